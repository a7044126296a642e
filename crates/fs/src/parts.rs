//! Running the part requests of one multipart upload (or the object copies of a directory
//! rename, some of them multipart), a bounded number at a time.
//!
//! Why not `buffered(n).try_collect()`: on the first error it drops the requests still
//! running. A dropped request whose body the server already has may still store its part,
//! after the caller has aborted the upload; S3 then keeps (and bills) that part, and MinIO
//! lists the upload again. So a failure here stops new requests but waits for the running
//! ones before it returns, and the caller's abort comes after the last of them.

use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, StreamExt};

/// Runs `jobs` with at most `limit` at a time and returns their results in order, or the
/// first error once every job already started has finished.
pub async fn run_parts<T, E>(
    jobs: Vec<BoxFuture<'_, Result<T, E>>>,
    limit: usize,
) -> Result<Vec<T>, E> {
    let total = jobs.len();
    let mut waiting = jobs.into_iter().enumerate();
    let mut running = FuturesUnordered::new();
    let mut done: Vec<Option<T>> = (0..total).map(|_| None).collect();
    let mut first_error = None;
    loop {
        while first_error.is_none() && running.len() < limit.max(1) {
            let Some((i, job)) = waiting.next() else {
                break;
            };
            running.push(async move { (i, job.await) });
        }
        match running.next().await {
            None => break,
            Some((i, Ok(v))) => done[i] = Some(v),
            Some((_, Err(e))) => {
                first_error.get_or_insert(e);
            }
        }
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(done
            .into_iter()
            .map(|v| v.expect("every job ran"))
            .collect()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    #[tokio::test]
    async fn results_come_in_order_with_the_bound_kept() {
        let running = Arc::new(AtomicUsize::new(0));
        let peak = Arc::new(AtomicUsize::new(0));
        let jobs: Vec<BoxFuture<'_, Result<usize, ()>>> = (0..10)
            .map(|i| {
                let (running, peak) = (running.clone(), peak.clone());
                async move {
                    let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                    peak.fetch_max(now, Ordering::SeqCst);
                    // Later jobs finish first, so order is not completion order.
                    tokio::time::sleep(Duration::from_millis(20 - i as u64)).await;
                    running.fetch_sub(1, Ordering::SeqCst);
                    Ok(i)
                }
                .boxed()
            })
            .collect();
        assert_eq!(run_parts(jobs, 3).await, Ok((0..10).collect()));
        assert_eq!(peak.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn a_failure_waits_for_running_jobs_and_starts_no_more() {
        let finished = Arc::new(AtomicUsize::new(0));
        let started = Arc::new(AtomicUsize::new(0));
        let jobs: Vec<BoxFuture<'_, Result<(), usize>>> = (0..10)
            .map(|i| {
                let (finished, started) = (finished.clone(), started.clone());
                async move {
                    started.fetch_add(1, Ordering::SeqCst);
                    if i == 0 {
                        return Err(0);
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    finished.fetch_add(1, Ordering::SeqCst);
                    Ok(())
                }
                .boxed()
            })
            .collect();
        assert_eq!(run_parts(jobs, 3).await, Err(0));
        // Jobs 1 and 2 were running when job 0 failed: both ran to the end; none after.
        assert_eq!(started.load(Ordering::SeqCst), 3);
        assert_eq!(finished.load(Ordering::SeqCst), 2);
    }
}
