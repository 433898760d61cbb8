"""Attacks on an object store's whole-object read (``ckptio.get``: ``read``, the rest fetched into the
bytes returned) and on ``start_read_head`` (the first GET of a load, started on the IO loop): an
interrupt while requests are in flight, subclasses with their own ``read_head``, the shared pool held
by many loads, stale memory in a traceback."""

from __future__ import annotations

import contextlib
import functools
import json
import sys
import textwrap
import threading

import pytest

import ckptio
import zygote
from ckptio.backends.s3 import S3Backend
from ckptio.errors import IntegrityError
from conftest import S3_TEST_OPTIONS
from test_pinned_reads import _replace_before_the_second_read

MiB = 1 << 20

CHILD = textwrap.dedent(
    """
    import asyncio, gc, json, os, signal, sys, threading, time
    import ckptio

    uri, opts = sys.argv[1], json.loads(sys.argv[2])
    ckptio.configure(backends={"s3": opts})
    backend, uri = ckptio.resolve(uri)
    size = 12 << 20
    backend.write(uri, b"\\xab" * size)
    cls = type(backend)
    real = cls._get_range

    mode = sys.argv[3]

    async def slow(self, uri, bucket, key, start, end, into, on_size=None, pin=None):
        if start > 0 or mode == "first":
            await asyncio.sleep(1.0)  # a slow network: Ctrl-C comes while it is in flight
        return await real(self, uri, bucket, key, start, end, into, on_size=on_size, pin=pin)

    cls._get_range = slow
    if mode != "staged":  # it reads its buffer list after on_size, as S3Backend's own hook does
        cls._sized_get_range = slow
    print("straight" if backend._reads_straight(backend.pin_version(uri)) else "staged")
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a KeyboardInterrupt even where SIGINT came ignored
    threading.Timer(0.4, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    try:
        backend.read(uri)
        print("no interrupt")
    except KeyboardInterrupt:
        pass
    gc.collect()
    victims = [bytearray(size - (4 << 20)) for _ in range(4)] + [bytes(size) for _ in range(4)]
    time.sleep(1.5)  # the requests still in flight end meanwhile
    dirty = sum(len(v) - v.count(0) for v in victims)
    print("dirty" if dirty else "clean", flush=True)
    """
)


@pytest.mark.parametrize("mode", ["staged", "straight", "first"])
def test_ctrl_c_during_a_whole_read_writes_only_live_memory(tmp_path, s3_uri, s3_endpoint, mode):
    """The requests of an interrupted read go on for a while: what they fill must still be the read's
    own buffer (a freed bytes object would be reused by the next allocation and corrupted). ``staged``:
    the first body into a staging buffer; ``straight``: into the bytes returned, Ctrl-C while the rest
    is in flight; ``first``: Ctrl-C before the first reply's headers (the bytes are made after it)."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    opts = {"endpoint_url": s3_endpoint, "part_size": 5 << 20, **S3_TEST_OPTIONS}
    proc = zygote.run(
        [sys.executable, str(script), f"{s3_uri}/big.bin", json.dumps(opts), mode],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    path = "staged" if mode == "staged" else "straight"
    assert proc.stdout.split() == [path, "clean"], (proc.stdout, proc.stderr[-3000:])


def _within(fn, timeout: float = 30):
    out: list = []

    def body() -> None:
        try:
            out.append(("ok", fn()))
        except BaseException as e:  # noqa: BLE001 - reported to the test
            out.append(("err", e))

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"hung for {timeout}s"
    kind, value = out[0]
    if kind == "err":
        raise value
    return value


def test_a_subclass_read_head_that_calls_super_does_not_loop(s3_uri, s3_endpoint):
    calls: list[bool] = []

    class Logging(S3Backend):
        def read_head(self, uri, buf, on_size, *, pin=None):
            calls.append(pin is not None)
            return super().read_head(uri, buf, on_size, pin=pin)

    b = Logging(endpoint_url=s3_endpoint, part_size=5 * MiB, **S3_TEST_OPTIONS)
    uri = f"{s3_uri}/sub.bin"
    data = bytes(range(256)) * (24 << 10)  # 6 MiB: a first range and the rest
    b.write(uri, data)
    assert _within(lambda: b.read(uri)) == data
    buf = bytearray(len(data))
    assert _within(lambda: b.read_head(uri, buf, lambda n: None)) == len(data) and buf == data
    assert calls == [True, False]  # the read's (pinned), then the direct call; once each


def test_a_subclass_read_head_that_takes_the_pin_gets_it(s3_uri, s3_endpoint, monkeypatch):
    pins: list = []

    class PinAware(S3Backend):
        def read_head(self, uri, buf, on_size, *, pin=None):
            pins.append(pin)
            on_size(self.stat(uri).size)
            return self.readinto(uri, buf, 0, pin=pin)

    b = PinAware(endpoint_url=s3_endpoint, part_size=5 * MiB, **S3_TEST_OPTIONS)
    uri = f"{s3_uri}/p.bin"
    b.write(uri, b"a" * (12 * MiB))
    done = _replace_before_the_second_read(monkeypatch, s3_endpoint, uri, b"b" * (12 * MiB))
    with pytest.raises(IntegrityError, match="replaced while it was being read"):
        b.read(uri)  # never a mix of a and b
    assert done and len(pins) == 1 and pins[0] is not None


def test_many_loads_of_empty_objects_through_a_wrapper_do_not_hold_the_shared_pool(s3_uri):
    """A wrapper (progress counting) runs read_head on the shared pool; an empty object's size lookup must
    not queue behind those very tasks on the same pool."""
    from ckptio.threads import SHARED_WORKERS

    uri = f"{s3_uri}/empty.fpk"
    backend, resolved = ckptio.resolve(uri)
    backend.write(resolved, b"")
    errors: list[BaseException] = []

    def one() -> None:
        try:
            ckptio.load(uri, progress=lambda *a: None)
        except Exception as e:  # noqa: BLE001 - an empty file is not a checkpoint: the error is expected
            errors.append(e)

    threads = [threading.Thread(target=one, daemon=True) for _ in range(SHARED_WORKERS + 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "loads hung on the shared pool"
    assert len(errors) == len(threads) and all(isinstance(e, IntegrityError) for e in errors), errors[:2]


def test_a_failed_whole_read_leaves_no_stale_memory_in_its_traceback(s3_uri, s3_endpoint, monkeypatch):
    """The bytes object a read fills is not zeroed first; when the read fails, no frame of the traceback
    may still hold it (or a view of it) with whatever the heap held before."""
    backend, uri = ckptio.resolve(f"{s3_uri}/t.bin", part_size=5 * MiB)
    backend.write(uri, b"a" * (12 * MiB))
    _replace_before_the_second_read(monkeypatch, s3_endpoint, uri, b"b" * (12 * MiB))
    big = bytes(32 * MiB)  # freed: malloc now serves blocks of up to 32 MiB from its heap, not fresh mappings
    del big
    secret = b"SECRET-KEY;" * (MiB + 1)  # 11 MiB freed just before the read: heap memory it may be given
    del secret
    with pytest.raises(IntegrityError) as info:
        backend.read(uri)
    tb = info.value.__traceback__
    while tb is not None:
        for name, v in tb.tb_frame.f_locals.items():
            if isinstance(v, (bytes, bytearray, memoryview)):
                assert b"SECRET-KEY;" not in bytes(v), (tb.tb_frame.f_code.co_name, name)
        tb = tb.tb_next


@pytest.mark.parametrize("store", ["s3", "gcs"])
def test_start_sized_returns_early_only_when_there_is_more_to_fetch(store, s3_uri, gcs_uri):
    """An object that fits the buffer: the caller is woken once, when the read is in (on 2 cores a wake-up
    at the headers and another at the body costs tenths of a millisecond). A larger one: at its size, before
    its first body is in, so the rest can start while it comes."""
    from ckptio.backends.base import start_sized
    from ckptio.osio import anonymous

    root = s3_uri if store == "s3" else gcs_uri
    backend, _ = ckptio.resolve(root)
    ckptio.put(b"x" * 1000, f"{root}/small")
    fut, size = start_sized(backend, f"{root}/small", anonymous(4096))
    assert size == 1000 and fut.done() and fut.result() == 1000
    fut, size = start_sized(backend, f"{root}/small", anonymous(100))
    assert size == 1000 and fut.result() == 100
    fut, size = start_sized(backend, f"{root}/small", anonymous(1000))  # exactly full
    assert size == 1000 and fut.done() and fut.result() == 1000
    ckptio.put(b"", f"{root}/empty")
    fut, size = start_sized(backend, f"{root}/empty", anonymous(4096))
    assert size == 0 and fut.result() == 0


@pytest.mark.parametrize("store", ["s3", "gcs"])
@pytest.mark.parametrize("size", [0, 1, 3 * MiB, 5 * MiB + 7, 12 * MiB])
def test_a_whole_read_returns_the_bytes_its_first_body_streamed_into(store, size, s3_uri, gcs_uri, monkeypatch):
    """No staging copy: the bytes returned are the ones made when the first reply told the size, and
    its body and the rest were fetched into them (an empty object has nothing to stream)."""
    from ckptio.objectstore import backend as ob

    made: list[bytes] = []
    real = ob.fresh_bytes

    def spy(n):
        out, view = real(n)
        made.append(out)
        return out, view

    monkeypatch.setattr(ob, "fresh_bytes", spy)
    root = s3_uri if store == "s3" else gcs_uri
    backend, uri = ckptio.resolve(f"{root}/whole-{size}.bin", part_size=5 * MiB)
    data = bytes(range(251)) * (size // 251) + b"z" * (size % 251)
    backend.write(uri, data)
    got = backend.read(uri)
    assert got == data and type(got) is bytes
    if size:
        assert len(made) == 1 and got is made[0]
    with pytest.raises(ckptio.NotFoundError, match="whole-missing"):
        backend.read(f"{root}/whole-missing.bin")


def _copies_its_buffer_list(fn):
    @functools.wraps(fn)  # a decorator written the usual way: it copies the function's attributes too
    async def wrapper(self, uri, bucket, key, start, end, into, **kw):
        return await fn(self, uri, bucket, key, start, end, [memoryview(v).cast("B") for v in into], **kw)

    return wrapper


@pytest.mark.parametrize("how", ["override", "wraps"])
def test_a_subclass_get_range_keeps_the_staged_whole_read(how, s3_uri, s3_endpoint):
    """A subclass's own ``_get_range`` (an override, or the parent's wrapped by a decorator that copies
    its buffer list) may read its buffers before it tells the size: it is not handed a buffer swapped
    under it, and the read is whole and exact (never bytes nobody filled)."""
    swapped: list[bool] = []

    class Own(S3Backend):
        async def _get_range(self, uri, bucket, key, start, end, into, on_size=None, pin=None):
            first = into[0]
            n = await super()._get_range(uri, bucket, key, start, end, into, on_size=on_size, pin=pin)
            swapped.append(into[0] is not first)
            return n

    class Wrapped(S3Backend):
        _get_range = _copies_its_buffer_list(S3Backend._get_range)

    b = (Own if how == "override" else Wrapped)(endpoint_url=s3_endpoint, part_size=5 * MiB, **S3_TEST_OPTIONS)
    for size in (1000, 200_000, 6 * MiB + 1):
        uri = f"{s3_uri}/own-{size}.bin"
        data = bytes(range(256)) * (size // 256) + b"q" * (size % 256)
        b.write(uri, data)
        for _ in range(2):
            assert _within(lambda u=uri: b.read(u)) == data
    assert how == "wraps" or (swapped and not any(swapped))


def _buffers_reachable_from(exc: BaseException) -> list:
    """Every bytes-like object the traceback's frames (and their closures, lists, views) still hold."""
    import ctypes
    import types

    stack: list = []
    for e in (exc, exc.__context__):
        tb = e.__traceback__ if e is not None else None
        while tb is not None:
            stack.append(tb.tb_frame.f_locals)
            tb = tb.tb_next
    seen, out = set(), []
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, (types.ModuleType, type)):
            continue
        seen.add(id(o))
        if isinstance(o, (bytes, bytearray)):
            out.append(o)
        elif isinstance(o, memoryview):
            out.append(o)
            stack.append(o.obj)
        elif isinstance(o, ctypes.Array):
            stack.append(getattr(o, "_owner", None))
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set)):
            stack.extend(o)
        elif isinstance(o, types.FunctionType):
            for c in o.__closure__ or ():
                with contextlib.suppress(ValueError):
                    stack.append(c.cell_contents)
    return out


@pytest.mark.parametrize("size", [MiB, 6 * MiB])
def test_an_interrupt_at_any_line_of_a_whole_read_leaves_no_stale_heap_in_its_traceback(size, s3_uri):
    """KeyboardInterrupt raised at each line of ``read`` in turn (a Ctrl-C can land between any two
    bytecodes): whatever the traceback still holds is the object's bytes or zeros, never what the heap
    held before (planted by reading another object of the same size first)."""
    import inspect
    import time

    from ckptio.objectstore.backend import ObjectStoreBackend

    backend, uri = ckptio.resolve(f"{s3_uri}/lines-{size}.bin", part_size=5 * MiB)
    junk = f"{s3_uri}/junk-{size}.bin"
    backend.write(uri, b"\x01" * size)
    backend.write(junk, b"\xee" * size)
    code = ObjectStoreBackend.read.__code__
    src, first = inspect.getsourcelines(ObjectStoreBackend.read)
    lines = [first + i for i, line in enumerate(src) if line.strip() and not line.strip().startswith(("#", '"'))]
    interrupted = 0
    for line in lines:
        for _ in range(2):
            backend.read(junk)  # freed: its 0xEE bytes are what fresh memory may hold next
        fired: list[bool] = []

        def trace(frame, event, arg, line=line, fired=fired):
            if frame.f_code is not code:
                return None

            def local(f, ev, a):
                if ev == "line" and f.f_lineno == line and not fired:
                    fired.append(True)
                    raise KeyboardInterrupt(f"at line {line}")
                return local

            return local

        sys.settrace(trace)
        try:
            got = backend.read(uri)
        except KeyboardInterrupt as e:
            sys.settrace(None)
            interrupted += 1
            time.sleep(0.15)  # requests still in flight end: they may only have written the object's bytes
            for b in _buffers_reachable_from(e):
                data = bytes(b)
                assert data.count(0) + data.count(1) == len(data), f"stale heap bytes after an interrupt at {line}"
        else:
            sys.settrace(None)
            assert got == b"\x01" * size
    assert interrupted > 10
