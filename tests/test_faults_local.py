"""Local faults: a filesystem that fills up, a read-only mount, files damaged after writing.

Writes that fail part-way raise a ckptio error naming the URI, leave no temporary file behind and
leave the existing object (or checkpoint) under the same name untouched. Damage after writing is
detected by checksums on load (fastpickle, DCP), naming the object and the byte range.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest
import torch

import ckptio
from ckptio import dcp
from ckptio.checkpointer import Checkpointer
from ckptio.errors import AccessDeniedError, IntegrityError, TransferError
from conftest import flip_byte

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore::ckptio.checkpointer.CheckpointWarning"),
]


def _mount(path, *opts: str) -> None:
    path.mkdir(exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(opts), "tmpfs", str(path)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root and mount rights): {r.stderr.decode().strip()}")


def _umount(path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture
def small_fs(tmp_path):
    """A 1 MiB tmpfs."""
    d = tmp_path / "small"
    _mount(d, "size=1m")
    yield d
    _umount(d)


@pytest.fixture
def ro_fs(tmp_path):
    """A tmpfs holding one committed checkpoint file, then remounted read-only (root ignores mode bits)."""
    d = tmp_path / "ro"
    _mount(d, "size=4m")
    ckptio.dump({"w": torch.ones(10)}, str(d / "old.pt"))
    r = subprocess.run(["mount", "-o", "remount,ro", str(d)], capture_output=True)
    if r.returncode != 0:
        _umount(d)
        pytest.skip(f"cannot remount read-only: {r.stderr.decode().strip()}")
    yield d
    _umount(d)


def _names(d) -> list[str]:
    return sorted(p.name for p in d.rglob("*"))


@pytest.mark.parametrize("ext", [".pt", ".fpk", ".bin"])
def test_disk_full_raises_cleans_up_and_keeps_existing(small_fs, ext):
    old = {"w": torch.arange(1000.0)}
    target = str(small_fs / f"ckpt{ext}")
    if ext == ".bin":
        ckptio.put(b"old bytes", target)
    else:
        ckptio.dump(old, target)
    before = open(target, "rb").read()
    big = os.urandom(2 * 1024 * 1024)
    with pytest.raises(TransferError) as ei:
        if ext == ".bin":
            ckptio.put(big, target)
        else:
            ckptio.dump({"w": torch.frombuffer(bytearray(big), dtype=torch.uint8)}, target)
    assert ei.value.errno == errno.ENOSPC and target in str(ei.value)
    assert _names(small_fs) == [f"ckpt{ext}"]  # no temporary file left
    assert open(target, "rb").read() == before
    if ext != ".bin":
        assert torch.equal(ckptio.load(target)["w"], old["w"])


def test_disk_full_during_checkpointer_save_keeps_last_commit(small_fs):
    root = str(small_fs / "run")
    ck = Checkpointer(root, format="fpk")
    ck.save(1, {"model": {"w": torch.ones(1000)}})
    with pytest.raises(OSError) as ei:
        ck.save(2, {"model": {"w": torch.ones(400_000)}})  # 1.6 MB > 1 MiB
    assert ei.value.errno == errno.ENOSPC
    fresh = Checkpointer(root, format="fpk")
    state = {"model": {"w": torch.zeros(1000)}}
    assert fresh.latest() == 1 and fresh.load(state) == 1 and torch.equal(state["model"]["w"], torch.ones(1000))
    assert not any(".ckptio-tmp-" in n for n in _names(small_fs))


def test_cp_onto_a_full_disk_names_the_destination(small_fs, tmp_path, capsys):
    from ckptio import cli

    src, dst = tmp_path / "src.bin", small_fs / "copy.bin"
    src.write_bytes(os.urandom(2 * 1024 * 1024))
    code = cli.main(["cp", str(src), str(dst)])
    err = capsys.readouterr().err
    assert code == cli.EXIT_FAILURE and "no space left on device" in err
    assert str(dst) in err and str(src) not in err, err
    assert _names(small_fs) == []  # no temporary file left


def test_cp_past_the_file_size_limit_names_the_destination(tmp_path):
    """Without a small filesystem to mount: RLIMIT_FSIZE makes the write fail (EFBIG) in a subprocess."""
    src, dst = tmp_path / "src.bin", tmp_path / "out" / "copy.bin"
    src.write_bytes(os.urandom(2 * 1024 * 1024))
    code = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))\n"
        "from ckptio.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, "cp", str(src), str(dst)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 1 and "file too large" in r.stderr, r.stderr
    assert str(dst) in r.stderr and str(src) not in r.stderr, r.stderr
    assert os.listdir(dst.parent) == []  # no temporary file left


def test_read_only_mount(ro_fs):
    target = str(ro_fs / "old.pt")
    with pytest.raises(AccessDeniedError) as ei:
        ckptio.dump({"w": torch.zeros(10)}, target)
    assert target in str(ei.value) and "read-only" in str(ei.value)
    with pytest.raises(PermissionError):
        ckptio.put(b"x", str(ro_fs / "new.bin"))
    assert torch.equal(ckptio.load(target)["w"], torch.ones(10))
    assert _names(ro_fs) == ["old.pt"]


# ---- replacing an existing name --------------------------------------------------------------


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_durable_replace_leaves_no_descriptor_or_name_and_old_readers_keep_old_bytes(tmp_path):
    # A durable replace holds the old file open across the rename and directory fsync (its blocks are
    # freed after the commit); the descriptor must not outlive the save, and nothing else may change.
    target = tmp_path / "ckpt.fpk"
    ckptio.dump({"w": torch.zeros(1000)}, str(target))
    reader = open(target, "rb")
    old = reader.read()
    reader.seek(0)
    before = _open_fds()
    ckptio.dump({"w": torch.ones(1000)}, str(target))
    ckptio.dump({"w": torch.full((1000,), 2.0)}, str(target))
    assert _open_fds() == before
    assert reader.read() == old  # the replaced inode is intact for whoever still has it open
    reader.close()
    assert torch.equal(ckptio.load(str(target))["w"], torch.full((1000,), 2.0))
    assert _names(tmp_path) == ["ckpt.fpk"]


def test_durable_replace_holds_the_old_file_until_the_directory_fsync_is_done(tmp_path, monkeypatch):
    from ckptio.backends import local

    target = tmp_path / "ckpt.fpk"
    ckptio.dump({"w": torch.zeros(1000)}, str(target))
    if os.major(os.stat(target).st_dev) == 0:
        pytest.skip("tmp_path is not on a block-device filesystem (the old file is not held there)")
    old_ino, seen = os.stat(target).st_ino, []
    real = local.fsync_dir

    def spy(path: str) -> None:
        held = [os.fstat(int(fd)).st_ino for fd in os.listdir("/proc/self/fd") if _is_file_fd(fd)]
        seen.append(old_ino in held and os.stat(target).st_ino != old_ino)
        real(path)

    monkeypatch.setattr(local, "fsync_dir", spy)
    ckptio.dump({"w": torch.ones(1000)}, str(target))
    assert seen == [True]  # renamed over, and still open while the directory was synced
    held = [os.fstat(int(fd)).st_ino for fd in os.listdir("/proc/self/fd") if _is_file_fd(fd)]
    assert old_ino not in held


def _is_file_fd(fd: str) -> bool:
    try:
        return os.path.isfile(os.readlink(f"/proc/self/fd/{fd}").removesuffix(" (deleted)")) or os.readlink(
            f"/proc/self/fd/{fd}"
        ).endswith(" (deleted)")
    except OSError:
        return False


def test_durable_replace_of_a_fifo_or_symlink_does_not_block_or_follow(tmp_path):
    # The old name is opened read-only before the rename: a FIFO there must not block the save (it
    # runs in a child so a hang fails the test), and a symlink is replaced, not followed.
    fifo, link, elsewhere = tmp_path / "pipe.fpk", tmp_path / "link.fpk", tmp_path / "elsewhere.bin"
    os.mkfifo(fifo)
    elsewhere.write_bytes(b"keep me")
    os.symlink(elsewhere, link)
    code = "import sys, torch, ckptio\nfor p in sys.argv[1:]: ckptio.dump({'w': torch.ones(3)}, p)\n"
    subprocess.run([sys.executable, "-c", code, str(fifo), str(link)], check=True, timeout=60)
    for p in (fifo, link):
        assert p.is_file() and not p.is_symlink()
        assert torch.equal(ckptio.load(str(p))["w"], torch.ones(3))
    assert elsewhere.read_bytes() == b"keep me"


@pytest.mark.parametrize("ext", [".fpk", ".pt", ".json"])
def test_saves_into_new_directories_and_under_a_file_name_the_uri(tmp_path, ext):
    deep = tmp_path / "a" / "b" / f"x{ext}"  # parents made on the first write into them
    ckptio.dump({"w": 1}, str(deep))
    assert ckptio.load(str(deep)) == {"w": 1}
    (tmp_path / "plain").write_bytes(b"keep")
    for uri in (tmp_path / "plain" / f"x{ext}", tmp_path / "plain" / "sub" / f"x{ext}"):
        with pytest.raises(NotADirectoryError, match=f"a parent of {uri} is a file"):
            ckptio.dump({"w": 1}, str(uri))
    assert (tmp_path / "plain").read_bytes() == b"keep"
    with pytest.raises(ckptio.AlreadyExistsError):
        ckptio.dump({"w": 2}, str(deep), mode="create")
    assert sorted(os.listdir(deep.parent)) == [f"x{ext}"]  # no temporary left behind


@pytest.mark.parametrize("mode", ["overwrite", "create"])
def test_a_durable_save_makes_the_directories_it_creates_durable_too(tmp_path, monkeypatch, mode):
    """A file's directory entry is fsynced, and so is the entry of every directory the save made (in its
    parent): after a power loss the new ``step_N/`` cannot be missing with the file inside it. A save into
    an existing directory syncs that directory only; ``durable=False`` syncs nothing."""
    from ckptio.backends import local

    synced: list[str] = []
    real = local.fsync_dir
    monkeypatch.setattr(local, "fsync_dir", lambda p: (synced.append(p), real(p)))
    root = tmp_path / "runs"
    root.mkdir()
    target = root / "run7" / "step_100" / "model.fpk"
    ckptio.dump({"w": torch.ones(3)}, str(target), mode=mode)
    # the file's directory, then the parent of each directory made (deepest first)
    assert synced == [str(target.parent), str(root / "run7"), str(root)]
    synced.clear()
    ckptio.dump({"w": torch.ones(3)}, str(target.parent / "optim.fpk"), mode=mode)
    assert synced == [str(target.parent)]  # nothing new: no extra fsync
    synced.clear()
    ckptio.put(b"x", str(root / "run8" / "a.bin"), durable=False)
    assert synced == []
    ckptio.copytree(str(target.parent), str(root / "copy" / "step_100"))  # the destination root it makes, too
    assert {str(root / "copy"), str(root)} <= set(synced)
    # through a symlink and "..": the kernel makes step_1 in the link target's parent, and that is what is synced
    (tmp_path / "deep" / "target").mkdir(parents=True)
    (tmp_path / "top").mkdir()
    os.symlink(tmp_path / "deep" / "target", tmp_path / "top" / "lnk")
    synced.clear()
    ckptio.dump({"w": torch.ones(3)}, str(tmp_path / "top" / "lnk" / ".." / "step_1" / "m.fpk"), mode=mode)
    assert (tmp_path / "deep" / "step_1" / "m.fpk").is_file()
    deep = os.path.realpath(tmp_path / "deep")
    assert [os.path.realpath(p) for p in synced] == [os.path.join(deep, "step_1"), deep]
    assert torch.equal(ckptio.load(str(target))["w"], torch.ones(3))


# ---- damage after writing ----------------------------------------------------------------------


# below and above ckptio.threads.PARALLEL_MIN: hashed in the calling thread, and on other threads
@pytest.mark.parametrize("numel", [300 * 300, 3 << 20])
@pytest.mark.parametrize("mmap", [None, False])  # the default (a verified mapping) and copy mode
def test_fpk_bit_flip_is_detected_with_object_and_range(tmp_path, numel, mmap):
    p = str(tmp_path / "s.fpk")
    w = torch.randn(numel)
    ckptio.dump({"v": torch.ones(5), "w": w}, p)
    assert torch.equal(ckptio.load(p, mmap=mmap)["w"], w)  # what the writer hashed is what the reader finds
    flip_byte(p, os.path.getsize(p) // 2)
    with pytest.raises(IntegrityError) as ei:
        ckptio.load(p, mmap=mmap)
    assert p in str(ei.value) and "'w'" in str(ei.value) and "bytes [" in str(ei.value)


def test_fpk_truncation_is_detected(tmp_path):
    p = str(tmp_path / "s.fpk")
    ckptio.dump({"w": torch.randn(300, 300)}, p)
    os.truncate(p, os.path.getsize(p) - 1000)
    with pytest.raises(IntegrityError, match="truncated") as ei:
        ckptio.load(p)
    assert p in str(ei.value)


def test_dcp_bit_flip_is_detected_with_object_and_range(tmp_path):
    d = str(tmp_path / "ck")
    dcp.save({"w": torch.randn(300, 300)}, d)
    data = [n for n in os.listdir(d) if n.endswith(".distcp")][0]
    flip_byte(os.path.join(d, data), os.path.getsize(os.path.join(d, data)) // 2)
    with pytest.raises(IntegrityError) as ei:  # ckptio.dcp.load raises the failed rank's own error
        dcp.load({"w": torch.zeros(300, 300)}, d)
    text = str(ei.value)
    assert data in text and "bytes [" in text


def test_dcp_truncated_data_is_detected(tmp_path):
    d = str(tmp_path / "ck")
    dcp.save({"w": torch.randn(300, 300)}, d)
    data = os.path.join(d, [n for n in os.listdir(d) if n.endswith(".distcp")][0])
    os.truncate(data, os.path.getsize(data) // 2)
    with pytest.raises(BaseException) as ei:
        dcp.load({"w": torch.zeros(300, 300)}, d)
    assert os.path.basename(data) in str(ei.value)


def test_remote_fpk_bit_flip_is_detected(s3_uri):
    uri = s3_uri + "/s.fpk"
    ckptio.dump({"w": torch.randn(300, 300)}, uri)
    raw = bytearray(ckptio.get(uri))
    raw[len(raw) // 2] ^= 0x01
    ckptio.put(bytes(raw), uri)
    with pytest.raises(IntegrityError) as ei:
        ckptio.load(uri)
    assert uri in str(ei.value) and "bytes [" in str(ei.value)
