//! Operations answered on the thread that received them.
//!
//! A FUSE request handed to the runtime costs two thread switches (the FUSE thread wakes a
//! worker, whose reply wakes the kernel's waiter), and a local-disk step inside it two more
//! (the worker hands it to the blocking pool and is woken by it). On a small machine those
//! switches are most of what a lookup, open or close answered from memory or the data cache
//! costs. So the FUSE thread first polls the operation itself ([`poll_here`]): one that needs
//! nothing from the network finishes there, with its local-disk steps run in place
//! ([`local_io`]); one that must wait is handed to the runtime where it stopped.
//!
//! Local-disk steps run in place on all FUSE threads but one at once ([`set_fuse_threads`]):
//! a stalled cache disk never holds the last one, which keeps serving (what needs that disk
//! then waits in the blocking pool).

use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, Waker};

/// FUSE threads that may be inside a local-disk step at once (see [`set_fuse_threads`]).
static IN_PLACE_MAX: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// This thread is polling an operation in [`poll_here`].
    static HERE: Cell<bool> = const { Cell::new(false) };
}

static IN_PLACE: AtomicUsize = AtomicUsize::new(0);

/// The mount serves requests on `n` FUSE threads: all but one may run local-disk steps in
/// place (with one thread, none does).
pub fn set_fuse_threads(n: usize) {
    IN_PLACE_MAX.store(n.saturating_sub(1), Ordering::Relaxed);
}

/// Polls `fut` once on this thread. `Ready`: it finished here. `Pending`: it waits for
/// something; the caller hands it to the runtime, whose first poll registers the waker
/// (this poll's waker does nothing). Call it inside the runtime's context (`Handle::enter`),
/// as its futures may spawn.
pub fn poll_here<F: Future + ?Sized>(fut: Pin<&mut F>) -> Poll<F::Output> {
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            HERE.with(|h| h.set(false));
        }
    }
    HERE.with(|h| h.set(true));
    let _reset = Reset;
    fut.poll(&mut Context::from_waker(Waker::noop()))
}

/// Runs a local-disk step `f`: in place when polled by [`poll_here`] and a place is free,
/// else on the blocking pool. `None`: the pool's task was lost (the runtime shuts down).
pub async fn local_io<T, F>(f: F) -> Option<T>
where
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    if HERE.with(Cell::get) {
        let taken = IN_PLACE.fetch_add(1, Ordering::AcqRel);
        struct Release;
        impl Drop for Release {
            fn drop(&mut self) {
                IN_PLACE.fetch_sub(1, Ordering::AcqRel);
            }
        }
        let _release = Release;
        if taken < IN_PLACE_MAX.load(Ordering::Relaxed) {
            return Some(f());
        }
    }
    tokio::task::spawn_blocking(f).await.ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    // One test: the places are a process-wide count.
    #[tokio::test]
    async fn a_step_runs_in_place_only_when_polled_here_and_a_place_is_free() {
        let me = std::thread::current().id();
        let here = move || std::thread::current().id() == me;
        // One FUSE thread: none in place, it must stay free.
        set_fuse_threads(1);
        let mut fut = Box::pin(local_io(here));
        let r = match poll_here(fut.as_mut()) {
            Poll::Ready(r) => r,
            Poll::Pending => fut.await,
        };
        assert_eq!(r, Some(false), "the only FUSE thread ran a disk step");
        set_fuse_threads(4);
        // Polled here: run on this thread.
        let mut fut = Box::pin(local_io(here));
        assert_eq!(poll_here(fut.as_mut()), Poll::Ready(Some(true)));
        // Awaited by a runtime task: the blocking pool.
        assert_eq!(local_io(here).await, Some(false));
        // Every place taken: the pool, though polled here.
        let max = IN_PLACE_MAX.load(Ordering::Relaxed);
        IN_PLACE.fetch_add(max, Ordering::AcqRel);
        let mut fut = Box::pin(local_io(here));
        let r = match poll_here(fut.as_mut()) {
            Poll::Ready(r) => r,
            Poll::Pending => fut.await,
        };
        IN_PLACE.fetch_sub(max, Ordering::AcqRel);
        assert_eq!(r, Some(false), "ran in place while the places were taken");
        assert_eq!(
            IN_PLACE.load(Ordering::Acquire),
            0,
            "every place given back"
        );
    }
}
