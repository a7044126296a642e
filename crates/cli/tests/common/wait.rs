//! Waiting for a condition, and the daemon waiting at a test point.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Polls `f` every 50 ms until it holds; panics after `limit`.
pub fn wait_for(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A pause point's file (`NAME=pause:FILE`, crates/fs/src/testpoint.rs): the daemon creates
/// it when it gets there and goes on once it is removed.
pub struct Pause(PathBuf);

impl Pause {
    pub fn new(dir: &Path) -> Pause {
        Pause(dir.join("pause"))
    }

    pub fn point(&self, name: &str) -> String {
        format!("{name}=pause:{}", self.0.display())
    }

    pub fn reached(&self) {
        wait_for(
            "the daemon at its pause point",
            Duration::from_secs(30),
            || self.0.exists(),
        );
    }

    /// The file: for a test that looks whether the daemon got there without waiting, or lets
    /// it on many times.
    pub fn file(&self) -> &Path {
        &self.0
    }

    pub fn go_on(&self) {
        std::fs::remove_file(&self.0).unwrap();
    }

    /// Lets every pass of the point on at once from now on, counting them, until the
    /// returned guard drops.
    pub fn let_on(&self) -> Passes {
        let count = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (file, n, end) = (self.0.clone(), count.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !end.load(Ordering::Relaxed) {
                if std::fs::remove_file(&file).is_ok() {
                    n.fetch_add(1, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        Passes {
            count,
            stop,
            thread: Some(thread),
        }
    }
}

/// The passes of a pause point let on by [`Pause::let_on`].
pub struct Passes {
    count: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Passes {
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }
}

impl Drop for Passes {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Pause {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
