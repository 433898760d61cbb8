"""S3-only request machinery, kept out of :mod:`ckptio.backends.s3` so the storage keeps its
request hooks: the error codes, their retry classification (:func:`classify`) and their translation
into :mod:`ckptio.errors` (:func:`translate`), ``credentials_file`` and the ``checksum`` option, and
the ``s3v4`` signer that uses a payload SHA-256 computed off the IO loop.

Imported by :mod:`ckptio.backends.s3` after its client-version check (it imports botocore).
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import re
from typing import Any

import aiohttp
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    FlexibleChecksumError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
    ResponseStreamingError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError
from botocore.parsers import ResponseParserError

from ..errors import AccessDeniedError, AlreadyExistsError, CkptioError, CredentialsError, NotFoundError, TransferError
from . import body as _body
from . import retry as _retry

CREDENTIALS_HINT = (
    "set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or give the s3 backend access_key_id/"
    "secret_access_key, credentials_file or profile (in ckptio.toml [backends.s3] or "
    "ckptio.configure), or anon=true for public buckets"
)
NOT_FOUND = {"NoSuchKey", "404", "NotFound", "NoSuchUpload"}
EXISTS = {"PreconditionFailed", "412", "ConditionalRequestConflict"}
BAD_CREDENTIALS = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
    "AuthorizationHeaderMalformed",
}
DENIED = {"AccessDenied", "403", "AllAccessDisabled", "Forbidden"}
# FlexibleChecksumError: the body did not match the checksum S3 sent with it (truncated or damaged in flight)
_TRANSIENT_CLIENT = (
    ResponseStreamingError,
    BotoConnectionError,
    HTTPClientError,
    IncompleteReadError,
    FlexibleChecksumError,
    ResponseParserError,
    aiohttp.ClientPayloadError,
    aiohttp.ClientConnectionError,
)


def error_code(e: ClientError) -> tuple[str, int | None]:
    """The S3 error code and the HTTP status of a botocore ClientError."""
    code = str(e.response.get("Error", {}).get("Code", ""))
    return code, e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")


def reply_error(status: int, headers: dict[str, str], body: bytes, operation: str) -> ClientError:
    """The botocore ``ClientError`` an S3 error reply makes (its XML's ``Code`` and ``Message``; the
    status as the code when the body has none, as botocore does), for replies read outside botocore."""
    text = body.decode("utf-8", "replace")
    code = re.search(r"<Code>([^<]{1,200})</Code>", text)
    message = re.search(r"<Message>([^<]{0,1000})</Message>", text)
    return ClientError(
        {
            "Error": {"Code": code.group(1) if code else str(status), "Message": message.group(1) if message else ""},
            "ResponseMetadata": {"HTTPStatusCode": status, "HTTPHeaders": headers},
        },
        operation,
    )


def refuses_presigned(status: int, code: str) -> bool:
    """Whether an error reply to a presigned GET may be about the way it was sent (a redirect to the
    bucket's region, a signature or a bucket policy refusing query-string authentication), so that the
    client's own signed GET may fare differently. Expired credentials are not: the retry policy
    refreshes them, and the next URL is signed with the new ones."""
    if code in _retry.EXPIRED_CODES:
        return False
    return 300 <= status < 400 or status in (401, 403) or (status == 400 and code.startswith("Authorization"))


def classify(e: BaseException) -> str:
    """TRANSIENT / EXPIRED / PERMANENT for any error the S3 client raises (see :mod:`ckptio.objectstore.retry`)."""
    if isinstance(e, ClientError):
        code, status = error_code(e)
        return _retry.classify_status(status, code)
    if isinstance(e, _TRANSIENT_CLIENT):
        return _retry.TRANSIENT
    common = _retry.classify_common(e)
    return common if common is not None else _retry.PERMANENT


def translate(e: BaseException, uri: str, *, checksum: str, endpoint_url: str | None) -> BaseException:
    """A ckptio error naming ``uri`` for an error the S3 client raised (the client's error is the
    ``__cause__``); ``e`` itself when it is a ckptio error or not the client's. ``checksum`` and
    ``endpoint_url`` are the backend's, for the hints in messages."""
    if isinstance(e, CkptioError):
        return e
    out: BaseException
    if isinstance(e, ClientError):
        err = e.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code == "NoSuchBucket":
            out = NotFoundError(uri, "no such bucket")
        elif code in NOT_FOUND:
            out = NotFoundError(uri)
        elif code in EXISTS:
            out = AlreadyExistsError(uri)
        elif code in BAD_CREDENTIALS:
            out = CredentialsError(uri, f"S3 rejected the credentials ({code}); {CREDENTIALS_HINT}")
        elif code in DENIED:
            out = AccessDeniedError(uri, f"S3 denied access ({code})")
        else:
            message = str(err.get("Message", ""))
            hint = ""
            if checksum != "none" and code not in _retry.DAMAGED_CODES and "checksum" in message.lower():
                hint = " (if this store does not support S3 checksum headers, set the s3 option checksum = 'none')"
            out = TransferError(errno.EIO, f"S3 error {code} (HTTP {status}) for {uri}: {message}{hint}", uri)
    elif isinstance(e, (NoCredentialsError, PartialCredentialsError)):
        out = CredentialsError(uri, f"no S3 credentials found; {CREDENTIALS_HINT}")
    elif isinstance(e, (BotoConnectionError, OSError, asyncio.TimeoutError)):
        out = TransferError(
            errno.EIO, f"cannot reach S3 endpoint {endpoint_url or 'aws'} for {uri}: {type(e).__name__}", uri
        )
    elif isinstance(e, BotoCoreError):
        out = TransferError(errno.EIO, f"S3 client error for {uri}: {type(e).__name__}: {e}", uri)
    else:
        return e
    out.__cause__ = e
    return out


def load_credentials_file(path: str) -> dict[str, str]:
    try:
        with open(os.path.expanduser(path)) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise CredentialsError(path, "S3 credentials file not found") from None
    except (OSError, ValueError) as e:
        raise CredentialsError(path, f"S3 credentials file is not readable JSON ({type(e).__name__})") from None
    if not isinstance(data, dict):
        raise CredentialsError(path, "S3 credentials file must hold a JSON object")
    return {str(k).lower(): v for k, v in data.items()}


def checksum_option(value: str | None, profile: str | None) -> str:
    """``crc32`` or ``none``; unset follows boto3's ``request_checksum_calculation`` (the
    ``AWS_REQUEST_CHECKSUM_CALCULATION`` variable or the AWS config file, for ``profile``)."""
    if value is None:
        import botocore.exceptions
        import botocore.session

        try:
            setting = botocore.session.Session(profile=profile).get_config_variable("request_checksum_calculation")
        except botocore.exceptions.BotoCoreError:  # e.g. no such profile: reported when credentials are needed
            setting = os.environ.get("AWS_REQUEST_CHECKSUM_CALCULATION")
        return "none" if str(setting or "").strip().lower() == "when_required" else "crc32"
    v = str(value).strip().lower()
    if v not in ("crc32", "none"):
        raise ValueError(f"s3 option checksum must be 'crc32' or 'none', got {value!r}")
    return v


def _make_prehashed_signer() -> Any:
    """An ``s3v4`` signer that takes the payload SHA-256 a :class:`_body.MemoryBody` carries
    (computed off the event-loop thread) instead of reading the body to hash it there."""
    import botocore.auth

    class PrehashedSha256Auth(botocore.auth.S3SigV4Auth):
        def _should_sha256_sign_payload(self, request: Any) -> bool:
            # botocore leaves an upload's payload unsigned over https when the request carries a checksum
            # header that botocore added itself; the writer adds its CRC32 itself, so apply the same rule
            # (TLS + CRC32), or the IO loop would SHA-256 every part
            s3_config = getattr(request.context.get("client_config"), "s3", None) or {}
            if (
                s3_config.get("payload_signing_enabled") is None
                and request.url.startswith("https")
                and request.context.get("has_streaming_input", False)
                and any(k.lower().startswith("x-amz-checksum-") for k in request.headers)
            ):
                return False
            return bool(super()._should_sha256_sign_payload(request))

        def payload(self, request: Any) -> str:
            body = getattr(request.body, "__wrapped__", request.body)
            digest = getattr(body, "sha256", None)
            if (
                digest
                and isinstance(body, _body.MemoryBody)
                and body.tell() == 0
                and not self._is_streaming_checksum_payload(request)
                and self._should_sha256_sign_payload(request)
            ):
                return digest
            return super().payload(request)

    botocore.auth.AUTH_TYPE_MAPS[PREHASHED_SIGNER_NAME] = PrehashedSha256Auth
    return PrehashedSha256Auth


PREHASHED_SIGNER_NAME = "ckptio-s3v4-sha256"
PREHASHED_SIGNER = _make_prehashed_signer()


def choose_prehashed_signer(
    signing_name: str = "", signature_version: Any = None, context: Any = None, **kwargs: Any
) -> str | None:
    """choose-signer hook for this backend's clients: plain ``s3v4`` requests (not presigned URLs or
    POSTs, not S3 Express) use :data:`PREHASHED_SIGNER`; everything else is left to botocore."""
    import botocore.handlers

    if not isinstance(signature_version, str) or signature_version.endswith(("-query", "-presign-post")):
        return None
    chosen = botocore.handlers.set_operation_specific_signer(context=context or {}, signing_name=signing_name, **kwargs)
    return PREHASHED_SIGNER_NAME if chosen == "s3v4" else None
