//! What a stall is, as the retry layer sees it: time without progress.
//!
//! * An **operation** is one file-system call (one syscall). The FUSE adapter runs each in
//!   [`within_operation`], which records when it started; every store call it makes shares
//!   that start, so the calls of one syscall get one deadline instead of one each
//!   (see [`crate::retry`]).
//! * **Progress** is a byte of a request or answer body going over the wire, the head of an
//!   answer arriving, or a call succeeding. The S3 backend reports bytes through
//!   [`AttemptProgress`] (each attempt of [`crate::retry::RetryStore`] runs with one); the
//!   retry layer counts successes itself. A slow transfer makes progress; a store that
//!   accepts a request and never answers does not.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

tokio::task_local! {
    static OPERATION_START: Instant;
    static ATTEMPT: Arc<AttemptProgress>;
}

/// Runs `fut` as one file-system operation: the store calls it makes share its start.
pub async fn within_operation<F: std::future::Future>(fut: F) -> F::Output {
    OPERATION_START.scope(Instant::now(), fut).await
}

/// Runs `fut` (in a task of its own) as part of the operation that started at `start`, or of
/// none: a request spawned for an operation keeps its deadline.
pub async fn within_operation_from<F: std::future::Future>(
    start: Option<Instant>,
    fut: F,
) -> F::Output {
    match start {
        Some(s) => OPERATION_START.scope(s, fut).await,
        None => fut.await,
    }
}

/// When the operation the current task serves started, if it runs in [`within_operation`].
pub fn operation_start() -> Option<Instant> {
    OPERATION_START.try_with(|s| *s).ok()
}

/// An instant that only moves forward, shared between threads without a lock.
#[derive(Debug)]
pub struct Clock {
    base: Instant,
    /// Nanoseconds after `base`.
    at: AtomicU64,
}

impl Clock {
    pub fn new() -> Self {
        Self {
            base: Instant::now(),
            at: AtomicU64::new(0),
        }
    }

    /// Moves the clock to now.
    pub fn tick(&self) {
        let now = self.base.elapsed().as_nanos() as u64;
        self.at.fetch_max(now, Ordering::Relaxed);
    }

    /// The last tick (the clock's creation if none).
    pub fn last(&self) -> Instant {
        self.base + Duration::from_nanos(self.at.load(Ordering::Relaxed))
    }
}

impl Default for Clock {
    fn default() -> Self {
        Self::new()
    }
}

/// The progress of one attempt, and of the store it goes to.
#[derive(Debug)]
pub struct AttemptProgress {
    /// The last progress of any request to this store.
    pub store: Arc<Clock>,
    /// The last progress of this attempt (its start if none).
    pub own: Clock,
    /// Waits in progress for a place in a queue (a request slot): the attempt is not idle
    /// while it queues behind other requests, only the store can stall.
    queued: AtomicU32,
}

impl AttemptProgress {
    pub fn new(store: Arc<Clock>) -> Arc<Self> {
        Arc::new(Self {
            store,
            own: Clock::new(),
            queued: AtomicU32::new(0),
        })
    }

    /// Whether the attempt waits in a queue ([`queued`]) rather than for the store.
    pub fn is_queued(&self) -> bool {
        self.queued.load(Ordering::Relaxed) > 0
    }

    pub fn tick(&self) {
        self.own.tick();
        self.store.tick();
    }

    /// Runs `fut` (one attempt) with this progress as the task's current one.
    pub async fn scope<F: std::future::Future>(self: &Arc<Self>, fut: F) -> F::Output {
        ATTEMPT.scope(self.clone(), fut).await
    }

    /// The progress of the attempt the current task runs, if any: a body that moves bytes
    /// outside this task (the HTTP client sends request bodies from its connection task)
    /// takes it along.
    pub fn current() -> Option<Arc<Self>> {
        ATTEMPT.try_with(|p| p.clone()).ok()
    }
}

/// Waits for `place` (a request slot) as a queue wait of the attempt the current task runs:
/// its idle time does not run meanwhile and starts again once the wait ends, without noting
/// progress of the store. The store's own stall bound still applies.
pub async fn queued<F: std::future::Future>(place: F) -> F::Output {
    /// Ends the queue wait however it ends (a dropped attempt included).
    struct Queued(Arc<AttemptProgress>);
    impl Drop for Queued {
        fn drop(&mut self) {
            self.0.own.tick();
            self.0.queued.fetch_sub(1, Ordering::Relaxed);
        }
    }
    let _queued = AttemptProgress::current().map(|p| {
        p.queued.fetch_add(1, Ordering::Relaxed);
        Queued(p)
    });
    place.await
}

/// Notes progress of the attempt the current task runs (nothing outside an attempt).
pub fn tick() {
    let _ = ATTEMPT.try_with(|p| p.tick());
}
