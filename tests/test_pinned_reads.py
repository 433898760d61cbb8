"""Reads of one object in several requests come from one version of it (``Backend.pin_version``).

An object replaced while a load reads it in parts must never load as a mix of both versions: ``.pt``
has no checksums torch checks, so without a pin the mix would load silently. S3 (moto) pins the
first reply's ETag with ``If-Match``; a replaced object is an ``IntegrityError`` naming it. (The GCS
emulator sends no generation header on media reads, so there GCS reads are unpinned and still work;
real GCS pins by ``generation=``.)
"""

from __future__ import annotations

import pytest
import torch

import ckptio
from ckptio.errors import IntegrityError
from ckptio.objectstore.backend import ObjectStoreBackend
from ckptio.objectstore.ranged import VersionPin
from servers import s3_client

MiB = 1 << 20


def test_version_pin_pins_the_first_version_and_refuses_another():
    pin = VersionPin()
    pin.check("s3://b/k", None)  # a reply without a version: not checked
    assert pin.version is None
    pin.check("s3://b/k", '"a"')
    pin.check("s3://b/k", 'W/"a"')  # the same version, weakened by a proxy
    pin.check("s3://b/k", "a", reply=False)  # as a stat may spell it
    pin.check("s3://b/k", None)
    assert pin.version == "a" and pin.token == '"a"'  # a GET reply's strong ETag: the If-Match token
    with pytest.raises(IntegrityError, match=r"s3://b/k was replaced while it was being read"):
        pin.check("s3://b/k", '"b"')
    weak = VersionPin()
    weak.check("s3://b/k", 'W/"a"')
    assert weak.version == "a" and weak.token is None  # compared, never sent as a precondition
    seeded = VersionPin('"a"')  # from a stat: compared, not sent
    assert seeded.version == "a" and seeded.token is None
    assert VersionPin("None").version is None  # GCS metadata without a generation


def _replace_before_the_second_read(
    monkeypatch, s3_endpoint: str, uri: str, new: bytes, *, first: bool = False
) -> list[int]:
    """Replace the object (other bytes) right before the first read that does not start at 0 (``first``:
    before the very first read, i.e. after a size lookup)."""
    bucket, key = uri[len("s3://") :].split("/", 1)
    done: list[int] = []
    real = ObjectStoreBackend.readv

    def readv(self, u, views, offset=0, **kw):
        if u == uri and (offset > 0 or first) and not done:
            s3_client(s3_endpoint).put_object(Bucket=bucket, Key=key, Body=new)
            done.append(offset)
        return real(self, u, views, offset, **kw)

    monkeypatch.setattr(ObjectStoreBackend, "readv", readv)
    return done


@pytest.mark.parametrize("ext", [".pt", ".fpk"])
def test_an_object_replaced_between_parts_of_a_load_is_an_error(s3_uri, s3_endpoint, monkeypatch, ext):
    a = {"w": torch.zeros(3 * MiB)}  # 12 MiB: a first part and the rest
    uri = f"{s3_uri}/m{ext}"
    opts = {"part_size": 5 * MiB}
    ckptio.dump({"w": torch.ones(3 * MiB)}, uri, backend_args=opts)
    backend, resolved = ckptio.resolve(uri, **opts)
    other = backend.read(resolved)  # a same-size object with other bytes
    ckptio.dump(a, uri, backend_args=opts)
    done = _replace_before_the_second_read(monkeypatch, s3_endpoint, resolved, other)
    with pytest.raises(IntegrityError, match=f"{resolved} was replaced while it was being read"):
        ckptio.load(uri, backend_args=opts)
    assert done  # the object was replaced mid-load
    monkeypatch.undo()
    assert torch.equal(ckptio.load(uri, backend_args=opts)["w"], torch.ones(3 * MiB))  # read again: the new one


def test_parts_of_one_read_come_from_one_version(s3_uri, s3_endpoint, monkeypatch):
    backend, uri = ckptio.resolve(f"{s3_uri}/blob.bin", part_size=5 * MiB, concurrency=1)
    backend.write(uri, b"a" * (12 * MiB))
    bucket, key = uri[len("s3://") :].split("/", 1)
    real = type(backend)._get_range

    async def get_range(self, u, b, k, start, end, into, on_size=None, pin=None):
        if start > 0 and pin is not None and pin.version is not None and not replaced:
            s3_client(s3_endpoint).put_object(Bucket=bucket, Key=key, Body=b"b" * (12 * MiB))
            replaced.append(start)
        return await real(self, u, b, k, start, end, into, on_size=on_size, pin=pin)

    replaced: list[int] = []
    monkeypatch.setattr(type(backend), "_get_range", get_range)
    with pytest.raises(IntegrityError, match="replaced while it was being read"):
        backend.readinto(uri, bytearray(12 * MiB))
    assert replaced
    assert backend.read(uri) == b"b" * (12 * MiB)  # a read of the new version on its own is fine


def test_unchanged_objects_and_other_objects_read_as_before(s3_uri):
    backend, uri = ckptio.resolve(f"{s3_uri}/x.bin", part_size=5 * MiB)
    data = bytes(range(256)) * (48 * 1024)  # 12 MiB
    backend.write(uri, data)
    backend.write(uri + "-2", b"other")
    view = backend.pin_version(uri)
    buf = bytearray(len(data))
    assert view.readinto(uri, buf, 0) == len(data) and buf == data
    assert view.read_range(uri, 10, 20) == data[10:20]
    assert view.read(uri + "-2") == b"other"  # another object: unpinned
    backend.write(uri + "-2", b"changed")
    assert view.read(uri + "-2") == b"changed"
    assert view.pin_version(uri) is view


def test_a_copy_in_parts_comes_from_one_version(s3_uri, s3_endpoint, monkeypatch, tmp_path):
    backend, uri = ckptio.resolve(f"{s3_uri}/big.bin", part_size=5 * MiB, concurrency=1)
    backend.write(uri, b"a" * (12 * MiB))
    done = _replace_before_the_second_read(monkeypatch, s3_endpoint, uri, b"b" * (12 * MiB))
    with pytest.raises(IntegrityError, match="replaced while it was being read"):
        with backend.get_local_path(uri):  # copied in part_size * concurrency pieces
            pass
    assert done


def test_a_cache_fill_of_a_replaced_object_is_an_error_and_caches_nothing(s3_uri, s3_endpoint, monkeypatch, tmp_path):
    from ckptio.cache import CachedBackend

    inner, uri = ckptio.resolve(f"{s3_uri}/c.bin", part_size=5 * MiB, concurrency=1)
    inner.write(uri, b"a" * (12 * MiB))
    cached = CachedBackend(inner, str(tmp_path / "cache"))
    done = _replace_before_the_second_read(monkeypatch, s3_endpoint, uri, b"b" * (12 * MiB))
    with pytest.raises(IntegrityError, match="replaced while it was being read"):
        cached.read(uri)  # the entry is keyed by version a: its bytes must all be a's
    assert done
    monkeypatch.undo()
    assert cached.read(uri) == b"b" * (12 * MiB)  # nothing mixed was kept


def test_a_size_and_bytes_of_different_versions_are_an_error(s3_uri, s3_endpoint, monkeypatch):
    backend, uri = ckptio.resolve(f"{s3_uri}/s.bin", part_size=5 * MiB, concurrency=1)
    backend.write(uri, b"a" * (12 * MiB))
    _replace_before_the_second_read(monkeypatch, s3_endpoint, uri, b"b" * (14 * MiB), first=True)
    with pytest.raises(IntegrityError, match="replaced while it was being read"):
        with backend.get_local_path(uri):  # the size from a stat of a, the bytes from b
            pass
    monkeypatch.undo()
    backend.write(uri, b"a" * (12 * MiB))
    # read takes the size from its first GET; replaced by a small object before the rest is fetched
    swapped = _replace_before_the_second_read(monkeypatch, s3_endpoint, uri, b"small")
    with pytest.raises(IntegrityError, match="replaced while it was being read"):
        backend.read(uri)  # not the first 4 MiB of a as if they were the whole object
    assert swapped


def test_a_store_whose_read_overrides_predate_pins_still_reads(s3_uri, s3_endpoint):
    from ckptio.backends.s3 import S3Backend
    from conftest import S3_TEST_OPTIONS

    class Older(S3Backend):
        def readinto(self, uri, buf, offset=0):  # no pin keyword
            return super().readinto(uri, buf, offset)

    backend = Older(endpoint_url=s3_endpoint, part_size=5 * MiB, **S3_TEST_OPTIONS)
    uri = f"{s3_uri}/old.bin"
    backend.write(uri, b"z" * (6 * MiB))
    buf = bytearray(6 * MiB)
    assert backend.pin_version(uri).readinto(uri, buf, 0) == 6 * MiB and buf == b"z" * (6 * MiB)
    assert backend.pin_version(uri).with_options(concurrency=2).read(uri) == b"z" * (6 * MiB)


@pytest.mark.parametrize("ext", [".pt", ".fpk"])
def test_a_memory_object_replaced_mid_load_loads_the_version_it_started_with(monkeypatch, ext):
    """memory:// pins by snapshot: the stored bytes are immutable and a write replaces them."""
    from ckptio.backends.memory import MemoryBackend
    from ckptio.formats import torch as ptformat

    uri = f"memory://pins/m{ext}"
    ckptio.dump({"w": torch.zeros(300_000)}, uri)
    monkeypatch.setattr(ptformat, "IN_MEMORY_MAX", 256 << 10)  # .pt: the reader route, many reads
    monkeypatch.setattr("ckptio.formats.fastpickle.read.WHOLE_LOCAL_MAX", 256 << 10)  # .fpk: a read a payload
    real = MemoryBackend.readinto
    swapped: list[int] = []

    def readinto(self, u, buf, offset=0):
        if offset > 0 and not swapped:
            ckptio.dump({"w": torch.ones(300_000)}, uri)
            swapped.append(offset)
        return real(self, u, buf, offset)

    monkeypatch.setattr(MemoryBackend, "readinto", readinto)
    monkeypatch.setattr("ckptio.backends.memory.copy_bytes", _swap_then(uri, swapped))
    # .fpk reads the bytes the backend holds (Backend.held), copying out of them itself
    monkeypatch.setattr("ckptio.formats.fastpickle.read.copy_bytes", _swap_then(uri, swapped))
    out = ckptio.load(uri)["w"]
    assert swapped and torch.equal(out, torch.zeros(300_000))  # all of the first version
    assert torch.equal(ckptio.load(uri)["w"], torch.ones(300_000))
    backend, resolved = ckptio.resolve(uri)
    with pytest.raises(IntegrityError, match="replaced while it was being read"):
        backend.pin_version(resolved, version="0")  # not the version the caller holds
    ckptio.remove(uri)


def _swap_then(uri: str, swapped: list[int]):
    """copy_bytes that replaces the object before its first copy from past the start (snapshot reads)."""
    from ckptio import osio

    def copy(dst, src, offset=0):
        if offset > 0 and not swapped:
            ckptio.dump({"w": torch.ones(300_000)}, uri)
            swapped.append(offset)
        return osio.copy_bytes(dst, src, offset)

    return copy
