//! The second epoch from the data cache (issue 22) through real mounts against MinIO: a job
//! opening many files across directories lists each directory once; after a remount, the
//! directory pages an earlier mount saved in the data cache answer lookups while younger than
//! half of `--stat-ttl`, with no request at all; and an object another client replaced between two
//! mounts sharing the cache is read anew once the stat TTL has passed, never from the old
//! bytes.

mod common;

use common::*;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Opens and reads `paths` from `threads` threads at once, checking each against `want`.
fn read_all(paths: &[(std::path::PathBuf, Vec<u8>)], threads: usize) {
    let next = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some((p, want)) = paths.get(i) else {
                    return;
                };
                assert!(read_file(p) == *want, "{}: wrong bytes", p.display());
            });
        }
    });
}

/// `n` files spread over `dirs` directories below `top/`, as a training job's data set
/// (file `i` in directory `i % dirs`), stored by another client.
fn data_set(b: &str, top: &str, dirs: usize, n: usize) -> Vec<(String, Vec<u8>)> {
    (0..n)
        .map(|i| {
            let key = format!("{top}/d{:03}/f{i:04}", i % dirs);
            let body = pattern::bytes(i as u64, 3000 + i);
            s3().put(b, &key, body.clone());
            (key, body)
        })
        .collect()
}

fn under(m: &Mount, files: &[(String, Vec<u8>)]) -> Vec<(std::path::PathBuf, Vec<u8>)> {
    files.iter().map(|(k, v)| (m.join(k), v.clone())).collect()
}

fn lists(req: &std::collections::BTreeMap<String, u64>) -> u64 {
    req.get("list").copied().unwrap_or(0)
}

#[test]
fn concurrent_opens_across_directories_list_each_directory_once() {
    let b = s3().new_bucket("epoch-coalesce");
    let dirs = 100;
    let files = data_set(&b, "set", dirs, 3 * dirs);
    let m = MountSpec::s3(&b, "").mount();
    let before = store_requests(m.path());
    read_all(&under(&m, &files), 128);
    let req = requests_between(&before, &store_requests(m.path()));
    eprintln!("{req:?}");
    // `set` itself, then each directory once: its page answers the lookups of its files
    // (a few more when `set` is listed again for the lookups of its names). Before (about
    // 1.5 LISTs per directory), directories stat'ed ahead were listed twice (a one-key LIST,
    // then the page) and lookups finding the page missing each fetched it again.
    assert!(
        lists(&req) <= dirs as u64 + 5,
        "{} LISTs for {dirs} directories: {req:?}",
        lists(&req)
    );
}

/// A mount of `bucket` with the data cache in `dir` and passthrough.
fn mount_epoch(bucket: &str, dir: &Path, extra: &[&str]) -> Mount {
    mount_data_cache(bucket, dir, &["--passthrough"], extra).0
}

#[test]
fn after_a_remount_saved_directory_pages_younger_than_the_stat_ttl_answer_lookups() {
    let b = s3().new_bucket("epoch-saved");
    let dirs = 8;
    let files = data_set(&b, "set", dirs, 3 * dirs);
    let cache = tempfile::tempdir().unwrap();
    let ttl = ["--stat-ttl", "120"];
    let m = mount_epoch(&b, cache.path(), &ttl);
    read_all(&under(&m, &files), 8);
    // Every file whole (the pages of `set` and of each directory were saved at their lookups).
    wait_for("whole copies", Duration::from_secs(20), || {
        cache_files(cache.path(), ".man").len() >= files.len()
    });
    let m = m.remount();
    let before = store_requests(m.path());
    read_all(&under(&m, &files), 8);
    let req = requests_between(&before, &store_requests(m.path()));
    // Before, every directory was listed again (its entries' ETags are what keeps a replaced
    // object from being read from old cached bytes).
    assert!(req.is_empty(), "requests after the remount: {req:?}");

    // With the default stat TTL (5 s), pages that old are not used: listed again.
    let m = {
        drop(m);
        std::thread::sleep(Duration::from_millis(5500));
        mount_epoch(&b, cache.path(), &[])
    };
    let before = store_requests(m.path());
    read_all(&under(&m, &files), 8);
    let req = requests_between(&before, &store_requests(m.path()));
    assert!(lists(&req) > dirs as u64, "{req:?}");
    assert_eq!(req.get("get"), None, "the bytes still come from the cache");
}

#[test]
fn an_object_replaced_between_mounts_sharing_the_cache_is_read_anew_after_the_stat_ttl() {
    let b = s3().new_bucket("epoch-replace");
    let old = pattern::bytes(1, 50_000);
    let other = pattern::bytes(2, 50_000);
    s3().put(&b, "set/d/f", old.clone());
    s3().put(&b, "set/d/g", other.clone());
    let cache = tempfile::tempdir().unwrap();
    let ttl = ["--stat-ttl", "2"];
    let m = mount_epoch(&b, cache.path(), &ttl);
    let listed = Instant::now();
    assert!(read_file(&m.join("set/d/f")) == old);
    assert!(read_file(&m.join("set/d/g")) == other);
    wait_for("whole copies", Duration::from_secs(20), || {
        cache_files(cache.path(), ".man").len() >= 2
    });
    drop(m);
    // Another client replaces `f` (same size, new bytes) while nothing is mounted.
    let new = pattern::bytes(3, old.len());
    s3().put(&b, "set/d/f", new.clone());
    // Once the saved page is older than the stat TTL, the next mount must not believe it:
    // the new bytes, never the old ones the cache holds.
    let wait = Duration::from_millis(2500).saturating_sub(listed.elapsed());
    std::thread::sleep(wait);
    let m = mount_epoch(&b, cache.path(), &ttl);
    assert!(
        read_file(&m.join("set/d/f")) == new,
        "a page saved more than --stat-ttl ago was believed: the replaced object's old bytes"
    );
    assert!(read_file(&m.join("set/d/g")) == other);
    wait_for("the new version whole", Duration::from_secs(20), || {
        cache_files(cache.path(), ".man").len() >= 3
    });
    drop(m);

    // The page that mount saved shows the new version: within a longer TTL, the next mount
    // reads it from the cache with no request.
    let m = mount_epoch(&b, cache.path(), &["--stat-ttl", "60"]);
    let before = store_requests(m.path());
    assert!(read_file(&m.join("set/d/f")) == new);
    let req = requests_between(&before, &store_requests(m.path()));
    assert!(req.is_empty(), "{req:?}");
}
