"""The second epoch (issue 22): the small-files set and one large file, read once into
bucketfs's --data-cache, then read again after a remount with the cache kept and the page
cache dropped; with FUSE passthrough (--passthrough) and without it. Each run is
quoted against reading the same bytes from plain files on the disk the cache lives on, read
the same way after a drop_caches just before and just after the row, the faster of the two
(`extra`: local_mb_s and ratio_to_local); the daemon's CPU
per GB and peak RSS come from the phase as for every row. bucketfs only: no peer's cache
is read this way."""

from __future__ import annotations

import os
import shutil
import time
import urllib.request
from pathlib import Path

# (small-files row, large-file row or None, mount flags). The `-ttl` row mounts with a stat TTL
# longer than the phase (a data set nobody changes): the directory pages the warmup mount saved
# in the data cache answer the lookups after the remount instead of a LIST per directory.
MODES = (
    ("epoch2-small-files", "epoch2-large", ["--passthrough"]),
    ("epoch2-small-files-daemon", "epoch2-large-daemon", []),
    ("epoch2-small-files-ttl", None, ["--passthrough", "--stat-ttl", "3600"]),
)


def _metric(m, name: str) -> float:
    from .systems import parse_prometheus

    with urllib.request.urlopen(m.metrics_url, timeout=5) as r:
        return parse_prometheus(r.read().decode("utf-8", "replace")).get(name, 0.0)


def _warm(ss, R, m, timeout: float) -> None:
    """First epoch: `bucketfs warmup` until a pass caches everything it reads (a block the
    cache writer was too far behind for is skipped and fetched by the next pass), then until
    the writer is done."""
    for _ in range(4):
        before = _metric(m, "bucketfs_data_cache_skipped_total")
        r = R.run_cmd([ss.ctx.bucketfs_bin, "warmup", str(m.mountpoint)], timeout)
        if r.returncode != 0:
            raise R.PhaseError(f"warmup failed: {R._tail(r.stderr or r.stdout)}")
        if _metric(m, "bucketfs_data_cache_skipped_total") == before:
            break
    last, still = -1.0, 0
    deadline = time.monotonic() + timeout
    while still < 5 and time.monotonic() < deadline:
        now = _metric(m, "bucketfs_data_cache_bytes")
        still = still + 1 if now == last else 0
        last = now
        time.sleep(0.2)


def g_epoch2(ss) -> None:
    from . import runner as R
    from .rows import rows_of

    ctx, s = ss.ctx, ss.ctx.sizes
    if ss.sys.name != "bucketfs" or not ctx.bucketfs_bin:
        for r in rows_of("epoch2"):
            ctx.record(r.id, ss.sys.name, {"status": "unsupported", "error": "bucketfs --data-cache only", "rep": ss.rep})
        return
    t = s["timeout"]
    common = ["--file-size-KB", str(s["sf_kb"]), "--file-count", str(s["sf_count"]), "--threads",
              str(s["sf_threads"]), "--depth", "1", "--fanout", str(s["sf_dirs"])]
    big = s["seq"]
    local = ctx.workdir / "epoch2-local"
    dcache = ctx.workdir / "epoch2-cache"  # the same disk as `local`
    shutil.rmtree(local, ignore_errors=True)
    local.mkdir(parents=True)
    base = list(ss.sys.extra_args)
    try:
        # The data: plain local files, and the same bytes in the store.
        R.loadgen_run(ctx, ["write", "--dir", str(local / "sf"), *common], t)
        with open(local / "big", "wb") as f:
            left = big
            while left > 0:
                c = os.urandom(min(left, 8 << 20))
                f.write(c)
                left -= len(c)
        m = ss.mount()
        R.loadgen_run(ctx, ["write", "--dir", str(m.mountpoint / "sf"), *common], t)
        r = R.run_cmd(["cp", str(local / "big"), str(m.mountpoint / "big")], t)
        if r.returncode != 0:
            raise R.PhaseError(f"cp of the large file failed: {R._tail(r.stderr)}")
        ss.unmount()

        def read_small(d: Path) -> dict:
            out = R.loadgen_run(ctx, ["read", "--dir", str(d), *common, "--verify"], t)["passes"][0]
            return {"bytes": out["bytes"], "timed_s": out["seconds"], "extra": {"files_s": out["files_s"]}}

        def read_big(p: Path) -> dict:
            out = R.loadgen_run(ctx, ["readfiles", "--threads", "1", str(p)], t)
            if out["bytes"] != big:
                raise R.PhaseError(f"verify: read {out['bytes']} bytes of {big}")
            return {"bytes": out["bytes"], "timed_s": out["seconds"]}

        def local_mb_s(read, p: Path) -> float:
            # The local disk's figure from the same cold start, taken next to the row's own
            # (the shared disk's speed drifts over minutes).
            R.drop_caches()
            loc = read(p)
            return loc["bytes"] / loc["timed_s"] / 1e6

        for small_row, big_row, flags in MODES:
            shutil.rmtree(dcache, ignore_errors=True)
            ss.sys.extra_args = base + ["--data-cache", str(dcache), *flags]
            _warm(ss, R, ss.mount(), t)
            ss.unmount()
            m = ss.mount(cold=True)  # after a drop_caches; the data cache stays
            for row, fn, read, p in ((small_row, lambda: read_small(m.mountpoint / "sf"), read_small, local / "sf"),
                                     (big_row, lambda: read_big(m.mountpoint / "big"), read_big, local / "big")):
                if row is None:
                    continue
                before = local_mb_s(read, p)
                R.drop_caches()
                opens = _metric(m, "bucketfs_passthrough_opens_total")
                run = ss.phase(row, fn)
                if run and run["status"] == "ok":
                    # Before and after the row: the better of the two, against bucketfs.
                    loc_mb_s = max(before, local_mb_s(read, p))
                    run["extra"]["local_mb_s"] = loc_mb_s
                    run["extra"]["ratio_to_local"] = run["value"] / loc_mb_s if loc_mb_s else None
                    run["extra"]["passthrough_opens"] = _metric(m, "bucketfs_passthrough_opens_total") - opens
                    R.log(f"    -> {run['extra']['ratio_to_local']:.2f} of the local disk ({loc_mb_s:.0f} MB/s), "
                          f"{run.get('cpu_s_per_gb') or 0:.3f} daemon CPU s/GB")
            ss.unmount()
    finally:
        ss.sys.extra_args = base
        shutil.rmtree(local, ignore_errors=True)
        shutil.rmtree(dcache, ignore_errors=True)
