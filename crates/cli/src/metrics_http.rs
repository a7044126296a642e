//! Serving the counters: `--metrics-addr` (Prometheus text over HTTP at `/metrics`) and the
//! per-mount stats socket that `bucketfs stats` reads.
//!
//! Both are deliberately tiny: one request per connection, no keep-alive. They only read
//! counters, so they cannot disturb the data path.

use bucketfs_fs::FsMetrics;
use bucketfs_store::metrics::StoreMetrics;
use bucketfs_store::retry::RetryMetrics;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, UnixListener};

/// Everything a mount counts, rendered on demand.
#[derive(Clone)]
pub struct Counters {
    pub store: Arc<StoreMetrics>,
    pub fs: Arc<FsMetrics>,
    /// What the retry layer did.
    pub retry: Arc<RetryMetrics>,
    /// Inodes the fs core holds right now.
    pub inodes: Arc<dyn Fn() -> usize + Send + Sync>,
}

impl Counters {
    pub fn text(&self) -> String {
        let mut s = self.store.prometheus();
        s += &self.fs.prometheus();
        let r = &self.retry;
        for (name, help, v) in [
            (
                "bucketfs_store_retries_total",
                "Store requests attempted again after a transient failure",
                &r.retries,
            ),
            (
                "bucketfs_store_retry_recovered_total",
                "Store calls that succeeded after retries",
                &r.recovered,
            ),
            (
                "bucketfs_store_retry_gave_up_total",
                "Store calls that failed after their retry budget",
                &r.gave_up,
            ),
            (
                "bucketfs_store_outages_total",
                "Periods longer than the retry budget without a successful store call",
                &r.outages,
            ),
        ] {
            s += &format!(
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}\n",
                RetryMetrics::get(v)
            );
        }
        s += &format!(
            "# HELP bucketfs_inodes Inodes held by the file system\n# TYPE bucketfs_inodes gauge\n\
             bucketfs_inodes {}\n",
            (self.inodes)()
        );
        s
    }
}

/// Binds `addr` (fails at startup with a clear message if it cannot) and serves forever.
pub async fn serve_http(addr: SocketAddr, counters: Counters) -> std::io::Result<()> {
    let listener = TcpListener::bind(addr).await?;
    tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                continue;
            };
            let counters = counters.clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 2048];
                let n = sock.read(&mut buf).await.unwrap_or(0);
                let req = String::from_utf8_lossy(&buf[..n]);
                let path = req.split_whitespace().nth(1).unwrap_or("");
                let (status, body) = if path == "/metrics" || path == "/" {
                    ("200 OK", counters.text())
                } else {
                    ("404 Not Found", "not found\n".to_string())
                };
                let head = format!(
                    "HTTP/1.0 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\n\r\n",
                    body.len()
                );
                let _ = sock.write_all(head.as_bytes()).await;
                let _ = sock.write_all(body.as_bytes()).await;
            });
        }
    });
    Ok(())
}

/// Where the stats socket of the mount at `mountpoint` lives: a directory private to the user
/// (`/run/bucketfs` for root), named after the mount point so `bucketfs stats` can find it.
pub fn stats_socket(mountpoint: &Path) -> PathBuf {
    // SAFETY: getuid cannot fail.
    let uid = unsafe { libc::getuid() };
    let dir = if uid == 0 {
        PathBuf::from("/run/bucketfs")
    } else {
        PathBuf::from(format!("/tmp/bucketfs-{uid}"))
    };
    // FNV-1a: stable across builds, unlike the std hasher.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in mountpoint.as_os_str().as_encoded_bytes() {
        h ^= *b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    dir.join(format!("{h:016x}.sock"))
}

/// Serves the counters on the stats socket until the returned guard is dropped.
pub fn serve_socket(path: &Path, counters: Counters) -> std::io::Result<SocketGuard> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    }
    let _ = std::fs::remove_file(path); // left by a daemon that was killed
    let listener = UnixListener::bind(path)?;
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                continue;
            };
            let _ = sock.write_all(counters.text().as_bytes()).await;
        }
    });
    Ok(SocketGuard {
        path: path.to_path_buf(),
        task,
    })
}

/// Stops serving and removes the socket file.
pub struct SocketGuard {
    path: PathBuf,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for SocketGuard {
    fn drop(&mut self) {
        self.task.abort();
        let _ = std::fs::remove_file(&self.path);
    }
}
