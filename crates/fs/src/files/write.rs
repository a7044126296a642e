//! The write path: one [`WriteState`] per inode open for writing, shared by all its handles.
//!
//! Written bytes are tracked as dirty extents over a *base* (the object as it was when the file
//! was opened, if any). A sequential stream of appends fills an in-memory *tail* buffer, one
//! part at a time: a full tail uploads straight from memory, and a small file never touches
//! the disk at all. Every streamed part is also copied to the staging file, in the background
//! from the same buffer: S3 cannot read a part of an unfinished upload, and publishing the
//! file to read it back would put half-written content under its key. Bytes whose copy failed
//! (a full disk) are held only by their uploaded part: reading or partly rewriting them fails
//! with `EIO` (the writer's appends go on), and only the writer's own close/fsync publishes
//! them. Any other write goes to a sparse local staging file under `cache_dir`, and each part
//! that becomes completely written there uploads in the background too, so close only sends
//! what is left. At publish, unchanged part-sized ranges of the base are copied server-side
//! (UploadPartCopy), and only parts holding new bytes are sent, so an append or an overwrite
//! in the middle of a large object sends kilobytes, not the object. Small results go up as
//! one PUT. Nothing is visible in the bucket until a publish completes; a failed publish
//! aborts its multipart upload and returns the error.
//!
//! A publish that keeps bytes of the base is pinned to the base's ETag: its part copies and
//! GETs, and its PUT or CompleteMultipartUpload (`If-Match`). Another client's version written
//! meanwhile refuses it (ESTALE) and stays whole; a whole rewrite is not pinned.
//!
//! Here: the state, its tail, the staging file, reads and truncation; the streaming upload
//! is in `write/stream.rs`, publish and background mode's commit in `write/publish.rs`.

use crate::aligned::{AlignedBuf, ALIGN};
use crate::budget::{MemoryBudget, Reservation};
use crate::config::MinFree;
use crate::error::{log_store_err, FsError, FsResult};
use crate::files::extents::Extents;
use crate::files::writeback::{Changes, Cond, WriteBack};
use crate::meta::Ino;
use crate::metrics::{inc, inc_by, FsMetrics};
use crate::paths::ObjectKey;
use crate::pool::PoolBuf;
use bucketfs_store::{
    run_bounded, CompletedPart, HeadersFrom, ObjectStore, StoreError, StoreLimits, StoreResult,
    Upload, Uploads, UserMeta, IF_ABSENT,
};
use bytes::Bytes;
use futures::future::BoxFuture;
use futures::FutureExt;
use std::collections::BTreeMap;
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::SystemTime;
use tokio::task::JoinHandle;

mod publish;
pub use publish::Stored;
mod stream;

/// Where each part of a multipart object starts and ends. Parts are `part_size` bytes for the
/// first 1,000, then double every 1,000 parts, so 10,000 parts reach the 5 TiB object limit
/// with an 8 MiB base while small files keep small parts.
#[derive(Debug, Clone, Copy)]
pub struct PartLayout {
    pub part_size: u64,
}

const PARTS_PER_STEP: u64 = 1000;
/// Reads of a file open for writing fetch base bytes in aligned blocks of this size.
const READ_BLOCK: u64 = 128 * 1024;
/// Background mode: staging writes of at least this much start their write to disk at
/// once (see [`start_writeback`]).
const FLUSH_MIN: u64 = 1 << 20;
/// A commit copies the content into its write-back entry this much at a time.
const COMMIT_CHUNK: u64 = 1 << 20;

impl PartLayout {
    /// Byte range of part `index` (0-based; part number `index + 1`).
    pub fn bounds(&self, index: u64) -> Range<u64> {
        let step = index / PARTS_PER_STEP;
        let within = index % PARTS_PER_STEP;
        // Steps before this one hold 1000 parts of part_size << s each.
        let start_of_step = self.part_size * PARTS_PER_STEP * ((1u64 << step) - 1);
        let size = self.part_size << step;
        let start = start_of_step + within * size;
        start..start + size
    }

    /// Index of the part holding byte `offset`.
    pub fn index_of(&self, offset: u64) -> u64 {
        let mut step = 0;
        let mut step_start = 0u64;
        loop {
            let step_len = (self.part_size << step) * PARTS_PER_STEP;
            if offset < step_start + step_len {
                return step * PARTS_PER_STEP + (offset - step_start) / (self.part_size << step);
            }
            step_start += step_len;
            step += 1;
        }
    }

    /// The largest file this layout can store as one object within `limits`: its parts
    /// must number at most `max_parts` and be at most `max_part` each (they double every
    /// 1,000), and the object at most `max_object`.
    pub fn largest_file(&self, limits: &StoreLimits) -> u64 {
        let max_parts = u64::from(limits.max_parts.max(1));
        let mut end = self.bounds(max_parts - 1).end;
        let mut step = 0;
        while step * PARTS_PER_STEP < max_parts {
            if self.part_size << step > limits.max_part {
                end = end.min(self.bounds(step * PARTS_PER_STEP).start);
                break;
            }
            step += 1;
        }
        end.min(limits.max_object)
    }

    /// Ranges of all parts of an object of `size` bytes (the last one cut at `size`).
    pub fn parts(&self, size: u64) -> Vec<Range<u64>> {
        let mut out = Vec::new();
        let mut i = 0;
        loop {
            let b = self.bounds(i);
            if b.start >= size {
                break;
            }
            out.push(b.start..b.end.min(size));
            i += 1;
        }
        out
    }
}

/// The object a rewrite starts from.
#[derive(Debug, Clone)]
pub struct Base {
    pub etag: String,
    pub size: u64,
}

/// The in-memory tail grows in powers of two up to this, then to its whole part at once (so a
/// small file holds little memory and a big part is copied at most once when it grows).
const TAIL_STEP_MAX: u64 = 1024 * 1024;

/// Appends since the start of a part, held in memory until the part is full.
struct Tail {
    /// Where the buffer starts: always the start of a part.
    start: u64,
    /// End of that part.
    part_end: u64,
    buf: TailBuf,
}

/// The tail's memory: a buffer of the budget's pool growing with a file that may turn out
/// small, then one of a whole part for each part.
enum TailBuf {
    /// Bytes staging could not take back as a tail ([`Self::thawed`]), in memory `mem`.
    Thawed {
        buf: AlignedBuf,
        /// Budget taken for `buf`'s capacity.
        mem: Vec<Reservation>,
        reserved: u64,
    },
    /// A buffer of the budget's pool (none yet: empty), holding its own reservation. Not the
    /// allocator's: glibc keeps freed buffers of this size in its heap, outside the budget
    /// (300 writers of 1 MiB files closing at once left the daemon at 373 MiB with
    /// `--max-memory 256M`).
    Pooled { buf: Option<PoolBuf>, filled: usize },
}

impl Default for TailBuf {
    fn default() -> Self {
        TailBuf::Pooled {
            buf: None,
            filled: 0,
        }
    }
}

impl TailBuf {
    fn as_slice(&self) -> &[u8] {
        match self {
            TailBuf::Thawed { buf, .. } => buf.as_slice(),
            TailBuf::Pooled { buf, filled } => buf.as_ref().map_or(&[], |b| &b.as_ref()[..*filled]),
        }
    }

    /// Bytes it holds room for.
    fn capacity(&self) -> u64 {
        match self {
            TailBuf::Thawed { reserved, .. } => *reserved,
            TailBuf::Pooled { buf, .. } => buf.as_ref().map_or(0, |b| b.as_ref().len() as u64),
        }
    }

    /// A buffer holding a copy of `data` in memory `mem`: what [`Self::freeze`] gave, back
    /// as a tail (its bytes could not be staged).
    fn thawed(data: &[u8], mem: Vec<Reservation>) -> Self {
        let mut buf = AlignedBuf::default();
        buf.extend_from_slice(data);
        let reserved = mem.iter().map(Reservation::bytes).sum();
        TailBuf::Thawed { buf, mem, reserved }
    }

    /// The bytes, without a copy, and the memory they hold (whose holder returns it when the
    /// part is sent and copied, even if a store keeps the bytes).
    fn freeze(self) -> (Bytes, Vec<Reservation>) {
        match self {
            TailBuf::Thawed { buf, mem, .. } => (buf.freeze(), mem),
            TailBuf::Pooled { buf: None, .. } => (Bytes::new(), Vec::new()),
            TailBuf::Pooled {
                buf: Some(buf),
                filled,
            } => {
                let (buf, mem) = buf.split_mem();
                (buf.freeze(filled), vec![mem])
            }
        }
    }
}

impl Tail {
    fn end(&self) -> u64 {
        self.start + self.buf.as_slice().len() as u64
    }

    fn range(&self) -> Range<u64> {
        self.start..self.end()
    }

    fn is_full(&self) -> bool {
        self.end() == self.part_end
    }

    /// Appends `data` (which must fit in the part) if the budget has room for it now; false
    /// leaves the tail unchanged.
    fn append(&mut self, budget: &MemoryBudget, data: &[u8]) -> bool {
        let len = self.buf.as_slice().len();
        let need = len + data.len();
        if need as u64 > self.buf.capacity() {
            // Past its first part a file is big: take the whole part at once (its pages
            // faulted in at once: it will be written whole, unless it is the last).
            let whole = need as u64 > TAIL_STEP_MAX || self.start > 0;
            let target = match whole {
                true => self.part_end - self.start,
                false => (need as u64)
                    .next_power_of_two()
                    .clamp(64 * 1024, TAIL_STEP_MAX),
            };
            let Some(mut bigger) = budget.try_buffer_lasting(target, whole) else {
                return false;
            };
            bigger.as_mut_slice()[..len].copy_from_slice(self.buf.as_slice());
            self.buf = TailBuf::Pooled {
                buf: Some(bigger),
                filled: len,
            };
        }
        match &mut self.buf {
            TailBuf::Thawed { buf, .. } => buf.extend_from_slice(data),
            TailBuf::Pooled { buf, filled } => {
                let buf = buf.as_mut().expect("room was made above");
                buf.as_mut_slice()[len..need].copy_from_slice(data);
                *filled = need;
            }
        }
        true
    }
}

/// What [`WriteState::append_now`] did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Appended {
    /// Nothing: take the asynchronous path.
    No,
    Yes,
    /// Appended, and the part is full: ship it before answering.
    PartFull,
}

/// Where the current content of a byte range is.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Source {
    Staging,
    Tail,
    Base,
    Zeros,
    /// Only in an uploaded part of the open upload: publish before using it.
    Uploaded,
}

/// A part uploaded (or uploading) ahead of publish.
enum PartSlot {
    Uploading {
        generation: u64,
        task: JoinHandle<PartOutcome>,
    },
    Done {
        generation: u64,
        etag: String,
    },
    /// The upload failed; publish sends it again, from `kept` when the part's bytes are
    /// nowhere else (its local copy failed too).
    Failed {
        generation: u64,
        kept: Option<PartBody>,
    },
}

/// A part's bytes and the budget they hold.
type PartBody = (Bytes, Arc<Vec<Reservation>>);

/// What a background part upload ends with: the ETag, or the error and, for a part with no
/// local copy, its bytes (so that a failure loses nothing).
type PartOutcome = Result<String, (StoreError, Option<PartBody>)>;

/// An open multipart upload fed while the file is being written. Dropped unfinished (its
/// handles are gone and publish failed or was never reached), the upload aborts itself once
/// its running parts are done, so no parts are left behind.
struct Stream {
    upload: Upload,
    slots: BTreeMap<u64, PartSlot>,
    /// The metadata the upload was created with, which its object will carry: a change
    /// since (chmod, chown, utimens through the file) is stored after it completes.
    meta: UserMeta,
    /// The ETag of the version whose other headers it was given (see
    /// [`WriteState::headers_from`]).
    headers_of: Option<String>,
}

pub struct WriteConfig {
    pub layout: PartLayout,
    pub upload_concurrency: usize,
    /// Creates the multipart uploads, and retries the aborts that failed (the store was down).
    pub uploads: Arc<Uploads>,
    /// The store's sizes: parts per upload, largest object and copy.
    pub limits: StoreLimits,
    pub metrics: Arc<FsMetrics>,
    /// Part buffers take their memory from here (writers wait when it is full).
    pub budget: Arc<MemoryBudget>,
    /// `--upload background`: close commits to this write-back directory (see
    /// [`WriteState::commit`]); full parts go up while a file is written only as a head
    /// start for its entry's upload (see `WriteState::ship_tail_early`).
    pub writeback: Option<Arc<WriteBack>>,
    /// Free space the staging disk keeps (see [`WriteState::ship_tail`]).
    pub cache_min_free: MinFree,
}

/// Where a write state is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Nothing differs from the bucket.
    Clean,
    /// Content or metadata differs from the bucket: the next publish stores it.
    Changed,
    /// The last publish failed (its caller was told) and nothing changed since; the next
    /// publish tries again.
    Failed,
    /// Unlinked, or renamed over: never published again.
    Unlinked,
    /// Dropped by the registry after its last writer closed: nothing publishes it.
    Retired,
}

/// Everything written to one inode and not yet published.
pub struct WriteState {
    store: Arc<dyn ObjectStore>,
    cfg: Arc<WriteConfig>,
    pub key: ObjectKey,
    /// The object being rewritten; bytes below `base_len` that are not dirty come from it.
    base: Option<Base>,
    base_len: u64,
    /// Current file size, shared with getattr without taking the lock.
    size: Arc<AtomicU64>,
    cache_dir: PathBuf,
    /// Created on first use: a small file written in one go never needs it.
    staging: Option<Arc<File>>,
    /// The staging file opened with `O_DIRECT` (None where the file system refuses it), for
    /// copies of whole parts: through the page cache they cost more CPU than the upload.
    staging_direct: Option<Arc<File>>,
    /// Sequential appends not yet in the staging file (see [`Tail`]).
    tail: Option<Tail>,
    /// Background copies of uploaded tails into the staging file; settled before the staging
    /// file is read or written.
    spills: Vec<(Range<u64>, JoinHandle<std::io::Result<()>>)>,
    /// Bytes that only a part of the open upload holds (their local copy failed): unreadable
    /// until a publish (see [`Self::recover`]).
    uploaded_only: Extents,
    /// Streamed parts stopped getting staging copies (the disk reached --cache-min-free).
    copies_stopped: bool,
    /// Shipping a part a write filled failed after the write took its bytes (they are
    /// kept): that write got its count, the next one gets this error (a writer the store
    /// refuses stops before it fills the staging disk).
    deferred_err: Option<FsError>,
    dirty: Extents,
    /// Bytes whose current content is in the staging file: what was written (`dirty`) plus
    /// what was fetched or published since. Reads and uploads take these from disk.
    local: Extents,
    /// Times each part was touched, so a part uploaded early is resent if rewritten.
    generations: BTreeMap<u64, u64>,
    stream: Option<Stream>,
    /// Background mode: the stream being opened (its upload created) in the background: a
    /// writer never waits for the store there.
    opening: Option<JoinHandle<StoreResult<Stream>>>,
    /// Background mode: no part of this file goes up early any more (its upload could not
    /// be created, or it was renamed).
    early_off: bool,
    /// User metadata the published object carries.
    pub meta: UserMeta,
    phase: Phase,
    /// A publish was refused because another client changed the object (ESTALE): a content
    /// that keeps bytes of the base can never be published (and its streamed parts are gone).
    conflict: bool,
    /// The ETags (as S3 computes them: the body's MD5, or the multipart form) and sizes of
    /// this file's pinned publishes (`If-None-Match` for a new file, `If-Match` for a
    /// partial rewrite) that failed without a definite answer: one may have landed, and the
    /// next publish, refused because the object is no longer what it was pinned to, finds
    /// that object its own (see [`Self::own_earlier_try`]), not another client's.
    unanswered_tries: Vec<(String, u64)>,
    /// The mtime to publish; `None` keeps the one in `meta` (nothing written since open, so
    /// a chmod or an atime-only utimens through the descriptor leaves the stored mtime).
    pub mtime: Option<SystemTime>,
    /// `mtime` was set by utimens, not by a write since: a streamed upload must store it
    /// (see [`Self::set_mtime`]).
    mtime_set: bool,
    /// Background mode: the write-back entry of the last commit (see [`Self::commit`]).
    committed: Option<u64>,
    /// Background mode: the ETag that commit's upload landed as, once the file system
    /// learnt it: what the next version replaces when there is no base object.
    committed_etag: Option<String>,
    /// Background mode: what changed since that commit made the content, for a delta
    /// commit; None: not known (no commit yet, or the entry was made otherwise).
    since_commit: Option<SinceCommit>,
    /// Background mode: bytes were written or the size changed since the content was last
    /// committed or stored (or since the state was made): a commit now is a rewrite, which
    /// may go over another client's version after a conflict; a chmod's is not.
    bytes_changed: bool,
    /// The staging file is that entry's file: it is read, and copied before a change.
    staging_shared: bool,
    /// Where the file's bytes start in a shared staging file (a segment record's).
    staging_offset: u64,
}

/// What changed in a file since its last commit (background mode).
pub(crate) struct SinceCommit {
    /// The byte ranges written.
    written: Extents,
    /// The smallest size the file had.
    keep: u64,
    /// Its size at the commit.
    committed: u64,
}

impl SinceCommit {
    pub(crate) fn new(size: u64) -> Self {
        Self {
            written: Extents::default(),
            keep: size,
            committed: size,
        }
    }
}

/// Whether `len` bytes at `offset` end within the largest file `cfg`'s part layout can
/// store (it failed at close before, after all of it was written).
fn fits_object(cfg: &WriteConfig, offset: u64, len: usize) -> bool {
    offset
        .checked_add(len as u64)
        .is_some_and(|e| e <= cfg.layout.largest_file(&cfg.limits))
}

fn io_err(e: std::io::Error) -> FsError {
    tracing::warn!("staging file: {e}");
    FsError::from(e)
}

/// A staging file at least this big is closed on a blocking thread (see `Drop`).
const CLOSE_AWAY_MIN: u64 = 16 << 20;

impl Drop for WriteState {
    /// Closing the last descriptor of a big staging file frees its blocks, which takes the
    /// file system a while (about 0.2 s a GiB on a virtual disk that discards them). A state
    /// goes at a release or a publish, on a FUSE thread or before a reply: neither may wait.
    fn drop(&mut self) {
        close_away([self.staging.take(), self.staging_direct.take()]);
    }
}

/// Closes a staging file and its `O_DIRECT` twin; on a blocking thread when it is big (see
/// `Drop for WriteState`).
fn close_away(files: [Option<Arc<File>>; 2]) {
    let big = files[0]
        .as_ref()
        .and_then(|f| f.metadata().ok())
        .is_some_and(|m| m.len() >= CLOSE_AWAY_MIN);
    if let (true, Ok(rt)) = (big, tokio::runtime::Handle::try_current()) {
        rt.spawn_blocking(move || {
            crate::testpoint::reached_blocking("write.close_away");
            drop(files)
        });
    }
}

impl WriteState {
    /// A state over `base` (None for a new or empty object), staging in `cache_dir`.
    pub fn new(
        store: Arc<dyn ObjectStore>,
        cfg: Arc<WriteConfig>,
        key: ObjectKey,
        base: Option<Base>,
        meta: UserMeta,
        cache_dir: &Path,
        size: Arc<AtomicU64>,
    ) -> Self {
        let base_len = base.as_ref().map_or(0, |b| b.size);
        size.store(base_len, Ordering::Relaxed);
        Self {
            store,
            cfg,
            key,
            base,
            base_len,
            size,
            cache_dir: cache_dir.to_path_buf(),
            staging: None,
            staging_direct: None,
            tail: None,
            spills: Vec::new(),
            uploaded_only: Extents::default(),
            copies_stopped: false,
            deferred_err: None,
            dirty: Extents::default(),
            local: Extents::default(),
            generations: BTreeMap::new(),
            stream: None,
            opening: None,
            early_off: false,
            meta,
            phase: Phase::Clean,
            conflict: false,
            unanswered_tries: Vec::new(),
            mtime: None,
            mtime_set: false,
            committed: None,
            committed_etag: None,
            since_commit: None,
            bytes_changed: false,
            staging_shared: false,
            staging_offset: 0,
        }
    }

    pub fn size(&self) -> u64 {
        self.size.load(Ordering::Relaxed)
    }

    pub fn base_etag(&self) -> Option<&str> {
        self.base.as_ref().map(|b| b.etag.as_str())
    }

    /// The size of the version this state builds on, as stored.
    pub fn base_size(&self) -> Option<u64> {
        self.base.as_ref().map(|b| b.size)
    }

    /// The ETag of the version this state builds on, as far as it knows: its base object's,
    /// else (background mode) that of its last commit's upload once it landed.
    pub fn known_etag(&self) -> Option<&str> {
        self.base_etag().or(self.committed_etag.as_deref())
    }

    /// The version whose headers other than the user metadata (Content-Type,
    /// Cache-Control, ...) the next version, stored under `pin`, keeps: the one it replaces,
    /// the pinned one or as far as this state knows (see [`Self::known_etag`]); none for a
    /// new file.
    pub fn headers_from<'a>(&'a self, pin: Option<&'a str>) -> Option<HeadersFrom<'a>> {
        let etag = match pin {
            Some(IF_ABSENT) => return None,
            Some(etag) => etag,
            None => self.known_etag()?,
        };
        Some(HeadersFrom {
            key: self.key.as_str(),
            etag: Some(etag),
        })
    }

    /// Background mode: the write-back entry of the last commit.
    pub fn committed(&self) -> Option<u64> {
        self.committed
    }

    /// The write-back entry that holds the content as of the last commit is `seq` now (a
    /// rename moved it), or none is (`None`).
    pub fn set_committed(&mut self, seq: Option<u64>) {
        self.committed = seq;
        // Only this state's own commits say what changed since.
        self.since_commit = None;
    }

    fn touch_parts(&mut self, r: Range<u64>) {
        if r.start >= r.end {
            return;
        }
        let layout = self.cfg.layout;
        for i in layout.index_of(r.start)..=layout.index_of(r.end - 1) {
            *self.generations.entry(i).or_default() += 1;
        }
    }

    /// Writes `data` at `offset`; returns how many bytes the file took: all, or fewer when the
    /// local disk failed after some were (a short write, as a disk filling up gives: failing
    /// it as a whole would leave its first bytes in the file unsaid, and an O_APPEND caller's
    /// retry would write them twice). A store's refusal fails the write, so that a writer
    /// stops before it fills the staging disk with a file that cannot be stored.
    pub async fn write(&mut self, offset: u64, mut data: Bytes) -> FsResult<usize> {
        if !fits_object(&self.cfg, offset, data.len()) {
            return Err(FsError::EFBIG);
        }
        if data.is_empty() {
            return Ok(0);
        }
        if let Some(e) = self.deferred_err.take() {
            return Err(e);
        }
        let len = data.len();
        // A part rewritten in part needs its other bytes at publish.
        self.recover(self.parts_around(offset..offset + len as u64))
            .await?;
        self.touch();
        let short = |at: u64, e: FsError| match at - offset {
            0 => Err(e),
            took => Ok(took as usize),
        };
        let mut at = offset;
        while !data.is_empty() {
            // A part filled by `append_now` and not shipped yet.
            self.ship_full_tail().await?;
            let tail_took = match self.tail_takes(at) {
                true => {
                    let tail = self.tail.as_mut().expect("tail_takes made one");
                    let n = data.len().min((tail.part_end - at) as usize);
                    // False when the budget is full: this part continues on disk.
                    tail.append(&self.cfg.budget, &data[..n]).then_some(n)
                }
                false => None,
            };
            let Some(n) = tail_took else {
                if let Err(e) = self.spill_tail().await {
                    return short(at, e);
                }
                let rest = data.len() as u64;
                return match self.write_staging(at, data).await {
                    (took, Err(e)) if took < rest => short(at + took, e),
                    (_, r) => r.map(|()| len),
                };
            };
            let full = self.tail.as_ref().is_some_and(Tail::is_full);
            let _ = data.split_to(n);
            self.wrote(at..at + n as u64);
            at += n as u64;
            if full {
                if let Err(e) = self.ship_tail().await {
                    // The bytes are taken (kept in the tail or on disk): failing this write
                    // would have its caller write them again (twice, with O_APPEND).
                    self.deferred_err = Some(e);
                    return Ok((at - offset) as usize);
                }
            }
        }
        Ok(len)
    }

    /// Appends `data` at `at` to the in-memory tail when that needs nothing asynchronous: the
    /// write continues or starts a part without crossing its end, and the budget has room
    /// now. This lets the FUSE thread copy straight from the kernel's buffer instead of into
    /// an owned one first (a third of the user-space copying of a sequential write).
    pub fn append_now(&mut self, at: u64, data: &[u8]) -> Appended {
        let full_tail = self.tail.as_ref().is_some_and(Tail::is_full);
        // A deferred error is the next write's: the slow path returns it.
        if data.is_empty()
            || !fits_object(&self.cfg, at, data.len())
            || full_tail
            || self.deferred_err.is_some()
        {
            return Appended::No;
        }
        if !self.tail_takes(at) {
            return Appended::No;
        }
        let tail = self.tail.as_mut().expect("tail_takes made one");
        if data.len() as u64 > tail.part_end - at || !tail.append(&self.cfg.budget, data) {
            return Appended::No;
        }
        let full = tail.is_full();
        self.touch();
        self.wrote(at..at + data.len() as u64);
        if full {
            Appended::PartFull
        } else {
            Appended::Yes
        }
    }

    /// Uploads the tail if it holds a whole part (left so by [`WriteState::append_now`]).
    pub async fn ship_full_tail(&mut self) -> FsResult<()> {
        if self.tail.as_ref().is_some_and(Tail::is_full) {
            self.ship_tail().await?;
        }
        Ok(())
    }

    /// [`Self::ship_full_tail`] after the write that filled the part took its bytes: a
    /// failure is the next write's (see `deferred_err`).
    pub async fn ship_filled_tail(&mut self) {
        if let Err(e) = self.ship_full_tail().await {
            self.deferred_err = Some(e);
        }
    }

    /// The content changes now: it differs from the bucket, and an earlier failed publish
    /// no longer describes it.
    fn touch(&mut self) {
        self.mark_changed();
        self.mtime = Some(SystemTime::now());
        self.mtime_set = false;
    }

    /// An mtime set by utimens: the object stores it, unless a write comes after.
    pub fn set_mtime(&mut self, t: SystemTime) {
        self.mtime = Some(t);
        self.mtime_set = true;
    }

    /// Bookkeeping of bytes `r` just written.
    fn wrote(&mut self, r: Range<u64>) {
        self.bytes_changed = true;
        if let Some(since) = &mut self.since_commit {
            since.written.insert(r.clone());
        }
        self.dirty.insert(r.clone());
        self.touch_parts(r.clone());
        if r.end > self.size() {
            self.size.store(r.end, Ordering::Relaxed);
        }
    }

    /// Whether a write at `at` goes to the in-memory tail (starting one if needed): it must
    /// continue the tail, or start a part (a new file, an append, or a rewrite from the
    /// start such as a database or `dd conv=notrunc`).
    fn tail_takes(&mut self, at: u64) -> bool {
        if let Some(t) = &self.tail {
            return at == t.end() && at < t.part_end;
        }
        if self.phase == Phase::Unlinked {
            return false;
        }
        let layout = self.cfg.layout;
        let i = layout.index_of(at);
        let part = layout.bounds(i);
        // The last possible part is never streamed: leave it to the staging path. Nor is a
        // part whose old bytes only the upload holds (the slow path recovers them first).
        if at != part.start
            || i + 1 >= self.cfg.limits.max_parts as u64
            || self.uploaded_only.intersects(&part)
        {
            return false;
        }
        self.tail = Some(Tail {
            start: at,
            part_end: part.end,
            buf: TailBuf::default(),
        });
        true
    }

    /// Moves the tail into the staging file (something other than an append needs it there).
    /// If that fails (a full disk), the tail stays: no acknowledged byte is dropped.
    async fn spill_tail(&mut self) -> FsResult<()> {
        let Some(r) = self.tail.as_ref().map(Tail::range) else {
            return Ok(());
        };
        if r.is_empty() {
            self.tail = None;
            return Ok(());
        }
        self.settle_spills().await;
        self.stage_tail().await?;
        self.local.insert(r);
        Ok(())
    }

    /// Stages the tail's bytes from its own memory and takes it; returns the bytes (frozen)
    /// and the memory they hold. A copy beside the tail would be a part's worth of memory
    /// outside the budget per writer staging. A failed write leaves the tail (a copy then).
    async fn stage_tail(&mut self) -> FsResult<(Bytes, Vec<Reservation>)> {
        let tail = self.tail.take().expect("a tail to stage");
        let (start, part_end) = (tail.start, tail.part_end);
        let (body, mem) = tail.buf.freeze();
        if let Err(e) = self.stage(start, body.clone()).await {
            let buf = TailBuf::thawed(&body, mem);
            self.tail = Some(Tail {
                start,
                part_end,
                buf,
            });
            return Err(e);
        }
        Ok((body, mem))
    }

    /// The tail holds a whole part: upload it from memory, and copy it to the staging file in
    /// the background from the same buffer, for reads and rewrites before publish. Where the
    /// staging file cannot be had, the part is held only by the upload (the write goes on).
    async fn ship_tail(&mut self) -> FsResult<()> {
        if self.phase == Phase::Unlinked {
            // Never published: keep the bytes for reads through open descriptors.
            return self.spill_tail().await;
        }
        if self.cfg.writeback.is_some() {
            return self.ship_tail_early().await;
        }
        let Some(i) = self
            .tail
            .as_ref()
            .map(|t| self.cfg.layout.index_of(t.start))
        else {
            return Ok(());
        };
        if let Err(e) = self.start_stream(None).await {
            // Keep the bytes (on disk, or else still in the tail): publish sends them, and
            // says if it cannot. After a failure that may pass (EIO: the store unreachable)
            // the write that filled the part succeeded: failing it would have the caller write
            // again what is kept (an O_APPEND retry stores it twice). A refusal (EACCES, no
            // bucket) fails it, so that a writer stops before it fills the staging disk with a
            // file that cannot be stored.
            let _ = self.spill_tail().await;
            return match e {
                FsError::EIO => Ok(()),
                e => Err(e),
            };
        }
        let staging = if self.keeps_copy_of_part(i).await {
            self.staging().await.ok()
        } else {
            None
        };
        self.reap_spills();
        let shipped = self.tail.as_ref().map(Tail::range);
        if shipped.is_some_and(|r| {
            self.spills
                .iter()
                .any(|(s, _)| s.start < r.end && r.start < s.end)
        }) {
            // An earlier copy of these bytes (the part written again from its start) still
            // runs: two copies of one range at once could land in either order, the older
            // bytes last, and a failure of the older one would mark the newer bytes lost.
            self.settle_spills().await;
        }
        self.wait_for_upload_slot().await;
        let Some(tail) = self.tail.take() else {
            return Ok(());
        };
        let r = tail.range();
        let generation = self.generations.get(&i).copied().unwrap_or(0);
        let (body, mem) = tail.buf.freeze();
        let mem = Arc::new(mem);
        match staging {
            Some(staging) => {
                let direct = self.staging_direct.clone();
                inc_by(&self.cfg.metrics.staged_bytes, r.end - r.start);
                let spill = {
                    let (body, mem, at) = (body.clone(), mem.clone(), r.start);
                    tokio::task::spawn_blocking(move || {
                        let _mem = mem;
                        write_part_blocking(&staging, direct.as_deref(), &body, at)
                    })
                };
                self.spills.push((r.clone(), spill));
                self.local.insert(r);
            }
            None => {
                if !self.copies_stopped {
                    tracing::warn!(
                        "{}: no staging file for bytes {r:?}: only their upload holds them, \
                         unreadable until close",
                        self.key
                    );
                }
                // Older bytes of this range may be staged; they are stale now.
                self.local.remove(r.clone());
                self.uploaded_only.insert(r);
            }
        }
        // Its staging copy may still fail: a failed upload returns the bytes.
        self.spawn_part_upload(i, generation, body, mem, true).await;
        Ok(())
    }

    /// Whether streamed part `i` gets a copy in the staging file (for reads and rewrites
    /// before close). The first part always does (headers are rewritten there); the others
    /// while the staging disk keeps `--cache-min-free`, so a big sequential write never fills
    /// the disk with a copy of what the store already holds.
    async fn keeps_copy_of_part(&mut self, i: u64) -> bool {
        let len = self.cfg.layout.bounds(i).end - self.cfg.layout.bounds(i).start;
        if i == 0 {
            return true;
        }
        let (min_free, dir) = (self.cfg.cache_min_free, self.cache_dir.clone());
        // A local-disk step (a hung disk must not hold the thread: see `inline`).
        let room = crate::inline::local_io(move || min_free.room_for(&dir, len)).await;
        if room.unwrap_or(true) {
            return true;
        }
        if !self.copies_stopped {
            self.copies_stopped = true;
            tracing::warn!(
                "{}: {} has less free space than --cache-min-free: the parts it uploads from \
                 byte {} on keep no local copy (reading or rewriting them before close gets EIO)",
                self.key,
                self.cache_dir.display(),
                self.cfg.layout.bounds(i).start
            );
        }
        false
    }

    /// Waits for the background copies into the staging file. A failed copy leaves its bytes
    /// only in their uploaded part: readable again once published.
    async fn settle_spills(&mut self) {
        for (r, task) in std::mem::take(&mut self.spills) {
            let outcome = task.await.map_err(std::io::Error::other).and_then(|x| x);
            self.spilled(r, outcome);
        }
    }

    /// Records the copies into the staging file that have finished, without waiting.
    fn reap_spills(&mut self) {
        let mut running = Vec::new();
        for (r, mut task) in std::mem::take(&mut self.spills) {
            match (&mut task).now_or_never() {
                Some(outcome) => {
                    self.spilled(r, outcome.map_err(std::io::Error::other).and_then(|x| x))
                }
                None => running.push((r, task)),
            }
        }
        self.spills = running;
    }

    fn spilled(&mut self, r: Range<u64>, outcome: std::io::Result<()>) {
        if let Err(e) = outcome {
            tracing::warn!(
                "{}: staging copy of bytes {r:?} failed: {e}; only their upload holds them, \
                 unreadable until close",
                self.key
            );
            self.local.remove(r.clone());
            self.uploaded_only.insert(r);
        }
    }

    /// Before the staging file changes: if it is a write-back entry's file (which must stay
    /// as committed until uploaded), the bytes move to a staging file of this state's own.
    async fn unshare(&mut self) -> FsResult<()> {
        self.unshare_below(self.size()).await
    }

    /// [`Self::unshare`], of the bytes below `end` only (a truncate's new size).
    async fn unshare_below(&mut self, end: u64) -> FsResult<()> {
        if !self.staging_shared {
            return Ok(());
        }
        let src = self.staging.clone().expect("a shared staging file");
        let (dst, direct) = self.new_staging().await?;
        let dst = Arc::new(dst);
        let ranges: Vec<Range<u64>> = self
            .local
            .segments(0..end.min(self.size()))
            .filter(|(_, local)| *local)
            .map(|(r, _)| r)
            .collect();
        let (copy, offset) = (dst.clone(), self.staging_offset);
        tokio::task::spawn_blocking(move || -> std::io::Result<()> {
            let mut buf = vec![0u8; 1 << 20];
            for r in ranges {
                let mut at = r.start;
                while at < r.end {
                    let n = ((r.end - at) as usize).min(buf.len());
                    src.read_exact_at(&mut buf[..n], offset + at)?;
                    copy.write_all_at(&buf[..n], at)?;
                    at += n as u64;
                }
            }
            Ok(())
        })
        .await
        .map_err(|_| FsError::EIO)?
        .map_err(io_err)?;
        // The shared file may be the last link to an uploaded entry: freed away from here.
        let direct = direct.map(Arc::new);
        close_away([
            self.staging.replace(dst),
            std::mem::replace(&mut self.staging_direct, direct),
        ]);
        self.staging_shared = false;
        self.staging_offset = 0;
        Ok(())
    }

    /// A new staging file in the cache directory; in background mode, when the write-back
    /// directory is on the same file system, one there that a commit can take as its
    /// entry's file (see `Slot::adopt`). On another file system a commit could not take it,
    /// and staging there would move the writers' disk use off the cache directory's disk.
    /// With it, the file opened again with `O_DIRECT` where that works (see
    /// [`open_direct`]). Local-disk steps: run where a hung disk holds no thread that must
    /// stay free (see `inline`).
    async fn new_staging(&self) -> FsResult<(File, Option<File>)> {
        let (wb, cache_dir) = (self.cfg.writeback.clone(), self.cache_dir.clone());
        let made = crate::inline::local_io(move || {
            use std::os::unix::fs::MetadataExt;
            let dev = |p: &Path| std::fs::metadata(p).map(|m| m.dev()).ok();
            let f = match &wb {
                Some(wb) if dev(&wb.config().dir).is_some_and(|d| Some(d) == dev(&cache_dir)) => {
                    wb.unnamed_file()
                }
                _ => tempfile::tempfile_in(&cache_dir),
            }?;
            let direct = open_direct(&f);
            Ok((f, direct))
        })
        .await
        .ok_or(FsError::EIO)?;
        made.map_err(io_err)
    }

    /// The staging file, created on first use.
    async fn staging(&mut self) -> FsResult<Arc<File>> {
        if let Some(f) = &self.staging {
            return Ok(f.clone());
        }
        let (f, direct) = self.new_staging().await?;
        let f = Arc::new(f);
        self.staging = Some(f.clone());
        self.staging_direct = direct.map(Arc::new);
        Ok(f)
    }

    /// Writes `data` at `offset` of the staging file.
    async fn stage(&mut self, offset: u64, data: Bytes) -> FsResult<()> {
        self.stage_counted(offset, data).await.1
    }

    /// [`Self::stage`], also returning how many of the bytes the staging file took: a disk
    /// that fills up midway takes the first ones.
    async fn stage_counted(&mut self, offset: u64, data: Bytes) -> (u64, FsResult<()>) {
        if let Err(e) = self.unshare().await {
            return (0, Err(e));
        }
        let staging = match self.staging().await {
            Ok(f) => f,
            Err(e) => return (0, Err(e)),
        };
        // Background mode: what is staged is committed (fsync'd) at close, in place when the
        // file is bigger than a record.
        let len = data.len() as u64;
        let flush = self.cfg.writeback.is_some()
            && len >= FLUSH_MIN
            && offset + len > crate::files::writeback::RECORD_MAX;
        let (took, r) = write_at(&staging, offset, data, flush).await;
        inc_by(&self.cfg.metrics.staged_bytes, took);
        (took, r)
    }

    /// Writes `data` at `offset` through the staging file; returns how many bytes the file
    /// took (all, or the first ones when the disk refused the rest) and how the step ended.
    async fn write_staging(&mut self, offset: u64, data: Bytes) -> (u64, FsResult<()>) {
        self.settle_spills().await;
        let (took, staged) = self.stage_counted(offset, data).await;
        // Bytes the disk took replaced what was there: they are the file's now, and the
        // write a short one (failing it as a whole left them in the file unsaid, and a
        // close stored them).
        let r = offset..offset + took;
        if took > 0 {
            self.local.insert(r.clone());
            self.uploaded_only.remove(r.clone());
            self.wrote(r.clone());
        }
        if let Err(e) = staged {
            return (took, Err(e));
        }
        (took, self.stream_full_parts(r).await)
    }

    /// Sets the size (truncate/extend).
    pub async fn truncate(&mut self, size: u64) -> FsResult<()> {
        if size > self.cfg.layout.largest_file(&self.cfg.limits) {
            return Err(FsError::EFBIG);
        }
        let old = self.size();
        if size == old {
            // The same size changes nothing (POSIX: not even mtime); re-publishing here would
            // copy the whole object server-side (fio reopens its files this way).
            return Ok(());
        }
        // The part where the old and new sizes meet is sent again: its kept bytes are needed.
        let edge = size.min(old);
        let part = self.cfg.layout.bounds(self.cfg.layout.index_of(edge));
        self.recover(part.start..edge).await?;
        self.spill_tail().await?;
        self.settle_spills().await;
        if size < old {
            // The disk steps first: one that fails leaves the file as it was (cut before
            // them, the bytes from the cut on read as zeros, and a close stored that).
            // A shared file is copied into a new one holding only the bytes below the cut.
            let shared = self.staging_shared;
            self.unshare_below(size).await?;
            if let Some(staging) = self.staging.clone().filter(|_| !shared) {
                tokio::task::spawn_blocking(move || staging.set_len(size))
                    .await
                    .map_err(|_| FsError::EIO)?
                    .map_err(io_err)?;
            }
            if let Some(since) = &mut self.since_commit {
                since.written.truncate(size);
                since.keep = since.keep.min(size);
            }
            self.dirty.truncate(size);
            self.local.truncate(size);
            self.uploaded_only.truncate(size);
            self.base_len = self.base_len.min(size);
            // Parts from the cut on no longer hold what they held.
            self.touch_parts(size..old);
        } else if size > old {
            // The new bytes are zeros: mark them dirty so they are not taken from the base.
            self.touch_parts(old..size);
            self.dirty.insert(old..size);
        }
        // Only once it is done: a truncate that failed changed nothing.
        self.bytes_changed = true;
        self.size.store(size, Ordering::Relaxed);
        self.touch();
        Ok(())
    }

    /// Bytes `range` of the current content. Base bytes not at hand yet are fetched in
    /// aligned blocks and kept in the staging file, so later reads and uploads of them need
    /// no request.
    pub async fn read(&mut self, range: Range<u64>) -> FsResult<Bytes> {
        let end = range.end.min(self.size());
        if range.start >= end {
            return Ok(Bytes::new());
        }
        self.recover(range.start..end).await?;
        self.settle_spills().await;
        // A base of at most one part comes whole at the first read, as a read-only open's
        // does (a program that opens O_RDWR only to read, sysbench or a database, otherwise
        // waits for one GET per block it touches), when that much memory is free; else the
        // aligned blocks the read touches, whose memory a read may always demand.
        let whole = (self.base_len <= self.cfg.layout.part_size && range.start < self.base_len)
            .then(|| self.missing_base(0..self.base_len))
            .and_then(|m| {
                let len = m.last()?.end - m.first()?.start;
                Some((m, self.cfg.budget.try_buffer(len)?))
            });
        let fetch = match whole {
            Some(w) => Some(w),
            None => {
                let block_start = range.start - range.start % READ_BLOCK;
                let block_end = (end.div_ceil(READ_BLOCK) * READ_BLOCK).min(self.base_len);
                let m = self.missing_base(block_start..block_end);
                match (m.first(), m.last()) {
                    (Some(first), Some(last)) => {
                        let len = last.end - first.start;
                        Some((m, self.cfg.budget.demand_buffer(len).await))
                    }
                    _ => None,
                }
            }
        };
        if let Some((missing, mut buf)) = fetch {
            let span = missing[0].start..missing[missing.len() - 1].end;
            let n = self
                .store
                .get_range_into(
                    &self.key,
                    span.clone(),
                    self.base_etag(),
                    buf.as_mut_slice(),
                )
                .await
                .map_err(|e| self.base_err(e))?;
            if n as u64 != span.end - span.start {
                return Err(self.base_shorter());
            }
            let data = buf.freeze(n);
            for r in missing {
                let piece =
                    data.slice((r.start - span.start) as usize..(r.end - span.start) as usize);
                // Kept for later reads where the staging disk has room; a full or failing
                // one costs this read a second GET below, never its bytes (a read that
                // failed with ENOSPC, a mapping that died of SIGBUS).
                if let Err(e) = self.stage(r.start, piece).await {
                    tracing::debug!("{}: bytes read not kept locally: {e:?}", self.key);
                    break;
                }
                self.local.insert(r);
            }
        }
        // Counted like any read's bytes (the budget, else the overdraft).
        let len = (end - range.start) as usize;
        let buf = self.cfg.budget.demand_buffer(len as u64).await;
        Ok(self.assemble_into(range.start..end, buf).await?.freeze(len))
    }

    /// The pieces of `range` whose current bytes are only in the base object.
    fn missing_base(&self, range: Range<u64>) -> Vec<Range<u64>> {
        self.sources(range)
            .into_iter()
            .filter(|(_, src)| *src == Source::Base)
            .map(|(r, _)| r)
            .collect()
    }

    /// Splits `range` by where its current content is. The tail holds the newest bytes of
    /// its range (a write elsewhere moves it to disk first); outside it, bytes are in the
    /// staging file, else in the base (up to its length), else zeros.
    fn sources(&self, range: Range<u64>) -> Vec<(Range<u64>, Source)> {
        let tail = self.tail.as_ref().map_or(0..0, Tail::range);
        let pieces = [
            range.start..range.end.min(tail.start).max(range.start),
            range.start.max(tail.start)..range.end.min(tail.end),
            range.start.max(tail.end).min(range.end)..range.end,
        ];
        let mut out = Vec::new();
        for (k, piece) in pieces.into_iter().enumerate() {
            if piece.is_empty() {
                continue;
            }
            if k == 1 {
                out.push((piece, Source::Tail));
                continue;
            }
            for (seg, local) in self.local.segments(piece) {
                if local {
                    out.push((seg, Source::Staging));
                } else if self.uploaded_only.intersects(&seg) {
                    out.push((seg, Source::Uploaded));
                } else {
                    let base_end = self.base_len.clamp(seg.start, seg.end);
                    for (r, src) in [
                        (seg.start..base_end, Source::Base),
                        (base_end..seg.end, Source::Zeros),
                    ] {
                        if !r.is_empty() {
                            out.push((r, src));
                        }
                    }
                }
            }
        }
        out
    }

    /// A read of the base's bytes failed: gone (another client deleted the object since
    /// this file's base was read) is a conflict, as a replaced one is (`ESTALE`, never
    /// `ENOENT` for a file that is open).
    fn base_err(&self, e: StoreError) -> FsError {
        let gone = matches!(e, StoreError::NotFound(_)) && self.base_etag().is_some();
        let errno = log_store_err(&format!("read {}", self.key), e);
        if !gone {
            return errno;
        }
        tracing::warn!(
            "{}: deleted by another client since this file was opened; the bytes it keeps of \
             that version cannot be read (ESTALE)",
            self.key
        );
        FsError::ESTALE
    }

    /// The base object came back shorter than the version it was read as: another
    /// client's (a store that checks the range before `If-Match` answers 416, read as the
    /// end of the file).
    fn base_shorter(&self) -> FsError {
        tracing::warn!(
            "{}: replaced by another client with a shorter version since this file was \
             opened; the bytes it keeps of that version cannot be read (ESTALE)",
            self.key
        );
        FsError::ESTALE
    }

    /// `range` of the base object, which must lie within `base_len`.
    async fn get_base(&self, range: Range<u64>) -> FsResult<Bytes> {
        let data = self
            .store
            .get_range(&self.key, range.clone(), self.base_etag())
            .await
            .map_err(|e| self.base_err(e))?;
        if data.len() as u64 != range.end - range.start {
            return Err(self.base_shorter());
        }
        Ok(data)
    }

    /// The current content of `range`, which must lie within the file, into `buf` (as long as
    /// `range`, its old bytes overwritten); background staging copies must be settled.
    async fn assemble_into<B>(&self, range: Range<u64>, mut buf: B) -> FsResult<B>
    where
        B: AsMut<[u8]> + Send + 'static,
    {
        for (seg, src) in self.sources(range.clone()) {
            let at = (seg.start - range.start) as usize;
            let n = (seg.end - seg.start) as usize;
            match src {
                Source::Staging => {
                    let staging = self.staging.as_ref().expect("local bytes are staged");
                    let o = self.staging_offset;
                    buf = read_into(staging, seg.start + o..seg.end + o, buf, at).await?;
                }
                Source::Tail => {
                    let t = self.tail.as_ref().expect("a tail source");
                    let from = (seg.start - t.start) as usize;
                    buf.as_mut()[at..at + n].copy_from_slice(&t.buf.as_slice()[from..from + n]);
                }
                Source::Base => {
                    // Straight into `buf` (budget memory): a body of the size of the range
                    // beside it would be memory outside the budget, per close of a rewrite.
                    let dst = &mut buf.as_mut()[at..at + n];
                    let got = self
                        .store
                        .get_range_into(&self.key, seg, self.base_etag(), dst)
                        .await
                        .map_err(|e| self.base_err(e))?;
                    if got != n {
                        return Err(self.base_shorter());
                    }
                }
                Source::Zeros => buf.as_mut()[at..at + n].fill(0),
                Source::Uploaded => {
                    // Callers recover these first; this is an upload that failed for good.
                    tracing::warn!("{}: bytes {seg:?} are only in a failed upload", self.key);
                    return Err(FsError::EIO);
                }
            }
        }
        Ok(buf)
    }

    /// Something changed since the last publish, and the file can still be published (an
    /// unlinked file never is).
    pub fn has_changes_to_publish(&self) -> bool {
        matches!(self.phase, Phase::Changed | Phase::Failed)
    }

    /// Background mode: the bytes written since the last commit, when another file's fsync
    /// may commit them along (see `Fs::commit_along`): as a delta over that commit, nothing
    /// failed since, and the file never cut shorter since (a truncate then a rewrite is
    /// never stored half done).
    pub fn along_len(&self) -> Option<u64> {
        let since = self.since_commit.as_ref()?;
        let ok = self.phase == Phase::Changed && since.keep >= since.committed;
        ok.then(|| {
            since
                .written
                .segments(0..self.size())
                .filter(|(_, w)| *w)
                .map(|(r, _)| r.end - r.start)
                .sum()
        })
    }

    /// A commit nobody waited for failed: the next fsync or close commits again and
    /// reports what it meets (a failed phase means its caller was told).
    pub fn untold_failure(&mut self) {
        if self.phase == Phase::Failed {
            self.phase = Phase::Changed;
        }
    }

    /// Something (content or metadata) now differs from the bucket.
    pub fn mark_changed(&mut self) {
        if matches!(self.phase, Phase::Clean | Phase::Failed) {
            self.phase = Phase::Changed;
        }
    }

    /// The last publish failed (and its caller was told) and nothing changed since.
    pub fn failed(&self) -> bool {
        self.phase == Phase::Failed
    }

    /// The file was unlinked, or another renamed over it: it is never published again.
    pub fn unlink(&mut self) {
        if self.phase != Phase::Retired {
            self.phase = Phase::Unlinked;
        }
    }

    pub fn is_unlinked(&self) -> bool {
        self.phase == Phase::Unlinked
    }

    /// The last writer closed and the registry dropped this state: nothing publishes it any
    /// more, so a change made to it would be lost (see `Fs::setattr`).
    pub fn retire(&mut self) {
        self.phase = Phase::Retired;
    }

    pub fn is_retired(&self) -> bool {
        self.phase == Phase::Retired
    }

    /// Whether some current byte can only be read from the base object in the store (neither
    /// written since nor fetched into the staging file). False after `O_TRUNC`.
    pub fn reads_base(&self) -> bool {
        self.base.is_some()
            && self
                .dirty
                .segments(0..self.base_len)
                .any(|(r, dirty)| !dirty && !self.local.covers(&r))
    }

    /// The base object was copied, unchanged, to `key`, where the copy has ETag `etag`; the
    /// state reads the base from there. The upload must be closed (it belongs to the old key).
    pub fn move_base(&mut self, key: ObjectKey, etag: String) {
        debug_assert!(self.stream.is_none());
        self.key = key;
        self.committed_etag = None;
        if let Some(b) = &mut self.base {
            b.etag = etag;
        }
    }

    /// The base object's metadata was replaced in place (a chmod by CopyObject), which can
    /// give it a new ETag (`new`, was `old`): the same bytes, so keep building on them.
    pub fn restamp_base(&mut self, old: &str, new: String) {
        if let Some(b) = self.base.as_mut().filter(|b| b.etag == old) {
            b.etag = new;
        }
    }

    /// Whether the file can move to another key before it is published (rename): not when
    /// some written bytes are only in its upload (their local copy failed), which belongs to
    /// `key` and cannot be read back. Publishing them would put half-written content there.
    /// The copies still running are waited for: one that fails leaves bytes there.
    pub async fn leave_key(&mut self, key: &ObjectKey) -> FsResult<()> {
        self.settle_spills().await;
        if self.uploaded_only.is_empty() {
            return Ok(());
        }
        tracing::warn!(
            "rename of {key}: some of its written bytes are only in its upload (their local \
             copy failed); close the file first"
        );
        Err(FsError::EIO)
    }

    /// The file's name moved to `key` (rename) before it was published: the open upload
    /// belonged to the old key and is aborted, so publish sends every part again (from the
    /// local copies, see [`Self::leave_key`]). `etag` is that of the copy of the base object
    /// under `key`, if the file has one.
    pub async fn move_to(&mut self, key: ObjectKey, etag: Option<String>) {
        self.since_commit = None;
        self.settle_spills().await;
        self.abort_stream().await;
        self.generations.clear();
        self.key = key;
        // The copy under `key` of what the old key held.
        self.committed_etag.clone_from(&etag);
        if let (Some(b), Some(etag)) = (&mut self.base, etag) {
            b.etag = etag;
        }
    }
}

/// `staging` opened again with `O_DIRECT`, through its `/proc/self/fd` link.
fn open_direct(staging: &File) -> Option<File> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(format!("/proc/self/fd/{}", staging.as_raw_fd()))
        .ok()
}

/// Writes a part to the staging file, bypassing the page cache when everything is aligned
/// for it and the file system takes it.
fn write_part_blocking(
    staging: &File,
    direct: Option<&File>,
    data: &[u8],
    at: u64,
) -> std::io::Result<()> {
    let aligned = (data.as_ptr() as usize).is_multiple_of(ALIGN)
        && data.len().is_multiple_of(ALIGN)
        && at.is_multiple_of(ALIGN as u64);
    if let Some(direct) = direct.filter(|_| aligned) {
        match direct.write_all_at(data, at) {
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
            done => return done,
        }
    }
    staging.write_all_at(data, at)
}

/// Writes `data` to the staging file at `offset`: in place on a FUSE thread (see
/// [`crate::inline::local_io`]; a page-cache write), else on the blocking pool. Returns how
/// many bytes the file took (the first ones, when the disk fills up midway) and the error.
async fn write_at(
    staging: &Arc<File>,
    offset: u64,
    data: Bytes,
    flush: bool,
) -> (u64, FsResult<()>) {
    let staging = staging.clone();
    let done = crate::inline::local_io(move || {
        let mut took = 0;
        while took < data.len() {
            match staging.write_at(&data[took..], offset + took as u64) {
                Ok(0) => return (took, Err(std::io::ErrorKind::WriteZero.into())),
                Ok(n) => took += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return (took, Err(e)),
            }
        }
        if flush {
            start_writeback(&staging, offset, data.len() as u64);
        }
        (took, Ok(()))
    })
    .await;
    match done {
        Some((took, r)) => (took as u64, r.map_err(io_err)),
        None => (0, Err(FsError::EIO)),
    }
}

/// Starts writing bytes `len` at `offset` of `file` to disk, without waiting for it
/// (`sync_file_range`, a hint: nothing is durable before an fsync). The fsync of a commit
/// then finds little left to write, instead of all the file at once.
fn start_writeback(file: &File, offset: u64, len: u64) {
    use std::os::fd::AsRawFd;
    // SAFETY: a valid descriptor; no memory is passed.
    unsafe {
        libc::sync_file_range(
            file.as_raw_fd(),
            offset as libc::off64_t,
            len as libc::off64_t,
            libc::SYNC_FILE_RANGE_WRITE,
        );
    }
}

/// Reads bytes `r` of the staging file into `buf` at `at`; a hole at the end of the sparse
/// file reads as zeros.
async fn read_into<B>(staging: &Arc<File>, r: Range<u64>, mut buf: B, at: usize) -> FsResult<B>
where
    B: AsMut<[u8]> + Send + 'static,
{
    let staging = staging.clone();
    crate::inline::local_io(move || {
        let dst = &mut buf.as_mut()[at..at + (r.end - r.start) as usize];
        let mut done = 0;
        while done < dst.len() {
            let n = staging.read_at(&mut dst[done..], r.start + done as u64)?;
            if n == 0 {
                dst[done..].fill(0);
                break;
            }
            done += n;
        }
        Ok::<_, std::io::Error>(buf)
    })
    .await
    .ok_or(FsError::EIO)?
    .map_err(io_err)
}

fn mtime_into(meta: &mut UserMeta, t: SystemTime) {
    let pm = crate::meta::PosixMeta {
        mtime: Some(t),
        ..Default::default()
    };
    pm.write_into(meta);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_grows_in_steps() {
        let l = PartLayout { part_size: 8 };
        assert_eq!(l.bounds(0), 0..8);
        assert_eq!(l.bounds(999), 7992..8000);
        assert_eq!(l.bounds(1000), 8000..8016);
        assert_eq!(l.index_of(7999), 999);
        assert_eq!(l.index_of(8000), 1000);
        assert_eq!(l.index_of(8015), 1000);
        assert_eq!(l.index_of(8016), 1001);
        for i in [0u64, 5, 999, 1000, 2500, 9999] {
            let b = l.bounds(i);
            assert_eq!(l.index_of(b.start), i);
            assert_eq!(l.index_of(b.end - 1), i);
        }
        assert_eq!(l.parts(20), vec![0..8, 8..16, 16..20]);
        // With 8 MiB parts, 10,000 parts cover the 5 TiB maximum object.
        let big = PartLayout { part_size: 8 << 20 };
        assert!(big.bounds(9999).end >= StoreLimits::S3.max_object);
        assert_eq!(
            big.largest_file(&StoreLimits::S3),
            StoreLimits::S3.max_object
        );
    }

    /// At `--part-size 5M`, 10,000 parts end before 5 TiB, and with parts of 5 GiB the
    /// second 1,000 would be 10 GiB each: a write past either fails at once with EFBIG,
    /// not at close after terabytes were written.
    #[test]
    fn the_largest_file_is_what_the_parts_can_hold() {
        let s3 = StoreLimits::S3;
        let small = PartLayout { part_size: 5 << 20 };
        assert_eq!(small.largest_file(&s3), small.bounds(9999).end);
        assert!(small.largest_file(&s3) < s3.max_object);
        let huge = PartLayout { part_size: 5 << 30 };
        assert_eq!(huge.largest_file(&s3), 1000 * (5 << 30));
        assert!(huge.bounds(1000).end - huge.bounds(1000).start > s3.max_part);
    }
}
