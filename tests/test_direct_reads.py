"""S3 GETs sent around the client (``ckptio.objectstore.direct``): presigned URLs read by http.client on a
worker thread straight into the caller's memory. What they must keep from the client's own GETs: the
bytes, the errors (each naming the object, none showing the signed URL), the retries, the client's
way where the presigned URL is refused or a proxy applies, and no byte written after a read returns."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest

import ckptio
from ckptio.bench.servers import self_signed_certificate
from ckptio.errors import NotFoundError
from ckptio.objectstore import direct as _direct
from ckptio.objectstore.retry import StalledError
from faultproxy import Fault
from servers import CountingProxy

SIGNED = "X-Amz-Signature="


def _gets(proxy) -> list:
    return [r for r in proxy.requests if r.method == "GET"]


def test_reads_are_presigned_gets_into_the_callers_memory(s3_faults):
    data = os.urandom(11 << 20)
    uri = s3_faults.uri + "/direct.bin"
    ckptio.put(data, uri)
    backend, u = ckptio.resolve(uri, part_size=5 << 20)
    s3_faults.requests.clear()
    buf = bytearray(len(data) - 5)
    assert backend.readinto(u, buf, 5) == len(buf) and bytes(buf) == data[5:]
    gets = _gets(s3_faults)
    assert len(gets) == 3  # one per part
    assert all(SIGNED in g.path and "Authorization" not in g.headers for g in gets)
    assert all("X-Amz-Algorithm=AWS4-HMAC-SHA256" in g.path for g in gets)  # SigV4, not S3's legacy SigV2


def test_direct_reads_off_sends_the_clients_own_gets(s3_faults):
    data = os.urandom(1 << 20)
    uri = s3_faults.uri + "/indirect.bin"
    ckptio.put(data, uri)
    backend, u = ckptio.resolve(uri, direct_reads=False)
    s3_faults.requests.clear()
    assert backend.read(u) == data
    assert all(SIGNED not in g.path and "Authorization" in g.headers for g in _gets(s3_faults))


@pytest.mark.parametrize(
    "status,code", [(403, "AccessDenied"), (400, "AuthorizationQueryParametersError"), (301, "PermanentRedirect")]
)
def test_a_refused_presigned_url_falls_back_to_the_clients_gets_for_that_bucket(s3_faults, status, code):
    """A bucket policy refusing query-string authentication, a presigned URL for the wrong region: the
    read succeeds through the client, and that bucket's later reads go the client's way at once."""
    data = os.urandom(1 << 20)
    uri = s3_faults.uri + "/refused.bin"
    ckptio.put(data, uri)
    backend, u = ckptio.resolve(uri)
    s3_faults.add(Fault("status", status=status, code=code, method="GET", path=SIGNED, fraction=1.0))
    s3_faults.requests.clear()
    assert backend.read(u) == data
    assert backend.read(u) == data
    assert s3_faults.fired("status") == 1
    assert [SIGNED in g.path for g in _gets(s3_faults)] == [True, False, False]


@pytest.mark.parametrize("status,code", [(503, "SlowDown"), (500, "InternalError")])
def test_a_transient_error_on_a_direct_get_is_retried_the_direct_way(s3_faults, status, code):
    data = os.urandom(1 << 20)
    uri = s3_faults.uri + "/transient.bin"
    ckptio.put(data, uri)
    backend, u = ckptio.resolve(uri)
    s3_faults.add(Fault("status", status=status, code=code, method="GET", nth=1))
    s3_faults.requests.clear()
    assert backend.read(u) == data
    assert s3_faults.fired("status") == 1
    assert [SIGNED in g.path for g in _gets(s3_faults)] == [True, True]


def test_errors_name_the_object_and_never_show_the_signed_url(s3_faults):
    backend, u = ckptio.resolve(s3_faults.uri + "/missing.bin")
    with pytest.raises(NotFoundError) as info:
        backend.readinto(u, bytearray(10))
    shown = "".join(traceback.format_exception(info.value)) + repr(info.value.__cause__)
    assert "missing.bin" in str(info.value)
    assert SIGNED not in shown and "X-Amz-Credential" not in shown and "Signature=" not in shown
    # a server that is gone: the connection error names the endpoint, not the URL
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()
    b2, u2 = ckptio.resolve(s3_faults.uri + "/x.bin", endpoint_url=f"http://127.0.0.1:{port}", max_attempts=1)
    with pytest.raises(OSError) as info2:
        b2.readinto(u2, bytearray(10))
    shown = "".join(traceback.format_exception(info2.value))
    assert "x.bin" in str(info2.value) and SIGNED not in shown and "X-Amz-Credential" not in shown


def test_a_proxy_keeps_the_gets_the_clients(s3_endpoint):
    """Where the client's session sends requests through a proxy, a direct GET would bypass it."""
    from aiobotocore.config import AioConfig
    from aiobotocore.session import get_session

    from ckptio.objectstore.s3_client import direct_route

    async def route(config: AioConfig | None) -> bool:
        async with get_session().create_client(
            "s3",
            endpoint_url=s3_endpoint,
            region_name="us-east-1",
            aws_access_key_id="k",
            aws_secret_access_key="s",
            config=config,
        ) as client:
            return direct_route(client, s3_endpoint + "/b/k?X-Amz-Signature=0")[0]

    assert asyncio.run(route(None)) is True
    assert asyncio.run(route(AioConfig(proxies={"http": "http://127.0.0.1:9"}))) is False


# ---- DirectGets against a server that misbehaves on purpose ------------------------------------
class _Server:
    """A loopback HTTP/1.1 server: answers each request with ``headers_then`` bytes of a body whose
    Content-Length says ``length``, then keeps the connection open (``hold``) or closes it."""

    def __init__(self, length: int, sent: int, *, hold: bool, keep_alive: bool = False) -> None:
        self.length, self.sent, self.hold, self.keep_alive = length, sent, hold, keep_alive
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.conns = 0
        self._stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns += 1
            threading.Thread(target=self._one, args=(c,), daemon=True).start()

    def _one(self, c: socket.socket) -> None:
        with c:
            try:
                while True:
                    req = b""
                    while b"\r\n\r\n" not in req:
                        got = c.recv(65536)
                        if not got:
                            return
                        req += got
                    head = f"HTTP/1.1 206 Partial Content\r\nContent-Length: {self.length}\r\n"
                    c.sendall((head + ("" if self.keep_alive else "Connection: close\r\n") + "\r\n").encode())
                    c.sendall(b"x" * self.sent)
                    if self.hold:
                        self._stop.wait(30)
                        return
                    if not self.keep_alive:
                        return
                    if self.keep_alive == "once":  # keep the connection idle, then drop it before its next use
                        time.sleep(0.2)
                        return
            except OSError:
                return

    def close(self) -> None:
        self._stop.set()
        self.sock.close()


def test_a_cancelled_direct_read_ends_at_once_and_writes_nothing_after():
    """A stalled body whose read is cancelled (a deadline, a load closing): the await ends within a
    fraction of the stall timeout, and the worker thread has left the buffer by then."""
    server = _Server(1 << 20, 1000, hold=True)
    gets = _direct.DirectGets(ssl_context=None, connect_timeout=5, workers=2)
    buf = bytearray(1 << 20)

    async def go() -> float:
        reply = await gets.get(f"http://127.0.0.1:{server.port}/o?X-Amz-Signature=s", {}, stall=30)
        task = asyncio.ensure_future(reply.fill([memoryview(buf)]))
        await asyncio.sleep(0.3)
        t0 = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        reply.close()
        return time.monotonic() - t0

    try:
        took = asyncio.run(go())
        assert took < 2.0
        before = bytes(buf)
        time.sleep(0.3)
        assert bytes(buf) == before and buf[:1000] == b"x" * 1000 and buf[1000:] == bytes(len(buf) - 1000)
    finally:
        gets.close()
        server.close()


def test_a_stalled_direct_read_raises_stalled_within_the_stall_timeout():
    server = _Server(1 << 20, 1000, hold=True)
    gets = _direct.DirectGets(ssl_context=None, connect_timeout=5, workers=2)

    async def go() -> None:
        reply = await gets.get(f"http://127.0.0.1:{server.port}/o", {}, stall=0.5)
        try:
            await reply.fill([memoryview(bytearray(1 << 20))])
        finally:
            reply.close()

    try:
        t0 = time.monotonic()
        with pytest.raises(StalledError):
            asyncio.run(go())
        assert time.monotonic() - t0 < 5
    finally:
        gets.close()
        server.close()


def test_a_kept_connection_the_server_dropped_is_replaced_once():
    """Keep-alive: the next GET to a host reuses the connection; when the server closed it while it was
    idle, the GET goes again on a new one instead of failing."""
    server = _Server(100, 100, hold=False, keep_alive="once")
    gets = _direct.DirectGets(ssl_context=None, connect_timeout=5, workers=2)

    async def one() -> bytes:
        reply = await gets.get(f"http://127.0.0.1:{server.port}/o", {}, stall=5)
        buf = bytearray(100)
        try:
            assert await reply.fill([memoryview(buf)]) == 100
        finally:
            reply.close()
        return bytes(buf)

    async def go() -> None:
        assert await one() == b"x" * 100
        await asyncio.sleep(0.5)  # the server drops the idle connection
        assert await one() == b"x" * 100

    try:
        asyncio.run(go())
        assert server.conns == 2
    finally:
        gets.close()
        server.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_opens_its_own_connections():
    """Kept connections are the parent's: a child using the same DirectGets opens its own (two
    processes reading one socket would take each other's replies), and the parent keeps its own."""
    server = _Server(100, 100, hold=False, keep_alive=True)
    gets = _direct.DirectGets(ssl_context=None, connect_timeout=5, workers=2)

    async def one() -> bytes:
        reply = await gets.get(f"http://127.0.0.1:{server.port}/o", {}, stall=5)
        buf = bytearray(100)
        try:
            await reply.fill([memoryview(buf)])
        finally:
            reply.close()
        return bytes(buf)

    try:
        assert asyncio.run(one()) == b"x" * 100
        assert server.conns == 1
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = 0 if asyncio.run(one()) == b"x" * 100 else 2
            except BaseException as e:  # noqa: BLE001 - shown by the parent's failure
                os.write(2, f"child: {type(e).__name__}: {e}\n".encode())
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert server.conns == 2  # the child's own
        assert asyncio.run(one()) == b"x" * 100
        assert server.conns == 2  # the parent's kept one
    finally:
        gets.close()
        server.close()


# ---- https ---------------------------------------------------------------------------------------
def test_https_direct_reads_verify_the_server_as_the_client_does(s3_uri, s3_endpoint, tmp_path, monkeypatch):
    """Over https the direct GETs trust what the client trusts (here ``AWS_CA_BUNDLE``), and a server
    that the client would not trust fails the read instead of being read from."""
    cert, key = self_signed_certificate(str(tmp_path))
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    data = os.urandom(6 << 20)
    ckptio.put(data, s3_uri + "/tls.bin")
    with CountingProxy(s3_endpoint, tls=tls) as proxy:
        monkeypatch.setenv("AWS_CA_BUNDLE", cert)
        backend, u = ckptio.resolve(s3_uri + "/tls.bin", endpoint_url=proxy.url)
        assert backend.read(u) == data
        gets = [r for r in proxy.requests if r.method == "GET"]
        assert gets and all(SIGNED in g.path for g in gets)
        ckptio.reset()
        monkeypatch.delenv("AWS_CA_BUNDLE")
        backend, u = ckptio.resolve(s3_uri + "/tls.bin", endpoint_url=proxy.url, max_attempts=1)
        proxy.clear()
        with pytest.raises(OSError, match="tls.bin") as info:
            backend.read(u)
        assert "CERTIFICATE_VERIFY_FAILED" in repr(info.value.__cause__) or "certificate" in str(info.value).lower()
        assert not [r for r in proxy.requests if r.method == "GET"]  # no request got through


def _serve_each(answer: Callable[[socket.socket], None]) -> socket.socket:
    """A loopback listener answering each connection with ``answer(conn)`` on its own thread (the
    connection closed after; a client gone meanwhile ignored); close the returned socket to stop."""
    srv = socket.create_server(("127.0.0.1", 0))

    def one(c: socket.socket) -> None:
        with c, contextlib.suppress(OSError):
            answer(c)

    def serve() -> None:
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=one, args=(c,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return srv


def test_a_read_cancelled_twice_still_waits_for_its_thread():
    """A deadline and then a failing sibling range cancel one read twice: the second cancellation must
    not end the wait for the worker thread, which would go on copying what the kernel had queued."""
    n = 64 << 20

    def one(c: socket.socket) -> None:
        c.recv(65536)
        c.sendall(b"HTTP/1.1 206 Partial Content\r\nContent-Length: %d\r\n\r\n" % n)
        for _ in range(64):
            c.sendall(b"x" * (1 << 20))

    srv = _serve_each(one)
    gets = _direct.DirectGets(ssl_context=None, connect_timeout=5, workers=2)

    async def go() -> list[int]:
        late = []
        for i in range(12):
            reply = await gets.get(f"http://127.0.0.1:{srv.getsockname()[1]}/o", {}, stall=30)
            buf = bytearray(n)
            task = asyncio.ensure_future(reply.fill([memoryview(buf)]))
            await asyncio.sleep(0.002 * (i % 6))
            task.cancel()
            for _ in range(2):
                await asyncio.sleep(0)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):  # (or it had ended first)
                await task
            written = n - buf.count(0)
            time.sleep(0.05)
            late.append(n - buf.count(0) - written)
            reply.close()
        return late

    try:
        assert asyncio.run(go()) == [0] * 12
    finally:
        gets.close()
        srv.close()


async def _wait_out(seconds: float) -> None:
    """Clean up as a direct read does whatever cancels it: wait for its worker thread (here a sleep)."""
    thread = asyncio.ensure_future(asyncio.sleep(seconds))
    while not thread.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait([thread])


async def _cancel_twice(coro: Any, pause: float) -> None:
    """Run ``coro`` as a task, cancel it, again after ``pause`` s, and see it end cancelled."""
    task = asyncio.ensure_future(coro)
    await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.sleep(pause)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_retry_attempts_end_before_their_timeout_or_cancellation_returns():
    """``RetryPolicy``'s per-attempt timeout returns only once the attempt has ended, even when the
    waiting task is cancelled meanwhile (``asyncio.wait_for`` of Python 3.11 does not wait then)."""
    from ckptio.objectstore.retry import within

    ended: list[str] = []

    async def attempt() -> None:
        try:
            await asyncio.sleep(10)
        finally:
            await _wait_out(0.05)
            ended.append("attempt")

    async def timed_out() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await within(attempt(), 0.05)
        assert ended == ["attempt"]

    async def cancelled_twice() -> None:
        await _cancel_twice(within(attempt(), 10), 0)
        assert ended == ["attempt", "attempt"]

    asyncio.run(timed_out())
    asyncio.run(cancelled_twice())


def test_connection_errors_of_direct_gets_are_retried_and_name_the_host_only(s3_faults):
    """A malformed reply (or DNS, TLS) on a direct GET is a connection error, retried as the client's
    own are; what it says names the host, never the signed URL."""
    from ckptio.objectstore.retry import TRANSIENT
    from ckptio.objectstore.s3_support import classify

    def one(c: socket.socket) -> None:
        c.recv(65536)
        c.sendall(b"HTTX/9 garbage\r\n\r\n")

    srv = _serve_each(one)
    gets = _direct.DirectGets(ssl_context=None, connect_timeout=5, workers=2)
    secret = "".join(["sig", "nature-value"])  # not in this file's text, which a traceback shows

    async def go() -> None:
        await gets.get(f"http://127.0.0.1:{srv.getsockname()[1]}/k?X-Amz-Signature={secret}", {}, stall=5)

    try:
        with pytest.raises(_direct.DirectConnectionError) as info:
            asyncio.run(go())
        assert classify(info.value) == TRANSIENT
        shown = "".join(traceback.format_exception(info.value))
        assert "127.0.0.1" in str(info.value) and secret not in shown
    finally:
        gets.close()
        srv.close()


def test_a_body_damaged_in_flight_is_caught_by_the_checksum_s3_sent_and_read_again(s3_faults):
    """A direct GET asks for checksums as the client's GETs do (``x-amz-checksum-mode``, signed into the
    URL) and checks the body against the ``x-amz-checksum-crc32`` S3 sends with a reply holding the whole
    object: a bit flipped in flight is read again, not returned."""
    data = os.urandom(1 << 20)
    uri = s3_faults.uri + "/damaged.bin"
    ckptio.put(data, uri)  # one PUT, with its CRC32
    backend, u = ckptio.resolve(uri)
    s3_faults.add(Fault("corrupt", method="GET", nth=1))
    s3_faults.requests.clear()
    assert backend.read(u) == data
    gets = _gets(s3_faults)
    assert [g.fault for g in gets] == ["corrupt", None]
    assert all(SIGNED in g.path and "x-amz-checksum-mode" in g.path for g in gets)
    assert all(g.headers.get("x-amz-checksum-mode") == "ENABLED" for g in gets)
    s3_faults.add(Fault("corrupt", method="GET", fraction=1.0))  # damaged every time: the read fails
    b2, u2 = ckptio.resolve(uri, max_attempts=2)
    with pytest.raises(OSError, match="damaged.bin"):
        b2.read(u2)


@pytest.mark.parametrize("direct", [True, False])
def test_either_way_a_damaged_whole_object_body_is_read_again(s3_faults, direct):
    """botocore checks a body only when it is read past its end, which a read of exactly its range never
    is: ckptio checks it itself, on the client's GETs as on direct ones."""
    data = os.urandom(1 << 20)
    uri = s3_faults.uri + "/damaged2.bin"
    ckptio.put(data, uri)
    backend, u = ckptio.resolve(uri, direct_reads=direct)
    s3_faults.add(Fault("corrupt", method="GET", nth=1))
    buf = bytearray(len(data))
    assert backend.readinto(u, buf, 0) == len(data) and bytes(buf) == data
    assert backend.read(u) == data
    assert s3_faults.fired("corrupt") == 1


@pytest.mark.parametrize(
    "headers,checked",
    [
        ({}, True),  # a 200: the whole object
        ({"content-range": "bytes 0-4999/5000"}, True),  # a range holding the whole object
        ({"content-range": "bytes 0-999/5000"}, False),  # a part: a whole-object checksum is not its own
        ({"content-range": "bytes 4000-4999/5000"}, False),
        ({"etag": '"abc-3"'}, False),  # multipart, no type: a composite sent without its -N
        ({"etag": '"abc-3"', "x-amz-checksum-type": "FULL_OBJECT"}, True),
        ({"x-amz-checksum-type": "COMPOSITE"}, False),
        ({"etag": '"abc"'}, True),
    ],
)
def test_only_a_whole_object_checksum_of_a_whole_object_reply_is_checked(headers, checked):
    import base64
    import zlib

    from ckptio.objectstore.s3_client import body_checksum

    data = os.urandom(5000)
    crc = base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()
    check = body_checksum({"x-amz-checksum-crc32": crc, **headers})
    assert (check is not None) is checked
    if check is not None:
        check.update(memoryview(data))
        assert check.matches()
    for bad in ("notbase64!", crc + "-3", "AAAA"):  # not base64, composite, the wrong size
        assert body_checksum({"x-amz-checksum-crc32": bad}) is None


def test_a_cancelled_gather_ends_after_every_request_it_started():
    """``gather_or_cancel`` cancelled (even twice) cancels its requests and returns only once each has
    ended: a ranged read's requests write into the caller's buffers until then."""
    from ckptio.objectstore.ranged import gather_or_cancel

    ended: list[int] = []

    async def request(i: int) -> None:
        try:
            await asyncio.sleep(10)
        finally:
            await _wait_out(0.05 * (i + 1))
            ended.append(i)

    async def go() -> None:
        await _cancel_twice(gather_or_cancel([request(i) for i in range(3)]), 0.06)
        assert sorted(ended) == [0, 1, 2]

    asyncio.run(go())
