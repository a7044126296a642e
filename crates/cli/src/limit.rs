//! `bucketfs bench`: the store's own speed with no file system in between — the limit the
//! bench suite compares every mounted system against.
//!
//! It writes one object as a parallel multipart upload and reads it back as parallel ranged
//! GETs, through the same store layer (and so the same HTTP client and settings) the mount
//! uses, and deletes it afterwards. With `--small-count N` it also PUTs and GETs N small
//! objects with many requests in flight: the limit of a small-file workload, whose cost is
//! per request, not per byte, so one large object says nothing about it.

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

pub struct SmallOptions {
    /// Objects to PUT then GET (0: skip).
    pub count: usize,
    /// Bytes of each.
    pub size: u64,
    /// Requests in flight at once.
    pub concurrency: usize,
}

#[derive(Debug)]
pub struct SmallResult {
    pub count: usize,
    pub size: u64,
    pub concurrency: usize,
    pub put_mb_s: f64,
    pub get_mb_s: f64,
    pub put_files_s: f64,
    pub get_files_s: f64,
}

#[derive(Debug)]
pub struct LimitResult {
    pub put_mb_s: f64,
    pub get_mb_s: f64,
    pub put_requests: u64,
    pub get_requests: u64,
    pub small: Option<SmallResult>,
}

impl LimitResult {
    pub fn json(&self) -> String {
        let small = self.small.as_ref().map_or(String::new(), |s| {
            format!(
                ", \"small_count\": {}, \"small_size\": {}, \"small_concurrency\": {}, \
                 \"small_put_mb_s\": {:.1}, \"small_get_mb_s\": {:.1}, \
                 \"small_put_files_s\": {:.1}, \"small_get_files_s\": {:.1}",
                s.count,
                s.size,
                s.concurrency,
                s.put_mb_s,
                s.get_mb_s,
                s.put_files_s,
                s.get_files_s
            )
        });
        format!(
            "{{\"put_mb_s\": {:.1}, \"get_mb_s\": {:.1}, \"put_requests\": {}, \"get_requests\": {}{small}}}",
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
        .create(key, &Default::default(), None)
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
        small: None,
    })
}

/// PUTs `count` objects of `size` bytes under `prefix`, then GETs each whole (one request
/// each, as a mount reads a small file), `concurrency` requests in flight; removes them.
pub async fn measure_small(
    store: Arc<dyn ObjectStore>,
    prefix: &str,
    opts: &SmallOptions,
    cold: bool,
) -> Result<SmallResult, StoreError> {
    let body = Bytes::from(pseudo_random(opts.size as usize));
    let keys: Vec<String> = (0..opts.count)
        .map(|i| format!("{prefix}{:03}/f{i:07}", i % 100))
        .collect();
    let conc = opts.concurrency.max(1);
    let started = Instant::now();
    let put: Result<Vec<String>, StoreError> = stream::iter(keys.iter())
        .map(|k| {
            let (store, body) = (store.clone(), body.clone());
            async move { store.put(k, body, &Default::default()).await }
        })
        .buffer_unordered(conc)
        .try_collect()
        .await;
    let put_secs = started.elapsed().as_secs_f64();
    let got = match put {
        Ok(_) => {
            if cold {
                drop_page_cache().map_err(|e| StoreError::Other(format!("--cold: {e}")))?;
            }
            let started = Instant::now();
            let got: Result<Vec<u64>, StoreError> = stream::iter(keys.iter())
                .map(|k| {
                    let store = store.clone();
                    async move { Ok(store.get_range(k, 0..opts.size, None).await?.len() as u64) }
                })
                .buffer_unordered(conc)
                .try_collect()
                .await;
            got.map(|g| (g.iter().sum::<u64>(), started.elapsed().as_secs_f64()))
        }
        Err(e) => Err(e),
    };
    let _: Vec<_> = stream::iter(keys.iter())
        .map(|k| store.delete(k))
        .buffer_unordered(conc)
        .collect()
        .await;
    let (read, get_secs) = got?;
    let total = opts.size * opts.count as u64;
    if read != total {
        return Err(StoreError::Other(format!(
            "small objects: read back {read} bytes of {total}"
        )));
    }
    let n = opts.count as f64;
    Ok(SmallResult {
        count: opts.count,
        size: opts.size,
        concurrency: conc,
        put_mb_s: mb_s(total, put_secs),
        get_mb_s: mb_s(total, get_secs),
        put_files_s: n / put_secs.max(1e-9),
        get_files_s: n / get_secs.max(1e-9),
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
                if let Some(s) = &r.small {
                    println!(
                        "{} x {} B, {} in flight: PUT {:.1} MB/s ({:.0} objects/s), GET {:.1} MB/s ({:.0} objects/s)",
                        s.count, s.size, s.concurrency, s.put_mb_s, s.put_files_s, s.get_mb_s, s.get_files_s
                    );
                }
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
    let small = SmallOptions {
        count: args.small_count,
        size: parse_size(&args.small_size)?,
        concurrency: args.small_concurrency,
    };
    let rt = tokio::runtime::Runtime::new().map_err(|e| format!("runtime: {e}"))?;
    rt.block_on(async {
        let opened = open_store(&settings, &target).await?;
        let (store, metrics) = (opened.store, opened.metrics);
        let key = format!("{prefix}.bucketfs-bench-{}", std::process::id());
        let mut r = if opts.size > 0 {
            measure(store.clone(), &metrics, &key, &opts)
                .await
                .map_err(|e| e.to_string())?
        } else {
            LimitResult {
                put_mb_s: 0.0,
                get_mb_s: 0.0,
                put_requests: 0,
                get_requests: 0,
                small: None,
            }
        };
        if small.count > 0 {
            let dir = format!("{key}-small/");
            r.small = Some(
                measure_small(store, &dir, &small, opts.cold)
                    .await
                    .map_err(|e| e.to_string())?,
            );
        }
        Ok(r)
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

    #[tokio::test]
    async fn small_objects_are_measured_and_removed() {
        let mem = Arc::new(MemoryStore::new());
        let metered = MeteredStore::new(mem.clone() as Arc<dyn ObjectStore>);
        let metrics = metered.metrics();
        let opts = SmallOptions {
            count: 300,
            size: 128 << 10,
            concurrency: 128,
        };
        let r = measure_small(Arc::new(metered), "bench/s/", &opts, false)
            .await
            .unwrap();
        // One PUT and one whole-object GET per object, nothing else.
        assert_eq!(metrics.requests(Op::Put), 300);
        assert_eq!(metrics.requests(Op::Get), 300);
        assert_eq!((r.count, r.size, r.concurrency), (300, 128 << 10, 128));
        assert!(r.put_files_s > 0.0 && r.get_mb_s > 0.0);
        assert!(mem.keys().is_empty());
        let whole = LimitResult {
            put_mb_s: 1.0,
            get_mb_s: 2.0,
            put_requests: 1,
            get_requests: 1,
            small: Some(r),
        };
        let doc = whole.json();
        assert!(
            doc.contains("\"small_get_files_s\"") && doc.ends_with('}'),
            "{doc}"
        );
    }
}
