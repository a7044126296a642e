//! Running `bucketfs ...` for its exit status and output (errors, short-lived commands).

use super::{bin, force_unmount, isolate_env};
use std::ffi::OsString;
use std::fs::File;
use std::path::Path;
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// The result of one `bucketfs ...` run.
#[derive(Debug)]
pub struct CliRun {
    pub status: Option<ExitStatus>,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
    pub timed_out: bool,
}

/// Runs `bucketfs args...` (with the isolated environment plus `envs`), waits at most `limit`
/// for it to exit and cleans up any mount of `mountpoint` it made. stdout/stderr go to files,
/// so a daemon that keeps them open cannot block the test.
pub fn run_cli(
    args: &[OsString],
    envs: &[(&str, &str)],
    mountpoint: Option<&Path>,
    limit: Duration,
) -> CliRun {
    let dir = tempfile::tempdir().unwrap();
    let home = dir.path().join("home");
    std::fs::create_dir(&home).unwrap();
    let out_p = dir.path().join("stdout");
    let err_p = dir.path().join("stderr");
    let mut cmd = Command::new(bin());
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(File::create(&out_p).unwrap())
        .stderr(File::create(&err_p).unwrap());
    isolate_env(&mut cmd, &home);
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let start = Instant::now();
    let mut child = cmd.spawn().unwrap();
    let mut timed_out = false;
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break Some(st);
        }
        if start.elapsed() > limit {
            timed_out = true;
            if let Some(mp) = mountpoint {
                force_unmount(mp);
            }
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let elapsed = start.elapsed();
    CliRun {
        status,
        stdout: std::fs::read_to_string(&out_p).unwrap_or_default(),
        stderr: std::fs::read_to_string(&err_p).unwrap_or_default(),
        elapsed,
        timed_out,
    }
}

pub fn os(args: &[&str]) -> Vec<OsString> {
    args.iter().map(OsString::from).collect()
}
