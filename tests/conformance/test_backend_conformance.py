"""One suite, every backend: local, memory, S3 (moto), GCS (emulator), the fsspec adapter and a
user backend registered by decorator (see ``any_uri`` in conftest.py)."""

from __future__ import annotations

import os

import pytest

import ckptio
from ckptio.uri import join_path

MiB = 1024 * 1024


@pytest.fixture
def root(any_uri):
    backend, resolved = ckptio.resolve(any_uri)
    return backend, resolved


def j(root, *parts):
    return join_path(root[1], *parts)


def test_write_then_read_whole_and_ranges(root):
    b, u = root[0], j(root, "dir", "obj.bin")
    data = bytes(range(256)) * 40
    b.write(u, data)
    assert b.read(u) == data
    assert b.read_range(u, 10, 20) == data[10:20]
    assert b.read_range(u, 100) == data[100:]
    assert b.read_range(u, len(data) - 5, len(data) + 100) == data[-5:]  # short at EOF
    assert b.read_range(u, len(data) + 10, len(data) + 20) == b""


def test_readinto_fills_callers_buffer(root):
    b, u = root[0], j(root, "obj.bin")
    data = os.urandom(10_000)
    b.write(u, data)
    buf = bytearray(3000)
    assert b.readinto(u, buf, 500) == 3000 and bytes(buf) == data[500:3500]
    big = bytearray(20_000)
    assert b.readinto(u, memoryview(big)[100:], 0) == 10_000  # short at EOF, into a slice
    assert bytes(big[100:10_100]) == data
    assert b.readinto(u, bytearray(10), len(data)) == 0


def test_empty_object(root):
    b, u = root[0], j(root, "empty")
    b.write(u, b"")
    assert b.read(u) == b"" and b.stat(u).size == 0


def test_overwrite_changes_size_and_version(root):
    b, u = root[0], j(root, "v.bin")
    b.write(u, b"first")
    s1 = b.stat(u)
    assert s1.size == 5 and not s1.is_dir and s1.version
    b.write(u, b"second version")
    s2 = b.stat(u)
    assert s2.size == 14 and s2.version != s1.version
    assert b.read(u) == b"second version"


def test_create_mode_refuses_existing_and_keeps_original(root):
    b, u = root[0], j(root, "c.bin")
    b.write(u, b"original", mode="create")
    with pytest.raises(FileExistsError) as ei:
        b.write(u, b"other", mode="create")
    assert u in str(ei.value)
    with pytest.raises(FileExistsError):
        with b.open_writer(u, mode="create") as w:
            w.write(b"streamed other")
    assert b.read(u) == b"original"


def test_streaming_writer_commits_on_close_only(root):
    b, u = root[0], j(root, "s", "stream.bin")
    w = b.open_writer(u)
    for i in range(5):
        w.write(bytes([i]) * 1000)
    assert not b.isfile(u)
    w.close()
    assert b.read(u) == b"".join(bytes([i]) * 1000 for i in range(5))


def test_streaming_writer_abort_leaves_nothing(root):
    b, u = root[0], j(root, "a", "aborted.bin")
    w = b.open_writer(u)
    w.write(b"x" * 5000)
    w.abort()
    w.abort()  # idempotent
    assert not b.exists(u)
    with pytest.raises(RuntimeError, match="boom"):
        with b.open_writer(u) as w2:
            w2.write(b"y" * 100)
            raise RuntimeError("boom")
    assert not b.exists(u)
    assert _listing(b, root[1]) == []


def _listing(b, uri, recursive=True):
    """URIs under ``uri``; a missing directory lists as empty (filesystems raise, object stores don't)."""
    try:
        return [i.uri for i in b.list(uri, recursive=recursive)]
    except FileNotFoundError:
        return []


def _tree(b, root_uri):
    for name in ("a.txt", "sub/b.txt", "sub/deeper/c.txt"):
        b.write(join_path(root_uri, "t", name), name.encode())


def test_list_one_level_and_recursive(root):
    b, r = root
    _tree(b, r)
    top = join_path(r, "t")
    one = {(os.path.basename(i.uri.rstrip("/")), i.is_dir) for i in b.list(top)}
    assert one == {("a.txt", False), ("sub", True)}
    rec = sorted(i.uri[len(top) :].lstrip("/").replace(os.sep, "/") for i in b.list(top, recursive=True))
    assert rec == ["a.txt", "sub/b.txt", "sub/deeper/c.txt"]
    sizes = {os.path.basename(i.uri): i.size for i in b.list(top, recursive=True)}
    assert sizes["c.txt"] == len(b"sub/deeper/c.txt")


def test_exists_isdir_isfile_rmtree(root):
    b, r = root
    _tree(b, r)
    top = join_path(r, "t")
    assert b.isdir(top) and b.isdir(join_path(top, "sub")) and not b.isfile(top)
    assert b.isfile(join_path(top, "a.txt")) and b.exists(join_path(top, "a.txt"))
    assert not b.exists(join_path(top, "nope")) and not b.isdir(join_path(top, "nope"))
    b.rmtree(join_path(top, "sub"))
    assert not b.exists(join_path(top, "sub", "b.txt")) and b.exists(join_path(top, "a.txt"))
    b.rmtree(join_path(top, "missing"))  # no error


def test_delete(root):
    b, u = root[0], j(root, "d.bin")
    b.write(u, b"x")
    b.delete(u)
    assert not b.exists(u)
    with pytest.raises(FileNotFoundError) as ei:
        b.delete(u)
    assert u in str(ei.value)


def test_copy(root):
    b, src = root[0], j(root, "src.bin")
    dst = j(root, "cp", "dst.bin")
    b.write(src, b"payload" * 100)
    b.copy(src, dst)
    assert b.read(dst) == b"payload" * 100 and b.read(src) == b"payload" * 100
    with pytest.raises(FileExistsError):
        b.copy(src, dst, mode="create")


def test_get_local_path(root):
    b, u = root[0], j(root, "local.bin")
    b.write(u, b"on disk")
    with b.get_local_path(u) as path:
        with open(path, "rb") as f:
            assert f.read() == b"on disk"


@pytest.mark.parametrize("op", ["read", "stat", "read_range", "readinto", "open_reader"])
def test_missing_object_is_file_not_found_naming_uri(root, op):
    b, u = root[0], j(root, "no", "such.bin")
    call = {
        "read": lambda: b.read(u),
        "stat": lambda: b.stat(u),
        "read_range": lambda: b.read_range(u, 0, 10),
        "readinto": lambda: b.readinto(u, bytearray(10)),
        "open_reader": lambda: b.open_reader(u).read(),
    }[op]
    with pytest.raises(FileNotFoundError) as ei:
        call()
    assert u in str(ei.value)


def test_open_reader_seeks(root):
    b, u = root[0], j(root, "r.bin")
    data = os.urandom(50_000)
    b.write(u, data)
    with b.open_reader(u) as f:
        f.seek(1000)
        assert f.read(10) == data[1000:1010]
        f.seek(-5, os.SEEK_END)
        assert f.read() == data[-5:]


def test_large_object_multipart_roundtrip(any_uri):
    # 5 MiB is S3's smallest part; the other backends split or spool at the same size
    b, r = ckptio.resolve(any_uri, part_size=5 * MiB, concurrency=3)
    data = os.urandom(40 * MiB + 123)
    u1, u2 = join_path(r, "big", "whole.bin"), join_path(r, "big", "streamed.bin")
    b.write(u1, data)
    with b.open_writer(u2) as w:
        for i in range(0, len(data), 3 * MiB):
            w.write(data[i : i + 3 * MiB])
    for u in (u1, u2):
        assert b.stat(u).size == len(data)
        buf = bytearray(len(data))
        assert b.readinto(u, buf) == len(data)
        assert buf == data
    assert b.read_range(u1, 12 * MiB - 7, 17 * MiB + 3) == data[12 * MiB - 7 : 17 * MiB + 3]
