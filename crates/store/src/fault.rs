//! A store wrapper that injects failures and latency on chosen calls, for unit tests of the
//! fs core's error handling (cases a real server cannot be made to produce on demand).

use crate::metrics::Op;
use crate::*;
use async_trait::async_trait;
use bytes::Bytes;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// What to do to a matching call.
#[derive(Debug, Clone)]
pub enum Fault {
    /// Fail with this error instead of calling the inner store.
    Error(StoreError),
    /// Sleep, then call the inner store.
    Delay(Duration),
    /// Call the inner store (the request happens), then report a dropped connection.
    DropAfter,
    /// Call the inner store (the request happens), then never answer (a held response).
    HangAfter,
    /// Call the inner store (the request happens), then sleep before answering (an answer
    /// slow on its way back: the store may change meanwhile).
    DelayAfter(Duration),
}

#[derive(Debug, Clone)]
struct Rule {
    op: Op,
    /// Skip this many matching calls before the rule fires.
    skip: u64,
    /// Fire this many times; `None` = forever.
    times: Option<u64>,
    fault: Fault,
}

pub struct FaultStore {
    inner: Arc<dyn ObjectStore>,
    rules: Mutex<Vec<Rule>>,
    /// Part requests (upload and copy) running now, by upload id.
    parts_running: Arc<Mutex<HashMap<String, usize>>>,
    /// Aborts sent while a part request of the same upload was running.
    aborts_racing_parts: AtomicU64,
    /// Part requests dropped before they returned.
    parts_cancelled: Arc<AtomicU64>,
    parts_started: AtomicU64,
}

impl FaultStore {
    pub fn new(inner: Arc<dyn ObjectStore>) -> Self {
        Self {
            inner,
            rules: Mutex::new(Vec::new()),
            parts_running: Arc::default(),
            aborts_racing_parts: AtomicU64::new(0),
            parts_cancelled: Arc::default(),
            parts_started: AtomicU64::new(0),
        }
    }

    /// Aborts sent while a part request of the same upload was still running. On a real
    /// server that part may be stored after the abort, and kept.
    pub fn aborts_racing_parts(&self) -> u64 {
        self.aborts_racing_parts.load(Ordering::Relaxed)
    }

    /// Part requests dropped before they returned: the server may still store such a part.
    pub fn parts_cancelled(&self) -> u64 {
        self.parts_cancelled.load(Ordering::Relaxed)
    }

    /// Part requests (upload and copy) that reached this store.
    pub fn parts_started(&self) -> u64 {
        self.parts_started.load(Ordering::Relaxed)
    }

    /// [`Self::wrap`] for a part request of `upload_id`, counted while it runs.
    async fn wrap_part<F>(&self, op: Op, upload_id: &str, call: F) -> StoreResult<String>
    where
        F: std::future::Future<Output = StoreResult<String>> + Send,
    {
        self.parts_started.fetch_add(1, Ordering::Relaxed);
        *self
            .parts_running
            .lock()
            .entry(upload_id.to_string())
            .or_default() += 1;
        let mut request = PartRequest {
            upload_id: upload_id.to_string(),
            running: self.parts_running.clone(),
            cancelled: self.parts_cancelled.clone(),
            returned: false,
        };
        let r = self.wrap(op, call).await;
        request.returned = true;
        r
    }

    /// Injects `fault` on calls of `op`, after `skip` clean calls, `times` times (None: always).
    pub fn inject(&self, op: Op, skip: u64, times: Option<u64>, fault: Fault) {
        self.rules.lock().push(Rule {
            op,
            skip,
            times,
            fault,
        });
    }

    pub fn clear(&self) {
        self.rules.lock().clear();
    }

    fn take(&self, op: Op) -> Option<Fault> {
        let mut rules = self.rules.lock();
        for r in rules.iter_mut().filter(|r| r.op == op) {
            if r.skip > 0 {
                r.skip -= 1;
                continue;
            }
            match &mut r.times {
                Some(0) => continue,
                Some(n) => *n -= 1,
                None => {}
            }
            return Some(r.fault.clone());
        }
        None
    }

    async fn wrap<T, F>(&self, op: Op, call: F) -> StoreResult<T>
    where
        F: std::future::Future<Output = StoreResult<T>> + Send,
    {
        match self.take(op) {
            None => call.await,
            Some(Fault::Error(e)) => Err(e),
            Some(Fault::Delay(d)) => {
                tokio::time::sleep(d).await;
                call.await
            }
            Some(Fault::DropAfter) => {
                let _ = call.await;
                Err(StoreError::Transient("connection reset (injected)".into()))
            }
            Some(Fault::HangAfter) => {
                let _ = call.await;
                std::future::pending().await
            }
            Some(Fault::DelayAfter(d)) => {
                let r = call.await;
                tokio::time::sleep(d).await;
                r
            }
        }
    }
}

/// One part request in flight; counted out when it returns or is dropped.
struct PartRequest {
    upload_id: String,
    running: Arc<Mutex<HashMap<String, usize>>>,
    cancelled: Arc<AtomicU64>,
    returned: bool,
}

impl Drop for PartRequest {
    fn drop(&mut self) {
        if !self.returned {
            self.cancelled.fetch_add(1, Ordering::Relaxed);
        }
        let mut running = self.running.lock();
        if let Some(n) = running.get_mut(&self.upload_id) {
            *n -= 1;
            if *n == 0 {
                running.remove(&self.upload_id);
            }
        }
    }
}

#[async_trait]
impl crate::layer::StoreLayer for FaultStore {
    type Inner = dyn ObjectStore;
    fn inner(&self) -> &Self::Inner {
        &*self.inner
    }
    fn describe(&self) -> String {
        format!("faulty {}", self.inner.describe())
    }
    async fn head(&self, key: &str) -> StoreResult<ObjectMeta> {
        self.wrap(Op::Head, self.inner.head(key)).await
    }
    async fn get_range(
        &self,
        key: &str,
        range: Range<u64>,
        if_match: Option<&str>,
    ) -> StoreResult<Bytes> {
        self.wrap(Op::Get, self.inner.get_range(key, range, if_match))
            .await
    }
    async fn get_range_into(
        &self,
        key: &str,
        range: Range<u64>,
        if_match: Option<&str>,
        dst: &mut [u8],
    ) -> StoreResult<usize> {
        self.wrap(
            Op::Get,
            self.inner.get_range_into(key, range, if_match, dst),
        )
        .await
    }
    async fn put_if(
        &self,
        key: &str,
        body: Bytes,
        meta: &UserMeta,
        if_match: Option<&str>,
        headers_from: Option<HeadersFrom<'_>>,
    ) -> StoreResult<String> {
        self.wrap(
            Op::Put,
            self.inner.put_if(key, body, meta, if_match, headers_from),
        )
        .await
    }
    async fn create_multipart(
        &self,
        key: &str,
        meta: &UserMeta,
        headers_from: Option<HeadersFrom<'_>>,
    ) -> StoreResult<String> {
        self.wrap(
            Op::CreateMultipart,
            self.inner.create_multipart(key, meta, headers_from),
        )
        .await
    }
    async fn upload_part(
        &self,
        key: &str,
        upload_id: &str,
        part_number: u32,
        body: Bytes,
    ) -> StoreResult<String> {
        self.wrap_part(
            Op::UploadPart,
            upload_id,
            self.inner.upload_part(key, upload_id, part_number, body),
        )
        .await
    }
    async fn upload_part_copy(
        &self,
        key: &str,
        upload_id: &str,
        part_number: u32,
        src_key: &str,
        range: Range<u64>,
        src_if_match: Option<&str>,
    ) -> StoreResult<String> {
        self.wrap_part(
            Op::UploadPartCopy,
            upload_id,
            self.inner
                .upload_part_copy(key, upload_id, part_number, src_key, range, src_if_match),
        )
        .await
    }
    async fn complete_multipart(
        &self,
        key: &str,
        upload_id: &str,
        parts: &[CompletedPart],
        if_match: Option<&str>,
    ) -> StoreResult<String> {
        self.wrap(
            Op::CompleteMultipart,
            self.inner
                .complete_multipart(key, upload_id, parts, if_match),
        )
        .await
    }
    async fn abort_multipart(&self, key: &str, upload_id: &str) -> StoreResult<()> {
        if self.parts_running.lock().contains_key(upload_id) {
            self.aborts_racing_parts.fetch_add(1, Ordering::Relaxed);
        }
        self.wrap(
            Op::AbortMultipart,
            self.inner.abort_multipart(key, upload_id),
        )
        .await
    }
    async fn list_multipart_uploads(&self, prefix: &str) -> StoreResult<Vec<MultipartUpload>> {
        self.wrap(Op::ListMultipart, self.inner.list_multipart_uploads(prefix))
            .await
    }
    async fn copy(
        &self,
        src_key: &str,
        dst_key: &str,
        meta: Option<&UserMeta>,
        src_if_match: Option<&str>,
    ) -> StoreResult<String> {
        self.wrap(
            Op::Copy,
            self.inner.copy(src_key, dst_key, meta, src_if_match),
        )
        .await
    }
    async fn delete(&self, key: &str) -> StoreResult<()> {
        self.wrap(Op::Delete, self.inner.delete(key)).await
    }
    async fn delete_if(&self, key: &str, if_match: &str) -> StoreResult<()> {
        self.wrap(Op::Delete, self.inner.delete_if(key, if_match))
            .await
    }
    async fn list(
        &self,
        prefix: &str,
        delimiter: Option<&str>,
        from: ListFrom,
        max_keys: usize,
        detail: ListDetail,
    ) -> StoreResult<ListPage> {
        self.wrap(
            Op::List,
            self.inner.list(prefix, delimiter, from, max_keys, detail),
        )
        .await
    }
}
