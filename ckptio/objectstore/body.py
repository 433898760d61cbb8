"""Request bodies over the caller's memory, and the aiohttp session setting the stores need.

:class:`MemoryBody` is a request body that neither botocore nor aiohttp copies (registered with
aiohttp as its own payload type on import); :func:`no_hidden_retries` keeps aiohttp from re-sending
a request behind the retry policy's back.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import aiohttp.payload

from ..backends.base import Buffer
from ..backends.readers import BytesReader

SEND_CHUNK = 1024 * 1024  # what an upload hands the socket at a time


class MemoryBody(BytesReader):
    """A read-only, seekable file over a buffer, sent without copying it.

    botocore hashes and measures it through ``read``/``seek``/``tell``; aiohttp sends it through
    :class:`_MemoryPayload` in ``SEND_CHUNK`` slices. A plain ``bytes``/``bytearray`` body would be
    handed to the socket transport whole, which (Python < 3.12) copies the unsent rest of it, i.e.
    a second copy of every part in flight. Make a new one for each attempt of a request.
    ``sha256``: the hex SHA-256 of the whole view, when the caller computed it (a signer may use it
    instead of reading the body on the event-loop thread).
    """

    def __init__(self, data: Buffer, uri: str = "<memory>", sha256: str | None = None) -> None:
        super().__init__(data, uri)
        self.sha256 = sha256

    @property
    def view(self) -> memoryview:
        return self._mv

    def __len__(self) -> int:
        return self.size

    def read(self, size: int | None = -1) -> bytes:  # one copy (RawIOBase.read makes two)
        end = self.size if size is None or size < 0 else min(self.size, self._pos + size)
        out = bytes(self._mv[self._pos : end]) if end > self._pos else b""
        self._pos = max(self._pos, end)
        return out

    def close(self) -> None:  # aiohttp closes payloads; the view stays usable for a retry's new body
        pass


class _MemoryPayload(aiohttp.payload.Payload):
    """aiohttp's payload for :class:`MemoryBody`: slices of the caller's memory, with backpressure."""

    def __init__(self, value: Any, *args: Any, **kwargs: Any) -> None:
        body = getattr(value, "__wrapped__", value)  # aiobotocore wraps file objects in a proxy
        kwargs.setdefault("content_type", "application/octet-stream")
        super().__init__(body, *args, **kwargs)
        self._size = len(body.view) - body.tell()

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return bytes(self._value.view[self._value.tell() :]).decode(encoding, errors)

    async def write(self, writer: Any) -> None:
        await self.write_with_length(writer, None)

    async def write_with_length(self, writer: Any, content_length: int | None) -> None:
        view = self._value.view[self._value.tell() :]
        if content_length is not None:
            view = view[:content_length]
        for i in range(0, len(view), SEND_CHUNK):
            await writer.write(view[i : i + SEND_CHUNK])  # drains when the transport holds > 64 KiB


aiohttp.payload.register_payload(_MemoryPayload, MemoryBody, order=aiohttp.payload.Order.try_first)


def no_hidden_retries(session: Any) -> Any:
    """Stop an ``aiohttp.ClientSession`` from silently re-sending an idempotent request (GET, PUT,
    HEAD, DELETE) once when a pooled connection breaks: :class:`ckptio.objectstore.retry.RetryPolicy` owns
    retries, and a hidden re-send of an upload chunk can corrupt a resumable upload's offsets.
    aiohttp has no public switch; the private flag is set only where it exists."""
    if hasattr(session, "_retry_connection"):
        session._retry_connection = False
    return session
