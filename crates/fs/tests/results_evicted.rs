//! Background upload of a file kept open while far more uploads land than the write-back
//! directory remembers the results of (`BUCKETFS_TEST_RESULTS_KEPT`, set for this test
//! binary alone: it is read once per process).

mod support;

use bucketfs_fs::{Fs, WriteBackConfig, ROOT_INO};
use bucketfs_store::memory::MemoryStore;
use bytes::Bytes;
use std::ffi::OsStr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// A file open for writing whose fsync'd version landed, then forgotten by the write-back
/// directory under many other uploads: its next version replaces the landed one (`If-Match`
/// its ETag, learnt by the open file), instead of being refused as a conflict with another
/// client (before: sent as a new file, `If-None-Match: *`, and kept in the write-back
/// directory for good as "changed by another client").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_files_next_version_replaces_its_landed_one_after_its_result_was_forgotten() {
    let (mem, fs, f, fh, _dirs) = landed_and_forgotten().await;
    fs.write(f, fh, 0, Bytes::from_static(b"v2")).await.unwrap();
    fs.flush(f, fh).await.unwrap();
    fs.release(f, fh).await.unwrap();
    let (left, _) = fs.wait_for_uploads(Duration::from_secs(5), |_, _| {}).await;
    let conflicts = fs.metrics().writeback_conflicts.load(Ordering::Relaxed);
    assert_eq!((left, conflicts), (0, 0), "v2 was refused as a conflict");
    assert_eq!(support::object(&mem, "f").await, b"v2");
}

/// The same file, replaced by another client, then renamed: the rename moves only the
/// version the file's upload made (whose ETag the open file learnt), so it is refused
/// (`ESTALE`) and the other client's file stays. An earlier build, with the result
/// forgotten, moved whatever the old name held and took it for the file's own: its next
/// version then replaced the other client's file under the new name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rename_of_an_open_file_after_its_result_was_forgotten_moves_only_its_version() {
    let (mem, fs, f, fh, _dirs) = landed_and_forgotten().await;
    support::put(&mem, "f", b"theirs").await;
    let r = fs
        .rename(ROOT_INO, OsStr::new("f"), ROOT_INO, OsStr::new("f2"), 0)
        .await;
    assert_eq!(r.unwrap_err(), bucketfs_fs::FsError::ESTALE);
    assert_eq!(support::object(&mem, "f").await, b"theirs");
    fs.release(f, fh).await.unwrap();
    fs.wait_for_uploads(Duration::from_secs(5), |_, _| {}).await;
    assert_eq!(support::object(&mem, "f").await, b"theirs");
}

/// A mount remembering 2 upload results, file `f` (ino, handle) open for writing with `v1`
/// uploaded, and 4 uploads since; with the temp dirs to keep.
async fn landed_and_forgotten() -> (
    Arc<MemoryStore>,
    Arc<Fs>,
    u64,
    u64,
    (tempfile::TempDir, tempfile::TempDir),
) {
    std::env::set_var("BUCKETFS_TEST_RESULTS_KEPT", "2");
    let mem = Arc::new(MemoryStore::new());
    let state = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let mut cfg = support::config(&cache);
    cfg.writeback = Some(WriteBackConfig {
        dir: state.path().join("wb"),
        max_bytes: 1 << 30,
        concurrency: 2,
        fsync_waits_upload: true,
        delay: Duration::ZERO,
        space_wait: Duration::from_secs(60),
        store: "memory".to_string(),
    });
    let fs = Fs::new(mem.clone(), cfg);
    let create = |name| support::create_written(&fs, name, libc::O_RDWR, &[]);
    let (f, fh) = create("f").await;
    fs.write(f, fh, 0, Bytes::from_static(b"v1")).await.unwrap();
    fs.fsync(f, fh).await.unwrap(); // in the bucket when it returns
    assert_eq!(support::object(&mem, "f").await, b"v1");
    for name in ["g1", "g2", "g3", "g4"] {
        let (g, gh) = create(name).await;
        fs.flush(g, gh).await.unwrap();
        fs.release(g, gh).await.unwrap();
    }
    let (left, _) = fs.wait_for_uploads(Duration::from_secs(5), |_, _| {}).await;
    assert_eq!(left, 0);
    (mem, fs, f, fh, (state, cache))
}
