"""What the reply to a ranged GET must be before its body is taken for the bytes asked for, on every
read path of both stores (the IO loop's client, a direct GET, a GET from the caller's thread).

:func:`check_reply` runs on the status and headers, before any byte of the body is read:

* a redirect is not followed (the store's client is told not to, or the check finds it did): the error
  names the object and where the server pointed;
* an encoded body (a ``Content-Encoding`` coding other than ``identity`` or S3's ``aws-chunked``: gzip
  from a proxy or a transcoding server) is not the object's stored bytes: an :class:`~ckptio.errors.IntegrityError`;
* a 206 must name, in ``Content-Range``, the bytes asked for (from the byte asked for: more are not
  read; fewer only where the object ends first; none, ``bytes S-(S-1)/S``, where the object ends before the
  start asked, as emulators answer): another range is a :class:`WrongRangeError`, retried as a
  body cut short is, then reported naming the object.

A 200 reply is the object from byte 0: :func:`ckptio.objectstore.retry.check_ranged_status` and
``check_suffix_status`` handle a server that ignores ``Range``. :func:`whole` checks a read that got
fewer bytes than it asked for against the size the store tells (a 416, an empty reply, inside the object).
"""

from __future__ import annotations

import errno
import re
from collections.abc import Mapping
from urllib.parse import urlsplit

from ..errors import IntegrityError, TransferError
from .retry import TruncatedBodyError

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(-?\d+)/(\d+|\*)")
# codings that leave a body as stored: none, ``identity``, and ``aws-chunked``, an upload's framing that
# S3-compatible servers other than AWS keep in the object's metadata and send back with its plain bytes
_STORED = frozenset(("", "identity", "aws-chunked"))


class WrongRangeError(TruncatedBodyError):
    """A 206 reply whose ``Content-Range`` names other bytes than the GET asked for: retried and
    reported as a body cut short is (the retry policy tries again, then names the object)."""


def redirected(uri: str, status: int | None, location: str | None) -> TransferError:
    """The error for a read of ``uri`` answered with a redirect (``location``: where it pointed)."""
    host = urlsplit(location).netloc if location else ""
    where = f" to {host}" if host else ""
    return TransferError(
        errno.EIO,
        f"read of {uri} was answered with a redirect (HTTP {status}){where}, which is not followed: set the "
        "store's endpoint to the server that holds the bucket",
        uri,
    )


def check_reply(uri: str, status: int | None, headers: Mapping[str, str], start: int, end: int) -> None:
    """Raise unless the reply (``status``, ``headers`` with lower-case names) to a GET of bytes
    ``start``..``end - 1`` of ``uri`` (``start < 0``: its last ``-start`` bytes) carries those bytes."""
    if status is not None and 300 <= status < 400:
        raise redirected(uri, status, headers.get("location"))
    encoding = (headers.get("content-encoding") or "").strip().lower()
    if any(c.strip() not in _STORED for c in encoding.split(",")):
        raise IntegrityError(
            f"{uri}: the server sent the object encoded (Content-Encoding: {encoding[:40]}), not its bytes as "
            "stored; a proxy or server that compresses replies is in the way"
        )
    if status != 206:
        return
    rng = (headers.get("content-range") or "").strip()
    m = _CONTENT_RANGE.fullmatch(rng)
    asked = f"the last {-start} bytes" if start < 0 else f"bytes {start}-{end - 1}"
    if m is None or not _names_asked(int(m.group(1)), int(m.group(2)), m.group(3), start, end):
        raise WrongRangeError(f"the server answered {asked} of {uri} with {rng[:80] or 'no Content-Range'!r}")


def _names_asked(first: int, last: int, total: str, start: int, end: int) -> bool:
    """Whether ``bytes first-last/total`` are the bytes asked for (to the object's end, where it is shorter)."""
    size = int(total) if total.isdigit() else None
    if size is not None and first >= size and last == min(first, size) - 1:  # none: past the end, as asked
        return first == start or (start < 0 and size == 0)
    if last < first or (size is not None and last >= size):
        return False
    if start < 0:  # a suffix: the object's last min(n, size) bytes
        return size is not None and last == size - 1 and last - first + 1 == min(-start, size)
    if first != start:
        return False
    return last >= end - 1 or (size is not None and last == size - 1)  # (more than asked: not read)


def whole(uri: str, n: int, size: int, offset: int = 0) -> int:
    """``n``, the bytes a read of ``uri`` from ``offset`` got, where the object holds ``size``: all of
    them (a TransferError otherwise: a reply said the object ends earlier than it does)."""
    if n != max(size - offset, 0):
        raise TransferError(
            errno.EIO,
            f"read of {uri} from byte {offset} ended after {n} bytes, but it holds {size}: read it again",
            uri,
        )
    return n
