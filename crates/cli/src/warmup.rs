//! `bucketfs warmup PATH...`: reads files (and the trees under directories) through their
//! mount, several at once, so a mount with `--data-cache` holds them before a job reads them.
//! Reading through the mount is the whole mechanism: the daemon caches what it fetches. The
//! summary's "already cached" is what the mounts' data caches served meanwhile (their stats
//! sockets), so it assumes nothing else reads from those mounts at the same time.

use crate::args::WarmupArgs;
use crate::metrics_http::stats_socket;
use std::collections::BTreeSet;
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

/// Bytes the data caches of `mounts` have served (files handed to the kernel whole
/// included), and whether any of them has one.
fn served(mounts: &BTreeSet<PathBuf>) -> (u64, bool) {
    let mut total = 0;
    let mut any = false;
    for m in mounts {
        if let Ok(s) = crate::stats::fetch(&stats_socket(m)) {
            let get = |k: &str| s.get(k).copied().unwrap_or(0.0);
            total += get("bucketfs_data_cache_bytes_served_total") as u64;
            total += get("bucketfs_passthrough_bytes_total") as u64;
            any |= get("bucketfs_data_cache_limit_bytes") > 0.0;
        }
    }
    (total, any)
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
    for p in &args.paths {
        let p = bucketfs_fuse::absolute(p);
        match mount_of(&p) {
            Some(m) => {
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
        collect(&p, &mut files, &mut errors);
    }
    let (before, cached) = served(&mounts);
    if !cached {
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
    let total_bytes: u64 = files.iter().map(|f| f.1).sum();
    let count = files.len();
    let queue = Mutex::new(files);
    let (done, bytes) = (AtomicU64::new(0), AtomicU64::new(0));
    let failed = Mutex::new(errors);
    let tty = std::io::stderr().is_terminal();
    std::thread::scope(|s| {
        for _ in 0..args.jobs.max(1) {
            s.spawn(|| loop {
                let Some((path, _)) = queue.lock().unwrap().pop() else {
                    return;
                };
                match read_all(&path) {
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
        if tty {
            // Progress on a terminal: files and bytes, redrawn in place.
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
    let (after, _) = served(&mounts);
    let secs = start.elapsed().as_secs_f64();
    let read = bytes.load(Ordering::Relaxed);
    let failed = failed.into_inner().unwrap();
    for e in &failed {
        eprintln!("bucketfs: warmup: {e}");
    }
    println!(
        "warmup: {count} files, {:.1} MB in {secs:.1} s ({:.1} MB/s), {:.1} MB already cached, {} errors",
        read as f64 / 1e6,
        read as f64 / 1e6 / secs.max(1e-3),
        after.saturating_sub(before) as f64 / 1e6,
        failed.len()
    );
    i32::from(!failed.is_empty())
}
