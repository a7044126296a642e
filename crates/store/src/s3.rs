//! The S3 backend on `aws-sdk-s3`: Amazon S3, Alibaba OSS, MinIO, Ceph RGW and any other
//! S3-compatible store.

use crate::blank_keys::sdk_key;
use crate::list_encoding::{decode, SanitizeListing};
use crate::list_meta::{ListCapture, ListMetadata};
use crate::*;
use async_trait::async_trait;
use aws_sdk_s3::config::{Credentials, Region};
use aws_sdk_s3::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_sdk_s3::primitives::ByteStream;
use aws_sdk_s3::types::{CompletedMultipartUpload, EncodingType, MetadataDirective};
use aws_sdk_s3::Client;
use aws_smithy_types::date_time::DateTime as SmithyTime;
use bytes::Bytes;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tokio::sync::{Semaphore, SemaphorePermit};

/// How to reach and authenticate to an S3-compatible service.
#[derive(Debug, Clone, Default)]
pub struct S3Config {
    pub bucket: String,
    /// e.g. `http://127.0.0.1:9000` or `https://oss-cn-hangzhou.aliyuncs.com`; `None` = AWS.
    pub endpoint_url: Option<String>,
    pub region: Option<String>,
    /// Path-style addressing (MinIO, Ceph); off = virtual-hosted (AWS, OSS).
    pub force_path_style: bool,
    /// A named profile from `~/.aws/config` and `~/.aws/credentials`.
    pub profile: Option<String>,
    /// Static credentials (from the config file); otherwise the SDK's default chain.
    pub access_key_id: Option<String>,
    pub secret_access_key: Option<String>,
    pub session_token: Option<String>,
    /// Attempts per request inside the SDK, including the first. bucketfs retries in
    /// [`crate::retry::RetryStore`] instead, so the CLI sets 1 here.
    pub max_attempts: u32,
    /// Which server certificates to accept over HTTPS.
    pub tls: crate::tls::TlsTrust,
    /// Send upload bodies as `UNSIGNED-PAYLOAD` instead of signing their SHA-256 (which costs
    /// about a quarter of the CPU of an upload). `None`: unsigned over HTTPS, whose TLS
    /// already protects the body, signed over plain HTTP.
    pub unsigned_payload: Option<bool>,
    /// Whether LISTs ask for user metadata (MinIO's `metadata=true`), so that listed entries
    /// need no HEAD. `Auto`: only once the server has said it is MinIO.
    pub list_metadata: ListMetadata,
    /// Most requests moving data in flight at once, and so most connections open (each
    /// request holds one until its answer is read); see [`RequestSlots`] for the spare slots
    /// of metadata requests. 0 means [`DEFAULT_MAX_CONNECTIONS`].
    pub max_connections: usize,
    /// Give each object this client writes a Content-Type guessed from its name's extension
    /// (`index.html`: `text/html`), as s3fs, rclone and gcsfuse do; off: none (the store's
    /// default, `binary/octet-stream` on S3).
    pub guess_content_type: bool,
}

/// Requests in flight when the configuration does not say: enough for 16 part uploads and
/// many readers' prefetch at once, few enough that a burst of small operations (a thousand
/// closes, deletes or lookups) queues here instead of opening a connection each.
pub const DEFAULT_MAX_CONNECTIONS: usize = 128;

/// LIST requests for more than one key in flight at once. The server reads each entry's
/// metadata for a page (from a cold disk after a restart), and all pages in flight share its
/// disk: 100 pages of 1,000 entries sent at once (128 readers entering 100 cold directories)
/// all ended together after more than 30 s with no answer to any request, which the retry
/// layer took for a dead store and failed 6,805 reads with `EIO`. A few at a time end one by
/// one, every answer counts as progress, and a one-key LIST (a lookup's probe) never waits.
const PAGE_LISTS_IN_FLIGHT: usize = 8;

/// Time allowed for one attempt of a request without a large body (HEAD, LIST, DELETE,
/// copies, completing an upload), and the base of every other attempt's time.
pub const ATTEMPT_BASE: Duration = Duration::from_secs(30);
/// The slowest transfer rate an attempt with a body is allowed before it counts as hung
/// (it is then retried): 8 MiB parts get 30 s + 8 s, 1 GiB parts 30 s + 17 min.
pub const MIN_RATE: u64 = 1024 * 1024;
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long one attempt that moves `bytes` of body may take.
pub fn attempt_timeout(bytes: u64) -> Duration {
    ATTEMPT_BASE + Duration::from_secs_f64(bytes as f64 / MIN_RATE as f64)
}

/// No read timeout: the SDK's runs from the request's start to the answer's head, which S3
/// sends once it has the whole body (or the copy is done), so it would cut every upload and
/// copy at its length however fast bytes move; the attempt limit and the stall bound of
/// [`crate::retry`] bound those instead.
fn timeouts(attempt: Duration) -> aws_sdk_s3::config::timeout::TimeoutConfig {
    aws_sdk_s3::config::timeout::TimeoutConfig::builder()
        .connect_timeout(CONNECT_TIMEOUT)
        .disable_read_timeout()
        .operation_attempt_timeout(attempt)
        .build()
}

/// A config override that gives one request an attempt timeout for `bytes` of body.
fn sized(bytes: u64) -> aws_sdk_s3::config::Builder {
    aws_sdk_s3::config::Builder::default().timeout_config(timeouts(attempt_timeout(bytes)))
}

pub struct S3Store {
    client: Client,
    bucket: String,
    unsigned_payload: bool,
    list_metadata: ListMetadata,
    /// What the answers said about the server: [`SERVER_UNKNOWN`], [`SERVER_MINIO`] or
    /// [`SERVER_OTHER`] (only looked at with `ListMetadata::Auto`).
    server: AtomicU8,
    /// One permit per request in flight ([`S3Config::max_connections`], plus spares).
    slots: Arc<RequestSlots>,
    /// One permit per LIST of more than one key in flight ([`PAGE_LISTS_IN_FLIGHT`]).
    page_lists: Semaphore,
    /// Set once the store refused `If-Match` on a DELETE (`501`/`400`): later deletes go
    /// plain, as on stores that ignore it (callers HEAD first).
    no_conditional_delete: AtomicBool,
    /// Set once the store refused `If-None-Match: *` on a PUT or CompleteMultipartUpload
    /// (`501 NotImplemented`): later writes of new objects HEAD the key first and go plain.
    no_conditional_create: AtomicBool,
    /// The endpoint requests go to, however it was given (`endpoint_url`, or the SDK's
    /// `AWS_ENDPOINT_URL` or a profile's `endpoint_url`); `None`: AWS's own.
    endpoint: Option<String>,
    /// See [`S3Config::guess_content_type`].
    guess_content_type: bool,
    /// The versions this client's PUTs, uploads and copies made, with every header it gave
    /// them: a rewrite or a copy replacing their metadata has none to read first.
    own: parking_lot::Mutex<OwnVersions>,
    /// A version's headers could not be read (see [`S3Store::headers_to_keep`]) and that
    /// was logged.
    warned_headers: AtomicBool,
    /// A version's tags could not be read, or a write carrying tags was refused, and that
    /// was logged.
    warned_tags: AtomicBool,
    /// The store refused a write carrying tags (`403`: no `s3:PutObjectTagging`) and took
    /// it without: later writes neither read nor send tags.
    no_tag_writes: AtomicBool,
    /// Multipart uploads under way, with the headers they were given: what they make is one
    /// of [`S3Store::own`]'s.
    own_uploads: parking_lot::Mutex<HashMap<String, Own>>,
    /// Where the continuation tokens this store was given lead from.
    list_progress: parking_lot::Mutex<ListProgress>,
    /// Where the requests sent within a call are counted (see
    /// [`S3Store::count_inner_requests_in`]).
    inner_requests: std::sync::OnceLock<Arc<crate::metrics::StoreMetrics>>,
}

/// The last `N` entries put, by key: a map that forgets its oldest insertions first.
struct Recent<K, V, const N: usize> {
    map: HashMap<K, V>,
    order: std::collections::VecDeque<K>,
}

impl<K, V, const N: usize> Default for Recent<K, V, N> {
    fn default() -> Self {
        Self {
            map: HashMap::new(),
            order: Default::default(),
        }
    }
}

impl<K: std::hash::Hash + Eq + Clone, V, const N: usize> Recent<K, V, N> {
    fn put(&mut self, k: K, v: V) {
        if self.map.insert(k.clone(), v).is_none() {
            self.order.push_back(k);
            while self.order.len() > N {
                if let Some(old) = self.order.pop_front() {
                    self.map.remove(&old);
                }
            }
        }
    }

    fn get(&self, k: &K) -> Option<&V> {
        self.map.get(k)
    }

    fn remove(&mut self, k: &K) {
        if self.map.remove(k).is_some() {
            self.order.retain(|o| o != k);
        }
    }
}

/// Where each of the last 4,096 continuation tokens of LIST answers (with their prefix)
/// leads from: the greatest entry listed before it, and how many pages in a row added none
/// past it. A store (or a gateway before it) whose token leads back to entries already
/// listed, or on to pages of nothing for ever, would loop a listing (a `readdir` that never
/// returns, a DeleteVolume that never ends): such a page is an error instead. One token
/// per listing in flight is all a check needs.
type ListProgress = Recent<(String, String), Progress, 4096>;

#[derive(Clone)]
struct Progress {
    last: String,
    idle_pages: u32,
}

/// Pages in a row that may add no entry (S3 may cut a page short before any, as over many
/// delete markers of a versioned bucket).
const MAX_IDLE_PAGES: u32 = 10_000;

/// Checks that `page`, asked for after `before` (the progress its token was given at), goes
/// on past what was listed, and returns the progress its own token leads from.
fn list_progress(prefix: &str, before: Option<Progress>, page: &ListPage) -> StoreResult<Progress> {
    let keys = page.objects.iter().map(|o| o.key.as_str());
    let entries = || {
        keys.clone()
            .chain(page.common_prefixes.iter().map(String::as_str))
    };
    let (first, last) = (entries().min(), entries().max());
    match (before, last) {
        (Some(b), _) if first.is_some_and(|f| f < b.last.as_str()) => {
            Err(StoreError::Other(format!(
                "list {prefix:?}: the store went back to {:?} after {:?} (a continuation token \
                 that does not go on)",
                first.unwrap_or_default(),
                b.last
            )))
        }
        (Some(b), l) if l.is_none_or(|l| l <= b.last.as_str()) => {
            if b.idle_pages >= MAX_IDLE_PAGES {
                return Err(StoreError::Other(format!(
                    "list {prefix:?}: {} pages in a row without a new entry",
                    b.idle_pages + 1
                )));
            }
            Ok(Progress {
                idle_pages: b.idle_pages + 1,
                ..b
            })
        }
        (_, l) => Ok(Progress {
            last: l.unwrap_or_default().to_string(),
            idle_pages: u32::from(l.is_none()),
        }),
    }
}

/// Gives request `$req` (a PutObject, CreateMultipartUpload or CopyObject) the headers
/// `$h` (a [`KeptHeaders`]).
macro_rules! with_headers {
    ($req:expr, $h:expr) => {{
        let h: &KeptHeaders = $h;
        $req.set_content_type(h.content_type.clone())
            .set_content_encoding(h.content_encoding.clone())
            .set_content_language(h.content_language.clone())
            .set_content_disposition(h.content_disposition.clone())
            .set_cache_control(h.cache_control.clone())
            .set_website_redirect_location(h.website_redirect_location.clone())
            .set_storage_class(h.storage_class.clone())
            .set_server_side_encryption(h.server_side_encryption.clone())
            .set_ssekms_key_id(h.ssekms_key_id.clone())
            .set_bucket_key_enabled(h.bucket_key_enabled)
    }};
}

/// A lower CopyObject limit, in builds with debug assertions (the tests') when
/// `BUCKETFS_TEST_MAX_COPY_OBJECT` says so: copies in parts without 5 GiB objects.
fn test_max_copy_object() -> Option<u64> {
    static MAX: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    *MAX.get_or_init(|| {
        cfg!(debug_assertions)
            .then(|| {
                std::env::var("BUCKETFS_TEST_MAX_COPY_OBJECT")
                    .ok()?
                    .parse()
                    .ok()
            })
            .flatten()
    })
}

/// The last 4,096 (key, ETag) pairs this client stored, each with what it gave the version
/// besides the bytes.
#[derive(Default)]
struct OwnVersions(Recent<String, (String, Own), 4096>);

/// What this client gave a version it stored: its whole user metadata and its other
/// headers.
#[derive(Clone)]
struct Own {
    headers: KeptHeaders,
    meta: UserMeta,
    /// When: for [`OWN_KNOWN_FOR`] this client trusts what it gave.
    at: std::time::Instant,
}

impl Own {
    fn new(headers: KeptHeaders, meta: UserMeta) -> Self {
        Self {
            headers,
            meta,
            at: std::time::Instant::now(),
        }
    }
}

/// How long after this client stored a version it takes the headers it gave for the ones
/// the version has, and a rename of it gives it the new name's guessed Content-Type (a file
/// written under a temporary name and renamed, as rsync and editors do). Later, another
/// client may have changed them in place, keeping the ETag: they are read with a HEAD.
const OWN_KNOWN_FOR: Duration = Duration::from_secs(60);

impl OwnVersions {
    fn made(&mut self, key: &str, etag: &str, own: Own) {
        self.0.put(key.to_string(), (etag.to_string(), own));
    }

    /// What version `etag` of `key` was given, if it is one of these stored less than
    /// [`OWN_KNOWN_FOR`] ago.
    fn get(&self, key: &str, etag: &str) -> Option<Own> {
        self.0
            .get(&key.to_string())
            .filter(|(e, o)| e == etag && o.at.elapsed() < OWN_KNOWN_FOR)
            .map(|(_, o)| o.clone())
    }

    /// `key` holds a version another client's headers may be on (a copy of one), or none.
    fn forget(&mut self, key: &str) {
        self.0.remove(&key.to_string());
    }
}

/// The headers other than the user metadata that a version has and that a new version
/// replacing it, or a copy of it replacing its user metadata, gives again (S3 keeps none of
/// them then): Content-Type, Content-Encoding, Content-Language, Content-Disposition,
/// Cache-Control, the website redirect, the storage class and the KMS encryption; and for
/// new bytes, its tags.
#[derive(Clone, Debug, Default, PartialEq)]
struct KeptHeaders {
    content_type: Option<String>,
    /// The Content-Type is the one guessed from the name (see [`S3Store::content_type_of`]),
    /// not one another client gave: at a new name, that name's is.
    type_guessed: bool,
    content_encoding: Option<String>,
    content_language: Option<String>,
    content_disposition: Option<String>,
    cache_control: Option<String>,
    website_redirect_location: Option<String>,
    storage_class: Option<aws_sdk_s3::types::StorageClass>,
    server_side_encryption: Option<aws_sdk_s3::types::ServerSideEncryption>,
    ssekms_key_id: Option<String>,
    bucket_key_enabled: Option<bool>,
    /// Its tags as a write gives them (`x-amz-tagging`: `k=v&k2=v2`, URL-encoded), or none.
    /// A copy keeps the source's by itself (S3's default tagging directive), so it sends
    /// none; a PUT or a multipart upload of new bytes has none unless it sends them.
    tagging: Option<String>,
    /// The version has tags that [`Self::tagging`] does not hold: a HEAD counted them and
    /// they were not read (a copy needs none read), or the version is a copy of such.
    tags_unread: bool,
}

impl KeptHeaders {
    /// A new object's: a Content-Type guessed from its name, or none (the store's default).
    fn guessed(content_type: Option<String>) -> Self {
        Self {
            content_type,
            type_guessed: true,
            ..Self::default()
        }
    }

    /// Those a HEAD of a version says.
    fn of(h: &aws_sdk_s3::operation::head_object::HeadObjectOutput) -> Self {
        use aws_sdk_s3::types::StorageClass;
        Self {
            content_type: h.content_type().map(str::to_string),
            type_guessed: false,
            content_encoding: h.content_encoding().map(str::to_string),
            content_language: h.content_language().map(str::to_string),
            content_disposition: h.content_disposition().map(str::to_string),
            cache_control: h.cache_control().map(str::to_string),
            website_redirect_location: h.website_redirect_location().map(str::to_string),
            // Not a class this client does not know: MinIO names a remote tier there, which
            // a write refuses.
            storage_class: h
                .storage_class()
                .filter(|c| StorageClass::values().contains(&c.as_str()))
                .cloned(),
            server_side_encryption: h.server_side_encryption().cloned(),
            ssekms_key_id: h.ssekms_key_id().map(str::to_string),
            bucket_key_enabled: h.bucket_key_enabled(),
            tagging: None,
            tags_unread: h.tag_count().is_some_and(|n| n > 0),
        }
    }

    /// Those a new version of the bytes takes: not an archive class (a file in Glacier
    /// written again would be unreadable the moment it is stored; its lifecycle rule moves
    /// it again).
    fn for_new_bytes(mut self) -> Self {
        use aws_sdk_s3::types::StorageClass;
        if matches!(
            self.storage_class,
            Some(StorageClass::Glacier | StorageClass::DeepArchive)
        ) {
            self.storage_class = None;
        }
        self
    }
}

/// The bound on S3 requests in flight (`--max-connections`), and how busy it is: gauges for
/// tuning it. Requests that move data or may take long (GET, PUT, parts, copies, completing
/// a multipart upload, listing uploads) take one of `max` slots; metadata requests (HEAD,
/// LIST, DELETE, starting or aborting a multipart upload) take one of `max / 8` spare slots
/// first, else one of the `max`. LIST pages hold at most [`PAGE_LISTS_IN_FLIGHT`] spares, so
/// at the default 128 at least 8 stay for lookups: a lookup or a listing does not wait
/// behind transfers that fill every slot on a slow link.
#[derive(Debug)]
pub struct RequestSlots {
    sem: Semaphore,
    /// Slots only metadata requests take.
    spare: Semaphore,
    max: usize,
    waiting: AtomicUsize,
}

/// Requests in flight at most, and connections kept, for `--max-connections max`: the
/// spare slots of [`RequestSlots`] included.
pub const fn most_connections(max: usize) -> usize {
    max + max / 8
}

/// What a request is, for the slot it may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotKind {
    /// It moves data or may take long: one of the `max` slots.
    Data,
    /// Metadata: a spare slot first.
    Metadata,
}

impl RequestSlots {
    fn new(max: usize) -> Self {
        Self {
            sem: Semaphore::new(max),
            spare: Semaphore::new(most_connections(max) - max),
            max,
            waiting: AtomicUsize::new(0),
        }
    }

    /// Connections the requests may hold at once.
    fn most(&self) -> usize {
        most_connections(self.max)
    }

    /// Requests holding a slot (sent, or having their answer read).
    pub fn in_use(&self) -> usize {
        self.most() - self.sem.available_permits() - self.spare.available_permits()
    }

    /// Requests waiting for a slot.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    async fn acquire(&self, kind: SlotKind) -> SemaphorePermit<'_> {
        let metadata = kind == SlotKind::Metadata;
        // A spare first: the `max` stay for transfers.
        if let (true, Ok(p)) = (metadata, self.spare.try_acquire()) {
            return p;
        }
        if let Ok(p) = self.sem.try_acquire() {
            return p;
        }
        /// Counts a waiter out however its wait ends (a dropped request future included).
        struct Waiter<'a>(&'a AtomicUsize);
        impl Drop for Waiter<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::Relaxed);
            }
        }
        self.waiting.fetch_add(1, Ordering::Relaxed);
        let _waiter = Waiter(&self.waiting);
        // A dropped acquire gives back a permit it was handed: the one not taken is not lost.
        let permit = match metadata {
            true => tokio::select! {
                p = self.sem.acquire() => p,
                p = self.spare.acquire() => p,
            },
            false => self.sem.acquire().await,
        };
        permit.expect("the request semaphores are never closed")
    }
}

const SERVER_UNKNOWN: u8 = 0;
const SERVER_MINIO: u8 = 1;
const SERVER_OTHER: u8 = 2;

fn system_time(t: Option<&SmithyTime>) -> Option<SystemTime> {
    t.and_then(|t| SystemTime::try_from(*t).ok())
}

/// Removes the quotes some callers leave on ETags, then adds them back consistently.
fn norm_etag(e: Option<&str>) -> Option<String> {
    e.map(|s| format!("\"{}\"", s.trim_matches('"')))
}

/// Maps an SDK error to a [`StoreError`] that says what happened to `what`.
fn map_err<E>(what: &str, e: SdkError<E, aws_smithy_runtime_api::http::Response>) -> StoreError
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
{
    match &e {
        SdkError::ServiceError(se) => {
            let status = se.raw().status().as_u16();
            let code = se.err().code().unwrap_or("");
            let msg = se.err().message().unwrap_or("");
            let req = se
                .raw()
                .headers()
                .get("x-amz-request-id")
                .unwrap_or("-")
                .to_string();
            let detail = format!("{what}: {status} {code} {msg} (request id {req})");
            match code {
                "NoSuchKey" | "NotFound" | "NoSuchUpload" => StoreError::NotFound(detail),
                "NoSuchBucket" => StoreError::NoSuchBucket(detail),
                "PreconditionFailed" => StoreError::PreconditionFailed(detail),
                "InvalidAccessKeyId"
                | "SignatureDoesNotMatch"
                | "AccessDenied"
                | "InvalidToken"
                | "ExpiredToken" => StoreError::AccessDenied(detail),
                "XMinioStorageFull" | "QuotaExceeded" | "InsufficientStorage" => {
                    StoreError::NoSpace(detail)
                }
                // A conditional write racing another one (AWS says to retry it), or an
                // operation on the key aborted by a concurrent one.
                "SlowDown"
                | "RequestTimeout"
                | "InternalError"
                | "ServiceUnavailable"
                | "XMinioServerNotInitialized"
                | "ConditionalRequestConflict"
                | "OperationAborted" => StoreError::Transient(detail),
                // A feature (a conditional header) the store does not have: no retry makes
                // it; the callers that can do without it look for this answer first.
                "NotImplemented" => StoreError::Other(detail),
                _ => match status {
                    501 => StoreError::Other(detail),
                    404 => StoreError::NotFound(detail),
                    412 => StoreError::PreconditionFailed(detail),
                    401 | 403 => StoreError::AccessDenied(detail),
                    507 => StoreError::NoSpace(detail),
                    408 | 429 | 500..=599 => StoreError::Transient(detail),
                    400 => StoreError::Invalid(detail),
                    _ => StoreError::Other(detail),
                },
            }
        }
        _ => classify_failure(what, &e, &DisplayErrorContext(&e).to_string()),
    }
}

/// Classifies an error that is not an answer of the service: TLS and credential problems are
/// permanent (retrying cannot fix them), connection failures and timeouts are transient, also
/// during a TLS handshake (a load balancer with no backend closes it) or a credential
/// provider's refresh (STS throttled or unreachable).
fn classify_failure<E, R>(what: &str, e: &SdkError<E, R>, text: &str) -> StoreError {
    let lower = text.to_ascii_lowercase();
    // What the connection did, not what the peer or its certificate is.
    let cut = [
        "handshake eof",
        "unexpected eof",
        "connection reset",
        "connection refused",
        "connection closed",
        "broken pipe",
        "timed out",
        "timeout",
        "throttl",
        "slowdown",
        "service unavailable",
        "internal error",
    ]
    .iter()
    .any(|w| lower.contains(w));
    if !cut
        && (lower.contains("certificate")
            || lower.contains("unknownissuer")
            || lower.contains("invalid peer")
            || lower.contains("handshake")
            || lower.contains("wrong version number")
            || lower.contains("invalidcontenttype"))
    {
        // What a plain-HTTP server answers to a TLS hello is no certificate matter.
        let why = match lower.contains("invalidcontenttype") || lower.contains("wrong version") {
            true => "is it an http:// endpoint?",
            false => "certificate not trusted? see --ca-bundle",
        };
        return StoreError::Other(format!("{what}: TLS failure ({why}): {text}"));
    }
    if lower.contains("credential") && !cut {
        return StoreError::AccessDenied(format!("{what}: no usable credentials: {text}"));
    }
    match e {
        SdkError::ConstructionFailure(_) => StoreError::Other(format!("{what}: {text}")),
        SdkError::DispatchFailure(d) if d.is_user() => StoreError::Other(format!("{what}: {text}")),
        _ => StoreError::Transient(format!("{what}: {text}")),
    }
}

/// Whether error `e` is the store refusing a conditional header it does not implement
/// (`501 NotImplemented`; with `or_400`, any `400` too). Never transient: retrying would
/// fail every such request after the retry budget. The first time, `flag` is set (the
/// caller stops sending the header) and `message` (given the status and code) logged.
fn refused_condition<E: ProvideErrorMetadata>(
    e: &SdkError<E, aws_smithy_runtime_api::http::Response>,
    or_400: bool,
    flag: &AtomicBool,
    message: impl FnOnce(&str) -> String,
) -> bool {
    let SdkError::ServiceError(se) = e else {
        return false;
    };
    let status = se.raw().status().as_u16();
    let code = se.err().code();
    // A 400 for the header itself; an expired token or a request timeout is a 400 too, and
    // says nothing of it.
    let of_header = matches!(code, None | Some("InvalidArgument" | "InvalidRequest"));
    let refused =
        status == 501 || (or_400 && status == 400 && of_header) || code == Some("NotImplemented");
    if refused && !flag.swap(true, Ordering::Relaxed) {
        let why = format!("{status} {}", se.err().code().unwrap_or(""));
        tracing::warn!("{}", message(&why));
    }
    refused
}

/// A tag set as `x-amz-tagging` gives it: `k=v&k2=v2`, each key and value URL-encoded;
/// `None` for an empty one.
fn encode_tagging(tags: &[aws_sdk_s3::types::Tag]) -> Option<String> {
    use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
    // Everything but RFC 3986's unreserved characters.
    const ENCODED: &AsciiSet = &NON_ALPHANUMERIC
        .remove(b'-')
        .remove(b'_')
        .remove(b'.')
        .remove(b'~');
    let pairs: Vec<String> = tags
        .iter()
        .map(|t| {
            format!(
                "{}={}",
                utf8_percent_encode(t.key(), ENCODED),
                utf8_percent_encode(t.value(), ENCODED)
            )
        })
        .collect();
    (!pairs.is_empty()).then(|| pairs.join("&"))
}

fn to_hashmap(meta: &UserMeta) -> HashMap<String, String> {
    meta.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

/// `bucket/key` for x-amz-copy-source, with the key percent-encoded.
fn copy_source(bucket: &str, key: &str) -> String {
    let mut s = String::with_capacity(bucket.len() + key.len() + 1);
    s.push_str(bucket);
    s.push('/');
    for b in key.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' | b'/' => {
                s.push(b as char)
            }
            _ => s.push_str(&format!("%{b:02X}")),
        }
    }
    s
}

impl S3Store {
    /// DELETE, with `If-Match` when `pin` is given (a store that ignores it deletes
    /// whatever is there). A missing key succeeds.
    async fn delete_pinned(&self, key: &str, pin: Option<&str>) -> StoreResult<()> {
        // Whatever takes the key next is not this client's version.
        self.own.lock().forget(key);
        let pin = pin.filter(|_| !self.no_conditional_delete.load(Ordering::Relaxed));
        let _slot = self.metadata_slot().await;
        let mut r = self.delete_request(key, pin).await;
        if let (Some(_), Err(e)) = (pin, &r) {
            // A store without conditional DELETE (AWS general-purpose buckets before
            // 2025-09, LocalStack) refuses the header: 501 NotImplemented, or 400.
            let refused = refused_condition(e, true, &self.no_conditional_delete, |why| {
                format!(
                    "delete {key}: the store refuses If-Match on DELETE ({why}): deletes \
                     are checked by a HEAD only from now on"
                )
            });
            if refused {
                r = self.delete_request(key, None).await;
            }
        }
        match r {
            Ok(()) => Ok(()),
            Err(e) => match map_err(key, e) {
                StoreError::NotFound(_) => Ok(()),
                other => Err(other),
            },
        }
    }

    async fn put_request(
        &self,
        key: &str,
        body: Bytes,
        meta: &UserMeta,
        headers: &KeptHeaders,
        if_match: Option<&str>,
    ) -> Result<
        aws_sdk_s3::operation::put_object::PutObjectOutput,
        SdkError<
            aws_sdk_s3::operation::put_object::PutObjectError,
            aws_smithy_runtime_api::http::Response,
        >,
    > {
        let _slot = self.slot().await;
        let len = body.len() as u64;
        let req = self
            .client
            .put_object()
            .bucket(&self.bucket)
            .key(sdk_key(key))
            .body(ByteStream::from(body))
            .set_metadata(Some(to_hashmap(meta)));
        let req = with_headers!(req, headers)
            .set_tagging(headers.tagging.clone())
            .set_if_match(if_match.filter(|t| *t != IF_ABSENT).map(str::to_string))
            .set_if_none_match((if_match == Some(IF_ABSENT)).then(|| "*".to_string()))
            .customize()
            .config_override(sized(len));
        let req = if self.unsigned_payload {
            req.disable_payload_signing()
        } else {
            req
        };
        req.send().await
    }

    /// The condition a write of `key` under `if_match` is sent with: as asked, unless it is
    /// [`IF_ABSENT`] and the store refuses that (see [`Self::refuses_create_condition`]):
    /// then a HEAD checks the key is free (`PreconditionFailed` if not) and the write goes
    /// plain. Another client's object made between the two is replaced (one round trip).
    async fn create_condition<'a>(
        &self,
        key: &str,
        if_match: Option<&'a str>,
    ) -> StoreResult<Option<&'a str>> {
        if if_match != Some(IF_ABSENT) || !self.no_conditional_create.load(Ordering::Relaxed) {
            return Ok(if_match);
        }
        match self.head(key).await {
            Ok(_) => Err(StoreError::PreconditionFailed(format!(
                "{key}: exists (checked by HEAD: the store refuses If-None-Match)"
            ))),
            Err(StoreError::NotFound(_)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Whether error `e` of a write of `key` with `If-None-Match: *` is the store refusing
    /// the header (`501 NotImplemented`: AWS before 2024-08, LocalStack; see
    /// [`refused_condition`]).
    fn refuses_create_condition<E: ProvideErrorMetadata>(
        &self,
        key: &str,
        e: &SdkError<E, aws_smithy_runtime_api::http::Response>,
    ) -> bool {
        refused_condition(e, false, &self.no_conditional_create, |why| {
            format!(
                "write {key}: the store refuses If-None-Match ({why}): new objects are \
                 checked by a HEAD only from now on"
            )
        })
    }

    async fn delete_request(
        &self,
        key: &str,
        pin: Option<&str>,
    ) -> Result<
        (),
        SdkError<
            aws_sdk_s3::operation::delete_object::DeleteObjectError,
            aws_smithy_runtime_api::http::Response,
        >,
    > {
        self.client
            .delete_object()
            .bucket(&self.bucket)
            .key(sdk_key(key))
            .set_if_match(pin.map(str::to_string))
            .send()
            .await
            .map(|_| ())
    }

    /// Builds a client. Does not contact the service; call [`S3Store::check_access`] for that.
    pub async fn new(cfg: &S3Config) -> StoreResult<Self> {
        let mut loader = aws_config::defaults(aws_config::BehaviorVersion::latest());
        if let Some(p) = &cfg.profile {
            loader = loader.profile_name(p);
        }
        if let (Some(ak), Some(sk)) = (&cfg.access_key_id, &cfg.secret_access_key) {
            loader = loader.credentials_provider(Credentials::new(
                ak,
                sk,
                cfg.session_token.clone(),
                None,
                "bucketfs-config",
            ));
        }
        if let Some(r) = &cfg.region {
            loader = loader.region(Region::new(r.clone()));
        }
        let max_connections = match cfg.max_connections {
            0 => DEFAULT_MAX_CONNECTIONS,
            n => n.min(Semaphore::MAX_PERMITS),
        };
        let slots = Arc::new(RequestSlots::new(max_connections));
        loader = loader.http_client(crate::tls::http_client(&cfg.tls, slots.most()));
        let sdk = loader.load().await;
        let mut b = aws_sdk_s3::config::Builder::from(&sdk)
            .force_path_style(cfg.force_path_style)
            .request_checksum_calculation(
                aws_sdk_s3::config::RequestChecksumCalculation::WhenRequired,
            )
            .response_checksum_validation(
                aws_sdk_s3::config::ResponseChecksumValidation::WhenRequired,
            )
            .retry_config(if cfg.max_attempts <= 1 {
                aws_sdk_s3::config::retry::RetryConfig::disabled()
            } else {
                aws_sdk_s3::config::retry::RetryConfig::standard()
                    .with_max_attempts(cfg.max_attempts)
                    .with_initial_backoff(Duration::from_millis(200))
                    .with_max_backoff(Duration::from_secs(5))
            })
            .timeout_config(timeouts(ATTEMPT_BASE))
            .interceptor(crate::wire::Progress)
            .interceptor(crate::blank_keys::BlankKeys);
        if sdk.region().is_none() {
            b = b.region(Region::new("us-east-1"));
        }
        if let Some(ep) = &cfg.endpoint_url {
            b = b.endpoint_url(ep);
        }
        let endpoint = cfg.endpoint_url.clone().or_else(|| sdk_endpoint(&sdk));
        let https = endpoint
            .as_deref()
            .is_none_or(|e| e.to_ascii_lowercase().starts_with("https://"));
        Ok(Self {
            client: Client::from_conf(b.build()),
            bucket: cfg.bucket.clone(),
            unsigned_payload: cfg.unsigned_payload.unwrap_or(https),
            list_metadata: cfg.list_metadata,
            server: AtomicU8::new(SERVER_UNKNOWN),
            slots,
            page_lists: Semaphore::new(PAGE_LISTS_IN_FLIGHT),
            no_conditional_delete: AtomicBool::new(false),
            no_conditional_create: AtomicBool::new(false),
            endpoint,
            guess_content_type: cfg.guess_content_type,
            own: Default::default(),
            warned_headers: AtomicBool::new(false),
            warned_tags: AtomicBool::new(false),
            no_tag_writes: AtomicBool::new(false),
            own_uploads: Default::default(),
            list_progress: Default::default(),
            inner_requests: Default::default(),
        })
    }

    /// Counts in `m` the requests this store sends within a call (see
    /// [`crate::metrics::StoreMetrics::count_request`]): the metered wrapper sees only the
    /// call.
    pub fn count_inner_requests_in(&self, m: Arc<crate::metrics::StoreMetrics>) {
        let _ = self.inner_requests.set(m);
    }

    /// One request of [`Self::count_inner_requests_in`].
    fn counted<T>(&self, op: crate::metrics::Op, r: &StoreResult<T>) {
        if let Some(m) = self.inner_requests.get() {
            m.count_request(op, r.is_ok());
        }
    }

    /// The endpoint requests go to (see the field); `None`: AWS's own.
    pub fn endpoint(&self) -> Option<&str> {
        self.endpoint.as_deref()
    }

    /// HEAD of `key` (the version `if_match`), all its headers: [`ObjectStore::head`] keeps
    /// what a file needs; a copy replacing the user metadata gives the others again (S3
    /// keeps none of them then: Content-Type, Content-Encoding, Content-Language,
    /// Content-Disposition, Cache-Control, the website redirect, the storage class and the
    /// KMS encryption).
    async fn head_object(
        &self,
        key: &str,
        if_match: Option<&str>,
    ) -> StoreResult<aws_sdk_s3::operation::head_object::HeadObjectOutput> {
        let _slot = self.metadata_slot().await;
        self.client
            .head_object()
            .bucket(&self.bucket)
            .key(sdk_key(key))
            .set_if_match(if_match.map(str::to_string))
            .send()
            .await
            .map_err(|e| map_err(key, e))
    }

    /// The headers a new version of `dst` made from version `etag` of `src` gives again: a
    /// copy replacing the user metadata, or new bytes replacing that version. For a version
    /// this client stored in the last [`OWN_KNOWN_FOR`], those it gave (no HEAD); at a new
    /// name, a guessed Content-Type is that name's, as the version would have if written
    /// there. A version gone since gives those of whatever is there now, or a new object's
    /// (a pinned write or copy then fails on its own condition).
    async fn headers_to_keep(
        &self,
        src: &str,
        etag: Option<&str>,
        dst: &str,
    ) -> StoreResult<KeptHeaders> {
        if let Some(o) = self.own_version(src, etag) {
            return Ok(self.own_headers_at(src, o, dst));
        }
        let mut head = self.head_object(src, etag).await;
        self.counted(crate::metrics::Op::Head, &head);
        if etag.is_some()
            && matches!(
                head,
                Err(StoreError::PreconditionFailed(_) | StoreError::NotFound(_))
            )
        {
            head = self.head_object(src, None).await;
            self.counted(crate::metrics::Op::Head, &head);
        }
        match head {
            Ok(h) => {
                let mut kept = KeptHeaders::of(&h);
                // The type its name gives (one this mount gave, likely): at a new name, that
                // name's (see `OWN_KNOWN_FOR`).
                kept.type_guessed =
                    kept.content_type.is_some() && kept.content_type == self.content_type_of(src);
                Ok(kept)
            }
            Err(StoreError::NotFound(_)) => Ok(KeptHeaders::guessed(self.content_type_of(dst))),
            Err(e) => Err(e),
        }
    }

    /// The headers a write of new bytes to `key` gives: a new object's, or with `from`
    /// those of the version they replace (see [`S3Store::headers_to_keep`]).
    async fn headers_of_write(
        &self,
        key: &str,
        from: Option<HeadersFrom<'_>>,
    ) -> StoreResult<KeptHeaders> {
        let Some(f) = from else {
            return Ok(KeptHeaders::guessed(self.content_type_of(key)));
        };
        match self.headers_to_keep(f.key, f.etag, key).await {
            Ok(mut h) => {
                if h.tags_unread {
                    h.tagging = self.tags_to_keep(f.key).await?;
                    h.tags_unread = false;
                }
                Ok(h.for_new_bytes())
            }
            // Not a reason to refuse the write: a credential that may write but not read
            // (s3:PutObject alone), an object encrypted with a key of the client's own
            // (SSE-C). The version gets a new object's headers, as before they were kept.
            Err(e @ (StoreError::AccessDenied(_) | StoreError::Invalid(_))) => {
                if !self.warned_headers.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        "{}: its headers cannot be read ({e}); a version written over such an \
                         object gets a new object's Content-Type and no other header (logged \
                         once)",
                        f.key
                    );
                }
                Ok(KeptHeaders::guessed(self.content_type_of(key)))
            }
            Err(e) => Err(e),
        }
    }

    /// The tags of `key` that a write of new bytes over it gives again (see
    /// [`KeptHeaders::tagging`]): none when the object has gone, or when they cannot be
    /// read or written (a credential without `s3:GetObjectTagging` or
    /// `s3:PutObjectTagging`; logged once): the write is not refused for them.
    async fn tags_to_keep(&self, key: &str) -> StoreResult<Option<String>> {
        if self.no_tag_writes.load(Ordering::Relaxed) {
            return Ok(None);
        }
        let out = {
            let _slot = self.metadata_slot().await;
            self.client
                .get_object_tagging()
                .bucket(&self.bucket)
                .key(sdk_key(key))
                .send()
                .await
        };
        let out = out.map_err(|e| map_err(key, e));
        self.counted(crate::metrics::Op::GetTagging, &out);
        match out {
            Ok(o) => Ok(encode_tagging(o.tag_set())),
            Err(StoreError::NotFound(_)) => Ok(None),
            Err(e @ (StoreError::AccessDenied(_) | StoreError::Invalid(_))) => {
                if !self.warned_tags.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        "{key}: its tags cannot be read ({e}); a version written over a \
                         tagged object is stored without its tags (logged once)"
                    );
                }
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Whether `e`, the answer to a write sent with `headers`, may be the store refusing
    /// their tags (`403 AccessDenied`): the write is sent again without them (see
    /// [`Self::took_untagged`]).
    fn tags_refused<E: ProvideErrorMetadata>(
        &self,
        e: &SdkError<E, aws_smithy_runtime_api::http::Response>,
        headers: &KeptHeaders,
    ) -> bool {
        // Not a clock skew or a signature error, which are 403s too.
        headers.tagging.is_some()
            && matches!(e, SdkError::ServiceError(se)
                if se.raw().status().as_u16() == 403 && se.err().code() == Some("AccessDenied"))
    }

    /// A write of `key` refused with its tags was taken without them: later writes send
    /// none (logged once).
    fn took_untagged(&self, key: &str) {
        self.no_tag_writes.store(true, Ordering::Relaxed);
        if !self.warned_tags.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                "write {key}: the store refuses the tags of the version it replaces (403; \
                 no s3:PutObjectTagging?) and took it without them: versions written over \
                 tagged objects are stored without their tags (logged once)"
            );
        }
    }

    /// What this client gave version `etag` of `key`, if it stored it (see
    /// [`OwnVersions::get`]).
    fn own_version(&self, key: &str, etag: Option<&str>) -> Option<Own> {
        self.own.lock().get(key, etag?)
    }

    /// The headers own version `o` of `src` has at `dst`.
    fn own_headers_at(&self, src: &str, o: Own, dst: &str) -> KeptHeaders {
        let mut h = o.headers;
        if src != dst && h.type_guessed {
            h.content_type = self.content_type_of(dst);
        }
        h
    }

    /// The Content-Type a new object `key` is written with (see
    /// [`S3Config::guess_content_type`]): `None` for a directory marker or a name with no
    /// extension the table knows.
    fn content_type_of(&self, key: &str) -> Option<String> {
        if !self.guess_content_type || key.ends_with('/') {
            return None;
        }
        let name = key.rsplit('/').next().unwrap_or(key);
        // `.bashrc` is a name, not an extension.
        let (stem, ext) = name.rsplit_once('.')?;
        if stem.is_empty() {
            return None;
        }
        mime_guess::from_ext(ext).first_raw().map(str::to_string)
    }

    /// Waits for a request slot. Held across the whole request (the SDK's own attempts and
    /// the reading of the body), so requests in flight, and with them open connections,
    /// never exceed [`most_connections`] of the configured number. A slot is never held
    /// while waiting for another.
    async fn slot(&self) -> SemaphorePermit<'_> {
        // Time spent queueing behind other requests is not this request's stall.
        crate::liveness::queued(self.slots.acquire(SlotKind::Data)).await
    }

    /// [`Self::slot`] for a metadata request: it may take a spare slot.
    async fn metadata_slot(&self) -> SemaphorePermit<'_> {
        crate::liveness::queued(self.slots.acquire(SlotKind::Metadata)).await
    }

    /// The request bound, for its gauges.
    pub fn request_slots(&self) -> Arc<RequestSlots> {
        self.slots.clone()
    }

    /// Whether LISTs that want user metadata ask the server for it now.
    pub fn lists_metadata(&self) -> bool {
        match self.list_metadata {
            ListMetadata::On => true,
            ListMetadata::Off => false,
            ListMetadata::Auto => self.server.load(Ordering::Relaxed) == SERVER_MINIO,
        }
    }

    /// A LIST request, url-encoded (see [`crate::list_encoding`]), asking for user metadata
    /// when `detail` wants it and [`Self::lists_metadata`], and with an interceptor when its
    /// answer must be looked at (metadata to parse, or the server to detect). The query
    /// parameter is added before signing, so it is signed like the rest.
    fn list_request(
        &self,
        req: aws_sdk_s3::operation::list_objects_v2::builders::ListObjectsV2FluentBuilder,
        detail: ListDetail,
    ) -> (
        aws_sdk_s3::client::customize::CustomizableOperation<
            aws_sdk_s3::operation::list_objects_v2::ListObjectsV2Output,
            aws_sdk_s3::operation::list_objects_v2::ListObjectsV2Error,
            aws_sdk_s3::operation::list_objects_v2::builders::ListObjectsV2FluentBuilder,
        >,
        Option<ListCapture>,
    ) {
        let want = detail == ListDetail::UserMeta && self.lists_metadata();
        let detect = self.list_metadata == ListMetadata::Auto
            && self.server.load(Ordering::Relaxed) == SERVER_UNKNOWN;
        let mut req = req
            .encoding_type(EncodingType::Url)
            .customize()
            .interceptor(SanitizeListing);
        if want {
            req = req.mutate_request(|r| {
                let uri = crate::list_meta::with_query_param(r.uri());
                // A URI that was valid stays valid with a plain `&metadata=true` appended.
                let _ = r.set_uri(uri);
            });
        }
        let capture = (want || detect).then(|| ListCapture::new(want));
        if let Some(c) = &capture {
            req = req.interceptor(c.clone());
        }
        (req, capture)
    }

    /// Notes what an answer said about the server (`Auto` only).
    fn note_server(&self, minio: bool) {
        if self.list_metadata != ListMetadata::Auto {
            return;
        }
        let state = if minio { SERVER_MINIO } else { SERVER_OTHER };
        if self
            .server
            .compare_exchange(SERVER_UNKNOWN, state, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
        {
            if minio {
                tracing::info!("server is MinIO: listings carry user metadata (no HEAD per entry)");
            } else {
                tracing::debug!("server is not MinIO: plain listings");
            }
        }
    }

    /// One cheap LIST to prove that the bucket exists and the credentials work, so that a
    /// mount fails at startup with a clear message instead of at first use.
    /// With `ListMetadata::Auto` it also finds out whether the server is MinIO.
    pub async fn check_access(&self, prefix: &str) -> StoreResult<()> {
        let _slot = self.metadata_slot().await;
        let (req, capture) = self.list_request(
            self.client
                .list_objects_v2()
                .bucket(&self.bucket)
                .prefix(prefix)
                .max_keys(1),
            ListDetail::Plain,
        );
        req.send()
            .await
            .map_err(|e| map_err(&format!("bucket {}", self.bucket), e))?;
        if let Some(c) = capture {
            self.note_server(c.take().minio);
        }
        Ok(())
    }

    /// Ranged GET whose body frames go to `sink` as they arrive (each is freed right after).
    async fn get_body(
        &self,
        key: &str,
        range: Range<u64>,
        if_match: Option<&str>,
        mut sink: impl FnMut(&[u8]) -> StoreResult<()> + Send,
    ) -> StoreResult<()> {
        if range.start >= range.end {
            return Ok(());
        }
        let _slot = self.slot().await;
        let limit = attempt_timeout(range.end - range.start);
        let get = async {
            let out = self
                .client
                .get_object()
                .bucket(&self.bucket)
                .key(sdk_key(key))
                .range(format!("bytes={}-{}", range.start, range.end - 1))
                .set_if_match(if_match.map(str::to_string))
                .customize()
                .config_override(sized(range.end - range.start))
                .send()
                .await;
            let out = match out {
                Ok(o) => o,
                // Asking for bytes past the end of an object is not an error for a file read.
                Err(SdkError::ServiceError(se)) if se.raw().status().as_u16() == 416 => {
                    return Ok(())
                }
                Err(e) => return Err(map_err(key, e)),
            };
            // A store (or proxy) that ignores If-Match would hand over another version's
            // bytes, which a reader would mix with the pinned version's and the data cache
            // would keep under the pinned ETag.
            if let (Some(want), Some(got)) = (if_match, out.e_tag()) {
                // Hex case is a gateway's formatting, not another version.
                if !norm_etag(Some(want))
                    .unwrap_or_default()
                    .eq_ignore_ascii_case(&norm_etag(Some(got)).unwrap_or_default())
                {
                    return Err(StoreError::PreconditionFailed(format!(
                        "{key}: asked for version {want}, the store sent {got} (it ignores \
                         If-Match)"
                    )));
                }
            }
            // A store (or proxy) that ignores Range sends the object from its start (bytes of
            // another offset) and as much of it as it likes (a daemon buffering it runs out
            // of memory): the bytes must start where asked and stop at the range's end.
            let starts_at = out
                .content_range()
                .and_then(|r| r.strip_prefix("bytes "))
                .and_then(|r| r.split_once('-'))
                .and_then(|(from, _)| from.parse::<u64>().ok())
                .unwrap_or(0);
            if starts_at != range.start {
                return Err(StoreError::Other(format!(
                    "{key}: asked for bytes from {}, the store sent them from {starts_at} (it \
                     ignores Range)",
                    range.start
                )));
            }
            let (want, mut got) = (range.end - range.start, 0u64);
            let mut body = out.body;
            while let Some(frame) = body.next().await {
                let frame = frame
                    .map_err(|e| StoreError::Transient(format!("{key}: reading body: {e}")))?;
                got += frame.len() as u64;
                if got > want {
                    return Err(StoreError::Other(format!(
                        "{key}: asked for {want} bytes, the store sent more (it ignores Range)"
                    )));
                }
                sink(&frame)?;
            }
            Ok(())
        };
        match tokio::time::timeout(limit, get).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::Transient(format!(
                "{key}: GET of {} bytes took longer than {} s",
                range.end - range.start,
                limit.as_secs()
            ))),
        }
    }
}

#[async_trait]
impl ObjectStore for S3Store {
    fn describe(&self) -> String {
        format!("s3://{}", self.bucket)
    }

    fn limits(&self) -> StoreLimits {
        StoreLimits {
            max_copy_object: test_max_copy_object().unwrap_or(StoreLimits::S3.max_copy_object),
            ..StoreLimits::S3
        }
    }

    async fn head(&self, key: &str) -> StoreResult<ObjectMeta> {
        let out = self.head_object(key, None).await?;
        Ok(ObjectMeta {
            key: key.to_string(),
            size: out.content_length().unwrap_or(0).max(0) as u64,
            etag: norm_etag(out.e_tag()),
            last_modified: system_time(out.last_modified()),
            user: out
                .metadata()
                .map(|m| {
                    m.iter()
                        .map(|(k, v)| (k.to_lowercase(), v.clone()))
                        .collect()
                })
                .unwrap_or_default(),
            user_complete: true,
        })
    }

    async fn get_range(
        &self,
        key: &str,
        range: Range<u64>,
        if_match: Option<&str>,
    ) -> StoreResult<Bytes> {
        // One buffer of the final size; each frame is copied in as it arrives and then freed,
        // so a GET holds its size once (not frames plus a copy) and never reallocates.
        let mut buf =
            bytes::BytesMut::with_capacity(range.end.saturating_sub(range.start) as usize);
        self.get_body(key, range, if_match, |frame| {
            buf.extend_from_slice(frame);
            Ok(())
        })
        .await?;
        Ok(buf.freeze())
    }

    async fn get_range_into(
        &self,
        key: &str,
        range: Range<u64>,
        if_match: Option<&str>,
        dst: &mut [u8],
    ) -> StoreResult<usize> {
        let mut filled = 0;
        self.get_body(key, range.clone(), if_match, |frame| {
            let Some(to) = dst.get_mut(filled..filled + frame.len()) else {
                return Err(StoreError::Other(format!(
                    "{key}: GET of range {range:?} returned more bytes than asked"
                )));
            };
            to.copy_from_slice(frame);
            filled += frame.len();
            Ok(())
        })
        .await?;
        Ok(filled)
    }

    async fn put_if(
        &self,
        key: &str,
        body: Bytes,
        meta: &UserMeta,
        if_match: Option<&str>,
        headers_from: Option<HeadersFrom<'_>>,
    ) -> StoreResult<String> {
        let if_match = self.create_condition(key, if_match).await?;
        let mut headers = self.headers_of_write(key, headers_from).await?;
        let mut out = self
            .put_request(key, body.clone(), meta, &headers, if_match)
            .await;
        if matches!(&out, Err(e) if self.tags_refused(e, &headers)) {
            let untagged = KeptHeaders {
                tagging: None,
                ..headers.clone()
            };
            out = self
                .put_request(key, body.clone(), meta, &untagged, if_match)
                .await;
            if out.is_ok() {
                self.took_untagged(key);
                headers = untagged;
            }
        }
        let out = match out {
            Err(e) if if_match == Some(IF_ABSENT) && self.refuses_create_condition(key, &e) => {
                self.create_condition(key, if_match).await?;
                self.put_request(key, body, meta, &headers, None).await
            }
            r => r,
        };
        let out = out.map_err(|e| map_err(key, e))?;
        let etag = norm_etag(out.e_tag()).unwrap_or_default();
        self.own
            .lock()
            .made(key, &etag, Own::new(headers, meta.clone()));
        Ok(etag)
    }

    async fn create_multipart(
        &self,
        key: &str,
        meta: &UserMeta,
        headers_from: Option<HeadersFrom<'_>>,
    ) -> StoreResult<String> {
        let mut headers = self.headers_of_write(key, headers_from).await?;
        let create = |headers: &KeptHeaders| {
            let req = self
                .client
                .create_multipart_upload()
                .bucket(&self.bucket)
                .key(sdk_key(key))
                .set_metadata(Some(to_hashmap(meta)));
            with_headers!(req, headers)
                .set_tagging(headers.tagging.clone())
                .send()
        };
        let _slot = self.metadata_slot().await;
        let mut out = create(&headers).await;
        if matches!(&out, Err(e) if self.tags_refused(e, &headers)) {
            let untagged = KeptHeaders {
                tagging: None,
                ..headers.clone()
            };
            out = create(&untagged).await;
            if out.is_ok() {
                self.took_untagged(key);
                headers = untagged;
            }
        }
        let out = out.map_err(|e| map_err(key, e))?;
        let id = out
            .upload_id()
            .map(str::to_string)
            .ok_or_else(|| StoreError::Other(format!("{key}: no upload id returned")))?;
        let own = Own::new(headers, meta.clone());
        self.own_uploads.lock().insert(id.clone(), own);
        Ok(id)
    }

    async fn upload_part(
        &self,
        key: &str,
        upload_id: &str,
        part_number: u32,
        body: Bytes,
    ) -> StoreResult<String> {
        let _slot = self.slot().await;
        let len = body.len() as u64;
        let req = self
            .client
            .upload_part()
            .bucket(&self.bucket)
            .key(sdk_key(key))
            .upload_id(upload_id)
            .part_number(part_number as i32)
            .body(ByteStream::from(body))
            .customize()
            .config_override(sized(len));
        let req = if self.unsigned_payload {
            req.disable_payload_signing()
        } else {
            req
        };
        let out = req
            .send()
            .await
            .map_err(|e| map_err(&format!("{key} part {part_number}"), e))?;
        norm_etag(out.e_tag()).ok_or_else(|| StoreError::Other(format!("{key}: part without ETag")))
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
        let _slot = self.slot().await;
        let out = self
            .client
            .upload_part_copy()
            .bucket(&self.bucket)
            .key(sdk_key(key))
            .upload_id(upload_id)
            .part_number(part_number as i32)
            .copy_source(copy_source(&self.bucket, src_key))
            .copy_source_range(format!("bytes={}-{}", range.start, range.end - 1))
            .set_copy_source_if_match(src_if_match.map(str::to_string))
            .customize()
            .config_override(sized(range.end - range.start))
            .send()
            .await
            .map_err(|e| map_err(&format!("{key} part {part_number} copy"), e))?;
        norm_etag(out.copy_part_result().and_then(|r| r.e_tag()))
            .ok_or_else(|| StoreError::Other(format!("{key}: copied part without ETag")))
    }

    async fn complete_multipart(
        &self,
        key: &str,
        upload_id: &str,
        parts: &[CompletedPart],
        if_match: Option<&str>,
    ) -> StoreResult<String> {
        let if_match = self.create_condition(key, if_match).await?;
        let complete = |if_match: Option<&str>| {
            let parts = parts
                .iter()
                .map(|p| {
                    aws_sdk_s3::types::CompletedPart::builder()
                        .part_number(p.part_number as i32)
                        .e_tag(&p.etag)
                        .build()
                })
                .collect();
            self.client
                .complete_multipart_upload()
                .bucket(&self.bucket)
                .key(sdk_key(key))
                .upload_id(upload_id)
                .multipart_upload(
                    CompletedMultipartUpload::builder()
                        .set_parts(Some(parts))
                        .build(),
                )
                .set_if_match(if_match.filter(|t| *t != IF_ABSENT).map(str::to_string))
                .set_if_none_match((if_match == Some(IF_ABSENT)).then(|| "*".to_string()))
                .send()
        };
        let r = {
            let _slot = self.slot().await;
            complete(if_match).await
        };
        let out = match r {
            Err(e) if if_match == Some(IF_ABSENT) && self.refuses_create_condition(key, &e) => {
                self.create_condition(key, if_match).await?;
                let _slot = self.slot().await;
                complete(None).await
            }
            r => r,
        };
        let out = out.map_err(|e| map_err(key, e))?;
        let etag = norm_etag(out.e_tag()).unwrap_or_default();
        match self.own_uploads.lock().remove(upload_id) {
            Some(own) => self.own.lock().made(key, &etag, own),
            None => self.own.lock().forget(key),
        }
        Ok(etag)
    }

    async fn abort_multipart(&self, key: &str, upload_id: &str) -> StoreResult<()> {
        self.own_uploads.lock().remove(upload_id);
        let _slot = self.metadata_slot().await;
        match self
            .client
            .abort_multipart_upload()
            .bucket(&self.bucket)
            .key(sdk_key(key))
            .upload_id(upload_id)
            .send()
            .await
        {
            Ok(_) => Ok(()),
            Err(e) => match map_err(key, e) {
                StoreError::NotFound(_) => Ok(()),
                other => Err(other),
            },
        }
    }

    async fn list_multipart_uploads(&self, prefix: &str) -> StoreResult<Vec<MultipartUpload>> {
        let _slot = self.slot().await;
        let mut out = Vec::new();
        let (mut key_marker, mut id_marker) = (None::<String>, None::<String>);
        let mut seen = std::collections::HashSet::new();
        loop {
            let page = self
                .client
                .list_multipart_uploads()
                .bucket(&self.bucket)
                .prefix(prefix)
                .encoding_type(EncodingType::Url)
                .set_key_marker(key_marker.clone())
                .set_upload_id_marker(id_marker.clone())
                .customize()
                .interceptor(SanitizeListing)
                .send()
                .await
                .map_err(|e| map_err(&format!("uploads under {prefix:?}"), e))?;
            let url = page.encoding_type() == Some(&EncodingType::Url);
            let dec = |s: &str| if url { decode(s) } else { Some(s.to_string()) };
            for u in page.uploads() {
                let key = u.key().and_then(|k| {
                    let d = dec(k);
                    if d.is_none() {
                        tracing::warn!("uploads under {prefix:?}: key {k:?} is not UTF-8: skipped");
                    }
                    d
                });
                if let (Some(k), Some(id)) = (key, u.upload_id()) {
                    out.push(MultipartUpload {
                        key: k,
                        upload_id: id.to_string(),
                        initiated: system_time(u.initiated()),
                    });
                }
            }
            if page.is_truncated() != Some(true) {
                return Ok(out);
            }
            let next = (
                page.next_key_marker().and_then(dec),
                page.next_upload_id_marker().map(str::to_string),
            );
            if next.0.is_none() {
                return Ok(out);
            }
            // Going on from a marker already given (or from before one: the uploads are
            // listed in key order) would read the same pages for ever.
            if !seen.insert(next.clone()) || next.0 < key_marker {
                return Err(StoreError::Other(format!(
                    "uploads under {prefix:?}: the store answered a marker with itself or \
                     an earlier one"
                )));
            }
            (key_marker, id_marker) = next;
        }
    }

    async fn copy(
        &self,
        src_key: &str,
        dst_key: &str,
        meta: Option<&UserMeta>,
        src_if_match: Option<&str>,
    ) -> StoreResult<String> {
        // A copy that replaces the user metadata replaces the object's other headers too:
        // they are given again (chmod must not make a web page a download). A plain copy
        // (a rename) of a version this client stored a moment ago with a guessed type, to
        // a name of another type, replaces the metadata with what it was given and the
        // type with the new name's.
        let own_src = self.own_version(src_key, src_if_match);
        let (meta, headers) = match (meta, &own_src) {
            (Some(m), _) => {
                let h = self.headers_to_keep(src_key, src_if_match, dst_key).await?;
                (Some(m.clone()), Some(h))
            }
            (None, Some(o)) => {
                let h = self.own_headers_at(src_key, o.clone(), dst_key);
                match h == o.headers {
                    true => (None, None),
                    false => (Some(o.meta.clone()), Some(h)),
                }
            }
            (None, None) => (None, None),
        };
        let _slot = self.slot().await;
        let mut req = self
            .client
            .copy_object()
            .bucket(&self.bucket)
            .key(sdk_key(dst_key))
            .copy_source(copy_source(&self.bucket, src_key))
            .set_copy_source_if_match(src_if_match.map(str::to_string));
        if src_key == dst_key {
            // For stores that honour it; MinIO ignores it, leaving only its own copy step
            // between the source check and the write.
            req = req.set_if_match(src_if_match.map(str::to_string));
        }
        if let Some(m) = &meta {
            req = req
                .metadata_directive(MetadataDirective::Replace)
                .set_metadata(Some(to_hashmap(m)));
        }
        if let Some(h) = &headers {
            req = with_headers!(req, h);
        }
        // The size is unknown here and a server-side copy of up to 5 GiB can take minutes.
        let out = req
            .customize()
            .config_override(
                aws_sdk_s3::config::Builder::default()
                    .timeout_config(timeouts(Duration::from_secs(600))),
            )
            .send()
            .await
            .map_err(|e| map_err(&format!("copy {src_key} -> {dst_key}"), e))?;
        let etag = out
            .copy_object_result()
            .and_then(|r| norm_etag(r.e_tag()))
            .ok_or_else(|| StoreError::Other(format!("copy {src_key} -> {dst_key}: no ETag")))?;
        let made = match (headers, meta, own_src) {
            // Every header given: those are the copy's.
            (Some(headers), Some(meta), _) => Some(Own::new(headers, meta)),
            // A plain copy of one of its own: the same as it.
            (None, None, Some(o)) => Some(o),
            // Another client's headers are on it.
            _ => None,
        };
        match made {
            Some(own) => self.own.lock().made(dst_key, &etag, own),
            None => self.own.lock().forget(dst_key),
        }
        Ok(etag)
    }

    async fn delete(&self, key: &str) -> StoreResult<()> {
        self.delete_pinned(key, None).await
    }

    async fn delete_if(&self, key: &str, if_match: &str) -> StoreResult<()> {
        self.delete_pinned(key, Some(if_match)).await
    }

    async fn list(
        &self,
        prefix: &str,
        delimiter: Option<&str>,
        from: ListFrom,
        max_keys: usize,
        detail: ListDetail,
    ) -> StoreResult<ListPage> {
        // Taken before the request slot, which is never held while waiting for another.
        let _page = match max_keys > 1 {
            true => Some(
                crate::liveness::queued(self.page_lists.acquire())
                    .await
                    .expect("never closed"),
            ),
            false => None,
        };
        let _slot = self.metadata_slot().await;
        let (start_after, token) = match from {
            ListFrom::Start => (None, None),
            ListFrom::After(k) => (Some(k), None),
            ListFrom::Token(t) => (None, Some(t)),
        };
        let (req, capture) = self.list_request(
            self.client
                .list_objects_v2()
                .bucket(&self.bucket)
                .prefix(prefix)
                .set_delimiter(delimiter.map(str::to_string))
                .set_start_after(start_after)
                .set_continuation_token(token.clone())
                .max_keys(max_keys.min(1000) as i32),
            detail,
        );
        let out = req
            .send()
            .await
            .map_err(|e| map_err(&format!("list {prefix:?}"), e))?;
        if out.is_truncated() == Some(true) {
            match out.next_continuation_token() {
                // Taken for the end, it would make the listing look complete.
                None => {
                    return Err(StoreError::Other(format!(
                        "list {prefix:?}: a truncated page without a continuation token"
                    )))
                }
                // Going on from it would read the same page for ever.
                Some(next) if Some(next) == token.as_deref() => {
                    return Err(StoreError::Other(format!(
                        "list {prefix:?}: the store answered a continuation token with itself"
                    )))
                }
                Some(_) => {}
            }
        }
        // The user metadata of each `<Contents>`, in the same order as the SDK's entries.
        let mut metas = match capture.map(|c| c.take()) {
            Some(c) => {
                self.note_server(c.minio);
                match c.entries {
                    Some(Ok(v)) => v,
                    Some(Err(e)) => {
                        tracing::warn!("list {prefix:?}: user metadata not understood: {e}");
                        Vec::new()
                    }
                    None => Vec::new(),
                }
            }
            None => Vec::new(),
        }
        .into_iter();
        // Keys come url-encoded unless the store ignored the parameter. One that does not
        // decode to a key under `prefix` is skipped, never the page (and never sliced wrong).
        let url = out.encoding_type() == Some(&EncodingType::Url);
        let mut skipped = Vec::new();
        let mut dec = |s: &str| {
            let d = if url { decode(s) } else { Some(s.to_string()) };
            let d = d.filter(|d| d.starts_with(prefix));
            if d.is_none() {
                skipped.push(s.to_string());
            }
            d
        };
        let page = ListPage {
            objects: out
                .contents()
                .iter()
                .filter_map(|o| {
                    let listed = metas.next();
                    let raw = o.key()?;
                    // Both as the answer spelled them.
                    let user = listed.and_then(|(k, u)| if k == raw { u } else { None });
                    Some(ObjectMeta {
                        key: dec(raw)?,
                        size: o.size().unwrap_or(0).max(0) as u64,
                        etag: norm_etag(o.e_tag()),
                        last_modified: system_time(o.last_modified()),
                        user_complete: user.is_some(),
                        user: user.unwrap_or_default(),
                    })
                })
                .collect(),
            common_prefixes: out
                .common_prefixes()
                .iter()
                .filter_map(|p| p.prefix().and_then(&mut dec))
                .collect(),
            next_continuation: if out.is_truncated() == Some(true) {
                out.next_continuation_token().map(str::to_string)
            } else {
                None
            },
        };
        if !skipped.is_empty() {
            tracing::warn!(
                "list {prefix:?}: {} key(s) not UTF-8 or not under the prefix once decoded, \
                 skipped: {skipped:?}",
                skipped.len()
            );
        }
        let before = token
            .map(|t| (prefix.to_string(), t))
            .and_then(|k| self.list_progress.lock().get(&k).cloned());
        let progress = list_progress(prefix, before, &page)?;
        if let Some(next) = &page.next_continuation {
            self.list_progress
                .lock()
                .put((prefix.to_string(), next.clone()), progress);
        }
        Ok(page)
    }
}

/// The endpoint the SDK gives an S3 client when bucketfs is given none, resolved as
/// `aws_sdk_s3`'s `From<&SdkConfig>` does: the S3 one (`AWS_ENDPOINT_URL_S3`, a profile's
/// `services` section) before the global one (`AWS_ENDPOINT_URL`, a profile's
/// `endpoint_url`); `None`: AWS's own.
fn sdk_endpoint(sdk: &aws_config::SdkConfig) -> Option<String> {
    if sdk.get_origin("endpoint_url").is_client_config() {
        return sdk.endpoint_url().map(str::to_string);
    }
    let key = aws_types::service_config::ServiceConfigKey::builder()
        .service_id("S3")
        .env("AWS_ENDPOINT_URL")
        .profile("endpoint_url")
        .build()
        .ok()?;
    sdk.service_config()
        .and_then(|c| c.load_config(key))
        .or_else(|| sdk.endpoint_url().map(str::to_string))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::sync::atomic::{AtomicUsize, Ordering as AtomicOrdering};
    use std::sync::Arc;
    use std::time::Instant;

    #[test]
    fn attempt_timeouts_scale_with_the_body() {
        assert_eq!(attempt_timeout(0), ATTEMPT_BASE);
        assert_eq!(
            attempt_timeout(8 * 1024 * 1024),
            ATTEMPT_BASE + Duration::from_secs(8)
        );
        assert!(attempt_timeout(5 << 30) > Duration::from_secs(5 * 1024));
    }

    /// A plain-HTTP server that answers every request after `delay` and records the most
    /// requests it was ever answering at once.
    fn slow_server(delay: Duration) -> (String, Arc<AtomicUsize>) {
        slow_answer(
            delay,
            "HTTP/1.1 200 OK\r\nContent-Length: 3\r\nETag: \"e\"\r\n\r\n".into(),
        )
    }

    /// A plain-HTTP server that answers every request (with no body) with `answer` after
    /// `delay`; also gives the most requests it held at once.
    fn slow_answer(delay: Duration, answer: String) -> (String, Arc<AtomicUsize>) {
        let active = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let seen = most.clone();
        let url = serve(move |conn, _| {
            let now = active.fetch_add(1, AtomicOrdering::SeqCst) + 1;
            most.fetch_max(now, AtomicOrdering::SeqCst);
            std::thread::sleep(delay);
            active.fetch_sub(1, AtomicOrdering::SeqCst);
            conn.write_all(answer.as_bytes())
        });
        (url, seen)
    }

    /// A plain-HTTP server on a thread per connection: `answer` writes the answer to each
    /// request, given its first line (requests have no body: one ends at its blank line).
    fn serve(
        answer: impl Fn(&mut std::net::TcpStream, &str) -> std::io::Result<()> + Send + Sync + 'static,
    ) -> String {
        use std::io::{BufRead, BufReader};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let answer = Arc::new(answer);
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { return };
                let answer = answer.clone();
                std::thread::spawn(move || {
                    let mut reader = BufReader::new(conn.try_clone().unwrap());
                    loop {
                        let (mut line, mut first) = (String::new(), None);
                        loop {
                            line.clear();
                            match reader.read_line(&mut line) {
                                Ok(0) | Err(_) => return,
                                Ok(_) if line == "\r\n" => break,
                                Ok(_) => {
                                    first.get_or_insert_with(|| line.clone());
                                }
                            }
                        }
                        if answer(&mut conn, first.as_deref().unwrap_or_default()).is_err() {
                            return;
                        }
                    }
                });
            }
        });
        url
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn requests_in_flight_never_exceed_max_connections() {
        let (url, most) = slow_server(Duration::from_millis(200));
        let store = store_bounded(url, 3).await;
        // The gauges, sampled while the requests run.
        let slots = store.request_slots();
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let sampler = tokio::spawn({
            let (slots, done) = (slots.clone(), done.clone());
            async move {
                let (mut in_use, mut waiting) = (0, 0);
                while !done.load(AtomicOrdering::SeqCst) {
                    in_use = slots.in_use().max(in_use);
                    waiting = slots.waiting().max(waiting);
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                (in_use, waiting)
            }
        });
        let keys: Vec<String> = (0..12).map(|i| format!("k{i}")).collect();
        let heads = keys.iter().map(|k| store.head(k));
        for r in futures::future::join_all(heads).await {
            assert_eq!(r.unwrap().size, 3);
        }
        done.store(true, AtomicOrdering::SeqCst);
        // 12 requests queued behind 3 slots: the server never saw more than 3 at a time (12
        // without the bound), and more than one (they do run in parallel).
        let most = most.load(AtomicOrdering::SeqCst);
        assert!((2..=3).contains(&most), "{most} requests at once");
        let (in_use, waiting) = sampler.await.unwrap();
        assert_eq!(in_use, 3, "most slots in use");
        assert!(
            (1..=9).contains(&waiting),
            "{waiting} requests waiting at most"
        );
        assert_eq!((slots.in_use(), slots.waiting()), (0, 0), "all settled");
    }

    /// At `--max-connections 16`, 40 HEADs reach the server 18 at a time: the 16 slots and
    /// the 2 spares of metadata requests, never more.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn metadata_requests_take_the_spare_slots_and_no_more() {
        let (url, most) = slow_server(Duration::from_millis(200));
        let store = store_bounded(url, 16).await;
        let keys: Vec<String> = (0..40).map(|i| format!("k{i}")).collect();
        let heads = keys.iter().map(|k| store.head(k));
        for r in futures::future::join_all(heads).await {
            assert_eq!(r.unwrap().size, 3);
        }
        let most = most.load(AtomicOrdering::SeqCst);
        assert_eq!(most, most_connections(16), "requests at once");
        assert_eq!(most, 18);
    }

    /// LIST pages wait for one of a few permits; one-key LISTs (lookups' probes) do not.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn page_lists_in_flight_are_bounded_and_one_key_lists_are_not() {
        let answer = String::from_utf8(answer_with(EMPTY_PAGE.as_bytes())).unwrap();
        for (max_keys, bounded) in [(1000, true), (1, false)] {
            let (url, most) = slow_answer(Duration::from_millis(200), answer.clone());
            let store = plain_store(url).await;
            let lists = (0..24).map(|i| {
                let prefix = format!("p{i}/");
                let store = &store;
                async move {
                    let detail = ListDetail::Plain;
                    store
                        .list(&prefix, Some("/"), ListFrom::Start, max_keys, detail)
                        .await
                }
            });
            for r in futures::future::join_all(lists).await {
                assert!(r.unwrap().objects.is_empty());
            }
            let most = most.load(AtomicOrdering::SeqCst);
            match bounded {
                // 24 without the bound.
                true => assert!((2..=PAGE_LISTS_IN_FLIGHT).contains(&most), "{most} pages"),
                false => assert!(most > PAGE_LISTS_IN_FLIGHT, "{most} one-key LISTs"),
            }
        }
    }

    /// A 400 to a pinned DELETE that is not about the header (an expired token) turned
    /// If-Match off for the rest of the mount and deleted at once without it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_400_that_is_not_about_if_match_keeps_deletes_pinned() {
        let deletes = Arc::new(AtomicUsize::new(0));
        let body = "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>ExpiredToken\
            </Code><Message>The provided token has expired.</Message></Error>";
        let answer = format!(
            "HTTP/1.1 400 Bad Request\r\nContent-Type: application/xml\r\n\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        );
        let url = serve({
            let deletes = deletes.clone();
            move |conn, request| {
                if request.starts_with("DELETE") {
                    deletes.fetch_add(1, AtomicOrdering::SeqCst);
                }
                conn.write_all(answer.as_bytes())
            }
        });
        let store = plain_store(url).await;
        assert!(store.delete_if("k", "\"e\"").await.is_err());
        assert_eq!(
            deletes.load(AtomicOrdering::SeqCst),
            1,
            "deleted without the pin"
        );
        assert!(!store.no_conditional_delete.load(Ordering::Relaxed));
    }

    /// A plain-HTTP server that answers every request with `body` (as XML, status 200).
    fn fixed_server(body: &'static [u8]) -> String {
        fixed_answer(answer_with(body))
    }

    /// A LIST page with no entry.
    const EMPTY_PAGE: &str = "<?xml version=\"1.0\" encoding=\"UTF-8\"?><ListBucketResult \
        xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\"><Name>b</Name><Prefix>p/</Prefix>\
        <KeyCount>0</KeyCount><MaxKeys>1000</MaxKeys><IsTruncated>false</IsTruncated>\
        </ListBucketResult>";

    /// A 200 answer with `body` as XML.
    fn answer_with(body: &[u8]) -> Vec<u8> {
        let head = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: application/xml\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        [head.as_bytes(), body].concat()
    }

    /// A slow link: a GET's answer is a 20-byte body sent a byte every `pause`; a HEAD's
    /// and a LIST's (an empty page) come at once.
    fn trickle_server(pause: Duration) -> String {
        serve(move |conn, request| {
            if request.contains("list-type=2") {
                return conn.write_all(&answer_with(EMPTY_PAGE.as_bytes()));
            }
            conn.write_all(
                b"HTTP/1.1 206 Partial Content\r\nETag: \"e\"\r\n\
                  Content-Range: bytes 0-19/20\r\nContent-Length: 20\r\n\r\n",
            )?;
            if request.starts_with("HEAD") {
                return conn.flush();
            }
            for _ in 0..20 {
                conn.flush()?;
                std::thread::sleep(pause);
                conn.write_all(b"x")?;
            }
            Ok(())
        })
    }

    /// 17 GETs on a slow link hold the 16 slots of `--max-connections 16` and queue: a HEAD
    /// and a LIST page (a lookup) take spare slots and are answered before any transfer
    /// ends.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lookup_never_waits_behind_transfers_filling_every_slot() {
        let url = trickle_server(Duration::from_millis(150));
        let store = Arc::new(store_bounded(url, 16).await);
        let slots = store.request_slots();
        let gets: Vec<_> = (0..17)
            .map(|_| {
                let store = store.clone();
                tokio::spawn(async move { store.get_range("k", 0..20, None).await })
            })
            .collect();
        let t = Instant::now();
        while slots.in_use() < 16 || slots.waiting() < 1 {
            assert!(
                t.elapsed() < Duration::from_secs(3),
                "the GETs never filled the slots"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(
            (slots.in_use(), slots.waiting()),
            (16, 1),
            "a GET took the spare"
        );
        let t = Instant::now();
        let head = store.head("k").await.unwrap();
        let page = store
            .list("d/", Some("/"), ListFrom::Start, 1000, ListDetail::Plain)
            .await
            .unwrap();
        let took = t.elapsed();
        assert_eq!(head.size, 20);
        assert!(page.objects.is_empty());
        // Each GET holds its slot for 3 s.
        let ended = gets.iter().filter(|g| g.is_finished()).count();
        assert_eq!(ended, 0, "the lookup waited for a transfer ({took:?})");
        for g in gets {
            assert_eq!(g.await.unwrap().unwrap(), &[b'x'; 20][..]);
        }
    }

    /// A plain-HTTP server that answers every request with `answer` (status line to body).
    fn fixed_answer(answer: Vec<u8>) -> String {
        serve(move |conn, _| conn.write_all(&answer))
    }

    /// A link slower than the requests queued on it: each GET moves bytes (a 20-byte body,
    /// a byte every 50 ms) but holds the only request slot for a second, so the third waits
    /// two seconds in the queue, four times the stall bound. Waiting behind requests that
    /// move bytes is not a stall: no attempt is cut and every GET gets its bytes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_get_queued_behind_slow_transfers_is_never_cut() {
        let url = trickle_server(Duration::from_millis(50));
        let s3 = store_bounded(url, 1).await;
        let policy = crate::retry::RetryPolicy {
            max_elapsed: Duration::from_millis(500),
            ..Default::default()
        };
        let store = crate::retry::RetryStore::new(Arc::new(s3), policy).cutting_stalls();
        let gets = (0..3).map(|_| store.get_range("k", 0..20, None));
        for r in futures::future::join_all(gets).await {
            assert_eq!(r.unwrap(), &[b'x'; 20][..]);
        }
        let m = store.metrics();
        let stalls = crate::retry::RetryMetrics::get(&m.stalls);
        assert_eq!(stalls, 0, "attempts cut while queued");
    }

    #[tokio::test]
    async fn a_get_answered_with_another_version_fails_instead_of_mixing_versions() {
        let answer = b"HTTP/1.1 206 Partial Content\r\nETag: \"new\"\r\n\
            Content-Range: bytes 0-3/4\r\nContent-Length: 4\r\n\r\nabcd";
        let store = plain_store(fixed_answer(answer.to_vec())).await;
        let e = store
            .get_range("k", 0..4, Some("\"old\""))
            .await
            .unwrap_err();
        assert!(matches!(e, StoreError::PreconditionFailed(_)), "{e:?}");
        // The version asked for, with or without quotes, or no version asked: the bytes.
        for want in [Some("\"new\""), Some("new"), Some("NEW"), None] {
            assert_eq!(
                &store.get_range("k", 0..4, want).await.unwrap()[..],
                b"abcd"
            );
        }
    }

    /// A store (or proxy) that ignores Range answers 200 with the whole object: its bytes
    /// start at 0, not where asked, and are more than asked. Refused, never handed on (before:
    /// a read at 100 got the object's first bytes, and a huge object was buffered whole).
    #[tokio::test]
    async fn a_get_whose_range_is_ignored_fails() {
        let mut answer = b"HTTP/1.1 200 OK\r\nETag: \"e\"\r\nContent-Length: 1000\r\n\r\n".to_vec();
        answer.extend((0..1000u32).map(|i| (i % 251) as u8));
        let store = plain_store(fixed_answer(answer)).await;
        for range in [100..110, 0..10] {
            let e = store.get_range("k", range.clone(), None).await.unwrap_err();
            assert!(matches!(e, StoreError::Other(_)), "{range:?}: {e:?}");
            let mut dst = [0u8; 10];
            let e = store
                .get_range_into("k", range.clone(), None, &mut dst)
                .await
                .unwrap_err();
            assert!(matches!(e, StoreError::Other(_)), "{range:?}: {e:?}");
        }
        // The whole object asked for: its bytes.
        assert_eq!(
            store.get_range("k", 0..1000, None).await.unwrap().len(),
            1000
        );
    }

    /// A LIST answered with the continuation token it was given (a gateway's bug) would be
    /// read again for ever (`ls` hung, and a rename of the directory with it): an error.
    #[tokio::test]
    async fn a_list_that_answers_a_token_with_itself_fails() {
        let body = "<?xml version=\"1.0\" encoding=\"UTF-8\"?><ListBucketResult><Name>b</Name>\
            <Prefix>d/</Prefix><KeyCount>1</KeyCount><MaxKeys>1000</MaxKeys><IsTruncated>true\
            </IsTruncated><NextContinuationToken>t1</NextContinuationToken><Contents><Key>d/a\
            </Key><Size>1</Size></Contents></ListBucketResult>";
        let store = plain_store(fixed_server(body.as_bytes())).await;
        let first = store
            .list("d/", Some("/"), ListFrom::Start, 1000, ListDetail::Plain)
            .await
            .unwrap();
        assert_eq!(first.next_continuation.as_deref(), Some("t1"));
        let again = store.list(
            "d/",
            Some("/"),
            ListFrom::Token("t1".into()),
            1000,
            ListDetail::Plain,
        );
        let e = tokio::time::timeout(Duration::from_secs(10), again)
            .await
            .unwrap()
            .unwrap_err();
        assert!(matches!(e, StoreError::Other(_)), "{e:?}");
        // The same for the multipart uploads a start recovers (before: a loop that never
        // ended, growing its list).
        let body = "<?xml version=\"1.0\" encoding=\"UTF-8\"?><ListMultipartUploadsResult>\
            <Bucket>b</Bucket><KeyMarker>a</KeyMarker><UploadIdMarker>u</UploadIdMarker>\
            <NextKeyMarker>a</NextKeyMarker><NextUploadIdMarker>u</NextUploadIdMarker>\
            <IsTruncated>true</IsTruncated><Upload><Key>a</Key><UploadId>u</UploadId></Upload>\
            </ListMultipartUploadsResult>";
        let store = plain_store(fixed_server(body.as_bytes())).await;
        let uploads = store.list_multipart_uploads("");
        let e = tokio::time::timeout(Duration::from_secs(10), uploads)
            .await
            .expect("a loop that never ends")
            .unwrap_err();
        assert!(matches!(e, StoreError::Other(_)), "{e:?}");
    }

    /// A gateway whose continuation tokens do not go on: each answer is the first page
    /// again under a new token, or a page of nothing under a new token, for ever; or a
    /// truncated page comes without a token. Each fails (the first when its token leads
    /// back, the second after 10,000 empty pages) instead of listing for ever, or (the
    /// third) of being taken for the last page. Before: only a token answered with itself
    /// was caught, and the third ended the listing there.
    #[tokio::test]
    async fn a_list_whose_tokens_do_not_go_on_fails() {
        let page = |keys: &str, token: Option<String>| {
            let next = token.map_or(String::new(), |t| {
                format!("<NextContinuationToken>{t}</NextContinuationToken>")
            });
            format!(
                "<?xml version=\"1.0\" encoding=\"UTF-8\"?><ListBucketResult><Name>b</Name>\
                 <Prefix>d/</Prefix><MaxKeys>1000</MaxKeys><IsTruncated>true</IsTruncated>\
                 {next}{keys}</ListBucketResult>"
            )
        };
        let two = "<Contents><Key>d/a</Key><Size>1</Size></Contents><Contents><Key>d/b</Key>\
                   <Size>1</Size></Contents>";
        for (keys, want_pages) in [(two, 2), ("", 10_001)] {
            let n = Arc::new(AtomicUsize::new(0));
            let url = serve({
                let n = n.clone();
                move |conn, _| {
                    let i = n.fetch_add(1, AtomicOrdering::SeqCst);
                    conn.write_all(&answer_with(page(keys, Some(format!("t{i}"))).as_bytes()))
                }
            });
            let store = plain_store(url).await;
            let walk = async {
                let mut from = ListFrom::Start;
                loop {
                    let p = store
                        .list("d/", Some("/"), from, 1000, ListDetail::Plain)
                        .await?;
                    match p.next_continuation {
                        Some(t) => from = ListFrom::Token(t),
                        None => return Ok(()),
                    }
                }
            };
            let e: StoreError = tokio::time::timeout(Duration::from_secs(60), walk)
                .await
                .expect("a listing that never ends")
                .unwrap_err();
            assert!(matches!(e, StoreError::Other(_)), "{e:?}");
            assert_eq!(n.load(AtomicOrdering::SeqCst), want_pages, "{e:?}");
        }
        let body = page(two, None);
        let store = plain_store(fixed_server(Box::leak(body.into_boxed_str()).as_bytes())).await;
        let e = store
            .list("d/", Some("/"), ListFrom::Start, 1000, ListDetail::Plain)
            .await
            .unwrap_err();
        assert!(matches!(e, StoreError::Other(_)), "{e:?}");
    }

    /// Tags go out as `x-amz-tagging` query pairs: every key and value URL-encoded but the
    /// unreserved characters (a `+` sent bare would come back a space), none for none.
    #[test]
    fn tags_are_sent_url_encoded() {
        use aws_sdk_s3::types::Tag;
        let tag = |k: &str, v: &str| Tag::builder().key(k).value(v).build().unwrap();
        assert_eq!(
            encode_tagging(&[tag("cost centre", "ml/a+b:1"), tag("k-1_.~", "v=é")]).as_deref(),
            Some("cost%20centre=ml%2Fa%2Bb%3A1&k-1_.~=v%3D%C3%A9")
        );
        assert_eq!(encode_tagging(&[]), None);
    }

    /// No request has a read timeout: the SDK's runs to the answer's head, which S3 sends
    /// after the whole body or copy, so it cut any upload or copy longer than it (60 s: a
    /// 64 MiB part under 1.1 MiB/s, a multi-GiB copy on MinIO) whatever its attempt limit.
    #[test]
    fn no_request_has_a_read_timeout() {
        for attempt in [
            ATTEMPT_BASE,
            attempt_timeout(1 << 30),
            Duration::from_secs(600),
        ] {
            let t = timeouts(attempt);
            assert_eq!(t.read_timeout(), None, "{attempt:?}");
            assert_eq!(t.operation_attempt_timeout(), Some(attempt));
        }
    }

    /// An HTTPS endpoint that accepts each connection and closes it during the handshake (a
    /// load balancer with no backend): transient, ridden out by the retries. Before: taken
    /// for a certificate problem, permanent, every call failed at once.
    #[tokio::test]
    async fn a_handshake_cut_by_the_peer_is_transient() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("https://{}", listener.local_addr().unwrap());
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                drop(conn);
            }
        });
        let store = plain_store(url).await;
        let e = store.head("k").await.unwrap_err();
        assert!(e.is_transient(), "{e:?}");
    }

    /// `--no-verify-ssl` against a server that accepts TCP and never answers the TLS
    /// handshake (a load balancer without a backend): the connection is given up within the
    /// 10 s connect timeout, handshake included (before: only the TCP handshake was bounded,
    /// and the socket stayed until the attempt's 30 s cut, or for ever when hyper finished the
    /// connect in the background).
    #[tokio::test]
    async fn a_tls_handshake_never_answered_is_given_up_within_the_connect_timeout() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("https://{}", listener.local_addr().unwrap());
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            let accepted = std::time::Instant::now();
            let mut buf = [0u8; 4096];
            // The client hello, then nothing until the client closes.
            while matches!(std::io::Read::read(&mut conn, &mut buf), Ok(n) if n > 0) {}
            let _ = tx.send(accepted.elapsed());
            // Further connections (a retry) are held open, never answered.
            for c in listener.incoming() {
                std::mem::forget(c);
            }
        });
        let store = S3Store::new(&S3Config {
            tls: crate::tls::TlsTrust::Insecure,
            ..plain_config(url)
        })
        .await
        .unwrap();
        let head = tokio::spawn(async move { store.head("k").await });
        let closed = tokio::task::spawn_blocking(move || rx.recv_timeout(Duration::from_secs(20)))
            .await
            .unwrap()
            .expect("the connection was not closed within 20 s");
        assert!(closed < Duration::from_secs(15), "closed after {closed:?}");
        head.abort();
    }

    /// `409 ConditionalRequestConflict` (a conditional write racing another; AWS says to
    /// retry it) is transient; `501 NotImplemented` (a conditional header the store does not
    /// have) is not: no retry makes it.
    #[tokio::test]
    async fn a_conditional_conflict_is_retried_and_a_missing_feature_is_not() {
        let answer = |status: &str, code: &str| {
            let body = format!("<Error><Code>{code}</Code><Message>m</Message></Error>");
            format!(
                "HTTP/1.1 {status}\r\nContent-Type: application/xml\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
            .into_bytes()
        };
        let store = plain_store(fixed_answer(answer(
            "409 Conflict",
            "ConditionalRequestConflict",
        )))
        .await;
        let e = store
            .put_if(
                "k",
                Bytes::from_static(b"x"),
                &UserMeta::new(),
                Some("\"e\""),
                None,
            )
            .await
            .unwrap_err();
        assert!(e.is_transient(), "{e:?}");
        let store = plain_store(fixed_answer(answer(
            "501 Not Implemented",
            "NotImplemented",
        )))
        .await;
        let e = store
            .put_if(
                "k",
                Bytes::from_static(b"x"),
                &UserMeta::new(),
                Some("\"e\""),
                None,
            )
            .await
            .unwrap_err();
        assert!(!e.is_transient(), "{e:?}");
    }

    /// A store on the plain-HTTP test server at `url`, one attempt per request.
    async fn plain_store(url: String) -> S3Store {
        S3Store::new(&plain_config(url)).await.unwrap()
    }

    /// [`plain_store`] with `--max-connections max`.
    async fn store_bounded(url: String, max: usize) -> S3Store {
        S3Store::new(&S3Config {
            max_connections: max,
            ..plain_config(url)
        })
        .await
        .unwrap()
    }

    /// A store at `url` with fixed credentials and no retries of the SDK's own.
    fn plain_config(url: String) -> S3Config {
        S3Config {
            bucket: "b".into(),
            endpoint_url: Some(url),
            region: Some("us-east-1".into()),
            force_path_style: true,
            access_key_id: Some("k".into()),
            secret_access_key: Some("s".into()),
            max_attempts: 1,
            ..S3Config::default()
        }
    }

    async fn list_from(body: &'static [u8]) -> StoreResult<ListPage> {
        let store = plain_store(fixed_server(body)).await;
        store
            .list("d/", Some("/"), ListFrom::Start, 1000, ListDetail::Plain)
            .await
    }

    fn keys(p: &ListPage) -> Vec<&str> {
        p.objects.iter().map(|o| o.key.as_str()).collect()
    }

    /// A store that ignores `encoding-type=url` and sends control characters raw (XML 1.0
    /// cannot carry them): the page is read whole, with those keys exact.
    #[tokio::test]
    async fn a_listing_with_raw_control_characters_is_read_whole() {
        let page = list_from(
            b"<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<ListBucketResult><Name>b</Name>\
              <Prefix>d/</Prefix><IsTruncated>false</IsTruncated>\
              <Contents><Key>d/a</Key><Size>1</Size></Contents>\
              <Contents><Key>d/b\x08\x0b\x0c\x0e\x1b\x1f</Key><Size>2</Size></Contents>\
              <Contents><Key>d/c%41+</Key><Size>3</Size></Contents>\
              <CommonPrefixes><Prefix>d/s\x1b/</Prefix></CommonPrefixes></ListBucketResult>",
        )
        .await
        .unwrap();
        assert_eq!(
            keys(&page),
            ["d/a", "d/b\x08\x0b\x0c\x0e\x1b\x1f", "d/c%41+"]
        );
        assert_eq!(page.objects[1].size, 2);
        assert_eq!(page.common_prefixes, ["d/s\x1b/"]);
    }

    /// A url-encoded page: every key and prefix decoded; one key that decodes to bytes no
    /// key can hold (not UTF-8) is skipped, and the rest of the page is there.
    #[tokio::test]
    async fn a_url_encoded_listing_is_decoded_and_a_bad_key_skipped() {
        let page = list_from(
            b"<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<ListBucketResult><Name>b</Name>\
              <Prefix>d%2F</Prefix><IsTruncated>true</IsTruncated>\
              <NextContinuationToken>t+%2F</NextContinuationToken>\
              <Contents><Key>d/a%08b%0Bc%1Fd</Key><Size>1</Size></Contents>\
              <Contents><Key>d/bad%FF</Key><Size>1</Size></Contents>\
              <Contents><Key>d/sp+ace%2Bplus%25</Key><Size>1</Size></Contents>\
              <CommonPrefixes><Prefix>d/sub%1B/</Prefix></CommonPrefixes>\
              <EncodingType>url</EncodingType></ListBucketResult>",
        )
        .await
        .unwrap();
        assert_eq!(keys(&page), ["d/a\x08b\x0bc\x1fd", "d/sp ace+plus%"]);
        assert_eq!(page.common_prefixes, ["d/sub\x1b/"]);
        // The token is opaque, never encoded.
        assert_eq!(page.next_continuation.as_deref(), Some("t+%2F"));
    }

    #[test]
    fn copy_source_encodes_specials() {
        assert_eq!(copy_source("b", "a b/c%+?#"), "b/a%20b/c%25%2B%3F%23");
        assert_eq!(copy_source("b", "é"), "b/%C3%A9");
    }
}
