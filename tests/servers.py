"""Real storage servers on loopback for tests and benchmarks: moto (S3 API) and gcp-storage-emulator.

The launchers (:class:`Server`, :class:`MotoServer`, :class:`TLSMotoServer`, :class:`GCSEmulator`,
the bucket helpers, a boto3 client) live in :mod:`ckptio.bench.servers`, since the benchmarks start
them too; they are re-exported here. This module adds what only tests use: :class:`CountingProxy`,
which sits in front of a server and records every request with the bytes sent and received, for
tests that check what the server saw.
"""

from __future__ import annotations

import http.client
import ssl
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from ckptio.bench.servers import (  # noqa: F401 - re-exported for the tests
    GCSEmulator,
    MotoServer,
    Server,
    TLSMotoServer,
    free_port,
    make_gcs_bucket,
    make_s3_bucket,
    s3_client,
)

# ---- a counting proxy -------------------------------------------------------------------------


@dataclass
class Request:
    method: str
    path: str  # includes the query string
    headers: dict[str, str]
    bytes_in: int  # request body bytes (client -> server)
    bytes_out: int  # response body bytes (server -> client)
    status: int


def read_body(handler: BaseHTTPRequestHandler) -> bytes:
    """The request body of a ``BaseHTTPRequestHandler`` (Content-Length or chunked)."""
    if handler.headers.get("Transfer-Encoding", "").lower() == "chunked":
        out = bytearray()
        while True:
            n = int(handler.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if n == 0:
                while handler.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                return bytes(out)
            out += handler.rfile.read(n)
            handler.rfile.readline()
    return handler.rfile.read(int(handler.headers.get("Content-Length") or 0))


class ProxyHandler(BaseHTTPRequestHandler):
    """Request handler plumbing shared by the proxies: read the body, forward it to ``upstream``,
    send a response head. A subclass sets ``upstream`` (a ``urlsplit`` result)."""

    protocol_version = "HTTP/1.1"
    upstream: Any = None

    def log_message(self, *a) -> None:
        pass

    def _body(self) -> bytes:
        return read_body(self)

    def _forward(self, body: bytes, drop: tuple[str, ...] = ()) -> tuple[int, str, list[tuple[str, str]], bytes]:
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("transfer-encoding", "connection", *drop)}
        if body or self.command in ("PUT", "POST"):
            headers["Content-Length"] = str(len(body))
        conn = http.client.HTTPConnection(self.upstream.hostname, self.upstream.port, timeout=60)
        try:
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        return resp.status, resp.reason, resp.getheaders(), data

    def _head(self, status: int, reason: str, headers: list[tuple[str, str]], length: int | None) -> None:
        self.send_response(status, reason)
        for k, v in headers:
            if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(k, v)
        if length is not None:
            self.send_header("Content-Length", str(length))
        self.end_headers()


class LoopbackProxy:
    """Serving and request counting shared by the proxies: ``_serve(Handler)`` binds 127.0.0.1 on a
    free port; ``start``/``stop`` or ``with``. Subclasses keep ``requests`` (with ``method`` and
    ``path``) under ``_lock``."""

    thread_name = "proxy"
    requests: list[Any]

    def _serve(self, handler: type, server: type = ThreadingHTTPServer, tls: ssl.SSLContext | None = None) -> None:
        self._lock = threading.Lock()
        if tls is not None:  # https: each connection wrapped (its handshake on the handler's thread)

            class TLSServer(server):  # type: ignore[valid-type,misc]
                def get_request(self) -> tuple[Any, Any]:
                    sock, addr = super().get_request()
                    return tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), addr

            server = TLSServer
        self._server = server(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self._server.server_address[1]}"
        self._thread: threading.Thread | None = None

    def start(self):
        # a short poll: shutdown() waits for the loop's next poll (0.5 s by default, paid per test)
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.02,), name=self.thread_name, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def count(self, method: str | None = None, contains: str = "") -> int:
        with self._lock:
            return sum(1 for r in self.requests if (method is None or r.method == method) and contains in r.path)


@dataclass
class CountingProxy(LoopbackProxy):
    """An HTTP proxy in front of ``upstream`` that records every request (thread-safe).

    ``with CountingProxy(server.url) as p: ... p.url ... p.requests``. Bodies are relayed whole,
    so keep objects small in tests that use it.
    """

    upstream: str
    requests: list[Request] = field(default_factory=list)
    tls: ssl.SSLContext | None = None  # serve https with this server context
    thread_name = "counting-proxy"

    def __post_init__(self) -> None:
        proxy = self

        class Handler(ProxyHandler):
            upstream = urlsplit(self.upstream)

            def _relay(self) -> None:
                body = self._body()
                status, reason, headers, data = self._forward(body)
                with proxy._lock:  # recorded before the client can see the response
                    proxy.requests.append(
                        Request(self.command, self.path, dict(self.headers.items()), len(body), len(data), status)
                    )
                length = next((v for k, v in headers if k.lower() == "content-length"), None)
                self._head(status, reason, headers, length if self.command == "HEAD" and length else len(data))
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _relay

        self._serve(Handler, tls=self.tls)

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()

    @property
    def bytes_in(self) -> int:
        with self._lock:
            return sum(r.bytes_in for r in self.requests)

    @property
    def bytes_out(self) -> int:
        with self._lock:
            return sum(r.bytes_out for r in self.requests)
