"""Remote faults injected by a proxy in front of the real S3 server (moto) and the GCS emulator.

Transient faults (503/500, connection reset mid-body, stalls, truncated bodies, an expired token
with a credential provider) end in success with the right bytes, retrying only the failed request
(one part, one range). Permanent faults end in a clear error (URI, part, attempt count) within the
deadline, with no partial object under the final name and no abandoned multipart upload.
"""

from __future__ import annotations

import errno
import os
import sys
import time

import pytest
import torch

import ckptio
from ckptio.errors import AccessDeniedError, CredentialsError, NotFoundError, TransferError
from ckptio.objectstore.retry import RetryPolicy
from faultproxy import FAST, Fault, MiB
from servers import s3_client

TRANSIENT = {
    "503": dict(kind="status", status=503),
    "500": dict(kind="status", status=500),
    "reset": dict(kind="reset"),
    "reset-before": dict(kind="reset", before=True),
    "stall": dict(kind="stall"),
    "truncate": dict(kind="truncate"),
}


def _big(faults) -> bytes:
    # S3: 3 parts of 5 MiB; GCS: 3 resumable chunks of 256 KiB
    return os.urandom(12 * MiB if faults.flavor == "s3" else 700 * 1024)


def _part_puts(faults) -> int:
    return faults.count("PUT", "partNumber=") if faults.flavor == "s3" else faults.count("PUT", "upload_id=")


@pytest.mark.parametrize("fault", ["503", "reset", "reset-before", "stall"])  # (PUT answers have no body)
def test_transient_fault_on_part_upload_retries_only_that_part(faults, fault):
    b, u = ckptio.resolve(faults.uri + "/obj.bin")
    data = _big(faults)
    faults.add(Fault(method="PUT", nth=2, **TRANSIENT[fault]))
    b.write(u, data)
    assert faults.fired() == 1
    assert b.read(u) == data
    if faults.flavor == "s3":
        assert faults.count("POST", "?uploads") == 1  # the upload was not restarted
        assert 4 <= _part_puts(faults) <= 4  # 3 parts + the one retried
        assert s3_client(faults.endpoint).list_multipart_uploads(Bucket=faults.bucket).get("Uploads", []) == []
    else:
        assert faults.count("POST", "uploadType=resumable") == 1


@pytest.mark.parametrize("code", ["BadDigest", "XAmzContentSHA256Mismatch"])
def test_s3_part_damaged_in_flight_is_sent_again(s3_faults, code):
    """S3 answers 400 when a part's body does not match its CRC32 / payload hash: only that part is re-sent;
    if it keeps happening the error names the part and the attempts."""
    b, u = ckptio.resolve(s3_faults.uri + "/obj.bin")
    data = _big(s3_faults)
    s3_faults.add(Fault("status", status=400, code=code, method="PUT", path="partNumber=2"))
    b.write(u, data)
    assert s3_faults.fired() == 1 and _part_puts(s3_faults) == 4 and b.read(u) == data
    s3_faults.clear()
    s3_faults.add(Fault("status", status=400, code=code, method="PUT", path="partNumber=2", fraction=1.0))
    with pytest.raises(TransferError, match=r"part 2 .*attempt") as ei:
        b.write(u + "2", data)
    assert code in str(ei.value)
    assert s3_client(s3_faults.endpoint).list_multipart_uploads(Bucket=s3_faults.bucket).get("Uploads", []) == []


@pytest.mark.parametrize("fault", ["500", "reset", "stall", "truncate"])
def test_transient_fault_on_ranged_read_retries_only_that_range(faults, fault):
    b, u = ckptio.resolve(faults.uri + "/obj.bin")
    data = _big(faults)
    b.write(u, data)
    faults.clear()
    faults.add(Fault(method="GET", nth=2, **TRANSIENT[fault]))
    buf = bytearray(len(data))
    assert b.readinto(u, buf) == len(data) and buf == data
    assert faults.fired() == 1
    assert faults.count("GET") == 3 + 1  # three ranges, one of them twice


@pytest.mark.parametrize("fault", ["503", "reset", "reset-before", "stall", "truncate"])
def test_transient_fault_on_a_whole_reads_first_get(faults, fault):
    """ckptio.get's first GET streams into the bytes it returns, made when that reply's headers came: a
    retry of it refills them from the start (a small object whole; a larger one's first range)."""
    b, u = ckptio.resolve(faults.uri + "/whole.bin")
    for data in (os.urandom(MiB + 3), _big(faults)):
        b.write(u, data)
        faults.clear()
        faults.add(Fault(method="GET", nth=1, **TRANSIENT[fault]))
        assert b.read(u) == data
        assert faults.fired() == 1


@pytest.mark.parametrize("size", [MiB + 3, 7 * MiB])
def test_a_retried_first_get_that_tells_another_size_is_an_integrity_error(faults, size, monkeypatch):
    """The first reply told the size (and the bytes were made for it), then its connection broke; the
    retry's reply tells another size: the object changed under the read (on a store whose version pin
    cannot tell, as the GCS emulator's). Never a truncated or padded result."""
    from ckptio.errors import IntegrityError
    from ckptio.objectstore import retry as _retry

    b, u = ckptio.resolve(faults.uri + "/resized.bin")
    b.write(u, os.urandom(size))
    told = []
    real = _retry.object_size

    def second_tells_more(status, content_range, content_length):
        n = real(status, content_range, content_length)
        told.append(n)
        return n + 1000 if n is not None and len(told) == 2 else n

    monkeypatch.setattr(_retry, "object_size", second_tells_more)
    faults.clear()
    faults.add(Fault(method="GET", nth=1, **TRANSIENT["reset"]))
    with pytest.raises(IntegrityError, match="resized.bin was replaced while it was being read"):
        b.read(u)
    assert faults.fired() == 1 and len(told) >= 2


@pytest.mark.parametrize("fault", ["503", "reset"])
def test_transient_fault_on_metadata_calls(faults, fault):
    b, u = ckptio.resolve(faults.uri + "/dir/obj")
    b.write(u, b"payload")
    for op in (
        lambda: b.stat(u).size == 7,
        lambda: [i.uri for i in b.list(faults.uri + "/dir")] == [u],
        lambda: b.read(u) == b"payload",
        lambda: b.delete(u) is None,
        lambda: not b.exists(u),
    ):
        faults.clear()
        faults.add(Fault(nth=1, **TRANSIENT[fault]))
        assert op()
        assert faults.fired() == 1


def test_small_create_write_survives_lost_response(faults):
    """The PUT reached the server but the answer was lost: the retry's precondition failure is
    recognised as our own earlier success, not reported as FileExistsError."""
    b, u = ckptio.resolve(faults.uri + "/marker")
    faults.add(Fault("reset", method=("PUT" if faults.flavor == "s3" else "POST"), nth=1))
    b.write(u, b"commit marker", mode="create")
    assert b.read(u) == b"commit marker"
    faults.clear()
    with pytest.raises(FileExistsError):
        b.write(u, b"other", mode="create")


def test_s3_multipart_create_survives_lost_complete_response(s3_faults):
    b, u = ckptio.resolve(s3_faults.uri + "/big")
    data = _big(s3_faults)
    s3_faults.add(Fault("reset", method="POST", path="uploadId=", nth=1))  # the complete
    b.write(u, data, mode="create")
    assert s3_faults.fired() == 1 and b.read(u) == data


def test_only_transient_errors_are_retried(faults):
    b, u = ckptio.resolve(faults.uri + "/obj")
    b.write(u, b"x")
    for status, exc in ((403, AccessDeniedError), (404, NotFoundError)):
        faults.clear()
        faults.add(Fault("status", status=status, method="GET", fraction=1.0))
        with pytest.raises(exc) as ei:
            b.read(u)
        assert u in str(ei.value)
        sent = [(r.method, r.path) for r in faults.requests]
        assert len(sent) == len(set(sent))  # no request was sent twice


def test_no_hidden_client_retries(faults):
    """botocore/gcsfs must not retry under us: max_attempts=1 means exactly one request."""
    b, u = ckptio.resolve(faults.uri + "/obj", max_attempts=1)
    b.write(u, b"x")
    faults.clear()
    faults.add(Fault("status", status=503, fraction=1.0))
    with pytest.raises(TransferError, match="1 attempt"):
        b.read(u)
    assert len(faults.requests) == 1


def test_permanent_upload_failure_is_clear_and_leaves_nothing(faults):
    b, u = ckptio.resolve(faults.uri + "/obj.bin")
    b.write(u, b"previous committed version")
    faults.clear()
    faults.add(
        Fault(
            "status",
            status=503,
            method="PUT",
            path=("partNumber=2" if faults.flavor == "s3" else "upload_id="),
            fraction=1.0,
        )
    )
    with pytest.raises(TransferError) as ei:
        b.write(u, _big(faults))
    msg = str(ei.value)  # it ran out of attempts, well within the deadline (no wall clock: busy machines)
    assert u in msg and f"gave up after {FAST['max_attempts']} attempt(s)" in msg
    assert "503" in msg or "SlowDown" in msg
    assert ("part 2" in msg) if faults.flavor == "s3" else ("chunk" in msg)
    assert ei.value.attempts == FAST["max_attempts"]
    faults.clear()
    assert b.read(u) == b"previous committed version"  # the old object is untouched
    if faults.flavor == "s3":
        assert s3_client(faults.endpoint).list_multipart_uploads(Bucket=faults.bucket).get("Uploads", []) == []
        assert faults.count("DELETE", "uploadId=") >= 0


def test_s3_failed_upload_aborts_multipart_upload(s3_faults):
    b, u = ckptio.resolve(s3_faults.uri + "/new.bin")
    s3_faults.add(Fault("reset", method="PUT", path="partNumber=3", fraction=1.0))
    with pytest.raises(TransferError, match="part 3"):
        b.write(u, _big(s3_faults))
    assert s3_faults.count("DELETE", "uploadId=") == 1
    assert s3_client(s3_faults.endpoint).list_multipart_uploads(Bucket=s3_faults.bucket).get("Uploads", []) == []
    assert not b.exists(u)


def test_permanent_read_failure_names_range_and_attempts(faults):
    b, u = ckptio.resolve(faults.uri + "/obj.bin")
    data = _big(faults)
    b.write(u, data)
    faults.clear()
    faults.add(Fault("truncate", method="GET", path="alt=media" if faults.flavor == "gcs" else "", fraction=1.0))
    with pytest.raises(TransferError) as ei:
        b.read(u)
    msg = str(ei.value)
    # every attempt was cut short; the last one may end as a dropped connection (the server closes it
    # mid-body), and the message then names the first error too
    assert u in msg and "ranged read of bytes" in msg and "attempt(s)" in msg and "Truncated" in msg


def test_giving_up_names_the_first_error_when_the_last_differs():
    import asyncio

    from ckptio.objectstore import retry

    errors = iter([retry.TruncatedBodyError("body ended after 3 of 9 bytes"), ConnectionResetError("reset")] * 2)

    async def fail():
        raise next(errors)

    policy = RetryPolicy(max_attempts=2, base_delay=0.0, deadline=30.0)
    run = policy.run(fail, uri="s3://bkt/k", what="read", classify=lambda e: retry.TRANSIENT, describe=repr)
    with pytest.raises(TransferError) as ei:
        asyncio.run(run)
    msg = str(ei.value)
    assert "last error: ConnectionResetError('reset')" in msg and "first error: TruncatedBodyError" in msg

    async def reset():
        raise ConnectionResetError("reset")

    with pytest.raises(TransferError) as ei:  # the same error every time: said once
        asyncio.run(policy.run(reset, uri="s3://bkt/k", what="read", classify=lambda e: retry.TRANSIENT, describe=repr))
    assert "last error: ConnectionResetError('reset')" in str(ei.value) and "first error" not in str(ei.value)


def _tight(faults, key: str, **options):
    """The object ``key`` written with the fixture's patient settings, and a backend with ``options``
    to read it: a busy machine's slow first request (client start-up) is never what a test times."""
    b, u = ckptio.resolve(f"{faults.uri}/{key}")
    b.write(u, b"abc")
    faults.clear()
    return ckptio.resolve(u, **options)[0], u


def test_stall_forever_ends_within_the_deadline(faults):
    # a stall longer than the test, and attempts that would outlast it: only the deadline can end the read
    b, u = _tight(faults, "obj", max_attempts=1000, deadline=2.0, stall_timeout=0.4)
    faults.add(Fault("stall", method="GET", fraction=1.0, stall=300))
    t0 = time.monotonic()
    with pytest.raises(TransferError) as ei:
        b.readinto(u, bytearray(3))
    assert ei.value.errno == errno.ETIMEDOUT and "deadline of 2s exceeded" in str(ei.value)
    assert time.monotonic() - t0 < 2.0 + 30  # the bound is for a busy machine: without the deadline, minutes


def test_per_attempt_timeout_bounds_a_stalled_request(faults, caplog):
    # nothing else would end the stalled attempt for 300 s (stall timeout, read timeout, deadline): the
    # per-attempt timeout does, and the next attempt succeeds (a few spare ones for a busy machine)
    b, u = _tight(faults, "obj", max_attempts=6, timeout=3.0, stall_timeout=300, read_timeout=300, deadline=600)
    faults.add(Fault("stall", method="GET", nth=1, before=True, stall=300))
    buf = bytearray(3)
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="ckptio"):
        assert b.readinto(u, buf) == 3 and buf == b"abc"
    assert faults.fired() == 1 and "StalledError: no response within 3s" in caplog.text
    assert time.monotonic() - t0 < 60


# ---- credentials ------------------------------------------------------------------------------


class Provider:
    def __init__(self, flavor: str) -> None:
        self.flavor, self.calls = flavor, 0

    def __call__(self):
        self.calls += 1
        if self.flavor == "s3":
            return {
                "access_key_id": f"KEY{self.calls}",
                "secret_access_key": f"S3CRET-{self.calls}-xyz",
                "session_token": f"TOKEN-{self.calls}-abc",
            }
        return f"ya29.token-{self.calls}"


def test_expired_token_is_refreshed_and_retried(faults, caplog):
    provider = Provider(faults.flavor)
    b, u = ckptio.resolve(faults.uri + "/obj.bin", credential_provider=provider)
    assert provider.calls == 1  # first credentials come from the provider too
    data = _big(faults)
    faults.add(Fault("expired", method="PUT", nth=2))  # in the middle of a multipart upload
    with caplog.at_level("DEBUG", logger="ckptio"):
        b.write(u, data)
        faults.add(Fault("expired", method="GET", nth=1))
        assert b.read(u) == data
    assert provider.calls == 3 and faults.fired("expired") == 2
    last = faults.requests[-1]
    auth = last.headers.get("Authorization", "")
    if faults.flavor == "s3":  # signed in the header, or in the query (a direct read's presigned URL)
        assert "Credential=KEY3/" in auth or "X-Amz-Credential=KEY3%2F" in last.path, (auth, last.path)
    else:
        assert auth == "Bearer ya29.token-3"
    secrets = ["S3CRET-", "TOKEN-", "ya29.token"]
    assert not any(s in caplog.text for s in secrets)


def test_provider_named_in_settings(s3_faults, monkeypatch):
    import sys
    import types

    mod = types.ModuleType("ckptio_test_provider")
    mod.provider = Provider("s3")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ckptio_test_provider", mod)
    ckptio.configure(
        aliases={"cred": {"target": s3_faults.uri, "options": {"credential_provider": "ckptio_test_provider:provider"}}}
    )
    s3_faults.add(Fault("expired", nth=1))
    ckptio.put(b"hello", "cred://k")
    assert ckptio.get("cred://k") == b"hello" and mod.provider.calls == 2


def test_expired_token_without_provider_is_a_credentials_error(faults):
    b, u = ckptio.resolve(faults.uri + "/obj")
    faults.add(Fault("expired", fraction=1.0))
    with pytest.raises(CredentialsError) as ei:
        b.write(u, b"x")
    assert u in str(ei.value)
    assert len(faults.requests) == 1


# ---- settings --------------------------------------------------------------------------------


def test_retry_options_per_backend_and_per_alias(faults):
    name = "s3" if faults.flavor == "s3" else "gcs"
    ckptio.configure(aliases={"fragile": {"target": faults.uri, "options": {"max_attempts": 1}}})
    ckptio.put(b"x", faults.uri + "/k")
    faults.clear()
    faults.add(Fault("status", status=503, nth=1))
    with pytest.raises(TransferError, match="1 attempt"):
        ckptio.get("fragile://k")
    faults.clear()
    faults.add(Fault("status", status=503, nth=1))
    assert ckptio.get(faults.uri + "/k") == b"x"  # the backend's own setting (4 attempts)
    b, _ = ckptio.resolve(faults.uri + "/k")
    assert b.policy == RetryPolicy(max_attempts=4, deadline=30.0, stall_timeout=1.0)
    b, _ = ckptio.resolve(faults.uri + "/k", retries=2)
    assert b.policy.max_attempts == 4  # max_attempts (from settings) wins over retries
    b, _ = ckptio.resolve(f"{'s3' if name == 's3' else 'gs'}://x/k", max_attempts=None, retries=2)
    assert b.policy.max_attempts == 3


def test_part_size_takes_a_size_string_as_the_docs_say(faults):
    b, _ = ckptio.resolve(faults.uri + "/k", part_size="64MiB")
    assert b.part_size == 64 * MiB
    with pytest.raises(ckptio.errors.SettingsError, match="part_size"):
        ckptio.resolve(faults.uri + "/k", part_size="-1MiB")


def test_invalid_retry_settings_are_rejected():
    with pytest.raises(ckptio.errors.SettingsError, match="max_attempts"):
        ckptio.configure(backends={"s3": {"max_attempts": 0}})
    with pytest.raises(ckptio.errors.SettingsError, match="credential_provider"):
        ckptio.configure(backends={"s3": {"credential_provider": "not a provider"}})
    with pytest.raises(ckptio.errors.SettingsError, match="deadline"):
        ckptio.configure(backends={"gcs": {"deadline": -1}})


def test_backoff_is_full_jitter_and_bounded():
    p = RetryPolicy(base_delay=0.1, max_delay=1.0)
    delays = [p.backoff(a) for a in range(10) for _ in range(50)]
    assert min(delays) >= 0 and max(delays) <= 1.0
    assert len({round(d, 6) for d in delays}) > 100  # jittered


# ---- the easy_io face and fastpickle under random faults ---------------------------------------


@pytest.mark.parametrize("ext", [".pt", ".fpk"])
def test_dump_load_under_random_faults(faults, ext):
    state = {"w": torch.randn(700, 600), "b": torch.arange(1000), "step": 7}  # ~1.7 MB
    uri = faults.uri + "/ckpt/state" + ext
    ckptio.dump(state, uri)
    faults.clear()
    faults.add(Fault("status", status=503, nth=1))
    faults.add(Fault("reset", method="GET", nth=1))  # the first GET; its retry is the truncate rule's first
    faults.add(Fault("truncate", method="GET", path="alt=media" if faults.flavor == "gcs" else "", nth=1))
    ckptio.dump(state, uri)
    out = ckptio.load(uri)
    assert faults.fired() == 3
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"]) and out["step"] == 7


def test_fastpickle_partial_load_under_faults(faults):
    from ckptio import fastpickle

    state = {"a": torch.randn(300, 300), "b": torch.randn(200, 200)}
    uri = faults.uri + "/s.fpk"
    fastpickle.save(state, uri)
    faults.add(Fault("reset", method="GET", nth=1))
    faults.add(Fault("truncate", method="GET", nth=2))
    out = fastpickle.load(uri, keys=["b"])
    assert torch.equal(out["b"], state["b"]) and faults.fired() == 2


def test_s3_store_rejecting_checksum_headers_gets_a_hint(s3_faults):
    """Some S3-compatible stores reject the CRC32 headers; the error says which option turns them off."""
    b, u = ckptio.resolve(s3_faults.uri + "/obj.bin")
    s3_faults.add(
        Fault(
            "status",
            status=501,
            code="NotImplemented",
            method="PUT",
            fraction=1.0,
            message="Header 'x-amz-checksum-crc32' with value 'AAAAAA==' not implemented",
        )
    )
    with pytest.raises(TransferError, match="checksum = 'none'") as ei:
        b.write(u, b"x")
    assert "NotImplemented" in str(ei.value) and u in str(ei.value)
    b2, _ = ckptio.resolve(s3_faults.uri + "/obj.bin", checksum="none")
    with pytest.raises(TransferError) as ei:
        b2.write(u, b"x")
    assert "checksum = 'none'" not in str(ei.value)  # no hint once they are off


def test_stall_watch_ends_a_silent_body_and_lets_a_slow_steady_one_finish():
    # one timer moved forward after each chunk: a body that keeps arriving outlives the stall timeout
    # in total, one that goes silent for longer than it ends with StalledError
    import asyncio

    from ckptio.objectstore.retry import StalledError, StallWatch

    async def chunk(delay: float) -> bytes:
        await asyncio.sleep(delay)
        return b"x"

    async def steady() -> int:
        async with StallWatch(0.2) as watch:
            return sum([len(await watch(chunk(0.05))) for _ in range(10)])  # 0.5 s in all

    async def silent() -> None:
        async with StallWatch(0.2) as watch:
            await watch(chunk(0.01))
            await watch(chunk(30))

    assert asyncio.run(steady()) == 10
    t0 = time.monotonic()
    with pytest.raises(StalledError):
        asyncio.run(silent())
    assert time.monotonic() - t0 < 5


def test_a_guarded_read_ends_stalled_or_with_its_value_and_runs_in_the_callers_task():
    """``stall_guard`` (a whole reply body) and ``within`` (one attempt): StalledError / TimeoutError once
    their time is up, the value otherwise; on Python 3.11+ the read runs in the caller's own task (no task
    a request, which cost a loop round each)."""
    import asyncio

    from ckptio.objectstore.retry import StalledError, stall_guard, within

    async def read(delay: float) -> tuple[bytes, object]:
        await asyncio.sleep(delay)
        return b"body", asyncio.current_task()

    async def main() -> None:
        me = asyncio.current_task()
        for guard in (lambda r: stall_guard(r, 0.2), lambda r: within(r, 0.2)):
            body, task = await guard(read(0.01))
            assert body == b"body" and (task is me or sys.version_info < (3, 11))
            t0 = time.monotonic()
            with pytest.raises(asyncio.TimeoutError) as ei:
                await guard(read(30))
            assert time.monotonic() - t0 < 5
        assert isinstance(ei.value, asyncio.TimeoutError)
        with pytest.raises(StalledError):
            await stall_guard(read(30), 0.1)

    asyncio.run(main())


def test_a_cancelled_request_cleans_up_untimed_and_is_never_retried():
    """A request cancelled from outside: its cleanup runs to the end even when its attempt's time runs
    out meanwhile (as it did in a task of its own), and a request that turns the cancellation into an
    error of its own (a connection error) ends the call cancelled, not retried as that error."""
    import asyncio

    from ckptio.objectstore.retry import RetryPolicy, classify_common, within

    async def cleanup_case() -> list[str]:
        log: list[str] = []

        async def req() -> None:
            try:
                await asyncio.sleep(10)
            finally:
                await asyncio.sleep(0.2)  # past the attempt's 0.1 s
                log.append("cleanup done")

        t = asyncio.ensure_future(within(req(), 0.1))
        await asyncio.sleep(0.05)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        return log

    async def converted_case() -> int:
        attempts = 0

        async def req() -> None:
            nonlocal attempts
            attempts += 1
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                raise ConnectionResetError("the request's own error") from None

        policy = RetryPolicy(timeout=5, max_attempts=3, base_delay=0)
        t = asyncio.ensure_future(
            policy.run(req, uri="u", what="w", classify=lambda e: classify_common(e) or "permanent", describe=str)
        )
        await asyncio.sleep(0.05)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(t), 2)
        return attempts

    assert asyncio.run(cleanup_case()) == ["cleanup done"]
    assert asyncio.run(converted_case()) == 1
