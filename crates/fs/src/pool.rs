//! Reusable buffers for file data (the bodies readers fetch, writers' parts, copies of write
//! requests), owned by the memory budget.
//!
//! Why not the allocator: glibc keeps freed multi-MiB chunks in its arenas, fragmented, and
//! does not give them back. With 10 concurrent readers at `--max-memory 256M` the daemon kept
//! ~274 MiB resident with no buffer live, and peaked near 350 MiB while the budget held 256;
//! 64 writers' 8 MiB parts read back from staging files left ~200 MiB in glibc's heap, a
//! 406 MiB peak.
//! These buffers are mapped from the kernel directly and kept for reuse when freed, as long
//! as reserved memory plus kept buffers stay within the budget (and kept ones within a
//! quarter of it); anything beyond that is unmapped at once, so it really leaves the process.
//! Reuse also spares a fresh buffer's page faults on the hot read path. Buffers kept unused
//! for [`IDLE_TTL`] are unmapped too, so a daemon that stops reading gives the memory back.

use crate::budget::Reservation;
use bytes::Bytes;
use parking_lot::Mutex;
use std::collections::{BTreeMap, VecDeque};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;
use tokio::runtime::Handle;
use tokio::sync::Semaphore;
// The runtime's clock (so tests can pause it); the plain system clock otherwise.
use tokio::time::Instant;

/// Buffers are sized in these steps (the budget's accounting unit), so one serves every
/// request of its size class and never holds more than its reservation.
pub const STEP: usize = 64 * 1024;

/// Kept buffers unused this long are unmapped.
pub const IDLE_TTL: Duration = Duration::from_secs(5);

/// An anonymous private mapping of `len` bytes.
struct Region {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value alone.
unsafe impl Send for Region {}
// SAFETY: shared access only reads it.
unsafe impl Sync for Region {}

impl Region {
    /// `populate`: fault its pages in now (see below); otherwise they fault in as written.
    fn new(len: usize, populate: bool) -> Region {
        // SAFETY: a fresh anonymous mapping; no existing memory is touched.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            // What a failed allocation does anyway; the budget keeps this rare.
            std::alloc::handle_alloc_error(std::alloc::Layout::from_size_align(len, 4096).unwrap())
        }
        // Every byte of a buffer is about to be written (a GET body, a part): fault its pages
        // in with one call rather than one fault per 4 KiB page as the copy reaches them (on
        // a cold concurrent read those faults were a fifth of the daemon's CPU). Kernels
        // before 5.14 refuse it, and the pages then fault in as they are touched.
        if populate {
            // SAFETY: advice on the mapping made above, which nothing else refers to yet.
            unsafe {
                libc::madvise(p, len, libc::MADV_POPULATE_WRITE);
            }
        }
        Region {
            ptr: NonNull::new(p.cast()).expect("mmap returned a non-null address"),
            len,
        }
    }

    fn slice(&self, len: usize) -> &[u8] {
        // SAFETY: `len <= self.len`, the mapping is live and initialised (zero or written).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), len.min(self.len)) }
    }

    fn slice_mut(&mut self, len: usize) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), len.min(self.len)) }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `new`, which nothing refers to any more.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

#[derive(Default)]
struct Idle {
    /// Kept buffers by size, each list oldest first, with when each was kept.
    by_size: BTreeMap<usize, VecDeque<(u64, Instant, Region)>>,
    bytes: u64,
    /// Sequence number of the next buffer kept (orders eviction across sizes).
    seq: u64,
    /// A task unmaps buffers kept too long; it runs while any are kept.
    expiring: bool,
}

impl Idle {
    /// Removes the buffer kept longest.
    fn pop_oldest(&mut self) -> Option<Region> {
        let size = *self
            .by_size
            .iter()
            .filter_map(|(s, l)| l.front().map(|(seq, ..)| (seq, s)))
            .min()?
            .1;
        let list = self.by_size.get_mut(&size)?;
        let (_, _, r) = list.pop_front()?;
        if list.is_empty() {
            self.by_size.remove(&size);
        }
        self.bytes -= r.len as u64;
        Some(r)
    }

    /// Removes the buffers kept since before `cutoff`.
    fn pop_stale(&mut self, cutoff: Instant, out: &mut Vec<Region>) {
        for list in self.by_size.values_mut() {
            while list.front().is_some_and(|(_, t, _)| *t < cutoff) {
                if let Some((_, _, r)) = list.pop_front() {
                    self.bytes -= r.len as u64;
                    out.push(r);
                }
            }
        }
        self.by_size.retain(|_, l| !l.is_empty());
    }
}

/// Freed buffers kept for reuse. Their memory is not reserved, so a waiting reservation is
/// never held up by them; instead they are trimmed so that reservations plus kept buffers
/// never exceed the budget.
pub struct Pool {
    /// The budget's semaphore: what is not available there is reserved.
    sem: Arc<Semaphore>,
    budget: u64,
    /// At most this much is kept.
    max_idle: u64,
    idle: Mutex<Idle>,
    /// Where the expiry task runs (none outside a runtime: buffers then only expire as others
    /// are kept).
    rt: Option<Handle>,
    /// Buffers mapped so far.
    fresh: AtomicU64,
}

impl Pool {
    pub fn new(sem: Arc<Semaphore>, budget: u64) -> Arc<Pool> {
        Arc::new(Pool {
            sem,
            budget,
            max_idle: budget / 4,
            idle: Mutex::default(),
            rt: Handle::try_current().ok(),
            fresh: AtomicU64::new(0),
        })
    }

    fn reserved(&self) -> u64 {
        self.budget
            .saturating_sub(self.sem.available_permits() as u64 * STEP as u64)
    }

    /// A buffer for `len` bytes whose memory `mem` holds: a kept one of its size, or a new one.
    pub fn take(self: &Arc<Self>, len: usize, mem: Reservation) -> PoolBuf {
        self.take_as(len, mem, true)
    }

    /// [`Self::take`]; `populate`: a fresh buffer's pages are faulted in at once, for one
    /// about to be written whole (otherwise they fault in as written: the start of a small
    /// file being written, which may stay a few bytes).
    pub fn take_as(self: &Arc<Self>, len: usize, mem: Reservation, populate: bool) -> PoolBuf {
        let size = len.div_ceil(STEP).max(1) * STEP;
        let kept = {
            let mut idle = self.idle.lock();
            let r = idle.by_size.get_mut(&size).and_then(|l| l.pop_back());
            if let Some((.., r)) = &r {
                idle.bytes -= r.len as u64;
                if idle.by_size.get(&size).is_some_and(VecDeque::is_empty) {
                    idle.by_size.remove(&size);
                }
            }
            r.map(|(.., r)| r)
        };
        let region = kept.unwrap_or_else(|| {
            self.fresh.fetch_add(1, Ordering::Relaxed);
            Region::new(size, populate)
        });
        // Only now, with the kept buffer this memory pays for out of the pool.
        self.trim();
        PoolBuf {
            region: Some(region),
            len,
            mem: Some(mem),
            pool: self.clone(),
        }
    }

    /// Unmaps kept buffers while reserved plus kept memory is over the budget (someone just
    /// reserved memory).
    pub fn trim(&self) {
        let mut drop_now = Vec::new();
        {
            let mut idle = self.idle.lock();
            let room = self.budget.saturating_sub(self.reserved());
            while idle.bytes > room {
                match idle.pop_oldest() {
                    Some(r) => drop_now.push(r),
                    None => break,
                }
            }
        }
        drop(drop_now); // munmap outside the lock
    }

    /// Takes back a freed buffer: kept if it fits, unmapped if not.
    fn put(self: &Arc<Self>, region: Region) {
        let mut drop_now = Vec::new();
        let mut start_expiry = false;
        {
            let mut idle = self.idle.lock();
            let now = Instant::now();
            if let Some(cutoff) = now.checked_sub(IDLE_TTL) {
                idle.pop_stale(cutoff, &mut drop_now);
            }
            let room = self
                .max_idle
                .min(self.budget.saturating_sub(self.reserved()));
            if region.len as u64 > room {
                drop_now.push(region);
            } else {
                // Newest kept, oldest unmapped.
                idle.bytes += region.len as u64;
                while idle.bytes > room {
                    match idle.pop_oldest() {
                        Some(r) => drop_now.push(r),
                        None => break,
                    }
                }
                let seq = idle.seq;
                idle.seq += 1;
                idle.by_size
                    .entry(region.len)
                    .or_default()
                    .push_back((seq, now, region));
                if !idle.expiring && self.rt.is_some() {
                    idle.expiring = true;
                    start_expiry = true;
                }
            }
        }
        drop(drop_now);
        if let (true, Some(rt)) = (start_expiry, &self.rt) {
            rt.spawn(Self::expire(Arc::downgrade(self)));
        }
    }

    /// Unmaps buffers kept longer than [`IDLE_TTL`]; ends when none are kept.
    async fn expire(pool: Weak<Pool>) {
        loop {
            tokio::time::sleep(IDLE_TTL).await;
            let Some(pool) = pool.upgrade() else {
                return;
            };
            let mut drop_now = Vec::new();
            let done = {
                let mut idle = pool.idle.lock();
                if let Some(cutoff) = Instant::now().checked_sub(IDLE_TTL) {
                    idle.pop_stale(cutoff, &mut drop_now);
                }
                // Decided under the lock, so a buffer kept meanwhile starts a new task.
                idle.expiring = idle.bytes > 0;
                !idle.expiring
            };
            drop(drop_now);
            if done {
                return;
            }
        }
    }

    /// Buffers mapped so far (not reused).
    #[cfg(test)]
    pub fn fresh(&self) -> u64 {
        self.fresh.load(Ordering::Relaxed)
    }

    /// Bytes kept for reuse.
    #[cfg(test)]
    pub fn idle_bytes(&self) -> u64 {
        self.idle.lock().bytes
    }
}

/// A buffer of file data and the budget memory it holds; back to the pool when dropped.
pub struct PoolBuf {
    region: Option<Region>,
    len: usize,
    mem: Option<Reservation>,
    pool: Arc<Pool>,
}

impl PoolBuf {
    /// The buffer's `len` bytes (old contents when it is reused).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        let len = self.len;
        self.region.as_mut().expect("live buffer").slice_mut(len)
    }

    /// The memory it holds, apart from the buffer from now on: its holder decides how long
    /// that memory counts (a part's upload: until its request ends, although a store may keep
    /// the bytes longer), while the mapping goes back to the pool when the last clone of its
    /// bytes is dropped.
    pub fn split_mem(mut self) -> (PoolBuf, Reservation) {
        let mem = self
            .mem
            .take()
            .expect("a buffer holds its memory until split");
        (self, mem)
    }

    /// Its first `filled` bytes as [`Bytes`] without a copy; the buffer (and its memory)
    /// goes back when the last clone or slice is dropped.
    pub fn freeze(mut self, filled: usize) -> Bytes {
        self.len = filled.min(self.len);
        Bytes::from_owner(self)
    }
}

impl AsMut<[u8]> for PoolBuf {
    fn as_mut(&mut self) -> &mut [u8] {
        self.as_mut_slice()
    }
}

impl AsRef<[u8]> for PoolBuf {
    fn as_ref(&self) -> &[u8] {
        self.region.as_ref().expect("live buffer").slice(self.len)
    }
}

impl Drop for PoolBuf {
    fn drop(&mut self) {
        // Memory first: the pool counts what is reserved when it decides to keep the buffer.
        drop(self.mem.take());
        if let Some(r) = self.region.take() {
            self.pool.put(r);
        }
    }
}
