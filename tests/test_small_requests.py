"""Requests per call for small objects on S3 and GCS, counted by a proxy in front of the real server
(issue 14: the fixed cost per call decides small sizes; a small object is one request).

Counts, not timings: a small ``.fpk`` is one PUT, and one GET to load (its size from the reply's headers), as is a
small ``.pt``; a small DCP
checkpoint is one data object; ``read`` of a small object is one GET with no HEAD first; ``isfile`` is one HEAD.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time

import pytest
import torch

import ckptio
from ckptio import dcp as cd
from ckptio.formats.fastpickle import pacing


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(64, 64, generator=g) for i in range(6)}  # ~96 KiB


def _data_requests(proxy) -> list[str]:
    """The methods of the recorded requests, without GCS's precondition checks of create-only writes."""
    return [r.method for r in proxy.requests if "fields=generation" not in r.path]


def test_small_fpk_is_one_put_and_one_get_to_load(proxy):
    # (a store that answers in time: conftest's _no_early_end; the other case is the next test)
    state, uri = _state(), proxy.uri + "/small.fpk"
    proxy.clear()
    ckptio.dump(state, uri)
    assert len(proxy.requests) == 1, proxy.requests  # one PUT (S3) or one media upload (GCS)
    proxy.clear()
    out = ckptio.load(uri)
    # one ranged GET from byte 0: the object's size comes with its headers (Backend.read_head), so no
    # HEAD first; a larger object's other reads start as soon as those headers are in
    assert [r.method for r in proxy.requests] == ["GET"], proxy.requests
    assert all(torch.equal(out[k], v) for k, v in state.items())


def test_fpk_load_requests_of_a_larger_object_fetch_each_byte_once(proxy):
    g = torch.Generator().manual_seed(1)
    state = {f"w{i}": torch.randn(1 << 20, generator=g) for i in range(6)}  # 24 MiB: several parts
    uri = proxy.uri + "/big.fpk"
    ckptio.dump(state, uri)
    size = ckptio.resolve(uri)[0].stat(ckptio.resolve(uri)[1]).size
    proxy.clear()
    out = ckptio.load(uri)
    assert all(torch.equal(out[k], v) for k, v in state.items())
    assert all(r.method == "GET" and "Range" in r.headers for r in proxy.requests), proxy.requests  # no size lookup
    assert sum(r.bytes_out for r in proxy.requests) <= size + (64 << 10), proxy.requests


@pytest.mark.parametrize("mib", [0, 24])
def test_a_late_size_has_the_end_read_at_once_by_a_suffix_range(proxy, monkeypatch, mib):
    """When the first reply has not told the size TAIL_EARLY after the load started (a remote store's
    round trip), S3 reads the object's end at once with a suffix range (no size needed), so the layout
    comes a round trip sooner: a small object is then two GETs in one round trip (the second's bytes go
    unused), a larger one is still read once, byte for byte. GCS (no suffix reads here) is as before."""
    from ckptio.formats.fastpickle import read as fpk_read

    monkeypatch.setattr(fpk_read, "TAIL_EARLY", 0.0)  # the size is late whatever the store's speed
    g = torch.Generator().manual_seed(2)
    state = {f"w{i}": torch.randn(1 << 20, generator=g) for i in range(mib // 4)} if mib else _state()
    state["odd"] = torch.randn(7, generator=g)  # the end's payloads: as aligned in their buffer as in the file
    uri = proxy.uri + f"/late{mib}.fpk"
    ckptio.dump(state, uri)
    backend, key = ckptio.resolve(uri)
    size = backend.stat(key).size
    proxy.clear()
    out = ckptio.load(uri)
    assert all(torch.equal(out[k], v) for k, v in state.items())
    assert out["odd"].data_ptr() % 64 == 0

    def suffixes() -> list:
        return [r for r in proxy.requests if r.headers.get("Range", "").startswith("bytes=-")]

    deadline = time.monotonic() + 10  # an unused suffix read is not waited for: it may land after the load
    while not proxy.uri.startswith("gs://") and not suffixes() and time.monotonic() < deadline:
        time.sleep(0.01)
    suffix = suffixes()
    assert all(r.method == "GET" and "Range" in r.headers for r in proxy.requests), proxy.requests  # no HEAD
    if proxy.uri.startswith("gs://"):
        assert not suffix
    else:
        assert len(suffix) == 1 and suffix[0].headers["Range"] == f"bytes=-{fpk_read.TAIL_PREFETCH}"
    if mib:
        assert sum(r.bytes_out for r in proxy.requests) <= size + (64 << 10), proxy.requests  # each byte once
    else:
        assert len(proxy.requests) == 1 + len(suffix), proxy.requests


def test_a_slow_store_has_the_end_read_with_the_first_range(s3_proxy, monkeypatch):
    """A store whose first replies took over SLOW_STORE (the median of its last few, per store) has the end
    of the next large load requested with its first range, without waiting; a fast one does not."""
    from ckptio.formats.fastpickle import read as fpk_read

    g = torch.Generator().manual_seed(3)
    state = {f"w{i}": torch.randn(1 << 20, generator=g) for i in range(4)}
    uri = s3_proxy.uri + "/slow.fpk"
    ckptio.dump(state, uri)
    backend = ckptio.resolve(uri)[0]
    monkeypatch.setattr(fpk_read, "SLOW_STORE", 0.0)  # any store is slow
    s3_proxy.clear()
    ckptio.load(uri)  # the first load: no history, the end waits for the size (TAIL_EARLY: an hour)
    assert not [r for r in s3_proxy.requests if r.headers.get("Range", "").startswith("bytes=-")]
    assert len(pacing.first_replies[backend]) == 1  # the time its first reply took to tell the size
    s3_proxy.clear()
    out = ckptio.load(uri)
    assert all(torch.equal(out[k], v) for k, v in state.items())
    assert [r.headers["Range"] for r in s3_proxy.requests if r.headers.get("Range", "").startswith("bytes=-")] == [
        f"bytes=-{fpk_read.TAIL_PREFETCH}"
    ]
    monkeypatch.setattr(fpk_read, "SLOW_STORE", 3600.0)  # a fast store
    s3_proxy.clear()
    ckptio.load(uri)
    assert not [r for r in s3_proxy.requests if r.headers.get("Range", "").startswith("bytes=-")]


def test_a_mid_sized_objects_middle_is_read_once_the_size_is_known(proxy, monkeypatch):
    """An object larger than the first range and at most MIDDLE_MAX: the bytes between the first range
    and the end are requested as soon as the first reply tells the size, not after the end's reply
    (which told the layout) as a larger object's payloads are; each byte is read once and the payloads
    there come back as views of one buffer, laid out as in the file and exact. ``mmap=False`` (no views)
    reads each payload into a tensor of its own, once the layout is known."""
    from ckptio.formats.fastpickle import read as fpk_read

    g = torch.Generator().manual_seed(4)
    state = {f"w{i}": torch.randn(1 << 20, generator=g) for i in range(6)}  # 24 MiB: 4 MiB payloads
    uri = proxy.uri + "/middle.fpk"
    ckptio.dump(state, uri)
    backend, key = ckptio.resolve(uri)
    size = backend.stat(key).size
    head = min(backend.part_size, fpk_read.HEAD_PREFETCH)
    calls: list[tuple[int, int, float, float]] = []  # (offset, bytes, start, end) of the reads past the head
    real = fpk_read.BackendSource._fetch

    def fetch(self, mv, offset):
        t = time.monotonic()
        if offset + len(mv) == size:  # the end: the layout comes late
            time.sleep(1.0)
        try:
            return real(self, mv, offset)
        finally:
            calls.append((offset, len(mv), t, time.monotonic()))

    monkeypatch.setattr(fpk_read.BackendSource, "_fetch", fetch)
    for mmap in (None, False):
        calls.clear()
        proxy.clear()
        out = ckptio.load(uri, mmap=mmap)
        assert all(torch.equal(out[k], v) for k, v in state.items())
        ranges = sorted((o, o + n) for o, n, _, _ in calls)
        tail_read = next(c for c in calls if c[0] + c[1] == size)
        others = [c for c in calls if c is not tail_read]
        if mmap is None:
            assert ranges[0][0] == head and all(a[1] == b[0] for a, b in itertools.pairwise(ranges))  # once each
            assert others and all(n >= pacing.MIDDLE_PIECE for _, n, _, _ in others)  # (how many: the store's pace)
            assert all(t < tail_read[3] - 0.5 for _, _, t, _ in others)  # not waiting for the end's reply
            assert out["w4"].data_ptr() - out["w2"].data_ptr() == 2 * (4 << 20)  # views of one buffer
            assert sum(r.bytes_out for r in proxy.requests) <= size + (64 << 10)
        else:
            assert others and all(t >= tail_read[3] for _, _, t, _ in others)  # once the layout is known
            assert len({out[k].untyped_storage().data_ptr() for k in state}) == len(state)


def test_a_mid_sized_objects_middle_keeps_to_the_backends_concurrency(proxy, monkeypatch):
    """The middle's ranges are read at most ``concurrency`` at once (the backend's bound on requests in
    flight, which users lower for throttled stores), whatever the shared pool's size."""
    from ckptio.formats.fastpickle import read as fpk_read

    g = torch.Generator().manual_seed(5)
    state = {f"w{i}": torch.randn(1 << 20, generator=g) for i in range(12)}  # 48 MiB: ten 4 MiB middle ranges
    uri = proxy.uri + "/middle-bound.fpk"
    ckptio.dump(state, uri)
    size = ckptio.resolve(uri)[0].stat(ckptio.resolve(uri)[1]).size
    lock, now, most = threading.Lock(), [0], [0]
    real = fpk_read.BackendSource._fetch

    def fetch(self, mv, offset):
        middle = offset + len(mv) < size  # not the end's read
        with lock:
            now[0] += middle
            most[0] = max(most[0], now[0])
        try:
            time.sleep(0.02)  # each range takes a while: the next would start meanwhile if allowed
            return real(self, mv, offset)
        finally:
            with lock:
                now[0] -= middle

    monkeypatch.setattr(fpk_read.BackendSource, "_fetch", fetch)
    for concurrency in (1, 2):
        most[0] = 0
        out = ckptio.load(uri, backend_args={"concurrency": concurrency})
        assert all(torch.equal(out[k], v) for k, v in state.items())
        assert most[0] == concurrency, (concurrency, most[0])


def test_a_load_failing_on_the_ends_stops_reading_its_middle(proxy, monkeypatch):
    """A mid-sized object that is no .fpk fails once its head and end are in: no range of its middle
    starts once the source is closing (the load waits only for those in flight), so it reads less
    than the object."""
    from ckptio.formats.fastpickle import read as fpk_read

    uri = proxy.uri + "/not-fpk.fpk"
    backend, key = ckptio.resolve(uri)
    size = 60 << 20
    backend.write(key, bytes(range(256)) * (size >> 8))  # 60 MiB of anything
    starts: list[tuple[float, int]] = []  # (when, bytes) of each middle range started
    closed: list[float] = []
    real_fetch, real_close = fpk_read.BackendSource._fetch, fpk_read.BackendSource.close

    def fetch(self, mv, offset):
        if offset + len(mv) < size:  # a middle range
            starts.append((time.monotonic(), len(mv)))
            time.sleep(0.05)  # slow ranges: the load has failed before the middle is through
        return real_fetch(self, mv, offset)

    def close(self):
        closed.append(time.monotonic())
        real_close(self)

    monkeypatch.setattr(fpk_read.BackendSource, "_fetch", fetch)
    monkeypatch.setattr(fpk_read.BackendSource, "close", close)
    proxy.clear()
    with pytest.raises(ckptio.errors.FormatError, match="not a fastpickle file"):
        ckptio.load(uri, backend_args={"concurrency": 2, "part_size": 8 << 20})  # more ranges than readers
    # (a reader that found the source open as close() began may start one more range)
    assert starts and sum(t >= closed[0] for t, _ in starts) <= 2
    assert sum(n for _, n in starts) < size - (9 << 20), starts  # the middle is 52 MiB less the end


def test_the_middle_is_read_in_ranges_one_connection_streams_for_two_round_trips():
    """pacing.middle_piece: ``n`` in equal ranges, as many as the connections take, fewer where one would
    be shorter than MIDDLE_PIECE or than what one connection of the store moved (median of its last
    first ranges) in two of its first replies (median), none over part_size; the history is the
    store's own."""
    from ckptio.backends.memory import MemoryBackend

    store, other, mib = MemoryBackend(), MemoryBackend(), 1 << 20
    assert pacing.middle_piece(store, 24 * mib, 16, 16 * mib) == 4 * mib  # no history yet: the floor
    assert pacing.middle_piece(store, 26 * mib, 16, 16 * mib) == -(-26 * mib // 6)  # 6 equal, not 6 x 4 + 2
    for s in (0.008, 0.009, 0.010):
        pacing.note_first_reply(store, s)
    pacing.conn_rates[store] = collections.deque([0.6e9, 0.7e9, 0.1e9])  # 10.8 MB in two 9 ms replies
    assert pacing.middle_piece(store, 24 * mib, 16, 16 * mib) == 12 * mib  # 2 ranges of 12 MiB, not 10 + 10 + 4
    assert pacing.middle_piece(store, 30 * mib, 16, 16 * mib) == 15 * mib  # 2 of at least 10.8 MB
    assert pacing.middle_piece(other, 24 * mib, 16, 16 * mib) == 4 * mib
    assert pacing.middle_piece(store, 40 * mib, 16, 8 * mib) == 8 * mib  # part_size caps it
    pacing.conn_rates[store] = collections.deque([0.09e9])  # 90 MB/s, 9 ms: 1.6 MB, the floor
    assert pacing.middle_piece(store, 24 * mib, 16, 16 * mib) == 4 * mib
    assert pacing.middle_piece(store, 120 * mib, 16, 16 * mib) == 120 * mib // 16  # shared out
    for n in (1, 5 * mib + 3, 63 * mib):
        for part in (1, 3 * mib, 16 * mib):
            p = pacing.middle_piece(store, n, 16, part)
            k = -(-n // p)
            assert 1 <= p <= part and k * p - n < k, (n, part, p)  # equal, within a byte
            assert p >= min(part, 4 * mib, n) or k == -(-n // part), (n, part, p)  # the floor, or part_size's count


def test_small_fpk_partial_load_still_reads_ranges(proxy):
    state = {f"layer{i}.weight": torch.randn(128, 256) for i in range(8)}  # 1 MiB
    uri = proxy.uri + "/small.fpk"
    ckptio.dump(state, uri)
    proxy.clear()
    out = ckptio.load(uri, keys=["layer2.weight"])
    assert torch.equal(out["layer2.weight"], state["layer2.weight"])
    assert proxy.bytes_out < 512 << 10  # the end (metadata) and one tensor, not the whole object


def test_read_of_a_small_object_is_one_get_and_isfile_one_head(proxy):
    backend, uri = ckptio.resolve(proxy.uri + "/obj.bin")
    backend.write(uri, b"x" * 1000)
    backend.write(uri + "-empty", b"")
    proxy.clear()
    assert backend.read(uri) == b"x" * 1000
    assert [r.method for r in proxy.requests] == ["GET"]
    assert backend.read(uri + "-empty") == b""
    with pytest.raises(FileNotFoundError):
        backend.read(uri + "-missing")
    proxy.clear()
    assert backend.isfile(uri) and not backend.isfile(uri + "-missing")
    assert len(proxy.requests) == 2  # one HEAD (S3) or metadata GET (GCS) each, no listing
    assert not backend.isfile(proxy.uri + "/")


def test_read_of_a_larger_object_reuses_its_first_range(proxy):
    backend, uri = ckptio.resolve(proxy.uri + "/big.bin", part_size=8 << 20)
    data = bytes(range(256)) * (24 << 10)  # 6 MiB: over the first range (4 MiB)
    backend.write(uri, data)
    proxy.clear()
    out = backend.read(uri)
    assert type(out) is bytes and out == data and hash(out) == hash(data)
    # the size from the first GET's headers, no HEAD; the rest fetched once, from where the first range ends
    assert [r.method for r in proxy.requests] == ["GET", "GET"], proxy.requests
    assert proxy.bytes_out <= len(data) + 4096


def test_small_dcp_save_and_load_requests(proxy):
    state, uri = _state(), proxy.uri + "/ckpt"
    proxy.clear()
    cd.save(state, uri)
    # the overwrite check, one data object, the .metadata commit
    assert len(_data_requests(proxy)) == 3, proxy.requests
    backend, root = ckptio.resolve(uri)
    assert len(list(backend.list(root))) == 2
    proxy.clear()
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    cd.load(out, uri)
    # .metadata in one GET; the data object in one GET whose reply also tells its size (checked
    # against every item's range before the items are read), not a HEAD and then a GET
    assert [r.method for r in proxy.requests] == ["GET", "GET"], proxy.requests
    assert all(torch.equal(out[k], v) for k, v in state.items())


def test_dcp_load_of_many_megabyte_tensors_is_one_get_per_part(proxy):
    """Neighbouring tensors of a data object come in one ranged GET of up to ``part_size`` bytes that
    streams through them (a scatter read), not one GET per tensor; nothing is read twice."""
    g = torch.Generator().manual_seed(1)
    state = {f"w{i}": torch.randn(1 << 18, generator=g) for i in range(12)}  # 12 x 1 MiB, one data object
    uri = proxy.uri + "/mb"
    cd.save(state, uri, min_object_bytes=64 << 20)
    backend, root = ckptio.resolve(uri)
    assert len(list(backend.list(root))) == 2
    proxy.clear()
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    cd.load(out, uri)
    assert all(torch.equal(out[k], v) for k, v in state.items())
    gets = [r for r in proxy.requests if r.method == "GET" and "metadata" not in r.path]
    part = backend.part_size
    assert len(gets) <= 1 + (12 << 20) // part + 1, proxy.requests  # the object's size may be one GET (GCS)
    assert proxy.bytes_out <= (13 << 20), proxy.bytes_out  # each byte once (+ metadata)


def test_pt_loads_fetch_each_byte_once(proxy, monkeypatch):
    # a remote .pt is fetched into memory for torch's zip reader: its first part_size bytes by one GET that
    # also tells the size (no HEAD first), the rest in parallel ranged GETs started when those headers arrive
    state, uri = _state(), proxy.uri + "/small.pt"
    ckptio.dump(state, uri)
    proxy.clear()
    out = ckptio.load(uri)
    assert [r.method for r in proxy.requests] == ["GET"], proxy.requests
    assert all(torch.equal(out[k], v) for k, v in state.items())

    big = {"w": torch.randn(3 << 20)}  # 12 MiB
    uri = proxy.uri + "/big.pt"
    ckptio.dump(big, uri, backend_args={"part_size": 16 << 20})
    size = ckptio.resolve(uri)[0].stat(ckptio.resolve(uri)[1]).size
    for part, requests in ((16 << 20, 1), (5 << 20, 3)):  # within one part; over several (S3's least is 5 MiB)
        proxy.clear()
        out = ckptio.load(uri, backend_args={"part_size": part})
        assert torch.equal(out["w"], big["w"])
        assert len(proxy.requests) == requests and all(r.method == "GET" for r in proxy.requests), proxy.requests
        assert proxy.bytes_out <= size + 4096

    # over the in-memory bound: through a temporary file, the first part not fetched again
    from ckptio.formats import torch as ptformat

    monkeypatch.setattr(ptformat, "IN_MEMORY_MAX", 8 << 20)
    proxy.clear()
    out = ckptio.load(uri, backend_args={"part_size": 5 << 20})
    assert torch.equal(out["w"], big["w"])
    assert all(r.method == "GET" for r in proxy.requests) and proxy.bytes_out <= size + 4096, proxy.requests


def test_read_head_tells_the_size_once_and_old_get_range_hooks_still_work(proxy):
    import copy

    backend, uri = ckptio.resolve(proxy.uri + "/obj.bin")
    data = bytes(range(256)) * 4000
    backend.write(uri, data)
    backend.write(uri + "-empty", b"")
    for size, target in ((len(data), uri), (0, uri + "-empty")):
        buf, told = bytearray(len(data) + 100), []
        proxy.clear()
        assert backend.read_head(target, buf, told.append) == size
        assert told == [size] and bytes(buf[:size]) == data[:size]
        if size:
            assert [r.method for r in proxy.requests] == ["GET"], proxy.requests
    small = bytearray(1000)  # the buffer smaller than the object: the size is still the object's
    told = []
    assert backend.read_head(uri, small, told.append) == 1000 and told == [len(data)] and small == data[:1000]

    class OldHook(type(backend)):  # a subclass written before _get_range took on_size
        async def _get_range(self, uri, bucket, key, start, end, into):
            return await super()._get_range(uri, bucket, key, start, end, into)

    old = copy.copy(backend)
    old.__class__ = OldHook
    buf, told = bytearray(len(data)), []
    assert old.read_head(uri, buf, told.append) == len(data) and told == [len(data)] and bytes(buf) == data


def test_a_small_fpk_load_needs_no_thread_of_the_shared_pool(proxy):
    """The first GET of a load starts on the IO loop from the caller (``Backend.start_read_head``), not
    from a thread of the shared I/O pool that then waits on the loop: each hand-off between threads
    costs tenths of a millisecond on a busy 2-core machine. Shown by a load that completes while every
    thread of that pool is held."""
    import threading

    from ckptio.threads import SHARED_WORKERS, shared_pool

    state, uri = _state(), proxy.uri + "/small.fpk"
    ckptio.dump(state, uri)
    release, held = threading.Event(), threading.Semaphore(0)

    def hold() -> None:
        held.release()
        release.wait(60)

    blockers = [shared_pool().submit(hold) for _ in range(SHARED_WORKERS)]
    try:
        for _ in range(SHARED_WORKERS):
            assert held.acquire(timeout=30)
        out: list = []
        t = threading.Thread(target=lambda: out.append(ckptio.load(uri)), daemon=True)
        t.start()
        t.join(30)
        assert out, "the load waited for a thread of the shared pool"
        assert all(torch.equal(out[0][k], v) for k, v in state.items())
    finally:
        release.set()
        for f in blockers:
            f.result()


def test_start_read_head_futures(proxy):
    """Started at once and not cancellable (a closing reader waits for the buffer it fills); the size is
    told before the future is done, an empty object's by a lookup (S3 answers its range with 416);
    errors come out as ckptio errors."""
    backend, uri = ckptio.resolve(proxy.uri + "/obj.bin")
    data = bytes(range(256)) * 100
    backend.write(uri, data)
    backend.write(uri + "-empty", b"")
    for target, want in ((uri, data), (uri + "-empty", b"")):
        buf, told = bytearray(len(data)), []
        fut = backend.pin_version(target).start_read_head(target, buf, told.append)
        assert not fut.cancel()
        assert fut.result(30) == len(want) and bytes(buf[: len(want)]) == want and told == [len(want)]
        told = []
        assert backend.read_head(target, buf, told.append) == len(want) and told == [len(want)]
    told = []  # a buffer of 0 bytes: no GET, the size (or the error) from a lookup
    assert backend.start_read_head(uri, bytearray(0), told.append).result(30) == 0 and told == [len(data)]
    for buf in (bytearray(10), bytearray(0)):
        fut = backend.start_read_head(uri + "-missing", buf, lambda n: None)
        with pytest.raises(ckptio.NotFoundError, match="obj.bin-missing"):
            fut.result(30)


def test_small_dcp_save_over_a_committed_checkpoint_is_refused_before_any_data(proxy):
    """The check for a committed ``.metadata`` comes first: a refused save uploads nothing and leaves the
    checkpoint as it was."""
    state, uri = _state(), proxy.uri + "/ckpt"
    cd.save(state, uri)
    backend, root = ckptio.resolve(uri)
    before = sorted(i.uri for i in backend.list(root))
    proxy.clear()
    with pytest.raises(ckptio.AlreadyExistsError, match="overwrite=True"):
        cd.save({k: v + 1 for k, v in state.items()}, uri)
    assert len(_data_requests(proxy)) == 1 and proxy.bytes_in == 0, proxy.requests
    assert sorted(i.uri for i in backend.list(root)) == before
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    cd.load(out, uri)
    assert all(torch.equal(out[k], v) for k, v in state.items())


def _thp_always() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[always]" in f.read()
    except OSError:
        return False


@pytest.mark.skipif(
    _thp_always(), reason="transparent huge pages 'always': anonymous memory is faulted in 2 MiB at a time"
)
@pytest.mark.parametrize("n", [6, 100])  # ~96 KiB (under the 256 KiB faulted in first), ~1.6 MiB (over)
def test_a_remote_fpk_load_keeps_no_memory_past_its_object(proxy, n):
    """The caller faults in the first GET's buffer while it waits for the reply (``osio.fault_in_ahead``):
    the tensors returned are views of that buffer, so the pages it faulted in past the object's end would
    stay resident as long as they live. They are given back: none past the object's last page is."""
    import ctypes
    import mmap

    g = torch.Generator().manual_seed(2)
    state = {f"layer{i}.weight": torch.randn(64, 64, generator=g) for i in range(n)}
    uri = proxy.uri + "/resident.fpk"
    ckptio.dump(state, uri)
    size = ckptio.resolve(uri)[0].stat(ckptio.resolve(uri)[1]).size
    out = ckptio.load(uri)
    assert all(torch.equal(out[k], v) for k, v in state.items())
    page = mmap.PAGESIZE
    base = min(t.untyped_storage().data_ptr() for t in out.values()) // page * page  # the buffer's first page
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    pages = -(-size // page)
    past = (4 << 20) // page  # well past the guess, inside the buffer (a part: 64 MiB)
    vec = ctypes.create_string_buffer(past)
    assert libc.mincore(base, past * page, vec) == 0, ctypes.get_errno()
    resident = [b & 1 for b in vec.raw]
    assert all(resident[:pages]) and not any(resident[pages:]), (pages, sum(resident))


def test_a_load_that_reports_progress_reads_no_suffix(s3_proxy, monkeypatch):
    """Counted reads must not overlap: a load with ``progress`` reads the end by offset only."""
    from ckptio.formats.fastpickle import read as fpk_read

    monkeypatch.setattr(fpk_read, "TAIL_EARLY", 0.0)
    g = torch.Generator().manual_seed(9)
    state = {f"w{i}": torch.randn(1 << 20, generator=g) for i in range(3)}
    uri = s3_proxy.uri + "/progress.fpk"
    ckptio.dump(state, uri)
    seen: list[tuple[int, int]] = []
    s3_proxy.clear()
    out = ckptio.load(uri, progress=lambda done, total: seen.append((done, total)))
    assert all(torch.equal(out[k], v) for k, v in state.items())
    assert not [r for r in s3_proxy.requests if r.headers.get("Range", "").startswith("bytes=-")]
    size = ckptio.stat(uri).size
    assert seen and seen[-1] == (size, size)
