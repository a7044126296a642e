//! Metadata is never dropped, and a descriptor opened after another client's change reads
//! whole versions (issue 17, items 3 and 7), through real mounts of a MinIO bucket, checked in
//! the bucket with the S3 API. Needs `scripts/test.sh` (MinIO + fuse3).

mod common;

use common::*;
use std::ffi::CString;
use std::fs::{self, File, OpenOptions, Permissions};
use std::io::{Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

fn head(bucket: &str, key: &str) -> Head {
    s3().head(bucket, key)
        .unwrap_or_else(|| panic!("object {bucket}/{key} does not exist"))
}

/// `x-amz-meta-mode` of an object (decimal `st_mode`).
fn stored_mode(bucket: &str, key: &str) -> u32 {
    let h = head(bucket, key);
    h.meta
        .get("mode")
        .and_then(|m| m.trim().parse().ok())
        .unwrap_or_else(|| panic!("{key}: no decimal x-amz-meta-mode: {:?}", h.meta))
}

/// `x-amz-meta-mtime` of an object, in seconds.
fn stored_mtime(bucket: &str, key: &str) -> f64 {
    let h = head(bucket, key);
    h.meta
        .get("mtime")
        .and_then(|m| m.trim().parse().ok())
        .unwrap_or_else(|| panic!("{key}: no x-amz-meta-mtime in seconds: {:?}", h.meta))
}

/// utimensat(2) of a path: `None` leaves that time alone (UTIME_OMIT).
fn set_times(path: &Path, atime: Option<i64>, mtime: Option<i64>) {
    let ts = |t: Option<i64>| match t {
        Some(s) => libc::timespec {
            tv_sec: s,
            tv_nsec: 0,
        },
        None => libc::timespec {
            tv_sec: 0,
            tv_nsec: libc::UTIME_OMIT,
        },
    };
    let times = [ts(atime), ts(mtime)];
    let c = CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path and two timespecs.
    let rc = unsafe { libc::utimensat(libc::AT_FDCWD, c.as_ptr(), times.as_ptr(), 0) };
    assert_eq!(
        rc,
        0,
        "utimensat {}: {}",
        path.display(),
        std::io::Error::last_os_error()
    );
}

fn secs(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH).unwrap().as_secs_f64()
}

/// mtime and ctime of a path as stat shows them now.
fn times(path: &Path) -> (SystemTime, SystemTime) {
    let md = fs::symlink_metadata(path).unwrap_or_else(|e| panic!("stat {}: {e}", path.display()));
    let ctime = UNIX_EPOCH + Duration::new(md.ctime() as u64, md.ctime_nsec() as u32);
    (md.modified().unwrap(), ctime)
}

/// Runs `f` and checks that it moved the mtime and ctime of `path` forward at once.
fn moves_times(what: &str, path: &Path, f: impl FnOnce()) {
    let before = times(path);
    std::thread::sleep(Duration::from_millis(20));
    f();
    let after = times(path);
    assert!(
        after.0 > before.0 && after.1 > before.1,
        "{what}: mtime/ctime of {} did not move: before {before:?}, after {after:?}",
        path.display()
    );
}

/// The rsync pattern, in a tight loop: the temporary file is made `O_EXCL` 0600, written,
/// closed, its times set, opened read-only and `fchmod`ed to 0664, closed, and renamed into
/// place. A chmod/utimens arriving while the last close was still being released was lost
/// (5-7 of 1,000 kept mode 0600 in the bucket while stat showed 0664 until remount).
/// Objects another tool wrote (no `x-amz-meta-mtime`: their mtime is their Last-Modified)
/// keep their mtime through `mv` of the file and of a directory above it, and through a
/// remount. Before, the copy's Last-Modified became the file's mtime: the time of the `mv`.
/// The mtime is in whole seconds whether a listing or a `HEAD` answered (before, a listing
/// showed milliseconds a `HEAD` had not).
#[test]
fn mv_keeps_the_mtime_of_objects_other_tools_wrote() {
    let s3 = s3();
    let b = s3.new_bucket("mvmtime");
    s3.put(&b, "src/f1", "one");
    s3.put(&b, "src/sub/f2", "two");
    s3.put(&b, "g", "three");
    let spec = || MountSpec::s3(&b, "").arg("--stat-ttl").arg("1");
    let m = spec().mount();
    let mtime = |p: &str| fs::symlink_metadata(m.join(p)).unwrap().modified().unwrap();
    let before = [mtime("src/f1"), mtime("src/sub/f2"), mtime("g")];
    for t in before {
        assert_eq!(secs(t).fract(), 0.0, "{t:?} is not in whole seconds");
    }
    // An `ls` (a listing) shows the same times as the stats (HEADs) did.
    std::thread::sleep(Duration::from_millis(1500));
    Command::new("ls")
        .arg("-lR")
        .arg(m.path())
        .output()
        .unwrap();
    assert_eq!(
        [mtime("src/f1"), mtime("src/sub/f2"), mtime("g")],
        before,
        "after ls"
    );
    std::thread::sleep(Duration::from_millis(1100));
    fs::rename(m.join("src"), m.join("dst")).unwrap();
    fs::rename(m.join("g"), m.join("g2")).unwrap();
    let after = || [mtime("dst/f1"), mtime("dst/sub/f2"), mtime("g2")];
    assert_eq!(after(), before, "right after the renames");
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(after(), before, "after T");
    for k in ["dst/f1", "dst/sub/f2", "g2"] {
        assert!(stored_mtime(&b, k) > 0.0);
    }
    drop(m);
    let m = spec().mount();
    let mtime = |p: &str| fs::symlink_metadata(m.join(p)).unwrap().modified().unwrap();
    assert_eq!(
        [mtime("dst/f1"), mtime("dst/sub/f2"), mtime("g2")],
        before,
        "after a remount"
    );
    drop(m);
    s3.remove_bucket(&b);
}

#[test]
fn rsync_like_loop_keeps_every_mode_and_mtime() {
    const WORKERS: usize = 4;
    const PER_WORKER: usize = 250;
    const MTIME: i64 = 1_500_000_000;
    let s3 = s3();
    let b = s3.new_bucket("meta-loop");
    let m = Mount::s3(&b);
    let root = m.path().to_path_buf();
    std::thread::scope(|s| {
        for w in 0..WORKERS {
            let root = root.clone();
            s.spawn(move || {
                for i in 0..PER_WORKER {
                    let n = w * PER_WORKER + i;
                    let tmp = root.join(format!(".f{n}.tmp"));
                    let mut f = OpenOptions::new()
                        .write(true)
                        .create_new(true)
                        .mode(0o600)
                        .open(&tmp)
                        .unwrap_or_else(|e| panic!("create {}: {e}", tmp.display()));
                    f.write_all(format!("file {n}\n").as_bytes()).unwrap();
                    close_checked(f).unwrap();
                    set_times(&tmp, Some(MTIME + n as i64), Some(MTIME + n as i64));
                    let f = File::open(&tmp).unwrap();
                    f.set_permissions(Permissions::from_mode(0o664)).unwrap();
                    close_checked(f).unwrap();
                    fs::rename(&tmp, root.join(format!("f{n}"))).unwrap();
                }
            });
        }
    });
    let check_bucket = |when: &str| {
        let mut wrong = Vec::new();
        for n in 0..WORKERS * PER_WORKER {
            let key = format!("f{n}");
            let (mode, mtime) = (stored_mode(&b, &key), stored_mtime(&b, &key));
            if mode != libc::S_IFREG | 0o664 || mtime != (MTIME + n as i64) as f64 {
                wrong.push(format!("{key}: mode {mode:o} mtime {mtime}"));
            }
        }
        assert!(
            wrong.is_empty(),
            "{when}: {} of {} objects lost their chmod/utimens: {:?}",
            wrong.len(),
            WORKERS * PER_WORKER,
            &wrong[..wrong.len().min(10)]
        );
    };
    check_bucket("mounted");
    drop(m);
    check_bucket("after unmount");
    let m = Mount::s3(&b);
    for n in 0..WORKERS * PER_WORKER {
        let md = fs::metadata(m.join(format!("f{n}"))).unwrap();
        assert_eq!(md.mode(), libc::S_IFREG | 0o664, "f{n} after remount");
        assert_eq!(md.mtime(), MTIME + n as i64, "f{n} after remount");
    }
    drop(m);
    s3.remove_bucket(&b);
}

/// `rsync -a` of many small files with assorted modes and times: every object carries its
/// source's mode and mtime (2,600 files left 5-9 at rsync's temporary 0600).
#[test]
fn rsync_a_keeps_every_mode_and_mtime() {
    if Command::new("rsync").arg("--version").output().is_err() {
        panic!("rsync is not installed (apt-get install rsync)");
    }
    const FILES: usize = 600;
    const MODES: [u32; 6] = [0o644, 0o755, 0o600, 0o640, 0o664, 0o700];
    let src = tempfile::tempdir().unwrap();
    for n in 0..FILES {
        let p = src.path().join(format!("f{n:04}"));
        fs::write(&p, pattern::bytes(n as u64, n % 3000)).unwrap();
        fs::set_permissions(&p, Permissions::from_mode(MODES[n % MODES.len()])).unwrap();
        set_times(&p, Some(1_400_000_000), Some(1_400_000_000 + 7 * n as i64));
    }
    let s3 = s3();
    let b = s3.new_bucket("meta-rsync");
    let m = Mount::s3(&b);
    let dst = m.join("dst");
    run(
        "rsync",
        &[
            "-a",
            &format!("{}/", src.path().display()),
            &format!("{}/", dst.display()),
        ],
    );
    drop(m);
    let mut wrong = Vec::new();
    for n in 0..FILES {
        let key = format!("dst/f{n:04}");
        let (mode, mtime) = (stored_mode(&b, &key), stored_mtime(&b, &key));
        let want = (
            libc::S_IFREG | MODES[n % MODES.len()],
            1_400_000_000 + 7 * n as i64,
        );
        if mode != want.0 || mtime.floor() != want.1 as f64 {
            wrong.push(format!("{key}: mode {mode:o} mtime {mtime}"));
        }
    }
    assert!(
        wrong.is_empty(),
        "{} of {FILES} files lost their mode or mtime: {:?}",
        wrong.len(),
        &wrong[..wrong.len().min(10)]
    );
    s3.remove_bucket(&b);
}

/// `touch -a`, and fchmod/fchown/futimens(atime only) through a descriptor open for writing
/// with nothing written, leave the stored mtime alone (they rewrote it to "now").
#[test]
fn atime_and_mode_changes_keep_the_stored_mtime() {
    const OLD: i64 = 1_600_000_000;
    let s3 = s3();
    let b = s3.new_bucket("meta-atime");
    let old = OLD.to_string();
    let meta = [
        ("mode", "33188"),
        ("uid", "0"),
        ("gid", "0"),
        ("mtime", old.as_str()),
    ];
    for k in ["touched", "fchmod", "futimens"] {
        s3.put_with_meta(&b, k, "content", &meta);
    }
    let m = Mount::s3(&b);
    run("touch", &["-a", m.join("touched").to_str().unwrap()]);
    let f = OpenOptions::new()
        .write(true)
        .open(m.join("fchmod"))
        .unwrap();
    f.set_permissions(Permissions::from_mode(0o640)).unwrap();
    std::os::unix::fs::fchown(&f, Some(0), Some(65534)).unwrap();
    close_checked(f).unwrap();
    let f = OpenOptions::new()
        .write(true)
        .open(m.join("futimens"))
        .unwrap();
    f.set_times(fs::FileTimes::new().set_accessed(UNIX_EPOCH + Duration::from_secs(1_700_000_000)))
        .unwrap();
    close_checked(f).unwrap();
    for k in ["touched", "fchmod", "futimens"] {
        assert_eq!(fs::metadata(m.join(k)).unwrap().mtime(), OLD, "{k}: stat");
        assert_eq!(stored_mtime(&b, k), OLD as f64, "{k}: in the bucket");
        assert_eq!(s3.get(&b, k).unwrap(), b"content", "{k}");
    }
    assert_eq!(stored_mode(&b, "fchmod"), libc::S_IFREG | 0o640);
    assert_eq!(
        head(&b, "fchmod").meta.get("gid").map(String::as_str),
        Some("65534")
    );
    drop(m);
    let m = Mount::s3(&b);
    for k in ["touched", "fchmod", "futimens"] {
        assert_eq!(
            fs::metadata(m.join(k)).unwrap().mtime(),
            OLD,
            "{k}: after remount"
        );
    }
    assert_eq!(
        fs::metadata(m.join("futimens")).unwrap().atime(),
        1_700_000_000,
        "futimens(atime) after remount"
    );
    drop(m);
    s3.remove_bucket(&b);
}

/// truncate/ftruncate/O_TRUNC move the file's mtime and ctime, and adding or removing an
/// entry moves its directory's, as stat shows right after (they waited for the cache).
#[test]
fn times_move_at_once() {
    let s3 = s3();
    let b = s3.new_bucket("meta-times");
    let m = Mount::s3(&b);
    let dir = m.join("d");
    fs::create_dir(&dir).unwrap();
    let f = dir.join("f");
    write_file(&f, &[7u8; 10_000]);
    moves_times("truncate(2)", &f, || {
        let c = CString::new(f.as_os_str().as_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::truncate(c.as_ptr(), 5_000) }, 0);
    });
    moves_times("ftruncate", &f, || {
        let h = OpenOptions::new().write(true).open(&f).unwrap();
        h.set_len(1_000).unwrap();
        close_checked(h).unwrap();
    });
    moves_times("O_TRUNC", &f, || {
        let h = OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(&f)
            .unwrap();
        close_checked(h).unwrap();
    });
    assert_eq!(fs::metadata(&f).unwrap().len(), 0);
    let at = |name: &str| dir.join(name);
    moves_times("create", &dir, || write_file(&at("new"), b"x"));
    moves_times("unlink", &dir, || fs::remove_file(at("new")).unwrap());
    moves_times("mkdir", &dir, || fs::create_dir(at("sub")).unwrap());
    moves_times("rmdir", &dir, || fs::remove_dir(at("sub")).unwrap());
    moves_times("symlink", &dir, || {
        std::os::unix::fs::symlink("f", at("link")).unwrap()
    });
    moves_times("rename", &dir, || {
        fs::rename(at("link"), at("link2")).unwrap()
    });
    // What the bucket holds for the file agrees with what stat showed.
    let shown = secs(fs::metadata(&f).unwrap().modified().unwrap());
    drop(m);
    assert!(
        (stored_mtime(&b, "d/f") - shown).abs() < 1e-6,
        "stored mtime {} differs from the one stat showed {shown}",
        stored_mtime(&b, "d/f")
    );
    s3.remove_bucket(&b);
}

/// The mount point lives in 0700 temp dirs: give others search permission on each ancestor.
fn let_other_users_reach(mountpoint: &Path) {
    for dir in mountpoint.ancestors().skip(1) {
        let Ok(md) = fs::metadata(dir) else { continue };
        let mode = md.permissions().mode();
        if mode & 0o001 == 0 {
            fs::set_permissions(dir, Permissions::from_mode((mode | 0o001) & 0o7777)).unwrap();
        }
    }
}

/// Appends `data` to `path` through a write-only descriptor as user and group 65534.
fn append_as_nobody(path: &Path, data: &str) {
    let out = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "sh",
            "-c",
        ])
        .arg("printf %s \"$1\" | dd of=\"$2\" oflag=append conv=notrunc status=none")
        .args(["sh", data])
        .arg(path)
        .output()
        .expect("setpriv");
    assert!(
        out.status.success(),
        "write as nobody: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A write by a user without CAP_FSETID through a write-only descriptor (direct I/O, where
/// the kernel only passes FUSE_WRITE_KILL_SUIDGID) clears S_ISUID, and S_ISGID when the group
/// may execute, in stat and in the bucket.
#[test]
fn a_write_by_another_user_clears_setid_bits() {
    // SAFETY: getuid cannot fail.
    if unsafe { libc::getuid() } != 0 {
        panic!("this test switches to another user and needs root (as scripts/test.sh runs)");
    }
    let s3 = s3();
    let b = s3.new_bucket("meta-suid");
    let m = MountSpec::s3(&b, "").arg("--allow-other").mount();
    let_other_users_reach(m.path());
    // (file, mode before, mode after a write)
    let cases = [("both", 0o6775, 0o775), ("sgid-noexec", 0o6765, 0o2765)];
    for (name, before, _) in cases {
        let p = m.join(name);
        write_file(&p, b"start\n");
        std::os::unix::fs::chown(&p, Some(0), Some(65534)).unwrap();
        fs::set_permissions(&p, Permissions::from_mode(before)).unwrap();
        assert_eq!(fs::metadata(&p).unwrap().mode() & 0o7777, before);
    }
    for (name, _, after) in cases {
        let p = m.join(name);
        append_as_nobody(&p, "more\n");
        assert_eq!(
            fs::metadata(&p).unwrap().mode() & 0o7777,
            after,
            "{name}: stat after the write"
        );
        assert_eq!(read_file(&p), b"start\nmore\n");
        assert_eq!(
            stored_mode(&b, name),
            libc::S_IFREG | after,
            "{name}: bucket"
        );
    }
    drop(m);
    let m = Mount::s3(&b);
    for (name, _, after) in cases {
        let md = fs::metadata(m.join(name)).unwrap();
        assert_eq!(md.mode() & 0o7777, after, "{name}: after remount");
    }
    drop(m);
    s3.remove_bucket(&b);
}

fn version(i: usize) -> Vec<u8> {
    // Sizes go up and down from version to version: a reader that kept the old size reads
    // too little or zeros.
    format!("version {i:03} ")
        .repeat(40 + (i * 37) % 300)
        .into_bytes()
}

/// Another client overwrites a small file; a descriptor opened on a second mount right
/// after reads a whole version, the old or the new one, never ESTALE (every such open failed
/// for the first seconds, while the mount's cached ETag was older than the object).
#[test]
fn a_fresh_open_after_another_clients_change_reads_a_whole_version() {
    const ROUNDS: usize = 60;
    let s3 = s3();
    let b = s3.new_bucket("meta-fresh");
    s3.put(&b, "f", version(0));
    let m = Mount::s3(&b);
    let p = m.join("f");
    // The mount knows the file (its ETag) but the kernel caches none of its pages.
    assert_eq!(fs::metadata(&p).unwrap().len(), version(0).len() as u64);
    let mut last = 0;
    for i in 1..=ROUNDS {
        s3.put(&b, "f", version(i));
        let mut got = Vec::new();
        File::open(&p)
            .and_then(|mut f| f.read_to_end(&mut got))
            .unwrap_or_else(|e| panic!("round {i}: open+read after the change: {e}"));
        let Some(j) = (last..=i).find(|&j| got == version(j)) else {
            panic!(
                "round {i}: read {} bytes that are no version from {last} to {i}: {:?}",
                got.len(),
                String::from_utf8_lossy(&got[..got.len().min(40)])
            );
        };
        last = j;
    }
    assert_eq!(last, ROUNDS, "the last open read an old version");
    drop(m);
    s3.remove_bucket(&b);
}

/// A descriptor that read part of a version before another client replaced the object gets
/// ESTALE for bytes it has not read yet: it never mixes two versions.
#[test]
fn a_descriptor_reading_across_a_change_gets_estale() {
    let s3 = s3();
    let b = s3.new_bucket("meta-across");
    let len = 32 * MIB;
    s3.put(&b, "big", pattern::bytes(1, len));
    let m = Mount::s3(&b);
    let p: PathBuf = m.join("big");
    let f = File::open(&p).unwrap();
    let mut head_bytes = vec![0u8; 4096];
    f.read_exact_at(&mut head_bytes, 0).unwrap();
    assert_eq!(&head_bytes[..], &pattern::bytes(1, 4096)[..]);
    s3.put(&b, "big", pattern::bytes(2, len));
    let mut far = vec![0u8; 4096];
    let e = f.read_exact_at(&mut far, 30 * MIB as u64);
    assert_eq!(
        errno(e),
        libc::ESTALE,
        "read of a changed object, past what was read"
    );
    drop(f);
    // A descriptor opened now reads the new version whole.
    let mut g = File::open(&p).unwrap();
    pattern::check_reader(&mut g, 2, len as u64).unwrap();
    // Closed before the unmount: a mount with a descriptor open is detached lazily and its
    // daemon serves the descriptor until it closes (an earlier version of this test held it
    // across the unmount, and the harness killed the daemon after 120 s).
    drop(g);
    drop(m);
    s3.remove_bucket(&b);
}

/// A file bigger than a part streams its parts while it is written, into an upload created
/// with the metadata of that moment. `install -m 0751` (fchmod before its close) and a
/// rewrite (`cp` over a file with an old mtime, O_TRUNC) of such a file: the bucket and a
/// later mount show the new mode and a new mtime. Before, the mode of the create and the
/// old object's mtime were stored (the close completed the upload as created).
#[test]
fn a_big_file_keeps_a_chmod_made_while_it_streams_and_gets_a_new_mtime_when_rewritten() {
    let s3 = s3();
    let b = s3.new_bucket("meta-stream");
    let mode = (libc::S_IFREG | 0o600).to_string();
    let old = [("mtime", "1000000000"), ("mode", mode.as_str())];
    s3.put_with_meta(&b, "rewritten", vec![b'o'; 10], &old);
    let src = tempfile::NamedTempFile::new().unwrap();
    let data: Vec<u8> = (0..20u32 << 20).map(|i| (i % 251) as u8).collect();
    fs::write(src.path(), &data).unwrap();
    let m = Mount::s3(&b);
    let started = SystemTime::now() - Duration::from_secs(1);
    let st = Command::new("install")
        .args(["-m", "0751"])
        .arg(src.path())
        .arg(m.join("installed"))
        .status()
        .unwrap();
    assert!(st.success(), "install failed");
    let st = Command::new("cp")
        .arg(src.path())
        .arg(m.join("rewritten"))
        .status()
        .unwrap();
    assert!(st.success(), "cp failed");
    assert_eq!(stored_mode(&b, "installed"), libc::S_IFREG | 0o751);
    assert!(
        stored_mtime(&b, "rewritten") >= secs(started),
        "the old mtime was stored"
    );
    let here = times(&m.join("rewritten")).0;
    let m = m.remount();
    for name in ["installed", "rewritten"] {
        assert_eq!(fs::read(m.join(name)).unwrap(), data, "{name}");
    }
    let md = fs::metadata(m.join("installed")).unwrap();
    assert_eq!(md.mode(), libc::S_IFREG | 0o751);
    let md = fs::metadata(m.join("rewritten")).unwrap();
    assert_eq!(
        md.mode(),
        libc::S_IFREG | 0o600,
        "the rewrite kept the file's mode"
    );
    assert_eq!(
        md.modified().unwrap(),
        here,
        "the mtime shown before the remount is not the one stored"
    );
}

/// chmod, chown and utimens of an object another tool stored with its own headers keep
/// them: a copy that replaces the user metadata drops every other header unless it gives
/// them again (before: a `text/html` page came back `binary/octet-stream`, its caching and
/// download name gone).
#[test]
fn chmod_chown_utimens_keep_the_objects_other_headers() {
    let b = s3().new_bucket("headers");
    s3().block_on(
        s3().client
            .put_object()
            .bucket(&b)
            .key("page.html")
            .body(b"<p>hi</p>".to_vec().into())
            .content_type("text/html; charset=utf-8")
            .cache_control("max-age=60")
            .content_disposition("inline; filename=page.html")
            .content_language("en")
            .content_encoding("identity")
            .send(),
    )
    .unwrap();
    let m = MountSpec::s3(&b, "").mount();
    let p = m.join("page.html");
    fs::set_permissions(&p, Permissions::from_mode(0o600)).unwrap();
    std::os::unix::fs::chown(&p, Some(1234), Some(5678)).unwrap();
    set_times(&p, None, Some(1_000_000_000));
    drop(m);
    let h = s3()
        .block_on(s3().client.head_object().bucket(&b).key("page.html").send())
        .unwrap();
    assert_eq!(h.content_type(), Some("text/html; charset=utf-8"));
    assert_eq!(h.cache_control(), Some("max-age=60"));
    assert_eq!(h.content_disposition(), Some("inline; filename=page.html"));
    assert_eq!(h.content_language(), Some("en"));
    assert_eq!(h.content_encoding(), Some("identity"));
    assert_eq!(stored_mode(&b, "page.html") & 0o7777, 0o600);
    assert_eq!(
        head(&b, "page.html").meta.get("uid").map(String::as_str),
        Some("1234")
    );
    assert_eq!(stored_mtime(&b, "page.html") as i64, 1_000_000_000);
}

/// The same for an object over the CopyObject limit (5 GiB; lowered to 1 MiB here by a
/// test-only variable), which a chmod or a rename copies in parts: the multipart upload
/// carried the user metadata only, so a `text/html` object became `binary/octet-stream`;
/// and its tags, which a single copy keeps by itself.
#[test]
fn a_chmod_or_rename_of_an_object_over_the_copy_limit_keeps_its_headers() {
    let b = s3().new_bucket("bigheaders");
    let body: Vec<u8> = (0..3u32 << 20).map(|i| (i % 251) as u8).collect();
    s3().block_on(
        s3().client
            .put_object()
            .bucket(&b)
            .key("big.html")
            .body(body.clone().into())
            .content_type("text/html; charset=utf-8")
            .cache_control("max-age=60")
            .content_disposition("inline; filename=big.html")
            .content_language("en")
            .content_encoding("identity")
            .tagging(TAGGING)
            .send(),
    )
    .unwrap();
    let mut spec = MountSpec::s3(&b, "");
    spec.envs.push((
        "BUCKETFS_TEST_MAX_COPY_OBJECT".into(),
        (1u64 << 20).to_string(),
    ));
    let m = spec.mount();
    let p = m.join("big.html");
    fs::set_permissions(&p, Permissions::from_mode(0o600)).unwrap();
    fs::rename(&p, m.join("moved.html")).unwrap();
    drop(m);
    let h = s3()
        .block_on(
            s3().client
                .head_object()
                .bucket(&b)
                .key("moved.html")
                .send(),
        )
        .unwrap();
    assert_eq!(h.content_type(), Some("text/html; charset=utf-8"));
    assert_eq!(h.cache_control(), Some("max-age=60"));
    assert_eq!(h.content_disposition(), Some("inline; filename=big.html"));
    assert_eq!(h.content_language(), Some("en"));
    assert_eq!(h.content_encoding(), Some("identity"));
    assert_eq!(tags(&b, "moved.html"), kept_tags());
    // It was copied in parts (a single copy would have kept them anyway).
    assert!(
        h.e_tag().is_some_and(|e| e.contains('-')),
        "not a multipart copy: {:?}",
        h.e_tag()
    );
    assert_eq!(stored_mode(&b, "moved.html") & 0o7777, 0o600);
    assert_eq!(s3().get(&b, "moved.html"), Some(body));
    assert_eq!(s3().head(&b, "big.html").map(|_| ()), None);
}

/// The Content-Type a HEAD of `key` gives.
fn content_type(bucket: &str, key: &str) -> Option<String> {
    s3().block_on(s3().client.head_object().bucket(bucket).key(key).send())
        .unwrap()
        .content_type()
        .map(str::to_string)
}

/// Files written here get the Content-Type of their extension, whether stored in one PUT,
/// in parts, or in parts again after a rewrite in place, and keep it through the chmod and
/// utimens that `cp -p`, `tar` and `rsync -a` send after writing (a copy of a version this
/// mount stored, which it makes without reading its headers first: before, every object
/// written here was `binary/octet-stream`, a web page a download). One written under a
/// temporary name and renamed gets its final name's, its metadata kept. `--content-type
/// none` gives none.
#[test]
fn files_written_here_get_the_content_type_of_their_name_and_keep_it() {
    let b = s3().new_bucket("ctype");
    let m = MountSpec::s3(&b, "").mount();
    let big: Vec<u8> = (0..20u32 << 20).map(|i| (i % 251) as u8).collect();
    write_file(&m.join("page.html"), b"<p>hi</p>");
    write_file(&m.join("data.json"), &big);
    write_file(&m.join("README"), b"no extension");
    write_file(&m.join(".profile"), b"a dot file");
    fs::create_dir(m.join("site.css")).unwrap();
    // A rewrite in place: parts of the old version copied, one part new.
    let f = OpenOptions::new()
        .write(true)
        .open(m.join("data.json"))
        .unwrap();
    f.write_all_at(b"changed", 10 << 20).unwrap();
    close_checked(f).unwrap();
    for name in ["page.html", "data.json"] {
        let p = m.join(name);
        fs::set_permissions(&p, Permissions::from_mode(0o600)).unwrap();
        set_times(&p, None, Some(1_000_000_000));
    }
    // Written under a temporary name and renamed, as rsync and editors do: the final name's.
    write_file(&m.join(".index.html.Xa9Qz1"), b"<p>page</p>");
    fs::rename(m.join(".index.html.Xa9Qz1"), m.join("index.html")).unwrap();
    write_file(&m.join("style.txt"), b"p {}");
    fs::set_permissions(m.join("style.txt"), Permissions::from_mode(0o640)).unwrap();
    fs::rename(m.join("style.txt"), m.join("style.css")).unwrap();
    drop(m);
    assert_eq!(content_type(&b, "index.html").as_deref(), Some("text/html"));
    assert_eq!(content_type(&b, "style.css").as_deref(), Some("text/css"));
    assert_eq!(stored_mode(&b, "style.css") & 0o7777, 0o640);
    assert_eq!(s3().get(&b, "style.css").as_deref(), Some(&b"p {}"[..]));
    assert_eq!(content_type(&b, "page.html").as_deref(), Some("text/html"));
    assert_eq!(
        content_type(&b, "data.json").as_deref(),
        Some("application/json")
    );
    for key in ["README", ".profile", "site.css/"] {
        assert!(is_default_type(&b, key), "{key}");
    }
    assert_eq!(stored_mode(&b, "page.html") & 0o7777, 0o600);
    assert_eq!(stored_mtime(&b, "data.json") as i64, 1_000_000_000);
    let mut expected = big;
    expected[10 << 20..(10 << 20) + 7].copy_from_slice(b"changed");
    assert!(s3().get(&b, "data.json") == Some(expected), "data.json");

    let m = MountSpec::s3(&b, "")
        .arg("--content-type")
        .arg("none")
        .mount();
    write_file(&m.join("other.html"), b"<p>hi</p>");
    drop(m);
    assert!(is_default_type(&b, "other.html"));
}

/// Whether `key` has the type a store gives an object written with none (MinIO's, for
/// what the SDK sends: either way an octet stream).
fn is_default_type(bucket: &str, key: &str) -> bool {
    let t = content_type(bucket, key);
    matches!(
        t.as_deref(),
        Some("binary/octet-stream" | "application/octet-stream")
    )
}

/// The tags [`put_with_headers`] gives (a lifecycle rule's, and one whose key and value
/// need encoding), as `x-amz-tagging` says them.
const TAGGING: &str = "retention=30d&cost%20centre=ml%2Fteam%20a%2Bb%3A1";

/// The tags of `key`, sorted.
fn tags(bucket: &str, key: &str) -> Vec<(String, String)> {
    let out = s3()
        .block_on(
            s3().client
                .get_object_tagging()
                .bucket(bucket)
                .key(key)
                .send(),
        )
        .unwrap();
    let mut tags: Vec<(String, String)> = out
        .tag_set()
        .iter()
        .map(|t| (t.key().to_string(), t.value().to_string()))
        .collect();
    tags.sort();
    tags
}

/// What [`TAGGING`] says.
fn kept_tags() -> Vec<(String, String)> {
    vec![
        ("cost centre".into(), "ml/team a+b:1".into()),
        ("retention".into(), "30d".into()),
    ]
}

/// Puts `key` as another tool would, with every header a version keeps besides its user
/// metadata that MinIO stores, and tags.
fn put_with_headers(bucket: &str, key: &str, body: Vec<u8>) {
    s3().block_on(
        s3().client
            .put_object()
            .bucket(bucket)
            .key(key)
            .body(body.into())
            .content_type("text/csv; charset=utf-8")
            .cache_control("max-age=60")
            .content_disposition("attachment; filename=report.csv")
            .content_language("en")
            .content_encoding("identity")
            .storage_class(aws_sdk_s3::types::StorageClass::ReducedRedundancy)
            .tagging(TAGGING)
            .send(),
    )
    .unwrap();
}

/// Asserts `key` still has what [`put_with_headers`] gave it.
fn assert_kept_headers(bucket: &str, key: &str) {
    assert_kept_headers_but_tags(bucket, key);
    assert_eq!(tags(bucket, key), kept_tags(), "{key}");
}

/// Asserts `key` still has the headers [`put_with_headers`] gave it.
fn assert_kept_headers_but_tags(bucket: &str, key: &str) {
    let h = s3()
        .block_on(s3().client.head_object().bucket(bucket).key(key).send())
        .unwrap();
    assert_eq!(h.content_type(), Some("text/csv; charset=utf-8"), "{key}");
    assert_eq!(h.cache_control(), Some("max-age=60"), "{key}");
    assert_eq!(
        h.content_disposition(),
        Some("attachment; filename=report.csv"),
        "{key}"
    );
    assert_eq!(h.content_language(), Some("en"), "{key}");
    assert_eq!(h.content_encoding(), Some("identity"), "{key}");
    assert_eq!(
        h.storage_class(),
        Some(&aws_sdk_s3::types::StorageClass::ReducedRedundancy),
        "{key}"
    );
}

/// A file another tool stored with its own headers and tags keeps them when written again
/// here: an append, a rewrite from empty (`>`, `O_TRUNC`), a rewrite in place of a big
/// file (in parts), and the same from a background mount's write-back directory. Each
/// writes a new version, which S3 gives no header and no tag it is not sent: before, every
/// such version came out an octet stream with no caching, download name or storage class,
/// and (until the tags were read too) untagged, out of reach of the lifecycle rules and
/// policies that select by tag.
#[test]
fn files_written_again_keep_the_headers_another_tool_gave_them() {
    let b = s3().new_bucket("rewriteheaders");
    let big: Vec<u8> = (0..20u32 << 20).map(|i| (i % 251) as u8).collect();
    for key in ["append.csv", "trunc.csv", "bg.csv", "bgtrunc.csv"] {
        put_with_headers(&b, key, b"a,b\n".to_vec());
    }
    put_with_headers(&b, "big.csv", big.clone());
    let m = MountSpec::s3(&b, "").mount();
    let mut f = OpenOptions::new()
        .append(true)
        .open(m.join("append.csv"))
        .unwrap();
    f.write_all(b"1,2\n").unwrap();
    close_checked(f).unwrap();
    write_file(&m.join("trunc.csv"), b"x,y\n");
    let f = OpenOptions::new()
        .write(true)
        .open(m.join("big.csv"))
        .unwrap();
    f.write_all_at(b"changed", 10 << 20).unwrap();
    close_checked(f).unwrap();
    // The requests that read the headers and tags kept are counted (before: neither).
    let req = store_requests(m.path());
    assert_eq!(req.get("get_tagging").copied(), Some(3), "{req:?}");
    assert!(req.get("head").copied().unwrap_or(0) >= 3, "{req:?}");
    drop(m);
    assert_eq!(
        s3().get(&b, "append.csv").as_deref(),
        Some(&b"a,b\n1,2\n"[..])
    );
    assert_eq!(s3().get(&b, "trunc.csv").as_deref(), Some(&b"x,y\n"[..]));
    let mut expected = big;
    expected[10 << 20..(10 << 20) + 7].copy_from_slice(b"changed");
    assert!(s3().get(&b, "big.csv") == Some(expected), "big.csv");
    for key in ["append.csv", "trunc.csv", "big.csv"] {
        assert_kept_headers(&b, key);
    }

    let state = state_dir();
    let m = background(MountSpec::s3(&b, ""), state.path(), &[]).mount();
    let mut f = OpenOptions::new()
        .append(true)
        .open(m.join("bg.csv"))
        .unwrap();
    f.write_all(b"3,4\n").unwrap();
    close_checked(f).unwrap();
    write_file(&m.join("bgtrunc.csv"), b"z,w\n");
    drop(m);
    assert_eq!(s3().get(&b, "bg.csv").as_deref(), Some(&b"a,b\n3,4\n"[..]));
    assert_eq!(s3().get(&b, "bgtrunc.csv").as_deref(), Some(&b"z,w\n"[..]));
    for key in ["bg.csv", "bgtrunc.csv"] {
        assert_kept_headers(&b, key);
    }
}

/// A file whose version's headers cannot be read (a credential that may write but not
/// read them, an object encrypted with the client's own key: here the test proxy answers
/// the pinned HEAD `403`) is still written again: it gets a new object's headers, as before
/// they were kept (before this fallback, the append failed).
#[test]
fn a_file_whose_headers_cannot_be_read_is_still_written_again() {
    let b = s3().new_bucket("unreadableheaders");
    put_with_headers(&b, "f.csv", b"a,b\n".to_vec());
    let proxy = proxy::FaultProxy::start(&minio_addr());
    let m = via_proxy(&b, &proxy).mount();
    assert_eq!(read_file(&m.join("f.csv")), b"a,b\n");
    proxy.reject_with_header(&format!("HEAD /{b}/f.csv"), "if-match", 403);
    let mut f = OpenOptions::new()
        .append(true)
        .open(m.join("f.csv"))
        .unwrap();
    f.write_all(b"1,2\n").unwrap();
    close_checked(f).unwrap();
    drop(m);
    assert!(proxy.rejected() >= 1, "the headers were not asked for");
    assert_eq!(s3().get(&b, "f.csv").as_deref(), Some(&b"a,b\n1,2\n"[..]));
    assert_eq!(content_type(&b, "f.csv").as_deref(), Some("text/csv"));
}

/// A tagged file is still written again when its tags cannot be carried: when they cannot
/// be read (a credential without `s3:GetObjectTagging`; here the test proxy answers the
/// tag read `403`), and when the store refuses a write that carries them (without
/// `s3:PutObjectTagging`: the proxy answers a PUT with `x-amz-tagging` `403`). The version
/// is stored without them, and after the refused write the mount neither reads nor sends
/// tags again (one refused request, not one per write).
#[test]
fn a_tagged_file_whose_tags_cannot_be_carried_is_still_written_again() {
    let b = s3().new_bucket("untaggable");
    for key in ["unread.csv", "refused.csv", "later.csv"] {
        put_with_headers(&b, key, b"a,b\n".to_vec());
    }
    let proxy = proxy::FaultProxy::start(&minio_addr());
    let m = via_proxy(&b, &proxy).mount();
    let append = |name: &str| {
        let mut f = OpenOptions::new().append(true).open(m.join(name)).unwrap();
        f.write_all(b"1,2\n").unwrap();
        close_checked(f)
    };

    proxy.reject_with_header(&format!("GET /{b}/unread.csv?tagging"), "host", 403);
    append("unread.csv").unwrap();
    assert_eq!(proxy.rejected(), 1, "the tags were not asked for");
    assert_eq!(
        s3().get(&b, "unread.csv").as_deref(),
        Some(&b"a,b\n1,2\n"[..])
    );
    assert_eq!(tags(&b, "unread.csv"), vec![]);

    proxy.reject_with_header(&format!("PUT /{b}/"), "x-amz-tagging", 403);
    append("refused.csv").unwrap();
    assert_eq!(proxy.rejected(), 2, "the write did not carry the tags");
    assert_eq!(
        s3().get(&b, "refused.csv").as_deref(),
        Some(&b"a,b\n1,2\n"[..])
    );
    assert_eq!(tags(&b, "refused.csv"), vec![]);

    append("later.csv").unwrap();
    drop(m);
    assert_eq!(proxy.rejected(), 2, "tags were sent again after a refusal");
    assert!(
        proxy
            .request_heads(&format!("GET /{b}/later.csv?tagging"))
            .is_empty(),
        "tags were read again after a refusal"
    );
    assert_eq!(
        s3().get(&b, "later.csv").as_deref(),
        Some(&b"a,b\n1,2\n"[..])
    );
    assert_kept_headers_but_tags(&b, "later.csv");
}

/// Background mode: chmod and utimens by path of a file another descriptor holds open for
/// writing are stored at once when every write is committed (a log file after its fsync;
/// a file opened `O_RDWR` and not written), so a kill -9 before that descriptor's close
/// keeps them (before: kept only in memory until the close, and the next mount uploaded
/// the file with its old mode and mtime; sync mode stored them).
#[test]
fn background_chmod_of_a_file_open_for_writing_survives_a_crash() {
    let b = s3().new_bucket("bgopenmeta");
    s3().put(&b, "plain", b"p".to_vec());
    let state = state_dir();
    let spec = background(
        MountSpec::s3(&b, ""),
        state.path(),
        &["--upload-delay", "600"],
    );
    let mut m = spec.mount();
    let mut log = OpenOptions::new()
        .create(true)
        .append(true)
        .open(m.join("log"))
        .unwrap();
    log.write_all(b"line1\n").unwrap();
    log.sync_all().unwrap();
    fs::set_permissions(m.join("log"), Permissions::from_mode(0o600)).unwrap();
    set_times(&m.join("log"), None, Some(1_000_000_000));
    let plain = OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.join("plain"))
        .unwrap();
    fs::set_permissions(m.join("plain"), Permissions::from_mode(0o640)).unwrap();
    m.kill9();
    drop((log, plain));
    drop(m);
    let (status, out) = background(MountSpec::s3(&b, ""), state.path(), &[])
        .mount()
        .unmount();
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{out}");
    assert_eq!(s3().get(&b, "log").as_deref(), Some(&b"line1\n"[..]));
    assert_eq!(stored_mode(&b, "log") & 0o7777, 0o600);
    assert_eq!(stored_mtime(&b, "log") as i64, 1_000_000_000);
    assert_eq!(s3().get(&b, "plain").as_deref(), Some(&b"p"[..]));
    assert_eq!(stored_mode(&b, "plain") & 0o7777, 0o640);
}

/// `tar` of a file truncated here a moment before (its new size still being stored while tar
/// reads it): tar compares the file's ctime before and after reading it, and this mount shows
/// the ctime of the truncate throughout, not the time its upload ended once the stat TTL
/// passed (before: "file changed as we read it", exit 1).
#[test]
fn tar_of_a_file_truncated_just_before_sees_it_unchanged() {
    let s3 = s3();
    let b = s3.new_bucket("metatar");
    let m = MountSpec::s3(&b, "").arg("--stat-ttl").arg("1").mount();
    let img = m.join("img");
    fs::write(&img, b"hello").unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    let f = OpenOptions::new().write(true).open(&img).unwrap();
    f.set_len(100 << 20).unwrap();
    drop(f);
    std::thread::sleep(Duration::from_millis(300));
    let out = Command::new("bash")
        .arg("-c")
        .arg("set -o pipefail; tar cf - img | cat > /dev/null")
        .current_dir(m.path())
        .output()
        .unwrap();
    assert!(
        out.status.success() && out.stderr.is_empty(),
        "tar: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    drop(m);
    s3.remove_bucket(&b);
}
