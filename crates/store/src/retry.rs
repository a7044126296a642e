//! Retries of transient store failures: exponential backoff with jitter, bounded in time, with
//! an outage breaker so that a store that stays down makes calls fail fast instead of each one
//! waiting out the whole budget.
//!
//! [`RetryStore`] wraps any [`ObjectStore`]. A call that fails with [`StoreError::Transient`]
//! (5xx, `SlowDown`, request timeouts, refused or reset connections, a body cut off
//! mid-transfer) is tried again after `min(max_backoff, initial_backoff * 2^n)`, of which the
//! upper half is random ("equal jitter"), until it succeeds, fails with a permanent error, has
//! made `max_attempts` attempts, or its deadline passes. The deadline is one per file-system
//! operation (see [`crate::liveness`]): `max_elapsed` after the later of the operation's start
//! and the store's last progress (a byte moved, an answer's head, a success, by any request).
//! So a slow store that moves bytes is waited for, a stalled one fails every call of a syscall
//! within `max_elapsed` of its start, and an attempt that moves no byte of its own for
//! `max_elapsed` is cut and tried again. Permanent errors (403, 404, 412, 400, out of space)
//! are returned at once.
//!
//! **Outage breaker.** Every success clears the breaker. When the store has made no progress
//! for `max_elapsed`, or has failed for that long without a success, an outage is declared:
//! attempts waiting on it stop, new calls fail at once, and a probe task sends a one-key LIST
//! every [`PROBE_INTERVAL`] until one is answered, which closes the outage. So a dead or
//! stalled endpoint costs each syscall at most `max_elapsed`, and every call after that
//! nothing, while a restart that takes less than `max_elapsed` is ridden out invisibly. The
//! start and the end of an outage are logged once each.
//!
//! **Idempotency.** Every store operation is safe to repeat (PUT, UploadPart, CopyObject and
//! DELETE of the same request give the same result), except CompleteMultipartUpload: when an
//! attempt completed the upload but its answer was lost, the repeat gets `NoSuchUpload`. The
//! wrapper then HEADs the key and accepts the object only if its ETag is the multipart ETag of
//! exactly the parts it completed (`md5(md5(part 1) ‖ … ‖ md5(part n))-n`); otherwise it
//! reports the original transient error, so the caller never believes in an object that is not
//! the one it uploaded. A conditional PUT or CompleteMultipartUpload (`If-Match`) whose first
//! attempt landed and lost its answer gets `PreconditionFailed` on the repeat (the object now
//! has the new ETag): the same HEAD tells that apart from another writer's version, and so
//! does, by its metadata, a copy of an object onto itself pinned to its ETag (a chmod). An
//! attempt this layer cut counts as one whose answer was lost. A
//! CreateMultipartUpload whose answer was lost leaves an upload the
//! caller never learns about; see `docs/reliability.md`.

use crate::liveness::{operation_start, AttemptProgress, Clock};
use crate::*;
use async_trait::async_trait;
use bytes::Bytes;
use md5::{Digest, Md5};
use parking_lot::Mutex;
use rand::Rng;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// How long and how often to retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// The stall bound (`--retry-timeout`): a call fails once neither it nor any other
    /// request to the store has made progress for this long since the operation it serves
    /// started, and an attempt is cut after this long without a byte of its own. Zero: no
    /// retries, no bound of our own (the backend's timeouts only) and no breaker.
    pub max_elapsed: Duration,
    /// Backoff before the second attempt (before jitter); doubles after each attempt.
    pub initial_backoff: Duration,
    /// Largest backoff between two attempts.
    pub max_backoff: Duration,
    /// Most attempts of one call, the first included.
    pub max_attempts: u32,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_elapsed: Duration::from_secs(30),
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(4),
            max_attempts: 25,
        }
    }
}

/// Longest wait for an answer to a probe of a store the breaker has found down.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(5);
/// Pause between two probes.
pub const PROBE_INTERVAL: Duration = Duration::from_secs(1);

impl RetryPolicy {
    /// A policy that never retries.
    pub fn none() -> Self {
        Self {
            max_elapsed: Duration::ZERO,
            max_attempts: 1,
            ..Self::default()
        }
    }

    /// The backoff before attempt `attempt + 1` (1-based `attempt` just failed), jittered:
    /// half of it fixed, half random.
    pub fn backoff(&self, attempt: u32) -> Duration {
        let exp = self.initial_backoff.saturating_mul(
            1u32.checked_shl(attempt.saturating_sub(1))
                .unwrap_or(u32::MAX),
        );
        let cap = exp.min(self.max_backoff);
        let half = cap / 2;
        let jitter = rand::thread_rng().gen_range(0..=half.as_micros() as u64);
        half + Duration::from_micros(jitter)
    }

    /// How long a probe of a store found down may wait for its answer.
    pub fn probe_timeout(&self) -> Duration {
        self.max_elapsed.min(PROBE_TIMEOUT)
    }
}

/// Counters of what the retry layer did.
#[derive(Debug, Default)]
pub struct RetryMetrics {
    /// Attempts made after a transient failure.
    pub retries: AtomicU64,
    /// Calls that failed with a transient error after exhausting their budget.
    pub gave_up: AtomicU64,
    /// Calls that failed on their first attempt, then succeeded on a retry.
    pub recovered: AtomicU64,
    /// Outages: the store made no progress for `max_elapsed` while calls waited on it, or
    /// failed for that long without a success.
    pub outages: AtomicU64,
    /// Calls that failed at once because an outage was in progress.
    pub fast_failed: AtomicU64,
    /// Attempts cut for making no progress.
    pub stalls: AtomicU64,
}

impl RetryMetrics {
    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }
}

#[derive(Debug, Default)]
struct Breaker {
    /// When the current run of failures started (None: the last call succeeded).
    failing_since: Option<Instant>,
    /// When the outage in progress was declared (None: the store is taken to be up).
    outage: Option<Instant>,
    /// A probe task is running.
    probing: bool,
}

/// What the retry layer shares with its probe task.
struct Shared {
    breaker: Mutex<Breaker>,
    /// The last progress of any request (a body byte, an answer's head, a success).
    progress: Arc<Clock>,
    /// Woken when an outage is declared: attempts in flight stop waiting.
    opened: Notify,
    metrics: Arc<RetryMetrics>,
    describe: String,
}

impl Shared {
    fn succeeded(&self) {
        self.progress.tick();
        let mut b = self.breaker.lock();
        b.failing_since = None;
        if let Some(since) = b.outage.take() {
            tracing::warn!(
                "{}: reachable again after {:.1} s of outage",
                self.describe,
                since.elapsed().as_secs_f64()
            );
        }
    }

    fn in_outage(&self) -> bool {
        self.breaker.lock().outage.is_some()
    }
}

pub struct RetryStore<S: ?Sized = dyn ObjectStore> {
    inner: Arc<S>,
    policy: RetryPolicy,
    shared: Arc<Shared>,
    /// Attempts are watched for progress and cut when they make none (see
    /// [`RetryStore::cutting_stalls`]).
    cut_stalls: bool,
}

/// Why an attempt was cut.
enum Cut {
    /// No progress of the store for the budget since the operation started.
    Stalled,
    /// No byte of this attempt for the budget (while other requests made progress).
    Idle,
    /// An outage was declared while it waited.
    Outage,
}

impl<S: ObjectStore + ?Sized> RetryStore<S> {
    pub fn new(inner: Arc<S>, policy: RetryPolicy) -> Self {
        let describe = inner.describe();
        Self {
            inner,
            policy,
            shared: Arc::new(Shared {
                breaker: Mutex::new(Breaker::default()),
                progress: Arc::new(Clock::new()),
                opened: Notify::new(),
                metrics: Arc::new(RetryMetrics::default()),
                describe,
            }),
            cut_stalls: false,
        }
    }

    /// Cuts attempts that make no progress: for a store that reports the bytes it moves
    /// ([`crate::liveness`]; the S3 backend does). A store that does not (a local directory)
    /// would have every long request taken for a stall.
    pub fn cutting_stalls(mut self) -> Self {
        self.cut_stalls = true;
        self
    }

    pub fn metrics(&self) -> Arc<RetryMetrics> {
        self.shared.metrics.clone()
    }

    pub fn policy(&self) -> RetryPolicy {
        self.policy
    }

    /// When a call of the operation that started at `start` fails for lack of progress:
    /// the budget after the later of that start and the store's last progress.
    fn deadline(&self, start: Instant) -> Instant {
        start.max(self.shared.progress.last()) + self.policy.max_elapsed
    }

    /// Records a transient failure; declares an outage when the store has made no progress
    /// for the budget (`stalled`) or has failed for that long without a success. Returns
    /// whether an outage is in progress.
    fn failed(&self, e: &StoreError, stalled: bool) -> bool {
        let mut b = self.shared.breaker.lock();
        let since = *b.failing_since.get_or_insert_with(Instant::now);
        if b.outage.is_none() && (stalled || since.elapsed() > self.policy.max_elapsed) {
            b.outage = Some(Instant::now());
            self.shared.metrics.outages.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                "{}: no progress for {:.1} s ({e}); calls now fail at once until a probe \
                 gets an answer",
                self.shared.describe,
                self.policy.max_elapsed.as_secs_f64()
            );
            if stalled {
                // Nothing moved for the budget: no attempt in flight is making progress.
                self.shared.opened.notify_waiters();
            }
            if !b.probing {
                b.probing = true;
                tokio::spawn(probe(
                    Arc::downgrade(&self.shared),
                    self.inner.clone(),
                    self.policy.probe_timeout(),
                ));
            }
        }
        b.outage.is_some()
    }

    /// Runs one attempt, cut when the store has made no progress for the budget since
    /// `start`, when the attempt has moved no byte for the budget, or when an outage is
    /// declared.
    async fn attempt<T>(
        &self,
        start: Instant,
        fut: impl Future<Output = StoreResult<T>>,
    ) -> Result<StoreResult<T>, Cut> {
        let progress = AttemptProgress::new(self.shared.progress.clone());
        if !self.cut_stalls {
            return Ok(progress.scope(fut).await);
        }
        let opened = self.shared.opened.notified();
        tokio::pin!(opened);
        let run = progress.scope(fut);
        tokio::pin!(run);
        loop {
            let stall_at = self.deadline(start);
            // Queued behind other requests, the attempt waits for them, not for the store:
            // only the store's stall bound applies.
            let idle_at = match progress.is_queued() {
                true => stall_at,
                false => progress.own.last() + self.policy.max_elapsed,
            };
            let now = Instant::now();
            if now >= stall_at {
                return Err(Cut::Stalled);
            }
            if now >= idle_at {
                return Err(Cut::Idle);
            }
            tokio::select! {
                r = &mut run => return Ok(r),
                _ = &mut opened => return Err(Cut::Outage),
                // Progress may have moved both, and the queue wait may have ended: look again.
                _ = tokio::time::sleep_until(stall_at.min(idle_at).into()) => {}
            }
        }
    }

    /// Runs `call` until it succeeds, fails permanently, or the operation's budget is spent.
    async fn retry<T, F, Fut>(&self, what: &str, mut call: F) -> StoreResult<T>
    where
        F: FnMut() -> Fut + Send,
        Fut: Future<Output = StoreResult<T>> + Send,
        T: Send,
    {
        if self.policy.max_elapsed.is_zero() {
            return call().await;
        }
        let begun = Instant::now();
        let mut start = operation_start().unwrap_or(begun).min(begun);
        if self.deadline(start) <= begun {
            // The operation spent its budget waiting for something else than the store (a
            // lock, room for a write-back), which was asked nothing meanwhile: not a stall.
            // This call has a budget of its own.
            start = begun;
        }
        if self.shared.in_outage() {
            self.shared
                .metrics
                .fast_failed
                .fetch_add(1, Ordering::Relaxed);
            return Err(StoreError::Transient(format!(
                "{what}: {} made no progress for {} s; failing at once until it answers",
                self.shared.describe,
                self.policy.max_elapsed.as_secs_f64()
            )));
        }
        let mut first_failure = None;
        let mut attempt = 1u32;
        loop {
            let result = match self.attempt(start, call()).await {
                Ok(r) => r,
                Err(cut) => {
                    let why = match cut {
                        Cut::Stalled => format!(
                            "no progress for {} s",
                            self.policy.max_elapsed.as_secs_f64()
                        ),
                        Cut::Idle => format!(
                            "no byte for {} s on this request",
                            self.policy.max_elapsed.as_secs_f64()
                        ),
                        Cut::Outage => "the store is in an outage".to_string(),
                    };
                    self.shared.metrics.stalls.fetch_add(1, Ordering::Relaxed);
                    Err(StoreError::Transient(format!("{what}: cut: {why}")))
                }
            };
            match result {
                Ok(v) => {
                    self.shared.succeeded();
                    if attempt > 1 {
                        self.shared
                            .metrics
                            .recovered
                            .fetch_add(1, Ordering::Relaxed);
                        tracing::debug!("{what}: succeeded on attempt {attempt}");
                    }
                    return Ok(v);
                }
                Err(e) if e.is_transient() => {
                    let now = Instant::now();
                    let wait = self.policy.backoff(attempt);
                    // No time left for another attempt before the deadline: the store has
                    // made no progress for (all but a backoff of) the budget.
                    let stalled = now + wait >= self.deadline(start);
                    let outage = self.failed(&e, stalled);
                    let failing = *first_failure.get_or_insert(now);
                    let out_of_budget = outage
                        || attempt >= self.policy.max_attempts
                        || failing.elapsed() + wait > self.policy.max_elapsed
                        || now + wait >= self.deadline(start);
                    if out_of_budget {
                        self.shared.metrics.gave_up.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(
                            "{what}: giving up after {attempt} attempt(s) in {:.1} s: {e}",
                            begun.elapsed().as_secs_f64()
                        );
                        return Err(e);
                    }
                    tracing::debug!(
                        "{what}: attempt {attempt} failed ({e}); retrying in {} ms",
                        wait.as_millis()
                    );
                    self.shared.metrics.retries.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(wait).await;
                    attempt += 1;
                }
                Err(e) => {
                    // A permanent answer is still an answer: the store is reachable.
                    self.shared.succeeded();
                    return Err(e);
                }
            }
        }
    }
}

/// What the attempts of one write said so far, for [`RetryStore::lost_answer`].
#[derive(Default)]
struct Attempts {
    /// The first sign that an attempt may have landed without its answer: a transient
    /// failure, or an attempt this layer cut (the store may have done it and held the answer).
    lost: Mutex<Option<StoreError>>,
    started: std::sync::atomic::AtomicBool,
}

impl Attempts {
    /// An attempt begins: one before it ended without an answer (only a transient failure or
    /// a cut is retried).
    fn begin(&self) {
        if self.started.swap(true, Ordering::Relaxed) {
            self.lost.lock().get_or_insert_with(|| {
                StoreError::Transient("an earlier attempt got no answer".into())
            });
        }
    }

    /// Remembers the first transient failure of the attempts.
    fn ended<T>(&self, r: &StoreResult<T>) {
        if let Err(e) = r {
            if e.is_transient() {
                self.lost.lock().get_or_insert_with(|| e.clone());
            }
        }
    }
}

impl<S: ObjectStore + ?Sized> RetryStore<S> {
    /// A write to `key` ended in `r` (not found, or a failed precondition) after an earlier
    /// attempt failed transiently or was cut (`attempts`): that attempt may have landed and
    /// lost its answer. It did if the object now has `expected`, the ETag our request gives
    /// it; otherwise the original failure stands (transient), or `r` when no attempt failed
    /// before, or when the object has another client's version.
    async fn lost_answer(
        &self,
        what: &str,
        key: &str,
        attempts: &Attempts,
        expected: Option<String>,
        r: StoreResult<String>,
    ) -> StoreResult<String> {
        let Some(lost) = attempts.lost.lock().take() else {
            return r; // no attempt failed before: the answer stands
        };
        let Err(now) = r else {
            return r;
        };
        let found = match self.head(key).await {
            Ok(obj) => obj.etag,
            // Gone: not ours either.
            Err(StoreError::NotFound(_)) => None,
            Err(e) => {
                // Whether our attempt landed is not known: not a conflict.
                tracing::warn!(
                    "{what}: an attempt failed ({lost}), the retry said {now}, and the object \
                     could not be checked ({e}): reported as failed"
                );
                return Err(lost);
            }
        };
        let same = |a: &str, b: &str| a.eq_ignore_ascii_case(b);
        match found {
            Some(etag) if expected.as_deref().is_some_and(|e| same(e, &etag)) => {
                tracing::info!(
                    "{what}: the answer to an attempt was lost ({lost}), but the object has \
                     the ETag of our request: done"
                );
                Ok(etag)
            }
            _ => {
                tracing::warn!(
                    "{what}: an attempt failed ({lost}) and the retry said {now}; the object \
                     does not carry our request's ETag, so the write is reported as failed"
                );
                Err(match now {
                    // Another writer's version: a conflict, whatever happened before.
                    StoreError::PreconditionFailed(_) => now,
                    _ => lost,
                })
            }
        }
    }
}

/// Asks a store found down for the smallest listing, every [`PROBE_INTERVAL`], until any
/// answer comes (an error such as 403 is an answer too): that ends the outage. One probe at
/// a time, each cut after `timeout`; stops when the retry layer is gone.
async fn probe<S: ObjectStore + ?Sized>(
    shared: std::sync::Weak<Shared>,
    inner: Arc<S>,
    timeout: Duration,
) {
    loop {
        {
            let Some(sh) = shared.upgrade() else { return };
            let mut b = sh.breaker.lock();
            if b.outage.is_none() {
                b.probing = false;
                return;
            }
        }
        tokio::time::sleep(PROBE_INTERVAL).await;
        let r = tokio::time::timeout(
            timeout,
            inner.list("", Some("/"), ListFrom::Start, 1, ListDetail::Plain),
        )
        .await;
        let Some(sh) = shared.upgrade() else { return };
        match r {
            Ok(Ok(_)) => sh.succeeded(),
            Ok(Err(e)) if !e.is_transient() => sh.succeeded(),
            Ok(Err(e)) => tracing::debug!("{}: probe failed: {e}", sh.describe),
            Err(_) => tracing::debug!(
                "{}: probe got no answer in {:.1} s",
                sh.describe,
                timeout.as_secs_f64()
            ),
        }
    }
}

/// The ETag S3 gives an object completed from parts with these ETags (MD5s, quoted or not):
/// `"md5(md5(p1) ‖ … ‖ md5(pn))-n"`. `None` when a part ETag is not a plain MD5.
pub fn multipart_etag(parts: &[CompletedPart]) -> Option<String> {
    let mut h = Md5::new();
    for p in parts {
        let raw = hex::decode(p.etag.trim_matches('"')).ok()?;
        if raw.len() != 16 {
            return None;
        }
        h.update(&raw);
    }
    Some(format!("\"{}-{}\"", hex::encode(h.finalize()), parts.len()))
}

#[async_trait]
impl<S: ObjectStore + ?Sized> crate::layer::StoreLayer for RetryStore<S> {
    type Inner = S;
    fn inner(&self) -> &S {
        &self.inner
    }

    async fn head(&self, key: &str) -> StoreResult<ObjectMeta> {
        self.retry(&format!("HEAD {key}"), || self.inner.head(key))
            .await
    }

    async fn get_range(
        &self,
        key: &str,
        range: Range<u64>,
        if_match: Option<&str>,
    ) -> StoreResult<Bytes> {
        self.retry(&format!("GET {key} {range:?}"), || {
            self.inner.get_range(key, range.clone(), if_match)
        })
        .await
    }

    async fn get_range_into(
        &self,
        key: &str,
        range: Range<u64>,
        if_match: Option<&str>,
        dst: &mut [u8],
    ) -> StoreResult<usize> {
        // Every attempt needs `dst`: an uncontended lock lends it to one attempt at a time.
        let dst = tokio::sync::Mutex::new(dst);
        self.retry(&format!("GET {key} {range:?}"), || async {
            let mut d = dst.lock().await;
            self.inner
                .get_range_into(key, range.clone(), if_match, &mut d)
                .await
        })
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
        let what = format!("PUT {key}");
        let attempts = Attempts::default();
        let r = self
            .retry(&what, || async {
                attempts.begin();
                let r = self
                    .inner
                    .put_if(key, body.clone(), meta, if_match, headers_from)
                    .await;
                attempts.ended(&r);
                r
            })
            .await;
        if !matches!(r, Err(StoreError::PreconditionFailed(_))) {
            return r;
        }
        // A single PUT's ETag is the MD5 of its body (on stores that say so).
        let ours = format!("\"{}\"", hex::encode(Md5::digest(&body)));
        self.lost_answer(&what, key, &attempts, Some(ours), r).await
    }

    async fn create_multipart(
        &self,
        key: &str,
        meta: &UserMeta,
        headers_from: Option<HeadersFrom<'_>>,
    ) -> StoreResult<String> {
        self.retry(&format!("CreateMultipartUpload {key}"), || {
            self.inner.create_multipart(key, meta, headers_from)
        })
        .await
    }

    async fn upload_part(
        &self,
        key: &str,
        upload_id: &str,
        part_number: u32,
        body: Bytes,
    ) -> StoreResult<String> {
        self.retry(&format!("UploadPart {key} #{part_number}"), || {
            self.inner
                .upload_part(key, upload_id, part_number, body.clone())
        })
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
        self.retry(&format!("UploadPartCopy {key} #{part_number}"), || {
            self.inner.upload_part_copy(
                key,
                upload_id,
                part_number,
                src_key,
                range.clone(),
                src_if_match,
            )
        })
        .await
    }

    async fn complete_multipart(
        &self,
        key: &str,
        upload_id: &str,
        parts: &[CompletedPart],
        if_match: Option<&str>,
    ) -> StoreResult<String> {
        let what = format!("CompleteMultipartUpload {key}");
        let attempts = Attempts::default();
        let r = self
            .retry(&what, || async {
                attempts.begin();
                let r = self
                    .inner
                    .complete_multipart(key, upload_id, parts, if_match)
                    .await;
                attempts.ended(&r);
                r
            })
            .await;
        if !matches!(
            r,
            Err(StoreError::NotFound(_) | StoreError::PreconditionFailed(_))
        ) {
            return r;
        }
        self.lost_answer(&what, key, &attempts, multipart_etag(parts), r)
            .await
    }

    async fn abort_multipart(&self, key: &str, upload_id: &str) -> StoreResult<()> {
        self.retry(&format!("AbortMultipartUpload {key}"), || {
            self.inner.abort_multipart(key, upload_id)
        })
        .await
    }

    async fn list_multipart_uploads(&self, prefix: &str) -> StoreResult<Vec<MultipartUpload>> {
        self.retry(&format!("ListMultipartUploads {prefix:?}"), || {
            self.inner.list_multipart_uploads(prefix)
        })
        .await
    }

    async fn copy(
        &self,
        src_key: &str,
        dst_key: &str,
        meta: Option<&UserMeta>,
        src_if_match: Option<&str>,
    ) -> StoreResult<String> {
        let what = format!("CopyObject {src_key} -> {dst_key}");
        let attempts = Attempts::default();
        let r = self
            .retry(&what, || async {
                attempts.begin();
                let r = self.inner.copy(src_key, dst_key, meta, src_if_match).await;
                attempts.ended(&r);
                r
            })
            .await;
        let pinned_onto_itself = src_key == dst_key && src_if_match.is_some();
        if !pinned_onto_itself || !matches!(r, Err(StoreError::PreconditionFailed(_))) {
            return r;
        }
        // A copy onto itself (new metadata) gives a new ETag, so a repeat after an attempt
        // that landed is refused: the object is ours if it has the metadata we sent. Its ETag
        // cannot tell (a copy of a multipart object has an MD5 of its own).
        let Some(lost) = attempts.lost.lock().take() else {
            return r;
        };
        match ObjectStore::head(self, dst_key).await {
            Ok(obj) if meta.is_some_and(|m| *m == obj.user) => {
                tracing::info!(
                    "{what}: the answer to an attempt was lost ({lost}), but the object has \
                     the metadata of our request: done"
                );
                Ok(obj.etag.unwrap_or_default())
            }
            // Not ours, or not known: the attempt's failure stands (never taken for another
            // client's version, which sync mode keeps as a conflict).
            _ => Err(lost),
        }
    }

    async fn delete(&self, key: &str) -> StoreResult<()> {
        self.retry(&format!("DELETE {key}"), || self.inner.delete(key))
            .await
    }

    async fn delete_if(&self, key: &str, if_match: &str) -> StoreResult<()> {
        // A repeat after a lost answer finds the object gone: done (a missing key succeeds).
        self.retry(&format!("DELETE {key}"), || {
            self.inner.delete_if(key, if_match)
        })
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
        self.retry(&format!("LIST {prefix:?}"), || {
            self.inner
                .list(prefix, delimiter, from.clone(), max_keys, detail)
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fault::{Fault, FaultStore};
    use crate::memory::MemoryStore;
    use crate::metrics::Op;

    fn quick(max_elapsed_ms: u64) -> RetryPolicy {
        RetryPolicy {
            max_elapsed: Duration::from_millis(max_elapsed_ms),
            initial_backoff: Duration::from_millis(2),
            max_backoff: Duration::from_millis(20),
            max_attempts: 50,
        }
    }

    fn setup(policy: RetryPolicy) -> (Arc<MemoryStore>, Arc<FaultStore>, RetryStore) {
        let mem = Arc::new(MemoryStore::new());
        let fault = Arc::new(FaultStore::new(mem.clone()));
        let retry = RetryStore::new(fault.clone() as Arc<dyn ObjectStore>, policy);
        (mem, fault, retry)
    }

    fn transient() -> Fault {
        Fault::Error(StoreError::Transient("503 SlowDown (injected)".into()))
    }

    #[test]
    fn backoff_grows_with_jitter_and_is_capped() {
        let p = RetryPolicy {
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(4),
            ..RetryPolicy::default()
        };
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..200 {
            let b1 = p.backoff(1);
            assert!(b1 >= Duration::from_millis(50) && b1 <= Duration::from_millis(100));
            seen.insert(b1.as_micros());
            let b3 = p.backoff(3);
            assert!(b3 >= Duration::from_millis(200) && b3 <= Duration::from_millis(400));
            let b30 = p.backoff(30);
            assert!(b30 >= Duration::from_secs(2) && b30 <= Duration::from_secs(4));
            assert!(p.backoff(u32::MAX) <= Duration::from_secs(4));
        }
        assert!(seen.len() > 50, "backoff is not jittered: {seen:?}");
    }

    #[tokio::test]
    async fn transient_errors_are_retried_until_success() {
        let (mem, fault, retry) = setup(quick(5_000));
        mem.put("k", Bytes::from_static(b"v"), &UserMeta::new())
            .await
            .unwrap();
        fault.inject(Op::Get, 0, Some(5), transient());
        fault.inject(Op::Put, 0, Some(3), Fault::DropAfter);
        assert_eq!(retry.get_range("k", 0..1, None).await.unwrap(), "v");
        retry
            .put("k2", Bytes::from_static(b"w"), &UserMeta::new())
            .await
            .unwrap();
        let m = retry.metrics();
        assert_eq!(RetryMetrics::get(&m.retries), 8);
        assert_eq!(RetryMetrics::get(&m.recovered), 2);
        assert_eq!(RetryMetrics::get(&m.gave_up), 0);
    }

    #[tokio::test]
    async fn permanent_errors_are_not_retried() {
        let (_mem, fault, retry) = setup(quick(5_000));
        for e in [
            StoreError::AccessDenied("403".into()),
            StoreError::NoSpace("507".into()),
            StoreError::PreconditionFailed("412".into()),
            StoreError::Invalid("400".into()),
        ] {
            fault.clear();
            fault.inject(Op::Head, 0, Some(1), Fault::Error(e.clone()));
            let got = retry.head("k").await.unwrap_err();
            assert_eq!(std::mem::discriminant(&got), std::mem::discriminant(&e));
        }
        // 404 comes from the store itself.
        assert!(retry.head("missing").await.unwrap_err().is_not_found());
        assert_eq!(RetryMetrics::get(&retry.metrics().retries), 0);
    }

    #[tokio::test]
    async fn retries_are_bounded_in_time() {
        let (_mem, fault, retry) = setup(quick(300));
        fault.inject(Op::Head, 0, None, transient());
        let t = Instant::now();
        let e = retry.head("k").await.unwrap_err();
        let took = t.elapsed();
        assert!(e.is_transient());
        assert!(took <= Duration::from_millis(600), "took {took:?}");
        assert!(
            took >= Duration::from_millis(200),
            "gave up too early: {took:?}"
        );
        assert!(RetryMetrics::get(&retry.metrics().retries) >= 5);
        assert_eq!(RetryMetrics::get(&retry.metrics().gave_up), 1);
    }

    #[tokio::test]
    async fn a_slow_failure_is_retried_while_the_store_makes_progress() {
        // The first attempt takes longer than the whole budget and then fails (a request that
        // waited for a connection behind busy ones): other calls succeeding meanwhile are
        // progress, so it is still retried.
        let mem = Arc::new(MemoryStore::new());
        let failing = Arc::new(FaultStore::new(mem.clone()));
        failing.inject(Op::Head, 0, Some(1), transient());
        let slow = Arc::new(FaultStore::new(failing as Arc<dyn ObjectStore>));
        slow.inject(
            Op::Head,
            0,
            Some(1),
            Fault::Delay(Duration::from_millis(400)),
        );
        let retry = Arc::new(RetryStore::new(slow as Arc<dyn ObjectStore>, quick(300)));
        mem.put("k", Bytes::from_static(b"abc"), &UserMeta::new())
            .await
            .unwrap();
        let busy = tokio::spawn({
            let retry = retry.clone();
            async move {
                for _ in 0..8 {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    retry
                        .list("", None, ListFrom::Start, 1, ListDetail::Plain)
                        .await
                        .unwrap();
                }
            }
        });
        assert_eq!(retry.head("k").await.unwrap().size, 3);
        busy.await.unwrap();
        assert_eq!(RetryMetrics::get(&retry.metrics().retries), 1);
        assert_eq!(RetryMetrics::get(&retry.metrics().recovered), 1);
    }

    /// A write whose answer the store held until this layer cut the attempt (others'
    /// requests moving meanwhile), then retried: the retry's 412 or NoSuchUpload was taken
    /// for another client's doing, though the first attempt had stored our bytes. Found done
    /// now, as after a transient failure.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_whose_attempt_was_cut_after_it_landed_is_found_done() {
        let (mem, fault, retry) = setup(quick(200));
        let retry = Arc::new(retry.cutting_stalls());
        let meta = UserMeta::new();
        let v1 = mem
            .put("k", Bytes::from_static(b"v1"), &meta)
            .await
            .unwrap();
        let busy = tokio::spawn({
            let retry = retry.clone();
            async move {
                for _ in 0..60 {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    let _ = retry
                        .list("", None, ListFrom::Start, 1, ListDetail::Plain)
                        .await;
                }
            }
        });
        fault.inject(Op::Put, 0, Some(1), Fault::HangAfter);
        let put = retry
            .put_if("k", Bytes::from_static(b"v2"), &meta, Some(&v1), None)
            .await;
        let up = retry.create_multipart("m", &meta, None).await.unwrap();
        let etag = retry
            .upload_part("m", &up, 1, Bytes::from_static(b"part"))
            .await
            .unwrap();
        let parts = [CompletedPart {
            part_number: 1,
            etag,
        }];
        fault.inject(Op::CompleteMultipart, 0, Some(1), Fault::HangAfter);
        let done = retry.complete_multipart("m", &up, &parts, None).await;
        busy.await.unwrap();
        assert_eq!(put.unwrap(), mem.head("k").await.unwrap().etag.unwrap());
        assert_eq!(done.unwrap(), mem.head("m").await.unwrap().etag.unwrap());
    }

    /// The retry of a write said 412 after an attempt failed, and the HEAD that would tell
    /// whether that attempt landed failed too: unknown, so a transient failure, not another
    /// client's version (a conflict, which sync mode makes sticky).
    #[tokio::test]
    async fn a_lost_answer_that_cannot_be_checked_is_no_conflict() {
        let (mem, fault, retry) = setup(quick(100));
        let meta = UserMeta::new();
        let v1 = mem
            .put("k", Bytes::from_static(b"v1"), &meta)
            .await
            .unwrap();
        mem.put("k", Bytes::from_static(b"other"), &meta)
            .await
            .unwrap();
        fault.inject(
            Op::Put,
            0,
            Some(1),
            Fault::Error(StoreError::Transient("reset".into())),
        );
        fault.inject(Op::Head, 0, None, transient());
        let r = retry
            .put_if("k", Bytes::from_static(b"v2"), &meta, Some(&v1), None)
            .await;
        assert!(matches!(r, Err(ref e) if e.is_transient()), "{r:?}");
    }

    /// A copy of an object onto itself (a chmod of a multipart object) that landed and lost
    /// its answer: the repeat's source pin no longer matched (the copy has a new ETag), and
    /// the 412 made a chmod of our own file a conflict with "another client".
    #[tokio::test]
    async fn a_copy_onto_itself_that_landed_and_lost_its_answer_is_found_done() {
        let (mem, fault, retry) = setup(quick(300));
        let up = mem
            .create_multipart("big", &UserMeta::new(), None)
            .await
            .unwrap();
        let etag = mem
            .upload_part("big", &up, 1, Bytes::from_static(b"part"))
            .await
            .unwrap();
        let parts = [CompletedPart {
            part_number: 1,
            etag,
        }];
        let v1 = mem
            .complete_multipart("big", &up, &parts, None)
            .await
            .unwrap();
        let mut meta = UserMeta::new();
        meta.insert("mode".into(), "100600".into());
        fault.inject(Op::Copy, 0, Some(1), Fault::DropAfter);
        let r = retry.copy("big", "big", Some(&meta), Some(&v1)).await;
        let now = mem.head("big").await.unwrap();
        assert_eq!(now.user, meta);
        assert_eq!(r.unwrap(), now.etag.unwrap());
    }

    fn hanging(policy: RetryPolicy) -> (Arc<MemoryStore>, Arc<FaultStore>, RetryStore) {
        let (mem, fault, retry) = setup(policy);
        fault.inject(Op::Head, 0, None, Fault::Delay(Duration::from_secs(3600)));
        fault.inject(Op::List, 0, None, Fault::Delay(Duration::from_secs(3600)));
        (mem, fault, retry.cutting_stalls())
    }

    #[tokio::test]
    async fn one_operation_has_one_deadline_from_its_start() {
        let (_mem, _fault, retry) = hanging(quick(300));
        let t = Instant::now();
        // The operation spends 200 ms before its first store call, then makes three calls
        // to a store that never answers: it fails 300 ms after it started, not after each.
        crate::liveness::within_operation(async {
            tokio::time::sleep(Duration::from_millis(200)).await;
            for _ in 0..3 {
                assert!(retry.head("k").await.unwrap_err().is_transient());
            }
        })
        .await;
        let took = t.elapsed();
        assert!(
            (Duration::from_millis(290)..Duration::from_millis(450)).contains(&took),
            "{took:?}"
        );
        let m = retry.metrics();
        assert_eq!(RetryMetrics::get(&m.outages), 1);
        assert_eq!(RetryMetrics::get(&m.fast_failed), 2);
        // Calls in flight when the outage is declared stop waiting, and later calls fail at
        // once while it lasts.
        let t = Instant::now();
        for _ in 0..10 {
            retry.head("k").await.unwrap_err();
        }
        assert!(t.elapsed() < Duration::from_millis(20), "{:?}", t.elapsed());
    }

    /// An operation that waited longer than the budget for something else than the store,
    /// which nothing was asked of meanwhile, then calls it: the call has a budget of its own
    /// (an earlier build cut it before it was sent and declared an outage: every call of
    /// the mount failed at once until a probe).
    #[tokio::test]
    async fn a_call_after_the_operation_waited_elsewhere_has_a_budget_of_its_own() {
        let (mem, _fault, retry) = setup(quick(200));
        let retry = retry.cutting_stalls();
        mem.put("k", Bytes::from_static(b"abc"), &UserMeta::new())
            .await
            .unwrap();
        let got = crate::liveness::within_operation(async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            retry.head("k").await
        })
        .await;
        assert_eq!(got.unwrap().size, 3);
        assert_eq!(RetryMetrics::get(&retry.metrics().outages), 0);
        // On a store that does not answer, such a call is cut its budget after it began.
        let (_mem, _fault, retry) = hanging(quick(200));
        let t = Instant::now();
        crate::liveness::within_operation(async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            assert!(retry.head("k").await.unwrap_err().is_transient());
        })
        .await;
        let took = t.elapsed();
        assert!(
            (Duration::from_millis(490)..Duration::from_millis(650)).contains(&took),
            "{took:?}"
        );
    }

    #[tokio::test]
    async fn calls_waiting_when_the_outage_is_declared_stop_at_once() {
        let (_mem, _fault, retry) = hanging(quick(300));
        let retry = Arc::new(retry);
        let t = Instant::now();
        let late = tokio::spawn({
            let retry = retry.clone();
            async move {
                tokio::time::sleep(Duration::from_millis(150)).await;
                let e = retry.head("k").await.unwrap_err();
                (e, Instant::now())
            }
        });
        retry.head("k").await.unwrap_err();
        let (e, ended) = late.await.unwrap();
        // The second call started 150 ms later but ended with the outage, not 300 ms later.
        assert!(e.is_transient());
        assert!(ended - t < Duration::from_millis(400), "{:?}", ended - t);
    }

    #[tokio::test]
    async fn a_slow_attempt_that_makes_progress_is_not_cut() {
        let (_mem, _fault, retry) = setup(quick(200));
        let retry = retry.cutting_stalls();
        let t = Instant::now();
        // One second of transfer, a byte every 50 ms: five times the budget, never idle.
        let r = retry
            .retry("slow", || async {
                for _ in 0..20 {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    crate::liveness::tick();
                }
                Ok(7)
            })
            .await;
        assert_eq!(r.unwrap(), 7);
        assert!(t.elapsed() >= Duration::from_secs(1));
        assert_eq!(RetryMetrics::get(&retry.metrics().stalls), 0);
        // The same attempt stopping halfway is cut 200 ms after its last byte.
        let t = Instant::now();
        let r: StoreResult<()> = retry
            .retry("stops", || async {
                for _ in 0..5 {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    crate::liveness::tick();
                }
                std::future::pending().await
            })
            .await;
        assert!(r.unwrap_err().is_transient());
        let took = t.elapsed();
        assert!(
            (Duration::from_millis(440)..Duration::from_millis(600)).contains(&took),
            "{took:?}"
        );
    }

    /// Three calls queue for one place (a request slot) and each then moves a byte every
    /// 50 ms for a second: the last waits two seconds, four times the budget, in the queue.
    #[tokio::test]
    async fn an_attempt_waiting_in_a_queue_is_not_idle() {
        let (_mem, _fault, retry) = setup(quick(500));
        let retry = retry.cutting_stalls();
        let slot = tokio::sync::Semaphore::new(1);
        let call = || {
            retry.retry("queued", || async {
                let _slot = crate::liveness::queued(slot.acquire()).await;
                for _ in 0..20 {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    crate::liveness::tick();
                }
                Ok(())
            })
        };
        let (a, b, c) = tokio::join!(call(), call(), call());
        assert!(a.is_ok() && b.is_ok() && c.is_ok(), "{a:?} {b:?} {c:?}");
        assert_eq!(RetryMetrics::get(&retry.metrics().stalls), 0);
        // A queue that does not move while the store makes no progress is a stall.
        let held = slot.acquire().await.unwrap();
        let t = Instant::now();
        let r = call().await;
        assert!(r.unwrap_err().is_transient());
        assert!(
            t.elapsed() < Duration::from_millis(1200),
            "{:?}",
            t.elapsed()
        );
        drop(held);
    }

    #[tokio::test]
    async fn a_probe_ends_the_outage_when_the_store_answers() {
        let (mem, fault, retry) = hanging(quick(200));
        mem.put("k", Bytes::new(), &UserMeta::new()).await.unwrap();
        retry.head("k").await.unwrap_err();
        assert!(retry.head("k").await.unwrap_err().is_transient());
        fault.clear();
        // The next probe (one a second) gets an answer and ends the outage.
        let t = Instant::now();
        while retry.head("k").await.is_err() {
            assert!(t.elapsed() < Duration::from_secs(3), "still failing");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(RetryMetrics::get(&retry.metrics().outages), 1);
    }

    #[tokio::test]
    async fn attempts_are_bounded_in_number() {
        let mut p = quick(60_000);
        p.max_attempts = 4;
        let (_mem, fault, retry) = setup(p);
        fault.inject(Op::Head, 0, None, transient());
        retry.head("k").await.unwrap_err();
        assert_eq!(RetryMetrics::get(&retry.metrics().retries), 3);
    }

    #[tokio::test]
    async fn a_long_outage_makes_calls_fail_fast_until_the_store_answers() {
        let (mem, fault, retry) = setup(quick(200));
        mem.put("k", Bytes::new(), &UserMeta::new()).await.unwrap();
        fault.inject(Op::Head, 0, None, transient());
        // The first call waits out the budget and opens the breaker.
        retry.head("k").await.unwrap_err();
        tokio::time::sleep(Duration::from_millis(20)).await;
        retry.head("k").await.unwrap_err();
        // Now every call fails after a single attempt.
        let t = Instant::now();
        for _ in 0..10 {
            retry.head("k").await.unwrap_err();
        }
        assert!(
            t.elapsed() < Duration::from_millis(100),
            "{:?}",
            t.elapsed()
        );
        let m = retry.metrics();
        assert_eq!(RetryMetrics::get(&m.outages), 1);
        assert!(RetryMetrics::get(&m.fast_failed) >= 10);
        // The store comes back: the next probe (one a second) ends the outage.
        fault.clear();
        let t = Instant::now();
        while retry.head("k").await.is_err() {
            assert!(t.elapsed() < Duration::from_secs(3), "still failing");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        fault.inject(Op::Head, 0, Some(2), transient());
        retry.head("k").await.unwrap();
        assert_eq!(RetryMetrics::get(&m.recovered), 1);
    }

    #[tokio::test]
    async fn a_lost_complete_answer_is_recognised_by_the_etag() {
        let (mem, fault, retry) = setup(quick(5_000));
        let id = retry
            .create_multipart("big", &UserMeta::new(), None)
            .await
            .unwrap();
        let part = Bytes::from(vec![7u8; StoreLimits::S3.min_part as usize]);
        let e1 = retry
            .upload_part("big", &id, 1, part.clone())
            .await
            .unwrap();
        let e2 = retry.upload_part("big", &id, 2, part).await.unwrap();
        let parts = [
            CompletedPart {
                part_number: 1,
                etag: e1,
            },
            CompletedPart {
                part_number: 2,
                etag: e2,
            },
        ];
        // The first attempt completes the upload, then the connection drops.
        fault.inject(Op::CompleteMultipart, 0, Some(1), Fault::DropAfter);
        let etag = retry
            .complete_multipart("big", &id, &parts, None)
            .await
            .unwrap();
        assert_eq!(Some(etag), multipart_etag(&parts));
        assert_eq!(
            mem.head("big").await.unwrap().size,
            2 * StoreLimits::S3.min_part
        );
        assert_eq!(mem.pending_uploads(), 0);
    }

    #[tokio::test]
    async fn a_lost_complete_answer_with_another_object_is_an_error() {
        let (mem, fault, retry) = setup(quick(5_000));
        let id = retry
            .create_multipart("big", &UserMeta::new(), None)
            .await
            .unwrap();
        let e1 = retry
            .upload_part("big", &id, 1, Bytes::from_static(b"x"))
            .await
            .unwrap();
        let parts = [CompletedPart {
            part_number: 1,
            etag: e1,
        }];
        // The upload vanished (aborted by someone) and another writer put the key.
        fault.inject(
            Op::CompleteMultipart,
            0,
            Some(1),
            Fault::Error(StoreError::Transient("connection reset".into())),
        );
        retry.abort_multipart("big", &id).await.unwrap();
        mem.put("big", Bytes::from_static(b"other"), &UserMeta::new())
            .await
            .unwrap();
        let e = retry
            .complete_multipart("big", &id, &parts, None)
            .await
            .unwrap_err();
        assert!(e.is_transient(), "{e}");
        // And with no earlier failure, NoSuchUpload stays NotFound.
        let e = retry
            .complete_multipart("big", "nope", &parts, None)
            .await
            .unwrap_err();
        assert!(e.is_not_found(), "{e}");
    }

    #[test]
    fn multipart_etag_matches_s3() {
        // Two parts whose MD5s are known: md5("a"), md5("b").
        let parts = [
            CompletedPart {
                part_number: 1,
                etag: "\"0cc175b9c0f1b6a831c399e269772661\"".into(),
            },
            CompletedPart {
                part_number: 2,
                etag: "92eb5ffee6ae2fec3ad71c777531578f".into(),
            },
        ];
        let mut h = Md5::new();
        h.update(Md5::digest(b"a"));
        h.update(Md5::digest(b"b"));
        assert_eq!(
            multipart_etag(&parts),
            Some(format!("\"{}-2\"", hex::encode(h.finalize())))
        );
        let bad = [CompletedPart {
            part_number: 1,
            etag: "\"not-md5\"".into(),
        }];
        assert_eq!(multipart_etag(&bad), None);
    }
}
