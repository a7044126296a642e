//! Requests the bench's scenarios cost, counted by the daemon through a real mount against
//! MinIO (the bench itself measures speed; these pin the request counts behind it).

mod common;

use common::*;
use std::time::Duration;

/// A program creating files in a directory for longer than the stat TTL (the bench's
/// small-files-write and many-create): once the directory's listing is stale, the next new
/// name lists it again, once, instead of a HEAD and a LIST for each of the first three names.
#[test]
fn creating_files_after_the_listing_went_stale_lists_the_directory_once() {
    let b = s3().new_bucket("stalelist");
    let m = MountSpec::s3(&b, "").arg("--stat-ttl").arg("1").mount();
    let d = m.join("d");
    std::fs::create_dir(&d).unwrap();
    std::fs::write(d.join("f0"), b"x").unwrap();
    std::thread::sleep(Duration::from_millis(1300));
    let before = store_requests(m.path());
    for i in 1..=4 {
        std::fs::write(d.join(format!("f{i}")), b"x").unwrap();
    }
    let sent = requests_between(&before, &store_requests(m.path()));
    assert_eq!(sent.get("put").copied(), Some(4), "{sent:?}");
    // The kernel's lookup of d itself (its entry timed out too) probes it: HEAD d and LIST
    // d/ at once, whose page then answers the new names. Before: also a HEAD and a LIST for
    // each of f1 and f2, and a LIST at f3.
    let other: u64 = sent
        .iter()
        .filter(|(k, _)| *k != "put")
        .map(|(_, v)| v)
        .sum();
    assert!(other <= 2, "d probed once, no request per name: {sent:?}");
    for i in 0..=4 {
        assert_eq!(s3().get(&b, &format!("d/f{i}")).as_deref(), Some(&b"x"[..]));
    }
}

/// A job opening files across a tree (the bench's small-files-read-cold): after the listing
/// of the tree's top, subtree listings answer the lookups of its 40 directories and 1,200
/// files in a few LISTs (before: one per directory), and each name means what its own
/// directory's LIST would have said: a marker's mode, a nested directory, a name with odd
/// bytes, a missing name. A file another client adds afterwards is found. (A file beside a
/// directory of the same name is in the unit tests: MinIO lists only the file.)
#[test]
fn opening_files_across_a_tree_costs_a_few_subtree_listings() {
    use std::os::unix::fs::PermissionsExt;
    let b = s3().new_bucket("subtree");
    let mut files: Vec<(String, Vec<u8>)> = (0..1200u64)
        .map(|i| {
            let key = format!("t/d{:02}/f{i:04}", i % 40);
            (key, pattern::bytes(i, 100 + i as usize))
        })
        .collect();
    files.push(("t/d07/sub/deep/f".into(), b"deep".to_vec()));
    files.push(("t/d11/odd \u{1} %2F\u{e9}".into(), b"odd".to_vec()));
    s3().put_many(&b, files.clone(), 32);
    let dir_mode = (libc::S_IFDIR | 0o700).to_string();
    s3().put_with_meta(&b, "t/d05/", "", &[("mode", &dir_mode)]);
    let m = MountSpec::s3(&b, "").mount();
    assert_eq!(list_dir(&m.join("t")).len(), 40);
    let before = store_requests(m.path());
    let paths: Vec<_> = files.iter().map(|(k, v)| (m.join(k), v.clone())).collect();
    read_all(&paths, 64);
    let sent = requests_between(&before, &store_requests(m.path()));
    // 1,203 keys: two pages, a few more when lookups begin out of order.
    let lists = sent.get("list").copied().unwrap_or(0);
    assert!(lists <= 5, "{sent:?}");
    assert_eq!(sent.get("head"), None, "{sent:?}");
    let d05 = std::fs::metadata(m.join("t/d05")).unwrap();
    assert_eq!(d05.permissions().mode() & 0o7777, 0o700);
    assert_eq!(
        errno(std::fs::metadata(m.join("t/d03/absent"))),
        libc::ENOENT
    );
    s3().put(&b, "t/d20/new", b"new");
    assert_eq!(read_file(&m.join("t/d20/new")), b"new");
}
