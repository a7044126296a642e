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

use crate::budget::MemoryBudget;
use crate::error::{FsError, FsResult};
use crate::files::write::PartLayout;
use crate::meta::Ino;
use crate::metrics::{inc, FsMetrics};
use bucketfs_store::{
    run_bounded, CompletedPart, HeadersFrom, ObjectStore, StoreError, Upload, Uploads, UserMeta,
    IF_ABSENT,
};
use bytes::Bytes;
use futures::future::BoxFuture;
use futures::FutureExt;
use md5::{Digest, Md5};
use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};
use tokio::sync::Notify;

const MAGIC: &[u8; 8] = b"BFSWB\x00\x00\x01";
const FOOTER: usize = 4 + 4 + 8;
/// Segments: preallocated (zeros written and fsync'd once), so a record written into one
/// needs only an fdatasync (no new name, no size or extent change to journal): a tenth of
/// the cost of a file of its own with its directory fsync.
const SEGMENT_SIZE: u64 = 64 << 20;
const SEG_MAGIC: &[u8; 8] = b"BFSWSEG1";
/// Emptied segments kept for reuse: a new nonce makes one a fresh segment at the cost of one
/// block's write, where a new file costs 64 MiB of zeros written and synced (as much again as
/// the records it will hold).
const FREE_KEPT: usize = 2;
/// The next segment is made once the one being filled holds this much: a mount that commits
/// little writes no second segment's zeros, and a quarter of a segment of records is time
/// enough to make one.
const SPARE_AT: u64 = SEGMENT_SIZE / 4;
/// How long after a failed try to make a segment (a full disk) the next waits.
const SPARE_RETRY: Duration = Duration::from_secs(1);

const REC_MAGIC: &[u8; 8] = b"BFSWREC1";
/// Records start at multiples of this (so recovery can step over a torn one).
const REC_ALIGN: u64 = 4096;
const REC_HEADER: u64 = 64;
/// Files up to this size (with their trailer) are committed as segment records; larger ones
/// as files of their own.
pub(crate) const RECORD_MAX: u64 = 4 << 20;
/// Records up to this size are written whole at their seal (see [`Slot::write_blocking`]).
const HELD_MAX: u64 = 256 << 10;
/// Upload results kept for later versions of the same files (their `If-Match`), until the
/// file system learns them (see `WriteState::commit_landed`).
const RESULTS_KEPT: usize = 200_000;

/// [`RESULTS_KEPT`]; fewer in builds with debug assertions (the tests') when
/// `BUCKETFS_TEST_RESULTS_KEPT` says so.
fn results_kept() -> usize {
    static KEPT: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *KEPT.get_or_init(|| {
        let test = cfg!(debug_assertions)
            .then(|| {
                std::env::var("BUCKETFS_TEST_RESULTS_KEPT")
                    .ok()?
                    .parse()
                    .ok()
            })
            .flatten();
        test.unwrap_or(RESULTS_KEPT)
    })
}
/// ETags of possibly landed versions an entry carries (see `Entry::landed`) at most.
const LANDED_KEPT: usize = 8;
/// Most records one entry's content spans (a whole file and deltas over it); the commit
/// after that writes the whole file again.
const PIECES_MAX: usize = 16;
/// How long a version committed by `fsync` of a file still open for writing waits before
/// it uploads (unless its last writer closes it first): the next fsync then adds a delta
/// instead of waiting for that upload, and a file fsync'd in a loop uploads at most this
/// often.
const PARK: Duration = Duration::from_secs(5);

/// Parts of one entry's multipart upload in flight at once (their buffers come from the
/// memory budget, which bounds them all together).
const PARTS_AT_ONCE: usize = 8;

/// The unit the part buffers' memory is counted in (see `WriteBack::buffers`).
const BUFFER_UNIT: u64 = 64 << 10;

/// A failed upload is tried again after this, doubling up to [`RETRY_MAX`].
const RETRY_FIRST: Duration = Duration::from_secs(10);
const RETRY_MAX: Duration = Duration::from_secs(300);
/// How long the renames a crash interrupted are tried at start before their files are
/// let go (each then finishes before its upload, as it would have).
const MOVE_FINISH_TRIES: Duration = Duration::from_secs(if cfg!(test) { 2 } else { 30 });

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
    pub fn if_match(&self) -> Option<&str> {
        match self {
            Cond::Absent => Some(IF_ABSENT),
            Cond::Match(e) => Some(e),
            Cond::Any => None,
        }
    }
}

/// The version of `key` whose headers other than the user metadata an upload under `pin`
/// keeps: the one it replaces, when it is pinned to it (a file written here first, or over
/// whatever is there, takes a new object's).
fn headers_from<'a>(key: &'a str, pin: Option<&'a str>) -> Option<HeadersFrom<'a>> {
    let etag = pin.filter(|p| *p != IF_ABSENT)?;
    Some(HeadersFrom {
        key,
        etag: Some(etag),
    })
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
    /// A commit waiting for room gets `ENOSPC` once no upload has landed (freeing room) for
    /// this long; at once when entries that never go up by themselves (conflicts,
    /// unreadable entries) leave no room.
    pub space_wait: Duration,
    /// What the directory's files are for (the store, bucket and prefix), recorded in its
    /// [`STORE_FILE`]: a directory recorded for another is refused.
    pub store: String,
}

/// The file of a write-back directory that names what its files are for (see
/// [`WriteBackConfig::store`]). Directories of versions before it have none.
pub const STORE_FILE: &str = "store";

/// The files of a write-back directory that are not entries.
fn not_an_entry(name: &std::ffi::OsStr) -> bool {
    name == "lock" || name == STORE_FILE || name == STORE_ASIDE
}

/// [`STORE_FILE`] while it is written.
const STORE_ASIDE: &str = "store.new";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    Queued,
    /// Being replaced by a commit in progress: no worker takes it.
    Held,
    Uploading,
    /// The last try failed; tried again at `next_try` (never for a conflict).
    Failed,
    /// Uploaded, its file dropped; the file system has not learnt the object yet (its
    /// callback runs): still pending for `is_pending`, so the state that shows the file
    /// is kept until it knows the new ETag.
    Landed,
}

/// What [`WriteBack::hold`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Holding {
    /// The entry is held (no upload until released or discarded); its upload was to
    /// replace what `cond` says, and it had been refused as a conflict.
    Held { cond: Cond, conflict: bool },
    /// It was uploaded: the object has this ETag (when still remembered).
    Uploaded(Option<String>),
    /// No such entry.
    Gone,
}

/// A rename in progress that moved an entry to its key: the object the rename moves from
/// `key` (ETag `etag`; none: there was none), at `at` (Unix seconds). In the entry's
/// trailer before the rename changes the bucket, so that after a crash the upload finishes
/// the rename first: the old name's object, if still that one, is deleted (see
/// [`WriteBack::rekey`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Moved {
    pub key: String,
    pub etag: Option<String>,
    pub at: u64,
}

impl Moved {
    /// A rename of the version of `key` with `etag`, last modified at `modified` (the
    /// store's time, when known): a restart deletes what is at `key` only if it has that
    /// ETag and is no newer. Unknown, the time is now plus a second (the store's times are
    /// whole seconds), which an identical version made just after the rename passes too.
    pub fn of(key: &str, etag: Option<String>, modified: Option<std::time::SystemTime>) -> Self {
        let secs = |t: std::time::SystemTime| {
            t.duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs())
        };
        let at = match modified {
            Some(t) => secs(t),
            None => secs(std::time::SystemTime::now()) + 1,
        };
        Moved {
            key: key.to_string(),
            etag,
            at,
        }
    }

    /// [`Self::of`] a version whose time is not known.
    pub fn now(key: &str, etag: Option<String>) -> Self {
        Self::of(key, etag, None)
    }
}

/// A segment file: records of committed files, one after another.
pub struct Segment {
    id: u64,
    path: PathBuf,
    file: Arc<File>,
    /// Random, in the segment's first block and every record header: file bytes that look
    /// like a record header are never taken for one.
    nonce: u64,
    /// Its fdatasyncs, shared by the writers waiting at the time.
    sync: SharedSync,
}

/// fdatasyncs of one file shared by the writers waiting at the time (blocking): a writer
/// takes a ticket once its writes are done, and any sync that starts after that covers them;
/// one leader syncs while the others wait for it. 128 closes at once cost a few syncs.
#[derive(Default)]
struct SharedSync {
    state: Mutex<SyncState>,
    done: parking_lot::Condvar,
}

#[derive(Default)]
struct SyncState {
    issued: u64,
    synced: u64,
    /// A sync failed: writes made before it may be lost, and a later sync would not say so
    /// (the kernel reports a writeback error once), whenever their writer took its ticket.
    /// So no ticket after that succeeds; new records go to another segment.
    poisoned: bool,
    running: bool,
}

impl SharedSync {
    /// Returns once a sync of `file` that started after this call has succeeded (true: this
    /// call ran it); `EIO` once any sync of it failed (see [`SyncState::poisoned`]).
    fn sync(&self, file: &File) -> std::io::Result<bool> {
        self.sync_by(|| file.sync_data())
    }

    /// [`Self::sync`] with `sync` as the file's fdatasync.
    fn sync_by(&self, sync: impl FnOnce() -> std::io::Result<()>) -> std::io::Result<bool> {
        let mut s = self.state.lock();
        s.issued += 1;
        let ticket = s.issued;
        loop {
            if s.synced >= ticket {
                return Ok(false);
            }
            if s.poisoned {
                return Err(std::io::Error::from_raw_os_error(libc::EIO));
            }
            if s.running {
                self.done.wait(&mut s);
                continue;
            }
            s.running = true;
            let upto = s.issued;
            drop(s);
            let r = sync();
            let mut s = self.state.lock();
            s.running = false;
            match &r {
                Ok(()) => s.synced = s.synced.max(upto),
                Err(_) => s.poisoned = true,
            }
            drop(s);
            self.done.notify_all();
            return r.map(|()| true);
        }
    }

    /// A sync of it failed (see [`SyncState::poisoned`]).
    fn poisoned(&self) -> bool {
        self.state.lock().poisoned
    }
}

/// Where an entry's bytes are.
#[derive(Clone)]
enum Loc {
    /// A file of its own (`SEQ.wb`): the bytes from 0, then the trailer and the footer.
    File(PathBuf),
    /// A record of a segment at `rec`; the bytes from `rec + REC_HEADER`.
    Rec { seg: Arc<Segment>, rec: u64 },
}

impl Loc {
    /// The file holding the bytes and where they start.
    fn open(&self) -> std::io::Result<(Arc<File>, u64)> {
        match self {
            Loc::File(p) => Ok((Arc::new(File::open(p)?), 0)),
            Loc::Rec { seg, rec } => Ok((seg.file.clone(), rec + REC_HEADER)),
        }
    }

    fn describe(&self) -> PathBuf {
        match self {
            Loc::File(p) => p.clone(),
            Loc::Rec { seg, rec } => PathBuf::from(format!("{}@{rec}", seg.path.display())),
        }
    }
}

/// What a delta entry changes in the entry it extends: its record holds the bytes of
/// `ranges`, one after another. A commit of a file whose last version still waits for
/// upload writes only this (see [`WriteBack::begin`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delta {
    /// The entry it extends.
    over: u64,
    /// The file's size.
    size: u64,
    /// Bytes of the extended content kept: past this, zeros unless written in `ranges`.
    keep: u64,
    ranges: Vec<Range<u64>>,
}

/// What changed in a file since its last commit, for a delta (see [`WriteBack::begin`]).
#[derive(Debug, Clone, Default)]
pub struct Changes {
    /// The smallest size the file had since.
    pub keep: u64,
    /// The byte ranges written since, in order, not overlapping.
    pub ranges: Vec<Range<u64>>,
}

impl Changes {
    fn len(&self) -> u64 {
        self.ranges.iter().map(|r| r.end - r.start).sum()
    }
}

/// One record of an entry's content: the whole file, or a delta over the pieces before it.
#[derive(Clone)]
struct Piece {
    loc: Loc,
    /// Bytes the record holds.
    len: u64,
    delta: Option<Arc<Delta>>,
}

/// An entry's content: its pieces, the whole file first, then the deltas in order.
#[derive(Clone)]
struct Content(Vec<Piece>);

impl Content {
    /// The newest piece: the entry's own record.
    fn head(&self) -> &Loc {
        &self.0.last().expect("a piece").loc
    }

    /// Bytes its records hold (what it takes in the directory).
    fn stored(&self) -> u64 {
        self.0.iter().map(|p| p.len).sum()
    }

    /// Reads `buf.len()` bytes of the file from `at` (blocking): the whole file's bytes,
    /// then each delta's, cut at what it keeps.
    fn read_at(&self, at: u64, buf: &mut [u8]) -> std::io::Result<()> {
        let end = at + buf.len() as u64;
        let base = &self.0[0];
        let (file, off) = base.loc.open()?;
        let have = base.len.clamp(at, end);
        file.read_exact_at(&mut buf[..(have - at) as usize], off + at)?;
        buf[(have - at) as usize..].fill(0);
        for p in &self.0[1..] {
            let d = p.delta.as_ref().expect("pieces after the first are deltas");
            if d.keep < end {
                buf[(d.keep.max(at) - at) as usize..].fill(0);
            }
            let mut file = None;
            let mut stored = 0;
            for r in &d.ranges {
                let (s, e) = (r.start.max(at), r.end.min(end));
                if s < e {
                    if file.is_none() {
                        file = Some(p.loc.open()?);
                    }
                    let (f, off) = file.as_ref().expect("opened");
                    let dst = &mut buf[(s - at) as usize..(e - at) as usize];
                    f.read_exact_at(dst, off + stored + (s - r.start))?;
                }
                stored += r.end - r.start;
            }
        }
        Ok(())
    }
}

/// The segment being filled, the next one, how many live records each has, and emptied
/// ones kept for reuse.
#[derive(Default)]
struct Segs {
    current: Option<(Arc<Segment>, u64)>,
    spare: Option<Arc<Segment>>,
    making: bool,
    /// When making a spare last failed (a full disk): the next try waits [`SPARE_RETRY`],
    /// as each writes up to a segment of zeros.
    failed_at: Option<Instant>,
    live: HashMap<u64, usize>,
    sealed: std::collections::HashSet<u64>,
    free: Vec<Arc<Segment>>,
    next_id: u64,
}

impl Segs {
    /// Counts a record found at start as live: its segment stays until it is dropped.
    fn hold(&mut self, loc: &Loc) {
        if let Loc::Rec { seg, .. } = loc {
            *self.live.entry(seg.id).or_default() += 1;
        }
    }

    /// A segment that takes no more records and holds no live one: kept for reuse (see
    /// [`FREE_KEPT`]), else removed.
    fn retire(&mut self, seg: Arc<Segment>) {
        self.live.remove(&seg.id);
        self.sealed.remove(&seg.id);
        if self.free.iter().any(|f| f.id == seg.id) {
            // Kept already: its file is the one kept.
            debug_assert!(false, "segment {} retired twice", seg.id);
        } else if self.free.len() < FREE_KEPT {
            self.free.push(seg);
        } else {
            let _ = std::fs::remove_file(&seg.path);
        }
    }

    /// An emptied segment nothing else refers to: no entry, reader or staging file (an
    /// open file's bytes may be read from a record after its upload) can see its bytes
    /// change when it is reused.
    fn take_free(&mut self) -> Option<Segment> {
        let i = self
            .free
            .iter()
            .position(|s| Arc::strong_count(s) == 1 && Arc::strong_count(&s.file) == 1)?;
        Arc::try_unwrap(self.free.swap_remove(i)).ok()
    }
}

struct Entry {
    key: String,
    /// The file's size.
    size: u64,
    meta: UserMeta,
    cond: Cond,
    content: Content,
    /// The inode whose file this is (0: none; recovered at start and not adopted).
    ino: Ino,
    status: Status,
    error: Option<String>,
    conflict: bool,
    tries: u32,
    next_try: Option<Instant>,
    /// Not uploaded before this.
    not_before: Instant,
    /// Committed by an fsync of a file still open for writing: not in the queue until this
    /// time or its last writer's close (see [`PARK`]).
    parked: Option<Instant>,
    /// A rename a crash interrupted, finished before the upload; or, while `renaming`, the
    /// move of the rename under way that holds the entry (see [`WriteBack::rekey`]).
    moving: Option<Moved>,
    renaming: bool,
    /// ETags of versions this one replaced whose upload failed and may have landed (the
    /// answer lost): found at the key, they are this mount's, not another client's.
    landed: Vec<String>,
    /// Parts of it already sent (see [`EarlyParts`]); taken by its first upload try.
    early: Option<EarlyParts>,
}

/// A multipart upload a file's parts went into while it was written (each as soon as it
/// was full, while an upload slot was free), handed to the entry its close committed: the
/// entry's upload completes it instead of sending those parts again, so a big file is
/// mostly in the bucket by the time its close returns. Dropped unused (the entry replaced,
/// renamed or removed first, its metadata not the upload's, a crash), it aborts itself.
pub struct EarlyParts {
    pub upload: Upload,
    /// The metadata the upload was created with.
    pub meta: UserMeta,
    /// The ETag of the version whose other headers it was given.
    pub headers_of: Option<String>,
    /// By part number: whether the part's bytes are still the file's (false: written
    /// again since, so sent again, once this request has ended), and its request (the
    /// part's ETag; None: it failed).
    pub parts: BTreeMap<u32, (bool, BoxFuture<'static, Option<String>>)>,
}

/// Why an upload did not land.
enum UploadErr {
    /// Refused: the error, and whether it is a conflict.
    Refused(String, bool),
    /// The object it was to replace is gone.
    Gone,
    /// The key holds a version this mount uploaded before (its ETag; see `Entry::landed`).
    Ours(String),
}
use UploadErr::{Gone, Refused};

/// An upload a worker took.
struct Job {
    seq: u64,
    key: String,
    size: u64,
    meta: UserMeta,
    cond: Cond,
    content: Content,
    ino: Ino,
    moving: Option<Moved>,
    landed: Vec<String>,
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

/// An entry a previous daemon committed, for the file system to take over (see
/// [`WriteBack::adopt`]): the file's bytes are `size` bytes of `file` from `offset`.
pub struct Orphan {
    pub seq: u64,
    pub key: String,
    pub size: u64,
    pub meta: UserMeta,
    pub cond: Cond,
    pub file: Arc<File>,
    pub offset: u64,
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
    segs: Segs,
    /// The entry that replaced each entry (a later commit, a rename), for fsync's wait.
    successor: HashMap<u64, u64>,
    successor_order: VecDeque<u64>,
    /// Files recovery could not read (path, error): kept, never removed, listed.
    unreadable: Vec<(PathBuf, String)>,
    /// Entries recovered at start that wait for [`WriteBack::adopt`] before they upload.
    unadopted: Vec<u64>,
    /// Entries let go whose drop from the directory failed, tried again (see
    /// [`WriteBack::drop_or_later`]): the records left to drop, in order.
    undropped: Vec<(Vec<Loc>, String, String)>,
    /// Commits waiting for room, first come first served (see [`WriteBack::room`]).
    room_queue: VecDeque<u64>,
    next_ticket: u64,
    /// When room was last freed (an upload landed, an entry removed).
    freed_at: Option<Instant>,
    /// When a commit first found no room (a free since then ends it): the commits after it
    /// wait only what is left of its `space_wait` (each waited a whole one while the store
    /// was down).
    full_since: Option<Instant>,
    /// When a full directory was last logged.
    full_logged: Option<Instant>,
    /// When uploads around a full directory were last logged ([`WriteBack::log_direct`]).
    direct_logged: Option<Instant>,
    /// Keys being uploaded directly by closes ([`WriteBack::direct_cond`]).
    direct: Vec<String>,
    /// Key prefixes of directories being renamed: entries below are not uploaded.
    paused: Vec<String>,
}

impl Inner {
    /// Parked entry `seq` joins the queue, due at `now` (at the back: every entry before it
    /// was due earlier).
    fn unpark(&mut self, seq: u64, now: Instant) {
        if let Some(e) = self.entries.get_mut(&seq).filter(|e| e.parked.is_some()) {
            e.parked = None;
            e.not_before = e.not_before.min(now);
            if e.status == Status::Queued {
                self.ready.push_back(seq);
            }
        }
    }

    /// Entry `seq` goes up next (a close waits for it, see [`WriteBack::direct_cond`]):
    /// failed (not a conflict), tried again now; then as [`Self::due_now`].
    fn expedite(&mut self, seq: u64) {
        if let Some(e) = self.entries.get_mut(&seq) {
            if e.status == Status::Failed && !e.conflict {
                e.status = Status::Queued;
                e.next_try = None;
            }
        }
        self.due_now(seq);
    }

    /// Queued entry `seq` goes up next: due now, first in the queue (which is in order of
    /// the entries' times).
    fn due_now(&mut self, seq: u64) {
        let now = Instant::now();
        self.unpark(seq, now);
        match self.entries.get_mut(&seq) {
            Some(e) if e.status == Status::Queued => e.not_before = now,
            _ => return,
        }
        self.ready.retain(|s| *s != seq);
        self.ready.push_front(seq);
    }

    /// Bytes that no upload will free by itself: conflicts.
    fn stuck_bytes(&self) -> u64 {
        self.entries
            .values()
            .filter(|e| e.conflict && e.status == Status::Failed)
            .map(|e| e.content.stored())
            .sum()
    }
}

pub struct WriteBack {
    cfg: WriteBackConfig,
    store: Arc<dyn ObjectStore>,
    uploads: Arc<Uploads>,
    /// Parts of a multipart upload: 10,000 of them reach the largest object.
    layout: PartLayout,
    /// Part buffers come from here (uploads wait for memory like writers do); None in tests
    /// and for what a background mount left to a sync one.
    budget: Option<Arc<MemoryBudget>>,
    metrics: Arc<FsMetrics>,
    inner: Mutex<Inner>,
    /// Work for the workers.
    work: Arc<Notify>,
    /// An entry finished (uploaded, failed, removed) or room was freed.
    changed: Notify,
    dir_sync: DirSync,
    /// The memory of the part buffers the uploads hold at once, all workers together, in
    /// [`BUFFER_UNIT`]s: a part per worker, but never more than a quarter of the memory
    /// budget, so that the parts one entry sends at once never take more than one part per
    /// worker would, and commits and reads, which wait for the budget too, always find a
    /// quarter of it free of what a stalled store holds: writers' parts sent early may hold
    /// half until the store answers (32 workers of 8 MiB parts took all of 256M; with half
    /// for these buffers, early parts took the rest).
    buffers: tokio::sync::Semaphore,
    /// All of [`Self::buffers`]' units.
    buffer_units: u32,
    dir_file: File,
    on_uploaded: Mutex<Option<Arc<OnUploaded>>>,
    /// Itself, for the tasks it starts.
    me: Mutex<Option<Weak<WriteBack>>>,
    /// Held for the daemon's life: one mount per directory.
    _lock: File,
}

/// A commit's place in the queue for room; it leaves the queue when dropped.
struct RoomTicket<'a> {
    wb: &'a WriteBack,
    ticket: u64,
}

impl Drop for RoomTicket<'_> {
    fn drop(&mut self) {
        self.wb
            .inner
            .lock()
            .room_queue
            .retain(|t| *t != self.ticket);
        self.wb.changed.notify_waiters();
    }
}

/// Entries below a directory being renamed wait while this lives (see
/// [`WriteBack::pause_below`]).
pub struct Paused {
    wb: Arc<WriteBack>,
    prefix: String,
}

impl Drop for Paused {
    fn drop(&mut self) {
        {
            let mut inner = self.wb.inner.lock();
            if let Some(i) = inner.paused.iter().position(|p| *p == self.prefix) {
                inner.paused.swap_remove(i);
            }
        }
        self.wb.work.notify_waiters();
        self.wb.changed.notify_waiters();
    }
}

/// A close uploading its file directly (see [`WriteBack::direct_cond`]): a directory rename
/// above waits for it to end.
pub struct DirectUpload {
    wb: Arc<WriteBack>,
    key: String,
}

impl Drop for DirectUpload {
    fn drop(&mut self) {
        {
            let mut inner = self.wb.inner.lock();
            if let Some(i) = inner.direct.iter().position(|k| *k == self.key) {
                inner.direct.swap_remove(i);
            }
        }
        self.wb.changed.notify_waiters();
    }
}

/// A commit in progress: the entry file being written.
pub struct Slot {
    seq: u64,
    key: String,
    /// Bytes the record holds.
    size: u64,
    /// A delta over the entry it replaces (`replaces`), else the whole file.
    delta: Option<Arc<Delta>>,
    meta: UserMeta,
    cond: Cond,
    replaces: Option<u64>,
    /// The object a rename moved to this entry's key, deleted from its old name before the
    /// upload (see [`WriteBack::rekey`]).
    from: Option<Moved>,
    /// A rename's entry: stays held by it (else `from` is a successor's, carried over).
    rename_holds: bool,
    landed: Vec<String>,
    loc: Loc,
    file: Arc<File>,
    /// Where the bytes start in `file`.
    base: u64,
    trailer: Vec<u8>,
    crc: crc32fast::Hasher,
    written: u64,
    /// A small record's bytes, written whole with its header and trailer at its seal (see
    /// [`Slot::write_blocking`]).
    held: Vec<u8>,
    early: Option<EarlyParts>,
    /// The entry's file is a file the caller wrote (see [`Slot::adopt`]), linked here: the
    /// seal reads its bytes for the CRC instead of writing them, then renames this link over
    /// the entry's name.
    adopting: Option<PathBuf>,
    /// Gives back the room and the replaced entry if the slot is dropped unsettled.
    wb: Weak<WriteBack>,
    /// Committed or abandoned: its drop changes nothing.
    settled: bool,
}

impl Drop for Slot {
    /// A caller that panicked, or whose future was dropped, between begin and commit: the
    /// entry this one would replace goes up again and its key's next commit does not wait
    /// for it for good (it waited forever for the held entry).
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        if let Some(wb) = self.wb.upgrade() {
            wb.forget_loc(&self.loc);
            wb.unhold(self.replaces, self.size);
        }
    }
}

impl Slot {
    /// Appends `data` (the bytes must come in order, from 0 to the size).
    pub async fn write(&mut self, data: Bytes) -> FsResult<()> {
        self.crc.update(&data);
        let (file, at) = (self.file.clone(), self.base + self.written);
        self.written += data.len() as u64;
        tokio::task::spawn_blocking(move || file.write_all_at(&data, at))
            .await
            .map_err(|_| FsError::EIO)?
            .map_err(wb_io)
    }

    /// The file holding the bytes written, and where they start in it.
    pub fn file(&self) -> (Arc<File>, u64) {
        (self.file.clone(), self.base)
    }

    /// Appends `data` (blocking; see [`Self::write`]). A small record keeps its bytes until
    /// its seal writes it whole pages at a time: a write of part of a page the kernel does
    /// not have cached reads it from disk first (a record does not start its page's bytes,
    /// its header does).
    pub fn write_blocking(&mut self, data: &[u8]) -> std::io::Result<()> {
        self.crc.update(data);
        let small = REC_HEADER + self.size + self.trailer.len() as u64 + 4 <= HELD_MAX;
        if matches!(self.loc, Loc::Rec { .. }) && small && self.held.len() as u64 == self.written {
            self.held.extend_from_slice(data);
        } else {
            self.file.write_all_at(data, self.base + self.written)?;
        }
        self.written += data.len() as u64;
        Ok(())
    }

    /// Makes the bytes written durable as an entry (blocking): the trailer, then a record's
    /// header and an fdatasync, or a file's footer and fsync (its directory is the
    /// caller's). Fails (`EIO`) unless every byte was written. True when this call ran a
    /// sync (a record's may be covered by another commit's).
    fn seal(&mut self) -> std::io::Result<bool> {
        let r = self.seal_bytes();
        if r.is_err() {
            if let Some(link) = self.adopting.take() {
                let _ = std::fs::remove_file(link);
            }
        }
        r
    }

    /// [`Self::seal`], leaving an adopted file's link to the caller when it fails.
    fn seal_bytes(&mut self) -> std::io::Result<bool> {
        if self.adopting.is_some() && self.written == 0 {
            let mut buf = vec![0u8; 1 << 20];
            while self.written < self.size {
                let n = (self.size - self.written).min(buf.len() as u64) as usize;
                self.file.read_exact_at(&mut buf[..n], self.written)?;
                self.crc.update(&buf[..n]);
                self.written += n as u64;
            }
        }
        if self.written != self.size {
            return Err(std::io::Error::from_raw_os_error(libc::EIO));
        }
        self.crc.update(&self.trailer);
        let crc = self.crc.clone().finalize();
        let mut tail = self.trailer.clone();
        let at = self.base + self.written;
        let header = match &self.loc {
            Loc::File(_) => {
                tail.extend_from_slice(&((self.trailer.len() as u32).to_le_bytes()));
                tail.extend_from_slice(&crc.to_le_bytes());
                tail.extend_from_slice(MAGIC);
                None
            }
            Loc::Rec { seg, rec } => {
                tail.extend_from_slice(&crc.to_le_bytes());
                let tlen = self.trailer.len() as u32;
                let h = record_header(seg.nonce, self.seq, self.size, tlen);
                Some((h, *rec, seg.clone()))
            }
        };
        match header {
            // All of it at once, to the end of its last page (the record's own): the
            // record's CRC, not the order of the writes, tells a torn one.
            Some((h, rec, seg)) if self.held.len() as u64 == self.written => {
                let mut whole = Vec::with_capacity(h.len() + self.held.len() + tail.len());
                whole.extend_from_slice(&h);
                whole.append(&mut self.held);
                whole.extend_from_slice(&tail);
                whole.resize(
                    (whole.len() as u64).div_ceil(REC_ALIGN) as usize * REC_ALIGN as usize,
                    0,
                );
                self.file.write_all_at(&whole, rec)?;
                seg.sync.sync(&self.file)
            }
            Some((h, rec, seg)) => {
                self.file.write_all_at(&tail, at)?;
                self.file.write_all_at(&h, rec)?;
                seg.sync.sync(&self.file)
            }
            None => {
                self.file.write_all_at(&tail, at)?;
                if self.adopting.is_some() {
                    // The writer's file may be longer (a shrink).
                    self.file.set_len(at + tail.len() as u64)?;
                }
                self.file.sync_all()?;
                if let (Some(link), Loc::File(path)) = (&self.adopting, &self.loc) {
                    crate::testpoint::reached_blocking("writeback.adopt");
                    std::fs::rename(link, path)?;
                }
                Ok(true)
            }
        }
    }

    /// Takes `file`, which holds the version's bytes from 0 (and was made by
    /// [`WriteBack::unnamed_file`]), as the entry's file instead of writing them again. It
    /// is linked as `SEQ.adopt` now, and the seal renames that over the entry's name once
    /// the file is whole and synced: the entry's name never holds a file that is not (a
    /// crash before leaves the link, which the next start removes as not an entry). False,
    /// and nothing changed, when the slot is not a file of its own or the link fails
    /// (another file system, a file made otherwise): write the bytes.
    pub fn adopt(&mut self, file: &Arc<File>) -> bool {
        use std::os::fd::AsRawFd;
        use std::os::unix::ffi::OsStrExt;
        let Loc::File(path) = &self.loc else {
            return false;
        };
        if !self.may_adopt() || self.adopting.is_some() {
            return false;
        }
        let link = path.with_extension("adopt");
        let c = |p: &Path| std::ffi::CString::new(p.as_os_str().as_bytes()).ok();
        let proc = PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()));
        let (Some(src), Some(dst)) = (c(&proc), c(&link)) else {
            return false;
        };
        // SAFETY: two NUL-terminated paths.
        let rc = unsafe {
            libc::linkat(
                libc::AT_FDCWD,
                src.as_ptr(),
                libc::AT_FDCWD,
                dst.as_ptr(),
                libc::AT_SYMLINK_FOLLOW,
            )
        };
        if rc != 0 {
            return false;
        }
        self.file = file.clone();
        self.adopting = Some(link);
        true
    }

    /// Whether [`Self::adopt`] may take a file: a whole version in a file of its own,
    /// nothing written yet.
    pub fn may_adopt(&self) -> bool {
        matches!(self.loc, Loc::File(_)) && self.written == 0 && self.delta.is_none()
    }

    /// Parts of this version sent while it was written: its upload completes them.
    pub fn attach_early(&mut self, early: EarlyParts) {
        self.early = Some(early);
    }

    /// Whether this commit is a delta: only the bytes of the changes it was begun with
    /// are written, in order.
    pub fn is_delta(&self) -> bool {
        self.delta.is_some()
    }

    /// The file's size this commit stores.
    fn file_size(&self) -> u64 {
        self.delta.as_ref().map_or(self.size, |d| d.size)
    }
}

/// How long a mount waits for a write-back directory's lock: the daemon of a mount just
/// unmounted holds it until it has stored what it was given, after the unmount returned
/// (a `umount && mount` was refused).
const LOCK_WAIT: Duration = Duration::from_secs(10);

/// Takes write-back directory `dir`'s lock (held while the file is open).
fn lock_dir(dir: &Path) -> Result<File, String> {
    lock_dir_within(dir, LOCK_WAIT)
}

/// [`lock_dir`], waiting `wait` at most for the process that holds it.
fn lock_dir_within(dir: &Path, wait: Duration) -> Result<File, String> {
    use std::os::fd::AsRawFd;
    let path = dir.join("lock");
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .mode(0o600)
        .open(&path)
        .map_err(|e| format!("write-back directory {}: {e}", dir.display()))?;
    let start = Instant::now();
    // SAFETY: flock on a descriptor we own.
    while unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        if start.elapsed() >= wait {
            let holder = std::fs::read_to_string(&path)
                .ok()
                .and_then(|s| s.trim().parse::<u32>().ok())
                .map_or(String::new(), |pid| format!(" (pid {pid})"));
            return Err(format!(
                "write-back directory {} is in use by another bucketfs{holder} of the same \
                 bucket and state directory: one unmounted a moment ago exits once it has \
                 stored the files it was given (`bucketfs pending` lists them while it runs); \
                 mount again then",
                dir.display()
            ));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    // Who holds it, for the message of a mount that finds it held.
    let _ = lock.set_len(0);
    let _ = lock.write_all_at(format!("{}\n", std::process::id()).as_bytes(), 0);
    Ok(lock)
}

/// Records `store` in write-back directory `dir` (see [`STORE_FILE`]) if it records none
/// (new, or made by an earlier version); refuses it if it records another.
fn record_store(dir: &Path, store: &str) -> Result<(), String> {
    let path = dir.join(STORE_FILE);
    let err = |e: std::io::Error| format!("write-back directory {}: {e}", dir.display());
    match std::fs::read_to_string(&path) {
        Ok(r) if r == store => return Ok(()),
        Ok(r) => {
            return Err(format!(
                "write-back directory {} holds files for {r:?}, not for {store:?}",
                dir.display()
            ))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(err(e)),
    }
    // Whole or absent after a crash: written aside, synced, renamed in, the rename synced.
    let aside = dir.join(STORE_ASIDE);
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .write(true)
            .mode(0o600)
            .open(&aside)?;
        std::io::Write::write_all(&mut f, store.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&aside, &path)?;
        File::open(dir)?.sync_all()
    };
    write().map_err(err)
}

fn wb_io(e: std::io::Error) -> FsError {
    match e.raw_os_error() {
        // Said by the close that uploads instead, at most every 10 s (`log_direct`).
        Some(libc::ENOSPC | libc::EDQUOT) => tracing::debug!("write-back directory: {e}"),
        _ => tracing::warn!("write-back directory: {e}"),
    }
    FsError::from(e)
}

impl WriteBack {
    /// Opens (creating, mode 0700) the directory, takes its lock, and queues every entry a
    /// previous daemon acknowledged; removes those it never did. Returns how many it queued.
    pub fn open(
        cfg: WriteBackConfig,
        store: Arc<dyn ObjectStore>,
        uploads: Arc<Uploads>,
        part_size: u64,
        budget: Option<Arc<MemoryBudget>>,
        metrics: Arc<FsMetrics>,
    ) -> Result<(Arc<Self>, usize), String> {
        Self::open_for(cfg, store, uploads, (part_size, budget), metrics, true)
    }

    /// [`Self::open`]; `commits`: segments are prepared for new commits.
    fn open_for(
        cfg: WriteBackConfig,
        store: Arc<dyn ObjectStore>,
        uploads: Arc<Uploads>,
        (part_size, budget): (u64, Option<Arc<MemoryBudget>>),
        metrics: Arc<FsMetrics>,
        commits: bool,
    ) -> Result<(Arc<Self>, usize), String> {
        use std::os::unix::fs::DirBuilderExt;
        let dir = &cfg.dir;
        let err = |e: std::io::Error| format!("write-back directory {}: {e}", dir.display());
        // The directories made here are fsync'd into their parents: a commit's fsyncs cover
        // the entry and the directory, not a directory that a power loss could still undo.
        let mut made = Vec::new();
        let mut p = dir.as_path();
        while !p.exists() {
            made.push(p.to_path_buf());
            match p.parent() {
                Some(q) => p = q,
                None => break,
            }
        }
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(err)?;
        for d in made.iter().rev() {
            if let Some(parent) = d.parent() {
                File::open(parent).and_then(|f| f.sync_all()).map_err(err)?;
            }
        }
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(err)?;
        }
        let lock = lock_dir(dir)?;
        record_store(dir, &cfg.store)?;
        let dir_file = File::open(dir).map_err(err)?;
        let mut inner = Inner::default();
        let Recovered {
            entries: found,
            segments,
            unreadable,
            damaged,
        } = recover(dir).map_err(err)?;
        // A segment with a part that could not be read is never removed.
        for &id in &damaged {
            *inner.segs.live.entry(id).or_default() += 1;
            inner.segs.next_id = inner.segs.next_id.max(id + 1);
        }
        inner.unreadable = unreadable;
        let replaced: std::collections::HashSet<u64> =
            found.values().filter_map(|(t, _)| t.replaces).collect();
        let extended: std::collections::HashSet<u64> = found
            .values()
            .filter_map(|(t, _)| t.delta.as_ref().map(|d| d.over))
            .collect();
        let max_seq = found.keys().next_back().copied().unwrap_or(0);
        let heads: Vec<u64> = found
            .keys()
            .filter(|s| !extended.contains(s))
            .copied()
            .collect();
        let mut found = found;
        // What recovery drops is made durable before anything uploads (below): a power loss
        // after an upload would bring back a replaced entry with nothing replacing it.
        let dropped = std::cell::Cell::new(false);
        let drop_loc = |l: &Loc| {
            drop_loc_blocking(l);
            dropped.set(true);
        };
        // While a part of the directory cannot be read, nothing found is uploaded: a delta
        // in that part may extend any entry here (uploading that entry would put an older
        // version in the bucket and lose the delta), or be the base a delta found here needs.
        let unread = !damaged.is_empty() || !inner.unreadable.is_empty();
        // Newest first: of two deltas over one entry (one whose commit failed after its
        // record reached the disk), the later, acknowledged one takes it.
        for seq in heads.into_iter().rev() {
            // Its records, following each delta to the entry it extends; oldest first.
            let mut chain = Vec::new();
            let mut next = Some(seq);
            let mut broken = false;
            while let Some(s) = next {
                let Some((t, loc)) = found.remove(&s) else {
                    broken = true;
                    break;
                };
                next = t.delta.as_ref().map(|d| d.over);
                broken = next.is_some_and(|o| o >= s);
                chain.push((t, loc));
                if broken {
                    break;
                }
            }
            chain.reverse();
            if replaced.contains(&seq) {
                chain.iter().for_each(|(_, l)| drop_loc(l));
                continue;
            }
            if broken || unread {
                let head = chain.last().expect("the head").1.describe();
                if !unread {
                    // Records are dropped oldest first (after an upload, an unlink): the
                    // rest of one a crash stopped.
                    tracing::warn!(
                        "write-back directory: removing {} (left of an entry being dropped)",
                        head.display()
                    );
                    chain.iter().for_each(|(_, l)| drop_loc(l));
                } else {
                    chain.iter().for_each(|(_, l)| inner.segs.hold(l));
                    let e = "kept while a part of the write-back directory cannot be read";
                    tracing::error!(
                        "write-back directory: {}: {e}; kept, not uploaded",
                        head.display()
                    );
                    inner.unreadable.push((head, e.to_string()));
                }
                continue;
            }
            let t = chain.last().expect("the head").0.clone();
            let content = Content(
                chain
                    .into_iter()
                    .map(|(t, loc)| Piece {
                        loc,
                        len: t.size,
                        delta: t.delta.map(Arc::new),
                    })
                    .collect(),
            );
            if inner.by_key.contains_key(&t.key) {
                // Two of one key (cannot happen): the later one, met first, is the file.
                content.0.iter().for_each(|p| drop_loc(&p.loc));
                continue;
            }
            inner.by_key.insert(t.key.clone(), seq);
            content.0.iter().for_each(|p| inner.segs.hold(&p.loc));
            inner.bytes += content.stored();
            inner.unadopted.push(seq);
            inner.entries.insert(
                seq,
                Entry {
                    key: t.key,
                    size: t.delta.as_ref().map_or(t.size, |d| d.size),
                    meta: t.meta,
                    cond: t.cond,
                    content,
                    ino: 0,
                    status: Status::Queued,
                    error: None,
                    conflict: false,
                    tries: 0,
                    next_try: None,
                    not_before: Instant::now(),
                    parked: None,
                    moving: t.from,
                    renaming: false,
                    landed: t.landed,
                    early: None,
                },
            );
        }
        // Records no head leads to (what a crash left of a dropped entry).
        for (_, (_, loc)) in found {
            drop_loc(&loc);
        }
        // Old segments take no more records; they go once their last one is uploaded.
        for seg in segments {
            inner.segs.next_id = inner.segs.next_id.max(seg.id + 1);
            if inner.segs.live.get(&seg.id).copied().unwrap_or(0) == 0 {
                // Not kept for reuse: the headers dropped above are not synced yet.
                let _ = std::fs::remove_file(&seg.path);
                dropped.set(true);
            } else {
                inner.segs.sealed.insert(seg.id);
                if dropped.get() {
                    if let Err(e) = File::open(&seg.path).and_then(|f| f.sync_data()) {
                        tracing::error!("write-back directory: {}: {e}", seg.path.display());
                    }
                }
            }
        }
        if dropped.get() {
            if let Err(e) = dir_file.sync_all() {
                tracing::error!("write-back directory {}: {e}", dir.display());
            }
        }
        inner.unadopted.retain(|s| inner.entries.contains_key(s));
        inner.next_seq = max_seq.max(now_seq()) + 1;
        let n = inner.entries.len();
        let most = (cfg.concurrency.max(1) as u64 * part_size)
            .min(budget.as_ref().map_or(u64::MAX, |b| b.total() / 4))
            .max(part_size);
        let buffer_units = most.div_ceil(BUFFER_UNIT).min(u32::MAX as u64 / 2) as u32;
        let buffers = tokio::sync::Semaphore::new(buffer_units as usize);
        let wb = Arc::new(Self {
            cfg,
            store,
            uploads,
            layout: PartLayout { part_size },
            budget,
            metrics,
            inner: Mutex::new(inner),
            work: Arc::new(Notify::new()),
            changed: Notify::new(),
            dir_sync: DirSync::default(),
            buffers,
            buffer_units,
            dir_file,
            on_uploaded: Mutex::new(None),
            me: Mutex::new(None),
            _lock: lock,
        });
        *wb.me.lock() = Some(Arc::downgrade(&wb));
        wb.update_gauges();
        for _ in 0..wb.cfg.concurrency.max(1) {
            let w = Arc::downgrade(&wb);
            tokio::spawn(worker(w, wb.work.clone()));
        }
        let w = Arc::downgrade(&wb);
        tokio::spawn(retry_loop(w));
        if commits {
            wb.make_spare();
        }
        Ok((wb, n))
    }

    /// Hands each entry recovered at start to `take`, which makes it a file of this daemon
    /// (an inode with its write state, as a commit of this daemon's leaves it) and returns
    /// the inode (0: none); then queues them. Until then they do not upload, so none lands
    /// before its file can learn it.
    pub fn adopt(&self, mut take: impl FnMut(Orphan) -> Ino) {
        let orphans: Vec<(u64, String, u64, UserMeta, Cond, Content)> = {
            let mut inner = self.inner.lock();
            let seqs = std::mem::take(&mut inner.unadopted);
            seqs.iter()
                .filter_map(|s| {
                    let e = inner.entries.get(s)?;
                    Some((
                        *s,
                        e.key.clone(),
                        e.size,
                        e.meta.clone(),
                        e.cond.clone(),
                        e.content.clone(),
                    ))
                })
                .collect()
        };
        let mut inos = Vec::new();
        for (seq, key, size, meta, cond, content) in orphans {
            let ino = match self.whole_file(&content, size) {
                Ok((file, offset)) => take(Orphan {
                    seq,
                    key,
                    size,
                    meta,
                    cond,
                    file,
                    offset,
                }),
                // Its upload says so (and keeps it).
                Err(_) => 0,
            };
            inos.push((seq, ino));
        }
        let mut inner = self.inner.lock();
        let mut moves = Vec::new();
        for (seq, ino) in inos {
            if let Some(e) = inner.entries.get_mut(&seq) {
                e.ino = ino;
                match e.moving.clone() {
                    // Held until its rename is finished: replaced, moved or removed first,
                    // the entry would take with it the only record of the old name to delete.
                    Some(m) => {
                        e.status = Status::Held;
                        moves.push((seq, m));
                    }
                    None => inner.ready.push_back(seq),
                }
            }
        }
        drop(inner);
        self.work.notify_waiters();
        if moves.is_empty() {
            return;
        }
        let me = self.me.lock().clone().unwrap_or_default();
        let until = tokio::time::Instant::now() + MOVE_FINISH_TRIES;
        for (seq, m) in moves {
            let me = me.clone();
            tokio::spawn(async move {
                loop {
                    let Some(wb) = me.upgrade() else { return };
                    let tried = tokio::time::timeout_at(until, wb.finish_move(seq, &m)).await;
                    let e = match tried {
                        Ok(Ok(())) => break wb.release(seq),
                        Ok(Err(e)) => e,
                        Err(_) => "no answer in time".to_string(),
                    };
                    if tokio::time::Instant::now() >= until {
                        // Its upload tries again first.
                        tracing::warn!("{}: finishing a rename a crash interrupted: {e}", m.key);
                        break wb.release(seq);
                    }
                    drop(wb);
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            });
        }
    }

    /// A file holding `content` (`size` bytes) from the offset returned: a whole file's
    /// record, or for deltas a copy put together (blocking) in an unnamed file.
    fn whole_file(&self, content: &Content, size: u64) -> std::io::Result<(Arc<File>, u64)> {
        if content.0.len() == 1 {
            return content.head().open();
        }
        let out = tempfile::tempfile_in(&self.cfg.dir)?;
        let mut buf = vec![0u8; 1 << 20];
        let mut at = 0;
        while at < size {
            let n = (size - at).min(buf.len() as u64) as usize;
            content.read_at(at, &mut buf[..n])?;
            out.write_all_at(&buf[..n], at)?;
            at += n as u64;
        }
        Ok((Arc::new(out), 0))
    }

    /// A mount without `--upload background`: uploads the files a background mount of the
    /// same bucket left in `cfg.dir` (it exists and holds entries), before the mount serves,
    /// calling `progress` every `every`. Returns how many there were and how many are left
    /// (failed, unreadable), or why the directory could not be used.
    pub async fn upload_left_behind(
        cfg: WriteBackConfig,
        store: Arc<dyn ObjectStore>,
        part_size: u64,
        every: Duration,
        progress: impl FnMut(usize, u64),
    ) -> Result<(usize, usize), String> {
        let uploads = Uploads::new(store.clone());
        let (wb, _) = Self::open_for(
            cfg,
            store,
            uploads,
            (part_size, None),
            Arc::default(),
            false,
        )?;
        wb.adopt(|_| 0);
        let (found, _, _) = wb.counts();
        if found > 0 {
            wb.drain(every, progress).await;
        }
        let (left, _, _) = wb.counts();
        Ok((found, left))
    }

    /// Whether `dir` holds anything a background mount left (entries, segments).
    pub fn holds_entries(dir: &Path) -> bool {
        std::fs::read_dir(dir)
            .is_ok_and(|mut d| d.any(|e| e.is_ok_and(|e| !not_an_entry(&e.file_name()))))
    }

    /// Moves write-back directory `from`, which a version before [`STORE_FILE`] left and
    /// which may be this mount's under another name (see the caller), to `to`: only when
    /// `from` holds entries and records no store, no mount holds either, and `to` holds no
    /// entries. Returns whether it moved it; an error says why it could not (the mount goes
    /// on without it).
    pub fn take_over(from: &Path, to: &Path) -> Result<bool, String> {
        if from.join(STORE_FILE).exists() {
            return Ok(false);
        }
        Self::move_dir(from, to)
    }

    /// Moves write-back directory `from`, recorded for this very store under another
    /// spelling of its endpoint (the caller checked: `http://localhost:9000` and
    /// `http://127.0.0.1:9000/` are one server), to `to`, as [`Self::take_over`] does; its
    /// record goes, and the mount records its own.
    pub fn take_over_spelling(from: &Path, to: &Path) -> Result<bool, String> {
        Self::move_dir(from, to)
    }

    /// [`Self::take_over`] without its check of the record, which goes with the move.
    fn move_dir(from: &Path, to: &Path) -> Result<bool, String> {
        if !Self::holds_entries(from) {
            return Ok(false);
        }
        let err = |e: std::io::Error| format!("write-back directory {}: {e}", from.display());
        if Self::holds_entries(to) {
            return Err(format!(
                "write-back directory {} holds files an earlier bucketfs acknowledged, and so \
                 does {}: the first stays as it is",
                from.display(),
                to.display()
            ));
        }
        let _from_lock = lock_dir(from)?;
        let _to_lock = match to.exists() {
            true => {
                let l = lock_dir(to)?;
                for name in ["lock", STORE_FILE, STORE_ASIDE] {
                    match std::fs::remove_file(to.join(name)) {
                        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(err(e)),
                        _ => {}
                    }
                }
                std::fs::remove_dir(to).map_err(err)?;
                Some(l)
            }
            false => None,
        };
        std::fs::rename(from, to).map_err(err)?;
        if let Some(parent) = to.parent() {
            File::open(parent).and_then(|f| f.sync_all()).map_err(err)?;
        }
        // Its record of the other spelling goes once it is here (before, a failed move would
        // leave it with none); one that stays makes the mount refuse it, saying why.
        for name in [STORE_FILE, STORE_ASIDE] {
            match std::fs::remove_file(to.join(name)) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(err(e)),
                _ => {}
            }
        }
        Ok(true)
    }

    /// A new file in the directory with no name (`O_TMPFILE`), for a writer's bytes that a
    /// commit may take as its entry's file (see [`Slot::adopt`]); where the file system
    /// has no such files, an ordinary temporary file (which no slot can adopt).
    pub fn unnamed_file(&self) -> std::io::Result<File> {
        let made = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .mode(0o600)
            .custom_flags(libc::O_TMPFILE)
            .open(&self.cfg.dir);
        match made {
            Ok(f) => Ok(f),
            Err(_) => tempfile::tempfile_in(&self.cfg.dir),
        }
    }

    pub fn config(&self) -> &WriteBackConfig {
        &self.cfg
    }

    /// Called (on a worker, briefly) after each upload that landed.
    pub fn on_uploaded(&self, f: OnUploaded) {
        *self.on_uploaded.lock() = Some(Arc::new(f));
    }

    /// Starts a commit of `size` bytes for `key`: waits for room (counting the key's queued
    /// entry, which it will replace, as free), then for an upload of the key in flight;
    /// decides the upload's condition (see the module docs). `prev` is the entry the same
    /// file committed last, `origin` the condition if nothing here is newer.
    ///
    /// `changes`: what changed in the file since it committed `prev`. While `prev` is still
    /// the key's entry waiting for upload (not uploading, no conflict), the commit is a
    /// delta over it (see [`Slot::is_delta`]) when the changes are small next to the file:
    /// an fsync of a big file after a few writes stores kilobytes, not the file.
    ///
    /// `rewrite`: the bytes changed since `prev` (not only the metadata). Only a rewrite
    /// after a conflict goes over the other client's version; a chmod or utimens of a file
    /// held as a conflict stays one.
    #[allow(clippy::too_many_arguments)]
    pub async fn begin(
        &self,
        key: &str,
        size: u64,
        meta: &UserMeta,
        prev: Option<u64>,
        origin: Cond,
        changes: Option<Changes>,
        rewrite: bool,
    ) -> FsResult<Slot> {
        if let Some(c) = changes {
            if let Some(slot) = self.try_delta(key, size, meta, prev, c).await? {
                return Ok(slot);
            }
        }
        // Room first (held by the slot from then on): the queued entry stays free to upload
        // meanwhile, and the room it would free counts only while it is queued.
        self.room(key, size).await?;
        // `moving`: a rename a crash interrupted that the replaced entry has still to finish
        // (see `adopt`); the new one finishes it instead.
        let (cond, replaces, mut landed, moving) = loop {
            let changed = self.changed.notified();
            let decided = {
                let mut inner = self.inner.lock();
                match inner.by_key.get(key).copied() {
                    Some(s) => {
                        let e = inner.entries.get_mut(&s).expect("entry of key");
                        match e.status {
                            Status::Uploading | Status::Held | Status::Landed => None,
                            Status::Queued | Status::Failed => {
                                e.status = Status::Held;
                                // After a conflict the user wrote the file again: this
                                // version goes over the other client's.
                                let (cond, landed) = if e.conflict && rewrite {
                                    (Cond::Any, Vec::new())
                                } else {
                                    (e.cond.clone(), e.landed.clone())
                                };
                                Some((cond, Some(s), landed, e.moving.clone()))
                            }
                        }
                    }
                    None => {
                        let known = prev.and_then(|p| inner.results.get(&p).cloned());
                        let cond = known.map(Cond::Match).unwrap_or(origin.clone());
                        Some((cond, None, Vec::new(), None))
                    }
                }
            };
            match decided {
                Some(d) => break d,
                None => changed.await,
            }
        };
        // A failed try of the replaced version may have landed (its answer lost): the
        // bucket may hold it, this mount's, when this one goes (and after a crash).
        if let Some(s) = replaces.filter(|_| landed.len() < LANDED_KEPT) {
            if let Some(etag) = self.etag_if_tried(s).await {
                if !landed.contains(&etag) {
                    landed.push(etag);
                }
            }
        }
        match self.new_slot(
            key,
            size,
            meta.clone(),
            cond,
            replaces,
            moving,
            landed,
            None,
        ) {
            Ok(mut slot) => {
                slot.rename_holds = false;
                Ok(slot)
            }
            Err(e) => {
                self.unhold(replaces, size);
                Err(e)
            }
        }
    }

    /// A commit of `key` failed for want of room (the bound stayed full, or the local disk
    /// is), and the file goes to the bucket directly instead: waits until no entry of the
    /// key is left to upload (an earlier version, sent first, lands before it, so it never
    /// lands over this one), at most `space_wait`. Returns the condition the direct upload
    /// takes, the one [`Self::begin`] would have given its entry (`prev`, `origin`: as
    /// there), and a guard that a directory rename above the key waits for (see
    /// [`Self::pause_below`]). None when an entry of the key never goes up by itself (a
    /// conflict) or is not up in time, or a directory above is being renamed (the upload
    /// would land under the old name): the commit's error stands.
    pub async fn direct_cond(
        self: &Arc<Self>,
        key: &str,
        prev: Option<u64>,
        origin: Cond,
    ) -> Option<(Cond, DirectUpload)> {
        let deadline = Instant::now() + self.cfg.space_wait;
        let mut waited = None;
        loop {
            let changed = self.changed.notified();
            {
                let mut inner = self.inner.lock();
                if inner.paused.iter().any(|p| key.starts_with(p.as_str())) {
                    return None;
                }
                let waiting = inner.by_key.get(key).copied();
                match waiting.and_then(|s| inner.entries.get(&s)) {
                    None => {
                        // The version the key's last entry (the one waited for, else the
                        // file's own last) made is the object now.
                        let known = waited
                            .or(prev)
                            .and_then(|s| inner.results.get(&s).cloned())
                            .or_else(|| prev.and_then(|p| inner.results.get(&p).cloned()));
                        inner.direct.push(key.to_string());
                        let guard = DirectUpload {
                            wb: self.clone(),
                            key: key.to_string(),
                        };
                        return Some((known.map(Cond::Match).unwrap_or(origin), guard));
                    }
                    Some(e) if e.conflict => return None,
                    Some(_) => {}
                }
                if let Some(s) = waiting.filter(|s| waited != Some(*s)) {
                    waited = Some(s);
                    inner.expedite(s);
                    drop(inner);
                    self.work.notify_waiters();
                }
            }
            let left = deadline.checked_duration_since(Instant::now())?;
            let _ = tokio::time::timeout(left, changed).await;
        }
    }

    /// Says, at most every 10 s, that closes upload directly (see [`Self::direct_cond`]).
    pub fn log_direct(&self, key: &str, e: FsError) {
        let mut inner = self.inner.lock();
        let now = Instant::now();
        if inner
            .direct_logged
            .is_some_and(|t| now.duration_since(t) <= Duration::from_secs(10))
        {
            return;
        }
        inner.direct_logged = Some(now);
        drop(inner);
        tracing::warn!(
            "{key}: no room in the write-back directory ({e}): closes and fsyncs upload to \
             the bucket before they return until there is room again"
        );
    }

    /// [`Self::begin`] of a delta (`c` over `prev`) when one is taken now, else None.
    pub async fn try_delta(
        &self,
        key: &str,
        size: u64,
        meta: &UserMeta,
        prev: Option<u64>,
        c: Changes,
    ) -> FsResult<Option<Slot>> {
        // A delta only when it has room now (nobody waiting for room either): else the
        // whole commit, which counts the entry it replaces as free, waits its turn.
        let len = c.len();
        let held = {
            let mut inner = self.inner.lock();
            let s = self.delta_room(&inner, key, prev, size, len);
            if let Some(s) = s {
                inner.bytes += len;
                inner.entries.get_mut(&s).expect("extendable").status = Status::Held;
            }
            s
        };
        match held {
            Some(s) => self.begin_delta(key, size, meta, s, c).await.map(Some),
            None => Ok(None),
        }
    }

    /// Whether a commit of `len` changed bytes of `key` (`size` bytes, last committed as
    /// `prev`) would be a delta now (see [`Self::begin`]).
    pub fn takes_delta(&self, key: &str, prev: Option<u64>, size: u64, len: u64) -> bool {
        let inner = self.inner.lock();
        self.delta_room(&inner, key, prev, size, len).is_some()
    }

    /// The entry a delta of `len` bytes would extend, when it also has room now (nobody
    /// waiting for room either).
    fn delta_room(
        &self,
        inner: &Inner,
        key: &str,
        prev: Option<u64>,
        size: u64,
        len: u64,
    ) -> Option<u64> {
        let fits = inner.room_queue.is_empty()
            && (inner.bytes == 0 || inner.bytes + len <= self.cfg.max_bytes);
        self.extendable_in(inner, key, prev, size, len)
            .filter(|_| fits)
    }

    /// The entry a delta of `len` bytes for `key` could extend: `prev`, while it is the
    /// key's entry, queued (not uploading, not failed), and its
    /// records would not grow past twice the file or [`PIECES_MAX`].
    fn extendable_in(
        &self,
        inner: &Inner,
        key: &str,
        prev: Option<u64>,
        size: u64,
        len: u64,
    ) -> Option<u64> {
        let s = inner
            .by_key
            .get(key)
            .copied()
            .filter(|s| Some(*s) == prev)?;
        let e = inner.entries.get(&s)?;
        // Not over a failed one: a whole commit is its fix when its record went bad.
        let ok = e.status == Status::Queued
            && !e.conflict
            && e.moving.is_none()
            && e.content.0.len() < PIECES_MAX
            && len <= size / 2
            && e.content.stored() + len <= 2 * size;
        ok.then_some(s)
    }

    /// [`Self::begin`] of a delta over held entry `over`, whose room is counted.
    async fn begin_delta(
        &self,
        key: &str,
        size: u64,
        meta: &UserMeta,
        over: u64,
        c: Changes,
    ) -> FsResult<Slot> {
        let (cond, mut landed, moving) = {
            let inner = self.inner.lock();
            let e = inner.entries.get(&over).expect("held");
            (e.cond.clone(), e.landed.clone(), e.moving.clone())
        };
        if landed.len() < LANDED_KEPT {
            if let Some(etag) = self.etag_if_tried(over).await {
                if !landed.contains(&etag) {
                    landed.push(etag);
                }
            }
        }
        let len = c.len();
        let delta = Delta {
            over,
            size,
            keep: c.keep.min(size),
            ranges: c.ranges,
        };
        match self.new_slot(
            key,
            len,
            meta.clone(),
            cond,
            Some(over),
            moving,
            landed,
            Some(delta),
        ) {
            Ok(mut slot) => {
                slot.rename_holds = false;
                Ok(slot)
            }
            Err(e) => {
                self.unhold(Some(over), len);
                Err(e)
            }
        }
    }

    /// Waits for room for a commit of `size` bytes for `key`, then counts them; the key's
    /// queued entry, which the commit replaces, counts as free. First come, first served: a
    /// commit waits behind every one that waited before it, so a large file is not starved
    /// by smaller ones that keep fitting; one that takes no more than the entry it replaces
    /// goes at once (it takes no room another could get). The wait is bounded: see
    /// `WriteBackConfig::space_wait`.
    async fn room(&self, key: &str, size: u64) -> FsResult<()> {
        let started = Instant::now();
        let mut waiting: Option<RoomTicket<'_>> = None;
        loop {
            let changed = self.changed.notified();
            let left = {
                let mut inner = self.inner.lock();
                let replaced = inner
                    .by_key
                    .get(key)
                    .and_then(|s| inner.entries.get(s))
                    .filter(|e| matches!(e.status, Status::Queued | Status::Failed));
                let freed = replaced.map_or(0, |e| e.content.stored());
                // A conflict this commit replaces goes with it: not stuck for it.
                let unstuck = replaced
                    .filter(|e| e.conflict)
                    .map_or(0, |e| e.content.stored());
                let first = size <= freed
                    || inner
                        .room_queue
                        .front()
                        .is_none_or(|t| waiting.as_ref().is_some_and(|w| w.ticket == *t));
                let used = inner.bytes.saturating_sub(freed);
                if first && (used == 0 || used + size <= self.cfg.max_bytes) {
                    inner.bytes += size;
                    break;
                }
                if waiting.is_none() {
                    inner.next_ticket += 1;
                    let ticket = inner.next_ticket;
                    inner.room_queue.push_back(ticket);
                    waiting = Some(RoomTicket { wb: self, ticket });
                    inc(&self.metrics.writeback_space_waits);
                }
                let stuck = inner.stuck_bytes().saturating_sub(unstuck);
                if inner
                    .full_since
                    .is_some_and(|f| inner.freed_at.is_some_and(|t| t >= f))
                {
                    inner.full_since = None;
                }
                let full_since = *inner.full_since.get_or_insert(started);
                let since = inner.freed_at.map_or(full_since, |t| t.max(full_since));
                let left = (since + self.cfg.space_wait).checked_duration_since(Instant::now());
                // A file larger than the bound goes alone: it waits for the others, unless
                // conflicts, which never go by themselves, keep the directory from emptying.
                let fits = stuck + size.min(self.cfg.max_bytes) <= self.cfg.max_bytes;
                let left = left.filter(|_| fits);
                if left.is_none() {
                    self.log_full(&mut inner);
                }
                left
            };
            let Some(left) = left else {
                return Err(FsError(libc::ENOSPC));
            };
            let _ = tokio::time::timeout(left, changed).await;
        }
        // Its ticket goes (the next waiter is woken).
        drop(waiting);
        Ok(())
    }

    /// Says, at most every 10 s, that a commit gets `ENOSPC`.
    fn log_full(&self, inner: &mut Inner) {
        let now = Instant::now();
        if inner
            .full_logged
            .is_some_and(|t| now.duration_since(t) <= Duration::from_secs(10))
        {
            return;
        }
        inner.full_logged = Some(now);
        let conflicts = inner
            .entries
            .values()
            .filter(|e| e.conflict && e.status == Status::Failed)
            .count();
        let failed = inner
            .entries
            .values()
            .filter(|e| e.status == Status::Failed)
            .count();
        tracing::error!(
            "write-back directory full ({} file(s), {:.1} MB, {failed} failed of which \
             {conflicts} conflict(s), bound {:.1} MB) and no upload freed room for {:.0} s: \
             closes upload their files themselves until uploads land or conflicts are \
             resolved (see `bucketfs pending`)",
            inner.entries.len(),
            inner.bytes as f64 / 1e6,
            self.cfg.max_bytes as f64 / 1e6,
            self.cfg.space_wait.as_secs_f64()
        );
    }

    /// A new entry of `size` bytes for `key`: a record of the current segment when it is
    /// small and one has room, else a file of its own. Its room is reserved by the caller.
    #[allow(clippy::too_many_arguments)] // the trailer's fields
    fn new_slot(
        &self,
        key: &str,
        size: u64,
        meta: UserMeta,
        cond: Cond,
        replaces: Option<u64>,
        from: Option<Moved>,
        landed: Vec<String>,
        delta: Option<Delta>,
    ) -> FsResult<Slot> {
        let seq = {
            let mut inner = self.inner.lock();
            let s = inner.next_seq;
            inner.next_seq += 1;
            s
        };
        let trailer = Trailer {
            seq,
            key: key.to_string(),
            size,
            meta: meta.clone(),
            cond: cond.clone(),
            // A delta keeps the entry it extends: it names it as such, not as replaced.
            replaces: replaces.filter(|_| delta.is_none()),
            from: from.clone(),
            landed: landed.clone(),
            delta: delta.clone(),
        }
        .encode();
        let need = REC_HEADER + size + trailer.len() as u64 + 4;
        let rec = (need <= RECORD_MAX)
            .then(|| self.alloc(need.div_ceil(REC_ALIGN) * REC_ALIGN))
            .flatten();
        let (loc, file, base) = match rec {
            Some((seg, rec)) => {
                let file = seg.file.clone();
                (Loc::Rec { seg, rec }, file, rec + REC_HEADER)
            }
            None => {
                let path = entry_path(&self.cfg.dir, seq);
                let file = std::fs::OpenOptions::new()
                    .create_new(true)
                    .read(true)
                    .write(true)
                    .mode(0o600)
                    .open(&path)
                    .map_err(wb_io)?;
                (Loc::File(path), Arc::new(file), 0)
            }
        };
        Ok(Slot {
            seq,
            key: key.to_string(),
            size,
            delta: delta.map(Arc::new),
            meta,
            cond,
            replaces,
            rename_holds: from.is_some(),
            from,
            landed,
            loc,
            file,
            base,
            trailer,
            crc: crc32fast::Hasher::new(),
            written: 0,
            held: Vec::new(),
            early: None,
            adopting: None,
            wb: self.me.lock().clone().unwrap_or_default(),
            settled: false,
        })
    }

    /// `len` bytes of the current segment (switching to the spare one when it is full), or
    /// None when no segment has room now (a spare is being made).
    fn alloc(&self, len: u64) -> Option<(Arc<Segment>, u64)> {
        let mut inner = self.inner.lock();
        let segs = &mut inner.segs;
        let fits = segs
            .current
            .as_ref()
            .is_some_and(|(seg, next)| next + len <= SEGMENT_SIZE && !seg.sync.poisoned());
        if !fits {
            let Some(spare) = segs.spare.take() else {
                // One that failed to be made is tried again.
                drop(inner);
                self.make_spare();
                return None;
            };
            if let Some((old, _)) = segs.current.take() {
                if segs.live.get(&old.id).copied().unwrap_or(0) == 0 {
                    segs.retire(old);
                } else {
                    segs.sealed.insert(old.id);
                }
            }
            segs.current = Some((spare, REC_ALIGN));
        }
        let segs = &mut inner.segs;
        let (seg, next) = segs.current.as_mut()?;
        if *next + len > SEGMENT_SIZE {
            return None;
        }
        let at = *next;
        *next += len;
        let want_spare = *next >= SPARE_AT;
        let seg = seg.clone();
        *segs.live.entry(seg.id).or_default() += 1;
        let want_spare = want_spare && segs.spare.is_none() && !segs.making;
        drop(inner);
        if want_spare {
            self.make_spare();
        }
        Some((seg, at))
    }

    /// Whether the next segment is ready or on its way.
    #[cfg(test)]
    fn spare_asked(&self) -> bool {
        let inner = self.inner.lock();
        inner.segs.spare.is_some() || inner.segs.making
    }

    /// Prepares the next segment in the background (an emptied one reused, else a new
    /// one), unless one is ready or on its way.
    fn make_spare(&self) {
        let (id, reuse) = {
            let mut inner = self.inner.lock();
            let failed_lately = inner
                .segs
                .failed_at
                .is_some_and(|t| t.elapsed() < SPARE_RETRY);
            if inner.segs.spare.is_some() || inner.segs.making || failed_lately {
                return;
            }
            inner.segs.making = true;
            match inner.segs.take_free() {
                Some(seg) => (seg.id, Some(seg)),
                None => {
                    let id = inner.segs.next_id;
                    inner.segs.next_id += 1;
                    (id, None)
                }
            }
        };
        let path = self.cfg.dir.join(format!("seg-{id:020}.wbs"));
        let dir = self.dir_file.try_clone();
        let me = self.me.lock().clone();
        tokio::spawn(async move {
            let made = tokio::task::spawn_blocking(move || -> std::io::Result<Segment> {
                if let Some(seg) = reuse {
                    match reuse_segment(seg) {
                        Ok(seg) => return Ok(seg),
                        Err(e) => {
                            tracing::warn!("write-back directory: reusing a segment: {e}");
                            std::fs::remove_file(&path)?;
                        }
                    }
                }
                let seg = create_segment(id, &path)?;
                if let Err(e) = dir.and_then(|d| d.sync_all()) {
                    // Its name may not last: not used, and not left to fill the disk.
                    drop(seg);
                    let _ = std::fs::remove_file(&path);
                    return Err(e);
                }
                Ok(seg)
            })
            .await;
            let Some(wb) = me.and_then(|w| w.upgrade()) else {
                return;
            };
            let mut inner = wb.inner.lock();
            inner.segs.making = false;
            let made = made
                .map_err(|e| e.to_string())
                .and_then(|r| r.map_err(|e| e.to_string()));
            inner.segs.failed_at = match made {
                Ok(seg) => {
                    inner.segs.spare = Some(Arc::new(seg));
                    None
                }
                Err(e) => {
                    tracing::warn!("write-back directory: new segment: {e}");
                    Some(Instant::now())
                }
            };
        });
    }

    /// A commit that will not finish: its file goes, its room and the entry it was to
    /// replace come back.
    pub async fn abandon(&self, mut slot: Slot) {
        slot.settled = true;
        let (replaces, size) = (slot.replaces, slot.size);
        match &slot.loc {
            // Its name and the slot's descriptor hold a file's blocks, freed when both go
            // (0.2 s a GiB on ext4): not on a runtime thread.
            Loc::File(p) => {
                let (path, again) = (p.clone(), p.clone());
                let removed = tokio::task::spawn_blocking(move || {
                    crate::testpoint::reached_blocking("writeback.abandon_file");
                    let _ = std::fs::remove_file(&path);
                    drop(slot);
                })
                .await;
                // Never ran (the runtime shutting down): a sealed file would come back.
                if removed.is_err() {
                    let _ = std::fs::remove_file(&again);
                }
            }
            // Nothing of a record is valid before its header, written last; but a seal
            // whose sync failed wrote it, and the page cache keeps it past a kill -9: it is
            // zeroed, or a restart would upload the version whose commit failed.
            Loc::Rec { .. } => {
                let loc = slot.loc.clone();
                let zeroed = tokio::task::spawn_blocking(move || drop_loc_blocking(&loc)).await;
                if zeroed.is_err() {
                    drop_loc_blocking(&slot.loc);
                }
                self.forget_loc(&slot.loc)
            }
        }
        self.unhold(replaces, size);
    }

    /// The entry at `loc` is gone from the books: a file is removed, a segment whose last
    /// record it was goes (the caller makes that durable when it must).
    fn forget_loc(&self, loc: &Loc) {
        match loc {
            Loc::File(p) => {
                let _ = std::fs::remove_file(p);
            }
            Loc::Rec { seg, .. } => {
                let mut inner = self.inner.lock();
                let segs = &mut inner.segs;
                let live = segs.live.entry(seg.id).or_default();
                *live = live.saturating_sub(1);
                if *live == 0 && segs.sealed.contains(&seg.id) {
                    segs.retire(seg.clone());
                }
            }
        }
    }

    /// Makes sure the entry at `loc` never comes back after a crash: a record's header is
    /// zeroed (fdatasync), a file removed (directory fsync). Then forgets it.
    async fn drop_loc(&self, loc: &Loc) -> FsResult<()> {
        match loc {
            Loc::File(p) => {
                // Its blocks are freed here (0.2 s a GiB on ext4): not on a runtime thread.
                let path = p.clone();
                let removed = tokio::task::spawn_blocking(move || {
                    crate::testpoint::reached_blocking("writeback.drop_file");
                    std::fs::remove_file(path)
                })
                .await
                .map_err(|_| FsError::EIO)?;
                // Removed: a file has nothing else in the books to forget.
                match removed {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(wb_io(e)),
                    _ => self.sync_dir().await,
                }
            }
            Loc::Rec { seg, rec } => {
                let (seg, at) = (seg.clone(), *rec);
                tokio::task::spawn_blocking(move || {
                    seg.file.write_all_at(&[0u8; REC_HEADER as usize], at)?;
                    seg.sync.sync(&seg.file)
                })
                .await
                .map_err(|_| FsError::EIO)?
                .map_err(wb_io)?;
                self.forget_loc(loc);
                Ok(())
            }
        }
    }

    fn unhold(&self, replaces: Option<u64>, size: u64) {
        self.inner.lock().bytes -= size;
        match replaces {
            Some(s) => self.release(s),
            None => self.changed.notify_waiters(),
        }
    }

    /// Finishes a commit whose bytes are all written: trailer, then a record's header and an
    /// fdatasync, or a file's footer, fsync and directory fsync; then the entry is queued
    /// (and the one it replaces removed; a delta's keeps its records as its own). Returns
    /// its number. `park`: an fsync of a file still open for writing (see [`PARK`]).
    pub async fn commit(&self, slot: Slot, ino: Ino, park: bool) -> FsResult<u64> {
        self.commit_filled(slot, ino, park, |_| Ok(())).await
    }

    /// [`Self::commit`] after `fill` writes the slot's bytes ([`Slot::write_blocking`]), in
    /// the same blocking call as the sync: a small commit costs one thread hand-off, none
    /// when the FUSE thread runs it in place ([`crate::inline::local_io`]).
    pub async fn commit_filled(
        &self,
        mut slot: Slot,
        ino: Ino,
        park: bool,
        fill: impl FnOnce(&mut Slot) -> std::io::Result<()> + Send + 'static,
    ) -> FsResult<u64> {
        let done = crate::inline::local_io(move || {
            let r = fill(&mut slot).and_then(|()| slot.seal());
            (slot, r)
        })
        .await;
        let mut slot = match done {
            Some((slot, Ok(synced))) => {
                if synced {
                    inc(&self.metrics.writeback_syncs);
                }
                slot
            }
            Some((slot, Err(e))) => {
                self.abandon(slot).await;
                return Err(wb_io(e));
            }
            // The slot went unsettled (the fill panicked, or never ran): its drop gave
            // everything back.
            None => return Err(FsError::EIO),
        };
        if matches!(slot.loc, Loc::File(_)) {
            if let Err(e) = self.sync_dir().await {
                self.abandon(slot).await;
                return Err(e);
            }
        }
        // A delta's base is held by this commit; were it gone, the delta alone would be
        // taken for the whole file.
        if slot.delta.is_some()
            && !slot
                .replaces
                .is_some_and(|s| self.inner.lock().entries.contains_key(&s))
        {
            self.abandon(slot).await;
            return Err(FsError::EIO);
        }
        let piece = Piece {
            loc: slot.loc.clone(),
            len: slot.size,
            delta: slot.delta.clone(),
        };
        let old = {
            let mut inner = self.inner.lock();
            let mut old = slot.replaces.and_then(|s| inner.entries.remove(&s));
            let now = Instant::now();
            let parked = park.then(|| {
                let first = now + PARK.max(self.cfg.delay);
                old.as_ref().and_then(|o| o.parked).unwrap_or(first)
            });
            let content = match old.take_if(|_| slot.delta.is_some()) {
                // Its records are the new entry's now. Not its parts sent early: a delta
                // follows a write, whose mtime their upload does not carry.
                Some(o) => {
                    let mut c = o.content;
                    c.0.push(piece);
                    c
                }
                None => Content(vec![piece]),
            };
            if let Some(o) = &old {
                inner.bytes -= o.content.stored();
                inner.freed_at = Some(now);
            }
            if let Some(r) = slot.replaces {
                inner.successor.insert(r, slot.seq);
                inner.successor_order.push_back(r);
                while inner.successor_order.len() > results_kept() {
                    if let Some(s) = inner.successor_order.pop_front() {
                        inner.successor.remove(&s);
                    }
                }
            }
            inner.by_key.insert(slot.key.clone(), slot.seq);
            let held = slot.rename_holds;
            inner.entries.insert(
                slot.seq,
                Entry {
                    key: slot.key.clone(),
                    size: slot.file_size(),
                    meta: slot.meta.clone(),
                    cond: slot.cond.clone(),
                    content,
                    ino,
                    status: if held { Status::Held } else { Status::Queued },
                    error: None,
                    conflict: false,
                    tries: 0,
                    next_try: None,
                    not_before: now + self.cfg.delay,
                    parked,
                    moving: slot.from.clone(),
                    renaming: slot.rename_holds,
                    landed: slot.landed.clone(),
                    early: slot.early.take(),
                },
            );
            if !held && parked.is_none() {
                inner.ready.push_back(slot.seq);
            }
            slot.settled = true;
            old
        };
        if slot.delta.is_some() {
            inc(&self.metrics.writeback_deltas);
        }
        inc(&self.metrics.writeback_committed);
        self.update_gauges();
        self.work.notify_one();
        if old.is_some() {
            // A smaller version than the one it replaced frees room for the waiters.
            self.changed.notify_waiters();
        }
        if let Some(o) = old {
            // Its replacement names it; it must still never outlive it (an uploaded
            // replacement is dropped for good).
            self.drop_or_later(o.content, &o.key).await;
            inc(&self.metrics.writeback_replaced);
        }
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

    /// Removes held entry `seq` for good (durably, before this returns: the file must not
    /// come back): its file was unlinked or renamed over, and the bucket says so now.
    pub async fn discard(&self, seq: u64) -> FsResult<()> {
        self.finish_move_before_drop(seq).await;
        let e = {
            let mut inner = self.inner.lock();
            if inner.entries.get(&seq).map(|e| e.status) != Some(Status::Held) {
                return Ok(());
            }
            let e = inner.entries.remove(&seq).expect("present");
            inner.bytes -= e.content.stored();
            inner.freed_at = Some(Instant::now());
            if inner.by_key.get(&e.key) == Some(&seq) {
                inner.by_key.remove(&e.key);
            }
            e
        };
        self.drop_or_later(e.content, &e.key).await;
        inc(&self.metrics.writeback_cancelled);
        self.update_gauges();
        self.changed.notify_waiters();
        Ok(())
    }

    /// Held entry `seq`, about to be dropped or moved, still has a rename a crash
    /// interrupted to finish (see [`Self::adopt`]): it is finished now, once, as the entry
    /// is the only record of it; if the store refuses, the old name stays (logged).
    async fn finish_move_before_drop(&self, seq: u64) {
        let moving = {
            let inner = self.inner.lock();
            let e = inner.entries.get(&seq).filter(|e| !e.renaming);
            e.and_then(|e| e.moving.clone())
        };
        let Some(m) = moving else { return };
        if let Err(e) = self.finish_move(seq, &m).await {
            tracing::error!(
                "{}: not deleted ({e}), as a rename a crash interrupted was to: it stays \
                 in the bucket",
                m.key
            );
        }
    }

    /// [`Self::drop_loc`] of each record of an entry the books have let go (its file was
    /// unlinked, or it was uploaded or replaced), oldest first, each durably before the
    /// next: a crash in between leaves deltas over nothing, which the next start removes,
    /// never an older version that looks whole. What the caller did stands even when the
    /// local disk refuses the drop now; it is tried again every second and before the
    /// daemon exits (logged). Until it succeeds, only a crash could bring the entry back.
    async fn drop_or_later(&self, content: Content, key: &str) {
        let locs: Vec<Loc> = content.0.into_iter().map(|p| p.loc).collect();
        if let Err((left, e)) = self.drop_locs(locs).await {
            tracing::error!(
                "{key}: write-back entry {} not invalidated ({e:?}); tried again every second",
                left[0].describe().display()
            );
            let e = format!("not invalidated yet: {e:?}");
            self.inner.lock().undropped.push((left, key.to_string(), e));
        }
    }

    /// Drops `locs` in order; on a failure, those left (the failed one first).
    async fn drop_locs(&self, locs: Vec<Loc>) -> Result<(), (Vec<Loc>, FsError)> {
        for (i, loc) in locs.iter().enumerate() {
            if let Err(e) = self.drop_loc(loc).await {
                return Err((locs[i..].to_vec(), e));
            }
        }
        Ok(())
    }

    /// Tries the drops that failed before again; returns how many are still to do.
    async fn drop_undropped(&self) -> usize {
        let groups = std::mem::take(&mut self.inner.lock().undropped);
        for (locs, key, e) in groups {
            if let Err((left, _)) = self.drop_locs(locs).await {
                self.inner.lock().undropped.push((left, key, e));
            }
        }
        self.inner.lock().undropped.len()
    }

    /// Waits for entry `seq`, or the entry that replaced it (a later commit of the same
    /// file, a rename), to be uploaded; its error if its upload failed since. One still
    /// waiting for `--upload-delay` goes up now: the delay gathers a file's rewrites, and
    /// whoever waits here wants the version it has.
    pub async fn wait_uploaded(&self, seq: u64) -> FsResult<()> {
        loop {
            let changed = self.changed.notified();
            {
                let mut inner = self.inner.lock();
                let mut s = seq;
                while let Some(n) = inner.successor.get(&s) {
                    s = *n;
                }
                // Each time: a version that replaced it (a close, a rename) is queued anew.
                if inner
                    .entries
                    .get(&s)
                    .is_some_and(|e| e.not_before > Instant::now())
                {
                    inner.due_now(s);
                    self.work.notify_waiters();
                }
                match inner.entries.get(&s) {
                    None => return Ok(()),
                    Some(e) if e.status == Status::Landed => return Ok(()),
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
            // Looked at again each second too: the version replacing it is made due above
            // even if nothing said it changed.
            let _ = tokio::time::timeout(Duration::from_secs(1), changed).await;
        }
    }

    /// The ETag an upload of entry `seq` gives its object (the MD5 of its bytes, or the
    /// multipart ETag of its parts), if a try of it failed: that try may have landed with
    /// its answer lost (the bucket then holds this entry's version). None when no try
    /// failed or the entry cannot be read.
    pub async fn etag_if_tried(&self, seq: u64) -> Option<String> {
        let (content, size) = {
            let inner = self.inner.lock();
            let e = inner.entries.get(&seq).filter(|e| e.tries > 0)?;
            (e.content.clone(), e.size)
        };
        if size <= self.layout.part_size {
            let md5 = md5_of(&content, 0..size).await?;
            return Some(format!("\"{}\"", hex::encode(md5)));
        }
        let parts = self.layout.parts(size);
        let mut md5s = Vec::new();
        for r in &parts {
            md5s.extend_from_slice(&md5_of(&content, r.clone()).await?);
        }
        Some(format!(
            "\"{}-{}\"",
            hex::encode(Md5::digest(&md5s)),
            parts.len()
        ))
    }

    /// The size of entry `seq` if a try to upload it failed (see [`Self::etag_if_tried`]).
    pub fn tried_size(&self, seq: u64) -> Option<u64> {
        let inner = self.inner.lock();
        inner
            .entries
            .get(&seq)
            .filter(|e| e.tries > 0)
            .map(|e| e.size)
    }

    /// ETags of versions entry `seq` replaced that may be at its key, uploaded by this mount
    /// (see `Entry::landed`).
    pub fn landed(&self, seq: u64) -> Vec<String> {
        let inner = self.inner.lock();
        inner
            .entries
            .get(&seq)
            .map_or_else(Vec::new, |e| e.landed.clone())
    }

    /// Whether entry `seq` is still to be uploaded.
    pub fn is_pending(&self, seq: u64) -> bool {
        self.inner.lock().entries.contains_key(&seq)
    }

    /// Keeps entry `seq` from being uploaded (a rename is moving it, an unlink removing
    /// it), once an upload of it in flight is over. Only a holder of the file's write state,
    /// or a directory rename that holds no state (see `Fs::rename_dir`), holds an entry, so
    /// the wait is an upload's, or a commit's that replaces it.
    pub async fn hold(&self, seq: u64) -> Holding {
        self.hold_unless_moved(seq, None)
            .await
            .expect("no key to check")
    }

    /// [`Self::hold`] for an unlink or rename of the file whose state has key `key`: None,
    /// holding nothing, while a directory rename moves the entries below it (it may have
    /// moved `seq` to a new entry that the state learns of only when it ends: the caller
    /// waits for that, [`Self::wait_unmoved`], and tries again). Checked under the books'
    /// lock with the hold, so no directory rename can take the entry in between.
    pub async fn hold_unless_moved(&self, seq: u64, key: Option<&str>) -> Option<Holding> {
        loop {
            let changed = self.changed.notified();
            {
                let mut inner = self.inner.lock();
                if let Some(k) = key {
                    if inner.paused.iter().any(|p| k.starts_with(p.as_str())) {
                        return None;
                    }
                }
                match inner.entries.get_mut(&seq) {
                    None => {
                        return Some(match inner.results.get(&seq) {
                            Some(etag) => Holding::Uploaded(Some(etag.clone())),
                            None => Holding::Gone,
                        })
                    }
                    Some(e) if e.status == Status::Landed => {
                        return Some(Holding::Uploaded(inner.results.get(&seq).cloned()))
                    }
                    Some(e) if matches!(e.status, Status::Queued | Status::Failed) => {
                        e.status = Status::Held;
                        return Some(Holding::Held {
                            cond: e.cond.clone(),
                            conflict: e.conflict,
                        });
                    }
                    Some(_) => {}
                }
            }
            changed.await;
        }
    }

    /// The file system learnt that entry `seq` landed (see [`Status::Landed`]).
    pub fn settled(&self, seq: u64) {
        let mut inner = self.inner.lock();
        if inner
            .entries
            .get(&seq)
            .is_some_and(|e| e.status == Status::Landed)
        {
            inner.entries.remove(&seq);
        }
        drop(inner);
        self.changed.notify_waiters();
    }

    /// The last writer of the file whose latest commit is `seq` (or replaced it) closed
    /// it: a version its fsync parked goes up now, after `--upload-delay`.
    pub fn closed(&self, seq: u64) {
        let mut inner = self.inner.lock();
        let mut s = seq;
        while let Some(n) = inner.successor.get(&s) {
            s = *n;
        }
        let now = Instant::now();
        let due = now + self.cfg.delay;
        if inner.entries.get(&s).is_some_and(|e| e.parked.is_some()) {
            inner.unpark(s, now);
            if let Some(e) = inner.entries.get_mut(&s) {
                e.not_before = due;
            }
            drop(inner);
            self.work.notify_one();
        }
    }

    /// Lets a held entry go up again (the rename failed).
    pub fn release(&self, seq: u64) {
        let mut inner = self.inner.lock();
        if let Some(e) = inner.entries.get_mut(&seq) {
            if e.status == Status::Held {
                // A rename that let it go without `moved` (it failed) holds it no more: its
                // move, if any, is finished like one a crash interrupted.
                e.renaming = false;
                // Its key again, if a rename over it that failed had taken it.
                let key = e.key.clone();
                inner.by_key.entry(key).or_insert(seq);
                let e = inner.entries.get_mut(&seq).expect("present");
                // A failed upload waits for its next try, a conflict for the file to be
                // written again; one the retry loop had queued again (no next try) goes now.
                e.status = match &e.error {
                    Some(_) if e.conflict || e.next_try.is_some() => Status::Failed,
                    _ => Status::Queued,
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
    /// bytes, durably replacing it, and still held. Returns its number.
    ///
    /// A rename calls this with `from` (the object it moves) before it changes the bucket,
    /// then [`Self::moved`] once it did; were the daemon to die in between, the entry found
    /// at the next start deletes the old name's object before it goes up (with `cond`, so
    /// a rename records `Cond::Any`: the name it takes is the rename's to replace). With
    /// `from` None (a rename undone moves the entry back) the new entry is released at once.
    /// `also`: an entry of
    /// `key` this one replaces too (an earlier version of the same file moved by the same
    /// rename), removed once this one is durable.
    pub async fn rekey(
        &self,
        seq: u64,
        key: &str,
        cond: Cond,
        from: Option<Moved>,
        also: Option<u64>,
    ) -> FsResult<u64> {
        if from.is_some() {
            // A rename records one move: an earlier one of the entry's is done first.
            self.finish_move_before_drop(seq).await;
        }
        let (src, size, meta, ino) = {
            let mut inner = self.inner.lock();
            let Some(e) = inner.entries.get_mut(&seq) else {
                return Err(FsError::EIO);
            };
            let r = (e.content.clone(), e.size, e.meta.clone(), e.ino);
            inner.bytes += r.1;
            r
        };
        let slot = self.new_slot(key, size, meta, cond, Some(seq), from, Vec::new(), None);
        let mut slot = match slot {
            Ok(s) => s,
            Err(e) => {
                self.unhold(Some(seq), size);
                return Err(e);
            }
        };
        let mut at = 0;
        while at < size {
            let n = (size - at).min(1 << 20);
            let r = match read_range(&src, at, n).await {
                Ok(c) => slot.write(c).await,
                Err(e) => Err(e),
            };
            if let Err(e) = r {
                self.abandon(slot).await;
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
        let new = self.commit(slot, ino, false).await?;
        if let Some(a) = also.filter(|a| *a != new) {
            self.discard(a).await?;
        }
        self.changed.notify_waiters();
        Ok(new)
    }

    /// A rename finished moving held entry `seq` (see [`Self::rekey`]): it goes up with
    /// `cond` (what the rename left at its key).
    pub fn moved(&self, seq: u64, cond: Cond) {
        {
            let mut inner = self.inner.lock();
            if let Some(e) = inner.entries.get_mut(&seq) {
                e.cond = cond;
                e.moving = None;
                e.renaming = false;
            }
        }
        self.release(seq);
    }

    /// A number standing for a version of a file that is in the bucket as `etag` with no
    /// entry (a rename moved the object an upload made): a later commit naming it as its
    /// predecessor replaces only that object.
    pub fn remember(&self, etag: String) -> u64 {
        let mut inner = self.inner.lock();
        let s = inner.next_seq;
        inner.next_seq += 1;
        inner.results.insert(s, etag);
        inner.results_order.push_back(s);
        s
    }

    /// The ETag entry `seq`'s upload gave its object, while remembered.
    pub fn result(&self, seq: u64) -> Option<String> {
        self.inner.lock().results.get(&seq).cloned()
    }

    /// Whether entry `seq` is still to be uploaded (and has not landed).
    pub fn awaits_upload(&self, seq: u64) -> bool {
        self.inner
            .lock()
            .entries
            .get(&seq)
            .is_some_and(|e| e.status != Status::Landed)
    }

    /// The entry that stands for `seq` now: `seq`, or the one that replaced it (a later
    /// commit, a rename), following the chain.
    pub fn latest(&self, seq: u64) -> u64 {
        let inner = self.inner.lock();
        let mut s = seq;
        while let Some(n) = inner.successor.get(&s) {
            s = *n;
        }
        s
    }

    /// Entries not landed whose keys start with `prefix`, and their keys.
    pub fn below(&self, prefix: &str) -> Vec<(u64, String)> {
        self.inner
            .lock()
            .entries
            .iter()
            .filter(|(_, e)| e.key.starts_with(prefix) && e.status != Status::Landed)
            .map(|(s, e)| (*s, e.key.clone()))
            .collect()
    }

    /// Waits until no directory rename moves the entries of `key` (see
    /// [`Self::hold_unless_moved`]).
    pub async fn wait_unmoved(&self, key: &str) {
        loop {
            let changed = self.changed.notified();
            if !self
                .inner
                .lock()
                .paused
                .iter()
                .any(|p| key.starts_with(p.as_str()))
            {
                return;
            }
            changed.await;
        }
    }

    /// Keeps entries whose keys start with `prefix` (a directory being renamed) from being
    /// uploaded until the guard goes, and waits for the uploads of such entries in flight.
    pub async fn pause_below(self: &Arc<Self>, prefix: &str) -> Paused {
        self.inner.lock().paused.push(prefix.to_string());
        let guard = Paused {
            wb: self.clone(),
            prefix: prefix.to_string(),
        };
        loop {
            let changed = self.changed.notified();
            let busy = {
                let inner = self.inner.lock();
                inner.direct.iter().any(|k| k.starts_with(prefix))
                    || inner
                        .entries
                        .values()
                        .any(|e| e.key.starts_with(prefix) && e.status == Status::Uploading)
            };
            if !busy {
                return guard;
            }
            changed.await;
        }
    }

    /// Waits until nothing is queued or uploading (failed entries are left), calling
    /// `progress` every `every` with the files and bytes left.
    pub async fn drain(&self, every: Duration, mut progress: impl FnMut(usize, u64)) {
        // Failed entries are tried once more now, and delayed ones wait no longer.
        self.retry_failed_now();
        {
            let now = Instant::now();
            let mut inner = self.inner.lock();
            let parked: Vec<u64> = inner
                .entries
                .iter()
                .filter(|(_, e)| e.parked.is_some())
                .map(|(s, _)| *s)
                .collect();
            for s in parked {
                inner.unpark(s, now);
            }
            for e in inner.entries.values_mut() {
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
                    .filter(|e| !matches!(e.status, Status::Failed | Status::Landed))
                    .count();
                let files = inner.entries.len() + inner.unreadable.len();
                (active, files, inner.bytes)
            };
            if active == 0 {
                let left = self.drop_undropped().await;
                if left > 0 {
                    tracing::error!(
                        "write-back directory: {left} entry file(s) let go could not be \
                         invalidated; a later mount would upload them again"
                    );
                }
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

    /// Files not uploaded yet and bytes, and how many of them failed (or could not be
    /// read at start).
    pub fn counts(&self) -> (usize, u64, usize) {
        let inner = self.inner.lock();
        let live = inner
            .entries
            .values()
            .filter(|e| e.status != Status::Landed)
            .count();
        let failed = inner
            .entries
            .values()
            .filter(|e| e.status == Status::Failed)
            .count();
        let bad = inner.unreadable.len();
        (live + bad, inner.bytes, failed + bad)
    }

    /// Every file not uploaded yet, and the entries let go whose drop is still to do.
    pub fn pending(&self) -> Vec<PendingFile> {
        let inner = self.inner.lock();
        let unreadable = inner.unreadable.iter().map(|(p, e)| PendingFile {
            key: String::new(),
            size: 0,
            state: "unreadable",
            error: Some(e.clone()),
            path: p.clone(),
        });
        inner
            .entries
            .values()
            .filter(|e| e.status != Status::Landed)
            .map(|e| PendingFile {
                key: e.key.clone(),
                size: e.size,
                state: match (e.status, e.conflict) {
                    (Status::Failed, true) => "conflict",
                    (Status::Failed, false) => "failed",
                    (Status::Uploading, _) => "uploading",
                    _ if e.parked.is_some() => "parked",
                    _ => "queued",
                },
                error: e.error.clone(),
                path: e.content.head().describe(),
            })
            .chain(unreadable)
            .chain(inner.undropped.iter().map(|(locs, key, e)| PendingFile {
                key: key.clone(),
                size: 0,
                state: "dropping",
                error: Some(e.clone()),
                path: locs[0].describe(),
            }))
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

    /// The next entry to upload, marked uploading, with its early parts (kept apart from the
    /// job, which is shared across awaits: they are not `Sync`); else how long until the
    /// first one is due.
    fn take(&self) -> Result<(Job, Option<EarlyParts>), Option<Duration>> {
        let mut inner = self.inner.lock();
        let inner = &mut *inner;
        let now = Instant::now();
        let mut i = 0;
        while let Some(&s) = inner.ready.get(i) {
            let Some(e) = inner.entries.get_mut(&s) else {
                inner.ready.remove(i);
                continue;
            };
            if e.status != Status::Queued || e.parked.is_some() {
                inner.ready.remove(i);
                continue;
            }
            if inner.paused.iter().any(|p| e.key.starts_with(p.as_str())) {
                // Its directory is being renamed: it goes up under its new name.
                i += 1;
                continue;
            }
            if e.not_before > now {
                // Entries are queued in order of their times: none behind it is due either.
                return Err(Some(e.not_before - now));
            }
            inner.ready.remove(i);
            e.status = Status::Uploading;
            let r = Job {
                seq: s,
                key: e.key.clone(),
                size: e.size,
                meta: e.meta.clone(),
                cond: e.cond.clone(),
                content: e.content.clone(),
                ino: e.ino,
                moving: e.moving.clone(),
                landed: e.landed.clone(),
            };
            inner.running += 1;
            return Ok((r, e.early.take()));
        }
        Err(None)
    }

    /// Uploads the next entry due; else how long until one is (`None`: nothing queued).
    async fn upload_one(&self) -> Result<(), Option<Duration>> {
        let (job, early) = self.take()?;
        let Job {
            seq,
            ref key,
            ref content,
            ino,
            ref moving,
            ..
        } = job;
        let loc = content.head().clone();
        let r = match &moving {
            Some(m) => self.finish_move(seq, m).await,
            None => Ok(()),
        };
        let r = match r {
            Ok(()) => self.upload(&job, early).await,
            Err(e) => Err((e, false)),
        };
        match r {
            Ok(etag) => {
                crate::testpoint::reached("writeback.uploaded").await;
                // The entry goes for good before anything learns of the upload: were it to
                // come back after a crash, its upload would be done again over whatever
                // happened to the file since (a delete, say). Until then it counts as
                // uploading (an unlink or rename waits).
                self.drop_or_later(content.clone(), key).await;
                let cb = self.on_uploaded.lock().clone();
                {
                    let mut inner = self.inner.lock();
                    inner.running -= 1;
                    inner.freed_at = Some(Instant::now());
                    if let Some(e) = inner.entries.get_mut(&seq) {
                        e.status = Status::Landed;
                        let stored = e.content.stored();
                        inner.bytes -= stored;
                        if cb.is_none() {
                            inner.entries.remove(&seq);
                        }
                    }
                    if inner.by_key.get(key) == Some(&seq) {
                        inner.by_key.remove(key);
                    }
                    inner.results.insert(seq, etag.clone());
                    inner.results_order.push_back(seq);
                    while inner.results_order.len() > results_kept() {
                        if let Some(old) = inner.results_order.pop_front() {
                            inner.results.remove(&old);
                        }
                    }
                }
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
                                loc.describe().display()
                            );
                        } else {
                            tracing::error!(
                                "{key}: background upload failed ({e}); kept in {}, retried \
                                 every few minutes (see `bucketfs pending`)",
                                loc.describe().display()
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

    /// Finishes the rename a crash interrupted (see [`Moved`]): the object it was moving is
    /// deleted from the old name, unless it is not that object any more (another ETag, or
    /// written after the rename began).
    async fn finish_move(&self, seq: u64, m: &Moved) -> Result<(), String> {
        if let Some(etag) = &m.etag {
            match self.store.head(&m.key).await {
                Ok(o) => {
                    let since = o.last_modified.and_then(|t| {
                        t.duration_since(std::time::UNIX_EPOCH)
                            .ok()
                            .map(|d| d.as_secs())
                    });
                    if o.etag.as_ref() == Some(etag) && since.is_none_or(|t| t <= m.at) {
                        tracing::info!(
                            "{}: deleting it, as a rename to {} interrupted by a crash was \
                             to",
                            m.key,
                            self.inner.lock().entries.get(&seq).map_or("", |e| &e.key)
                        );
                        match self.store.delete_if(&m.key, etag).await {
                            Ok(()) | Err(StoreError::PreconditionFailed(_)) => {}
                            Err(e) => return Err(e.to_string()),
                        }
                    }
                }
                Err(StoreError::NotFound(_)) => {}
                Err(e) => return Err(e.to_string()),
            }
        }
        if let Some(e) = self.inner.lock().entries.get_mut(&seq) {
            e.moving = None;
        }
        Ok(())
    }

    /// One upload of an entry; its ETag, or the error and whether it is a conflict. A
    /// version of an object another client deleted since (a `404` to `If-Match`) is stored
    /// as a new file, only while the key stays free (`If-None-Match: *`): deleting loses no
    /// byte of the other client's, and this version's bytes were acknowledged.
    async fn upload(
        &self,
        job: &Job,
        mut early: Option<EarlyParts>,
    ) -> Result<String, (String, bool)> {
        let (key, mut cond) = (&job.key, job.cond.clone());
        for _ in 0..3 {
            match self.upload_as(job, &cond, early.take()).await {
                Err(Gone) if matches!(cond, Cond::Match(_)) => {
                    tracing::warn!(
                        "{key}: deleted by another client since this mount knew it; this \
                         mount's version is stored as a new file"
                    );
                    cond = Cond::Absent;
                }
                // A version of ours that landed with its answer lost: this one replaces it.
                Err(UploadErr::Ours(etag)) => cond = Cond::Match(etag),
                Err(Gone) => return Err(("not found".into(), false)),
                Err(Refused(e, conflict)) => return Err((e, conflict)),
                Ok(etag) => return Ok(etag),
            }
        }
        Err(("the object kept changing under the upload".into(), false))
    }

    /// One try of [`Self::upload`], replacing what `cond` says.
    async fn upload_as(
        &self,
        job: &Job,
        cond: &Cond,
        early: Option<EarlyParts>,
    ) -> Result<String, UploadErr> {
        let (key, size, meta, content) = (job.key.as_str(), job.size, &job.meta, &job.content);
        let landed = &job.landed;
        let pin = cond.if_match();
        // The ETag ours would have, worked out only when a refusal asks whose the object
        // is: an MD5 of every body was a sixth of the daemon's CPU writing small files.
        let (r, ours): (_, Box<dyn FnOnce() -> String + Send>) = if size <= self.layout.part_size {
            let _buffer = self.buffer(size).await;
            let body = self.read_part(content, 0, size).await.map_err(|e| {
                Refused(
                    format!("{}: {e}", content.head().describe().display()),
                    false,
                )
            })?;
            let from = headers_from(key, pin);
            let r = self.store.put_if(key, body.clone(), meta, pin, from).await;
            (r, Box::new(move || put_etag(&body)))
        } else {
            let (r, ours) = self
                .upload_multipart(key, size, meta, pin, content, early)
                .await;
            (r, Box::new(move || ours))
        };
        match r {
            Ok(etag) => Ok(etag),
            Err(e @ (StoreError::PreconditionFailed(_) | StoreError::NotFound(_))) => {
                let ours = ours();
                // Ours already (an upload whose answer or removal a crash lost)? A check
                // that fails tells nothing: the upload is tried again, never a conflict.
                let head = self.store.head(key).await;
                match &head {
                    Err(StoreError::NotFound(_)) | Ok(_) => {}
                    Err(he) => {
                        return Err(Refused(format!("{e}; then checking the key: {he}"), false))
                    }
                }
                if let Ok(o) = &head {
                    if o.etag.as_deref() == Some(ours.as_str()) && o.size == size {
                        if o.user == *meta {
                            return Ok(ours);
                        }
                        // Our bytes with other metadata: an earlier version of ours (a
                        // chmod since) whose answer was lost, or metadata the store wrote
                        // its own way. This version goes over it.
                        if cond.if_match() != Some(ours.as_str()) {
                            return Err(UploadErr::Ours(ours));
                        }
                    }
                    match &o.etag {
                        Some(etag)
                            if landed.contains(etag) && cond.if_match() != Some(etag.as_str()) =>
                        {
                            return Err(UploadErr::Ours(etag.clone()))
                        }
                        _ => {}
                    }
                }
                if matches!(e, StoreError::NotFound(_)) {
                    return Err(match cond {
                        Cond::Match(_) => UploadErr::Gone,
                        _ => Refused(e.to_string(), false),
                    });
                }
                if matches!(cond, Cond::Match(_)) {
                    // A 412 to If-Match for an object that is gone (servers differ).
                    if let Err(StoreError::NotFound(_)) = head {
                        return Err(UploadErr::Gone);
                    }
                }
                inc(&self.metrics.writeback_conflicts);
                Err(Refused(
                    format!("changed by another client since this mount knew it ({e})"),
                    true,
                ))
            }
            Err(e) => Err(Refused(e.to_string(), false)),
        }
    }

    /// A multipart upload from the entry file, completing the one of its parts sent early
    /// if it can; the result and the ETag it would have. An early upload the store no
    /// longer has (aborted by a lifecycle rule after a long wait) is not taken for a
    /// deleted object: the parts go again into a new upload.
    async fn upload_multipart(
        &self,
        key: &str,
        size: u64,
        meta: &UserMeta,
        pin: Option<&str>,
        content: &Content,
        early: Option<EarlyParts>,
    ) -> (Result<String, StoreError>, String) {
        let Some(reused) = reuse_early(early, key, meta, pin).await else {
            return self.send_parts(key, size, meta, pin, content, None).await;
        };
        match self
            .send_parts(key, size, meta, pin, content, Some(reused))
            .await
        {
            (Err(StoreError::NotFound(e)), _) => {
                tracing::info!("{key}: the upload its parts went into early is gone ({e})");
                self.send_parts(key, size, meta, pin, content, None).await
            }
            r => r,
        }
    }

    /// The parts of a multipart upload from the entry file (into `upload` with the parts
    /// it has, else a new one), [`PARTS_AT_ONCE`] in flight, then its completion; the
    /// result and the ETag it would have: S3's rule over the ETags the parts got, which are
    /// their MD5s wherever that rule holds (no MD5 of the bytes here).
    async fn send_parts(
        &self,
        key: &str,
        size: u64,
        meta: &UserMeta,
        pin: Option<&str>,
        content: &Content,
        upload: Option<(Upload, HashMap<u32, String>)>,
    ) -> (Result<String, StoreError>, String) {
        let (mut upload, sent) = match upload {
            Some(reused) => reused,
            None => match self.uploads.create(key, meta, headers_from(key, pin)).await {
                Ok(u) => (u, HashMap::new()),
                Err(e) => return (Err(e), String::new()),
            },
        };
        let parts = self.layout.parts(size);
        let up = &upload;
        let (sent, layout) = (&sent, self.layout);
        // Collected and boxed so the caller's future stays provably Send
        // (rust-lang/rust#102211).
        let jobs: Vec<BoxFuture<'_, Result<CompletedPart, StoreError>>> = parts
            .into_iter()
            .zip(1u32..)
            .map(|(r, part_number)| {
                async move {
                    let whole = r == layout.bounds(u64::from(part_number) - 1);
                    if let Some(etag) = sent.get(&part_number).filter(|_| whole) {
                        inc(&self.metrics.writeback_early_parts);
                        return Ok(CompletedPart {
                            part_number,
                            etag: etag.clone(),
                        });
                    }
                    let _buffer = self.buffer(r.end - r.start).await;
                    let body = self
                        .read_part(content, r.start, r.end - r.start)
                        .await
                        .map_err(|e| StoreError::Other(e.to_string()))?;
                    let etag = up.part(part_number, body).await?;
                    Ok(CompletedPart { part_number, etag })
                }
                .boxed()
            })
            .collect();
        let parts = match run_bounded(jobs, PARTS_AT_ONCE).await {
            Ok(p) => p,
            Err(e) => {
                let _ = upload.abort().await;
                return (Err(e), String::new());
            }
        };
        // Not all MD5s (an encrypted object, say): this upload's ETag is not known.
        let ours = bucketfs_store::retry::multipart_etag(&parts).unwrap_or_default();
        let r = upload.complete(&parts, pin).await;
        if r.is_err() {
            let _ = upload.abort().await;
        }
        (r, ours)
    }
}

/// The MD5 of bytes `r` of `content`, read 1 MiB at a time: it is taken outside the memory
/// budget (for an unlink or a commit, of up to a part each).
async fn md5_of(content: &Content, r: Range<u64>) -> Option<[u8; 16]> {
    let mut h = Md5::new();
    let mut at = r.start;
    while at < r.end {
        let n = (r.end - at).min(1 << 20);
        h.update(read_range(content, at, n).await.ok()?);
        at += n;
    }
    Some(h.finalize().into())
}

impl WriteBack {
    /// Leave to hold a part buffer of `len` bytes (see [`Self::buffers`]).
    async fn buffer(&self, len: u64) -> tokio::sync::SemaphorePermit<'_> {
        let units = len.div_ceil(BUFFER_UNIT).clamp(1, self.buffer_units as u64) as u32;
        self.buffers
            .acquire_many(units)
            .await
            .expect("the buffers semaphore is never closed")
    }

    /// `len` bytes of an entry's file from `at`, in a buffer of the memory budget.
    async fn read_part(&self, content: &Content, at: u64, len: u64) -> FsResult<Bytes> {
        let Some(budget) = &self.budget else {
            return read_range(content, at, len).await;
        };
        let mut buf = budget.buffer(len).await;
        let content = content.clone();
        tokio::task::spawn_blocking(move || {
            content
                .read_at(at, &mut buf.as_mut_slice()[..len as usize])
                .map(|_| buf.freeze(len as usize))
        })
        .await
        .map_err(|_| FsError::EIO)?
        .map_err(wb_io)
    }
}

impl Drop for WriteBack {
    /// Segments without a live record (the one being filled, the spare) are not left behind.
    fn drop(&mut self) {
        let inner = self.inner.get_mut();
        let segs = &mut inner.segs;
        let current = segs.current.take().map(|(s, _)| s);
        for seg in current.into_iter().chain(segs.spare.take()) {
            if segs.live.get(&seg.id).copied().unwrap_or(0) == 0 {
                let _ = std::fs::remove_file(&seg.path);
            }
        }
        for seg in segs.free.drain(..) {
            let _ = std::fs::remove_file(&seg.path);
        }
    }
}

async fn worker(wb: std::sync::Weak<WriteBack>, work: Arc<Notify>) {
    loop {
        let notified = work.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let wait = {
            let Some(w) = wb.upgrade() else { return };
            match w.upload_one().await {
                Ok(()) => continue,
                Err(due) => due.unwrap_or(Duration::MAX).min(Duration::from_secs(1)),
            }
        };
        // Woken by a commit; waits without holding the WriteBack, so that it can go.
        let _ = tokio::time::timeout(wait, notified).await;
    }
}

/// Queues failed uploads again when their time comes.
async fn retry_loop(wb: std::sync::Weak<WriteBack>) {
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let Some(w) = wb.upgrade() else { return };
        let now = Instant::now();
        let (due, undropped) = {
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
            let parked: Vec<u64> = inner
                .entries
                .iter()
                .filter(|(_, e)| e.parked.is_some_and(|t| t <= now))
                .map(|(s, _)| *s)
                .collect();
            for s in &parked {
                inner.unpark(*s, now);
            }
            (due.len() + parked.len(), !inner.undropped.is_empty())
        };
        if undropped {
            w.drop_undropped().await;
        }
        if due > 0 {
            w.work.notify_waiters();
        }
    }
}

/// The upload of `early` and the ETags of its parts still valid, if it can become the
/// object `key` with `meta` (else it is dropped, which aborts it). Every early part's
/// request has ended when this returns: a part sent again must not race an older body.
async fn reuse_early(
    early: Option<EarlyParts>,
    key: &str,
    meta: &UserMeta,
    pin: Option<&str>,
) -> Option<(Upload, HashMap<u32, String>)> {
    let headers_of = headers_from(key, pin).and_then(|f| f.etag);
    let e = early.filter(|e| {
        e.upload.key() == key && e.meta == *meta && e.headers_of.as_deref() == headers_of
    })?;
    let mut sent = HashMap::new();
    for (number, (valid, request)) in e.parts {
        if let Some(etag) = request.await.filter(|_| valid) {
            sent.insert(number, etag);
        }
    }
    Some((e.upload, sent))
}

/// `len` bytes of an entry's file from `at`.
async fn read_range(content: &Content, at: u64, len: u64) -> FsResult<Bytes> {
    let content = content.clone();
    tokio::task::spawn_blocking(move || {
        let mut buf = vec![0u8; len as usize];
        content.read_at(at, &mut buf).map(|_| Bytes::from(buf))
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
    seq: u64,
    key: String,
    size: u64,
    meta: UserMeta,
    cond: Cond,
    replaces: Option<u64>,
    /// Written by a rename (see [`WriteBack::rekey`]); trailers without it end before.
    from: Option<Moved>,
    /// `Entry::landed`; trailers without it end before.
    landed: Vec<String>,
    /// A delta's (its `size` is then the bytes of its ranges); trailers without it end
    /// before.
    delta: Option<Delta>,
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
        out.extend_from_slice(&self.seq.to_le_bytes());
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
        let more = !self.landed.is_empty() || self.delta.is_some();
        if self.from.is_none() && more {
            out.push(0);
        }
        if let Some(m) = &self.from {
            out.push(1);
            put_str(&mut out, &m.key);
            match &m.etag {
                Some(e) => {
                    out.push(1);
                    put_str(&mut out, e);
                }
                None => out.push(0),
            }
            out.extend_from_slice(&m.at.to_le_bytes());
        }
        if more {
            out.extend_from_slice(&(self.landed.len() as u32).to_le_bytes());
            for e in &self.landed {
                put_str(&mut out, e);
            }
        }
        if let Some(d) = &self.delta {
            for v in [d.over, d.size, d.keep] {
                out.extend_from_slice(&v.to_le_bytes());
            }
            out.extend_from_slice(&(d.ranges.len() as u32).to_le_bytes());
            for r in &d.ranges {
                out.extend_from_slice(&r.start.to_le_bytes());
                out.extend_from_slice(&r.end.to_le_bytes());
            }
        }
        out
    }

    fn decode(b: &[u8]) -> Option<Trailer> {
        let mut r = Reader(b);
        let seq = r.u64()?;
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
        let from = match r.take(1).map(|t| t[0]) {
            None | Some(0) => None,
            Some(1) => {
                let key = r.str()?;
                let etag = match r.take(1)?[0] {
                    0 => None,
                    1 => Some(r.str()?),
                    _ => return None,
                };
                Some(Moved {
                    key,
                    etag,
                    at: r.u64()?,
                })
            }
            Some(_) => return None,
        };
        let mut landed = Vec::new();
        if !r.0.is_empty() {
            for _ in 0..r.u32()? {
                landed.push(r.str()?);
            }
        }
        let mut delta = None;
        if !r.0.is_empty() {
            let (over, dsize, keep) = (r.u64()?, r.u64()?, r.u64()?);
            let mut ranges = Vec::new();
            let mut end = 0;
            for _ in 0..r.u32()? {
                let (a, b) = (r.u64()?, r.u64()?);
                // In order, not overlapping, within the file, holding the record's bytes.
                if a < end || b <= a || b > dsize {
                    return None;
                }
                end = b;
                ranges.push(a..b);
            }
            let len: u64 = ranges.iter().map(|r| r.end - r.start).sum();
            if len != size || keep > dsize || over >= seq {
                return None;
            }
            delta = Some(Delta {
                over,
                size: dsize,
                keep,
                ranges,
            });
        }
        r.0.is_empty().then_some(Trailer {
            seq,
            key,
            size,
            meta,
            cond,
            replaces,
            from,
            landed,
            delta,
        })
    }
}

/// The sound entries of `dir` by number, where each is, the segments, and the files that
/// could not be read (path, error); removes entry files that are not sound (commits that
/// never returned) and stray files. A file it cannot read is never taken for a torn one:
/// it is kept (a segment with an unreadable part is never removed either).
struct Recovered {
    entries: BTreeMap<u64, (Trailer, Loc)>,
    segments: Vec<Arc<Segment>>,
    unreadable: Vec<(PathBuf, String)>,
    /// Segments with a part that could not be read.
    damaged: Vec<u64>,
}

fn recover(dir: &Path) -> std::io::Result<Recovered> {
    let mut out = Recovered {
        entries: BTreeMap::new(),
        segments: Vec::new(),
        unreadable: Vec::new(),
        damaged: Vec::new(),
    };
    let mut removed = false;
    let unreadable = |path: PathBuf, e: std::io::Error| {
        tracing::error!(
            "write-back directory: cannot read {} ({e}); kept, not uploaded (see `bucketfs \
             pending`); the next mount tries again",
            path.display()
        );
        (path, e.to_string())
    };
    let mut bad = Vec::new();
    for d in std::fs::read_dir(dir)? {
        let d = d?;
        let name = d.file_name();
        if not_an_entry(&name) {
            continue;
        }
        let name = name.to_string_lossy();
        if let Some(id) = name
            .strip_prefix("seg-")
            .and_then(|n| n.strip_suffix(".wbs"))
            .and_then(|n| n.parse::<u64>().ok())
        {
            match open_segment(id, &d.path()) {
                Ok(Some((seg, recs, err))) => {
                    let seg = Arc::new(seg);
                    for (rec, t) in recs {
                        out.entries.insert(
                            t.seq,
                            (
                                t,
                                Loc::Rec {
                                    seg: seg.clone(),
                                    rec,
                                },
                            ),
                        );
                    }
                    if let Some(e) = err {
                        bad.push(unreadable(d.path(), e));
                        out.damaged.push(id);
                    }
                    out.segments.push(seg);
                }
                Ok(None) => {
                    std::fs::remove_file(d.path())?;
                    removed = true;
                }
                Err(e) => {
                    bad.push(unreadable(d.path(), e));
                    out.damaged.push(id);
                }
            }
            continue;
        }
        if !name.ends_with(".wb") {
            tracing::warn!(
                "write-back directory: removing {} (not an entry)",
                d.path().display()
            );
            std::fs::remove_file(d.path())?;
            removed = true;
            continue;
        }
        match read_entry(&d.path()) {
            // An entry's trailer names the entry its file is named after.
            Ok(Some(t)) if d.path() == entry_path(dir, t.seq) => {
                out.entries.insert(t.seq, (t, Loc::File(d.path())));
            }
            Ok(Some(_)) => {
                tracing::warn!(
                    "write-back directory: removing {} (its trailer names another entry)",
                    d.path().display()
                );
                std::fs::remove_file(d.path())?;
                removed = true;
            }
            Ok(None) => {
                tracing::warn!(
                    "write-back directory: removing {} (a commit that never finished)",
                    d.path().display()
                );
                std::fs::remove_file(d.path())?;
                removed = true;
            }
            Err(e) => bad.push(unreadable(d.path(), e)),
        }
    }
    out.unreadable = bad;
    if removed {
        File::open(dir)?.sync_all()?;
    }
    Ok(out)
}

// Test seam: reads of these files fail with `EIO` (a mount cannot make the local disk fail
// on demand).
#[cfg(test)]
thread_local! {
    static FAIL_READS: std::cell::RefCell<Vec<PathBuf>> = const { std::cell::RefCell::new(Vec::new()) };
}

fn check_readable(path: &Path) -> std::io::Result<()> {
    #[cfg(test)]
    if FAIL_READS.with(|f| f.borrow().iter().any(|p| p == path)) {
        return Err(std::io::Error::from_raw_os_error(libc::EIO));
    }
    let _ = path;
    Ok(())
}

/// A segment file, its sound records (offset, trailer), and the error that stopped the
/// scan (records after it are not known); None: not a segment (a creation that never
/// finished).
type Records = (Segment, Vec<(u64, Trailer)>, Option<std::io::Error>);

fn open_segment(id: u64, path: &Path) -> std::io::Result<Option<Records>> {
    check_readable(path)?;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)?;
    let mut head = [0u8; 16];
    let len = file.metadata()?.len();
    if len < 16 {
        return Ok(None);
    }
    file.read_exact_at(&mut head, 0)?;
    if &head[..8] != SEG_MAGIC {
        return Ok(None);
    }
    let nonce = u64::from_le_bytes(head[8..16].try_into().expect("8 bytes"));
    let len = len.min(SEGMENT_SIZE);
    let mut recs = Vec::new();
    let mut at = REC_ALIGN;
    let mut h = [0u8; REC_HEADER as usize];
    let mut err = None;
    while at + REC_HEADER <= len {
        if let Err(e) = file.read_exact_at(&mut h, at) {
            err = Some(e);
            break;
        }
        let Some((seq, size, tlen)) = parse_record_header(&h, nonce) else {
            at += REC_ALIGN;
            continue;
        };
        let total = REC_HEADER + size + tlen as u64 + 4;
        if at + total > len {
            at += REC_ALIGN;
            continue;
        }
        let mut body = vec![0u8; (size + tlen as u64 + 4) as usize];
        if let Err(e) = file.read_exact_at(&mut body, at + REC_HEADER) {
            err = Some(e);
            break;
        }
        let (content, crc) = body.split_at(body.len() - 4);
        let crc = u32::from_le_bytes(crc.try_into().expect("4 bytes"));
        let t = (crc32fast::hash(content) == crc)
            .then(|| Trailer::decode(&content[size as usize..]))
            .flatten()
            .filter(|t| t.seq == seq && t.size == size);
        if let Some(t) = t {
            recs.push((at, t));
        }
        at += total.div_ceil(REC_ALIGN) * REC_ALIGN;
    }
    Ok(Some((
        Segment {
            id,
            path: path.to_path_buf(),
            file: Arc::new(file),
            nonce,
            sync: SharedSync::default(),
        },
        recs,
        err,
    )))
}

/// A new segment file: its first block (magic, nonce), zeros to its size, fsync'd.
fn create_segment(id: u64, path: &Path) -> std::io::Result<Segment> {
    let file = std::fs::OpenOptions::new()
        .create_new(true)
        .read(true)
        .write(true)
        .mode(0o600)
        .open(path)?;
    let filled = (|| {
        let zeros = vec![0u8; 1 << 20];
        let mut at = 0;
        while at < SEGMENT_SIZE {
            file.write_all_at(&zeros, at)?;
            at += zeros.len() as u64;
        }
        let nonce = write_segment_head(&file)?;
        file.sync_all()?;
        Ok(nonce)
    })();
    let nonce = match filled {
        Ok(n) => n,
        Err(e) => {
            // A disk too full for it: what it took goes back at once, not at the next mount.
            drop(file);
            let _ = std::fs::remove_file(path);
            return Err(e);
        }
    };
    Ok(Segment {
        id,
        path: path.to_path_buf(),
        file: Arc::new(file),
        nonce,
        sync: SharedSync::default(),
    })
}

/// An emptied segment made a fresh one: a new nonce in its first block, synced before it
/// takes a record, so every record it held (uploaded, replaced, torn) is invalid for good.
/// Its blocks stay written, so a record in it still needs only an fdatasync.
fn reuse_segment(seg: Segment) -> std::io::Result<Segment> {
    let nonce = write_segment_head(&seg.file)?;
    seg.file.sync_data()?;
    Ok(Segment {
        nonce,
        sync: SharedSync::default(),
        ..seg
    })
}

/// Writes a segment's first block's magic and a new random nonce; returns the nonce.
fn write_segment_head(file: &File) -> std::io::Result<u64> {
    let mut nonce = [0u8; 8];
    File::open("/dev/urandom")?
        .read_exact_at(&mut nonce, 0)
        .or_else(|_| {
            use std::io::Read;
            File::open("/dev/urandom")?.read_exact(&mut nonce)
        })?;
    let mut head = Vec::from(&SEG_MAGIC[..]);
    head.extend_from_slice(&nonce);
    file.write_all_at(&head, 0)?;
    Ok(u64::from_le_bytes(nonce))
}

fn record_header(nonce: u64, seq: u64, size: u64, tlen: u32) -> [u8; REC_HEADER as usize] {
    let mut h = [0u8; REC_HEADER as usize];
    h[..8].copy_from_slice(REC_MAGIC);
    h[8..16].copy_from_slice(&nonce.to_le_bytes());
    h[16..24].copy_from_slice(&seq.to_le_bytes());
    h[24..32].copy_from_slice(&size.to_le_bytes());
    h[32..36].copy_from_slice(&tlen.to_le_bytes());
    let crc = crc32fast::hash(&h[..60]);
    h[60..].copy_from_slice(&crc.to_le_bytes());
    h
}

fn parse_record_header(h: &[u8], nonce: u64) -> Option<(u64, u64, u32)> {
    if &h[..8] != REC_MAGIC || h[8..16] != nonce.to_le_bytes() {
        return None;
    }
    if crc32fast::hash(&h[..60]).to_le_bytes() != h[60..64] {
        return None;
    }
    let seq = u64::from_le_bytes(h[16..24].try_into().ok()?);
    let size = u64::from_le_bytes(h[24..32].try_into().ok()?);
    let tlen = u32::from_le_bytes(h[32..36].try_into().ok()?);
    (size <= SEGMENT_SIZE && tlen as u64 <= SEGMENT_SIZE).then_some((seq, size, tlen))
}

/// Removes what `loc` holds at start (an entry replaced by another): a record's header
/// zeroed, a file removed. Made durable by the caller's later syncs or not at all (a
/// replaced entry found again is dropped again).
fn drop_loc_blocking(loc: &Loc) {
    match loc {
        Loc::File(p) => {
            let _ = std::fs::remove_file(p);
        }
        Loc::Rec { seg, rec } => {
            let _ = seg.file.write_all_at(&[0u8; REC_HEADER as usize], *rec);
        }
    }
}

/// The trailer of a sound entry file (footer magic, CRC of bytes and trailer); None: not
/// sound; an error: it could not be read.
fn read_entry(path: &Path) -> std::io::Result<Option<Trailer>> {
    check_readable(path)?;
    let data = std::fs::read(path)?;
    Ok(check_entry(&data))
}

fn check_entry(data: &[u8]) -> Option<Trailer> {
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

/// The ETag S3 gives a single PUT of `body` (its MD5, quoted): how an upload whose answer
/// was lost is told to be ours.
pub(crate) fn put_etag(body: &[u8]) -> String {
    format!("\"{}\"", hex::encode(Md5::digest(body)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A mount finding the lock held waits for its holder (a daemon just unmounted, storing
    /// what it was given: `umount && mount` was refused at once), then names it.
    #[test]
    fn the_lock_is_waited_for_then_its_holder_named() {
        let dir = tempfile::tempdir().unwrap();
        let held = lock_dir(dir.path()).unwrap();
        let e = lock_dir_within(dir.path(), Duration::from_millis(300)).unwrap_err();
        assert!(
            e.contains(&format!(
                "in use by another bucketfs (pid {})",
                std::process::id()
            )),
            "{e}"
        );
        let release = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            drop(held);
        });
        lock_dir_within(dir.path(), Duration::from_secs(10)).unwrap();
        release.join().unwrap();
    }
    use std::collections::BTreeSet;

    /// A failed fdatasync may have carried the bytes of a writer that took its ticket after
    /// it started, and the kernel reports a writeback error once: that writer's own later
    /// sync succeeding proves nothing. So after a failure no sync of the file succeeds (its
    /// records go to another segment); a ticket covered before the failure stays good.
    #[test]
    fn after_a_failed_sync_no_later_sync_of_the_file_succeeds() {
        let eio = || Err(std::io::Error::from_raw_os_error(libc::EIO));
        let s = SharedSync::default();
        assert!(s.sync_by(|| Ok(())).unwrap(), "the first sync runs");
        assert!(s.sync_by(eio).is_err());
        let later = s.sync_by(|| Ok(()));
        assert!(
            later.is_err(),
            "a sync after a failed one said the bytes were durable"
        );
        assert!(s.poisoned());
    }

    #[test]
    fn trailer_round_trips() {
        let mut meta = UserMeta::new();
        meta.insert("mode".into(), "33188".into());
        for cond in [Cond::Absent, Cond::Match("\"abc\"".into()), Cond::Any] {
            let t = Trailer {
                seq: 3,
                key: "a/b\nc".into(),
                size: 42,
                meta: meta.clone(),
                cond,
                replaces: Some(7),
                from: None,
                landed: Vec::new(),
                delta: None,
            };
            assert_eq!(Trailer::decode(&t.encode()), Some(t.clone()));
            for etag in [None, Some("\"e\"".to_string())] {
                let t = Trailer {
                    from: Some(Moved {
                        key: "old/name".into(),
                        etag,
                        at: 1_700_000_000,
                    }),
                    ..t.clone()
                };
                assert_eq!(Trailer::decode(&t.encode()), Some(t.clone()));
                let t = Trailer {
                    landed: vec!["\"a\"".into(), "\"b-2\"".into()],
                    ..t
                };
                assert_eq!(Trailer::decode(&t.encode()), Some(t));
            }
            let t = Trailer {
                landed: vec!["\"a\"".into()],
                ..t.clone()
            };
            assert_eq!(Trailer::decode(&t.encode()), Some(t.clone()));
            let delta = Delta {
                over: 2,
                size: 100,
                keep: 90,
                ranges: vec![0..10, 50..82],
            };
            for landed in [vec![], vec!["\"a\"".to_string()]] {
                let t = Trailer {
                    delta: Some(delta.clone()),
                    landed,
                    ..t.clone()
                };
                assert_eq!(Trailer::decode(&t.encode()), Some(t.clone()));
                // Ranges that do not add up to the record's bytes are not a delta.
                let t = Trailer { size: 41, ..t };
                assert_eq!(Trailer::decode(&t.encode()), None);
            }
        }
    }

    async fn open_wb<S: ObjectStore + 'static>(
        dir: &Path,
        store: &Arc<S>,
    ) -> (Arc<WriteBack>, usize) {
        let store: Arc<dyn ObjectStore> = store.clone();
        let cfg = WriteBackConfig {
            dir: dir.to_path_buf(),
            max_bytes: 1 << 30,
            concurrency: 2,
            fsync_waits_upload: false,
            delay: Duration::from_secs(3600),
            space_wait: Duration::from_secs(60),
            store: "memory".to_string(),
        };
        let (wb, n) = WriteBack::open(
            cfg,
            store.clone(),
            Uploads::new(store),
            8 << 20,
            None,
            Arc::default(),
        )
        .unwrap();
        wb.adopt(|_| 0);
        (wb, n)
    }

    /// Waits for the first segment, so small entries go to records.
    /// A write-back directory in a new temp dir over a new memory store, opened and with
    /// its first segment ready.
    async fn started_wb() -> (
        tempfile::TempDir,
        Arc<bucketfs_store::memory::MemoryStore>,
        Arc<WriteBack>,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(bucketfs_store::memory::MemoryStore::new());
        let (wb, _) = open_wb(dir.path(), &store).await;
        wait_for_segment(&wb).await;
        (dir, store, wb)
    }

    /// The names of the segment files in `dir`, sorted.
    fn segment_files(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".wbs"))
            .collect();
        v.sort();
        v
    }

    /// The id of the segment being filled.
    fn current_segment(wb: &WriteBack) -> Option<u64> {
        wb.inner.lock().segs.current.as_ref().map(|c| c.0.id)
    }

    async fn wait_for_segment(wb: &WriteBack) {
        for _ in 0..200 {
            if wb.inner.lock().segs.spare.is_some() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn put(wb: &WriteBack, key: &str, body: &[u8]) -> u64 {
        let mut slot = wb
            .begin(
                key,
                body.len() as u64,
                &UserMeta::new(),
                None,
                Cond::Absent,
                None,
                true,
            )
            .await
            .unwrap();
        slot.write(Bytes::copy_from_slice(body)).await.unwrap();
        wb.commit(slot, 0, false).await.unwrap()
    }

    /// An entry whose failed upload the retry loop had queued again, held by a rename or an
    /// unlink that then failed, is queued again at its release: it was left failed with no
    /// next try, never retried while the mount lasted.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_upload_queued_again_and_held_is_still_retried() {
        let (_dir, _store, wb) = started_wb().await;
        let seq = put(&wb, "f", b"v1").await;
        {
            // As the retry loop leaves a failed upload whose time came.
            let mut inner = wb.inner.lock();
            let e = inner.entries.get_mut(&seq).unwrap();
            e.error = Some("refused".into());
            e.tries = 1;
            assert_eq!((e.status, e.next_try), (Status::Queued, None));
        }
        assert!(matches!(wb.hold(seq).await, Holding::Held { .. }));
        wb.release(seq);
        let inner = wb.inner.lock();
        let e = &inner.entries[&seq];
        assert!(
            e.status == Status::Queued && inner.ready.contains(&seq),
            "left {:?} with next try {:?}",
            e.status,
            e.next_try
        );
    }

    /// A commit whose sync fails (a disk error) after its record's header was written is
    /// refused, and its record does not come back at a restart (the page cache still holds
    /// the header after a kill -9): the version whose close failed was uploaded, even over
    /// an unlink of the file made since.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_record_whose_sync_failed_does_not_come_back_at_a_restart() {
        let (dir, store, wb) = started_wb().await;
        put(&wb, "kept", b"committed").await;
        let body = b"close failed";
        let mut slot = wb
            .begin(
                "k",
                body.len() as u64,
                &UserMeta::new(),
                None,
                Cond::Absent,
                None,
                true,
            )
            .await
            .unwrap();
        slot.write(Bytes::from_static(body)).await.unwrap();
        let Loc::Rec { seg, .. } = &slot.loc else {
            panic!("a small version goes to a record")
        };
        seg.sync.state.lock().poisoned = true;
        assert!(wb.commit(slot, 0, false).await.is_err());
        drop(wb);
        let (wb, n) = open_wb(dir.path(), &store).await;
        assert_eq!(n, 1, "only the committed version is found");
        wb.drain(Duration::from_secs(5), |_, _| {}).await;
        assert!(store.head("k").await.is_err(), "the failed version went up");
        assert!(store.head("kept").await.is_ok());
    }

    /// For each `(from, to, pinned)`: `from` holds "FROM v1" in `mem`; a version "FROM v2"
    /// committed through `store` is moved to `to` by a rename recording the object at
    /// `from` (its real ETag if `pinned`, else a stale one), and the daemon is killed before
    /// the rename said `moved`. The next mount is left to the caller.
    async fn renames_cut_by_a_crash<S: ObjectStore + 'static>(
        dir: &Path,
        store: &Arc<S>,
        mem: &bucketfs_store::memory::MemoryStore,
        renames: &[(&str, &str, bool)],
    ) {
        for (from, ..) in renames {
            let body = Bytes::from(format!("{from} v1"));
            mem.put(from, body, &UserMeta::new()).await.unwrap();
        }
        let (wb, _) = open_wb(dir, store).await;
        for &(from, to, pinned) in renames {
            let etag = match pinned {
                true => mem.head(from).await.unwrap().etag,
                false => Some("\"stale\"".into()),
            };
            let seq = put(&wb, from, format!("{from} v2").as_bytes()).await;
            assert!(matches!(wb.hold(seq).await, Holding::Held { .. }));
            wb.rekey(seq, to, Cond::Any, Some(Moved::now(from, etag)), None)
                .await
                .unwrap();
        }
        drop(wb);
        tokio::time::sleep(Duration::from_millis(1200)).await;
    }

    /// The bytes of `key` in `mem`, if it is there.
    async fn object(mem: &bucketfs_store::memory::MemoryStore, key: &str) -> Option<Vec<u8>> {
        let got = mem.get_range(key, 0..100, None).await;
        got.ok().map(|b| b.to_vec())
    }

    /// A rename's entry found at start (the daemon died between moving it and finishing the
    /// bucket's part) deletes the object it moved from the old name, only if still that
    /// one, then goes up under its new name.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_renames_entry_found_at_start_finishes_the_rename() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(bucketfs_store::memory::MemoryStore::new());
        let renames = [("a", "b", true), ("c", "d", false)];
        renames_cut_by_a_crash(dir.path(), &store, &store, &renames).await;
        let (wb, n) = open_wb(dir.path(), &store).await;
        assert_eq!(n, 2);
        wb.drain(Duration::from_secs(5), |_, _| {}).await;
        assert_eq!(object(&store, "b").await.as_deref(), Some(&b"a v2"[..]));
        assert_eq!(
            object(&store, "a").await,
            None,
            "the old name's object stayed"
        );
        assert_eq!(object(&store, "d").await.as_deref(), Some(&b"c v2"[..]));
        assert_eq!(
            object(&store, "c").await.as_deref(),
            Some(&b"c v1"[..]),
            "an object the rename did not move was deleted"
        );
    }

    /// A rename that finished (the old name deleted), then a file made again at the old name
    /// with the same bytes and uploaded, the renamed file's entry still waiting when the
    /// daemon stops: the next start leaves the new file. Its record of the rename held the
    /// local clock at the rename plus a second, and a version with the same ETag made within
    /// that was deleted as the rename's leftover; it holds the moved version's own time now.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_file_made_again_at_a_renamed_name_is_not_taken_for_the_renames_leftover() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(bucketfs_store::memory::MemoryStore::new());
        store
            .put("a", Bytes::new(), &UserMeta::new())
            .await
            .unwrap();
        let o = store.head("a").await.unwrap();
        {
            let (wb, _) = open_wb(dir.path(), &store).await;
            let seq = put(&wb, "a", b"v2").await;
            assert!(matches!(wb.hold(seq).await, Holding::Held { .. }));
            let from = Moved::of("a", o.etag.clone(), o.last_modified);
            let new = wb
                .rekey(seq, "b", Cond::Any, Some(from), None)
                .await
                .unwrap();
            wb.moved(new, Cond::Absent);
            store.delete("a").await.unwrap();
            // Made again a second later, empty like the first.
            tokio::time::sleep(Duration::from_millis(1050)).await;
            store
                .put("a", Bytes::new(), &UserMeta::new())
                .await
                .unwrap();
        }
        tokio::time::sleep(Duration::from_millis(1200)).await;
        let (wb, _) = open_wb(dir.path(), &store).await;
        wb.drain(Duration::from_secs(5), |_, _| {}).await;
        assert_eq!(object(&store, "b").await.as_deref(), Some(&b"v2"[..]));
        assert!(
            store.head("a").await.is_ok(),
            "the file made again at the old name was deleted"
        );
    }

    /// A rename's entry found at start and removed or replaced at once (the file unlinked
    /// or written again right after the mount) still finishes the rename: the entry was the
    /// only record of the old name's object to delete, which came back as a second file.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_renames_entry_found_at_start_and_dropped_at_once_still_finishes_the_rename() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(bucketfs_store::memory::MemoryStore::new());
        let renames = [("a", "b", true), ("c", "d", true)];
        renames_cut_by_a_crash(dir.path(), &store, &store, &renames).await;
        let (wb, n) = open_wb(dir.path(), &store).await;
        assert_eq!(n, 2);
        // b unlinked, d written again, at once (before they go up, unless the upload
        // workers are first, as on a loaded machine: the old names must be gone either way).
        let (b, d) = {
            let inner = wb.inner.lock();
            (
                inner.by_key.get("b").copied(),
                inner.by_key.get("d").copied(),
            )
        };
        if let Some(b) = b {
            if let Holding::Held { .. } = wb.hold(b).await {
                wb.discard(b).await.unwrap();
            }
        }
        // Over the version of d that went up already, if it did.
        let cond = match d {
            Some(_) => Cond::Absent,
            None => Cond::Any,
        };
        let mut slot = wb
            .begin("d", 4, &UserMeta::new(), d, cond, None, true)
            .await
            .unwrap();
        slot.write(Bytes::from_static(b"d v3")).await.unwrap();
        wb.commit(slot, 0, false).await.unwrap();
        wb.drain(Duration::from_secs(5), |_, _| {}).await;
        assert_eq!(
            object(&store, "a").await,
            None,
            "the unlinked file's old name came back"
        );
        assert_eq!(
            object(&store, "c").await,
            None,
            "the rewritten file's old name came back"
        );
        assert_eq!(object(&store, "d").await.as_deref(), Some(&b"d v3"[..]));
    }

    /// The same when the store does not answer at start for as long as the rename is tried
    /// there: the file unlinked, written again or renamed again afterwards still finishes it
    /// (the unlink and the rename delete the old name first; the new version carries the
    /// move to its upload).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_renames_entry_whose_finish_failed_at_start_still_finishes_it_when_dropped() {
        use bucketfs_store::fault::{Fault, FaultStore};
        use bucketfs_store::metrics::Op;
        let dir = tempfile::tempdir().unwrap();
        let mem = Arc::new(bucketfs_store::memory::MemoryStore::new());
        let store = Arc::new(FaultStore::new(mem.clone()));
        let renames = [("a", "b", true), ("c", "d", true), ("e", "f", true)];
        renames_cut_by_a_crash(dir.path(), &store, &mem, &renames).await;
        let down = StoreError::Other("store down".into());
        store.inject(Op::Head, 0, None, Fault::Error(down));
        let (wb, _) = open_wb(dir.path(), &store).await;
        let (b, d, f) = {
            let inner = wb.inner.lock();
            (inner.by_key["b"], inner.by_key["d"], inner.by_key["f"])
        };
        // Let go after the tries at start, then failed at its upload's first step.
        assert!(matches!(wb.hold(b).await, Holding::Held { .. }));
        assert!(matches!(wb.hold(f).await, Holding::Held { .. }));
        // d written again: begun while its entry still has the move to finish.
        let mut slot = wb
            .begin("d", 4, &UserMeta::new(), Some(d), Cond::Absent, None, true)
            .await
            .unwrap();
        store.clear();
        wb.discard(b).await.unwrap();
        let moved = Moved::now("f", None);
        let g = wb
            .rekey(f, "g", Cond::Any, Some(moved), None)
            .await
            .unwrap();
        wb.moved(g, Cond::Absent);
        slot.write(Bytes::from_static(b"d v3")).await.unwrap();
        wb.commit(slot, 0, false).await.unwrap();
        wb.drain(Duration::from_secs(5), |_, _| {}).await;
        assert_eq!(
            object(&mem, "a").await,
            None,
            "the unlinked file's old name came back"
        );
        assert_eq!(object(&mem, "b").await, None);
        assert_eq!(
            object(&mem, "c").await,
            None,
            "the rewritten file's old name came back"
        );
        assert_eq!(object(&mem, "d").await.as_deref(), Some(&b"d v3"[..]));
        assert_eq!(
            object(&mem, "e").await,
            None,
            "the renamed file's first name came back"
        );
        assert_eq!(object(&mem, "g").await.as_deref(), Some(&b"e v2"[..]));
    }

    /// Entries committed into a segment come back after a restart, except one whose bytes
    /// were torn (its CRC fails) and one removed; bytes that look like a record header (of
    /// another segment's nonce) inside a file are not taken for one.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn segment_records_survive_a_restart_and_torn_ones_do_not() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(bucketfs_store::memory::MemoryStore::new());
        let (wb, n) = open_wb(dir.path(), &store).await;
        assert_eq!(n, 0);
        wait_for_segment(&wb).await;
        let forged = {
            let mut b = vec![0u8; 8192];
            b[4096 - 64..4096].copy_from_slice(&record_header(7, 99, 10, 10));
            b
        };
        let a = put(&wb, "a", b"alpha").await;
        let b = put(&wb, "b", &forged).await;
        let c = put(&wb, "c", b"gamma").await;
        let d = put(&wb, "d", b"delta").await;
        assert_eq!(
            wb.hold(d).await,
            Holding::Held {
                cond: Cond::Absent,
                conflict: false
            }
        );
        wb.discard(d).await.unwrap();
        let locs: Vec<Loc> = [a, b, c]
            .iter()
            .map(|s| wb.inner.lock().entries[s].content.head().clone())
            .collect();
        assert!(locs.iter().all(|l| matches!(l, Loc::Rec { .. })));
        // Tear c: one byte of its bytes changed.
        if let Loc::Rec { seg, rec } = &locs[2] {
            seg.file.write_all_at(b"X", rec + REC_HEADER + 1).unwrap();
        }
        drop(locs);
        drop(wb);
        tokio::time::sleep(Duration::from_millis(1200)).await;
        let (wb, n) = open_wb(dir.path(), &store).await;
        assert_eq!(n, 2);
        // Recovered entries go up at once: some may be uploaded already.
        let keys: BTreeSet<String> = wb.pending().into_iter().map(|p| p.key).collect();
        let ab: BTreeSet<String> = ["a", "b"].iter().map(|k| k.to_string()).collect();
        assert!(keys.is_subset(&ab), "{keys:?}");
        wb.drain(Duration::from_secs(5), |_, _| {}).await;
        assert_eq!(
            &store.get_range("a", 0..100, None).await.unwrap()[..],
            b"alpha"
        );
        assert_eq!(
            &store.get_range("b", 0..9000, None).await.unwrap()[..],
            &forged[..]
        );
        assert!(store.head("c").await.is_err());
    }

    /// A segment whose records all went up is reused for the next segment with a new nonce
    /// (no new 64 MiB file of zeros), and a record its old nonce would have made valid (a
    /// header whose zeroing a crash lost) is not taken for one after a restart.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_emptied_segment_is_reused_and_its_old_records_never_come_back() {
        // Uploads wait for the drains (see `open_wb`).
        let (dir, store, wb) = started_wb().await;
        let body = vec![7u8; 3 << 20];
        // Fill the first segment until the second takes records; all go up.
        let first = {
            put(&wb, "k0", &body).await;
            current_segment(&wb).unwrap()
        };
        let mut n = 1;
        while current_segment(&wb) == Some(first) {
            put(&wb, &format!("k{n}"), &body).await;
            n += 1;
        }
        wb.drain(Duration::from_secs(5), |_, _| {}).await;
        let old = {
            let inner = wb.inner.lock();
            let f = inner.segs.free.iter().find(|s| s.id == first);
            let f = f.expect("the emptied first segment is kept for reuse");
            (f.nonce, f.file.clone())
        };
        // What a lost zeroing would leave: a record valid under the old nonce.
        let ghost = b"ghost bytes";
        let t = Trailer {
            seq: 1,
            key: "ghost".into(),
            size: ghost.len() as u64,
            meta: UserMeta::new(),
            cond: Cond::Any,
            replaces: None,
            from: None,
            landed: Vec::new(),
            delta: None,
        }
        .encode();
        let mut rec = record_header(old.0, 1, ghost.len() as u64, t.len() as u32).to_vec();
        let mut content = ghost.to_vec();
        content.extend_from_slice(&t);
        let crc = crc32fast::hash(&content);
        rec.extend_from_slice(&content);
        rec.extend_from_slice(&crc.to_le_bytes());
        old.1.write_all_at(&rec, REC_ALIGN).unwrap();
        drop(old.1);
        let files_before = segment_files(dir.path());
        // Fill the second one until it wants a spare: the first becomes it.
        while !wb.spare_asked() {
            put(&wb, &format!("k{n}"), &body).await;
            n += 1;
        }
        wait_for_segment(&wb).await;
        let spare = wb.inner.lock().segs.spare.clone().expect("a spare segment");
        assert_eq!(spare.id, first, "the emptied segment is the new spare");
        assert_ne!(spare.nonce, old.0, "under a new nonce");
        assert_eq!(
            segment_files(dir.path()),
            files_before,
            "no new segment file"
        );
        // A restart finds nothing in it (the copy stands for it: an unmount removes it).
        let copy = dir.path().join(format!("seg-{:020}.wbs", 1000));
        std::fs::copy(&spare.path, &copy).unwrap();
        drop(spare);
        wb.drain(Duration::from_secs(5), |_, _| {}).await;
        drop(wb);
        tokio::time::sleep(Duration::from_millis(1200)).await;
        let (_wb, found) = open_wb(dir.path(), &store).await;
        assert_eq!(found, 0, "no record of the reused segment comes back");
        assert!(store.head("ghost").await.is_err());
        assert_eq!(
            store.get_range("k1", 0..10, None).await.unwrap()[..],
            [7u8; 10]
        );
    }

    /// A mount that commits little writes one segment's zeros, not two: the next segment is
    /// made once the first holds a quarter of its size.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_next_segment_is_made_once_the_first_is_a_quarter_full() {
        let (dir, _store, wb) = started_wb().await;
        for i in 0..50 {
            put(&wb, &format!("small{i}"), &[1u8; 4096]).await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!wb.spare_asked());
        assert_eq!(segment_files(dir.path()).len(), 1);
        let body = vec![7u8; 3 << 20];
        let mut n = 0;
        while !wb.spare_asked() {
            put(&wb, &format!("k{n}"), &body).await;
            n += 1;
        }
        assert!(
            (5..=6).contains(&n),
            "{n} records of 3 MiB before the next segment"
        );
        wait_for_segment(&wb).await;
        assert_eq!(segment_files(dir.path()).len(), 2);
    }

    /// An emptied segment whose file something still reads (a staging file shared with a
    /// record, an orphan's bytes) is not reused: a new one is made.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_segment_still_read_is_not_reused() {
        // Uploads wait for the drain (see `open_wb`).
        let (_dir, _store, wb) = started_wb().await;
        let body = vec![7u8; 3 << 20];
        let s0 = put(&wb, "k0", &body).await;
        let held = wb.inner.lock().entries[&s0].content.head().open().unwrap();
        let first = current_segment(&wb).unwrap();
        let mut n = 1;
        while current_segment(&wb) == Some(first) {
            put(&wb, &format!("k{n}"), &body).await;
            n += 1;
        }
        wb.drain(Duration::from_secs(5), |_, _| {}).await;
        while !wb.spare_asked() {
            put(&wb, &format!("k{n}"), &body).await;
            n += 1;
        }
        wait_for_segment(&wb).await;
        let spare = wb.inner.lock().segs.spare.as_ref().map(|s| s.id);
        assert!(spare.is_some_and(|id| id != first), "{spare:?}");
        drop(held);
    }

    /// A write-back directory in `dir` uploading at once to `store` with `concurrency`
    /// workers and 8 MiB parts, its part buffers from `budget`.
    fn budgeted_wb(
        dir: &Path,
        store: Arc<dyn ObjectStore>,
        budget: &Arc<MemoryBudget>,
        concurrency: usize,
    ) -> Arc<WriteBack> {
        let cfg = WriteBackConfig {
            dir: dir.to_path_buf(),
            max_bytes: 1 << 30,
            concurrency,
            fsync_waits_upload: false,
            delay: Duration::ZERO,
            space_wait: Duration::from_secs(60),
            store: "memory".to_string(),
        };
        let (wb, _) = WriteBack::open(
            cfg,
            store.clone(),
            Uploads::new(store),
            8 << 20,
            Some(budget.clone()),
            Arc::default(),
        )
        .unwrap();
        wb
    }

    /// A large entry goes up as a multipart upload in the part layout, its part buffers taken
    /// from the memory budget and given back.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn large_entries_upload_in_parts_from_the_budget() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(bucketfs_store::memory::MemoryStore::new());
        let budget = MemoryBudget::new(64 << 20, Arc::default());
        let free = budget.available();
        let wb = budgeted_wb(dir.path(), store.clone(), &budget, 2);
        let body: Vec<u8> = (0..(20u32 << 20)).map(|i| (i % 251) as u8).collect();
        put(&wb, "big", &body).await;
        wb.drain(Duration::from_secs(5), |_, _| {}).await;
        let got = store.get_range("big", 0..(21 << 20), None).await.unwrap();
        assert!(got[..] == body[..], "bytes differ");
        let etag = store.head("big").await.unwrap().etag.unwrap();
        assert!(etag.ends_with("-3\""), "three parts: {etag}");
        assert_eq!(budget.available(), free, "part buffers not given back");
    }

    /// Uploads that do not move (a stalled store) hold at most a quarter of the memory
    /// budget: 32 workers with 8 MiB parts, entries of 24 MiB, a 64 MiB budget of which
    /// writers' parts sent early hold the half they may; a commit's buffer is still there at
    /// once (an earlier build let the uploads take all of the budget, a later one half of it,
    /// so a close that needed memory waited for the stalled store).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn stalled_uploads_leave_memory_for_commits() {
        use bucketfs_store::fault::{Fault, FaultStore};
        use bucketfs_store::metrics::Op;
        let dir = tempfile::tempdir().unwrap();
        let mem = Arc::new(bucketfs_store::memory::MemoryStore::new());
        let fault = Arc::new(FaultStore::new(mem.clone()));
        let hang = Fault::Delay(Duration::from_secs(3600));
        fault.inject(Op::UploadPart, 0, None, hang.clone());
        fault.inject(Op::Put, 0, None, hang);
        let budget = MemoryBudget::new(64 << 20, Arc::default());
        let wb = budgeted_wb(dir.path(), fault.clone(), &budget, 32);
        let _early = budget
            .try_buffer_lasting(32 << 20, true)
            .expect("half the budget");
        let body = vec![7u8; 24 << 20];
        for i in 0..4 {
            put(&wb, &format!("big{i}"), &body).await;
        }
        // The uploads start and take what they may.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let free = budget.available();
        assert!(
            free < 32 << 20,
            "no upload took memory: the test proves nothing"
        );
        let commit = tokio::time::timeout(Duration::from_secs(2), budget.buffer(8 << 20)).await;
        assert!(
            commit.is_ok(),
            "a commit's 8 MiB waited for the stalled store ({} MiB of 64 free)",
            free >> 20
        );
    }

    /// An entry file whose trailer names another entry than its file name (a file that
    /// holds an entry image it did not commit: a copy, a writer's bytes) is not taken for
    /// one at start: removed, never uploaded.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_entry_file_named_for_another_entry_is_not_recovered() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(bucketfs_store::memory::MemoryStore::new());
        let (wb, _) = open_wb(dir.path(), &store).await;
        let seq = put(&wb, "big", &vec![5u8; 5 << 20]).await;
        let path = entry_path(dir.path(), seq);
        let image = std::fs::read(&path).unwrap();
        drop(wb);
        tokio::time::sleep(Duration::from_millis(200)).await;
        std::fs::remove_file(&path).unwrap();
        std::fs::write(entry_path(dir.path(), seq + 1000), &image).unwrap();
        let (wb, n) = open_wb(dir.path(), &store).await;
        assert_eq!(n, 0, "an entry image under another name was recovered");
        assert!(wb.pending().is_empty());
        assert!(!entry_path(dir.path(), seq + 1000).exists());
    }

    /// The memory store with each UploadPart taking 50 ms; the most in flight at once.
    struct SlowParts {
        inner: Arc<bucketfs_store::memory::MemoryStore>,
        now: std::sync::atomic::AtomicUsize,
        most: std::sync::atomic::AtomicUsize,
    }

    #[async_trait::async_trait]
    impl bucketfs_store::layer::StoreLayer for SlowParts {
        type Inner = bucketfs_store::memory::MemoryStore;
        fn inner(&self) -> &Self::Inner {
            &self.inner
        }
        async fn upload_part(
            &self,
            key: &str,
            upload_id: &str,
            part_number: u32,
            body: Bytes,
        ) -> bucketfs_store::StoreResult<String> {
            let n = self.now.fetch_add(1, Ordering::SeqCst) + 1;
            self.most.fetch_max(n, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(50)).await;
            self.now.fetch_sub(1, Ordering::SeqCst);
            self.inner
                .upload_part(key, upload_id, part_number, body)
                .await
        }
    }

    /// A large entry's parts go up several at a time, not one after another (a 1 GiB file
    /// took 5 s to drain against 2 for the same upload in sync mode), but never more than
    /// one buffer per worker in all; the ETag the uploader expects, from the parts' ETags,
    /// is the one the store gives.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_large_entrys_parts_upload_at_once_and_its_etag_is_known() {
        let dir = tempfile::tempdir().unwrap();
        let mem = Arc::new(bucketfs_store::memory::MemoryStore::new());
        let store = Arc::new(SlowParts {
            inner: mem.clone(),
            now: Default::default(),
            most: Default::default(),
        });
        let (wb, _) = open_wb(dir.path(), &store).await;
        let body: Vec<u8> = (0..(50u32 << 20)).map(|i| (i % 253) as u8).collect();
        let seq = put(&wb, "big", &body).await;
        let content = wb.inner.lock().entries[&seq].content.clone();
        let (r, ours) = wb
            .upload_multipart(
                "copy",
                body.len() as u64,
                &UserMeta::new(),
                None,
                &content,
                None,
            )
            .await;
        let etag = r.unwrap();
        assert_eq!(ours, etag);
        assert_eq!(mem.head("copy").await.unwrap().etag.unwrap(), etag);
        let most = store.most.load(Ordering::SeqCst);
        assert!(most > 1, "parts went up one at a time");
        // No more part buffers at once than workers (2 here): the budget is shared.
        assert!(most <= 2, "{most} parts in flight");
        wb.drain(Duration::from_secs(5), |_, _| {}).await;
        let got = mem.get_range("big", 0..(51 << 20), None).await.unwrap();
        assert!(got[..] == body[..], "bytes differ");
    }

    /// An entry file and a segment that cannot be read at start (EIO) are kept, listed as
    /// unreadable and counted, not taken for torn commits and removed; the next start that
    /// can read them uploads them.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn unreadable_entries_are_kept_and_listed() {
        let (dir, store, wb) = started_wb().await;
        let big = vec![7u8; 5 << 20];
        let a = put(&wb, "a", b"alpha").await;
        let b = put(&wb, "b", &big).await;
        let paths: Vec<PathBuf> = [a, b]
            .iter()
            .map(|s| match wb.inner.lock().entries[s].content.head() {
                Loc::Rec { seg, .. } => seg.path.clone(),
                Loc::File(p) => p.clone(),
            })
            .collect();
        assert!(paths[0].to_string_lossy().ends_with(".wbs"));
        assert!(paths[1].to_string_lossy().ends_with(".wb"));
        drop(wb);
        tokio::time::sleep(Duration::from_millis(1200)).await;
        FAIL_READS.with(|f| *f.borrow_mut() = paths.clone());
        let (wb, n) = open_wb(dir.path(), &store).await;
        FAIL_READS.with(|f| f.borrow_mut().clear());
        assert_eq!(n, 0);
        let p = wb.pending();
        assert_eq!(p.len(), 2, "{p:?}");
        assert!(p.iter().all(|f| f.state == "unreadable"), "{p:?}");
        assert_eq!(wb.counts().0, 2);
        assert_eq!(wb.counts().2, 2);
        assert!(
            paths.iter().all(|p| p.exists()),
            "an unreadable entry was removed"
        );
        drop(wb);
        tokio::time::sleep(Duration::from_millis(1200)).await;
        let (wb, n) = open_wb(dir.path(), &store).await;
        assert_eq!(n, 2);
        wb.drain(Duration::from_secs(5), |_, _| {}).await;
        assert_eq!(
            &store.get_range("a", 0..100, None).await.unwrap()[..],
            b"alpha"
        );
        assert_eq!(
            store
                .get_range("b", 0..(6 << 20), None)
                .await
                .unwrap()
                .len(),
            big.len()
        );
    }

    async fn delta(wb: &WriteBack, key: &str, prev: u64, size: u64, c: Changes, b: &[u8]) -> u64 {
        let meta = UserMeta::new();
        let mut slot = wb
            .begin(key, size, &meta, Some(prev), Cond::Absent, Some(c), true)
            .await
            .unwrap();
        assert!(slot.is_delta(), "a whole commit");
        slot.write(Bytes::copy_from_slice(b)).await.unwrap();
        wb.commit(slot, 0, false).await.unwrap()
    }

    /// Deltas over a waiting entry come back after a restart as one file (the whole
    /// version, then each delta's bytes, cut where the file was cut); a chain whose oldest
    /// record is gone (what a crash in the middle of dropping an uploaded chain leaves, as
    /// records go oldest first) is removed, never uploaded as an older version.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn deltas_come_back_after_a_restart_and_a_chain_without_its_base_does_not() {
        let (dir, store, wb) = started_wb().await;
        let mut want: Vec<u8> = (0..10240u32).map(|i| (i % 251) as u8).collect();
        let a = put(&wb, "a", &want).await;
        let c = Changes {
            keep: 10240,
            ranges: std::iter::once(100..200).collect(),
        };
        let d1 = delta(&wb, "a", a, 10240, c, &[1; 100]).await;
        want[100..200].fill(1);
        // Cut to 4,000 bytes, grown to 12,000, 10 bytes written at 5,000.
        let c = Changes {
            keep: 4000,
            ranges: std::iter::once(5000..5010).collect(),
        };
        let d2 = delta(&wb, "a", d1, 12000, c, &[2; 10]).await;
        want.truncate(4000);
        want.resize(12000, 0);
        want[5000..5010].fill(2);
        assert_eq!(wb.inner.lock().entries[&d2].content.0.len(), 3);
        assert_eq!(wb.inner.lock().entries.len(), 1);
        let b = put(&wb, "b", &[3; 10000]).await;
        let c = Changes {
            keep: 10000,
            ranges: std::iter::once(0..10).collect(),
        };
        let bd = delta(&wb, "b", b, 10000, c, &[4; 10]).await;
        let base = wb.inner.lock().entries[&bd].content.0[0].loc.clone();
        drop_loc_blocking(&base);
        drop(base);
        drop(wb);
        tokio::time::sleep(Duration::from_millis(1200)).await;
        let (wb, n) = open_wb(dir.path(), &store).await;
        assert_eq!(n, 1);
        wb.drain(Duration::from_secs(5), |_, _| {}).await;
        let got = store.get_range("a", 0..20000, None).await.unwrap();
        assert!(got[..] == want[..], "the version uploaded differs");
        assert!(store.head("b").await.is_err(), "a cut chain went up");
        assert_eq!(wb.counts().0, 0);
    }

    /// A caller that panics between a commit's begin and its commit (a bug, or a future
    /// dropped) gives back what the slot held: before, the entry it replaced stayed held,
    /// never went up, and the key's next commit waited for it for good. Both kinds: a whole
    /// commit and a delta.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_commit_dropped_between_begin_and_commit_holds_nothing() {
        let (_dir, store, wb) = started_wb().await;
        let v1 = put(&wb, "a", &[1; 8192]).await;
        let room = wb.inner.lock().bytes;
        for changes in [
            None,
            Some(Changes {
                keep: 8192,
                ranges: std::iter::once(0..4).collect(),
            }),
        ] {
            let w = wb.clone();
            let panicked = tokio::spawn(async move {
                let meta = UserMeta::new();
                let mut slot = w
                    .begin("a", 8192, &meta, Some(v1), Cond::Absent, changes, true)
                    .await
                    .unwrap();
                slot.write(Bytes::from_static(b"half")).await.unwrap();
                panic!("a bug between begin and commit");
            })
            .await;
            assert!(panicked.is_err());
            assert_eq!(wb.inner.lock().bytes, room, "the slot's room was kept");
        }
        let v2 = tokio::time::timeout(Duration::from_secs(5), put(&wb, "a", &[2; 8192]))
            .await
            .expect("the key's next commit waited for the held entry");
        wb.drain(Duration::from_secs(5), |_, _| {}).await;
        assert_eq!(wb.counts().0, 0);
        let got = store.get_range("a", 0..9000, None).await.unwrap();
        assert!(
            got[..] == [2; 8192][..],
            "not the version committed last ({v2})"
        );
    }

    /// Review finding: a delta whose commit failed after its record reached the disk (its
    /// sync said EIO) stays valid there beside the delta that then extended the same entry
    /// and returned. After a restart the acknowledged one is the file, not the failed one.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn of_two_deltas_over_one_entry_the_acknowledged_one_comes_back() {
        let (dir, store, wb) = started_wb().await;
        let base = vec![5u8; 8192];
        let w = put(&wb, "a", &base).await;
        let c = |b: u64| Changes {
            keep: 8192,
            ranges: std::iter::once(b..b + 4).collect(),
        };
        // The failed one: sealed (valid on disk), then abandoned as a failed sync leaves it.
        let meta = UserMeta::new();
        let mut failed = wb
            .begin("a", 8192, &meta, Some(w), Cond::Absent, Some(c(0)), true)
            .await
            .unwrap();
        assert!(failed.is_delta());
        failed.write_blocking(b"FAIL").unwrap();
        failed.seal().unwrap();
        wb.abandon(failed).await;
        let ok = delta(&wb, "a", w, 8192, c(100), b"GOOD").await;
        assert_eq!(wb.inner.lock().entries[&ok].content.0.len(), 2);
        drop(wb);
        tokio::time::sleep(Duration::from_millis(1200)).await;
        let (wb, n) = open_wb(dir.path(), &store).await;
        assert_eq!(n, 1);
        wb.drain(Duration::from_secs(5), |_, _| {}).await;
        let mut want = base.clone();
        want[100..104].copy_from_slice(b"GOOD");
        let got = store.get_range("a", 0..9000, None).await.unwrap();
        assert!(got[..] == want[..], "not the acknowledged version");
    }

    /// Review finding: while a part of the directory cannot be read, an entry found whole is
    /// not uploaded (a delta in the unreadable part may extend it: uploading it would store
    /// an older version and lose the delta); the next start that reads everything uploads
    /// the version with its delta.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn nothing_goes_up_while_a_delta_may_be_in_what_cannot_be_read() {
        let (dir, store, wb) = started_wb().await;
        // A whole file of its own (over 4 MiB), its delta a record of a segment.
        let size = 5u64 << 20;
        let mut want = vec![3u8; size as usize];
        let w = put(&wb, "big", &want).await;
        let c = Changes {
            keep: size,
            ranges: std::iter::once(10..20).collect(),
        };
        let d = delta(&wb, "big", w, size, c, &[9; 10]).await;
        want[10..20].fill(9);
        let seg = match wb.inner.lock().entries[&d].content.head() {
            Loc::Rec { seg, .. } => seg.path.clone(),
            Loc::File(_) => panic!("the delta is not a record"),
        };
        drop(wb);
        tokio::time::sleep(Duration::from_millis(1200)).await;
        FAIL_READS.with(|f| *f.borrow_mut() = vec![seg.clone()]);
        let (wb, n) = open_wb(dir.path(), &store).await;
        FAIL_READS.with(|f| f.borrow_mut().clear());
        assert_eq!(n, 0, "an entry was queued while a delta may be unreadable");
        wb.drain(Duration::from_secs(2), |_, _| {}).await;
        assert!(
            store.head("big").await.is_err(),
            "the older version went up"
        );
        assert!(wb.pending().iter().all(|p| p.state == "unreadable"));
        drop(wb);
        tokio::time::sleep(Duration::from_millis(1200)).await;
        let (wb, n) = open_wb(dir.path(), &store).await;
        assert_eq!(n, 1);
        wb.drain(Duration::from_secs(5), |_, _| {}).await;
        let got = store.get_range("big", 0..size + 1, None).await.unwrap();
        assert!(got[..] == want[..], "the version uploaded differs");
    }
}
