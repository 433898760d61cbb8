"""ckptio.dcp in one process: round trips, interop with torch's FileSystemWriter/Reader, commit rules,
integrity, partial loads, async_save and failure paths. Multi-rank and crash tests are in
test_dcp_dist.py and test_dcp_crash.py; S3 in test_dcp_s3.py."""

from __future__ import annotations

import io
import os
import pickle
import re
import traceback
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import ckptio
import ckptio.dcp as cd
from ckptio.backends import local as local_backend
from ckptio.dcp import writer as dcp_writer
from ckptio.dcp.reader import contiguous_span
from ckptio.dcp.zipframe import ZipFraming
from ckptio.errors import AlreadyExistsError, CkptioError, FormatError, IncompleteCheckpointError, IntegrityError
from conftest import flip_byte

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(params=["local", "memory"])
def root(request, tmp_path):
    return str(tmp_path) if request.param == "local" else f"memory://dcp-{uuid.uuid4().hex}"


def join(root: str, name: str) -> str:
    return f"{root}/{name}"


DATA_NAME = re.compile(r"__(\d+)_(\d+)\.([0-9a-f]{16})\.distcp")  # rank, object number, save attempt


def data_objects(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.endswith(".distcp"))


def sample() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "w": torch.randn(33, 17, generator=g),
            "half": torch.randn(5, 4, generator=g).to(torch.bfloat16),
            "ids": torch.arange(100, dtype=torch.int64),
            "mask": torch.rand(7, generator=g) > 0.5,
            "scalar": torch.tensor(3.5),
            "empty": torch.zeros(0, 4),
            "t_view": torch.randn(6, 9, generator=g).t(),  # not contiguous
        },
        "optim": {"lr": 0.1, "betas": (0.9, 0.99), "name": "adam", "state": {0: {"step": torch.tensor(4.0)}}},
        "blob": io.BytesIO(b"raw bytes \x00\x01" * 100),
        "epoch": 12,
    }


def blank(sd: dict) -> dict:
    """A destination with the same structure, tensors zeroed and values cleared."""
    out: dict = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out[k] = blank(v)
        elif isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v.contiguous())
        elif isinstance(v, io.BytesIO):
            out[k] = io.BytesIO()
        else:
            out[k] = None
    return out


def assert_same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        if isinstance(v, dict):
            assert_same(got[k], v)
        elif isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
            assert torch.equal(got[k], v), k
        elif isinstance(v, io.BytesIO):
            assert got[k].getvalue() == v.getvalue(), k
        else:
            assert got[k] == v, k


def test_round_trip(root):
    uri = join(root, "ckpt")
    sd = sample()
    assert not cd.is_complete(uri)
    cd.save(sd, uri)
    assert cd.is_complete(uri)
    out = blank(sd)
    cd.load(out, uri)
    assert_same(out, sample())


def test_thread_counts_and_small_parts(root):
    sd = {f"t{i}": torch.randn(1000 + i) for i in range(9)}
    uri = join(root, "ckpt")
    cd.save(sd, uri, thread_count=3, min_object_bytes=1)
    backend, r = ckptio.resolve(uri)
    names = sorted(i.uri.rsplit("/", 1)[-1] for i in backend.list(r))
    assert names[0] == ".metadata" and len(names) == 4
    parts = [DATA_NAME.fullmatch(n).groups() for n in names[1:]]
    assert [p[:2] for p in parts] == [("0", "0"), ("0", "1"), ("0", "2")] and len({p[2] for p in parts}) == 1
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    cd.load(out, uri, thread_count=1)
    assert all(torch.equal(out[k], sd[k]) for k in sd)


def test_small_payload_is_one_data_object(root):
    """A rank's payload below min_object_bytes is one data object (one file, or one request), whatever thread_count."""
    sd = {f"t{i}": torch.randn(1000 + i) for i in range(9)}
    uri = join(root, "ckpt")
    cd.save(sd, uri, thread_count=4, min_object_bytes=40_000 * 4)
    backend, r = ckptio.resolve(uri)
    names = sorted(i.uri.rsplit("/", 1)[-1] for i in backend.list(r))
    assert names[0] == ".metadata" and len(names) == 2  # 36 KiB of tensors < 160 kB
    uri2 = join(root, "ckpt2")
    cd.save(sd, uri2, thread_count=4, min_object_bytes=9000 * 4)  # 36144 bytes: just over one object, so two
    assert len(list(backend.list(ckptio.resolve(uri2)[1]))) == 1 + 2
    for u in (uri, uri2):
        out = {k: torch.zeros_like(v) for k, v in sd.items()}
        cd.load(out, u)
        assert all(torch.equal(out[k], sd[k]) for k in sd)


def test_async_save(root):
    uri = join(root, "ckpt")
    sd = sample()
    fut = cd.async_save(sd, uri)
    fut.result(timeout=60)
    assert cd.is_complete(uri)
    out = blank(sd)
    cd.load(out, uri)
    assert_same(out, sample())


def test_async_save_with_dcp_directly(tmp_path):
    sd = {"x": torch.randn(100)}
    fut = dcp.async_save(sd, storage_writer=cd.StorageWriter(str(tmp_path / "c")))
    fut.result(timeout=60)
    out = {"x": torch.zeros(100)}
    dcp.load(out, storage_reader=cd.StorageReader(str(tmp_path / "c")))
    assert torch.equal(out["x"], sd["x"])


# ---- interop with torch's own FileSystemWriter / FileSystemReader --------------------------------


def test_torch_reader_loads_ckptio_checkpoint(tmp_path):
    sd = sample()
    cd.save(sd, str(tmp_path / "c"), thread_count=2)
    out = blank(sd)
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(tmp_path / "c")))
    assert_same(out, sample())


@pytest.mark.parametrize("single_file", [True, False])
def test_ckptio_loads_torch_checkpoint(tmp_path, single_file):
    sd = sample()
    dcp.save(
        sd, storage_writer=dcp.FileSystemWriter(str(tmp_path / "c"), thread_count=2, single_file_per_rank=single_file)
    )
    assert cd.is_complete(str(tmp_path / "c"))
    out = blank(sd)
    cd.load(out, str(tmp_path / "c"))
    assert_same(out, sample())


def test_metadata_unpickles_without_ckptio(tmp_path):
    cd.save(sample(), str(tmp_path / "c"))
    modules = set()

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            modules.add(module)
            return super().find_class(module, name)

    with open(tmp_path / "c" / ".metadata", "rb") as f:
        md = Unpickler(f).load()
    assert modules and not any(m.startswith("ckptio") for m in modules)
    infos = list(md.storage_data.values())
    assert all(type(i).__module__ == "torch.distributed.checkpoint.filesystem" for i in infos)
    tensor_infos = [i for i in infos if "dtype" in i.ckptio]
    assert tensor_infos and all(i.ckptio["xxh3"] for i in tensor_infos)


# ---- the tensor framing is a torch.save archive ----------------------------------------------------


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.float64,
        torch.bfloat16,
        torch.float16,
        torch.int8,
        torch.uint8,
        torch.int32,
        torch.int64,
        torch.bool,
        torch.complex64,
    ],
)
@pytest.mark.parametrize("shape", [(), (0,), (3,), (4, 5), (2, 0, 3)])
def test_framing_loads_with_torch_load(dtype, shape):
    t = torch.randn(shape).mul(7).to(dtype) if not dtype.is_complex else torch.randn(shape, dtype=dtype)
    z = ZipFraming(t.dtype, tuple(t.shape), t.numel() * t.element_size())
    data = z.head + t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() + z.tail
    assert len(data) == z.total and z.data_offset == len(z.head) and z.data_offset % 64 == 0
    u = torch.load(io.BytesIO(data), weights_only=True)
    assert u.dtype == t.dtype and u.shape == t.shape and torch.equal(u, t)


def test_framing_named_by_key_is_the_same_at_every_save():
    t = torch.arange(6.0)
    a, b = (ZipFraming(t.dtype, (6,), 24, key="model.w[0]") for _ in range(2))
    assert (a.head, a.tail) == (b.head, b.tail)
    other = ZipFraming(t.dtype, (6,), 24, key="model.v[0]")
    assert other.head == a.head and other.tail != a.tail and len(other.tail) == len(a.tail)
    assert ZipFraming(t.dtype, (6,), 24).tail != ZipFraming(t.dtype, (6,), 24).tail  # no key: random
    data = a.head + t.numpy().tobytes() + a.tail
    assert torch.equal(torch.load(io.BytesIO(data), weights_only=True), t)


def test_framing_zip64_for_large_tensors(tmp_path):
    nbytes = (5 << 30) + 12  # > 4 GiB: zip64 records; written as a sparse file, never allocated
    z = ZipFraming(torch.uint8, (nbytes,), nbytes)
    path = tmp_path / "big.pt"
    with open(path, "wb") as f:
        f.write(z.head)
        f.seek(len(z.head) + nbytes)
        f.write(z.tail)
    reader = torch._C.PyTorchFileReader(str(path))
    assert "data/0" in reader.get_all_records()
    assert reader.get_record_offset("data/0") == z.data_offset
    assert reader.get_record("byteorder") == b"little"


# ---- commit rules --------------------------------------------------------------------------------
# ckptio.dcp.save/load raise the failed rank's own error (torch's CheckpointException is its cause);
# torch's dcp.save/load with ckptio's StorageWriter/Reader keep raising CheckpointException.


def _failure(exc: CheckpointException) -> BaseException:
    ((err, _tb),) = exc.failures.values()
    return err


def _text(e: BaseException) -> str:
    return "".join(traceback.format_exception(e))


def test_existing_checkpoint_needs_overwrite(root):
    uri = join(root, "ckpt")
    cd.save({"x": torch.ones(3)}, uri)
    with pytest.raises(AlreadyExistsError, match="overwrite=True") as ei:
        cd.save({"x": torch.zeros(3)}, uri)
    assert isinstance(ei.value.__cause__, CheckpointException) and "on rank 0" in _text(ei.value)
    assert str(ei.value).startswith(f"Checkpoint already exists at {uri!r}")
    # torch's own save keeps torch's exception, with the words torch's test_overwrite matches on
    with pytest.raises(CheckpointException, match=".*Checkpoint already exists.*") as ei:
        dcp.save({"x": torch.zeros(3)}, storage_writer=cd.StorageWriter(uri))
    assert isinstance(_failure(ei.value), AlreadyExistsError) and uri in str(_failure(ei.value))
    out = {"x": torch.zeros(3)}
    cd.load(out, uri)
    assert torch.equal(out["x"], torch.ones(3))  # untouched
    cd.save({"x": torch.full((3,), 2.0)}, uri, overwrite=True)
    cd.load(out, uri)
    assert torch.equal(out["x"], torch.full((3,), 2.0))


def test_overwrite_removes_metadata_before_touching_data(tmp_path, monkeypatch):
    uri = str(tmp_path / "c")
    cd.save({"x": torch.ones(3)}, uri)
    seen = []
    original = local_backend.LocalBackend.open_writer

    def open_writer(self, u, **kw):
        seen.append((os.path.basename(u), os.path.exists(os.path.join(uri, ".metadata"))))
        return original(self, u, **kw)

    monkeypatch.setattr(local_backend.LocalBackend, "open_writer", open_writer)
    old = data_objects(uri)
    cd.save({"x": torch.zeros(3)}, uri, overwrite=True)
    assert DATA_NAME.fullmatch(seen[0][0]) and seen[0][1] is False
    assert seen[-1] == (".metadata", False)
    new = data_objects(uri)  # once committed, the replaced checkpoint's data objects are deleted
    assert len(new) == 1 and not set(old) & set(new)


def test_old_data_object_names_load_and_are_replaced(tmp_path):
    """Checkpoints written before data objects were named per save (``__0_0.distcp``) still load, and
    an overwrite deletes their data objects once it has committed."""
    uri = str(tmp_path / "c")
    cd.save({"x": torch.arange(10.0)}, uri, thread_count=1)
    (name,) = data_objects(uri)
    os.rename(os.path.join(uri, name), os.path.join(uri, "__0_0.distcp"))
    md = pickle.loads((tmp_path / "c" / ".metadata").read_bytes())
    for sinfo in md.storage_data.values():
        sinfo.relative_path = "__0_0.distcp"
    (tmp_path / "c" / ".metadata").write_bytes(pickle.dumps(md))
    out = {"x": torch.zeros(10)}
    cd.load(out, uri)
    assert torch.equal(out["x"], torch.arange(10.0))
    cd.save({"x": torch.ones(10)}, uri, overwrite=True)
    (name,) = data_objects(uri)
    assert DATA_NAME.fullmatch(name)
    cd.load(out, uri)
    assert torch.equal(out["x"], torch.ones(10))


def test_incomplete_checkpoint_is_reported(root):
    uri = join(root, "ckpt")
    cd.save({"x": torch.ones(3)}, uri)
    backend, r = ckptio.resolve(uri)
    backend.delete(f"{r}/.metadata")  # as if the save died before its commit
    assert not cd.is_complete(uri)
    with pytest.raises(IncompleteCheckpointError, match="incomplete"):
        cd.load({"x": torch.zeros(3)}, uri)
    with pytest.raises(CheckpointException, match="incomplete"):
        dcp.load({"x": torch.zeros(3)}, storage_reader=cd.StorageReader(uri))


def test_write_failure_commits_nothing(tmp_path, monkeypatch):
    uri = str(tmp_path / "c")
    original = local_backend.LocalWriter.write

    def write(self, data):
        if os.path.basename(self._path).startswith("__0_1."):
            raise OSError(5, "injected I/O error")
        return original(self, data)

    monkeypatch.setattr(local_backend.LocalWriter, "write", write)
    with pytest.raises(OSError, match="injected I/O error") as ei:
        cd.save({f"t{i}": torch.randn(100) for i in range(4)}, uri, thread_count=2, min_object_bytes=1)
    text = _text(ei.value)
    assert re.search(r"__0_1\.[0-9a-f]{16}\.distcp", text) and "rank 0" in text
    assert not cd.is_complete(uri)
    assert os.listdir(uri) == []  # the failed object's temp file and the rank's other object are gone


# ---- integrity -----------------------------------------------------------------------------------


def test_corruption_names_object_and_item(tmp_path):
    uri = str(tmp_path / "c")
    sd = {"a": torch.randn(1000), "b": torch.randn(1000)}
    cd.save(sd, uri, thread_count=1)
    md = pickle.loads((tmp_path / "c" / ".metadata").read_bytes())
    info = next(v for k, v in md.storage_data.items() if k.fqn == "b")
    flip_byte(str(tmp_path / "c" / info.relative_path), info.offset + info.ckptio["data"] + 100, 0xFF)
    with pytest.raises(IntegrityError) as ei:
        cd.load({"a": torch.zeros(1000), "b": torch.zeros(1000)}, uri)
    err = ei.value
    assert info.relative_path in str(err) and "'b'" in str(err)
    out = {"a": torch.zeros(1000)}
    cd.load(out, uri)  # the intact item still loads
    assert torch.equal(out["a"], sd["a"])
    out = {"b": torch.zeros(1000)}
    cd.load(out, uri, verify=False)
    assert not torch.equal(out["b"], sd["b"])


def test_corrupt_bytes_item(tmp_path):
    uri = str(tmp_path / "c")
    cd.save({"blob": io.BytesIO(b"x" * 500)}, uri)
    md = pickle.loads((tmp_path / "c" / ".metadata").read_bytes())
    info = next(iter(md.storage_data.values()))
    flip_byte(str(tmp_path / "c" / info.relative_path), info.offset + 10, 0xFF)
    with pytest.raises(IntegrityError, match="checksum mismatch"):
        cd.load({"blob": io.BytesIO()}, uri)


def test_truncated_object(tmp_path):
    uri = str(tmp_path / "c")
    cd.save({"a": torch.randn(5000)}, uri)
    path = tmp_path / "c" / data_objects(uri)[0]
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(IntegrityError, match="truncated"):
        cd.load({"a": torch.zeros(5000)}, uri)


# ---- partial loads read only what they need --------------------------------------------------------


def test_partial_load_reads_only_needed_bytes():
    uri = f"memory://dcp-{uuid.uuid4().hex}/c"
    sd = {"model": {"w": torch.randn(256, 1024)}, "optim": {"m": torch.randn(256, 1024), "v": torch.randn(256, 1024)}}
    cd.save(sd, uri, thread_count=1)
    reader = cd.StorageReader(uri)
    before = reader.backend.bytes_read
    out = {"model": {"w": torch.zeros(256, 1024)}}
    dcp.load(out, storage_reader=reader)
    assert torch.equal(out["model"]["w"], sd["model"]["w"])
    read = reader.backend.bytes_read - before
    meta = len(reader.backend.read_range(f"{reader.root}/.metadata"))
    assert 1 << 20 <= read <= (1 << 20) + meta + 4096  # one MiB tensor + the metadata


def test_block_checksums_on_sub_ranges(tmp_path, monkeypatch):
    monkeypatch.setattr(dcp_writer, "CHECKSUM_BLOCK", 4096)  # what the writer records
    sd = {"w": torch.randn(100, 50)}  # 20000 bytes: 5 blocks
    cd.save(sd, str(tmp_path / "c"))
    md = pickle.loads((tmp_path / "c" / ".metadata").read_bytes())
    assert len(next(iter(md.storage_data.values())).ckptio["xxh3"]) == 5
    out = {"w": torch.zeros(100, 50)}
    cd.load(out, str(tmp_path / "c"))
    assert torch.equal(out["w"], sd["w"])


def test_contiguous_span():
    assert contiguous_span((10, 4), (3, 0), (5, 4)) == (12, 32)
    assert contiguous_span((10, 4), (3, 1), (1, 2)) == (13, 15)
    assert contiguous_span((10, 4), (3, 1), (5, 2)) is None
    assert contiguous_span((), (), ()) == (0, 1)


def test_validate_checkpoint_id():
    assert cd.StorageWriter.validate_checkpoint_id("memory://x/y")
    assert cd.StorageReader.validate_checkpoint_id("/tmp/x")
    assert not cd.StorageReader.validate_checkpoint_id("nosuchscheme-zz://x")


def test_other_failures_become_ckptio_errors(tmp_path):
    uri = str(tmp_path / "c")
    cd.save({"x": torch.ones(3)}, uri)
    with pytest.raises(CkptioError, match="Missing key") as ei:  # torch's planner raises RuntimeError
        cd.load({"x": torch.zeros(3), "nope": torch.zeros(2)}, uri)
    assert "rank 0" in str(ei.value) and isinstance(ei.value.__cause__, CheckpointException)


def test_async_save_failure_surfaces_ckptio_error(tmp_path):
    uri = str(tmp_path / "c")
    cd.save({"x": torch.ones(3)}, uri)
    fut = cd.async_save({"x": torch.zeros(3)}, uri)
    with pytest.raises(AlreadyExistsError):
        fut.result(timeout=60)


# ---- the .metadata pickle is read by a restricted unpickler -------------------------------------


class _Evil:
    def __init__(self, cmd: str) -> None:
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


def test_crafted_metadata_runs_nothing(tmp_path):
    uri = str(tmp_path / "c")
    cd.save({"x": torch.ones(3)}, uri)
    marker = tmp_path / "PWNED"
    md = pickle.loads((tmp_path / "c" / ".metadata").read_bytes())
    md.planner_data = {"x": _Evil(f"touch {marker}")}  # hidden deep inside legitimate metadata
    (tmp_path / "c" / ".metadata").write_bytes(pickle.dumps(md))
    for attempt in (
        lambda: cd.load({"x": torch.zeros(3)}, uri),
        lambda: cd.StorageReader(uri).read_metadata(),
        lambda: cd.loads_metadata((tmp_path / "c" / ".metadata").read_bytes(), "m"),
    ):
        with pytest.raises(FormatError, match=r"\.metadata.*posix\.system|m: .*posix\.system"):
            attempt()
    with pytest.raises(CheckpointException, match="system"):
        dcp.load({"x": torch.zeros(3)}, storage_reader=cd.StorageReader(uri))
    from ckptio import cli

    for cmd in ("info", "verify"):
        assert cli.main([cmd, uri]) != 0
    assert not marker.exists()


@pytest.mark.parametrize("payload", [b"not a pickle", pickle.dumps({"a": 1}), pickle.dumps(b"x" * 10)[:-3]])
def test_malformed_metadata_is_a_format_error(payload):
    with pytest.raises(FormatError, match="some/.metadata"):
        cd.loads_metadata(payload, "some/.metadata")


def test_metadata_allows_what_torch_writers_store(tmp_path):
    sd = sample()
    sd["cl"] = torch.ones(2, 3, 4, 5).to(memory_format=torch.channels_last)
    for i, single in enumerate((True, False)):
        path = str(tmp_path / f"t{i}")
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(path, single_file_per_rank=single))
        with open(os.path.join(path, ".metadata"), "rb") as f:
            data = f.read()
        assert cd.loads_metadata(data) == pickle.loads(data)
    cd.save(sd, str(tmp_path / "ck"))
    data = (tmp_path / "ck" / ".metadata").read_bytes()
    assert cd.loads_metadata(data) == pickle.loads(data)


def test_bytes_reader_is_a_seekable_file_without_copies():
    from ckptio.backends.readers import BytesReader

    buf = io.BytesIO()
    torch.save({"w": torch.arange(10)}, buf)
    data = bytearray(buf.getvalue())
    r = BytesReader(memoryview(data), "mem://x")
    assert torch.equal(torch.load(r, weights_only=True)["w"], torch.arange(10))
    r.seek(-4, io.SEEK_END)
    assert r.read() == bytes(data[-4:]) and r.read(3) == b"" and r.tell() == len(data)
    r.seek(2)
    data[2] = data[2] ^ 0xFF  # a view over the caller's memory
    assert r.read(1) == bytes([data[2]])
    with pytest.raises(ValueError, match="mem://x"):
        r.seek(-1)
