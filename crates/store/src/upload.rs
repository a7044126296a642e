//! The multipart protocol, written once: an [`Upload`] is created, fed parts (sent or copied
//! server-side), then completed or aborted. Every caller (the write path, copies over the
//! CopyObject limit, the bench) goes through it.
//!
//! Why part requests run as tasks the upload counts, and why a failure waits for the running
//! ones: a dropped request whose body the server already has may still store its part after
//! the caller has aborted the upload; S3 then keeps (and bills) that part, and MinIO lists the
//! upload again. So a part request, once started, runs to its end even if its caller stops
//! waiting, and [`Upload::abort`] (or the drop of an upload never finished) waits for every
//! running one before it asks the store. [`run_bounded`] runs a batch the same way: the first
//! failure stops new requests and is returned once the running ones are done.
//!
//! An abort that fails (the store is down) leaves the upload on its [`Uploads`]' orphan list,
//! which [`Uploads::retry_aborts`] works through.
//!
//! On a mount's store an upload is also in the crash journal ([`crate::journal`]) from its
//! creation to its end, so that one a crash leaves open is aborted by the next mount.

use crate::journal::UploadJournal;
use crate::liveness::{operation_start, within_operation_from};
use crate::{CompletedPart, HeadersFrom, ObjectStore, StoreError, StoreResult, UserMeta};
use bytes::Bytes;
use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, StreamExt};
use std::future::Future;
use std::ops::Range;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// How often aborts that failed are tried again.
const ABORT_RETRY: Duration = Duration::from_secs(5);

/// The multipart uploads made through one store, and those of them whose abort failed
/// (tried again every few seconds while this lives, and by [`Uploads::retry_aborts`]).
pub struct Uploads {
    store: Arc<dyn ObjectStore>,
    /// The store's crash journal, if it has one: every upload is in it until it ends.
    journal: Option<Arc<UploadJournal>>,
    /// `(key, upload id)` to abort later.
    orphans: parking_lot::Mutex<Vec<(String, String)>>,
}

impl Uploads {
    pub fn new(store: Arc<dyn ObjectStore>) -> Arc<Self> {
        let uploads = Arc::new(Self {
            journal: store.upload_journal(),
            store,
            orphans: parking_lot::Mutex::new(Vec::new()),
        });
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(Self::retry_aborts_forever(Arc::downgrade(&uploads)));
        }
        uploads
    }

    /// Every few seconds, aborts uploads whose abort failed earlier (the store was down).
    async fn retry_aborts_forever(uploads: std::sync::Weak<Self>) {
        loop {
            tokio::time::sleep(ABORT_RETRY).await;
            let Some(uploads) = uploads.upgrade() else {
                return;
            };
            if uploads.pending_aborts() > 0 {
                uploads.retry_aborts().await;
            }
        }
    }

    /// Starts a multipart upload of `key` whose object will carry `meta`, and with `from`
    /// that version's other headers (see [`ObjectStore::create_multipart`]): the version
    /// it replaces, or the source of a copy made in parts.
    pub async fn create(
        self: &Arc<Self>,
        key: &str,
        meta: &UserMeta,
        from: Option<HeadersFrom<'_>>,
    ) -> StoreResult<Upload> {
        let id = self.store.create_multipart(key, meta, from).await?;
        if let Some(journal) = &self.journal {
            if let Err(e) = journal.started(key, &id) {
                // Without a journal entry a crash would leave this upload behind for good:
                // give it up now rather than risk that.
                let _ = self.store.abort_multipart(key, &id).await;
                return Err(journal.failed(e));
            }
        }
        Ok(Upload {
            shared: Arc::new(Shared {
                uploads: self.clone(),
                key: key.to_string(),
                id,
                running: AtomicUsize::new(0),
                idle: Notify::new(),
            }),
            finished: false,
        })
    }

    /// Uploads whose abort failed and is still to be retried.
    pub fn pending_aborts(&self) -> usize {
        self.orphans.lock().len()
    }

    /// Tries every failed abort once more; keeps those that still fail.
    pub async fn retry_aborts(&self) {
        let todo = std::mem::take(&mut *self.orphans.lock());
        for (key, id) in todo {
            let r = self.store.abort_multipart(&key, &id).await;
            self.ended(&key, &id, &r);
            match r {
                Ok(()) => tracing::info!("aborted leftover upload of {key}"),
                Err(e) => {
                    tracing::debug!("abort of leftover upload of {key} failed again: {e}");
                    self.orphans.lock().push((key, id));
                }
            }
        }
    }
}

impl Uploads {
    /// The upload `id` of `key` is over, if `r` (its completion or abort) says so: it leaves
    /// the journal.
    fn ended<T>(&self, key: &str, id: &str, r: &StoreResult<T>) {
        let over = match r {
            Ok(_) => true,
            Err(e) => e.is_not_found(),
        };
        if let (true, Some(journal)) = (over, &self.journal) {
            journal.end(key, id);
        }
    }
}

struct Shared {
    uploads: Arc<Uploads>,
    key: String,
    id: String,
    /// Part requests started and not finished.
    running: AtomicUsize,
    /// Signalled when `running` drops to zero.
    idle: Notify,
}

impl Shared {
    fn store(&self) -> &Arc<dyn ObjectStore> {
        &self.uploads.store
    }

    /// Starts `request` as a task counted in `running`, so that an abort can wait for it. The
    /// task serves the file-system operation that started at `operation` (see
    /// [`crate::liveness`]), if any.
    fn start<F>(self: &Arc<Self>, operation: Option<Instant>, request: F) -> PartRequest
    where
        F: Future<Output = StoreResult<String>> + Send + 'static,
    {
        self.running.fetch_add(1, Ordering::SeqCst);
        let shared = self.clone();
        PartRequest(tokio::spawn(async move {
            let r = within_operation_from(operation, request).await;
            if shared.running.fetch_sub(1, Ordering::SeqCst) == 1 {
                shared.idle.notify_waiters();
            }
            r
        }))
    }

    async fn wait_idle(&self) {
        loop {
            let idle = self.idle.notified();
            if self.running.load(Ordering::SeqCst) == 0 {
                return;
            }
            idle.await;
        }
    }

    /// Waits for the running parts, then aborts; a failed abort goes on the orphan list.
    async fn abort(&self) -> StoreResult<()> {
        self.wait_idle().await;
        let r = self.store().abort_multipart(&self.key, &self.id).await;
        self.uploads.ended(&self.key, &self.id, &r);
        if r.is_err() {
            self.uploads
                .orphans
                .lock()
                .push((self.key.clone(), self.id.clone()));
        }
        r
    }
}

/// One multipart upload in progress. Drop it without [`Upload::complete`] or
/// [`Upload::abort`] and it is aborted in the background (after its running parts).
pub struct Upload {
    shared: Arc<Shared>,
    /// Completed or aborted: nothing left to do at drop.
    finished: bool,
}

/// A part request under way; it runs to its end even if this is dropped. Gives the part's
/// ETag.
pub struct PartRequest(tokio::task::JoinHandle<StoreResult<String>>);

impl Future for PartRequest {
    type Output = StoreResult<String>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.0).poll(cx).map(|r| {
            r.unwrap_or_else(|e| Err(StoreError::Other(format!("part request failed: {e}"))))
        })
    }
}

impl Upload {
    pub fn key(&self) -> &str {
        &self.shared.key
    }

    pub fn id(&self) -> &str {
        &self.shared.id
    }

    /// Starts uploading part `number` (1-based) now, as part of the current file-system
    /// operation (it shares its deadline).
    pub fn part(&self, number: u32, body: Bytes) -> PartRequest {
        self.send_part(operation_start(), number, body)
    }

    /// [`Upload::part`] for a part sent in the background while the file goes on being
    /// written: it belongs to no operation, and has a deadline of its own.
    pub fn part_in_background(&self, number: u32, body: Bytes) -> PartRequest {
        self.send_part(None, number, body)
    }

    fn send_part(&self, operation: Option<Instant>, number: u32, body: Bytes) -> PartRequest {
        let s = self.shared.clone();
        self.shared.start(operation, async move {
            s.store().upload_part(&s.key, &s.id, number, body).await
        })
    }

    /// Starts copying `range` of `src` server-side as part `number` now, only from the
    /// version with ETag `src_if_match` when given (see [`ObjectStore::upload_part_copy`]).
    pub fn copy_part(
        &self,
        number: u32,
        src: &str,
        range: Range<u64>,
        src_if_match: Option<&str>,
    ) -> PartRequest {
        let s = self.shared.clone();
        let (src, pin) = (src.to_string(), src_if_match.map(str::to_string));
        self.shared.start(operation_start(), async move {
            s.store()
                .upload_part_copy(&s.key, &s.id, number, &src, range, pin.as_deref())
                .await
        })
    }

    /// Completes the upload from `parts`, in order; returns the new ETag. With `if_match`,
    /// only while the object still has that ETag. On failure the upload stays open: abort it
    /// (or drop it).
    pub async fn complete(
        &mut self,
        parts: &[CompletedPart],
        if_match: Option<&str>,
    ) -> StoreResult<String> {
        let s = &self.shared;
        let r = s
            .store()
            .complete_multipart(&s.key, &s.id, parts, if_match)
            .await;
        if r.is_ok() {
            s.uploads.ended(&s.key, &s.id, &r);
        }
        let etag = r?;
        self.finished = true;
        Ok(etag)
    }

    /// Aborts the upload once its running parts are done. If the store refuses, the upload
    /// is kept for [`Uploads::retry_aborts`] and the error returned (to log).
    pub async fn abort(mut self) -> StoreResult<()> {
        self.finished = true;
        self.shared.abort().await
    }
}

impl Drop for Upload {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        let shared = self.shared.clone();
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn(async move {
                    let _ = shared.abort().await;
                });
            }
            Err(_) => shared
                .uploads
                .orphans
                .lock()
                .push((shared.key.clone(), shared.id.clone())),
        }
    }
}

/// Runs `jobs` with at most `limit` at a time and returns their results in order, or the
/// first error once every job already started has finished (see the module docs).
pub async fn run_bounded<T, E>(
    jobs: Vec<BoxFuture<'_, Result<T, E>>>,
    limit: usize,
) -> Result<Vec<T>, E> {
    let total = jobs.len();
    let mut waiting = jobs.into_iter().enumerate();
    let mut running = FuturesUnordered::new();
    let mut done: Vec<Option<T>> = (0..total).map(|_| None).collect();
    let mut first_error = None;
    loop {
        while first_error.is_none() && running.len() < limit.max(1) {
            let Some((i, job)) = waiting.next() else {
                break;
            };
            running.push(async move { (i, job.await) });
        }
        match running.next().await {
            None => break,
            Some((i, Ok(v))) => done[i] = Some(v),
            Some((_, Err(e))) => {
                first_error.get_or_insert(e);
            }
        }
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(done
            .into_iter()
            .map(|v| v.expect("every job ran"))
            .collect()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fault::{Fault, FaultStore};
    use crate::memory::MemoryStore;
    use crate::metrics::Op;
    use futures::FutureExt;
    use std::time::Duration;

    #[tokio::test]
    async fn results_come_in_order_with_the_bound_kept() {
        let running = Arc::new(AtomicUsize::new(0));
        let peak = Arc::new(AtomicUsize::new(0));
        let jobs: Vec<BoxFuture<'_, Result<usize, ()>>> = (0..10)
            .map(|i| {
                let (running, peak) = (running.clone(), peak.clone());
                async move {
                    let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                    peak.fetch_max(now, Ordering::SeqCst);
                    // Later jobs finish first, so order is not completion order.
                    tokio::time::sleep(Duration::from_millis(20 - i as u64)).await;
                    running.fetch_sub(1, Ordering::SeqCst);
                    Ok(i)
                }
                .boxed()
            })
            .collect();
        assert_eq!(run_bounded(jobs, 3).await, Ok((0..10).collect()));
        assert_eq!(peak.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn a_failure_waits_for_running_jobs_and_starts_no_more() {
        let finished = Arc::new(AtomicUsize::new(0));
        let started = Arc::new(AtomicUsize::new(0));
        let jobs: Vec<BoxFuture<'_, Result<(), usize>>> = (0..10)
            .map(|i| {
                let (finished, started) = (finished.clone(), started.clone());
                async move {
                    started.fetch_add(1, Ordering::SeqCst);
                    if i == 0 {
                        return Err(0);
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    finished.fetch_add(1, Ordering::SeqCst);
                    Ok(())
                }
                .boxed()
            })
            .collect();
        assert_eq!(run_bounded(jobs, 3).await, Err(0));
        // Jobs 1 and 2 were running when job 0 failed: both ran to the end; none after.
        assert_eq!(started.load(Ordering::SeqCst), 3);
        assert_eq!(finished.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn an_upload_completes_from_sent_and_copied_parts() {
        let mem = Arc::new(MemoryStore::new());
        let meta = UserMeta::new();
        mem.put("src", Bytes::from_static(b"0123456789"), &meta)
            .await
            .unwrap();
        let uploads = Uploads::new(mem.clone());
        let mut up = uploads.create("dst", &meta, None).await.unwrap();
        let first = Bytes::from(vec![b'a'; 5 << 20]);
        let a = up.part(1, first).await.unwrap();
        let b = up.copy_part(2, "src", 2..5, None).await.unwrap();
        let parts = [
            CompletedPart {
                part_number: 1,
                etag: a,
            },
            CompletedPart {
                part_number: 2,
                etag: b,
            },
        ];
        up.complete(&parts, None).await.unwrap();
        drop(up);
        tokio::task::yield_now().await;
        let got = mem.get_range("dst", (5 << 20) - 1..6 << 20, None).await;
        assert_eq!(got.unwrap(), "a234");
        assert_eq!(mem.pending_uploads(), 0);
    }

    /// A part whose caller gave up still runs; the abort comes after it, so no part lands on
    /// an aborted upload. A dropped upload is aborted the same way.
    #[tokio::test]
    async fn abort_and_drop_wait_for_running_parts() {
        let mem = Arc::new(MemoryStore::new());
        let fault = Arc::new(FaultStore::new(mem.clone()));
        let uploads = Uploads::new(fault.clone());
        let meta = UserMeta::new();
        for abandon in [false, true] {
            fault.inject(
                Op::UploadPart,
                0,
                Some(1),
                Fault::Delay(Duration::from_millis(100)),
            );
            let up = uploads.create("k", &meta, None).await.unwrap();
            drop(up.part(1, Bytes::from_static(b"x")));
            let started = std::time::Instant::now();
            if abandon {
                drop(up);
                while mem.pending_uploads() > 0 {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            } else {
                up.abort().await.unwrap();
            }
            assert!(started.elapsed() >= Duration::from_millis(90));
            assert_eq!(mem.pending_uploads(), 0);
            assert_eq!(fault.aborts_racing_parts(), 0);
            assert_eq!(fault.parts_cancelled(), 0);
        }
    }

    /// Records the operation each part request serves.
    struct SeesOperation {
        inner: Arc<dyn ObjectStore>,
        seen: parking_lot::Mutex<Vec<Option<Instant>>>,
    }

    #[async_trait::async_trait]
    impl crate::layer::StoreLayer for SeesOperation {
        type Inner = dyn ObjectStore;
        fn inner(&self) -> &Self::Inner {
            &*self.inner
        }
        async fn upload_part(
            &self,
            key: &str,
            upload_id: &str,
            part_number: u32,
            body: Bytes,
        ) -> StoreResult<String> {
            self.seen.lock().push(operation_start());
            self.inner
                .upload_part(key, upload_id, part_number, body)
                .await
        }
    }

    /// A part runs in a task of its own but keeps the deadline of the operation that sent
    /// it; a part sent in the background has its own.
    #[tokio::test]
    async fn a_part_serves_the_operation_that_sent_it() {
        let seer = Arc::new(SeesOperation {
            inner: Arc::new(MemoryStore::new()),
            seen: Default::default(),
        });
        let uploads = Uploads::new(seer.clone());
        let up = uploads.create("k", &UserMeta::new(), None).await.unwrap();
        let body = Bytes::from_static(b"x");
        let start = crate::liveness::within_operation(async {
            up.part(1, body.clone()).await.unwrap();
            up.part_in_background(2, body.clone()).await.unwrap();
            operation_start()
        })
        .await;
        assert!(start.is_some());
        assert_eq!(*seer.seen.lock(), vec![start, None]);
        up.abort().await.unwrap();
    }

    #[tokio::test]
    async fn a_failed_abort_is_retried() {
        let mem = Arc::new(MemoryStore::new());
        let fault = Arc::new(FaultStore::new(mem.clone()));
        let uploads = Uploads::new(fault.clone());
        let up = uploads.create("k", &UserMeta::new(), None).await.unwrap();
        let down = Fault::Error(StoreError::Transient("down".into()));
        fault.inject(Op::AbortMultipart, 0, Some(1), down);
        assert!(up.abort().await.is_err());
        assert_eq!(uploads.pending_aborts(), 1);
        assert_eq!(mem.pending_uploads(), 1);
        uploads.retry_aborts().await;
        assert_eq!(uploads.pending_aborts(), 0);
        assert_eq!(mem.pending_uploads(), 0);
    }

    /// A failed abort is tried again every few seconds while the uploads live.
    #[tokio::test(start_paused = true)]
    async fn a_failed_abort_is_retried_in_the_background() {
        let mem = Arc::new(MemoryStore::new());
        let fault = Arc::new(FaultStore::new(mem.clone()));
        let uploads = Uploads::new(fault.clone());
        let up = uploads.create("k", &UserMeta::new(), None).await.unwrap();
        let down = Fault::Error(StoreError::Transient("down".into()));
        fault.inject(Op::AbortMultipart, 0, Some(1), down);
        assert!(up.abort().await.is_err());
        assert_eq!(mem.pending_uploads(), 1);
        tokio::time::sleep(ABORT_RETRY + Duration::from_secs(1)).await;
        assert_eq!(uploads.pending_aborts(), 0);
        assert_eq!(mem.pending_uploads(), 0);
    }
}
