//! The file system: every operation the kernel can ask for, as an async call on [`Fs`].
//!
//! Paths map to keys by [`crate::names`]; attributes by [`crate::meta`]; reads go through
//! [`crate::files::read::Reader`], writes through [`crate::files::write::WriteState`]. Locks on the inode
//! and handle tables are never held across a store request.

use crate::budget::MemoryBudget;
use crate::config::FsConfig;
use crate::error::{log_store_err, FsError, FsResult};
use crate::files::read::{ReadConfig, Reader};
use crate::files::write::{Appended, Base, PartLayout, WriteConfig, WriteState};
use crate::meta::{Attr, AttrPolicy, FileKind, PosixMeta};
use crate::metrics::{inc, FsMetrics};
use crate::namespace::inode::{join, DirListing, Ino, Inode, InodeTable, OpenWrite, ROOT_INO};
use crate::namespace::lookup::{page_entries, CacheLimits, Found, Lookups, LIST_PAGE};
use crate::namespace::markers::PendingMarkers;
use crate::namespace::names::{check_name, UNLINKED_DIR};
use dir::{DirMisses, DirStream, ListingSays};

mod dir;
use bucketfs_store::{
    run_bounded, CompletedPart, ListDetail, ListFrom, ObjectMeta, ObjectStore, StoreError, Uploads,
    UserMeta, MAX_COPY_OBJECT_SIZE,
};
use bytes::Bytes;
use futures::future::BoxFuture;
use futures::stream::{self, StreamExt, TryStreamExt};
use futures::FutureExt;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Who is making a call (from the FUSE request header); owns what it creates.
#[derive(Debug, Clone, Copy)]
pub struct Caller {
    pub uid: u32,
    pub gid: u32,
}

/// One directory entry as `readdir` returns it.
#[derive(Debug, Clone)]
pub struct DirEntry {
    pub ino: Ino,
    /// Cookie of the entry after this one: pass it back to continue the listing.
    pub next_offset: i64,
    pub kind: FileKind,
    pub name: String,
}

impl DirEntry {
    /// `.` or `..`: not a lookup of anything when handed to the kernel.
    pub fn is_dot(&self) -> bool {
        self.name == "." || self.name == ".."
    }
}

/// Result of `open`/`create`.
#[derive(Debug, Clone, Copy)]
pub struct OpenReply {
    pub fh: u64,
    /// The kernel may keep its page cache for this file (content unchanged since last open).
    pub keep_cache: bool,
}

/// The attribute changes of one `setattr`; `None` leaves a field alone.
#[derive(Debug, Clone, Default)]
pub struct SetAttr {
    /// Permission bits (the type bits are ignored).
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub size: Option<u64>,
    pub atime: Option<SystemTime>,
    pub mtime: Option<SystemTime>,
}

/// What `statfs` reports: a bucket has no real capacity, so it is large and constant.
#[derive(Debug, Clone, Copy)]
pub struct StatFs {
    pub blocks: u64,
    pub bfree: u64,
    pub bavail: u64,
    pub files: u64,
    pub ffree: u64,
    pub bsize: u32,
    pub namelen: u32,
    pub frsize: u32,
}

/// Longest object key S3 accepts, in bytes.
const MAX_KEY_LEN: usize = 1024;
/// Requests in flight at once for directory renames (copy, then delete).
const RENAME_CONCURRENCY: usize = 16;
/// Part size of server-side copies of objects too big for one CopyObject.
const COPY_PART_SIZE: u64 = 512 * 1024 * 1024;
/// Longest directory name whose marker mkdir uploads in the background. MinIO stores a
/// marker `name/` as a file `name__XLDIR__` and refuses it when that passes 255 bytes; a
/// longer name gets its marker before mkdir answers, so the refusal reaches the caller.
const BACKGROUND_MARKER_MAX_NAME: usize = 246;
/// How often aborts that failed are tried again.
const ORPHAN_RETRY: Duration = Duration::from_secs(5);
/// An open file: its read state and, when opened for writing, the inode's shared write state.
#[derive(Clone)]
struct FileHandle {
    ino: Ino,
    flags: i32,
    /// Opened with the kernel's cached pages kept: it may have handed out bytes this handle
    /// never read through the fs.
    keep_cache: bool,
    reader: Arc<tokio::sync::Mutex<Option<Reader>>>,
    write: Option<Arc<OpenWrite>>,
}

/// A file still open here whose name a rename takes (see [`Fs::rename_file`]).
struct Replaced {
    ino: Ino,
    write: Option<Arc<OpenWrite>>,
    in_store: bool,
}

type StateGuard<'a> = tokio::sync::MutexGuard<'a, WriteState>;

/// Locks the write states of two files in inode order, so that two renames crossing each
/// other cannot deadlock.
async fn lock_in_order<'a>(
    a: (Ino, Option<&'a OpenWrite>),
    b: Option<(Ino, Option<&'a OpenWrite>)>,
) -> (Option<StateGuard<'a>>, Option<StateGuard<'a>>) {
    async fn lock(w: Option<&OpenWrite>) -> Option<StateGuard<'_>> {
        match w {
            Some(w) => Some(w.state.lock().await),
            None => None,
        }
    }
    let Some((b_ino, b)) = b else {
        return (lock(a.1).await, None);
    };
    if a.0 <= b_ino {
        let ga = lock(a.1).await;
        (ga, lock(b).await)
    } else {
        let gb = lock(b).await;
        (lock(a.1).await, gb)
    }
}

enum Handle {
    File(FileHandle),
    Dir(Arc<tokio::sync::Mutex<DirStream>>),
}

pub struct Fs {
    store: Arc<dyn ObjectStore>,
    cfg: FsConfig,
    policy: AttrPolicy,
    wcfg: Arc<WriteConfig>,
    rcfg: Arc<ReadConfig>,
    table: Mutex<InodeTable>,
    handles: Mutex<HashMap<u64, Handle>>,
    next_fh: AtomicU64,
    /// Stat cache, single-flight probes and statahead.
    lookups: Arc<Lookups>,
    /// Lookup misses per directory without a listing (see [`Fs::list_for_lookups`]).
    dir_misses: Mutex<HashMap<Ino, DirMisses>>,
    /// Directory markers mkdir has not finished uploading.
    markers: PendingMarkers,
    /// See [`Fs::on_stale_cache`].
    stale_cache: Mutex<Option<StaleCache>>,
}

/// Called with an inode whose kernel-cached attributes are of an older version.
pub type StaleCache = Box<dyn Fn(Ino) + Send + Sync>;

/// Times a fresh descriptor learns a newer version before its read gives up with ESTALE
/// (the object keeps changing under it).
const REPIN_TRIES: u32 = 3;

fn now() -> SystemTime {
    SystemTime::now()
}

/// The name at the mount root that holds files unlinked while open: never a file's.
fn is_reserved(parent: Ino, name: &str) -> bool {
    parent == ROOT_INO && name == UNLINKED_DIR
}

impl Fs {
    pub fn new(store: Arc<dyn ObjectStore>, cfg: FsConfig) -> Arc<Self> {
        let policy = AttrPolicy {
            uid: cfg.uid,
            gid: cfg.gid,
            force_uid: cfg.force_uid,
            force_gid: cfg.force_gid,
            file_mode: cfg.file_mode,
            dir_mode: cfg.dir_mode,
        };
        let root_attr = policy.attr(
            ROOT_INO,
            FileKind::Dir,
            0,
            &PosixMeta::default(),
            Some(now()),
        );
        let mut root = Inode::new(
            ROOT_INO,
            ROOT_INO,
            String::new(),
            String::new(),
            FileKind::Dir,
            root_attr,
        );
        root.lookups = 1;
        let metrics = Arc::new(FsMetrics::default());
        let (store_for_lookups, prefix_for_lookups) = (store.clone(), cfg.prefix.clone());
        let cache_limits = CacheLimits {
            ttl: cfg.stat_ttl,
            negative_ttl: cfg.negative_ttl,
            max_entries: cfg.stat_cache_size,
        };
        let store_for_markers = store.clone();
        let budget = MemoryBudget::new(cfg.max_memory, metrics.clone());
        let rcfg = Arc::new(ReadConfig {
            part_size: cfg.part_size.max(bucketfs_store::MIN_PART_SIZE),
            max_window: cfg.max_prefetch,
            budget: budget.clone(),
            metrics: metrics.clone(),
        });
        let wcfg = Arc::new(WriteConfig {
            layout: PartLayout {
                part_size: cfg.part_size.max(bucketfs_store::MIN_PART_SIZE),
            },
            upload_concurrency: cfg.upload_concurrency.max(1),
            uploads: Uploads::new(store.clone()),
            metrics,
            budget,
        });
        let fs = Arc::new(Self {
            store,
            policy,
            wcfg,
            rcfg,
            cfg,
            table: Mutex::new(InodeTable::new(root)),
            handles: Mutex::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
            lookups: Lookups::new(store_for_lookups, prefix_for_lookups, cache_limits),
            dir_misses: Mutex::new(HashMap::new()),
            markers: PendingMarkers::new(store_for_markers),
            stale_cache: Mutex::new(None),
        });
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(Self::retry_orphans_forever(Arc::downgrade(&fs)));
        }
        fs
    }

    /// Every few seconds, aborts uploads whose abort failed earlier (the store was down).
    async fn retry_orphans_forever(fs: std::sync::Weak<Self>) {
        loop {
            tokio::time::sleep(ORPHAN_RETRY).await;
            let Some(fs) = fs.upgrade() else { return };
            if fs.wcfg.uploads.pending_aborts() > 0 {
                fs.wcfg.uploads.retry_aborts().await;
            }
        }
    }

    /// The fs core's counters.
    pub fn metrics(&self) -> Arc<FsMetrics> {
        self.wcfg.metrics.clone()
    }

    /// Multipart uploads this mount could not abort yet.
    pub fn pending_aborts(&self) -> usize {
        self.wcfg.uploads.pending_aborts()
    }

    pub fn config(&self) -> &FsConfig {
        &self.cfg
    }

    /// How long the kernel may cache entries and attributes this fs returns.
    pub fn attr_ttl(&self) -> Duration {
        self.cfg.stat_ttl
    }

    /// Number of inodes the table holds (for tests of forget).
    pub fn inode_count(&self) -> usize {
        self.table.lock().len()
    }

    // ---- keys ----

    fn key(&self, path: &str) -> String {
        format!("{}{path}", self.cfg.prefix)
    }

    /// Key prefix of a directory's children (and its marker's key).
    fn dir_key(&self, path: &str) -> String {
        if path.is_empty() {
            self.cfg.prefix.clone()
        } else {
            format!("{}{path}/", self.cfg.prefix)
        }
    }

    /// S3 keys are at most 1,024 bytes; a path whose key (or directory marker) would be longer
    /// cannot be stored.
    fn check_key_len(&self, path: &str) -> FsResult<()> {
        if self.dir_key(path).len() > MAX_KEY_LEN {
            Err(FsError::ENAMETOOLONG)
        } else {
            Ok(())
        }
    }

    fn check_writable(&self) -> FsResult<()> {
        if self.cfg.read_only {
            Err(FsError::EROFS)
        } else {
            Ok(())
        }
    }

    /// A fetch time old enough that `fresh` says no: marks attributes to be asked again.
    fn stale_instant(&self) -> Option<Instant> {
        Instant::now().checked_sub(self.cfg.stat_ttl + Duration::from_secs(1))
    }

    fn fresh(&self, fetched: Option<Instant>) -> bool {
        fetched.is_none_or(|t| t.elapsed() < self.cfg.stat_ttl)
    }

    /// Path and kind of a directory inode.
    fn dir_path(&self, ino: Ino) -> FsResult<String> {
        let t = self.table.lock();
        let i = t.get(ino).ok_or(FsError::ENOENT)?;
        if i.kind != FileKind::Dir {
            return Err(FsError::ENOTDIR);
        }
        Ok(i.path.clone())
    }

    /// The attributes to report for an inode now (a file being written shows its live size).
    fn current_attr(i: &Inode) -> Attr {
        let mut a = i.attr.clone();
        if let Some(w) = &i.write {
            a.size = w.size.load(Ordering::Relaxed);
        }
        a
    }

    fn new_meta(&self, kind: FileKind, mode: u32, umask: u32, caller: Caller) -> PosixMeta {
        let t = now();
        PosixMeta {
            mode: Some(kind.mode_bits() | (mode & !umask & 0o7777)),
            uid: Some(caller.uid),
            gid: Some(caller.gid),
            mtime: Some(t),
            atime: None,
        }
    }

    // ---- asking the store what a path is ----

    /// Records what the store said about `name` in `parent`; returns the inode.
    fn remember(&self, parent: Ino, name: &str, path: String, f: Found, lookups: u64) -> Attr {
        let mut t = self.table.lock();
        if let Some(ino) = t.child(parent, name) {
            let i = t.get_mut(ino).expect("child in table");
            if i.kind == f.kind {
                let mut a = self.policy.attr_of_object(ino, f.kind, &f.obj);
                if f.kind == FileKind::Dir && i.attr.mtime > a.mtime {
                    // Changed here since its marker was stored (see `dir_changed`).
                    (a.mtime, a.ctime) = (i.attr.mtime, i.attr.ctime.max(a.ctime));
                }
                i.attr = a;
                i.etag = f.obj.etag.clone();
                i.user = f.obj.user;
                i.has_marker = f.has_marker;
                i.fetched = Some(Instant::now());
                i.lookups += lookups;
                return Self::current_attr(i);
            }
        }
        let ino = t.ino_for(&path);
        let attr = self.policy.attr_of_object(ino, f.kind, &f.obj);
        let mut i = Inode::new(ino, parent, name.to_string(), path, f.kind, attr.clone());
        i.etag = f.obj.etag;
        i.user = f.obj.user;
        i.has_marker = f.has_marker;
        i.lookups = lookups;
        t.insert(i);
        attr
    }

    /// Finds `name` in `parent`, from the table while fresh, else from the store.
    async fn resolve(&self, parent: Ino, name: &OsStr, lookups: u64) -> FsResult<Attr> {
        let name = check_name(name)?;
        if is_reserved(parent, name) {
            return Err(FsError::ENOENT);
        }
        let parent_path = self.dir_path(parent)?;
        {
            let mut t = self.table.lock();
            if let Some(ino) = t.child(parent, name) {
                let i = t.get_mut(ino).expect("child in table");
                if self.fresh(i.fetched) || i.write.is_some() {
                    i.lookups += lookups;
                    inc(&self.wcfg.metrics.attr_hits);
                    return Ok(Self::current_attr(i));
                }
            }
        }
        inc(&self.wcfg.metrics.attr_misses);
        let path = join(&parent_path, name);
        let mut cached = self.lookups.cached_complete(&path);
        let mut says = self.listing_says(parent, name);
        if matches!(says, ListingSays::Unknown)
            && !self.lookups.known(&path)
            && self.list_for_lookups(parent, &parent_path).await
        {
            cached = self.lookups.cached_complete(&path);
            says = self.listing_says(parent, name);
        }
        match says {
            ListingSays::Absent if !cached => {
                // A fresh complete listing of the parent does not have it.
                inc(&self.wcfg.metrics.attr_hits);
                return Err(FsError::ENOENT);
            }
            ListingSays::Present { window, far_end } => {
                // Keep the window full: refill on a miss, or when its far end is not
                // fetched yet, so the reader never catches up with the statahead. Only then
                // are the window's names copied out of the listing.
                let far_behind =
                    far_end.is_some_and(|n| !self.lookups.known(&join(&parent_path, &n)));
                if !cached || far_behind {
                    let ahead = self.listing_names(parent, window, &parent_path);
                    // Pages fetched ahead could lack a directory whose marker is on its way.
                    self.lookups.statahead(ahead, self.markers.len() == 0);
                }
            }
            _ => {}
        }
        // A directory made here whose marker is not up yet would look absent.
        let dir_key = self.dir_key(&path);
        self.markers.wait(&dir_key).await?;
        // The kernel's lookup of a directory usually comes before its listing: let a LIST of
        // it fetch the first page too. Not while a directory made here below is not in the
        // bucket yet (the page would lack it); the epoch is read first, so one made after
        // the check invalidates the page.
        let epoch = self.lookups.epoch();
        let stat = if lookups > 0 && !self.markers.any_below(&dir_key) {
            self.lookups.stat_before_listing(&path, epoch).await
        } else {
            self.lookups.stat(&path).await
        };
        match stat.map(|(f, _)| f) {
            Ok(f) => Ok(self.remember(parent, name, path, f, lookups)),
            Err(e) => {
                if e == FsError::ENOENT {
                    self.table.lock().remove_child(parent, name);
                }
                Err(e)
            }
        }
    }

    // ---- the operations ----

    /// Looks `name` up in directory `parent`; on success the inode's lookup count goes up by one.
    pub async fn lookup(&self, parent: Ino, name: &OsStr) -> FsResult<Attr> {
        self.resolve(parent, name, 1).await
    }

    /// The kernel dropped `nlookup` references to `ino`.
    pub fn forget(&self, ino: Ino, nlookup: u64) {
        self.table.lock().forget(ino, nlookup);
    }

    /// Adds one lookup reference (for entries returned by readdirplus).
    pub fn add_lookup(&self, ino: Ino) {
        if let Some(i) = self.table.lock().get_mut(ino) {
            i.lookups += 1;
        }
    }

    pub async fn getattr(&self, ino: Ino) -> FsResult<Attr> {
        let (parent, name) = {
            let t = self.table.lock();
            let i = t.get(ino).ok_or(FsError::ENOENT)?;
            if ino == ROOT_INO
                || i.kind == FileKind::Dir
                || i.unlinked
                || i.write.is_some()
                || self.fresh(i.fetched)
            {
                inc(&self.wcfg.metrics.attr_hits);
                return Ok(Self::current_attr(i));
            }
            (i.parent, i.name.clone())
        };
        self.resolve(parent, OsStr::new(&name), 0).await?;
        let t = self.table.lock();
        t.get(ino).map(Self::current_attr).ok_or(FsError::ENOENT)
    }

    /// chmod/chown/utimens/truncate. `fh` is set for ftruncate/futimens on an open file.
    ///
    /// The change is stored, or queued in the file's live write state, before this returns. A
    /// state whose last close is retiring it is never used: its publish is over and nothing
    /// would publish the change (see [`WriteState::retired`]).
    pub async fn setattr(&self, ino: Ino, _fh: Option<u64>, set: SetAttr) -> FsResult<Attr> {
        self.check_writable()?;
        let (kind, path, mut write) = {
            let t = self.table.lock();
            let i = t.get(ino).ok_or(FsError::ENOENT)?;
            (i.kind, i.path.clone(), i.write.clone())
        };
        if set.size.is_some() {
            match kind {
                FileKind::Dir => return Err(FsError::EISDIR),
                FileKind::Symlink => return Err(FsError::EINVAL),
                FileKind::File => {}
            }
        }
        self.lookups.forget(&path);
        while let Some(w) = write.take() {
            let mut st = w.state.lock().await;
            if st.retired {
                drop(st);
                write = self
                    .table
                    .lock()
                    .get(ino)
                    .ok_or(FsError::ENOENT)?
                    .write
                    .clone();
                continue;
            }
            // truncate(2) on a path nobody has open: nobody will close it, publish now.
            let open = self.table.lock().get(ino).map_or(0, |i| i.open_handles);
            return self
                .setattr_state(ino, kind, &mut st, &set, open == 0)
                .await;
        }
        let (etag, size, user) = {
            let t = self.table.lock();
            let i = t.get(ino).ok_or(FsError::ENOENT)?;
            (i.etag.clone(), i.attr.size, i.user.clone())
        };
        if set.size.is_some() {
            // A state of its own, published now.
            let base = etag.map(|etag| Base { etag, size });
            let w = self.new_write(&path, base, user)?;
            let mut st = w.state.lock().await;
            return self.setattr_state(ino, kind, &mut st, &set, true).await;
        }
        let Some(change) = Self::meta_change(kind, &set) else {
            return self.getattr(ino).await;
        };
        let mut new_user = user;
        self.filled_meta(ino, kind, &new_user)?
            .write_into(&mut new_user);
        change.write_into(&mut new_user);
        self.store_meta(ino, kind, &path, size, &new_user, etag.as_deref())
            .await?;
        // A writer that opened the file meanwhile took the old metadata: its publish must
        // carry the change too, and build on the object as it is now.
        let (write, new_etag) = {
            let t = self.table.lock();
            let i = t.get(ino).ok_or(FsError::ENOENT)?;
            (i.write.clone(), i.etag.clone())
        };
        if let Some(w) = write {
            let mut st = w.state.lock().await;
            if !st.retired {
                change.write_into(&mut st.meta);
                if let (Some(old), Some(new)) = (etag.as_deref(), new_etag) {
                    st.restamp_base(old, new);
                }
            }
        }
        let mut t = self.table.lock();
        let i = t.get_mut(ino).ok_or(FsError::ENOENT)?;
        let pm = PosixMeta::from_user(&new_user);
        i.attr = self.policy.attr(ino, kind, i.attr.size, &pm, Some(now()));
        i.user = new_user;
        Ok(Self::current_attr(i))
    }

    /// Applies `set` to file `ino` through its write state `st` (held locked), and publishes
    /// at once when `publish` says so.
    async fn setattr_state(
        &self,
        ino: Ino,
        kind: FileKind,
        st: &mut WriteState,
        set: &SetAttr,
        publish: bool,
    ) -> FsResult<Attr> {
        let old_size = st.size();
        if let Some(n) = set.size {
            st.truncate(n).await?;
        }
        let resized = st.size() != old_size;
        let change = Self::meta_change(kind, set);
        if let Some(c) = &change {
            let filled = self.filled_meta(ino, kind, &st.meta)?;
            filled.write_into(&mut st.meta);
            c.write_into(&mut st.meta);
            if c.mtime.is_some() {
                st.mtime = c.mtime;
            }
            st.changed = true;
        }
        if publish && st.has_changes_to_publish() {
            st.publish().await?;
            self.published(ino, st);
        } else if change.is_some() || resized {
            // What stat shows now is what the close will store.
            let mut pm = PosixMeta::from_user(&st.meta);
            if st.mtime.is_some() {
                pm.mtime = st.mtime;
            }
            let mut t = self.table.lock();
            let i = t.get_mut(ino).ok_or(FsError::ENOENT)?;
            i.attr = self.policy.attr(ino, kind, st.size(), &pm, Some(now()));
            i.user = st.meta.clone();
        }
        let t = self.table.lock();
        let i = t.get(ino).ok_or(FsError::ENOENT)?;
        let mut a = Self::current_attr(i);
        a.size = st.size();
        Ok(a)
    }

    /// The metadata fields `set` changes (`None`: only the size, or nothing).
    fn meta_change(kind: FileKind, set: &SetAttr) -> Option<PosixMeta> {
        let c = PosixMeta {
            mode: set.mode.map(|m| kind.mode_bits() | (m & 0o7777)),
            uid: set.uid,
            gid: set.gid,
            mtime: set.mtime,
            atime: set.atime,
        };
        (c != PosixMeta::default()).then_some(c)
    }

    /// The metadata `user` describes, with what it lacks taken from what stat shows for
    /// `ino`, so that it is stored whole.
    fn filled_meta(&self, ino: Ino, kind: FileKind, user: &UserMeta) -> FsResult<PosixMeta> {
        let mut pm = PosixMeta::from_user(user);
        let t = self.table.lock();
        let i = t.get(ino).ok_or(FsError::ENOENT)?;
        pm.mode.get_or_insert(kind.mode_bits() | i.attr.perm as u32);
        pm.uid.get_or_insert(i.attr.uid);
        pm.gid.get_or_insert(i.attr.gid);
        pm.mtime.get_or_insert(i.attr.mtime);
        Ok(pm)
    }

    /// The S_ISUID/S_ISGID bits a write by an unprivileged caller clears from file `ino`, as
    /// the kernel does for local files (S_ISGID only with group execute); 0 when none.
    pub fn suid_bits(&self, ino: Ino) -> u32 {
        let t = self.table.lock();
        let Some(i) = t.get(ino).filter(|i| i.kind == FileKind::File) else {
            return 0;
        };
        let perm = i.attr.perm as u32;
        let mut kill = perm & libc::S_ISUID;
        if perm & (libc::S_ISGID | libc::S_IXGRP) == libc::S_ISGID | libc::S_IXGRP {
            kill |= libc::S_ISGID;
        }
        kill
    }

    /// Clears the bits [`Fs::suid_bits`] names (the kernel asks this with a write by a caller
    /// without CAP_FSETID, `FUSE_WRITE_KILL_SUIDGID`); stored like a chmod.
    pub async fn kill_suid(&self, ino: Ino) -> FsResult<()> {
        let kill = self.suid_bits(ino);
        if kill == 0 {
            return Ok(());
        }
        let perm = self.table.lock().get(ino).map_or(0, |i| i.attr.perm as u32);
        let set = SetAttr {
            mode: Some(perm & !kill),
            ..SetAttr::default()
        };
        self.setattr(ino, None, set).await.map(|_| ())
    }

    /// Replaces the user metadata of a stored object (CopyObject onto itself), pinned to
    /// `etag`, the version this mount knows: never over another client's newer one.
    async fn store_meta(
        &self,
        ino: Ino,
        kind: FileKind,
        path: &str,
        size: u64,
        user: &UserMeta,
        etag: Option<&str>,
    ) -> FsResult<()> {
        if kind == FileKind::Dir {
            if path.is_empty() && self.cfg.prefix.is_empty() {
                return Ok(()); // the bucket root has no object to carry metadata
            }
            let key = self.dir_key(path);
            // mkdir's marker must not land after this one.
            self.markers.settle(&key).await;
            self.store
                .put(&key, Bytes::new(), user)
                .await
                .map_err(|e| log_store_err(&format!("set metadata of {key}"), e))?;
            if let Some(i) = self.table.lock().get_mut(ino) {
                i.has_marker = true;
            }
            return Ok(());
        }
        let key = self.key(path);
        let copied = self.copy_object(&key, &key, size, Some(user), etag).await;
        if copied == Err(FsError::ESTALE) {
            // Another client's version is there now: the next lookup (the kernel retries a
            // chmod once after ESTALE) sees it, and the change applies to it.
            let _ = self.refresh(ino);
        }
        copied?;
        let etag = self.store.head(&key).await.ok().and_then(|o| o.etag);
        if let Some(i) = self.table.lock().get_mut(ino) {
            i.etag = etag;
        }
        Ok(())
    }

    /// Server-side copy of any size; `meta` replaces the user metadata when given. With
    /// `src_etag`, every request copies from that version of `src` only, and a copy onto
    /// itself lands only over it, so the copy is never a mix of two versions nor written
    /// over another client's: a mismatch is ESTALE.
    async fn copy_object(
        &self,
        src: &str,
        dst: &str,
        size: u64,
        meta: Option<&UserMeta>,
        src_etag: Option<&str>,
    ) -> FsResult<()> {
        let what = format!("copy {src} to {dst}");
        let fail = |e: StoreError| match e {
            StoreError::PreconditionFailed(_) => {
                tracing::warn!(
                    "{src}: changed by another client since this mount last saw it; {what} \
                     refused (ESTALE), the other client's version is kept: {e}"
                );
                FsError::ESTALE
            }
            e => log_store_err(&what, e),
        };
        if size <= MAX_COPY_OBJECT_SIZE {
            return self
                .store
                .copy(src, dst, meta, src_etag)
                .await
                .map_err(fail);
        }
        let meta = match meta {
            Some(m) => m.clone(),
            None => {
                self.store
                    .head(src)
                    .await
                    .map_err(|e| log_store_err(&what, e))?
                    .user
            }
        };
        let mut upload = self
            .wcfg
            .uploads
            .create(dst, &meta)
            .await
            .map_err(|e| log_store_err(&what, e))?;
        let ranges: Vec<_> = (0..size.div_ceil(COPY_PART_SIZE))
            .map(|i| i * COPY_PART_SIZE..((i + 1) * COPY_PART_SIZE).min(size))
            .collect();
        // Futures are collected first (not mapped lazily in the stream) and boxed, so that the
        // callers' futures stay provably Send (rust-lang/rust#102211).
        let jobs: Vec<BoxFuture<'_, Result<CompletedPart, StoreError>>> = ranges
            .into_iter()
            .enumerate()
            .map(|(i, r)| {
                let upload = &upload;
                async move {
                    let n = i as u32 + 1;
                    let etag = upload.copy_part(n, src, r, src_etag).await?;
                    Ok(CompletedPart {
                        part_number: n,
                        etag,
                    })
                }
                .boxed()
            })
            .collect();
        let parts = run_bounded(jobs, self.wcfg.upload_concurrency).await;
        // Onto itself (chmod of a huge file): only over the version copied.
        let dst_etag = src_etag.filter(|_| src == dst);
        let done = match parts {
            Ok(p) => upload.complete(&p, dst_etag).await.map(|_| ()),
            Err(e) => Err(e),
        };
        if let Err(e) = done {
            // A failed abort stays on the orphan list, retried later.
            let _ = upload.abort().await;
            return Err(fail(e));
        }
        Ok(())
    }

    pub async fn readlink(&self, ino: Ino) -> FsResult<Bytes> {
        let (path, size, cached) = {
            let t = self.table.lock();
            let i = t.get(ino).ok_or(FsError::ENOENT)?;
            if i.kind != FileKind::Symlink {
                return Err(FsError::EINVAL);
            }
            (i.path.clone(), i.attr.size, i.symlink_target.clone())
        };
        if let Some(c) = cached {
            return Ok(c);
        }
        let key = self.key(&path);
        let target = self
            .store
            .get_range(&key, 0..size.max(1), None)
            .await
            .map_err(|e| log_store_err(&format!("readlink {key}"), e))?;
        if let Some(i) = self.table.lock().get_mut(ino) {
            i.symlink_target = Some(target.clone());
        }
        Ok(target)
    }

    /// Adds a new inode that was just created in the store (or locally, `fetched: None`).
    #[allow(clippy::too_many_arguments)]
    fn add_new(
        &self,
        parent: Ino,
        name: &str,
        path: String,
        kind: FileKind,
        pm: &PosixMeta,
        size: u64,
        etag: Option<String>,
        local_only: bool,
    ) -> (Ino, Attr) {
        self.lookups.forget(&path);
        self.note_added(parent, name);
        self.dir_changed(parent);
        let mut t = self.table.lock();
        let ino = t.ino_for(&path);
        let attr = self.policy.attr(ino, kind, size, pm, Some(now()));
        let mut i = Inode::new(ino, parent, name.to_string(), path, kind, attr.clone());
        if local_only {
            i.fetched = None;
        }
        i.etag = etag;
        i.user = pm.to_user();
        i.has_marker = kind == FileKind::Dir;
        i.lookups = 1;
        t.insert(i);
        (ino, attr)
    }

    /// An entry of directory `dir` was added or removed here: its mtime and ctime are now.
    /// Kept in memory only (storing them would cost a request per entry); [`Self::remember`]
    /// never moves them back.
    fn dir_changed(&self, dir: Ino) {
        if let Some(i) = self.table.lock().get_mut(dir) {
            let t = now();
            i.attr.mtime = t;
            i.attr.ctime = t;
        }
    }

    /// Name check, read-only check, and the parent's path, for calls that add an entry.
    fn prepare_new(&self, parent: Ino, name: &OsStr) -> FsResult<(String, String)> {
        self.check_writable()?;
        let name = check_name(name)?.to_string();
        if is_reserved(parent, &name) {
            return Err(FsError::EPERM);
        }
        let parent_path = self.dir_path(parent)?;
        if self.table.lock().child(parent, &name).is_some() {
            return Err(FsError::EEXIST);
        }
        self.check_key_len(&join(&parent_path, &name))?;
        Ok((name, parent_path))
    }

    pub async fn mkdir(
        &self,
        parent: Ino,
        name: &OsStr,
        mode: u32,
        umask: u32,
        caller: Caller,
    ) -> FsResult<Attr> {
        let (name, parent_path) = self.prepare_new(parent, name)?;
        let path = join(&parent_path, &name);
        let pm = self.new_meta(FileKind::Dir, mode, umask, caller);
        let key = self.dir_key(&path);
        if name.len() <= BACKGROUND_MARKER_MAX_NAME {
            // The marker goes up in the background (see markers.rs).
            self.markers.start(key, pm.to_user());
        } else {
            // A server may refuse this marker for its name alone: say so to mkdir.
            self.store
                .put(&key, Bytes::new(), &pm.to_user())
                .await
                .map_err(|e| log_store_err(&format!("mkdir {key}"), e))?;
        }
        let (ino, attr) = self.add_new(parent, &name, path, FileKind::Dir, &pm, 0, None, false);
        if let Some(i) = self.table.lock().get_mut(ino) {
            // Just made: known to be empty.
            i.listing = Some(DirListing::new(Vec::new()));
        }
        Ok(attr)
    }

    /// Only regular files can be made (FIFOs, sockets and devices cannot live in a bucket).
    pub async fn mknod(
        &self,
        parent: Ino,
        name: &OsStr,
        mode: u32,
        umask: u32,
        caller: Caller,
    ) -> FsResult<Attr> {
        if mode & libc::S_IFMT != libc::S_IFREG && mode & libc::S_IFMT != 0 {
            return Err(FsError::EPERM);
        }
        let (name, parent_path) = self.prepare_new(parent, name)?;
        let path = join(&parent_path, &name);
        let pm = self.new_meta(FileKind::File, mode, umask, caller);
        let key = self.key(&path);
        let etag = self
            .store
            .put(&key, Bytes::new(), &pm.to_user())
            .await
            .map_err(|e| log_store_err(&format!("create {key}"), e))?;
        Ok(self
            .add_new(
                parent,
                &name,
                path,
                FileKind::File,
                &pm,
                0,
                Some(etag),
                false,
            )
            .1)
    }

    pub async fn symlink(
        &self,
        parent: Ino,
        name: &OsStr,
        target: &Path,
        caller: Caller,
    ) -> FsResult<Attr> {
        let (name, parent_path) = self.prepare_new(parent, name)?;
        let path = join(&parent_path, &name);
        let pm = self.new_meta(FileKind::Symlink, 0o777, 0, caller);
        let key = self.key(&path);
        let body = Bytes::copy_from_slice(target.as_os_str().as_bytes());
        let etag = self
            .store
            .put(&key, body.clone(), &pm.to_user())
            .await
            .map_err(|e| log_store_err(&format!("symlink {key}"), e))?;
        let (ino, attr) = self.add_new(
            parent,
            &name,
            path,
            FileKind::Symlink,
            &pm,
            body.len() as u64,
            Some(etag),
            false,
        );
        if let Some(i) = self.table.lock().get_mut(ino) {
            i.symlink_target = Some(body);
        }
        Ok(attr)
    }

    /// Resolves an existing entry for a call that changes it; returns its inode number.
    async fn existing(&self, parent: Ino, name: &OsStr) -> FsResult<Ino> {
        self.resolve(parent, name, 0).await?;
        let name = check_name(name)?;
        self.table.lock().child(parent, name).ok_or(FsError::ENOENT)
    }

    pub async fn unlink(&self, parent: Ino, name: &OsStr) -> FsResult<()> {
        self.check_writable()?;
        let ino = self.existing(parent, name).await?;
        let (kind, path, write, in_store, open) = {
            let t = self.table.lock();
            let i = t.get(ino).ok_or(FsError::ENOENT)?;
            let open = i.open_handles > 0;
            (
                i.kind,
                i.path.clone(),
                i.write.clone(),
                i.fetched.is_some(),
                open,
            )
        };
        if kind == FileKind::Dir {
            return Err(FsError::EISDIR);
        }
        // One hold of the write state's lock for the whole unlink, so no write or publish
        // changes what it decides (keep a copy or not, delete or not) before it acts. The
        // object goes before the state is marked unlinked: a failed delete leaves the file as
        // it was, to be published at close.
        let mut guard = match &write {
            Some(w) => Some(w.state.lock().await),
            None => None,
        };
        // Published since the table was read: the object exists.
        let in_store = in_store || guard.as_ref().is_some_and(|st| st.base_etag().is_some());
        if open
            && self
                .hide_open_file(ino, &path, guard.as_deref_mut(), in_store)
                .await?
        {
            drop(guard);
            self.lookups.forget(&path);
            self.dir_changed(parent);
            return Ok(());
        }
        if in_store {
            let key = self.key(&path);
            self.store
                .delete(&key)
                .await
                .map_err(|e| log_store_err(&format!("unlink {key}"), e))?;
        }
        if let Some(st) = guard.as_deref_mut() {
            st.unlinked = true;
            st.abort_stream().await;
        }
        drop(guard);
        self.lookups.forget(&path);
        self.table.lock().removed(ino);
        self.dir_changed(parent);
        Ok(())
    }

    /// Unlinks file `ino`, still open here, without losing what its descriptors may read
    /// (POSIX keeps an unlinked file until its last close). Bytes that only the store holds
    /// move to a hidden key (see [`Self::copy_for_descriptors`]; copy, then delete), which
    /// the last close deletes. Returns false, having done nothing, when all its bytes are
    /// local anyway. `st` is its write state, locked by the caller.
    async fn hide_open_file(
        &self,
        ino: Ino,
        path: &str,
        mut st: Option<&mut WriteState>,
        in_store: bool,
    ) -> FsResult<bool> {
        let Some(kept) = self
            .copy_for_descriptors(ino, path, st.as_deref_mut(), in_store)
            .await?
        else {
            return Ok(false);
        };
        let src = self.key(path);
        if let Err(e) = self.store.delete(&src).await {
            self.delete_hidden(kept.0).await;
            return Err(log_store_err(&format!("unlink {src}"), e));
        }
        self.retire_open_file(ino, st, Some(kept)).await;
        Ok(true)
    }

    /// Copies what the store holds of open file `ino` at `path` (its object; streamed parts
    /// have local copies, and publishing them would put half-written content under the
    /// name) server-side to a new hidden key under [`UNLINKED_DIR`], for its descriptors to
    /// read once the name is gone or taken.
    /// Returns that path and the copy's ETag, or None, having copied nothing, when all its
    /// bytes are local anyway. The object stays where it is.
    async fn copy_for_descriptors(
        &self,
        ino: Ino,
        path: &str,
        st: Option<&mut WriteState>,
        in_store: bool,
    ) -> FsResult<Option<(String, String)>> {
        // A file truncated or rewritten since it was opened needs nothing from its object.
        let reads_object = in_store && st.as_ref().is_none_or(|st| st.reads_base());
        if !reads_object {
            return Ok(None);
        }
        // Unique across mounts sharing the bucket: inode numbers repeat, clocks and pids less so.
        let stamp = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        let hidden = format!("{UNLINKED_DIR}/{ino}-{}-{stamp:x}", std::process::id());
        self.check_key_len(&hidden)?;
        let (src, dst) = (self.key(path), self.key(&hidden));
        let what = format!("keeping {src} as {dst} for its open descriptors");
        let (size, etag) = match self.store.head(&src).await {
            Ok(o) => (o.size, o.etag),
            // Deleted behind our back: nothing left to keep.
            Err(StoreError::NotFound(_)) => return Ok(None),
            Err(e) => return Err(log_store_err(&what, e)),
        };
        self.copy_object(&src, &dst, size, None, etag.as_deref())
            .await?;
        // Readers pin the copy's own ETag with If-Match.
        let e = match self.store.head(&dst).await.map(|o| o.etag) {
            Ok(Some(etag)) => return Ok(Some((hidden, etag))),
            Ok(None) => StoreError::Other(format!("no ETag for {dst}")),
            Err(e) => e,
        };
        self.delete_hidden(hidden).await;
        Err(log_store_err(&what, e))
    }

    /// The last step of unlinking open file `ino`, or of renaming another file over it: its
    /// name is gone, its state never publishes again, and with `kept` (the hidden copy of
    /// [`Self::copy_for_descriptors`]) its descriptors read that copy until the last close.
    async fn retire_open_file(
        &self,
        ino: Ino,
        st: Option<&mut WriteState>,
        kept: Option<(String, String)>,
    ) {
        if let Some(st) = st {
            st.unlinked = true;
            st.abort_stream().await;
            if let Some((hidden, etag)) = &kept {
                st.move_base(self.key(hidden), etag.clone());
            }
        }
        let closed = {
            let mut t = self.table.lock();
            t.removed(ino);
            match (kept, t.get_mut(ino)) {
                (Some((hidden, etag)), Some(i)) => {
                    i.path = hidden.clone();
                    i.etag = Some(etag);
                    // The last close came while the object was moving: it could not delete it.
                    i.hidden = i.open_handles > 0;
                    (!i.hidden).then_some(hidden)
                }
                (Some((hidden, _)), None) => Some(hidden),
                (None, _) => None,
            }
        };
        if let Some(hidden) = closed {
            self.delete_hidden(hidden).await;
        }
    }

    /// Deletes the hidden object of a file unlinked while open (see [`Self::hide_open_file`]),
    /// once nothing has it open any more.
    async fn delete_hidden(&self, path: String) {
        let key = self.key(&path);
        if let Err(e) = self.store.delete(&key).await {
            tracing::warn!("{key}: object of a file unlinked while open not deleted: {e}");
        }
    }

    /// Whether a directory holds anything (in the store or created here and not yet uploaded).
    async fn dir_is_empty(&self, ino: Ino, path: &str) -> FsResult<bool> {
        if !self
            .table
            .lock()
            .children_of(ino)
            .iter()
            .all(|c| c.fetched.is_some())
        {
            return Ok(false);
        }
        let dir_key = self.dir_key(path);
        if self.markers.any_below(&dir_key) {
            // A subdirectory made here whose marker is not in the bucket (yet).
            return Ok(false);
        }
        let page = self
            .store
            .list(&dir_key, None, ListFrom::Start, 2, ListDetail::Plain)
            .await
            .map_err(|e| log_store_err(&format!("list {dir_key}"), e))?;
        Ok(page.objects.iter().all(|o| o.key == dir_key) && page.common_prefixes.is_empty())
    }

    pub async fn rmdir(&self, parent: Ino, name: &OsStr) -> FsResult<()> {
        self.check_writable()?;
        let ino = self.existing(parent, name).await?;
        let (kind, path) = {
            let t = self.table.lock();
            let i = t.get(ino).ok_or(FsError::ENOENT)?;
            (i.kind, i.path.clone())
        };
        if kind != FileKind::Dir {
            return Err(FsError::ENOTDIR);
        }
        if !self.dir_is_empty(ino, &path).await? {
            return Err(FsError::ENOTEMPTY);
        }
        let key = self.dir_key(&path);
        self.markers.settle(&key).await;
        self.store
            .delete(&key)
            .await
            .map_err(|e| log_store_err(&format!("rmdir {key}"), e))?;
        self.lookups.forget(&path);
        self.lookups.forget_below(&path);
        self.table.lock().removed(ino);
        self.dir_changed(parent);
        Ok(())
    }

    /// `flags` are renameat2 flags (`RENAME_NOREPLACE` is honoured, `RENAME_EXCHANGE` is not
    /// supported).
    pub async fn rename(
        &self,
        parent: Ino,
        name: &OsStr,
        new_parent: Ino,
        new_name: &OsStr,
        flags: u32,
    ) -> FsResult<()> {
        self.check_writable()?;
        if flags & libc::RENAME_EXCHANGE != 0 {
            return Err(FsError::EINVAL);
        }
        let new_name_s = check_name(new_name)?.to_string();
        if is_reserved(new_parent, &new_name_s) {
            return Err(FsError::EPERM);
        }
        let new_parent_path = self.dir_path(new_parent)?;
        let src = self.existing(parent, name).await?;
        let target = match self.existing(new_parent, new_name).await {
            Ok(t) => Some(t),
            Err(e) if e == FsError::ENOENT => None,
            Err(e) => return Err(e),
        };
        if target == Some(src) {
            return Ok(());
        }
        if target.is_some() && flags & libc::RENAME_NOREPLACE != 0 {
            return Err(FsError::EEXIST);
        }
        let (kind, path, size, write, etag) = {
            let t = self.table.lock();
            let i = t.get(src).ok_or(FsError::ENOENT)?;
            (
                i.kind,
                i.path.clone(),
                i.attr.size,
                i.write.clone(),
                i.etag.clone(),
            )
        };
        let new_path = join(&new_parent_path, &new_name_s);
        self.check_key_len(&new_path)?;
        let mut replaced = None;
        if let Some(t) = target {
            let (tkind, tpath, open, twrite, in_store) = {
                let tb = self.table.lock();
                let i = tb.get(t).ok_or(FsError::ENOENT)?;
                let open = i.open_handles > 0;
                (
                    i.kind,
                    i.path.clone(),
                    open,
                    i.write.clone(),
                    i.fetched.is_some(),
                )
            };
            match (kind == FileKind::Dir, tkind == FileKind::Dir) {
                (true, false) => return Err(FsError::ENOTDIR),
                (false, true) => return Err(FsError::EISDIR),
                (true, true) => {
                    if !self.dir_is_empty(t, &tpath).await? {
                        return Err(FsError::ENOTEMPTY);
                    }
                }
                (false, false) => {
                    if open {
                        replaced = Some(Replaced {
                            ino: t,
                            write: twrite,
                            in_store,
                        });
                    }
                }
            }
        }
        let new_etag = if kind == FileKind::Dir {
            self.rename_dir(&path, &new_path, target.is_some()).await?;
            None
        } else {
            let moved = self
                .rename_file(&path, &new_path, (size, etag), (src, write), replaced)
                .await;
            if moved == Err(FsError::ESTALE) {
                // Another client's version is there now: the next lookup (the kernel retries
                // the rename once after ESTALE) sees it.
                let _ = self.refresh(src);
            }
            moved?
        };
        self.lookups.forget(&path);
        self.lookups.forget(&new_path);
        if kind == FileKind::Dir {
            self.lookups.forget_below(&path);
        }
        self.note_added(new_parent, &new_name_s);
        self.dir_changed(parent);
        self.dir_changed(new_parent);
        let mut t = self.table.lock();
        t.rename(src, new_parent, &new_name_s, &new_parent_path);
        if let Some(i) = t.get_mut(src) {
            i.attr.ctime = now();
            if kind != FileKind::Dir {
                i.etag = new_etag;
            }
        }
        if kind == FileKind::Dir {
            // Every object below was copied: their ETags are unknown until asked again.
            let stale = self.stale_instant();
            for d in t.descendants(&new_path) {
                if let Some(i) = t.get_mut(d) {
                    if i.write.is_none() {
                        i.etag = None;
                        i.fetched = stale.or(i.fetched);
                    }
                }
            }
        }
        t.maybe_drop(src);
        Ok(())
    }

    /// Moves file `src` (its inode and write state) from `path` to `new_path`. The file whose
    /// name it takes, if still open here (`replaced`), keeps its bytes for its descriptors, as
    /// an unlinked one does (see [`Self::hide_open_file`]), and never publishes over the new
    /// object.
    async fn rename_file(
        &self,
        path: &str,
        new_path: &str,
        version: (u64, Option<String>),
        src: (Ino, Option<Arc<OpenWrite>>),
        replaced: Option<Replaced>,
    ) -> FsResult<Option<String>> {
        let (mut guard, mut replaced_guard) = lock_in_order(
            (src.0, src.1.as_deref()),
            replaced.as_ref().map(|r| (r.ino, r.write.as_deref())),
        )
        .await;
        let kept = match &replaced {
            Some(r) => {
                self.copy_for_descriptors(
                    r.ino,
                    new_path,
                    replaced_guard.as_deref_mut(),
                    r.in_store,
                )
                .await?
            }
            None => None,
        };
        let moved = self
            .move_object(path, new_path, version, guard.as_deref_mut())
            .await;
        match (moved, &replaced) {
            (Err(e), _) => {
                if let Some((hidden, _)) = kept {
                    self.delete_hidden(hidden).await;
                }
                Err(e)
            }
            (Ok(etag), Some(r)) => {
                self.retire_open_file(r.ino, replaced_guard.as_deref_mut(), kept)
                    .await;
                Ok(etag)
            }
            (Ok(etag), None) => Ok(etag),
        }
    }

    /// Moves the object of a file from `path` to `new_path`; returns the new object's ETag.
    /// A file being written (state `st`) is not published here: what it holds is half
    /// written, and its upload belongs to the old key. The upload is aborted and the state
    /// goes on under the new key (close sends the streamed parts again, from their local
    /// copies); the file's previous complete object, if any, moves with the name, else the
    /// new name has no object until close. Either way each key holds a complete object or
    /// none, whenever the daemon dies. The copy is pinned to the version the file was looked
    /// up on (`version`: size and ETag), or its state is based on.
    async fn move_object(
        &self,
        path: &str,
        new_path: &str,
        version: (u64, Option<String>),
        st: Option<&mut WriteState>,
    ) -> FsResult<Option<String>> {
        let (src, dst) = (self.key(path), self.key(new_path));
        let Some(st) = st else {
            let (size, etag) = version;
            self.copy_object(&src, &dst, size, None, etag.as_deref())
                .await?;
            self.store
                .delete(&src)
                .await
                .map_err(|e| log_store_err(&format!("delete {src} after copy"), e))?;
            // The copy has an ETag of its own (a multipart source's never carries over):
            // readers pin it with If-Match, so learn it now.
            return Ok(self.store.head(&dst).await.ok().and_then(|o| o.etag));
        };
        st.leave_key(&src)?;
        let what = format!("rename {src} to {dst}");
        let old = match self.store.head(&src).await {
            Ok(o) => Some(o),
            Err(StoreError::NotFound(_)) => None,
            Err(e) => return Err(log_store_err(&what, e)),
        };
        let etag = match &old {
            Some(o) => {
                // The state reads its base from the copy: it must be that base, whole.
                let pin = st.base_etag().map(str::to_string);
                self.copy_object(&src, &dst, o.size, None, pin.as_deref())
                    .await?;
                // Learnt before the source goes: the state reads its base from the copy.
                match self.store.head(&dst).await {
                    Ok(o) => o.etag,
                    Err(e) => return Err(log_store_err(&what, e)),
                }
            }
            None => {
                // The name's old object (a file replaced) is gone; this one comes at close.
                self.store
                    .delete(&dst)
                    .await
                    .map_err(|e| log_store_err(&what, e))?;
                None
            }
        };
        if old.is_some() {
            self.store
                .delete(&src)
                .await
                .map_err(|e| log_store_err(&format!("delete {src} after copy"), e))?;
        }
        st.move_to(dst, etag.clone()).await;
        Ok(etag)
    }

    /// Moves every object under the directory: copies all, then deletes the sources.
    async fn rename_dir(&self, path: &str, new_path: &str, replace: bool) -> FsResult<()> {
        // Files being written below are not published (their content is half written): their
        // complete objects, if any, move with the rest, and they go on under the new keys.
        let writes: Vec<Arc<OpenWrite>> = {
            let t = self.table.lock();
            t.descendants(path)
                .into_iter()
                .filter_map(|d| t.get(d).and_then(|i| i.write.clone()))
                .collect()
        };
        for w in &writes {
            let st = w.state.lock().await;
            st.leave_key(&st.key)?;
        }
        let (src, dst) = (self.dir_key(path), self.dir_key(new_path));
        // Directories made below must be in the bucket to be listed and moved.
        self.markers.wait_below(&src).await?;
        if replace {
            self.markers.settle(&dst).await;
        }
        let mut objects = Vec::new();
        let mut from = ListFrom::Start;
        loop {
            let page = self
                .store
                .list(&src, None, from, 1000, ListDetail::Plain)
                .await
                .map_err(|e| log_store_err(&format!("list {src}"), e))?;
            objects.extend(page.objects);
            if objects.len() > self.cfg.max_dir_rename_objects {
                tracing::info!(
                    "rename of {src}: more than {} objects, returning EXDEV",
                    self.cfg.max_dir_rename_objects
                );
                return Err(FsError::EXDEV);
            }
            match page.next_continuation {
                Some(t) => from = ListFrom::Token(t),
                None => break,
            }
        }
        if replace {
            self.store
                .delete(&dst)
                .await
                .map_err(|e| log_store_err(&format!("delete {dst}"), e))?;
        }
        if !objects.iter().any(|o| o.key == src) {
            // An implied directory: give the new one a marker so it exists even if empty.
            self.store
                .put(&dst, Bytes::new(), &UserMeta::new())
                .await
                .map_err(|e| log_store_err(&format!("mkdir {dst}"), e))?;
        }
        let copies: Vec<BoxFuture<'_, FsResult<()>>> = objects
            .iter()
            .map(|o| {
                let to = format!("{dst}{}", &o.key[src.len()..]);
                // Each object as listed: its size and version go together.
                async move {
                    self.copy_object(&o.key, &to, o.size, None, o.etag.as_deref())
                        .await
                }
                .boxed()
            })
            .collect();
        // A failed copy lets the others finish: one over 5 GiB is multipart, and dropping it
        // would skip its abort.
        run_bounded(copies, RENAME_CONCURRENCY).await?;
        // Objects first, then directory markers deepest first, so that a store where a
        // marker is a real directory (the local one) can remove it once it is empty.
        let (mut markers, files): (Vec<&ObjectMeta>, Vec<&ObjectMeta>) =
            objects.iter().partition(|o| o.key.ends_with('/'));
        let deletes: Vec<BoxFuture<'_, FsResult<()>>> = files
            .into_iter()
            .map(|o| {
                async move {
                    self.store
                        .delete(&o.key)
                        .await
                        .map_err(|e| log_store_err(&format!("delete {}", o.key), e))
                }
                .boxed()
            })
            .collect();
        stream::iter(deletes)
            .buffer_unordered(RENAME_CONCURRENCY)
            .try_collect::<Vec<()>>()
            .await?;
        markers.sort_by(|a, b| b.key.cmp(&a.key));
        for m in markers {
            self.store
                .delete(&m.key)
                .await
                .map_err(|e| log_store_err(&format!("delete {}", m.key), e))?;
        }
        // Re-point files still open for writing at their new keys.
        let below: Vec<(String, Arc<OpenWrite>)> = {
            let t = self.table.lock();
            t.descendants(path)
                .into_iter()
                .filter_map(|d| {
                    t.get(d).and_then(|i| {
                        i.write
                            .clone()
                            .map(|w| (format!("{new_path}{}", &i.path[path.len()..]), w))
                    })
                })
                .collect()
        };
        for (p, w) in below {
            let key = self.key(&p);
            let etag = self.store.head(&key).await.ok().and_then(|o| o.etag);
            w.state.lock().await.move_to(key, etag).await;
        }
        Ok(())
    }

    fn new_write(
        &self,
        path: &str,
        base: Option<Base>,
        user: UserMeta,
    ) -> FsResult<Arc<OpenWrite>> {
        let size = Arc::new(AtomicU64::new(0));
        let st = WriteState::new(
            self.store.clone(),
            self.wcfg.clone(),
            self.key(path),
            base,
            user,
            &self.cfg.cache_dir,
            size.clone(),
        );
        Ok(Arc::new(OpenWrite {
            state: tokio::sync::Mutex::new(st),
            size,
        }))
    }

    fn add_handle(&self, h: Handle) -> u64 {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        self.handles.lock().insert(fh, h);
        fh
    }

    /// `flags` are the open(2) flags.
    pub async fn open(&self, ino: Ino, flags: i32) -> FsResult<OpenReply> {
        let writable = flags & libc::O_ACCMODE != libc::O_RDONLY;
        if writable || flags & libc::O_TRUNC != 0 {
            self.check_writable()?;
        }
        // Close-to-open: attributes older than the TTL are checked again.
        self.getattr(ino).await?;
        let (write, keep_cache) = {
            let mut t = self.table.lock();
            let i = t.get_mut(ino).ok_or(FsError::ENOENT)?;
            match i.kind {
                FileKind::Dir => return Err(FsError::EISDIR),
                FileKind::Symlink => return Err(FsError::ELOOP),
                FileKind::File => {}
            }
            let write = if writable {
                let w = match &i.write {
                    Some(w) => w.clone(),
                    None => {
                        let base = i.etag.clone().map(|etag| Base {
                            etag,
                            size: i.attr.size,
                        });
                        let w = self.new_write(&i.path, base, i.user.clone())?;
                        i.write = Some(w.clone());
                        w
                    }
                };
                i.writers += 1;
                Some(w)
            } else {
                None
            };
            i.open_handles += 1;
            // The kernel may keep its cached pages if the object is the one it cached them from.
            let keep = write.is_none() && i.etag.is_some() && i.cached_etag == i.etag;
            i.cached_etag = if write.is_none() {
                i.etag.clone()
            } else {
                None
            };
            (write, keep)
        };
        if let (Some(w), true) = (&write, flags & libc::O_TRUNC != 0) {
            let trunc = SetAttr {
                size: Some(0),
                ..SetAttr::default()
            };
            let mut st = w.state.lock().await;
            self.setattr_state(ino, FileKind::File, &mut st, &trunc, false)
                .await?;
        }
        let fh = self.add_handle(Handle::File(FileHandle {
            ino,
            flags,
            keep_cache,
            reader: Arc::new(tokio::sync::Mutex::new(None)),
            write,
        }));
        Ok(OpenReply { fh, keep_cache })
    }

    /// Creates and opens a regular file; the lookup count of the new inode goes up by one.
    pub async fn create(
        &self,
        parent: Ino,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        caller: Caller,
    ) -> FsResult<(Attr, OpenReply)> {
        let (name, parent_path) = match self.prepare_new(parent, name) {
            Err(e) if e == FsError::EEXIST && flags & libc::O_EXCL == 0 => {
                let ino = self.existing(parent, name).await?;
                let reply = self.open(ino, flags | libc::O_TRUNC).await?;
                self.add_lookup(ino);
                return Ok((self.getattr(ino).await?, reply));
            }
            other => other?,
        };
        let path = join(&parent_path, &name);
        let pm = self.new_meta(FileKind::File, mode, umask, caller);
        let w = self.new_write(&path, None, pm.to_user())?;
        w.state.lock().await.changed = true; // an empty file is still a file
        let (ino, attr) = self.add_new(parent, &name, path, FileKind::File, &pm, 0, None, true);
        {
            let mut t = self.table.lock();
            if let Some(i) = t.get_mut(ino) {
                i.write = Some(w.clone());
                i.writers = 1;
                i.open_handles = 1;
            }
        }
        let fh = self.add_handle(Handle::File(FileHandle {
            ino,
            flags,
            keep_cache: false,
            reader: Arc::new(tokio::sync::Mutex::new(None)),
            write: Some(w),
        }));
        Ok((
            attr,
            OpenReply {
                fh,
                keep_cache: false,
            },
        ))
    }

    /// The open file `fh`, which must be a handle of `ino`.
    fn file_handle(&self, ino: Ino, fh: u64) -> FsResult<FileHandle> {
        match self.handles.lock().get(&fh) {
            Some(Handle::File(h)) if h.ino == ino => Ok(h.clone()),
            _ => Err(FsError::EBADF),
        }
    }

    /// Reads up to `size` bytes at `offset`; shorter only at end of file.
    pub async fn read(&self, ino: Ino, fh: u64, offset: u64, size: u32) -> FsResult<Bytes> {
        let handle = self.file_handle(ino, fh)?;
        let (reader, direct) = (handle.reader, handle.flags & libc::O_DIRECT != 0);
        let kernel_pages = handle.keep_cache;
        let (write, path, etag, file_size) = {
            let t = self.table.lock();
            let i = t.get(ino).ok_or(FsError::ENOENT)?;
            (i.write.clone(), i.path.clone(), i.etag.clone(), i.attr.size)
        };
        if let Some(w) = write {
            // Someone is writing this file: read its current content, staged bytes included.
            let mut st = w.state.lock().await;
            return st.read(offset..offset.saturating_add(size as u64)).await;
        }
        let mut slot = reader.lock().await;
        let key = self.key(&path);
        if slot.as_ref().is_some_and(|r| r.key() != key) {
            // Renamed while open: read the object under its new key.
            *slot = None;
        }
        let new_reader = |etag, size| {
            let (store, cfg) = (self.store.clone(), self.rcfg.clone());
            Reader::new(store, cfg, key.clone(), etag, size, direct)
        };
        let r = slot.get_or_insert_with(|| new_reader(etag, file_size));
        let got = r.read(offset, size).await;
        if got != Err(FsError::ESTALE) {
            return got;
        }
        // The object changed after this mount last looked at it (the ETag it had is older).
        // A descriptor that has read nothing yet, opened without the kernel's cached pages,
        // gets everything it reads from here: it reads the object as it is now. Any other
        // may have been given bytes of the old version: ESTALE, and the next open starts
        // from the new one.
        let fresh = !r.has_served() && !kernel_pages;
        let mut tries = 0;
        let mut grew = false;
        let got = loop {
            tries += 1;
            let (etag, len, longer) = self.repin(ino, &key).await?;
            grew |= longer;
            if !fresh {
                break Err(FsError::ESTALE);
            }
            *r = new_reader(etag, len);
            match r.read(offset, size).await {
                Err(e) if e == FsError::ESTALE && tries < REPIN_TRIES => continue,
                other => break other,
            }
        };
        if grew {
            // The kernel stops reading at the size it knows (a short read shrinks that by
            // itself): make it ask again before it next reads past it.
            if let Some(f) = self.stale_cache.lock().as_ref() {
                f(ino);
            }
        }
        got
    }

    /// Learns the object of open file `ino` (at `key`) as it is now in the store, after a
    /// read found it changed: its ETag, its size, and whether that is more than stat showed.
    async fn repin(&self, ino: Ino, key: &str) -> FsResult<(Option<String>, u64, bool)> {
        let obj = match self.store.head(key).await {
            Ok(o) => o,
            Err(StoreError::NotFound(_)) => return Err(FsError::ESTALE),
            Err(e) => return Err(log_store_err(&format!("stat {key}"), e)),
        };
        let mut grew = false;
        let mut t = self.table.lock();
        if let Some(i) = t.get_mut(ino) {
            if i.write.is_none() && self.key(&i.path) == key {
                self.lookups.forget(&i.path);
                grew = obj.size > i.attr.size;
                i.attr = self.policy.attr_of_object(ino, i.kind, &obj);
                i.etag = obj.etag.clone();
                i.user = obj.user.clone();
                i.fetched = Some(Instant::now());
                // Pages the kernel keeps may be of either version: the next open drops them.
                i.cached_etag = None;
            }
        }
        Ok((obj.etag, obj.size, grew))
    }

    /// Registers what tells the kernel that its cached attributes of an inode are out of
    /// date (a read found the object grew under another client's change).
    pub fn on_stale_cache(&self, f: Option<StaleCache>) {
        *self.stale_cache.lock() = f;
    }

    /// Writes all of `data` at `offset` and returns its length.
    pub async fn write(&self, ino: Ino, fh: u64, offset: u64, data: Bytes) -> FsResult<u32> {
        let FileHandle { flags, write, .. } = self.file_handle(ino, fh)?;
        let w = write.ok_or(FsError::EBADF)?;
        let len = data.len() as u32;
        let mut st = w.state.lock().await;
        let at = if flags & libc::O_APPEND != 0 {
            st.size()
        } else {
            offset
        };
        st.write(at, data).await?;
        drop(st);
        if let Some(i) = self.table.lock().get_mut(ino) {
            i.attr.mtime = now();
        }
        Ok(len)
    }

    /// A write the calling (FUSE) thread finishes itself, straight from its buffer: an
    /// append to the file's in-memory part (see [`WriteState::append_now`]). `None`: nothing
    /// was done, use [`Fs::write`]. `Some(Appended::PartFull)`: call [`Fs::ship_part`] before
    /// answering.
    pub fn write_now(&self, ino: Ino, fh: u64, offset: u64, data: &[u8]) -> Option<Appended> {
        let FileHandle { flags, write, .. } = self.file_handle(ino, fh).ok()?;
        let w = write?;
        // Busy (an upload being started, a publish): the asynchronous path waits its turn.
        let mut st = w.state.try_lock().ok()?;
        let at = if flags & libc::O_APPEND != 0 {
            st.size()
        } else {
            offset
        };
        let done = st.append_now(at, data);
        drop(st);
        if done == Appended::No {
            return None;
        }
        if let Some(i) = self.table.lock().get_mut(ino) {
            i.attr.mtime = now();
        }
        Some(done)
    }

    /// Uploads the part a [`Fs::write_now`] filled; its error is the write's.
    pub async fn ship_part(&self, ino: Ino, fh: u64) -> FsResult<()> {
        let w = self.file_handle(ino, fh)?.write.ok_or(FsError::EBADF)?;
        let mut st = w.state.lock().await;
        st.ship_full_tail().await
    }

    /// [`Fs::flush`] or [`Fs::fsync`] of a handle with nothing to upload (read-only, or no
    /// change since the last publish), answered without a task: programs that fsync every
    /// open file (sysbench does, every 100 writes) or close many read-only files pay a
    /// thread hand-off per call otherwise. `None`: take the asynchronous path (there is
    /// something to publish, or the file's state is busy, e.g. a publish is under way).
    pub fn publish_now(&self, ino: Ino, fh: u64) -> Option<FsResult<()>> {
        let write = match self.file_handle(ino, fh) {
            Ok(h) => h.write,
            Err(e) => return Some(Err(e)),
        };
        let Some(w) = write else {
            return Some(Ok(()));
        };
        let st = w.state.try_lock().ok()?;
        (!st.has_changes_to_publish()).then_some(Ok(()))
    }

    /// Uploads what this handle's file holds and records the new object.
    async fn publish_handle(&self, ino: Ino, fh: u64) -> FsResult<()> {
        let write = self.file_handle(ino, fh)?.write;
        let Some(w) = write else {
            return Ok(());
        };
        let mut st = w.state.lock().await;
        if !st.has_changes_to_publish() {
            return Ok(());
        }
        if let Err(e) = st.publish().await {
            if e == FsError::ESTALE {
                self.changed_elsewhere(ino);
            }
            return Err(e);
        }
        self.published(ino, &st);
        Ok(())
    }

    /// Another client replaced or deleted the object of `ino` (a publish of it was refused):
    /// what this mount knows of it is stale, so the next lookup asks the store again.
    fn changed_elsewhere(&self, ino: Ino) {
        let mut t = self.table.lock();
        if let Some(i) = t.get_mut(ino) {
            self.lookups.forget(&i.path);
            i.fetched = self.stale_instant().or(i.fetched);
        }
    }

    /// The object of `ino` is now in the store as write state `st` (held locked, so that no
    /// setattr queued after the publish is overwritten here) says.
    fn published(&self, ino: Ino, st: &WriteState) {
        let mut t = self.table.lock();
        if let Some(i) = t.get_mut(ino) {
            self.lookups.forget(&i.path);
            let pm = PosixMeta::from_user(&st.meta);
            i.attr = self.policy.attr(ino, i.kind, st.size(), &pm, Some(now()));
            i.etag = st.base_etag().map(str::to_string);
            i.user = st.meta.clone();
            i.fetched = Some(Instant::now());
        }
    }

    /// close(2) of one descriptor: publishes what was written and reports a failed upload.
    pub async fn flush(&self, ino: Ino, fh: u64) -> FsResult<()> {
        self.publish_handle(ino, fh).await
    }

    /// Makes everything written so far durable in the bucket.
    pub async fn fsync(&self, ino: Ino, fh: u64) -> FsResult<()> {
        self.publish_handle(ino, fh).await
    }

    /// fsync of a directory: the directories made in it (and below) are in the bucket.
    pub async fn fsyncdir(&self, ino: Ino) -> FsResult<()> {
        let path = self.dir_path(ino)?;
        self.markers.wait_below(&self.dir_key(&path)).await
    }

    /// The last reference to an open file went away.
    pub async fn release(&self, ino: Ino, fh: u64) -> FsResult<()> {
        let handle = self.handles.lock().remove(&fh);
        let Some(Handle::File(FileHandle { write, .. })) = handle else {
            return Err(FsError::EBADF);
        };
        let (last_writer, hidden) = {
            let mut t = self.table.lock();
            let Some(i) = t.get_mut(ino) else {
                return Ok(());
            };
            i.open_handles = i.open_handles.saturating_sub(1);
            if write.is_some() {
                i.writers = i.writers.saturating_sub(1);
            }
            if i.unlinked && i.open_handles == 0 {
                // The state kept for readers of an unlinked file (see below) goes with them.
                i.write = None;
            }
            let hidden = (i.hidden && i.open_handles == 0).then(|| {
                i.hidden = false;
                i.path.clone()
            });
            (write.is_some() && i.writers == 0, hidden)
        };
        if !last_writer {
            if let Some(path) = hidden {
                self.delete_hidden(path).await;
            }
            return Ok(());
        }
        let w = write.expect("writer handle");
        let mut st = w.state.lock().await;
        if st.has_changes_to_publish() && !st.failed {
            // Normally flush already published; this catches a flush that never came.
            match st.publish().await {
                Ok(()) => self.published(ino, &st),
                Err(e) => tracing::error!("{}: data not uploaded and now lost: {e}", st.key),
            }
        } else if st.failed {
            tracing::error!("{}: closed after a failed upload; data not stored", st.key);
        }
        st.abort_stream().await;
        {
            // Still under the state's lock: a setattr waiting for it sees the state retired
            // and stores its change itself, instead of queueing it where nothing publishes.
            let mut t = self.table.lock();
            let mut never_stored = false;
            if let Some(i) = t.get_mut(ino) {
                let ours = i.write.as_ref().is_some_and(|x| Arc::ptr_eq(x, &w));
                if i.writers == 0 && ours {
                    // An unlinked file's bytes may exist nowhere else: its readers read them
                    // from the state until the last close.
                    if !st.unlinked || i.open_handles == 0 {
                        i.write = None;
                        st.retired = true;
                    }
                    never_stored = i.fetched.is_none();
                }
            }
            if never_stored {
                // Created here and never uploaded: the file does not exist.
                t.removed(ino);
            }
            t.maybe_drop(ino);
        }
        drop(st);
        if let Some(path) = hidden {
            self.delete_hidden(path).await;
        }
        Ok(())
    }

    pub fn statfs(&self) -> StatFs {
        // 1 PiB free, 2^32 inodes free: a bucket's capacity is not ours to know.
        StatFs {
            blocks: 1 << 38,
            bfree: 1 << 38,
            bavail: 1 << 38,
            files: 1 << 32,
            ffree: 1 << 32,
            bsize: 4096,
            namelen: crate::namespace::names::NAME_MAX as u32,
            frsize: 4096,
        }
    }

    /// Forgets what this mount cached about `ino` (and, for a directory, its listing), so the
    /// next access asks the store: how a user forces another client's change to show now.
    pub fn refresh(&self, ino: Ino) -> FsResult<()> {
        let mut t = self.table.lock();
        let i = t.get_mut(ino).ok_or(FsError::ENOENT)?;
        let (path, parent, kind) = (i.path.clone(), i.parent, i.kind);
        if i.write.is_none() && ino != ROOT_INO {
            let stale = self.stale_instant();
            i.fetched = stale.or(i.fetched);
        }
        i.listing = None;
        if let Some(p) = t.get_mut(parent) {
            p.listing = None;
        }
        drop(t);
        self.lookups.forget(&path);
        if kind == FileKind::Dir {
            // Including names cached as missing.
            self.lookups.forget_below(&path);
        }
        Ok(())
    }

    /// Keys of the files being written with something not stored yet, for the second signal
    /// to name (without waiting: a file busy publishing has its upload named already).
    pub fn files_not_stored(&self) -> Vec<String> {
        let writes = self.table.lock().all_writes();
        writes
            .iter()
            .filter_map(|w| {
                let st = w.state.try_lock().ok()?;
                st.has_changes_to_publish().then(|| st.key.clone())
            })
            .collect()
    }

    /// The last step once the mount is gone (SIGTERM waits for every descriptor to close,
    /// and each close publishes its own file). A file still being written now was never
    /// closed: what it holds is half written, so it is not published (that would put it
    /// under the file's key); its upload is aborted and it is named. Returns how many files
    /// were not stored.
    pub async fn shutdown(&self) -> usize {
        let writes = self.table.lock().all_writes();
        let mut failed = 0;
        for w in writes {
            let mut st = w.state.lock().await;
            if st.has_changes_to_publish() {
                tracing::error!(
                    "{}: still open for writing when the mount went away; the file was NOT \
                     stored",
                    st.key
                );
                failed += 1;
            }
            st.abort_stream().await;
        }
        let hidden = self.table.lock().take_hidden();
        for path in hidden {
            self.delete_hidden(path).await;
        }
        if let Err(e) = self.markers.wait_below("").await {
            tracing::error!("directory markers not stored at shutdown: {e}");
            failed += self.markers.len();
        }
        self.wcfg.uploads.retry_aborts().await;
        let left = self.wcfg.uploads.pending_aborts();
        if left > 0 {
            tracing::error!("{left} multipart uploads could not be aborted");
        }
        failed
    }
}
