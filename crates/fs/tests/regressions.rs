//! Failures found by the reliability suite (soak, model tests), each reduced to the smallest
//! case on the memory store. Every test here failed when it was written.

use bucketfs_fs::{Caller, Fs, FsConfig, ROOT_INO};
use bucketfs_store::memory::MemoryStore;
use bytes::Bytes;
use std::ffi::OsStr;
use std::sync::Arc;

const MIB: usize = 1024 * 1024;
const ME: Caller = Caller { uid: 0, gid: 0 };

/// Found by the soak (`t40-r21: Stale file handle (os error 116)`): a file uploaded in parts
/// has a multipart ETag (`"…-3"`); a rename copies it to a new object whose ETag differs, but
/// the inode keeps the old ETag, so the next read sends `If-Match` with it, gets 412 and
/// fails with ESTALE until the attributes expire (`--stat-ttl`).
#[tokio::test]
async fn read_after_renaming_a_multipart_file() {
    let mem = Arc::new(MemoryStore::new());
    let cache = tempfile::tempdir().unwrap();
    let fs = Fs::new(
        mem.clone(),
        FsConfig {
            part_size: 5 * MIB as u64,
            cache_dir: cache.path().to_path_buf(),
            ..FsConfig::default()
        },
    );
    let data: Vec<u8> = (0..12 * MIB).map(|i| (i % 251) as u8).collect();
    let (a, h) = fs
        .create(ROOT_INO, OsStr::new("big"), 0o644, 0, libc::O_WRONLY, ME)
        .await
        .unwrap();
    for (i, c) in data.chunks(MIB).enumerate() {
        fs.write(a.ino, h.fh, (i * MIB) as u64, Bytes::copy_from_slice(c))
            .await
            .unwrap();
    }
    fs.flush(a.ino, h.fh).await.unwrap();
    fs.release(a.ino, h.fh).await.unwrap();
    fs.rename(
        ROOT_INO,
        OsStr::new("big"),
        ROOT_INO,
        OsStr::new("moved"),
        0,
    )
    .await
    .unwrap();
    let m = fs.lookup(ROOT_INO, OsStr::new("moved")).await.unwrap();
    let h = fs.open(m.ino, libc::O_RDONLY).await.unwrap();
    let got = fs.read(m.ino, h.fh, 0, MIB as u32).await;
    assert_eq!(
        got.map(|b| b.len()),
        Ok(MIB),
        "read right after renaming a multipart file"
    );
}
