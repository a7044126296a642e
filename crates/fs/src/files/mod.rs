//! What an open file's bytes are: the one place that answers it.
//!
//! [`OpenFiles`] owns the open-file registry: each handle (its flags and its [`read::Reader`],
//! which has its own prefetch window and uses the budget's block cache) and, per inode open
//! for writing, the one [`write::WriteState`] its writers share (dirty extents over the
//! object it was opened on, the staging file, the streaming upload). It knows nothing of
//! paths or the inode table: the caller says which key a state writes, and tells the
//! namespace what a publish stored.
//!
//! It also decides which read-only opens the kernel serves itself from the data cache's whole
//! copy of the file (FUSE passthrough, [`OpenFiles::choose_through`]): the kernel requires
//! every open of an inode that is open for passthrough to share its backing file, so opens
//! of an inode go either all through one copy of one version, or none.
//!
//! Lock order: the namespace's inode table may be held while this registry's locks are taken,
//! never the reverse; a write state's own lock is taken with neither held.

pub mod cache;
pub mod extents;
pub mod read;
pub mod write;
pub mod writeback;

use crate::budget::MemoryBudget;
use crate::config::FsConfig;
use crate::error::{FsError, FsResult};
use crate::meta::Ino;
use crate::metrics::FsMetrics;
use crate::paths::ObjectKey;
use bucketfs_store::{ObjectStore, Uploads, UserMeta};
use bytes::Bytes;
use parking_lot::Mutex;
use read::{ReadConfig, Reader};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use write::{Appended, Base, PartLayout, WriteConfig, WriteState};
use writeback::WriteBack;

/// A file open for writing: its shared write state and its size (readable without the lock).
pub struct OpenWrite {
    pub state: tokio::sync::Mutex<WriteState>,
    pub size: Arc<AtomicU64>,
    /// An fsync of it came since another file's fsync last took its changes along (see
    /// [`OpenFiles::fsynced_writes`]).
    pub fsynced: AtomicBool,
}

/// One open descriptor of a file.
#[derive(Clone)]
pub struct FileHandle {
    pub ino: Ino,
    /// The open(2) flags.
    pub flags: i32,
    pub reader: Arc<tokio::sync::Mutex<Option<Reader>>>,
    /// The inode's `learned_changes` at the open, or when this descriptor, having read
    /// nothing, took up the version learnt since: another client's version learnt after it
    /// is read only by a descriptor the kernel cannot have handed pages of the one before.
    pub learned_changes: Arc<AtomicU64>,
    /// The inode's `page_drops` after the open: while it stays, the inode's `pages` say
    /// every page the kernel may have handed this descriptor.
    pub page_drops: u64,
    /// The inode's write state, when opened for writing.
    pub write: Option<Arc<OpenWrite>>,
    /// Handed to the kernel with a local copy (passthrough): its reads never come here.
    pub through: bool,
    /// The kernel reads it through the daemon, not the inode's page cache (see
    /// [`OpenFiles::reads_older_pages`]).
    pub uncached: bool,
    /// This descriptor changed the file (wrote, truncated or created it) since a publish
    /// through it last stored the file. Set and cleared under the write state's lock.
    pub changed: Arc<AtomicBool>,
}

impl FileHandle {
    /// Where a write at `offset` lands in a file of `size` bytes: at the end with `append`.
    pub fn write_offset(offset: u64, size: u64, append: bool) -> u64 {
        if append {
            size
        } else {
            offset
        }
    }

    /// See [`Self::learned_changes`].
    pub fn learned(&self) -> u64 {
        self.learned_changes.load(Ordering::Relaxed)
    }

    /// This descriptor, having read nothing, reads the version the inode knows as of its
    /// `learned_changes` being `learned`: this mount's own changes after it are no other
    /// client's to it.
    pub fn took_up(&self, learned: u64) {
        self.learned_changes.store(learned, Ordering::Relaxed);
    }

    /// A change of the file through this descriptor (see [`Self::changed`]).
    pub fn changes(&self) {
        self.changed.store(true, Ordering::Relaxed);
    }

    /// Whether the handle was opened with `O_APPEND`.
    pub fn appends(&self) -> bool {
        self.flags & libc::O_APPEND != 0
    }
}

/// An inode open for passthrough: the version and the local copy its handles share.
struct Through {
    etag: String,
    file: Arc<std::fs::File>,
    /// The copy as its first open found it checked (see [`OpenFiles::sound_shared_copy`]).
    seal: CopySeal,
    handles: u64,
    /// Found changed since: said once.
    damaged: bool,
}

/// What tells a local copy changed since it was checked: a write, a truncation or a
/// replacement of the file changes its size, inode or ctime.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct CopySeal {
    len: u64,
    ino: u64,
    ctime: (i64, i64),
    mtime: (i64, i64),
    links: u64,
}

impl CopySeal {
    pub fn of(md: &std::fs::Metadata) -> Self {
        use std::os::unix::fs::MetadataExt;
        CopySeal {
            len: md.len(),
            ino: md.ino(),
            ctime: (md.ctime(), md.ctime_nsec()),
            mtime: (md.mtime(), md.mtime_nsec()),
            links: md.nlink(),
        }
    }

    /// Whether the copy sealed `self` still holds the bytes it held, as `now` finds it. Its
    /// eviction from the cache (an unlink: the last link gone) changes its ctime, not its
    /// bytes: then its size and mtime say.
    fn holds(&self, now: &CopySeal) -> bool {
        (self.len, self.ino) == (now.len, now.ino)
            && (self.ctime == now.ctime || (now.links == 0 && self.mtime == now.mtime))
    }
}

/// A checked local copy an open may hand the kernel: its version, the file and its seal.
pub type LocalCopy = (String, std::fs::File, CopySeal);

/// An open that must wait: the inode is open for passthrough and this open cannot share it.
#[derive(Debug)]
pub struct Busy;

/// The write state an inode's writers share, and how many of them are open.
struct Writing {
    write: Arc<OpenWrite>,
    writers: u64,
}

pub struct OpenFiles {
    store: Arc<dyn ObjectStore>,
    wcfg: Arc<WriteConfig>,
    rcfg: Arc<ReadConfig>,
    cache_dir: PathBuf,
    handles: Mutex<HashMap<u64, FileHandle>>,
    writes: Mutex<HashMap<Ino, Writing>>,
    through: Mutex<HashMap<Ino, Through>>,
    /// The kernel takes local copies (see [`OpenFiles::enable_passthrough`]).
    passthrough: AtomicBool,
    next_fh: AtomicU64,
}

impl OpenFiles {
    /// The registry, and in background mode the write-back directory opened (with the number
    /// of entries a previous daemon left, queued again).
    pub fn new(
        store: Arc<dyn ObjectStore>,
        cfg: &FsConfig,
        metrics: Arc<FsMetrics>,
    ) -> Result<(Self, usize), String> {
        let budget = MemoryBudget::new(cfg.max_memory, metrics.clone());
        let limits = store.limits();
        let part_size = cfg.part_size.max(limits.min_part);
        let rcfg = Arc::new(ReadConfig {
            part_size,
            // A quarter of the budget at most: one reader never holds the memory the
            // others and the writers need.
            max_window: cfg.max_prefetch.min(budget.total() / 4),
            budget: budget.clone(),
            data_cache: cfg.data_cache.as_ref().map(|c| {
                cache::DataCache::start(c, cache::queue_len(cfg.max_memory), metrics.clone())
            }),
            metrics: metrics.clone(),
        });
        let uploads = Uploads::new(store.clone());
        let (writeback, recovered) = match &cfg.writeback {
            Some(w) => {
                let (wb, n) = WriteBack::open(
                    w.clone(),
                    store.clone(),
                    uploads.clone(),
                    part_size,
                    Some(budget.clone()),
                    metrics.clone(),
                )?;
                (Some(wb), n)
            }
            None => (None, 0),
        };
        let wcfg = Arc::new(WriteConfig {
            layout: PartLayout { part_size },
            upload_concurrency: cfg.upload_concurrency.max(1),
            uploads,
            limits,
            metrics,
            budget,
            writeback,
            cache_min_free: cfg.cache_min_free,
        });
        let files = Self {
            store,
            wcfg,
            rcfg,
            cache_dir: cfg.cache_dir.clone(),
            handles: Mutex::new(HashMap::new()),
            writes: Mutex::new(HashMap::new()),
            through: Mutex::new(HashMap::new()),
            passthrough: AtomicBool::new(false),
            next_fh: AtomicU64::new(1),
        };
        Ok((files, recovered))
    }

    /// The data cache (`--data-cache`), if any.
    pub fn data_cache(&self) -> Option<&Arc<cache::DataCache>> {
        self.rcfg.data_cache.as_ref()
    }

    /// The write-back directory, in background mode.
    pub fn writeback(&self) -> Option<&Arc<WriteBack>> {
        self.wcfg.writeback.as_ref()
    }

    /// The kernel can read local files for us (FUSE passthrough): with a data cache, whole
    /// copies are assembled and offered to read-only opens. Off again (`false`) when the
    /// kernel refused one.
    pub fn enable_passthrough(&self, on: bool) -> bool {
        let Some(c) = &self.rcfg.data_cache else {
            return false;
        };
        c.set_whole_files(on);
        self.passthrough.store(on, Ordering::Relaxed);
        true
    }

    pub fn passthrough_on(&self) -> bool {
        self.passthrough.load(Ordering::Relaxed)
    }

    /// The data cache's checked whole copy of `key` version `etag` (`size` bytes), if any,
    /// with its seal.
    pub async fn local_copy(
        &self,
        key: ObjectKey,
        etag: String,
        size: u64,
    ) -> Option<(std::fs::File, CopySeal)> {
        let cache = self.rcfg.data_cache.clone()?;
        cache
            // After a reboot, the first open reads the whole copy to check it.
            .read_disk(size, move |cache| {
                let f = cache.local_copy(&key, &etag, size)?;
                let seal = CopySeal::of(&f.metadata().ok()?);
                Some((f, seal))
            })
            .await
            .flatten()
    }

    /// The local copy `ino`'s passthrough handles share, for another open to share too, if
    /// it is still as its first open checked it (nothing wrote, truncated or replaced it
    /// since) and its disk still opens it: the kernel opens it anew for each descriptor, and
    /// reads it with no check of ours. `None` otherwise (said once per copy, and counted):
    /// the open then waits for those handles to close, as one that cannot share does, and
    /// the next open checks the cache's copy in full.
    pub async fn sound_shared_copy(&self, ino: Ino) -> Option<Arc<std::fs::File>> {
        use std::os::fd::AsRawFd;
        let (file, seal) = {
            let th = self.through.lock();
            let t = th.get(&ino).filter(|t| !t.damaged)?;
            (t.file.clone(), t.seal)
        };
        let cache = self.rcfg.data_cache.clone()?;
        let f = file.clone();
        let now = cache
            .read_disk(0, move |_| {
                let again = std::fs::File::open(format!("/proc/self/fd/{}", f.as_raw_fd()))?;
                again.metadata().map(|md| CopySeal::of(&md))
            })
            .await;
        if matches!(&now, Some(Ok(n)) if seal.holds(n)) {
            return Some(file);
        }
        let mut th = self.through.lock();
        if let Some(t) = th.get_mut(&ino).filter(|t| Arc::ptr_eq(&t.file, &file)) {
            if !std::mem::replace(&mut t.damaged, true) {
                drop(th);
                self.wcfg
                    .metrics
                    .data_cache_corrupt
                    .fetch_add(1, Ordering::Relaxed);
                let why = match now {
                    Some(Ok(_)) => "changed since it was checked".to_string(),
                    Some(Err(e)) => format!("cannot be opened again ({e})"),
                    None => "on a disk too slow to answer".to_string(),
                };
                tracing::warn!(
                    "data cache: the local copy that inode {ino}'s open descriptors read \
                     (passthrough) {why}: other opens wait for them to close"
                );
            }
        }
        None
    }

    /// How a new open of `ino` (version `etag`, `others` handles open already) is served:
    /// `Some(file)` through that local copy, `None` by the daemon. `shareable`: a read-only
    /// open that may share the inode's copy, if it is `checked` (see
    /// [`Self::sound_shared_copy`]); `local`: the copy found for it, if it may start one.
    /// `Busy` while the inode is open for passthrough and this open cannot share it (the
    /// kernel would refuse it).
    pub fn choose_through(
        &self,
        ino: Ino,
        etag: Option<&str>,
        others: u64,
        (shareable, checked): (bool, Option<&Arc<std::fs::File>>),
        local: &mut Option<LocalCopy>,
    ) -> Result<Option<Arc<std::fs::File>>, Busy> {
        let mut th = self.through.lock();
        if let Some(t) = th.get_mut(&ino) {
            let sound = checked.is_some_and(|c| Arc::ptr_eq(c, &t.file));
            if shareable && sound && Some(t.etag.as_str()) == etag {
                t.handles += 1;
                return Ok(Some(t.file.clone()));
            }
            return Err(Busy);
        }
        match local.take() {
            // Not while the inode is being written here (a writer's close, a truncate): its
            // copy was found before, and is of the version they replace.
            Some((e, f, seal)) if shareable && others == 0 && Some(e.as_str()) == etag => {
                let file = Arc::new(f);
                th.insert(
                    ino,
                    Through {
                        etag: e,
                        file: file.clone(),
                        seal,
                        handles: 1,
                        damaged: false,
                    },
                );
                Ok(Some(file))
            }
            _ => Ok(None),
        }
    }

    /// This mount's own copy gave version `old` of `ino` the ETag `new` (a rename, a chmod):
    /// the same bytes, so opens of `new` share the local copy its passthrough handles hold
    /// (they would wait and get `ETXTBSY` otherwise).
    pub fn retag_through(&self, ino: Ino, old: &str, new: &str) {
        if let Some(t) = self.through.lock().get_mut(&ino) {
            if t.etag == old {
                t.etag = new.to_string();
            }
        }
    }

    /// Whether `ino` is open for passthrough.
    pub fn is_through(&self, ino: Ino) -> bool {
        self.through.lock().contains_key(&ino)
    }

    /// A passthrough handle of `ino` closed (or the kernel refused it).
    pub fn drop_through(&self, ino: Ino) {
        let mut th = self.through.lock();
        let last = th.get_mut(&ino).is_some_and(|t| {
            t.handles = t.handles.saturating_sub(1);
            t.handles == 0
        });
        let gone = last.then(|| th.remove(&ino));
        drop(th);
        // The copy is closed here, not under the lock every open takes.
        drop(gone);
    }

    /// Handle `fh` is served by the daemon after all.
    pub fn not_through(&self, fh: u64) -> Option<Ino> {
        let mut h = self.handles.lock();
        let h = h.get_mut(&fh).filter(|h| h.through)?;
        h.through = false;
        let ino = h.ino;
        self.drop_through(ino);
        Some(ino)
    }

    pub fn metrics(&self) -> &Arc<FsMetrics> {
        &self.wcfg.metrics
    }

    /// The multipart uploads of this mount, and those whose abort failed.
    pub fn uploads(&self) -> &Arc<Uploads> {
        &self.wcfg.uploads
    }

    /// Requests in flight at once for one upload (and for the parts of one large copy).
    pub fn upload_concurrency(&self) -> usize {
        self.wcfg.upload_concurrency
    }

    /// A write state of the object at `key` as `base` says it is (None: a new or empty
    /// file), whose publish stores `user` metadata. Not registered: see [`Self::add_writer`].
    pub fn new_write(&self, key: ObjectKey, base: Option<Base>, user: UserMeta) -> Arc<OpenWrite> {
        let size = Arc::new(AtomicU64::new(0));
        let st = WriteState::new(
            self.store.clone(),
            self.wcfg.clone(),
            key,
            base,
            user,
            &self.cache_dir,
            size.clone(),
        );
        Arc::new(OpenWrite {
            state: tokio::sync::Mutex::new(st),
            size,
            fsynced: AtomicBool::new(false),
        })
    }

    /// A reader of the object at `key`, pinned to `etag`, of `size` bytes.
    pub fn new_reader(
        &self,
        key: ObjectKey,
        etag: Option<String>,
        size: u64,
        direct: bool,
    ) -> Reader {
        Reader::new(
            self.store.clone(),
            self.rcfg.clone(),
            key,
            etag,
            size,
            direct,
        )
    }

    /// One more writer of `ino`: its registered write state, or the one `make` gives.
    pub fn add_writer(&self, ino: Ino, make: impl FnOnce() -> Arc<OpenWrite>) -> Arc<OpenWrite> {
        let mut w = self.writes.lock();
        let e = w.entry(ino).or_insert_with(|| Writing {
            write: make(),
            writers: 0,
        });
        e.writers += 1;
        e.write.clone()
    }

    /// How many writers have `ino`'s write state.
    pub fn writers(&self, ino: Ino) -> u64 {
        self.writes.lock().get(&ino).map_or(0, |e| e.writers)
    }

    /// One writer of `ino` closed; returns how many are left.
    pub fn drop_writer(&self, ino: Ino) -> u64 {
        let mut w = self.writes.lock();
        w.get_mut(&ino).map_or(0, |e| {
            e.writers = e.writers.saturating_sub(1);
            e.writers
        })
    }

    /// Whether `write` is `ino`'s registered write state and no writer has it open.
    pub fn is_sole(&self, ino: Ino, write: &Arc<OpenWrite>) -> bool {
        let w = self.writes.lock();
        w.get(&ino)
            .is_some_and(|e| e.writers == 0 && Arc::ptr_eq(&e.write, write))
    }

    /// Unregisters `ino`'s write state, whatever it is.
    pub fn forget_write(&self, ino: Ino) {
        self.writes.lock().remove(&ino);
    }

    /// The write state of `ino`, if a writer has it open (or its readers still need it).
    pub fn write_of(&self, ino: Ino) -> Option<Arc<OpenWrite>> {
        self.writes.lock().get(&ino).map(|e| e.write.clone())
    }

    /// The size of `ino` as its write state has it now, if it is being written.
    pub fn live_size(&self, ino: Ino) -> Option<u64> {
        let w = self.writes.lock();
        w.get(&ino).map(|e| e.write.size.load(Ordering::Relaxed))
    }

    /// The write states of files other than `except` fsync'd since their changes were last
    /// taken along by another file's fsync (group commit: see `Fs::commit_along`).
    pub fn fsynced_writes(&self, except: Ino) -> Vec<(Ino, Arc<OpenWrite>)> {
        self.writes
            .lock()
            .iter()
            .filter(|(ino, e)| **ino != except && e.write.fsynced.load(Ordering::Relaxed))
            .map(|(ino, e)| (*ino, e.write.clone()))
            .collect()
    }

    /// An fsync of handle `h` came (see [`OpenWrite::fsynced`]).
    pub fn note_fsync(&self, h: &FileHandle) {
        if let Some(w) = &h.write {
            w.fsynced.store(true, Ordering::Relaxed);
        }
    }

    /// Every registered write state.
    pub fn all_writes(&self) -> Vec<Arc<OpenWrite>> {
        self.writes
            .lock()
            .values()
            .map(|e| e.write.clone())
            .collect()
    }

    /// Registers an open descriptor; returns its handle number.
    pub fn add_handle(&self, h: FileHandle) -> u64 {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        self.handles.lock().insert(fh, h);
        fh
    }

    /// Whether a descriptor of `ino` may be handed the kernel's cached pages while it reads a
    /// version older than the inode's (another client's change learnt since its open: its
    /// `learned_changes` is not `learned`). A new open's pages would then go on with the new
    /// version where it left the old: the open is made uncached while such a descriptor stays
    /// open, so its next read reaches the daemon (`ESTALE`). Not a descriptor the kernel
    /// reads through the daemon or a local copy, nor a writer's (its reads come from the
    /// write state, which the daemon checks the same way) or a write-only one's.
    pub fn reads_older_pages(&self, ino: Ino, learned: u64) -> bool {
        self.handles.lock().values().any(|h| {
            h.ino == ino
                && h.learned() != learned
                && !h.through
                && !h.uncached
                && h.write.is_none()
                && h.flags & libc::O_DIRECT == 0
                && h.flags & libc::O_ACCMODE != libc::O_WRONLY
        })
    }

    /// The open file `fh`, which must be a handle of `ino`.
    pub fn handle(&self, ino: Ino, fh: u64) -> FsResult<FileHandle> {
        match self.handles.lock().get(&fh) {
            Some(h) if h.ino == ino => Ok(h.clone()),
            _ => Err(FsError::EBADF),
        }
    }

    pub fn remove_handle(&self, fh: u64) -> Option<FileHandle> {
        self.handles.lock().remove(&fh)
    }

    /// A copy of a write request's bytes out of the kernel's buffer, for a write the calling
    /// (FUSE) thread cannot finish itself, in memory of the budget's request area. When all
    /// of it is taken by copies still on their way to storage, this thread waits for one to
    /// be stored (a copy is freed when its bytes reach the tail or the staging file, with no
    /// network wait), at most [`crate::budget::DEMAND_WAIT`] before it takes the overdraft;
    /// so copies stay within a stated bound however many processes write at once.
    pub fn copy_write(&self, data: &[u8]) -> Bytes {
        match self.wcfg.budget.request_buffer_blocking(data.len() as u64) {
            Some(mut buf) => {
                buf.as_mut_slice().copy_from_slice(data);
                buf.freeze(data.len())
            }
            // Called on a runtime thread (tests), which must not block.
            None => Bytes::copy_from_slice(data),
        }
    }

    /// An append the calling thread finishes itself, straight from the kernel's buffer (see
    /// [`WriteState::append_now`]). `Appended::No`: nothing was done (not such an append, or
    /// the state is busy: an upload being started, a publish).
    pub fn append_now(&self, h: &FileHandle, offset: u64, data: &[u8], append: bool) -> Appended {
        let Some(w) = &h.write else {
            return Appended::No;
        };
        let Ok(mut st) = w.state.try_lock() else {
            return Appended::No;
        };
        h.changes();
        let at = FileHandle::write_offset(offset, st.size(), append);
        st.append_now(at, data)
    }

    /// Whether a close of writer `h` leaves the file to the other writers' closes: it changed
    /// nothing, and another writer has the file open (a program that opens `O_RDWR` to read
    /// would store another process's half-written file as a version). The last writer's
    /// close stores what is left either way. Not after a publish failed (`failed`: its
    /// writer was told): any close tries again, as the last one may never come to it.
    pub fn leaves_close_to_others(&self, h: &FileHandle, failed: bool) -> bool {
        h.write.is_some()
            && !failed
            && !h.changed.load(Ordering::Relaxed)
            && self.writers(h.ino) > 1
    }

    /// [`Self::leaves_close_to_others`], known without waiting (false while the state is
    /// busy).
    pub fn leaves_close_to_others_now(&self, h: &FileHandle) -> bool {
        let Some(w) = &h.write else {
            return false;
        };
        let Ok(st) = w.state.try_lock() else {
            return false;
        };
        self.leaves_close_to_others(h, st.failed())
    }

    /// Whether handle `h` has nothing to publish, known without waiting (`None`: its state
    /// is busy).
    pub fn nothing_to_publish(&self, h: &FileHandle) -> Option<bool> {
        let Some(w) = &h.write else {
            return Some(true);
        };
        let st = w.state.try_lock().ok()?;
        Some(!st.has_changes_to_publish())
    }

    /// Whether all handle `h` would publish now is an empty file (created or truncated,
    /// nothing written since), known without waiting.
    pub fn only_emptied(&self, h: &FileHandle) -> bool {
        let Some(w) = &h.write else {
            return false;
        };
        w.state
            .try_lock()
            .is_ok_and(|st| st.has_changes_to_publish() && st.size() == 0)
    }

    /// Keys of the files being written with something not stored yet (without waiting: a
    /// file busy publishing has its upload named already).
    pub fn not_stored(&self) -> Vec<String> {
        self.all_writes()
            .iter()
            .filter_map(|w| {
                let st = w.state.try_lock().ok()?;
                st.has_changes_to_publish().then(|| st.key.to_string())
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bucketfs_store::memory::MemoryStore;

    /// A copy found for an open that may no longer share one (the inode is being written
    /// here since: a background close, a truncate) is never handed to the kernel: it is of
    /// the version they replace. An earlier build checked only the ETag, which a write here
    /// changes only once it is stored.
    #[tokio::test]
    async fn a_copy_is_not_handed_out_to_an_open_that_may_not_share() {
        let (files, _) = OpenFiles::new(
            Arc::new(MemoryStore::new()),
            &FsConfig::default(),
            Arc::default(),
        )
        .unwrap();
        let copy = || {
            let f = tempfile::tempfile().unwrap();
            let seal = CopySeal::of(&f.metadata().unwrap());
            Some(("\"E\"".to_string(), f, seal))
        };
        let mut local = copy();
        let r = files.choose_through(7, Some("\"E\""), 0, (false, None), &mut local);
        assert!(matches!(r, Ok(None)), "handed out while being written");
        assert!(!files.is_through(7));
        let mut local = copy();
        let r = files.choose_through(7, Some("\"E\""), 0, (true, None), &mut local);
        assert!(matches!(r, Ok(Some(_))), "an idle inode's copy was refused");
    }
}
