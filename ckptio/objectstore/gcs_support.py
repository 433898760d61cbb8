"""GCS-only request machinery, kept out of :mod:`ckptio.backends.gcs` so the storage keeps its request
hooks: the error a reply other than the one asked for becomes (:class:`HTTPStatus`), its retry
classification (:func:`classify`), object names in URLs, and what a ranged GET's reply tells (its
generation, checked against a pin, and the object's size) on both of the backend's paths, the IO loop's
and the caller thread's (:mod:`ckptio.objectstore.here`).

Imported by :mod:`ckptio.backends.gcs` after its dependency check (it imports aiohttp).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import aiohttp

from . import ranged as _ranged
from . import retry as _retry


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
