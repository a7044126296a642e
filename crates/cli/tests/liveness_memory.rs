//! The memory budget never deadlocks, and it bounds the daemon's memory (issue 18, item 1).
//!
//! * Paused readers whose prefetch fills the budget do not stop another process's `cat`.
//! * One process holding many small files open after reading each does not stop its own next
//!   read, nor anyone else's.
//! * Many concurrent writers keep the daemon's peak RSS within the budget plus the stated
//!   overhead (docs/reliability.md, "Memory").
//!
//! Every operation that could hang runs with a deadline: a hang fails the test, it does not
//! hang the suite (the mount guard's unmount then unblocks the stuck threads).

mod common;

use common::*;
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// A read that takes longer than this counts as hung.
const LIMIT: Duration = Duration::from_secs(10);

/// `cat path` in a process of its own, which must finish within `limit`; its output.
fn cat_within(path: &Path, limit: Duration) -> Result<Vec<u8>, String> {
    let out = std::env::temp_dir().join(format!(
        "bucketfs-cat-{}-{}",
        std::process::id(),
        unique_bucket_name("c")
    ));
    let mut child = Command::new("cat")
        .arg(path)
        .stdout(File::create(&out).unwrap())
        .spawn()
        .unwrap();
    let start = Instant::now();
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            let data = std::fs::read(&out).unwrap_or_default();
            let _ = std::fs::remove_file(&out);
            return if st.success() {
                Ok(data)
            } else {
                Err(format!("cat {} failed: {st}", path.display()))
            };
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            let _ = std::fs::remove_file(&out);
            return Err(format!(
                "cat {} still running after {limit:?}: hung",
                path.display()
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs `f` on a thread of its own; `Err` if it has not finished within `limit` (the thread
/// is left behind, stuck in the mount until the test's unmount unblocks it).
fn within<T: Send + 'static>(
    limit: Duration,
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit)
        .map_err(|_| format!("{what}: not done after {limit:?}: hung"))
}

fn raise_nofile(want: u64) {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit on this process with a valid struct.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut r);
        if r.rlim_cur < want {
            r.rlim_cur = want.min(r.rlim_max);
            libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        }
    }
}

/// Six readers read the start of big files and pause with them open; their prefetch fills
/// the budget. Another process's `cat` of a small file must still finish, and so must the
/// readers' own next reads (each reader's window started over).
#[test]
fn paused_readers_holding_the_budget_do_not_stop_a_cat() {
    const READERS: u64 = 6;
    const FILE: usize = 48 * MIB;
    const READ: usize = 16 * MIB;
    let s3 = s3();
    let b = s3.new_bucket("paused");
    let body = pattern::bytes(7, FILE);
    let mut objects: Vec<(String, Vec<u8>)> = (0..READERS)
        .map(|i| (format!("big{i}"), body.clone()))
        .collect();
    objects.push(("small".into(), b"hello\n".to_vec()));
    s3.put_many(&b, objects, 4);
    drop(body);
    let metrics = free_local_addr();
    let m = MountSpec::s3(&b, "")
        .arg("--max-memory")
        .arg("64M")
        .arg("--metrics-addr")
        .arg(&metrics)
        .watchdog(Duration::from_secs(300))
        .mount();
    let budget = metric(&metrics, "bucketfs_memory_budget_bytes");

    // Each reader reads 16 MiB and keeps its file open: its window has grown well past what
    // the budget can give six readers.
    let mut open = Vec::new();
    for i in 0..READERS {
        let path = m.join(format!("big{i}"));
        let r = within(LIMIT * 3, &format!("reader {i}"), move || {
            let mut f = File::open(&path).unwrap();
            let mut buf = vec![0u8; READ];
            f.read_exact(&mut buf).map(|_| (f, buf))
        });
        let (f, buf) = r.unwrap_or_else(|e| panic!("{e}")).unwrap();
        pattern::check_slice(&buf, 7, READ as u64).unwrap();
        open.push(f);
    }
    // The prefetch settles with the budget (nearly) all taken.
    let start = Instant::now();
    let mut held = 0;
    while start.elapsed() < Duration::from_secs(5) {
        held = metric(&metrics, "bucketfs_buffer_bytes");
        if held + 8 * MIB as u64 >= budget {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        held + 8 * MIB as u64 >= budget,
        "paused readers hold {held} of a {budget}-byte budget: the test needs it full"
    );

    let got = cat_within(&m.join("small"), LIMIT).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(got, b"hello\n");
    // Still within the budget plus its overdraft, and the paused readers read on correctly.
    assert!(metric(&metrics, "bucketfs_buffer_bytes") <= budget + budget / 16 + 4 * MIB as u64);
    for (i, mut f) in open.into_iter().enumerate() {
        let r = within(LIMIT, &format!("reader {i} again"), move || {
            let mut buf = vec![0u8; 2 * MIB];
            f.read_exact(&mut buf).map(|_| buf)
        });
        let buf = r.unwrap_or_else(|e| panic!("{e}")).unwrap();
        let want = &pattern::bytes(7, READ + 2 * MIB)[READ..];
        assert!(buf == want, "reader {i}: wrong bytes after its pause");
    }
    drop(m);
    s3.remove_bucket(&b);
}

/// One process opens many small files and reads each without closing any. Each holds a
/// small file's body (one 64 KiB budget unit); far more files than the budget has units
/// must all read, and meanwhile a `cat` of another file works. 1,500 files at 64M (1,024
/// units) show what 5,000 at 256M (4,096 units) would, in a fifth of the time.
#[test]
fn many_open_small_files_do_not_exhaust_the_budget() {
    const FILES: usize = 1500;
    raise_nofile(FILES as u64 + 256);
    let s3 = s3();
    let b = s3.new_bucket("manysmall");
    let objects: Vec<(String, Vec<u8>)> = (0..FILES)
        .map(|i| (format!("d/f{i:05}"), format!("file {i}\n").into_bytes()))
        .chain([("other".to_string(), b"other\n".to_vec())])
        .collect();
    s3.put_many(&b, objects, 32);
    let metrics = free_local_addr();
    let m = MountSpec::s3(&b, "")
        .arg("--max-memory")
        .arg("64M")
        .arg("--metrics-addr")
        .arg(&metrics)
        .watchdog(Duration::from_secs(300))
        .mount();
    let budget = metric(&metrics, "bucketfs_memory_budget_bytes");
    assert!(
        (FILES as u64) * 64 * 1024 > budget * 5 / 4,
        "more files than budget units"
    );

    let root: PathBuf = m.path().to_path_buf();
    let (tx, rx) = mpsc::channel::<usize>();
    // The opener reports each file read; it keeps them all open until told to stop.
    let (stop_tx, stop_rx) = mpsc::channel::<()>();
    let opener = std::thread::spawn(move || {
        let mut open = Vec::new();
        for i in 0..FILES {
            let mut f = File::open(root.join(format!("d/f{i:05}"))).unwrap();
            let mut s = String::new();
            f.read_to_string(&mut s).unwrap();
            assert_eq!(s, format!("file {i}\n"));
            open.push(f);
            let _ = tx.send(i);
        }
        let _ = stop_rx.recv();
        drop(open);
    });
    let mut done = 0;
    let mut checked_cat = false;
    loop {
        match rx.recv_timeout(LIMIT) {
            Ok(i) => done = i + 1,
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                panic!("the read of open file {} hung ({done} read)", done + 1)
            }
        }
        if done == FILES {
            break;
        }
        // Once the budget is full of open files' bodies, another process still reads.
        if !checked_cat && done as u64 * 64 * 1024 >= budget + 8 * MIB as u64 {
            let got = cat_within(&m.join("other"), LIMIT).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(got, b"other\n");
            checked_cat = true;
        }
    }
    assert_eq!(done, FILES, "the opener failed");
    assert!(checked_cat);
    assert!(metric(&metrics, "bucketfs_buffer_bytes") <= budget + budget / 16 + 4 * MIB as u64);
    let _ = stop_tx.send(());
    opener.join().unwrap();
    drop(m);
    s3.remove_bucket(&b);
}

/// Many writers at once: the daemon's peak RSS stays within the budget plus the overhead
/// docs/reliability.md states, and every file is stored exactly. The size (64 x 64
/// MiB at 256M, about 45 s here): smaller runs do not tell the old code (371-470 MiB) from the
/// bound reliably. `BUCKETFS_WRITERS`, `BUCKETFS_WRITER_MIB`, `BUCKETFS_WRITER_BUDGET_MIB`
/// change it.
#[test]
fn many_writers_stay_within_the_memory_bound() {
    let writers: u64 = std::env::var("BUCKETFS_WRITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64);
    let size_mib: u64 = std::env::var("BUCKETFS_WRITER_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64);
    let budget_mib: u64 = std::env::var("BUCKETFS_WRITER_BUDGET_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    writers_stay_within_the_memory_bound(writers, size_mib, budget_mib);
}

/// Files under one part are stored with one PUT at close, whose body was a copy outside the
/// budget: 64 such closes at once held 64 copies. Their bodies are budget buffers now.
#[test]
fn many_small_file_writers_stay_within_the_memory_bound() {
    writers_stay_within_the_memory_bound(64, 6, 64);
}

/// 2,000 files written 4 KiB each and kept open: each holds a 64 KiB buffer of the budget
/// for its first bytes, but only the pages written are resident (the pool faults a fresh
/// buffer's pages in at once only for a whole part: 135 MiB more for these otherwise).
#[test]
fn writers_holding_small_files_open_keep_only_what_they_wrote_resident() {
    const FILES: u64 = 2000;
    raise_nofile(FILES + 256);
    let s3 = s3();
    let b = s3.new_bucket("heldwriters");
    let m = MountSpec::s3(&b, "")
        .arg("--max-memory")
        .arg("256M")
        .watchdog(Duration::from_secs(300))
        .mount();
    let (before, _) = m.rss_kib();
    let files: Vec<File> = (0..FILES)
        .map(|i| {
            let mut f = File::create(m.join(format!("h{i}"))).unwrap();
            pattern::write(&mut f, 500 + i, 4096).unwrap();
            f
        })
        .collect();
    let (held, _) = m.rss_kib();
    let per_file = (held.saturating_sub(before)) / FILES;
    eprintln!(
        "{FILES} writers holding 4 KiB each: RSS {} -> {} MiB ({per_file} KiB each)",
        before / 1024,
        held / 1024
    );
    for f in files {
        close_checked(f).unwrap();
    }
    for i in [0, FILES / 2, FILES - 1] {
        let got = s3.get(&b, &format!("h{i}")).expect("stored");
        pattern::check_slice(&got, 500 + i, 4096).unwrap();
    }
    drop(m);
    assert!(
        per_file <= 16,
        "{per_file} KiB resident per writer holding 4 KiB (at most 16 expected)"
    );
}

/// 300 writers of 1 MiB files close at once at 256M. A file's first MiB is held in memory
/// from its first write (64 KiB, doubling); those buffers came from the allocator, and glibc
/// kept them after the closes: the daemon peaked at 373 MiB (release build), over the bound.
/// They are the budget's own pool buffers now (294 MiB).
#[test]
fn small_file_writers_closing_at_once_stay_within_the_memory_bound() {
    let (writers, size, budget_mib) = (300u64, MIB as u64, 256);
    let s3 = s3();
    let b = s3.new_bucket("smallclose");
    let m = MountSpec::s3(&b, "")
        .arg("--max-memory")
        .arg(&format!("{budget_mib}M"))
        .watchdog(Duration::from_secs(300))
        .mount();
    let written = std::sync::Arc::new(std::sync::Barrier::new(writers as usize));
    let threads: Vec<_> = (0..writers)
        .map(|i| {
            let path = m.join(format!("s{i}"));
            let written = written.clone();
            std::thread::spawn(move || {
                let mut f = File::create(&path).unwrap();
                pattern::write(&mut f, 300 + i, size).unwrap();
                written.wait();
                close_checked(f).unwrap();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let (peak_mib, bound) = peak_and_bound(&m, budget_mib);
    eprintln!("{writers} writers x 1 MiB closing at once at --max-memory {budget_mib}M: peak RSS {peak_mib} MiB, bound {bound} MiB");
    for i in 0..writers {
        let got = s3.get(&b, &format!("s{i}")).expect("stored");
        pattern::check_slice(&got, 300 + i, size).unwrap_or_else(|e| panic!("s{i}: {e}"));
    }
    drop(m);
    s3.remove_bucket(&b);
    assert!(
        peak_mib <= bound,
        "peak RSS {peak_mib} MiB over the budget {budget_mib} MiB and its overhead"
    );
}

/// 128 readers of 8 MiB files at once, each on a connection of its own: the daemon's peak
/// RSS stays within the bound. Each connection's read buffer grew to hyper's 408 KiB,
/// outside the budget: 128 readers of 48 MiB files peaked at 118 MiB at 64M and 323 MiB at
/// 256M (release build), over the bound, and a daemon in a container of 330 MiB was killed.
#[test]
fn many_readers_on_many_connections_stay_within_the_memory_bound() {
    const READERS: u64 = 128;
    const SIZE: usize = 8 * MIB;
    let budget_mib = 64;
    let s3 = s3();
    let b = s3.new_bucket("manyreaders");
    let body = pattern::bytes(700, SIZE);
    for i in 0..READERS {
        s3.put(&b, &format!("r{i}"), body.clone());
    }
    let m = MountSpec::s3(&b, "")
        .arg("--max-memory")
        .arg(&format!("{budget_mib}M"))
        .watchdog(Duration::from_secs(300))
        .mount();
    let threads: Vec<_> = (0..READERS)
        .map(|i| {
            let path = m.join(format!("r{i}"));
            std::thread::spawn(move || {
                let got = std::fs::read(&path).unwrap();
                pattern::check_slice(&got, 700, SIZE as u64)
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap().unwrap();
    }
    let (peak_mib, bound) = peak_and_bound(&m, budget_mib);
    // A debug build's 128 read tasks are bigger than a release build's (unoptimised futures
    // and code): 125 MiB here alone, 139 beside this file's other tests, where release
    // builds peaked at 97 MiB (with 48 MiB files). Each connection's 408 KiB took this test
    // alone to 168-170 MiB.
    let bound = bound + if cfg!(debug_assertions) { 32 } else { 0 };
    eprintln!("{READERS} readers x 8 MiB at --max-memory {budget_mib}M: peak RSS {peak_mib} MiB, bound {bound} MiB");
    drop(m);
    s3.remove_bucket(&b);
    assert!(
        peak_mib <= bound,
        "peak RSS {peak_mib} MiB over the budget {budget_mib} MiB and its overhead"
    );
}

/// 64 processes each append a line to an existing 6 MiB object and close at once: each
/// close stores the whole object with one PUT whose body (a budget buffer) takes the unchanged
/// bytes from the bucket. The GET's body was a second copy beside it, outside the budget
/// (64 MiB over it at 64M); it goes straight into the body now.
#[test]
fn appends_to_existing_files_stay_within_the_memory_bound() {
    let (files, size, budget_mib) = (64u64, 6 * MIB as u64, 64);
    let s3 = s3();
    let b = s3.new_bucket("appends");
    for i in 0..files {
        s3.put(&b, &format!("a{i}"), pattern::bytes(200 + i, size as usize));
    }
    let m = MountSpec::s3(&b, "")
        .arg("--max-memory")
        .arg(&format!("{budget_mib}M"))
        .watchdog(Duration::from_secs(300))
        .mount();
    let threads: Vec<_> = (0..files)
        .map(|i| {
            let path = m.join(format!("a{i}"));
            std::thread::spawn(move || {
                let mut f = std::fs::OpenOptions::new()
                    .append(true)
                    .open(&path)
                    .unwrap();
                f.write_all(b"one more line\n").unwrap();
                close_checked(f).unwrap();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let (peak_mib, bound) = peak_and_bound(&m, budget_mib);
    eprintln!("{files} appends to 6 MiB objects at --max-memory {budget_mib}M: peak RSS {peak_mib} MiB, bound {bound} MiB");
    for i in 0..files {
        let got = s3.get(&b, &format!("a{i}")).expect("stored");
        assert_eq!(got.len() as u64, size + 14, "a{i}");
        pattern::check_slice(&got[..size as usize], 200 + i, size).unwrap();
        assert_eq!(&got[size as usize..], b"one more line\n");
    }
    drop(m);
    s3.remove_bucket(&b);
    assert!(
        peak_mib <= bound,
        "peak RSS {peak_mib} MiB over the budget {budget_mib} MiB and its overhead"
    );
}

/// `writers` threads each write a file of `size_mib` at `--max-memory budget_mib`M; the peak
/// RSS stays within the stated bound and every file is stored exactly.
fn writers_stay_within_the_memory_bound(writers: u64, size_mib: u64, budget_mib: u64) {
    writers_stay_within_the_memory_bound_in(writers, size_mib, budget_mib, None)
}

/// Background mode: each full part is staged (and sent) from the tail's own memory. A copy
/// of it was made for the staging write, a part's worth outside the budget per writer
/// staging at that moment.
#[test]
fn background_writers_stay_within_the_memory_bound() {
    let state = state_dir();
    writers_stay_within_the_memory_bound_in(64, 24, 64, Some(state.path()));
}

/// [`writers_stay_within_the_memory_bound`], in background mode with state directory `state`.
fn writers_stay_within_the_memory_bound_in(
    writers: u64,
    size_mib: u64,
    budget_mib: u64,
    state: Option<&Path>,
) {
    let s3 = s3();
    let b = s3.new_bucket("writers");
    let spec = match state {
        Some(dir) => background(MountSpec::s3(&b, ""), dir, &[]),
        None => MountSpec::s3(&b, ""),
    };
    let m = spec
        .arg("--max-memory")
        .arg(&format!("{budget_mib}M"))
        .watchdog(Duration::from_secs(600))
        .mount();
    let (base, _) = m.rss_kib();
    let threads: Vec<_> = (0..writers)
        .map(|i| {
            let path = m.join(format!("w{i}"));
            std::thread::spawn(move || {
                let mut f = File::create(&path).unwrap();
                pattern::write(&mut f, 100 + i, size_mib * MIB as u64).unwrap();
                f.flush().unwrap();
                close_checked(f).unwrap();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    if state.is_some() {
        wait_for("nothing pending", Duration::from_secs(120), || {
            nothing_pending(m.path())
        });
    }
    let (_, hwm) = m.rss_kib();
    let peak_mib = hwm / 1024;
    let overhead = overhead_mib(budget_mib);
    let bound = budget_mib + overhead;
    eprintln!(
        "{writers} writers x {size_mib} MiB at --max-memory {budget_mib}M: peak RSS {peak_mib} MiB \
         (at start {} MiB), bound {bound} MiB",
        base / 1024
    );
    for i in 0..writers {
        let got = s3.get(&b, &format!("w{i}")).expect("stored");
        pattern::check_slice(&got, 100 + i, size_mib * MIB as u64)
            .unwrap_or_else(|e| panic!("w{i}: {e}"));
    }
    drop(m);
    s3.remove_bucket(&b); // 4 GiB: give the disk back
    assert!(
        peak_mib <= bound,
        "peak RSS {peak_mib} MiB over the budget {budget_mib} MiB + {overhead} MiB overhead"
    );
}

/// The daemon's peak RSS so far and the bound it must stay within at `--max-memory
/// budget_mib`M, in MiB.
fn peak_and_bound(m: &Mount, budget_mib: u64) -> (u64, u64) {
    let (_, hwm) = m.rss_kib();
    (hwm / 1024, budget_mib + overhead_mib(budget_mib))
}

/// What the daemon may hold beyond `--max-memory`, in MiB, as docs/reliability.md ("Memory")
/// states it: the read overdraft (a sixteenth of the budget, at least 4 MiB) and 48 MiB for
/// the request area for copies of write requests (a thirty-second, 4 to 8 MiB), the code,
/// runtime, threads and connections. 64 MiB at 256M, where 302-308 MiB were measured
/// (455-470 before the write buffers left the allocator); 52 MiB at 64M, where 98-113 were
/// (the area is 4 MiB there: the test once held it to 48, and a run with the other tests of
/// this file at once peaked at 113).
fn overhead_mib(budget_mib: u64) -> u64 {
    (budget_mib / 16).max(4) + 48
}
