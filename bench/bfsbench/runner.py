"""Runs the scenarios against every system and the limit, and collects the results."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from . import loadgen, procstat
from .epoch2 import g_epoch2
from .minio import StoreCounter
from .rows import BY_ID, GROUPS, ROWS, rows_of
from .s3 import S3
from .systems import Bucketfs, Mount, System, clean_env

HERE = Path(__file__).resolve().parent
LOADGEN = HERE / "loadgen.py"
PANDAS = HERE / "pandas_overwrite.py"


class PhaseError(Exception):
    def __init__(self, msg: str, unsupported: bool = False):
        super().__init__(msg)
        self.unsupported = unsupported


_UNSUPPORTED_HINTS = ("Operation not supported", "Function not implemented", "not supported")


def _classify(msg: str) -> bool:
    return any(h in msg for h in _UNSUPPORTED_HINTS)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


def run_cmd(cmd: list[str], timeout: float, cwd: str | None = None, env=None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
    except subprocess.TimeoutExpired as e:
        raise PhaseError(f"timed out after {timeout:.0f} s: {' '.join(cmd[:3])}…") from e


def _tail(s: str, n: int = 4) -> str:
    lines = [l for l in (s or "").strip().splitlines() if l.strip()]
    return " | ".join(lines[-n:])[-400:]


@dataclass
class Ctx:
    sizes: dict
    size_name: str
    repeat: int
    workdir: Path
    s3: S3
    bucket: str
    counter: StoreCounter | None
    minio_pid: int | None
    systems: list[System]
    python: str  # interpreter with pandas, or None
    have_pandas: bool
    verify_full: bool
    groups: list[str]
    bucketfs_bin: str | None
    results: dict = field(default_factory=dict)  # row id -> system -> [runs]
    limit_runs: list = field(default_factory=list)
    limit_cp_runs: list = field(default_factory=list)  # the PUT limit with cp's source cached
    notes: list = field(default_factory=list)
    dropped_caches: bool = True
    store_env: dict = field(default_factory=dict)
    shared: dict = field(default_factory=dict)

    def record(self, row: str, system: str, run: dict) -> None:
        self.results.setdefault(row, {}).setdefault(system, []).append(run)


# ------------------------------------------------------------------------------------------------
# one measured phase


def measure(ctx: Ctx, sysobj: System, m: Mount, row: str, fn, *, durable=None) -> dict:
    """Runs fn() against mount m while watching the daemon. fn returns a dict with at least
    `bytes` and, unless the row's figure is computed here, `value`. `durable` (async systems
    only): a callable that waits until the store holds what fn wrote."""
    if not m.alive():
        raise PhaseError(f"daemon exited before the phase: {m.log_tail(3)}")
    mon = procstat.PhaseMonitor(m.pid, m.cache_dirs).start()
    self0 = sysobj.metrics(m)
    minio0 = procstat.cpu_seconds([ctx.minio_pid]) if ctx.minio_pid else None
    t_mark = ctx.counter.mark() if ctx.counter else None
    t0 = time.monotonic()
    try:
        out = fn()
        if durable is not None and sysobj.async_upload:
            out["durable_wait_s"] = durable()
    finally:
        wall = time.monotonic() - t0
        stats = mon.stop()
    minio1 = procstat.cpu_seconds([ctx.minio_pid]) if ctx.minio_pid else None
    store = ctx.counter.collect(t_mark) if ctx.counter else None
    self1 = sysobj.metrics(m)
    if not m.alive():
        raise PhaseError(f"daemon died during the phase: {m.log_tail(3)}")
    run = {"status": "ok", "wall_s": wall, **{k: v for k, v in stats.items() if k != "wall_s"}}
    run.update({k: v for k, v in out.items() if k not in ("extra",)})
    run["extra"] = out.get("extra", {})
    r = BY_ID[row]
    if "value" not in run and r.unit == "MB/s" and run.get("timed_s"):
        # The tool timed its own I/O (fio: from the first request to the end, with a final
        # fsync for writes); its process start-up is not the file system's time.
        t = run["timed_s"] + run.get("durable_wait_s", 0.0)
        run["value"] = run["bytes"] / t / 1e6 if t > 0 else 0.0
    if "value" not in run:
        if r.unit == "MB/s":
            run["value"] = run["bytes"] / wall / 1e6 if wall > 0 else 0.0
        elif r.unit == "s":
            run["value"] = wall
        elif r.unit == "files/s" and run.get("files"):
            run["value"] = run["files"] / wall if wall > 0 else 0.0
    if "durable_wait_s" in run and BY_ID[row].unit in ("MB/s", "files/s"):
        # The rate the application saw (close returned), before the store had the data.
        ack = (run["timed_s"] if "timed_s" in run else wall - run["durable_wait_s"])
        n = run.get("files") if r.unit == "files/s" else run["bytes"] / 1e6
        run["value_ack"] = n / ack if ack > 0 and n else None
    gb = run.get("bytes", 0) / 1e9
    run["cpu_s_per_gb"] = run["cpu_s"] / gb if gb >= 0.001 else None
    run["mean_cores"] = run["cpu_s"] / wall if wall > 0 else None
    if store is not None:
        run["store_requests"] = store["total"]
        run["store_by_api"] = store["by_api"]
        run["store_bytes_in"] = store["bytes_in"]
        run["store_bytes_out"] = store["bytes_out"]
    if minio0 is not None:
        run["store_cpu_s"] = minio1 - minio0
        run["store_cpu_s_per_gb"] = run["store_cpu_s"] / gb if gb >= 0.001 else None
    if self0 is not None and self1 is not None:
        by = {k: int(self1["by_op"].get(k, 0) - self0["by_op"].get(k, 0)) for k in self1["by_op"]}
        by = {k: v for k, v in by.items() if v}
        run["self_requests"] = sum(by.values())
        run["self_by_op"] = by
        for k in ("bytes_up", "bytes_down"):
            if self1.get(k) is not None and self0.get(k) is not None:
                run["self_" + k] = self1[k] - self0[k]
    return run


# ------------------------------------------------------------------------------------------------
# helpers for phases


class Session:
    """Mounts of one system for one group and repeat, under its own prefix."""

    def __init__(self, ctx: Ctx, sysobj: System, prefix: str, rep: int, group: str):
        self.ctx = ctx
        self.sys = sysobj
        self.prefix = prefix.strip("/")
        self.rep = rep
        self.group = group
        self.mnt = ctx.workdir / "mnt" / sysobj.name
        self.cache = ctx.workdir / "cache" / sysobj.name
        self.log = ctx.workdir / "logs" / f"{sysobj.name}.log"
        self.m: Mount | None = None
        self.n = 0

    def mount(self, cold: bool = True) -> Mount:
        self.unmount()
        if cold:
            if not drop_caches():
                self.ctx.dropped_caches = False
        if self.cache.exists():
            shutil.rmtree(self.cache, ignore_errors=True)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.m = self.sys.mount(self.ctx.bucket, self.prefix, self.mnt, self.cache, self.log)
        return self.m

    def unmount(self) -> float | None:
        if self.m is None:
            return None
        m, self.m = self.m, None
        return self.sys.unmount(m)

    def key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def phase(self, row: str, fn, durable=None) -> dict | None:
        """Measures one row; records the run (ok or error) and returns it."""
        if row in self.sys.unsupported:
            self.ctx.record(row, self.sys.name, {"status": "unsupported", "error": self.sys.unsupported[row]})
            return None
        assert self.m is not None
        log(f"  {self.sys.name:9s} {row}")
        try:
            run = measure(self.ctx, self.sys, self.m, row, fn, durable=durable)
        except PhaseError as e:
            st = "unsupported" if (e.unsupported or _classify(str(e))) else "error"
            run = {"status": st, "error": str(e)}
            log(f"    -> {st}: {e}")
        except Exception as e:  # noqa: BLE001
            run = {"status": "error", "error": f"{type(e).__name__}: {e}"}
            log(f"    -> error: {run['error']}")
            traceback.print_exc()
        else:
            v = run.get("value")
            log(f"    -> {v:.2f} {BY_ID[row].unit}" if isinstance(v, (int, float)) else "    -> ok")
        run["rep"] = self.rep
        self.ctx.record(row, self.sys.name, run)
        return run

    # what reached the store: S3 itself, or a fresh mount for a system that stores chunks

    def stored_sizes(self, sub: str) -> dict[str, int]:
        """Path (relative to the session's prefix) -> size of every file stored under sub."""
        if self.sys.object_per_file:
            base = self.key("")
            return {o.key[len(base):]: o.size for o in self.ctx.s3.list(self.ctx.bucket, self.key(sub))
                    if not o.key.endswith("/")}
        m = self.mount(cold=True)
        out = {}
        try:
            for root, _, files in os.walk(m.mountpoint / sub):
                for f in files:
                    p = Path(root) / f
                    out[str(p.relative_to(m.mountpoint))] = p.stat().st_size
        finally:
            self.unmount()
        return out

    def stored_md5(self, rel: str) -> tuple[int, str]:
        h, n = hashlib.md5(), 0
        if self.sys.object_per_file:
            for c in self.ctx.s3.get_stream(self.ctx.bucket, self.key(rel)):
                h.update(c)
                n += len(c)
            return n, h.hexdigest()
        m = self.mount(cold=True)
        try:
            with open(m.mountpoint / rel, "rb") as f:
                while c := f.read(8 << 20):
                    h.update(c)
                    n += len(c)
        finally:
            self.unmount()
        return n, h.hexdigest()

    # durability (for write-back systems)

    def wait_objects(self, expect: dict[str, int], timeout: float | None = None) -> float:
        t0 = time.monotonic()
        timeout = timeout or self.ctx.sizes["timeout"]
        want = {self.key(k): v for k, v in expect.items()}
        while True:
            have = {o.key: o.size for o in self.ctx.s3.list(self.ctx.bucket, self.key(""))}
            if all(have.get(k) == v for k, v in want.items()):
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                raise PhaseError("data did not reach the store in time")
            time.sleep(0.1)

    def wait_count(self, sub: str, count: int, size: int, timeout: float | None = None) -> float:
        t0 = time.monotonic()
        timeout = timeout or self.ctx.sizes["timeout"]
        while True:
            n = sum(1 for o in self.ctx.s3.list(self.ctx.bucket, self.key(sub)) if o.size == size and not o.key.endswith("/"))
            if n >= count:
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                raise PhaseError(f"only {n} of {count} files reached the store in time")
            time.sleep(0.2)


def disk_check(ctx: Ctx, need: int) -> None:
    """Refuses a phase whose data would not fit on the store's disk with room to spare (the
    disk is shared: a full disk fails every process on it, not only this run). The store
    frees deleted objects in the background, so this waits a minute for room first."""
    reserve = ctx.sizes.get("disk_reserve", 0)
    deadline = time.monotonic() + 60
    while True:
        free = shutil.disk_usage(ctx.workdir).free
        if free >= need + reserve:
            return
        if time.monotonic() > deadline:
            raise PhaseError(f"not enough disk: {free / 2**30:.1f} GiB free, the phase needs "
                             f"{need / 2**30:.1f} GiB + {reserve / 2**30:.0f} GiB reserve")
        time.sleep(2)


def fio(mnt: Path, rw: str, size: int, numjobs: int, timeout: float, extra: list[str] = (), out: Path | None = None) -> dict:
    out = out or (mnt.parent.parent / "fio.json")
    if out.exists():
        out.unlink()
    cmd = [
        "fio", "--name=seq", "--ioengine=libaio", f"--rw={rw}", "--bs=1M", f"--size={size}",
        f"--numjobs={numjobs}", "--direct=1", *extra, f"--directory={mnt}", "--group_reporting",
        "--output-format=json", f"--output={out}",
    ]
    if "write" in rw:
        # The upload is part of the timed run: fsync at the end (close follows right after).
        cmd.append("--end_fsync=1")
    r = run_cmd(cmd, timeout)
    try:
        doc = json.loads(out.read_text())
    except (OSError, json.JSONDecodeError):
        raise PhaseError(f"fio failed (exit {r.returncode}): {_tail(r.stderr or r.stdout)}")
    job = doc["jobs"][0]
    if r.returncode != 0 or job.get("error"):
        raise PhaseError(f"fio error {job.get('error')} (exit {r.returncode}): {_tail(r.stderr or r.stdout)}")
    d = job["write" if "write" in rw else "read"]
    return {
        "bytes": d["io_bytes"],
        "timed_s": d["runtime"] / 1000,  # the longest job (job_runtime sums them)
        "extra": {"fio_bw_mb_s": d["bw_bytes"] / 1e6, "fio_runtime_s": job["job_runtime"] / 1000, "iops": d["iops"],
                  "lat_mean_ms": (d.get("clat_ns") or {}).get("mean", 0) / 1e6},
    }


def loadgen_run(ctx: Ctx, args: list[str], timeout: float) -> dict:
    r = run_cmd([sys.executable, str(LOADGEN), *args], timeout)
    try:
        out = json.loads(r.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise PhaseError(f"loadgen failed (exit {r.returncode}): {_tail(r.stderr)}")
    if r.returncode != 0:
        samples = out.get("error_samples") or [e for p in out.get("passes", []) for e in p.get("error_samples", [])]
        raise PhaseError(f"loadgen: {out.get('errors')} errors, {out.get('mismatches', 0)} mismatches: {'; '.join(samples[:3])}")
    return out


# ------------------------------------------------------------------------------------------------
# shared read-only data sets (written once per run straight to the store)


S_IFREG = 0o100000
S_IFDIR = 0o040000


def _meta(mode: int) -> dict[str, str]:
    return {"mode": str(mode), "uid": "0", "gid": "0", "mtime": str(int(time.time()))}


def shared_listing(ctx: Ctx) -> tuple[set[str], list[tuple[str, bytes]]]:
    """The directories and small files of the ls dir and the find tree, under shared/."""
    s = ctx.sizes
    dirs = {"shared/"}
    files: list[tuple[str, bytes]] = []
    if "lsfind" in ctx.groups:
        dirs.add("shared/ls/")
        for i in range(s["ls_n"]):
            files.append((f"shared/ls/f{i:06d}", f"ls entry {i}\n".encode()))
        dirs.add("shared/tree/")
        depth, fan = 2, s["tree_fanout"]
        for i in range(s["tree_n"]):
            leaf = loadgen.leaf_dir(i, depth, fan)
            parts = leaf.split("/")
            for k in range(1, len(parts) + 1):
                dirs.add("shared/tree/" + "/".join(parts[:k]) + "/")
            files.append((f"shared/tree/{leaf}/f{i:07d}", f"tree entry {i}\n".encode()))
    return dirs, files


def large_chunks(ctx: Ctx, i: int):
    """The bytes of shared/large/fileNN, 1 MiB at a time (each MiB tagged with file and index)."""
    base = loadgen.base_block(1 << 20)
    left = ctx.sizes["cr_size"]
    j = 0
    while left > 0:
        c = (f"{i:08d}{j:08d}".encode() + base[16:])[:left]
        yield c
        left -= len(c)
        j += 1


def populate_shared(ctx: Ctx) -> dict:
    """ls dir, find tree and the large files for concurrent reads, under shared/."""
    s = ctx.sizes
    s3, b = ctx.s3, ctx.bucket
    info: dict = {}
    want = set(ctx.groups)
    dirs, files = shared_listing(ctx)
    t0 = time.monotonic()

    def put_dir(k):
        s3.request("PUT", b, k, body=b"", headers={"content-type": "application/x-directory",
                                                     **{f"x-amz-meta-{a}": v for a, v in _meta(S_IFDIR | 0o755).items()}})

    def put_file(kv):
        s3.put(b, kv[0], kv[1], meta=_meta(S_IFREG | 0o644))

    with ThreadPoolExecutor(16) as ex:
        list(ex.map(put_dir, sorted(dirs)))
        list(ex.map(put_file, files))
    info["small_objects"] = len(files) + len(dirs)
    if "concurrent" in want:
        md5s = {}

        def put_large(i):
            h = hashlib.md5()

            def chunks():
                for c in large_chunks(ctx, i):
                    h.update(c)
                    yield c

            s3.put_chunks(b, f"shared/large/file{i:02d}", chunks(), 16 << 20)
            md5s[f"file{i:02d}"] = h.hexdigest()

        s3.put(b, "shared/large/", b"", meta=_meta(S_IFDIR | 0o755))
        with ThreadPoolExecutor(4) as ex:
            list(ex.map(put_large, range(s["cr_n"])))
        info["large_md5"] = md5s
    info["seconds"] = time.monotonic() - t0
    return info


def empty_via_mount(ss: Session) -> None:
    """Removes a group's files through a mount (a chunk store frees its objects only so)."""
    m = ss.mount(cold=False)
    try:
        for p in m.mountpoint.iterdir():
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                try:
                    p.unlink()
                except OSError:
                    pass
    finally:
        ss.unmount()


def populate_via_mount(ctx: Ctx, sysobj: System) -> float:
    """The shared data sets written through a mount of sysobj, for a system whose files are
    not plain objects (the ones populate_shared wrote are invisible to it). Same paths and
    bytes; not timed as a phase."""
    ss = Session(ctx, sysobj, "shared", 0, "populate")
    t0 = time.monotonic()
    m = ss.mount(cold=False)
    try:
        root = m.mountpoint
        dirs, files = shared_listing(ctx)
        for d in sorted(dirs):
            (root / d[len("shared/"):]).mkdir(parents=True, exist_ok=True)

        def write(kv):
            (root / kv[0][len("shared/"):]).write_bytes(kv[1])

        with ThreadPoolExecutor(16) as ex:
            list(ex.map(write, files))
        if "concurrent" in ctx.groups:
            (root / "large").mkdir(exist_ok=True)

            def write_large(i):
                with open(root / "large" / f"file{i:02d}", "wb") as f:
                    for c in large_chunks(ctx, i):
                        f.write(c)

            with ThreadPoolExecutor(4) as ex:
                list(ex.map(write_large, range(ctx.sizes["cr_n"])))
    finally:
        ss.unmount()
    return time.monotonic() - t0


# ------------------------------------------------------------------------------------------------
# the groups


def g_seq(ss: Session) -> None:
    ctx, S = ss.ctx, ss.ctx.sizes["seq"]
    t = ctx.sizes["timeout"]
    m = ss.mount()
    # The store's copy, plus the daemon's local one where it keeps one until close.
    disk_check(ctx, S * (2 if ss.sys.stages_writes else 1))
    run = ss.phase("seq-write", lambda: fio(m.mountpoint, "write", S, 1, t, extra=ss.sys.fio_write_extra),
                   durable=lambda: ss.wait_objects({"seq.0.0": S}))
    ss.unmount()
    write_ok = run is not None and run["status"] == "ok"
    if write_ok:
        got = ss.stored_sizes("").get("seq.0.0")
        if got != S:
            run.update(status="error", error=f"verify: object is {got} bytes, expected {S}")
            write_ok = False
    if not write_ok:
        ctx.record("seq-read", ss.sys.name, {"status": "error", "error": "no input (seq-write failed)", "rep": ss.rep})
        return
    m = ss.mount(cold=True)

    def read():
        out = fio(m.mountpoint, "read", S, 1, t)
        if out["bytes"] != S:
            raise PhaseError(f"verify: read {out['bytes']} bytes, expected {S}")
        return out

    ss.phase("seq-read", read)
    ss.unmount()


def g_read4(ss: Session) -> None:
    ctx, S = ss.ctx, ss.ctx.sizes["r4_size"]
    t = ctx.sizes["timeout"]
    m = ss.mount()
    try:
        prep = fio(m.mountpoint, "write", S, 4, t, extra=ss.sys.fio_write_extra)
        if ss.sys.async_upload:
            ss.wait_objects({f"seq.{j}.0": S for j in range(4)})
    except PhaseError as e:
        ctx.record("read-4jobs", ss.sys.name, {"status": "error", "error": f"prepare (fio write 4 jobs): {e}", "rep": ss.rep})
        ss.unmount()
        return
    ss.unmount()
    m = ss.mount(cold=True)
    rt = ctx.sizes["r4_runtime"]
    ss.phase("read-4jobs", lambda: fio(m.mountpoint, "read", S, 4, t + rt, extra=["--time_based", f"--runtime={rt}"]))
    ss.unmount()


def g_small(ss: Session) -> None:
    ctx, s = ss.ctx, ss.ctx.sizes
    t = s["timeout"]
    common = ["--file-size-KB", str(s["sf_kb"]), "--file-count", str(s["sf_count"]), "--threads",
              str(s["sf_threads"]), "--depth", "1", "--fanout", str(s["sf_dirs"])]
    m = ss.mount()
    disk_check(ctx, s["sf_count"] * s["sf_kb"] * 1024)  # small files are not staged whole

    def write():
        out = loadgen_run(ctx, ["write", "--dir", str(m.mountpoint / "sf"), *common], t)
        return {"bytes": out["bytes"], "extra": {"files_s": out["files_s"], "files": out["files"]}}

    size = s["sf_kb"] * 1024
    run = ss.phase("small-files-write", write, durable=lambda: ss.wait_count("sf/", s["sf_count"], size))
    ss.unmount()
    if run is None or run["status"] != "ok":
        for r in ("small-files-read-cold", "small-files-read-warm"):
            ctx.record(r, ss.sys.name, {"status": "error", "error": "no input (small-files-write failed)", "rep": ss.rep})
        return
    n = sum(1 for v in ss.stored_sizes("sf/").values() if v == size)
    if n != s["sf_count"]:
        run.update(status="error", error=f"verify: {n} of {s['sf_count']} objects in the store")
    m = ss.mount(cold=True)
    for row in ("small-files-read-cold", "small-files-read-warm"):
        def read():
            out = loadgen_run(ctx, ["read", "--dir", str(m.mountpoint / "sf"), *common, "--verify"], t)
            p = out["passes"][0]
            return {"bytes": p["bytes"], "extra": {"files_s": p["files_s"], "verified": True}}

        ss.phase(row, read)
    ss.unmount()


_SB_RE = {
    "reads_s": r"reads/s:\s+([\d.]+)",
    "writes_s": r"writes/s:\s+([\d.]+)",
    "fsyncs_s": r"fsyncs/s:\s+([\d.]+)",
    "read_mib_s": r"read, MiB/s:\s+([\d.]+)",
    "written_mib_s": r"written, MiB/s:\s+([\d.]+)",
}


def sysbench(mnt: Path, s: dict, mode: str, action: str, timeout: float) -> subprocess.CompletedProcess:
    cmd = ["sysbench", "fileio", f"--file-num={s['sb_files']}", "--file-block-size=16384",
           f"--file-total-size={s['sb_total']}"]
    if action == "run":
        cmd += [f"--file-test-mode={mode}", f"--time={s['sb_time']}", "--events=0", "--threads=1"]
    cmd.append(action)
    r = run_cmd(cmd, timeout, cwd=str(mnt))
    if r.returncode != 0 or "FATAL" in r.stdout or "FATAL" in r.stderr:
        raise PhaseError(f"sysbench {action} {mode} failed (exit {r.returncode}): {_tail(r.stdout + r.stderr)}")
    return r


def g_sysbench(ss: Session) -> None:
    ctx, s = ss.ctx, ss.ctx.sizes
    t = s["timeout"]
    # seqwr is sysbench's "creation" test (it recreates the files): last, so that a system that
    # fails it does not take the other modes' input with it
    modes = ["seqrd", "rndrd", "rndwr", "rndrw", "seqwr"]
    rows = [f"sysbench-{m}" for m in modes]
    if "sysbench-prepare" in ss.sys.unsupported:
        for r in rows:
            ctx.record(r, ss.sys.name, {"status": "unsupported", "error": ss.sys.unsupported["sysbench-prepare"], "rep": ss.rep})
        return
    m = ss.mount()
    try:
        t0 = time.monotonic()
        sysbench(m.mountpoint, s, "seqwr", "prepare", t)
        if ss.sys.async_upload:
            per = s["sb_total"] // s["sb_files"]
            ss.wait_objects({f"test_file.{i}": per for i in range(s["sb_files"])})
        prep_s = time.monotonic() - t0
    except PhaseError as e:
        for r in rows:
            ctx.record(r, ss.sys.name, {"status": "error", "error": f"prepare: {e}", "rep": ss.rep})
        ss.unmount()
        return
    ss.unmount()
    for mode, row in zip(modes, rows):
        try:
            m = ss.mount(cold=True)
        except RuntimeError as e:
            ctx.record(row, ss.sys.name, {"status": "error", "error": f"mount: {e}", "rep": ss.rep})
            continue

        def run(mode=mode, m=m):
            r = sysbench(m.mountpoint, s, mode, "run", t + s["sb_time"])
            vals = {}
            for k, rx in _SB_RE.items():
                mm = re.search(rx, r.stdout)
                vals[k] = float(mm.group(1)) if mm else 0.0
            mb_s = (vals["read_mib_s"] + vals["written_mib_s"]) * 1.048576
            ops = vals["reads_s"] + vals["writes_s"]
            if ops <= 0:
                raise PhaseError(f"sysbench {mode}: no operations completed: {_tail(r.stdout)}")
            return {"value": mb_s, "bytes": int(mb_s * 1e6 * s["sb_time"]),
                    "extra": {**vals, "ops_s": ops, "prepare_s": prep_s}}

        res = ss.phase(row, run)
        # A background-upload system uploads what the mode wrote after the phase: its unmount
        # waits for that (bucketfs-bg) or leaves it (see the report).
        took = ss.unmount()
        if res and res["status"] == "ok" and took is not None:
            res["extra"]["unmount_s"] = took


def g_lsfind(ss: Session) -> None:
    ctx, s = ss.ctx, ss.ctx.sizes
    t = s.get("ls_timeout", s["timeout"])

    def lister(flag: str, count):
        def ls():
            r = run_cmd(["ls", flag, str(ss.m.mountpoint / "ls")], t)
            if r.returncode != 0:
                raise PhaseError(f"ls failed: {_tail(r.stderr)}")
            n = count(r.stdout.splitlines())
            if n != s["ls_n"]:
                raise PhaseError(f"verify: ls {flag} listed {n} files, expected {s['ls_n']}")
            return {"bytes": 0, "extra": {"entries": n}}
        return ls

    # ls -f: names only, in directory order (no sort, no stat); ls -l: a stat of every entry.
    for row, flag, count in (("ls-dir-f", "-f", lambda ls: sum(1 for x in ls if x not in (".", ".."))),
                             ("ls-dir", "-l", lambda ls: sum(1 for x in ls if x.startswith("-")))):
        ss.mount(cold=True)
        run = ss.phase(row, lister(flag, count))
        if run and run["status"] == "ok":
            run["extra"]["entries_s"] = s["ls_n"] / run["wall_s"]
    m = ss.mount(cold=True)

    def find():
        r = run_cmd(["find", str(m.mountpoint / "tree"), "-type", "f"], t)
        if r.returncode != 0:
            raise PhaseError(f"find failed: {_tail(r.stderr)}")
        n = len(r.stdout.splitlines())
        if n != s["tree_n"]:
            raise PhaseError(f"verify: find listed {n} files, expected {s['tree_n']}")
        return {"bytes": 0, "extra": {"entries": n}}

    run = ss.phase("find-tree", find)
    if run and run["status"] == "ok":
        run["extra"]["entries_s"] = s["tree_n"] / run["wall_s"]
    ss.unmount()


def g_cp(ss: Session) -> None:
    ctx, s = ss.ctx, ss.ctx.sizes
    src = ctx.workdir / "large-src.bin"
    md5 = (ctx.workdir / "large-src.md5").read_text().strip()
    m = ss.mount()
    # the source comes from the page cache, not the local disk
    _warm(src)

    def cp():
        r = run_cmd(["cp", str(src), str(m.mountpoint / "big.bin")], s["timeout"])
        if r.returncode != 0:
            raise PhaseError(f"cp failed: {_tail(r.stderr)}")
        return {"bytes": s["cp"]}

    run = ss.phase("large-cp", cp, durable=lambda: ss.wait_objects({"big.bin": s["cp"]}))
    ss.unmount()
    if run and run["status"] == "ok":
        n, digest = ss.stored_md5("big.bin")
        run["extra"]["seconds"] = run["wall_s"]
        if n != s["cp"] or digest != md5:
            run.update(status="error", error=f"verify: stored object ({n} bytes) differs from the source")


def _warm(path: Path) -> None:
    with open(path, "rb", buffering=0) as f:
        while f.read(8 << 20):
            pass


def g_create(ss: Session) -> None:
    ctx, s = ss.ctx, ss.ctx.sizes
    m = ss.mount()
    size = s["mc_kb"] * 1024

    def create():
        out = loadgen_run(ctx, ["write", "--dir", str(m.mountpoint / "mc"), "--file-size-KB", str(s["mc_kb"]),
                                "--file-count", str(s["mc_n"]), "--threads", "1", "--depth", str(s["mc_depth"]),
                                "--fanout", str(s["mc_fanout"])], s["timeout"])
        return {"bytes": out["bytes"], "files": out["files"], "extra": {"dirs": out["dirs"], "mkdir_s": out["mkdir_seconds"]}}

    run = ss.phase("many-create", create, durable=lambda: ss.wait_count("mc/", s["mc_n"], size))
    ss.unmount()
    if run and run["status"] == "ok":
        run["extra"]["seconds"] = run["wall_s"]
        n = sum(1 for v in ss.stored_sizes("mc/").values() if v == size)
        if n != s["mc_n"]:
            run.update(status="error", error=f"verify: {n} of {s['mc_n']} objects in the store")


def g_concurrent(ss: Session) -> None:
    ctx, s = ss.ctx, ss.ctx.sizes
    m = ss.mount(cold=True)
    files = [str(m.mountpoint / "large" / f"file{i:02d}") for i in range(s["cr_n"])]
    md5s = ctx.shared.get("large_md5", {})

    def read():
        args = ["readfiles", "--threads", str(s["cr_n"])] + (["--md5"] if ctx.verify_full else []) + files
        out = loadgen_run(ctx, args, s["timeout"])
        for path, r in out["files"].items():
            name = os.path.basename(path)
            if r["bytes"] != s["cr_size"]:
                raise PhaseError(f"verify: {name}: read {r['bytes']} bytes, expected {s['cr_size']}")
            if r["md5"] and r["md5"] != md5s.get(name):
                raise PhaseError(f"verify: {name}: content differs")
        return {"bytes": out["bytes"], "extra": {"slowest_file_s": max(r["seconds"] for r in out["files"].values())}}

    run = ss.phase("concurrent-reads", read)
    if run and run["status"] == "ok":
        run["extra"]["seconds"] = run["wall_s"]
    ss.unmount()


def g_pandas(ss: Session) -> None:
    ctx, s = ss.ctx, ss.ctx.sizes
    if not ctx.have_pandas:
        ctx.record("pandas-overwrite", ss.sys.name, {"status": "error", "error": "pandas is not installed for the runner", "rep": ss.rep})
        return
    m = ss.mount()
    args = ["--path", str(m.mountpoint / "frame.csv"), "--rows", str(s["pd_rows"]), "--iterations", str(s["pd_iter"])]

    def run():
        r = run_cmd([ctx.python, str(PANDAS), *args], s["timeout"])
        if r.returncode != 0:
            raise PhaseError(f"pandas failed: {_tail(r.stderr)}")
        out = json.loads(r.stdout.strip().splitlines()[-1])
        return {"value": out["overwrite_median_s"], "bytes": out["bytes"] * s["pd_iter"],
                "extra": {"create_s": out["create_s"], "overwrite_times_s": out["overwrite_times_s"], "file_bytes": out["bytes"]}}

    res = ss.phase("pandas-overwrite", run)
    if ss.sys.async_upload and res and res["status"] == "ok":
        # the last version must reach the store before the remount reads it back
        try:
            ss.wait_objects({"frame.csv": res["extra"]["file_bytes"]})
        except PhaseError:
            pass
    ss.unmount()
    if res and res["status"] == "ok":
        m = ss.mount(cold=True)
        r = run_cmd([ctx.python, str(PANDAS), "--path", str(m.mountpoint / "frame.csv"), "--rows", str(s["pd_rows"]),
                     "--iterations", str(s["pd_iter"]), "--verify"], s["timeout"])
        ss.unmount()
        if r.returncode != 0:
            res.update(status="error", error=f"verify: the CSV read back differs: {_tail(r.stdout + r.stderr)}")


GROUP_FN = {
    "seq": g_seq, "read4": g_read4, "small": g_small, "sysbench": g_sysbench, "lsfind": g_lsfind,
    "cp": g_cp, "create": g_create, "concurrent": g_concurrent, "pandas": g_pandas, "epoch2": g_epoch2,
}
SHARED_GROUPS = {"lsfind", "concurrent"}


# ------------------------------------------------------------------------------------------------
# the limit


def run_limit(ctx: Ctx, rep: int, size: int, warm: Path | None = None) -> dict:
    """The limit of one repeat: the PUT and GET of `size` bytes run at each concurrency in
    limit_conc, and the best PUT and best GET count (the store's best, not one setting that
    suits it less). With `warm`, that file is read into the page cache first (see g_cp)."""
    tries = [run_limit_at(ctx, rep, conc, size, warm) for conc in ctx.sizes["limit_conc"]]
    ok = [t for t in tries if t.get("status") == "ok"]
    if not ok:
        return {**tries[0], "tries": tries}
    best_put = max(ok, key=lambda t: t["put_mb_s"])
    best_get = max(ok, key=lambda t: t["get_mb_s"])
    out = {**best_put, "get_mb_s": best_get["get_mb_s"], "put_conc": best_put["conc"],
           "get_conc": best_get["conc"], "tries": tries}
    if warm is None and "small" in ctx.groups:
        # The small-file rows' own limit: their cost is per request, which one large object
        # does not show.
        sm = run_limit_at(ctx, rep, SMALL_CONC, 0, None, small=min(ctx.sizes["sf_count"], SMALL_LIMIT_MAX))
        out["small"] = sm
        if sm.get("status") == "ok":
            out.update({k: v for k, v in sm.items() if k.startswith("small_")})
    return out


#: requests in flight for the small-object limit (the small-file rows run 128 threads)
SMALL_CONC = 128
#: objects the small-object limit writes at most (its rate does not depend on the count beyond
#: a few thousand; the scale size's 100,000 would cost 12.5 GiB more of disk)
SMALL_LIMIT_MAX = 10000


def run_limit_at(ctx: Ctx, rep: int, conc: int, size: int, warm: Path | None, small: int = 0) -> dict:
    s = ctx.sizes
    if not ctx.bucketfs_bin:
        return {"status": "n/a", "error": "no bucketfs binary", "rep": rep}
    b = Bucketfs(None, ctx.bucketfs_bin)  # type: ignore[arg-type]
    if not b.has_bench():
        return {"status": "n/a", "error": "bucketfs has no bench subcommand", "rep": rep}
    if small and "--small-count" not in (b.bench_help() or ""):
        return {"status": "n/a", "error": "bucketfs bench has no --small-count", "rep": rep}
    name = "limit-cp" if warm else ("limit-small" if small else "limit")
    cmd = [ctx.bucketfs_bin, "bench", f"s3://{ctx.bucket}/{name}-r{rep}", "--endpoint-url", ctx.store_env["endpoint"],
           "--force-path-style", "--region", ctx.store_env["region"], "--size", str(size),
           "--concurrency", str(conc), "--part-size", str(8 << 20), "--json",
           "--unsigned-payload"]
    if small:
        cmd += ["--small-count", str(small), "--small-size", str(ctx.sizes["sf_kb"] * 1024),
                "--small-concurrency", str(conc)]
    # The GETs read a cold object, as every read phase does after its drop_caches.
    if os.geteuid() == 0 and b.bench_has_cold():
        cmd.append("--cold")
    log(f"  {name:9s} bucketfs bench --size {size} --concurrency {conc}" + (f", {warm.name} cached" if warm else "")
        + (f", {small} small objects" if small else ""))
    # The same start as every system's phase, which mounts after a drop_caches: the store's
    # cost per byte written depends on how much of memory its page cache already holds.
    if not drop_caches():
        ctx.dropped_caches = False
    if warm:
        _warm(warm)
    t_mark = ctx.counter.mark() if ctx.counter else None
    minio0 = procstat.cpu_seconds([ctx.minio_pid]) if ctx.minio_pid else None
    outp = ctx.workdir / "limit.out"
    errp = ctx.workdir / "limit.err"
    t0 = time.monotonic()
    with open(outp, "w") as fo, open(errp, "w") as fe:
        p = subprocess.Popen(cmd, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL, env=ctx.store_env["env"])
    timer = threading.Timer(s["timeout"], p.kill)
    timer.start()
    try:
        _, status, ru = os.wait4(p.pid, 0)
    finally:
        timer.cancel()
    p.returncode = os.waitstatus_to_exitcode(status)
    wall = time.monotonic() - t0
    out, err = outp.read_text(), errp.read_text()
    cpu = ru.ru_utime + ru.ru_stime
    gb = 2 * (size or small * ctx.sizes["sf_kb"] * 1024) / 1e9  # written once and read once
    run: dict = {"rep": rep, "conc": conc, "wall_s": wall, "cpu_s": cpu, "cpu_s_per_gb": cpu / gb, "mean_cores": cpu / wall,
                 "peak_rss_mb": ru.ru_maxrss / 1024}
    if p.returncode != 0:
        return {**run, "status": "error", "error": f"bucketfs bench exit {p.returncode}: {_tail(err)}"}
    try:
        doc = json.loads([l for l in out.splitlines() if l.strip().startswith("{")][-1])
    except (IndexError, json.JSONDecodeError):
        return {**run, "status": "error", "error": f"bucketfs bench printed no JSON: {_tail(out + err)}"}
    run.update(status="ok", **doc)
    if ctx.counter:
        st = ctx.counter.collect(t_mark)
        if st:
            run["store_requests"] = st["total"]
            run["store_by_api"] = st["by_api"]
    if minio0 is not None:
        run["store_cpu_s"] = procstat.cpu_seconds([ctx.minio_pid]) - minio0
        run["store_cpu_s_per_gb"] = run["store_cpu_s"] / gb
    if small:
        log(f"    -> small PUT {doc.get('small_put_mb_s')} MB/s, GET {doc.get('small_get_mb_s')} MB/s")
    else:
        log(f"    -> PUT {doc.get('put_mb_s')} MB/s, GET {doc.get('get_mb_s')} MB/s")
    return run


# ------------------------------------------------------------------------------------------------
# the whole run


def run_all(ctx: Ctx) -> None:
    s = ctx.sizes
    log(f"populating shared data sets under s3://{ctx.bucket}/shared/")
    ctx.shared = populate_shared(ctx)
    log(f"  {ctx.shared.get('small_objects', 0)} small objects, {len(ctx.shared.get('large_md5', {}))} large, "
        f"{ctx.shared['seconds']:.1f} s")
    if "cp" in ctx.groups:
        src = ctx.workdir / "large-src.bin"
        h = hashlib.md5()
        with open(src, "wb") as f:
            left = s["cp"]
            while left > 0:
                c = os.urandom(min(left, 8 << 20))
                h.update(c)
                f.write(c)
                left -= len(c)
        (ctx.workdir / "large-src.md5").write_text(h.hexdigest())
    for sysobj in ctx.systems:
        sysobj.setup(ctx.workdir)
        ctx.s3.put(ctx.bucket, f"{sysobj.name}/", b"", meta=_meta(S_IFDIR | 0o755))
        if not sysobj.object_per_file and SHARED_GROUPS & set(ctx.groups):
            log(f"writing the shared data sets through {sysobj.name}")
            try:
                log(f"  {populate_via_mount(ctx, sysobj):.1f} s")
            except Exception as e:  # noqa: BLE001 - its shared rows then fail, the rest runs
                log(f"  failed: {type(e).__name__}: {e}")
    for rep in range(1, ctx.repeat + 1):
        log(f"=== repeat {rep}/{ctx.repeat}")
        ctx.limit_runs.append(run_limit(ctx, rep, s["limit_size"]))
        for group in ctx.groups:
            log(f"--- {group}")
            if group == "cp" and ctx.bucketfs_bin:
                # cp runs with its 1 GiB source in the page cache, and on this VM that alone
                # raises the store's CPU per GB written by a third (the same fio write: 3.3 ->
                # 4.5 core-s/GB): its own limit is a PUT from that same state.
                ctx.limit_cp_runs.append(run_limit(ctx, rep, s["cp"], warm=ctx.workdir / "large-src.bin"))
            for sysobj in ctx.systems:
                prefix = "shared" if group in SHARED_GROUPS else f"{sysobj.name}/{group}-r{rep}"
                if group not in SHARED_GROUPS:
                    ctx.s3.put(ctx.bucket, prefix + "/", b"", meta=_meta(S_IFDIR | 0o755))
                ss = Session(ctx, sysobj, prefix, rep, group)
                before = {r.id: len(ctx.results.get(r.id, {}).get(sysobj.name, [])) for r in rows_of(group)}
                try:
                    GROUP_FN[group](ss)
                except Exception as e:  # noqa: BLE001 - a failed mount etc. fails the group's rows
                    msg = f"{type(e).__name__}: {e}" if not isinstance(e, (PhaseError, RuntimeError)) else str(e)
                    log(f"  {sysobj.name}: {group} failed: {msg}")
                    if not isinstance(e, (PhaseError, RuntimeError)):
                        traceback.print_exc()
                    for r in rows_of(group):
                        if len(ctx.results.get(r.id, {}).get(sysobj.name, [])) == before[r.id]:
                            ctx.record(r.id, sysobj.name, {"status": "error", "error": msg, "rep": rep})
                finally:
                    try:
                        ss.unmount()
                    except Exception:  # noqa: BLE001
                        pass
                    # rows the group never reached (e.g. it returned early)
                    for r in rows_of(group):
                        if len(ctx.results.get(r.id, {}).get(sysobj.name, [])) == before[r.id]:
                            ctx.record(r.id, sysobj.name, {"status": "error", "error": "not run", "rep": rep})
                    if group not in SHARED_GROUPS:
                        try:
                            if not sysobj.object_per_file:
                                empty_via_mount(ss)
                            ctx.s3.delete_prefix(ctx.bucket, prefix + "/")
                        except Exception as e:  # noqa: BLE001
                            log(f"  cleanup of {prefix} failed: {e}")


# ------------------------------------------------------------------------------------------------
# medians


NUMERIC_KEYS = ("value", "bytes", "wall_s", "cpu_s", "cpu_s_per_gb", "mean_cores", "peak_rss_mb", "disk_peak_mb",
                "store_requests", "self_requests", "store_cpu_s", "store_cpu_s_per_gb", "durable_wait_s",
                "value_ack")


def _median(xs):
    xs = [x for x in xs if isinstance(x, (int, float))]
    return statistics.median(xs) if xs else None


def summarize(ctx: Ctx) -> dict:
    rows = {}
    for r in ROWS:
        per = ctx.results.get(r.id, {})
        rows[r.id] = {}
        for sysname, runs in per.items():
            ok = [x for x in runs if x.get("status") == "ok"]
            bad = [x for x in runs if x.get("status") != "ok"]
            if ok:
                status = "ok" if not bad else "partial"
            else:
                statuses = {x.get("status") for x in runs}
                status = "unsupported" if statuses == {"unsupported"} else "error"
            med = {k: _median([x.get(k) for x in ok]) for k in NUMERIC_KEYS}
            extra_keys = sorted({k for x in ok for k, v in x.get("extra", {}).items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
            med["extra"] = {k: _median([x["extra"].get(k) for x in ok]) for k in extra_keys}
            # request breakdowns: the one of the median run (by value)
            if ok:
                ref = sorted(ok, key=lambda x: x.get("value") or 0)[len(ok) // 2]
                med["store_by_api"] = ref.get("store_by_api")
                med["self_by_op"] = ref.get("self_by_op")
            rows[r.id][sysname] = {
                "status": status, "runs": len(runs), "ok_runs": len(ok),
                "errors": sorted({x.get("error", "") for x in bad if x.get("error")}),
                "median": med,
            }
    limit = summarize_limit(ctx.limit_runs)
    if ctx.limit_cp_runs:
        limit["cp"] = summarize_limit(ctx.limit_cp_runs)
    return {"rows": rows, "limit": limit}


SMALL_KEYS = ("small_put_mb_s", "small_get_mb_s", "small_put_files_s", "small_get_files_s", "small_count",
              "small_concurrency")


def summarize_limit(runs: list) -> dict:
    lim_ok = [x for x in runs if x.get("status") == "ok"]
    return {
        "status": "ok" if lim_ok else (runs[0].get("status") if runs else "n/a"),
        "errors": sorted({x.get("error", "") for x in runs if x.get("status") != "ok" and x.get("error")}),
        "put_mb_s": _median([x.get("put_mb_s") for x in lim_ok]),
        "get_mb_s": _median([x.get("get_mb_s") for x in lim_ok]),
        "put_requests": _median([x.get("put_requests") for x in lim_ok]),
        "get_requests": _median([x.get("get_requests") for x in lim_ok]),
        **{k: _median([x.get(k) for x in lim_ok]) for k in SMALL_KEYS},
        "small_store_cpu_s_per_gb": _median([(x.get("small") or {}).get("store_cpu_s_per_gb") for x in lim_ok]),
        "small_cpu_s_per_gb": _median([(x.get("small") or {}).get("cpu_s_per_gb") for x in lim_ok]),
        "store_requests": _median([x.get("store_requests") for x in lim_ok]),
        "store_cpu_s": _median([x.get("store_cpu_s") for x in lim_ok]),
        "store_cpu_s_per_gb": _median([x.get("store_cpu_s_per_gb") for x in lim_ok]),
        "cpu_s_per_gb": _median([x.get("cpu_s_per_gb") for x in lim_ok]),
        "mean_cores": _median([x.get("mean_cores") for x in lim_ok]),
        "peak_rss_mb": _median([x.get("peak_rss_mb") for x in lim_ok]),
        "runs": len(runs), "ok_runs": len(lim_ok),
    }
