"""Retries, deadlines and credential refresh for remote operations.

Every request an object-store backend makes (a part of a multipart upload, one ranged read, a
stat, a list page, a delete) runs through :meth:`RetryPolicy.run`: it is retried on transient
errors with exponential backoff and full jitter, up to ``max_attempts`` attempts and within a
total ``deadline``; each attempt is bounded by ``timeout``, and a transfer that receives no bytes
for ``stall_timeout`` seconds is abandoned (:func:`stall_guard`) and retried. A failed part is
retried on its own: the rest of the object is not sent again.

What is transient is decided by the backend's ``classify(exc)``, which returns one of
``TRANSIENT`` (throttling, 500/502/503/504, connection reset, timeouts, truncated bodies),
``EXPIRED`` (the credentials expired: refresh them through the ``credential_provider`` hook and
retry at once) or ``PERMANENT`` (403, 404, 412 and every other client error: raised immediately).
:func:`classify_common` handles the errors every HTTP client shares.

When retries run out, the error is a :class:`~ckptio.errors.TransferError` that names the URI,
the part and the attempt count, with the last client error as its ``__cause__``.

Backend options (settings ``[backends.s3]``, ``[aliases.NAME.options]``, or keywords):
``max_attempts`` (or ``retries`` = attempts - 1), ``deadline``, ``timeout``, ``stall_timeout``,
``credential_provider`` (a callable or ``"module:function"``).
"""

from __future__ import annotations

import asyncio
import errno
import http.client
import importlib
import math
import random
import socket
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ..errors import CkptioError, SettingsError, TransferError, logger
from .waiting import retrying

log = logger("ckptio.retry")

TRANSIENT, EXPIRED, PERMANENT = "transient", "expired", "permanent"
RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
THROTTLE_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "TooManyRequestsException",
        "ProvisionedThroughputExceededException",
        "RequestThrottled",
        "ServiceUnavailable",
        "InternalError",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "BandwidthLimitExceeded",
        "EC2ThrottledException",
    }
)
# the body S3 received does not match the checksum sent with it (CRC32 / SigV4 payload hash): damaged on the
# way, so the part is sent again from memory that still matches the checksum (computed once, before sending)
DAMAGED_CODES = frozenset({"BadDigest", "XAmzContentSHA256Mismatch", "XAmzContentChecksumMismatch"})  # last: MinIO
EXPIRED_CODES = frozenset({"ExpiredToken", "ExpiredTokenException", "RequestExpired", "TokenRefreshRequired"})


class TruncatedBodyError(ConnectionError):
    """The server sent fewer bytes than it announced (Content-Length / Content-Range)."""


class StalledError(TimeoutError):
    """No bytes moved for ``stall_timeout`` seconds."""


def classify_common(exc: BaseException) -> str | None:
    """The classification of errors shared by all HTTP clients, or None if this is not one of them."""
    if isinstance(exc, CkptioError):
        return PERMANENT
    if isinstance(
        exc,
        (
            TruncatedBodyError,
            StalledError,
            asyncio.TimeoutError,
            TimeoutError,
            socket.timeout,
            ConnectionError,
            http.client.IncompleteRead,
        ),
    ):
        return TRANSIENT
    if isinstance(exc, OSError) and exc.errno in (
        errno.ECONNRESET,
        errno.ECONNABORTED,
        errno.ECONNREFUSED,
        errno.EPIPE,
        errno.ETIMEDOUT,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.ENETRESET,
    ):
        return TRANSIENT
    return None


def classify_status(status: int | None, code: str = "") -> str:
    """HTTP status plus (for S3) the error code -> TRANSIENT / EXPIRED / PERMANENT."""
    if code in EXPIRED_CODES:
        return EXPIRED
    if code in THROTTLE_CODES or code in DAMAGED_CODES or (status is not None and status in RETRY_STATUS):
        return TRANSIENT
    return PERMANENT


def load_provider(spec: Any) -> Callable[[], Any] | None:
    """``credential_provider``: a callable, or ``"package.module:function"`` naming one."""
    if spec is None or callable(spec):
        return spec
    if not isinstance(spec, str) or ":" not in spec:
        raise SettingsError(f"credential_provider: expected a callable or 'module:function', got {type(spec).__name__}")
    mod, _, attr = spec.partition(":")
    try:
        fn: Any = importlib.import_module(mod)
        for part in attr.split("."):
            fn = getattr(fn, part)
    except (ImportError, AttributeError) as e:
        raise SettingsError(f"credential_provider {spec!r} cannot be loaded: {type(e).__name__}: {e}") from None
    if not callable(fn):
        raise SettingsError(f"credential_provider {spec!r} is not callable")
    return fn


@dataclass(frozen=True)
class RetryPolicy:
    """How one request is retried. ``deadline`` bounds all attempts of one request together."""

    max_attempts: int = 5
    deadline: float = 600.0
    timeout: float | None = None  # per attempt; None: only the deadline bounds an attempt
    stall_timeout: float = 60.0
    base_delay: float = 0.1
    max_delay: float = 10.0

    def __post_init__(self) -> None:
        if int(self.max_attempts) < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts!r}")
        for name in ("deadline", "stall_timeout", "base_delay", "max_delay"):
            if not float(getattr(self, name)) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.timeout is not None and not float(self.timeout) > 0:
            raise ValueError(f"timeout must be > 0, got {self.timeout!r}")

    @classmethod
    def from_options(
        cls,
        *,
        retries: int | None = None,
        max_attempts: int | None = None,
        deadline: float | None = None,
        timeout: float | None = None,
        stall_timeout: float | None = None,
        **defaults: Any,
    ) -> RetryPolicy:
        """Build from backend options; ``max_attempts`` wins over ``retries`` (= attempts - 1)."""
        if retries is not None and int(retries) < 0:
            raise ValueError(f"retries must be >= 0, got {retries!r}")
        kw: dict[str, Any] = dict(defaults)
        if max_attempts is not None:
            kw["max_attempts"] = int(max_attempts)
        elif retries is not None:
            kw["max_attempts"] = int(retries) + 1
        if deadline is not None:
            kw["deadline"] = float(deadline)
        if timeout is not None:
            kw["timeout"] = float(timeout)
        if stall_timeout is not None:
            kw["stall_timeout"] = float(stall_timeout)
        return cls(**kw)

    def backoff(self, attempt: int) -> float:
        """Full jitter: uniform in [0, min(max_delay, base_delay * 2**attempt)]."""
        return random.uniform(0, min(self.max_delay, self.base_delay * 2**attempt))

    async def run(
        self,
        fn: Callable[[], Awaitable[Any]],
        *,
        uri: str,
        what: str,
        classify: Callable[[BaseException], str],
        describe: Callable[[BaseException], str],
        refresh: CredentialRefresher | None = None,
        on_retry: Callable[[BaseException], Awaitable[None]] | None = None,
        after: PriorAttempt | None = None,
        where: Any = None,
    ) -> Any:
        """Await ``fn()`` until it succeeds, a permanent error occurs, or attempts/deadline run out.

        ``after``: an attempt made elsewhere (a caller's thread) that failed; it is this request's first
        attempt (counted, classified and retried as one, the deadline running from when it began).

        ``refresh`` is awaited on EXPIRED errors; it returns False when no provider is configured
        (the error is then raised as it is). ``on_retry(exc)`` runs before each retry
        (e.g. to find out how much of an upload chunk the server kept). ``describe(exc)`` is the
        backend's one-line description of a client error (never containing credentials). ``where``: the
        backend, for the warning a retry logs (:mod:`.waiting`)."""
        start = time.monotonic() if after is None else after.started
        failed = after.take() if after is not None else None
        attempt = 0
        refreshed = 0
        me = asyncio.current_task()
        # Python 3.11+ counts cancellations. Held weakly: the task holds the error that leaves this frame,
        # whose traceback holds this frame (a local of the task would be a reference cycle)
        task = weakref.ref(me) if me is not None and hasattr(me, "cancelling") else None
        cancels = _cancelling(task) if task is not None else 0
        me = None
        first = ""  # the first failure's description: a different last one must not hide it
        while True:
            attempt += 1
            remaining = self.deadline - (time.monotonic() - start)
            limit = remaining if self.timeout is None else min(self.timeout, remaining)
            gen = refresh.generation if refresh is not None else 0
            try:
                if failed is not None:
                    e, failed = failed, None
                    raise e
                if limit <= 0:
                    raise asyncio.TimeoutError()
                return await within(fn(), limit)
            except asyncio.CancelledError:
                raise
            except BaseException as e:
                if task is not None and _cancelling(task) > cancels:
                    # cancelled from outside while the request turned that into an error of its own: the
                    # cancellation is the outcome, never a retry
                    raise asyncio.CancelledError() from e
                if type(e) is asyncio.TimeoutError:  # this attempt's time ran out (a client's own timeouts say theirs)
                    e = StalledError(f"no response within {limit:.3g}s") if limit > 0 else e
                kind = classify(e)
                elapsed = time.monotonic() - start
                if kind == EXPIRED and refresh is not None and refreshed < 2 and await refresh(gen):
                    refreshed += 1
                    attempt -= 1  # a refresh is not a failed attempt
                    log.info("credentials expired for %s (%s); refreshed, retrying", uri, what)
                    continue
                if kind != TRANSIENT:
                    raise
                out_of_time = elapsed + 0.001 >= self.deadline
                said = describe(e)
                first = first or said
                if attempt >= self.max_attempts or out_of_time:
                    why = (
                        f"deadline of {self.deadline:g}s exceeded"
                        if out_of_time
                        else f"gave up after {attempt} attempt(s) in {elapsed:.1f}s"
                    )
                    code = errno.ETIMEDOUT if isinstance(e, TimeoutError) or out_of_time else errno.EIO
                    errors = f"last error: {said}" + (f"; first error: {first}" if first != said else "")
                    err = TransferError(code, f"{what} of {uri} failed: {why}; {errors}", uri)
                    err.attempts = attempt
                    try:
                        raise err from e
                    finally:  # the error's traceback holds this frame: no reference cycle through it
                        del err
                delay = min(self.backoff(attempt - 1), max(0.0, self.deadline - elapsed))
                log.warning("%s", retrying(self, what, uri, said, attempt, elapsed, delay, where))
                await asyncio.sleep(delay)
                if on_retry is not None:
                    await on_retry(e)


def _cancelling(task: weakref.ref) -> int:
    t = task()
    return t.cancelling() if t is not None else 0


def _call(task: weakref.ref, method: str) -> None:
    t = task()
    if t is not None:
        getattr(t, method)()


class PriorAttempt:
    """An attempt of a request made before :meth:`RetryPolicy.run` (from a caller's thread) that failed:
    its error, which ``run`` takes once (so that no frame the error then passes through holds it: no
    reference cycle), and the ``time.monotonic()`` it began."""

    __slots__ = ("_error", "started")

    def __init__(self, error: BaseException, started: float) -> None:
        self._error: BaseException | None = error
        self.started = started

    def take(self) -> BaseException | None:
        error, self._error = self._error, None
        return error


async def settle(*tasks: asyncio.Future) -> None:
    """Wait until every one of ``tasks`` is done, however often the waiting task is cancelled meanwhile
    (each cancellation is passed on to those still running, and raised once they have all ended): an
    attempt's buffers are the caller's until it has ended. Their exceptions are retrieved (the caller
    reads them from the tasks)."""
    cancelled = False
    while True:
        running = [t for t in tasks if not t.done()]
        if not running:
            break
        try:
            await asyncio.wait(running)
        except asyncio.CancelledError:
            cancelled = True
            for t in running:
                t.cancel()
    for t in tasks:
        if not t.cancelled():
            t.exception()
    if cancelled:
        raise asyncio.CancelledError()


async def within(coro: Awaitable[Any], limit: float) -> Any:
    """``asyncio.wait_for(coro, limit)`` that never returns (timed out or cancelled) before ``coro``
    has ended; ``asyncio.wait_for`` of Python 3.11 returns when cancelled while it cancels ``coro``.

    Where tasks count cancellations (Python 3.11+), ``coro`` runs in the caller's task, not in a task of
    its own: a request costs no task and no ``asyncio.wait``. Its timer cancels the task as
    ``asyncio.timeout`` does, except while someone else is cancelling it: a request cancelled from
    outside then cleans up untimed, as it did in a task of its own."""
    me = asyncio.current_task()
    if me is None or not hasattr(me, "cancelling"):
        return await _within_task(coro, limit)
    base, fired = me.cancelling(), False
    task = weakref.ref(me)  # weakly, as in RetryPolicy.run: the task holds the error leaving this frame
    me = None

    def expire() -> None:
        nonlocal fired
        if _cancelling(task) == base:  # not already being cancelled (its request cleaning up)
            fired = True
            _call(task, "cancel")

    timer = None if math.isinf(limit) else asyncio.get_running_loop().call_later(max(0.0, limit), expire)
    try:
        return await coro
    except asyncio.CancelledError:
        if fired and _cancelling(task) == base + 1:  # this timer's cancellation alone: timed out
            raise asyncio.TimeoutError() from None
        raise
    finally:
        if timer is not None:
            timer.cancel()
        if fired:
            _call(task, "uncancel")  # Python 3.11+, as cancelling() (checked above)


async def _within_task(coro: Awaitable[Any], limit: float) -> Any:
    """:func:`within` in a task of its own (Python 3.10)."""
    task = asyncio.ensure_future(coro)
    try:
        done, _ = await asyncio.wait([task], timeout=limit)
    except asyncio.CancelledError:
        task.cancel()
        await settle(task)
        raise
    if not done:
        task.cancel()
        await settle(task)
        if task.cancelled():
            raise asyncio.TimeoutError()
    return task.result()


class CredentialRefresher:
    """Calls ``provider`` at most once per expiry, however many requests see the error at once.

    ``apply(credentials)`` installs what the provider returned (on the backend's client).
    The returned credentials are never logged or shown.
    """

    def __init__(self, provider: Callable[[], Any] | None, apply: Callable[[Any], Awaitable[None]]) -> None:
        self.provider = provider
        self._apply = apply
        self._lock: asyncio.Lock | None = None
        self.generation = 0

    def __repr__(self) -> str:
        return f"<CredentialRefresher generation={self.generation}>"

    async def __call__(self, seen: int) -> bool:
        if self.provider is None:
            return False
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self.generation == seen:
                creds = self.provider()
                if asyncio.iscoroutine(creds):
                    creds = await creds
                await self._apply(creds)
                self.generation += 1
        return True


_timeout = getattr(asyncio, "timeout", None)  # Python 3.11+


async def stall_guard(read: Awaitable[Any], stall_timeout: float) -> Any:
    """Await one read of a body; :class:`StalledError` if no bytes arrive for ``stall_timeout`` seconds (in
    the caller's task on Python 3.11+, as :func:`within`: ``asyncio.wait_for`` of 3.11 makes a task a read)."""
    try:
        if _timeout is not None:
            async with _timeout(stall_timeout):
                return await read
        return await asyncio.wait_for(read, stall_timeout)
    except asyncio.TimeoutError:
        raise StalledError(f"no bytes received for {stall_timeout:g}s") from None


class StallWatch:
    """A stall timer over one body's reads: ``async with StallWatch(t) as watch: n = await watch(read)``.

    :class:`StalledError` if no read completes for ``t`` seconds. On Python 3.11+ one timer is moved
    forward after each read (a body arrives in many small chunks; ``asyncio.wait_for`` would create
    a task per chunk); on 3.10 each read is guarded by :func:`stall_guard`."""

    def __init__(self, stall_timeout: float) -> None:
        self.stall_timeout = stall_timeout
        self._cm: Any = None

    async def __aenter__(self) -> StallWatch:
        if _timeout is not None:
            self._cm = _timeout(self.stall_timeout)
            await self._cm.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        cm, self._cm = self._cm, None  # it holds the task, which holds the error leaving here: no reference cycle
        if cm is not None:
            try:
                await cm.__aexit__(*exc)
            except TimeoutError:
                raise StalledError(f"no bytes received for {self.stall_timeout:g}s") from None
            finally:
                cm = None

    async def __call__(self, read: Awaitable[Any]) -> Any:
        if self._cm is None:
            return await stall_guard(read, self.stall_timeout)
        out = await read
        self._cm.reschedule(asyncio.get_running_loop().time() + self.stall_timeout)
        return out


class SuffixIgnoredError(TransferError):
    """A suffix range (``Range: bytes=-N``) answered 200 with the whole object, larger than ``N`` bytes:
    the server ignored the header. ``size``: the object's size, from the reply's length."""

    def __init__(self, uri: str, n: int | str = 0, size: int | None = None) -> None:
        super().__init__(errno.EIO, f"read of the last {n} bytes of {uri}: the server ignored the suffix range", uri)
        self.size = size


def check_suffix_status(
    status: int | None, n: int, size: int | None, uri: str, content_range: str | None = None
) -> None:
    """A suffix range of ``n`` bytes answered 200 is the whole object: the last ``n`` bytes only if the
    object has no more (``size``, from the reply); else :class:`SuffixIgnoredError`. Answered 206, its
    ``Content-Range`` must be the object's last ``min(n, size)`` bytes (a TransferError otherwise)."""
    if status == 200 and (size is None or size > n):
        raise SuffixIgnoredError(uri, n, size)
    if status == 206 and size is not None:
        span = (content_range or "")[6:].partition("/")[0] if (content_range or "").startswith("bytes ") else ""
        first, _, last = span.partition("-")
        if not (first.isdigit() and last.isdigit()) or (int(first), int(last)) != (size - min(n, size), size - 1):
            raise TransferError(
                errno.EIO, f"read of the last {n} bytes of {uri}: the server answered bytes {span!r} of {size}", uri
            )


def check_ranged_status(status: int | None, start: int, uri: str) -> None:
    """A ranged GET from ``start`` > 0 answered 200 (not 206) carries the object from byte 0: the
    server ignored ``Range``. Raise instead of handing those bytes back as if they were the range."""
    if status == 200 and start > 0:
        raise TransferError(
            errno.EIO,
            f"ranged read of {uri} from byte {start} failed: the server ignored the "
            "Range header (HTTP 200 with the object from byte 0); use a server that supports "
            "ranged GETs",
            uri,
        )


def object_size(status: int | None, content_range: str | None, content_length: str | None) -> int | None:
    """The whole object's size from a GET's headers (``Content-Range: bytes a-b/SIZE``, or the length
    of a 200 reply), or None where they do not say."""
    if content_range and "/" in content_range:
        total = content_range.rpartition("/")[2].strip()
        return int(total) if total.isdigit() else None
    if status == 200 and content_length and content_length.isdigit():
        return int(content_length)
    return None


def check_range(view_len: int, got: int, content_range: str | None, content_length: str | None) -> None:
    """Raise :class:`TruncatedBodyError` when a ranged body ended before the bytes its headers announced."""
    expected = None
    if content_range and content_range.startswith("bytes ") and "-" in content_range:
        try:
            span, _, total = content_range[6:].partition("/")
            s, _, e = span.partition("-")
            expected = int(e) - int(s) + 1
            if total not in ("*", "") and int(e) + 1 < int(total) and expected < view_len:
                raise TruncatedBodyError(
                    f"server returned bytes {span} of {total}, fewer than the {view_len} asked for"
                )
        except ValueError:
            expected = None
    if expected is None and content_length and content_length.isdigit():
        expected = int(content_length)
    if expected is not None and got < min(expected, view_len):
        raise TruncatedBodyError(f"response body ended after {got} of {min(expected, view_len)} bytes")
