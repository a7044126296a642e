//! Mounts with `--upload background` (a private state directory each) and what they have
//! not uploaded yet (`bucketfs pending`).

use super::{run_cli, MountSpec};
use std::ffi::OsString;
use std::path::Path;
use std::time::Duration;

/// A state directory of one test.
pub fn state_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("bucketfs-bg-state-")
        .tempdir()
        .unwrap()
}

/// `spec` in background mode with state directory `state`, then `extra`.
pub fn background(mut spec: MountSpec, state: &Path, extra: &[&str]) -> MountSpec {
    spec.args.extend(
        [
            "--upload",
            "background",
            "--state-dir",
            state.to_str().unwrap(),
        ]
        .iter()
        .chain(extra)
        .map(|s| s.to_string()),
    );
    spec
}

/// `bucketfs pending MOUNTPOINT`: (exit code, stdout).
pub fn pending_run(mp: &Path) -> (Option<i32>, String) {
    let run = run_cli(
        &[OsString::from("pending"), mp.as_os_str().to_owned()],
        &[],
        None,
        Duration::from_secs(30),
    );
    (run.status.and_then(|s| s.code()), run.stdout)
}

/// `bucketfs pending MOUNTPOINT`: its output, the command having succeeded.
pub fn pending(mp: &Path) -> String {
    let (code, out) = pending_run(mp);
    assert_eq!(code, Some(0), "{out}");
    out
}

/// Whether `bucketfs pending` says nothing is left (its summary line: "0 file(s), ...", not
/// "10 file(s)").
pub fn nothing_pending(mp: &Path) -> bool {
    pending_run(mp)
        .1
        .lines()
        .any(|l| l.starts_with("0 file(s)"))
}
