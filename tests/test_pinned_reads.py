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
    pin.check("s3://b/k", '"a"')
    pin.check("s3://b/k", None)
    with pytest.raises(IntegrityError, match=r"s3://b/k was replaced while it was being read"):
        pin.check("s3://b/k", '"b"')


def _replace_before_the_second_read(monkeypatch, s3_endpoint: str, uri: str, new: bytes) -> list[int]:
    """Replace the object (same size, other bytes) right before the first read that does not start at 0."""
    bucket, key = uri[len("s3://") :].split("/", 1)
    done: list[int] = []
    real = ObjectStoreBackend.readv

    def readv(self, u, views, offset=0, **kw):
        if u == uri and offset > 0 and not done:
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
