//! Passthrough's rules through real mounts against MinIO (run as root on Linux 6.9+): it is
//! opt-in (`--passthrough`), and a truncate by path waits for the readers of the cache's copy
//! as an open for writing does.

mod common;

use common::*;
use std::path::Path;
use std::time::{Duration, Instant};

const MIB: u64 = 1024 * 1024;

/// truncate(2) by path: a setattr with no open file.
fn truncate_path(path: &Path, len: u64) -> std::io::Result<()> {
    let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    // SAFETY: a valid C string.
    if unsafe { libc::truncate(c.as_ptr(), len as libc::off_t) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[test]
fn passthrough_is_off_unless_asked_for() {
    let b = s3().new_bucket("ptr-optin");
    let data = pattern::bytes(60, (2 * MIB + 5) as usize);
    s3().put(&b, "f", data.clone());
    let cache = tempfile::tempdir().unwrap();
    let (m, addr) = mount_data_cache(&b, cache.path(), &[], &[]);
    assert!(read_file(&m.join("f")) == data);
    // Without --passthrough the cache keeps blocks: no whole copy, none handed over, and a
    // writer is never kept out by a reader.
    wait_for("the blocks cached", Duration::from_secs(20), || {
        cache_files(cache.path(), "").len() >= 3
    });
    let held = std::fs::File::open(m.join("f")).unwrap();
    let w = std::fs::OpenOptions::new().write(true).open(m.join("f"));
    assert!(w.is_ok(), "a writer refused without --passthrough: {w:?}");
    drop(w);
    drop(held);
    assert_eq!(passthrough_opens(&addr), 0);
    assert!(cache_files(cache.path(), ".obj").is_empty());
    drop(m);
    // With it, a file read into the cache is assembled whole and handed to the kernel.
    s3().put(&b, "g", data.clone());
    let (m, addr) = mount_data_cache(&b, cache.path(), &[], &["--passthrough"]);
    assert!(read_file(&m.join("g")) == data);
    wait_for("a whole copy", Duration::from_secs(20), || {
        !cache_files(cache.path(), ".man").is_empty()
    });
    assert!(read_file(&m.join("g")) == data);
    assert_eq!(passthrough_opens(&addr), 1);
    drop(m);
    // --no-passthrough still wins.
    let (m, addr) = mount_data_cache(
        &b,
        cache.path(),
        &[],
        &["--passthrough", "--no-passthrough"],
    );
    assert!(read_file(&m.join("g")) == data);
    assert_eq!(passthrough_opens(&addr), 0);
}

#[test]
fn a_truncate_by_path_waits_for_passthrough_readers_then_fails() {
    let b = s3().new_bucket("ptr-trunc");
    let data = pattern::bytes(61, (2 * MIB + 77) as usize);
    s3().put(&b, "f", data.clone());
    let cache = tempfile::tempdir().unwrap();
    let (m, addr) = mount_data_cache(&b, cache.path(), &[], &["--passthrough"]);
    assert!(read_file(&m.join("f")) == data);
    wait_for("a whole copy", Duration::from_secs(20), || {
        !cache_files(cache.path(), ".man").is_empty()
    });
    let held = std::fs::File::open(m.join("f")).unwrap();
    assert_eq!(passthrough_opens(&addr), 1);
    let t = Instant::now();
    let r = truncate_path(&m.join("f"), 10);
    assert_eq!(
        r.as_ref().err().and_then(|e| e.raw_os_error()),
        Some(libc::ETXTBSY),
        "{r:?}"
    );
    assert!(
        t.elapsed() >= Duration::from_millis(500),
        "{:?}",
        t.elapsed()
    );
    assert!(
        s3().get(&b, "f") == Some(data.clone()),
        "the object changed under the reader"
    );
    drop(held);
    // Once the reader is gone the truncate goes through.
    truncate_path(&m.join("f"), 10).unwrap();
    assert!(s3().get(&b, "f") == Some(data[..10].to_vec()));
}
