//! Which opens the fs core hands the data cache's whole copy (passthrough), with the kernel's
//! answers played by the test: after the kernel refused one file (passthrough off for the
//! mount), a file it already reads through a copy still takes read-only opens of the same
//! version, instead of `ETXTBSY`.

mod support;

use bucketfs_fs::{DataCacheConfig, Fs, FsConfig, ROOT_INO};
use bucketfs_store::memory::MemoryStore;
use bucketfs_store::{ObjectStore, UserMeta};
use bytes::Bytes;
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::MIB;

/// An fs over `store` with a data cache of 64 MiB and passthrough on, and the directories
/// it keeps (cache and data cache; keep them alive).
fn passthrough_fs(store: Arc<dyn ObjectStore>) -> (Arc<Fs>, [tempfile::TempDir; 2]) {
    let cache = tempfile::tempdir().unwrap();
    let dc = tempfile::tempdir().unwrap();
    let cfg = FsConfig {
        data_cache: Some(DataCacheConfig {
            dir: dc.path().to_path_buf(),
            max_bytes: 64 * MIB,
            scope: "test".into(),
        }),
        ..support::config(&cache)
    };
    let fs = Fs::new(store, cfg);
    assert!(fs.enable_passthrough());
    (fs, [cache, dc])
}

async fn whole_copy_open(fs: &Fs, name: &str, size: u64) -> (u64, u64) {
    let ino = fs.lookup(ROOT_INO, name.as_ref()).await.unwrap().ino;
    // Read once through the daemon: the cache writes its blocks and assembles them.
    let r = fs.open(ino, libc::O_RDONLY).await.unwrap();
    assert!(r.local.is_none());
    assert_eq!(
        fs.read(ino, r.fh, 0, size as u32).await.unwrap().len() as u64,
        size
    );
    fs.release(ino, r.fh).await.unwrap();
    let t = Instant::now();
    loop {
        let r = fs.open(ino, libc::O_RDONLY).await.unwrap();
        if r.local.is_some() {
            return (ino, r.fh);
        }
        fs.release(ino, r.fh).await.unwrap();
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "no whole copy of {name}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_backing_elsewhere_does_not_lock_out_readers_of_a_shared_copy() {
    let mem = Arc::new(MemoryStore::new());
    for k in ["a", "b"] {
        let data = Bytes::from(support::random((MIB + 5) as usize, 7));
        mem.put(k, data, &UserMeta::default()).await.unwrap();
    }
    let (fs, _dirs) = passthrough_fs(mem.clone());
    let (a, fh_a) = whole_copy_open(&fs, "a", MIB + 5).await;
    fs.passed_through(a, fh_a, true);
    // The kernel refuses b's copy: passthrough goes off for the mount.
    let (b, fh_b) = whole_copy_open(&fs, "b", MIB + 5).await;
    fs.passed_through(b, fh_b, false);
    // a is still read by the kernel through its copy: a read-only open must share it.
    let r = fs.open(a, libc::O_RDONLY).await;
    let r = r.expect("a reader of the same version refused");
    assert!(
        r.local.is_some(),
        "the kernel refuses an open of a that does not share its copy"
    );
    // New copies are no longer handed out.
    fs.release(b, fh_b).await.unwrap();
    let r2 = fs.open(b, libc::O_RDONLY).await.unwrap();
    assert!(r2.local.is_none());
    fs.release(a, r.fh).await.unwrap();
    fs.release(a, fh_a).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_truncate_waits_for_the_readers_of_a_copy_then_fails() {
    let mem = Arc::new(MemoryStore::new());
    let data = Bytes::from(support::random((MIB + 5) as usize, 8));
    mem.put("a", data, &UserMeta::default()).await.unwrap();
    let (fs, _dirs) = passthrough_fs(mem.clone());
    let (a, fh) = whole_copy_open(&fs, "a", MIB + 5).await;
    fs.passed_through(a, fh, true);
    let set = bucketfs_fs::SetAttr {
        size: Some(3),
        ..Default::default()
    };
    let t = Instant::now();
    let e = fs.setattr(a, None, set.clone()).await.unwrap_err();
    assert_eq!(e.0, libc::ETXTBSY);
    assert!(t.elapsed() >= Duration::from_millis(500));
    fs.release(a, fh).await.unwrap();
    assert_eq!(fs.setattr(a, None, set).await.unwrap().size, 3);
}

/// A truncate of a file nobody has open keeps out a read-only open while it uploads: that
/// open reads through the fs (the new size once it is stored), never the old whole copy,
/// which the kernel would go on reading after the truncate returned (and which would keep
/// out every later open with `ETXTBSY`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_while_a_truncate_uploads_never_reads_the_old_copy() {
    use bucketfs_store::fault::{Fault, FaultStore};
    use bucketfs_store::metrics::Op;
    let mem = Arc::new(MemoryStore::new());
    let data = Bytes::from(support::random((MIB + 5) as usize, 8));
    mem.put("a", data, &UserMeta::default()).await.unwrap();
    let faulty = Arc::new(FaultStore::new(mem.clone()));
    let (fs, _dirs) = passthrough_fs(faulty.clone());
    let (ino, fh) = whole_copy_open(&fs, "a", MIB + 5).await;
    fs.passed_through(ino, fh, true);
    fs.release(ino, fh).await.unwrap();
    faulty.inject(Op::Put, 0, Some(1), Fault::Delay(Duration::from_secs(1)));
    let truncate = tokio::spawn({
        let fs = fs.clone();
        async move {
            let set = bucketfs_fs::SetAttr {
                size: Some(3),
                ..Default::default()
            };
            fs.setattr(ino, None, set).await
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!truncate.is_finished(), "the truncate's upload is held");
    let r = fs.open(ino, libc::O_RDONLY).await.unwrap();
    assert!(
        r.local.is_none(),
        "an open during the truncate got the old copy"
    );
    assert_eq!(truncate.await.unwrap().unwrap().size, 3);
    assert_eq!(fs.read(ino, r.fh, 0, 4096).await.unwrap().len(), 3);
    fs.release(ino, r.fh).await.unwrap();
}

/// A file read through a local copy, then renamed or chmod'ed here: this mount's own copy
/// of the object, pinned to the version read, holds the same bytes under a new ETag (an
/// object stored in parts gets one). Opens of it go on sharing the local copy (an earlier
/// build took the new ETag for another version: every open waited and got `ETXTBSY` until
/// the first reader closed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rename_or_chmod_here_keeps_sharing_the_local_copy() {
    let mem = Arc::new(MemoryStore::new());
    let size = 5 * MIB + 5;
    let data = Bytes::from(support::random(size as usize, 9));
    let none = UserMeta::default();
    for key in ["chmod", "rename"] {
        let id = mem.create_multipart(key, &none, None).await.unwrap();
        let mut parts = Vec::new();
        for (n, range) in [
            (1, 0..5 * MIB as usize),
            (2, 5 * MIB as usize..size as usize),
        ] {
            let etag = mem
                .upload_part(key, &id, n, data.slice(range))
                .await
                .unwrap();
            parts.push(bucketfs_store::CompletedPart {
                part_number: n,
                etag,
            });
        }
        mem.complete_multipart(key, &id, &parts, None)
            .await
            .unwrap();
    }
    let (fs, _dirs) = passthrough_fs(mem.clone());
    for step in ["chmod", "rename"] {
        let (ino, fh) = whole_copy_open(&fs, step, size).await;
        fs.passed_through(ino, fh, true);
        let before = mem.head(step).await.unwrap().etag;
        let key = if step == "chmod" {
            let set = bucketfs_fs::SetAttr {
                mode: Some(0o100600),
                ..Default::default()
            };
            fs.setattr(ino, None, set).await.unwrap();
            "chmod"
        } else {
            fs.rename(ROOT_INO, "rename".as_ref(), ROOT_INO, "renamed".as_ref(), 0)
                .await
                .unwrap();
            "renamed"
        };
        let after = mem.head(key).await.unwrap().etag;
        assert_ne!(before, after, "{step}: the copy has another ETag");
        let r = fs.open(ino, libc::O_RDONLY).await;
        let r = r.unwrap_or_else(|e| panic!("{step}: an open of the same bytes refused: {e:?}"));
        assert!(
            r.local.is_some(),
            "{step}: the open does not share the copy"
        );
        fs.passed_through(ino, r.fh, true);
        fs.release(ino, r.fh).await.unwrap();
        fs.release(ino, fh).await.unwrap();
    }
}
