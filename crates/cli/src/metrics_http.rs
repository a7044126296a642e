//! `--metrics-addr`: serves the store counters in the Prometheus text format at `/metrics`.
//!
//! A deliberately tiny HTTP/1.0 responder: one GET per connection, no keep-alive. It only
//! reads counters, so it cannot disturb the data path.

use bucketfs_store::metrics::StoreMetrics;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// Binds `addr` (fails at startup with a clear message if it cannot) and serves forever.
pub async fn serve(addr: SocketAddr, metrics: Arc<StoreMetrics>) -> std::io::Result<()> {
    let listener = TcpListener::bind(addr).await?;
    tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                continue;
            };
            let metrics = metrics.clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 2048];
                let n = sock.read(&mut buf).await.unwrap_or(0);
                let req = String::from_utf8_lossy(&buf[..n]);
                let path = req.split_whitespace().nth(1).unwrap_or("");
                let (status, body) = if path == "/metrics" || path == "/" {
                    ("200 OK", metrics.prometheus())
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
