"""A copy reads its source from one version: a source replaced while it is being copied is an IntegrityError
naming it, and the destination is not written (nothing half-written, nothing mixed).

The copy engine (:mod:`ckptio.transfer`: ``ckptio cp``, ``copyfile``, ``copytree``) reads a large source in
several calls; each is pinned to the version the first one (or the listing) saw. The source is replaced
right after the first chunk reached the destination: on an object store by a new upload, on a local
disk by a rename over it, in memory by a new write (``memory://`` copies the bytes it started with).
"""

from __future__ import annotations

import os
import sys

import pytest

import ckptio
import zygote
from ckptio import transfer
from ckptio.backends import local as _local
from ckptio.errors import IntegrityError
from conftest import ALL_BACKENDS

KiB = 1 << 10
PART = 64 * KiB
SIZE = 5 * PART  # five chunks with concurrency 1


def _small_parts(uri: str) -> int:
    """Reads of ``uri``'s storage in small parts, one at a time; returns the part size (S3: at least 5 MiB)."""
    scheme = uri.split("://", 1)[0] if "://" in uri else "local"
    name = {"gs": "gcs"}.get(scheme, scheme)  # a settings section: a backend's name or an fsspec protocol
    part = 5 << 20 if name == "s3" else PART
    ckptio.configure(backends={name: {"part_size": part, "concurrency": 1}})
    return ckptio.resolve(f"{uri}/x")[0].part_size  # GCS: a multiple of 256 KiB


def _replace(uri: str, data: bytes) -> None:
    """Replace ``uri`` by other bytes the way its storage does: a rename over a local file, a new upload."""
    backend, resolved = ckptio.resolve(uri)
    path = backend.file_path(resolved)
    if path is None:
        backend.write(resolved, data)
        return
    with open(path + ".new", "wb") as f:
        f.write(data)
    os.replace(path + ".new", path)


def _other_side(uri: str, tmp_path) -> str:
    """A destination on another backend than ``uri``'s (a copy within one backend is its own ``copy``)."""
    return f"memory://dst-{os.getpid()}" if ckptio.resolve(uri)[0].name == "local" else str(tmp_path / "dst")


@pytest.mark.parametrize("backend", [b for b in ALL_BACKENDS if b != "gcs"])  # gcs: see the next test
def test_a_source_replaced_after_its_first_chunk_is_an_error_and_nothing_is_written(backend, request, tmp_path):
    root = request.getfixturevalue(f"{backend}_uri")
    src = f"{root}/src.bin"
    size = _small_parts(root) * 5 // 2
    old, new = b"a" * size, b"b" * size
    ckptio.put(old, src)
    dst = f"{_other_side(src, tmp_path)}/copy.bin"
    seen: list[int] = []

    def progress(done: int, total: int) -> None:
        if not seen:
            _replace(src, new)
        seen.append(done)

    if backend == "memory":  # a copy reads a snapshot of the object (a write replaces it, never changes it)
        transfer.copy(src, dst, progress=progress)
        assert ckptio.get(dst) == old
    else:
        with pytest.raises(IntegrityError, match=r"src\.bin was replaced while it was being read"):
            transfer.copy(src, dst, progress=progress)
        assert not ckptio.exists(dst)
    assert seen and seen[0] < size  # the source was replaced after the first chunk only
    transfer.copy(src, dst)  # copied again: the new version whole
    assert ckptio.get(dst) == new


def test_every_read_of_a_gcs_copy_asks_for_the_listed_generation(gcs_proxy, tmp_path):
    """The GCS emulator serves the newest bytes whatever generation is asked (GCS answers 404 once the asked
    one is replaced, which the backend reports as replaced): what the copy asks for is checked."""
    src = f"{gcs_proxy.uri}/src.bin"
    size = _small_parts(gcs_proxy.uri) * 5 // 2
    ckptio.put(b"a" * size, src)
    generation = ckptio.stat(src).version
    gcs_proxy.clear()
    transfer.copy(gcs_proxy.uri, str(tmp_path / "dst"), recursive=True)
    reads = [r.path for r in gcs_proxy.requests if "alt=media" in r.path]
    assert len(reads) == 3 and all(f"generation={generation}" in p for p in reads), reads
    assert ckptio.get(str(tmp_path / "dst" / "src.bin")) == b"a" * size


def test_copyfile_and_copytree_pin_their_sources_too(local_uri, monkeypatch):
    src_dir = f"{local_uri}/tree"
    src = f"{src_dir}/w.bin"
    ckptio.put(b"a" * SIZE, src)
    _small_parts(src)
    real = ckptio.backends.memory.BufferedWriter.write
    done: list[int] = []

    def write(self, data):
        if not done:
            _replace(src, b"b" * SIZE)
            done.append(1)
        return real(self, data)

    monkeypatch.setattr(ckptio.backends.memory.BufferedWriter, "write", write)
    with pytest.raises(IntegrityError, match="w.bin was replaced"):
        ckptio.copyfile(src, "memory://one/w.bin")
    assert not ckptio.exists("memory://one/w.bin")
    done.clear()
    with pytest.raises(IntegrityError, match="w.bin was replaced"):
        ckptio.copytree(src_dir, "memory://two")
    assert not ckptio.exists("memory://two/w.bin")


def test_a_local_file_rewritten_in_place_with_another_size_is_an_error(local_uri):
    src = f"{local_uri}/src.bin"
    ckptio.put(b"a" * SIZE, src)
    _small_parts(src)

    def progress(done: int, total: int) -> None:
        if done == PART:
            with open(_local.local_path(src), "r+b") as f:  # not atomic: the same file, new bytes
                f.write(b"b" * (SIZE + 1))

    with pytest.raises(IntegrityError, match="src.bin was replaced"):
        transfer.copy(src, "memory://d/copy.bin", progress=progress)
    assert not ckptio.exists("memory://d/copy.bin")


def test_unchanged_sources_copy_as_before(any_uri, tmp_path):
    src = f"{any_uri}/d/x.bin"
    data = os.urandom(_small_parts(any_uri) * 2 + 7)
    ckptio.put(data, src)
    ckptio.put(b"", f"{any_uri}/d/empty.bin")
    dst = _other_side(src, tmp_path)
    result = transfer.copy(f"{any_uri}/d", f"{dst}/t", recursive=True)
    assert result.bytes_copied == len(data)
    assert ckptio.get(f"{dst}/t/x.bin") == data and ckptio.get(f"{dst}/t/empty.bin") == b""


def test_copy_version_fuzzer(s3_endpoint):
    """Random sizes, part sizes, tree shapes and changes (renames, rewrites, uploads, deletes) at random
    points, local, memory:// and S3, in a child under a timeout: each copy raises IntegrityError or
    FileNotFoundError naming the changed source, or leaves every destination equal to one version."""
    worker = os.path.join(os.path.dirname(__file__), "copy_fuzz.py")
    r = zygote.run([sys.executable, worker, "3", "1234", s3_endpoint], timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "checked" in r.stdout


@pytest.mark.parametrize("backend", ["local", "fsspec", "user"])
def test_a_copy_within_one_backend_reads_one_version_too(backend, request, monkeypatch):
    """Source and destination on one backend: its own ``copy`` (local: one descriptor; fsspec, a plug-in:
    the streamed default) read a source rewritten in place (local) or replaced (a backend that cannot pin)
    after the first chunk; it wrote 64 KiB of the old bytes and the rest of the new and reported success."""
    root = request.getfixturevalue(f"{backend}_uri")
    src, dst = f"{root}/src.bin", f"{root}/out/copy.bin"
    size = _small_parts(root) * 5 // 2
    ckptio.put(b"a" * size, src)
    backend_, resolved = ckptio.resolve(dst)
    writer = type(backend_.open_writer(resolved))
    real, armed, fired = writer.write, [], []

    def write(self, data):
        if armed and not fired:
            fired.append(1)
            if backend == "local":  # not atomic: the same file, new bytes
                with open(_local.local_path(src), "r+b") as f:
                    f.write(b"b" * (size + 1))
            else:
                _replace(src, b"b" * (size + 1))
        return real(self, data)

    monkeypatch.setattr(writer, "write", write)
    for copy in (lambda: transfer.copy(src, dst), lambda: ckptio.copyfile(src, dst)):
        armed.clear(), fired.clear()
        ckptio.put(b"a" * size, src)
        armed.append(1)
        with pytest.raises(IntegrityError, match=r"src\.bin was replaced while it was being read"):
            copy()
        assert fired and not ckptio.exists(dst)
