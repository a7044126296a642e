//! The fs core driven in-process against the memory store (and the fault store for errors).

use bucketfs_fs::{Appended, Caller, FileKind, Fs, FsConfig, FsError, SetAttr, ROOT_INO};
use bucketfs_store::fault::{Fault, FaultStore};
use bucketfs_store::memory::MemoryStore;
use bucketfs_store::metrics::{MeteredStore, Op, StoreMetrics};
use bucketfs_store::{ObjectStore, StoreError, UserMeta};
use bytes::Bytes;
use rand::{Rng, SeedableRng};
use std::ffi::OsStr;
use std::sync::Arc;
use std::time::Duration;

const MIB: u64 = 1024 * 1024;
const ME: Caller = Caller {
    uid: 1000,
    gid: 100,
};

struct Env {
    fs: Arc<Fs>,
    mem: Arc<MemoryStore>,
    metrics: Arc<StoreMetrics>,
    _cache: tempfile::TempDir,
}

fn config(cache: &tempfile::TempDir) -> FsConfig {
    FsConfig {
        part_size: 5 * MIB,
        cache_dir: cache.path().to_path_buf(),
        ..FsConfig::default()
    }
}

fn env() -> Env {
    env_on(MemoryStore::new())
}

fn env_on(mem: MemoryStore) -> Env {
    let mem = Arc::new(mem);
    let metered = MeteredStore::new(mem.clone() as Arc<dyn ObjectStore>);
    let metrics = metered.metrics();
    let cache = tempfile::tempdir().unwrap();
    let fs = Fs::new(Arc::new(metered), config(&cache));
    Env {
        fs,
        mem,
        metrics,
        _cache: cache,
    }
}

fn random(n: usize, seed: u64) -> Vec<u8> {
    let mut r = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n).map(|_| r.gen()).collect()
}

/// Writes `data` at `at` of an open file in 1 MiB writes, as fio and cp do.
async fn write_mib(fs: &Fs, ino: u64, fh: u64, at: u64, data: &[u8]) {
    for (i, c) in data.chunks(MIB as usize).enumerate() {
        fs.write(ino, fh, at + i as u64 * MIB, Bytes::copy_from_slice(c))
            .await
            .unwrap();
    }
}

/// `ftruncate` of open file `ino` to `size`.
async fn set_size(fs: &Fs, ino: u64, fh: u64, size: u64) {
    let set = SetAttr {
        size: Some(size),
        ..SetAttr::default()
    };
    fs.setattr(ino, Some(fh), set).await.unwrap();
}

/// The fs over a fault-injecting wrapper of `mem`, and its cache dir (keep it alive).
fn faulty_fs(mem: &Arc<MemoryStore>) -> (Arc<FaultStore>, Arc<Fs>, tempfile::TempDir) {
    let faulty = Arc::new(FaultStore::new(mem.clone()));
    let cache = tempfile::tempdir().unwrap();
    let fs = Fs::new(faulty.clone(), config(&cache));
    (faulty, fs, cache)
}

async fn object(mem: &MemoryStore, key: &str) -> Vec<u8> {
    let m = mem.head(key).await.unwrap();
    mem.get_range(key, 0..m.size, None).await.unwrap().to_vec()
}

async fn put(mem: &MemoryStore, key: &str, data: &[u8]) {
    mem.put(key, Bytes::copy_from_slice(data), &UserMeta::new())
        .await
        .unwrap();
}

/// Writes `data` as a new file `name` in the root in 1 MiB writes and closes it.
async fn write_file(fs: &Fs, name: &str, data: &[u8]) -> u64 {
    let (attr, open) = fs
        .create(ROOT_INO, OsStr::new(name), 0o644, 0o022, libc::O_WRONLY, ME)
        .await
        .unwrap();
    write_mib(fs, attr.ino, open.fh, 0, data).await;
    fs.flush(attr.ino, open.fh).await.unwrap();
    fs.release(attr.ino, open.fh).await.unwrap();
    attr.ino
}

async fn read_all(fs: &Fs, name: &str) -> Vec<u8> {
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

#[tokio::test]
async fn small_file_is_one_put_with_s3fs_metadata() {
    let e = env();
    let data = random(128 * 1024, 1);
    write_file(&e.fs, "a.bin", &data).await;
    assert_eq!(e.metrics.requests(Op::Put), 1);
    assert_eq!(e.metrics.requests(Op::CreateMultipart), 0);
    assert_eq!(object(&e.mem, "a.bin").await, data);
    let m = e.mem.head("a.bin").await.unwrap();
    assert_eq!(m.user["mode"], (libc::S_IFREG | 0o644).to_string());
    assert_eq!(m.user["uid"], "1000");
    assert_eq!(m.user["gid"], "100");
    assert!(m.user["mtime"].parse::<f64>().unwrap() > 1.6e9);
    assert_eq!(read_all(&e.fs, "a.bin").await, data);
}

#[tokio::test]
async fn empty_file_is_published() {
    let e = env();
    write_file(&e.fs, "empty", &[]).await;
    assert_eq!(object(&e.mem, "empty").await, Vec::<u8>::new());
}

#[tokio::test]
async fn sequential_write_streams_parts_before_close() {
    let e = env();
    let data = random(23 * MIB as usize + 7, 2);
    let (attr, open) =
        e.fs.create(ROOT_INO, OsStr::new("big"), 0o644, 0, libc::O_WRONLY, ME)
            .await
            .unwrap();
    write_mib(&e.fs, attr.ino, open.fh, 0, &data).await;
    // Four full 5 MiB parts went up while writing; nothing is visible yet.
    assert_eq!(e.mem.pending_uploads(), 1);
    assert!(e.mem.head("big").await.is_err());
    e.fs.flush(attr.ino, open.fh).await.unwrap();
    e.fs.release(attr.ino, open.fh).await.unwrap();
    assert_eq!(e.metrics.requests(Op::UploadPart), 5);
    assert_eq!(e.mem.pending_uploads(), 0);
    assert_eq!(object(&e.mem, "big").await, data);
    assert_eq!(read_all(&e.fs, "big").await, data);
    // Every byte was sent exactly once.
    assert_eq!(e.metrics.bytes_up(), data.len() as u64);
}

#[tokio::test]
async fn writes_done_in_the_calling_thread_stream_like_the_others() {
    let e = env();
    let data = random(23 * MIB as usize + 7, 5);
    let (attr, open) =
        e.fs.create(ROOT_INO, OsStr::new("big"), 0o644, 0, libc::O_WRONLY, ME)
            .await
            .unwrap();
    // 1 MiB writes, except one odd-sized pair around the second part boundary, which the
    // calling thread cannot take (it crosses the part's end) and the async path then does.
    let mut cuts: Vec<usize> = (0..=23).map(|m| m * MIB as usize).collect();
    cuts.retain(|&c| c != 10 * MIB as usize);
    cuts.push(10 * MIB as usize + 4096);
    cuts.push(data.len());
    cuts.sort();
    let (mut now, mut full, mut later) = (0, 0, 0);
    for w in cuts.windows(2) {
        let chunk = &data[w[0]..w[1]];
        match e.fs.write_now(attr.ino, open.fh, w[0] as u64, chunk) {
            Some(Appended::Yes) => now += 1,
            Some(Appended::PartFull) => {
                full += 1;
                e.fs.ship_part(attr.ino, open.fh).await.unwrap();
            }
            Some(Appended::No) => unreachable!("write_now answers None instead"),
            None => {
                later += 1;
                e.fs.write(
                    attr.ino,
                    open.fh,
                    w[0] as u64,
                    Bytes::copy_from_slice(chunk),
                )
                .await
                .unwrap();
            }
        }
    }
    // Parts 1, 3 and 4 were filled in the calling thread; part 2's boundary write was not.
    assert_eq!(full, 3);
    assert_eq!(later, 1);
    assert_eq!(now + full + later, cuts.len() - 1);
    assert_eq!(e.mem.pending_uploads(), 1);
    assert!(e.mem.head("big").await.is_err());
    e.fs.flush(attr.ino, open.fh).await.unwrap();
    e.fs.release(attr.ino, open.fh).await.unwrap();
    assert_eq!(object(&e.mem, "big").await, data);
    assert_eq!(e.metrics.requests(Op::UploadPart), 5);
    // Every byte was sent exactly once: no part went through the staging file again.
    assert_eq!(e.metrics.bytes_up(), data.len() as u64);
}

#[tokio::test]
async fn fsync_with_nothing_to_upload_is_answered_at_once() {
    let e = env();
    put(&e.mem, "ro", b"old").await;
    let ro = e.fs.lookup(ROOT_INO, OsStr::new("ro")).await.unwrap();
    let h = e.fs.open(ro.ino, libc::O_RDONLY).await.unwrap();
    assert!(matches!(e.fs.publish_now(ro.ino, h.fh), Some(Ok(()))));
    assert!(matches!(
        e.fs.publish_now(ro.ino, h.fh + 1000),
        Some(Err(FsError::EBADF))
    ));

    // A new file must reach the store at its first flush, even empty: not answered here.
    let (attr, open) =
        e.fs.create(ROOT_INO, OsStr::new("w"), 0o644, 0, libc::O_WRONLY, ME)
            .await
            .unwrap();
    assert!(e.fs.publish_now(attr.ino, open.fh).is_none());
    e.fs.fsync(attr.ino, open.fh).await.unwrap();
    assert!(matches!(e.fs.publish_now(attr.ino, open.fh), Some(Ok(()))));
    // A write makes it dirty again; once published, clean again with no further request.
    e.fs.write(attr.ino, open.fh, 0, Bytes::from_static(b"new"))
        .await
        .unwrap();
    assert!(e.fs.publish_now(attr.ino, open.fh).is_none());
    e.fs.fsync(attr.ino, open.fh).await.unwrap();
    let puts = e.metrics.requests(Op::Put);
    assert!(matches!(e.fs.publish_now(attr.ino, open.fh), Some(Ok(()))));
    e.fs.flush(attr.ino, open.fh).await.unwrap();
    assert_eq!(e.metrics.requests(Op::Put), puts);
    assert_eq!(object(&e.mem, "w").await, b"new");
}

#[tokio::test]
async fn truncate_to_the_same_size_sends_nothing() {
    let e = env();
    let data = random(11 * MIB as usize, 6);
    put(&e.mem, "same", &data).await;
    let attr = e.fs.lookup(ROOT_INO, OsStr::new("same")).await.unwrap();
    let h = e.fs.open(attr.ino, libc::O_WRONLY).await.unwrap();
    let before = e.metrics.total_requests();
    let size = |n| SetAttr {
        size: Some(n),
        ..Default::default()
    };
    e.fs.setattr(attr.ino, Some(h.fh), size(data.len() as u64))
        .await
        .unwrap();
    e.fs.flush(attr.ino, h.fh).await.unwrap();
    e.fs.release(attr.ino, h.fh).await.unwrap();
    // Re-publishing would have copied all three parts server-side.
    assert_eq!(e.metrics.total_requests(), before);
    // truncate(2) by path to the same size, with a chmod: only the metadata changes.
    let a =
        e.fs.setattr(
            attr.ino,
            None,
            SetAttr {
                mode: Some(0o600),
                ..size(data.len() as u64)
            },
        )
        .await
        .unwrap();
    assert_eq!(a.perm & 0o777, 0o600);
    let m = e.mem.head("same").await.unwrap();
    assert_eq!(m.user["mode"], (libc::S_IFREG | 0o600).to_string());
    assert_eq!(object(&e.mem, "same").await, data);
}

#[tokio::test]
async fn append_to_large_object_copies_unchanged_parts() {
    let e = env();
    let mut data = random(21 * MIB as usize, 3);
    put(&e.mem, "log", &data).await;
    let attr = e.fs.lookup(ROOT_INO, OsStr::new("log")).await.unwrap();
    let h =
        e.fs.open(attr.ino, libc::O_WRONLY | libc::O_APPEND)
            .await
            .unwrap();
    let tail = random(1024, 4);
    e.fs.write(attr.ino, h.fh, 0, Bytes::copy_from_slice(&tail))
        .await
        .unwrap();
    let up_before = e.metrics.bytes_up();
    e.fs.flush(attr.ino, h.fh).await.unwrap();
    e.fs.release(attr.ino, h.fh).await.unwrap();
    data.extend_from_slice(&tail);
    assert_eq!(object(&e.mem, "log").await, data);
    // Parts 1-4 copied server-side; only the last 1 MiB + 1 KiB part was sent.
    assert_eq!(e.metrics.requests(Op::UploadPartCopy), 4);
    assert!(e.metrics.bytes_up() - up_before < 2 * MIB);
}

#[tokio::test]
async fn random_writes_and_truncates_match_a_model() {
    let e = env();
    let mut model = random(12 * MIB as usize, 5);
    put(&e.mem, "f", &model).await;
    let attr = e.fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    let h = e.fs.open(attr.ino, libc::O_RDWR).await.unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(6);
    for step in 0..40 {
        if step % 7 == 3 {
            let n = rng.gen_range(0..16 * MIB as usize);
            model.resize(n, 0);
            e.fs.setattr(
                attr.ino,
                Some(h.fh),
                SetAttr {
                    size: Some(n as u64),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        } else {
            let off = rng.gen_range(0..14 * MIB as usize);
            let len = rng.gen_range(1..300_000);
            let buf = random(len, step);
            if model.len() < off + len {
                model.resize(off + len, 0);
            }
            model[off..off + len].copy_from_slice(&buf);
            e.fs.write(attr.ino, h.fh, off as u64, Bytes::from(buf))
                .await
                .unwrap();
        }
        if step % 10 == 9 {
            // Reads through the handle see staged and clean bytes together.
            let off = rng.gen_range(0..model.len().max(1));
            let got =
                e.fs.read(attr.ino, h.fh, off as u64, 200_000)
                    .await
                    .unwrap();
            let end = (off + 200_000).min(model.len());
            assert_eq!(&got[..], &model[off.min(end)..end]);
            e.fs.fsync(attr.ino, h.fh).await.unwrap();
            assert_eq!(object(&e.mem, "f").await, model);
        }
    }
    e.fs.flush(attr.ino, h.fh).await.unwrap();
    e.fs.release(attr.ino, h.fh).await.unwrap();
    assert_eq!(object(&e.mem, "f").await, model);
    assert_eq!(e.mem.pending_uploads(), 0);
}

#[tokio::test]
async fn truncate_by_path_publishes_at_once() {
    let e = env();
    put(&e.mem, "t", b"hello world").await;
    let attr = e.fs.lookup(ROOT_INO, OsStr::new("t")).await.unwrap();
    let a =
        e.fs.setattr(
            attr.ino,
            None,
            SetAttr {
                size: Some(5),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(a.size, 5);
    assert_eq!(object(&e.mem, "t").await, b"hello");
}

#[tokio::test]
async fn directories_markers_and_implied_prefixes() {
    let e = env();
    put(&e.mem, "implied/x/y.txt", b"y").await;
    put(&e.mem, "top.txt", b"top").await;
    let d =
        e.fs.mkdir(ROOT_INO, OsStr::new("made"), 0o750, 0, ME)
            .await
            .unwrap();
    assert_eq!(d.kind, FileKind::Dir);
    // The marker goes up in the background; fsync of the parent waits for it.
    e.fs.fsyncdir(ROOT_INO).await.unwrap();
    let m = e.mem.head("made/").await.unwrap();
    assert_eq!(m.user["mode"], (libc::S_IFDIR | 0o750).to_string());
    let (f, h) =
        e.fs.create(d.ino, OsStr::new("new"), 0o600, 0, libc::O_WRONLY, ME)
            .await
            .unwrap();
    // Not uploaded yet, but listed.
    let names = list(&e.fs, d.ino).await;
    assert_eq!(names, [".", "..", "new"]);
    assert_eq!(
        e.fs.rmdir(ROOT_INO, OsStr::new("made")).await,
        Err(FsError::ENOTEMPTY)
    );
    e.fs.flush(f.ino, h.fh).await.unwrap();
    e.fs.release(f.ino, h.fh).await.unwrap();
    assert!(e.mem.head("made/new").await.is_ok());

    let root = list(&e.fs, ROOT_INO).await;
    assert_eq!(root, [".", "..", "implied", "made", "top.txt"]);
    let i = e.fs.lookup(ROOT_INO, OsStr::new("implied")).await.unwrap();
    assert_eq!(i.kind, FileKind::Dir);
    let x = e.fs.lookup(i.ino, OsStr::new("x")).await.unwrap();
    let y = e.fs.lookup(x.ino, OsStr::new("y.txt")).await.unwrap();
    assert_eq!((y.kind, y.size), (FileKind::File, 1));

    e.fs.unlink(d.ino, OsStr::new("new")).await.unwrap();
    e.fs.rmdir(ROOT_INO, OsStr::new("made")).await.unwrap();
    assert!(e.mem.keys().iter().all(|k| !k.starts_with("made")));
    assert_eq!(
        e.fs.lookup(ROOT_INO, OsStr::new("made")).await,
        Err(FsError::ENOENT)
    );
}

async fn list(fs: &Fs, ino: u64) -> Vec<String> {
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

#[tokio::test]
async fn rename_file_and_directory() {
    let e = env();
    put(&e.mem, "d/a", b"a").await;
    put(&e.mem, "d/sub/b", b"b").await;
    put(&e.mem, "f", b"file").await;
    put(&e.mem, "g", b"old").await;
    e.fs.rename(ROOT_INO, OsStr::new("f"), ROOT_INO, OsStr::new("g"), 0)
        .await
        .unwrap();
    assert_eq!(object(&e.mem, "g").await, b"file");
    assert!(e.mem.head("f").await.is_err());
    let d = e.fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    e.fs.rename(ROOT_INO, OsStr::new("d"), ROOT_INO, OsStr::new("e"), 0)
        .await
        .unwrap();
    let keys = e.mem.keys();
    assert!(keys.contains(&"e/a".to_string()) && keys.contains(&"e/sub/b".to_string()));
    assert!(keys.iter().all(|k| !k.starts_with("d/")));
    // The inode the kernel holds now names the new path.
    let sub = e.fs.lookup(d.ino, OsStr::new("sub")).await.unwrap();
    let b = e.fs.lookup(sub.ino, OsStr::new("b")).await.unwrap();
    assert_eq!(b.size, 1);
    assert_eq!(
        e.fs.rename(ROOT_INO, OsStr::new("g"), ROOT_INO, OsStr::new("e"), 0)
            .await,
        Err(FsError::EISDIR)
    );
    assert_eq!(
        e.fs.rename(
            ROOT_INO,
            OsStr::new("e"),
            ROOT_INO,
            OsStr::new("g"),
            libc::RENAME_NOREPLACE
        )
        .await,
        Err(FsError::EEXIST)
    );
}

#[tokio::test]
async fn directory_rename_limit_gives_exdev() {
    let mem = Arc::new(MemoryStore::new());
    let cache = tempfile::tempdir().unwrap();
    let fs = Fs::new(
        mem.clone(),
        FsConfig {
            max_dir_rename_objects: 3,
            ..config(&cache)
        },
    );
    for i in 0..5 {
        put(&mem, &format!("big/{i}"), b"x").await;
    }
    assert_eq!(
        fs.rename(ROOT_INO, OsStr::new("big"), ROOT_INO, OsStr::new("b2"), 0)
            .await,
        Err(FsError::EXDEV)
    );
    assert_eq!(mem.keys().len(), 5);
}

#[tokio::test]
async fn symlink_is_stored_like_s3fs() {
    let e = env();
    let a =
        e.fs.symlink(
            ROOT_INO,
            OsStr::new("ln"),
            std::path::Path::new("../target"),
            ME,
        )
        .await
        .unwrap();
    assert_eq!(a.kind, FileKind::Symlink);
    assert_eq!(object(&e.mem, "ln").await, b"../target");
    let m = e.mem.head("ln").await.unwrap();
    assert_eq!(m.user["mode"], (libc::S_IFLNK | 0o777).to_string());
    // A fresh mount reads it back from the store.
    let cache = tempfile::tempdir().unwrap();
    let fs2 = Fs::new(e.mem.clone(), config(&cache));
    let l = fs2.lookup(ROOT_INO, OsStr::new("ln")).await.unwrap();
    assert_eq!(l.kind, FileKind::Symlink);
    assert_eq!(&fs2.readlink(l.ino).await.unwrap()[..], b"../target");
}

#[tokio::test]
async fn chmod_chown_utimens_persist_in_metadata() {
    let e = env();
    put(&e.mem, "m", b"data").await;
    let a = e.fs.lookup(ROOT_INO, OsStr::new("m")).await.unwrap();
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000_000);
    let a =
        e.fs.setattr(
            a.ino,
            None,
            SetAttr {
                mode: Some(0o751),
                uid: Some(42),
                gid: Some(43),
                mtime: Some(t),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!((a.perm, a.uid, a.gid, a.mtime), (0o751, 42, 43, t));
    let m = e.mem.head("m").await.unwrap();
    assert_eq!(m.user["mode"], (libc::S_IFREG | 0o751).to_string());
    assert_eq!(m.user["mtime"], "1000000000");
    assert_eq!(object(&e.mem, "m").await, b"data");
    let cache = tempfile::tempdir().unwrap();
    let fs2 = Fs::new(e.mem.clone(), config(&cache));
    let b = fs2.lookup(ROOT_INO, OsStr::new("m")).await.unwrap();
    assert_eq!((b.perm, b.uid, b.gid, b.mtime), (0o751, 42, 43, t));
}

/// mkdir answers before its marker is stored; whatever needs the marker waits for it, and a
/// marker that could not be stored is reported (EIO) and sent again, never lost silently.
#[tokio::test]
async fn directory_markers_go_up_in_the_background_and_failures_are_reported() {
    let mem = Arc::new(MemoryStore::new());
    let (faulty, fs, _cache) = faulty_fs(&mem);
    let slow = std::time::Duration::from_millis(300);
    faulty.inject(Op::Put, 0, Some(1), Fault::Delay(slow));
    let t0 = std::time::Instant::now();
    let a = fs
        .mkdir(ROOT_INO, OsStr::new("a"), 0o755, 0, ME)
        .await
        .unwrap();
    assert!(t0.elapsed() < slow, "mkdir waited for its marker");
    assert!(mem.head("a/").await.is_err(), "not up yet");
    // A listing of the parent shows it from the bucket: it waits for the marker.
    let fh = fs.opendir(ROOT_INO).await.unwrap();
    let names: Vec<String> = fs
        .readdir(ROOT_INO, fh, 0)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert!(names.contains(&"a".to_string()), "{names:?}");
    assert!(mem.head("a/").await.is_ok());

    // A marker that cannot be stored: mkdir still succeeds, fsync of the parent says EIO.
    let down = || Fault::Error(StoreError::Transient("connection refused".into()));
    faulty.inject(Op::Put, 0, Some(2), down());
    let b = fs
        .mkdir(a.ino, OsStr::new("b"), 0o700, 0, ME)
        .await
        .unwrap();
    assert_eq!(fs.fsyncdir(a.ino).await, Err(FsError::EIO));
    // The next fsync sends it again (the second injected failure), and then once the store is
    // back it lands, with its mode.
    assert_eq!(fs.fsyncdir(a.ino).await, Err(FsError::EIO));
    fs.fsyncdir(a.ino).await.unwrap();
    let m = mem.head("a/b/").await.unwrap();
    assert_eq!(m.user["mode"], (libc::S_IFDIR | 0o700).to_string());

    // rmdir of a directory whose marker is still in flight: the DELETE comes after the PUT,
    // so no marker is left behind.
    faulty.inject(Op::Put, 0, Some(1), Fault::Delay(slow));
    fs.mkdir(b.ino, OsStr::new("c"), 0o755, 0, ME)
        .await
        .unwrap();
    fs.rmdir(b.ino, OsStr::new("c")).await.unwrap();
    tokio::time::sleep(slow).await;
    assert!(mem.head("a/b/c/").await.is_err(), "marker resurrected");

    // A directory whose new subdirectory's marker is still in flight is not empty.
    faulty.inject(Op::Put, 0, Some(2), Fault::Delay(slow));
    let e = fs
        .mkdir(b.ino, OsStr::new("e"), 0o755, 0, ME)
        .await
        .unwrap();
    fs.mkdir(e.ino, OsStr::new("sub"), 0o755, 0, ME)
        .await
        .unwrap();
    assert_eq!(
        fs.rmdir(b.ino, OsStr::new("e")).await,
        Err(FsError::ENOTEMPTY)
    );

    // Unmount (shutdown) stores every marker still pending.
    faulty.inject(Op::Put, 0, Some(1), Fault::Delay(slow));
    fs.mkdir(b.ino, OsStr::new("d"), 0o755, 0, ME)
        .await
        .unwrap();
    assert_eq!(fs.shutdown().await, 0);
    assert!(mem.head("a/b/d/").await.is_ok());
}

#[tokio::test]
async fn failed_upload_is_reported_and_leaves_nothing() {
    let mem = Arc::new(MemoryStore::new());
    let (faulty, fs, _cache) = faulty_fs(&mem);
    faulty.inject(
        Op::UploadPart,
        2,
        None,
        Fault::Error(StoreError::Transient("connection reset".into())),
    );
    let data = random(20 * MIB as usize, 9);
    let (attr, h) = fs
        .create(ROOT_INO, OsStr::new("doomed"), 0o644, 0, libc::O_WRONLY, ME)
        .await
        .unwrap();
    write_mib(&fs, attr.ino, h.fh, 0, &data).await;
    assert_eq!(fs.flush(attr.ino, h.fh).await, Err(FsError::EIO));
    fs.release(attr.ino, h.fh).await.unwrap();
    assert!(mem.head("doomed").await.is_err());
    // The file never reached the bucket, so it does not exist.
    faulty.clear();
    assert_eq!(
        fs.lookup(ROOT_INO, OsStr::new("doomed")).await,
        Err(FsError::ENOENT)
    );
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    assert_eq!(mem.pending_uploads(), 0);
}

/// A publish whose part fails while other parts are being sent: those are waited for, not
/// dropped, before the upload is aborted (a dropped part the server already has may be
/// stored after the abort, and kept: MinIO then lists the upload again).
#[tokio::test]
async fn a_failed_publish_aborts_only_after_its_running_parts_return() {
    let mem = Arc::new(MemoryStore::new());
    let (faulty, fs, _cache) = faulty_fs(&mem);
    let (attr, h) = fs
        .create(ROOT_INO, OsStr::new("sparse"), 0o644, 0, libc::O_WRONLY, ME)
        .await
        .unwrap();
    // Extended, not written: nothing streams, all 8 parts go at publish, 8 at a time.
    let size = 40 * MIB;
    set_size(&fs, attr.ino, h.fh, size).await;
    faulty.inject(
        Op::UploadPart,
        2,
        Some(1),
        Fault::Error(StoreError::Transient("connection reset".into())),
    );
    faulty.inject(
        Op::UploadPart,
        0,
        None,
        Fault::Delay(Duration::from_millis(300)),
    );
    assert_eq!(fs.flush(attr.ino, h.fh).await, Err(FsError::EIO));
    // The failing third request and the two before it, still in their delay.
    assert!(faulty.parts_started() >= 3, "{}", faulty.parts_started());
    assert_eq!(faulty.parts_cancelled(), 0, "part requests dropped");
    assert_eq!(
        faulty.aborts_racing_parts(),
        0,
        "abort sent with parts running"
    );
    assert_eq!(mem.pending_uploads(), 0);
    fs.release(attr.ino, h.fh).await.unwrap();
}

/// An upload given up while parts of it are on their way (the file shrank below a part and
/// goes up in one PUT) is aborted after they return.
#[tokio::test]
async fn an_abandoned_upload_is_aborted_only_after_its_running_parts_return() {
    let mem = Arc::new(MemoryStore::new());
    let (faulty, fs, _cache) = faulty_fs(&mem);
    faulty.inject(
        Op::UploadPart,
        0,
        None,
        Fault::Delay(Duration::from_millis(300)),
    );
    let data = random(7 * MIB as usize, 31);
    let (attr, h) = fs
        .create(ROOT_INO, OsStr::new("shrunk"), 0o644, 0, libc::O_WRONLY, ME)
        .await
        .unwrap();
    // The first 5 MiB part is on its way when the file is cut to 1 MiB and closed.
    write_mib(&fs, attr.ino, h.fh, 0, &data).await;
    set_size(&fs, attr.ino, h.fh, MIB).await;
    fs.flush(attr.ino, h.fh).await.unwrap();
    fs.release(attr.ino, h.fh).await.unwrap();
    assert_eq!(
        faulty.parts_started(),
        1,
        "the first part was not on its way"
    );
    assert_eq!(faulty.parts_cancelled(), 0, "part requests dropped");
    assert_eq!(
        faulty.aborts_racing_parts(),
        0,
        "abort sent with parts running"
    );
    assert_eq!(mem.pending_uploads(), 0);
    assert_eq!(object(&mem, "shrunk").await, &data[..MIB as usize]);
}

/// A streamed part whose upload fails once is sent again at close: the first part from its
/// staged copy, a later part (no local copy) from the bytes its failed upload handed back.
#[tokio::test]
async fn transient_part_failure_is_resent_at_close() {
    for part in [0, 2] {
        let mem = Arc::new(MemoryStore::new());
        let (faulty, fs, _cache) = faulty_fs(&mem);
        faulty.inject(
            Op::UploadPart,
            part,
            Some(1),
            Fault::Error(StoreError::Transient("503".into())),
        );
        let data = random(23 * MIB as usize, 10 + part);
        write_file(&fs, "ok", &data).await;
        assert_eq!(object(&mem, "ok").await, data, "part {part}");
        assert_eq!(mem.pending_uploads(), 0);
    }
}

/// An unlink whose DeleteObject fails changes nothing: the file open for writing keeps its
/// name and what was written since its last publish goes up at close.
#[tokio::test]
async fn a_failed_unlink_of_a_file_being_written_loses_nothing() {
    let mem = Arc::new(MemoryStore::new());
    let (faulty, fs, _cache) = faulty_fs(&mem);
    let (attr, h) = fs
        .create(ROOT_INO, OsStr::new("log"), 0o644, 0, libc::O_RDWR, ME)
        .await
        .unwrap();
    fs.write(attr.ino, h.fh, 0, Bytes::from_static(b"first "))
        .await
        .unwrap();
    fs.fsync(attr.ino, h.fh).await.unwrap();
    // Rewritten from the start: nothing of the object is needed any more, so the unlink
    // deletes it rather than keeping a copy for the descriptor.
    set_size(&fs, attr.ino, h.fh, 0).await;
    fs.write(attr.ino, h.fh, 0, Bytes::from_static(b"second"))
        .await
        .unwrap();
    faulty.inject(
        Op::Delete,
        0,
        Some(1),
        Fault::Error(StoreError::Transient("connection reset".into())),
    );
    assert_eq!(
        fs.unlink(ROOT_INO, OsStr::new("log")).await,
        Err(FsError::EIO)
    );
    fs.flush(attr.ino, h.fh).await.unwrap();
    fs.release(attr.ino, h.fh).await.unwrap();
    assert_eq!(object(&mem, "log").await, b"second");
    assert!(fs.lookup(ROOT_INO, OsStr::new("log")).await.is_ok());
}

#[tokio::test]
async fn unlinked_open_file_is_not_resurrected_at_close() {
    let e = env();
    let (attr, h) =
        e.fs.create(ROOT_INO, OsStr::new("tmp"), 0o644, 0, libc::O_RDWR, ME)
            .await
            .unwrap();
    e.fs.write(attr.ino, h.fh, 0, Bytes::from_static(b"scratch"))
        .await
        .unwrap();
    e.fs.unlink(ROOT_INO, OsStr::new("tmp")).await.unwrap();
    // Still readable through the open descriptor.
    assert_eq!(
        &e.fs.read(attr.ino, h.fh, 0, 100).await.unwrap()[..],
        b"scratch"
    );
    e.fs.flush(attr.ino, h.fh).await.unwrap();
    e.fs.release(attr.ino, h.fh).await.unwrap();
    assert!(e.mem.keys().is_empty());
}

#[tokio::test]
async fn forget_drops_inodes() {
    let e = env();
    put(&e.mem, "a", b"1").await;
    let base = e.fs.inode_count();
    let a = e.fs.lookup(ROOT_INO, OsStr::new("a")).await.unwrap();
    e.fs.lookup(ROOT_INO, OsStr::new("a")).await.unwrap();
    assert_eq!(e.fs.inode_count(), base + 1);
    e.fs.forget(a.ino, 1);
    assert_eq!(e.fs.inode_count(), base + 1);
    e.fs.forget(a.ino, 1);
    assert_eq!(e.fs.inode_count(), base);
}

#[tokio::test]
async fn prefix_mount_sees_only_its_prefix() {
    let mem = Arc::new(MemoryStore::new());
    put(&mem, "outside", b"o").await;
    put(&mem, "p/q/inside", b"i").await;
    let cache = tempfile::tempdir().unwrap();
    let fs = Fs::new(
        mem.clone(),
        FsConfig {
            prefix: "p/q/".into(),
            ..config(&cache)
        },
    );
    assert_eq!(list(&fs, ROOT_INO).await, [".", "..", "inside"]);
    write_file(&fs, "new", b"n").await;
    assert!(mem.head("p/q/new").await.is_ok());
}

#[tokio::test]
async fn read_only_refuses_changes() {
    let mem = Arc::new(MemoryStore::new());
    put(&mem, "a", b"1").await;
    let cache = tempfile::tempdir().unwrap();
    let fs = Fs::new(
        mem.clone(),
        FsConfig {
            read_only: true,
            ..config(&cache)
        },
    );
    let a = fs.lookup(ROOT_INO, OsStr::new("a")).await.unwrap();
    assert_eq!(
        fs.open(a.ino, libc::O_WRONLY).await.err(),
        Some(FsError::EROFS)
    );
    assert_eq!(
        fs.mkdir(ROOT_INO, OsStr::new("d"), 0o755, 0, ME).await,
        Err(FsError::EROFS)
    );
    assert_eq!(
        fs.unlink(ROOT_INO, OsStr::new("a")).await,
        Err(FsError::EROFS)
    );
}

#[tokio::test]
async fn names_over_255_bytes_are_refused() {
    let e = env();
    let long = "n".repeat(256);
    assert_eq!(
        e.fs.lookup(ROOT_INO, OsStr::new(&long)).await,
        Err(FsError::ENAMETOOLONG)
    );
    let ok = "n".repeat(255);
    write_file(&e.fs, &ok, b"x").await;
    assert_eq!(read_all(&e.fs, &ok).await, b"x");
}

#[tokio::test]
async fn broken_read_is_retried_from_the_same_offset() {
    let mem = Arc::new(MemoryStore::new());
    let data = random(3 * MIB as usize, 11);
    put(&mem, "r", &data).await;
    let (faulty, fs, _cache) = faulty_fs(&mem);
    faulty.inject(Op::Get, 1, Some(2), Fault::DropAfter);
    assert_eq!(read_all(&fs, "r").await, data);
}

#[tokio::test]
async fn abort_that_fails_is_retried_at_shutdown() {
    let mem = Arc::new(MemoryStore::new());
    let (faulty, fs, _cache) = faulty_fs(&mem);
    let down = || Fault::Error(StoreError::Transient("connection refused".into()));
    faulty.inject(Op::UploadPart, 1, None, down());
    faulty.inject(Op::AbortMultipart, 0, None, down());
    let data = random(12 * MIB as usize, 12);
    let (attr, h) = fs
        .create(ROOT_INO, OsStr::new("x"), 0o644, 0, libc::O_WRONLY, ME)
        .await
        .unwrap();
    write_mib(&fs, attr.ino, h.fh, 0, &data).await;
    assert_eq!(fs.flush(attr.ino, h.fh).await, Err(FsError::EIO));
    fs.release(attr.ino, h.fh).await.unwrap();
    assert_eq!(mem.pending_uploads(), 1);
    assert_eq!(fs.pending_aborts(), 1);
    // The store comes back; shutdown cleans up.
    faulty.clear();
    fs.shutdown().await;
    assert_eq!(mem.pending_uploads(), 0);
    assert!(mem.head("x").await.is_err());
}

#[tokio::test]
async fn directory_rename_on_the_local_store_leaves_no_old_directory() {
    let root = tempfile::tempdir().unwrap();
    let local = Arc::new(bucketfs_store::local::LocalStore::open(root.path()).unwrap());
    let cache = tempfile::tempdir().unwrap();
    let fs = Fs::new(local, config(&cache));
    let d = fs
        .mkdir(ROOT_INO, OsStr::new("d"), 0o755, 0, ME)
        .await
        .unwrap();
    let e = fs
        .mkdir(d.ino, OsStr::new("e"), 0o755, 0, ME)
        .await
        .unwrap();
    let (f, h) = fs
        .create(e.ino, OsStr::new("f"), 0o644, 0, libc::O_WRONLY, ME)
        .await
        .unwrap();
    fs.write(f.ino, h.fh, 0, Bytes::from_static(b"content"))
        .await
        .unwrap();
    fs.flush(f.ino, h.fh).await.unwrap();
    fs.release(f.ino, h.fh).await.unwrap();
    fs.rename(ROOT_INO, OsStr::new("d"), ROOT_INO, OsStr::new("d2"), 0)
        .await
        .unwrap();
    assert!(!root.path().join("d").exists());
    assert_eq!(
        std::fs::read(root.path().join("d2/e/f")).unwrap(),
        b"content"
    );
    assert_eq!(list(&fs, ROOT_INO).await, [".", "..", "d2"]);
}

#[tokio::test]
async fn paths_whose_key_exceeds_1024_bytes_are_refused() {
    let e = env();
    let mut dir = ROOT_INO;
    // Four levels of 250-byte names: the fifth name pushes the key past 1,024 bytes.
    for i in 0..4 {
        let name = format!("{i}").repeat(250);
        dir =
            e.fs.mkdir(dir, OsStr::new(&name), 0o755, 0, ME)
                .await
                .unwrap()
                .ino;
    }
    assert_eq!(
        e.fs.create(
            dir,
            OsStr::new(&"x".repeat(30)),
            0o644,
            0,
            libc::O_WRONLY,
            ME
        )
        .await
        .err(),
        Some(FsError::ENAMETOOLONG)
    );
    assert!(e
        .fs
        .create(dir, OsStr::new("ok"), 0o644, 0, libc::O_WRONLY, ME)
        .await
        .is_ok());
}

/// Reads `name` with `chunk`-sized reads at the given offsets, checking each against `data`.
async fn read_at(fs: &Fs, name: &str, data: &[u8], offsets: &[u64], chunk: u32) {
    let attr = fs.lookup(ROOT_INO, OsStr::new(name)).await.unwrap();
    let h = fs.open(attr.ino, libc::O_RDONLY).await.unwrap();
    for &off in offsets {
        let b = fs.read(attr.ino, h.fh, off, chunk).await.unwrap();
        let end = (off as usize + chunk as usize).min(data.len());
        assert_eq!(&b[..], &data[off as usize..end], "at {off}");
    }
    fs.release(attr.ino, h.fh).await.unwrap();
    fs.forget(attr.ino, 1);
}

#[tokio::test]
async fn sequential_reads_become_part_sized_gets() {
    let e = env();
    let data = random(41 * MIB as usize, 20);
    put(&e.mem, "seq", &data).await;
    let offsets: Vec<u64> = (0..data.len() as u64).step_by(128 * 1024).collect();
    read_at(&e.fs, "seq", &data, &offsets, 128 * 1024).await;
    // The window grows quickly to 5 MiB parts: a handful of GETs, not one per read.
    let gets = e.metrics.requests(Op::Get);
    assert!(gets <= 14, "{gets} GETs for 41 MiB");
    assert!(e.metrics.bytes_down() <= data.len() as u64 + 4 * MIB);
}

#[tokio::test]
async fn random_reads_fetch_little_more_than_asked() {
    let e = env();
    let data = random(40 * MIB as usize, 21);
    put(&e.mem, "rnd", &data).await;
    let mut rng = rand::rngs::StdRng::seed_from_u64(22);
    let offsets: Vec<u64> = (0..50)
        .map(|_| rng.gen_range(0..data.len() as u64 - 4096))
        .collect();
    read_at(&e.fs, "rnd", &data, &offsets, 4096).await;
    let per_read = e.metrics.bytes_down() / offsets.len() as u64;
    assert!(
        per_read <= 256 * 1024,
        "{per_read} bytes fetched per 4 KiB read"
    );
}

#[tokio::test]
async fn readers_stay_within_the_memory_budget() {
    let mem = Arc::new(MemoryStore::new());
    let data = random(48 * MIB as usize, 23);
    for i in 0..4 {
        put(&mem, &format!("f{i}"), &data).await;
    }
    let cache = tempfile::tempdir().unwrap();
    let budget = 12 * MIB;
    let fs = Fs::new(
        mem.clone(),
        FsConfig {
            max_memory: budget,
            ..config(&cache)
        },
    );
    let peak = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut tasks = Vec::new();
    for i in 0..4 {
        let (fs, data, peak) = (fs.clone(), data.clone(), peak.clone());
        tasks.push(tokio::spawn(async move {
            let name = format!("f{i}");
            let a = fs.lookup(ROOT_INO, OsStr::new(&name)).await.unwrap();
            let h = fs.open(a.ino, libc::O_RDONLY).await.unwrap();
            let mut off = 0usize;
            while off < data.len() {
                let b = fs.read(a.ino, h.fh, off as u64, 1 << 20).await.unwrap();
                assert_eq!(&b[..], &data[off..off + b.len()]);
                off += b.len();
                let used = fs
                    .metrics()
                    .buffer_bytes
                    .load(std::sync::atomic::Ordering::Relaxed);
                peak.fetch_max(used, std::sync::atomic::Ordering::Relaxed);
            }
            fs.release(a.ino, h.fh).await.unwrap();
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let peak = peak.load(std::sync::atomic::Ordering::Relaxed);
    assert!(
        peak <= budget,
        "buffers peaked at {peak} over a budget of {budget}"
    );
    assert!(peak > 0);
}

#[tokio::test]
async fn unchanged_files_keep_the_page_cache() {
    let e = env();
    put(&e.mem, "k", b"v1").await;
    let a = e.fs.lookup(ROOT_INO, OsStr::new("k")).await.unwrap();
    let h1 = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    assert!(!h1.keep_cache);
    e.fs.release(a.ino, h1.fh).await.unwrap();
    let h2 = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    assert!(h2.keep_cache);
    e.fs.release(a.ino, h2.fh).await.unwrap();
    // Rewritten here: the cached pages are stale.
    let w =
        e.fs.open(a.ino, libc::O_WRONLY | libc::O_TRUNC)
            .await
            .unwrap();
    e.fs.write(a.ino, w.fh, 0, Bytes::from_static(b"v2"))
        .await
        .unwrap();
    e.fs.flush(a.ino, w.fh).await.unwrap();
    e.fs.release(a.ino, w.fh).await.unwrap();
    let h3 = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    assert!(!h3.keep_cache);
    assert_eq!(&e.fs.read(a.ino, h3.fh, 0, 10).await.unwrap()[..], b"v2");
    e.fs.release(a.ino, h3.fh).await.unwrap();
}

#[tokio::test]
async fn ls_l_costs_one_list_and_one_head_per_file_with_statahead() {
    let e = env();
    for i in 0..300 {
        put(&e.mem, &format!("d/f{i:04}"), b"x").await;
    }
    let before = (e.metrics.requests(Op::List), e.metrics.requests(Op::Head));
    let d = e.fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    let names = list(&e.fs, d.ino).await;
    assert_eq!(names.len(), 302);
    // The lookup's LIST fetched the page the listing then used.
    assert_eq!(e.metrics.requests(Op::List) - before.0, 1);
    let before = (before.0, e.metrics.requests(Op::Head));
    // Stat every entry in order, as ls -l does.
    for n in &names[2..] {
        let a = e.fs.lookup(d.ino, OsStr::new(n)).await.unwrap();
        assert_eq!(a.size, 1);
    }
    // No LIST per file, one HEAD per file (statahead fetched most of them in the background).
    assert_eq!(e.metrics.requests(Op::List) - before.0, 1);
    let heads = e.metrics.requests(Op::Head) - before.1;
    assert!((300..=310).contains(&heads), "{heads} HEADs for 300 files");
    // Names the listing does not have are answered without a request.
    let total = e.metrics.total_requests();
    assert_eq!(
        e.fs.lookup(d.ino, OsStr::new("missing")).await,
        Err(FsError::ENOENT)
    );
    assert_eq!(e.metrics.total_requests(), total);
}

/// s3fs-style metadata of a file with permissions `perm` and mtime `secs`.
fn file_meta(perm: u32, secs: u64) -> UserMeta {
    [
        ("mode", (libc::S_IFREG | perm).to_string()),
        ("uid", "1234".to_string()),
        ("gid", "5678".to_string()),
        ("mtime", secs.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

#[tokio::test]
async fn ls_l_with_metadata_in_the_listing_sends_no_head() {
    let e = env_on(MemoryStore::with_list_metadata());
    let t0 = 1_600_000_000u64;
    for i in 0..300u32 {
        let meta = file_meta(0o600 + (i % 64), t0 + i as u64);
        e.mem
            .put(&format!("d/f{i:04}"), Bytes::from_static(b"xy"), &meta)
            .await
            .unwrap();
    }
    let link: UserMeta = [("mode".to_string(), (libc::S_IFLNK | 0o777).to_string())].into();
    e.mem
        .put("d/link", Bytes::from_static(b"f0000"), &link)
        .await
        .unwrap();
    put(&e.mem, "d/plain", b"foreign").await; // no metadata at all
    let marker: UserMeta = [("mode".to_string(), (libc::S_IFDIR | 0o710).to_string())].into();
    e.mem.put("d/sub/", Bytes::new(), &marker).await.unwrap();
    put(&e.mem, "d/sub/inner", b"").await;

    let d = e.fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    assert_eq!(e.metrics.requests(Op::List), 1);
    let before = e.metrics.total_requests();
    let heads = e.metrics.requests(Op::Head);
    let fh = e.fs.opendir(d.ino).await.unwrap();
    let entries = e.fs.readdir(d.ino, fh, 0).await.unwrap();
    e.fs.releasedir(d.ino, fh);
    assert_eq!(entries.len(), 2 + 303);
    // The kind of a symlink shows in the listing itself.
    let kind = |n: &str| entries.iter().find(|e| e.name == n).unwrap().kind;
    assert_eq!(kind("link"), FileKind::Symlink);
    assert_eq!(kind("f0007"), FileKind::File);
    assert_eq!(kind("sub"), FileKind::Dir);
    // The listing's page came with the lookup of d.
    assert_eq!(e.metrics.requests(Op::List), 1);
    // Stat every file as ls -l does: all from the listing, no HEAD.
    for i in 0..300u32 {
        let a =
            e.fs.lookup(d.ino, OsStr::new(&format!("f{i:04}")))
                .await
                .unwrap();
        assert_eq!(a.kind, FileKind::File);
        assert_eq!(a.size, 2);
        assert_eq!(a.perm as u32, 0o600 + (i % 64), "f{i:04}");
        assert_eq!((a.uid, a.gid), (1234, 5678));
        assert_eq!(
            a.mtime,
            std::time::UNIX_EPOCH + std::time::Duration::from_secs(t0 + i as u64)
        );
    }
    let l = e.fs.lookup(d.ino, OsStr::new("link")).await.unwrap();
    assert_eq!(l.kind, FileKind::Symlink);
    let p = e.fs.lookup(d.ino, OsStr::new("plain")).await.unwrap();
    assert_eq!((p.kind, p.perm), (FileKind::File, 0o644));
    assert_eq!(
        e.metrics.total_requests() - before,
        0,
        "the lookup's LIST was all"
    );
    assert_eq!(e.metrics.requests(Op::Head), heads);
    // A listed subdirectory costs one LIST, which also carries its marker's metadata.
    let s = e.fs.lookup(d.ino, OsStr::new("sub")).await.unwrap();
    assert_eq!((s.kind, s.perm), (FileKind::Dir, 0o710));
    assert_eq!(e.metrics.total_requests() - before, 1);
    assert_eq!(e.metrics.requests(Op::Head), heads);
    // The target of a symlink is its body: one GET.
    assert_eq!(&e.fs.readlink(l.ino).await.unwrap()[..], b"f0000");
    assert_eq!(e.metrics.requests(Op::Get), 1);
}

#[tokio::test]
async fn walks_that_stat_no_file_list_without_metadata_until_files_are_stat_ed() {
    let e = env_on(MemoryStore::with_list_metadata());
    for d in 0..6 {
        for i in 0..100 {
            e.mem
                .put(
                    &format!("d{d}/f{i:03}"),
                    Bytes::from_static(b"x"),
                    &file_meta(0o640, 1_600_000_000),
                )
                .await
                .unwrap();
        }
    }
    let mut dirs = Vec::new();
    for d in 0..5 {
        let a =
            e.fs.lookup(ROOT_INO, OsStr::new(&format!("d{d}")))
                .await
                .unwrap();
        // A walk like `find`: the directory is listed, its files are not stat'ed.
        assert_eq!(list(&e.fs, a.ino).await.len(), 102);
        dirs.push(a.ino);
    }
    let stat_all = |ino: u64| {
        let fs = e.fs.clone();
        async move {
            for i in 0..100 {
                let a = fs
                    .lookup(ino, OsStr::new(&format!("f{i:03}")))
                    .await
                    .unwrap();
                assert_eq!(a.perm, 0o640);
            }
        }
    };
    // The first directory was listed with metadata; after its 100 unused entries the others
    // were listed without, so their files need a HEAD each (statahead).
    let heads = e.metrics.requests(Op::Head);
    stat_all(dirs[4]).await;
    let after = e.metrics.requests(Op::Head);
    assert!(after - heads >= 100, "{} HEADs", after - heads);
    stat_all(dirs[0]).await;
    assert_eq!(e.metrics.requests(Op::Head), after);
    // Listed files were stat'ed: the next listing carries the metadata again.
    let d5 = e.fs.lookup(ROOT_INO, OsStr::new("d5")).await.unwrap();
    let after = e.metrics.requests(Op::Head);
    assert_eq!(list(&e.fs, d5.ino).await.len(), 102);
    stat_all(d5.ino).await;
    assert_eq!(e.metrics.requests(Op::Head), after);
}

#[tokio::test]
async fn listed_subdirectories_cost_no_head_of_the_name() {
    // A store whose listings have no metadata: the subdirectory's marker needs a HEAD, but
    // the name itself (which the listing says is a directory) is not HEADed as a file.
    let e = env();
    let marker: UserMeta = [("mode".to_string(), (libc::S_IFDIR | 0o750).to_string())].into();
    e.mem.put("sub/", Bytes::new(), &marker).await.unwrap();
    put(&e.mem, "implied/x", b"").await;
    let names = list(&e.fs, ROOT_INO).await;
    assert_eq!(names, [".", "..", "implied", "sub"]);
    let before = (e.metrics.requests(Op::List), e.metrics.requests(Op::Head));
    let s = e.fs.lookup(ROOT_INO, OsStr::new("sub")).await.unwrap();
    assert_eq!((s.kind, s.perm), (FileKind::Dir, 0o750));
    let i = e.fs.lookup(ROOT_INO, OsStr::new("implied")).await.unwrap();
    assert_eq!((i.kind, i.perm), (FileKind::Dir, 0o755));
    assert_eq!(e.metrics.requests(Op::List) - before.0, 2);
    assert_eq!(
        e.metrics.requests(Op::Head) - before.1,
        1,
        "the marker of sub"
    );
}

#[tokio::test]
async fn a_listed_directory_that_became_a_file_is_found() {
    let e = env();
    put(&e.mem, "x/y", b"").await;
    assert_eq!(list(&e.fs, ROOT_INO).await, [".", "..", "x"]);
    // Another client replaces the directory with a file before the stat.
    e.mem.delete("x/y").await.unwrap();
    put(&e.mem, "x", b"now a file").await;
    let a = e.fs.lookup(ROOT_INO, OsStr::new("x")).await.unwrap();
    assert_eq!((a.kind, a.size), (FileKind::File, 10));
}

#[tokio::test]
async fn creating_files_in_a_new_directory_sends_only_puts() {
    let e = env();
    let d =
        e.fs.mkdir(ROOT_INO, OsStr::new("new"), 0o755, 0, ME)
            .await
            .unwrap();
    e.fs.fsyncdir(ROOT_INO).await.unwrap();
    let before = e.metrics.total_requests();
    for i in 0..100 {
        let name = format!("f{i}");
        // The kernel looks a name up before creating it.
        assert_eq!(
            e.fs.lookup(d.ino, OsStr::new(&name)).await,
            Err(FsError::ENOENT)
        );
        let (a, h) =
            e.fs.create(d.ino, OsStr::new(&name), 0o644, 0, libc::O_WRONLY, ME)
                .await
                .unwrap();
        e.fs.write(a.ino, h.fh, 0, Bytes::from(random(128 * 1024, i)))
            .await
            .unwrap();
        e.fs.flush(a.ino, h.fh).await.unwrap();
        e.fs.release(a.ino, h.fh).await.unwrap();
    }
    assert_eq!(e.metrics.total_requests() - before, 100);
    assert_eq!(e.metrics.requests(Op::Put), 101);
    // And they are all there.
    assert_eq!(list(&e.fs, d.ino).await.len(), 102);
}

#[tokio::test]
async fn big_directories_stream_page_by_page() {
    let e = env();
    for i in 0..2500 {
        put(&e.mem, &format!("big/{i:05}"), b"").await;
    }
    put(&e.mem, "big/sub/x", b"").await;
    let before = e.metrics.requests(Op::List);
    let d = e.fs.lookup(ROOT_INO, OsStr::new("big")).await.unwrap();
    let fh = e.fs.opendir(d.ino).await.unwrap();
    let first = e.fs.readdir(d.ino, fh, 0).await.unwrap();
    // The first answer needs only the first page (which the lookup fetched).
    assert_eq!(e.metrics.requests(Op::List) - before, 1);
    assert!(first.len() >= 100);
    e.fs.releasedir(d.ino, fh);
    let names = list(&e.fs, d.ino).await;
    assert_eq!(names.len(), 2 + 2501);
    assert!(names.contains(&"sub".to_string()));
}

#[tokio::test]
async fn overwriting_an_existing_file_from_the_start_streams_too() {
    let e = env();
    put(&e.mem, "o", &random(30 * MIB as usize, 30)).await;
    let a = e.fs.lookup(ROOT_INO, OsStr::new("o")).await.unwrap();
    // No O_TRUNC: the object is the base, but every part is rewritten whole.
    let h = e.fs.open(a.ino, libc::O_WRONLY).await.unwrap();
    let data = random(30 * MIB as usize, 31);
    write_mib(&e.fs, a.ino, h.fh, 0, &data).await;
    // Parts started going up while writing (the multipart upload is open).
    assert_eq!(e.mem.pending_uploads(), 1);
    e.fs.flush(a.ino, h.fh).await.unwrap();
    e.fs.release(a.ino, h.fh).await.unwrap();
    assert_eq!(object(&e.mem, "o").await, data);
    assert_eq!(e.metrics.requests(Op::UploadPartCopy), 0);
    assert_eq!(e.metrics.bytes_up(), data.len() as u64);
}

#[tokio::test]
async fn random_reads_reuse_recently_fetched_blocks() {
    let e = env();
    let data = random(16 * MIB as usize, 40);
    put(&e.mem, "r16", &data).await;
    let mut rng = rand::rngs::StdRng::seed_from_u64(41);
    let offsets: Vec<u64> = (0..2000)
        .map(|_| rng.gen_range(0..(data.len() as u64 - 16384)) / 16384 * 16384)
        .collect();
    read_at(&e.fs, "r16", &data, &offsets, 16384).await;
    // Blocks of 128 KiB are fetched once and kept: at most one GET per block of the file.
    let gets = e.metrics.requests(Op::Get);
    assert!(
        gets <= 16 * 8 + 8,
        "{gets} GETs for 2,000 random 16 KiB reads of 16 MiB"
    );
}

#[tokio::test]
async fn an_open_file_keeps_reading_after_a_rename() {
    let e = env();
    let data = random(12 * MIB as usize, 50);
    put(&e.mem, "a", &data).await;
    let a = e.fs.lookup(ROOT_INO, OsStr::new("a")).await.unwrap();
    let h = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    let first = e.fs.read(a.ino, h.fh, 0, 1 << 20).await.unwrap();
    assert_eq!(&first[..], &data[..1 << 20]);
    e.fs.rename(ROOT_INO, OsStr::new("a"), ROOT_INO, OsStr::new("b"), 0)
        .await
        .unwrap();
    let later = e.fs.read(a.ino, h.fh, 9 << 20, 1 << 20).await.unwrap();
    assert_eq!(&later[..], &data[9 << 20..10 << 20]);
    e.fs.release(a.ino, h.fh).await.unwrap();
}

#[tokio::test]
async fn files_open_for_writing_keep_fetched_and_published_bytes_on_disk() {
    let e = env();
    let mut model = random(MIB as usize, 60);
    put(&e.mem, "db", &model).await;
    let a = e.fs.lookup(ROOT_INO, OsStr::new("db")).await.unwrap();
    let h = e.fs.open(a.ino, libc::O_RDWR).await.unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(61);
    // Random 16 KiB reads (as sysbench does on files it opens O_RDWR).
    for _ in 0..200 {
        let off = rng.gen_range(0..64u64) * 16384;
        let b = e.fs.read(a.ino, h.fh, off, 16384).await.unwrap();
        assert_eq!(&b[..], &model[off as usize..off as usize + 16384]);
    }
    // 1 MiB in 128 KiB blocks: at most 8 GETs, however many reads.
    assert!(e.metrics.requests(Op::Get) <= 8);
    // Random writes, each followed by fsync: after the first upload nothing is fetched again.
    for i in 0..30 {
        let off = rng.gen_range(0..64usize) * 16384;
        let buf = random(16384, 100 + i);
        model[off..off + 16384].copy_from_slice(&buf);
        e.fs.write(a.ino, h.fh, off as u64, Bytes::from(buf))
            .await
            .unwrap();
        e.fs.fsync(a.ino, h.fh).await.unwrap();
    }
    assert!(
        e.metrics.requests(Op::Get) <= 8,
        "{}",
        e.metrics.requests(Op::Get)
    );
    assert_eq!(object(&e.mem, "db").await, model);
    e.fs.release(a.ino, h.fh).await.unwrap();
}

/// An application opening the files of a cold directory by name (no readdir): after a few
/// misses the directory is listed once, and the other names, present or not, cost nothing.
#[tokio::test]
async fn lookups_of_many_names_in_one_directory_list_it_once() {
    let e = env_on(MemoryStore::with_list_metadata());
    for i in 0..40u32 {
        let meta = file_meta(0o640, 1_600_000_000 + i as u64);
        e.mem
            .put(&format!("d/f{i:02}"), Bytes::from_static(b"abc"), &meta)
            .await
            .unwrap();
    }
    let d = e.fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    let before = e.metrics.total_requests();
    for i in 0..40u32 {
        let a =
            e.fs.lookup(d.ino, OsStr::new(&format!("f{i:02}")))
                .await
                .unwrap();
        assert_eq!((a.size, a.perm), (3, 0o640), "f{i:02}");
    }
    // Names that do not exist: answered by the listing too.
    for n in ["nope", "f99"] {
        assert_eq!(
            e.fs.lookup(d.ino, OsStr::new(n)).await.unwrap_err(),
            FsError::ENOENT
        );
    }
    // Two names probed (HEAD + LIST each), then the rest answered by a listing whose page
    // the lookup of d had fetched already.
    assert_eq!(e.metrics.total_requests() - before, 2 * 2);
}

/// A single lookup in a cold directory still probes just its name: no listing of a
/// directory that may be huge. The page the directory's lookup fetched showed `f3` as a
/// file (this store lists no metadata), so only its HEAD is needed, not LIST `f3/`.
#[tokio::test]
async fn a_lone_lookup_does_not_list_the_directory() {
    let e = env();
    for i in 0..5u32 {
        put(&e.mem, &format!("d/f{i}"), b"x").await;
    }
    let d = e.fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    let lists = e.metrics.requests(Op::List);
    e.fs.lookup(d.ino, OsStr::new("f3")).await.unwrap();
    assert_eq!(e.metrics.requests(Op::Head), 2, "HEAD d, HEAD f3");
    assert_eq!(e.metrics.requests(Op::List), lists, "HEAD f3 only");
}

/// A file read whole and closed leaves no memory behind (the kernel's page cache has it);
/// one read partly keeps the unread rest of its block for the next reader.
#[tokio::test]
async fn only_unread_bytes_stay_cached_after_close() {
    let e = env();
    let data = random(100 * 1024, 9);
    put(&e.mem, "whole", &data).await;
    put(&e.mem, "part", &data).await;
    let buffered = |e: &Env| {
        e.fs.metrics()
            .buffer_bytes
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    let a = e.fs.lookup(ROOT_INO, OsStr::new("whole")).await.unwrap();
    let h = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    let got = e.fs.read(a.ino, h.fh, 0, 200 * 1024).await.unwrap();
    assert_eq!(&got[..], &data[..]);
    // A reply shares the read buffer, which holds its memory until the reply is sent.
    drop(got);
    e.fs.release(a.ino, h.fh).await.unwrap();
    assert_eq!(buffered(&e), 0);
    let a = e.fs.lookup(ROOT_INO, OsStr::new("part")).await.unwrap();
    let h = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    let got = e.fs.read(a.ino, h.fh, 0, 4096).await.unwrap();
    assert_eq!(&got[..], &data[..4096]);
    e.fs.release(a.ino, h.fh).await.unwrap();
    assert!(buffered(&e) >= data.len() as u64);
    // The next open reads the rest from the cache: no GET.
    let gets = e.metrics.requests(Op::Get);
    let h = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    let got = e.fs.read(a.ino, h.fh, 4096, 8192).await.unwrap();
    assert_eq!(&got[..], &data[4096..12288]);
    assert_eq!(e.metrics.requests(Op::Get), gets);
    e.fs.release(a.ino, h.fh).await.unwrap();
}

/// With O_DIRECT the kernel caches nothing: a single pass keeps nothing either, but once a
/// reader goes over the file again, what it reads is kept in the block cache (within its
/// quarter of the budget) and the next pass sends no GET.
#[tokio::test]
async fn direct_io_rereads_come_from_the_block_cache() {
    let e = env();
    let data = random(24 * MIB as usize, 12);
    put(&e.mem, "d.bin", &data).await;
    let a = e.fs.lookup(ROOT_INO, OsStr::new("d.bin")).await.unwrap();
    let h =
        e.fs.open(a.ino, libc::O_RDONLY | libc::O_DIRECT)
            .await
            .unwrap();
    let pass = || {
        let (fs, data) = (e.fs.clone(), data.clone());
        async move {
            for (i, c) in data.chunks(MIB as usize).enumerate() {
                let got = fs
                    .read(a.ino, h.fh, i as u64 * MIB, MIB as u32)
                    .await
                    .unwrap();
                assert!(got[..] == *c, "block {i}");
            }
        }
    };
    let buffered = || {
        e.fs.metrics()
            .buffer_bytes
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    pass().await;
    let first = e.metrics.requests(Op::Get);
    assert!(first >= 3);
    assert!(
        buffered() < 16 * MIB,
        "a single pass kept {} bytes",
        buffered()
    );
    pass().await;
    let second = e.metrics.requests(Op::Get);
    assert!(second > first, "the second pass had nothing cached yet");
    pass().await;
    assert_eq!(
        e.metrics.requests(Op::Get),
        second,
        "the third pass fetched again"
    );
    e.fs.release(a.ino, h.fh).await.unwrap();
}

/// readdirplus entries: attributes a listing carried are complete (no request, one lookup
/// each); an entry listed without metadata is registered stale, so its stat asks the store and
/// a symlink the listing could not tell from a file gets its true type.
#[tokio::test]
async fn readdirplus_entries_are_complete_only_with_metadata() {
    for with_meta in [true, false] {
        let e = env_on(if with_meta {
            MemoryStore::with_list_metadata()
        } else {
            MemoryStore::new()
        });
        e.mem
            .put(
                "d/f",
                Bytes::from_static(b"abc"),
                &file_meta(0o600, 1_600_000_000),
            )
            .await
            .unwrap();
        let link: UserMeta = [("mode".to_string(), (libc::S_IFLNK | 0o777).to_string())].into();
        e.mem
            .put("d/l", Bytes::from_static(b"f"), &link)
            .await
            .unwrap();
        let d = e.fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
        let fh = e.fs.opendir(d.ino).await.unwrap();
        let entries = e.fs.readdir(d.ino, fh, 0).await.unwrap();
        e.fs.releasedir(d.ino, fh);
        let inodes = e.fs.inode_count();
        let before = e.metrics.total_requests();
        let mut got = std::collections::HashMap::new();
        for ent in &entries {
            let (attr, complete) = e.fs.plus_entry(d.ino, ent).unwrap();
            got.insert(ent.name.clone(), (attr, complete));
        }
        assert_eq!(
            e.metrics.total_requests(),
            before,
            "no request for readdirplus"
        );
        assert_eq!(e.fs.inode_count(), inodes + 2, "f and l registered");
        let (f, f_complete) = &got["f"];
        let (l, l_complete) = &got["l"];
        assert_eq!((*f_complete, *l_complete), (with_meta, with_meta));
        if with_meta {
            assert_eq!((f.perm, f.size), (0o600, 3));
            assert_eq!(l.kind, FileKind::Symlink);
        }
        // Each entry counted one lookup: forgetting it once drops the inode.
        e.fs.forget(f.ino, 1);
        assert_eq!(e.fs.inode_count(), inodes + 1);
        // A stat after readdirplus: free with metadata, else one HEAD; the symlink's type is
        // right either way.
        let s = e.fs.getattr(l.ino).await;
        let l2 = e.fs.lookup(d.ino, OsStr::new("l")).await.unwrap();
        assert_eq!(l2.kind, FileKind::Symlink);
        if with_meta {
            assert_eq!(s.unwrap().kind, FileKind::Symlink);
            assert_eq!(e.metrics.total_requests(), before);
        } else {
            assert!(e.metrics.requests(Op::Head) >= 1);
        }
    }
}

/// When the staging file cannot be written (here: the cache dir is gone), a write that needs
/// it fails, and the bytes acknowledged before it, still in memory, are not lost.
#[tokio::test]
async fn a_failed_staging_write_keeps_the_bytes_already_written() {
    let mem = Arc::new(MemoryStore::new());
    let cache = tempfile::tempdir().unwrap();
    let fs = Fs::new(
        mem.clone(),
        FsConfig {
            cache_dir: cache.path().join("missing"),
            ..config(&cache)
        },
    );
    let (a, h) = fs
        .create(ROOT_INO, OsStr::new("f"), 0o644, 0, libc::O_WRONLY, ME)
        .await
        .unwrap();
    fs.write(a.ino, h.fh, 0, Bytes::from_static(b"hello"))
        .await
        .unwrap();
    // Not an append: it needs the staging file, which cannot be made.
    assert!(fs
        .write(a.ino, h.fh, 100, Bytes::from_static(b"X"))
        .await
        .is_err());
    fs.flush(a.ino, h.fh).await.unwrap();
    fs.release(a.ino, h.fh).await.unwrap();
    assert_eq!(object(&mem, "f").await, b"hello");
}

/// Lets background statahead finish (the memory store answers at once).
async fn settle() {
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
}

/// One stat of a name in a listed directory (`ls -l dir` after a listing of its parent) stats
/// nothing else; the second lookup from the same listing starts statahead.
#[tokio::test]
async fn statahead_starts_at_the_second_lookup_from_a_listing() {
    let e = env();
    for d in ["a", "b", "c"] {
        put(&e.mem, &format!("{d}/x"), b"x").await;
    }
    for i in 0..10 {
        put(&e.mem, &format!("f{i}"), b"x").await;
    }
    assert_eq!(list(&e.fs, ROOT_INO).await.len(), 2 + 13);
    let before = (e.metrics.requests(Op::List), e.metrics.requests(Op::Head));
    let a = e.fs.lookup(ROOT_INO, OsStr::new("a")).await.unwrap();
    assert_eq!(a.kind, FileKind::Dir);
    settle().await;
    let sent = (
        e.metrics.requests(Op::List) - before.0,
        e.metrics.requests(Op::Head) - before.1,
    );
    assert_eq!(sent, (1, 0), "LIST a/ only, not b/ and c/ too");
    // The second lookup: the names after it are stat'ed ahead (c, f0..f9 after b).
    e.fs.lookup(ROOT_INO, OsStr::new("b")).await.unwrap();
    settle().await;
    assert_eq!(e.metrics.requests(Op::List) - before.0, 3, "a/, b/ and c/");
    assert_eq!(e.metrics.requests(Op::Head) - before.1, 10, "f0..f9");
    let total = e.metrics.total_requests();
    for i in 0..10 {
        e.fs.lookup(ROOT_INO, OsStr::new(&format!("f{i}")))
            .await
            .unwrap();
    }
    e.fs.lookup(ROOT_INO, OsStr::new("c")).await.unwrap();
    assert_eq!(e.metrics.total_requests(), total, "all stat'ed ahead");
}

/// Marker `d/` with metadata and 300 files, on a store whose listings carry metadata.
async fn dir_with_marker(e: &Env) {
    let marker: UserMeta = [("mode".to_string(), (libc::S_IFDIR | 0o750).to_string())].into();
    e.mem.put("d/", Bytes::new(), &marker).await.unwrap();
    for i in 0..300u32 {
        e.mem
            .put(
                &format!("d/f{i:04}"),
                Bytes::from_static(b"xy"),
                &file_meta(0o640, 1_600_000_000),
            )
            .await
            .unwrap();
    }
}

/// `ls -l d` on a cold mount: the lookup of d lists it from its marker with a full page, and
/// the listing and the stats of its entries are served from that page: one LIST in all.
#[tokio::test]
async fn stat_of_a_directory_then_its_listing_is_one_list() {
    for parent_listed in [false, true] {
        let e = env_on(MemoryStore::with_list_metadata());
        dir_with_marker(&e).await;
        if parent_listed {
            assert_eq!(list(&e.fs, ROOT_INO).await, [".", "..", "d"]);
        }
        let before = (e.metrics.requests(Op::List), e.metrics.requests(Op::Head));
        let d = e.fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
        assert_eq!(
            (d.kind, d.perm),
            (FileKind::Dir, 0o750),
            "the marker's mode"
        );
        let names = list(&e.fs, d.ino).await;
        assert_eq!(names.len(), 2 + 300, "the marker is no entry");
        assert_eq!(names[2], "f0000");
        for n in &names[2..] {
            let a = e.fs.lookup(d.ino, OsStr::new(n)).await.unwrap();
            assert_eq!((a.perm, a.size), (0o640, 2));
        }
        settle().await;
        let lists = e.metrics.requests(Op::List) - before.0;
        let heads = e.metrics.requests(Op::Head) - before.1;
        // Not listed by its parent, d's type is unknown: HEAD d goes with the LIST.
        let want_heads = if parent_listed { 0 } else { 1 };
        assert_eq!(
            (lists, heads),
            (1, want_heads),
            "parent listed: {parent_listed}"
        );
        // The page is used once: the next listing asks the store.
        assert_eq!(list(&e.fs, d.ino).await.len(), 302);
        assert_eq!(e.metrics.requests(Op::List) - before.0, 2);
    }
}

/// Changes made here between the lookup of a directory and its listing show in the listing:
/// the page the lookup fetched predates them and is not used.
#[tokio::test]
async fn changes_after_a_directory_lookup_show_in_its_listing() {
    let e = env_on(MemoryStore::with_list_metadata());
    dir_with_marker(&e).await;
    let d = e.fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    let (f, h) =
        e.fs.create(d.ino, OsStr::new("new"), 0o644, 0, libc::O_WRONLY, ME)
            .await
            .unwrap();
    e.fs.unlink(d.ino, OsStr::new("f0001")).await.unwrap();
    let lists = e.metrics.requests(Op::List);
    let names = list(&e.fs, d.ino).await;
    assert!(
        names.contains(&"new".to_string()),
        "created here, not stored yet"
    );
    assert!(!names.contains(&"f0001".to_string()), "removed here");
    assert_eq!(names.len(), 2 + 300);
    assert_eq!(e.metrics.requests(Op::List) - lists, 1, "listed again");
    e.fs.flush(f.ino, h.fh).await.unwrap();
    e.fs.release(f.ino, h.fh).await.unwrap();

    // A change elsewhere in this mount makes the page stale as well (the epoch is global).
    let e = env_on(MemoryStore::with_list_metadata());
    dir_with_marker(&e).await;
    let d = e.fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    write_file(&e.fs, "elsewhere", b"x").await;
    let lists = e.metrics.requests(Op::List);
    assert_eq!(list(&e.fs, d.ino).await.len(), 302);
    assert_eq!(e.metrics.requests(Op::List) - lists, 1);
}

/// A directory made here whose marker is still on its way when its parent is looked up: the
/// page that lookup would fetch lacks it, so none is kept, and the listing shows it.
#[tokio::test]
async fn a_directory_lookup_keeps_no_page_while_a_marker_below_is_pending() {
    let mem = Arc::new(MemoryStore::with_list_metadata());
    put(&mem, "d/f", b"x").await;
    let (faulty, fs, _cache) = faulty_fs(&mem);
    let d = fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    faulty.inject(
        Op::Put,
        0,
        Some(1),
        Fault::Delay(std::time::Duration::from_millis(300)),
    );
    fs.mkdir(d.ino, OsStr::new("sub"), 0o755, 0, ME)
        .await
        .unwrap();
    // d's attributes are asked again (as after its TTL): a new lookup of it from the store.
    fs.refresh(d.ino).unwrap();
    let d2 = fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    assert_eq!(d2.ino, d.ino);
    assert!(
        mem.head("d/sub/").await.is_err(),
        "the marker is not up yet"
    );
    let mut names = list(&fs, d.ino).await;
    names.sort();
    assert_eq!(names, [".", "..", "f", "sub"]);
}

fn counter(fs: &Fs, pick: fn(&bucketfs_fs::FsMetrics) -> &std::sync::atomic::AtomicU64) -> u64 {
    pick(&fs.metrics()).load(std::sync::atomic::Ordering::Relaxed)
}

/// Creates `name` O_RDWR and writes `data` in 1 MiB writes; returns (ino, fh), still open.
async fn write_open(fs: &Fs, name: &str, data: &[u8]) -> (u64, u64) {
    let (a, h) = fs
        .create(ROOT_INO, OsStr::new(name), 0o644, 0, libc::O_RDWR, ME)
        .await
        .unwrap();
    write_mib(fs, a.ino, h.fh, 0, data).await;
    (a.ino, h.fh)
}

/// Every streamed part is also copied to the staging file, so reading it back before close
/// needs no request and publishes nothing: the key never holds a half-written file.
#[tokio::test]
async fn streamed_parts_are_read_back_locally_without_publishing() {
    let e = env();
    let mut data = random(23 * MIB as usize, 70);
    let (ino, fh) = write_open(&e.fs, "big", &data).await;
    // Parts 1-4 (5 MiB each) went up, each copied to the staging file; nothing is visible.
    assert_eq!(counter(&e.fs, |m| &m.staged_bytes), 20 * MIB);
    let gets = e.metrics.requests(Op::Get);
    for at in [0, 7 * MIB, 12 * MIB, 19 * MIB + 4095, 22 * MIB] {
        let b = e.fs.read(ino, fh, at, 1 << 20).await.unwrap();
        assert_eq!(&b[..], &data[at as usize..at as usize + b.len()], "at {at}");
    }
    assert!(e.mem.head("big").await.is_err(), "published for a read");
    assert_eq!(e.metrics.requests(Op::Get), gets);
    assert_eq!(e.metrics.requests(Op::Put), 0);
    assert_eq!(e.metrics.requests(Op::CompleteMultipart), 0);
    let more = random(10 * MIB as usize, 71);
    write_mib(&e.fs, ino, fh, 23 * MIB, &more).await;
    data.extend_from_slice(&more);
    let b = e.fs.read(ino, fh, 26 * MIB, 1 << 20).await.unwrap();
    assert_eq!(&b[..], &data[26 * MIB as usize..27 * MIB as usize]);
    assert!(e.mem.head("big").await.is_err(), "published for a read");
    e.fs.flush(ino, fh).await.unwrap();
    e.fs.release(ino, fh).await.unwrap();
    assert_eq!(object(&e.mem, "big").await, data);
    assert_eq!(e.mem.pending_uploads(), 0);
}

/// The fs over `store` with a cache dir that does not exist: no staging file can be made,
/// as on a full disk.
fn fs_without_staging(store: Arc<dyn ObjectStore>) -> (Arc<Fs>, tempfile::TempDir) {
    let cache = tempfile::tempdir().unwrap();
    let cfg = FsConfig {
        cache_dir: cache.path().join("missing"),
        ..config(&cache)
    };
    (Fs::new(store, cfg), cache)
}

/// Where a streamed part cannot be copied locally, its bytes are only in the upload: a read
/// of them (and a rename of the file) is EIO, and nothing is published before close; the
/// writer goes on, and close stores every byte.
#[tokio::test]
async fn bytes_only_an_upload_holds_are_eio_never_published() {
    let mem = Arc::new(MemoryStore::new());
    let (fs, _cache) = fs_without_staging(mem.clone());
    let mut data = random(23 * MIB as usize, 78);
    let (ino, fh) = write_open(&fs, "f", &data).await;
    assert_eq!(fs.read(ino, fh, 7 * MIB, 4096).await, Err(FsError::EIO));
    assert_eq!(
        fs.rename(ROOT_INO, OsStr::new("f"), ROOT_INO, OsStr::new("g"), 0)
            .await,
        Err(FsError::EIO)
    );
    assert!(mem.keys().is_empty(), "{:?}", mem.keys());
    assert_eq!(counter(&fs, |m| &m.unreadable_streamed), 1);
    // The tail (bytes after the last full part) still reads.
    let b = fs.read(ino, fh, 21 * MIB, 4096).await.unwrap();
    assert_eq!(&b[..], &data[21 * MIB as usize..21 * MIB as usize + 4096]);
    let more = random(7 * MIB as usize, 79);
    write_mib(&fs, ino, fh, 23 * MIB, &more).await;
    data.extend_from_slice(&more);
    fs.flush(ino, fh).await.unwrap();
    fs.release(ino, fh).await.unwrap();
    assert_eq!(object(&mem, "f").await, data);
    assert_eq!(mem.pending_uploads(), 0);
}

/// Rename of a file being written publishes nothing: the old name is gone at once, the
/// file's previous complete object moves to the new name (a new file has none there until
/// close), the upload of the old key is aborted, and close stores the whole file under the
/// new name, streamed parts sent again from their local copies.
#[tokio::test]
async fn rename_of_a_file_being_written_publishes_nothing() {
    let e = env();
    let old = random(3 * MIB as usize, 80);
    put(&e.mem, "a", &old).await;
    put(&e.mem, "taken", b"replaced").await;
    let a = e.fs.lookup(ROOT_INO, OsStr::new("a")).await.unwrap();
    let h =
        e.fs.open(a.ino, libc::O_WRONLY | libc::O_TRUNC)
            .await
            .unwrap();
    let mut data = random(13 * MIB as usize, 81);
    write_mib(&e.fs, a.ino, h.fh, 0, &data).await;
    let (n, nh) = write_open(&e.fs, "n", &random(12 * MIB as usize, 82)).await;
    e.fs.rename(ROOT_INO, OsStr::new("a"), ROOT_INO, OsStr::new("b"), 0)
        .await
        .unwrap();
    e.fs.rename(ROOT_INO, OsStr::new("n"), ROOT_INO, OsStr::new("taken"), 0)
        .await
        .unwrap();
    assert_eq!(e.mem.keys(), ["b"]);
    assert_eq!(object(&e.mem, "b").await, old);
    assert_eq!(e.mem.pending_uploads(), 0);
    let more = random(4 * MIB as usize, 83);
    write_mib(&e.fs, a.ino, h.fh, 13 * MIB, &more).await;
    data.extend_from_slice(&more);
    assert_eq!(object(&e.mem, "b").await, old);
    e.fs.flush(a.ino, h.fh).await.unwrap();
    e.fs.release(a.ino, h.fh).await.unwrap();
    assert_eq!(object(&e.mem, "b").await, data);
    let attr = e.fs.lookup(ROOT_INO, OsStr::new("b")).await.unwrap();
    assert_eq!(attr.size, data.len() as u64);
    e.fs.flush(n, nh).await.unwrap();
    e.fs.release(n, nh).await.unwrap();
    assert_eq!(object(&e.mem, "taken").await, random(12 * MIB as usize, 82));
    assert_eq!(e.mem.keys(), ["b", "taken"]);
    assert_eq!(e.mem.pending_uploads(), 0);
}

/// A directory renamed while files below it are being written publishes none of them: the
/// complete objects move, a file rewritten over one keeps it under the new name until close,
/// and close stores each file complete under its new key.
#[tokio::test]
async fn rename_of_a_directory_with_files_being_written_publishes_nothing() {
    let e = env();
    let old = random(2 * MIB as usize, 84);
    put(&e.mem, "d/old", &old).await;
    let d = e.fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    let o = e.fs.lookup(d.ino, OsStr::new("old")).await.unwrap();
    let oh =
        e.fs.open(o.ino, libc::O_WRONLY | libc::O_TRUNC)
            .await
            .unwrap();
    let rewritten = random(12 * MIB as usize, 85);
    write_mib(&e.fs, o.ino, oh.fh, 0, &rewritten).await;
    let (n, nh) =
        e.fs.create(d.ino, OsStr::new("new"), 0o644, 0, libc::O_WRONLY, ME)
            .await
            .unwrap();
    let fresh = random(11 * MIB as usize, 86);
    write_mib(&e.fs, n.ino, nh.fh, 0, &fresh).await;
    e.fs.rename(ROOT_INO, OsStr::new("d"), ROOT_INO, OsStr::new("e"), 0)
        .await
        .unwrap();
    assert_eq!(e.mem.keys(), ["e/", "e/old"]);
    assert_eq!(object(&e.mem, "e/old").await, old);
    assert_eq!(e.mem.pending_uploads(), 0);
    for (ino, fh) in [(o.ino, oh.fh), (n.ino, nh.fh)] {
        e.fs.flush(ino, fh).await.unwrap();
        e.fs.release(ino, fh).await.unwrap();
    }
    assert_eq!(object(&e.mem, "e/old").await, rewritten);
    assert_eq!(object(&e.mem, "e/new").await, fresh);
    assert_eq!(e.mem.keys(), ["e/", "e/new", "e/old"]);
    assert_eq!(e.mem.pending_uploads(), 0);
}

/// A small rewrite inside a streamed part, and a truncate cutting one, keep every other byte.
#[tokio::test]
async fn rewriting_or_cutting_a_streamed_part_keeps_its_other_bytes() {
    let e = env();
    let mut data = random(23 * MIB as usize, 72);
    let (ino, fh) = write_open(&e.fs, "f", &data).await;
    e.fs.write(ino, fh, 7 * MIB + 3, Bytes::from_static(b"patched"))
        .await
        .unwrap();
    data[7 * MIB as usize + 3..7 * MIB as usize + 10].copy_from_slice(b"patched");
    e.fs.setattr(
        ino,
        Some(fh),
        SetAttr {
            size: Some(17 * MIB + 5),
            ..SetAttr::default()
        },
    )
    .await
    .unwrap();
    data.truncate(17 * MIB as usize + 5);
    e.fs.flush(ino, fh).await.unwrap();
    e.fs.release(ino, fh).await.unwrap();
    assert_eq!(object(&e.mem, "f").await, data);
    assert_eq!(e.mem.pending_uploads(), 0);
}

/// A publish that fails while the upload holds the only copy of some bytes (their local copy
/// failed) keeps the upload: the next fsync completes it with nothing lost.
#[tokio::test]
async fn a_failed_publish_keeps_the_upload_holding_streamed_bytes() {
    let mem = Arc::new(MemoryStore::new());
    let faulty = Arc::new(FaultStore::new(mem.clone()));
    let (fs, _cache) = fs_without_staging(faulty.clone());
    faulty.inject(
        Op::CompleteMultipart,
        0,
        Some(1),
        Fault::Error(StoreError::Transient("503".into())),
    );
    let data = random(23 * MIB as usize, 74);
    let (ino, fh) = write_open(&fs, "f", &data).await;
    assert_eq!(fs.fsync(ino, fh).await, Err(FsError::EIO));
    assert_eq!(mem.pending_uploads(), 1);
    fs.fsync(ino, fh).await.unwrap();
    assert_eq!(object(&mem, "f").await, data);
    fs.release(ino, fh).await.unwrap();
    assert_eq!(mem.pending_uploads(), 0);
}

/// The keys under the hidden directory of files unlinked while open.
fn hidden_keys(mem: &MemoryStore) -> Vec<String> {
    mem.keys()
        .into_iter()
        .filter(|k| k.starts_with(".bucketfs-unlinked/"))
        .collect()
}

/// An open file unlinked after some of its parts were streamed stays whole for its
/// descriptor: the parts have local copies, so nothing is published or kept in the bucket,
/// and the upload is aborted. Later writes stay local.
#[tokio::test]
async fn an_unlinked_open_file_keeps_its_streamed_bytes() {
    let e = env();
    let mut data = random(23 * MIB as usize, 75);
    let (ino, fh) = write_open(&e.fs, "gone", &data).await;
    assert_eq!(e.mem.pending_uploads(), 1, "parts are being streamed");
    e.fs.unlink(ROOT_INO, OsStr::new("gone")).await.unwrap();
    assert_eq!(
        e.fs.lookup(ROOT_INO, OsStr::new("gone")).await,
        Err(FsError::ENOENT)
    );
    assert!(e.mem.keys().is_empty(), "{:?}", e.mem.keys());
    assert_eq!(
        list(&e.fs, ROOT_INO).await,
        [".", ".."],
        "the hidden directory is not listed"
    );
    assert_eq!(e.mem.pending_uploads(), 0);
    let uploads = e.metrics.requests(Op::UploadPart);
    let puts = e.metrics.requests(Op::Put);
    let more = random(12 * MIB as usize, 76);
    write_mib(&e.fs, ino, fh, 23 * MIB, &more).await;
    data.extend_from_slice(&more);
    for off in [0, 6 * MIB, 12 * MIB, 20 * MIB, 26 * MIB, 34 * MIB] {
        let b = e.fs.read(ino, fh, off, 1 << 20).await.unwrap();
        assert!(!b.is_empty());
        assert_eq!(
            &b[..],
            &data[off as usize..off as usize + b.len()],
            "at {off}"
        );
    }
    // Nothing written after the unlink goes up.
    e.fs.flush(ino, fh).await.unwrap();
    assert_eq!(e.metrics.requests(Op::UploadPart), uploads);
    assert_eq!(e.metrics.requests(Op::Put), puts);
    e.fs.release(ino, fh).await.unwrap();
    assert!(e.mem.keys().is_empty(), "{:?}", e.mem.keys());
    assert_eq!(e.mem.pending_uploads(), 0);
}

/// A stored file open for reading, then unlinked (by this descriptor's owner or anyone else
/// on the mount), reads on to the end, as POSIX promises; its name is gone at once.
#[tokio::test]
async fn an_unlinked_file_open_for_reading_reads_on() {
    let e = env();
    let data = random(3 * MIB as usize, 77);
    put(&e.mem, "in", &data).await;
    let a = e.fs.lookup(ROOT_INO, OsStr::new("in")).await.unwrap();
    let h = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    let first = e.fs.read(a.ino, h.fh, 0, 1 << 20).await.unwrap();
    assert_eq!(&first[..], &data[..MIB as usize]);
    e.fs.unlink(ROOT_INO, OsStr::new("in")).await.unwrap();
    assert_eq!(
        e.fs.lookup(ROOT_INO, OsStr::new("in")).await,
        Err(FsError::ENOENT)
    );
    assert_eq!(hidden_keys(&e.mem).len(), 1, "{:?}", e.mem.keys());
    // A new file may take the name while the old one is still open.
    write_file(&e.fs, "in", b"new").await;
    let mut rest = Vec::new();
    loop {
        let b =
            e.fs.read(a.ino, h.fh, MIB + rest.len() as u64, 1 << 20)
                .await
                .unwrap();
        if b.is_empty() {
            break;
        }
        rest.extend_from_slice(&b);
    }
    assert_eq!(&rest[..], &data[MIB as usize..]);
    e.fs.release(a.ino, h.fh).await.unwrap();
    assert_eq!(e.mem.keys(), vec!["in".to_string()]);
    assert_eq!(object(&e.mem, "in").await, b"new");
}

/// Unlinking a file nobody has open, or whose bytes are all local, copies nothing.
#[tokio::test]
async fn unlink_copies_only_for_open_files_with_stored_bytes() {
    let e = env();
    put(&e.mem, "closed", b"x").await;
    e.fs.lookup(ROOT_INO, OsStr::new("closed")).await.unwrap();
    e.fs.unlink(ROOT_INO, OsStr::new("closed")).await.unwrap();
    let (a, h) =
        e.fs.create(ROOT_INO, OsStr::new("new"), 0o644, 0, libc::O_RDWR, ME)
            .await
            .unwrap();
    e.fs.write(a.ino, h.fh, 0, Bytes::from_static(b"local"))
        .await
        .unwrap();
    e.fs.unlink(ROOT_INO, OsStr::new("new")).await.unwrap();
    assert_eq!(&e.fs.read(a.ino, h.fh, 0, 10).await.unwrap()[..], b"local");
    e.fs.release(a.ino, h.fh).await.unwrap();
    assert_eq!(e.metrics.requests(Op::Copy), 0);
    assert!(e.mem.keys().is_empty());
}

/// A stored file opened with `O_TRUNC` needs nothing from its object: unlinking it while
/// open deletes the object without copying it, and a reader of the file still reads what the
/// writer wrote after the writer's last close.
#[tokio::test]
async fn an_unlinked_truncated_file_is_not_copied_and_reads_on() {
    let e = env();
    put(&e.mem, "log", &random(3 * MIB as usize, 78)).await;
    let a = e.fs.lookup(ROOT_INO, OsStr::new("log")).await.unwrap();
    let w =
        e.fs.open(a.ino, libc::O_RDWR | libc::O_TRUNC)
            .await
            .unwrap();
    e.fs.write(a.ino, w.fh, 0, Bytes::from_static(b"fresh"))
        .await
        .unwrap();
    let r = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    e.fs.unlink(ROOT_INO, OsStr::new("log")).await.unwrap();
    assert_eq!(e.metrics.requests(Op::Copy), 0);
    assert!(e.mem.keys().is_empty(), "{:?}", e.mem.keys());
    e.fs.release(a.ino, w.fh).await.unwrap();
    assert_eq!(&e.fs.read(a.ino, r.fh, 0, 100).await.unwrap()[..], b"fresh");
    e.fs.release(a.ino, r.fh).await.unwrap();
    assert!(e.mem.keys().is_empty(), "{:?}", e.mem.keys());
    assert_eq!(e.metrics.requests(Op::Put), 0);
}

/// A file renamed over one still open here replaces it for good, as on a local disk (the
/// "write a temp file, rename it over" save): the open file's descriptors keep reading and
/// writing their own bytes, and its last close does not publish them over the new file.
#[tokio::test]
async fn renaming_over_an_open_file_keeps_it_for_its_descriptors() {
    let e = env();
    let mut old = random(3 * MIB as usize, 79);
    put(&e.mem, "cfg", &old).await;
    let a = e.fs.lookup(ROOT_INO, OsStr::new("cfg")).await.unwrap();
    let w = e.fs.open(a.ino, libc::O_RDWR).await.unwrap();
    let r = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    e.fs.write(a.ino, w.fh, 0, Bytes::from_static(b"edit"))
        .await
        .unwrap();
    old[..4].copy_from_slice(b"edit");
    write_file(&e.fs, "cfg.tmp", b"new content").await;
    e.fs.rename(
        ROOT_INO,
        OsStr::new("cfg.tmp"),
        ROOT_INO,
        OsStr::new("cfg"),
        0,
    )
    .await
    .unwrap();
    assert_eq!(object(&e.mem, "cfg").await, b"new content");
    assert_eq!(hidden_keys(&e.mem).len(), 1, "{:?}", e.mem.keys());
    let head = e.fs.read(a.ino, r.fh, 0, MIB as u32).await.unwrap();
    assert_eq!(&head[..], &old[..MIB as usize]);
    e.fs.write(a.ino, w.fh, MIB, Bytes::from_static(b"more"))
        .await
        .unwrap();
    old[MIB as usize..MIB as usize + 4].copy_from_slice(b"more");
    e.fs.flush(a.ino, w.fh).await.unwrap();
    e.fs.release(a.ino, w.fh).await.unwrap();
    for off in [MIB, 2 * MIB] {
        let b = e.fs.read(a.ino, r.fh, off, MIB as u32).await.unwrap();
        assert_eq!(&b[..], &old[off as usize..(off + MIB) as usize], "at {off}");
    }
    e.fs.release(a.ino, r.fh).await.unwrap();
    assert_eq!(e.mem.keys(), vec!["cfg".to_string()]);
    assert_eq!(object(&e.mem, "cfg").await, b"new content");
    let now = e.fs.lookup(ROOT_INO, OsStr::new("cfg")).await.unwrap();
    assert_eq!(now.size, 11);
}

/// The hidden directory's name is reserved at the root only.
#[tokio::test]
async fn the_hidden_directory_name_is_reserved_at_the_root() {
    let e = env();
    let name = OsStr::new(".bucketfs-unlinked");
    put(&e.mem, ".bucketfs-unlinked/7-00", b"x").await;
    assert_eq!(e.fs.lookup(ROOT_INO, name).await, Err(FsError::ENOENT));
    assert_eq!(list(&e.fs, ROOT_INO).await, [".", ".."]);
    assert_eq!(
        e.fs.create(ROOT_INO, name, 0o644, 0, libc::O_RDWR, ME)
            .await
            .err(),
        Some(FsError::EPERM)
    );
    assert_eq!(
        e.fs.mkdir(ROOT_INO, name, 0o755, 0, ME).await.err(),
        Some(FsError::EPERM)
    );
    let d =
        e.fs.mkdir(ROOT_INO, OsStr::new("d"), 0o755, 0, ME)
            .await
            .unwrap();
    let (a, h) =
        e.fs.create(d.ino, name, 0o644, 0, libc::O_RDWR, ME)
            .await
            .unwrap();
    e.fs.flush(a.ino, h.fh).await.unwrap();
    e.fs.release(a.ino, h.fh).await.unwrap();
    assert_eq!(list(&e.fs, d.ino).await, [".", "..", ".bucketfs-unlinked"]);
}
