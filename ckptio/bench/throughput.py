"""Save/load throughput of ckptio across backends x formats x sizes, against baselines in the same run.

    ckptio bench                      # quick: a temp dir, memory://, S3 (moto) and GCS (emulator) on loopback
    ckptio bench --full               # larger sizes
    ckptio bench --uri s3://my-bucket/tmp --uri ckpt://scratch   # your storage (settings file, aliases)
    ckptio bench --backends local,memory --sizes 8MiB             # a subset
    ckptio bench --sizes 1MiB,32MiB,256MiB,1GiB                   # every size in one run (remote capped)
    ckptio bench --backends s3 --profile realistic                # S3 as a remote store behaves
    python -m benchmarks.throughput   # the same, from a source checkout (results in benchmarks/results/)

Prints a table that starts with one line per storage and size (ckptio's best against the best
baseline, named, save and load), writes a JSON file with every raw figure and the machine
description, and a PNG chart (GB/s, and those ratios per size), to --out (default
./ckptio-bench-results). Needs the bench extra for the embedded servers, the chart and some
baselines (pip install 'ckptio[bench]'), and the peers extra for s3torchconnector (pip install
'ckptio[peers]'); what is missing is listed under "not measured". The method is in
benchmarks/README.md of the source repository.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import tempfile
import time
from typing import Any

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

from ckptio.config import parse_size
from ckptio.progress import Bar, human_bytes

from .chart import chart
from .measure import run_matrix
from .proxy import DEFAULT_BANDWIDTH, DEFAULT_LATENCY
from .report import machine, ratios, summary, table
from .targets import BENCH_HINT, EMBEDDED, embedded_targets, has_dcp, has_format, user_targets

QUICK_SIZES = ["32MiB"]
FULL_SIZES = ["256MiB", "1GiB"]
FULL_REMOTE_MAX = 256 * 2**20  # loopback S3/GCS servers move ~0.1 GB/s: bigger objects only take longer
DEFAULT_OUT = "ckptio-bench-results"  # relative to the working directory


def parse_args(argv: list[str] | None, default_out: str = DEFAULT_OUT) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="ckptio bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    g = ap.add_mutually_exclusive_group()
    g.add_argument(
        "--quick", action="store_true", help=f"sizes {','.join(QUICK_SIZES)}, slow cells measured once (the default)"
    )
    g.add_argument(
        "--full",
        action="store_true",
        help=f"sizes {','.join(FULL_SIZES)} (remote capped at {human_bytes(FULL_REMOTE_MAX)})",
    )
    ap.add_argument(
        "--sizes", help="comma-separated sizes, e.g. 8MiB,256MiB (with --quick: the quick run at these sizes)"
    )
    ap.add_argument(
        "--remote-max",
        type=parse_size,
        default=None,
        help=f"largest size run on remote storage (default {human_bytes(FULL_REMOTE_MAX)}, without --uri "
        "or with --full; 0: no cap)",
    )
    ap.add_argument(
        "--backends", help=f"comma-separated subset of {','.join(EMBEDDED)} (default: all; with --uri: local)"
    )
    ap.add_argument(
        "--uri",
        action="append",
        default=[],
        help="also measure this URI (repeatable; alias schemes "
        "and settings from your ckptio.toml apply); objects are written under URI/bench-<id>/ and removed",
    )
    ap.add_argument("--repeats", type=int, default=3, help="runs per cell; the median is reported (default 3)")
    ap.add_argument(
        "--cell-budget",
        type=float,
        default=None,
        help="a cell whose first run takes longer than this "
        "many seconds is measured once (default: 10 with --quick, unlimited otherwise)",
    )
    ap.add_argument(
        "--profile",
        choices=("loopback", "realistic"),
        default="loopback",
        help="realistic: reach the embedded S3/GCS servers through a loopback proxy that adds a first-byte "
        "latency and a per-connection bandwidth cap, as a remote object store has (default loopback)",
    )
    ap.add_argument(
        "--latency-ms", type=float, default=DEFAULT_LATENCY * 1e3, help="with --profile realistic (default %(default)g)"
    )
    ap.add_argument(
        "--stream-mbps",
        type=float,
        default=DEFAULT_BANDWIDTH / 1e6,
        help="MB/s per connection with --profile realistic (default %(default)g, one fsspec S3 stream)",
    )
    ap.add_argument(
        "--moto-as-is",
        action="store_true",
        help="run moto unchanged: each ranged GET then reads the whole object on the server (0.33 s for 1 MiB "
        "of a 256 MiB object), which penalises every reader that splits an object into ranges; by default the "
        "embedded S3 server reads only the range, as S3 does",
    )
    ap.add_argument("--out", default=default_out, help=f"directory for JSON and PNG (default {default_out})")
    ap.add_argument("--name", help="file name stem (default throughput-<timestamp>)")
    ap.add_argument("--json", action="store_true", help="print the JSON document instead of the table")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress bar or log lines")
    ap.add_argument("--no-chart", action="store_true", help="skip the PNG")
    args = ap.parse_args(argv)
    if args.full and args.sizes:
        ap.error("--full and --sizes cannot be combined")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if args.latency_ms < 0 or args.stream_mbps <= 0:
        ap.error("--latency-ms must be >= 0 and --stream-mbps > 0")
    return args


def main(argv: list[str] | None = None, default_out: str = DEFAULT_OUT) -> int:
    """Run the benchmark with command-line arguments ``argv``; ``default_out`` is ``--out``'s default."""
    args = parse_args(argv, default_out)
    quick = args.quick or not (args.full or args.sizes)
    sizes = [parse_size(s) for s in (args.sizes.split(",") if args.sizes else FULL_SIZES if args.full else QUICK_SIZES)]
    # the loopback servers move ~0.1 GB/s: remote storage stops at 256 MiB (--remote-max 0: no cap);
    # the user's own URIs are capped only with --full, as before
    if args.remote_max is not None:
        remote_max = args.remote_max or None
    else:
        remote_max = FULL_REMOTE_MAX if args.full or not args.uri else None
    names = (
        [b.strip() for b in args.backends.split(",") if b.strip()]
        if args.backends
        else (["local"] if args.uri else list(EMBEDDED))
    )

    def log(msg: str) -> None:
        if not args.quiet:
            bar.write(msg)

    wan = (args.latency_ms / 1e3, args.stream_mbps * 1e6) if args.profile == "realistic" else None
    profile_notes = (
        [
            f"--profile realistic: S3 and GCS through a loopback proxy: {args.latency_ms:g} ms before each "
            f"response's first byte, {args.stream_mbps:g} MB/s per connection"
        ]
        if wan
        else []
    )
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    stem = args.name or f"throughput-{stamp}"
    os.makedirs(args.out, exist_ok=True)
    t_start = time.perf_counter()
    with (
        tempfile.TemporaryDirectory(prefix="ckptio-bench-") as tmp,
        Bar(0, "bench", enabled=False if args.quiet else None) as bar,
        embedded_targets(names, tmp, log, quick=quick, wan=wan, moto_as_is=args.moto_as_is) as targets,
    ):
        missing = [{"backend": t.name, "size_bytes": 0, **n} for t in targets for n in t.notes]
        targets = [t for t in targets if t.impls] + user_targets(args.uri)
        if not has_format(".fpk"):
            missing.append(
                {
                    "backend": "*",
                    "impl": "ckptio .fpk",
                    "size_bytes": 0,
                    "reason": "ckptio.fastpickle is not available in this installation",
                }
            )
        if not has_dcp():
            missing.append(
                {
                    "backend": "*",
                    "impl": "ckptio DCP",
                    "size_bytes": 0,
                    "reason": "ckptio.dcp is not available in this installation",
                }
            )
        budget = args.cell_budget if args.cell_budget is not None else (10.0 if quick else None)
        records, skipped = run_matrix(targets, sizes, args.repeats, bar, log, remote_max, budget)
    results = [r.as_dict() for r in records]
    doc: dict[str, Any] = {
        "schema": 1,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "settings": {
            "sizes": sizes,
            "repeats": args.repeats,
            "cell_budget_seconds": budget,
            "backends": names,
            "uris": args.uri,
            "profile": args.profile,
            "profile_notes": profile_notes,
            "wall_seconds": None,
            "method": "interleaved (every implementation once per repeat), median of repeats; every load "
            "faults in every page of every tensor; local saves include fsync for every "
            "implementation; 'load_cold' evicts the files from the page cache "
            "(posix_fadvise DONTNEED) first; RSS+ is the peak RSS above the start of the "
            "operation, sampled every 3 ms",
        },
        "results": results,
        "ratios": ratios(results),
        "summary": summary(results),
        "skipped": missing + skipped,
        "outputs": {},
    }
    doc["settings"]["wall_seconds"] = round(time.perf_counter() - t_start, 2)
    json_path = os.path.join(args.out, stem + ".json")
    png_path = None if args.no_chart else chart(doc, os.path.join(args.out, stem + ".png"))
    doc["outputs"] = {"json": os.path.abspath(json_path), "png": os.path.abspath(png_path) if png_path else None}
    with open(json_path, "w") as f:
        json.dump(doc, f, indent=2)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(table(doc))
        print(f"\nresults: {doc['outputs']['json']}")
        why = "--no-chart was given" if args.no_chart else f"matplotlib is not installed: {BENCH_HINT}"
        print(f"chart:   {doc['outputs']['png'] or f'(not written: {why})'}")
    return 0
