//! Pods' bind mounts of a dead daemon's mount, replaced by the new mount.
//!
//! A pod's container does not use the target itself but a bind mount of it, made in the
//! container's mount namespace when the container started. When the daemon dies and the
//! driver mounts the target again, that bind still shows the dead mount (`ENOTCONN`). So,
//! after a remount, the driver looks in every mount namespace of the node (it sees the
//! host's processes with `hostPID`) for mounts of the dead file system, and in each replaces
//! it by a copy of the new mount (`open_tree` of the target, then, in that namespace, a
//! detach of the dead one and `move_mount` of the copy). Files the pod had open on the dead
//! mount stay dead; new opens work.
//!
//! Only what can be replaced safely is: a bind of the whole volume (a `subPath` bind names a
//! directory the bucket's content chooses, which may be a symlink by now), with nothing
//! mounted below it (a detach would take it away), seen by a process at its namespace's root.
//! The copy gets the old mount's `ro`, `nosuid`, `nodev` and `noexec`, and is private unless
//! the old one was shared. Anything else is logged and left dead: its pod must restart.

use std::collections::HashSet;
use std::ffi::CString;
use std::fs::{self, File};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;
use tracing::{info, warn};

const OPEN_TREE_CLONE: libc::c_uint = 1;
const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x4;
const MOUNT_ATTR_RDONLY: u64 = 0x1;
const MOUNT_ATTR_NOSUID: u64 = 0x2;
const MOUNT_ATTR_NODEV: u64 = 0x4;
const MOUNT_ATTR_NOEXEC: u64 = 0x8;

/// `struct mount_attr` of mount_setattr(2).
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

/// The dead file system at a target, held open: while it is, its device number (`MAJ:MIN`)
/// names it and no other (a freed one could be given to the next mount, another volume's).
pub struct Dead {
    dev: String,
    _held: File,
}

impl Dead {
    /// Holds the file system mounted at `target` (before the driver detaches it).
    pub fn hold(target: &Path) -> Option<Dead> {
        use std::os::unix::fs::OpenOptionsExt;
        // O_PATH: no open of the (dead) file system's root, just a reference to it.
        let held = fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_PATH | libc::O_NOFOLLOW)
            .open(target)
            .ok()?;
        let dev = crate::mounts::mount_at(target)?.dev;
        Some(Dead { dev, _held: held })
    }
}

/// [`replace_dead_binds`] now, then again 1, 4 and 14 s later on a thread of its own (holding
/// `dead`), while `target` still holds the mount there now: a namespace the first pass
/// missed (its process starting, its mounts changing at that moment) gets the new mount too.
/// A later pass finds nothing left to replace in the namespaces done.
pub fn repair_binds(dead: Dead, target: PathBuf) {
    replace_dead_binds(&dead, &target);
    let Some(now) = crate::mounts::mount_at(&target).map(|m| m.dev) else {
        return;
    };
    let spawned = std::thread::Builder::new()
        .name("bind-repair".into())
        .spawn(move || {
            for wait in [1, 3, 10] {
                std::thread::sleep(Duration::from_secs(wait));
                if crate::mounts::mount_at(&target).map(|m| m.dev).as_ref() != Some(&now) {
                    return;
                }
                replace_dead_binds(&dead, &target);
            }
        });
    if let Err(e) = spawned {
        warn!("cannot start the repeated repair of pods' binds: {e}");
    }
}

/// Replaces, in every other mount namespace, each mount of the dead file system `dead` by a
/// copy of what is mounted at `target` now (the same subdirectory of it, for a bind of a
/// subdirectory). Returns how many it replaced.
fn replace_dead_binds(dead: &Dead, target: &Path) -> usize {
    let dead = dead.dev.as_str();
    let own = fs::read_link("/proc/self/ns/mnt").ok();
    let mut seen = HashSet::new();
    let mut replaced = 0;
    let Ok(procs) = fs::read_dir("/proc") else {
        return 0;
    };
    for e in procs.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(ns) = fs::read_link(format!("/proc/{pid}/ns/mnt")) else {
            continue;
        };
        if Some(&ns) == own.as_ref() || seen.contains(&ns) {
            continue;
        }
        // Mount points in its mountinfo are seen from its root: only a process at the root
        // of its namespace names them as the namespace does (a chroot'ed one does not).
        if fs::read_link(format!("/proc/{pid}/root")).ok().as_deref() != Some(Path::new("/")) {
            continue;
        }
        // The namespace held before its mountinfo is read, and checked after: a pid reused
        // meanwhile by a process of another namespace is skipped.
        let Ok(ns_file) = File::open(format!("/proc/{pid}/ns/mnt")) else {
            continue;
        };
        let Ok(text) = fs::read_to_string(format!("/proc/{pid}/mountinfo")) else {
            continue;
        };
        if fs::read_link(format!("/proc/{pid}/ns/mnt")).ok().as_ref() != Some(&ns) {
            continue;
        }
        seen.insert(ns);
        let lines: Vec<Vec<&str>> = text.lines().map(|l| l.split(' ').collect()).collect();
        for f in &lines {
            if f.len() < 7 || f[2] != dead {
                continue;
            }
            let (root, point) = (crate::mounts::unescape(f[3]), crate::mounts::unescape(f[4]));
            if Path::new(&point) == target {
                // The target itself as the host sees it: a fence the new mount stacks on.
                continue;
            }
            let why_not = if root != "/" {
                Some("it is a bind of a subdirectory (subPath)")
            } else if lines.iter().any(|c| c.len() > 1 && c[1] == f[0]) {
                Some("something is mounted below it")
            } else {
                None
            };
            if let Some(why) = why_not {
                warn!("left the dead mount at {point} (process {pid}'s namespace): {why}; its pod must restart");
                continue;
            }
            let attrs = copy_attrs(f);
            match replace_in(&ns_file, target, &point, &attrs) {
                Ok(()) => {
                    replaced += 1;
                    info!(
                        "replaced the dead mount at {point} (process {pid}'s namespace) by {}",
                        target.display()
                    );
                }
                Err(e) => warn!("replacing the dead mount at {point} of process {pid}: {e}"),
            }
        }
    }
    replaced
}

/// The attributes a copy replacing the mount of mountinfo line `f` gets: its per-mount
/// flags (field 6), and private propagation unless it was shared (optional fields).
fn copy_attrs(f: &[&str]) -> MountAttr {
    let mut set = 0;
    for o in f[5].split(',') {
        set |= match o {
            "ro" => MOUNT_ATTR_RDONLY,
            "nosuid" => MOUNT_ATTR_NOSUID,
            "nodev" => MOUNT_ATTR_NODEV,
            "noexec" => MOUNT_ATTR_NOEXEC,
            _ => 0,
        };
    }
    let optional = f[6..].iter().take_while(|o| **o != "-");
    let shared = optional.clone().any(|o| o.starts_with("shared:"));
    MountAttr {
        attr_set: set,
        attr_clr: 0,
        propagation: if shared { 0 } else { libc::MS_PRIVATE },
        userns_fd: 0,
    }
}

/// In the mount namespace `ns`: detach what is at `point`, attach a copy of `source` there
/// with `attrs`.
fn replace_in(ns: &File, source: &Path, point: &str, attrs: &MountAttr) -> io::Result<()> {
    let src = CString::new(source.as_os_str().as_bytes())?;
    let dst = CString::new(point)?;
    // SAFETY: plain syscall; the returned descriptor is owned below.
    let tree = unsafe {
        libc::syscall(
            libc::SYS_open_tree,
            libc::AT_FDCWD,
            src.as_ptr(),
            OPEN_TREE_CLONE | libc::O_CLOEXEC as libc::c_uint,
        )
    };
    if tree < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor open_tree just returned.
    let tree = unsafe { OwnedFd::from_raw_fd(tree as i32) };
    // SAFETY: plain syscall on the descriptor above and a struct of the size given.
    let r = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            attrs as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    let ns = ns.try_clone()?;
    let mut cmd = Command::new("/bin/true");
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // SAFETY: setns, umount2, syscall and _exit only, on data made before the fork.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNS) != 0 {
                libc::_exit(10);
            }
            // The dead mount: a detach does not ask its (gone) daemon anything.
            libc::umount2(dst.as_ptr(), libc::MNT_DETACH);
            let r = libc::syscall(
                libc::SYS_move_mount,
                tree.as_raw_fd(),
                c"".as_ptr(),
                libc::AT_FDCWD,
                dst.as_ptr(),
                MOVE_MOUNT_F_EMPTY_PATH,
            );
            libc::_exit(if r == 0 { 0 } else { 11 })
        });
    }
    let status = cmd.status()?;
    match status.code() {
        Some(0) => Ok(()),
        Some(10) => Err(io::Error::other("cannot enter its mount namespace")),
        _ => Err(io::Error::other(format!("move_mount failed ({status})"))),
    }
}
