"""The ranks a Checkpointer coordinates: its process group (by default a gloo group of its own when
``torch.distributed`` is initialized), running a step on rank 0 and handing every rank its result or
its error, agreeing on the outcome of a step every rank ran, and a barrier; every collective has the
Checkpointer's timeout."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ..errors import CkptioError


class Group:
    """``pg`` (None in a single process), this process's ``rank`` and the ``world`` size."""

    def __init__(self, process_group: Any, timeout: float) -> None:
        import torch.distributed as dist

        self.timeout = timeout
        self.pg: Any = None
        self.rank, self.world = 0, 1
        if dist.is_available() and dist.is_initialized():
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
            self.pg = (
                process_group
                if process_group is not None
                else dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
            )

    def on_rank0(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn`` on rank 0 and give every rank its result, or raise its error on every rank."""
        result, err = None, None
        if self.rank == 0:
            try:
                result = fn(*args)
            except BaseException as e:  # noqa: BLE001 - re-raised below, on every rank
                err = e
        if self.pg is not None:
            import torch.distributed as dist

            op = _name(fn)  # a method called on some ranks only must not answer another one
            box = [(op, result, None if err is None else f"{type(err).__name__}: {err}")]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.pg, 0), group=self.pg)
            theirs, result, msg = box[0]
            if theirs != op:
                raise CkptioError(
                    f"rank 0 ran {theirs} while rank {self.rank} called {op}: every rank calls each of the "
                    f"Checkpointer's methods, in the same order (a call on rank 0 only shifts them)"
                )
            if err is None and msg is not None:
                raise CkptioError(f"rank 0 failed: {msg}")
        if err is not None:
            try:
                raise err
            finally:  # the error's traceback holds this frame: no reference cycle through it
                del err
        return result

    def agree(self, err: Exception | None) -> None:
        """Every rank's outcome of a step each ran on its own (a read): raise ``err``, or on a rank that
        succeeded a :class:`CkptioError` naming the ranks that failed, so no rank goes on alone."""
        if self.pg is not None:
            import torch.distributed as dist

            msgs: list[Any] = [None] * self.world
            dist.all_gather_object(msgs, None if err is None else f"{type(err).__name__}: {err}", group=self.pg)
            failed = [f"rank {r} failed: {m}" for r, m in enumerate(msgs) if m is not None]
            if err is None and failed:
                raise CkptioError("; ".join(failed))
        if err is not None:
            try:
                raise err
            finally:  # the error's traceback holds this frame: no reference cycle through it
                del err

    def agreed(self, fn: Callable[[Any], None]) -> Callable[[Any], None]:
        """``fn`` for a step every rank runs before a collective (a dcp read): the ranks :meth:`agree` on its
        outcome, so every rank raises, or none, and no collective waits for a rank that failed."""

        def run(x: Any) -> None:
            err = None
            try:
                fn(x)
            except Exception as e:  # noqa: BLE001 - raised below, on every rank
                err = e
            self.agree(err)

        return run

    def barrier(self) -> None:
        if self.pg is not None:
            import torch.distributed as dist

            dist.monitored_barrier(group=self.pg, timeout=timedelta(seconds=self.timeout), wait_all_ranks=True)


def _name(fn: Callable[..., Any]) -> str:
    return str(getattr(fn, "__qualname__", type(fn).__qualname__))
