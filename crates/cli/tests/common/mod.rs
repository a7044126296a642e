//! Shared harness of the integration tests: real FUSE mounts of the built `bucketfs` binary
//! against the MinIO server that `scripts/test.sh` starts. One module per topic; everything
//! is re-exported here, so a test file needs only `mod common; use common::*;`.
//!
//! * [`environment`]: `BUCKETFS_TEST_*`, the binary, unique bucket names.
//! * [`s3_client`]: a blocking S3 client for looking at the bucket directly.
//! * [`mount`]: [`Mount`], a guard around one `bucketfs mount -f` daemon (unmounted on drop,
//!   watchdog), and [`MountSpec`].
//! * [`process`]: the daemon's memory and descriptors, processes using a path.
//! * [`metrics`]: the daemon's request counters and Prometheus values.
//! * [`cli`]: running `bucketfs ...` for its status and output.
//! * [`background`]: mounts with `--upload background`, `bucketfs pending`.
//! * [`data_cache`]: mounts with `--data-cache` and the files of their cache directory.
//! * [`files`]: checked file operations through a mount, running a command.
//! * [`pattern`]: reproducible pseudo-random file contents, written and checked in 1 MiB blocks.
//! * [`wait`]: polling until a condition holds; [`Pause`], a test point the daemon waits at.
//! * [`minio`]: stopping and restarting the shared server; [`private_minio`]: a server of one
//!   test (TLS, a tiny disk).
//! * [`writer`]: a writer in its own process.
//! * [`proxy`]: a TCP proxy in front of MinIO that injects faults.
#![allow(dead_code)]

mod background;
mod cli;
mod data_cache;
mod environment;
mod files;
mod metrics;
mod minio;
mod mount;
pub mod pattern;
mod private_minio;
mod process;
pub mod proxy;
mod s3_client;
mod wait;
mod writer;

// Each test binary uses a part of the harness.
#[allow(unused_imports)]
pub use self::{
    background::*, cli::*, data_cache::*, environment::*, files::*, metrics::*, minio::*, mount::*,
    private_minio::*, process::*, s3_client::*, wait::*, writer::*,
};
