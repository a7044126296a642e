//! `bucketfs mount`: startup checks, building the store and fs, mounting, and the run loop.
//!
//! Order matters: settings and every check that needs no runtime run first, in the calling
//! process, so plain mistakes fail before forking. Then (unless `-f`) the process forks while it
//! is still single-threaded; the child sets up logging and the tokio runtime, builds the store,
//! checks bucket access, mounts, and reports readiness. It then waits for SIGTERM/SIGINT/SIGHUP
//! or for the mount to disappear (external `umount`), unmounts (lazily while files are open:
//! each is published at its own close), cleans up (`Fs::shutdown`) and exits.

use crate::args::MountArgs;
use crate::config::{parse_source, Settings, Source};
use crate::daemon::{self, Readiness};
use crate::logging::{self, LogTarget};
use crate::metrics_http::{serve_http, serve_socket, stats_socket, Counters};
use bucketfs_fs::{normalize_prefix, unlinked_key_prefix, Fs, WriteBack, WriteBackConfig};
use bucketfs_fuse::{absolute, MountHandle, MountOptions};
use bucketfs_store::crash::{Bucket, JournalDirs, Left, MountJournal, ShutdownAbort, JOURNAL_WAIT};
use bucketfs_store::local::LocalStore;
use bucketfs_store::metrics::{MeteredStore, StoreMetrics};
use bucketfs_store::retry::{RetryMetrics, RetryPolicy, RetryStore};
use bucketfs_store::s3::{S3Config, S3Store};
use bucketfs_store::tls::{load_ca_bundle, TlsTrust};
use bucketfs_store::{ObjectStore, StoreError};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::signal::unix::{signal, SignalKind};
use tracing::{error, info, warn};

/// Attempts per S3 request inside the SDK: 1, because [`RetryStore`] does the retrying
/// (bounded in time, with jitter and an outage breaker).
const S3_MAX_ATTEMPTS: u32 = 1;
/// Longest the startup access check may take before the endpoint counts as unreachable.
const CHECK_TIMEOUT: Duration = Duration::from_secs(30);
/// Tries of the startup access check when it fails for a transient reason: a reset
/// connection or a 503 must not fail the mount, while an endpoint that refuses every
/// connection (a typo, a server that is down) is still said within about 2 s.
const CHECK_TRIES: u32 = 4;
/// A failure later than this after the check began is said as it is, not tried again (a
/// resolver or connect timing out would take the tries past [`CHECK_TIMEOUT`], whose
/// message names no cause).
const CHECK_RETRY_WITHIN: Duration = Duration::from_secs(5);

/// A mount request after parsing and the checks that need no network.
struct Plan {
    settings: Settings,
    target: Target,
    /// Absolute mount point.
    mountpoint: PathBuf,
    /// What `df`/`mount` show as the source.
    fsname: String,
}

pub(crate) enum Target {
    S3 { bucket: String, prefix: String },
    Local { dir: PathBuf },
}

/// Runs `bucketfs mount`; returns the exit code.
pub fn run(args: &MountArgs) -> i32 {
    let plan = match plan(args) {
        Ok(p) => p,
        Err(msg) => {
            eprintln!("bucketfs: {msg}");
            return 1;
        }
    };
    let readiness = if plan.settings.foreground {
        None
    } else {
        match daemon::daemonize() {
            Ok(r) => Some(r),
            Err(msg) => {
                eprintln!("bucketfs: {msg}");
                return 1;
            }
        }
    };
    let code = serve(plan, readiness);
    // Its last lines (why it stopped, what was not stored) are in the log's queue; every
    // caller (the s3fs and ossfs command lines too) exits next.
    logging::flush(LOG_FLUSH);
    code
}

fn plan(args: &MountArgs) -> Result<Plan, String> {
    if args.mountpoint.is_none() && args.source.contains("://") {
        return Err(format!(
            "no MOUNTPOINT after {}: give SOURCE MOUNTPOINT, or MOUNTPOINT alone with a config \
             file that names the bucket",
            args.source
        ));
    }
    let mut settings = args.settings()?;
    for n in &settings.notices {
        eprintln!("bucketfs: {n}");
    }
    settings.check_credentials()?;
    // Every part goes up from one buffer of the memory budget, and uploads hold at most a
    // quarter of it: a bigger part would wait for memory that writers may hold for good.
    if settings.part_size > settings.max_memory / 4 {
        return Err(format!(
            "part size {} MiB needs max memory of at least {} MiB (four parts), not {} MiB: \
             raise --max-memory or lower --part-size",
            settings.part_size >> 20,
            (settings.part_size * 4).div_ceil(1 << 20),
            settings.max_memory >> 20
        ));
    }
    let (source, mountpoint) = args.source_and_mountpoint();
    let target = target_of(&source, &settings)?;
    let mountpoint = mountpoint_within(&mountpoint)?;
    check_mountpoint(&mountpoint, settings.nonempty, settings.allow_stacking)?;
    if let Target::Local { dir } = &target {
        if mountpoint.starts_with(dir) {
            return Err(format!(
                "mount point {} is inside the source directory {}",
                mountpoint.display(),
                dir.display()
            ));
        }
    }
    for (what, p) in [
        ("cache dir", Some(settings.cache_dir.as_path())),
        ("data cache", settings.data_cache.as_deref()),
        ("state dir", settings.state_dir.as_deref()),
        ("log file", settings.log_file.as_deref()),
    ] {
        if let Some(p) = p {
            check_links(what, p)?;
        }
    }
    // Paths are made absolute before the daemon moves to `/`.
    settings.cache_dir = absolute(&settings.cache_dir);
    settings.data_cache = settings.data_cache.as_deref().map(absolute);
    settings.log_file = settings.log_file.as_deref().map(absolute);
    let state = match &settings.state_dir {
        Some(d) => absolute(d),
        None => default_state_dir()?,
    };
    // Checked before any of them is made.
    let own: Vec<(&str, &Path)> = [
        ("cache dir", Some(settings.cache_dir.as_path())),
        ("data cache", settings.data_cache.as_deref()),
        ("state dir", Some(state.as_path())),
        ("log file", settings.log_file.as_deref()),
    ]
    .into_iter()
    .filter_map(|(what, p)| Some((what, p?)))
    .collect();
    check_own_paths(&own, &mountpoint, &target)?;
    std::fs::create_dir_all(&settings.cache_dir)
        .map_err(|e| format!("cache dir {}: {e}", settings.cache_dir.display()))?;
    if let Some(d) = &settings.data_cache {
        settings.data_cache = Some(bucketfs_fs::prepare_data_cache_dir(d)?);
    }
    settings.state_dir = Some(state.clone());
    private_state_dir(&state)?;
    for sub in [JOURNAL_SUBDIR, LOG_SUBDIR] {
        private_dir(&state.join(sub))?;
    }
    if settings.background_upload {
        private_dir(&state.join(WRITEBACK_SUBDIR))?;
    }
    if let Some(ca) = &settings.ca_bundle {
        if settings.no_verify_ssl {
            return Err("--ca-bundle and --no-verify-ssl contradict each other: give one".into());
        }
        let ca = absolute(ca);
        load_ca_bundle(&ca)?;
        settings.ca_bundle = Some(ca);
    }
    if settings.no_verify_ssl {
        eprintln!(
            "bucketfs: warning: --no-verify-ssl: the server's certificate is not checked, so \
             anyone on the network path can read and change the traffic"
        );
    }
    let fsname = match &target {
        Target::S3 { bucket, prefix } => format!("s3://{bucket}/{prefix}")
            .trim_end_matches('/')
            .to_string(),
        Target::Local { dir } => dir.display().to_string(),
    };
    Ok(Plan {
        settings,
        target,
        mountpoint,
        fsname,
    })
}

/// The daemon's own files (`own`: what, where, absolute) lie outside the mount point, which
/// would hide them once mounted and send the daemon's own I/O through itself, and outside a
/// local source directory, where they would show as the bucket's files.
/// Each is checked where it leads (a link to the mount point is inside it).
fn check_own_paths(
    own: &[(&str, &Path)],
    mountpoint: &Path,
    target: &Target,
) -> Result<(), String> {
    for (what, given) in own {
        let p = &resolved(given);
        check_dirs_above(what, given, p)?;
        if p.starts_with(mountpoint) {
            return Err(format!(
                "{what} {} is inside the mount point {}: give one outside it",
                given.display(),
                mountpoint.display()
            ));
        }
        if let Target::Local { dir } = target {
            if p.starts_with(dir) {
                return Err(format!(
                    "{what} {} is inside the source directory {}: give one outside it",
                    p.display(),
                    dir.display()
                ));
            }
        }
    }
    Ok(())
}

/// Where absolute path `p` leads: its links resolved (a dangling one too: what it names is
/// made through it), the rest (to be made) as given.
fn resolved(p: &Path) -> PathBuf {
    resolved_within(p, 40)
}

/// [`resolved`], following `links` more links at most (a loop of them ends).
fn resolved_within(p: &Path, links: u32) -> PathBuf {
    if let Ok(real) = p.canonicalize() {
        return real;
    }
    if let (Ok(to), Some(dir), true) = (std::fs::read_link(p), p.parent(), links > 0) {
        return resolved_within(&dir.join(to), links - 1);
    }
    match (p.parent(), p.file_name()) {
        (Some(parent), Some(name)) => resolved_within(parent, links).join(name),
        _ => p.to_path_buf(),
    }
}

/// Refuses `p` (one of the daemon's own paths, as given) when a link on the way to it is
/// another user's: that user chose where the daemon (root, often) makes and writes its
/// files, and may point it into a mount or another file system at any time.
fn check_links(what: &str, p: &Path) -> Result<(), String> {
    let p = if p.is_absolute() {
        p.to_path_buf()
    } else {
        std::env::current_dir().unwrap_or_default().join(p)
    };
    let me = uid();
    for a in p.ancestors() {
        let Ok(md) = std::fs::symlink_metadata(a) else {
            continue;
        };
        if md.file_type().is_symlink() && md.uid() != me && md.uid() != 0 {
            return Err(format!(
                "{what} {}: {} on the way is a link of user {}: give a path whose links are \
                 this user's or root's",
                p.display(),
                a.display(),
                md.uid()
            ));
        }
    }
    Ok(())
}

/// Refuses `real` (where own path `given` leads) when a directory on the way to it (itself
/// included, if it is one) is another user's than this one's or root's, or every user may
/// rename in it (writable, not sticky like /tmp): its owner could swap what the daemon made
/// there for a link into the mount after the checks (its staging files going through
/// itself: a frozen mount) or anywhere else. Group-writable ones are left to the group.
fn check_dirs_above(what: &str, given: &Path, real: &Path) -> Result<(), String> {
    let me = uid();
    for dir in real.ancestors() {
        let Ok(md) = std::fs::metadata(dir) else {
            continue;
        };
        if !md.is_dir() {
            continue;
        }
        let mode = md.mode();
        if (md.uid() != me && md.uid() != 0) || (mode & 0o002 != 0 && mode & 0o1000 == 0) {
            return Err(format!(
                "{what} {}: {} on the way belongs to user {} with mode {:o}: give a path only \
                 this user or root can change",
                given.display(),
                dir.display(),
                md.uid(),
                mode & 0o7777
            ));
        }
    }
    Ok(())
}

/// What SOURCE names, with the bucket and prefix filled in from the config file if needed.
pub(crate) fn target_of(source: &str, settings: &Settings) -> Result<Target, String> {
    Ok(match parse_source(source)? {
        Source::S3 { bucket, prefix } => {
            let bucket = if bucket.is_empty() {
                settings.bucket.clone().ok_or(
                    "no bucket: give SOURCE as s3://BUCKET[/PREFIX] or set bucket in the \
                     config file",
                )?
            } else {
                bucket
            };
            let prefix = if prefix.is_empty() {
                settings.prefix.clone().unwrap_or_default()
            } else {
                prefix
            };
            Target::S3 {
                bucket,
                prefix: normalize_prefix(&prefix),
            }
        }
        Source::Local(dir) => Target::Local {
            dir: check_local_source(&dir)?,
        },
    })
}

fn check_local_source(dir: &Path) -> Result<PathBuf, String> {
    match std::fs::metadata(dir) {
        Ok(md) if md.is_dir() => dir
            .canonicalize()
            .map_err(|e| format!("source directory {}: {e}", dir.display())),
        Ok(_) => Err(format!("source {} is not a directory", dir.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(format!(
            "source directory {} does not exist (use s3://BUCKET for a bucket)",
            dir.display()
        )),
        Err(e) => Err(format!("source directory {}: {e}", dir.display())),
    }
}

/// How long the mount point may take to answer a `stat`: a FUSE mount whose daemon hangs
/// (stopped, or stuck) never answers, and the mount command must say so, not hang too.
const MOUNTPOINT_ANSWER: Duration = Duration::from_secs(5);
/// How long an exit waits for the log's queued lines (a hung log disk must not hold it).
const LOG_FLUSH: Duration = Duration::from_secs(2);

/// What `f` returns, if within `limit`: it runs on a thread of its own, left behind if it
/// never returns (a look at a hung FUSE mount cannot be interrupted).
pub(crate) fn within<T: Send + 'static>(
    limit: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> Option<T> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit).ok()
}

/// `look` at the mount point, within [`MOUNTPOINT_ANSWER`] (see [`within`]).
fn mountpoint_answer<T: Send + 'static>(
    mp: &Path,
    look: impl FnOnce(&Path) -> T + Send + 'static,
) -> Result<T, String> {
    let p = mp.to_path_buf();
    within(MOUNTPOINT_ANSWER, move || look(&p)).ok_or_else(|| {
        format!(
            "mount point {} does not answer within {} s (a FUSE mount whose daemon hangs?); \
             unmount it first (fusermount3 -uz {})",
            mp.display(),
            MOUNTPOINT_ANSWER.as_secs(),
            mp.display()
        )
    })
}

/// [`absolute`] of a mount point, within [`MOUNTPOINT_ANSWER`]: its directory may be inside
/// a FUSE mount whose daemon hangs, and resolving it waits for that daemon.
pub(crate) fn absolute_within(mp: &Path) -> Result<PathBuf, String> {
    let p = mp.to_path_buf();
    within(MOUNTPOINT_ANSWER, move || absolute(&p)).ok_or_else(|| {
        format!(
            "the directory of mount point {} does not answer within {} s (is it inside a \
             FUSE mount whose daemon hangs? see `grep fuse /proc/mounts`)",
            mp.display(),
            MOUNTPOINT_ANSWER.as_secs()
        )
    })
}

/// [`absolute_within`], and a symbolic link to a directory taken for where it points, as the
/// mount goes there (the stats socket, mountinfo and the unmount name that place); only when
/// the path is no mount point itself, whose root may be a hung mount's.
pub(crate) fn mountpoint_within(mp: &Path) -> Result<PathBuf, String> {
    let abs = absolute_within(mp)?;
    if bucketfs_fuse::mount_info(&abs).is_some() || std::fs::read_link(&abs).is_err() {
        return Ok(abs);
    }
    Ok(mountpoint_answer(&abs, |p| p.canonicalize())?.unwrap_or(abs))
}

/// `stat` of the mount point (see [`mountpoint_answer`]).
fn mountpoint_metadata(mp: &Path) -> Result<std::io::Result<std::fs::Metadata>, String> {
    mountpoint_answer(mp, |p| std::fs::metadata(p))
}

/// Whether `mp` is a FUSE mount whose daemon is gone: its `stat` fails with `ENOTCONN`, or,
/// since the kernel answers a `stat` from attributes it cached (for up to the dead daemon's
/// TTL), its `statfs`, which the kernel always asks the daemon.
fn dead_fuse_mount(mp: &Path) -> Result<bool, String> {
    let fuse = bucketfs_fuse::mount_info(mp).is_some_and(|m| m.fstype.starts_with("fuse"));
    if !fuse {
        return Ok(false);
    }
    mountpoint_answer(mp, |p| {
        bucketfs_fs::statvfs(p).is_err_and(|e| e.raw_os_error() == Some(libc::ENOTCONN))
    })
}

fn check_mountpoint(mp: &Path, nonempty: bool, allow_stacking: bool) -> Result<(), String> {
    let md = match mountpoint_metadata(mp)? {
        Ok(_) if dead_fuse_mount(mp)? => Err(std::io::Error::from_raw_os_error(libc::ENOTCONN)),
        r => r,
    };
    let md = match md {
        Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => {
            // A FUSE daemon died without unmounting: clear the corpse and go on.
            bucketfs_fuse::unmount_path(mp, true).map_err(|ue| {
                format!(
                    "mount point {} is a dead FUSE mount (transport endpoint is not \
                     connected) and unmounting it failed: {ue}",
                    mp.display()
                )
            })?;
            eprintln!(
                "bucketfs: mount point {} was a dead FUSE mount (transport endpoint is not \
                 connected); unmounted it",
                mp.display()
            );
            mountpoint_metadata(mp)?
        }
        r => r,
    };
    let md = match md {
        Ok(md) => md,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(format!("mount point {} does not exist", mp.display()))
        }
        Err(e) => return Err(format!("cannot access mount point {}: {e}", mp.display())),
    };
    if !md.is_dir() {
        return Err(format!("mount point {} is not a directory", mp.display()));
    }
    if !allow_stacking {
        // A second mount would hide the first one (and its open files) without a word.
        let real =
            mountpoint_answer(mp, |p| p.canonicalize())?.unwrap_or_else(|_| mp.to_path_buf());
        if let Some(m) = bucketfs_fuse::mount_info(&real) {
            return Err(format!(
                "mount point {} is already a mount point ({} {}): unmount it first, or give \
                 --allow-stacking to mount over it",
                mp.display(),
                m.fstype,
                m.source
            ));
        }
    }
    if !nonempty {
        // A mount stacked over a hung one may have answered the stat from the kernel's cache.
        let any = mountpoint_answer(mp, |p| std::fs::read_dir(p).map(|mut d| d.next().is_some()))?
            .map_err(|e| format!("cannot read mount point {}: {e}", mp.display()))?;
        if any {
            return Err(format!(
                "mount point {} is not empty (use --nonempty to mount over its contents)",
                mp.display()
            ));
        }
    }
    Ok(())
}

/// Everything after the fork: returns the exit code.
fn serve(plan: Plan, readiness: Option<Readiness>) -> i32 {
    let s = &plan.settings;
    let target = LogTarget::choose(
        s.log_file.as_deref(),
        s.syslog,
        s.foreground,
        &state_dir(s).join(LOG_SUBDIR),
    );
    // The automatic log file of a daemon that never started only repeats the error the user
    // was shown: remove it so failed mounts leave nothing behind.
    let auto_log = match (&target, &s.log_file) {
        (LogTarget::File(f), None) => Some(f.clone()),
        _ => None,
    };
    let report_failure = |readiness: Option<Readiness>, msg: String| {
        error!("{msg}");
        if let Some(f) = &auto_log {
            let _ = std::fs::remove_file(f);
        }
        match readiness {
            Some(r) => r.failed(&msg),
            None => eprintln!("bucketfs: {msg}"),
        }
        1
    };
    if let Err(msg) = logging::init_queued(s.log_level, &target) {
        return report_failure(readiness, msg);
    }
    match raise_open_files_limit() {
        Ok(Some((old, new))) => info!("open files limit raised from {old} to {new}"),
        Ok(None) => {}
        Err(e) => warn!("cannot raise the open files limit: {e}"),
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("bucketfs-worker")
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return report_failure(readiness, format!("cannot start runtime: {e}")),
    };
    let opened = match rt.block_on(open_store(&plan.settings, &plan.target)) {
        Ok(x) => x,
        Err(msg) => return report_failure(readiness, msg),
    };
    let (store, metrics, retry_metrics) = (opened.store, opened.metrics, opened.retry_metrics);
    if s.no_verify_ssl {
        warn!("--no-verify-ssl: server certificates are not verified");
    }
    let prefix = match &plan.target {
        Target::S3 { prefix, .. } => prefix.clone(),
        Target::Local { .. } => String::new(),
    };
    // Uploads left open by a daemon of this bucket that died are aborted before we start;
    // ours are journaled from now on.
    let endpoint = opened.endpoint.clone();
    let journal = match rt.block_on(open_journal(store, s, &plan.target, endpoint, &prefix)) {
        Ok(j) => j,
        Err(msg) => return report_failure(readiness, msg),
    };
    let store = journal.store().clone();

    let mut fs_config = s.fs_config(prefix.clone());
    // The store as the client resolved its endpoint: two profiles, or `AWS_ENDPOINT_URL`s,
    // of one bucket name are two stores.
    let scope = match &plan.target {
        Target::S3 { bucket, .. } => {
            let endpoint = opened.endpoint.as_deref().unwrap_or("aws");
            format!("s3 {endpoint} {bucket}")
        }
        Target::Local { dir } => format!("local {}", dir.display()),
    };
    if let Some(c) = &mut fs_config.data_cache {
        // Blocks are keyed by this too: two buckets (or endpoints) never share one.
        c.scope = scope.clone();
    }
    let writeback_dir_of = |store: &str| {
        state_dir(s)
            .join(WRITEBACK_SUBDIR)
            .join(writeback_tag(&plan.target, store))
    };
    let writeback_for = writeback_store(&plan.target, &scope, &prefix);
    let writeback_dir = writeback_dir_of(&writeback_for);
    if let (Target::S3 { bucket, .. }, None, Some(endpoint)) =
        (&plan.target, &s.endpoint_url, &opened.endpoint)
    {
        // Before the directory recorded its store, it was named after the endpoint option
        // alone ("aws" without one): this store's files may wait under that name.
        let legacy = writeback_dir_of(&writeback_store(
            &plan.target,
            &format!("s3 aws {bucket}"),
            &prefix,
        ));
        match WriteBack::take_over(&legacy, &writeback_dir) {
            Ok(true) => warn!(
                "{}: files an earlier bucketfs acknowledged for this bucket at {endpoint}, \
                 named without the endpoint: moved to {}",
                legacy.display(),
                writeback_dir.display()
            ),
            Ok(false) => {}
            Err(msg) => warn!("{msg}"),
        }
    }
    if let Target::S3 { bucket, .. } = &plan.target {
        let endpoint = opened.endpoint.as_deref().unwrap_or("aws");
        other_spellings(&writeback_dir, (endpoint, bucket, &prefix));
    }
    if let Some(w) = &mut fs_config.writeback {
        // One directory per bucket and prefix (and store): files wait there for upload.
        w.dir = writeback_dir.clone();
        w.store = writeback_for.clone();
    }
    if fs_config.writeback.is_none() {
        // Files a mount with --upload background acknowledged and left here are uploaded
        // before this one serves, or it refuses: they are never ignored.
        let left = (writeback_dir, writeback_for);
        if let Err(msg) = upload_left_behind(&rt, &store, &fs_config, left) {
            return report_failure(readiness, msg);
        }
    }
    let (fs, recovered) = match rt.block_on(async { Fs::with_writeback(store.clone(), fs_config) })
    {
        Ok(x) => x,
        Err(msg) => return report_failure(readiness, msg),
    };
    if recovered > 0 {
        // Acknowledged before a crash: in the bucket before the mount shows anything.
        warn!("{recovered} file(s) a previous bucketfs acknowledged were not uploaded yet: uploading them now");
        let (left, failed) = rt.block_on(fs.wait_for_uploads(Duration::from_secs(2), |n, b| {
            info!("recovery: {n} file(s), {:.1} MB to upload", b as f64 / 1e6)
        }));
        if left > 0 {
            error!(
                "{left} recovered file(s) could not be uploaded ({failed} failed); they stay \
                 in the write-back directory, retried in the background (bucketfs pending)"
            );
        } else {
            info!("recovery: all {recovered} file(s) uploaded");
        }
    }
    let weak = Arc::downgrade(&fs);
    let counters = Counters {
        store: metrics.clone(),
        fs: fs.metrics(),
        retry: retry_metrics.clone(),
        inodes: Arc::new(move || weak.upgrade().map_or(0, |f| f.inode_count())),
        pending: {
            let weak = Arc::downgrade(&fs);
            Arc::new(move || {
                weak.upgrade()
                    .map(|f| f.pending_uploads())
                    .unwrap_or_default()
            })
        },
    };
    if let Some(addr) = s.metrics_addr {
        if let Err(e) = rt.block_on(serve_http(addr, counters.clone())) {
            return report_failure(readiness, format!("metrics address {addr}: {e}"));
        }
        info!("serving metrics at http://{addr}/metrics");
    }
    let socket = stats_socket(&plan.mountpoint);
    let _stats = match rt.block_on(async { serve_socket(&socket, counters) }) {
        Ok(g) => Some(g),
        Err(e) => {
            warn!(
                "stats socket {}: {e}; bucketfs stats will not work",
                socket.display()
            );
            None
        }
    };
    let opts = MountOptions {
        fsname: plan.fsname.clone(),
        allow_other: s.allow_other,
        allow_root: s.allow_root,
        read_only: s.read_only,
        no_exec: s.no_exec,
        n_threads: s.fuse_threads,
        passthrough: s.passthrough && !s.no_passthrough,
    };
    let handle =
        match bucketfs_fuse::mount(fs.clone(), rt.handle().clone(), &plan.mountpoint, &opts) {
            Ok(h) => h,
            Err(e) => {
                let shared = if s.allow_other {
                    Some("--allow-other")
                } else if s.allow_root {
                    Some("--allow-root")
                } else {
                    None
                };
                let hint = match shared {
                    Some(opt)
                        if e.raw_os_error() == Some(libc::EPERM)
                            || e.to_string().contains("allow_other") =>
                    {
                        format!(
                            " (non-root users need user_allow_other in /etc/fuse.conf for {opt})"
                        )
                    }
                    _ => String::new(),
                };
                return report_failure(
                    readiness,
                    format!(
                        "cannot mount at {}: {}{hint}",
                        plan.mountpoint.display(),
                        one_line(&e.to_string())
                    ),
                );
            }
        };
    info!(
        "bucketfs {} ready: {} at {} (log: {target:?})",
        env!("CARGO_PKG_VERSION"),
        plan.fsname,
        plan.mountpoint.display()
    );
    if let Some(r) = readiness {
        r.ready();
    }
    daemon::notify_systemd("READY=1");
    let code = rt.block_on(wait_and_shutdown(&fs, handle, &journal));
    log_metrics(&metrics, &retry_metrics);
    let Some(Left {
        uploads: left,
        temporaries: kept,
    }) = rt.block_on(journal.close())
    else {
        error!(
            "upload journal {} did not answer within {} s (is the state disk hung?); it stays, \
             and the next mount of this bucket aborts the uploads it holds",
            journal.path().display(),
            JOURNAL_WAIT.as_secs()
        );
        // Now: what is left to drop (the runtime's tasks, the write-back directory's
        // segments) would wait for the same disk.
        logging::flush(LOG_FLUSH);
        std::process::exit(code.max(1));
    };
    if left > 0 {
        warn!(
            "{left} multipart upload(s) could not be aborted; the next mount of this bucket \
             aborts them (journal {})",
            journal.path().display()
        );
    }
    if kept > 0 {
        warn!(
            "{kept} object(s) of files unlinked while open could not be deleted; the next mount \
             of this bucket deletes them (journal {})",
            journal.path().display()
        );
    }
    rt.shutdown_timeout(Duration::from_secs(5));
    code
}

/// Waits for a signal or an external unmount, then unmounts. Files still open keep being
/// served through the lazily detached mount, and each is published at its own close or
/// fsync (publishing them now would put half-written content under their keys); the daemon
/// exits when the last is closed. A second signal stops waiting and aborts their uploads,
/// naming each file that was not stored. Returns the exit code.
async fn wait_and_shutdown(fs: &Fs, handle: MountHandle, journal: &MountJournal) -> i32 {
    let (mut term, mut int, mut hup) = match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
        signal(SignalKind::hangup()),
    ) {
        (Ok(a), Ok(b), Ok(c)) => (a, b, c),
        _ => {
            error!("cannot install signal handlers; waiting for an external unmount");
            handle.unmounted().await;
            let code = unmount(handle).await.max(drain_uploads(fs).await);
            return code.max(clean_up(fs).await);
        }
    };
    tokio::select! {
        _ = term.recv() => info!("SIGTERM: unmounting"),
        _ = int.recv() => info!("SIGINT: unmounting"),
        _ = hup.recv() => info!("SIGHUP: unmounting"),
        _ = handle.unmounted() => info!("{} was unmounted", handle.mountpoint().display()),
    }
    let second = tokio::select! {
        // The clean-up too: a store or disk that stops answering there leaves the second
        // signal its way out.
        code = async {
            let code = unmount(handle).await.max(drain_uploads(fs).await);
            code.max(clean_up(fs).await)
        } => return code,
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
        // Not SIGHUP: a terminal's hangup can deliver it twice (kernel and shell).
    };
    let left = fs.pending_uploads().len();
    if left > 0 {
        warn!(
            "second signal ({second}): {left} file(s) not uploaded yet stay in the write-back \
             directory; the next mount of this bucket uploads them"
        );
    }
    warn!("second signal ({second}): not waiting for open files; aborting their uploads");
    let mut uploading = Vec::new();
    let Some(aborted) = journal.abort_open_uploads().await else {
        error!(
            "upload journal {} did not answer within {} s (is the state disk hung?): the \
             uploads of files still open were NOT stored nor aborted; the next mount aborts them",
            journal.path().display(),
            JOURNAL_WAIT.as_secs()
        );
        return 1;
    };
    for (key, what) in aborted {
        match what {
            ShutdownAbort::Aborted => {
                error!("{key}: upload aborted at shutdown; the file was NOT stored")
            }
            ShutdownAbort::Failed(e) => error!(
                "{key}: upload not stored, and aborting it failed ({e}); the next mount aborts it"
            ),
            ShutdownAbort::TimedOut => error!(
                "{key}: upload not stored, and aborting it timed out; the next mount aborts it"
            ),
        }
        uploading.push(key);
    }
    for key in fs.files_not_stored() {
        if !uploading.contains(&key) {
            error!("{key}: still open for writing at shutdown; the file was NOT stored");
        }
    }
    1
}

/// Unmounts, waiting until the last open file of a busy mount is closed; returns the exit
/// code. On a thread of its own, not the blocking pool: tasks stuck there on a hung disk (a
/// data cache on a lost NFS server) must not keep the mount from going.
async fn unmount(handle: MountHandle) -> i32 {
    let mountpoint = handle.mountpoint().display().to_string();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let spawned = std::thread::Builder::new()
        .name("unmount".into())
        .spawn(move || {
            let _ = tx.send(handle.unmount());
        });
    let r = match spawned {
        Ok(_) => rx.await.map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    match r {
        Ok(Ok(())) => 0,
        Ok(Err(e)) => {
            error!("unmount {mountpoint}: {e}");
            1
        }
        Err(e) => {
            error!("unmount {mountpoint}: {e}");
            1
        }
    }
}

/// A mount without `--upload background` over a write-back directory `dir` that a
/// background mount of the same bucket left entries in: uploads them, or says why not.
fn upload_left_behind(
    rt: &tokio::runtime::Runtime,
    store: &Arc<dyn ObjectStore>,
    fs_config: &bucketfs_fs::FsConfig,
    (dir, store_for): (PathBuf, String),
) -> Result<(), String> {
    if !WriteBack::holds_entries(&dir) {
        return Ok(());
    }
    warn!(
        "{}: files a mount with --upload background acknowledged are waiting there: \
         uploading them before serving",
        dir.display()
    );
    let cfg = WriteBackConfig {
        dir: dir.clone(),
        max_bytes: u64::MAX,
        concurrency: crate::config::BACKGROUND_UPLOADS,
        fsync_waits_upload: false,
        delay: Duration::ZERO,
        space_wait: Duration::from_secs(60),
        store: store_for,
    };
    let part_size = fs_config.part_size.max(store.limits().min_part);
    let (found, left) = rt.block_on(WriteBack::upload_left_behind(
        cfg,
        store.clone(),
        part_size,
        Duration::from_secs(2),
        |n, b| info!("recovery: {n} file(s), {:.1} MB to upload", b as f64 / 1e6),
    ))?;
    if left > 0 {
        return Err(format!(
            "{left} of {found} file(s) a mount with --upload background acknowledged could \
             not be uploaded from {}; mount with --upload background to keep retrying them \
             (bucketfs pending lists them)",
            dir.display()
        ));
    }
    info!("recovery: all {found} file(s) uploaded");
    Ok(())
}

/// Subdirectories of the state directory.
const JOURNAL_SUBDIR: &str = "journal";
const LOG_SUBDIR: &str = "logs";
const WRITEBACK_SUBDIR: &str = "writeback";

/// The state directory when none is given: `/var/lib/bucketfs` for root, else
/// `$XDG_STATE_HOME/bucketfs` or `~/.local/state/bucketfs`. Persistent, unlike the cache dir
/// (often a tmpfs), so the journals of a crash outlive a reboot.
fn default_state_dir() -> Result<PathBuf, String> {
    // SAFETY: getuid cannot fail.
    if unsafe { libc::getuid() } == 0 {
        return Ok(PathBuf::from("/var/lib/bucketfs"));
    }
    let abs = |v: Option<std::ffi::OsString>| v.map(PathBuf::from).filter(|p| p.is_absolute());
    if let Some(x) = abs(std::env::var_os("XDG_STATE_HOME")) {
        return Ok(x.join("bucketfs"));
    }
    if let Some(h) = abs(std::env::var_os("HOME")) {
        return Ok(h.join(".local/state/bucketfs"));
    }
    Err("no state directory: HOME is not set; give --state-dir DIR".into())
}

/// The state directory `plan` settled on.
fn state_dir(settings: &Settings) -> PathBuf {
    settings.state_dir.clone().expect("set by plan")
}

fn uid() -> u32 {
    // SAFETY: getuid cannot fail.
    unsafe { libc::getuid() }
}

/// Whether `dir` is a real directory of this user that nobody else can enter (`mask` 0o077)
/// or change (`mask` 0o022).
fn owned_by_us(dir: &Path, mask: u32) -> Result<(), String> {
    let md = std::fs::symlink_metadata(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    if md.is_dir() && md.uid() == uid() && md.mode() & mask == 0 {
        return Ok(());
    }
    Err(format!(
        "{} is not private to this user ({}owner {}, mode {:04o}); remove it, chmod 700 it or \
         give another --state-dir",
        dir.display(),
        if md.is_dir() { "" } else { "not a directory, " },
        md.uid(),
        md.mode() & 0o7777
    ))
}

/// Creates `dir` (0700) and the directories above it that are missing, each fsync'd into its
/// parent: the journals and write-back entries made in them are fsync'd by their writers,
/// which a power loss must not undo by losing the directory's own name.
fn create_private(dir: &Path) -> Result<(), String> {
    use std::os::unix::fs::DirBuilderExt;
    let err = |e: std::io::Error| format!("state directory {}: {e}", dir.display());
    let made: Vec<&Path> = dir.ancestors().take_while(|p| !p.exists()).collect();
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(err)?;
    for d in made.iter().rev() {
        if let Some(parent) = d.parent() {
            std::fs::File::open(parent)
                .and_then(|f| f.sync_all())
                .map_err(err)?;
        }
    }
    Ok(())
}

/// The state directory: created 0700 if missing; ours and writable by nobody else.
fn private_state_dir(dir: &Path) -> Result<(), String> {
    create_private(dir)?;
    owned_by_us(dir, 0o022)
}

/// A subdirectory of the state directory: ours alone (0700). Another user who could read the
/// journals or the log, or plant journals that make us abort uploads, must not get in.
fn private_dir(dir: &Path) -> Result<(), String> {
    create_private(dir)?;
    owned_by_us(dir, 0o077)
}

/// Cleans up what dead daemons of this bucket left (in the state directory, and in the
/// journal directories of older versions), then opens this daemon's journal.
/// `endpoint`: as the client resolved it (see [`writeback_tag`]).
async fn open_journal(
    store: Arc<dyn ObjectStore>,
    settings: &Settings,
    target: &Target,
    endpoint: Option<String>,
    prefix: &str,
) -> Result<MountJournal, String> {
    let dir = state_dir(settings).join(JOURNAL_SUBDIR);
    private_dir(&dir)?;
    let bucket = match target {
        Target::S3 { bucket, .. } => Bucket::S3 {
            bucket: bucket.clone(),
            endpoint,
        },
        Target::Local { dir } => Bucket::Local { dir: dir.clone() },
    };
    let dirs = JournalDirs {
        dir,
        legacy: legacy_journal_dirs(settings),
    };
    let (journal, recovery) =
        MountJournal::open(store, &bucket, &dirs, unlinked_key_prefix(prefix)).await?;
    match recovery {
        Ok(r) => {
            for (key, _) in &r.aborted {
                warn!("{key}: aborted the upload a previous bucketfs left open when it died");
            }
            for (key, _, e) in &r.failed {
                warn!("{key}: could not abort the upload a previous bucketfs left open: {e}");
            }
            for key in &r.deleted {
                warn!("{key}: deleted the copy of an unlinked file a previous bucketfs left");
            }
            for (key, e) in &r.failed_deletes {
                warn!("{key}: could not delete the copy of an unlinked file a previous bucketfs left: {e}");
            }
        }
        Err(e) => warn!("upload journals in {}: {e}", dirs.dir.display()),
    }
    Ok(journal)
}

/// Where bucketfs before the state directory kept its journals (`CACHE_DIR/bucketfs-journal-UID`
/// of this and of the default cache dir), if such a directory is private to this user.
fn legacy_journal_dirs(settings: &Settings) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    for cache in [
        settings.cache_dir.clone(),
        std::env::temp_dir(),
        PathBuf::from("/tmp"),
    ] {
        let d = cache.join(format!("bucketfs-journal-{}", uid()));
        if !dirs.contains(&d) && owned_by_us(&d, 0o077).is_ok() {
            dirs.push(d);
        }
    }
    dirs
}

/// Raises the soft limit of open files to the hard limit (often 1024 of 4096 or more): every
/// open file, staging file and store connection is a descriptor. Returns `(old, new)` if raised.
pub(crate) fn raise_open_files_limit() -> std::io::Result<Option<(u64, u64)>> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid out pointer.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut want = lim.rlim_max;
    if want == libc::RLIM_INFINITY {
        // The kernel refuses more than fs.nr_open.
        want = std::fs::read_to_string("/proc/sys/fs/nr_open")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(1 << 20);
    }
    if lim.rlim_cur >= want {
        return Ok(None);
    }
    let old = lim.rlim_cur;
    lim.rlim_cur = want;
    // SAFETY: `lim` is a valid rlimit.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(Some((old, want)))
}

/// Background mode, once the mount is gone: waits for the uploads still to do, showing
/// progress; returns the exit code (1 when some could not be uploaded: they stay for the next
/// mount).
async fn drain_uploads(fs: &Fs) -> i32 {
    let (files, bytes) = {
        let p = fs.pending_uploads();
        (p.len(), p.iter().map(|f| f.size).sum::<u64>())
    };
    if files == 0 {
        return 0;
    }
    info!(
        "waiting for {files} background upload(s), {:.1} MB (a second signal leaves them for the \
         next mount)",
        bytes as f64 / 1e6
    );
    let (left, failed) = fs
        .wait_for_uploads(Duration::from_secs(2), |n, b| {
            info!("{n} upload(s) left, {:.1} MB", b as f64 / 1e6)
        })
        .await;
    if left > 0 {
        error!(
            "{left} file(s) not uploaded ({failed} failed, see above); they stay in the \
             write-back directory and the next mount of this bucket uploads them"
        );
        return 1;
    }
    info!("all background uploads done");
    0
}

/// What a mount's write-back files are for (see [`WriteBackConfig::store`]): `scope` (the
/// store as the client resolved its endpoint, and the bucket) and the prefix. Before, the
/// endpoint a mount was given as an option stood for the store, so a mount of the same
/// bucket name at another `AWS_ENDPOINT_URL` uploaded files another store acknowledged.
fn writeback_store(target: &Target, scope: &str, prefix: &str) -> String {
    match target {
        Target::S3 { .. } => format!("{scope} {prefix}"),
        Target::Local { .. } => scope.to_string(),
    }
}

/// The write-back directories of bucket `bucket` (and `prefix`) beside this mount's (`ours`)
/// that hold files a background mount acknowledged: one recorded for this very store under
/// another spelling of its endpoint (the same host name in other case or with the default
/// port, or `localhost` for `127.0.0.1`; never two names that merely share an address) is
/// taken over, so its files go up from this mount; one for another endpoint is named in a
/// warning (its files wait for a mount of that store). Neither is left unsaid: a remount
/// spelling the endpoint otherwise showed none of the files acknowledged before.
fn other_spellings(ours: &Path, (endpoint, bucket, prefix): (&str, &str, &str)) {
    let Some(parent) = ours.parent() else {
        return;
    };
    let Some(tag_start) = ours
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.rsplit_once('-'))
        .map(|(b, _)| format!("{b}-"))
    else {
        return;
    };
    let Ok(dirs) = std::fs::read_dir(parent) else {
        return;
    };
    let spelt_otherwise = |record: &str| {
        let mut f = record.splitn(4, ' ');
        let (Some("s3"), Some(theirs), Some(b), Some(p)) = (f.next(), f.next(), f.next(), f.next())
        else {
            return None;
        };
        let same = theirs == endpoint
            || (theirs != "aws"
                && endpoint != "aws"
                && bucketfs_store::crash::same_endpoint_spelt(theirs, endpoint));
        (b == bucket && p == prefix).then(|| (theirs.to_string(), same))
    };
    // A move cut short (a crash after the rename) left the other spelling's record here:
    // this store's, it goes, and the mount records its own.
    let record = ours.join(bucketfs_fs::WRITEBACK_STORE_FILE);
    if let Ok(r) = std::fs::read_to_string(&record) {
        if spelt_otherwise(&r).is_some_and(|(theirs, same)| same && theirs != endpoint) {
            let _ = std::fs::remove_file(&record);
        }
    }
    for dir in dirs.flatten().map(|e| e.path()) {
        let named = dir.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if dir == ours || !named.starts_with(&tag_start) || !WriteBack::holds_entries(&dir) {
            continue;
        }
        let Ok(record) = std::fs::read_to_string(dir.join(bucketfs_fs::WRITEBACK_STORE_FILE))
        else {
            continue;
        };
        let Some((theirs, same)) = spelt_otherwise(&record) else {
            continue;
        };
        if !same {
            warn!(
                "{}: files a background mount acknowledged for bucket {bucket} at {theirs} wait \
                 there; a mount of that store uploads them",
                dir.display()
            );
            continue;
        }
        match WriteBack::take_over_spelling(&dir, ours) {
            Ok(true) => warn!(
                "{}: files acknowledged for this bucket at {theirs} (this store, spelt \
                 otherwise): moved to {}, uploaded from here",
                dir.display(),
                ours.display()
            ),
            Ok(false) => {}
            Err(msg) => warn!("{msg}"),
        }
    }
}

/// The write-back directory's name for a mount: the bucket (readable) and a hash of what
/// its files are for ([`writeback_store`]).
fn writeback_tag(target: &Target, store: &str) -> String {
    let name = match target {
        Target::S3 { bucket, .. } => bucket.clone(),
        Target::Local { .. } => "local".to_string(),
    };
    // FNV-1a: stable across versions (the name must be found again after an upgrade).
    let mut h: u64 = 0xcbf29ce484222325;
    for b in store.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    let name: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("{name}-{h:016x}")
}

/// Cleans up once the mount is gone; returns the exit code.
async fn clean_up(fs: &Fs) -> i32 {
    let failed = fs.shutdown().await;
    if failed > 0 {
        error!("{failed} file(s) were not stored");
        1
    } else {
        0
    }
}

fn log_metrics(m: &StoreMetrics, r: &RetryMetrics) {
    info!(
        "store requests: {}, bytes up: {}, bytes down: {}; retries: {}, recovered: {}, \
         gave up: {}, outages: {}",
        m.total_requests(),
        m.bytes_up(),
        m.bytes_down(),
        RetryMetrics::get(&r.retries),
        RetryMetrics::get(&r.recovered),
        RetryMetrics::get(&r.gave_up),
        RetryMetrics::get(&r.outages),
    );
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// An SDK error made short: one line, without the `(DispatchFailure(DispatchFailure { .. }))`
/// debug dump the SDK appends, at most 300 characters.
fn short_detail(s: &str) -> String {
    let mut s = one_line(s);
    let b = s.as_bytes();
    let cut = (0..b.len().saturating_sub(2)).find(|&i| {
        b[i] == b' ' && b[i + 1] == b'(' && b[i + 2].is_ascii_uppercase() && {
            let rest = &s[i + 2..];
            let ident_end = rest
                .find(|c: char| !c.is_ascii_alphanumeric() && c != '_')
                .unwrap_or(rest.len());
            matches!(rest[ident_end..].chars().next(), Some('(') | Some('{'))
        }
    });
    if let Some(i) = cut {
        s.truncate(i);
    }
    if s.len() > 300 {
        let mut end = 300;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
        s.push_str("...");
    }
    s
}

/// A store built and checked by [`open_store`].
pub(crate) struct OpenedStore {
    pub store: Arc<dyn ObjectStore>,
    pub metrics: Arc<StoreMetrics>,
    pub retry_metrics: Arc<RetryMetrics>,
    /// An S3 store's endpoint, however it was given; `None`: AWS's own, or a directory.
    pub endpoint: Option<String>,
}

/// Builds the store of `target` and checks that it can be used.
pub(crate) async fn open_store(
    settings: &Settings,
    target: &Target,
) -> Result<OpenedStore, String> {
    let (store, metrics, endpoint) = open_raw_store(settings, target).await?;
    let policy = if settings.retry_timeout.is_zero() {
        RetryPolicy::none()
    } else {
        RetryPolicy {
            max_elapsed: settings.retry_timeout,
            ..RetryPolicy::default()
        }
    };
    let retry = RetryStore::new(store, policy);
    // Only the S3 backend reports the bytes it moves; a local directory does not stall.
    let retry = match target {
        Target::S3 { .. } => retry.cutting_stalls(),
        Target::Local { .. } => retry,
    };
    let retry_metrics = retry.metrics();
    Ok(OpenedStore {
        store: Arc::new(retry),
        metrics,
        retry_metrics,
        endpoint,
    })
}

/// The backend with request counters, before retries, and an S3 store's endpoint.
async fn open_raw_store(
    settings: &Settings,
    target: &Target,
) -> Result<(Arc<dyn ObjectStore>, Arc<StoreMetrics>, Option<String>), String> {
    match target {
        Target::Local { dir } => {
            let store = LocalStore::open(dir).map_err(|e| match e {
                StoreError::NoSuchBucket(_) => {
                    format!("source directory {} does not exist", dir.display())
                }
                e => format!("source directory {}: {e}", dir.display()),
            })?;
            let metered = MeteredStore::new(Arc::new(store));
            let metrics = metered.metrics();
            Ok((Arc::new(metered), metrics, None))
        }
        Target::S3 { bucket, prefix } => {
            let s = settings;
            let cfg = S3Config {
                bucket: bucket.clone(),
                endpoint_url: s.endpoint_url.clone(),
                region: s.region.clone(),
                force_path_style: s.force_path_style,
                profile: s.profile.clone(),
                access_key_id: s.access_key_id.clone(),
                secret_access_key: s.secret_access_key.clone(),
                session_token: s.session_token.clone(),
                max_attempts: S3_MAX_ATTEMPTS,
                unsigned_payload: s.unsigned_payload,
                list_metadata: s.list_metadata,
                max_connections: s.max_connections,
                guess_content_type: s.guess_content_type,
                tls: if s.no_verify_ssl {
                    TlsTrust::Insecure
                } else if let Some(ca) = &s.ca_bundle {
                    TlsTrust::CaBundle(load_ca_bundle(ca)?)
                } else {
                    TlsTrust::System
                },
            };
            let store = S3Store::new(&cfg).await.map_err(|e| {
                format!(
                    "cannot set up the S3 client: {}",
                    short_detail(&e.to_string())
                )
            })?;
            let resolved = store.endpoint().map(str::to_string);
            let endpoint = resolved.as_deref().unwrap_or("AWS S3").to_string();
            match tokio::time::timeout(CHECK_TIMEOUT, check_access(&store, prefix)).await {
                Err(_) => {
                    return Err(format!(
                        "cannot reach endpoint {endpoint}: no answer within {} s",
                        CHECK_TIMEOUT.as_secs()
                    ))
                }
                Ok(Err(e)) => return Err(access_error(e, bucket, &endpoint)),
                Ok(Ok(())) => {}
            }
            info!("bucket {bucket} at {endpoint}: access checked");
            let slots = store.request_slots();
            let store = Arc::new(store);
            let metered = MeteredStore::new(store.clone());
            let metrics = metered.metrics();
            metrics.watch_request_slots(slots);
            store.count_inner_requests_in(metrics.clone());
            Ok((Arc::new(metered), metrics, resolved))
        }
    }
}

/// The startup access check, tried again after 250 ms, then twice as long each time, while it
/// fails quickly for a transient reason, [`CHECK_TRIES`] tries in all.
async fn check_access(store: &S3Store, prefix: &str) -> Result<(), StoreError> {
    let mut pause = Duration::from_millis(250);
    let mut tries = 1;
    let started = std::time::Instant::now();
    loop {
        match store.check_access(prefix).await {
            Err(e)
                if e.is_transient()
                    && tries < CHECK_TRIES
                    && started.elapsed() < CHECK_RETRY_WITHIN =>
            {
                warn!(
                    "bucket access check: {}; trying again in {} ms",
                    one_line(&e.to_string()),
                    pause.as_millis()
                );
                tokio::time::sleep(pause).await;
                pause *= 2;
                tries += 1;
            }
            r => return r,
        }
    }
}

/// A one-line message for a failed startup access check. Store error details carry the
/// service's error code and message, never the credentials.
fn access_error(e: StoreError, bucket: &str, endpoint: &str) -> String {
    let detail = |d: &str| {
        let d = d.strip_prefix(&format!("bucket {bucket}: ")).unwrap_or(d);
        short_detail(d)
    };
    // An endpoint with a path (`http://host:9000/minio/`): the bucket is looked for under
    // it, which few stores serve; said with a "does not exist".
    let path_hint = match endpoint
        .split_once("://")
        .and_then(|(_, r)| r.split_once('/'))
    {
        Some((_, path)) if !path.trim_matches('/').is_empty() => format!(
            "; the endpoint has a path (/{}): S3 endpoints seldom do, try without it",
            path.trim_end_matches('/')
        ),
        _ => String::new(),
    };
    match e {
        // What a plain-HTTP server answers to a TLS hello (rustls: "received corrupt
        // message of type InvalidContentType").
        StoreError::Other(d) if d.contains("TLS failure (is it an http://") => {
            format!("{endpoint} does not speak HTTPS: {}", detail(&d))
        }
        StoreError::Other(d) if d.contains("TLS failure") => format!(
            "the HTTPS certificate of {endpoint} is not trusted (for a private CA give \
             --ca-bundle FILE): {}",
            detail(&d)
        ),
        StoreError::AccessDenied(d) | StoreError::Transient(d) | StoreError::Other(d)
            if d.contains("no usable credentials")
                || (!d.contains("(request id")
                    && d.to_ascii_lowercase().contains("credential")) =>
        {
            format!(
                "no usable credentials for bucket {bucket}: set AWS_ACCESS_KEY_ID and \
                 AWS_SECRET_ACCESS_KEY, use --profile, or put access_key_id and \
                 secret_access_key in the config file ({})",
                detail(&d)
            )
        }
        StoreError::AccessDenied(d) => format!(
            "access denied to bucket {bucket}: check credentials ({})",
            detail(&d)
        ),
        StoreError::NoSuchBucket(_) => {
            format!("bucket {bucket} does not exist (endpoint {endpoint}{path_hint})")
        }
        StoreError::NotFound(d) => format!(
            "bucket {bucket} does not exist (endpoint {endpoint}: {}{path_hint})",
            detail(&d)
        ),
        StoreError::Transient(d) => {
            format!("cannot reach endpoint {endpoint}: {}", detail(&d))
        }
        e => format!(
            "cannot access bucket {bucket} at {endpoint}: {}",
            one_line(&e.to_string())
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn access_errors_are_one_line() {
        let m = access_error(
            StoreError::AccessDenied("bucket b: 403 InvalidAccessKeyId The key\nis bad".into()),
            "b",
            "http://h",
        );
        assert_eq!(
            m,
            "access denied to bucket b: check credentials (403 InvalidAccessKeyId The key is bad)"
        );
        assert_eq!(
            access_error(StoreError::NoSuchBucket("x".into()), "b", "http://h"),
            "bucket b does not exist (endpoint http://h)"
        );
        assert_eq!(
            access_error(
                StoreError::NoSuchBucket("x".into()),
                "b",
                "http://h:9/minio/"
            ),
            "bucket b does not exist (endpoint http://h:9/minio/; the endpoint has a path \
             (/minio): S3 endpoints seldom do, try without it)"
        );
        let plain = "bucket b: TLS failure (is it an http:// endpoint?): dispatch failure: \
                     received corrupt message of type InvalidContentType";
        assert!(
            access_error(StoreError::Other(plain.into()), "b", "https://h:9000").starts_with(
                "https://h:9000 does not speak HTTPS: TLS failure (is it an http:// endpoint?)"
            )
        );
        assert!(access_error(
            StoreError::Transient("bucket b: dispatch failure: Connection refused".into()),
            "b",
            "http://h"
        )
        .starts_with("cannot reach endpoint http://h: dispatch failure"));
        assert_eq!(
            short_detail(
                "dispatch failure: io error: Connection refused (os error 111) \
                 (DispatchFailure(DispatchFailure { source: x }))"
            ),
            "dispatch failure: io error: Connection refused (os error 111)"
        );
    }

    #[test]
    fn mountpoint_checks() {
        let d = tempfile::tempdir().unwrap();
        assert!(check_mountpoint(d.path(), false, false).is_ok());
        std::fs::write(d.path().join("f"), b"x").unwrap();
        let e = check_mountpoint(d.path(), false, false).unwrap_err();
        assert!(e.contains("is not empty"), "{e}");
        assert!(check_mountpoint(d.path(), true, false).is_ok());
        let e = check_mountpoint(&d.path().join("f"), false, false).unwrap_err();
        assert!(e.contains("is not a directory"), "{e}");
        let e = check_mountpoint(&d.path().join("nope"), false, false).unwrap_err();
        assert!(e.contains("does not exist"), "{e}");
        // `/` is a mount point everywhere.
        let e = check_mountpoint(Path::new("/"), true, false).unwrap_err();
        assert!(e.contains("is already a mount point"), "{e}");
        assert!(check_mountpoint(Path::new("/"), true, true).is_ok());
    }
}
