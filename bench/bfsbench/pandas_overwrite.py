#!/usr/bin/env python3
"""pandas overwrite: write a DataFrame to CSV at PATH, then overwrite it ITER-1 more times, timing
each to_csv call (open, write, close). With --verify, read PATH back and compare instead.

  pandas_overwrite.py --path MNT/frame.csv --rows 50000 --iterations 5
  pandas_overwrite.py --path MNT/frame.csv --rows 50000 --iterations 5 --verify
Prints one JSON object; exits 1 on a mismatch."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import pandas as pd


def frame(rows: int, version: int) -> pd.DataFrame:
    rng = np.random.default_rng(1000 + version)
    return pd.DataFrame({
        "id": np.arange(rows, dtype=np.int64),
        "version": np.full(rows, version, dtype=np.int64),
        "x": rng.random(rows).round(6),
        "y": rng.normal(size=rows).round(6),
        "name": [f"item-{i:08d}" for i in range(rows)],
    })


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--path", required=True)
    ap.add_argument("--rows", type=int, default=50000)
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--verify", action="store_true")
    a = ap.parse_args()
    if a.verify:
        want = frame(a.rows, a.iterations - 1)
        got = pd.read_csv(a.path)
        ok = got.shape == want.shape and bool((got["id"] == want["id"]).all()) and bool(
            (got["version"] == want["version"]).all()) and bool((got["name"] == want["name"]).all()) and bool(
            np.allclose(got["x"], want["x"])) and bool(np.allclose(got["y"], want["y"]))
        json.dump({"verified": ok, "rows": int(got.shape[0])}, sys.stdout)
        print()
        return 0 if ok else 1
    frames = [frame(a.rows, v) for v in range(a.iterations)]
    times = []
    size = 0
    for df in frames:
        t0 = time.monotonic()
        df.to_csv(a.path, index=False)
        times.append(time.monotonic() - t0)
    import os

    size = os.path.getsize(a.path)
    over = times[1:] or times
    json.dump({
        "create_s": times[0], "overwrite_times_s": over, "overwrite_median_s": statistics.median(over),
        "overwrite_mean_s": statistics.mean(over), "bytes": size, "total_s": sum(times),
    }, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
