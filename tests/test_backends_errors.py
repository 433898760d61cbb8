"""Bad input and failure modes at the backend boundary: missing extras, credentials, endpoints,
malformed URIs, and secrets that must never leak into reprs or error messages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import traceback

import pytest

import ckptio
from ckptio.errors import CredentialsError, InvalidURIError, MissingDependencyError, SettingsError, TransferError
from servers import free_port

SECRET = "SUPERSECRETvalue1234567890"


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
    )


def test_import_ckptio_does_not_import_storage_clients():
    r = _run("""
        import sys, ckptio
        ckptio.resolve("memory://x/y")
        print(sorted(m for m in ("s3fs", "gcsfs", "botocore", "aiobotocore") if m in sys.modules))
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "module,uri,extra", [("s3fs", "s3://bucket/k", "ckptio[s3]"), ("gcsfs", "gs://bucket/k", "ckptio[gcs]")]
)
def test_missing_extra_names_what_to_install(module, uri, extra):
    r = _run(f"""
        import sys
        sys.modules[{module!r}] = None  # as if not installed
        import ckptio
        from ckptio.errors import MissingDependencyError
        try:
            ckptio.resolve({uri!r})
        except MissingDependencyError as e:
            print("MISSING:", e)
    """)
    assert r.returncode == 0, r.stderr
    assert "MISSING:" in r.stdout and extra in r.stdout


def test_missing_s3_credentials(s3_endpoint, monkeypatch, tmp_path):
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    b, u = ckptio.resolve("s3://bucket/key", endpoint_url=s3_endpoint, retries=0)
    with pytest.raises(CredentialsError) as ei:
        b.read(u)
    assert "s3://bucket/key" in str(ei.value) and "AWS_ACCESS_KEY_ID" in str(ei.value)
    assert isinstance(ei.value, PermissionError)


def test_credentials_file_in_easy_io_format(s3_uri, s3_endpoint, tmp_path, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    creds = tmp_path / "creds.json"
    creds.write_text(
        json.dumps(
            {
                "aws_access_key_id": "fromfile",
                "aws_secret_access_key": SECRET,
                "endpoint_url": s3_endpoint,
                "region_name": "us-east-1",
            }
        )
    )
    ckptio.reset()
    b, u = ckptio.resolve(s3_uri + "/k", credentials_file=str(creds))
    b.write(u, b"via file")
    assert b.read(u) == b"via file"
    assert b.endpoint_url == s3_endpoint
    with pytest.raises(CredentialsError, match="not found"):
        ckptio.resolve(s3_uri + "/k", credentials_file=str(tmp_path / "missing.json"))


def test_unreachable_gcs_endpoint(gcs_endpoint):
    endpoint = f"http://127.0.0.1:{free_port()}"
    b, u = ckptio.resolve("gs://bucket/obj", endpoint_url=endpoint, retries=0, connect_timeout=2, anon=True)
    with pytest.raises(TransferError) as ei:
        b.read(u)
    assert "gs://bucket/obj" in str(ei.value) and endpoint in str(ei.value)


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_unreachable_endpoint_is_a_transfer_error_naming_uri(scheme):
    endpoint = f"http://127.0.0.1:{free_port()}"
    opts = {"secret_access_key": SECRET, "access_key_id": "id"} if scheme == "s3" else {"token": SECRET}
    t0 = time.monotonic()
    b = None
    with pytest.raises((TransferError, CredentialsError)) as ei:
        b, u = ckptio.resolve(f"{scheme}://bucket/obj", endpoint_url=endpoint, retries=0, connect_timeout=2, **opts)
        b.write(u, b"data")
    assert time.monotonic() - t0 < 10
    text = "".join(traceback.format_exception(ei.value)) + repr(b) + repr(ei.value)
    if scheme == "s3":  # (gcsfs checks a literal token when it is given: no network here, so that fails first)
        assert isinstance(ei.value, TransferError)
        assert f"{scheme}://bucket/obj" in str(ei.value) and endpoint in str(ei.value)
    assert SECRET not in text
    assert SECRET not in repr(ckptio.settings())


def test_secrets_not_in_repr_or_settings(s3_endpoint):
    ckptio.configure(
        backends={
            "s3": {
                "endpoint_url": s3_endpoint,
                "access_key_id": "id",
                "secret_access_key": SECRET,
                "session_token": SECRET,
            }
        }
    )
    b, _ = ckptio.resolve("s3://bucket/x")
    assert SECRET not in repr(b) and SECRET not in str(ckptio.settings())


@pytest.mark.parametrize("uri", ["s3://", "s3:///key", "gs://", "s3://bucket", "gs://bucket/"])
def test_malformed_object_uri(uri, s3_endpoint, gcs_endpoint):
    ckptio.configure(
        backends={"s3": {"endpoint_url": s3_endpoint}, "gcs": {"endpoint_url": gcs_endpoint, "anon": True}}
    )
    b, u = ckptio.resolve(uri)
    with pytest.raises(InvalidURIError) as ei:
        b.read(u)
    assert uri in str(ei.value)
    assert isinstance(ei.value, ValueError)


def test_invalid_options_fail_when_the_backend_is_built(s3_endpoint):
    with pytest.raises(SettingsError, match="part_size"):
        ckptio.resolve("s3://bucket/x", endpoint_url=s3_endpoint, part_size=1024)
    with pytest.raises(SettingsError, match="no_such_option"):
        ckptio.resolve("s3://bucket/x", no_such_option=1)


def test_missing_bucket_is_not_found(s3_uri):
    b, _ = ckptio.resolve(s3_uri)
    with pytest.raises(FileNotFoundError, match="no such bucket: s3://no-such-bucket-x/k"):
        b.read("s3://no-such-bucket-x/k")


def test_missing_extra_error_is_an_import_error():
    assert issubclass(MissingDependencyError, ImportError)
