"""A loopback TCP proxy that makes a local object-store server behave like a remote one: each response's
first byte waits ``latency`` seconds after the request's last byte (S3's first-byte latency), and each
connection moves at most ``bandwidth`` bytes/s in each direction (one S3 stream's throughput), so
concurrency and round trips cost what they cost against real storage.

    with LatencyProxy(server.url, latency=0.020, bandwidth=90e6) as p:
        ... use p.url as the endpoint ...

It relays bytes, not HTTP: any protocol with request/response turns on one connection works (HTTP/1.1
keep-alive included). ``ckptio bench --profile realistic`` puts one in front of each embedded server, in
its own process (``python -m ckptio.bench.proxy UPSTREAM_URL --port P``, :class:`~ckptio.bench.servers.
ProxyServer`), so its relaying does not compete with the measured client for one interpreter's lock.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import socket
import threading
import time
from typing import Any
from urllib.parse import urlsplit

DEFAULT_LATENCY = 0.020  # s, before the first byte of each response
DEFAULT_BANDWIDTH = 90e6  # bytes/s per connection and direction: one fsspec S3 stream (published figure)
_CHUNK = 256 * 1024


class _Pacer:
    """Holds a stream to ``rate`` bytes/s: :meth:`wait` returns when ``n`` more bytes may go out."""

    def __init__(self, rate: float) -> None:
        self.rate, self.free_at = rate, 0.0

    def wait(self, n: int) -> None:
        now = time.monotonic()
        self.free_at = max(self.free_at, now) + n / self.rate  # idle time earns no credit
        if self.free_at > now:
            time.sleep(self.free_at - now)


class _Connection:
    """One client connection and its upstream: two pumps, the request/response turn between them."""

    def __init__(self, proxy: LatencyProxy, client: socket.socket) -> None:
        self.proxy, self.client = proxy, client
        self.upstream = socket.create_connection(proxy.upstream, timeout=None)
        self.lock = threading.Lock()
        self.request_end: float | None = None  # when the pending request's last byte came in
        for s in (client, self.upstream):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=self._pump, args=(client, self.upstream, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, request: bool) -> None:
        pacer = _Pacer(self.proxy.bandwidth)
        try:
            while data := src.recv(_CHUNK):
                if request:
                    pacer.wait(len(data))
                    with self.lock:
                        self.request_end = time.monotonic()
                else:
                    with self.lock:
                        end, self.request_end = self.request_end, None
                    if end is not None:  # the response's first bytes: the round trip
                        delay = end + self.proxy.latency - time.monotonic()
                        if delay > 0:
                            time.sleep(delay)
                    pacer.wait(len(data))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
            if not request:
                self.close()

    def close(self) -> None:
        for s in (self.client, self.upstream):
            with contextlib.suppress(OSError):
                s.close()
        with contextlib.suppress(ValueError):
            self.proxy._conns.remove(self)


class LatencyProxy:
    """A proxy on a free 127.0.0.1 port in front of ``upstream_url`` (``http://host:port``); ``url`` is
    its endpoint. ``start``/``stop`` or ``with``."""

    def __init__(
        self, upstream_url: str, latency: float = DEFAULT_LATENCY, bandwidth: float = DEFAULT_BANDWIDTH, port: int = 0
    ):
        check_wan(latency, bandwidth)
        u = urlsplit(upstream_url)
        self.upstream = (u.hostname or "127.0.0.1", u.port or 80)
        self.latency, self.bandwidth = latency, bandwidth
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", port))
        self.url = f"{u.scheme or 'http'}://127.0.0.1:{self._sock.getsockname()[1]}"
        self._conns: list[_Connection] = []
        self.connections = 0  # accepted so far
        self._stopped = threading.Event()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            self.connections += 1
            try:
                self._conns.append(_Connection(self, client))
            except OSError:
                client.close()  # the upstream refused: the client sees the connection close

    def start(self) -> LatencyProxy:
        self._sock.listen(128)
        threading.Thread(target=self._accept, name="latency-proxy", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() (close alone does not, on Linux)
        self._sock.close()
        for c in list(self._conns):
            c.close()

    def __enter__(self) -> LatencyProxy:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def describe(self) -> str:
        return describe_wan(self.latency, self.bandwidth)


def check_wan(latency: float, bandwidth: float) -> None:
    if latency < 0 or bandwidth <= 0:
        raise ValueError(f"latency must be >= 0 and bandwidth > 0, got {latency} s and {bandwidth} B/s")


def describe_wan(latency: float, bandwidth: float) -> str:
    return f"{latency * 1e3:g} ms before each response, {bandwidth / 1e6:g} MB/s per connection"


def main(argv: list[str] | None = None) -> None:
    """Serve a proxy in front of UPSTREAM_URL on --port until SIGTERM or SIGINT."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("upstream_url")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--latency", type=float, default=DEFAULT_LATENCY, help="seconds before each response")
    ap.add_argument("--bandwidth", type=float, default=DEFAULT_BANDWIDTH, help="bytes/s per connection")
    args = ap.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with LatencyProxy(args.upstream_url, args.latency, args.bandwidth, args.port):
        stop.wait()


if __name__ == "__main__":
    main()
