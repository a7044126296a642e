//! A blocking S3 client for looking at the bucket directly, as another client would.

use super::{env, unique_bucket_name};
use aws_sdk_s3::config::{
    BehaviorVersion, Credentials, Region, RequestChecksumCalculation, ResponseChecksumValidation,
};
use aws_sdk_s3::primitives::ByteStream;
use aws_sdk_s3::Client;
use bucketfs_store::blank_keys::{sdk_key, BlankKeys};
use std::collections::{BTreeSet, HashMap};
use std::sync::OnceLock;

/// Blocking wrapper around an `aws-sdk-s3` client configured for the test MinIO.
pub struct S3 {
    pub(crate) rt: tokio::runtime::Runtime,
    pub client: Client,
}

/// What HEAD says about an object.
#[derive(Debug, Clone)]
pub struct Head {
    pub size: u64,
    /// User metadata, keys without the `x-amz-meta-` prefix.
    pub meta: HashMap<String, String>,
    /// With its quotes.
    pub etag: String,
}

pub fn s3() -> &'static S3 {
    static S3C: OnceLock<S3> = OnceLock::new();
    S3C.get_or_init(|| {
        let e = env();
        let conf = aws_sdk_s3::config::Builder::new()
            .behavior_version(BehaviorVersion::latest())
            .endpoint_url(&e.endpoint)
            .region(Region::new("us-east-1"))
            .credentials_provider(Credentials::new(
                &e.access_key,
                &e.secret_key,
                None,
                None,
                "bucketfs-tests",
            ))
            .force_path_style(true)
            .request_checksum_calculation(RequestChecksumCalculation::WhenRequired)
            .response_checksum_validation(ResponseChecksumValidation::WhenRequired)
            .interceptor(BlankKeys)
            .build();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("tokio runtime");
        S3 {
            rt,
            client: Client::from_conf(conf),
        }
    })
}

impl S3 {
    pub fn block_on<F: std::future::Future>(&self, f: F) -> F::Output {
        self.rt.block_on(f)
    }

    pub fn create_bucket(&self, bucket: &str) {
        self.block_on(self.client.create_bucket().bucket(bucket).send())
            .unwrap_or_else(|e| panic!("CreateBucket {bucket}: {}", err_text(&e)));
    }

    /// A fresh, empty bucket for one test.
    pub fn new_bucket(&self, tag: &str) -> String {
        let b = unique_bucket_name(tag);
        self.create_bucket(&b);
        b
    }

    pub fn put(&self, bucket: &str, key: &str, body: impl Into<Vec<u8>>) {
        self.put_with_meta(bucket, key, body, &[]);
    }

    pub fn put_with_meta(
        &self,
        bucket: &str,
        key: &str,
        body: impl Into<Vec<u8>>,
        meta: &[(&str, &str)],
    ) {
        let mut req = self
            .client
            .put_object()
            .bucket(bucket)
            .key(sdk_key(key))
            .body(ByteStream::from(body.into()));
        for (k, v) in meta {
            req = req.metadata(*k, *v);
        }
        self.block_on(req.send())
            .unwrap_or_else(|e| panic!("PutObject {bucket}/{key}: {}", err_text(&e)));
    }

    /// PUTs many small objects with at most `concurrency` requests in flight.
    pub fn put_many(&self, bucket: &str, objects: Vec<(String, Vec<u8>)>, concurrency: usize) {
        use futures::stream::{self, StreamExt, TryStreamExt};
        let client = &self.client;
        self.block_on(
            stream::iter(objects.into_iter().map(|(key, body)| async move {
                client
                    .put_object()
                    .bucket(bucket)
                    .key(sdk_key(&key))
                    .body(ByteStream::from(body))
                    .send()
                    .await
                    .map_err(|e| format!("PutObject {bucket}/{key}: {}", err_text(&e)))
            }))
            .buffer_unordered(concurrency)
            .try_collect::<Vec<_>>(),
        )
        .unwrap_or_else(|e| panic!("{e}"));
    }

    /// The object's bytes, or `None` when the key does not exist.
    /// DeleteObject, as another client would.
    pub fn delete(&self, bucket: &str, key: &str) {
        self.block_on(
            self.client
                .delete_object()
                .bucket(bucket)
                .key(sdk_key(key))
                .send(),
        )
        .unwrap_or_else(|e| panic!("DeleteObject {bucket}/{key}: {e:?}"));
    }

    pub fn get(&self, bucket: &str, key: &str) -> Option<Vec<u8>> {
        let res = self.block_on(async {
            let out = self
                .client
                .get_object()
                .bucket(bucket)
                .key(sdk_key(key))
                .send()
                .await?;
            Ok::<_, aws_sdk_s3::Error>(Some(out.body.collect().await.unwrap().into_bytes()))
        });
        match res {
            Ok(b) => b.map(|b| b.to_vec()),
            Err(aws_sdk_s3::Error::NoSuchKey(_)) => None,
            Err(e) => panic!("GetObject {bucket}/{key}: {e:?}"),
        }
    }

    /// HEAD of a key, or `None` when it does not exist.
    pub fn head(&self, bucket: &str, key: &str) -> Option<Head> {
        match self.block_on(
            self.client
                .head_object()
                .bucket(bucket)
                .key(sdk_key(key))
                .send(),
        ) {
            Ok(out) => Some(Head {
                size: out.content_length().unwrap_or(-1) as u64,
                meta: out.metadata().cloned().unwrap_or_default(),
                etag: out.e_tag().unwrap_or_default().to_string(),
            }),
            Err(e) if e.as_service_error().is_some_and(|s| s.is_not_found()) => None,
            Err(e) => panic!("HeadObject {bucket}/{key}: {}", err_text(&e)),
        }
    }

    /// Every key under `prefix` (all pages, no delimiter).
    pub fn list_keys(&self, bucket: &str, prefix: &str) -> BTreeSet<String> {
        let mut keys = BTreeSet::new();
        let mut token: Option<String> = None;
        loop {
            let out = self
                .block_on(
                    self.client
                        .list_objects_v2()
                        .bucket(bucket)
                        .prefix(prefix)
                        .set_continuation_token(token.take())
                        .send(),
                )
                .unwrap_or_else(|e| panic!("ListObjectsV2 {bucket}/{prefix}: {}", err_text(&e)));
            for o in out.contents() {
                keys.insert(o.key().unwrap_or_default().to_string());
            }
            match out.next_continuation_token() {
                Some(t) if out.is_truncated() == Some(true) => token = Some(t.to_string()),
                _ => break,
            }
        }
        keys
    }

    /// Deletes every object and open upload in `bucket`, then the bucket: tests that store
    /// gigabytes call it when they pass, so the suite's peak disk use stays that of one test.
    pub fn remove_bucket(&self, bucket: &str) {
        let c = &self.client;
        for key in self.list_keys(bucket, "") {
            self.block_on(c.delete_object().bucket(bucket).key(sdk_key(&key)).send())
                .unwrap_or_else(|e| panic!("DeleteObject {bucket}/{key}: {}", err_text(&e)));
        }
        for (key, id) in self.list_multipart_uploads(bucket) {
            let abort = c
                .abort_multipart_upload()
                .bucket(bucket)
                .key(sdk_key(&key))
                .upload_id(id);
            self.block_on(abort.send()).unwrap_or_else(|e| {
                panic!("AbortMultipartUpload {bucket}/{key}: {}", err_text(&e))
            });
        }
        self.block_on(c.delete_bucket().bucket(bucket).send())
            .unwrap_or_else(|e| panic!("DeleteBucket {bucket}: {}", err_text(&e)));
    }

    /// `(key, upload id)` of every multipart upload in progress in the bucket.
    pub fn list_multipart_uploads(&self, bucket: &str) -> Vec<(String, String)> {
        let out = self
            .block_on(self.client.list_multipart_uploads().bucket(bucket).send())
            .unwrap_or_else(|e| panic!("ListMultipartUploads {bucket}: {}", err_text(&e)));
        out.uploads()
            .iter()
            .map(|u| {
                (
                    u.key().unwrap_or_default().to_string(),
                    u.upload_id().unwrap_or_default().to_string(),
                )
            })
            .collect()
    }
}

/// The full error chain of an SDK error (its `Display` alone says little).
pub fn err_text<E: std::error::Error>(e: &E) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}

/// Starts a multipart upload directly through S3 (as another client, or a dead daemon, would).
pub fn create_upload(bucket: &str, key: &str) -> String {
    let s3 = s3();
    s3.block_on(
        s3.client
            .create_multipart_upload()
            .bucket(bucket)
            .key(sdk_key(key))
            .send(),
    )
    .unwrap()
    .upload_id()
    .unwrap()
    .to_string()
}
