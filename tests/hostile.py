"""A hostile HTTP proxy on loopback, in front of moto (S3) or the GCS emulator: it changes the GETs of an
object's bytes (a ``Range`` header, or GCS's ``alt=media``) and their replies, as a broken or malicious
server, cache or middlebox would. Every other request passes through unchanged. Nothing here knows how
ckptio sends its requests: the same proxy stands in front of any client of the two APIs.

    with HostileProxy(server.url, answer=gzipped) as p:      # every object GET's reply gzip-encoded
        ... use p.url as the endpoint ...

``ask(asked)`` may change a data GET's request headers before it is forwarded (``shifted``: other bytes
than asked for, named truthfully by the reply); ``answer(reply, headers)`` gets the upstream's reply (and
the request headers the client sent) and returns the one to send. A reply whose ``length`` is set
announces that ``Content-Length`` whatever its body; the connection is closed after it. ``match``
chooses other requests than data GETs (a GCS metadata GET, say).
"""

from __future__ import annotations

import gzip
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from urllib.parse import urlsplit

from servers import LoopbackProxy, ProxyHandler


@dataclass
class Reply:
    status: int
    headers: list[tuple[str, str]]
    body: bytes
    length: int | None = None  # a Content-Length other than len(body)

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k.lower() == name.lower()), None)

    def without(self, *names: str) -> list[tuple[str, str]]:
        drop = {n.lower() for n in names}
        return [(k, v) for k, v in self.headers if k.lower() not in drop]


@dataclass
class Asked:
    """A data GET as the client sent it."""

    path: str
    headers: dict[str, str]

    def range(self) -> str | None:
        return next((v for k, v in self.headers.items() if k.lower() == "range"), None)


Ask = Callable[[Asked], dict[str, str]]
Answer = Callable[[Reply, Asked], Reply]


def credentials(path: str, headers: dict[str, str]) -> bool:
    """Whether a request carries credentials: a signed header or a presigned URL's signature."""
    return any(k.lower() == "authorization" for k in headers) or "signature=" in path.lower()


def is_data_get(method: str, path: str, headers: dict[str, str]) -> bool:
    """A GET of an object's bytes (not a listing, a metadata GET or a GCS precondition check)."""
    if method != "GET":
        return False
    if "alt=media" in path:
        return True
    return any(k.lower() == "range" for k in headers) and "/o?" not in path and "list-type" not in path


@dataclass
class HostileProxy(LoopbackProxy):
    upstream: str
    ask: Ask | None = None
    answer: Answer | None = None
    match: Callable[[str, str, dict[str, str]], bool] = is_data_get  # (method, path, headers): change it?
    requests: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)  # (method, path, headers)
    changed: int = 0  # data GETs whose request or reply was changed
    thread_name = "hostile-proxy"

    def __post_init__(self) -> None:
        proxy = self

        class Handler(ProxyHandler):
            upstream = urlsplit(self.upstream)

            def finish(self) -> None:
                try:
                    super().finish()
                except (OSError, ValueError):
                    pass

            def _relay(self) -> None:
                body = self._body()
                sent = Asked(self.path, dict(self.headers.items()))
                data_get = proxy.match(self.command, self.path, sent.headers)
                with proxy._lock:
                    proxy.requests.append((self.command, self.path, sent.headers))
                if data_get and proxy.ask is not None:
                    new = proxy.ask(sent)
                    if new != sent.headers:
                        for k in set(self.headers.keys()):
                            del self.headers[k]
                        for k, v in new.items():
                            self.headers[k] = v
                        proxy._count()
                status, reason, headers, payload = self._forward(body)
                reply = Reply(status, headers, payload)
                if data_get and proxy.answer is not None:
                    new_reply = proxy.answer(reply, sent)
                    if new_reply is not reply:
                        proxy._count()
                    reply = new_reply
                length = reply.length
                if length is None:
                    head_len = reply.header("content-length")
                    length = int(head_len) if self.command == "HEAD" and head_len else len(reply.body)
                else:
                    self.close_connection = True
                self._head(reply.status, reason if reply.status == status else "", reply.headers, length)
                if self.command != "HEAD":
                    self.wfile.write(reply.body)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _relay

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address) -> None:
                pass  # a client that gives up on a reply resets the connection: the point here

        self._serve(Handler, Server)

    def _count(self) -> None:
        with self._lock:
            self.changed += 1


# ---- what a hostile server does ------------------------------------------------------------------

_RANGE = re.compile(r"bytes=(\d*)-(\d*)")
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


def shifted(by: int) -> Ask:
    """Ask the server for other bytes than the client did (``by`` further on; the first bytes instead of a
    suffix): the reply's ``Content-Range`` names them truthfully."""

    def ask(sent: Asked) -> dict[str, str]:
        m = _RANGE.fullmatch(sent.range() or "")
        if m is None:
            return sent.headers
        out = {k: v for k, v in sent.headers.items() if k.lower() != "range"}
        start, end = m.groups()
        if not start:  # a suffix of N bytes: the first N instead
            out["Range"] = f"bytes=0-{int(end) - 1}"
        else:
            out["Range"] = f"bytes={int(start) + by}-{int(end) + by if end else ''}"
        return out

    return ask


def relabelled(by: int) -> Answer:
    """The server's bytes under a ``Content-Range`` that names other bytes (``by`` further on)."""

    def answer(reply: Reply, sent: Asked) -> Reply:
        m = _CONTENT_RANGE.fullmatch(reply.header("content-range") or "")
        if reply.status != 206 or m is None:
            return reply
        s, e, total = int(m.group(1)) + by, int(m.group(2)) + by, m.group(3)
        return Reply(206, [*reply.without("content-range"), ("Content-Range", f"bytes {s}-{e}/{total}")], reply.body)

    return answer


def redirected(to: str, status: int = 302, *, later: bool = False) -> Answer:
    """A redirect of every object GET (``later``: of those after an object's first bytes) to the same path
    on the server ``to`` (another host)."""

    def answer(reply: Reply, sent: Asked) -> Reply:
        if later and (sent.range() or "bytes=0-").startswith("bytes=0-"):
            return reply
        return Reply(status, [("Location", to + sent.path), ("Content-Type", "text/plain")], b"")

    return answer


def forged(size: int) -> Answer:
    """Whatever the server answered, other bytes of an object of ``size`` bytes: exactly the range asked
    for, under a ``Content-Range`` that names it (a host that needs no credentials, serving its own bytes)."""

    def answer(reply: Reply, sent: Asked) -> Reply:
        m = _RANGE.fullmatch(sent.range() or "")
        if m is None or not m.group(1):
            return Reply(200, [("Content-Type", "application/octet-stream")], b"\x5a" * size)
        first = int(m.group(1))
        last = min(int(m.group(2)) if m.group(2) else size - 1, size - 1)
        rng = f"bytes {first}-{last}/{size}"
        return Reply(
            206, [("Content-Range", rng), ("Content-Type", "application/octet-stream")], b"\x5a" * (last - first + 1)
        )

    return answer


def gzipped(reply: Reply, sent: Asked, *, consistent: bool = True) -> Reply:
    """The body gzip-encoded (``Content-Encoding: gzip``); ``consistent``: a 206's ``Content-Range``
    rewritten to the compressed length, as if those were the object's bytes."""
    if reply.status not in (200, 206):
        return reply
    body = gzip.compress(reply.body, compresslevel=1)
    headers = [*reply.without("content-encoding", "content-range"), ("Content-Encoding", "gzip")]
    if reply.status == 206:
        rng = reply.header("content-range") or ""
        headers.append(("Content-Range", f"bytes 0-{len(body) - 1}/{len(body)}" if consistent else rng))
    return Reply(reply.status, headers, body)
