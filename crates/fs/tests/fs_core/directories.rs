//! Directories, listings and lookups: markers, prefixes, statahead, readdirplus, request counts.

use crate::support::{
    config, env, env_on, env_with, faulty_fs, list, object, put, random, write_file, write_file_in,
    Env, ME,
};
use bucketfs_fs::{FileKind, Fs, FsConfig, FsError, SetAttr, ROOT_INO};
use bucketfs_store::fault::Fault;
use bucketfs_store::memory::MemoryStore;
use bucketfs_store::metrics::Op;
use bucketfs_store::ObjectStore;
use bucketfs_store::{ListDetail, ListFrom, ListPage, StoreError, UserMeta};
use bytes::Bytes;
use std::ffi::OsStr;
use std::sync::Arc;
use std::time::Duration;

/// s3fs-style metadata of a file with permissions `perm` and mtime `secs`.
fn file_meta(perm: u32, secs: u64) -> UserMeta {
    [
        ("mode", (libc::S_IFREG | perm).to_string()),
        ("uid", "1234".to_string()),
        ("gid", "5678".to_string()),
        ("mtime", secs.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

#[tokio::test]
async fn directories_markers_and_implied_prefixes() {
    let e = env();
    put(&e.mem, "implied/x/y.txt", b"y").await;
    put(&e.mem, "top.txt", b"top").await;
    let d =
        e.fs.mkdir(ROOT_INO, OsStr::new("made"), 0o750, 0, ME)
            .await
            .unwrap();
    assert_eq!(d.kind, FileKind::Dir);
    // The marker goes up in the background; fsync of the parent waits for it.
    e.fs.fsyncdir(ROOT_INO).await.unwrap();
    let m = e.mem.head("made/").await.unwrap();
    assert_eq!(m.user["mode"], (libc::S_IFDIR | 0o750).to_string());
    let (f, h) =
        e.fs.create(d.ino, OsStr::new("new"), 0o600, 0, libc::O_WRONLY, ME)
            .await
            .unwrap();
    // Not uploaded yet, but listed.
    let names = list(&e.fs, d.ino).await;
    assert_eq!(names, [".", "..", "new"]);
    assert_eq!(
        e.fs.rmdir(ROOT_INO, OsStr::new("made")).await,
        Err(FsError::ENOTEMPTY)
    );
    e.fs.flush(f.ino, h.fh).await.unwrap();
    e.fs.release(f.ino, h.fh).await.unwrap();
    assert!(e.mem.head("made/new").await.is_ok());

    let root = list(&e.fs, ROOT_INO).await;
    assert_eq!(root, [".", "..", "implied", "made", "top.txt"]);
    let i = e.fs.lookup(ROOT_INO, OsStr::new("implied")).await.unwrap();
    assert_eq!(i.kind, FileKind::Dir);
    let x = e.fs.lookup(i.ino, OsStr::new("x")).await.unwrap();
    let y = e.fs.lookup(x.ino, OsStr::new("y.txt")).await.unwrap();
    assert_eq!((y.kind, y.size), (FileKind::File, 1));

    e.fs.unlink(d.ino, OsStr::new("new")).await.unwrap();
    e.fs.rmdir(ROOT_INO, OsStr::new("made")).await.unwrap();
    assert!(e.mem.keys().iter().all(|k| !k.starts_with("made")));
    assert_eq!(
        e.fs.lookup(ROOT_INO, OsStr::new("made")).await,
        Err(FsError::ENOENT)
    );
}

/// mkdir answers before its marker is stored; whatever needs the marker waits for it, and a
/// marker that could not be stored is reported (EIO) and sent again, never lost silently.
#[tokio::test]
async fn directory_markers_go_up_in_the_background_and_failures_are_reported() {
    let mem = Arc::new(MemoryStore::new());
    let (faulty, fs, _cache) = faulty_fs(&mem);
    let slow = std::time::Duration::from_millis(300);
    faulty.inject(Op::Put, 0, Some(1), Fault::Delay(slow));
    let t0 = std::time::Instant::now();
    let a = fs
        .mkdir(ROOT_INO, OsStr::new("a"), 0o755, 0, ME)
        .await
        .unwrap();
    assert!(t0.elapsed() < slow, "mkdir waited for its marker");
    assert!(mem.head("a/").await.is_err(), "not up yet");
    // A listing of the parent shows it from the bucket: it waits for the marker.
    let fh = fs.opendir(ROOT_INO).await.unwrap();
    let names: Vec<String> = fs
        .readdir(ROOT_INO, fh, 0)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert!(names.contains(&"a".to_string()), "{names:?}");
    assert!(mem.head("a/").await.is_ok());

    // A marker that cannot be stored: mkdir still succeeds, fsync of the parent says EIO.
    let down = || Fault::Error(StoreError::Transient("connection refused".into()));
    faulty.inject(Op::Put, 0, Some(2), down());
    let b = fs
        .mkdir(a.ino, OsStr::new("b"), 0o700, 0, ME)
        .await
        .unwrap();
    assert_eq!(fs.fsyncdir(a.ino).await, Err(FsError::EIO));
    // The next fsync sends it again (the second injected failure), and then once the store is
    // back it lands, with its mode.
    assert_eq!(fs.fsyncdir(a.ino).await, Err(FsError::EIO));
    fs.fsyncdir(a.ino).await.unwrap();
    let m = mem.head("a/b/").await.unwrap();
    assert_eq!(m.user["mode"], (libc::S_IFDIR | 0o700).to_string());

    // rmdir of a directory whose marker is still in flight: the DELETE comes after the PUT,
    // so no marker is left behind.
    faulty.inject(Op::Put, 0, Some(1), Fault::Delay(slow));
    fs.mkdir(b.ino, OsStr::new("c"), 0o755, 0, ME)
        .await
        .unwrap();
    fs.rmdir(b.ino, OsStr::new("c")).await.unwrap();
    tokio::time::sleep(slow).await;
    assert!(mem.head("a/b/c/").await.is_err(), "marker resurrected");

    // A directory whose new subdirectory's marker is still in flight is not empty.
    faulty.inject(Op::Put, 0, Some(2), Fault::Delay(slow));
    let e = fs
        .mkdir(b.ino, OsStr::new("e"), 0o755, 0, ME)
        .await
        .unwrap();
    fs.mkdir(e.ino, OsStr::new("sub"), 0o755, 0, ME)
        .await
        .unwrap();
    assert_eq!(
        fs.rmdir(b.ino, OsStr::new("e")).await,
        Err(FsError::ENOTEMPTY)
    );

    // Unmount (shutdown) stores every marker still pending.
    faulty.inject(Op::Put, 0, Some(1), Fault::Delay(slow));
    fs.mkdir(b.ino, OsStr::new("d"), 0o755, 0, ME)
        .await
        .unwrap();
    assert_eq!(fs.shutdown().await, 0);
    assert!(mem.head("a/b/d/").await.is_ok());
}

#[tokio::test]
async fn prefix_mount_sees_only_its_prefix() {
    let mem = Arc::new(MemoryStore::new());
    put(&mem, "outside", b"o").await;
    put(&mem, "p/q/inside", b"i").await;
    let cache = tempfile::tempdir().unwrap();
    let fs = Fs::new(
        mem.clone(),
        FsConfig {
            prefix: "p/q/".into(),
            ..config(&cache)
        },
    );
    assert_eq!(list(&fs, ROOT_INO).await, [".", "..", "inside"]);
    write_file(&fs, "new", b"n").await;
    assert!(mem.head("p/q/new").await.is_ok());
}

#[tokio::test]
async fn ls_l_costs_one_list_and_one_head_per_file_with_statahead() {
    let e = env();
    for i in 0..300 {
        put(&e.mem, &format!("d/f{i:04}"), b"x").await;
    }
    let before = (e.metrics.requests(Op::List), e.metrics.requests(Op::Head));
    let d = e.fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    let names = list(&e.fs, d.ino).await;
    assert_eq!(names.len(), 302);
    // The lookup's LIST fetched the page the listing then used.
    assert_eq!(e.metrics.requests(Op::List) - before.0, 1);
    let before = (before.0, e.metrics.requests(Op::Head));
    // Stat every entry in order, as ls -l does.
    for n in &names[2..] {
        let a = e.fs.lookup(d.ino, OsStr::new(n)).await.unwrap();
        assert_eq!(a.size, 1);
    }
    // No LIST per file, one HEAD per file (statahead fetched most of them in the background).
    assert_eq!(e.metrics.requests(Op::List) - before.0, 1);
    let heads = e.metrics.requests(Op::Head) - before.1;
    assert!((300..=310).contains(&heads), "{heads} HEADs for 300 files");
    // Names the listing does not have are answered without a request.
    let total = e.metrics.total_requests();
    assert_eq!(
        e.fs.lookup(d.ino, OsStr::new("missing")).await,
        Err(FsError::ENOENT)
    );
    assert_eq!(e.metrics.total_requests(), total);
}

#[tokio::test]
async fn ls_l_with_metadata_in_the_listing_sends_no_head() {
    let e = env_on(MemoryStore::with_list_metadata());
    let t0 = 1_600_000_000u64;
    for i in 0..300u32 {
        let meta = file_meta(0o600 + (i % 64), t0 + i as u64);
        e.mem
            .put(&format!("d/f{i:04}"), Bytes::from_static(b"xy"), &meta)
            .await
            .unwrap();
    }
    let link: UserMeta = [("mode".to_string(), (libc::S_IFLNK | 0o777).to_string())].into();
    e.mem
        .put("d/link", Bytes::from_static(b"f0000"), &link)
        .await
        .unwrap();
    put(&e.mem, "d/plain", b"foreign").await; // no metadata at all
    let marker: UserMeta = [("mode".to_string(), (libc::S_IFDIR | 0o710).to_string())].into();
    e.mem.put("d/sub/", Bytes::new(), &marker).await.unwrap();
    put(&e.mem, "d/sub/inner", b"").await;

    let d = e.fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    assert_eq!(e.metrics.requests(Op::List), 1);
    let before = e.metrics.total_requests();
    let heads = e.metrics.requests(Op::Head);
    let fh = e.fs.opendir(d.ino).await.unwrap();
    let entries = e.fs.readdir(d.ino, fh, 0).await.unwrap();
    e.fs.releasedir(d.ino, fh);
    assert_eq!(entries.len(), 2 + 303);
    // The kind of a symlink shows in the listing itself.
    let kind = |n: &str| entries.iter().find(|e| e.name == n).unwrap().kind;
    assert_eq!(kind("link"), FileKind::Symlink);
    assert_eq!(kind("f0007"), FileKind::File);
    assert_eq!(kind("sub"), FileKind::Dir);
    // The listing's page came with the lookup of d.
    assert_eq!(e.metrics.requests(Op::List), 1);
    // Stat every file as ls -l does: all from the listing, no HEAD.
    for i in 0..300u32 {
        let a =
            e.fs.lookup(d.ino, OsStr::new(&format!("f{i:04}")))
                .await
                .unwrap();
        assert_eq!(a.kind, FileKind::File);
        assert_eq!(a.size, 2);
        assert_eq!(a.perm as u32, 0o600 + (i % 64), "f{i:04}");
        assert_eq!((a.uid, a.gid), (1234, 5678));
        assert_eq!(
            a.mtime,
            std::time::UNIX_EPOCH + std::time::Duration::from_secs(t0 + i as u64)
        );
    }
    let l = e.fs.lookup(d.ino, OsStr::new("link")).await.unwrap();
    assert_eq!(l.kind, FileKind::Symlink);
    let p = e.fs.lookup(d.ino, OsStr::new("plain")).await.unwrap();
    assert_eq!((p.kind, p.perm), (FileKind::File, 0o644));
    assert_eq!(
        e.metrics.total_requests() - before,
        0,
        "the lookup's LIST was all"
    );
    assert_eq!(e.metrics.requests(Op::Head), heads);
    // A listed subdirectory costs one LIST, which also carries its marker's metadata.
    let s = e.fs.lookup(d.ino, OsStr::new("sub")).await.unwrap();
    assert_eq!((s.kind, s.perm), (FileKind::Dir, 0o710));
    assert_eq!(e.metrics.total_requests() - before, 1);
    assert_eq!(e.metrics.requests(Op::Head), heads);
    // The target of a symlink is its body: one GET.
    assert_eq!(&e.fs.readlink(l.ino).await.unwrap()[..], b"f0000");
    assert_eq!(e.metrics.requests(Op::Get), 1);
}

#[tokio::test]
async fn walks_that_stat_no_file_list_without_metadata_until_files_are_stat_ed() {
    let e = env_on(MemoryStore::with_list_metadata());
    for d in 0..6 {
        for i in 0..100 {
            e.mem
                .put(
                    &format!("d{d}/f{i:03}"),
                    Bytes::from_static(b"x"),
                    &file_meta(0o640, 1_600_000_000),
                )
                .await
                .unwrap();
        }
    }
    let mut dirs = Vec::new();
    for d in 0..5 {
        let a =
            e.fs.lookup(ROOT_INO, OsStr::new(&format!("d{d}")))
                .await
                .unwrap();
        // A walk like `find`: the directory is listed, its files are not stat'ed.
        assert_eq!(list(&e.fs, a.ino).await.len(), 102);
        dirs.push(a.ino);
    }
    let stat_all = |ino: u64| {
        let fs = e.fs.clone();
        async move {
            for i in 0..100 {
                let a = fs
                    .lookup(ino, OsStr::new(&format!("f{i:03}")))
                    .await
                    .unwrap();
                assert_eq!(a.perm, 0o640);
            }
        }
    };
    // The first directory was listed with metadata; after its 100 unused entries the others
    // were listed without, so their files need a HEAD each (statahead).
    let heads = e.metrics.requests(Op::Head);
    stat_all(dirs[4]).await;
    let after = e.metrics.requests(Op::Head);
    assert!(after - heads >= 100, "{} HEADs", after - heads);
    stat_all(dirs[0]).await;
    assert_eq!(e.metrics.requests(Op::Head), after);
    // Listed files were stat'ed: the next listing carries the metadata again.
    let d5 = e.fs.lookup(ROOT_INO, OsStr::new("d5")).await.unwrap();
    let after = e.metrics.requests(Op::Head);
    assert_eq!(list(&e.fs, d5.ino).await.len(), 102);
    stat_all(d5.ino).await;
    assert_eq!(e.metrics.requests(Op::Head), after);
}

#[tokio::test]
async fn listed_subdirectories_cost_no_head_of_the_name() {
    // A store whose listings have no metadata: the subdirectory's marker needs a HEAD, but
    // the name itself (which the listing says is a directory) is not HEADed as a file.
    let e = env();
    let marker: UserMeta = [("mode".to_string(), (libc::S_IFDIR | 0o750).to_string())].into();
    e.mem.put("sub/", Bytes::new(), &marker).await.unwrap();
    put(&e.mem, "implied/x", b"").await;
    let names = list(&e.fs, ROOT_INO).await;
    assert_eq!(names, [".", "..", "implied", "sub"]);
    let before = (e.metrics.requests(Op::List), e.metrics.requests(Op::Head));
    let s = e.fs.lookup(ROOT_INO, OsStr::new("sub")).await.unwrap();
    assert_eq!((s.kind, s.perm), (FileKind::Dir, 0o750));
    let i = e.fs.lookup(ROOT_INO, OsStr::new("implied")).await.unwrap();
    assert_eq!((i.kind, i.perm), (FileKind::Dir, 0o755));
    assert_eq!(e.metrics.requests(Op::List) - before.0, 2);
    assert_eq!(
        e.metrics.requests(Op::Head) - before.1,
        1,
        "the marker of sub"
    );
}

#[tokio::test]
async fn a_listed_directory_that_became_a_file_is_found() {
    let e = env();
    put(&e.mem, "x/y", b"").await;
    assert_eq!(list(&e.fs, ROOT_INO).await, [".", "..", "x"]);
    // Another client replaces the directory with a file before the stat.
    e.mem.delete("x/y").await.unwrap();
    put(&e.mem, "x", b"now a file").await;
    let a = e.fs.lookup(ROOT_INO, OsStr::new("x")).await.unwrap();
    assert_eq!((a.kind, a.size), (FileKind::File, 10));
}

#[tokio::test]
async fn creating_files_in_a_new_directory_sends_only_puts() {
    let e = env();
    let d =
        e.fs.mkdir(ROOT_INO, OsStr::new("new"), 0o755, 0, ME)
            .await
            .unwrap();
    e.fs.fsyncdir(ROOT_INO).await.unwrap();
    let before = e.metrics.total_requests();
    for i in 0..100 {
        let name = format!("f{i}");
        // The kernel looks a name up before creating it.
        assert_eq!(
            e.fs.lookup(d.ino, OsStr::new(&name)).await,
            Err(FsError::ENOENT)
        );
        let (a, h) =
            e.fs.create(d.ino, OsStr::new(&name), 0o644, 0, libc::O_WRONLY, ME)
                .await
                .unwrap();
        e.fs.write(a.ino, h.fh, 0, Bytes::from(random(128 * 1024, i)))
            .await
            .unwrap();
        e.fs.flush(a.ino, h.fh).await.unwrap();
        e.fs.release(a.ino, h.fh).await.unwrap();
    }
    assert_eq!(e.metrics.total_requests() - before, 100);
    assert_eq!(e.metrics.requests(Op::Put), 101);
    // And they are all there.
    assert_eq!(list(&e.fs, d.ino).await.len(), 102);
}

#[tokio::test]
async fn big_directories_stream_page_by_page() {
    let e = env();
    for i in 0..2500 {
        put(&e.mem, &format!("big/{i:05}"), b"").await;
    }
    put(&e.mem, "big/sub/x", b"").await;
    let before = e.metrics.requests(Op::List);
    let d = e.fs.lookup(ROOT_INO, OsStr::new("big")).await.unwrap();
    let fh = e.fs.opendir(d.ino).await.unwrap();
    let first = e.fs.readdir(d.ino, fh, 0).await.unwrap();
    // The first answer needs only the first page (which the lookup fetched).
    assert_eq!(e.metrics.requests(Op::List) - before, 1);
    assert!(first.len() >= 100);
    e.fs.releasedir(d.ino, fh);
    let names = list(&e.fs, d.ino).await;
    assert_eq!(names.len(), 2 + 2501);
    assert!(names.contains(&"sub".to_string()));
}

/// An application opening the files of a cold directory by name (no readdir): after a few
/// misses the directory is listed once, and the other names, present or not, cost nothing.
#[tokio::test]
async fn lookups_of_many_names_in_one_directory_list_it_once() {
    let e = env_on(MemoryStore::with_list_metadata());
    for i in 0..40u32 {
        let meta = file_meta(0o640, 1_600_000_000 + i as u64);
        e.mem
            .put(&format!("d/f{i:02}"), Bytes::from_static(b"abc"), &meta)
            .await
            .unwrap();
    }
    let d = e.fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    let before = e.metrics.total_requests();
    for i in 0..40u32 {
        let a =
            e.fs.lookup(d.ino, OsStr::new(&format!("f{i:02}")))
                .await
                .unwrap();
        assert_eq!((a.size, a.perm), (3, 0o640), "f{i:02}");
    }
    // Names that do not exist: answered by the listing too.
    for n in ["nope", "f99"] {
        assert_eq!(
            e.fs.lookup(d.ino, OsStr::new(n)).await.unwrap_err(),
            FsError::ENOENT
        );
    }
    // Two names probed (HEAD + LIST each), then the rest answered by a listing whose page
    // the lookup of d had fetched already.
    assert_eq!(e.metrics.total_requests() - before, 2 * 2);
}

/// A single lookup in a cold directory still probes just its name: no listing of a
/// directory that may be huge. The page the directory's lookup fetched showed `f3` as a
/// file (this store lists no metadata), so only its HEAD is needed, not LIST `f3/`.
#[tokio::test]
async fn a_lone_lookup_does_not_list_the_directory() {
    let e = env();
    for i in 0..5u32 {
        put(&e.mem, &format!("d/f{i}"), b"x").await;
    }
    let d = e.fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    let lists = e.metrics.requests(Op::List);
    e.fs.lookup(d.ino, OsStr::new("f3")).await.unwrap();
    assert_eq!(e.metrics.requests(Op::Head), 2, "HEAD d, HEAD f3");
    assert_eq!(e.metrics.requests(Op::List), lists, "HEAD f3 only");
}

/// readdirplus entries: attributes a listing carried are complete (no request, one lookup
/// each); an entry listed without metadata is registered stale, so its stat asks the store and
/// a symlink the listing could not tell from a file gets its true type.
#[tokio::test]
async fn readdirplus_entries_are_complete_only_with_metadata() {
    for with_meta in [true, false] {
        let e = env_on(if with_meta {
            MemoryStore::with_list_metadata()
        } else {
            MemoryStore::new()
        });
        e.mem
            .put(
                "d/f",
                Bytes::from_static(b"abc"),
                &file_meta(0o600, 1_600_000_000),
            )
            .await
            .unwrap();
        let link: UserMeta = [("mode".to_string(), (libc::S_IFLNK | 0o777).to_string())].into();
        e.mem
            .put("d/l", Bytes::from_static(b"f"), &link)
            .await
            .unwrap();
        let d = e.fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
        let fh = e.fs.opendir(d.ino).await.unwrap();
        let entries = e.fs.readdir(d.ino, fh, 0).await.unwrap();
        e.fs.releasedir(d.ino, fh);
        let inodes = e.fs.inode_count();
        let before = e.metrics.total_requests();
        let mut got = std::collections::HashMap::new();
        for ent in &entries {
            let (attr, complete) = e.fs.plus_entry(d.ino, ent).unwrap();
            got.insert(ent.name.clone(), (attr, complete));
        }
        assert_eq!(
            e.metrics.total_requests(),
            before,
            "no request for readdirplus"
        );
        assert_eq!(e.fs.inode_count(), inodes + 2, "f and l registered");
        let (f, f_complete) = &got["f"];
        let (l, l_complete) = &got["l"];
        assert_eq!((*f_complete, *l_complete), (with_meta, with_meta));
        if with_meta {
            assert_eq!((f.perm, f.size), (0o600, 3));
            assert_eq!(l.kind, FileKind::Symlink);
        }
        // Each entry counted one lookup: forgetting it once drops the inode.
        e.fs.forget(f.ino, 1);
        assert_eq!(e.fs.inode_count(), inodes + 1);
        // A stat after readdirplus: free with metadata, else one HEAD; the symlink's type is
        // right either way.
        let s = e.fs.getattr(l.ino).await;
        let l2 = e.fs.lookup(d.ino, OsStr::new("l")).await.unwrap();
        assert_eq!(l2.kind, FileKind::Symlink);
        if with_meta {
            assert_eq!(s.unwrap().kind, FileKind::Symlink);
            assert_eq!(e.metrics.total_requests(), before);
        } else {
            assert!(e.metrics.requests(Op::Head) >= 1);
        }
    }
}

/// Lets background statahead finish (the memory store answers at once).
async fn settle() {
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
}

/// One stat of a name in a listed directory (`ls -l dir` after a listing of its parent) stats
/// nothing else; the second lookup from the same listing starts statahead.
#[tokio::test]
async fn statahead_starts_at_the_second_lookup_from_a_listing() {
    let e = env();
    for d in ["a", "b", "c"] {
        put(&e.mem, &format!("{d}/x"), b"x").await;
    }
    for i in 0..10 {
        put(&e.mem, &format!("f{i}"), b"x").await;
    }
    assert_eq!(list(&e.fs, ROOT_INO).await.len(), 2 + 13);
    let before = (e.metrics.requests(Op::List), e.metrics.requests(Op::Head));
    let a = e.fs.lookup(ROOT_INO, OsStr::new("a")).await.unwrap();
    assert_eq!(a.kind, FileKind::Dir);
    settle().await;
    let sent = (
        e.metrics.requests(Op::List) - before.0,
        e.metrics.requests(Op::Head) - before.1,
    );
    assert_eq!(sent, (1, 0), "LIST a/ only, not b/ and c/ too");
    // The second lookup: the names after it are stat'ed ahead (c, f0..f9 after b).
    e.fs.lookup(ROOT_INO, OsStr::new("b")).await.unwrap();
    settle().await;
    assert_eq!(e.metrics.requests(Op::List) - before.0, 3, "a/, b/ and c/");
    assert_eq!(e.metrics.requests(Op::Head) - before.1, 10, "f0..f9");
    let total = e.metrics.total_requests();
    for i in 0..10 {
        e.fs.lookup(ROOT_INO, OsStr::new(&format!("f{i}")))
            .await
            .unwrap();
    }
    e.fs.lookup(ROOT_INO, OsStr::new("c")).await.unwrap();
    assert_eq!(e.metrics.total_requests(), total, "all stat'ed ahead");
}

/// Marker `d/` with metadata and 300 files, on a store whose listings carry metadata.
async fn dir_with_marker(e: &Env) {
    let marker: UserMeta = [("mode".to_string(), (libc::S_IFDIR | 0o750).to_string())].into();
    e.mem.put("d/", Bytes::new(), &marker).await.unwrap();
    for i in 0..300u32 {
        e.mem
            .put(
                &format!("d/f{i:04}"),
                Bytes::from_static(b"xy"),
                &file_meta(0o640, 1_600_000_000),
            )
            .await
            .unwrap();
    }
}

/// `ls -l d` on a cold mount: the lookup of d lists it from its marker with a full page, and
/// the listing and the stats of its entries are served from that page: one LIST in all.
#[tokio::test]
async fn stat_of_a_directory_then_its_listing_is_one_list() {
    for parent_listed in [false, true] {
        let e = env_on(MemoryStore::with_list_metadata());
        dir_with_marker(&e).await;
        if parent_listed {
            assert_eq!(list(&e.fs, ROOT_INO).await, [".", "..", "d"]);
        }
        let before = (e.metrics.requests(Op::List), e.metrics.requests(Op::Head));
        let d = e.fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
        assert_eq!(
            (d.kind, d.perm),
            (FileKind::Dir, 0o750),
            "the marker's mode"
        );
        let names = list(&e.fs, d.ino).await;
        assert_eq!(names.len(), 2 + 300, "the marker is no entry");
        assert_eq!(names[2], "f0000");
        for n in &names[2..] {
            let a = e.fs.lookup(d.ino, OsStr::new(n)).await.unwrap();
            assert_eq!((a.perm, a.size), (0o640, 2));
        }
        settle().await;
        let lists = e.metrics.requests(Op::List) - before.0;
        let heads = e.metrics.requests(Op::Head) - before.1;
        // Not listed by its parent, d's type is unknown: HEAD d goes with the LIST.
        let want_heads = if parent_listed { 0 } else { 1 };
        assert_eq!(
            (lists, heads),
            (1, want_heads),
            "parent listed: {parent_listed}"
        );
        // The page is used once: the next listing asks the store.
        assert_eq!(list(&e.fs, d.ino).await.len(), 302);
        assert_eq!(e.metrics.requests(Op::List) - before.0, 2);
    }
}

/// Changes made here between the lookup of a directory and its listing show in the listing:
/// the page the lookup fetched predates them and is not used.
#[tokio::test]
async fn changes_after_a_directory_lookup_show_in_its_listing() {
    let e = env_on(MemoryStore::with_list_metadata());
    dir_with_marker(&e).await;
    let d = e.fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    let (f, h) =
        e.fs.create(d.ino, OsStr::new("new"), 0o644, 0, libc::O_WRONLY, ME)
            .await
            .unwrap();
    e.fs.unlink(d.ino, OsStr::new("f0001")).await.unwrap();
    let lists = e.metrics.requests(Op::List);
    let names = list(&e.fs, d.ino).await;
    assert!(
        names.contains(&"new".to_string()),
        "created here, not stored yet"
    );
    assert!(!names.contains(&"f0001".to_string()), "removed here");
    assert_eq!(names.len(), 2 + 300);
    assert_eq!(e.metrics.requests(Op::List) - lists, 1, "listed again");
    e.fs.flush(f.ino, h.fh).await.unwrap();
    e.fs.release(f.ino, h.fh).await.unwrap();

    // A change elsewhere in this mount makes the page stale as well (the epoch is global).
    let e = env_on(MemoryStore::with_list_metadata());
    dir_with_marker(&e).await;
    let d = e.fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    write_file(&e.fs, "elsewhere", b"x").await;
    let lists = e.metrics.requests(Op::List);
    assert_eq!(list(&e.fs, d.ino).await.len(), 302);
    assert_eq!(e.metrics.requests(Op::List) - lists, 1);
}

/// A directory made here whose marker is still on its way when its parent is looked up: the
/// page that lookup would fetch lacks it, so none is kept, and the listing shows it.
#[tokio::test]
async fn a_directory_lookup_keeps_no_page_while_a_marker_below_is_pending() {
    let mem = Arc::new(MemoryStore::with_list_metadata());
    put(&mem, "d/f", b"x").await;
    let (faulty, fs, _cache) = faulty_fs(&mem);
    let d = fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    faulty.inject(
        Op::Put,
        0,
        Some(1),
        Fault::Delay(std::time::Duration::from_millis(300)),
    );
    fs.mkdir(d.ino, OsStr::new("sub"), 0o755, 0, ME)
        .await
        .unwrap();
    // d's attributes are asked again (as after its TTL): a new lookup of it from the store.
    fs.refresh(d.ino).unwrap();
    let d2 = fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    assert_eq!(d2.ino, d.ino);
    assert!(
        mem.head("d/sub/").await.is_err(),
        "the marker is not up yet"
    );
    let mut names = list(&fs, d.ino).await;
    names.sort();
    assert_eq!(names, [".", "..", "f", "sub"]);
}

/// A directory made (or listed) here whose listing went stale while its names are still being
/// looked up (a writer creating files for longer than the stat TTL): the first miss lists it
/// again, once, instead of a HEAD and a LIST per name until the third miss.
#[tokio::test]
async fn lookups_in_a_directory_whose_listing_went_stale_list_it_at_once() {
    use bucketfs_store::metrics::MeteredStore;
    let mem = Arc::new(MemoryStore::with_list_metadata());
    let metered = MeteredStore::new(mem.clone() as Arc<dyn ObjectStore>);
    let metrics = metered.metrics();
    let (fs, _cache) = short_ttl_fs(Arc::new(metered));
    let d = fs
        .mkdir(ROOT_INO, OsStr::new("d"), 0o755, 0o022, ME)
        .await
        .unwrap();
    let (a, open) = fs
        .create(d.ino, OsStr::new("f0"), 0o644, 0o022, libc::O_WRONLY, ME)
        .await
        .unwrap();
    fs.flush(a.ino, open.fh).await.unwrap();
    fs.release(a.ino, open.fh).await.unwrap();
    // Names not made yet: the fresh listing of the new directory answers them.
    let before = metrics.total_requests();
    for n in ["g0", "g1", "g2"] {
        assert_eq!(
            fs.lookup(d.ino, OsStr::new(n)).await.unwrap_err(),
            FsError::ENOENT
        );
    }
    assert_eq!(metrics.total_requests(), before);
    outlive_short_ttl().await;
    let (heads, lists) = (metrics.requests(Op::Head), metrics.requests(Op::List));
    for n in ["h0", "h1", "h2", "h3"] {
        assert_eq!(
            fs.lookup(d.ino, OsStr::new(n)).await.unwrap_err(),
            FsError::ENOENT
        );
    }
    assert_eq!(metrics.requests(Op::Head) - heads, 0, "no HEAD per name");
    assert_eq!(metrics.requests(Op::List) - lists, 1, "one LIST of d");
    // That LIST, for names it lacked, carried no metadata: f0 costs its HEAD.
    assert_eq!(fs.lookup(d.ino, OsStr::new("f0")).await.unwrap().size, 0);
    assert_eq!(metrics.requests(Op::Head) - heads, 1);
}

/// Stat and negative TTL of the mounts [`short_ttl_fs`] makes.
const SHORT_TTL: Duration = Duration::from_millis(300);

/// A mount over `store` that believes what it learnt for [`SHORT_TTL`] only.
fn short_ttl_fs(store: Arc<dyn ObjectStore>) -> (Arc<Fs>, tempfile::TempDir) {
    let cache = tempfile::tempdir().unwrap();
    let cfg = FsConfig {
        stat_ttl: SHORT_TTL,
        negative_ttl: SHORT_TTL,
        ..config(&cache)
    };
    (Fs::new(store, cfg), cache)
}

/// Waits until what a [`short_ttl_fs`] mount learnt is stale.
async fn outlive_short_ttl() {
    tokio::time::sleep(SHORT_TTL + Duration::from_millis(100)).await;
}

/// The LIST pages a store sends for `d/`, by what they carry.
struct ListsOfD {
    inner: Arc<MemoryStore>,
    details: parking_lot::Mutex<Vec<ListDetail>>,
}

impl ListsOfD {
    fn over(inner: &Arc<MemoryStore>) -> Arc<Self> {
        Arc::new(Self {
            inner: inner.clone(),
            details: parking_lot::Mutex::new(Vec::new()),
        })
    }
}

#[async_trait::async_trait]
impl bucketfs_store::layer::StoreLayer for ListsOfD {
    type Inner = MemoryStore;
    fn inner(&self) -> &MemoryStore {
        &self.inner
    }
    async fn list(
        &self,
        prefix: &str,
        delimiter: Option<&str>,
        from: bucketfs_store::ListFrom,
        max_keys: usize,
        detail: ListDetail,
    ) -> bucketfs_store::StoreResult<bucketfs_store::ListPage> {
        if prefix == "d/" && max_keys > 1 {
            self.details.lock().push(detail);
        }
        self.inner
            .list(prefix, delimiter, from, max_keys, detail)
            .await
    }
}

/// A directory whose listing went stale is listed again for the lookups of its names, with
/// user metadata only when they are of names it showed: a writer creating names it lacks
/// (each create's lookup) needs their absence alone, and a page of metadata makes the server
/// read every entry's, each stat TTL, for as long as the writer goes on (at 1,000 files per
/// directory, most of MinIO's time). Before, every such LIST asked for metadata.
#[tokio::test]
async fn a_stale_directory_is_listed_with_metadata_only_for_names_it_showed() {
    let mem = Arc::new(MemoryStore::with_list_metadata());
    put(&mem, "d/a", b"a").await;
    put(&mem, "d/b", b"bb").await;
    let store = ListsOfD::over(&mem);
    let (fs, _cache) = short_ttl_fs(store.clone());
    let d = fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    assert_eq!(list(&fs, d.ino).await.len(), 4);
    store.details.lock().clear();
    outlive_short_ttl().await;
    for n in ["new0", "new1", "new2"] {
        let r = fs.lookup(d.ino, OsStr::new(n)).await;
        assert_eq!(r.unwrap_err(), FsError::ENOENT);
    }
    assert_eq!(*store.details.lock(), [ListDetail::Plain]);
    store.details.lock().clear();
    outlive_short_ttl().await;
    assert_eq!(fs.lookup(d.ino, OsStr::new("b")).await.unwrap().size, 2);
    assert_eq!(fs.lookup(d.ino, OsStr::new("a")).await.unwrap().size, 1);
    assert_eq!(*store.details.lock(), [ListDetail::UserMeta]);
}

/// A LIST answered with what the store held before this mount changed the directory
/// (the store's answer was on its way while a file was created here): once armed, the next
/// LIST takes its page, then waits for `go` before answering.
struct SlowList {
    inner: Arc<MemoryStore>,
    armed: std::sync::atomic::AtomicBool,
    taken: tokio::sync::Notify,
    go: tokio::sync::Notify,
}

impl SlowList {
    /// Over `mem`, not armed.
    fn over(mem: &Arc<MemoryStore>) -> Arc<Self> {
        Arc::new(Self {
            inner: mem.clone(),
            armed: std::sync::atomic::AtomicBool::new(false),
            taken: tokio::sync::Notify::new(),
            go: tokio::sync::Notify::new(),
        })
    }
}

#[async_trait::async_trait]
impl bucketfs_store::layer::StoreLayer for SlowList {
    type Inner = MemoryStore;
    fn inner(&self) -> &MemoryStore {
        &self.inner
    }
    async fn list(
        &self,
        prefix: &str,
        delimiter: Option<&str>,
        from: bucketfs_store::ListFrom,
        max_keys: usize,
        detail: bucketfs_store::ListDetail,
    ) -> bucketfs_store::StoreResult<bucketfs_store::ListPage> {
        let page = self
            .inner
            .list(prefix, delimiter, from, max_keys, detail)
            .await;
        if self.armed.swap(false, std::sync::atomic::Ordering::SeqCst) {
            let go = self.go.notified();
            self.taken.notify_one();
            go.await;
        }
        page
    }
}

/// Found by the soak (a renamed file read back as `ENOENT`): a listing whose LIST was sent
/// before a file was created (or renamed to) here lacks it; once the kernel forgot the file,
/// a lookup must not take that listing's silence for absence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_older_than_a_file_made_here_does_not_hide_it() {
    let mem = Arc::new(MemoryStore::new());
    put(&mem, "d/a", b"a").await;
    let store = SlowList::over(&mem);
    let cache = tempfile::tempdir().unwrap();
    let fs = Fs::new(store.clone(), config(&cache));
    let d = fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    // A change here drops the page the lookup kept, so the listing sends its own LIST.
    write_file(&fs, "x", b"x").await;
    store.armed.store(true, std::sync::atomic::Ordering::SeqCst);
    let taken = store.taken.notified();
    let lister = {
        let fs = fs.clone();
        tokio::spawn(async move { list(&fs, d.ino).await })
    };
    tokio::time::timeout(Duration::from_secs(10), taken)
        .await
        .expect("the LIST was not sent");
    // The LIST has its page; now a file is made here and closed (sync mode: stored).
    let new = tokio::time::timeout(
        Duration::from_secs(10),
        write_file_in(&fs, d.ino, "new", b"new"),
    )
    .await
    .expect("the file's create or close waited for the listing");
    store.go.notify_one();
    let names = lister.await.unwrap();
    assert!(names.contains(&"a".to_string()), "{names:?}");
    // The kernel forgets the file; then looks it up again within the stat TTL.
    fs.forget(new, 1);
    let again = fs.lookup(d.ino, OsStr::new("new")).await;
    assert!(again.is_ok(), "a file made here looked up as {again:?}");
}

/// Found by the soak (`t51-f16: ENOENT` at its final pass, the object in the bucket): a file
/// created here before a listing's LIST was sent, and stored while that LIST's answer
/// (without it) was on its way. Once the kernel forgot the file, a lookup must not take that
/// listing's silence for absence (it did: the note of the create predated the LIST, and the
/// file was no longer being written when the answer came).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_sent_before_a_new_files_upload_landed_does_not_hide_it() {
    let mem = Arc::new(MemoryStore::new());
    put(&mem, "d/a", b"a").await;
    let store = SlowList::over(&mem);
    let cache = tempfile::tempdir().unwrap();
    let fs = Fs::new(store.clone(), config(&cache));
    let d = fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    // Created (noted as added) before the LIST is sent; not stored yet.
    let (new, h) = fs
        .create(d.ino, OsStr::new("new"), 0o644, 0o022, libc::O_WRONLY, ME)
        .await
        .unwrap();
    fs.write(new.ino, h.fh, 0, bytes::Bytes::from_static(b"new"))
        .await
        .unwrap();
    store.armed.store(true, std::sync::atomic::Ordering::SeqCst);
    let taken = store.taken.notified();
    let lister = {
        let fs = fs.clone();
        tokio::spawn(async move { list(&fs, d.ino).await })
    };
    tokio::time::timeout(Duration::from_secs(10), taken)
        .await
        .expect("the LIST was not sent");
    // The LIST has its page (without the file); now the file is stored and closed.
    fs.flush(new.ino, h.fh).await.unwrap();
    fs.release(new.ino, h.fh).await.unwrap();
    store.go.notify_one();
    let names = lister.await.unwrap();
    assert!(names.contains(&"a".to_string()), "{names:?}");
    // The kernel forgets the file; then looks it up again within the stat TTL.
    fs.forget(new.ino, 1);
    let again = fs.lookup(d.ino, OsStr::new("new")).await;
    assert!(again.is_ok(), "a file made here looked up as {again:?}");
}

/// A big directory whose listing went stale is not listed again for the first few lookups
/// of its names: a page of its entries with metadata costs the server more than their HEADs.
/// Only once as many lookups missed within a stat TTL as it has entries per 6 (here 200 / 6
/// = 33) is it listed, and that listing answers the rest. Before, the first miss listed it:
/// reading 100,000 files in 100 directories of 1,000 sent a page of 1,000 entries with
/// metadata per directory and TTL, 16,700 LISTs for 60,000 files read; and then at 31 misses
/// (200 / 32 = 6 here), 840 pages of 1,000 in a cold read of them, a third of MinIO's CPU.
#[tokio::test]
async fn a_big_stale_directory_is_listed_again_only_for_many_lookups() {
    use bucketfs_store::metrics::MeteredStore;
    let mem = Arc::new(MemoryStore::with_list_metadata());
    for i in 0..200 {
        put(&mem, &format!("d/f{i:03}"), b"x").await;
    }
    let lists = ListsOfD::over(&mem);
    let metered = MeteredStore::new(lists.clone() as Arc<dyn ObjectStore>);
    let metrics = metered.metrics();
    let (fs, _cache) = short_ttl_fs(Arc::new(metered));
    let d = fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    assert_eq!(list(&fs, d.ino).await.len(), 202);
    lists.details.lock().clear();
    outlive_short_ttl().await;
    let (heads, all) = (metrics.requests(Op::Head), metrics.total_requests());
    for i in 0..32 {
        let a = fs.lookup(d.ino, OsStr::new(&format!("f{i:03}"))).await;
        assert_eq!(a.unwrap().size, 1);
    }
    assert!(lists.details.lock().is_empty(), "no page for 32 lookups");
    assert_eq!(metrics.requests(Op::Head) - heads, 32, "a HEAD each");
    // The old listing showed them as files: no LIST of `name/` beside the HEAD (before, 64).
    assert_eq!(metrics.total_requests() - all, 32, "nothing but the HEADs");
    let before = metrics.total_requests();
    for i in 32..60 {
        let a = fs.lookup(d.ino, OsStr::new(&format!("f{i:03}"))).await;
        assert_eq!(a.unwrap().size, 1);
    }
    assert_eq!(*lists.details.lock(), [ListDetail::UserMeta]);
    assert_eq!(
        metrics.total_requests() - before,
        1,
        "the 33rd miss lists it, and the listing answers the rest"
    );
}

/// A file looked up again after the stat TTL (the next epoch of a job, on the same mount)
/// costs one HEAD: it was a file when last seen, so no LIST asks whether it became a
/// directory unless the HEAD finds nothing. Before, each such lookup sent a HEAD and a LIST.
#[tokio::test]
async fn a_file_seen_before_is_looked_up_again_with_one_head() {
    use bucketfs_store::metrics::MeteredStore;
    let mem = Arc::new(MemoryStore::with_list_metadata());
    put(&mem, "f", b"x").await;
    put(&mem, "g", b"y").await;
    let metered = MeteredStore::new(mem.clone() as Arc<dyn ObjectStore>);
    let metrics = metered.metrics();
    let (fs, _cache) = short_ttl_fs(Arc::new(metered));
    assert_eq!(fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap().size, 1);
    for _ in 0..2 {
        outlive_short_ttl().await;
        let before = metrics.total_requests();
        assert_eq!(fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap().size, 1);
        assert_eq!(metrics.total_requests() - before, 1, "one HEAD");
    }
    // Another client made it a directory: the HEAD finds nothing, then one LIST (not the
    // HEAD again).
    mem.delete("f").await.unwrap();
    put(&mem, "f/inner", b"z").await;
    outlive_short_ttl().await;
    let before = metrics.total_requests();
    let f = fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    assert_eq!(f.kind, FileKind::Dir);
    assert_eq!(metrics.total_requests() - before, 2, "a HEAD, then a LIST");
    // Deleted by another client: the same two, then nothing there.
    fs.lookup(ROOT_INO, OsStr::new("g")).await.unwrap();
    mem.delete("g").await.unwrap();
    outlive_short_ttl().await;
    let before = metrics.total_requests();
    let e = fs.lookup(ROOT_INO, OsStr::new("g")).await.unwrap_err();
    assert_eq!(e, FsError::ENOENT);
    assert_eq!(metrics.total_requests() - before, 2, "a HEAD, then a LIST");
}

/// `--stat-ttl 0` remembers nothing: a directory another client adds beside a file this
/// mount has seen shows at the next lookup (a directory wins over a file of the same name).
#[tokio::test]
async fn stat_ttl_zero_shows_a_directory_added_beside_a_known_file() {
    let mem = Arc::new(MemoryStore::with_list_metadata());
    put(&mem, "f", b"x").await;
    let cache = tempfile::tempdir().unwrap();
    let cfg = FsConfig {
        stat_ttl: Duration::ZERO,
        negative_ttl: Duration::ZERO,
        ..config(&cache)
    };
    let fs = Fs::new(mem.clone(), cfg);
    let f = fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    assert_eq!(f.kind, FileKind::File);
    put(&mem, "f/inner", b"z").await;
    let f = fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    assert_eq!(f.kind, FileKind::Dir);
}

/// The kernel looks a directory up again each stat TTL while a job works in it. For one
/// bigger than a page, that lookup fetches no page: before, each brought a page of 1,000
/// entries for a listing that did not follow (20,028 of them in a cold read of 100,000 files
/// in 100 directories of 1,000). Its listing still works, from its own first page.
#[tokio::test]
async fn a_directory_bigger_than_a_page_is_looked_up_again_without_one() {
    let mem = Arc::new(MemoryStore::with_list_metadata());
    for i in 0..1100 {
        put(&mem, &format!("d/f{i:04}"), b"x").await;
    }
    let lists = ListsOfD::over(&mem);
    let (fs, _cache) = short_ttl_fs(lists.clone());
    let d = fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    assert_eq!(lists.details.lock().len(), 1, "the first lookup's page");
    for _ in 0..2 {
        outlive_short_ttl().await;
        let again = fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
        assert_eq!((again.ino, again.kind), (d.ino, FileKind::Dir));
    }
    assert_eq!(
        lists.details.lock().len(),
        1,
        "no page for the lookups after"
    );
    assert_eq!(list(&fs, d.ino).await.len(), 1102);
}

/// A listing that starts from the page a lookup of its directory kept shows what that LIST
/// saw, and believes it for the stat TTL counted from when the LIST was sent, not from the
/// listing: another client's change made just after the lookup shows T after it (before:
/// up to 2 T, the page's entries and the listing's "no such name" taken as new).
#[tokio::test]
async fn a_listing_from_a_kept_page_is_believed_for_the_ttl_from_its_list() {
    let ttl = Duration::from_secs(2);
    let mem = MemoryStore::new();
    put(&mem, "d/f", &[1; 100]).await;
    let e = crate::support::env_with(mem, |c| FsConfig {
        stat_ttl: ttl,
        negative_ttl: ttl,
        ..c
    });
    let d = e.fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    let lists = e.metrics.requests(Op::List);
    put(&e.mem, "d/f", &[2; 200]).await;
    put(&e.mem, "d/g", b"new").await;
    // Used while half of T is left.
    tokio::time::sleep(ttl * 4 / 10).await;
    assert_eq!(list(&e.fs, d.ino).await, [".", "..", "f"]);
    assert_eq!(
        e.metrics.requests(Op::List),
        lists,
        "the kept page was used"
    );
    // 1.1 T after the lookup's LIST, 0.7 T after the listing.
    tokio::time::sleep(ttl * 7 / 10).await;
    let g = e.fs.lookup(d.ino, OsStr::new("g")).await;
    assert_eq!(g.map(|a| a.size), Ok(3), "d/g, added T ago");
    let f = e.fs.lookup(d.ino, OsStr::new("f")).await.unwrap();
    assert_eq!(f.size, 200, "d/f, replaced T ago");
}

/// What the kernel is told to keep: of a file or a directory's entry, what is left of T
/// since the store said it; of a directory's attributes (answered from what this mount
/// holds), all of T, however old its entry (an earlier build gave 0 once T passed, and a
/// process working in the directory then sent a getattr per file it opened). A kept page
/// older than T/2 is not used for a listing: its entries would be kept for less than that.
#[tokio::test]
async fn the_kernel_keeps_what_is_left_of_the_ttl() {
    let ttl = Duration::from_secs(2);
    let mem = MemoryStore::new();
    put(&mem, "d/f", &[1; 100]).await;
    put(&mem, "e/f", &[1; 100]).await;
    let e = crate::support::env_with(mem, |c| FsConfig {
        stat_ttl: ttl,
        negative_ttl: ttl,
        ..c
    });
    let d = e.fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    let f = e.fs.lookup(d.ino, OsStr::new("f")).await.unwrap();
    let left = e.fs.entry_ttl(&f);
    assert!(left <= ttl && left > ttl / 2, "{left:?}");
    tokio::time::sleep(ttl * 6 / 10).await;
    let left = e.fs.entry_ttl(&f);
    assert!(left <= ttl * 4 / 10, "a file learnt 0.6 T ago: {left:?}");
    let fa = e.fs.getattr(f.ino).await.unwrap();
    assert!(
        e.fs.attr_ttl(&fa) <= ttl * 4 / 10,
        "a file's attributes too"
    );
    tokio::time::sleep(ttl / 2).await;
    assert_eq!(
        e.fs.entry_ttl(&d),
        Duration::ZERO,
        "d's entry, learnt 1.1 T ago"
    );
    let da = e.fs.getattr(d.ino).await.unwrap();
    assert_eq!(e.fs.attr_ttl(&da), ttl, "d's attributes");
    // A page kept by a lookup 0.6 T before the listing: a LIST.
    let ed = e.fs.lookup(ROOT_INO, OsStr::new("e")).await.unwrap();
    let lists = e.metrics.requests(Op::List);
    tokio::time::sleep(ttl * 6 / 10).await;
    assert_eq!(list(&e.fs, ed.ino).await, [".", "..", "f"]);
    assert_eq!(
        e.metrics.requests(Op::List),
        lists + 1,
        "the old kept page was not used"
    );
}

/// AWS S3 can hold an object `d/x` and keys below `d/x/` at once; the directory wins. When
/// `x` ends one LIST page and `x/` comes on the next (keys `x-0001` ... sort between them),
/// readdir handed `x` out as a file before it fetched the next page, and the lookups the page
/// fed took it for a file: `find` and `cp -r` skipped the directory, `rm -rf` unlinked the
/// hidden object, `cat d/x/y` was ENOTDIR. A file that a later page may show to be a directory
/// is handed out (and believed) only once that page is read.
#[tokio::test]
async fn a_file_and_a_directory_of_one_name_on_two_list_pages_is_a_directory() {
    let e = env();
    put(&e.mem, "d/x", b"hidden").await;
    for i in 1..=1000u32 {
        put(&e.mem, &format!("d/x-{i:04}"), b"").await;
    }
    put(&e.mem, "d/x/y", b"below").await;
    let d = e.fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    let fh = e.fs.opendir(d.ino).await.unwrap();
    // As the kernel reads: each call from the offset the last entry gave.
    let mut offset = 0;
    let mut xs = Vec::new();
    let mut count = 0;
    loop {
        let batch = e.fs.readdir(d.ino, fh, offset).await.unwrap();
        let Some(last) = batch.last() else { break };
        offset = last.next_offset;
        count += batch.len();
        xs.extend(
            batch
                .iter()
                .filter(|ent| ent.name == "x")
                .map(|ent| ent.kind),
        );
    }
    e.fs.releasedir(d.ino, fh);
    assert_eq!(xs, vec![FileKind::Dir], "x as readdir handed it out");
    assert_eq!(count, 2 + 1001);
    let x = e.fs.lookup(d.ino, OsStr::new("x")).await.unwrap();
    assert_eq!(x.kind, FileKind::Dir);
    let y = e.fs.lookup(x.ino, OsStr::new("y")).await.unwrap();
    assert_eq!(y.size, 5);
}

/// Another client put an object named like the hidden directory of files unlinked while
/// open (`.bucketfs-unlinked`) at the mount's root: it was listed, and its lookup said
/// ENOENT (`ls` showed a name `stat` and `rm` could not find). It is not listed.
#[tokio::test]
async fn an_object_named_like_the_hidden_directory_is_not_listed_at_the_root() {
    let e = env();
    put(&e.mem, ".bucketfs-unlinked", b"x").await;
    put(&e.mem, "d/.bucketfs-unlinked", b"y").await;
    put(&e.mem, "f", b"z").await;
    let names = list(&e.fs, ROOT_INO).await;
    assert!(
        !names.contains(&".bucketfs-unlinked".to_string()),
        "{names:?}"
    );
    assert!(names.contains(&"f".to_string()));
    // Below the root it is a name like any other.
    let d = e.fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    assert!(list(&e.fs, d.ino)
        .await
        .contains(&".bucketfs-unlinked".to_string()));
}

/// A directory renamed (here) while a program lists it: the listing goes on at its new
/// place and shows every entry. Before, its next LIST page asked for the old place, empty
/// once the rename had deleted it: the listing ended there and was kept as complete, so the
/// names it lacked were ENOENT for the stat TTL.
#[tokio::test]
async fn a_directory_renamed_while_listed_is_listed_whole() {
    let e = env();
    for i in 0..2500 {
        put(&e.mem, &format!("d/{i:05}"), b"").await;
    }
    put(&e.mem, "d/sub/x", b"").await;
    let d = e.fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    let fh = e.fs.opendir(d.ino).await.unwrap();
    let (mut offset, mut names, mut renamed) = (0, Vec::new(), false);
    loop {
        let batch = e.fs.readdir(d.ino, fh, offset).await.unwrap();
        let Some(last) = batch.last() else { break };
        offset = last.next_offset;
        names.extend(batch.iter().map(|x| x.name.clone()));
        if !renamed && names.len() > 1200 {
            e.fs.rename(ROOT_INO, OsStr::new("d"), ROOT_INO, OsStr::new("e"), 0)
                .await
                .unwrap();
            renamed = true;
        }
    }
    e.fs.releasedir(d.ino, fh);
    assert!(renamed);
    let count = names.len();
    names.sort();
    names.dedup();
    assert_eq!((count, names.len()), (2 + 2501, 2 + 2501));
    let moved = e.fs.lookup(ROOT_INO, OsStr::new("e")).await.unwrap();
    assert_eq!(moved.ino, d.ino);
    for name in ["02499", "sub"] {
        e.fs.lookup(d.ino, OsStr::new(name)).await.unwrap();
    }
}

/// A known symlink, listed again after the stat TTL by a store whose listings carry no
/// metadata (AWS S3): the listing cannot tell it from a file, and `ls -l` (readdirplus, then
/// a stat) gave it a new inode number as a file, then another as a symlink again. It keeps
/// its number, and stays a symlink.
#[tokio::test]
async fn a_symlink_listed_without_metadata_keeps_its_inode_number() {
    let mem = Arc::new(MemoryStore::new());
    let link: UserMeta = [("mode".to_string(), (libc::S_IFLNK | 0o777).to_string())].into();
    mem.put("d/l", Bytes::from_static(b"f"), &link)
        .await
        .unwrap();
    put(&mem, "d/f", b"x").await;
    let (fs, _cache) = short_ttl_fs(mem.clone());
    let d = fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    let l = fs.lookup(d.ino, OsStr::new("l")).await.unwrap();
    assert_eq!(l.kind, FileKind::Symlink);
    for _ in 0..2 {
        outlive_short_ttl().await;
        let fh = fs.opendir(d.ino).await.unwrap();
        let entries = fs.readdir(d.ino, fh, 0).await.unwrap();
        fs.releasedir(d.ino, fh);
        let ent = entries.iter().find(|x| x.name == "l").unwrap();
        let (attr, _) = fs.plus_entry(d.ino, ent).unwrap();
        assert_eq!((attr.ino, attr.kind), (l.ino, FileKind::Symlink));
        let again = fs.lookup(d.ino, OsStr::new("l")).await.unwrap();
        assert_eq!((again.ino, again.kind), (l.ino, FileKind::Symlink));
        assert_eq!((ent.ino, ent.kind), (l.ino, FileKind::Symlink));
    }
}

/// Names another client deleted while this mount's kernel still held their inodes (a file
/// open here): once a listing shows them gone, they can be made again here, as a file or as
/// a directory (before: `touch` got `ENOENT` and `mkdir` `EEXIST` until the inodes went,
/// the stale entries staying attached to their names).
#[tokio::test]
async fn a_name_deleted_elsewhere_while_open_here_can_be_made_again() {
    let e = env_with(MemoryStore::new(), |c| FsConfig {
        stat_ttl: Duration::from_millis(200),
        negative_ttl: Duration::from_millis(200),
        ..c
    });
    for k in ["d/f1", "d/f2", "d/keep"] {
        put(&e.mem, k, b"old").await;
    }
    let d = e.fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap().ino;
    let mut open = Vec::new();
    for n in ["f1", "f2"] {
        let ino = e.fs.lookup(d, OsStr::new(n)).await.unwrap().ino;
        let h = e.fs.open(ino, libc::O_RDONLY).await.unwrap();
        open.push((ino, h.fh));
        e.mem.delete(&format!("d/{n}")).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(list(&e.fs, d).await, vec![".", "..", "keep"]);
    assert_eq!(e.fs.lookup(d, OsStr::new("f1")).await, Err(FsError::ENOENT));
    let (a, h) =
        e.fs.create(d, OsStr::new("f1"), 0o644, 0, libc::O_WRONLY, ME)
            .await
            .unwrap();
    e.fs.write(a.ino, h.fh, 0, Bytes::from_static(b"new"))
        .await
        .unwrap();
    e.fs.flush(a.ino, h.fh).await.unwrap();
    e.fs.release(a.ino, h.fh).await.unwrap();
    assert_eq!(object(&e.mem, "d/f1").await, b"new");
    // As the kernel does before a mkdir.
    assert_eq!(e.fs.lookup(d, OsStr::new("f2")).await, Err(FsError::ENOENT));
    e.fs.mkdir(d, OsStr::new("f2"), 0o755, 0, ME).await.unwrap();
    for (ino, fh) in open {
        e.fs.release(ino, fh).await.unwrap();
    }
    let mut names = list(&e.fs, d).await;
    names.sort();
    assert_eq!(names, vec![".", "..", "f1", "f2", "keep"]);
}

/// Holds the answer of a HEAD of `key` at its gate: the store has answered, the mount does
/// not know it yet.
struct HoldsHeadAnswer {
    inner: Arc<MemoryStore>,
    key: String,
    gate: crate::support::Gate,
}

#[async_trait::async_trait]
impl bucketfs_store::layer::StoreLayer for HoldsHeadAnswer {
    type Inner = MemoryStore;
    fn inner(&self) -> &MemoryStore {
        &self.inner
    }
    async fn head(&self, key: &str) -> bucketfs_store::StoreResult<bucketfs_store::ObjectMeta> {
        let r = self.inner.head(key).await;
        self.gate.pass(key == self.key).await;
        r
    }
}

/// A statahead HEAD of `d/f` answered before this mount unlinked `f` and seen after: the
/// file is gone at once all the same (before: the answer was cached as the file's, and a
/// lookup found it for the stat TTL, its open failing and `O_EXCL` giving `EEXIST`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stat_answered_before_an_unlink_here_does_not_bring_the_file_back() {
    let mem = Arc::new(MemoryStore::new());
    for k in ["d/a", "d/b", "d/c"] {
        put(&mem, k, b"x").await;
    }
    let held = Arc::new(HoldsHeadAnswer {
        inner: mem.clone(),
        key: "d/f".into(),
        gate: crate::support::Gate::new(false),
    });
    let cache = tempfile::tempdir().unwrap();
    let fs = Fs::new(held.clone(), config(&cache));
    let d = fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap().ino;
    // Written here: known to the inode table, not to the stat cache.
    write_file_in(&fs, d, "f", b"mine").await;
    held.gate.arm();
    let fh = fs.opendir(d).await.unwrap();
    let names: Vec<String> = fs
        .readdir(d, fh, 0)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    fs.releasedir(d, fh);
    assert!(names.iter().any(|n| n == "f"), "{names:?}");
    // The second lookup in a listing sends the statahead of the names after it.
    for n in ["a", "b"] {
        fs.lookup(d, OsStr::new(n)).await.unwrap();
    }
    tokio::time::timeout(Duration::from_secs(5), held.gate.reached())
        .await
        .expect("no statahead HEAD of d/f");
    fs.unlink(d, OsStr::new("f")).await.unwrap();
    held.gate.open();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(fs.lookup(d, OsStr::new("f")).await, Err(FsError::ENOENT));
}

/// Directories with no marker (a bucket uploaded by `aws s3 cp --recursive`), whose last
/// entry goes through this mount (unlink, rmdir, rename out of it): they stay, as on a disk
/// until `rmdir`, for this mount after the stat TTL and for other clients, and a chmod of
/// them works (before: each was gone from the bucket with its last key; `ls` of the parent
/// no longer showed it, `chmod` got `ENOENT`, and after the TTL so did `stat`).
#[tokio::test]
async fn an_implied_directory_emptied_here_stays() {
    let mem = Arc::new(MemoryStore::new());
    for k in ["d/f", "e/g/h", "m/x", "m/y"] {
        put(&mem, k, b"x").await;
    }
    let (fs, _cache) = short_ttl_fs(mem.clone());
    let ino = |parent, name: &'static str| {
        let fs = fs.clone();
        async move { fs.lookup(parent, OsStr::new(name)).await.unwrap().ino }
    };
    let d = ino(ROOT_INO, "d").await;
    ino(d, "f").await;
    fs.unlink(d, OsStr::new("f")).await.unwrap();
    let e = ino(ROOT_INO, "e").await;
    let g = ino(e, "g").await;
    ino(g, "h").await;
    fs.unlink(g, OsStr::new("h")).await.unwrap();
    fs.rmdir(e, OsStr::new("g")).await.unwrap();
    let m = ino(ROOT_INO, "m").await;
    for n in ["x", "y"] {
        ino(m, n).await;
        fs.rename(m, OsStr::new(n), ROOT_INO, OsStr::new(n), 0)
            .await
            .unwrap();
    }
    let set = SetAttr {
        mode: Some(0o700),
        ..SetAttr::default()
    };
    fs.setattr(d, None, set).await.unwrap();
    outlive_short_ttl().await;
    let mut names = list(&fs, ROOT_INO).await;
    names.sort();
    assert_eq!(names, vec![".", "..", "d", "e", "m", "x", "y"]);
    for (dir, n) in [(d, "d"), (e, "e"), (m, "m")] {
        assert_eq!(ino(ROOT_INO, n).await, dir, "{n}");
        assert_eq!(list(&fs, dir).await, vec![".", ".."], "{n}");
    }
    let mut keys = mem.keys();
    keys.sort();
    assert_eq!(keys, vec!["d/", "e/", "m/", "x", "y"]);
}

/// Markers whose uploads failed are sent again together when a listing needs them, not one
/// after another: 8 failed markers whose PUTs now take 0.5 s each hold `ls` of their parent
/// for about 0.5 s (before: 4 s, and with each PUT retried for --retry-timeout against a
/// store that refuses PUTs, `ls` of the root waited that long per marker).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_markers_are_sent_again_together() {
    let mem = Arc::new(MemoryStore::new());
    let (faulty, fs, _cache) = faulty_fs(&mem);
    let e = StoreError::Transient("503".into());
    faulty.inject(Op::Put, 0, Some(8), Fault::Error(e));
    faulty.inject(Op::Put, 0, None, Fault::Delay(Duration::from_millis(500)));
    for i in 0..8 {
        fs.mkdir(ROOT_INO, OsStr::new(&format!("d{i}")), 0o755, 0, ME)
            .await
            .unwrap();
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let started = std::time::Instant::now();
    assert_eq!(list(&fs, ROOT_INO).await.len(), 10);
    let took = started.elapsed();
    assert!(took < Duration::from_secs(2), "{took:?}");
    assert_eq!(mem.keys().len(), 8);
}

/// `rm -rf` of a tree with no markers: the directories it empties are not kept at the cost
/// of a request per file. Each file's unlink knows from the directory's listing (and what
/// was removed here since) that entries are left; the last one costs one LIST, and the
/// marker it leaves is the one `rmdir` deletes.
#[tokio::test]
async fn rm_rf_of_an_implied_tree_costs_no_request_per_file() {
    let e = env();
    for i in 0..20 {
        put(&e.mem, &format!("t/a/f{i:02}"), b"x").await;
    }
    let t = e.fs.lookup(ROOT_INO, OsStr::new("t")).await.unwrap().ino;
    let a = e.fs.lookup(t, OsStr::new("a")).await.unwrap().ino;
    let names = list(&e.fs, a).await;
    let before = (e.metrics.requests(Op::List), e.metrics.requests(Op::Put));
    // As rm does: lstat, then unlink, one name at a time.
    for n in &names[2..] {
        e.fs.lookup(a, OsStr::new(n)).await.unwrap();
        e.fs.unlink(a, OsStr::new(n)).await.unwrap();
    }
    let lists = e.metrics.requests(Op::List) - before.0;
    assert!(lists <= 1, "{lists} LISTs for 20 unlinks");
    e.fs.rmdir(t, OsStr::new("a")).await.unwrap();
    e.fs.rmdir(ROOT_INO, OsStr::new("t")).await.unwrap();
    assert!(e.mem.keys().is_empty(), "{:?}", e.mem.keys());
    // The marker of `a` (the rmdir deleted it), and that of `t` once `a` went.
    assert_eq!(e.metrics.requests(Op::Put) - before.1, 2);
}

/// The same for a directory listed first whose last file is unlinked while open (kept for
/// its descriptor under the hidden directory): the listing, less that name, shows nothing
/// left, and the directory gets its marker (a build of this session took the listed name
/// for an entry left).
#[tokio::test]
async fn an_implied_directory_listed_and_emptied_by_an_unlink_of_an_open_file_stays() {
    let e = env();
    put(&e.mem, "h/f", b"x").await;
    let h = e.fs.lookup(ROOT_INO, OsStr::new("h")).await.unwrap().ino;
    assert_eq!(list(&e.fs, h).await, vec![".", "..", "f"]);
    let f = e.fs.lookup(h, OsStr::new("f")).await.unwrap().ino;
    let fh = e.fs.open(f, libc::O_RDONLY).await.unwrap().fh;
    e.fs.unlink(h, OsStr::new("f")).await.unwrap();
    assert_eq!(list(&e.fs, h).await, vec![".", ".."]);
    e.fs.release(f, fh).await.unwrap();
    assert_eq!(e.mem.keys(), vec!["h/".to_string()]);
}

/// A listing read slowly (a program working on each entry between readdirs) believed the
/// names it lacks for T from its end: a name another client added to a page read longer
/// than T ago was ENOENT for up to T more, and a create made a new file over it. The
/// listing is believed from when its first LIST was sent.
#[tokio::test]
async fn a_slow_listing_is_believed_from_its_first_list_not_its_end() {
    let mem = Arc::new(MemoryStore::new());
    for i in 0..2500 {
        put(&mem, &format!("d/{i:05}"), b"x").await;
    }
    let (fs, _cache) = short_ttl_fs(mem.clone());
    let d = fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    let fh = fs.opendir(d.ino).await.unwrap();
    let mut off = fs
        .readdir(d.ino, fh, 0)
        .await
        .unwrap()
        .last()
        .unwrap()
        .next_offset;
    outlive_short_ttl().await;
    put(&mem, "d/00000a", b"theirs").await;
    let mut names = 0;
    loop {
        let batch = fs.readdir(d.ino, fh, off).await.unwrap();
        let Some(last) = batch.last() else { break };
        off = last.next_offset;
        names += batch.len();
    }
    fs.releasedir(d.ino, fh);
    assert!(names > 1500, "{names}");
    let got = fs.lookup(d.ino, OsStr::new("00000a")).await;
    assert_eq!(
        got.map(|a| a.size),
        Ok(6),
        "added T ago to a page read before"
    );
}

/// A directory whose marker `d/` holds bytes (another tool stored data under that key):
/// rmdir deleted the object, bytes and all, as if it were an empty marker. It is
/// `ENOTEMPTY` now, and the object stays.
#[tokio::test]
async fn rmdir_keeps_a_marker_that_holds_bytes() {
    let e = env();
    put(&e.mem, "d/", b"data under the marker").await;
    e.fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    let r = e.fs.rmdir(ROOT_INO, OsStr::new("d")).await;
    assert_eq!(r, Err(FsError::ENOTEMPTY));
    assert_eq!(object(&e.mem, "d/").await, b"data under the marker");
}

/// `rewinddir` (a readdir from offset 0 again on the same handle) lists the directory as it
/// is now: a name unlinked here since is gone and one another client added is there. It
/// replayed the listing the handle read first, and readdirplus registered the unlinked
/// names again.
#[tokio::test]
async fn rewinddir_lists_the_directory_as_it_is_now() {
    let e = env();
    put(&e.mem, "d/gone", b"1").await;
    put(&e.mem, "d/stays", b"2").await;
    let d = e.fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    let fh = e.fs.opendir(d.ino).await.unwrap();
    let names = |batch: Vec<bucketfs_fs::DirEntry>| -> Vec<String> {
        batch.into_iter().map(|e| e.name).collect()
    };
    let first = names(e.fs.readdir(d.ino, fh, 0).await.unwrap());
    assert_eq!(first, [".", "..", "gone", "stays"]);
    e.fs.unlink(d.ino, OsStr::new("gone")).await.unwrap();
    put(&e.mem, "d/new", b"3").await;
    let again = names(e.fs.readdir(d.ino, fh, 0).await.unwrap());
    e.fs.releasedir(d.ino, fh);
    assert_eq!(again, [".", "..", "new", "stays"]);
}

/// A file and a directory of one name, the directory's prefix on the second LIST page (the
/// file's 999 `x-NNN` neighbours sort before `x/`): the directory wins, also when the lookup
/// of the parent kept its first page and fed the names on it (before: `x` was taken from it
/// for a file, and `cd d/x` failed with ENOTDIR).
#[tokio::test]
async fn a_directory_on_a_later_page_wins_over_a_file_the_first_page_shows() {
    let e = env();
    put(&e.mem, "d/x", b"file").await;
    for i in 0..999 {
        put(&e.mem, &format!("d/x-{i:03}"), b"").await;
    }
    put(&e.mem, "d/x/y", b"below").await;
    let d = e.fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    let x = e.fs.lookup(d.ino, OsStr::new("x")).await.unwrap();
    assert_eq!(x.kind, FileKind::Dir);
}

/// The file a lookup's kept first page ends with is held back from the stat cache (a
/// directory of its name may come on the next page), and the listing's next page settles it:
/// `ls -l` of 1,000 files and a marker stats every one of them without a request (before the
/// listing fed it, the last file of the first page cost a HEAD).
#[tokio::test]
async fn the_file_a_page_ends_with_is_believed_once_the_next_page_is_read() {
    let e = env_on(MemoryStore::with_list_metadata());
    let marker: UserMeta = [("mode".to_string(), (libc::S_IFDIR | 0o750).to_string())].into();
    e.mem.put("d/", Bytes::new(), &marker).await.unwrap();
    for i in 0..1000u32 {
        let meta = file_meta(0o640, 1_600_000_000 + i as u64);
        e.mem
            .put(&format!("d/f{i:04}"), Bytes::from_static(b"xy"), &meta)
            .await
            .unwrap();
    }
    let d = e.fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    let names = list(&e.fs, d.ino).await;
    assert_eq!(names.len(), 2 + 1000);
    assert_eq!(
        e.metrics.requests(Op::List),
        2,
        "the kept page and the second"
    );
    let before = e.metrics.total_requests();
    for n in &names[2..] {
        let a = e.fs.lookup(d.ino, OsStr::new(n)).await.unwrap();
        assert_eq!((a.kind, a.size, a.perm), (FileKind::File, 2, 0o640), "{n}");
    }
    assert_eq!(e.metrics.total_requests(), before, "ls -l sent requests");
}

/// Every other LIST page empty and truncated, as a store may send (fewer keys than asked,
/// none at all): the token of a page is first answered with an empty page.
struct EmptyPagesBetween {
    inner: Arc<dyn ObjectStore>,
}

#[async_trait::async_trait]
impl bucketfs_store::layer::StoreLayer for EmptyPagesBetween {
    type Inner = dyn ObjectStore;
    fn inner(&self) -> &Self::Inner {
        &*self.inner
    }
    async fn list(
        &self,
        prefix: &str,
        delimiter: Option<&str>,
        from: ListFrom,
        max_keys: usize,
        detail: ListDetail,
    ) -> bucketfs_store::StoreResult<ListPage> {
        let from = match from {
            ListFrom::Token(t) => match t.strip_prefix("empty:") {
                Some(t) => ListFrom::Token(t.to_string()),
                None => {
                    return Ok(ListPage {
                        objects: Vec::new(),
                        common_prefixes: Vec::new(),
                        next_continuation: Some(format!("empty:{t}")),
                    })
                }
            },
            other => other,
        };
        self.inner
            .list(prefix, delimiter, from, max_keys, detail)
            .await
    }
}

/// Every listing's first page empty and truncated: its keys come on the page its token
/// gives.
struct EmptyFirstPages {
    inner: Arc<dyn ObjectStore>,
}

#[async_trait::async_trait]
impl bucketfs_store::layer::StoreLayer for EmptyFirstPages {
    type Inner = dyn ObjectStore;
    fn inner(&self) -> &Self::Inner {
        &*self.inner
    }
    async fn list(
        &self,
        prefix: &str,
        delimiter: Option<&str>,
        from: ListFrom,
        max_keys: usize,
        detail: ListDetail,
    ) -> bucketfs_store::StoreResult<ListPage> {
        let from = match from {
            ListFrom::Token(t) if t == "start" => ListFrom::Start,
            ListFrom::Token(t) => match t.strip_prefix("after:") {
                Some(k) => ListFrom::After(k.to_string()),
                None => ListFrom::Token(t),
            },
            first => {
                let token = match first {
                    ListFrom::After(k) => format!("after:{k}"),
                    _ => "start".to_string(),
                };
                return Ok(ListPage {
                    objects: Vec::new(),
                    common_prefixes: Vec::new(),
                    next_continuation: Some(token),
                });
            }
        };
        self.inner
            .list(prefix, delimiter, from, max_keys, detail)
            .await
    }
}

/// A directory whose first LIST page comes back empty and truncated (a store may cut a page
/// short before any key) is still a directory, with its marker's attributes; a name with
/// nothing at any page is still `ENOENT`. Before: `ENOENT` for the directory.
#[tokio::test]
async fn a_directory_whose_first_page_is_empty_is_still_found() {
    let mem = Arc::new(MemoryStore::new());
    put(&mem, "d/f", b"file").await;
    let marker: UserMeta = [("mode".to_string(), (libc::S_IFDIR | 0o700).to_string())].into();
    mem.put("e/", Bytes::new(), &marker).await.unwrap();
    let store = EmptyFirstPages {
        inner: mem.clone() as Arc<dyn ObjectStore>,
    };
    let cache = tempfile::tempdir().unwrap();
    let fs = Fs::new(Arc::new(store), config(&cache));
    let d = fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    assert_eq!(d.kind, FileKind::Dir);
    let e = fs.lookup(ROOT_INO, OsStr::new("e")).await.unwrap();
    assert_eq!(e.kind, FileKind::Dir);
    assert_eq!(e.perm, 0o700);
    let err = fs.lookup(ROOT_INO, OsStr::new("none")).await.unwrap_err();
    assert_eq!(err, FsError::ENOENT);
    assert_eq!(list(&fs, ROOT_INO).await, [".", "..", "d", "e"]);
    assert_eq!(list(&fs, d.ino).await, [".", "..", "f"]);
}

/// A file the first page ends with waits for a page that reads past its directory's key:
/// an empty page in between (truncated, with no key) settles nothing. Before: the empty
/// page let the listing hand out `x` as a file, and its directory came a page later.
#[tokio::test]
async fn an_empty_page_settles_no_file_a_directory_may_follow() {
    let mem = Arc::new(MemoryStore::new());
    put(&mem, "d/x", b"file").await;
    for i in 0..999 {
        put(&mem, &format!("d/x-{i:03}"), b"").await;
    }
    put(&mem, "d/x/y", b"below").await;
    let store = EmptyPagesBetween {
        inner: mem.clone() as Arc<dyn ObjectStore>,
    };
    let cache = tempfile::tempdir().unwrap();
    let fs = Fs::new(Arc::new(store), config(&cache));
    let d = fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    let fh = fs.opendir(d.ino).await.unwrap();
    let mut kinds = std::collections::HashMap::new();
    loop {
        let offset = kinds.len() as i64;
        let batch = fs.readdir(d.ino, fh, offset).await.unwrap();
        if batch.is_empty() {
            break;
        }
        kinds.extend(batch.into_iter().map(|e| (e.name, e.kind)));
    }
    fs.releasedir(d.ino, fh);
    assert_eq!(kinds.len(), 2 + 1000);
    assert_eq!(kinds["x"], FileKind::Dir);
    assert_eq!(
        fs.lookup(d.ino, OsStr::new("x")).await.unwrap().kind,
        FileKind::Dir
    );
}

/// A listing made for lookups (a name missed in a directory whose listing went stale) whose
/// LIST is read while the directory is renamed here: it saw the old keys gone and is not
/// kept for the directory at its new name (before: its files were ENOENT there for the stat
/// TTL).
#[tokio::test]
async fn a_listing_read_while_its_directory_is_renamed_is_not_kept() {
    let mem = Arc::new(MemoryStore::new());
    put(&mem, "p/f", b"f").await;
    let ttl = Duration::from_secs(1);
    let (faulty, fs, _cache) = crate::support::faulty_fs_with(&mem, |c| FsConfig {
        stat_ttl: ttl,
        negative_ttl: ttl,
        ..c
    });
    let p = fs.lookup(ROOT_INO, OsStr::new("p")).await.unwrap();
    assert_eq!(list(&fs, p.ino).await, [".", "..", "f"]);
    tokio::time::sleep(ttl + Duration::from_millis(100)).await;
    // A miss in the stale listing lists p again; that LIST is read after the rename.
    faulty.inject(
        Op::List,
        0,
        Some(1),
        Fault::Delay(Duration::from_millis(500)),
    );
    let looking = tokio::spawn({
        let fs = fs.clone();
        async move { fs.lookup(p.ino, OsStr::new("missing")).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    fs.rename(ROOT_INO, OsStr::new("p"), ROOT_INO, OsStr::new("q"), 0)
        .await
        .unwrap();
    assert!(
        !looking.is_finished(),
        "the listing was read before the rename"
    );
    assert_eq!(looking.await.unwrap(), Err(FsError::ENOENT));
    let q = fs.lookup(ROOT_INO, OsStr::new("q")).await.unwrap();
    assert_eq!(q.ino, p.ino);
    let f = fs.lookup(q.ino, OsStr::new("f")).await.unwrap();
    assert_eq!(f.size, 1);
}
