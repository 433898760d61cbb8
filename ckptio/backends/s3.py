"""``s3://`` and ``s3a://`` on any S3 API server, through s3fs's aiobotocore client.

s3fs provides the session, credentials chain, endpoint handling and IO loop; the data path calls
the client directly so that reads stream into the caller's buffer in parallel ranges and writes
go up as parallel multipart uploads with bounded memory (see :mod:`ckptio.objectstore`).
``mode="create"`` sends ``If-None-Match: *`` on the PUT or on CompleteMultipartUpload.

Credentials, highest first: ``access_key_id``/``secret_access_key``/``session_token`` options,
``credentials_file`` (a JSON file with boto-style keys ``aws_access_key_id``,
``aws_secret_access_key``, ``aws_session_token``, ``endpoint_url``, ``region_name``: Cosmos
easy_io's ``s3_credential_path``), ``profile``, then boto's default chain (environment, shared
files, instance metadata). ``anon=True`` sends unsigned requests. ``credential_provider`` (a
callable or ``"module:function"`` returning a dict with those keys) supplies fresh credentials
when S3 answers ``ExpiredToken``/``RequestExpired``; the request is then retried.

Sizes: ranged reads are ``part_size`` (16 MiB) with ``concurrency`` at once; uploads go in
``upload_part_size`` parts (8 MiB, at most ``part_size``), and a streaming writer's copied bytes
stay within ``max_buffer_bytes`` (48 MiB; large writes go up from the caller's memory).

Uploads carry a CRC32 of every part (``checksum="crc32"``, the AWS SDKs' default), computed on a
worker thread: S3 verifies each part on arrival and stores a composite checksum, and servers do not
have to checksum the whole object again at completion. ``checksum="none"`` (also the default where
boto3's ``request_checksum_calculation`` is ``when_required``, in the environment or the AWS config
file) is for S3-compatible stores that reject checksum headers.

Ranged GETs go around the client (``direct_reads=True``, see :mod:`ckptio.objectstore.direct`): the
client presigns each one and ``http.client`` reads its body straight into the caller's buffer; where
a proxy or a client certificate applies, or a bucket refuses the presigned URL, the client sends them.

Every request runs under the backend's :class:`~ckptio.objectstore.retry.RetryPolicy` (``max_attempts`` or
``retries``, ``deadline``, ``timeout``, ``stall_timeout``); botocore's own retries are off so the
two never multiply. Parts of multipart uploads and ranges of reads are retried one by one.

A writer that fails aborts its multipart upload; one that is killed leaves it behind (S3 keeps and
bills its parts until it is aborted). ``list_pending_writes``/``abort_pending_write`` find and abort
those (``s3:ListBucketMultipartUploads``, ``s3:AbortMultipartUpload``); the Checkpointer does so under
its root (see :mod:`ckptio.checkpointer`). A bucket lifecycle rule ``AbortIncompleteMultipartUpload``
does it for a whole bucket.
"""

from __future__ import annotations

import asyncio
import errno
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from .. import uri as _uri
from ..errors import MissingDependencyError, TransferError, replaced
from ..objectstore import direct as _direct
from ..objectstore import multipart as _multipart
from ..objectstore import ranged as _ranged
from ..objectstore import retry as _retry
from ..objectstore.backend import Entry, ObjectStoreBackend, check_versions
from ..objectstore.replies import check_reply
from .base import Buffer, ObjectInfo, PendingWrite, WriteMode, Writer, check_mode

# checked before the imports below: an old release can fail there with a less helpful error
MIN_VERSIONS = {"s3fs": "2025.2.0", "aiobotocore": "2.23.0"}  # = the s3 extra's floors in pyproject.toml
check_versions("s3", MIN_VERSIONS)

try:
    import s3fs  # noqa: F401 - the dependency named in the message below
    from botocore.exceptions import ClientError, FlexibleChecksumError
except ImportError as _e:  # pragma: no cover - exercised in a subprocess test
    raise MissingDependencyError(
        f"s3:// needs s3fs, which is not installed ({_e.name or _e}); run: pip install 'ckptio[s3]'"
    ) from _e

# after the version check:
from ..objectstore.s3_client import (  # noqa: E402
    ClientReply,
    S3ClientConfig,
    body_checksum,
    client_get,
    credentials_from,
    direct_route,
    own_retries,
)
from ..objectstore.s3_multipart import MAX_PARTS, MIN_PART_SIZE, S3Writer  # noqa: E402
from ..objectstore.s3_support import (  # noqa: E402
    checksum_option,
    classify,
    error_code,
    refuses_presigned,
    reply_error,
    translate,
)

# Ranged reads are ``part_size``: 16 MiB, within AWS's 8-16 MiB guidance, so that an object of a
# few hundred MiB already keeps ``concurrency`` connections busy (one S3 connection moves ~90 MB/s).
# 256 MiB through the benchmark's realistic proxy (20 ms, 90 MB/s a connection, ranges served as S3
# does): 16 MiB parts 0.44-0.55 GB/s, 64 MiB 0.22. moto itself reads the whole object for each ranged
# GET, so against it larger parts read faster (64 MiB 0.37 GB/s, 16 MiB 0.11): set part_size there.
# Uploads go in ``upload_part_size`` parts (boto3's 8 MiB).
READ_PART_SIZE = 16 * 1024 * 1024
UPLOAD_PART_SIZE = 8 * 1024 * 1024
# Ranges and upload parts in flight at once: 16, as one S3 connection moves ~90 MB/s and a client that
# wants more opens more (s3torchconnector's CRT client sizes its connections to a 10 Gb/s target). 256 MiB
# through the realistic proxy (own process), 5 interleaved rounds: .fpk load 0.413 -> 0.465 GB/s, save
# 0.147 -> 0.158, 32 MiB unchanged; a no-work client: 8 connections 0.46-0.48 GB/s, 16 0.54. Reads stream
# into the caller's tensors, so more of them in flight costs no memory; uploads stay bounded by
# max_buffer_bytes.
S3_CONCURRENCY = 16
# Direct reads GET a presigned URL at once (see S3Backend._direct_get); its lifetime only
# has to cover the request's start.
PRESIGNED_SECONDS = 900


class S3Backend(ObjectStoreBackend):
    """Objects in S3 or any S3 API server (MinIO, moto, Ceph...)."""

    name = "s3"
    scheme = "s3"
    classify = staticmethod(classify)
    suffix_reads = True  # S3 and its compatibles answer "Range: bytes=-N" with the last N bytes

    def __init__(
        self,
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        profile: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        session_token: str | None = None,
        credentials_file: str | None = None,
        anon: bool = False,
        part_size: int = READ_PART_SIZE,
        concurrency: int = S3_CONCURRENCY,
        retries: int | None = None,
        max_attempts: int | None = None,
        deadline: float | None = None,
        timeout: float | None = None,
        stall_timeout: float | None = None,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        credential_provider: Any = None,
        max_buffer_bytes: int | str = _multipart.DEFAULT_MAX_BUFFER_BYTES,
        upload_part_size: int | str | None = None,
        checksum: str | None = None,
        direct_reads: bool = True,
    ) -> None:
        self._options = _multipart.constructor_options(locals())  # for with_options
        super().__init__(
            part_size=part_size,
            concurrency=concurrency,
            retries=retries,
            max_attempts=max_attempts,
            deadline=deadline,
            timeout=timeout,
            stall_timeout=stall_timeout,
            read_timeout=read_timeout,
            credential_provider=credential_provider,
            max_buffer_bytes=max_buffer_bytes,
        )
        self.upload_part_size = (
            _multipart.size_option("upload_part_size", upload_part_size)
            if upload_part_size
            else min(self.part_size, UPLOAD_PART_SIZE)
        )
        if min(self.part_size, self.upload_part_size) < MIN_PART_SIZE:
            raise ValueError(
                f"part_size must be >= 5 MiB for S3 multipart uploads, got {min(self.part_size, self.upload_part_size)}"
            )
        self.checksum = checksum_option(checksum, profile)
        self._old_clients: list[Any] = []  # replaced by a credential refresh, closed when their requests end
        self._in_flight: dict[int, int] = {}  # id(client) -> requests using it (touched only on the IO loop)
        config = S3ClientConfig.from_options(
            endpoint_url=endpoint_url,
            region=region,
            profile=profile,
            access_key_id=access_key_id,
            secret_access_key=secret_access_key,
            session_token=session_token,
            credentials_file=credentials_file,
            anon=anon,
            provider=self._refresher.provider,
        )
        self.endpoint_url, self.region, self.anon = config.endpoint_url, config.region, config.anon
        self.direct_reads = bool(direct_reads)
        self._direct: _direct.DirectGets | None = None  # made by the first direct GET
        self._indirect: set[str] = set()  # buckets whose GETs are the client's (see _direct_get)
        self._connect_timeout = float(connect_timeout)
        self._fs = config.filesystem(
            connect_timeout=connect_timeout,
            read_timeout=min(float(read_timeout), self.policy.stall_timeout),
            max_pool_connections=max(10, 2 * self.concurrency),
        )
        self._client: Any = None

    def __repr__(self) -> str:
        return f"<S3Backend endpoint={self.endpoint_url or 'aws'!r} region={self.region!r}>"

    @property
    def endpoint(self) -> str | None:
        """Where requests go: ``endpoint_url``, else the client's (``AWS_ENDPOINT_URL``, AWS's) once it is made."""
        return self.endpoint_url or getattr(getattr(self._client, "meta", None), "endpoint_url", None)

    # ---- plumbing --------------------------------------------------------------------------
    @property
    def _loop(self) -> asyncio.AbstractEventLoop:
        return self._fs.loop

    async def _s3(self) -> Any:
        if self._client is None:
            self._client = own_retries(await self._fs.set_session())
        return self._client

    async def _apply_credentials(self, creds: Any) -> None:
        self._fs.key, self._fs.secret, self._fs.token = credentials_from(creds)
        old = self._client
        self._client = own_retries(await self._fs.set_session(refresh=True))
        if old is not None:
            if self._in_flight.get(id(old)):
                self._old_clients.append(old)  # requests in flight still use it: closed when the last one ends
            else:
                await self._close_client(old)

    @staticmethod
    async def _close_client(client: Any) -> None:
        try:
            await client.close()
        except Exception:  # closing a dead connection pool must not fail a request
            pass

    async def _release(self, client: Any) -> None:
        n = self._in_flight.pop(id(client), 1) - 1
        if n:
            self._in_flight[id(client)] = n
        elif any(c is client for c in self._old_clients):
            self._old_clients = [c for c in self._old_clients if c is not client]
            await self._close_client(client)

    async def _op(
        self,
        uri: str,
        what: str,
        fn: Callable[[Any], Awaitable[Any]],
        on_retry: Callable[[BaseException], Awaitable[None]] | None = None,
    ) -> Any:
        """``fn(client)`` under the retry policy (one request, retried on transient errors)."""

        async def attempt() -> Any:
            client = await self._s3()
            self._in_flight[id(client)] = self._in_flight.get(id(client), 0) + 1
            try:
                return await fn(client)
            finally:
                await self._release(client)

        return await self._retrying(uri, what, attempt, on_retry)

    def _call(self, uri: str, method: str, **kwargs: Any) -> Any:
        return self._run(uri, lambda: self._op(uri, method, lambda s3: getattr(s3, method)(**kwargs)))

    def translate(self, e: BaseException, uri: str) -> BaseException:
        return translate(e, uri, checksum=self.checksum, endpoint_url=self.endpoint)

    def close_clients(self) -> None:
        direct, self._direct = self._direct, None
        if direct is not None:
            direct.close()
        clients = [c for c in (self._client, *self._old_clients) if c is not None]
        self._client, self._old_clients = None, []
        for client in clients:
            if self._loop.is_running():
                try:
                    _ranged.run(self._loop, client.close)
                except Exception:  # closing a dead connection pool must not fail reset()
                    pass

    # ---- reads -----------------------------------------------------------------------------
    async def _get_range(
        self,
        uri: str,
        bucket: str,
        key: str,
        start: int,
        end: int,
        into: list[memoryview],
        on_size: Callable[[int], None] | None = None,
        pin: _ranged.VersionPin | None = None,
    ) -> int:
        stall = self.policy.stall_timeout
        # start < 0: the last -start bytes (a suffix range, no size needed; ``end`` is not used)
        rng = f"bytes={start}" if start < 0 else f"bytes={start}-{end - 1}"

        async def once(s3: Any) -> int:
            cond = {"IfMatch": pin.token} if pin is not None and pin.token else {}
            try:
                reply: _direct.DirectResponse | ClientReply | None = await self._direct_get(
                    s3, bucket, key, rng, cond, stall
                )
                if reply is None:  # the client's own GET
                    reply = await client_get(s3, uri, stall, Bucket=bucket, Key=key, Range=rng, **cond)
            except ClientError as e:
                code = e.response.get("Error", {}).get("Code")
                if code == "InvalidRange":
                    return 0  # starts past the end of the object
                status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                if cond and (code == "PreconditionFailed" or status == 412):
                    raise replaced(uri, cond["IfMatch"]) from None
                raise
            total, check = 0, None
            status, headers = reply.status, reply.headers
            try:
                check_reply(uri, status, headers, start, end)
                if pin is not None:
                    pin.check(uri, headers.get("etag"))
                size = None
                if on_size is not None or start < 0:
                    size = _retry.object_size(status, headers.get("content-range"), headers.get("content-length"))
                if on_size is not None and size is not None:
                    on_size(size)
                if start < 0:
                    _retry.check_suffix_status(status, -start, size, uri, headers.get("content-range"))
                _retry.check_ranged_status(status, start, uri)
                # the body checked against the checksum S3 sends with a reply holding the whole object
                check = body_checksum(headers)
                total = await reply.fill(into, check)  # the body streams through the buffers in order
            finally:
                reply.close()
            want = -start if start < 0 else end - start
            _retry.check_range(want, total, headers.get("content-range"), headers.get("content-length"))
            read_whole = str(total) == headers.get("content-length")  # as botocore, only a body read to its end
            if check is not None and read_whole and not check.matches():
                raise FlexibleChecksumError(
                    error_msg=f"the body of a {what} did not match its {check.header}: "
                    f"expected {check.expected}, computed {check.computed()} (damaged in flight)"
                )
            return total

        what = f"read of the last {-start} bytes" if start < 0 else f"ranged read of bytes {start}-{end - 1}"
        return await self._op(uri, what, once)

    _sized_get_range = _get_range  # ``into`` is read after ``on_size``: see ObjectStoreBackend._get_range

    async def _direct_get(
        self, s3: Any, bucket: str, key: str, rng: str, cond: dict[str, str], stall: float
    ) -> _direct.DirectResponse | None:
        """The GET sent around the client (see :mod:`ckptio.objectstore.direct`): its reply when it is a
        body; the ``ClientError`` the client would raise for an error reply; None when this GET is the
        client's to send: ``direct_reads`` off, a proxy, or a bucket that answered a direct GET with a
        redirect or a refusal that may be about the presigned URL (the bucket's region, a policy
        refusing query-string authentication: the client's own GETs for that bucket from then on)."""
        if not self.direct_reads or bucket in self._indirect:
            return None
        url = await s3.generate_presigned_url(  # checksums asked for, as the client's GETs do
            "get_object", Params={"Bucket": bucket, "Key": key, "ChecksumMode": "ENABLED"}, ExpiresIn=PRESIGNED_SECONDS
        )
        if self._direct is None:
            ok, ssl_context = direct_route(s3, url)
            if not ok:
                self.direct_reads = False
                return None
            context = await asyncio.to_thread(ssl_context) if ssl_context else None
            if self._direct is None:  # the first of the GETs that built a context meanwhile
                self._direct = _direct.DirectGets(
                    ssl_context=context, connect_timeout=self._connect_timeout, workers=2 * self.concurrency
                )
        headers = {"Range": rng, "x-amz-checksum-mode": "ENABLED"}  # signed: a header of the presigned URL
        if cond:
            headers["If-Match"] = cond["IfMatch"]
        reply = await self._direct.get(url, headers, stall)
        if reply.status < 300:
            return reply
        try:
            body = await reply.error_body()
        finally:
            reply.close()
        error = reply_error(reply.status, reply.headers, body, "GetObject")
        if refuses_presigned(reply.status, error_code(error)[0]):
            self._indirect.add(bucket)
            return None
        try:
            raise error
        finally:  # the error's traceback holds this frame: no reference cycle through it
            del error

    # ---- writes ----------------------------------------------------------------------------
    def open_writer(
        self, uri: str, *, mode: WriteMode = "overwrite", durable: bool = True, size_hint: int | None = None
    ) -> Writer:
        check_mode(mode)
        bucket, key = self._split(uri)
        part_size = self.upload_part_size
        if size_hint and -(-size_hint // part_size) > MAX_PARTS:
            part_size = -(-size_hint // MAX_PARTS)
        return S3Writer(self, uri, bucket, key, mode, part_size)

    def write(self, uri: str, data: Buffer, *, mode: WriteMode = "overwrite", durable: bool = True) -> None:
        mv = memoryview(data).cast("B")
        w = self.open_writer(uri, mode=mode, size_hint=len(mv))
        w.write_all(mv)  # type: ignore[attr-defined]

    # ---- metadata --------------------------------------------------------------------------
    def _head(self, uri: str, bucket: str, key: str) -> ObjectInfo:
        h = self._call(uri, "head_object", Bucket=bucket, Key=key)
        return ObjectInfo(uri, int(h["ContentLength"]), h["LastModified"].timestamp(), h.get("ETag"))

    def _list_page(
        self, uri: str, bucket: str, prefix: str, *, delimiter: bool, token: str | None, limit: int | None = None
    ) -> tuple[list[Entry], list[str], str | None]:
        kw: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
        if delimiter:
            kw["Delimiter"] = "/"
        if token:
            kw["ContinuationToken"] = token
        if limit:
            kw["MaxKeys"] = limit
        r = self._call(uri, "list_objects_v2", **kw)
        objects = [
            (o["Key"], int(o["Size"]), o["LastModified"].timestamp(), o.get("ETag")) for o in r.get("Contents", [])
        ]
        return (
            objects,
            [p["Prefix"] for p in r.get("CommonPrefixes", [])],
            r["NextContinuationToken"] if r.get("IsTruncated") else None,
        )

    def delete(self, uri: str) -> None:
        bucket, key = self._split(uri)
        self._call(uri, "head_object", Bucket=bucket, Key=key)  # S3 deletes missing keys silently
        self._call(uri, "delete_object", Bucket=bucket, Key=key)

    def rmtree(self, uri: str) -> None:
        bucket, _ = self._split(uri, key_required=False)
        keys = [_uri.bucket_key(i.uri)[1] for i in self.list(uri, recursive=True) if not i.is_dir]
        for i in range(0, len(keys), 1000):
            r = self._call(
                uri,
                "delete_objects",
                Bucket=bucket,
                Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True},
            )
            if r.get("Errors"):
                e = r["Errors"][0]
                raise TransferError(
                    errno.EIO,
                    f"S3 could not delete {len(r['Errors'])} object(s) under {uri}, "
                    f"first: {e.get('Key')}: {e.get('Code')}",
                    uri,
                )

    # ---- multipart uploads left by killed writers ---------------------------------------------
    def list_pending_writes(self, uri: str) -> Iterator[PendingWrite]:
        bucket, key = self._split(uri, key_required=False)
        scheme = _uri.scheme_of(uri) or self.scheme
        kw: dict[str, Any] = {"Bucket": bucket, "Prefix": key.rstrip("/") + "/" if key.strip("/") else ""}
        while True:
            r = self._call(uri, "list_multipart_uploads", **kw)
            for u in r.get("Uploads", []):
                yield PendingWrite(f"{scheme}://{bucket}/{u['Key']}", u["Initiated"].timestamp(), u["UploadId"])
            if not r.get("IsTruncated"):
                return
            kw.update(KeyMarker=r.get("NextKeyMarker", ""), UploadIdMarker=r.get("NextUploadIdMarker", ""))

    def abort_pending_write(self, write: PendingWrite) -> None:
        bucket, key = self._split(write.uri)
        try:
            self._call(write.uri, "abort_multipart_upload", Bucket=bucket, Key=key, UploadId=write.handle)
        except FileNotFoundError:  # NoSuchUpload: completed or aborted since it was listed
            pass

    def copy(self, src: str, dst: str, *, mode: WriteMode = "overwrite") -> None:
        check_mode(mode)
        sb, sk = self._split(src)
        db, dk = self._split(dst)
        if mode == "create" or self.stat(src).size > 5 * 1024**3:
            return super().copy(src, dst, mode=mode)  # create: streamed, so the commit is conditional
        self._call(src, "copy_object", Bucket=db, Key=dk, CopySource={"Bucket": sb, "Key": sk})
