"""A private MinIO for one bench run, and a request counter fed by MinIO's audit webhook.

MinIO's Prometheus counters are cached for several seconds, so they cannot be cut into phases.
Its audit log can: MinIO posts one JSON entry per S3 request to an HTTP target, here a small
server in this process. A phase is closed with a sentinel request; once the sentinel's entry has
arrived, every request of the phase has too (plus a short grace for batching), and the phase's
count is the entries whose time lies inside it, less the runner's own (User-Agent
bucketfs-bench).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
import socket
import subprocess
import threading
import time
import urllib.request
import uuid
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from .s3 import S3, USER_AGENT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_minio() -> str | None:
    p = shutil.which("minio")
    if p:
        return p
    try:
        gopath = subprocess.run(["go", "env", "GOPATH"], capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        gopath = ""
    for d in filter(None, [gopath, os.path.expanduser("~/go")]):
        c = Path(d) / "bin" / "minio"
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    return None


def _parse_time(s: str) -> float:
    # RFC 3339 with up to nanoseconds: 2026-11-22T23:17:13.123456789Z
    s = s.rstrip("Z")
    if "." in s:
        head, frac = s.split(".", 1)
        frac = "".join(ch for ch in frac if ch.isdigit())[:6]
        s = f"{head}.{frac}"
    t = _dt.datetime.fromisoformat(s).replace(tzinfo=_dt.timezone.utc)
    return t.timestamp()


class AuditCollector:
    """HTTP target for MinIO's audit webhook; keeps (time, api, user agent, rx, tx, object)."""

    def __init__(self) -> None:
        self.entries: list[tuple[float, str, str, int, int, str]] = []
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        collector = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                n = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(n) if n else b""
                collector._ingest(body)
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            do_PUT = do_POST

            def log_message(self, *a):  # silence
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/audit"

    def _ingest(self, body: bytes) -> None:
        items = []
        text = body.decode("utf-8", "replace").strip()
        if not text:
            return
        try:
            doc = json.loads(text)
            items = doc if isinstance(doc, list) else [doc]
        except json.JSONDecodeError:
            for line in text.splitlines():
                line = line.strip()
                if line:
                    try:
                        items.append(json.loads(line))
                    except json.JSONDecodeError:
                        pass
        rows = []
        for e in items:
            api = e.get("api") or {}
            name = api.get("name") or ""
            if not name:
                continue
            ua = e.get("userAgent") or (e.get("requestHeader") or {}).get("User-Agent", "")
            try:
                t = _parse_time(e.get("time", ""))
            except ValueError:
                t = time.time()
            rows.append((t, name, ua, int(api.get("rx") or 0), int(api.get("tx") or 0), api.get("object") or ""))
        with self.cond:
            self.entries.extend(rows)
            self.cond.notify_all()

    def wait_for_object(self, key: str, timeout: float = 15.0) -> bool:
        deadline = time.time() + timeout
        with self.cond:
            seen = 0
            while True:
                for e in self.entries[seen:]:
                    if e[5] == key:
                        return True
                seen = len(self.entries)
                left = deadline - time.time()
                if left <= 0:
                    return False
                self.cond.wait(left)

    def count(self, t0: float, t1: float) -> dict:
        """Requests (not the runner's own) whose audit time lies in [t0, t1]."""
        by_api: Counter[str] = Counter()
        rx = tx = 0
        with self.lock:
            for t, name, ua, r, x, _ in self.entries:
                if t0 <= t <= t1 and not ua.startswith(USER_AGENT):
                    by_api[name] += 1
                    rx += r
                    tx += x
        return {"total": sum(by_api.values()), "by_api": dict(sorted(by_api.items())), "bytes_in": rx, "bytes_out": tx}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class StoreCounter:
    """Cuts the audit stream into phases: `mark()` before, `collect(t0)` after."""

    def __init__(self, collector: AuditCollector, s3: S3, bucket: str):
        self.collector = collector
        self.s3 = s3
        self.bucket = bucket

    def mark(self) -> float:
        return time.time()

    def collect(self, t0: float) -> dict | None:
        t1 = time.time()
        key = f"__bench_sentinel__/{uuid.uuid4().hex}"
        self.s3.head(self.bucket, key)
        if not self.collector.wait_for_object(key):
            return None
        time.sleep(0.3)  # batching may reorder entries slightly
        return self.collector.count(t0, t1)


class MinioServer:
    def __init__(self, binary: str, workdir: Path, access_key: str, secret_key: str, log: Path,
                 cpus: set[int] | None = None):
        """cpus: run MinIO on these CPUs only (its threads inherit the affinity set before exec;
        Go sizes GOMAXPROCS from it)."""
        self.binary = binary
        self.dir = workdir
        self.access_key = access_key
        self.secret_key = secret_key
        self.port = free_port()
        self.console = free_port()
        self.collector = AuditCollector()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MINIO_", "AWS_"))}
        env.update(
            MINIO_ROOT_USER=access_key,
            MINIO_ROOT_PASSWORD=secret_key,
            MINIO_PROMETHEUS_AUTH_TYPE="public",
            MINIO_BROWSER="off",
            MINIO_UPDATE="off",
            MINIO_AUDIT_WEBHOOK_ENABLE_bench="on",
            MINIO_AUDIT_WEBHOOK_ENDPOINT_bench=self.collector.url,
            MINIO_AUDIT_WEBHOOK_BATCH_SIZE_bench="100",
            MINIO_AUDIT_WEBHOOK_QUEUE_SIZE_bench="1000000",
        )
        (workdir / "data").mkdir(parents=True, exist_ok=True)
        self.logf = open(log, "ab")
        self.proc = subprocess.Popen(
            [binary, "server", str(workdir / "data"), "--address", f"127.0.0.1:{self.port}",
             "--console-address", f"127.0.0.1:{self.console}", "--quiet"],
            env=env, stdout=self.logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
        )
        deadline = time.time() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"minio exited with {self.proc.returncode}; see {log}")
            try:
                with urllib.request.urlopen(f"{self.endpoint}/minio/health/live", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"minio did not become ready in 60 s; see {log}")
            time.sleep(0.2)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.logf.close()
        self.collector.close()
