//! Going to the background with a readiness pipe.
//!
//! [`daemonize`] forks while the process still has a single thread (before the tokio runtime,
//! logging or any store exists). The parent blocks on a pipe until the child reports: `ok`
//! (exit 0, print nothing) or an error message (print it, exit 1); if the child dies first, the
//! parent says so. The child starts a new session, moves to `/`, builds everything, mounts, and
//! then reports through [`Readiness`]; after `ok` its stdin/stdout/stderr point at `/dev/null`.
//! Until then the child still writes to the caller's stderr, so startup notices reach the user.
//!
//! Under systemd (a `Type=notify` unit, `bucketfs mount -f`), [`notify_systemd`] says when the
//! mount is ready, so that `systemctl start` fails when the mount does and units ordered after
//! it start once it is there.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

const OK: &str = "ok\n";
const ERR: &str = "error: ";

/// The child's end of the readiness pipe.
pub struct Readiness {
    pipe: File,
}

/// Forks. Returns in the child only; the parent waits for the child's report and exits.
///
/// Must be called before any thread is started.
pub fn daemonize() -> Result<Readiness, String> {
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(format!("pipe: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: pipe2 succeeded, so both descriptors are open and owned by nobody else.
    let (rd, wr) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: the process is single-threaded here (the caller's contract), so the child may
    // run arbitrary code after fork.
    match unsafe { libc::fork() } {
        -1 => Err(format!("fork: {}", std::io::Error::last_os_error())),
        0 => {
            drop(rd);
            // SAFETY: plain syscalls without memory arguments (chdir gets a C string literal).
            unsafe {
                libc::setsid();
                libc::chdir(c"/".as_ptr());
            }
            Ok(Readiness {
                pipe: File::from(wr),
            })
        }
        pid => {
            drop(wr);
            std::process::exit(wait_for_child(File::from(rd), pid));
        }
    }
}

/// The parent's side: relays the child's report; returns the exit code.
fn wait_for_child(mut pipe: File, pid: libc::pid_t) -> i32 {
    let mut msg = String::new();
    let _ = pipe.read_to_string(&mut msg);
    if msg == OK {
        return 0;
    }
    if let Some(err) = msg.strip_prefix(ERR) {
        eprintln!("bucketfs: {}", err.trim_end());
        return 1;
    }
    // The child exited (or crashed) without reporting.
    let mut status = 0;
    // SAFETY: `status` is a valid out pointer; `pid` is our child.
    let r = unsafe { libc::waitpid(pid, &mut status, 0) };
    let how = if r == pid && libc::WIFSIGNALED(status) {
        format!("was killed by signal {}", libc::WTERMSIG(status))
    } else if r == pid && libc::WIFEXITED(status) {
        format!("exited with status {}", libc::WEXITSTATUS(status))
    } else {
        "exited".to_string()
    };
    eprintln!("bucketfs: the mount process {how} before the mount was ready");
    1
}

impl Readiness {
    /// Tells the parent the mount is ready, then detaches from the terminal's stdio.
    pub fn ready(mut self) {
        let _ = self.pipe.write_all(OK.as_bytes());
        drop(self.pipe);
        redirect_stdio_to_null();
    }

    /// Tells the parent startup failed with `msg` (one line, printed as `bucketfs: msg`).
    pub fn failed(mut self, msg: &str) {
        let line = msg.replace('\n', " ");
        let _ = self.pipe.write_all(format!("{ERR}{line}\n").as_bytes());
    }
}

fn redirect_stdio_to_null() {
    if let Ok(null) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
    {
        for fd in 0..3 {
            // SAFETY: dup2 onto the standard descriptors; `null` stays open during the calls.
            unsafe {
                libc::dup2(null.as_raw_fd(), fd);
            }
        }
    }
}

/// Sends `state` (`READY=1`) to systemd when it started this process as a `Type=notify`
/// service (`$NOTIFY_SOCKET` set); nothing otherwise.
pub fn notify_systemd(state: &str) {
    if let Some(socket) = std::env::var_os("NOTIFY_SOCKET") {
        if let Err(e) = notify_to(&socket, state) {
            tracing::warn!("cannot tell systemd {state}: {e}");
        }
    }
}

/// Sends `state` to the notify socket `socket`: a path, or an abstract name (`@name`).
fn notify_to(socket: &std::ffi::OsStr, state: &str) -> std::io::Result<()> {
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::net::{SocketAddr, UnixDatagram};
    let sock = UnixDatagram::unbound()?;
    let name = socket.as_bytes();
    let addr = match name.strip_prefix(b"@") {
        Some(abs) => SocketAddr::from_abstract_name(abs)?,
        None => SocketAddr::from_pathname(std::path::Path::new(socket))?,
    };
    sock.send_to_addr(state.as_bytes(), &addr).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn systemd_is_told_at_a_path_and_an_abstract_name() {
        use std::os::linux::net::SocketAddrExt;
        use std::os::unix::net::{SocketAddr, UnixDatagram};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let server = UnixDatagram::bind(&path).unwrap();
        notify_to(path.as_os_str(), "READY=1").unwrap();
        let mut buf = [0u8; 64];
        let n = server.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1");
        let name = format!("bucketfs-test-{}", std::process::id());
        let server =
            UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap())
                .unwrap();
        notify_to(std::ffi::OsStr::new(&format!("@{name}")), "STOPPING=1").unwrap();
        let n = server.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"STOPPING=1");
    }
}
