//! `--upload background` (issue 20) under failures and other clients, through real mounts
//! against MinIO: a failed unlink or rename keeps the version waiting for upload, a rename or
//! unlink never moves or deletes another client's newer object (a directory rename and a
//! close below it: integrity_bgrename.rs), conflicts filling the write-back directory give ENOSPC
//! instead of a close that waits forever, an object deleted by another client gets this
//! mount's version, `--upload-fsync bucket` waits for the upload of the version that replaced
//! its own, and a mount without background mode uploads what one left.

mod common;

use common::*;
use std::io::Write;
use std::path::Path;
use std::sync::mpsc;
use std::time::{Duration, Instant};

fn pending_lines(mp: &Path, state: &str) -> usize {
    pending(mp).lines().filter(|l| l.starts_with(state)).count()
}

/// Runs `f` on a thread; its result, or None if it did not finish within `limit`.
fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit).ok()
}

/// A failed unlink, and a failed rename over a file, keep the versions waiting for upload:
/// the files are still there with their content, still pending, and uploaded later.
#[test]
fn a_failed_unlink_or_rename_keeps_the_version_waiting_for_upload() {
    let b = s3().new_bucket("bgfixa");
    s3().put(&b, "old", b"theirs v1".to_vec());
    let state = state_dir();
    let proxy = proxy::FaultProxy::start(&minio_addr());
    let spec = background(
        via_proxy(&b, &proxy),
        state.path(),
        &["--upload-delay", "600", "--retry-timeout", "0"],
    );
    let m = spec.mount();
    assert_eq!(read_file(&m.join("old")), b"theirs v1");
    write_file(&m.join("old"), b"ours over v1");
    write_file(&m.join("a"), b"file a");
    write_file(&m.join("b"), b"file b");
    assert_eq!(pending_lines(m.path(), "queued"), 3);
    // Every request fails now.
    proxy.slow_down(1_000_000);
    let unlinked = std::fs::remove_file(m.join("old"));
    let renamed = std::fs::rename(m.join("a"), m.join("b"));
    proxy.slow_down(0);
    assert!(unlinked.is_err(), "the unlink did not fail");
    assert!(renamed.is_err(), "the rename did not fail");
    assert_eq!(read_file(&m.join("old")), b"ours over v1");
    assert_eq!(read_file(&m.join("a")), b"file a");
    assert_eq!(read_file(&m.join("b")), b"file b");
    assert_eq!(
        pending_lines(m.path(), "queued"),
        3,
        "a version waiting for upload was lost:\n{}",
        pending(m.path())
    );
    let (status, log) = m.unmount();
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
    assert_eq!(s3().get(&b, "old").unwrap(), b"ours over v1");
    assert_eq!(s3().get(&b, "a").unwrap(), b"file a");
    assert_eq!(s3().get(&b, "b").unwrap(), b"file b");
}

/// Another client writes a file whose version here waits for upload: a rename of the file
/// (or of its directory) is refused with ESTALE and neither moves nor deletes the other
/// client's object, so the upload cannot go over it under the new name; an unlink removes
/// this mount's version and keeps the other client's object.
#[test]
fn rename_and_unlink_never_bypass_the_conflict_check() {
    let b = s3().new_bucket("bgfixb");
    s3().put(&b, "old", b"theirs v1".to_vec());
    s3().put(&b, "gone", b"theirs g1".to_vec());
    let state = state_dir();
    let m = background(
        MountSpec::s3(&b, ""),
        state.path(),
        &["--upload-delay", "600"],
    )
    .mount();
    assert_eq!(read_file(&m.join("old")), b"theirs v1");
    assert_eq!(read_file(&m.join("gone")), b"theirs g1");
    std::fs::create_dir(m.join("d")).unwrap();
    write_file(&m.join("old"), b"ours over v1");
    write_file(&m.join("gone"), b"ours over g1");
    write_file(&m.join("d/f"), b"ours, new");
    std::fs::File::open(m.path()).unwrap().sync_all().unwrap();
    s3().put(&b, "old", b"theirs v2".to_vec());
    s3().put(&b, "gone", b"theirs g2".to_vec());
    s3().put(&b, "d/f", b"theirs, new".to_vec());
    let e = std::fs::rename(m.join("old"), m.join("new")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::ESTALE), "{e}");
    let e = std::fs::rename(m.join("d"), m.join("e")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::ESTALE), "{e}");
    std::fs::remove_file(m.join("gone")).unwrap();
    assert_eq!(s3().get(&b, "old").unwrap(), b"theirs v2");
    assert_eq!(s3().get(&b, "d/f").unwrap(), b"theirs, new");
    assert_eq!(s3().get(&b, "gone").unwrap(), b"theirs g2");
    assert!(s3().get(&b, "new").is_none());
    assert!(s3().get(&b, "e/f").is_none());
    // The uploads are refused as conflicts; the other client's objects stay.
    let (_, log) = m.unmount();
    assert!(log.contains("changed by another client"), "{log}");
    assert_eq!(s3().get(&b, "old").unwrap(), b"theirs v2");
    assert_eq!(s3().get(&b, "d/f").unwrap(), b"theirs, new");
    assert_eq!(s3().get(&b, "gone").unwrap(), b"theirs g2");
    assert!(s3().get(&b, "new").is_none() && s3().get(&b, "e/f").is_none());
}

/// Conflicts (never uploaded by themselves) that fill `--writeback-size` make a close
/// upload its file itself (as sync mode does) at once, with a log line, instead of waiting
/// forever or failing with ENOSPC (before: ENOSPC); removing one makes room again.
#[test]
fn conflicts_filling_the_writeback_directory_make_a_close_upload_itself_not_hang() {
    let b = s3().new_bucket("bgfixe");
    let state = state_dir();
    let m = background(
        MountSpec::s3(&b, ""),
        state.path(),
        &["--upload-delay", "2", "--writeback-size", "1M"],
    )
    .mount();
    let body = pattern::bytes(5, 400 << 10);
    write_file(&m.join("c0"), &body);
    write_file(&m.join("c1"), &body);
    s3().put(&b, "c0", b"theirs".to_vec());
    s3().put(&b, "c1", b"theirs".to_vec());
    wait_for("two conflicts", Duration::from_secs(20), || {
        pending_lines(m.path(), "conflict") == 2
    });
    let p = m.join("c2");
    let b2 = body.clone();
    let start = Instant::now();
    let r = within(Duration::from_secs(20), move || {
        let mut f = std::fs::File::create(&p)?;
        f.write_all(&b2)?;
        close_checked(f)
    });
    let Some(r) = r else {
        let mut m = m;
        m.kill9();
        panic!("the close waited for room that conflicts hold, forever");
    };
    r.expect("the close uploads the file");
    assert!(start.elapsed() < Duration::from_secs(5));
    assert!(
        s3().get(&b, "c2").as_deref() == Some(&body[..]),
        "in the bucket when the close returned"
    );
    assert!(
        m.log().contains("no room in the write-back directory"),
        "{}",
        m.log()
    );
    // Resolved by removing a conflicting file (the other client's object stays): the next
    // close goes through the write-back directory again (its upload waits 2 s).
    std::fs::remove_file(m.join("c0")).unwrap();
    write_file(&m.join("c3"), &body);
    assert!(s3().head(&b, "c3").is_none(), "uploaded before the delay");
    assert_eq!(s3().get(&b, "c0").unwrap(), b"theirs");
    wait_for("c3 uploaded", Duration::from_secs(20), || {
        s3().get(&b, "c3").as_deref() == Some(&body[..])
    });
}

/// Another client deletes an object whose new version here waits for upload: the upload
/// stores this mount's version as a new file (only while the key stays free), logged; it is
/// not left as a conflict.
#[test]
fn an_object_deleted_by_another_client_gets_this_mounts_version() {
    let b = s3().new_bucket("bgfixf");
    s3().put(&b, "old", b"theirs".to_vec());
    let state = state_dir();
    let m = background(
        MountSpec::s3(&b, ""),
        state.path(),
        &["--upload-delay", "2"],
    )
    .mount();
    assert_eq!(read_file(&m.join("old")), b"theirs");
    write_file(&m.join("old"), b"ours");
    s3().delete(&b, "old");
    wait_for("the upload", Duration::from_secs(20), || {
        s3().get(&b, "old").is_some()
    });
    assert_eq!(s3().get(&b, "old").unwrap(), b"ours");
    // Listed until the file system has learnt the uploaded version (just after it lands).
    wait_for("nothing pending", Duration::from_secs(10), || {
        nothing_pending(m.path())
    });
    assert!(m.log().contains("deleted by another client"), "{}", m.log());
}

/// `--upload-fsync bucket`: an fsync returns once its bytes are in the bucket, also when the
/// version it waits for is replaced before its upload (here by the rename of the directory
/// above, which moves it to a new key): it waits for the upload of the version that holds
/// its bytes. The fsync starts its upload at once (not after `--upload-delay`), so the
/// rename may also come after it: the bytes are then at the old key until the rename copies
/// them (the copy comes before the delete, so one of the two keys always holds them).
#[test]
fn fsync_to_bucket_waits_for_the_upload_of_the_version_that_replaced_its_own() {
    let b = s3().new_bucket("bgfixh");
    let state = state_dir();
    let m = background(
        MountSpec::s3(&b, ""),
        state.path(),
        &[
            "--upload-delay",
            "3",
            "--upload-fsync",
            "bucket",
            "--negative-ttl",
            "300",
        ],
    )
    .mount();
    std::fs::create_dir(m.join("d")).unwrap();
    assert!(!m.join("e").exists());
    std::fs::File::open(m.path()).unwrap().sync_all().unwrap();
    let mut f = std::fs::File::create(m.join("d/f")).unwrap();
    f.write_all(b"v1").unwrap();
    // Another file's upload lands (waking waiters) after the rename, before d/f's is due.
    write_file(&m.join("x"), b"x");
    let (bucket, start) = (b.clone(), Instant::now());
    let fsync = std::thread::spawn(move || {
        f.sync_all().unwrap();
        let at = start.elapsed();
        let found = s3()
            .get(&bucket, "d/f")
            .or_else(|| s3().get(&bucket, "e/f"));
        (at, found, f)
    });
    std::thread::sleep(Duration::from_millis(1500));
    std::fs::rename(m.join("d"), m.join("e")).unwrap();
    let (at, found, f) = fsync.join().unwrap();
    assert_eq!(
        found.as_deref(),
        Some(&b"v1"[..]),
        "fsync returned after {at:?} with its bytes not in the bucket"
    );
    close_checked(f).unwrap();
}

/// A mount without `--upload background` from a state directory where a background mount
/// left acknowledged files (kill -9) uploads them before it serves.
#[test]
fn a_sync_mount_uploads_what_a_background_mount_left() {
    let b = s3().new_bucket("bgfixj");
    let state = state_dir();
    let mut m = background(
        MountSpec::s3(&b, ""),
        state.path(),
        &["--upload-delay", "600"],
    )
    .mount();
    for i in 0..5 {
        write_file(&m.join(format!("j{i}")), format!("left {i}").as_bytes());
    }
    m.kill9();
    drop(m);
    assert!(s3().list_keys(&b, "").is_empty());
    let m = MountSpec::s3(&b, "")
        .arg("--state-dir")
        .arg(state.path().to_str().unwrap())
        .mount();
    for i in 0..5 {
        assert_eq!(
            s3().get(&b, &format!("j{i}")).as_deref(),
            Some(format!("left {i}").as_bytes()),
            "j{i} not uploaded before the mount served"
        );
    }
    assert!(
        m.log().contains("uploading them before serving"),
        "{}",
        m.log()
    );
}

/// The write-back directory and the `writeback` directory above it, made by the first mount
/// in background mode, are fsync'd into their parents before any commit relies on them
/// (strace of the daemon: `fsync` of each parent directory).
#[test]
fn the_writeback_directory_is_fsynced_into_its_parents_when_made() {
    let b = s3().new_bucket("bgfixi");
    let state = state_dir();
    let traced = tempfile::tempdir().unwrap();
    let out = traced.path().join("strace.txt");
    let mut spec = background(MountSpec::s3(&b, ""), state.path(), &[]);
    spec.program = Some("/usr/bin/strace".into());
    spec.command = [
        "-f",
        "-y",
        "-qq",
        "-e",
        "trace=fsync",
        "-e",
        "signal=none",
        "-o",
        out.to_str().unwrap(),
        bin(),
        "mount",
        "-f",
    ]
    .map(String::from)
    .to_vec();
    let m = spec.mount();
    write_file(&m.join("x"), b"x");
    let (_, log) = m.unmount();
    let trace = std::fs::read_to_string(&out).unwrap();
    let st = state.path().canonicalize().unwrap();
    for dir in [st.clone(), st.join("writeback")] {
        let synced = format!("<{}>) = 0", dir.display());
        assert!(
            trace
                .lines()
                .any(|l| l.contains("fsync(") && l.ends_with(&synced)),
            "{} not fsync'd:\n{trace}\n{log}",
            dir.display()
        );
    }
}

/// When what a background mount left cannot be uploaded (here another client wrote the key
/// since: a conflict), a mount without `--upload background` refuses to start with one line
/// that says so, instead of ignoring it; the file stays for a background mount.
#[test]
fn a_sync_mount_refuses_when_what_was_left_cannot_be_uploaded() {
    let b = s3().new_bucket("bgfixj2");
    let state = state_dir();
    let mut m = background(
        MountSpec::s3(&b, ""),
        state.path(),
        &["--upload-delay", "600"],
    )
    .mount();
    write_file(&m.join("k"), b"ours");
    m.kill9();
    drop(m);
    s3().put(&b, "k", b"theirs".to_vec());
    let spec = MountSpec::s3(&b, "")
        .arg("--state-dir")
        .arg(state.path().to_str().unwrap());
    let err = match Mount::start(spec) {
        Ok(_) => panic!("the mount started with an acknowledged file it could not upload"),
        Err(e) => e,
    };
    assert!(
        err.contains(
            "1 of 1 file(s) a mount with --upload background acknowledged could not be uploaded"
        ),
        "{err}"
    );
    assert_eq!(s3().get(&b, "k").unwrap(), b"theirs");
    // A background mount still has it (as a conflict).
    let m = background(MountSpec::s3(&b, ""), state.path(), &[]).mount();
    assert_eq!(
        pending_lines(m.path(), "conflict"),
        1,
        "{}",
        pending(m.path())
    );
}

/// A chmod or utimens of a file held as a conflict (another client wrote the object after
/// this mount's version was acknowledged) keeps it a conflict: the change is recorded in
/// this mount's version, which still never goes over the other client's object (before: the
/// change made a new version that went over it, and the other client's bytes were gone).
/// Writing the file again is what stores it over theirs. The same after a remount (the
/// conflict taken up from the state directory).
#[test]
fn a_chmod_of_a_conflict_keeps_the_other_clients_object() {
    use std::os::unix::fs::PermissionsExt;
    let b = s3().new_bucket("bgfixc");
    s3().put(&b, "old", b"theirs v1".to_vec());
    let state = state_dir();
    let m = background(
        MountSpec::s3(&b, ""),
        state.path(),
        &["--upload-delay", "1"],
    )
    .mount();
    assert_eq!(read_file(&m.join("old")), b"theirs v1");
    write_file(&m.join("old"), b"ours over v1");
    s3().put(&b, "old", b"theirs v2".to_vec());
    wait_for("the conflict", Duration::from_secs(30), || {
        pending_lines(m.path(), "conflict") == 1
    });
    std::fs::set_permissions(m.join("old"), std::fs::Permissions::from_mode(0o600)).unwrap();
    let old = std::fs::File::options()
        .write(true)
        .open(m.join("old"))
        .unwrap();
    old.set_modified(std::time::UNIX_EPOCH + Duration::from_secs(1_000_000_000))
        .unwrap();
    drop(old);
    // Past the upload delay and a try.
    std::thread::sleep(Duration::from_secs(4));
    assert_eq!(s3().get(&b, "old").unwrap(), b"theirs v2");
    wait_for("the conflict again", Duration::from_secs(30), || {
        pending_lines(m.path(), "conflict") == 1
    });
    let md = std::fs::metadata(m.join("old")).unwrap();
    assert_eq!(md.permissions().mode() & 0o7777, 0o600);
    let (_, log) = m.unmount();
    assert_eq!(s3().get(&b, "old").unwrap(), b"theirs v2", "{log}");
    // The same after a remount, which takes the conflict up from the state directory.
    let m = background(
        MountSpec::s3(&b, ""),
        state.path(),
        &["--upload-delay", "1"],
    )
    .mount();
    wait_for(
        "the conflict after a remount",
        Duration::from_secs(30),
        || pending_lines(m.path(), "conflict") == 1,
    );
    std::fs::set_permissions(m.join("old"), std::fs::Permissions::from_mode(0o640)).unwrap();
    std::thread::sleep(Duration::from_secs(4));
    assert_eq!(s3().get(&b, "old").unwrap(), b"theirs v2");
    let (_, log) = m.unmount();
    assert_eq!(s3().get(&b, "old").unwrap(), b"theirs v2", "{log}");
}

/// Background mode: a directory the bucket holds only through its keys (no marker) whose
/// last stored file is removed while a file made here waits for upload in it keeps
/// existing: it gets a marker, so it is still listed (with the file) and `rm -rf` of the
/// tree above removes the waiting file too, which then never reaches the bucket (before:
/// the directories vanished from listings, `rm -rf` succeeded without seeing the file, and
/// the upload brought it back).
#[test]
fn a_file_waiting_for_upload_keeps_its_implied_directory() {
    let b = s3().new_bucket("bgfixd");
    s3().put(&b, "top/d/x", b"theirs".to_vec());
    s3().put(&b, "one/x", b"theirs".to_vec());
    let state = state_dir();
    let m = background(
        MountSpec::s3(&b, ""),
        state.path(),
        &["--upload-delay", "600"],
    )
    .mount();
    write_file(&m.join("top/d/a"), b"acked");
    write_file(&m.join("one/a"), b"acked");
    std::fs::remove_file(m.join("top/d/x")).unwrap();
    std::fs::remove_file(m.join("one/x")).unwrap();
    // A listing waits for the markers made below it.
    let root = list_dir(m.path());
    assert!(root.contains("top") && root.contains("one"), "{root:?}");
    assert!(s3().head(&b, "top/d/").is_some(), "no marker keeps top/d");
    assert!(s3().head(&b, "one/").is_some(), "no marker keeps one");
    assert!(list_dir(&m.join("top")).contains("d"));
    assert!(list_dir(&m.join("top/d")).contains("a"));
    assert!(list_dir(&m.join("one")).contains("a"));
    std::fs::remove_dir_all(m.join("top")).unwrap();
    let (status, log) = m.unmount();
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
    assert!(
        s3().list_keys(&b, "top/").is_empty(),
        "{:?}",
        s3().list_keys(&b, "top/")
    );
    assert_eq!(s3().get(&b, "one/a").as_deref(), Some(&b"acked"[..]));
}
