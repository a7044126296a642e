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
    cfg.writeback = Some(WriteBackConfig {
        dir: state.path().join("wb"),
        max_bytes: 1 << 30,
        concurrency: 2,
        fsync_waits_upload: false,
        delay: Duration::from_secs(3600),
        space_wait: Duration::from_secs(60),
    });
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
