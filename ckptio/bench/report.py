"""``ckptio bench`` output: ratios to the baselines, the machine description (never secrets: no
environment, no endpoints or credentials), the text table and the PNG chart (matplotlib)."""

from __future__ import annotations

import contextlib
import os
import platform
from typing import Any

import torch

from ckptio.progress import human_bytes


def size_label(n: int) -> str:
    """``8 MiB`` for exactly 8 MiB (binary units, no rounding shown); ``7.6 MiB`` otherwise."""
    for unit, k in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << k and n % (1 << k) == 0:
            return f"{n >> k} {unit}"
    return human_bytes(n)


def _spread(base: dict[str, Any], mine: dict[str, Any]) -> tuple[float, float]:
    """Min and max of the per-round ratios (rounds are interleaved, so round i of each ran together; a
    cell measured once has one)."""
    rs = [b / m for b, m in zip(base["seconds"], mine["seconds"], strict=False) if m > 0] or [
        base["median_seconds"] / mine["median_seconds"]
    ]
    return min(rs), max(rs)


def _ratio(base: dict[str, Any], mine: dict[str, Any]) -> dict[str, Any]:
    lo, hi = _spread(base, mine)
    return {"ratio": base["median_seconds"] / mine["median_seconds"], "ratio_min": lo, "ratio_max": hi}


def ratios(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For every ckptio figure, its speed relative to every baseline on the same backend, size and op:
    the ratio of the medians, and the min-max of the per-round ratios."""
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
                        **_ratio(b, r),
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
                **_ratio(base, mine),
            }
        )
    return out


def fmt_ratio(x: dict[str, Any]) -> str:
    """``1.23x [1.10-1.40]``: the ratio of the medians and the min-max over rounds."""
    if "ratio_min" not in x or x["ratio_min"] == x["ratio_max"]:
        return f"{x['ratio']:.2f}x"
    return f"{x['ratio']:.2f}x [{x['ratio_min']:.2f}-{x['ratio_max']:.2f}]"


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
        "s3torchconnector",
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
    """The first screen: the summary (one line per storage and size), then per size the GB/s of every
    implementation and the ratio to every baseline, then what was not measured."""
    recs = doc["results"]
    lines = _summary_lines(doc.get("summary") or summary(recs))
    for note in doc["settings"].get("profile_notes", []):
        lines.append(f"  {note}")
    for size in sorted({r["size_bytes"] for r in recs}):
        rows: dict[tuple[str, str], dict[str, Any]] = {}
        for r in recs:
            if r["size_bytes"] == size:
                rows.setdefault((r["backend"], r["impl"]), {"baseline": r["baseline"]})[r["op"]] = r
        lines.append(
            f"\n== {size_label(size)} of fp32 tensors; GB/s, median of {doc['settings']['repeats']}; "
            f"* = baseline; RSS+ = extra peak memory (MiB) save/load =="
        )
        w = max([len(i) for _, i in rows] + [14]) + 2
        bw = max([len(b) for b, _ in rows] + [7]) + 2
        lines.append(f"{'backend':<{bw}}{'implementation':<{w}}{'save':>8}{'load':>8}{'load cold':>11}{'RSS+':>13}")
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
                lines.append(f"{b:<{bw}}{name:<{w}}{cells[0]:>8}{cells[1]:>8}{cells[2]:>11}{rss_s:>13}")
        lines += _ratio_lines([x for x in doc["ratios"] if x["size_bytes"] == size], backends, bw, w)
    if doc["skipped"]:
        lines.append("\nnot measured:")
        for s in doc["skipped"]:
            at = f" ({size_label(s['size_bytes'])})" if s["size_bytes"] else ""
            lines.append(f"  {s['backend']} {s['impl']}{at}: {s['reason']}")
    return "\n".join(ln.rstrip() for ln in lines).lstrip("\n")


def _ratio_lines(rs: list[dict[str, Any]], backends: list[str], bw: int, w: int) -> list[str]:
    """One line per ckptio implementation and baseline: the ratio per op, median [min-max of the rounds]."""
    if not rs:
        return []
    bases = max(len(x["baseline"]) for x in rs) + 2
    lines = [
        "\nratio = baseline time / ckptio time, median [min-max over rounds] (>1: ckptio faster)",
        f"{'backend':<{bw}}{'ckptio':<{w}}{'vs baseline':<{bases}}" + "".join(f"{c:<20}" for _, c in OP_COLUMNS),
    ]
    for b in backends:
        pairs = list(dict.fromkeys((x["impl"], x["baseline"]) for x in rs if x["backend"] == b))
        for impl, base in pairs:
            cells = []
            for op, _ in OP_COLUMNS:
                x = next(
                    (x for x in rs if (x["backend"], x["impl"], x["baseline"], x["op"]) == (b, impl, base, op)), None
                )
                cells.append(fmt_ratio(x) if x else "-")
            lines.append(f"{b:<{bw}}  {impl:<{w - 2}}{base:<{bases}}" + "".join(f"{c:<20}" for c in cells))
    return lines


def _summary_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One line per storage and size: ckptio's best vs the best baseline (named), save and load."""
    if not rows:
        return []
    lines = [
        "== ckptio's best vs the best baseline: baseline time / ckptio time, median [min-max over rounds]; "
        ">1: ckptio faster =="
    ]
    keys = list(dict.fromkeys((x["size_bytes"], x["backend"]) for x in sorted(rows, key=lambda x: x["size_bytes"])))
    table = []
    for size, b in keys:
        cells = [size_label(size), b]
        for op in ("save", "load"):
            x = next((x for x in rows if x["backend"] == b and x["size_bytes"] == size and x["op"] == op), None)
            cells.append(
                f"{op} {fmt_ratio(x)} {x['impl']} {x['gb_per_s']:.3f} vs {x['baseline']} "
                f"{x['baseline_gb_per_s']:.3f} GB/s"
                if x
                else f"{op} -"
            )
        table.append(cells)
    widths = [max(len(r[i]) for r in table) for i in range(3)]
    for r in table:
        lines.append(f"{r[0]:>{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}   {r[3]}")
    return lines
