//! Rewrites racing another S3 client, through real mounts against MinIO (issue 17): a new
//! version built from the old one (append, pwrite of a part, chmod, rename of a file being
//! written) is pinned to the version it was built from. When another client replaced the
//! object meanwhile, the close (or the call) fails with ESTALE, the log names the file, no
//! upload is left behind, and the bucket holds exactly the other client's object: never a
//! version neither wrote.

mod common;

use common::*;
use std::fs::{self, File, OpenOptions};
use std::io::{Seek, SeekFrom, Write};
use std::os::unix::fs::PermissionsExt;

/// The other client's object is the whole of the key, and no upload is left.
fn assert_other_version_intact(b: &str, key: &str, other: &[u8]) {
    let s3 = s3();
    let got = s3.get(b, key).expect("the other client's object");
    assert!(
        got.len() == other.len() && got == other,
        "{key}: {} bytes that are not the other client's {} bytes",
        got.len(),
        other.len()
    );
    assert!(
        s3.list_multipart_uploads(b).is_empty(),
        "an upload was left"
    );
}

/// `r` failed with ESTALE (the mount's log is shown if not).
fn assert_estale<T: std::fmt::Debug>(r: std::io::Result<T>, m: &Mount) {
    match r {
        Err(e) if e.raw_os_error() == Some(libc::ESTALE) => {}
        other => panic!("expected ESTALE, got {other:?}; log:\n{}", m.log()),
    }
}

fn assert_logged_conflict(m: &Mount, key: &str) {
    let log = m.log();
    assert!(
        log.lines()
            .any(|l| l.contains(key) && l.contains("changed by another client")),
        "no log line names {key} as changed by another client:\n{log}"
    );
}

#[test]
fn an_append_racing_another_client_fails_at_close() {
    let s3 = s3();
    let b = s3.new_bucket("pinappend");
    s3.put(&b, "log", pattern::bytes(1, 16 * MIB));
    let m = Mount::s3(&b);
    let mut f = OpenOptions::new().append(true).open(m.join("log")).unwrap();
    f.write_all(&pattern::bytes(2, 8 * MIB)).unwrap();
    let other = pattern::bytes(3, 16 * MIB);
    s3.put(&b, "log", other.clone());
    // Before the fix: 0, and the bucket held the other client's 16 MiB + our 8 MiB.
    assert_estale(close_checked(f), &m);
    assert_other_version_intact(&b, "log", &other);
    assert_logged_conflict(&m, "log");
    drop(m);
    s3.remove_bucket(&b);
}

/// Another client deletes a file this mount has open for a partial rewrite: the close is
/// refused (`ESTALE`), and a program that makes the file again at once (`>` in a shell,
/// `open(O_CREAT|O_TRUNC)`) makes it. Before, that open failed with `ENOENT` for the
/// kernel's cached name, until the release of the refused descriptor was done: the
/// attributes it asked for by inode were `ENOENT`, now `ESTALE`, which has it look up again.
#[test]
fn a_file_made_again_right_after_a_close_refused_for_its_deletion_is_made() {
    use std::os::unix::fs::FileExt;
    let s3 = s3();
    let b = s3.new_bucket("pinremake");
    let m = Mount::s3(&b);
    for i in 0..5 {
        let name = format!("f{i}");
        write_file(&m.join(&name), b"hello");
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .open(m.join(&name))
            .unwrap();
        f.write_at(b"J", 1).unwrap();
        s3.delete(&b, &name);
        assert_estale(close_checked(f), &m);
        let made = File::create(m.join(&name)).and_then(|mut f| f.write_all(b"new").map(|()| f));
        match made.and_then(close_checked) {
            Ok(()) => assert_eq!(s3.get(&b, &name).unwrap(), b"new"),
            Err(e) => panic!(
                "{name}: made again after the refused close: {e}; log:\n{}",
                m.log()
            ),
        }
    }
    drop(m);
    s3.remove_bucket(&b);
}

/// A file another client deleted keeps its attributes for the descriptors open here
/// (`fstat`, as on a local disk; `tail --follow=descriptor` stats its descriptor), while a
/// `stat` of its name gets `ENOENT` once the mount learnt of the delete.
#[test]
fn fstat_of_a_file_deleted_elsewhere_works_while_it_is_open() {
    use std::io::Read;
    use std::os::unix::fs::MetadataExt;
    let s3 = s3();
    let b = s3.new_bucket("pinfstat");
    s3.put(&b, "f", "0123456789");
    let m = MountSpec::s3(&b, "").arg("--stat-ttl").arg("1").mount();
    let mut f = File::open(m.join("f")).unwrap();
    let mut head = [0u8; 3];
    f.read_exact(&mut head).unwrap();
    s3.delete(&b, "f");
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let md = f
        .metadata()
        .unwrap_or_else(|e| panic!("fstat: {e}; log:\n{}", m.log()));
    assert_eq!(md.size(), 10);
    match fs::metadata(m.join("f")) {
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
        other => panic!("stat of the deleted name: {other:?}"),
    }
    let mut rest = Vec::new();
    f.read_to_end(&mut rest).unwrap();
    assert_eq!(rest, b"3456789");
    drop(f);
    drop(m);
    s3.remove_bucket(&b);
}

#[test]
fn a_pwrite_of_one_part_racing_another_client_fails_at_close() {
    let s3 = s3();
    let b = s3.new_bucket("pinpwrite");
    s3.put(&b, "db", pattern::bytes(1, 24 * MIB));
    let m = Mount::s3(&b);
    let mut f = OpenOptions::new().write(true).open(m.join("db")).unwrap();
    // The second 8 MiB part, whole: parts 1 and 3 are copied from the base at close.
    f.seek(SeekFrom::Start(8 * MIB as u64)).unwrap();
    f.write_all(&pattern::bytes(2, 8 * MIB)).unwrap();
    let other = pattern::bytes(3, 24 * MIB);
    s3.put(&b, "db", other.clone());
    assert_estale(f.sync_all(), &m);
    assert_estale(close_checked(f), &m);
    assert_other_version_intact(&b, "db", &other);
    assert_logged_conflict(&m, "db");
    drop(m);
    s3.remove_bucket(&b);
}

/// chmod and utimens copy the object onto itself with new metadata. Racing a replace, the
/// copy of the version this mount knew is refused; the kernel retries the call once after
/// a fresh lookup, so the change applies to the other client's version, whose own metadata
/// stays. Before the fix the copy put our old metadata on the other client's bytes.
#[test]
fn chmod_and_utimens_racing_another_client_never_mix_metadata() {
    let s3 = s3();
    let b = s3.new_bucket("pinchmod");
    s3.put_with_meta(&b, "f", "ours", &[("color", "red")]);
    s3.put_with_meta(&b, "g", "ours", &[("color", "red")]);
    // A long TTL: the mount acts on what it looked up, as it would inside any TTL.
    let m = MountSpec::s3(&b, "").arg("--stat-ttl").arg("600").mount();
    fs::metadata(m.join("f")).unwrap();
    fs::metadata(m.join("g")).unwrap();
    s3.put_with_meta(&b, "f", "theirs", &[("color", "blue")]);
    s3.put_with_meta(&b, "g", "theirs", &[("color", "blue")]);

    let chmod = fs::set_permissions(m.join("f"), fs::Permissions::from_mode(0o600));
    let h = s3.head(&b, "f").unwrap();
    assert_eq!(s3.get(&b, "f").unwrap(), b"theirs");
    assert_eq!(
        h.meta.get("color").map(String::as_str),
        Some("blue"),
        "{h:?}"
    );
    match chmod {
        Ok(()) => assert_eq!(h.meta["mode"], (libc::S_IFREG | 0o600).to_string()),
        Err(e) => assert_eq!(e.raw_os_error(), Some(libc::ESTALE), "{e}"),
    }

    let t = libc::timespec {
        tv_sec: 1_000_000_000,
        tv_nsec: 0,
    };
    let path = std::ffi::CString::new(m.join("g").into_os_string().into_encoded_bytes()).unwrap();
    // SAFETY: a valid C path and two valid timespecs.
    let rc = unsafe { libc::utimensat(libc::AT_FDCWD, path.as_ptr(), [t, t].as_ptr(), 0) };
    let h = s3.head(&b, "g").unwrap();
    assert_eq!(s3.get(&b, "g").unwrap(), b"theirs");
    assert_eq!(
        h.meta.get("color").map(String::as_str),
        Some("blue"),
        "{h:?}"
    );
    if rc == 0 {
        assert_eq!(h.meta["mtime"], "1000000000");
    } else {
        assert_eq!(
            std::io::Error::last_os_error().raw_os_error(),
            Some(libc::ESTALE)
        );
    }
    drop(m);
    s3.remove_bucket(&b);
}

/// A rename of a file being written moves its previous complete object, which must be the
/// object its writes are based on: refused, nothing is moved, and the close is refused too.
#[test]
fn a_rename_of_a_file_being_appended_racing_another_client_fails() {
    let s3 = s3();
    let b = s3.new_bucket("pinrenamew");
    s3.put(&b, "a", pattern::bytes(1, 16 * MIB));
    let m = Mount::s3(&b);
    let mut f = OpenOptions::new().append(true).open(m.join("a")).unwrap();
    f.write_all(&pattern::bytes(2, 8 * MIB)).unwrap();
    let other = pattern::bytes(3, 16 * MIB);
    s3.put(&b, "a", other.clone());
    // Before the fix: the rename succeeded and "b" held the other client's bytes + ours.
    assert_estale(fs::rename(m.join("a"), m.join("b")), &m);
    assert!(close_checked(f).is_err());
    assert!(s3.get(&b, "b").is_none(), "nothing moved");
    assert_other_version_intact(&b, "a", &other);
    drop(m);
    s3.remove_bucket(&b);
}

/// A rename of a closed file moves one whole version: the one it looked up, or (the kernel
/// retries once after ESTALE, on a fresh lookup) the other client's.
#[test]
fn a_rename_racing_another_client_moves_one_whole_version() {
    let s3 = s3();
    let b = s3.new_bucket("pinrename");
    s3.put_with_meta(&b, "a", "ours", &[("color", "red")]);
    let m = MountSpec::s3(&b, "").arg("--stat-ttl").arg("600").mount();
    fs::metadata(m.join("a")).unwrap();
    s3.put_with_meta(&b, "a", "theirs", &[("color", "blue")]);
    match fs::rename(m.join("a"), m.join("b")) {
        Ok(()) => {
            assert!(s3.get(&b, "a").is_none());
            assert_eq!(s3.get(&b, "b").unwrap(), b"theirs");
            let h = s3.head(&b, "b").unwrap();
            assert_eq!(h.meta.get("color").map(String::as_str), Some("blue"));
        }
        Err(e) => {
            assert_eq!(e.raw_os_error(), Some(libc::ESTALE), "{e}");
            assert!(s3.get(&b, "b").is_none());
            assert_eq!(s3.get(&b, "a").unwrap(), b"theirs");
        }
    }
    let _ = File::open(m.join("b"));
    drop(m);
    s3.remove_bucket(&b);
}

/// Another client's larger version, learnt by a `fstat`, an `lseek(SEEK_END)` or a `read` of
/// a descriptor that has read nothing yet, is acted on whole at once: the kernel takes the
/// reply that carries its size. The mount tells the kernel a little later that its
/// attributes may be stale (a reply racing one of the kernel's own updates is dropped, which
/// left the old size valid for T while reads served the new version: the new version cut
/// short); told inside the request, the kernel dropped that very reply every time, so `fstat`
/// showed the new size while the kernel kept the old one (an mmap of it faulted with SIGBUS
/// past the old size), `lseek(SEEK_END)` gave the old size and a read stopped there.
#[test]
fn a_descriptor_acts_on_another_clients_larger_version_at_once() {
    use std::io::Read;
    use std::os::fd::AsRawFd;
    let s3 = s3();
    let b = s3.new_bucket("pingrow");
    let m = MountSpec::s3(&b, "").arg("--stat-ttl").arg("1").mount();
    for how in ["fstat and mmap", "lseek", "read"] {
        let key = how.replace(' ', "-");
        s3.put(&b, &key, pattern::bytes(1, 43));
        let mut f = File::open(m.join(&key)).unwrap();
        assert_eq!(f.metadata().unwrap().len(), 43);
        let new = pattern::bytes(2, 5042);
        s3.put(&b, &key, new.clone());
        std::thread::sleep(std::time::Duration::from_millis(1300));
        match how {
            "fstat and mmap" => {
                let len = f.metadata().unwrap().len() as usize;
                assert_eq!(len, new.len(), "fstat");
                // SAFETY: a private read-only mapping of `len` bytes of an open file, read
                // and unmapped here.
                let got = unsafe {
                    let p = libc::mmap(
                        std::ptr::null_mut(),
                        len,
                        libc::PROT_READ,
                        libc::MAP_PRIVATE,
                        f.as_raw_fd(),
                        0,
                    );
                    assert_ne!(p, libc::MAP_FAILED, "mmap");
                    let got = std::slice::from_raw_parts(p as *const u8, len).to_vec();
                    libc::munmap(p, len);
                    got
                };
                assert!(got == new, "the mapping is not the new version");
            }
            "lseek" => assert_eq!(f.seek(SeekFrom::End(0)).unwrap(), new.len() as u64),
            _ => {
                let mut buf = vec![0; 10_000];
                let n = f.read(&mut buf).unwrap();
                assert!(
                    buf[..n] == new[..],
                    "one read gave {n} bytes of {}",
                    new.len()
                );
            }
        }
    }
    drop(m);
    s3.remove_bucket(&b);
}

/// A descriptor partway through a version another client then replaced (same size, so only
/// the ETag tells), while a newer open reads the new version in full: the old descriptor reads
/// on with `ESTALE`, never the new version's bytes after the old one's. Before, the newer
/// open filled the kernel's page cache, which both descriptors share, and the old one was
/// served those pages without a word to the daemon (1 MiB of the old version, then the new).
#[test]
fn a_descriptor_partway_through_a_version_never_reads_a_newer_opens_pages() {
    use std::io::Read;
    let s3 = s3();
    let b = s3.new_bucket("pinmix");
    let m = MountSpec::s3(&b, "").arg("--stat-ttl").arg("1").mount();
    let (old, new) = (pattern::bytes(1, 3 * MIB), pattern::bytes(2, 3 * MIB));
    s3.put(&b, "k", old.clone());
    let mut a = File::open(m.join("k")).unwrap();
    let mut head = vec![0; MIB];
    a.read_exact(&mut head).unwrap();
    assert!(head == old[..MIB], "the first MiB is not the old version");
    s3.put(&b, "k", new.clone());
    std::thread::sleep(std::time::Duration::from_millis(1300));
    assert!(
        fs::read(m.join("k")).unwrap() == new,
        "a new open reads the new version"
    );
    let mut rest = Vec::new();
    match a.read_to_end(&mut rest) {
        Err(e) if e.raw_os_error() == Some(libc::ESTALE) => {}
        Err(e) => panic!("the old descriptor failed with {e}, not ESTALE"),
        Ok(n) => assert!(
            rest == old[MIB..],
            "the old descriptor read {n} more bytes: not the rest of its version (the new \
             version's: {})",
            rest == new[MIB..]
        ),
    }
    // Opens while the old descriptor stays open are served through the daemon; a shared
    // mapping of one still works (the page cache serves it).
    let c = File::open(m.join("k")).unwrap();
    assert!(
        map_shared(&c, new.len()) == new,
        "the mapping is not the new version"
    );
    drop((a, c));
    drop(m);
    s3.remove_bucket(&b);
}

/// The first `len` bytes of `f` through a shared read-only mapping.
fn map_shared(f: &File, len: usize) -> Vec<u8> {
    use std::os::fd::AsRawFd;
    // SAFETY: a shared read-only mapping of `len` bytes of an open file, copied out and
    // unmapped here.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        );
        assert_ne!(
            p,
            libc::MAP_FAILED,
            "mmap: {}",
            std::io::Error::last_os_error()
        );
        let got = std::slice::from_raw_parts(p as *const u8, len).to_vec();
        libc::munmap(p, len);
        got
    }
}

/// The atomic replace config writers and editors do (write `NAME.tmp`, rename it over `NAME`)
/// while readers open `NAME` and read it: every read gives one whole version, never `ESTALE`,
/// in both upload modes. With one writer (every 20 ms), readers that read 64 KiB, pause and
/// read the rest; with two writers (renames over the name back to back at times), readers
/// that read the file at once (at most 1 in 1,000 reads gets `ESTALE` there). Before, a reader whose open came while a rename replaced the
/// file opened the replaced one and got `ESTALE` a read later (15-60 of 280 reads in 20 s with
/// one writer, most in background mode); with the first fix, an open that got `ESTALE` for
/// that, whose kernel's one try again met the next rename, failed (48 of 84 `cat`s with two
/// writers); a read in flight while a rename moved its file to a hidden name for its
/// descriptors got `ESTALE` (3 of 204 reads under load).
#[test]
fn readers_of_a_file_replaced_by_renames_always_read_one_whole_version() {
    let s3 = s3();
    let b = s3.new_bucket("pinatomic");
    let state = state_dir();
    for (mode, prefix) in [("sync", "s"), ("background", "b")] {
        let m = MountSpec::s3(&b, prefix)
            .arg("--upload")
            .arg(mode)
            .arg("--state-dir")
            .arg(state.path().to_str().unwrap())
            .mount();
        for (writers, pause) in [(&[20][..], true), (&[20, 30][..], false)] {
            let (ok, bad) = replace_while_reading(&m, writers, pause);
            let what = format!("{mode}, {} writers", writers.len());
            // Two writers: a reader whose open and its kernel's try again both met a rename
            // reads what the name holds after, and a third rename between its two reads
            // leaves it no copy (about 1 in 10,000 reads; see reliability.md).
            let allowed = if writers.len() == 1 { 0 } else { ok / 1000 };
            assert!(
                bad.len() <= allowed,
                "{what}: {} bad reads of {}: {:?}",
                bad.len(),
                ok + bad.len(),
                &bad[..bad.len().min(5)]
            );
            assert!(ok > 10, "{what}: only {ok} reads");
        }
        drop(m);
    }
    s3.remove_bucket(&b);
}

/// Writers (one per entry of `writers`: its pause in ms) replace `atomic.dat` by renames for
/// 4 s while three readers read it whole, pausing 50 ms after its first 64 KiB if `pause`:
/// the reads that gave one whole version, and what each other one gave.
fn replace_while_reading(m: &Mount, writers: &[u64], pause: bool) -> (usize, Vec<String>) {
    use std::io::Read;
    use std::sync::atomic::{AtomicBool, Ordering};
    let version = |v: u64| v.to_le_bytes().repeat(256 << 10 >> 3);
    let name = m.join("atomic.dat");
    fs::write(&name, version(0)).unwrap();
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        let readers: Vec<_> = (0..3)
            .map(|_| {
                s.spawn(|| {
                    let (mut ok, mut bad) = (0, Vec::new());
                    while !stop.load(Ordering::Relaxed) {
                        let got = File::open(&name)
                            .map_err(|e| format!("open: {e}"))
                            .and_then(|mut f| {
                                let mut head = vec![0; 64 << 10];
                                f.read_exact(&mut head)
                                    .map_err(|e| format!("first read: {e}"))?;
                                if pause {
                                    std::thread::sleep(std::time::Duration::from_millis(50));
                                }
                                f.read_to_end(&mut head)
                                    .map_err(|e| format!("second read: {e}"))?;
                                Ok(head)
                            });
                        match got {
                            Ok(d) if d.len() == 256 << 10 && d == version(d[0] as u64) => ok += 1,
                            Ok(d) => bad.push(format!("{} bytes, not one version", d.len())),
                            Err(e) => bad.push(e),
                        }
                    }
                    (ok, bad)
                })
            })
            .collect();
        let writers: Vec<_> = writers
            .iter()
            .enumerate()
            .map(|(w, &pause)| {
                let (tmp, name) = (m.join(format!("atomic.dat.{w}")), &name);
                let n = writers.len() as u64;
                s.spawn(move || {
                    let start = std::time::Instant::now();
                    let mut v = w as u64;
                    while start.elapsed() < std::time::Duration::from_secs(4) {
                        v += n;
                        fs::write(&tmp, version(v % 200)).unwrap();
                        fs::rename(&tmp, name).unwrap();
                        std::thread::sleep(std::time::Duration::from_millis(pause));
                    }
                })
            })
            .collect();
        for w in writers {
            w.join().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        readers
            .into_iter()
            .fold((0, Vec::new()), |(ok, mut bad), r| {
                let (o, b) = r.join().unwrap();
                bad.extend(b);
                (ok + o, bad)
            })
    })
}
