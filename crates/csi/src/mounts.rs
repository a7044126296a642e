//! The node's mounts: one `bucketfs mount -f` daemon per published target, and a record of
//! each in the state directory.
//!
//! Daemons run where [`crate::launch`] puts them: outside the driver's container when it can
//! (systemd services or PID 1's cgroups and mount namespace), so that they outlive the driver
//! and its container. A restarted driver reads the records, adopts the mounts that are live
//! (in /proc/self/mountinfo, daemon alive) and mounts again those whose daemon died (and
//! [`crate::repair`] gives pods' binds of the dead mount the new one).
//!
//! Layout of the state directory (0700):
//!   mounts/ID.toml   the record (volume, target, source, arguments, daemon pid), no secrets
//!   mounts/ID.cred   the credentials, 0600, handed to the daemon as its config file (never
//!                    on its command line); kept while mounted so a dead daemon can be remounted
//!   logs/ID.log      the daemon's log (stderr of `bucketfs mount -f`)
//!   bin/             the copies of the binary daemons run outside the container
//!   daemon/          the daemons' own state directory (upload journals)
//!   cache/VOLUME/    the data cache of a volume with `dataCacheSize`
//! ID is a hash of the target path.

use crate::attrs::Credentials;
use crate::launch::{self, Kind, Launcher};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fs::{self, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::{info, warn};

/// How often the driver looks for daemons that died (OOM kill, crash) to mount them again.
pub const HEAL_INTERVAL: Duration = Duration::from_secs(5);

/// How long a daemon may take to mount (it checks the bucket first).
const MOUNT_TIMEOUT: Duration = Duration::from_secs(60);
/// Time a daemon has after a clean unmount to store what it holds, even past the unpublish
/// deadline, before it is killed.
const DAEMON_GRACE: Duration = Duration::from_secs(30);

/// What the driver remembers of one published target.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Record {
    pub volume_id: String,
    pub target: PathBuf,
    pub source: String,
    pub args: Vec<String>,
    /// The daemon. Checked against /proc/PID/cmdline before it is trusted (pids are reused).
    pub pid: i32,
    pub has_credentials: bool,
}

impl Record {
    /// Two publishes of a target are the same when they mount the same thing the same way.
    pub fn same_mount(&self, other: &Record) -> bool {
        self.volume_id == other.volume_id && self.source == other.source && self.args == other.args
    }
}

/// Why a publish or unpublish failed, mapped to a gRPC code by the node service.
#[derive(Debug)]
pub enum MountError {
    /// The target is in use by another volume or mount.
    AlreadyExists(String),
    /// The daemon refused the mount (bad bucket, credentials, option).
    Mount(String),
    /// Still busy (open files, uploads): the caller should retry.
    Busy(String),
    Internal(String),
}

pub struct Mounts {
    state: PathBuf,
    launcher: Launcher,
    unpublish_timeout: Duration,
    /// One lock per target: a publish and an unpublish of one target must not mix, and a
    /// slow one (a stalled store) must not hold up the other targets.
    locks: std::sync::Mutex<HashMap<PathBuf, Arc<tokio::sync::Mutex<()>>>>,
    /// When the pending unpublish of a target began: the kubelet retries a call that gave
    /// up, and the escalation's deadline counts from the first.
    unpublishing: std::sync::Mutex<HashMap<PathBuf, Instant>>,
    /// Targets whose daemon died and whose remount failed: tried again later, their record
    /// and credentials kept (the kubelet never publishes a mounted volume again).
    remounts: std::sync::Mutex<HashMap<PathBuf, Remount>>,
}

/// A remount that failed, to be tried again.
struct Remount {
    /// The dead file system the pods' binds still show, for when the remount works.
    dead: Option<crate::repair::Dead>,
    /// The fence standing in meanwhile (see [`fence`]), which containers restarted since
    /// show: their binds get the new mount too.
    fence: Option<crate::repair::Dead>,
    failures: u32,
    next: Instant,
}

/// The longest wait between two tries of a remount that fails.
const REMOUNT_BACKOFF_MAX: Duration = Duration::from_secs(300);

/// What [`Mounts::start`] leaves after a daemon that did not mount.
#[derive(Clone, Copy, PartialEq, Eq)]
enum OnFailure {
    /// Nothing: the record, the credentials and the target directory go (a publish; the
    /// kubelet calls again).
    Forget,
    /// The record, credentials and target stay, for the next try (a remount).
    Keep,
}

/// Creates `p` 0700, and makes it 0700 if it was there already (a hostPath the kubelet made
/// 0755, say): it holds credentials files.
fn private_dir(p: &Path) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(p)
        .and_then(|_| fs::set_permissions(p, fs::Permissions::from_mode(0o700)))
        .map_err(|e| format!("{}: {e}", p.display()))
}

/// FNV-1a: a stable short name for a path (file names, not security).
pub(crate) fn id_of(s: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in s.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// What /proc/self/mountinfo says of the mount on top at a mount point.
pub struct MountEntry {
    /// The file system's device number, `MAJ:MIN`.
    pub dev: String,
    pub fstype: String,
    pub source: String,
}

impl MountEntry {
    /// Whether this is the driver's fence (see [`fence`]).
    fn is_fence(&self) -> bool {
        self.fstype == "tmpfs" && self.source == FENCE_SOURCE
    }
}

/// The source name of the driver's fences (see [`fence`]).
const FENCE_SOURCE: &str = "bucketfs-fence";

/// Mounts a fence at `target` unless one is on top there: an empty, read-only file system that
/// stands in for the volume while its daemon is dead and not mounted again yet. A pod's
/// container restarting meanwhile binds that, not the bare directory, whose writes would go
/// to the node's disk (never to the bucket, and the remount would then find the target not
/// empty). The remount stacks the daemon's mount on it; unpublish removes both.
fn fence(target: &Path) {
    use std::os::unix::ffi::OsStrExt;
    if mount_at(target).is_some_and(|m| m.is_fence()) {
        return;
    }
    let (Ok(src), Ok(dst), Ok(fstype), Ok(opts)) = (
        std::ffi::CString::new(FENCE_SOURCE),
        std::ffi::CString::new(target.as_os_str().as_bytes()),
        std::ffi::CString::new("tmpfs"),
        std::ffi::CString::new("size=4k,nr_inodes=1,mode=0555"),
    ) else {
        return;
    };
    let flags = libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    // SAFETY: NUL-terminated strings that live across the call.
    let r = unsafe {
        libc::mount(
            src.as_ptr(),
            dst.as_ptr(),
            fstype.as_ptr(),
            flags,
            opts.as_ptr().cast(),
        )
    };
    if r != 0 {
        warn!(
            "cannot fence {} while its volume is mounted again ({}): a pod starting meanwhile \
             sees the bare directory",
            target.display(),
            std::io::Error::last_os_error()
        );
    }
}

/// Removes the fences at `target` (see [`fence`]), once nothing of bucketfs is above them.
fn remove_fences(target: &Path) {
    while mount_at(target).is_some_and(|m| m.is_fence()) {
        if umount2(target, libc::MNT_DETACH).is_err() {
            break;
        }
    }
}

/// The entry of /proc/self/mountinfo whose mount point is `target` (the last one wins:
/// that is the mount on top).
pub fn mount_at(target: &Path) -> Option<MountEntry> {
    let text = fs::read_to_string("/proc/self/mountinfo").ok()?;
    let want = target.to_string_lossy();
    text.lines().rev().find_map(|line| {
        let f: Vec<&str> = line.split(' ').collect();
        let sep = f.iter().position(|x| *x == "-")?;
        (unescape(f.get(4)?) == want).then(|| {
            Some(MountEntry {
                dev: f.get(2)?.to_string(),
                fstype: f.get(sep + 1)?.to_string(),
                source: unescape(f.get(sep + 2)?),
            })
        })?
    })
}

/// The file system type mounted on top at `target`.
pub fn mounted_fstype(target: &Path) -> Option<String> {
    mount_at(target).map(|m| m.fstype)
}

/// mountinfo escapes space, tab, newline and backslash as octal.
pub(crate) fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(u8::is_ascii_digit) {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn is_fuse(fstype: &str) -> bool {
    fstype == "fuse" || fstype.starts_with("fuse.")
}

/// Whether `pid` is a live (not zombie) bucketfs daemon for `target`: its command line
/// names the target, and it runs as the driver's user (the daemons it starts do), so that
/// another user's process naming the target cannot pass for the daemon of a dead mount and
/// keep it from being mounted again.
pub fn daemon_alive(pid: i32, target: &Path) -> bool {
    if pid <= 0 {
        return false;
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    if effective_uid(pid) != Some(unsafe { libc::geteuid() }) {
        return false;
    }
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The state follows the parenthesized command name, which may itself hold spaces.
    let state = stat
        .rsplit(')')
        .next()
        .and_then(|r| r.split_whitespace().next());
    if matches!(state, None | Some("Z") | Some("X")) {
        return false;
    }
    let cmdline = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let want = target.as_os_str().as_encoded_bytes();
    cmdline.split(|b| *b == 0).any(|a| a == want)
}

/// The effective uid of process `pid`, from /proc.
fn effective_uid(pid: i32) -> Option<u32> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let uids = status.lines().find_map(|l| l.strip_prefix("Uid:"))?;
    uids.split_whitespace().nth(1)?.parse().ok()
}

/// The live daemon of `r`: its recorded pid, or the daemon /proc shows for its target (one
/// systemd started, or one recorded before its pid was known).
fn live_pid(r: &Record) -> Option<i32> {
    if daemon_alive(r.pid, &r.target) {
        return Some(r.pid);
    }
    launch::find_daemon(&r.target)
}

/// How long process `pid` has run, from /proc (its start in clock ticks after boot).
fn process_age(pid: i32) -> Option<Duration> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Field 22, counted after the parenthesized command name (field 2).
    let start: u64 = stat
        .rsplit(')')
        .next()?
        .split_whitespace()
        .nth(19)?
        .parse()
        .ok()?;
    let uptime: f64 = fs::read_to_string("/proc/uptime")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Some(Duration::from_secs_f64(
        (uptime - start as f64 / hz).max(0.0),
    ))
}

/// Daemons this driver started and has not reaped yet.
static CHILDREN: std::sync::Mutex<Vec<i32>> = std::sync::Mutex::new(Vec::new());

/// Reaps the daemons this driver started once they exit. Only those pids: a wait for any
/// child would steal the exit status of the fusermount3 runs.
pub fn start_reaper() {
    std::thread::Builder::new()
        .name("reaper".into())
        .spawn(|| loop {
            std::thread::sleep(Duration::from_millis(200));
            CHILDREN
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .retain(|&pid| {
                    let mut status = 0;
                    // SAFETY: plain syscall with a valid out pointer.
                    unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) == 0 }
                });
        })
        .expect("spawn reaper thread");
}

impl Mounts {
    pub fn open(cfg: &crate::Config) -> Result<Mounts, String> {
        for d in ["", "mounts", "logs", "daemon", "cache"] {
            private_dir(&cfg.state_dir.join(d))?;
        }
        Ok(Mounts {
            state: cfg.state_dir.clone(),
            launcher: Launcher::new(cfg.daemons, cfg.host_pid, &cfg.bucketfs, &cfg.state_dir)?,
            unpublish_timeout: cfg.unpublish_timeout,
            locks: Default::default(),
            unpublishing: Default::default(),
            remounts: Default::default(),
        })
    }

    /// The lock of `target`'s operations.
    fn lock_of(&self, target: &Path) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = self.locks.lock().unwrap_or_else(|e| e.into_inner());
        // Drop the locks nobody holds or waits for (the map's is the only reference).
        locks.retain(|_, l| Arc::strong_count(l) > 1);
        locks.entry(target.to_path_buf()).or_default().clone()
    }

    fn record_path(&self, target: &Path) -> PathBuf {
        self.state
            .join("mounts")
            .join(format!("{}.toml", id_of(&target.to_string_lossy())))
    }

    fn cred_path(&self, target: &Path) -> PathBuf {
        self.record_path(target).with_extension("cred")
    }

    fn log_path(&self, target: &Path) -> PathBuf {
        self.state
            .join("logs")
            .join(format!("{}.log", id_of(&target.to_string_lossy())))
    }

    pub fn cache_dir(&self, volume_id: &str) -> PathBuf {
        self.state.join("cache").join(id_of(volume_id))
    }

    pub fn daemon_state_dir(&self) -> PathBuf {
        self.state.join("daemon")
    }

    fn load(&self, target: &Path) -> Option<Record> {
        let text = fs::read_to_string(self.record_path(target)).ok()?;
        toml::from_str::<Record>(&text)
            .ok()
            .filter(|r| r.target == target)
    }

    fn save(&self, r: &Record) -> Result<(), String> {
        let p = self.record_path(&r.target);
        let tmp = p.with_extension("tmp");
        let text = toml::to_string(r).map_err(|e| e.to_string())?;
        fs::write(&tmp, text)
            .and_then(|_| fs::rename(&tmp, &p))
            .map_err(|e| format!("{}: {e}", p.display()))
    }

    fn forget(&self, target: &Path) {
        self.remount_lock().remove(target);
        for p in [
            self.record_path(target),
            self.cred_path(target),
            self.log_path(target),
        ] {
            let _ = fs::remove_file(p);
        }
    }

    /// Mounts `want` at its target, or does nothing when the same mount is already there.
    pub async fn publish(&self, want: Record, creds: &Credentials) -> Result<(), MountError> {
        let lock = self.lock_of(&want.target);
        let _g = lock.lock().await;
        let target = want.target.clone();
        let top = mount_at(&target);
        // A fence (a remount still to do) stands for no mount: the daemon stacks over it,
        // and the binds of it that containers restarted meanwhile get the new mount.
        let fenced = top
            .as_ref()
            .is_some_and(MountEntry::is_fence)
            .then(|| crate::repair::Dead::hold(&target))
            .flatten();
        let fstype = top.filter(|m| !m.is_fence()).map(|m| m.fstype);
        // The remount under way there (its dead mount, which pods' binds still show, and its
        // fence): this publish does it, and leaves it to go on if it fails too.
        let pending = fenced
            .as_ref()
            .and_then(|_| self.remount_lock().remove(&target));
        // The file system of a dead daemon this publish replaces.
        let mut dead = None;
        let mut starting = None;
        if let Some(have) = self.load(&target) {
            if !have.same_mount(&want) {
                return Err(MountError::AlreadyExists(format!(
                    "{} is published already with other arguments (volume {})",
                    target.display(),
                    have.volume_id
                )));
            }
            if fstype.as_deref().is_some_and(is_fuse) {
                if let Some(pid) = live_pid(&have) {
                    if pid != have.pid {
                        let _ = self.save(&Record { pid, ..have });
                    }
                    return Ok(());
                }
            }
            if fstype.is_none() {
                // Its daemon still starting (a publish cut off by the kubelet's deadline or a
                // driver restart while the daemon checked a slow bucket): waited for. A second
                // one started over it mounted on top, or, as a systemd unit of the same name,
                // failed and took the record with it.
                starting = live_pid(&have).map(|pid| Record { pid, ..have });
            }
            if let Some(t) = fstype.as_deref().filter(|t| !is_fuse(t)) {
                // Not the daemon's: someone else's, to be left alone (as unpublish does).
                return Err(MountError::AlreadyExists(format!(
                    "{} has a {t} mount over it that this driver did not make",
                    target.display()
                )));
            }
            // Same volume, daemon gone: clear the dead mount and mount again.
            if fstype.is_some() {
                dead = crate::repair::Dead::hold(&target);
                detach(&target);
            }
        } else if let Some(t) = fstype {
            return Err(MountError::AlreadyExists(format!(
                "{} is already a mount point ({t}) this driver did not make",
                target.display()
            )));
        }
        let this = Record {
            has_credentials: !creds.is_empty(),
            ..want
        };
        let on_failure = match pending {
            Some(_) => OnFailure::Keep,
            None => OnFailure::Forget,
        };
        let adopted = match starting {
            Some(r) => self.await_adopted(&r).await,
            None => Ok(false),
        };
        let still_running = adopted.is_err();
        let r = match adopted {
            Ok(true) => Ok(()),
            Ok(false) => match self.write_credentials(&target, creds) {
                Ok(()) => self.start(this, on_failure).await,
                Err(e) => Err(MountError::Internal(e)),
            },
            Err(e) => Err(e),
        };
        if r.is_err() {
            match pending {
                // A daemon of the volume still runs: its record and credentials stay.
                None if still_running => {}
                // The remount goes on trying, as before this publish.
                Some(p) => {
                    self.remount_lock().insert(
                        target.clone(),
                        Remount {
                            fence: p.fence.or(fenced),
                            ..p
                        },
                    );
                }
                // No credentials file (nor record) outlives a publish that failed anywhere.
                None => self.forget(&target),
            }
        } else {
            let (pending_dead, pending_fence) = pending.map_or((None, None), |p| (p.dead, p.fence));
            for d in [dead, fenced, pending_dead, pending_fence]
                .into_iter()
                .flatten()
            {
                crate::repair::repair_binds(d, target.clone());
            }
            // An unpublish given up on before this publish starts its deadline afresh.
            self.unpublishing
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&target);
        }
        r
    }

    fn write_credentials(&self, target: &Path, creds: &Credentials) -> Result<(), String> {
        let p = self.cred_path(target);
        let _ = fs::remove_file(&p);
        if creds.is_empty() {
            return Ok(());
        }
        #[derive(Serialize)]
        struct File<'a> {
            access_key_id: Option<&'a str>,
            secret_access_key: Option<&'a str>,
            session_token: Option<&'a str>,
        }
        let text = toml::to_string(&File {
            access_key_id: creds.access_key_id.as_deref(),
            secret_access_key: creds.secret_access_key.as_deref(),
            session_token: creds.session_token.as_deref(),
        })
        .map_err(|e| e.to_string())?;
        // create_new with 0600: the secret is never readable by anyone else, not even briefly.
        OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&p)
            .and_then(|mut f| f.write_all(text.as_bytes()))
            .map_err(|e| format!("{}: {e}", p.display()))
    }

    /// Starts the daemon for `r` and waits until its mount shows in mountinfo.
    async fn start(&self, mut r: Record, on_failure: OnFailure) -> Result<(), MountError> {
        let target = r.target.clone();
        let id = id_of(&target.to_string_lossy());
        fs::create_dir_all(&target)
            .map_err(|e| MountError::Internal(format!("{}: {e}", target.display())))?;
        if self.launcher.kind != Kind::Child {
            // The daemon mounts in the host's mount namespace: the kubelet's directory must
            // be the host's (a hostPath at the same path).
            self.launcher
                .same_path_on_host(&target)
                .map_err(MountError::Internal)?;
        }
        let log_path = self.log_path(&target);
        let log_len = fs::metadata(&log_path).map(|m| m.len()).unwrap_or(0);
        let mut argv: Vec<std::ffi::OsString> = vec![
            "mount".into(),
            "-f".into(),
            r.source.clone().into(),
            target.clone().into(),
        ];
        argv.extend(r.args.iter().map(Into::into));
        if mount_at(&target).is_some_and(|m| m.is_fence()) {
            // A remount: over the fence that stands in for the volume meanwhile.
            argv.push("--allow-stacking".into());
        }
        if r.has_credentials {
            argv.push("-c".into());
            argv.push(self.cred_path(&target).into());
        }
        let spawned = self
            .launcher
            .spawn(&id, &argv, &log_path)
            .map_err(MountError::Internal)?;
        if let Some(pid) = spawned.pid {
            r.pid = pid;
            // The reaper thread collects it; the driver never waits for it.
            CHILDREN.lock().unwrap_or_else(|e| e.into_inner()).push(pid);
        }
        // Recorded before the mount shows: a driver that dies meanwhile leaves its successor
        // a record to adopt the daemon by. Without one (a full state disk) the daemon is
        // stopped: mounted and in no record, it would make the target refused for good.
        if let Err(e) = self.save(&r) {
            if r.pid != 0 {
                // SAFETY: plain syscall on the daemon just started.
                unsafe { libc::kill(r.pid, libc::SIGKILL) };
            } else {
                self.launcher.kill_unit(&id);
            }
            return Err(MountError::Internal(e));
        }
        self.await_mount(r, log_len, on_failure).await
    }

    /// Waits for the live daemon of `r`, which this call did not start (a publish the kubelet
    /// gave up on, or one from before a driver restart), to mount its target: true once it
    /// has, false once it has exited (a new one is then started). Never kills it: a daemon
    /// without its mount may be storing the files of an unmount (an unpublish cut off, a
    /// `umount -l`) rather than starting, and killing it would lose them. One older than
    /// [`MOUNT_TIMEOUT`] (a start gives up by then), or whose target an unpublish is under
    /// way for, is not starting: `UNAVAILABLE` at once, as for a starting one not mounted in
    /// time; the kubelet tries again.
    async fn await_adopted(&self, r: &Record) -> Result<bool, MountError> {
        let target = &r.target;
        let unpublishing = self
            .unpublishing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(target);
        let started = Instant::now();
        loop {
            if mounted_fstype(target).as_deref().is_some_and(is_fuse) {
                let _ = self.save(r);
                self.remount_lock().remove(target);
                info!(
                    "mounted {} at {} (daemon pid {}, started by an earlier publish)",
                    r.source,
                    target.display(),
                    r.pid
                );
                return Ok(true);
            }
            if !daemon_alive(r.pid, target) {
                return Ok(false);
            }
            // Its age from /proc, and this wait's own (a container's uptime may not be the
            // host's, and a wrong age must not make the wait endless).
            let age = process_age(r.pid)
                .unwrap_or(MOUNT_TIMEOUT)
                .max(started.elapsed());
            if unpublishing || age >= MOUNT_TIMEOUT {
                return Err(MountError::Busy(format!(
                    "the daemon of {} (pid {}) runs without its mount (starting, or storing \
                     the files of an unmount); retry once it has mounted or exited",
                    target.display(),
                    r.pid
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until the daemon of `r` (started, its log `log_len` bytes long before) mounts
    /// its target; kills it when it is not mounted within [`MOUNT_TIMEOUT`].
    async fn await_mount(
        &self,
        mut r: Record,
        log_len: u64,
        on_failure: OnFailure,
    ) -> Result<(), MountError> {
        let target = r.target.clone();
        let log_path = self.log_path(&target);
        let started = Instant::now();
        loop {
            if r.pid == 0 {
                // Started by systemd: its pid shows in /proc.
                r.pid = launch::find_daemon(&target).unwrap_or(0);
                if r.pid != 0 {
                    if let Err(e) = self.save(&r) {
                        // SAFETY: plain syscall on the daemon just found (see above).
                        unsafe { libc::kill(r.pid, libc::SIGKILL) };
                        return Err(MountError::Internal(e));
                    }
                }
            }
            let mounted = mounted_fstype(&target).as_deref().is_some_and(is_fuse);
            if mounted && r.pid != 0 {
                // A remount that failed before is over.
                self.remount_lock().remove(&target);
                info!(
                    "mounted {} at {} (daemon pid {})",
                    r.source,
                    target.display(),
                    r.pid
                );
                return Ok(());
            }
            // Systemd has 10 s to show the daemon it started.
            let dead = (r.pid != 0 && !daemon_alive(r.pid, &target))
                || (r.pid == 0 && started.elapsed() > Duration::from_secs(10));
            if dead || started.elapsed() > MOUNT_TIMEOUT {
                if r.pid != 0 {
                    // SAFETY: plain syscall on the daemon just started (or already gone).
                    unsafe { libc::kill(r.pid, libc::SIGKILL) };
                } else {
                    self.launcher.kill_unit(&id_of(&target.to_string_lossy()));
                }
                let why = fs::read(&log_path)
                    .map(|b| {
                        String::from_utf8_lossy(&b[(log_len as usize).min(b.len())..]).into_owned()
                    })
                    .unwrap_or_default();
                let why = why
                    .trim()
                    .lines()
                    .last()
                    .unwrap_or("no message")
                    .to_string();
                if mounted {
                    detach(&target);
                }
                if on_failure == OnFailure::Forget {
                    self.forget(&target);
                    let _ = fs::remove_dir(&target);
                }
                return Err(MountError::Mount(format!(
                    "mounting {} at {} failed: {why}",
                    r.source,
                    target.display()
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Unmounts the target, waits for its daemon to store what was written and exit, and
    /// removes the target directory. A target that is not mounted is fine.
    ///
    /// Bounded: once `unpublish_timeout` has passed since the first unpublish of the target
    /// (the kubelet retries the ones that answered UNAVAILABLE), a mount still busy is
    /// detached and a daemon still running (hung, or its store unreachable) is killed; what
    /// it had not stored is lost, and the call succeeds.
    pub async fn unpublish(&self, target: &Path) -> Result<(), MountError> {
        let lock = self.lock_of(target);
        let _g = lock.lock().await;
        let deadline = *self
            .unpublishing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(target.to_path_buf())
            .or_insert_with(Instant::now)
            + self.unpublish_timeout;
        let rec = self.load(target);
        let pid = rec.as_ref().and_then(live_pid).unwrap_or(0);
        let mut unmounted_now = false;
        // A fence on top: the remount that would have stacked on it has not yet.
        remove_fences(target);
        if let Some(t) = mounted_fstype(target) {
            // Another FUSE file system with no record of this driver's is not its either
            // (one of bucketfs's may be: a record lost, its dead mount to clear).
            if !is_fuse(&t) || (rec.is_none() && t != "fuse.bucketfs") {
                return Err(MountError::Internal(format!(
                    "{} is a {t} mount, not bucketfs",
                    target.display()
                )));
            }
            if !daemon_alive(pid, target) {
                // A dead daemon leaves ENOTCONN behind: only a detach clears it.
                detach(target);
            } else if let Err(e) = unmount(target).inspect(|()| unmounted_now = true) {
                if Instant::now() < deadline {
                    return Err(MountError::Busy(format!(
                        "{e}; retry (after {:?} the mount is detached and its daemon killed)",
                        self.unpublish_timeout
                    )));
                }
                warn!(
                    "{} still busy after {:?}: detaching it",
                    target.display(),
                    self.unpublish_timeout
                );
                detach(target);
            }
        }
        // The daemon exits once it has stored every file still being written. Killed only
        // once the deadline has passed and, when this call unmounted it cleanly, it had
        // DAEMON_GRACE since (a mount busy until just before the deadline leaves it uploads
        // to finish; a detached one is the last resort, its daemon likely hung).
        let kill_at = match unmounted_now {
            true => deadline.max(Instant::now() + DAEMON_GRACE),
            false => deadline,
        };
        while daemon_alive(pid, target) {
            if Instant::now() >= kill_at {
                warn!(
                    "the daemon of {} (pid {pid}) has not exited {:?} after the first \
                     unpublish and {DAEMON_GRACE:?} after the unmount: killing it (files it \
                     had not stored are lost)",
                    target.display(),
                    self.unpublish_timeout
                );
                // SAFETY: plain syscall; daemon_alive checked that the pid is this target's.
                unsafe { libc::kill(pid, libc::SIGKILL) };
                let killed = Instant::now();
                while daemon_alive(pid, target) && killed.elapsed() < Duration::from_secs(5) {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                if mounted_fstype(target).is_some() {
                    detach(target);
                }
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // The fence a remount stacked on.
        remove_fences(target);
        match fs::remove_dir(target) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(MountError::Internal(format!("{}: {e}", target.display()))),
        }
        if rec.is_some() {
            info!("unmounted {}", target.display());
        }
        self.forget(target);
        self.unpublishing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(target);
        Ok(())
    }

    /// At startup and then every [`HEAL_INTERVAL`]: adopts the live mounts of the records,
    /// remounts those whose daemon died while their target is still there, forgets the rest.
    /// Skips targets with an operation under way (their lock is held), so a daemon exiting
    /// during an unpublish is never mistaken for a dead one.
    pub async fn recover(self: &Arc<Self>, startup: bool) {
        let Ok(dir) = fs::read_dir(self.state.join("mounts")) else {
            return;
        };
        let records: Vec<Record> = dir
            .flatten()
            .filter(|e| e.path().extension().is_some_and(|x| x == "toml"))
            .filter_map(|e| toml::from_str(&fs::read_to_string(e.path()).ok()?).ok())
            .collect();
        for r in records {
            let lock = self.lock_of(&r.target);
            let Ok(held) = lock.try_lock_owned() else {
                continue;
            };
            // Read again under the lock: an unpublish may have just removed it.
            if self.load(&r.target).as_ref() != Some(&r) {
                continue;
            }
            // Nor is a volume being unpublished mounted again (its pod is leaving: a new
            // daemon would hold its credentials for nothing); the next unpublish call
            // clears what is left.
            if self
                .unpublishing
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .contains_key(&r.target)
            {
                continue;
            }
            let top = mount_at(&r.target);
            let fenced = top.as_ref().is_some_and(MountEntry::is_fence);
            // The fence of a remount still to do stands for no mount.
            let fstype = top.filter(|m| !m.is_fence()).map(|m| m.fstype);
            let live = live_pid(&r);
            if let Some(pid) = live.filter(|p| *p != r.pid) {
                let _ = self.save(&Record { pid, ..r.clone() });
            }
            let alive = live.is_some();
            if alive {
                // Its daemon runs (a late start, or adopted): no remount to try again.
                self.remount_lock().remove(&r.target);
            }
            if alive && fstype.as_deref().is_some_and(is_fuse) {
                if startup {
                    info!(
                        "adopted the mount of {} at {} (daemon pid {})",
                        r.source,
                        r.target.display(),
                        live.unwrap_or(r.pid)
                    );
                }
                continue;
            }
            if alive {
                // Unmounted but still storing files: unpublish waits for it.
                continue;
            }
            if fstype.is_none() && !fenced && !r.target.is_dir() {
                self.forget(&r.target);
                continue;
            }
            if fstype.as_deref().is_some_and(|t| !is_fuse(t)) {
                // Another file system mounted over the target: not ours to detach (a
                // remount would, and then put the bucket in place of that one in pods).
                if startup {
                    warn!(
                        "{} has a {} mount over it that this driver did not make: not \
                         mounting {} again there",
                        r.target.display(),
                        fstype.as_deref().unwrap_or_default(),
                        r.source
                    );
                }
                continue;
            }
            let taken = self.remount_lock().remove(&r.target);
            let earlier = match taken {
                Some(e) if Instant::now() < e.next => {
                    self.remount_lock().insert(r.target.clone(), e);
                    continue;
                }
                e => e,
            };
            // On a task of its own, holding the target's lock: a remount can take up to
            // MOUNT_TIMEOUT, and the other targets' must not wait for it.
            let this = self.clone();
            tokio::spawn(async move {
                let _held = held;
                this.remount(r, fstype.is_some(), earlier).await;
            });
        }
    }

    /// Mounts `r` again after its daemon died; `dead_mounted`: its dead mount is still at the
    /// target. `earlier`: the failed tries before this one.
    async fn remount(&self, r: Record, dead_mounted: bool, earlier: Option<Remount>) {
        let failures = earlier.as_ref().map_or(0, |e| e.failures);
        warn!(
            "the daemon of {} at {} is gone; mounting again{}",
            r.source,
            r.target.display(),
            if failures > 0 {
                format!(" (try {})", failures + 1)
            } else {
                String::new()
            }
        );
        // The file system the pods' binds show: the one at the target now, else the one an
        // earlier try detached.
        let (earlier_dead, earlier_fence) = earlier.map_or((None, None), |e| (e.dead, e.fence));
        let dead = dead_mounted
            .then(|| crate::repair::Dead::hold(&r.target))
            .flatten()
            .or(earlier_dead);
        if dead_mounted {
            detach(&r.target);
        }
        fence(&r.target);
        let fence = earlier_fence.or_else(|| {
            mount_at(&r.target)
                .is_some_and(|m| m.is_fence())
                .then(|| crate::repair::Dead::hold(&r.target))
                .flatten()
        });
        match self.start(r.clone(), OnFailure::Keep).await {
            Ok(()) => {
                // Pods' binds of the dead mount, and of the fence (containers restarted
                // meanwhile), get the new one.
                for d in [dead, fence].into_iter().flatten() {
                    crate::repair::repair_binds(d, r.target.clone());
                }
            }
            Err(e) => {
                // A store or DNS outage at the wrong moment must not leave the pod's volume
                // dead for good: tried again, less often as it keeps failing.
                let wait = HEAL_INTERVAL
                    .saturating_mul(1 << failures.min(6))
                    .min(REMOUNT_BACKOFF_MAX);
                warn!("{e}; trying again in {} s", wait.as_secs());
                self.remount_lock().insert(
                    r.target.clone(),
                    Remount {
                        dead,
                        fence,
                        failures: failures + 1,
                        next: Instant::now() + wait,
                    },
                );
            }
        }
    }

    fn remount_lock(&self) -> std::sync::MutexGuard<'_, HashMap<PathBuf, Remount>> {
        self.remounts.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Unmounts `target` (the driver is root: umount2, which neither runs a helper nor asks the
/// daemon, so a hung daemon cannot hang it). Fails when the mount is busy.
fn unmount(target: &Path) -> Result<(), String> {
    umount2(target, 0).map_err(|e| format!("cannot unmount {}: {e}", target.display()))
}

/// Detaches the mount at `target` (MNT_DETACH): it leaves the tree at once; open files keep
/// the file system until they close.
fn detach(target: &Path) {
    if let Err(e) = umount2(target, libc::MNT_DETACH) {
        warn!("detaching {}: {e}", target.display());
    }
}

fn umount2(target: &Path, flags: libc::c_int) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(target.as_os_str().as_bytes())?;
    // SAFETY: a NUL-terminated path that lives across the call.
    if unsafe { libc::umount2(c.as_ptr(), flags | libc::UMOUNT_NOFOLLOW) } == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    if mounted_fstype(target).is_none() {
        return Ok(());
    }
    // Not root (tests of the driver as a user): the setuid helper.
    if e.raw_os_error() == Some(libc::EPERM) {
        let lazy = if flags & libc::MNT_DETACH != 0 {
            "-uz"
        } else {
            "-u"
        };
        if Command::new("fusermount3")
            .arg(lazy)
            .arg(target)
            .output()
            .is_ok_and(|o| o.status.success())
        {
            return Ok(());
        }
    }
    Err(e)
}

impl std::fmt::Display for MountError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MountError::AlreadyExists(m)
            | MountError::Mount(m)
            | MountError::Busy(m)
            | MountError::Internal(m) => f.write_str(m),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_names_are_unescaped() {
        assert_eq!(unescape("/a\\040b\\134c"), "/a b\\c");
        assert_eq!(id_of("/x"), id_of("/x"));
        assert_ne!(id_of("/x"), id_of("/y"));
    }

    /// A process of another user whose command line is a daemon's for a target (anyone can
    /// start one) is no daemon: it kept a dead mount from being mounted again.
    #[test]
    fn another_users_process_is_no_daemon() {
        use std::os::unix::process::CommandExt;
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("target");
        // `bucketfs mount TARGET`, as /proc shows it: sh running a script named `mount`.
        fs::write(dir.path().join("mount"), "sleep 30\n").unwrap();
        for (p, mode) in [
            (dir.path().to_path_buf(), 0o755),
            (dir.path().join("mount"), 0o644),
        ] {
            use std::os::unix::fs::PermissionsExt;
            fs::set_permissions(p, fs::Permissions::from_mode(mode)).unwrap();
        }
        let spawn = |uid: u32| {
            let mut c = Command::new("sh");
            c.arg0("bucketfs").arg("mount").arg(&target);
            c.current_dir(dir.path()).uid(uid);
            c.spawn().unwrap()
        };
        let mut other = spawn(65534);
        // SAFETY: geteuid has no preconditions and cannot fail.
        let mut own = spawn(unsafe { libc::geteuid() });
        std::thread::sleep(Duration::from_millis(300));
        let other_alive = daemon_alive(other.id() as i32, &target);
        let own_alive = daemon_alive(own.id() as i32, &target);
        let found = launch::find_daemon(&target);
        for c in [&mut other, &mut own] {
            let _ = c.kill();
            let _ = c.wait();
        }
        assert!(!other_alive, "another user's process passed for the daemon");
        assert!(own_alive, "the driver's own daemon was not recognised");
        assert_eq!(found, Some(own.id() as i32));
    }
}
