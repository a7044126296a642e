//! Shared harness of the integration tests: real FUSE mounts of the built `bucketfs` binary
//! against the MinIO server that `scripts/test.sh` starts.
//!
//! * [`env`]: the `BUCKETFS_TEST_*` variables (the tests fail with a clear message without them).
//! * [`s3`]: a blocking S3 client for looking at the bucket directly.
//! * [`Mount`]: a guard around one `bucketfs mount -f` daemon; it unmounts, reaps the daemon
//!   and removes its temp dir on drop, even when the test panics, and a watchdog force-unmounts
//!   it when a test hangs in a file operation.
//! * [`pattern`]: reproducible pseudo-random file contents, written and checked in 1 MiB blocks.
//! * [`Minio`]: stopping and restarting the shared server (the fault test only).
#![allow(dead_code)]

pub mod proxy;

use aws_sdk_s3::config::{
    BehaviorVersion, Credentials, Region, RequestChecksumCalculation, ResponseChecksumValidation,
};
use aws_sdk_s3::primitives::ByteStream;
use aws_sdk_s3::Client;
use std::collections::{BTreeSet, HashMap};
use std::ffi::OsString;
use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::io::IntoRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

pub const MIB: usize = 1024 * 1024;

/// Path of the `bucketfs` binary cargo built for these tests.
pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_bucketfs")
}

// ---------------------------------------------------------------------------------------------
// Environment
// ---------------------------------------------------------------------------------------------

#[derive(Debug)]
pub struct TestEnv {
    pub endpoint: String,
    pub access_key: String,
    pub secret_key: String,
}

fn required(name: &str) -> String {
    match std::env::var(name) {
        Ok(v) if !v.is_empty() => v,
        _ => panic!(
            "{name} is not set. The integration tests of bucketfs need the MinIO server and the \
             BUCKETFS_TEST_* variables that scripts/test.sh provides: run `scripts/test.sh` \
             (it installs MinIO and fuse3 when missing, starts the server and runs all tests)."
        ),
    }
}

/// The MinIO endpoint and credentials exported by `scripts/test.sh`.
pub fn env() -> &'static TestEnv {
    static ENV: OnceLock<TestEnv> = OnceLock::new();
    ENV.get_or_init(|| TestEnv {
        endpoint: required("BUCKETFS_TEST_ENDPOINT"),
        access_key: required("BUCKETFS_TEST_ACCESS_KEY"),
        secret_key: required("BUCKETFS_TEST_SECRET_KEY"),
    })
}

/// A bucket name no other test (or earlier run against the same server) uses.
pub fn unique_bucket_name(tag: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let tag: String = tag
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .take(30)
        .collect();
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!(
        "bfs-{}-{}-{}-{:x}",
        tag.trim_matches('-'),
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed),
        nanos & 0xffff
    )
}

// ---------------------------------------------------------------------------------------------
// Direct S3 access
// ---------------------------------------------------------------------------------------------

/// Blocking wrapper around an `aws-sdk-s3` client configured for the test MinIO.
pub struct S3 {
    rt: tokio::runtime::Runtime,
    pub client: Client,
}

/// What HEAD says about an object.
#[derive(Debug, Clone)]
pub struct Head {
    pub size: u64,
    /// User metadata, keys without the `x-amz-meta-` prefix.
    pub meta: HashMap<String, String>,
}

pub fn s3() -> &'static S3 {
    static S3C: OnceLock<S3> = OnceLock::new();
    S3C.get_or_init(|| {
        let e = env();
        let conf = aws_sdk_s3::config::Builder::new()
            .behavior_version(BehaviorVersion::latest())
            .endpoint_url(&e.endpoint)
            .region(Region::new("us-east-1"))
            .credentials_provider(Credentials::new(
                &e.access_key,
                &e.secret_key,
                None,
                None,
                "bucketfs-tests",
            ))
            .force_path_style(true)
            .request_checksum_calculation(RequestChecksumCalculation::WhenRequired)
            .response_checksum_validation(ResponseChecksumValidation::WhenRequired)
            .build();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("tokio runtime");
        S3 {
            rt,
            client: Client::from_conf(conf),
        }
    })
}

impl S3 {
    pub fn block_on<F: std::future::Future>(&self, f: F) -> F::Output {
        self.rt.block_on(f)
    }

    pub fn create_bucket(&self, bucket: &str) {
        self.block_on(self.client.create_bucket().bucket(bucket).send())
            .unwrap_or_else(|e| panic!("CreateBucket {bucket}: {}", err_text(&e)));
    }

    /// A fresh, empty bucket for one test.
    pub fn new_bucket(&self, tag: &str) -> String {
        let b = unique_bucket_name(tag);
        self.create_bucket(&b);
        b
    }

    pub fn put(&self, bucket: &str, key: &str, body: impl Into<Vec<u8>>) {
        self.put_with_meta(bucket, key, body, &[]);
    }

    pub fn put_with_meta(
        &self,
        bucket: &str,
        key: &str,
        body: impl Into<Vec<u8>>,
        meta: &[(&str, &str)],
    ) {
        let mut req = self
            .client
            .put_object()
            .bucket(bucket)
            .key(key)
            .body(ByteStream::from(body.into()));
        for (k, v) in meta {
            req = req.metadata(*k, *v);
        }
        self.block_on(req.send())
            .unwrap_or_else(|e| panic!("PutObject {bucket}/{key}: {}", err_text(&e)));
    }

    /// PUTs many small objects with at most `concurrency` requests in flight.
    pub fn put_many(&self, bucket: &str, objects: Vec<(String, Vec<u8>)>, concurrency: usize) {
        use futures::stream::{self, StreamExt, TryStreamExt};
        let client = &self.client;
        self.block_on(
            stream::iter(objects.into_iter().map(|(key, body)| async move {
                client
                    .put_object()
                    .bucket(bucket)
                    .key(&key)
                    .body(ByteStream::from(body))
                    .send()
                    .await
                    .map_err(|e| format!("PutObject {bucket}/{key}: {}", err_text(&e)))
            }))
            .buffer_unordered(concurrency)
            .try_collect::<Vec<_>>(),
        )
        .unwrap_or_else(|e| panic!("{e}"));
    }

    /// The object's bytes, or `None` when the key does not exist.
    pub fn get(&self, bucket: &str, key: &str) -> Option<Vec<u8>> {
        let res = self.block_on(async {
            let out = self
                .client
                .get_object()
                .bucket(bucket)
                .key(key)
                .send()
                .await?;
            Ok::<_, aws_sdk_s3::Error>(Some(out.body.collect().await.unwrap().into_bytes()))
        });
        match res {
            Ok(b) => b.map(|b| b.to_vec()),
            Err(aws_sdk_s3::Error::NoSuchKey(_)) => None,
            Err(e) => panic!("GetObject {bucket}/{key}: {e:?}"),
        }
    }

    /// HEAD of a key, or `None` when it does not exist.
    pub fn head(&self, bucket: &str, key: &str) -> Option<Head> {
        match self.block_on(self.client.head_object().bucket(bucket).key(key).send()) {
            Ok(out) => Some(Head {
                size: out.content_length().unwrap_or(-1) as u64,
                meta: out.metadata().cloned().unwrap_or_default(),
            }),
            Err(e) if e.as_service_error().is_some_and(|s| s.is_not_found()) => None,
            Err(e) => panic!("HeadObject {bucket}/{key}: {}", err_text(&e)),
        }
    }

    /// Every key under `prefix` (all pages, no delimiter).
    pub fn list_keys(&self, bucket: &str, prefix: &str) -> BTreeSet<String> {
        let mut keys = BTreeSet::new();
        let mut token: Option<String> = None;
        loop {
            let out = self
                .block_on(
                    self.client
                        .list_objects_v2()
                        .bucket(bucket)
                        .prefix(prefix)
                        .set_continuation_token(token.take())
                        .send(),
                )
                .unwrap_or_else(|e| panic!("ListObjectsV2 {bucket}/{prefix}: {}", err_text(&e)));
            for o in out.contents() {
                keys.insert(o.key().unwrap_or_default().to_string());
            }
            match out.next_continuation_token() {
                Some(t) if out.is_truncated() == Some(true) => token = Some(t.to_string()),
                _ => break,
            }
        }
        keys
    }

    /// Deletes every object and open upload in `bucket`, then the bucket: tests that store
    /// gigabytes call it when they pass, so the suite's peak disk use stays that of one test.
    pub fn remove_bucket(&self, bucket: &str) {
        let c = &self.client;
        for key in self.list_keys(bucket, "") {
            self.block_on(c.delete_object().bucket(bucket).key(&key).send())
                .unwrap_or_else(|e| panic!("DeleteObject {bucket}/{key}: {}", err_text(&e)));
        }
        for (key, id) in self.list_multipart_uploads(bucket) {
            let abort = c
                .abort_multipart_upload()
                .bucket(bucket)
                .key(&key)
                .upload_id(id);
            self.block_on(abort.send()).unwrap_or_else(|e| {
                panic!("AbortMultipartUpload {bucket}/{key}: {}", err_text(&e))
            });
        }
        self.block_on(c.delete_bucket().bucket(bucket).send())
            .unwrap_or_else(|e| panic!("DeleteBucket {bucket}: {}", err_text(&e)));
    }

    /// `(key, upload id)` of every multipart upload in progress in the bucket.
    pub fn list_multipart_uploads(&self, bucket: &str) -> Vec<(String, String)> {
        let out = self
            .block_on(self.client.list_multipart_uploads().bucket(bucket).send())
            .unwrap_or_else(|e| panic!("ListMultipartUploads {bucket}: {}", err_text(&e)));
        out.uploads()
            .iter()
            .map(|u| {
                (
                    u.key().unwrap_or_default().to_string(),
                    u.upload_id().unwrap_or_default().to_string(),
                )
            })
            .collect()
    }
}

/// The full error chain of an SDK error (its `Display` alone says little).
pub fn err_text<E: std::error::Error>(e: &E) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}

// ---------------------------------------------------------------------------------------------
// File contents
// ---------------------------------------------------------------------------------------------

/// Reproducible pseudo-random contents: block `i` (1 MiB) of the file with `seed` is generated
/// from `(seed, i)`, so any range can be re-created without keeping the file in memory.
pub mod pattern {
    use super::MIB;
    use rand::{RngCore, SeedableRng};
    use std::io::{Read, Write};

    pub fn block(seed: u64, index: u64) -> Vec<u8> {
        let mut rng =
            rand::rngs::StdRng::seed_from_u64(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ index);
        let mut b = vec![0u8; MIB];
        rng.fill_bytes(&mut b);
        b
    }

    /// The whole content (for small files).
    pub fn bytes(seed: u64, len: usize) -> Vec<u8> {
        let mut v = Vec::with_capacity(len);
        let mut i = 0;
        while v.len() < len {
            let b = block(seed, i);
            let n = (len - v.len()).min(MIB);
            v.extend_from_slice(&b[..n]);
            i += 1;
        }
        v
    }

    /// Writes `len` bytes in 1 MiB `write_all` calls.
    pub fn write(w: &mut impl Write, seed: u64, len: u64) -> std::io::Result<()> {
        let mut done = 0u64;
        let mut i = 0;
        while done < len {
            let b = block(seed, i);
            let n = (len - done).min(MIB as u64) as usize;
            w.write_all(&b[..n])?;
            done += n as u64;
            i += 1;
        }
        Ok(())
    }

    /// Checks that a slice holds exactly the content.
    pub fn check_slice(data: &[u8], seed: u64, len: u64) -> Result<(), String> {
        if data.len() as u64 != len {
            return Err(format!("length is {} bytes, expected {len}", data.len()));
        }
        for (i, chunk) in data.chunks(MIB).enumerate() {
            let b = block(seed, i as u64);
            if chunk != &b[..chunk.len()] {
                let at = chunk.iter().zip(&b).position(|(x, y)| x != y).unwrap_or(0);
                return Err(format!("content differs at byte {}", i * MIB + at));
            }
        }
        Ok(())
    }

    /// Reads the reader to its end and checks it returns exactly the content.
    pub fn check_reader(r: &mut impl Read, seed: u64, len: u64) -> Result<(), String> {
        let mut buf = vec![0u8; MIB];
        let mut off = 0u64;
        let mut i = 0;
        loop {
            // Fill a whole block (reads may be short).
            let mut got = 0;
            while got < MIB {
                match r.read(&mut buf[got..]) {
                    Ok(0) => break,
                    Ok(n) => got += n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(format!("read at byte {}: {e}", off + got as u64)),
                }
            }
            if got == 0 {
                break;
            }
            if off + got as u64 > len {
                return Err(format!("more than the expected {len} bytes"));
            }
            let b = block(seed, i);
            if buf[..got] != b[..got] {
                let at = buf[..got]
                    .iter()
                    .zip(&b)
                    .position(|(x, y)| x != y)
                    .unwrap_or(0);
                return Err(format!("content differs at byte {}", off + at as u64));
            }
            off += got as u64;
            i += 1;
            if got < MIB {
                break;
            }
        }
        if off != len {
            return Err(format!("ended after {off} bytes, expected {len}"));
        }
        Ok(())
    }
}

/// close(2) of a file, returning its error (dropping a `File` ignores it, and close is where
/// bucketfs reports a failed upload).
pub fn close_checked(f: File) -> std::io::Result<()> {
    let fd = f.into_raw_fd();
    // SAFETY: we own the descriptor (into_raw_fd) and close it exactly once.
    if unsafe { libc::close(fd) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Writes a whole file through the mount and checks write and close.
pub fn write_file(path: &Path, data: &[u8]) {
    let mut f = File::create(path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
    f.write_all(data)
        .unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    close_checked(f).unwrap_or_else(|e| panic!("close {}: {e}", path.display()));
}

pub fn read_file(path: &Path) -> Vec<u8> {
    let mut v = Vec::new();
    File::open(path)
        .and_then(|mut f| f.read_to_end(&mut v))
        .unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    v
}

/// Names in a directory (panics on a duplicate name: a listing must not repeat entries).
pub fn list_dir(path: &Path) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for e in std::fs::read_dir(path).unwrap_or_else(|e| panic!("readdir {}: {e}", path.display())) {
        let e = e.unwrap_or_else(|e| panic!("readdir {}: {e}", path.display()));
        let n = e.file_name().into_string().expect("UTF-8 name");
        assert!(
            names.insert(n.clone()),
            "readdir {} returned {n:?} twice",
            path.display()
        );
    }
    names
}

pub fn set<const N: usize>(names: [&str; N]) -> BTreeSet<String> {
    names.iter().map(|s| s.to_string()).collect()
}

/// The errno of an I/O result that must have failed.
pub fn errno<T: std::fmt::Debug>(r: std::io::Result<T>) -> i32 {
    match r {
        Ok(v) => panic!("expected an error, got Ok({v:?})"),
        Err(e) => e
            .raw_os_error()
            .unwrap_or_else(|| panic!("error without errno: {e}")),
    }
}

/// Runs a command and returns its stdout (panics on failure).
pub fn run(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{cmd}: {e}"));
    assert!(
        out.status.success(),
        "{cmd} {args:?} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

// ---------------------------------------------------------------------------------------------
// Mounts
// ---------------------------------------------------------------------------------------------

/// Whether `path` is a mount point right now (per /proc/self/mountinfo).
pub fn is_mounted(path: &Path) -> bool {
    let want = path.to_string_lossy().into_owned();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .any(|mp| unescape_mountinfo(mp) == want)
}

fn unescape_mountinfo(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() {
            if let Ok(v) =
                u8::from_str_radix(std::str::from_utf8(&b[i + 1..i + 4]).unwrap_or("x"), 8)
            {
                out.push(v);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Pids of processes whose command line mentions `needle` (to prove a failed mount left no
/// daemon behind).
pub fn processes_mentioning(needle: &str) -> Vec<u32> {
    let me = std::process::id();
    let mut pids = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if pid == me {
            continue;
        }
        if let Ok(cmd) = std::fs::read(e.path().join("cmdline")) {
            if String::from_utf8_lossy(&cmd).contains(needle) {
                pids.push(pid);
            }
        }
    }
    pids
}

fn fusermount(args: &[&str], path: &Path) -> bool {
    Command::new("fusermount3")
        .args(args)
        .arg(path)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

/// Unmounts `path` (normal, then lazy). Returns whether it is unmounted now.
pub fn force_unmount(path: &Path) -> bool {
    if !is_mounted(path) {
        return true;
    }
    for _ in 0..3 {
        if fusermount(&["-u"], path) || !is_mounted(path) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(300));
    }
    fusermount(&["-uz"], path);
    !is_mounted(path)
}

/// How a [`Mount`] is started.
#[derive(Debug, Clone)]
pub struct MountSpec {
    /// `s3://bucket[/prefix]` or a local directory.
    pub source: String,
    /// Extra arguments after the mount point.
    pub args: Vec<String>,
    /// Extra environment for the daemon.
    pub envs: Vec<(String, String)>,
    /// After this long the watchdog force-unmounts and kills the daemon, so a hung file
    /// operation fails the test instead of hanging the suite.
    pub watchdog: Duration,
}

impl MountSpec {
    /// A mount of `s3://bucket[/prefix]` on the test MinIO with the test credentials.
    pub fn s3(bucket: &str, prefix: &str) -> Self {
        let e = env();
        let prefix = prefix.trim_matches('/');
        let source = if prefix.is_empty() {
            format!("s3://{bucket}")
        } else {
            format!("s3://{bucket}/{prefix}")
        };
        MountSpec {
            source,
            args: s3_args(),
            envs: vec![
                ("AWS_ACCESS_KEY_ID".into(), e.access_key.clone()),
                ("AWS_SECRET_ACCESS_KEY".into(), e.secret_key.clone()),
            ],
            watchdog: Duration::from_secs(600),
        }
    }

    /// A mount of a local directory (the embedded store).
    pub fn local(dir: &Path) -> Self {
        MountSpec {
            source: dir.to_string_lossy().into_owned(),
            args: vec![],
            envs: vec![],
            watchdog: Duration::from_secs(300),
        }
    }

    pub fn arg(mut self, a: &str) -> Self {
        self.args.push(a.to_string());
        self
    }

    pub fn watchdog(mut self, d: Duration) -> Self {
        self.watchdog = d;
        self
    }

    pub fn mount(&self) -> Mount {
        Mount::start(self.clone()).unwrap_or_else(|e| panic!("{e}"))
    }
}

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

/// `--endpoint-url ... --force-path-style --region us-east-1` for the test MinIO.
pub fn s3_args() -> Vec<String> {
    vec![
        "--endpoint-url".into(),
        env().endpoint.clone(),
        "--force-path-style".into(),
        "--region".into(),
        "us-east-1".into(),
    ]
}

/// Environment every bucketfs process of the tests gets: no AWS settings of the machine leak
/// in, and no IMDS lookups.
pub fn isolate_env(cmd: &mut Command, home: &Path) {
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy().into_owned();
        if k.starts_with("AWS_") || (k.starts_with("BUCKETFS_") && !k.starts_with("BUCKETFS_TEST"))
        {
            cmd.env_remove(&k);
        }
    }
    // Empty AWS config files: nothing from the machine, and no SDK warning about missing ones.
    for f in ["aws-config", "aws-credentials"] {
        let p = home.join(f);
        if !p.exists() {
            let _ = File::create(&p);
        }
    }
    cmd.env("HOME", home)
        .env("XDG_CONFIG_HOME", home.join(".config"))
        .env("AWS_CONFIG_FILE", home.join("aws-config"))
        .env("AWS_SHARED_CREDENTIALS_FILE", home.join("aws-credentials"))
        .env("AWS_EC2_METADATA_DISABLED", "true");
    if std::env::var_os("RUST_LOG").is_none() {
        cmd.env("RUST_LOG", "info");
    }
}

struct Watch {
    done: Mutex<bool>,
    cv: Condvar,
    fired: AtomicBool,
}

/// One running `bucketfs mount -f` daemon. Dropping it unmounts, reaps the daemon and removes
/// the mount point, whatever state the test is in.
pub struct Mount {
    spec: MountSpec,
    dir: Option<tempfile::TempDir>,
    path: PathBuf,
    log: PathBuf,
    child: Option<Child>,
    watch: Arc<Watch>,
    exit: Option<ExitStatus>,
}

impl Mount {
    pub fn s3(bucket: &str) -> Mount {
        MountSpec::s3(bucket, "").mount()
    }

    pub fn s3_prefix(bucket: &str, prefix: &str) -> Mount {
        MountSpec::s3(bucket, prefix).mount()
    }

    pub fn start(spec: MountSpec) -> Result<Mount, String> {
        let dir = tempfile::Builder::new()
            .prefix("bucketfs-mnt-")
            .tempdir()
            .map_err(|e| format!("temp dir: {e}"))?;
        let path = dir.path().join("mnt");
        std::fs::create_dir(&path).map_err(|e| format!("mkdir {}: {e}", path.display()))?;
        let path = path.canonicalize().unwrap();
        let home = dir.path().join("home");
        std::fs::create_dir(&home).unwrap();
        let log = dir.path().join("daemon.log");
        let logf = File::create(&log).unwrap();

        let mut cmd = Command::new(bin());
        cmd.arg("mount")
            .arg("-f")
            .arg(&spec.source)
            .arg(&path)
            .args(&spec.args)
            .stdin(Stdio::null())
            .stdout(logf.try_clone().unwrap())
            .stderr(logf);
        isolate_env(&mut cmd, &home);
        for (k, v) in &spec.envs {
            cmd.env(k, v);
        }
        let child = cmd.spawn().map_err(|e| format!("spawn {}: {e}", bin()))?;
        let mut m = Mount {
            spec,
            dir: Some(dir),
            path,
            log,
            child: Some(child),
            watch: Arc::new(Watch {
                done: Mutex::new(false),
                cv: Condvar::new(),
                fired: AtomicBool::new(false),
            }),
            exit: None,
        };

        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if is_mounted(&m.path) {
                break;
            }
            if let Some(st) = m.child.as_mut().unwrap().try_wait().unwrap() {
                m.child = None;
                m.exit = Some(st);
                return Err(format!(
                    "bucketfs mount -f {} exited ({st}) before mounting; its output:\n{}",
                    m.spec.source,
                    m.log()
                ));
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "bucketfs mount -f {} did not mount {} within 30 s; its output:\n{}",
                    m.spec.source,
                    m.path.display(),
                    m.log()
                ));
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        m.start_watchdog();
        Ok(m)
    }

    fn start_watchdog(&self) {
        let watch = self.watch.clone();
        let path = self.path.clone();
        let pid = self.child.as_ref().unwrap().id() as libc::pid_t;
        let limit = self.spec.watchdog;
        std::thread::spawn(move || {
            let deadline = Instant::now() + limit;
            let mut done = watch.done.lock().unwrap();
            while !*done {
                let now = Instant::now();
                if now >= deadline {
                    eprintln!(
                        "watchdog: mount {} still in use after {} s: force-unmounting and \
                         killing its daemon (pid {pid})",
                        path.display(),
                        limit.as_secs()
                    );
                    watch.fired.store(true, Ordering::SeqCst);
                    fusermount(&["-uz"], &path);
                    // SAFETY: plain kill(2) of the daemon this harness spawned; `done` is false
                    // under the lock, so it has not been reaped and the pid is still ours.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                    return;
                }
                done = watch.cv.wait_timeout(done, deadline - now).unwrap().0;
            }
        });
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `mount point / rel`.
    pub fn join(&self, rel: impl AsRef<Path>) -> PathBuf {
        self.path.join(rel)
    }

    /// Everything the daemon printed so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Whether the watchdog had to force-unmount this mount (the test hung).
    pub fn watchdog_fired(&self) -> bool {
        self.watch.fired.load(Ordering::SeqCst)
    }

    /// Whether the daemon is still running (and mounted).
    pub fn daemon_alive(&mut self) -> bool {
        match self.child.as_mut() {
            Some(c) => c.try_wait().ok().flatten().is_none() && is_mounted(&self.path),
            None => false,
        }
    }

    pub fn spec(&self) -> &MountSpec {
        &self.spec
    }

    /// The daemon's pid (while it runs).
    pub fn daemon_pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// Sends `sig` to the daemon.
    pub fn signal(&self, sig: i32) {
        let pid = self.daemon_pid().expect("daemon running") as libc::pid_t;
        // SAFETY: kill(2) of the daemon this harness spawned and has not reaped.
        unsafe { libc::kill(pid, sig) };
    }

    /// Waits up to `limit` for the daemon to exit on its own (after a signal); returns its
    /// status. The mount point is left as it is.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            let child = self.child.as_mut()?;
            if let Ok(Some(st)) = child.try_wait() {
                *self.watch.done.lock().unwrap() = true;
                self.watch.cv.notify_all();
                self.child = None;
                self.exit = Some(st);
                return Some(st);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILLs the daemon (a crash) and reaps it. The mount point stays behind as a dead FUSE
    /// mount ("Transport endpoint is not connected") until the guard is dropped.
    pub fn kill9(&mut self) {
        *self.watch.done.lock().unwrap() = true;
        self.watch.cv.notify_all();
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            self.exit = c.wait().ok();
        }
    }

    /// Resident memory of the daemon in KiB (VmRSS), and its peak (VmHWM).
    pub fn rss_kib(&self) -> (u64, u64) {
        let pid = self.daemon_pid().expect("daemon running");
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let field = |name: &str| {
            status
                .lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        (field("VmRSS:"), field("VmHWM:"))
    }

    /// Open descriptors of the daemon that are not sockets (files, pipes, /dev/fuse), and
    /// its sockets (HTTP connections kept alive in the pool come and go).
    pub fn fd_kinds(&self) -> (usize, usize) {
        let pid = self.daemon_pid().expect("daemon running");
        let mut files = 0;
        let mut sockets = 0;
        for e in std::fs::read_dir(format!("/proc/{pid}/fd"))
            .into_iter()
            .flatten()
            .flatten()
        {
            match std::fs::read_link(e.path()) {
                Ok(t) if t.to_string_lossy().starts_with("socket:") => sockets += 1,
                Ok(_) => files += 1,
                Err(_) => {}
            }
        }
        (files, sockets)
    }

    /// Open file descriptors of the daemon.
    pub fn fd_count(&self) -> usize {
        let pid = self.daemon_pid().expect("daemon running");
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .map(|d| d.count())
            .unwrap_or(0)
    }

    /// Unmounts and waits for the daemon; returns its exit status and output.
    pub fn unmount(mut self) -> (Option<ExitStatus>, String) {
        self.stop();
        (self.exit, self.log())
    }

    /// Unmounts and mounts the same source again (fresh daemon, cold caches).
    pub fn remount(self) -> Mount {
        let spec = self.spec.clone();
        let (st, log) = self.unmount();
        if st.is_some_and(|s| !s.success()) {
            eprintln!("note: daemon exited with {st:?} at remount; its output:\n{log}");
        }
        spec.mount()
    }

    fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            // The daemon is gone already (kill9, wait_exit): clear a dead mount it left.
            if !force_unmount(&self.path) {
                eprintln!("could not unmount {}", self.path.display());
            }
            return;
        };
        // From here on the watchdog must not act (it would kill a pid that we reap below).
        *self.watch.done.lock().unwrap() = true;
        self.watch.cv.notify_all();
        let unmounted = force_unmount(&self.path);
        // The daemon publishes what is still being written before it exits: give it time.
        let deadline = Instant::now() + Duration::from_secs(120);
        let status = loop {
            match child.try_wait() {
                Ok(Some(st)) => break Some(st),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                _ => {
                    eprintln!(
                        "daemon of {} did not exit within 120 s of the unmount: killing it",
                        self.path.display()
                    );
                    let _ = child.kill();
                    break child.wait().ok();
                }
            }
        };
        self.exit = status;
        if !unmounted && !force_unmount(&self.path) {
            eprintln!(
                "could not unmount {}: leaving its temp dir",
                self.path.display()
            );
            if let Some(d) = self.dir.take() {
                let _ = d.keep();
            }
        }
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        self.stop();
        if std::thread::panicking() {
            eprintln!(
                "---- output of bucketfs mount -f {} ({}) ----\n{}\n---- end ----",
                self.spec.source,
                self.path.display(),
                self.log()
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Running the CLI for errors
// ---------------------------------------------------------------------------------------------

/// The result of one `bucketfs ...` run.
#[derive(Debug)]
pub struct CliRun {
    pub status: Option<ExitStatus>,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
    pub timed_out: bool,
}

/// Runs `bucketfs args...` (with the isolated environment plus `envs`), waits at most `limit`
/// for it to exit and cleans up any mount of `mountpoint` it made. stdout/stderr go to files,
/// so a daemon that keeps them open cannot block the test.
pub fn run_cli(
    args: &[OsString],
    envs: &[(&str, &str)],
    mountpoint: Option<&Path>,
    limit: Duration,
) -> CliRun {
    let dir = tempfile::tempdir().unwrap();
    let home = dir.path().join("home");
    std::fs::create_dir(&home).unwrap();
    let out_p = dir.path().join("stdout");
    let err_p = dir.path().join("stderr");
    let mut cmd = Command::new(bin());
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(File::create(&out_p).unwrap())
        .stderr(File::create(&err_p).unwrap());
    isolate_env(&mut cmd, &home);
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let start = Instant::now();
    let mut child = cmd.spawn().unwrap();
    let mut timed_out = false;
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break Some(st);
        }
        if start.elapsed() > limit {
            timed_out = true;
            if let Some(mp) = mountpoint {
                force_unmount(mp);
            }
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let elapsed = start.elapsed();
    CliRun {
        status,
        stdout: std::fs::read_to_string(&out_p).unwrap_or_default(),
        stderr: std::fs::read_to_string(&err_p).unwrap_or_default(),
        elapsed,
        timed_out,
    }
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

pub fn os(args: &[&str]) -> Vec<OsString> {
    args.iter().map(OsString::from).collect()
}

// ---------------------------------------------------------------------------------------------
// MinIO control (fault test)
// ---------------------------------------------------------------------------------------------

/// The shared MinIO server: stop it and start it again on the same port, data dir and
/// credentials. The pid file (`BUCKETFS_TEST_MINIO_PIDFILE`) always names the live server, so
/// scripts/test.sh stops the right process at the end.
pub struct Minio {
    pub bin: PathBuf,
    pub data: PathBuf,
    pub pidfile: Option<PathBuf>,
    pub log: Option<PathBuf>,
    pub addr: String,
}

impl Minio {
    pub fn from_env() -> Minio {
        let e = env();
        let addr = e
            .endpoint
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .to_string();
        Minio {
            bin: required("BUCKETFS_TEST_MINIO_BIN").into(),
            data: required("BUCKETFS_TEST_MINIO_DATA").into(),
            pidfile: std::env::var_os("BUCKETFS_TEST_MINIO_PIDFILE").map(PathBuf::from),
            log: std::env::var_os("BUCKETFS_TEST_MINIO_LOG").map(PathBuf::from),
            addr,
        }
    }

    /// The pid of the running server (the pid file wins over BUCKETFS_TEST_MINIO_PID, which
    /// goes stale after a restart).
    pub fn pid(&self) -> i32 {
        if let Some(p) = &self.pidfile {
            if let Ok(s) = std::fs::read_to_string(p) {
                if let Ok(pid) = s.trim().parse() {
                    return pid;
                }
            }
        }
        required("BUCKETFS_TEST_MINIO_PID")
            .trim()
            .parse()
            .expect("BUCKETFS_TEST_MINIO_PID is a pid")
    }

    pub fn healthy(&self) -> bool {
        use std::net::TcpStream;
        let Ok(mut s) = TcpStream::connect_timeout(
            &self.addr.parse().expect("endpoint is http://IP:PORT"),
            Duration::from_secs(2),
        ) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        let req = format!(
            "GET /minio/health/live HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
            self.addr
        );
        if s.write_all(req.as_bytes()).is_err() {
            return false;
        }
        let mut buf = [0u8; 64];
        let n = s.read(&mut buf).unwrap_or(0);
        String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200")
    }

    fn accepts_connections(&self) -> bool {
        std::net::TcpStream::connect_timeout(
            &self.addr.parse().unwrap(),
            Duration::from_millis(500),
        )
        .is_ok()
    }

    /// SIGKILLs the server (a crash, not a clean shutdown) and waits until its port is closed.
    pub fn kill(&self) {
        let pid = self.pid();
        // SAFETY: kill(2) of the MinIO server scripts/test.sh (or an earlier restart) started.
        let r = unsafe { libc::kill(pid, libc::SIGKILL) };
        assert_eq!(
            r,
            0,
            "kill MinIO pid {pid}: {}",
            std::io::Error::last_os_error()
        );
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.accepts_connections() {
            assert!(
                Instant::now() < deadline,
                "MinIO still accepts connections after SIGKILL"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Spawns a helper process that, once `trigger` exists, SIGKILLs the server, keeps it down
    /// for `down`, starts it again (recording its pid in the pid file) and exits when it is
    /// healthy. A test that holds a file open for writing on a mount must restart MinIO this
    /// way rather than with [`Minio::start`]: a child forked by the test process closes that
    /// descriptor at exec (O_CLOEXEC), which is a FUSE flush that uploads, and would wait for
    /// the very server it is starting.
    pub fn restart_on_trigger(&self, trigger: &Path, down: Duration) -> Child {
        let e = env();
        let pidfile = self
            .pidfile
            .clone()
            .expect("BUCKETFS_TEST_MINIO_PIDFILE is needed to restart MinIO");
        let log = self
            .log
            .clone()
            .unwrap_or_else(|| PathBuf::from("/dev/null"));
        let script = r#"
            while [ ! -e "$TRIGGER" ]; do sleep 0.01; done
            kill -9 "$(cat "$PIDFILE")"
            while curl -s -o /dev/null --max-time 1 "http://$ADDR/minio/health/live"; do sleep 0.05; done
            sleep "$DOWN"
            MINIO_ROOT_USER="$AK" MINIO_ROOT_PASSWORD="$SK" MINIO_BROWSER=off MINIO_UPDATE=off                 setsid "$BIN" server --quiet --address "$ADDR" "$DATA" >>"$LOG" 2>&1 </dev/null &
            echo $! >"$PIDFILE"
            for i in $(seq 600); do
                curl -sf -o /dev/null --max-time 1 "http://$ADDR/minio/health/live" && exit 0
                sleep 0.1
            done
            exit 1
        "#;
        Command::new("bash")
            .arg("-c")
            .arg(script)
            .env("TRIGGER", trigger)
            .env("PIDFILE", &pidfile)
            .env("ADDR", &self.addr)
            .env("DOWN", format!("{:.3}", down.as_secs_f64()))
            .env("AK", &e.access_key)
            .env("SK", &e.secret_key)
            .env("BIN", &self.bin)
            .env("DATA", &self.data)
            .env("LOG", log)
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn the restart helper")
    }

    /// Starts the server again with the same binary, address, data dir and credentials, waits
    /// until it is healthy and records its pid in the pid file.
    pub fn start(&self) {
        let e = env();
        let log = match &self.log {
            Some(p) => std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .unwrap(),
            None => File::create("/dev/null").unwrap(),
        };
        let child = Command::new(&self.bin)
            .args(["server", "--quiet", "--address", &self.addr])
            .arg(&self.data)
            .env("MINIO_ROOT_USER", &e.access_key)
            .env("MINIO_ROOT_PASSWORD", &e.secret_key)
            .env("MINIO_BROWSER", "off")
            .env("MINIO_UPDATE", "off")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", self.bin.display()));
        let pid = child.id();
        if let Some(p) = &self.pidfile {
            std::fs::write(p, format!("{pid}\n")).unwrap();
        }
        // The Child handle is dropped without waiting: the server outlives this test process
        // and scripts/test.sh stops it through the pid file.
        drop(child);
        let deadline = Instant::now() + Duration::from_secs(60);
        while !self.healthy() {
            assert!(
                Instant::now() < deadline,
                "restarted MinIO (pid {pid}) not healthy within 60 s"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// While alive, MinIO is down; dropping it (also during a panic) starts the server again.
pub struct MinioOutage {
    minio: Minio,
    restarted: bool,
}

impl MinioOutage {
    pub fn begin() -> MinioOutage {
        let minio = Minio::from_env();
        assert!(minio.healthy(), "MinIO is not healthy before the outage");
        minio.kill();
        MinioOutage {
            minio,
            restarted: false,
        }
    }

    pub fn end(&mut self) {
        if !self.restarted {
            self.restarted = true;
            self.minio.start();
        }
    }
}

impl Drop for MinioOutage {
    fn drop(&mut self) {
        if !self.restarted {
            self.restarted = true;
            if std::thread::panicking() {
                // Must not panic again: report instead.
                if let Err(e) =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.minio.start()))
                {
                    eprintln!("could not restart MinIO after a failed test: {e:?}");
                }
            } else {
                self.minio.start();
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// A private MinIO (TLS, a tiny disk)
// ---------------------------------------------------------------------------------------------

/// A MinIO server of one test, on its own port and data dir, with the shared credentials.
/// Stopped (SIGKILL) when dropped.
pub struct PrivateMinio {
    child: Child,
    pub addr: String,
    pub tls: bool,
}

impl PrivateMinio {
    /// Starts MinIO on `data`; with `certs` (a dir holding public.crt/private.key) it serves
    /// HTTPS. Waits until it answers.
    pub fn start(data: &Path, certs: Option<&Path>) -> PrivateMinio {
        let e = env();
        let bin = required("BUCKETFS_TEST_MINIO_BIN");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let addr = format!("127.0.0.1:{port}");
        let mut cmd = Command::new(&bin);
        cmd.args(["server", "--quiet", "--address", &addr]);
        if let Some(c) = certs {
            cmd.arg("--certs-dir").arg(c);
        }
        let log = File::create(data.with_extension("log")).unwrap();
        let child = cmd
            .arg(data)
            .env("MINIO_ROOT_USER", &e.access_key)
            .env("MINIO_ROOT_PASSWORD", &e.secret_key)
            .env("MINIO_BROWSER", "off")
            .env("MINIO_UPDATE", "off")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("start {bin}: {e}"));
        let m = PrivateMinio {
            child,
            addr,
            tls: certs.is_some(),
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while !m.healthy() {
            assert!(
                Instant::now() < deadline,
                "private MinIO on {} not healthy within 60 s: {}",
                m.addr,
                std::fs::read_to_string(data.with_extension("log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        m
    }

    pub fn endpoint(&self) -> String {
        format!(
            "{}://{}",
            if self.tls { "https" } else { "http" },
            self.addr
        )
    }

    fn healthy(&self) -> bool {
        let url = format!("{}/minio/health/live", self.endpoint());
        Command::new("curl")
            .args(["-skf", "-o", "/dev/null", "--max-time", "2", &url])
            .status()
            .map(|s| s.success())
            .unwrap_or_else(|_| {
                std::net::TcpStream::connect(&self.addr).is_ok() && {
                    std::thread::sleep(Duration::from_secs(2));
                    true
                }
            })
    }

    /// An S3 client for this server (`ca`: the PEM of the CA that signed its certificate).
    pub fn client(&self, ca: Option<&[u8]>) -> S3 {
        let e = env();
        let mut b = aws_sdk_s3::config::Builder::new()
            .behavior_version(BehaviorVersion::latest())
            .endpoint_url(self.endpoint())
            .region(Region::new("us-east-1"))
            .credentials_provider(Credentials::new(
                &e.access_key,
                &e.secret_key,
                None,
                None,
                "bucketfs-tests",
            ))
            .force_path_style(true)
            .request_checksum_calculation(RequestChecksumCalculation::WhenRequired)
            .response_checksum_validation(ResponseChecksumValidation::WhenRequired);
        if let Some(pem) = ca {
            use aws_smithy_http_client::tls::{self, TlsContext, TrustStore};
            let http = aws_smithy_http_client::Builder::new()
                .tls_provider(tls::Provider::rustls(
                    tls::rustls_provider::CryptoMode::AwsLc,
                ))
                .tls_context(
                    TlsContext::builder()
                        .with_trust_store(TrustStore::empty().with_pem_certificate(pem.to_vec()))
                        .build()
                        .unwrap(),
                )
                .build_https();
            b = b.http_client(http);
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("tokio runtime");
        S3 {
            rt,
            client: Client::from_conf(b.build()),
        }
    }

    /// A mount spec of `bucket` on this server.
    pub fn mount_spec(&self, bucket: &str) -> MountSpec {
        let mut spec = MountSpec::s3(bucket, "");
        spec.args = vec![
            "--endpoint-url".into(),
            self.endpoint(),
            "--force-path-style".into(),
            "--region".into(),
            "us-east-1".into(),
        ];
        spec
    }
}

impl Drop for PrivateMinio {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A tmpfs of `mib` MiB mounted at a new temp dir (a disk that fills up). Unmounted on drop.
pub struct SmallDisk {
    pub dir: tempfile::TempDir,
}

impl SmallDisk {
    pub fn new(mib: u64) -> Result<SmallDisk, String> {
        let dir = tempfile::Builder::new()
            .prefix("bucketfs-smalldisk-")
            .tempdir()
            .unwrap();
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={mib}m"), "tmpfs"])
            .arg(dir.path())
            .output()
            .map_err(|e| format!("mount tmpfs: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "mount -t tmpfs: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(SmallDisk { dir })
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount")
            .arg("-l")
            .arg(self.dir.path())
            .status();
    }
}

// ---------------------------------------------------------------------------------------------
// A writer in its own process
// ---------------------------------------------------------------------------------------------

/// A separate process that holds files open for writing on a mount, driven line by line.
///
/// Tests that keep a file open across a daemon crash or signal use it instead of a `File` of
/// the test process: when any test running in parallel forks a child, that child closes its
/// copies of the test process's descriptors at exec (O_CLOEXEC), which the mount sees as a
/// flush of every file the test process has open.
pub struct ForeignWriter {
    child: Child,
    stdin: std::process::ChildStdin,
    stdout: std::io::BufReader<std::process::ChildStdout>,
}

/// 1 MiB of the block pattern [`ForeignWriter`] writes (`fill`): bytes 0..=255 repeated.
pub fn writer_block() -> Vec<u8> {
    (0..MIB).map(|i| i as u8).collect()
}

impl ForeignWriter {
    pub fn start() -> ForeignWriter {
        let script = r#"
import sys
files = {}
block = bytes(range(256)) * 4096
for line in sys.stdin:
    cmd = line.rstrip("\n").split(" ", 2)
    try:
        if cmd[0] == "open":
            files[cmd[1]] = open(cmd[2], "wb", buffering=0)
        elif cmd[0] == "fill":
            for _ in range(int(cmd[2])):
                files[cmd[1]].write(block)
        elif cmd[0] == "text":
            files[cmd[1]].write(cmd[2].encode())
        elif cmd[0] == "close":
            files.pop(cmd[1]).close()
        print("ok", flush=True)
    except OSError as e:
        print("errno %d" % e.errno, flush=True)
"#;
        let mut child = Command::new("python3")
            .arg("-c")
            .arg(script)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3");
        let stdin = child.stdin.take().unwrap();
        let stdout = std::io::BufReader::new(child.stdout.take().unwrap());
        ForeignWriter {
            child,
            stdin,
            stdout,
        }
    }

    /// Runs one command (`open NAME PATH`, `fill NAME MIB`, `text NAME TEXT`, `close NAME`);
    /// returns `ok` or `errno N`.
    pub fn cmd(&mut self, line: &str) -> String {
        use std::io::BufRead;
        writeln!(self.stdin, "{line}").expect("writer stdin");
        let mut out = String::new();
        self.stdout.read_line(&mut out).expect("writer stdout");
        out.trim().to_string()
    }

    pub fn open(&mut self, name: &str, path: &Path) {
        let r = self.cmd(&format!("open {name} {}", path.display()));
        assert_eq!(r, "ok", "open {}", path.display());
    }
}

impl Drop for ForeignWriter {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Polls `f` every 50 ms until it holds; panics after `limit`.
pub fn wait_for(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Starts a multipart upload directly through S3 (as another client, or a dead daemon, would).
pub fn create_upload(bucket: &str, key: &str) -> String {
    let s3 = s3();
    s3.block_on(
        s3.client
            .create_multipart_upload()
            .bucket(bucket)
            .key(key)
            .send(),
    )
    .unwrap()
    .upload_id()
    .unwrap()
    .to_string()
}

/// MinIO's `host:port`, for proxies in front of it.
pub fn minio_addr() -> String {
    env()
        .endpoint
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_string()
}

/// A mount of `bucket` through `proxy`.
pub fn via_proxy(bucket: &str, proxy: &proxy::FaultProxy) -> MountSpec {
    let mut spec = MountSpec::s3(bucket, "");
    spec.args = vec![
        "--endpoint-url".into(),
        proxy.endpoint(),
        "--force-path-style".into(),
        "--region".into(),
        "us-east-1".into(),
    ];
    spec
}
