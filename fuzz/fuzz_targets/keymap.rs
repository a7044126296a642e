//! Fuzzes the key <-> path mapping: arbitrary keys in a bucket (memory store) must give a
//! tree where every name is valid and every file shows exactly the object of its path's key,
//! without a panic or a hang.
#![no_main]

use bucketfs_fs::{FileKind, Fs, FsConfig, ROOT_INO};
use bucketfs_store::memory::MemoryStore;
use bucketfs_store::{ObjectStore, UserMeta};
use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use std::ffi::OsStr;
use std::sync::Arc;

fuzz_target!(|data: &[u8]| {
    // Keys separated by 0xff bytes; each made valid UTF-8 lossily, at most 1,024 bytes.
    let keys: Vec<String> = data
        .split(|b| *b == 0xff)
        .map(|k| String::from_utf8_lossy(k).into_owned())
        .filter(|k| !k.is_empty() && k.len() <= 1024)
        .take(32)
        .collect();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mem = Arc::new(MemoryStore::new());
        for k in &keys {
            mem.put(k, Bytes::from(k.clone()), &UserMeta::new())
                .await
                .unwrap();
        }
        let cache = tempfile::tempdir().unwrap();
        let fs = Fs::new(
            mem.clone(),
            FsConfig {
                cache_dir: cache.path().to_path_buf(),
                ..FsConfig::default()
            },
        );
        let walk = async {
            let mut todo = vec![(ROOT_INO, String::new())];
            let mut seen = 0;
            while let Some((ino, path)) = todo.pop() {
                seen += 1;
                assert!(seen < 10_000, "walk does not end");
                let fh = fs.opendir(ino).await.unwrap();
                let entries = fs.readdir(ino, fh, 0).await.unwrap();
                fs.releasedir(ino, fh);
                for e in entries {
                    if e.name == "." || e.name == ".." {
                        continue;
                    }
                    assert!(!e.name.is_empty() && !e.name.contains('/') && e.name.len() <= 255);
                    let p = if path.is_empty() {
                        e.name.clone()
                    } else {
                        format!("{path}/{}", e.name)
                    };
                    let a = fs.lookup(ino, OsStr::new(&e.name)).await.unwrap();
                    if a.kind == FileKind::Dir {
                        todo.push((a.ino, p));
                    } else {
                        assert!(keys.contains(&p), "{p:?} is not a key");
                        let h = fs.open(a.ino, libc::O_RDONLY).await.unwrap();
                        let got = fs.read(a.ino, h.fh, 0, 4096).await.unwrap();
                        assert_eq!(&got[..], p.as_bytes());
                        fs.release(a.ino, h.fh).await.unwrap();
                    }
                }
            }
        };
        tokio::time::timeout(std::time::Duration::from_secs(10), walk)
            .await
            .expect("hang");
    });
});
