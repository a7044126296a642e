//! `bucketfs bench`: the store's own speed with no file system in between — the limit the
//! bench suite compares every mounted system against.
//!
//! It writes one object as a parallel multipart upload and reads it back as parallel ranged
//! GETs, through the same store layer (and so the same HTTP client and settings) the mount
//! uses, and deletes it afterwards.

use crate::args::BenchArgs;
use crate::config::parse_size;
use crate::run::{open_store, target_of, Target};
use bucketfs_store::metrics::{Op, StoreMetrics};
use bucketfs_store::{CompletedPart, ObjectStore, StoreError, Uploads};
use bytes::Bytes;
use futures::stream::{self, StreamExt, TryStreamExt};
use std::sync::Arc;
use std::time::Instant;

pub struct LimitOptions {
    /// Bytes of the test object.
    pub size: u64,
    /// Requests in flight at once.
    pub concurrency: usize,
    /// Part size of the upload and size of each ranged GET.
    pub part_size: u64,
    /// Drop the page cache between the PUT and the GETs.
    pub cold: bool,
}

#[derive(Debug)]
pub struct LimitResult {
    pub put_mb_s: f64,
    pub get_mb_s: f64,
    pub put_requests: u64,
    pub get_requests: u64,
}

impl LimitResult {
    pub fn json(&self) -> String {
        format!(
            "{{\"put_mb_s\": {:.1}, \"get_mb_s\": {:.1}, \"put_requests\": {}, \"get_requests\": {}}}",
            self.put_mb_s, self.get_mb_s, self.put_requests, self.get_requests
        )
    }
}

fn mb_s(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / 1e6 / secs.max(1e-9)
}

/// Runs the PUT then GET measurement on `key` and removes the object.
pub async fn measure(
    store: Arc<dyn ObjectStore>,
    metrics: &StoreMetrics,
    key: &str,
    opts: &LimitOptions,
) -> Result<LimitResult, StoreError> {
    let part = opts.part_size.max(store.limits().min_part);
    let parts = opts.size.div_ceil(part).max(1);
    // One buffer of incompressible bytes, shared by every part (no copy per request).
    let body = Bytes::from(pseudo_random(part as usize));
    let ranges: Vec<(u32, std::ops::Range<u64>)> = (0..parts)
        .map(|i| {
            (
                i as u32 + 1,
                i * part..((i + 1) * part).min(opts.size.max(1)),
            )
        })
        .collect();
    let before = (metrics.requests(Op::UploadPart), metrics.requests(Op::Get));

    let started = Instant::now();
    let mut upload = Uploads::new(store.clone())
        .create(key, &Default::default())
        .await?;
    let uploaded: Result<Vec<CompletedPart>, StoreError> = stream::iter(ranges.clone())
        .map(|(n, r)| {
            let (upload, body) = (&upload, body.clone());
            async move {
                let etag = upload
                    .part(n, body.slice(0..(r.end - r.start) as usize))
                    .await?;
                Ok(CompletedPart {
                    part_number: n,
                    etag,
                })
            }
        })
        .buffered(opts.concurrency.max(1))
        .try_collect()
        .await;
    let completed = match uploaded {
        Ok(p) => upload.complete(&p, None).await.map(|_| ()),
        Err(e) => Err(e),
    };
    if let Err(e) = completed {
        let _ = upload.abort().await;
        return Err(e);
    }
    let put_secs = started.elapsed().as_secs_f64();
    let total = ranges.last().map_or(0, |(_, r)| r.end);
    if opts.cold {
        drop_page_cache().map_err(|e| StoreError::Other(format!("--cold: {e}")))?;
    }

    let started = Instant::now();
    let got: Result<Vec<u64>, StoreError> = stream::iter(ranges)
        .map(|(_, r)| {
            let store = store.clone();
            async move { Ok(store.get_range(key, r, None).await?.len() as u64) }
        })
        .buffer_unordered(opts.concurrency.max(1))
        .try_collect()
        .await;
    let get_secs = started.elapsed().as_secs_f64();
    let _ = store.delete(key).await;
    let read: u64 = got?.iter().sum();
    if read != total {
        return Err(StoreError::Other(format!(
            "read back {read} bytes of {total}"
        )));
    }
    Ok(LimitResult {
        put_mb_s: mb_s(total, put_secs),
        get_mb_s: mb_s(total, get_secs),
        put_requests: metrics.requests(Op::UploadPart) - before.0,
        get_requests: metrics.requests(Op::Get) - before.1,
    })
}

/// `bucketfs bench`: returns the exit code.
pub fn run(args: &BenchArgs) -> i32 {
    match run_inner(args) {
        Ok(r) => {
            if args.json {
                println!("{}", r.json());
            } else {
                println!(
                    "PUT {:.1} MB/s ({} parts), GET {:.1} MB/s ({} requests)",
                    r.put_mb_s, r.put_requests, r.get_mb_s, r.get_requests
                );
            }
            0
        }
        Err(msg) => {
            eprintln!("bucketfs: bench: {msg}");
            1
        }
    }
}

fn run_inner(args: &BenchArgs) -> Result<LimitResult, String> {
    let settings = args.settings()?;
    let target = target_of(&args.source, &settings)?;
    let prefix = match &target {
        Target::S3 { prefix, .. } => prefix.clone(),
        Target::Local { .. } => String::new(),
    };
    let opts = LimitOptions {
        size: parse_size(&args.size)?,
        concurrency: args.concurrency,
        part_size: settings.part_size,
        cold: args.cold,
    };
    let rt = tokio::runtime::Runtime::new().map_err(|e| format!("runtime: {e}"))?;
    rt.block_on(async {
        let (store, metrics, _) = open_store(&settings, &target).await?;
        let key = format!("{prefix}.bucketfs-bench-{}", std::process::id());
        measure(store, &metrics, &key, &opts)
            .await
            .map_err(|e| e.to_string())
    })
}

/// Writes dirty pages out and drops the clean ones, as the bench suite does before a read phase.
fn drop_page_cache() -> std::io::Result<()> {
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() };
    std::fs::write("/proc/sys/vm/drop_caches", "3")
}

/// Fast xorshift bytes: incompressible enough that no layer can cheat by compressing.
fn pseudo_random(n: usize) -> Vec<u8> {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15 ^ std::process::id() as u64;
    let mut out = Vec::with_capacity(n + 8);
    while out.len() < n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(n);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use bucketfs_store::memory::MemoryStore;
    use bucketfs_store::metrics::MeteredStore;

    #[tokio::test]
    async fn measures_and_cleans_up() {
        let mem = Arc::new(MemoryStore::new());
        let metered = MeteredStore::new(mem.clone() as Arc<dyn ObjectStore>);
        let metrics = metered.metrics();
        let opts = LimitOptions {
            size: 12 << 20,
            concurrency: 4,
            part_size: 5 << 20,
            cold: false,
        };
        let r = measure(Arc::new(metered), &metrics, "bench/x", &opts)
            .await
            .unwrap();
        assert_eq!((r.put_requests, r.get_requests), (3, 3));
        assert!(r.put_mb_s > 0.0 && r.get_mb_s > 0.0);
        assert!(mem.keys().is_empty());
        assert_eq!(mem.pending_uploads(), 0);
    }
}
