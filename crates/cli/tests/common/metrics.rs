//! The daemon's counters: store requests from `bucketfs stats`, values from its Prometheus
//! endpoint.

use super::run_cli;
use std::collections::HashMap;
use std::ffi::OsString;
use std::io::{Read, Write};
use std::path::Path;
use std::time::Duration;

/// A `127.0.0.1:port` nobody listens on (for `--metrics-addr`).
pub fn free_local_addr() -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    format!("127.0.0.1:{port}")
}

/// One value from a daemon's Prometheus endpoint at `addr`.
pub fn metric(addr: &str, name: &str) -> u64 {
    let mut s = std::net::TcpStream::connect(addr).expect("metrics endpoint");
    s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("{name} not in the metrics:\n{text}"))
}

/// Store requests the daemon of mount `mp` has sent so far, by operation (`head`, `list`,
/// `get`, ...), from `bucketfs stats MOUNTPOINT --once`. Operations not sent are absent.
pub fn store_requests(mp: &Path) -> HashMap<String, u64> {
    let run = run_cli(
        &[
            OsString::from("stats"),
            mp.as_os_str().to_owned(),
            OsString::from("--once"),
        ],
        &[],
        None,
        Duration::from_secs(30),
    );
    assert_eq!(run.status.and_then(|s| s.code()), Some(0), "{run:?}");
    let line = run
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("requests"))
        .unwrap_or_else(|| panic!("no requests line in stats output:\n{}", run.stdout));
    let words: Vec<&str> = line.split_whitespace().collect();
    words
        .chunks(2)
        .filter(|w| w.len() == 2)
        .filter_map(|w| Some((w[0].to_string(), w[1].parse().ok()?)))
        .collect()
}

/// What `store_requests` counted from `before` to `after`, by operation (zeros left out).
pub fn requests_between(
    before: &HashMap<String, u64>,
    after: &HashMap<String, u64>,
) -> std::collections::BTreeMap<String, u64> {
    after
        .iter()
        .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0)))
        .filter(|(_, v)| *v > 0)
        .collect()
}
