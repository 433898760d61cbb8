"""Pure URI helpers: split a URI into scheme and path, join paths. No I/O."""

from __future__ import annotations

import os
import re

from .errors import InvalidURIError, redact

_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
# a path that starts like a URI with its '//' missing or mangled: "s3:/b/k", "s3:b", " S3 :/b", "s3:\\b"
_LEADING_SCHEME_RE = re.compile(r"\s*([A-Za-z][A-Za-z0-9+.\-]*)\s*:[\s/\\]*")


def scheme_of(uri: str) -> str:
    """Return the scheme of ``uri`` (``"s3"``), or ``""`` for a bare local path."""
    m = _SCHEME_RE.match(uri)
    return m.group(1).lower() if m else ""


def split(uri: str) -> tuple[str, str]:
    """Split ``"s3://b/k"`` into ``("s3", "b/k")``; a bare path gives ``("", path)``."""
    if not isinstance(uri, str):
        if isinstance(uri, os.PathLike):
            return "", os.fspath(uri)
        raise TypeError(f"expected a URI string or os.PathLike, got {type(uri).__name__}: {uri!r}")
    m = _SCHEME_RE.match(uri)
    if not m:
        return "", uri
    return m.group(1).lower(), uri[m.end() :]


def leading_scheme(path: str) -> tuple[str, str] | None:
    """For a bare path whose first component reads ``scheme:`` (``"s3:/b/k"``, ``"s3:b"``, ``" S3 :/b"``):
    the scheme, lowercased, and what follows the colon and any slashes; None for a URI or any other path.
    Whether the scheme is one ckptio knows (a mistyped URI) is the caller's question."""
    m = None if _SCHEME_RE.match(path) else _LEADING_SCHEME_RE.match(path)
    return (m.group(1).lower(), path[m.end() :]) if m else None


def masked(path: str | os.PathLike) -> str:
    """``path`` as a message may show it: :func:`~ckptio.errors.redact`'s masking, also where ``path`` is a URI
    mistyped without its '//' (``s3:/KEY:SECRET@b/k``, ``https:/h/x?X-Amz-Signature=...``)."""
    path = str(os.fspath(path))
    found = leading_scheme(path)
    if found is None:
        return redact(path)
    scheme, rest = found
    return path[: len(path) - len(rest)] + redact(f"{scheme}://{rest}")[len(scheme) + 3 :]


def bucket_key(uri: str) -> tuple[str, str]:
    """Split an object-store URI into bucket and key (``"s3://b/a/k"`` -> ``("b", "a/k")``)."""
    scheme, rest = split(uri)
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise InvalidURIError(f"URI has no bucket: {uri!r} (expected {scheme or 's3'}://BUCKET/KEY)")
    if "@" in bucket:  # no bucket name holds one: credentials (the error masks them), never sent as a name
        raise InvalidURIError(
            f"URI holds credentials before its bucket: {uri!r}; give them in settings or the environment"
        )
    return bucket, key


def join_path(base: str, *parts: str) -> str:
    """Join path segments with ``/`` (or ``os.path.join`` for bare local paths)."""
    base = os.fspath(base)
    scheme, _ = split(base)
    if not scheme:
        return os.path.join(base, *parts)
    out = base
    for p in parts:
        p = p.lstrip("/")
        out = out if not p else (out.rstrip("/") + "/" + p if not out.endswith("://") else out + p)
    return out


def basename(uri: str) -> str:
    return split(uri)[1].rstrip("/").rsplit("/", 1)[-1]


def parent(uri: str) -> str:
    scheme, rest = split(uri)
    head = rest.rstrip("/").rsplit("/", 1)[0] if "/" in rest.rstrip("/") else ""
    return f"{scheme}://{head}" if scheme else (head or ".")
