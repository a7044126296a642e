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
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::sync::Semaphore;
use tracing::warn;

/// Everything a mount counts, rendered on demand.
#[derive(Clone)]
pub struct Counters {
    pub store: Arc<StoreMetrics>,
    pub fs: Arc<FsMetrics>,
    /// What the retry layer did.
    pub retry: Arc<RetryMetrics>,
    /// Inodes the fs core holds right now.
    pub inodes: Arc<dyn Fn() -> usize + Send + Sync>,
    /// Files waiting for a background upload (`--upload background`).
    pub pending: Arc<dyn Fn() -> Vec<bucketfs_fs::PendingFile> + Send + Sync>,
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
                "Outages: no progress of the store for the retry budget, or failures for that \
                 long without a success",
                &r.outages,
            ),
            (
                "bucketfs_store_stalls_total",
                "Store request attempts cut for making no progress",
                &r.stalls,
            ),
            (
                "bucketfs_store_fast_failed_total",
                "Store calls failed at once during an outage",
                &r.fast_failed,
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
        s += &format!(
            "# HELP bucketfs_log_lines_dropped_total Log lines dropped because the log (a file, \
             stderr or syslog) did not take them in time\n\
             # TYPE bucketfs_log_lines_dropped_total counter\n\
             bucketfs_log_lines_dropped_total {}\n",
            crate::logging::dropped_lines()
        );
        s
    }
}

/// Connections one endpoint serves at once. Beyond it the endpoint stops accepting: further
/// clients wait in the kernel's listen queue, which costs the daemon no descriptor.
pub const MAX_CONNECTIONS: usize = 64;
/// Longest a client may take to send its request head (or to take the answer).
pub const IO_TIMEOUT: Duration = Duration::from_secs(5);
/// Pauses after a failed `accept` (EMFILE, ENFILE, ENOMEM...), doubling up to the last:
/// the failed connection stays queued, so retrying at once would spin.
const ACCEPT_BACKOFF: (Duration, Duration) = (Duration::from_millis(10), Duration::from_secs(1));

/// Accepts connections of one endpoint under [`MAX_CONNECTIONS`], with a backoff on errors,
/// and runs `serve` for each one holding a slot.
async fn accept_loop<S, A, F>(name: &'static str, mut accept: A, serve: S)
where
    A: FnMut() -> F,
    F: std::future::Future<Output = std::io::Result<S::Conn>>,
    S: Serve,
{
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let mut backoff = ACCEPT_BACKOFF.0;
    let mut warned = false;
    loop {
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return;
        };
        match accept().await {
            Ok(conn) => {
                backoff = ACCEPT_BACKOFF.0;
                let serve = serve.clone();
                tokio::spawn(async move {
                    serve.serve(conn).await;
                    drop(slot);
                });
            }
            Err(e) => {
                if !warned {
                    warn!("{name}: accept failed ({e}); backing off");
                    warned = true;
                }
                drop(slot);
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(ACCEPT_BACKOFF.1);
            }
        }
    }
}

/// What one endpoint does with an accepted connection.
trait Serve: Clone + Send + 'static {
    type Conn: Send + 'static;
    fn serve(self, conn: Self::Conn) -> impl std::future::Future<Output = ()> + Send;
}

#[derive(Clone)]
struct HttpServe(Counters);

impl Serve for HttpServe {
    type Conn = TcpStream;
    async fn serve(self, mut sock: TcpStream) {
        let mut buf = [0u8; 2048];
        // An idle or trickling client gives up its slot after IO_TIMEOUT.
        let n = match tokio::time::timeout(IO_TIMEOUT, read_head(&mut sock, &mut buf)).await {
            Ok(n) => n,
            Err(_) => return,
        };
        let req = String::from_utf8_lossy(&buf[..n]);
        let path = req.split_whitespace().nth(1).unwrap_or("");
        let (status, body) = if path == "/metrics" || path == "/" {
            ("200 OK", self.0.text())
        } else {
            ("404 Not Found", "not found\n".to_string())
        };
        let head = format!(
            "HTTP/1.0 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        let _ = tokio::time::timeout(IO_TIMEOUT, async {
            sock.write_all(head.as_bytes()).await?;
            sock.write_all(body.as_bytes()).await
        })
        .await;
    }
}

/// Reads until the end of the request head, a full buffer or EOF; returns the bytes read.
async fn read_head(sock: &mut TcpStream, buf: &mut [u8]) -> usize {
    let mut n = 0;
    while n < buf.len() {
        match sock.read(&mut buf[n..]).await {
            Ok(0) | Err(_) => break,
            Ok(m) => n += m,
        }
        if buf[..n].windows(4).any(|w| w == b"\r\n\r\n") || buf[..n].ends_with(b"\n\n") {
            break;
        }
    }
    n
}

/// Binds `addr` (fails at startup with a clear message if it cannot) and serves forever.
pub async fn serve_http(addr: SocketAddr, counters: Counters) -> std::io::Result<()> {
    let listener = TcpListener::bind(addr).await?;
    tokio::spawn(async move {
        accept_loop(
            "metrics endpoint",
            {
                let l = &listener;
                move || async move { l.accept().await.map(|(s, _)| s) }
            },
            HttpServe(counters),
        )
        .await
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

#[derive(Clone)]
struct SocketServe(Counters);

impl Serve for SocketServe {
    type Conn = UnixStream;
    async fn serve(self, mut sock: UnixStream) {
        let mut text = self.0.text();
        // For `bucketfs pending` (comments to a metrics reader).
        for f in (self.0.pending)() {
            text += &format!(
                "# pending\t{}\t{}\t{:?}\t{:?}\t{}\n",
                f.state,
                f.size,
                f.key,
                f.error.unwrap_or_default(),
                f.path.display()
            );
        }
        let _ = tokio::time::timeout(IO_TIMEOUT, sock.write_all(text.as_bytes())).await;
    }
}

/// Creates (or checks) the socket's directory: it must be a real directory of this user that
/// nobody else can enter, or another user could swap the socket for their own.
fn private_socket_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    let md = std::fs::symlink_metadata(dir)?;
    // SAFETY: getuid cannot fail.
    if !md.is_dir() || md.uid() != unsafe { libc::getuid() } {
        return Err(std::io::Error::other(format!(
            "{} is not a directory of this user (owner {})",
            dir.display(),
            md.uid()
        )));
    }
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
}

/// Serves the counters on the stats socket until the returned guard is dropped.
pub fn serve_socket(path: &Path, counters: Counters) -> std::io::Result<SocketGuard> {
    use std::os::unix::fs::PermissionsExt;
    if let Some(dir) = path.parent() {
        private_socket_dir(dir)?;
    }
    let _ = std::fs::remove_file(path); // left by a daemon that was killed
    let listener = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    let bound = file_id(path)?;
    let task = tokio::spawn(async move {
        accept_loop(
            "stats socket",
            {
                let l = &listener;
                move || async move { l.accept().await.map(|(s, _)| s) }
            },
            SocketServe(counters),
        )
        .await
    });
    Ok(SocketGuard {
        path: path.to_path_buf(),
        bound,
        task,
    })
}

/// `(device, inode)` of the file at `path`.
fn file_id(path: &Path) -> std::io::Result<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let md = std::fs::symlink_metadata(path)?;
    Ok((md.dev(), md.ino()))
}

/// Stops serving and removes the socket file, if it is still the one this daemon bound.
pub struct SocketGuard {
    path: PathBuf,
    bound: (u64, u64),
    task: tokio::task::JoinHandle<()>,
}

impl Drop for SocketGuard {
    fn drop(&mut self) {
        self.task.abort();
        // A daemon detached lazily exits once its last file is closed, maybe after a new
        // mount at the same place bound its own socket there: that one stays.
        if file_id(&self.path).ok() == Some(self.bound) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counters() -> Counters {
        Counters {
            store: Arc::new(StoreMetrics::default()),
            fs: Arc::new(FsMetrics::default()),
            retry: Arc::new(RetryMetrics::default()),
            inodes: Arc::new(|| 0),
            pending: Arc::new(Vec::new),
        }
    }

    /// `bucketfs umount` of a mount with files open detaches it; its daemon exits once they
    /// are closed, and it removed the stats socket of the mount made at the same place
    /// meanwhile: `bucketfs stats` and `pending` then said no daemon answers for a live mount.
    #[tokio::test]
    async fn an_exiting_daemon_leaves_a_newer_daemons_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sock/mp.sock");
        let old = serve_socket(&path, counters()).unwrap();
        let new = serve_socket(&path, counters()).unwrap();
        drop(old);
        assert!(path.exists(), "the newer daemon's socket was removed");
        drop(new);
        assert!(!path.exists(), "a daemon's own socket stays behind");
    }
}
