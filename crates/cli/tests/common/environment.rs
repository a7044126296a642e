//! The test environment: the built binary and the MinIO endpoint and credentials the
//! `BUCKETFS_TEST_*` variables give (the tests fail with a clear message without them), and
//! bucket names no other test uses.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

pub const MIB: usize = 1024 * 1024;

/// Path of the `bucketfs` binary cargo built for these tests.
pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_bucketfs")
}

#[derive(Debug)]
pub struct TestEnv {
    pub endpoint: String,
    pub access_key: String,
    pub secret_key: String,
}

pub(crate) fn required(name: &str) -> String {
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
