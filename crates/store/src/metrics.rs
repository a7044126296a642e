//! Request counters: a wrapper that counts every store call by type plus bytes up and down.
//! Tests use it to assert how many requests an operation costs; the CLI exposes it.

use crate::*;
use async_trait::async_trait;
use bytes::Bytes;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

/// Kinds of store request, in the order they are reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    Head,
    Get,
    Put,
    CreateMultipart,
    UploadPart,
    UploadPartCopy,
    CompleteMultipart,
    AbortMultipart,
    ListMultipart,
    Copy,
    Delete,
    List,
    /// GetObjectTagging: the tags a write over a tagged object gives again.
    GetTagging,
}

impl Op {
    pub const ALL: [Op; 13] = [
        Op::Head,
        Op::Get,
        Op::Put,
        Op::CreateMultipart,
        Op::UploadPart,
        Op::UploadPartCopy,
        Op::CompleteMultipart,
        Op::AbortMultipart,
        Op::ListMultipart,
        Op::Copy,
        Op::Delete,
        Op::List,
        Op::GetTagging,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Op::Head => "head",
            Op::Get => "get",
            Op::Put => "put",
            Op::CreateMultipart => "create_multipart",
            Op::UploadPart => "upload_part",
            Op::UploadPartCopy => "upload_part_copy",
            Op::CompleteMultipart => "complete_multipart",
            Op::AbortMultipart => "abort_multipart",
            Op::ListMultipart => "list_multipart",
            Op::Copy => "copy",
            Op::Delete => "delete",
            Op::List => "list",
            Op::GetTagging => "get_tagging",
        }
    }
}

/// Counters shared between the wrapper and whoever reports them.
#[derive(Default, Debug)]
pub struct StoreMetrics {
    requests: [AtomicU64; Op::ALL.len()],
    errors: [AtomicU64; Op::ALL.len()],
    pub bytes_up: AtomicU64,
    pub bytes_down: AtomicU64,
    /// The S3 store's request bound, reported as gauges (none for other stores).
    slots: OnceLock<Arc<crate::s3::RequestSlots>>,
}

impl StoreMetrics {
    pub fn requests(&self, op: Op) -> u64 {
        self.requests[op as usize].load(Ordering::Relaxed)
    }
    pub fn errors(&self, op: Op) -> u64 {
        self.errors[op as usize].load(Ordering::Relaxed)
    }
    /// Reports `slots` (the S3 store's request bound) along with the counters.
    pub fn watch_request_slots(&self, slots: Arc<crate::s3::RequestSlots>) {
        let _ = self.slots.set(slots);
    }

    pub fn total_requests(&self) -> u64 {
        Op::ALL.iter().map(|o| self.requests(*o)).sum()
    }
    pub fn bytes_up(&self) -> u64 {
        self.bytes_up.load(Ordering::Relaxed)
    }
    pub fn bytes_down(&self) -> u64 {
        self.bytes_down.load(Ordering::Relaxed)
    }
    fn count<T>(&self, op: Op, r: &StoreResult<T>) {
        self.count_request(op, r.is_ok());
    }

    /// One request `op` a store sent on its own, within a call this wrapper counted as
    /// another (the HEAD and GetObjectTagging that read the headers a write keeps).
    pub fn count_request(&self, op: Op, ok: bool) {
        self.requests[op as usize].fetch_add(1, Ordering::Relaxed);
        if !ok {
            self.errors[op as usize].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Prometheus text exposition of all counters.
    pub fn prometheus(&self) -> String {
        let mut s = String::from("# TYPE bucketfs_store_requests_total counter\n");
        for op in Op::ALL {
            s += &format!(
                "bucketfs_store_requests_total{{op=\"{}\"}} {}\n",
                op.name(),
                self.requests(op)
            );
        }
        s += "# TYPE bucketfs_store_errors_total counter\n";
        for op in Op::ALL {
            s += &format!(
                "bucketfs_store_errors_total{{op=\"{}\"}} {}\n",
                op.name(),
                self.errors(op)
            );
        }
        s += &format!(
            "# TYPE bucketfs_store_bytes_up_total counter\nbucketfs_store_bytes_up_total {}\n",
            self.bytes_up()
        );
        s += &format!(
            "# TYPE bucketfs_store_bytes_down_total counter\nbucketfs_store_bytes_down_total {}\n",
            self.bytes_down()
        );
        if let Some(slots) = self.slots.get() {
            s += &format!(
                "# HELP bucketfs_store_requests_in_flight S3 requests holding one of the \
                 --max-connections slots\n# TYPE bucketfs_store_requests_in_flight gauge\n\
                 bucketfs_store_requests_in_flight {}\n\
                 # HELP bucketfs_store_requests_waiting S3 requests waiting for a slot\n\
                 # TYPE bucketfs_store_requests_waiting gauge\nbucketfs_store_requests_waiting {}\n",
                slots.in_use(),
                slots.waiting()
            );
        }
        s
    }
}

/// Wraps a store and counts what goes through it.
pub struct MeteredStore<S: ?Sized> {
    inner: Arc<S>,
    metrics: Arc<StoreMetrics>,
}

impl<S: ObjectStore + ?Sized> MeteredStore<S> {
    pub fn new(inner: Arc<S>) -> Self {
        Self {
            inner,
            metrics: Arc::default(),
        }
    }
    pub fn metrics(&self) -> Arc<StoreMetrics> {
        self.metrics.clone()
    }
}

#[async_trait]
impl<S: ObjectStore + ?Sized> crate::layer::StoreLayer for MeteredStore<S> {
    type Inner = S;
    fn inner(&self) -> &S {
        &self.inner
    }

    async fn head(&self, key: &str) -> StoreResult<ObjectMeta> {
        let r = self.inner.head(key).await;
        self.metrics.count(Op::Head, &r);
        r
    }

    async fn get_range(
        &self,
        key: &str,
        range: Range<u64>,
        if_match: Option<&str>,
    ) -> StoreResult<Bytes> {
        let r = self.inner.get_range(key, range, if_match).await;
        self.metrics.count(Op::Get, &r);
        if let Ok(b) = &r {
            self.metrics
                .bytes_down
                .fetch_add(b.len() as u64, Ordering::Relaxed);
        }
        r
    }

    async fn get_range_into(
        &self,
        key: &str,
        range: Range<u64>,
        if_match: Option<&str>,
        dst: &mut [u8],
    ) -> StoreResult<usize> {
        let r = self.inner.get_range_into(key, range, if_match, dst).await;
        self.metrics.count(Op::Get, &r);
        if let Ok(n) = &r {
            self.metrics
                .bytes_down
                .fetch_add(*n as u64, Ordering::Relaxed);
        }
        r
    }

    async fn put_if(
        &self,
        key: &str,
        body: Bytes,
        meta: &UserMeta,
        if_match: Option<&str>,
        headers_from: Option<HeadersFrom<'_>>,
    ) -> StoreResult<String> {
        let n = body.len() as u64;
        let r = self
            .inner
            .put_if(key, body, meta, if_match, headers_from)
            .await;
        self.metrics.count(Op::Put, &r);
        self.metrics.bytes_up.fetch_add(n, Ordering::Relaxed);
        r
    }

    async fn create_multipart(
        &self,
        key: &str,
        meta: &UserMeta,
        headers_from: Option<HeadersFrom<'_>>,
    ) -> StoreResult<String> {
        let r = self.inner.create_multipart(key, meta, headers_from).await;
        self.metrics.count(Op::CreateMultipart, &r);
        r
    }

    async fn upload_part(
        &self,
        key: &str,
        upload_id: &str,
        part_number: u32,
        body: Bytes,
    ) -> StoreResult<String> {
        let n = body.len() as u64;
        let r = self
            .inner
            .upload_part(key, upload_id, part_number, body)
            .await;
        self.metrics.count(Op::UploadPart, &r);
        self.metrics.bytes_up.fetch_add(n, Ordering::Relaxed);
        r
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
        let r = self
            .inner
            .upload_part_copy(key, upload_id, part_number, src_key, range, src_if_match)
            .await;
        self.metrics.count(Op::UploadPartCopy, &r);
        r
    }

    async fn complete_multipart(
        &self,
        key: &str,
        upload_id: &str,
        parts: &[CompletedPart],
        if_match: Option<&str>,
    ) -> StoreResult<String> {
        let r = self
            .inner
            .complete_multipart(key, upload_id, parts, if_match)
            .await;
        self.metrics.count(Op::CompleteMultipart, &r);
        r
    }

    async fn abort_multipart(&self, key: &str, upload_id: &str) -> StoreResult<()> {
        let r = self.inner.abort_multipart(key, upload_id).await;
        self.metrics.count(Op::AbortMultipart, &r);
        r
    }

    async fn list_multipart_uploads(&self, prefix: &str) -> StoreResult<Vec<MultipartUpload>> {
        let r = self.inner.list_multipart_uploads(prefix).await;
        self.metrics.count(Op::ListMultipart, &r);
        r
    }

    async fn copy(
        &self,
        src_key: &str,
        dst_key: &str,
        meta: Option<&UserMeta>,
        src_if_match: Option<&str>,
    ) -> StoreResult<String> {
        let r = self.inner.copy(src_key, dst_key, meta, src_if_match).await;
        self.metrics.count(Op::Copy, &r);
        r
    }

    async fn delete(&self, key: &str) -> StoreResult<()> {
        let r = self.inner.delete(key).await;
        self.metrics.count(Op::Delete, &r);
        r
    }

    async fn delete_if(&self, key: &str, if_match: &str) -> StoreResult<()> {
        let r = self.inner.delete_if(key, if_match).await;
        self.metrics.count(Op::Delete, &r);
        r
    }

    async fn list(
        &self,
        prefix: &str,
        delimiter: Option<&str>,
        from: ListFrom,
        max_keys: usize,
        detail: ListDetail,
    ) -> StoreResult<ListPage> {
        let r = self
            .inner
            .list(prefix, delimiter, from, max_keys, detail)
            .await;
        self.metrics.count(Op::List, &r);
        r
    }
}
