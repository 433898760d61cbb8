"""``ckptio bench`` output: ratios to the baselines, the machine description (never secrets: no
environment, no endpoints or credentials), the text table and the PNG chart (matplotlib)."""

from __future__ import annotations

import contextlib
import os
import platform
from typing import Any

import torch

from ckptio.progress import human_bytes


def ratios(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For every ckptio figure, its speed relative to every baseline on the same backend, size and op."""
    out = []
    for r in records:
        if r["baseline"] or not r["median_seconds"]:
            continue
        for b in records:
            if (
                b["baseline"]
                and b["backend"] == r["backend"]
                and b["size_bytes"] == r["size_bytes"]
                and b["op"] == r["op"]
                and b["median_seconds"]
            ):
                out.append(
                    {
                        "backend": r["backend"],
                        "size_bytes": r["size_bytes"],
                        "op": r["op"],
                        "impl": r["impl"],
                        "baseline": b["impl"],
                        "ratio": b["median_seconds"] / r["median_seconds"],
                    }
                )
    return out


def summary(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per backend, size and op (save, load): ckptio's fastest implementation against the fastest baseline."""
    best: dict[tuple[str, int, str, bool], dict[str, Any]] = {}
    for r in records:
        if r["op"] not in ("save", "load") or not r["median_seconds"]:
            continue
        key = (r["backend"], r["size_bytes"], r["op"], r["baseline"])
        if key not in best or r["median_seconds"] < best[key]["median_seconds"]:
            best[key] = r
    out = []
    for (backend, size, op, is_base), mine in best.items():
        base = best.get((backend, size, op, True))
        if is_base or base is None:
            continue
        out.append(
            {
                "backend": backend,
                "size_bytes": size,
                "op": op,
                "impl": mine["impl"],
                "gb_per_s": mine["gb_per_s"],
                "baseline": base["impl"],
                "baseline_gb_per_s": base["gb_per_s"],
                "ratio": base["median_seconds"] / mine["median_seconds"],
            }
        )
    return out


# ---------------------------------------------------------------------------------------------
# machine description (never secrets: no environment, no endpoints with credentials)


def machine() -> dict[str, Any]:
    import importlib.metadata as md

    versions = {}
    for pkg in (
        "torch",
        "ckptio",
        "numpy",
        "fsspec",
        "s3fs",
        "gcsfs",
        "safetensors",
        "moto",
        "gcp-storage-emulator",
        "xxhash",
        "matplotlib",
    ):
        with contextlib.suppress(md.PackageNotFoundError):
            versions[pkg] = md.version(pkg)
    mem = None
    with contextlib.suppress(ImportError):
        import psutil

        mem = psutil.virtual_memory().total
    cpu = platform.processor() or ""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_bytes": mem,
        "torch_threads": torch.get_num_threads(),
        "versions": versions,
    }


# ---------------------------------------------------------------------------------------------
# output


OP_COLUMNS = (("save", "save"), ("load", "load"), ("load_cold", "load cold"))


def table(doc: dict[str, Any]) -> str:
    recs = doc["results"]
    lines = []
    for size in sorted({r["size_bytes"] for r in recs}):
        rows: dict[tuple[str, str], dict[str, Any]] = {}
        for r in recs:
            if r["size_bytes"] == size:
                rows.setdefault((r["backend"], r["impl"]), {"baseline": r["baseline"]})[r["op"]] = r
        lines.append(
            f"\n== {human_bytes(size)} of fp32 tensors; GB/s, median of {doc['settings']['repeats']}; "
            f"* = baseline; RSS+ = extra peak memory (MiB) save/load =="
        )
        w = max([len(i) for _, i in rows] + [14]) + 2
        lines.append(f"{'backend':<10}{'implementation':<{w}}{'save':>8}{'load':>8}{'load cold':>11}{'RSS+':>13}")
        backends = list(dict.fromkeys(b for b, _ in rows))
        for b in backends:
            for (bb, impl), ops in rows.items():
                if bb != b:
                    continue
                cells = []
                for op, _ in OP_COLUMNS:
                    g = ops.get(op, {}).get("gb_per_s")
                    cells.append(f"{g:.3f}" if g else "-")
                rss = [ops.get(op, {}).get("median_rss_extra_bytes") for op in ("save", "load")]
                rss_s = "/".join(f"{x / 2**20:.0f}" if x is not None else "-" for x in rss)
                name = ("* " if ops["baseline"] else "  ") + impl
                lines.append(f"{b:<10}{name:<{w}}{cells[0]:>8}{cells[1]:>8}{cells[2]:>11}{rss_s:>13}")
        rs = [x for x in doc["ratios"] if x["size_bytes"] == size]
        if rs:
            lines.append("\nratio = baseline time / ckptio time (>1: ckptio faster); save/load/load cold")
        for b in backends:
            mine = list(dict.fromkeys(x["impl"] for x in rs if x["backend"] == b))
            bases = list(dict.fromkeys(x["baseline"] for x in rs if x["backend"] == b))
            if not mine:
                continue
            cw = [max(len(x), 16) + 2 for x in bases]
            lines.append(f"{b[:28]:<30}" + "".join(f"{x:<{w}}" for x, w in zip(bases, cw, strict=True)))
            for impl in mine:
                cells = []
                for base in bases:
                    vals = [
                        next(
                            (
                                f"{x['ratio']:.2f}"
                                for x in rs
                                if x["backend"] == b and x["impl"] == impl and x["baseline"] == base and x["op"] == op
                            ),
                            None,
                        )
                        for op, _ in OP_COLUMNS
                    ]
                    cells.append("/".join(v for v in vals if v is not None) or "-")
                lines.append(f"  {impl:<28}" + "".join(f"{c:<{w}}" for c, w in zip(cells, cw, strict=True)))
    lines += _summary_lines(doc.get("summary") or summary(recs))
    if doc["skipped"]:
        lines.append("\nnot measured:")
        for s in doc["skipped"]:
            at = f" ({human_bytes(s['size_bytes'])})" if s["size_bytes"] else ""
            lines.append(f"  {s['backend']} {s['impl']}{at}: {s['reason']}")
    return "\n".join(ln.rstrip() for ln in lines)


def _summary_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One line per storage and size: ckptio's best vs the best baseline, save and load."""
    if not rows:
        return []
    lines = ["\n== ckptio's best vs the best baseline; ratio = baseline time / ckptio time (>1: ckptio faster) =="]
    keys = list(dict.fromkeys((x["size_bytes"], x["backend"]) for x in sorted(rows, key=lambda x: x["size_bytes"])))
    table = []
    for size, b in keys:
        cells = [human_bytes(size), b]
        for op in ("save", "load"):
            x = next((x for x in rows if x["backend"] == b and x["size_bytes"] == size and x["op"] == op), None)
            cells.append(
                f"{op} {x['ratio']:5.2f}x ({x['impl']} {x['gb_per_s']:.3f} vs {x['baseline']} "
                f"{x['baseline_gb_per_s']:.3f} GB/s)"
                if x
                else f"{op} -"
            )
        table.append(cells)
    widths = [max(len(r[i]) for r in table) for i in range(3)]
    for r in table:
        lines.append(f"{r[0]:>{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}   {r[3]}")
    return lines


def chart(doc: dict[str, Any], path: str) -> str | None:
    """Top: GB/s per backend x implementation (largest size), save and load, baselines hatched. Bottom:
    ckptio's best over the best baseline (the summary ratio) per size and backend, save and load."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    recs = doc["results"]
    if not recs:
        return None
    size = max(r["size_bytes"] for r in recs if r["size_bytes"] in {x["size_bytes"] for x in recs if x["op"] == "save"})
    backends = list(dict.fromkeys(r["backend"] for r in recs if r["size_bytes"] == size))
    fig, axes = plt.subplots(2, 2, figsize=(max(8, 2.6 * len(backends) + 4), 10), squeeze=False)
    for ax, op in zip(axes[0], ("save", "load"), strict=True):
        x = 0.0
        ticks, labels = [], []
        for b in backends:
            rows = [r for r in recs if r["backend"] == b and r["size_bytes"] == size and r["op"] == op]
            start = x
            for r in rows:
                color = "#b0b0b0" if r["baseline"] else "#1f77b4"
                ax.bar(
                    x,
                    r["gb_per_s"] or 1e-4,
                    width=0.8,
                    color=color,
                    edgecolor="black",
                    hatch="//" if r["baseline"] else None,
                )
                ax.text(x, (r["gb_per_s"] or 1e-4) * 1.08, r["impl"], rotation=90, ha="center", va="bottom", fontsize=7)
                x += 1
            if rows:
                ticks.append((start + x - 1) / 2)
                labels.append(b)
            x += 1
        ax.set_xticks(ticks)
        ax.set_xticklabels(labels)
        ax.set_yscale("log")  # local/memory and loopback object stores differ by 10-100x
        ax.set_ylabel("GB/s (median, log scale)")
        ax.set_title(f"{op}, {human_bytes(size)}")
        lo, hi = ax.get_ylim()
        ax.set_ylim(lo, hi * 30)  # room for the labels above the bars
    _ratio_panels(axes[1], doc.get("summary") or summary(recs))
    from matplotlib.patches import Patch

    fig.legend(
        handles=[
            Patch(facecolor="#1f77b4", edgecolor="black", label="ckptio"),
            Patch(facecolor="#b0b0b0", edgecolor="black", hatch="//", label="baseline"),
        ],
        loc="upper right",
    )
    fig.suptitle("ckptio checkpoint throughput and ratio to the best baseline (higher is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _ratio_panels(axes: Any, rows: list[dict[str, Any]]) -> None:
    """Grouped bars: per size, one bar per backend of ckptio's best over the best baseline; a line at 1."""
    sizes = sorted({x["size_bytes"] for x in rows})
    backends = list(dict.fromkeys(x["backend"] for x in rows))
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]
    width = 0.8 / max(1, len(backends))
    for ax, op in zip(axes, ("save", "load"), strict=True):
        for j, b in enumerate(backends):
            label: str | None = b
            for i, size in enumerate(sizes):
                x = next((x for x in rows if x["backend"] == b and x["size_bytes"] == size and x["op"] == op), None)
                if x is None:
                    continue
                pos = i - 0.4 + width * (j + 0.5)
                ax.bar(pos, x["ratio"], width=width, color=colors[j % len(colors)], edgecolor="black", label=label)
                label = None
                ax.text(pos, x["ratio"], f"{x['ratio']:.2f}", ha="center", va="bottom", fontsize=7)
        ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
        ax.set_xticks(range(len(sizes)))
        ax.set_xticklabels([human_bytes(s) for s in sizes])
        ax.set_ylabel("baseline time / ckptio time")
        ax.set_title(f"{op}: ckptio's best / best baseline (>1: faster)")
        if backends:
            ax.legend(fontsize=8)
