"""``gs://`` and ``gcs://``: Google Cloud Storage (or an emulator) through gcsfs's session.

gcsfs provides credentials (``token``: a path to a service-account JSON, ``"google_default"``,
``"anon"``...), the HTTP session and the IO loop. The data path speaks the JSON API directly:
small objects are one media upload, large ones a resumable upload in ``part_size`` chunks
(a multiple of 256 KiB) while the caller fills the next chunk; reads are parallel ranged GETs
streamed into the caller's buffer (``part_size``, 64 MiB, each; uploads use ``upload_part_size``,
by default ``part_size``, and ``max_buffer_bytes`` bounds a streaming writer's copies).
``mode="create"`` sends ``ifGenerationMatch=0``; the version token is the object's generation.

Every request runs under the backend's :class:`~ckptio.objectstore.retry.RetryPolicy` (gcsfs's own retry
decorator is not on this path). A resumable-upload chunk that fails is retried alone: the
upload's status is queried first and only the bytes the server has not persisted are re-sent.
A killed writer's resumable upload session needs no cleanup: GCS discards it a week after it
started, and it is not an object (``list_pending_writes`` keeps the default: none).
``credential_provider`` (a callable or ``"module:function"`` returning an OAuth access token, or a
dict with ``token``) is called when GCS answers 401; its token is sent as a Bearer token.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import json
import math
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlencode

from ..errors import (
    AccessDeniedError,
    AlreadyExistsError,
    CkptioError,
    CredentialsError,
    MissingDependencyError,
    NotFoundError,
    TransferError,
    replaced,
)
from ..objectstore import body as _body
from ..objectstore import direct as _direct
from ..objectstore import here as _here
from ..objectstore import multipart as _multipart
from ..objectstore import ranged as _ranged
from ..objectstore import retry as _retry
from ..objectstore.backend import Entry, ObjectStoreBackend, check_versions
from ..objectstore.names import GCS
from ..objectstore.replies import check_reply, redirected
from .base import DEFAULT_CONCURRENCY, Buffer, ObjectInfo, WriteMode, Writer, check_mode

# checked before the imports below: an old release can fail there with a less helpful error
MIN_VERSIONS = {"gcsfs": "2025.2.0"}  # = the gcs extra's floor in pyproject.toml
check_versions("gcs", MIN_VERSIONS)

try:
    import aiohttp
    import gcsfs
    import yarl
except ImportError as _e:  # pragma: no cover - exercised in a subprocess test
    raise MissingDependencyError(
        f"gs:// needs gcsfs, which is not installed ({_e.name or _e}); run: pip install 'ckptio[gcs]'"
    ) from _e

CHUNK_ALIGN = 256 * 1024  # resumable upload chunks must be multiples of this
READ_PART_SIZE = 64 * 1024 * 1024  # ranged reads: fewer, larger GETs (emulators pay per request)

from ..objectstore import gcs_support as _gcs  # noqa: E402
from ..objectstore.gcs_support import HTTPStatus, classify, on_read_headers, quote_key, read_params  # noqa: E402


class GCSBackend(ObjectStoreBackend):
    """Objects in Google Cloud Storage or gcp-storage-emulator."""

    name = "gcs"
    scheme = "gs"
    classify = staticmethod(classify)
    naming = GCS
    _raw_errors = (*ObjectStoreBackend._raw_errors, json.JSONDecodeError)

    def __init__(
        self,
        *,
        endpoint_url: str | None = None,
        project: str | None = None,
        token: Any = None,
        anon: bool = False,
        part_size: int = READ_PART_SIZE,
        concurrency: int = DEFAULT_CONCURRENCY,
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
        self.part_size = -(-self.part_size // CHUNK_ALIGN) * CHUNK_ALIGN
        up = _multipart.size_option("upload_part_size", upload_part_size) if upload_part_size else self.part_size
        self.upload_part_size = -(-up // CHUNK_ALIGN) * CHUNK_ALIGN
        self._bearer: str | None = None
        if self._refresher.provider is not None:
            self._bearer = _gcs.bearer_token(self._refresher.provider())
        self.endpoint_url = endpoint_url.rstrip("/") if endpoint_url else None
        self.direct_reads = bool(direct_reads)
        self._direct: _direct.DirectGets | None = None  # made by the first GET from a caller's thread
        self._direct_lock = threading.Lock()
        self._connect_timeout = float(connect_timeout)
        self._timeout = aiohttp.ClientTimeout(
            sock_connect=float(connect_timeout), sock_read=min(float(read_timeout), self.policy.stall_timeout)
        )
        try:
            self._fs = gcsfs.GCSFileSystem(
                project=project or gcsfs.core.DEFAULT_PROJECT,
                token="anon" if anon else token,
                endpoint_url=self.endpoint_url,
                skip_instance_cache=True,
                use_listings_cache=False,
            )
        except Exception as e:  # its messages may quote the token: keep only the type
            raise CredentialsError(
                "gs://",
                f"GCS credentials could not be loaded ({type(e).__name__}); set the "
                "gcs backend's token option (a service-account JSON path, 'google_default' "
                "or 'anon') or GOOGLE_APPLICATION_CREDENTIALS",
            ) from None

    def __repr__(self) -> str:
        return f"<GCSBackend endpoint={self.endpoint_url or 'google'!r}>"

    @property
    def endpoint(self) -> str:
        """Where requests go: ``endpoint_url``, else gcsfs's (``STORAGE_EMULATOR_HOST``, Google's)."""
        return self._fs._location

    # ---- plumbing --------------------------------------------------------------------------
    @property
    def _loop(self) -> asyncio.AbstractEventLoop:
        return self._fs.loop

    @property
    def _api(self) -> str:
        return f"{self._fs._location}/storage/v1"

    @property
    def _upload_url(self) -> str:
        return f"{self._fs._location}/upload/storage/v1"

    async def _apply_credentials(self, creds: Any) -> None:
        self._bearer = _gcs.bearer_token(creds)

    async def _attempt(
        self,
        method: str,
        url: str,
        *,
        params: dict | None = None,
        headers: dict | None = None,
        data: Any = None,
        ok: tuple[int, ...] = (200,),
        into: list[memoryview] | None = None,
        parse_json: bool = False,
        on_headers: Callable[[int, Any], None] | None = None,
        range_start: int = 0,
        uri: str = "gs://",
    ) -> tuple[int, Any, Any]:
        """One HTTP request. ``into``: stream the body (of a ranged GET from ``range_start``) through
        those consecutive buffers and return its length as the body."""
        stall = self.policy.stall_timeout
        session = _body.no_hidden_retries(await self._fs._set_session())
        hdrs = self._headers(headers)
        kw = {"params": params, "data": data, "timeout": self._timeout, "headers": hdrs, "allow_redirects": False}
        async with session.request(method, yarl.URL(url, encoded=True), **kw) as r:  # sent as quoted here
            if r.status not in ok:
                raise HTTPStatus(r.status, await _retry.stall_guard(r.read(), stall))
            if into is None:
                body = await _retry.stall_guard(r.read(), stall)
                return r.status, r.headers, _gcs.parse_json(body, uri) if parse_json else body
            pos, want = 0, sum(len(v) for v in into)
            _retry.check_ranged_status(r.status, range_start, uri)
            check_reply(uri, r.status, r.headers, range_start, range_start + want)
            if on_headers is not None:
                on_headers(r.status, r.headers)
            async with _retry.StallWatch(stall) as watch:
                while pos < want:
                    chunk = await watch(r.content.read(want - pos))
                    if not chunk:
                        break
                    _ranged.fill(into, chunk, pos)
                    pos += len(chunk)
            if r.status == 206:
                _retry.check_range(want, pos, r.headers.get("Content-Range"), r.headers.get("Content-Length"))
            return r.status, r.headers, pos

    def _headers(self, headers: dict | None) -> dict:
        """A request's headers with the credentials: gcsfs's (which may refresh a token), or the
        credential_provider's bearer token."""
        out = self._fs._get_headers(headers)
        if self._bearer is not None:
            out["Authorization"] = f"Bearer {self._bearer}"
        return out

    async def _request(
        self,
        method: str,
        url: str,
        *,
        uri: str = "gs://",
        what: str | None = None,
        after: _retry.PriorAttempt | None = None,
        **kw: Any,
    ) -> tuple[int, Any, Any]:
        """One HTTP call under the retry policy (see :meth:`_attempt` for the keywords; ``after``: an
        attempt made from the caller's thread that failed, see ``RetryPolicy.run``)."""
        return await self._retrying(uri, what or method, lambda: self._attempt(method, url, uri=uri, **kw), after=after)

    def _call(self, uri: str, method: str, url: str, **kw: Any) -> tuple[int, Any, Any]:
        return self._run(uri, lambda: self._request(method, url, uri=uri, **kw))

    def _json(self, uri: str, method: str, url: str, **kw: Any) -> dict:
        return self._call(uri, method, url, parse_json=True, **kw)[2]

    def translate(self, e: BaseException, uri: str) -> BaseException:
        if isinstance(e, CkptioError):
            return e
        out: BaseException
        if isinstance(e, HTTPStatus):
            if e.status == 404:
                out = NotFoundError(uri)
            elif e.status == 412:
                out = AlreadyExistsError(uri)
            elif e.status == 401:
                out = CredentialsError(
                    uri,
                    "GCS rejected the credentials (HTTP 401); set the gcs backend's token "
                    "option (a service-account JSON path, 'google_default' or 'anon') or "
                    "GOOGLE_APPLICATION_CREDENTIALS",
                )
            elif e.status == 403:
                out = AccessDeniedError(uri, f"GCS denied access (HTTP 403: {e.message()})")
            elif 300 <= e.status < 400:
                out = redirected(uri, e.status, None)
            else:
                out = TransferError(errno.EIO, f"GCS error HTTP {e.status} for {uri}: {e.message()}", uri)
        elif isinstance(e, (aiohttp.ClientError, OSError, asyncio.TimeoutError)):
            out = TransferError(
                errno.EIO, f"cannot reach GCS endpoint {self._fs._location} for {uri}: {type(e).__name__}", uri
            )
        else:
            return e
        out.__cause__ = e
        return out

    def close_clients(self) -> None:
        direct, self._direct = self._direct, None
        if direct is not None:
            direct.close()
        session = getattr(self._fs, "_session", None)
        if session is not None and not session.closed and self._loop.is_running():
            try:
                _ranged.run(self._loop, session.close)
            except Exception:  # closing a dead connection pool must not fail reset()
                pass
            self._fs._session = None

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
        after: _retry.PriorAttempt | None = None,
    ) -> int:
        params, pinned = read_params(pin)
        try:
            return (
                await self._request(
                    "GET",
                    f"{self._api}/b/{bucket}/o/{quote_key(key)}",
                    params=params,
                    headers={"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"},
                    ok=(200, 206),
                    into=into,
                    on_headers=functools.partial(on_read_headers, uri, on_size, pin),
                    range_start=start,
                    uri=uri,
                    what=f"ranged read of bytes {start}-{end - 1}",
                    after=after,
                )
            )[2]
        except HTTPStatus as e:
            if e.status == 416:
                return 0
            if e.status == 404 and pinned:
                raise replaced(uri, pinned) from None
            raise

    _sized_get_range = _get_range  # ``into`` is read after ``on_size``: see ObjectStoreBackend._get_range

    def _head_here(
        self,
        uri: str,
        bucket: str,
        key: str,
        into: list[memoryview],
        on_size: Callable[[int], None],
        pin: _ranged.VersionPin | None,
    ) -> _here.HeadHere | None:
        """The head GET with ``http.client`` on the caller's thread (:mod:`ckptio.objectstore.here`): the
        request :meth:`_get_range` sends, its reply checked as there, within the attempt's time (the policy's
        ``timeout`` and ``deadline``). Not where ``direct_reads`` is off, the endpoint authenticates with a
        client certificate, or a subclass has its own request hooks (``_get_range``, ``_request``, ``_attempt``)."""
        cls = type(self)
        own = (cls._get_range, cls._request, cls._attempt) == (
            GCSBackend._get_range,
            GCSBackend._request,
            GCSBackend._attempt,
        )
        if not self.direct_reads or not own:
            return None
        gets = self._direct_gets()
        if gets is None:
            return None
        started = time.monotonic()
        policy = self.policy
        limit = min(policy.deadline, policy.timeout if policy.timeout is not None else math.inf)
        n = len(into[0])
        params, _ = read_params(pin)
        headers = {"Range": f"bytes=0-{n - 1}"}
        reply: _direct.DirectResponse | None = None
        try:
            headers = self._headers(headers)
            url = f"{self._api}/b/{bucket}/o/{quote_key(key)}?{urlencode(params)}"
            reply = gets.get_here(url, headers, min(policy.stall_timeout, limit), started + limit)
            if reply.status not in (200, 206):
                raise HTTPStatus(reply.status, reply.error_body_here())
            _retry.check_ranged_status(reply.status, 0, uri)
            check_reply(uri, reply.status, reply.headers, 0, n)
            on_read_headers(uri, on_size, pin, reply.status, reply.headers)
        except Exception as e:
            if reply is not None:
                reply.close()
            return _here.HeadHere(None, e, started)
        except BaseException:
            if reply is not None:
                reply.close()
            raise
        got = reply

        def fill() -> int:
            try:
                pos = got.fill_here(into)
            finally:
                got.close()
            if got.status == 206:
                _retry.check_range(n, pos, got.headers.get("content-range"), got.headers.get("content-length"))
            return pos

        return _here.HeadHere(fill, None, started, gets.submit)

    def _direct_gets(self) -> _direct.DirectGets | None:
        """The connections of :meth:`_head_here`'s GETs, made on first use; None (and ``direct_reads``
        turned off) where the endpoint needs a client certificate, which gcsfs's session brings."""
        gets = self._direct
        if gets is None:
            if getattr(self._fs, "_use_client_cert", False):
                self.direct_reads = False
                return None
            with self._direct_lock:
                if self._direct is None:
                    https = self._fs._location.startswith("https://")
                    self._direct = _direct.DirectGets(
                        ssl_context=ssl.create_default_context() if https else None,
                        connect_timeout=self._connect_timeout,
                        workers=self.concurrency,
                    )
                gets = self._direct
        return gets

    # ---- writes ----------------------------------------------------------------------------
    def open_writer(self, uri: str, *, mode: WriteMode = "overwrite", durable: bool = True) -> Writer:
        check_mode(mode)
        bucket, key = self._split(uri)
        return _GCSWriter(self, uri, bucket, key, mode)

    def write(self, uri: str, data: Buffer, *, mode: WriteMode = "overwrite", durable: bool = True) -> None:
        self.open_writer(uri, mode=mode).write_all(data)  # type: ignore[attr-defined]

    # ---- metadata --------------------------------------------------------------------------
    def _head(self, uri: str, bucket: str, key: str) -> ObjectInfo:
        o = self._json(uri, "GET", f"{self._api}/b/{bucket}/o/{quote_key(key)}")
        return ObjectInfo(uri, *_gcs.entry(o, uri, self._fs._parse_timestamp)[1:])

    def _list_page(
        self, uri: str, bucket: str, prefix: str, *, delimiter: bool, token: str | None, limit: int | None = None
    ) -> tuple[list[Entry], list[str], str | None]:
        params = {"prefix": prefix}
        if delimiter:
            params["delimiter"] = "/"
        if token:
            params["pageToken"] = token
        if limit:
            params["maxResults"] = str(limit)
        r = self._json(uri, "GET", f"{self._api}/b/{bucket}/o", params=params)
        return _gcs.listing(r, uri, self._fs._parse_timestamp)

    def delete(self, uri: str) -> None:
        bucket, key = self._split(uri)
        ambiguous = False

        async def on_retry(e: BaseException) -> None:
            nonlocal ambiguous
            ambiguous = ambiguous or not isinstance(e, HTTPStatus)

        async def go() -> None:
            try:
                await self._retrying(
                    uri,
                    "DELETE",
                    lambda: self._attempt("DELETE", f"{self._api}/b/{bucket}/o/{quote_key(key)}", ok=(200, 204)),
                    on_retry,
                )
            except HTTPStatus as e:
                if not (e.status == 404 and ambiguous):  # 404 after a lost answer: our delete went through
                    raise

        self._run(uri, go)


class _GCSWriter(_multipart.MultipartWriter):
    ordered = True  # a resumable upload takes its chunks in order
    min_part_size = part_align = CHUNK_ALIGN

    def __init__(self, backend: GCSBackend, uri: str, bucket: str, key: str, mode: WriteMode) -> None:
        super().__init__(uri, backend._loop, backend.upload_part_size, 1, backend.max_buffer_bytes)
        self._b, self._bucket, self._key = backend, bucket, key
        self._cond = {"ifGenerationMatch": "0"} if mode == "create" else {}

    def translate(self, exc: BaseException) -> BaseException:
        return self._b.translate(exc, self.uri)

    async def _refuse_existing(self) -> None:
        # The server's ifGenerationMatch=0 is authoritative; this early check saves uploading
        # gigabytes for nothing (and gives emulators that ignore preconditions the same behaviour).
        try:
            await self._b._request(
                "GET",
                f"{self._b._api}/b/{self._bucket}/o/{quote_key(self._key)}",
                params={"fields": "generation"},
                uri=self.uri,
                what="precondition check",
            )
        except HTTPStatus as e:
            if e.status == 404:
                return
            raise
        raise AlreadyExistsError(self.uri)

    async def put_single(self, data: Buffer) -> None:
        if self._cond:
            await self._refuse_existing()
        if not len(memoryview(data)):  # gcp-storage-emulator drops empty media uploads; multipart works everywhere
            await gcsfs.core.simple_upload(
                self._b._fs, self._bucket, self._key, b"", mode="create" if self._cond else "overwrite"
            )
            return
        await self._b._request(
            "POST",
            f"{self._b._upload_url}/b/{self._bucket}/o",
            data=_body.MemoryBody(data),
            params={"uploadType": "media", "name": self._key, **self._cond},
            headers={"Content-Type": "application/octet-stream"},
            uri=self.uri,
            what="upload",
        )

    async def begin(self) -> Any:
        if self._cond:
            await self._refuse_existing()
        _, headers, _ = await self._b._request(
            "POST",
            f"{self._b._upload_url}/b/{self._bucket}/o",
            data=json.dumps({"name": self._key}),
            params={"uploadType": "resumable", "name": self._key, **self._cond},
            headers={
                "Content-Type": "application/json; charset=UTF-8",
                "X-Upload-Content-Type": "application/octet-stream",
            },
            uri=self.uri,
            what="start of resumable upload",
        )
        return headers["Location"]

    async def upload_part(self, handle: Any, number: int, offset: int, data: Buffer, total: int | None) -> Any:
        mv = memoryview(data).cast("B")
        n, size = len(mv), "*" if total is None else str(total)
        state = {"sent": 0, "done": False}  # bytes of this chunk the server already persisted

        async def once() -> None:
            if state["done"] or (state["sent"] >= n and total is None):
                return
            start = offset + state["sent"]
            body = _body.MemoryBody(mv[state["sent"] :])
            await self._b._attempt(
                "PUT",
                handle,
                data=body,
                ok=(200, 201, 308),
                headers={
                    "Content-Range": f"bytes {start}-{offset + n - 1}/{size}"
                    if start < offset + n
                    else f"bytes */{size}",
                    "Content-Type": "application/octet-stream",
                },
            )

        async def resync(e: BaseException) -> None:
            # ask the server how much it kept, so the retry re-sends only the rest of this chunk
            try:
                status, headers, _ = await self._b._attempt(
                    "PUT", handle, data=b"", ok=(200, 201, 308), headers={"Content-Range": f"bytes */{size}"}
                )
            except Exception:
                return  # the retry re-sends the whole chunk
            if status in (200, 201):
                state["done"] = True
                return
            rng = headers.get("Range", "")
            persisted = int(rng.rpartition("-")[2]) + 1 if rng.startswith("bytes=") else 0
            state["sent"] = min(n, max(0, persisted - offset))

        await self._b._retrying(self.uri, f"chunk {number} (bytes {offset}-{offset + n - 1})", once, resync)

    async def complete(self, handle: Any, tokens: list[Any], total: int) -> None:
        pass  # the last chunk (with the total size) completed the upload

    async def abort_upload(self, handle: Any) -> None:
        try:
            await self._b._request(
                "DELETE", handle, ok=(200, 204, 499), uri=self.uri, what="cancel of resumable upload"
            )
        except HTTPStatus as e:
            if e.status not in (404, 405, 410, 501):  # already gone, or (emulator) cancel not supported
                raise
