//! The `fuser::Filesystem` implementation: one kernel request → one async `Fs` call.
//!
//! Each request handler copies what it needs out of the request (names, the caller's uid/gid,
//! write data) into a future that calls the fs and answers the kernel (fuser 0.18 replies are
//! `Send`). The FUSE thread polls it once itself: a call answered from memory or the local disk
//! finishes there, with no thread switch; one that waits for the network goes on as a task on
//! the tokio runtime, so a FUSE thread never waits for the network. Errors are errnos
//! (`FsError(e)` → `reply.error(Errno::from_i32(e))`); a panic in a call drops its reply, which
//! fuser answers with `EIO`.
//!
//! FUSE passthrough (Linux 6.9+, `CAP_SYS_ADMIN`, a data cache, not `--no-passthrough`): an
//! open whose `OpenReply::local` names a file is answered with a backing id of it, and the
//! kernel then reads that file itself. The kernel wants one backing per inode while any of
//! its opens uses it, so the ids are kept per inode ([`Backings`]) until the last handle
//! that uses one is released.

use bucketfs_fs::{Attr, Caller, FileKind, Fs, FsError, Now, OpenReply, SetAttr};
use fuser::{
    BackingId, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo,
    InitFlags, IoctlFlags, KernelConfig, LockOwner, Notifier, OpenFlags, RenameFlags, ReplyAttr,
    ReplyCreate, ReplyData, ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyIoctl,
    ReplyOpen, ReplyStatfs, ReplyWrite, Request, TimeOrNow, WriteFlags,
};
use std::collections::HashMap;
use std::ffi::OsStr;
use std::future::Future;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, SystemTime};
use tokio::runtime::Handle;
use tokio::sync::watch;
use tracing::{debug, info, trace, warn};

/// Largest write the kernel may send in one request.
pub(crate) const MAX_WRITE: u32 = 1024 * 1024;
/// Readahead we ask for at `init`; the kernel caps it (usually at 128 KiB), which is why the
/// mount's bdi `read_ahead_kb` is raised afterwards.
pub(crate) const MAX_READAHEAD: u32 = 1024 * 1024;
/// Background requests (readahead, async reads) the kernel keeps in flight.
const MAX_BACKGROUND: u16 = 64;
const CONGESTION_THRESHOLD: u16 = 48;

/// The kernel's view of an fs-core attribute.
pub fn file_attr(a: &Attr) -> FileAttr {
    FileAttr {
        ino: INodeNo(a.ino),
        size: a.size,
        blocks: a.blocks(),
        atime: a.atime,
        mtime: a.mtime,
        ctime: a.ctime,
        crtime: a.ctime,
        kind: file_type(a.kind),
        perm: a.perm,
        nlink: a.nlink(),
        uid: a.uid,
        gid: a.gid,
        rdev: 0,
        // The I/O size programs pick from st_blksize (cp, stdio and Python buffers): one FUSE
        // write each, instead of eight 128 KiB ones.
        blksize: MAX_WRITE,
        flags: 0,
    }
}

fn file_type(k: FileKind) -> FileType {
    match k {
        FileKind::File => FileType::RegularFile,
        FileKind::Dir => FileType::Directory,
        FileKind::Symlink => FileType::Symlink,
    }
}

fn time(t: TimeOrNow) -> SystemTime {
    match t {
        TimeOrNow::SpecificTime(t) => t,
        TimeOrNow::Now => SystemTime::now(),
    }
}

/// Logs a failed call (quietly for the expected ones) and turns it into the reply errno.
fn errno(op: &'static str, e: FsError) -> Errno {
    if e.0 == libc::ENOENT || e.0 == libc::EEXIST || e.0 == libc::ENOTEMPTY {
        trace!("{op}: {e}");
    } else {
        debug!("{op}: {e}");
    }
    Errno::from_i32(e.0)
}

fn caller(req: &Request) -> Caller {
    Caller {
        uid: req.uid(),
        gid: req.gid(),
    }
}

/// The extended attribute whose setting asks the mount to refresh a path (what older
/// versions of `bucketfs refresh` do).
pub const REFRESH_XATTR: &str = "user.bucketfs.refresh";

/// The ioctl (`_IO('B', 0xF5)`, no data) on an open file or directory that asks the mount to
/// refresh it: an open needs only read access and works on a read-only mount, where the
/// kernel refuses to set [`REFRESH_XATTR`] before the mount sees it.
pub const REFRESH_IOCTL: u32 = ((b'B' as u32) << 8) | 0xF5;

/// The backing ids handed to the kernel: one per inode, held by each handle using it.
#[derive(Default)]
struct Backings {
    by_ino: HashMap<u64, Weak<BackingId>>,
    by_fh: HashMap<u64, Arc<BackingId>>,
}

/// The adapter the FUSE session drives.
pub(crate) struct FuseFs {
    fs: Arc<Fs>,
    /// Passthrough is wanted (not `--no-passthrough`).
    passthrough: bool,
    backings: Arc<Mutex<Backings>>,
    /// A backing id was refused (logged once; passthrough is then off).
    refused: Arc<AtomicBool>,
    rt: Handle,
    /// Set to `true` when the session ends (the kernel dropped the mount).
    done: watch::Sender<bool>,
    /// Handles open for writing and the task (thread) that opened each.
    writers: Arc<Mutex<HashMap<u64, u32>>>,
    /// Threads whose open got `ESTALE` just now (see [`StaleOpens`]).
    stale_opens: Arc<Mutex<StaleOpens>>,
    /// The session's notifier, set once the session runs; owned here so that it goes (with
    /// its /dev/fuse descriptor) when the session ends.
    notifier: Arc<OnceLock<Notifier>>,
    /// The kernel's id of this mount (`mnt_id` in /proc/PID/fdinfo), set once mounted.
    mount_id: Arc<OnceLock<u64>>,
}

/// Tells the kernel that its attributes of `ino` are of an older version (see
/// [`Fs::on_stale_cache`]), so that its next read past the size it knows asks for them.
/// Called while a read of `ino` waits for its reply, or from a timer: invalidating
/// attributes only locks no page, so it cannot wait for that read.
fn invalidate_attr(notifier: &std::sync::Weak<OnceLock<Notifier>>, ino: u64) {
    let Some(cell) = notifier.upgrade() else {
        return;
    };
    if let Some(n) = cell.get() {
        if let Err(e) = n.inval_inode(INodeNo(ino), -1, 0) {
            debug!("invalidating attributes of inode {ino}: {e}");
        }
    }
}

/// The fdinfo files of task `pid`'s descriptors of files (their link is a path), at most
/// 1,024 (a process with more gets its close stored now). Not the others: the fdinfo of an
/// epoll whose lock its owner holds (a poll of its own FUSE mount left unanswered) blocks its
/// reader for good, and inotify's can be megabytes; the task is any user's.
fn file_fdinfos(pid: u32) -> impl Iterator<Item = PathBuf> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
        .take(1024)
        .filter(|e| {
            std::fs::read_link(e.path()).is_ok_and(|l| l.as_os_str().as_bytes().starts_with(b"/"))
        })
        .map(move |e| PathBuf::from(format!("/proc/{pid}/fdinfo")).join(e.file_name()))
}

/// Whether an fdinfo text describes a descriptor of inode `ino` on mount `mnt`.
fn fdinfo_names(info: &str, mnt: u64, ino: u64) -> bool {
    let field = |name: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    field("mnt_id:") == Some(mnt) && field("ino:") == Some(ino)
}

/// Whether task `task` is a thread of the same process as task `opener`. Reads nothing when
/// they are the same task (the usual close); otherwise looks up /proc/TASK/task/OPENER,
/// which exists only when both are threads of one process. When the opener is gone, or a
/// task is outside the daemon's pid namespace (pid 0), it cannot tell and says yes: a close
/// wrongly taken for the opener's uploads a version early, one wrongly taken for a child's
/// would return before the upload.
fn same_process(task: u32, opener: u32) -> bool {
    task == opener
        || task == 0
        || std::fs::symlink_metadata(format!("/proc/{opener}")).is_err()
        || std::fs::symlink_metadata(format!("/proc/{task}/task/{opener}")).is_ok()
}

impl FuseFs {
    pub(crate) fn new(
        fs: Arc<Fs>,
        rt: Handle,
        done: watch::Sender<bool>,
        passthrough: bool,
    ) -> Self {
        let notifier: Arc<OnceLock<Notifier>> = Arc::default();
        let weak = Arc::downgrade(&notifier);
        fs.on_stale_cache(Some(Arc::new(move |ino| invalidate_attr(&weak, ino))));
        Self {
            fs,
            passthrough,
            backings: Arc::default(),
            refused: Arc::default(),
            rt,
            done,
            writers: Arc::default(),
            stale_opens: Arc::default(),
            notifier,
            mount_id: Arc::default(),
        }
    }

    /// Where [`crate::mount`] puts the mount's id once it is mounted.
    pub(crate) fn mount_id_slot(&self) -> Arc<OnceLock<u64>> {
        self.mount_id.clone()
    }

    /// Whether task `pid` still has a descriptor open on inode `ino` of this mount (read from
    /// /proc/PID/fdinfo: no request to this mount). The descriptor being closed is already
    /// out of its table when the flush comes, so any found is another one.
    fn holds_descriptor_of(&self, pid: u32, ino: u64) -> bool {
        let Some(&mnt) = self.mount_id.get() else {
            return false;
        };
        file_fdinfos(pid)
            .any(|p| std::fs::read_to_string(p).is_ok_and(|info| fdinfo_names(&info, mnt, ino)))
    }

    /// Where [`crate::mount`] puts the session's notifier once it runs.
    pub(crate) fn notifier_slot(&self) -> Arc<OnceLock<Notifier>> {
        self.notifier.clone()
    }

    /// Whether a flush of `fh` by task `pid` is a close by another process than the one that
    /// opened the file for writing: a forked child closing its inherited copy (at exit, or at
    /// exec for O_CLOEXEC descriptors). Such a close must not publish a file the opener is
    /// still writing; the opener's own close (or the release of the last descriptor) does.
    fn foreign_flush(&self, fh: u64, pid: u32) -> bool {
        let Some(opener) = self.writers.lock().unwrap().get(&fh).copied() else {
            return false;
        };
        !same_process(pid, opener)
    }

    /// Serves a request: polled here first, so one that needs nothing from the network is
    /// answered on this FUSE thread (see `bucketfs_fs::poll_here`); the rest of one that must
    /// wait runs as a task.
    fn serve<F>(&self, fut: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        // One request is one operation: its store calls share one stall deadline.
        // Entered first, so that it is left last: an operation dropped here (finished, or
        // after a panic) drops what it holds inside the runtime's context.
        let _rt = self.rt.enter();
        let mut op = Box::pin(bucketfs_fs::within_operation(fut));
        let polled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            bucketfs_fs::poll_here(op.as_mut())
        }));
        // A panic dropped nothing yet: dropping the operation drops its reply (EIO), as a
        // task's panic does, and this thread goes on serving.
        if matches!(polled, Ok(std::task::Poll::Pending)) {
            self.rt.spawn(op);
        }
    }

    /// Asks the kernel for passthrough when it can be used, and says once why not.
    fn init_passthrough(&self, config: &mut KernelConfig) {
        if !self.passthrough || !self.fs.has_data_cache() {
            return;
        }
        let why_not = if !config.capabilities().contains(InitFlags::FUSE_PASSTHROUGH) {
            "the kernel does not offer it (Linux 6.9+ with CONFIG_FUSE_PASSTHROUGH)"
        } else if !has_cap_sys_admin() {
            "it needs CAP_SYS_ADMIN (mount as root)"
        } else if config
            .add_capabilities(InitFlags::FUSE_PASSTHROUGH)
            .is_err()
            // Depth 1: the cache files may not be on a stacked file system (overlayfs), and
            // this mount may still be a layer of one.
            || config.set_max_stack_depth(1).is_err()
        {
            "the kernel refused it"
        } else {
            self.fs.enable_passthrough();
            info!("FUSE passthrough on: files the data cache holds whole are read by the kernel");
            return;
        };
        info!("FUSE passthrough off: {why_not}; cached files are read through the daemon");
    }

    /// Answers an open whose file may be read by the kernel from `local`, falling back to the
    /// daemon's reads when the kernel refuses the backing file.
    #[allow(clippy::too_many_arguments)]
    fn reply_open_local(
        fs: &Fs,
        backings: &Mutex<Backings>,
        refused: &AtomicBool,
        ino: u64,
        fh: u64,
        local: Option<&std::fs::File>,
        flags: FopenFlags,
        reply: ReplyOpen,
    ) {
        let Some(file) = local else {
            return reply.opened(FileHandle(fh), flags);
        };
        let mut b = backings.lock().unwrap();
        let id = match b.by_ino.get(&ino).and_then(Weak::upgrade) {
            Some(id) => Ok(id),
            // Opens that shared the copy of a refused one: the kernel would refuse them too.
            None if refused.load(Ordering::Relaxed) => {
                Err(std::io::Error::other("refused earlier"))
            }
            None => reply.open_backing(file).map(Arc::new),
        };
        match id {
            Ok(id) => {
                b.by_ino.insert(ino, Arc::downgrade(&id));
                b.by_fh.insert(fh, id.clone());
                drop(b);
                fs.passed_through(ino, fh, true);
                // Only the flags that still mean something when the kernel reads the file
                // itself (no page of this inode is cached through FUSE).
                let f = flags & FopenFlags::FOPEN_NOFLUSH;
                reply.opened_passthrough(FileHandle(fh), f, &id);
            }
            Err(e) => {
                drop(b);
                if !refused.swap(true, Ordering::Relaxed) {
                    warn!("FUSE passthrough refused by the kernel ({e}): off for this mount");
                }
                fs.passed_through(ino, fh, false);
                reply.opened(FileHandle(fh), flags);
            }
        }
    }

    fn reply_entry(fs: &Fs, op: &'static str, r: Result<Attr, FsError>, reply: ReplyEntry) {
        match r {
            Ok(a) => reply.entry(&fs.entry_ttl(&a), &file_attr(&a), Generation(0)),
            Err(e) => reply.error(errno(op, e)),
        }
    }

    fn reply_empty(op: &'static str, r: Result<(), FsError>, reply: ReplyEmpty) {
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(op, e)),
        }
    }
}

/// Threads (task ids) whose open got `ESTALE` (its file removed by an unlink or a rename
/// over it while the open came), and when: the kernel looks the name up again and tries the
/// open once more, from the same thread, at once; that try is [`Fs::open_retried`].
#[derive(Default)]
struct StaleOpens(HashMap<u32, std::time::Instant>);

impl StaleOpens {
    /// How soon after the first the kernel's second try comes (at once: its lookup and open).
    const WITHIN: Duration = Duration::from_secs(1);

    fn note(&mut self, pid: u32) {
        if self.0.len() >= 1024 {
            self.0.retain(|_, at| at.elapsed() < Self::WITHIN);
        }
        self.0.insert(pid, std::time::Instant::now());
    }

    /// Whether `pid`'s open got `ESTALE` within [`Self::WITHIN`] (forgotten now).
    fn took(&mut self, pid: u32) -> bool {
        self.0
            .remove(&pid)
            .is_some_and(|at| at.elapsed() < Self::WITHIN)
    }
}

/// Whether this process has CAP_SYS_ADMIN, which the kernel wants for a backing file.
fn has_cap_sys_admin() -> bool {
    const CAP_SYS_ADMIN: u32 = 21;
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let v = s
                .lines()
                .find_map(|l| l.strip_prefix("CapEff:"))?
                .trim()
                .to_string();
            u64::from_str_radix(&v, 16).ok()
        })
        .is_some_and(|caps| caps & (1 << CAP_SYS_ADMIN) != 0)
}

/// How the kernel treats an opened file. A write-only descriptor bypasses the page cache
/// (it cannot be mmapped, and nothing reads through it): each write reaches the daemon
/// without first being copied into cache pages, and the cache is not filled with data the
/// writer will not read back. So does one the daemon serves `uncached`.
fn open_flags(flags: i32, o: &OpenReply) -> FopenFlags {
    let mut f = FopenFlags::empty();
    if o.keep_cache {
        f |= FopenFlags::FOPEN_KEEP_CACHE;
    }
    if o.uncached || flags & libc::O_ACCMODE == libc::O_WRONLY {
        f |= FopenFlags::FOPEN_DIRECT_IO;
    }
    f
}

impl Filesystem for FuseFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> io::Result<()> {
        if let Err(max) = config.set_max_write(MAX_WRITE) {
            let _ = config.set_max_write(max);
        }
        if let Err(max) = config.set_max_readahead(MAX_READAHEAD) {
            let _ = config.set_max_readahead(max);
        }
        let _ = config.set_max_background(MAX_BACKGROUND);
        let _ = config.set_congestion_threshold(CONGESTION_THRESHOLD);
        // Asynchronous reads let the kernel keep several reads of one file in flight.
        // Parallel directory operations let lookups in one directory run concurrently.
        // Writeback cache stays off: close() must see upload errors and sizes must be exact.
        // Readdirplus (the kernel's adaptive mode: for a directory's first batch, and then only
        // while its entries get looked up) hands `ls -l` the attributes a listing carried.
        // Atomic O_TRUNC: the open gets O_TRUNC, so the truncation counts as a change of its
        // descriptor (without it the kernel sends a SETATTR with no file handle, and `: > f`
        // of a file another process has open for writing was stored only at that one's close).
        // Shared mappings of a descriptor served `uncached` (see `open_flags`) work as they do
        // for any other (through the page cache) rather than failing with ENODEV.
        for flag in [
            InitFlags::FUSE_ASYNC_READ,
            InitFlags::FUSE_ATOMIC_O_TRUNC,
            InitFlags::FUSE_PARALLEL_DIROPS,
            InitFlags::FUSE_DO_READDIRPLUS,
            InitFlags::FUSE_READDIRPLUS_AUTO,
            InitFlags::FUSE_DIRECT_IO_ALLOW_MMAP,
        ] {
            if config.capabilities().contains(flag) {
                let _ = config.add_capabilities(flag);
            }
        }
        self.init_passthrough(config);
        info!(
            "FUSE session started (kernel ABI {}, max_write {} KiB)",
            config.kernel_abi(),
            MAX_WRITE / 1024
        );
        Ok(())
    }

    fn destroy(&mut self) {
        debug!("FUSE session ended");
        self.done.send_replace(true);
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let fs = self.fs.clone();
        let name = name.to_owned();
        self.serve(async move {
            let r = fs.lookup(parent.0, &name).await;
            Self::reply_entry(&fs, "lookup", r, reply);
        });
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        self.fs.forget(ino.0, nlookup);
    }

    // `batch_forget` keeps fuser's default (one `forget` per node): fuser 0.18 does not export
    // the `ForgetOne` type its signature names.

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        let fs = self.fs.clone();
        self.serve(async move {
            match fs.getattr(ino.0).await {
                Ok(a) => reply.attr(&fs.attr_ttl(&a), &file_attr(&a)),
                Err(e) => reply.error(errno("getattr", e)),
            }
        });
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let fs = self.fs.clone();
        let set = SetAttr {
            mode,
            uid,
            gid,
            size,
            atime: atime.map(time),
            mtime: mtime.map(time),
        };
        self.serve(async move {
            match fs.setattr(ino.0, fh.map(|f| f.0), set).await {
                Ok(a) => reply.attr(&fs.attr_ttl(&a), &file_attr(&a)),
                Err(e) => reply.error(errno("setattr", e)),
            }
        });
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        let fs = self.fs.clone();
        self.serve(async move {
            match fs.readlink(ino.0).await {
                Ok(target) => reply.data(&target),
                Err(e) => reply.error(errno("readlink", e)),
            }
        });
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        _rdev: u32,
        reply: ReplyEntry,
    ) {
        let fs = self.fs.clone();
        let name = name.to_owned();
        let who = caller(req);
        self.serve(async move {
            let r = fs.mknod(parent.0, &name, mode, umask, who).await;
            Self::reply_entry(&fs, "mknod", r, reply);
        });
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let fs = self.fs.clone();
        let name = name.to_owned();
        let who = caller(req);
        self.serve(async move {
            let r = fs.mkdir(parent.0, &name, mode, umask, who).await;
            Self::reply_entry(&fs, "mkdir", r, reply);
        });
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let fs = self.fs.clone();
        let name = name.to_owned();
        self.serve(async move {
            Self::reply_empty("unlink", fs.unlink(parent.0, &name).await, reply);
        });
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let fs = self.fs.clone();
        let name = name.to_owned();
        self.serve(async move {
            Self::reply_empty("rmdir", fs.rmdir(parent.0, &name).await, reply);
        });
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let fs = self.fs.clone();
        let name = link_name.to_owned();
        let target = target.to_owned();
        let who = caller(req);
        self.serve(async move {
            let r = fs.symlink(parent.0, &name, &target, who).await;
            Self::reply_entry(&fs, "symlink", r, reply);
        });
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let fs = self.fs.clone();
        let name = name.to_owned();
        let newname = newname.to_owned();
        self.serve(async move {
            let r = fs
                .rename(parent.0, &name, newparent.0, &newname, flags.bits())
                .await;
            Self::reply_empty("rename", r, reply);
        });
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let fs = self.fs.clone();
        let writable = flags.0 & libc::O_ACCMODE != libc::O_RDONLY;
        let opener = (writable && req.pid() != 0).then(|| req.pid());
        let writers = self.writers.clone();
        let (backings, refused) = (self.backings.clone(), self.refused.clone());
        let stale_opens = self.stale_opens.clone();
        let pid = req.pid();
        self.serve(async move {
            // The kernel's one try again of this thread's open that got ESTALE just now.
            let retried = pid != 0 && stale_opens.lock().unwrap().took(pid);
            let opened = match retried {
                true => fs.open_retried(ino.0, flags.0).await,
                false => fs.open(ino.0, flags.0).await,
            };
            if opened.as_ref().is_err_and(|e| *e == FsError::ESTALE) && pid != 0 {
                stale_opens.lock().unwrap().note(pid);
            }
            match opened {
                Ok(o) => {
                    if let Some(p) = opener {
                        writers.lock().unwrap().insert(o.fh, p);
                    }
                    let mut f = open_flags(flags.0, &o);
                    if !writable {
                        // The close of a descriptor that cannot write has nothing to store
                        // (`create` always does): no FLUSH, whose round trip each close
                        // would wait for.
                        f |= FopenFlags::FOPEN_NOFLUSH;
                    }
                    let local = o.local.as_deref();
                    Self::reply_open_local(&fs, &backings, &refused, ino.0, o.fh, local, f, reply);
                }
                Err(e) => reply.error(errno("open", e)),
            }
        });
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let fs = self.fs.clone();
        self.serve(async move {
            match fs.read(ino.0, fh.0, offset, size).await {
                Ok(data) => reply.data(&data),
                Err(e) => reply.error(errno("read", e)),
            }
        });
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        // A writer without CAP_FSETID clears set-id bits. The kernel does it itself (by a
        // setattr) for writes through the page cache; a direct-I/O write only carries this flag.
        let kill_suid = write_flags.contains(WriteFlags::FUSE_WRITE_KILL_SUIDGID);
        let append = flags.0 & libc::O_APPEND != 0;
        match self
            .fs
            .write_now(ino.0, fh.0, offset, data, kill_suid, append)
        {
            Now::Done(Ok(n)) => reply.written(n),
            Now::Done(Err(e)) => reply.error(errno("write", e)),
            Now::Later(task) => self.serve(async move {
                match task.await {
                    Ok(n) => reply.written(n),
                    Err(e) => reply.error(errno("write", e)),
                }
            }),
        }
    }

    fn flush(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        if self.foreign_flush(fh.0, req.pid()) {
            debug!(
                "flush of handle {} by pid {} (not the process that opened it): not uploading",
                fh.0,
                req.pid()
            );
            reply.ok();
            return;
        }
        if self.fs.close_stores_only_emptiness(ino.0, fh.0)
            && self.holds_descriptor_of(req.pid(), ino.0)
        {
            // A duplicate of the descriptor stays open (`echo x > f`): its close stores the
            // file, with what is written meanwhile, instead of an empty one now and again then.
            debug!(
                "flush of empty handle {} with a duplicate open: left to its close",
                fh.0
            );
            reply.ok();
            return;
        }
        match self.fs.publish_now(ino.0, fh.0, false) {
            Now::Done(r) => Self::reply_empty("flush", r, reply),
            Now::Later(task) => self.serve(async move {
                Self::reply_empty("flush", task.await, reply);
            }),
        }
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        self.writers.lock().unwrap().remove(&fh.0);
        {
            // The backing id goes with the last handle of the inode that uses it.
            let mut b = self.backings.lock().unwrap();
            if b.by_fh.remove(&fh.0).is_some()
                && b.by_ino.get(&ino.0).is_some_and(|w| w.strong_count() == 0)
            {
                b.by_ino.remove(&ino.0);
            }
        }
        let fs = self.fs.clone();
        self.serve(async move {
            Self::reply_empty("release", fs.release(ino.0, fh.0).await, reply);
        });
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        match self.fs.publish_now(ino.0, fh.0, true) {
            Now::Done(r) => Self::reply_empty("fsync", r, reply),
            Now::Later(task) => self.serve(async move {
                Self::reply_empty("fsync", task.await, reply);
            }),
        }
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        let fs = self.fs.clone();
        self.serve(async move {
            Self::reply_empty("fsyncdir", fs.fsyncdir(ino.0).await, reply);
        });
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let fs = self.fs.clone();
        self.serve(async move {
            match fs.opendir(ino.0).await {
                Ok(fh) => reply.opened(FileHandle(fh), FopenFlags::empty()),
                Err(e) => reply.error(errno("opendir", e)),
            }
        });
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let fs = self.fs.clone();
        self.serve(async move {
            match fs.readdir(ino.0, fh.0, offset as i64).await {
                Ok(entries) => {
                    for e in &entries {
                        let full = reply.add(
                            INodeNo(e.ino),
                            e.next_offset as u64,
                            file_type(e.kind),
                            &e.name,
                        );
                        if full {
                            break;
                        }
                    }
                    reply.ok();
                }
                Err(e) => reply.error(errno("readdir", e)),
            }
        });
    }

    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        let fs = self.fs.clone();
        self.serve(async move {
            match fs.readdir(ino.0, fh.0, offset as i64).await {
                Ok(entries) => {
                    for e in &entries {
                        // Registered one at a time: the entry that does not fit is given back.
                        let Some((attr, complete)) = fs.plus_entry(ino.0, e) else {
                            continue;
                        };
                        // What a listing carried without user metadata is asked again at its stat.
                        let t = if complete {
                            fs.entry_ttl(&attr)
                        } else {
                            Duration::ZERO
                        };
                        let full = reply.add(
                            INodeNo(attr.ino),
                            e.next_offset as u64,
                            &e.name,
                            &t,
                            &file_attr(&attr),
                            Generation(0),
                        );
                        if full {
                            if !e.is_dot() {
                                fs.forget(attr.ino, 1);
                            }
                            break;
                        }
                    }
                    reply.ok();
                }
                Err(e) => reply.error(errno("readdirplus", e)),
            }
        });
    }

    fn releasedir(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        self.fs.releasedir(ino.0, fh.0);
        reply.ok();
    }

    /// Only `user.bucketfs.refresh` is understood: it drops what this mount cached about the
    /// file (`bucketfs refresh PATH` sets it). Other attributes cannot be stored.
    fn setxattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        name: &OsStr,
        _value: &[u8],
        _flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        if name == REFRESH_XATTR {
            Self::reply_empty("refresh", self.fs.refresh(ino.0), reply);
        } else {
            reply.error(Errno::EOPNOTSUPP);
        }
    }

    /// Only [`REFRESH_IOCTL`] (`bucketfs refresh`); `ENOTTY` for any other, as a file
    /// system without ioctls answers.
    fn ioctl(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _flags: IoctlFlags,
        cmd: u32,
        _in_data: &[u8],
        _out_size: u32,
        reply: ReplyIoctl,
    ) {
        if cmd != REFRESH_IOCTL {
            return reply.error(Errno::ENOTTY);
        }
        match self.fs.refresh(ino.0) {
            Ok(()) => {
                // The kernel's attributes too (setting the attribute made it drop them).
                invalidate_attr(&Arc::downgrade(&self.notifier), ino.0);
                reply.ioctl(0, &[]);
            }
            Err(e) => reply.error(errno("refresh", e)),
        }
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let s = self.fs.statfs();
        reply.statfs(
            s.blocks, s.bfree, s.bavail, s.files, s.ffree, s.bsize, s.namelen, s.frsize,
        );
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let fs = self.fs.clone();
        let name = name.to_owned();
        let who = caller(req);
        let opener = (req.pid() != 0).then(|| req.pid());
        let writers = self.writers.clone();
        self.serve(async move {
            match fs.create(parent.0, &name, mode, umask, flags, who).await {
                Ok((a, o)) => {
                    if let Some(p) = opener {
                        writers.lock().unwrap().insert(o.fh, p);
                    }
                    let f = open_flags(flags, &o);
                    reply.created(
                        &fs.entry_ttl(&a),
                        &file_attr(&a),
                        Generation(0),
                        FileHandle(o.fh),
                        f,
                    );
                }
                Err(e) => reply.error(errno("create", e)),
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, UNIX_EPOCH};

    #[test]
    fn attr_conversion() {
        let t = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let a = Attr {
            ino: 42,
            kind: FileKind::Dir,
            size: 1000,
            perm: 0o750,
            uid: 7,
            gid: 8,
            mtime: t,
            atime: t,
            ctime: t,
        };
        let f = file_attr(&a);
        assert_eq!(f.ino, INodeNo(42));
        assert_eq!(f.kind, FileType::Directory);
        assert_eq!((f.perm, f.uid, f.gid, f.nlink), (0o750, 7, 8, 2));
        assert_eq!((f.blksize, f.rdev, f.flags, f.blocks), (MAX_WRITE, 0, 0, 2));
        assert_eq!(Errno::from_i32(FsError::ENOENT.0), Errno::ENOENT);
    }

    /// Only descriptors of files are read: an epoll's fdinfo can block its reader for good.
    #[test]
    fn only_the_fdinfo_of_files_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let file = std::fs::File::create(dir.path().join("f")).unwrap();
        // SAFETY: plain syscalls; the descriptors are closed below.
        let epoll = unsafe { libc::epoll_create1(0) };
        let mut pipe = [0; 2];
        assert_eq!(unsafe { libc::pipe(pipe.as_mut_ptr()) }, 0);
        assert!(epoll >= 0);
        let names: Vec<String> = file_fdinfos(std::process::id())
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        for fd in [epoll, pipe[0], pipe[1]] {
            assert!(!names.contains(&fd.to_string()), "fd {fd} read: {names:?}");
            unsafe { libc::close(fd) };
        }
        assert!(names.contains(&std::os::fd::AsRawFd::as_raw_fd(&file).to_string()));
    }

    #[test]
    fn two_threads_are_one_process_and_a_child_is_another() {
        let me = std::process::id();
        let main_task = unsafe { libc::gettid() } as u32;
        let (tx, rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let t = std::thread::spawn(move || {
            tx.send(unsafe { libc::gettid() } as u32).unwrap();
            done_rx.recv().ok();
        });
        let other_task = rx.recv().unwrap();
        assert!(same_process(other_task, main_task));
        assert!(same_process(main_task, other_task));
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        assert!(!same_process(child.id(), main_task));
        assert!(!same_process(child.id(), other_task));
        assert!(same_process(child.id(), child.id()));
        child.kill().ok();
        child.wait().ok();
        // The child is gone: its pid says nothing any more, so a close is taken for the opener's.
        assert!(same_process(me, child.id()));
        done_tx.send(()).ok();
        t.join().unwrap();
    }
}
