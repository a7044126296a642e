//! `bucketfs warmup PATH...`: reads files (and the trees under directories) through their
//! mount, several at once, so a mount with `--data-cache` holds them before a job reads them.
//! Reading through the mount is the whole mechanism: the daemon caches what it fetches. The
//! summary's "already cached" is what the mounts' data caches served during the first pass
//! (their stats sockets), so it assumes nothing else reads from those mounts at the same time.
//!
//! A daemon whose cache writer is behind does not cache a block it fetched (it counts it as
//! skipped rather than make the read wait). So a pass ends by waiting for the writers to
//! finish what they were given, and while a pass left blocks out, the files are read again
//! with fewer at once (the cached ones cost a local read), up to [`PASSES`] passes.

use crate::args::WarmupArgs;
use crate::metrics_http::stats_socket;
use std::collections::{BTreeMap, BTreeSet};
use std::io::{IsTerminal, Read};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The mount point holding `path`: the nearest ancestor a bucketfs daemon has a stats socket
/// for.
fn mount_of(path: &Path) -> Option<PathBuf> {
    path.ancestors()
        .find(|a| stats_socket(a).exists())
        .map(Path::to_path_buf)
}

/// Passes at most over the files: the first, and more while blocks were left out, each with
/// half the readers of the one before, down to one (from the default 64). Four were not
/// always enough once opens and closes got cheaper (no FLUSH for read-only closes): readers
/// of small files outran a writer syncing each whole copy even 8 at once.
const PASSES: usize = 7;
/// How long a pass waits at most for the cache writers to finish what they were given.
const DRAIN_WAIT: Duration = Duration::from_secs(120);
/// A drain during which the writers' queue does not change for this long ends: their disk
/// hangs (another pass would read every file from the bucket again for nothing). Not "no
/// new low": other readers of the mounts may keep the queue up while the writers write.
const DRAIN_STALL: Duration = Duration::from_secs(10);

/// What the data caches of a set of mounts say, summed.
#[derive(Default, Clone, Copy)]
struct CacheCounts {
    /// Bytes served (files handed to the kernel whole included).
    served: u64,
    /// Fetched blocks left out because a writer was behind.
    skipped: u64,
    /// Blocks given to the writers and not written yet.
    queued: u64,
    /// Files evicted (blocks, whole copies).
    evicted: u64,
    /// Any of the mounts has a data cache.
    any: bool,
}

/// The size of mount `m`'s data cache (0: none, or its daemon does not answer).
fn cache_limit(m: &Path) -> u64 {
    crate::stats::fetch(&stats_socket(m))
        .ok()
        .and_then(|s| s.get("bucketfs_data_cache_limit_bytes").copied())
        .unwrap_or(0.0) as u64
}

/// The mounts (of `bytes`: mount and the bytes of the files to warm there) whose data cache
/// cannot hold those files, said on stderr: warming them evicts what it warmed first.
fn too_big(bytes: &BTreeMap<PathBuf, u64>) -> bool {
    let mut any = false;
    for (m, &n) in bytes {
        let limit = cache_limit(m);
        if limit > 0 && n > limit {
            eprintln!(
                "bucketfs: warmup: the files to warm in {} take {:.1} MB, more than its data \
                 cache holds ({:.1} MB, --data-cache-size): only the last read stay in it",
                m.display(),
                n as f64 / 1e6,
                limit as f64 / 1e6
            );
            any = true;
        }
    }
    any
}

fn cache_counts(mounts: &BTreeSet<PathBuf>) -> CacheCounts {
    let mut c = CacheCounts::default();
    for m in mounts {
        if let Ok(s) = crate::stats::fetch(&stats_socket(m)) {
            let get = |k: &str| s.get(k).copied().unwrap_or(0.0) as u64;
            c.served += get("bucketfs_data_cache_bytes_served_total");
            c.served += get("bucketfs_passthrough_bytes_total");
            c.skipped += get("bucketfs_data_cache_skipped_total");
            c.queued += get("bucketfs_data_cache_queued_blocks");
            c.evicted += get("bucketfs_data_cache_evictions_total");
            c.any |= get("bucketfs_data_cache_limit_bytes") > 0;
        }
    }
    c
}

/// Waits until the mounts' cache writers have written every block they were given, for
/// [`DRAIN_WAIT`] at most, and [`DRAIN_STALL`] with the queue unchanged; whether they did.
fn drain(mounts: &BTreeSet<PathBuf>) -> bool {
    drain_queue(|| cache_counts(mounts).queued, DRAIN_WAIT, DRAIN_STALL)
}

/// [`drain`] of a queue whose length `queued` says.
fn drain_queue(queued: impl Fn() -> u64, wait: Duration, stall: Duration) -> bool {
    let start = Instant::now();
    let (mut last, mut moved) = (u64::MAX, start);
    loop {
        let n = queued();
        if n == 0 {
            return true;
        }
        if n != last {
            (last, moved) = (n, Instant::now());
        }
        if start.elapsed() >= wait || moved.elapsed() >= stall {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Reads `files`, `jobs` at once; returns the bytes read and the errors. With `progress`,
/// redraws a progress line on stderr.
fn read_pass(files: &[(PathBuf, u64)], jobs: usize, progress: bool) -> (u64, Vec<String>) {
    let total_bytes: u64 = files.iter().map(|f| f.1).sum();
    let count = files.len();
    let queue = Mutex::new(files.iter());
    let (done, bytes) = (AtomicU64::new(0), AtomicU64::new(0));
    let failed = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..jobs.max(1) {
            s.spawn(|| loop {
                let Some((path, _)) = queue.lock().unwrap().next() else {
                    return;
                };
                match read_all(path) {
                    Ok(n) => {
                        bytes.fetch_add(n, Ordering::Relaxed);
                    }
                    Err(e) => failed
                        .lock()
                        .unwrap()
                        .push(format!("{}: {e}", path.display())),
                }
                done.fetch_add(1, Ordering::Relaxed);
            });
        }
        if progress {
            // Files and bytes, redrawn in place.
            while done.load(Ordering::Relaxed) < count as u64 {
                eprint!(
                    "\r{}/{count} files, {:.1}/{:.1} MB",
                    done.load(Ordering::Relaxed),
                    bytes.load(Ordering::Relaxed) as f64 / 1e6,
                    total_bytes as f64 / 1e6
                );
                std::thread::sleep(Duration::from_millis(200));
            }
            eprint!("\r\x1b[K");
        }
    });
    (bytes.into_inner(), failed.into_inner().unwrap())
}

/// Regular files under `p` (itself if it is one); symlinks are not followed.
fn collect(p: &Path, out: &mut Vec<(PathBuf, u64)>, errors: &mut Vec<String>) {
    match std::fs::symlink_metadata(p) {
        Ok(md) if md.is_file() => out.push((p.to_path_buf(), md.len())),
        Ok(md) if md.is_dir() => match std::fs::read_dir(p) {
            Ok(rd) => {
                for e in rd {
                    match e {
                        Ok(e) => collect(&e.path(), out, errors),
                        Err(e) => errors.push(format!("{}: {e}", p.display())),
                    }
                }
            }
            Err(e) => errors.push(format!("{}: {e}", p.display())),
        },
        Ok(_) => {}
        Err(e) => errors.push(format!("{}: {e}", p.display())),
    }
}

fn read_all(path: &Path) -> std::io::Result<u64> {
    let mut f = std::fs::File::open(path)?;
    // Pages the kernel holds already would be read from it, never reaching the daemon and
    // its data cache: dropped first (advice only; a descriptor of this process).
    // SAFETY: a valid descriptor; advice only.
    unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0;
    loop {
        match f.read(&mut buf)? {
            0 => break,
            k => n += k as u64,
        }
    }
    // The data cache keeps the bytes; the page cache need not.
    // SAFETY: a valid descriptor; advice only.
    unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    Ok(n)
}

/// Runs `bucketfs warmup`; returns the exit code.
pub fn run(args: &WarmupArgs) -> i32 {
    let start = Instant::now();
    let mut files = Vec::new();
    let mut errors = Vec::new();
    let mut mounts = BTreeSet::new();
    let mut bytes_in = BTreeMap::new();
    let mut seen = BTreeSet::new();
    for p in &args.paths {
        let p = bucketfs_fuse::absolute(p);
        match mount_of(&p) {
            Some(m) => {
                let mut found = Vec::new();
                collect(&p, &mut found, &mut errors);
                // A file named twice (a tree and a file in it) is read and counted once.
                for f in found {
                    if seen.insert(f.0.clone()) {
                        *bytes_in.entry(m.clone()).or_default() += f.1;
                        files.push(f);
                    }
                }
                mounts.insert(m);
            }
            None => {
                eprintln!(
                    "bucketfs: warmup: {} is not inside a bucketfs mount",
                    p.display()
                );
                return 1;
            }
        }
    }
    let count = files.len();
    let first = cache_counts(&mounts);
    if !first.any {
        eprintln!(
            "bucketfs: warmup: note: no --data-cache on {}: the files are read, but only the \
             page cache keeps them",
            mounts
                .iter()
                .map(|m| m.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let overflow = too_big(&bytes_in);
    let tty = std::io::stderr().is_terminal();
    let (read, failed) = read_pass(&files, args.jobs, tty);
    let mut drained = drain(&mounts);
    let after_first = cache_counts(&mounts);
    let already = after_first.served.saturating_sub(first.served);
    // Blocks the writers had no room for: read again, fewer at once, until none is left out;
    // not while they write nothing (a hung cache disk: each pass would be for nothing).
    let (mut passes, mut before, mut left_out) = (1, first, after_first);
    if !drained && first.any {
        eprintln!("bucketfs: warmup: the cache writers write nothing (is the cache disk hung?)");
    }
    while first.any && drained && left_out.skipped > before.skipped && passes < PASSES {
        passes += 1;
        if tty {
            eprintln!(
                "bucketfs: warmup: {} blocks were not cached (the cache writer was behind): pass {passes}",
                left_out.skipped - before.skipped
            );
        }
        before = left_out;
        read_pass(&files, (args.jobs >> (passes - 1)).max(1), tty);
        drained = drain(&mounts);
        left_out = cache_counts(&mounts);
    }
    let secs = start.elapsed().as_secs_f64();
    errors.extend(failed);
    for e in &errors {
        eprintln!("bucketfs: warmup: {e}");
    }
    let not_cached = left_out.skipped.saturating_sub(before.skipped);
    let evicted = left_out.evicted.saturating_sub(first.evicted);
    println!(
        "warmup: {count} files, {:.1} MB in {secs:.1} s ({:.1} MB/s), {:.1} MB already cached, \
         {passes} {}, {not_cached} blocks not cached, {evicted} cache files evicted, {} errors",
        read as f64 / 1e6,
        read as f64 / 1e6 / secs.max(1e-3),
        already as f64 / 1e6,
        if passes == 1 { "pass" } else { "passes" },
        errors.len()
    );
    if overflow {
        eprintln!("bucketfs: warmup: the data cache is too small for these files (see above)");
    }
    i32::from(!errors.is_empty() || overflow)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer that writes nothing (a hung cache disk) ends the drain after the stall, not
    /// the whole wait, and says so: the passes stop (each read every file from the bucket
    /// again, 7 in all, with 2 minutes of drain each). One that writes on is waited for.
    #[test]
    fn a_drain_ends_when_the_writers_write_nothing() {
        let t = Instant::now();
        let stuck = drain_queue(|| 5, Duration::from_secs(30), Duration::from_millis(300));
        assert!(!stuck);
        assert!(t.elapsed() < Duration::from_secs(5));
        let left = AtomicU64::new(8);
        let moving = drain_queue(
            || {
                std::thread::sleep(Duration::from_millis(100));
                left.fetch_sub(1, Ordering::Relaxed) - 1
            },
            Duration::from_secs(30),
            Duration::from_millis(300),
        );
        assert!(moving);
    }
}
