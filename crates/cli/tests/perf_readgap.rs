//! Requests behind the bench's read rows (issue 21), counted by the daemon through a real
//! mount against MinIO: the bench measures the speed, these pin the requests it costs.

mod common;

use common::*;
use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;

const KIB: usize = 1024;

/// sysbench's read modes open their files O_RDWR (the bench's sysbench-seqrd and -rndrd):
/// reads of a file open for writing that has not been written come from the object. A file
/// of at most one part comes in one GET at the first read, as a read-only open's does, and
/// every later read of it is local; it came in one GET per 128 KiB block the reads touched
/// (8 here, each a round trip while the reader waits).
#[test]
fn reads_of_a_small_file_open_for_writing_fetch_it_once() {
    let b = s3().new_bucket("rdwrread");
    let len = MIB;
    let data = pattern::bytes(21, len);
    s3().put(&b, "f", data.clone());
    let m = MountSpec::s3(&b, "").mount();
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.join("f"))
        .unwrap();
    // No kernel readahead: every read below reaches the daemon as it is (sysbench rndrd).
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_RANDOM) };
    assert_eq!(rc, 0);
    let before = store_requests(m.path());
    // One 16 KiB read in each 128 KiB block, last block first.
    for blk in (0..len / (128 * KIB)).rev() {
        let at = blk * 128 * KIB + 40 * KIB;
        let mut buf = vec![0u8; 16 * KIB];
        f.read_exact_at(&mut buf, at as u64).unwrap();
        assert!(buf == data[at..at + 16 * KIB], "bytes at {at}");
    }
    let sent = requests_between(&before, &store_requests(m.path()));
    assert_eq!(sent.get("get").copied(), Some(1), "{sent:?}");
    // A write through it still lands on the bytes it read.
    f.write_all_at(b"new", 5).unwrap();
    drop(f);
    let mut want = data;
    want[5..8].copy_from_slice(b"new");
    assert!(s3().get(&b, "f").unwrap() == want);
}

/// A whole pass over `f` (opened `O_DIRECT`), 1 MiB per read into an aligned buffer.
fn direct_pass(f: &std::fs::File, len: usize) -> Vec<u8> {
    let layout = std::alloc::Layout::from_size_align(MIB, 4096).unwrap();
    let p = unsafe { std::alloc::alloc(layout) };
    assert!(!p.is_null());
    let buf = unsafe { std::slice::from_raw_parts_mut(p, MIB) };
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        let n = f.read_at(buf, out.len() as u64).unwrap();
        assert!(n > 0, "short file at {}", out.len());
        out.extend_from_slice(&buf[..n]);
    }
    unsafe { std::alloc::dealloc(p, layout) };
    out
}

fn open_direct(path: &std::path::Path) -> std::fs::File {
    use std::os::unix::fs::OpenOptionsExt;
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .unwrap()
}

/// fio's read-4jobs reads its files `O_DIRECT`, over and over: the kernel keeps no page of
/// them, so the daemon's block cache is the only one. A file that takes at most half of it
/// is kept from the first pass, so the second pass (through the same descriptor or a new
/// one) sends no GET; it was fetched twice (the first pass kept nothing). A version another
/// client stores is read once the stat TTL has passed (the cache is per version).
#[test]
fn a_direct_reader_reads_a_file_again_without_a_get() {
    let b = s3().new_bucket("directagain");
    // More than one part (8 MiB), so it streams in window-sized chunks.
    let len = 24 * MIB;
    let data = pattern::bytes(22, len);
    s3().put(&b, "f", data.clone());
    let m = MountSpec::s3(&b, "").arg("--stat-ttl").arg("1").mount();
    let gets = |before: &std::collections::HashMap<String, u64>| {
        let sent = requests_between(before, &store_requests(m.path()));
        sent.get("get").copied().unwrap_or(0)
    };
    let f = open_direct(&m.join("f"));
    let before = store_requests(m.path());
    assert!(direct_pass(&f, len) == data, "first pass");
    assert!(gets(&before) >= 1);
    let before = store_requests(m.path());
    assert!(direct_pass(&f, len) == data, "second pass");
    assert_eq!(
        gets(&before),
        0,
        "the second pass comes from the block cache"
    );
    drop(f);
    let before = store_requests(m.path());
    assert!(direct_pass(&open_direct(&m.join("f")), len) == data);
    assert_eq!(gets(&before), 0, "so does a new open of the same version");
    // Another client replaces it (same size): the next open after the TTL reads the new one.
    let new = pattern::bytes(23, len);
    s3().put(&b, "f", new.clone());
    std::thread::sleep(std::time::Duration::from_millis(1500));
    assert!(
        direct_pass(&open_direct(&m.join("f")), len) == new,
        "new version"
    );
}
