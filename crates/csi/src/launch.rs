//! Where the mount daemons run, so that they outlive the node plugin's container.
//!
//! In a cluster the driver runs in a container: when that container stops (a crash, an OOM
//! kill, a DaemonSet update), the runtime kills every process of its cgroup, and the kernel
//! every process of its PID namespace. A daemon that is the driver's child dies with it, and
//! every pod using it sees `ENOTCONN`. So, with `hostPID: true`, the daemons leave:
//!
//! - [`Kind::Systemd`] (hosts whose PID 1 is systemd): each daemon is a transient service
//!   `bucketfs-csi-ID.service` that the host's systemd starts (`systemd-run`, run in the
//!   host's mount namespace), as Mountpoint-s3's CSI driver v1 does. Nothing of the container
//!   is in its ancestry, cgroup or namespaces.
//! - [`Kind::Host`] (other hosts): the driver forks the daemon, which enters the host's mount
//!   and cgroup namespaces (PID 1's) and moves itself into PID 1's cgroups before it runs.
//! - [`Kind::Child`]: a child of the driver in a session of its own (outside containers, or
//!   without `hostPID`: then the daemons die with the container, and the driver says so).
//!
//! In the first two, the daemon runs a copy of the binary in `STATE_DIR/bin/` (a host
//! directory: the container's image may be gone while the daemon runs), and the state
//! directory and the targets must be at the same paths in the container and on the host.

use std::ffi::{CString, OsString};
use std::fs::{self, File};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use tracing::{info, warn};

/// `--daemons`: where the driver runs the mount daemons.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// systemd when the host's PID 1 is systemd, else host; child when the driver cannot
    /// reach the host (no `hostPID`, no privileges).
    Auto,
    Systemd,
    Host,
    Child,
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Mode, String> {
        match s {
            "auto" => Ok(Mode::Auto),
            "systemd" => Ok(Mode::Systemd),
            "host" => Ok(Mode::Host),
            "child" => Ok(Mode::Child),
            _ => Err(format!("{s}: expected auto, systemd, host or child")),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    Systemd,
    /// The `cgroup.procs` files (host paths) of PID 1's cgroups, one per hierarchy.
    Host(Vec<CString>),
    Child,
}

pub struct Launcher {
    pub kind: Kind,
    /// The binary the daemons run.
    pub bin: PathBuf,
    /// The process whose namespaces and cgroups are the host's: 1, the host's init (tests
    /// name another one).
    host: u32,
}

/// What a spawn left running: the daemon's pid when the driver started it itself.
pub struct Spawned {
    pub pid: Option<i32>,
}

impl Launcher {
    /// Picks where daemons run. `state` is the state directory (made already).
    pub fn new(mode: Mode, host: u32, bucketfs: &Path, state: &Path) -> Result<Launcher, String> {
        let child = Launcher {
            kind: Kind::Child,
            bin: bucketfs.to_path_buf(),
            host,
        };
        if mode == Mode::Child {
            return Ok(child);
        }
        match Launcher::outside(mode, host, bucketfs, state) {
            Ok(l) => Ok(l),
            Err(e) if mode == Mode::Auto => {
                warn!(
                    "the mount daemons run in this container and die with it: {e} \
                     (docs/kubernetes.md: hostPID and privileges)"
                );
                Ok(child)
            }
            Err(e) => Err(e),
        }
    }

    /// A launcher that starts daemons outside the driver's container.
    fn outside(mode: Mode, host: u32, bucketfs: &Path, state: &Path) -> Result<Launcher, String> {
        reach_host(host, state)?;
        let systemd =
            fs::read_to_string(format!("/proc/{host}/comm")).is_ok_and(|c| c.trim() == "systemd");
        let kind = match mode {
            Mode::Systemd => Kind::Systemd,
            Mode::Auto if systemd => Kind::Systemd,
            _ => Kind::Host(host_cgroups(host)?),
        };
        let bin = install_binary(bucketfs, &state.join("bin"))?;
        info!(
            "mount daemons run {} from {}",
            match kind {
                Kind::Systemd => "as transient systemd services of the host",
                _ => "in the host's cgroups and mount namespace",
            },
            bin.display()
        );
        Ok(Launcher { kind, bin, host })
    }

    /// The systemd unit of the daemon of record `id`.
    pub fn unit(id: &str) -> String {
        format!("bucketfs-csi-{id}.service")
    }

    /// Kills the systemd unit of record `id` (`systemctl kill --signal=SIGKILL`), for a
    /// daemon given up on before its pid showed: it must not mount later, in no record.
    /// Nothing for the other kinds, whose daemons are killed by pid.
    pub fn kill_unit(&self, id: &str) {
        if self.kind != Kind::Systemd {
            return;
        }
        let unit = Launcher::unit(id);
        let out = in_host_mount_ns(
            Command::new("systemctl").args(["kill", "--signal=SIGKILL", unit.as_str()]),
            self.host,
        )
        .and_then(|c| c.output());
        if let Err(e) = out {
            tracing::warn!("systemctl kill {unit}: {e}");
        }
    }

    /// Starts `bin argv...` with stdout and stderr to `log`, stdin /dev/null, only `PATH` in
    /// its environment. Never waits for it (a reaper thread collects children).
    pub fn spawn(&self, id: &str, argv: &[OsString], log: &Path) -> Result<Spawned, String> {
        let path =
            std::env::var_os("PATH").unwrap_or_else(|| "/usr/sbin:/usr/bin:/sbin:/bin".into());
        match &self.kind {
            Kind::Systemd => {
                let unit = Launcher::unit(id);
                // A failed unit of that name would refuse the new one.
                let _ = in_host_mount_ns(
                    Command::new("systemctl").args(["reset-failed", unit.as_str()]),
                    self.host,
                )
                .and_then(|c| c.output());
                let mut cmd = Command::new("systemd-run");
                cmd.args(systemd_run_args(&unit, &self.bin, argv, log))
                    .env_clear()
                    .env("PATH", &path);
                let out = in_host_mount_ns(&mut cmd, self.host)
                    .and_then(|c| c.output())
                    .map_err(|e| format!("systemd-run in the host's mount namespace: {e}"))?;
                if !out.status.success() {
                    return Err(format!(
                        "systemd-run {unit}: {}",
                        String::from_utf8_lossy(&out.stderr).trim()
                    ));
                }
                Ok(Spawned { pid: None })
            }
            kind => {
                let log_file = fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(log)
                    .map_err(|e| format!("{}: {e}", log.display()))?;
                let mut cmd = Command::new(&self.bin);
                cmd.args(argv)
                    // Nothing of the driver's environment: its credentials (AWS_*, a web
                    // identity token), RUST_LOG or BUCKETFS_* are not the volume's.
                    .env_clear()
                    .env("PATH", &path)
                    .stdin(Stdio::null())
                    .stdout(log_file.try_clone().map_err(|e| e.to_string())?)
                    .stderr(log_file)
                    .current_dir("/");
                match kind {
                    Kind::Host(procs) => leave_for_host(&mut cmd, self.host, procs.clone(), true)
                        .map_err(|e| format!("host namespaces: {e}"))?,
                    // SAFETY: setsid is async-signal-safe. A session of its own: no signal
                    // meant for the driver's process group or terminal reaches the daemon.
                    _ => unsafe {
                        cmd.pre_exec(|| {
                            libc::setsid();
                            Ok(())
                        });
                    },
                };
                let child = cmd
                    .spawn()
                    .map_err(|e| format!("{}: {e}", self.bin.display()))?;
                Ok(Spawned {
                    pid: Some(child.id() as i32),
                })
            }
        }
    }
}

/// The `systemd-run` arguments that start `bin argv...` as the transient service `unit`:
/// removed once it exits (even failed), its output appended to `log`.
fn systemd_run_args(unit: &str, bin: &Path, argv: &[OsString], log: &Path) -> Vec<OsString> {
    let mut a: Vec<OsString> = vec![
        format!("--unit={unit}").into(),
        "--description=bucketfs CSI volume".into(),
        "--collect".into(),
        "--quiet".into(),
        // Stopping the unit is an unmount: the daemon stores what is still being written.
        "--property=KillMode=mixed".into(),
        "--property=TimeoutStopSec=300".into(),
    ];
    for p in ["StandardOutput", "StandardError"] {
        let mut s = OsString::from(format!("--property={p}=append:"));
        s.push(log);
        a.push(s);
    }
    a.push("--".into());
    a.push(bin.into());
    a.extend(argv.iter().cloned());
    a
}

/// Checks that the driver can put daemons outside its container: it shares the host's PID
/// namespace (`hostPID`), may enter PID 1's mount and cgroup namespaces, and sees the state
/// directory at the host's path.
fn reach_host(host: u32, state: &Path) -> Result<(), String> {
    if std::process::id() == 1 {
        return Err("the driver is PID 1 of its PID namespace (no hostPID)".into());
    }
    let ns = |p: &str| fs::read_link(p).map_err(|e| format!("{p}: {e}"));
    if ns("/proc/self/ns/pid")? != ns(&format!("/proc/{host}/ns/pid"))? {
        return Err("the driver is not in the host's PID namespace (no hostPID)".into());
    }
    for p in [
        format!("/proc/{host}/ns/mnt"),
        format!("/proc/{host}/ns/cgroup"),
    ] {
        File::open(&p).map_err(|e| format!("{p}: {e}"))?;
    }
    same_path_on_host(host, state)
}

impl Launcher {
    /// `p` is the same directory in the driver's mount namespace and in the host's.
    pub fn same_path_on_host(&self, p: &Path) -> Result<(), String> {
        same_path_on_host(self.host, p)
    }
}

fn same_path_on_host(host: u32, p: &Path) -> Result<(), String> {
    let host = Path::new(&format!("/proc/{host}/root")).join(p.strip_prefix("/").unwrap_or(p));
    match (fs::metadata(p), fs::metadata(&host)) {
        (Ok(a), Ok(b)) if a.dev() == b.dev() && a.ino() == b.ino() => Ok(()),
        _ => Err(format!(
            "{} is not the host's directory of that path: mount it from the host at the same \
             path",
            p.display()
        )),
    }
}

/// Makes the child of `cmd` enter PID 1's cgroup and mount namespaces and, with `procs`,
/// move itself into PID 1's cgroups (the `cgroup.procs` files of the host's hierarchies)
/// before it runs. Then its working directory and stdin are the host's, and it has a session
/// of its own.
fn leave_for_host(
    cmd: &mut Command,
    host: u32,
    procs: Vec<CString>,
    setsid: bool,
) -> io::Result<()> {
    let cg = File::open(format!("/proc/{host}/ns/cgroup"))?;
    let mnt = File::open(format!("/proc/{host}/ns/mnt"))?;
    // SAFETY: only async-signal-safe calls (setns, open, write, close, chdir, dup2, setsid)
    // on data made before the fork.
    unsafe {
        cmd.pre_exec(move || {
            let fail = || Err(io::Error::last_os_error());
            if libc::setns(cg.as_raw_fd(), libc::CLONE_NEWCGROUP) != 0
                || libc::setns(mnt.as_raw_fd(), libc::CLONE_NEWNS) != 0
            {
                return fail();
            }
            for p in &procs {
                // "0": the writing process.
                let fd = libc::open(p.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 {
                    return fail();
                }
                let n = libc::write(fd, c"0".as_ptr().cast(), 1);
                libc::close(fd);
                if n != 1 {
                    return fail();
                }
            }
            // Hold nothing of the container's file systems.
            libc::chdir(c"/".as_ptr());
            let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY);
            if null >= 0 {
                libc::dup2(null, 0);
                libc::close(null);
            }
            if setsid {
                libc::setsid();
            }
            Ok(())
        });
    }
    Ok(())
}

fn in_host_mount_ns(cmd: &mut Command, host: u32) -> io::Result<&mut Command> {
    let mnt = File::open(format!("/proc/{host}/ns/mnt"))?;
    // SAFETY: setns is async-signal-safe; the descriptor is made before the fork.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(mnt.as_raw_fd(), libc::CLONE_NEWNS) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Ok(cmd)
}

/// The text of `file` read by a child that entered the host's namespaces (and, with
/// `procs`, PID 1's cgroups): what PID 1's cgroups are called on the host, and whether a
/// daemon would really land in them.
fn read_as_host(host: u32, file: &str, procs: Vec<CString>) -> Result<String, String> {
    let path = CString::new(file).map_err(|e| e.to_string())?;
    let mut cmd = Command::new("/bin/true");
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    leave_for_host(&mut cmd, host, procs, false).map_err(|e| e.to_string())?;
    // SAFETY: open, read, write and _exit only; the child copies the file to its stdout and
    // exits without running anything of the host's.
    unsafe {
        cmd.pre_exec(move || {
            let fd = libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
            if fd < 0 {
                libc::_exit(2);
            }
            let mut buf = [0u8; 4096];
            loop {
                let n = libc::read(fd, buf.as_mut_ptr().cast(), buf.len());
                if n <= 0 {
                    break;
                }
                if libc::write(1, buf.as_ptr().cast(), n as usize) != n {
                    libc::_exit(3);
                }
            }
            libc::_exit(0)
        });
    }
    let out = cmd
        .output()
        .map_err(|e| format!("entering the host's namespaces: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "entering the host's namespaces to read {file}: {}",
            out.status
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The `cgroup.procs` files of PID 1's cgroups in the host's view, checked by moving a
/// probe process into them.
fn host_cgroups(host: u32) -> Result<Vec<CString>, String> {
    let cgroups = read_as_host(host, &format!("/proc/{host}/cgroup"), Vec::new())?;
    let mountinfo = fs::read_to_string(format!("/proc/{host}/mountinfo"))
        .map_err(|e| format!("/proc/{host}/mountinfo: {e}"))?;
    let procs = cgroup_procs_files(&cgroups, &mountinfo)?;
    let moved = read_as_host(host, "/proc/self/cgroup", procs.clone())?;
    if moved.trim() != cgroups.trim() {
        return Err(format!(
            "a process moved into PID 1's cgroups is in\n{moved}instead of\n{cgroups}"
        ));
    }
    Ok(procs)
}

/// For each hierarchy of a `/proc/PID/cgroup` text, the `cgroup.procs` file of that cgroup
/// under the hierarchy's mount in `mountinfo`.
fn cgroup_procs_files(cgroups: &str, mountinfo: &str) -> Result<Vec<CString>, String> {
    struct CgMount<'a> {
        root: &'a str,
        point: String,
        v2: bool,
        opts: Vec<&'a str>,
    }
    let mounts: Vec<CgMount> = mountinfo
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            let sep = f.iter().position(|x| *x == "-")?;
            let fstype = *f.get(sep + 1)?;
            (fstype == "cgroup" || fstype == "cgroup2").then(|| CgMount {
                root: f[3],
                point: crate::mounts::unescape(f[4]),
                v2: fstype == "cgroup2",
                opts: f
                    .get(sep + 3)
                    .map(|o| o.split(',').collect())
                    .unwrap_or_default(),
            })
        })
        .collect();
    let mut files = Vec::new();
    for line in cgroups.lines().filter(|l| !l.is_empty()) {
        let mut it = line.splitn(3, ':');
        let (Some(_), Some(ctrls), Some(path)) = (it.next(), it.next(), it.next()) else {
            return Err(format!("unexpected cgroup line {line:?}"));
        };
        let m = mounts.iter().find(|m| {
            if ctrls.is_empty() {
                m.v2
            } else {
                !m.v2 && ctrls.split(',').all(|c| m.opts.contains(&c))
            }
        });
        // A hierarchy mounted nowhere cannot hold the container either.
        let Some(m) = m else { continue };
        let rel = if m.root == "/" {
            path
        } else {
            path.strip_prefix(m.root)
                .ok_or_else(|| format!("cgroup {path} is outside the mount of {} ", m.point))?
        };
        let file = format!(
            "{}/{}/cgroup.procs",
            m.point.trim_end_matches('/'),
            rel.trim_matches('/')
        )
        .replace("//", "/");
        files.push(CString::new(file).map_err(|e| e.to_string())?);
    }
    if files.is_empty() {
        return Err("no cgroup hierarchy of PID 1 is mounted on the host".into());
    }
    Ok(files)
}

/// Puts a copy of `bin` in `dir` (a host directory), named by version and identity of the
/// file; returns its path.
fn install_binary(bin: &Path, dir: &Path) -> Result<PathBuf, String> {
    let err = |p: &Path, e: io::Error| format!("{}: {e}", p.display());
    fs::create_dir_all(dir).map_err(|e| err(dir, e))?;
    let md = fs::metadata(bin).map_err(|e| err(bin, e))?;
    let stamp = format!(
        "{}:{}:{}:{}",
        md.len(),
        md.mtime(),
        md.mtime_nsec(),
        md.ino()
    );
    let dest = dir.join(format!(
        "bucketfs-{}-{}",
        env!("CARGO_PKG_VERSION"),
        crate::mounts::id_of(&stamp)
    ));
    // Older copies go: a daemon running one keeps its inode (remounts use the new one).
    for e in fs::read_dir(dir).map_err(|e| err(dir, e))?.flatten() {
        if e.path() != dest {
            let _ = fs::remove_file(e.path());
        }
    }
    if fs::metadata(&dest).is_ok_and(|d| d.len() == md.len()) {
        return Ok(dest);
    }
    let tmp = dest.with_extension("tmp");
    let _ = fs::remove_file(&tmp);
    // A hard link where it can (same file system), else a copy.
    fs::hard_link(bin, &tmp)
        .or_else(|_| fs::copy(bin, &tmp).map(|_| ()))
        .and_then(|_| fs::set_permissions(&tmp, fs::Permissions::from_mode(0o755)))
        .and_then(|_| fs::rename(&tmp, &dest))
        .map_err(|e| err(&dest, e))?;
    Ok(dest)
}

/// The pid of the live bucketfs daemon whose command line mounts at `target` (systemd
/// starts it: the driver learns its pid from /proc).
pub fn find_daemon(target: &Path) -> Option<i32> {
    let want = target.as_os_str().as_bytes();
    fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: i32 = e.file_name().to_str()?.parse().ok()?;
        let cmd = fs::read(e.path().join("cmdline")).ok()?;
        let args: Vec<&[u8]> = cmd.split(|b| *b == 0).collect();
        let is_bucketfs = Path::new(std::ffi::OsStr::from_bytes(args.first()?))
            .file_name()
            .is_some_and(|n| n.as_bytes().starts_with(b"bucketfs"));
        (is_bucketfs
            && args.get(1) == Some(&&b"mount"[..])
            && args.contains(&want)
            && crate::mounts::daemon_alive(pid, target))
        .then_some(pid)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cgroup_files_of_v1_v2_and_hybrid_hierarchies() {
        let mountinfo = "\
31 23 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct
40 31 0:37 / /sys/fs/cgroup/systemd rw - cgroup cgroup rw,xattr,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw
42 31 0:39 /sub /mnt/x rw - cgroup cgroup rw,memory";
        let got = cgroup_procs_files(
            "9:name=systemd:/init.scope\n2:cpu,cpuacct:/\n4:memory:/sub/a\n0::/init.scope\n\
             7:pids:/\n",
            mountinfo,
        )
        .unwrap();
        let got: Vec<&str> = got.iter().map(|c| c.to_str().unwrap()).collect();
        assert_eq!(
            got,
            [
                "/sys/fs/cgroup/systemd/init.scope/cgroup.procs",
                "/sys/fs/cgroup/cpu,cpuacct/cgroup.procs",
                "/mnt/x/a/cgroup.procs",
                "/sys/fs/cgroup/unified/init.scope/cgroup.procs",
            ]
        );
    }

    #[test]
    fn systemd_units_append_to_the_log_and_are_collected() {
        let a = systemd_run_args(
            &Launcher::unit("00ff"),
            Path::new("/var/lib/bucketfs/csi/bin/bucketfs-1"),
            &["mount".into(), "-f".into()],
            Path::new("/var/lib/bucketfs/csi/logs/00ff.log"),
        );
        let a: Vec<&str> = a.iter().map(|s| s.to_str().unwrap()).collect();
        assert_eq!(a[0], "--unit=bucketfs-csi-00ff.service");
        assert!(a.contains(&"--collect"));
        assert!(a.contains(&"--property=StandardError=append:/var/lib/bucketfs/csi/logs/00ff.log"));
        let dash = a.iter().position(|x| *x == "--").unwrap();
        assert_eq!(
            &a[dash + 1..],
            ["/var/lib/bucketfs/csi/bin/bucketfs-1", "mount", "-f"]
        );
    }
}
