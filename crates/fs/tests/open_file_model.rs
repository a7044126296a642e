//! Model test of one file kept open for writing: random appends (the in-memory tail and
//! parts streamed from it), writes anywhere (the staging file), truncates, reads and fsyncs
//! through one `O_RDWR` handle, over a base object or none, with a memory budget that is
//! sometimes too small for a part. After every step reads must return the model's bytes; after
//! every fsync, and after close, the object in the store must equal the model, with no
//! multipart upload left behind.
//!
//! `PROPTEST_CASES` sets the number of sequences (default 24).

mod support;

use bucketfs_fs::{Caller, Fs, FsConfig, SetAttr, ROOT_INO};
use bucketfs_store::memory::MemoryStore;
use bucketfs_store::{ObjectStore, UserMeta};
use bytes::Bytes;
use proptest::prelude::*;
use std::ffi::OsStr;
use std::sync::Arc;
use support::object;

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;
/// The smallest part size the fs accepts: parts are crossed often with a few MiB of writes.
const PART: u64 = 5 * MIB;
const ME: Caller = Caller { uid: 0, gid: 0 };

#[derive(Debug, Clone)]
enum Step {
    /// Appends `len` bytes at the end of the file.
    Append(u64, u8),
    /// Writes `len` bytes at `offset` (a fraction of the size, in 1/64ths).
    WriteAt(u8, u64, u8),
    /// Writes `len` bytes at the start of part `n` (modulo the parts the file has, plus one).
    WritePart(u8, u64, u8),
    /// Sets the size to a fraction (1/64ths, up to 1.5x) of the current size.
    Truncate(u8),
    /// Reads `len` bytes at a fraction (1/64ths) of the size.
    Read(u8, u64),
    Fsync,
}

/// Lengths around part boundaries: small, odd, a whole part, more than a part.
fn len() -> impl Strategy<Value = u64> {
    prop_oneof![
        1u64..300,
        (1u64..20).prop_map(|k| k * 256 * KIB),
        Just(PART),
        (1u64..8).prop_map(|k| k * MIB + 17),
        Just(PART + 3),
    ]
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        5 => (len(), any::<u8>()).prop_map(|(n, s)| Step::Append(n, s)),
        2 => (0u8..=64, len(), any::<u8>()).prop_map(|(o, n, s)| Step::WriteAt(o, n, s)),
        2 => (any::<u8>(), len(), any::<u8>()).prop_map(|(p, n, s)| Step::WritePart(p, n, s)),
        1 => (0u8..=96).prop_map(Step::Truncate),
        2 => (0u8..=64, len()).prop_map(|(o, n)| Step::Read(o, n)),
        1 => Just(Step::Fsync),
    ]
}

fn fill(n: u64, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 13) as u8)
        .collect()
}

fn at(fraction: u8, size: u64) -> u64 {
    size * fraction as u64 / 64
}

fn run(base: Option<u64>, budget: u64, steps: Vec<Step>) -> Result<(), TestCaseError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let mem = Arc::new(MemoryStore::new());
        let mut model = Vec::new();
        if let Some(n) = base {
            model = fill(n, 99);
            mem.put("f", Bytes::from(model.clone()), &UserMeta::new())
                .await
                .unwrap();
        }
        let cache = tempfile::tempdir().unwrap();
        let fs = Fs::new(
            mem.clone(),
            FsConfig {
                cache_dir: cache.path().to_path_buf(),
                part_size: PART,
                max_memory: budget,
                ..FsConfig::default()
            },
        );
        let (ino, fh) = if base.is_some() {
            let a = fs.lookup(ROOT_INO, OsStr::new("f")).await.unwrap();
            let o = fs.open(a.ino, libc::O_RDWR).await.unwrap();
            (a.ino, o.fh)
        } else {
            let (a, o) = fs
                .create(ROOT_INO, OsStr::new("f"), 0o644, 0o022, libc::O_RDWR, ME)
                .await
                .unwrap();
            (a.ino, o.fh)
        };
        for (i, s) in steps.iter().enumerate() {
            match *s {
                Step::Append(n, seed) => {
                    let d = fill(n, seed);
                    let off = model.len() as u64;
                    fs.write(ino, fh, off, Bytes::from(d.clone()))
                        .await
                        .unwrap();
                    model.extend_from_slice(&d);
                }
                Step::WriteAt(_, n, seed) | Step::WritePart(_, n, seed) => {
                    let d = fill(n, seed);
                    let off = match *s {
                        Step::WriteAt(o, ..) => at(o, model.len() as u64) as usize,
                        Step::WritePart(p, ..) => {
                            let parts = model.len() as u64 / PART + 1;
                            (p as u64 % parts * PART) as usize
                        }
                        _ => unreachable!("matched above"),
                    };
                    fs.write(ino, fh, off as u64, Bytes::from(d.clone()))
                        .await
                        .unwrap();
                    if model.len() < off + d.len() {
                        model.resize(off + d.len(), 0);
                    }
                    model[off..off + d.len()].copy_from_slice(&d);
                }
                Step::Truncate(f) => {
                    let n = at(f, model.len() as u64);
                    fs.setattr(
                        ino,
                        Some(fh),
                        SetAttr {
                            size: Some(n),
                            ..SetAttr::default()
                        },
                    )
                    .await
                    .unwrap();
                    model.resize(n as usize, 0);
                }
                Step::Read(o, n) => {
                    let off = at(o, model.len() as u64);
                    let got = fs.read(ino, fh, off, n as u32).await.unwrap();
                    let end = (off + n).min(model.len() as u64) as usize;
                    let want = &model[(off as usize).min(end)..end];
                    prop_assert!(got[..] == *want, "read at step {} {:?}", i, s);
                }
                Step::Fsync => {
                    fs.fsync(ino, fh).await.unwrap();
                    prop_assert!(
                        object(&mem, "f").await == model,
                        "object after fsync at step {}",
                        i
                    );
                }
            }
        }
        fs.flush(ino, fh).await.unwrap();
        fs.release(ino, fh).await.unwrap();
        prop_assert!(object(&mem, "f").await == model, "object after close");
        prop_assert_eq!(mem.pending_uploads(), 0, "multipart uploads left");
        Ok(())
    })
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(24)
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(),
        max_shrink_iters: 200,
        ..ProptestConfig::default()
    })]

    #[test]
    fn an_open_file_matches_its_model(
        base in prop_oneof![Just(None), (1u64..3 * PART).prop_map(Some)],
        // 6 MiB cannot hold a part buffer next to an upload; 256 MiB always can.
        budget in prop_oneof![Just(6 * MIB), Just(256 * MIB)],
        steps in prop::collection::vec(step(), 1..16),
    ) {
        run(base, budget, steps)?;
    }
}
