//! FUSE passthrough of the data cache through real mounts against MinIO (run as root on Linux
//! 6.9+): a file whose version the cache holds whole is read by the kernel from the cache's
//! copy, with no read reaching the daemon; a partly cached, replaced, damaged or writable one
//! is not; a reader of that copy keeps others from opening another version or for writing.

mod common;

use common::*;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const MIB: u64 = 1024 * 1024;

/// A mount of `bucket` caching data in `dir` with passthrough, serving metrics at the
/// returned address.
fn mount_cached(bucket: &str, dir: &Path, extra: &[&str]) -> (Mount, String) {
    mount_data_cache(bucket, dir, &["--passthrough"], extra)
}

/// The whole-object data files in the cache directory (those with their manifest).
fn whole_files(dir: &Path) -> Vec<PathBuf> {
    cache_files(dir, ".obj")
        .into_iter()
        .filter(|p| p.with_extension("man").exists())
        .collect()
}

fn wait_whole(dir: &Path, n: usize) {
    wait_for(
        &format!("{n} whole files in the data cache"),
        Duration::from_secs(20),
        || whole_files(dir).len() >= n,
    );
}

/// Read requests that reached the daemon's read path.
fn daemon_reads(addr: &str) -> u64 {
    metric(addr, "bucketfs_read_hits_total") + metric(addr, "bucketfs_read_misses_total")
}

/// `cat FILE`: another process reads it whole.
fn cat(path: &Path) -> Vec<u8> {
    let out = std::process::Command::new("cat")
        .arg(path)
        .output()
        .unwrap();
    assert!(out.status.success(), "cat {}: {out:?}", path.display());
    out.stdout
}

fn gets(m: &Mount, f: impl FnOnce()) -> u64 {
    let before = store_requests(m.path());
    f();
    let after = store_requests(m.path());
    requests_between(&before, &after)
        .get("get")
        .copied()
        .unwrap_or(0)
}

#[test]
fn a_file_the_cache_holds_whole_is_read_by_the_kernel_not_the_daemon() {
    let b = s3().new_bucket("pt-whole");
    let big = pattern::bytes(30, (5 * MIB + 12345) as usize);
    let small = pattern::bytes(31, 100_000);
    s3().put(&b, "big", big.clone());
    s3().put(&b, "small", small.clone());
    let cache = tempfile::tempdir().unwrap();
    let (m, addr) = mount_cached(&b, cache.path(), &[]);
    assert!(read_file(&m.join("big")) == big);
    assert!(read_file(&m.join("small")) == small);
    wait_whole(cache.path(), 2);
    // A new daemon and no page cache: only the cache directory is left.
    let m = m.remount();
    let reads = daemon_reads(&addr);
    let g = gets(&m, || {
        assert!(cat(&m.join("big")) == big, "big: wrong bytes");
        assert!(cat(&m.join("small")) == small, "small: wrong bytes");
    });
    assert_eq!(passthrough_opens(&addr), 2);
    assert_eq!(daemon_reads(&addr), reads, "a read reached the daemon");
    assert_eq!(g, 0);
    assert_eq!(
        metric(&addr, "bucketfs_passthrough_bytes_total"),
        (big.len() + small.len()) as u64
    );
    let stats = run(bin(), &["stats", m.path().to_str().unwrap(), "--once"]);
    assert!(stats.contains("passthrough  2 opens   5.4 MB"), "{stats}");
    // Two descriptors at once share the copy; a seek and a read in the middle are right.
    let mut f = std::fs::File::open(m.join("big")).unwrap();
    let second = cat(&m.join("big"));
    f.seek(SeekFrom::Start(3 * MIB + 5)).unwrap();
    let mut mid = vec![0u8; 100_000];
    f.read_exact(&mut mid).unwrap();
    assert!(second == big);
    assert!(mid[..] == big[(3 * MIB + 5) as usize..(3 * MIB + 5) as usize + 100_000]);
    assert_eq!(passthrough_opens(&addr), 4);
    assert_eq!(daemon_reads(&addr), reads);
}

#[test]
fn a_partly_cached_file_is_read_through_the_daemon_until_it_is_whole() {
    let b = s3().new_bucket("pt-partial");
    let data = pattern::bytes(32, (20 * MIB + 7) as usize);
    s3().put(&b, "f", data.clone());
    let cache = tempfile::tempdir().unwrap();
    let (m, addr) = mount_cached(&b, cache.path(), &[]);
    // Its first bytes only.
    let mut f = std::fs::File::open(m.join("f")).unwrap();
    let mut head = vec![0u8; 4096];
    f.read_exact(&mut head).unwrap();
    drop(f);
    assert!(head[..] == data[..4096]);
    wait_for("first blocks cached", Duration::from_secs(20), || {
        metric(&addr, "bucketfs_data_cache_bytes") > 0
    });
    let m = m.remount();
    let reads = daemon_reads(&addr);
    assert!(cat(&m.join("f")) == data);
    assert_eq!(
        passthrough_opens(&addr),
        0,
        "a partial copy was handed over"
    );
    assert!(daemon_reads(&addr) > reads);
    // That read cached the rest: the file is whole now, and the next open is passed through.
    wait_whole(cache.path(), 1);
    let reads = daemon_reads(&addr);
    assert!(cat(&m.join("f")) == data);
    assert_eq!(passthrough_opens(&addr), 1);
    assert_eq!(daemon_reads(&addr), reads);
}

#[test]
fn a_replaced_object_is_never_read_through_its_old_copy() {
    let b = s3().new_bucket("pt-replaced");
    let old = pattern::bytes(33, (2 * MIB + 100) as usize);
    s3().put(&b, "f", old.clone());
    let cache = tempfile::tempdir().unwrap();
    // Every open asks the store whether the object changed.
    let (m, addr) = mount_cached(&b, cache.path(), &["--stat-ttl", "0"]);
    assert!(read_file(&m.join("f")) == old);
    wait_whole(cache.path(), 1);
    assert!(cat(&m.join("f")) == old);
    assert_eq!(passthrough_opens(&addr), 1);
    // Another client replaces it (same size): the next open reads the new bytes.
    let new = pattern::bytes(34, old.len());
    s3().put(&b, "f", new.clone());
    assert!(cat(&m.join("f")) == new, "stale bytes from the old copy");
    assert_eq!(passthrough_opens(&addr), 1);
    // Once the new version is whole, it is the one handed over.
    wait_whole(cache.path(), 2);
    assert!(cat(&m.join("f")) == new);
    assert_eq!(passthrough_opens(&addr), 2);
    // A descriptor reading that copy keeps its version; an open of a newer one waits for it
    // (the kernel wants one backing file per inode), then fails with ETXTBSY.
    let mut held = std::fs::File::open(m.join("f")).unwrap();
    let newer = pattern::bytes(35, old.len());
    s3().put(&b, "f", newer.clone());
    let t = Instant::now();
    let r = std::fs::File::open(m.join("f"));
    assert_eq!(errno(r), libc::ETXTBSY);
    assert!(
        t.elapsed() >= Duration::from_millis(500),
        "{:?}",
        t.elapsed()
    );
    let mut got = Vec::new();
    held.read_to_end(&mut got).unwrap();
    assert!(got == new, "a descriptor's bytes changed version");
    drop(held);
    assert!(cat(&m.join("f")) == newer);
}

#[test]
fn a_damaged_cache_file_is_not_handed_to_the_kernel() {
    let b = s3().new_bucket("pt-damaged");
    let data = pattern::bytes(36, (3 * MIB + 99) as usize);
    s3().put(&b, "f", data.clone());
    let cache = tempfile::tempdir().unwrap();
    let (m, _) = mount_cached(&b, cache.path(), &[]);
    assert!(read_file(&m.join("f")) == data);
    wait_whole(cache.path(), 1);
    drop(m);
    // One byte changed in place (its size, inode and mtime kept).
    let obj = whole_files(cache.path()).remove(0);
    let mtime = std::fs::metadata(&obj).unwrap().modified().unwrap();
    let mut f = std::fs::OpenOptions::new().write(true).open(&obj).unwrap();
    f.seek(SeekFrom::Start(MIB + 7)).unwrap();
    f.write_all(&[data[(MIB + 7) as usize] ^ 0x40]).unwrap();
    f.set_modified(mtime).unwrap();
    drop(f);
    let (m, addr2) = mount_cached(&b, cache.path(), &[]);
    let g = gets(&m, || {
        assert!(cat(&m.join("f")) == data, "damaged bytes served")
    });
    assert!(g > 0, "the bytes come from the bucket");
    assert_eq!(passthrough_opens(&addr2), 0);
    assert_eq!(metric(&addr2, "bucketfs_data_cache_corrupt_total"), 1);
    // Fetched again and written whole: handed over again, the right bytes.
    wait_whole(cache.path(), 1);
    assert!(cat(&m.join("f")) == data);
    assert_eq!(passthrough_opens(&addr2), 1);
    // Cut short: not handed over either.
    let obj = whole_files(cache.path()).remove(0);
    let f = std::fs::OpenOptions::new().write(true).open(&obj).unwrap();
    f.set_len(MIB).unwrap();
    drop(f);
    assert!(cat(&m.join("f")) == data);
    assert_eq!(passthrough_opens(&addr2), 1);
    assert_eq!(metric(&addr2, "bucketfs_data_cache_corrupt_total"), 2);
}

#[test]
fn opens_for_writing_never_get_the_cache_copy() {
    let b = s3().new_bucket("pt-write");
    let data = pattern::bytes(37, (2 * MIB + 3) as usize);
    s3().put(&b, "f", data.clone());
    let cache = tempfile::tempdir().unwrap();
    let (m, addr) = mount_cached(&b, cache.path(), &[]);
    assert!(read_file(&m.join("f")) == data);
    wait_whole(cache.path(), 1);
    let m = m.remount();
    // Read and written through O_RDWR: through the daemon.
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.join("f"))
        .unwrap();
    let mut got = Vec::new();
    f.read_to_end(&mut got).unwrap();
    assert!(got == data);
    drop(f);
    assert_eq!(passthrough_opens(&addr), 0);
    // A reader through the copy: an open for writing waits for it, then ETXTBSY. (The
    // kernel sends the RELEASE of the descriptor above after its close returned: until the
    // daemon has it, the file is open elsewhere and an open reads through the daemon.)
    let deadline = Instant::now() + Duration::from_secs(10);
    let held = loop {
        let held = std::fs::File::open(m.join("f")).unwrap();
        if passthrough_opens(&addr) == 1 || Instant::now() > deadline {
            break held;
        }
        drop(held);
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(passthrough_opens(&addr), 1);
    let w = std::fs::OpenOptions::new().write(true).open(m.join("f"));
    assert_eq!(errno(w), libc::ETXTBSY);
    drop(held);
    // Closed: the writer opens, and what it stores is what the next open reads.
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.join("f"))
        .unwrap();
    f.write_all(b"NEW").unwrap();
    close_checked(f).unwrap();
    let mut want = data.clone();
    want[..3].copy_from_slice(b"NEW");
    assert!(cat(&m.join("f")) == want);
    assert_eq!(passthrough_opens(&addr), 1);
}

#[test]
fn warmup_then_remount_hands_the_kernel_every_file() {
    let b = s3().new_bucket("pt-warmup");
    let files: Vec<(String, Vec<u8>)> = vec![
        ("d/a".into(), pattern::bytes(38, (2 * MIB + 5) as usize)),
        ("d/b".into(), pattern::bytes(39, 70_000)),
        ("d/sub/c".into(), pattern::bytes(40, 1000)),
    ];
    for (k, v) in &files {
        s3().put(&b, k, v.clone());
    }
    let cache = tempfile::tempdir().unwrap();
    let (m, addr) = mount_cached(&b, cache.path(), &[]);
    let out = run(bin(), &["warmup", m.join("d").to_str().unwrap()]);
    assert!(out.contains("warmup: 3 files"), "{out}");
    wait_whole(cache.path(), 3);
    let m = m.remount();
    let reads = daemon_reads(&addr);
    let g = gets(&m, || {
        for (k, v) in &files {
            assert!(cat(&m.join(k)) == *v, "{k}");
        }
    });
    assert_eq!(g, 0);
    assert_eq!(passthrough_opens(&addr), 3);
    assert_eq!(daemon_reads(&addr), reads);
    // A second warmup counts them as cached.
    let out = run(bin(), &["warmup", m.join("d").to_str().unwrap()]);
    assert!(out.contains("2.2 MB already cached"), "{out}");
}

/// A single warmup of many small files, read 64 at a time at a small memory budget (so the
/// cache writer's queue is short and falls behind), leaves every one of them cached whole
/// when it returns: the job after the remount sends no GET and reads each through the kernel.
#[test]
fn one_warmup_of_many_small_files_caches_every_one_before_it_returns() {
    const N: usize = 400;
    let b = s3().new_bucket("pt-warmup-many");
    let files: Vec<(String, Vec<u8>)> = (0..N)
        .map(|i| {
            (
                format!("d{}/f{i}", i % 4),
                pattern::bytes(i as u64, 64 * 1024 + i),
            )
        })
        .collect();
    for (k, v) in &files {
        s3().put(&b, k, v.clone());
    }
    let cache = tempfile::tempdir().unwrap();
    let (m, addr) = mount_cached(&b, cache.path(), &["--max-memory", "64M"]);
    let out = run(bin(), &["warmup", "-j", "64", m.path().to_str().unwrap()]);
    assert!(out.contains(&format!("warmup: {N} files")), "{out}");
    assert!(out.contains(", 0 blocks not cached"), "{out}");
    // No waiting for the cache writer here: warmup said it is done.
    let m = m.remount();
    let g = gets(&m, || {
        for (k, v) in &files {
            assert!(read_file(&m.join(k)) == *v, "{k}");
        }
    });
    assert_eq!(g, 0, "GETs after the warmup");
    assert_eq!(passthrough_opens(&addr), N as u64);
}

/// Blocks a mount without passthrough cached are assembled into a whole copy by the first
/// open on a mount with it (read from those blocks, no GET), so the next open is passed
/// through.
#[test]
fn blocks_cached_without_passthrough_are_assembled_by_a_later_open() {
    let b = s3().new_bucket("pt-old-blocks");
    let data = pattern::bytes(41, (3 * MIB + 7) as usize);
    s3().put(&b, "f", data.clone());
    let cache = tempfile::tempdir().unwrap();
    let (m, addr) = mount_cached(&b, cache.path(), &["--no-passthrough"]);
    assert!(cat(&m.join("f")) == data);
    // The cache's writer done with what the read handed it.
    wait_for("the data cache writer", Duration::from_secs(10), || {
        metric(&addr, "bucketfs_data_cache_queued_blocks") == 0
    });
    let first = format!(
        "first mount: {} cache bytes, {} blocks skipped, {} cache errors",
        metric(&addr, "bucketfs_data_cache_bytes"),
        metric(&addr, "bucketfs_data_cache_skipped_total"),
        metric(&addr, "bucketfs_data_cache_errors_total"),
    );
    drop(m);
    assert!(
        whole_files(cache.path()).is_empty(),
        "no whole copy without passthrough"
    );
    let (m, addr) = mount_cached(&b, cache.path(), &[]);
    let g = gets(&m, || assert!(cat(&m.join("f")) == data));
    assert_eq!(g, 0, "read from the cached blocks ({first})");
    wait_whole(cache.path(), 1);
    let reads = daemon_reads(&addr);
    assert!(cat(&m.join("f")) == data);
    assert_eq!(passthrough_opens(&addr), 1);
    assert_eq!(daemon_reads(&addr), reads);
}

#[test]
fn two_mounts_share_the_whole_copies() {
    let b = s3().new_bucket("pt-shared");
    let data = pattern::bytes(41, (3 * MIB) as usize);
    s3().put(&b, "f", data.clone());
    let cache = tempfile::tempdir().unwrap();
    let (a, _) = mount_cached(&b, cache.path(), &[]);
    let (c, addr_c) = mount_cached(&b, cache.path(), &[]);
    assert!(read_file(&a.join("f")) == data);
    wait_whole(cache.path(), 1);
    // What one mount made whole, the other hands to the kernel.
    let g = gets(&c, || assert!(cat(&c.join("f")) == data));
    assert_eq!(g, 0);
    assert_eq!(passthrough_opens(&addr_c), 1);
    drop(a);
}

/// The cache's copy damaged while a descriptor reads it through the kernel (here: cut short,
/// then written to in place): a new open is not handed it (the kernel reopens the copy for
/// each descriptor it shares and reads it with no check). It waits for the old descriptor to
/// close and then reads the right bytes through the daemon, or, while that one stays open,
/// fails with `ETXTBSY` after 1 s. Before, it shared the copy: the file read as its first
/// 1,000 bytes, or with another's 4 bytes at its start.
#[test]
fn a_copy_damaged_while_open_is_not_shared_with_another_open() {
    let b = s3().new_bucket("pt-shared");
    let data = pattern::bytes(37, (3 * MIB + 5) as usize);
    s3().put(&b, "f", data.clone());
    let cache = tempfile::tempdir().unwrap();
    let (m, addr) = mount_cached(&b, cache.path(), &[]);
    assert!(read_file(&m.join("f")) == data);
    wait_whole(cache.path(), 1);
    for (round, damage) in ["cut short", "written to"].into_iter().enumerate() {
        let opens = passthrough_opens(&addr);
        let first = std::fs::File::open(m.join("f")).unwrap();
        assert_eq!(passthrough_opens(&addr), opens + 1, "{damage}");
        let obj = whole_files(cache.path()).remove(0);
        let mut f = std::fs::OpenOptions::new().write(true).open(&obj).unwrap();
        match damage {
            "cut short" => f.set_len(1000).unwrap(),
            _ => f.write_all(b"XXXX").unwrap(),
        }
        drop(f);
        let again = std::fs::File::open(m.join("f"));
        assert_eq!(
            again.as_ref().map_err(|e| e.raw_os_error()).err(),
            Some(Some(libc::ETXTBSY)),
            "{damage}: a second open while the first stays open"
        );
        let closer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            drop(first);
        });
        assert!(cat(&m.join("f")) == data, "{damage}: damaged bytes served");
        closer.join().unwrap();
        let corrupt = metric(&addr, "bucketfs_data_cache_corrupt_total");
        assert!(
            corrupt > 2 * round as u64,
            "{damage}: {corrupt} found corrupt"
        );
        // Fetched again whole for the next round.
        wait_whole(cache.path(), 1);
        assert!(cat(&m.join("f")) == data, "{damage}");
    }
}

/// The cache's copy evicted (unlinked) while a descriptor reads it through the kernel: its
/// bytes are intact, so a new open still shares it (the unlink changed its ctime, not its size
/// or mtime). An earlier build of the check above took it for damaged: `ETXTBSY`.
#[test]
fn a_copy_evicted_while_open_is_still_shared() {
    let b = s3().new_bucket("pt-evicted");
    let files: Vec<_> = (0..4)
        .map(|i| pattern::bytes(40 + i, (3 * MIB) as usize))
        .collect();
    for (i, f) in files.iter().enumerate() {
        s3().put(&b, &format!("f{i}"), f.clone());
    }
    let cache = tempfile::tempdir().unwrap();
    let (m, addr) = mount_cached(&b, cache.path(), &["--data-cache-size", "8M"]);
    assert!(read_file(&m.join("f0")) == files[0]);
    wait_whole(cache.path(), 1);
    let opens = passthrough_opens(&addr);
    let first = std::fs::File::open(m.join("f0")).unwrap();
    assert_eq!(passthrough_opens(&addr), opens + 1);
    let copy = whole_files(cache.path()).remove(0);
    for (i, f) in files.iter().enumerate().skip(1) {
        assert!(cat(&m.join(format!("f{i}"))) == *f);
    }
    wait_for("the first copy evicted", Duration::from_secs(20), || {
        !copy.exists()
    });
    assert!(cat(&m.join("f0")) == files[0], "the second open");
    assert_eq!(metric(&addr, "bucketfs_data_cache_corrupt_total"), 0);
    drop(first);
}
