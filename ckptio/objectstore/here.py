"""A load's first GET sent from the caller's thread, not from the IO loop.

The first GET of a load (bytes 0 to the end of the head buffer: a small object whole) is one its caller
only waits for: the object's size comes with its headers. Sent from the IO loop, it costs two thread
hand-offs (the caller to the loop, the loop back), each contending for the GIL with the thread it wakes:
on a fast store that is as much as the GET itself. A 6 KiB object from the GCS emulator on loopback,
interleaved rounds, the heap trimmed before each: gcsfs ``cat_file`` 2.06 ms, the same GET with
``http.client`` on the caller's thread 1.14 ms. A store whose client can send it there implements
:meth:`~ckptio.objectstore.backend.ObjectStoreBackend._head_here` and returns a :class:`HeadHere`.

Nothing else changes: the reply's version is checked against the pin and its size told as on the IO
loop. A body that is the whole object is read on the caller's thread; a larger object's is read on a
worker thread (the caller starts the rest of the object meanwhile). A GET that fails here (its
headers, its body) is the first attempt of the IO loop's GET, which goes on from it under the retry
policy: it counts against ``max_attempts``, and its time against the deadline.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .retry import PriorAttempt


@dataclass
class HeadHere:
    """A head GET sent from the caller's thread.

    ``fill()``: reads the body into the caller's buffers and returns the count (it closes the reply,
    whatever happens); None when the GET failed before that, with ``failed``, its error. ``started``:
    the ``time.monotonic()`` the attempt began. ``submit(fn)``: runs ``fn`` on a worker thread (for a
    body larger than the head buffer)."""

    fill: Callable[[], int] | None
    failed: BaseException | None
    started: float
    submit: Callable[[Callable[[], None]], cf.Future[Any]] | None = None


def finish(
    here: HeadHere,
    room: int,
    told: list[int],
    settle: Callable[[int], None],
    on_loop: Callable[[PriorAttempt], None],
    fail: Callable[[BaseException], None],
) -> None:
    """Complete a head GET sent from the caller's thread: its body read (here, or on a worker thread where
    the object is larger than the ``room`` bytes it fills: ``told`` holds the size once its headers told
    it), then ``settle(count)``; or, on any error, ``on_loop(attempt)``: the IO loop's GET, with this
    attempt counted as its first. On a worker thread, an error of ``settle`` or ``on_loop`` (a closed IO
    loop) goes to ``fail``, which completes the read's future with it; here it is raised to the caller."""
    fill, failed = here.fill, here.failed
    if fill is None:
        assert failed is not None
        here.failed = None  # the error is the retries' to hold (see PriorAttempt)
        on_loop(PriorAttempt(detached(failed), here.started))
        return

    def body() -> None:
        try:
            n = fill()
        except Exception as e:
            on_loop(PriorAttempt(detached(e), here.started))
            return
        settle(n)

    def on_worker() -> None:
        try:
            body()
        except BaseException as e:  # noqa: BLE001 - handed on through the read's future
            fail(detached(e))

    if told and told[0] > room and here.submit is not None:
        here.submit(on_worker)  # the caller starts the rest of the object while this body comes
    else:
        body()


def detached(error: BaseException) -> BaseException:
    """``error`` (and the errors it chains) without tracebacks: a frame of the thread that sent the GET
    holds, through its callers, the future this error ends up in (a reference cycle keeping those frames
    and their buffers until the gc runs). Its message, not where the socket raised it, says what failed."""
    todo, seen = [error], set()
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        e.__traceback__ = None
        todo += [x for x in (e.__cause__, e.__context__) if x is not None]
    return error
