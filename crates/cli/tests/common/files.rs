//! Local file helpers through a mount (checked writes and closes, listings, errno) and
//! running a command.

use std::collections::BTreeSet;
use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::io::IntoRawFd;
use std::path::Path;
use std::process::Command;

/// close(2) of a file, returning its error (dropping a `File` ignores it, and close is where
/// bucketfs reports a failed upload).
pub fn close_checked(f: File) -> std::io::Result<()> {
    let fd = f.into_raw_fd();
    // SAFETY: we own the descriptor (into_raw_fd) and close it exactly once.
    if unsafe { libc::close(fd) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Writes a whole file through the mount and checks write and close.
pub fn write_file(path: &Path, data: &[u8]) {
    let mut f = File::create(path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
    f.write_all(data)
        .unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    close_checked(f).unwrap_or_else(|e| panic!("close {}: {e}", path.display()));
}

pub fn read_file(path: &Path) -> Vec<u8> {
    let mut v = Vec::new();
    File::open(path)
        .and_then(|mut f| f.read_to_end(&mut v))
        .unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    v
}

/// Names in a directory (panics on a duplicate name: a listing must not repeat entries).
pub fn list_dir(path: &Path) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for e in std::fs::read_dir(path).unwrap_or_else(|e| panic!("readdir {}: {e}", path.display())) {
        let e = e.unwrap_or_else(|e| panic!("readdir {}: {e}", path.display()));
        let n = e.file_name().into_string().expect("UTF-8 name");
        assert!(
            names.insert(n.clone()),
            "readdir {} returned {n:?} twice",
            path.display()
        );
    }
    names
}

pub fn set<const N: usize>(names: [&str; N]) -> BTreeSet<String> {
    names.iter().map(|s| s.to_string()).collect()
}

/// The errno of an I/O result that must have failed.
pub fn errno<T: std::fmt::Debug>(r: std::io::Result<T>) -> i32 {
    match r {
        Ok(v) => panic!("expected an error, got Ok({v:?})"),
        Err(e) => e
            .raw_os_error()
            .unwrap_or_else(|| panic!("error without errno: {e}")),
    }
}

/// Runs a command and returns its stdout (panics on failure).
pub fn run(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{cmd}: {e}"));
    assert!(
        out.status.success(),
        "{cmd} {args:?} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}
