"""The default context: backend caching, reset, and fork safety."""

from __future__ import annotations

import multiprocessing as mp

import ckptio


def _child_reconfigures(endpoint: str, uri: str, q) -> None:
    try:
        ckptio.reset()  # must not close the parent's S3 client (not fork-safe)
        ckptio.configure(backends={"s3": {"endpoint_url": endpoint}})
        q.put(ckptio.get(uri))
    except BaseException as e:  # report, don't hang the parent
        q.put(repr(e))


def test_forked_child_can_reset_and_reconfigure(s3_uri, s3_endpoint):
    uri = f"{s3_uri}/x.bin"
    ckptio.put(b"payload", uri)  # the parent now holds a cached S3 backend
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_reconfigures, args=(s3_endpoint, uri, q))
    p.start()
    got = q.get(timeout=60)
    p.join(timeout=30)
    assert got == b"payload"
    assert ckptio.get(uri) == b"payload"  # and the parent's client still works


def test_backends_are_cached_per_options_and_dropped_by_reset():
    b1, _ = ckptio.resolve("memory://a/x")
    b2, _ = ckptio.resolve("memory://a/y")
    b3, _ = ckptio.resolve("memory://a/y", part_size=1234)
    assert b1 is b2 and b3 is not b1
    ckptio.reset()
    assert ckptio.resolve("memory://a/x")[0] is not b1


def test_import_is_cheap_and_submodules_load_on_first_use():
    import subprocess
    import sys

    code = (
        "import sys, ckptio; assert 'torch' not in sys.modules and 's3fs' not in sys.modules; "
        "ckptio.fastpickle.inspect, ckptio.dcp.is_complete, ckptio.distributed.load, ckptio.Checkpointer; "
        "assert 'torch' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
