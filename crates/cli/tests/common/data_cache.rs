//! Mounts with a data cache (`--data-cache`) and what their cache directory holds.

use super::{free_local_addr, metric, Mount, MountSpec};
use std::path::{Path, PathBuf};

/// A mount of `bucket` caching data in `dir`, with `mode` (the passthrough flag the test file
/// is about, if any) and `extra` flags, serving metrics at the returned address.
pub fn mount_data_cache(
    bucket: &str,
    dir: &Path,
    mode: &[&str],
    extra: &[&str],
) -> (Mount, String) {
    let addr = free_local_addr();
    let mut spec = MountSpec::s3(bucket, "")
        .arg("--data-cache")
        .arg(dir.to_str().unwrap())
        .arg("--metrics-addr")
        .arg(&addr);
    for a in mode.iter().chain(extra) {
        spec = spec.arg(a);
    }
    (spec.mount(), addr)
}

/// Files under the cache directory whose name ends with `ext`, temporaries aside, sorted.
pub fn cache_files(dir: &Path, ext: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            // The type from the directory entry: a temporary file the cache's writer renames
            // or removes meanwhile has no metadata left to read.
            let Ok(kind) = e.file_type() else {
                continue;
            };
            if kind.is_dir() {
                todo.push(e.path());
            } else if name.ends_with(ext) && !name.starts_with(".tmp-") {
                out.push(e.path());
            }
        }
    }
    out.sort();
    out
}

/// Opens the mount at `addr` handed to the kernel with the cache's copy (passthrough).
pub fn passthrough_opens(addr: &str) -> u64 {
    metric(addr, "bucketfs_passthrough_opens_total")
}
