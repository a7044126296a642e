"""results.json → Markdown tables and PNG plots."""

from __future__ import annotations

from pathlib import Path

from .rows import BY_ID, ROWS
from .sizes import human

PEER_BASELINE = "bucketfs"
#: bucketfs in background-upload mode, quoted against the limit and the peers like bucketfs
BG = "bucketfs-bg"


def fmt(v, digits=None) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, str):
        return v
    if isinstance(v, float) and v.is_integer() and digits is None and abs(v) >= 1:
        v = int(v)
    if isinstance(v, int) and digits is None:
        return f"{v:,}"
    if digits is not None:
        return f"{v:.{digits}f}"
    a = abs(v)
    if a >= 1000:
        return f"{v:,.0f}"
    if a >= 100:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.3f}"


def limit_of(doc: dict, row_id: str) -> float | None:
    r = BY_ID[row_id]
    lim = doc["summary"]["limit"]
    if r.limit == "put-cp" and "cp" in lim:
        return lim["cp"].get("put_mb_s")
    if r.limit in ("put", "put-cp"):  # results from before the cp limit have only the one
        return lim.get("put_mb_s")
    if r.limit == "get":
        return lim.get("get_mb_s")
    if r.limit in ("put-small", "get-small"):
        return lim.get(f"small_{r.limit[:3]}_mb_s")
    return None


def best_peer(doc: dict, row_id: str) -> tuple[str | None, float | None]:
    r = BY_ID[row_id]
    best = None
    name = None
    for sysname, res in doc["summary"]["rows"].get(row_id, {}).items():
        # bucketfs in another mode (bucketfs-bg) is no peer
        if sysname.startswith(PEER_BASELINE) or res["status"] not in ("ok", "partial"):
            continue
        v = res["median"].get("value")
        if v is None:
            continue
        if best is None or (v > best if r.better == "higher" else v < best):
            best, name = v, sysname
    return name, best


def ratio_limit(doc, row_id, v):
    lim = limit_of(doc, row_id)
    if v is None or not lim:
        return None
    return v / lim


def paired_ratios(doc, row_id, system: str = PEER_BASELINE) -> list[float]:
    """bucketfs's figure in each repeat divided by the limit measured at the start of the same
    repeat. The store drifts over a long run (MinIO on this VM got 30 % slower over 40 min), so
    these pair figures taken minutes apart, where the median ratio may pair different repeats."""
    kind = BY_ID[row_id].limit or ""
    key = {"put": "put_mb_s", "get": "get_mb_s", "put-cp": "put_mb_s", "put-small": "small_put_mb_s",
           "get-small": "small_get_mb_s"}.get(kind)
    runs = doc.get("runs") or {}
    if not key:
        return []
    limit_runs = runs.get("limit_cp") if kind == "put-cp" and runs.get("limit_cp") else runs.get("limit", [])
    lims = {x.get("rep"): x.get(key) for x in limit_runs if x.get("status", "ok") == "ok"}
    out = []
    for x in (runs.get("rows", {}).get(row_id, {}).get(system) or []):
        lim, v = lims.get(x.get("rep")), x.get("value")
        if x.get("status") == "ok" and isinstance(v, (int, float)) and lim:
            out.append(v / lim)
    return out


def ratio_peer(doc, row_id, v):
    _, b = best_peer(doc, row_id)
    if v is None or not b:
        return None
    return v / b if BY_ID[row_id].better == "higher" else b / v


def cell(res: dict | None) -> tuple[str, float | None]:
    if res is None:
        return "—", None
    st = res["status"]
    if st == "unsupported":
        return "unsupported", None
    if st == "error":
        return "error", None
    v = res["median"].get("value")
    s = fmt(v)
    if st == "partial":
        s += f" ({res['ok_runs']}/{res['runs']} ok)"
    return s, v


WRITE_BACK = "†"
#: uploads after close(), but close() waits until the data is durable on local disk
LOCAL_DURABLE = "‡"


def acks_before_durable(meta: dict, s: str) -> bool:
    si = meta["systems"].get(s) or {}
    # results from before the flag: every async system was one
    return si.get("acks_before_durable", si.get("async_upload", False))


def label(meta: dict, s: str) -> str:
    """A system's name, marked when it acknowledges writes before they are durable (†) or
    before they are in the store but durable locally (‡)."""
    si = meta["systems"].get(s) or {}
    if acks_before_durable(meta, s):
        return s + WRITE_BACK
    return s + LOCAL_DURABLE if si.get("async_upload") else s


def has_ack(doc: dict) -> bool:
    return any(res["median"].get("value_ack") is not None
               for per in doc["summary"]["rows"].values() for res in per.values())


def ack_table(doc: dict) -> list[str]:
    """For the systems that upload after close(): each write row's rate as the application saw
    it (close returned) beside the durable rate (until the store held the data), with the
    drain, and each one against the best peer's same kind of rate."""
    meta = doc["meta"]
    rows = doc["summary"]["rows"]
    systems = [s for s in meta["systems_order"] if meta["systems"][s].get("async_upload")]
    if not systems:
        return []
    out = ["### Acknowledged and durable rates\n",
           "For the systems that upload after close(): **ack** is the rate the application saw (up to the "
           "last close(); for fio, fio's own runtime with its final fsync), **durable** the same up to the moment "
           "the store held every object at its full size (the figure above), **drain s** the difference. "
           "**÷ best ack** compares ack rates, the fair comparison between systems that all return before the "
           "upload; the systems that upload before close() have ack = durable.\n",
           "| scenario | system | ack | durable | drain s | ack ÷ best other ack | CPU core-s/GB (incl. drain) |",
           "|---|---|---|---|---|---|---|"]
    n = 0
    for r in ROWS:
        if r.unit not in ("MB/s", "files/s"):
            continue
        res_all = rows.get(r.id) or {}
        acks = {}
        for s, res in res_all.items():
            if res["status"] not in ("ok", "partial"):
                continue
            m = res["median"]
            acks[s] = m.get("value_ack") if m.get("value_ack") is not None else (
                None if meta["systems"].get(s, {}).get("async_upload") else m.get("value"))
        for s in systems:
            res = res_all.get(s)
            if not res or res["status"] not in ("ok", "partial") or res["median"].get("value_ack") is None:
                continue
            m = res["median"]
            others = {k: v for k, v in acks.items() if k != s and v is not None
                      and not (k.startswith(PEER_BASELINE) and s.startswith(PEER_BASELINE))}
            best = max(others.items(), key=lambda kv: kv[1]) if others else None
            rr = f"{fmt(m['value_ack'] / best[1], 2)} ({best[0]})" if best and best[1] else "n/a"
            out.append(f"| {r.id} | {label(meta, s)} | {fmt(m['value_ack'])} {r.unit} | {fmt(m.get('value'))} {r.unit} "
                       f"| {fmt(m.get('durable_wait_s'))} | {rr} | {fmt(m.get('cpu_s_per_gb'))} |")
            n += 1
    return out + [""] if n else []


def markdown(doc: dict, plots_rel: str | None = "plots") -> str:
    meta = doc["meta"]
    systems = meta["systems_order"]
    rows = doc["summary"]["rows"]
    lim = doc["summary"]["limit"]
    L: list[str] = []
    L.append(f"# bucketfs benchmark results ({meta['size']} size)\n")
    L.append(f"Command: `{meta['command']}`\n")
    # RESULTS.md sits beside the spec; a report in an --out directory names it.
    spec = "[BENCHMARKS.md](BENCHMARKS.md)" if plots_rel == "results" else "`bench/BENCHMARKS.md`"
    L.append(f"Scenarios and the published figures to compare with: {spec}; how each figure is measured: "
             f"{'[README.md](README.md)' if plots_rel == 'results' else '`bench/README.md`'}.\n")
    L.append(f"- Date: {meta['date']}, {meta['repeat']} repeat(s) of every measurement, medians shown.")
    h = meta["host"]
    split = meta.get("cpu_split")
    if split:
        where = (f"The store ({meta['store']}) runs on the same machine but on CPU(s) {split['store']} only; "
                 f"the limit client, the file systems and the tools run on CPU(s) {split['others']} "
                 "(`--store-cpus`), as if the store were another machine.")
    else:
        where = (f"The store ({meta['store']}) runs on the same machine, so every figure shares the CPU with it.")
    L.append(f"- Machine: {h['cpu']}, {h['cores']} cores, {h['mem_gb']:.0f} GB RAM, Linux {h['kernel']}. {where}")
    L.append(f"- Page cache dropped before every mount (so before every phase) and before the limit: "
             f"{'yes' if meta.get('dropped_caches') else 'NO (not root?)'}.")
    L.append("- Systems:")
    for s in systems:
        si = meta["systems"][s]
        L.append(f"  - **{label(meta, s)}** {si['version']}; options: {si['options']}")
    if any(acks_before_durable(meta, s) for s in systems):
        L.append(f"- {WRITE_BACK} acknowledges writes before they are durable: close() returns before the "
                 "store has the data (a write-back cache), so a crash then loses acknowledged writes. Its write "
                 "rows include the wait until the store holds what was written (polled by S3 LIST), so they "
                 "are durable rates; its create rate as the application sees it is higher" +
                 (" (both: \"Acknowledged and durable rates\" below)." if has_ack(doc) else "."))
    if any(meta["systems"][s].get("async_upload") and not acks_before_durable(meta, s) for s in systems):
        L.append(f"- {LOCAL_DURABLE} uploads in the background (`--upload background`): close() returns once "
                 "the data is fsync'd in a local write-back directory, so a crash loses nothing (the next "
                 "mount uploads it). Its write rows, like †'s, include the wait until the store holds the "
                 "data; the rate close() gives the application is beside it below.")
    L.append("- MB = 10^6 bytes, GB = 10^9 bytes.\n")

    L.append("## The limit: the store with no file system in between\n")
    if lim["status"] == "ok":
        L.append("`bucketfs bench` (one parallel multipart PUT, then parallel ranged GETs of it, through "
                 f"bucketfs's store layer; {meta['sizes_human']['limit']}; when run as root the page cache "
                 "is dropped before the PUT, as before every phase, and between PUT and GET (`--cold`)):\n")
        L.append("| | MB/s | requests | client CPU core-s/GB | store CPU core-s/GB | client peak RSS MB |")
        L.append("|---|---|---|---|---|---|")
        L.append(f"| PUT | {fmt(lim['put_mb_s'])} | {fmt(lim['put_requests'])} | {fmt(lim.get('cpu_s_per_gb'))} (PUT+GET) "
                 f"| {fmt(lim.get('store_cpu_s_per_gb'))} (PUT+GET) | {fmt(lim.get('peak_rss_mb'))} |")
        L.append(f"| GET | {fmt(lim['get_mb_s'])} | {fmt(lim['get_requests'])} | | | |")
        if lim.get("small_put_mb_s"):
            n, kb = lim.get("small_count"), meta["sizes"]["sf_kb"]
            L.append(f"| small PUT ({fmt(n)} × {kb} KiB, {fmt(lim.get('small_concurrency'))} in flight) "
                     f"| {fmt(lim['small_put_mb_s'])} ({fmt(lim.get('small_put_files_s'))} objects/s) | {fmt(n)} "
                     f"| {fmt(lim.get('small_cpu_s_per_gb'))} (PUT+GET) | {fmt(lim.get('small_store_cpu_s_per_gb'))} "
                     "(PUT+GET) | |")
            L.append(f"| small GET | {fmt(lim['small_get_mb_s'])} ({fmt(lim.get('small_get_files_s'))} objects/s) "
                     f"| {fmt(n)} | | | |")
        cp = lim.get("cp")
        if cp and cp["status"] == "ok":
            L.append(f"| PUT, cp's source cached | {fmt(cp['put_mb_s'])} | {fmt(cp['put_requests'])} "
                     f"| {fmt(cp.get('cpu_s_per_gb'))} (PUT+GET) | {fmt(cp.get('store_cpu_s_per_gb'))} (PUT+GET) "
                     f"| {fmt(cp.get('peak_rss_mb'))} |")
        L.append("")
        if cp:
            L.append("large-cp is quoted against its own PUT limit: the same `bucketfs bench`, "
                     f"{human(meta['sizes']['cp'])}, run at the start of the cp group after the page-cache "
                     "drop and after reading cp's source into the page cache, the state cp itself runs in. "
                     "With the store on the same machine, a fuller page cache alone makes the store "
                     "spend more CPU per GB written (on the 2-core VM where this was found: 3.3 -> 4.5 "
                     "core-s/GB for the same fio write).")
            if cp["status"] != "ok":
                L.append(f"Not measured: {'; '.join(cp.get('errors') or [cp['status']])}.")
            L.append("")
    else:
        L.append(f"Not measured: {'; '.join(lim.get('errors') or [lim['status']])}. Ratios to the limit are n/a.\n")

    L.append("## Summary\n")
    L.append("Main figure of each scenario (median). **÷ limit**: bucketfs's figure divided by the limit "
             "(PUT for writes, GET for reads). **÷ best peer**: bucketfs against the best other system, as a "
             "speed ratio (> 1: bucketfs is faster; for times it is best peer time ÷ bucketfs time). "
             "The small-files rows are quoted against the small-object limit (N × 128 KiB PUT / GET, "
             "128 in flight), the others against the large-object one. "
             "**÷ limit, each repeat**: each repeat's figure divided by the limit measured at the start of "
             "that repeat.\n")
    bg = BG in systems
    head = ["scenario", "unit"] + [label(meta, s) for s in systems] + ["bucketfs ÷ limit", "÷ limit, each repeat", "bucketfs ÷ best peer"]
    if bg:
        head += [f"{BG} ÷ limit", f"{BG} ÷ best peer"]
    L.append("| " + " | ".join(head) + " |")
    L.append("|" + "---|" * len(head))
    for r in ROWS:
        if not rows.get(r.id):  # a group this run did not run
            continue
        cells = []
        vals = {}
        for s in systems:
            txt, v = cell(rows[r.id].get(s))
            cells.append(txt)
            vals[s] = v
        bv = vals.get(PEER_BASELINE)
        arrow = "↑" if r.better == "higher" else "↓"
        bp_name, _ = best_peer(doc, r.id)
        rp = ratio_peer(doc, r.id, bv)
        line = (f"| {r.id} | {r.unit} {arrow} | " + " | ".join(cells) +
                f" | {fmt(ratio_limit(doc, r.id, bv), 2)} | {' / '.join(fmt(x, 2) for x in paired_ratios(doc, r.id))}"
                f" | {fmt(rp, 2)}{f' ({bp_name})' if rp is not None else ''} |")
        if bg:
            gv = vals.get(BG)
            gp = ratio_peer(doc, r.id, gv)
            line += f" {fmt(ratio_limit(doc, r.id, gv), 2)} | {fmt(gp, 2)}{f' ({bp_name})' if gp is not None else ''} |"
        L.append(line)
    L.append("")
    ack = ack_table(doc)
    if ack:
        L.extend(ack)

    L.append("## Details\n")
    L.append("Per scenario and system: the figure; ÷ limit; ÷ best peer (speed ratio, see above); wall time of the "
             "measured phase; the FUSE daemon's CPU (core-seconds per GB moved, and mean cores busy over the phase); "
             "its peak RSS (VmHWM, reset before the phase); the store's CPU per GB moved (MinIO, when the bench started it); the most local disk it held (cache dir + open temp files); "
             "S3 requests the store saw during the phase (MinIO audit log, every system), and the requests bucketfs "
             "itself counted (its /metrics).\n")
    for r in ROWS:
        if not rows.get(r.id):  # a group this run did not run
            continue
        L.append(f"### {r.id}: {meta['row_descriptions'].get(r.id, '')}\n")
        L.append("| system | " + f"{r.unit} {'↑' if r.better == 'higher' else '↓'}" +
                 " | ÷ limit | ÷ best peer | wall s | CPU core-s/GB | mean cores | peak RSS MB | store CPU core-s/GB | local disk MB | store requests | bucketfs requests |")
        L.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for s in systems:
            res = rows[r.id].get(s)
            txt, v = cell(res)
            if res is None or res["status"] in ("error", "unsupported"):
                why = ("; ".join(res["errors"])[:160] if res else "").replace("|", "\\|")
                L.append(f"| {label(meta, s)} | {txt}: {why} | | | | | | | | | | |")
                continue
            m = res["median"]
            L.append("| " + " | ".join([
                label(meta, s), txt, fmt(ratio_limit(doc, r.id, v), 2), fmt(ratio_peer(doc, r.id, v), 2), fmt(m.get("wall_s")),
                fmt(m.get("cpu_s_per_gb")), fmt(m.get("mean_cores"), 2), fmt(m.get("peak_rss_mb")),
                fmt(m.get("store_cpu_s_per_gb")), fmt(m.get("disk_peak_mb")), fmt(m.get("store_requests")), fmt(m.get("self_requests")),
            ]) + " |")
        L.append("")
        if r.id == "read-4jobs":
            total = 4 * meta["sizes"]["r4_size"]
            passes = []
            for s in systems:
                res = rows[r.id].get(s)
                if res and res["status"] in ("ok", "partial") and res["median"].get("bytes"):
                    passes.append(f"{s} {res['median']['bytes'] / total:.1f}")
            if passes:
                L.append("fio's time-based run reads the 4 files over and over: times each file was read, "
                         f"{', '.join(passes)}. After the first pass a system may serve them from its own cache, "
                         "so this row can exceed the limit when the files are small next to bandwidth × runtime.\n")

    L.append("## Requests by S3 API (store side, median run)\n")
    L.append("| scenario | system | requests |")
    L.append("|---|---|---|")
    for r in ROWS:
        for s in systems:
            res = rows.get(r.id, {}).get(s)
            if not res or res["status"] not in ("ok", "partial"):
                continue
            by = res["median"].get("store_by_api") or {}
            if by:
                txt = ", ".join(f"{k} {v}" for k, v in sorted(by.items(), key=lambda kv: -kv[1]))
                L.append(f"| {r.id} | {s} | {txt} |")
    L.append("")

    errs = []
    for r in ROWS:
        for s in systems:
            res = rows.get(r.id, {}).get(s)
            if res and res["errors"]:
                errs.append(f"- {r.id} / {s} ({res['status']}): " + "; ".join(e[:300] for e in res["errors"]))
    if errs:
        L.append("## Errors and unsupported scenarios\n")
        L.extend(errs)
        L.append("")
    if plots_rel and doc.get("plots"):
        L.append("## Plots\n")
        for name in doc["plots"]:
            L.append(f"![{name}]({plots_rel}/{name})\n")
    return "\n".join(L) + "\n"


# ------------------------------------------------------------------------------------------------


def plots(doc: dict, outdir: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    outdir.mkdir(parents=True, exist_ok=True)
    systems = doc["meta"]["systems_order"]
    rows = doc["summary"]["rows"]
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]
    colors = {s: palette[i % len(palette)] for i, s in enumerate(systems)}
    made = []
    title_sfx = f" — {doc['meta']['size']} size, {doc['meta']['host']['cores']} cores"

    def grouped(ids, key, ylabel, title, fname, limit_key=None, log=False):
        ids = [i for i in ids if i in rows]
        have = [rows[i][s]["median"].get(key) for i in ids for s in systems
                if rows[i].get(s) and rows[i][s]["status"] in ("ok", "partial")]
        if not ids or not any(isinstance(v, (int, float)) and v > 0 for v in have):
            return
        fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(ids) + 3), 5))
        n = len(systems)
        w = 0.8 / n
        for k, s in enumerate(systems):
            xs, ys, marks = [], [], []
            for i, rid in enumerate(ids):
                res = rows[rid].get(s)
                x = i - 0.4 + w * (k + 0.5)
                v = None
                if res and res["status"] in ("ok", "partial"):
                    v = res["median"].get(key) if key != "value" else res["median"].get("value")
                if v is None:
                    tag = "n/s" if res and res["status"] == "unsupported" else ("err" if res and res["status"] == "error" else "n/a")
                    marks.append((x, tag))
                else:
                    xs.append(x)
                    ys.append(v)
            ax.bar(xs, ys, w, label=s, color=colors[s])
            for x, tag in marks:
                ax.text(x, 0.02, tag, rotation=90, ha="center", va="bottom", fontsize=7, color=colors[s],
                        transform=ax.get_xaxis_transform())
        if limit_key:
            first = True
            for i, rid in enumerate(ids):
                lv = limit_of(doc, rid)
                if lv:
                    ax.hlines(lv, i - 0.45, i + 0.45, colors="black", linestyles="--", label="limit (bucketfs bench)" if first else None)
                    first = False
        ax.set_xticks(range(len(ids)))
        ax.set_xticklabels(ids, rotation=30, ha="right")
        ax.set_ylabel(ylabel)
        ax.set_title(title + title_sfx)
        if log:
            ax.set_yscale("log")
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        fig.savefig(outdir / fname, dpi=110)
        plt.close(fig)
        made.append(fname)

    mb_rows = [r.id for r in ROWS if r.unit == "MB/s"]
    grouped(mb_rows, "value", "MB/s (higher is better, log scale)", "Bandwidth", "bandwidth.png", limit_key=True, log=True)
    data_rows = [r.id for r in ROWS if r.unit == "MB/s" or r.id == "large-cp"]
    grouped(data_rows, "cpu_s_per_gb", "daemon CPU, core-seconds per GB (lower is better)", "CPU per GB", "cpu_per_gb.png", log=True)
    grouped([r.id for r in ROWS], "peak_rss_mb", "daemon peak RSS, MB (lower is better)", "Peak memory", "peak_rss.png")

    other = [r for r in ROWS if r.unit != "MB/s" and r.id in rows]
    if other:
        fig, axes = plt.subplots(1, len(other), figsize=(3.2 * len(other) + 1, 4.2))
        if len(other) == 1:
            axes = [axes]
        for ax, r in zip(axes, other):
            for k, s in enumerate(systems):
                res = rows[r.id].get(s)
                v = res["median"].get("value") if res and res["status"] in ("ok", "partial") else None
                ax.bar([k], [v or 0], color=colors[s], label=s)
                if v is None:
                    ax.text(k, 0.02, "n/s" if res and res["status"] == "unsupported" else "err", rotation=90, ha="center",
                            va="bottom", fontsize=7, transform=ax.get_xaxis_transform())
            ax.set_xticks(range(len(systems)))
            ax.set_xticklabels(systems, rotation=30, ha="right", fontsize=8)
            ax.set_title(f"{r.id}\n{r.unit} ({'higher' if r.better == 'higher' else 'lower'} is better)", fontsize=9)
            ax.grid(axis="y", alpha=0.3)
        fig.suptitle("Metadata and application scenarios" + title_sfx, fontsize=10)
        fig.tight_layout()
        fig.savefig(outdir / "metadata.png", dpi=110)
        plt.close(fig)
        made.append("metadata.png")
    return made
