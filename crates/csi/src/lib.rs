//! `bucketfs csi`: a Kubernetes CSI driver (identity, controller and node services) served over
//! gRPC on a Unix socket.
//!
//! Node: each NodePublishVolume runs one `bucketfs mount -f` daemon (see [`mounts`]), outside
//! the driver's container when it can ([`launch`]), so the mounts outlive the driver and its
//! container; a small state directory lets a restarted driver find them again. Controller: a volume is a prefix of a bucket
//! ([`controller`]). The volume attributes and secrets a volume may carry are in [`attrs`].

// tonic's Status (176 bytes) is the error of every gRPC handler: helpers return it as is.
#![allow(clippy::result_large_err)]

pub mod attrs;
mod controller;
mod identity;
mod launch;
mod mounts;
mod node;
mod repair;

/// The CSI v1 messages and the tonic client and server stubs, generated from proto/csi.proto
/// by proto-gen (committed, so that building bucketfs needs no protoc).
#[allow(clippy::all, clippy::pedantic, missing_docs, rustdoc::all)]
pub mod proto {
    include!("proto/csi.v1.rs");
}

pub use launch::Mode as DaemonMode;

/// The gRPC library the stubs are for (clients of [`connect`] need its types).
pub use tonic;

use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The driver name Kubernetes knows the driver by (CSIDriver, StorageClass provisioner).
pub const DRIVER_NAME: &str = "csi.bucketfs.io";

/// What `bucketfs csi` was started with.
#[derive(Debug, Clone)]
pub struct Config {
    /// `unix:///path/csi.sock` (or a plain path).
    pub endpoint: String,
    pub node_id: String,
    /// Records of the mounts this node serves, credentials files, logs, data caches.
    pub state_dir: PathBuf,
    /// The bucketfs binary that mounts (the running one).
    pub bucketfs: PathBuf,
    /// How long NodeUnpublishVolume waits for a daemon to finish its uploads and exit before
    /// it detaches the mount and kills the daemon.
    pub unpublish_timeout: std::time::Duration,
    /// Where the mount daemons run.
    pub daemons: DaemonMode,
    /// The process whose namespaces and cgroups are the host's (1: the host's init).
    pub host_pid: u32,
}

/// The socket path of a `unix://` endpoint.
pub fn socket_path(endpoint: &str) -> Result<PathBuf, String> {
    let p = endpoint
        .strip_prefix("unix://")
        .or_else(|| endpoint.strip_prefix("unix:"))
        .unwrap_or(endpoint);
    if p.is_empty() || endpoint.contains("://") && !endpoint.starts_with("unix://") {
        return Err(format!(
            "endpoint {endpoint}: only unix:///PATH sockets are supported"
        ));
    }
    Ok(PathBuf::from(p))
}

/// Serves until SIGTERM or SIGINT. The mounts stay: they belong to their daemons.
pub fn run(cfg: Config) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("tokio runtime: {e}"))?;
    rt.block_on(serve(cfg))
}

async fn serve(cfg: Config) -> Result<(), String> {
    let path = socket_path(&cfg.endpoint)?;
    let node = Arc::new(mounts::Mounts::open(&cfg)?);
    mounts::start_reaper();
    // In the background: a volume whose store stalls must not keep the socket closed.
    let healer = node.clone();
    tokio::spawn(async move {
        healer.recover(true).await;
        loop {
            tokio::time::sleep(mounts::HEAL_INTERVAL).await;
            healer.recover(false).await;
        }
    });
    let listener = bind(&path)?;
    tracing::info!(
        "CSI driver {DRIVER_NAME} {} serving on {} (node {}, state {})",
        env!("CARGO_PKG_VERSION"),
        path.display(),
        cfg.node_id,
        cfg.state_dir.display()
    );
    let incoming = Incoming::new(listener);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let services = Services {
        identity: proto::identity_server::IdentityServer::new(identity::IdentityService),
        controller: proto::controller_server::ControllerServer::new(controller::ControllerService),
        node: proto::node_server::NodeServer::new(node::NodeService {
            node_id: cfg.node_id.clone(),
            mounts: node,
        }),
    };
    let server = tonic::transport::Server::builder().serve_with_incoming_shutdown(
        services,
        incoming,
        async {
            let _ = stopped.await;
        },
    );
    tokio::pin!(server);
    let r = tokio::select! {
        r = &mut server => r,
        _ = termination() => {
            tracing::info!("stopping; the mounts stay up");
            let _ = stop.send(());
            // Clients that keep their connection open must not hold up the exit.
            tokio::time::timeout(std::time::Duration::from_secs(5), server)
                .await
                .unwrap_or(Ok(()))
        }
    };
    let _ = std::fs::remove_file(&path);
    r.map_err(|e| format!("gRPC server: {e}"))
}

/// The connections of the driver's socket, as the gRPC server takes them. An accept that
/// fails (`EMFILE`: clients holding every descriptor) is tried again after a pause that
/// doubles up to [`ACCEPT_PAUSE_MAX`], and said once per run of failures: tonic's own loop
/// tried again at once, spinning a core until a descriptor came free.
struct Incoming {
    listener: tokio::net::UnixListener,
    pause: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
    next_pause: std::time::Duration,
    failing: bool,
}

const ACCEPT_PAUSE_MIN: std::time::Duration = std::time::Duration::from_millis(10);
const ACCEPT_PAUSE_MAX: std::time::Duration = std::time::Duration::from_secs(1);

impl Incoming {
    fn new(listener: tokio::net::UnixListener) -> Self {
        Self {
            listener,
            pause: None,
            next_pause: ACCEPT_PAUSE_MIN,
            failing: false,
        }
    }
}

impl tokio_stream::Stream for Incoming {
    type Item = std::io::Result<tokio::net::UnixStream>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        use std::future::Future;
        use std::task::{ready, Poll};
        loop {
            if let Some(pause) = self.pause.as_mut() {
                ready!(pause.as_mut().poll(cx));
                self.pause = None;
            }
            match ready!(self.listener.poll_accept(cx)) {
                Ok((conn, _)) => {
                    if self.failing {
                        tracing::info!("CSI socket: accepting connections again");
                    }
                    self.failing = false;
                    self.next_pause = ACCEPT_PAUSE_MIN;
                    return Poll::Ready(Some(Ok(conn)));
                }
                Err(e) => {
                    if !self.failing {
                        tracing::warn!(
                            "CSI socket: cannot accept a connection ({e}); trying again with \
                             pauses of up to {} s",
                            ACCEPT_PAUSE_MAX.as_secs()
                        );
                    }
                    self.failing = true;
                    let pause = self.next_pause;
                    self.next_pause = (pause * 2).min(ACCEPT_PAUSE_MAX);
                    self.pause = Some(Box::pin(tokio::time::sleep(pause)));
                }
            }
        }
    }
}

/// The three CSI services behind one socket, routed by the gRPC path's service name (what
/// tonic's router does, without the web framework it brings along).
#[derive(Clone)]
struct Services {
    identity: proto::identity_server::IdentityServer<identity::IdentityService>,
    controller: proto::controller_server::ControllerServer<controller::ControllerService>,
    node: proto::node_server::NodeServer<node::NodeService>,
}

type Reply = http::Response<tonic::body::Body>;

impl tower::Service<http::Request<tonic::body::Body>> for Services {
    type Response = Reply;
    type Error = std::convert::Infallible;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Reply, Self::Error>> + Send + 'static>,
    >;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        // The generated services are always ready.
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        let path = req.uri().path();
        if path.starts_with("/csi.v1.Identity/") {
            Box::pin(self.identity.call(req))
        } else if path.starts_with("/csi.v1.Controller/") {
            Box::pin(self.controller.call(req))
        } else if path.starts_with("/csi.v1.Node/") {
            Box::pin(self.node.call(req))
        } else {
            let status = tonic::Status::unimplemented(format!("no service for {path}"));
            Box::pin(async move { Ok(status.into_http()) })
        }
    }
}

async fn termination() {
    use tokio::signal::unix::{signal, SignalKind};
    match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(mut t), Ok(mut i)) => {
            tokio::select! {
                _ = t.recv() => {}
                _ = i.recv() => {}
            }
        }
        _ => std::future::pending().await,
    }
}

/// Binds the socket, replacing a stale one left by a driver that was killed. Only its owner
/// (root: kubelet and the registrar) may connect, whatever the umask: a caller can have any
/// directory mounted as root. It is bound under a temporary name and made private before it
/// takes its own, so no connection comes before.
fn bind(path: &Path) -> Result<tokio::net::UnixListener, String> {
    use std::os::unix::fs::PermissionsExt;
    let fail = |p: &Path, e: std::io::Error| format!("{}: {e}", p.display());
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| fail(dir, e))?;
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".{}.tmp", std::process::id()));
    let tmp = PathBuf::from(tmp);
    for p in [path, &tmp] {
        match std::fs::remove_file(p) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(fail(p, e)),
        }
    }
    let listener = tokio::net::UnixListener::bind(&tmp).map_err(|e| fail(&tmp, e))?;
    let placed = std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))
        .and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = placed {
        let _ = std::fs::remove_file(&tmp);
        return Err(fail(path, e));
    }
    Ok(listener)
}

/// A gRPC channel to a driver's socket (for tests and tools).
pub async fn connect(path: &Path) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    let path = path.to_path_buf();
    // The URI is required by the API but unused: the connector always dials the socket.
    tonic::transport::Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move {
                let s = tokio::net::UnixStream::connect(path).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(s))
            }
        }))
        .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// The driver's socket is its owner's only (it was 0755 under the usual umask, 0777
    /// under 0: anyone could ask the root driver to mount a bucket anywhere).
    #[tokio::test]
    async fn the_socket_is_private() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("csi.sock");
        std::fs::write(&path, b"stale").unwrap();
        let _l = bind(&path).unwrap();
        let md = std::fs::symlink_metadata(&path).unwrap();
        assert_eq!(md.permissions().mode() & 0o777, 0o600);
        assert!(std::os::unix::fs::FileTypeExt::is_socket(&md.file_type()));
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        tokio::net::UnixStream::connect(&path).await.unwrap();
    }
}
