//! `--upload background` (issue 20) through real mounts against MinIO: close returns once the
//! file is durable in the write-back directory under `--state-dir`, uploads follow. Nothing
//! acknowledged is lost (kill -9, a simulated reboot), refused and conflicting uploads stay
//! pending and listed, a rename or unlink before the upload costs no upload, and a full
//! write-back directory makes writers wait.

mod common;

use common::*;
use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A mount of `bucket` in background mode keeping its state in `state`.
fn bg_spec(bucket: &str, state: &Path) -> MountSpec {
    background(MountSpec::s3(bucket, ""), state, &[])
}

/// [`bg_spec_at`] with the daemon on one runtime thread (`TOKIO_WORKER_THREADS=1`): work
/// held on a runtime thread would stop every request.
fn bg_spec_at_on_one_thread(bucket: &str, state: &Path, pause: &Pause, point: &str) -> MountSpec {
    let mut spec = bg_spec_at(bucket, state, pause, point);
    spec.envs
        .push(("TOKIO_WORKER_THREADS".to_string(), "1".to_string()));
    spec
}

/// [`bg_spec`] with the daemon stopping at test point `point` (see [`Pause`]).
fn bg_spec_at(bucket: &str, state: &Path, pause: &Pause, point: &str) -> MountSpec {
    let mut spec = bg_spec(bucket, state);
    spec.envs
        .push(("BUCKETFS_TEST_POINT".to_string(), pause.point(point)));
    spec
}

/// The mount's `bucketfs_store_requests_total{op="put"}` and similar, by operation.
fn puts(mp: &Path) -> u64 {
    store_requests(mp).get("put").copied().unwrap_or(0)
}

fn content(i: usize) -> Vec<u8> {
    let mut v = format!("file {i}\n").into_bytes();
    v.extend(pattern::bytes(i as u64, 100 + i % 900));
    v
}

fn name(i: usize) -> String {
    format!("d{}/f{i:05}", i % 16)
}

/// What a writer learned of one file before its close returned.
#[derive(Debug, Clone)]
struct Acked {
    mtime: f64,
    uid: u32,
    gid: u32,
}

/// Checks that every acknowledged file is in the bucket byte-exact with its attributes, and
/// that any other key there is one of `in_flight` (a close that may have finished as the
/// daemon died), complete and exact too. Returns how many acknowledged files it checked.
fn check_bucket(
    bucket: &str,
    acked: &BTreeMap<usize, Acked>,
    in_flight: &BTreeSet<usize>,
) -> usize {
    let s3 = s3();
    let keys = s3.list_keys(bucket, "");
    let files: BTreeSet<String> = keys.iter().filter(|k| !k.ends_with('/')).cloned().collect();
    for (i, a) in acked {
        let key = name(*i);
        assert!(
            files.contains(&key),
            "acknowledged {key} is not in the bucket"
        );
        assert_eq!(
            s3.get(bucket, &key).as_deref(),
            Some(&content(*i)[..]),
            "{key}: bytes"
        );
        let h = s3.head(bucket, &key).unwrap();
        assert_eq!(
            h.meta.get("mode").map(String::as_str),
            Some("33184"),
            "{key}: mode 0640"
        );
        assert_eq!(h.meta.get("uid"), Some(&a.uid.to_string()), "{key}: uid");
        assert_eq!(h.meta.get("gid"), Some(&a.gid.to_string()), "{key}: gid");
        let mtime: f64 = h.meta["mtime"].parse().unwrap();
        assert!(
            (mtime - a.mtime).abs() < 1.0,
            "{key}: stored mtime {mtime}, the file had {}",
            a.mtime
        );
    }
    for key in &files {
        let i: usize = key
            .rsplit_once("/f")
            .and_then(|(_, n)| n.parse().ok())
            .unwrap_or_else(|| panic!("unexpected key {key}"));
        if acked.contains_key(&i) {
            continue;
        }
        assert!(
            in_flight.contains(&i),
            "{key} is in the bucket, but its close never returned and it was not being closed"
        );
        assert_eq!(
            s3.get(bucket, key).as_deref(),
            Some(&content(i)[..]),
            "{key}"
        );
    }
    acked.len()
}

/// Writers creating files 0..n (thread t takes i % threads == t) until `stop`; each file is
/// written, chmod'ed 0640 and closed. Returns the acknowledged files and, per thread, the one
/// whose close was in progress when it stopped.
fn run_writers(
    root: PathBuf,
    n: usize,
    threads: usize,
    stop: Arc<AtomicBool>,
    acked: Arc<Mutex<BTreeMap<usize, Acked>>>,
    closing: Arc<Mutex<BTreeSet<usize>>>,
) -> Vec<std::thread::JoinHandle<()>> {
    (0..threads)
        .map(|t| {
            let (root, stop, acked, closing) =
                (root.clone(), stop.clone(), acked.clone(), closing.clone());
            std::thread::spawn(move || {
                for i in (t..n).step_by(threads) {
                    if stop.load(Ordering::SeqCst) {
                        return;
                    }
                    let p = root.join(name(i));
                    let Ok(mut f) = std::fs::File::create(&p) else {
                        return;
                    };
                    if f.write_all(&content(i)).is_err()
                        || f.set_permissions(std::fs::Permissions::from_mode(0o640))
                            .is_err()
                    {
                        return;
                    }
                    let Ok(md) = f.metadata() else { return };
                    let a = Acked {
                        mtime: md.mtime() as f64 + md.mtime_nsec() as f64 / 1e9,
                        uid: md.uid(),
                        gid: md.gid(),
                    };
                    closing.lock().unwrap().insert(i);
                    if close_checked(f).is_ok() {
                        acked.lock().unwrap().insert(i, a);
                    } else {
                        return;
                    }
                }
            })
        })
        .collect()
}

fn make_dirs(root: &Path) {
    for d in 0..16 {
        std::fs::create_dir(root.join(format!("d{d}"))).unwrap();
    }
}

/// kill -9 of the daemon in the middle of 10,000 small creates by 8 threads: after the next
/// mount from the same state directory, every file whose close returned 0 is in the bucket,
/// byte-exact, with its mode, uid, gid and mtime, and no other file is (except one whose
/// close was under way at the kill, complete).
#[test]
fn kill_9_mid_10000_creates_loses_no_acknowledged_file() {
    let b = s3().new_bucket("bgcrash");
    let state = state_dir();
    // Uploads start a second after each close: the kill finds many files acknowledged and
    // not uploaded, and many uploaded.
    let spec = bg_spec(&b, state.path()).arg("--upload-delay").arg("1");
    let mut m = spec.mount();
    make_dirs(m.path());
    // The markers are uploaded in the background too: make them durable first.
    std::fs::File::open(m.path()).unwrap().sync_all().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let acked = Arc::new(Mutex::new(BTreeMap::new()));
    let closing = Arc::new(Mutex::new(BTreeSet::new()));
    let start = Instant::now();
    let writers = run_writers(
        m.path().to_path_buf(),
        10_000,
        8,
        stop.clone(),
        acked.clone(),
        closing.clone(),
    );
    // Mid-way: when half are acknowledged (or after 30 s).
    while acked.lock().unwrap().len() < 5_000 && start.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(5));
    }
    let in_flight_before: BTreeSet<usize> = {
        let c = closing.lock().unwrap();
        let a = acked.lock().unwrap();
        c.iter().filter(|i| !a.contains_key(i)).copied().collect()
    };
    m.kill9();
    let killed_at = start.elapsed();
    stop.store(true, Ordering::SeqCst);
    for w in writers {
        w.join().unwrap();
    }
    let acked = acked.lock().unwrap().clone();
    let closing = closing.lock().unwrap().clone();
    let in_flight: BTreeSet<usize> = closing
        .iter()
        .filter(|i| !acked.contains_key(i))
        .copied()
        .collect();
    let uploaded_at_kill = s3()
        .list_keys(&b, "")
        .iter()
        .filter(|k| !k.ends_with('/'))
        .count();
    drop(m);
    let m = spec.mount();
    let remount = start.elapsed() - killed_at;
    let n = check_bucket(&b, &acked, &in_flight);
    eprintln!(
        "crash test: {} acknowledged in {:.1} s, {uploaded_at_kill} of them uploaded at the \
         kill, {} closes in flight ({} before the kill), all {n} acknowledged in the bucket \
         after the remount ({} pending at the kill, recovered in {:.1} s)",
        acked.len(),
        killed_at.as_secs_f64(),
        in_flight.len(),
        in_flight_before.len(),
        acked.len().saturating_sub(uploaded_at_kill),
        remount.as_secs_f64()
    );
    assert!(
        acked.len() >= 1_000,
        "too few files acknowledged: {}",
        acked.len()
    );
    assert!(
        uploaded_at_kill < acked.len(),
        "every file was uploaded before the kill: the crash tested nothing"
    );
    // The mount shows them.
    for i in acked.keys().take(50) {
        assert_eq!(read_file(&m.join(name(*i))), content(*i));
    }
    // Listed until the file system has learnt each uploaded version (just after it lands).
    wait_for("nothing pending", Duration::from_secs(10), || {
        nothing_pending(m.path())
    });
    assert_eq!(pending_run(m.path()).0, Some(0));
}

/// A simulated reboot: files closed while uploads wait (`--upload-delay 600`), the daemon
/// killed, the mount point cleaned up, the state directory kept. The next mount, on a new
/// mount point, uploads them before it serves: all there, byte-exact.
#[test]
fn simulated_reboot_uploads_what_was_acknowledged() {
    let b = s3().new_bucket("bgreboot");
    let state = state_dir();
    let mut m = bg_spec(&b, state.path())
        .arg("--upload-delay")
        .arg("600")
        .mount();
    make_dirs(m.path());
    std::fs::File::open(m.path()).unwrap().sync_all().unwrap();
    let mut acked = BTreeMap::new();
    for i in 0..200 {
        let p = m.join(name(i));
        let mut f = std::fs::File::create(&p).unwrap();
        f.write_all(&content(i)).unwrap();
        f.set_permissions(std::fs::Permissions::from_mode(0o640))
            .unwrap();
        let md = f.metadata().unwrap();
        close_checked(f).unwrap();
        acked.insert(
            i,
            Acked {
                mtime: md.mtime() as f64 + md.mtime_nsec() as f64 / 1e9,
                uid: md.uid(),
                gid: md.gid(),
            },
        );
    }
    // This mount reads them back at once.
    assert_eq!(read_file(&m.join(name(7))), content(7));
    let (code, out) = pending_run(m.path());
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("200 file(s)"), "{out}");
    m.kill9();
    drop(m); // the dead mount point is cleaned up; the state directory stays
    assert!(
        s3().list_keys(&b, "d").iter().all(|k| k.ends_with('/')),
        "uploaded before the kill?"
    );
    let m = bg_spec(&b, state.path()).mount();
    assert_eq!(check_bucket(&b, &acked, &BTreeSet::new()), 200);
    assert_eq!(read_file(&m.join(name(199))), content(199));
}

/// `spec` reaching its store through `AWS_ENDPOINT_URL=endpoint` instead of `--endpoint-url`.
fn at_env_endpoint(mut spec: MountSpec, endpoint: String) -> MountSpec {
    let i = spec
        .args
        .iter()
        .position(|a| a == "--endpoint-url")
        .unwrap();
    spec.args.drain(i..i + 2);
    spec.envs.push(("AWS_ENDPOINT_URL".into(), endpoint));
    spec
}

/// Writes `body` to `f` through a mount of `spec` whose uploads wait (`--upload-delay
/// 600`), then kills its daemon (kill -9): `f` is acknowledged and not uploaded.
fn acknowledge_then_kill(spec: MountSpec, body: &[u8]) {
    let mut m = spec.arg("--upload-delay").arg("600").mount();
    std::fs::write(m.join("f"), body).unwrap();
    m.kill9();
}

/// Files a background mount acknowledged wait for the store it wrote to, as the client
/// resolved its endpoint (`AWS_ENDPOINT_URL` here). A mount of a bucket of the same name at
/// another endpoint, from the same state directory, never uploads them there (it did: the
/// write-back directory was named after the endpoint given as an option, here none). The
/// next mount of their own store does.
#[test]
fn pending_files_go_only_to_the_store_that_acknowledged_them() {
    let b = s3().new_bucket("bgscope");
    let state = state_dir();
    let ours = || at_env_endpoint(bg_spec(&b, state.path()), env().endpoint.clone());
    acknowledge_then_kill(ours(), b"acknowledged here");
    let disk = tempfile::tempdir().unwrap();
    let data = disk.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let minio = PrivateMinio::start(&data, None);
    let other = minio.client(None);
    other.create_bucket(&b);
    let m = at_env_endpoint(bg_spec(&b, state.path()), minio.endpoint()).mount();
    let shown = m.join("f").exists();
    let log = m.log();
    assert!(log.contains("a mount of that store uploads them"), "{log}");
    drop(m);
    assert_eq!(
        other.list_keys(&b, ""),
        BTreeSet::new(),
        "uploaded to another store"
    );
    assert!(!shown, "another store's mount showed the file");
    assert_eq!(s3().get(&b, "f"), None);
    let m = ours().mount();
    assert_eq!(
        s3().get(&b, "f").as_deref(),
        Some(&b"acknowledged here"[..])
    );
    drop(m);
}

/// A write-back directory an earlier version left for a mount given its store by
/// `AWS_ENDPOINT_URL` was named as if for AWS (the endpoint option alone named it) and
/// recorded no store. The next mount at that endpoint takes it over and uploads its files
/// (before the take-over they waited there, unseen, for a mount of the bucket name at AWS).
#[test]
fn files_an_earlier_version_left_for_an_env_endpoint_are_uploaded() {
    let b = s3().new_bucket("bglegacy");
    let state = state_dir();
    let ours = || at_env_endpoint(bg_spec(&b, state.path()), env().endpoint.clone());
    acknowledge_then_kill(ours(), b"left by an earlier version");
    // What the earlier version left: the same entries, under its name, no store recorded.
    let wb = state.path().join("writeback");
    let dirs: Vec<PathBuf> = std::fs::read_dir(&wb)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(dirs.len(), 1, "{dirs:?}");
    std::fs::remove_file(dirs[0].join("store")).unwrap();
    let mut h: u64 = 0xcbf29ce484222325;
    for c in format!("s3 aws {b} ").bytes() {
        h ^= c as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    let legacy = wb.join(format!("{b}-{h:016x}"));
    std::fs::rename(&dirs[0], &legacy).unwrap();
    let m = ours().mount();
    assert_eq!(
        s3().get(&b, "f").as_deref(),
        Some(&b"left by an earlier version"[..])
    );
    assert!(!legacy.exists());
    assert!(
        m.log().contains("named without the endpoint: moved to"),
        "{}",
        m.log()
    );
    drop(m);
}

/// Files acknowledged by a mount given the endpoint one way are uploaded by the next mount
/// of that store given it another way (`localhost` for `127.0.0.1`): the write-back directory
/// is named after the spelling, and the next mount showed none of them, said nothing, and
/// left them for good (or for a mount spelling it the first way again). A directory of the
/// same bucket name at another endpoint is named in a warning, its files left for that store.
#[test]
fn files_acknowledged_under_another_spelling_of_the_endpoint_are_uploaded() {
    let b = s3().new_bucket("bgspelling");
    let state = state_dir();
    acknowledge_then_kill(bg_spec(&b, state.path()), b"acknowledged here");
    let mut spec = bg_spec(&b, state.path());
    let i = spec
        .args
        .iter()
        .position(|a| a == "--endpoint-url")
        .unwrap();
    spec.args[i + 1] = env().endpoint.replace("127.0.0.1", "localhost");
    let m = spec.mount();
    let shown = std::fs::read(m.join("f")).ok();
    let (status, log) = m.unmount();
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
    assert_eq!(shown.as_deref(), Some(&b"acknowledged here"[..]), "{log}");
    assert_eq!(
        s3().get(&b, "f").as_deref(),
        Some(&b"acknowledged here"[..]),
        "{log}"
    );
    assert!(log.contains("this store, spelt otherwise"), "{log}");
}

/// An upload the store refuses for good (the bucket is gone) is kept, shown by the mount,
/// listed by `bucketfs pending` with its error, counted, logged once per file, and retried:
/// once the bucket is back, the unmount uploads it.
#[test]
fn refused_upload_stays_pending_listed_and_is_retried() {
    let b = s3().new_bucket("bgrefused");
    let state = state_dir();
    let addr = free_local_addr();
    let m = bg_spec(&b, state.path())
        .arg("--metrics-addr")
        .arg(&addr)
        .arg("--negative-ttl")
        .arg("300")
        .mount();
    // Looked up first (missing, remembered for --negative-ttl): the creates need no request.
    for i in 0..3 {
        assert!(!m.join(format!("r{i}")).exists());
    }
    s3().remove_bucket(&b);
    for i in 0..3 {
        write_file(&m.join(format!("r{i}")), &content(i));
    }
    wait_for("the three uploads to fail", Duration::from_secs(30), || {
        metric(&addr, "bucketfs_writeback_failed_files") == 3
    });
    assert_eq!(read_file(&m.join("r1")), content(1));
    let (code, out) = pending_run(m.path());
    assert_eq!(code, Some(0), "{out}");
    for i in 0..3 {
        assert!(
            out.lines()
                .any(|l| l.starts_with("failed") && l.contains(&format!("\"r{i}\""))),
            "r{i} not listed as failed:\n{out}"
        );
    }
    assert!(out.contains("3 failed"), "{out}");
    assert!(metric(&addr, "bucketfs_writeback_upload_errors_total") >= 3);
    // Retried (every 10 s at first): still refused, still logged once per file.
    std::thread::sleep(Duration::from_secs(12));
    let log = m.log();
    for i in 0..3 {
        let lines = log
            .lines()
            .filter(|l| l.contains(&format!("r{i}: background upload failed")))
            .count();
        assert_eq!(lines, 1, "r{i} logged {lines} times:\n{log}");
    }
    s3().create_bucket(&b);
    let (status, log) = m.unmount();
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
    for i in 0..3 {
        assert_eq!(s3().get(&b, &format!("r{i}")), Some(content(i)), "r{i}");
    }
}

/// With --upload-delay, a file renamed, removed or chmod'ed before its upload costs no
/// extra upload: a renamed file is uploaded once under its new name, a removed one never,
/// a chmod goes up with the file.
#[test]
fn rename_unlink_chmod_before_upload_cost_no_extra_upload() {
    let b = s3().new_bucket("bgrename");
    let state = state_dir();
    let m = bg_spec(&b, state.path())
        .arg("--upload-delay")
        .arg("3")
        .mount();
    let before = puts(m.path());
    write_file(&m.join("a.tmp"), b"renamed");
    std::fs::rename(m.join("a.tmp"), m.join("a")).unwrap();
    write_file(&m.join("gone"), b"removed");
    std::fs::remove_file(m.join("gone")).unwrap();
    write_file(&m.join("c"), b"chmod");
    std::fs::set_permissions(m.join("c"), std::fs::Permissions::from_mode(0o600)).unwrap();
    // The mount shows them meanwhile.
    assert_eq!(read_file(&m.join("a")), b"renamed");
    assert!(!m.join("a.tmp").exists() && !m.join("gone").exists());
    assert_eq!(
        std::fs::metadata(m.join("c")).unwrap().permissions().mode() & 0o777,
        0o600
    );
    assert_eq!(puts(m.path()), before, "nothing uploaded within the delay");
    wait_for("the uploads", Duration::from_secs(20), || {
        s3().get(&b, "a").is_some() && s3().get(&b, "c").is_some()
    });
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(puts(m.path()) - before, 2, "one PUT per file that stays");
    let keys = s3().list_keys(&b, "");
    assert_eq!(keys, ["a", "c"].iter().map(|s| s.to_string()).collect());
    assert_eq!(s3().get(&b, "a").unwrap(), b"renamed");
    assert_eq!(
        s3().head(&b, "c")
            .unwrap()
            .meta
            .get("mode")
            .map(String::as_str),
        Some("33152")
    );
}

/// Another client writes the object between this mount's close and its upload: the upload
/// is refused (If-Match / If-None-Match), the other client's object stays, the file is
/// listed as a conflict and this mount still shows its version; written again here, it goes
/// over the other.
#[test]
fn another_clients_change_before_upload_is_not_clobbered() {
    let b = s3().new_bucket("bgconflict");
    s3().put(&b, "old", b"theirs v1".to_vec());
    let state = state_dir();
    let m = bg_spec(&b, state.path())
        .arg("--upload-delay")
        .arg("2")
        .mount();
    assert_eq!(read_file(&m.join("old")), b"theirs v1");
    write_file(&m.join("old"), b"ours over v1");
    write_file(&m.join("new"), b"ours, new");
    s3().put(&b, "old", b"theirs v2".to_vec());
    s3().put(&b, "new", b"theirs, new".to_vec());
    wait_for("two conflicts", Duration::from_secs(20), || {
        let (_, out) = pending_run(m.path());
        out.lines().filter(|l| l.starts_with("conflict")).count() == 2
    });
    assert_eq!(s3().get(&b, "old").unwrap(), b"theirs v2");
    assert_eq!(s3().get(&b, "new").unwrap(), b"theirs, new");
    assert_eq!(read_file(&m.join("old")), b"ours over v1");
    assert!(m
        .log()
        .contains("changed by another client before this mount uploaded it"));
    // Written again here: stored over the other client's.
    write_file(&m.join("new"), b"ours again");
    wait_for("the rewrite to go up", Duration::from_secs(20), || {
        s3().get(&b, "new").as_deref() == Some(&b"ours again"[..])
    });
}

/// A full write-back directory makes a close wait for room (never ENOSPC): with uploads
/// stalled and --writeback-size 1M, two 400 KiB files fit and the third close waits until
/// uploads free room.
#[test]
fn full_writeback_directory_makes_writers_wait() {
    let b = s3().new_bucket("bgspace");
    let state = state_dir();
    let proxy = proxy::FaultProxy::start(&minio_addr());
    let mut spec = via_proxy(&b, &proxy);
    spec.args.extend(
        [
            "--upload",
            "background",
            "--state-dir",
            state.path().to_str().unwrap(),
            "--writeback-size",
            "1M",
            "--negative-ttl",
            "300",
        ]
        .map(String::from),
    );
    let m = spec.mount();
    let body = pattern::bytes(3, 400 << 10);
    // Looked up before the stall, so the creates below need no request.
    for i in 0..3 {
        assert!(!m.join(format!("s{i}")).exists());
    }
    proxy.stall(true);
    write_file(&m.join("s0"), &body);
    write_file(&m.join("s1"), &body);
    let done = Arc::new(AtomicBool::new(false));
    let t = {
        let (p, body, done) = (m.join("s2"), body.clone(), done.clone());
        std::thread::spawn(move || {
            let mut f = std::fs::File::create(&p).unwrap();
            f.write_all(&body).unwrap();
            let r = close_checked(f);
            done.store(true, Ordering::SeqCst);
            r
        })
    };
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        !done.load(Ordering::SeqCst),
        "the third close did not wait for room"
    );
    proxy.stall(false);
    t.join()
        .unwrap()
        .expect("the waiting close succeeds once uploads free room");
    let (status, log) = m.unmount();
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
    for i in 0..3 {
        assert_eq!(s3().get(&b, &format!("s{i}")).unwrap(), body, "s{i}");
    }
}

/// Unmounting waits for the uploads still to do, and says so in the log.
#[test]
fn unmount_waits_for_background_uploads() {
    let b = s3().new_bucket("bgumount");
    let state = state_dir();
    let m = bg_spec(&b, state.path())
        .arg("--upload-delay")
        .arg("60")
        .mount();
    for i in 0..20 {
        write_file(&m.join(format!("u{i}")), &content(i));
    }
    assert!(s3().list_keys(&b, "").is_empty());
    let (status, log) = m.unmount();
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
    assert!(log.contains("waiting for 20 background upload(s)"), "{log}");
    for i in 0..20 {
        assert_eq!(s3().get(&b, &format!("u{i}")), Some(content(i)));
    }
}

/// A database-like writer on a background mount (small writes all over an open file, an
/// fsync every few, as sysbench's rndwr): its fsyncs after the first store only what changed
/// since (deltas), nothing goes up while the file stays open, and kill -9 after more
/// writes leaves the bucket, after the next mount, with exactly the last fsync'd version:
/// not the old object, not a mix with the writes after that fsync.
#[test]
fn kill_9_after_fsyncs_of_an_open_file_keeps_exactly_the_last_fsynced_version() {
    use std::os::unix::fs::FileExt;
    let b = s3().new_bucket("bgdelta");
    let state = state_dir();
    let size = 1 << 20;
    let old = pattern::bytes(1, size);
    s3().put(&b, "db", old.clone());
    let addr = free_local_addr();
    let m = bg_spec(&b, state.path())
        .arg("--metrics-addr")
        .arg(&addr)
        .mount();
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.join("db"))
        .unwrap();
    let mut now = old.clone();
    let mut fsynced = now.clone();
    for i in 0..32usize {
        let block = pattern::bytes(100 + i as u64, 16 << 10);
        let at = (i * 7919 * 4096) % (size - block.len());
        f.write_all_at(&block, at as u64).unwrap();
        now[at..at + block.len()].copy_from_slice(&block);
        if i % 3 == 2 {
            f.sync_all().unwrap();
            fsynced = now.clone();
        }
    }
    assert_ne!(
        now, fsynced,
        "the last writes were fsync'd: nothing to lose"
    );
    let deltas = metric(&addr, "bucketfs_writeback_deltas_total");
    assert!(deltas >= 8, "{deltas} of 10 fsyncs stored deltas");
    assert_eq!(
        s3().get(&b, "db").as_deref(),
        Some(&old[..]),
        "a version went up while the file was open"
    );
    let mut m = m;
    m.kill9();
    drop(f);
    drop(m);
    let m = bg_spec(&b, state.path()).mount();
    wait_for(
        "the recovered version to land",
        Duration::from_secs(30),
        || s3().get(&b, "db").as_deref() != Some(&old[..]),
    );
    assert!(
        s3().get(&b, "db").as_deref() == Some(&fsynced[..]),
        "the bucket holds another version than the last fsync'd one"
    );
    assert!(read_file(&m.join("db")) == fsynced);
}

/// Group commit through a real mount: a program that writes to each of its open files and
/// then fsyncs each in turn (sysbench's rndwr, a database's checkpoint) pays about one sync
/// of the write-back directory per round, not one per file. kill -9 after a write to every
/// file and an fsync of the first only: after the next mount the first is exactly as
/// fsync'd, and each other file is its last fsync'd version or the state it had at the
/// first's fsync (taken along), never anything else.
#[test]
fn fsyncs_of_many_open_files_share_syncs_and_survive_kill_9() {
    use std::os::unix::fs::FileExt;
    let b = s3().new_bucket("bggroup");
    let state = state_dir();
    let addr = free_local_addr();
    let m = bg_spec(&b, state.path())
        .arg("--metrics-addr")
        .arg(&addr)
        .mount();
    let (n, size) = (16usize, 256usize << 10);
    let mut files = Vec::new();
    let (mut now, mut fsynced) = (Vec::new(), Vec::new());
    for i in 0..n {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(m.join(format!("t{i}")))
            .unwrap();
        let data = pattern::bytes(i as u64, size);
        f.write_all_at(&data, 0).unwrap();
        f.sync_all().unwrap();
        files.push(f);
        now.push(data.clone());
        fsynced.push(data);
    }
    let write_all = |round: usize, now: &mut Vec<Vec<u8>>| {
        for (i, f) in files.iter().enumerate() {
            let block = pattern::bytes((1000 * round + i) as u64, 16 << 10);
            let at = (i * 7919 + round * 4099) * 4 % (size - block.len());
            f.write_all_at(&block, at as u64).unwrap();
            now[i][at..at + block.len()].copy_from_slice(&block);
        }
    };
    let syncs = || metric(&addr, "bucketfs_writeback_syncs_total");
    let mut rounds = Vec::new();
    for round in 1..=3 {
        write_all(round, &mut now);
        let before = syncs();
        for f in &files {
            f.sync_all().unwrap();
        }
        rounds.push(syncs() - before);
        fsynced.clone_from(&now);
    }
    assert!(
        rounds.iter().min().is_some_and(|r| *r <= 3 * n as u64 / 4),
        "syncs per round of {n} fsyncs of changed files: {rounds:?} (one per file without group commit)"
    );
    write_all(4, &mut now);
    let along = metric(&addr, "bucketfs_writeback_along_total");
    files[0].sync_all().unwrap();
    // The commits taken along run beside the fsync: wait for them to be counted.
    wait_for("the files taken along", Duration::from_secs(10), || {
        metric(&addr, "bucketfs_writeback_along_total") > along
    });
    let mut m = m;
    m.kill9();
    drop(files);
    drop(m);
    let m = bg_spec(&b, state.path()).mount();
    let mut taken = 0;
    for i in 0..n {
        let got = read_file(&m.join(format!("t{i}")));
        if i == 0 {
            assert!(got == now[0], "t0 is not its fsync'd version");
        } else if got == now[i] {
            taken += 1;
        } else {
            assert!(
                got == fsynced[i],
                "t{i} is neither its fsync'd version nor a later state"
            );
        }
    }
    assert!(taken > 0, "no file was taken along by the last fsync");
    // And the bucket gets the same versions.
    wait_for(
        "the recovered versions to land",
        Duration::from_secs(30),
        || (0..n).all(|i| s3().get(&b, &format!("t{i}")).is_some()),
    );
    drop(m); // the unmount waits for the uploads
    for i in 0..n {
        let got = s3().get(&b, &format!("t{i}")).unwrap();
        assert!(
            got == now[i] || (i > 0 && got == fsynced[i]),
            "the bucket holds another version of t{i}"
        );
    }
}

/// Removing an uploaded version's file from the write-back directory frees its blocks (0.2 s
/// a GiB on this disk), so it runs on a thread of its own: with the daemon's one runtime
/// thread (`TOKIO_WORKER_THREADS=1`) and the removal held at its test point, a lookup that
/// needs the store is still answered, and the removal finishes once let on.
#[test]
fn removing_an_uploaded_big_file_never_holds_the_runtime() {
    let b = s3().new_bucket("bgdrop");
    let state = state_dir();
    let work = tempfile::tempdir().unwrap();
    let pause = Pause::new(work.path());
    let m = bg_spec_at_on_one_thread(&b, state.path(), &pause, "writeback.drop_file").mount();
    // Past the largest size a segment record holds, so the version is a file of its own.
    let body = pattern::bytes(7, 6 << 20);
    write_file(&m.join("big.bin"), &body);
    pause.reached();
    assert_eq!(s3().get(&b, "big.bin"), Some(body.clone()), "uploaded");
    s3().put(&b, "other", b"theirs".to_vec());
    assert_eq!(
        stat_then_go_on(&pause, &m.join("other")),
        (true, Some(6)),
        "a lookup while the removal was held was answered within 10 s"
    );
    let (status, log) = m.unmount();
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
    let left = cache_files(state.path(), ".wb");
    assert!(
        left.is_empty(),
        "the uploaded version's file is gone: {left:?}"
    );
}

/// Stats `path` (a lookup that needs a HEAD) while the daemon is held at `pause`, then lets
/// it on: whether the stat was answered within 10 s, and the size it gave.
fn stat_then_go_on(pause: &Pause, path: &Path) -> (bool, Option<u64>) {
    std::thread::scope(|s| {
        let h = s.spawn(|| std::fs::metadata(path).map(|md| md.len()));
        let deadline = Instant::now() + Duration::from_secs(10);
        while !h.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let finished = h.is_finished();
        pause.go_on();
        (finished, h.join().unwrap().ok())
    })
}

/// A commit whose record fills the write-back directory's disk (a 96 MiB tmpfs: the
/// staging file cannot be linked in and its bytes are copied) in the middle of a 40 MiB
/// file: its file goes off the runtime (with one runtime thread and its removal held at the
/// test point, a lookup that needs the store is still answered), and the close uploads the
/// file to the bucket itself before it returns (before: `ENOSPC`); the mount writes on.
#[test]
fn a_commit_that_fills_the_writeback_disk_drops_its_file_off_the_runtime_and_uploads_itself() {
    let b = s3().new_bucket("bgabandon");
    let disk = SmallDisk::new(96).expect("mount a tmpfs (run as root)");
    let state = disk.path().join("state");
    let work = tempfile::tempdir().unwrap();
    let pause = Pause::new(work.path());
    let m = bg_spec_at_on_one_thread(&b, &state, &pause, "writeback.abandon_file").mount();
    s3().put(&b, "other", b"other!".to_vec());
    let path = m.join("big.bin");
    let body = pattern::bytes(5, 40 << 20);
    let closed = {
        let body = body.clone();
        std::thread::spawn(move || {
            let mut f = std::fs::File::create(&path)?;
            f.write_all(&body)?;
            close_checked(f)
        })
    };
    pause.reached();
    assert_eq!(
        stat_then_go_on(&pause, &m.join("other")),
        (true, Some(6)),
        "a lookup while the removal was held was answered within 10 s"
    );
    let _passes = pause.let_on();
    closed.join().unwrap().expect("the close uploads the file");
    assert!(
        s3().get(&b, "big.bin") == Some(body),
        "in the bucket, byte-exact, when the close returned"
    );
    write_file(&m.join("small"), b"after");
    let (status, log) = m.unmount();
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
    assert!(log.contains("no room in the write-back directory"), "{log}");
    assert_eq!(
        s3().get(&b, "small"),
        Some(b"after".to_vec()),
        "the mount wrote on"
    );
    let left = cache_files(&state, ".wb");
    assert!(
        left.is_empty(),
        "the failed version's file is gone: {left:?}"
    );
}

/// The write-back directory's disk filled by another program (a 96 MiB tmpfs; the mount's
/// 64 MiB segment, made at start, keeps room for small records): each close of a file too
/// big for a record (over 4 MiB) uploads it to the bucket before it returns (before: every
/// such close failed with `ENOSPC`), so nothing is refused while the bucket has room. Once
/// there is room again, closes go through the write-back directory, and a file written
/// both ways ends as its last version.
#[test]
fn a_full_writeback_disk_makes_closes_upload_their_files_themselves() {
    let b = s3().new_bucket("bgdiskfull");
    let disk = SmallDisk::new(96).expect("mount a tmpfs (run as root)");
    let state = disk.path().join("state");
    let m = background(MountSpec::s3(&b, ""), &state, &["--upload-delay", "2"]).mount();
    wait_first_segment(&state);
    let (filler, _) = fill(disk.path());
    let body = |i: u64| pattern::bytes(i, (5 << 20) + i as usize * 1000);
    for i in 0..4 {
        let name = format!("f{i}");
        write_file(&m.join(&name), &body(i));
        assert!(
            s3().get(&b, &name) == Some(body(i)),
            "{name} in the bucket when its close returned"
        );
    }
    std::fs::remove_file(&filler).unwrap();
    write_file(&m.join("f0"), &body(9));
    assert!(
        s3().get(&b, "f0") == Some(body(0)),
        "with room again, the close waits for no upload (--upload-delay 2)"
    );
    let (status, log) = m.unmount();
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
    assert!(log.contains("no room in the write-back directory"), "{log}");
    assert!(s3().get(&b, "f0") == Some(body(9)), "{log}");
    for i in 1..4 {
        assert!(s3().get(&b, &format!("f{i}")) == Some(body(i)), "f{i}");
    }
}

/// The segment files under `state` (name, length).
fn segment_files(state: &Path) -> Vec<(String, u64)> {
    let mut segments = Vec::new();
    let mut dirs = vec![state.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                dirs.push(e.path());
            } else if name.starts_with("seg-") {
                segments.push((name, e.metadata().map_or(0, |m| m.len())));
            }
        }
    }
    segments
}

/// Fills the disk of `dir` with a file `dir/filler` (1 MiB writes until one fails); returns
/// its path and the file.
fn fill(dir: &Path) -> (PathBuf, std::fs::File) {
    let filler = dir.join("filler");
    let mut f = std::fs::File::create(&filler).unwrap();
    let chunk = vec![7u8; 1 << 20];
    while f.write_all(&chunk).is_ok() {}
    (filler, f)
}

/// Waits until the write-back directory under `state` made its first segment (in the
/// background at mount): a disk filled before would take that segment's room instead.
fn wait_first_segment(state: &Path) {
    wait_for("the first segment", Duration::from_secs(20), || {
        segment_files(state).iter().any(|(_, len)| *len == 64 << 20)
    });
    // Its head and sync follow the zeros.
    std::thread::sleep(Duration::from_millis(300));
}

/// A write-back disk too full for a new 64 MiB segment: each try to make one (once the
/// segment in use is a quarter full, and again at later commits) fails, and leaves nothing
/// behind. The half-written segment files stayed until the next mount, each holding the
/// space that was free when it was tried, so a disk full for a moment stayed full.
#[test]
fn a_segment_that_cannot_be_made_leaves_no_file_behind() {
    let b = s3().new_bucket("bgsegfull");
    let disk = SmallDisk::new(96).expect("mount a tmpfs (run as root)");
    let state = disk.path().join("state");
    let m = background(MountSpec::s3(&b, ""), &state, &["--upload-delay", "0"]).mount();
    wait_first_segment(&state);
    let (filler, f) = fill(disk.path());
    let len = f.metadata().unwrap().len();
    f.set_len(len - (8 << 20)).unwrap();
    drop(f);
    let body = |i: u64| pattern::bytes(i, 1 << 20);
    for i in 0..24 {
        write_file(&m.join(format!("f{i}")), &body(i));
    }
    // Room again, not enough for a segment: the next tries fail too.
    std::fs::remove_file(&filler).unwrap();
    for i in 24..28 {
        write_file(&m.join(format!("f{i}")), &body(i));
    }
    std::thread::sleep(Duration::from_millis(500));
    let segments = segment_files(&state);
    assert!(
        segments.iter().all(|(_, len)| *len == 64 << 20),
        "segment files that are not whole segments: {segments:?}"
    );
    let (status, log) = m.unmount();
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
    for i in 0..28 {
        assert!(s3().get(&b, &format!("f{i}")) == Some(body(i)), "f{i}");
    }
}

/// A big file fsync'd while open becomes a write-back entry that is its staging file; once
/// uploaded, the state may hold its last descriptor. The next write copies the bytes to a
/// staging file of its own and closes the old one away from the runtime (its blocks are freed
/// then): the close passes the test point of closes on a blocking thread after that write.
#[test]
fn a_write_after_a_big_fsynced_version_uploaded_frees_it_off_the_runtime() {
    let b = s3().new_bucket("bgunshare");
    let state = state_dir();
    let work = tempfile::tempdir().unwrap();
    let pause = Pause::new(work.path());
    let m = bg_spec_at(&b, state.path(), &pause, "write.close_away").mount();
    let passes = pause.let_on();
    let body = pattern::bytes(9, 20 << 20);
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .read(true)
        .write(true)
        .open(m.join("big.bin"))
        .unwrap();
    f.write_all(&body).unwrap();
    f.sync_all().unwrap();
    wait_for(
        "the fsync'd version uploaded",
        Duration::from_secs(60),
        || {
            s3().head(&b, "big.bin")
                .is_some_and(|h| h.size == body.len() as u64)
        },
    );
    std::thread::sleep(Duration::from_millis(300));
    let before = passes.count();
    use std::os::unix::fs::FileExt;
    // Inside a part (a write that starts one goes to memory first).
    f.write_all_at(b"X", (3 << 20) + 5).unwrap();
    wait_for(
        "the old staging file closed away",
        Duration::from_secs(10),
        || passes.count() > before,
    );
    drop(f);
    let (status, log) = m.unmount();
    drop(passes);
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
    let mut want = body;
    want[(3 << 20) + 5] = b'X';
    assert!(
        s3().get(&b, "big.bin") == Some(want),
        "the last version whole"
    );
}
