#!/usr/bin/env python3
"""Concurrent small-file load generator (like the ossfs guide's rw-bench) and a concurrent reader.

  loadgen.py write --dir D --file-size-KB 128 --file-count N --threads T [--depth 1 --fanout 100]
  loadgen.py read  --dir D --file-size-KB 128 --file-count N --threads T [--passes 2] [--verify]
  loadgen.py readfiles --threads 10 [--md5] FILE...

File i lives in a leaf directory picked from i (fanout**depth leaves, one level per digit) and
holds a deterministic pattern that starts with its own index, so a read can verify every byte.
Prints one JSON object; exits 1 when any operation failed or a verification did not match.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import threading
import time

_BASE_CACHE: dict[int, bytes] = {}


def base_block(size: int) -> bytes:
    b = _BASE_CACHE.get(size)
    if b is None:
        b = random.Random(20240607).randbytes(size)
        _BASE_CACHE[size] = b
    return b


def content(i: int, size: int) -> bytes:
    head = f"{i:016d}".encode()
    if size <= len(head):
        return head[:size]
    return head + base_block(size)[len(head):]


def leaf_dir(i: int, depth: int, fanout: int) -> str:
    parts = []
    n = i % (fanout**depth) if depth else 0
    for level in range(depth):
        parts.append(f"l{level}_{n % fanout:03d}")
        n //= fanout
    return "/".join(parts)


def file_path(root: str, i: int, depth: int, fanout: int) -> str:
    d = leaf_dir(i, depth, fanout)
    return os.path.join(root, d, f"f{i:07d}") if d else os.path.join(root, f"f{i:07d}")


class Pool:
    """Runs fn(i) for i in range(n) on `threads` threads; collects errors."""

    def __init__(self, n: int, threads: int):
        self.n = n
        self.threads = max(1, min(threads, n or 1))
        self.next = 0
        self.lock = threading.Lock()
        self.errors: list[str] = []
        self.nerr = 0

    def _take(self) -> int | None:
        with self.lock:
            if self.next >= self.n:
                return None
            i = self.next
            self.next += 1
            return i

    def run(self, fn) -> float:
        def worker():
            while True:
                i = self._take()
                if i is None:
                    return
                try:
                    fn(i)
                except Exception as e:  # noqa: BLE001 - report every failure
                    with self.lock:
                        self.nerr += 1
                        if len(self.errors) < 5:
                            self.errors.append(f"{i}: {e}")

        t0 = time.monotonic()
        ts = [threading.Thread(target=worker) for _ in range(self.threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return time.monotonic() - t0


def cmd_write(a) -> dict:
    size = a.file_size_KB * 1024
    t0 = time.monotonic()
    leaves = sorted({leaf_dir(i, a.depth, a.fanout) for i in range(min(a.file_count, a.fanout**a.depth if a.depth else 1))})
    for d in leaves:
        if d:
            os.makedirs(os.path.join(a.dir, d), exist_ok=True)
    mkdir_s = time.monotonic() - t0

    def one(i: int) -> None:
        fd = os.open(file_path(a.dir, i, a.depth, a.fanout), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            data = memoryview(content(i, size))
            while data:
                n = os.write(fd, data)
                data = data[n:]
        finally:
            os.close(fd)

    pool = Pool(a.file_count, a.threads)
    secs = pool.run(one) + mkdir_s
    total = a.file_count * size
    return {
        "mode": "write", "files": a.file_count, "bytes": total, "seconds": secs, "mkdir_seconds": mkdir_s,
        "dirs": len(leaves), "mb_s": total / secs / 1e6 if secs else 0, "files_s": a.file_count / secs if secs else 0,
        "errors": pool.nerr, "error_samples": pool.errors,
    }


def cmd_read(a) -> dict:
    size = a.file_size_KB * 1024
    passes = []
    mismatches = 0
    lock = threading.Lock()
    for p in range(a.passes):
        got = [0]

        def one(i: int) -> None:
            nonlocal mismatches
            fd = os.open(file_path(a.dir, i, a.depth, a.fanout), os.O_RDONLY)
            try:
                chunks = []
                while True:
                    b = os.read(fd, max(size, 1 << 20))
                    if not b:
                        break
                    chunks.append(b)
            finally:
                os.close(fd)
            data = b"".join(chunks)
            with lock:
                got[0] += len(data)
            if a.verify and data != content(i, size):
                with lock:
                    mismatches += 1
                raise ValueError(f"content mismatch ({len(data)} bytes read, {size} expected)")

        pool = Pool(a.file_count, a.threads)
        secs = pool.run(one)
        passes.append({
            "pass": p + 1, "seconds": secs, "bytes": got[0], "files": a.file_count,
            "mb_s": got[0] / secs / 1e6 if secs else 0, "files_s": a.file_count / secs if secs else 0,
            "errors": pool.nerr, "error_samples": pool.errors,
        })
    return {"mode": "read", "passes": passes, "mismatches": mismatches,
            "errors": sum(p["errors"] for p in passes)}


def cmd_readfiles(a) -> dict:
    results: dict[str, dict] = {}
    lock = threading.Lock()
    files = a.files

    def one(i: int) -> None:
        path = files[i]
        h = hashlib.md5() if a.md5 else None
        n = 0
        t0 = time.monotonic()
        with open(path, "rb", buffering=0) as f:
            while True:
                b = f.read(a.block)
                if not b:
                    break
                n += len(b)
                if h:
                    h.update(b)
        with lock:
            results[path] = {"bytes": n, "seconds": time.monotonic() - t0, "md5": h.hexdigest() if h else None}

    pool = Pool(len(files), a.threads)
    secs = pool.run(one)
    total = sum(r["bytes"] for r in results.values())
    return {"mode": "readfiles", "files": results, "bytes": total, "seconds": secs,
            "mb_s": total / secs / 1e6 if secs else 0, "errors": pool.nerr, "error_samples": pool.errors}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("write", "read"):
        p = sub.add_parser(name)
        p.add_argument("--dir", required=True)
        p.add_argument("--file-size-KB", type=int, default=128)
        p.add_argument("--file-count", type=int, required=True)
        p.add_argument("--threads", type=int, default=128)
        p.add_argument("--depth", type=int, default=1)
        p.add_argument("--fanout", type=int, default=100)
        if name == "read":
            p.add_argument("--passes", type=int, default=1)
            p.add_argument("--verify", action="store_true")
    p = sub.add_parser("readfiles")
    p.add_argument("--threads", type=int, default=10)
    p.add_argument("--block", type=int, default=1 << 20)
    p.add_argument("--md5", action="store_true")
    p.add_argument("files", nargs="+")
    a = ap.parse_args(argv)
    out = {"write": cmd_write, "read": cmd_read, "readfiles": cmd_readfiles}[a.cmd](a)
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")
    return 1 if out.get("errors") or out.get("mismatches") else 0


if __name__ == "__main__":
    sys.exit(main())
