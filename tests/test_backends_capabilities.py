"""The optional capabilities of the backend interface, and how the wrappers (counting, the node-local
cache) forward or decline each one."""

from __future__ import annotations

import os

import pytest
import torch

import ckptio
from ckptio.backends.local import LocalBackend
from ckptio.backends.memory import MemoryBackend
from ckptio.cache import CachedBackend
from ckptio.formats.fastpickle import read as fpk_read
from ckptio.wrappers.counting import CountingBackend
from conftest import UserDictBackend


def _counter() -> tuple[list[int], object]:
    seen: list[int] = []
    return seen, seen.append


def test_counting_forwards_local_file_and_counts_the_object_as_read(tmp_path):
    path = str(tmp_path / "x.bin")
    LocalBackend().write(path, b"y" * 1000)
    seen, add = _counter()
    counted = CountingBackend(LocalBackend(), add)  # type: ignore[arg-type]
    with counted.local_file(path) as p:
        assert p == path and seen == []  # a format reads it through its own descriptor
    assert sum(seen) == 1000
    mem = CountingBackend(MemoryBackend(), add)  # type: ignore[arg-type]
    mem.write("memory://b/x", b"z")
    with mem.local_file("memory://b/x") as p:
        assert p is None  # declined by the storage: the caller takes the ranged path, counted


def test_counting_declines_the_writer_descriptor_and_has_no_attribute_forwarding(tmp_path):
    seen, add = _counter()
    counted = CountingBackend(LocalBackend(), add)  # type: ignore[arg-type]
    assert counted.writes_in_place and counted.max_buffer_bytes is None and counted.node_cache is None
    with counted.open_writer(str(tmp_path / "w.bin")) as w:
        assert w.local_fileno() is None  # every byte must go through write()
        w.write(b"abc")
    assert sum(seen) == 3
    with pytest.raises(AttributeError):
        counted.no_such_capability  # noqa: B018 - no __getattr__: an unknown name is an error, not the inner's
    derived = counted.with_options(concurrency=3)
    assert isinstance(derived, CountingBackend) and derived.concurrency == 3
    assert counted.with_options(concurrency=counted.concurrency) is counted


def test_reads_local_and_assembled_are_the_storages_through_wrappers(s3_uri):
    """Local and memory reads have no latency to hide (readers skip read-ahead and staging); object
    stores do. No plain storage assembles objects from blocks; wrappers say what they wrap says."""
    s3, _ = ckptio.resolve(s3_uri)
    for backend, local in ((LocalBackend(), True), (MemoryBackend(), True), (s3, False)):
        counted = CountingBackend(backend, _counter()[1])  # type: ignore[arg-type]
        assert backend.reads_local is local and counted.reads_local is local
        assert not backend.assembled("x") and not counted.assembled("x")


def test_progress_load_of_a_local_fpk_is_counted_whole(tmp_path, monkeypatch):
    uri = str(tmp_path / "s.fpk")
    ckptio.dump({"w": torch.arange(1000)}, uri)

    class NoRangedReads(fpk_read.BackendSource):
        def __init__(self, *a, **kw):
            raise AssertionError("a progress= load of a local .fpk must read through the file descriptor")

    monkeypatch.setattr(fpk_read, "BackendSource", NoRangedReads)  # the fast path is kept under the wrapper
    calls: list[tuple[int, int]] = []
    out = ckptio.load(uri, progress=lambda done, total: calls.append((done, total)))
    assert torch.equal(out["w"], torch.arange(1000))
    size = os.path.getsize(uri)
    assert calls and calls[-1] == (size, size)


def test_cache_local_file_is_the_verified_pinned_entry_filled_on_a_miss(tmp_path):
    remote = str(tmp_path / "remote" / "o.bin")
    LocalBackend().write(remote, b"q" * 5000)
    cache = CachedBackend(LocalBackend(), tmp_path / "cache", max_bytes=1)
    assert cache.node_cache is cache and LocalBackend().node_cache is None
    with cache.local_file(remote) as p:
        assert p is not None and p.startswith(str(tmp_path / "cache")) and p.endswith("o.bin")
        cache.clear()  # held: eviction and clear spare it
        with open(p, "rb") as f:
            assert f.read() == b"q" * 5000
    assert cache.stats()["misses"] == 1


def test_cache_with_options_shares_the_store(tmp_path):
    cache = CachedBackend(LocalBackend(), tmp_path / "cache")
    derived = cache.with_options(concurrency=2)
    assert isinstance(derived, CachedBackend) and derived.store is cache.store and derived.concurrency == 2
    assert cache.with_options() is cache


def test_object_store_with_options_is_a_new_backend_with_the_same_settings(s3_uri):
    backend, root = ckptio.resolve(s3_uri)
    assert backend.max_buffer_bytes is not None and not backend.writes_in_place
    assert backend.with_options(max_buffer_bytes=backend.max_buffer_bytes) is backend
    derived = backend.with_options(max_buffer_bytes=16 << 20)
    assert type(derived) is type(backend) and derived.name == backend.name
    assert derived.max_buffer_bytes == 16 << 20 and derived.endpoint_url == backend.endpoint_url  # type: ignore[attr-defined]
    derived.write(f"{root}/a.bin", b"abc")
    assert backend.read(f"{root}/a.bin") == b"abc"
    with pytest.raises(ValueError, match="no option"):
        backend.with_options(no_such_option=1)


def test_object_store_derived_backends_are_kept_and_closed_with_their_parent(s3_uri):
    # A DCP save tunes max_buffer_bytes on every call: a fresh backend per save paid for a new
    # client (and leaked it); the derived backend is made once and closed with its parent.
    backend, root = ckptio.resolve(s3_uri)
    derived = backend.with_options(max_buffer_bytes=16 << 20)
    assert backend.with_options(max_buffer_bytes=16 << 20) is derived
    assert backend.with_options(max_buffer_bytes=8 << 20) is not derived
    derived.write(f"{root}/b.bin", b"abc")
    assert derived._client is not None  # type: ignore[attr-defined]
    backend.close()
    assert derived._client is None  # type: ignore[attr-defined]
    assert backend.with_options(max_buffer_bytes=16 << 20) is not derived  # a new one after close
    backend.close()


def test_counting_forwards_pin_version_and_still_counts(s3_uri):
    backend, uri = ckptio.resolve(s3_uri + "/pin.bin")
    backend.write(uri, b"x" * 1000)
    seen, add = _counter()
    counted = CountingBackend(backend, add)
    pinned = counted.pin_version(uri)
    assert pinned is not counted and isinstance(pinned, CountingBackend)
    buf = bytearray(1000)
    assert pinned.readinto(uri, buf, 0) == 1000 and sum(seen) == 1000
    plain = CountingBackend(UserDictBackend(), add)
    assert plain.pin_version("userdict://x") is plain  # nothing to pin: the same wrapper
