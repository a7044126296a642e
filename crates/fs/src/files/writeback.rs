//! Background upload (`--upload background`): a closed file is made durable in a local
//! write-back directory, then uploaded by a few workers while the application goes on.
//!
//! Each committed version of a file is one *entry*: a file `SEQ.wb` in the directory holding
//! the file's bytes, then a trailer (key, size, user metadata, upload condition, the entries
//! it replaces) and a footer (trailer length, CRC-32 of everything before it, magic). The
//! committer writes it, fsyncs it and fsyncs the directory (shared by concurrent commits)
//! before close returns; an entry whose footer or CRC does not check out was never
//! acknowledged and is removed at the next start. So after any crash the directory holds
//! exactly the versions whose close returned, and [`WriteBack::open`] queues them again.
//!
//! One rule for what an upload may replace: the version this mount last knew of the key.
//! An entry of a file created here is uploaded only while the key is free (`If-None-Match:
//! *`), one of a file that existed only over the ETag it was opened on (`If-Match`); a later
//! version of the same file replaces its queued entry (taking its condition) or, once that
//! is uploaded, is pinned to the ETag that upload got. Another client's object met on the way
//! is never replaced: the entry stays, failed, until the file is written again here (that
//! stores this version over the other) or removed.
//!
//! At most one entry per key exists at a time, and a key's entry is never replaced while it
//! uploads (the new commit waits for it), so the order of versions in the bucket is the
//! order of their closes.

use crate::error::{FsError, FsResult};
use crate::meta::Ino;
use crate::metrics::{inc, FsMetrics};
use bucketfs_store::{CompletedPart, ObjectStore, StoreError, Uploads, UserMeta, IF_ABSENT};
use bytes::Bytes;
use md5::{Digest, Md5};
use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Notify;

const MAGIC: &[u8; 8] = b"BFSWB\x00\x00\x01";
const FOOTER: usize = 4 + 4 + 8;
/// Upload results kept for later versions of the same files (their `If-Match`).
const RESULTS_KEPT: usize = 200_000;
/// A failed upload is tried again after this, doubling up to [`RETRY_MAX`].
const RETRY_FIRST: Duration = Duration::from_secs(10);
const RETRY_MAX: Duration = Duration::from_secs(300);

/// What an entry's upload may replace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cond {
    /// Only while no object has the key (a file created here).
    Absent,
    /// Only the object with this ETag (the version this mount knew).
    Match(String),
    /// Whatever is there (the user wrote the file again after a conflict).
    Any,
}

impl Cond {
    fn if_match(&self) -> Option<&str> {
        match self {
            Cond::Absent => Some(IF_ABSENT),
            Cond::Match(e) => Some(e),
            Cond::Any => None,
        }
    }
}

#[derive(Debug, Clone)]
pub struct WriteBackConfig {
    /// The directory (private, persistent) of this bucket and prefix.
    pub dir: PathBuf,
    /// Most bytes of entries not uploaded yet; a commit waits for room (one larger file
    /// alone is let through).
    pub max_bytes: u64,
    /// Uploads at once.
    pub concurrency: usize,
    /// fsync(2) waits for the upload, not only for local durability.
    pub fsync_waits_upload: bool,
    /// How long a committed version waits before its upload starts: a file renamed,
    /// removed or written again meanwhile costs no upload of this version.
    pub delay: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    Queued,
    /// Being replaced by a commit in progress: no worker takes it.
    Held,
    Uploading,
    /// The last try failed; tried again at `next_try` (never for a conflict).
    Failed,
}

struct Entry {
    key: String,
    size: u64,
    meta: UserMeta,
    cond: Cond,
    path: PathBuf,
    /// The inode whose file this is (0: recovered at start).
    ino: Ino,
    status: Status,
    error: Option<String>,
    conflict: bool,
    tries: u32,
    next_try: Option<Instant>,
    /// Not uploaded before this.
    not_before: Instant,
}

/// An upload a worker took.
struct Job {
    seq: u64,
    key: String,
    size: u64,
    meta: UserMeta,
    cond: Cond,
    path: PathBuf,
    ino: Ino,
}

/// One pending file, for `bucketfs pending`.
#[derive(Debug, Clone)]
pub struct PendingFile {
    pub key: String,
    pub size: u64,
    pub state: &'static str,
    pub error: Option<String>,
    pub path: PathBuf,
}

/// An upload that landed: the file's object is now `etag`.
#[derive(Debug, Clone)]
pub struct Uploaded {
    pub ino: Ino,
    pub seq: u64,
    pub key: String,
    pub etag: String,
}

type OnUploaded = Box<dyn Fn(Uploaded) + Send + Sync>;

#[derive(Default)]
struct Inner {
    entries: BTreeMap<u64, Entry>,
    /// The entry of each key.
    by_key: HashMap<String, u64>,
    /// ETags of uploaded entries, for the next version of the same file.
    results: HashMap<u64, String>,
    results_order: VecDeque<u64>,
    /// Entries a worker may take, oldest first.
    ready: VecDeque<u64>,
    /// Bytes of entries (and of commits in progress).
    bytes: u64,
    next_seq: u64,
    /// Uploads running.
    running: usize,
}

pub struct WriteBack {
    cfg: WriteBackConfig,
    store: Arc<dyn ObjectStore>,
    uploads: Arc<Uploads>,
    part_size: u64,
    metrics: Arc<FsMetrics>,
    inner: Mutex<Inner>,
    /// Work for the workers.
    work: Notify,
    /// An entry finished (uploaded, failed, removed) or room was freed.
    changed: Notify,
    dir_sync: DirSync,
    dir_file: File,
    on_uploaded: Mutex<Option<Arc<OnUploaded>>>,
    /// Held for the daemon's life: one mount per directory.
    _lock: File,
}

/// A commit in progress: the entry file being written.
pub struct Slot {
    seq: u64,
    key: String,
    size: u64,
    cond: Cond,
    replaces: Option<u64>,
    path: PathBuf,
    file: Arc<File>,
    crc: crc32fast::Hasher,
    written: u64,
}

impl Slot {
    /// Appends `data` (the bytes must come in order, from 0 to the size).
    pub async fn write(&mut self, data: Bytes) -> FsResult<()> {
        self.crc.update(&data);
        let (file, at) = (self.file.clone(), self.written);
        self.written += data.len() as u64;
        tokio::task::spawn_blocking(move || file.write_all_at(&data, at))
            .await
            .map_err(|_| FsError::EIO)?
            .map_err(wb_io)
    }

    /// The entry file, for reads of the bytes written.
    pub fn file(&self) -> Arc<File> {
        self.file.clone()
    }
}

fn wb_io(e: std::io::Error) -> FsError {
    tracing::warn!("write-back directory: {e}");
    FsError::from(e)
}

/// What [`WriteBack::cancel`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cancelled {
    /// The entry was removed before it went up; it was to replace what `Cond` says.
    Removed(Cond),
    /// It had been uploaded already (the object is in the bucket).
    Uploaded,
    /// No such entry.
    Unknown,
}

impl WriteBack {
    /// Opens (creating, mode 0700) the directory, takes its lock, and queues every entry a
    /// previous daemon acknowledged; removes those it never did. Returns how many it queued.
    pub fn open(
        cfg: WriteBackConfig,
        store: Arc<dyn ObjectStore>,
        uploads: Arc<Uploads>,
        part_size: u64,
        metrics: Arc<FsMetrics>,
    ) -> Result<(Arc<Self>, usize), String> {
        use std::os::unix::fs::DirBuilderExt;
        let dir = &cfg.dir;
        let err = |e: std::io::Error| format!("write-back directory {}: {e}", dir.display());
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(err)?;
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(err)?;
        }
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(dir.join("lock"))
            .map_err(err)?;
        {
            use std::os::fd::AsRawFd;
            // SAFETY: flock on a descriptor we own.
            if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
                return Err(format!(
                    "write-back directory {} is in use by another bucketfs of the same bucket \
                     and state directory",
                    dir.display()
                ));
            }
        }
        let dir_file = File::open(dir).map_err(err)?;
        let mut inner = Inner::default();
        let found = recover(dir).map_err(err)?;
        let replaced: std::collections::HashSet<u64> =
            found.values().filter_map(|t| t.replaces).collect();
        let mut max_seq = 0;
        for (seq, t) in found {
            max_seq = max_seq.max(seq);
            let path = entry_path(dir, seq);
            if replaced.contains(&seq) {
                let _ = std::fs::remove_file(&path);
                continue;
            }
            if let Some(old) = inner.by_key.insert(t.key.clone(), seq) {
                // Two of one key (cannot happen): the later one is the file.
                if let Some(e) = inner.entries.remove(&old) {
                    inner.bytes -= e.size;
                    let _ = std::fs::remove_file(&e.path);
                }
            }
            inner.bytes += t.size;
            inner.ready.push_back(seq);
            inner.entries.insert(
                seq,
                Entry {
                    key: t.key,
                    size: t.size,
                    meta: t.meta,
                    cond: t.cond,
                    path,
                    ino: 0,
                    status: Status::Queued,
                    error: None,
                    conflict: false,
                    tries: 0,
                    next_try: None,
                    not_before: Instant::now(),
                },
            );
        }
        inner.ready = inner
            .ready
            .iter()
            .copied()
            .filter(|s| inner.entries.contains_key(s))
            .collect();
        inner.next_seq = max_seq.max(now_seq()) + 1;
        let n = inner.entries.len();
        let wb = Arc::new(Self {
            cfg,
            store,
            uploads,
            part_size,
            metrics,
            inner: Mutex::new(inner),
            work: Notify::new(),
            changed: Notify::new(),
            dir_sync: DirSync::default(),
            dir_file,
            on_uploaded: Mutex::new(None),
            _lock: lock,
        });
        wb.update_gauges();
        for _ in 0..wb.cfg.concurrency.max(1) {
            let w = Arc::downgrade(&wb);
            tokio::spawn(worker(w));
        }
        let w = Arc::downgrade(&wb);
        tokio::spawn(retry_loop(w));
        Ok((wb, n))
    }

    pub fn config(&self) -> &WriteBackConfig {
        &self.cfg
    }

    /// Called (on a worker, briefly) after each upload that landed.
    pub fn on_uploaded(&self, f: OnUploaded) {
        *self.on_uploaded.lock() = Some(Arc::new(f));
    }

    /// Starts a commit of `size` bytes for `key`: waits for room, and for an upload of the
    /// key in flight; decides the upload's condition (see the module docs). `prev` is the
    /// entry the same file committed last, `origin` the condition if nothing here is newer.
    pub async fn begin(
        &self,
        key: &str,
        size: u64,
        prev: Option<u64>,
        origin: Cond,
    ) -> FsResult<Slot> {
        // Room first (held by the slot from then on).
        loop {
            let changed = self.changed.notified();
            {
                let mut inner = self.inner.lock();
                if inner.bytes == 0 || inner.bytes + size <= self.cfg.max_bytes {
                    inner.bytes += size;
                    break;
                }
            }
            inc(&self.metrics.writeback_space_waits);
            changed.await;
        }
        loop {
            let changed = self.changed.notified();
            let decided = {
                let mut inner = self.inner.lock();
                match inner.by_key.get(key).copied() {
                    Some(s) => {
                        let e = inner.entries.get_mut(&s).expect("entry of key");
                        match e.status {
                            Status::Uploading | Status::Held => None,
                            Status::Queued | Status::Failed => {
                                e.status = Status::Held;
                                // After a conflict the user wrote the file again: this
                                // version goes over the other client's.
                                let cond = if e.conflict {
                                    Cond::Any
                                } else {
                                    e.cond.clone()
                                };
                                Some((cond, Some(s)))
                            }
                        }
                    }
                    None => {
                        let known = prev.and_then(|p| inner.results.get(&p).cloned());
                        Some((known.map(Cond::Match).unwrap_or(origin.clone()), None))
                    }
                }
            };
            let Some((cond, replaces)) = decided else {
                changed.await;
                continue;
            };
            let seq = {
                let mut inner = self.inner.lock();
                let s = inner.next_seq;
                inner.next_seq += 1;
                s
            };
            let path = entry_path(&self.cfg.dir, seq);
            let file = std::fs::OpenOptions::new()
                .create_new(true)
                .read(true)
                .write(true)
                .mode(0o600)
                .open(&path);
            let file = match file {
                Ok(f) => f,
                Err(e) => {
                    self.unhold(replaces, size);
                    return Err(wb_io(e));
                }
            };
            return Ok(Slot {
                seq,
                key: key.to_string(),
                size,
                cond,
                replaces,
                path,
                file: Arc::new(file),
                crc: crc32fast::Hasher::new(),
                written: 0,
            });
        }
    }

    /// A commit that will not finish: its file goes, its room and the entry it was to
    /// replace come back.
    pub fn abandon(&self, slot: Slot) {
        let _ = std::fs::remove_file(&slot.path);
        self.unhold(slot.replaces, slot.size);
    }

    fn unhold(&self, replaces: Option<u64>, size: u64) {
        self.inner.lock().bytes -= size;
        match replaces {
            Some(s) => self.release(s),
            None => self.changed.notify_waiters(),
        }
    }

    /// Finishes a commit whose bytes are all written: trailer, fsync, directory fsync, then
    /// the entry is queued (and the one it replaces removed). Returns its number.
    pub async fn commit(&self, mut slot: Slot, meta: &UserMeta, ino: Ino) -> FsResult<u64> {
        if slot.written != slot.size {
            self.abandon(slot);
            return Err(FsError::EIO);
        }
        let trailer = Trailer {
            key: slot.key.clone(),
            size: slot.size,
            meta: meta.clone(),
            cond: slot.cond.clone(),
            replaces: slot.replaces,
        }
        .encode();
        slot.crc.update(&trailer);
        let mut tail = trailer;
        tail.extend_from_slice(&((tail.len() as u32).to_le_bytes()));
        tail.extend_from_slice(&slot.crc.clone().finalize().to_le_bytes());
        tail.extend_from_slice(MAGIC);
        let (file, at) = (slot.file.clone(), slot.written);
        let synced = tokio::task::spawn_blocking(move || {
            file.write_all_at(&tail, at)?;
            file.sync_all()
        })
        .await
        .map_err(|_| FsError::EIO)
        .and_then(|r| r.map_err(wb_io));
        if let Err(e) = synced {
            self.abandon(slot);
            return Err(e);
        }
        if let Err(e) = self.sync_dir().await {
            self.abandon(slot);
            return Err(e);
        }
        let old = {
            let mut inner = self.inner.lock();
            let old = slot.replaces.and_then(|s| inner.entries.remove(&s));
            if let Some(o) = &old {
                inner.bytes -= o.size;
            }
            inner.by_key.insert(slot.key.clone(), slot.seq);
            inner.entries.insert(
                slot.seq,
                Entry {
                    key: slot.key.clone(),
                    size: slot.size,
                    meta: meta.clone(),
                    cond: slot.cond.clone(),
                    path: slot.path.clone(),
                    ino,
                    status: Status::Queued,
                    error: None,
                    conflict: false,
                    tries: 0,
                    next_try: None,
                    not_before: Instant::now() + self.cfg.delay,
                },
            );
            inner.ready.push_back(slot.seq);
            old
        };
        if let Some(o) = old {
            // Its replacement names it: a crash before this removal cannot bring it back.
            let _ = std::fs::remove_file(&o.path);
            inc(&self.metrics.writeback_replaced);
        }
        inc(&self.metrics.writeback_committed);
        self.update_gauges();
        self.work.notify_one();
        Ok(slot.seq)
    }

    /// fsync of the directory, one for all the commits waiting at the time.
    async fn sync_dir(&self) -> FsResult<()> {
        let ticket = self.dir_sync.ticket();
        loop {
            let notified = self.dir_sync.done.notified();
            match self.dir_sync.try_lead(ticket) {
                Lead::Done => return Ok(()),
                Lead::Wait => notified.await,
                Lead::Sync(upto) => {
                    let dir = self.dir_file.try_clone().map_err(wb_io)?;
                    let r = tokio::task::spawn_blocking(move || dir.sync_all())
                        .await
                        .map_err(|_| FsError::EIO)
                        .and_then(|r| r.map_err(wb_io));
                    self.dir_sync.finish(upto, r.is_ok());
                    r?;
                    return Ok(());
                }
            }
        }
    }

    /// Removes entry `seq` before it goes up (its file was unlinked, or renamed over), once
    /// an upload of it in flight is over.
    pub async fn cancel(&self, seq: u64) -> FsResult<Cancelled> {
        loop {
            let changed = self.changed.notified();
            let found = {
                let mut inner = self.inner.lock();
                match inner.entries.get(&seq).map(|e| e.status) {
                    Some(Status::Uploading | Status::Held) => None,
                    Some(_) => {
                        let e = inner.entries.remove(&seq).expect("present");
                        inner.bytes -= e.size;
                        if inner.by_key.get(&e.key) == Some(&seq) {
                            inner.by_key.remove(&e.key);
                        }
                        Some(Some(e))
                    }
                    None => Some(None),
                }
            };
            match found {
                None => changed.await,
                Some(None) => {
                    let known = self.inner.lock().results.contains_key(&seq);
                    return Ok(if known {
                        Cancelled::Uploaded
                    } else {
                        Cancelled::Unknown
                    });
                }
                Some(Some(e)) => {
                    let _ = std::fs::remove_file(&e.path);
                    // Durable before the unlink returns: the file must not come back.
                    self.sync_dir().await?;
                    inc(&self.metrics.writeback_cancelled);
                    self.update_gauges();
                    self.changed.notify_waiters();
                    return Ok(Cancelled::Removed(e.cond));
                }
            }
        }
    }

    /// Waits for entry `seq` to be uploaded; its error if its upload failed since.
    pub async fn wait_uploaded(&self, seq: u64) -> FsResult<()> {
        loop {
            let changed = self.changed.notified();
            {
                let inner = self.inner.lock();
                match inner.entries.get(&seq) {
                    None => return Ok(()),
                    Some(e) if e.status == Status::Failed => {
                        return Err(if e.conflict {
                            FsError::ESTALE
                        } else {
                            FsError::EIO
                        })
                    }
                    Some(_) => {}
                }
            }
            changed.await;
        }
    }

    /// Whether entry `seq` is still to be uploaded.
    pub fn is_pending(&self, seq: u64) -> bool {
        self.inner.lock().entries.contains_key(&seq)
    }

    /// Keeps entry `seq` from being uploaded (a rename is moving it), once an upload of it
    /// in flight is over. False: it is not pending any more.
    pub async fn hold(&self, seq: u64) -> bool {
        loop {
            let changed = self.changed.notified();
            {
                let mut inner = self.inner.lock();
                match inner.entries.get_mut(&seq) {
                    None => return false,
                    Some(e) if matches!(e.status, Status::Queued | Status::Failed) => {
                        e.status = Status::Held;
                        return true;
                    }
                    Some(_) => {}
                }
            }
            changed.await;
        }
    }

    /// Lets a held entry go up again (the rename failed).
    pub fn release(&self, seq: u64) {
        let mut inner = self.inner.lock();
        if let Some(e) = inner.entries.get_mut(&seq) {
            if e.status == Status::Held {
                e.status = if e.error.is_some() {
                    Status::Failed
                } else {
                    Status::Queued
                };
                if e.status == Status::Queued {
                    inner.ready.push_back(seq);
                }
            }
        }
        drop(inner);
        self.changed.notify_waiters();
        self.work.notify_one();
    }

    /// Moves held entry `seq` to `key` with condition `cond`: a new entry with a copy of its
    /// bytes, replacing it. Returns its number.
    pub async fn rekey(&self, seq: u64, key: &str, cond: Cond) -> FsResult<u64> {
        let (src, size, meta, ino) = {
            let mut inner = self.inner.lock();
            let Some(e) = inner.entries.get_mut(&seq) else {
                return Err(FsError::EIO);
            };
            let r = (e.path.clone(), e.size, e.meta.clone(), e.ino);
            inner.bytes += r.1;
            r
        };
        let seq_new = {
            let mut inner = self.inner.lock();
            let s = inner.next_seq;
            inner.next_seq += 1;
            s
        };
        let path = entry_path(&self.cfg.dir, seq_new);
        let mut slot = Slot {
            seq: seq_new,
            key: key.to_string(),
            size,
            cond,
            replaces: Some(seq),
            path: path.clone(),
            file: Arc::new(
                std::fs::OpenOptions::new()
                    .create_new(true)
                    .read(true)
                    .write(true)
                    .mode(0o600)
                    .open(&path)
                    .map_err(|e| {
                        self.unhold(Some(seq), size);
                        wb_io(e)
                    })?,
            ),
            crc: crc32fast::Hasher::new(),
            written: 0,
        };
        let src = File::open(&src).map_err(wb_io);
        let src = match src {
            Ok(f) => Arc::new(f),
            Err(e) => {
                self.abandon(slot);
                return Err(e);
            }
        };
        let mut at = 0;
        while at < size {
            let n = (size - at).min(1 << 20);
            let chunk = read_range(&src, at, n).await;
            let r = match chunk {
                Ok(c) => slot.write(c).await,
                Err(e) => Err(e),
            };
            if let Err(e) = r {
                self.abandon(slot);
                return Err(e);
            }
            at += n;
        }
        // The old key's entry goes with it.
        {
            let mut inner = self.inner.lock();
            let old_key = inner.entries.get(&seq).map(|e| e.key.clone());
            if let Some(k) = old_key {
                if inner.by_key.get(&k) == Some(&seq) {
                    inner.by_key.remove(&k);
                }
            }
        }
        self.commit(slot, &meta, ino).await
    }

    /// Waits until nothing is queued or uploading (failed entries are left), calling
    /// `progress` every `every` with the files and bytes left.
    pub async fn drain(&self, every: Duration, mut progress: impl FnMut(usize, u64)) {
        // Failed entries are tried once more now, and delayed ones wait no longer.
        self.retry_failed_now();
        {
            let now = Instant::now();
            for e in self.inner.lock().entries.values_mut() {
                e.not_before = e.not_before.min(now);
            }
        }
        self.work.notify_waiters();
        loop {
            let changed = self.changed.notified();
            let (active, files, bytes) = {
                let inner = self.inner.lock();
                let active = inner
                    .entries
                    .values()
                    .filter(|e| e.status != Status::Failed)
                    .count();
                (active, inner.entries.len(), inner.bytes)
            };
            if active == 0 {
                return;
            }
            if tokio::time::timeout(every, changed).await.is_err() {
                progress(files, bytes);
            }
        }
    }

    fn retry_failed_now(&self) {
        let mut inner = self.inner.lock();
        let failed: Vec<u64> = inner
            .entries
            .iter()
            .filter(|(_, e)| e.status == Status::Failed && !e.conflict)
            .map(|(s, _)| *s)
            .collect();
        for s in failed {
            if let Some(e) = inner.entries.get_mut(&s) {
                e.status = Status::Queued;
                e.next_try = None;
            }
            inner.ready.push_back(s);
        }
        drop(inner);
        self.work.notify_waiters();
    }

    /// Files not uploaded yet and bytes, and how many of them failed.
    pub fn counts(&self) -> (usize, u64, usize) {
        let inner = self.inner.lock();
        let failed = inner
            .entries
            .values()
            .filter(|e| e.status == Status::Failed)
            .count();
        (inner.entries.len(), inner.bytes, failed)
    }

    /// Every file not uploaded yet.
    pub fn pending(&self) -> Vec<PendingFile> {
        self.inner
            .lock()
            .entries
            .values()
            .map(|e| PendingFile {
                key: e.key.clone(),
                size: e.size,
                state: match (e.status, e.conflict) {
                    (Status::Failed, true) => "conflict",
                    (Status::Failed, false) => "failed",
                    (Status::Uploading, _) => "uploading",
                    _ => "queued",
                },
                error: e.error.clone(),
                path: e.path.clone(),
            })
            .collect()
    }

    fn update_gauges(&self) {
        let (files, bytes, failed) = self.counts();
        self.metrics
            .writeback_pending
            .store(files as u64, Ordering::Relaxed);
        self.metrics
            .writeback_pending_bytes
            .store(bytes, Ordering::Relaxed);
        self.metrics
            .writeback_failed
            .store(failed as u64, Ordering::Relaxed);
    }

    /// The next entry to upload, marked uploading; else how long until the first one is due.
    fn take(&self) -> Result<Job, Option<Duration>> {
        let mut inner = self.inner.lock();
        let now = Instant::now();
        while let Some(s) = inner.ready.pop_front() {
            let Some(e) = inner.entries.get_mut(&s) else {
                continue;
            };
            if e.status != Status::Queued {
                continue;
            }
            if e.not_before > now {
                // Entries are queued in order of their times: none behind it is due either.
                let wait = e.not_before - now;
                inner.ready.push_front(s);
                return Err(Some(wait));
            }
            e.status = Status::Uploading;
            let r = Job {
                seq: s,
                key: e.key.clone(),
                size: e.size,
                meta: e.meta.clone(),
                cond: e.cond.clone(),
                path: e.path.clone(),
                ino: e.ino,
            };
            inner.running += 1;
            return Ok(r);
        }
        Err(None)
    }

    /// Uploads the next entry due; else how long until one is (`None`: nothing queued).
    async fn upload_one(&self) -> Result<(), Option<Duration>> {
        let Job {
            seq,
            key,
            size,
            meta,
            cond,
            path,
            ino,
        } = self.take()?;
        let r = self.upload(&key, size, &meta, &cond, &path).await;
        match r {
            Ok(etag) => {
                // The entry goes for good before anything learns of the upload: were it to
                // come back after a crash, its upload would be done again over whatever
                // happened to the file since (a delete, say). Until then it counts as
                // uploading (an unlink or rename waits).
                let _ = std::fs::remove_file(&path);
                if let Err(e) = self.sync_dir().await {
                    tracing::warn!("write-back directory: {e:?} after uploading {key}");
                }
                {
                    let mut inner = self.inner.lock();
                    inner.running -= 1;
                    if let Some(e) = inner.entries.remove(&seq) {
                        inner.bytes -= e.size;
                    }
                    if inner.by_key.get(&key) == Some(&seq) {
                        inner.by_key.remove(&key);
                    }
                    inner.results.insert(seq, etag.clone());
                    inner.results_order.push_back(seq);
                    while inner.results_order.len() > RESULTS_KEPT {
                        if let Some(old) = inner.results_order.pop_front() {
                            inner.results.remove(&old);
                        }
                    }
                }
                let cb = self.on_uploaded.lock().clone();
                if let Some(cb) = cb {
                    cb(Uploaded {
                        ino,
                        seq,
                        key: key.clone(),
                        etag,
                    });
                }
                inc(&self.metrics.writeback_uploaded);
            }
            Err((e, conflict)) => {
                let mut inner = self.inner.lock();
                inner.running -= 1;
                if let Some(en) = inner.entries.get_mut(&seq) {
                    let first = en.error.is_none();
                    en.tries += 1;
                    en.status = Status::Failed;
                    en.conflict = conflict;
                    en.error = Some(e.clone());
                    let wait = RETRY_FIRST
                        .saturating_mul(1 << en.tries.min(6).saturating_sub(1))
                        .min(RETRY_MAX);
                    en.next_try = (!conflict).then(|| Instant::now() + wait);
                    if first {
                        if conflict {
                            tracing::error!(
                                "{key}: changed by another client before this mount uploaded \
                                 it; this version is kept in {} (see `bucketfs pending`): \
                                 write the file again to store it over the other, or remove it",
                                path.display()
                            );
                        } else {
                            tracing::error!(
                                "{key}: background upload failed ({e}); kept in {}, retried \
                                 every few minutes (see `bucketfs pending`)",
                                path.display()
                            );
                        }
                    }
                }
                drop(inner);
                inc(&self.metrics.writeback_upload_errors);
            }
        }
        self.update_gauges();
        self.changed.notify_waiters();
        Ok(())
    }

    /// One upload of an entry; its ETag, or the error and whether it is a conflict.
    async fn upload(
        &self,
        key: &str,
        size: u64,
        meta: &UserMeta,
        cond: &Cond,
        path: &Path,
    ) -> Result<String, (String, bool)> {
        let file = File::open(path)
            .map(Arc::new)
            .map_err(|e| (format!("{}: {e}", path.display()), false))?;
        let pin = cond.if_match();
        let (r, ours) = if size <= self.part_size {
            let body = read_range(&file, 0, size)
                .await
                .map_err(|e| (e.to_string(), false))?;
            let ours = format!("\"{}\"", hex::encode(Md5::digest(&body)));
            (self.store.put_if(key, body, meta, pin).await, ours)
        } else {
            self.upload_multipart(key, size, meta, pin, &file).await
        };
        match r {
            Ok(etag) => Ok(etag),
            Err(e @ (StoreError::PreconditionFailed(_) | StoreError::NotFound(_))) => {
                // Ours already (an upload whose answer or removal a crash lost)?
                if let Ok(o) = self.store.head(key).await {
                    if o.etag.as_deref() == Some(ours.as_str()) && o.size == size {
                        return Ok(ours);
                    }
                }
                if matches!(e, StoreError::NotFound(_)) && *cond == Cond::Absent {
                    return Err((e.to_string(), false));
                }
                inc(&self.metrics.writeback_conflicts);
                Err((
                    format!("changed by another client since this mount knew it ({e})"),
                    true,
                ))
            }
            Err(e) => Err((e.to_string(), false)),
        }
    }

    /// A multipart upload from the entry file; the result and the ETag it would have.
    async fn upload_multipart(
        &self,
        key: &str,
        size: u64,
        meta: &UserMeta,
        pin: Option<&str>,
        file: &Arc<File>,
    ) -> (Result<String, StoreError>, String) {
        let mut md5s = Vec::new();
        let mut upload = match self.uploads.create(key, meta).await {
            Ok(u) => u,
            Err(e) => return (Err(e), String::new()),
        };
        let mut parts = Vec::new();
        let mut at = 0;
        let mut n = 1u32;
        while at < size {
            let len = (size - at).min(self.part_size);
            let body = match read_range(file, at, len).await {
                Ok(b) => b,
                Err(e) => {
                    let _ = upload.abort().await;
                    return (Err(StoreError::Other(e.to_string())), String::new());
                }
            };
            md5s.extend_from_slice(&Md5::digest(&body));
            match upload.part(n, body).await {
                Ok(etag) => parts.push(CompletedPart {
                    part_number: n,
                    etag,
                }),
                Err(e) => {
                    let _ = upload.abort().await;
                    return (Err(e), String::new());
                }
            }
            at += len;
            n += 1;
        }
        let ours = format!("\"{}-{}\"", hex::encode(Md5::digest(&md5s)), n - 1);
        let r = upload.complete(&parts, pin).await;
        if r.is_err() {
            let _ = upload.abort().await;
        }
        (r, ours)
    }
}

async fn worker(wb: std::sync::Weak<WriteBack>) {
    loop {
        let Some(w) = wb.upgrade() else { return };
        {
            let notified = w.work.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let wait = match w.upload_one().await {
                Ok(()) => continue,
                Err(due) => due.unwrap_or(Duration::MAX).min(Duration::from_secs(1)),
            };
            // Woken by a commit; the timeout lets the worker notice its WriteBack is gone.
            let _ = tokio::time::timeout(wait, notified).await;
        }
        drop(w);
    }
}

/// Queues failed uploads again when their time comes.
async fn retry_loop(wb: std::sync::Weak<WriteBack>) {
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let Some(w) = wb.upgrade() else { return };
        let now = Instant::now();
        let mut inner = w.inner.lock();
        let due: Vec<u64> = inner
            .entries
            .iter()
            .filter(|(_, e)| e.status == Status::Failed && e.next_try.is_some_and(|t| t <= now))
            .map(|(s, _)| *s)
            .collect();
        for s in &due {
            if let Some(e) = inner.entries.get_mut(s) {
                e.status = Status::Queued;
                e.next_try = None;
            }
            inner.ready.push_back(*s);
        }
        drop(inner);
        if !due.is_empty() {
            w.work.notify_waiters();
        }
    }
}

async fn read_range(file: &Arc<File>, at: u64, len: u64) -> FsResult<Bytes> {
    let file = file.clone();
    tokio::task::spawn_blocking(move || {
        let mut buf = vec![0u8; len as usize];
        file.read_exact_at(&mut buf, at).map(|_| Bytes::from(buf))
    })
    .await
    .map_err(|_| FsError::EIO)?
    .map_err(wb_io)
}

fn entry_path(dir: &Path, seq: u64) -> PathBuf {
    dir.join(format!("{seq:020}.wb"))
}

/// Sequence numbers start above the clock (in µs), so a new daemon never reuses the number
/// of an entry whose file a crash left half-removed.
fn now_seq() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// The trailer of an entry file.
#[derive(Debug, Clone, PartialEq)]
struct Trailer {
    key: String,
    size: u64,
    meta: UserMeta,
    cond: Cond,
    replaces: Option<u64>,
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u32).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Option<&[u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
    fn str(&mut self) -> Option<String> {
        let n = self.u32()? as usize;
        String::from_utf8(self.take(n)?.to_vec()).ok()
    }
}

impl Trailer {
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        put_str(&mut out, &self.key);
        out.extend_from_slice(&self.size.to_le_bytes());
        out.extend_from_slice(&(self.meta.len() as u32).to_le_bytes());
        for (k, v) in &self.meta {
            put_str(&mut out, k);
            put_str(&mut out, v);
        }
        match &self.cond {
            Cond::Absent => out.push(0),
            Cond::Match(e) => {
                out.push(1);
                put_str(&mut out, e);
            }
            Cond::Any => out.push(2),
        }
        out.extend_from_slice(&self.replaces.unwrap_or(0).to_le_bytes());
        out
    }

    fn decode(b: &[u8]) -> Option<Trailer> {
        let mut r = Reader(b);
        let key = r.str()?;
        let size = r.u64()?;
        let n = r.u32()?;
        let mut meta = UserMeta::new();
        for _ in 0..n {
            let k = r.str()?;
            let v = r.str()?;
            meta.insert(k, v);
        }
        let cond = match r.take(1)?[0] {
            0 => Cond::Absent,
            1 => Cond::Match(r.str()?),
            2 => Cond::Any,
            _ => return None,
        };
        let replaces = Some(r.u64()?).filter(|s| *s != 0);
        r.0.is_empty().then_some(Trailer {
            key,
            size,
            meta,
            cond,
            replaces,
        })
    }
}

/// The sound entries of `dir` by number; removes the others (commits that never returned)
/// and stray files.
fn recover(dir: &Path) -> std::io::Result<BTreeMap<u64, Trailer>> {
    let mut out = BTreeMap::new();
    for d in std::fs::read_dir(dir)? {
        let d = d?;
        let name = d.file_name();
        let name = name.to_string_lossy();
        if name == "lock" {
            continue;
        }
        let seq = name.strip_suffix(".wb").and_then(|s| s.parse::<u64>().ok());
        match seq.and_then(|s| read_entry(&d.path()).map(|t| (s, t))) {
            Some((s, t)) => {
                out.insert(s, t);
            }
            None => {
                tracing::warn!(
                    "write-back directory: removing {} (a commit that never finished)",
                    d.path().display()
                );
                std::fs::remove_file(d.path())?;
            }
        }
    }
    if !out.is_empty() {
        File::open(dir)?.sync_all()?;
    }
    Ok(out)
}

fn read_entry(path: &Path) -> Option<Trailer> {
    let data = std::fs::read(path).ok()?;
    if data.len() < FOOTER {
        return None;
    }
    let (body, footer) = data.split_at(data.len() - FOOTER);
    if &footer[8..] != MAGIC {
        return None;
    }
    let tlen = u32::from_le_bytes(footer[..4].try_into().ok()?) as usize;
    let crc = u32::from_le_bytes(footer[4..8].try_into().ok()?);
    if tlen > body.len() || crc32fast::hash(body) != crc {
        return None;
    }
    let t = Trailer::decode(&body[body.len() - tlen..])?;
    (t.size == (body.len() - tlen) as u64).then_some(t)
}

/// Shared directory fsyncs: a commit waits for a sync that started after its entry file was
/// complete, and one sync serves every commit waiting when it starts.
#[derive(Default)]
struct DirSync {
    state: Mutex<DirSyncState>,
    done: Notify,
}

#[derive(Default)]
struct DirSyncState {
    /// Tickets handed out.
    issued: u64,
    /// Every ticket up to this is synced.
    synced: u64,
    running: bool,
}

enum Lead {
    Done,
    Wait,
    /// Sync, then every ticket up to this one is done.
    Sync(u64),
}

impl DirSync {
    fn ticket(&self) -> u64 {
        let mut s = self.state.lock();
        s.issued += 1;
        s.issued
    }

    fn try_lead(&self, ticket: u64) -> Lead {
        let mut s = self.state.lock();
        if s.synced >= ticket {
            Lead::Done
        } else if s.running {
            Lead::Wait
        } else {
            s.running = true;
            Lead::Sync(s.issued)
        }
    }

    fn finish(&self, upto: u64, ok: bool) {
        let mut s = self.state.lock();
        s.running = false;
        if ok {
            s.synced = s.synced.max(upto);
        }
        drop(s);
        self.done.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trailer_round_trips() {
        let mut meta = UserMeta::new();
        meta.insert("mode".into(), "33188".into());
        for cond in [Cond::Absent, Cond::Match("\"abc\"".into()), Cond::Any] {
            let t = Trailer {
                key: "a/b\nc".into(),
                size: 42,
                meta: meta.clone(),
                cond,
                replaces: Some(7),
            };
            assert_eq!(Trailer::decode(&t.encode()), Some(t));
        }
    }
}
