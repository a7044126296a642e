//! Directory markers uploaded in the background.
//!
//! mkdir answers as soon as the directory exists in this mount; its marker object `dir/` is
//! PUT by a task. POSIX makes a new directory durable at fsync of the directory, not at
//! mkdir, and a tree of new directories (tar, cp -r, many-file creates) no longer waits one
//! PUT per directory. Everything that needs the marker in the bucket waits for it first:
//! fsyncdir, a listing of its parent, a store lookup of it, chmod and friends, rename, rmdir,
//! unmount. A marker whose upload failed is sent again by the next of those, which reports
//! EIO if that fails too, so a failure is never silent. A marker the store refuses for its
//! key (MinIO's limit on a marker's name: `XMinioInvalidObjectName`; `KeyTooLongError`) is
//! logged and then no longer waited for:
//! no try could store it, and every listing above it would fail for good.

use crate::error::{FsError, FsResult};
use crate::paths::ObjectKey;
use bucketfs_store::{ObjectStore, UserMeta};
use bytes::Bytes;
use futures::future::{BoxFuture, Shared};
use futures::FutureExt;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

type Upload = Shared<BoxFuture<'static, Result<(), String>>>;

enum Marker {
    /// The PUT in flight of `meta`; `id` tells this upload from a later one of the same key.
    Uploading {
        id: u64,
        upload: Upload,
        meta: UserMeta,
    },
    /// The last PUT failed: send it again when the marker is next needed.
    Failed(UserMeta),
}

pub struct PendingMarkers {
    store: Arc<dyn ObjectStore>,
    markers: Arc<Mutex<HashMap<String, Marker>>>,
    next_id: AtomicU64,
}

impl PendingMarkers {
    pub fn new(store: Arc<dyn ObjectStore>) -> Self {
        Self {
            store,
            markers: Arc::default(),
            next_id: AtomicU64::new(1),
        }
    }

    /// Starts uploading marker `key` with `meta`.
    pub fn start(&self, key: ObjectKey, meta: UserMeta) {
        // The upload runs in a task of its own; its handle is only for waiters.
        drop(self.upload(key.into_string(), meta));
    }

    fn upload(&self, key: String, meta: UserMeta) -> Upload {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (store, markers) = (self.store.clone(), self.markers.clone());
        let (task_key, task_meta) = (key.clone(), meta.clone());
        // Held until the entry is in: the task's own update must come after it.
        let mut pending = self.markers.lock();
        // A task of its own, so the upload proceeds whether or not anyone waits for it.
        let task = tokio::spawn(async move {
            let r = store.put(&task_key, Bytes::new(), &task_meta).await;
            let mut m = markers.lock();
            if !matches!(m.get(&task_key), Some(Marker::Uploading { id: i, .. }) if *i == id) {
                return r.map(|_| ()).map_err(|e| e.to_string());
            }
            match r {
                Ok(_) => {
                    m.remove(&task_key);
                    Ok(())
                }
                Err(e) if e.refuses_key() => {
                    tracing::error!(
                        "{task_key}: the store refuses this directory marker ({e}); the \
                         directory is in the bucket only while it holds something"
                    );
                    m.remove(&task_key);
                    // Nothing to wait for: no try could store it.
                    Ok(())
                }
                Err(e) => {
                    tracing::error!(
                        "{task_key}: the directory marker could not be stored ({e}); it is \
                         sent again when the directory is next synced, listed or changed"
                    );
                    m.insert(task_key, Marker::Failed(task_meta));
                    Err(e.to_string())
                }
            }
        });
        let upload = async move { task.await.unwrap_or_else(|e| Err(e.to_string())) }
            .boxed()
            .shared();
        pending.insert(
            key,
            Marker::Uploading {
                id,
                upload: upload.clone(),
                meta,
            },
        );
        upload
    }

    /// Returns once marker `key` is in the bucket (at once when none is pending); EIO if its
    /// upload failed, after one more try for a marker that had failed before.
    pub async fn wait(&self, key: &ObjectKey) -> FsResult<()> {
        let pending = self.markers.lock().get(key.as_str()).map(|m| match m {
            Marker::Uploading { upload, .. } => Ok(upload.clone()),
            Marker::Failed(meta) => Err(meta.clone()),
        });
        let upload = match pending {
            None => return Ok(()),
            Some(Ok(upload)) => upload,
            Some(Err(meta)) => self.upload(key.to_string(), meta),
        };
        upload.await.map_err(|_| FsError::EIO)
    }

    /// [`Self::wait`] for every pending marker whose key starts with `prefix` (the directory
    /// itself and all below it), all at once: failed ones are sent again together, so the
    /// caller waits about one retry bound, not one per marker. The first failure is
    /// returned after all were waited for.
    pub async fn wait_below(&self, prefix: &ObjectKey) -> FsResult<()> {
        let keys: Vec<ObjectKey> = {
            let m = self.markers.lock();
            if m.is_empty() {
                return Ok(());
            }
            m.keys()
                .filter(|k| k.starts_with(prefix.as_str()))
                .map(ObjectKey::new)
                .collect()
        };
        let waits = keys.iter().map(|k| self.wait(k));
        futures::future::join_all(waits)
            .await
            .into_iter()
            .collect::<FsResult<Vec<()>>>()
            .map(|_| ())
    }

    /// Drops marker `key` from the pending set (the directory is being removed, replaced or
    /// its marker stored again): waits for an upload in flight, whatever its outcome, so that
    /// a DELETE or PUT cannot overtake it. A marker that is not in the bucket (its upload
    /// failed) is pending again once the answer is dropped, unless [`Unstored::replaced`]
    /// says what was to replace it was stored.
    pub async fn settle(&self, key: &ObjectKey) -> Unstored<'_> {
        let taken = self.markers.lock().remove(key.as_str());
        let meta = match taken {
            Some(Marker::Uploading { upload, meta, .. }) => upload.await.is_err().then_some(meta),
            Some(Marker::Failed(meta)) => Some(meta),
            None => None,
        };
        Unstored {
            markers: self,
            key: key.clone(),
            meta,
        }
    }

    /// Waits for an upload of marker `key` in flight, whatever its outcome, leaving what it
    /// leaves (a failed marker stays pending).
    pub async fn landed(&self, key: &ObjectKey) {
        let upload = match self.markers.lock().get(key.as_str()) {
            Some(Marker::Uploading { upload, .. }) => upload.clone(),
            _ => return,
        };
        let _ = upload.await;
    }

    /// Whether marker `key` is not in the bucket yet (uploading or failed).
    pub fn pending(&self, key: &ObjectKey) -> bool {
        self.markers.lock().contains_key(key.as_str())
    }

    /// Whether a marker strictly below `prefix` is not in the bucket yet (uploading or
    /// failed): a directory made there still exists.
    pub fn any_below(&self, prefix: &ObjectKey) -> bool {
        let m = self.markers.lock();
        m.keys()
            .any(|k| k.len() > prefix.len() && k.starts_with(prefix.as_str()))
    }

    /// Markers not yet in the bucket.
    pub fn len(&self) -> usize {
        self.markers.lock().len()
    }
}

/// A marker [`PendingMarkers::settle`] took out of the pending set while it was not in the
/// bucket: pending again (sent at the next sync) when this is dropped, unless replaced.
pub struct Unstored<'a> {
    markers: &'a PendingMarkers,
    key: ObjectKey,
    meta: Option<UserMeta>,
}

impl Unstored<'_> {
    /// What was to replace the marker (a DELETE, a PUT, a rename over it) is done.
    pub fn replaced(mut self) {
        self.meta = None;
    }

    /// Whether the marker was not in the bucket.
    #[cfg(test)]
    fn was_unstored(&self) -> bool {
        self.meta.is_some()
    }
}

impl Drop for Unstored<'_> {
    fn drop(&mut self) {
        if let Some(meta) = self.meta.take() {
            self.markers
                .markers
                .lock()
                .entry(self.key.to_string())
                .or_insert(Marker::Failed(meta));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bucketfs_store::fault::{Fault, FaultStore};
    use bucketfs_store::memory::MemoryStore;
    use bucketfs_store::metrics::Op;
    use bucketfs_store::StoreError;

    /// Markers over a memory store whose next `times` PUTs fail.
    fn failing_puts(times: u64) -> (Arc<MemoryStore>, PendingMarkers) {
        refused_puts(times, StoreError::Transient("injected".into()))
    }

    /// Markers over a memory store whose next `times` PUTs fail with `e`.
    fn refused_puts(times: u64, e: StoreError) -> (Arc<MemoryStore>, PendingMarkers) {
        let mem = Arc::new(MemoryStore::new());
        let fault = Arc::new(FaultStore::new(mem.clone()));
        fault.inject(Op::Put, 0, Some(times), Fault::Error(e));
        (mem, PendingMarkers::new(fault))
    }

    /// A marker the store refuses for its key is logged and not kept: the listings above
    /// it, which wait for every marker below, go on, the first one too (before: `EIO` for
    /// good, and every unmount said a file was not stored).
    #[tokio::test]
    async fn a_marker_the_store_refuses_for_its_key_is_not_kept() {
        let e = StoreError::Invalid("400 XMinioInvalidObjectName Object name contains...".into());
        let (mem, markers) = refused_puts(1, e);
        markers.start("top/long/".into(), UserMeta::new());
        markers.wait_below(&"top/".into()).await.unwrap();
        assert_eq!(markers.len(), 0, "kept for a try that cannot succeed");
        markers.wait_below(&"".into()).await.unwrap();
        markers.wait_below(&"top/".into()).await.unwrap();
        assert!(mem.head("top/long/").await.is_err());
        // Any other 400 (a setting of the bucket, a malformed request) stays a failure.
        let e = StoreError::Invalid("400 InvalidRequest Content-MD5 required".into());
        let (_, markers) = refused_puts(1, e);
        markers.start("other/".into(), UserMeta::new());
        assert_eq!(markers.wait_below(&"".into()).await, Err(FsError::EIO));
        assert_eq!(markers.len(), 1);
    }

    #[tokio::test]
    async fn a_failed_marker_is_sent_again_when_waited_for() {
        let (mem, markers) = failing_puts(1);
        markers.start("d/".into(), UserMeta::new());
        assert_eq!(markers.wait(&"d/".into()).await, Err(FsError::EIO));
        assert_eq!(markers.len(), 1, "kept for another try");
        assert!(mem.head("d/").await.is_err());
        markers.wait_below(&"".into()).await.unwrap();
        assert!(mem.head("d/").await.is_ok());
        assert_eq!(markers.len(), 0);
    }

    #[tokio::test]
    async fn wait_reports_a_failure_and_settle_forgets_it() {
        let (mem, markers) = failing_puts(2);
        markers.start("a/".into(), UserMeta::new());
        assert_eq!(markers.wait(&"a/".into()).await, Err(FsError::EIO));
        // wait() found it uploading: no second try yet. The next wait retries, and fails.
        assert_eq!(markers.wait(&"a/".into()).await, Err(FsError::EIO));
        let unstored = markers.settle(&"a/".into()).await;
        assert!(unstored.was_unstored(), "not in the bucket");
        assert_eq!(markers.len(), 0);
        unstored.replaced();
        assert_eq!(markers.len(), 0);
        assert_eq!(markers.wait(&"a/".into()).await, Ok(()));
        assert!(mem.head("a/").await.is_err());
    }
}
