"""Bucket and object names from user strings never change which resource a request names (S3 and GCS):
a bucket name that is not one is refused before any request (``gs://EMPTY#/x`` once deleted the bucket
``EMPTY``), an object call needs a key, and a key's characters (``#``, ``?``, ``;``, ``%2F``, ``..``)
reach the server as that key. The fuzzer (:mod:`url_workers`) sends random names through every call
in a child and checks, with the store's own API, that nothing but the object named was touched.
"""

from __future__ import annotations

import pytest

import ckptio
from ckptio.errors import InvalidURIError
from servers import CountingProxy
from url_workers import run_cases


@pytest.fixture(params=["s3", "gcs"])
def bucket(request):
    """A fresh bucket holding ``x`` and ``a``, reached through a counting proxy."""
    p = request.getfixturevalue(f"{request.param}_proxy")
    ckptio.put(b"the x", p.uri + "/x")
    ckptio.put(b"the a", p.uri + "/a")
    p.clear()
    return p


def _intact(p: CountingProxy) -> None:
    assert ckptio.get(p.uri + "/x") == b"the x" and ckptio.get(p.uri + "/a") == b"the a"
    assert sorted(ckptio.ls(p.uri)) == [p.uri + "/a", p.uri + "/x"]


CALLS = {
    "remove": ckptio.remove,
    "get": ckptio.get,
    "exists": ckptio.exists,
    "put": lambda uri: ckptio.put(b"new", uri),
    "ls": lambda uri: list(ckptio.ls(uri)),
    "rmtree": ckptio.rmtree,
}


@pytest.mark.parametrize("suffix", ["#/x", "?x/y", "%2F/x", "#", "/../x"])
def test_a_bucket_name_that_is_not_one_is_refused_before_any_request(bucket, suffix):
    """``remove("gs://B#/x")`` deleted the bucket B; ``get`` returned its metadata; ``exists("gs://B?x/y")``
    was True. Now: an error naming the URI and the rule, and no request sent."""
    scheme, name = bucket.uri.split("://")
    uri = bucket.uri + suffix if suffix != "/../x" else f"{scheme}://../{name}/x"
    for call in CALLS.values():
        with pytest.raises(InvalidURIError, match="bucket name") as e:
            call(uri)
        assert uri.split("?")[0] in str(e.value)
    assert bucket.count() == 0, [(r.method, r.path) for r in bucket.requests]
    _intact(bucket)


def test_gcs_bucket_names_follow_the_gcs_rule(gcs_proxy):
    for name in ("UPPER", "ab", "a" * 64, "-ab", "ab_", "a..b"):
        with pytest.raises(InvalidURIError, match="lowercase"):
            ckptio.get(f"gs://{name}/x")
    assert gcs_proxy.count() == 0


def test_an_object_call_needs_a_key(bucket):
    for call in ("remove", "get", "put"):
        for suffix in ("", "/", "//"):
            with pytest.raises(InvalidURIError, match="names a bucket, not an object"):
                CALLS[call](bucket.uri + suffix)
    assert bucket.count() == 0
    _intact(bucket)


@pytest.mark.parametrize("key", [".", ".."])
def test_gcs_dot_names_are_refused(gcs_proxy, key):
    """GCS has no objects named ``.`` or ``..``; an HTTP client would send them as path steps (the bucket,
    or the bucket's listing)."""
    p = gcs_proxy
    ckptio.put(b"the x", p.uri + "/x")
    p.clear()
    for call in ("get", "exists", "remove", "put"):
        with pytest.raises(InvalidURIError, match="not a valid object name"):
            CALLS[call](f"{p.uri}/{key}")
    assert p.count() == 0
    assert ckptio.get(p.uri + "/x") == b"the x"


@pytest.mark.parametrize("key", ["a;b", "a#b", "a?b=c", "a%2Fb", "a b", "a+b", "é/日本", "a&b=c:d@e", "a/./b"])
def test_a_key_with_url_syntax_names_that_object_only(bucket, key):
    """``a;b`` was sent as ``/o/a;b`` on GCS (the client decoded the quoting), which a server may read as
    the object ``a``: removing ``a;b`` removed ``a``."""
    uri = f"{bucket.uri}/{key}"
    ckptio.put(b"the key", uri)
    assert ckptio.get(uri) == b"the key" and ckptio.exists(uri) and ckptio.stat(uri).size == 7
    assert uri in ckptio.ls(bucket.uri, recursive=True)
    ckptio.remove(uri)
    assert not ckptio.exists(uri)
    _intact(bucket)


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_url_parts_fuzz(scheme, request):
    """Random bucket and object names (URL syntax, dots, spaces, control characters, unicode, lone
    surrogates, empty parts) through put/get/exists/isfile/stat/ls/remove/rmtree, in a child: each call
    ends in a ckptio error or does exactly what it says to exactly that object."""
    endpoint = request.getfixturevalue("s3_endpoint" if scheme == "s3" else "gcs_endpoint")
    results = run_cases(scheme, endpoint, seed=51, cases=10)
    problems = [r for r in results if r["outcome"] == "problem"]
    assert not problems, problems
    assert {r["outcome"] for r in results} == {"ok", "refused"}


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_url_parts_fuzz_long(scheme, seed, request):
    endpoint = request.getfixturevalue("s3_endpoint" if scheme == "s3" else "gcs_endpoint")
    problems = [r for r in run_cases(scheme, endpoint, seed=seed, cases=150, timeout=900) if r["outcome"] == "problem"]
    assert not problems, problems
