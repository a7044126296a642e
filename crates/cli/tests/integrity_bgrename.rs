//! `--upload background` (issue 20), renames, through real mounts against MinIO. The daemon
//! is stopped at named steps (`BUCKETFS_TEST_POINT`, see crates/fs/src/testpoint.rs) to force
//! each interleaving, or killed there: a file closed below a directory being renamed goes up
//! under its new name; a rename killed between its bucket change and its write-back record
//! leaves each version under the name it is to have; a file renamed while it uploads lets its
//! state (and the disk space it holds) go; a directory rename freezes no file below it (and,
//! without background mode, still makes a close below wait, so its version is not lost).

mod common;

use common::*;
use std::io::Write;
use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

/// A background mount of `bucket` with state directory `state`, stopped at test points
/// `points` (empty: none).
fn background_at(bucket: &str, state: &Path, points: &str, extra: &[&str]) -> MountSpec {
    let mut spec = background(MountSpec::s3(bucket, ""), state, extra);
    if !points.is_empty() {
        spec.envs
            .push(("BUCKETFS_TEST_POINT".into(), points.to_string()));
    }
    spec
}

/// Runs `f` on a thread; its result, or None if it did not finish within `limit`.
fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit).ok()
}

/// A file opened for writing below a directory after its rename began, and closed while the
/// rename copies the objects, goes up under its new name (it used to keep its version
/// waiting for upload under the old key: uploaded to the old name after the rename).
#[test]
fn a_file_closed_below_a_directory_being_renamed_goes_up_under_the_new_name() {
    let b = s3().new_bucket("bgrena");
    s3().put(&b, "d/f", b"v1".to_vec());
    let state = state_dir();
    let pause = Pause::new(state.path());
    let m = background_at(
        &b,
        state.path(),
        &pause.point("rename_dir.copied"),
        &["--upload-delay", "600", "--negative-ttl", "300"],
    )
    .mount();
    // Looked up now: the open during the rename needs no lookup in the root it locks.
    assert_eq!(read_file(&m.join("d/f")), b"v1");
    assert!(!m.join("e").exists());
    let (from, to) = (m.join("d"), m.join("e"));
    let rename = std::thread::spawn(move || std::fs::rename(from, to));
    pause.reached();
    let path = m.join("d/f");
    let closed = within(Duration::from_secs(20), move || {
        let mut f = std::fs::File::create(path)?;
        f.write_all(b"v2, closed during the rename")?;
        close_checked(f)
    });
    pause.go_on();
    let renamed = within(Duration::from_secs(30), move || rename.join().unwrap());
    renamed.expect("rename hung").expect("rename");
    closed.expect("close hung").expect("close");
    assert_eq!(read_file(&m.join("e/f")), b"v2, closed during the rename");
    let (status, log) = m.unmount();
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
    assert_eq!(
        s3().get(&b, "e/f").as_deref(),
        Some(&b"v2, closed during the rename"[..]),
        "the version closed during the rename is not under the new name"
    );
    assert_eq!(
        s3().list_keys(&b, "d"),
        Default::default(),
        "the old name came back"
    );
}

/// A file opened below a directory at the very end of its rename (after the files being
/// written were re-pointed) goes up under its new name: the namespace moved before that step
/// (it used to move after, so such a file took its old key, uploaded to the old name).
#[test]
fn a_file_opened_at_the_end_of_a_directory_rename_goes_up_under_the_new_name() {
    let b = s3().new_bucket("bgrenf");
    s3().put(&b, "d/f", b"v1".to_vec());
    let state = state_dir();
    let pause = Pause::new(state.path());
    let m = background_at(
        &b,
        state.path(),
        &pause.point("rename_dir.repointed"),
        &["--upload-delay", "0", "--negative-ttl", "300"],
    )
    .mount();
    assert_eq!(read_file(&m.join("d/f")), b"v1");
    assert!(!m.join("e").exists());
    let (from, to) = (m.join("d"), m.join("e"));
    let rename = std::thread::spawn(move || std::fs::rename(from, to));
    pause.reached();
    let path = m.join("d/f");
    let closed = within(Duration::from_secs(20), move || {
        let mut f = std::fs::File::create(path)?;
        f.write_all(b"v2, opened at the end of the rename")?;
        close_checked(f)
    });
    pause.go_on();
    let renamed = within(Duration::from_secs(30), move || rename.join().unwrap());
    renamed.expect("rename hung").expect("rename");
    closed.expect("close hung").expect("close");
    let (status, log) = m.unmount();
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
    assert_eq!(
        s3().get(&b, "e/f").as_deref(),
        Some(&b"v2, opened at the end of the rename"[..])
    );
    assert_eq!(
        s3().list_keys(&b, "d"),
        Default::default(),
        "the old name came back"
    );
}

/// While a directory rename copies the objects, a file below it that is open for writing
/// takes writes and closes (its version waiting for upload moves with the rest): the rename
/// locks no file across a request (it used to hold them all for its whole length).
#[test]
fn a_directory_rename_freezes_no_file_below_it() {
    let b = s3().new_bucket("bgrenb");
    let state = state_dir();
    let pause = Pause::new(state.path());
    let m = background_at(
        &b,
        state.path(),
        &pause.point("rename_dir.copied"),
        &["--upload-delay", "600", "--negative-ttl", "300"],
    )
    .mount();
    std::fs::create_dir(m.join("d")).unwrap();
    assert!(!m.join("e").exists());
    write_file(&m.join("d/f"), b"v1");
    write_file(&m.join("d/g"), b"g, waiting");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open(m.join("d/f"))
        .unwrap();
    f.write_all(b"v2").unwrap();
    let (from, to) = (m.join("d"), m.join("e"));
    let rename = std::thread::spawn(move || std::fs::rename(from, to));
    pause.reached();
    // The rename is in the middle of its copies now, and stays there until `go_on`.
    let closed = within(Duration::from_secs(10), move || {
        f.write_all(b", written and closed during the rename")?;
        close_checked(f)
    });
    pause.go_on();
    let renamed = within(Duration::from_secs(30), move || rename.join().unwrap());
    let closed = closed.expect("a write or close below the directory waited for its rename");
    closed.expect("close");
    renamed.expect("rename hung").expect("rename");
    assert_eq!(
        read_file(&m.join("e/f")),
        b"v2, written and closed during the rename"
    );
    let (status, log) = m.unmount();
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
    assert_eq!(
        s3().get(&b, "e/f").as_deref(),
        Some(&b"v2, written and closed during the rename"[..])
    );
    assert_eq!(s3().get(&b, "e/g").as_deref(), Some(&b"g, waiting"[..]));
    assert_eq!(s3().list_keys(&b, "d"), Default::default());
}

/// kill -9 of a rename after it copied the object to the new name and before it deleted the
/// old one (a file, then a directory), with the file's version waiting for upload: after the
/// restart that version is under the new name only (it used to go up under the old name,
/// which came back, and the new name kept the stale copy).
#[test]
fn a_rename_killed_between_copy_and_delete_leaves_the_version_under_the_new_name() {
    let b = s3().new_bucket("bgrenc");
    s3().put(&b, "a", b"a v1".to_vec());
    s3().put(&b, "d/f", b"f v1".to_vec());
    let state = state_dir();
    let cases = [
        ("rename.copied", "a", "b", "a", "b"),
        ("rename_dir.copied", "d/f", "e/f", "d", "e"),
    ];
    for (point, old, new, from, to) in cases {
        let mut m = background_at(
            &b,
            state.path(),
            &format!("{point}=abort"),
            &["--upload-delay", "600"],
        )
        .mount();
        assert_eq!(read_file(&m.join(old)).len(), 4);
        write_file(&m.join(old), format!("{old} v2, ours").as_bytes());
        let renamed = std::fs::rename(m.join(from), m.join(to));
        assert!(renamed.is_err(), "the daemon was not killed at {point}");
        m.kill9();
        drop(m);
        // The copy is there, the old object too: the daemon died between them.
        assert!(s3().get(&b, new).is_some() && s3().get(&b, old).is_some());
        let m = background_at(&b, state.path(), "", &["--upload-delay", "0"]).mount();
        let (status, log) = m.unmount();
        assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
        assert_eq!(
            s3().get(&b, new).as_deref(),
            Some(format!("{old} v2, ours").as_bytes()),
            "{point}: the version is not under the new name"
        );
        assert_eq!(s3().get(&b, old), None, "{point}: the old name came back");
    }
}

/// A file renamed over one whose version waits for upload, the daemon killed between the
/// rename's copy and its delete of the old name: after the restart the new name holds the
/// moved file, and the replaced version never goes up over it (it did, from the write-back
/// directory: the moved file's bytes were then under neither name, or the upload stopped as
/// a conflict). Two replaced files: one written under its name, one renamed there.
#[test]
fn a_rename_over_a_file_waiting_for_upload_killed_after_its_copy_keeps_the_moved_file() {
    let b = s3().new_bucket("bgrenw");
    for (moved, replaced, via) in [("z1", "y1", None), ("z2", "y2", Some("tmp"))] {
        s3().put(&b, moved, b"the moved file".to_vec());
        let state = state_dir();
        let mut m = background_at(
            &b,
            state.path(),
            "rename.copied=abort",
            &["--upload-delay", "600"],
        )
        .mount();
        write_file(&m.join(via.unwrap_or(replaced)), b"the replaced version");
        if let Some(via) = via {
            std::fs::rename(m.join(via), m.join(replaced)).unwrap();
        }
        let renamed = std::fs::rename(m.join(moved), m.join(replaced));
        assert!(renamed.is_err(), "the daemon was not killed at the copy");
        m.kill9();
        drop(m);
        assert_eq!(
            s3().get(&b, replaced).as_deref(),
            Some(&b"the moved file"[..])
        );
        let m = background_at(&b, state.path(), "", &["--upload-delay", "0"]).mount();
        let (status, log) = m.unmount();
        assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
        assert_eq!(
            s3().get(&b, replaced).as_deref(),
            Some(&b"the moved file"[..]),
            "{replaced}: the replaced version went up over the moved file"
        );
    }
}

/// A background mount of a new bucket (`name`) whose file `a` (`body`) is renamed to `b`
/// while its upload is stopped before it lands, then let go; returns once the rename
/// returned and nothing is pending, with the bucket, the state directory, the mount and, if
/// `read`, a descriptor reading `a` opened before the rename.
fn renamed_while_uploading(
    name: &str,
    body: &[u8],
    read: bool,
) -> (String, tempfile::TempDir, Mount, Option<std::fs::File>) {
    let b = s3().new_bucket(name);
    let state = state_dir();
    let pause = Pause::new(state.path());
    let m = background_at(
        &b,
        state.path(),
        &pause.point("writeback.uploaded"),
        &["--upload-delay", "0", "--stat-ttl", "1"],
    )
    .mount();
    write_file(&m.join("a"), body);
    let reader = read.then(|| std::fs::File::open(m.join("a")).unwrap());
    pause.reached();
    let (from, to) = (m.join("a"), m.join("b"));
    let rename = std::thread::spawn(move || std::fs::rename(from, to));
    std::thread::sleep(Duration::from_millis(300));
    pause.go_on();
    let renamed = within(Duration::from_secs(30), move || rename.join().unwrap());
    renamed.expect("rename hung").expect("rename");
    wait_for("nothing pending", Duration::from_secs(20), || {
        nothing_pending(m.path())
    });
    (b, state, m, reader)
}

/// Another client replaces `b` in `bucket`: mount `m` shows it after its `--stat-ttl`.
fn shows_another_clients_version(bucket: &str, m: &Mount, why: &str) {
    s3().put(bucket, "b", b"theirs, longer".to_vec());
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(read_file(&m.join("b")), b"theirs, longer", "{why}");
}

/// A file renamed while its upload is in flight: once the upload is done its write state
/// goes (it used to stay, "being written", holding the write-back file it read from, so
/// that the disk space never came back and the file kept showing this mount's version over
/// another client's).
#[test]
fn a_file_renamed_while_it_uploads_lets_its_state_go() {
    // Over 4 MiB: a write-back file of its own, not a segment record.
    let body = pattern::bytes(1, 5 << 20);
    let (b, state, m, _) = renamed_while_uploading("bgrend", &body, false);
    assert_eq!(s3().get(&b, "b").as_deref(), Some(&body[..]));
    assert_eq!(s3().get(&b, "a"), None);
    let pid = m.daemon_pid().unwrap();
    let held: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .map(|p| p.display().to_string())
        .filter(|p| p.starts_with(state.path().to_str().unwrap()) && p.ends_with("(deleted)"))
        .collect();
    assert!(
        held.is_empty(),
        "the daemon still holds removed write-back files: {held:?}"
    );
    shows_another_clients_version(&b, &m, "the renamed file still shows this mount's state");
}

/// The same with a reader holding the file open across the rename: its state is kept for
/// the reader, and goes when the reader closes (it stayed until the unmount, the renamed
/// file showing this mount's old version over another client's newer one).
#[test]
fn a_file_renamed_while_it_uploads_and_read_lets_its_state_go_at_the_last_close() {
    let (b, _state, m, reader) = renamed_while_uploading("bgrenr", b"ours", true);
    drop(reader);
    assert_eq!(s3().get(&b, "b").as_deref(), Some(&b"ours"[..]));
    shows_another_clients_version(
        &b,
        &m,
        "the renamed file still shows this mount's state after its reader closed",
    );
}

/// Without background mode, a close of a file below a directory being renamed waits for the
/// rename and publishes under the new name: the rename's delete of the old objects never
/// takes a version published meanwhile.
#[test]
fn a_sync_close_below_a_directory_being_renamed_is_published_under_the_new_name() {
    let b = s3().new_bucket("bgrene");
    s3().put(&b, "d/f", b"v1".to_vec());
    let tmp = state_dir();
    let pause = Pause::new(tmp.path());
    let mut spec = MountSpec::s3(&b, "");
    spec.args
        .extend(["--negative-ttl", "300"].iter().map(|s| s.to_string()));
    spec.envs.push((
        "BUCKETFS_TEST_POINT".into(),
        pause.point("rename_dir.copied"),
    ));
    let m = spec.mount();
    assert!(!m.join("e").exists());
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open(m.join("d/f"))
        .unwrap();
    f.write_all(b"v2").unwrap();
    let (from, to) = (m.join("d"), m.join("e"));
    let rename = std::thread::spawn(move || std::fs::rename(from, to));
    pause.reached();
    let close = std::thread::spawn(move || close_checked(f));
    std::thread::sleep(Duration::from_millis(500));
    pause.go_on();
    let renamed = within(Duration::from_secs(30), move || rename.join().unwrap());
    renamed.expect("rename hung").expect("rename");
    let closed = within(Duration::from_secs(30), move || close.join().unwrap());
    closed.expect("close hung").expect("close");
    assert_eq!(s3().get(&b, "e/f").as_deref(), Some(&b"v2"[..]));
    assert_eq!(s3().list_keys(&b, "d"), Default::default());
    drop(m);
}

/// A file unlinked, or renamed, inside a directory while that directory's rename is in the
/// middle of its copies: the file's version waiting for upload goes with the unlink (or the
/// file rename), not up under the directory's new name (the unlink saw it as uploaded, since
/// the directory rename had moved it to a new entry, and the deleted file came back under
/// the new name; the file rename left its bytes under the old file name).
#[test]
fn a_file_unlinked_or_renamed_below_a_directory_being_renamed_stays_so() {
    for (case, tag) in [("unlink", "bgrenu"), ("rename", "bgrenr")] {
        let b = s3().new_bucket(tag);
        let state = state_dir();
        let pause = Pause::new(state.path());
        let m = background_at(
            &b,
            state.path(),
            &pause.point("rename_dir.copied"),
            &["--upload-delay", "600", "--negative-ttl", "300"],
        )
        .mount();
        std::fs::create_dir(m.join("d")).unwrap();
        assert!(!m.join("e").exists());
        write_file(&m.join("d/f"), b"f, waiting");
        write_file(&m.join("d/g"), b"g, waiting");
        let (from, to) = (m.join("d"), m.join("e"));
        let rename = std::thread::spawn(move || std::fs::rename(from, to));
        pause.reached();
        // The kernel locks only d for these: they reach the daemon during the rename.
        let (f, g) = (m.join("d/f"), m.join("d/g"));
        let op = std::thread::spawn(move || match case {
            "unlink" => std::fs::remove_file(f),
            _ => std::fs::rename(f, g),
        });
        std::thread::sleep(Duration::from_millis(500));
        pause.go_on();
        let renamed = within(Duration::from_secs(30), move || rename.join().unwrap());
        renamed.expect("rename hung").expect("rename");
        let done = within(Duration::from_secs(30), move || op.join().unwrap());
        done.expect("hung").expect(case);
        let (status, log) = m.unmount();
        assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
        let g = match case {
            "unlink" => &b"g, waiting"[..],
            _ => &b"f, waiting"[..],
        };
        assert_eq!(s3().get(&b, "e/f"), None, "{case}: e/f came back");
        assert_eq!(s3().get(&b, "e/g").as_deref(), Some(g), "{case}: e/g");
        assert_eq!(s3().list_keys(&b, "d"), Default::default(), "{case}");
    }
}

/// A directory rename while a writer below keeps appending to a file and closing it: each
/// time the rename is about to re-point the file, another version is closed under the old
/// name; the rename still ends, and the file under the new name holds every append (it used
/// to sweep again and come back for each such version: with a writer that keeps closing,
/// forever, the kernel holding the parent directory's lock meanwhile).
#[test]
fn a_directory_rename_ends_while_a_writer_below_keeps_closing() {
    let b = s3().new_bucket("bgrenl");
    let state = state_dir();
    let pause = Pause::new(state.path());
    let m = background_at(
        &b,
        state.path(),
        &pause.point("rename_dir.repointing"),
        &["--upload-delay", "600", "--negative-ttl", "300"],
    )
    .mount();
    std::fs::create_dir(m.join("d")).unwrap();
    write_file(&m.join("d/log"), b"line 0\n");
    let mut want = b"line 0\n".to_vec();
    let (from, to) = (m.join("d"), m.join("e"));
    let rename = std::thread::spawn(move || std::fs::rename(from, to));
    let mut rounds = 0;
    while rounds < 5 {
        let t = std::time::Instant::now();
        while !pause.file().exists()
            && !rename.is_finished()
            && t.elapsed() < Duration::from_secs(20)
        {
            std::thread::sleep(Duration::from_millis(10));
        }
        if !pause.file().exists() {
            break;
        }
        rounds += 1;
        let line = format!("line {rounds}\n");
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(m.join("d/log"))
            .unwrap();
        f.write_all(line.as_bytes()).unwrap();
        close_checked(f).unwrap();
        want.extend_from_slice(line.as_bytes());
        pause.go_on();
    }
    assert_eq!(
        rounds, 1,
        "the rename came back to the file for each version closed meanwhile"
    );
    let renamed = within(Duration::from_secs(20), move || rename.join().unwrap());
    renamed.expect("rename hung").expect("rename");
    assert_eq!(read_file(&m.join("e/log")), want);
    let (status, log) = m.unmount();
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
    assert_eq!(s3().get(&b, "e/log").as_deref(), Some(&want[..]));
    assert_eq!(s3().list_keys(&b, "d"), Default::default());
}

/// A file created in a directory while a rename of the directory runs from start to end
/// between the create's read of the directory's path and its new inode's registration (the
/// kernel does not lock a directory renamed within its parent, and in background mode the
/// create does not wait): it goes up under the new name. It used to keep the old path, and
/// its upload brought the old directory back, the file missing from the new one.
#[test]
fn a_file_created_across_a_rename_of_its_directory_goes_up_under_the_new_name() {
    let b = s3().new_bucket("bgrenc");
    s3().put(&b, "d/a", b"a".to_vec());
    let state = state_dir();
    let pause = Pause::new(state.path());
    let m = background_at(
        &b,
        state.path(),
        &pause.point("create.prepared"),
        &["--upload-delay", "0"],
    )
    .mount();
    assert_eq!(read_file(&m.join("d/a")), b"a");
    let path = m.join("d/n");
    let created = std::thread::spawn(move || {
        let mut f = std::fs::File::create(path)?;
        f.write_all(b"made across the rename")?;
        close_checked(f)
    });
    pause.reached();
    let (from, to) = (m.join("d"), m.join("e"));
    let renamed = within(Duration::from_secs(30), move || std::fs::rename(from, to));
    renamed.expect("rename hung").expect("rename");
    pause.go_on();
    created.join().unwrap().expect("create");
    assert_eq!(read_file(&m.join("e/n")), b"made across the rename");
    let (status, log) = m.unmount();
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
    assert_eq!(
        s3().get(&b, "e/n").as_deref(),
        Some(&b"made across the rename"[..])
    );
    assert_eq!(
        s3().list_keys(&b, "d"),
        Default::default(),
        "the old directory came back"
    );
}
