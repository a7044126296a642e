//! Background upload (`--upload background`) against the memory store, with another client
//! acting between two requests of the mount.

use crate::support::{config, object, put};
use bucketfs_fs::{Fs, WriteBackConfig, ROOT_INO};
use bucketfs_store::layer::StoreLayer;
use bucketfs_store::memory::MemoryStore;
use bucketfs_store::{ObjectMeta, ObjectStore, StoreResult};
use bytes::Bytes;
use std::ffi::OsStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Another client writing `key` right after the store answers this mount's HEAD of it
/// (once armed).
struct WritesAfterHead {
    inner: Arc<MemoryStore>,
    key: String,
    armed: AtomicBool,
}

#[async_trait::async_trait]
impl StoreLayer for WritesAfterHead {
    type Inner = MemoryStore;
    fn inner(&self) -> &MemoryStore {
        &self.inner
    }
    async fn head(&self, key: &str) -> StoreResult<ObjectMeta> {
        let r = self.inner.head(key).await;
        if key == self.key && self.armed.swap(false, Ordering::SeqCst) {
            put(&self.inner, key, b"theirs, new").await;
        }
        r
    }
}

/// An unlink of a file whose version here waits for upload deletes the object only if it
/// is still the version that one replaces: the DELETE is pinned to it (`If-Match`), so
/// another client's write after the unlink's check is kept (the check alone let it go).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unlink_never_deletes_a_version_written_after_its_check() {
    let mem = Arc::new(MemoryStore::new());
    put(&mem, "f", b"theirs, old").await;
    let store = Arc::new(WritesAfterHead {
        inner: mem.clone(),
        key: "f".into(),
        armed: AtomicBool::new(false),
    });
    let (cache, state) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut cfg = config(&cache);
    cfg.writeback = Some(writeback_config(&state, Duration::from_secs(3600)));
    let fs = Fs::new(store.clone(), cfg);
    let attr = fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    let h = fs
        .open(attr.ino, libc::O_WRONLY | libc::O_TRUNC)
        .await
        .unwrap();
    fs.write(attr.ino, h.fh, 0, Bytes::from_static(b"ours"))
        .await
        .unwrap();
    fs.flush(attr.ino, h.fh).await.unwrap();
    fs.release(attr.ino, h.fh).await.unwrap();
    store.armed.store(true, Ordering::SeqCst);
    fs.unlink(ROOT_INO, OsStr::new("f")).await.unwrap();
    assert!(
        mem.head("f").await.is_ok(),
        "the other client's version was deleted"
    );
    assert_eq!(object(&mem, "f").await, b"theirs, new");
}

/// Background upload with its write-back directory in `state`, uploads after `delay`.
fn writeback_config(state: &tempfile::TempDir, delay: Duration) -> WriteBackConfig {
    WriteBackConfig {
        dir: state.path().join("wb"),
        max_bytes: 1 << 30,
        concurrency: 2,
        fsync_waits_upload: false,
        delay,
        space_wait: Duration::from_secs(60),
        store: "memory".to_string(),
    }
}

/// A background fs over a metered memory store, its state directory in `state`.
fn background_env(state: &tempfile::TempDir, delay: Duration) -> crate::support::Env {
    let wb = writeback_config(state, delay);
    crate::support::env_with(MemoryStore::new(), move |mut c| {
        c.writeback = Some(wb);
        c
    })
}

/// A database-like writer (sysbench's rndwr: small writes all over an open file, fsync
/// every few): each fsync after the first stores only the bytes written since, as a delta
/// over the version still waiting, nothing goes up while the file stays open, and its
/// close uploads the last version once, byte-exact (a shrink and a regrowth included).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fsyncs_of_an_open_file_store_only_their_changes_and_upload_once_at_close() {
    use crate::support::{random, MIB};
    use bucketfs_fs::SetAttr;
    use bucketfs_store::metrics::Op;
    let state = tempfile::tempdir().unwrap();
    let e = background_env(&state, Duration::ZERO);
    put(&e.mem, "db", &random(MIB as usize, 1)).await;
    let mut want = random(MIB as usize, 1);
    let attr = e.fs.lookup(ROOT_INO, OsStr::new("db")).await.unwrap();
    let h = e.fs.open(attr.ino, libc::O_RDWR).await.unwrap();
    let puts = e.metrics.requests(Op::Put);
    let block = random(16 << 10, 2);
    for i in 0..24u64 {
        let at = (i * 7919 * 4096) % (MIB - (16 << 10));
        e.fs.write(attr.ino, h.fh, at, Bytes::copy_from_slice(&block))
            .await
            .unwrap();
        want[at as usize..at as usize + block.len()].copy_from_slice(&block);
        if i == 12 {
            // Cut and grown again: the bytes past the cut read as zeros.
            let cut = SetAttr {
                size: Some(MIB / 2),
                ..SetAttr::default()
            };
            e.fs.setattr(attr.ino, Some(h.fh), cut).await.unwrap();
            want.truncate((MIB / 2) as usize);
            want.resize(MIB as usize, 0);
            e.fs.write(attr.ino, h.fh, MIB - 1, Bytes::from_static(&[7]))
                .await
                .unwrap();
            want[MIB as usize - 1] = 7;
        }
        e.fs.fsync(attr.ino, h.fh).await.unwrap();
    }
    let deltas = e.fs.metrics().writeback_deltas.load(Ordering::Relaxed);
    assert!(deltas >= 20, "{deltas} of 24 fsyncs stored deltas");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        e.metrics.requests(Op::Put),
        puts,
        "a version went up while the file was open"
    );
    let read = e.fs.read(attr.ino, h.fh, 0, MIB as u32).await.unwrap();
    assert!(read[..] == want[..], "the open file reads other bytes");
    let states: Vec<_> = e.fs.pending_uploads().iter().map(|p| p.state).collect();
    assert_eq!(
        states,
        ["parked"],
        "what `bucketfs pending` shows while the file is open"
    );
    e.fs.release(attr.ino, h.fh).await.unwrap();
    for _ in 0..100 {
        if e.metrics.requests(Op::Put) > puts {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (left, _) =
        e.fs.wait_for_uploads(Duration::from_secs(5), |_, _| {})
            .await;
    assert_eq!(left, 0);
    assert_eq!(e.metrics.requests(Op::Put), puts + 1, "one upload at close");
    assert!(
        object(&e.mem, "db").await == want,
        "the bucket holds other bytes"
    );
}

/// With fsync to the bucket, an fsync uploads the version it waits for at once: the upload
/// delay gathers rewrites of a file, and whoever fsyncs wants the version it has (before, the
/// fsync took the whole delay). Other files still wait for their delay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fsync_to_the_bucket_does_not_wait_for_the_upload_delay() {
    let state = tempfile::tempdir().unwrap();
    let mut wb = writeback_config(&state, Duration::from_secs(3600));
    wb.fsync_waits_upload = true;
    let e = crate::support::env_with(MemoryStore::new(), move |mut c| {
        c.writeback = Some(wb);
        c
    });
    let (other, oh) = create_and_write(&e, "other", b"closed, not fsync'd").await;
    e.fs.flush(other, oh).await.unwrap();
    e.fs.release(other, oh).await.unwrap();
    let (ino, fh) = create_and_write(&e, "f", b"fsync'd").await;
    tokio::time::timeout(Duration::from_secs(30), e.fs.fsync(ino, fh))
        .await
        .expect("the fsync waited for the upload delay")
        .unwrap();
    assert_eq!(object(&e.mem, "f").await, b"fsync'd");
    assert!(
        e.mem.head("other").await.is_err(),
        "a file no one waits for went up before its delay"
    );
    e.fs.release(ino, fh).await.unwrap();
}

/// With fsync to the bucket, a version that replaces the one an fsync waits for before it
/// goes up (another descriptor's close, while every upload slot is taken) goes up without
/// its delay too: the fsync waits for it (before, for the whole delay).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fsync_to_the_bucket_does_not_wait_for_the_delay_of_a_version_replacing_its_own() {
    use bucketfs_store::fault::{Fault, FaultStore};
    use bucketfs_store::metrics::Op;
    let (state, cache) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mem = Arc::new(MemoryStore::new());
    let faulty = Arc::new(FaultStore::new(mem.clone()));
    // The first two uploads take both slots (concurrency 2) for two seconds.
    faulty.inject(Op::Put, 0, Some(2), Fault::Delay(Duration::from_secs(2)));
    let mut cfg = config(&cache);
    let mut wb = writeback_config(&state, Duration::from_secs(3600));
    wb.fsync_waits_upload = true;
    cfg.writeback = Some(wb);
    let fs = Fs::new(faulty, cfg);
    let create = |name, body| crate::support::create_written(&fs, name, libc::O_WRONLY, body);
    let fsync = |(ino, fh): (u64, u64)| {
        let fs = fs.clone();
        tokio::spawn(async move { fs.fsync(ino, fh).await })
    };
    let busy = [
        fsync(create("x1", b"x1").await),
        fsync(create("x2", b"x2").await),
    ];
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (ino, fh) = create("f", b"v1").await;
    let waiting = fsync((ino, fh));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let h2 = fs.open(ino, libc::O_WRONLY).await.unwrap();
    fs.write(ino, h2.fh, 0, Bytes::from_static(b"v2"))
        .await
        .unwrap();
    fs.flush(ino, h2.fh).await.unwrap();
    fs.release(ino, h2.fh).await.unwrap();
    tokio::time::timeout(Duration::from_secs(30), waiting)
        .await
        .expect("the fsync waited for the delay of the version replacing its own")
        .unwrap()
        .unwrap();
    assert_eq!(object(&mem, "f").await, b"v2");
    for b in busy {
        b.await.unwrap().unwrap();
    }
}

/// Creates `name` write-only and writes `data` in 1 MiB writes; returns (ino, fh), still open.
async fn create_and_write(e: &crate::support::Env, name: &str, data: &[u8]) -> (u64, u64) {
    crate::support::create_written(&e.fs, name, libc::O_WRONLY, data).await
}

/// Closes (flush, release) and waits for every upload.
async fn close_and_drain(e: &crate::support::Env, ino: u64, fh: u64) {
    e.fs.flush(ino, fh).await.unwrap();
    e.fs.release(ino, fh).await.unwrap();
    let (left, _) =
        e.fs.wait_for_uploads(Duration::from_secs(5), |_, _| {})
            .await;
    assert_eq!(left, 0);
}

fn early_parts(e: &crate::support::Env) -> u64 {
    e.fs.metrics().writeback_early_parts.load(Ordering::Relaxed)
}

/// Uploads left open in the store once their aborts (in the background) are done.
async fn open_uploads(e: &crate::support::Env) -> usize {
    for _ in 0..100 {
        if e.mem.list_multipart_uploads("").await.unwrap().is_empty() {
            return 0;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    e.mem.list_multipart_uploads("").await.unwrap().len()
}

/// Background mode, a file of several parts: its parts go up while it is written (before
/// the close; before: none until its entry's upload), the entry's upload completes that
/// upload without sending them again, and the bucket gets the file byte-exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_big_files_parts_go_up_while_it_is_written_and_only_once() {
    use bucketfs_store::metrics::Op;
    let state = tempfile::tempdir().unwrap();
    // The entry waits an hour: only early parts go up before the drain.
    let e = background_env(&state, Duration::from_secs(3600));
    let data = crate::support::random(30 << 20, 41);
    let (ino, fh) = create_and_write(&e, "big", &data).await;
    let parts = 6; // 5 MiB parts in these tests
    for _ in 0..100 {
        if e.metrics.requests(Op::UploadPart) >= parts - 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        e.metrics.requests(Op::UploadPart) >= 1,
        "no part went up while the file was written"
    );
    close_and_drain(&e, ino, fh).await;
    assert!(
        object(&e.mem, "big").await == data,
        "the bucket holds other bytes"
    );
    assert_eq!(
        e.metrics.requests(Op::UploadPart),
        parts,
        "a part was sent twice"
    );
    assert_eq!(e.metrics.requests(Op::CreateMultipart), 1);
    assert!(early_parts(&e) >= 1);
    assert_eq!(open_uploads(&e).await, 0);
}

/// A part written again after it went up early is sent again from the entry (its early
/// body is stale), after the early request ended: the bucket has the last bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_part_written_again_after_it_went_up_early_is_sent_again() {
    let state = tempfile::tempdir().unwrap();
    let e = background_env(&state, Duration::from_secs(3600));
    let mut data = crate::support::random(30 << 20, 42);
    let (ino, fh) = create_and_write(&e, "big", &data).await;
    let patch = crate::support::random(4096, 43);
    for at in [(12 << 20) + 5, (21 << 20) + 77] {
        e.fs.write(ino, fh, at, Bytes::copy_from_slice(&patch))
            .await
            .unwrap();
        data[at as usize..at as usize + patch.len()].copy_from_slice(&patch);
    }
    close_and_drain(&e, ino, fh).await;
    assert!(
        object(&e.mem, "big").await == data,
        "a stale early part was kept"
    );
    assert_eq!(open_uploads(&e).await, 0);
}

/// A chmod through the open file after its parts began to go up: the entry's metadata is
/// not the early upload's, so that upload is dropped (aborted) and the file goes up whole
/// with the new mode. A rename before the upload: the early upload (of the old key) is
/// dropped, the file goes up under the new name only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn early_parts_are_dropped_for_a_chmod_or_a_rename_before_the_upload() {
    use bucketfs_fs::SetAttr;
    let state = tempfile::tempdir().unwrap();
    let e = background_env(&state, Duration::from_secs(3600));
    let data = crate::support::random(20 << 20, 44);
    let (ino, fh) = create_and_write(&e, "chmodded", &data).await;
    let set = SetAttr {
        mode: Some(0o600),
        ..Default::default()
    };
    e.fs.setattr(ino, Some(fh), set).await.unwrap();
    close_and_drain(&e, ino, fh).await;
    assert!(object(&e.mem, "chmodded").await == data);
    let m = e.mem.head("chmodded").await.unwrap();
    assert_eq!(m.user["mode"], (libc::S_IFREG | 0o600).to_string());

    let (ino, fh) = create_and_write(&e, "before", &data).await;
    e.fs.flush(ino, fh).await.unwrap();
    e.fs.release(ino, fh).await.unwrap();
    e.fs.rename(
        ROOT_INO,
        OsStr::new("before"),
        ROOT_INO,
        OsStr::new("after"),
        0,
    )
    .await
    .unwrap();
    let (left, _) =
        e.fs.wait_for_uploads(Duration::from_secs(5), |_, _| {})
            .await;
    assert_eq!(left, 0);
    assert!(object(&e.mem, "after").await == data);
    assert!(
        e.mem.head("before").await.is_err(),
        "the old name was stored"
    );
    assert_eq!(open_uploads(&e).await, 0, "an early upload was left open");
}

/// fsync before the close (fio's end_fsync, `dd conv=fsync`): the fsync's commit takes the
/// parts sent early (the close after it has nothing to commit), and they are not sent
/// again. A write and an fsync after that store a delta with a later mtime than the early
/// upload's: that upload is dropped, and the bucket gets the last bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn early_parts_survive_an_fsync_before_the_close() {
    use bucketfs_store::metrics::Op;
    let state = tempfile::tempdir().unwrap();
    let e = background_env(&state, Duration::from_secs(3600));
    let data = crate::support::random(30 << 20, 45);
    let (ino, fh) = create_and_write(&e, "big", &data).await;
    e.fs.fsync(ino, fh).await.unwrap();
    close_and_drain(&e, ino, fh).await;
    assert!(object(&e.mem, "big").await == data);
    assert!(
        early_parts(&e) >= 1,
        "the fsync dropped the parts sent early"
    );
    assert_eq!(
        e.metrics.requests(Op::UploadPart),
        6,
        "a part was sent twice"
    );

    let mut data = crate::support::random(30 << 20, 46);
    let (ino, fh) = create_and_write(&e, "big2", &data).await;
    e.fs.fsync(ino, fh).await.unwrap();
    let patch = crate::support::random(4096, 47);
    let at = (16 << 20) + 3;
    e.fs.write(ino, fh, at, Bytes::copy_from_slice(&patch))
        .await
        .unwrap();
    data[at as usize..at as usize + patch.len()].copy_from_slice(&patch);
    e.fs.fsync(ino, fh).await.unwrap();
    close_and_drain(&e, ino, fh).await;
    assert!(
        object(&e.mem, "big2").await == data,
        "a stale early part was kept"
    );
    assert_eq!(open_uploads(&e).await, 0);
}

fn adopted(e: &crate::support::Env) -> u64 {
    e.fs.metrics().writeback_adopted.load(Ordering::Relaxed)
}

/// A big file's staging file (made in the write-back directory) becomes its entry's file
/// at the close, with no copy; the entry reads back whole. An fsync of a file that stays
/// open does the same, and a write after it goes to a copy: the entry stays as fsync'd
/// (were the write to change it in place, its CRC would fail and recovery would drop an
/// acknowledged version). Then the close uploads the last version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_big_files_staging_file_becomes_its_entry_and_stays_as_committed() {
    let state = tempfile::tempdir().unwrap();
    let e = background_env(&state, Duration::from_secs(3600));
    let data = crate::support::random(20 << 20, 51);
    let (ino, fh) = create_and_write(&e, "closed", &data).await;
    e.fs.flush(ino, fh).await.unwrap();
    e.fs.release(ino, fh).await.unwrap();
    assert_eq!(adopted(&e), 1, "the close copied the file");
    assert!(crate::support::read_all(&e.fs, "closed").await == data);

    let mut data = crate::support::random(20 << 20, 52);
    let (ino, fh) = create_and_write(&e, "open", &data).await;
    e.fs.fsync(ino, fh).await.unwrap();
    assert_eq!(adopted(&e), 2, "the fsync copied the file");
    let entry = std::fs::read_dir(state.path().join("wb"))
        .unwrap()
        .map(|d| d.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "wb"))
        .map(|p| std::fs::read(p).unwrap())
        .find(|b| b.len() > data.len() && b[..64] == data[..64])
        .expect("the fsync's entry");
    let patch = vec![9u8; 4096];
    e.fs.write(ino, fh, 4 << 20, Bytes::copy_from_slice(&patch))
        .await
        .unwrap();
    let after = std::fs::read_dir(state.path().join("wb"))
        .unwrap()
        .map(|d| d.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "wb"))
        .map(|p| std::fs::read(p).unwrap())
        .find(|b| b.len() == entry.len() && b[..64] == data[..64])
        .expect("the fsync's entry, after the write");
    assert!(after == entry, "a write after the fsync changed its entry");
    data[4 << 20..(4 << 20) + 4096].copy_from_slice(&patch);
    close_and_drain(&e, ino, fh).await;
    assert!(object(&e.mem, "open").await == data);
    assert!(object(&e.mem, "closed").await == crate::support::random(20 << 20, 51));
}

/// The early upload of a rewrite is gone from the store when the entry's upload comes (a
/// lifecycle rule aborting old uploads, a long queue): the parts go again into a new
/// upload. Before, the store's NoSuchUpload was taken for the object deleted by another
/// client, and the version, stored as a new file only while the key stays free, became a
/// conflict for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rewrite_whose_early_upload_vanished_is_uploaded_anew() {
    let state = tempfile::tempdir().unwrap();
    let e = background_env(&state, Duration::from_secs(3600));
    put(&e.mem, "big", b"theirs, before").await;
    let a = e.fs.lookup(ROOT_INO, OsStr::new("big")).await.unwrap();
    let h =
        e.fs.open(a.ino, libc::O_WRONLY | libc::O_TRUNC)
            .await
            .unwrap();
    let data = crate::support::random(20 << 20, 61);
    // The first whole part starts the upload's creation in the background; the next parts go
    // up early once it is made (a loaded machine may take a while to run that task).
    crate::support::write_mib(&e.fs, a.ino, h.fh, 0, &data[..9 << 20]).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    crate::support::write_mib(&e.fs, a.ino, h.fh, 9 << 20, &data[9 << 20..]).await;
    e.fs.flush(a.ino, h.fh).await.unwrap();
    e.fs.release(a.ino, h.fh).await.unwrap();
    let open = e.mem.list_multipart_uploads("").await.unwrap();
    assert!(!open.is_empty(), "no part went up early");
    for u in open {
        e.mem.abort_multipart(&u.key, &u.upload_id).await.unwrap();
    }
    let (left, failed) =
        e.fs.wait_for_uploads(Duration::from_secs(5), |_, _| {})
            .await;
    assert_eq!((left, failed), (0, 0), "{:?}", e.fs.pending_uploads());
    assert!(object(&e.mem, "big").await == data);
}

/// A memory store that never answers an `UploadPart`.
fn store_stalling_every_part() -> Arc<bucketfs_store::fault::FaultStore> {
    use bucketfs_store::fault::{Fault, FaultStore};
    use bucketfs_store::metrics::Op;
    let faulty = Arc::new(FaultStore::new(Arc::new(MemoryStore::new())));
    faulty.inject(
        Op::UploadPart,
        0,
        None,
        Fault::Delay(Duration::from_secs(3600)),
    );
    faulty
}

/// A part written again while its earlier body still goes up to a store that stalls: the
/// write goes on (the part is left to the entry's upload) instead of waiting for that
/// request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_part_written_again_while_its_early_body_stalls_does_not_wait() {
    let state = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let faulty = store_stalling_every_part();
    let mut cfg = config(&cache);
    cfg.writeback = Some(writeback_config(&state, Duration::from_secs(3600)));
    let fs = Fs::new(faulty, cfg);
    let (a, h) = fs
        .create(
            ROOT_INO,
            OsStr::new("f"),
            0o644,
            0,
            libc::O_RDWR,
            crate::support::ME,
        )
        .await
        .unwrap();
    let data = crate::support::random(20 << 20, 62);
    let rewrite = async {
        for _ in 0..3 {
            crate::support::write_mib(&fs, a.ino, h.fh, 0, &data).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), rewrite)
        .await
        .expect("a write waited for the stalled store");
}

/// Big files written while the store stalls every part: the parts they send early keep
/// their tail's memory until the store answers, which stays within the half of the budget
/// writers' tails may hold, so the close of a file whose bytes are staged (written out of
/// order), whose commit needs a buffer of the budget, does not wait for the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parts_sent_early_to_a_stalled_store_leave_memory_for_a_close() {
    let state = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let faulty = store_stalling_every_part();
    let mut cfg = config(&cache);
    cfg.max_memory = 40 << 20;
    cfg.writeback = Some(writeback_config(&state, Duration::from_secs(3600)));
    let fs = Fs::new(faulty, cfg);
    let big = crate::support::random(30 << 20, 63);
    let mut open = Vec::new();
    for i in 0..4 {
        let (a, h) = fs
            .create(
                ROOT_INO,
                OsStr::new(&format!("big{i}")),
                0o644,
                0,
                libc::O_WRONLY,
                crate::support::ME,
            )
            .await
            .unwrap();
        crate::support::write_mib(&fs, a.ino, h.fh, 0, &big).await;
        open.push((a.ino, h.fh));
    }
    let held = fs.metrics().buffer_bytes.load(Ordering::Relaxed);
    assert!(held >= 10 << 20, "parts went up early: {held} bytes held");
    assert!(held <= 20 << 20, "more than half the budget held: {held}");
    let close_one = async {
        let (a, h) = fs
            .create(
                ROOT_INO,
                OsStr::new("staged"),
                0o644,
                0,
                libc::O_WRONLY,
                crate::support::ME,
            )
            .await
            .unwrap();
        // Backwards: every write goes to the staging file.
        for i in (0..4u64).rev() {
            fs.write(a.ino, h.fh, i << 18, Bytes::from(vec![i as u8; 1 << 18]))
                .await
                .unwrap();
        }
        fs.flush(a.ino, h.fh).await.unwrap();
        fs.release(a.ino, h.fh).await.unwrap();
    };
    tokio::time::timeout(Duration::from_secs(10), close_one)
        .await
        .expect("a close waited for memory the stalled store holds");
}

fn syncs(e: &crate::support::Env) -> u64 {
    e.fs.metrics().writeback_syncs.load(Ordering::Relaxed)
}

fn taken_along(e: &crate::support::Env) -> u64 {
    e.fs.metrics().writeback_along.load(Ordering::Relaxed)
}

/// Group commit: a program that writes to many open files and then fsyncs each in turn
/// (a database's checkpoint, sysbench's rndwr) pays about one sync of the write-back
/// directory per round, not one per file: the first fsync takes the others' changes along
/// and their own fsyncs find nothing to do. Every file still reads, and uploads at its
/// close, byte-exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fsyncs_of_many_files_in_turn_share_one_sync() {
    use crate::support::random;
    let state = tempfile::tempdir().unwrap();
    let e = background_env(&state, Duration::from_secs(3600));
    let n = 32;
    let mut files = Vec::new();
    for i in 0..n {
        let data = random(64 << 10, 100 + i as u64);
        let (ino, fh) = create_and_write(&e, &format!("f{i}"), &data).await;
        e.fs.fsync(ino, fh).await.unwrap();
        files.push((ino, fh, data));
    }
    // Rounds of a write to each file, then an fsync of each.
    let mut rounds = Vec::new();
    for r in 0..3u64 {
        let before = syncs(&e);
        for (i, (ino, fh, data)) in files.iter_mut().enumerate() {
            let block = random(4096, 200 + r * 100 + i as u64);
            let at = (i as u64 * 1237 + r * 4999) % (60 << 10);
            e.fs.write(*ino, *fh, at, Bytes::copy_from_slice(&block))
                .await
                .unwrap();
            data[at as usize..at as usize + block.len()].copy_from_slice(&block);
        }
        for (ino, fh, _) in &files {
            e.fs.fsync(*ino, *fh).await.unwrap();
        }
        rounds.push(syncs(&e) - before);
    }
    // Shared by the commits in flight at the same moment (waves of them, as they reach
    // the sync): fewer than the fsyncs, however the threads are scheduled.
    assert!(
        rounds.iter().min().is_some_and(|r| *r <= 3 * n as u64 / 4),
        "syncs per round of {n} fsyncs of changed files: {rounds:?} (one each before), {} taken along",
        taken_along(&e)
    );
    assert!(
        taken_along(&e) >= 3 * (n - 8) as u64,
        "{} taken along",
        taken_along(&e)
    );
    for (i, (ino, fh, data)) in files.iter().enumerate() {
        let read = e.fs.read(*ino, *fh, 0, data.len() as u32).await.unwrap();
        assert!(read[..] == data[..], "f{i} reads other bytes");
        e.fs.flush(*ino, *fh).await.unwrap();
        e.fs.release(*ino, *fh).await.unwrap();
    }
    let (left, _) =
        e.fs.wait_for_uploads(Duration::from_secs(5), |_, _| {})
            .await;
    assert_eq!(left, 0);
    for (i, (_, _, data)) in files.iter().enumerate() {
        assert!(
            object(&e.mem, &format!("f{i}")).await == *data,
            "the bucket holds other bytes for f{i}"
        );
    }
}

/// What an fsync takes along is bounded: never a file's first version (a file neither
/// closed nor fsync'd never comes back after a crash), never a file cut shorter since its
/// fsync (a truncate then a rewrite is never stored half done), and a file written beside
/// one that is fsync'd often is taken once per fsync of its own, not at every other fsync.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_fsync_takes_along_only_files_fsyncd_since_and_never_a_first_version() {
    use crate::support::random;
    let state = tempfile::tempdir().unwrap();
    let e = background_env(&state, Duration::from_secs(3600));
    let (new_ino, new_fh) = create_and_write(&e, "never-synced", &random(8192, 1)).await;
    let (data_ino, data_fh) = create_and_write(&e, "data", &random(64 << 10, 2)).await;
    e.fs.fsync(data_ino, data_fh).await.unwrap();
    let cut_old = random(64 << 10, 5);
    let (cut_ino, cut_fh) = create_and_write(&e, "cut", &cut_old).await;
    e.fs.fsync(cut_ino, cut_fh).await.unwrap();
    // Cut, then the start of a rewrite: a delta small enough to be taken.
    let cut = bucketfs_fs::SetAttr {
        size: Some(40 << 10),
        ..bucketfs_fs::SetAttr::default()
    };
    e.fs.setattr(cut_ino, Some(cut_fh), cut).await.unwrap();
    e.fs.write(cut_ino, cut_fh, 0, Bytes::from(random(4096, 6)))
        .await
        .unwrap();
    let (wal_ino, wal_fh) = create_and_write(&e, "wal", &random(4096, 3)).await;
    let block = random(4096, 4);
    for i in 0..10u64 {
        e.fs.write(data_ino, data_fh, i * 4096, Bytes::copy_from_slice(&block))
            .await
            .unwrap();
        e.fs.write(new_ino, new_fh, i, Bytes::copy_from_slice(&block[..1]))
            .await
            .unwrap();
        e.fs.write(
            wal_ino,
            wal_fh,
            4096 * (i + 1),
            Bytes::copy_from_slice(&block),
        )
        .await
        .unwrap();
        e.fs.fsync(wal_ino, wal_fh).await.unwrap();
    }
    // Its commit runs beside the fsync that took it.
    for _ in 0..250 {
        if taken_along(&e) > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(taken_along(&e), 1, "times the data file was taken along");
    let pending: Vec<(String, u64)> =
        e.fs.pending_uploads()
            .into_iter()
            .map(|p| (p.key, p.size))
            .collect();
    assert!(
        !pending.iter().any(|(k, _)| k == "never-synced"),
        "a file never closed or fsync'd was committed: {pending:?}"
    );
    assert!(
        pending.contains(&("cut".to_string(), cut_old.len() as u64)),
        "the cut file's version is not the one its fsync stored: {pending:?}"
    );
    for (ino, fh) in [
        (new_ino, new_fh),
        (data_ino, data_fh),
        (wal_ino, wal_fh),
        (cut_ino, cut_fh),
    ] {
        e.fs.flush(ino, fh).await.unwrap();
        e.fs.release(ino, fh).await.unwrap();
    }
}

const KIB: u64 = 1024;

/// A background fs whose write-back directory (bound 1 MiB, uploads after 120 s, a close
/// waiting at most 5 s for room) has 600 KiB held by a conflict, which never goes up by
/// itself: another client made `c` before its upload, tried at once by a drain.
async fn env_with_600k_conflict(state: &tempfile::TempDir) -> crate::support::Env {
    let mut wb = writeback_config(state, Duration::from_secs(120));
    wb.max_bytes = 1024 * KIB;
    wb.space_wait = Duration::from_secs(5);
    let e = crate::support::env_with(MemoryStore::new(), move |mut c| {
        c.writeback = Some(wb);
        c
    });
    let c = crate::support::random(600 * KIB as usize, 1);
    let (ino, fh) = create_and_write(&e, "c", &c).await;
    e.fs.flush(ino, fh).await.unwrap();
    e.fs.release(ino, fh).await.unwrap();
    put(&e.mem, "c", b"theirs").await;
    e.fs.wait_for_uploads(Duration::from_secs(5), |_, _| {})
        .await;
    let conflicts = e.fs.metrics().writeback_conflicts.load(Ordering::Relaxed);
    assert_eq!(conflicts, 1, "c is a conflict");
    e
}

/// A write-back directory with no room for a close (its bound held by a conflict, which
/// never goes up by itself) makes that close upload the file itself, as sync mode does,
/// instead of failing with `ENOSPC`; and only once the version of the same file still
/// queued before it has landed (sent at once, not after its 120 s delay), so that version
/// never lands over it (nor fails as a conflict against it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_close_with_no_room_uploads_itself_after_the_version_queued_before_it() {
    use crate::support::{random, write_mib};
    let state = tempfile::tempdir().unwrap();
    let e = env_with_600k_conflict(&state).await;
    let conflicts = || e.fs.metrics().writeback_conflicts.load(Ordering::Relaxed);
    let direct = || e.fs.metrics().writeback_direct.load(Ordering::Relaxed);
    // f's first version (300 KiB) fits and waits its 120 s.
    let v1 = random(300 * KIB as usize, 2);
    let (ino, fh) = create_and_write(&e, "f", &v1).await;
    e.fs.flush(ino, fh).await.unwrap();
    e.fs.release(ino, fh).await.unwrap();
    // Its second (500 KiB) does not: 600 + 500 KiB over the bound, with v1's room free.
    let v2 = random(500 * KIB as usize, 3);
    let h =
        e.fs.open(ino, libc::O_WRONLY | libc::O_TRUNC)
            .await
            .unwrap();
    write_mib(&e.fs, ino, h.fh, 0, &v2).await;
    e.fs.flush(ino, h.fh).await.expect("the close uploads it");
    assert!(object(&e.mem, "f").await == v2, "in the bucket at close");
    assert_eq!(direct(), 1);
    e.fs.release(ino, h.fh).await.unwrap();
    // v1 landed before v2 went up: nothing lands over it later, no conflict.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        object(&e.mem, "f").await == v2,
        "the older version landed over it"
    );
    assert_eq!(conflicts(), 1, "the older version failed as a conflict");
    let pending: Vec<String> = e.fs.pending_uploads().into_iter().map(|p| p.key).collect();
    assert_eq!(pending, vec!["c".to_string()], "only the conflict is left");
}

/// A file uploaded directly (no room in the write-back directory) that another client
/// changed since this mount read it is refused (`ESTALE`), and so is every later close or
/// fsync of it until it is written again: only a version written after the refusal goes
/// over the other client's (before: the next close overwrote it, unasked).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_upload_refused_as_a_conflict_stays_refused_until_written_again() {
    use crate::support::{random, write_mib};
    let state = tempfile::tempdir().unwrap();
    let e = env_with_600k_conflict(&state).await;
    put(&e.mem, "g", b"base").await;
    let attr = e.fs.lookup(ROOT_INO, OsStr::new("g")).await.unwrap();
    let h = e.fs.open(attr.ino, libc::O_RDWR).await.unwrap();
    let ours = random(500 * KIB as usize, 2);
    write_mib(&e.fs, attr.ino, h.fh, 0, &ours).await;
    put(&e.mem, "g", b"theirs, since").await;
    let refused = e.fs.fsync(attr.ino, h.fh).await;
    assert_eq!(refused, Err(bucketfs_fs::FsError::ESTALE));
    let again = e.fs.flush(attr.ino, h.fh).await;
    assert_eq!(again, Err(bucketfs_fs::FsError::ESTALE), "refused again");
    assert_eq!(object(&e.mem, "g").await, b"theirs, since");
    // Written again: that version goes over theirs.
    e.fs.write(attr.ino, h.fh, 0, Bytes::from_static(b"X"))
        .await
        .unwrap();
    e.fs.flush(attr.ino, h.fh).await.expect("a rewrite goes up");
    let mut want = ours;
    want[0] = b'X';
    assert!(object(&e.mem, "g").await == want);
    e.fs.release(attr.ino, h.fh).await.unwrap();
}

/// A background fs (uploads at once) whose file `f` ("data", mode 0644; `over` an object
/// another client made) went up with the answer to its `PUT` lost: its entry failed, to be
/// tried again later; and its inode.
async fn fs_with_a_lost_answer(
    over: bool,
) -> (Arc<MemoryStore>, Arc<Fs>, u64, [tempfile::TempDir; 2]) {
    use bucketfs_store::fault::{Fault, FaultStore};
    use bucketfs_store::metrics::Op;
    let mem = Arc::new(MemoryStore::new());
    let faulty = Arc::new(FaultStore::new(mem.clone()));
    faulty.inject(Op::Put, 0, Some(1), Fault::DropAfter);
    let state = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let mut cfg = config(&cache);
    cfg.writeback = Some(writeback_config(&state, Duration::ZERO));
    if over {
        put(&mem, "f", b"base").await;
    }
    let fs = Fs::new(faulty, cfg);
    if over {
        // As the kernel does before a create.
        fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    }
    let (a, h) = fs
        .create(
            ROOT_INO,
            OsStr::new("f"),
            0o644,
            0,
            libc::O_WRONLY | libc::O_TRUNC,
            crate::support::ME,
        )
        .await
        .unwrap();
    fs.write(a.ino, h.fh, 0, Bytes::from_static(b"data"))
        .await
        .unwrap();
    fs.flush(a.ino, h.fh).await.unwrap();
    fs.release(a.ino, h.fh).await.unwrap();
    let errors = || fs.metrics().writeback_upload_errors.load(Ordering::Relaxed);
    for _ in 0..500 {
        if errors() > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(errors(), 1, "the upload landed and failed");
    assert_eq!(object(&mem, "f").await, b"data");
    (mem, fs, a.ino, [state, cache])
}

/// The mode an object's metadata says.
fn stored_mode(m: &ObjectMeta) -> Option<u32> {
    m.user
        .get("mode")
        .map(|v| v.parse::<u32>().unwrap() & 0o7777)
}

/// A file whose upload landed with its answer lost (its entry failed, to be tried again),
/// then chmod'ed: the chmod's version, the same bytes with another mode, goes over the
/// landed one, so the bucket gets the new mode (before: the upload took the object, whose
/// ETag and size were its own, for itself already there, and the mode never reached the
/// bucket).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chmod_after_an_upload_whose_answer_was_lost_reaches_the_bucket() {
    use bucketfs_fs::SetAttr;
    let (mem, fs, ino, _dirs) = fs_with_a_lost_answer(false).await;
    assert_eq!(stored_mode(&mem.head("f").await.unwrap()), Some(0o644));
    let chmod = SetAttr {
        mode: Some(0o600),
        ..SetAttr::default()
    };
    fs.setattr(ino, None, chmod).await.unwrap();
    let (left, _) = fs.wait_for_uploads(Duration::from_secs(5), |_, _| {}).await;
    assert_eq!(left, 0);
    assert_eq!(stored_mode(&mem.head("f").await.unwrap()), Some(0o600));
    assert_eq!(object(&mem, "f").await, b"data");
    assert_eq!(fs.metrics().writeback_conflicts.load(Ordering::Relaxed), 0);
}

/// A file whose upload landed with its answer lost, renamed: the object at its name is this
/// mount's own version, not another client's, so the rename goes through and the file ends
/// at its new name alone (before: `ESTALE` until the entry's retry, 10 s to 5 min later),
/// also when that version replaced another client's object.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rename_after_an_upload_whose_answer_was_lost_goes_through() {
    for over in [false, true] {
        let (mem, fs, _ino, _dirs) = fs_with_a_lost_answer(over).await;
        fs.rename(ROOT_INO, OsStr::new("f"), ROOT_INO, OsStr::new("g"), 0)
            .await
            .unwrap_or_else(|e| panic!("over an object: {over}: {e:?}"));
        let (left, _) = fs.wait_for_uploads(Duration::from_secs(5), |_, _| {}).await;
        assert_eq!(left, 0);
        assert_eq!(object(&mem, "g").await, b"data");
        assert!(mem.head("f").await.is_err(), "f is gone");
        assert_eq!(fs.metrics().writeback_conflicts.load(Ordering::Relaxed), 0);
    }
}

/// A new file being written here in a directory renamed after another client made a file
/// of the same name: its version replaces nothing, so it is a conflict against the copy of
/// the other client's file under the new name, never stored over it (an earlier build
/// took the copy for its base: the upload replaced the other client's file).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_file_below_a_renamed_directory_never_replaces_another_clients_copy() {
    use crate::support::ME;
    let state = tempfile::tempdir().unwrap();
    let e = background_env(&state, Duration::ZERO);
    let d =
        e.fs.mkdir(ROOT_INO, OsStr::new("d"), 0o755, 0, ME)
            .await
            .unwrap();
    let (f, h) =
        e.fs.create(d.ino, OsStr::new("f"), 0o644, 0, libc::O_WRONLY, ME)
            .await
            .unwrap();
    e.fs.write(f.ino, h.fh, 0, Bytes::from_static(b"ours"))
        .await
        .unwrap();
    put(&e.mem, "d/f", b"theirs").await;
    e.fs.rename(ROOT_INO, OsStr::new("d"), ROOT_INO, OsStr::new("d2"), 0)
        .await
        .unwrap();
    e.fs.flush(f.ino, h.fh).await.unwrap();
    e.fs.release(f.ino, h.fh).await.unwrap();
    e.fs.wait_for_uploads(Duration::from_secs(5), |_, _| {})
        .await;
    assert_eq!(object(&e.mem, "d2/f").await, b"theirs");
    let conflicts = e.fs.metrics().writeback_conflicts.load(Ordering::Relaxed);
    assert_eq!(conflicts, 1, "ours is kept as a conflict");
}

/// A file still open here whose version went up, replaced by another client, then its
/// directory renamed: the copy under the new name is of the other client's version, so the
/// file's next version is a conflict against it, never stored over it (an earlier build
/// took any copy for the file's own once it had committed: the other client's file was then
/// in the bucket nowhere, its old name deleted by the rename and its copy replaced).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uploaded_file_below_a_renamed_directory_never_replaces_another_clients_copy() {
    use crate::support::ME;
    let state = tempfile::tempdir().unwrap();
    let e = background_env(&state, Duration::ZERO);
    let d =
        e.fs.mkdir(ROOT_INO, OsStr::new("d"), 0o755, 0, ME)
            .await
            .unwrap();
    let (f, h) =
        e.fs.create(d.ino, OsStr::new("f"), 0o644, 0, libc::O_WRONLY, ME)
            .await
            .unwrap();
    e.fs.write(f.ino, h.fh, 0, Bytes::from_static(b"ours1"))
        .await
        .unwrap();
    e.fs.flush(f.ino, h.fh).await.unwrap();
    e.fs.wait_for_uploads(Duration::from_secs(5), |_, _| {})
        .await;
    assert_eq!(object(&e.mem, "d/f").await, b"ours1");
    put(&e.mem, "d/f", b"theirs").await;
    e.fs.rename(ROOT_INO, OsStr::new("d"), ROOT_INO, OsStr::new("d2"), 0)
        .await
        .unwrap();
    e.fs.write(f.ino, h.fh, 0, Bytes::from_static(b"ours2"))
        .await
        .unwrap();
    e.fs.flush(f.ino, h.fh).await.unwrap();
    e.fs.release(f.ino, h.fh).await.unwrap();
    e.fs.wait_for_uploads(Duration::from_secs(5), |_, _| {})
        .await;
    assert_eq!(object(&e.mem, "d2/f").await, b"theirs");
    let conflicts = e.fs.metrics().writeback_conflicts.load(Ordering::Relaxed);
    assert_eq!(conflicts, 1, "ours is kept as a conflict");
}

/// A file open below a directory being renamed, whose first upload landed with its answer
/// lost and whose next version's upload failed: the object the rename finds at the old name
/// is the file's own (the rename checks that), so its copy under the new name is what the
/// next version replaces. It is no conflict: an earlier draft of the check above counted
/// it as another client's (the moved entry no longer carried the landed ETag) and kept the
/// file in the write-back directory for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renamed_directorys_file_whose_own_upload_landed_unanswered_is_no_conflict() {
    use bucketfs_store::fault::{Fault, FaultStore};
    use bucketfs_store::metrics::Op;
    use bucketfs_store::StoreError;
    let mem = Arc::new(MemoryStore::new());
    let faulty = Arc::new(FaultStore::new(mem.clone()));
    // The first upload lands, its answer lost; the second fails.
    faulty.inject(Op::Put, 0, Some(1), Fault::DropAfter);
    let refused = StoreError::Transient("injected".into());
    faulty.inject(Op::Put, 1, Some(1), Fault::Error(refused));
    let state = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let mut cfg = config(&cache);
    cfg.writeback = Some(writeback_config(&state, Duration::ZERO));
    put(&mem, "d/", b"").await;
    let fs = Fs::new(faulty, cfg);
    let d = fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    let (f, h) = fs
        .create(
            d.ino,
            OsStr::new("f"),
            0o644,
            0,
            libc::O_WRONLY,
            crate::support::ME,
        )
        .await
        .unwrap();
    let errors = || fs.metrics().writeback_upload_errors.load(Ordering::Relaxed);
    let wait_errors = |n: u64| async move {
        for _ in 0..500 {
            if errors() >= n {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(errors(), n);
    };
    fs.write(f.ino, h.fh, 0, Bytes::from_static(b"v1"))
        .await
        .unwrap();
    fs.flush(f.ino, h.fh).await.unwrap();
    wait_errors(1).await;
    assert_eq!(object(&mem, "d/f").await, b"v1", "landed, unanswered");
    fs.write(f.ino, h.fh, 0, Bytes::from_static(b"v2"))
        .await
        .unwrap();
    fs.flush(f.ino, h.fh).await.unwrap();
    wait_errors(2).await;
    fs.rename(ROOT_INO, OsStr::new("d"), ROOT_INO, OsStr::new("d2"), 0)
        .await
        .unwrap();
    fs.release(f.ino, h.fh).await.unwrap();
    let (left, _) = fs.wait_for_uploads(Duration::from_secs(5), |_, _| {}).await;
    let conflicts = fs.metrics().writeback_conflicts.load(Ordering::Relaxed);
    assert_eq!((left, conflicts), (0, 0));
    assert_eq!(object(&mem, "d2/f").await, b"v2");
}

/// An open for writing of a file while a rename of that file is copying it: the writer took
/// the old name (no write state was there when the rename started, and the rename moves
/// only those), so its close queued an upload to `f` after the rename had deleted it. `f`
/// came back with the new bytes and `g` kept the old ones. A writer's open now waits for a
/// rename of its file under way (as in sync mode), and writes to `g`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_racing_a_rename_of_its_file_writes_to_the_new_name() {
    use crate::support::{Gate, HoldsCopyAnswer};
    let mem = Arc::new(MemoryStore::new());
    put(&mem, "f", b"old").await;
    let store = Arc::new(HoldsCopyAnswer {
        inner: mem.clone(),
        key: "g".into(),
        gate: Gate::new(true),
    });
    let (cache, state) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut cfg = config(&cache);
    cfg.writeback = Some(writeback_config(&state, Duration::ZERO));
    let fs = Fs::new(store.clone(), cfg);
    let f = fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    let rename = tokio::spawn({
        let fs = fs.clone();
        async move {
            fs.rename(ROOT_INO, OsStr::new("f"), ROOT_INO, OsStr::new("g"), 0)
                .await
        }
    });
    store.gate.reached().await;
    let writer = tokio::spawn({
        let fs = fs.clone();
        async move {
            let h = fs.open(f.ino, libc::O_WRONLY | libc::O_TRUNC).await?;
            fs.write(f.ino, h.fh, 0, Bytes::from_static(b"new")).await?;
            fs.flush(f.ino, h.fh).await?;
            fs.release(f.ino, h.fh).await
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    store.gate.open();
    rename.await.unwrap().unwrap();
    writer.await.unwrap().unwrap();
    let (left, _) = fs.wait_for_uploads(Duration::from_secs(5), |_, _| {}).await;
    assert_eq!(left, 0);
    assert!(mem.head("f").await.is_err(), "the old name came back");
    assert_eq!(object(&mem, "g").await, b"new");
}

/// A file created in a directory while a rename of the directory is copying it (the create
/// does not wait for it) is uploaded below the new name, never bringing the old directory
/// back: the rename moves the new file's write state along.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_racing_a_rename_of_its_directory_lands_below_the_new_name() {
    use crate::support::{Gate, HoldsCopyAnswer, ME};
    let mem = Arc::new(MemoryStore::new());
    put(&mem, "d/a", b"a").await;
    let store = Arc::new(HoldsCopyAnswer {
        inner: mem.clone(),
        key: "e/a".into(),
        gate: Gate::new(true),
    });
    let (cache, state) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut cfg = config(&cache);
    cfg.writeback = Some(writeback_config(&state, Duration::ZERO));
    let fs = Fs::new(store.clone(), cfg);
    let d = fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    let rename = tokio::spawn({
        let fs = fs.clone();
        async move {
            fs.rename(ROOT_INO, OsStr::new("d"), ROOT_INO, OsStr::new("e"), 0)
                .await
        }
    });
    store.gate.reached().await;
    let writer = tokio::spawn({
        let fs = fs.clone();
        async move {
            let (a, h) = fs
                .create(d.ino, OsStr::new("n"), 0o644, 0, libc::O_WRONLY, ME)
                .await?;
            fs.write(a.ino, h.fh, 0, Bytes::from_static(b"new")).await?;
            fs.flush(a.ino, h.fh).await?;
            fs.release(a.ino, h.fh).await
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    store.gate.open();
    rename.await.unwrap().unwrap();
    writer.await.unwrap().unwrap();
    let (left, _) = fs.wait_for_uploads(Duration::from_secs(5), |_, _| {}).await;
    assert_eq!(left, 0);
    assert!(
        mem.head("d/n").await.is_err(),
        "the old directory came back"
    );
    assert!(mem.head("d/a").await.is_err());
    assert_eq!(object(&mem, "e/n").await, b"new");
    assert_eq!(object(&mem, "e/a").await, b"a");
}

/// A chmod, and a truncate, of a closed file whose version waits for upload while a program
/// has it open for reading only (`tail -f`, a web server): the change went into the file's
/// write state alone, which only a writer's close commits, and no writer came. It was never
/// stored, even by a clean unmount. With no writer open, it is committed at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chmod_or_truncate_while_only_readers_have_the_file_open_is_stored() {
    use bucketfs_fs::SetAttr;
    let state = tempfile::tempdir().unwrap();
    let e = background_env(&state, Duration::from_secs(3600));
    for (name, set) in [
        (
            "m",
            SetAttr {
                mode: Some(0o600),
                ..SetAttr::default()
            },
        ),
        (
            "t",
            SetAttr {
                size: Some(1),
                ..SetAttr::default()
            },
        ),
    ] {
        let (ino, fh) = create_and_write(&e, name, b"abc").await;
        e.fs.flush(ino, fh).await.unwrap();
        e.fs.release(ino, fh).await.unwrap();
        let r = e.fs.open(ino, libc::O_RDONLY).await.unwrap();
        e.fs.setattr(ino, None, set).await.unwrap();
        e.fs.release(ino, r.fh).await.unwrap();
    }
    let (left, _) =
        e.fs.wait_for_uploads(Duration::from_secs(5), |_, _| {})
            .await;
    assert_eq!(left, 0);
    let m = e.mem.head("m").await.unwrap();
    assert_eq!(m.user["mode"], (libc::S_IFREG | 0o600).to_string());
    assert_eq!(object(&e.mem, "t").await, b"a");
}

/// Background mode: a descriptor open for writing that wrote nothing commits nothing at
/// its close, so another writer's half-written file never goes up as a version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_close_that_wrote_nothing_commits_no_half_file() {
    let state = tempfile::tempdir().unwrap();
    let e = background_env(&state, Duration::ZERO);
    put(&e.mem, "f", b"the old version").await;
    let attr = e.fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    let writer =
        e.fs.open(attr.ino, libc::O_WRONLY | libc::O_TRUNC)
            .await
            .unwrap();
    e.fs.write(attr.ino, writer.fh, 0, Bytes::from_static(b"first half, "))
        .await
        .unwrap();
    let idle = e.fs.open(attr.ino, libc::O_RDWR).await.unwrap();
    e.fs.flush(attr.ino, idle.fh).await.unwrap();
    e.fs.release(attr.ino, idle.fh).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        e.fs.pending_uploads().is_empty(),
        "the idle close committed"
    );
    assert_eq!(object(&e.mem, "f").await, b"the old version");
    e.fs.write(attr.ino, writer.fh, 12, Bytes::from_static(b"second half"))
        .await
        .unwrap();
    e.fs.flush(attr.ino, writer.fh).await.unwrap();
    e.fs.release(attr.ino, writer.fh).await.unwrap();
    for _ in 0..100 {
        if object(&e.mem, "f").await == b"first half, second half" {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the writer's close never went up");
}

/// Holds the answer of a PUT of `key` at its gate: the upload has landed, the mount does not
/// know it yet.
struct HoldsPutAnswer {
    inner: Arc<MemoryStore>,
    key: String,
    gate: crate::support::Gate,
}

#[async_trait::async_trait]
impl StoreLayer for HoldsPutAnswer {
    type Inner = MemoryStore;
    fn inner(&self) -> &MemoryStore {
        &self.inner
    }
    async fn put_if(
        &self,
        key: &str,
        body: Bytes,
        meta: &bucketfs_store::UserMeta,
        if_match: Option<&str>,
        headers_from: Option<bucketfs_store::HeadersFrom<'_>>,
    ) -> StoreResult<String> {
        let r = self
            .inner
            .put_if(key, body, meta, if_match, headers_from)
            .await;
        self.gate.pass(key == self.key).await;
        r
    }
}

/// A file renamed while its upload is in flight (`tmp` then `mv`, as every atomic writer
/// does), then unlinked: the rename waited for the upload, moved the object, and dropped
/// the file's state; the inode, never stored under its own name before, did not count as
/// in the bucket, so the unlink sent no DELETE. It returned 0 and the file came back at the
/// next listing (git branch -D, rsync --delete, rm -rf: ENOTEMPTY).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_renamed_while_its_upload_lands_is_deleted_by_its_unlink() {
    let mem = Arc::new(MemoryStore::new());
    let store = Arc::new(HoldsPutAnswer {
        inner: mem.clone(),
        key: "f.tmp".into(),
        gate: crate::support::Gate::new(true),
    });
    let (cache, state) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut cfg = config(&cache);
    cfg.writeback = Some(writeback_config(&state, Duration::ZERO));
    let fs = Fs::new(store.clone(), cfg);
    // The kernel sends the release after close(2) returned: the rename can come first.
    let (ino, fh) = crate::support::write_open(&fs, "f.tmp", b"new bytes").await;
    fs.flush(ino, fh).await.unwrap();
    store.gate.reached().await;
    let rename = tokio::spawn({
        let fs = fs.clone();
        async move {
            fs.rename(ROOT_INO, OsStr::new("f.tmp"), ROOT_INO, OsStr::new("f"), 0)
                .await
        }
    });
    // The rename waits for the upload in flight.
    tokio::time::sleep(Duration::from_millis(300)).await;
    store.gate.open();
    rename.await.unwrap().unwrap();
    fs.release(ino, fh).await.unwrap();
    assert_eq!(object(&mem, "f").await, b"new bytes");
    fs.unlink(ROOT_INO, OsStr::new("f")).await.unwrap();
    let (left, _) = fs.wait_for_uploads(Duration::from_secs(5), |_, _| {}).await;
    assert_eq!(left, 0);
    assert_eq!(mem.keys(), Vec::<String>::new(), "an unlinked file stayed");
}

/// The store down (every PUT fails), the write-back directory full: the first close to
/// find no room waits `space_wait` for an upload to free some, then uploads its file itself
/// (and gets its error). Closes after it, nothing having landed since, do the same at once:
/// each waited a `space_wait` of its own (60 s by default: 380 closes, hours).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closes_after_the_first_that_waited_for_room_in_vain_do_not_wait_again() {
    use bucketfs_store::fault::{Fault, FaultStore};
    use bucketfs_store::metrics::Op;
    use bucketfs_store::StoreError;
    let (state, cache) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let faulty = Arc::new(FaultStore::new(Arc::new(MemoryStore::new())));
    faulty.inject(
        Op::Put,
        0,
        None,
        Fault::Error(StoreError::Other("the store is down".into())),
    );
    let mut wb = writeback_config(&state, Duration::ZERO);
    wb.max_bytes = 1024 * KIB;
    wb.space_wait = Duration::from_secs(3);
    let mut cfg = config(&cache);
    cfg.writeback = Some(wb);
    let fs = Fs::new(faulty, cfg);
    let close = |name: &'static str| {
        let fs = fs.clone();
        async move {
            let data = crate::support::random(600 * KIB as usize, 9);
            let (ino, fh) = crate::support::write_open(&fs, name, &data).await;
            let started = std::time::Instant::now();
            let r = fs.flush(ino, fh).await;
            let _ = fs.release(ino, fh).await;
            (r, started.elapsed())
        }
    };
    let (r, _) = close("a").await;
    assert_eq!(r, Ok(()), "a fits");
    let (r, took) = close("b").await;
    assert!(r.is_err(), "b went to the store itself, which is down");
    assert!(took >= Duration::from_secs(2), "b waited for room first");
    for name in ["c", "d"] {
        let (r, took) = close(name).await;
        assert!(r.is_err());
        assert!(
            took < Duration::from_secs(2),
            "{name} waited {took:?} again, nothing having landed since b"
        );
    }
}
