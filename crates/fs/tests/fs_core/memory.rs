//! The memory budget of readers and what stays cached after close.

use crate::support::{config, env, env_with, put, random, Env, MIB};
use bucketfs_fs::{Fs, FsConfig, ROOT_INO};
use bucketfs_store::memory::MemoryStore;
use bucketfs_store::metrics::Op;
use std::ffi::OsStr;
use std::sync::Arc;

#[tokio::test]
async fn readers_stay_within_the_memory_budget() {
    let mem = Arc::new(MemoryStore::new());
    let data = random(48 * MIB as usize, 23);
    for i in 0..4 {
        put(&mem, &format!("f{i}"), &data).await;
    }
    let cache = tempfile::tempdir().unwrap();
    let budget = 12 * MIB;
    let fs = Fs::new(
        mem.clone(),
        FsConfig {
            max_memory: budget,
            ..config(&cache)
        },
    );
    let peak = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut tasks = Vec::new();
    for i in 0..4 {
        let (fs, data, peak) = (fs.clone(), data.clone(), peak.clone());
        tasks.push(tokio::spawn(async move {
            let name = format!("f{i}");
            let a = fs.lookup(ROOT_INO, OsStr::new(&name)).await.unwrap();
            let h = fs.open(a.ino, libc::O_RDONLY).await.unwrap();
            let mut off = 0usize;
            while off < data.len() {
                let b = fs.read(a.ino, h.fh, off as u64, 1 << 20).await.unwrap();
                assert_eq!(&b[..], &data[off..off + b.len()]);
                off += b.len();
                let used = fs
                    .metrics()
                    .buffer_bytes
                    .load(std::sync::atomic::Ordering::Relaxed);
                peak.fetch_max(used, std::sync::atomic::Ordering::Relaxed);
            }
            fs.release(a.ino, h.fh).await.unwrap();
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let peak = peak.load(std::sync::atomic::Ordering::Relaxed);
    assert!(
        peak <= budget,
        "buffers peaked at {peak} over a budget of {budget}"
    );
    assert!(peak > 0);
}

/// A file read whole and closed leaves no memory behind (the kernel's page cache has it);
/// one read partly keeps the unread rest of its block for the next reader.
#[tokio::test]
async fn only_unread_bytes_stay_cached_after_close() {
    let e = env();
    let data = random(100 * 1024, 9);
    put(&e.mem, "whole", &data).await;
    put(&e.mem, "part", &data).await;
    let buffered = |e: &Env| {
        e.fs.metrics()
            .buffer_bytes
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    let a = e.fs.lookup(ROOT_INO, OsStr::new("whole")).await.unwrap();
    let h = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    let got = e.fs.read(a.ino, h.fh, 0, 200 * 1024).await.unwrap();
    assert_eq!(&got[..], &data[..]);
    // A reply shares the read buffer, which holds its memory until the reply is sent.
    drop(got);
    e.fs.release(a.ino, h.fh).await.unwrap();
    assert_eq!(buffered(&e), 0);
    let a = e.fs.lookup(ROOT_INO, OsStr::new("part")).await.unwrap();
    let h = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    let got = e.fs.read(a.ino, h.fh, 0, 4096).await.unwrap();
    assert_eq!(&got[..], &data[..4096]);
    e.fs.release(a.ino, h.fh).await.unwrap();
    assert!(buffered(&e) >= data.len() as u64);
    // The next open reads the rest from the cache: no GET.
    let gets = e.metrics.requests(Op::Get);
    let h = e.fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    let got = e.fs.read(a.ino, h.fh, 4096, 8192).await.unwrap();
    assert_eq!(&got[..], &data[4096..12288]);
    assert_eq!(e.metrics.requests(Op::Get), gets);
    e.fs.release(a.ino, h.fh).await.unwrap();
}

/// With O_DIRECT the kernel caches nothing, so what a reader reads is kept in the block cache
/// (a quarter of the budget) for its next pass: from the first pass when the file takes at
/// most half that cache, else from the first time the reader goes over it again (a single
/// pass of a large file keeps nothing).
#[tokio::test]
async fn direct_io_rereads_come_from_the_block_cache() {
    // 128 MiB: a 32 MiB block cache, files of up to 16 MiB kept from their first pass.
    let e = env_with(MemoryStore::new(), |c| FsConfig {
        max_memory: 128 * MIB,
        ..c
    });
    let big = random(24 * MIB as usize, 12);
    let small = random(12 * MIB as usize, 13);
    put(&e.mem, "big", &big).await;
    put(&e.mem, "small", &small).await;
    let buffered = || {
        e.fs.metrics()
            .buffer_bytes
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    for (name, data) in [("big", &big), ("small", &small)] {
        let a = e.fs.lookup(ROOT_INO, OsStr::new(name)).await.unwrap();
        let h =
            e.fs.open(a.ino, libc::O_RDONLY | libc::O_DIRECT)
                .await
                .unwrap();
        let pass = || {
            let (fs, data) = (e.fs.clone(), data.clone());
            async move {
                for (i, c) in data.chunks(MIB as usize).enumerate() {
                    let got = fs
                        .read(a.ino, h.fh, i as u64 * MIB, MIB as u32)
                        .await
                        .unwrap();
                    assert!(got[..] == *c, "{name}: block {i}");
                }
            }
        };
        let start = e.metrics.requests(Op::Get);
        pass().await;
        let first = e.metrics.requests(Op::Get);
        assert!(first >= start + 2, "{name}");
        if name == "big" {
            assert!(
                buffered() < 16 * MIB,
                "a single pass kept {} bytes",
                buffered()
            );
        }
        pass().await;
        let second = e.metrics.requests(Op::Get);
        if name == "big" {
            assert!(second > first, "the second pass had nothing cached yet");
            pass().await;
            assert_eq!(
                e.metrics.requests(Op::Get),
                second,
                "the third pass fetched again"
            );
        } else {
            assert_eq!(second, first, "{name}: the second pass fetched again");
        }
        e.fs.release(a.ino, h.fh).await.unwrap();
    }
}
