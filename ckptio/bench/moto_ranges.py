"""moto's S3 server with ranged GETs that read only their range, as S3 serves them.

moto answers ``GET`` with ``Range: bytes=a-b`` (or ``bytes=-n``) by reading the whole object out of its
buffer (a temporary file past 16 MiB) and slicing it, so a ranged read costs time in proportion to the
*object's* size: a 1 MiB range took 0.016 s from a 1 MiB object, 0.097 s from a 64 MiB one and 0.33 s from a 256 MiB one
(moto 5.2, this machine). Real object stores do not behave like that, and it penalises any reader that
splits one large object into parallel ranges (ckptio's ``.fpk`` and ``.pt`` loads, s3fs's block reads)
against formats stored as many smaller objects (DCP's files). ``ckptio bench --profile realistic``, which
models a remote store, runs this server; the loopback profile runs moto as it is.

Run as ``python -m ckptio.bench.moto_ranges`` with moto.server's arguments. Nothing else changes: the
response is the same bytes and headers; only where moto gets the bytes from differs.
"""

from __future__ import annotations

import re
import sys
import threading
from typing import Any

_RANGE = re.compile(r"^bytes=(\d+)-(\d+)$")
_SUFFIX = re.compile(r"^bytes=-(\d+)$")
# the current GET's byte range: (first, last), or (None, n) for its last n bytes; else None
_request = threading.local()


class _Window(bytes):
    """The bytes of one range standing in for a whole object: ``len`` is the object's size and slicing
    the range returns its bytes (what moto's range handling asks of the value)."""

    begin: int
    size: int

    def __new__(cls, data: bytes, begin: int, size: int) -> _Window:
        self = super().__new__(cls, data)
        self.begin, self.size = begin, size
        return self

    def __len__(self) -> int:
        return self.size

    def __bool__(self) -> bool:
        return self.size > 0

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice) and key.step is None and key.start == self.begin:
            stop = min(key.stop, self.size) if key.stop is not None else self.size
            return bytes.__getitem__(self, slice(0, stop - self.begin))
        raise RuntimeError("moto_ranges: moto read an object's bytes other than the requested range")


def patch() -> None:
    from moto.s3 import models, responses

    fake_key: Any = models.FakeKey
    s3_response: Any = responses.S3Response
    key_response = s3_response.key_response
    value = fake_key.__dict__["value"]  # the property

    def ranged_key_response(self: Any, request: Any, full_url: str, headers: Any) -> Any:
        header = (request.headers.get("range") or "") if request.method == "GET" else ""
        m, tail = _RANGE.match(header), _SUFFIX.match(header)
        _request.range = (int(m[1]), int(m[2])) if m and int(m[1]) <= int(m[2]) else None
        if tail and int(tail[1]):
            _request.range = (None, int(tail[1]))
        try:
            return key_response(self, request, full_url, headers)
        finally:
            _request.range = None

    def ranged_value(self: Any) -> bytes:
        rng = getattr(_request, "range", None)
        size = self.size
        if rng is not None and rng[0] is None:  # the last n bytes
            rng = (max(0, size - rng[1]), size - 1)
        if rng is None or rng[0] >= size:  # not a ranged GET, or one moto answers with an error
            return value.fget(self)
        first, last = rng[0], min(rng[1], size - 1)
        with self.lock:
            self._value_buffer.seek(first)
            data = self._value_buffer.read(last - first + 1)
        return _Window(data, first, size)

    s3_response.key_response = ranged_key_response
    fake_key.value = property(ranged_value, value.fset)


def main(argv: list[str] | None = None) -> None:
    patch()
    from moto.server import main as moto_main

    moto_main(argv if argv is not None else sys.argv[1:])


if __name__ == "__main__":
    main()
