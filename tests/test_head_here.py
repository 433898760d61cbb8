"""A GCS load's first GET sent from the caller's thread (ckptio.objectstore.here): one request, the
same checks as on the IO loop, and a failure there is the first attempt of the IO loop's retries."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import ckptio
from ckptio.errors import NotFoundError, TransferError
from ckptio.objectstore import direct as _direct
from faultproxy import Fault


@pytest.fixture
def spy(monkeypatch):
    """The threads that sent a direct GET from their caller and read its body: (kind, thread name)."""
    seen: list[tuple[str, str]] = []
    get_here, fill_here = _direct.DirectGets.get_here, _direct.DirectResponse.fill_here

    def spy_get(self, *a, **kw):
        seen.append(("get", threading.current_thread().name))
        return get_here(self, *a, **kw)

    def spy_fill(self, *a, **kw):
        seen.append(("fill", threading.current_thread().name))
        return fill_here(self, *a, **kw)

    monkeypatch.setattr(_direct.DirectGets, "get_here", spy_get)
    monkeypatch.setattr(_direct.DirectResponse, "fill_here", spy_fill)
    return seen


def _gets(faults) -> list:
    return [r for r in faults.requests if r.method == "GET"]


def test_a_small_load_is_one_get_sent_and_read_on_the_callers_thread(gcs_faults, spy):
    state = {"w": torch.arange(1000, dtype=torch.float32), "step": 7}
    uri = f"{gcs_faults.uri}/small.fpk"
    ckptio.dump(state, uri)
    gcs_faults.clear()
    out = ckptio.load(uri)
    assert torch.equal(out["w"], state["w"]) and out["step"] == 7
    me = threading.current_thread().name
    assert spy == [("get", me), ("fill", me)]
    assert len(_gets(gcs_faults)) == 1 and not gcs_faults.requests[1:]  # no HEAD, no second range


def test_a_larger_object_tells_its_size_here_and_its_body_comes_on_a_worker(gcs_faults, spy):
    b, u = ckptio.resolve(f"{gcs_faults.uri}/big.bin")  # part_size 256 KiB: the head GET is 256 KiB of it
    data = bytes(range(256)) * (3 * 4096 + 7)
    b.write(u, data)
    gcs_faults.clear()
    assert b.read(u) == data
    me = threading.current_thread().name
    assert spy[0] == ("get", me) and spy[1][0] == "fill" and spy[1][1].startswith("ckptio-get")
    assert len(spy) == 2  # the rest of the object: the IO loop's ranged GETs


@pytest.mark.parametrize(
    "fault",
    [
        Fault("status", status=503, method="GET", nth=1),
        Fault("reset", method="GET", nth=1),
        Fault("reset", method="GET", nth=1, before=True),
        Fault("truncate", method="GET", nth=1),
        Fault("stall", method="GET", nth=1, stall=30),
    ],
    ids=["503", "reset", "reset-before", "truncate", "stall"],
)
def test_a_failed_first_get_is_the_first_attempt_of_the_retries(gcs_faults, spy, fault):
    b, u = ckptio.resolve(f"{gcs_faults.uri}/obj.bin")
    b.write(u, b"0123456789" * 100)
    gcs_faults.clear()
    gcs_faults.add(fault)
    assert b.read(u) == b"0123456789" * 100  # retried on the IO loop
    assert gcs_faults.fired() == 1 and len(_gets(gcs_faults)) == 2
    assert spy[0] == ("get", threading.current_thread().name)

    one, _ = ckptio.resolve(u, max_attempts=1)  # the attempt made here is counted: none is left
    gcs_faults.clear()
    gcs_faults.add(Fault(fault.kind, status=fault.status, method="GET", nth=1, before=fault.before, stall=fault.stall))
    with pytest.raises(TransferError, match=r"gave up after 1 attempt\(s\)") as ei:
        one.read(u)
    assert u in str(ei.value) and len(_gets(gcs_faults)) == 1


def test_a_missing_object_is_one_get_and_named(gcs_faults, spy):
    b, u = ckptio.resolve(f"{gcs_faults.uri}/nothing.fpk")
    gcs_faults.clear()
    with pytest.raises(NotFoundError) as ei:
        ckptio.load(u)
    sent = [r.path for r in gcs_faults.requests]
    gcs_faults.clear()
    with pytest.raises(NotFoundError):
        ckptio.load(u, backend_args={"direct_reads": False})
    assert u in str(ei.value) and sent == [r.path for r in gcs_faults.requests], sent  # as on the IO loop


def test_the_attempt_made_here_is_bounded_by_the_per_attempt_timeout(gcs_faults):
    # headers and half the body, then nothing for 300 s: only the per-attempt timeout ends the wait here
    b, u = ckptio.resolve(f"{gcs_faults.uri}/slow.bin")
    b.write(u, b"abcdef")
    gcs_faults.clear()
    one, _ = ckptio.resolve(u, timeout=1.5, stall_timeout=300, read_timeout=300, deadline=600, max_attempts=3)
    gcs_faults.add(Fault("stall", method="GET", nth=1, stall=300))
    t0 = time.monotonic()
    assert one.read(u) == b"abcdef"
    assert gcs_faults.fired() == 1 and time.monotonic() - t0 < 60


def test_the_deadline_runs_from_the_attempt_made_here(gcs_faults):
    b, u = ckptio.resolve(f"{gcs_faults.uri}/late.bin")
    b.write(u, b"abc")
    gcs_faults.clear()
    one, _ = ckptio.resolve(u, max_attempts=1000, deadline=2.0, stall_timeout=0.4)
    gcs_faults.add(Fault("stall", method="GET", fraction=1.0, stall=300))
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="deadline of 2s exceeded"):
        one.read(u)
    assert time.monotonic() - t0 < 2.0 + 30  # a busy machine's bound: without the deadline, minutes


def test_a_pinned_generation_is_asked_for_and_another_refused(gcs_faults, monkeypatch):
    """The emulator sends no generation header (nothing to pin from); a pin given is sent as
    ``generation=``, and a reply of another generation is refused naming the object, without a retry."""
    b, u = ckptio.resolve(f"{gcs_faults.uri}/pinned.bin")
    b.write(u, bytes(1024))
    gcs_faults.clear()
    sizes: list[int] = []
    assert b.pin_version(u, "123").read_head(u, bytearray(4096), sizes.append) == 1024 and sizes == [1024]
    assert "generation=123" in _gets(gcs_faults)[-1].path

    init = _direct.DirectResponse.__init__

    def another_generation(self, *a, **kw):
        init(self, *a, **kw)
        self.headers["x-goog-generation"] = "456"

    monkeypatch.setattr(_direct.DirectResponse, "__init__", another_generation)
    gcs_faults.clear()
    with pytest.raises(Exception, match="456") as ei:
        b.pin_version(u, "123").read_head(u, bytearray(4096), sizes.append)
    assert u in str(ei.value) and len(_gets(gcs_faults)) == 1 and sizes == [1024]


def test_direct_reads_off_keeps_every_get_on_the_io_loop(gcs_faults, spy):
    state = {"w": torch.ones(10)}
    uri = f"{gcs_faults.uri}/off.fpk"
    ckptio.dump(state, uri)
    gcs_faults.clear()
    assert torch.equal(ckptio.load(uri, backend_args={"direct_reads": False})["w"], state["w"])
    assert spy == [] and len(_gets(gcs_faults)) == 1


class _Media:
    """A GCS media server on loopback whose first reply misbehaves: ``trickle`` (headers, then the body
    8 bytes every 50 ms), ``slowhead`` (the status line and headers a byte every 50 ms) or ``trunc``
    (half the body, then the connection closed); later replies are whole."""

    def __init__(self, body: bytes, mode: str) -> None:
        import socket

        self.body, self.mode, self.gets = body, mode, 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(c,), daemon=True).start()

    def _one(self, c) -> None:
        f = c.makefile("rb")
        while f.readline().strip():  # the request line and headers (the whole object is answered)
            pass
        self.gets += 1
        n = len(self.body)
        head = f"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-{n - 1}/{n}\r\nContent-Length: {n}\r\n\r\n"
        mode = self.mode if self.gets == 1 else "ok"
        try:
            if mode == "slowhead":
                for ch in head.encode():
                    c.sendall(bytes([ch]))
                    time.sleep(0.05)
                c.sendall(self.body)
            elif mode == "trickle":
                c.sendall(head.encode())
                for i in range(0, n, 8):
                    time.sleep(0.05)
                    c.sendall(self.body[i : i + 8])
            elif mode == "trunc":
                c.sendall(head.encode() + self.body[: n // 2])
            else:
                c.sendall(head.encode() + self.body)
        except OSError:
            pass
        c.close()

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("mode", ["trickle", "slowhead"])
def test_a_reply_that_trickles_is_ended_by_the_attempts_time(mode):
    """Each read waits at most the stall timeout, but a reply that keeps trickling would never stall: the
    attempt's time (the policy's ``timeout``) ends it, as it ends the IO loop's GET, and the retry reads
    the object."""
    from ckptio.backends.gcs import GCSBackend

    srv = _Media(bytes(range(256)) * 8, mode)  # 2 KiB: ~13 s trickled, ~5 s of headers
    try:
        b = GCSBackend(endpoint_url=srv.url, anon=True, project="t", timeout=1.0, stall_timeout=30, max_attempts=1)
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="attempt's time"):
            b.read_head("gs://bkt/obj", bytearray(4096), lambda n: None)
        assert time.monotonic() - t0 < 4.5 and srv.gets == 1  # not the whole trickle (a busy machine's bound)
        b2 = GCSBackend(endpoint_url=srv.url, anon=True, project="t", timeout=1.0, stall_timeout=30, max_attempts=2)
        srv.gets = 0
        buf = bytearray(4096)
        assert b2.read_head("gs://bkt/obj", buf, lambda n: None) == 2048 and bytes(buf[:2048]) == srv.body
        assert srv.gets == 2
    finally:
        srv.close()


def test_a_token_is_never_in_an_error_and_its_trailing_newline_is_dropped(gcs_endpoint):
    """A credential_provider's token read from a file ends with a newline: sent without it. A token
    http.client refuses as a header value is refused without quoting it."""
    from ckptio.backends.gcs import GCSBackend

    srv = _Media(b"abc", "ok")
    try:
        b = GCSBackend(endpoint_url=srv.url, project="t", anon=True, credential_provider=lambda: "ya29.SECRET\n")
        assert b.read_head("gs://bkt/obj", bytearray(16), lambda n: None) == 3
        bad = GCSBackend(endpoint_url=srv.url, project="t", anon=True, credential_provider=lambda: "ya29.SE\nCRET")
        with pytest.raises(Exception) as ei:
            bad.read_head("gs://bkt/obj", bytearray(16), lambda n: None)
        assert "SE" not in str(ei.value) and "CRET" not in repr(ei.value)
    finally:
        srv.close()


def test_a_body_read_on_a_worker_that_cannot_be_retried_fails_the_read(monkeypatch):
    """The IO loop refusing the retry (closed) after a worker's body failed: the read's future fails with
    that error instead of never ending."""
    import ckptio.objectstore.backend as objectstore_backend
    from ckptio.backends.gcs import GCSBackend

    def refused(loop, coro):  # what ranged.start does on a closed loop
        coro.close()
        raise RuntimeError("Loop is not running")

    monkeypatch.setattr(objectstore_backend, "start", refused)
    srv = _Media(bytes(10000), "trunc")  # larger than the buffer: its body comes on a worker
    try:
        b = GCSBackend(endpoint_url=srv.url, anon=True, project="t")
        fut = b.start_read_head("gs://bkt/obj", bytearray(8192), lambda n: None)  # 5000 bytes come
        with pytest.raises(RuntimeError, match="Loop is not running"):
            fut.result(timeout=30)
    finally:
        srv.close()


def test_the_watchdog_fires_once_and_keeps_no_disarmed_deadlines():
    """Deadlines far ahead (most GETs end long before theirs) are let go when disarmed: the heap stays
    small however many GETs there were; one that comes due fires once, and a disarm after that is a no-op."""
    from ckptio.objectstore.watchdog import Watchdog

    dog = Watchdog()
    fired = threading.Event()
    due = dog.arm(time.monotonic() + 0.05, fired.set)
    far = [dog.arm(time.monotonic() + 600, lambda: None) for _ in range(5000)]
    for entry in far:
        dog.disarm(entry)
    assert len(dog._heap) <= 200
    assert fired.wait(10)
    dog.disarm(due)
    assert dog._disarmed >= 0 and all(e[2] is None for e in far)
    for entry in [dog.arm(time.monotonic() + 600, lambda: None) for _ in range(1000)]:
        dog.disarm(entry)
    assert len(dog._heap) <= 200 and dog._disarmed <= len(dog._heap)


def test_an_endless_deadline_arms_nothing_and_the_watchdog_survives_one():
    """A policy without ``timeout`` and with ``deadline=inf`` (allowed) gives a GET no deadline: nothing is
    armed; a deadline past what a wait can take does not end the watchdog's thread (later GETs keep theirs)."""
    from ckptio.backends.gcs import GCSBackend
    from ckptio.objectstore.watchdog import Watchdog

    dog = Watchdog()
    dog.arm(float("inf"), lambda: None)
    dog.arm(1e12, lambda: None)
    fired = threading.Event()
    dog.arm(time.monotonic() + 0.05, fired.set)
    assert fired.wait(10) and dog._thread is not None and dog._thread.is_alive()

    srv = _Media(b"abc", "ok")
    try:
        b = GCSBackend(endpoint_url=srv.url, anon=True, project="t", deadline=float("inf"))
        assert b.read_head("gs://bkt/obj", bytearray(16), lambda n: None) == 3
    finally:
        srv.close()
    test_a_reply_that_trickles_is_ended_by_the_attempts_time("trickle")  # the shared watchdog still works
