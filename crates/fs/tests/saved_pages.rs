//! Directory pages saved in the data cache for later mounts, against this machine's own
//! changes: a mount believes a saved page only if its LIST was sent after the last change a
//! mount sharing the cache made.

mod support;

use bucketfs_fs::{DataCacheConfig, Fs, FsConfig, ROOT_INO};
use bucketfs_store::memory::MemoryStore;
use bucketfs_store::metrics::{MeteredStore, Op, StoreMetrics};
use bucketfs_store::ObjectStore;
use std::ffi::OsStr;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::{put, MIB};

/// A mount of `mem` with its data cache in `dc` and a long stat TTL (saved pages are used
/// while younger than half of it), and its request counters.
fn mount(
    mem: &Arc<MemoryStore>,
    dc: &Path,
    cache: &tempfile::TempDir,
) -> (Arc<Fs>, Arc<StoreMetrics>) {
    let metered = MeteredStore::new(mem.clone() as Arc<dyn ObjectStore>);
    let metrics = metered.metrics();
    let cfg = FsConfig {
        data_cache: Some(DataCacheConfig {
            dir: dc.to_path_buf(),
            max_bytes: 64 * MIB,
            scope: "test".into(),
        }),
        stat_ttl: Duration::from_secs(600),
        negative_ttl: Duration::from_secs(600),
        ..support::config(cache)
    };
    (Fs::new(Arc::new(metered), cfg), metrics)
}

/// Waits until a file whose name passes `is` is somewhere in `dir` (the cache writes in
/// the background).
fn wait_for_file(dir: &Path, is: impl Fn(&str) -> bool) {
    let t = Instant::now();
    let found = |d: &Path| {
        walkdir(d)
            .iter()
            .any(|p| p.file_name().is_some_and(|n| is(&n.to_string_lossy())))
    };
    while !found(dir) {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "no such file in the cache"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Every file below `dir`.
fn walkdir(dir: &Path) -> Vec<std::path::PathBuf> {
    let (mut files, mut todo) = (Vec::new(), vec![dir.to_path_buf()]);
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            match e.path().is_dir() {
                true => todo.push(e.path()),
                false => files.push(e.path()),
            }
        }
    }
    files
}

/// `d/f` through `fs`: its bytes.
async fn read_f(fs: &Fs) -> Vec<u8> {
    let d = fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    let f = fs.lookup(d.ino, OsStr::new("f")).await.unwrap();
    let h = fs.open(f.ino, libc::O_RDONLY).await.unwrap();
    let got = fs.read(f.ino, h.fh, 0, 4096).await.unwrap().to_vec();
    fs.release(f.ino, h.fh).await.unwrap();
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remount_never_believes_a_page_saved_before_a_change_made_here() {
    let mem = Arc::new(MemoryStore::new());
    put(&mem, "d/f", b"one").await;
    let dc = tempfile::tempdir().unwrap();
    let (c1, c2, c3) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    // A mount before them all makes a change, so the change record's lock is there to hold
    // below; its record is removed (the first mount's page would not be used otherwise).
    put(&mem, "z", b"").await;
    let c0 = tempfile::tempdir().unwrap();
    let (fs, _) = mount(&mem, dc.path(), &c0);
    fs.unlink(ROOT_INO, OsStr::new("z")).await.unwrap();
    assert_eq!(fs.shutdown().await, 0);
    drop(fs);
    let is_record = |n: &str| n.starts_with("changed-") && !n.contains('.');
    wait_for_file(dc.path(), is_record);
    let record = walkdir(dc.path())
        .into_iter()
        .find(|p| is_record(&p.file_name().unwrap().to_string_lossy()))
        .expect("a change record");
    std::fs::remove_file(&record).unwrap();
    // The first mount's lookup of d saves its page, and its read of d/f caches its bytes.
    let (fs, _) = mount(&mem, dc.path(), &c1);
    assert_eq!(read_f(&fs).await, b"one");
    wait_for_file(dc.path(), |n| n.ends_with(".lst"));
    wait_for_file(dc.path(), |n| {
        !n.contains('.') && !n.starts_with("changed-")
    });
    drop(fs);
    // The next mount uses the page: no LIST for d.
    let (fs, m) = mount(&mem, dc.path(), &c2);
    assert_eq!(read_f(&fs).await, b"one");
    assert_eq!(m.requests(Op::List), 0, "the saved page was used");
    // It rewrites d/f (same size), and is unmounted.
    let d = fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    let f = fs.lookup(d.ino, OsStr::new("f")).await.unwrap();
    // The record's write is held a while (a slow cache disk), past the unmount's start.
    let lock = std::fs::File::open(record.with_extension("lock")).unwrap();
    // SAFETY: flock(2) of a descriptor the test owns.
    assert_eq!(unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) }, 0);
    let held = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(500));
        drop(lock);
    });
    let h = fs
        .open(f.ino, libc::O_WRONLY | libc::O_TRUNC)
        .await
        .unwrap();
    fs.write(f.ino, h.fh, 0, bytes::Bytes::from_static(b"two"))
        .await
        .unwrap();
    fs.flush(f.ino, h.fh).await.unwrap();
    fs.release(f.ino, h.fh).await.unwrap();
    // Unmounted as the daemon does: its record of the change is on disk once it is gone
    // (an earlier build left it to a background write that a quick remount could beat).
    assert_eq!(fs.shutdown().await, 0);
    drop(fs);
    // The mount after it lists d again (the page predates the rewrite) and reads the new
    // bytes, not the old ones the cache holds under the ETag the page names.
    let (fs, m) = mount(&mem, dc.path(), &c3);
    assert_eq!(read_f(&fs).await, b"two");
    assert!(m.requests(Op::List) > 0);
    held.join().unwrap();
}

/// The record of this mount's changes on a cache disk that hangs (its file a FIFO nobody
/// writes: reading it blocks, as on a lost NFS server) holds one blocking thread however
/// long the mount goes on changing things. An earlier build left one thread per second of
/// changes blocked there, until the blocking pool (which the local store, staging files
/// and unmount need) had none left.
#[test]
fn a_hung_cache_disk_holds_one_blocking_thread_for_the_change_record() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let dc = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let mem = Arc::new(MemoryStore::new());
    let (fs, _) = rt.block_on(async { mount(&mem, dc.path(), &cache) });
    rt.block_on(support::write_file(&fs, "first", b"1"));
    wait_for_file(dc.path(), |n| n.starts_with("changed-"));
    let record = walkdir(dc.path())
        .into_iter()
        .find(|p| {
            p.file_name().is_some_and(|n| {
                let n = n.to_string_lossy();
                n.starts_with("changed-") && !n.contains(".tmp")
            })
        })
        .expect("the change record");
    std::fs::remove_file(&record).unwrap();
    let c = std::ffi::CString::new(record.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    /// Lets the readers stuck on the FIFO go, whatever the test's outcome.
    struct Unblock(std::path::PathBuf);
    impl Drop for Unblock {
        fn drop(&mut self) {
            use std::os::unix::fs::OpenOptionsExt;
            let _ = std::fs::OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_NONBLOCK)
                .open(&self.0);
        }
    }
    let _unblock = Unblock(record.clone());
    // Changes over three record periods (a record is asked for at most every 2 s).
    for i in 0..3 {
        rt.block_on(support::write_file(&fs, &format!("f{i}"), b"x"));
        std::thread::sleep(Duration::from_millis(2100));
    }
    let free = rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(2), tokio::task::spawn_blocking(|| ())).await
    });
    drop(_unblock);
    drop(fs);
    rt.shutdown_background();
    assert!(
        free.is_ok(),
        "the blocking pool is full of writes of the change record"
    );
}

/// A listing's own first page starts after the directory's marker: saved, it told the next
/// mount the directory has none, which then showed the default mode and owner and, at the
/// `rm` of its last file, wrote the marker again without them. Only a lookup's page (from
/// the marker on) is saved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remount_keeps_the_marker_of_a_directory_listed_twice() {
    let mem = Arc::new(MemoryStore::with_list_metadata());
    let dir_meta: bucketfs_store::UserMeta = [
        ("mode".to_string(), (libc::S_IFDIR | 0o700).to_string()),
        ("uid".to_string(), "4321".to_string()),
    ]
    .into();
    mem.put("d/", bytes::Bytes::new(), &dir_meta).await.unwrap();
    put(&mem, "d/f", b"one").await;
    let dc = tempfile::tempdir().unwrap();
    let (c1, c2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (fs, _) = mount(&mem, dc.path(), &c1);
    let d = fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    assert_eq!((d.perm, d.uid), (0o700, 4321));
    wait_for_file(dc.path(), |n| n.ends_with(".lst"));
    let saved = || {
        walkdir(dc.path())
            .into_iter()
            .filter(|p| p.to_string_lossy().ends_with(".lst"))
            .map(|p| std::fs::read(p).unwrap_or_default())
            .collect::<Vec<_>>()
    };
    let first = saved();
    // The first listing takes the lookup's page; the second sends a LIST of its own.
    for _ in 0..2 {
        assert_eq!(support::list(&fs, d.ino).await, [".", "..", "f"]);
    }
    // Time for a save of that page to land, as it did before.
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(saved(), first, "the listing's page replaced the lookup's");
    drop(fs);
    let (fs, _) = mount(&mem, dc.path(), &c2);
    let d = fs.lookup(ROOT_INO, OsStr::new("d")).await.unwrap();
    assert_eq!((d.perm, d.uid), (0o700, 4321));
    fs.unlink(d.ino, OsStr::new("f")).await.unwrap();
    let marker = mem.head("d/").await.unwrap();
    assert_eq!(marker.user.get("uid").map(String::as_str), Some("4321"));
}
