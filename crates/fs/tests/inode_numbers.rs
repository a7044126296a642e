//! `st_ino` is stable for the life of a file on a mount: after the kernel forgets an inode, after
//! renames of it or of a directory above it, and readdir shows the number lookup gives. Two files
//! known at once never share a number. In-process against the memory store.

mod support;

use bucketfs_fs::{Fs, ROOT_INO};
use bucketfs_store::memory::MemoryStore;
use bucketfs_store::{ObjectStore, UserMeta};
use bytes::Bytes;
use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use support::{env, ME};

async fn put(mem: &MemoryStore, key: &str) {
    mem.put(key, Bytes::from_static(b"x"), &UserMeta::new())
        .await
        .unwrap();
}

/// Looks a slash-separated path up from the root, one lookup per component (as the kernel
/// does); returns the inode numbers on the way.
async fn walk(fs: &Fs, path: &str) -> Vec<u64> {
    let mut at = ROOT_INO;
    let mut inos = Vec::new();
    for name in path.split('/') {
        at = fs
            .lookup(at, OsStr::new(name))
            .await
            .unwrap_or_else(|e| panic!("lookup {name:?} of {path:?}: {e:?}"))
            .ino;
        inos.push(at);
    }
    inos
}

/// The kernel forgets every lookup `walk` made.
fn forget(fs: &Fs, inos: &[u64]) {
    for &i in inos {
        fs.forget(i, 1);
    }
}

async fn ino_of(fs: &Fs, path: &str) -> u64 {
    let inos = walk(fs, path).await;
    forget(fs, &inos);
    *inos.last().unwrap()
}

/// Name -> number, as readdir shows them.
async fn readdir(fs: &Fs, dir: u64) -> HashMap<String, u64> {
    let fh = fs.opendir(dir).await.unwrap();
    let mut out = HashMap::new();
    let mut off = 0;
    loop {
        let batch = fs.readdir(dir, fh, off).await.unwrap();
        let Some(last) = batch.last() else { break };
        off = last.next_offset;
        for e in batch {
            out.insert(e.name, e.ino);
        }
    }
    fs.releasedir(dir, fh);
    out
}

#[tokio::test]
async fn numbers_survive_forget_and_follow_renames() {
    let e = env();
    for k in ["d/a", "d/sub/b", "d/sub/deep/c", "top"] {
        put(&e.mem, k).await;
    }
    let base = e.fs.inode_count();
    let paths = [
        "d",
        "d/a",
        "d/sub",
        "d/sub/b",
        "d/sub/deep",
        "d/sub/deep/c",
        "top",
    ];
    let mut first = HashMap::new();
    for p in paths {
        first.insert(p, ino_of(&e.fs, p).await);
    }
    assert_eq!(e.fs.inode_count(), base, "all forgotten");
    let distinct: HashSet<u64> = first.values().copied().collect();
    assert_eq!(distinct.len(), paths.len(), "{first:?}");
    // Forgotten, then looked up again: the same numbers.
    for p in paths {
        assert_eq!(ino_of(&e.fs, p).await, first[p], "{p} after forget");
    }
    // readdir shows what lookup gives, known or not.
    let d = walk(&e.fs, "d").await;
    let listed = readdir(&e.fs, d[0]).await;
    assert_eq!(listed["a"], first["d/a"]);
    assert_eq!(listed["sub"], first["d/sub"]);
    forget(&e.fs, &d);

    // A file renamed keeps its number, before and after a forget.
    let a = walk(&e.fs, "d/a").await;
    e.fs.rename(a[0], OsStr::new("a"), a[0], OsStr::new("a2"), 0)
        .await
        .unwrap();
    let a2 = walk(&e.fs, "d/a2").await;
    assert_eq!(a2[1], first["d/a"]);
    forget(&e.fs, &a);
    forget(&e.fs, &a2);
    assert_eq!(
        ino_of(&e.fs, "d/a2").await,
        first["d/a"],
        "renamed, forgotten"
    );

    // A directory renamed: it and everything below keep theirs, looked up since or not.
    let d = walk(&e.fs, "d").await;
    e.fs.rename(ROOT_INO, OsStr::new("d"), ROOT_INO, OsStr::new("e"), 0)
        .await
        .unwrap();
    forget(&e.fs, &d);
    assert_eq!(e.fs.inode_count(), base);
    assert_eq!(ino_of(&e.fs, "e").await, first["d"]);
    assert_eq!(ino_of(&e.fs, "e/sub/deep/c").await, first["d/sub/deep/c"]);
    assert_eq!(ino_of(&e.fs, "e/sub/b").await, first["d/sub/b"]);
    assert_eq!(ino_of(&e.fs, "e/a2").await, first["d/a"]);
    let e_ino = walk(&e.fs, "e").await;
    let sub = walk(&e.fs, "e/sub").await;
    let listed = readdir(&e.fs, sub[1]).await;
    assert_eq!(listed["b"], first["d/sub/b"]);
    assert_eq!(listed["deep"], first["d/sub/deep"]);
    forget(&e.fs, &sub);
    forget(&e.fs, &e_ino);

    // New files where the renamed ones were get numbers of their own.
    let nd =
        e.fs.mkdir(ROOT_INO, OsStr::new("d"), 0o755, 0, ME)
            .await
            .unwrap();
    let na =
        e.fs.mkdir(nd.ino, OsStr::new("a"), 0o755, 0, ME)
            .await
            .unwrap();
    let nsub =
        e.fs.mkdir(nd.ino, OsStr::new("sub"), 0o755, 0, ME)
            .await
            .unwrap();
    for n in [nd.ino, na.ino, nsub.ino] {
        assert!(
            !distinct.contains(&n),
            "a new file took a number in use: {n}"
        );
    }
    assert_eq!(ino_of(&e.fs, "e/sub").await, first["d/sub"]);
    e.fs.forget(nsub.ino, 1);
    e.fs.forget(na.ino, 1);
    e.fs.forget(nd.ino, 1);
    assert_eq!(ino_of(&e.fs, "d").await, nd.ino, "the new d keeps its own");
    assert_eq!(ino_of(&e.fs, "d/sub").await, nsub.ino);

    // Renamed back: the original numbers again.
    let nd = walk(&e.fs, "d").await;
    let sub = walk(&e.fs, "d/sub").await;
    e.fs.rmdir(nd[0], OsStr::new("sub")).await.unwrap();
    e.fs.rmdir(nd[0], OsStr::new("a")).await.unwrap();
    e.fs.rmdir(ROOT_INO, OsStr::new("d")).await.unwrap();
    forget(&e.fs, &sub);
    forget(&e.fs, &nd);
    let eo = walk(&e.fs, "e").await;
    e.fs.rename(ROOT_INO, OsStr::new("e"), ROOT_INO, OsStr::new("d"), 0)
        .await
        .unwrap();
    forget(&e.fs, &eo);
    for p in ["d", "d/sub", "d/sub/b", "d/sub/deep/c", "top"] {
        assert_eq!(ino_of(&e.fs, p).await, first[p], "{p} renamed back");
    }
    assert_eq!(e.fs.inode_count(), base);
}

#[tokio::test]
async fn a_new_file_never_takes_a_number_still_held() {
    let e = env();
    put(&e.mem, "x").await;
    let x = walk(&e.fs, "x").await[0];
    // Unlinked while open: still held under its number.
    let h = e.fs.open(x, libc::O_RDONLY).await.unwrap();
    e.fs.unlink(ROOT_INO, OsStr::new("x")).await.unwrap();
    let (new, h2) =
        e.fs.create(ROOT_INO, OsStr::new("x"), 0o644, 0, libc::O_WRONLY, ME)
            .await
            .unwrap();
    assert_ne!(new.ino, x, "the new x took the number of the open one");
    e.fs.release(new.ino, h2.fh).await.unwrap();
    e.fs.forget(new.ino, 1);
    assert_eq!(ino_of(&e.fs, "x").await, new.ino, "the new x keeps its own");
    e.fs.release(x, h.fh).await.unwrap();
    e.fs.forget(x, 1);
}
