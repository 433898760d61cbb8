"""Bucket and object names, checked where a URI becomes a bucket and a key (the object stores'
``_split``), before any request is built from them.

A bucket name becomes a URL's host label or path segment: it must follow the store's naming rule, so
that no character of it (``#``, ``?``, ``%``, ``/``, ``..``) can end the segment and make the request
name another resource (the bucket itself, another bucket). The rules are the stores' own:

* S3: 3-255 letters, digits, ``.``, ``-`` and ``_``, starting and ending with a letter or a digit, no
  ``..`` (AWS asks 3-63 lowercase for new buckets; older ones and other S3 servers allow the rest,
  as botocore does);
* GCS: 3-63 lowercase letters, digits, ``-``, ``_`` and ``.`` (up to 222 with dots, each dot-separated
  part at most 63), starting and ending with a letter or a digit.

An object name is sent quoted (or as a client's parameter), never as a URL's structure: it must be
valid UTF-8 of at most 1024 bytes (both stores' limit), and on GCS neither ``.`` nor ``..`` nor hold a
carriage return or line feed (GCS refuses them; an HTTP client would resolve ``.``/``..`` as path steps).
A call on an object needs a key: ``s3://bucket`` alone names no object.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import InvalidURIError

MAX_KEY_BYTES = 1024


@dataclass(frozen=True)
class Rule:
    """A store's naming rule: ``bucket`` (a full match), in words for the error (``says``)."""

    store: str
    bucket: re.Pattern[str]
    says: str
    dot_keys: bool = True  # "." and ".." are object names
    line_breaks: bool = True  # an object name may hold CR and LF

    def check(self, uri: str, bucket: str, key: str) -> None:
        """Raise :class:`~ckptio.errors.InvalidURIError` naming ``uri`` and the rule ``bucket``/``key`` break."""
        if not self.bucket.fullmatch(bucket) or ".." in bucket:
            raise InvalidURIError(f"{uri!r}: {bucket!r} is not a valid {self.store} bucket name; they are {self.says}")
        try:
            size = len(key.encode("utf-8"))
        except UnicodeError:
            raise InvalidURIError(f"{uri!r}: object names on {self.store} must be valid UTF-8") from None
        if size > MAX_KEY_BYTES:
            raise InvalidURIError(
                f"{uri!r}: object names on {self.store} are at most {MAX_KEY_BYTES} bytes, not {size}"
            )
        if not self.dot_keys and key in (".", ".."):
            raise InvalidURIError(f"{uri!r}: {key!r} is not a valid object name on {self.store}")
        if not self.line_breaks and ("\r" in key or "\n" in key):
            raise InvalidURIError(f"{uri!r}: object names on {self.store} cannot hold a carriage return or line feed")


S3 = Rule(
    "S3",
    re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{1,253}[A-Za-z0-9]"),
    "3-255 letters, digits, '.', '-' or '_', starting and ending with a letter or digit",
)
GCS = Rule(
    "GCS",
    re.compile(r"(?=.{3,63}\Z|(?=.{3,222}\Z)[^.]{1,63}(?:\.[^.]{1,63})+\Z)[a-z0-9][a-z0-9._-]*[a-z0-9]"),
    "3-63 lowercase letters, digits, '-', '_' or '.' (up to 222 with dots, at most 63 between them), "
    "starting and ending with a letter or digit",
    dot_keys=False,
    line_breaks=False,
)
