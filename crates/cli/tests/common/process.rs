//! Processes: who mentions a path, and the daemon's resident memory and descriptors.

use super::Mount;

/// Pids of processes whose command line mentions `needle` (to prove a failed mount left no
/// daemon behind).
pub fn processes_mentioning(needle: &str) -> Vec<u32> {
    let me = std::process::id();
    let mut pids = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if pid == me {
            continue;
        }
        if let Ok(cmd) = std::fs::read(e.path().join("cmdline")) {
            if String::from_utf8_lossy(&cmd).contains(needle) {
                pids.push(pid);
            }
        }
    }
    pids
}

/// Measurements of the daemon from /proc.
impl Mount {
    /// Resident memory of the daemon in KiB (VmRSS), and its peak (VmHWM).
    pub fn rss_kib(&self) -> (u64, u64) {
        let pid = self.daemon_pid().expect("daemon running");
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let field = |name: &str| {
            status
                .lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        (field("VmRSS:"), field("VmHWM:"))
    }

    /// Open descriptors of the daemon that are not sockets (files, pipes, /dev/fuse), and
    /// its sockets (HTTP connections kept alive in the pool come and go).
    pub fn fd_kinds(&self) -> (usize, usize) {
        let pid = self.daemon_pid().expect("daemon running");
        let mut files = 0;
        let mut sockets = 0;
        for e in std::fs::read_dir(format!("/proc/{pid}/fd"))
            .into_iter()
            .flatten()
            .flatten()
        {
            match std::fs::read_link(e.path()) {
                Ok(t) if t.to_string_lossy().starts_with("socket:") => sockets += 1,
                Ok(_) => files += 1,
                Err(_) => {}
            }
        }
        (files, sockets)
    }

    /// Open file descriptors of the daemon.
    pub fn fd_count(&self) -> usize {
        let pid = self.daemon_pid().expect("daemon running");
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .map(|d| d.count())
            .unwrap_or(0)
    }
}
