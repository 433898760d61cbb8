"""The floors under the cells where ckptio stays below the simplest baseline (issue 14).

The throughput benchmark compares ckptio with the simplest thing a user would write: a raw
``write`` + ``fsync``, one PUT, one GET. Those baselines keep no promise: a crash can leave a torn file
under the name, a DCP-style checkpoint needs a commit that one object cannot give, and a ``.pt`` load
has to run ``torch.load`` on the bytes. This script measures, in one process, interleaved, median of
``--repeats`` with the min-max, the same bytes written or read the least costly way that keeps
ckptio's promise (the floor), next to ckptio and the simple baseline:

local (fsync everywhere)
  raw write + fsync          1 file fsync; a crash can leave a torn file (the throughput baseline)
  raw atomic replace         temporary file + fsync + rename + directory fsync (any crash-safe save)
  torch.save, atomic replace torch.save to a temporary path + the same: the crash-safe .pt floor
  raw DCP commit             ckptio's protocol with os calls: data temporary file + fsync + rename +
                             directory fsync, then .metadata temporary + fsync + link + directory fsync
  raw DCP, 3 fsyncs          data file written under its final (fresh) name + fsync, then the .metadata
                             commit: the least a crash-safe two-file commit needs
  torch dcp.save, no writes  torch's DCP API with a writer that writes nothing (planner, bookkeeping):
                             what every DCP save through torch pays on top of its files
  loads: raw read; torch.load; raw DCP read (.metadata + unpickle + data readinto); torch dcp.load
  with a reader that reads nothing (torch's API on every DCP load)
memory:// (the fixed costs of a small verified load)
  raw memcpy                 the tensor bytes copied into one buffer and back into fresh tensors (the
                             throughput baseline)
  .fpk verified, least Python, a tensor per payload / one buffer
                             the least a verified .fpk load does in Python, from the stored bytes:
                             footer and metadata checksums, the metadata unpacked and validated
                             (ckptio's own checks), each payload copied into a fresh tensor (or all
                             into one buffer, payloads as views of it, as a small remote object's
                             are) and its checksum checked, the tensors built and the tree decoded;
                             none of ckptio's plumbing (URIs, sources, the parallel reader)
S3 (moto) / GCS (emulator) on loopback
  raw 1 PUT / 1 GET          s3fs / gcsfs, the GET unpacked into fresh tensors (the throughput baseline)
  raw GET + .fpk verified    the GET of the .fpk, then the one-buffer verified load above: the floor of
                             a verified small load
  raw DCP                    overwrite check (one listing) + data PUT + .metadata PUT; load: .metadata
                             GET + data size (HEAD) + data GET: the requests ckptio's DCP makes
  raw GET + torch.load       the .pt load floor: torch's parse and copy on top of the bytes

Each table gives every row's median against its first row's (first row's time / this row's: >1 faster).

    python -m benchmarks.floors [--sizes 1MiB,32MiB] [--repeats 9] [--backends local,memory,s3,gcs]
    python -m benchmarks.floors --sizes 6KiB,1MiB --backends memory,gcs   # the small loads' floors
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import pickle
import statistics
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from typing import Any

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import torch

import ckptio
from ckptio import dcp
from ckptio.bench.heap import trim_heap
from ckptio.bench.impls import Impl, fsspec_baselines, local_baselines
from ckptio.bench.targets import S3_CREDS
from ckptio.bench.workload import make_state, nbytes, pack, touch, u8, unpack

Op = Callable[[str], Any]  # takes a fresh name, returns what a load returns


def _size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for u, f in units.items():
        if text.endswith(u):
            return int(float(text[: -len(u)]) * f)
    return int(text)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_fsync(path: str, pieces: list[Any], flags: int = 0) -> None:
    """Write ``pieces`` in order (the tensors' own memory, as the raw baseline writes it) and fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o644)
    try:
        for piece in pieces:
            view = memoryview(piece).cast("B")
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _dcp_meta(state: dict[str, torch.Tensor]) -> bytes:
    return pickle.dumps({k: (tuple(v.shape), str(v.dtype), v.nbytes) for k, v in state.items()})


def local_ops(state: dict[str, torch.Tensor], root: str) -> tuple[dict[str, Op], dict[str, Op]]:
    data, meta = [u8(t) for t in state.values()], _dcp_meta(state)
    base = {i.name: i for i in local_baselines()}  # the throughput benchmark's own baselines
    raw, tsave = base["raw write/read"], base["torch.save/load"]

    def at(impl: Impl, name: str) -> str:
        return os.path.join(root, name + impl.suffix)

    def atomic(name: str) -> None:
        final = os.path.join(root, name + ".atomic")
        tmp = f"{final}.tmp-{uuid.uuid4().hex[:8]}"
        _write_fsync(tmp, data)
        os.rename(tmp, final)
        _fsync_dir(root)

    def torch_atomic(name: str) -> None:
        final = os.path.join(root, name + ".atomic.pt")
        tmp = f"{final}.tmp-{uuid.uuid4().hex[:8]}"
        torch.save(state, tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, final)
        _fsync_dir(root)

    def dcp_commit(name: str, minimal: bool) -> None:
        d = os.path.join(root, name + (".rawdcp3" if minimal else ".rawdcp"))
        os.mkdir(d)
        obj = os.path.join(d, f"__0_0.{uuid.uuid4().hex[:16]}.distcp")
        if minimal:
            _write_fsync(obj, data, os.O_EXCL)
        else:
            _write_fsync(obj + ".tmp", data)
            os.rename(obj + ".tmp", obj)
            _fsync_dir(d)
        _write_fsync(os.path.join(d, ".metadata.tmp"), [meta])
        os.link(os.path.join(d, ".metadata.tmp"), os.path.join(d, ".metadata"))
        os.unlink(os.path.join(d, ".metadata.tmp"))
        _fsync_dir(d)

    def dcp_read(name: str) -> dict[str, torch.Tensor]:
        d = os.path.join(root, name + ".rawdcp3")
        with open(os.path.join(d, ".metadata"), "rb") as f:
            pickle.loads(f.read())
        obj = next(e.path for e in os.scandir(d) if e.name.endswith(".distcp"))
        return raw.load(state, obj)  # the tensors, read as the raw baseline reads its file

    saves: dict[str, Op] = {
        "raw write + fsync": lambda n: raw.save(state, at(raw, n)),
        "raw atomic replace": atomic,
        "raw DCP commit (ckptio's)": lambda n: dcp_commit(n, False),
        "raw DCP, 3 fsyncs": lambda n: dcp_commit(n, True),
        "torch dcp.save, no writes": lambda n: _dcp_api_only(state),
        "torch.save + fsync": lambda n: tsave.save(state, at(tsave, n)),
        "torch.save, atomic replace": torch_atomic,
        "ckptio .fpk": lambda n: ckptio.dump(state, os.path.join(root, n + ".fpk")),
        "ckptio .pt": lambda n: ckptio.dump(state, os.path.join(root, n + ".ckptio.pt")),
        "ckptio DCP": lambda n: dcp.save(state, os.path.join(root, n + ".dcp")),
    }
    loads: dict[str, Op] = {
        "raw read": lambda n: raw.load(state, at(raw, n)),
        "raw DCP read": dcp_read,
        "torch.load": lambda n: tsave.load(state, at(tsave, n)),
        "ckptio .fpk": lambda n: ckptio.load(os.path.join(root, n + ".fpk")),
        "ckptio .pt": lambda n: ckptio.load(os.path.join(root, n + ".ckptio.pt")),
        "ckptio DCP": lambda n: _dcp_load(state, os.path.join(root, n + ".dcp")),
        "torch dcp.load, no reads": lambda n: _dcp_load_api_only(state, os.path.join(root, n + ".dcp")),
    }
    return saves, loads


class _NoStorage:
    """What torch's DCP asks of a storage writer or reader that moves no bytes (plans passed through)."""

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def prepare_local_plan(self, plan: Any) -> Any:
        return plan

    def prepare_global_plan(self, plans: Any) -> Any:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True


def _dcp_api_only(state: dict[str, torch.Tensor]) -> None:
    """torch's ``dcp.save`` with a writer that writes nothing: what its planner and bookkeeping cost."""
    from torch.distributed.checkpoint import save
    from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
    from torch.futures import Future

    class NoWrites(_NoStorage, StorageWriter):
        def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
            pass

        def write_data(self, plan: Any, planner: Any) -> Future:
            fut: Future = Future()
            fut.set_result([WriteResult(index=i.index, size_in_bytes=0, storage_data=None) for i in plan.items])
            return fut

        def finish(self, metadata: Any, results: Any) -> None:
            pass

    save(state, storage_writer=NoWrites())


_metadata_bytes: dict[int, bytes] = {}


def _dcp_load_api_only(state: dict[str, torch.Tensor], uri: str) -> dict[str, torch.Tensor]:
    """torch's ``dcp.load`` into fresh tensors with a reader that reads nothing but hands over the
    ``.metadata`` of the first checkpoint of ``state`` (read in the warm-up round): the planner and
    bookkeeping of every load through torch's API, on top of which a reader reads its files."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.storage import StorageReader
    from torch.futures import Future

    if id(state) not in _metadata_bytes:  # in the warm-up round, not counted: every save of state has the same
        _metadata_bytes[id(state)] = ckptio.get(uri + "/.metadata")
    meta = _metadata_bytes[id(state)]

    class NoReads(_NoStorage, StorageReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return pickle.loads(meta)

        def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
            pass

        def read_data(self, plan: Any, planner: Any) -> Future:
            fut: Future = Future()
            fut.set_result(None)
            return fut

    out = {k: torch.empty_like(v) for k, v in state.items()}
    load(out, storage_reader=NoReads())
    return out


def _dcp_load(state: dict[str, torch.Tensor], uri: str) -> dict[str, torch.Tensor]:
    out = {k: torch.empty_like(v) for k, v in state.items()}
    dcp.load(out, uri)
    return out


def fpk_floor(data: bytes, one_buffer: bool) -> Any:
    """The least a verified ``.fpk`` load does in Python, from the object's bytes (see the module's
    docstring): every check ckptio's reader makes of the footer, header and metadata, every payload's
    checksum, into fresh memory; ``one_buffer``: one copy of the whole object, payloads as views of it."""
    import msgpack
    import xxhash

    from ckptio.errors import IntegrityError
    from ckptio.formats.fastpickle.decode import decode_tree, tensor_factory
    from ckptio.formats.fastpickle.layout import FOOTER, HEADER, MAGIC, validate

    size, src = len(data), memoryview(data)
    meta_off, meta_len, meta_hash, _, _, flags, foot_hash, _ = FOOTER.unpack_from(data, size - FOOTER.size)
    if xxhash.xxh3_64_intdigest(src[size - FOOTER.size : size - FOOTER.size + 48]) != foot_hash:
        raise IntegrityError("footer")
    if one_buffer:  # the views below keep this buffer alive
        src = memoryview(torch.empty(size, dtype=torch.uint8).numpy())  # type: ignore[arg-type]
        src[:] = data
    meta_bytes = src[meta_off : meta_off + meta_len]
    h = xxhash.xxh3_64()
    h.update(src[: HEADER.size])
    h.update(meta_bytes)
    if h.intdigest() != meta_hash or src[:8] != MAGIC:
        raise IntegrityError("metadata")
    meta = validate(msgpack.unpackb(meta_bytes, raw=False, strict_map_key=False), "floor", size, meta_off, flags)
    payloads = {}
    for i, (off, n, checksum, _) in enumerate(meta.storages):
        if one_buffer and n:  # a storage of its own over the payload's bytes, as ckptio's views are
            t = torch.frombuffer(src[off : off + n], dtype=torch.uint8)
        else:
            t = torch.empty(n, dtype=torch.uint8)
            memoryview(t.numpy())[:] = src[off : off + n]  # type: ignore[arg-type]
        if xxhash.xxh3_64_intdigest(memoryview(t.numpy())) != checksum:  # type: ignore[arg-type]
            raise IntegrityError(f"payload {i}")
        payloads[i] = t
    return decode_tree(meta, tensor_factory(meta, payloads, None), False)


def memory_ops(state: dict[str, torch.Tensor]) -> tuple[dict[str, Op], dict[str, Op]]:
    store: dict[str, Any] = {}
    base = "memory://floors"

    def keep(name: str) -> None:
        store[name] = pack(state)

    saves: dict[str, Op] = {"raw memcpy": keep, "ckptio .fpk": lambda n: ckptio.dump(state, f"{base}/{n}.fpk")}
    loads: dict[str, Op] = {
        "raw memcpy": lambda n: unpack(state, store.pop(n)),
        ".fpk verified, least Python": lambda n: fpk_floor(ckptio.get(f"{base}/{n}.fpk"), False),
        ".fpk verified, least Python, 1 buf": lambda n: fpk_floor(ckptio.get(f"{base}/{n}.fpk"), True),
        "ckptio .fpk": lambda n: ckptio.load(f"{base}/{n}.fpk"),
    }
    return saves, loads


def remote_ops(state: dict[str, torch.Tensor], fs: Any, base: str) -> tuple[dict[str, Op], dict[str, Op]]:
    """``base``: scheme://bucket; fs: the raw fsspec filesystem on the same server."""
    data, meta = [u8(t) for t in state.values()], _dcp_meta(state)
    path = base.split("://", 1)[1]
    raw = fsspec_baselines(fs, base.split("://", 1)[0], {})[0]  # the throughput benchmark's raw s3fs/gcsfs
    buf = io.BytesIO()
    torch.save(state, buf)

    def raw_dcp(name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            fs.ls(f"{path}/{name}.rawdcp/", refresh=True)  # the overwrite check
        put(f"{name}.rawdcp/__0_0.distcp", data)
        put(f"{name}.rawdcp/.metadata", [meta])

    def raw_dcp_read(name: str) -> dict[str, torch.Tensor]:
        pickle.loads(fs.cat_file(f"{path}/{name}.rawdcp/.metadata"))
        fs.info(f"{path}/{name}.rawdcp/__0_0.distcp", refresh=True)
        return unpack(state, fs.cat_file(f"{path}/{name}.rawdcp/__0_0.distcp"))

    def put(name: str, pieces: list[Any]) -> None:  # as the throughput benchmark's raw baseline writes
        with fs.open(f"{path}/{name}", "wb") as f:
            for piece in pieces:
                f.write(piece)

    saves: dict[str, Op] = {
        "raw 1 PUT": lambda n: raw.save(state, f"{base}/{n}{raw.suffix}"),
        "raw DCP (3 requests)": raw_dcp,
        "raw PUT of a .pt": lambda n: put(f"{n}.raw.pt", [buf.getbuffer()]),
        "ckptio .fpk": lambda n: ckptio.dump(state, f"{base}/{n}.fpk"),
        "ckptio .pt": lambda n: ckptio.dump(state, f"{base}/{n}.pt"),
        "ckptio DCP": lambda n: dcp.save(state, f"{base}/{n}.dcp"),
    }
    loads: dict[str, Op] = {
        "raw 1 GET": lambda n: raw.load(state, f"{base}/{n}{raw.suffix}"),
        "raw DCP read (3 requests)": raw_dcp_read,
        "raw GET + torch.load": lambda n: torch.load(io.BytesIO(fs.cat_file(f"{path}/{n}.raw.pt")), weights_only=True),
        "raw GET + .fpk verified": lambda n: fpk_floor(fs.cat_file(f"{path}/{n}.fpk"), True),
        "ckptio .fpk": lambda n: ckptio.load(f"{base}/{n}.fpk"),
        "ckptio .pt": lambda n: ckptio.load(f"{base}/{n}.pt"),
        "ckptio DCP": lambda n: _dcp_load(state, f"{base}/{n}.dcp"),
    }
    return saves, loads


def measure(saves: dict[str, Op], loads: dict[str, Op], repeats: int) -> dict[str, list[float]]:
    """Each repeat: every save once, then every load of what the saves wrote, both orders rotating by
    one between repeats; the heap trimmed before each timed call (as the throughput benchmark does)."""
    times: dict[str, list[float]] = {}
    names = list(saves)
    for r in range(repeats + 1):  # the first round warms imports, clients and connections: not counted
        tag = f"r{r}-{uuid.uuid4().hex[:6]}"
        order = names[r % len(names) :] + names[: r % len(names)]
        for key in order:
            trim_heap()
            t = time.perf_counter()
            saves[key](tag)
            if r:
                times.setdefault(f"save  {key}", []).append(time.perf_counter() - t)
        lnames = list(loads)
        for key in lnames[r % len(lnames) :] + lnames[: r % len(lnames)]:
            op = loads[key]
            trim_heap()
            t = time.perf_counter()
            out = op(tag)
            if isinstance(out, dict):
                touch(out)
            if r:
                times.setdefault(f"load  {key}", []).append(time.perf_counter() - t)
            del out
    return times


@contextlib.contextmanager
def _targets(which: list[str]) -> Iterator[list[tuple[str, Callable[..., tuple[dict, dict]]]]]:
    with contextlib.ExitStack() as stack:
        out: list[tuple[str, Callable[..., tuple[dict, dict]]]] = []
        if "local" in which:
            root = stack.enter_context(tempfile.TemporaryDirectory(prefix="ckptio-floors-", dir=os.getcwd()))
            out.append(("local", lambda s, root=root: local_ops(s, tempfile.mkdtemp(dir=root))))
        if "memory" in which:
            out.append(("memory", memory_ops))
        if "s3" in which:
            from ckptio.bench.servers import MotoServer, make_s3_bucket, moto_s3fs

            srv = stack.enter_context(MotoServer())
            make_s3_bucket(srv.url, "floors")
            ckptio.configure(backends={"s3": {"endpoint_url": srv.url, **S3_CREDS}})
            sfs = moto_s3fs(srv.url)
            out.append(("s3", lambda s, fs=sfs: remote_ops(s, fs, "s3://floors")))
        if "gcs" in which:
            import gcsfs

            from ckptio.bench.servers import GCSEmulator, make_gcs_bucket

            gsrv = stack.enter_context(GCSEmulator())
            make_gcs_bucket(gsrv.url, "floors")
            ckptio.configure(backends={"gcs": {"endpoint_url": gsrv.url, "anon": True, "project": "bench"}})
            gfs = gcsfs.GCSFileSystem(skip_instance_cache=True, token="anon", project="bench", endpoint_url=gsrv.url)
            out.append(("gcs", lambda s, fs=gfs: remote_ops(s, fs, "gs://floors")))
        yield out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1MiB,32MiB")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--backends", default="local,s3,gcs")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    sizes = [_size(s) for s in args.sizes.split(",")]
    with _targets(args.backends.split(",")) as targets:
        for name, ops in targets:
            for size in sizes:
                state = make_state(size)
                saves, loads = ops(state)
                times = measure(saves, loads, args.repeats)
                print(
                    f"== {name}, {nbytes(state) / 2**20:.3f} MiB, ms: median [min-max] of {args.repeats}, "
                    f"and the first row's median / this one's =="
                )
                for op, keys in (("save", list(saves)), ("load", list(loads))):
                    ref = statistics.median(times[f"{op}  {keys[0]}"])
                    for key in keys:
                        v = times[f"{op}  {key}"]
                        med = statistics.median(v)
                        print(
                            f"  {op}  {key:40s} {med * 1e3:9.3f}  [{min(v) * 1e3:.3f}-{max(v) * 1e3:.3f}]"
                            f"  {ref / med:5.2f}x"
                        )
                sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
