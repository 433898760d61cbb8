"""GETs whose bodies the kernel copies straight into the caller's memory.

aiohttp hands a response body over in chunks it has copied twice (out of the socket, out of its HTTP
parser) before the reader copies them into the tensor they fill, with Python running per chunk; at
loopback or LAN speeds that is most of a load's client CPU. A 32 MiB object from moto on loopback,
two 16 MiB ranges into fresh memory, 8 interleaved rounds: 0.58-0.62 GB/s through aiobotocore,
0.98-1.05 GB/s this way. :class:`DirectGets` sends a GET to a URL the store's client signed (a
presigned URL) with ``http.client`` on a worker thread and reads the body with ``readinto`` into the
caller's buffers: one copy, made by the kernel (or by OpenSSL as it decrypts).

The client stays in charge of what it knows: it signs the URL (credentials, region, addressing), and
an answer other than a body goes back to it (see the S3 backend's ``_get_range``). The URL carries a
signature: it never appears in an error, a log or a repr, only the request's host does.

A GET whose caller would only wait for it (the first GET of a load, which tells the object's size)
can run on the caller's thread instead (:meth:`DirectGets.get_here`, :meth:`DirectResponse.fill_here`):
no hand-off to the IO loop and back, which on a small object costs as much as the GET itself.

Threads: a blocking read runs on this object's own pool; the coroutine awaiting it, when cancelled
(a stall, a deadline, a load closing), shuts the socket down and waits for the thread to leave the
caller's memory before it lets the cancellation through: no byte lands after the await ends.
Connections are kept for the next GET to the same host (keep-alive), dropped after any error and
not shared with a forked child.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import http.client
import math
import os
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ..threads import Pool
from .retry import StalledError
from .watchdog import WATCHDOG, shut_all

T = TypeVar("T")

ERROR_BODY_LIMIT = 64 * 1024  # an error's XML is a few hundred bytes; more is not read
_TOO_LATE = "the reply took longer than the attempt's time"  # a GET from the caller's thread, at its deadline


class DirectConnectionError(ConnectionError):
    """A direct GET's connection failed (DNS, TLS, a malformed reply): transient, as the client's
    own connection errors are; names the host, never the signed URL."""


def _connection_error(e: BaseException, host: str) -> BaseException:
    """What a direct GET raises for ``e``: timeouts, refused certificates, connection resets and
    short bodies as they are (the retry policy knows them); the other errors of the connection (DNS,
    TLS, a malformed reply) as a :class:`DirectConnectionError`, retried as the client's are."""
    if isinstance(e, (TimeoutError, ssl.SSLCertVerificationError, ConnectionError, http.client.IncompleteRead)):
        return e
    if isinstance(e, (http.client.HTTPException, OSError)):  # OSError: ssl.SSLError and socket.gaierror too
        text = str(e)
        if "X-Amz-" in text or "Signature" in text or "?" in text:  # e.g. http.client's InvalidURL names the URL
            text = "(message withheld: it names the signed URL)"
        return DirectConnectionError(f"{type(e).__name__} from {host}: {text}"[:500])
    return e


class DirectResponse:
    """A reply's status and headers (names in lower case), its body still to be read. Read it with
    :meth:`fill` (or :meth:`error_body`) and :meth:`close` it in every case."""

    def __init__(
        self,
        gets: DirectGets,
        key: tuple[str, str, int],
        conn: http.client.HTTPConnection,
        sent: tuple[Any, socket.socket],
        stall: float,
        fired: list[bool] | None = None,
        deadline: list | None = None,
    ) -> None:
        self._gets, self._key, self._stall = gets, key, stall
        self._fired = fired if fired is not None else []  # get_here's: not empty once its deadline shut the socket
        self._deadline = deadline  # and that deadline's handle (:mod:`.watchdog`), disarmed by close()
        self._conn: http.client.HTTPConnection | None = conn
        # the socket, kept to unblock a read: a reply that closes its connection takes it from ``conn``
        self._resp, self._sock = sent
        resp = self._resp
        self.status: int = resp.status
        self.headers: dict[str, str] = {k.lower(): v for k, v in resp.getheaders()}

    async def fill(self, into: Sequence[memoryview], checksum: Any = None) -> int:
        """Stream the body through the consecutive buffers ``into``, in order; the bytes written (fewer
        than they hold when the body ends first). ``checksum.update`` is given each piece as it lands."""
        try:
            return await self._gets._in_thread(self._sock, _fill, self._resp, into, self._stall, checksum)
        except Exception as e:
            raise _connection_error(e, self._key[1]) from None

    def fill_here(self, into: Sequence[memoryview]) -> int:
        """:meth:`fill` on the calling thread (a reply of :meth:`DirectGets.get_here`: its deadline ends it
        with a :class:`~ckptio.objectstore.retry.StalledError`)."""
        return self._here(lambda: _fill(self._resp, into, self._stall, None))

    def error_body_here(self) -> bytes:
        """:meth:`error_body` on the calling thread."""
        return self._here(lambda: self._resp.read(ERROR_BODY_LIMIT))

    def _here(self, read: Callable[[], T]) -> T:
        """``read()`` of this reply on the calling thread. Once its deadline has shut the socket, whatever the
        read returned or raised is cut short: a StalledError."""
        try:
            out = read()
        except Exception as e:
            if self._fired:
                raise StalledError(_TOO_LATE) from None
            raise _connection_error(e, self._key[1]) from None
        if self._fired:
            raise StalledError(_TOO_LATE)
        return out

    async def error_body(self) -> bytes:
        """The first :data:`ERROR_BODY_LIMIT` bytes of the body (an error's XML)."""
        try:
            return await self._gets._in_thread(self._sock, self._resp.read, ERROR_BODY_LIMIT)
        except Exception as e:
            raise _connection_error(e, self._key[1]) from None

    def close(self) -> None:
        """Give the connection back for the next GET when the body was read to its end; else close it."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        deadline, self._deadline = self._deadline, None
        if deadline is not None:
            WATCHDOG.disarm(deadline)  # before the connection can serve another GET
        if self._resp.isclosed() and not self._resp.will_close and not self._fired:  # (not a shut socket)
            self._gets._give_back(self._key, conn)
        else:  # the reply holds the socket when it closes the connection: both let go of it
            self._resp.close()
            conn.close()


class DirectGets:
    """GETs of presigned URLs on worker threads (at most ``workers`` at once), bodies read into the
    caller's buffers. ``ssl_context`` verifies ``https`` hosts (the store client's own settings);
    ``connect_timeout``: seconds to open a connection; each read then waits at most its ``stall``."""

    def __init__(self, *, ssl_context: ssl.SSLContext | None, connect_timeout: float, workers: int) -> None:
        self.ssl_context = ssl_context
        self.connect_timeout = float(connect_timeout)
        self.workers = max(1, int(workers))
        self._pid = -1
        self._pool: Pool | None = None
        self._idle: dict[tuple[str, str, int], list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<DirectGets workers={self.workers}>"

    async def get(self, url: str, headers: dict[str, str], stall: float) -> DirectResponse:
        """Send ``GET url`` with ``headers``; the reply once its status and headers have arrived."""
        key, target = _route(url)
        conn, reused = self._take(key)
        socks: list[socket.socket] = []  # the thread's socket, for a cancellation to shut down
        try:
            # nothing is written into the caller's memory yet: a cancellation need not wait for the thread
            sent = await self._in_thread(
                socks, self._send, conn, reused, target, headers, stall, socks, wait=False, abandoned=conn.close
            )
        except asyncio.CancelledError:
            raise  # the thread may still be in connect/request/getresponse: closed when it ends (_in_thread)
        except Exception as e:
            conn.close()
            raise _connection_error(e, key[1]) from None
        return DirectResponse(self, key, conn, sent, stall)

    def get_here(self, url: str, headers: dict[str, str], stall: float, until: float) -> DirectResponse:
        """:meth:`get` on the calling thread: no worker, no IO loop (the caller waits on the socket).
        ``until`` (a ``time.monotonic()``) ends the GET, its body's reads included, with a
        :class:`~ckptio.objectstore.retry.StalledError` (:mod:`.watchdog`), as a stall does."""
        key, target = _route(url)
        left = until - time.monotonic()
        if left <= 0:
            raise StalledError("no time left for the attempt")
        conn, reused = self._take(key)
        conn.timeout = min(self.connect_timeout, left)  # a connection opened now: within the time left
        socks: list[socket.socket] = []
        fired: list[bool] = []
        deadline = WATCHDOG.arm(until, shut_all(socks, fired)) if math.isfinite(until) else None
        try:
            sent = self._send(conn, reused, target, headers, stall, socks)
        except BaseException as e:
            if deadline is not None:
                WATCHDOG.disarm(deadline)
            conn.close()
            if not isinstance(e, Exception):
                raise
            if fired:
                raise StalledError(_TOO_LATE) from None
            if isinstance(e, (ValueError, UnicodeError)) and not isinstance(e, OSError):
                # http.client refusing a header value: its message quotes the value (a bearer token)
                raise ValueError(f"a header of the GET to {key[1]} is not valid HTTP (its value withheld)") from None
            raise _connection_error(e, key[1]) from None
        reply = DirectResponse(self, key, conn, sent, stall, fired, deadline)
        if fired:  # a status line and headers cut short can still parse
            reply.close()
            raise StalledError(_TOO_LATE)
        return reply

    def submit(self, fn: Callable[..., T], *args: Any) -> cf.Future[T]:
        """``fn(*args)`` on this object's worker threads (a body read that its caller does not wait for)."""
        return self._workers().submit(fn, *args)

    def close(self) -> None:
        """Close the idle connections and let the worker threads end (a GET in flight finishes first)."""
        with self._lock:
            idle, self._idle = self._idle, {}
            pool, self._pool = self._pool, None
        for conns in idle.values():
            for conn in conns:
                conn.close()
        if pool is not None:
            pool.shutdown(wait=False)

    # ---- connections -------------------------------------------------------------------------
    def _fresh_process(self) -> None:
        """After a fork the parent's connections and threads are not this process's to use."""
        if self._pid != os.getpid():
            with self._lock:
                if self._pid != os.getpid():
                    self._idle, self._pool, self._pid = {}, None, os.getpid()

    def _take(self, key: tuple[str, str, int]) -> tuple[http.client.HTTPConnection, bool]:
        self._fresh_process()
        with self._lock:
            idle = self._idle.get(key)
            if idle:
                return idle.pop(), True
        scheme, host, port = key
        if scheme == "https":
            return http.client.HTTPSConnection(
                host, port, timeout=self.connect_timeout, context=self.ssl_context
            ), False
        return http.client.HTTPConnection(host, port, timeout=self.connect_timeout), False

    def _give_back(self, key: tuple[str, str, int], conn: http.client.HTTPConnection) -> None:
        with self._lock:
            idle = self._idle.setdefault(key, [])
            if self._pid == os.getpid() and len(idle) < self.workers:
                idle.append(conn)
                return
        conn.close()

    @staticmethod
    def _send(
        conn: http.client.HTTPConnection,
        reused: bool,
        target: str,
        headers: dict[str, str],
        stall: float,
        socks: list[socket.socket],
    ) -> tuple[Any, socket.socket]:
        """On a worker thread: the request, and the reply (status line and headers read) with its socket."""
        for attempt in (0, 1):
            try:
                if conn.sock is None:
                    conn.connect()  # within connect_timeout
                sock = conn.sock
                socks.append(sock)
                sock.settimeout(stall)  # then each read waits at most ``stall``
                conn.request("GET", target, headers=headers)
                return conn.getresponse(), sock
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                # a kept connection the server had closed meanwhile: once more on a new one
                if attempt or not reused:
                    raise
                conn.close()
            except StalledError:
                raise
            except TimeoutError:
                raise StalledError(f"no reply for {stall:g}s") from None
        raise AssertionError("unreachable")

    # ---- threads -----------------------------------------------------------------------------
    def _workers(self) -> Pool:
        self._fresh_process()
        with self._lock:
            if self._pool is None:
                self._pool = Pool(self.workers, thread_name_prefix="ckptio-get")  # works at exit too
            return self._pool

    async def _in_thread(
        self,
        sock: socket.socket | list[socket.socket],
        fn: Callable[..., T],
        *args: Any,
        wait: bool = True,
        abandoned: Callable[[], None] | None = None,
    ) -> T:
        """``fn(*args)`` on a worker thread reading ``sock`` (or the sockets this list holds once the
        thread has opened them). Cancelled: the socket is shut down (the thread's read returns at
        once) and, with ``wait``, the thread is waited for, so that it has left the caller's memory."""
        fut = asyncio.get_running_loop().run_in_executor(self._workers(), fn, *args)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            for one in sock if isinstance(sock, list) else [sock]:
                _shut(one)
            if wait:
                # asyncio.wait never cancels ``fut``: a second cancellation (a deadline, then a sibling's
                # failure) must not end this wait before the thread has left the caller's memory
                while not fut.done():
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.wait([fut])

            def drop(f: asyncio.Future) -> None:  # its outcome is nobody's: retrieved, its resources freed
                if not f.cancelled():
                    f.exception()
                if abandoned is not None:
                    abandoned()

            fut.add_done_callback(drop)
            raise


def _shut(sock: socket.socket) -> None:
    """Unblock a thread reading ``sock`` (the base socket's shutdown: an SSL socket's own would drop its
    SSL object under the reading thread)."""
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


def _route(url: str) -> tuple[tuple[str, str, int], str]:
    """``url``'s connection key (scheme, host, port) and request target."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("a direct GET needs an http(s) URL")  # the URL itself is not named: it is signed
    key = (parts.scheme, parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    return key, target


def _fill(resp: Any, into: Sequence[memoryview], stall: float, checksum: Any) -> int:
    """On a worker thread: the body through the buffers ``into`` in order (each piece through
    ``checksum.update`` too, while it is in the cache); the bytes written."""
    total = 0
    try:
        for view in into:
            pos = 0
            while pos < len(view):
                n = resp.readinto(view[pos:])
                if not n:
                    break
                if checksum is not None:
                    checksum.update(view[pos : pos + n])
                pos += n
            total += pos
            if pos < len(view):
                break
    except StalledError:
        raise
    except TimeoutError:
        raise StalledError(f"no bytes received for {stall:g}s") from None
    return total
