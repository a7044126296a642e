//! The data cache on local disk (`--data-cache DIR`, `--data-cache-size SIZE`) through real
//! mounts against MinIO: reads after a remount come from it, a replaced object is never served
//! from old blocks, it stays within its size, a damaged block is refetched, a full cache disk
//! only costs GETs, blocks gone from the middle of a file are fetched alone, and two mounts share
//! one directory.

mod common;

use common::*;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const MIB: u64 = 1024 * 1024;

/// A mount of `bucket` caching data in `dir`, serving metrics at the returned address.
/// These tests look at the block files: passthrough, which assembles a file's blocks into one
/// whole copy, is off (its tests are in passthrough.rs).
fn mount_cached(bucket: &str, dir: &Path, extra: &[&str]) -> (Mount, String) {
    mount_data_cache(bucket, dir, &["--no-passthrough"], extra)
}

/// Block files (not temporaries) under the cache directory, with their sizes.
fn block_files(dir: &Path) -> Vec<(PathBuf, u64)> {
    cache_files(dir, "")
        .into_iter()
        .map(|p| {
            let len = std::fs::metadata(&p).unwrap().len();
            (p, len)
        })
        .collect()
}

fn wait_blocks(dir: &Path, n: usize) {
    wait_for(
        &format!("{n} blocks in the data cache"),
        Duration::from_secs(20),
        || block_files(dir).len() >= n,
    );
}

fn gets(req: &std::collections::BTreeMap<String, u64>) -> u64 {
    req.get("get").copied().unwrap_or(0)
}

/// Reads `name` through `m`; returns the GETs that cost and how long it took.
fn read_counted(m: &Mount, name: &str, want: &[u8]) -> (u64, Duration) {
    let before = store_requests(m.path());
    let t = Instant::now();
    let got = read_file(&m.join(name));
    let took = t.elapsed();
    assert!(got == want, "{name}: wrong bytes");
    let after = store_requests(m.path());
    (gets(&requests_between(&before, &after)), took)
}

/// A new bucket `tag` holding `f`, `mib` MiB of pattern `seed`, read once through a mount
/// caching in a new directory: every block is on disk and the mount is gone.
fn cached_object(tag: &str, seed: u64, mib: u64) -> (String, Vec<u8>, tempfile::TempDir) {
    let b = s3().new_bucket(tag);
    let data = pattern::bytes(seed, (mib * MIB) as usize);
    s3().put(&b, "f", data.clone());
    let cache = tempfile::tempdir().unwrap();
    let (m, _) = mount_cached(&b, cache.path(), &[]);
    read_counted(&m, "f", &data);
    wait_blocks(cache.path(), mib as usize);
    drop(m);
    (b, data, cache)
}

#[test]
fn a_second_read_after_remount_comes_from_the_data_cache() {
    let b = s3().new_bucket("dcache-remount");
    let big = pattern::bytes(1, (6 * MIB + 12345) as usize);
    let small: Vec<Vec<u8>> = (0..3).map(|i| pattern::bytes(10 + i, 100_000)).collect();
    s3().put(&b, "big", big.clone());
    for (i, s) in small.iter().enumerate() {
        s3().put(&b, &format!("small{i}"), s.clone());
    }
    let cache = tempfile::tempdir().unwrap();
    let (m, _) = mount_cached(&b, cache.path(), &[]);
    let (first_gets, first_time) = read_counted(&m, "big", &big);
    // Its 7 blocks written before more come (a full queue would skip some).
    wait_blocks(cache.path(), 7);
    for (i, s) in small.iter().enumerate() {
        read_counted(&m, &format!("small{i}"), s);
    }
    assert!(first_gets > 0);
    // 7 blocks of the big file, one of each small one.
    wait_blocks(cache.path(), 10);
    drop(m);

    let (m, addr) = mount_cached(&b, cache.path(), &[]);
    let (second_gets, second_time) = read_counted(&m, "big", &big);
    let mut small_gets = 0;
    for (i, s) in small.iter().enumerate() {
        small_gets += read_counted(&m, &format!("small{i}"), s).0;
    }
    eprintln!(
        "first read: {first_gets} GETs in {first_time:?}; after remount: {second_gets} GETs in {second_time:?}"
    );
    assert_eq!(
        second_gets + small_gets,
        0,
        "a remount reads cached data again"
    );
    assert_eq!(metric(&addr, "bucketfs_data_cache_hits_total"), 10);
    assert_eq!(
        metric(&addr, "bucketfs_data_cache_bytes_served_total"),
        big.len() as u64 + 300_000
    );
    let stats = run(bin(), &["stats", m.path().to_str().unwrap(), "--once"]);
    assert!(stats.contains("data cache   hits 10"), "{stats}");
}

/// A file of `size` bytes read through a mount (caching without passthrough) whose cache
/// writer now waits at its first block: the test point `cache.write` stops it before each
/// block while `pause`'s file exists.
struct HeldWriter {
    mount: Mount,
    bucket: String,
    data: Vec<u8>,
    cache: tempfile::TempDir,
    pause: Pause,
    _points: tempfile::TempDir,
}

fn read_with_the_writer_held(tag: &str, size: usize) -> HeldWriter {
    let bucket = s3().new_bucket(tag);
    let data = pattern::bytes(5, size);
    s3().put(&bucket, "f", data.clone());
    let cache = tempfile::tempdir().unwrap();
    let points = tempfile::tempdir().unwrap();
    let pause = Pause::new(points.path());
    let mut spec = MountSpec::s3(&bucket, "")
        .arg("--data-cache")
        .arg(cache.path().to_str().unwrap())
        .arg("--no-passthrough");
    spec.envs
        .push(("BUCKETFS_TEST_POINT".into(), pause.point("cache.write")));
    let mount = spec.mount();
    assert!(read_file(&mount.join("f")) == data);
    pause.reached();
    HeldWriter {
        mount,
        bucket,
        data,
        cache,
        pause,
        _points: points,
    }
}

/// An unmount right after a read waits for the cache's writer: the blocks it queued are on
/// disk for the next mount (they were dropped with the cache, and the next mount fetched them
/// again). The writer is held at each block until the unmount has begun.
#[test]
fn blocks_read_just_before_an_unmount_are_cached_for_the_next_mount() {
    let h = read_with_the_writer_held("dcache-unmount", (3 * MIB + 7) as usize);
    // Lets each block through once the unmount is under way.
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let releaser = {
        let (done, file) = (done.clone(), h.pause.file().to_path_buf());
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = std::fs::remove_file(&file);
                std::thread::sleep(Duration::from_millis(5));
            }
        })
    };
    let (st, log) = h.mount.unmount();
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    releaser.join().unwrap();
    assert!(st.is_some_and(|s| s.success()), "{log}");
    assert_eq!(block_files(h.cache.path()).len(), 4, "{log}");

    let (m, _) = mount_cached(&h.bucket, h.cache.path(), &[]);
    let (g, _) = read_counted(&m, "f", &h.data);
    assert_eq!(g, 0, "read from the blocks the first mount cached");
}

/// A cache writer that never gets on (a hung cache disk) holds an unmount 10 s at most: the
/// daemon then exits 0 and says that the blocks still queued are not cached.
#[test]
fn a_stuck_cache_writer_holds_an_unmount_10_s_at_most() {
    let h = read_with_the_writer_held("dcache-stuck", (2 * MIB) as usize);
    let t = Instant::now();
    let (st, log) = h.mount.unmount();
    let took = t.elapsed();
    assert!(st.is_some_and(|s| s.success()), "{log}");
    assert!(
        took >= Duration::from_secs(9) && took < Duration::from_secs(20),
        "{took:?}"
    );
    assert!(log.contains("blocks still queued are not cached"), "{log}");
}

#[test]
fn a_replaced_object_is_read_anew_never_from_its_old_blocks() {
    let b = s3().new_bucket("dcache-etag");
    let old = pattern::bytes(2, (2 * MIB + 100) as usize);
    s3().put(&b, "f", old.clone());
    let cache = tempfile::tempdir().unwrap();
    let (m, _) = mount_cached(&b, cache.path(), &[]);
    read_counted(&m, "f", &old);
    wait_blocks(cache.path(), 3);
    drop(m);
    // Another client replaces it between mounts: same key and size, new bytes.
    let new = pattern::bytes(3, old.len());
    s3().put(&b, "f", new.clone());
    let (m, addr) = mount_cached(&b, cache.path(), &[]);
    let (g, _) = read_counted(&m, "f", &new);
    assert!(g > 0);
    assert_eq!(metric(&addr, "bucketfs_data_cache_hits_total"), 0);
    // And the new version is what the cache holds next.
    wait_blocks(cache.path(), 6);
    let m = m.remount();
    assert_eq!(read_counted(&m, "f", &new).0, 0);
}

#[test]
fn the_data_cache_stays_within_its_size_evicting_the_oldest_blocks() {
    let b = s3().new_bucket("dcache-evict");
    let data = pattern::bytes(4, (12 * MIB) as usize);
    s3().put(&b, "f", data.clone());
    let cache = tempfile::tempdir().unwrap();
    // One block per request, read one by one, so the writer keeps up (a full queue skips
    // blocks) and the last blocks read are the last written.
    let small = ["--data-cache-size", "4M", "--max-prefetch", "1M"];
    let (m, addr) = mount_cached(&b, cache.path(), &small);
    let mut f = std::fs::File::open(m.join("f")).unwrap();
    let mut got = vec![0u8; data.len()];
    for c in got.chunks_mut(MIB as usize) {
        std::io::Read::read_exact(&mut f, c).unwrap();
        std::thread::sleep(Duration::from_millis(30));
    }
    drop(f);
    assert!(got == data);
    wait_for("evictions", Duration::from_secs(20), || {
        metric(&addr, "bucketfs_data_cache_evictions_total") >= 6
    });
    std::thread::sleep(Duration::from_millis(500));
    let files = block_files(cache.path());
    // The disk space they take: whole 4 KiB blocks.
    let total: u64 = files.iter().map(|(_, s)| s.div_ceil(4096) * 4096).sum();
    assert!(total <= 4 * MIB, "{total} bytes in {} files", files.len());
    assert_eq!(total, metric(&addr, "bucketfs_data_cache_bytes"));
    assert_eq!(metric(&addr, "bucketfs_data_cache_skipped_total"), 0);
    drop(m);
    // The most recently read blocks are the ones kept: the tail reads without a GET.
    let (m, _) = mount_cached(&b, cache.path(), &small);
    let mut f = std::fs::File::open(m.join("f")).unwrap();
    let before = store_requests(m.path());
    std::io::Seek::seek(&mut f, std::io::SeekFrom::Start(11 * MIB)).unwrap();
    let mut tail = vec![0u8; MIB as usize];
    std::io::Read::read_exact(&mut f, &mut tail).unwrap();
    drop(f);
    assert!(tail[..] == data[11 * MIB as usize..]);
    assert_eq!(
        gets(&requests_between(&before, &store_requests(m.path()))),
        0
    );
}

#[test]
fn a_corrupt_or_truncated_block_is_refetched_never_served() {
    let (b, data, cache) = cached_object("dcache-corrupt", 5, 3);
    let files = block_files(cache.path());
    assert_eq!(files.len(), 3);
    // One bit flipped in the data of one block, another block cut short.
    let mut bytes = std::fs::read(&files[0].0).unwrap();
    let at = bytes.len() - 1000;
    bytes[at] ^= 0x10;
    std::fs::write(&files[0].0, &bytes).unwrap();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&files[1].0)
        .unwrap();
    f.set_len(files[1].1 - 4096).unwrap();
    drop(f);

    let (m, addr) = mount_cached(&b, cache.path(), &[]);
    let (g, _) = read_counted(&m, "f", &data);
    assert!(g > 0, "the damaged blocks come from the bucket");
    assert_eq!(metric(&addr, "bucketfs_data_cache_corrupt_total"), 2);
    assert_eq!(metric(&addr, "bucketfs_data_cache_hits_total"), 1);
    // Written again, sound: the next mount reads all of it from the cache.
    wait_for("blocks rewritten", Duration::from_secs(20), || {
        block_files(cache.path())
            .iter()
            .filter(|(_, s)| *s > MIB)
            .count()
            == 3
    });
    let m = m.remount();
    assert_eq!(read_counted(&m, "f", &data).0, 0);
}

/// Blocks gone from the middle of a cached file (evicted, or by another mount sharing the
/// directory) are fetched alone: the cached blocks between them cost no byte from the store.
#[test]
fn only_the_missing_blocks_of_a_partly_cached_file_are_fetched() {
    let (b, data, cache) = cached_object("dcache-holes", 6, 8);
    // Blocks 2, 3 and 6 go (a block file ends with its bytes).
    let block = |i: usize| &data[i * MIB as usize..(i + 1) * MIB as usize];
    let mut removed = 0;
    for (path, _) in block_files(cache.path()) {
        let bytes = std::fs::read(&path).unwrap();
        if [2, 3, 6].iter().any(|&i| bytes.ends_with(block(i))) {
            std::fs::remove_file(&path).unwrap();
            removed += 1;
        }
    }
    assert_eq!(removed, 3);
    let (m, addr) = mount_cached(&b, cache.path(), &[]);
    let down = metric(&addr, "bucketfs_store_bytes_down_total");
    let (g, _) = read_counted(&m, "f", &data);
    assert_eq!(metric(&addr, "bucketfs_data_cache_hits_total"), 5);
    assert_eq!(
        metric(&addr, "bucketfs_store_bytes_down_total") - down,
        3 * MIB,
        "only the missing blocks come from the store ({g} GETs)"
    );
}

#[test]
fn a_full_cache_disk_reads_from_the_bucket() {
    let disk = match SmallDisk::new(2) {
        Ok(d) => d,
        Err(e) => panic!("this test needs to mount a tmpfs (run as root): {e}"),
    };
    let b = s3().new_bucket("dcache-full");
    let data = pattern::bytes(6, (8 * MIB) as usize);
    s3().put(&b, "f", data.clone());
    let dir = disk.path().join("cache");
    let (m, addr) = mount_cached(&b, &dir, &["--data-cache-size", "1G"]);
    let t = Instant::now();
    read_counted(&m, "f", &data);
    wait_for("cache write errors", Duration::from_secs(20), || {
        metric(&addr, "bucketfs_data_cache_errors_total") > 0
    });
    let m = m.remount();
    // Still every byte right, from the blocks that fit and the bucket.
    read_counted(&m, "f", &data);
    let elapsed = t.elapsed();
    assert!(elapsed < Duration::from_secs(20), "{elapsed:?}");
    let log = m.log();
    drop(m);
    assert!(log.contains("data cache"), "{log}");
}

#[test]
fn two_mounts_share_one_data_cache() {
    let b = s3().new_bucket("dcache-shared");
    let one = pattern::bytes(7, (3 * MIB) as usize);
    let two = pattern::bytes(8, (3 * MIB) as usize);
    s3().put(&b, "one", one.clone());
    s3().put(&b, "two", two.clone());
    let cache = tempfile::tempdir().unwrap();
    let (a, _) = mount_cached(&b, cache.path(), &[]);
    let (c, addr_c) = mount_cached(&b, cache.path(), &[]);
    read_counted(&a, "one", &one);
    wait_blocks(cache.path(), 3);
    // What one mount cached, the other reads from the cache.
    assert_eq!(read_counted(&c, "one", &one).0, 0);
    assert_eq!(metric(&addr_c, "bucketfs_data_cache_hits_total"), 3);
    // Both reading and caching the same file at once: right bytes in both.
    std::thread::scope(|s| {
        s.spawn(|| assert!(read_file(&a.join("two")) == two));
        s.spawn(|| assert!(read_file(&c.join("two")) == two));
    });
    wait_blocks(cache.path(), 6);
    drop(a);
    let c = c.remount();
    assert_eq!(read_counted(&c, "two", &two).0, 0);
}

#[test]
fn a_data_cache_directory_of_another_user_is_refused() {
    let b = s3().new_bucket("dcache-owner");
    let cache = tempfile::tempdir().unwrap();
    let dir = cache.path().join("theirs");
    std::fs::create_dir(&dir).unwrap();
    std::os::unix::fs::chown(&dir, Some(65534), Some(65534)).unwrap();
    let spec = MountSpec::s3(&b, "")
        .arg("--data-cache")
        .arg(dir.to_str().unwrap());
    let err = Mount::start(spec).err().expect("mount must be refused");
    assert!(err.contains("belongs to user 65534"), "{err}");
    // A new directory is created private.
    let mine = cache.path().join("mine");
    let m = MountSpec::s3(&b, "")
        .arg("--data-cache")
        .arg(mine.to_str().unwrap())
        .mount();
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&mine).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o700);
    drop(m);
}

#[test]
fn warmup_fills_the_data_cache_ahead_of_a_read() {
    let b = s3().new_bucket("dcache-warmup");
    let files: Vec<(String, Vec<u8>)> = vec![
        ("d/a".into(), pattern::bytes(20, (2 * MIB + 5) as usize)),
        ("d/sub/b".into(), pattern::bytes(21, 70_000)),
        ("d/sub/c".into(), pattern::bytes(22, 1000)),
    ];
    for (k, v) in &files {
        s3().put(&b, k, v.clone());
    }
    let total: usize = files.iter().map(|f| f.1.len()).sum();
    let cache = tempfile::tempdir().unwrap();
    let (m, _) = mount_cached(&b, cache.path(), &[]);
    let dir = m.join("d");
    let w = run_cli(
        &os(&["warmup", dir.to_str().unwrap()]),
        &[],
        None,
        Duration::from_secs(60),
    );
    assert_eq!(w.status.and_then(|s| s.code()), Some(0), "{w:?}");
    let out = &w.stdout;
    assert!(
        out.contains("warmup: 3 files, 2.2 MB") && out.contains("0.0 MB already cached"),
        "{out}"
    );
    // The mount has a data cache: no note says otherwise.
    assert!(!w.stderr.contains("no --data-cache"), "{}", w.stderr);
    // 3 blocks of a, one each of b and c.
    wait_blocks(cache.path(), 5);
    let m = m.remount();
    // A second warmup, after the remount, finds everything in the data cache (a file named
    // twice, by itself and in its tree, read and counted once)...
    let dir = m.join("d");
    let a = m.join("d/a");
    let out = run(
        bin(),
        &[
            "warmup",
            "-j",
            "2",
            dir.to_str().unwrap(),
            a.to_str().unwrap(),
        ],
    );
    let want = format!("{:.1} MB already cached", total as f64 / 1e6);
    assert!(out.contains(&want), "{out}");
    assert!(out.contains("warmup: 3 files, 2.2 MB"), "{out}");
    // ...and the job that follows sends no GET.
    for (k, v) in &files {
        assert_eq!(read_counted(&m, k, v).0, 0, "{k} read from the cache");
    }
}

/// Warming more than the data cache holds says so and exits 1: before, it reported every
/// block cached and exited 0, the cache holding only the last files read.
#[test]
fn warmup_of_more_than_the_cache_holds_fails_and_says_so() {
    let b = s3().new_bucket("dcache-warmup-big");
    for i in 0..3 {
        s3().put(
            &b,
            &format!("d/{i}"),
            pattern::bytes(30 + i, (3 * MIB) as usize),
        );
    }
    let cache = tempfile::tempdir().unwrap();
    let (m, addr) = mount_cached(&b, cache.path(), &["--data-cache-size", "4M"]);
    let dir = m.join("d");
    let w = run_cli(
        &os(&["warmup", dir.to_str().unwrap()]),
        &[],
        None,
        Duration::from_secs(60),
    );
    assert_eq!(w.status.and_then(|s| s.code()), Some(1), "{w:?}");
    assert!(
        w.stderr
            .contains("take 9.4 MB, more than its data cache holds (4.2 MB"),
        "{}",
        w.stderr
    );
    assert!(w.stdout.contains("warmup: 3 files, 9.4 MB"), "{}", w.stdout);
    let evicted = metric(&addr, "bucketfs_data_cache_evictions_total");
    assert!(evicted > 0);
    assert!(w.stdout.contains("cache files evicted"), "{}", w.stdout);
}

/// Pages of a file the kernel still holds (kept across opens) would serve warmup's reads
/// without the daemon seeing them: warmup drops them first, so blocks the data cache lost
/// meanwhile (here: removed behind the daemon's back, as another mount sharing the
/// directory evicts) are fetched and cached again.
#[test]
fn warmup_caches_a_file_whose_pages_the_kernel_still_holds() {
    let b = s3().new_bucket("dcache-warm-pages");
    let data = pattern::bytes(23, (2 * MIB + 11) as usize);
    s3().put(&b, "f", data.clone());
    let cache = tempfile::tempdir().unwrap();
    let (m, _) = mount_cached(&b, cache.path(), &[]);
    read_counted(&m, "f", &data);
    wait_blocks(cache.path(), 3);
    // The blocks go (another mount's eviction, a cleanup); the pages stay.
    for (p, _) in block_files(cache.path()) {
        std::fs::remove_file(p).unwrap();
    }
    let out = run(bin(), &["warmup", m.join("f").to_str().unwrap()]);
    assert!(out.contains("warmup: 1 files"), "{out}");
    wait_blocks(cache.path(), 3);
    let m = m.remount();
    assert_eq!(
        read_counted(&m, "f", &data).0,
        0,
        "read from the bucket again"
    );
}
