//! One global memory budget for prefetched data and part buffers (`--max-memory`).
//!
//! Every buffer that holds file data for longer than one request takes a [`Reservation`]
//! first. Readers ask with [`MemoryBudget::try_reserve`] for read-ahead, so when the budget is
//! full their windows simply stop growing; the bytes a read needs right now, and the parts a
//! writer uploads, wait in [`MemoryBudget::reserve`] until memory is returned. The daemon
//! therefore never holds more than the budget in these buffers, and never fails with ENOMEM.
//! Writers' in-memory part buffers can live as long as a file is open, so they only take
//! memory with [`MemoryBudget::try_reserve_lasting`], which keeps them within half the budget
//! (a writer that gets none stages on disk): the rest is always given back, so nobody waits
//! forever.
//!
//! The budget also keeps a cache of blocks readers fetched but did not hand to the kernel
//! (the rest of a random read's 128 KiB block, a stream's chunks when the reader jumps away or
//! closes), up to a quarter of the budget. It is the first thing given back: a reservation that
//! would wait evicts cached blocks first, so the cache can never starve a reader or a writer.
//!
//! Readers' buffers come from the budget's [`Pool`], which reuses freed ones within the budget
//! instead of leaving them to the allocator (see there why).

use crate::metrics::FsMetrics;
use crate::pool::{Pool, PoolBuf, STEP};
use bytes::Bytes;
use parking_lot::Mutex;
use std::collections::{BTreeMap, VecDeque};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Accounting granularity: the pool's buffer size step, so a buffer is exactly its reservation.
const UNIT: u64 = STEP as u64;

pub struct MemoryBudget {
    sem: Arc<Semaphore>,
    units: u64,
    /// Bytes held in [`MemoryBudget::try_reserve_lasting`] reservations.
    lasting: Arc<AtomicU64>,
    metrics: Arc<FsMetrics>,
    cache: Mutex<BlockCache>,
    pool: Arc<Pool>,
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
    metrics: Arc<FsMetrics>,
    /// The lasting-bytes counter this reservation counts in, if any.
    lasting: Option<Arc<AtomicU64>>,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.metrics
            .buffer_bytes
            .fetch_sub(self.bytes, Ordering::Relaxed);
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
        Arc::new(Self {
            pool: Pool::new(sem.clone(), units * UNIT),
            sem,
            units,
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
        self.metrics
            .buffer_bytes
            .fetch_add(bytes, Ordering::Relaxed);
        Reservation {
            _permit: Some(permit),
            bytes,
            metrics: self.metrics.clone(),
            lasting: None,
        }
    }

    /// Waits until `bytes` are free and takes them, evicting cached blocks before waiting.
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
    /// out a kept buffer for this memory (trimming first could unmap that very buffer).
    async fn reserve_untrimmed(&self, bytes: u64) -> Reservation {
        let units = self.units_for(bytes);
        loop {
            if let Ok(permit) = self.sem.clone().try_acquire_many_owned(units) {
                return self.wrap(permit, bytes);
            }
            if !self.cache.lock().evict_one() {
                break;
            }
        }
        let permit = self
            .sem
            .clone()
            .acquire_many_owned(units)
            .await
            .expect("the budget semaphore is never closed");
        self.wrap(permit, bytes)
    }

    /// A buffer for `len` bytes of file data, if that much memory is free now. It holds the
    /// memory until it (and every [`Bytes`] made of it) is dropped.
    pub fn try_buffer(&self, len: u64) -> Option<PoolBuf> {
        let mem = self.try_reserve_untrimmed(len)?;
        Some(self.pool.take(len as usize, mem))
    }

    /// A buffer for `len` bytes of file data, waiting for the memory if it must.
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
        let limit = self.units * UNIT / 4;
        while c.bytes > limit && c.evict_one() {}
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

    /// Takes `bytes` for memory that may be held for as long as a file stays open (a writer's
    /// part buffer), if they are free now and such memory stays within half the budget. The
    /// other half is only ever held for the length of a request, so whoever waits in
    /// [`MemoryBudget::reserve`] is always served eventually.
    pub fn try_reserve_lasting(&self, bytes: u64) -> Option<Reservation> {
        let r = self.try_reserve_lasting_untrimmed(bytes)?;
        self.pool.trim();
        Some(r)
    }

    /// A pool buffer for `len` bytes held as long as a file stays open (a writer's whole
    /// part), on the terms of [`MemoryBudget::try_reserve_lasting`]. Reusing kept buffers
    /// spares a fresh mapping's page faults and zeroing on every part.
    pub fn try_buffer_lasting(&self, len: u64) -> Option<PoolBuf> {
        let mem = self.try_reserve_lasting_untrimmed(len)?;
        Some(self.pool.take(len as usize, mem))
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

/// A default budget from the machine's memory: an eighth of RAM, between 256 MiB and 4 GiB.
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
    (total / 8).clamp(256 << 20, 4 << 30)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lasting_reservations_stay_within_half_the_budget() {
        let m = Arc::new(FsMetrics::default());
        let b = MemoryBudget::new(1 << 20, m);
        let a = b.try_reserve_lasting(256 * 1024).unwrap();
        let c = b.try_reserve_lasting(256 * 1024).unwrap();
        // Half the budget is lasting now: no more, although the other half is free.
        assert!(b.try_reserve_lasting(64 * 1024).is_none());
        assert_eq!(b.available(), 512 * 1024);
        let short = b.try_reserve(512 * 1024).unwrap();
        // Lasting room, but no free memory: refused, and the refusal holds nothing.
        drop(a);
        let _busy = b.try_reserve(256 * 1024).unwrap();
        assert!(b.try_reserve_lasting(64 * 1024).is_none());
        drop((short, _busy));
        let d = b.try_reserve_lasting(256 * 1024).unwrap();
        drop((c, d));
        assert_eq!(b.available(), 1 << 20);
        assert!(b.try_reserve_lasting(512 * 1024).is_some());
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
        drop(all);
    }
}
