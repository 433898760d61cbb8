"""Wrong bytes from a server are never returned (S3 and GCS): a 206 whose ``Content-Range`` names other
bytes than asked, a redirect to another host serving other bytes, a gzip-encoded reply. Each read path
(the first GET, ranged parallel reads, ``get``, an ``.fpk`` and a ``.pt`` load) ends in an error naming
the object. The hostile server is a proxy (:mod:`hostile`) in front of moto or the GCS emulator, so
these tests hold whatever client the stores use.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

import ckptio
from ckptio.errors import CkptioError
from conftest import S3_TEST_OPTIONS, _unique
from faultproxy import FAST
from hostile import HostileProxy, credentials, forged, gzipped, redirected, relabelled, shifted
from reply_workers import run_cases as run_reply_cases
from servers import make_gcs_bucket, make_s3_bucket

MiB = 1024 * 1024


def configure(flavor: str, endpoint: str) -> None:
    if flavor == "s3":
        options = {**S3_TEST_OPTIONS, "part_size": 5 * MiB}
    else:
        options = {"anon": True, "project": "test", "part_size": 256 * 1024}
    ckptio.configure(backends={flavor: {"endpoint_url": endpoint, "concurrency": 3, **FAST, **options}})


def bucket(flavor: str, endpoint: str) -> str:
    name = _unique("h")
    if flavor == "s3":
        make_s3_bucket(endpoint, name)
        return f"s3://{name}"
    make_gcs_bucket(endpoint, name)
    return f"gs://{name}"


# what the object is and how it is read: (write it at uri, read it back from uri) -> the read's result
def _bytes(size: int):
    data = os.urandom(size)
    return (lambda uri: ckptio.put(data, uri)), ckptio.get, data


def _tensors(n: int):
    state = {"w": torch.arange(n, dtype=torch.float32), "b": torch.ones(7)}

    def check(uri: str):
        out = ckptio.load(uri)
        assert set(out) == set(state) and all(torch.equal(out[k], state[k]) for k in state)
        return True

    return (lambda uri: ckptio.dump(state, uri)), check, True


PATHS = {
    "first": lambda flavor: _bytes(100_000),  # one GET: the first holds it all
    "ranged": lambda flavor: _bytes(6 * MiB if flavor == "s3" else MiB + 5),  # the first GET, then ranges
    "fpk": lambda flavor: _tensors(1_500_000 if flavor == "s3" else 300_000),  # more than one GET
    "pt": lambda flavor: _tensors(1_500_000 if flavor == "s3" else 300_000),
}


@pytest.fixture(params=["s3", "gcs"])
def store(request):
    return request.param, request.getfixturevalue(f"{request.param}_endpoint")


def _read_through(store, path: str, **proxy) -> tuple[BaseException | None, object, object, str]:
    """Write an object straight to the server, then read it through a hostile proxy: the error (or the
    value read, and the value written) and the object's URI."""
    flavor, endpoint = store
    write, read, want = PATHS[path](flavor)
    uri = f"{bucket(flavor, endpoint)}/dir/obj{'.' + path if path in ('fpk', 'pt') else '.bin'}"
    configure(flavor, endpoint)
    write(uri)
    with HostileProxy(endpoint, **proxy) as p:
        configure(flavor, p.url)
        try:
            got = read(uri)
        except Exception as e:  # noqa: BLE001 - the assertion says what was expected
            return e, None, want, uri
        finally:
            changed = p.changed
    assert changed, "the proxy changed nothing: the test does not test the read path"
    return None, got, want, uri


def _assert_refused(outcome) -> None:
    error, got, want, uri = outcome
    assert error is not None, f"wrong bytes returned for {uri} (correct: {got == want})"
    assert isinstance(error, CkptioError), repr(error)
    assert uri in str(error) or uri.split("/", 3)[3] in str(error), str(error)


@pytest.mark.parametrize("path", PATHS)
def test_a_206_naming_other_bytes_is_refused(store, path):
    _assert_refused(_read_through(store, path, ask=shifted(1)))


@pytest.mark.parametrize("path", PATHS)
def test_a_206_labelled_with_other_bytes_is_refused(store, path):
    _assert_refused(_read_through(store, path, answer=relabelled(3)))


@pytest.mark.parametrize(
    "status, later", [(302, False), (307, False), (307, True)], ids=["302", "307", "307-after-the-first-bytes"]
)
@pytest.mark.parametrize("path", PATHS)
def test_a_redirect_to_another_host_is_not_followed(store, path, status, later):
    """The host a redirect names serves its own bytes for any range, without asking for credentials."""
    if later and path == "first":
        pytest.skip("one GET: nothing after the first bytes")
    flavor, endpoint = store
    with HostileProxy(endpoint, answer=forged(20 * MiB)) as decoy:
        _assert_refused(_read_through(store, path, answer=redirected(decoy.url, status, later=later)))
        assert not any(credentials(p, h) for _, p, h in decoy.requests), "credentials sent where a redirect pointed"


@pytest.mark.parametrize("consistent", [True, False], ids=["range-of-compressed", "range-as-asked"])
@pytest.mark.parametrize("path", PATHS)
def test_a_gzip_encoded_reply_is_refused(store, path, consistent):
    _assert_refused(_read_through(store, path, answer=functools.partial(gzipped, consistent=consistent)))


def _coded(value: str):
    """The reply as it was, with ``Content-Encoding: value`` (the body unchanged)."""

    def answer(reply, sent):
        if reply.status not in (200, 206):
            return reply
        return type(reply)(reply.status, [*reply.without("content-encoding"), ("Content-Encoding", value)], reply.body)

    return answer


@pytest.mark.parametrize("value", ["aws-chunked", "identity", "aws-chunked, identity"])
@pytest.mark.parametrize("path", PATHS)
def test_a_coding_that_leaves_the_stored_bytes_is_read(s3_endpoint, path, value):
    """S3-compatible servers other than AWS keep ``aws-chunked`` (an upload's framing) in an object's
    metadata and send it back with the object's plain bytes: was refused as an encoded body."""
    error, got, want, uri = _read_through(("s3", s3_endpoint), path, answer=_coded(value))
    assert error is None and got == want, f"{uri}: {error!r}"


@pytest.mark.parametrize(
    "content_range, start, end, ok",
    [
        ("bytes 0-99/100", 0, 4096, True),  # the object ends first
        ("bytes 10-19/100", 10, 20, True),
        ("bytes 10-99/100", 10, 20, True),  # more than asked: only what was asked is read
        ("bytes 11-20/100", 10, 20, False),
        ("bytes 0-9/100", 10, 20, False),
        ("bytes 10-14/100", 10, 20, False),  # fewer, and the object goes on
        ("bytes 10-14/*", 10, 20, False),
        ("bytes 10250-10239/10240", 10250, 10260, True),  # none: past the end (the GCS emulator)
        ("bytes 0--1/0", 0, 4096, True),  # an empty object (the GCS emulator)
        ("bytes 90-99/100", -10, 0, True),  # a suffix
        ("bytes 0-9/100", -10, 0, False),
        ("bytes 0-99/100", -200, 0, True),
        (None, 0, 10, False),
        ("bytes x-y/z", 0, 10, False),
    ],
)
def test_a_206_must_name_the_bytes_asked_for(content_range, start, end, ok):
    from ckptio.objectstore.replies import WrongRangeError, check_reply

    headers = {} if content_range is None else {"content-range": content_range}
    if ok:
        check_reply("gs://b/k", 206, headers, start, end)
    else:
        with pytest.raises(WrongRangeError, match="gs://b/k"):
            check_reply("gs://b/k", 206, headers, start, end)


# ---- GCS metadata replies --------------------------------------------------------------------------

DEEP = 100_000
METADATA = {
    "deep-object": b'{"a":' * DEEP + b"1" + b"}" * DEEP,
    "deep-list": b"[" * DEEP + b"]" * DEEP,
    "size-not-a-number": b'{"name": "dir/obj", "size": "12abc", "generation": "1"}',
    "negative-size": b'{"name": "dir/obj", "size": "-1", "generation": "1"}',
    "no-name": b'{"size": "3", "generation": "1"}',
    "not-a-time": b'{"name": "dir/obj", "size": "3", "updated": "yesterday"}',
    "an-array": b"[1, 2]",
}


def _metadata_get(method: str, path: str, headers: dict[str, str]) -> bool:
    return method == "GET" and "/storage/v1/b/" in path and "/o" in path and "alt=media" not in path


def _listing(body: bytes) -> bytes:
    """``body`` as a listing's items, or (deep JSON) as the listing itself."""
    return body if body.startswith((b"[[", b'{"a"')) else b'{"items": [' + body + b"]}"


@pytest.mark.parametrize("body", METADATA.values(), ids=METADATA.keys())
def test_gcs_metadata_that_is_not_an_object_resource_is_an_error_naming_it(gcs_endpoint, body):
    """A GCS server answering an object's metadata or a listing with JSON nested 100,000 deep or a size
    of "12abc" raised a raw RecursionError or ValueError; now a ckptio error naming the object."""
    uri = f"{bucket('gcs', gcs_endpoint)}/dir/obj"
    configure("gcs", gcs_endpoint)
    ckptio.put(b"abc", uri)

    def answer(reply, sent):
        return type(reply)(200, [("Content-Type", "application/json")], body if "/o/" in sent.path else _listing(body))

    with HostileProxy(gcs_endpoint, answer=answer, match=_metadata_get) as p:
        configure("gcs", p.url)
        for call in (ckptio.stat, ckptio.exists, lambda u: list(ckptio.ls(u.rsplit("/", 1)[0]))):
            with pytest.raises(CkptioError) as e:
                call(uri)
            assert uri.rsplit("/", 1)[0] in str(e.value), str(e.value)
        assert p.changed


# ---- the fuzzer: random reply headers ---------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_reply_headers_fuzz(scheme, request):
    """Random statuses, Content-Range, Content-Length, Content-Encoding, Location and request ranges on the
    object GETs of get / readinto / an .fpk load, in a child (:mod:`reply_workers`): each read returns the
    object's bytes or raises a ckptio error; never other bytes, another error or a hang."""
    endpoint = request.getfixturevalue("s3_endpoint" if scheme == "s3" else "gcs_endpoint")
    results = run_reply_cases(scheme, endpoint, seed=51, cases=8 if scheme == "s3" else 16)
    problems = [r for r in results if r["outcome"] == "problem"]
    assert not problems, problems
    assert {"ok", "refused"} <= {r["outcome"] for r in results}


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_reply_headers_fuzz_long(scheme, seed, request):
    endpoint = request.getfixturevalue("s3_endpoint" if scheme == "s3" else "gcs_endpoint")
    results = run_reply_cases(scheme, endpoint, seed=seed, cases=100, timeout=1800)
    assert not [r for r in results if r["outcome"] == "problem"]
