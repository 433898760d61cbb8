"""What a local storage holds where a file should be (a pipe, a directory, a file where a folder should
be) fails a read with an error naming it, never a hang; and the first reads of a process, on several
threads at once, find ``osio``'s lazily loaded libc functions ready. Hangs and races run in a
subprocess under a timeout, so they fail the test instead of the run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import ckptio
from ckptio.backends.local import LocalBackend
from ckptio.checkpointer import Checkpointer
from ckptio.errors import CkptioError, IntegrityError


def run_child(code: str, timeout: float = 60) -> str:
    """Run ``code`` in a fresh interpreter; its stdout (a hang fails the test at ``timeout``)."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def biggest_block(root: str) -> str:
    content = os.path.join(root, ".content")
    return max((os.path.join(d, f) for d, _, fs in os.walk(content) for f in fs), key=os.path.getsize)


def saved(tmp_path) -> tuple[Checkpointer, str, dict]:
    root = str(tmp_path / "r")
    ck = Checkpointer(root, format="fpk", incremental=True)
    state = {"w": torch.randn(1 << 20), "step": 1}
    ck.save(1, state)
    return ck, root, state


def test_a_pipe_in_place_of_a_content_object_fails_the_load_naming_it(tmp_path):
    _, root, _ = saved(tmp_path)
    victim = biggest_block(root)
    os.unlink(victim)
    os.mkfifo(victim)  # no writer: a blocking open would wait forever
    out = run_child(
        f"""
        import torch
        from ckptio.checkpointer import Checkpointer
        ck = Checkpointer({root!r}, format="fpk", incremental=True)
        try:
            ck.load({{"w": torch.zeros(1 << 20), "step": 0}}, step=1)
        except Exception as e:
            print(type(e).__name__, e)
        """
    )
    assert out.startswith("IntegrityError") and os.path.basename(victim) in out and "not a regular file" in out


def test_a_pipe_in_place_of_a_checkpoint_file_fails_the_load(tmp_path):
    p = str(tmp_path / "x.fpk")
    os.mkfifo(p)
    out = run_child(
        f"""
        import ckptio
        for kw in ({{}}, {{"mmap": False}}):
            try:
                ckptio.load({p!r}, **kw)
                print("returned")
            except Exception as e:
                print(type(e).__name__, e)
        """
    )
    assert out.count("IntegrityError") == 2 and "x.fpk" in out


@pytest.mark.parametrize("shape", ["folder is a file", "content dir is a file", "object is a directory"])
def test_a_content_store_of_the_wrong_shape_fails_the_load_naming_the_object(tmp_path, shape):
    ck, root, state = saved(tmp_path)
    victim = biggest_block(root)
    if shape == "object is a directory":
        os.unlink(victim)
        os.mkdir(victim)
        want = "is a directory"
    else:
        gone = os.path.dirname(victim) if shape == "folder is a file" else os.path.join(root, ".content")
        os.rename(gone, gone + ".away")
        with open(gone, "wb") as f:
            f.write(b"not a folder")
        want = "missing"
    with pytest.raises(IntegrityError, match=f"its content object .*/.content/.* {want}") as e:
        ck.load({"w": torch.zeros_like(state["w"]), "step": 0}, step=1)
    assert "state.fpk" in str(e.value)  # and the step's file
    if shape != "content dir is a file":  # (there: whichever block is read first)
        assert os.path.basename(victim) in str(e.value)


def test_local_reads_of_a_directory_or_a_pipe_name_it_and_leak_nothing(tmp_path):
    b = LocalBackend()
    (tmp_path / "sub").mkdir()
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "f").write_bytes(b"hello")
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        for call in (lambda: b.read_range(str(tmp_path / "sub")), lambda: b.open_reader(str(tmp_path / "sub"))):
            with pytest.raises(CkptioError, match="sub"):
                call()
        assert b.read_range(str(tmp_path / "pipe")) == b""  # no writer: empty, at once
        assert b.read_range(str(tmp_path / "f"), 1, 3) == b"el" and b.read_range(str(tmp_path / "f"), 4) == b"o"
        with b.open_reader(str(tmp_path / "f")) as r:
            assert r.read() == b"hello"
    assert len(os.listdir("/proc/self/fd")) == fds


def test_only_a_plain_local_backend_gives_its_files_paths(tmp_path):
    class Counting(LocalBackend):
        def readinto(self, uri, buf, offset=0):  # a subclass reading its own way: not read around
            return super().readinto(uri, buf, offset)

    assert LocalBackend().file_path(str(tmp_path / "x")) == str(tmp_path / "x")
    assert Counting().file_path(str(tmp_path / "x")) is None
    backend, uri = ckptio.resolve("memory://b/x")
    assert backend.file_path(uri) is None


def test_first_prefaults_on_many_threads_at_once_find_libc_ready():
    out = run_child(
        """
        import mmap, sys, threading
        from ckptio import osio
        sys.setswitchinterval(1e-6)  # a thread switch at almost every bytecode: the widest window
        bufs = [memoryview(mmap.mmap(-1, 4 << 20)) for _ in range(8)]
        errors = []
        for attempt in range(30):
            osio._libc = osio._mincore = None  # as in a fresh process
            barrier = threading.Barrier(len(bufs))

            def go(buf):
                barrier.wait()
                try:
                    osio.prefault(buf)
                except Exception as e:
                    errors.append(repr(e))

            threads = [threading.Thread(target=go, args=(b,)) for b in bufs]
            [t.start() for t in threads]
            [t.join() for t in threads]
        print(len(errors), errors[:1])
        """,
        timeout=120,
    )
    assert out.startswith("0 "), out
