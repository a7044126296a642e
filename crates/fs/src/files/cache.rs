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
//!
//! Whole objects (with FUSE passthrough on, [`DataCache::set_whole_files`]): when every block
//! of a version is cached, the writer assembles them, each checked, into one file holding
//! exactly the object's bytes at their offsets (`NAME.obj`, written under a temporary name and
//! renamed), then writes its manifest (`NAME.man`: scope, key, ETag, size, every block's
//! CRC-32, and the seal: the data file's device, inode and ctime after the rename, and the
//! boot it was written in), and removes the block files. The kernel may read such a file
//! directly ([`DataCache::local_copy`]); before it is handed over the seal is checked (any
//! write, truncation or replacement of the file changes its ctime, size or inode), and its
//! CRCs are checked in full once when it was written before the machine last started (a
//! crash may have lost bytes the page cache held). Readers of the daemon read it block by
//! block with each block's CRC checked, as block files. An entry is never changed in place:
//! eviction unlinks it, so a descriptor the kernel holds keeps its bytes.

use crate::metrics::{inc, inc_by, FsMetrics};
use bytes::Bytes;
use parking_lot::Mutex;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::fs::File;
use std::io::{ErrorKind, Read, Write};
use std::ops::Range;
use std::os::unix::fs::{DirBuilderExt, FileExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Size of a cached block (and the alignment of a reader's requests when the cache is on).
pub const BLOCK: u64 = 1 << 20;
/// Blocks waiting to be written at most: an eighth of the memory budget (each holds a
/// buffer of its own), between 8 and 64. A stream's prefetch brings several chunks of up to
/// 32 MiB at once; beyond this a fetched block is not cached.
pub fn queue_len(budget: u64) -> usize {
    (budget / 8 / BLOCK).clamp(8, 64) as usize
}
/// How often the writer rereads the directory (other mounts' blocks and evictions).
const RESCAN_EVERY: Duration = Duration::from_secs(60);
/// A whole copy's manifest gets its last use written when the one it holds is older.
const TOUCH_EVERY: Duration = Duration::from_secs(60);
/// Temporary files older than this are a crashed writer's: removed by the rescan.
const STALE_TMP: Duration = Duration::from_secs(600);
/// A whole copy's data file is sealed (its manifest written) right after it is linked into
/// place: one without a manifest for longer is a crashed assembly's.
const ORPHAN_AGE: Duration = Duration::from_secs(if cfg!(test) { 1 } else { 60 });
/// Subdirectory of the cache directory: a new file format gets a new one.
/// Reads of the cache's disk at once (see [`DataCache::read_disk`]): what a hung disk
/// holds at most, each with the buffer it fills.
const DISK_READS: usize = 8;
/// How long a read of the cache's disk is waited for before the bucket is asked instead,
/// plus the time its bytes take at [`DISK_READ_SLOWEST`].
const DISK_READ_WAIT: Duration = Duration::from_secs(if cfg!(test) { 1 } else { 5 });
/// The slowest a cache disk reads and still counts as working, in bytes per second: the
/// check of a 10 GB whole copy after a reboot is waited for 205 s.
const DISK_READ_SLOWEST: u64 = 50 << 20;
const VERSION_DIR: &str = "bucketfs-v1";
const MAGIC: &[u8; 8] = b"BFSBLK2\n";
/// magic, three string lengths, index, data length, data CRC, object size.
const FIXED: usize = 8 + 3 * 4 + 8 + 8 + 4 + 8;
const MAN_MAGIC: &[u8; 8] = b"BFSOBJ1\n";
/// The block index a whole object's name is hashed with (no block has it).
const WHOLE: u64 = u64::MAX;
/// The block index of a directory's saved listing page (key: the directory's key, ETag
/// empty): a block file like any other (`NAME.lst`), evicted with them.
const LISTING: u64 = u64::MAX - 1;
const LST: &str = "lst";
/// The `BlockId` index naming the record of when mounts of a scope last changed something.
const CHANGED: u64 = u64::MAX - 2;
/// Extensions of a whole object's data file and manifest.
const OBJ: &str = "obj";
const MAN: &str = "man";

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
/// to it (they could plant blocks that pass the checks), or to a directory above it. Returns
/// it with no link in it, the path the cache is to use.
pub fn prepare_dir(dir: &Path) -> Result<PathBuf, String> {
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
    // Every directory on the way is this user's or root's, and not open to every user for
    // renames (or sticky, like /tmp): else another user could swap one for a link, and this
    // daemon (often root) would write and delete files where it points. Group-writable ones
    // are left to the group.
    let real = dir
        .canonicalize()
        .map_err(|e| format!("data cache {show}: {e}"))?;
    for above in real.ancestors().skip(1) {
        let md = std::fs::metadata(above).map_err(|e| format!("data cache {show}: {e}"))?;
        let mode = md.permissions().mode();
        if (md.uid() != me && md.uid() != 0) || (mode & 0o002 != 0 && mode & 0o1000 == 0) {
            return Err(format!(
                "data cache {show}: {} above it belongs to user {} with mode {:o}: give a \
                 directory that only this user or root can change the way to",
                above.display(),
                md.uid(),
                mode & 0o7777
            ));
        }
    }
    Ok(real)
}

/// A fresh temporary file next to `path` (a sibling named `.tmp-RANDOM-NAME`), created
/// exclusively without following links: two writers (two mounts, or two containers whose
/// daemons have the same PID) never share one, and nothing planted under the name is written.
fn create_tmp(path: &Path) -> std::io::Result<(File, PathBuf)> {
    use std::hash::{BuildHasher, Hasher};
    use std::os::unix::fs::OpenOptionsExt;
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
    let name = name.unwrap_or_default();
    let mut made_dir = false;
    loop {
        let r = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish();
        let tmp = path.with_file_name(format!(".tmp-{r:016x}-{name}"));
        let f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp);
        match f {
            Ok(f) => return Ok((f, tmp)),
            Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
            Err(e) if e.kind() == ErrorKind::NotFound && !made_dir => {
                made_dir = true;
                private_dirs(path.parent().expect("a cache file has a parent"))?;
            }
            Err(e) => return Err(e),
        }
    }
}

/// Makes directory `dir` and those above it that are missing, 0700 whatever the umask:
/// others could list what was read, and when, or with umask 0 move the files.
fn private_dirs(dir: &Path) -> std::io::Result<()> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

/// Lock file `path` (made if need be, never through a link), held exclusively (`flock`)
/// until the file returned is dropped: one process at a time, of all that share the cache.
fn lock_exclusive(path: &Path) -> std::io::Result<File> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let open = || {
        std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path)
    };
    let f = match open() {
        // The cache's directory is made by its writer, which may not have run yet.
        Err(e) if e.kind() == ErrorKind::NotFound => {
            private_dirs(path.parent().expect("a cache file has a parent"))?;
            open()?
        }
        r => r?,
    };
    // SAFETY: flock(2) of a descriptor this function owns.
    while unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() != ErrorKind::Interrupted {
            return Err(e);
        }
    }
    Ok(f)
}

/// Opens a cache file for reading, refusing a link and anything but a regular file of this
/// user (what is handed to the kernel must be the cache's own file).
fn open_own(path: &Path) -> std::io::Result<File> {
    open_own_md(path).map(|(f, _)| f)
}

/// [`open_own`], with the file's metadata.
fn open_own_md(path: &Path) -> std::io::Result<(File, std::fs::Metadata)> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?;
    let md = f.metadata()?;
    // SAFETY: geteuid cannot fail.
    if !md.is_file() || md.uid() != unsafe { libc::geteuid() } {
        return Err(std::io::Error::other("not a regular file of this user"));
    }
    Ok((f, md))
}

/// What one block file is about.
struct BlockId<'a> {
    scope: &'a str,
    key: &'a str,
    etag: &'a str,
    /// The object's size (0 for what is no object's block): a store whose ETags do not
    /// change with the content (a gateway's fixed or weak ones) still never has the blocks
    /// of a version of another size served.
    size: u64,
    index: u64,
}

impl BlockId<'_> {
    /// 128 bits of FNV-1a (two 64-bit lanes): a stable file name. A collision is harmless
    /// (the header does not match: a miss).
    fn name(&self) -> u128 {
        let mut a: u64 = 0xcbf2_9ce4_8422_2325;
        let mut b: u64 = 0x6c62_272e_07bb_0142;
        let idx = self.index.to_le_bytes();
        let size = self.size.to_le_bytes();
        let parts: [&[u8]; 8] = [
            self.scope.as_bytes(),
            b"\0",
            self.key.as_bytes(),
            b"\0",
            self.etag.as_bytes(),
            b"\0",
            &idx,
            &size,
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
        h.extend_from_slice(&self.size.to_le_bytes());
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
    /// Names that are whole objects (data file and manifest), not blocks.
    wholes: HashSet<u128>,
    /// Names that are saved listing pages (`NAME.lst`), not blocks.
    listings: HashSet<u128>,
    /// Whole objects whose manifest this mount has read or written in this boot: what an
    /// open checks instead of reading the manifest again.
    seals: HashMap<u128, Seal>,
    /// Whole objects used since their last use was last written to their manifest.
    used: HashSet<u128>,
    /// Whole objects whose manifest was read and gave no seal (another boot's, damaged):
    /// not read again by a rescan (an open reads it, and checks the copy).
    unsealed: HashSet<u128>,
}

/// The disk space a cache file of `len` bytes takes: whole file-system blocks (4 KiB on
/// every common one), at least one. What the limit counts: a cache of tiny objects counted
/// by their length used many times its limit on disk (and an inode each).
fn on_disk(len: u64) -> u64 {
    len.div_ceil(4096).max(1) * 4096
}

impl Index {
    /// Indexes file `name` of `size` bytes on disk (see [`on_disk`]; a whole object's two
    /// files, each counted so).
    fn insert(&mut self, name: u128, size: u64, used: u64) {
        let size = on_disk(size);
        self.remove(name);
        self.files.insert(name, (size, used));
        self.lru.insert((used, name));
        self.bytes += size;
    }

    fn remove(&mut self, name: u128) -> Option<u64> {
        self.wholes.remove(&name);
        self.listings.remove(&name);
        self.seals.remove(&name);
        self.used.remove(&name);
        self.unsealed.remove(&name);
        let (size, used) = self.files.remove(&name)?;
        self.lru.remove(&(used, name));
        self.bytes -= size;
        Some(size)
    }

    fn touch(&mut self, name: u128, size: u64, now: u64) {
        let whole = self.wholes.contains(&name);
        let listing = self.listings.contains(&name);
        let seal = self.seals.get(&name).copied();
        self.insert(name, size, now);
        if whole {
            self.wholes.insert(name);
        }
        if listing {
            self.listings.insert(name);
        }
        if let Some(seal) = seal {
            self.seals.insert(name, seal);
        }
    }

    /// A whole object in use: like [`Index::touch`], and marked whole.
    fn touch_whole(&mut self, name: u128, size: u64, now: u64) {
        self.touch(name, size, now);
        self.wholes.insert(name);
    }

    fn insert_listing(&mut self, name: u128, size: u64, used: u64) {
        self.insert(name, size, used);
        self.listings.insert(name);
    }

    fn insert_whole(&mut self, name: u128, size: u64, used: u64) {
        self.insert(name, size, used);
        self.wholes.insert(name);
    }
}

/// What a whole object's manifest says its data file is, kept in memory once read (or
/// written) in this boot, so that an open checks the data file alone: one file opened instead
/// of two, which is most of a cold open's disk time.
#[derive(Clone, Copy, PartialEq, Debug)]
struct Seal {
    /// [`DataCache::ident`] of the manifest's (scope, key, ETag): a copy is handed over only
    /// for the object it holds, never for another one whose name collides with it.
    ident: u64,
    size: u64,
    dev: u64,
    ino: u64,
    ctime: (i64, i64),
    /// The CRC-32 of an object of one block: daemon reads of it need no manifest either.
    crc: Option<u32>,
}

impl Seal {
    fn matches(&self, md: &std::fs::Metadata) -> bool {
        (md.len(), md.dev(), md.ino(), (md.ctime(), md.ctime_nsec()))
            == (self.size, self.dev, self.ino, self.ctime)
    }
}

/// A whole object's manifest: what its data file must be.
struct Manifest {
    size: u64,
    /// The seal: device, inode and ctime (s, ns) of the data file once in place.
    dev: u64,
    ino: u64,
    ctime: (i64, i64),
    /// `/proc/sys/kernel/random/boot_id` when it was sealed.
    boot: String,
    crcs: Vec<u32>,
}

impl Manifest {
    fn sealed(md: &std::fs::Metadata, boot: &str, crcs: Vec<u32>) -> Self {
        Manifest {
            size: md.len(),
            dev: md.dev(),
            ino: md.ino(),
            ctime: (md.ctime(), md.ctime_nsec()),
            boot: boot.to_string(),
            crcs,
        }
    }

    fn seal_matches(&self, md: &std::fs::Metadata) -> bool {
        (md.len(), md.ino(), (md.ctime(), md.ctime_nsec())) == (self.size, self.ino, self.ctime)
    }

    fn encode(&self, id: &BlockId<'_>) -> Vec<u8> {
        let mut h = Vec::with_capacity(64 + id.strings_len() + 4 * self.crcs.len());
        h.extend_from_slice(MAN_MAGIC);
        for s in [id.scope, id.key, id.etag, &self.boot] {
            h.extend_from_slice(&(s.len() as u32).to_le_bytes());
            h.extend_from_slice(s.as_bytes());
        }
        for v in [self.size, self.dev, self.ino] {
            h.extend_from_slice(&v.to_le_bytes());
        }
        h.extend_from_slice(&self.ctime.0.to_le_bytes());
        h.extend_from_slice(&self.ctime.1.to_le_bytes());
        h.extend_from_slice(&(self.crcs.len() as u64).to_le_bytes());
        for c in &self.crcs {
            h.extend_from_slice(&c.to_le_bytes());
        }
        let crc = crc32fast::hash(&h);
        h.extend_from_slice(&crc.to_le_bytes());
        h
    }

    /// The manifest in `b` if it is sound and `id`'s (another object's under a colliding
    /// name is `Absent`).
    fn decode(id: &BlockId<'_>, b: &[u8]) -> Result<Manifest, Miss> {
        let (strings, m) = Self::decode_any(b)?;
        if strings[0] != id.scope.as_bytes()
            || strings[1] != id.key.as_bytes()
            || strings[2] != id.etag.as_bytes()
        {
            return Err(Miss::Absent);
        }
        Ok(m)
    }

    /// The manifest in `b` if it is sound, with the scope, key and ETag it is of.
    fn decode_any(b: &[u8]) -> Result<([Vec<u8>; 3], Manifest), Miss> {
        const BAD: Miss = Miss::Corrupt("corrupt (manifest checksum)");
        if b.len() < MAN_MAGIC.len() + 4 || b[..8] != MAN_MAGIC[..] {
            return Err(BAD);
        }
        let (body, crc) = b.split_at(b.len() - 4);
        if crc32fast::hash(body).to_le_bytes() != crc {
            return Err(BAD);
        }
        let mut at = 8;
        let mut take = |n: usize| -> Result<&[u8], Miss> {
            let s = body.get(at..at + n).ok_or(BAD)?;
            at += n;
            Ok(s)
        };
        let u32_of = |s: &[u8]| u32::from_le_bytes(s.try_into().expect("4 bytes"));
        let u64_of = |s: &[u8]| u64::from_le_bytes(s.try_into().expect("8 bytes"));
        let mut strings: [Vec<u8>; 4] = Default::default();
        for s in &mut strings {
            let n = u32_of(take(4)?) as usize;
            *s = take(n)?.to_vec();
        }
        let size = u64_of(take(8)?);
        let dev = u64_of(take(8)?);
        let ino = u64_of(take(8)?);
        let ctime = (u64_of(take(8)?) as i64, u64_of(take(8)?) as i64);
        let n = u64_of(take(8)?);
        if n != size.div_ceil(BLOCK) {
            return Err(BAD);
        }
        let mut crcs = Vec::with_capacity(n as usize);
        for _ in 0..n {
            crcs.push(u32_of(take(4)?));
        }
        let [scope, key, etag, boot] = strings;
        let m = Manifest {
            size,
            dev,
            ino,
            ctime,
            boot: String::from_utf8_lossy(&boot).into_owned(),
            crcs,
        };
        Ok(([scope, key, etag], m))
    }

    fn seal(&self, ident: u64) -> Seal {
        Seal {
            ident,
            size: self.size,
            dev: self.dev,
            ino: self.ino,
            ctime: self.ctime,
            crc: match self.crcs[..] {
                [crc] => Some(crc),
                _ => None,
            },
        }
    }
}

struct Job {
    key: String,
    etag: String,
    /// The object's size.
    size: u64,
    index: u64,
    data: Bytes,
}

pub struct DataCache {
    /// Held by a test: the writer waits before each block (a slow cache disk).
    #[cfg(test)]
    pub(crate) writer_held: Mutex<()>,
    /// Serializes the writes of [`DataCache::changing_until`].
    changed_lock: Mutex<()>,
    root: PathBuf,
    scope: String,
    max_bytes: u64,
    index: Mutex<Index>,
    queue: SyncSender<Job>,
    metrics: Arc<FsMetrics>,
    /// An I/O error of the cache disk was logged (once per mount).
    warned: AtomicBool,
    /// Assemble whole objects (for FUSE passthrough).
    whole_files: AtomicBool,
    /// This boot's id: a whole object sealed in another boot is checked in full once.
    boot: String,
    /// The key of [`DataCache::ident`], this process's own.
    ident_key: std::collections::hash_map::RandomState,
    /// A thread is reading manifests for their seals ([`DataCache::read_seals`]).
    reading_seals: AtomicBool,
    /// One permit per read of the disk in flight ([`DISK_READS`]).
    disk_reads: Arc<tokio::sync::Semaphore>,
    /// Reads of the disk past [`DISK_READ_WAIT`] that have not ended: while there is one,
    /// the disk is not read.
    disk_stuck: Arc<std::sync::atomic::AtomicUsize>,
    /// A read waited past [`DISK_READ_WAIT`] was logged (once per mount).
    warned_slow: AtomicBool,
}

impl std::fmt::Debug for DataCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataCache")
            .field("root", &self.root)
            .field("max_bytes", &self.max_bytes)
            .finish()
    }
}

/// Writes now as the last use of a cache file, unless the one it holds is recent: the order
/// among uses a minute apart is all eviction needs, and a job opening many small files would
/// otherwise dirty an inode (a journal write) per open.
fn touch(f: &File) {
    let now = SystemTime::now();
    let recent = f
        .metadata()
        .and_then(|m| m.modified())
        .is_ok_and(|t| now.duration_since(t).is_ok_and(|age| age < TOUCH_EVERY));
    if !recent {
        let _ = f.set_modified(now);
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
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map(|s| s.trim().to_string())
            .unwrap_or_default();
        Self::start_in_boot(cfg, queue, metrics, boot)
    }

    /// [`DataCache::start`] in the boot named `boot` (empty: unknown).
    fn start_in_boot(
        cfg: &DataCacheConfig,
        queue: usize,
        metrics: Arc<FsMetrics>,
        boot: String,
    ) -> Arc<DataCache> {
        let (tx, rx) = sync_channel(queue);
        metrics
            .data_cache_limit_bytes
            .store(cfg.max_bytes, Ordering::Relaxed);
        let cache = Arc::new(DataCache {
            changed_lock: Mutex::new(()),
            root: cfg.dir.join(VERSION_DIR),
            scope: cfg.scope.clone(),
            max_bytes: cfg.max_bytes,
            index: Mutex::default(),
            queue: tx,
            metrics,
            warned: AtomicBool::new(false),
            whole_files: AtomicBool::new(false),
            boot,
            ident_key: Default::default(),
            reading_seals: AtomicBool::new(false),
            disk_reads: Arc::new(tokio::sync::Semaphore::new(DISK_READS)),
            disk_stuck: Arc::default(),
            warned_slow: AtomicBool::new(false),
            #[cfg(test)]
            writer_held: Mutex::new(()),
        });
        let weak = Arc::downgrade(&cache);
        std::thread::Builder::new()
            .name("data-cache".into())
            .spawn(move || writer(weak, rx))
            .expect("spawn the data cache writer");
        cache
    }

    /// Block `index` of `key` version `etag`, `size` bytes.
    fn id<'a>(&'a self, key: &'a str, etag: &'a str, size: u64, index: u64) -> BlockId<'a> {
        BlockId {
            scope: &self.scope,
            key,
            etag,
            size,
            index,
        }
    }

    /// A hash of `id`'s scope, key and ETag under a key of this process: unlike file names,
    /// nobody can make two objects collide in it.
    fn ident(&self, id: &BlockId<'_>) -> u64 {
        use std::hash::BuildHasher;
        self.ident_key
            .hash_one((id.scope, id.key, id.etag, id.size))
    }

    /// Keeps `m`, the manifest of whole object `id` (indexed as `name`), as its seal in
    /// `ix`, if it was sealed in this boot.
    fn keep_seal(&self, ix: &mut Index, name: u128, id: &BlockId<'_>, m: &Manifest) {
        if !self.boot.is_empty() && m.boot == self.boot && ix.files.contains_key(&name) {
            ix.seals.insert(name, m.seal(self.ident(id)));
            ix.unsealed.remove(&name);
        }
    }

    /// The whole copy of `id` (indexed as `name`, `size` bytes), opened and checked against
    /// the seal this mount keeps for it: no manifest read. `None`: no seal kept, or the data
    /// file no longer matches it (its manifest then decides).
    fn open_sealed(&self, id: &BlockId<'_>, name: u128, size: u64) -> Option<(File, Seal)> {
        let seal = self.index.lock().seals.get(&name).copied()?;
        if seal.ident != self.ident(id) || seal.size != size {
            return None;
        }
        let (f, md) = open_own_md(&self.whole_path(name, OBJ)).ok()?;
        if !seal.matches(&md) {
            return None;
        }
        let mut ix = self.index.lock();
        let &(bytes, _) = ix.files.get(&name)?;
        ix.touch(name, bytes, now_tick());
        // Written to its manifest later, off the open's path (see `persist_uses`).
        ix.used.insert(name);
        Some((f, seal))
    }

    /// Writes the last use of the whole objects opened through their seal to their
    /// manifests, for the next start's eviction order.
    fn persist_uses(&self) {
        let used = std::mem::take(&mut self.index.lock().used);
        for name in used {
            if let Ok(f) = open_own(&self.whole_path(name, MAN)) {
                touch(&f);
            }
        }
    }

    fn path(&self, name: u128) -> PathBuf {
        let hex = format!("{name:032x}");
        self.root.join(&hex[..2]).join(hex)
    }

    /// The data file (`OBJ`) or manifest (`MAN`) of a whole object.
    fn whole_path(&self, name: u128, ext: &str) -> PathBuf {
        self.path(name).with_extension(ext)
    }

    /// From now on, objects whose blocks are all cached are assembled into whole files (for
    /// [`DataCache::local_copy`]).
    pub fn set_whole_files(&self, on: bool) {
        self.whole_files.store(on, Ordering::Relaxed);
    }

    /// The whole copy of object `key` version `etag` (`size` bytes) with its manifest, the
    /// seal checked.
    fn open_whole(&self, id: &BlockId<'_>, size: u64) -> Result<(File, Manifest, u64), Miss> {
        let name = id.name();
        let mut mf = match open_own(&self.whole_path(name, MAN)) {
            Ok(f) => f,
            Err(e) if e.kind() == ErrorKind::NotFound => return Err(Miss::Absent),
            Err(e) if not_own(&e) => return Err(Miss::Corrupt("not a file of its own")),
            Err(e) => return Err(Miss::Io(e)),
        };
        let mut man = Vec::new();
        mf.read_to_end(&mut man).map_err(Miss::Io)?;
        let m = Manifest::decode(id, &man)?;
        if m.size != size {
            return Err(Miss::Corrupt("of the wrong size"));
        }
        let f = match open_own(&self.whole_path(name, OBJ)) {
            Ok(f) => f,
            Err(e) if e.kind() == ErrorKind::NotFound => {
                return Err(Miss::Corrupt("missing its data file"))
            }
            Err(e) if not_own(&e) => return Err(Miss::Corrupt("not a file of its own")),
            Err(e) => return Err(Miss::Io(e)),
        };
        let md = f.metadata().map_err(Miss::Io)?;
        if !m.seal_matches(&md) {
            return Err(Miss::Corrupt("changed since it was written"));
        }
        let mut m = m;
        if m.dev != md.dev() {
            // The same file under another device number (a renumbered disk, a re-attached
            // volume, btrfs after a reboot): checked in full before use, like a copy of
            // another boot, then sealed with this number.
            m.boot.clear();
            m.dev = md.dev();
        }
        // Its last use, on the manifest (the data file's own times are part of the seal).
        touch(&mf);
        let bytes = on_disk(md.len()) + on_disk(man.len() as u64);
        self.index.lock().touch_whole(name, bytes, now_tick());
        Ok((f, m, bytes))
    }

    /// Deals with a whole object that could not be used: a damaged one is removed.
    fn whole_miss(&self, name: u128, key: &str, miss: Miss) {
        match miss {
            Miss::Absent => {}
            Miss::Io(e) => self.io_error("read", &e),
            Miss::Corrupt(why) => {
                inc(&self.metrics.data_cache_corrupt);
                tracing::warn!(
                    "data cache file {} ({key}) is {why}: removed, fetching it again",
                    self.whole_path(name, OBJ).display()
                );
                self.remove_whole(name);
                self.index.lock().remove(name);
                self.update_size();
            }
        }
    }

    /// Unlinks a whole object, manifest first: a data file without one is never used.
    fn remove_whole(&self, name: u128) -> bool {
        let mut gone = false;
        for ext in [MAN, OBJ] {
            match std::fs::remove_file(self.whole_path(name, ext)) {
                Ok(()) => gone = true,
                Err(e) if e.kind() == ErrorKind::NotFound => {}
                Err(e) => self.io_error("evict", &e),
            }
        }
        gone
    }

    /// A local file holding exactly the bytes of object `key` version `etag` (`size` bytes),
    /// if the cache has it whole and it checks out: for the kernel to read from directly.
    /// Blocking (file I/O).
    pub fn local_copy(&self, key: &str, etag: &str, size: u64) -> Option<File> {
        let id = self.id(key, etag, size, WHOLE);
        let name = id.name();
        if let Some((f, _)) = self.open_sealed(&id, name, size) {
            return Some(f);
        }
        match self.open_whole(&id, size) {
            // Without the boot's id a crash cannot be told apart: always checked in full.
            Ok((f, m, _)) if !self.boot.is_empty() && m.boot == self.boot => {
                self.keep_seal(&mut self.index.lock(), name, &id, &m);
                Some(f)
            }
            Ok((f, m, _)) => {
                // Sealed before the machine last started: a crash may have lost bytes the
                // page cache held then. Checked in full once, then sealed for this boot.
                let mut buf = vec![0u8; BLOCK as usize];
                for (i, crc) in m.crcs.iter().enumerate() {
                    let b = block_range(i as u64, size);
                    let dst = &mut buf[..(b.end - b.start) as usize];
                    match f.read_exact_at(dst, b.start) {
                        Ok(()) if crc32fast::hash(dst) == *crc => {}
                        Ok(()) => {
                            self.whole_miss(name, key, Miss::Corrupt("corrupt (data checksum)"));
                            return None;
                        }
                        Err(e) => {
                            self.whole_miss(name, key, Miss::Io(e));
                            return None;
                        }
                    }
                }
                let m = Manifest {
                    boot: self.boot.clone(),
                    ..m
                };
                match self.write_manifest(&id, &m) {
                    Ok(_) => self.keep_seal(&mut self.index.lock(), name, &id, &m),
                    Err(e) => self.io_error("write", &e),
                }
                Some(f)
            }
            Err(Miss::Absent) => {
                // Blocks cached before whole copies were made (a mount without passthrough,
                // or one whose writer was behind when the last block came): assembled now,
                // in the background, for the next open.
                if self.whole_files.load(Ordering::Relaxed) {
                    let job = Job {
                        key: key.to_string(),
                        etag: etag.to_string(),
                        size,
                        index: WHOLE,
                        data: Bytes::new(),
                    };
                    if self.all_blocks(&job) {
                        self.send(job);
                    }
                }
                None
            }
            Err(miss) => {
                self.whole_miss(name, key, miss);
                None
            }
        }
    }

    /// Blocks of `range` (those [`blocks_within`] it) from the whole object, each checked
    /// against its CRC; `None` when there is none.
    fn read_whole(
        &self,
        key: &str,
        etag: &str,
        size: u64,
        range: &Range<u64>,
        out: &mut [u8],
    ) -> Option<Vec<bool>> {
        let id = self.id(key, etag, size, WHOLE);
        let name = id.name();
        // Only a copy of one block: the CRCs of a larger one are in its manifest alone.
        let one_block = self.index.lock().seals.get(&name).and_then(|s| s.crc);
        let sealed =
            one_block.and_then(|crc| Some((self.open_sealed(&id, name, size)?.0, vec![crc])));
        let whole = || self.open_whole(&id, size).map(|(f, m, _)| (f, m.crcs));
        let (f, crcs) = match sealed.map_or_else(whole, Ok) {
            Ok(w) => w,
            Err(miss) => {
                self.whole_miss(name, key, miss);
                return None;
            }
        };
        let mut sound = true;
        let hits = blocks_within(range, size)
            .map(|i| {
                let b = block_range(i, size);
                let dst =
                    &mut out[(b.start - range.start) as usize..(b.end - range.start) as usize];
                if sound {
                    match f.read_exact_at(dst, b.start) {
                        Ok(()) if crc32fast::hash(dst) == crcs[i as usize] => {}
                        Ok(()) => {
                            sound = false;
                            self.whole_miss(name, key, Miss::Corrupt("corrupt (data checksum)"));
                        }
                        Err(e) => {
                            sound = false;
                            self.whole_miss(name, key, Miss::Io(e));
                        }
                    }
                }
                if sound {
                    inc(&self.metrics.data_cache_hits);
                    inc_by(&self.metrics.data_cache_bytes_served, dst.len() as u64);
                } else {
                    inc(&self.metrics.data_cache_misses);
                }
                sound
            })
            .collect();
        Some(hits)
    }

    /// Writes `m` as the manifest of `id` (temporary file and rename).
    fn write_manifest(&self, id: &BlockId<'_>, m: &Manifest) -> std::io::Result<u64> {
        let name = id.name();
        let path = self.whole_path(name, MAN);
        let bytes = m.encode(id);
        let (mut f, tmp) = create_tmp(&path)?;
        let r = f
            .write_all(&bytes)
            .and_then(|()| std::fs::rename(&tmp, &path));
        if r.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        r.map(|()| bytes.len() as u64)
    }

    /// Where the manifest of the whole copy of `key` version `etag` is (the first file a
    /// read of the object opens).
    #[cfg(test)]
    pub(crate) fn whole_manifest(&self, key: &str, etag: &str, size: u64) -> PathBuf {
        self.whole_path(self.id(key, etag, size, WHOLE).name(), MAN)
    }

    /// Runs read `f` of the cache's disk, of `bytes` at most, in the blocking pool,
    /// [`DISK_READS`] at most at once, and waits for it (its place included)
    /// [`DISK_READ_WAIT`] plus the time of `bytes` at [`DISK_READ_SLOWEST`] at most: `None`
    /// when the disk is that slow, and at once while a read that slow has not ended (the
    /// caller asks the bucket). A read that did not answer holds its thread and its place
    /// until the disk does, so a hung disk holds [`DISK_READS`] threads and buffers, and
    /// neither the blocking pool the staging files and the write-back directory use nor the
    /// reads of the mount.
    pub async fn read_disk<T: Send + 'static>(
        self: &Arc<Self>,
        bytes: u64,
        f: impl FnOnce(&DataCache) -> T + Send + 'static,
    ) -> Option<T> {
        use std::sync::atomic::AtomicUsize;
        if self.disk_stuck.load(Ordering::Relaxed) > 0 {
            inc(&self.metrics.data_cache_errors);
            return None;
        }
        let wait = DISK_READ_WAIT + Duration::from_secs(bytes / DISK_READ_SLOWEST);
        let deadline = tokio::time::Instant::now() + wait;
        let place = self.disk_reads.clone().acquire_owned();
        let Ok(Ok(place)) = tokio::time::timeout_at(deadline, place).await else {
            self.disk_slow();
            return None;
        };
        let cache = self.clone();
        let mut read = tokio::task::spawn_blocking(move || {
            let _place = place;
            f(&cache)
        });
        match tokio::time::timeout_at(deadline, &mut read).await {
            Ok(r) => r.ok(),
            Err(_) => {
                /// Counts a read as stuck until it ends.
                struct Stuck(Arc<AtomicUsize>);
                impl Drop for Stuck {
                    fn drop(&mut self) {
                        self.0.fetch_sub(1, Ordering::Relaxed);
                    }
                }
                self.disk_stuck.fetch_add(1, Ordering::Relaxed);
                let stuck = Stuck(self.disk_stuck.clone());
                tokio::spawn(async move {
                    let _ = read.await;
                    drop(stuck);
                });
                self.disk_slow();
                None
            }
        }
    }

    /// A read of the disk did not answer within [`DISK_READ_WAIT`].
    fn disk_slow(&self) {
        inc(&self.metrics.data_cache_errors);
        if !self.warned_slow.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                "data cache {}: a read did not answer within {} s (is the disk hung?); \
                 reading from the bucket instead (logged once)",
                self.root.display(),
                DISK_READ_WAIT.as_secs()
            );
        }
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
        if let Some(hits) = self.read_whole(key, etag, size, &range, out) {
            return hits;
        }
        blocks_within(&range, size)
            .map(|i| {
                let b = block_range(i, size);
                let dst =
                    &mut out[(b.start - range.start) as usize..(b.end - range.start) as usize];
                let id = self.id(key, etag, size, i);
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
                            Miss::Corrupt(why) => self.drop_corrupt(&id, key, i, why),
                        }
                        false
                    }
                }
            })
            .collect()
    }

    /// Removes block `i` of `key` (`id`), found `why` damaged, from the disk and the index.
    fn drop_corrupt(&self, id: &BlockId<'_>, key: &str, i: u64, why: &str) {
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

    /// Reads and checks one block file into `dst` (its expected length).
    fn read_one(&self, id: &BlockId<'_>, dst: &mut [u8]) -> Result<(), Miss> {
        self.read_file(&self.path(id.name()), id, dst)
    }

    /// Reads and checks the block file at `path` (block `id`) into `dst` (its expected length).
    fn read_file(&self, path: &Path, id: &BlockId<'_>, dst: &mut [u8]) -> Result<(), Miss> {
        let name = id.name();
        let mut f = match open_own(path) {
            Ok(f) => f,
            Err(e) if e.kind() == ErrorKind::NotFound => {
                // Evicted by another mount sharing the directory (or removed by hand): no
                // longer indexed, so the block fetched instead is written again.
                if self.index.lock().remove(name).is_some() {
                    self.update_size();
                }
                return Err(Miss::Absent);
            }
            Err(e) if not_own(&e) => return Err(Miss::Corrupt("not a file of its own")),
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
        touch(&f);
        let size = file_len;
        self.index.lock().touch(name, size, now_tick());
        Ok(())
    }

    /// Waits, at most `limit`, until the writer has written every block queued so far, so
    /// that what a mount read just before its unmount is cached for the next one. False
    /// when the limit passed first (a slow or hung cache disk).
    pub async fn settle(&self, limit: Duration) -> bool {
        let start = std::time::Instant::now();
        while self.metrics.data_cache_queued.load(Ordering::Relaxed) > 0 {
            if start.elapsed() >= limit {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        true
    }

    /// Hands block `index` of `key` version `etag` (`size` bytes) to the writer, unless its
    /// queue is full.
    pub fn put(&self, key: &str, etag: &str, size: u64, index: u64, data: Bytes) {
        self.send(Job {
            key: key.to_string(),
            etag: etag.to_string(),
            size,
            index,
            data,
        });
    }

    /// A block not handed to the writer (no memory for it).
    pub fn skipped(&self) {
        inc(&self.metrics.data_cache_skipped);
    }

    fn send(&self, job: Job) {
        // Counted before the send: the writer may be done with it before `try_send` returns.
        self.metrics
            .data_cache_queued
            .fetch_add(1, Ordering::Relaxed);
        match self.queue.try_send(job) {
            Ok(()) => return,
            Err(TrySendError::Full(_)) => inc(&self.metrics.data_cache_skipped),
            Err(TrySendError::Disconnected(_)) => {}
        }
        self.metrics
            .data_cache_queued
            .fetch_sub(1, Ordering::Relaxed);
    }

    fn update_size(&self) {
        let b = self.index.lock().bytes;
        self.metrics.data_cache_bytes.store(b, Ordering::Relaxed);
    }

    /// Writes one block: evicts to make room, then temp file and rename. With whole files
    /// on, an object of one block is written whole, and the last missing block of a larger
    /// one has it assembled.
    fn write(&self, job: &Job) {
        let whole = self.id(&job.key, &job.etag, job.size, WHOLE).name();
        if self.index.lock().files.contains_key(&whole) {
            return;
        }
        let whole_files = self.whole_files.load(Ordering::Relaxed);
        if job.index == WHOLE {
            // An open found every block and no whole copy (see `local_copy`).
            if whole_files && self.all_blocks(job) {
                self.assemble(job);
            }
            return;
        }
        if whole_files && job.size <= BLOCK {
            return self.assemble(job);
        }
        if !self.write_block(job, false) {
            return;
        }
        if whole_files && self.all_blocks(job) {
            self.assemble(job);
        }
    }

    /// Writes the block file of `job`; `replace`: over the one of the same name, if any.
    /// Whether it was written.
    fn write_block(&self, job: &Job, replace: bool) -> bool {
        let id = self.id(&job.key, &job.etag, job.size, job.index);
        let name = id.name();
        if !replace && self.index.lock().files.contains_key(&name) {
            return false;
        }
        let header = id.header(job.data.len() as u64, crc32fast::hash(&job.data));
        let size = (header.len() + job.data.len()) as u64;
        if on_disk(size) > self.max_bytes {
            return false;
        }
        self.evict_keeping(self.max_bytes - on_disk(size), &[name]);
        let listing = job.index == LISTING;
        let path = match listing {
            true => self.whole_path(name, LST),
            false => self.path(name),
        };
        let mut tmp = None;
        let written = (|| {
            let (mut f, t) = create_tmp(&path)?;
            let tmp = tmp.insert(t);
            f.write_all(&header)?;
            f.write_all(&job.data)?;
            std::fs::rename(&*tmp, &path)
        })();
        match written {
            Ok(()) => {
                let mut ix = self.index.lock();
                match listing {
                    true => ix.insert_listing(name, size, now_tick()),
                    false => ix.insert(name, size, now_tick()),
                }
                drop(ix);
                self.update_size();
                true
            }
            Err(e) => {
                if let Some(tmp) = tmp {
                    let _ = std::fs::remove_file(tmp);
                }
                self.io_error("write", &e);
                false
            }
        }
    }

    /// Saves `blob` as the listing page of directory `dir_key` (over the last one). Blocking
    /// (file I/O): not through the writer's queue, where blocks would crowd it out.
    pub fn put_listing(&self, dir_key: &str, blob: Vec<u8>) {
        self.write_block(
            &Job {
                key: dir_key.to_string(),
                etag: String::new(),
                // No object's: found by the directory's key alone.
                size: 0,
                index: LISTING,
                data: Bytes::from(blob),
            },
            true,
        );
    }

    /// Where the record of the last change made by a mount of this scope is: in the root,
    /// which the rescan does not read (it is no block).
    fn changed_path(&self) -> PathBuf {
        let name = self.id("", "", 0, CHANGED).name();
        self.root.join(format!("changed-{name:032x}"))
    }

    /// A mount of this scope changes something in the store, until `until` at the latest:
    /// the listing pages saved before then may predate it. Blocking (file I/O).
    /// Writes are one at a time (they run in the background, and may finish out of order),
    /// never move the time back, and replace the record whole (a temporary file renamed).
    pub fn changing_until(&self, until: SystemTime) {
        let _one = self.changed_lock.lock();
        let path = self.changed_path();
        // Mounts sharing the cache compare and write one at a time too.
        let _theirs = match lock_exclusive(&path.with_extension("lock")) {
            Ok(l) => l,
            Err(e) => return self.unrecorded(&path, "lock", &e),
        };
        if self.changed_until().is_some_and(|t| t >= until) {
            return;
        }
        let nanos = until
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let r = create_tmp(&path).and_then(|(mut f, tmp)| {
            let r = f
                .write_all(&nanos.to_le_bytes())
                .and_then(|()| std::fs::rename(&tmp, &path));
            if r.is_err() {
                let _ = std::fs::remove_file(&tmp);
            }
            r
        });
        if let Err(e) = r {
            self.unrecorded(&path, "write", &e);
        }
    }

    /// A change could not be recorded at `path`: the record is cut to nothing (no free
    /// space needed), which reads as "now" (see [`Self::changed_until`]), so no page saved
    /// before is used; the older record would have let a mount sharing the cache take a
    /// page from before this change for the directory as it is.
    fn unrecorded(&self, path: &Path, what: &str, e: &std::io::Error) {
        use std::os::unix::fs::OpenOptionsExt;
        self.io_error(what, e);
        let cut = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path);
        if let Err(e) = cut {
            tracing::warn!(
                "data cache: the record of changes {} cannot be written nor cut ({e}): listing \
                 pages saved in the cache may be used after a change",
                path.display()
            );
        }
    }

    /// Until when a mount of this scope last said it changes something (see
    /// [`Self::changing_until`]), if one ever did; a record that cannot be read counts as
    /// now (no page saved so far is used). Blocking (file I/O).
    pub fn changed_until(&self) -> Option<SystemTime> {
        match std::fs::read(self.changed_path()) {
            Ok(b) => Some(match <[u8; 8]>::try_from(b.as_slice()) {
                Ok(a) => UNIX_EPOCH + Duration::from_nanos(u64::from_le_bytes(a)),
                Err(_) => SystemTime::now(),
            }),
            Err(e) if e.kind() == ErrorKind::NotFound => None,
            Err(_) => Some(SystemTime::now()),
        }
    }

    /// The listing page last saved for directory `dir_key`, checked like a block (a damaged
    /// one is removed). Blocking (file I/O).
    pub fn listing(&self, dir_key: &str) -> Option<Vec<u8>> {
        let id = self.id(dir_key, "", 0, LISTING);
        let name = id.name();
        let path = self.whole_path(name, LST);
        let hlen = id.header(0, 0).len() as u64;
        let len = match std::fs::symlink_metadata(&path) {
            Ok(md) if md.len() >= hlen => md.len() - hlen,
            Ok(_) => 0,
            Err(_) => return None,
        };
        let mut buf = vec![0; len as usize];
        match self.read_file(&path, &id, &mut buf) {
            Ok(()) => Some(buf),
            Err(Miss::Absent) => None,
            Err(Miss::Io(e)) => {
                self.io_error("read", &e);
                None
            }
            Err(Miss::Corrupt(why)) => {
                inc(&self.metrics.data_cache_corrupt);
                tracing::warn!(
                    "data cache file {} (listing of {dir_key}) is {why}: removed",
                    path.display()
                );
                let _ = std::fs::remove_file(&path);
                self.index.lock().remove(name);
                self.update_size();
                None
            }
        }
    }

    /// Whether the index has every block of `job`'s object (the last ones first: a stream
    /// writes them last).
    fn all_blocks(&self, job: &Job) -> bool {
        let ix = self.index.lock();
        (0..job.size.div_ceil(BLOCK)).rev().all(|i| {
            ix.files
                .contains_key(&self.id(&job.key, &job.etag, job.size, i).name())
        })
    }

    /// Writes `job`'s object whole: its blocks read back (each checked) or `job`'s own data,
    /// at their offsets in a temporary file renamed into place, then the manifest sealing it;
    /// the block files go. Whatever fails leaves the blocks as they were.
    fn assemble(&self, job: &Job) {
        let (key, etag, size) = (&job.key, &job.etag, job.size);
        let id = self.id(key, etag, size, WHOLE);
        let name = id.name();
        // The copy is written next to the blocks it is made of: one over half the cache
        // would push out everything else, then not fit (on a disk the size of the cache,
        // fail, and be tried again at every open). It stays in blocks.
        if size > self.max_bytes / 2 {
            return;
        }
        let obj = self.whole_path(name, OBJ);
        if let Ok(md) = std::fs::symlink_metadata(&obj) {
            // Sealed already, or being sealed by another mount: nothing to do. A crashed
            // assembly's data file is in the way of every later one: removed.
            let linked = UNIX_EPOCH + Duration::new(md.ctime() as u64, md.ctime_nsec() as u32);
            let orphan = linked.elapsed().is_ok_and(|age| age > ORPHAN_AGE)
                && !self.whole_path(name, MAN).exists();
            if !orphan {
                return;
            }
            let _ = std::fs::remove_file(&obj);
        }
        let n = size.div_ceil(BLOCK);
        let blocks: Vec<u128> = (0..n).map(|i| self.id(key, etag, size, i).name()).collect();
        // Room for the copy (and its manifest) next to this object's own blocks, which it
        // is made from and which go once it is sealed.
        self.evict_keeping(self.max_bytes.saturating_sub(on_disk(size) + 4096), &blocks);
        let mut tmp = None;
        let made = (|| -> Result<(File, Vec<u32>), Miss> {
            let (mut f, t) = create_tmp(&obj).map_err(Miss::Io)?;
            let tmp = tmp.insert(t);
            let mut buf = Vec::new();
            let mut crcs = Vec::with_capacity(n as usize);
            for i in 0..n {
                let data: &[u8] = if i == job.index {
                    &job.data
                } else {
                    let b = block_range(i, size);
                    buf.resize((b.end - b.start) as usize, 0);
                    let id = self.id(key, etag, size, i);
                    match self.read_one(&id, &mut buf) {
                        Ok(()) => {}
                        // Out of the index, so that the next open does not ask for this
                        // copy again (reading and writing all the rest) before a read
                        // brought the block back.
                        Err(Miss::Corrupt(why)) => {
                            self.drop_corrupt(&id, key, i, why);
                            return Err(Miss::Corrupt(why));
                        }
                        Err(miss) => {
                            if self.index.lock().remove(id.name()).is_some() {
                                self.update_size();
                            }
                            return Err(miss);
                        }
                    }
                    &buf
                };
                crcs.push(crc32fast::hash(data));
                f.write_all(data).map_err(Miss::Io)?;
            }
            // On the disk before it is sealed: the kernel reads a handed-over copy unchecked,
            // and bytes the page cache drops unwritten (a failing disk, space that runs out
            // at writeback) would show there with no error. Names and the manifest are not
            // synced: a crash loses at most the copy, fetched again.
            f.sync_data().map_err(Miss::Io)?;
            // Never over another mount's copy, which it may be sealing: that one stays.
            std::fs::hard_link(&*tmp, &obj).map_err(Miss::Io)?;
            let _ = std::fs::remove_file(&*tmp);
            Ok((f, crcs))
        })();
        let (f, crcs) = match made {
            Ok(m) => m,
            Err(miss) => {
                if let Some(tmp) = tmp {
                    let _ = std::fs::remove_file(tmp);
                }
                match miss {
                    Miss::Io(e) if e.kind() == ErrorKind::AlreadyExists => {}
                    Miss::Io(e) => self.io_error("write", &e),
                    _ => {}
                }
                return;
            }
        };
        // Indexed before its manifest makes it visible: a reader that finds it damaged at
        // once then removes it from the index too.
        self.index.lock().insert_whole(name, size, now_tick());
        // Sealed as it is now in place (the link changed its ctime).
        let sealed = f.metadata().and_then(|md| {
            let m = Manifest::sealed(&md, &self.boot, crcs);
            self.write_manifest(&id, &m).map(|len| (len, m))
        });
        match sealed {
            Ok((man_len, m)) => {
                let mut ix = self.index.lock();
                for b in &blocks {
                    ix.remove(*b);
                }
                if let Some(&(_, used)) = ix.files.get(&name) {
                    ix.insert_whole(name, on_disk(size) + on_disk(man_len), used);
                    self.keep_seal(&mut ix, name, &id, &m);
                }
            }
            Err(e) => {
                self.index.lock().remove(name);
                self.remove_whole(name);
                return self.io_error("write", &e);
            }
        }
        for b in blocks {
            match std::fs::remove_file(self.path(b)) {
                Ok(()) => {}
                Err(e) if e.kind() == ErrorKind::NotFound => {}
                Err(e) => self.io_error("evict", &e),
            }
        }
        self.evict_to(self.max_bytes);
    }

    /// Evicts the least recently used blocks until at most `limit` bytes are left.
    fn evict_to(&self, limit: u64) {
        self.evict_keeping(limit, &[]);
    }

    /// [`DataCache::evict_to`], never evicting `keep` (nor going below their bytes).
    fn evict_keeping(&self, limit: u64, keep: &[u128]) {
        // Looked up for every entry passed over, under the index's lock.
        let keep: HashSet<u128> = keep.iter().copied().collect();
        loop {
            let victim = {
                let mut ix = self.index.lock();
                if ix.bytes <= limit {
                    break;
                }
                let Some(&(_, name)) = ix.lru.iter().find(|(_, n)| !keep.contains(n)) else {
                    break;
                };
                let whole = ix.wholes.contains(&name);
                let listing = ix.listings.contains(&name);
                ix.remove(name);
                (name, whole, listing)
            };
            let (victim, whole, listing) = victim;
            if whole {
                if self.remove_whole(victim) {
                    inc(&self.metrics.data_cache_evictions);
                }
                continue;
            }
            let path = match listing {
                true => self.whole_path(victim, LST),
                false => self.path(victim),
            };
            match std::fs::remove_file(path) {
                Ok(()) => inc(&self.metrics.data_cache_evictions),
                Err(e) if e.kind() == ErrorKind::NotFound => {} // another mount evicted it
                Err(e) => self.io_error("evict", &e),
            }
        }
        self.update_size();
    }

    /// Rereads the directory: block files (size and mtime, or the later use this mount saw)
    /// replace the index, with the seals of whole objects sealed in this boot (their
    /// manifests read once); temporary files of crashed writers go.
    fn rescan(self: &Arc<Self>) {
        self.persist_uses();
        let mut found: Vec<(u128, u64, u64)> = Vec::new();
        let mut listings: Vec<(u128, u64, u64)> = Vec::new();
        // Whole objects: name → (bytes, last use, has a data file, has a manifest).
        let mut wholes: HashMap<u128, (u64, u64, bool, bool)> = HashMap::new();
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
                let (hex, ext) = name.split_once('.').unwrap_or((&name, ""));
                let Ok(n) = u128::from_str_radix(hex, 16) else {
                    continue;
                };
                match ext {
                    "" => found.push((n, md.len(), tick(mtime))),
                    LST => listings.push((n, md.len(), tick(mtime))),
                    OBJ | MAN => {
                        let w = wholes.entry(n).or_default();
                        w.0 += on_disk(md.len());
                        w.1 = w.1.max(tick(mtime));
                        if ext == OBJ {
                            w.2 = true;
                        } else {
                            w.3 = true;
                        }
                    }
                    _ => {}
                }
            }
        }
        // A data file without its manifest (a writer died in between, or eviction did) is
        // never used: removed once old; a manifest without its data file at once.
        wholes.retain(|&n, w| match (w.2, w.3) {
            (true, true) => true,
            (false, _) => {
                let _ = std::fs::remove_file(self.whole_path(n, MAN));
                false
            }
            (true, false) => {
                let old = now_tick().saturating_sub(w.1) > STALE_TMP.as_nanos() as u64;
                if old {
                    let _ = std::fs::remove_file(self.whole_path(n, OBJ));
                }
                false
            }
        });
        {
            let mut ix = self.index.lock();
            let mut fresh = Index::default();
            for (n, size, t) in found {
                let used = ix.files.get(&n).map_or(t, |&(_, u)| u.max(t));
                fresh.insert(n, size, used);
            }
            for (n, (size, t, _, _)) in wholes {
                let used = ix.files.get(&n).map_or(t, |&(_, u)| u.max(t));
                fresh.insert_whole(n, size, used);
            }
            for (n, size, t) in listings {
                let used = ix.files.get(&n).map_or(t, |&(_, u)| u.max(t));
                fresh.insert_listing(n, size, used);
            }
            let whole = |n: &u128| fresh.wholes.contains(n);
            let seals = ix.seals.drain().filter(|(n, _)| whole(n)).collect();
            let used = ix.used.drain().filter(whole).collect();
            let unsealed = ix.unsealed.drain().filter(whole).collect();
            (fresh.seals, fresh.used, fresh.unsealed) = (seals, used, unsealed);
            *ix = fresh;
        }
        self.evict_to(self.max_bytes);
        self.read_seals();
    }

    /// Reads, on a thread of its own (the writer goes on meanwhile), the manifests of the
    /// whole objects found without a seal and not read before: each at most once per mount.
    fn read_seals(self: &Arc<Self>) {
        if self.boot.is_empty() || self.reading_seals.swap(true, Ordering::AcqRel) {
            return;
        }
        let todo: Vec<u128> = {
            let ix = self.index.lock();
            ix.wholes
                .iter()
                .filter(|n| !ix.seals.contains_key(n) && !ix.unsealed.contains(n))
                .copied()
                .collect()
        };
        let cache = Arc::downgrade(self);
        let spawned = std::thread::Builder::new()
            .name("data-cache-seals".into())
            .spawn(move || {
                for n in todo {
                    let Some(c) = cache.upgrade() else { return };
                    let seal = c.read_seal(n);
                    let mut ix = c.index.lock();
                    if ix.wholes.contains(&n) && !ix.seals.contains_key(&n) {
                        match seal {
                            Some(s) => drop(ix.seals.insert(n, s)),
                            None => drop(ix.unsealed.insert(n)),
                        }
                    }
                }
                if let Some(c) = cache.upgrade() {
                    c.reading_seals.store(false, Ordering::Release);
                }
            });
        if spawned.is_err() {
            self.reading_seals.store(false, Ordering::Release);
        }
    }
}

impl DataCache {
    /// The seal in the manifest of whole object `name`, if it is sound, of this cache's
    /// scope, named as its object is, and sealed in this boot.
    fn read_seal(&self, name: u128) -> Option<Seal> {
        let mut b = Vec::new();
        open_own(&self.whole_path(name, MAN))
            .and_then(|mut f| f.read_to_end(&mut b))
            .ok()?;
        let ([scope, key, etag], m) = Manifest::decode_any(&b).ok()?;
        let id = BlockId {
            scope: std::str::from_utf8(&scope).ok()?,
            key: std::str::from_utf8(&key).ok()?,
            etag: std::str::from_utf8(&etag).ok()?,
            size: m.size,
            index: WHOLE,
        };
        let ours = id.scope == self.scope && id.name() == name;
        (ours && !self.boot.is_empty() && m.boot == self.boot).then(|| m.seal(self.ident(&id)))
    }
}

impl Drop for DataCache {
    fn drop(&mut self) {
        // A disk that holds a read for good would hold the daemon's exit too: the uses are
        // an eviction hint, not worth that.
        if self.disk_stuck.load(Ordering::Relaxed) > 0 {
            tracing::warn!("data cache: its disk does not answer; last uses not recorded");
            return;
        }
        self.persist_uses();
    }
}

/// An [`open_own`] refusal: a link, or not a regular file of this user.
fn not_own(e: &std::io::Error) -> bool {
    e.raw_os_error() == Some(libc::ELOOP) || e.kind() == ErrorKind::Other
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
    loop {
        // Ends when the cache is dropped (its sender with it).
        let job = match rx.recv_timeout(RESCAN_EVERY) {
            Ok(job) => Some(job),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => None,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return,
        };
        let Some(c) = cache.upgrade() else { return };
        if scanned.elapsed() >= RESCAN_EVERY {
            c.rescan();
            scanned = std::time::Instant::now();
        }
        if let Some(job) = job {
            crate::testpoint::reached_blocking("cache.write");
            #[cfg(test)]
            let _held = c.writer_held.lock();
            c.write(&job);
            c.metrics.data_cache_queued.fetch_sub(1, Ordering::Relaxed);
        }
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

    /// A cache directory reached through a directory others may change (writable, not
    /// sticky) is refused: they could swap what is below for a link. Through a link of its
    /// own it is taken at its real path; below a sticky directory (like /tmp) it is fine.
    #[test]
    fn a_cache_dir_others_can_reroute_is_refused() {
        let top = tempfile::tempdir().unwrap();
        let open = top.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = prepare_dir(&open.join("cache")).unwrap_err();
        assert!(e.contains("above it") && e.contains("mode 777"), "{e}");
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let real = prepare_dir(&open.join("cache")).unwrap();
        assert_eq!(real, open.join("cache").canonicalize().unwrap());
        let link = top.path().join("link");
        std::os::unix::fs::symlink(open.join("cache"), &link).unwrap();
        assert_eq!(prepare_dir(&link).unwrap(), real);
    }

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
        let size = index * BLOCK + data.len() as u64;
        c.put("k", etag, size, index, Bytes::copy_from_slice(data));
        let name = c.id("k", etag, size, index).name();
        wait_until("block written", || c.index.lock().files.contains_key(&name));
    }

    /// Two mounts sharing a cache record their changes at once: the record ends at the
    /// later of them, never moved back by the other's older one, and always whole. An earlier
    /// build compared and wrote under a lock of its own process only, through a temporary
    /// file named by the PID (two daemons in containers share one).
    #[test]
    fn two_mounts_recording_changes_at_once_never_move_the_record_back() {
        let dir = tempfile::tempdir().unwrap();
        let (a, _) = start(dir.path(), 64 << 20);
        let (b, _) = start(dir.path(), 64 << 20);
        let at = |n: u64| UNIX_EPOCH + Duration::from_secs(1_000_000 + n);
        let last = 2000;
        std::thread::scope(|s| {
            for (c, odd) in [(&a, 1), (&b, 0)] {
                s.spawn(move || {
                    for n in (0..=last).filter(|n| n % 2 == odd) {
                        c.changing_until(at(n));
                        let seen = c.changed_until().expect("a record");
                        assert!(seen >= at(n), "the record went back below {n}");
                    }
                });
            }
        });
        assert_eq!(a.changed_until(), Some(at(last)));
    }

    /// A change that cannot be recorded (a full or failing cache disk) leaves a record that
    /// reads as "now", never the older one: a mount sharing the cache would otherwise use a
    /// listing page saved before this change, and with it the version the change replaced.
    #[test]
    fn a_change_that_cannot_be_recorded_makes_every_saved_page_old() {
        let dir = tempfile::tempdir().unwrap();
        let (c, _) = start(dir.path(), 64 << 20);
        let old = UNIX_EPOCH + Duration::from_secs(1_000_000);
        c.changing_until(old);
        assert_eq!(c.changed_until(), Some(old));
        // The shared lock cannot be taken (a directory in its place).
        let lock = c.changed_path().with_extension("lock");
        std::fs::remove_file(&lock).unwrap();
        std::fs::create_dir(&lock).unwrap();
        let before = SystemTime::now();
        c.changing_until(before + Duration::from_secs(60));
        assert!(c.changed_until().is_some_and(|t| t >= before));
    }

    #[test]
    fn listing_pages_are_replaced_checked_and_evicted_like_blocks() {
        let dir = tempfile::tempdir().unwrap();
        let (c, m) = start(dir.path(), 64 << 20);
        c.put_listing("d/", b"one".to_vec());
        c.put_listing("d/", b"second".to_vec());
        assert_eq!(c.listing("d/").as_deref(), Some(&b"second"[..]));
        assert!(c.listing("e/").is_none());
        let path = c.whole_path(c.id("d/", "", 0, LISTING).name(), LST);
        assert!(path.exists());
        // Damaged: removed, never returned.
        let mut bytes = std::fs::read(&path).unwrap();
        let n = bytes.len();
        bytes[n - 1] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        assert!(c.listing("d/").is_none());
        assert!(!path.exists());
        assert_eq!(FsMetrics::get(&m.data_cache_corrupt), 1);
        // Counted in the size, and evicted to make room like a block.
        c.put_listing("d/", vec![7; 4000]);
        assert!(c.index.lock().bytes > 4000);
        c.evict_to(0);
        assert!(!path.exists() && c.listing("d/").is_none());
    }

    #[test]
    fn blocks_come_back_only_for_their_own_key_etag_and_sound_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let (c, m) = start(dir.path(), 64 << 20);
        let data: Vec<u8> = (0..5000u32).map(|i| (i % 253) as u8).collect();
        put_and_wait(&c, "e1", 3, &data);
        assert_eq!(get(&c, "e1", 3, data.len()).as_deref(), Some(&data[..]));
        // Another version, another block, another object size (a store whose ETags do not
        // change with the content): misses.
        assert!(get(&c, "e2", 3, data.len()).is_none());
        assert!(get(&c, "e1", 2, data.len()).is_none());
        assert!(get(&c, "e1", 3, data.len() - 1).is_none());
        put_and_wait(&c, "e1", 0, &vec![7; BLOCK as usize]);
        let mut out = vec![0; BLOCK as usize];
        assert_eq!(c.read_blocks("k", "e1", BLOCK, 0..BLOCK, &mut out), [true]);
        assert_eq!(
            c.read_blocks("k", "e1", 2 * BLOCK, 0..BLOCK, &mut out),
            [false]
        );
        // A block file cut short: removed, never served.
        let path = c.path(c.id("k", "e1", 3 * BLOCK + data.len() as u64, 3).name());
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 1]).unwrap();
        assert!(get(&c, "e1", 3, data.len()).is_none());
        assert_eq!(FsMetrics::get(&m.data_cache_corrupt), 1, "the wrong length");
        // That removed it; written again, then one bit flipped: removed, never served.
        put_and_wait(&c, "e1", 3, &data);
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
        assert_eq!(FsMetrics::get(&m.data_cache_hits), 2);
    }

    #[test]
    fn eviction_keeps_the_size_and_the_recently_read_blocks() {
        let dir = tempfile::tempdir().unwrap();
        let block = vec![7u8; 100_000];
        let one = on_disk(block.len() as u64 + 200);
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

    /// A damaged block found while assembling its object's whole copy is removed: it stayed
    /// indexed, so every open asked for the copy again, each reading and writing all the
    /// other blocks to fail at the same one, until a read through the daemon removed it.
    #[test]
    fn a_damaged_block_found_by_an_assembly_is_removed() {
        let dir = tempfile::tempdir().unwrap();
        let (c, m) = start(dir.path(), 64 << 20);
        let size = 3 * BLOCK;
        let data: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
        put_all(&c, "e", &data);
        let name = |i| c.id("k", "e", size, i).name();
        wait_until("blocks written", || {
            (0..3).all(|i| c.index.lock().files.contains_key(&name(i)))
        });
        let path = c.path(name(1));
        let mut bytes = std::fs::read(&path).unwrap();
        let n = bytes.len();
        bytes[n - 10] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        c.set_whole_files(true);
        assert!(c.local_copy("k", "e", size).is_none());
        // The file goes first, then its index entry.
        wait_until("the damaged block removed", || {
            !path.exists() && !c.index.lock().files.contains_key(&name(1))
        });
        assert_eq!(FsMetrics::get(&m.data_cache_corrupt), 1);
        assert!(c.local_copy("k", "e", size).is_none());
    }

    /// The directories the cache makes below its own are its user's alone: under a umask
    /// of 022 they were 0755, so other users could list what was read, and when.
    #[test]
    fn the_directories_below_the_cache_are_private() {
        let dir = tempfile::tempdir().unwrap();
        let (c, _m) = start(dir.path(), 1 << 20);
        put_and_wait(&c, "e", 0, b"data");
        let sub = c.path(c.id("k", "e", 4, 0).name());
        let sub = sub.parent().unwrap();
        assert_ne!(sub, dir.path());
        let mode = std::fs::metadata(sub).unwrap().permissions().mode();
        assert_eq!(mode & 0o077, 0, "{} is {mode:o}", sub.display());
    }

    /// Tiny objects count the disk blocks their files take, not their length: 100 of 10
    /// bytes in a 40 KiB cache kept all 100 (400 KiB on disk, and 100 inodes).
    #[test]
    fn tiny_blocks_count_the_disk_space_they_take() {
        let dir = tempfile::tempdir().unwrap();
        let (c, m) = start(dir.path(), 40 << 10);
        for i in 0..100 {
            put_and_wait(&c, &format!("e{i}"), 0, b"0123456789");
        }
        let files = c.index.lock().files.len();
        assert!(files <= 10, "{files} files of 4 KiB at least in 40 KiB");
        fn used(dir: &Path) -> u64 {
            std::fs::read_dir(dir)
                .unwrap()
                .map(|e| {
                    let e = e.unwrap();
                    match e.file_type().unwrap().is_dir() {
                        true => used(&e.path()),
                        false => e.metadata().unwrap().blocks() * 512,
                    }
                })
                .sum()
        }
        let on_disk = used(&dir.path().join(VERSION_DIR));
        assert!(on_disk <= 40 << 10, "{on_disk} bytes on disk");
        assert!(FsMetrics::get(&m.data_cache_bytes) <= 40 << 10);
    }

    #[test]
    fn whole_objects_are_assembled_sealed_checked_and_evicted_whole() {
        let dir = tempfile::tempdir().unwrap();
        let (c, m) = start(dir.path(), 64 << 20);
        c.set_whole_files(true);
        let size = 2 * BLOCK + 5000;
        let data: Vec<u8> = (0..size).map(|i| (i * 31 % 251) as u8).collect();
        for i in 0..3 {
            let b = block_range(i, size);
            let part = Bytes::copy_from_slice(&data[b.start as usize..b.end as usize]);
            c.put("k", "e", size, i, part);
        }
        wait_until("assembled", || c.local_copy("k", "e", size).is_some());
        let name = c.id("k", "e", size, WHOLE).name();
        let obj = c.whole_path(name, OBJ);
        assert_eq!(
            std::fs::read(&obj).unwrap(),
            data,
            "exactly the object's bytes"
        );
        wait_until("blocks removed", || {
            (0..3).all(|i| !c.path(c.id("k", "e", size, i).name()).exists())
        });
        // Daemon reads come from it, each block checked.
        let mut out = vec![0; size as usize];
        assert_eq!(c.read_blocks("k", "e", size, 0..size, &mut out), [true; 3]);
        assert!(out == data);
        assert!(c.local_copy("k", "e2", size).is_none());
        // Changed in place and sealed again, but in another boot: checked in full, refused.
        let mut bytes = data.clone();
        bytes[BLOCK as usize + 3] ^= 1;
        std::fs::write(&obj, &bytes).unwrap();
        let md = std::fs::metadata(&obj).unwrap();
        let crcs = (0..3)
            .map(|i| {
                let b = block_range(i, size);
                crc32fast::hash(&data[b.start as usize..b.end as usize])
            })
            .collect();
        let id = c.id("k", "e", size, WHOLE);
        c.write_manifest(&id, &Manifest::sealed(&md, "another boot", crcs))
            .unwrap();
        assert!(c.local_copy("k", "e", size).is_none());
        assert_eq!(FsMetrics::get(&m.data_cache_corrupt), 1);
        assert!(!obj.exists() && !c.whole_path(name, MAN).exists());
        // Written whole again, then evicted as one entry by a smaller cache.
        for i in 0..3 {
            let b = block_range(i, size);
            let part = Bytes::copy_from_slice(&data[b.start as usize..b.end as usize]);
            c.put("k", "e", size, i, part);
        }
        wait_until("assembled again", || c.local_copy("k", "e", size).is_some());
        // Touched by a write in place: the seal no longer matches.
        let f = std::fs::OpenOptions::new().write(true).open(&obj).unwrap();
        f.write_at(&data[..1], 0).unwrap();
        drop(f);
        assert!(c.local_copy("k", "e", size).is_none());
        assert_eq!(FsMetrics::get(&m.data_cache_corrupt), 2);
        for i in 0..3 {
            let b = block_range(i, size);
            let part = Bytes::copy_from_slice(&data[b.start as usize..b.end as usize]);
            c.put("k", "e", size, i, part);
        }
        wait_until("assembled a third time", || {
            c.local_copy("k", "e", size).is_some()
        });
        wait_until("blocks removed again", || {
            (0..3).all(|i| !c.path(c.id("k", "e", size, i).name()).exists())
        });
        drop(c);
        let (c, m) = start(dir.path(), BLOCK);
        wait_until("evicted", || FsMetrics::get(&m.data_cache_evictions) == 1);
        assert!(!obj.exists() && !c.whole_path(name, MAN).exists());
        assert_eq!(FsMetrics::get(&m.data_cache_bytes), 0);
    }

    /// An object over half the cache stays in blocks, and evicts nothing to be made whole
    /// (an earlier build evicted every other entry for its copy, then held the copy and its
    /// blocks together, past the bound).
    #[test]
    fn objects_over_half_the_cache_stay_in_blocks() {
        let dir = tempfile::tempdir().unwrap();
        let (c, m) = start(dir.path(), 8 * BLOCK);
        for (key, blocks) in [("other", 2u64), ("big", 5)] {
            // Whole copies on for the big one only (the other stays in blocks to be seen).
            c.set_whole_files(key == "big");
            let size = blocks * BLOCK;
            for i in 0..blocks {
                c.put(
                    key,
                    "e",
                    size,
                    i,
                    Bytes::from(vec![i as u8; BLOCK as usize]),
                );
            }
            wait_until(key, || {
                (0..blocks).all(|i| c.path(c.id(key, "e", size, i).name()).exists())
                    || c.local_copy(key, "e", size).is_some()
            });
        }
        // An open of the big one asks for its whole copy.
        assert!(c.local_copy("big", "e", 5 * BLOCK).is_none());
        std::thread::sleep(Duration::from_millis(300));
        assert!(c.local_copy("big", "e", 5 * BLOCK).is_none(), "made whole");
        assert_eq!(FsMetrics::get(&m.data_cache_evictions), 0);
        assert!((0..2).all(|i| c.path(c.id("other", "e", 2 * BLOCK, i).name()).exists()));
        assert!(FsMetrics::get(&m.data_cache_bytes) <= 8 * BLOCK);
    }

    fn put_all(c: &DataCache, etag: &str, data: &[u8]) {
        let size = data.len() as u64;
        for i in 0..size.div_ceil(BLOCK) {
            let b = block_range(i, size);
            let part = Bytes::copy_from_slice(&data[b.start as usize..b.end as usize]);
            c.put("k", etag, size, i, part);
        }
    }

    #[test]
    fn planted_links_are_never_written_through_nor_handed_over() {
        let dir = tempfile::tempdir().unwrap();
        let (c, _m) = start(dir.path(), 64 << 20);
        c.set_whole_files(true);
        let size = 2 * BLOCK + 77;
        let data: Vec<u8> = (0..size).map(|i| (i * 7 % 253) as u8).collect();
        // Links at every name a temporary file of this process could have had before
        // (`.tmp-PID-NAME`), to a file the cache must never write.
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let pid = std::process::id();
        let name = c.id("k", "e", size, WHOLE).name();
        let mut planted = vec![c.whole_path(name, OBJ), c.whole_path(name, MAN)];
        planted.extend((0..3).map(|i| c.path(c.id("k", "e", size, i).name())));
        for p in &planted {
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            let f = p.file_name().unwrap().to_string_lossy().into_owned();
            let f = match f.split_once('.') {
                Some((hex, ext)) => format!(".tmp-{pid}-{hex}.{ext}"),
                None => format!(".tmp-{pid}-{f}"),
            };
            std::os::unix::fs::symlink(&victim, p.with_file_name(f)).unwrap();
        }
        put_all(&c, "e", &data);
        wait_until("assembled", || c.local_copy("k", "e", size).is_some());
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        // A manifest (or data file) replaced by a link to an identical file elsewhere is
        // not the cache's own file: refused, not followed.
        let man = c.whole_path(name, MAN);
        let elsewhere = dir.path().join("man-copy");
        std::fs::copy(&man, &elsewhere).unwrap();
        std::fs::remove_file(&man).unwrap();
        std::os::unix::fs::symlink(&elsewhere, &man).unwrap();
        // Seen at the next start (this mount opens the copy by the seal it keeps).
        drop(c);
        let (c, _m) = start(dir.path(), 64 << 20);
        c.set_whole_files(true);
        assert!(c.local_copy("k", "e", size).is_none(), "followed a link");
    }

    /// The name of the whole copy of version `etag` of `k` (`size` bytes) in a cache of
    /// scope "test".
    fn c_name(etag: &str, size: u64) -> u128 {
        let id = BlockId {
            scope: "test",
            key: "k",
            etag,
            size,
            index: WHOLE,
        };
        id.name()
    }

    #[test]
    fn a_restart_hands_over_copies_by_their_seal_alone_never_a_changed_one() {
        let dir = tempfile::tempdir().unwrap();
        let (c, _m) = start(dir.path(), 64 << 20);
        c.set_whole_files(true);
        let size = BLOCK + 77;
        let data: Vec<u8> = (0..size).map(|i| (i * 7 % 251) as u8).collect();
        put_all(&c, "e", &data);
        wait_until("assembled", || c.local_copy("k", "e", size).is_some());
        // And a version of one block, which daemon reads check against the seal's CRC.
        let one = &data[..5000];
        put_all(&c, "e1", one);
        wait_until("written whole", || c.local_copy("k", "e1", 5000).is_some());
        drop(c);
        let one_name = c_name("e1", 5000);
        let name = c_name("e", size);
        // Another boot's manifests give no seal: their copies are checked in full first.
        let cfg = DataCacheConfig {
            dir: dir.path().to_path_buf(),
            max_bytes: 64 << 20,
            scope: "test".into(),
        };
        let m = Arc::new(FsMetrics::default());
        let other = DataCache::start_in_boot(&cfg, 8, m, "another boot".into());
        wait_until("manifest read", || {
            other.index.lock().unsealed.contains(&name)
        });
        assert!(other.index.lock().seals.is_empty());
        drop(other);
        // This boot's: the scan reads each manifest once, and opens need the data file alone.
        let (c, _m) = start(dir.path(), 64 << 20);
        wait_until("seals read", || {
            let ix = c.index.lock();
            ix.seals.contains_key(&name) && ix.seals.contains_key(&one_name)
        });
        let (man, obj) = (c.whole_path(name, MAN), c.whole_path(name, OBJ));
        std::fs::remove_file(&man).unwrap();
        std::fs::remove_file(c.whole_path(one_name, MAN)).unwrap();
        let mut out = vec![0; 5000];
        assert_eq!(c.read_blocks("k", "e1", 5000, 0..5000, &mut out), [true]);
        assert!(out == one);
        let mut bytes = Vec::new();
        let mut f = c
            .local_copy("k", "e", size)
            .expect("handed over by its seal");
        f.read_to_end(&mut bytes).unwrap();
        assert!(bytes == data);
        // Not for another version, nor once the data file changed (its manifest decides
        // then, and here has none).
        assert!(c.local_copy("k", "e2", size).is_none());
        let f = std::fs::OpenOptions::new().write(true).open(&obj).unwrap();
        f.write_at(&data[..1], 0).unwrap();
        assert!(c.local_copy("k", "e", size).is_none());
    }

    #[test]
    fn without_a_boot_id_every_copy_is_checked_in_full() {
        let dir = tempfile::tempdir().unwrap();
        prepare_dir(dir.path()).unwrap();
        let m = Arc::new(FsMetrics::default());
        let cfg = DataCacheConfig {
            dir: dir.path().to_path_buf(),
            max_bytes: 64 << 20,
            scope: "test".into(),
        };
        let c = DataCache::start_in_boot(&cfg, 8, m.clone(), String::new());
        c.set_whole_files(true);
        let size = 2 * BLOCK + 9;
        let data: Vec<u8> = (0..size).map(|i| (i * 11 % 251) as u8).collect();
        put_all(&c, "e", &data);
        wait_until("assembled", || c.local_copy("k", "e", size).is_some());
        // Bytes lost in a crash, then sealed in the same (unknown) boot: only a full check
        // finds them.
        let name = c.id("k", "e", size, WHOLE).name();
        let obj = c.whole_path(name, OBJ);
        let mut bytes = data.clone();
        bytes[BLOCK as usize + 1] ^= 1;
        std::fs::write(&obj, &bytes).unwrap();
        let md = std::fs::metadata(&obj).unwrap();
        let crcs = (0..3)
            .map(|i| {
                let b = block_range(i, size);
                crc32fast::hash(&data[b.start as usize..b.end as usize])
            })
            .collect();
        let id = c.id("k", "e", size, WHOLE);
        c.write_manifest(&id, &Manifest::sealed(&md, "", crcs))
            .unwrap();
        assert!(
            c.local_copy("k", "e", size).is_none(),
            "damaged copy handed over"
        );
        assert_eq!(FsMetrics::get(&m.data_cache_corrupt), 1);
    }

    #[test]
    fn a_crashed_assemblys_data_file_does_not_block_later_ones() {
        let dir = tempfile::tempdir().unwrap();
        let (c, _m) = start(dir.path(), 64 << 20);
        c.set_whole_files(true);
        let size = 2 * BLOCK + 3;
        let data: Vec<u8> = (0..size).map(|i| (i * 5 % 239) as u8).collect();
        // kill -9 between linking the data file and writing its manifest.
        let name = c.id("k", "e", size, WHOLE).name();
        let obj = c.whole_path(name, OBJ);
        std::fs::create_dir_all(obj.parent().unwrap()).unwrap();
        std::fs::write(&obj, b"half an assembly").unwrap();
        std::thread::sleep(ORPHAN_AGE + Duration::from_millis(100));
        put_all(&c, "e", &data);
        wait_until("assembled over the orphan", || {
            c.local_copy("k", "e", size).is_some()
        });
        let mut got = Vec::new();
        (&c.local_copy("k", "e", size).unwrap())
            .read_to_end(&mut got)
            .unwrap();
        assert_eq!(got, data);
    }

    #[test]
    fn a_copy_seen_under_another_device_number_is_checked_in_full_not_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let (c, m) = start(dir.path(), 64 << 20);
        c.set_whole_files(true);
        let size = 2 * BLOCK + 5;
        let data: Vec<u8> = (0..size).map(|i| (i * 13 % 241) as u8).collect();
        put_all(&c, "e", &data);
        wait_until("assembled", || c.local_copy("k", "e", size).is_some());
        let id = c.id("k", "e", size, WHOLE);
        let name = id.name();
        let obj = c.whole_path(name, OBJ);
        let crcs = |d: &[u8]| -> Vec<u32> {
            (0..3)
                .map(|i| {
                    let b = block_range(i, size);
                    crc32fast::hash(&d[b.start as usize..b.end as usize])
                })
                .collect()
        };
        // Sealed in this boot on a device numbered differently (a re-attached volume).
        let reseal = |dev_delta: u64| {
            let md = std::fs::metadata(&obj).unwrap();
            let mut man = Manifest::sealed(&md, &c.boot, crcs(&data));
            man.dev = man.dev.wrapping_add(dev_delta);
            c.write_manifest(&id, &man).unwrap();
        };
        reseal(1);
        // A manifest written behind its back is read at the cache's next start: as then.
        c.index.lock().seals.clear();
        let f = c.local_copy("k", "e", size).expect("a sound copy kept");
        let mut got = Vec::new();
        (&f).read_to_end(&mut got).unwrap();
        assert_eq!(got, data);
        assert_eq!(FsMetrics::get(&m.data_cache_corrupt), 0);
        // Sealed again with this device number: handed over without another full read.
        let md = std::fs::metadata(&obj).unwrap();
        let mut man = Vec::new();
        File::open(c.whole_path(name, MAN))
            .unwrap()
            .read_to_end(&mut man)
            .unwrap();
        assert!(matches!(Manifest::decode(&id, &man), Ok(m) if m.dev == md.dev()));
        // Damaged under another number: the full check finds it.
        let mut bytes = data.clone();
        bytes[3] ^= 1;
        std::fs::OpenOptions::new()
            .write(true)
            .open(&obj)
            .unwrap()
            .write_all_at(&bytes[..8], 0)
            .unwrap();
        reseal(1);
        c.index.lock().seals.clear();
        assert!(
            c.local_copy("k", "e", size).is_none(),
            "damaged copy handed over"
        );
        assert_eq!(FsMetrics::get(&m.data_cache_corrupt), 1);
    }

    /// A memory store holding `f`: `len` bytes of a pattern (byte `i` is `i * step % modulo`).
    /// Returns the store, the bytes and their ETag.
    async fn stored_f(
        len: usize,
        step: usize,
        modulo: usize,
    ) -> (Arc<dyn ObjectStore>, Vec<u8>, String) {
        let mem: Arc<dyn ObjectStore> = Arc::new(MemoryStore::new());
        let data: Vec<u8> = (0..len).map(|i| (i * step % modulo) as u8).collect();
        let etag = mem
            .put("f", Bytes::from(data.clone()), &UserMeta::default())
            .await
            .unwrap();
        (mem, data, etag)
    }

    /// A reader of `f` (version `etag`, `size` bytes) through `store`, with a fresh cache over
    /// `dir` and a fresh budget: what a remount gives it. The cache outlives the reader (its
    /// writer drops what is queued when it goes).
    fn cached_reader(
        dir: &Path,
        store: Arc<dyn ObjectStore>,
        etag: &str,
        size: u64,
    ) -> (Reader, Arc<FsMetrics>, Arc<DataCache>) {
        const MIB: u64 = 1 << 20;
        let (cache, metrics) = start(dir, 64 << 20);
        let cfg = Arc::new(ReadConfig {
            part_size: 8 * MIB,
            max_window: 8 * MIB,
            budget: MemoryBudget::new(64 * MIB, metrics.clone()),
            metrics: metrics.clone(),
            data_cache: Some(cache.clone()),
        });
        let r = Reader::new(store, cfg, "f".into(), Some(etag.to_string()), size, false);
        (r, metrics, cache)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_new_reader_reads_cached_blocks_with_no_get() {
        const MIB: u64 = 1 << 20;
        let dir = tempfile::tempdir().unwrap();
        let (mem, data, etag) = stored_f((3 * MIB + 777) as usize, 13, 251).await;
        let store = Arc::new(FaultStore::new(mem));
        let reader = |dir: &Path| cached_reader(dir, store.clone(), &etag, data.len() as u64);
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
        // A hole in the middle (block 1 gone) and a damaged block at the end: a GET for
        // each, the right bytes, both rewritten.
        store.clear();
        let (r0, _, cache) = reader(dir.path());
        drop(r0);
        std::fs::remove_file(cache.path(cache.id("f", &etag, data.len() as u64, 1).name()))
            .unwrap();
        let last = cache.path(cache.id("f", &etag, data.len() as u64, 3).name());
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

    /// Blocks missed in the middle of a chunk are fetched alone, each run with its own GET
    /// (at once); the cached blocks between them are not fetched again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn only_the_blocks_missing_in_a_chunk_are_fetched() {
        use bucketfs_store::metrics::MeteredStore;
        const MIB: u64 = 1 << 20;
        let dir = tempfile::tempdir().unwrap();
        let (mem, data, etag) = stored_f((8 * MIB) as usize, 7, 253).await;
        let read_all = |dir: &Path| {
            let store = Arc::new(MeteredStore::new(mem.clone()));
            let (r, metrics, cache) = cached_reader(dir, store.clone(), &etag, 8 * MIB);
            (r, metrics, cache, store)
        };
        let (mut r, m, _c, _) = read_all(dir.path());
        assert!(r.read(0, (8 * MIB) as u32).await.unwrap()[..] == data[..]);
        drop(r);
        wait_until("eight blocks", || {
            FsMetrics::get(&m.data_cache_bytes) >= 8 * MIB
        });
        // Blocks 2, 3 and 6 evicted: two runs missing, four cached blocks around them.
        let (r0, _, cache, _) = read_all(dir.path());
        drop(r0);
        for i in [2, 3, 6] {
            std::fs::remove_file(cache.path(cache.id("f", &etag, 8 * MIB, i).name())).unwrap();
        }
        let (mut r, m, _c, store) = read_all(dir.path());
        assert!(r.read(0, (8 * MIB) as u32).await.unwrap()[..] == data[..]);
        assert_eq!(FsMetrics::get(&m.data_cache_hits), 5);
        assert_eq!(
            store.metrics().requests(Op::Get),
            2,
            "one GET per missing run"
        );
        assert_eq!(
            store.metrics().bytes_down(),
            3 * MIB,
            "only the missing blocks"
        );
    }

    #[test]
    fn missing_spans_join_the_closest_runs_past_four() {
        use crate::files::read::missing_spans;
        const MIB: u64 = 1 << 20;
        let size = 16 * MIB + 5;
        // Cut ends, every other block missed: many runs, joined down to four.
        let range = MIB / 2..16 * MIB + 5;
        let spans = missing_spans(&range, size, blocks_within(&range, size), |i| {
            i % 2 == 0 && i != 16
        });
        assert_eq!(spans.len(), 4);
        let covered: u64 = spans.iter().map(|s| s.end - s.start).sum();
        assert!(spans.windows(2).all(|w| w[0].end < w[1].start));
        assert_eq!(spans[0].start, MIB / 2, "the cut first block is fetched");
        assert_eq!(spans[3].end, size, "up to the end");
        for i in (1..17).filter(|i| i % 2 == 1 || *i == 16) {
            let b = block_range(i, size);
            assert!(
                spans.iter().any(|s| s.start <= b.start && b.end <= s.end),
                "block {i}"
            );
        }
        assert!(
            covered < range.end - range.start,
            "some cached blocks are left out"
        );
        // Everything cached: nothing to fetch; nothing cached: one span.
        assert!(
            missing_spans(&(0..size), size, blocks_within(&(0..size), size), |_| true).is_empty()
        );
        assert_eq!(
            missing_spans(&(0..size), size, blocks_within(&(0..size), size), |_| false),
            vec![0..size]
        );
        // Within one block: the range itself.
        let r = 10..20;
        assert_eq!(
            missing_spans(&r, size, blocks_within(&r, size), |_| true),
            vec![10..20]
        );
    }
}
