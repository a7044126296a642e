//! The read path of one open handle: ranged GETs pinned to the ETag seen at open, with an
//! adaptive prefetch window fetched as parallel ranged GETs.
//!
//! A handle keeps a queue of consecutive chunks (fetched or in flight) starting at or just
//! before the read position. A read that continues near where the last one ended (tolerating
//! the kernel's readahead reordering) is sequential: the window ahead of the reader doubles
//! (past 64 MiB, only as the stream proves long) up to `max_window`, and chunks of up to a
//! sixteenth of that (at least a part) keep that much in flight. Any other read is
//! random: unless the queue already holds the bytes, its fetched chunks go to the budget's
//! block cache and only the aligned 128 KiB blocks the read touches are fetched (or served from
//! that cache). Files no larger than one part come in a single GET. Chunks take their memory from the global budget; prefetch only uses memory that
//! is free, so under pressure windows shrink instead of the daemon growing.
//!
//! With the data cache on ([`DataCache`]), requests are aligned to its 1 MiB blocks; a chunk's
//! fetch first reads the blocks the cache holds into its buffer, asks the store only for the
//! rest, and hands the blocks it fetched to the cache's writer.

use super::cache::{block_range, blocks_within, DataCache, BLOCK};
use crate::budget::{MemoryBudget, Reclaim};
use crate::error::{log_store_err, FsError, FsResult};
use crate::metrics::{inc, FsMetrics};
use crate::paths::ObjectKey;
use crate::pool::PoolBuf;
use bucketfs_store::ObjectStore;
use bytes::{Bytes, BytesMut};
use futures::future::{BoxFuture, FutureExt, Shared};
use parking_lot::{Mutex, MutexGuard};
use std::collections::VecDeque;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::task::AbortHandle;
use tokio::time::Instant;

/// First window of a sequential stream.
const MIN_WINDOW: u64 = 1024 * 1024;
/// A stream's window doubles freely up to this; beyond, it grows to at most four times what
/// the stream has read, so a short read of a big file (`head`, a file's header) never sends
/// more GETs than a window of this size.
const FREE_WINDOW: u64 = 64 * 1024 * 1024;
/// Reads within this distance of the last one still count as sequential.
const SEQ_SLACK: u64 = 1024 * 1024;
/// How far behind the read position chunks are kept (the kernel may re-read a little).
const KEEP_BEHIND: u64 = 1024 * 1024;
/// Random reads fetch aligned blocks of this size.
const RANDOM_READAHEAD: u64 = 128 * 1024;

/// Settings shared by all readers.
pub struct ReadConfig {
    pub part_size: u64,
    pub max_window: u64,
    pub budget: Arc<MemoryBudget>,
    pub metrics: Arc<FsMetrics>,
    pub data_cache: Option<Arc<DataCache>>,
}

/// Most bytes one GET of a stream asks for.
const MAX_STREAM_CHUNK: u64 = 32 * 1024 * 1024;

/// How long a failed fetch stands for the bytes it was fetching: the kernel asks again at
/// once for pages its readahead failed to get (its own read of them), which would wait for
/// the store as long again (2T on a hung connection: 4T for one read(2)).
const FAILED_STANDS: Duration = Duration::from_secs(1);

impl ReadConfig {
    /// Largest chunk of a stream: a sixteenth of the largest window, at least a part, at
    /// most 32 MiB (or a part, if larger). A full window is then about 16 GETs in flight,
    /// and a big one asks for fewer, larger ranges (each GET costs the store a seek and a
    /// round trip: reading 20 GiB cold from MinIO here, 8 MiB chunks of a 256 MiB window ran
    /// at 784 MB/s, 16 MiB ones at 945).
    fn stream_chunk(&self) -> u64 {
        let most = self.part_size.max(MAX_STREAM_CHUNK);
        (self.max_window / 16).clamp(self.part_size, most)
    }

    /// Alignment of the requests that are not a stream's: a data cache's blocks if any.
    fn align(&self) -> u64 {
        if self.data_cache.is_some() {
            BLOCK
        } else {
            RANDOM_READAHEAD
        }
    }
}

/// A chunk's bytes once fetched; shared so a read can wait for them without holding the
/// queue's lock (which the budget takes to reclaim chunks).
type ChunkData = Shared<BoxFuture<'static, FsResult<Bytes>>>;

struct Chunk {
    range: Range<u64>,
    data: ChunkData,
    task: AbortHandle,
    /// Bytes of it handed to the kernel so far (counting repeats).
    served: u64,
}

impl Chunk {
    fn ready(&self) -> Option<Bytes> {
        match self.data.peek() {
            Some(Ok(b)) => Some(b.clone()),
            _ => None,
        }
    }
}

impl Drop for Chunk {
    fn drop(&mut self) {
        // A fetch nobody waits for any more: its buffer goes back now.
        self.task.abort();
    }
}

/// A reader's chunks: consecutive, covering `[chunks[0].range.start, next)`.
struct Queue {
    chunks: VecDeque<Chunk>,
    next: u64,
    /// The bytes the read in progress asks for: never reclaimed.
    pinned: Option<Range<u64>>,
}

impl Queue {
    fn covered(&self) -> Range<u64> {
        match self.chunks.front() {
            Some(c) => c.range.start..self.next,
            None => self.next..self.next,
        }
    }
}

/// The part of a reader the budget reaches to take its prefetch back.
struct Held {
    queue: Mutex<Queue>,
    last_use: Mutex<Instant>,
    /// Chunks were taken back since the last read: the window starts over.
    reclaimed: AtomicBool,
}

impl Reclaim for Held {
    fn reclaim(&self) -> u64 {
        let dropped: Vec<Chunk> = {
            let mut q = self.queue.lock();
            let mut out = Vec::new();
            match q.pinned.clone() {
                None => out.extend(q.chunks.drain(..)),
                Some(p) => {
                    while q.chunks.back().is_some_and(|c| c.range.start >= p.end) {
                        out.extend(q.chunks.pop_back());
                    }
                    while q.chunks.front().is_some_and(|c| c.range.end <= p.start) {
                        out.extend(q.chunks.pop_front());
                    }
                    if let Some(c) = q.chunks.back() {
                        q.next = c.range.end;
                    }
                }
            }
            out
        };
        if !dropped.is_empty() {
            self.reclaimed.store(true, Ordering::Relaxed);
        }
        // Dropped outside the lock (their buffers go back to the pool).
        dropped.iter().map(|c| c.range.end - c.range.start).sum()
    }

    fn holds(&self) -> bool {
        let q = self.queue.lock();
        q.chunks.iter().any(|c| match &q.pinned {
            Some(p) => c.range.end <= p.start || c.range.start >= p.end,
            None => true,
        })
    }

    fn last_use(&self) -> Instant {
        *self.last_use.lock()
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        self.retire_chunks();
    }
}

pub struct Reader {
    store: Arc<dyn ObjectStore>,
    cfg: Arc<ReadConfig>,
    key: ObjectKey,
    etag: Option<String>,
    size: u64,
    held: Arc<Held>,
    window: u64,
    last_end: Option<u64>,
    /// Where the current sequential stream started.
    stream_start: u64,
    /// Opened with `O_DIRECT`: the kernel keeps no page cache of what it reads.
    direct: bool,
    /// A direct reader keeps the chunks it consumes in the block cache, so the next pass
    /// needs no GET: from its first pass when the file takes at most half that cache (no
    /// page cache keeps such a file, and fio, databases and tools that open O_DIRECT often
    /// read it again), else once it went back over bytes it had read. A single pass of a
    /// larger file keeps nothing (caching it would only cost memory and fresh pages, and
    /// push out what the cache holds).
    rereading: bool,
    /// End of the furthest read so far.
    high_water: u64,
    /// Some bytes went to the caller: from then on a changed object is `ESTALE`, never
    /// another version's bytes.
    served: bool,
    /// The last read whose fetch failed: its range, when, and the error (see
    /// [`FAILED_STANDS`]).
    failed: Option<(Range<u64>, Instant, FsError)>,
}

impl Reader {
    pub fn new(
        store: Arc<dyn ObjectStore>,
        cfg: Arc<ReadConfig>,
        key: ObjectKey,
        etag: Option<String>,
        size: u64,
        direct: bool,
    ) -> Self {
        let held = Arc::new(Held {
            queue: Mutex::new(Queue {
                chunks: VecDeque::new(),
                next: 0,
                pinned: None,
            }),
            last_use: Mutex::new(Instant::now()),
            reclaimed: AtomicBool::new(false),
        });
        let weak = Arc::downgrade(&held);
        cfg.budget.register(weak);
        let rereading = direct && size <= cfg.budget.block_cache_limit() / 2;
        Self {
            store,
            cfg,
            key,
            etag,
            size,
            held,
            window: MIN_WINDOW,
            last_end: None,
            stream_start: 0,
            direct,
            rereading,
            high_water: 0,
            served: false,
            failed: None,
        }
    }

    /// The object this reader reads.
    pub fn key(&self) -> &ObjectKey {
        &self.key
    }

    fn queue(&self) -> MutexGuard<'_, Queue> {
        self.held.queue.lock()
    }

    /// The version it reads.
    pub fn etag(&self) -> Option<&str> {
        self.etag.as_deref()
    }

    /// Counts as having handed bytes out (its descriptor's earlier reader did).
    pub fn mark_served(&mut self) {
        self.served = true;
    }

    /// Whether any byte of its version went to the caller yet.
    pub fn has_served(&self) -> bool {
        self.served
    }

    fn small_file(&self) -> bool {
        self.size <= self.cfg.part_size
    }

    /// Starts fetching `buf.len()` bytes (cut at the end of the object) at the queue's end
    /// into `buf`, a budget buffer.
    fn push(&self, len: u64, buf: PoolBuf) {
        let mut q = self.queue();
        let range = q.next..(q.next + len).min(self.size);
        let (store, key, etag) = (self.store.clone(), self.key.clone(), self.etag.clone());
        let (cache, size) = (self.cfg.data_cache.clone(), self.size);
        let budget = self.cfg.budget.clone();
        let r = range.clone();
        let task = tokio::spawn(async move {
            match (cache, etag) {
                (Some(c), Some(etag)) => {
                    let cached = CacheIn { cache: c, budget };
                    fetch_cached(store, cached, key, etag, size, r, buf).await
                }
                (_, etag) => fetch(&*store, &key, r, etag.as_deref(), buf).await,
            }
        });
        let abort = task.abort_handle();
        let want = range.end - range.start;
        let data = async move {
            let b = task.await.map_err(|_| FsError::EIO)??;
            if (b.len() as u64) < want {
                // Not the version of the size it was read as: another client's shorter one
                // (a store that checks the range before If-Match answers 416, read as the
                // end). As for a refused GET: the caller reads the new one or says ESTALE.
                return Err(FsError::ESTALE);
            }
            Ok(b)
        }
        .boxed()
        .shared();
        q.next = range.end;
        q.chunks.push_back(Chunk {
            range,
            data,
            task: abort,
            served: 0,
        });
    }

    /// Size of the next chunk to request at `next`.
    fn chunk_len(&self, next: u64, sequential: bool, want_end: u64) -> u64 {
        let left = self.size - next;
        let len = if self.small_file() {
            left
        } else if sequential {
            let c = self.window.clamp(MIN_WINDOW, self.cfg.stream_chunk());
            // Ends on a multiple of the part size (or of the chunk, if smaller), so that a
            // stream's GETs read whole parts of an object uploaded in parts: MinIO keeps
            // each part apart and reads it in blocks from its start, and GETs across part
            // boundaries cost it 10-25 % more CPU per GB (bench/RESULTS.md, 2026-12-02).
            // A part size that does not divide the chunk would shrink every GET to whole
            // parts: such chunks keep to a grid of their own size.
            let part = self.cfg.part_size;
            let grid = if c.is_multiple_of(part) { part } else { c };
            match (next + c) / grid * grid {
                aligned if aligned > next => aligned - next,
                _ => c,
            }
        } else {
            (want_end - next).div_ceil(RANDOM_READAHEAD) * RANDOM_READAHEAD
        };
        let len = len.max(want_end.saturating_sub(next));
        // Ends on a whole block (the data cache's; and a stream that started at an odd
        // offset still comes to the grid above).
        let align = self.cfg.align();
        let end = (next + len).div_ceil(align) * align;
        (end - next).min(left)
    }

    pub async fn read(&mut self, offset: u64, len: u32) -> FsResult<Bytes> {
        let end = (offset + len as u64).min(self.size);
        if offset >= end {
            return Ok(Bytes::new());
        }
        *self.held.last_use.lock() = Instant::now();
        let m = self.cfg.metrics.clone();
        // Its prefetch was taken for another read while it paused: start small again.
        if self.held.reclaimed.swap(false, Ordering::Relaxed) {
            self.window = MIN_WINDOW;
        }
        // Sequential: right where the last read ended, or a small jump (the kernel reorders
        // its readahead) to bytes this stream already requested.
        let covered = self.queue().covered();
        let sequential = self.last_end.is_some_and(|l| {
            offset == l
                || (offset + SEQ_SLACK >= l && offset <= l + SEQ_SLACK && covered.contains(&offset))
        });
        if sequential {
            let read = end.saturating_sub(self.stream_start);
            self.window = (self.window * 2)
                .min(self.cfg.max_window.max(MIN_WINDOW))
                .min(FREE_WINDOW.max(4 * read));
        } else {
            if self.last_end.is_some() && self.window > MIN_WINDOW {
                inc(&m.prefetch_resets);
            }
            self.window = MIN_WINDOW;
            self.stream_start = offset;
        }
        self.last_end = Some(end);
        if self.direct && offset + KEEP_BEHIND < self.high_water {
            self.rereading = true;
        }
        self.high_water = self.high_water.max(end);

        // A stream's chunks well behind its reader are consumed: dropped, or kept in the
        // block cache for a direct reader on its second pass. A random reader's go there below.
        if sequential {
            let mut behind = Vec::new();
            {
                let mut q = self.queue();
                while q
                    .chunks
                    .front()
                    .is_some_and(|c| c.range.end + KEEP_BEHIND <= offset)
                {
                    behind.extend(q.chunks.pop_front());
                }
            }
            for c in behind {
                if self.rereading {
                    self.retire(c);
                }
            }
        }
        // Checked and pinned at once: a reclaim in between took every chunk, leaving `next`
        // past them, so nothing was fetched again and the read failed (EIO).
        let hit = {
            let mut q = self.queue();
            let hit = q.covered().contains(&offset);
            if hit {
                q.pinned = Some(offset..end);
            }
            hit
        };
        if !hit {
            self.retire_chunks();
            if let Some(b) = self.cached_block(offset, end) {
                inc(&m.read_hits);
                self.served = true;
                return Ok(b);
            }
            if let Some((r, at, e)) = &self.failed {
                if at.elapsed() < FAILED_STANDS && offset < r.end && r.start < end {
                    return Err(*e);
                }
            }
            let align = self.cfg.align();
            let next = if self.small_file() {
                0
            } else if sequential && self.cfg.data_cache.is_none() {
                offset
            } else {
                offset - offset % align
            };
            let mut q = self.queue();
            q.next = next;
            // From here the bytes this read asks for are the reader's own: nobody reclaims
            // them.
            q.pinned = Some(offset..end);
        }
        inc(if hit { &m.read_hits } else { &m.read_misses });
        let r = self.fill_and_collect(offset, end, sequential).await;
        self.queue().pinned = None;
        r
    }

    async fn fill_and_collect(
        &mut self,
        offset: u64,
        end: u64,
        sequential: bool,
    ) -> FsResult<Bytes> {
        // What this read needs and is not requested yet: never waits long (see
        // `MemoryBudget::demand_buffer`). With no memory free, only the blocks it touches.
        loop {
            let next = self.queue().next;
            if next >= end {
                break;
            }
            let len = self.chunk_len(next, sequential, end);
            let buf = match self.cfg.budget.try_buffer(len) {
                Some(b) => b,
                None => {
                    let next = {
                        let mut q = self.queue();
                        if q.chunks.is_empty() && q.next < offset {
                            // A small file's whole body would start before the read: skip ahead.
                            q.next = offset - offset % self.cfg.align();
                        }
                        q.next
                    };
                    let align = self.cfg.align();
                    let len = ((end - next).div_ceil(align) * align).min(self.size - next);
                    self.cfg.budget.demand_buffer(len).await
                }
            };
            let len = buf.as_ref().len() as u64;
            self.push(len, buf);
        }
        // Read-ahead for a sequential reader: only with memory that is free now.
        if sequential || self.small_file() {
            let target = (end + self.window).min(self.size);
            loop {
                let next = self.queue().next;
                if next >= target {
                    break;
                }
                let len = self.chunk_len(next, true, next);
                let Some(buf) = self.cfg.budget.try_buffer(len) else {
                    break;
                };
                self.push(len, buf);
            }
        }
        let got = self.collect(offset, end).await;
        self.served |= got.is_ok();
        got
    }

    /// Hands the stream's fetched chunks to the budget's block cache (chunks still in flight
    /// are dropped; see [`Reader::retire`] for which), so a reader coming back to them, or
    /// the next open, finds them.
    fn retire_chunks(&mut self) {
        let chunks = std::mem::take(&mut self.queue().chunks);
        for c in chunks {
            self.retire(c);
        }
    }

    fn retire(&self, c: Chunk) {
        let Some(etag) = self.etag.as_deref() else {
            return;
        };
        // Served whole to a reader with a page cache: the kernel has it (keep_cache makes the
        // next open use it); caching it here too would only double the memory.
        if !self.direct && c.served >= c.range.end - c.range.start {
            return;
        }
        if let Some(b) = c.ready() {
            self.cfg
                .budget
                .cache_block(&self.key, etag, c.range.clone(), b);
        }
    }

    /// `[offset, end)` from the block cache, if one block holds all of it.
    fn cached_block(&self, offset: u64, end: u64) -> Option<Bytes> {
        let etag = self.etag.as_deref()?;
        self.cfg.budget.cached(&self.key, etag, offset, end)
    }

    /// The bytes `[offset, end)` from the chunks, which cover them.
    async fn collect(&mut self, offset: u64, end: u64) -> FsResult<Bytes> {
        let mut out: Option<BytesMut> = None;
        let mut pos = offset;
        while pos < end {
            let (data, range) = {
                let mut q = self.queue();
                let chunk = q
                    .chunks
                    .iter_mut()
                    .find(|c| c.range.contains(&pos))
                    .ok_or(FsError::EIO)?;
                let to = end.min(chunk.range.end);
                chunk.served += to - pos;
                (chunk.data.clone(), chunk.range.clone())
            };
            let data = match data.await {
                Ok(d) => d,
                Err(e) => {
                    if e != FsError::ESTALE {
                        // The bytes asked for, not the whole chunk (up to 32 MiB).
                        self.failed = Some((offset..end, Instant::now(), e));
                    }
                    // Forget the failed chunk and everything after it; a retry refetches.
                    let mut q = self.queue();
                    while q
                        .chunks
                        .back()
                        .is_some_and(|c| c.range.start >= range.start)
                    {
                        q.chunks.pop_back();
                    }
                    q.next = q.chunks.back().map_or(offset, |c| c.range.end);
                    return Err(e);
                }
            };
            let from = (pos - range.start) as usize;
            let to = (end.min(range.end) - range.start) as usize;
            if pos == offset && end <= range.end {
                return Ok(data.slice(from..to)); // the whole answer in one chunk: no copy
            }
            out.get_or_insert_with(|| BytesMut::with_capacity((end - offset) as usize))
                .extend_from_slice(&data[from..to]);
            pos = range.start + to as u64;
        }
        Ok(out.map(BytesMut::freeze).unwrap_or_default())
    }
}

/// Fetches `range` into `buf`; the result is the buffer's filled part (short at the end of
/// the object). On failure the buffer goes back to the pool. The store retries (a body cut
/// off mid-transfer included) within the operation's stall bound; a second layer of retries
/// here would only stretch that bound.
async fn fetch(
    store: &dyn ObjectStore,
    key: &str,
    range: Range<u64>,
    etag: Option<&str>,
    mut buf: PoolBuf,
) -> FsResult<Bytes> {
    match store
        .get_range_into(key, range, etag, buf.as_mut_slice())
        .await
    {
        Ok(n) => Ok(buf.freeze(n)),
        Err(e) => Err(log_store_err(&format!("read {key}"), e)),
    }
}

/// [`fetch`] through the data cache: the blocks of `range` it holds are read into `buf`, the
/// store is asked for the spans that are left ([`missing_spans`], their GETs at once), and
/// the whole blocks those GETs brought go to the cache's writer. `size` is the object's,
/// `etag` its version.
async fn fetch_cached(
    store: Arc<dyn ObjectStore>,
    CacheIn { cache, budget }: CacheIn,
    key: ObjectKey,
    etag: String,
    size: u64,
    range: Range<u64>,
    buf: PoolBuf,
) -> FsResult<Bytes> {
    let blocks = blocks_within(&range, size);
    let read = {
        let (r, key, etag) = (range.clone(), key.clone(), etag.clone());
        cache
            .read_disk(r.end - r.start, move |cache| {
                let mut buf = buf;
                let hits = cache.read_blocks(&key, &etag, size, r, buf.as_mut_slice());
                (buf, hits)
            })
            .await
    };
    let Some((mut buf, hits)) = read else {
        // The cache's disk is slow or hung; the read there kept its buffer.
        let buf = budget.demand_buffer(range.end - range.start).await;
        return fetch(&*store, &key, range, Some(&etag), buf).await;
    };
    let first = blocks.start;
    let hit = |i: u64| hits[(i - first) as usize];
    let spans = missing_spans(&range, size, blocks.clone(), hit);
    let fetched = {
        // Each span's GET fills its own part of the buffer.
        let (mut rest, mut at) = (buf.as_mut_slice(), range.start);
        let mut gets = Vec::with_capacity(spans.len());
        for span in &spans {
            let (_, tail) = std::mem::take(&mut rest).split_at_mut((span.start - at) as usize);
            let (dst, tail) = tail.split_at_mut((span.end - span.start) as usize);
            (rest, at) = (tail, span.end);
            let (store, key, etag) = (&store, &key, &etag);
            gets.push(async move {
                match store
                    .get_range_into(key, span.clone(), Some(etag.as_str()), dst)
                    .await
                {
                    Ok(n) => Ok(n as u64),
                    Err(e) => Err(log_store_err(&format!("read {key}"), e)),
                }
            });
        }
        futures::future::try_join_all(gets).await?
    };
    if let Some((span, n)) = spans
        .iter()
        .zip(fetched)
        .find(|(span, n)| *n < span.end - span.start)
    {
        // The object is shorter than it was said to be: the caller's length check fails.
        return Ok(buf.freeze((span.start + n - range.start) as usize));
    }
    let data = buf.freeze((range.end - range.start) as usize);
    for i in blocks.filter(|&i| !hit(i)) {
        let b = block_range(i, size);
        let part = data.slice((b.start - range.start) as usize..(b.end - range.start) as usize);
        if part.len() == data.len() {
            cache.put(&key, &etag, size, i, part);
            continue;
        }
        // A slice would hold the whole chunk's buffer for as long as the block waits for
        // the cache's disk: a copy of its own, if the budget has the memory free now.
        let Some(mut own) = budget.try_buffer(part.len() as u64) else {
            cache.skipped();
            continue;
        };
        own.as_mut_slice()[..part.len()].copy_from_slice(&part);
        cache.put(&key, &etag, size, i, own.freeze(part.len()));
    }
    Ok(data)
}

/// The data cache a fetch goes through, and the budget its blocks' copies come from.
struct CacheIn {
    cache: Arc<DataCache>,
    budget: Arc<MemoryBudget>,
}

/// Most GETs one chunk's missing blocks are fetched with; past that, the spans closest
/// together are joined (the cached blocks between them come from the store again).
const GETS_PER_CHUNK: usize = 4;

/// The parts of `range` the cache did not serve: each run of blocks it missed, and the
/// parts of blocks that the range's ends cut (never cached whole here). `blocks` are the
/// object's blocks wholly within `range`, `hit` whether the cache served one.
pub(crate) fn missing_spans(
    range: &Range<u64>,
    size: u64,
    blocks: Range<u64>,
    hit: impl Fn(u64) -> bool,
) -> Vec<Range<u64>> {
    let mut spans: Vec<Range<u64>> = Vec::new();
    let mut add = |r: Range<u64>| match spans.last_mut() {
        Some(last) if last.end == r.start => last.end = r.end,
        _ if r.is_empty() => {}
        _ => spans.push(r),
    };
    if blocks.is_empty() {
        add(range.clone());
    } else {
        add(range.start..block_range(blocks.start, size).start);
        for i in blocks.clone().filter(|&i| !hit(i)) {
            add(block_range(i, size));
        }
        add(block_range(blocks.end - 1, size).end.min(range.end)..range.end);
    }
    while spans.len() > GETS_PER_CHUNK {
        let i = (1..spans.len())
            .min_by_key(|&i| spans[i].start - spans[i - 1].end)
            .unwrap_or(1);
        spans[i - 1].end = spans[i].end;
        spans.remove(i);
    }
    spans
}

#[cfg(test)]
mod tests {
    use super::*;
    use bucketfs_store::fault::{Fault, FaultStore};
    use bucketfs_store::memory::MemoryStore;
    use bucketfs_store::metrics::Op;
    use bucketfs_store::{StoreError, UserMeta};

    const MIB: u64 = 1 << 20;

    async fn setup(
        budget: u64,
        size: usize,
    ) -> (Arc<FaultStore>, Arc<ReadConfig>, Vec<u8>, String) {
        let mem: Arc<dyn ObjectStore> = Arc::new(MemoryStore::new());
        let data: Vec<u8> = (0..size).map(|i| (i * 7 % 251) as u8).collect();
        let etag = mem
            .put("f", Bytes::from(data.clone()), &UserMeta::default())
            .await
            .unwrap();
        let metrics = Arc::new(FsMetrics::default());
        let cfg = Arc::new(ReadConfig {
            part_size: 2 * MIB,
            max_window: 4 * MIB,
            budget: MemoryBudget::new(budget, metrics.clone()),
            metrics,
            data_cache: None,
        });
        (Arc::new(FaultStore::new(mem)), cfg, data, etag)
    }

    /// A data cache of 256 MiB in `dir`, made ready for it.
    fn cache_in(dir: &std::path::Path) -> crate::config::DataCacheConfig {
        crate::files::cache::prepare_dir(dir).unwrap();
        crate::config::DataCacheConfig {
            dir: dir.to_path_buf(),
            max_bytes: 256 * MIB,
            scope: "test".into(),
        }
    }

    /// Blocks waiting for a slow cache disk hold a block of memory each, not the chunk they
    /// were fetched in: an earlier build queued slices of it, so the 9 blocks the writer took
    /// of a 16 MiB chunk held all of it (with a queue of 64, a whole budget of chunks).
    #[tokio::test]
    // The guard stalls the cache's writer thread, which nothing here awaits.
    #[allow(clippy::await_holding_lock)]
    async fn blocks_waiting_for_the_cache_disk_hold_only_their_own_memory() {
        let (store, cfg, data, etag) = setup(64 * MIB, 16 * MIB as usize).await;
        let dir = tempfile::tempdir().unwrap();
        let dc = cache_in(dir.path());
        let cache = DataCache::start(&dc, 8, cfg.metrics.clone());
        let held = cache.writer_held.lock();
        let budget = cfg.budget.clone();
        let buf = budget.try_buffer(16 * MIB).unwrap();
        let cached = CacheIn {
            cache: cache.clone(),
            budget: budget.clone(),
        };
        let size = data.len() as u64;
        let got = fetch_cached(store, cached, "f".into(), etag, size, 0..size, buf)
            .await
            .unwrap();
        assert_eq!(&got[..], &data[..]);
        drop(got);
        // The queue's 8, and the one the writer holds.
        let used = budget.total() - budget.available();
        assert!(
            used <= 9 * MIB,
            "{} MiB held by the blocks waiting for the disk",
            used / MIB
        );
        drop(held);
    }

    /// A hung cache disk (here a FIFO where the object's first cache file is: its open
    /// never returns) leaves reads to the bucket after a few seconds (one in tests), and
    /// holds a few blocking threads: each read waited for the disk for good, one more
    /// blocking thread each, until the pool the staging files and the write-back directory
    /// use was full.
    #[test]
    fn a_hung_cache_disk_leaves_reads_to_the_bucket() {
        // Twice the reads the cache sends its disk at once.
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .max_blocking_threads(16)
            .enable_all()
            .build()
            .unwrap();
        let (store, cfg, data, etag) = rt.block_on(setup(256 * MIB, 2 * MIB as usize));
        let dir = tempfile::tempdir().unwrap();
        let dc = cache_in(dir.path());
        let cache = rt.block_on(async { DataCache::start(&dc, 8, cfg.metrics.clone()) });
        // Its first look at the directory done (it removes what is not its own): the writer
        // takes a block after it.
        cache.put("other", "e", 1, 0, Bytes::from_static(b"x"));
        assert!(rt.block_on(cache.settle(std::time::Duration::from_secs(10))));
        let fifo = cache.whole_manifest("f", &etag, data.len() as u64);
        std::fs::create_dir_all(fifo.parent().unwrap()).unwrap();
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        /// Lets the reads stuck on the FIFO go, whatever the test's outcome.
        struct Unblock(std::path::PathBuf);
        impl Drop for Unblock {
            fn drop(&mut self) {
                use std::os::unix::fs::OpenOptionsExt;
                let _ = std::fs::OpenOptions::new()
                    .write(true)
                    .custom_flags(libc::O_NONBLOCK)
                    .open(&self.0);
            }
        }
        let unblock = Unblock(fifo);
        let size = data.len() as u64;
        let errors = || FsMetrics::get(&cfg.metrics.data_cache_errors);
        assert_eq!(errors(), 0);
        let reads = rt.block_on(async {
            let reads = (0..40).map(|_| {
                let cached = CacheIn {
                    cache: cache.clone(),
                    budget: cfg.budget.clone(),
                };
                let buf = cfg.budget.try_buffer(size).unwrap();
                let store: Arc<dyn ObjectStore> = store.clone();
                tokio::spawn(fetch_cached(
                    store,
                    cached,
                    "f".into(),
                    etag.clone(),
                    size,
                    0..size,
                    buf,
                ))
            });
            let all = futures::future::join_all(reads);
            tokio::time::timeout(std::time::Duration::from_secs(20), all).await
        });
        let free = rt.block_on(async {
            tokio::time::timeout(
                std::time::Duration::from_secs(2),
                tokio::task::spawn_blocking(|| ()),
            )
            .await
        });
        assert!(unblock.0.exists(), "the FIFO went");
        // Each read that did not wait for the disk, or waited past the limit.
        assert_eq!(errors(), 40);
        drop(unblock);
        rt.shutdown_background();
        let reads = reads.expect("reads waited for the hung cache disk");
        for r in reads {
            assert!(r.unwrap().unwrap() == data, "a read got other bytes");
        }
        assert!(free.is_ok(), "the blocking pool is full of cache reads");
    }

    /// A stream's GETs past its first part start on part boundaries, so each reads whole
    /// parts of an object uploaded in parts (an earlier build's ramp left every later GET
    /// a part and a half in: 1-3, 3-5 MiB and so on).
    #[tokio::test]
    async fn a_streams_gets_start_on_part_boundaries() {
        let (store, cfg, data, etag) = setup(64 * MIB, 24 * MIB as usize).await;
        let size = data.len() as u64;
        let part = cfg.part_size;
        // From the start, and from an odd offset (a stream going on from there comes to
        // the boundaries after its first part).
        for from in [0, 5 * MIB + 4096] {
            let etag = Some(etag.clone());
            let mut r = Reader::new(store.clone(), cfg.clone(), "f".into(), etag, size, false);
            let mut starts = std::collections::BTreeSet::new();
            let mut pos = from;
            while pos < size {
                let b = r.read(pos, 1 << 20).await.unwrap();
                assert_eq!(&b[..], &data[pos as usize..pos as usize + b.len()]);
                pos += b.len() as u64;
                starts.extend(r.queue().chunks.iter().map(|c| c.range.start));
                if from > 0 && pos == from + MIB {
                    // Its memory taken back: the stream goes on from where it is, at an odd
                    // offset.
                    r.held.reclaim();
                }
            }
            let off: Vec<_> = starts
                .iter()
                .filter(|s| **s >= from + part && **s % part != 0)
                .collect();
            assert!(off.is_empty(), "GETs from {off:?} (parts of {part})");
            assert!(starts.len() > 6, "{starts:?}");
        }
    }

    /// A part size that does not divide the stream's chunk leaves the chunks whole (an
    /// earlier build cut each to whole parts: 3 MiB GETs of a stream of 4 MiB chunks).
    #[tokio::test]
    async fn a_part_size_that_does_not_divide_the_chunk_leaves_it_whole() {
        let (store, cfg, data, etag) = setup(64 * MIB, 24 * MIB as usize).await;
        let cfg = Arc::new(ReadConfig {
            part_size: 3 * MIB,
            max_window: 64 * MIB,
            budget: cfg.budget.clone(),
            metrics: cfg.metrics.clone(),
            data_cache: None,
        });
        assert_eq!(cfg.stream_chunk(), 4 * MIB);
        let size = data.len() as u64;
        let mut r = Reader::new(store, cfg, "f".into(), Some(etag), size, false);
        let mut chunks = std::collections::BTreeSet::new();
        let mut pos = 0;
        while pos < size {
            let b = r.read(pos, 1 << 20).await.unwrap();
            assert_eq!(&b[..], &data[pos as usize..pos as usize + b.len()]);
            pos += b.len() as u64;
            chunks.extend(
                r.queue()
                    .chunks
                    .iter()
                    .map(|c| (c.range.start, c.range.end)),
            );
        }
        let short: Vec<_> = chunks
            .iter()
            .filter(|(start, end)| *start >= 8 * MIB && *end < size && end - start != 4 * MIB)
            .collect();
        assert!(short.is_empty(), "{short:?}");
    }

    #[tokio::test]
    async fn streams_read_into_reused_budget_buffers() {
        let (store, cfg, data, etag) = setup(8 * MIB, 24 * MIB as usize).await;
        for pass in 0..2 {
            let mut r = Reader::new(
                store.clone(),
                cfg.clone(),
                "f".into(),
                Some(etag.clone()),
                data.len() as u64,
                false,
            );
            let mut pos = 0;
            while pos < data.len() {
                let b = r.read(pos as u64, 1 << 20).await.unwrap();
                assert_eq!(&b[..], &data[pos..pos + b.len()], "pass {pass} at {pos}");
                pos += b.len();
                // Reserved plus pooled memory never exceeds the budget.
                assert!(8 * MIB - cfg.budget.available() + cfg.budget.pooled() <= 8 * MIB);
            }
            drop(r);
            // Everything is back: in the budget, and the buffers in the pool for the next pass.
            assert_eq!(cfg.budget.available(), 8 * MIB);
            assert!(cfg.budget.pooled() > 0);
        }
    }

    #[tokio::test]
    async fn readers_holding_the_whole_budget_do_not_stop_other_reads() {
        // 1 MiB budget: 16 units. Forty small files read and kept open, each holding its
        // body's unit, then a stream that paused with its window full.
        let (store, cfg, data, etag) = setup(MIB, 24 * MIB as usize).await;
        for i in 0..40 {
            store
                .put(
                    &format!("s{i}"),
                    Bytes::from(vec![i as u8; 6]),
                    &Default::default(),
                )
                .await
                .unwrap();
        }
        let mut small = Vec::new();
        for i in 0..40u8 {
            let mut r = Reader::new(
                store.clone(),
                cfg.clone(),
                ObjectKey::new(format!("s{i}")),
                None,
                6,
                false,
            );
            let b = tokio::time::timeout(std::time::Duration::from_secs(2), r.read(0, 4096))
                .await
                .expect("a small file's read must not wait for the others");
            assert_eq!(&b.unwrap()[..], &[i; 6]);
            small.push(r);
        }
        let mut big = Reader::new(
            store.clone(),
            cfg.clone(),
            "f".into(),
            Some(etag),
            data.len() as u64,
            false,
        );
        for pos in (0..4 * MIB).step_by(128 * 1024) {
            let b = big.read(pos, 128 * 1024).await.unwrap();
            assert_eq!(&b[..], &data[pos as usize..(pos + 128 * 1024) as usize]);
        }
        // The stream paused; small readers come back, and the stream resumes.
        for (i, r) in small.iter_mut().enumerate() {
            let b = r.read(0, 4096).await.unwrap();
            assert_eq!(&b[..], &[i as u8; 6]);
        }
        let b = big.read(4 * MIB, 128 * 1024).await.unwrap();
        assert_eq!(
            &b[..],
            &data[4 * MIB as usize..(4 * MIB + 128 * 1024) as usize]
        );
        assert!(
            FsMetrics::get(&cfg.metrics.buffer_bytes) <= MIB + crate::budget::overdraft_for(MIB)
        );
    }

    /// A metered stream reader of a `size`-byte object with `part_size` parts and windows up
    /// to `max_window`, over a budget of `budget` bytes; its object's bytes, its config and
    /// the store's request counts.
    async fn metered_stream(
        budget: u64,
        size: usize,
        part_size: u64,
        max_window: u64,
    ) -> (
        Reader,
        Vec<u8>,
        Arc<ReadConfig>,
        Arc<bucketfs_store::metrics::StoreMetrics>,
    ) {
        use bucketfs_store::metrics::MeteredStore;
        let (store, cfg, data, etag) = setup(budget, size).await;
        let cfg = Arc::new(ReadConfig {
            part_size,
            max_window,
            budget: cfg.budget.clone(),
            metrics: cfg.metrics.clone(),
            data_cache: None,
        });
        let metered = Arc::new(MeteredStore::new(store));
        let requests = metered.metrics();
        let len = data.len() as u64;
        let r = Reader::new(metered, cfg.clone(), "f".into(), Some(etag), len, false);
        (r, data, cfg, requests)
    }

    /// A stream's chunks grow with its window up to a sixteenth of the largest window (at
    /// least a part): a big window asks for fewer, larger ranges. With 2 MiB parts and a
    /// 64 MiB window, 64 MiB read in 1 MiB reads take about 16 GETs of 4 MiB (32 of one part
    /// each before).
    #[tokio::test]
    async fn a_big_windows_chunks_are_a_sixteenth_of_it() {
        let (mut r, data, _, gets) =
            metered_stream(256 * MIB, 64 * MIB as usize, 2 * MIB, 64 * MIB).await;
        let mut pos = 0;
        while pos < data.len() {
            let b = r.read(pos as u64, 1 << 20).await.unwrap();
            assert_eq!(&b[..], &data[pos..pos + b.len()]);
            pos += b.len();
        }
        let n = gets.requests(Op::Get);
        assert!((16..=20).contains(&n), "{n} GETs for 64 MiB");
    }

    /// A short read of a big file (`head`, a header) fetches at most [`FREE_WINDOW`] ahead,
    /// however large the window may grow for a long stream.
    #[tokio::test]
    async fn a_short_read_of_a_big_file_fetches_at_most_the_free_window() {
        let (mut r, _, cfg, m) =
            metered_stream(1024 * MIB, 192 * MIB as usize, 8 * MIB, 256 * MIB).await;
        for i in 0..16u64 {
            let b = r.read(i * 128 * 1024, 128 * 1024).await.unwrap();
            assert_eq!(b.len(), 128 * 1024);
        }
        let asked = 1024 * MIB - cfg.budget.available();
        assert!(
            asked <= FREE_WINDOW + 2 * 16 * MIB,
            "{} MiB fetched ahead for 2 MiB read ({} GETs)",
            asked / MIB,
            m.requests(Op::Get)
        );
    }

    #[tokio::test]
    async fn a_failed_get_returns_its_buffer() {
        let (store, cfg, data, etag) = setup(8 * MIB, 6 * MIB as usize).await;
        store.inject(
            Op::Get,
            0,
            None,
            Fault::Error(StoreError::AccessDenied("f".into())),
        );
        let mut r = Reader::new(
            store.clone(),
            cfg.clone(),
            "f".into(),
            Some(etag),
            data.len() as u64,
            false,
        );
        assert!(r.read(0, 1 << 20).await.is_err());
        // The failed chunks are forgotten and their buffers given back before any retry.
        assert!(r.read(MIB, 1 << 20).await.is_err());
        store.clear();
        // Within FAILED_STANDS the same bytes fail at once; after it they are fetched.
        assert!(r.read(MIB, 1 << 20).await.is_err());
        tokio::time::sleep(FAILED_STANDS).await;
        let b = r.read(MIB, 1 << 20).await.unwrap();
        assert_eq!(&b[..], &data[MIB as usize..2 * MIB as usize]);
        drop((r, b));
        assert_eq!(cfg.budget.available(), 8 * MIB);
    }

    #[tokio::test]
    async fn a_short_object_is_an_error_and_frees_its_buffer() {
        let (store, cfg, data, etag) = setup(8 * MIB, 3 * MIB as usize).await;
        // The reader believes the object is longer than it is.
        let mut r = Reader::new(store, cfg.clone(), "f".into(), Some(etag), 5 * MIB, false);
        assert!(r.read(4 * MIB, 4096).await.is_err());
        let b = r.read(0, 4096).await.unwrap();
        assert_eq!(&b[..], &data[..4096]);
        drop((r, b));
        // The block the second read touched stays cached: the failed one is gone.
        assert_eq!(cfg.budget.available(), 8 * MIB - RANDOM_READAHEAD);
    }
}
