//! `--upload background` (issue 20) after a crash and under other clients, through real
//! mounts against MinIO: a file recovered from the write-back directory behaves as one
//! written by the running daemon (reads, appends, unlink and rename see its version), an
//! unlink that deleted the object reports success, an upload whose answer was lost is not
//! taken for another client's write, and a close waiting for room is not starved by later,
//! smaller ones.

mod common;

use common::*;
use std::io::Write;
use std::path::Path;
use std::time::Duration;

fn append(path: &Path, data: &[u8]) {
    let mut f = std::fs::OpenOptions::new().append(true).open(path).unwrap();
    f.write_all(data).unwrap();
    close_checked(f).unwrap();
}

/// Files written over objects of the bucket, the daemon killed before their uploads, the
/// next mount (same state directory) unable to upload them at first: each is still this
/// mount's version: it reads back, an append builds on it, an unlink removes it for good
/// (its upload does not bring it back later), a rename moves it.
#[test]
fn recovered_files_behave_as_files_written_here() {
    let b = s3().new_bucket("bgrec1");
    for k in ["fread", "fappend", "funlink", "frename", "fdir/fnew"] {
        s3().put(&b, k, format!("theirs {k}").into_bytes());
    }
    let state = state_dir();
    let proxy = proxy::FaultProxy::start(&minio_addr());
    let spec = background(
        via_proxy(&b, &proxy),
        state.path(),
        &["--upload-delay", "600", "--retry-timeout", "0"],
    );
    let mut m = spec.mount();
    for k in ["fread", "fappend", "funlink", "frename", "fdir/fnew"] {
        write_file(&m.join(k), format!("ours {k}").as_bytes());
    }
    // A file created here, in a directory of the bucket.
    write_file(&m.join("fdir/fcreated"), b"ours, created");
    m.kill9();
    drop(m);
    // The uploads of the recovered files fail for now (the retry comes 10 s later).
    proxy.fail_requests(&format!("PUT /{b}/f"), 1_000_000);
    let m = spec.mount();
    assert_eq!(read_file(&m.join("fread")), b"ours fread");
    assert_eq!(read_file(&m.join("fdir/fnew")), b"ours fdir/fnew");
    assert_eq!(read_file(&m.join("fdir/fcreated")), b"ours, created");
    assert_eq!(list_dir(&m.join("fdir")), set(["fcreated", "fnew"]));
    append(&m.join("fappend"), b" and more");
    assert_eq!(read_file(&m.join("fappend")), b"ours fappend and more");
    std::fs::remove_file(m.join("funlink")).unwrap();
    std::fs::rename(m.join("frename"), m.join("grename")).unwrap();
    assert_eq!(read_file(&m.join("grename")), b"ours frename");
    let names = list_dir(m.path());
    assert!(
        !names.contains("funlink") && !names.contains("frename"),
        "{names:?}"
    );
    proxy.fail_requests("", 0);
    let (status, log) = m.unmount();
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
    assert_eq!(s3().get(&b, "fread").unwrap(), b"ours fread");
    assert_eq!(s3().get(&b, "fdir/fnew").unwrap(), b"ours fdir/fnew");
    assert_eq!(s3().get(&b, "fdir/fcreated").unwrap(), b"ours, created");
    assert_eq!(s3().get(&b, "fappend").unwrap(), b"ours fappend and more");
    assert_eq!(s3().get(&b, "funlink"), None, "the unlinked file came back");
    assert_eq!(s3().get(&b, "frename"), None, "the renamed file came back");
    assert_eq!(s3().get(&b, "grename").unwrap(), b"ours frename");
}

/// Runs `f` on a thread; its result, or None if it did not finish within `limit`.
fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit).ok()
}

/// The files (segments, entries) of the write-back directories under `state`.
fn entry_files(state: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let mut dirs = vec![state.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "wbs" || x == "wb") {
                out.push(p);
            }
        }
    }
    out
}

fn chattr(flag: &str, files: &[std::path::PathBuf]) {
    for f in files {
        let st = std::process::Command::new("chattr")
            .arg(flag)
            .arg(f)
            .status()
            .unwrap();
        assert!(st.success(), "chattr {flag} {}", f.display());
    }
}

/// An unlink whose object the bucket deleted reports success even when the local entry of
/// the version waiting for upload cannot be invalidated right away (its segment record, or
/// its file of its own, refuses: `chattr +i`); the entry is dropped once the disk lets it,
/// never uploaded, so the file does not come back, not even at the next mount.
#[test]
fn an_unlink_done_in_the_bucket_succeeds_when_its_entry_cannot_be_dropped_at_once() {
    let b = s3().new_bucket("bgrec3");
    let big = pattern::bytes(3, 5 << 20);
    s3().put(&b, "e", b"theirs".to_vec());
    s3().put(&b, "big", b"theirs".to_vec());
    let state = state_dir();
    let spec = background(
        MountSpec::s3(&b, ""),
        state.path(),
        &["--upload-delay", "600"],
    );
    let m = spec.mount();
    assert_eq!(read_file(&m.join("e")), b"theirs");
    assert_eq!(read_file(&m.join("big")), b"theirs");
    // Small files go to a segment once the first one is made.
    wait_for("a segment", Duration::from_secs(20), || {
        entry_files(state.path())
            .iter()
            .any(|p| p.extension().is_some_and(|x| x == "wbs"))
    });
    write_file(&m.join("e"), b"ours");
    write_file(&m.join("big"), &big);
    let files = entry_files(state.path());
    assert!(files
        .iter()
        .any(|p| p.extension().is_some_and(|x| x == "wb")));
    chattr("+i", &files);
    let r1 = std::fs::remove_file(m.join("e"));
    let r2 = std::fs::remove_file(m.join("big"));
    chattr("-i", &files);
    r1.expect("the unlink of e deleted the object: it succeeded");
    r2.expect("the unlink of big deleted the object: it succeeded");
    assert_eq!(s3().get(&b, "e"), None);
    assert_eq!(s3().get(&b, "big"), None);
    let names = list_dir(m.path());
    assert!(!names.contains("e") && !names.contains("big"), "{names:?}");
    let (status, log) = m.unmount();
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
    let m = spec.mount();
    let (status, log) = m.unmount();
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
    assert_eq!(s3().get(&b, "e"), None, "the unlinked file came back");
    assert_eq!(s3().get(&b, "big"), None, "the unlinked file came back");
}

/// The answer to an upload is lost (the PUT, or the CompleteMultipartUpload, landed; the
/// connection broke before its reply): the retry's refusal is recognised as this mount's own
/// write, not filed as another client's (no conflict, nothing pending).
#[test]
fn an_upload_whose_answer_was_lost_is_not_a_conflict() {
    let b = s3().new_bucket("bgrec4");
    s3().put(&b, "over", b"theirs".to_vec());
    let state = state_dir();
    let proxy = proxy::FaultProxy::start(&minio_addr());
    let m = background(
        via_proxy(&b, &proxy),
        state.path(),
        &["--upload-delay", "0"],
    )
    .mount();
    assert_eq!(read_file(&m.join("over")), b"theirs");
    let big = pattern::bytes(4, 9 << 20);
    proxy.drop_answers(&format!("PUT /{b}/new"), 1);
    write_file(&m.join("new"), b"ours, new");
    wait_for("the upload of new", Duration::from_secs(30), || {
        s3().get(&b, "new").is_some() && !pending(m.path()).contains("new")
    });
    proxy.drop_answers(&format!("PUT /{b}/over"), 1);
    write_file(&m.join("over"), b"ours over theirs");
    wait_for("the upload of over", Duration::from_secs(30), || {
        s3().get(&b, "over").as_deref() == Some(&b"ours over theirs"[..])
            && !pending(m.path()).contains("over")
    });
    proxy.drop_answers(&format!("POST /{b}/big?uploadId"), 1);
    write_file(&m.join("big"), &big);
    wait_for("the upload of big", Duration::from_secs(60), || {
        s3().get(&b, "big").is_some_and(|d| d == big) && !pending(m.path()).contains("big")
    });
    assert_eq!(proxy.dropped(), 3, "answers dropped");
    let log = m.log();
    assert!(!log.contains("changed by another client"), "{log}");
    let (status, log) = m.unmount();
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
}

/// Room waits are first come, first served: with uploads stalled and `--writeback-size 1M`
/// holding 800 KiB, a 400 KiB close waits; a 100 KiB close that comes after it (and would
/// fit) waits behind it instead of taking the room it needs. Both go once uploads resume.
#[test]
fn a_close_waiting_for_room_is_not_overtaken_by_smaller_ones() {
    let b = s3().new_bucket("bgrec5a");
    let state = state_dir();
    let proxy = proxy::FaultProxy::start(&minio_addr());
    let m = background(
        via_proxy(&b, &proxy),
        state.path(),
        &["--writeback-size", "1M", "--negative-ttl", "300"],
    )
    .mount();
    for n in ["a", "b", "big", "small"] {
        assert!(!m.join(n).exists());
    }
    proxy.stall(true);
    let body = pattern::bytes(6, 400 << 10);
    write_file(&m.join("a"), &body);
    write_file(&m.join("b"), &body);
    let big = {
        let (p, body) = (m.join("big"), body.clone());
        std::thread::spawn(move || {
            let mut f = std::fs::File::create(&p).unwrap();
            f.write_all(&body).unwrap();
            close_checked(f)
        })
    };
    std::thread::sleep(Duration::from_millis(500));
    assert!(!big.is_finished(), "the third close did not wait for room");
    let p = m.join("small");
    let small = within(Duration::from_secs(2), move || {
        let mut f = std::fs::File::create(&p).unwrap();
        f.write_all(&[7u8; 100 << 10]).unwrap();
        close_checked(f)
    });
    let overtaken = small.is_some();
    proxy.stall(false);
    big.join().unwrap().expect("the waiting close succeeds");
    assert!(
        !overtaken,
        "a later, smaller close took the room the waiting one needs"
    );
    let (status, log) = m.unmount();
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
    assert_eq!(s3().get(&b, "big").unwrap(), body);
    assert_eq!(s3().get(&b, "small").unwrap(), vec![7u8; 100 << 10]);
}

/// A new version of a file replaces its queued one: the room the old one holds is counted
/// as free for it. With `--writeback-size 1M` and uploads held back (`--upload-delay`), a
/// 600 KiB file written twice does not wait for room (before: the second close waited 60 s
/// and failed with ENOSPC).
#[test]
fn a_new_version_takes_the_room_of_the_one_it_replaces() {
    let b = s3().new_bucket("bgrec5b");
    let state = state_dir();
    let m = background(
        MountSpec::s3(&b, ""),
        state.path(),
        &["--writeback-size", "1M", "--upload-delay", "600"],
    )
    .mount();
    let v1 = pattern::bytes(8, 600 << 10);
    let v2 = pattern::bytes(9, 600 << 10);
    write_file(&m.join("f"), &v1);
    let (p, v) = (m.join("f"), v2.clone());
    let second = within(Duration::from_secs(5), move || {
        let mut f = std::fs::File::create(&p).unwrap();
        f.write_all(&v).unwrap();
        close_checked(f)
    });
    let Some(second) = second else {
        let mut m = m;
        m.kill9();
        panic!("the second version waited for room its first one holds");
    };
    second.unwrap();
    let (status, log) = m.unmount();
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
    assert_eq!(s3().get(&b, "f").unwrap(), v2);
}

/// An unlink of a file whose version waits for upload over an object deletes that object
/// only if it is still the version this one replaces: its `DELETE` carries `If-Match` with
/// that ETag, so a store that honours it (AWS S3) keeps a version another client wrote
/// after the unlink's check; MinIO ignores the header (see docs/reliability.md), so what is
/// checked here is the request, and that another client's earlier write is kept.
#[test]
fn an_unlinks_delete_is_pinned_to_the_version_it_checked() {
    let b = s3().new_bucket("bgrec2");
    s3().put(&b, "mine", b"theirs, v1".to_vec());
    s3().put(&b, "other", b"theirs, v1".to_vec());
    let etag = s3().head(&b, "mine").unwrap().etag;
    let state = state_dir();
    let proxy = proxy::FaultProxy::start(&minio_addr());
    let m = background(
        via_proxy(&b, &proxy),
        state.path(),
        &["--upload-delay", "600"],
    )
    .mount();
    assert_eq!(read_file(&m.join("mine")), b"theirs, v1");
    assert_eq!(read_file(&m.join("other")), b"theirs, v1");
    write_file(&m.join("mine"), b"ours");
    write_file(&m.join("other"), b"ours");
    s3().put(&b, "other", b"theirs, v2".to_vec());
    std::fs::remove_file(m.join("mine")).unwrap();
    std::fs::remove_file(m.join("other")).unwrap();
    assert_eq!(s3().get(&b, "mine"), None);
    assert_eq!(s3().get(&b, "other").unwrap(), b"theirs, v2");
    let deletes = proxy.request_heads(&format!("DELETE /{b}/mine"));
    assert_eq!(deletes.len(), 1, "{deletes:?}");
    let pinned = deletes[0]
        .lines()
        .any(|l| l.to_ascii_lowercase() == format!("if-match: {}", etag.to_ascii_lowercase()));
    assert!(pinned, "the DELETE is not pinned to {etag}: {}", deletes[0]);
    assert!(proxy
        .request_heads(&format!("DELETE /{b}/other"))
        .is_empty());
    let (status, log) = m.unmount();
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
    assert_eq!(s3().get(&b, "mine"), None);
    assert_eq!(s3().get(&b, "other").unwrap(), b"theirs, v2");
}

/// A rewrite waiting for room behind another close does not keep its old version from
/// uploading: that upload is what frees the room the first close waits for. With
/// `--writeback-size 1M` and `--upload-delay 2`: a 600 KiB file, a 500 KiB close that
/// waits, a 700 KiB rewrite of the first file behind it: both closes return once the
/// uploads free room (with the old version held by the waiting rewrite, the first waited
/// 60 s and got ENOSPC).
#[test]
fn a_waiting_rewrite_lets_its_old_version_upload() {
    let b = s3().new_bucket("bgrec5c");
    let state = state_dir();
    let m = background(
        MountSpec::s3(&b, ""),
        state.path(),
        &["--writeback-size", "1M", "--upload-delay", "2"],
    )
    .mount();
    write_file(&m.join("a"), &pattern::bytes(1, 600 << 10));
    let close = |name: &str, body: Vec<u8>| {
        let p = m.join(name);
        std::thread::spawn(move || {
            let mut f = std::fs::File::create(&p).unwrap();
            f.write_all(&body).unwrap();
            close_checked(f)
        })
    };
    let second = close("b", pattern::bytes(2, 500 << 10));
    std::thread::sleep(Duration::from_millis(300));
    let a2 = pattern::bytes(3, 700 << 10);
    let rewrite = close("a", a2.clone());
    let done = within(Duration::from_secs(20), move || {
        (second.join().unwrap(), rewrite.join().unwrap())
    });
    let Some((r1, r2)) = done else {
        let mut m = m;
        m.kill9();
        panic!("the closes waited for room an upload held back by a waiter would free");
    };
    r1.expect("the waiting close");
    r2.expect("the rewrite");
    let (status, log) = m.unmount();
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
    assert_eq!(s3().get(&b, "a").unwrap(), a2);
}

/// A new file whose upload landed but whose answer was lost (the mount holds it as failed,
/// to retry) is unlinked: its object, this mount's own version, is deleted, in this daemon's
/// life and after a kill -9 and a remount that cannot upload it (before: the object stayed
/// and the unlinked file came back).
#[test]
fn an_unlink_deletes_an_upload_whose_answer_was_lost() {
    let b = s3().new_bucket("bgrec4b");
    let state = state_dir();
    let proxy = proxy::FaultProxy::start(&minio_addr());
    let spec = background(
        via_proxy(&b, &proxy),
        state.path(),
        &["--retry-timeout", "0"],
    );
    let mut m = spec.mount();
    proxy.drop_answers(&format!("PUT /{b}/lost"), 2);
    write_file(&m.join("lost1"), b"ours 1");
    write_file(&m.join("lost2"), b"ours 2");
    wait_for("both PUTs to land", Duration::from_secs(20), || {
        proxy.dropped() == 2 && s3().get(&b, "lost1").is_some() && s3().get(&b, "lost2").is_some()
    });
    wait_for(
        "both uploads to count as failed",
        Duration::from_secs(20),
        || {
            pending(m.path())
                .lines()
                .filter(|l| l.starts_with("failed"))
                .count()
                == 2
        },
    );
    std::fs::remove_file(m.join("lost1")).unwrap();
    assert_eq!(
        s3().get(&b, "lost1"),
        None,
        "the unlinked file's object stayed"
    );
    m.kill9();
    drop(m);
    proxy.fail_requests(&format!("PUT /{b}/lost"), 1_000_000);
    let m = spec.mount();
    std::fs::remove_file(m.join("lost2")).unwrap();
    proxy.fail_requests("", 0);
    let (status, log) = m.unmount();
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
    assert_eq!(s3().get(&b, "lost1"), None);
    assert_eq!(
        s3().get(&b, "lost2"),
        None,
        "the unlinked recovered file came back"
    );
}

/// A store that answers `501 NotImplemented` to a `DELETE` carrying `If-Match` (AWS
/// general-purpose buckets before 2025-09, LocalStack): an unlink of a file whose waiting
/// version replaces an object falls back to the HEAD-checked plain `DELETE` and succeeds at
/// once (before: the 501 was retried as transient for the retry budget, then EIO).
#[test]
fn an_unlink_works_on_a_store_without_conditional_delete() {
    let b = s3().new_bucket("bgrec6");
    s3().put(&b, "f", b"theirs".to_vec());
    s3().put(&b, "g", b"theirs".to_vec());
    let state = state_dir();
    let proxy = proxy::FaultProxy::start(&minio_addr());
    proxy.reject_with_header(&format!("DELETE /{b}/"), "if-match", 501);
    let m = background(
        via_proxy(&b, &proxy),
        state.path(),
        &["--upload-delay", "60"],
    )
    .mount();
    for k in ["f", "g"] {
        assert_eq!(read_file(&m.join(k)), b"theirs");
        write_file(&m.join(k), b"ours");
    }
    let p = m.join("f");
    let rm = within(Duration::from_secs(10), move || std::fs::remove_file(p));
    let Some(rm) = rm else {
        let mut m = m;
        m.kill9();
        panic!("the unlink retried the store's 501");
    };
    rm.expect("rm over a store without conditional DELETE");
    assert_eq!(s3().get(&b, "f"), None, "the object stayed");
    // The store's answer is remembered: the next unlink asks plainly.
    let rejected = proxy.rejected();
    assert!(rejected >= 1, "the proxy did not refuse the condition");
    std::fs::remove_file(m.join("g")).unwrap();
    assert_eq!(s3().get(&b, "g"), None, "the object stayed");
    assert_eq!(proxy.rejected(), rejected, "the condition was sent again");
    let (status, log) = m.unmount();
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
    assert_eq!(s3().get(&b, "f"), None);
    assert_eq!(s3().get(&b, "g"), None);
}

/// A store that answers `501 NotImplemented` to a write carrying `If-None-Match` (AWS
/// before 2024-08, LocalStack): files created in background mode go up all the same, once a
/// HEAD finds their key free, in one PUT or in parts (before: the 501 was retried as
/// transient for the retry budget, then each new file stayed pending for good).
#[test]
fn new_files_go_up_on_a_store_without_conditional_create() {
    for (request, size) in [("PUT", 1000), ("POST", 12 << 20)] {
        let b = s3().new_bucket("bgrec8");
        let state = state_dir();
        let proxy = proxy::FaultProxy::start(&minio_addr());
        proxy.reject_with_header(&format!("{request} /{b}/"), "if-none-match", 501);
        let m = background(
            via_proxy(&b, &proxy),
            state.path(),
            &["--upload-delay", "0", "--part-size", "5M"],
        )
        .mount();
        let body = pattern::bytes(8, size);
        write_file(&m.join("n1"), &body);
        wait_for("n1 to go up", Duration::from_secs(20), || {
            s3().get(&b, "n1").as_deref() == Some(&body[..])
        });
        let rejected = proxy.rejected();
        assert!(
            rejected >= 1,
            "{request}: the proxy did not refuse the condition"
        );
        // The store's answer is remembered: the next new file goes up plainly.
        write_file(&m.join("n2"), &body);
        wait_for("n2 to go up", Duration::from_secs(20), || {
            s3().get(&b, "n2").as_deref() == Some(&body[..])
        });
        assert_eq!(
            proxy.rejected(),
            rejected,
            "{request}: the condition was sent again"
        );
        let (status, log) = m.unmount();
        assert_eq!(status.and_then(|s| s.code()), Some(0), "{request}: {log}");
    }
}

/// A new file's upload landed with its answer lost, then the network failed for the retry
/// budget (the entry counts as failed, not a conflict); the file is written again meanwhile.
/// The new version knows the bucket may hold the old one, this mount's: once the network is
/// back it goes over it (before: a permanent conflict, the bucket kept the old version), and
/// an unlink deletes it (before: the old version stayed and the file came back).
#[test]
fn a_new_version_knows_its_failed_predecessor_may_have_landed() {
    let b = s3().new_bucket("bgrec7");
    let state = state_dir();
    let proxy = proxy::FaultProxy::start(&minio_addr());
    let m = background(
        via_proxy(&b, &proxy),
        state.path(),
        &["--retry-timeout", "0", "--upload-delay", "0"],
    )
    .mount();
    proxy.drop_answers(&format!("PUT /{b}/"), 2);
    write_file(&m.join("f"), b"ours v1");
    write_file(&m.join("g"), b"ours v1");
    wait_for("both PUTs to land", Duration::from_secs(20), || {
        proxy.dropped() == 2 && s3().get(&b, "f").is_some() && s3().get(&b, "g").is_some()
    });
    proxy.fail_requests(&format!("PUT /{b}/"), 1_000_000);
    wait_for(
        "both uploads to count as failed",
        Duration::from_secs(20),
        || {
            pending(m.path())
                .lines()
                .filter(|l| l.starts_with("failed"))
                .count()
                == 2
        },
    );
    write_file(&m.join("f"), b"ours, v2 (longer)");
    write_file(&m.join("g"), b"ours, v2 (longer)");
    std::fs::remove_file(m.join("g")).unwrap();
    proxy.fail_requests("", 0);
    let (status, log) = m.unmount();
    assert!(!log.contains("changed by another client"), "{log}");
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
    assert_eq!(s3().get(&b, "f").unwrap(), b"ours, v2 (longer)");
    assert_eq!(s3().get(&b, "g"), None, "the unlinked file came back");
}

/// A file larger than `--writeback-size` goes alone: with `--writeback-size 1M`, uploads
/// stalled and 200 KiB pending, a 2 MiB close waits for the pending upload, then goes
/// (before: `ENOSPC` at once whenever anything else was pending).
#[test]
fn a_file_larger_than_the_bound_waits_for_the_others() {
    let b = s3().new_bucket("bgrec8");
    let state = state_dir();
    let proxy = proxy::FaultProxy::start(&minio_addr());
    let m = background(
        via_proxy(&b, &proxy),
        state.path(),
        &["--writeback-size", "1M", "--negative-ttl", "300"],
    )
    .mount();
    for n in ["a", "big"] {
        assert!(!m.join(n).exists());
    }
    proxy.stall(true);
    let small = pattern::bytes(10, 200 << 10);
    write_file(&m.join("a"), &small);
    let big = pattern::bytes(11, 2 << 20);
    let close = {
        let (p, body) = (m.join("big"), big.clone());
        std::thread::spawn(move || {
            let mut f = std::fs::File::create(&p).unwrap();
            f.write_all(&body).unwrap();
            close_checked(f)
        })
    };
    std::thread::sleep(Duration::from_millis(1000));
    let early = close.is_finished();
    proxy.stall(false);
    close.join().unwrap().expect("the large close succeeds");
    assert!(
        !early,
        "the large close did not wait for the pending upload"
    );
    let (status, log) = m.unmount();
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
    assert_eq!(s3().get(&b, "a").unwrap(), small);
    assert_eq!(s3().get(&b, "big").unwrap(), big);
}

/// A rewrite of a file in conflict is not failed by the room of that very conflict: with
/// `--writeback-size 1M`, a 600 KiB version in conflict (another client wrote the key
/// before its upload) and 400 KiB pending with uploads stalled, a 700 KiB rewrite of the
/// conflicting file waits for the pending upload and goes (before: `ENOSPC` at once, its
/// own conflict counted as room that never frees).
#[test]
fn a_rewrite_of_a_conflict_is_not_failed_by_that_conflict() {
    let b = s3().new_bucket("bgrec9");
    s3().put(&b, "f", b"theirs".to_vec());
    let state = state_dir();
    let proxy = proxy::FaultProxy::start(&minio_addr());
    let m = background(
        via_proxy(&b, &proxy),
        state.path(),
        &[
            "--writeback-size",
            "1M",
            "--upload-delay",
            "2",
            "--negative-ttl",
            "300",
        ],
    )
    .mount();
    assert_eq!(read_file(&m.join("f")), b"theirs");
    assert!(!m.join("a").exists());
    write_file(&m.join("f"), &pattern::bytes(12, 600 << 10));
    s3().put(&b, "f", b"theirs, v2".to_vec());
    wait_for("the conflict", Duration::from_secs(20), || {
        pending(m.path()).lines().any(|l| l.starts_with("conflict"))
    });
    proxy.stall(true);
    let small = pattern::bytes(13, 400 << 10);
    write_file(&m.join("a"), &small);
    let v = pattern::bytes(14, 700 << 10);
    let close = {
        let (p, body) = (m.join("f"), v.clone());
        std::thread::spawn(move || {
            let mut f = std::fs::File::create(&p).unwrap();
            f.write_all(&body).unwrap();
            close_checked(f)
        })
    };
    std::thread::sleep(Duration::from_millis(1000));
    proxy.stall(false);
    close
        .join()
        .unwrap()
        .expect("the rewrite of the conflicting file");
    let (status, log) = m.unmount();
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
    assert_eq!(s3().get(&b, "a").unwrap(), small);
    assert_eq!(s3().get(&b, "f").unwrap(), v);
}

/// A close that shrinks a queued version wakes the closes waiting for room: with
/// `--writeback-size 1M` and `--upload-delay 600` (nothing uploads), a 700 KiB file and a
/// 400 KiB close waiting for room, the rewrite of the first file to 100 KiB lets the waiting
/// close go at once (before: it slept until its 60 s bound).
#[test]
fn a_shrinking_rewrite_wakes_the_closes_waiting_for_room() {
    let b = s3().new_bucket("bgrec10");
    let state = state_dir();
    let m = background(
        MountSpec::s3(&b, ""),
        state.path(),
        &["--writeback-size", "1M", "--upload-delay", "600"],
    )
    .mount();
    write_file(&m.join("a"), &pattern::bytes(15, 700 << 10));
    let body = pattern::bytes(16, 400 << 10);
    let waiting = {
        let (p, body) = (m.join("b"), body.clone());
        std::thread::spawn(move || {
            let mut f = std::fs::File::create(&p).unwrap();
            f.write_all(&body).unwrap();
            close_checked(f)
        })
    };
    std::thread::sleep(Duration::from_millis(500));
    assert!(!waiting.is_finished(), "the second close did not wait");
    let a2 = pattern::bytes(17, 100 << 10);
    write_file(&m.join("a"), &a2);
    let done = within(Duration::from_secs(5), move || waiting.join().unwrap());
    let Some(done) = done else {
        let mut m = m;
        m.kill9();
        panic!("the waiting close was not woken by the room the rewrite freed");
    };
    done.expect("the waiting close");
    let (status, log) = m.unmount();
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
    assert_eq!(s3().get(&b, "a").unwrap(), a2);
    assert_eq!(s3().get(&b, "b").unwrap(), body);
}

/// A new file's upload landed with its answer lost (`--retry-timeout 0`: held as failed);
/// its next try gets `412` and the `HEAD` that would tell its own version fails: the entry
/// stays failed, to retry, and goes up later (before: a permanent conflict, unmount exit 1).
#[test]
fn a_failed_check_after_a_lost_answer_is_not_a_conflict() {
    let b = s3().new_bucket("bgrec11");
    let state = state_dir();
    let proxy = proxy::FaultProxy::start(&minio_addr());
    let m = background(
        via_proxy(&b, &proxy),
        state.path(),
        &["--retry-timeout", "0", "--upload-delay", "0"],
    )
    .mount();
    proxy.drop_answers(&format!("PUT /{b}/f"), 1);
    write_file(&m.join("f"), b"ours");
    wait_for("the PUT to land", Duration::from_secs(20), || {
        proxy.dropped() == 1 && s3().get(&b, "f").is_some()
    });
    let heads = proxy.request_heads(&format!("HEAD /{b}/f")).len();
    proxy.fail_requests(&format!("HEAD /{b}/f"), 1_000_000);
    // The retry (10 s later): 412, then the failing HEAD.
    wait_for("the check of the key", Duration::from_secs(30), || {
        proxy.request_heads(&format!("HEAD /{b}/f")).len() > heads
    });
    std::thread::sleep(Duration::from_millis(500));
    let listed = pending(m.path());
    proxy.fail_requests("", 0);
    assert!(!listed.contains("conflict"), "{listed}");
    let (status, log) = m.unmount();
    assert!(!log.contains("changed by another client"), "{log}");
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
    assert_eq!(s3().get(&b, "f").unwrap(), b"ours");
}

/// Big files (several 8 MiB parts) in background mode: their parts go up while they are
/// written, and their staging file becomes their entry (no copy). The daemon is killed
/// (kill -9) after one was closed, its upload not completed, and while another is open
/// after an fsync and a write past it. The next mount (same state directory) uploads the
/// closed file and the fsync'd version of the open one, byte-exact, and leaves no
/// multipart upload open in the bucket (the dead daemon's are aborted).
#[test]
fn big_files_written_in_background_mode_survive_a_kill_9() {
    use std::os::unix::fs::FileExt;
    let b = s3().new_bucket("bgbig");
    let state = state_dir();
    let spec = background(
        MountSpec::s3(&b, ""),
        state.path(),
        &["--upload-delay", "600"],
    );
    let mut m = spec.mount();
    let closed = pattern::bytes(71, 40 << 20);
    write_file(&m.join("closed"), &closed);
    let fsynced = pattern::bytes(72, 40 << 20);
    let mut f = std::fs::File::create(m.join("open")).unwrap();
    f.write_all(&fsynced).unwrap();
    f.sync_all().unwrap();
    f.write_all_at(&[b'x'; 4096], 1 << 20).unwrap();
    let early = s3().list_multipart_uploads(&b);
    assert!(
        !early.is_empty(),
        "no part went up while the files were written"
    );
    m.kill9();
    drop(f);
    drop(m);
    let m = spec.mount();
    let (status, log) = m.unmount();
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
    assert!(
        s3().get(&b, "closed").unwrap() == closed,
        "closed: other bytes"
    );
    assert!(
        s3().get(&b, "open").unwrap() == fsynced,
        "open: not the fsync'd version"
    );
    assert_eq!(
        s3().list_multipart_uploads(&b),
        Vec::new(),
        "uploads left open"
    );
}

/// The daemon dies (kill at the test point) while a big file's close names its staging
/// file as its entry: after the sync, before the rename over the entry's name. The close
/// never returned, so the next mount uploads nothing of that file and leaves nothing of it
/// in the write-back directory; a file closed before is uploaded.
#[test]
fn a_crash_while_a_close_names_its_staging_file_uploads_nothing_of_it() {
    let b = s3().new_bucket("bgadopt");
    let state = state_dir();
    let mut spec = background(
        MountSpec::s3(&b, ""),
        state.path(),
        &["--upload-delay", "600"],
    );
    spec.envs
        .push(("BUCKETFS_TEST_POINT".into(), "writeback.adopt=abort".into()));
    let mut m = spec.mount();
    write_file(&m.join("small"), b"closed before");
    let mut f = std::fs::File::create(m.join("big")).unwrap();
    f.write_all(&pattern::bytes(81, 20 << 20)).unwrap();
    assert!(
        close_checked(f).is_err(),
        "the close returned although the daemon died"
    );
    m.kill9();
    drop(m);
    let spec = background(MountSpec::s3(&b, ""), state.path(), &[]);
    let m = spec.mount();
    let (status, log) = m.unmount();
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
    assert_eq!(s3().get(&b, "small").unwrap(), b"closed before");
    assert_eq!(
        s3().get(&b, "big"),
        None,
        "a close that never returned was uploaded"
    );
    let mut left = Vec::new();
    let mut dirs = vec![state.path().join("writeback")];
    while let Some(d) = dirs.pop() {
        for p in std::fs::read_dir(&d).unwrap().flatten().map(|e| e.path()) {
            if p.is_dir() {
                dirs.push(p);
            } else if !p.ends_with("lock")
                && !p.ends_with("store")
                && p.extension().is_none_or(|x| x != "wbs")
            {
                left.push(p);
            }
        }
    }
    assert!(
        left.is_empty(),
        "left in the write-back directory: {left:?}"
    );
}
