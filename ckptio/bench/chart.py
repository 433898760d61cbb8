"""``ckptio bench``'s PNG (matplotlib, optional): top, GB/s of every implementation per storage at the
largest size, save and load, baselines grey and hatched, on a log axis fitted to the data; bottom,
ckptio's best over the best baseline per size and storage, each bar naming that baseline."""

from __future__ import annotations

import math
from typing import Any

from .report import size_label, summary

CKPTIO, BASELINE = "#1f77b4", "#b0b0b0"


def log_limits(values: list[float]) -> tuple[float, float]:
    """Log-axis limits around ``values``: from half the smallest to twice the largest, whole decades
    not forced (a run whose bars stop at 5 GB/s gets an axis that stops near 10)."""
    vals = [v for v in values if v and v > 0] or [1.0]
    return min(vals) / 2, max(vals) * 2


def chart(doc: dict[str, Any], path: str) -> str | None:
    """Write the chart of ``doc`` (the benchmark's JSON document) to ``path``; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
        from matplotlib.transforms import blended_transform_factory
    except ImportError:
        return None
    recs = doc["results"]
    if not recs:
        return None
    size = max(r["size_bytes"] for r in recs if r["op"] == "save")
    backends = list(dict.fromkeys(r["backend"] for r in recs if r["size_bytes"] == size))
    n_bars = len({(r["backend"], r["impl"]) for r in recs if r["size_bytes"] == size})
    fig, axes = plt.subplots(2, 2, figsize=(max(10, 0.45 * n_bars + 4), 11), squeeze=False)
    for ax, op in zip(axes[0], ("save", "load"), strict=True):
        x, ticks, names, values = 0, [], [], []
        for b in backends:
            rows = [
                r for r in recs if r["backend"] == b and r["size_bytes"] == size and r["op"] == op and r["gb_per_s"]
            ]
            if not rows:
                continue
            start = x
            for r in rows:
                g = r["gb_per_s"]
                ax.bar(
                    x,
                    g,
                    width=0.8,
                    color=BASELINE if r["baseline"] else CKPTIO,
                    edgecolor="black",
                    hatch="//" if r["baseline"] else None,
                )
                ax.text(x, g * 1.05, f"{g:.2g}", ha="center", va="bottom", fontsize=6)
                ticks.append(x)
                names.append(r["impl"])
                values.append(g)
                x += 1
            # the storage's name above its group of bars
            ax.text(
                (start + x - 1) / 2,
                1.01,
                b,
                ha="center",
                va="bottom",
                fontsize=8,
                transform=blended_transform_factory(ax.transData, ax.transAxes),
            )
            if b != backends[-1]:
                ax.axvline(x, color="#dddddd", linewidth=1)
            x += 1
        ax.set_xticks(ticks)
        ax.set_xticklabels(names, rotation=60, ha="right", fontsize=7)
        ax.set_yscale("log")  # local/memory and loopback object stores differ by 10-100x
        ax.set_ylim(*log_limits(values))
        ax.set_ylabel("GB/s (median, log scale)")
        ax.set_title(f"{op}, {size_label(size)}", pad=16)
    _ratio_panels(axes[1], doc.get("summary") or summary(recs))
    fig.suptitle("ckptio checkpoint throughput, and ratio to the best baseline (higher is better)")
    fig.legend(  # on its own line under the title, clear of it and of the bars
        handles=[
            Patch(facecolor=CKPTIO, edgecolor="black", label="ckptio"),
            Patch(facecolor=BASELINE, edgecolor="black", hatch="//", label="baseline"),
        ],
        loc="upper center",
        bbox_to_anchor=(0.5, 0.965),
        ncol=2,
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _ratio_panels(axes: Any, rows: list[dict[str, Any]]) -> None:
    """Per size, one bar per storage: ckptio's best over the best baseline, the baseline named in the
    bar, the min-max over rounds as an error bar; a dashed line at 1."""
    sizes = sorted({x["size_bytes"] for x in rows})
    backends = list(dict.fromkeys(x["backend"] for x in rows))
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]
    width = 0.8 / max(1, len(backends))
    for ax, op in zip(axes, ("save", "load"), strict=True):
        top = 1.0
        for j, b in enumerate(backends):
            label: str | None = b
            for i, size in enumerate(sizes):
                x = next((x for x in rows if x["backend"] == b and x["size_bytes"] == size and x["op"] == op), None)
                if x is None:
                    continue
                pos = i - 0.4 + width * (j + 0.5)
                lo, hi = x.get("ratio_min", x["ratio"]), x.get("ratio_max", x["ratio"])
                ax.bar(
                    pos,
                    x["ratio"],
                    width=width,
                    color=colors[j % len(colors)],
                    edgecolor="black",
                    label=label,
                    yerr=[[x["ratio"] - lo], [hi - x["ratio"]]],
                    capsize=2,
                )
                label = None
                top = max(top, hi)
                ax.text(pos, hi, f"{x['ratio']:.2f}", ha="center", va="bottom", fontsize=7)
                ax.text(
                    pos - width / 4,  # beside the error bar
                    0.02,
                    f"{x['impl']} vs {x['baseline']}",
                    rotation=90,
                    ha="center",
                    va="bottom",
                    fontsize=7,
                    transform=ax.get_xaxis_transform(),
                )
        ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
        ax.set_xticks(range(len(sizes)))
        ax.set_xticklabels([size_label(s) for s in sizes])
        ax.set_ylim(0, math.ceil(top * 1.2 * 4) / 4)
        ax.set_ylabel("best baseline time / ckptio time")
        ax.set_title(f"{op}: ckptio's best / the best baseline (named in the bar)", fontsize=10)
        if backends:
            ax.legend(fontsize=8, loc="upper left")
