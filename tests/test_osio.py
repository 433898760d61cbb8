"""``ckptio.osio``: copy_bytes (the copy memory:// reads use, large copies with the GIL released) and
preadv_into (the scatter read local readv uses)."""

from __future__ import annotations

import mmap
import os
import threading
import time

import pytest

import ckptio
from ckptio import osio


@pytest.mark.parametrize("n", [0, 1, 4096, osio.COPY_UNLOCKED_MIN - 1, osio.COPY_UNLOCKED_MIN, 3 << 20])
@pytest.mark.parametrize("offset", [0, 7])
def test_copy_bytes_copies_what_a_slice_would(n, offset):
    src = os.urandom((3 << 20) + 100)
    dst = bytearray(n + 5)
    got = osio.copy_bytes(memoryview(dst)[2 : 2 + n], src, offset)
    assert got == n and dst[2 : 2 + n] == src[offset : offset + n] and dst[:2] == b"\0\0" and dst[2 + n :] == b"\0" * 3


def test_copy_bytes_past_the_end_and_other_sources_and_read_only_targets():
    src = os.urandom(2 << 20)
    dst = bytearray(2 << 20)
    assert osio.copy_bytes(memoryview(dst), src, (1 << 20) + 3) == (1 << 20) - 3  # short at the end
    assert dst[: (1 << 20) - 3] == src[(1 << 20) + 3 :]
    assert osio.copy_bytes(memoryview(dst), src, len(src) + 10) == 0
    arr = bytearray(src)  # not bytes: copied by slice assignment
    dst2 = bytearray(len(src))
    assert osio.copy_bytes(memoryview(dst2), arr) == len(src) and dst2 == arr
    with pytest.raises(TypeError):
        osio.copy_bytes(memoryview(bytes(len(src))), src)


def test_memory_reads_copy_large_ranges_without_the_gil(monkeypatch):
    calls: list[int] = []
    real = osio.memmove
    monkeypatch.setattr(osio, "memmove", lambda d, s, n, *a: (calls.append(n), real(d, s, n, *a)))
    backend, uri = ckptio.resolve("memory://osio-test/big.bin")
    data = os.urandom(5 << 20)
    backend.write(uri, data)
    buf = bytearray(4 << 20)
    assert backend.readinto(uri, buf, 1 << 20) == 4 << 20 and buf == data[1 << 20 :]
    assert calls == [4 << 20]
    small = bytearray(100)
    assert backend.readinto(uri, small, 10) == 100 and small == data[10:110] and calls == [4 << 20]
    backend.delete(uri)


def test_copy_bytes_refuses_negative_offsets_and_counts_bytes_of_any_format():
    src = os.urandom(3 << 20)
    with pytest.raises(ValueError, match="negative"):
        osio.copy_bytes(memoryview(bytearray(2 << 20)), src, -32)
    backend, uri = ckptio.resolve("memory://osio-test/neg.bin")
    backend.write(uri, src)
    with pytest.raises(ValueError, match="memory://osio-test/neg.bin"):
        backend.readinto(uri, bytearray(2 << 20), -(1 << 44))
    backend.delete(uri)
    floats = memoryview(bytearray(2 << 20)).cast("f")  # 512 Ki items, 2 MiB
    assert osio.copy_bytes(floats, src) == 2 << 20 and floats.cast("B") == src[: 2 << 20]


def _views(sizes: list[int]) -> tuple[bytearray, list[memoryview]]:
    buf = bytearray(sum(sizes))
    out, pos = [], 0
    for n in sizes:
        out.append(memoryview(buf)[pos : pos + n])
        pos += n
    return buf, out


@pytest.mark.parametrize("seed", range(30))
def test_preadv_into_reads_what_one_read_would_with_short_reads_and_eof(tmp_path, monkeypatch, seed):
    import random

    rng = random.Random(seed)
    data = os.urandom(rng.randrange(0, 20000))
    path = tmp_path / "f"
    path.write_bytes(data)
    sizes = [rng.choice([0, 0, 1, 7, 100, 4096, 5000]) for _ in range(rng.randrange(0, 40))]
    offset = rng.randrange(0, len(data) + 10)
    real = os.preadv
    if seed % 2:  # the kernel may return fewer bytes than asked: every caller must carry on from there

        def short(fd, bufs, off):
            want = sum(len(b) for b in bufs)
            if want <= 1:
                return real(fd, bufs, off)
            cut = rng.randrange(1, want)
            trimmed, room = [], cut
            for b in bufs:
                trimmed.append(b[: max(0, min(len(b), room))])
                room -= len(trimmed[-1])
            return real(fd, trimmed, off)

        monkeypatch.setattr(osio.os, "preadv", short)
    buf, views = _views(sizes)
    fd = os.open(path, os.O_RDONLY)
    try:
        n = osio.preadv_into(fd, views, offset)
    finally:
        os.close(fd)
    want = data[offset : offset + len(buf)]
    assert n == len(want) and bytes(buf[:n]) == want and buf[n:] == bytearray(len(buf) - n)


def test_preadv_into_takes_more_buffers_than_one_call_allows(tmp_path, monkeypatch):
    data = os.urandom(3000)
    path = tmp_path / "f"
    path.write_bytes(data)
    calls = []
    real = os.preadv
    monkeypatch.setattr(osio.os, "preadv", lambda fd, bufs, off: calls.append(len(bufs)) or real(fd, bufs, off))
    buf, views = _views([1] * 2500)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert osio.preadv_into(fd, views, 100) == 2500
    finally:
        os.close(fd)
    assert bytes(buf) == data[100:2600] and max(calls) <= 1024 and len(calls) == 3
    for sizes in ([0] * 1024 + [100], [0] * 1500 + [100, 0], [20] + [0] * 2000 + [20]):  # empties take no slot
        buf, views = _views(sizes)
        fd = os.open(path, os.O_RDONLY)
        try:
            assert osio.preadv_into(fd, views, 7) == sum(sizes) and bytes(buf) == data[7 : 7 + sum(sizes)]
        finally:
            os.close(fd)


def test_local_readv_scatters_in_one_open_and_names_a_missing_file(tmp_path):
    data = os.urandom(10000)
    (tmp_path / "f").write_bytes(data)
    backend, _ = ckptio.resolve(str(tmp_path / "f"))
    buf, views = _views([10, 0, 4000, 3, 9000])
    assert backend.readv(str(tmp_path / "f"), views, 50) == 9950 and bytes(buf[:9950]) == data[50:]
    with pytest.raises(FileNotFoundError, match="nope"):
        backend.readv(str(tmp_path / "nope"), views, 0)

    class Counting(type(backend)):  # a subclass with its own readinto keeps being asked
        calls = 0

        def readinto(self, uri, buf, offset=0):
            Counting.calls += 1
            return super().readinto(uri, buf, offset)

    buf, views = _views([10, 20])
    assert Counting().readv(str(tmp_path / "f"), views, 0) == 30 and Counting.calls == 2 and bytes(buf) == data[:30]


def _record_writeback(monkeypatch) -> list[tuple[int, int, int, int]]:
    """Every range WriteBehind asks the kernel to start writing back, as (fd, offset, nbytes, flags);
    the real call still runs."""
    calls: list[tuple[int, int, int, int]] = []
    real = osio.sync_file_range()
    if real is None:
        pytest.skip("no sync_file_range on this platform")

    def record(fd: int, offset: int, nbytes: int, flags: int) -> int:
        calls.append((fd, offset, nbytes, flags))
        return real(fd, offset, nbytes, flags)

    monkeypatch.setattr(osio, "sync_file_range", lambda: record)
    return calls


def _check_ranges(calls: list[tuple[int, int, int, int]], written: int) -> list[int]:
    """The ranges of one file are contiguous from 0, whole pages, not empty (a length of 0 means "to
    the end of the file"), never past what was written, and never waited for (SYNC_FILE_RANGE_WRITE
    alone); returns where each ends."""
    assert all(flags == 2 for *_, flags in calls)
    pos = 0
    for _, offset, nbytes, _ in calls:
        assert offset == pos and nbytes > 0 and (offset + nbytes) % mmap.PAGESIZE == 0
        pos = offset + nbytes
    assert pos <= written
    return [o + n for _, o, n, _ in calls]


def _write(f, wb: osio.WriteBehind, sizes: list[int]) -> int:
    for n in sizes:
        f.write(os.urandom(n))
        wb.wrote(n)
    return sum(sizes)


def test_write_behind_starts_whole_pages_early_then_every_so_often(tmp_path, monkeypatch):
    calls = _record_writeback(monkeypatch)
    sizes = [5, 99_990, 7, 150_000, 4096, 200_000, 1, 300_000, 200_000, 600_000, 2_000_000, 1_500_000]
    with open(tmp_path / "f", "wb", buffering=0) as f:
        written = _write(f, osio.WriteBehind(f.fileno(), eager=1 << 20, step=100_000, every=1 << 20), sizes)
    ends = _check_ranges(calls, written)
    starts = [0, *ends[:-1]]
    early = [e for s, e in zip(starts, ends, strict=True) if s < 1 << 20]
    assert len(early) >= 4 and early[-1] == 1 << 20  # about every 100,000 bytes, up to the early part's end
    late = [e - s for s, e in zip(starts, ends, strict=True) if s >= 1 << 20]
    assert late and all(n >= (1 << 20) - mmap.PAGESIZE for n in late)  # later: about every MiB


def test_write_behind_with_a_known_size_starts_early_in_its_first_half_only(tmp_path, monkeypatch):
    calls = _record_writeback(monkeypatch)
    with open(tmp_path / "f", "wb", buffering=0) as f:
        wb = osio.WriteBehind(f.fileno(), size=1_000_000, eager=1 << 30, step=100_000, every=1 << 30)
        written = _write(f, wb, [120_000] * 8 + [40_000])
    ends = _check_ranges(calls, written)
    assert len(ends) >= 3 and ends[-1] == -(-500_000 // mmap.PAGESIZE) * mmap.PAGESIZE


@pytest.mark.parametrize("sizes", [[3 << 20], [1, 3 << 20], [200_000, 5 << 20, 100]])
def test_one_large_write_starts_only_the_early_part(tmp_path, monkeypatch, sizes):
    calls = _record_writeback(monkeypatch)
    with open(tmp_path / "f", "wb", buffering=0) as f:
        written = _write(f, osio.WriteBehind(f.fileno(), eager=1 << 20, step=100_000, every=32 << 20), sizes)
    assert _check_ranges(calls, written)[-1] == 1 << 20  # not all of it, right before the fsync


@pytest.mark.parametrize("step, every", [(100, 1 << 20), (1, 1), (4096, 10)])
def test_steps_under_a_page_never_ask_for_an_empty_range(tmp_path, monkeypatch, step, every):
    calls = _record_writeback(monkeypatch)
    with open(tmp_path / "f", "wb", buffering=0) as f:
        wb = osio.WriteBehind(f.fileno(), eager=64 << 10, step=step, every=every)
        written = _write(f, wb, [100, 10, 4000, 1, 70_000, 10, 3, 5000, 4096, 9])
    _check_ranges(calls, written)  # nbytes > 0 for every call


@pytest.mark.parametrize("ext", [".fpk", ".pt", "dcp"])
@pytest.mark.parametrize("shape", ["many", "one"])
def test_durable_local_saves_start_writeback_as_they_write(tmp_path, monkeypatch, ext, shape):
    import torch

    from ckptio import dcp

    calls = _record_writeback(monkeypatch)
    if shape == "many":
        state = {f"w{i}": torch.randn(100_000 + i) for i in range(6)}  # 2.4 MB in tensors of odd sizes
    else:
        state = {"w": torch.randn(1 << 20)}  # one 4 MiB write
    uri = str(tmp_path / f"ckpt{ext}") if ext != "dcp" else str(tmp_path / "ckpt")
    if ext == "dcp":
        dcp.save(state, uri)
        back = {k: torch.empty_like(v) for k, v in state.items()}
        dcp.load(back, uri)
    else:
        ckptio.dump(state, uri)
        back = ckptio.load(uri)
    assert all(torch.equal(back[k], v) for k, v in state.items())
    by_file: dict[int, list] = {}
    for c in calls:
        by_file.setdefault(c[0], []).append(c)
    assert by_file, "no writeback started"
    for fd_calls in by_file.values():  # early in each file only, long before its fsync
        assert 1 <= len(fd_calls) <= 2 and _check_ranges(fd_calls, 5 << 20)[-1] <= 512 << 10, fd_calls
    calls.clear()
    ckptio.dump(state, str(tmp_path / "not-durable.fpk"), durable=False)
    ckptio.dump(state, str(tmp_path / "not-durable.pt"), durable=False)
    assert calls == []  # nothing is fsynced, so nothing is pushed to the disk early


def test_fresh_bytes_are_ordinary_bytes_once_filled():
    from ckptio.osio import bytes_of, fresh_bytes

    data = bytes(range(256)) * 4096
    out, view = fresh_bytes(len(data))
    view[:] = data
    got = bytes_of(out, view, len(data))
    assert got is out and type(got) is bytes and got == data and hash(got) == hash(data)
    out, view = fresh_bytes(10)  # filled in part (a short read): a copy of what was filled
    view[:4] = b"abcd"
    assert bytes_of(out, view, 4) == b"abcd"
    out, view = fresh_bytes(0)
    assert bytes_of(out, view, 0) == b""


def _resident(view: memoryview) -> list[bool]:
    """Which pages of ``view`` (page-aligned) are resident, by ``mincore``."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    pages = -(-len(view) // mmap.PAGESIZE)
    vec = ctypes.create_string_buffer(pages)
    assert libc.mincore(ctypes.addressof(ctypes.c_char.from_buffer(view)), len(view), vec) == 0
    return [bool(b & 1) for b in vec.raw]


def _fresh(n: int) -> memoryview:
    """``osio.anonymous(n)`` in 4 KiB pages even where transparent huge pages are "always" (a huge page
    is faulted in, and stays, 2 MiB at a time: residency would count those, not what was populated)."""
    import ctypes

    buf = osio.anonymous(n)
    libc = ctypes.CDLL(None)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise(ctypes.addressof(ctypes.c_char.from_buffer(buf)), n, 15)  # MADV_NOHUGEPAGE
    return buf


needs_populate = pytest.mark.skipif(
    not osio._load_madvise() or osio.sys.platform != "linux", reason="MADV_POPULATE_WRITE is Linux-only"
)
PAGE = mmap.PAGESIZE


@needs_populate
@pytest.mark.parametrize("size", [0, 1, PAGE, 300_001, (1 << 20) + 5, 3 << 20])
def test_fault_in_ahead_populates_to_the_size_and_gives_back_what_lies_past_it(size):
    """Told the size at once, the pages up to it (the last one, partly filled, too) are faulted in and
    none past it stay resident, whatever the guess."""
    buf = _fresh(8 << 20)
    told = threading.Event()
    told.set()
    kept = osio.fault_in_ahead(buf, lambda: size, told, lambda: False, 2 << 20)
    pages = -(-size // PAGE)
    assert kept == pages * PAGE
    res = _resident(buf)
    assert all(res[:pages]) and not any(res[pages:])


@needs_populate
@pytest.mark.parametrize("size", [10_000, (1 << 20) + 5, 3 << 20])
def test_fault_in_ahead_populates_the_guess_then_waits_for_the_size(size):
    """Before the reply's headers only the guess is faulted in; once the size is known the rest up to it,
    and what the guess faulted in past a smaller object is given back."""
    buf = _fresh(8 << 20)
    known: list[int] = []
    sized = threading.Event()
    t = threading.Thread(
        target=lambda: known.append(
            osio.fault_in_ahead(buf, lambda: known[0] if known else None, sized, lambda: False, 1 << 20)
        )
    )
    t.start()
    deadline = time.monotonic() + 10
    while sum(_resident(buf)) < (1 << 20) // PAGE:
        assert time.monotonic() < deadline, "the guess was not faulted in"
    assert sum(_resident(buf)) == (1 << 20) // PAGE  # no further than the guess while the size is unknown
    known.append(size)
    sized.set()
    t.join(10)
    pages = -(-size // PAGE)
    assert known[1] == pages * PAGE
    res = _resident(buf)
    assert all(res[:pages]) and not any(res[pages:])


@needs_populate
def test_fault_in_ahead_stops_when_asked_and_keeps_bytes_written_meanwhile():
    """A reader waiting for more than the buffer holds stops faulting in at once; bytes another thread
    wrote while pages were faulted in (and given back past the size) are intact."""
    buf = _fresh(8 << 20)
    sized = threading.Event()
    assert osio.fault_in_ahead(buf, lambda: None, sized, lambda: True, 4 << 20) == 0
    assert not any(_resident(buf))

    size = (5 << 20) + 123
    data = os.urandom(size)
    go = threading.Event()

    def write() -> None:
        go.wait()
        for pos in range(0, size, 65536):  # as a reply's body streams in
            buf[pos : min(size, pos + 65536)] = data[pos : pos + 65536]

    w = threading.Thread(target=write)
    w.start()
    go.set()
    kept = osio.fault_in_ahead(buf, lambda: size, sized, lambda: False, 1 << 20)
    w.join(10)
    assert kept == -(-size // PAGE) * PAGE
    assert bytes(buf[:size]) == data


def test_fault_in_ahead_is_a_no_op_without_madvise(monkeypatch):
    monkeypatch.setattr(osio, "_populate_ok", False)
    buf = osio.anonymous(1 << 20)
    assert osio.fault_in_ahead(buf, lambda: 1 << 20, threading.Event(), lambda: False, 1 << 20) == 0


@needs_populate
def test_a_read_that_never_tells_the_size_gives_back_what_was_faulted_in_past_it():
    """A user backend's ``read_head`` may never call ``on_size`` (``start_sized`` then asks ``stat``): the
    pages the caller faulted in while it waited are given back past the size ``stat`` tells."""
    import concurrent.futures as cf

    from ckptio.backends.base import ObjectInfo, start_sized

    size = 10_000
    buf = _fresh(8 << 20)

    class NoSize:
        def stat(self, uri):
            return ObjectInfo(uri, size)

    def start(on_size):
        fut: cf.Future[int] = cf.Future()

        def read() -> None:
            time.sleep(0.05)  # the caller faults in its guess meanwhile
            buf[:size] = b"x" * size
            fut.set_result(size)

        threading.Thread(target=read).start()
        return fut

    fut, n = start_sized(NoSize(), "user://a", buf, start=start, fault_in=1 << 20)
    assert n == size and fut.result() == size and bytes(buf[:size]) == b"x" * size
    pages = -(-size // PAGE)
    res = _resident(buf)
    assert all(res[:pages]) and not any(res[pages:]), sum(res)


@needs_populate
def test_fault_in_striped_populates_every_buffer_of_every_read():
    """Every page of every read's buffers ends resident; bytes a read wrote meanwhile stay intact."""
    reads = [[_fresh(3 << 20), _fresh((1 << 20) + PAGE)], [_fresh(PAGE)], [], [_fresh(5 << 20)]]
    reads[1][0][:5] = b"hello"  # written before its page was populated: kept
    done = osio.fault_in_striped(reads, threading.Event())
    assert done == sum(len(v) for views in reads for v in views)
    assert all(all(_resident(v)) for views in reads for v in views)
    assert bytes(reads[1][0][:5]) == b"hello"


def test_fault_in_striped_takes_a_step_of_each_read_in_turn_and_stops_when_asked(monkeypatch):
    """The reads stream in side by side, so each gets its next ``step`` in turn (a read's first pages are
    resident early, whichever read it is), and a set ``stop`` ends it at the next step."""
    calls: list[tuple[int, int]] = []
    stop = threading.Event()
    monkeypatch.setattr(osio, "_load_madvise", lambda: True)
    monkeypatch.setattr(osio, "_populate_ok", True)
    monkeypatch.setattr(osio, "prefault_range", lambda addr, n, least: calls.append((addr, n)))
    a, b = osio.anonymous(3 << 20), osio.anonymous(1 << 20)
    base = {id(a): ctypes_addr(a), id(b): ctypes_addr(b)}
    osio.fault_in_striped([[a], [b]], stop)
    mib = 1 << 20
    want = [(base[id(a)], mib), (base[id(b)], mib), (base[id(a)] + mib, mib), (base[id(a)] + 2 * mib, mib)]
    assert calls == want
    calls.clear()

    def stop_after_two(addr: int, n: int, least: int) -> None:
        calls.append((addr, n))
        if len(calls) == 2:
            stop.set()

    monkeypatch.setattr(osio, "prefault_range", stop_after_two)
    assert osio.fault_in_striped([[a], [b]], stop) == 2 * mib
    assert len(calls) == 2
    assert osio.fault_in_striped([[a]], stop) == 0  # stopped before it starts


def test_fault_in_striped_is_a_no_op_without_madvise(monkeypatch):
    monkeypatch.setattr(osio, "_populate_ok", False)
    assert osio.fault_in_striped([[osio.anonymous(1 << 20)]], threading.Event()) == 0


def ctypes_addr(view: memoryview) -> int:
    return osio.address(view)


@pytest.mark.parametrize("fault_in", [None, 1 << 20])
@pytest.mark.parametrize("delay", [0.0, 0.3])
def test_start_sized_calls_late_once_when_the_size_is_late_and_never_when_it_is_not(fault_in, delay):
    """``late=(seconds, fn)``: ``fn`` runs once, on the caller's thread before start_sized returns, when
    the reply has not told the size by then (with or without a fault-in meanwhile); not when it has."""
    import concurrent.futures as cf

    from ckptio.backends.base import start_sized

    class Slow:
        def start_read_head(self, uri, buf, on_size):
            fut: cf.Future[int] = cf.Future()

            def reply() -> None:
                time.sleep(delay)
                on_size(10)
                buf[:10] = b"0123456789"
                fut.set_result(10)

            threading.Thread(target=reply).start()
            return fut

    calls: list[str] = []
    buf = osio.anonymous(4 << 20)
    fut, size = start_sized(
        Slow(), "x", buf, fault_in=fault_in, late=(0.1, lambda: calls.append(threading.current_thread().name))
    )
    assert size == 10 and fut.result() == 10 and bytes(buf[:10]) == b"0123456789"
    assert calls == ([threading.current_thread().name] if delay else [])
