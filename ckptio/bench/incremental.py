"""Incremental checkpoints (issue 16): five saves, then a restore of step 5, incremental vs not.

Workload F: a state of ``size`` bytes, a frozen backbone (90%), a trainable head and the head's Adam
moments (the other 10%, new every save). Workload W1: the same tensors, every byte new every save.
For each target (local with fsync; S3 on a moto server), five saves with
``Checkpointer(incremental=True)`` and five without (the two taking turns going first), then, once both
roots are saved, a restore of step 5 from each by a new ``Checkpointer`` (as a resumed job), in the same
order; reported per save: the median seconds and the bytes written, the ratio of saves 2-5
(non-incremental / incremental) and the restore times.

Local only: ``--restores N`` adds N interleaved restores of the last repeat's two step-5 checkpoints
from the page cache, and the floor under them (the same bytes read and hashed by plain code);
``--cold N`` adds N with both checkpoints dropped from the page cache before each (a resume on a fresh
node), each followed by one from the page cache that read left (its folios differ from a just-written
file's).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import shutil
import statistics
import tempfile
import time
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import torch

SAVES = 5


def workload_f(size: int, step: int, frozen: bool = True) -> dict[str, Any]:
    """~90% frozen backbone (same bytes every step unless not ``frozen``: W1), head + its two Adam
    moments (new every step)."""
    g = torch.Generator().manual_seed(0 if frozen else 1 + step)
    per = max(1, size * 9 // 10 // 16 // 4)
    backbone = {f"backbone.{i}": torch.randn(per, generator=g) for i in range(16)}
    head_n = max(1, size // 10 // 3 // 4)
    g.manual_seed(1000 + step)
    head = torch.randn(head_n, generator=g)
    moments = {"exp_avg": torch.randn(head_n, generator=g), "exp_avg_sq": torch.rand(head_n, generator=g)}
    return {"model": {**backbone, "head": head}, "optim": {"state": {"head": moments}}, "step": step}


@contextlib.contextmanager
def targets(which: list[str]) -> Iterator[Iterator[tuple[str, str]]]:
    """(name, base URI) of each storage target, its server running for the block."""
    import ckptio

    from .servers import MOTO_S3_OPTIONS, MotoServer, make_s3_bucket

    stack = contextlib.ExitStack()
    out = []
    with stack:
        if "local" in which:
            out.append(("local", stack.enter_context(tempfile.TemporaryDirectory(prefix="ckptio-inc-"))))
        if "s3" in which:
            srv = stack.enter_context(MotoServer())
            make_s3_bucket(srv.url, "bench")
            ckptio.configure(backends={"s3": {"endpoint_url": srv.url, **MOTO_S3_OPTIONS}})
            out.append(("s3", "s3://bench"))
        yield iter(out)


def run_saves(root: str, fmt: str, incremental: bool, size: int, frozen: bool = True) -> list[tuple[float, int]]:
    """(seconds, bytes written) of each of the five saves into a fresh root."""
    from ..checkpointer import Checkpointer

    ck = Checkpointer(root, format=fmt, incremental=incremental)
    out = []
    for step in range(1, SAVES + 1):
        state = workload_f(size, step, frozen)
        t = time.perf_counter()
        ck.save(step, state)
        took = time.perf_counter() - t
        res = ck.last_save
        written = res.bytes_written if res is not None and res.bytes_written is not None else _logical(state)
        out.append((took, written))
    return out


def restore_once(root: str, fmt: str, incremental: bool, size: int) -> float:
    """Seconds to restore step 5 of ``root`` as a resumed job does: a new ``Checkpointer``, into a fresh
    zeroed state (allocated before the clock starts)."""
    from ..checkpointer import Checkpointer

    ck = Checkpointer(root, format=fmt, incremental=incremental)
    target = _zeros(workload_f(size, SAVES))
    t = time.perf_counter()
    ck.load(target, step=SAVES)
    return time.perf_counter() - t


def _step_file(root: str) -> str:
    return glob.glob(os.path.join(root, f"{SAVES:012d}", "*.fpk"))[0]


Piece = tuple[str, int, memoryview]  # (file, offset in it, where its bytes go)


def raw_reads(payloads: list[list[Piece]], threads: int = 2) -> float:
    """Seconds to read each payload's pieces as a verified restore reads them, and no more: each piece's
    file opened, read into its view in ``osio.HOT_PIECE`` pieces with ``preadv``, each hashed right after
    its read into the payload's one xxh3-64; the payloads dealt out to ``threads`` threads by bytes (the
    largest first, each to the thread with the fewest so far; each thread's in file order): the floor
    under a restore of those bytes into those views."""
    import concurrent.futures as cf

    import xxhash

    from ..osio import preadinto_each
    from ..threads import deal

    def read(mine: list[list[Piece]]) -> None:
        for pieces in mine:
            hasher = xxhash.xxh3_64()
            for path, off, view in pieces:
                fd = os.open(path, os.O_RDONLY)
                try:
                    if preadinto_each(fd, view, off, hasher.update) < len(view):
                        raise OSError(f"{path}: short read")
                finally:
                    os.close(fd)

    shares = deal({i: sum(len(v) for _, _, v in p) for i, p in enumerate(payloads)}, threads)
    t = time.perf_counter()
    with cf.ThreadPoolExecutor(threads) as ex:
        list(ex.map(read, [[payloads[i] for i in sorted(share)] for share in shares]))
    return time.perf_counter() - t


def payload_targets(path: str, target: Any) -> list[tuple[int, memoryview]]:
    """``(offset in the file, the bytes of the tensor of ``target`` it restores into)`` for each payload of
    the ``.fpk`` file ``path``, in file order (``target`` has the file's tree, tensors where it has them)."""
    from ..formats.fastpickle import TensorInfo, inspect

    out: dict[int, tuple[int, memoryview]] = {}

    def walk(tree: Any, into: Any) -> None:
        if isinstance(tree, TensorInfo):
            if tree.storage not in out:
                view = memoryview(into.detach().reshape(-1).view(torch.uint8).numpy())
                assert len(view) == tree.nbytes, f"{tree.path}: {len(view)} bytes to restore, {tree.nbytes} stored"
                out[tree.storage] = (tree.offset, view)
        elif isinstance(tree, dict):
            for k, v in tree.items():
                walk(v, into[k])
        elif isinstance(tree, (list, tuple)):
            for a, b in zip(tree, into, strict=True):
                walk(a, b)

    walk(inspect(path).tree, target)
    return sorted(out.values(), key=lambda x: x[0])


def block_pieces(recipe: Any, content: str, offset: int, view: memoryview) -> list[Piece]:
    """The content objects (under ``content``) holding bytes ``[offset, offset + len(view))`` of the
    file ``recipe`` describes, each piece with the part of ``view`` its bytes go to."""
    import bisect

    out: list[Piece] = []
    pos, end = offset, offset + len(view)
    i = bisect.bisect_right(recipe.offsets, pos) - 1
    while pos < end:
        lo, h = recipe.offsets[i], recipe.hashes[i]
        take = min(lo + recipe.lengths[i], end) - pos
        out.append((os.path.join(content, h[:2], h), pos - lo, view[pos - offset : pos - offset + take]))
        pos += take
        i += 1
    return out


def _restorers(full_root: str, inc_root: str, fmt: str, size: int) -> tuple[dict[str, Any], Any]:
    """The two roots' Checkpointers ("full", "inc") and a zeroed state to restore step 5 into."""
    from ..checkpointer import Checkpointer

    cks = {"full": Checkpointer(full_root, format=fmt), "inc": Checkpointer(inc_root, format=fmt, incremental=True)}
    return cks, _zeros(workload_f(size, SAVES))


def restore_rounds(full_root: str, inc_root: str, fmt: str, size: int, rounds: int) -> dict[str, list[float]]:
    """``rounds`` interleaved restores of step 5 from each root, and the raw reads under them
    (:func:`raw_reads`): each payload's bytes from the other step's file, or from the incremental step's
    content objects, into the very tensors the restores fill (the two steps' files have one layout: the
    same state, saved alike). The memory a floor reads into changes which of the two reads is faster
    here: into one buffer at the file's offsets, objects / file measured 0.99x; into the restore's own
    tensors, 1.02x (1 GiB, three runs of 21 rounds: 1.017, 1.024, 1.018), so the floor reads into those."""
    from ..incremental.recipe import parse_recipe
    from ..incremental.store import CONTENT_DIR

    cks, target = _restorers(full_root, inc_root, fmt, size)
    inc_file, full_file = _step_file(inc_root), _step_file(full_root)
    with open(inc_file, "rb") as f:
        recipe = parse_recipe(f.read(), inc_file)
    content = os.path.join(inc_root, CONTENT_DIR)
    spans = payload_targets(full_file, target)
    reads = {
        "raw file": [[(full_file, off, view)] for off, view in spans],
        "raw blocks": [block_pieces(recipe, content, off, view) for off, view in spans],
    }
    res: dict[str, list[float]] = {"full": [], "inc": [], "raw file": [], "raw blocks": []}
    for r in range(rounds):
        order = ["full", "inc", "raw file", "raw blocks"]
        for name in order[r % 4 :] + order[: r % 4]:
            if name in cks:
                t = time.perf_counter()
                cks[name].load(target, step=SAVES)
                res[name].append(time.perf_counter() - t)
            else:
                res[name].append(raw_reads(reads[name]))
    return res


def cold_rounds(full_root: str, inc_root: str, fmt: str, size: int, rounds: int) -> dict[str, list[float]] | None:
    """``rounds`` interleaved restores of step 5 from each root, both roots dropped from the page cache
    before each (a resumed job on a fresh node reads from the device), and each followed at once by a
    restore from the page cache that read left behind ("again": a second load in the same job). None
    where the page cache cannot be dropped (no ``posix_fadvise``)."""
    from .measure import evict_local

    cks, target = _restorers(full_root, inc_root, fmt, size)
    res: dict[str, list[float]] = {"full": [], "inc": [], "full again": [], "inc again": []}
    for r in range(rounds):
        for name in ("full", "inc") if r % 2 == 0 else ("inc", "full"):
            if not (evict_local(full_root) and evict_local(inc_root)):
                return None
            for key in (name, f"{name} again"):
                t = time.perf_counter()
                cks[name].load(target, step=SAVES)
                res[key].append(time.perf_counter() - t)
    return res


def _zeros(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: _zeros(v) for k, v in state.items()}
    return state


def _logical(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_logical(v) for v in state.values())
    return 0


def _spread(xs: list[float], unit: str = "x") -> str:
    """The median and [min-max] of the runs (one per repeat, each pairing the two modes' runs)."""
    return f"(per repeat: median {statistics.median(xs):.2f}{unit} [{min(xs):.2f}-{max(xs):.2f}], n={len(xs)})"


def _print_cold(rc: dict[str, list[float]] | None, rounds: int) -> None:
    if rc is None:
        print("cold restores: skipped (this platform cannot drop files from the page cache)")
        return
    for label, f, i in (
        (f"{rounds} cold restores of step {SAVES} (page cache dropped before each)", "full", "inc"),
        ("  each followed by a restore from the page cache it left", "full again", "inc again"),
    ):
        per = [b / a for a, b in zip(rc[f], rc[i], strict=True)]
        print(
            f"{label}: non-incremental {statistics.median(rc[f]):.3f} s, incremental "
            f"{statistics.median(rc[i]):.3f} s; incremental / non-incremental {_spread(per)}"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=1024, help="state size in MiB (default 1024)")
    p.add_argument("--repeats", type=int, default=3, help="runs of the five saves per mode (median)")
    p.add_argument("--format", default="fpk", choices=["fpk", "pt", "dcp"])
    p.add_argument("--targets", default="local,s3", help="comma-separated: local, s3")
    p.add_argument("--workload", default="F", choices=["F", "W1"], help="F: 90%% frozen; W1: every byte changes")
    p.add_argument("--s3-size", type=int, default=256, help="state size in MiB on S3 (moto; default 256)")
    p.add_argument(
        "--restores", type=int, default=0, help="local .fpk: this many more interleaved restore rounds (and floor)"
    )
    p.add_argument(
        "--cold",
        type=int,
        default=0,
        help="local: this many interleaved restores with the page cache dropped before each (and one right after)",
    )
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    frozen = args.workload == "F"
    with targets(args.targets.split(",")) as found:
        for name, base in found:
            size = min(args.size, args.s3_size) << 20 if name == "s3" else args.size << 20
            times: dict[bool, list[list[float]]] = {False: [], True: []}
            written: dict[bool, list[int]] = {}
            warm = args.restores > 0 and args.format == "fpk"
            keep = name == "local" and (warm or args.cold > 0)
            roots: dict[bool, str] = {}
            for rep in range(args.repeats):
                # the modes take turns going first, and each root is restored once both are saved (in the same
                # order): neither restore runs right after its own saves, nor after the other root's removal
                # (the kernel freeing GiBs of page cache meanwhile), which favoured whichever went first
                order = (False, True) if rep % 2 == 0 else (True, False)
                made: dict[bool, str] = {}
                for inc in order:
                    made[inc] = f"{base.rstrip('/')}/{uuid.uuid4().hex[:8]}-{'inc' if inc else 'full'}"
                    res = run_saves(made[inc], args.format, inc, size, frozen)
                    times[inc].append([t for t, _ in res])
                    written[inc] = [w for _, w in res]
                for inc in order:
                    times[inc][-1].append(restore_once(made[inc], args.format, inc, size))
                for inc, root in made.items():
                    if keep and rep == args.repeats - 1:
                        roots[inc] = root
                    elif name == "local":
                        shutil.rmtree(root, ignore_errors=True)
            print(f"== {name} workload {args.workload} ({args.format}, {size >> 20} MiB, median of {args.repeats})")
            print(f"{'save':>4} {'full s':>8} {'inc s':>8} {'full MiB':>9} {'inc MiB':>9} {'inc %':>6}")
            for i in range(SAVES):
                full_t = statistics.median(r[i] for r in times[False])
                inc_t = statistics.median(r[i] for r in times[True])
                fw, iw = written[False][i], written[True][i]
                mib = f"{fw / 2**20:>9.1f} {iw / 2**20:>9.1f}"
                print(f"{i + 1:>4} {full_t:>8.3f} {inc_t:>8.3f} {mib} {100 * iw / fw:>6.1f}")
            full_rest = statistics.median(t for r in times[False] for t in r[1:SAVES])
            inc_rest = statistics.median(t for r in times[True] for t in r[1:SAVES])
            per = [
                statistics.median(f[1:SAVES]) / statistics.median(i[1:SAVES])
                for f, i in zip(times[False], times[True], strict=True)
            ]
            print(f"saves 2-{SAVES}: non-incremental / incremental time = {full_rest / inc_rest:.2f}x {_spread(per)}")
            full_load = statistics.median(r[SAVES] for r in times[False])
            inc_load = statistics.median(r[SAVES] for r in times[True])
            per = [i[SAVES] / f[SAVES] for f, i in zip(times[False], times[True], strict=True)]
            print(
                f"restore of step {SAVES}: non-incremental {full_load:.3f} s "
                f"{_spread([r[SAVES] for r in times[False]], 's')}, incremental {inc_load:.3f} s "
                f"{_spread([r[SAVES] for r in times[True]], 's')}; incremental / non-incremental {_spread(per)}"
            )
            if roots and warm:
                rr = restore_rounds(roots[False], roots[True], args.format, size, args.restores)
                per = [i / f for f, i in zip(rr["full"], rr["inc"], strict=True)]
                floor = [b / f for f, b in zip(rr["raw file"], rr["raw blocks"], strict=True)]
                print(
                    f"{args.restores} more interleaved restores of step {SAVES}: non-incremental "
                    f"{statistics.median(rr['full']):.3f} s, incremental {statistics.median(rr['inc']):.3f} s; "
                    f"incremental / non-incremental {_spread(per)}"
                )
                print(
                    "  floor, the same bytes read and hashed by plain code into the same tensors: one file "
                    f"{statistics.median(rr['raw file']):.3f} s, the content objects "
                    f"{statistics.median(rr['raw blocks']):.3f} s; objects / file {_spread(floor)}"
                )
            if roots and args.cold > 0:  # after the warm rounds: a cold read leaves another page cache behind
                _print_cold(cold_rounds(roots[False], roots[True], args.format, size, args.cold), args.cold)
            for root in roots.values():
                shutil.rmtree(root, ignore_errors=True)
            print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0
