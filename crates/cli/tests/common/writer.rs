//! A writer in its own process.

use super::MIB;
use std::io::Write;
use std::path::Path;
use std::process::{Child, Command, Stdio};

/// A separate process that holds files open for writing on a mount, driven line by line.
///
/// Tests that keep a file open across a daemon crash or signal use it instead of a `File` of
/// the test process: when any test running in parallel forks a child, that child closes its
/// copies of the test process's descriptors at exec (O_CLOEXEC), which the mount sees as a
/// flush of every file the test process has open.
pub struct ForeignWriter {
    child: Child,
    stdin: std::process::ChildStdin,
    stdout: std::io::BufReader<std::process::ChildStdout>,
}

/// 1 MiB of the block pattern [`ForeignWriter`] writes (`fill`): bytes 0..=255 repeated.
pub fn writer_block() -> Vec<u8> {
    (0..MIB).map(|i| i as u8).collect()
}

impl ForeignWriter {
    pub fn start() -> ForeignWriter {
        let script = r#"
import sys
files = {}
block = bytes(range(256)) * 4096
for line in sys.stdin:
    cmd = line.rstrip("\n").split(" ", 2)
    try:
        if cmd[0] == "open":
            files[cmd[1]] = open(cmd[2], "wb", buffering=0)
        elif cmd[0] == "append":
            files[cmd[1]] = open(cmd[2], "ab", buffering=0)
        elif cmd[0] == "fill":
            for _ in range(int(cmd[2])):
                files[cmd[1]].write(block)
        elif cmd[0] == "text":
            files[cmd[1]].write(cmd[2].encode())
        elif cmd[0] == "close":
            files.pop(cmd[1]).close()
        print("ok", flush=True)
    except OSError as e:
        print("errno %d" % e.errno, flush=True)
"#;
        let mut child = Command::new("python3")
            .arg("-c")
            .arg(script)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3");
        let stdin = child.stdin.take().unwrap();
        let stdout = std::io::BufReader::new(child.stdout.take().unwrap());
        ForeignWriter {
            child,
            stdin,
            stdout,
        }
    }

    /// Runs one command (`open NAME PATH`, `append NAME PATH`, `fill NAME MIB`, `text NAME TEXT`, `close NAME`);
    /// returns `ok` or `errno N`.
    pub fn cmd(&mut self, line: &str) -> String {
        use std::io::BufRead;
        writeln!(self.stdin, "{line}").expect("writer stdin");
        let mut out = String::new();
        self.stdout.read_line(&mut out).expect("writer stdout");
        out.trim().to_string()
    }

    pub fn open(&mut self, name: &str, path: &Path) {
        let r = self.cmd(&format!("open {name} {}", path.display()));
        assert_eq!(r, "ok", "open {}", path.display());
    }
}

impl Drop for ForeignWriter {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
