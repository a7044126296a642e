"""The result rows: what each measures, its unit, which way is better, and which limit it is
quoted against."""

from __future__ import annotations

from dataclasses import dataclass

from .sizes import human


@dataclass(frozen=True)
class Row:
    id: str
    group: str
    unit: str  # "MB/s", "s", "files/s"
    better: str  # "higher" | "lower"
    limit: str | None  # "put" | "get" | "put-cp" | "put-small" | "get-small" | None
    describe: object  # callable(sizes) -> str


ROWS: list[Row] = [
    Row("seq-write", "seq", "MB/s", "higher", "put",
        lambda s: f"fio write, 1 job, bs 1M, direct, {human(s['seq'])}"),
    Row("seq-read", "seq", "MB/s", "higher", "get",
        lambda s: f"fio read of that file after drop caches + remount"),
    # Right after seq, so that both rows quoted against the PUT limit are measured next to it:
    # the store slows down over a run (MinIO's limit fell 408 -> 280 MB/s over five repeats of
    # 7.5 min, and within a repeat), and a row measured minutes later pays for that drift.
    # Quoted against its own PUT limit, measured with cp's source in the page cache as cp runs.
    Row("large-cp", "cp", "MB/s", "higher", "put-cp",
        lambda s: f"cp of one {human(s['cp'])} local file into the mount"),
    Row("read-4jobs", "read4", "MB/s", "higher", "get",
        lambda s: f"fio read, 4 jobs × {human(s['r4_size'])}, time based {s['r4_runtime']} s, direct"),
    # Quoted against the small-object limit: N × 128 KiB PUT / GET, 128 in flight, direct.
    Row("small-files-write", "small", "MB/s", "higher", "put-small",
        lambda s: f"create {s['sf_count']} × {s['sf_kb']} KiB in {s['sf_dirs']} dirs, {s['sf_threads']} threads"),
    Row("small-files-read-cold", "small", "MB/s", "higher", "get-small",
        lambda s: f"read them all, {s['sf_threads']} threads, after remount"),
    Row("small-files-read-warm", "small", "MB/s", "higher", "get-small",
        lambda s: "second read pass on the same mount"),
    Row("sysbench-seqwr", "sysbench", "MB/s", "higher", "put",
        lambda s: f"sysbench fileio {s['sb_files']} files, {human(s['sb_total'])}, 16 KiB, {s['sb_time']} s"),
    Row("sysbench-seqrd", "sysbench", "MB/s", "higher", "get", lambda s: "sysbench seqrd"),
    Row("sysbench-rndrd", "sysbench", "MB/s", "higher", "get", lambda s: "sysbench rndrd"),
    Row("sysbench-rndwr", "sysbench", "MB/s", "higher", "put", lambda s: "sysbench rndwr"),
    Row("sysbench-rndrw", "sysbench", "MB/s", "higher", None, lambda s: "sysbench rndrw (read+written)"),
    Row("ls-dir", "lsfind", "s", "lower", None,
        lambda s: f"ls -l of a directory of {s['ls_n']} files, cold mount"),
    # Mountpoint's benchmark: names only (getdents, no stat per entry), which is what a
    # listing costs before any attribute is asked for.
    Row("ls-dir-f", "lsfind", "s", "lower", None,
        lambda s: f"ls -f of the same directory, cold mount"),
    Row("find-tree", "lsfind", "s", "lower", None,
        lambda s: f"find -type f over a tree of {s['tree_n']} files, cold mount"),
    Row("many-create", "create", "files/s", "higher", None,
        lambda s: f"create {s['mc_n']} × {s['mc_kb']} KiB files in nested dirs, 1 thread"),
    Row("concurrent-reads", "concurrent", "MB/s", "higher", "get",
        lambda s: f"{s['cr_n']} files × {human(s['cr_size'])} read at once"),
    Row("pandas-overwrite", "pandas", "s", "lower", None,
        lambda s: f"DataFrame.to_csv overwrite, {s['pd_rows']} rows (median of {s['pd_iter'] - 1})"),
    # Issue 22: reads from bucketfs's --data-cache after a remount (bfsbench/epoch2.py).
    Row("epoch2-small-files", "epoch2", "MB/s", "higher", None,
        lambda s: f"the {s['sf_count']} × {s['sf_kb']} KiB files again after a remount with --data-cache kept and "
                  "the page cache dropped (--passthrough)"),
    Row("epoch2-small-files-daemon", "epoch2", "MB/s", "higher", None,
        lambda s: "the same without --passthrough"),
    Row("epoch2-small-files-ttl", "epoch2", "MB/s", "higher", None,
        lambda s: "the same with --passthrough --stat-ttl 3600 (a data set nobody changes): the directory pages "
                  "the warmup mount saved in the data cache answer the lookups, no LIST"),
    Row("epoch2-large", "epoch2", "MB/s", "higher", None,
        lambda s: f"one {human(s['seq'])} file, the same way (--passthrough)"),
    Row("epoch2-large-daemon", "epoch2", "MB/s", "higher", None,
        lambda s: "the same without --passthrough"),
]

BY_ID = {r.id: r for r in ROWS}
GROUPS: list[str] = []
for _r in ROWS:
    if _r.group not in GROUPS:
        GROUPS.append(_r.group)


def rows_of(group: str) -> list[Row]:
    return [r for r in ROWS if r.group == group]
