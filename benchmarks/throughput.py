"""Save/load throughput of ckptio across backends x formats x sizes, against baselines in the same run.

    python -m benchmarks.throughput              # quick: embedded local dir, memory://, S3 (moto), GCS (emulator)
    python -m benchmarks.throughput --full       # larger sizes
    python -m benchmarks.throughput --uri s3://my-bucket/tmp --uri ckpt://scratch   # your storage (settings file)
    ckptio bench ...                             # the same

Prints a table, writes a JSON file with every raw figure and the machine description, and a PNG
bar chart. The method is in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import io
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import torch  # noqa: E402

import ckptio  # noqa: E402
from benchmarks._heap import trim_heap  # noqa: E402
from ckptio import uri as _uri  # noqa: E402
from ckptio.config import parse_size  # noqa: E402
from ckptio.progress import Bar, human_bytes  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK_SIZES = ["32MiB"]
FULL_SIZES = ["256MiB", "1GiB"]
FULL_REMOTE_MAX = 256 * 2**20  # loopback S3/GCS servers move ~0.1 GB/s: bigger objects only take longer
EMBEDDED = ("local", "memory", "s3", "gcs")
S3_CREDS = {"access_key_id": "bench", "secret_access_key": "bench", "region": "us-east-1"}


# ---------------------------------------------------------------------------------------------
# workload


def make_state(size: int) -> dict[str, torch.Tensor]:
    """A flat dict of transformer-shaped fp32 tensors (qkv, out, mlp up/down, two norms per layer) of ~``size`` bytes."""
    layers = 8 if size >= 8 * 2**20 else 2
    h = max(8, round((size / (4 * 12 * layers)) ** 0.5 / 8) * 8)
    g = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {}
    for i in range(layers):
        p = f"layers.{i}."
        for name, shape in (("attn.qkv.weight", (3 * h, h)), ("attn.out.weight", (h, h)), ("mlp.up.weight", (4 * h, h)),
                            ("mlp.down.weight", (h, 4 * h)), ("norm1.weight", (h,)), ("norm2.weight", (h,))):
            state[p + name] = torch.randn(shape, generator=g)
    return state


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def touch(obj: Any) -> None:
    """Fault in every page of every tensor (loads that map files lazily pay their read here)."""
    if isinstance(obj, torch.Tensor):
        if obj.numel():
            u8 = obj.detach().reshape(-1).view(torch.uint8)
            int(u8[::4096].sum())
    elif isinstance(obj, dict):
        for v in obj.values():
            touch(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            touch(v)


def same(a: dict[str, torch.Tensor], b: Any) -> bool:
    return isinstance(b, dict) and set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _u8(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def pack(state: dict[str, torch.Tensor]) -> bytearray:
    """The tensor bytes back to back in one buffer (what a raw write stores)."""
    buf, pos = bytearray(nbytes(state)), 0
    for t in state.values():
        mv = _u8(t)
        buf[pos: pos + len(mv)] = mv
        pos += len(mv)
    return buf


def unpack(ref: dict[str, torch.Tensor], data: Any) -> dict[str, torch.Tensor]:
    """Fresh tensors shaped like ``ref`` filled from ``pack``ed bytes."""
    data, out, pos = memoryview(data).cast("B"), {}, 0
    for k, v in ref.items():
        t = torch.empty_like(v)
        mv = _u8(t)
        mv[:] = data[pos: pos + len(mv)]
        pos += len(mv)
        out[k] = t
    return out


# ---------------------------------------------------------------------------------------------
# implementations: a save and a load on one kind of target


@dataclass
class Impl:
    name: str
    baseline: bool
    suffix: str  # appended to the target path ("" for directories)
    save: Callable[[dict, str], None]
    load: Callable[[dict, str], Any]  # (reference state for shapes, target) -> loaded state
    note: str = ""


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _template(ref: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.empty_like(v) for k, v in ref.items()}


def ckptio_impls(has_fpk: bool, has_dcp: bool) -> list[Impl]:
    out = []
    if has_fpk:
        out.append(Impl("ckptio .fpk", False, ".fpk", lambda s, u: ckptio.dump(s, u), lambda r, u: ckptio.load(u)))
    out.append(Impl("ckptio .pt", False, ".pt", lambda s, u: ckptio.dump(s, u), lambda r, u: ckptio.load(u)))
    if has_dcp:
        from ckptio import dcp

        def dsave(s: dict, u: str) -> None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.save(s, u)

        def dload(r: dict, u: str) -> dict:
            t = _template(r)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.load(t, u)
            return t

        out.append(Impl("ckptio DCP", False, "", dsave, dload))
    return out


def local_baselines() -> list[Impl]:
    def tsave(s: dict, p: str) -> None:
        torch.save(s, p)
        _fsync_path(p)

    def rsave(s: dict, p: str) -> None:
        with open(p, "wb", buffering=0) as f:
            for t in s.values():
                f.write(_u8(t))
            os.fsync(f.fileno())

    def rload(r: dict, p: str) -> dict:
        out = {}
        with open(p, "rb", buffering=0) as f:
            for k, v in r.items():
                t = torch.empty_like(v)
                f.readinto(_u8(t))
                out[k] = t
        return out

    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    def dsave(s: dict, p: str) -> None:
        import torch.distributed.checkpoint as tdcp

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tdcp.save(s, storage_writer=FileSystemWriter(p, thread_count=2))

    def dload(r: dict, p: str) -> dict:
        import torch.distributed.checkpoint as tdcp

        t = _template(r)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tdcp.load(t, storage_reader=FileSystemReader(p))
        return t

    out = [Impl("torch.save/load", True, ".pt", tsave, lambda r, p: torch.load(p, weights_only=True),
                "torch.save + fsync; torch.load(weights_only=True)"),
           Impl("raw write/read", True, ".raw", rsave, rload, "sequential write of the tensor bytes + fsync; "
                "readinto fresh tensors")]
    try:
        import safetensors.torch as st

        def ssave(s: dict, p: str) -> None:
            st.save_file(s, p)
            _fsync_path(p)

        out.append(Impl("safetensors", True, ".safetensors", ssave, lambda r, p: st.load_file(p),
                        "save_file + fsync; load_file (pages touched)"))
    except ImportError:
        pass
    out.append(Impl("torch DCP FileSystemWriter", True, "", dsave, dload, "thread_count=2, sync_files=True"))
    return out


def memory_baselines() -> list[Impl]:
    store: dict[str, Any] = {}

    def tsave(s: dict, u: str) -> None:
        b = io.BytesIO()
        torch.save(s, b)
        store[u] = b

    def tload(r: dict, u: str) -> dict:
        b = store.pop(u)
        b.seek(0)
        return torch.load(b, weights_only=True)

    def msave(s: dict, u: str) -> None:
        store[u] = pack(s)

    return [Impl("torch.save/load BytesIO", True, ".pt", tsave, tload),
            Impl("raw memcpy", True, ".raw", msave, lambda r, u: unpack(r, store.pop(u)),
                 "copy of the tensor bytes into one buffer and back")]


def fsspec_baselines(fs: Any, protocol: str, storage_options: dict) -> list[Impl]:
    """Baselines through a raw fsspec filesystem (s3fs / gcsfs) on the same server."""

    def path(u: str) -> str:
        return _uri.split(u)[1]

    def rsave(s: dict, u: str) -> None:
        with fs.open(path(u), "wb") as f:
            for t in s.values():
                f.write(_u8(t))

    def rload(r: dict, u: str) -> dict:
        return unpack(r, fs.cat_file(path(u)))

    def tsave(s: dict, u: str) -> None:
        with fs.open(path(u), "wb") as f:
            torch.save(s, f)

    def tload(r: dict, u: str) -> dict:
        with fs.open(path(u), "rb") as f:
            return torch.load(f, weights_only=True)

    def dsave(s: dict, u: str) -> None:
        import torch.distributed.checkpoint as tdcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tdcp.save(s, storage_writer=FsspecWriter(f"{protocol}://{path(u)}", thread_count=2, **storage_options))

    def dload(r: dict, u: str) -> dict:
        import torch.distributed.checkpoint as tdcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        t = _template(r)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tdcp.load(t, storage_reader=FsspecReader(f"{protocol}://{path(u)}", **storage_options))
        return t

    lib = type(fs).__module__.split(".")[0]
    return [Impl(f"raw {lib}", True, ".raw", rsave, rload, f"{lib} open('wb') of the tensor bytes; cat_file"),
            Impl(f"torch.save via {lib}", True, ".pt", tsave, tload, f"torch.save/torch.load on a {lib} file"),
            Impl("torch DCP FsspecWriter", True, "", dsave, dload, "thread_count=2")]


def backend_raw_baseline() -> Impl:
    """For user URIs: the storage's own speed for the same bytes, through ckptio's backend (no serialization)."""
    return Impl("raw put/get", True, ".raw", lambda s, u: ckptio.put(pack(s), u),
                lambda r, u: unpack(r, ckptio.get(u)), "one ckptio.put/get of the tensor bytes")


# ---------------------------------------------------------------------------------------------
# measurement


class RSSPeak:
    """Samples this process's RSS every few ms; ``peak - start`` is the extra memory of the block."""

    def __init__(self, interval: float = 0.003) -> None:
        self.interval, self.start, self.peak = interval, 0, 0
        self._stop = threading.Event()
        self._proc: Any = None
        with contextlib.suppress(ImportError):
            import psutil

            self._proc = psutil.Process()

    def _rss(self) -> int:
        if self._proc is not None:
            return self._proc.memory_info().rss
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self._rss())

    def __enter__(self) -> "RSSPeak":
        self.start = self.peak = self._rss()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self._rss())

    @property
    def extra(self) -> int:
        return max(0, self.peak - self.start)


def measure(fn: Callable[[], Any]) -> tuple[float, int, Any]:
    trim_heap()  # start from the same heap whatever ran before
    with RSSPeak() as rss:
        t0 = time.perf_counter()
        out = fn()
        touch(out)
        dt = time.perf_counter() - t0
    return dt, rss.extra, out


def evict_local(path: str) -> bool:
    """Drop a (clean, fsynced) file or tree from the page cache so the next read comes from the device."""
    if not hasattr(os, "posix_fadvise"):
        return False
    paths = [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs] if os.path.isdir(path) else [path]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


@dataclass
class Target:
    """One storage under test: a name, a root URI, the implementations that apply to it."""

    name: str
    root: str
    impls: list[Impl]
    local_dir: str | None = None  # set for local targets: enables cold loads
    cleanup: Callable[[str], None] | None = None
    notes: list[dict[str, str]] = field(default_factory=list)  # {"impl", "reason"} for cells left out


def _remove(u: str) -> None:
    backend, resolved = ckptio.resolve(u)
    if _uri.scheme_of(resolved) in ("", "file"):
        p = resolved.removeprefix("file://")
        if os.path.isdir(p):
            shutil.rmtree(p, ignore_errors=True)
        elif os.path.exists(p):
            os.unlink(p)
        return
    if backend.isfile(resolved):
        backend.delete(resolved)
    else:
        backend.rmtree(resolved)


@dataclass
class Record:
    backend: str
    impl: str
    baseline: bool
    size: int
    op: str
    seconds: list[float] = field(default_factory=list)
    rss_extra: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        med = statistics.median(self.seconds) if self.seconds else None
        return {"backend": self.backend, "impl": self.impl, "baseline": self.baseline, "size_bytes": self.size,
                "op": self.op, "seconds": self.seconds, "median_seconds": med,
                "gb_per_s": self.size / med / 1e9 if med else None, "rss_extra_bytes": self.rss_extra,
                "median_rss_extra_bytes": int(statistics.median(self.rss_extra)) if self.rss_extra else None}


def run_matrix(targets: list[Target], sizes: list[int], repeats: int, bar: Bar, log: Callable[[str], None],
               remote_max: int | None, cell_budget: float | None = None) -> tuple[list[Record], list[dict[str, Any]]]:
    """Every implementation on every target and size, interleaved, ``repeats`` times.

    A cell whose first run (save + loads) takes longer than ``cell_budget`` seconds is measured
    only once; this is noted in the skipped list so nobody mistakes it for a median.
    """
    records: dict[tuple, Record] = {}
    skipped: list[dict[str, Any]] = []
    run_id = uuid.uuid4().hex[:8]
    plan = [(t, s) for s in sizes for t in targets if not (remote_max and t.local_dir is None and t.name != "memory"
                                                           and s > remote_max)]
    for t in targets:
        for s in sizes:
            if (t, s) not in plan:
                skipped.append({"backend": t.name, "impl": "*", "size_bytes": s,
                                "reason": f"sizes above {human_bytes(remote_max or 0)} are not run on remote storage "
                                          f"(pass --sizes to force)"})
    total = sum(s * repeats * (3 if t.local_dir else 2) * len(t.impls) for t, s in plan)
    bar(0, total)
    done = 0
    started = time.perf_counter()
    broken: set[tuple[str, str, int]] = set()
    capped: set[tuple[str, str, int]] = set()
    for size in sizes:
        state = make_state(size)
        size_b = nbytes(state)
        log(f"size {human_bytes(size_b)}: {len(state)} tensors")
        for r in range(repeats):
            for target, s in plan:
                if s != size:
                    continue
                for impl in target.impls:  # interleaved: every implementation once per repeat
                    steps = 3 if target.local_dir else 2
                    key = (target.name, impl.name, size)
                    if key in broken or key in capped:
                        done += size * steps
                        bar(done, total)
                        continue
                    uri = _uri.join_path(target.root, f"bench-{run_id}", f"{size}-{r}-{_slug(impl.name)}{impl.suffix}")
                    bar.set_description(f"{target.name} {impl.name} r{r + 1}/{repeats}")
                    t_cell = time.perf_counter()
                    try:
                        dt, extra, _ = measure(lambda: impl.save(state, uri))
                        rec = records.setdefault((*key, "save"), Record(target.name, impl.name, impl.baseline, size_b, "save"))
                        rec.seconds.append(dt)
                        rec.rss_extra.append(extra)
                        done += size
                        bar(done, total)
                        loads = ["load"]
                        if target.local_dir:
                            loads = ["load_cold", "load"] if evict_local(uri) else ["load"]
                        for op in loads:
                            dt, extra, out = measure(lambda: impl.load(state, uri))
                            if r == 0 and op == loads[0] and not same(state, out):
                                raise AssertionError(f"{impl.name} on {target.name} did not return the saved tensors")
                            del out
                            rec = records.setdefault((*key, op), Record(target.name, impl.name, impl.baseline, size_b, op))
                            rec.seconds.append(dt)
                            rec.rss_extra.append(extra)
                            done += size
                            bar(done, total)
                        if len(loads) < steps - 1:
                            done += size
                        spent = time.perf_counter() - t_cell
                        if r == 0 and repeats > 1 and cell_budget and spent > cell_budget:
                            capped.add(key)
                            skipped.append({"backend": target.name, "impl": impl.name, "size_bytes": size_b,
                                            "reason": f"measured once, not {repeats} times: the first run took "
                                                      f"{spent:.0f}s (> --cell-budget {cell_budget:g}s)"})
                    except Exception as e:  # noqa: BLE001 - a broken cell is reported, the rest still runs
                        broken.add(key)
                        msg = " ".join(f"{type(e).__name__}: {e}".split())[:300]
                        skipped.append({"backend": target.name, "impl": impl.name, "size_bytes": size_b, "reason": msg})
                        log(f"skipped {impl.name} on {target.name}: {msg}")
                        for op in ("save", "load", "load_cold"):
                            records.pop((*key, op), None)
                    finally:
                        with contextlib.suppress(Exception):
                            (target.cleanup or _remove)(uri)
            log(f"  repeat {r + 1}/{repeats} of {human_bytes(size_b)} done ({time.perf_counter() - started:.0f}s)")
        del state
    for t in targets:  # the per-run directory (objects were removed one by one)
        with contextlib.suppress(Exception):
            (t.cleanup or _remove)(_uri.join_path(t.root, f"bench-{run_id}"))
    return list(records.values()), skipped


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


def ratios(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For every ckptio figure, its speed relative to every baseline on the same backend, size and op."""
    out = []
    for r in records:
        if r["baseline"] or not r["median_seconds"]:
            continue
        for b in records:
            if (b["baseline"] and b["backend"] == r["backend"] and b["size_bytes"] == r["size_bytes"]
                    and b["op"] == r["op"] and b["median_seconds"]):
                out.append({"backend": r["backend"], "size_bytes": r["size_bytes"], "op": r["op"], "impl": r["impl"],
                            "baseline": b["impl"], "ratio": b["median_seconds"] / r["median_seconds"]})
    return out


# ---------------------------------------------------------------------------------------------
# machine description (never secrets: no environment, no endpoints with credentials)


def machine() -> dict[str, Any]:
    import importlib.metadata as md

    versions = {}
    for pkg in ("torch", "ckptio", "numpy", "fsspec", "s3fs", "gcsfs", "safetensors", "moto", "gcp-storage-emulator",
                "xxhash", "matplotlib"):
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
    return {"platform": platform.platform(), "python": platform.python_version(), "cpu": cpu,
            "cpu_count": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else None, "memory_bytes": mem, "torch_threads": torch.get_num_threads(), "versions": versions}


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
        lines.append(f"\n== {human_bytes(size)} of fp32 tensors; GB/s, median of {doc['settings']['repeats']}; "
                     f"* = baseline; RSS+ = extra peak memory (MiB) save/load ==")
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
            lines.append(f"{b[:28]:<30}" + "".join(f"{x:<{w}}" for x, w in zip(bases, cw)))
            for impl in mine:
                cells = []
                for base in bases:
                    vals = [next((f"{x['ratio']:.2f}" for x in rs if x["backend"] == b and x["impl"] == impl
                                  and x["baseline"] == base and x["op"] == op), None) for op, _ in OP_COLUMNS]
                    cells.append("/".join(v for v in vals if v is not None) or "-")
                lines.append(f"  {impl:<28}" + "".join(f"{c:<{w}}" for c, w in zip(cells, cw)))
    if doc["skipped"]:
        lines.append("\nnot measured:")
        for s in doc["skipped"]:
            at = f" ({human_bytes(s['size_bytes'])})" if s["size_bytes"] else ""
            lines.append(f"  {s['backend']} {s['impl']}{at}: {s['reason']}")
    return "\n".join(ln.rstrip() for ln in lines)


def chart(doc: dict[str, Any], path: str) -> str | None:
    """Bar chart of GB/s per backend x implementation (largest size), save and load; baselines hatched."""
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
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 2.6 * len(backends) + 4), 5.2), squeeze=False)
    for ax, op in zip(axes[0], ("save", "load")):
        x = 0.0
        ticks, labels = [], []
        for b in backends:
            rows = [r for r in recs if r["backend"] == b and r["size_bytes"] == size and r["op"] == op]
            start = x
            for r in rows:
                color = "#b0b0b0" if r["baseline"] else "#1f77b4"
                ax.bar(x, r["gb_per_s"] or 1e-4, width=0.8, color=color, edgecolor="black",
                       hatch="//" if r["baseline"] else None)
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
    from matplotlib.patches import Patch

    fig.legend(handles=[Patch(facecolor="#1f77b4", edgecolor="black", label="ckptio"),
                        Patch(facecolor="#b0b0b0", edgecolor="black", hatch="//", label="baseline")],
               loc="upper right")
    fig.suptitle("ckptio checkpoint throughput (higher is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# targets


def _has_format(ext: str) -> bool:
    try:
        ckptio.registry.formats.find("x" + ext)
        return True
    except ckptio.UnknownFormatError:
        return False


def _has_dcp() -> bool:
    try:
        from ckptio import dcp  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def embedded_targets(names: list[str], tmp: str, log: Callable[[str], None], quick: bool = False
                     ) -> Iterator[list[Target]]:
    mine = ckptio_impls(_has_format(".fpk"), _has_dcp())
    targets: list[Target] = []
    with contextlib.ExitStack() as stack:
        for name in names:
            if name == "local":
                d = os.path.join(tmp, "local")
                os.makedirs(d, exist_ok=True)
                targets.append(Target("local", d, mine + local_baselines(), local_dir=d))
            elif name == "memory":
                targets.append(Target("memory", f"memory://bench-{uuid.uuid4().hex[:8]}", mine + memory_baselines()))
            elif name in ("s3", "gcs"):
                try:
                    targets.append(stack.enter_context(_server_target(name, log, quick)))
                except Exception as e:  # noqa: BLE001 - missing server packages skip the column with a note
                    log(f"skipping {name}: {type(e).__name__}: {e}")
                    targets.append(Target(name, "", [], notes=[{"impl": "*", "reason": f"{type(e).__name__}: {e}"}]))
            else:
                raise SystemExit(f"unknown backend {name!r}; choose from {', '.join(EMBEDDED)} or pass --uri")
        yield targets


@contextlib.contextmanager
def _server_target(name: str, log: Callable[[str], None], quick: bool = False) -> Iterator[Target]:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from servers import GCSEmulator, MotoServer, make_gcs_bucket, make_s3_bucket

    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    mine = ckptio_impls(_has_format(".fpk"), _has_dcp())
    if name == "s3":
        import s3fs

        with MotoServer() as srv:
            make_s3_bucket(srv.url, bucket)
            log(f"S3 API server (moto) on {srv.url}")
            ckptio.configure(backends={"s3": {"endpoint_url": srv.url, **S3_CREDS}})
            opts = {"key": S3_CREDS["access_key_id"], "secret": S3_CREDS["secret_access_key"],
                    "client_kwargs": {"endpoint_url": srv.url, "region_name": "us-east-1"}}
            fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
            yield Target("s3", f"s3://{bucket}", mine + fsspec_baselines(fs, "s3", opts))
    else:
        import logging

        import gcsfs

        logging.getLogger("gcsfs").setLevel(logging.CRITICAL)  # it logs tracebacks for the emulator's missing moveTo
        with GCSEmulator() as srv:
            make_gcs_bucket(srv.url, bucket)
            log(f"GCS emulator on {srv.url}")
            ckptio.configure(backends={"gcs": {"endpoint_url": srv.url, "anon": True, "project": "bench"}})
            opts = {"token": "anon", "project": "bench", "endpoint_url": srv.url}
            fs = gcsfs.GCSFileSystem(skip_instance_cache=True, **opts)
            impls, notes = mine + fsspec_baselines(fs, "gs", opts), []
            if quick:  # the emulator has no moveTo API: gcsfs renames by copy + delete, ~30 s for 32 MiB here
                impls = [i for i in impls if i.name != "torch DCP FsspecWriter"]
                notes.append({"impl": "torch DCP FsspecWriter", "reason": "left out of --quick: the GCS emulator "
                              "has no rename (moveTo) API, so gcsfs falls back to copy + delete and one save takes "
                              "tens of seconds; --full or --sizes includes it"})
            yield Target("gcs", f"gs://{bucket}", impls, notes=notes)


def user_targets(uris: list[str]) -> list[Target]:
    mine = ckptio_impls(_has_format(".fpk"), _has_dcp())
    out = []
    for u in uris:
        _, resolved = ckptio.resolve(u)
        local = resolved.removeprefix("file://") if _uri.scheme_of(resolved) in ("", "file") else None
        impls = mine + [backend_raw_baseline()]
        out.append(Target(u.rstrip("/"), u.rstrip("/"), impls, local_dir=local))
    return out


# ---------------------------------------------------------------------------------------------
# entry point


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="ckptio bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help=f"sizes {','.join(QUICK_SIZES)} (the default)")
    g.add_argument("--full", action="store_true", help=f"sizes {','.join(FULL_SIZES)} (remote capped at "
                                                        f"{human_bytes(FULL_REMOTE_MAX)})")
    g.add_argument("--sizes", help="comma-separated sizes, e.g. 8MiB,256MiB")
    ap.add_argument("--backends", help=f"comma-separated subset of {','.join(EMBEDDED)} (default: all; with --uri: local)")
    ap.add_argument("--uri", action="append", default=[], help="also measure this URI (repeatable; alias schemes "
                    "and settings from your ckptio.toml apply); objects are written under URI/bench-<id>/ and removed")
    ap.add_argument("--repeats", type=int, default=3, help="runs per cell; the median is reported (default 3)")
    ap.add_argument("--cell-budget", type=float, default=None, help="a cell whose first run takes longer than this "
                    "many seconds is measured once (default: 10 with --quick, unlimited otherwise)")
    ap.add_argument("--out", default=os.path.join("benchmarks", "results"), help="directory for JSON and PNG")
    ap.add_argument("--name", help="file name stem (default throughput-<timestamp>)")
    ap.add_argument("--json", action="store_true", help="print the JSON document instead of the table")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress bar or log lines")
    ap.add_argument("--no-chart", action="store_true", help="skip the PNG")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    sizes = [parse_size(s) for s in (args.sizes.split(",") if args.sizes else FULL_SIZES if args.full else QUICK_SIZES)]
    remote_max = FULL_REMOTE_MAX if args.full else None
    names = [b.strip() for b in args.backends.split(",") if b.strip()] if args.backends else (
        ["local"] if args.uri else list(EMBEDDED))

    def log(msg: str) -> None:
        if not args.quiet:
            bar.write(msg)

    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    stem = args.name or f"throughput-{stamp}"
    os.makedirs(args.out, exist_ok=True)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ckptio-bench-") as tmp, \
            Bar(0, "bench", enabled=False if args.quiet else None) as bar, \
            embedded_targets(names, tmp, log, quick=not (args.full or args.sizes)) as targets:
        missing = [{"backend": t.name, "size_bytes": 0, **n} for t in targets for n in t.notes]
        targets = [t for t in targets if t.impls] + user_targets(args.uri)
        if not _has_format(".fpk"):
            missing.append({"backend": "*", "impl": "ckptio .fpk", "size_bytes": 0,
                            "reason": "ckptio.fastpickle is not available in this checkout"})
        if not _has_dcp():
            missing.append({"backend": "*", "impl": "ckptio DCP", "size_bytes": 0,
                            "reason": "ckptio.dcp is not available in this checkout"})
        budget = args.cell_budget if args.cell_budget is not None else (
            None if (args.full or args.sizes) else 10.0)
        records, skipped = run_matrix(targets, sizes, args.repeats, bar, log, remote_max, budget)
    results = [r.as_dict() for r in records]
    doc = {
        "schema": 1,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "settings": {"sizes": sizes, "repeats": args.repeats, "cell_budget_seconds": budget, "backends": names,
                     "uris": args.uri,
                     "wall_seconds": None,
                     "method": "interleaved (every implementation once per repeat), median of repeats; every load "
                               "faults in every page of every tensor; local saves include fsync for every "
                               "implementation; 'load_cold' evicts the files from the page cache "
                               "(posix_fadvise DONTNEED) first; RSS+ is the peak RSS above the start of the "
                               "operation, sampled every 3 ms"},
        "results": results,
        "ratios": ratios(results),
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
        print(f"chart:   {doc['outputs']['png'] or '(not written: install matplotlib, or --no-chart was given)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
