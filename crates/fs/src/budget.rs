//! One global memory budget for prefetched data and part buffers (`--max-memory`).
//!
//! Every buffer that holds file data for longer than one request takes a [`Reservation`]
//! first. Readers ask with [`MemoryBudget::try_buffer`] for read-ahead, so when the budget is
//! full their windows simply stop growing. Writers' in-memory part buffers can live as long as
//! a file is open, so they only take memory with [`MemoryBudget::try_buffer_lasting`], which
//! keeps them within half the budget (a writer that gets none stages on disk).
//!
//! Nothing a handle holds can starve the others. What readers fetched ahead of their readers
//! (prefetch, a small file's body once read) is *reclaimable*: each reader registers as a
//! [`Reclaim`] holder, and whoever must wait for memory first takes it back from the holders
//! used longest ago (a paused reader's window goes, and shrinks). The bytes a read needs
//! right now ([`MemoryBudget::demand_buffer`]) then wait at most [`DEMAND_WAIT`]; after that
//! they come from a small overdraft beyond the budget ([`overdraft_for`]), which only such
//! reads use, each for the length of one request. Writers' short reservations
//! ([`MemoryBudget::reserve`]) wait for memory that in-flight requests return. So the daemon's
//! buffers stay within the budget plus the overdraft, and no wait lasts longer than the
//! requests holding the memory.
//!
//! The budget also keeps a cache of blocks readers fetched but did not hand to the kernel
//! (the rest of a random read's 128 KiB block, a stream's chunks when the reader jumps away or
//! closes), up to a quarter of the budget. It is the first thing given back.
//!
//! Copies of write requests, from the FUSE thread until their bytes are in a part buffer or
//! the staging file, take memory from a *request area* beside the budget
//! ([`request_area_for`]), so that parts in flight filling the budget do not stall every
//! write; when the area is full a copy waits for one ahead to be stored, at most
//! [`DEMAND_WAIT`], then takes the overdraft.
//!
//! Buffers of file data (readers' chunks, writers' parts, request copies) come from the
//! budget's [`Pool`]s, which reuse freed ones within the budget instead of leaving them to the
//! allocator (see there why).

use crate::metrics::FsMetrics;
use crate::pool::{Pool, PoolBuf, STEP};
use bytes::Bytes;
use parking_lot::Mutex;
use std::collections::{BTreeMap, VecDeque};
use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;
use tokio::runtime::Handle;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

/// Accounting granularity: the pool's buffer size step, so a buffer is exactly its reservation.
const UNIT: u64 = STEP as u64;

/// Longest a read waits for budget memory before it takes it from the overdraft.
pub const DEMAND_WAIT: Duration = Duration::from_millis(500);

/// Longest a FUSE thread waits for memory for a copy of a write request (the area, then the
/// overdraft): it serves nothing else meanwhile, so copies held by writes queued behind a
/// slow upload must not stop `ls` and `stat` of the whole mount. Past it the copy is made
/// outside the budget: such copies are as many as write requests in flight, at most one per
/// writing thread (1 MiB each), and counted.
pub const COPY_WAIT: Duration = Duration::from_secs(1);
/// While waiting, holders are asked again this often (memory may have been re-taken).
const RECLAIM_EVERY: Duration = Duration::from_millis(50);

/// Memory reads may take beyond the budget when it stays full for [`DEMAND_WAIT`]: a
/// sixteenth of it, at least 4 MiB (a few reads of the kernel's largest request).
pub fn overdraft_for(budget: u64) -> u64 {
    (budget / 16).max(4 << 20)
}

/// Memory for the copies of write requests on their way to a file's part buffer or staging
/// file: a thirty-second of the budget, between 4 and 8 MiB (of the kernel's largest writes).
/// A copy lives for a memory copy or a local disk write, so a few suffice at any write rate.
pub fn request_area_for(budget: u64) -> u64 {
    (budget / 32).clamp(4 << 20, 8 << 20)
}

/// Something holding budget memory it can give back at once: a reader's fetched-ahead chunks.
pub trait Reclaim: Send + Sync {
    /// Drops what it holds beyond the read in progress; returns the bytes dropped.
    fn reclaim(&self) -> u64;
    /// Whether it holds anything it could give back.
    fn holds(&self) -> bool;
    /// When it was last read from (the longest unused gives back first).
    fn last_use(&self) -> Instant;
}

pub struct MemoryBudget {
    sem: Arc<Semaphore>,
    units: u64,
    /// Memory reads take beyond the budget as a last resort (see [`overdraft_for`]).
    overdraft: Arc<Semaphore>,
    overdraft_units: u64,
    /// Readers whose prefetch can be taken back.
    holders: Mutex<Holders>,
    /// Bytes held in [`MemoryBudget::try_buffer_lasting`] reservations.
    lasting: Arc<AtomicU64>,
    metrics: Arc<FsMetrics>,
    cache: Mutex<BlockCache>,
    pool: Arc<Pool>,
    /// Memory for copies of write requests (see [`MemoryBudget::request_buffer`]), beside the
    /// budget, and the pool of its buffers.
    requests: Arc<Semaphore>,
    request_pool: Arc<Pool>,
    /// The runtime a FUSE thread waits in for request memory.
    rt: Option<Handle>,
    /// When a FUSE thread last waited [`COPY_WAIT`] for a copy in vain.
    copies_short: Mutex<Option<Instant>>,
}

/// Registered holders; closed readers' entries are dropped now and then.
#[derive(Default)]
struct Holders {
    list: Vec<Weak<dyn Reclaim>>,
    /// Length at which closed readers' entries are pruned next.
    prune_at: usize,
}

impl Holders {
    fn prune(&mut self) {
        self.list.retain(|w| w.strong_count() > 0);
        self.prune_at = (self.list.len() * 2).max(1024);
    }
}

/// Identifies the content of a cached block: object key and ETag.
type BlockKey = (String, String);

struct Block {
    end: u64,
    /// A reader's buffer, which holds its memory.
    data: Bytes,
}

#[derive(Default)]
struct BlockCache {
    blocks: BTreeMap<(BlockKey, u64), Block>,
    /// Insertion order, for eviction (first in, first out).
    order: VecDeque<(BlockKey, u64)>,
    bytes: u64,
}

impl BlockCache {
    fn evict_one(&mut self) -> bool {
        while let Some(k) = self.order.pop_front() {
            if let Some(b) = self.blocks.remove(&k) {
                self.bytes -= b.data.len() as u64;
                return true;
            }
        }
        false
    }
}

/// Bytes taken from the budget; returned when dropped.
pub struct Reservation {
    _permit: Option<OwnedSemaphorePermit>,
    bytes: u64,
    /// The memory its permits stand for (whole units), which `bucketfs_buffer_bytes` counts:
    /// a 1 KiB body holds a 64 KiB unit of the budget.
    held: u64,
    metrics: Arc<FsMetrics>,
    /// The lasting-bytes counter this reservation counts in, if any.
    lasting: Option<Arc<AtomicU64>>,
}

impl Reservation {
    /// How many bytes it holds.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.metrics
            .buffer_bytes
            .fetch_sub(self.held, Ordering::Relaxed);
        if let Some(l) = &self.lasting {
            l.fetch_sub(self.bytes, Ordering::Relaxed);
        }
    }
}

impl MemoryBudget {
    pub fn new(bytes: u64, metrics: Arc<FsMetrics>) -> Arc<Self> {
        let units = (bytes / UNIT).clamp(1, Semaphore::MAX_PERMITS as u64);
        metrics.budget_bytes.store(units * UNIT, Ordering::Relaxed);
        let sem = Arc::new(Semaphore::new(units as usize));
        let overdraft_units = overdraft_for(units * UNIT) / UNIT;
        let requests = Arc::new(Semaphore::new(
            request_area_for(units * UNIT) as usize / STEP,
        ));
        Arc::new(Self {
            request_pool: Pool::new(requests.clone(), request_area_for(units * UNIT)),
            rt: Handle::try_current().ok(),
            copies_short: Mutex::new(None),
            requests,
            pool: Pool::new(sem.clone(), units * UNIT),
            sem,
            units,
            overdraft: Arc::new(Semaphore::new(overdraft_units as usize)),
            overdraft_units,
            holders: Mutex::default(),
            lasting: Arc::default(),
            metrics,
            cache: Mutex::new(BlockCache::default()),
        })
    }

    /// Units for `bytes`; a request bigger than the whole budget takes the whole budget.
    fn units_for(&self, bytes: u64) -> u32 {
        bytes.div_ceil(UNIT).clamp(1, self.units) as u32
    }

    fn wrap(&self, permit: OwnedSemaphorePermit, bytes: u64) -> Reservation {
        let held = permit.num_permits() as u64 * UNIT;
        self.metrics.buffer_bytes.fetch_add(held, Ordering::Relaxed);
        Reservation {
            _permit: Some(permit),
            bytes,
            held,
            metrics: self.metrics.clone(),
            lasting: None,
        }
    }

    /// Waits until `bytes` are free and takes them, evicting cached blocks before waiting.
    #[cfg(test)]
    pub async fn reserve(&self, bytes: u64) -> Reservation {
        let r = self.reserve_untrimmed(bytes).await;
        // Reserved plus pooled memory stays within the budget.
        self.pool.trim();
        r
    }

    /// Takes `bytes` if they are free now.
    #[cfg(test)]
    pub fn try_reserve(&self, bytes: u64) -> Option<Reservation> {
        let r = self.try_reserve_untrimmed(bytes)?;
        self.pool.trim();
        Some(r)
    }

    /// [`MemoryBudget::reserve`] for a pool buffer: the pool trims itself once it has handed
    /// out a kept buffer for this memory (trimming first could unmap that very buffer). Takes
    /// back cached blocks and readers' prefetch before it waits.
    async fn reserve_untrimmed(&self, bytes: u64) -> Reservation {
        let units = self.units_for(bytes);
        if let Some(r) = self.try_or_reclaim(units, bytes) {
            return r;
        }
        loop {
            let acquire = self.sem.clone().acquire_many_owned(units);
            if let Ok(permit) = tokio::time::timeout(RECLAIM_EVERY, acquire).await {
                return self.wrap(permit.expect("the budget semaphore is never closed"), bytes);
            }
            // Prefetch may have taken what was freed meanwhile: ask again.
            if let Some(r) = self.try_or_reclaim(units, bytes) {
                return r;
            }
        }
    }

    /// The memory now if it is free, or once cached blocks and then readers' prefetch (the
    /// longest unused first) are given back.
    fn try_or_reclaim(&self, units: u32, bytes: u64) -> Option<Reservation> {
        loop {
            if let Ok(permit) = self.sem.clone().try_acquire_many_owned(units) {
                return Some(self.wrap(permit, bytes));
            }
            if !self.cache.lock().evict_one() {
                break;
            }
        }
        self.reclaim(u64::from(units) * UNIT);
        let permit = self.sem.clone().try_acquire_many_owned(units).ok()?;
        Some(self.wrap(permit, bytes))
    }

    /// Takes back readers' prefetch, the longest unused first, until `want` bytes (and at
    /// least a sixteenth of the budget, so that the next waits need no search) are dropped.
    /// Memory of fetches still in flight returns when their tasks end.
    fn reclaim(&self, want: u64) -> u64 {
        let mut live: Vec<(Instant, Arc<dyn Reclaim>)> = {
            let mut h = self.holders.lock();
            h.prune();
            h.list
                .iter()
                .filter_map(Weak::upgrade)
                .filter(|r| r.holds())
                .map(|r| (r.last_use(), r))
                .collect()
        };
        live.sort_by_key(|(t, _)| *t);
        let want = want.max(self.units * UNIT / 16);
        let mut freed = 0;
        for (_, r) in live {
            if freed >= want {
                break;
            }
            freed += r.reclaim();
        }
        freed
    }

    fn overdrawn(&self, permit: OwnedSemaphorePermit, len: u64) -> Reservation {
        tracing::debug!("memory budget full for {DEMAND_WAIT:?}: a read of {len} bytes overdraws");
        self.wrap(permit, len)
    }

    /// Registers a holder of reclaimable memory (kept as a weak reference).
    pub fn register(&self, holder: Weak<dyn Reclaim>) {
        let mut h = self.holders.lock();
        if h.list.len() >= h.prune_at {
            h.prune();
        }
        h.list.push(holder);
    }

    /// A buffer for bytes a read needs right now. It never waits for long: cached blocks and
    /// readers' prefetch are taken back first; if the budget stays full for [`DEMAND_WAIT`]
    /// (its memory is in requests still running), the buffer comes from the overdraft
    /// instead, or from whichever of the two frees memory first.
    pub async fn demand_buffer(&self, len: u64) -> PoolBuf {
        let mem = self.demand(&self.sem, len, true).await;
        self.pool.take(len as usize, mem)
    }

    /// Memory from `sem` (the budget, or the request area) for bytes needed right now: taken
    /// back from prefetch first if `reclaim`, from the overdraft after [`DEMAND_WAIT`].
    async fn demand(&self, sem: &Arc<Semaphore>, len: u64, reclaim: bool) -> Reservation {
        let total = if reclaim {
            self.units
        } else {
            request_area_for(self.units * UNIT) / UNIT
        };
        let units = len.div_ceil(UNIT).clamp(1, total) as u32;
        let over = u64::from(units).min(self.overdraft_units) as u32;
        let start = Instant::now();
        loop {
            if reclaim {
                if let Some(r) = self.try_or_reclaim(units, len) {
                    return r;
                }
            } else if let Ok(p) = sem.clone().try_acquire_many_owned(units) {
                return self.wrap(p, len);
            }
            let overdrawn = start.elapsed() >= DEMAND_WAIT;
            if overdrawn {
                if let Ok(p) = self.overdraft.clone().try_acquire_many_owned(over) {
                    return self.overdrawn(p, len);
                }
            }
            // Waits for either, and takes back prefetch again every RECLAIM_EVERY.
            let wait = async {
                tokio::select! {
                    p = sem.clone().acquire_many_owned(units) => {
                        self.wrap(p.expect("the budget semaphore is never closed"), len)
                    }
                    p = self.overdraft.clone().acquire_many_owned(over), if overdrawn => {
                        self.overdrawn(p.expect("the overdraft semaphore is never closed"), len)
                    }
                }
            };
            if let Ok(r) = tokio::time::timeout(RECLAIM_EVERY, wait).await {
                return r;
            }
        }
    }

    /// A buffer for a copy of a write request's `len` bytes, free now. Such copies live from
    /// the FUSE thread until the bytes are in a part buffer or the staging file; they take
    /// memory from an area of their own ([`request_area_for`]), so that writers' parts in
    /// flight filling the budget do not stall every write.
    pub fn try_request_buffer(&self, len: u64) -> Option<PoolBuf> {
        let units = len
            .div_ceil(UNIT)
            .clamp(1, request_area_for(self.units * UNIT) / UNIT) as u32;
        let p = self.requests.clone().try_acquire_many_owned(units).ok()?;
        Some(self.request_pool.take(len as usize, self.wrap(p, len)))
    }

    /// [`MemoryBudget::request_buffer`] for a thread outside the runtime (a FUSE thread),
    /// which it blocks while it waits, at most [`COPY_WAIT`]; `None` on a runtime thread,
    /// which must not block, or after that wait (the caller copies outside the budget).
    pub fn request_buffer_blocking(&self, len: u64) -> Option<PoolBuf> {
        if let Some(b) = self.try_request_buffer(len) {
            return Some(b);
        }
        if Handle::try_current().is_ok() {
            return None;
        }
        let rt = self.rt.as_ref()?;
        // Short of it a moment ago: no wait for each write while it lasts.
        if self
            .copies_short
            .lock()
            .is_some_and(|t| t.elapsed() < COPY_WAIT)
        {
            self.metrics
                .write_copies_unbudgeted
                .fetch_add(1, Ordering::Relaxed);
            return None;
        }
        let got =
            rt.block_on(async { tokio::time::timeout(COPY_WAIT, self.request_buffer(len)).await });
        if got.is_err() {
            *self.copies_short.lock() = Some(Instant::now());
            let n = self
                .metrics
                .write_copies_unbudgeted
                .fetch_add(1, Ordering::Relaxed);
            if n == 0 {
                tracing::warn!(
                    "memory for copies of write requests stayed taken for {COPY_WAIT:?} \
                     (writes queued behind slow uploads): copies are made outside \
                     --max-memory while it lasts (bucketfs_write_copies_unbudgeted_total)"
                );
            }
        }
        got.ok()
    }

    /// [`MemoryBudget::try_request_buffer`], waiting for the area's memory (copies return it
    /// once their bytes are stored), and after [`DEMAND_WAIT`] taking the overdraft instead.
    pub async fn request_buffer(&self, len: u64) -> PoolBuf {
        let mem = self.demand(&self.requests, len, false).await;
        self.request_pool.take(len as usize, mem)
    }

    /// A buffer for `len` bytes of file data, if that much memory is free now. It holds the
    /// memory until it (and every [`Bytes`] made of it) is dropped.
    pub fn try_buffer(&self, len: u64) -> Option<PoolBuf> {
        let mem = self.try_reserve_untrimmed(len)?;
        Some(self.pool.take(len as usize, mem))
    }

    /// A buffer for `len` bytes of file data, waiting for the memory if it must (memory that
    /// requests in flight return).
    pub async fn buffer(&self, len: u64) -> PoolBuf {
        let mem = self.reserve_untrimmed(len).await;
        self.pool.take(len as usize, mem)
    }

    /// Keeps a fetched block of object `key` (version `etag`) covering `range`; `data` is a
    /// pool buffer, which holds its memory. Blocks beyond a quarter of the budget push out
    /// the oldest.
    pub fn cache_block(&self, key: &str, etag: &str, range: Range<u64>, data: Bytes) {
        if data.len() as u64 != range.end - range.start {
            return;
        }
        let k = ((key.to_string(), etag.to_string()), range.start);
        let mut c = self.cache.lock();
        c.bytes += data.len() as u64;
        if let Some(old) = c.blocks.insert(
            k.clone(),
            Block {
                end: range.end,
                data,
            },
        ) {
            c.bytes -= old.data.len() as u64;
        }
        c.order.push_back(k);
        let limit = self.block_cache_limit();
        while c.bytes > limit && c.evict_one() {}
    }

    /// The whole budget, in bytes.
    pub fn total(&self) -> u64 {
        self.units * UNIT
    }

    /// Most bytes the block cache keeps: a quarter of the budget.
    pub fn block_cache_limit(&self) -> u64 {
        self.units * UNIT / 4
    }

    /// `[offset, end)` of object `key` version `etag`, if one cached block holds all of it.
    pub fn cached(&self, key: &str, etag: &str, offset: u64, end: u64) -> Option<Bytes> {
        let c = self.cache.lock();
        let bk = (key.to_string(), etag.to_string());
        // Blocks may overlap (a stream's chunks, random blocks): look at the few starting
        // closest before `offset`.
        c.blocks
            .range(..=(bk.clone(), offset))
            .rev()
            .take(8)
            .take_while(|((k, _), _)| *k == bk)
            .find(|(_, b)| end <= b.end)
            .map(|((_, start), b)| {
                b.data
                    .slice((offset - start) as usize..(end - start) as usize)
            })
    }

    fn try_reserve_untrimmed(&self, bytes: u64) -> Option<Reservation> {
        let permit = self
            .sem
            .clone()
            .try_acquire_many_owned(self.units_for(bytes))
            .ok()?;
        Some(self.wrap(permit, bytes))
    }

    /// A pool buffer for `len` bytes held as long as a file stays open (a writer's tail),
    /// if they are free now and such memory stays within half the budget. The other half is
    /// only ever held for the length of a request, so whoever waits in
    /// [`MemoryBudget::reserve`] is always served eventually. Reusing kept buffers spares a
    /// fresh mapping's page faults and zeroing on every part; `populate`: see
    /// [`Pool::take_as`].
    pub fn try_buffer_lasting(&self, len: u64, populate: bool) -> Option<PoolBuf> {
        let mem = self.try_reserve_lasting_untrimmed(len)?;
        Some(self.pool.take_as(len as usize, mem, populate))
    }

    fn try_reserve_lasting_untrimmed(&self, bytes: u64) -> Option<Reservation> {
        let cap = self.units * UNIT / 2;
        let held = self.lasting.fetch_add(bytes, Ordering::Relaxed) + bytes;
        let mut r = if held <= cap {
            self.try_reserve_untrimmed(bytes)
        } else {
            None
        };
        match &mut r {
            Some(r) => r.lasting = Some(self.lasting.clone()),
            None => {
                self.lasting.fetch_sub(bytes, Ordering::Relaxed);
            }
        }
        r
    }

    /// Bytes of freed buffers kept for reuse.
    #[cfg(test)]
    pub fn pooled(&self) -> u64 {
        self.pool.idle_bytes()
    }

    /// Buffers mapped so far (not reused).
    #[cfg(test)]
    pub fn fresh_buffers(&self) -> u64 {
        self.pool.fresh()
    }

    /// Bytes free right now.
    #[cfg(test)]
    pub fn available(&self) -> u64 {
        self.sem.available_permits() as u64 * UNIT
    }
}

/// A default budget from the memory this process may use: an eighth of RAM, or of its
/// cgroup's limit when lower (a container's), between 256 MiB and 4 GiB (see
/// [`budget_within`]).
pub fn default_budget() -> u64 {
    let total = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map(|kb| kb * 1024)
        .unwrap_or(2 << 30);
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let limit = cgroup_limit(&own, Path::new("/sys/fs/cgroup")).unwrap_or(u64::MAX);
    budget_within(total.min(limit))
}

/// The default budget of a process that may use `memory`: an eighth of it, 256 MiB to 4 GiB,
/// but never more than half of what the overhead beside the budget (up to 64 MiB) leaves,
/// nor less than 32 MiB. In a container of 330 MiB a 256 MiB budget left too little room,
/// and the kernel killed the daemon (the mount died) under 128 readers.
fn budget_within(memory: u64) -> u64 {
    const MIB: u64 = 1 << 20;
    let eighth = (memory / 8).clamp(256 * MIB, 4096 * MIB);
    eighth.min((memory.saturating_sub(64 * MIB) / 2).max(32 * MIB))
}

/// The tightest memory limit on a process whose `/proc/self/cgroup` says `own`, with the
/// cgroup file systems under `root`: its cgroup's and every ancestor's (v2 `memory.max`,
/// v1 `memory.limit_in_bytes`). None when nothing limits it.
fn cgroup_limit(own: &str, root: &Path) -> Option<u64> {
    let mut tightest: Option<u64> = None;
    for line in own.lines() {
        let mut f = line.splitn(3, ':');
        let (Some(_), Some(ctrl), Some(path)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        let (top, file) = if ctrl.is_empty() {
            (root.to_path_buf(), "memory.max")
        } else if ctrl.split(',').any(|c| c == "memory") {
            (root.join("memory"), "memory.limit_in_bytes")
        } else {
            continue;
        };
        let mut dir = top.join(path.trim_start_matches('/'));
        loop {
            let limit = std::fs::read_to_string(dir.join(file))
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok());
            if let Some(l) = limit {
                tightest = Some(tightest.map_or(l, |t| t.min(l)));
            }
            if dir == top || !dir.pop() {
                break;
            }
        }
    }
    tightest
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A container's memory limit (cgroup v2, set on an ancestor too) sizes the default
    /// budget, not the machine's RAM; "max" and unreadable files limit nothing; v1 too.
    #[test]
    fn the_default_budget_leaves_room_in_a_small_container() {
        const MIB: u64 = 1 << 20;
        assert_eq!(budget_within(64 << 30), 4096 * MIB);
        assert_eq!(budget_within(16 << 30), 2048 * MIB);
        assert_eq!(budget_within(1 << 30), 256 * MIB);
        assert_eq!(budget_within(512 * MIB), 224 * MIB);
        assert_eq!(budget_within(330 * MIB), 133 * MIB);
        assert_eq!(budget_within(100 * MIB), 32 * MIB);
    }

    #[test]
    fn the_tightest_cgroup_memory_limit_is_found() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        let pod = r.join("kubepods/pod1");
        let own = pod.join("ctr");
        std::fs::create_dir_all(&own).unwrap();
        std::fs::write(r.join("memory.max"), "max\n").unwrap();
        std::fs::write(r.join("kubepods/memory.max"), "8589934592\n").unwrap();
        std::fs::write(pod.join("memory.max"), "1073741824\n").unwrap();
        std::fs::write(own.join("memory.max"), "max\n").unwrap();
        let v2 = "0::/kubepods/pod1/ctr\n";
        assert_eq!(cgroup_limit(v2, r), Some(1 << 30));
        assert_eq!(cgroup_limit("0::/elsewhere\n", r), None);
        let v1_dir = r.join("memory/docker/abc");
        std::fs::create_dir_all(&v1_dir).unwrap();
        std::fs::write(v1_dir.join("memory.limit_in_bytes"), "536870912\n").unwrap();
        let v1 = "12:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n";
        assert_eq!(cgroup_limit(v1, r), Some(512 << 20));
    }

    #[test]
    fn lasting_reservations_stay_within_half_the_budget() {
        let m = Arc::new(FsMetrics::default());
        let b = MemoryBudget::new(1 << 20, m);
        let a = b.try_buffer_lasting(256 * 1024, false).unwrap();
        let c = b.try_buffer_lasting(256 * 1024, false).unwrap();
        // Half the budget is lasting now: no more, although the other half is free.
        assert!(b.try_buffer_lasting(64 * 1024, false).is_none());
        assert_eq!(b.available(), 512 * 1024);
        let short = b.try_reserve(512 * 1024).unwrap();
        // Lasting room, but no free memory: refused, and the refusal holds nothing.
        drop(a);
        let _busy = b.try_reserve(256 * 1024).unwrap();
        assert!(b.try_buffer_lasting(64 * 1024, false).is_none());
        drop((short, _busy));
        let d = b.try_buffer_lasting(256 * 1024, false).unwrap();
        drop((c, d));
        assert_eq!(b.available(), 1 << 20);
        assert!(b.try_buffer_lasting(512 * 1024, false).is_some());
    }

    /// Reserved plus pooled memory, which must never exceed the budget.
    fn held(b: &MemoryBudget) -> u64 {
        b.units * UNIT - b.available() + b.pooled()
    }

    #[test]
    fn freed_buffers_are_reused_within_the_budget() {
        let m = Arc::new(FsMetrics::default());
        let b = MemoryBudget::new(8 << 20, m.clone());
        let mut a = b.try_buffer(1 << 20).unwrap();
        a.as_mut_slice().fill(7);
        let addr = a.as_mut_slice().as_ptr();
        assert_eq!(b.available(), 7 << 20);
        drop(a);
        // Back in the pool, its memory back in the budget.
        assert_eq!((b.pooled(), b.available()), (1 << 20, 8 << 20));
        let mut c = b.try_buffer(1 << 20).unwrap();
        assert_eq!(
            c.as_mut_slice().as_ptr(),
            addr,
            "the freed buffer is reused"
        );
        assert_eq!(c.as_mut_slice().len(), 1 << 20);
        assert_eq!(b.pooled(), 0);
        // Another size class gets a buffer of its own.
        let d = b.try_buffer(100_000).unwrap();
        assert_eq!(held(&b), (1 << 20) + 2 * UNIT);
        drop((c, d));
        assert_eq!(b.pooled(), (1 << 20) + 2 * UNIT);
        assert_eq!(FsMetrics::get(&m.buffer_bytes), 0);
    }

    #[test]
    fn a_full_budget_still_reuses_freed_buffers() {
        let b = MemoryBudget::new(8 << 20, Arc::new(FsMetrics::default()));
        let mut bufs: Vec<_> = (0..8).map(|_| b.try_buffer(1 << 20).unwrap()).collect();
        assert_eq!(b.fresh_buffers(), 8);
        // Ten readers turning over their chunks with no memory to spare: each one freed
        // serves the next, with no new mapping.
        for _ in 0..20 {
            bufs.remove(0);
            bufs.push(b.try_buffer(1 << 20).unwrap());
            assert!(held(&b) <= 8 << 20);
        }
        assert_eq!(b.fresh_buffers(), 8);
    }

    #[test]
    fn pooled_buffers_give_way_to_reservations() {
        let b = MemoryBudget::new(4 << 20, Arc::new(FsMetrics::default()));
        // A quarter of the budget is kept at most: the rest is unmapped when freed.
        let bufs: Vec<_> = (0..4).map(|_| b.try_buffer(1 << 20).unwrap()).collect();
        assert!(b.try_buffer(UNIT).is_none());
        drop(bufs);
        assert_eq!(b.pooled(), 1 << 20);
        // Reserving what the pool keeps shrinks the pool, not the reservation.
        let writer = b.try_reserve(3584 * 1024).unwrap();
        assert!(held(&b) <= 4 << 20);
        assert_eq!(b.pooled(), 0);
        // A buffer freed while memory is short is not kept either.
        let small = b.try_buffer(512 * 1024).unwrap();
        assert!(b.try_buffer(UNIT).is_none());
        drop(writer);
        let writer = b.try_reserve(3584 * 1024).unwrap();
        drop(small);
        assert!(held(&b) <= 4 << 20);
        assert_eq!(b.pooled(), 512 * 1024);
        drop(writer);
        assert_eq!(b.available(), 4 << 20);
    }

    #[test]
    fn frozen_buffers_hold_their_memory_until_the_last_slice_drops() {
        let b = MemoryBudget::new(4 << 20, Arc::new(FsMetrics::default()));
        let mut buf = b.try_buffer(300_000).unwrap();
        buf.as_mut_slice()[..5].copy_from_slice(b"hello");
        let bytes = buf.freeze(5);
        assert_eq!(&bytes[..], b"hello");
        let tail = bytes.slice(1..3);
        drop(bytes);
        assert_eq!(b.available(), (4 << 20) - 5 * UNIT);
        assert_eq!(b.pooled(), 0);
        assert_eq!(&tail[..], b"el");
        drop(tail);
        assert_eq!((b.available(), b.pooled()), (4 << 20, 5 * UNIT));
    }

    #[tokio::test(start_paused = true)]
    async fn buffers_kept_unused_are_unmapped_after_a_while() {
        let b = MemoryBudget::new(8 << 20, Arc::new(FsMetrics::default()));
        drop(b.try_buffer(1 << 20).unwrap());
        assert_eq!(b.pooled(), 1 << 20);
        tokio::time::sleep(crate::pool::IDLE_TTL / 2).await;
        assert_eq!(b.pooled(), 1 << 20);
        let again = b.try_buffer(1 << 20).unwrap();
        drop(again);
        // Reuse restarts its clock; left alone, it goes.
        tokio::time::sleep(crate::pool::IDLE_TTL * 3).await;
        assert_eq!(b.pooled(), 0);
        drop(b.try_buffer(UNIT).unwrap());
        assert_eq!(b.pooled(), UNIT, "kept again after the expiry task ended");
        tokio::time::sleep(crate::pool::IDLE_TTL * 3).await;
        assert_eq!(b.pooled(), 0);
    }

    #[tokio::test]
    async fn a_waiting_reader_gets_memory_a_freed_buffer_returns() {
        let b = MemoryBudget::new(1 << 20, Arc::new(FsMetrics::default()));
        let a = b.try_buffer(1 << 20).unwrap();
        let waiter = tokio::spawn({
            let b = b.clone();
            async move { b.buffer(1 << 20).await }
        });
        tokio::task::yield_now().await;
        // The freed buffer's memory goes to the waiter (it is not parked in the pool).
        drop(a);
        let got = waiter.await.unwrap();
        assert_eq!(b.available(), 0);
        assert!(held(&b) <= 1 << 20);
        drop(got);
        assert_eq!(b.available(), 1 << 20);
    }

    #[tokio::test(start_paused = true)]
    async fn a_demand_read_never_waits_longer_than_its_bound() {
        let m = Arc::new(FsMetrics::default());
        let b = MemoryBudget::new(4 << 20, m.clone());
        // All of it held by requests that do not end (nothing to reclaim).
        let all = b.try_reserve(4 << 20).unwrap();
        let start = Instant::now();
        let got = b.demand_buffer(1 << 20).await;
        let waited = start.elapsed();
        assert!(
            waited >= DEMAND_WAIT && waited < DEMAND_WAIT * 2,
            "{waited:?}"
        );
        // From the overdraft: over the budget by at most that.
        assert_eq!(FsMetrics::get(&m.buffer_bytes), 5 << 20);
        assert!(FsMetrics::get(&m.buffer_bytes) <= (4 << 20) + overdraft_for(4 << 20));
        drop((got, all));
        assert_eq!(FsMetrics::get(&m.buffer_bytes), 0);
        assert_eq!(b.available(), 4 << 20);
        assert_eq!(
            b.overdraft.available_permits() as u64,
            overdraft_for(4 << 20) / UNIT
        );
    }

    /// A FUSE thread (outside the runtime) whose write request finds the copies' area and
    /// the overdraft taken for good (writes queued behind a stalled upload) waits
    /// [`COPY_WAIT`], then is told to copy outside the budget, counted (an earlier build
    /// blocked it until an upload let a copy go: with every FUSE thread there, the mount
    /// answered nothing, `ls` of other directories included).
    #[test]
    fn a_fuse_thread_never_waits_longer_than_copy_wait_for_a_copy() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let m = Arc::new(FsMetrics::default());
        let b = rt.block_on(async { MemoryBudget::new(64 << 20, m.clone()) });
        let area: Vec<_> = std::iter::from_fn(|| b.try_request_buffer(1 << 20)).collect();
        let over = b
            .overdraft
            .clone()
            .try_acquire_many_owned(b.overdraft_units as u32)
            .unwrap();
        let b2 = b.clone();
        let t = Instant::now();
        let got = std::thread::spawn(move || b2.request_buffer_blocking(1 << 20).is_none())
            .join()
            .unwrap();
        assert!(got, "no copy from the budget");
        assert!(
            t.elapsed() >= COPY_WAIT && t.elapsed() < COPY_WAIT * 3,
            "{:?}",
            t.elapsed()
        );
        assert_eq!(FsMetrics::get(&m.write_copies_unbudgeted), 1);
        // Right after, the next one does not wait again.
        let t = Instant::now();
        assert!(b.request_buffer_blocking(1 << 20).is_none());
        assert!(t.elapsed() < COPY_WAIT / 2, "{:?}", t.elapsed());
        assert_eq!(FsMetrics::get(&m.write_copies_unbudgeted), 2);
        drop((area, over));
        assert!(
            b.request_buffer_blocking(1 << 20).is_some(),
            "memory back, copies in it"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn write_copies_have_their_own_area_and_a_bounded_wait() {
        let m = Arc::new(FsMetrics::default());
        let b = MemoryBudget::new(64 << 20, m.clone());
        let area = request_area_for(64 << 20);
        assert_eq!(area, 4 << 20);
        // Parts in flight holding the whole budget do not stop a copy.
        let all = b.try_reserve(64 << 20).unwrap();
        let copies: Vec<_> = (0..4)
            .map(|_| b.try_request_buffer(1 << 20).unwrap())
            .collect();
        assert!(b.try_request_buffer(1 << 20).is_none(), "the area is full");
        // A copy freed serves the next one waiting, with its buffer kept for reuse.
        let waiter = tokio::spawn({
            let b = b.clone();
            async move { b.request_buffer(1 << 20).await }
        });
        tokio::task::yield_now().await;
        let mut copies = copies.into_iter();
        drop(copies.next());
        let got = tokio::time::timeout(Duration::from_millis(100), waiter)
            .await
            .expect("served by the freed copy")
            .unwrap();
        // With the area full for good, a copy waits DEMAND_WAIT, then takes the overdraft.
        let start = Instant::now();
        let over = b.request_buffer(1 << 20).await;
        assert!(start.elapsed() >= DEMAND_WAIT && start.elapsed() < DEMAND_WAIT * 2);
        assert_eq!(
            FsMetrics::get(&m.buffer_bytes),
            (64 << 20) + area + (1 << 20)
        );
        drop((all, got, over, copies));
        assert_eq!(FsMetrics::get(&m.buffer_bytes), 0);
        assert_eq!(b.requests.available_permits() as u64 * UNIT, area);
    }

    #[test]
    fn split_memory_returns_when_its_holder_drops_it() {
        let b = MemoryBudget::new(4 << 20, Arc::new(FsMetrics::default()));
        let (buf, mem) = b.try_buffer(1 << 20).unwrap().split_mem();
        let bytes = buf.freeze(1 << 20);
        let kept = bytes.clone(); // a store keeping the part's bytes
        drop((bytes, mem)); // the upload ended
        assert_eq!(
            b.available(),
            4 << 20,
            "the memory is back although the bytes live"
        );
        assert_eq!(kept.len(), 1 << 20);
        drop(kept);
        assert_eq!(b.pooled(), 1 << 20, "the mapping goes back to the pool");
    }

    struct Holder {
        mem: Mutex<Vec<Reservation>>,
        used: Instant,
    }

    impl Reclaim for Holder {
        fn reclaim(&self) -> u64 {
            let v = std::mem::take(&mut *self.mem.lock());
            v.iter().map(|r| r.bytes).sum()
        }
        fn holds(&self) -> bool {
            !self.mem.lock().is_empty()
        }
        fn last_use(&self) -> Instant {
            self.used
        }
    }

    #[tokio::test]
    async fn waiting_reservations_take_back_the_longest_unused_prefetch() {
        let b = MemoryBudget::new(4 << 20, Arc::new(FsMetrics::default()));
        let now = Instant::now();
        let holders: Vec<Arc<Holder>> = (0..4)
            .map(|i| {
                let h = Arc::new(Holder {
                    mem: Mutex::new(vec![b.try_reserve(1 << 20).unwrap()]),
                    used: now - Duration::from_secs(10 - i),
                });
                let weak = Arc::downgrade(&h);
                b.register(weak);
                h
            })
            .collect();
        assert_eq!(b.available(), 0);
        // A writer's reservation and a read both get memory at once, from the oldest holders.
        let w = tokio::time::timeout(Duration::from_millis(100), b.reserve(1 << 20))
            .await
            .expect("no wait");
        assert!(!holders[0].holds() && holders[3].holds());
        let r = tokio::time::timeout(Duration::from_millis(100), b.demand_buffer(1 << 20))
            .await
            .expect("no wait");
        assert!(!holders[1].holds() && holders[3].holds());
        drop((w, r, holders));
        assert_eq!(b.available(), 4 << 20);
    }

    #[tokio::test]
    async fn reservations_block_at_the_limit_and_release_on_drop() {
        let m = Arc::new(FsMetrics::default());
        let b = MemoryBudget::new(1 << 20, m.clone());
        let a = b.try_reserve(768 * 1024).unwrap();
        assert_eq!(FsMetrics::get(&m.buffer_bytes), 768 * 1024);
        assert!(b.try_reserve(512 * 1024).is_none());
        let c = b.try_reserve(256 * 1024).unwrap();
        assert_eq!(b.available(), 0);
        let waiter = tokio::spawn({
            let b = b.clone();
            async move { b.reserve(512 * 1024).await }
        });
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        assert!(!waiter.is_finished());
        drop(a);
        let r = waiter.await.unwrap();
        drop((r, c));
        assert_eq!(b.available(), 1 << 20);
        assert_eq!(FsMetrics::get(&m.buffer_bytes), 0);
        // Bigger than the whole budget: takes all of it rather than waiting forever.
        let all = b.reserve(10 << 20).await;
        assert_eq!(b.available(), 0);
        assert_eq!(FsMetrics::get(&m.buffer_bytes), 1 << 20);
        drop(all);
    }

    #[test]
    fn the_buffer_gauge_counts_the_units_held_not_the_bytes_asked() {
        let m = Arc::new(FsMetrics::default());
        let b = MemoryBudget::new(4 << 20, m.clone());
        // Small files' bodies: 1 KiB each, a whole unit of the budget each.
        let held: Vec<_> = (0..16).map(|_| b.try_buffer(1024).unwrap()).collect();
        assert_eq!(b.available(), (4 << 20) - 16 * UNIT);
        assert_eq!(FsMetrics::get(&m.buffer_bytes), 16 * UNIT);
        drop(held);
        assert_eq!(FsMetrics::get(&m.buffer_bytes), 0);
    }
}
