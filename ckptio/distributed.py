"""Multi-rank loads that fetch each object once per node, or once per job over the network.

With an initialised process group, :func:`load` groups the ranks by node (each rank reports
:func:`node_id`, exchanged through the group, so no ``LOCAL_RANK`` arithmetic is assumed), lets the
lowest rank of each node fill the node-local cache (:class:`ckptio.cache.CachedBackend`),
then every rank reads from that cache. ``mode="network"`` instead has one rank read the object and
broadcast it over the group in ``chunk_size`` pieces (for nodes without a usable local disk).
:func:`load_dcp` does the same for a ``torch.distributed.checkpoint`` directory: each node
downloads every file of the checkpoint once, then ``dcp.load`` reads them from the cache.

Failure handling: after filling, every rank exchanges a status object with every other rank
(that exchange is the barrier). An error on a downloading rank is re-raised there and reaches every
other rank as :class:`RankFailedError` naming the rank, node, URI and cause. Every collective here
waits at most ``timeout`` seconds and then raises :class:`DistributedTimeoutError` (a
``TimeoutError``) saying which step timed out; ``dcp.load``'s own collectives use the process
group's timeout.

The node identity is, highest first: the ``node=`` argument, ``$CKPTIO_NODE_ID``, the hostname.
Ranks with the same identity must share the cache directory, ranks with different ones must not.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import registry as _registry
from .backends.base import Backend, NodeCache, ObjectInfo
from .backends.local import LocalBackend
from .backends.readers import BytesReader
from .context import resolve
from .errors import CkptioError
from .formats.base import check_keywords

__all__ = [
    "load",
    "load_dcp",
    "node_id",
    "node_plan",
    "NodePlan",
    "RankFailedError",
    "DistributedTimeoutError",
    "DEFAULT_TIMEOUT",
    "ENV_NODE_ID",
]

ENV_NODE_ID = "CKPTIO_NODE_ID"
DEFAULT_TIMEOUT = 1800.0
DEFAULT_CHUNK = 64 << 20


class RankFailedError(CkptioError, RuntimeError):
    """Another rank failed while fetching the checkpoint for this one."""


class DistributedTimeoutError(CkptioError, TimeoutError):
    """A collective of a distributed load did not complete within its timeout."""


def node_id(node: str | None = None) -> str:
    """This process's node identity: ``node``, else ``$CKPTIO_NODE_ID``, else the hostname."""
    return node or os.environ.get(ENV_NODE_ID) or socket.gethostname()


@dataclass(frozen=True)
class NodePlan:
    """Who downloads for whom. Ranks are ranks in the group."""

    rank: int
    world: int
    nodes: tuple[str, ...]  # node identity of each rank
    leader: int  # the rank that fills this rank's node cache

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    @property
    def leaders(self) -> list[int]:
        return sorted({self.nodes.index(n) for n in self.nodes})


def _wait(work: Any, timeout: float, what: str) -> None:
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as e:
        raise DistributedTimeoutError(
            f"ckptio.distributed: {what} did not complete within {timeout:g}s on rank {dist.get_rank()} "
            f"(another rank stuck or dead?): {e}"
        ) from e


def _exchange(obj: Any, group: Any, timeout: float, what: str) -> list[Any]:
    """all_gather of a picklable object, with a timeout on each collective."""
    world = dist.get_world_size(group)
    data = pickle.dumps(obj)
    sizes = [torch.zeros(1, dtype=torch.int64, device="cpu") for _ in range(world)]
    _wait(
        dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64, device="cpu"), group=group, async_op=True),
        timeout,
        what,
    )
    width = max(int(s.item()) for s in sizes)
    mine = torch.zeros(width, dtype=torch.uint8, device="cpu")
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    outs = [torch.empty(width, dtype=torch.uint8, device="cpu") for _ in range(world)]
    _wait(dist.all_gather(outs, mine, group=group, async_op=True), timeout, what)
    return [pickle.loads(o[: int(s.item())].numpy().tobytes()) for o, s in zip(outs, sizes, strict=True)]


def node_plan(group: Any = None, *, node: str | None = None, timeout: float = DEFAULT_TIMEOUT) -> NodePlan:
    """Exchange node identities over ``group``; the lowest rank of each node is its leader."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "ckptio.distributed needs an initialised process group (torch.distributed.init_process_group)"
        )
    nodes = tuple(_exchange(node_id(node), group, timeout, "exchanging node identities"))
    rank = dist.get_rank(group)
    return NodePlan(rank, len(nodes), nodes, nodes.index(nodes[rank]))


@dataclass(frozen=True)
class _Status:
    ok: bool
    value: Any = None  # the result when ok, else the error text
    error_type: str = ""


def _attempt(fn: Callable[[], Any]) -> tuple[_Status, BaseException | None]:
    try:
        return _Status(True, fn()), None
    except Exception as e:  # reported to every rank below, then re-raised here
        return _Status(False, str(e) or repr(e), type(e).__name__), e


def _settle(
    plan: NodePlan, mine: _Status | None, error: BaseException | None, group: Any, timeout: float, what: str
) -> list[_Status | None]:
    """The barrier: every rank learns every leader's status. Raises on every rank if any failed."""
    statuses = _exchange(mine, group, timeout, f"waiting for the node leaders to {what}")
    if error is not None:
        try:
            raise error
        finally:  # the error's traceback holds this frame: no reference cycle through it
            del error
    failed = [(r, s) for r, s in enumerate(statuses) if s is not None and not s.ok]
    if failed:
        r, s = failed[0]
        more = f" (and {len(failed) - 1} other rank(s))" if len(failed) > 1 else ""
        raise RankFailedError(f"rank {r} on node {plan.nodes[r]!r} failed to {what}{more}: {s.error_type}: {s.value}")
    return statuses


def _cached_backend(uri: str, cache: Any, options: dict[str, Any]) -> tuple[Backend, NodeCache, str]:
    backend, resolved = resolve(uri, cache=True if cache is None else cache, **options)
    node_cache = backend.node_cache
    if node_cache is None:
        raise ValueError(f"mode='filesystem' needs a cache for {uri!r}; pass cache=True or a directory")
    return backend, node_cache, resolved


def load(
    uri: str | os.PathLike,
    *,
    mode: str = "filesystem",
    cache: Any = None,
    group: Any = None,
    node: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    src: int = 0,
    chunk_size: int = DEFAULT_CHUNK,
    file_format: str | None = None,
    backend_options: dict[str, Any] | None = None,
    **kwargs: Any,
) -> Any:
    """``ckptio.load`` on every rank of ``group``, fetching the object once per node (or once).

    ``mode="filesystem"``: one rank per node fills the node cache (``cache``: True, a directory or a
    mapping, as for :func:`ckptio.load`), the others read it. ``mode="network"``: rank ``src`` reads
    and broadcasts in ``chunk_size`` pieces. ``node`` overrides this rank's node identity. Extra
    keywords go to the format (``map_location``, ``weights_only`` ...).
    """
    uri = os.fspath(uri)
    entry = _registry.formats.find("x." + file_format.lstrip(".")) if file_format else _registry.formats.find(uri)
    fmt = entry.instance()
    check_keywords(fmt, "load", kwargs, load, uri)
    if mode == "network":
        return _load_network(uri, fmt, group, timeout, src, chunk_size, backend_options or {}, kwargs)
    if mode != "filesystem":
        raise ValueError(f"mode must be 'filesystem' or 'network', got {mode!r}")
    plan = node_plan(group, node=node, timeout=timeout)
    backend, node_cache, resolved = _cached_backend(uri, cache, backend_options or {})
    mine, error = _attempt(lambda: node_cache.fill(resolved)) if plan.is_leader else (None, None)
    statuses = _settle(plan, mine, error, group, timeout, f"fetch {uri}")
    info: ObjectInfo = statuses[plan.leader].value  # type: ignore[union-attr]
    with node_cache.pinned([info]), backend.local_file(resolved) as path:
        if path is None:  # the entry is damaged and held by other readers: read through
            return fmt.load(backend, resolved, **kwargs)
        return fmt.load(LocalBackend(part_size=backend.part_size, concurrency=backend.concurrency), path, **kwargs)


def _load_network(
    uri: str,
    fmt: Any,
    group: Any,
    timeout: float,
    src: int,
    chunk_size: int,
    options: dict[str, Any],
    kwargs: dict[str, Any],
) -> Any:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "ckptio.distributed needs an initialised process group (torch.distributed.init_process_group)"
        )
    if int(chunk_size) <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size!r}")
    rank = dist.get_rank(group)
    src_global = dist.get_global_rank(group, src) if group is not None else src
    backend: Backend | None = None
    header: _Status | None = None
    error: BaseException | None = None
    if rank == src:
        try:
            backend, resolved = resolve(uri, **options)
            header = _Status(True, (backend.stat(resolved).size, resolved))
        except Exception as e:  # reported to every rank below, then re-raised here
            header, error = _Status(False, str(e) or repr(e), type(e).__name__), e
    headers = _exchange(header, group, timeout, f"waiting for rank {src} to open {uri}")
    if error is not None:
        try:
            raise error
        finally:  # the error's traceback holds this frame: no reference cycle through it
            del error
    head = headers[src]
    if not head.ok:
        raise RankFailedError(f"rank {src} failed to read {uri}: {head.error_type}: {head.value}")
    size, resolved = head.value
    buf = torch.empty(size, dtype=torch.uint8, device="cpu")
    mv = memoryview(buf.numpy()).cast("B")  # type: ignore[arg-type]  # numpy's stubs: ndarray.__buffer__ on 3.12+ only
    flag = torch.zeros(1, dtype=torch.int64, device="cpu")
    for off in range(0, size, int(chunk_size)):
        n = min(int(chunk_size), size - off)
        if rank == src:
            try:
                got = backend.readinto(resolved, mv[off : off + n], off)  # type: ignore[union-attr]
                if got != n:
                    raise EOFError(f"{uri}: object shrank while reading (byte {off + got} of {size})")
                flag.zero_()
            except Exception as e:
                error, flag[0] = e, 1
        _wait(
            dist.broadcast(flag, src_global, group=group, async_op=True),
            timeout,
            f"waiting for rank {src} to read {uri} at byte {off}",
        )
        if int(flag.item()):
            if error is not None:
                try:
                    raise error
                finally:  # the error's traceback holds this frame: no reference cycle through it
                    del error
            raise RankFailedError(f"rank {src} failed to read {uri} at byte {off} of {size}")
        _wait(
            dist.broadcast(buf[off : off + n], src_global, group=group, async_op=True),
            timeout,
            f"broadcasting {uri} (bytes {off}-{off + n} of {size}) from rank {src}",
        )
    try:
        return fmt.load_file(BytesReader(mv, uri), **kwargs)
    except NotImplementedError:
        raise ValueError(f"mode='network' cannot load {uri!r}: format {fmt.name!r} cannot read from memory") from None


def load_dcp(
    state_dict: dict[str, Any],
    uri: str | os.PathLike,
    *,
    cache: Any = None,
    group: Any = None,
    node: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    planner: Any = None,
    **reader_options: Any,
) -> None:
    """``torch.distributed.checkpoint.load`` of ``uri`` into ``state_dict``, each node downloading every
    file of the checkpoint once into its cache. ``reader_options`` go to :class:`ckptio.dcp.StorageReader`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from .dcp import StorageReader, surface_error
    from .dcp.quiet import quiet_dcp_log

    plan = node_plan(group, node=node, timeout=timeout)
    reader = StorageReader(uri, cache=True if cache is None else cache, **reader_options)
    backend, root = reader.backend, reader.root
    node_cache = backend.node_cache
    if node_cache is None:
        raise ValueError(f"load_dcp needs a cache for {os.fspath(uri)!r}; pass cache=True or a directory")

    def prefetch() -> list[ObjectInfo]:
        files = [i.uri for i in backend.list(root, recursive=True) if not i.is_dir]  # listings pass through
        if not files:
            raise FileNotFoundError(f"no checkpoint files under {os.fspath(uri)}")
        return list(node_cache.fill_many(files).values())

    mine, error = _attempt(prefetch) if plan.is_leader else (None, None)
    statuses = _settle(plan, mine, error, group, timeout, f"fetch the checkpoint {os.fspath(uri)}")
    with node_cache.pinned(statuses[plan.leader].value):  # type: ignore[union-attr]
        try:
            with quiet_dcp_log():
                dcp.load(state_dict, storage_reader=reader, planner=planner, process_group=group)
        except CheckpointException as e:  # the failed rank's own error, as ckptio.dcp.load raises
            raise surface_error(e, "load", uri, reader._metadata_error) from e
