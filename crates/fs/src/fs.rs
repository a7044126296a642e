//! The POSIX layer: every operation the kernel can ask for, as an async call on [`Fs`].
//!
//! Each operation asks the [`Namespace`] what is at a path, the [`OpenFiles`] registry what
//! an open file's bytes are, and the store, in that order; the two never call each other.
//! Some live beside this file: open and create in `open.rs`, attributes in `attr.rs`, unlink
//! and rmdir in `remove.rs`, rename in `rename.rs`. No lock of the namespace or the registry
//! is held across a store request; a write state's lock may be (it serialises one file).

use crate::config::FsConfig;
use crate::error::{log_store_err, FsError, FsResult};
use crate::files::write::{Appended, Base, Stored, WriteState};
use crate::files::{FileHandle, LocalCopy, OpenFiles, OpenWrite};
use crate::meta::{Attr, AttrPolicy, FileKind, Ino, PosixMeta};
use crate::metrics::FsMetrics;
use crate::namespace::inode::{DirListing, Inode, KernelPages};
pub use crate::namespace::listing::DirEntry;
use crate::namespace::lookup::CacheLimits;
use crate::namespace::names::{check_name, UNLINKED_DIR};
use crate::namespace::{is_reserved, Namespace};
use crate::paths::{MountPath, ObjectKey};

mod attr;
mod meta_changes;
mod open;
mod remove;
mod rename;
mod subtrees;

use bucketfs_store::{
    run_bounded, CompletedPart, HeadersFrom, ListDetail, ListFrom, ObjectMeta, ObjectStore,
    StoreError, UserMeta, IF_ABSENT,
};
use bytes::Bytes;
use futures::future::BoxFuture;
use futures::stream::{self, StreamExt, TryStreamExt};
use futures::FutureExt;
use parking_lot::Mutex;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Who is making a call (from the FUSE request header); owns what it creates.
#[derive(Debug, Clone, Copy)]
pub struct Caller {
    pub uid: u32,
    pub gid: u32,
}

/// Result of `open`/`create`.
#[derive(Debug, Clone)]
pub struct OpenReply {
    pub fh: u64,
    /// The kernel may keep its page cache for this file (content unchanged since last open).
    pub keep_cache: bool,
    /// The kernel must read and write this descriptor through the daemon, not its page cache
    /// (`FOPEN_DIRECT_IO`): another descriptor partway through an older version shares it.
    pub uncached: bool,
    /// A local file holding exactly this version's bytes (the data cache's whole copy), for
    /// the kernel to read itself (passthrough). Every open of the inode gets the same one
    /// while any of them is open; report the outcome with [`Fs::passed_through`].
    pub local: Option<Arc<std::fs::File>>,
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

/// The answer to a call the calling (FUSE) thread may finish itself.
pub enum Now<T> {
    /// Finished on the calling thread.
    Done(T),
    /// The rest must run as a task: await it, then answer.
    Later(BoxFuture<'static, T>),
}

/// Requests in flight at once for directory renames (copy, then delete).
const RENAME_CONCURRENCY: usize = 16;
/// Part size of server-side copies of objects too big for one CopyObject.
const COPY_PART_SIZE: u64 = 512 * 1024 * 1024;
/// Longest directory name whose marker mkdir uploads in the background. MinIO stores a
/// marker `name/` as a file `name__XLDIR__` and refuses it when that passes 255 bytes; a
/// longer name gets its marker before mkdir answers, so the refusal reaches the caller.
const BACKGROUND_MARKER_MAX_NAME: usize = 246;

pub struct Fs {
    store: Arc<dyn ObjectStore>,
    cfg: FsConfig,
    /// What is at each path.
    ns: Namespace,
    /// What each open file's bytes are.
    files: OpenFiles,
    /// Directory renames and the metadata stores below them, kept apart.
    subtrees: subtrees::Subtrees,
    /// A setattr or an unlink of an inode and the opens for writing of it, kept apart.
    meta_changes: meta_changes::MetaChanges,
    /// Set once a prefix mount's root has its marker's attributes (see `attr.rs`).
    root_read: tokio::sync::OnceCell<()>,
    /// The root's ctime before that: a later one is a change made here.
    root_made: SystemTime,
    /// Where listing pages are saved for later mounts, with the record of this mount's
    /// changes (with `--data-cache`).
    saved_pages: Option<Arc<PagesInDataCache>>,
}

pub use crate::namespace::StaleCache;

/// Times a fresh descriptor learns a newer version before its read gives up with ESTALE
/// (the object keeps changing under it).
const REPIN_TRIES: u32 = 3;

/// Most files, most of their changed bytes, and most of one file's, one fsync takes along
/// (see [`Fs::commit_along`]).
const ALONG_FILES: usize = 128;
const ALONG_BYTES: u64 = 16 << 20;
const ALONG_FILE_MAX: u64 = 1 << 20;

/// How long an unmount waits for the data cache's writer to write the blocks queued.
const CACHE_SETTLE: Duration = Duration::from_secs(10);

fn now() -> SystemTime {
    SystemTime::now()
}

/// Most pages written to the data cache's disk at once, in the background; past it a page is
/// not saved. A cache disk that hangs then holds this many blocking threads (of 512), not one
/// per directory listed (the blocking pool serves the local store, staging files and more).
const PAGE_SAVES: usize = 16;

/// Directory pages kept across mounts live in the data cache's directory.
struct PagesInDataCache {
    cache: Arc<crate::files::cache::DataCache>,
    /// Leave to save a page (see [`PAGE_SAVES`]).
    saves: Arc<tokio::sync::Semaphore>,
    /// The change record to write: one blocking thread at a time writes the latest asked
    /// until none is newer, so a hung cache disk holds one, not one per second of changes.
    record: Arc<Mutex<ChangeRecord>>,
}

#[derive(Default)]
struct ChangeRecord {
    until: Option<SystemTime>,
    writing: bool,
}

impl PagesInDataCache {
    fn new(cache: Arc<crate::files::cache::DataCache>) -> Self {
        Self {
            cache,
            saves: Arc::new(tokio::sync::Semaphore::new(PAGE_SAVES)),
            record: Arc::default(),
        }
    }

    /// Waits, up to `limit`, until the change record holds every change asked so far: a
    /// later mount must not believe a page saved before the last of them. False if it
    /// still does not.
    async fn settle(&self, limit: Duration) -> bool {
        let start = std::time::Instant::now();
        while self.record.lock().writing {
            if start.elapsed() >= limit {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        true
    }
}

impl crate::namespace::saved::ListingDisk for PagesInDataCache {
    fn save(&self, dir_key: &str, blob: Vec<u8>) {
        let (cache, dir_key) = (self.cache.clone(), dir_key.to_string());
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return cache.put_listing(&dir_key, blob);
        };
        let Ok(leave) = self.saves.clone().try_acquire_owned() else {
            return;
        };
        drop(rt.spawn_blocking(move || {
            cache.put_listing(&dir_key, blob);
            drop(leave);
        }));
    }
    fn load(&self, dir_key: &str) -> BoxFuture<'static, Option<(Vec<u8>, Option<SystemTime>)>> {
        let (cache, dir_key) = (self.cache.clone(), dir_key.to_string());
        async move {
            cache
                .read_disk(0, move |cache| {
                    Some((cache.listing(&dir_key)?, cache.changed_until()))
                })
                .await
                .flatten()
        }
        .boxed()
    }
    fn changing_until(&self, until: SystemTime) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return self.cache.changing_until(until);
        };
        {
            let mut r = self.record.lock();
            r.until = r.until.max(Some(until));
            if std::mem::replace(&mut r.writing, true) {
                return;
            }
        }
        /// The writer's end when it does not see it through (a panic, its task dropped at
        /// shutdown): the next change starts another.
        struct Abandoned(Arc<Mutex<ChangeRecord>>, bool);
        impl Abandoned {
            fn seen_through(&mut self) {
                self.1 = false;
            }
        }
        impl Drop for Abandoned {
            fn drop(&mut self) {
                if self.1 {
                    self.0.lock().writing = false;
                }
            }
        }
        let (cache, mut abandoned) = (self.cache.clone(), Abandoned(self.record.clone(), true));
        drop(rt.spawn_blocking(move || {
            let mut written = None;
            loop {
                let until = {
                    let mut r = abandoned.0.lock();
                    if r.until <= written {
                        // Under the lock: a change asked from now on starts a writer.
                        r.writing = false;
                        drop(r);
                        abandoned.seen_through();
                        return;
                    }
                    r.until
                };
                if let Some(t) = until {
                    cache.changing_until(t);
                }
                written = until;
            }
        }));
    }
}

impl Fs {
    /// An fs over `store`. Panics if the write-back directory cannot be opened: see
    /// [`Fs::with_writeback`].
    pub fn new(store: Arc<dyn ObjectStore>, cfg: FsConfig) -> Arc<Self> {
        Self::with_writeback(store, cfg)
            .expect("write-back directory")
            .0
    }

    /// An fs over `store`, and, in background mode, how many files a previous daemon left to
    /// upload (queued again; see [`Fs::wait_for_uploads`]).
    pub fn with_writeback(
        store: Arc<dyn ObjectStore>,
        cfg: FsConfig,
    ) -> Result<(Arc<Self>, usize), String> {
        let policy = AttrPolicy {
            uid: cfg.uid,
            gid: cfg.gid,
            force_uid: cfg.force_uid,
            force_gid: cfg.force_gid,
            file_mode: cfg.file_mode,
            dir_mode: cfg.dir_mode,
            umask: cfg.umask,
            mp_umask: cfg.mp_umask,
        };
        let metrics = Arc::new(FsMetrics::default());
        let limits = CacheLimits {
            ttl: cfg.stat_ttl,
            negative_ttl: cfg.negative_ttl,
            max_entries: cfg.stat_cache_size,
        };
        let ns = Namespace::new(
            store.clone(),
            cfg.prefix.clone(),
            policy,
            limits,
            metrics.clone(),
        );
        let root_made = ns.attr(crate::ROOT_INO).map_or(UNIX_EPOCH, |a| a.ctime);
        let (files, recovered) = OpenFiles::new(store.clone(), &cfg, metrics)?;
        let saved_pages = files
            .data_cache()
            .map(|c| Arc::new(PagesInDataCache::new(c.clone())));
        if let Some(p) = &saved_pages {
            ns.save_pages_on(p.clone());
        }
        let fs = Arc::new(Self {
            store,
            cfg,
            ns,
            files,
            subtrees: Default::default(),
            meta_changes: Default::default(),
            root_read: Default::default(),
            root_made,
            saved_pages,
        });
        if let Some(wb) = fs.files.writeback() {
            let weak = Arc::downgrade(&fs);
            wb.on_uploaded(Box::new(move |u| {
                if let Some(fs) = weak.upgrade() {
                    tokio::spawn(async move { fs.uploaded(u).await });
                }
            }));
            wb.adopt(|o| fs.adopt_recovered(o));
        }
        Ok((fs, recovered))
    }

    /// A file committed by a daemon that died, recovered from the write-back directory:
    /// it gets the inode and write state a commit of this daemon leaves, so reads see it,
    /// writes build on it, and unlink and rename drop or move its entry. Returns the inode.
    fn adopt_recovered(&self, o: crate::files::writeback::Orphan) -> Ino {
        use crate::files::writeback::Cond;
        let Some(path) = self.ns.path_of_key(&o.key) else {
            return 0;
        };
        let etag = match &o.cond {
            Cond::Match(e) => Some(e.clone()),
            _ => None,
        };
        let in_store = o.cond != Cond::Absent;
        let ino = self
            .ns
            .add_recovered(&path, o.size, o.meta.clone(), etag, in_store);
        let w = self
            .files
            .new_write(self.ns.key(&path), None, o.meta.clone());
        w.state
            .try_lock()
            .expect("a new state")
            .adopt(o.seq, (o.file, o.offset), o.size, o.meta);
        self.files.add_writer(ino, || w.clone());
        self.files.drop_writer(ino);
        ino
    }

    /// The fs core's counters.
    pub fn metrics(&self) -> Arc<FsMetrics> {
        self.files.metrics().clone()
    }

    /// The kernel can read local files in our place (FUSE passthrough, granted at the mount's
    /// start): with a data cache, read-only opens of files it holds whole get its copy.
    /// Returns whether there is a data cache to use it with.
    pub fn enable_passthrough(&self) -> bool {
        self.files.enable_passthrough(true)
    }

    /// Whether this mount has a data cache (the only source of local copies).
    pub fn has_data_cache(&self) -> bool {
        self.cfg.data_cache.is_some()
    }

    /// What became of an open's local copy (`OpenReply::local`): the kernel took it
    /// (`true`), or it could not be handed over and the daemon serves the handle; then no
    /// further open gets one.
    pub fn passed_through(&self, ino: Ino, fh: u64, taken: bool) {
        let m = self.files.metrics();
        if taken {
            let size = self.ns.table().get(ino).map_or(0, |i| i.attr.size);
            crate::metrics::inc(&m.passthrough_opens);
            crate::metrics::inc_by(&m.passthrough_bytes, size);
        } else {
            self.files.not_through(fh);
            self.files.enable_passthrough(false);
        }
    }

    /// Multipart uploads this mount could not abort yet.
    pub fn pending_aborts(&self) -> usize {
        self.files.uploads().pending_aborts()
    }

    pub fn config(&self) -> &FsConfig {
        &self.cfg
    }

    /// How long the kernel may keep the entry and attributes of a lookup, create or
    /// readdirplus reply for `a`: see [`Namespace::kernel_ttl`].
    pub fn entry_ttl(&self, a: &Attr) -> Duration {
        self.ns.kernel_ttl(a.ino)
    }

    /// How long the kernel may keep the attributes of a getattr or setattr reply for `a`. A
    /// directory's are answered from what this mount holds, however old (whether it still
    /// exists is its entry's question): all of T, or a process working in it would send a
    /// getattr for each file it opens there once T passed.
    pub fn attr_ttl(&self, a: &Attr) -> Duration {
        if a.kind == FileKind::Dir {
            self.cfg.stat_ttl
        } else {
            self.ns.kernel_ttl(a.ino)
        }
    }

    /// Number of inodes the table holds (for tests of forget).
    pub fn inode_count(&self) -> usize {
        self.ns.inode_count()
    }

    fn check_writable(&self) -> FsResult<()> {
        if self.cfg.read_only {
            Err(FsError::EROFS)
        } else {
            Ok(())
        }
    }

    /// The metadata of a new entry in directory `parent`. A set-group-ID directory gives its
    /// group to what is made in it, and its bit to new directories (the BSD rule Linux keeps,
    /// which a FUSE daemon applies itself; the kernel already took the bit off a new file's
    /// mode where its caller may not have it).
    fn new_meta(
        &self,
        parent: Ino,
        kind: FileKind,
        mode: u32,
        umask: u32,
        caller: Caller,
    ) -> PosixMeta {
        let t = now();
        let mut mode = mode & !umask & 0o7777;
        let setgid_dir = self
            .ns
            .table()
            .get(parent)
            .filter(|p| p.attr.perm as u32 & libc::S_ISGID != 0)
            .map(|p| p.attr.gid);
        if setgid_dir.is_some() && kind == FileKind::Dir {
            mode |= libc::S_ISGID;
        }
        PosixMeta {
            mode: Some(kind.mode_bits() | mode),
            uid: Some(caller.uid),
            gid: Some(setgid_dir.unwrap_or(caller.gid)),
            mtime: Some(t),
            atime: None,
        }
    }

    /// The attributes to report for inode `i` now (a file being written shows its live size).
    fn current_attr(&self, i: &Inode) -> Attr {
        self.live(i.attr.clone())
    }

    /// `a` with the live size of the file, if it is being written here.
    fn live(&self, mut a: Attr) -> Attr {
        if let Some(size) = self.files.live_size(a.ino) {
            a.size = size;
        }
        a
    }

    // ---- the operations ----

    /// Looks `name` up in directory `parent`; on success the inode's lookup count goes up by one.
    pub async fn lookup(&self, parent: Ino, name: &OsStr) -> FsResult<Attr> {
        Ok(self.live(self.ns.resolve(parent, name, 1).await?))
    }

    /// The kernel dropped `nlookup` references to `ino`.
    pub fn forget(&self, ino: Ino, nlookup: u64) {
        self.ns.forget(ino, nlookup);
    }

    /// Adds one lookup reference (for entries returned by readdirplus).
    pub fn add_lookup(&self, ino: Ino) {
        self.ns.add_lookup(ino);
    }

    pub async fn getattr(&self, ino: Ino) -> FsResult<Attr> {
        if ino == crate::ROOT_INO {
            self.read_root_marker().await;
        }
        if let Some(a) = self.ns.known_attr(ino)? {
            return Ok(self.live(a));
        }
        let (parent, name) = self.ns.place(ino)?;
        let found = async {
            self.ns.resolve(parent, OsStr::new(&name), 0).await?;
            self.ns.attr(ino)
        };
        match found.await {
            // The kernel asks by inode for a name it still holds, and the file is gone
            // (another client deleted it). Open here, it keeps its attributes for its
            // descriptors (`fstat`, the kernel's size check before a read), as an open file
            // does on a local disk. Else the handle is stale: `ESTALE` has `stat` and `open`
            // look the name up again at once (`ENOENT`; an `O_CREAT` open then makes the
            // file), where `ENOENT` failed them for the name's TTL.
            Err(e) if e == FsError::ENOENT => match self.ns.with(ino, |i| i.open_handles > 0) {
                Some(true) => Ok(self.live(self.ns.attr(ino)?)),
                _ => Err(FsError::ESTALE),
            },
            r => r.map(|a| self.live(a)),
        }
    }

    /// Deletes `key` once its version `etag` was copied elsewhere (a rename, the hidden copy
    /// of an open file unlinked): pinned to that version (`If-Match`), so another client's
    /// put since stays under the name, logged (where the store checks the condition; MinIO
    /// deletes whatever is there). Other errors are the caller's.
    async fn delete_copied(&self, key: &str, etag: Option<&str>) -> Result<(), StoreError> {
        let r = match etag {
            Some(e) => self.store.delete_if(key, e).await,
            None => self.store.delete(key).await,
        };
        match r {
            Err(StoreError::PreconditionFailed(_)) => {
                tracing::warn!(
                    "{key}: another client wrote it after this mount copied it away (a rename, \
                     an unlink of an open file); that version stays under the name"
                );
                Ok(())
            }
            r => r,
        }
    }

    /// Server-side copy of any size; `meta` replaces the user metadata when given. With
    /// `src_etag`, every request copies from that version of `src` only, and a copy onto
    /// itself lands only over it, so the copy is never a mix of two versions nor written
    /// over another client's: a mismatch is ESTALE. Returns the copy's ETag.
    async fn copy_object(
        &self,
        src: &str,
        dst: &str,
        size: u64,
        meta: Option<&UserMeta>,
        src_etag: Option<&str>,
    ) -> FsResult<String> {
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
        if size <= self.store.limits().max_copy_object {
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
        let from = HeadersFrom {
            key: src,
            etag: src_etag,
        };
        let mut upload = self
            .files
            .uploads()
            .create(dst, &meta, Some(from))
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
        let parts = run_bounded(jobs, self.files.upload_concurrency()).await;
        // Onto itself (chmod of a huge file): only over the version copied.
        let dst_etag = src_etag.filter(|_| src == dst);
        let done = match parts {
            Ok(p) => upload.complete(&p, dst_etag).await,
            Err(e) => Err(e),
        };
        match done {
            Ok(etag) => Ok(etag),
            Err(e) => {
                // A failed abort stays on the orphan list, retried later.
                let _ = upload.abort().await;
                Err(fail(e))
            }
        }
    }

    pub async fn readlink(&self, ino: Ino) -> FsResult<Bytes> {
        crate::testpoint::reached("readlink").await;
        let (path, cached) = {
            let t = self.ns.table();
            let i = t.get(ino).ok_or(FsError::ENOENT)?;
            if i.kind != FileKind::Symlink {
                return Err(FsError::EINVAL);
            }
            (i.path.clone(), i.symlink_target.clone())
        };
        let known = self.ns.table().get(ino).and_then(|i| i.etag.clone());
        if let Some(c) = cached {
            return Ok(c);
        }
        let key = self.ns.key(&path);
        // Another client may have made it longer than the size known. No more than PATH_MAX
        // bytes: a target is shorter (another client's object marked as a symlink may hold
        // gigabytes, which the inode would keep).
        let target = self
            .store
            .get_range(&key, 0..libc::PATH_MAX as u64, None)
            .await
            .map_err(|e| log_store_err(&format!("readlink {key}"), e))?;
        if target.len() >= libc::PATH_MAX as usize {
            tracing::warn!("readlink {key}: a symbolic link of PATH_MAX bytes or more");
            return Err(FsError(libc::ENAMETOOLONG));
        }
        if let Some(i) = self.ns.table().get_mut(ino) {
            // Not if a new version was learnt while the GET ran: it may hold the old target.
            if i.etag == known {
                i.symlink_target = Some(target.clone());
            }
        }
        Ok(target)
    }

    /// Read-only and name checks, and the parent's path, for calls that add an entry.
    fn prepare_new(&self, parent: Ino, name: &OsStr) -> FsResult<(String, MountPath)> {
        self.check_writable()?;
        self.ns.prepare_new(parent, name)
    }

    /// Stores the object of an entry made here at `path`, a name this mount found free:
    /// only while no object has `key` (another client may have made one since the mount
    /// looked), else `EEXIST` and the name is asked of the store again.
    async fn put_new(
        &self,
        path: &MountPath,
        key: &str,
        body: Bytes,
        pm: &PosixMeta,
        what: &str,
    ) -> FsResult<String> {
        match self
            .store
            .put_if(key, body, &pm.to_user(), Some(IF_ABSENT), None)
            .await
        {
            Err(StoreError::PreconditionFailed(_)) => {
                self.ns.changing(path);
                Err(FsError::EEXIST)
            }
            r => r.map_err(|e| log_store_err(&format!("{what} {key}"), e)),
        }
    }

    /// Holds off a rename of directory `dir`, or of one above it, while what is in it
    /// changes (see `subtrees`): waits for one under way.
    async fn changing_in(&self, dir: Ino) -> FsResult<subtrees::Held<'_>> {
        Ok(self.subtrees.store(|| self.ns.dir_path(dir)).await?.1)
    }

    pub async fn mkdir(
        &self,
        parent: Ino,
        name: &OsStr,
        mode: u32,
        umask: u32,
        caller: Caller,
    ) -> FsResult<Attr> {
        let _changing = self.changing_in(parent).await?;
        let (name, parent_path) = self.prepare_new(parent, name)?;
        let path = parent_path.join(&name);
        let pm = self.new_meta(parent, FileKind::Dir, mode, umask, caller);
        let key = self.ns.dir_key(&path);
        if name.len() <= BACKGROUND_MARKER_MAX_NAME {
            // The marker goes up in the background (see markers.rs).
            self.ns.markers.start(key, pm.to_user());
        } else {
            // A server may refuse this marker for its name alone: say so to mkdir.
            self.put_new(&path, &key, Bytes::new(), &pm, "mkdir")
                .await?;
        }
        let (ino, attr) = self
            .ns
            .add_new(parent, &name, path, FileKind::Dir, &pm, 0, None, false);
        if let Some(i) = self.ns.table().get_mut(ino) {
            // Just made: known to be empty.
            i.listing = Some(DirListing::new(Vec::new(), std::time::Instant::now()));
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
        let _changing = self.changing_in(parent).await?;
        let (name, parent_path) = self.prepare_new(parent, name)?;
        let path = parent_path.join(&name);
        let pm = self.new_meta(parent, FileKind::File, mode, umask, caller);
        let key = self.ns.key(&path);
        let etag = self
            .put_new(&path, &key, Bytes::new(), &pm, "create")
            .await?;
        Ok(self
            .ns
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
        let _changing = self.changing_in(parent).await?;
        let (name, parent_path) = self.prepare_new(parent, name)?;
        let path = parent_path.join(&name);
        let pm = self.new_meta(parent, FileKind::Symlink, 0o777, 0, caller);
        let key = self.ns.key(&path);
        let body = Bytes::copy_from_slice(target.as_os_str().as_bytes());
        let etag = self
            .put_new(&path, &key, body.clone(), &pm, "symlink")
            .await?;
        let (ino, attr) = self.ns.add_new(
            parent,
            &name,
            path,
            FileKind::Symlink,
            &pm,
            body.len() as u64,
            Some(etag),
            false,
        );
        if let Some(i) = self.ns.table().get_mut(ino) {
            i.symlink_target = Some(body);
        }
        Ok(attr)
    }

    /// Reads up to `size` bytes at `offset`; shorter only at end of file.
    pub async fn read(&self, ino: Ino, fh: u64, offset: u64, size: u32) -> FsResult<Bytes> {
        let mut tries = 0;
        loop {
            let path = self.ns.table().get(ino).map(|i| i.path.clone());
            let got = self.read_once(ino, fh, offset, size).await;
            if got != Err(FsError::ESTALE) || tries == 2 || !self.moved_away(ino, path).await {
                return got;
            }
            tries += 1;
        }
    }

    /// Whether file `ino`, at `path` when a read of it began, was moved since (an unlink of
    /// it or a rename over it keeping its bytes for its descriptors under a hidden name,
    /// waited for if under way): the read, refused at the old name, goes there. Before, a
    /// read in flight across that move got `ESTALE` (`412` at the old name).
    async fn moved_away(&self, ino: Ino, path: Option<MountPath>) -> bool {
        loop {
            let (removing, now) = match self.ns.table().get(ino) {
                Some(i) => (i.removing > 0, Some(i.path.clone())),
                None => return false,
            };
            if !removing {
                return now != path;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    async fn read_once(&self, ino: Ino, fh: u64, offset: u64, size: u32) -> FsResult<Bytes> {
        let handle = self.files.handle(ino, fh)?;
        let (reader, direct) = (handle.reader.clone(), handle.flags & libc::O_DIRECT != 0);
        if let Some(w) = self.files.write_of(ino) {
            if handle.write.is_none() {
                // A reader opened before another client's version was learnt: the state is
                // of the file as it is now, so only one that cannot have handed out the
                // version before reads it (as below, with no writer): its own reader, if
                // it served any, is of the version the inode names; with none, the
                // kernel's pages can hold no older version for it.
                let (learned, etag) = self
                    .ns
                    .table()
                    .get(ino)
                    .map(|i| (i.learned_changes, i.etag.clone()))
                    .ok_or(FsError::ENOENT)?;
                if handle.learned() != learned {
                    let older = match reader.lock().await.as_ref() {
                        Some(r) if r.has_served() => r.etag() != etag.as_deref(),
                        _ => !(direct || self.pages_only_of(ino, &handle, etag.as_deref())),
                    };
                    if older {
                        return Err(FsError::ESTALE);
                    }
                }
            }
            // Someone is writing this file: read its current content, staged bytes included.
            let mut st = w.state.lock().await;
            let got = st.read(offset..offset.saturating_add(size as u64)).await;
            drop(st);
            if !direct {
                self.filled_pages(ino, None);
            }
            return got;
        }
        // Taken first: what the inode says is read under it, so a read of this descriptor
        // that waited for another never acts on what was true before that one learnt more.
        let mut slot = reader.lock().await;
        let (path, etag, file_size, pages_current, learned, kernel_sizes) = {
            let t = self.ns.table();
            let i = t.get(ino).ok_or(FsError::ENOENT)?;
            // A read of the current version leaves such pages as they are (no lock after it).
            let current = i.pages.holds(i.etag.as_deref());
            let (etag, size) = (i.etag.clone(), i.attr.size);
            let held = i.kernel_may_hold_other_sizes(self.cfg.stat_ttl);
            (i.path.clone(), etag, size, current, i.learned_changes, held)
        };
        let key = self.ns.key(&path);
        let mut served = false;
        if slot.as_ref().is_some_and(|r| *r.key() != key) {
            // Renamed while open: read the object under its new key (what the old reader
            // handed out still counts).
            served = slot.take().is_some_and(|r| r.has_served());
        }
        let new_reader = |etag, size| self.files.new_reader(key.clone(), etag, size, direct);
        if slot.is_none()
            && handle.learned() != learned
            && !(!served && (direct || self.pages_only_of(ino, &handle, etag.as_deref())))
        {
            // Another client's version was learnt since the open, and the kernel may have
            // handed this descriptor pages of the one before (as a read would find it, below).
            return Err(FsError::ESTALE);
        }
        if !direct
            && handle.learned() != learned
            && slot.as_ref().is_some_and(|r| r.etag() != etag.as_deref())
        {
            // Its reader, of the version before another client's learnt since the open, could
            // serve bytes from memory with no refused GET, and they would go into the
            // kernel's pages, which a newer open reads (it has served some: ESTALE).
            return Err(FsError::ESTALE);
        }
        if etag.is_some()
            && handle.learned() == learned
            && slot.as_ref().is_some_and(|r| r.etag() != etag.as_deref())
        {
            // The version changed through this mount since the reader began (a write
            // published, a chmod's copy): the file is what this mount made it, as on a local
            // disk, and the reader's pin would refuse it.
            served |= slot.take().is_some_and(|r| r.has_served());
        }
        if slot.is_none() && !served {
            // Reads the version the inode names from its first byte on.
            handle.took_up(learned);
        }
        let first = slot.is_none();
        let r = slot.get_or_insert_with(|| new_reader(etag.clone(), file_size));
        if served {
            r.mark_served();
        }
        // A 404 to the pinned GET: another client deleted the file from under the descriptor.
        let gone_is_stale = |e| match e {
            FsError::ENOENT => FsError::ESTALE,
            e => e,
        };
        let got = r.read(offset, size).await.map_err(gone_is_stale);
        if got != Err(FsError::ESTALE) {
            if got.is_ok() && !direct && !(pages_current && r.etag() == etag.as_deref()) {
                self.filled_pages(ino, r.etag());
            }
            // A first reader reads the version the inode names, whose sizes those are.
            let (may_hold_less, may_hold_more) = kernel_sizes;
            // A full reply never shrinks the kernel's size; a short one (the version's end)
            // does, if it holds more, and a notice racing it would make it refuse.
            let shrinks = |b: &Bytes| b.len() < size as usize && may_hold_more;
            if first && !direct && may_hold_less && got.as_ref().is_ok_and(|b| !shrinks(b)) {
                // The first read of another client's larger version, while the kernel may
                // hold a smaller size (a reply that told it dropped): it hands the caller
                // bytes up to that size only, then stops there, the new version cut short.
                // Told its size is stale, its next read past it asks again.
                self.ns.stale_attrs_of(ino, r.etag());
            }
            return got;
        }
        // The object changed after this mount last looked at it (the ETag it had is older).
        // A descriptor that has read nothing yet reads the object as it is now, if the
        // kernel cannot have handed it bytes of another version either: with O_DIRECT, or
        // while the pages it may have been handed since its open are all of the new
        // version. Any other gets ESTALE, and the next open starts from the new one.
        // Moved (or being moved) to a hidden name for its descriptors by an unlink or a rename
        // over it here: not another version to take up, but the same file elsewhere (`read`
        // reads it there).
        let moving = self
            .ns
            .table()
            .get(ino)
            .is_none_or(|i| i.removing > 0 || self.ns.key(&i.path) != key);
        if moving {
            return Err(FsError::ESTALE);
        }
        let unread = !r.has_served();
        let mut tries = 0;
        let mut grew = false;
        let got = loop {
            tries += 1;
            let (etag, len, longer) = self.repin(ino, &key).await?;
            grew |= longer;
            if !(unread && (direct || self.pages_only_of(ino, &handle, etag.as_deref()))) {
                break Err(FsError::ESTALE);
            }
            *r = new_reader(etag, len);
            if let Some(l) = self.ns.table().get(ino).map(|i| i.learned_changes) {
                handle.took_up(l);
            }
            match r.read(offset, size).await.map_err(gone_is_stale) {
                Err(e) if e == FsError::ESTALE && tries < REPIN_TRIES => continue,
                other => break other,
            }
        };
        if grew {
            // The kernel stops reading at the size it knows (a short read shrinks that by
            // itself): make it ask again before it next reads past it.
            self.ns.stale_attrs(ino);
        }
        if got.is_ok() && !direct {
            self.filled_pages(ino, r.etag());
        }
        got
    }

    /// Whether every page of `ino` the kernel may have handed descriptor `h` since its open
    /// is of version `etag`.
    fn pages_only_of(&self, ino: Ino, h: &FileHandle, etag: Option<&str>) -> bool {
        let t = self.ns.table();
        t.get(ino)
            .is_some_and(|i| i.page_drops == h.page_drops && i.pages.only_of(etag))
    }

    /// A read of `ino` filled the kernel's page cache with bytes of version `etag`.
    fn filled_pages(&self, ino: Ino, etag: Option<&str>) {
        self.ns.with(ino, |i| i.pages.filled(etag));
    }

    /// Learns the object of open file `ino` (at `key`) as it is now in the store, after a
    /// read found it changed: its ETag, its size, and whether that is more than stat showed.
    async fn repin(&self, ino: Ino, key: &ObjectKey) -> FsResult<(Option<String>, u64, bool)> {
        let obj = match self.store.head(key).await {
            Ok(o) => o,
            Err(StoreError::NotFound(_)) => return Err(FsError::ESTALE),
            Err(e) => return Err(log_store_err(&format!("stat {key}"), e)),
        };
        let grew = self.ns.learned(ino, key, &obj);
        Ok((obj.etag, obj.size, grew))
    }

    /// Registers what tells the kernel that its cached attributes of an inode are out of
    /// date (another client's change made the object larger than the size it may hold).
    pub fn on_stale_cache(&self, f: Option<StaleCache>) {
        self.ns.on_stale_cache(f);
    }

    /// Writes all of `data` at `offset` (at the end if the handle was opened `O_APPEND`) and
    /// returns its length.
    pub async fn write(&self, ino: Ino, fh: u64, offset: u64, data: Bytes) -> FsResult<u32> {
        let append = self.files.handle(ino, fh)?.appends();
        self.write_as(ino, fh, offset, data, append).await
    }

    /// [`Fs::write`], at the end with `append` (the descriptor's flags now).
    async fn write_as(
        &self,
        ino: Ino,
        fh: u64,
        offset: u64,
        data: Bytes,
        append: bool,
    ) -> FsResult<u32> {
        let h = self.files.handle(ino, fh)?;
        let w = h.write.as_ref().ok_or(FsError::EBADF)?;
        let mut st = w.state.lock().await;
        h.changes();
        let at = FileHandle::write_offset(offset, st.size(), append);
        let took = st.write(at, data).await?;
        drop(st);
        self.wrote(ino);
        Ok(took as u32)
    }

    /// The file's content changed here: its mtime and ctime are now, and the kernel's pages
    /// may hold what was written.
    fn wrote(&self, ino: Ino) {
        self.ns.with(ino, |i| {
            i.attr.mtime = now();
            i.attr.ctime = i.attr.mtime;
            i.pages = KernelPages::Unknown;
        });
    }

    /// A write, finished on the calling (FUSE) thread straight from its buffer when it is an
    /// append to the file's in-memory part, else by the task it returns. `kill_suid`: the
    /// caller may not keep set-id bits (`FUSE_WRITE_KILL_SUIDGID`), cleared first. `append`:
    /// the descriptor has `O_APPEND` now (the write's own flags: `fcntl` may have changed them
    /// since the open).
    pub fn write_now(
        self: &Arc<Self>,
        ino: Ino,
        fh: u64,
        offset: u64,
        data: &[u8],
        kill_suid: bool,
        append: bool,
    ) -> Now<FsResult<u32>> {
        let n = data.len() as u32;
        let h = match self.files.handle(ino, fh) {
            Ok(h) => h,
            Err(e) => return Now::Done(Err(e)),
        };
        if kill_suid && self.suid_bits(ino) != 0 {
            let (fs, data) = (self.clone(), self.files.copy_write(data));
            return Now::Later(Box::pin(async move {
                fs.kill_suid(ino).await?;
                fs.write_as(ino, fh, offset, data, append).await
            }));
        }
        let appended = self.files.append_now(&h, offset, data, append);
        if appended != Appended::No {
            self.wrote(ino);
        }
        match appended {
            Appended::Yes => Now::Done(Ok(n)),
            // The part is full: it is shipped before the write is answered.
            Appended::PartFull => {
                let w = h.write.expect("only a writer's handle appends");
                Now::Later(Box::pin(async move {
                    w.state.lock().await.ship_filled_tail().await;
                    Ok(n)
                }))
            }
            Appended::No => {
                let (fs, data) = (self.clone(), self.files.copy_write(data));
                Now::Later(Box::pin(async move {
                    fs.write_as(ino, fh, offset, data, append).await
                }))
            }
        }
    }

    /// [`Fs::flush`] or [`Fs::fsync`], answered on the calling thread when
    /// the handle has nothing to upload (read-only, or no change since the last publish):
    /// programs that fsync every open file (sysbench does, every 100 writes) or close many
    /// read-only files pay a thread hand-off per call otherwise.
    pub fn publish_now(self: &Arc<Self>, ino: Ino, fh: u64, fsync: bool) -> Now<FsResult<()>> {
        // Background mode with fsync waiting for the bucket: an unchanged file may still
        // have an upload to wait for.
        let waits = fsync
            && self
                .files
                .writeback()
                .is_some_and(|wb| wb.config().fsync_waits_upload);
        match self.files.handle(ino, fh) {
            Err(e) => return Now::Done(Err(e)),
            Ok(h) => {
                if fsync {
                    self.files.note_fsync(&h);
                }
                let of_writers = fsync && h.write.is_none() && self.files.write_of(ino).is_some();
                if !waits && !of_writers && self.files.nothing_to_publish(&h) == Some(true) {
                    return Now::Done(Ok(()));
                }
                if !fsync && self.files.leaves_close_to_others_now(&h) {
                    return Now::Done(Ok(()));
                }
            }
        }
        let fs = self.clone();
        Now::Later(Box::pin(async move {
            if fsync {
                fs.fsync(ino, fh).await
            } else {
                fs.flush(ino, fh).await
            }
        }))
    }

    /// Whether a close of handle `fh` would only store an empty file (created or truncated
    /// here, nothing written yet) that no other handle has open. Such a close may be left to
    /// the next one while the closing process still holds a duplicate of the descriptor: a
    /// shell's `echo x > f` opens, duplicates and closes before writing, and the empty object
    /// that close would store is replaced at once (two PUTs for one file).
    pub fn close_stores_only_emptiness(&self, ino: Ino, fh: u64) -> bool {
        let Ok(h) = self.files.handle(ino, fh) else {
            return false;
        };
        let sole = self.ns.with(ino, |i| i.open_handles == 1).unwrap_or(false);
        sole && self.files.only_emptied(&h)
    }

    /// Uploads what this handle's file holds and records the new object (in background
    /// mode: commits it to the write-back directory). Returns the write-back entry of the
    /// file's last commit, if any. `fsync`: the file stays open (in background mode with
    /// local fsyncs its version waits for the close before it uploads: see
    /// `writeback::PARK`).
    async fn publish_handle(&self, ino: Ino, fh: u64, fsync: bool) -> FsResult<Option<u64>> {
        // An fsync through a descriptor open for reading (`sync FILE`) stores what the
        // file's writers wrote, as on a local disk.
        let h = self.files.handle(ino, fh)?;
        let write = h.write.clone();
        let Some(w) = write.or_else(|| self.files.write_of(ino).filter(|_| fsync)) else {
            return Ok(None);
        };
        let mut st = w.state.lock().await;
        if !st.has_changes_to_publish() {
            return Ok(st.committed());
        }
        if !fsync && self.files.leaves_close_to_others(&h, st.failed()) {
            return Ok(None);
        }
        let park = fsync
            && self
                .files
                .writeback()
                .is_some_and(|wb| !wb.config().fsync_waits_upload);
        if let Err(e) = self.persist(ino, &mut st, park).await {
            if e == FsError::ESTALE {
                self.ns.changed_elsewhere(ino);
            }
            return Err(e);
        }
        h.changed.store(false, Ordering::Relaxed);
        Ok(st.committed())
    }

    /// Stores what write state `st` of `ino` holds: a publish, or in background mode a
    /// commit to the write-back directory (`park`: see [`Self::publish_handle`]); then
    /// records it in the namespace.
    pub(crate) async fn persist(&self, ino: Ino, st: &mut WriteState, park: bool) -> FsResult<()> {
        if self.files.writeback().is_some() {
            match st.commit(ino, park).await? {
                Stored::Committed => self.ns.changed_here(ino, st.size(), st.meta.clone()),
                Stored::Uploaded => self.published(ino, st),
            }
        } else {
            st.publish().await?;
            self.published(ino, st);
        }
        Ok(())
    }

    /// A background upload of file `u.ino` landed: the inode learns the object's ETag and,
    /// when nothing of it is left to store and nobody has it open for writing, its write
    /// state goes (it was kept for reads and as the file's content until now).
    ///
    /// The entry stays pending (landed) until this is done, under the state's lock: a
    /// release in between keeps the state for this to retire, so the inode never keeps the
    /// ETag of an older version.
    async fn uploaded(&self, u: crate::files::writeback::Uploaded) {
        let Some(w) = self.files.write_of(u.ino) else {
            // Its state went already (unlinked, renamed over): the inode learns the object
            // if it still names it.
            {
                let mut t = self.ns.table();
                if let Some(i) = t.get_mut(u.ino) {
                    if !i.writing && self.ns.key(&i.path).as_str() == u.key {
                        i.etag = Some(u.etag.clone());
                        i.fetched = Some(std::time::Instant::now());
                    }
                }
            }
            if let Some(wb) = self.files.writeback() {
                wb.settled(u.seq);
            }
            return;
        };
        let mut st = w.state.lock().await;
        self.learn_upload(&u, &w, &mut st);
        if let Some(wb) = self.files.writeback() {
            wb.settled(u.seq);
        }
    }

    /// [`Self::uploaded`] with the file's write state `st` (of `w`) locked.
    fn learn_upload(
        &self,
        u: &crate::files::writeback::Uploaded,
        w: &Arc<OpenWrite>,
        st: &mut WriteState,
    ) {
        if st.committed() != Some(u.seq) || st.key.as_str() != u.key || st.is_unlinked() {
            return;
        }
        st.commit_landed(u.etag.clone());
        let clean = !st.has_changes_to_publish();
        if clean {
            self.ns
                .stored(u.ino, st.size(), Some(u.etag.clone()), st.meta.clone());
        }
        let mut t = self.ns.table();
        let Some(i) = t.get_mut(u.ino) else {
            return;
        };
        if !clean {
            // In the bucket now, as committed; what changed since comes with the next commit.
            i.etag = Some(u.etag.clone());
            i.fetched = Some(std::time::Instant::now());
        }
        if clean && self.files.is_sole(u.ino, w) {
            self.files.forget_write(u.ino);
            i.writing = false;
            st.retire();
            t.maybe_drop(u.ino);
        }
    }

    /// The object of `ino` is now in the store as write state `st` (held locked, so that no
    /// setattr queued after the publish is overwritten here) says.
    fn published(&self, ino: Ino, st: &WriteState) {
        let etag = st.base_etag().map(str::to_string);
        self.ns.stored(ino, st.size(), etag, st.meta.clone());
    }

    /// close(2) of one descriptor: publishes what was written and reports a failed upload
    /// (in background mode: makes it durable in the write-back directory).
    pub async fn flush(&self, ino: Ino, fh: u64) -> FsResult<()> {
        self.publish_handle(ino, fh, false).await.map(|_| ())
    }

    /// Makes everything written so far durable in the bucket (in background mode: in the
    /// write-back directory, or with `fsync_waits_upload` in the bucket).
    pub async fn fsync(self: &Arc<Self>, ino: Ino, fh: u64) -> FsResult<()> {
        let h = self.files.handle(ino, fh)?;
        self.files.note_fsync(&h);
        if let Some(w) = &h.write {
            self.commit_along(ino, w);
        }
        let committed = self.publish_handle(ino, fh, true).await?;
        match (self.files.writeback(), committed) {
            (Some(wb), Some(seq)) if wb.config().fsync_waits_upload => wb.wait_uploaded(seq).await,
            _ => Ok(()),
        }
    }

    /// Background mode with local fsyncs: group commit. An fsync through `write` that has
    /// something to store first starts commits of what other open files wrote since their
    /// own last fsync: they run together on the blocking pool and share their syncs, and
    /// the files' own fsyncs then find nothing to store. A program that fsyncs each of its
    /// files in turn (a database's checkpoint, sysbench's rndwr) pays a few device flushes
    /// per round instead of one per file.
    ///
    /// Only files fsync'd since they were last taken along (a file written beside one that
    /// is fsync'd often is taken once per fsync of its own: no write amplification), whose
    /// changes are a small delta over the version an fsync of theirs made (never a file's
    /// first version: a new file never comes back after a crash unless acknowledged; never
    /// a file cut shorter since), taken only if that delta has room at once (see
    /// [`WriteState::commit_along`]).
    fn commit_along(self: &Arc<Self>, ino: Ino, write: &OpenWrite) {
        let Some(wb) = self.files.writeback() else {
            return;
        };
        // Nothing of its own to sync: the others' commits would each pay their own.
        if wb.config().fsync_waits_upload
            || write
                .state
                .try_lock()
                .is_ok_and(|st| !st.has_changes_to_publish())
        {
            return;
        }
        let mut room = ALONG_BYTES;
        let mut taken = 0;
        for (other, w) in self.files.fsynced_writes(ino) {
            if taken == ALONG_FILES || room == 0 {
                break;
            }
            let len = w.state.try_lock().ok().and_then(|st| {
                let len = st.along_len()?;
                let delta = wb.takes_delta(st.key.as_str(), st.committed(), st.size(), len);
                (len <= ALONG_FILE_MAX.min(room) && delta).then_some(len)
            });
            let Some(len) = len else {
                continue;
            };
            if !w.fsynced.swap(false, std::sync::atomic::Ordering::Relaxed) {
                continue;
            }
            room -= len;
            taken += 1;
            let fs = self.clone();
            tokio::spawn(async move {
                // Its own fsync or a write may come first: the commit then finds less or
                // nothing to do.
                let mut st = w.state.lock().await;
                if st.commit_along(other, ALONG_FILE_MAX).await {
                    fs.ns.changed_here(other, st.size(), st.meta.clone());
                    crate::metrics::inc(&fs.files.metrics().writeback_along);
                }
            });
        }
    }

    /// Background mode: waits for the uploads queued or running (failed ones are tried once
    /// more, and left), calling `progress(files, bytes)` every `every` meanwhile. Returns
    /// the files left and how many of them failed.
    pub async fn wait_for_uploads(
        &self,
        every: Duration,
        progress: impl FnMut(usize, u64),
    ) -> (usize, usize) {
        let Some(wb) = self.files.writeback() else {
            return (0, 0);
        };
        wb.drain(every, progress).await;
        let (files, _, failed) = wb.counts();
        (files, failed)
    }

    /// Background mode: the files not uploaded yet.
    pub fn pending_uploads(&self) -> Vec<crate::files::writeback::PendingFile> {
        self.files
            .writeback()
            .map(|wb| wb.pending())
            .unwrap_or_default()
    }

    /// The last reference to an open file went away.
    pub async fn release(&self, ino: Ino, fh: u64) -> FsResult<()> {
        let Some(FileHandle { write, through, .. }) = self.files.remove_handle(fh) else {
            return Err(FsError::EBADF);
        };
        if through {
            self.files.drop_through(ino);
        }
        let (last_writer, hidden, idle) = {
            let mut t = self.ns.table();
            let Some(i) = t.get_mut(ino) else {
                return Ok(());
            };
            i.open_handles = i.open_handles.saturating_sub(1);
            let writers = match write {
                Some(_) => self.files.drop_writer(ino),
                None => 1,
            };
            if i.unlinked && i.open_handles == 0 {
                // The state kept for readers of an unlinked file (see below) goes with them.
                self.files.forget_write(ino);
                i.writing = false;
            }
            let hidden = (i.hidden && i.open_handles == 0).then(|| {
                i.hidden = false;
                i.path.clone()
            });
            (write.is_some() && writers == 0, hidden, i.open_handles == 0)
        };
        if !last_writer {
            if idle {
                self.drop_state_kept_for_readers(ino).await;
            }
            if let Some(path) = hidden {
                self.delete_hidden(path).await;
            }
            return Ok(());
        }
        let w = write.expect("writer handle");
        self.last_writer_done(ino, &w, true).await;
        if let Some(path) = hidden {
            self.delete_hidden(path).await;
        }
        Ok(())
    }

    /// Background mode: the last reader of `ino` closed. A write state a rename kept for
    /// readers after its upload landed (see [`Self::drop_if_uploaded`]) goes now: nothing
    /// else would retire it, and the file would show it over other clients' changes.
    async fn drop_state_kept_for_readers(&self, ino: Ino) {
        if self.files.writeback().is_none() {
            return;
        }
        let Some(w) = self
            .files
            .write_of(ino)
            .filter(|w| self.files.is_sole(ino, w))
        else {
            return;
        };
        let mut st = w.state.lock().await;
        if !st.is_unlinked() {
            self.drop_if_uploaded(ino, &w, &mut st);
        }
    }

    /// The last writer of `ino` (a descriptor, or a `truncate` of a file nobody had open:
    /// `close` false) is done with write state `w`: what is left of its changes is published,
    /// and the state goes, unless the inode still needs it (an upload to land in background
    /// mode, readers of an unlinked file).
    pub(super) async fn last_writer_done(&self, ino: Ino, w: &Arc<OpenWrite>, close: bool) {
        let mut st = w.state.lock().await;
        let (mut ask_store, mut gone) = (false, None);
        if st.has_changes_to_publish() && !st.failed() {
            // Normally flush already published; this catches a flush that never came.
            if let Err(e) = self.persist(ino, &mut st, false).await {
                tracing::error!("{}: data not uploaded and now lost: {e}", st.key);
            }
        } else if st.failed() && close {
            tracing::error!("{}: closed after a failed upload; data not stored", st.key);
        }
        // The inode shows the size and metadata of what was never stored, with the ETag of
        // the version stored before: a next writer would build on that pair.
        let unstored = st.has_changes_to_publish();
        st.abort_stream().await;
        if let (Some(wb), Some(seq)) = (self.files.writeback(), st.committed()) {
            // A version an fsync parked goes up now.
            wb.closed(seq);
        }
        {
            // Still under the state's lock: a setattr waiting for it sees the state retired
            // and stores its change itself, instead of queueing it where nothing publishes.
            let mut t = self.ns.table();
            let mut never_stored = false;
            // Background mode: a file whose commit is still to upload keeps its state (its
            // content, read from the write-back entry) until the upload lands.
            let uploading = !st.is_unlinked()
                && st
                    .committed()
                    .zip(self.files.writeback())
                    .is_some_and(|(seq, wb)| wb.is_pending(wb.latest(seq)));
            if let Some(i) = t.get_mut(ino).filter(|_| !uploading) {
                if self.files.is_sole(ino, w) {
                    // An unlinked file's bytes may exist nowhere else: its readers read them
                    // from the state until the last close.
                    let retired = !st.is_unlinked() || i.open_handles == 0;
                    if retired {
                        self.files.forget_write(ino);
                        i.writing = false;
                        st.retire();
                    }
                    never_stored = i.fetched.is_none() && st.committed().is_none();
                    ask_store = retired && unstored && !never_stored;
                }
            }
            if never_stored {
                // Created here and never uploaded: the file does not exist.
                gone = t.get(ino).map(|i| (i.parent, i.path.clone()));
                t.removed(ino);
            } else if ask_store {
                // Readers build on the inode's (ETag, size): the size never stored goes
                // with the state, back to its base version's.
                if let Some(i) = t.get_mut(ino) {
                    let base = st.base_etag().zip(st.base_size());
                    if let Some((etag, size)) = base.filter(|_| st.committed().is_none()) {
                        if i.etag.as_deref() == Some(etag) {
                            i.attr.size = size;
                        }
                    }
                }
                self.ns.ask_store_again(&mut t, ino);
            }
            t.maybe_drop(ino);
        }
        if let Some((parent, path)) = gone {
            self.ns.note_removed(parent, &path);
        }
        if ask_store {
            // The kernel keeps the attributes a setattr answered (the size never stored).
            self.ns.stale_attrs(ino);
        }
    }

    // ---- directories ----

    /// Opens a directory for listing and returns its handle. The listing is read from the
    /// store page by page as `readdir` asks for entries.
    pub async fn opendir(&self, ino: Ino) -> FsResult<u64> {
        self.ns.opendir(ino).await
    }

    /// Entries after cookie `offset` (0 = from the start, including `.` and `..`).
    pub async fn readdir(&self, ino: Ino, fh: u64, offset: i64) -> FsResult<Vec<DirEntry>> {
        // Not while a rename moves the directory (see `subtrees`): a page would miss what
        // the rename deleted already. One renamed since the last page goes on at its new
        // place.
        let held = self.subtrees.store(|| self.ns.dir_path(ino)).await.ok();
        self.ns
            .readdir(fh, offset, held.as_ref().map(|(p, _)| p))
            .await
    }

    /// Attributes for readdirplus entry `e` of directory `dir`, and whether they are
    /// complete (see [`Namespace::plus_entry`]).
    pub fn plus_entry(&self, dir: Ino, e: &DirEntry) -> Option<(Attr, bool)> {
        let (attr, complete) = self.ns.plus_entry(dir, e)?;
        Some((self.live(attr), complete))
    }

    pub fn releasedir(&self, _ino: Ino, fh: u64) {
        self.ns.releasedir(fh);
    }

    /// fsync of a directory: the directories made in it (and below) are in the bucket.
    pub async fn fsyncdir(&self, ino: Ino) -> FsResult<()> {
        let path = self.ns.dir_path(ino)?;
        self.ns.markers.wait_below(&self.ns.dir_key(&path)).await
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
        self.ns.refresh(ino)
    }

    /// Keys of the files being written with something not stored yet, for the second signal
    /// to name (without waiting: a file busy publishing has its upload named already).
    pub fn files_not_stored(&self) -> Vec<String> {
        self.files.not_stored()
    }

    /// The last step once the mount is gone (SIGTERM waits for every descriptor to close,
    /// and each close publishes its own file). A file still being written now was never
    /// closed: what it holds is half written, so it is not published (that would put it
    /// under the file's key); its upload is aborted and it is named. Returns how many files
    /// were not stored.
    pub async fn shutdown(&self) -> usize {
        let writes = self.files.all_writes();
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
        let hidden = self.ns.table().take_hidden();
        for path in hidden {
            self.delete_hidden(path).await;
        }
        // Every marker is below the mount root.
        let root = self.ns.dir_key(&MountPath::root());
        if let Err(e) = self.ns.markers.wait_below(&root).await {
            tracing::error!("directory markers not stored at shutdown: {e}");
            failed += self.ns.markers.len();
        }
        let settle_by = std::time::Instant::now() + CACHE_SETTLE;
        if let Some(c) = self.files.data_cache() {
            if !c.settle(CACHE_SETTLE).await {
                tracing::warn!(
                    "the data cache's writer did not finish within {CACHE_SETTLE:?}; blocks \
                     still queued are not cached"
                );
            }
        }
        // The record of this mount's last changes, or the next mount would believe a page
        // saved before them.
        if let Some(p) = &self.saved_pages {
            self.ns.changes_end();
            let left = settle_by.saturating_duration_since(std::time::Instant::now());
            if !p.settle(left).await {
                tracing::warn!(
                    "the data cache's record of this mount's changes was not written within \
                     {CACHE_SETTLE:?}; the next mount may list what this one changed as it was"
                );
            }
        }
        self.files.uploads().retry_aborts().await;
        let left = self.files.uploads().pending_aborts();
        if left > 0 {
            tracing::error!("{left} multipart uploads could not be aborted");
        }
        failed
    }
}
