//! The data cache on local disk (`--data-cache DIR`, `--data-cache-size SIZE`): blocks of
//! objects that readers fetched, kept across unmounts and restarts so the next read of the
//! same version comes from the local disk instead of the bucket.
//!
//! A block is the [`BLOCK`]-sized piece `index` of object `key` version `etag` (the last one
//! shorter). It lives in one file named by a hash of (scope, key, etag, index), the scope
//! telling buckets and endpoints apart. The file's header repeats those four and carries the
//! CRC-32 of the data and of itself, all checked on every read: a changed object (new ETag)
//! never matches an old block, and a corrupt, truncated or colliding file is a miss (deleted,
//! the block fetched again), never served. A block is written under a temporary name and
//! renamed, so a crash leaves no half block under a real name.
//!
//! Writes go to one background thread through a short queue; when it is full the block is
//! simply not cached: a reader never waits for the cache disk. That thread keeps the directory
//! within the size, evicting the least recently used blocks (access times kept in memory,
//! taken from the files' mtimes at start and by a rescan every [`RESCAN_EVERY`], which also
//! finds blocks that other mounts sharing the directory wrote or evicted). A hit sets its
//! file's mtime, so the order survives a restart. Any I/O error of the cache disk (full,
//! failing) is logged once and counted; the read then goes to the bucket.
//!
//! Cached bytes are read straight into the reader's budget buffer, and written from it: the
//! cache holds no file data in the daemon's memory beyond the few blocks queued for writing.

use crate::metrics::{inc, inc_by, FsMetrics};
use bytes::Bytes;
use parking_lot::Mutex;
use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::io::{ErrorKind, Read, Write};
use std::ops::Range;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Size of a cached block (and the alignment of a reader's requests when the cache is on).
pub const BLOCK: u64 = 1 << 20;
/// Blocks waiting to be written at most: an eighth of the memory budget (they hold their
/// chunks' buffers), between 8 and 64. A stream's prefetch brings several 8 MiB chunks at
/// once; beyond this a fetched block is not cached.
pub fn queue_len(budget: u64) -> usize {
    (budget / 8 / BLOCK).clamp(8, 64) as usize
}
/// How often the writer rereads the directory (other mounts' blocks and evictions).
const RESCAN_EVERY: Duration = Duration::from_secs(60);
/// Temporary files older than this are a crashed writer's: removed by the rescan.
const STALE_TMP: Duration = Duration::from_secs(600);
/// Subdirectory of the cache directory: a new file format gets a new one.
const VERSION_DIR: &str = "bucketfs-v1";
const MAGIC: &[u8; 8] = b"BFSBLK1\n";
/// magic, three string lengths, index, data length, data CRC.
const FIXED: usize = 8 + 3 * 4 + 8 + 8 + 4;

/// The settings of a data cache.
#[derive(Debug, Clone)]
pub struct DataCacheConfig {
    pub dir: PathBuf,
    /// Most bytes of block files the directory holds.
    pub max_bytes: u64,
    /// Names the store the keys belong to (endpoint and bucket), so two buckets never share
    /// a block.
    pub scope: String,
}

/// Creates `dir` (0700) or checks it: refused if another user owns it or others may write
/// to it (they could plant blocks that pass the checks).
pub fn prepare_dir(dir: &Path) -> Result<(), String> {
    let show = dir.display();
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| format!("data cache {show}: {e}"))?;
    let md = std::fs::metadata(dir).map_err(|e| format!("data cache {show}: {e}"))?;
    if !md.is_dir() {
        return Err(format!("data cache {show} is not a directory"));
    }
    // SAFETY: geteuid cannot fail.
    let me = unsafe { libc::geteuid() };
    if md.uid() != me {
        return Err(format!(
            "data cache {show} belongs to user {}, not to this user ({me}): give a directory of your own",
            md.uid()
        ));
    }
    if md.permissions().mode() & 0o022 != 0 {
        return Err(format!(
            "data cache {show} is writable by other users (mode {:o}): chmod 700 it",
            md.permissions().mode() & 0o7777
        ));
    }
    Ok(())
}

/// What one block file is about.
struct BlockId<'a> {
    scope: &'a str,
    key: &'a str,
    etag: &'a str,
    index: u64,
}

impl BlockId<'_> {
    /// 128 bits of FNV-1a (two 64-bit lanes): a stable file name. A collision is harmless
    /// (the header does not match: a miss).
    fn name(&self) -> u128 {
        let mut a: u64 = 0xcbf2_9ce4_8422_2325;
        let mut b: u64 = 0x6c62_272e_07bb_0142;
        let idx = self.index.to_le_bytes();
        let parts: [&[u8]; 7] = [
            self.scope.as_bytes(),
            b"\0",
            self.key.as_bytes(),
            b"\0",
            self.etag.as_bytes(),
            b"\0",
            &idx,
        ];
        for p in parts {
            for &x in p {
                a = (a ^ u64::from(x)).wrapping_mul(0x0000_0100_0000_01b3);
                b = (b ^ u64::from(x)).wrapping_mul(0x0000_0100_0000_01b3 ^ 0x5a5a);
            }
        }
        (u128::from(a) << 64) | u128::from(b)
    }

    /// The header of a block of `len` bytes whose CRC-32 is `crc`.
    fn header(&self, len: u64, crc: u32) -> Vec<u8> {
        let mut h = Vec::with_capacity(FIXED + self.strings_len() + 4);
        h.extend_from_slice(MAGIC);
        for s in [self.scope, self.key, self.etag] {
            h.extend_from_slice(&(s.len() as u32).to_le_bytes());
        }
        h.extend_from_slice(&self.index.to_le_bytes());
        h.extend_from_slice(&len.to_le_bytes());
        h.extend_from_slice(&crc.to_le_bytes());
        for s in [self.scope, self.key, self.etag] {
            h.extend_from_slice(s.as_bytes());
        }
        let crc = crc32fast::hash(&h);
        h.extend_from_slice(&crc.to_le_bytes());
        h
    }

    fn strings_len(&self) -> usize {
        self.scope.len() + self.key.len() + self.etag.len()
    }
}

/// Why a block file was not served.
enum Miss {
    Absent,
    /// Its content does not check out: deleted.
    Corrupt(&'static str),
    Io(std::io::Error),
}

/// Which block files the directory holds, by name: size and last use.
#[derive(Default)]
struct Index {
    files: HashMap<u128, (u64, u64)>,
    /// (last use, name): the least recently used first.
    lru: BTreeSet<(u64, u128)>,
    bytes: u64,
}

impl Index {
    fn insert(&mut self, name: u128, size: u64, used: u64) {
        self.remove(name);
        self.files.insert(name, (size, used));
        self.lru.insert((used, name));
        self.bytes += size;
    }

    fn remove(&mut self, name: u128) -> Option<u64> {
        let (size, used) = self.files.remove(&name)?;
        self.lru.remove(&(used, name));
        self.bytes -= size;
        Some(size)
    }

    fn touch(&mut self, name: u128, size: u64, now: u64) {
        self.insert(name, size, now);
    }
}

struct Job {
    key: String,
    etag: String,
    index: u64,
    data: Bytes,
}

pub struct DataCache {
    root: PathBuf,
    scope: String,
    max_bytes: u64,
    index: Mutex<Index>,
    queue: SyncSender<Job>,
    metrics: Arc<FsMetrics>,
    /// An I/O error of the cache disk was logged (once per mount).
    warned: AtomicBool,
}

impl std::fmt::Debug for DataCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataCache")
            .field("root", &self.root)
            .field("max_bytes", &self.max_bytes)
            .finish()
    }
}

fn now_tick() -> u64 {
    tick(SystemTime::now())
}

fn tick(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

impl DataCache {
    /// Starts the cache in `cfg.dir` (made ready by [`prepare_dir`]): its writer thread reads
    /// the directory first, then writes what readers hand it.
    pub fn start(cfg: &DataCacheConfig, queue: usize, metrics: Arc<FsMetrics>) -> Arc<DataCache> {
        let (tx, rx) = sync_channel(queue);
        metrics
            .data_cache_limit_bytes
            .store(cfg.max_bytes, Ordering::Relaxed);
        let cache = Arc::new(DataCache {
            root: cfg.dir.join(VERSION_DIR),
            scope: cfg.scope.clone(),
            max_bytes: cfg.max_bytes,
            index: Mutex::default(),
            queue: tx,
            metrics,
            warned: AtomicBool::new(false),
        });
        let weak = Arc::downgrade(&cache);
        std::thread::Builder::new()
            .name("data-cache".into())
            .spawn(move || writer(weak, rx))
            .expect("spawn the data cache writer");
        cache
    }

    fn id<'a>(&'a self, key: &'a str, etag: &'a str, index: u64) -> BlockId<'a> {
        BlockId {
            scope: &self.scope,
            key,
            etag,
            index,
        }
    }

    fn path(&self, name: u128) -> PathBuf {
        let hex = format!("{name:032x}");
        self.root.join(&hex[..2]).join(hex)
    }

    fn io_error(&self, what: &str, e: &std::io::Error) {
        inc(&self.metrics.data_cache_errors);
        if !self.warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                "data cache {}: {what}: {e}; reading from the bucket instead (logged once)",
                self.root.display()
            );
        }
    }

    /// Fills `out` with the cached blocks of object `key` (version `etag`, `size` bytes)
    /// that lie wholly within `range`, `out` holding `range`. Returns, for each of those
    /// blocks ([`blocks_within`]), whether it came from the cache.
    pub fn read_blocks(
        &self,
        key: &str,
        etag: &str,
        size: u64,
        range: Range<u64>,
        out: &mut [u8],
    ) -> Vec<bool> {
        blocks_within(&range, size)
            .map(|i| {
                let b = block_range(i, size);
                let dst = &mut out[(b.start - range.start) as usize..(b.end - range.start) as usize];
                let id = self.id(key, etag, i);
                match self.read_one(&id, dst) {
                    Ok(()) => {
                        inc(&self.metrics.data_cache_hits);
                        inc_by(&self.metrics.data_cache_bytes_served, dst.len() as u64);
                        true
                    }
                    Err(miss) => {
                        inc(&self.metrics.data_cache_misses);
                        match miss {
                            Miss::Absent => {}
                            Miss::Io(e) => self.io_error("read", &e),
                            Miss::Corrupt(why) => {
                                inc(&self.metrics.data_cache_corrupt);
                                let name = id.name();
                                tracing::warn!(
                                    "data cache block {} ({key} block {i}) is {why}: removed, fetching it again",
                                    self.path(name).display()
                                );
                                let _ = std::fs::remove_file(self.path(name));
                                self.index.lock().remove(name);
                                self.update_size();
                            }
                        }
                        false
                    }
                }
            })
            .collect()
    }

    /// Reads and checks one block file into `dst` (its expected length).
    fn read_one(&self, id: &BlockId<'_>, dst: &mut [u8]) -> Result<(), Miss> {
        let name = id.name();
        let mut f = match File::open(self.path(name)) {
            Ok(f) => f,
            Err(e) if e.kind() == ErrorKind::NotFound => return Err(Miss::Absent),
            Err(e) => return Err(Miss::Io(e)),
        };
        let want = id.header(dst.len() as u64, 0);
        let hlen = want.len();
        let file_len = f.metadata().map_err(Miss::Io)?.len();
        if file_len != (hlen + dst.len()) as u64 {
            // Cut short or damaged (another block under a colliding name is as good as never).
            return Err(Miss::Corrupt("truncated or of the wrong length"));
        }
        let mut h = vec![0; hlen];
        read_exact(&mut f, &mut h)?;
        read_exact(&mut f, dst)?;
        // The header's own CRC, then its fields (all but the data CRC, bytes 36..40 of the
        // fixed part) must be this block's, then the data's CRC.
        let (body, crc) = h.split_at(hlen - 4);
        if crc32fast::hash(body).to_le_bytes() != crc {
            return Err(Miss::Corrupt("corrupt (header checksum)"));
        }
        if body[..36] != want[..36] || body[40..] != want[40..hlen - 4] {
            return Err(Miss::Absent); // another block under a colliding name
        }
        if crc32fast::hash(dst).to_le_bytes() != body[36..40] {
            return Err(Miss::Corrupt("corrupt (data checksum)"));
        }
        // Its last use, kept on disk for the next start.
        let _ = f.set_modified(SystemTime::now());
        let size = file_len;
        self.index.lock().touch(name, size, now_tick());
        Ok(())
    }

    /// Hands block `index` of `key` version `etag` to the writer, unless its queue is full.
    pub fn put(&self, key: &str, etag: &str, index: u64, data: Bytes) {
        let job = Job {
            key: key.to_string(),
            etag: etag.to_string(),
            index,
            data,
        };
        match self.queue.try_send(job) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => inc(&self.metrics.data_cache_skipped),
            Err(TrySendError::Disconnected(_)) => {}
        }
    }

    fn update_size(&self) {
        let b = self.index.lock().bytes;
        self.metrics.data_cache_bytes.store(b, Ordering::Relaxed);
    }

    /// Writes one block: evicts to make room, then temp file and rename.
    fn write(&self, job: &Job) {
        let id = self.id(&job.key, &job.etag, job.index);
        let name = id.name();
        if self.index.lock().files.contains_key(&name) {
            return;
        }
        let header = id.header(job.data.len() as u64, crc32fast::hash(&job.data));
        let size = (header.len() + job.data.len()) as u64;
        if size > self.max_bytes {
            return;
        }
        self.evict_to(self.max_bytes - size);
        let path = self.path(name);
        let tmp = path.with_file_name(format!(".tmp-{}-{name:032x}", std::process::id()));
        let written = (|| {
            let mut f = match File::create(&tmp) {
                Err(e) if e.kind() == ErrorKind::NotFound => {
                    std::fs::create_dir_all(tmp.parent().expect("a block has a parent"))?;
                    File::create(&tmp)?
                }
                r => r?,
            };
            f.write_all(&header)?;
            f.write_all(&job.data)?;
            std::fs::rename(&tmp, &path)
        })();
        match written {
            Ok(()) => {
                self.index.lock().insert(name, size, now_tick());
                self.update_size();
            }
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                self.io_error("write", &e);
            }
        }
    }

    /// Evicts the least recently used blocks until at most `limit` bytes are left.
    fn evict_to(&self, limit: u64) {
        loop {
            let victim = {
                let mut ix = self.index.lock();
                if ix.bytes <= limit {
                    break;
                }
                let Some(&(_, name)) = ix.lru.iter().next() else {
                    break;
                };
                ix.remove(name);
                name
            };
            match std::fs::remove_file(self.path(victim)) {
                Ok(()) => inc(&self.metrics.data_cache_evictions),
                Err(e) if e.kind() == ErrorKind::NotFound => {} // another mount evicted it
                Err(e) => self.io_error("evict", &e),
            }
        }
        self.update_size();
    }

    /// Rereads the directory: block files (size and mtime, or the later use this mount saw)
    /// replace the index; temporary files of crashed writers go.
    fn rescan(&self) {
        let mut found: Vec<(u128, u64, u64)> = Vec::new();
        let subdirs = match std::fs::read_dir(&self.root) {
            Ok(d) => d,
            Err(e) if e.kind() == ErrorKind::NotFound => {
                if let Err(e) = std::fs::DirBuilder::new().mode(0o700).create(&self.root) {
                    if e.kind() != ErrorKind::AlreadyExists {
                        self.io_error("create", &e);
                    }
                }
                return;
            }
            Err(e) => return self.io_error("scan", &e),
        };
        for sub in subdirs.flatten() {
            let Ok(files) = std::fs::read_dir(sub.path()) else {
                continue;
            };
            for f in files.flatten() {
                let Ok(md) = f.metadata() else { continue };
                let file_name = f.file_name();
                let name = file_name.to_string_lossy();
                let mtime = md.modified().unwrap_or(UNIX_EPOCH);
                if name.starts_with(".tmp-") {
                    if mtime.elapsed().is_ok_and(|age| age > STALE_TMP) {
                        let _ = std::fs::remove_file(f.path());
                    }
                    continue;
                }
                if let Ok(n) = u128::from_str_radix(&name, 16) {
                    found.push((n, md.len(), tick(mtime)));
                }
            }
        }
        {
            let mut ix = self.index.lock();
            let mut fresh = Index::default();
            for (n, size, t) in found {
                let used = ix.files.get(&n).map_or(t, |&(_, u)| u.max(t));
                fresh.insert(n, size, used);
            }
            *ix = fresh;
        }
        self.evict_to(self.max_bytes);
    }
}

fn read_exact(f: &mut File, buf: &mut [u8]) -> Result<(), Miss> {
    f.read_exact(buf).map_err(|e| match e.kind() {
        ErrorKind::UnexpectedEof => Miss::Corrupt("truncated"),
        _ => Miss::Io(e),
    })
}

/// The writer thread: scans, then writes blocks as they come, rescanning now and then.
fn writer(cache: std::sync::Weak<DataCache>, rx: Receiver<Job>) {
    match cache.upgrade() {
        Some(c) => c.rescan(),
        None => return,
    }
    let mut scanned = std::time::Instant::now();
    // Ends when the cache is dropped (its sender with it).
    while let Ok(job) = rx.recv() {
        let Some(c) = cache.upgrade() else { return };
        if scanned.elapsed() >= RESCAN_EVERY {
            c.rescan();
            scanned = std::time::Instant::now();
        }
        c.write(&job);
    }
}

/// The byte range of block `i` of an object of `size` bytes.
pub fn block_range(i: u64, size: u64) -> Range<u64> {
    i * BLOCK..((i + 1) * BLOCK).min(size)
}

/// The blocks of an object of `size` bytes that lie wholly within `range`.
pub fn blocks_within(range: &Range<u64>, size: u64) -> Range<u64> {
    let first = range.start.div_ceil(BLOCK);
    let end = if range.end >= size {
        size.div_ceil(BLOCK)
    } else {
        range.end / BLOCK
    };
    first..end.max(first)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::MemoryBudget;
    use crate::files::read::{ReadConfig, Reader};
    use bucketfs_store::fault::{Fault, FaultStore};
    use bucketfs_store::memory::MemoryStore;
    use bucketfs_store::metrics::Op;
    use bucketfs_store::{ObjectStore, StoreError, UserMeta};

    fn start(dir: &Path, max_bytes: u64) -> (Arc<DataCache>, Arc<FsMetrics>) {
        prepare_dir(dir).unwrap();
        let m = Arc::new(FsMetrics::default());
        let cfg = DataCacheConfig {
            dir: dir.to_path_buf(),
            max_bytes,
            scope: "test".into(),
        };
        (DataCache::start(&cfg, 8, m.clone()), m)
    }

    fn wait_until(what: &str, f: impl Fn() -> bool) {
        let t = std::time::Instant::now();
        while !f() {
            assert!(t.elapsed() < Duration::from_secs(10), "{what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn get(c: &DataCache, etag: &str, index: u64, len: usize) -> Option<Vec<u8>> {
        let mut out = vec![0; len];
        let size = index * BLOCK + len as u64;
        let r = index * BLOCK..size;
        c.read_blocks("k", etag, size, r, &mut out)[0].then_some(out)
    }

    fn put_and_wait(c: &DataCache, etag: &str, index: u64, data: &[u8]) {
        c.put("k", etag, index, Bytes::copy_from_slice(data));
        let name = c.id("k", etag, index).name();
        wait_until("block written", || c.index.lock().files.contains_key(&name));
    }

    #[test]
    fn blocks_come_back_only_for_their_own_key_etag_and_sound_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let (c, m) = start(dir.path(), 64 << 20);
        let data: Vec<u8> = (0..5000u32).map(|i| (i % 253) as u8).collect();
        put_and_wait(&c, "e1", 3, &data);
        assert_eq!(get(&c, "e1", 3, data.len()).as_deref(), Some(&data[..]));
        // Another version, another block, another length: misses.
        assert!(get(&c, "e2", 3, data.len()).is_none());
        assert!(get(&c, "e1", 2, data.len()).is_none());
        assert!(get(&c, "e1", 3, data.len() - 1).is_none());
        assert_eq!(FsMetrics::get(&m.data_cache_corrupt), 1, "the wrong length");
        // That removed it; written again, then one bit flipped: removed, never served.
        put_and_wait(&c, "e1", 3, &data);
        let path = c.path(c.id("k", "e1", 3).name());
        let mut bytes = std::fs::read(&path).unwrap();
        let n = bytes.len();
        bytes[n - 7] ^= 4;
        std::fs::write(&path, &bytes).unwrap();
        assert!(get(&c, "e1", 3, data.len()).is_none());
        assert!(!path.exists());
        assert_eq!(FsMetrics::get(&m.data_cache_corrupt), 2);
        // A corrupt header too.
        put_and_wait(&c, "e1", 3, &data);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[30] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        assert!(get(&c, "e1", 3, data.len()).is_none());
        assert_eq!(FsMetrics::get(&m.data_cache_corrupt), 3);
        assert_eq!(FsMetrics::get(&m.data_cache_hits), 1);
    }

    #[test]
    fn eviction_keeps_the_size_and_the_recently_read_blocks() {
        let dir = tempfile::tempdir().unwrap();
        let block = vec![7u8; 100_000];
        let one = block.len() as u64 + 200;
        let (c, m) = start(dir.path(), 3 * one);
        for i in 0..3 {
            put_and_wait(&c, "e", i, &block);
        }
        // Block 0 read last: block 1 is the least recently used.
        assert!(get(&c, "e", 0, block.len()).is_some());
        put_and_wait(&c, "e", 3, &block);
        assert!(get(&c, "e", 1, block.len()).is_none());
        for i in [0, 2, 3] {
            assert!(get(&c, "e", i, block.len()).is_some(), "block {i}");
        }
        assert_eq!(FsMetrics::get(&m.data_cache_evictions), 1);
        assert!(FsMetrics::get(&m.data_cache_bytes) <= 3 * one);
        // A restart rebuilds the index from the files; a smaller size evicts at once.
        drop(c);
        let (c, m) = start(dir.path(), 2 * one);
        wait_until("rescan", || FsMetrics::get(&m.data_cache_evictions) == 1);
        assert!(FsMetrics::get(&m.data_cache_bytes) <= 2 * one);
        assert_eq!(c.index.lock().files.len(), 2);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_new_reader_reads_cached_blocks_with_no_get() {
        const MIB: u64 = 1 << 20;
        let dir = tempfile::tempdir().unwrap();
        let mem: Arc<dyn ObjectStore> = Arc::new(MemoryStore::new());
        let data: Vec<u8> = (0..(3 * MIB + 777) as usize)
            .map(|i| (i * 13 % 251) as u8)
            .collect();
        let etag = mem
            .put("f", Bytes::from(data.clone()), &UserMeta::default())
            .await
            .unwrap();
        let store = Arc::new(FaultStore::new(mem));
        // A fresh cache and budget each time: a remount.
        let reader = |dir: &Path| {
            let (cache, metrics) = start(dir, 64 << 20);
            let cfg = Arc::new(ReadConfig {
                part_size: 8 * MIB,
                max_window: 8 * MIB,
                budget: MemoryBudget::new(64 * MIB, metrics.clone()),
                metrics: metrics.clone(),
                data_cache: Some(cache.clone()),
            });
            let s: Arc<dyn ObjectStore> = store.clone();
            let r = Reader::new(
                s,
                cfg,
                "f".into(),
                Some(etag.clone()),
                data.len() as u64,
                false,
            );
            // The cache outlives the reader: its writer drops what is queued when it goes.
            (r, metrics, cache)
        };
        let (mut r, m, _cache) = reader(dir.path());
        let got = r.read(0, data.len() as u32).await.unwrap();
        assert!(got[..] == data[..]);
        drop(r);
        wait_until("four blocks", || {
            FsMetrics::get(&m.data_cache_bytes) > 3 * MIB
        });
        // Every GET fails from here: the bytes can only come from the cache.
        store.inject(
            Op::Get,
            0,
            None,
            Fault::Error(StoreError::AccessDenied("f".into())),
        );
        let (mut r, m, _) = reader(dir.path());
        for off in [2 * MIB + 5, 0, MIB] {
            let got = r.read(off, 300_000).await.unwrap();
            assert!(got[..] == data[off as usize..off as usize + 300_000]);
        }
        assert!(FsMetrics::get(&m.data_cache_hits) >= 3);
        assert_eq!(FsMetrics::get(&m.data_cache_misses), 0);
        drop(r);
        // A hole in the middle (block 1 gone) and a damaged block at the end: one GET for
        // the span between the sound blocks at either end, the right bytes, both rewritten.
        store.clear();
        let (r0, _, cache) = reader(dir.path());
        drop(r0);
        std::fs::remove_file(cache.path(cache.id("f", &etag, 1).name())).unwrap();
        let last = cache.path(cache.id("f", &etag, 3).name());
        let mut bytes = std::fs::read(&last).unwrap();
        let n = bytes.len();
        bytes[n - 1] ^= 1;
        std::fs::write(&last, &bytes).unwrap();
        let (mut r, m, _cache) = reader(dir.path());
        let got = r.read(0, data.len() as u32).await.unwrap();
        assert!(got[..] == data[..]);
        assert_eq!(FsMetrics::get(&m.data_cache_hits), 2);
        assert_eq!(FsMetrics::get(&m.data_cache_misses), 2);
        assert_eq!(FsMetrics::get(&m.data_cache_corrupt), 1);
        wait_until("rewritten", || {
            FsMetrics::get(&m.data_cache_bytes) > 3 * MIB && last.exists()
        });
    }
}
