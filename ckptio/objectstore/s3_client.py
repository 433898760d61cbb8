"""How the S3 backend's client is configured, kept out of :mod:`ckptio.backends.s3` so the storage
keeps its request hooks: :class:`S3ClientConfig` turns the endpoint, region and credential options
(``credentials_file``, the environment, a ``credential_provider``) into one s3fs filesystem with
botocore's retries off; :func:`own_retries` hooks every aiobotocore client it opens (retries left to
:class:`~ckptio.objectstore.retry.RetryPolicy`, the prehashed ``s3v4`` signer); :func:`credentials_from`
reads what a ``credential_provider`` returns; :func:`direct_route` tells whether a presigned GET may go
around the client's HTTP session (:mod:`.direct`), with that session's TLS settings; :func:`client_get`
sends the client's own GetObject and reads its reply as a direct one (:class:`ClientReply`). The aiobotocore
names these reach into are in this module only.

Imported by :mod:`ckptio.backends.s3` after its client-version check (it imports s3fs and botocore).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import errno
import os
import re
from collections.abc import Callable
from typing import Any

import s3fs

from ..errors import CredentialsError, TransferError
from . import body as _body
from . import retry as _retry
from .s3_support import PREHASHED_SIGNER, choose_prehashed_signer, load_credentials_file


@dataclasses.dataclass(frozen=True)
class S3ClientConfig:
    """Where the S3 backend sends its requests and the credentials it signs them with (secrets stay
    out of the repr). Explicit options win over ``credentials_file``, which wins over the environment
    (region) or boto's default chain (credentials); a ``credential_provider`` replaces them all."""

    endpoint_url: str | None
    region: str
    anon: bool
    profile: str | None
    key: str | None = dataclasses.field(default=None, repr=False)
    secret: str | None = dataclasses.field(default=None, repr=False)
    token: str | None = dataclasses.field(default=None, repr=False)

    @classmethod
    def from_options(
        cls,
        *,
        endpoint_url: str | None,
        region: str | None,
        profile: str | None,
        access_key_id: str | None,
        secret_access_key: str | None,
        session_token: str | None,
        credentials_file: str | None,
        anon: bool,
        provider: Any = None,
    ) -> S3ClientConfig:
        creds = load_credentials_file(credentials_file) if credentials_file else {}
        key = access_key_id or creds.get("aws_access_key_id") or creds.get("access_key_id")
        secret = secret_access_key or creds.get("aws_secret_access_key") or creds.get("secret_access_key")
        token = session_token or creds.get("aws_session_token") or creds.get("session_token")
        if bool(key) != bool(secret):
            raise CredentialsError(
                credentials_file or "s3 options", "S3 credentials need both an access key id and a secret access key"
            )
        if provider is not None and not anon:  # the provider is the credentials' source
            key, secret, token = credentials_from(provider())
        return cls(
            endpoint_url=endpoint_url or creds.get("endpoint_url") or None,
            region=(
                region
                or creds.get("region_name")
                or creds.get("region")
                or os.environ.get("AWS_REGION")
                or os.environ.get("AWS_DEFAULT_REGION")
                or "us-east-1"
            ),
            anon=bool(anon),
            profile=profile,
            key=key,
            secret=secret,
            token=token,
        )

    def filesystem(self, *, connect_timeout: float, read_timeout: float, max_pool_connections: int) -> Any:
        """The s3fs filesystem whose session and IO loop the backend's requests use."""
        extra = {"profile": self.profile} if self.profile else {}
        return s3fs.S3FileSystem(
            anon=self.anon,
            key=self.key,
            secret=self.secret,
            token=self.token,
            endpoint_url=self.endpoint_url,
            client_kwargs={"region_name": self.region},
            skip_instance_cache=True,
            use_listings_cache=False,
            # botocore's retries are off: RetryPolicy owns them (read_timeout: no bytes for that long)
            config_kwargs={
                "connect_timeout": float(connect_timeout),
                "read_timeout": float(read_timeout),
                "retries": {"total_max_attempts": 1, "mode": "standard"},
                "max_pool_connections": max_pool_connections,
                # the writer sends its own CRC32 and SHA-256 (hashed off the IO thread, see
                # S3Writer._digests in .s3_multipart); botocore would hash every part again on the
                # IO thread (reads are still checked)
                "request_checksum_calculation": "when_required",
            },
            **extra,
        )


def own_retries(client: Any) -> Any:
    """Make aiobotocore's aiohttp sessions leave retries to our policy (see ``no_hidden_retries``)
    and sign uploads with the prehashed SHA-256 signer; returns ``client``."""
    hs = getattr(getattr(client, "_endpoint", None), "http_session", None)
    get = getattr(hs, "_get_session", None)
    if hs is not None and get is not None and not getattr(hs, "_ckptio_owned", False):

        async def get_session(*a: Any, **kw: Any) -> Any:
            return _body.no_hidden_retries(await get(*a, **kw))

        hs._get_session, hs._ckptio_owned = get_session, True
    events = getattr(getattr(client, "meta", None), "events", None)
    if events is not None and PREHASHED_SIGNER is not None:
        for op in ("UploadPart", "PutObject"):
            events.register_first(
                f"choose-signer.s3.{op}", choose_prehashed_signer, unique_id=f"ckptio-prehashed-sha256-{op}"
            )
    if events is not None:
        events.register_first("choose-signer.s3.GetObject", presign_v4, unique_id="ckptio-presign-v4")
    return client


def presign_v4(signature_version: Any = None, **kwargs: Any) -> str | None:
    """choose-signer hook: GetObject URLs are presigned with SigV4 (``s3v4-query``), as requests are
    signed. botocore presigns them with S3's legacy SigV2 (``s3-query``) where the client's signature
    version is not set (the endpoint rules say ``v4``), which AWS regions opened since 2014 refuse;
    anything else (unsigned, SigV4a, S3 Express) is left to botocore."""
    return "s3v4-query" if signature_version in ("s3-query", "v4-query") else None


class ClientReply:
    """The client's GetObject reply as a direct GET's (status, lower-case headers, ``fill``, ``close``)."""

    def __init__(self, resp: dict[str, Any], stall: float) -> None:
        meta = resp.get("ResponseMetadata", {})
        self.status, self.headers = meta.get("HTTPStatusCode"), meta.get("HTTPHeaders", {})
        self._body, self._stall = resp["Body"], stall
        hops = getattr(getattr(self._body, "raw_stream", None), "history", None) or ()
        if hops:  # the client followed a redirect: the reply is that redirect (check_reply refuses it)
            self.status, self.headers = hops[0].status, {"location": str(hops[0].headers.get("Location", ""))}

    async def fill(self, into: list[memoryview], checksum: Any = None) -> int:
        """The body through ``into`` (each piece through ``checksum.update`` too: botocore checks only a
        body read past its end, which a read of exactly its range never is)."""
        total = 0
        async with _retry.StallWatch(self._stall) as watch:
            for view in into:  # the body streams through the buffers in order
                pos = 0
                while pos < len(view):
                    n = await watch(self._body.readinto(view[pos:]))
                    if not n:
                        break
                    if checksum is not None:
                        checksum.update(view[pos : pos + n])
                    pos += n
                total += pos
                if pos < len(view):
                    break
        return total

    def close(self) -> None:
        self._body.close()


async def client_get(s3: Any, uri: str, stall: float, **params: Any) -> ClientReply:
    """The client's own GetObject of ``params``. A TypeError it raises parsing an odd error reply (a 304
    that carries a checksum header) is a TransferError naming ``uri``."""
    try:
        return ClientReply(await s3.get_object(**params), stall)
    except TypeError as e:
        raise TransferError(errno.EIO, f"the S3 client could not read the reply to a GET of {uri}", uri) from e


class BodyChecksum:
    """The checksum S3 sent with a reply (``x-amz-checksum-<algorithm>``), and the running one of the
    body as it is read (``update`` takes each piece in order, on any thread)."""

    def __init__(self, header: str, expected: str, checksum: Any) -> None:
        self.header, self.expected, self._checksum = header, expected, checksum

    def update(self, piece: memoryview) -> None:
        self._checksum.update(piece)

    def computed(self) -> str:
        return str(self._checksum.b64digest())

    def matches(self) -> bool:
        return self.computed() == self.expected


_WHOLE_RANGE = re.compile(r"bytes 0-(\d+)/(\d+)")


def body_checksum(headers: dict[str, str]) -> BodyChecksum | None:
    """The checksum to check a GetObject body against, when the reply holds the whole object (no
    ``Content-Range``, or ``bytes 0-(S-1)/S``) and carries a whole-object checksum: the first of
    botocore's algorithms, in its order, whose header is there, valid base64 of its size, and not a
    composite of the parts' (``x-amz-checksum-type: COMPOSITE``, a ``...-N`` value, or, without the type,
    a multipart ETag ``"...-N"``); None otherwise. S3-compatible servers send whole-object checksums with
    partial ranges, and composites without their ``-N``: neither is a body's. botocore's checksum
    classes and order are private names, read here only."""
    import botocore.httpchecksum as hc

    rng = headers.get("content-range")
    if rng is not None:
        m = _WHOLE_RANGE.fullmatch(rng.strip())
        if m is None or int(m.group(1)) + 1 != int(m.group(2)):
            return None
    kind = headers.get("x-amz-checksum-type", "").upper()
    if kind == "COMPOSITE" or (not kind and re.search(r"-\d+\"?$", headers.get("etag", ""))):
        return None
    classes = {**getattr(hc, "_CHECKSUM_CLS", {"crc32": hc.Crc32Checksum}), **getattr(hc, "_CRT_CHECKSUM_CLS", {})}
    order = getattr(hc, "_ALGORITHMS_PRIORITY_LIST", ["crc64nvme", "crc32c", "crc32", "sha1", "sha256"])
    for algorithm in order:
        value = headers.get(f"x-amz-checksum-{algorithm}")
        if not value or "-" in value or algorithm not in classes:
            continue
        checksum = classes[algorithm]()
        try:
            if len(base64.b64decode(value, validate=True)) != len(checksum.digest()):
                continue
        except (binascii.Error, ValueError):
            continue
        return BodyChecksum(f"x-amz-checksum-{algorithm}", value, checksum)
    return None


def direct_route(client: Any, url: str) -> tuple[bool, Callable[[], Any] | None]:
    """Whether a GET of ``url``, which ``client`` presigned, may be sent around the client's HTTP
    session, and (for ``https``) a function building the SSL context that session verifies hosts with
    (it reads the CA bundle: call it off the IO loop). Not where a proxy applies to the URL or the
    session presents a client certificate, nor with an aiobotocore whose session lacks what is read
    here: such GETs stay the session's."""
    hs = getattr(getattr(client, "_endpoint", None), "http_session", None)
    proxies = getattr(hs, "_proxy_config", None)
    build = getattr(hs, "_build_verify_context", None)
    if proxies is None or not callable(build) or getattr(hs, "_cert_file", None) or not hasattr(hs, "_cert_file"):
        return False, None
    try:
        if proxies.proxy_url_for(url):
            return False, None
    except Exception:  # noqa: BLE001 - an unexpected configuration: the session's own way
        return False, None
    return True, (build if url.startswith("https:") else None)


def credentials_from(creds: Any) -> tuple[str | None, str | None, str | None]:
    """Key, secret and token from the dict a ``credential_provider`` returns (boto-style names too)."""
    if not isinstance(creds, dict):
        raise CredentialsError(
            "s3 credential_provider",
            "the S3 credential_provider must return a dict with "
            "access_key_id, secret_access_key and optionally session_token",
        )
    c = {str(k).lower(): v for k, v in creds.items()}
    return (
        c.get("access_key_id") or c.get("aws_access_key_id"),
        c.get("secret_access_key") or c.get("aws_secret_access_key"),
        c.get("session_token") or c.get("aws_session_token") or c.get("token"),
    )
