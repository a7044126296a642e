//! Wrapper stores (retry, metrics, faults, the upload journal) as layers: a layer names its
//! inner store and writes only the methods it changes; every other one goes straight through.
//!
//! Every [`StoreLayer`] is an [`ObjectStore`] by the blanket impl below, which hands each
//! trait method to the layer's method of the same name. A method added to [`ObjectStore`] must
//! be added here too: the blanket impl does not compile without a new required method, and
//! `clippy::missing_trait_methods` (denied on it) fails on a new provided one, so no layer is
//! ever skipped by a default. The layer's own default then forwards it to the inner store.
//!
//! Bring this trait into scope only where a layer is implemented: where both traits are in
//! scope, a method call on a concrete layer type is ambiguous (write `ObjectStore::m(&x, ..)`).

use crate::*;
use async_trait::async_trait;
use bytes::Bytes;

/// A store that wraps another one. Each method defaults to the inner store's.
#[async_trait]
pub trait StoreLayer: Send + Sync + 'static {
    type Inner: ObjectStore + ?Sized;

    /// The store this layer wraps.
    fn inner(&self) -> &Self::Inner;

    fn describe(&self) -> String {
        self.inner().describe()
    }

    fn limits(&self) -> StoreLimits {
        self.inner().limits()
    }

    fn upload_journal(&self) -> Option<Arc<journal::UploadJournal>> {
        self.inner().upload_journal()
    }

    async fn head(&self, key: &str) -> StoreResult<ObjectMeta> {
        self.inner().head(key).await
    }

    async fn get_range(
        &self,
        key: &str,
        range: Range<u64>,
        if_match: Option<&str>,
    ) -> StoreResult<Bytes> {
        self.inner().get_range(key, range, if_match).await
    }

    async fn get_range_into(
        &self,
        key: &str,
        range: Range<u64>,
        if_match: Option<&str>,
        dst: &mut [u8],
    ) -> StoreResult<usize> {
        self.inner().get_range_into(key, range, if_match, dst).await
    }

    async fn put_if(
        &self,
        key: &str,
        body: Bytes,
        meta: &UserMeta,
        if_match: Option<&str>,
        headers_from: Option<HeadersFrom<'_>>,
    ) -> StoreResult<String> {
        self.inner()
            .put_if(key, body, meta, if_match, headers_from)
            .await
    }

    async fn create_multipart(
        &self,
        key: &str,
        meta: &UserMeta,
        headers_from: Option<HeadersFrom<'_>>,
    ) -> StoreResult<String> {
        self.inner().create_multipart(key, meta, headers_from).await
    }

    async fn upload_part(
        &self,
        key: &str,
        upload_id: &str,
        part_number: u32,
        body: Bytes,
    ) -> StoreResult<String> {
        self.inner()
            .upload_part(key, upload_id, part_number, body)
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
        self.inner()
            .upload_part_copy(key, upload_id, part_number, src_key, range, src_if_match)
            .await
    }

    async fn complete_multipart(
        &self,
        key: &str,
        upload_id: &str,
        parts: &[CompletedPart],
        if_match: Option<&str>,
    ) -> StoreResult<String> {
        self.inner()
            .complete_multipart(key, upload_id, parts, if_match)
            .await
    }

    async fn abort_multipart(&self, key: &str, upload_id: &str) -> StoreResult<()> {
        self.inner().abort_multipart(key, upload_id).await
    }

    async fn list_multipart_uploads(&self, prefix: &str) -> StoreResult<Vec<MultipartUpload>> {
        self.inner().list_multipart_uploads(prefix).await
    }

    async fn copy(
        &self,
        src_key: &str,
        dst_key: &str,
        meta: Option<&UserMeta>,
        src_if_match: Option<&str>,
    ) -> StoreResult<String> {
        self.inner()
            .copy(src_key, dst_key, meta, src_if_match)
            .await
    }

    async fn delete(&self, key: &str) -> StoreResult<()> {
        self.inner().delete(key).await
    }

    async fn delete_if(&self, key: &str, if_match: &str) -> StoreResult<()> {
        self.inner().delete_if(key, if_match).await
    }

    async fn list(
        &self,
        prefix: &str,
        delimiter: Option<&str>,
        from: ListFrom,
        max_keys: usize,
        detail: ListDetail,
    ) -> StoreResult<ListPage> {
        self.inner()
            .list(prefix, delimiter, from, max_keys, detail)
            .await
    }
}

#[deny(clippy::missing_trait_methods)]
#[async_trait]
impl<L: StoreLayer> ObjectStore for L {
    fn describe(&self) -> String {
        StoreLayer::describe(self)
    }

    fn limits(&self) -> StoreLimits {
        StoreLayer::limits(self)
    }

    fn upload_journal(&self) -> Option<Arc<journal::UploadJournal>> {
        StoreLayer::upload_journal(self)
    }

    async fn head(&self, key: &str) -> StoreResult<ObjectMeta> {
        StoreLayer::head(self, key).await
    }

    async fn get_range(
        &self,
        key: &str,
        range: Range<u64>,
        if_match: Option<&str>,
    ) -> StoreResult<Bytes> {
        StoreLayer::get_range(self, key, range, if_match).await
    }

    async fn get_range_into(
        &self,
        key: &str,
        range: Range<u64>,
        if_match: Option<&str>,
        dst: &mut [u8],
    ) -> StoreResult<usize> {
        StoreLayer::get_range_into(self, key, range, if_match, dst).await
    }

    /// Through this layer's own `put_if`, as for any store.
    async fn put(&self, key: &str, body: Bytes, meta: &UserMeta) -> StoreResult<String> {
        StoreLayer::put_if(self, key, body, meta, None, None).await
    }

    async fn put_if(
        &self,
        key: &str,
        body: Bytes,
        meta: &UserMeta,
        if_match: Option<&str>,
        headers_from: Option<HeadersFrom<'_>>,
    ) -> StoreResult<String> {
        StoreLayer::put_if(self, key, body, meta, if_match, headers_from).await
    }

    async fn create_multipart(
        &self,
        key: &str,
        meta: &UserMeta,
        headers_from: Option<HeadersFrom<'_>>,
    ) -> StoreResult<String> {
        StoreLayer::create_multipart(self, key, meta, headers_from).await
    }

    async fn upload_part(
        &self,
        key: &str,
        upload_id: &str,
        part_number: u32,
        body: Bytes,
    ) -> StoreResult<String> {
        StoreLayer::upload_part(self, key, upload_id, part_number, body).await
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
        StoreLayer::upload_part_copy(
            self,
            key,
            upload_id,
            part_number,
            src_key,
            range,
            src_if_match,
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
        StoreLayer::complete_multipart(self, key, upload_id, parts, if_match).await
    }

    async fn abort_multipart(&self, key: &str, upload_id: &str) -> StoreResult<()> {
        StoreLayer::abort_multipart(self, key, upload_id).await
    }

    async fn list_multipart_uploads(&self, prefix: &str) -> StoreResult<Vec<MultipartUpload>> {
        StoreLayer::list_multipart_uploads(self, prefix).await
    }

    async fn copy(
        &self,
        src_key: &str,
        dst_key: &str,
        meta: Option<&UserMeta>,
        src_if_match: Option<&str>,
    ) -> StoreResult<String> {
        StoreLayer::copy(self, src_key, dst_key, meta, src_if_match).await
    }

    async fn delete(&self, key: &str) -> StoreResult<()> {
        StoreLayer::delete(self, key).await
    }

    async fn delete_if(&self, key: &str, if_match: &str) -> StoreResult<()> {
        StoreLayer::delete_if(self, key, if_match).await
    }

    async fn list(
        &self,
        prefix: &str,
        delimiter: Option<&str>,
        from: ListFrom,
        max_keys: usize,
        detail: ListDetail,
    ) -> StoreResult<ListPage> {
        StoreLayer::list(self, prefix, delimiter, from, max_keys, detail).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemoryStore;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    /// Changes one method; the rest reach the inner store.
    struct CountDeletes {
        inner: Arc<dyn ObjectStore>,
        deletes: AtomicUsize,
    }

    #[async_trait]
    impl StoreLayer for CountDeletes {
        type Inner = dyn ObjectStore;
        fn inner(&self) -> &Self::Inner {
            &*self.inner
        }
        async fn delete(&self, key: &str) -> StoreResult<()> {
            self.deletes.fetch_add(1, Ordering::Relaxed);
            self.inner.delete(key).await
        }
        async fn put_if(
            &self,
            key: &str,
            body: Bytes,
            meta: &UserMeta,
            if_match: Option<&str>,
            headers_from: Option<HeadersFrom<'_>>,
        ) -> StoreResult<String> {
            // A plain `put` must come through here too.
            self.deletes.fetch_add(100, Ordering::Relaxed);
            self.inner
                .put_if(key, body, meta, if_match, headers_from)
                .await
        }
    }

    #[tokio::test]
    async fn a_layer_changes_only_what_it_writes() {
        let mem = Arc::new(MemoryStore::new());
        let layer = CountDeletes {
            inner: mem.clone(),
            deletes: AtomicUsize::new(0),
        };
        let store: &dyn ObjectStore = &layer;
        store
            .put("k", Bytes::from_static(b"abc"), &UserMeta::new())
            .await
            .unwrap();
        assert_eq!(store.head("k").await.unwrap().size, 3);
        let mut buf = [0u8; 3];
        let n = store.get_range_into("k", 0..3, None, &mut buf).await;
        assert_eq!(n.unwrap(), 3);
        store.delete("k").await.unwrap();
        assert_eq!(layer.deletes.load(Ordering::Relaxed), 101);
        assert!(mem.head("k").await.is_err());
        assert_eq!(store.describe(), mem.describe());
    }
}
