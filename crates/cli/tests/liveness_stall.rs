//! A stalled store (it accepts connections, reads requests and never answers) gives every
//! syscall an error within `--retry-timeout` plus a small margin, calls fail fast while the
//! outage lasts, and once the store answers again everything works with exact data: no
//! partial object, a written file complete after a retried close, or absent. A slow link
//! that keeps moving bytes is no stall: nothing fails and lookups are still answered.
//!
//! The stall comes from the test proxy between the mount and MinIO, switched at runtime.
//! Every timed syscall runs on a thread of its own with a limit, so a regression fails the
//! test instead of hanging the suite (the mount's drop guard then unmounts it).

mod common;

use common::proxy::FaultProxy;
use common::*;
use std::fs::{self, File};
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// `--retry-timeout` of these mounts.
const T: Duration = Duration::from_secs(5);
/// What a syscall may take beyond `T`: the stated margin (1 s) plus room for a loaded
/// machine.
const SLACK: Duration = Duration::from_millis(2500);
/// A call that "fails fast" while the outage lasts.
const FAST: Duration = Duration::from_millis(1000);
/// Past this a call is taken for hung (the old code took 30 s and more).
const GUARD: Duration = Duration::from_secs(60);

fn mount_via(bucket: &str, proxy: &FaultProxy) -> Mount {
    let mut spec = via_proxy(bucket, proxy);
    spec.args
        .extend(["--retry-timeout".into(), format!("{}", T.as_secs())]);
    spec.watchdog(Duration::from_secs(300)).mount()
}

/// Runs `f` on a thread of its own; panics if it takes longer than [`GUARD`].
fn timed<R: Send + 'static>(what: &str, f: impl FnOnce() -> R + Send + 'static) -> (R, Duration) {
    let (tx, rx) = mpsc::channel();
    let t = Instant::now();
    std::thread::spawn(move || {
        let r = f();
        let _ = tx.send(r);
    });
    match rx.recv_timeout(GUARD) {
        Ok(r) => (r, t.elapsed()),
        Err(_) => panic!("{what}: no answer after {GUARD:?} (hung)"),
    }
}

/// A call made while the store stalls: it fails within `T` + margin.
fn bounded<R: Send + 'static>(
    what: &str,
    f: impl FnOnce() -> std::io::Result<R> + Send + 'static,
) -> (std::io::Result<R>, Duration) {
    let (r, took) = timed(what, f);
    eprintln!("{what}: {:?} after {took:.2?}", r.as_ref().err());
    assert!(
        took <= T + SLACK,
        "{what} took {took:?} (bound {T:?} + margin)"
    );
    (r, took)
}

/// A call made while the outage is known: it fails at once.
fn fast<R: Send + std::fmt::Debug + 'static>(
    what: &str,
    f: impl FnOnce() -> std::io::Result<R> + Send + 'static,
) -> Duration {
    let (r, took) = timed(what, f);
    eprintln!(
        "{what} (outage known): {:?} after {took:.2?}",
        r.as_ref().err()
    );
    assert!(r.is_err(), "{what} succeeded while the store stalls: {r:?}");
    assert!(
        took <= FAST,
        "{what} took {took:?} while the outage is known"
    );
    took
}

/// Waits until the mount gets answers again: a lookup of a fresh name says ENOENT.
fn wait_for_recovery(m: &Mount, tag: &str) -> Duration {
    let t = Instant::now();
    for i in 0.. {
        let p = m.join(format!("probe-{tag}-{i}"));
        let (r, _) = timed("recovery probe", move || fs::metadata(p));
        if r.as_ref().err().and_then(|e| e.raw_os_error()) == Some(libc::ENOENT) {
            return t.elapsed();
        }
        assert!(t.elapsed() < Duration::from_secs(30), "no recovery: {r:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
    unreachable!()
}

fn eio<R: std::fmt::Debug>(what: &str, r: &std::io::Result<R>) {
    let e = r.as_ref().err().and_then(|e| e.raw_os_error());
    assert_eq!(e, Some(libc::EIO), "{what}: {r:?}");
}

#[test]
fn a_stall_mid_read_fails_the_read_in_bounded_time_then_reads_are_exact() {
    let s3 = s3();
    let b = s3.new_bucket("stallread");
    const LEN: u64 = 96 * MIB as u64;
    s3.put(&b, "big.bin", pattern::bytes(11, LEN as usize));
    s3.put(&b, "dir/x", b"x".to_vec());
    let proxy = FaultProxy::start(&minio_addr());
    let m = mount_via(&b, &proxy);

    let mut f = File::open(m.join("big.bin")).unwrap();
    let mut buf = vec![0u8; MIB];
    for _ in 0..8 {
        f.read_exact(&mut buf).unwrap();
    }
    proxy.stall(true);
    let stalled = Instant::now();
    // Read on: prefetched bytes still come, then one read fails within the bound.
    let mut pos = 8 * MIB as u64;
    let first_error = loop {
        let (r, _) = bounded("read", move || {
            let mut buf = vec![0u8; MIB];
            let r = f.read(&mut buf);
            r.map(|n| (f, n))
        });
        match r {
            Ok((file, n)) => {
                assert!(n > 0);
                f = file;
                pos += n as u64;
                assert!(pos < LEN, "the whole file came through a stalled store");
            }
            Err(e) => break e,
        }
    };
    let took = stalled.elapsed();
    eprintln!("first read error {took:.2?} after the stall began, at byte {pos}: {first_error}");
    assert_eq!(first_error.raw_os_error(), Some(libc::EIO));
    assert!(
        took <= T + SLACK,
        "the read failed {took:?} after the stall began"
    );

    // While it lasts, reads elsewhere (what the kernel's readahead re-reads do), stat and
    // ls fail at once instead of starting a new wait each.
    let path = m.join("big.bin");
    for i in 0..4u64 {
        let p = path.clone();
        fast("read", move || {
            let f = File::open(&p)?;
            let mut buf = vec![0u8; 4096];
            f.read_at(&mut buf, 40 * MIB as u64 + i * 8 * MIB as u64)
        });
    }
    let p = m.join("dir");
    fast("ls", move || fs::read_dir(p).map(|d| d.count()));

    proxy.stall(false);
    let back = wait_for_recovery(&m, "read");
    eprintln!("answers again {back:.2?} after the stall ended");
    let p = m.join("big.bin");
    let (r, took) = timed("read after the stall", move || {
        let mut f = File::open(p)?;
        pattern::check_reader(&mut f, 11, LEN).map_err(std::io::Error::other)
    });
    r.unwrap();
    eprintln!("whole file read back exact in {took:.2?}");
}

#[test]
fn a_stall_mid_write_fails_fsync_in_bounded_time_and_close_completes_after() {
    let s3 = s3();
    let b = s3.new_bucket("stallwrite");
    const LEN: u64 = 100 * MIB as u64;
    let proxy = FaultProxy::start(&minio_addr());
    let m = mount_via(&b, &proxy);

    let mut f = File::create(m.join("big.bin")).unwrap();
    let mut i = 0u64;
    while i < 40 {
        f.write_all(&pattern::block(12, i)).unwrap();
        i += 1;
    }
    proxy.stall(true);
    let stalled = Instant::now();
    // The rest of the writes: each returns in bounded time (they may wait for memory held
    // by parts on their way, never longer than the bound).
    let mut slowest = Duration::ZERO;
    while i < LEN / MIB as u64 {
        let block = pattern::block(12, i);
        let start = Instant::now();
        let (r, took) = timed("write", move || f.write_all(&block).map(|()| f));
        f = r.expect("write() fails only at fsync/close");
        // Parts still send their bodies into the stall: the bound runs from the last byte.
        let from = proxy.last_swallowed().map_or(start, |l| l.max(start));
        let after_last = took.saturating_sub(from - start);
        assert!(
            after_last <= T + SLACK,
            "write took {took:?}, {after_last:?} after the last byte"
        );
        slowest = slowest.max(after_last);
        i += 1;
    }
    eprintln!(
        "60 writes during the stall: slowest {slowest:.2?} after the last byte moved, all in {:.2?}",
        stalled.elapsed()
    );
    // The parts on their way still send their bodies into the stalled store (bytes moving
    // are progress); the bound runs from the last of them.
    let mut seen = proxy.swallowed();
    loop {
        std::thread::sleep(Duration::from_millis(300));
        let now = proxy.swallowed();
        if now == seen {
            break;
        }
        seen = now;
        assert!(stalled.elapsed() < GUARD, "bytes still moving");
    }
    eprintln!(
        "{} MiB of request bodies swallowed by the stall, the last {:.2?} after it began",
        seen >> 20,
        stalled.elapsed()
    );
    // fsync sends the parts that failed again, into the stall too: its bound runs from the
    // later of its start and the last byte it sent.
    let start = Instant::now();
    let (r, took) = timed("fsync", move || {
        let r = f.sync_all();
        (f, r)
    });
    let (f, r) = r;
    let from = proxy.last_swallowed().map_or(start, |l| l.max(start));
    let bound_took = took.saturating_sub(from - start);
    eprintln!(
        "fsync: {r:?} after {took:.2?}, {bound_took:.2?} after its last byte moved ({} MiB \
         swallowed in all)",
        proxy.swallowed() >> 20
    );
    assert!(
        bound_took <= T + SLACK,
        "fsync took {bound_took:?} after its last byte"
    );
    eio("fsync during the stall", &r);
    let (r, took) = timed("fsync", move || {
        let r = f.sync_all();
        (f, r)
    });
    let (f, r) = r;
    eprintln!("second fsync (outage known): {r:?} after {took:.2?}");
    eio("second fsync", &r);
    assert!(took <= FAST, "second fsync took {took:?}");
    // Nothing partial is visible.
    assert!(s3.head(&b, "big.bin").is_none(), "a partial object");

    // Once the store answers, close sends what the failed fsync could not: all of it.
    proxy.stall(false);
    wait_for_recovery(&m, "write");
    let (r, took) = timed("close after the stall", move || close_checked(f));
    r.expect("close after the stall");
    eprintln!("close after the stall: ok in {took:.2?}");
    let body = s3.get(&b, "big.bin").expect("the object after close");
    pattern::check_slice(&body, 12, LEN).unwrap();
    drop(m);
    assert!(s3.list_multipart_uploads(&b).is_empty());
}

#[test]
fn metadata_calls_under_a_stall_fail_in_bounded_time() {
    let s3 = s3();
    let b = s3.new_bucket("stallmeta");
    for d in ["ls1", "ls2", "ls3"] {
        s3.put(&b, &format!("{d}/x"), b"x".to_vec());
    }
    for f in ["st1", "st2", "st3"] {
        s3.put(&b, f, b"abc".to_vec());
    }
    let proxy = FaultProxy::start(&minio_addr());
    let m = mount_via(&b, &proxy);
    let root = m.path().to_path_buf();
    let at = move |n: &str| -> PathBuf { root.join(n) };

    // ls of a directory never listed.
    proxy.stall(true);
    let p = at("ls1");
    let (r, _) = bounded("ls", move || fs::read_dir(p).map(|d| d.count()));
    eio("ls", &r);
    let p = at("ls2");
    fast("ls", move || fs::read_dir(p).map(|d| d.count()));
    proxy.stall(false);
    wait_for_recovery(&m, "ls");
    assert_eq!(list_dir(&at("ls3")), set(["x"]));

    // stat of a name never looked up: EIO, not ENOENT.
    proxy.stall(true);
    let p = at("st1");
    let (r, _) = bounded("stat", move || fs::metadata(p));
    eio("stat", &r);
    let p = at("st2");
    fast("stat", move || fs::metadata(p));
    proxy.stall(false);
    wait_for_recovery(&m, "stat");
    assert_eq!(fs::metadata(at("st3")).unwrap().len(), 3);

    // create + write + close of a new file.
    let create = |p: PathBuf| {
        move || -> std::io::Result<()> {
            let mut f = File::create(p)?;
            f.write_all(&pattern::bytes(13, 4096))?;
            close_checked(f)
        }
    };
    assert_eq!(list_dir(m.path()).len(), 6); // the names are known absent: create needs no lookup
    proxy.stall(true);
    let (r, _) = bounded("create+close", create(at("new1")));
    eio("create+close", &r);
    fast("create+close", create(at("new2")));
    proxy.stall(false);
    wait_for_recovery(&m, "create");
    for n in ["new1", "new2"] {
        if let Some(body) = s3.get(&b, n) {
            pattern::check_slice(&body, 13, 4096).unwrap();
        }
    }
    create(at("new3"))().unwrap();
    pattern::check_slice(&s3.get(&b, "new3").unwrap(), 13, 4096).unwrap();
    drop(m);
    assert!(s3.list_multipart_uploads(&b).is_empty());
}

/// A slow link, not a stalled one: each connection moves 32 KiB/s. 20 readers of 256 KiB
/// files at `--max-connections 16 --retry-timeout 3` keep the 16 slots busy about 8 s each,
/// so 4 GETs queue that long (before: cut after 3 s in the queue, twice, and `EIO`).
/// Meanwhile a stat of a file in a directory never listed (a HEAD and a LIST page) is
/// answered on the spare slots in a few of the link's round trips (before: it queued behind
/// the reads and failed the same way). Every read returns its exact bytes.
#[test]
fn a_slow_link_with_more_reads_than_connections_fails_nothing_and_answers_lookups() {
    let s3 = s3();
    let b = s3.new_bucket("slowlink");
    let files: Vec<Vec<u8>> = (0..20).map(|i| pattern::bytes(i, 256 << 10)).collect();
    for (i, f) in files.iter().enumerate() {
        s3.put(&b, &format!("f{i:02}"), f.clone());
    }
    s3.put(&b, "sub/probe", b"probe".to_vec());
    let proxy = FaultProxy::start(&minio_addr());
    let mut spec = via_proxy(&b, &proxy);
    spec.args.extend(
        ["--retry-timeout", "3", "--max-connections", "16"]
            .iter()
            .map(|s| s.to_string()),
    );
    let m = spec.watchdog(Duration::from_secs(300)).mount();
    // The root's listing at full speed: the reads' lookups need no request.
    assert_eq!(fs::read_dir(m.path()).unwrap().count(), 21);
    proxy.set_bandwidth(32 * 1024);
    let readers: Vec<_> = files
        .iter()
        .enumerate()
        .map(|(i, want)| {
            let (path, want) = (m.join(format!("f{i:02}")), want.clone());
            std::thread::spawn(move || {
                let got = fs::read(&path);
                (
                    got.as_ref().map(|g| g == &want).map_err(|e| e.to_string()),
                    path,
                )
            })
        })
        .collect();
    // Every slot busy with a transfer and GETs queued behind them.
    std::thread::sleep(Duration::from_millis(1500));
    let probe = m.join("sub/probe");
    let (size, took) = timed("stat sub/probe", move || {
        fs::metadata(&probe).map(|md| md.len())
    });
    assert_eq!(
        size.ok(),
        Some(5),
        "the stat during the reads, after {took:?}"
    );
    assert!(
        took < Duration::from_secs(3),
        "the stat waited {took:?} for the transfers"
    );
    for r in readers {
        let (ok, path) = r.join().unwrap();
        assert_eq!(ok, Ok(true), "{}: {}", path.display(), m.log());
    }
}
