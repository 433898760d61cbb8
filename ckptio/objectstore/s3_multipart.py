"""The S3 multipart writer: :class:`S3Writer` fills in :class:`~ckptio.objectstore.multipart.MultipartWriter`
with S3's requests (PutObject, CreateMultipartUpload, UploadPart, CompleteMultipartUpload,
AbortMultipartUpload), each under the backend's retry policy. ``mode="create"`` sends
``If-None-Match: *`` on the PUT or the CompleteMultipartUpload; a precondition failure after an
attempt whose answer was lost is checked against the object's ETag, so it never turns into a false
error. Every body carries a CRC32 (``checksum="crc32"``) and, where SigV4 signs the payload, a SHA-256,
computed once per part, off the IO loop for large parts.

Imported by :mod:`ckptio.backends.s3` after its client-version check (it imports botocore).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import zlib
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from botocore.exceptions import ClientError

from ..backends.base import Buffer, WriteMode
from ..errors import AlreadyExistsError
from . import body as _body
from . import multipart as _multipart
from .s3_support import EXISTS, NOT_FOUND, PREHASHED_SIGNER, error_code

MIN_PART_SIZE = 5 * 1024 * 1024  # S3's minimum for every part but the last
MAX_PARTS = 10_000
_INLINE_HASH_MAX = 64 * 1024  # smaller upload bodies are hashed on the IO loop itself


class S3Requests(Protocol):
    """What :class:`S3Writer` asks of the backend it writes for (:class:`ckptio.backends.s3.S3Backend`)."""

    concurrency: int
    max_buffer_bytes: int | None
    endpoint_url: str | None
    checksum: str
    anon: bool

    @property
    def _loop(self) -> asyncio.AbstractEventLoop: ...

    def translate(self, e: BaseException, uri: str) -> BaseException: ...

    async def _op(
        self,
        uri: str,
        what: str,
        fn: Callable[[Any], Awaitable[Any]],
        on_retry: Callable[[BaseException], Awaitable[None]] | None = None,
    ) -> Any: ...


class S3Writer(_multipart.MultipartWriter):
    """One S3 object written through a multipart upload (one PUT when it fits in a part)."""

    min_part_size = MIN_PART_SIZE
    part_align = 1024 * 1024
    max_parts = MAX_PARTS

    def __init__(self, backend: S3Requests, uri: str, bucket: str, key: str, mode: WriteMode, part_size: int) -> None:
        super().__init__(uri, backend._loop, part_size, backend.concurrency, backend.max_buffer_bytes)
        self._b, self._bucket, self._key = backend, bucket, key
        self._cond = {"IfNoneMatch": "*"} if mode == "create" else {}

    def translate(self, exc: BaseException) -> BaseException:
        return self._b.translate(exc, self.uri)

    async def _request(
        self, what: str, fn: Callable[[Any], Awaitable[Any]], committed: Callable[[], Awaitable[bool]] | None = None
    ) -> Any:
        """One request under the retry policy. If an attempt may have reached S3 (the connection
        broke, no answer) and a retry then fails its precondition, ``committed()`` checks whether
        that earlier attempt in fact succeeded, so a lost response never turns into a false error."""
        ambiguous = False

        async def on_retry(e: BaseException) -> None:
            nonlocal ambiguous
            ambiguous = ambiguous or not isinstance(e, ClientError)

        try:
            return await self._b._op(self.uri, what, fn, on_retry)
        except ClientError as e:
            if (
                ambiguous
                and committed is not None
                and error_code(e)[0] in (EXISTS | {"NoSuchUpload"})
                and await committed()
            ):
                return None
            raise

    async def _etag_is(self, etag: str) -> bool:
        try:
            h = await self._b._op(self.uri, "HEAD", lambda s3: s3.head_object(Bucket=self._bucket, Key=self._key))
        except ClientError:
            return False
        return str(h.get("ETag", "")).strip('"') == etag

    async def _digests(self, data: Buffer) -> tuple[str | None, dict[str, str]]:
        """Hashes of a body, computed once per part and reused by every attempt of it: the SHA-256
        when SigV4 signs the payload (plain http, or https without a CRC32), and the CRC32 S3 checks
        the part against (given as request arguments, so botocore does not hash again). Large bodies are
        hashed on a worker thread (both hashes release the GIL) so the event loop keeps sending other parts."""
        ep = self._b.endpoint_url
        https = not ep or ep.lower().startswith("https:")  # no endpoint: AWS, over https
        crc = self._b.checksum == "crc32"
        # SigV4 signs the payload unless it goes over https with a checksum (see PrehashedSha256Auth)
        sha = PREHASHED_SIGNER is not None and not self._b.anon and not (https and crc)
        if not (sha or crc):
            return None, {}

        def run() -> tuple[str | None, dict[str, str]]:
            digest = hashlib.sha256(data).hexdigest() if sha else None
            args = (
                {
                    "ChecksumAlgorithm": "CRC32",
                    "ChecksumCRC32": base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode(),
                }
                if crc
                else {}
            )
            return digest, args

        if memoryview(data).nbytes <= _INLINE_HASH_MAX:  # cheaper than the hop to a thread
            return run()
        fut = asyncio.get_running_loop().run_in_executor(None, run)  # the loop's default: a Pool (threads.exit_safe)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:  # the thread reads the part (lent: the caller's memory): it ends first
            while not fut.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait([fut])
            raise

    async def put_single(self, data: Buffer) -> None:
        digest, crc = await self._digests(data)
        await self._request(
            "PUT",
            lambda s3: s3.put_object(
                Bucket=self._bucket, Key=self._key, Body=_body.MemoryBody(data, sha256=digest), **crc, **self._cond
            ),
            lambda: self._etag_is(hashlib.md5(data).hexdigest()),
        )

    async def begin(self) -> Any:
        if self._cond:  # fail before uploading gigabytes; the conditional complete stays authoritative
            try:
                await self._b._op(self.uri, "HEAD", lambda s3: s3.head_object(Bucket=self._bucket, Key=self._key))
                raise AlreadyExistsError(self.uri)
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") not in NOT_FOUND:
                    raise
        algo = {"ChecksumAlgorithm": "CRC32"} if self._b.checksum == "crc32" else {}
        r = await self._request(
            "CreateMultipartUpload", lambda s3: s3.create_multipart_upload(Bucket=self._bucket, Key=self._key, **algo)
        )
        return r["UploadId"]

    async def upload_part(self, handle: Any, number: int, offset: int, data: Buffer, total: int | None) -> Any:
        n = memoryview(data).nbytes
        digest, crc = await self._digests(data)
        r = await self._request(
            f"part {number} (bytes {offset}-{offset + n - 1})",
            lambda s3: s3.upload_part(
                Bucket=self._bucket,
                Key=self._key,
                UploadId=handle,
                PartNumber=number,
                Body=_body.MemoryBody(data, sha256=digest),
                **crc,
            ),
        )
        return {"PartNumber": number, "ETag": r["ETag"], **({"ChecksumCRC32": crc["ChecksumCRC32"]} if crc else {})}

    async def complete(self, handle: Any, tokens: list[Any], total: int) -> None:
        digest = hashlib.md5(b"".join(bytes.fromhex(t["ETag"].strip('"')) for t in tokens)).hexdigest()
        await self._request(
            f"CompleteMultipartUpload ({len(tokens)} parts)",
            lambda s3: s3.complete_multipart_upload(
                Bucket=self._bucket, Key=self._key, UploadId=handle, MultipartUpload={"Parts": tokens}, **self._cond
            ),
            lambda: self._etag_is(f"{digest}-{len(tokens)}"),
        )

    async def abort_upload(self, handle: Any) -> None:
        try:
            await self._request(
                "AbortMultipartUpload",
                lambda s3: s3.abort_multipart_upload(Bucket=self._bucket, Key=self._key, UploadId=handle),
            )
        except ClientError as e:
            if error_code(e)[0] not in NOT_FOUND:  # already gone (an earlier attempt's answer was lost)
                raise
