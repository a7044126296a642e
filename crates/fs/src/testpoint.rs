//! Named points where the integration tests stop or kill the daemon, to force an interleaving
//! or a crash at an exact step. Inert unless `BUCKETFS_TEST_POINT` is set (the tests set it):
//! `NAME=abort` SIGKILLs the process there (a crash: no cleanup at all); `NAME=panic` panics
//! there (a bug in that operation);
//! `NAME=pause:FILE` creates FILE there and waits while it exists (the test removes it to go
//! on). Several are separated by commas. Only in builds with debug assertions (the tests'):
//! a release daemon ignores the variable, so a setting left behind cannot let users of the
//! mount kill or stall it.

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

enum Action {
    Abort,
    Panic,
    Pause(PathBuf),
}

fn points() -> &'static [(String, Action)] {
    static POINTS: OnceLock<Vec<(String, Action)>> = OnceLock::new();
    POINTS.get_or_init(|| {
        if !cfg!(debug_assertions) {
            return Vec::new();
        }
        let Ok(v) = std::env::var("BUCKETFS_TEST_POINT") else {
            return Vec::new();
        };
        v.split(',')
            .filter_map(|p| {
                let (name, action) = p.split_once('=')?;
                let action = match action.split_once(':') {
                    Some(("pause", file)) => Action::Pause(file.into()),
                    None if action == "abort" => Action::Abort,
                    None if action == "panic" => Action::Panic,
                    _ => return None,
                };
                Some((name.to_string(), action))
            })
            .collect()
    })
}

/// The daemon is at point `name`.
pub(crate) async fn reached(name: &str) {
    for file in act(name) {
        while file.exists() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// [`reached`] on a thread of its own (not a runtime's).
pub(crate) fn reached_blocking(name: &str) {
    for file in act(name) {
        while file.exists() {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Aborts or panics as point `name` says; returns the files of its pauses (each created).
fn act(name: &str) -> impl Iterator<Item = &'static PathBuf> + '_ {
    points()
        .iter()
        .filter(move |(n, _)| n == name)
        .filter_map(move |(_, action)| match action {
            Action::Abort => {
                tracing::error!("test point {name}: killing the daemon");
                // SAFETY: kill(2) of this process: a crash, as kill -9 from outside.
                unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
                None
            }
            Action::Panic => panic!("test point {name}: panicking"),
            Action::Pause(file) => {
                let _ = std::fs::File::create(file);
                Some(file)
            }
        })
}
