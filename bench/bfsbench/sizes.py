"""Scenario sizes for each --size. `published` follows bench/BENCHMARKS.md; `ci` fits a 2-core
box in minutes per system; `smoke` only checks that every scenario still runs; `scale` runs the
published shapes as far as one 2-core, 24 GiB box with a shared disk allows (run it with
`--scenarios seq,small,lsfind`: every group deletes its data before the next one starts)."""

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

SIZES: dict[str, dict] = {
    "smoke": dict(
        seq=32 * MiB,
        r4_size=8 * MiB, r4_runtime=3,
        sf_count=200, sf_kb=128, sf_dirs=20, sf_threads=32,
        sb_files=16, sb_total=16 * MiB, sb_time=2,
        ls_n=100, tree_n=1000, tree_fanout=10,
        cp=64 * MiB,
        mc_n=100, mc_kb=4, mc_depth=2, mc_fanout=4,
        cr_n=10, cr_size=8 * MiB,
        pd_rows=5000, pd_iter=3,
        limit_size=32 * MiB, limit_conc=(8,),
        timeout=180,
        repeat=1,
    ),
    "ci": dict(
        seq=1 * GiB,  # the limit's size: seq-write and seq-read move what the limit moves
        r4_size=128 * MiB, r4_runtime=10,
        sf_count=2000, sf_kb=128, sf_dirs=100, sf_threads=128,
        sb_files=128, sb_total=128 * MiB, sb_time=10,
        ls_n=1000, tree_n=10000, tree_fanout=10,
        cp=1 * GiB,
        mc_n=500, mc_kb=4, mc_depth=3, mc_fanout=5,
        cr_n=10, cr_size=64 * MiB,
        pd_rows=50000, pd_iter=5,
        limit_size=1 * GiB, limit_conc=(8, 16),
        timeout=900,
        repeat=3,
    ),
    "scale": dict(
        seq=20 * GiB,
        r4_size=1 * GiB, r4_runtime=30,
        # the ossfs 2.0 guide's rw-bench: 100,000 x 128 KiB read by 128 threads
        sf_count=100000, sf_kb=128, sf_dirs=100, sf_threads=128,
        sb_files=128, sb_total=1 * GiB, sb_time=30,
        # one directory of 100,000 entries (ls -f, ls -l) and a find over a 100,000-file tree
        ls_n=100000, tree_n=100000, tree_fanout=10,
        cp=10 * GiB,
        mc_n=10000, mc_kb=4, mc_depth=3, mc_fanout=10,
        cr_n=10, cr_size=1 * GiB,
        pd_rows=100000, pd_iter=10,
        limit_size=1 * GiB, limit_conc=(8, 16),
        timeout=3600, ls_timeout=900,
        # a phase whose data would leave less than this free on the (shared) disk is refused
        disk_reserve=6 * GiB,
        repeat=1,
    ),
    "published": dict(
        seq=100 * GiB,
        r4_size=100 * GiB, r4_runtime=30,
        sf_count=100000, sf_kb=128, sf_dirs=100, sf_threads=128,
        sb_files=128, sb_total=8 * GiB, sb_time=60,
        ls_n=1000, tree_n=100000, tree_fanout=10,
        cp=10 * GiB,
        mc_n=10000, mc_kb=4, mc_depth=3, mc_fanout=10,
        cr_n=10, cr_size=10 * GiB,
        pd_rows=100000, pd_iter=10,
        limit_size=10 * GiB, limit_conc=(16, 64),
        timeout=6 * 3600,
        repeat=3,
    ),
}


def human(n: float) -> str:
    for unit, f in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= f and n % f == 0:
            return f"{int(n // f)} {unit}"
    for unit, f in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= f:
            return f"{n / f:.1f} {unit}"
    return f"{int(n)} B"
