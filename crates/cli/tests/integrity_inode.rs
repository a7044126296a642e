//! Issue 17, items 5 and 6, through a real mount against MinIO.
//!
//! * `st_ino` is stable for the life of a file on a mount: the kernel forgetting inodes
//!   (`drop_caches`, memory pressure) or a rename does not change it, and GNU tar, which checks
//!   `st_ino` of its placeholders and directories before it finishes them, extracts exactly
//!   while caches are dropped under it.
//! * Every name S3 can store is reachable: names with control characters XML 1.0 cannot carry
//!   are listed exactly, opened, and deleted (`rm -rf` of their directory works).

mod common;

use common::*;
use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{DirEntryExt, MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Makes the kernel forget every inode nothing holds (they get FORGET requests).
fn drop_caches() {
    fs::write("/proc/sys/vm/drop_caches", "2").expect("drop_caches (needs root)");
    // Forgets reach the daemon asynchronously.
    std::thread::sleep(Duration::from_millis(100));
}

/// Relative path -> st_ino of everything below `root` (lstat, not following symlinks), and
/// checks that readdir's d_ino is the same number.
fn numbers(root: &Path) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    let mut todo = vec![root.to_path_buf()];
    while let Some(dir) = todo.pop() {
        for e in fs::read_dir(&dir).unwrap() {
            let e = e.unwrap();
            let md = fs::symlink_metadata(e.path()).unwrap();
            let rel = e.path().strip_prefix(root).unwrap().display().to_string();
            assert_eq!(e.ino(), md.ino(), "{rel}: d_ino is not st_ino");
            if md.is_dir() {
                todo.push(e.path());
            }
            out.insert(rel, md.ino());
        }
    }
    out
}

#[test]
fn st_ino_survives_forget_and_rename() {
    let s3 = s3();
    let b = s3.new_bucket("ino-stable");
    // Some of the tree comes from another client, never seen by the mount before.
    s3.put(&b, "t/remote/r1", "r1");
    s3.put(&b, "t/remote/deep/r2", "r2");
    let m = Mount::s3(&b);
    let t = m.join("t");
    fs::create_dir_all(t.join("a/b")).unwrap();
    write_file(&t.join("a/f"), b"f");
    write_file(&t.join("a/b/g"), b"g");
    std::os::unix::fs::symlink("f", t.join("a/rel")).unwrap();
    std::os::unix::fs::symlink("/etc/hostname", t.join("abs")).unwrap();
    let before = numbers(&t);
    assert_eq!(before.len(), 10, "{before:?}");
    let distinct: std::collections::BTreeSet<u64> = before.values().copied().collect();
    assert_eq!(distinct.len(), before.len(), "two entries share a number");
    for round in 0..3 {
        drop_caches();
        assert_eq!(numbers(&t), before, "after drop_caches, round {round}");
    }
    // A rename keeps the number of the file, and a directory's of everything below it.
    fs::rename(t.join("a/f"), t.join("a/f2")).unwrap();
    fs::rename(t.join("a"), t.join("z")).unwrap();
    fs::rename(t.join("remote"), t.join("far")).unwrap();
    let renamed = |k: &str| -> String {
        if k == "a/f" {
            "z/f2".into()
        } else if k == "a" || k.starts_with("a/") {
            format!("z{}", &k[1..])
        } else if k == "remote" || k.starts_with("remote/") {
            format!("far{}", &k["remote".len()..])
        } else {
            k.into()
        }
    };
    let expect: BTreeMap<String, u64> = before.iter().map(|(k, v)| (renamed(k), *v)).collect();
    assert_eq!(numbers(&t), expect, "after renames");
    drop_caches();
    assert_eq!(numbers(&t), expect, "after renames and drop_caches");
    // A new file where a renamed one was has a number of its own.
    write_file(&t.join("a"), b"new");
    let new = fs::symlink_metadata(t.join("a")).unwrap().ino();
    assert!(!distinct.contains(&new), "new file took number {new}");
    let mut m = m;
    assert!(m.daemon_alive(), "{}", m.log());
}

/// A symlink listed once directories are listed without metadata (after a walk that stats
/// no files, such as `find`): such a listing cannot tell it from a file. Its number stays
/// the same across `drop_caches`, and `d_ino` is `st_ino`. Before, its next lookup gave it a
/// fresh number (2, 7, ...) while the kernel still held the listed file's.
#[test]
fn a_symlink_keeps_its_number_after_a_listing_without_metadata() {
    let s3 = s3();
    let b = s3.new_bucket("ino-symlink");
    for i in 0..100 {
        s3.put(&b, &format!("g/file{i:03}"), "");
    }
    let m = MountSpec::s3(&b, "").arg("--stat-ttl").arg("1").mount();
    fs::create_dir(m.join("f")).unwrap();
    std::os::unix::fs::symlink("tgt", m.join("f/a")).unwrap();
    let first = fs::symlink_metadata(m.join("f/a")).unwrap().ino();
    for round in 0..2 {
        drop_caches();
        std::thread::sleep(Duration::from_millis(1500));
        // 100 files listed, none stat'ed: the next listings come without metadata.
        let found = Command::new("find").arg(m.join("g")).output().unwrap();
        assert!(found.status.success());
        assert_eq!(
            numbers(&m.join("f")).get("a"),
            Some(&first),
            "round {round}"
        );
    }
    drop(m);
    s3.remove_bucket(&b);
}

/// One source tree for tar: directories with modes tar sets last (0755, 0750, 0711),
/// files, and symlinks: relative ones (made at once), and absolute or `..` ones, which GNU
/// tar extracts as empty mode-000 placeholders and turns into symlinks at the end, after
/// checking with fstatat that each placeholder still has the st_ino it had.
fn tar_source(src: &Path, dirs: usize) -> BTreeMap<String, (u32, Option<String>)> {
    let mut want = BTreeMap::new();
    for i in 0..dirs {
        let d = format!("d{i:03}");
        let mode = [0o755, 0o750, 0o711][i % 3];
        fs::create_dir_all(src.join(&d).join("sub")).unwrap();
        fs::write(src.join(&d).join("file"), format!("content {i}")).unwrap();
        fs::set_permissions(src.join(&d).join("file"), fs::Permissions::from_mode(0o640)).unwrap();
        let links = [
            ("rel", "file".to_string()),
            ("up", format!("../d{:03}/file", (i + 1) % dirs)),
            ("abs", "/etc/hostname".to_string()),
            ("sub/up2", "../file".to_string()),
        ];
        for (name, target) in links {
            std::os::unix::fs::symlink(&target, src.join(&d).join(name)).unwrap();
            want.insert(format!("{d}/{name}"), (libc::S_IFLNK | 0o777, Some(target)));
        }
        fs::set_permissions(src.join(&d).join("sub"), fs::Permissions::from_mode(0o700)).unwrap();
        fs::set_permissions(src.join(&d), fs::Permissions::from_mode(mode)).unwrap();
        want.insert(d.clone(), (libc::S_IFDIR | mode, None));
        want.insert(format!("{d}/sub"), (libc::S_IFDIR | 0o700, None));
        want.insert(format!("{d}/file"), (libc::S_IFREG | 0o640, None));
    }
    want
}

#[test]
fn tar_extracts_exactly_while_caches_are_dropped() {
    let s3 = s3();
    let b = s3.new_bucket("ino-tar");
    let m = Mount::s3(&b);
    let work = tempfile::tempdir().unwrap();
    let src = work.path().join("src");
    let want = tar_source(&src, 40);
    let archive = work.path().join("a.tar");
    let out = Command::new("tar")
        .arg("-cf")
        .arg(&archive)
        .arg("-C")
        .arg(&src)
        .arg(".")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let dest = m.join("x");
    fs::create_dir(&dest).unwrap();
    // Memory pressure, the hard way: the kernel forgets every idle inode every 20 ms.
    let stop = Arc::new(AtomicBool::new(false));
    let dropper = std::thread::spawn({
        let stop = stop.clone();
        move || {
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                fs::write("/proc/sys/vm/drop_caches", "2").unwrap();
                n += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
            n
        }
    });
    let out = Command::new("tar")
        .arg("-xf")
        .arg(&archive)
        .arg("-C")
        .arg(&dest)
        .output()
        .unwrap();
    stop.store(true, Ordering::Relaxed);
    let drops = dropper.join().unwrap();
    eprintln!("tar: {:?} with {drops} cache drops", out.status);
    assert!(
        out.status.success() && out.stderr.is_empty(),
        "tar: {:?}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    drop_caches();
    for (rel, (mode, target)) in &want {
        let p = dest.join(rel);
        let md = fs::symlink_metadata(&p).unwrap_or_else(|e| panic!("{rel}: {e}"));
        assert_eq!(md.mode(), *mode, "{rel}: mode {:o}", md.mode());
        if let Some(t) = target {
            assert_eq!(fs::read_link(&p).unwrap().to_str().unwrap(), t, "{rel}");
        }
    }
    assert_eq!(read_file(&dest.join("d007/file")), b"content 7");
    let mut m = m;
    assert!(m.daemon_alive(), "{}", m.log());
}

/// Names with characters XML 1.0 cannot carry, mixed with ones url-encoding must not mangle.
fn control_names() -> Vec<String> {
    [
        "\u{8}",
        "\u{b}",
        "\u{c}",
        "\u{e}",
        "\u{1b}",
        "\u{1f}",
        "a\u{8}b\u{b}c\u{c}d\u{e}e\u{1b}f\u{1f}g",
        "\u{1b}[31mred\u{1b}[0m",
        "%41+ \u{1f}%",
        "sp ace+plus%2B%",
        "tab\tnl\ncr\r",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

#[test]
fn names_with_control_characters_list_open_and_delete() {
    let s3 = s3();
    let b = s3.new_bucket("ctl-names");
    let m = Mount::s3(&b);
    let root = m.join("ctl");
    fs::create_dir(&root).unwrap();
    let names = control_names();
    let sub = root.join("dir\u{1b}\u{8}");
    fs::create_dir(&sub).unwrap();
    for n in &names {
        write_file(&root.join(n), n.as_bytes());
        write_file(&sub.join(n), n.as_bytes());
    }
    // The keys are exactly the names.
    for n in &names {
        assert_eq!(
            s3.get(&b, &format!("ctl/{n}")).unwrap(),
            n.as_bytes(),
            "{n:?}"
        );
    }
    // A cold mount lists them exactly (nothing cached from the creates) and opens them.
    let m = m.remount();
    let root = m.join("ctl");
    let sub = root.join("dir\u{1b}\u{8}");
    let mut expect: std::collections::BTreeSet<String> = names.iter().cloned().collect();
    assert_eq!(list_dir(&sub), expect, "listing of the subdirectory");
    expect.insert("dir\u{1b}\u{8}".to_string());
    assert_eq!(list_dir(&root), expect, "listing of ctl");
    for n in &names {
        assert_eq!(read_file(&root.join(n)), n.as_bytes(), "read {n:?}");
        assert_eq!(read_file(&sub.join(n)), n.as_bytes(), "read {n:?}");
    }
    // Deleted one by one, and all at once by rm -rf (which lists before it deletes).
    fs::remove_file(root.join(&names[0])).unwrap();
    assert!(s3.head(&b, &format!("ctl/{}", names[0])).is_none());
    let out = Command::new("rm").arg("-rf").arg(&root).output().unwrap();
    assert!(
        out.status.success(),
        "rm -rf: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!root.exists());
    for n in &names {
        assert!(s3.head(&b, &format!("ctl/{n}")).is_none(), "{n:?} left");
        assert!(s3.head(&b, &format!("ctl/dir\u{1b}\u{8}/{n}")).is_none());
    }
    let mut m = m;
    assert!(m.daemon_alive(), "{}", m.log());
}
