//! Attributes, symlinks, inode lifetime, read-only mounts and name limits.

use crate::support::{
    config, env, object, put, read_all, write_file, write_file_in, Gate, HoldsCopyAnswer, ME,
};
use bucketfs_fs::{FileKind, Fs, FsConfig, FsError, SetAttr, ROOT_INO};
use bucketfs_store::memory::MemoryStore;
use bucketfs_store::ObjectStore;
use std::ffi::OsStr;
use std::sync::Arc;

#[tokio::test]
async fn symlink_is_stored_like_s3fs() {
    let e = env();
    let a =
        e.fs.symlink(
            ROOT_INO,
            OsStr::new("ln"),
            std::path::Path::new("../target"),
            ME,
        )
        .await
        .unwrap();
    assert_eq!(a.kind, FileKind::Symlink);
    assert_eq!(object(&e.mem, "ln").await, b"../target");
    let m = e.mem.head("ln").await.unwrap();
    assert_eq!(m.user["mode"], (libc::S_IFLNK | 0o777).to_string());
    // A fresh mount reads it back from the store.
    let cache = tempfile::tempdir().unwrap();
    let fs2 = Fs::new(e.mem.clone(), config(&cache));
    let l = fs2.lookup(ROOT_INO, OsStr::new("ln")).await.unwrap();
    assert_eq!(l.kind, FileKind::Symlink);
    assert_eq!(&fs2.readlink(l.ino).await.unwrap()[..], b"../target");
}

#[tokio::test]
async fn chmod_chown_utimens_persist_in_metadata() {
    let e = env();
    put(&e.mem, "m", b"data").await;
    let a = e.fs.lookup(ROOT_INO, OsStr::new("m")).await.unwrap();
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000_000);
    let a =
        e.fs.setattr(
            a.ino,
            None,
            SetAttr {
                mode: Some(0o751),
                uid: Some(42),
                gid: Some(43),
                mtime: Some(t),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!((a.perm, a.uid, a.gid, a.mtime), (0o751, 42, 43, t));
    let m = e.mem.head("m").await.unwrap();
    assert_eq!(m.user["mode"], (libc::S_IFREG | 0o751).to_string());
    assert_eq!(m.user["mtime"], "1000000000");
    assert_eq!(object(&e.mem, "m").await, b"data");
    let cache = tempfile::tempdir().unwrap();
    let fs2 = Fs::new(e.mem.clone(), config(&cache));
    let b = fs2.lookup(ROOT_INO, OsStr::new("m")).await.unwrap();
    assert_eq!((b.perm, b.uid, b.gid, b.mtime), (0o751, 42, 43, t));
}

#[tokio::test]
async fn forget_drops_inodes() {
    let e = env();
    put(&e.mem, "a", b"1").await;
    let base = e.fs.inode_count();
    let a = e.fs.lookup(ROOT_INO, OsStr::new("a")).await.unwrap();
    e.fs.lookup(ROOT_INO, OsStr::new("a")).await.unwrap();
    assert_eq!(e.fs.inode_count(), base + 1);
    e.fs.forget(a.ino, 1);
    assert_eq!(e.fs.inode_count(), base + 1);
    e.fs.forget(a.ino, 1);
    assert_eq!(e.fs.inode_count(), base);
}

#[tokio::test]
async fn read_only_refuses_changes() {
    let mem = Arc::new(MemoryStore::new());
    put(&mem, "a", b"1").await;
    let cache = tempfile::tempdir().unwrap();
    let fs = Fs::new(
        mem.clone(),
        FsConfig {
            read_only: true,
            ..config(&cache)
        },
    );
    let a = fs.lookup(ROOT_INO, OsStr::new("a")).await.unwrap();
    assert_eq!(
        fs.open(a.ino, libc::O_WRONLY).await.err(),
        Some(FsError::EROFS)
    );
    assert_eq!(
        fs.mkdir(ROOT_INO, OsStr::new("d"), 0o755, 0, ME).await,
        Err(FsError::EROFS)
    );
    assert_eq!(
        fs.unlink(ROOT_INO, OsStr::new("a")).await,
        Err(FsError::EROFS)
    );
}

#[tokio::test]
async fn names_over_255_bytes_are_refused() {
    let e = env();
    let long = "n".repeat(256);
    assert_eq!(
        e.fs.lookup(ROOT_INO, OsStr::new(&long)).await,
        Err(FsError::ENAMETOOLONG)
    );
    let ok = "n".repeat(255);
    write_file(&e.fs, &ok, b"x").await;
    assert_eq!(read_all(&e.fs, &ok).await, b"x");
}

#[tokio::test]
async fn paths_whose_key_exceeds_1024_bytes_are_refused() {
    let e = env();
    let mut dir = ROOT_INO;
    // Four levels of 250-byte names: the fifth name pushes the key past 1,024 bytes.
    for i in 0..4 {
        let name = format!("{i}").repeat(250);
        dir =
            e.fs.mkdir(dir, OsStr::new(&name), 0o755, 0, ME)
                .await
                .unwrap()
                .ino;
    }
    assert_eq!(
        e.fs.create(
            dir,
            OsStr::new(&"x".repeat(30)),
            0o644,
            0,
            libc::O_WRONLY,
            ME
        )
        .await
        .err(),
        Some(FsError::ENAMETOOLONG)
    );
    assert!(e
        .fs
        .create(dir, OsStr::new("ok"), 0o644, 0, libc::O_WRONLY, ME)
        .await
        .is_ok());
}

/// A truncate of a file nobody has open, and an open for writing while it uploads: the
/// writer shares the truncated content, so its close stores its write over the new size
/// (before: it had a state of its own over the old version, and its close failed with
/// `ESTALE`; in background mode it put the old bytes back over the acknowledged truncate).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_for_writing_while_a_truncate_uploads_builds_on_the_truncated_file() {
    use bucketfs_store::fault::Fault;
    use bucketfs_store::metrics::Op;
    use std::time::Duration;
    let mem = Arc::new(MemoryStore::new());
    let old = crate::support::random(1 << 20, 5);
    put(&mem, "f", &old).await;
    let (faulty, fs, _cache) = crate::support::faulty_fs(&mem);
    let a = fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    faulty.inject(Op::Put, 0, Some(1), Fault::Delay(Duration::from_secs(1)));
    let truncate = tokio::spawn({
        let fs = fs.clone();
        async move {
            let set = SetAttr {
                size: Some(512 << 10),
                ..SetAttr::default()
            };
            fs.setattr(a.ino, None, set).await
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!truncate.is_finished(), "the truncate's upload is held");
    let h = fs.open(a.ino, libc::O_WRONLY).await.unwrap();
    assert_eq!(truncate.await.unwrap().unwrap().size, 512 << 10);
    fs.write(a.ino, h.fh, 0, bytes::Bytes::from_static(b"x"))
        .await
        .unwrap();
    fs.flush(a.ino, h.fh).await.unwrap();
    fs.release(a.ino, h.fh).await.unwrap();
    let mut want = old[..512 << 10].to_vec();
    want[0] = b'x';
    assert_eq!(object(&mem, "f").await, want);
}

/// A truncate by path that finds the file's write state being retired by its last close
/// (publishing, here held at its `PUT`) truncates once the close is done, through a state of
/// its own (in a build of 2026-12-02 it returned 0 and changed nothing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_truncate_during_the_last_close_of_a_writer_is_not_lost() {
    use bucketfs_store::fault::Fault;
    use bucketfs_store::metrics::Op;
    use std::time::Duration;
    let mem = Arc::new(MemoryStore::new());
    put(&mem, "f", b"old").await;
    let (faulty, fs, _cache) = crate::support::faulty_fs(&mem);
    let a = fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    let h = fs.open(a.ino, libc::O_WRONLY).await.unwrap();
    fs.write(a.ino, h.fh, 0, bytes::Bytes::from(vec![7u8; 1 << 20]))
        .await
        .unwrap();
    faulty.inject(Op::Put, 0, Some(1), Fault::Delay(Duration::from_secs(1)));
    // A release with no flush before it: it publishes, holding the state.
    let close = tokio::spawn({
        let fs = fs.clone();
        async move { fs.release(a.ino, h.fh).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let set = SetAttr {
        size: Some(0),
        ..SetAttr::default()
    };
    assert_eq!(fs.setattr(a.ino, None, set).await.unwrap().size, 0);
    close.await.unwrap().unwrap();
    assert_eq!(object(&mem, "f").await, b"");
    assert_eq!(fs.getattr(a.ino).await.unwrap().size, 0);
}

/// Metadata of a file owned by `uid` with mtime `secs` and an extra key of its writer's.
fn owned_meta(uid: u32, secs: u64) -> bucketfs_store::UserMeta {
    [
        ("mode", (libc::S_IFREG | 0o644).to_string()),
        ("uid", uid.to_string()),
        ("gid", "5678".to_string()),
        ("mtime", secs.to_string()),
        ("origin", format!("writer-{uid}")),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// A chmod of a file whose directory was renamed after another client replaced the file:
/// the change goes onto the other client's version with that version's owner, mtime and
/// keys. An earlier build stored this mount's old attributes of the version before with it
/// (the rename gave the inode the copy's ETag, not its metadata).
#[tokio::test]
async fn a_chmod_below_a_renamed_directory_keeps_the_other_clients_attributes() {
    let e = env();
    e.mem
        .put(
            "d/f",
            bytes::Bytes::from_static(b"old"),
            &owned_meta(1234, 1_600_000_000),
        )
        .await
        .unwrap();
    let d = e.fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    let f = e.fs.lookup(d.ino, OsStr::new("f")).await.unwrap();
    e.mem
        .put(
            "d/f",
            bytes::Bytes::from_static(b"new"),
            &owned_meta(42, 1_700_000_000),
        )
        .await
        .unwrap();
    e.fs.rename(ROOT_INO, OsStr::new("d"), ROOT_INO, OsStr::new("d2"), 0)
        .await
        .unwrap();
    let chmod = SetAttr {
        mode: Some(0o600),
        ..Default::default()
    };
    let a = e.fs.setattr(f.ino, None, chmod).await.unwrap();
    assert_eq!((a.perm, a.uid), (0o600, 42));
    let m = e.mem.head("d2/f").await.unwrap();
    assert_eq!(m.user["mode"], (libc::S_IFREG | 0o600).to_string());
    assert_eq!(m.user["uid"], "42");
    assert_eq!(m.user["mtime"], "1700000000");
    assert_eq!(m.user["origin"], "writer-42");
    assert_eq!(object(&e.mem, "d2/f").await, b"new");
}

/// A fchmod on a descriptor after readdirplus listed the file without metadata (AWS S3 and
/// OSS never list it): the change goes onto the object's own owner, mtime and keys. An
/// earlier build took the listing's defaults (the mount's owner, no keys) for them.
#[tokio::test]
async fn a_chmod_after_a_listing_without_metadata_keeps_the_objects_attributes() {
    let e = env();
    e.mem
        .put(
            "d/f",
            bytes::Bytes::from_static(b"abc"),
            &owned_meta(42, 1_600_000_000),
        )
        .await
        .unwrap();
    let d = e.fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    let f = e.fs.lookup(d.ino, OsStr::new("f")).await.unwrap();
    let h = e.fs.open(f.ino, libc::O_RDONLY).await.unwrap();
    e.fs.refresh(f.ino).unwrap();
    let fh = e.fs.opendir(d.ino).await.unwrap();
    let entries = e.fs.readdir(d.ino, fh, 0).await.unwrap();
    for ent in entries.iter().filter(|ent| ent.name == "f") {
        let (_, complete) = e.fs.plus_entry(d.ino, ent).unwrap();
        assert!(!complete, "listed with metadata: the test proves nothing");
    }
    e.fs.releasedir(d.ino, fh);
    let chmod = SetAttr {
        mode: Some(0o600),
        ..Default::default()
    };
    let a = e.fs.setattr(f.ino, Some(h.fh), chmod).await.unwrap();
    assert_eq!((a.perm, a.uid), (0o600, 42));
    let m = e.mem.head("d/f").await.unwrap();
    assert_eq!(m.user["uid"], "42");
    assert_eq!(m.user["mtime"], "1600000000");
    assert_eq!(m.user["origin"], "writer-42");
    e.fs.release(f.ino, h.fh).await.unwrap();
}

/// A chmod of a directory known only from its parent's listing (a common prefix, which
/// carries no metadata): the marker keeps the owner, group and keys another client stored
/// on it. An earlier build rewrote the marker with this mount's defaults for everything but
/// the mode.
#[tokio::test]
async fn a_chmod_of_a_listed_directory_keeps_its_markers_attributes() {
    let e = env();
    let mut marker = owned_meta(42, 1_600_000_000);
    marker.insert("mode".into(), (libc::S_IFDIR | 0o750).to_string());
    e.mem.put("d/", bytes::Bytes::new(), &marker).await.unwrap();
    put(&e.mem, "d/f", b"abc").await;
    let fh = e.fs.opendir(ROOT_INO).await.unwrap();
    let entries = e.fs.readdir(ROOT_INO, fh, 0).await.unwrap();
    let d = entries.iter().find(|ent| ent.name == "d").unwrap();
    let (listed, _) = e.fs.plus_entry(ROOT_INO, d).unwrap();
    e.fs.add_lookup(d.ino);
    e.fs.releasedir(ROOT_INO, fh);
    assert_ne!(
        listed.uid, 42,
        "listed with the marker's owner: the test proves nothing"
    );
    let chmod = SetAttr {
        mode: Some(0o700),
        ..Default::default()
    };
    let a = e.fs.setattr(d.ino, None, chmod).await.unwrap();
    assert_eq!((a.perm, a.uid, a.gid), (0o700, 42, 5678));
    let m = e.mem.head("d/").await.unwrap();
    assert_eq!(m.user["mode"], (libc::S_IFDIR | 0o700).to_string());
    assert_eq!(m.user["uid"], "42");
    assert_eq!(m.user["gid"], "5678");
    assert_eq!(m.user["origin"], "writer-42");
}

/// Another client stored bytes in a directory's marker object (`d/`, which S3 allows and
/// this mount never shows): a chmod, chown or utimens of the directory (`touch d`, `rsync -a`,
/// `tar x`) replaced it with an empty marker, and the bytes were gone. It now copies the marker
/// onto itself, pinned to the version read, so its bytes (and its headers) stay.
#[tokio::test]
async fn a_chmod_of_a_directory_keeps_the_bytes_of_its_marker_object() {
    let e = env();
    let mut marker = owned_meta(42, 1_600_000_000);
    marker.insert("mode".into(), (libc::S_IFDIR | 0o750).to_string());
    e.mem
        .put("d/", bytes::Bytes::from_static(b"report"), &marker)
        .await
        .unwrap();
    put(&e.mem, "d/f", b"abc").await;
    let d = e.fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    let chmod = SetAttr {
        mode: Some(0o700),
        ..Default::default()
    };
    let a = e.fs.setattr(d.ino, None, chmod).await.unwrap();
    assert_eq!((a.perm, a.uid), (0o700, 42));
    assert_eq!(object(&e.mem, "d/").await, b"report");
    let m = e.mem.head("d/").await.unwrap();
    assert_eq!(m.user["mode"], (libc::S_IFDIR | 0o700).to_string());
    assert_eq!(m.user["uid"], "42");
}

/// A directory whose marker this mount read, listed again by readdirplus once that is out
/// of date: the listing (a common prefix, no metadata) does not replace the marker's mode
/// and owner with defaults, which `stat` of a directory would then show for a whole TTL.
#[tokio::test]
async fn a_listing_keeps_a_known_directorys_attributes() {
    let e = env();
    let mut marker = owned_meta(42, 1_600_000_000);
    marker.insert("mode".into(), (libc::S_IFDIR | 0o750).to_string());
    e.mem.put("d/", bytes::Bytes::new(), &marker).await.unwrap();
    put(&e.mem, "d/f", b"abc").await;
    let d = e.fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    assert_eq!((d.perm, d.uid), (0o750, 42));
    e.fs.refresh(d.ino).unwrap();
    let fh = e.fs.opendir(ROOT_INO).await.unwrap();
    let entries = e.fs.readdir(ROOT_INO, fh, 0).await.unwrap();
    let ent = entries.iter().find(|ent| ent.name == "d").unwrap();
    let (listed, _) = e.fs.plus_entry(ROOT_INO, ent).unwrap();
    e.fs.releasedir(ROOT_INO, fh);
    assert_eq!((listed.perm, listed.uid), (0o750, 42), "readdirplus");
    let a = e.fs.getattr(d.ino).await.unwrap();
    assert_eq!((a.perm, a.uid, a.gid), (0o750, 42, 5678), "stat");
}

/// A chmod of a directory after an entry was made in it keeps the mtime that made it show,
/// not the older one its marker has.
#[tokio::test]
async fn a_chmod_of_a_directory_keeps_its_newer_mtime() {
    let e = env();
    let mut marker = owned_meta(42, 1_600_000_000);
    marker.insert("mode".into(), (libc::S_IFDIR | 0o750).to_string());
    e.mem.put("d/", bytes::Bytes::new(), &marker).await.unwrap();
    let d = e.fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    write_file_in(&e.fs, d.ino, "f", b"x").await;
    let before = e.fs.getattr(d.ino).await.unwrap().mtime;
    let old = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_600_000_000);
    assert!(
        before > old,
        "the new entry did not move the mtime: the test proves nothing"
    );
    let chmod = SetAttr {
        mode: Some(0o700),
        ..Default::default()
    };
    let a = e.fs.setattr(d.ino, None, chmod).await.unwrap();
    // (Stored as decimal seconds: the last nanoseconds may round.)
    let slack = std::time::Duration::from_micros(1);
    assert!(
        a.mtime + slack >= before,
        "mtime went back to {:?} from {before:?}",
        a.mtime
    );
    let stored = e.mem.head("d/").await.unwrap().user["mtime"].clone();
    assert!(
        stored.parse::<f64>().unwrap() > 1_600_000_001.0,
        "stored {stored}"
    );
}

/// A chmod of an empty directory another client removed meanwhile gives ENOENT and does not
/// bring it back; one implied by objects below it gets its marker.
#[tokio::test]
async fn a_chmod_never_brings_back_a_directory_another_client_removed() {
    let e = env();
    e.mem
        .put("d/", bytes::Bytes::new(), &Default::default())
        .await
        .unwrap();
    put(&e.mem, "i/f", b"x").await;
    let d = e.fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    let i = e.fs.lookup(ROOT_INO, OsStr::new("i")).await.unwrap();
    e.mem.delete("d/").await.unwrap();
    let chmod = || SetAttr {
        mode: Some(0o700),
        ..Default::default()
    };
    assert_eq!(
        e.fs.setattr(d.ino, None, chmod()).await.err(),
        Some(FsError::ENOENT)
    );
    assert!(
        e.mem.head("d/").await.is_err(),
        "the removed directory came back"
    );
    let a = e.fs.setattr(i.ino, None, chmod()).await.unwrap();
    assert_eq!(a.perm, 0o700);
    assert!(
        e.mem.head("i/").await.is_ok(),
        "the implied directory got no marker"
    );
}

/// The root of a mount of a prefix keeps its attributes across mounts: a chmod and chown
/// of it store them on the prefix's marker, and the next mount reads them from there (an
/// earlier build stored them and never read them, so every mount showed the defaults; a
/// Kubernetes volume's fsGroup chown of its root was gone at the next mount).
#[tokio::test]
async fn a_prefix_mounts_root_keeps_its_attributes_across_mounts() {
    let mem = Arc::new(MemoryStore::new());
    let cache = tempfile::tempdir().unwrap();
    let prefixed = || FsConfig {
        prefix: "vol/".into(),
        ..config(&cache)
    };
    let fs = Fs::new(mem.clone(), prefixed());
    let set = SetAttr {
        mode: Some(0o2770),
        uid: Some(42),
        gid: Some(43),
        ..Default::default()
    };
    fs.setattr(ROOT_INO, None, set).await.unwrap();
    let a = fs.getattr(ROOT_INO).await.unwrap();
    assert_eq!((a.perm, a.uid, a.gid), (0o2770, 42, 43));
    drop(fs);
    let fs2 = Fs::new(mem.clone(), prefixed());
    let b = fs2.getattr(ROOT_INO).await.unwrap();
    assert_eq!((b.perm, b.uid, b.gid), (0o2770, 42, 43), "after a remount");
    // A marker another client stored is read the same way, and a chmod keeps its owner.
    let mut marker = owned_meta(7, 1_600_000_000);
    marker.insert("mode".into(), (libc::S_IFDIR | 0o750).to_string());
    mem.put("other/", bytes::Bytes::new(), &marker)
        .await
        .unwrap();
    let fs3 = Fs::new(
        mem.clone(),
        FsConfig {
            prefix: "other/".into(),
            ..config(&cache)
        },
    );
    let c = fs3.getattr(ROOT_INO).await.unwrap();
    assert_eq!((c.perm, c.uid), (0o750, 7));
    let chmod = SetAttr {
        mode: Some(0o755),
        ..Default::default()
    };
    let d = fs3.setattr(ROOT_INO, None, chmod).await.unwrap();
    assert_eq!((d.perm, d.uid, d.gid), (0o755, 7, 5678));
}

/// A prefix mount whose first read of its root's marker fails (the store down at mount)
/// reads it again at the next stat of the root, instead of showing the defaults (mode 0755,
/// its own owner: a pod's EACCES) until the next mount.
#[tokio::test]
async fn a_prefix_mounts_root_reads_its_marker_again_after_a_failed_read() {
    use bucketfs_store::fault::{Fault, FaultStore};
    use bucketfs_store::metrics::Op;
    let mem = Arc::new(MemoryStore::new());
    let mut marker = owned_meta(7, 1_600_000_000);
    marker.insert("mode".into(), (libc::S_IFDIR | 0o750).to_string());
    mem.put("vol/", bytes::Bytes::new(), &marker).await.unwrap();
    let faulty = Arc::new(FaultStore::new(mem.clone()));
    let down = bucketfs_store::StoreError::Transient("injected".into());
    faulty.inject(Op::Head, 0, Some(1), Fault::Error(down));
    let cache = tempfile::tempdir().unwrap();
    let fs = Fs::new(
        faulty,
        FsConfig {
            prefix: "vol/".into(),
            ..config(&cache)
        },
    );
    let first = fs.getattr(ROOT_INO).await.unwrap();
    assert_ne!(
        first.uid, 7,
        "the first read did not fail: the test proves nothing"
    );
    let a = fs.getattr(ROOT_INO).await.unwrap();
    assert_eq!((a.perm, a.uid), (0o750, 7));
}

/// HEADs of `vol/` in order: the first fails; the second (a chmod's) waits until the third
/// (a stat's read of the root's marker) is answered, which then waits for `go`.
struct RootHeads {
    inner: Arc<MemoryStore>,
    n: std::sync::atomic::AtomicU32,
    third_answered: tokio::sync::Notify,
    go: tokio::sync::Notify,
}

#[async_trait::async_trait]
impl bucketfs_store::layer::StoreLayer for RootHeads {
    type Inner = MemoryStore;
    fn inner(&self) -> &MemoryStore {
        &self.inner
    }
    async fn head(&self, key: &str) -> bucketfs_store::StoreResult<bucketfs_store::ObjectMeta> {
        if key != "vol/" {
            return self.inner.head(key).await;
        }
        match self.n.fetch_add(1, std::sync::atomic::Ordering::SeqCst) {
            0 => Err(bucketfs_store::StoreError::Transient("injected".into())),
            1 => {
                self.third_answered.notified().await;
                self.inner.head(key).await
            }
            _ => {
                let r = self.inner.head(key).await;
                self.third_answered.notify_one();
                self.go.notified().await;
                r
            }
        }
    }
}

/// A chmod of a prefix mount's root whose first read of the marker failed, racing a stat
/// whose read of it was answered before the chmod stored it: the stat's older answer does
/// not replace what the chmod left (it did in a draft of the retried read: the root then
/// showed the old mode and owner for the rest of the mount).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_read_of_the_roots_marker_never_undoes_a_chmod_of_the_root() {
    let mem = Arc::new(MemoryStore::new());
    let mut marker = owned_meta(7, 1_600_000_000);
    marker.insert("mode".into(), (libc::S_IFDIR | 0o750).to_string());
    mem.put("vol/", bytes::Bytes::new(), &marker).await.unwrap();
    let store = Arc::new(RootHeads {
        inner: mem.clone(),
        n: Default::default(),
        third_answered: Default::default(),
        go: Default::default(),
    });
    let cache = tempfile::tempdir().unwrap();
    let fs = Fs::new(
        store.clone(),
        FsConfig {
            prefix: "vol/".into(),
            ..config(&cache)
        },
    );
    let chmod = SetAttr {
        mode: Some(0o700),
        ..Default::default()
    };
    let setattr = tokio::spawn({
        let fs = fs.clone();
        async move { fs.setattr(ROOT_INO, None, chmod).await }
    });
    while store.n.load(std::sync::atomic::Ordering::SeqCst) < 2 {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let stat = tokio::spawn({
        let fs = fs.clone();
        async move { fs.getattr(ROOT_INO).await }
    });
    let a = setattr.await.unwrap().unwrap();
    assert_eq!((a.perm, a.uid), (0o700, 7));
    store.go.notify_one();
    stat.await.unwrap().unwrap();
    let b = fs.getattr(ROOT_INO).await.unwrap();
    assert_eq!((b.perm, b.uid), (0o700, 7), "after the stat's read");
}

/// A symlink another client points elsewhere (`ln -sfn`, a longer target) reads its new
/// target once the mount learns of the new version (before: the target read first stayed
/// for the inode's life).
#[tokio::test]
async fn a_symlink_another_client_points_elsewhere_reads_its_new_target() {
    let mem = Arc::new(MemoryStore::new());
    let cache = tempfile::tempdir().unwrap();
    let fs = Fs::new(
        mem.clone(),
        FsConfig {
            stat_ttl: std::time::Duration::ZERO,
            ..config(&cache)
        },
    );
    let target = std::path::Path::new("releases/v1");
    let l = fs
        .symlink(ROOT_INO, OsStr::new("ln"), target, ME)
        .await
        .unwrap();
    assert_eq!(&fs.readlink(l.ino).await.unwrap()[..], b"releases/v1");
    let meta = mem.head("ln").await.unwrap().user;
    mem.put(
        "ln",
        bytes::Bytes::from_static(b"releases/version-2"),
        &meta,
    )
    .await
    .unwrap();
    let again = fs.lookup(ROOT_INO, OsStr::new("ln")).await.unwrap();
    assert_eq!(again.ino, l.ino);
    assert_eq!(
        &fs.readlink(l.ino).await.unwrap()[..],
        b"releases/version-2"
    );
}

/// A chmod of a closed file races an open, write and close of it on the same mount: the
/// writer opened while the chmod's copy was in flight took the metadata before it, and its
/// upload (pinned to the ETag, which a copy of a one-part object keeps) landed after the
/// copy with the old mode. chmod had returned 0 and the mode was gone. A writer's open now
/// waits for a metadata change of its file under way, and stores what it made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chmod_racing_a_writers_open_and_close_is_kept() {
    let mem = Arc::new(MemoryStore::new());
    let mut meta = owned_meta(42, 1_600_000_000);
    meta.insert("mode".into(), (libc::S_IFREG | 0o644).to_string());
    mem.put("f", bytes::Bytes::from_static(b"old"), &meta)
        .await
        .unwrap();
    let store = Arc::new(HoldsCopyAnswer {
        inner: mem.clone(),
        key: "f".into(),
        gate: Gate::new(true),
    });
    let cache = tempfile::tempdir().unwrap();
    let fs = Fs::new(store.clone(), config(&cache));
    let a = fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    let chmod = tokio::spawn({
        let fs = fs.clone();
        async move {
            let set = SetAttr {
                mode: Some(0o600),
                ..Default::default()
            };
            fs.setattr(a.ino, None, set).await
        }
    });
    store.gate.reached().await;
    let writer = tokio::spawn({
        let fs = fs.clone();
        async move {
            let h = fs.open(a.ino, libc::O_WRONLY).await?;
            fs.write(a.ino, h.fh, 0, bytes::Bytes::from_static(b"new"))
                .await?;
            fs.flush(a.ino, h.fh).await?;
            fs.release(a.ino, h.fh).await
        }
    });
    // The writer's close lands now, unless its open waits for the chmod.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    store.gate.open();
    chmod.await.unwrap().unwrap();
    writer.await.unwrap().unwrap();
    assert_eq!(object(&mem, "f").await, b"new");
    let m = mem.head("f").await.unwrap();
    assert_eq!(m.user["mode"], (libc::S_IFREG | 0o600).to_string());
    assert_eq!(fs.getattr(a.ino).await.unwrap().perm, 0o600);
}

/// A set-group-ID directory (a shared project directory, 2775 with group `proj`): what is
/// made in it takes its group, and a new directory its set-group-ID bit too. FUSE leaves
/// that to the daemon; files took their creator's group and new directories lost the bit,
/// so the rest of the group was locked out of the subtree.
#[tokio::test]
async fn a_set_group_id_directory_gives_its_group_to_what_is_made_in_it() {
    let e = env();
    let proj =
        e.fs.mkdir(ROOT_INO, OsStr::new("proj"), 0o2775, 0o022, ME)
            .await
            .unwrap();
    let chgrp = SetAttr {
        gid: Some(4242),
        mode: Some(0o2775),
        ..Default::default()
    };
    let p = e.fs.setattr(proj.ino, None, chgrp).await.unwrap();
    assert_eq!((p.gid, p.perm & 0o2000), (4242, 0o2000));
    let (f, h) =
        e.fs.create(proj.ino, OsStr::new("f"), 0o664, 0o022, libc::O_WRONLY, ME)
            .await
            .unwrap();
    e.fs.release(f.ino, h.fh).await.unwrap();
    assert_eq!(f.gid, 4242);
    assert_eq!(
        f.perm & 0o2000,
        0,
        "a file gets no set-group-ID bit of its own"
    );
    let d =
        e.fs.mkdir(proj.ino, OsStr::new("d"), 0o775, 0o022, ME)
            .await
            .unwrap();
    assert_eq!((d.gid, d.perm), (4242, 0o2755));
    let l =
        e.fs.symlink(proj.ino, OsStr::new("l"), std::path::Path::new("f"), ME)
            .await
            .unwrap();
    assert_eq!(l.gid, 4242);
    // Stored so: a later mount sees the same.
    let m = e.mem.head("proj/f").await.unwrap();
    assert_eq!(m.user["gid"], "4242");
    // A plain directory gives nothing.
    let plain =
        e.fs.mkdir(ROOT_INO, OsStr::new("plain"), 0o775, 0o022, ME)
            .await
            .unwrap();
    let (g, h) =
        e.fs.create(plain.ino, OsStr::new("g"), 0o664, 0o022, libc::O_WRONLY, ME)
            .await
            .unwrap();
    e.fs.release(g.ino, h.fh).await.unwrap();
    assert_eq!(g.gid, ME.gid);
}

/// An object marked as a symlink (its mode says so) that holds 8 MiB: readlink fetches no
/// more than the longest target a kernel takes (PATH_MAX) and refuses the rest with
/// `ENAMETOOLONG`. It fetched the whole object (at least), and kept it for the inode's life:
/// a directory of such objects from another client took memory outside every bound.
#[tokio::test]
async fn a_huge_object_marked_as_a_symlink_is_not_fetched_whole() {
    let e = crate::support::env();
    e.fs.symlink(ROOT_INO, OsStr::new("model"), std::path::Path::new("t"), ME)
        .await
        .unwrap();
    let meta = e.mem.head("model").await.unwrap().user;
    e.mem
        .put("ln", bytes::Bytes::from(vec![b'a'; 8 << 20]), &meta)
        .await
        .unwrap();
    let l = e.fs.lookup(ROOT_INO, OsStr::new("ln")).await.unwrap();
    assert_eq!(l.kind, FileKind::Symlink);
    let down = e.metrics.bytes_down();
    let target = e.fs.readlink(l.ino).await.map(|t| t.len());
    assert_eq!(target, Err(FsError(libc::ENAMETOOLONG)));
    assert!(e.metrics.bytes_down() - down <= libc::PATH_MAX as u64);
}

/// A symlink, an `mknod`'d file or a long-named directory made at a name this mount found
/// free replaces nothing another client stored there since: `EEXIST`, their object stays,
/// and the name is asked of the store again.
#[tokio::test]
async fn a_new_entry_never_replaces_an_object_another_client_made_meanwhile() {
    let e = env();
    for name in ["l", "n"] {
        assert_eq!(
            e.fs.lookup(ROOT_INO, OsStr::new(name)).await.unwrap_err(),
            FsError::ENOENT
        );
    }
    let long = "d".repeat(250);
    put(&e.mem, "l", b"precious l").await;
    put(&e.mem, "n", b"precious n").await;
    put(&e.mem, &format!("{long}/"), b"").await;
    let r =
        e.fs.symlink(ROOT_INO, OsStr::new("l"), std::path::Path::new("t"), ME)
            .await;
    assert_eq!(r.unwrap_err(), FsError::EEXIST);
    let r =
        e.fs.mknod(ROOT_INO, OsStr::new("n"), libc::S_IFREG | 0o644, 0, ME)
            .await;
    assert_eq!(r.unwrap_err(), FsError::EEXIST);
    let r = e.fs.mkdir(ROOT_INO, OsStr::new(&long), 0o755, 0, ME).await;
    assert_eq!(r.unwrap_err(), FsError::EEXIST);
    assert_eq!(object(&e.mem, "l").await, b"precious l");
    assert_eq!(object(&e.mem, "n").await, b"precious n");
    // The next lookup finds the other client's file.
    let a = e.fs.lookup(ROOT_INO, OsStr::new("l")).await.unwrap();
    assert_eq!(a.kind, FileKind::File);
    assert_eq!(a.size, 10);
}

/// `--umask` changes what is shown, never what is stored: a utimens of an object another
/// client stored without a mode stores the default mode, not the masked one (before: 0600
/// at `--umask 077`, for every other mount too), and is shown masked.
#[tokio::test]
async fn umask_is_shown_and_never_stored() {
    let e = crate::support::env_with(MemoryStore::new(), |c| FsConfig { umask: 0o077, ..c });
    put(&e.mem, "plain", b"x").await;
    let a = e.fs.lookup(ROOT_INO, OsStr::new("plain")).await.unwrap();
    assert_eq!(a.perm, 0o644 & !0o077);
    let set = SetAttr {
        mtime: Some(std::time::SystemTime::now()),
        ..Default::default()
    };
    let a = e.fs.setattr(a.ino, None, set).await.unwrap();
    assert_eq!(a.perm, 0o600);
    let m = e.mem.head("plain").await.unwrap();
    assert_eq!(m.user["mode"], (libc::S_IFREG | 0o644).to_string());
}

/// A file written here shows one ctime until it changes: the time of the change, not the
/// object's `Last-Modified` once its stat is asked of the store again (the store sets that a
/// moment later). GNU tar compares ctime before and after reading a file: a file written less
/// than T before a `tar` that read it for longer was "changed as we read it" (exit 1). The
/// same after a chmod; another version does take the store's.
#[tokio::test]
async fn a_files_ctime_stays_until_it_changes() {
    let e = crate::support::env_with(MemoryStore::new(), |c| FsConfig {
        stat_ttl: std::time::Duration::ZERO,
        ..c
    });
    let ino = write_file(&e.fs, "f", b"hello").await;
    let ctime = e.fs.getattr(ino).await.unwrap().ctime;
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    let looked = e.fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    assert_eq!(looked.ctime, ctime, "a lookup asking the store");
    assert_eq!(e.fs.getattr(ino).await.unwrap().ctime, ctime, "a getattr");
    let set = SetAttr {
        mode: Some(0o600),
        ..SetAttr::default()
    };
    let chmod = e.fs.setattr(ino, None, set).await.unwrap().ctime;
    assert!(chmod > ctime);
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    let looked = e.fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    assert_eq!(looked.ctime, chmod, "after the chmod");
    // Another client's copy of the same bytes with other metadata (a chmod elsewhere keeps
    // the ETag on some stores): the store's ctime.
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    put(&e.mem, "f", b"hello").await;
    let theirs = e.fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    assert_eq!(theirs.size, 5);
    assert!(theirs.ctime > chmod, "another client's metadata");
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    put(&e.mem, "f", b"theirs").await;
    let theirs2 = e.fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    assert_eq!(theirs2.size, 6);
    assert!(theirs2.ctime > theirs.ctime, "another client's version");
    // A truncate here: the ctime it replied with stays once it is stored.
    let set = SetAttr {
        size: Some(2),
        ..SetAttr::default()
    };
    let cut = e.fs.setattr(ino, None, set).await.unwrap().ctime;
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    let looked = e.fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    assert_eq!((looked.size, looked.ctime), (2, cut), "after the truncate");
    e.fs.forget(ino, 4);
}
