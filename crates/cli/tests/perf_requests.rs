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
