"""What the S3 and GCS backends put on the wire, seen by a counting proxy in front of the real server:
parallel multipart/resumable uploads, ranged reads straight into the caller's buffer, create-mode
preconditions (``If-None-Match: *``, ``ifGenerationMatch=0``), aborted uploads, and the CRC32 and payload
signing of S3 uploads over http and https (moto with a self-signed certificate)."""

from __future__ import annotations

import base64
import os
import zlib

import pytest

import ckptio
from servers import TLSMotoServer, s3_client

MiB = 1024 * 1024


def _s3(proxy, **opts):
    return ckptio.resolve(proxy.uri + "/obj.bin", part_size=5 * MiB, concurrency=3, **opts)


def test_s3_large_write_is_parallel_multipart(s3_proxy):
    b, u = _s3(s3_proxy)
    data = os.urandom(12 * MiB)
    b.write(u, data)
    assert s3_proxy.count("POST", "?uploads") == 1
    assert s3_proxy.count("PUT", "partNumber=") == 3
    assert s3_proxy.count("POST", "uploadId=") == 1  # complete
    assert sum(r.bytes_in for r in s3_proxy.requests if r.method == "PUT") == len(data)
    s3_proxy.clear()
    buf = bytearray(len(data))
    assert b.readinto(u, buf) == len(data) and buf == data
    gets = [r for r in s3_proxy.requests if r.method == "GET"]
    assert len(gets) == 3 and all("range" in {k.lower() for k in r.headers} for r in gets)
    assert s3_proxy.bytes_out == len(data)


def test_s3_small_write_is_one_put(s3_proxy):
    b, u = _s3(s3_proxy)
    b.write(u, b"small")
    assert [(r.method, r.bytes_in) for r in s3_proxy.requests] == [("PUT", 5)]


def test_s3_create_sends_if_none_match(s3_proxy):
    b, u = _s3(s3_proxy)
    b.write(u, b"x", mode="create")
    b.write(u + "2", os.urandom(11 * MiB), mode="create")
    conditional = [r for r in s3_proxy.requests if r.headers.get("If-None-Match") == "*"]
    assert [(r.method, "uploadId=" in r.path) for r in conditional] == [("PUT", False), ("POST", True)]


def test_s3_create_race_lost_at_complete_aborts_upload(s3_proxy, s3_endpoint):
    b, u = _s3(s3_proxy)
    w = b.open_writer(u, mode="create")
    w.write(os.urandom(11 * MiB))  # two parts go up
    b.write(u, b"winner")  # someone else commits first
    with pytest.raises(FileExistsError):
        w.close()
    assert b.read(u) == b"winner"
    bucket = s3_proxy.uri[len("s3://") :]
    assert s3_client(s3_endpoint).list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_s3_abort_aborts_multipart_upload(s3_proxy, s3_endpoint):
    b, u = _s3(s3_proxy)
    w = b.open_writer(u)
    w.write(os.urandom(16 * MiB))
    w.abort()
    assert s3_proxy.count("DELETE", "uploadId=") == 1
    bucket = s3_proxy.uri[len("s3://") :]
    assert s3_client(s3_endpoint).list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert not b.exists(u)


def test_gcs_create_sends_if_generation_match_0(gcs_proxy):
    b, u = ckptio.resolve(gcs_proxy.uri + "/obj.bin", part_size=256 * 1024)
    b.write(u, b"small", mode="create")
    b.write(u + "2", os.urandom(600 * 1024), mode="create")
    uploads = [r for r in gcs_proxy.requests if r.method == "POST" and "/upload/" in r.path]
    assert len(uploads) == 2 and all("ifGenerationMatch=0" in r.path for r in uploads)
    assert "uploadType=media" in uploads[0].path and "uploadType=resumable" in uploads[1].path
    gcs_proxy.clear()
    b.write(u, b"overwrite")
    assert not any("ifGenerationMatch" in r.path for r in gcs_proxy.requests)


def test_gcs_resumable_chunks_are_256k_multiples_and_reads_are_ranged(gcs_proxy):
    b, u = ckptio.resolve(gcs_proxy.uri + "/obj.bin", part_size=300 * 1024, concurrency=4)
    assert b.part_size == 512 * 1024
    data = os.urandom(2 * MiB + 5)
    with b.open_writer(u) as w:
        for i in range(0, len(data), 100_000):
            w.write(data[i : i + 100_000])
    ranges = [r.headers["Content-Range"] for r in gcs_proxy.requests if r.method == "PUT"]
    assert ranges == [f"bytes {o}-{o + 512 * 1024 - 1}/*" for o in range(0, 2 * MiB, 512 * 1024)] + [
        f"bytes {2 * MiB}-{2 * MiB + 4}/{len(data)}"
    ]
    gcs_proxy.clear()
    assert b.read(u) == data
    assert gcs_proxy.count("GET", "alt=media") == 5 and gcs_proxy.bytes_out >= len(data)
    assert b.stat(u).version.isdigit()  # the generation


def _crc32_b64(data: bytes) -> str:
    return base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()


def test_s3_uploads_carry_a_crc32_per_part_that_s3_stores(s3_proxy, s3_endpoint):
    b, u = _s3(s3_proxy)
    data = os.urandom(12 * MiB)
    b.write(u, data)
    b.write(u + "-small", b"small")
    create = [r for r in s3_proxy.requests if r.method == "POST" and "?uploads" in r.path]
    assert create[0].headers.get("x-amz-checksum-algorithm") == "CRC32"
    parts = sorted((r for r in s3_proxy.requests if "partNumber=" in r.path), key=lambda r: r.path)
    sent = {r.headers.get("x-amz-checksum-crc32") for r in parts}
    want = {_crc32_b64(data[i : i + 5 * MiB]) for i in range(0, len(data), 5 * MiB)}
    assert sent == want
    small = [r for r in s3_proxy.requests if r.method == "PUT" and "partNumber=" not in r.path]
    assert small[0].headers.get("x-amz-checksum-crc32") == _crc32_b64(b"small")
    bucket, key = u[len("s3://") :].split("/", 1)
    client = s3_client(s3_endpoint)
    # S3's composite checksum: the CRC32 of the parts' CRC32s (real S3 appends "-<parts>")
    composite = _crc32_b64(
        b"".join(zlib.crc32(data[i : i + 5 * MiB]).to_bytes(4, "big") for i in range(0, len(data), 5 * MiB))
    )
    assert (
        client.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")["ChecksumCRC32"].split("-")[0] == composite
    )
    assert client.head_object(Bucket=bucket, Key=key + "-small", ChecksumMode="ENABLED")["ChecksumCRC32"] == _crc32_b64(
        b"small"
    )
    assert b.read(u) == data


@pytest.mark.parametrize("how", ["option", "boto3 env", "aws config profile"])
def test_s3_checksum_none_sends_no_checksum_headers(s3_proxy, monkeypatch, tmp_path, how):
    if how == "option":
        b, u = _s3(s3_proxy, checksum="none")
    elif how == "boto3 env":
        monkeypatch.setenv("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required")
        b, u = _s3(s3_proxy)
    else:
        config = tmp_path / "aws-config"
        config.write_text("[profile r2]\nrequest_checksum_calculation = when_required\n")
        monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
        monkeypatch.delenv("AWS_REQUEST_CHECKSUM_CALCULATION", raising=False)
        assert ckptio.resolve(s3_proxy.uri + "/x", part_size=5 * MiB)[0].checksum == "crc32"  # other profiles
        b, u = _s3(s3_proxy, profile="r2")
    data = os.urandom(11 * MiB)
    b.write(u, data)
    b.write(u + "-small", b"small")
    assert not [r for r in s3_proxy.requests if any(k.lower().startswith("x-amz-checksum") for k in r.headers)]
    assert b.read(u) == data


def test_s3_checksum_option_is_checked():
    with pytest.raises(ckptio.SettingsError, match="checksum must be 'crc32' or 'none'"):
        ckptio.resolve("s3://bucket/x", checksum="md5")


@pytest.mark.parametrize(
    "url, crc, signed",
    [
        ("https://s3.us-east-1.amazonaws.com/b/k", True, False),  # TLS + CRC32: unsigned payload, as botocore does
        ("https://s3.us-east-1.amazonaws.com/b/k", False, True),
        ("http://127.0.0.1:9000/b/k", True, True),  # plain http: always signed
    ],
)
def test_s3_payload_signing_follows_botocores_rule_without_hashing_on_the_loop(url, crc, signed):
    import botocore.credentials
    from botocore.awsrequest import AWSRequest

    from ckptio.objectstore import s3_support as s3mod
    from ckptio.objectstore.body import MemoryBody

    body = MemoryBody(b"x" * 1000, sha256="f" * 64)  # a digest computed elsewhere: the signer must take it as is
    req = AWSRequest(method="PUT", url=url, data=body, headers={"x-amz-checksum-crc32": "AAAAAA=="} if crc else {})
    req.context.update({"has_streaming_input": True})
    auth = s3mod.PREHASHED_SIGNER(botocore.credentials.Credentials("key", "secret"), "s3", "us-east-1")
    assert auth.payload(req) == ("f" * 64 if signed else "UNSIGNED-PAYLOAD")


@pytest.mark.parametrize(
    "endpoint, checksum, sha",
    [
        (None, "crc32", False),
        ("https://minio.example:9000", "crc32", False),
        ("https://minio.example:9000", "none", True),
        ("http://127.0.0.1:9000", "crc32", True),
        ("http://127.0.0.1:9000", "none", True),
    ],
)
def test_s3_writer_hashes_what_the_request_needs(endpoint, checksum, sha):
    import asyncio
    import hashlib

    b, u = ckptio.resolve(
        "s3://bucket/k", endpoint_url=endpoint, checksum=checksum, access_key_id="a", secret_access_key="b"
    )
    w = b.open_writer(u)
    data = os.urandom(100 * 1024)  # above the inline limit: hashed on a worker thread
    digest, args = asyncio.run(w._digests(data))
    assert digest == (hashlib.sha256(data).hexdigest() if sha else None)
    assert args == ({"ChecksumAlgorithm": "CRC32", "ChecksumCRC32": _crc32_b64(data)} if checksum == "crc32" else {})
    w.abort()


@pytest.fixture(scope="module")
def tls_s3(tmp_path_factory):
    """moto over https (a self-signed certificate, trusted through AWS_CA_BUNDLE in the test)."""
    with TLSMotoServer(str(tmp_path_factory.mktemp("tls"))) as server:
        yield server


def test_s3_over_tls_parts_carry_crc32_and_unsigned_payloads(tls_s3, monkeypatch):
    """Over https the IO loop hashes no part: each carries its CRC32 (hashed on a worker thread) and an
    unsigned payload, as botocore does for its own checksums; S3 stores the composite checksum."""
    import threading

    import botocore.auth

    monkeypatch.setenv("AWS_CA_BUNDLE", tls_s3.ca_file)
    client = s3_client(tls_s3.url)
    client.create_bucket(Bucket="tls-bucket")
    payloads = []
    real = botocore.auth.SigV4Auth.payload

    def spy(self, request):
        out = real(self, request)
        if request.method == "PUT":
            payloads.append((threading.current_thread().name, out))
        return out

    monkeypatch.setattr(botocore.auth.SigV4Auth, "payload", spy)
    b, u = ckptio.resolve("s3://tls-bucket/obj.bin", endpoint_url=tls_s3.url, part_size=5 * MiB)
    data = os.urandom(12 * MiB)
    b.write(u, data)
    b.write(u + "-small", b"small")
    assert len(payloads) == 4 and {p for _, p in payloads} == {"UNSIGNED-PAYLOAD"}
    assert b.read(u) == data
    head = client.head_object(Bucket="tls-bucket", Key="obj.bin", ChecksumMode="ENABLED")
    assert head["ChecksumCRC32"].split("-")[0] == _crc32_b64(
        b"".join(zlib.crc32(data[i : i + 5 * MiB]).to_bytes(4, "big") for i in range(0, len(data), 5 * MiB))
    )
