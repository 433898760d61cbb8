"""What the object-store backends (S3, GCS) share: URIs, the retry and transfer options, reads,
``stat``, paged ``list`` and ``with_options``.

A store subclass supplies ``_loop`` (the client's IO loop), ``translate``, ``classify`` and a few
request hooks: :meth:`~ObjectStoreBackend._get_range` (one ranged GET into memory),
:meth:`~ObjectStoreBackend._head` and :meth:`~ObjectStoreBackend._list_page`; plus its writer,
``delete`` and ``close``. Reads split into ``part_size`` ranges, ``concurrency`` at a time
(see :mod:`.ranged`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import functools
import json
import re
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

from .. import uri as _uri
from ..backends.base import SMALL_OBJECT, Backend, Buffer, ObjectInfo, start_sized
from ..errors import IntegrityError, InvalidURIError, MissingDependencyError, NotFoundError, replaced
from ..osio import anonymous, bytes_of, fresh_bytes, zero
from ..threads import Pool, shared_pool
from . import here as _here
from . import retry as _retry
from .multipart import size_option
from .names import S3, Rule
from .pinned import PinnedReads, hook_takes, range_of
from .ranged import VersionPin, parallel_readv, run, start
from .replies import whole

# one object of a listing page: key, size, mtime, version token
Entry = tuple[str, int, "float | None", "str | None"]


def check_versions(extra: str, minimums: Mapping[str, str]) -> None:
    """Refuse client libraries older than ``minimums`` (distribution -> oldest release that works,
    the floors of the ``extra`` in pyproject.toml), naming the package and the version needed."""
    from importlib import metadata

    for dist, minimum in minimums.items():
        try:
            found = metadata.version(dist)
        except metadata.PackageNotFoundError:  # imported without installed metadata: nothing to compare
            continue
        if _release(found) < _release(minimum):
            raise MissingDependencyError(
                f"ckptio's {extra} backend needs {dist}>={minimum}, but {dist} {found} is "
                f"installed; run: pip install -U 'ckptio[{extra}]'"
            )


def _release(version: str) -> tuple[int, ...]:
    """``"2025.2.0.post1"`` -> ``(2025, 2)``: the release numbers without trailing zeros."""
    m = re.match(r"\d+(?:\.\d+)*", version)
    parts = [int(p) for p in m.group(0).split(".")] if m else []
    while parts and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


class ObjectStoreBackend(Backend):
    """Base of the backends over a bucket/key store reached through an asyncio client."""

    scheme: ClassVar[str] = ""  # the default URI scheme, for messages and listings
    _options: dict[str, Any]  # the constructor's arguments, set by the subclass (see with_options)
    naming: ClassVar[Rule] = S3  # the store's bucket and object names (:mod:`.names`)
    _raw_errors: ClassVar[tuple[type[BaseException], ...]] = (_retry.TruncatedBodyError, _retry.StalledError)
    # the store answers a suffix range ("Range: bytes=-N") with the object's last N bytes, so
    # start_read_tail needs no size (a server that ignores it is caught, and read again by offset)
    suffix_reads = False

    def __init__(
        self,
        *,
        part_size: int,
        concurrency: int,
        retries: int | None,
        max_attempts: int | None,
        deadline: float | None,
        timeout: float | None,
        stall_timeout: float | None,
        read_timeout: float,
        credential_provider: Any,
        max_buffer_bytes: int | str,
    ) -> None:
        super().__init__(part_size=size_option("part_size", part_size), concurrency=concurrency)
        self.max_buffer_bytes = size_option("max_buffer_bytes", max_buffer_bytes)
        self.policy = _retry.RetryPolicy.from_options(
            retries=retries,
            max_attempts=max_attempts,
            deadline=deadline,
            timeout=timeout,
            stall_timeout=stall_timeout if stall_timeout is not None else read_timeout,
        )
        self.retries = self.policy.max_attempts - 1
        self._refresher = _retry.CredentialRefresher(_retry.load_provider(credential_provider), self._apply_credentials)
        self._derived: dict[str, Backend] = {}  # with_options' backends, by options
        self._derive_lock = threading.Lock()

    def with_options(self, **options: Any) -> Backend:
        """This store with the same settings and ``options`` changed (self when nothing changes).
        A derived backend is made once per set of options and kept (a DCP save that tunes its
        buffers reuses the warm client of the previous save); :meth:`close` closes them too."""
        if all(getattr(self, k, object()) == v for k, v in options.items()):
            return self
        unknown = sorted(set(options) - set(self._options))
        if unknown:
            raise ValueError(f"{self!r} has no option(s) {unknown}")
        key = json.dumps(options, sort_keys=True, default=repr)
        with self._derive_lock:
            derived = self._derived.get(key)
            if derived is None:
                derived = self._derived[key] = type(self)(**{**self._options, **options})
                derived.name = self.name
        return derived

    def close(self) -> None:
        """Close the backends :meth:`with_options` derived, then this one's clients (:meth:`close_clients`)."""
        with self._derive_lock:
            derived, self._derived = list(self._derived.values()), {}
        for b in derived:
            b.close()
        self.close_clients()

    def close_clients(self) -> None:
        """Close this backend's own connection pools (a subclass hook; must not raise on dead pools)."""

    # ---- hooks -------------------------------------------------------------------------------
    @property
    def _loop(self) -> asyncio.AbstractEventLoop:
        raise NotImplementedError

    @staticmethod
    def classify(e: BaseException) -> str:
        """TRANSIENT / EXPIRED / PERMANENT for an error of this store's client (see :mod:`ckptio.objectstore.retry`)."""
        raise NotImplementedError

    def translate(self, e: BaseException, uri: str) -> BaseException:
        """A ckptio error naming ``uri`` for any client error (the client's error is the ``__cause__``)."""
        raise NotImplementedError

    async def _apply_credentials(self, creds: Any) -> None:
        """Use what ``credential_provider`` returned for the next requests."""
        raise NotImplementedError

    async def _get_range(
        self,
        uri: str,
        bucket: str,
        key: str,
        start: int,
        end: int,
        into: list[memoryview],
        on_size: Callable[[int], None] | None = None,
        pin: VersionPin | None = None,
    ) -> int:
        """Read bytes ``[start, end)`` into the consecutive buffers ``into`` (one request, the body
        streamed through them in order) under the retry policy; the count (0 past the end).
        ``on_size(size)``: called with the whole object's size when the reply's headers tell it.
        ``pin``: the reply's version (ETag, generation) goes through ``pin.check`` before the body is
        read; a pinned version is sent as a precondition where the store has one. A class whose hook
        calls ``on_size`` before it writes any byte and reads the list ``into`` only after (its items
        may be replaced then) names that very function ``_sized_get_range``: :meth:`read` then streams
        the first body straight into the bytes it returns (a subclass's own ``_get_range``, even one
        wrapping it, is another function: its reads are staged)."""
        raise NotImplementedError

    def _head(self, uri: str, bucket: str, key: str) -> ObjectInfo:
        """The object ``key`` as ``uri`` (NotFoundError if missing)."""
        raise NotImplementedError

    def _list_page(
        self, uri: str, bucket: str, prefix: str, *, delimiter: bool, token: str | None, limit: int | None = None
    ) -> tuple[list[Entry], list[str], str | None]:
        """One page of keys under ``prefix``: objects, common prefixes (with ``delimiter``) and the
        token of the next page (None: last page)."""
        raise NotImplementedError

    # ---- plumbing ----------------------------------------------------------------------------
    def _split(self, uri: str, *, key_required: bool = True) -> tuple[str, str]:
        bucket, key = _uri.bucket_key(uri)
        self.naming.check(uri, bucket, key)
        if key_required and not key.strip("/"):
            raise InvalidURIError(f"URI names a bucket, not an object: {uri!r} (expected {self.scheme}://BUCKET/KEY)")
        return bucket, key

    def describe(self, e: BaseException, uri: str) -> str:
        if isinstance(e, self._raw_errors):
            return f"{type(e).__name__}: {e}"
        t = self.translate(e, uri)
        return t.strerror if isinstance(t, OSError) and t.strerror else str(t)

    async def _retrying(
        self,
        uri: str,
        what: str,
        fn: Callable[[], Awaitable[Any]],
        on_retry: Callable[[BaseException], Awaitable[None]] | None = None,
        after: _retry.PriorAttempt | None = None,
    ) -> Any:
        """``fn()`` (one request) under the retry policy (``after``: see ``RetryPolicy.run``)."""
        return await self.policy.run(
            fn,
            uri=uri,
            what=what,
            classify=self.classify,
            describe=lambda e: self.describe(e, uri),
            refresh=self._refresher,
            on_retry=on_retry,
            after=after,
            where=self,
        )

    def _run(self, uri: str, coro_fn: Callable[[], Awaitable[Any]]) -> Any:
        """Run ``coro_fn()`` on the IO loop; its errors come out translated."""
        try:
            return run(self._loop, coro_fn)
        except Exception as e:
            raise self.translate(e, uri) from None

    # ---- reads -------------------------------------------------------------------------------
    def readinto(self, uri: str, buf: Buffer, offset: int = 0, *, pin: VersionPin | None = None) -> int:
        return self.readv(uri, [memoryview(buf)], offset, pin=pin)

    def readv(self, uri: str, views: Sequence[memoryview], offset: int = 0, *, pin: VersionPin | None = None) -> int:
        """One ranged request per ``part_size`` bytes, each streamed through the buffers it spans; all
        of them from one version of the object (``pin``'s, or the first reply's)."""
        bucket, key = self._split(uri)
        mvs = [memoryview(v).cast("B") for v in views]
        one = pin if pin is not None else VersionPin()  # one call, one version

        async def go() -> int:
            if hook_takes(type(self)._get_range, "pin"):
                fetch = functools.partial(self._get_range, uri, bucket, key, pin=one)
            else:  # a subclass's hook from before pins existed
                fetch = functools.partial(self._get_range, uri, bucket, key)
            return await parallel_readv(fetch, mvs, offset, self.part_size, self.concurrency)

        n, want = self._run(uri, go), sum(len(m) for m in mvs)
        if n < want:  # the end of the object, or no such object (NotFoundError): as its metadata says
            whole(uri, n, min(self.stat(uri).size, offset + want), offset)
        return n

    def read_head(self, uri: str, buf: Buffer, on_size: Callable[[int], None], *, pin: VersionPin | None = None) -> int:
        """One ranged GET from byte 0; the object's size is taken from its reply's headers (no HEAD),
        and told as soon as they arrive, while the body is still coming."""
        if not hook_takes(type(self)._get_range, "on_size"):  # a subclass's hook from before on_size existed
            return super().read_head(uri, buf, on_size)
        return self._get_head(uri, buf, on_size, pin).result()

    def start_read_head(
        self, uri: str, buf: Buffer, on_size: Callable[[int], None], *, pin: VersionPin | None = None
    ) -> cf.Future[int]:
        """:meth:`read_head`'s GET started on the IO loop from the caller's thread, with no pool thread
        waiting on it in between (on a 2-core machine each hand-off between threads costs a few tenths of
        a millisecond, on the scale of a small object's whole GET). ``on_size`` runs on the IO loop."""
        cls = type(self)
        if hook_takes(cls._get_range, "on_size") and cls.read_head is ObjectStoreBackend.read_head:
            return self._get_head(uri, buf, on_size, pin)
        # a subclass's hooks from before this existed: its read_head on the shared pool, with the pin it takes
        kw = {"pin": pin} if pin is not None and hook_takes(cls.read_head, "pin") else {}
        return shared_pool().submit(self.read_head, uri, buf, on_size, **kw)

    def start_read_tail(
        self, uri: str, buf: Buffer, align: int = 1, *, pin: VersionPin | None = None
    ) -> cf.Future[int] | None:
        """:meth:`Backend.start_read_tail`: one suffix-range GET on the IO loop, where the class says the
        store has them (``suffix_reads``) and its hook tells the size before it writes a byte
        (``_sized_get_range``: the bytes' place in ``buf`` follows from the size); else None. A server that
        answers with the whole object (200) has its body dropped and the range read again by offset (the
        reply told the size); one that refuses the range or answers another has the future fail (the
        caller reads by offset); either way this backend asks for no more suffixes. The request's views
        keep ``buf`` alive: a caller that does not use the bytes need not wait for it."""
        cls = type(self)
        mv = memoryview(buf).cast("B")
        room = len(mv) - max(1, align) + 1
        if not self.suffix_reads or room <= 0 or cls._get_range is not getattr(cls, "_sized_get_range", None):
            return None
        bucket, key = self._split(uri)
        into: list[memoryview] = []
        fut: cf.Future[int] = cf.Future()
        fut.set_running_or_notify_cancel()

        def place(size: int) -> memoryview:
            n = min(room, size)
            p = (size - n) % max(1, align)
            return mv[p : p + n]

        def on_size(size: int) -> None:
            into[:] = [place(size)]  # before the body: the hook reads the list after it calls this

        async def go() -> None:
            try:
                try:
                    n = await self._get_range(uri, bucket, key, -room, 0, into, on_size=on_size, pin=pin)
                    if not into:  # no size in the reply: where its bytes belong is unknown
                        raise _retry.SuffixIgnoredError(uri, room, None)
                except _retry.SuffixIgnoredError as e:
                    if e.size is None:
                        raise
                    self.suffix_reads = False  # this instance: the server ignores them
                    view = place(e.size)
                    n = await self._get_range(uri, bucket, key, e.size - len(view), e.size, [view], pin=pin)
            except BaseException as e:
                out = self.translate(e, uri) if isinstance(e, Exception) else e
                if out is not e:
                    out.__suppress_context__ = True
                refused = isinstance(e, Exception) and self.classify(e) == _retry.PERMANENT
                if refused and not isinstance(out, (NotFoundError, IntegrityError)):
                    self.suffix_reads = False  # refused or answered wrong (400, 501, another range): no more
                fut.set_exception(out)
                if not isinstance(e, Exception):
                    raise
                return
            fut.set_result(n)

        start(self._loop, go())
        return fut

    def _get_head(
        self,
        uri: str,
        buf: Buffer,
        on_size: Callable[[int], None],
        pin: VersionPin | None,
        dest: Callable[[int], memoryview] | None = None,
    ) -> cf.Future[int]:
        """The GET of ``buf``'s length from byte 0, started on the IO loop: a future that cannot be
        cancelled (a reader that closes waits for the buffer it fills). ``on_size`` is called once, before
        it is done: from the reply's headers, or where they do not tell (an empty object, which S3 answers
        with 416; a buffer of 0 bytes) from a ``stat`` on a thread of its own, never on the shared pool,
        whose tasks may be waiting on this very future. A missing object is a NotFoundError.

        ``dest(size)``: where the body goes instead of ``buf`` (at most as long), chosen on the IO loop when
        the reply's headers tell the size, before any byte of the body is written (only with a hook that
        reads its buffer list after ``on_size``: :meth:`_reads_straight`). A reply that does not tell the
        size fills ``buf``. A retried GET whose reply tells another size than the first is an
        IntegrityError (the object changed; the size told, and any buffer made for it, would be wrong)."""
        bucket, key = self._split(uri)
        mv = memoryview(buf).cast("B")
        into = [mv]
        told: list[int] = []
        extra = {"pin": pin} if pin is not None and hook_takes(type(self)._get_range, "pin") else {}
        fut: cf.Future[int] = cf.Future()
        fut.set_running_or_notify_cancel()

        def tell(size: int) -> None:
            if not told:  # once, whatever the retries
                told.append(size)
                on_size(size)

        def told_by_reply(size: int) -> None:
            if told and size != told[0]:  # a retry's reply: the object changed (a pin may not tell)
                raise replaced(uri, f"of {told[0]} bytes", f"of {size} bytes")
            if dest is not None and not told:
                into[0] = dest(size)  # the same list: a retry streams into it too
            tell(size)

        def fail(e: BaseException) -> None:
            out = self.translate(e, uri) if isinstance(e, Exception) else e
            if out is not e:
                out.__suppress_context__ = True
            fut.set_exception(out)

        def told_by_stat(n: int) -> None:  # off the loop: stat waits on it
            try:
                tell(self.stat(uri).size)
            except BaseException as e:
                fail(e)
            else:
                fut.set_result(n)

        def settle(n: int) -> None:
            if told:
                fut.set_result(n)
            else:
                lookup = Pool(1, thread_name_prefix="ckptio-size")
                lookup.submit(told_by_stat, n)
                lookup.shutdown(wait=False)

        async def go(**after: Any) -> None:
            try:
                n = 0
                if mv:
                    n = await self._get_range(
                        uri, bucket, key, 0, len(mv), into, on_size=told_by_reply, **extra, **after
                    )
            except BaseException as e:
                # the error's traceback starts at this frame, which holds ``fut``: without it, ``fut``'s error
                # does not hold ``fut`` (a reference cycle keeping the caller's frames until the gc runs)
                e.__traceback__ = e.__traceback__.tb_next if e.__traceback__ is not None else None
                fail(e)
                if not isinstance(e, Exception):
                    raise
                return
            settle(n)

        here = self._head_here(uri, bucket, key, into, told_by_reply, pin) if mv else None
        if here is None:
            start(self._loop, go())
        else:
            _here.finish(here, len(mv), told, settle, lambda after: start(self._loop, go(after=after)), fail)
        return fut

    def _head_here(
        self,
        uri: str,
        bucket: str,
        key: str,
        into: list[memoryview],
        on_size: Callable[[int], None],
        pin: VersionPin | None,
    ) -> _here.HeadHere | None:
        """A subclass hook: :meth:`_get_head`'s GET (``len(into[0])`` bytes from byte 0) sent from the
        caller's thread, its reply's headers read there and ``on_size`` told (see :mod:`.here`). None: not
        sent (the GET goes to the IO loop as usual)."""
        return None

    def pin_version(self, uri: str, version: str | None = None) -> Backend:
        return PinnedReads(self, uri, version)

    def read_range(self, uri: str, start: int = 0, end: int | None = None) -> bytes:
        if end is None:  # the size and the bytes of one version
            return self.pin_version(uri).read_range(uri, start, end)
        return range_of(self, uri, start, end)

    def read(self, uri: str) -> bytes:
        """The whole object, straight into the bytes returned: its first GET (up to ``SMALL_OBJECT``
        bytes; a small object whole) tells the size with its headers, no HEAD first, and its body streams
        into a new ``bytes`` of that size (``osio.fresh_bytes``); a larger object's other ranges are
        fetched into the rest while that first body is still coming, from the same version. No copy out
        of a staging buffer, at any size. (A reply that does not tell the size, or a subclass's own read
        hooks: the first body is staged and copied.)"""
        self._split(uri)
        reads = self.pin_version(uri)
        head = anonymous(min(SMALL_OBJECT, self.part_size))  # the first body, where it cannot go straight
        k = len(head)
        sized: list[tuple[bytes, memoryview]] = []  # made on the IO loop when the headers tell the size
        lock, gave_up = threading.Lock(), [False]

        def dest(size: int) -> memoryview:
            with lock:
                if gave_up[0]:  # the caller is gone: nothing allocated that nobody fills and zeroes
                    return head[: min(size, k)]
                out, view = fresh_bytes(size)  # the view keeps ``out`` alive: requests still in flight
                sized.append((out, view))  # after an interrupt (Ctrl-C in a wait) write into live memory
                return view[:k]

        def give_up() -> None:  # no stale heap bytes in a traceback's locals, whatever interrupts a wait
            with lock:
                gave_up[0] = True
                for _, view in sized:
                    zero(view)
                sized.clear()

        straight = self._reads_straight(reads)
        first: cf.Future[int] | None = None
        try:
            if straight:
                pin = reads._pin  # type: ignore[attr-defined]  # _reads_straight: a PinnedReads
                first, size = start_sized(reads, uri, head, start=lambda on: self._get_head(uri, head, on, pin, dest))
            else:
                first, size = start_sized(reads, uri, head)
            staged = not sized  # dest runs before the first byte of the body, or never: the body is in ``head``
            if staged:
                if size <= k:
                    return bytes(head[: whole(uri, first.result(), size)])
                with lock:
                    sized.append(fresh_bytes(size))
            out, view = sized[0]
            got = reads.readinto(uri, view[k:], k) if size > k else 0
            n = first.result()
            if staged:
                view[:n] = head[:n]
            return bytes_of(out, view, whole(uri, n if n < k else k + got, size))
        except BaseException:
            give_up()  # ``out`` and ``view``, if this frame holds them, are zeroed with the rest
            if first is not None:  # it fills ``head`` (or the bytes, alive while it does) until it ends
                cf.wait([first])
                first = None  # its error's traceback holds this frame: no reference cycle through it
            raise

    def _reads_straight(self, reads: Backend) -> bool:
        """Whether :meth:`read` may have the first body streamed straight into the bytes it returns: this
        package's own read hooks (their buffer list is read after the size is told; a subclass's own
        ``_get_range``, ``read_head`` or ``pin_version`` gets the staged read)."""
        cls = type(self)
        return (
            isinstance(reads, PinnedReads)
            and cls._get_range is getattr(cls, "_sized_get_range", None)
            and cls.read_head is ObjectStoreBackend.read_head
            and cls.start_read_head is ObjectStoreBackend.start_read_head
        )

    def isfile(self, uri: str) -> bool:
        """One HEAD (``stat`` would list the prefix too, to tell a directory from nothing)."""
        bucket, key = self._split(uri, key_required=False)
        if not key.strip("/"):
            return False
        try:
            self._head(uri, bucket, key)
        except FileNotFoundError:
            return False
        return True

    # ---- metadata ----------------------------------------------------------------------------
    def stat(self, uri: str) -> ObjectInfo:
        bucket, key = self._split(uri, key_required=False)
        if key.strip("/"):
            try:
                return self._head(uri, bucket, key)
            except NotFoundError:
                pass
        prefix = key.rstrip("/") + "/" if key.strip("/") else ""
        objects, prefixes, _ = self._list_page(uri, bucket, prefix, delimiter=False, token=None, limit=1)
        if objects or prefixes or not prefix:
            return ObjectInfo(uri, 0, None, None, is_dir=True)
        raise NotFoundError(uri)

    def list(self, uri: str, *, recursive: bool = False) -> Iterator[ObjectInfo]:
        bucket, key = self._split(uri, key_required=False)
        scheme = _uri.scheme_of(uri) or self.scheme
        prefix = key.rstrip("/") + "/" if key.strip("/") else ""
        token: str | None = None
        while True:
            objects, prefixes, token = self._list_page(uri, bucket, prefix, delimiter=not recursive, token=token)
            entries = [
                ObjectInfo(f"{scheme}://{bucket}/{k}", size, mtime, version)
                for k, size, mtime, version in objects
                if k != prefix
            ]
            entries += [ObjectInfo(f"{scheme}://{bucket}/{p.rstrip('/')}", 0, None, None, True) for p in prefixes]
            yield from sorted(entries, key=lambda i: i.uri)
            if not token:
                return
