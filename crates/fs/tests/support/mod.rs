//! The harness the fs tests share: an `Fs` on the memory store (metered, or behind the fault
//! store) with a private cache dir, and the file operations many tests repeat.

#![allow(dead_code)] // each test binary uses a different part

use bucketfs_fs::{Caller, Fs, FsConfig, ROOT_INO};
use bucketfs_store::fault::FaultStore;
use bucketfs_store::memory::MemoryStore;
use bucketfs_store::metrics::{MeteredStore, StoreMetrics};
use bucketfs_store::{ObjectStore, UserMeta};
use bytes::Bytes;
use rand::{Rng, SeedableRng};
use std::ffi::OsStr;
use std::sync::Arc;

pub const MIB: u64 = 1024 * 1024;

pub const ME: Caller = Caller {
    uid: 1000,
    gid: 100,
};

pub struct Env {
    pub fs: Arc<Fs>,
    pub mem: Arc<MemoryStore>,
    pub metrics: Arc<StoreMetrics>,
    _cache: tempfile::TempDir,
}

pub fn config(cache: &tempfile::TempDir) -> FsConfig {
    FsConfig {
        part_size: 5 * MIB,
        cache_dir: cache.path().to_path_buf(),
        ..FsConfig::default()
    }
}

pub fn env() -> Env {
    env_on(MemoryStore::new())
}

pub fn env_on(mem: MemoryStore) -> Env {
    env_with(mem, |c| c)
}

/// [`env_on`] with the configuration `tune` makes of the default one.
pub fn env_with(mem: MemoryStore, tune: impl FnOnce(FsConfig) -> FsConfig) -> Env {
    let mem = Arc::new(mem);
    let metered = MeteredStore::new(mem.clone() as Arc<dyn ObjectStore>);
    let metrics = metered.metrics();
    let cache = tempfile::tempdir().unwrap();
    let fs = Fs::new(Arc::new(metered), tune(config(&cache)));
    Env {
        fs,
        mem,
        metrics,
        _cache: cache,
    }
}

pub fn random(n: usize, seed: u64) -> Vec<u8> {
    let mut r = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n).map(|_| r.gen()).collect()
}

/// Writes `data` at `at` of an open file in 1 MiB writes, as fio and cp do.
pub async fn write_mib(fs: &Fs, ino: u64, fh: u64, at: u64, data: &[u8]) {
    for (i, c) in data.chunks(MIB as usize).enumerate() {
        fs.write(ino, fh, at + i as u64 * MIB, Bytes::copy_from_slice(c))
            .await
            .unwrap();
    }
}

/// Creates `name` in the root (0644, opened with `flags`) and writes `data` in 1 MiB writes;
/// returns (ino, fh), still open.
pub async fn create_written(fs: &Fs, name: &str, flags: i32, data: &[u8]) -> (u64, u64) {
    let (a, h) = fs
        .create(ROOT_INO, OsStr::new(name), 0o644, 0, flags, ME)
        .await
        .unwrap();
    write_mib(fs, a.ino, h.fh, 0, data).await;
    (a.ino, h.fh)
}

/// The fs over a fault-injecting wrapper of `mem`, and its cache dir (keep it alive).
pub fn faulty_fs(mem: &Arc<MemoryStore>) -> (Arc<FaultStore>, Arc<Fs>, tempfile::TempDir) {
    faulty_fs_with(mem, |c| c)
}

/// [`faulty_fs`] with its configuration changed by `tune`.
pub fn faulty_fs_with(
    mem: &Arc<MemoryStore>,
    tune: impl FnOnce(FsConfig) -> FsConfig,
) -> (Arc<FaultStore>, Arc<Fs>, tempfile::TempDir) {
    let faulty = Arc::new(FaultStore::new(mem.clone()));
    let cache = tempfile::tempdir().unwrap();
    let fs = Fs::new(faulty.clone(), tune(config(&cache)));
    (faulty, fs, cache)
}

pub async fn object(mem: &MemoryStore, key: &str) -> Vec<u8> {
    let m = mem.head(key).await.unwrap();
    mem.get_range(key, 0..m.size, None).await.unwrap().to_vec()
}

pub async fn put(mem: &MemoryStore, key: &str, data: &[u8]) {
    mem.put(key, Bytes::copy_from_slice(data), &UserMeta::new())
        .await
        .unwrap();
}

/// Writes `data` as a new file `name` in the root in 1 MiB writes and closes it.
pub async fn write_file(fs: &Fs, name: &str, data: &[u8]) -> u64 {
    write_file_in(fs, ROOT_INO, name, data).await
}

/// [`write_file`] in directory `parent`.
pub async fn write_file_in(fs: &Fs, parent: u64, name: &str, data: &[u8]) -> u64 {
    let (attr, open) = fs
        .create(parent, OsStr::new(name), 0o644, 0o022, libc::O_WRONLY, ME)
        .await
        .unwrap();
    write_mib(fs, attr.ino, open.fh, 0, data).await;
    fs.flush(attr.ino, open.fh).await.unwrap();
    fs.release(attr.ino, open.fh).await.unwrap();
    attr.ino
}

pub async fn read_all(fs: &Fs, name: &str) -> Vec<u8> {
    let attr = fs.lookup(ROOT_INO, OsStr::new(name)).await.unwrap();
    let h = fs.open(attr.ino, libc::O_RDONLY).await.unwrap();
    let mut out = Vec::new();
    loop {
        let b = fs
            .read(attr.ino, h.fh, out.len() as u64, 128 * 1024)
            .await
            .unwrap();
        if b.is_empty() {
            break;
        }
        out.extend_from_slice(&b);
    }
    fs.release(attr.ino, h.fh).await.unwrap();
    fs.forget(attr.ino, 1);
    out
}

pub async fn list(fs: &Fs, ino: u64) -> Vec<String> {
    let fh = fs.opendir(ino).await.unwrap();
    let mut names = Vec::new();
    let mut off = 0;
    loop {
        let batch = fs.readdir(ino, fh, off).await.unwrap();
        let Some(last) = batch.last() else { break };
        off = last.next_offset;
        names.extend(batch.into_iter().map(|e| e.name));
    }
    fs.releasedir(ino, fh);
    names
}

pub fn counter(fs: &Fs, pick: fn(&bucketfs_fs::FsMetrics) -> &std::sync::atomic::AtomicU64) -> u64 {
    pick(&fs.metrics()).load(std::sync::atomic::Ordering::Relaxed)
}

/// Creates `name` O_RDWR and writes `data` in 1 MiB writes; returns (ino, fh), still open.
pub async fn write_open(fs: &Fs, name: &str, data: &[u8]) -> (u64, u64) {
    let (a, h) = fs
        .create(ROOT_INO, OsStr::new(name), 0o644, 0, libc::O_RDWR, ME)
        .await
        .unwrap();
    write_mib(fs, a.ino, h.fh, 0, data).await;
    (a.ino, h.fh)
}

/// The keys under the hidden directory of files unlinked while open.
pub fn hidden_keys(mem: &MemoryStore) -> Vec<String> {
    mem.keys()
        .into_iter()
        .filter(|k| k.starts_with(".bucketfs-unlinked/"))
        .collect()
}

/// A point in a store call where, once armed, the call waits until the test lets it go: the
/// test waits for it to be reached, acts meanwhile (another request of the mount, another
/// client), then opens it. For interleavings no ordinary call order gives.
pub struct Gate {
    armed: std::sync::atomic::AtomicBool,
    reached: tokio::sync::Notify,
    go: tokio::sync::Notify,
}

impl Gate {
    pub fn new(armed: bool) -> Self {
        Self {
            armed: armed.into(),
            reached: tokio::sync::Notify::new(),
            go: tokio::sync::Notify::new(),
        }
    }

    pub fn arm(&self) {
        self.armed.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// In the store call: waits here, once, if armed and `hit` (the call is the one wanted).
    pub async fn pass(&self, hit: bool) {
        if hit && self.armed.swap(false, std::sync::atomic::Ordering::SeqCst) {
            let go = self.go.notified();
            self.reached.notify_one();
            go.await;
        }
    }

    /// In the test: returns once a call waits at the gate.
    pub async fn reached(&self) {
        self.reached.notified().await
    }

    /// Lets the waiting call go on.
    pub fn open(&self) {
        self.go.notify_one();
    }
}

/// Holds the answer of a COPY of `key` at its gate: the copy has landed in the store, the
/// mount does not know it yet.
pub struct HoldsCopyAnswer {
    pub inner: Arc<MemoryStore>,
    pub key: String,
    pub gate: Gate,
}

#[async_trait::async_trait]
impl bucketfs_store::layer::StoreLayer for HoldsCopyAnswer {
    type Inner = MemoryStore;
    fn inner(&self) -> &MemoryStore {
        &self.inner
    }
    async fn copy(
        &self,
        src_key: &str,
        dst_key: &str,
        meta: Option<&bucketfs_store::UserMeta>,
        src_if_match: Option<&str>,
    ) -> bucketfs_store::StoreResult<String> {
        let r = self.inner.copy(src_key, dst_key, meta, src_if_match).await;
        self.gate.pass(dst_key == self.key).await;
        r
    }
}
