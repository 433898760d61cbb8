"""A DCP ``.metadata`` names its data objects by relative path: every name must stay inside the
checkpoint. Crafted names (``..``, absolute paths, URIs, symlinks out, the metadata itself) are
refused with a FormatError naming the metadata file and the entry, by the reader, by ``ckptio
info``/``verify`` and by an ``overwrite=True`` save (which deletes the replaced checkpoint's files)."""

from __future__ import annotations

import os
import pickle
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptio
import ckptio.dcp as cd
from ckptio import cli
from ckptio.checkpointer import Checkpointer
from ckptio.errors import FormatError

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore::ckptio.checkpointer.CheckpointWarning"),
]

SECRET = b"SECRET-BYTES-OUTSIDE-THE-CHECKPOINT" * 64  # 2240 bytes: larger than any item below
BAD_NAMES = {
    "dotdot": "../outside.bin",
    "dotdot_deep": "sub/../../outside.bin",
    "absolute": "/etc/passwd",
    "empty": "",
    "backslash": "..\\outside.bin",
    "nul": "__0_0.distcp\x00.txt",
    "dot_segment": "./__0_0.distcp",
    "empty_segment": "sub//x.distcp",
    "scheme": "s3://other-bucket/x.distcp",
    "metadata": ".metadata",
    "metadata_via_dir": "sub/../.metadata",
    "not_a_str": 7,
}


def state() -> dict:
    return {"w": torch.arange(64, dtype=torch.float32), "b": torch.ones(8, dtype=torch.int64)}


def zeros() -> dict:
    return {k: torch.zeros_like(v) for k, v in state().items()}


def craft(uri: str, name, which: str = "w") -> None:
    """Rewrite ``uri``'s .metadata so the storage entry of item ``which`` names ``name``."""
    meta = f"{uri}/.metadata"
    md = cd.loads_metadata(ckptio.get(meta))
    for idx, sinfo in md.storage_data.items():
        if idx.fqn == which:
            sinfo.relative_path = name
    ckptio.put(pickle.dumps(md), meta)


def assert_load_refused(uri: str, name) -> FormatError:
    """Point item 'w' of ``uri`` at ``name``: loading fails with a FormatError naming the metadata
    file and the entry, and reads nothing into the caller's tensors."""
    craft(uri, name)
    out = zeros()
    with pytest.raises(FormatError) as e:
        cd.load(out, uri)
    text = str(e.value)
    assert ".metadata" in text and repr(name) in text and "'w'" in text, text
    assert SECRET[:20].decode() not in text
    assert not out["w"].any()
    return e.value


@pytest.fixture(params=["ckptio", "torch"])
def local_ckpt(request, tmp_path):
    """A local checkpoint written by ckptio's or torch's FileSystemWriter, and a secret file beside it."""
    (tmp_path / "outside.bin").write_bytes(SECRET)
    uri = str(tmp_path / "ckpt")
    if request.param == "ckptio":
        cd.save(state(), uri)
    else:
        dcp.save(state(), storage_writer=dcp.FileSystemWriter(uri))
    return uri


@pytest.mark.parametrize("case", sorted(BAD_NAMES))
def test_reader_refuses_names_leaving_the_checkpoint(local_ckpt, case):
    assert_load_refused(local_ckpt, BAD_NAMES[case])
    with pytest.raises(FormatError):  # the reader on its own, as torch's load uses it
        cd.StorageReader(local_ckpt).read_metadata()


def test_metadata_changed_after_it_was_read_is_checked_again(local_ckpt):
    reader = cd.StorageReader(local_ckpt)
    metadata = reader.read_metadata()  # checked here; set_up reuses that answer only for the same names
    for sinfo in metadata.storage_data.values():
        sinfo.relative_path = "../outside.bin"
    with pytest.raises(FormatError, match="outside.bin"):
        reader.set_up_storage_reader(metadata, True)


def test_absolute_path_to_a_real_file_is_refused(local_ckpt, tmp_path):
    assert_load_refused(local_ckpt, str(tmp_path / "outside.bin"))


@pytest.mark.parametrize("via", ["file", "directory"])
def test_symlink_out_of_the_checkpoint_is_refused(local_ckpt, tmp_path, via):
    if via == "file":
        os.symlink(tmp_path / "outside.bin", os.path.join(local_ckpt, "link.distcp"))
        name = "link.distcp"
    else:
        (tmp_path / "elsewhere").mkdir()
        (tmp_path / "elsewhere" / "x.distcp").write_bytes(SECRET)
        os.symlink(tmp_path / "elsewhere", os.path.join(local_ckpt, "sub"))
        name = "sub/x.distcp"
    assert "symlink" in str(assert_load_refused(local_ckpt, name))


def test_names_in_a_subdirectory_and_symlinks_inside_still_load(tmp_path):
    uri = str(tmp_path / "ckpt")
    cd.save(state(), uri, thread_count=1)
    md = cd.loads_metadata(ckptio.get(f"{uri}/.metadata"))
    (name,) = {s.relative_path for s in md.storage_data.values()}
    os.makedirs(f"{uri}/sub")
    os.rename(f"{uri}/{name}", f"{uri}/sub/{name}")
    os.symlink(f"{uri}/sub/{name}", f"{uri}/alias.distcp")  # a symlink that stays inside
    craft(uri, f"sub/{name}", "w")
    craft(uri, "alias.distcp", "b")
    out = zeros()
    cd.load(out, uri)
    assert all(torch.equal(out[k], v) for k, v in state().items())


@pytest.mark.parametrize("case", ["dotdot", "absolute", "scheme", "metadata", "empty_segment"])
def test_object_store_names_stay_inside_the_prefix(s3_uri, case):
    """On S3 (and memory://) a name must stay under the checkpoint's prefix too."""
    for root in (f"{s3_uri}/run", f"memory://paths-{uuid.uuid4().hex}/run"):
        ckptio.put(SECRET, f"{root}/outside.bin")
        uri = f"{root}/ckpt"
        cd.save(state(), uri)
        assert_load_refused(uri, BAD_NAMES[case])


@pytest.mark.parametrize("case", ["dotdot", "absolute", "metadata"])
def test_cli_info_and_verify_refuse(local_ckpt, capsys, case):
    craft(local_ckpt, BAD_NAMES[case])
    for command in ("verify", "info"):
        code = cli.main([command, local_ckpt])
        out, err = capsys.readouterr()
        assert code == cli.EXIT_FAILURE, (command, out, err)
        assert repr(BAD_NAMES[case]) in err and SECRET[:20].decode() not in out + err


def test_overwrite_never_deletes_outside_the_checkpoint(tmp_path):
    """An overwrite deletes the replaced checkpoint's data objects: never the targets of crafted names."""
    victim = tmp_path / "outside.bin"
    victim.write_bytes(SECRET)
    uri = str(tmp_path / "ckpt")
    cd.save(state(), uri)
    md = cd.loads_metadata(ckptio.get(f"{uri}/.metadata"))
    old = {s.relative_path for s in md.storage_data.values()}
    craft(uri, "../outside.bin")
    new = {k: v + 1 for k, v in state().items()}
    cd.save(new, uri, overwrite=True)
    assert victim.read_bytes() == SECRET
    out = zeros()
    cd.load(out, uri)
    assert all(torch.equal(out[k], v) for k, v in new.items())
    assert all(os.path.exists(f"{uri}/{n}") for n in old)  # an unreadable old metadata: its files are kept

    step = str(tmp_path / "ck")  # the Checkpointer replacing a crafted, uncommitted step directory
    os.makedirs(f"{step}/000000000001")
    ckptio.put(ckptio.get(f"{uri}/.metadata"), f"{step}/000000000001/.metadata")
    craft(f"{step}/000000000001", "../../outside.bin")
    Checkpointer(step).save(1, {"m": state()})
    assert victim.read_bytes() == SECRET
