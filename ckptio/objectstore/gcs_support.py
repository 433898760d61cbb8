"""GCS-only request machinery, kept out of :mod:`ckptio.backends.gcs` so the storage keeps its request
hooks: the error a reply other than the one asked for becomes (:class:`HTTPStatus`), its retry
classification (:func:`classify`), object names in URLs, what a ranged GET's reply tells (its
generation, checked against a pin, and the object's size) on both of the backend's paths, the IO loop's
and the caller thread's (:mod:`ckptio.objectstore.here`), and the JSON API's metadata replies read
(:func:`parse_json`, :func:`entry`, :func:`listing`): one that is not what the API describes (nested
too deep to parse, a size that is not a number) is a :class:`~ckptio.errors.TransferError` naming the object.

Imported by :mod:`ckptio.backends.gcs` after its dependency check (it imports aiohttp).
"""

from __future__ import annotations

import errno
import json
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import aiohttp

from ..errors import CredentialsError, TransferError
from . import ranged as _ranged
from . import retry as _retry
from .backend import Entry

MAX_SIZE = 1 << 62  # more than any object GCS holds (5 TiB)


class HTTPStatus(Exception):
    """A GCS reply other than the one asked for: its status and (JSON) error body."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(status)
        self.status, self.body = status, body

    def message(self) -> str:
        try:
            return str(json.loads(self.body)["error"]["message"])
        except Exception:
            return self.body[:200].decode("utf-8", "replace")


def bearer_token(creds: Any) -> str:
    """The OAuth access token a ``credential_provider`` returned (a string, or a dict with ``token``)."""
    tok = creds.get("token") or creds.get("access_token") if isinstance(creds, dict) else creds
    tok = tok.strip() if isinstance(tok, str) else tok  # a token read from a file ends with a newline
    if not isinstance(tok, str) or not tok:
        raise CredentialsError(
            "gcs credential_provider",
            "the GCS credential_provider must return an OAuth access token (a string) or a dict with 'token'",
        )
    return tok


def quote_key(key: str) -> str:
    """An object name as one path segment of the JSON API's URLs."""
    return quote(key, safe="")


def classify(e: BaseException) -> str:
    """TRANSIENT / EXPIRED / PERMANENT for any error on the GCS path (see :mod:`ckptio.objectstore.retry`)."""
    if isinstance(e, HTTPStatus):
        return _retry.EXPIRED if e.status == 401 else _retry.classify_status(e.status)
    if isinstance(e, (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, json.JSONDecodeError)):
        return _retry.TRANSIENT
    common = _retry.classify_common(e)
    return common if common is not None else _retry.PERMANENT


def on_read_headers(
    uri: str, on_size: Callable[[int], None] | None, pin: _ranged.VersionPin | None, status: int, headers: Any
) -> None:
    """A ranged GET's headers: its generation checked against the pinned one, then its size told."""
    if pin is not None:  # header names in lower case: aiohttp's headers and a direct reply's both have them
        pin.check(uri, headers.get("x-goog-generation"))
    if on_size is not None:
        size = _retry.object_size(status, headers.get("content-range"), headers.get("content-length"))
        if size is not None:
            on_size(size)


def read_params(pin: _ranged.VersionPin | None) -> tuple[dict[str, str], str | None]:
    """A read's query parameters, and the generation they ask for (a pinned one)."""
    params = {"alt": "media"}
    pinned = pin.version if pin is not None and pin.version and pin.version.isdigit() else None
    if pinned:
        params["generation"] = pinned  # that generation's bytes, or 404 once it is gone
    return params, pinned


def malformed(uri: str, what: str) -> TransferError:
    return TransferError(errno.EIO, f"GCS answered a metadata request for {uri} with {what}", uri)


def parse_json(body: bytes, uri: str) -> Any:
    """A metadata reply's JSON object (``{}`` for an empty body). A truncated body raises
    ``json.JSONDecodeError`` (retried); JSON nested too deep to parse, or not an object, a TransferError."""
    if not body:
        return {}
    try:
        out = json.loads(body)
    except RecursionError:
        raise malformed(uri, "JSON nested too deep") from None
    if not isinstance(out, dict):
        raise malformed(uri, f"JSON {type(out).__name__}, not an object")
    return out


def entry(o: Any, uri: str, parse_time: Callable[[str], Any]) -> Entry:
    """An object resource as (name, size, mtime, generation); ``parse_time``: RFC 3339 to a datetime."""
    size = str(o.get("size", 0)) if isinstance(o, dict) else ""
    name = o.get("name") if isinstance(o, dict) else None
    if not isinstance(name, str) or not (size.isascii() and size.isdigit() and int(size) < MAX_SIZE):
        raise malformed(uri, f"an object without a valid name and size (size {size[:40]!r})")
    mtime = None
    if o.get("updated"):
        try:
            mtime = parse_time(o["updated"]).timestamp()
        except (AssertionError, AttributeError, TypeError, ValueError, OverflowError):
            raise malformed(uri, f"an object updated at {str(o['updated'])[:40]!r}, not a time") from None
    return name, int(size), mtime, str(o.get("generation"))


def listing(r: dict, uri: str, parse_time: Callable[[str], Any]) -> tuple[list[Entry], list[str], str | None]:
    """A list reply's objects, prefixes and next page token."""
    items, prefixes, token = r.get("items", []), r.get("prefixes", []), r.get("nextPageToken") or None
    if not isinstance(items, list) or not isinstance(prefixes, list) or not all(isinstance(p, str) for p in prefixes):
        raise malformed(uri, "a listing whose items or prefixes are not lists of objects and names")
    if token is not None and not isinstance(token, str):
        raise malformed(uri, "a listing whose next page token is not a string")
    return [entry(o, uri, parse_time) for o in items], prefixes, token
