//! Store and local failures (fault store, missing staging dir): reported, retried, nothing lost.

use crate::support::{
    config, counter, faulty_fs, object, put, random, read_all, write_file, write_mib, write_open,
    ME, MIB,
};
use bucketfs_fs::{Fs, FsConfig, FsError, SetAttr, ROOT_INO};
use bucketfs_store::fault::{Fault, FaultStore};
use bucketfs_store::memory::MemoryStore;
use bucketfs_store::metrics::Op;
use bucketfs_store::{ObjectStore, StoreError};
use bytes::Bytes;
use std::ffi::OsStr;
use std::sync::Arc;
use std::time::Duration;

/// `ftruncate` of open file `ino` to `size`.
async fn set_size(fs: &Fs, ino: u64, fh: u64, size: u64) {
    let set = SetAttr {
        size: Some(size),
        ..SetAttr::default()
    };
    fs.setattr(ino, Some(fh), set).await.unwrap();
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

/// A write that crosses a part's end, whose first half went into the part in memory and whose
/// second half then could not be staged (no room in memory while the part goes up, and a
/// staging disk that fails): it failed as a whole, though its first half was in the file and
/// stored at close (a torn record, written twice by an O_APPEND writer's retry). It is a
/// short write now: the count says what the file took.
#[tokio::test]
async fn a_write_failing_halfway_is_a_short_write() {
    let mem = Arc::new(MemoryStore::new());
    let faulty = Arc::new(FaultStore::new(mem.clone()));
    faulty.inject(
        Op::UploadPart,
        0,
        None,
        Fault::Delay(Duration::from_millis(300)),
    );
    let cache = tempfile::tempdir().unwrap();
    let fs = Fs::new(
        faulty.clone(),
        FsConfig {
            cache_dir: cache.path().join("missing"),
            max_memory: 12 * MIB,
            ..config(&cache)
        },
    );
    let (attr, h) = fs
        .create(ROOT_INO, OsStr::new("log"), 0o644, 0, libc::O_WRONLY, ME)
        .await
        .unwrap();
    let first = 5 * MIB - 4096;
    let data = random(first as usize, 43);
    fs.write(attr.ino, h.fh, 0, Bytes::from(data))
        .await
        .unwrap();
    let r = fs
        .write(attr.ino, h.fh, first, Bytes::from(vec![7u8; 8192]))
        .await;
    let size = fs.getattr(attr.ino).await.unwrap().size;
    let took = r.map_or(0, u64::from);
    assert_eq!(
        size,
        first + took,
        "{r:?}: the file took other bytes than the count says"
    );
    let _ = fs.flush(attr.ino, h.fh).await;
    fs.release(attr.ino, h.fh).await.unwrap();
}

/// An open with O_TRUNC whose truncate fails (here: the staging disk, needed for the tail
/// another descriptor wrote) registered a writer no release ever undid: the inode stayed
/// written here for good, and a chmod after the other descriptor's close was queued where
/// nothing stored it.
#[tokio::test]
async fn a_failed_truncating_open_leaves_no_writer_behind() {
    let mem = Arc::new(MemoryStore::new());
    let (fs, _cache) = fs_without_staging(mem.clone());
    let (a, h) = fs
        .create(ROOT_INO, OsStr::new("f"), 0o644, 0, libc::O_WRONLY, ME)
        .await
        .unwrap();
    fs.write(a.ino, h.fh, 0, Bytes::from_static(b"hello"))
        .await
        .unwrap();
    let again = fs.open(a.ino, libc::O_WRONLY | libc::O_TRUNC).await;
    assert!(again.is_err(), "the truncate needs the staging disk");
    fs.flush(a.ino, h.fh).await.unwrap();
    fs.release(a.ino, h.fh).await.unwrap();
    assert_eq!(object(&mem, "f").await, b"hello");
    let set = SetAttr {
        mode: Some(0o600),
        ..SetAttr::default()
    };
    fs.setattr(a.ino, None, set).await.unwrap();
    let m = mem.head("f").await.unwrap();
    assert_eq!(m.user["mode"], (libc::S_IFREG | 0o600).to_string());
    // Another client's version shows (a file written here shows its own state's).
    put(&mem, "f", b"another client").await;
    fs.refresh(a.ino).unwrap();
    assert_eq!(fs.getattr(a.ino).await.unwrap().size, 14);
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

/// A directory whose marker could not be stored keeps it pending through a chmod, chown or
/// rmdir that fails too: the next sync stores it. An earlier build dropped the pending
/// marker at the first of them, so the sync said it was stored and the empty directory was
/// gone from the bucket.
#[tokio::test]
async fn a_failed_marker_stays_pending_through_a_failed_chmod_or_rmdir() {
    let mem = Arc::new(MemoryStore::new());
    let (faulty, fs, _cache) = faulty_fs(&mem);
    let refuse = |op, times| {
        let e = StoreError::Transient("injected".into());
        faulty.inject(op, 0, Some(times), Fault::Error(e));
    };
    // Each marker's PUT fails, and so does the sync's second try.
    refuse(Op::Put, 6);
    let mut dirs = Vec::new();
    for name in ["d", "e", "f"] {
        let d = fs
            .mkdir(ROOT_INO, OsStr::new(name), 0o755, 0, ME)
            .await
            .unwrap();
        dirs.push(d.ino);
    }
    assert_eq!(fs.fsyncdir(ROOT_INO).await, Err(FsError::EIO));
    faulty.clear();
    let chmod = || SetAttr {
        mode: Some(0o700),
        ..Default::default()
    };
    // d: the chmod's HEAD fails; e: its PUT of the marker fails; f: the rmdir's DELETE fails.
    refuse(Op::Head, 1);
    assert_eq!(fs.setattr(dirs[0], None, chmod()).await, Err(FsError::EIO));
    refuse(Op::Put, 1);
    assert_eq!(fs.setattr(dirs[1], None, chmod()).await, Err(FsError::EIO));
    refuse(Op::Delete, 1);
    assert_eq!(fs.rmdir(ROOT_INO, OsStr::new("f")).await, Err(FsError::EIO));
    faulty.clear();
    fs.fsyncdir(ROOT_INO).await.unwrap();
    for key in ["d/", "e/", "f/"] {
        assert!(
            mem.head(key).await.is_ok(),
            "{key} is not in the bucket after the sync"
        );
    }
}

/// A chmod of a directory (or file) below a directory being renamed, its store slow: the
/// rename waits for it and moves the changed marker, and nothing comes back under the old
/// name. An earlier build let the rename copy and delete around the chmod's PUT, which then
/// stored the old directory's marker again (and the change only there).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chmod_below_a_directory_being_renamed_moves_with_it() {
    let mem = Arc::new(MemoryStore::new());
    let (faulty, fs, _cache) = faulty_fs(&mem);
    let dir_meta: bucketfs_store::UserMeta =
        [("mode".to_string(), (libc::S_IFDIR | 0o750).to_string())]
            .into_iter()
            .collect();
    mem.put("a/", Bytes::new(), &dir_meta).await.unwrap();
    mem.put("a/sub/", Bytes::new(), &dir_meta).await.unwrap();
    put(&mem, "a/sub/f", b"f").await;
    let a = fs.lookup(ROOT_INO, OsStr::new("a")).await.unwrap();
    let sub = fs.lookup(a.ino, OsStr::new("sub")).await.unwrap();
    faulty.inject(
        Op::Put,
        0,
        Some(1),
        Fault::Delay(Duration::from_millis(300)),
    );
    let chmod = tokio::spawn({
        let fs = fs.clone();
        async move {
            let set = SetAttr {
                mode: Some(0o700),
                ..Default::default()
            };
            fs.setattr(sub.ino, None, set).await
        }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    fs.rename(ROOT_INO, OsStr::new("a"), ROOT_INO, OsStr::new("b"), 0)
        .await
        .unwrap();
    assert_eq!(chmod.await.unwrap().unwrap().perm, 0o700);
    assert!(
        mem.head("a/sub/").await.is_err(),
        "the old directory came back"
    );
    let m = mem.head("b/sub/").await.unwrap();
    assert_eq!(m.user["mode"], (libc::S_IFDIR | 0o700).to_string());
}

/// A rename over an empty directory whose marker could not be stored, failing itself: the
/// directory replaced is still there, and so is its marker to store at the next sync (an
/// earlier build dropped it, and the sync said everything was stored).
#[tokio::test]
async fn a_failed_rename_over_a_directory_keeps_its_marker_pending() {
    let mem = Arc::new(MemoryStore::new());
    let (faulty, fs, _cache) = faulty_fs(&mem);
    // With a marker of its own, copied first (the copy that fails): no marker of b/ is put.
    mem.put("a/", Bytes::new(), &Default::default())
        .await
        .unwrap();
    put(&mem, "a/x", b"x").await;
    fs.lookup(ROOT_INO, OsStr::new("a")).await.unwrap();
    let refuse = |op, times| {
        let e = StoreError::Transient("injected".into());
        faulty.inject(op, 0, Some(times), Fault::Error(e));
    };
    refuse(Op::Put, 2);
    fs.mkdir(ROOT_INO, OsStr::new("b"), 0o755, 0, ME)
        .await
        .unwrap();
    assert_eq!(fs.fsyncdir(ROOT_INO).await, Err(FsError::EIO));
    faulty.clear();
    refuse(Op::Copy, 1);
    assert_eq!(
        fs.rename(ROOT_INO, OsStr::new("a"), ROOT_INO, OsStr::new("b"), 0)
            .await,
        Err(FsError::EIO)
    );
    faulty.clear();
    fs.fsyncdir(ROOT_INO).await.unwrap();
    assert!(
        mem.head("b/").await.is_ok(),
        "b/ is not in the bucket after the sync"
    );
}

/// A rename over an empty directory whose marker is in the bucket (with its mode), failing
/// at its copies: the directory replaced keeps its marker and mode (the marker was deleted
/// before the copies, so the failed rename took the directory's attributes, and after the
/// stat TTL the directory itself). With `a` implied (no marker of its own), the same.
#[tokio::test]
async fn a_failed_rename_over_a_stored_directory_keeps_its_marker() {
    for implied in [false, true] {
        let mem = Arc::new(MemoryStore::new());
        let (faulty, fs, _cache) = faulty_fs(&mem);
        if !implied {
            mem.put("a/", Bytes::new(), &Default::default())
                .await
                .unwrap();
        }
        put(&mem, "a/x", b"x").await;
        fs.mkdir(ROOT_INO, OsStr::new("b"), 0o700, 0, ME)
            .await
            .unwrap();
        fs.fsyncdir(ROOT_INO).await.unwrap();
        let mode = mem.head("b/").await.unwrap().user["mode"].clone();
        fs.lookup(ROOT_INO, OsStr::new("a")).await.unwrap();
        let e = StoreError::Transient("injected".into());
        faulty.inject(Op::Copy, 0, None, Fault::Error(e));
        assert_eq!(
            fs.rename(ROOT_INO, OsStr::new("a"), ROOT_INO, OsStr::new("b"), 0)
                .await,
            Err(FsError::EIO)
        );
        faulty.clear();
        let marker = mem.head("b/").await;
        assert!(marker.is_ok(), "implied {implied}: b/ is gone");
        assert_eq!(marker.unwrap().user["mode"], mode, "implied {implied}");
    }
}

/// `a/x` ("hello") in a fresh fs, and a rename of `a` to `b` running, held between its
/// copies and its deletes (its first DELETE takes 300 ms): the store, the fs, `x`'s inode,
/// the rename, and the cache dir (keep it alive).
async fn renaming_a_to_b_between_copy_and_delete() -> (
    Arc<MemoryStore>,
    Arc<Fs>,
    u64,
    tokio::task::JoinHandle<Result<(), FsError>>,
    tempfile::TempDir,
) {
    let mem = Arc::new(MemoryStore::new());
    let (faulty, fs, cache) = faulty_fs(&mem);
    put(&mem, "a/x", b"hello").await;
    let a = fs.lookup(ROOT_INO, OsStr::new("a")).await.unwrap();
    let x = fs.lookup(a.ino, OsStr::new("x")).await.unwrap();
    faulty.inject(
        Op::Delete,
        0,
        Some(1),
        Fault::Delay(Duration::from_millis(300)),
    );
    let rename = tokio::spawn({
        let fs = fs.clone();
        async move {
            fs.rename(ROOT_INO, OsStr::new("a"), ROOT_INO, OsStr::new("b"), 0)
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    (mem, fs, x.ino, rename, cache)
}

/// A truncate(2) of a closed file below a directory being renamed, once the rename has
/// copied it and before it deletes it: the truncate waits for the rename and applies at the
/// new name. An earlier build stored the truncated file under the old name, which the
/// rename's pinned delete then left there, and the new name kept the old bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_truncate_below_a_directory_being_renamed_moves_with_it() {
    let (mem, fs, x, rename, _cache) = renaming_a_to_b_between_copy_and_delete().await;
    let set = SetAttr {
        size: Some(2),
        ..Default::default()
    };
    assert_eq!(fs.setattr(x, None, set).await.unwrap().size, 2);
    rename.await.unwrap().unwrap();
    assert!(mem.head("a/x").await.is_err(), "the old file stayed");
    assert_eq!(object(&mem, "b/x").await, b"he");
}

/// A file opened for writing, written and closed below a directory being renamed, once the
/// rename has copied it and before it deletes it: the open waits for the rename, and what it
/// wrote is stored at the new name. An earlier build stored it under the old name, where the
/// rename's pinned delete left it (or, where DELETE ignores the condition, removed it), and
/// the new name kept the old bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_below_a_directory_being_renamed_moves_with_it() {
    let (mem, fs, x, rename, _cache) = renaming_a_to_b_between_copy_and_delete().await;
    let h = fs.open(x, libc::O_WRONLY | libc::O_TRUNC).await.unwrap();
    fs.write(x, h.fh, 0, Bytes::from_static(b"new"))
        .await
        .unwrap();
    fs.flush(x, h.fh).await.unwrap();
    fs.release(x, h.fh).await.unwrap();
    rename.await.unwrap().unwrap();
    assert!(mem.head("a/x").await.is_err(), "the old file stayed");
    assert_eq!(object(&mem, "b/x").await, b"new");
}

/// A rename over an empty directory whose marker could not be stored, failing only at its
/// last delete (done, but its answer lost): the copies are the directory now, and the
/// replaced directory's old marker is not stored over the copy of the renamed one's.
#[tokio::test]
async fn a_rename_over_a_directory_failing_after_its_copies_keeps_the_moved_marker() {
    let mem = Arc::new(MemoryStore::new());
    let (faulty, fs, _cache) = faulty_fs(&mem);
    let dir_meta: bucketfs_store::UserMeta =
        [("mode".to_string(), (libc::S_IFDIR | 0o700).to_string())]
            .into_iter()
            .collect();
    mem.put("a/", Bytes::new(), &dir_meta).await.unwrap();
    put(&mem, "a/x", b"x").await;
    fs.lookup(ROOT_INO, OsStr::new("a")).await.unwrap();
    let e = StoreError::Transient("injected".into());
    faulty.inject(Op::Put, 0, Some(2), Fault::Error(e));
    fs.mkdir(ROOT_INO, OsStr::new("b"), 0o755, 0, ME)
        .await
        .unwrap();
    assert_eq!(fs.fsyncdir(ROOT_INO).await, Err(FsError::EIO));
    faulty.clear();
    // Deletes: a/x, then a/ (done, its answer lost); b/ is overwritten by the copy of a/.
    faulty.inject(Op::Delete, 1, Some(1), Fault::DropAfter);
    assert!(fs
        .rename(ROOT_INO, OsStr::new("a"), ROOT_INO, OsStr::new("b"), 0)
        .await
        .is_err());
    faulty.clear();
    let _ = fs.fsyncdir(ROOT_INO).await;
    let m = mem.head("b/").await.unwrap();
    assert_eq!(
        m.user.get("mode"),
        Some(&(libc::S_IFDIR | 0o700).to_string())
    );
}

/// A write that fills a part starts the file's multipart upload. When that start failed (the
/// store refusing past its retries), the write returned `EIO` although its bytes were kept
/// and went up at close: an application that wrote them again (an `O_APPEND` logger retrying)
/// stored them twice. The write succeeds: its bytes are kept, and the close stores them (or
/// fails).
#[tokio::test]
async fn a_write_whose_upload_cannot_start_keeps_its_bytes_and_succeeds() {
    writes_whose_upload_cannot_start(None, 41).await;
}

/// The same with little memory, where every part goes through the staging file: the write
/// that completed a part failed with EIO though its bytes were kept (an O_APPEND writer's
/// retry then stored them twice).
#[tokio::test]
async fn a_staged_write_whose_upload_cannot_start_keeps_its_bytes_and_succeeds() {
    writes_whose_upload_cannot_start(Some(8 * MIB), 42).await;
}

/// 12 MiB written in 1 MiB writes while the start of the upload fails (with `max_memory`
/// if given): every write succeeds, and the close stores every byte.
async fn writes_whose_upload_cannot_start(max_memory: Option<u64>, seed: u64) {
    let mem = Arc::new(MemoryStore::new());
    let faulty = Arc::new(FaultStore::new(mem.clone()));
    let cache = tempfile::tempdir().unwrap();
    let cfg = config(&cache);
    let fs = Fs::new(
        faulty.clone(),
        FsConfig {
            max_memory: max_memory.unwrap_or(cfg.max_memory),
            ..cfg
        },
    );
    faulty.inject(
        Op::CreateMultipart,
        0,
        None,
        Fault::Error(StoreError::Transient("connection refused".into())),
    );
    let data = random(12 * MIB as usize, seed);
    let (attr, h) = fs
        .create(ROOT_INO, OsStr::new("log"), 0o644, 0, libc::O_WRONLY, ME)
        .await
        .unwrap();
    for (i, c) in data.chunks(MIB as usize).enumerate() {
        let r = fs
            .write(attr.ino, h.fh, i as u64 * MIB, Bytes::copy_from_slice(c))
            .await;
        assert_eq!(r, Ok(MIB as u32), "write {i}");
    }
    assert_eq!(fs.getattr(attr.ino).await.unwrap().size, data.len() as u64);
    faulty.clear();
    fs.flush(attr.ino, h.fh).await.unwrap();
    fs.release(attr.ino, h.fh).await.unwrap();
    assert!(object(&mem, "log").await == data);
}

/// A chmod by path after a file's close stored it and before its release (a forked child
/// still holds the descriptor): queued in the writer's clean state, it waited for the
/// release, which stored it as a whole upload whose failure was only logged, and the mode
/// went back. It is stored at once, as for a closed file.
#[tokio::test]
async fn a_chmod_between_a_close_and_its_release_is_stored_at_once() {
    let mem = Arc::new(MemoryStore::new());
    let (faulty, fs, _cache) = faulty_fs(&mem);
    let (ino, fh) = write_open(&fs, "f", b"data").await;
    fs.flush(ino, fh).await.unwrap();
    let set = SetAttr {
        mode: Some(0o600),
        ..SetAttr::default()
    };
    fs.setattr(ino, None, set).await.unwrap();
    faulty.inject(
        Op::Put,
        0,
        None,
        Fault::Error(StoreError::Transient("503".into())),
    );
    fs.release(ino, fh).await.unwrap();
    faulty.clear();
    let m = mem.head("f").await.unwrap();
    assert_eq!(m.user["mode"], (libc::S_IFREG | 0o600).to_string());
    assert_eq!(object(&mem, "f").await, b"data");
    assert_eq!(fs.getattr(ino).await.unwrap().perm, 0o600);
}

/// The same start refused for good (403): a write fails, so that a writer stops before it
/// fills the staging disk with a file that cannot be stored. Not the write that filled the
/// part, whose bytes were taken (the file has them): it gets its count, the next one the
/// error (before: the filling write failed with its bytes in the file, and a caller writing
/// them again, with O_APPEND, stored them twice).
#[tokio::test]
async fn a_write_whose_upload_is_refused_fails() {
    let mem = Arc::new(MemoryStore::new());
    let (faulty, fs, _cache) = faulty_fs(&mem);
    faulty.inject(
        Op::CreateMultipart,
        0,
        None,
        Fault::Error(StoreError::AccessDenied("log".into())),
    );
    let (attr, h) = fs
        .create(ROOT_INO, OsStr::new("log"), 0o644, 0, libc::O_WRONLY, ME)
        .await
        .unwrap();
    let mut refused = None;
    for i in 0..12u64 {
        let r = fs
            .write(
                attr.ino,
                h.fh,
                i * MIB,
                Bytes::from(vec![7u8; MIB as usize]),
            )
            .await;
        if let Err(e) = r {
            refused = Some((i, e));
            break;
        }
    }
    assert_eq!(refused, Some((5, FsError(libc::EACCES))));
    assert_eq!(fs.getattr(attr.ino).await.unwrap().size, 5 * MIB);
    let _ = fs.flush(attr.ino, h.fh).await;
    fs.release(attr.ino, h.fh).await.unwrap();

    // The same through the FUSE thread's fast path (`dd bs=1M`): the write after the one
    // that filled the part fails too (before: it took the fast path, and every write after
    // succeeded, to the staging disk).
    let (attr, h) = fs
        .create(ROOT_INO, OsStr::new("log2"), 0o644, 0, libc::O_WRONLY, ME)
        .await
        .unwrap();
    let chunk = vec![7u8; MIB as usize];
    let mut refused = None;
    for i in 0..12u64 {
        let r = match fs.write_now(attr.ino, h.fh, i * MIB, &chunk, false, false) {
            bucketfs_fs::Now::Done(r) => r,
            bucketfs_fs::Now::Later(f) => f.await,
        };
        if let Err(e) = r {
            refused = Some((i, e));
            break;
        }
    }
    assert_eq!(refused, Some((5, FsError(libc::EACCES))));
    let _ = fs.flush(attr.ino, h.fh).await;
    fs.release(attr.ino, h.fh).await.unwrap();
}

/// A truncate whose close failed to store it leaves the file as the store has it: the next
/// writer starts from the stored version's size, not from the size that was never stored
/// (before: the inode kept the unstored size with the stored version's ETag, and an append
/// published the first 100 bytes plus its own over the 1 MiB file, pinned to that ETag and
/// so accepted: a version nobody wrote).
#[tokio::test]
async fn a_truncate_whose_close_failed_leaves_the_stored_size_to_the_next_writer() {
    let mem = Arc::new(MemoryStore::new());
    let data = random(MIB as usize, 31);
    put(&mem, "f", &data).await;
    let (faulty, fs, _cache) = faulty_fs(&mem);
    let ino = fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap().ino;
    let h = fs.open(ino, libc::O_RDWR).await.unwrap();
    set_size(&fs, ino, h.fh, 100).await;
    faulty.inject(
        Op::Put,
        0,
        None,
        Fault::Error(StoreError::Transient("503".into())),
    );
    assert_eq!(fs.flush(ino, h.fh).await, Err(FsError::EIO));
    fs.release(ino, h.fh).await.unwrap();
    faulty.clear();
    assert_eq!(object(&mem, "f").await, data, "the failed truncate stored");
    // An appender, as the kernel runs one: it writes at the size stat gives.
    let h = fs.open(ino, libc::O_WRONLY | libc::O_APPEND).await.unwrap();
    let size = fs.getattr(ino).await.unwrap().size;
    assert_eq!(size, MIB);
    fs.write(ino, h.fh, size, Bytes::from_static(b"tail"))
        .await
        .unwrap();
    fs.flush(ino, h.fh).await.unwrap();
    fs.release(ino, h.fh).await.unwrap();
    let mut expected = data;
    expected.extend_from_slice(b"tail");
    assert!(
        object(&mem, "f").await == expected,
        "a version nobody wrote"
    );
}

/// A descriptor open for reading while a writer truncated the file and failed to store it:
/// the inode kept the size never stored beside the stored version's ETag, and the reader's
/// next read, which builds its reader from that pair, ended at byte 100 of a 1 MiB object
/// (buffered, the kernel then cut the file to 100 bytes for every reader).
#[tokio::test]
async fn a_reader_after_a_failed_truncate_reads_the_stored_version_whole() {
    let mem = Arc::new(MemoryStore::new());
    let data = random(MIB as usize, 32);
    put(&mem, "f", &data).await;
    let (faulty, fs, _cache) = faulty_fs(&mem);
    let ino = fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap().ino;
    let r = fs.open(ino, libc::O_RDONLY | libc::O_DIRECT).await.unwrap();
    let w = fs.open(ino, libc::O_RDWR).await.unwrap();
    set_size(&fs, ino, w.fh, 100).await;
    faulty.inject(
        Op::Put,
        0,
        None,
        Fault::Error(StoreError::Transient("503".into())),
    );
    assert_eq!(fs.flush(ino, w.fh).await, Err(FsError::EIO));
    fs.release(ino, w.fh).await.unwrap();
    faulty.clear();
    let mut got = Vec::new();
    loop {
        let b = fs
            .read(ino, r.fh, got.len() as u64, 256 * 1024)
            .await
            .unwrap();
        if b.is_empty() {
            break;
        }
        got.extend_from_slice(&b);
    }
    assert_eq!(got.len(), data.len(), "read a size never stored");
    assert!(got == data);
    fs.release(ino, r.fh).await.unwrap();
}

/// Another client's version put at a name between the copy and the delete of a rename of a
/// file open for writing (logrotate's `mv app.log app.log.1`), or of an unlink of a file
/// open for reading: the delete is pinned to the version copied, so the other client's
/// version stays under the name (before: deleted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_put_between_the_copy_and_the_delete_of_an_open_file_stays() {
    let mem = Arc::new(MemoryStore::new());
    let (faulty, fs, _cache) = faulty_fs(&mem);
    let (w, wh) = write_open(&fs, "app.log", b"first ").await;
    fs.fsync(w, wh).await.unwrap();
    fs.write(w, wh, 6, Bytes::from_static(b"second"))
        .await
        .unwrap();
    put(&mem, "in", b"read here").await;
    let r = fs.lookup(ROOT_INO, OsStr::new("in")).await.unwrap().ino;
    let rh = fs.open(r, libc::O_RDONLY).await.unwrap();
    for (name, other) in [("app.log", &b"other log"[..]), ("in", &b"other in"[..])] {
        faulty.inject(
            Op::Delete,
            0,
            Some(1),
            Fault::Delay(Duration::from_millis(300)),
        );
        let op = tokio::spawn({
            let fs = fs.clone();
            async move {
                match name {
                    "app.log" => {
                        let to = OsStr::new("app.log.1");
                        fs.rename(ROOT_INO, OsStr::new(name), ROOT_INO, to, 0).await
                    }
                    _ => fs.unlink(ROOT_INO, OsStr::new(name)).await,
                }
            }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        put(&mem, name, other).await;
        op.await.unwrap().unwrap();
        assert_eq!(object(&mem, name).await, other, "{name}");
    }
    fs.flush(w, wh).await.unwrap();
    fs.release(w, wh).await.unwrap();
    assert_eq!(object(&mem, "app.log.1").await, b"first second");
    assert_eq!(&fs.read(r, rh.fh, 0, 100).await.unwrap()[..], b"read here");
    fs.release(r, rh.fh).await.unwrap();
}

/// A new file's PUT lands but its answer is lost (the close gets `EIO`), then the file is
/// written again and closed: the second PUT, sent `If-None-Match`, is refused because the
/// name is taken, by this file's own first try, which it replaces (pinned to it). It was
/// taken for another client's object: `ESTALE`, the refusal sticky, the file's bytes lost.
#[tokio::test]
async fn a_new_files_publish_whose_answer_was_lost_is_no_conflict_for_the_next() {
    let mem = Arc::new(MemoryStore::new());
    let (faulty, fs, _cache) = faulty_fs(&mem);
    let (a, h) = fs
        .create(ROOT_INO, OsStr::new("n"), 0o644, 0, libc::O_WRONLY, ME)
        .await
        .unwrap();
    fs.write(a.ino, h.fh, 0, Bytes::from_static(b"first"))
        .await
        .unwrap();
    faulty.inject(Op::Put, 0, Some(1), Fault::DropAfter);
    assert_eq!(fs.flush(a.ino, h.fh).await, Err(FsError::EIO));
    assert_eq!(
        object(&mem, "n").await,
        b"first",
        "the lost answer's PUT landed"
    );
    fs.write(a.ino, h.fh, 5, Bytes::from_static(b" and second"))
        .await
        .unwrap();
    fs.flush(a.ino, h.fh).await.unwrap();
    fs.release(a.ino, h.fh).await.unwrap();
    assert_eq!(object(&mem, "n").await, b"first and second");
}

/// The same for a partial rewrite pinned to the version it was opened on: its publish
/// landed, the answer was lost (`EIO`), and the writer goes on. The next close finds the
/// object not the one pinned to, but the ETag and size of its own earlier try: it builds on
/// that and stores the file (before: `ESTALE` for good, the later bytes refused as if
/// another client had written the file).
#[tokio::test]
async fn a_rewrites_publish_whose_answer_was_lost_is_no_conflict_for_the_next() {
    let mem = Arc::new(MemoryStore::new());
    let (faulty, fs, _cache) = faulty_fs(&mem);
    put(&mem, "f", b"old").await;
    let f = fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    let h = fs.open(f.ino, libc::O_WRONLY).await.unwrap();
    fs.write(f.ino, h.fh, 3, Bytes::from_static(b"A"))
        .await
        .unwrap();
    faulty.inject(Op::Put, 0, Some(1), Fault::DropAfter);
    assert_eq!(fs.flush(f.ino, h.fh).await, Err(FsError::EIO));
    assert_eq!(
        object(&mem, "f").await,
        b"oldA",
        "the lost answer's PUT landed"
    );
    fs.write(f.ino, h.fh, 4, Bytes::from_static(b"B"))
        .await
        .unwrap();
    fs.flush(f.ino, h.fh).await.unwrap();
    fs.release(f.ino, h.fh).await.unwrap();
    assert_eq!(object(&mem, "f").await, b"oldAB");
}

/// Guard: a rewrite whose earlier try failed before it landed, then another client's
/// version: the next close is refused (`ESTALE`) and that version stays.
#[tokio::test]
async fn a_failed_try_of_a_rewrite_never_takes_another_clients_version_for_its_own() {
    let mem = Arc::new(MemoryStore::new());
    let (faulty, fs, _cache) = faulty_fs(&mem);
    put(&mem, "f", b"old").await;
    let f = fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    let h = fs.open(f.ino, libc::O_WRONLY).await.unwrap();
    fs.write(f.ino, h.fh, 3, Bytes::from_static(b"A"))
        .await
        .unwrap();
    let e = StoreError::Transient("503".into());
    faulty.inject(Op::Put, 0, Some(1), Fault::Error(e));
    assert!(fs.flush(f.ino, h.fh).await.is_err());
    put(&mem, "f", b"oldX").await;
    assert_eq!(fs.flush(f.ino, h.fh).await, Err(FsError::ESTALE));
    let _ = fs.release(f.ino, h.fh).await;
    assert_eq!(object(&mem, "f").await, b"oldX");
}

/// A writer's close fails (the store refused the PUT) and it goes; two descriptors open for
/// writing that changed nothing close after it: the first tries the publish again and stores
/// the file. Left to the last close (they changed nothing), neither tried, and the release,
/// which does not publish a failed state again, left the bytes unstored.
#[tokio::test]
async fn after_a_failed_close_a_close_that_changed_nothing_tries_again() {
    let mem = Arc::new(MemoryStore::new());
    let (faulty, fs, _cache) = faulty_fs(&mem);
    put(&mem, "f", b"old").await;
    let f = fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    let w = fs.open(f.ino, libc::O_WRONLY).await.unwrap();
    let x = fs.open(f.ino, libc::O_RDWR).await.unwrap();
    let y = fs.open(f.ino, libc::O_RDWR).await.unwrap();
    fs.write(f.ino, w.fh, 0, Bytes::from_static(b"NEW"))
        .await
        .unwrap();
    let e = StoreError::Transient("503".into());
    faulty.inject(Op::Put, 0, Some(1), Fault::Error(e));
    assert!(fs.flush(f.ino, w.fh).await.is_err());
    fs.release(f.ino, w.fh).await.unwrap();
    fs.flush(f.ino, x.fh).await.unwrap();
    assert_eq!(object(&mem, "f").await, b"NEW");
    for h in [x.fh, y.fh] {
        fs.release(f.ino, h).await.unwrap();
    }
}

/// The same with the first PUT refused before it landed (503), then another client's object
/// put at the name: the next close is refused (`ESTALE`) and that object stays. A failed try
/// makes only an object with its own ETag and size this file's, never whatever is there.
#[tokio::test]
async fn a_failed_try_of_a_new_file_never_takes_another_clients_object_for_its_own() {
    let mem = Arc::new(MemoryStore::new());
    let (faulty, fs, _cache) = faulty_fs(&mem);
    let (a, h) = fs
        .create(ROOT_INO, OsStr::new("n"), 0o644, 0, libc::O_WRONLY, ME)
        .await
        .unwrap();
    fs.write(a.ino, h.fh, 0, Bytes::from_static(b"ours"))
        .await
        .unwrap();
    let e = StoreError::Transient("503".into());
    faulty.inject(Op::Put, 0, Some(1), Fault::Error(e));
    assert_eq!(fs.flush(a.ino, h.fh).await, Err(FsError::EIO));
    put(&mem, "n", b"theirs").await;
    assert_eq!(fs.flush(a.ino, h.fh).await, Err(FsError::ESTALE));
    fs.release(a.ino, h.fh).await.unwrap();
    assert_eq!(object(&mem, "n").await, b"theirs");
}

/// A `chmod` by path of a file open for writing with nothing unstored copies the object
/// onto itself; the writer appends and fsyncs while the copy is under way. The fsync builds
/// on the copy (before: pinned to the version copied, it landed after the copy and was
/// refused, `ESTALE`, as if another client had written the file, and every later write
/// with it); a whole rewrite closed meanwhile carries the new mode (before: the old one,
/// over the copy, while stat showed the new).
#[tokio::test]
async fn a_chmod_copying_a_file_open_for_writing_holds_the_writers_publish() {
    let mem = Arc::new(MemoryStore::new());
    let (faulty, fs, _cache) = faulty_fs(&mem);
    put(&mem, "f", b"0123456789").await;
    put(&mem, "g", b"0123456789").await;
    for (name, whole) in [("f", false), ("g", true)] {
        let f = fs.lookup(ROOT_INO, OsStr::new(name)).await.unwrap();
        let h = fs.open(f.ino, libc::O_RDWR).await.unwrap();
        faulty.inject(
            Op::Copy,
            0,
            Some(1),
            Fault::DelayAfter(Duration::from_millis(300)),
        );
        let chmod = {
            let fs = fs.clone();
            let set = SetAttr {
                mode: Some(0o600),
                ..Default::default()
            };
            tokio::spawn(async move { fs.setattr(f.ino, None, set).await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        let (at, data): (u64, &[u8]) = match whole {
            false => (10, b"more"),
            true => (0, b"ABCDEFGHIJ"),
        };
        fs.write(f.ino, h.fh, at, Bytes::copy_from_slice(data))
            .await
            .unwrap();
        assert_eq!(fs.fsync(f.ino, h.fh).await, Ok(()), "{name}");
        fs.flush(f.ino, h.fh).await.unwrap();
        fs.release(f.ino, h.fh).await.unwrap();
        chmod.await.unwrap().unwrap();
        let want: &[u8] = match whole {
            false => b"0123456789more",
            true => b"ABCDEFGHIJ",
        };
        assert_eq!(object(&mem, name).await, want);
        let m = mem.head(name).await.unwrap();
        assert_eq!(
            m.user["mode"],
            (libc::S_IFREG | 0o600).to_string(),
            "{name}"
        );
    }
}

/// The multipart upload a file's first parts went into early is removed by the store
/// while the file stays open (a lifecycle rule aborting incomplete uploads, MinIO's
/// stale-upload expiry): the close sends the parts again into a new upload and stores the
/// file (before: the upload's "not found" was taken for the object deleted by another
/// client, `ESTALE` for an append, `ENOENT` for a new file, and the bytes were lost).
#[tokio::test]
async fn an_early_upload_the_store_removed_is_sent_again_at_close() {
    const MIB: u64 = 1 << 20;
    let mem = Arc::new(MemoryStore::new());
    let (_faulty, fs, _cache) = faulty_fs(&mem);
    let base = vec![1u8; 3 * MIB as usize];
    put(&mem, "old", &base).await;
    let added = vec![2u8; 8 * MIB as usize];
    let f = fs.lookup(ROOT_INO, OsStr::new("old")).await.unwrap();
    let h = fs.open(f.ino, libc::O_WRONLY).await.unwrap();
    let (n, nh) = fs
        .create(ROOT_INO, OsStr::new("new"), 0o644, 0, libc::O_WRONLY, ME)
        .await
        .unwrap();
    for (ino, fh, at) in [(f.ino, h.fh, 3 * MIB), (n.ino, nh.fh, 0)] {
        for (i, c) in added.chunks(MIB as usize).enumerate() {
            fs.write(ino, fh, at + i as u64 * MIB, Bytes::copy_from_slice(c))
                .await
                .unwrap();
        }
    }
    let uploads = mem.list_multipart_uploads("").await.unwrap();
    assert_eq!(uploads.len(), 2, "each file's first part went up early");
    for u in uploads {
        mem.abort_multipart(&u.key, &u.upload_id).await.unwrap();
    }
    fs.flush(f.ino, h.fh).await.unwrap();
    fs.release(f.ino, h.fh).await.unwrap();
    let mut want = base.clone();
    want.extend_from_slice(&added);
    assert!(object(&mem, "old").await == want);
    fs.flush(n.ino, nh.fh).await.unwrap();
    fs.release(n.ino, nh.fh).await.unwrap();
    assert!(object(&mem, "new").await == added);

    // A base of whole parts, copied server-side at close into the gone upload: its copies
    // say "changed", and the object as pinned tells the upload's loss from a conflict.
    let base = vec![3u8; 15 * MIB as usize];
    put(&mem, "big", &base).await;
    let b = fs.lookup(ROOT_INO, OsStr::new("big")).await.unwrap();
    let bh = fs.open(b.ino, libc::O_WRONLY).await.unwrap();
    for (i, c) in added.chunks(MIB as usize).enumerate() {
        fs.write(
            b.ino,
            bh.fh,
            15 * MIB + i as u64 * MIB,
            Bytes::copy_from_slice(c),
        )
        .await
        .unwrap();
    }
    for u in mem.list_multipart_uploads("").await.unwrap() {
        mem.abort_multipart(&u.key, &u.upload_id).await.unwrap();
    }
    fs.flush(b.ino, bh.fh).await.unwrap();
    fs.release(b.ino, bh.fh).await.unwrap();
    let mut want = base;
    want.extend_from_slice(&added);
    assert!(object(&mem, "big").await == want);
}

/// A read whose GET failed (after the store's own retries: up to 2T on a hung connection)
/// gets `EIO`; the kernel then asks for the same pages again at once (its readahead failed,
/// it reads the page itself), and that second request waited another 2T: one read(2) took
/// 4T (120 s with the default T). The failure stands for a second for the bytes it was
/// fetching; a read after that asks the store again.
#[tokio::test]
async fn the_kernels_second_read_of_pages_that_just_failed_fails_at_once() {
    let mem = Arc::new(MemoryStore::new());
    let data = random(3 * MIB as usize, 3);
    put(&mem, "f", &data).await;
    let (faulty, fs, _cache) = faulty_fs(&mem);
    let a = fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    let h = fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    faulty.inject(
        Op::Get,
        0,
        Some(1),
        Fault::Error(StoreError::Other("no byte for 30 s".into())),
    );
    assert_eq!(fs.read(a.ino, h.fh, 0, 128 << 10).await, Err(FsError::EIO));
    // The fault is spent: a GET now would succeed, so only a remembered failure fails.
    let again = fs.read(a.ino, h.fh, 4096, 4096).await.map(|b| b.len());
    assert_eq!(
        again,
        Err(FsError::EIO),
        "the same bytes were asked of the store again"
    );
    // Bytes it was not asked for are fetched (the GET is whole-file for a small file).
    let other = fs.read(a.ino, h.fh, 2 * MIB, 4096).await.unwrap();
    assert!(other[..] == data[2 * MIB as usize..2 * MIB as usize + 4096]);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let got = fs.read(a.ino, h.fh, 4096, 4096).await.unwrap();
    assert!(got[..] == data[4096..8192]);
    fs.release(a.ino, h.fh).await.unwrap();
}

/// A lookup whose probe failed (a LIST on a hung connection: up to 2T after the store's own
/// retries) gets `EIO`; the kernel, whose revalidation of the cached entry that was, drops
/// the entry and looks the name up again at once, and that second lookup waited another 2T:
/// one stat(2) took 4T (20 s at `--retry-timeout 5`). The failure stands for a second for
/// that name, for lookups and getattr alike; other names, and a lookup after that second,
/// ask the store.
#[tokio::test]
async fn the_kernels_second_lookup_of_a_name_that_just_failed_fails_at_once() {
    let mem = Arc::new(MemoryStore::new());
    put(&mem, "ok11/f", b"f").await;
    put(&mem, "ok12/f", b"f").await;
    let ttl = Duration::from_secs(1);
    let (faulty, fs, _cache) = crate::support::faulty_fs_with(&mem, |c| FsConfig {
        stat_ttl: ttl,
        negative_ttl: ttl,
        ..c
    });
    let d = fs.lookup(ROOT_INO, OsStr::new("ok11")).await.unwrap();
    let f = fs.lookup(d.ino, OsStr::new("f")).await.unwrap();
    // The entries expire: the kernel's revalidation asks the store.
    tokio::time::sleep(ttl + Duration::from_millis(100)).await;
    let hung = || Fault::Error(StoreError::Other("no byte for 30 s".into()));
    faulty.inject(Op::List, 0, Some(1), hung());
    assert_eq!(
        fs.lookup(ROOT_INO, OsStr::new("ok11")).await,
        Err(FsError::EIO)
    );
    // The fault is spent: a LIST now would succeed, so only a remembered failure fails.
    assert_eq!(
        fs.lookup(ROOT_INO, OsStr::new("ok11")).await,
        Err(FsError::EIO),
        "the same name was asked of the store again"
    );
    // A file's getattr (its HEAD hung), asked again.
    faulty.inject(Op::Head, 0, Some(1), hung());
    assert_eq!(fs.getattr(f.ino).await, Err(FsError::EIO));
    assert_eq!(
        fs.getattr(f.ino).await,
        Err(FsError::EIO),
        "the same file was asked of the store again"
    );
    // Other names are asked.
    assert!(fs.lookup(ROOT_INO, OsStr::new("ok12")).await.is_ok());
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let again = fs.lookup(ROOT_INO, OsStr::new("ok11")).await.unwrap();
    assert_eq!(again.ino, d.ino);
    assert_eq!(fs.getattr(f.ino).await.unwrap().size, 1);
}
