"""How the S3 backend's client is configured, kept out of :mod:`ckptio.backends.s3` so the storage
keeps its request hooks: :class:`S3ClientConfig` turns the endpoint, region and credential options
(``credentials_file``, the environment, a ``credential_provider``) into one s3fs filesystem with
botocore's retries off; :func:`own_retries` hooks every aiobotocore client it opens (retries left to
:class:`~ckptio.objectstore.retry.RetryPolicy`, the prehashed ``s3v4`` signer); :func:`credentials_from`
reads what a ``credential_provider`` returns.

Imported by :mod:`ckptio.backends.s3` after its client-version check (it imports s3fs and botocore).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import s3fs

from ..errors import CredentialsError
from . import body as _body
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
    return client


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
