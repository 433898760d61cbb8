"""A fault-injecting HTTP proxy on loopback, in front of moto (S3) or the GCS emulator.

    with FaultProxy(server.url, flavor="s3", seed=1) as p:
        p.add(Fault("status", status=503, nth=2))              # the 2nd matching request gets 503 SlowDown
        p.add(Fault("reset", method="GET", fraction=0.3))      # 30% of GETs: connection reset mid-body
        ... use p.url as the endpoint ...
        p.fired("status")                                      # how many times a fault was injected

Faults (``kind``):

* ``status``: answer ``status`` (503/500/...) without forwarding, with the server's error body
  (S3 XML ``SlowDown``/``InternalError``, or ``code`` and ``message`` when given; GCS JSON).
* ``expired``: the credentials expired (S3: 400 ``ExpiredToken`` XML; GCS: 401), not forwarded.
* ``reset``: forward, then send the status line, headers and half the body and reset the
  connection (RST); a response with no body is not sent at all. ``before=True`` resets before
  forwarding (the server never sees the request).
* ``stall``: forward, send headers and half the body (or nothing, ``before=True``) and then send
  nothing for ``stall`` seconds before closing.
* ``truncate``: forward, then send a consistent but short response: half the body, with
  ``Content-Length`` shrunk to match (only a client that checks ``Content-Range`` notices).
* ``ignore_range``: forward without the ``Range`` header, as a server that ignores it would
  (the whole object comes back with 200).
* ``corrupt``: forward, then send the response with one bit of its body flipped (headers as the
  server sent them: only a checksum of the body notices).

A rule matches requests by ``method``, a substring of the path (``path``) and the start of the ``Range``
header (``range``: ``"bytes=-"`` for suffix ranges only); it fires on the
``nth`` matching request (1-based) and the ``times - 1`` after it, or with probability
``fraction`` on each matching request (seeded, so runs repeat), at most ``limit`` times in all.
Every request is recorded in ``requests`` with the fault applied to it.
"""

from __future__ import annotations

import random
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from urllib.parse import urlsplit

from servers import LoopbackProxy, ProxyHandler

KINDS = ("status", "expired", "reset", "stall", "truncate", "ignore_range", "corrupt")


@dataclass
class Fault:
    kind: str
    status: int = 503
    code: str | None = None  # the S3 error code of a ``status`` answer (default: the usual one for the status)
    message: str | None = None  # and its message (default: "injected <status>")
    nth: int | None = None
    times: int = 1
    fraction: float = 0.0
    limit: int | None = None
    method: str | None = None
    path: str = ""
    before: bool = False
    stall: float = 5.0
    range: str | None = None  # the Range header starts with this (None: any request)
    seen: int = 0
    fired: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; expected one of {KINDS}")
        if self.nth is None and not self.fraction:
            self.nth = 1

    def matches(self, method: str, path: str, range_header: str = "") -> bool:
        return (
            (self.method is None or self.method == method)
            and self.path in path
            and (self.range is None or range_header.startswith(self.range))
        )

    def fire(self, rng: random.Random) -> bool:
        self.seen += 1
        if self.limit is not None and self.fired >= self.limit:
            return False
        if self.nth is not None:
            hit = self.nth <= self.seen < self.nth + self.times
        else:
            hit = rng.random() < self.fraction
        if hit:
            self.fired += 1
        return hit


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    fault: str | None
    status: int | None = None


def _error_body(flavor: str, status: int, code: str, message: str) -> tuple[bytes, str]:
    if flavor == "s3":
        return (
            f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{message}</Message>'
            f"<RequestId>fault</RequestId></Error>"
        ).encode(), "application/xml"
    import json

    return json.dumps(
        {"error": {"code": status, "message": message, "errors": [{"reason": code}]}}
    ).encode(), "application/json"


_S3_CODES = {
    500: "InternalError",
    502: "BadGateway",
    503: "SlowDown",
    504: "GatewayTimeout",
    403: "AccessDenied",
    404: "NoSuchKey",
    412: "PreconditionFailed",
}


@dataclass
class FaultProxy(LoopbackProxy):
    upstream: str
    flavor: str = "s3"  # error bodies in S3 XML or GCS JSON
    seed: int = 0
    faults: list[Fault] = field(default_factory=list)
    requests: list[Seen] = field(default_factory=list)
    thread_name = "fault-proxy"

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._stop = threading.Event()
        proxy = self

        class Handler(ProxyHandler):
            upstream = urlsplit(self.upstream)

            def finish(self) -> None:
                try:
                    super().finish()
                except (OSError, ValueError):
                    pass

            def _reset(self) -> None:
                self.close_connection = True
                try:
                    self.wfile.flush()
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.connection.close()
                except OSError:
                    pass

            def _error(self, status: int, code: str, message: str) -> None:
                body, ctype = _error_body(proxy.flavor, status, code, message)
                self._head(status, code, [("Content-Type", ctype)], len(body))
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _relay(self) -> None:
                body = self._body()
                fault = proxy._pick(self.command, self.path, self.headers.get("Range") or "")
                seen = Seen(self.command, self.path, dict(self.headers.items()), fault.kind if fault else None)
                with proxy._lock:
                    proxy.requests.append(seen)
                kind = fault.kind if fault else None
                if kind == "status":
                    seen.status = fault.status
                    code = fault.code or (
                        _S3_CODES.get(fault.status, "InternalError") if proxy.flavor == "s3" else "backendError"
                    )
                    return self._error(fault.status, code, fault.message or f"injected {fault.status}")
                if kind == "expired":
                    if proxy.flavor == "s3":
                        seen.status = 400
                        return self._error(400, "ExpiredToken", "The provided token has expired.")
                    seen.status = 401
                    return self._error(401, "authError", "Invalid Credentials")
                if fault is not None and fault.before:
                    if kind == "stall":
                        proxy._stop.wait(fault.stall)
                    return self._reset()
                status, reason, headers, data = self._forward(body, ("range",) if kind == "ignore_range" else ())
                seen.status = status
                if kind == "ignore_range":
                    kind = None
                if kind == "corrupt" and data:  # one bit of the body flipped in flight; headers as sent
                    data = data[: len(data) // 2] + bytes([data[len(data) // 2] ^ 0x01]) + data[len(data) // 2 + 1 :]
                    kind = None
                head_len = next((v for k, v in headers if k.lower() == "content-length"), None)
                if kind is None:
                    self._head(
                        status, reason, headers, int(head_len) if self.command == "HEAD" and head_len else len(data)
                    )
                    if self.command != "HEAD":
                        self.wfile.write(data)
                    return
                half = data[: len(data) // 2]
                if kind == "truncate":
                    self._head(status, reason, headers, len(half))
                    self.wfile.write(half)
                    self.close_connection = True
                    return
                if half:  # mid-body; a response without a body is lost whole (the server did the work)
                    self._head(status, reason, headers, len(data))
                    self.wfile.write(half)
                if kind == "stall":
                    self.wfile.flush()
                    proxy._stop.wait(fault.stall)
                self._reset()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _relay

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address) -> None:
                pass  # resets and client timeouts are the point here

        self._serve(Handler, Server)

    def _pick(self, method: str, path: str, range_header: str = "") -> Fault | None:
        with self._lock:
            for f in self.faults:
                if f.matches(method, path, range_header) and f.fire(self._rng):
                    return f
        return None

    def add(self, fault: Fault | None = None, /, *args, **kw) -> Fault:
        f = fault if fault is not None else Fault(*args, **kw)
        with self._lock:
            self.faults.append(f)
        return f

    def clear(self) -> None:
        """Remove every fault and forget recorded requests."""
        with self._lock:
            self.faults.clear()
            self.requests.clear()

    def fired(self, kind: str | None = None) -> int:
        with self._lock:
            return sum(1 for r in self.requests if r.fault is not None and (kind is None or r.fault == kind))

    def stop(self) -> None:
        self._stop.set()  # wake stalled handlers
        super().stop()


def wait_until(pred, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


# ---- fixtures (every test module has them: conftest.py lists this module in pytest_plugins) ----

import pytest  # noqa: E402

import ckptio  # noqa: E402

MiB = 1024 * 1024
# fast failure settings for tests: a stall is noticed after 1 s, a request gives up after 4 attempts
FAST = {"max_attempts": 4, "deadline": 30.0, "stall_timeout": 1.0, "connect_timeout": 2.0}


def _setup(flavor: str, endpoint: str, **options) -> FaultProxy:
    from conftest import S3_TEST_OPTIONS, _unique
    from servers import make_gcs_bucket, make_s3_bucket

    p = FaultProxy(endpoint, flavor=flavor).start()
    bucket = _unique("f")
    if flavor == "s3":
        make_s3_bucket(endpoint, bucket)
        ckptio.configure(
            backends={
                "s3": {
                    "endpoint_url": p.url,
                    **S3_TEST_OPTIONS,
                    "part_size": 5 * MiB,
                    "concurrency": 3,
                    **FAST,
                    **options,
                }
            }
        )
        p.uri = f"s3://{bucket}"  # type: ignore[attr-defined]
    else:
        make_gcs_bucket(endpoint, bucket)
        ckptio.configure(
            backends={
                "gcs": {
                    "endpoint_url": p.url,
                    "anon": True,
                    "project": "test",
                    "part_size": 256 * 1024,
                    "concurrency": 3,
                    **FAST,
                    **options,
                }
            }
        )
        p.uri = f"gs://{bucket}"  # type: ignore[attr-defined]
    p.endpoint = endpoint  # type: ignore[attr-defined]
    p.bucket = bucket  # type: ignore[attr-defined]
    return p


@pytest.fixture
def s3_faults(s3_endpoint):
    p = _setup("s3", s3_endpoint)
    yield p
    p.stop()


@pytest.fixture
def gcs_faults(gcs_endpoint):
    p = _setup("gcs", gcs_endpoint)
    yield p
    p.stop()


@pytest.fixture(params=["s3", "gcs"])
def faults(request):
    """A FaultProxy in front of the S3 or GCS server; ``faults.uri`` is a fresh bucket routed through it."""
    return request.getfixturevalue(f"{request.param}_faults")
