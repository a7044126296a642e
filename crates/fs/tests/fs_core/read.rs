//! Reads: GET sizes, readahead, block reuse and the page cache.

use crate::support::{env, put, random, Gate, MIB};
use bucketfs_fs::{Fs, FsConfig, FsError, ROOT_INO};
use bucketfs_store::metrics::Op;
use bucketfs_store::ObjectStore;
use bytes::Bytes;
use rand::{Rng, SeedableRng};
use std::ffi::OsStr;
use std::sync::Arc;

/// Reads `name` with `chunk`-sized reads at the given offsets, checking each against `data`.
async fn read_at(fs: &Fs, name: &str, data: &[u8], offsets: &[u64], chunk: u32) {
    let attr = fs.lookup(ROOT_INO, OsStr::new(name)).await.unwrap();
    let h = fs.open(attr.ino, libc::O_RDONLY).await.unwrap();
    for &off in offsets {
        let b = fs.read(attr.ino, h.fh, off, chunk).await.unwrap();
        let end = (off as usize + chunk as usize).min(data.len());
        assert_eq!(&b[..], &data[off as usize..end], "at {off}");
    }
    fs.release(attr.ino, h.fh).await.unwrap();
    fs.forget(attr.ino, 1);
}

#[tokio::test]
async fn sequential_reads_become_part_sized_gets() {
    let e = env();
    let data = random(41 * MIB as usize, 20);
    put(&e.mem, "seq", &data).await;
    let offsets: Vec<u64> = (0..data.len() as u64).step_by(128 * 1024).collect();
    read_at(&e.fs, "seq", &data, &offsets, 128 * 1024).await;
    // The window grows quickly to 5 MiB parts: a handful of GETs, not one per read.
    let gets = e.metrics.requests(Op::Get);
    assert!(gets <= 14, "{gets} GETs for 41 MiB");
    assert!(e.metrics.bytes_down() <= data.len() as u64 + 4 * MIB);
}

#[tokio::test]
async fn random_reads_fetch_little_more_than_asked() {
    let e = env();
    let data = random(40 * MIB as usize, 21);
    put(&e.mem, "rnd", &data).await;
    let mut rng = rand::rngs::StdRng::seed_from_u64(22);
    let offsets: Vec<u64> = (0..50)
        .map(|_| rng.gen_range(0..data.len() as u64 - 4096))
        .collect();
    read_at(&e.fs, "rnd", &data, &offsets, 4096).await;
    let per_read = e.metrics.bytes_down() / offsets.len() as u64;
    assert!(
        per_read <= 256 * 1024,
        "{per_read} bytes fetched per 4 KiB read"
    );
}

#[tokio::test]
async fn unchanged_files_keep_the_page_cache() {
    let e = env();
    put(&e.mem, "k", b"v1").await;
    let a = e.fs.lookup(ROOT_INO, OsStr::new("k")).await.unwrap();
    let h1 = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    assert!(!h1.keep_cache);
    e.fs.release(a.ino, h1.fh).await.unwrap();
    let h2 = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    assert!(h2.keep_cache);
    e.fs.release(a.ino, h2.fh).await.unwrap();
    // Rewritten here: the cached pages are stale.
    let w =
        e.fs.open(a.ino, libc::O_WRONLY | libc::O_TRUNC)
            .await
            .unwrap();
    e.fs.write(a.ino, w.fh, 0, Bytes::from_static(b"v2"))
        .await
        .unwrap();
    e.fs.flush(a.ino, w.fh).await.unwrap();
    e.fs.release(a.ino, w.fh).await.unwrap();
    let h3 = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    assert!(!h3.keep_cache);
    assert_eq!(&e.fs.read(a.ino, h3.fh, 0, 10).await.unwrap()[..], b"v2");
    e.fs.release(a.ino, h3.fh).await.unwrap();
}

/// A descriptor opened on the kernel's kept pages of a version reads that version, even when
/// a stat learns another client's newer one before its first read: it gets `ESTALE`, never
/// the kept pages of one version and the rest of the file from the other.
#[tokio::test]
async fn a_descriptor_keeping_the_kernels_pages_never_reads_a_version_learnt_after_its_open() {
    let e = env();
    put(&e.mem, "k", b"v1v1").await;
    let a = e.fs.lookup(ROOT_INO, OsStr::new("k")).await.unwrap();
    let h1 = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    assert_eq!(&e.fs.read(a.ino, h1.fh, 0, 4).await.unwrap()[..], b"v1v1");
    e.fs.release(a.ino, h1.fh).await.unwrap();
    let h2 = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    assert!(h2.keep_cache);
    put(&e.mem, "k", b"v2v2").await;
    e.fs.refresh(a.ino).unwrap();
    e.fs.getattr(a.ino).await.unwrap(); // learns v2
    let r = e.fs.read(a.ino, h2.fh, 0, 4).await;
    assert_eq!(
        r,
        Err(FsError(libc::ESTALE)),
        "a read of the kept descriptor"
    );
    e.fs.release(a.ino, h2.fh).await.unwrap();
    let h3 = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    assert!(!h3.keep_cache, "the kernel's pages are of the old version");
    assert_eq!(&e.fs.read(a.ino, h3.fh, 0, 4).await.unwrap()[..], b"v2v2");
    e.fs.release(a.ino, h3.fh).await.unwrap();
}

/// A descriptor that has read nothing, opened without kept pages, finds the object replaced
/// by another client: it reads the new version only if no other descriptor filled the
/// kernel's pages since it opened (the kernel may have handed it those without asking);
/// otherwise `ESTALE`.
#[tokio::test]
async fn a_replaced_object_is_read_anew_only_if_no_other_descriptor_filled_pages() {
    let e = env();
    put(&e.mem, "k", b"v1v1").await;
    let a = e.fs.lookup(ROOT_INO, OsStr::new("k")).await.unwrap();
    let idle = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    let busy = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    assert_eq!(&e.fs.read(a.ino, busy.fh, 0, 4).await.unwrap()[..], b"v1v1");
    put(&e.mem, "k", b"v2v2").await;
    let r = e.fs.read(a.ino, idle.fh, 0, 4).await;
    assert_eq!(r, Err(FsError(libc::ESTALE)), "pages of v1 were filled");
    e.fs.release(a.ino, idle.fh).await.unwrap();
    e.fs.release(a.ino, busy.fh).await.unwrap();
    // Alone, it reads the new version.
    let sole = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    assert!(!sole.keep_cache);
    put(&e.mem, "k", b"v3v3").await;
    assert_eq!(&e.fs.read(a.ino, sole.fh, 0, 4).await.unwrap()[..], b"v3v3");
    e.fs.release(a.ino, sole.fh).await.unwrap();
}

#[tokio::test]
async fn random_reads_reuse_recently_fetched_blocks() {
    let e = env();
    let data = random(16 * MIB as usize, 40);
    put(&e.mem, "r16", &data).await;
    let mut rng = rand::rngs::StdRng::seed_from_u64(41);
    let offsets: Vec<u64> = (0..2000)
        .map(|_| rng.gen_range(0..(data.len() as u64 - 16384)) / 16384 * 16384)
        .collect();
    read_at(&e.fs, "r16", &data, &offsets, 16384).await;
    // Blocks of 128 KiB are fetched once and kept: at most one GET per block of the file.
    let gets = e.metrics.requests(Op::Get);
    assert!(
        gets <= 16 * 8 + 8,
        "{gets} GETs for 2,000 random 16 KiB reads of 16 MiB"
    );
}

/// Two descriptors that have read nothing find the object replaced by another client: the
/// first reads the new version, and so does the second, since the only pages the first
/// filled are of that version; so does an `O_DIRECT` one, whatever the pages hold (the
/// kernel never hands it any).
#[tokio::test]
async fn descriptors_that_read_nothing_all_read_a_replaced_object_anew() {
    let e = env();
    put(&e.mem, "k", b"v1v1").await;
    let a = e.fs.lookup(ROOT_INO, OsStr::new("k")).await.unwrap();
    let fd1 = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    let fd2 = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    let fd3 = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    let d =
        e.fs.open(a.ino, libc::O_RDONLY | libc::O_DIRECT)
            .await
            .unwrap();
    put(&e.mem, "k", b"v2v2").await;
    for (h, what) in [
        (&fd1, "the first"),
        (&fd2, "the second"),
        (&fd3, "the third"),
    ] {
        let r = e.fs.read(a.ino, h.fh, 0, 4).await;
        assert_eq!(r.as_deref().ok(), Some(&b"v2v2"[..]), "{what}");
    }
    put(&e.mem, "k", b"v3v3").await;
    let r = e.fs.read(a.ino, d.fh, 0, 4).await;
    assert_eq!(r.as_deref().ok(), Some(&b"v3v3"[..]), "O_DIRECT");
    for h in [fd1, fd2, fd3, d] {
        e.fs.release(a.ino, h.fh).await.unwrap();
    }
}

/// What a writer here puts into the kernel's pages counts as filling them: bytes read through
/// its state (by another descriptor), and bytes it writes. A descriptor opened while the
/// writer was, that has read nothing, once the writer closed and another client replaced the
/// object, gets `ESTALE` rather than the other client's version (the kernel may have handed
/// it those pages); and the next open drops them.
#[tokio::test]
async fn pages_a_writer_fills_keep_a_descriptor_from_reading_another_version() {
    for (reads_through, writes) in [(true, false), (false, true)] {
        let e = env();
        put(&e.mem, "k", b"v1v1").await;
        let a = e.fs.lookup(ROOT_INO, OsStr::new("k")).await.unwrap();
        let w = e.fs.open(a.ino, libc::O_RDWR).await.unwrap();
        let idle = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
        let busy = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
        if writes {
            e.fs.write(a.ino, w.fh, 0, Bytes::from_static(b"v2"))
                .await
                .unwrap();
        }
        if reads_through {
            assert_eq!(&e.fs.read(a.ino, busy.fh, 0, 4).await.unwrap()[..], b"v1v1");
        }
        e.fs.flush(a.ino, w.fh).await.unwrap();
        e.fs.release(a.ino, w.fh).await.unwrap();
        put(&e.mem, "k", b"v3v3").await;
        let r = e.fs.read(a.ino, idle.fh, 0, 4).await;
        let case = format!("read through the state: {reads_through}, written: {writes}");
        assert_eq!(r, Err(FsError(libc::ESTALE)), "{case}");
        e.fs.release(a.ino, idle.fh).await.unwrap();
        e.fs.release(a.ino, busy.fh).await.unwrap();
        let next = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
        assert!(!next.keep_cache, "{case}");
        assert_eq!(&e.fs.read(a.ino, next.fh, 0, 4).await.unwrap()[..], b"v3v3");
        e.fs.release(a.ino, next.fh).await.unwrap();
    }
}

/// A descriptor that read part of a version, once another client's version is learnt: an
/// open meanwhile is served uncached (the kernel would hand the old descriptor the pages it
/// fills, the new version after the old one's bytes), and drops the pages the old one may
/// read; its next read reaches the daemon, `ESTALE`. Not once the old descriptor closed, nor
/// while only descriptors of the version the inode names are open.
#[tokio::test]
async fn an_open_while_a_descriptor_reads_an_older_version_is_served_uncached() {
    let e = crate::support::env_with(bucketfs_store::memory::MemoryStore::new(), |c| {
        bucketfs_fs::FsConfig {
            stat_ttl: std::time::Duration::ZERO,
            ..c
        }
    });
    put(&e.mem, "k", b"v1v1").await;
    let a = e.fs.lookup(ROOT_INO, OsStr::new("k")).await.unwrap();
    let old = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    assert_eq!(&e.fs.read(a.ino, old.fh, 0, 2).await.unwrap()[..], b"v1");
    let same = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    assert!(!same.uncached, "the inode names the version both read");
    e.fs.release(a.ino, same.fh).await.unwrap();
    put(&e.mem, "k", b"v2v2").await;
    for flags in [libc::O_RDONLY, libc::O_RDWR] {
        let new = e.fs.open(a.ino, flags).await.unwrap(); // learns v2
        assert!(new.uncached && !new.keep_cache, "flags {flags}");
        assert_eq!(&e.fs.read(a.ino, new.fh, 0, 4).await.unwrap()[..], b"v2v2");
        e.fs.flush(a.ino, new.fh).await.unwrap();
        e.fs.release(a.ino, new.fh).await.unwrap();
    }
    let r = e.fs.read(a.ino, old.fh, 2, 2).await;
    assert_eq!(r, Err(FsError(libc::ESTALE)), "the old descriptor read on");
    e.fs.release(a.ino, old.fh).await.unwrap();
    let next = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    assert!(!next.uncached, "no descriptor of the old version is open");
    assert_eq!(&e.fs.read(a.ino, next.fh, 0, 4).await.unwrap()[..], b"v2v2");
    e.fs.release(a.ino, next.fh).await.unwrap();
}

/// Another client's version learnt after a descriptor opened (a `stat`, another open): the
/// descriptor, unread, reads it if no page of the version before can have reached it
/// (another open in between dropped none), and gets `ESTALE` when the kernel kept such pages
/// for it; never the old version's bytes under pages of the new one.
#[tokio::test]
async fn a_version_learnt_after_an_open_is_read_only_where_no_older_page_can_be() {
    let e = crate::support::env_with(bucketfs_store::memory::MemoryStore::new(), |c| {
        bucketfs_fs::FsConfig {
            stat_ttl: std::time::Duration::ZERO,
            ..c
        }
    });
    put(&e.mem, "k", b"v1v1").await;
    let a = e.fs.lookup(ROOT_INO, OsStr::new("k")).await.unwrap();
    // Nothing read: the pages hold nothing.
    let d1 = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    put(&e.mem, "k", b"v2v2").await;
    let d2 = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap(); // learns v2
    for h in [&d1, &d2] {
        assert_eq!(&e.fs.read(a.ino, h.fh, 0, 4).await.unwrap()[..], b"v2v2");
    }
    e.fs.release(a.ino, d2.fh).await.unwrap();
    // Pages of v2 kept for d3; v3 learnt by another open, which drops them.
    let d3 = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    assert!(d3.keep_cache);
    put(&e.mem, "k", b"v3v3").await;
    let d4 = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    assert!(!d4.keep_cache);
    let r = e.fs.read(a.ino, d3.fh, 0, 4).await;
    assert_eq!(r, Err(FsError(libc::ESTALE)), "d3 may hold pages of v2");
    assert_eq!(&e.fs.read(a.ino, d4.fh, 0, 4).await.unwrap()[..], b"v3v3");
    for h in [d1, d3, d4] {
        e.fs.release(a.ino, h.fh).await.unwrap();
    }
}

/// A descriptor that read part of a version, once another client's version is learnt and a
/// writer here opens the file (its state built on that version), gets `ESTALE`, not the rest
/// from the other version through the writer's state (a copy torn between two versions);
/// one that has read nothing, and whose pages can hold nothing older, reads the writer's.
/// Before: the first read on in the other version's bytes.
#[tokio::test]
async fn a_reader_never_reads_on_from_another_version_through_a_writers_state() {
    let e = crate::support::env_with(bucketfs_store::memory::MemoryStore::new(), |c| {
        bucketfs_fs::FsConfig {
            stat_ttl: std::time::Duration::ZERO,
            ..c
        }
    });
    put(&e.mem, "k", b"v1v1").await;
    let a = e.fs.lookup(ROOT_INO, OsStr::new("k")).await.unwrap();
    let read =
        e.fs.open(a.ino, libc::O_RDONLY | libc::O_DIRECT)
            .await
            .unwrap();
    let unread =
        e.fs.open(a.ino, libc::O_RDONLY | libc::O_DIRECT)
            .await
            .unwrap();
    assert_eq!(&e.fs.read(a.ino, read.fh, 0, 2).await.unwrap()[..], b"v1");
    put(&e.mem, "k", b"v2v2").await;
    // The writer's open learns v2 and builds its state on it.
    let w =
        e.fs.open(a.ino, libc::O_WRONLY | libc::O_APPEND)
            .await
            .unwrap();
    let r = e.fs.read(a.ino, read.fh, 2, 2).await;
    assert_eq!(r, Err(FsError(libc::ESTALE)), "read on from v2 after v1");
    assert_eq!(
        &e.fs.read(a.ino, unread.fh, 0, 4).await.unwrap()[..],
        b"v2v2"
    );
    for h in [read, unread, w] {
        e.fs.release(a.ino, h.fh).await.unwrap();
    }
}

/// A descriptor that read part of a version keeps serving it from memory (a small file comes
/// in one GET): once another client's version is learnt, its next read gets `ESTALE` rather
/// than put more bytes of the old version into the kernel's pages, which a newer open reads.
#[tokio::test]
async fn a_reader_of_a_replaced_version_stops_once_the_new_one_is_learnt() {
    let e = env();
    put(&e.mem, "k", &[1; 256 << 10]).await;
    let a = e.fs.lookup(ROOT_INO, OsStr::new("k")).await.unwrap();
    let old = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    assert_eq!(
        &e.fs.read(a.ino, old.fh, 0, 4096).await.unwrap()[..],
        &[1; 4096]
    );
    put(&e.mem, "k", &[2; 256 << 10]).await;
    e.fs.refresh(a.ino).unwrap();
    e.fs.getattr(a.ino).await.unwrap(); // learns the new version
    let new = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    let r = e.fs.read(a.ino, old.fh, 128 << 10, 4096).await;
    assert_eq!(r, Err(FsError(libc::ESTALE)));
    assert_eq!(
        &e.fs.read(a.ino, new.fh, 0, 4096).await.unwrap()[..],
        &[2; 4096]
    );
    e.fs.release(a.ino, old.fh).await.unwrap();
    e.fs.release(a.ino, new.fh).await.unwrap();
}

/// With nothing cached to tell (no stat cache), a readdirplus entry of a file this mount
/// knows keeps its ETag: a kept descriptor reads on, and the next open keeps the pages (an
/// earlier build took the entry for another version: `ESTALE`, and no page kept again).
#[tokio::test]
async fn a_readdirplus_without_a_stat_cache_is_no_new_version() {
    let e = crate::support::env_with(bucketfs_store::memory::MemoryStore::new(), |c| {
        bucketfs_fs::FsConfig {
            stat_cache_size: 0,
            ..c
        }
    });
    put(&e.mem, "d/f", b"v1v1").await;
    let d = e.fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    let a = e.fs.lookup(d.ino, OsStr::new("f")).await.unwrap();
    let h = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    assert_eq!(&e.fs.read(a.ino, h.fh, 0, 4).await.unwrap()[..], b"v1v1");
    e.fs.release(a.ino, h.fh).await.unwrap();
    let kept = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    assert!(kept.keep_cache);
    e.fs.refresh(a.ino).unwrap();
    let fh = e.fs.opendir(d.ino).await.unwrap();
    for entry in e.fs.readdir(d.ino, fh, 0).await.unwrap() {
        e.fs.plus_entry(d.ino, &entry);
    }
    e.fs.releasedir(d.ino, fh);
    assert_eq!(&e.fs.read(a.ino, kept.fh, 0, 4).await.unwrap()[..], b"v1v1");
    e.fs.release(a.ino, kept.fh).await.unwrap();
    e.fs.getattr(a.ino).await.unwrap();
    let again = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    assert!(again.keep_cache, "the pages are of the version there");
    e.fs.release(a.ino, again.fh).await.unwrap();
}

/// A file open below a directory renamed here, stat'ed under its new name: its descriptor
/// reads on (the rename forgot the ETag; learning it again is no other client's change).
#[tokio::test]
async fn a_descriptor_reads_on_after_its_directory_is_renamed_and_stated() {
    let e = env();
    put(&e.mem, "d/f", &[3; 64 << 10]).await;
    let d = e.fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    let a = e.fs.lookup(d.ino, OsStr::new("f")).await.unwrap();
    let h = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    assert_eq!(
        &e.fs.read(a.ino, h.fh, 0, 4096).await.unwrap()[..],
        &[3; 4096]
    );
    e.fs.rename(ROOT_INO, OsStr::new("d"), ROOT_INO, OsStr::new("d2"), 0)
        .await
        .unwrap();
    let d2 = e.fs.lookup(ROOT_INO, OsStr::new("d2")).await.unwrap();
    e.fs.refresh(a.ino).unwrap();
    e.fs.lookup(d2.ino, OsStr::new("f")).await.unwrap();
    let r = e.fs.read(a.ino, h.fh, 4096, 4096).await;
    assert_eq!(r.as_deref().ok(), Some(&[3u8; 4096][..]));
    e.fs.release(a.ino, h.fh).await.unwrap();
}

/// A file open below a directory renamed here names the copy the rename made, whose ETag
/// the rename knows: its descriptor reads on from the copy, pinned to it, so another
/// client's version put there after the rename is refused (`ESTALE`) instead of read into
/// the same descriptor (an earlier build forgot the ETag and read on unconditionally); and
/// the kernel's pages, the same bytes, are kept by the next open. A version another client
/// put before the rename is what was copied: a descriptor that read the one before stops.
#[tokio::test]
async fn a_descriptor_below_a_renamed_directory_reads_only_the_copy_of_its_version() {
    for replaced in ["after the rename", "before the rename"] {
        let e = env();
        put(&e.mem, "d/f", &[3; 32 << 20]).await;
        let d = e.fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
        let a = e.fs.lookup(d.ino, OsStr::new("f")).await.unwrap();
        let h = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
        assert_eq!(
            &e.fs.read(a.ino, h.fh, 0, 4096).await.unwrap()[..],
            &[3; 4096]
        );
        if replaced == "before the rename" {
            put(&e.mem, "d/f", &[9; 32 << 20]).await;
        }
        e.fs.rename(ROOT_INO, OsStr::new("d"), ROOT_INO, OsStr::new("d2"), 0)
            .await
            .unwrap();
        if replaced == "after the rename" {
            let r = e.fs.read(a.ino, h.fh, 4096, 4096).await;
            assert_eq!(r.map(|b| (b.len(), b[4095])), Ok((4096, 3)), "{replaced}");
            let again = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
            assert!(again.keep_cache, "the pages are the copy's bytes");
            e.fs.release(a.ino, again.fh).await.unwrap();
            put(&e.mem, "d2/f", &[9; 32 << 20]).await;
        }
        // Far from what it read: a GET.
        let r = e.fs.read(a.ino, h.fh, 30 << 20, 4096).await;
        assert_eq!(r.map(|b| b[0]), Err(FsError(libc::ESTALE)), "{replaced}");
        e.fs.release(a.ino, h.fh).await.unwrap();
    }
}

/// A chmod made here of a file uploaded in parts gives it a new ETag (the copy onto itself is
/// one part): a descriptor reading it on this mount, whose reader was pinned to the ETag
/// before, got `ESTALE` at its next GET, although the bytes are the same. It now goes on.
#[tokio::test]
async fn a_chmod_made_here_never_fails_a_descriptor_reading_the_file() {
    let e = env();
    let data = random(24 * MIB as usize, 31);
    let ino = crate::support::write_file(&e.fs, "big", &data).await;
    let before = e.mem.head("big").await.unwrap().etag;
    let h = e.fs.open(ino, libc::O_RDONLY).await.unwrap();
    let first = e.fs.read(ino, h.fh, 0, MIB as u32).await.unwrap();
    assert_eq!(&first[..], &data[..MIB as usize]);
    let chmod = bucketfs_fs::SetAttr {
        mode: Some(0o600),
        ..Default::default()
    };
    e.fs.setattr(ino, None, chmod).await.unwrap();
    assert_ne!(
        e.mem.head("big").await.unwrap().etag,
        before,
        "the chmod kept the ETag: the test proves nothing"
    );
    for off in (MIB..data.len() as u64).step_by(MIB as usize) {
        let b = e.fs.read(ino, h.fh, off, MIB as u32).await.unwrap();
        assert_eq!(
            &b[..],
            &data[off as usize..(off + MIB) as usize],
            "at {off}"
        );
    }
    e.fs.release(ino, h.fh).await.unwrap();
}

/// A descriptor reading a file that another descriptor of this mount rewrites (O_TRUNC, then
/// new bytes, then close): its reads during the rewrite give the new bytes, and after the
/// close they gave the old version's again from the reader's memory (then `ESTALE`), a mix
/// of two versions. After the close it reads the file as it is now, as on a local disk.
#[tokio::test]
async fn a_descriptor_reading_across_a_rewrite_made_here_reads_the_new_content() {
    let e = env();
    let old = random(24 * MIB as usize, 32);
    let new = random(24 * MIB as usize, 33);
    put(&e.mem, "f", &old).await;
    let a = e.fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    let r = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    let got = e.fs.read(a.ino, r.fh, 0, MIB as u32).await.unwrap();
    assert_eq!(&got[..], &old[..MIB as usize]);
    let w =
        e.fs.open(a.ino, libc::O_WRONLY | libc::O_TRUNC)
            .await
            .unwrap();
    for off in (0..new.len()).step_by(MIB as usize) {
        let chunk = Bytes::copy_from_slice(&new[off..off + MIB as usize]);
        e.fs.write(a.ino, w.fh, off as u64, chunk).await.unwrap();
    }
    let got = e.fs.read(a.ino, r.fh, MIB, MIB as u32).await.unwrap();
    assert_eq!(
        &got[..],
        &new[MIB as usize..2 * MIB as usize],
        "during the rewrite"
    );
    e.fs.flush(a.ino, w.fh).await.unwrap();
    e.fs.release(a.ino, w.fh).await.unwrap();
    for off in (2 * MIB..new.len() as u64).step_by(MIB as usize) {
        let got = e.fs.read(a.ino, r.fh, off, MIB as u32).await.unwrap();
        assert_eq!(
            &got[..],
            &new[off as usize..(off + MIB) as usize],
            "at {off}"
        );
    }
    e.fs.release(a.ino, r.fh).await.unwrap();
}

/// Holds this mount's GETs of `key` pinned to `etag` at its gate.
struct HoldsPinnedGet {
    inner: Arc<bucketfs_store::memory::MemoryStore>,
    key: String,
    etag: parking_lot::Mutex<Option<String>>,
    gate: Gate,
}

impl HoldsPinnedGet {
    async fn hold(&self, key: &str, if_match: Option<&str>) {
        let hit = key == self.key
            && self
                .etag
                .lock()
                .as_deref()
                .is_some_and(|e| Some(e) == if_match);
        self.gate.pass(hit).await;
    }
}

#[async_trait::async_trait]
impl bucketfs_store::layer::StoreLayer for HoldsPinnedGet {
    type Inner = bucketfs_store::memory::MemoryStore;
    fn inner(&self) -> &Self::Inner {
        &self.inner
    }
    async fn get_range(
        &self,
        key: &str,
        range: std::ops::Range<u64>,
        if_match: Option<&str>,
    ) -> bucketfs_store::StoreResult<Bytes> {
        self.hold(key, if_match).await;
        self.inner.get_range(key, range, if_match).await
    }
    async fn get_range_into(
        &self,
        key: &str,
        range: std::ops::Range<u64>,
        if_match: Option<&str>,
        dst: &mut [u8],
    ) -> bucketfs_store::StoreResult<usize> {
        self.hold(key, if_match).await;
        self.inner.get_range_into(key, range, if_match, dst).await
    }
}

/// Two reads of one descriptor at once (the kernel's readahead, or threads sharing it) that
/// has read nothing, after another client replaced the object: the first finds the change
/// and reads the new version. The second had looked at the inode before it waited for the
/// first, and took the reader of the new version for one this mount had replaced: it went
/// back to the old version (ESTALE, or its cached bytes, a mix of two versions). It reads the
/// new version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_reads_at_once_of_a_replaced_object_both_read_the_new_version() {
    let mem = Arc::new(bucketfs_store::memory::MemoryStore::new());
    put(&mem, "k", b"old version").await;
    let store = Arc::new(HoldsPinnedGet {
        inner: mem.clone(),
        key: "k".into(),
        etag: parking_lot::Mutex::new(None),
        gate: Gate::new(false),
    });
    let cache = tempfile::tempdir().unwrap();
    let fs = Fs::new(store.clone(), crate::support::config(&cache));
    let a = fs.lookup(ROOT_INO, OsStr::new("k")).await.unwrap();
    let old = mem.head("k").await.unwrap().etag;
    let h = fs
        .open(a.ino, libc::O_RDONLY | libc::O_DIRECT)
        .await
        .unwrap();
    put(&mem, "k", b"new version").await;
    *store.etag.lock() = old;
    store.gate.arm();
    let first = tokio::spawn({
        let fs = fs.clone();
        async move { fs.read(a.ino, h.fh, 0, 64).await }
    });
    store.gate.reached().await;
    let second = tokio::spawn({
        let fs = fs.clone();
        async move { fs.read(a.ino, h.fh, 0, 64).await }
    });
    // The second looks at the inode and waits for the first's reader.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    store.gate.open();
    assert_eq!(&first.await.unwrap().unwrap()[..], b"new version");
    assert_eq!(&second.await.unwrap().unwrap()[..], b"new version");
    fs.release(a.ino, h.fh).await.unwrap();
}

/// Another client deletes a file a descriptor here has open and has read whole: once what the
/// mount knew is out of date, `fstat` of the descriptor (and the kernel's size check before
/// the read that finds the end, which `cat` makes) failed with ENOENT. Through the
/// descriptor the file keeps its attributes; by name it is gone.
#[tokio::test]
async fn a_file_deleted_elsewhere_keeps_its_attributes_for_its_descriptors() {
    let e = env();
    put(&e.mem, "f", b"contents").await;
    let a = e.fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    let h = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    assert_eq!(
        &e.fs.read(a.ino, h.fh, 0, 64).await.unwrap()[..],
        b"contents"
    );
    e.mem.delete("f").await.unwrap();
    e.fs.refresh(a.ino).unwrap();
    // The kernel's size check before a read, and `fstat`.
    assert_eq!(e.fs.getattr(a.ino).await.unwrap().size, 8);
    assert_eq!(
        e.fs.lookup(ROOT_INO, OsStr::new("f")).await,
        Err(FsError::ENOENT)
    );
    e.fs.release(a.ino, h.fh).await.unwrap();
}

/// Another client deletes a file a descriptor is reading: its next read that needs the store
/// gets `ESTALE`, as SEMANTICS says (the pinned GET's 404 gave `ENOENT`, which a program
/// takes for a missing path, not a file gone from under it).
#[tokio::test]
async fn a_read_of_a_file_deleted_elsewhere_gets_estale() {
    let e = env();
    let data = random(16 * MIB as usize, 7);
    put(&e.mem, "gone", &data).await;
    let a = e.fs.lookup(ROOT_INO, OsStr::new("gone")).await.unwrap();
    let h =
        e.fs.open(a.ino, libc::O_RDONLY | libc::O_DIRECT)
            .await
            .unwrap();
    let head = e.fs.read(a.ino, h.fh, 0, 4096).await.unwrap();
    assert!(head[..] == data[..4096]);
    e.mem.delete("gone").await.unwrap();
    let r = e.fs.read(a.ino, h.fh, 15 * MIB, 4096).await;
    assert_eq!(r, Err(FsError(libc::ESTALE)));
    e.fs.release(a.ino, h.fh).await.unwrap();
}

/// A descriptor that found another client's version at its first read (its GET refused, the
/// new version pinned) and read it, reads on through the state of a writer that opens
/// afterwards, built on that same version, and after that writer's fsync and close: it never
/// saw another version, and this mount's changes are none.
#[tokio::test]
async fn a_reader_of_the_version_a_writers_state_builds_on_reads_on_through_it() {
    let e = env();
    put(&e.mem, "k", b"v1v1").await;
    let a = e.fs.lookup(ROOT_INO, OsStr::new("k")).await.unwrap();
    let r =
        e.fs.open(a.ino, libc::O_RDONLY | libc::O_DIRECT)
            .await
            .unwrap();
    put(&e.mem, "k", b"v2v2").await;
    assert_eq!(&e.fs.read(a.ino, r.fh, 0, 2).await.unwrap()[..], b"v2");
    let w =
        e.fs.open(a.ino, libc::O_WRONLY | libc::O_APPEND)
            .await
            .unwrap();
    assert_eq!(&e.fs.read(a.ino, r.fh, 2, 2).await.unwrap()[..], b"v2");
    e.fs.write(a.ino, w.fh, 4, Bytes::from_static(b"++"))
        .await
        .unwrap();
    e.fs.fsync(a.ino, w.fh).await.unwrap();
    assert_eq!(&e.fs.read(a.ino, r.fh, 0, 8).await.unwrap()[..], b"v2v2++");
    e.fs.release(a.ino, w.fh).await.unwrap();
    assert_eq!(&e.fs.read(a.ino, r.fh, 0, 8).await.unwrap()[..], b"v2v2++");
    e.fs.release(a.ino, r.fh).await.unwrap();
}

/// MinIO answers a ranged GET that starts past an object's end with 416 before it checks
/// `If-Match`, and the store reads a 416 as the end of the file: a GET pinned to a version
/// that another client replaced with a shorter one comes back short, not refused.
struct RangeBeforeIfMatch {
    inner: Arc<bucketfs_store::memory::MemoryStore>,
}

impl RangeBeforeIfMatch {
    /// The condition the store checks for `range` of `key`: none past the object's end.
    async fn checked<'a>(
        &self,
        key: &str,
        range: &std::ops::Range<u64>,
        if_match: Option<&'a str>,
    ) -> bucketfs_store::StoreResult<Option<&'a str>> {
        let len = self.inner.head(key).await?.size;
        Ok(if_match.filter(|_| range.start < len))
    }
}

#[async_trait::async_trait]
impl bucketfs_store::layer::StoreLayer for RangeBeforeIfMatch {
    type Inner = bucketfs_store::memory::MemoryStore;
    fn inner(&self) -> &Self::Inner {
        &self.inner
    }
    async fn get_range(
        &self,
        key: &str,
        range: std::ops::Range<u64>,
        if_match: Option<&str>,
    ) -> bucketfs_store::StoreResult<Bytes> {
        let if_match = self.checked(key, &range, if_match).await?;
        self.inner.get_range(key, range, if_match).await
    }
    async fn get_range_into(
        &self,
        key: &str,
        range: std::ops::Range<u64>,
        if_match: Option<&str>,
        dst: &mut [u8],
    ) -> bucketfs_store::StoreResult<usize> {
        let if_match = self.checked(key, &range, if_match).await?;
        self.inner.get_range_into(key, range, if_match, dst).await
    }
}

/// Another client replaces a file with an empty one (after a descriptor open for writing
/// here found it deleted: `ESTALE`, the kernel's pages dropped): the next open for reading
/// reads it, empty. The GET pinned to the old version came back short on MinIO (see
/// [`RangeBeforeIfMatch`]), which was `EIO`, silently, at every read until the TTL passed.
/// A body shorter than the version it was pinned to is another version: read anew.
#[tokio::test]
async fn a_file_replaced_by_an_empty_one_reads_empty_on_a_store_checking_ranges_first() {
    let mem = Arc::new(bucketfs_store::memory::MemoryStore::new());
    put(&mem, "f", &[b'A'; 100]).await;
    let cache = tempfile::tempdir().unwrap();
    let fs = Fs::new(
        Arc::new(RangeBeforeIfMatch { inner: mem.clone() }),
        crate::support::config(&cache),
    );
    let a = fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    let h = fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    assert_eq!(fs.read(a.ino, h.fh, 0, 4096).await.unwrap().len(), 100);
    fs.release(a.ino, h.fh).await.unwrap();
    mem.delete("f").await.unwrap();
    let h = fs.open(a.ino, libc::O_RDWR).await.unwrap();
    assert_eq!(
        fs.read(a.ino, h.fh, 0, 4096).await,
        Err(FsError(libc::ESTALE))
    );
    fs.flush(a.ino, h.fh).await.unwrap();
    fs.release(a.ino, h.fh).await.unwrap();
    put(&mem, "f", b"").await;
    let h = fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    assert_eq!(fs.read(a.ino, h.fh, 0, 4096).await, Ok(Bytes::new()));
    fs.release(a.ino, h.fh).await.unwrap();
    // And a writer's state built on the old version: its read of the base is refused too.
    put(&mem, "g", &[b'B'; 100]).await;
    let g = fs.lookup(ROOT_INO, OsStr::new("g")).await.unwrap();
    let h = fs.open(g.ino, libc::O_RDWR).await.unwrap();
    put(&mem, "g", b"").await;
    assert_eq!(
        fs.read(g.ino, h.fh, 0, 4096).await,
        Err(FsError(libc::ESTALE))
    );
    fs.release(g.ino, h.fh).await.unwrap();
}

/// Inodes the kernel was told have stale attributes, in order.
fn record_stale_attrs(fs: &Fs) -> Arc<parking_lot::Mutex<Vec<u64>>> {
    let told = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let t = told.clone();
    fs.on_stale_cache(Some(Arc::new(move |ino| t.lock().push(ino))));
    told
}

/// Waits up to 5 s for `n` notices.
async fn told_at_least(told: &parking_lot::Mutex<Vec<u64>>, n: usize) {
    for _ in 0..500 {
        if told.lock().len() >= n {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("{n} notices expected, got {:?}", told.lock());
}

/// A lookup (a stat, a listing) that learns another client's larger version of a file tells
/// the kernel its attributes are stale a little after its reply, not inside it: the kernel
/// drops a reply that races one of its own attribute updates (a short read's among them) and
/// keeps the old size valid for the TTL while reads serve the new version, so a reader
/// stopped at the old size (the new version cut short, a version nobody wrote: about once in
/// 500,000 reads of a file replaced every 75 ms) and an mmap of fstat's size mapped a
/// prefix. Inside the request the notice makes the kernel drop that very reply every time
/// (an lseek(SEEK_END) or mmap after it acts on the old size). A smaller version is not told:
/// the kernel shrinks its size itself at the short read that ends it, which a notice racing
/// that read would make it refuse (the rest of the page read as zeros). One larger than the
/// smaller one is, again.
#[tokio::test]
async fn a_lookup_learning_a_larger_version_tells_the_kernel_after_its_reply() {
    let e = env();
    put(&e.mem, "f", &[b'A'; 43]).await;
    let a = e.fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    let told = record_stale_attrs(&e.fs);
    put(&e.mem, "f", &[b'B'; 5042]).await;
    e.fs.refresh(a.ino).unwrap();
    let b = e.fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    assert_eq!((b.ino, b.size), (a.ino, 5042));
    assert!(told.lock().is_empty(), "not inside the lookup's reply");
    told_at_least(&told, 1).await;
    // The same version again: nothing to tell.
    e.fs.refresh(a.ino).unwrap();
    e.fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    assert_eq!(*told.lock(), vec![a.ino]);
    // A smaller one.
    put(&e.mem, "f", &[b'C'; 43]).await;
    e.fs.refresh(a.ino).unwrap();
    let c = e.fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    assert_eq!(c.size, 43);
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    assert_eq!(told.lock().len(), 1, "a smaller version");
    // Larger than that one.
    put(&e.mem, "f", &[b'D'; 100]).await;
    e.fs.refresh(a.ino).unwrap();
    e.fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    told_at_least(&told, 2).await;
    assert_eq!(*told.lock(), vec![a.ino, a.ino]);
    // A larger one, then at once a smaller one: the notice for the larger is not sent (it
    // would race the read that ends the smaller one, whose shrink of the size it needs).
    put(&e.mem, "f", &[b'E'; 5042]).await;
    e.fs.refresh(a.ino).unwrap();
    e.fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    put(&e.mem, "f", &[b'F'; 43]).await;
    e.fs.refresh(a.ino).unwrap();
    e.fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    assert_eq!(
        told.lock().len(),
        2,
        "a larger version's notice after a smaller one"
    );
}

/// The first read of another client's larger version through a descriptor tells the kernel
/// its attributes are stale when it ends before the version's end: the kernel may still hold
/// the smaller size (the reply that told it the new one dropped, see above), hand the caller
/// bytes up to it and stop there. Told, its next read past that size asks it again and
/// reads on. Once per descriptor, a read ending short at the version's end too (the kernel
/// cannot hold more here: see the next test); not for a version the kernel was told by the
/// reply that created its inode, nor T after the version was learnt.
#[tokio::test]
async fn the_first_read_of_a_larger_version_tells_the_kernel_when_it_may_hold_less() {
    const TTL: std::time::Duration = std::time::Duration::from_secs(2);
    let e = crate::support::env_with(Default::default(), |c| FsConfig { stat_ttl: TTL, ..c });
    put(&e.mem, "f", &[b'A'; 10_000]).await;
    let a = e.fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    let told = record_stale_attrs(&e.fs);
    let h = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    assert_eq!(e.fs.read(a.ino, h.fh, 0, 4096).await.unwrap().len(), 4096);
    e.fs.release(a.ino, h.fh).await.unwrap();
    assert!(
        told.lock().is_empty(),
        "the version its inode was made with"
    );

    put(&e.mem, "f", &[b'B'; 20_000]).await;
    e.fs.refresh(a.ino).unwrap();
    e.fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    told_at_least(&told, 1).await; // the lookup's, after its reply
    let h = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    assert_eq!(
        e.fs.read(a.ino, h.fh, 0, 4096).await.unwrap(),
        vec![b'B'; 4096]
    );
    assert_eq!(told.lock().len(), 2, "the first read of the descriptor");
    e.fs.read(a.ino, h.fh, 4096, 4096).await.unwrap();
    assert_eq!(told.lock().len(), 2, "once per descriptor");
    e.fs.release(a.ino, h.fh).await.unwrap();
    // A first read that ends short, at the version's end.
    let h = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    assert_eq!(
        e.fs.read(a.ino, h.fh, 0, 32_768).await.unwrap().len(),
        20_000
    );
    e.fs.release(a.ino, h.fh).await.unwrap();
    assert_eq!(told.lock().len(), 3, "a read ending short");
    // Another descriptor's first read, full and ending at the version's end: the kernel may
    // still hold the smaller size.
    let h = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    e.fs.read(a.ino, h.fh, 16_384, 3_616).await.unwrap();
    e.fs.release(a.ino, h.fh).await.unwrap();
    assert_eq!(*told.lock(), vec![a.ino; 4]);
    // T after the version was learnt, every size the kernel was told before it has expired:
    // nothing to tell (before, each open of the file told it again, for good).
    tokio::time::sleep(TTL).await;
    let h = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    e.fs.read(a.ino, h.fh, 0, 4096).await.unwrap();
    e.fs.release(a.ino, h.fh).await.unwrap();
    assert_eq!(told.lock().len(), 4, "T after the version was learnt");
}

/// The first read of a version that fits in the page the kernel asks for ends short. The
/// kernel shrinks the size it holds to that end if it holds more, and a notice racing the
/// read would make it refuse (the page then holds zeros up to the size it kept), so such a
/// read tells the kernel only when every size it may hold is the version's or less: then it
/// keeps the smaller one, and a reader stops there (a 2,000-byte version that replaced a
/// 43-byte one read as its first 43 bytes, 4 times in 8.7 million reads of a file replaced
/// every 75 ms, when only the lookup's notice, taken back by a later version, told it).
#[tokio::test]
async fn a_short_first_read_tells_the_kernel_only_when_it_cannot_hold_more() {
    const TTL: std::time::Duration = std::time::Duration::from_secs(2);
    let e = crate::support::env_with(Default::default(), |c| FsConfig { stat_ttl: TTL, ..c });
    put(&e.mem, "small", &[b'A'; 43]).await;
    put(&e.mem, "shrunk", &[b'A'; 43]).await;
    let small = e.fs.lookup(ROOT_INO, OsStr::new("small")).await.unwrap();
    let shrunk = e.fs.lookup(ROOT_INO, OsStr::new("shrunk")).await.unwrap();
    // No hook during the lookups: only the reads' notices are looked at here.
    let told = Arc::new(parking_lot::Mutex::new(Vec::new()));
    put(&e.mem, "small", &[b'B'; 2000]).await;
    put(&e.mem, "shrunk", &[b'B'; 5042]).await;
    for ino in [small.ino, shrunk.ino] {
        e.fs.refresh(ino).unwrap();
    }
    e.fs.lookup(ROOT_INO, OsStr::new("small")).await.unwrap();
    e.fs.lookup(ROOT_INO, OsStr::new("shrunk")).await.unwrap();
    put(&e.mem, "shrunk", &[b'C'; 2000]).await;
    e.fs.refresh(shrunk.ino).unwrap();
    e.fs.lookup(ROOT_INO, OsStr::new("shrunk")).await.unwrap();
    let t = told.clone();
    e.fs.on_stale_cache(Some(Arc::new(move |ino| t.lock().push(ino))));

    // 43 -> 2,000 bytes: the kernel holds 43 or 2,000, never more.
    let h = e.fs.open(small.ino, libc::O_RDONLY).await.unwrap();
    let got = e.fs.read(small.ino, h.fh, 0, 4096).await.unwrap();
    assert_eq!(got, vec![b'B'; 2000]);
    e.fs.release(small.ino, h.fh).await.unwrap();
    assert_eq!(
        *told.lock(),
        vec![small.ino],
        "a version the kernel cannot hold more of"
    );
    // 43 -> 5,042 -> 2,000 bytes: the kernel may hold 5,042 and must take the shrink.
    let h = e.fs.open(shrunk.ino, libc::O_RDONLY).await.unwrap();
    let got = e.fs.read(shrunk.ino, h.fh, 0, 4096).await.unwrap();
    assert_eq!(got, vec![b'C'; 2000]);
    e.fs.release(shrunk.ino, h.fh).await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    assert_eq!(
        *told.lock(),
        vec![small.ino],
        "a version the kernel may hold more of"
    );
}

/// A version learnt T after the kernel was told a larger one is measured against that one
/// alone: the smaller sizes before it are no longer valid in the kernel (it asks again before
/// using them). Before, the least of them was kept for the inode's life, so after one growth
/// every later version above it, a smaller one too, was told, and its first read told again:
/// the notices a smaller version must not get (they race the short read whose shrink of the
/// size the kernel needs).
#[tokio::test]
async fn a_version_learnt_t_after_a_larger_one_is_measured_against_it_alone() {
    const TTL: std::time::Duration = std::time::Duration::from_millis(300);
    let e = crate::support::env_with(Default::default(), |c| FsConfig { stat_ttl: TTL, ..c });
    put(&e.mem, "f", &[b'A'; 43]).await;
    let a = e.fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    let told = record_stale_attrs(&e.fs);
    put(&e.mem, "f", &[b'B'; 5042]).await;
    e.fs.refresh(a.ino).unwrap();
    e.fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    told_at_least(&told, 1).await;
    tokio::time::sleep(TTL + std::time::Duration::from_millis(100)).await;
    put(&e.mem, "f", &[b'C'; 2000]).await;
    e.fs.refresh(a.ino).unwrap();
    assert_eq!(
        e.fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap().size,
        2000
    );
    let h = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    assert_eq!(e.fs.read(a.ino, h.fh, 0, 1024).await.unwrap().len(), 1024);
    e.fs.release(a.ino, h.fh).await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    assert_eq!(
        told.lock().len(),
        1,
        "a smaller version, T after the larger one"
    );
}
