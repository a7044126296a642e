//! `bucketfs stats <MOUNTPOINT>`: a live view of a mount — throughput, requests per second by
//! type, cache hit rates, buffers and uploads in flight — refreshed every second from the
//! daemon's stats socket.

use crate::args::StatsArgs;
use crate::metrics_http::stats_socket;
use std::collections::BTreeMap;
use std::io::{IsTerminal, Read};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

type Sample = BTreeMap<String, f64>;

pub fn fetch(path: &std::path::Path) -> Result<Sample, String> {
    Ok(parse(&fetch_text(path)?))
}

fn fetch_text(path: &std::path::Path) -> Result<String, String> {
    let mut sock = UnixStream::connect(path).map_err(|e| format!("{}: {e}", path.display()))?;
    sock.set_read_timeout(Some(Duration::from_secs(5))).ok();
    let mut text = String::new();
    sock.read_to_string(&mut text)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(text)
}

/// `bucketfs pending MOUNTPOINT`: the files of a background-upload mount not in the bucket
/// yet, one a line (state, size, key, error, write-back file), then a summary.
pub fn pending(a: &crate::args::PendingArgs) -> i32 {
    // Not canonicalize: it would stat the mount, which may be the hung one to look into.
    let mp = bucketfs_fuse::absolute(&a.mountpoint);
    let text = match fetch_text(&stats_socket(&mp)) {
        Ok(t) => t,
        Err(e) => {
            eprintln!(
                "bucketfs: pending: {e} (is {} a bucketfs mount?)",
                mp.display()
            );
            return 1;
        }
    };
    let (mut files, mut bytes, mut failed) = (0, 0u64, 0);
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("# pending\t") else {
            continue;
        };
        let f: Vec<&str> = rest.splitn(5, '\t').collect();
        if f.len() < 5 {
            continue;
        }
        let size: u64 = f[1].parse().unwrap_or(0);
        files += 1;
        bytes += size;
        if f[0] == "failed" || f[0] == "conflict" {
            failed += 1;
        }
        let err = if f[3] == "\"\"" {
            String::new()
        } else {
            format!("  error: {}", f[3])
        };
        println!("{:<9} {:>12}  {}{err}  ({})", f[0], size, f[2], f[4]);
    }
    println!("{files} file(s), {bytes} bytes not in the bucket yet; {failed} failed");
    0
}

/// Parses Prometheus text lines `name{labels} value` into a map.
pub fn parse(text: &str) -> Sample {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((k.to_string(), v.parse().ok()?))
        })
        .collect()
}

fn ratio(hits: f64, misses: f64) -> String {
    if hits + misses == 0.0 {
        "-".into()
    } else {
        format!("{:.1}%", 100.0 * hits / (hits + misses))
    }
}

/// One screen: rates over `secs` between `prev` and `cur` (cumulative totals if no `prev`).
pub fn render(prev: Option<&Sample>, cur: &Sample, secs: f64) -> String {
    let get = |s: &Sample, k: &str| s.get(k).copied().unwrap_or(0.0);
    let delta = |k: &str| match prev {
        Some(p) => (get(cur, k) - get(p, k)) / secs.max(1e-9),
        None => get(cur, k),
    };
    let unit = if prev.is_some() { "/s" } else { "" };
    let mut out = String::new();
    out += &format!(
        "throughput   up {:>10.1} MB{unit}   down {:>10.1} MB{unit}\n",
        delta("bucketfs_store_bytes_up_total") / 1e6,
        delta("bucketfs_store_bytes_down_total") / 1e6
    );
    out += "requests";
    let mut any = false;
    for (k, _) in cur.iter() {
        if let Some(op) = k
            .strip_prefix("bucketfs_store_requests_total{op=\"")
            .and_then(|r| r.strip_suffix("\"}"))
        {
            let n = delta(k);
            if n > 0.0 {
                out += &format!("   {op} {n:.0}{unit}");
                any = true;
            }
        }
    }
    if !any {
        out += "   none";
    }
    out += "\n";
    let errors: f64 = cur
        .keys()
        .filter(|k| k.starts_with("bucketfs_store_errors_total"))
        .map(|k| delta(k))
        .fold(0.0, |a, b| a + b);
    out += &format!("errors       {errors:.0}{unit}\n");
    let (ah, am) = (
        delta("bucketfs_attr_cache_hits_total"),
        delta("bucketfs_attr_cache_misses_total"),
    );
    let (rh, rm) = (
        delta("bucketfs_read_hits_total"),
        delta("bucketfs_read_misses_total"),
    );
    out += &format!(
        "cache hits   attributes {}   reads {}   prefetch resets {:.0}{unit}\n",
        ratio(ah, am),
        ratio(rh, rm),
        delta("bucketfs_prefetch_resets_total")
    );
    // Only for a mount with a data cache.
    if get(cur, "bucketfs_data_cache_limit_bytes") > 0.0 {
        let (dh, dm) = (
            delta("bucketfs_data_cache_hits_total"),
            delta("bucketfs_data_cache_misses_total"),
        );
        out += &format!(
            "data cache   hits {dh:.0}{unit}   misses {dm:.0}{unit} ({})   served {:.1} MB{unit}   evictions {:.0}{unit}   size {:.1} MiB   corrupt {:.0}{unit}   errors {:.0}{unit}   not cached {:.0}{unit}\n",
            ratio(dh, dm),
            delta("bucketfs_data_cache_bytes_served_total") / 1e6,
            delta("bucketfs_data_cache_evictions_total"),
            get(cur, "bucketfs_data_cache_bytes") / (1024.0 * 1024.0),
            delta("bucketfs_data_cache_corrupt_total"),
            delta("bucketfs_data_cache_errors_total"),
            delta("bucketfs_data_cache_skipped_total"),
        );
        // Opens the kernel reads itself from the cache's copy: their reads are not counted above.
        out += &format!(
            "passthrough  {:.0} opens{unit}   {:.1} MB{unit} in those files\n",
            delta("bucketfs_passthrough_opens_total"),
            delta("bucketfs_passthrough_bytes_total") / 1e6,
        );
    }
    out += &format!(
        "memory       {:.1} MiB in buffers   {:.0} part uploads in flight\n",
        get(cur, "bucketfs_buffer_bytes") / (1024.0 * 1024.0),
        get(cur, "bucketfs_uploads_in_flight")
    );
    out += &format!(
        "files        {:.0} published{unit}   {:.0} failed{unit}   {:.0} unreadable streamed{unit}\n",
        delta("bucketfs_files_published_total"),
        delta("bucketfs_publish_errors_total"),
        delta("bucketfs_unreadable_streamed_total")
    );
    out
}

/// Runs `bucketfs stats`; returns the exit code.
pub fn run(args: &StatsArgs) -> i32 {
    let mp = bucketfs_fuse::absolute(&args.mountpoint);
    let path = stats_socket(&mp);
    let mut prev = match fetch(&path) {
        Ok(s) => s,
        Err(e) => {
            eprintln!(
                "bucketfs: stats: no bucketfs daemon answers for {} ({e})",
                mp.display()
            );
            return 1;
        }
    };
    if args.once {
        print!("{}", render(None, &prev, 1.0));
        return 0;
    }
    let tty = std::io::stdout().is_terminal();
    let mut at = Instant::now();
    loop {
        std::thread::sleep(Duration::from_secs(1));
        let cur = match fetch(&path) {
            Ok(s) => s,
            Err(_) => {
                eprintln!("bucketfs: stats: {} is no longer mounted", mp.display());
                return 0;
            }
        };
        let secs = at.elapsed().as_secs_f64();
        at = Instant::now();
        if tty {
            println!("\x1b[2J\x1b[H{}", mp.display());
        }
        print!("{}", render(Some(&prev), &cur, secs));
        if !tty {
            println!();
        }
        prev = cur;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_rates_from_two_samples() {
        let a = parse(
            "# TYPE x counter\nbucketfs_store_requests_total{op=\"get\"} 10\n\
             bucketfs_store_bytes_down_total 1000000\nbucketfs_read_hits_total 3\n\
             bucketfs_read_misses_total 1\n",
        );
        let b = parse(
            "bucketfs_store_requests_total{op=\"get\"} 30\n\
             bucketfs_store_bytes_down_total 21000000\nbucketfs_read_hits_total 9\n\
             bucketfs_read_misses_total 1\nbucketfs_buffer_bytes 2097152\n",
        );
        let out = render(Some(&a), &b, 2.0);
        assert!(out.contains("down       10.0 MB/s"), "{out}");
        assert!(out.contains("get 10/s"), "{out}");
        assert!(out.contains("reads 100.0%"), "{out}");
        assert!(out.contains("errors       0/s"), "{out}");
        assert!(out.contains("2.0 MiB in buffers"), "{out}");
    }
}
