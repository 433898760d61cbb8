"""Crafted ``.fpk`` files, and a child process that loads them so a crash fails a test instead of pytest.

``seal`` wraps any metadata in a valid header and footer (checksums included), so only the parser
and validation stand between a crafted table or tree and the loader. ``nested_tree`` writes the
msgpack of containers nested to any depth without recursion (the writer refuses to go that deep).

:class:`LoaderProcess` runs ``python fpk_crafting.py``: the child takes files one after another on
stdin, loads / inspects / runs ``ckptio info`` or ``verify`` on each, and answers with what happened.
It dying from a signal, hanging, or raising anything but ckptio's FormatError/IntegrityError fails
the test that sent the file, which is kept for a rerun. The child's address space is capped at what
it needed to load a sample plus ``HEADROOM``, so a loader allocating far beyond a small file fails too.
"""

from __future__ import annotations

import collections
import contextlib
import io
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import traceback
from typing import Any

import msgpack
import pytest
import xxhash

from ckptio import fastpickle as fp

HEADROOM = 1 << 30
REPLY_TIMEOUT = 300  # seconds; only a hang gets near it


def split(data: bytes) -> tuple[int, bytes, bytes]:
    """(flags, payload area, metadata bytes) of a well-formed file."""
    meta_off, meta_len = struct.unpack("<QQ", data[-64:-48])
    flags = struct.unpack("<H", data[10:12])[0]
    return flags, data[64:meta_off], data[meta_off : meta_off + meta_len]


def seal(flags: int, payload: bytes, meta: bytes, *, footer_lie: dict | None = None) -> bytes:
    """A file with valid checksums around whatever metadata (and footer fields) it is given."""
    header = fp.HEADER.pack(fp.MAGIC, fp.VERSION, flags, fp.ALIGN)
    f = {
        "meta_off": 64 + len(payload),
        "meta_len": len(meta),
        "size": 64 + len(payload) + len(meta) + 64,
        "hash": xxhash.xxh3_64_intdigest(header + meta),
        **(footer_lie or {}),
    }
    body = struct.pack("<QQQQHH12x", f["meta_off"], f["meta_len"], f["hash"], f["size"], fp.VERSION, flags)
    footer = body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body)) + fp.FOOTER_MAGIC
    return header + payload + meta + footer


def craft(
    tree: bytes,
    storages: list | None = None,
    tensors: list | None = None,
    payload: bytes = b"",
    flags: int = 0,
    **footer_lie: int,
) -> bytes:
    """A sealed file from a packed tree and raw tables (each storage's checksum as given)."""
    meta = msgpack.packb(
        {"checksum": "xxh3_64", "storages": storages or [], "tensors": tensors or [], "tree": tree}, use_bin_type=True
    )
    return seal(flags, payload, meta, footer_lie=footer_lie or None)


def tensor_ref(i: int) -> bytes:
    return msgpack.packb(msgpack.ExtType(fp.EXT_TENSOR, i.to_bytes(4, "little")))


# ---- nesting --------------------------------------------------------------------------------------

# kind -> (wrap a value in it, whether the result is hashable, whether it needs a hashable inside)
KINDS: dict[str, tuple[Any, bool, bool]] = {
    "list": (lambda x: [x], False, False),
    "dict": (lambda x: {"k": x}, False, False),
    "tuple": (lambda x: (x,), True, False),
    "odict": (lambda x: collections.OrderedDict(k=x), False, False),
    "gdict": (lambda x: {1.5: x}, False, False),  # a key msgpack maps cannot hold: the generic dict
    "gdict_key": (lambda x: {x: 1}, False, True),
    "set": (lambda x: {x}, False, True),
    "frozenset": (lambda x: frozenset([x]), True, True),
}


def _ext(code: int, items: bytes, n: int) -> bytes:
    return msgpack.packb(msgpack.ExtType(code, bytes([0x90 | n]) + items))


def _wrap_bytes(kind: str, inner: bytes) -> bytes:
    """The msgpack the writer produces for ``kind`` around an already packed value."""
    if kind == "list":
        return b"\x91" + inner
    if kind == "dict":
        return b"\x81\xa1k" + inner
    if kind == "tuple":
        return _ext(fp.EXT_TUPLE, inner, 1)
    if kind == "odict":
        return _ext(fp.EXT_ODICT, b"\xa1k" + inner, 2)
    if kind == "gdict":
        return _ext(fp.EXT_GDICT, msgpack.packb(1.5) + inner, 2)
    if kind == "gdict_key":
        return _ext(fp.EXT_GDICT, inner + b"\x01", 2)
    return _ext(fp.EXT_SET if kind == "set" else fp.EXT_FROZENSET, inner, 1)


def fix_kinds(kinds: list[str]) -> list[str]:
    """``kinds`` (innermost first) with each kind that needs a hashable inside but would not get one
    replaced by a list, so the chain can exist in Python; the depth stays ``len(kinds)``."""
    out, hashable = [], True  # the leaf (None) is hashable
    for k in kinds:
        if KINDS[k][2] and not hashable:
            k = "list"
        out.append(k)
        hashable = hashable if k == "tuple" else KINDS[k][1]  # a tuple is hashable when its items are
    return out


def nested_value(kinds: list[str], leaf: Any = None) -> Any:
    x = leaf
    for k in kinds:
        x = KINDS[k][0](x)
    return x


def nested_tree(kinds: list[str], leaf: bytes = b"\xc0") -> bytes:
    """Packed tree of ``kinds`` (innermost first) around ``leaf``: as deep as asked, no recursion."""
    prefix: list[bytes] = []  # native containers only prefix their content: joined once, not copied per level
    x = leaf
    for k in kinds:
        if k in ("list", "dict"):
            prefix.append(_wrap_bytes(k, b""))
        else:
            x = _wrap_bytes(k, b"".join(reversed(prefix)) + x)
            prefix = []
    return b"".join(reversed(prefix)) + x


# ---- the child ----------------------------------------------------------------------------------


def _largest_owned(value: Any) -> int:
    """The largest buffer any array or tensor in ``value`` owns or views."""
    import numpy as np
    import torch

    most, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack += v.keys()
            stack += v.values()
        elif isinstance(v, (list, tuple, set, frozenset)):
            stack += v
        elif isinstance(v, np.ndarray):
            most = max(most, v.nbytes)
        elif isinstance(v, torch.Tensor):
            most = max(most, v.untyped_storage().nbytes())
    return most


def _run(op: str, path: str, kw: dict) -> tuple[str, Any]:
    from ckptio import cli

    if op == "load":
        want = kw.pop("return_value", False)
        value = fp.load(path, **kw)
        return "ok", {"largest": _largest_owned(value), "value": value if want else None}
    if op == "inspect":
        info = fp.inspect(path)
        return "ok", {"largest": max([t.nbytes for t in info.tensors], default=0)}
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main([op, path])
    return "exit", {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


def _child(workdir: str) -> None:
    import faulthandler
    import resource

    import numpy as np
    import torch

    from ckptio.errors import FormatError

    faulthandler.enable()
    replies = os.fdopen(os.dup(1), "wb")  # the answers; anything else printed goes to stderr
    os.dup2(2, 1)
    path = os.path.join(workdir, "crafted.fpk")
    fp.save({"w": torch.ones(3), "n": np.ones(2), "t": (1, {2})}, path)
    for op in ("load", "inspect", "info", "verify"):  # warm up: thread pools, lazy imports
        _run(op, path, {})
    with open("/proc/self/statm") as f:
        vsize = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (vsize + HEADROOM, resource.getrlimit(resource.RLIMIT_AS)[1]))
    stdin = sys.stdin.buffer
    while True:
        head = stdin.read(8)
        if len(head) < 8:
            return
        op, data, kw = pickle.loads(stdin.read(struct.unpack("<Q", head)[0]))
        with open(path, "wb") as f:
            f.write(data)
        try:
            reply = _run(op, path, kw)
        except FormatError as e:  # IntegrityError included
            reply = ("format", str(e))
        except KeyError as e:
            reply = ("keyerror", str(e))
        except BaseException:  # noqa: BLE001 - reported to the test, which fails
            reply = ("unexpected", traceback.format_exc())
        msg = pickle.dumps(reply)
        replies.write(struct.pack("<Q", len(msg)) + msg)
        replies.flush()


class LoaderProcess:
    """The parent's end: ``run(op, data, **kw)`` -> (outcome, detail), or an AssertionError if the child dies."""

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None
        self.sent = 0

    def _start(self) -> None:
        # few malloc arenas: each reserves 64 MiB of the capped address space
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "MALLOC_ARENA_MAX": "2"}
        self._err = open(os.path.join(self.workdir, "child.stderr"), "ab")
        self.proc = subprocess.Popen(
            [sys.executable, __file__, self.workdir],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            env=env,
        )

    def run(self, op: str, data: bytes, **kw: Any) -> tuple[str, Any]:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        assert self.proc and self.proc.stdin and self.proc.stdout
        self.sent += 1
        msg = pickle.dumps((op, data, kw))
        try:
            self.proc.stdin.write(struct.pack("<Q", len(msg)) + msg)
            self.proc.stdin.flush()
            head = self._read(8)
            return pickle.loads(self._read(struct.unpack("<Q", head)[0]))
        except (EOFError, BrokenPipeError, TimeoutError) as e:
            saved = os.path.join(self.workdir, f"case{self.sent}.fpk")
            with open(saved, "wb") as f:
                f.write(data)
            if isinstance(e, TimeoutError):
                self.proc.kill()
            rc = self.proc.wait()
            how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit status {rc}"
            with open(os.path.join(self.workdir, "child.stderr"), "rb") as f:
                tail = f.read()[-3000:].decode(errors="replace")
            what = "hung and was killed" if isinstance(e, TimeoutError) else "died"
            raise AssertionError(
                f"the loader process {what} ({how}) on {op} {kw} of a {len(data)}-byte file, saved as {saved}:\n{tail}"
            ) from None

    @property
    def path(self) -> str:
        """Where the child writes each file (error messages must name it)."""
        return os.path.join(self.workdir, "crafted.fpk")

    def check(self, data: bytes, ops: tuple[str, ...] = ("load", "inspect"), **kw: Any) -> str:
        """Run ``ops`` on ``data``: each must succeed within the file's size or fail with a FormatError
        naming the file (``ckptio info``/``verify``: exit status 0 or 1 with such a message). Returns
        the first op's outcome: "ok", "format" or "keyerror" (a missing key, with ``keys=``)."""
        outcomes = []
        for op in ops:
            outcome, detail = self.run(op, data, **(kw if op == "load" else {}))
            if op in ("info", "verify"):
                assert outcome == "exit" and detail["code"] in (0, 1), (op, outcome, detail)
                if detail["code"]:
                    assert self.path in detail["stderr"] and "error: " in detail["stderr"], detail
                outcome = "ok" if detail["code"] == 0 else "format"
            elif outcome == "ok":
                assert detail["largest"] <= len(data), (
                    f"{op} made a {detail['largest']}-byte buffer from a {len(data)}-byte file"
                )
            elif outcome == "format":  # names the file and says what is wrong
                assert detail.startswith(self.path) and not detail.rstrip().endswith(":"), detail
            else:
                assert outcome == "keyerror" and "keys" in kw, (op, kw, outcome, detail)
            outcomes.append(outcome)
        return outcomes[0]

    def _read(self, n: int) -> bytes:
        assert self.proc and self.proc.stdout
        fd, buf = self.proc.stdout.fileno(), b""
        while len(buf) < n:
            if not select.select([fd], [], [], REPLY_TIMEOUT)[0]:
                raise TimeoutError
            chunk = os.read(fd, n - len(buf))
            if not chunk:
                raise EOFError
            buf += chunk
        return buf

    def close(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()  # type: ignore[union-attr]
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self._err.close()
            self.proc = None


@pytest.fixture(scope="module")
def loader(tmp_path_factory):
    """One loader child per test module."""
    proc = LoaderProcess(str(tmp_path_factory.mktemp("fpk-loader")))
    yield proc
    proc.close()


if __name__ == "__main__":
    _child(sys.argv[1])
