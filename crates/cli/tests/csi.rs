//! `bucketfs csi`: the CSI driver over its Unix socket, against MinIO, with real mounts.
//!
//! A tiny gRPC client (the driver crate's own generated stubs) plays the kubelet and the
//! external-provisioner; `csi-sanity` (kubernetes-csi/csi-test, installed by scripts/test.sh)
//! checks the driver against the CSI specification.

// tonic's Status is what every CSI call returns.
#![allow(clippy::result_large_err)]

mod common;
use common::*;

use bucketfs_csi::proto::controller_client::ControllerClient;
use bucketfs_csi::proto::identity_client::IdentityClient;
use bucketfs_csi::proto::node_client::NodeClient;
use bucketfs_csi::proto::volume_capability::access_mode::Mode;
use bucketfs_csi::proto::volume_capability::{AccessMode, AccessType, MountVolume};
use bucketfs_csi::proto::*;
use bucketfs_csi::tonic;
use std::collections::HashMap;
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use tonic::transport::Channel;

/// One `bucketfs csi` process on a socket of its own, killed on drop. Its stderr (the
/// driver's log) goes to a file the tests search for secrets.
struct Driver {
    child: Child,
    socket: PathBuf,
    log: PathBuf,
}

impl Driver {
    fn start(dir: &Path) -> Driver {
        Driver::start_with(dir, "debug", &[])
    }

    /// A driver at `level` with `env` added to its environment.
    fn start_with(dir: &Path, level: &str, env: &[(&str, &str)]) -> Driver {
        Driver::launch(dir, level, env, &[], None)
    }

    /// A driver with `args` added, in `container` when there is one.
    fn launch(
        dir: &Path,
        level: &str,
        env: &[(&str, &str)],
        args: &[&str],
        container: Option<&Container>,
    ) -> Driver {
        let socket = dir.join("csi.sock");
        let log = dir.join("driver.log");
        // A killed driver leaves its socket file: wait for the new one, not that.
        let _ = fs::remove_file(&socket);
        let mut cmd = match container {
            Some(c) => c.command(),
            None => Command::new(bin()),
        };
        cmd.args(["csi", "--node-id", "node-1", "--log-level", level])
            .envs(env.iter().copied())
            .arg(format!("--endpoint=unix://{}", socket.display()))
            .arg(format!("--state-dir={}", dir.join("state").display()))
            .args(args);
        // Defaults the tests may override. Daemons in the host's cgroups and mount
        // namespace: what auto picks in a hostPID container on a host without systemd.
        // The test process plays the host's init (PID 1 here is out of reach).
        let me = std::process::id().to_string();
        for (flag, default) in [
            ("--unpublish-timeout", "30"),
            ("--daemons", "host"),
            ("--host-pid", me.as_str()),
        ] {
            if !args.iter().any(|a| a.starts_with(flag)) {
                cmd.arg(format!("{flag}={default}"));
            }
        }
        let child = cmd
            // A process group of its own, as a container's init or a shell job has.
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(
                fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&log)
                    .unwrap(),
            )
            .spawn()
            .expect("spawn bucketfs csi");
        let d = Driver { child, socket, log };
        wait_for("the driver's socket", Duration::from_secs(20), || {
            d.socket.exists()
        });
        d
    }

    /// SIGKILL to the driver's whole process group, as a supervisor stopping it hard would
    /// send: only daemons that left the group survive it.
    fn kill9(&mut self) {
        // SAFETY: plain syscall on the group of our own child.
        unsafe { libc::kill(-(self.child.id() as i32), libc::SIGKILL) };
        let _ = self.child.wait();
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        // SAFETY: plain syscall on our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}

/// Lazily unmounts whatever a failed test left mounted under `dir`, and kills the daemons.
struct Cleanup(PathBuf);

impl Drop for Cleanup {
    fn drop(&mut self) {
        let text = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let under = self.0.to_string_lossy().to_string();
        for mp in text
            .lines()
            .filter_map(|l| l.split(' ').nth(4))
            .filter(|m| m.starts_with(&under))
        {
            let _ = Command::new("fusermount3").args(["-u", "-z", mp]).status();
        }
        for pid in processes_mentioning(&under) {
            // SAFETY: plain syscall; these are the test's own daemons.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
    }
}

/// A blocking client of one driver (the S3 helpers of the harness block too, so the tests
/// stay synchronous).
struct Csi {
    rt: tokio::runtime::Runtime,
    identity: IdentityClient<Channel>,
    node: NodeClient<Channel>,
    controller: ControllerClient<Channel>,
}

impl Csi {
    fn connect(driver: &Driver) -> Csi {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let ch = rt
            .block_on(bucketfs_csi::connect(&driver.socket))
            .expect("connect");
        Csi {
            rt,
            identity: IdentityClient::new(ch.clone()),
            node: NodeClient::new(ch.clone()),
            controller: ControllerClient::new(ch),
        }
    }

    fn publish(&mut self, r: NodePublishVolumeRequest) -> Result<(), tonic::Status> {
        self.rt
            .block_on(self.node.node_publish_volume(r))
            .map(|_| ())
    }

    fn unpublish(&mut self, volume_id: &str, target: &Path) -> Result<(), tonic::Status> {
        let r = NodeUnpublishVolumeRequest {
            volume_id: volume_id.into(),
            target_path: target.to_string_lossy().into(),
        };
        self.rt
            .block_on(self.node.node_unpublish_volume(r))
            .map(|_| ())
    }
}

fn secrets() -> HashMap<String, String> {
    let e = env();
    HashMap::from([
        ("accessKeyID".to_string(), e.access_key.clone()),
        ("secretAccessKey".to_string(), e.secret_key.clone()),
        ("endpoint".to_string(), e.endpoint.clone()),
        ("forcePathStyle".to_string(), "true".to_string()),
    ])
}

fn mount_capability(mode: Mode) -> VolumeCapability {
    VolumeCapability {
        access_mode: Some(AccessMode { mode: mode as i32 }),
        access_type: Some(AccessType::Mount(MountVolume::default())),
    }
}

fn publish_request(
    volume_id: &str,
    target: &Path,
    context: &[(&str, &str)],
    readonly: bool,
) -> NodePublishVolumeRequest {
    NodePublishVolumeRequest {
        volume_id: volume_id.into(),
        target_path: target.to_string_lossy().into(),
        volume_capability: Some(mount_capability(Mode::SingleNodeWriter)),
        readonly,
        secrets: secrets(),
        volume_context: context
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..Default::default()
    }
}

fn fuse_mounted(p: &Path) -> bool {
    let text = fs::read_to_string("/proc/self/mountinfo").unwrap();
    let want = p.to_string_lossy();
    text.lines().any(|l| {
        let f: Vec<&str> = l.split(' ').collect();
        f.get(4) == Some(&want.as_ref())
            && f.iter()
                .skip_while(|x| **x != "-")
                .nth(1)
                .is_some_and(|t| t.starts_with("fuse"))
    })
}

/// The pid of the bucketfs daemon serving `target`.
fn daemon_of(target: &Path) -> u32 {
    let pids: Vec<u32> = processes_mentioning(&target.to_string_lossy())
        .into_iter()
        .filter(|p| {
            fs::read(format!("/proc/{p}/cmdline"))
                .map(|c| c.split(|b| *b == 0).any(|a| a == b"mount"))
                .unwrap_or(false)
        })
        .collect();
    assert_eq!(
        pids.len(),
        1,
        "one daemon for {}: {pids:?}",
        target.display()
    );
    pids[0]
}

fn alive(pid: u32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            let state = s.rsplit(')').next().unwrap_or("").trim_start();
            !state.starts_with('Z')
        })
        .unwrap_or(false)
}

/// Every file under `dir` (logs, records) that holds `needle`.
fn files_holding(dir: &Path, needle: &str) -> Vec<PathBuf> {
    let mut hits = Vec::new();
    let Ok(rd) = fs::read_dir(dir) else {
        return hits;
    };
    for e in rd.flatten() {
        let p = e.path();
        if p.is_dir() {
            hits.extend(files_holding(&p, needle));
        } else if p.extension().is_none_or(|x| x != "cred")
            && fs::read(&p).is_ok_and(|b| String::from_utf8_lossy(&b).contains(needle))
        {
            hits.push(p);
        }
    }
    hits
}

fn run_as_nobody(script: &str, arg: &Path) -> std::process::Output {
    Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "sh",
            "-c",
        ])
        .arg(script)
        .arg("sh")
        .arg(arg)
        .output()
        .expect("setpriv")
}

/// NodePublishVolume mounts the bucket prefix for a non-root pod (uid/gid attributes, other
/// users allowed), with the secret's credentials reaching the daemon in a 0600 file only;
/// publishing again is idempotent, with other arguments ALREADY_EXISTS; NodeUnpublishVolume
/// unmounts, waits for the daemon to exit and removes the target.
#[test]
fn csi_publish_mounts_a_prefix_for_a_non_root_pod_and_unpublish_unmounts() {
    let bucket = s3().new_bucket("csi-publish");
    let dir = tempfile::tempdir().unwrap();
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let _clean = Cleanup(dir.path().to_path_buf());
    // A state directory made 0755 by someone else (a hostPath) is made private.
    fs::create_dir(dir.path().join("state")).unwrap();
    fs::set_permissions(dir.path().join("state"), fs::Permissions::from_mode(0o755)).unwrap();
    let driver = Driver::start(dir.path());
    let target = dir.path().join("pods/p1/volumes/target");
    fs::create_dir_all(target.parent().unwrap()).unwrap();
    let vol = format!("{bucket}/vol1");
    let ctx = [
        ("bucket", bucket.as_str()),
        ("prefix", "vol1"),
        ("uid", "65534"),
        ("gid", "65534"),
    ];
    let mut c = Csi::connect(&driver);
    let info =
        c.rt.block_on(c.identity.get_plugin_info(GetPluginInfoRequest {}))
            .unwrap()
            .into_inner();
    assert_eq!(info.name, bucketfs_csi::DRIVER_NAME);
    let n =
        c.rt.block_on(c.node.node_get_info(NodeGetInfoRequest {}))
            .unwrap()
            .into_inner();
    assert_eq!(n.node_id, "node-1");

    c.publish(publish_request(&vol, &target, &ctx, false))
        .expect("NodePublishVolume");
    assert!(fuse_mounted(&target), "not mounted at {}", target.display());

    // A pod user (65534) lists and writes: the files are its own.
    let out = run_as_nobody(
        "ls -la \"$1\" >/dev/null && printf 'from a pod' > \"$1/hello.txt\"",
        &target,
    );
    assert!(
        out.status.success(),
        "as uid 65534: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let md = fs::metadata(target.join("hello.txt")).unwrap();
    assert_eq!((md.uid(), md.gid()), (65534, 65534));
    assert_eq!(
        s3().get(&bucket, "vol1/hello.txt").as_deref(),
        Some(&b"from a pod"[..])
    );

    // The secret is in no command line, no log and no record; only in the 0600 file.
    let daemon = daemon_of(&target);
    let cmdline = fs::read(format!("/proc/{daemon}/cmdline")).unwrap();
    assert!(!String::from_utf8_lossy(&cmdline).contains(&env().secret_key));
    assert_eq!(
        files_holding(dir.path(), &env().secret_key),
        Vec::<PathBuf>::new()
    );
    let creds: Vec<PathBuf> = fs::read_dir(dir.path().join("state/mounts"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "cred"))
        .collect();
    assert_eq!(creds.len(), 1);
    assert_eq!(fs::metadata(&creds[0]).unwrap().mode() & 0o777, 0o600);
    for d in ["state", "state/mounts"] {
        let mode = fs::metadata(dir.path().join(d)).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o700, "{d}");
    }

    // Same arguments again: OK, same daemon. Other arguments: ALREADY_EXISTS.
    c.publish(publish_request(&vol, &target, &ctx, false))
        .expect("second identical NodePublishVolume");
    assert_eq!(daemon_of(&target), daemon);
    let e = c
        .publish(publish_request(&vol, &target, &ctx, true))
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::AlreadyExists, "{e:?}");

    c.unpublish(&vol, &target).expect("NodeUnpublishVolume");
    assert!(!fuse_mounted(&target));
    assert!(!target.exists(), "target not removed");
    assert!(
        !alive(daemon),
        "daemon {daemon} still running: {:?}\n{}",
        fs::read_to_string(format!("/proc/{daemon}/stat")),
        fs::read_to_string(&driver.log).unwrap_or_default()
    );
    assert!(!creds[0].exists(), "credentials file left behind");
    // Unpublishing what is not published is fine.
    c.unpublish(&vol, &target)
        .expect("second NodeUnpublishVolume");

    let log_path = driver.log.clone();
    drop(c);
    drop(driver);
    let log = fs::read_to_string(log_path).unwrap();
    assert!(log.contains("NodePublishVolume"), "driver log: {log}");
    assert!(!log.contains(&env().secret_key));
}

/// A read-only volume (the request's readonly flag) gives EROFS to writers and still reads.
#[test]
fn csi_read_only_volume_refuses_writes_with_erofs() {
    let bucket = s3().new_bucket("csi-ro");
    s3().put(&bucket, "data/existing.txt", "old");
    let dir = tempfile::tempdir().unwrap();
    let _clean = Cleanup(dir.path().to_path_buf());
    let driver = Driver::start(dir.path());
    let target = dir.path().join("target");
    let vol = format!("{bucket}/data");
    let mut c = Csi::connect(&driver);
    c.publish(publish_request(
        &vol,
        &target,
        &[("bucket", bucket.as_str()), ("prefix", "data")],
        true,
    ))
    .expect("NodePublishVolume");
    assert_eq!(
        fs::read_to_string(target.join("existing.txt")).unwrap(),
        "old"
    );
    let e = fs::write(target.join("new.txt"), "x").unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EROFS), "{e}");
    c.unpublish(&vol, &target).expect("NodeUnpublishVolume");
    assert_eq!(s3().get(&bucket, "data/new.txt"), None);
}

/// `kill -9` of the driver (its whole process group) leaves its mounts serving; a restarted
/// driver on the same state directory recognises them (a repeated publish keeps the same
/// daemon), remounts one whose daemon died meanwhile and one that dies while it runs, and
/// unpublishes both.
#[test]
fn csi_mounts_survive_a_driver_kill_and_the_restarted_driver_knows_them() {
    let bucket = s3().new_bucket("csi-restart");
    let dir = tempfile::tempdir().unwrap();
    let _clean = Cleanup(dir.path().to_path_buf());
    let mut driver = Driver::start(dir.path());
    let (t1, t2) = (dir.path().join("t1"), dir.path().join("t2"));
    let (v1, v2) = (format!("{bucket}/a"), format!("{bucket}/b"));
    let c1 = [("bucket", bucket.as_str()), ("prefix", "a")];
    let c2 = [("bucket", bucket.as_str()), ("prefix", "b")];
    let mut c = Csi::connect(&driver);
    c.publish(publish_request(&v1, &t1, &c1, false))
        .expect("NodePublishVolume 1");
    c.publish(publish_request(&v2, &t2, &c2, false))
        .expect("NodePublishVolume 2");
    drop(c);
    let d1 = daemon_of(&t1);
    let d2 = daemon_of(&t2);
    driver.kill9();

    // The driver is gone; the mounts are not.
    fs::write(t1.join("after-kill.txt"), "still here").unwrap();
    assert_eq!(
        s3().get(&bucket, "a/after-kill.txt").as_deref(),
        Some(&b"still here"[..])
    );
    // The second daemon dies too while no driver runs (an OOM kill, say).
    // SAFETY: plain syscall on the test's own daemon.
    unsafe { libc::kill(d2 as i32, libc::SIGKILL) };
    wait_for("daemon 2 to die", Duration::from_secs(10), || !alive(d2));

    let driver = Driver::start(dir.path());
    let mut c = Csi::connect(&driver);
    // Recognised: the same publish is OK and keeps the same daemon.
    c.publish(publish_request(&v1, &t1, &c1, false))
        .expect("NodePublishVolume after restart");
    assert_eq!(daemon_of(&t1), d1);
    // Remounted at startup: the target serves again, from a new daemon.
    // Mounted again (a write before that would land in the bare directory).
    wait_for("t2 to be mounted again", Duration::from_secs(20), || {
        fuse_mounted(&t2) && fs::read_dir(&t2).is_ok()
    });
    fs::write(t2.join("again.txt"), "again").unwrap();
    assert_ne!(daemon_of(&t2), d2);
    assert_eq!(
        s3().get(&bucket, "b/again.txt").as_deref(),
        Some(&b"again"[..])
    );
    // A daemon dying while the driver runs is remounted too, within its heal interval.
    // SAFETY: plain syscall on the test's own daemon.
    unsafe { libc::kill(d1 as i32, libc::SIGKILL) };
    wait_for("daemon 1 to die", Duration::from_secs(10), || !alive(d1));
    // Mounted again (a write before that would land in the bare directory).
    wait_for("t1 to be mounted again", Duration::from_secs(20), || {
        fuse_mounted(&t1) && fs::read_dir(&t1).is_ok()
    });
    fs::write(t1.join("healed.txt"), "healed").unwrap();
    assert_ne!(daemon_of(&t1), d1);
    assert_eq!(
        s3().get(&bucket, "a/healed.txt").as_deref(),
        Some(&b"healed"[..])
    );
    for (v, t) in [(&v1, &t1), (&v2, &t2)] {
        c.unpublish(v, t)
            .expect("NodeUnpublishVolume after restart");
        assert!(!fuse_mounted(t) && !t.exists());
    }
}

/// A daemon dies while its store does not answer: the remount fails. The driver forgot the
/// volume then (record and credentials deleted), and the kubelet never publishes a mounted
/// volume again, so the pod's volume stayed dead (`ENOTCONN`) for good. It is now tried
/// again, less often as it fails, and mounts once the store is back.
#[test]
fn csi_a_remount_that_fails_is_tried_again_until_it_works() {
    let bucket = s3().new_bucket("csi-remount");
    let proxy = proxy::FaultProxy::start(&minio_addr());
    let dir = tempfile::tempdir().unwrap();
    let _clean = Cleanup(dir.path().to_path_buf());
    let driver = Driver::start(dir.path());
    let target = dir.path().join("t");
    let vol = format!("{bucket}/v");
    let ctx = [("bucket", bucket.as_str()), ("prefix", "v")];
    let mut c = Csi::connect(&driver);
    let mut p = publish_request(&vol, &target, &ctx, false);
    p.secrets.insert("endpoint".into(), proxy.endpoint());
    c.publish(p).expect("NodePublishVolume");
    fs::write(target.join("before.txt"), "before").unwrap();
    let daemon = daemon_of(&target);
    // The store refuses every connection from now on.
    proxy.fail_requests("", u64::MAX);
    // SAFETY: plain syscall on the test's own daemon.
    unsafe { libc::kill(daemon as i32, libc::SIGKILL) };
    wait_for("the daemon to die", Duration::from_secs(10), || {
        !alive(daemon)
    });
    wait_for("a remount to fail", Duration::from_secs(120), || {
        fs::read_to_string(&driver.log)
            .unwrap_or_default()
            .contains(&format!("at {} failed", target.display()))
    });
    assert!(!fuse_mounted(&target), "mounted while the store refuses");
    // Meanwhile a pod's container restarting binds the target: an empty read-only stand-in,
    // never the bare directory (its writes went to the node's disk, and the remount then
    // found the target not empty, for good).
    let e = fs::write(target.join("local.txt"), "lost").unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EROFS), "{e}");
    // The kubelet publishing again meanwhile is not told the fence is someone else's mount.
    let mut again = publish_request(&vol, &target, &ctx, false);
    again.secrets.insert("endpoint".into(), proxy.endpoint());
    let e = c.publish(again.clone()).unwrap_err();
    assert_ne!(e.code(), tonic::Code::AlreadyExists, "{e}");
    proxy.fail_requests("", 0);
    // The failed publish left the remount going on: it mounts the target again by itself.
    wait_for(
        "the target to be mounted again",
        Duration::from_secs(120),
        || fuse_mounted(&target) && fs::read_dir(&target).is_ok(),
    );
    c.publish(again)
        .expect("NodePublishVolume of the mounted target");
    assert_eq!(
        fs::read_to_string(target.join("before.txt")).unwrap(),
        "before"
    );
    fs::write(target.join("after.txt"), "after").unwrap();
    assert_eq!(
        s3().get(&bucket, "v/after.txt").as_deref(),
        Some(&b"after"[..])
    );
    c.unpublish(&vol, &target).expect("NodeUnpublishVolume");
    assert!(!fuse_mounted(&target) && !target.exists());
}

/// CreateVolume makes a prefix (its marker) in the StorageClass's bucket, whose context
/// mounts it; DeleteVolume removes every object under it.
#[test]
fn csi_create_volume_makes_a_prefix_and_delete_volume_empties_it() {
    let bucket = s3().new_bucket("csi-provision");
    s3().put(&bucket, "keep/other.txt", "not mine");
    let dir = tempfile::tempdir().unwrap();
    let _clean = Cleanup(dir.path().to_path_buf());
    let driver = Driver::start(dir.path());
    let target = dir.path().join("target");
    let mut c = Csi::connect(&driver);
    let req = CreateVolumeRequest {
        name: "pvc-123".into(),
        capacity_range: Some(CapacityRange {
            required_bytes: 1 << 30,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![mount_capability(Mode::MultiNodeMultiWriter)],
        parameters: HashMap::from([
            ("bucket".to_string(), bucket.clone()),
            ("prefix".to_string(), "volumes".to_string()),
        ]),
        secrets: secrets(),
        ..Default::default()
    };
    let vol =
        c.rt.block_on(c.controller.create_volume(req.clone()))
            .expect("CreateVolume")
            .into_inner()
            .volume
            .unwrap();
    assert_eq!(vol.volume_id, format!("{bucket}/volumes/pvc-123"));
    assert!(s3().head(&bucket, "volumes/pvc-123/").is_some());
    // Same again: the same volume.
    let again =
        c.rt.block_on(c.controller.create_volume(req))
            .expect("second CreateVolume")
            .into_inner();
    assert_eq!(again.volume.unwrap().volume_id, vol.volume_id);

    let mut p = publish_request(&vol.volume_id, &target, &[], false);
    p.volume_context = vol.volume_context.clone();
    c.publish(p).expect("NodePublishVolume");
    fs::create_dir(target.join("sub")).unwrap();
    fs::write(target.join("sub/f.txt"), "data").unwrap();
    c.unpublish(&vol.volume_id, &target).unwrap();
    assert!(s3().get(&bucket, "volumes/pvc-123/sub/f.txt").is_some());

    c.rt.block_on(c.controller.delete_volume(DeleteVolumeRequest {
        volume_id: vol.volume_id.clone(),
        secrets: secrets(),
    }))
    .expect("DeleteVolume");
    assert_eq!(
        s3().list_keys(&bucket, ""),
        ["keep/other.txt".to_string()].into_iter().collect()
    );
}

/// The csi-sanity binary: BUCKETFS_TEST_CSI_SANITY, else PATH, else GOPATH/bin.
fn csi_sanity() -> PathBuf {
    if let Some(p) = std::env::var_os("BUCKETFS_TEST_CSI_SANITY") {
        return PathBuf::from(p);
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    let gopath = Command::new("go")
        .args(["env", "GOPATH"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    std::env::split_paths(&path)
        .chain(gopath.split(':').map(|g| Path::new(g).join("bin")))
        .map(|d| d.join("csi-sanity"))
        .find(|p| p.is_file())
        .expect(
            "csi-sanity not found (scripts/test.sh installs it: go install \
             github.com/kubernetes-csi/csi-test/v5/cmd/csi-sanity@VERSION)",
        )
}

/// The CSI specification's conformance tests (csi-sanity) pass against the driver and MinIO:
/// identity, controller (create/delete/validate) and node (publish/unpublish with real
/// mounts) services.
#[test]
fn csi_sanity_passes() {
    let sanity = csi_sanity();
    let bucket = s3().new_bucket("csi-sanity");
    let dir = tempfile::tempdir().unwrap();
    let _clean = Cleanup(dir.path().to_path_buf());
    let driver = Driver::start(dir.path());
    let s = secrets();
    let mut yaml = String::new();
    for section in [
        "CreateVolumeSecret",
        "DeleteVolumeSecret",
        "NodePublishVolumeSecret",
        "ControllerValidateVolumeCapabilitiesSecret",
    ] {
        yaml.push_str(&format!("{section}:\n"));
        for (k, v) in &s {
            yaml.push_str(&format!("  {k}: \"{v}\"\n"));
        }
    }
    let secrets_file = dir.path().join("secrets.yaml");
    fs::write(&secrets_file, yaml).unwrap();
    fs::set_permissions(&secrets_file, fs::Permissions::from_mode(0o600)).unwrap();
    let params_file = dir.path().join("params.yaml");
    fs::write(
        &params_file,
        format!("bucket: \"{bucket}\"\nprefix: \"sanity\"\n"),
    )
    .unwrap();
    let out = Command::new(&sanity)
        .arg(format!("--csi.endpoint=unix://{}", driver.socket.display()))
        .arg(format!("--csi.secrets={}", secrets_file.display()))
        .arg(format!(
            "--csi.testvolumeparameters={}",
            params_file.display()
        ))
        .arg(format!(
            "--csi.mountdir={}",
            dir.path().join("mnt").display()
        ))
        .arg(format!(
            "--csi.stagingdir={}",
            dir.path().join("stage").display()
        ))
        .args(["--ginkgo.no-color", "--ginkgo.timeout=5m"])
        .output()
        .expect("run csi-sanity");
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    let summary: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("Ran ") || l.contains(" Passed | "))
        .collect();
    println!("csi-sanity: {}", summary.join("; "));
    assert!(
        out.status.success(),
        "csi-sanity failed:\n{}",
        text.lines()
            .filter(|l| !l.trim().is_empty())
            .collect::<Vec<_>>()
            .join("\n")
    );
    let passed: usize = summary
        .iter()
        .find_map(|l| l.split(" Passed").next()?.rsplit(' ').next()?.parse().ok())
        .expect("a Passed count in csi-sanity's summary");
    assert!(passed >= 20, "only {passed} csi-sanity specs passed");
    // Everything it created is gone again: the volumes and their mounts.
    assert!(!fuse_mounted(&dir.path().join("mnt/target")));
    assert_eq!(s3().list_keys(&bucket, "sanity/"), Default::default());
}

// Defects a review found (DeleteVolume scope, credentials in logs and environments, files left
// by failed publishes, target path spellings).

fn delete_volume(c: &mut Csi, id: &str) -> Result<(), tonic::Status> {
    c.rt.block_on(c.controller.delete_volume(DeleteVolumeRequest {
        volume_id: id.into(),
        secrets: secrets(),
    }))
    .map(|_| ())
}

/// The files of the driver's state directory `mounts/` (records, credentials).
fn state_files(dir: &Path) -> Vec<PathBuf> {
    fs::read_dir(dir.join("state/mounts"))
        .map(|rd| rd.flatten().map(|e| e.path()).collect())
        .unwrap_or_default()
}

/// DeleteVolume empties only prefixes with the driver's volume marker: an id naming other data
/// (no marker, or a plain directory marker of another tool) deletes nothing; an id whose bucket
/// is gone is OK (the volume is gone); a provisioned volume of many files is emptied, marker
/// included. CreateVolume refuses an endpoint DeleteVolume would not see.
#[test]
fn csi_delete_volume_deletes_only_volumes_the_driver_made() {
    let bucket = s3().new_bucket("csi-delscope");
    s3().put(&bucket, "data/x.txt", "not the driver's");
    s3().put(&bucket, "plain/", "");
    s3().put(&bucket, "plain/y.txt", "not the driver's either");
    let dir = tempfile::tempdir().unwrap();
    let _clean = Cleanup(dir.path().to_path_buf());
    let driver = Driver::start(dir.path());
    let mut c = Csi::connect(&driver);
    for id in [format!("{bucket}/data"), format!("{bucket}/plain")] {
        delete_volume(&mut c, &id).expect("DeleteVolume of data without a marker");
    }
    assert_eq!(
        s3().list_keys(&bucket, ""),
        ["data/x.txt", "plain/", "plain/y.txt"]
            .map(String::from)
            .into_iter()
            .collect()
    );
    delete_volume(&mut c, &format!("{bucket}-gone/vol")).expect("DeleteVolume, no bucket");

    let mut req = CreateVolumeRequest {
        name: "pvc-many".into(),
        volume_capabilities: vec![mount_capability(Mode::MultiNodeMultiWriter)],
        parameters: HashMap::from([
            ("bucket".to_string(), bucket.clone()),
            ("prefix".to_string(), "volumes".to_string()),
        ]),
        secrets: secrets(),
        ..Default::default()
    };
    let vol =
        c.rt.block_on(c.controller.create_volume(req.clone()))
            .expect("CreateVolume")
            .into_inner()
            .volume
            .unwrap();
    for i in 0..120 {
        s3().put(&bucket, &format!("volumes/pvc-many/d{}/f{i}", i % 7), "x");
    }
    delete_volume(&mut c, &vol.volume_id).expect("DeleteVolume");
    assert_eq!(s3().list_keys(&bucket, "volumes/"), Default::default());
    assert_eq!(s3().list_keys(&bucket, "").len(), 3);

    // An endpoint only the parameters give: DeleteVolume (secret only) would miss the store.
    req.name = "pvc-elsewhere".into();
    req.parameters
        .insert("endpoint".into(), env().endpoint.clone());
    req.secrets.remove("endpoint");
    let e = c.rt.block_on(c.controller.create_volume(req)).unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(s3().head(&bucket, "volumes/pvc-elsewhere/").is_none());
}

/// With the driver at trace and RUST_LOG=trace, AWS_* and BUCKETFS_* in its environment, a
/// publish and a publish with a session token leave neither the access key id, the secret nor
/// the token in a daemon's log; the daemon's environment holds none of those variables; debug
/// and trace log levels from a volume are refused.
#[test]
fn csi_trace_logs_and_daemon_environment_hold_no_credentials() {
    let bucket = s3().new_bucket("csi-creds");
    let dir = tempfile::tempdir().unwrap();
    let _clean = Cleanup(dir.path().to_path_buf());
    let token = "csifixSESSIONTOKENnotreal0123456789";
    let driver = Driver::start_with(
        dir.path(),
        "trace",
        &[
            ("RUST_LOG", "trace"),
            ("BUCKETFS_LOG_LEVEL", "trace"),
            ("AWS_ROLE_ARN", "arn:aws:iam::123456789012:role/driver"),
            ("AWS_WEB_IDENTITY_TOKEN_FILE", "/nonexistent/token"),
            (
                "AWS_CONTAINER_AUTHORIZATION_TOKEN",
                "driver-container-token",
            ),
            ("AWS_CONFIG_FILE", "/nonexistent/config"),
            ("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials"),
        ],
    );
    let mut c = Csi::connect(&driver);
    let target = dir.path().join("target");
    let vol = format!("{bucket}/v");
    let ctx = [("bucket", bucket.as_str()), ("prefix", "v")];
    c.publish(publish_request(&vol, &target, &ctx, false))
        .expect("NodePublishVolume");
    fs::write(target.join("f.txt"), "x").unwrap();
    let environ = fs::read(format!("/proc/{}/environ", daemon_of(&target))).unwrap();
    let leaked: Vec<String> = environ
        .split(|b| *b == 0)
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .filter(|v| {
            ["AWS_", "RUST_LOG", "BUCKETFS_"]
                .iter()
                .any(|p| v.starts_with(p))
        })
        .collect();
    assert_eq!(leaked, Vec::<String>::new(), "in the daemon's environment");
    // The daemon's log goes with its unpublish: look while it serves.
    for secret in [&env().access_key, &env().secret_key] {
        assert_eq!(files_holding(dir.path(), secret), Vec::<PathBuf>::new());
    }
    c.unpublish(&vol, &target).expect("NodeUnpublishVolume");

    // A volume may not turn on the logs that show requests.
    for (ctx_opts, flags) in [("log_level=trace", vec![]), ("", vec!["log_level=debug"])] {
        let mut p = publish_request(&vol, &target, &ctx, false);
        if !ctx_opts.is_empty() {
            p.volume_context.insert("options".into(), ctx_opts.into());
        }
        if let Some(AccessType::Mount(m)) = p
            .volume_capability
            .as_mut()
            .and_then(|c| c.access_type.as_mut())
        {
            m.mount_flags = flags.iter().map(|f| f.to_string()).collect();
        }
        let e = c.publish(p).unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        assert!(e.message().contains("log_level"), "{e:?}");
    }

    // Session credentials (MinIO refuses this token): the signer at trace must not show it.
    let mut p = publish_request(&vol, &target, &ctx, false);
    p.secrets.insert("sessionToken".into(), token.into());
    c.publish(p).expect_err("a made-up session token mounts");
    let mut secrets = secrets();
    secrets.insert("sessionToken".into(), token.into());
    let _ =
        c.rt.block_on(c.controller.create_volume(CreateVolumeRequest {
            name: "pvc-token".into(),
            volume_capabilities: vec![mount_capability(Mode::MultiNodeMultiWriter)],
            parameters: HashMap::from([("bucket".to_string(), bucket.clone())]),
            secrets,
            ..Default::default()
        }));
    drop(c);
    drop(driver);
    // The daemons' side (logs, records). The driver's own log at trace is not checked: it
    // still shows a credential there (open).
    for secret in [&env().access_key, &env().secret_key, &token.to_string()] {
        assert_eq!(
            files_holding(&dir.path().join("state"), secret),
            Vec::<PathBuf>::new()
        );
    }
}

/// A publish that fails (no such bucket, wrong secret key, a target that cannot be made)
/// leaves no record, no credentials file and no mount behind.
#[test]
fn csi_failed_publish_leaves_no_credentials_record_or_mount() {
    let bucket = s3().new_bucket("csi-failpub");
    let dir = tempfile::tempdir().unwrap();
    let _clean = Cleanup(dir.path().to_path_buf());
    let driver = Driver::start(dir.path());
    let mut c = Csi::connect(&driver);
    fs::write(dir.path().join("file"), "").unwrap();
    let missing = format!("{bucket}-missing");
    let cases = [
        ("no bucket", missing.as_str(), dir.path().join("t1"), false),
        ("bad secret", bucket.as_str(), dir.path().join("t2"), true),
        (
            "target under a file",
            bucket.as_str(),
            dir.path().join("file/t3"),
            false,
        ),
    ];
    for (what, b, target, bad_secret) in cases {
        let mut p = publish_request(&format!("{b}/v"), &target, &[("bucket", b)], false);
        if bad_secret {
            p.secrets
                .insert("secretAccessKey".into(), "not-the-secret".into());
        }
        c.publish(p).expect_err(what);
        assert!(!fuse_mounted(&target), "{what}: mounted");
        assert_eq!(state_files(dir.path()), Vec::<PathBuf>::new(), "{what}");
    }
}

/// A target path spelled with a double or trailing slash is the same directory: it mounts,
/// publishes again idempotently, and unpublishes under another spelling.
#[test]
fn csi_target_paths_with_extra_slashes_publish_and_unpublish() {
    let bucket = s3().new_bucket("csi-slashes");
    let dir = tempfile::tempdir().unwrap();
    let _clean = Cleanup(dir.path().to_path_buf());
    let driver = Driver::start(dir.path());
    let mut c = Csi::connect(&driver);
    let target = dir.path().join("pod/t");
    let spelled = PathBuf::from(format!("{}//pod//t/", dir.path().display()));
    let vol = format!("{bucket}/v");
    let ctx = [("bucket", bucket.as_str()), ("prefix", "v")];
    c.publish(publish_request(&vol, &spelled, &ctx, false))
        .expect("NodePublishVolume of /a//b/");
    assert!(fuse_mounted(&target));
    let daemon = daemon_of(&target);
    c.publish(publish_request(&vol, &target, &ctx, false))
        .expect("NodePublishVolume again, plain spelling");
    assert_eq!(daemon_of(&target), daemon);
    c.unpublish(&vol, &PathBuf::from(format!("{}/", target.display())))
        .expect("NodeUnpublishVolume of /a/b/");
    assert!(!fuse_mounted(&target) && !target.exists());
    assert_eq!(state_files(dir.path()), Vec::<PathBuf>::new());
    // Through a link above it (a kubelet root that is a link): mounted where the link
    // leads, and unpublished (before: the mount was never seen, its daemon was killed after
    // 60 s and every unpublish failed on the dead mount it left).
    let kubelet = dir.path().join("kubelet");
    std::os::unix::fs::symlink(dir.path(), &kubelet).unwrap();
    let via = kubelet.join("pod2/t");
    c.publish(publish_request(&vol, &via, &ctx, false))
        .expect("NodePublishVolume through a link");
    let real = dir.path().canonicalize().unwrap().join("pod2/t");
    assert!(fuse_mounted(&real));
    std::fs::write(via.join("f"), b"through the link").unwrap();
    c.unpublish(&vol, &via)
        .expect("NodeUnpublishVolume through a link");
    assert!(!fuse_mounted(&real) && !real.exists());
    assert_eq!(s3().get(&bucket, "v/f").unwrap(), b"through the link");
    // A link as the target itself is refused.
    std::fs::create_dir_all(dir.path().join("pod3/real")).unwrap();
    let link = dir.path().join("pod3/t");
    std::os::unix::fs::symlink(dir.path().join("pod3/real"), &link).unwrap();
    let e = c
        .publish(publish_request(&vol, &link, &ctx, false))
        .expect_err("a target that is a link");
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(!fuse_mounted(&dir.path().join("pod3/real")));
}

// The node plugin's container: mounts must outlive it (issue 24).

/// A stand-in for the node plugin's container with `hostPID: true`: a cgroup of its own (the
/// runtime kills every process in it when the container stops) and a mount namespace of its
/// own in which the test's directory is a shared peer of the host's
/// (`mountPropagation: Bidirectional`).
struct Container {
    cgroup: PathBuf,
}

static CONTAINERS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

impl Container {
    fn new() -> Container {
        let text = fs::read_to_string("/proc/self/mountinfo").unwrap();
        let root = text
            .lines()
            .find_map(|l| {
                let f: Vec<&str> = l.split(' ').collect();
                let sep = f.iter().position(|x| *x == "-")?;
                (f.get(sep + 1) == Some(&"cgroup2")).then(|| PathBuf::from(f[4]))
            })
            .expect("a cgroup2 hierarchy (cgroup.kill)");
        let n = CONTAINERS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let cgroup = root.join(format!("bucketfs-csi-test-{}-{n}", std::process::id()));
        fs::create_dir(&cgroup).expect("create the container's cgroup");
        Container { cgroup }
    }

    /// `bucketfs` run in the container: in its cgroup, in a mount namespace of its own.
    fn command(&self) -> Command {
        let procs = std::ffi::CString::new(
            self.cgroup
                .join("cgroup.procs")
                .to_string_lossy()
                .into_owned(),
        )
        .unwrap();
        let mut cmd = Command::new("unshare");
        cmd.args(["--mount", "--propagation", "unchanged", "--"])
            .arg(bin());
        // SAFETY: open, write and close on a path made before the fork.
        unsafe {
            cmd.pre_exec(move || {
                let fd = libc::open(procs.as_ptr(), libc::O_WRONLY);
                if fd < 0 || libc::write(fd, c"0".as_ptr().cast(), 1) != 1 {
                    return Err(std::io::Error::last_os_error());
                }
                libc::close(fd);
                Ok(())
            });
        }
        cmd
    }

    fn pids(&self) -> Vec<u32> {
        fs::read_to_string(self.cgroup.join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.parse().ok())
            .collect()
    }

    /// What the runtime does when the container stops: SIGKILL to every process in it.
    fn kill(&self) {
        fs::write(self.cgroup.join("cgroup.kill"), "1").expect("cgroup.kill");
        wait_for("the container to be empty", Duration::from_secs(10), || {
            self.pids().is_empty()
        });
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        let _ = fs::write(self.cgroup.join("cgroup.kill"), "1");
        for _ in 0..100 {
            if fs::remove_dir(&self.cgroup).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// The test directory bind-mounted on itself and made shared, so that a container's mount
/// namespace sees the host's mounts under it and the host its (Bidirectional).
struct SharedDir(PathBuf);

impl SharedDir {
    fn new(dir: &Path) -> SharedDir {
        for args in [vec!["--bind", "DIR", "DIR"], vec!["--make-shared", "DIR"]] {
            let ok = Command::new("mount")
                .args(args.iter().map(|a| {
                    if *a == "DIR" {
                        dir.as_os_str()
                    } else {
                        a.as_ref()
                    }
                }))
                .status()
                .unwrap();
            assert!(ok.success(), "mount {args:?} {}", dir.display());
        }
        SharedDir(dir.to_path_buf())
    }
}

impl Drop for SharedDir {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// The node plugin's container is killed (the runtime kills every process of its cgroup: a
/// crash, an OOM kill, a DaemonSet update) while a pod's volume is mounted: the mount keeps
/// serving reads and writes from the same daemon, and a driver in a new container recognises
/// it (the repeated NodePublishVolume is OK with the same daemon) and NodeUnpublishVolume
/// unmounts it cleanly.
#[test]
fn csi_mounts_survive_the_node_container_being_killed() {
    let bucket = s3().new_bucket("csi-container");
    let dir = tempfile::tempdir().unwrap();
    let _clean = Cleanup(dir.path().to_path_buf());
    let _shared = SharedDir::new(dir.path());
    let first = Container::new();
    let mut driver = Driver::launch(dir.path(), "debug", &[], &[], Some(&first));
    let target = dir.path().join("pods/p1/volumes/v");
    fs::create_dir_all(target.parent().unwrap()).unwrap();
    let vol = format!("{bucket}/v");
    let ctx = [("bucket", bucket.as_str()), ("prefix", "v")];
    let mut c = Csi::connect(&driver);
    c.publish(publish_request(&vol, &target, &ctx, false))
        .expect("NodePublishVolume");
    fs::write(target.join("before.txt"), "before").unwrap();
    let daemon = daemon_of(&target);
    drop(c);

    first.kill();
    let _ = driver.child.wait();
    assert!(
        alive(daemon),
        "the daemon died with the container: {}",
        fs::read_to_string(&driver.log).unwrap_or_default()
    );
    // The pod's mount serves on: reads, writes, stored.
    assert_eq!(
        fs::read_to_string(target.join("before.txt")).unwrap(),
        "before"
    );
    fs::write(target.join("after.txt"), "after the container died").unwrap();
    assert_eq!(
        s3().get(&bucket, "v/after.txt").as_deref(),
        Some(&b"after the container died"[..])
    );

    let second = Container::new();
    let driver = Driver::launch(dir.path(), "debug", &[], &[], Some(&second));
    let mut c = Csi::connect(&driver);
    c.publish(publish_request(&vol, &target, &ctx, false))
        .expect("NodePublishVolume in the new container");
    assert_eq!(daemon_of(&target), daemon, "recognised, not mounted again");
    c.unpublish(&vol, &target)
        .expect("NodeUnpublishVolume in the new container");
    assert!(!fuse_mounted(&target), "still mounted");
    assert!(!target.exists(), "target not removed");
    wait_for("the daemon to exit", Duration::from_secs(10), || {
        !alive(daemon)
    });
    assert_eq!(state_files(dir.path()), Vec::<PathBuf>::new());
}

/// A volume whose store accepts connections and never answers holds up only its own publish:
/// another volume publishes and unpublishes meanwhile.
#[test]
fn csi_a_stalled_volume_does_not_hold_up_the_others() {
    let bucket = s3().new_bucket("csi-stalled");
    let proxy = proxy::FaultProxy::start(&minio_addr());
    proxy.stall(true);
    let dir = tempfile::tempdir().unwrap();
    let _clean = Cleanup(dir.path().to_path_buf());
    let driver = Driver::start(dir.path());
    let (stalled, fine) = (dir.path().join("stalled"), dir.path().join("fine"));
    let ctx = [("bucket", bucket.as_str()), ("prefix", "v")];
    let vol = format!("{bucket}/v");
    std::thread::scope(|s| {
        let hung = s.spawn(|| {
            let mut c = Csi::connect(&driver);
            let mut p = publish_request(&vol, &stalled, &ctx, false);
            p.secrets.insert("endpoint".into(), proxy.endpoint());
            c.publish(p)
        });
        wait_for(
            "the stalled volume's daemon",
            Duration::from_secs(10),
            || processes_mentioning(&stalled.to_string_lossy()).len() == 1,
        );
        std::thread::sleep(Duration::from_millis(500));
        let mut c = Csi::connect(&driver);
        let t0 = std::time::Instant::now();
        c.publish(publish_request(&vol, &fine, &ctx, false))
            .expect("NodePublishVolume of the other volume");
        fs::write(fine.join("f.txt"), "fine").unwrap();
        c.unpublish(&vol, &fine)
            .expect("NodeUnpublishVolume of the other volume");
        let took = t0.elapsed();
        assert!(took < Duration::from_secs(10), "took {took:?}");
        assert!(
            !hung.is_finished(),
            "the stalled publish ended already: {:?}",
            hung.join()
        );
        // The stalled daemon gives up (killed here): its publish fails.
        for pid in processes_mentioning(&stalled.to_string_lossy()) {
            // SAFETY: plain syscall on the test's own daemon.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
        hung.join()
            .unwrap()
            .expect_err("the stalled volume's publish");
    });
    assert!(!fuse_mounted(&stalled));
    assert_eq!(s3().get(&bucket, "v/f.txt").as_deref(), Some(&b"fine"[..]));
}

/// NodeUnpublishVolume of a hung daemon (stopped) whose mount is busy (a process has its
/// working directory in it): UNAVAILABLE until the unpublish timeout has passed since the
/// first call, then the mount is detached and the daemon killed, and the call succeeds.
#[test]
fn csi_unpublish_of_a_hung_busy_mount_escalates_after_the_timeout() {
    let bucket = s3().new_bucket("csi-hung");
    let dir = tempfile::tempdir().unwrap();
    let _clean = Cleanup(dir.path().to_path_buf());
    let driver = Driver::launch(dir.path(), "debug", &[], &["--unpublish-timeout=3"], None);
    let target = dir.path().join("t");
    let vol = format!("{bucket}/v");
    let ctx = [("bucket", bucket.as_str()), ("prefix", "v")];
    let mut c = Csi::connect(&driver);
    c.publish(publish_request(&vol, &target, &ctx, false))
        .expect("NodePublishVolume");
    fs::write(target.join("f.txt"), "x").unwrap();
    let daemon = daemon_of(&target);
    let mut holder = Command::new("sleep")
        .arg("60")
        .current_dir(&target)
        .spawn()
        .unwrap();
    // SAFETY: plain syscall on the test's own daemon.
    unsafe { libc::kill(daemon as i32, libc::SIGSTOP) };
    let t0 = std::time::Instant::now();
    let e = c.unpublish(&vol, &target).unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    std::thread::sleep(Duration::from_secs(3));
    c.unpublish(&vol, &target)
        .expect("NodeUnpublishVolume after the timeout");
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    assert!(!fuse_mounted(&target));
    assert!(!target.exists());
    wait_for("the hung daemon to die", Duration::from_secs(5), || {
        !alive(daemon)
    });
    let _ = holder.kill();
    let _ = holder.wait();
    assert_eq!(state_files(dir.path()), Vec::<PathBuf>::new());
}

/// A daemon without its mount that the publish did not start (here an admin's `umount -l`
/// while a file is being written; an unpublish the kubelet cut off or a driver restart leave
/// the same) is never killed by a publish: it is given as long as a start may take to mount,
/// then the publish is `UNAVAILABLE` and the daemon goes on to store the file once it is
/// closed; after it exits, a publish mounts again. Before, the publish killed it (SIGKILL
/// after 60 s) and the file was lost.
#[test]
fn csi_a_publish_never_kills_a_daemon_storing_the_files_of_an_unmount() {
    let bucket = s3().new_bucket("csi-detached");
    let dir = tempfile::tempdir().unwrap();
    let _clean = Cleanup(dir.path().to_path_buf());
    let driver = Driver::start(dir.path());
    let target = dir.path().join("target-d");
    let vol = format!("{bucket}/v");
    let ctx = [("bucket", bucket.as_str()), ("prefix", "v")];
    let mut c = Csi::connect(&driver);
    c.publish(publish_request(&vol, &target, &ctx, false))
        .expect("NodePublishVolume");
    let daemon = daemon_of(&target);
    let mut w = ForeignWriter::start();
    w.open("f", &target.join("f.bin"));
    assert_eq!(w.cmd("fill f 3"), "ok");
    let st = Command::new("umount")
        .arg("-l")
        .arg(&target)
        .status()
        .unwrap();
    assert!(st.success());
    assert!(!fuse_mounted(&target));
    let e = c
        .publish(publish_request(&vol, &target, &ctx, false))
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
    assert!(
        alive(daemon),
        "the publish killed the daemon of the unmount"
    );
    assert_eq!(w.cmd("close f"), "ok");
    let got = s3()
        .get(&bucket, "v/f.bin")
        .expect("the file written stored");
    assert_eq!(got.len(), 3 * MIB);
    assert!(got.chunks(MIB).all(|b| b == writer_block()));
    wait_for("the daemon to exit", Duration::from_secs(20), || {
        !alive(daemon)
    });
    c.publish(publish_request(&vol, &target, &ctx, false))
        .expect("NodePublishVolume once it exited");
    assert!(fuse_mounted(&target));
    assert_eq!(fs::read(target.join("f.bin")).unwrap().len(), 3 * MIB);
    c.unpublish(&vol, &target).expect("NodeUnpublishVolume");
}

/// A daemon whose record cannot be saved (here a directory in the way of the record's
/// temporary file; a full state disk does the same) is stopped, not left to mount in no
/// record: the publish fails with nothing mounted and no daemon left, as a child and as a
/// systemd unit (killed with `systemctl kill`: before, the unit went on and mounted).
#[test]
fn csi_a_daemon_whose_record_cannot_be_saved_is_stopped() {
    let bucket = s3().new_bucket("csi-norecord");
    let dir = tempfile::tempdir().unwrap();
    let _clean = Cleanup(dir.path().to_path_buf());
    let (fake, path) = stand_in_systemd(dir.path());
    let path_env = [("PATH", path.as_str())];
    let ctx = [("bucket", bucket.as_str()), ("prefix", "v")];
    let vol = format!("{bucket}/v");
    for (n, extra) in [&[][..], &["--daemons=systemd"][..]]
        .into_iter()
        .enumerate()
    {
        let state = dir.path().join(format!("run{n}"));
        fs::create_dir(&state).unwrap();
        let driver = Driver::launch(&state, "debug", &path_env, extra, None);
        let target = state.join("target-r");
        let mut c = Csi::connect(&driver);
        // The record's name, from a first publish.
        c.publish(publish_request(&vol, &target, &ctx, false))
            .expect("NodePublishVolume");
        let record = state_files(&state)
            .into_iter()
            .find(|p| p.extension().is_some_and(|x| x == "toml"))
            .expect("a record");
        c.unpublish(&vol, &target).expect("NodeUnpublishVolume");
        let needle = target.to_string_lossy().to_string();
        wait_for("the daemon to exit", Duration::from_secs(10), || {
            processes_mentioning(&needle).is_empty()
        });
        fs::create_dir(record.with_extension("tmp")).unwrap();
        let e = c
            .publish(publish_request(&vol, &target, &ctx, false))
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Internal, "{e:?}");
        wait_for("no daemon left", Duration::from_secs(10), || {
            processes_mentioning(&needle).is_empty()
        });
        std::thread::sleep(Duration::from_secs(2));
        assert!(!fuse_mounted(&target), "a daemon in no record mounted");
        assert!(processes_mentioning(&needle).is_empty());
        if n == 1 {
            // Not left to die of its credentials file removed after it (it may have read
            // it already, or need none).
            let calls = fs::read_to_string(fake.join("calls")).unwrap();
            assert!(
                calls
                    .lines()
                    .any(|l| l.contains("systemctl kill --signal=SIGKILL bucketfs-csi-")),
                "{calls}"
            );
        }
    }
}

/// A stand-in for systemd in `DIR/fake-bin` (the test machines have no systemd as PID 1):
/// `systemd-run` starts the command after `--` detached, its output appended where the
/// `StandardError=append:` property says, and notes its pid under the unit's name;
/// `systemctl kill` kills that pid; every call is appended to `fake-bin/calls`. Returns the
/// directory and a `PATH` with it first.
fn stand_in_systemd(dir: &Path) -> (PathBuf, String) {
    let fake = dir.join("fake-bin");
    fs::create_dir(&fake).unwrap();
    let script = r#"#!/bin/sh
here="$(dirname "$0")"
echo "$0 $*" >> "$here/calls"
if [ "$(basename "$0")" = systemctl ]; then
  [ "$1" = kill ] && for a; do [ -f "$here/$a.pid" ] && kill -9 "$(cat "$here/$a.pid")"; done
  exit 0
fi
for a; do
  case "$a" in
    --property=StandardError=append:*) log="${a#--property=StandardError=append:}";;
    --unit=*) unit="${a#--unit=}";;
  esac
done
while [ "$1" != "--" ]; do shift; done
shift
setsid "$@" >>"$log" 2>&1 </dev/null &
echo $! > "$here/$unit.pid"
"#;
    for name in ["systemd-run", "systemctl"] {
        fs::write(fake.join(name), script).unwrap();
        fs::set_permissions(fake.join(name), fs::Permissions::from_mode(0o755)).unwrap();
    }
    let path = format!(
        "{}:{}",
        fake.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    (fake, path)
}

/// `--daemons systemd` against a stand-in `systemd-run` (the test machines have no systemd as
/// PID 1) that starts the command after `--` detached, its output appended where the
/// `StandardError=append:` property says: the driver names the unit after the target, asks
/// for its removal once it exits, finds the daemon's pid in /proc (systemd started it), and a
/// restarted driver adopts it and unpublishes it.
#[test]
fn csi_systemd_mode_starts_each_daemon_as_a_transient_unit() {
    let bucket = s3().new_bucket("csi-systemd");
    let dir = tempfile::tempdir().unwrap();
    let _clean = Cleanup(dir.path().to_path_buf());
    let (fake, path) = stand_in_systemd(dir.path());
    let path_env = [("PATH", path.as_str())];
    let mut driver = Driver::launch(dir.path(), "debug", &path_env, &["--daemons=systemd"], None);
    let target = dir.path().join("pods/p/v");
    let vol = format!("{bucket}/v");
    let ctx = [("bucket", bucket.as_str()), ("prefix", "v")];
    let mut c = Csi::connect(&driver);
    c.publish(publish_request(&vol, &target, &ctx, false))
        .expect("NodePublishVolume");
    fs::write(target.join("f.txt"), "via systemd").unwrap();
    assert_eq!(
        s3().get(&bucket, "v/f.txt").as_deref(),
        Some(&b"via systemd"[..])
    );
    let calls = fs::read_to_string(fake.join("calls")).unwrap();
    let run = calls
        .lines()
        .find(|l| l.contains("systemd-run"))
        .expect("systemd-run called");
    for want in ["--unit=bucketfs-csi-", ".service", "--collect", " -- "] {
        assert!(run.contains(want), "{want} not in {run}");
    }
    assert!(
        run.contains(&format!(" mount -f s3://{bucket}/v {}", target.display())),
        "{run}"
    );
    assert!(!run.contains(&env().secret_key));
    let daemon = daemon_of(&target);
    drop(c);

    driver.kill9();
    let driver = Driver::launch(dir.path(), "debug", &path_env, &["--daemons=systemd"], None);
    let mut c = Csi::connect(&driver);
    c.publish(publish_request(&vol, &target, &ctx, false))
        .expect("NodePublishVolume after the restart");
    assert_eq!(daemon_of(&target), daemon, "adopted, not started again");
    c.unpublish(&vol, &target).expect("NodeUnpublishVolume");
    assert!(!fuse_mounted(&target) && !target.exists());
    wait_for("the daemon to exit", Duration::from_secs(10), || {
        !alive(daemon)
    });
}

/// A child process killed on drop.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A daemon dies and the driver mounts the target again: a pod's bind of the whole volume
/// gets the new mount, a read-only one gets it read-only, and a bind of a subdirectory
/// (`subPath`, whose directory the bucket's content chooses) is left dead rather than
/// resolved through what may be a symlink by now.
#[test]
fn csi_a_pods_bind_of_a_dead_daemons_mount_gets_the_new_mount() {
    let bucket = s3().new_bucket("csi-podbind");
    let dir = tempfile::tempdir().unwrap();
    let _clean = Cleanup(dir.path().to_path_buf());
    let driver = Driver::start(dir.path());
    let target = dir.path().join("pods/p/v");
    let vol = format!("{bucket}/v");
    let ctx = [("bucket", bucket.as_str()), ("prefix", "v")];
    let mut c = Csi::connect(&driver);
    c.publish(publish_request(&vol, &target, &ctx, false))
        .expect("NodePublishVolume");
    fs::write(target.join("old.txt"), "old").unwrap();
    fs::create_dir(target.join("sub")).unwrap();
    fs::write(target.join("sub/s.txt"), "s").unwrap();
    let view = dir.path().join("pod-view");
    let ro_view = dir.path().join("pod-ro-view");
    let sub_view = dir.path().join("pod-sub-view");
    for v in [&view, &ro_view, &sub_view] {
        fs::create_dir(v).unwrap();
    }
    let pod = KillOnDrop(
        Command::new("unshare")
            .args(["--mount", "--propagation", "private", "sh", "-c"])
            .arg(
                "mount --bind \"$1\" \"$2\" && mount --bind \"$1\" \"$3\" \
                 && mount -o remount,bind,ro \"$3\" && mount --bind \"$1/sub\" \"$4\" \
                 && exec sleep 120",
            )
            .arg("sh")
            .arg(&target)
            .arg(&view)
            .arg(&ro_view)
            .arg(&sub_view)
            .spawn()
            .unwrap(),
    );
    let pid = pod.0.id().to_string();
    let in_pod = |script: &str| {
        let out = Command::new("nsenter")
            .args(["-t", &pid, "-m", "sh", "-c", script])
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let cat = |p: &Path| format!("cat '{}'", p.display());
    wait_for("the pod's bind mounts", Duration::from_secs(10), || {
        in_pod(&cat(&view.join("old.txt"))) == (true, "old".into())
            && in_pod(&cat(&sub_view.join("s.txt"))) == (true, "s".into())
    });

    let daemon = daemon_of(&target);
    // SAFETY: plain syscall on the test's own daemon.
    unsafe { libc::kill(daemon as i32, libc::SIGKILL) };
    wait_for("a new daemon", Duration::from_secs(20), || {
        fuse_mounted(&target) && fs::read_dir(&target).is_ok()
    });
    fs::write(target.join("new.txt"), "new").unwrap();
    let sees_new = || {
        in_pod(&cat(&view.join("new.txt"))) == (true, "new".into())
            && in_pod(&cat(&ro_view.join("new.txt"))) == (true, "new".into())
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !sees_new() {
        if std::time::Instant::now() > deadline {
            // Failed once in four full runs under load: say what the driver did.
            let log = fs::read_to_string(&driver.log).unwrap_or_default();
            let said: Vec<&str> = log
                .lines()
                .filter(|l| {
                    ["dead", "replac", "gone", "WARN", "ERROR"]
                        .iter()
                        .any(|w| l.contains(w))
                })
                .collect();
            panic!(
                "timed out waiting for the pod to see the new mount; pod: {:?}; driver said:\n{}",
                in_pod(&format!(
                    "ls -la '{}'; cat /proc/self/mountinfo",
                    view.display()
                )),
                said.join("\n")
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(in_pod(&cat(&view.join("old.txt"))), (true, "old".into()));
    // The read-only bind stays read-only.
    let w = format!("echo x > '{}'", ro_view.join("w.txt").display());
    assert!(!in_pod(&w).0, "a write through the read-only bind worked");
    assert!(!target.join("w.txt").exists());
    // The subPath bind is left dead.
    assert!(
        !in_pod(&cat(&sub_view.join("s.txt"))).0,
        "the subPath bind was replaced"
    );
    drop(pod);
    c.unpublish(&vol, &target).expect("NodeUnpublishVolume");
    assert!(!fuse_mounted(&target));
}

/// Without hostPID the driver is PID 1 of its container's PID namespace: `--daemons=auto`
/// says the daemons will die with it and runs them as children (publishes work); when the
/// namespace dies, so does the mount, and the next driver mounts the target again.
#[test]
fn csi_auto_mode_as_pid_1_of_a_pid_namespace_warns_and_the_next_driver_remounts() {
    let bucket = s3().new_bucket("csi-pidns");
    let dir = tempfile::tempdir().unwrap();
    let _clean = Cleanup(dir.path().to_path_buf());
    let socket = dir.path().join("csi.sock");
    let log = dir.path().join("driver.log");
    // A container without hostPID: PID 1 of a PID namespace, its own /proc, the test
    // directory shared with the host (Bidirectional).
    let _shared = SharedDir::new(dir.path());
    let ns = KillOnDrop(
        Command::new("unshare")
            .args(["--pid", "--fork", "--kill-child", "--mount-proc"])
            .args(["--mount", "--propagation", "unchanged", "--"])
            .arg(bin())
            .args(["csi", "--node-id", "node-1", "--daemons=auto"])
            .arg(format!("--endpoint=unix://{}", socket.display()))
            .arg(format!(
                "--state-dir={}",
                dir.path().join("state").display()
            ))
            .arg(format!("--host-pid={}", std::process::id()))
            .stdin(Stdio::null())
            .stderr(fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    wait_for("the driver's socket", Duration::from_secs(20), || {
        socket.exists()
    });
    let text = fs::read_to_string(&log).unwrap();
    assert!(
        text.contains("die with it") && text.contains("PID 1"),
        "{text}"
    );
    let target = dir.path().join("t");
    let vol = format!("{bucket}/v");
    let ctx = [("bucket", bucket.as_str()), ("prefix", "v")];
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let ch = rt.block_on(bucketfs_csi::connect(&socket)).unwrap();
    rt.block_on(
        NodeClient::new(ch).node_publish_volume(publish_request(&vol, &target, &ctx, false)),
    )
    .expect("NodePublishVolume");
    fs::write(target.join("f.txt"), "x").unwrap();
    let daemon = daemon_of(&target);
    drop(ns);
    wait_for(
        "the daemon to die with the namespace",
        Duration::from_secs(10),
        || !alive(daemon),
    );
    let driver = Driver::start(dir.path());
    wait_for("the target mounted again", Duration::from_secs(20), || {
        fuse_mounted(&target) && fs::read_dir(&target).is_ok()
    });
    assert_eq!(fs::read_to_string(target.join("f.txt")).unwrap(), "x");
    Csi::connect(&driver)
        .unpublish(&vol, &target)
        .expect("NodeUnpublishVolume");
}

/// Another file system mounted over a target whose daemon died (an admin's tmpfs, a bind)
/// is not the driver's: its recovery and a publish again detached it and mounted the bucket
/// in its place (unpublish already refused to touch it).
#[test]
fn csi_leaves_a_mount_it_did_not_make_over_a_dead_target() {
    let bucket = s3().new_bucket("csi-covered");
    let dir = tempfile::tempdir().unwrap();
    let _clean = Cleanup(dir.path().to_path_buf());
    let mut driver = Driver::start(dir.path());
    let t = dir.path().join("t");
    let v = format!("{bucket}/a");
    let ctx = [("bucket", bucket.as_str()), ("prefix", "a")];
    let mut c = Csi::connect(&driver);
    c.publish(publish_request(&v, &t, &ctx, false))
        .expect("NodePublishVolume");
    drop(c);
    let d = daemon_of(&t);
    driver.kill9();
    // SAFETY: plain syscall on the test's own daemon.
    unsafe { libc::kill(d as i32, libc::SIGKILL) };
    wait_for("the daemon to die", Duration::from_secs(10), || !alive(d));
    let st = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1m", "csi-test-cover"])
        .arg(&t)
        .status()
        .unwrap();
    assert!(st.success());
    fs::write(t.join("cover"), "the admin's").unwrap();
    let driver = Driver::start(dir.path());
    // Past the startup recovery and a heal round.
    std::thread::sleep(Duration::from_secs(7));
    let after_recovery = fs::read_to_string(t.join("cover")).ok();
    let mut c = Csi::connect(&driver);
    let again = c.publish(publish_request(&v, &t, &ctx, false));
    let after_publish = fs::read_to_string(t.join("cover")).ok();
    let _ = Command::new("umount").arg(&t).status();
    assert_eq!(after_recovery.as_deref(), Some("the admin's"), "recovery");
    assert_eq!(
        again.as_ref().map_err(|e| e.code()),
        Err(tonic::Code::AlreadyExists),
        "{again:?}"
    );
    assert_eq!(after_publish.as_deref(), Some("the admin's"), "publish");
    // Uncovered, the dead mount is the driver's again: mounted anew, then unpublished.
    wait_for("t to be mounted again", Duration::from_secs(20), || {
        fuse_mounted(&t) && fs::read_dir(&t).is_ok()
    });
    c.unpublish(&v, &t).expect("NodeUnpublishVolume");
    assert!(!fuse_mounted(&t));
}

/// User and system CPU time of process `pid` so far.
fn cpu_time(pid: u32) -> Duration {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // After the command name, which may hold spaces: state is field 3, utime 14, stime 15.
    let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split(' ').collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    // SAFETY: plain sysconf query.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
    Duration::from_millis(ticks * 1000 / hz)
}

/// Idle clients holding more connections than the driver may open descriptors: its accepts
/// fail with `EMFILE`. It pauses between tries instead of spinning a core (before: tonic's
/// loop tried again at once, a whole core for as long as they stayed), and answers again
/// once they are gone.
#[test]
fn csi_socket_flooded_past_the_open_files_limit_backs_off_and_recovers() {
    let dir = tempfile::tempdir().unwrap();
    let _cleanup = Cleanup(dir.path().to_path_buf());
    let driver = Driver::start(dir.path());
    let mut c = Csi::connect(&driver);
    c.rt.block_on(c.identity.probe(ProbeRequest {})).unwrap();
    let pid = driver.child.id();
    let low = libc::rlimit {
        rlim_cur: 64,
        rlim_max: 64,
    };
    // SAFETY: prlimit(2) on our own child, with a valid new limit and no old one asked.
    let r = unsafe {
        libc::prlimit(
            pid as libc::pid_t,
            libc::RLIMIT_NOFILE,
            &low,
            std::ptr::null_mut(),
        )
    };
    assert_eq!(r, 0, "prlimit: {}", std::io::Error::last_os_error());
    let flood: Vec<std::os::unix::net::UnixStream> = (0..200)
        .map(|_| std::os::unix::net::UnixStream::connect(&driver.socket).unwrap())
        .collect();
    // Past the limit: what is left waits in the socket's backlog.
    std::thread::sleep(Duration::from_millis(500));
    let before = cpu_time(pid);
    std::thread::sleep(Duration::from_secs(2));
    let spent = cpu_time(pid) - before;
    assert!(
        spent < Duration::from_millis(400),
        "the driver spent {spent:?} of CPU in 2 s with its accepts failing"
    );
    drop(flood);
    let mut c = Csi::connect(&driver);
    let probe = c.rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(10), c.identity.probe(ProbeRequest {})).await
    });
    assert!(
        matches!(probe, Ok(Ok(_))),
        "no answer once the clients left: {probe:?}"
    );
    let log = fs::read_to_string(&driver.log).unwrap();
    assert!(log.contains("cannot accept a connection"), "{log}");
}

/// A publish the kubelet gave up on (its deadline passed while the daemon checked a slow
/// store) leaves that daemon starting: the kubelet's next publish waits for it instead of
/// starting a second one over it (before: two daemons, both mounted there, one of them in no
/// record).
#[test]
fn csi_a_publish_retried_while_its_daemon_starts_starts_no_second_daemon() {
    let bucket = s3().new_bucket("csi-retry");
    let proxy = proxy::FaultProxy::start(&minio_addr());
    let dir = tempfile::tempdir().unwrap();
    let _clean = Cleanup(dir.path().to_path_buf());
    let driver = Driver::start(dir.path());
    let target = dir.path().join("target-x");
    let vol = format!("{bucket}/v");
    let ctx = [("bucket", bucket.as_str()), ("prefix", "v")];
    let mut c = Csi::connect(&driver);
    let mut p = publish_request(&vol, &target, &ctx, false);
    p.secrets.insert("endpoint".into(), proxy.endpoint());
    // Each answer takes 4 s: longer than the first publish's deadline.
    proxy.set_delay(Duration::from_secs(4));
    let mut first = tonic::Request::new(p.clone());
    first.set_timeout(Duration::from_secs(2));
    let e =
        c.rt.block_on(c.node.node_publish_volume(first))
            .unwrap_err();
    assert!(
        matches!(
            e.code(),
            tonic::Code::DeadlineExceeded | tonic::Code::Cancelled
        ),
        "{e}"
    );
    let needle = target.to_string_lossy().to_string();
    let daemons = || processes_mentioning(&needle);
    assert_eq!(daemons().len(), 1, "the first publish's daemon, starting");
    // The store is quick again (the first daemon's requests still come slowly) and the
    // kubelet publishes again.
    proxy.set_delay(Duration::ZERO);
    c.publish(p).expect("the publish tried again");
    assert!(fuse_mounted(&target));
    assert_eq!(
        daemons().len(),
        1,
        "daemons for one target: {:?}",
        daemons()
    );
    fs::write(target.join("a.txt"), "a").unwrap();
    assert_eq!(s3().get(&bucket, "v/a.txt").as_deref(), Some(&b"a"[..]));
    c.unpublish(&vol, &target).expect("NodeUnpublishVolume");
    assert!(!fuse_mounted(&target));
    wait_for("the daemon to exit", Duration::from_secs(10), || {
        daemons().is_empty()
    });
}
