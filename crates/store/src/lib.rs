//! Store layer: the object operations bucketfs needs, behind one trait.
//!
//! This crate owns talking to a bucket. It knows nothing about inodes or FUSE. Backends:
//! [`s3::S3Store`] (any S3-compatible service), [`local::LocalStore`] (a local directory used as a
//! bucket, the embedded default), [`memory::MemoryStore`] and [`fault::FaultStore`] (tests).

pub mod blank_keys;
pub mod crash;
pub mod error;
pub mod fault;
pub mod journal;
pub mod layer;
pub mod list_encoding;
pub mod list_meta;
pub mod listing;
pub mod liveness;
pub mod local;
pub mod memory;
pub mod metrics;
pub mod retry;
pub mod s3;
pub mod tls;
pub mod types;
pub mod upload;
pub mod wire;

pub use error::{StoreError, StoreResult};
pub use types::*;
pub use upload::{run_bounded, PartRequest, Upload, Uploads};

use async_trait::async_trait;
use bytes::Bytes;
use std::ops::Range;
use std::sync::Arc;

/// The `if_match` of [`ObjectStore::put_if`] and [`ObjectStore::complete_multipart`] that
/// asks for no object at all (S3 `If-None-Match: *`): [`StoreError::PreconditionFailed`]
/// when one exists. No ETag looks like it (ETags are quoted). Background uploads of files
/// created here use it, so another client's object made meanwhile is never replaced.
pub const IF_ABSENT: &str = "<absent>";

/// The object operations the file system needs. Keys are full object keys (no leading `/`).
#[async_trait]
pub trait ObjectStore: Send + Sync + 'static {
    /// A short name for logs and errors, such as `s3://bucket` or `/srv/data`.
    fn describe(&self) -> String;

    /// The sizes this store accepts (parts, copies, objects). Every backend here keeps S3's.
    fn limits(&self) -> StoreLimits {
        StoreLimits::S3
    }

    /// The crash journal the multipart uploads started through this store are recorded in
    /// (by [`Upload`], see [`journal`]), if any: a mount's store has one, the bench's none.
    fn upload_journal(&self) -> Option<Arc<journal::UploadJournal>> {
        None
    }

    /// HEAD: size, ETag, mtime and user metadata of one object.
    async fn head(&self, key: &str) -> StoreResult<ObjectMeta>;

    /// Ranged GET. The range may run past the end of the object; the result is then shorter.
    /// With `if_match`, fails with [`StoreError::PreconditionFailed`] when the ETag differs.
    async fn get_range(
        &self,
        key: &str,
        range: Range<u64>,
        if_match: Option<&str>,
    ) -> StoreResult<Bytes>;

    /// Ranged GET into the caller's memory: the body goes to the front of `dst` (which is
    /// `range`'s length) and the number of bytes written comes back, fewer when the object
    /// ends first. This lets the caller own, account and reuse the buffers a GET fills. The
    /// default copies from [`ObjectStore::get_range`]; stores that can write straight into
    /// `dst` do so.
    async fn get_range_into(
        &self,
        key: &str,
        range: Range<u64>,
        if_match: Option<&str>,
        dst: &mut [u8],
    ) -> StoreResult<usize> {
        let b = self.get_range(key, range, if_match).await?;
        let n = b.len().min(dst.len());
        dst[..n].copy_from_slice(&b[..n]);
        Ok(n)
    }

    /// PUT of a whole object with user metadata. Returns the new ETag.
    async fn put(&self, key: &str, body: Bytes, meta: &UserMeta) -> StoreResult<String> {
        self.put_if(key, body, meta, None, None).await
    }

    /// [`ObjectStore::put`] that, with `if_match`, replaces the object only while it still has
    /// that ETag (S3 `If-Match`): [`StoreError::PreconditionFailed`] when it has another,
    /// [`StoreError::NotFound`] when it is gone. This is how a file rewritten in part is
    /// published only over the version it was built from. With `headers_from`, the object
    /// takes that version's headers other than the user metadata (Content-Type,
    /// Cache-Control, ...): a file written again keeps them.
    async fn put_if(
        &self,
        key: &str,
        body: Bytes,
        meta: &UserMeta,
        if_match: Option<&str>,
        headers_from: Option<HeadersFrom<'_>>,
    ) -> StoreResult<String>;

    /// Starts a multipart upload whose object will carry `meta`, and with `headers_from`
    /// that version's other headers (Content-Type, Cache-Control, ...), as a
    /// [`ObjectStore::copy`] replacing the user metadata would: a copy made in parts keeps
    /// what a single copy keeps. Returns the upload id.
    async fn create_multipart(
        &self,
        key: &str,
        meta: &UserMeta,
        headers_from: Option<HeadersFrom<'_>>,
    ) -> StoreResult<String>;

    /// Uploads part `part_number` (1-based). Returns the part's ETag.
    async fn upload_part(
        &self,
        key: &str,
        upload_id: &str,
        part_number: u32,
        body: Bytes,
    ) -> StoreResult<String>;

    /// Uploads part `part_number` by copying `range` of `src_key` server-side. With
    /// `src_if_match`, only from the source version with that ETag (S3
    /// `x-amz-copy-source-if-match`): [`StoreError::PreconditionFailed`] otherwise, so a new
    /// version is never built from parts of two.
    async fn upload_part_copy(
        &self,
        key: &str,
        upload_id: &str,
        part_number: u32,
        src_key: &str,
        range: Range<u64>,
        src_if_match: Option<&str>,
    ) -> StoreResult<String>;

    /// Completes a multipart upload from its parts, in order. Returns the new ETag. With
    /// `if_match`, only while the object still has that ETag, as [`ObjectStore::put_if`];
    /// the upload then stays open (abort it).
    async fn complete_multipart(
        &self,
        key: &str,
        upload_id: &str,
        parts: &[CompletedPart],
        if_match: Option<&str>,
    ) -> StoreResult<String>;

    /// Aborts a multipart upload and frees its parts.
    async fn abort_multipart(&self, key: &str, upload_id: &str) -> StoreResult<()>;

    /// Multipart uploads in progress under `prefix`.
    async fn list_multipart_uploads(&self, prefix: &str) -> StoreResult<Vec<MultipartUpload>>;

    /// Server-side copy (objects up to 5 GiB). `meta: None` keeps the source's user metadata,
    /// `Some` replaces it (this is how chmod/utimens change an object in place). With
    /// `src_if_match`, only from the source version with that ETag
    /// (`x-amz-copy-source-if-match`); a copy onto itself then also asks the destination to
    /// still have it (`If-Match`, where the store honours it), so it never lands over a
    /// version another client wrote meanwhile. Returns the new object's ETag, as the copy's
    /// answer gives it: a HEAD after the copy could name a version another client wrote since.
    async fn copy(
        &self,
        src_key: &str,
        dst_key: &str,
        meta: Option<&UserMeta>,
        src_if_match: Option<&str>,
    ) -> StoreResult<String>;

    /// DELETE. Deleting a missing key succeeds, as in S3.
    async fn delete(&self, key: &str) -> StoreResult<()>;

    /// DELETE only while the object has ETag `if_match` (`If-Match`): `PreconditionFailed`
    /// when another version is there. A store that cannot check deletes whatever is there
    /// (this default; MinIO ignores the header too), so callers HEAD first where it matters.
    async fn delete_if(&self, key: &str, if_match: &str) -> StoreResult<()> {
        let _ = if_match;
        self.delete(key).await
    }

    /// One page of a LIST of keys starting with `prefix`, from `from`. With `delimiter`
    /// (always `/` here), keys below the next delimiter are rolled up into `common_prefixes`. With
    /// [`ListDetail::UserMeta`], entries carry their user metadata where the store can give it
    /// in a listing ([`ObjectMeta::user_complete`] says which do: they need no HEAD).
    async fn list(
        &self,
        prefix: &str,
        delimiter: Option<&str>,
        from: ListFrom,
        max_keys: usize,
        detail: ListDetail,
    ) -> StoreResult<ListPage>;
}

/// The sizes a store accepts: what a multipart upload, a copy and an object may be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreLimits {
    /// Smallest part a multipart upload accepts (except the last one).
    pub min_part: u64,
    /// Largest part.
    pub max_part: u64,
    /// Most parts one multipart upload may have.
    pub max_parts: u32,
    /// Largest object a single CopyObject may copy.
    pub max_copy_object: u64,
    /// Largest object.
    pub max_object: u64,
}

impl StoreLimits {
    /// Amazon S3's, which every S3-compatible store here accepts.
    pub const S3: StoreLimits = StoreLimits {
        min_part: 5 << 20,
        max_part: 5 << 30,
        max_parts: 10_000,
        max_copy_object: 5 << 30,
        max_object: 5 << 40,
    };
}
