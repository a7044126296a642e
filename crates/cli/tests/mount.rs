//! POSIX behaviour through a real FUSE mount of a MinIO bucket, checked both through the mount
//! and directly in the bucket with the S3 API. Needs `scripts/test.sh` (MinIO + fuse3).

mod common;

use common::*;
use std::fs::{self, File, Permissions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

const S_IFMT: u32 = libc::S_IFMT;
const S_IFREG: u32 = libc::S_IFREG;
const S_IFDIR: u32 = libc::S_IFDIR;
const S_IFLNK: u32 = libc::S_IFLNK;

fn meta_u32(h: &Head, k: &str) -> u32 {
    h.meta
        .get(k)
        .unwrap_or_else(|| panic!("object has no x-amz-meta-{k}: {:?}", h.meta))
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("x-amz-meta-{k} is not a decimal number: {:?}", h.meta))
}

fn meta_secs(h: &Head, k: &str) -> f64 {
    h.meta
        .get(k)
        .unwrap_or_else(|| panic!("object has no x-amz-meta-{k}: {:?}", h.meta))
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("x-amz-meta-{k} is not seconds: {:?}", h.meta))
}

fn head(bucket: &str, key: &str) -> Head {
    s3().head(bucket, key)
        .unwrap_or_else(|| panic!("object {bucket}/{key} does not exist"))
}

fn process_umask() -> u32 {
    let st = fs::read_to_string("/proc/self/status").unwrap();
    let line = st.lines().find(|l| l.starts_with("Umask:")).unwrap();
    u32::from_str_radix(line.split_whitespace().nth(1).unwrap(), 8).unwrap()
}

fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// `ls -lnd --time-style=+%s PATH` split into fields: mode, links, uid, gid, size, mtime, name.
fn ls_ld(path: &Path) -> Vec<String> {
    let out = run("ls", &["-lnd", "--time-style=+%s", path.to_str().unwrap()]);
    out.split_whitespace().map(str::to_string).collect()
}

fn mode_string(path: &Path) -> String {
    ls_ld(path)[0].chars().take(10).collect()
}

#[test]
fn s3_harness_roundtrip() {
    // The harness itself: bucket creation, PUT with metadata, HEAD, GET, LIST.
    let s3 = s3();
    let b = s3.new_bucket("harness");
    s3.put_with_meta(&b, "x/y.txt", "hello", &[("mode", "33188")]);
    let h = head(&b, "x/y.txt");
    assert_eq!(h.size, 5);
    assert_eq!(h.meta.get("mode").map(String::as_str), Some("33188"));
    assert_eq!(s3.get(&b, "x/y.txt").unwrap(), b"hello");
    assert!(s3.get(&b, "missing").is_none());
    assert!(s3.head(&b, "missing").is_none());
    assert_eq!(s3.list_keys(&b, ""), set(["x/y.txt"]));
    assert!(s3.list_multipart_uploads(&b).is_empty());
}

#[test]
fn files_of_many_sizes_round_trip() {
    let s3 = s3();
    let b = s3.new_bucket("sizes");
    let sizes: [(&str, u64); 4] = [
        ("empty", 0),
        ("one", 1),
        ("five-mib-plus-one", 5 * MIB as u64 + 1),
        ("two-hundred-mib", 200 * MIB as u64),
    ];
    let mut m = Mount::s3(&b);
    for (i, (name, len)) in sizes.iter().enumerate() {
        let p = m.join(name);
        let mut f = File::create(&p).unwrap_or_else(|e| panic!("create {name}: {e}"));
        pattern::write(&mut f, i as u64, *len).unwrap_or_else(|e| panic!("write {name}: {e}"));
        close_checked(f).unwrap_or_else(|e| panic!("close {name}: {e}"));
        assert_eq!(
            fs::metadata(&p).unwrap().len(),
            *len,
            "size of {name} after close"
        );
    }
    // Read back through the same mount.
    for (i, (name, len)) in sizes.iter().enumerate() {
        let mut f = File::open(m.join(name)).unwrap();
        pattern::check_reader(&mut f, i as u64, *len)
            .unwrap_or_else(|e| panic!("{name} read back through the mount: {e}"));
    }
    // In the bucket: one plain object per file, same bytes.
    for (i, (name, len)) in sizes.iter().enumerate() {
        let h = head(&b, name);
        assert_eq!(h.size, *len, "object size of {name}");
        let body = s3.get(&b, name).unwrap();
        pattern::check_slice(&body, i as u64, *len)
            .unwrap_or_else(|e| panic!("object {name} in the bucket: {e}"));
    }
    assert!(
        s3.list_multipart_uploads(&b).is_empty(),
        "multipart uploads left behind: {:?}",
        s3.list_multipart_uploads(&b)
    );
    // After a remount (cold caches, new daemon).
    m = m.remount();
    assert_eq!(
        list_dir(m.path()),
        sizes.iter().map(|(n, _)| n.to_string()).collect()
    );
    for (i, (name, len)) in sizes.iter().enumerate() {
        let p = m.join(name);
        assert_eq!(
            fs::metadata(&p).unwrap().len(),
            *len,
            "size of {name} after remount"
        );
        let mut f = File::open(&p).unwrap();
        pattern::check_reader(&mut f, i as u64, *len)
            .unwrap_or_else(|e| panic!("{name} read back after remount: {e}"));
    }
    // A random read in the middle of the big file.
    let mut f = File::open(m.join("two-hundred-mib")).unwrap();
    let off = 123 * MIB as u64 + 4567;
    f.seek(SeekFrom::Start(off)).unwrap();
    let mut buf = vec![0u8; 100_000];
    f.read_exact(&mut buf).unwrap();
    let blk = off / MIB as u64;
    let mut want = pattern::block(3, blk);
    want.extend(pattern::block(3, blk + 1));
    let s = (off % MIB as u64) as usize;
    assert!(
        buf == want[s..s + buf.len()],
        "random read at {off} differs"
    );
}

#[test]
fn nested_mkdir_and_rmdir() {
    let s3 = s3();
    let b = s3.new_bucket("mkdir");
    let m = Mount::s3(&b);
    run("mkdir", &["-p", m.join("a/b/c").to_str().unwrap()]);
    for d in ["a", "a/b", "a/b/c"] {
        assert!(
            fs::metadata(m.join(d)).unwrap().is_dir(),
            "{d} is a directory"
        );
    }
    assert_eq!(list_dir(&m.join("a")), set(["b"]));
    assert!(list_dir(&m.join("a/b/c")).is_empty());
    // Empty directories must survive in the bucket: they need marker objects.
    let keys = s3.list_keys(&b, "");
    assert!(keys.contains("a/b/c/"), "no marker for a/b/c: {keys:?}");

    assert_eq!(
        errno(fs::remove_dir(m.join("a"))),
        libc::ENOTEMPTY,
        "rmdir a"
    );
    assert_eq!(
        errno(fs::remove_dir(m.join("a/b"))),
        libc::ENOTEMPTY,
        "rmdir a/b"
    );
    write_file(&m.join("a/b/c/f"), b"x");
    assert_eq!(
        errno(fs::remove_dir(m.join("a/b/c"))),
        libc::ENOTEMPTY,
        "rmdir a/b/c with a file"
    );
    assert_eq!(
        errno(fs::remove_dir(m.join("a/b/c/f"))),
        libc::ENOTDIR,
        "rmdir of a file"
    );
    fs::remove_file(m.join("a/b/c/f")).unwrap();

    fs::remove_dir(m.join("a/b/c")).unwrap();
    fs::remove_dir(m.join("a/b")).unwrap();
    fs::remove_dir(m.join("a")).unwrap();
    assert!(list_dir(m.path()).is_empty());
    assert_eq!(errno(fs::metadata(m.join("a"))), libc::ENOENT);
    let keys = s3.list_keys(&b, "");
    assert!(keys.is_empty(), "objects left after rmdir: {keys:?}");

    // And the directory stays gone after a remount.
    let m = m.remount();
    assert!(list_dir(m.path()).is_empty());
}

#[test]
fn directory_with_2500_entries_lists_completely() {
    let s3 = s3();
    let b = s3.new_bucket("bigdir");
    let mut want = std::collections::BTreeSet::new();
    let mut objects = Vec::new();
    for i in 0..2500 {
        let name = format!("f-{i:05}");
        objects.push((format!("big/{name}"), format!("{i}").into_bytes()));
        want.insert(name);
    }
    // Subdirectories that exist only as key prefixes.
    for d in ["sub-a", "sub-b", "sub-c"] {
        objects.push((format!("big/{d}/inner"), b"i".to_vec()));
        want.insert(d.to_string());
    }
    s3.put_many(&b, objects, 32);
    let m = Mount::s3(&b);
    for i in 0..5 {
        let name = format!("m-{i}");
        write_file(&m.join("big").join(&name), name.as_bytes());
        want.insert(name);
    }
    let got = list_dir(&m.join("big"));
    assert_eq!(got.len(), want.len(), "number of entries of big/");
    assert_eq!(got, want);
    // Types from the listing.
    let mut dirs = 0;
    for e in fs::read_dir(m.join("big")).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            dirs += 1;
            assert!(e.file_name().to_str().unwrap().starts_with("sub-"));
        }
    }
    assert_eq!(dirs, 3);
    assert_eq!(fs::read(m.join("big/f-01234")).unwrap(), b"1234");
    // Cold, after a remount.
    let m = m.remount();
    assert_eq!(list_dir(&m.join("big")), want);
}

#[test]
fn rename_file() {
    let s3 = s3();
    let b = s3.new_bucket("renfile");
    let m = Mount::s3(&b);
    let data = pattern::bytes(11, 3 * MIB + 17);
    write_file(&m.join("old.bin"), &data);
    fs::create_dir(m.join("dir")).unwrap();
    fs::rename(m.join("old.bin"), m.join("dir/new.bin")).unwrap();
    assert_eq!(errno(fs::metadata(m.join("old.bin"))), libc::ENOENT);
    assert!(
        read_file(&m.join("dir/new.bin")) == data,
        "content after rename"
    );
    assert!(
        s3.head(&b, "old.bin").is_none(),
        "old key still in the bucket"
    );
    assert!(
        s3.get(&b, "dir/new.bin").unwrap() == data,
        "new object content"
    );
    assert_eq!(list_dir(m.path()), set(["dir"]));
    assert_eq!(list_dir(&m.join("dir")), set(["new.bin"]));
}

#[test]
fn rename_over_existing_file_replaces_it() {
    let s3 = s3();
    let b = s3.new_bucket("renover");
    let m = Mount::s3(&b);
    write_file(&m.join("src"), b"new content");
    write_file(&m.join("dst"), b"old content that is longer");
    fs::rename(m.join("src"), m.join("dst")).unwrap();
    assert_eq!(read_file(&m.join("dst")), b"new content");
    assert_eq!(fs::metadata(m.join("dst")).unwrap().len(), 11);
    assert_eq!(errno(fs::metadata(m.join("src"))), libc::ENOENT);
    assert_eq!(list_dir(m.path()), set(["dst"]));
    assert_eq!(s3.get(&b, "dst").unwrap(), b"new content");
    assert!(s3.head(&b, "src").is_none());
    let m = m.remount();
    assert_eq!(read_file(&m.join("dst")), b"new content");
}

#[test]
fn rename_directory_with_contents() {
    let s3 = s3();
    let b = s3.new_bucket("rendir");
    let m = Mount::s3(&b);
    run("mkdir", &["-p", m.join("d1/sub/empty").to_str().unwrap()]);
    write_file(&m.join("d1/f1"), b"one");
    write_file(&m.join("d1/sub/f2"), b"two");
    let big = pattern::bytes(5, 6 * MIB);
    write_file(&m.join("d1/sub/big"), &big);
    // A key that shares the string prefix but is not inside d1/.
    write_file(&m.join("d1x"), b"sibling");

    fs::rename(m.join("d1"), m.join("d2")).unwrap();
    assert_eq!(errno(fs::metadata(m.join("d1"))), libc::ENOENT);
    assert_eq!(list_dir(m.path()), set(["d1x", "d2"]));
    assert_eq!(list_dir(&m.join("d2")), set(["f1", "sub"]));
    assert_eq!(list_dir(&m.join("d2/sub")), set(["big", "empty", "f2"]));
    assert_eq!(read_file(&m.join("d2/f1")), b"one");
    assert_eq!(read_file(&m.join("d2/sub/f2")), b"two");
    assert!(read_file(&m.join("d2/sub/big")) == big);
    assert_eq!(read_file(&m.join("d1x")), b"sibling");

    let keys = s3.list_keys(&b, "");
    assert!(
        !keys.iter().any(|k| k.starts_with("d1/")),
        "keys left under d1/: {keys:?}"
    );
    for k in ["d2/f1", "d2/sub/f2", "d2/sub/big", "d2/sub/empty/", "d1x"] {
        assert!(keys.contains(k), "{k} missing in the bucket: {keys:?}");
    }
    assert_eq!(s3.get(&b, "d2/sub/f2").unwrap(), b"two");

    let m = m.remount();
    assert_eq!(list_dir(&m.join("d2/sub")), set(["big", "empty", "f2"]));
    assert_eq!(read_file(&m.join("d2/f1")), b"one");
}

#[test]
fn unlink_removes_file_and_object() {
    let s3 = s3();
    let b = s3.new_bucket("unlink");
    let m = Mount::s3(&b);
    write_file(&m.join("keep"), b"k");
    write_file(&m.join("gone"), b"g");
    assert!(s3.head(&b, "gone").is_some());
    fs::remove_file(m.join("gone")).unwrap();
    assert_eq!(list_dir(m.path()), set(["keep"]));
    assert_eq!(errno(File::open(m.join("gone"))), libc::ENOENT);
    assert!(
        s3.head(&b, "gone").is_none(),
        "object still in the bucket after unlink"
    );
    assert_eq!(errno(fs::remove_file(m.join("gone"))), libc::ENOENT);
    fs::create_dir(m.join("d")).unwrap();
    let e = errno(fs::remove_file(m.join("d")));
    assert!(
        e == libc::EISDIR || e == libc::EPERM,
        "unlink of a directory: errno {e}"
    );
    let m = m.remount();
    assert_eq!(list_dir(m.path()), set(["d", "keep"]));
}

/// POSIX keeps an unlinked file for the descriptors still open on it: one open for reading
/// (its object stored) and one being written (parts streamed, so only the open upload holds
/// them) both read every byte after the unlink. The bucket keeps their objects under a hidden
/// key, never listed, until the last close.
#[test]
fn unlinked_open_files_stay_readable_until_closed() {
    let s3 = s3();
    let b = s3.new_bucket("unlinkopen");
    let m = Mount::s3(&b);
    let stored = pattern::bytes(41, 3 << 20);
    s3.put(&b, "stored", stored.clone());
    let mut reader = File::open(m.join("stored")).unwrap();
    let mut first = vec![0u8; 1 << 20];
    reader.read_exact(&mut first).unwrap();

    let mut writer = fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .read(true)
        .write(true)
        .open(m.join("scratch"))
        .unwrap();
    pattern::write(&mut writer, 42, 40 << 20).unwrap();

    fs::remove_file(m.join("stored")).unwrap();
    fs::remove_file(m.join("scratch")).unwrap();
    assert_eq!(list_dir(m.path()), set([]));
    assert_eq!(errno(File::open(m.join("stored"))), libc::ENOENT);
    let keys = s3.list_keys(&b, "");
    assert!(
        !keys.contains("stored") && !keys.contains("scratch"),
        "{keys:?}"
    );

    let mut rest = Vec::new();
    reader.read_to_end(&mut rest).unwrap();
    first.extend_from_slice(&rest);
    assert!(
        first == stored,
        "the unlinked file read back different bytes"
    );
    writer.seek(SeekFrom::Start(0)).unwrap();
    pattern::check_reader(&mut writer, 42, 40 << 20).unwrap();

    drop(reader);
    close_checked(writer).unwrap();
    // The kernel sends RELEASE after close(2) has returned: give it a moment.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !s3.list_keys(&b, "").is_empty() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(s3.list_keys(&b, ""), std::collections::BTreeSet::new());
    assert!(s3.list_multipart_uploads(&b).is_empty());
}

/// The "write a temp file and rename it over" save, while another descriptor has the old file
/// open for reading and one for writing: the name gives the new file at once, both descriptors
/// keep the old one, and closing the old writer does not publish over the new file.
#[test]
fn renaming_over_an_open_file_keeps_it_for_its_descriptors() {
    let s3 = s3();
    let b = s3.new_bucket("renameover");
    let m = Mount::s3(&b);
    let old = pattern::bytes(43, 3 << 20);
    s3.put(&b, "data", old.clone());
    let mut reader = File::open(m.join("data")).unwrap();
    let mut writer = fs::OpenOptions::new()
        .append(true)
        .open(m.join("data"))
        .unwrap();
    writer.write_all(b"tail").unwrap();

    write_file(&m.join("data.tmp"), b"the new file");
    fs::rename(m.join("data.tmp"), m.join("data")).unwrap();
    assert_eq!(fs::read(m.join("data")).unwrap(), b"the new file");
    assert_eq!(s3.get(&b, "data").as_deref(), Some(&b"the new file"[..]));

    let mut got = Vec::new();
    reader.read_to_end(&mut got).unwrap();
    let mut expect = old;
    expect.extend_from_slice(b"tail");
    assert!(got == expect, "the replaced file read back different bytes");
    close_checked(writer).unwrap();
    drop(reader);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while s3.list_keys(&b, "").len() > 1 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(s3.list_keys(&b, ""), set(["data"]));
    assert_eq!(s3.get(&b, "data").as_deref(), Some(&b"the new file"[..]));
}

#[test]
fn symlink_and_readlink() {
    let s3 = s3();
    let b = s3.new_bucket("symlink");
    // A short stat TTL: the foreign link below is added after this mount listed the directory.
    let m = MountSpec::s3(&b, "").arg("--stat-ttl").arg("1").mount();
    write_file(&m.join("real.txt"), b"real content");
    std::os::unix::fs::symlink("real.txt", m.join("link")).unwrap();
    std::os::unix::fs::symlink("../some/where else", m.join("dangling")).unwrap();

    let check = |m: &Mount| {
        assert_eq!(
            fs::read_link(m.join("link")).unwrap(),
            Path::new("real.txt")
        );
        assert_eq!(
            fs::read_link(m.join("dangling")).unwrap(),
            Path::new("../some/where else")
        );
        let md = fs::symlink_metadata(m.join("link")).unwrap();
        assert!(md.file_type().is_symlink(), "lstat type of link");
        assert_eq!(
            md.len(),
            "real.txt".len() as u64,
            "size of a symlink is its target length"
        );
        assert_eq!(
            read_file(&m.join("link")),
            b"real content",
            "reading through the link"
        );
        assert_eq!(errno(fs::metadata(m.join("dangling"))), libc::ENOENT);
        assert_eq!(list_dir(m.path()), set(["dangling", "link", "real.txt"]));
    };
    check(&m);
    // s3fs format: the body is the target, the mode says S_IFLNK.
    assert_eq!(s3.get(&b, "link").unwrap(), b"real.txt");
    assert_eq!(s3.get(&b, "dangling").unwrap(), b"../some/where else");
    let h = head(&b, "link");
    assert_eq!(
        meta_u32(&h, "mode") & S_IFMT,
        S_IFLNK,
        "mode of the link object"
    );
    let m = m.remount();
    check(&m);
    // A symlink created by another tool in the s3fs format. The directory was just listed, so
    // the new name shows once that listing is older than the stat TTL (see README, coherence).
    std::thread::sleep(std::time::Duration::from_millis(1100));
    s3.put_with_meta(
        &b,
        "foreign-link",
        "real.txt",
        &[("mode", &(S_IFLNK | 0o777).to_string())],
    );
    assert_eq!(
        fs::read_link(m.join("foreign-link")).unwrap(),
        Path::new("real.txt")
    );
}

#[test]
fn chmod_chown_touch_persist_across_remount() {
    let s3 = s3();
    let b = s3.new_bucket("attrs");
    let m = Mount::s3(&b);
    write_file(&m.join("f"), b"data");
    write_file(&m.join("g"), b"data2");
    fs::create_dir(m.join("d")).unwrap();

    fs::set_permissions(m.join("f"), Permissions::from_mode(0o750)).unwrap();
    // Root (as in CI) can give files away; other users can only chown to themselves.
    // SAFETY: getuid/getgid cannot fail.
    let (uid, gid) = match unsafe { (libc::getuid(), libc::getgid()) } {
        (0, _) => (1234, 5678),
        ids => ids,
    };
    std::os::unix::fs::chown(m.join("f"), Some(uid), Some(gid)).unwrap();
    run(
        "touch",
        &["-m", "-d", "@1600000000", m.join("f").to_str().unwrap()],
    );
    fs::set_permissions(m.join("d"), Permissions::from_mode(0o700)).unwrap();
    // futimens on an open descriptor.
    let g = fs::OpenOptions::new()
        .write(true)
        .open(m.join("g"))
        .unwrap();
    g.set_modified(UNIX_EPOCH + Duration::from_secs(1_500_000_000))
        .unwrap();
    close_checked(g).unwrap();

    let check = |m: &Mount, when: &str| {
        let md = fs::metadata(m.join("f")).unwrap();
        assert_eq!(md.mode(), S_IFREG | 0o750, "{when}: mode of f");
        assert_eq!((md.uid(), md.gid()), (uid, gid), "{when}: owner of f");
        assert_eq!(md.mtime(), 1_600_000_000, "{when}: mtime of f");
        assert_eq!(md.len(), 4, "{when}: size of f");
        assert_eq!(
            mode_string(&m.join("f")),
            "-rwxr-x---",
            "{when}: ls -l of f"
        );
        let ls = ls_ld(&m.join("f"));
        assert_eq!(
            (ls[2].as_str(), ls[3].as_str()),
            (uid.to_string().as_str(), gid.to_string().as_str()),
            "{when}: ls -ln owner"
        );
        assert_eq!(ls[5], "1600000000", "{when}: ls mtime");
        assert_eq!(
            mode_string(&m.join("d")),
            "drwx------",
            "{when}: ls -ld of d"
        );
        assert_eq!(
            fs::metadata(m.join("g")).unwrap().mtime(),
            1_500_000_000,
            "{when}: g"
        );
        assert_eq!(read_file(&m.join("f")), b"data", "{when}: content kept");
    };
    check(&m, "same mount");

    let h = head(&b, "f");
    assert_eq!(
        meta_u32(&h, "mode"),
        S_IFREG | 0o750,
        "x-amz-meta-mode (decimal st_mode)"
    );
    assert_eq!(meta_u32(&h, "uid"), uid);
    assert_eq!(meta_u32(&h, "gid"), gid);
    assert_eq!(meta_secs(&h, "mtime"), 1_600_000_000.0);
    assert_eq!(meta_secs(&head(&b, "g"), "mtime"), 1_500_000_000.0);
    assert_eq!(
        meta_u32(&head(&b, "d/"), "mode"),
        S_IFDIR | 0o700,
        "mode of the d/ marker"
    );
    assert_eq!(
        s3.get(&b, "f").unwrap(),
        b"data",
        "chmod kept the object's content"
    );

    let m = m.remount();
    check(&m, "after remount");

    // A 0755 file is stored as 33261, like s3fs does.
    fs::set_permissions(m.join("f"), Permissions::from_mode(0o755)).unwrap();
    assert_eq!(
        head(&b, "f").meta.get("mode").map(String::as_str),
        Some("33261")
    );
}

#[test]
fn objects_put_directly_appear_as_files_and_directories() {
    let s3 = s3();
    let b = s3.new_bucket("foreign");
    s3.put(&b, "a.txt", "hello");
    s3.put(&b, "dir1/b.txt", "bee content");
    let c = pattern::bytes(21, 2 * MIB + 3);
    s3.put(&b, "deep/er/c.txt", c.clone());
    let m = Mount::s3(&b);

    assert_eq!(list_dir(m.path()), set(["a.txt", "deep", "dir1"]));
    assert_eq!(list_dir(&m.join("dir1")), set(["b.txt"]));
    assert_eq!(list_dir(&m.join("deep")), set(["er"]));
    assert_eq!(list_dir(&m.join("deep/er")), set(["c.txt"]));
    for d in ["dir1", "deep", "deep/er"] {
        let md = fs::metadata(m.join(d)).unwrap();
        assert!(md.is_dir(), "{d} is a directory");
        assert_eq!(
            md.mode() & 0o7777,
            0o755,
            "default mode of implied directory {d}"
        );
    }
    let md = fs::metadata(m.join("a.txt")).unwrap();
    assert!(md.is_file());
    assert_eq!(md.len(), 5);
    assert_eq!(
        md.mode() & 0o7777,
        0o644,
        "default mode of a file without metadata"
    );
    assert_eq!(fs::metadata(m.join("dir1/b.txt")).unwrap().len(), 11);
    assert_eq!(
        fs::metadata(m.join("deep/er/c.txt")).unwrap().len(),
        c.len() as u64
    );
    assert_eq!(read_file(&m.join("a.txt")), b"hello");
    assert_eq!(read_file(&m.join("dir1/b.txt")), b"bee content");
    assert!(read_file(&m.join("deep/er/c.txt")) == c);
    // mtime of an object without metadata is its Last-Modified.
    let mt = fs::metadata(m.join("a.txt")).unwrap().mtime();
    assert!(
        (mt - unix_now()).abs() < 600,
        "mtime {mt} is not the upload time"
    );
    // Stat of a name that exists neither as object nor as prefix.
    assert_eq!(errno(fs::metadata(m.join("nope"))), libc::ENOENT);
    assert_eq!(errno(fs::metadata(m.join("dir1/nope"))), libc::ENOENT);
    // Writing into an implied directory.
    write_file(&m.join("deep/er/new"), b"n");
    assert_eq!(s3.get(&b, "deep/er/new").unwrap(), b"n");
}

#[test]
fn prefix_mount_shows_only_the_prefix() {
    let s3 = s3();
    let b = s3.new_bucket("prefix");
    s3.put(&b, "some/prefix/x.txt", "inside");
    s3.put(&b, "some/prefix/sub/y.txt", "deeper");
    s3.put(
        &b,
        "some/prefixed.txt",
        "sibling with the same string prefix",
    );
    s3.put(&b, "some/other.txt", "outside");
    s3.put(&b, "top.txt", "outside");
    let m = Mount::s3_prefix(&b, "some/prefix");
    assert_eq!(list_dir(m.path()), set(["sub", "x.txt"]));
    assert_eq!(read_file(&m.join("x.txt")), b"inside");
    assert_eq!(read_file(&m.join("sub/y.txt")), b"deeper");
    assert_eq!(errno(fs::metadata(m.join("top.txt"))), libc::ENOENT);
    write_file(&m.join("w.txt"), b"written");
    fs::create_dir(m.join("newdir")).unwrap();
    // mkdir stores the marker in the background; fsync of the parent waits for it.
    File::open(m.path()).unwrap().sync_all().unwrap();
    assert_eq!(s3.get(&b, "some/prefix/w.txt").unwrap(), b"written");
    assert!(
        s3.head(&b, "some/prefix/newdir/").is_some(),
        "marker of newdir"
    );
    assert!(s3.head(&b, "w.txt").is_none());
}

#[test]
fn prefix_mount_of_a_missing_prefix() {
    let s3 = s3();
    let b = s3.new_bucket("noprefix");
    s3.put(&b, "elsewhere.txt", "x");
    let m = Mount::s3_prefix(&b, "some/prefix");
    assert!(
        list_dir(m.path()).is_empty(),
        "a mount of a missing prefix starts empty"
    );
    write_file(&m.join("file"), b"through the prefix");
    run("mkdir", &["-p", m.join("a/b").to_str().unwrap()]);
    write_file(&m.join("a/b/c"), b"nested");
    assert_eq!(
        s3.get(&b, "some/prefix/file").unwrap(),
        b"through the prefix"
    );
    assert_eq!(s3.get(&b, "some/prefix/a/b/c").unwrap(), b"nested");
    let keys = s3.list_keys(&b, "");
    assert!(
        keys.iter()
            .all(|k| k == "elsewhere.txt" || k.starts_with("some/prefix/")),
        "keys written outside the prefix: {keys:?}"
    );
    let m = m.remount();
    assert_eq!(list_dir(m.path()), set(["a", "file"]));
}

#[test]
fn written_files_are_plain_objects_with_metadata() {
    let s3 = s3();
    let b = s3.new_bucket("plain");
    let m = Mount::s3(&b);
    let before = unix_now();
    write_file(&m.join("doc.txt"), b"plain bytes\n");
    let data = pattern::bytes(31, 20 * MIB + 5);
    write_file(&m.join("multi.bin"), &data);
    let after = unix_now();
    let perm = 0o666 & !process_umask();
    // SAFETY: getuid/getgid cannot fail.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };

    assert_eq!(s3.get(&b, "doc.txt").unwrap(), b"plain bytes\n");
    assert!(
        s3.get(&b, "multi.bin").unwrap() == data,
        "multipart object content"
    );
    for key in ["doc.txt", "multi.bin"] {
        let h = head(&b, key);
        assert_eq!(
            meta_u32(&h, "mode"),
            S_IFREG | perm,
            "{key}: x-amz-meta-mode"
        );
        assert_eq!(meta_u32(&h, "uid"), uid, "{key}: x-amz-meta-uid");
        assert_eq!(meta_u32(&h, "gid"), gid, "{key}: x-amz-meta-gid");
        let mt = meta_secs(&h, "mtime");
        assert!(
            mt >= before as f64 - 2.0 && mt <= after as f64 + 2.0,
            "{key}: x-amz-meta-mtime {mt} not within [{before}, {after}]"
        );
    }
    // Nothing else: no temp objects, no markers for the root.
    assert_eq!(s3.list_keys(&b, ""), set(["doc.txt", "multi.bin"]));
    assert!(s3.list_multipart_uploads(&b).is_empty());
    // An overwrite of part of a file is published as a new whole object.
    let mut f = fs::OpenOptions::new()
        .write(true)
        .open(m.join("doc.txt"))
        .unwrap();
    f.seek(SeekFrom::Start(6)).unwrap();
    f.write_all(b"BYTES").unwrap();
    close_checked(f).unwrap();
    assert_eq!(s3.get(&b, "doc.txt").unwrap(), b"plain BYTES\n");
}

#[test]
fn append_overwrite_and_truncate_existing_files() {
    let s3 = s3();
    let b = s3.new_bucket("rewrite");
    let m = Mount::s3(&b);
    let p = m.join("f");
    let mut want = pattern::bytes(41, 9 * MIB + 5);
    write_file(&p, &want);

    // Append (O_APPEND) to a multipart-sized object.
    let mut f = fs::OpenOptions::new().append(true).open(&p).unwrap();
    f.write_all(&[b'A'; 100]).unwrap();
    close_checked(f).unwrap();
    want.extend_from_slice(&[b'A'; 100]);
    assert!(read_file(&p) == want, "content after append");
    assert!(s3.get(&b, "f").unwrap() == want, "object after append");

    // Overwrite 10 bytes in the middle.
    let mut f = fs::OpenOptions::new().write(true).open(&p).unwrap();
    f.seek(SeekFrom::Start(4 * MIB as u64 + 3)).unwrap();
    f.write_all(&[b'B'; 10]).unwrap();
    close_checked(f).unwrap();
    want[4 * MIB + 3..4 * MIB + 13].copy_from_slice(&[b'B'; 10]);
    assert_eq!(fs::metadata(&p).unwrap().len(), want.len() as u64);
    assert!(read_file(&p) == want, "content after overwrite");
    assert!(s3.get(&b, "f").unwrap() == want, "object after overwrite");

    // truncate(2) on the path: shrink, then extend with zeros.
    let f = fs::OpenOptions::new().write(true).open(&p).unwrap();
    f.set_len(3 * MIB as u64).unwrap();
    close_checked(f).unwrap();
    want.truncate(3 * MIB);
    assert_eq!(fs::metadata(&p).unwrap().len(), 3 * MIB as u64);
    assert!(s3.get(&b, "f").unwrap() == want, "object after shrinking");
    run(
        "truncate",
        &["-s", &(3 * MIB + 1000).to_string(), p.to_str().unwrap()],
    );
    want.resize(3 * MIB + 1000, 0);
    assert!(read_file(&p) == want, "content after extending");
    assert!(s3.get(&b, "f").unwrap() == want, "object after extending");

    // O_TRUNC of an existing file.
    write_file(&p, b"short");
    assert_eq!(s3.get(&b, "f").unwrap(), b"short");
    assert!(s3.list_multipart_uploads(&b).is_empty());

    let m = m.remount();
    assert_eq!(read_file(&m.join("f")), b"short");
}

/// `: > f` (an open with `O_TRUNC`) of a file another process holds open for writing: the
/// truncation is stored at that open's close, as any change through a descriptor is. Before,
/// the kernel sent it as a SETATTR without the descriptor, which therefore had changed
/// nothing: the bucket kept the old bytes until the other writer's close (and for good had
/// the daemon died first). `O_RDONLY|O_TRUNC` truncates too, as on Linux file systems.
#[test]
fn an_o_trunc_open_of_a_file_another_process_writes_stores_the_truncation() {
    let s3 = s3();
    let b = s3.new_bucket("otrunc");
    let m = Mount::s3(&b);
    let p = m.join("app.log");
    write_file(&p, b"old content\n");
    let mut w = ForeignWriter::start();
    assert_eq!(w.cmd(&format!("append a {}", p.display())), "ok");
    let f = fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(&p)
        .unwrap();
    close_checked(f).unwrap();
    assert_eq!(s3.get(&b, "app.log").as_deref(), Some(&b""[..]));
    assert_eq!(w.cmd("text a more"), "ok");
    assert_eq!(w.cmd("close a"), "ok");
    assert_eq!(s3.get(&b, "app.log").as_deref(), Some(&b"more"[..]));
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a NUL-terminated path; the descriptor is closed right after.
    let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDONLY | libc::O_TRUNC) };
    assert!(fd >= 0, "{}", std::io::Error::last_os_error());
    // SAFETY: the descriptor just opened.
    assert_eq!(unsafe { libc::close(fd) }, 0);
    assert_eq!(fs::metadata(&p).unwrap().len(), 0);
    assert_eq!(s3.get(&b, "app.log").as_deref(), Some(&b""[..]));
}

#[test]
fn mmap_read_and_shared_write() {
    use std::os::unix::io::AsRawFd;
    let s3 = s3();
    let b = s3.new_bucket("mmap");
    let m = Mount::s3(&b);
    let p = m.join("mapped");
    let mut want = pattern::bytes(51, 100_000);
    write_file(&p, &want);
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&p)
        .unwrap();
    let len = want.len();
    // SAFETY: a fresh shared mapping of `len` bytes of an open file, unmapped below; the
    // slices made from it stay within `len`.
    unsafe {
        let ptr = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        );
        assert_ne!(
            ptr,
            libc::MAP_FAILED,
            "mmap: {}",
            std::io::Error::last_os_error()
        );
        let map = std::slice::from_raw_parts_mut(ptr as *mut u8, len);
        assert!(map[..] == want[..], "content read through mmap");
        map[5000..5008].copy_from_slice(b"MMAPPED!");
        assert_eq!(
            libc::msync(ptr, len, libc::MS_SYNC),
            0,
            "msync: {}",
            std::io::Error::last_os_error()
        );
        assert_eq!(libc::munmap(ptr, len), 0);
    }
    close_checked(f).unwrap();
    want[5000..5008].copy_from_slice(b"MMAPPED!");
    assert!(
        s3.get(&b, "mapped").unwrap() == want,
        "object after a shared mmap write"
    );
    let m = m.remount();
    assert!(read_file(&m.join("mapped")) == want);
}

/// Write-only descriptors bypass the page cache (FOPEN_DIRECT_IO); readers that already hold
/// cached pages, through read(2) or a mapping, must still see those writes.
#[test]
fn readers_with_cached_pages_see_writes_through_a_write_only_descriptor() {
    use std::os::unix::fs::FileExt;
    use std::os::unix::io::AsRawFd;
    let s3 = s3();
    let b = s3.new_bucket("wronly");
    let m = Mount::s3(&b);
    let p = m.join("shared");
    let mut want = pattern::bytes(52, 3 * 4096);
    write_file(&p, &want);
    let reader = File::open(&p).unwrap();
    let mut seen = vec![0u8; want.len()];
    reader.read_exact_at(&mut seen, 0).unwrap();
    assert!(seen == want);
    let len = want.len();
    // SAFETY: a read-only shared mapping of `len` bytes of an open file, unmapped below; the
    // slice made from it stays within `len`.
    let map = unsafe {
        let ptr = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            reader.as_raw_fd(),
            0,
        );
        assert_ne!(ptr, libc::MAP_FAILED, "mmap");
        ptr
    };
    // SAFETY: `map` is a live mapping of `len` bytes.
    let mapped = || unsafe { std::slice::from_raw_parts(map as *const u8, len).to_vec() };
    assert!(mapped() == want);
    let writer = fs::OpenOptions::new().write(true).open(&p).unwrap();
    writer.write_all_at(b"REWRITTEN", 4096 + 10).unwrap();
    want[4096 + 10..4096 + 19].copy_from_slice(b"REWRITTEN");
    reader.read_exact_at(&mut seen, 0).unwrap();
    assert!(seen == want, "read(2) after the write");
    assert!(mapped() == want, "the mapping after the write");
    close_checked(writer).unwrap();
    assert!(s3.get(&b, "shared").unwrap() == want);
    // SAFETY: unmapping the mapping made above, which nothing uses any more.
    assert_eq!(unsafe { libc::munmap(map, len) }, 0);
}

#[test]
fn unsupported_operations_fail_cleanly_and_locks_are_local() {
    use std::os::unix::io::AsRawFd;
    let s3 = s3();
    let b = s3.new_bucket("unsupported");
    let m = Mount::s3(&b);
    write_file(&m.join("f"), b"x");
    // Hard links cannot exist in a bucket.
    assert_eq!(
        errno(fs::hard_link(m.join("f"), m.join("hard"))),
        libc::EPERM,
        "link(2)"
    );
    assert!(s3.head(&b, "hard").is_none());
    // Neither can FIFOs.
    let fifo = std::ffi::CString::new(m.join("fifo").to_str().unwrap()).unwrap();
    // SAFETY: mkfifo with a valid NUL-terminated path.
    let r = unsafe { libc::mkfifo(fifo.as_ptr(), 0o644) };
    assert_eq!(r, -1, "mkfifo succeeded");
    assert_eq!(
        std::io::Error::last_os_error().raw_os_error(),
        Some(libc::EPERM),
        "mkfifo"
    );
    // Extended attributes are not supported.
    let path = std::ffi::CString::new(m.join("f").to_str().unwrap()).unwrap();
    let name = std::ffi::CString::new("user.test").unwrap();
    // SAFETY: setxattr/getxattr with valid C strings and buffers of the given sizes.
    let (set, set_err, get, get_err) = unsafe {
        let set = libc::setxattr(path.as_ptr(), name.as_ptr(), b"v".as_ptr().cast(), 1, 0);
        let set_err = std::io::Error::last_os_error().raw_os_error();
        let mut buf = [0u8; 16];
        let get = libc::getxattr(path.as_ptr(), name.as_ptr(), buf.as_mut_ptr().cast(), 16);
        let get_err = std::io::Error::last_os_error().raw_os_error();
        (set, set_err, get, get_err)
    };
    assert_eq!((set, set_err), (-1, Some(libc::EOPNOTSUPP)), "setxattr");
    assert_eq!((get, get_err), (-1, Some(libc::EOPNOTSUPP)), "getxattr");
    // flock works between descriptors of this machine.
    let a = File::open(m.join("f")).unwrap();
    let c = File::open(m.join("f")).unwrap();
    // SAFETY: flock on open descriptors.
    unsafe {
        assert_eq!(libc::flock(a.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB), 0);
        assert_eq!(
            libc::flock(c.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB),
            -1
        );
        assert_eq!(
            std::io::Error::last_os_error().raw_os_error(),
            Some(libc::EWOULDBLOCK)
        );
        assert_eq!(libc::flock(a.as_raw_fd(), libc::LOCK_UN), 0);
        assert_eq!(libc::flock(c.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB), 0);
    }
}

#[test]
fn rename_noreplace_and_directory_rename_limit() {
    let s3 = s3();
    let b = s3.new_bucket("renlimit");
    let m = MountSpec::s3(&b, "")
        .arg("--max-dir-rename")
        .arg("3")
        .mount();
    write_file(&m.join("a"), b"a");
    write_file(&m.join("b"), b"b");
    let c = |p: &Path| std::ffi::CString::new(p.to_str().unwrap()).unwrap();
    let (pa, pb) = (c(&m.join("a")), c(&m.join("b")));
    // SAFETY: renameat2 with valid NUL-terminated paths.
    let r = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            pa.as_ptr(),
            libc::AT_FDCWD,
            pb.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    assert_eq!(r, -1, "RENAME_NOREPLACE over an existing file succeeded");
    assert_eq!(
        std::io::Error::last_os_error().raw_os_error(),
        Some(libc::EEXIST)
    );
    assert_eq!(read_file(&m.join("b")), b"b");
    assert_eq!(s3.get(&b, "a").unwrap(), b"a");

    // A directory with more objects than --max-dir-rename: EXDEV, nothing moved.
    fs::create_dir(m.join("big")).unwrap();
    for i in 0..5 {
        write_file(&m.join(format!("big/f{i}")), b"x");
    }
    assert_eq!(
        errno(fs::rename(m.join("big"), m.join("moved"))),
        libc::EXDEV
    );
    assert_eq!(list_dir(&m.join("big")).len(), 5);
    assert_eq!(errno(fs::metadata(m.join("moved"))), libc::ENOENT);
    assert!(s3.list_keys(&b, "moved").is_empty());
    // mv falls back to copy + delete.
    run(
        "mv",
        &[
            m.join("big").to_str().unwrap(),
            m.join("moved").to_str().unwrap(),
        ],
    );
    assert_eq!(list_dir(&m.join("moved")).len(), 5);
    assert_eq!(errno(fs::metadata(m.join("big"))), libc::ENOENT);
    assert_eq!(s3.get(&b, "moved/f4").unwrap(), b"x");
    assert!(s3.list_keys(&b, "big/").is_empty());
}

/// Changes by another client show after the stat TTL, or at once after `bucketfs refresh`.
#[test]
fn refresh_shows_other_clients_changes_at_once() {
    let s3 = s3();
    let b = s3.new_bucket("refresh");
    s3.put(&b, "d/old.txt", "12345");
    // A long TTL, so only the refresh can explain what the test sees.
    let m = MountSpec::s3(&b, "").arg("--stat-ttl").arg("300").mount();
    assert_eq!(list_dir(&m.join("d")), set(["old.txt"]));
    assert_eq!(fs::metadata(m.join("d/old.txt")).unwrap().len(), 5);
    s3.put(&b, "d/old.txt", "1234567890");
    s3.put(&b, "d/new.txt", "new");
    // Cached: the old size, and the listing says new.txt does not exist.
    assert_eq!(fs::metadata(m.join("d/old.txt")).unwrap().len(), 5);
    assert_eq!(errno(fs::metadata(m.join("d/new.txt"))), libc::ENOENT);
    let refresh = |p: &Path| {
        let st = Command::new(bin()).arg("refresh").arg(p).status().unwrap();
        assert!(st.success(), "bucketfs refresh {}", p.display());
    };
    refresh(&m.join("d/old.txt"));
    refresh(&m.join("d/new.txt")); // unknown here: refreshes d
    assert_eq!(fs::metadata(m.join("d/old.txt")).unwrap().len(), 10);
    assert_eq!(read_file(&m.join("d/old.txt")), b"1234567890");
    assert_eq!(read_file(&m.join("d/new.txt")), b"new");
    // Not a bucketfs mount: a clear failure.
    let out = Command::new(bin())
        .arg("refresh")
        .arg(std::env::temp_dir())
        .output()
        .unwrap();
    assert!(!out.status.success());
}

/// `bucketfs refresh` on a read-only mount (a data set mounted with a long TTL, where it is
/// most needed): it works for a file and a directory, by an ioctl on the path opened for
/// reading. Before, it set an extended attribute, which the kernel refuses on a read-only
/// mount (`EROFS`) before the mount sees it.
#[test]
fn refresh_works_on_a_read_only_mount() {
    let s3 = s3();
    let b = s3.new_bucket("refreshro");
    s3.put(&b, "d/old.txt", "12345");
    let m = MountSpec::s3(&b, "")
        .arg("--stat-ttl")
        .arg("300")
        .arg("--read-only")
        .mount();
    assert_eq!(list_dir(&m.join("d")), set(["old.txt"]));
    assert_eq!(fs::metadata(m.join("d/old.txt")).unwrap().len(), 5);
    s3.put(&b, "d/old.txt", "1234567890");
    s3.put(&b, "d/new.txt", "new");
    assert_eq!(fs::metadata(m.join("d/old.txt")).unwrap().len(), 5);
    for p in [m.join("d/old.txt"), m.join("d")] {
        let out = Command::new(bin()).arg("refresh").arg(&p).output().unwrap();
        assert!(
            out.status.success(),
            "bucketfs refresh {}: {}",
            p.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    assert_eq!(fs::metadata(m.join("d/old.txt")).unwrap().len(), 10);
    assert_eq!(read_file(&m.join("d/old.txt")), b"1234567890");
    assert_eq!(list_dir(&m.join("d")), set(["old.txt", "new.txt"]));
}

/// Another client's change shows within one stat TTL of when this mount learnt the old
/// version, however the kernel asks: the daemon answers a lookup or a readdirplus from its
/// cache with what is left of the TTL, not a whole new one (the kernel would keep the old
/// attributes for up to two TTLs).
#[test]
fn other_clients_changes_show_within_one_stat_ttl() {
    let s3 = s3();
    let b = s3.new_bucket("kernelttl");
    s3.put(&b, "d/looked", "12345");
    s3.put(&b, "d/listed", "12345");
    let ttl = Duration::from_secs(4);
    let m = MountSpec::s3(&b, "").arg("--stat-ttl").arg("4").mount();
    let t0 = std::time::Instant::now();
    let sizes =
        |m: &Mount| ["looked", "listed"].map(|n| fs::metadata(m.join("d").join(n)).unwrap().len());
    // Learnt (by the LIST of d) no earlier than t0.
    assert_eq!(sizes(&m), [5, 5]);
    s3.put(&b, "d/looked", "1234567890");
    s3.put(&b, "d/listed", "1234567890");
    // Halfway through the TTL the kernel forgets the entries and asks again, one by a
    // lookup, one by a listing: the mount answers from its cache (the old size, still
    // within its TTL)...
    std::thread::sleep(ttl / 2);
    fs::write("/proc/sys/vm/drop_caches", "2").expect("drop_caches (needs root)");
    assert_eq!(fs::metadata(m.join("d/looked")).unwrap().len(), 5);
    let listed = ls_l(&m.join("d"));
    assert!(listed.iter().any(|(n, _, _)| n == "listed"), "{listed:?}");
    // ...and the kernel keeps those answers only for what is left of it: one TTL and a
    // second after the mount learnt the old sizes, both show the new ones.
    std::thread::sleep(
        (t0 + ttl + Duration::from_secs(1)).saturating_duration_since(std::time::Instant::now()),
    );
    let seen = sizes(&m);
    let late = t0.elapsed();
    assert!(
        late < ttl + ttl / 2,
        "the test ran too slowly to tell ({late:?})"
    );
    assert_eq!(seen, [10, 10], "the old sizes were kept past one stat TTL");
}

/// Creates `n` files with distinct modes and mtimes and a symlink in directory `d` of `m`,
/// and a directory `sub` with mode 0710 in the root. Returns the (name, permissions, mtime) of
/// each file.
fn make_ls_fixture(m: &Mount, n: u32) -> Vec<(String, u32, SystemTime)> {
    let t0 = UNIX_EPOCH + Duration::from_secs(1_500_000_000);
    let mut files = Vec::new();
    fs::create_dir(m.join("d")).unwrap();
    for i in 0..n {
        let name = format!("f{i:03}");
        let p = m.join("d").join(&name);
        write_file(&p, &vec![b'x'; i as usize]);
        let perm = 0o600 | (i % 64);
        fs::set_permissions(&p, Permissions::from_mode(perm)).unwrap();
        let mtime = t0 + Duration::from_secs(u64::from(i) * 3600);
        File::options()
            .write(true)
            .open(&p)
            .unwrap()
            .set_modified(mtime)
            .unwrap();
        files.push((name, perm, mtime));
    }
    std::os::unix::fs::symlink("f001", m.join("d/link")).unwrap();
    fs::create_dir(m.join("sub")).unwrap();
    fs::set_permissions(m.join("sub"), Permissions::from_mode(0o710)).unwrap();
    files
}

/// `ls -l`: the names with their d_type, then lstat of each.
fn ls_l(dir: &Path) -> Vec<(String, fs::FileType, fs::Metadata)> {
    let mut out: Vec<_> = fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let name = e.file_name().into_string().unwrap();
            let md = fs::symlink_metadata(e.path()).unwrap();
            (name, e.file_type().unwrap(), md)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn check_ls(
    entries: &[(String, fs::FileType, fs::Metadata)],
    files: &[(String, u32, SystemTime)],
    symlink_in_readdir: bool,
) {
    assert_eq!(
        entries.len(),
        files.len() + 1,
        "{:?}",
        entries.iter().map(|e| &e.0).collect::<Vec<_>>()
    );
    for (i, (name, perm, mtime)) in files.iter().enumerate() {
        let (n, ft, md) = &entries[i];
        assert_eq!(n, name);
        assert!(ft.is_file() && md.is_file(), "{name}");
        assert_eq!(md.mode() & 0o7777, *perm, "mode of {name}");
        assert_eq!(md.modified().unwrap(), *mtime, "mtime of {name}");
        assert_eq!(md.len(), i as u64, "size of {name}");
    }
    let (n, ft, md) = &entries[files.len()];
    assert_eq!(n, "link");
    // Without metadata in the listing, readdir cannot tell a symlink from a file.
    assert_eq!(
        ft.is_symlink(),
        symlink_in_readdir,
        "d_type of link: {ft:?}"
    );
    assert!(md.file_type().is_symlink(), "lstat of link");
}

/// A job opening files by name across many directories at once (file i in directory
/// i % 100, 64 threads, as the bench's small-file readers do) on a cold mount: each
/// directory's lookup lists its first page and that page answers the lookups of its files,
/// so the walk costs at most two LISTs per directory (a statahead's one-key LIST may come
/// first) and no HEAD per file. Before, a directory stat'ed ahead was looked up with no
/// page, and so were those whose pages many lookups at once pushed out: most files cost a
/// HEAD and a LIST of their own (323 LISTs and 149 HEADs here).
#[test]
fn files_opened_across_many_directories_at_once_cost_a_list_per_directory() {
    const DIRS: usize = 100;
    const FILES: usize = 600;
    let b = s3().new_bucket("lookup-wide");
    let keys: Vec<String> = (0..FILES)
        .map(|i| format!("t/d{:03}/f{i}", i % DIRS))
        .collect();
    for k in &keys {
        s3().put(&b, k, k.as_bytes().to_vec());
    }
    let m = Mount::s3(&b);
    let before = store_requests(m.path());
    let next = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..64 {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(k) = keys.get(i) else { return };
                assert_eq!(fs::read(m.join(k)).unwrap(), k.as_bytes(), "{k}");
            });
        }
    });
    let sent = requests_between(&before, &store_requests(m.path()));
    let lists = sent.get("list").copied().unwrap_or(0);
    let heads = sent.get("head").copied().unwrap_or(0);
    // 100 directories and t: a page each, and the one-key LISTs of the statahead.
    assert!(lists <= 2 * DIRS as u64 + 1, "{sent:?}");
    assert!(heads <= 5, "{sent:?}");
    assert_eq!(sent.get("get").copied(), Some(FILES as u64), "{sent:?}");
}

/// Issue 6: on MinIO, listings carry the user metadata (`metadata=true`), so a cold `ls -l`
/// of a directory costs its LIST pages and no HEAD at all, with the right modes and mtimes;
/// a listed subdirectory's stat costs one LIST (its marker's metadata comes with it).
#[test]
fn cold_ls_l_on_minio_is_one_list_and_no_head() {
    let b = s3().new_bucket("lsmeta");
    let m = Mount::s3(&b);
    let files = make_ls_fixture(&m, 50);
    let m = m.remount();
    // The directory itself first: a HEAD and a LIST (nothing listed it yet), whose page the
    // listing then uses, so `ls -l` sends nothing more.
    let cold = store_requests(m.path());
    assert!(fs::metadata(m.join("d")).unwrap().is_dir());
    let before = store_requests(m.path());
    let entries = ls_l(&m.join("d"));
    let after = store_requests(m.path());
    check_ls(&entries, &files, true);
    let sent = requests_between(&before, &after);
    assert!(sent.is_empty(), "requests of ls -l: {sent:?}");
    let sent = requests_between(&cold, &after);
    assert_eq!(sent.get("list"), Some(&1), "stat and ls -l: {sent:?}");
    assert_eq!(sent.get("head"), Some(&1), "stat and ls -l: {sent:?}");
    assert_eq!(sent.len(), 2, "stat and ls -l: {sent:?}");
    assert!(m.log().contains("server is MinIO"), "{}", m.log());
    // The target of a symlink is its body, fetched at readlink.
    assert_eq!(fs::read_link(m.join("d/link")).unwrap(), Path::new("f001"));

    // A listed subdirectory: one LIST, which carries its marker's metadata too.
    assert_eq!(list_dir(m.path()), set(["d", "sub"]));
    let before = store_requests(m.path());
    let md = fs::metadata(m.join("sub")).unwrap();
    let sent = requests_between(&before, &store_requests(m.path()));
    assert_eq!(md.mode() & 0o7777, 0o710);
    assert_eq!(
        sent.get("list"),
        Some(&1),
        "stat of a subdirectory: {sent:?}"
    );
    assert_eq!(sent.len(), 1, "stat of a subdirectory: {sent:?}");
}

/// A directory of exactly 1,000 files and its marker `big/` is 1,001 keys: its listing starts
/// with the page its lookup fetched from the marker on (1,000 keys), so `ls -l` after the
/// stat is the one LIST for the last file, and the whole cold `ls -l` two LISTs (a LIST page
/// holds 1,000 keys at most) and no HEAD; the marker's own attributes show.
#[test]
fn a_1000_file_directory_and_its_marker_cost_two_lists_cold() {
    let s3 = s3();
    let b = s3.new_bucket("ls1000");
    let fmode = (libc::S_IFREG | 0o640).to_string();
    let dmode = (libc::S_IFDIR | 0o750).to_string();
    s3.put_with_meta(&b, "big/", "", &[("mode", &dmode)]);
    s3.put_with_meta(&b, "tree/", "", &[("mode", &dmode)]);
    s3.put(&b, "tree/x", "x");
    let files: Vec<(String, Vec<u8>)> = (0..1000)
        .map(|i| (format!("big/f{i:04}"), format!("{i}").into_bytes()))
        .collect();
    s3.put_many(&b, files, 16);
    // put_many sends no metadata: give one file a mode to see that listings carry it.
    s3.put_with_meta(&b, "big/f0007", "7", &[("mode", &fmode)]);
    let m = Mount::s3(&b);
    assert_eq!(list_dir(m.path()), set(["big", "tree"]));
    let cold = store_requests(m.path());
    let md = fs::metadata(m.join("big")).unwrap();
    assert_eq!(md.mode() & 0o7777, 0o750, "the marker's mode");
    let before = store_requests(m.path());
    let entries = ls_l(&m.join("big"));
    let after = store_requests(m.path());
    let sent = requests_between(&before, &after);
    assert_eq!(entries.len(), 1000);
    assert_eq!(entries[7].0, "f0007");
    assert_eq!(entries[7].2.mode() & 0o7777, 0o640);
    assert_eq!(entries[999].2.len(), 3);
    assert_eq!(sent.get("list"), Some(&1), "requests of ls -l: {sent:?}");
    assert_eq!(sent.len(), 1, "requests of ls -l: {sent:?}");
    let sent = requests_between(&cold, &after);
    assert_eq!(sent.get("list"), Some(&2), "stat and ls -l: {sent:?}");
    assert_eq!(sent.len(), 1, "stat and ls -l: {sent:?}");
}

/// The bench's `ls -l` on a cold mount whose root was listed (as its readiness check does):
/// the stat of the directory is one LIST whose page the listing uses, no sibling is stat'ed
/// ahead, and the entries' attributes come with the listing: one LIST and no HEAD in all,
/// for 1,000 files in an implied directory and for a marker and 999 files (one page each).
#[test]
fn a_cold_ls_l_of_a_one_page_directory_is_one_list_and_no_head() {
    let s3 = s3();
    let b = s3.new_bucket("lsone");
    let dmode = (libc::S_IFDIR | 0o750).to_string();
    let fmode = (libc::S_IFREG | 0o640).to_string();
    let mut files: Vec<(String, Vec<u8>)> = (0..1000)
        .map(|i| (format!("implied/f{i:04}"), b"i".to_vec()))
        .collect();
    files.extend((0..999).map(|i| (format!("marked/f{i:04}"), b"mm".to_vec())));
    files.extend((0..50).map(|i| (format!("tree/a/f{i:02}"), b"t".to_vec())));
    s3.put_many(&b, files, 16);
    s3.put_with_meta(&b, "marked/", "", &[("mode", &dmode)]);
    s3.put_with_meta(&b, "tree/", "", &[("mode", &dmode)]);
    s3.put_with_meta(&b, "implied/f0003", "iii", &[("mode", &fmode)]);
    s3.put(&b, "top.txt", "top");
    for (dir, n, mode, size) in [("implied", 1000, 0o755, 1), ("marked", 999, 0o750, 2)] {
        let m = Mount::s3(&b);
        assert_eq!(
            list_dir(m.path()),
            set(["implied", "marked", "top.txt", "tree"])
        );
        let before = store_requests(m.path());
        let md = fs::metadata(m.join(dir)).unwrap();
        let entries = ls_l(&m.join(dir));
        let sent = requests_between(&before, &store_requests(m.path()));
        assert_eq!(md.mode() & 0o7777, mode, "{dir}");
        assert_eq!(entries.len(), n, "{dir}");
        assert!(entries.iter().skip(4).all(|e| e.2.len() == size), "{dir}");
        assert_eq!(sent.get("list"), Some(&1), "cold ls -l {dir}: {sent:?}");
        assert_eq!(sent.len(), 1, "cold ls -l {dir}: {sent:?}");
        if dir == "implied" {
            assert_eq!(entries[3].2.mode() & 0o7777, 0o640);
            assert_eq!(entries[3].2.len(), 3);
        }
    }
}

/// With `list_metadata=off` listings are plain and each file's attributes come from a HEAD,
/// as on servers without the extension; the result is the same.
#[test]
fn ls_l_with_list_metadata_off_heads_each_file() {
    let b = s3().new_bucket("lsplain");
    let m = MountSpec::s3(&b, "")
        .arg("-o")
        .arg("list_metadata=off")
        .mount();
    let files = make_ls_fixture(&m, 20);
    let m = m.remount();
    let before = store_requests(m.path());
    assert!(fs::metadata(m.join("d")).unwrap().is_dir());
    let entries = ls_l(&m.join("d"));
    let sent = requests_between(&before, &store_requests(m.path()));
    check_ls(&entries, &files, false);
    // The stat's LIST (its page is the listing's) and HEADs of d and its marker d/.
    assert_eq!(sent.get("list"), Some(&1), "requests of ls -l: {sent:?}");
    // One HEAD per entry (20 files and the link).
    let heads = sent.get("head").copied().unwrap_or(0) - 2;
    assert!((21..=23).contains(&heads), "requests of ls -l: {sent:?}");
    assert!(!m.log().contains("server is MinIO"), "{}", m.log());
    let md = fs::metadata(m.join("sub")).unwrap();
    assert_eq!(md.mode() & 0o7777, 0o710);
}

/// The root of a mount of a prefix keeps a chmod and chown across mounts (a Kubernetes
/// volume's fsGroup): they are stored on the prefix's marker and read back from it at the
/// next mount. An earlier build stored them and showed the defaults after every remount.
#[test]
fn a_prefix_mounts_root_keeps_its_mode_and_owner_across_mounts() {
    let s3 = s3();
    let b = s3.new_bucket("rootattr");
    let m = MountSpec::s3(&b, "vol").mount();
    let root = m.path().to_path_buf();
    fs::set_permissions(&root, Permissions::from_mode(0o2770)).unwrap();
    std::os::unix::fs::chown(&root, Some(1234), Some(2345)).unwrap();
    let h = head(&b, "vol/");
    assert_eq!(meta_u32(&h, "mode"), S_IFDIR | 0o2770);
    assert_eq!((meta_u32(&h, "uid"), meta_u32(&h, "gid")), (1234, 2345));
    let m = m.remount();
    let md = fs::metadata(m.path()).unwrap();
    assert_eq!(md.mode() & 0o7777, 0o2770, "mode after a remount");
    assert_eq!((md.uid(), md.gid()), (1234, 2345), "owner after a remount");
}
