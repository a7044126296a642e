//! Mounting and unmounting: mount options, the background FUSE session, readahead tuning.
//!
//! [`mount`] mounts with `default_permissions` (the kernel checks modes, so no `access` calls),
//! `nosuid,nodev`, optional `allow_other`/`ro`, and never `auto_unmount` (the CLI unmounts after
//! publishing open files). It serves requests on `n_threads` FUSE threads, each reading its own
//! cloned `/dev/fuse` descriptor, and afterwards raises the mount's readahead to 1 MiB through
//! `/sys/class/bdi/<major:minor>/read_ahead_kb` (the kernel caps the readahead negotiated at
//! `init` at 128 KiB). The device number comes from `/proc/self/mountinfo` rather than from
//! `stat(mountpoint)`, so tuning needs no FUSE round trip.

use crate::adapter::FuseFs;
use bucketfs_fs::Fs;
use fuser::{BackgroundSession, MountOption, SessionACL};
use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use tokio::runtime::Handle;
use tokio::sync::watch;
use tracing::{debug, info, warn};

/// Readahead written to the mount's bdi after mounting, in KiB.
const READ_AHEAD_KB: u32 = 1024;

/// How to mount.
#[derive(Debug, Clone)]
pub struct MountOptions {
    /// What `mount`/`df` show as the source, e.g. `s3://bucket/prefix`.
    pub fsname: String,
    /// Let users other than the one mounting use the mount (needs `user_allow_other` in
    /// `/etc/fuse.conf` when not root).
    pub allow_other: bool,
    /// With `allow_other` off: let root use the mount too, besides its owner (FUSE
    /// `allow_root`; the kernel admits everyone, requests of other users get `EACCES`).
    pub allow_root: bool,
    /// Mount read-only (the kernel refuses writes with `EROFS`).
    pub read_only: bool,
    /// The kernel refuses to execute files of the mount (`noexec`).
    pub no_exec: bool,
    /// FUSE request threads (each with its own cloned `/dev/fuse` descriptor); at least 1.
    pub n_threads: usize,
    /// Let the kernel read files the data cache holds whole itself (FUSE passthrough), when
    /// it can. Off by default: its open rules are not POSIX (see docs/SEMANTICS.md).
    pub passthrough: bool,
}

impl Default for MountOptions {
    fn default() -> Self {
        Self {
            fsname: "bucketfs".into(),
            allow_other: false,
            allow_root: false,
            read_only: false,
            no_exec: false,
            n_threads: 4,
            passthrough: false,
        }
    }
}

/// A live mount. Dropping it unmounts (without waiting); [`MountHandle::unmount`] unmounts and
/// waits for the FUSE threads to finish.
pub struct MountHandle {
    session: Option<BackgroundSession>,
    mountpoint: PathBuf,
    /// The kernel's id of this mount, when mountinfo showed it: an unmount by path acts only
    /// while this mount is the one on top there.
    mount_id: Option<u64>,
    done: watch::Receiver<bool>,
}

impl std::fmt::Debug for MountHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MountHandle")
            .field("mountpoint", &self.mountpoint)
            .field("unmounted", &self.is_unmounted())
            .finish()
    }
}

/// Mounts `fs` at `mountpoint`; requests run as tasks on `rt`. Returns once the kernel has
/// completed the FUSE handshake, so the mount is usable when this returns.
///
/// Call it from a thread that is not a worker of `rt` (it blocks during the handshake).
pub fn mount(
    fs: Arc<Fs>,
    rt: Handle,
    mountpoint: &Path,
    opts: &MountOptions,
) -> io::Result<MountHandle> {
    let (tx, rx) = watch::channel(false);
    let adapter = FuseFs::new(fs, rt, tx, opts.passthrough);

    // The subtype makes the type `fuse.bucketfs` in mount(8) and df -T. fuser hands its
    // Subtype option to fusermount only; mounting as root it calls mount(2) itself, so there
    // the kernel gets it as a plain option.
    let subtype = if is_root() {
        MountOption::CUSTOM("subtype=bucketfs".into())
    } else {
        MountOption::Subtype("bucketfs".into())
    };
    let mut options = vec![
        MountOption::FSName(opts.fsname.clone()),
        subtype,
        MountOption::DefaultPermissions,
        MountOption::NoSuid,
        MountOption::NoDev,
    ];
    if opts.read_only {
        options.push(MountOption::RO);
    }
    if opts.no_exec {
        options.push(MountOption::NoExec);
    }
    let mut cfg = fuser::Config::default();
    cfg.mount_options = options;
    cfg.acl = if opts.allow_other {
        SessionACL::All
    } else if opts.allow_root {
        SessionACL::RootAndOwner
    } else {
        SessionACL::Owner
    };
    cfg.n_threads = Some(opts.n_threads.max(1));
    cfg.clone_fd = true;
    bucketfs_fs::set_fuse_threads(opts.n_threads.max(1));

    // A link to the directory: the mount goes where it points (fuser canonicalizes it), and
    // the unmount and /proc/self/mountinfo must name that place, not the link (fusermount
    // refused to unmount the link, and the daemon exited as if signalled twice).
    let mountpoint = match std::fs::read_link(mountpoint) {
        Ok(_) => mountpoint.canonicalize()?,
        Err(_) => absolute(mountpoint),
    };
    let notifier = adapter.notifier_slot();
    let mount_id = adapter.mount_id_slot();
    let session = fuser::spawn_mount(adapter, &mountpoint, &cfg)?;
    let _ = notifier.set(session.notifier());
    let id = mount_info(&mountpoint)
        .filter(MountInfo::is_fuse)
        .map(|m| m.id);
    if let Some(id) = id {
        let _ = mount_id.set(id);
    }
    info!(
        "mounted {} at {} ({} FUSE threads{}{})",
        opts.fsname,
        mountpoint.display(),
        opts.n_threads.max(1),
        if opts.read_only { ", read-only" } else { "" },
        if opts.allow_other {
            ", allow_other"
        } else {
            ""
        },
    );
    raise_readahead(&mountpoint);
    Ok(MountHandle {
        session: Some(session),
        mountpoint,
        mount_id: id,
        done: rx,
    })
}

impl MountHandle {
    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// Whether the FUSE session has ended (the kernel dropped the mount).
    pub fn is_unmounted(&self) -> bool {
        *self.done.borrow()
    }

    /// Resolves when the FUSE session ends: an external `umount`/`fusermount3 -u`, or
    /// [`MountHandle::unmount`] from another task.
    pub async fn unmounted(&self) {
        let mut rx = self.done.clone();
        // An error means the sender is gone, which also means the session ended.
        let _ = rx.wait_for(|done| *done).await;
    }

    /// Unmounts and waits for the FUSE threads to exit. A busy mount point (a process has its
    /// cwd or a file open in it) is detached lazily; the threads then keep serving the
    /// remaining users and this waits until they are gone.
    ///
    /// Only this mount is unmounted: another one on top of it at the same path (stacked, or
    /// made there after this one was detached) is left alone (see [`MountHandle::place`]).
    pub fn unmount(mut self) -> io::Result<()> {
        let Some(session) = self.session.take() else {
            return Ok(());
        };
        if !self.is_unmounted() {
            match self.place() {
                Place::Top => self.unmount_top()?,
                Place::Covered => {
                    warn!(
                        "{}: another file system is mounted over this one: not unmounting \
                         the path, which would unmount that one; this mount's connection \
                         ends with the daemon, leaving it to answer ENOTCONN under the other \
                         (unmount the path twice to clear both)",
                        self.mountpoint.display()
                    );
                    return let_go(session, self.mount_id);
                }
                Place::Detached => info!(
                    "{} was detached already: waiting for its last user",
                    self.mountpoint.display()
                ),
            }
        }
        match join_leaving_the_path(session) {
            Ok(()) => {}
            // The kernel aborts the connection when a lazily detached mount finally goes
            // away: that is the end we asked for, not a failure.
            Err(e) if e.raw_os_error() == Some(libc::ECONNABORTED) => {}
            Err(e) => return Err(e),
        }
        info!("unmounted {}", self.mountpoint.display());
        Ok(())
    }

    /// Unmounts the path, this mount being on top there: lazily when busy.
    fn unmount_top(&self) -> io::Result<()> {
        match unmount_path(&self.mountpoint, false) {
            Ok(()) => Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                warn!(
                    "{} is busy: detaching it lazily; it goes away when its last user does",
                    self.mountpoint.display()
                );
                unmount_path(&self.mountpoint, true)
            }
            // Not mounted any more: someone unmounted it while we were getting here.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(()),
            Err(_) if self.is_unmounted() => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Where this mount stands at its path, per /proc/self/mountinfo.
    fn place(&self) -> Place {
        let Some(id) = self.mount_id else {
            // Never seen in mountinfo (it could not be read): the path is all there is.
            return Place::Top;
        };
        let Ok(text) = std::fs::read_to_string("/proc/self/mountinfo") else {
            return Place::Top;
        };
        let mounts: Vec<MountInfo> = text.lines().filter_map(parse_mountinfo_line).collect();
        let top = mounts
            .iter()
            .rev()
            .find(|m| m.mountpoint == self.mountpoint);
        if top.is_some_and(|m| m.id == id) {
            Place::Top
        } else if mounts.iter().any(|m| m.id == id) {
            Place::Covered
        } else {
            Place::Detached
        }
    }

    /// Blocks until the kernel drops the mount (someone else unmounts it).
    pub fn join(mut self) -> io::Result<()> {
        match self.session.take() {
            Some(s) => s.join(),
            None => Ok(()),
        }
    }
}

impl Drop for MountHandle {
    fn drop(&mut self) {
        if let Some(session) = self.session.take() {
            if self.is_unmounted() {
                return;
            }
            if self.place() != Place::Top {
                // fuser's own unmount on drop goes by path too.
                let _ = let_go(session, self.mount_id);
                return;
            }
            if let Err(e) = unmount_path(&self.mountpoint, false) {
                if e.raw_os_error() != Some(libc::EINVAL) {
                    debug!("unmount {}: {e}", self.mountpoint.display());
                }
            }
            drop(session);
        }
    }
}

/// Joins the FUSE session's thread, without fuser's unmount when the session is dropped: that
/// unmounts the path once more after the session ended (its check of the device takes an
/// ended connection, `POLLERR`, for a live one), removing whatever is mounted there by then.
/// The session's device and record of the mount are left to the process's exit.
fn join_leaving_the_path(mut session: BackgroundSession) -> io::Result<()> {
    let Ok(ended) = std::thread::Builder::new().spawn(|| Ok(())) else {
        return session.join();
    };
    let guard = std::mem::replace(&mut session.guard, ended);
    std::mem::forget(session);
    guard
        .join()
        .map_err(|_| io::Error::other("the FUSE session's thread panicked"))?
}

/// Where a mount stands at its mount point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    /// The topmost mount there: unmounting the path unmounts it.
    Top,
    /// Still mounted, under another mount at the same path.
    Covered,
    /// Detached (`umount -l`), still serving processes that had files open in it.
    Detached,
}

/// Ends a FUSE session without unmounting by path (which would unmount the mount on top of
/// this one): the connection is aborted through fusectl when it can be (its mount stays,
/// answering `ENOTCONN`, for whoever unmounts it), else the session is left to end when the
/// process exits and the kernel closes its device.
fn let_go(session: BackgroundSession, mount_id: Option<u64>) -> io::Result<()> {
    let dev = mount_id.and_then(|id| {
        let text = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
        let m = text
            .lines()
            .filter_map(parse_mountinfo_line)
            .find(|m| m.id == id)?;
        let (major, minor) = m.dev.split_once(':')?;
        Some((major.parse::<u64>().ok()? << 20) | minor.parse::<u64>().ok()?)
    });
    let aborted = dev.is_some_and(|dev| {
        std::fs::write(format!("/sys/fs/fuse/connections/{dev}/abort"), "1").is_ok()
    });
    if aborted {
        let _ = join_leaving_the_path(session);
    } else {
        std::mem::forget(session);
    }
    Ok(())
}

/// Unmounts the mount at `mountpoint` (`lazy`: detach now, finish when no longer busy).
///
/// As root this is `umount2(2)`; otherwise (or if that is refused) `fusermount3 -u [-z]`, then
/// `fusermount -u [-z]`.
pub fn unmount_path(mountpoint: &Path, lazy: bool) -> io::Result<()> {
    let c = CString::new(mountpoint.as_os_str().as_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let flags = if lazy { libc::MNT_DETACH } else { 0 };
    // SAFETY: `c` is a valid NUL-terminated path.
    if unsafe { libc::umount2(c.as_ptr(), flags) } == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() != Some(libc::EPERM) {
        return Err(e);
    }
    fusermount_unmount(mountpoint, lazy)
}

fn fusermount_unmount(mountpoint: &Path, lazy: bool) -> io::Result<()> {
    for bin in ["fusermount3", "fusermount"] {
        let mut cmd = Command::new(bin);
        cmd.arg("-u");
        if lazy {
            cmd.arg("-z");
        }
        cmd.arg("--").arg(mountpoint);
        match cmd.output() {
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
            Ok(out) if out.status.success() => return Ok(()),
            Ok(out) => {
                let msg = String::from_utf8_lossy(&out.stderr);
                let msg = msg.trim().replace('\n', "; ");
                return Err(if msg.contains("Device or resource busy") {
                    io::Error::from_raw_os_error(libc::EBUSY)
                } else {
                    io::Error::other(format!("{bin}: {msg}"))
                });
            }
        }
    }
    Err(io::Error::new(
        io::ErrorKind::NotFound,
        "fusermount3 not found (install fuse3)",
    ))
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// One line of `/proc/self/mountinfo`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountInfo {
    /// The kernel's id of the mount (`mnt_id` in /proc/PID/fdinfo).
    pub id: u64,
    /// `major:minor` of the mounted file system.
    pub dev: String,
    pub mountpoint: PathBuf,
    /// e.g. `fuse`, `fuse.bucketfs`, `ext4`.
    pub fstype: String,
    pub source: String,
}

impl MountInfo {
    pub fn is_fuse(&self) -> bool {
        self.fstype == "fuse" || self.fstype.starts_with("fuse.")
    }
}

/// Decodes the octal escapes (`\040` for space, ...) of a mountinfo field.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = (b[i + 1] - b'0') as u32 * 64
                + (b[i + 2] - b'0') as u32 * 8
                + (b[i + 3] - b'0') as u32;
            out.push(v as u8);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn parse_mountinfo_line(line: &str) -> Option<MountInfo> {
    let mut parts = line.split(" - ");
    let left: Vec<&str> = parts.next()?.split(' ').collect();
    let right: Vec<&str> = parts.next()?.split(' ').collect();
    Some(MountInfo {
        id: left.first()?.parse().ok()?,
        dev: left.get(2)?.to_string(),
        mountpoint: PathBuf::from(unescape(left.get(4)?)),
        fstype: right.first()?.to_string(),
        source: unescape(right.get(1).unwrap_or(&"")),
    })
}

/// The topmost mount at `mountpoint` (an absolute path), from `/proc/self/mountinfo`.
pub fn mount_info(mountpoint: &Path) -> Option<MountInfo> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let want = absolute(mountpoint);
    text.lines()
        .rev()
        .filter_map(parse_mountinfo_line)
        .find(|m| m.mountpoint == want)
}

/// `p` made absolute without touching the file system at `p` itself (which may be a dead FUSE
/// mount that fails every `stat`): the parent is canonicalized, the last component kept.
pub fn absolute(p: &Path) -> PathBuf {
    let abs = if p.is_absolute() {
        p.to_path_buf()
    } else {
        std::env::current_dir().unwrap_or_default().join(p)
    };
    // Normalize `.` and `..` lexically, then resolve symlinks in the parent.
    let mut norm = PathBuf::new();
    for c in abs.components() {
        match c {
            Component::ParentDir => {
                norm.pop();
            }
            Component::CurDir => {}
            c => norm.push(c),
        }
    }
    match (norm.parent(), norm.file_name()) {
        (Some(parent), Some(name)) => match parent.canonicalize() {
            Ok(p) => p.join(name),
            Err(_) => norm,
        },
        _ => norm,
    }
}

fn raise_readahead(mountpoint: &Path) {
    let Some(info) = mount_info(mountpoint) else {
        debug!(
            "readahead: {} not found in /proc/self/mountinfo",
            mountpoint.display()
        );
        return;
    };
    let path = format!("/sys/class/bdi/{}/read_ahead_kb", info.dev);
    match std::fs::write(&path, format!("{READ_AHEAD_KB}\n")) {
        Ok(()) => debug!("readahead: {path} = {READ_AHEAD_KB}"),
        Err(e) => debug!("readahead: cannot write {path}: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_lines() {
        let l = "52 27 0:45 / /tmp/a\\040b rw,nosuid,nodev,relatime shared:30 - fuse s3://bkt/p rw,user_id=0,group_id=0,default_permissions";
        let m = parse_mountinfo_line(l).unwrap();
        assert_eq!(m.id, 52);
        assert_eq!(m.dev, "0:45");
        assert_eq!(m.mountpoint, PathBuf::from("/tmp/a b"));
        assert_eq!(m.fstype, "fuse");
        assert_eq!(m.source, "s3://bkt/p");
        assert!(m.is_fuse());
        assert_eq!(unescape("a\\134b\\011"), "a\\b\t");
    }

    #[test]
    fn absolute_paths() {
        assert_eq!(absolute(Path::new("/")), PathBuf::from("/"));
        let cwd = std::env::current_dir().unwrap().canonicalize().unwrap();
        assert_eq!(absolute(Path::new("x/../y")), cwd.join("y"));
    }
}
