//! Rewrites racing another client (issue 17): every new version built from an old one is
//! pinned to the ETag it was built from, so it is refused (ESTALE) when another client
//! replaced the object meanwhile, and the other client's version stays whole. A whole
//! rewrite stays last-writer-wins. In-process, against the memory store.

mod support;

use bucketfs_fs::{Fs, FsError, SetAttr, ROOT_INO};
use bucketfs_store::layer::StoreLayer;
use bucketfs_store::memory::MemoryStore;
use bucketfs_store::{ObjectStore, StoreResult, UserMeta};
use bytes::Bytes;
use rand::{RngCore, SeedableRng};
use std::ffi::OsStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use support::{config, env, object, write_mib, MIB};

fn random(n: u64, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; n as usize];
    rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut v);
    v
}

async fn put(mem: &MemoryStore, key: &str, data: &[u8], meta: &[(&str, &str)]) {
    let meta: UserMeta = meta
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    mem.put(key, Bytes::copy_from_slice(data), &meta)
        .await
        .unwrap();
}

/// Opens `name` (looked up in the root) with `flags`: (ino, fh).
async fn open(fs: &Fs, name: &str, flags: i32) -> (u64, u64) {
    let a = fs.lookup(ROOT_INO, OsStr::new(name)).await.unwrap();
    (a.ino, fs.open(a.ino, flags).await.unwrap().fh)
}

#[tokio::test]
async fn an_append_racing_a_replace_fails_and_keeps_the_other_version() {
    let e = env();
    // On a part boundary (5 MiB parts here), so no base byte needs a GET: three copies.
    put(&e.mem, "f", &random(15 * MIB, 1), &[]).await;
    let (ino, fh) = open(&e.fs, "f", libc::O_WRONLY | libc::O_APPEND).await;
    write_mib(&e.fs, ino, fh, 15 * MIB, &random(8 * MIB, 2)).await;
    let other = random(16 * MIB, 3);
    put(&e.mem, "f", &other, &[]).await;
    // Before: parts copied from the other version + our 8 MiB, and close said 0.
    assert_eq!(e.fs.flush(ino, fh).await, Err(FsError(libc::ESTALE)));
    e.fs.release(ino, fh).await.unwrap();
    assert!(
        object(&e.mem, "f").await == other,
        "the other version is intact"
    );
    assert_eq!(e.mem.pending_uploads(), 0, "the upload was aborted");
}

#[tokio::test]
async fn a_rewritten_part_racing_a_replace_fails_and_keeps_the_other_version() {
    let e = env();
    put(&e.mem, "f", &random(15 * MIB, 1), &[]).await;
    let (ino, fh) = open(&e.fs, "f", libc::O_WRONLY).await;
    // One whole part in the middle: streamed as it is written, the rest copied at close.
    write_mib(&e.fs, ino, fh, 5 * MIB, &random(5 * MIB, 2)).await;
    let other = random(15 * MIB, 3);
    put(&e.mem, "f", &other, &[]).await;
    assert_eq!(e.fs.fsync(ino, fh).await, Err(FsError(libc::ESTALE)));
    // The streamed part is in the aborted upload only: no later try could publish it.
    assert_eq!(e.mem.pending_uploads(), 0, "the upload was aborted");
    assert_eq!(e.fs.flush(ino, fh).await, Err(FsError(libc::ESTALE)));
    e.fs.release(ino, fh).await.unwrap();
    assert!(
        object(&e.mem, "f").await == other,
        "the other version is intact"
    );
}

#[tokio::test]
async fn a_small_partial_rewrite_is_published_only_over_its_base() {
    let e = env();
    put(&e.mem, "f", b"0123456789", &[]).await;
    let (ino, fh) = open(&e.fs, "f", libc::O_RDWR).await;
    // Read first: the base is at hand, so publish needs no GET (which is pinned anyway).
    assert_eq!(&e.fs.read(ino, fh, 0, 10).await.unwrap()[..], b"0123456789");
    e.fs.write(ino, fh, 2, Bytes::from_static(b"ab"))
        .await
        .unwrap();
    put(&e.mem, "f", b"other client", &[]).await;
    // Before: one unconditional PUT of "01ab456789" over the other client's object.
    assert_eq!(e.fs.flush(ino, fh).await, Err(FsError(libc::ESTALE)));
    e.fs.release(ino, fh).await.unwrap();
    assert_eq!(object(&e.mem, "f").await, b"other client");
}

#[tokio::test]
async fn a_partial_rewrite_of_a_deleted_object_fails() {
    let e = env();
    put(&e.mem, "f", b"0123456789", &[]).await;
    let (ino, fh) = open(&e.fs, "f", libc::O_RDWR).await;
    e.fs.read(ino, fh, 0, 10).await.unwrap();
    e.fs.write(ino, fh, 2, Bytes::from_static(b"ab"))
        .await
        .unwrap();
    e.mem.delete("f").await.unwrap();
    assert_eq!(e.fs.flush(ino, fh).await, Err(FsError(libc::ESTALE)));
    e.fs.release(ino, fh).await.unwrap();
    assert!(e.mem.head("f").await.unwrap_err().is_not_found());
}

#[tokio::test]
async fn a_truncate_racing_a_replace_fails_and_keeps_the_other_version() {
    let e = env();
    put(&e.mem, "f", &random(15 * MIB, 1), &[]).await;
    let a = e.fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    let other = random(15 * MIB, 3);
    put(&e.mem, "f", &other, &[]).await;
    // truncate(2) by path publishes at once: two parts copied from what it looked up.
    let set = SetAttr {
        size: Some(10 * MIB),
        ..SetAttr::default()
    };
    let r = e.fs.setattr(a.ino, None, set).await;
    assert_eq!(r.map(|_| ()), Err(FsError(libc::ESTALE)));
    assert!(
        object(&e.mem, "f").await == other,
        "the other version is intact"
    );
    assert_eq!(e.mem.pending_uploads(), 0);
}

#[tokio::test]
async fn a_whole_rewrite_is_last_writer_wins() {
    let e = env();
    put(&e.mem, "f", &random(12 * MIB, 1), &[]).await;
    let (ino, fh) = open(&e.fs, "f", libc::O_WRONLY | libc::O_TRUNC).await;
    let ours = random(12 * MIB, 2);
    write_mib(&e.fs, ino, fh, 0, &ours).await;
    put(&e.mem, "f", b"other client", &[]).await;
    e.fs.flush(ino, fh).await.unwrap();
    e.fs.release(ino, fh).await.unwrap();
    assert!(object(&e.mem, "f").await == ours);
}

#[tokio::test]
async fn a_chmod_racing_a_replace_never_mixes_metadata_into_the_other_version() {
    let e = env();
    put(&e.mem, "f", b"ours", &[("color", "red")]).await;
    let a = e.fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    put(&e.mem, "f", b"theirs", &[("color", "blue")]).await;
    let chmod = SetAttr {
        mode: Some(0o600),
        ..SetAttr::default()
    };
    // Before: their bytes with our old metadata (color red) and the new mode.
    let r = e.fs.setattr(a.ino, None, chmod.clone()).await;
    assert_eq!(r.map(|_| ()), Err(FsError(libc::ESTALE)));
    let m = e.mem.head("f").await.unwrap();
    assert_eq!(m.user.get("color").map(String::as_str), Some("blue"));
    assert!(!m.user.contains_key("mode"));
    // The refusal made the mount forget what it knew: the retry (the kernel makes one)
    // applies to the other client's version.
    let a = e.fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    e.fs.setattr(a.ino, None, chmod).await.unwrap();
    let m = e.mem.head("f").await.unwrap();
    assert_eq!(m.user.get("color").map(String::as_str), Some("blue"));
    assert_eq!(m.user["mode"], (libc::S_IFREG | 0o600).to_string());
    assert_eq!(object(&e.mem, "f").await, b"theirs");
}

#[tokio::test]
async fn a_rename_copies_only_the_version_it_looked_up() {
    let e = env();
    put(&e.mem, "a", b"ours", &[]).await;
    e.fs.lookup(ROOT_INO, OsStr::new("a")).await.unwrap();
    put(&e.mem, "a", b"theirs", &[]).await;
    let r =
        e.fs.rename(ROOT_INO, OsStr::new("a"), ROOT_INO, OsStr::new("b"), 0)
            .await;
    assert_eq!(r, Err(FsError(libc::ESTALE)));
    assert_eq!(object(&e.mem, "a").await, b"theirs");
    assert!(e.mem.head("b").await.unwrap_err().is_not_found());
    // Looked up again (the kernel's retry), it moves the version now there, whole.
    e.fs.lookup(ROOT_INO, OsStr::new("a")).await.unwrap();
    e.fs.rename(ROOT_INO, OsStr::new("a"), ROOT_INO, OsStr::new("b"), 0)
        .await
        .unwrap();
    assert_eq!(object(&e.mem, "b").await, b"theirs");
    assert!(e.mem.head("a").await.unwrap_err().is_not_found());
}

#[tokio::test]
async fn a_rename_of_a_file_being_rewritten_racing_a_replace_fails() {
    let e = env();
    put(&e.mem, "a", &random(15 * MIB, 1), &[]).await;
    let (ino, fh) = open(&e.fs, "a", libc::O_WRONLY | libc::O_APPEND).await;
    write_mib(&e.fs, ino, fh, 15 * MIB, &random(8 * MIB, 2)).await;
    let other = random(16 * MIB, 3);
    put(&e.mem, "a", &other, &[]).await;
    // The object the rename moves must be the file's base: refused, and so is the close.
    let r =
        e.fs.rename(ROOT_INO, OsStr::new("a"), ROOT_INO, OsStr::new("b"), 0)
            .await;
    assert_eq!(r, Err(FsError(libc::ESTALE)));
    e.fs.release(ino, fh).await.unwrap();
    assert!(
        object(&e.mem, "a").await == other,
        "the other version is intact"
    );
    assert!(e.mem.head("b").await.unwrap_err().is_not_found());
    assert_eq!(e.mem.pending_uploads(), 0);
}

/// Another client writing `theirs` to `key` right after the store answers this mount's copy
/// onto `key` (once armed): before this mount's next request about it.
struct WritesAfterCopy {
    inner: Arc<MemoryStore>,
    key: &'static str,
    theirs: &'static [u8],
    armed: AtomicBool,
}

#[async_trait::async_trait]
impl StoreLayer for WritesAfterCopy {
    type Inner = MemoryStore;
    fn inner(&self) -> &MemoryStore {
        &self.inner
    }
    async fn copy(
        &self,
        src_key: &str,
        dst_key: &str,
        meta: Option<&UserMeta>,
        src_if_match: Option<&str>,
    ) -> StoreResult<String> {
        let r = self.inner.copy(src_key, dst_key, meta, src_if_match).await;
        if dst_key == self.key && self.armed.swap(false, Ordering::SeqCst) {
            put(&self.inner, dst_key, self.theirs, &[]).await;
        }
        r
    }
}

/// A mount over `mem` whose copies onto `key` are followed by another client's write of
/// `theirs` there, once armed.
fn writes_after_copy(
    mem: &Arc<MemoryStore>,
    key: &'static str,
    theirs: &'static [u8],
) -> (Arc<WritesAfterCopy>, Arc<Fs>, tempfile::TempDir) {
    let store = Arc::new(WritesAfterCopy {
        inner: mem.clone(),
        key,
        theirs,
        armed: AtomicBool::new(false),
    });
    let cache = tempfile::tempdir().unwrap();
    let fs = Fs::new(store.clone(), config(&cache));
    (store, fs, cache)
}

/// An append after a chmod builds on the version the chmod's copy made, never on one another
/// client wrote right after it: before, the mount learnt its new ETag with a HEAD after the
/// copy, took the other client's version for its own, and appended to the first 4 bytes of
/// it ("thei+more" over "theirs, longer", with close saying 0).
#[tokio::test]
async fn an_append_after_a_chmod_never_builds_on_a_version_written_after_the_copy() {
    let mem = Arc::new(MemoryStore::new());
    put(&mem, "f", b"ours", &[]).await;
    let (store, fs, _cache) = writes_after_copy(&mem, "f", b"theirs, longer");
    let a = fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    store.armed.store(true, Ordering::SeqCst);
    let chmod = SetAttr {
        mode: Some(0o600),
        ..SetAttr::default()
    };
    fs.setattr(a.ino, None, chmod).await.unwrap();
    let (ino, fh) = open(&fs, "f", libc::O_WRONLY | libc::O_APPEND).await;
    fs.write(ino, fh, 4, Bytes::from_static(b"+more"))
        .await
        .unwrap();
    assert_eq!(fs.flush(ino, fh).await, Err(FsError(libc::ESTALE)));
    fs.release(ino, fh).await.unwrap();
    assert_eq!(object(&mem, "f").await, b"theirs, longer");
}

/// The same for a rename: the moved file's ETag is the copy's, not a HEAD's of the new name.
#[tokio::test]
async fn an_append_after_a_rename_never_builds_on_a_version_written_after_the_copy() {
    let mem = Arc::new(MemoryStore::new());
    put(&mem, "a", b"ours", &[]).await;
    let (store, fs, _cache) = writes_after_copy(&mem, "b", b"theirs, longer");
    fs.lookup(ROOT_INO, OsStr::new("a")).await.unwrap();
    store.armed.store(true, Ordering::SeqCst);
    fs.rename(ROOT_INO, OsStr::new("a"), ROOT_INO, OsStr::new("b"), 0)
        .await
        .unwrap();
    let (ino, fh) = open(&fs, "b", libc::O_WRONLY | libc::O_APPEND).await;
    fs.write(ino, fh, 4, Bytes::from_static(b"+more"))
        .await
        .unwrap();
    assert_eq!(fs.flush(ino, fh).await, Err(FsError(libc::ESTALE)));
    fs.release(ino, fh).await.unwrap();
    assert_eq!(object(&mem, "b").await, b"theirs, longer");
}

/// The same for a close that stores a metadata change made while the file's parts streamed
/// (a copy of the completed object onto itself).
#[tokio::test]
async fn an_append_after_a_close_that_copied_never_builds_on_a_version_written_after_it() {
    let mem = Arc::new(MemoryStore::new());
    put(&mem, "f", b"old", &[]).await;
    // Longer than ours: the append's base range is all in it.
    let theirs: &'static [u8] = random(7 * MIB, 2).leak();
    let (store, fs, _cache) = writes_after_copy(&mem, "f", theirs);
    let (ino, fh) = open(&fs, "f", libc::O_WRONLY | libc::O_TRUNC).await;
    let ours = random(6 * MIB, 1);
    write_mib(&fs, ino, fh, 0, &ours).await;
    let chmod = SetAttr {
        mode: Some(0o600),
        ..SetAttr::default()
    };
    fs.setattr(ino, Some(fh), chmod).await.unwrap();
    store.armed.store(true, Ordering::SeqCst);
    fs.flush(ino, fh).await.unwrap();
    fs.release(ino, fh).await.unwrap();
    assert!(
        !store.armed.load(Ordering::SeqCst),
        "the close stored the mode with a copy"
    );
    let (ino, fh) = open(&fs, "f", libc::O_WRONLY | libc::O_APPEND).await;
    fs.write(ino, fh, ours.len() as u64, Bytes::from_static(b"+more"))
        .await
        .unwrap();
    // Before: their first 6 MiB and "+more", with close saying 0.
    assert_eq!(fs.flush(ino, fh).await, Err(FsError(libc::ESTALE)));
    fs.release(ino, fh).await.unwrap();
    assert!(
        object(&mem, "f").await == theirs,
        "the other version is intact"
    );
}
