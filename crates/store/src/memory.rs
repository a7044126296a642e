//! In-memory bucket for fast unit tests of the fs core.

use crate::listing::page_from_sorted;
use crate::*;
use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use md5::{Digest, Md5};
use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap};
use std::time::SystemTime;

#[derive(Clone)]
struct Object {
    data: Bytes,
    meta: UserMeta,
    etag: String,
    modified: SystemTime,
}

struct Upload {
    key: String,
    meta: UserMeta,
    parts: BTreeMap<u32, (String, Bytes)>,
    initiated: SystemTime,
}

#[derive(Default)]
struct Inner {
    objects: BTreeMap<String, Object>,
    uploads: HashMap<String, Upload>,
    next_upload: u64,
}

/// A bucket held in a `BTreeMap`, with S3's LIST, multipart and ETag behaviour.
#[derive(Default)]
pub struct MemoryStore {
    inner: Mutex<Inner>,
    /// LIST entries carry user metadata, like MinIO's `metadata=true` (off: like plain S3).
    list_metadata: bool,
}

fn etag_of(data: &[u8]) -> String {
    format!("\"{}\"", hex::encode(Md5::digest(data)))
}

impl MemoryStore {
    pub fn new() -> Self {
        Self::default()
    }

    /// A store whose LIST entries carry their user metadata, as MinIO's do when asked.
    pub fn with_list_metadata() -> Self {
        Self {
            list_metadata: true,
            ..Self::default()
        }
    }

    /// Number of multipart uploads not yet completed or aborted.
    pub fn pending_uploads(&self) -> usize {
        self.inner.lock().uploads.len()
    }

    /// All keys, for test assertions.
    pub fn keys(&self) -> Vec<String> {
        self.inner.lock().objects.keys().cloned().collect()
    }

    /// Stores `data` as `key` if it still has ETag `if_match` (checked under the same lock,
    /// as a store would do it atomically).
    fn insert(
        &self,
        key: &str,
        data: Bytes,
        meta: UserMeta,
        etag: Option<String>,
        if_match: Option<&str>,
    ) -> StoreResult<String> {
        let etag = etag.unwrap_or_else(|| etag_of(&data));
        let mut inner = self.inner.lock();
        check_etag(inner.objects.get(key), key, if_match)?;
        inner.objects.insert(
            key.to_string(),
            Object {
                data,
                meta,
                etag: etag.clone(),
                modified: SystemTime::now(),
            },
        );
        Ok(etag)
    }

    fn get(&self, key: &str) -> StoreResult<Object> {
        self.inner
            .lock()
            .objects
            .get(key)
            .cloned()
            .ok_or_else(|| StoreError::NotFound(key.to_string()))
    }
}

/// S3's `If-Match`: a missing object is not found, another ETag fails the precondition.
fn check_etag(o: Option<&Object>, key: &str, if_match: Option<&str>) -> StoreResult<()> {
    let Some(tag) = if_match else {
        return Ok(());
    };
    if tag == crate::IF_ABSENT {
        return match o {
            Some(_) => Err(StoreError::PreconditionFailed(key.to_string())),
            None => Ok(()),
        };
    }
    match o {
        None => Err(StoreError::NotFound(key.to_string())),
        Some(o) if o.etag != tag => Err(StoreError::PreconditionFailed(key.to_string())),
        Some(_) => Ok(()),
    }
}

#[async_trait]
impl ObjectStore for MemoryStore {
    fn describe(&self) -> String {
        "memory".into()
    }

    async fn head(&self, key: &str) -> StoreResult<ObjectMeta> {
        let o = self.get(key)?;
        Ok(ObjectMeta {
            key: key.to_string(),
            size: o.data.len() as u64,
            etag: Some(o.etag),
            last_modified: Some(o.modified),
            user: o.meta,
            user_complete: true,
        })
    }

    async fn get_range(
        &self,
        key: &str,
        range: Range<u64>,
        if_match: Option<&str>,
    ) -> StoreResult<Bytes> {
        let o = self.get(key)?;
        check_etag(Some(&o), key, if_match)?;
        let len = o.data.len() as u64;
        let start = range.start.min(len) as usize;
        let end = range.end.min(len) as usize;
        Ok(o.data.slice(start..end.max(start)))
    }

    async fn put_if(
        &self,
        key: &str,
        body: Bytes,
        meta: &UserMeta,
        if_match: Option<&str>,
        // Objects here have no headers but the user metadata.
        _headers_from: Option<HeadersFrom<'_>>,
    ) -> StoreResult<String> {
        self.insert(key, body, meta.clone(), None, if_match)
    }

    async fn create_multipart(
        &self,
        key: &str,
        meta: &UserMeta,
        // Objects here have no headers but the user metadata.
        _headers_from: Option<HeadersFrom<'_>>,
    ) -> StoreResult<String> {
        let mut inner = self.inner.lock();
        inner.next_upload += 1;
        let id = format!("upload-{}", inner.next_upload);
        inner.uploads.insert(
            id.clone(),
            Upload {
                key: key.to_string(),
                meta: meta.clone(),
                parts: BTreeMap::new(),
                initiated: SystemTime::now(),
            },
        );
        Ok(id)
    }

    async fn upload_part(
        &self,
        _key: &str,
        upload_id: &str,
        part_number: u32,
        body: Bytes,
    ) -> StoreResult<String> {
        let etag = etag_of(&body);
        let mut inner = self.inner.lock();
        let up = inner
            .uploads
            .get_mut(upload_id)
            .ok_or_else(|| StoreError::NotFound(format!("upload {upload_id}")))?;
        up.parts.insert(part_number, (etag.clone(), body));
        Ok(etag)
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
        let src = self.get(src_key)?;
        check_etag(Some(&src), src_key, src_if_match)?;
        if range.end > src.data.len() as u64 || range.start >= range.end {
            return Err(StoreError::Invalid(format!("bad copy range {range:?}")));
        }
        let body = src.data.slice(range.start as usize..range.end as usize);
        self.upload_part(key, upload_id, part_number, body).await
    }

    async fn complete_multipart(
        &self,
        key: &str,
        upload_id: &str,
        parts: &[CompletedPart],
        if_match: Option<&str>,
    ) -> StoreResult<String> {
        let up = {
            let mut inner = self.inner.lock();
            // As S3: a failed precondition leaves the upload open.
            check_etag(inner.objects.get(key), key, if_match)?;
            inner
                .uploads
                .remove(upload_id)
                .ok_or_else(|| StoreError::NotFound(format!("upload {upload_id}")))?
        };
        let mut buf = BytesMut::new();
        for (i, p) in parts.iter().enumerate() {
            let (etag, data) = up
                .parts
                .get(&p.part_number)
                .ok_or_else(|| StoreError::Invalid(format!("missing part {}", p.part_number)))?;
            if *etag != p.etag {
                return Err(StoreError::Invalid(format!("part {} etag", p.part_number)));
            }
            if i + 1 < parts.len() && (data.len() as u64) < self.limits().min_part {
                return Err(StoreError::Invalid(format!(
                    "part {} smaller than 5 MiB",
                    p.part_number
                )));
            }
            buf.extend_from_slice(data);
        }
        // S3's multipart ETag: md5 of the parts' md5s, then "-<number of parts>".
        let etag = crate::retry::multipart_etag(parts);
        self.insert(key, buf.freeze(), up.meta, etag, if_match)
    }

    async fn abort_multipart(&self, _key: &str, upload_id: &str) -> StoreResult<()> {
        self.inner.lock().uploads.remove(upload_id);
        Ok(())
    }

    async fn list_multipart_uploads(&self, prefix: &str) -> StoreResult<Vec<MultipartUpload>> {
        Ok(self
            .inner
            .lock()
            .uploads
            .iter()
            .filter(|(_, u)| u.key.starts_with(prefix))
            .map(|(id, u)| MultipartUpload {
                key: u.key.clone(),
                upload_id: id.clone(),
                initiated: Some(u.initiated),
            })
            .collect())
    }

    async fn copy(
        &self,
        src_key: &str,
        dst_key: &str,
        meta: Option<&UserMeta>,
        src_if_match: Option<&str>,
    ) -> StoreResult<String> {
        let src = self.get(src_key)?;
        check_etag(Some(&src), src_key, src_if_match)?;
        let meta = meta.cloned().unwrap_or(src.meta);
        let dst_if_match = src_if_match.filter(|_| src_key == dst_key);
        // A copy of a multipart object is a single-part object: its ETag is its MD5.
        self.insert(dst_key, src.data, meta, None, dst_if_match)
    }

    async fn delete(&self, key: &str) -> StoreResult<()> {
        self.inner.lock().objects.remove(key);
        Ok(())
    }

    async fn delete_if(&self, key: &str, if_match: &str) -> StoreResult<()> {
        let mut inner = self.inner.lock();
        match inner.objects.get(key) {
            Some(o) if o.etag != if_match => Err(StoreError::PreconditionFailed(key.to_string())),
            _ => {
                inner.objects.remove(key);
                Ok(())
            }
        }
    }

    async fn list(
        &self,
        prefix: &str,
        delimiter: Option<&str>,
        from: ListFrom,
        max_keys: usize,
        detail: ListDetail,
    ) -> StoreResult<ListPage> {
        let inner = self.inner.lock();
        let with_user = self.list_metadata && detail == ListDetail::UserMeta;
        let entries = inner
            .objects
            .range(prefix.to_string()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, o)| ObjectMeta {
                key: k.clone(),
                size: o.data.len() as u64,
                etag: Some(o.etag.clone()),
                last_modified: Some(o.modified),
                user: if with_user {
                    o.meta.clone()
                } else {
                    UserMeta::new()
                },
                user_complete: with_user,
            });
        Ok(page_from_sorted(
            entries,
            prefix,
            delimiter,
            from.after_key(),
            max_keys,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn conditions_are_honoured() {
        crate::local::tests::check_conditions(&MemoryStore::new()).await;
    }
}
