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

/// How long a daemon may take to give its whole answer.
const ANSWER_WITHIN: Duration = Duration::from_secs(10);

fn fetch_text(path: &std::path::Path) -> Result<String, String> {
    fetch_text_within(path, ANSWER_WITHIN)
}

/// Reads the daemon's answer on the stats socket at `path`, whole within `limit`. Only from
/// a process of this user: a user's socket directory is in /tmp, where another user may have
/// made it first and planted a socket of their own.
fn fetch_text_within(path: &std::path::Path, limit: Duration) -> Result<String, String> {
    // On a thread, left behind if it never ends: a connect waits for good once the backlog
    // of a daemon that does not accept (stopped, hung) is full.
    let (p, deadline) = (path.to_path_buf(), Instant::now() + limit);
    crate::run::within(limit, move || exchange(&p, deadline)).unwrap_or_else(|| {
        Err(format!(
            "{}: no whole answer within {} s",
            path.display(),
            limit.as_secs()
        ))
    })
}

/// Connects to the stats socket at `path` and reads the whole answer by `deadline`.
fn exchange(path: &std::path::Path, deadline: Instant) -> Result<String, String> {
    let limit = deadline.saturating_duration_since(Instant::now());
    let fail = |e: std::io::Error| format!("{}: {e}", path.display());
    let mut sock = UnixStream::connect(path).map_err(fail)?;
    let server = peer_uid(&sock).map_err(fail)?;
    // SAFETY: getuid cannot fail.
    let me = unsafe { libc::getuid() };
    if server != me {
        return Err(format!(
            "{}: served by another user (uid {server}), not by a daemon of yours: not read",
            path.display()
        ));
    }
    let mut answer = Vec::new();
    let mut buf = [0u8; 64 << 10];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!(
                "{}: no whole answer within {} s",
                path.display(),
                limit.as_secs()
            ));
        }
        sock.set_read_timeout(Some(left)).map_err(fail)?;
        match sock.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => answer.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(fail(e)),
        }
    }
    String::from_utf8(answer).map_err(|e| format!("{}: {e}", path.display()))
}

/// The uid of the process that made the socket `sock` is connected to (`SO_PEERCRED`).
fn peer_uid(sock: &UnixStream) -> std::io::Result<u32> {
    use std::os::fd::AsRawFd;
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` outlive the call, and `len` is `cred`'s size.
    let r = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(cred.uid)
}

/// `bucketfs pending MOUNTPOINT`: the files of a background-upload mount not in the bucket
/// yet, one a line (state, size, key, error, write-back file), then a summary.
pub fn pending(a: &crate::args::PendingArgs) -> i32 {
    // Not canonicalize: it would stat the mount, which may be the hung one to look into.
    let mp = match crate::run::mountpoint_within(&a.mountpoint) {
        Ok(mp) => mp,
        Err(e) => {
            eprintln!("bucketfs: pending: {e}");
            return 1;
        }
    };
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
    let mp = match crate::run::mountpoint_within(&args.mountpoint) {
        Ok(mp) => mp,
        Err(e) => {
            eprintln!("bucketfs: stats: {e}");
            return 1;
        }
    };
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

    /// A server on a stats socket path, run as user `uid` (python3 as that user), answering
    /// `answer` slowly when `trickle`: one byte every 100 ms, for good.
    fn server_as(
        uid: u32,
        answer: &str,
        trickle: bool,
    ) -> (tempfile::TempDir, std::path::PathBuf, std::process::Child) {
        use std::os::unix::fs::PermissionsExt;
        use std::os::unix::process::CommandExt;
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        let path = dir.path().join("planted.sock");
        let script = format!(
            "import os, socket, time, sys\n\
             s = socket.socket(socket.AF_UNIX)\n\
             s.bind(sys.argv[1] + '.tmp')\n\
             s.listen(4)\n\
             os.rename(sys.argv[1] + '.tmp', sys.argv[1])\n\
             while True:\n\
             \x20   c, _ = s.accept()\n\
             \x20   if {trickle}:\n\
             \x20       while True:\n\
             \x20           c.send(b'x'); time.sleep(0.1)\n\
             \x20   c.sendall({answer:?}.encode()); c.close()\n",
            trickle = if trickle { "True" } else { "False" },
        );
        let child = std::process::Command::new("python3")
            .arg("-c")
            .arg(script)
            .arg(&path)
            .uid(uid)
            .spawn()
            .unwrap();
        // The name appears once the server listens (a connect between its bind and its
        // listen was refused: a flaky test).
        let deadline = Instant::now() + Duration::from_secs(10);
        while !path.exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(path.exists(), "the server did not start");
        (dir, path, child)
    }

    /// Another local user can make the directory the socket is looked for in (a user's is in
    /// /tmp) and plant a socket there: `bucketfs pending` then printed what that user's server
    /// said ("0 file(s) ... not in the bucket yet") for a mount with files still to upload.
    /// Only a socket this user's process serves is read.
    #[test]
    fn a_socket_another_user_serves_is_refused() {
        // SAFETY: getuid cannot fail.
        let me = unsafe { libc::getuid() };
        let other = if me == 65534 { 65533 } else { 65534 };
        let (_dir, path, mut child) = server_as(other, "bucketfs_buffer_bytes 1\n", false);
        let r = fetch_text(&path);
        let _ = child.kill();
        let _ = child.wait();
        let e = r.expect_err("read another user's socket");
        assert!(e.contains("another user"), "{e}");
    }

    /// A server that answers a byte at a time for good does not hold `stats` or `pending`:
    /// the whole answer has a time bound, not each read.
    #[test]
    fn a_socket_that_trickles_for_good_is_given_up() {
        // SAFETY: getuid cannot fail.
        let me = unsafe { libc::getuid() };
        let (_dir, path, mut child) = server_as(me, "", true);
        let start = Instant::now();
        let r = fetch_text_within(&path, Duration::from_secs(2));
        let took = start.elapsed();
        let _ = child.kill();
        let _ = child.wait();
        assert!(r.is_err(), "{r:?}");
        assert!(took < Duration::from_secs(5), "{took:?}");
    }
}
