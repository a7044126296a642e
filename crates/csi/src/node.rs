//! The CSI node service: NodePublishVolume mounts the volume at the pod's target path, one
//! bucketfs daemon per target, without a staging step (a bucket has no device to stage, and a
//! daemon per pod keeps one pod's load and memory budget away from the others).

use crate::attrs::{self, Credentials};
use crate::mounts::{MountError, Mounts, Record};
use crate::proto::node_server::Node;
use crate::proto::volume_capability::access_mode::Mode;
use crate::proto::volume_capability::AccessType;
use crate::proto::*;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tonic::{Request, Response, Status};
use tracing::{info, warn};

pub struct NodeService {
    pub node_id: String,
    pub mounts: Arc<Mounts>,
}

fn reader_only(cap: &VolumeCapability) -> bool {
    cap.access_mode.as_ref().is_some_and(|m| {
        matches!(
            Mode::try_from(m.mode),
            Ok(Mode::SingleNodeReaderOnly | Mode::MultiNodeReaderOnly)
        )
    })
}

/// Checks that the capability is a file-system one; returns its mount flags.
pub fn mount_flags(cap: Option<&VolumeCapability>) -> Result<Vec<String>, Status> {
    let cap = cap.ok_or_else(|| Status::invalid_argument("volume capability missing"))?;
    match &cap.access_type {
        Some(AccessType::Mount(m)) => {
            if !m.fs_type.is_empty() && m.fs_type != "fuse.bucketfs" && m.fs_type != "bucketfs" {
                return Err(Status::invalid_argument(format!(
                    "fs_type {:?}: bucketfs volumes are bucketfs",
                    m.fs_type
                )));
            }
            Ok(m.mount_flags.clone())
        }
        Some(AccessType::Block(_)) => Err(Status::invalid_argument(
            "block access is not supported: a bucket is a file system",
        )),
        None => Err(Status::invalid_argument(
            "volume capability has no access type",
        )),
    }
}

fn absolute_target(p: &str) -> Result<PathBuf, Status> {
    if p.is_empty() {
        return Err(Status::invalid_argument("target path missing"));
    }
    let p = Path::new(p);
    if !p.is_absolute() || p.components().any(|c| c == std::path::Component::ParentDir) {
        return Err(Status::invalid_argument(
            "target path must be absolute, without ..",
        ));
    }
    // One spelling per directory (`/a//b/` is `/a/b`): mountinfo, the daemon's command line
    // and the record's name all use it.
    let lexical: PathBuf = p.components().collect();
    let (Some(parent), Some(name)) = (lexical.parent(), lexical.file_name()) else {
        return Ok(lexical);
    };
    // The directories above with their links resolved (a kubelet root that is a link,
    // /var/lib/kubelet -> /data/kubelet): the daemon mounts where they lead and mountinfo
    // names that place; compared as given, the mount was never seen, the daemon was killed
    // and its dead mount made every unpublish fail.
    let target = real_dir(parent).join(name);
    // The target itself is a directory or a mount point (not looked at: its daemon may
    // hang); a link there is refused.
    if crate::mounts::mount_at(&target).is_none()
        && std::fs::symlink_metadata(&target).is_ok_and(|m| m.file_type().is_symlink())
    {
        return Err(Status::invalid_argument(format!(
            "target path {} is a symbolic link",
            target.display()
        )));
    }
    Ok(target)
}

/// Directory `dir` (absolute) with the links of the part that exists resolved; the rest,
/// to be made, as given.
fn real_dir(dir: &Path) -> PathBuf {
    match (dir.canonicalize(), dir.parent(), dir.file_name()) {
        (Ok(real), _, _) => real,
        (Err(_), Some(parent), Some(name)) => real_dir(parent).join(name),
        _ => dir.to_path_buf(),
    }
}

fn status(e: MountError) -> Status {
    match e {
        MountError::AlreadyExists(m) => Status::already_exists(m),
        MountError::Mount(m) => Status::internal(m),
        MountError::Busy(m) => Status::unavailable(m),
        MountError::Internal(m) => Status::internal(m),
    }
}

#[tonic::async_trait]
impl Node for NodeService {
    async fn node_stage_volume(
        &self,
        _: Request<NodeStageVolumeRequest>,
    ) -> Result<Response<NodeStageVolumeResponse>, Status> {
        Err(Status::unimplemented("no staging: each publish mounts"))
    }

    async fn node_unstage_volume(
        &self,
        _: Request<NodeUnstageVolumeRequest>,
    ) -> Result<Response<NodeUnstageVolumeResponse>, Status> {
        Err(Status::unimplemented("no staging: each publish mounts"))
    }

    async fn node_publish_volume(
        &self,
        req: Request<NodePublishVolumeRequest>,
    ) -> Result<Response<NodePublishVolumeResponse>, Status> {
        // Never log the request: it carries the secret.
        let r = req.into_inner();
        if r.volume_id.is_empty() {
            return Err(Status::invalid_argument("volume id missing"));
        }
        let target = absolute_target(&r.target_path)?;
        let flags = mount_flags(r.volume_capability.as_ref())?;
        let ro = r.readonly || r.volume_capability.as_ref().is_some_and(reader_only);
        let spec = attrs::volume_spec(&r.volume_context, &r.secrets, &flags, ro)
            .map_err(Status::invalid_argument)?;
        let creds = Credentials::from_secrets(&r.secrets).map_err(Status::invalid_argument)?;
        let want = Record {
            volume_id: r.volume_id.clone(),
            target: target.clone(),
            source: spec.source(),
            args: spec.mount_args(
                &self.mounts.daemon_state_dir(),
                &self.mounts.cache_dir(&r.volume_id),
            ),
            pid: 0,
            has_credentials: !creds.is_empty(),
        };
        info!(
            "NodePublishVolume {} {} at {}",
            r.volume_id,
            want.source,
            target.display()
        );
        self.mounts.publish(want, &creds).await.map_err(|e| {
            warn!("NodePublishVolume {}: {e}", r.volume_id);
            status(e)
        })?;
        Ok(Response::new(NodePublishVolumeResponse {}))
    }

    async fn node_unpublish_volume(
        &self,
        req: Request<NodeUnpublishVolumeRequest>,
    ) -> Result<Response<NodeUnpublishVolumeResponse>, Status> {
        let r = req.into_inner();
        if r.volume_id.is_empty() {
            return Err(Status::invalid_argument("volume id missing"));
        }
        let target = absolute_target(&r.target_path)?;
        info!(
            "NodeUnpublishVolume {} at {}",
            r.volume_id,
            target.display()
        );
        self.mounts.unpublish(&target).await.map_err(|e| {
            warn!("NodeUnpublishVolume {}: {e}", r.volume_id);
            status(e)
        })?;
        Ok(Response::new(NodeUnpublishVolumeResponse {}))
    }

    async fn node_get_volume_stats(
        &self,
        _: Request<NodeGetVolumeStatsRequest>,
    ) -> Result<Response<NodeGetVolumeStatsResponse>, Status> {
        Err(Status::unimplemented("a bucket has no capacity to report"))
    }

    async fn node_expand_volume(
        &self,
        _: Request<NodeExpandVolumeRequest>,
    ) -> Result<Response<NodeExpandVolumeResponse>, Status> {
        Err(Status::unimplemented("a bucket needs no expansion"))
    }

    async fn node_get_capabilities(
        &self,
        _: Request<NodeGetCapabilitiesRequest>,
    ) -> Result<Response<NodeGetCapabilitiesResponse>, Status> {
        Ok(Response::new(NodeGetCapabilitiesResponse {
            capabilities: Vec::new(),
        }))
    }

    async fn node_get_info(
        &self,
        _: Request<NodeGetInfoRequest>,
    ) -> Result<Response<NodeGetInfoResponse>, Status> {
        Ok(Response::new(NodeGetInfoResponse {
            node_id: self.node_id.clone(),
            max_volumes_per_node: 0,
            accessible_topology: None,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_paths_have_one_spelling() {
        // Path's == compares components: compare the bytes the driver uses.
        for p in ["/a//b/", "/a/b", "/a/./b//"] {
            assert_eq!(absolute_target(p).unwrap().as_os_str(), "/a/b", "{p}");
        }
        assert!(absolute_target("/a/../b").is_err());
        // Links above are resolved; a link as the target is refused.
        let d = tempfile::tempdir().unwrap();
        let real = d.path().canonicalize().unwrap().join("real");
        std::fs::create_dir(&real).unwrap();
        let link = d.path().join("link");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let via = link.join("pod/vol");
        assert_eq!(
            absolute_target(via.to_str().unwrap()).unwrap(),
            real.join("pod/vol")
        );
        let e = absolute_target(link.to_str().unwrap()).unwrap_err();
        assert!(e.message().contains("is a symbolic link"), "{e:?}");
        assert!(absolute_target("a/b").is_err());
    }
}
