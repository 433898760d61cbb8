"""How ``ckptio bench`` measures: timing and peak RSS of one call (:func:`measure`), page-cache
eviction for cold loads, and :func:`run_matrix`, which runs every implementation on every target
and size, interleaved. The method is in benchmarks/README.md of the source repository."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ckptio
from ckptio import uri as _uri
from ckptio.progress import Bar, human_bytes

from .heap import trim_heap
from .impls import Impl
from .workload import make_state, nbytes, same, touch


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

    def __enter__(self) -> RSSPeak:
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
        return {
            "backend": self.backend,
            "impl": self.impl,
            "baseline": self.baseline,
            "size_bytes": self.size,
            "op": self.op,
            "seconds": self.seconds,
            "median_seconds": med,
            "gb_per_s": self.size / med / 1e9 if med else None,
            "rss_extra_bytes": self.rss_extra,
            "median_rss_extra_bytes": int(statistics.median(self.rss_extra)) if self.rss_extra else None,
        }


def run_matrix(
    targets: list[Target],
    sizes: list[int],
    repeats: int,
    bar: Bar,
    log: Callable[[str], None],
    remote_max: int | None,
    cell_budget: float | None = None,
) -> tuple[list[Record], list[dict[str, Any]]]:
    """Every implementation on every target and size, interleaved, ``repeats`` times.

    A cell whose first run (save + loads) takes longer than ``cell_budget`` seconds is measured
    only once; this is noted in the skipped list so nobody mistakes it for a median.
    """
    records: dict[tuple, Record] = {}
    skipped: list[dict[str, Any]] = []
    run_id = uuid.uuid4().hex[:8]
    plan = [
        (t, s)
        for s in sizes
        for t in targets
        if not (remote_max and t.local_dir is None and t.name != "memory" and s > remote_max)
    ]
    for t in targets:
        for s in sizes:
            if (t, s) not in plan:
                skipped.append(
                    {
                        "backend": t.name,
                        "impl": "*",
                        "size_bytes": s,
                        "reason": f"sizes above {human_bytes(remote_max or 0)} are not run on remote storage "
                        f"(pass --sizes to force)",
                    }
                )
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
                k = r % len(target.impls) if target.impls else 0
                # interleaved: every implementation once per repeat; the order rotates between repeats so
                # no implementation always runs first (after the previous repeat's loads and removals)
                for impl in target.impls[k:] + target.impls[:k]:
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
                        dt, extra, _ = measure(functools.partial(impl.save, state, uri))
                        rec = records.setdefault(
                            (*key, "save"), Record(target.name, impl.name, impl.baseline, size_b, "save")
                        )
                        rec.seconds.append(dt)
                        rec.rss_extra.append(extra)
                        done += size
                        bar(done, total)
                        loads = ["load"]
                        if target.local_dir:
                            loads = ["load_cold", "load"] if evict_local(uri) else ["load"]
                        for op in loads:
                            dt, extra, out = measure(functools.partial(impl.load, state, uri))
                            if r == 0 and op == loads[0] and not same(state, out):
                                raise AssertionError(f"{impl.name} on {target.name} did not return the saved tensors")
                            del out
                            rec = records.setdefault(
                                (*key, op), Record(target.name, impl.name, impl.baseline, size_b, op)
                            )
                            rec.seconds.append(dt)
                            rec.rss_extra.append(extra)
                            done += size
                            bar(done, total)
                        if len(loads) < steps - 1:
                            done += size
                        spent = time.perf_counter() - t_cell
                        if r == 0 and repeats > 1 and cell_budget and spent > cell_budget:
                            capped.add(key)
                            skipped.append(
                                {
                                    "backend": target.name,
                                    "impl": impl.name,
                                    "size_bytes": size_b,
                                    "reason": f"measured once, not {repeats} times: the first run took "
                                    f"{spent:.0f}s (> --cell-budget {cell_budget:g}s)",
                                }
                            )
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
                        if target.local_dir and hasattr(os, "sync"):
                            # untimed: freeing (and, on a `discard` mount, discarding) the removed file's
                            # blocks would otherwise land in the next implementation's fsync
                            os.sync()
            log(f"  repeat {r + 1}/{repeats} of {human_bytes(size_b)} done ({time.perf_counter() - started:.0f}s)")
        del state
    for t in targets:  # the per-run directory (objects were removed one by one)
        with contextlib.suppress(Exception):
            (t.cleanup or _remove)(_uri.join_path(t.root, f"bench-{run_id}"))
    return list(records.values()), skipped


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
