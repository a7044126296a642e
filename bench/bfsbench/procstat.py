"""What a FUSE daemon costs, read from /proc: CPU (utime+stime of the daemon and any children),
peak RSS (VmHWM, reset per phase through clear_refs), and local disk it holds (its cache
directory plus deleted-but-open temp files)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                st = f.read()
        except OSError:
            continue
        ppid = int(st[st.rindex(")") + 2 :].split()[1])
        if ppid == pid:
            out.append(int(d))
    return out


def process_tree(pid: int) -> list[int]:
    todo, seen = [pid], []
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.append(p)
        todo.extend(_children(p))
    return seen


def holds_dev_fuse(pid: int) -> bool:
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == "/dev/fuse":
                    return True
            except OSError:
                pass
    except OSError:
        pass
    return False


def fuse_daemon(pid: int) -> int:
    """The process of `pid`'s tree that holds /dev/fuse (the FUSE server), else `pid`."""
    for p in process_tree(pid):
        if holds_dev_fuse(p):
            return p
    return pid


def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                st = f.read()
        except OSError:
            continue
        fields = st[st.rindex(")") + 2 :].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / CLK_TCK


def _status_kb(pid: int, key: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def reset_hwm(pids: list[int]) -> None:
    for p in pids:
        try:
            with open(f"/proc/{p}/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass


def disk_bytes(pid: int, cache_dirs: list[Path]) -> int:
    """Bytes the daemon keeps on local disk: its cache dirs plus open temp files outside them."""
    total = 0
    seen: set[tuple[int, int]] = set()
    for d in cache_dirs:
        for root, _, files in os.walk(d):
            for name in files:
                try:
                    st = os.lstat(os.path.join(root, name))
                except OSError:
                    continue
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return total
    for fd in fds:
        path = f"/proc/{pid}/fd/{fd}"
        try:
            target = os.readlink(path)
            if not target.startswith("/") or target.startswith(("/dev/", "/proc/", "/sys/")):
                continue
            st = os.stat(path)
        except OSError:
            continue
        import stat as _stat

        if not _stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) in seen:
            continue
        seen.add((st.st_dev, st.st_ino))
        total += st.st_blocks * 512
    return total


class PhaseMonitor:
    """Samples a daemon during one phase: CPU delta, peak RSS, peak local disk."""

    def __init__(self, pid: int, cache_dirs: list[Path], interval: float = 0.25):
        self.root = pid
        self.cache_dirs = cache_dirs
        self.interval = interval
        self.pids = process_tree(pid)
        self.peak_rss_kb = 0
        self.peak_disk = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        rss = sum(_status_kb(p, "VmRSS") for p in self.pids)
        self.peak_rss_kb = max(self.peak_rss_kb, rss)
        try:
            self.peak_disk = max(self.peak_disk, disk_bytes(self.root, self.cache_dirs))
        except OSError:
            pass

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def start(self) -> "PhaseMonitor":
        self.pids = process_tree(self.root)
        reset_hwm(self.pids)
        self.disk0 = disk_bytes(self.root, self.cache_dirs)
        self.cpu0 = cpu_seconds(self.pids)
        self.t0 = time.monotonic()
        self._sample()
        self._thread.start()
        return self

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        self.pids = [p for p in process_tree(self.root)] or self.pids
        cpu1 = cpu_seconds(self.pids)
        wall = time.monotonic() - self.t0
        self._sample()
        hwm = sum(_status_kb(p, "VmHWM") for p in self.pids)
        return {
            "cpu_s": max(0.0, cpu1 - self.cpu0),
            "wall_s": wall,
            "peak_rss_mb": max(hwm, self.peak_rss_kb) / 1024,
            "disk_peak_mb": self.peak_disk / 1e6,
        }
