//! Reliability and security through real mounts: crashes (kill -9, dead mount points),
//! SIGTERM during writes, network faults injected by a proxy (503 SlowDown, connections reset,
//! bodies cut mid-transfer, a slow server), a server out of space, HTTPS with a private CA,
//! and who may use a mount. None of these stops the shared MinIO, so they run in parallel
//! with the other tests (the tests that restart it are in `fault.rs`).

mod common;

use common::proxy::FaultProxy;
use common::*;
use std::ffi::OsString;
use std::fs::{self, File};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

// ---------------------------------------------------------------------------------------------
// Crash safety
// ---------------------------------------------------------------------------------------------

/// Requests are answered on the FUSE thread that read them when they need nothing from the
/// network: a bug that panics there costs its own request (EIO), never the thread. More
/// panics than the mount has FUSE threads, then the mount still answers everything else.
#[test]
fn a_request_that_panics_gets_eio_and_the_mount_keeps_serving() {
    let b = s3().new_bucket("panicop");
    s3().put(&b, "f", b"still here".to_vec());
    let mut spec = MountSpec::s3(&b, "");
    spec.envs
        .push(("BUCKETFS_TEST_POINT".into(), "readlink=panic".into()));
    let m = spec.mount();
    std::os::unix::fs::symlink("f", m.join("l")).unwrap();
    for _ in 0..12 {
        let e = fs::read_link(m.join("l")).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    }
    assert_eq!(fs::read(m.join("f")).unwrap(), b"still here");
    fs::write(m.join("g"), b"new").unwrap();
    assert_eq!(s3().get(&b, "g").as_deref(), Some(&b"new"[..]));
    assert_eq!(fs::read_dir(m.path()).unwrap().count(), 3);
}

/// A child forked while a file is open for writing closes its copy of the descriptor at exec
/// (O_CLOEXEC). That close is a FUSE flush, but not the writer's close: the file must not be
/// published, half-written, because some other process exec'd.
#[test]
fn a_forked_child_does_not_publish_a_file_being_written() {
    let s3 = s3();
    let b = s3.new_bucket("forkflush");
    let m = Mount::s3(&b);
    let mut f = File::create(m.join("half.bin")).unwrap();
    f.write_all(&pattern::block(3, 0)).unwrap();
    let st = Command::new("true").status().unwrap();
    assert!(st.success());
    std::thread::sleep(Duration::from_millis(300));
    let visible = s3.head(&b, "half.bin").map(|h| h.size);
    f.write_all(&pattern::block(3, 1)).unwrap();
    close_checked(f).unwrap();
    pattern::check_slice(&s3.get(&b, "half.bin").unwrap(), 3, 2 * MIB as u64).unwrap();
    assert_eq!(
        visible, None,
        "a child's exec published the file being written ({visible:?} bytes visible before \
         the writer closed it)"
    );
}

/// kill -9 in the middle of writes: nothing half-written becomes visible, and the next mount
/// of the bucket aborts the multipart upload the dead daemon left (and only that one).
#[test]
fn kill9_during_writes_leaves_no_object_and_the_next_mount_aborts_our_upload() {
    let s3 = s3();
    let b = s3.new_bucket("kill9");
    let foreign = create_upload(&b, "someone-else.bin");
    let mut m = MountSpec::s3(&b, "").mount();
    // The writer is its own process that never forks: a descriptor open for writing in this
    // test process would be flushed (and the file published) whenever another test running
    // in parallel forks a child (see `a_forked_child_does_not_publish_a_file_being_written`).
    let mut w = ForeignWriter::start();
    w.open("big", &m.join("big.bin"));
    assert_eq!(w.cmd("fill big 40"), "ok");
    w.open("small", &m.join("small.txt"));
    assert_eq!(w.cmd("text small not closed yet"), "ok");
    // The big file streams parts while it is written: its upload exists before close.
    wait_for("the streamed upload", Duration::from_secs(30), || {
        s3.list_multipart_uploads(&b)
            .iter()
            .any(|(k, _)| k == "big.bin")
    });
    m.kill9();
    drop(w);
    assert!(s3.head(&b, "big.bin").is_none(), "partial big.bin visible");
    assert!(
        s3.head(&b, "small.txt").is_none(),
        "partial small.txt visible"
    );
    let before = s3.list_multipart_uploads(&b);
    assert_eq!(before.len(), 2, "{before:?}");

    // The next mount of the bucket (same cache dir, so it finds the journal) cleans up.
    let m2 = MountSpec::s3(&b, "").mount();
    let after = s3.list_multipart_uploads(&b);
    assert_eq!(
        after,
        vec![("someone-else.bin".to_string(), foreign)],
        "our upload must be aborted, the foreign one kept; log:\n{}",
        m2.log()
    );
    assert!(
        m2.log()
            .contains("big.bin: aborted the upload a previous bucketfs left open"),
        "{}",
        m2.log()
    );
    assert!(list_dir(m2.path()).is_empty());
    drop(m);
}

/// A file unlinked while open keeps its bytes under `.bucketfs-unlinked/` until its last close;
/// a daemon killed before that close leaves the object, and the next mount deletes it.
#[test]
fn kill9_with_an_unlinked_file_open_and_the_next_mount_deletes_its_copy() {
    let s3 = s3();
    let b = s3.new_bucket("kill9unlinked");
    // Bytes only the bucket holds (a file written by another client, open here for reading):
    // unlink must keep them for the descriptor, in a hidden copy.
    s3.put(&b, "big.bin", vec![7u8; 24 << 20]);
    let mut m = MountSpec::s3(&b, "").mount();
    let reader = fs::File::open(m.join("big.bin")).unwrap();
    fs::remove_file(m.join("big.bin")).unwrap();
    let hidden: Vec<String> = s3
        .list_keys(&b, "")
        .into_iter()
        .filter(|k| k.starts_with(".bucketfs-unlinked/"))
        .collect();
    assert_eq!(hidden.len(), 1, "{:?}", s3.list_keys(&b, ""));
    assert_eq!(s3.head(&b, &hidden[0]).map(|h| h.size), Some(24 << 20));
    m.kill9();
    drop(reader);
    assert!(s3.head(&b, &hidden[0]).is_some());

    let m2 = MountSpec::s3(&b, "").mount();
    assert_eq!(
        s3.list_keys(&b, ""),
        std::collections::BTreeSet::new(),
        "log:\n{}",
        m2.log()
    );
    assert!(
        m2.log()
            .contains("deleted the copy of an unlinked file a previous bucketfs left"),
        "{}",
        m2.log()
    );
    drop(m);
}

/// A mount point left by a crashed daemon ("Transport endpoint is not connected") is
/// unmounted with a message, and the new mount works; also at once after the crash, while
/// the kernel still answers a `stat` of it from the root's attributes it cached (before: "is
/// already a mount point" for up to the dead daemon's stat TTL, 5 s).
#[test]
fn mounting_over_a_dead_mount_point_cleans_it_up_with_a_message() {
    let s3 = s3();
    let b = s3.new_bucket("deadmp");
    s3.put(&b, "f", "hello");
    for cached in [false, true] {
        mount_over_a_dead_mount(&b, cached);
    }
}

fn mount_over_a_dead_mount(b: &str, cached: bool) {
    let mut m = MountSpec::s3(b, "").arg("--stat-ttl").arg("30").mount();
    let mp = m.path().to_path_buf();
    if cached {
        fs::metadata(&mp).unwrap();
    }
    m.kill9();
    if cached {
        assert!(
            fs::metadata(&mp).is_ok(),
            "the root's attributes are not cached"
        );
    } else {
        std::thread::sleep(Duration::from_secs(1));
        assert_eq!(
            errno(fs::metadata(&mp)),
            libc::ENOTCONN,
            "the killed daemon should leave a dead mount"
        );
    }
    let log = tempfile::tempdir().unwrap();
    let mut args = os(&["mount", &format!("s3://{b}")]);
    args.push(mp.clone().into_os_string());
    args.extend(s3_args().into_iter().map(OsString::from));
    args.push("--log-file".into());
    args.push(log.path().join("d.log").into_os_string());
    let e = env();
    let run = run_cli(
        &args,
        &[
            ("AWS_ACCESS_KEY_ID", e.access_key.as_str()),
            ("AWS_SECRET_ACCESS_KEY", e.secret_key.as_str()),
        ],
        Some(&mp),
        Duration::from_secs(60),
    );
    assert!(run.status.is_some_and(|s| s.success()), "{run:?}");
    assert!(
        run.stderr.contains("was a dead FUSE mount")
            && run.stderr.contains("transport endpoint is not connected"),
        "no message about the dead mount: {run:?}"
    );
    assert_eq!(read_file(&mp.join("f")), b"hello");
    let um = run_cli(
        &[OsString::from("umount"), mp.clone().into_os_string()],
        &[],
        None,
        Duration::from_secs(60),
    );
    assert!(um.status.is_some_and(|s| s.success()), "{um:?}");
    wait_for("the daemon to exit", Duration::from_secs(30), || {
        processes_mentioning(mp.to_str().unwrap()).is_empty()
    });
    drop(m);
}

/// SIGTERM while files are open for writing: the mount is detached, the daemon keeps serving
/// the descriptors, publishes nothing half written, stores each file at its close, and exits
/// once the last is closed.
#[test]
fn sigterm_during_active_writes_stores_each_file_at_its_close() {
    let s3 = s3();
    let b = s3.new_bucket("sigterm");
    let mut m = MountSpec::s3(&b, "").mount();
    let mut w = ForeignWriter::start();
    w.open("a", &m.join("a.bin"));
    assert_eq!(w.cmd("fill a 20"), "ok");
    w.open("c", &m.join("c.txt"));
    assert_eq!(w.cmd("text c first half, "), "ok");
    m.signal(libc::SIGTERM);
    // The mount is busy (the writer's descriptors): it is detached lazily and still serves
    // them.
    wait_for("the lazy detach", Duration::from_secs(60), || {
        m.log().contains("detaching it lazily")
    });
    assert_eq!(w.cmd("text c second half"), "ok");
    assert!(
        s3.head(&b, "c.txt").is_none(),
        "half-written c.txt published"
    );
    assert!(
        s3.head(&b, "a.bin").is_none(),
        "half-written a.bin published"
    );
    assert_eq!(w.cmd("close c"), "ok", "close after SIGTERM");
    assert!(
        m.wait_exit(Duration::from_millis(100)).is_none(),
        "exited with a.bin still open"
    );
    assert_eq!(w.cmd("close a"), "ok", "close after SIGTERM");
    drop(w);
    let st = m.wait_exit(Duration::from_secs(60));
    assert!(
        st.is_some_and(|s| s.success()),
        "daemon exit {st:?}: {}",
        m.log()
    );
    assert_eq!(s3.get(&b, "c.txt").unwrap(), b"first half, second half");
    assert_eq!(s3.get(&b, "a.bin").unwrap(), writer_block().repeat(20));
    assert!(s3.list_multipart_uploads(&b).is_empty());
}

/// A second SIGTERM does not wait for slow uploads: it aborts them and names each file that
/// was therefore not stored; nothing partial is left in the bucket.
#[test]
fn second_sigterm_aborts_uploads_and_names_the_files_not_stored() {
    let s3 = s3();
    let b = s3.new_bucket("sigterm2");
    let proxy = FaultProxy::start(&minio_addr());
    let mut m = via_proxy(&b, &proxy).mount();
    // A slow link: the parts of a 32 MiB file take ~30 s to go up.
    proxy.set_bandwidth(1024 * 1024);
    let mut w = ForeignWriter::start();
    w.open("s", &m.join("slow.bin"));
    assert_eq!(w.cmd("fill s 32"), "ok");
    // A small file still open has no upload: it is named too.
    w.open("t", &m.join("small.txt"));
    assert_eq!(w.cmd("text t unfinished"), "ok");
    m.signal(libc::SIGTERM);
    std::thread::sleep(Duration::from_millis(500));
    m.signal(libc::SIGTERM);
    wait_for("the abort messages", Duration::from_secs(60), || {
        let l = m.log();
        l.contains("slow.bin: upload aborted at shutdown; the file was NOT stored")
            && l.contains("small.txt: still open for writing at shutdown; the file was NOT stored")
    });
    // The daemon exits without waiting for the writer's descriptors.
    let st = m.wait_exit(Duration::from_secs(60));
    assert!(st.is_some_and(|s| !s.success()), "exit {st:?}: {}", m.log());
    drop(w);
    assert!(s3.head(&b, "slow.bin").is_none());
    assert!(s3.head(&b, "small.txt").is_none());
    assert!(
        s3.list_multipart_uploads(&b).is_empty(),
        "{:?}",
        s3.list_multipart_uploads(&b)
    );
}

// ---------------------------------------------------------------------------------------------
// Network faults through a proxy
// ---------------------------------------------------------------------------------------------

/// The startup access check is tried again when it fails for a transient reason: a 503 and a
/// reset connection at the moment of the mount (a store restarting, a load balancer's
/// hiccup) do not fail it. Before, one such answer failed the mount ("cannot reach endpoint").
#[test]
fn a_mount_whose_first_requests_fail_transiently_still_mounts() {
    let s3 = s3();
    let b = s3.new_bucket("startretry");
    s3.put(&b, "f", b"here".to_vec());
    let proxy = FaultProxy::start(&minio_addr());
    proxy.slow_down(1);
    proxy.fail_requests(&format!("GET /{b}"), 1);
    let m = Mount::start(via_proxy(&b, &proxy)).expect("mount failed on transient errors");
    assert_eq!(proxy.slowdowns(), 1);
    assert_eq!(fs::read(m.join("f")).unwrap(), b"here");
    let log = m.log();
    assert_eq!(log.matches("bucket access check:").count(), 2, "{log}");
}

/// 503 SlowDown answers, all connections dropped mid-transfer and response bodies cut short:
/// every write and read still completes with exact bytes, thanks to the retries.
#[test]
fn slowdown_resets_and_cut_bodies_are_retried_with_exact_bytes() {
    let s3 = s3();
    let b = s3.new_bucket("proxyfaults");
    let proxy = FaultProxy::start(&minio_addr());
    let m = via_proxy(&b, &proxy).mount();
    let len = 24 * MIB as u64;
    {
        let mut f = File::create(m.join("w.bin")).unwrap();
        for i in 0..24u64 {
            f.write_all(&pattern::block(31, i)).unwrap();
            match i {
                3 => proxy.slow_down(4),
                9 => proxy.reset_all(),
                15 => proxy.cut_responses(2, 10),
                _ => {}
            }
        }
        proxy.slow_down(3);
        close_checked(f).expect("close must succeed after retries");
    }
    pattern::check_slice(&s3.get(&b, "w.bin").unwrap(), 31, len).unwrap();
    // Reads: bodies cut after 100 KiB, then everything reset, then SlowDown.
    let m = m.remount();
    let mut f = File::open(m.join("w.bin")).unwrap();
    proxy.cut_responses(3, 100 * 1024);
    let mut buf = vec![0u8; 6 * MIB];
    f.read_exact(&mut buf).unwrap();
    proxy.reset_all();
    proxy.slow_down(3);
    let mut rest = Vec::new();
    f.read_to_end(&mut rest).unwrap();
    buf.extend_from_slice(&rest);
    drop(f);
    pattern::check_slice(&buf, 31, len).unwrap();
    // Small files and metadata operations under SlowDown.
    proxy.slow_down(5);
    write_file(&m.join("small.txt"), b"tiny");
    proxy.slow_down(3);
    assert_eq!(list_dir(m.path()), set(["small.txt", "w.bin"]));
    assert_eq!(read_file(&m.join("small.txt")), b"tiny");
    let injected = proxy.slowdowns() + proxy.cuts() + proxy.resets();
    eprintln!(
        "proxy faults injected: {} SlowDown, {} cut bodies, {} resets of all connections",
        proxy.slowdowns(),
        proxy.cuts(),
        proxy.resets()
    );
    assert!(proxy.slowdowns() >= 10, "SlowDowns not exercised");
    assert!(proxy.cuts() >= 3, "cut bodies not exercised");
    assert!(injected >= 15);
    let (st, log) = m.unmount();
    assert!(st.is_some_and(|s| s.success()), "{log}");
    assert!(log.contains("retries: "), "{log}");
}

/// A slow server (latency on every packet and a bandwidth cap): operations take longer but
/// complete, with exact bytes and no spurious errors.
#[test]
fn a_slow_server_gives_exact_bytes() {
    let s3 = s3();
    let b = s3.new_bucket("slowserver");
    let proxy = FaultProxy::start(&minio_addr());
    let m = via_proxy(&b, &proxy).mount();
    proxy.set_delay(Duration::from_millis(30));
    proxy.set_bandwidth(4 * 1024 * 1024);
    let t = Instant::now();
    let len = 12 * MIB as u64 + 12345;
    {
        let mut f = File::create(m.join("slow.bin")).unwrap();
        pattern::write(&mut f, 41, len).unwrap();
        close_checked(f).unwrap();
    }
    let mut f = File::open(m.join("slow.bin")).unwrap();
    pattern::check_reader(&mut f, 41, len).unwrap();
    // And a random read in the middle.
    f.seek(SeekFrom::Start(5 * MIB as u64 + 7)).unwrap();
    let mut b7 = [0u8; 7];
    f.read_exact(&mut b7).unwrap();
    assert_eq!(&b7[..], &pattern::block(41, 5)[7..14]);
    let took = t.elapsed();
    eprintln!("slow server: 2 x {len} bytes in {took:?}");
    assert!(
        took > Duration::from_secs(4),
        "the proxy did not slow anything down ({took:?})"
    );
    drop(f);
    let (st, log) = m.unmount();
    assert!(st.is_some_and(|s| s.success()), "{log}");
}

// ---------------------------------------------------------------------------------------------
// A server out of space
// ---------------------------------------------------------------------------------------------

#[test]
fn a_full_server_gives_enospc_and_no_partial_object() {
    let disk = match SmallDisk::new(64) {
        Ok(d) => d,
        Err(e) => panic!("this test needs to mount a tmpfs (run as root): {e}"),
    };
    let data = disk.path().join("data");
    fs::create_dir(&data).unwrap();
    let minio = PrivateMinio::start(&data, None);
    let s3p = minio.client(None);
    let b = "full";
    s3p.create_bucket(b);
    let m = minio.mount_spec(b).mount();
    // 96 MiB does not fit in 64 MiB. (Written by another process: see ForeignWriter.)
    let mut w = ForeignWriter::start();
    w.open("h", &m.join("huge.bin"));
    let wrote = w.cmd("fill h 96");
    let closed = w.cmd("close h");
    drop(w);
    let enospc = format!("errno {}", libc::ENOSPC);
    assert!(
        wrote == enospc || closed == enospc,
        "expected ENOSPC from write or close, got {wrote:?} and {closed:?}; log:\n{}",
        m.log()
    );
    // The failure is logged with the key and the service's request id.
    assert!(
        m.log().lines().any(|l| l.contains("WARN")
            && l.contains("huge.bin")
            && l.contains("request id")
            && l.contains("XMinioStorageFull")),
        "no warning naming the key, the error code and the request id:\n{}",
        m.log()
    );
    assert!(s3p.head(b, "huge.bin").is_none(), "partial object visible");
    // The failed upload is aborted at release, which the kernel sends after close() returns.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut uploads = s3p.list_multipart_uploads(b);
    while !uploads.is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        uploads = s3p.list_multipart_uploads(b);
    }
    assert!(uploads.is_empty(), "{uploads:?}; log:\n{}", m.log());
    // That gives its space back: a small file fits again. (Written before the abort, under
    // load, it could still find the server full; MinIO frees the aborted parts' space a
    // little after the abort answers, so a close may still see it full for a moment.)
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let stored = File::create(m.join("small.txt"))
            .and_then(|mut f| f.write_all(b"still works").map(|()| f))
            .and_then(close_checked);
        match stored {
            Ok(()) => break,
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(200))
            }
            Err(e) => panic!("small.txt after the abort: {e}; log:\n{}", m.log()),
        }
    }
    assert_eq!(s3p.get(b, "small.txt").unwrap(), b"still works");
    drop(m);
}

/// A staging disk (`--cache-dir`) too small for a file opened `O_RDWR` only to be read (a
/// database, a tool that opens read-write to read): its reads give the bucket's bytes, kept
/// locally where there is room (before: `ENOSPC` once the disk was full, and a shared
/// mapping of the file died of `SIGBUS`); a reader opened beside it reads them too.
#[test]
fn reads_through_a_writable_descriptor_need_no_local_space() {
    let disk = SmallDisk::new(2).expect("this test mounts a tmpfs (run as root)");
    let b = s3().new_bucket("rdwr-full");
    let data = pattern::bytes(7, 8 << 20);
    s3().put(&b, "f", data.clone());
    let cache = disk.path().join("cache");
    let m = MountSpec::s3(&b, "")
        .arg("--cache-dir")
        .arg(cache.to_str().unwrap())
        .mount();
    let mut rw = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.join("f"))
        .unwrap();
    let mut got = Vec::new();
    rw.read_to_end(&mut got).unwrap();
    assert!(got == data, "{} bytes read of {}", got.len(), data.len());
    let mut ro = File::open(m.join("f")).unwrap();
    let mut got = Vec::new();
    ro.read_to_end(&mut got).unwrap();
    assert!(got == data);
    drop((ro, rw));
    let (st, log) = m.unmount();
    assert!(st.is_some_and(|s| s.success()), "{log}");
    assert_eq!(s3().get(&b, "f").unwrap(), data);
}

/// A full state disk in sync mode: a file of several parts, whose upload the journal cannot
/// record, fails with `ENOSPC` (its write or close; before: `EIO`, the cause only in the
/// log), the bucket holding no byte a failed call was given, and once space is freed every journal line is
/// whole (before: the line the full disk cut stayed, the next record was glued to it, and a
/// crash during that upload left it open in the bucket for good).
#[test]
fn a_full_state_disk_fails_with_enospc_and_leaves_the_journal_whole() {
    let disk = SmallDisk::new(1).expect("this test mounts a tmpfs (run as root)");
    let b = s3().new_bucket("state-full");
    let state = disk.path().join("state");
    let m = MountSpec::s3(&b, "")
        .arg("--state-dir")
        .arg(state.to_str().unwrap())
        .arg("--part-size")
        .arg("5M")
        .mount();
    let journal = state.join("journal");
    // Every free block taken: the journal grows within its last page, then a line is cut.
    let filler = disk.path().join("filler");
    let mut f = File::create(&filler).unwrap();
    while f.write_all(&[0u8; 4096]).is_ok() {}
    drop(f);
    let data = pattern::bytes(9, 6 << 20);
    let mut failed = None;
    for i in 0..60 {
        let name = format!("big{i}");
        let stored = File::create(m.join(&name))
            .and_then(|mut f| f.write_all(&data).map(|()| f))
            .and_then(close_checked);
        if let Err(e) = stored {
            failed = Some((name, e));
            break;
        }
    }
    let (name, e) = failed.expect("no close failed on a full state disk");
    assert_eq!(
        e.raw_os_error(),
        Some(libc::ENOSPC),
        "{e}; log:\n{}",
        m.log()
    );
    // What the bucket holds is what the writes that succeeded wrote (the write of the
    // part the journal could not record failed; the close stored the bytes before it).
    let kept = s3().get(&b, &name).unwrap_or_default();
    assert!(
        data.starts_with(&kept),
        "{name}: {} bytes, not written so",
        kept.len()
    );
    fs::remove_file(&filler).unwrap();
    write_file(&m.join("after"), &data);
    assert!(s3().get(&b, "after").unwrap() == data);
    for entry in fs::read_dir(&journal).unwrap() {
        let text = fs::read_to_string(entry.unwrap().path()).unwrap();
        for line in text.lines() {
            let f: Vec<&str> = line.split(' ').collect();
            let whole = match f[0] {
                "s" | "-" | "t" | "d" => f.len() == 2,
                "+" => f.len() == 3,
                _ => false,
            } && f[1..].iter().all(|h| hex_ok(h));
            assert!(whole, "a torn journal line {line:?}");
        }
    }
    drop(m);
}

/// A write over bytes already staged, which the full cache disk cuts midway: the bytes the
/// staging file took replaced the old ones, so the write is a short one of that count (or
/// fails with nothing changed), and the file and the bucket hold exactly that. Before, the
/// write failed with `ENOSPC` while its first 512 KiB had replaced the old bytes, and the
/// `fsync` that followed stored them.
#[test]
fn a_write_the_full_cache_disk_cuts_is_a_short_write_of_what_it_took() {
    use std::os::unix::fs::FileExt;
    const MIB: u64 = 1 << 20;
    let disk = SmallDisk::new(48).expect("this test mounts a tmpfs (run as root)");
    let b = s3().new_bucket("cache-cut");
    let m = MountSpec::s3(&b, "")
        .arg("--cache-dir")
        .arg(disk.path().to_str().unwrap())
        .mount();
    let f = File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(m.join("f"))
        .unwrap();
    f.set_len(400 * MIB).unwrap();
    // 1 MiB of 'a' in the middle of each 8 MiB until the cache disk is full.
    let a = vec![b'a'; MIB as usize];
    let mut parts = 0;
    while parts < 50 && f.write_at(&a, parts * 8 * MIB + 4 * MIB).is_ok() {
        parts += 1;
    }
    assert!(parts < 50, "the 48 MiB cache disk never filled");
    // Half over staged 'a's (no new space needed), half over a hole.
    let at = 4 * MIB + MIB / 2;
    let z = vec![b'Z'; MIB as usize];
    let took = match f.write_at(&z, at) {
        Ok(n) => n,
        Err(e) => {
            assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "{e}");
            0
        }
    };
    let mut want = vec![b'a'; MIB as usize / 2];
    want.extend(vec![0u8; MIB as usize / 2]);
    want[..took].fill(b'Z');
    let mut got = vec![0u8; MIB as usize];
    f.read_exact_at(&mut got, at).unwrap();
    let zs = |v: &[u8]| v.iter().filter(|&&c| c == b'Z').count();
    assert!(
        got == want,
        "the write returned {took}; the file holds {} 'Z's there",
        zs(&got)
    );
    f.sync_all().unwrap();
    drop(f);
    let stored = s3().get(&b, "f").unwrap();
    let stored = &stored[at as usize..(at + MIB) as usize];
    assert!(
        stored == want.as_slice(),
        "the write returned {took}; the bucket holds {} 'Z's there",
        zs(stored)
    );
    drop(m);
}

fn hex_ok(s: &str) -> bool {
    !s.is_empty() && s.len().is_multiple_of(2) && s.bytes().all(|c| c.is_ascii_hexdigit())
}

/// One disk under both the server and the mount's staging files fills up while six files are
/// written: part uploads fail (the server is full) and their bytes cannot go to the staging
/// file either. Every write and close returns (ENOSPC or EIO) in bounded time, no partial
/// object appears, and the mount works again once space is freed.
#[test]
fn a_disk_full_under_the_server_and_the_staging_files_fails_writers_without_hanging() {
    let disk = match SmallDisk::new(112) {
        Ok(d) => d,
        Err(e) => panic!("this test needs to mount a tmpfs (run as root): {e}"),
    };
    let data = disk.path().join("data");
    let cache = disk.path().join("cache");
    fs::create_dir(&data).unwrap();
    fs::create_dir(&cache).unwrap();
    let minio = PrivateMinio::start(&data, None);
    let s3p = minio.client(None);
    let b = "fulldisk";
    s3p.create_bucket(b);
    let mut spec = minio.mount_spec(b);
    for a in ["--max-memory", "32M", "--retry-timeout", "5", "--cache-dir"] {
        spec = spec.arg(a);
    }
    let m = spec.arg(cache.to_str().unwrap()).mount();
    const FILES: usize = 6;
    const MIB_EACH: usize = 40;
    let (tx, rx) = std::sync::mpsc::channel();
    let mut writers = Vec::new();
    for i in 0..FILES {
        let path = m.join(format!("f{i}.bin"));
        let tx = tx.clone();
        writers.push(std::thread::spawn(move || {
            // Writers in processes of their own (see ForeignWriter).
            let mut w = ForeignWriter::start();
            w.open("f", &path);
            let wrote = w.cmd(&format!("fill f {MIB_EACH}"));
            let closed = w.cmd("close f");
            let _ = tx.send((i, wrote, closed));
        }));
    }
    drop(tx);
    let deadline = Instant::now() + Duration::from_secs(150);
    let mut outcomes = Vec::new();
    while outcomes.len() < FILES {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(o) => outcomes.push(o),
            Err(_) => panic!(
                "writers hung: {} of {FILES} returned ({outcomes:?}); log:\n{}",
                outcomes.len(),
                m.log()
            ),
        }
    }
    for w in writers {
        w.join().unwrap();
    }
    eprintln!("outcomes: {outcomes:?}");
    let failed =
        |s: &str| s == format!("errno {}", libc::ENOSPC) || s == format!("errno {}", libc::EIO);
    assert!(
        outcomes.iter().any(|(_, w, c)| failed(w) || failed(c)),
        "{FILES} x {MIB_EACH} MiB fit on a 112 MiB disk? {outcomes:?}"
    );
    // A stored file holds exactly what its writes were acknowledged for: all of it when they
    // all were; after a write's ENOSPC, the whole 1 MiB writes before it (as a local disk
    // file would). A file whose close failed is absent.
    let block = writer_block();
    for (i, wrote, closed) in &outcomes {
        let key = format!("f{i}.bin");
        match s3p.get(b, &key) {
            Some(body) => {
                assert_eq!(closed, "ok", "{key}: stored, but its close said {closed}");
                if wrote == "ok" {
                    assert_eq!(body.len(), MIB_EACH * MIB, "{key}: partial object");
                }
                assert!(
                    body.len() % MIB == 0 && body.len() <= MIB_EACH * MIB,
                    "{key}: {} bytes",
                    body.len()
                );
                assert!(
                    body.chunks(MIB).all(|c| c == block.as_slice()),
                    "{key}: bytes differ"
                );
            }
            None => assert!(closed != "ok", "{key}: close said ok, object absent"),
        }
    }
    // Space freed, the mount works again.
    for (i, ..) in &outcomes {
        let _ = fs::remove_file(m.join(format!("f{i}.bin")));
    }
    wait_until_writable(&m, "small.txt");
    assert_eq!(s3p.get(b, "small.txt").unwrap(), b"room again");
    drop(m);
}

/// Writes `room again` to `name` on `m`, retrying while the store still refuses (its outage
/// breaker lets a probe through every second).
fn wait_until_writable(m: &Mount, name: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let write = || -> std::io::Result<()> {
        let mut f = File::create(m.join(name))?;
        f.write_all(b"room again")?;
        // fsync publishes and says how that went (a dropped File hides its close's error).
        f.sync_all()
    };
    while write().is_err() {
        assert!(Instant::now() < deadline, "no recovery; log:\n{}", m.log());
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// Fills the file system holding `dir` with a file in it, up to `leave` bytes of free space;
/// returns that file's path.
fn fill_disk(dir: &Path, leave: u64) -> std::path::PathBuf {
    let ballast = dir.join("ballast");
    let mut f = File::create(&ballast).unwrap();
    let block = vec![0xa5u8; MIB];
    // SAFETY: statvfs fills the struct it is given.
    let free = unsafe {
        let mut st: libc::statvfs = std::mem::zeroed();
        let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).unwrap();
        assert_eq!(libc::statvfs(c.as_ptr(), &mut st), 0);
        st.f_bavail * st.f_frsize
    };
    let mut left = free.saturating_sub(leave);
    while left > 0 {
        let n = left.min(MIB as u64) as usize;
        left -= n as u64;
        match f.write(&block[..n]) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
            Err(e) => panic!("fill {}: {e}", dir.display()),
        }
    }
    ballast
}

/// The server refuses every part (its disk is full) and the staging disk is full too, so the
/// failed parts' bytes can only stay in memory until the close; then staging space comes
/// back and the writer goes on. Such parts are lasting memory, held within half the budget,
/// so the parts written next still get memory: every write returns, and the close fails
/// with the store's error instead of storing a partial object.
#[test]
fn failed_parts_kept_in_memory_never_hang_their_writer() {
    let server_disk = SmallDisk::new(128).expect("this test mounts a tmpfs (run as root)");
    let staging_disk = SmallDisk::new(16).expect("this test mounts a tmpfs (run as root)");
    let data = server_disk.path().join("data");
    fs::create_dir(&data).unwrap();
    let minio = PrivateMinio::start(&data, None);
    let s3p = minio.client(None);
    let b = "keptparts";
    s3p.create_bucket(b);
    let mut spec = minio.mount_spec(b);
    for a in ["--max-memory", "32M", "--retry-timeout", "5", "--cache-dir"] {
        spec = spec.arg(a);
    }
    let m = spec.arg(staging_disk.path().to_str().unwrap()).mount();
    // Room for the upload's metadata, not for its parts (MinIO keeps a free-space reserve).
    let server_ballast = fill_disk(server_disk.path(), 4 << 20);
    let staging_ballast = fill_disk(staging_disk.path(), 0);

    let (tx, rx) = std::sync::mpsc::channel::<(&str, String)>();
    let path = m.join("f.bin");
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let writer = std::thread::spawn(move || {
        // A process of its own (see ForeignWriter).
        let mut w = ForeignWriter::start();
        w.open("f", &path);
        // Whole parts in memory, each refused by the server, none stageable.
        let _ = tx.send(("first", w.cmd("fill f 32")));
        go_rx.recv().unwrap();
        let _ = tx.send(("second", w.cmd("fill f 16")));
        let _ = tx.send(("close", w.cmd("close f")));
    });
    let limit = Duration::from_secs(60);
    let mut said = Vec::new();
    let next = |said: &mut Vec<(&str, String)>| match rx.recv_timeout(limit) {
        Ok(o) => said.push(o),
        Err(_) => panic!("the writer hung after {said:?}; log:\n{}", m.log()),
    };
    next(&mut said);
    // The refused parts have settled (their bytes are in memory now).
    std::thread::sleep(Duration::from_secs(2));
    fs::remove_file(&staging_ballast).unwrap();
    go_tx.send(()).unwrap();
    next(&mut said);
    next(&mut said);
    writer.join().unwrap();
    eprintln!("{said:?}");
    let closed = &said[2].1;
    assert!(closed != "ok", "close said ok on a full server: {said:?}");
    assert!(s3p.head(b, "f.bin").is_none(), "partial object stored");
    // The server gets room: the mount writes again.
    fs::remove_file(&server_ballast).unwrap();
    wait_until_writable(&m, "small.txt");
    assert_eq!(s3p.get(b, "small.txt").unwrap(), b"room again");
    drop(m);
}

/// Bytes the disk under `dir` has in use.
fn used_bytes(dir: &Path) -> u64 {
    let c = std::ffi::CString::new(dir.to_str().unwrap()).unwrap();
    // SAFETY: statvfs fills the struct it is given.
    unsafe {
        let mut st: libc::statvfs = std::mem::zeroed();
        assert_eq!(libc::statvfs(c.as_ptr(), &mut st), 0);
        (st.f_blocks - st.f_bfree) * st.f_frsize
    }
}

/// A sequential write bigger than the room `--cache-dir` has above `--cache-min-free` keeps
/// local copies of its first parts only: the staging disk never goes below the floor (before,
/// the copy of every streamed part filled it), the first part still reads back before close,
/// a part without a copy gives EIO, and the close stores every byte.
#[test]
fn a_large_write_leaves_cache_min_free_on_the_staging_disk() {
    let staging_disk = SmallDisk::new(64).expect("this test mounts a tmpfs (run as root)");
    let b = s3().new_bucket("minfree");
    let m = MountSpec::s3(&b, "")
        .arg("--cache-dir")
        .arg(staging_disk.path().to_str().unwrap())
        .arg("--cache-min-free")
        .arg("44M")
        .mount();
    let part = 8usize << 20;
    let data: Vec<u8> = (0..8 * part).map(|i| (i * 7 + i / 4099) as u8).collect();
    let path = m.join("big.bin");
    let mut f = File::create(&path).unwrap();
    let mut peak = 0;
    for chunk in data.chunks(1 << 20) {
        f.write_all(chunk).unwrap();
        peak = peak.max(used_bytes(staging_disk.path()));
    }
    // The copies still being made finish within this.
    std::thread::sleep(Duration::from_millis(500));
    peak = peak.max(used_bytes(staging_disk.path()));
    // 64 MiB disk, 44 MiB kept free: at most 20 MiB of copies (two parts and a bit).
    assert!(
        peak <= 26 << 20,
        "the staging disk held {} MiB of copies for a 64 MiB write",
        peak >> 20
    );
    // Reads reach the daemon, not pages the write left in the page cache.
    let r = File::open(&path).unwrap();
    unsafe {
        libc::posix_fadvise(
            std::os::fd::AsRawFd::as_raw_fd(&r),
            0,
            0,
            libc::POSIX_FADV_DONTNEED,
        )
    };
    let mut head = vec![0u8; 4096];
    std::os::unix::fs::FileExt::read_exact_at(&r, &mut head, 100).unwrap();
    assert_eq!(
        head,
        data[100..100 + 4096],
        "the first part reads back before close"
    );
    let mut mid = vec![0u8; 4096];
    let e = std::os::unix::fs::FileExt::read_exact_at(&r, &mut mid, 6 * part as u64)
        .expect_err("a part with no local copy reads before close");
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    drop(r);
    drop(f);
    assert!(
        s3().get(&b, "big.bin").unwrap() == data,
        "stored bytes differ"
    );
    assert!(
        m.log().contains("--cache-min-free"),
        "no log line says why: {}",
        m.log()
    );
    // After close the file reads whole again (from the object).
    assert!(fs::read(&path).unwrap() == data);
    drop(m);
}

// ---------------------------------------------------------------------------------------------

/// Closing a file written big enough to stream leaves its staging file to be freed, which
/// takes the disk about 0.2 s a GiB here (a virtual disk's discard). The release of the last
/// descriptor is answered first: an unmount right after the close finds no request of the
/// close still unanswered (before, the kernel had ended the release by then and the daemon
/// logged "Failed to send FUSE reply"), and the object is whole.
#[test]
fn a_big_files_release_is_answered_before_its_staging_file_is_freed() {
    let b = s3().new_bucket("relbig");
    let m = MountSpec::s3(&b, "").mount();
    let path = m.join("big.bin");
    let mut f = File::create(&path).unwrap();
    let chunk = vec![0x5au8; 1 << 20];
    for _ in 0..768 {
        f.write_all(&chunk).unwrap();
    }
    f.sync_all().unwrap();
    drop(f);
    let (status, log) = m.unmount();
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
    assert!(
        !log.contains("Failed to send FUSE reply"),
        "a request of the close was still unanswered at the unmount: {log}"
    );
    assert_eq!(
        s3().head(&b, "big.bin").map(|h| h.size),
        Some(768 << 20),
        "the object is whole"
    );
    s3().delete(&b, "big.bin");
}
// Security
// ---------------------------------------------------------------------------------------------

/// Runs `cmd args` as the unprivileged user 65534; returns (success, stderr).
fn as_nobody(cmd: &str, args: &[&Path]) -> (bool, String) {
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", cmd])
        .args(args)
        .output()
        .expect("setpriv");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The mount point lives in 0700 temp dirs (the harness's, scripts/test.sh's): give others
/// search permission (o+x, no listing) on each ancestor so only the mount itself decides.
fn let_other_users_reach(mountpoint: &Path) {
    use std::os::unix::fs::PermissionsExt;
    for dir in mountpoint.ancestors().skip(1) {
        let Ok(md) = fs::metadata(dir) else { continue };
        let mode = md.permissions().mode();
        if mode & 0o001 == 0 {
            fs::set_permissions(dir, fs::Permissions::from_mode((mode | 0o001) & 0o7777)).unwrap();
        }
    }
}

#[test]
fn the_mount_is_private_unless_allow_other_and_modes_are_enforced() {
    // SAFETY: getuid cannot fail.
    if unsafe { libc::getuid() } != 0 {
        panic!("this test switches to another user and needs root (as scripts/test.sh runs)");
    }
    let s3 = s3();
    let b = s3.new_bucket("private");
    s3.put_with_meta(&b, "secret", "s3cr3t", &[("mode", "33152"), ("uid", "0")]); // 0600
    s3.put_with_meta(&b, "public", "hello", &[("mode", "33188"), ("uid", "0")]); // 0644
    let m = Mount::s3(&b);
    let_other_users_reach(m.path());
    let (ok, err) = as_nobody("stat", &[m.path()]);
    assert!(!ok && err.contains("Permission denied"), "{err}");
    let (ok, _) = as_nobody("cat", &[&m.join("public")]);
    assert!(!ok, "another user read through a private mount");
    drop(m);

    let m = MountSpec::s3(&b, "").arg("--allow-other").mount();
    let_other_users_reach(m.path());
    let (ok, err) = as_nobody("cat", &[&m.join("public")]);
    assert!(ok, "allow_other: a 0644 file must be readable: {err}");
    let (ok, err) = as_nobody("cat", &[&m.join("secret")]);
    assert!(
        !ok && err.contains("Permission denied"),
        "a 0600 file of root read by another user: {err}"
    );
    let (ok, err) = as_nobody("touch", &[&m.join("new")]);
    assert!(
        !ok && err.contains("Permission denied"),
        "another user created a file in a 0755 root directory: {err}"
    );
    assert!(s3.head(&b, "new").is_none());
    // Root itself still can.
    assert_eq!(read_file(&m.join("secret")), b"s3cr3t");
}

#[test]
fn credentials_never_appear_in_logs_errors_or_the_command_line() {
    let s3 = s3();
    let e = env();
    let b = s3.new_bucket("nosecret");
    let mut spec = MountSpec::s3(&b, "").arg("--log-level").arg("debug");
    spec.envs.push(("RUST_LOG".into(), String::new())); // let --log-level decide
    let m = spec.mount();
    write_file(&m.join("f"), b"x");
    let _ = fs::metadata(m.join("missing"));
    let pid = m.daemon_pid().unwrap();
    let cmdline = fs::read(format!("/proc/{pid}/cmdline")).unwrap();
    assert!(
        !String::from_utf8_lossy(&cmdline).contains(&e.secret_key),
        "secret on the command line"
    );
    let (_, log) = m.unmount();
    assert!(log.contains("DEBUG"), "no debug lines logged: {log}");
    assert!(!log.contains(&e.secret_key), "secret key in the debug log");

    // Wrong credentials: the error names the problem, not the secret.
    let (d, mp) = {
        let d = tempfile::tempdir().unwrap();
        let mp = d.path().join("mnt");
        fs::create_dir(&mp).unwrap();
        (d, mp)
    };
    let wrong = "WRONGsecretWRONGsecret1234";
    let mut args = os(&["mount", &format!("s3://{b}")]);
    args.push(mp.clone().into_os_string());
    args.extend(s3_args().into_iter().map(OsString::from));
    args.push("--log-file".into());
    args.push(d.path().join("d.log").into_os_string());
    let run = run_cli(
        &args,
        &[
            ("AWS_ACCESS_KEY_ID", e.access_key.as_str()),
            ("AWS_SECRET_ACCESS_KEY", wrong),
        ],
        Some(&mp),
        Duration::from_secs(60),
    );
    assert!(!run.status.unwrap().success());
    assert!(!run.stderr.contains(wrong) && !run.stdout.contains(wrong));
    let dlog = fs::read_to_string(d.path().join("d.log")).unwrap_or_default();
    assert!(!dlog.contains(wrong));

    // Credentials as options are refused without echoing them.
    for opt in [
        format!("secret_access_key={wrong}"),
        format!("access_key_id=AKIA,secret_access_key={wrong}"),
    ] {
        let mut a = args.clone();
        a.push("-o".into());
        a.push(opt.into());
        let run = run_cli(&a, &[], Some(&mp), Duration::from_secs(30));
        assert!(!run.status.unwrap().success(), "{run:?}");
        assert!(
            run.stderr.contains("not accepted on the command line"),
            "{run:?}"
        );
        assert!(!run.stderr.contains(wrong), "{run:?}");
    }
    let mut a = args.clone();
    a.push(format!("--secret-access-key={wrong}").into());
    let run = run_cli(&a, &[], Some(&mp), Duration::from_secs(30));
    assert!(!run.status.unwrap().success());
    assert!(!run.stderr.contains(wrong), "{run:?}");

    // A config file holding credentials that others can read is refused (like s3fs).
    let cfg = d.path().join("creds.toml");
    fs::write(
        &cfg,
        format!(
            "access_key_id = \"{}\"\nsecret_access_key = \"{wrong}\"\n",
            e.access_key
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    for mode in [0o644, 0o640, 0o604] {
        fs::set_permissions(&cfg, fs::Permissions::from_mode(mode)).unwrap();
        let mut a = args.clone();
        a.push("-c".into());
        a.push(cfg.clone().into_os_string());
        let run = run_cli(&a, &[], Some(&mp), Duration::from_secs(30));
        assert!(!run.status.unwrap().success());
        assert!(
            run.stderr
                .contains("holds credentials but is readable or writable by group or others"),
            "mode {mode:o}: {run:?}"
        );
        assert!(!run.stderr.contains(wrong));
    }
    assert!(!is_mounted(&mp));
}

// ---------------------------------------------------------------------------------------------
// HTTPS
// ---------------------------------------------------------------------------------------------

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .expect("openssl");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA and a server certificate for 127.0.0.1 signed by it, in `dir`: `ca.pem`, and
/// `certs/public.crt` + `certs/private.key` (MinIO's layout).
fn make_ca(dir: &Path, name: &str) {
    fs::create_dir_all(dir.join("certs")).unwrap();
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            &format!("/CN={name} test CA"),
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
        ],
    );
    fs::write(
        dir.join("ext.cnf"),
        "basicConstraints=CA:FALSE\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n\
         keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n",
    )
    .unwrap();
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=127.0.0.1",
            "-keyout",
            "certs/private.key",
            "-out",
            "server.csr",
        ],
    );
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            "ext.cnf",
            "-out",
            "certs/public.crt",
        ],
    );
}

#[test]
fn https_is_verified_with_a_custom_ca_bundle_and_no_verify_is_explicit() {
    let dir = tempfile::tempdir().unwrap();
    make_ca(dir.path(), "bucketfs");
    let other = dir.path().join("other");
    make_ca(&other, "stranger");
    let data = dir.path().join("data");
    fs::create_dir(&data).unwrap();
    let minio = PrivateMinio::start(&data, Some(&dir.path().join("certs")));
    let ca = fs::read(dir.path().join("ca.pem")).unwrap();
    let s3p = minio.client(Some(&ca));
    let b = "tls";
    s3p.create_bucket(b);
    s3p.put(b, "hello.txt", "over https");
    let e = env();
    let creds = [
        ("AWS_ACCESS_KEY_ID", e.access_key.as_str()),
        ("AWS_SECRET_ACCESS_KEY", e.secret_key.as_str()),
    ];

    // Default: the system roots do not know this CA, so the mount fails fast and says why.
    let try_mount = |extra: &[&str]| {
        let d = tempfile::tempdir().unwrap();
        let mp = d.path().join("mnt");
        fs::create_dir(&mp).unwrap();
        let mut args = os(&["mount", "s3://tls"]);
        args.push(mp.clone().into_os_string());
        for a in [
            "--endpoint-url",
            &minio.endpoint(),
            "--force-path-style",
            "--region",
            "us-east-1",
        ] {
            args.push(a.into());
        }
        args.push("--log-file".into());
        args.push(d.path().join("d.log").into_os_string());
        args.extend(extra.iter().map(OsString::from));
        let run = run_cli(&args, &creds, Some(&mp), Duration::from_secs(60));
        (run, mp, d)
    };
    let (run, mp, _d) = try_mount(&[]);
    assert!(!run.status.unwrap().success(), "{run:?}");
    assert!(
        run.stderr.contains("not trusted") && run.stderr.contains("--ca-bundle"),
        "{run:?}"
    );
    assert!(
        run.elapsed < Duration::from_secs(20),
        "took {:?}",
        run.elapsed
    );
    assert!(!is_mounted(&mp));
    // A bundle of another CA does not help either.
    let other_ca = other.join("ca.pem");
    let (run, _, _d) = try_mount(&["--ca-bundle", other_ca.to_str().unwrap()]);
    assert!(!run.status.unwrap().success(), "{run:?}");
    assert!(run.stderr.contains("not trusted"), "{run:?}");
    // A file that is not a bundle is refused before anything starts.
    let junk = dir.path().join("ext.cnf");
    let (run, _, _d) = try_mount(&["--ca-bundle", junk.to_str().unwrap()]);
    assert!(run.stderr.contains("no certificate in it"), "{run:?}");

    // With the right bundle it mounts and works.
    let ca_path = dir.path().join("ca.pem");
    let m = minio
        .mount_spec(b)
        .arg("--ca-bundle")
        .arg(ca_path.to_str().unwrap())
        .mount();
    assert_eq!(read_file(&m.join("hello.txt")), b"over https");
    write_file(&m.join("back.txt"), b"written over https");
    assert_eq!(s3p.get(b, "back.txt").unwrap(), b"written over https");
    drop(m);

    // --no-verify-ssl works, but only when asked for, and with a warning.
    let m = minio.mount_spec(b).arg("--no-verify-ssl").mount();
    assert_eq!(read_file(&m.join("back.txt")), b"written over https");
    assert!(
        m.log().contains("warning: --no-verify-ssl"),
        "no warning: {}",
        m.log()
    );
    drop(m);
}
