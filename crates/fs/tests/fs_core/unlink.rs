//! Unlinks of open files and the hidden directory that keeps them.

use crate::support::{
    env, hidden_keys, list, object, put, random, write_file, write_mib, write_open, Gate, ME, MIB,
};
use bucketfs_fs::{FsError, ROOT_INO};
use bucketfs_store::metrics::Op;
use bucketfs_store::ObjectStore;
use bytes::Bytes;
use std::ffi::OsStr;

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

/// A file open for reading that another client replaced, then unlinked here: the hidden
/// copy its descriptor reads on is never of the other client's version (before: the copy
/// was of whatever the name held at the unlink, and the descriptor read on from it, the
/// first bytes of one version followed by the rest of another). Its reads go on with the
/// version it read, or fail.
#[tokio::test]
async fn an_unlinked_reader_never_reads_on_from_another_clients_version() {
    let e = env();
    let data = random(24 * MIB as usize, 78);
    put(&e.mem, "in", &data).await;
    let a = e.fs.lookup(ROOT_INO, OsStr::new("in")).await.unwrap();
    let h = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    let first = e.fs.read(a.ino, h.fh, 0, 1 << 20).await.unwrap();
    assert_eq!(&first[..], &data[..MIB as usize]);
    let other = random(24 * MIB as usize, 79);
    put(&e.mem, "in", &other).await;
    e.fs.unlink(ROOT_INO, OsStr::new("in")).await.unwrap();
    for at in [20 * MIB, 12 * MIB] {
        if let Ok(b) = e.fs.read(a.ino, h.fh, at, 1 << 20).await {
            let want = &data[at as usize..(at + MIB) as usize];
            assert!(&b[..] == want, "read at {at}: not the version opened");
        }
    }
    e.fs.release(a.ino, h.fh).await.unwrap();
    assert!(hidden_keys(&e.mem).is_empty(), "{:?}", e.mem.keys());
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

/// An open for writing that the kernel sends for a file looked up before an unlink of it
/// (`echo x > f` racing `rm f`) made a fresh write state on the old key, and its close put
/// the file back after the unlink had returned 0. It gets `ESTALE` (the kernel looks the
/// name up again: the file is gone, or a new one is made with `O_CREAT`).
#[tokio::test]
async fn an_open_racing_an_unlink_never_brings_the_file_back() {
    let e = env();
    put(&e.mem, "f", b"old").await;
    let a = e.fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    e.fs.unlink(ROOT_INO, OsStr::new("f")).await.unwrap();
    match e.fs.open(a.ino, libc::O_WRONLY | libc::O_TRUNC).await {
        Err(err) => assert_eq!(err, FsError(libc::ESTALE)),
        Ok(h) => {
            let _ = e.fs.write(a.ino, h.fh, 0, Bytes::from_static(b"x")).await;
            let _ = e.fs.flush(a.ino, h.fh).await;
            e.fs.release(a.ino, h.fh).await.unwrap();
        }
    }
    assert!(
        e.mem.head("f").await.is_err(),
        "the unlinked file came back: {:?}",
        object(&e.mem, "f").await
    );
}

/// The same for an open of a file another rename of this mount replaced: its close put
/// what it wrote over the renamed file, which was then lost.
#[tokio::test]
async fn an_open_racing_a_rename_over_its_file_never_overwrites_the_renamed_one() {
    let e = env();
    put(&e.mem, "t", b"target").await;
    put(&e.mem, "x", b"renamed").await;
    let t = e.fs.lookup(ROOT_INO, OsStr::new("t")).await.unwrap();
    e.fs.lookup(ROOT_INO, OsStr::new("x")).await.unwrap();
    e.fs.rename(ROOT_INO, OsStr::new("x"), ROOT_INO, OsStr::new("t"), 0)
        .await
        .unwrap();
    match e.fs.open(t.ino, libc::O_WRONLY | libc::O_TRUNC).await {
        Err(err) => assert_eq!(err, FsError(libc::ESTALE)),
        Ok(h) => {
            let _ = e.fs.write(t.ino, h.fh, 0, Bytes::from_static(b"x")).await;
            let _ = e.fs.flush(t.ino, h.fh).await;
            e.fs.release(t.ino, h.fh).await.unwrap();
        }
    }
    assert_eq!(object(&e.mem, "t").await, b"renamed");
}

/// Holds this mount's DELETEs of `key` at its gate.
struct HoldsDelete {
    inner: std::sync::Arc<bucketfs_store::memory::MemoryStore>,
    key: String,
    gate: Gate,
}

#[async_trait::async_trait]
impl bucketfs_store::layer::StoreLayer for HoldsDelete {
    type Inner = bucketfs_store::memory::MemoryStore;
    fn inner(&self) -> &Self::Inner {
        &self.inner
    }
    async fn delete(&self, key: &str) -> bucketfs_store::StoreResult<()> {
        self.gate.pass(key == self.key).await;
        self.inner.delete(key).await
    }
    async fn delete_if(&self, key: &str, if_match: &str) -> bucketfs_store::StoreResult<()> {
        self.gate.pass(key == self.key).await;
        self.inner.delete_if(key, if_match).await
    }
}

/// The same with the open arriving while the unlink's DELETE is under way (`echo x > f`
/// racing `rm f`: the open's lookup came first): the unlink had looked for a write state
/// before, found none, and never marked the one the open made; its close put the file back.
/// The open waits for the unlink, then gets `ESTALE`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_during_an_unlinks_delete_never_brings_the_file_back() {
    let mem = std::sync::Arc::new(bucketfs_store::memory::MemoryStore::new());
    put(&mem, "f", b"old").await;
    let store = std::sync::Arc::new(HoldsDelete {
        inner: mem.clone(),
        key: "f".into(),
        gate: Gate::new(true),
    });
    let cache = tempfile::tempdir().unwrap();
    let fs = bucketfs_fs::Fs::new(store.clone(), crate::support::config(&cache));
    let a = fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    let unlink = tokio::spawn({
        let fs = fs.clone();
        async move { fs.unlink(ROOT_INO, OsStr::new("f")).await }
    });
    store.gate.reached().await;
    let writer = tokio::spawn({
        let fs = fs.clone();
        async move {
            let h = fs.open(a.ino, libc::O_WRONLY | libc::O_TRUNC).await?;
            fs.write(a.ino, h.fh, 0, Bytes::from_static(b"x")).await?;
            let _ = fs.flush(a.ino, h.fh).await;
            fs.release(a.ino, h.fh).await
        }
    });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    store.gate.open();
    unlink.await.unwrap().unwrap();
    let opened = writer.await.unwrap();
    assert_eq!(opened, Err(FsError(libc::ESTALE)));
    assert!(mem.head("f").await.is_err(), "the unlinked file came back");
}
