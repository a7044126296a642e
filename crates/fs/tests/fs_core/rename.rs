//! Renames of files and directories, open or being written.

use crate::support::{
    config, env, hidden_keys, list, object, put, random, write_file, write_file_in, write_mib,
    write_open, Gate, ME, MIB,
};
use bucketfs_fs::{Fs, FsConfig, FsError, ROOT_INO};
use bucketfs_store::memory::MemoryStore;
use bucketfs_store::ObjectStore;
use bytes::Bytes;
use std::ffi::OsStr;
use std::sync::Arc;

#[tokio::test]
async fn rename_file_and_directory() {
    let e = env();
    put(&e.mem, "d/a", b"a").await;
    put(&e.mem, "d/sub/b", b"b").await;
    put(&e.mem, "f", b"file").await;
    put(&e.mem, "g", b"old").await;
    e.fs.rename(ROOT_INO, OsStr::new("f"), ROOT_INO, OsStr::new("g"), 0)
        .await
        .unwrap();
    assert_eq!(object(&e.mem, "g").await, b"file");
    assert!(e.mem.head("f").await.is_err());
    let d = e.fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    e.fs.rename(ROOT_INO, OsStr::new("d"), ROOT_INO, OsStr::new("e"), 0)
        .await
        .unwrap();
    let keys = e.mem.keys();
    assert!(keys.contains(&"e/a".to_string()) && keys.contains(&"e/sub/b".to_string()));
    assert!(keys.iter().all(|k| !k.starts_with("d/")));
    // The inode the kernel holds now names the new path.
    let sub = e.fs.lookup(d.ino, OsStr::new("sub")).await.unwrap();
    let b = e.fs.lookup(sub.ino, OsStr::new("b")).await.unwrap();
    assert_eq!(b.size, 1);
    assert_eq!(
        e.fs.rename(ROOT_INO, OsStr::new("g"), ROOT_INO, OsStr::new("e"), 0)
            .await,
        Err(FsError::EISDIR)
    );
    assert_eq!(
        e.fs.rename(
            ROOT_INO,
            OsStr::new("e"),
            ROOT_INO,
            OsStr::new("g"),
            libc::RENAME_NOREPLACE
        )
        .await,
        Err(FsError::EEXIST)
    );
}

#[tokio::test]
async fn directory_rename_limit_gives_exdev() {
    let mem = Arc::new(MemoryStore::new());
    let cache = tempfile::tempdir().unwrap();
    let fs = Fs::new(
        mem.clone(),
        FsConfig {
            max_dir_rename_objects: 3,
            ..config(&cache)
        },
    );
    for i in 0..5 {
        put(&mem, &format!("big/{i}"), b"x").await;
    }
    assert_eq!(
        fs.rename(ROOT_INO, OsStr::new("big"), ROOT_INO, OsStr::new("b2"), 0)
            .await,
        Err(FsError::EXDEV)
    );
    assert_eq!(mem.keys().len(), 5);
}

#[tokio::test]
async fn directory_rename_on_the_local_store_leaves_no_old_directory() {
    let root = tempfile::tempdir().unwrap();
    let local = Arc::new(bucketfs_store::local::LocalStore::open(root.path()).unwrap());
    let cache = tempfile::tempdir().unwrap();
    let fs = Fs::new(local, config(&cache));
    let d = fs
        .mkdir(ROOT_INO, OsStr::new("d"), 0o755, 0, ME)
        .await
        .unwrap();
    let e = fs
        .mkdir(d.ino, OsStr::new("e"), 0o755, 0, ME)
        .await
        .unwrap();
    write_file_in(&fs, e.ino, "f", b"content").await;
    fs.rename(ROOT_INO, OsStr::new("d"), ROOT_INO, OsStr::new("d2"), 0)
        .await
        .unwrap();
    assert!(!root.path().join("d").exists());
    assert_eq!(
        std::fs::read(root.path().join("d2/e/f")).unwrap(),
        b"content"
    );
    assert_eq!(list(&fs, ROOT_INO).await, [".", "..", "d2"]);
}

#[tokio::test]
async fn an_open_file_keeps_reading_after_a_rename() {
    let e = env();
    let data = random(12 * MIB as usize, 50);
    put(&e.mem, "a", &data).await;
    let a = e.fs.lookup(ROOT_INO, OsStr::new("a")).await.unwrap();
    let h = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    let first = e.fs.read(a.ino, h.fh, 0, 1 << 20).await.unwrap();
    assert_eq!(&first[..], &data[..1 << 20]);
    e.fs.rename(ROOT_INO, OsStr::new("a"), ROOT_INO, OsStr::new("b"), 0)
        .await
        .unwrap();
    let later = e.fs.read(a.ino, h.fh, 9 << 20, 1 << 20).await.unwrap();
    assert_eq!(&later[..], &data[9 << 20..10 << 20]);
    e.fs.release(a.ino, h.fh).await.unwrap();
}

/// Rename of a file being written publishes nothing: the old name is gone at once, the
/// file's previous complete object moves to the new name (a new file has none there until
/// close), the upload of the old key is aborted, and close stores the whole file under the
/// new name, streamed parts sent again from their local copies.
#[tokio::test]
async fn rename_of_a_file_being_written_publishes_nothing() {
    let e = env();
    let old = random(3 * MIB as usize, 80);
    put(&e.mem, "a", &old).await;
    put(&e.mem, "taken", b"replaced").await;
    let a = e.fs.lookup(ROOT_INO, OsStr::new("a")).await.unwrap();
    let h =
        e.fs.open(a.ino, libc::O_WRONLY | libc::O_TRUNC)
            .await
            .unwrap();
    let mut data = random(13 * MIB as usize, 81);
    write_mib(&e.fs, a.ino, h.fh, 0, &data).await;
    let (n, nh) = write_open(&e.fs, "n", &random(12 * MIB as usize, 82)).await;
    e.fs.rename(ROOT_INO, OsStr::new("a"), ROOT_INO, OsStr::new("b"), 0)
        .await
        .unwrap();
    e.fs.rename(ROOT_INO, OsStr::new("n"), ROOT_INO, OsStr::new("taken"), 0)
        .await
        .unwrap();
    assert_eq!(e.mem.keys(), ["b"]);
    assert_eq!(object(&e.mem, "b").await, old);
    assert_eq!(e.mem.pending_uploads(), 0);
    let more = random(4 * MIB as usize, 83);
    write_mib(&e.fs, a.ino, h.fh, 13 * MIB, &more).await;
    data.extend_from_slice(&more);
    assert_eq!(object(&e.mem, "b").await, old);
    e.fs.flush(a.ino, h.fh).await.unwrap();
    e.fs.release(a.ino, h.fh).await.unwrap();
    assert_eq!(object(&e.mem, "b").await, data);
    let attr = e.fs.lookup(ROOT_INO, OsStr::new("b")).await.unwrap();
    assert_eq!(attr.size, data.len() as u64);
    e.fs.flush(n, nh).await.unwrap();
    e.fs.release(n, nh).await.unwrap();
    assert_eq!(object(&e.mem, "taken").await, random(12 * MIB as usize, 82));
    assert_eq!(e.mem.keys(), ["b", "taken"]);
    assert_eq!(e.mem.pending_uploads(), 0);
}

/// A directory renamed while files below it are being written publishes none of them: the
/// complete objects move, a file rewritten over one keeps it under the new name until close,
/// and close stores each file complete under its new key.
#[tokio::test]
async fn rename_of_a_directory_with_files_being_written_publishes_nothing() {
    let e = env();
    let old = random(2 * MIB as usize, 84);
    put(&e.mem, "d/old", &old).await;
    let d = e.fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    let o = e.fs.lookup(d.ino, OsStr::new("old")).await.unwrap();
    let oh =
        e.fs.open(o.ino, libc::O_WRONLY | libc::O_TRUNC)
            .await
            .unwrap();
    let rewritten = random(12 * MIB as usize, 85);
    write_mib(&e.fs, o.ino, oh.fh, 0, &rewritten).await;
    let (n, nh) =
        e.fs.create(d.ino, OsStr::new("new"), 0o644, 0, libc::O_WRONLY, ME)
            .await
            .unwrap();
    let fresh = random(11 * MIB as usize, 86);
    write_mib(&e.fs, n.ino, nh.fh, 0, &fresh).await;
    e.fs.rename(ROOT_INO, OsStr::new("d"), ROOT_INO, OsStr::new("e"), 0)
        .await
        .unwrap();
    assert_eq!(e.mem.keys(), ["e/", "e/old"]);
    assert_eq!(object(&e.mem, "e/old").await, old);
    assert_eq!(e.mem.pending_uploads(), 0);
    for (ino, fh) in [(o.ino, oh.fh), (n.ino, nh.fh)] {
        e.fs.flush(ino, fh).await.unwrap();
        e.fs.release(ino, fh).await.unwrap();
    }
    assert_eq!(object(&e.mem, "e/old").await, rewritten);
    assert_eq!(object(&e.mem, "e/new").await, fresh);
    assert_eq!(e.mem.keys(), ["e/", "e/new", "e/old"]);
    assert_eq!(e.mem.pending_uploads(), 0);
}

/// A file renamed over one still open here replaces it for good, as on a local disk (the
/// "write a temp file, rename it over" save): the open file's descriptors keep reading and
/// writing their own bytes, and its last close does not publish them over the new file.
#[tokio::test]
async fn renaming_over_an_open_file_keeps_it_for_its_descriptors() {
    let e = env();
    let mut old = random(3 * MIB as usize, 79);
    put(&e.mem, "cfg", &old).await;
    let a = e.fs.lookup(ROOT_INO, OsStr::new("cfg")).await.unwrap();
    let w = e.fs.open(a.ino, libc::O_RDWR).await.unwrap();
    let r = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    e.fs.write(a.ino, w.fh, 0, Bytes::from_static(b"edit"))
        .await
        .unwrap();
    old[..4].copy_from_slice(b"edit");
    write_file(&e.fs, "cfg.tmp", b"new content").await;
    e.fs.rename(
        ROOT_INO,
        OsStr::new("cfg.tmp"),
        ROOT_INO,
        OsStr::new("cfg"),
        0,
    )
    .await
    .unwrap();
    assert_eq!(object(&e.mem, "cfg").await, b"new content");
    assert_eq!(hidden_keys(&e.mem).len(), 1, "{:?}", e.mem.keys());
    let head = e.fs.read(a.ino, r.fh, 0, MIB as u32).await.unwrap();
    assert_eq!(&head[..], &old[..MIB as usize]);
    e.fs.write(a.ino, w.fh, MIB, Bytes::from_static(b"more"))
        .await
        .unwrap();
    old[MIB as usize..MIB as usize + 4].copy_from_slice(b"more");
    e.fs.flush(a.ino, w.fh).await.unwrap();
    e.fs.release(a.ino, w.fh).await.unwrap();
    for off in [MIB, 2 * MIB] {
        let b = e.fs.read(a.ino, r.fh, off, MIB as u32).await.unwrap();
        assert_eq!(&b[..], &old[off as usize..(off + MIB) as usize], "at {off}");
    }
    e.fs.release(a.ino, r.fh).await.unwrap();
    assert_eq!(e.mem.keys(), vec!["cfg".to_string()]);
    assert_eq!(object(&e.mem, "cfg").await, b"new content");
    let now = e.fs.lookup(ROOT_INO, OsStr::new("cfg")).await.unwrap();
    assert_eq!(now.size, 11);
}

/// An open of a file while this mount renames another over it (the kernel looked the name up
/// before): it waits for the rename to end, then gets `ESTALE` (the kernel looks the name up
/// again and opens the new file), never the file replaced, whose object is the new one's now.
/// The same for an unlink. Before, the open went on, read the new object through the old
/// inode, and got `ESTALE` from its next read once the name was replaced again (the atomic
/// replace a config writer does every 50 ms: 15-60 of 280 reads in 20 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_racing_a_rename_over_its_file_waits_and_gets_estale() {
    use bucketfs_store::fault::Fault;
    use bucketfs_store::metrics::Op;
    use std::time::Duration;
    let mem = Arc::new(MemoryStore::new());
    put(&mem, "cfg", b"old").await;
    let (faulty, fs, _cache) = crate::support::faulty_fs(&mem);
    let a = fs.lookup(ROOT_INO, OsStr::new("cfg")).await.unwrap();
    write_file(&fs, "cfg.tmp", b"new").await;
    // The copy lands, its answer comes 500 ms later.
    faulty.inject(
        Op::Copy,
        0,
        Some(1),
        Fault::DelayAfter(Duration::from_millis(500)),
    );
    let rename = tokio::spawn({
        let fs = fs.clone();
        async move {
            fs.rename(
                ROOT_INO,
                OsStr::new("cfg.tmp"),
                ROOT_INO,
                OsStr::new("cfg"),
                0,
            )
            .await
        }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!rename.is_finished(), "the rename's copy is held");
    let r = fs.open(a.ino, libc::O_RDONLY).await;
    assert!(rename.is_finished(), "the open did not wait for the rename");
    assert_eq!(r.map(|h| h.fh).err(), Some(FsError(libc::ESTALE)));
    rename.await.unwrap().unwrap();
    // The kernel's one try again, if it meets the removal of the next file too, opens what
    // the name holds now.
    let h = fs.open_retried(a.ino, libc::O_RDONLY).await.unwrap();
    assert_eq!(&fs.read(a.ino, h.fh, 0, 10).await.unwrap()[..], b"new");
    fs.release(a.ino, h.fh).await.unwrap();
    let b = fs.lookup(ROOT_INO, OsStr::new("cfg")).await.unwrap();
    assert_ne!(b.ino, a.ino);
    let h = fs.open(b.ino, libc::O_RDONLY).await.unwrap();
    assert_eq!(&fs.read(b.ino, h.fh, 0, 10).await.unwrap()[..], b"new");
    fs.release(b.ino, h.fh).await.unwrap();
    // An unlink: the open waits for its delete.
    faulty.inject(
        Op::Delete,
        0,
        Some(1),
        Fault::DelayAfter(Duration::from_millis(500)),
    );
    let unlink = tokio::spawn({
        let fs = fs.clone();
        async move { fs.unlink(ROOT_INO, OsStr::new("cfg")).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!unlink.is_finished(), "the unlink's delete is held");
    let r = fs.open(b.ino, libc::O_RDONLY).await;
    assert!(unlink.is_finished(), "the open did not wait for the unlink");
    assert_eq!(r.map(|h| h.fh).err(), Some(FsError(libc::ESTALE)));
    unlink.await.unwrap().unwrap();
}

/// A read in flight while a rename over its file moves the file to a hidden name for its
/// descriptors (its GET sent to the old name after the new file took it): read again from the
/// hidden copy, the old bytes. Before, `ESTALE` (the GET's If-Match refused at the old name).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_in_flight_across_a_rename_over_its_file_reads_the_kept_copy() {
    use bucketfs_store::fault::Fault;
    use bucketfs_store::metrics::Op;
    use std::time::Duration;
    let mem = Arc::new(MemoryStore::new());
    put(&mem, "cfg", b"old").await;
    let (faulty, fs, _cache) = crate::support::faulty_fs(&mem);
    let a = fs.lookup(ROOT_INO, OsStr::new("cfg")).await.unwrap();
    let h = fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    write_file(&fs, "cfg.tmp", b"new").await;
    faulty.inject(
        Op::Get,
        0,
        Some(1),
        Fault::Delay(Duration::from_millis(500)),
    );
    let read = tokio::spawn({
        let fs = fs.clone();
        async move { fs.read(a.ino, h.fh, 0, 10).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    fs.rename(
        ROOT_INO,
        OsStr::new("cfg.tmp"),
        ROOT_INO,
        OsStr::new("cfg"),
        0,
    )
    .await
    .unwrap();
    assert_eq!(&read.await.unwrap().unwrap()[..], b"old");
    fs.release(a.ino, h.fh).await.unwrap();
}

/// Another client replaces a file of a directory while the directory is renamed here, after
/// its copy and before its delete: the rename deletes only the version it copied, and the
/// other client's stays under the old name (an earlier build deleted whatever was there).
#[tokio::test]
async fn a_directory_rename_deletes_only_the_versions_it_copied() {
    use bucketfs_store::fault::Fault;
    use bucketfs_store::metrics::Op;
    use std::time::Duration;
    let mem = Arc::new(MemoryStore::new());
    put(&mem, "d/f", b"copied").await;
    let (faulty, fs, _cache) = crate::support::faulty_fs(&mem);
    faulty.inject(
        Op::Delete,
        0,
        Some(1),
        Fault::Delay(Duration::from_millis(300)),
    );
    let other = {
        let mem = mem.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            put(&mem, "d/f", b"the other client's").await;
        })
    };
    fs.rename(ROOT_INO, OsStr::new("d"), ROOT_INO, OsStr::new("d2"), 0)
        .await
        .unwrap();
    other.await.unwrap();
    assert_eq!(object(&mem, "d2/f").await, b"copied");
    assert_eq!(object(&mem, "d/f").await, b"the other client's");
}

/// Another client puts a version of a file while this mount renames it, between the copy
/// and the delete, and this mount reads that version meanwhile: the renamed file is the
/// copy of the version it knew, and the kernel's pages of the other version are not kept
/// for it (an earlier build took them for the copy's bytes); that version stays under the
/// old name.
#[tokio::test]
async fn a_rename_keeps_no_pages_of_a_version_learnt_while_it_copied() {
    use bucketfs_store::fault::Fault;
    use bucketfs_store::metrics::Op;
    use std::time::Duration;
    let mem = Arc::new(MemoryStore::new());
    put(&mem, "a", b"v1v1").await;
    let (faulty, fs, _cache) = crate::support::faulty_fs(&mem);
    let a = fs.lookup(ROOT_INO, OsStr::new("a")).await.unwrap();
    faulty.inject(
        Op::Delete,
        0,
        Some(1),
        Fault::Delay(Duration::from_millis(400)),
    );
    let renaming = {
        let fs = fs.clone();
        tokio::spawn(async move {
            fs.rename(ROOT_INO, OsStr::new("a"), ROOT_INO, OsStr::new("b"), 0)
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    put(&mem, "a", b"v2v2").await;
    fs.refresh(a.ino).unwrap();
    fs.getattr(a.ino).await.unwrap();
    let h = fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    assert_eq!(&fs.read(a.ino, h.fh, 0, 4).await.unwrap()[..], b"v2v2");
    fs.release(a.ino, h.fh).await.unwrap();
    renaming.await.unwrap().unwrap();
    let again = fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    assert!(!again.keep_cache, "pages of v2 kept for the copy of v1");
    assert_eq!(&fs.read(a.ino, again.fh, 0, 4).await.unwrap()[..], b"v1v1");
    fs.release(a.ino, again.fh).await.unwrap();
    assert_eq!(
        object(&mem, "a").await,
        b"v2v2",
        "the other client's version stays"
    );
}

/// A file being written here whose directory is renamed after another client replaced the
/// file: its close is refused (`ESTALE`), as it would be without the rename, and the other
/// client's version stays whole under the new name. An earlier build pointed the writer at
/// whatever a HEAD of the new key found, took the copy of the other client's version for
/// its base and stored this mount's write over it: a version nobody wrote.
#[tokio::test]
async fn a_writer_below_a_renamed_directory_never_builds_on_another_clients_version() {
    let e = env();
    put(&e.mem, "d/f", &[b'a'; 4096]).await;
    let d = e.fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    let f = e.fs.lookup(d.ino, OsStr::new("f")).await.unwrap();
    let h = e.fs.open(f.ino, libc::O_RDWR).await.unwrap();
    e.fs.write(f.ino, h.fh, 0, Bytes::from_static(b"XXXX"))
        .await
        .unwrap();
    put(&e.mem, "d/f", &[b'b'; 4096]).await;
    e.fs.rename(ROOT_INO, OsStr::new("d"), ROOT_INO, OsStr::new("d2"), 0)
        .await
        .unwrap();
    assert_eq!(e.fs.flush(f.ino, h.fh).await, Err(FsError::ESTALE));
    let _ = e.fs.release(f.ino, h.fh).await;
    assert_eq!(object(&e.mem, "d2/f").await, vec![b'b'; 4096]);
}

/// The same with another client's version put under the new name after the rename copied
/// the file (the rename's delete delayed): the writer is pinned to the copy it made, so its
/// close is refused and the other client's version stays.
#[tokio::test]
async fn a_writer_below_a_renamed_directory_never_builds_on_a_version_put_after_the_copy() {
    use bucketfs_store::fault::Fault;
    use bucketfs_store::metrics::Op;
    use std::time::Duration;
    let mem = Arc::new(MemoryStore::new());
    put(&mem, "d/f", &[b'a'; 4096]).await;
    let (faulty, fs, _cache) = crate::support::faulty_fs(&mem);
    let d = fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    let f = fs.lookup(d.ino, OsStr::new("f")).await.unwrap();
    let h = fs.open(f.ino, libc::O_RDWR).await.unwrap();
    fs.write(f.ino, h.fh, 0, Bytes::from_static(b"XXXX"))
        .await
        .unwrap();
    faulty.inject(
        Op::Delete,
        0,
        Some(1),
        Fault::Delay(Duration::from_millis(300)),
    );
    let other = {
        let mem = mem.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            put(&mem, "d2/f", &[b'b'; 4096]).await;
        })
    };
    fs.rename(ROOT_INO, OsStr::new("d"), ROOT_INO, OsStr::new("d2"), 0)
        .await
        .unwrap();
    other.await.unwrap();
    assert_eq!(fs.flush(f.ino, h.fh).await, Err(FsError::ESTALE));
    let _ = fs.release(f.ino, h.fh).await;
    assert_eq!(object(&mem, "d2/f").await, vec![b'b'; 4096]);
}

/// The writer's own version copied by the rename: its close stores its bytes whole under the
/// new name, built on the copy (the guard above must not refuse it). The version is a
/// multipart object, whose copy has another ETag: the writer must take the copy's.
#[tokio::test]
async fn a_writer_below_a_renamed_directory_publishes_over_the_copy_of_its_version() {
    let e = env();
    let d =
        e.fs.mkdir(ROOT_INO, OsStr::new("d"), 0o755, 0, ME)
            .await
            .unwrap();
    let mut want = random(6 * MIB as usize, 41);
    let ino = write_file_in(&e.fs, d.ino, "f", &want).await;
    let etag = e.mem.head("d/f").await.unwrap().etag.unwrap();
    assert!(etag.ends_with("-2\""), "not multipart: {etag}");
    let h = e.fs.open(ino, libc::O_RDWR).await.unwrap();
    e.fs.write(ino, h.fh, 0, Bytes::from_static(b"XXXX"))
        .await
        .unwrap();
    e.fs.rename(ROOT_INO, OsStr::new("d"), ROOT_INO, OsStr::new("d2"), 0)
        .await
        .unwrap();
    e.fs.flush(ino, h.fh).await.unwrap();
    e.fs.release(ino, h.fh).await.unwrap();
    want[..4].copy_from_slice(b"XXXX");
    assert!(object(&e.mem, "d2/f").await == want, "bytes differ");
    assert_eq!(e.mem.keys(), ["d2/", "d2/f"]);
}

/// A directory renamed over an empty one: what the mount had found absent below the
/// replaced directory is not believed below the new one (before: `dst/f` was `ENOENT` for
/// the negative TTL after `mv src dst` brought an `f`).
#[tokio::test]
async fn a_directory_renamed_over_another_forgets_what_was_absent_below_it() {
    let e = env();
    put(&e.mem, "src/f", b"f").await;
    put(&e.mem, "dst/", b"").await;
    let dst = e.fs.lookup(ROOT_INO, OsStr::new("dst")).await.unwrap();
    assert_eq!(
        e.fs.lookup(dst.ino, OsStr::new("f")).await.map(|a| a.ino),
        Err(FsError::ENOENT)
    );
    let src = e.fs.lookup(ROOT_INO, OsStr::new("src")).await.unwrap();
    e.fs.rename(ROOT_INO, OsStr::new("src"), ROOT_INO, OsStr::new("dst"), 0)
        .await
        .unwrap();
    let f = e.fs.lookup(src.ino, OsStr::new("f")).await.unwrap();
    assert_eq!(f.size, 1);
    let dst = e.fs.lookup(ROOT_INO, OsStr::new("dst")).await.unwrap();
    assert_eq!(
        e.fs.lookup(dst.ino, OsStr::new("f")).await.unwrap().ino,
        f.ino
    );
}

/// Holds this mount's PUTs of `key` at its gate.
struct HoldsPut {
    inner: std::sync::Arc<bucketfs_store::memory::MemoryStore>,
    key: String,
    gate: Gate,
}

#[async_trait::async_trait]
impl bucketfs_store::layer::StoreLayer for HoldsPut {
    type Inner = bucketfs_store::memory::MemoryStore;
    fn inner(&self) -> &Self::Inner {
        &self.inner
    }
    async fn put_if(
        &self,
        key: &str,
        body: bytes::Bytes,
        meta: &bucketfs_store::UserMeta,
        if_match: Option<&str>,
        headers_from: Option<bucketfs_store::HeadersFrom<'_>>,
    ) -> bucketfs_store::StoreResult<String> {
        self.gate.pass(key == self.key).await;
        self.inner
            .put_if(key, body, meta, if_match, headers_from)
            .await
    }
}

/// A rename over a file whose last release is still publishing (its writes came through a
/// descriptor whose flush did not store them: an inherited one, or mmap): the rename did not
/// see the file open, copied its source over it, and the release's PUT landed after the copy:
/// the renamed file was lost. The rename waits for that publish and replaces what it stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rename_over_a_file_whose_release_is_publishing_keeps_the_renamed_file() {
    let mem = std::sync::Arc::new(bucketfs_store::memory::MemoryStore::new());
    put(&mem, "t", b"old").await;
    put(&mem, "x", b"renamed").await;
    let store = std::sync::Arc::new(HoldsPut {
        inner: mem.clone(),
        key: "t".into(),
        gate: Gate::new(false),
    });
    let cache = tempfile::tempdir().unwrap();
    let fs = bucketfs_fs::Fs::new(store.clone(), crate::support::config(&cache));
    let t = fs.lookup(ROOT_INO, OsStr::new("t")).await.unwrap();
    fs.lookup(ROOT_INO, OsStr::new("x")).await.unwrap();
    let h = fs
        .open(t.ino, libc::O_WRONLY | libc::O_TRUNC)
        .await
        .unwrap();
    fs.write(t.ino, h.fh, 0, bytes::Bytes::from_static(b"mine"))
        .await
        .unwrap();
    store.gate.arm();
    let release = tokio::spawn({
        let fs = fs.clone();
        async move { fs.release(t.ino, h.fh).await }
    });
    store.gate.reached().await;
    let rename = tokio::spawn({
        let fs = fs.clone();
        async move {
            fs.rename(ROOT_INO, OsStr::new("x"), ROOT_INO, OsStr::new("t"), 0)
                .await
        }
    });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    store.gate.open();
    release.await.unwrap().unwrap();
    rename.await.unwrap().unwrap();
    assert_eq!(object(&mem, "t").await, b"renamed");
    assert!(mem.head("x").await.is_err());
}

/// `RENAME_WHITEOUT` (overlayfs asks it of its upper layer) was taken for a plain rename: the
/// source went and no whiteout was left, so the lower layer's file showed through again. It
/// is refused, as `RENAME_EXCHANGE` is, and nothing moves.
#[tokio::test]
async fn a_rename_asking_for_a_whiteout_is_refused() {
    let e = env();
    put(&e.mem, "a", b"a").await;
    e.fs.lookup(ROOT_INO, OsStr::new("a")).await.unwrap();
    let r =
        e.fs.rename(
            ROOT_INO,
            OsStr::new("a"),
            ROOT_INO,
            OsStr::new("b"),
            libc::RENAME_WHITEOUT,
        )
        .await;
    assert_eq!(r, Err(FsError::EINVAL));
    assert_eq!(object(&e.mem, "a").await, b"a");
    assert!(e.mem.head("b").await.is_err());
}

/// A directory renamed to a longer name under which a key below it would pass S3's 1,024
/// bytes: `ENAMETOOLONG` before anything moves (before: the copies went until the store
/// refused one, `EINVAL`, leaving part of the tree at each name on MinIO).
#[tokio::test]
async fn a_directory_rename_that_would_make_a_key_too_long_moves_nothing() {
    let e = env();
    let long = |c: char| c.to_string().repeat(250);
    let deep = format!("a/{}/{}/{}/", long('p'), long('q'), long('r'));
    let file = format!("{deep}{}", "f".repeat(1010 - deep.len()));
    assert_eq!(file.len(), 1010);
    put(&e.mem, &file, b"x").await;
    put(&e.mem, "a/short", b"y").await;
    e.fs.lookup(ROOT_INO, OsStr::new("a")).await.unwrap();
    let longer = "b".repeat(20);
    assert_eq!(
        e.fs.rename(ROOT_INO, OsStr::new("a"), ROOT_INO, OsStr::new(&longer), 0)
            .await,
        Err(FsError::ENAMETOOLONG)
    );
    let mut keys = e.mem.keys();
    keys.sort();
    assert_eq!(keys, vec![file.clone(), "a/short".to_string()]);
    // A new name as long as the old one fits.
    e.fs.rename(ROOT_INO, OsStr::new("a"), ROOT_INO, OsStr::new("c"), 0)
        .await
        .unwrap();
    assert_eq!(object(&e.mem, &format!("c{}", &file[1..])).await, b"x");
}

/// A lookup of `x` in directory `a` whose answer (found) comes back after a rename of `a`
/// to `b` finished: the inode it registers is `b/x`, not the old path `a/x` (it was: a write
/// through it stored under `a/x`, bringing the old directory back, and `b/x` kept the old
/// bytes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lookup_answered_after_a_rename_of_its_directory_registers_the_new_path() {
    use bucketfs_store::fault::Fault;
    use bucketfs_store::metrics::Op;
    let mem = Arc::new(MemoryStore::new());
    put(&mem, "a/x", b"old").await;
    let (faulty, fs, _cache) = crate::support::faulty_fs(&mem);
    let a = fs.lookup(ROOT_INO, OsStr::new("a")).await.unwrap();
    // The lookup's HEAD of a/x happens at once, its answer comes 500 ms later.
    faulty.inject(
        Op::Head,
        0,
        Some(1),
        Fault::DelayAfter(std::time::Duration::from_millis(500)),
    );
    let looking = {
        let fs = fs.clone();
        tokio::spawn(async move { fs.lookup(a.ino, OsStr::new("x")).await })
    };
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    fs.rename(ROOT_INO, OsStr::new("a"), ROOT_INO, OsStr::new("b"), 0)
        .await
        .unwrap();
    assert_eq!(object(&mem, "b/x").await, b"old");
    let x = looking.await.unwrap().unwrap();
    let h = fs
        .open(x.ino, libc::O_WRONLY | libc::O_TRUNC)
        .await
        .unwrap();
    fs.write(x.ino, h.fh, 0, Bytes::from_static(b"new"))
        .await
        .unwrap();
    fs.flush(x.ino, h.fh).await.unwrap();
    fs.release(x.ino, h.fh).await.unwrap();
    assert_eq!(object(&mem, "b/x").await, b"new");
    assert!(
        mem.head("a/x").await.is_err(),
        "the write went to the old path"
    );
}

/// A lookup whose store answer comes after this mount changed the file (a truncate that
/// stored a new version) does not put the older answer on the inode: the size stays the
/// truncate's, and an append builds on the version the truncate stored (before: the old
/// ETag and size came back, believed for the TTL, and the append's close was `ESTALE`).
#[tokio::test]
async fn a_lookup_answered_after_a_change_here_keeps_the_change() {
    use bucketfs_fs::SetAttr;
    use bucketfs_store::fault::Fault;
    use bucketfs_store::metrics::Op;
    let mem = Arc::new(MemoryStore::new());
    put(&mem, "f", b"old").await;
    let (faulty, fs, _cache) = crate::support::faulty_fs(&mem);
    let f = fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    // Older than the TTL: the next lookup asks the store.
    fs.refresh(f.ino).unwrap();
    faulty.inject(
        Op::Head,
        0,
        Some(1),
        Fault::DelayAfter(std::time::Duration::from_millis(500)),
    );
    let looking = {
        let fs = fs.clone();
        tokio::spawn(async move { fs.lookup(ROOT_INO, OsStr::new("f")).await })
    };
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let set = SetAttr {
        size: Some(10),
        ..Default::default()
    };
    fs.setattr(f.ino, None, set).await.unwrap();
    let seen = looking.await.unwrap().unwrap();
    assert_eq!(seen.size, 10, "the lookup's answer predates the truncate");
    assert_eq!(fs.getattr(f.ino).await.unwrap().size, 10);
    let h = fs.open(f.ino, libc::O_WRONLY).await.unwrap();
    fs.write(f.ino, h.fh, 10, Bytes::from_static(b"x"))
        .await
        .unwrap();
    assert_eq!(fs.flush(f.ino, h.fh).await, Ok(()));
    fs.release(f.ino, h.fh).await.unwrap();
    assert_eq!(object(&mem, "f").await, b"old\0\0\0\0\0\0\0x");
}

/// A rename whose copy, pinned to the version this mount knew, is answered after another
/// client replaced the object and this mount learnt that (an open read it): the renamed
/// file names the copy of the version before, so the descriptor that read the other
/// client's version stops (`ESTALE`) instead of reading on from the copy, and `stat` shows
/// the copy's size. Before: it read on (here: an early end of file), and the size was the
/// other version's.
#[tokio::test]
async fn a_rename_copying_the_version_before_one_learnt_meanwhile_stops_its_readers() {
    use bucketfs_store::fault::Fault;
    use bucketfs_store::metrics::Op;
    use std::time::Duration;
    let mem = Arc::new(MemoryStore::new());
    put(&mem, "a", b"v1v1").await;
    let (faulty, fs, _cache) = crate::support::faulty_fs_with(&mem, |c| FsConfig {
        stat_ttl: Duration::ZERO,
        ..c
    });
    let a = fs.lookup(ROOT_INO, OsStr::new("a")).await.unwrap();
    faulty.inject(
        Op::Copy,
        0,
        Some(1),
        Fault::DelayAfter(Duration::from_millis(500)),
    );
    let renaming = tokio::spawn({
        let fs = fs.clone();
        async move {
            fs.rename(ROOT_INO, OsStr::new("a"), ROOT_INO, OsStr::new("b"), 0)
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    put(&mem, "a", b"v2v2v2v2").await;
    let h = fs
        .open(a.ino, libc::O_RDONLY | libc::O_DIRECT)
        .await
        .unwrap();
    assert_eq!(&fs.read(a.ino, h.fh, 0, 4).await.unwrap()[..], b"v2v2");
    renaming.await.unwrap().unwrap();
    assert_eq!(object(&mem, "b").await, b"v1v1");
    let r = fs.read(a.ino, h.fh, 4, 4).await;
    assert_eq!(
        r,
        Err(FsError(libc::ESTALE)),
        "read on after v2 from the copy of v1"
    );
    fs.release(a.ino, h.fh).await.unwrap();
    assert_eq!(fs.getattr(a.ino).await.unwrap().size, 4);
}

/// A rename waiting for a version this mount is storing (an `fsync` under way, as logrotate
/// renames a log its writer syncs) copies that version: no other client's change, so a
/// reader of the file reads on, the file as it is now. (The check for another client's
/// version learnt meanwhile must not take this mount's own new version for one.)
#[tokio::test]
async fn a_rename_waiting_for_this_mounts_own_store_keeps_its_readers_reading() {
    use bucketfs_store::fault::{Fault, FaultStore};
    use bucketfs_store::metrics::Op;
    use std::time::Duration;
    let mem = Arc::new(MemoryStore::new());
    put(&mem, "log", b"one ").await;
    let faulty = Arc::new(FaultStore::new(mem.clone()));
    let cache = tempfile::tempdir().unwrap();
    let fs = Fs::new(faulty.clone(), config(&cache));
    let a = fs.lookup(ROOT_INO, OsStr::new("log")).await.unwrap();
    let w = fs
        .open(a.ino, libc::O_WRONLY | libc::O_APPEND)
        .await
        .unwrap();
    let r = fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    assert_eq!(&fs.read(a.ino, r.fh, 0, 4).await.unwrap()[..], b"one ");
    fs.write(a.ino, w.fh, 4, Bytes::from_static(b"two "))
        .await
        .unwrap();
    faulty.inject(
        Op::Put,
        0,
        Some(1),
        Fault::Delay(Duration::from_millis(500)),
    );
    let syncing = tokio::spawn({
        let fs = fs.clone();
        async move { fs.fsync(a.ino, w.fh).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    fs.rename(
        ROOT_INO,
        OsStr::new("log"),
        ROOT_INO,
        OsStr::new("log.1"),
        0,
    )
    .await
    .unwrap();
    syncing.await.unwrap().unwrap();
    assert_eq!(object(&mem, "log.1").await, b"one two ");
    assert_eq!(&fs.read(a.ino, r.fh, 4, 4).await.unwrap()[..], b"two ");
    for h in [r, w] {
        fs.release(a.ino, h.fh).await.unwrap();
    }
}

/// `mv dir dir.bak; mkdir dir; mv dir.bak/file dir/`: the file is back at the path it was
/// first numbered at, below a directory numbered afresh. It keeps its number after the kernel
/// forgets it (drop_caches; before: a hash of the new directory's origin and its name), and a
/// file made anew at `dir.bak/file` while it is forgotten takes another (before: the moved
/// file's).
#[tokio::test]
async fn a_file_moved_into_a_directory_made_where_its_own_was_keeps_its_number() {
    let e = env();
    let dir =
        e.fs.mkdir(ROOT_INO, OsStr::new("dir"), 0o755, 0, ME)
            .await
            .unwrap()
            .ino;
    let file = write_file_in(&e.fs, dir, "file", b"1").await;
    e.fs.rename(
        ROOT_INO,
        OsStr::new("dir"),
        ROOT_INO,
        OsStr::new("dir.bak"),
        0,
    )
    .await
    .unwrap();
    let new_dir =
        e.fs.mkdir(ROOT_INO, OsStr::new("dir"), 0o755, 0, ME)
            .await
            .unwrap()
            .ino;
    assert_ne!(new_dir, dir, "the new dir took the renamed one's number");
    e.fs.rename(dir, OsStr::new("file"), new_dir, OsStr::new("file"), 0)
        .await
        .unwrap();
    let moved = e.fs.lookup(new_dir, OsStr::new("file")).await.unwrap();
    assert_eq!(moved.ino, file);
    // drop_caches: the kernel forgets every inode (create's lookup and this one for the file,
    // mkdir's for each directory).
    let base = e.fs.inode_count();
    e.fs.forget(file, 2);
    e.fs.forget(new_dir, 1);
    e.fs.forget(dir, 1);
    assert_eq!(e.fs.inode_count(), base - 3, "all forgotten");
    let d = e.fs.lookup(ROOT_INO, OsStr::new("dir")).await.unwrap().ino;
    assert_eq!(d, new_dir);
    let again = e.fs.lookup(d, OsStr::new("file")).await.unwrap().ino;
    assert_eq!(again, file, "the moved file changed number after a forget");
    e.fs.forget(again, 1);
    // Forgotten again: a new file where the moved one was takes a number of its own.
    let bak =
        e.fs.lookup(ROOT_INO, OsStr::new("dir.bak"))
            .await
            .unwrap()
            .ino;
    assert_eq!(bak, dir);
    let other = write_file_in(&e.fs, bak, "file", b"2").await;
    assert_ne!(
        other, file,
        "a new dir.bak/file took the moved file's number"
    );
    let again = e.fs.lookup(d, OsStr::new("file")).await.unwrap().ino;
    assert_eq!(again, file);
    for ino in [again, d, other, bak] {
        e.fs.forget(ino, 1);
    }
}
