//! Waiting for a condition, and the daemon waiting at a test point.

use std::path::{Path, PathBuf};
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
}

impl Drop for Pause {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
