//! Writes and publishing: single PUTs, streamed parts, appends, truncates, fsync.

use crate::support::{
    counter, env, object, put, random, read_all, write_file, write_mib, write_open, ME, MIB,
};
use bucketfs_fs::{FsError, Now, SetAttr, ROOT_INO};
use bucketfs_store::metrics::Op;
use bucketfs_store::ObjectStore;
use bytes::Bytes;
use rand::{Rng, SeedableRng};
use std::ffi::OsStr;

#[tokio::test]
async fn small_file_is_one_put_with_s3fs_metadata() {
    let e = env();
    let data = random(128 * 1024, 1);
    write_file(&e.fs, "a.bin", &data).await;
    assert_eq!(e.metrics.requests(Op::Put), 1);
    assert_eq!(e.metrics.requests(Op::CreateMultipart), 0);
    assert_eq!(object(&e.mem, "a.bin").await, data);
    let m = e.mem.head("a.bin").await.unwrap();
    assert_eq!(m.user["mode"], (libc::S_IFREG | 0o644).to_string());
    assert_eq!(m.user["uid"], "1000");
    assert_eq!(m.user["gid"], "100");
    assert!(m.user["mtime"].parse::<f64>().unwrap() > 1.6e9);
    assert_eq!(read_all(&e.fs, "a.bin").await, data);
}

#[tokio::test]
async fn empty_file_is_published() {
    let e = env();
    write_file(&e.fs, "empty", &[]).await;
    assert_eq!(object(&e.mem, "empty").await, Vec::<u8>::new());
}

/// Two processes on this mount create the same new name at once: the kernel sends both a
/// create (the name was missing for both lookups). The second finds the file the first made
/// and opens it, as open(2) with O_CREAT and without O_TRUNC does: what the first wrote stays.
#[tokio::test]
async fn a_racing_create_without_o_trunc_keeps_what_the_first_wrote() {
    let e = env();
    let name = OsStr::new("race");
    let flags = libc::O_WRONLY | libc::O_CREAT;
    let (a, first) =
        e.fs.create(ROOT_INO, name, 0o644, 0, flags, ME)
            .await
            .unwrap();
    e.fs.write(a.ino, first.fh, 0, Bytes::from_static(b"first writer"))
        .await
        .unwrap();
    let (b, second) =
        e.fs.create(ROOT_INO, name, 0o644, 0, flags, ME)
            .await
            .unwrap();
    assert_eq!(a.ino, b.ino);
    assert_eq!(b.size, 12, "the second create truncated the file");
    for fh in [first.fh, second.fh] {
        e.fs.flush(a.ino, fh).await.unwrap();
        e.fs.release(a.ino, fh).await.unwrap();
    }
    assert_eq!(object(&e.mem, "race").await, b"first writer");
    // With O_TRUNC, the second create does truncate, as open(2) would.
    let (_, third) =
        e.fs.create(ROOT_INO, name, 0o644, 0, flags | libc::O_TRUNC, ME)
            .await
            .unwrap();
    e.fs.flush(a.ino, third.fh).await.unwrap();
    e.fs.release(a.ino, third.fh).await.unwrap();
    assert_eq!(object(&e.mem, "race").await, b"");
}

#[tokio::test]
async fn sequential_write_streams_parts_before_close() {
    let e = env();
    let data = random(23 * MIB as usize + 7, 2);
    let (attr, open) =
        e.fs.create(ROOT_INO, OsStr::new("big"), 0o644, 0, libc::O_WRONLY, ME)
            .await
            .unwrap();
    write_mib(&e.fs, attr.ino, open.fh, 0, &data).await;
    // Four full 5 MiB parts went up while writing; nothing is visible yet.
    assert_eq!(e.mem.pending_uploads(), 1);
    assert!(e.mem.head("big").await.is_err());
    e.fs.flush(attr.ino, open.fh).await.unwrap();
    e.fs.release(attr.ino, open.fh).await.unwrap();
    assert_eq!(e.metrics.requests(Op::UploadPart), 5);
    assert_eq!(e.mem.pending_uploads(), 0);
    assert_eq!(object(&e.mem, "big").await, data);
    assert_eq!(read_all(&e.fs, "big").await, data);
    // Every byte was sent exactly once.
    assert_eq!(e.metrics.bytes_up(), data.len() as u64);
}

#[tokio::test]
async fn writes_done_in_the_calling_thread_stream_like_the_others() {
    let e = env();
    let data = random(23 * MIB as usize + 7, 5);
    let (attr, open) =
        e.fs.create(ROOT_INO, OsStr::new("big"), 0o644, 0, libc::O_WRONLY, ME)
            .await
            .unwrap();
    // 1 MiB writes, except one odd-sized pair around the second part boundary, which the
    // calling thread cannot take (it crosses the part's end) and the async path then does.
    let mut cuts: Vec<usize> = (0..=23).map(|m| m * MIB as usize).collect();
    cuts.retain(|&c| c != 10 * MIB as usize);
    cuts.push(10 * MIB as usize + 4096);
    cuts.push(data.len());
    cuts.sort();
    let (mut now, mut later) = (0, Vec::new());
    for w in cuts.windows(2) {
        let chunk = &data[w[0]..w[1]];
        match e
            .fs
            .write_now(attr.ino, open.fh, w[0] as u64, chunk, false, false)
        {
            Now::Done(r) => {
                r.unwrap();
                now += 1;
            }
            Now::Later(task) => {
                task.await.unwrap();
                later.push(w[0] as u64 / MIB);
            }
        }
    }
    // The writes that fill parts 1, 3 and 4 were appended in the calling thread and their
    // parts shipped by the task; part 2's boundary write (at 9 MiB) was all the task's.
    assert_eq!(later, [4, 9, 14, 19]);
    assert_eq!(now + later.len(), cuts.len() - 1);
    assert_eq!(e.mem.pending_uploads(), 1);
    assert!(e.mem.head("big").await.is_err());
    e.fs.flush(attr.ino, open.fh).await.unwrap();
    e.fs.release(attr.ino, open.fh).await.unwrap();
    assert_eq!(object(&e.mem, "big").await, data);
    assert_eq!(e.metrics.requests(Op::UploadPart), 5);
    // Every byte was sent exactly once: no part went through the staging file again.
    assert_eq!(e.metrics.bytes_up(), data.len() as u64);
}

#[tokio::test]
async fn fsync_with_nothing_to_upload_is_answered_at_once() {
    let e = env();
    put(&e.mem, "ro", b"old").await;
    let ro = e.fs.lookup(ROOT_INO, OsStr::new("ro")).await.unwrap();
    let h = e.fs.open(ro.ino, libc::O_RDONLY).await.unwrap();
    assert!(matches!(
        e.fs.publish_now(ro.ino, h.fh, false),
        Now::Done(Ok(()))
    ));
    assert!(matches!(
        e.fs.publish_now(ro.ino, h.fh + 1000, false),
        Now::Done(Err(FsError::EBADF))
    ));

    // A new file must reach the store at its first flush, even empty: not answered here.
    let (attr, open) =
        e.fs.create(ROOT_INO, OsStr::new("w"), 0o644, 0, libc::O_WRONLY, ME)
            .await
            .unwrap();
    assert!(matches!(
        e.fs.publish_now(attr.ino, open.fh, false),
        Now::Later(_)
    ));
    e.fs.fsync(attr.ino, open.fh).await.unwrap();
    assert!(matches!(
        e.fs.publish_now(attr.ino, open.fh, false),
        Now::Done(Ok(()))
    ));
    // A write makes it dirty again; once published, clean again with no further request.
    e.fs.write(attr.ino, open.fh, 0, Bytes::from_static(b"new"))
        .await
        .unwrap();
    assert!(matches!(
        e.fs.publish_now(attr.ino, open.fh, false),
        Now::Later(_)
    ));
    e.fs.fsync(attr.ino, open.fh).await.unwrap();
    let puts = e.metrics.requests(Op::Put);
    assert!(matches!(
        e.fs.publish_now(attr.ino, open.fh, false),
        Now::Done(Ok(()))
    ));
    e.fs.flush(attr.ino, open.fh).await.unwrap();
    assert_eq!(e.metrics.requests(Op::Put), puts);
    assert_eq!(object(&e.mem, "w").await, b"new");
}

/// An fsync through a descriptor open for reading (`sync FILE`, which opens the file
/// read-only) stores what another descriptor of the file wrote, as on a local disk: it
/// returned 0 and stored nothing.
#[tokio::test]
async fn an_fsync_through_a_read_only_descriptor_stores_the_writers_changes() {
    let e = env();
    let (attr, w) =
        e.fs.create(ROOT_INO, OsStr::new("f"), 0o644, 0, libc::O_WRONLY, ME)
            .await
            .unwrap();
    e.fs.write(attr.ino, w.fh, 0, Bytes::from_static(b"written"))
        .await
        .unwrap();
    let r = e.fs.open(attr.ino, libc::O_RDONLY).await.unwrap();
    match e.fs.publish_now(attr.ino, r.fh, true) {
        Now::Done(d) => d.unwrap(),
        Now::Later(f) => f.await.unwrap(),
    }
    assert_eq!(object(&e.mem, "f").await, b"written");
    // A flush (a close) of the reader stores nothing of the writer's.
    e.fs.write(attr.ino, w.fh, 7, Bytes::from_static(b" more"))
        .await
        .unwrap();
    let puts = e.metrics.requests(Op::Put);
    assert!(matches!(
        e.fs.publish_now(attr.ino, r.fh, false),
        Now::Done(Ok(()))
    ));
    assert_eq!(e.metrics.requests(Op::Put), puts);
}

#[tokio::test]
async fn truncate_to_the_same_size_sends_nothing() {
    let e = env();
    let data = random(11 * MIB as usize, 6);
    put(&e.mem, "same", &data).await;
    let attr = e.fs.lookup(ROOT_INO, OsStr::new("same")).await.unwrap();
    let h = e.fs.open(attr.ino, libc::O_WRONLY).await.unwrap();
    let before = e.metrics.total_requests();
    let size = |n| SetAttr {
        size: Some(n),
        ..Default::default()
    };
    e.fs.setattr(attr.ino, Some(h.fh), size(data.len() as u64))
        .await
        .unwrap();
    e.fs.flush(attr.ino, h.fh).await.unwrap();
    e.fs.release(attr.ino, h.fh).await.unwrap();
    // Re-publishing would have copied all three parts server-side.
    assert_eq!(e.metrics.total_requests(), before);
    // truncate(2) by path to the same size, with a chmod: only the metadata changes.
    let a =
        e.fs.setattr(
            attr.ino,
            None,
            SetAttr {
                mode: Some(0o600),
                ..size(data.len() as u64)
            },
        )
        .await
        .unwrap();
    assert_eq!(a.perm & 0o777, 0o600);
    let m = e.mem.head("same").await.unwrap();
    assert_eq!(m.user["mode"], (libc::S_IFREG | 0o600).to_string());
    assert_eq!(object(&e.mem, "same").await, data);
}

#[tokio::test]
async fn append_to_large_object_copies_unchanged_parts() {
    let e = env();
    let mut data = random(21 * MIB as usize, 3);
    put(&e.mem, "log", &data).await;
    let attr = e.fs.lookup(ROOT_INO, OsStr::new("log")).await.unwrap();
    let h =
        e.fs.open(attr.ino, libc::O_WRONLY | libc::O_APPEND)
            .await
            .unwrap();
    let tail = random(1024, 4);
    e.fs.write(attr.ino, h.fh, 0, Bytes::copy_from_slice(&tail))
        .await
        .unwrap();
    let up_before = e.metrics.bytes_up();
    e.fs.flush(attr.ino, h.fh).await.unwrap();
    e.fs.release(attr.ino, h.fh).await.unwrap();
    data.extend_from_slice(&tail);
    assert_eq!(object(&e.mem, "log").await, data);
    // Parts 1-4 copied server-side; only the last 1 MiB + 1 KiB part was sent.
    assert_eq!(e.metrics.requests(Op::UploadPartCopy), 4);
    assert!(e.metrics.bytes_up() - up_before < 2 * MIB);
}

#[tokio::test]
async fn random_writes_and_truncates_match_a_model() {
    let e = env();
    let mut model = random(12 * MIB as usize, 5);
    put(&e.mem, "f", &model).await;
    let attr = e.fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    let h = e.fs.open(attr.ino, libc::O_RDWR).await.unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(6);
    for step in 0..40 {
        if step % 7 == 3 {
            let n = rng.gen_range(0..16 * MIB as usize);
            model.resize(n, 0);
            e.fs.setattr(
                attr.ino,
                Some(h.fh),
                SetAttr {
                    size: Some(n as u64),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        } else {
            let off = rng.gen_range(0..14 * MIB as usize);
            let len = rng.gen_range(1..300_000);
            let buf = random(len, step);
            if model.len() < off + len {
                model.resize(off + len, 0);
            }
            model[off..off + len].copy_from_slice(&buf);
            e.fs.write(attr.ino, h.fh, off as u64, Bytes::from(buf))
                .await
                .unwrap();
        }
        if step % 10 == 9 {
            // Reads through the handle see staged and clean bytes together.
            let off = rng.gen_range(0..model.len().max(1));
            let got =
                e.fs.read(attr.ino, h.fh, off as u64, 200_000)
                    .await
                    .unwrap();
            let end = (off + 200_000).min(model.len());
            assert_eq!(&got[..], &model[off.min(end)..end]);
            e.fs.fsync(attr.ino, h.fh).await.unwrap();
            assert_eq!(object(&e.mem, "f").await, model);
        }
    }
    e.fs.flush(attr.ino, h.fh).await.unwrap();
    e.fs.release(attr.ino, h.fh).await.unwrap();
    assert_eq!(object(&e.mem, "f").await, model);
    assert_eq!(e.mem.pending_uploads(), 0);
}

#[tokio::test]
async fn truncate_by_path_publishes_at_once() {
    let e = env();
    put(&e.mem, "t", b"hello world").await;
    let attr = e.fs.lookup(ROOT_INO, OsStr::new("t")).await.unwrap();
    let a =
        e.fs.setattr(
            attr.ino,
            None,
            SetAttr {
                size: Some(5),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(a.size, 5);
    assert_eq!(object(&e.mem, "t").await, b"hello");
}

#[tokio::test]
async fn overwriting_an_existing_file_from_the_start_streams_too() {
    let e = env();
    put(&e.mem, "o", &random(30 * MIB as usize, 30)).await;
    let a = e.fs.lookup(ROOT_INO, OsStr::new("o")).await.unwrap();
    // No O_TRUNC: the object is the base, but every part is rewritten whole.
    let h = e.fs.open(a.ino, libc::O_WRONLY).await.unwrap();
    let data = random(30 * MIB as usize, 31);
    write_mib(&e.fs, a.ino, h.fh, 0, &data).await;
    // Parts started going up while writing (the multipart upload is open).
    assert_eq!(e.mem.pending_uploads(), 1);
    e.fs.flush(a.ino, h.fh).await.unwrap();
    e.fs.release(a.ino, h.fh).await.unwrap();
    assert_eq!(object(&e.mem, "o").await, data);
    assert_eq!(e.metrics.requests(Op::UploadPartCopy), 0);
    assert_eq!(e.metrics.bytes_up(), data.len() as u64);
}

#[tokio::test]
async fn files_open_for_writing_keep_fetched_and_published_bytes_on_disk() {
    let e = env();
    let mut model = random(MIB as usize, 60);
    put(&e.mem, "db", &model).await;
    let a = e.fs.lookup(ROOT_INO, OsStr::new("db")).await.unwrap();
    let h = e.fs.open(a.ino, libc::O_RDWR).await.unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(61);
    // Random 16 KiB reads (as sysbench does on files it opens O_RDWR).
    for _ in 0..200 {
        let off = rng.gen_range(0..64u64) * 16384;
        let b = e.fs.read(a.ino, h.fh, off, 16384).await.unwrap();
        assert_eq!(&b[..], &model[off as usize..off as usize + 16384]);
    }
    // 1 MiB in 128 KiB blocks: at most 8 GETs, however many reads.
    assert!(e.metrics.requests(Op::Get) <= 8);
    // Random writes, each followed by fsync: after the first upload nothing is fetched again.
    for i in 0..30 {
        let off = rng.gen_range(0..64usize) * 16384;
        let buf = random(16384, 100 + i);
        model[off..off + 16384].copy_from_slice(&buf);
        e.fs.write(a.ino, h.fh, off as u64, Bytes::from(buf))
            .await
            .unwrap();
        e.fs.fsync(a.ino, h.fh).await.unwrap();
    }
    assert!(
        e.metrics.requests(Op::Get) <= 8,
        "{}",
        e.metrics.requests(Op::Get)
    );
    assert_eq!(object(&e.mem, "db").await, model);
    e.fs.release(a.ino, h.fh).await.unwrap();
}

/// Every streamed part is also copied to the staging file, so reading it back before close
/// needs no request and publishes nothing: the key never holds a half-written file.
#[tokio::test]
async fn streamed_parts_are_read_back_locally_without_publishing() {
    let e = env();
    let mut data = random(23 * MIB as usize, 70);
    let (ino, fh) = write_open(&e.fs, "big", &data).await;
    // Parts 1-4 (5 MiB each) went up, each copied to the staging file; nothing is visible.
    assert_eq!(counter(&e.fs, |m| &m.staged_bytes), 20 * MIB);
    let gets = e.metrics.requests(Op::Get);
    for at in [0, 7 * MIB, 12 * MIB, 19 * MIB + 4095, 22 * MIB] {
        let b = e.fs.read(ino, fh, at, 1 << 20).await.unwrap();
        assert_eq!(&b[..], &data[at as usize..at as usize + b.len()], "at {at}");
    }
    assert!(e.mem.head("big").await.is_err(), "published for a read");
    assert_eq!(e.metrics.requests(Op::Get), gets);
    assert_eq!(e.metrics.requests(Op::Put), 0);
    assert_eq!(e.metrics.requests(Op::CompleteMultipart), 0);
    let more = random(10 * MIB as usize, 71);
    write_mib(&e.fs, ino, fh, 23 * MIB, &more).await;
    data.extend_from_slice(&more);
    let b = e.fs.read(ino, fh, 26 * MIB, 1 << 20).await.unwrap();
    assert_eq!(&b[..], &data[26 * MIB as usize..27 * MIB as usize]);
    assert!(e.mem.head("big").await.is_err(), "published for a read");
    e.fs.flush(ino, fh).await.unwrap();
    e.fs.release(ino, fh).await.unwrap();
    assert_eq!(object(&e.mem, "big").await, data);
    assert_eq!(e.mem.pending_uploads(), 0);
}

/// A small rewrite inside a streamed part, and a truncate cutting one, keep every other byte.
#[tokio::test]
async fn rewriting_or_cutting_a_streamed_part_keeps_its_other_bytes() {
    let e = env();
    let mut data = random(23 * MIB as usize, 72);
    let (ino, fh) = write_open(&e.fs, "f", &data).await;
    e.fs.write(ino, fh, 7 * MIB + 3, Bytes::from_static(b"patched"))
        .await
        .unwrap();
    data[7 * MIB as usize + 3..7 * MIB as usize + 10].copy_from_slice(b"patched");
    e.fs.setattr(
        ino,
        Some(fh),
        SetAttr {
            size: Some(17 * MIB + 5),
            ..SetAttr::default()
        },
    )
    .await
    .unwrap();
    data.truncate(17 * MIB as usize + 5);
    e.fs.flush(ino, fh).await.unwrap();
    e.fs.release(ino, fh).await.unwrap();
    assert_eq!(object(&e.mem, "f").await, data);
    assert_eq!(e.mem.pending_uploads(), 0);
}

/// A file bigger than a part streams its parts into an upload created with the metadata of
/// the moment. A chmod, chown or utimens through the open file after that (`install -m`
/// does fchmod before its close) is stored at the close, by one copy of the object onto
/// itself; a later mount sees it. Before: the object kept the metadata of the upload's
/// start and the change was lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_changed_while_parts_stream_is_stored_at_close() {
    let e = env();
    let data = random(12 * MIB as usize, 31);
    let (a, h) =
        e.fs.create(ROOT_INO, OsStr::new("big"), 0o644, 0, libc::O_WRONLY, ME)
            .await
            .unwrap();
    write_mib(&e.fs, a.ino, h.fh, 0, &data).await;
    assert_eq!(e.metrics.requests(Op::CreateMultipart), 1, "parts stream");
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000_000);
    let set = SetAttr {
        mode: Some(0o751),
        uid: Some(42),
        mtime: Some(t),
        ..Default::default()
    };
    e.fs.setattr(a.ino, Some(h.fh), set).await.unwrap();
    e.fs.flush(a.ino, h.fh).await.unwrap();
    e.fs.release(a.ino, h.fh).await.unwrap();
    let m = e.mem.head("big").await.unwrap();
    assert_eq!(m.user["mode"], (libc::S_IFREG | 0o751).to_string());
    assert_eq!(m.user["uid"], "42");
    assert_eq!(m.user["mtime"], "1000000000");
    assert_eq!(object(&e.mem, "big").await, data);
    assert_eq!(e.metrics.requests(Op::Copy), 1);
    let cache = tempfile::tempdir().unwrap();
    let later = bucketfs_fs::Fs::new(e.mem.clone(), crate::support::config(&cache));
    let b = later.lookup(ROOT_INO, OsStr::new("big")).await.unwrap();
    assert_eq!((b.perm, b.uid, b.mtime), (0o751, 42, t));
    // The ETag this mount keeps is the copy's: a rewrite pinned to it is not refused.
    let h = e.fs.open(a.ino, libc::O_WRONLY).await.unwrap();
    e.fs.write(a.ino, h.fh, 0, Bytes::from_static(b"x"))
        .await
        .unwrap();
    e.fs.flush(a.ino, h.fh).await.unwrap();
    e.fs.release(a.ino, h.fh).await.unwrap();
    assert_eq!(object(&e.mem, "big").await[..1], *b"x");
}

/// A utimens during the write, then more writes: the mtime is a write's (POSIX), and no
/// copy is needed for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_after_a_utimens_while_streaming_sets_the_mtime_again() {
    let e = env();
    let data = random(12 * MIB as usize, 32);
    let (a, h) =
        e.fs.create(ROOT_INO, OsStr::new("big"), 0o644, 0, libc::O_WRONLY, ME)
            .await
            .unwrap();
    let started = std::time::SystemTime::now();
    write_mib(&e.fs, a.ino, h.fh, 0, &data[..6 * MIB as usize]).await;
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000_000);
    let set = SetAttr {
        mtime: Some(t),
        ..Default::default()
    };
    e.fs.setattr(a.ino, Some(h.fh), set).await.unwrap();
    write_mib(&e.fs, a.ino, h.fh, 6 * MIB, &data[6 * MIB as usize..]).await;
    e.fs.flush(a.ino, h.fh).await.unwrap();
    e.fs.release(a.ino, h.fh).await.unwrap();
    let cache = tempfile::tempdir().unwrap();
    let later = bucketfs_fs::Fs::new(e.mem.clone(), crate::support::config(&cache));
    let b = later.lookup(ROOT_INO, OsStr::new("big")).await.unwrap();
    assert!(
        b.mtime >= started - std::time::Duration::from_secs(1),
        "{:?}",
        b.mtime
    );
    assert_eq!(e.metrics.requests(Op::Copy), 0);
    assert_eq!(object(&e.mem, "big").await, data);
}

/// A rewrite (O_TRUNC) of an existing file bigger than a part stores a new mtime, not the
/// old object's (its metadata is where the upload's came from), and this mount shows the
/// mtime stored, as a later mount will. No copy: the upload is created with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rewrite_streamed_in_parts_stores_a_new_mtime() {
    let e = env();
    let mut old = bucketfs_store::UserMeta::new();
    old.insert("mtime".into(), "1000000000".into());
    old.insert("mode".into(), (libc::S_IFREG | 0o640).to_string());
    e.mem
        .put("big", Bytes::from_static(b"old"), &old)
        .await
        .unwrap();
    let a = e.fs.lookup(ROOT_INO, OsStr::new("big")).await.unwrap();
    let opened = std::time::SystemTime::now();
    let h =
        e.fs.open(a.ino, libc::O_WRONLY | libc::O_TRUNC)
            .await
            .unwrap();
    let data = random(12 * MIB as usize, 33);
    write_mib(&e.fs, a.ino, h.fh, 0, &data).await;
    e.fs.flush(a.ino, h.fh).await.unwrap();
    e.fs.release(a.ino, h.fh).await.unwrap();
    let here = e.fs.getattr(a.ino).await.unwrap();
    let cache = tempfile::tempdir().unwrap();
    let later = bucketfs_fs::Fs::new(e.mem.clone(), crate::support::config(&cache));
    let b = later.lookup(ROOT_INO, OsStr::new("big")).await.unwrap();
    assert!(b.mtime >= opened, "the old mtime was kept: {:?}", b.mtime);
    assert_eq!(
        here.mtime, b.mtime,
        "this mount shows another mtime than the bucket's"
    );
    assert_eq!(b.perm, 0o640);
    assert_eq!(e.metrics.requests(Op::Copy), 0);
    assert_eq!(object(&e.mem, "big").await, data);
}

/// `open(O_APPEND)`, then `fcntl(F_SETFL, 0)` and `pwrite(fd, .., 0)`: the write lands at 0,
/// as the write's own flags say; it landed at the end, from the flags of the open. And the
/// other way: `O_APPEND` set after the open sends writes to the end.
#[tokio::test]
async fn o_append_follows_the_descriptors_flags_of_each_write() {
    let e = env();
    put(&e.mem, "log", b"abc").await;
    let a = e.fs.lookup(ROOT_INO, OsStr::new("log")).await.unwrap();
    let h =
        e.fs.open(a.ino, libc::O_WRONLY | libc::O_APPEND)
            .await
            .unwrap();
    let write = |offset: u64, data: &'static [u8], append: bool| {
        let fs = e.fs.clone();
        async move {
            match fs.write_now(a.ino, h.fh, offset, data, false, append) {
                bucketfs_fs::Now::Done(r) => r,
                bucketfs_fs::Now::Later(task) => task.await,
            }
        }
    };
    write(0, b"d", true).await.unwrap(); // appended: abcd
    write(0, b"e", true).await.unwrap(); // abcde
    write(0, b"X", false).await.unwrap(); // O_APPEND cleared: at 0
                                          // One write's flags are that write's: the handle still appends for the others (another
                                          // thread's write on the descriptor).
    e.fs.write(a.ino, h.fh, 0, Bytes::from_static(b"f"))
        .await
        .unwrap();
    e.fs.flush(a.ino, h.fh).await.unwrap();
    e.fs.release(a.ino, h.fh).await.unwrap();
    assert_eq!(object(&e.mem, "log").await, b"Xbcdef");
}

/// At 5 MiB parts (this config's), 10,000 parts end at 5 MiB x 1,000 x 1,023 bytes, short of
/// the 5 TiB object limit: a write past that was accepted and failed only at close, after
/// all of it was written. It is EFBIG at once now, as a truncate past it.
#[tokio::test]
async fn a_write_past_what_the_parts_can_hold_is_efbig_at_once() {
    let e = crate::support::env();
    let largest: u64 = (5 << 20) * 1000 * 1023;
    let (a, h) =
        e.fs.create(ROOT_INO, OsStr::new("huge"), 0o644, 0, libc::O_WRONLY, ME)
            .await
            .unwrap();
    let r =
        e.fs.write(a.ino, h.fh, largest, Bytes::from_static(b"x"))
            .await;
    assert_eq!(r, Err(FsError::EFBIG));
    let set = SetAttr {
        size: Some(largest + 1),
        ..SetAttr::default()
    };
    assert_eq!(
        e.fs.setattr(a.ino, Some(h.fh), set).await.map(|_| ()),
        Err(FsError::EFBIG)
    );
    e.fs.flush(a.ino, h.fh).await.unwrap();
    e.fs.release(a.ino, h.fh).await.unwrap();
}

/// A program opens a file another process is half way through writing, for reading and
/// writing (`O_RDWR`: many do, to read), and closes it having written nothing: its close
/// stores nothing, so other clients never get the half-written file as a version; the
/// writer's close stores it whole. A descriptor that did write (or truncate) stores the
/// file at its close as before, what the other writer wrote so far included.
#[tokio::test]
async fn a_close_that_wrote_nothing_does_not_store_another_writers_half_file() {
    let e = env();
    put(&e.mem, "f", b"the old version").await;
    let attr = e.fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    let writer =
        e.fs.open(attr.ino, libc::O_WRONLY | libc::O_TRUNC)
            .await
            .unwrap();
    e.fs.write(attr.ino, writer.fh, 0, Bytes::from_static(b"first half, "))
        .await
        .unwrap();
    let puts = e.metrics.requests(Op::Put);
    for flags in [libc::O_RDWR, libc::O_WRONLY] {
        let idle = e.fs.open(attr.ino, flags).await.unwrap();
        assert!(matches!(
            e.fs.publish_now(attr.ino, idle.fh, false),
            Now::Done(Ok(()))
        ));
        e.fs.flush(attr.ino, idle.fh).await.unwrap();
        e.fs.release(attr.ino, idle.fh).await.unwrap();
    }
    assert_eq!(
        e.metrics.requests(Op::Put),
        puts,
        "a close that wrote nothing stored"
    );
    assert_eq!(object(&e.mem, "f").await, b"the old version");
    // A descriptor that changed the file stores it at its close, the other's bytes too.
    let other = e.fs.open(attr.ino, libc::O_RDWR).await.unwrap();
    e.fs.write(attr.ino, other.fh, 100, Bytes::from_static(b"!"))
        .await
        .unwrap();
    e.fs.flush(attr.ino, other.fh).await.unwrap();
    let stored = object(&e.mem, "f").await;
    assert_eq!(&stored[..12], b"first half, ");
    assert_eq!(stored.len(), 101);
    e.fs.release(attr.ino, other.fh).await.unwrap();
    e.fs.write(attr.ino, writer.fh, 12, Bytes::from_static(b"second half"))
        .await
        .unwrap();
    e.fs.flush(attr.ino, writer.fh).await.unwrap();
    e.fs.release(attr.ino, writer.fh).await.unwrap();
    assert_eq!(&object(&e.mem, "f").await[..23], b"first half, second half");
}

/// [`a_close_that_wrote_nothing_does_not_store_another_writers_half_file`]'s ftruncate:
/// a descriptor that only truncated the file changed it, and its close stores that.
#[tokio::test]
async fn a_close_after_an_ftruncate_stores_the_file() {
    let e = env();
    put(&e.mem, "f", b"0123456789").await;
    let attr = e.fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    let writer = e.fs.open(attr.ino, libc::O_WRONLY).await.unwrap();
    let cutter = e.fs.open(attr.ino, libc::O_WRONLY).await.unwrap();
    let cut = SetAttr {
        size: Some(4),
        ..SetAttr::default()
    };
    e.fs.setattr(attr.ino, Some(cutter.fh), cut).await.unwrap();
    e.fs.flush(attr.ino, cutter.fh).await.unwrap();
    assert_eq!(object(&e.mem, "f").await, b"0123");
    for fh in [cutter.fh, writer.fh] {
        e.fs.release(attr.ino, fh).await.unwrap();
    }
}

/// A file created here while another client makes an object at the same name (after this
/// mount found the name free): the close is refused (`ESTALE`) and the other client's object
/// stays. It was overwritten (the PUT of a new file was unconditional), a version of a name
/// nobody here had seen replaced. Background mode did this already (`If-None-Match`).
#[tokio::test]
async fn a_new_file_is_never_stored_over_an_object_another_client_made_meanwhile() {
    let e = env();
    for (name, size) in [("small", 1000usize), ("big", 7 * MIB as usize)] {
        let (a, h) =
            e.fs.create(ROOT_INO, OsStr::new(name), 0o644, 0, libc::O_WRONLY, ME)
                .await
                .unwrap();
        put(&e.mem, name, b"another client's").await;
        write_mib(&e.fs, a.ino, h.fh, 0, &random(size, 3)).await;
        assert_eq!(
            e.fs.flush(a.ino, h.fh).await,
            Err(FsError::ESTALE),
            "{name}"
        );
        e.fs.release(a.ino, h.fh).await.unwrap();
        assert_eq!(object(&e.mem, name).await, b"another client's", "{name}");
    }
    // Made here, then rewritten: a file of this mount's own is no new file.
    write_file(&e.fs, "mine", b"v1").await;
    let a = e.fs.lookup(ROOT_INO, OsStr::new("mine")).await.unwrap();
    let h =
        e.fs.open(a.ino, libc::O_WRONLY | libc::O_TRUNC)
            .await
            .unwrap();
    e.fs.write(a.ino, h.fh, 0, Bytes::from_static(b"v2"))
        .await
        .unwrap();
    e.fs.flush(a.ino, h.fh).await.unwrap();
    e.fs.release(a.ino, h.fh).await.unwrap();
    assert_eq!(object(&e.mem, "mine").await, b"v2");
}

/// Another client deletes a file this mount has open for a partial rewrite whose kept bytes
/// are still only in the bucket: the close that needs them, and a read of them, get `ESTALE`
/// (a conflict, as for a replaced object), not `ENOENT` for a file that is open.
#[tokio::test]
async fn a_partial_rewrite_of_an_object_deleted_meanwhile_is_a_conflict() {
    let e = env();
    put(&e.mem, "f", b"0123456789").await;
    let f = e.fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    let h = e.fs.open(f.ino, libc::O_RDWR).await.unwrap();
    e.fs.write(f.ino, h.fh, 10, Bytes::from_static(b"ab"))
        .await
        .unwrap();
    e.mem.delete("f").await.unwrap();
    assert_eq!(
        e.fs.read(f.ino, h.fh, 0, 4).await.unwrap_err(),
        FsError::ESTALE
    );
    assert_eq!(e.fs.flush(f.ino, h.fh).await, Err(FsError::ESTALE));
    let _ = e.fs.release(f.ino, h.fh).await;
    assert!(e.mem.head("f").await.is_err(), "nothing stored");
}

/// `O_RDONLY|O_CREAT|O_TRUNC` of a name that exists by the time the create runs (another
/// process made it at that instant: the kernel sent a create) truncates it, as the same open
/// of an existing file does (before: only writable ones did).
#[tokio::test]
async fn a_read_only_create_finding_the_file_truncates_it() {
    let e = env();
    put(&e.mem, "f", b"content").await;
    e.fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    let flags = libc::O_RDONLY | libc::O_CREAT | libc::O_TRUNC;
    let (a, h) =
        e.fs.create(ROOT_INO, OsStr::new("f"), 0o644, 0, flags, ME)
            .await
            .unwrap();
    assert_eq!(a.size, 0);
    e.fs.release(a.ino, h.fh).await.unwrap();
    assert_eq!(object(&e.mem, "f").await, b"");
}

/// The kernel asks by inode for the attributes of a file another client deleted (its name
/// still cached: after a refused close, or a `stat` within T): `ESTALE`, so that `stat` and
/// `open` look the name up again (`ENOENT`, or an `O_CREAT` open makes it), not `ENOENT`,
/// which failed an `open(O_CREAT)` of the name.
#[tokio::test]
async fn the_attributes_of_a_file_deleted_elsewhere_are_stale() {
    let e = env();
    put(&e.mem, "f", b"0123456789").await;
    let f = e.fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
    let h = e.fs.open(f.ino, libc::O_RDWR).await.unwrap();
    e.fs.write(f.ino, h.fh, 1, Bytes::from_static(b"J"))
        .await
        .unwrap();
    e.mem.delete("f").await.unwrap();
    assert_eq!(e.fs.flush(f.ino, h.fh).await, Err(FsError::ESTALE));
    e.fs.release(f.ino, h.fh).await.unwrap_or_default();
    assert_eq!(e.fs.getattr(f.ino).await.unwrap_err(), FsError::ESTALE);
    assert_eq!(
        e.fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap_err(),
        FsError::ENOENT
    );
}
