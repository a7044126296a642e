//! A MinIO server of one test (TLS, a tiny disk).

use super::{env, required, MountSpec, S3};
use aws_sdk_s3::config::{
    BehaviorVersion, Credentials, Region, RequestChecksumCalculation, ResponseChecksumValidation,
};
use aws_sdk_s3::Client;
use std::fs::File;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

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
