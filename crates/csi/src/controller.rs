//! The CSI controller service: dynamic provisioning of one prefix per volume.
//!
//! CreateVolume puts a directory marker `BASE/NAME/` in the StorageClass's bucket, carrying
//! the requested capacity (a bucket has none, but CSI wants a second CreateVolume of the same
//! name with another size refused); the volume id is `BUCKET/BASE/NAME`. DeleteVolume removes
//! every object under the prefix and aborts its multipart uploads, only when the prefix has the
//! marker (so never data it did not make), the marker last. The bucket comes from the
//! StorageClass parameters; the endpoint, region and path style from its secret only, since
//! DeleteVolume gets the secret and not the parameters.

use crate::attrs::{self, Credentials};
use crate::node::mount_flags;
use crate::proto::controller_server::Controller;
use crate::proto::controller_service_capability::rpc::Type as RpcType;
use crate::proto::controller_service_capability::{Rpc, Type as CapType};
use crate::proto::validate_volume_capabilities_response::Confirmed;
use crate::proto::*;
use bucketfs_store::s3::{S3Config, S3Store};
use bucketfs_store::{ListDetail, ListFrom, ObjectStore, StoreError, UserMeta};
use bytes::Bytes;
use std::collections::HashMap;
use std::sync::Arc;
use tonic::{Request, Response, Status};
use tracing::{info, warn};

pub struct ControllerService;

/// Where the store is: for a provisioned volume, these come from the secret.
const STORE_SETTINGS: &[&str] = &["endpoint", "region", "forcePathStyle"];

/// User metadata of the marker: the capacity the volume was created with.
const CAPACITY_META: &str = "bucketfs-csi-capacity";

fn store_status(e: StoreError) -> Status {
    match e {
        StoreError::AccessDenied(m) => Status::permission_denied(m),
        StoreError::NoSuchBucket(m) => Status::failed_precondition(format!("no such bucket: {m}")),
        StoreError::Transient(m) => Status::unavailable(m),
        e => Status::internal(e.to_string()),
    }
}

fn setting(
    key: &str,
    params: &HashMap<String, String>,
    secrets: &HashMap<String, String>,
) -> Option<String> {
    params
        .get(key)
        .or_else(|| secrets.get(key))
        .filter(|v| !v.is_empty())
        .cloned()
}

async fn store(
    bucket: &str,
    params: &HashMap<String, String>,
    secrets: &HashMap<String, String>,
) -> Result<S3Store, Status> {
    let creds = Credentials::from_secrets(secrets).map_err(Status::invalid_argument)?;
    let cfg = S3Config {
        bucket: bucket.to_string(),
        endpoint_url: setting("endpoint", params, secrets),
        region: setting("region", params, secrets),
        force_path_style: match setting("forcePathStyle", params, secrets) {
            Some(v) => {
                crate::attrs::parse_bool("forcePathStyle", &v).map_err(Status::invalid_argument)?
            }
            None => false,
        },
        access_key_id: creds.access_key_id,
        secret_access_key: creds.secret_access_key,
        session_token: creds.session_token,
        max_attempts: 3,
        ..Default::default()
    };
    S3Store::new(&cfg).await.map_err(store_status)
}

/// `BUCKET/PREFIX` -> (bucket, prefix); `None` for ids this driver never made.
fn parse_volume_id(id: &str) -> Option<(&str, &str)> {
    let (b, p) = id.split_once('/')?;
    (!b.is_empty() && !p.is_empty() && !p.starts_with('/') && !p.ends_with('/')).then_some((b, p))
}

fn check_capabilities(caps: &[VolumeCapability]) -> Result<(), Status> {
    if caps.is_empty() {
        return Err(Status::invalid_argument("volume capabilities missing"));
    }
    for c in caps {
        mount_flags(Some(c))?;
    }
    Ok(())
}

async fn head_marker(store: &S3Store, prefix: &str) -> Result<Option<i64>, Status> {
    match store.head(&format!("{prefix}/")).await {
        Ok(m) => Ok(Some(
            m.user
                .get(CAPACITY_META)
                .and_then(|c| c.parse().ok())
                .unwrap_or(0),
        )),
        Err(e) if e.is_not_found() => Ok(None),
        Err(e) => Err(store_status(e)),
    }
}

/// Requests in flight while DeleteVolume empties a prefix: one at a time would take hours for
/// a volume of a million files (the store has no batch delete).
const DELETE_CONCURRENCY: usize = 32;

/// Deletes `keys`, [`DELETE_CONCURRENCY`] at a time; the count deleted.
async fn delete_keys(store: &Arc<S3Store>, keys: Vec<String>) -> Result<usize, Status> {
    let n = keys.len();
    let mut running = tokio::task::JoinSet::new();
    for key in keys {
        if running.len() >= DELETE_CONCURRENCY {
            join_one(&mut running).await?;
        }
        let store = store.clone();
        running.spawn(async move { store.delete(&key).await });
    }
    while !running.is_empty() {
        join_one(&mut running).await?;
    }
    Ok(n)
}

async fn join_one(
    running: &mut tokio::task::JoinSet<Result<(), StoreError>>,
) -> Result<(), Status> {
    match running.join_next().await {
        Some(Ok(Ok(()))) | None => Ok(()),
        Some(Ok(Err(e))) if e.is_not_found() => Ok(()),
        Some(Ok(Err(e))) => Err(store_status(e)),
        Some(Err(e)) => Err(Status::internal(format!("delete task: {e}"))),
    }
}

fn unimplemented<T>() -> Result<Response<T>, Status> {
    Err(Status::unimplemented("not offered by this driver"))
}

#[tonic::async_trait]
impl Controller for ControllerService {
    async fn create_volume(
        &self,
        req: Request<CreateVolumeRequest>,
    ) -> Result<Response<CreateVolumeResponse>, Status> {
        let r = req.into_inner();
        if r.name.is_empty() {
            return Err(Status::invalid_argument("volume name missing"));
        }
        if r.name.contains('/') || r.name == "." || r.name == ".." {
            return Err(Status::invalid_argument("volume name must not contain /"));
        }
        check_capabilities(&r.volume_capabilities)?;
        if r.volume_content_source.is_some() {
            return Err(Status::invalid_argument(
                "volumes from snapshots or other volumes are not supported",
            ));
        }
        // DeleteVolume gets the secret, never the parameters: a store setting only the
        // parameters give would send it to another store (or none) than the one provisioned.
        for k in STORE_SETTINGS {
            if let Some(v) = r.parameters.get(*k).filter(|v| !v.is_empty()) {
                if r.secrets.get(*k) != Some(v) {
                    return Err(Status::invalid_argument(format!(
                        "StorageClass parameter {k}: put it in the provisioner secret \
                         (DeleteVolume gets only the secret)"
                    )));
                }
            }
        }
        // The same checks a mount makes, so a bad StorageClass fails at provisioning.
        let spec = attrs::volume_spec(&r.parameters, &r.secrets, &[], false)
            .map_err(Status::invalid_argument)?;
        let prefix = if spec.prefix.is_empty() {
            r.name.clone()
        } else {
            format!("{}/{}", spec.prefix, r.name)
        };
        let capacity = r
            .capacity_range
            .as_ref()
            .map(|c| {
                if c.required_bytes > 0 {
                    c.required_bytes
                } else {
                    c.limit_bytes
                }
            })
            .unwrap_or(0)
            .max(0);
        let store = store(&spec.bucket, &r.parameters, &r.secrets).await?;
        match head_marker(&store, &prefix).await? {
            Some(have) if have != capacity => {
                return Err(Status::already_exists(format!(
                    "volume {} exists with capacity {have}",
                    r.name
                )))
            }
            Some(_) => {}
            None => {
                let mut meta = UserMeta::new();
                meta.insert(CAPACITY_META.into(), capacity.to_string());
                store
                    .put(&format!("{prefix}/"), Bytes::new(), &meta)
                    .await
                    .map_err(store_status)?;
                info!("CreateVolume {}: s3://{}/{prefix}", r.name, spec.bucket);
            }
        }
        let mut context: HashMap<String, String> = r
            .parameters
            .iter()
            .filter(|(k, _)| !k.contains('/'))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        context.insert("prefix".into(), prefix.clone());
        Ok(Response::new(CreateVolumeResponse {
            volume: Some(Volume {
                capacity_bytes: capacity,
                volume_id: format!("{}/{prefix}", spec.bucket),
                volume_context: context,
                content_source: None,
                accessible_topology: Vec::new(),
            }),
        }))
    }

    async fn delete_volume(
        &self,
        req: Request<DeleteVolumeRequest>,
    ) -> Result<Response<DeleteVolumeResponse>, Status> {
        let r = req.into_inner();
        if r.volume_id.is_empty() {
            return Err(Status::invalid_argument("volume id missing"));
        }
        // An id this driver never made names no volume: deleting it succeeds, as CSI asks.
        let Some((bucket, prefix)) = parse_volume_id(&r.volume_id) else {
            return Ok(Response::new(DeleteVolumeResponse {}));
        };
        let store = Arc::new(store(bucket, &HashMap::new(), &r.secrets).await?);
        let dir = format!("{prefix}/");
        // Only a prefix with this driver's marker is a volume it made: an id that names other
        // data (a static PV's, another tool's) must never empty it. The marker goes last, so
        // a DeleteVolume cut short is finished by the provisioner's retry.
        match store.head(&dir).await {
            Ok(m) if m.user.contains_key(CAPACITY_META) => {}
            Ok(_) => {
                warn!(
                    "DeleteVolume {}: s3://{bucket}/{dir} has no bucketfs-csi volume marker; \
                     nothing deleted",
                    r.volume_id
                );
                return Ok(Response::new(DeleteVolumeResponse {}));
            }
            Err(e) if e.is_not_found() || matches!(e, StoreError::NoSuchBucket(_)) => {
                info!(
                    "DeleteVolume {}: no volume marker s3://{bucket}/{dir} (deleted already, \
                     or not made by this driver); nothing deleted",
                    r.volume_id
                );
                return Ok(Response::new(DeleteVolumeResponse {}));
            }
            Err(e) => return Err(store_status(e)),
        }
        let uploads = match store.list_multipart_uploads(&dir).await {
            Ok(u) => u,
            // The bucket went away meanwhile: so did the volume.
            Err(StoreError::NoSuchBucket(_)) => Vec::new(),
            Err(e) => return Err(store_status(e)),
        };
        for u in uploads {
            store
                .abort_multipart(&u.key, &u.upload_id)
                .await
                .map_err(store_status)?;
        }
        let mut from = ListFrom::Start;
        let mut deleted = 0usize;
        loop {
            let page = match store.list(&dir, None, from, 1000, ListDetail::Plain).await {
                Ok(p) => p,
                Err(StoreError::NoSuchBucket(_)) => break,
                Err(e) => return Err(store_status(e)),
            };
            let keys: Vec<String> = page
                .objects
                .into_iter()
                .map(|o| o.key)
                .filter(|k| *k != dir)
                .collect();
            deleted += delete_keys(&store, keys).await?;
            match page.next_continuation {
                Some(t) => from = ListFrom::Token(t),
                None => break,
            }
        }
        match store.delete(&dir).await {
            Ok(()) | Err(StoreError::NoSuchBucket(_)) => {}
            Err(e) if e.is_not_found() => {}
            Err(e) => return Err(store_status(e)),
        }
        info!("DeleteVolume {}: {deleted} objects deleted", r.volume_id);
        Ok(Response::new(DeleteVolumeResponse {}))
    }

    async fn controller_publish_volume(
        &self,
        _: Request<ControllerPublishVolumeRequest>,
    ) -> Result<Response<ControllerPublishVolumeResponse>, Status> {
        unimplemented()
    }

    async fn controller_unpublish_volume(
        &self,
        _: Request<ControllerUnpublishVolumeRequest>,
    ) -> Result<Response<ControllerUnpublishVolumeResponse>, Status> {
        unimplemented()
    }

    async fn validate_volume_capabilities(
        &self,
        req: Request<ValidateVolumeCapabilitiesRequest>,
    ) -> Result<Response<ValidateVolumeCapabilitiesResponse>, Status> {
        let r = req.into_inner();
        if r.volume_id.is_empty() {
            return Err(Status::invalid_argument("volume id missing"));
        }
        if r.volume_capabilities.is_empty() {
            return Err(Status::invalid_argument("volume capabilities missing"));
        }
        let Some((bucket, prefix)) = parse_volume_id(&r.volume_id) else {
            return Err(Status::not_found(format!("no volume {}", r.volume_id)));
        };
        let store = store(bucket, &r.parameters, &r.secrets).await?;
        if head_marker(&store, prefix).await?.is_none() {
            return Err(Status::not_found(format!("no volume {}", r.volume_id)));
        }
        // Block access is the only kind a bucket cannot serve.
        if let Err(e) = check_capabilities(&r.volume_capabilities) {
            return Ok(Response::new(ValidateVolumeCapabilitiesResponse {
                confirmed: None,
                message: e.message().to_string(),
            }));
        }
        Ok(Response::new(ValidateVolumeCapabilitiesResponse {
            confirmed: Some(Confirmed {
                volume_context: r.volume_context,
                volume_capabilities: r.volume_capabilities,
                parameters: r.parameters,
                mutable_parameters: r.mutable_parameters,
            }),
            message: String::new(),
        }))
    }

    async fn list_volumes(
        &self,
        _: Request<ListVolumesRequest>,
    ) -> Result<Response<ListVolumesResponse>, Status> {
        unimplemented()
    }

    async fn get_capacity(
        &self,
        _: Request<GetCapacityRequest>,
    ) -> Result<Response<GetCapacityResponse>, Status> {
        unimplemented()
    }

    async fn controller_get_capabilities(
        &self,
        _: Request<ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<ControllerGetCapabilitiesResponse>, Status> {
        Ok(Response::new(ControllerGetCapabilitiesResponse {
            capabilities: vec![ControllerServiceCapability {
                r#type: Some(CapType::Rpc(Rpc {
                    r#type: RpcType::CreateDeleteVolume as i32,
                })),
            }],
        }))
    }

    async fn create_snapshot(
        &self,
        _: Request<CreateSnapshotRequest>,
    ) -> Result<Response<CreateSnapshotResponse>, Status> {
        unimplemented()
    }

    async fn delete_snapshot(
        &self,
        _: Request<DeleteSnapshotRequest>,
    ) -> Result<Response<DeleteSnapshotResponse>, Status> {
        unimplemented()
    }

    async fn list_snapshots(
        &self,
        _: Request<ListSnapshotsRequest>,
    ) -> Result<Response<ListSnapshotsResponse>, Status> {
        unimplemented()
    }

    async fn get_snapshot(
        &self,
        _: Request<GetSnapshotRequest>,
    ) -> Result<Response<GetSnapshotResponse>, Status> {
        unimplemented()
    }

    async fn controller_expand_volume(
        &self,
        _: Request<ControllerExpandVolumeRequest>,
    ) -> Result<Response<ControllerExpandVolumeResponse>, Status> {
        unimplemented()
    }

    async fn controller_get_volume(
        &self,
        _: Request<ControllerGetVolumeRequest>,
    ) -> Result<Response<ControllerGetVolumeResponse>, Status> {
        unimplemented()
    }

    async fn controller_modify_volume(
        &self,
        _: Request<ControllerModifyVolumeRequest>,
    ) -> Result<Response<ControllerModifyVolumeResponse>, Status> {
        unimplemented()
    }
}
