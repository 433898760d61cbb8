"""ckptio.dcp.quiet: torch's DCP log records are skipped while ckptio calls torch's DCP API only when
nothing would receive them; a handler or propagation gets every record; the logger is always turned
back on (errors, nesting, threads)."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
import torch.distributed.checkpoint as tdcp

import ckptio.dcp as cd
from ckptio import torch_internals
from ckptio.dcp.quiet import quiet_dcp_log

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _as_torch_leaves_it(monkeypatch) -> logging.Logger:
    """torch's DCP logger as a plain process has it: one NullHandler, no propagation. Called in each
    test's body: under pytest it also holds the logging plugin's capture handlers, which receive every
    record (they are put back for each test phase)."""
    lg = torch_internals.dcp_logger
    monkeypatch.setattr(lg, "handlers", [logging.NullHandler()])
    monkeypatch.setattr(lg, "propagate", False)
    assert not lg.disabled
    return lg


@pytest.fixture
def built(monkeypatch) -> list[logging.LogRecord]:
    """Every record torch's DCP logger builds (whoever receives it)."""
    lg = torch_internals.dcp_logger
    records: list[logging.LogRecord] = []
    make = lg.makeRecord

    def counting(*args, **kwargs):
        records.append(make(*args, **kwargs))
        return records[-1]

    monkeypatch.setattr(lg, "makeRecord", counting)
    return records


def _state() -> dict[str, torch.Tensor]:
    return {"a": torch.arange(10.0), "b": torch.ones(3, 4)}


def _round_trip(uri: str) -> None:
    cd.save(_state(), uri)
    back = {k: torch.empty_like(v) for k, v in _state().items()}
    cd.load(back, uri)
    assert all(torch.equal(back[k], v) for k, v in _state().items())


def test_records_nobody_receives_are_not_built_and_the_logger_comes_back(tmp_path, built, monkeypatch):
    lg = _as_torch_leaves_it(monkeypatch)
    tdcp.save(_state(), storage_writer=tdcp.FileSystemWriter(str(tmp_path / "torch")))
    assert len(built) > 10  # the probe sees torch's own API building them
    built.clear()
    _round_trip(str(tmp_path / "ckptio"))
    assert built == [] and not lg.disabled


def test_a_handler_or_propagation_gets_every_record(tmp_path, built, monkeypatch):
    lg = _as_torch_leaves_it(monkeypatch)
    got: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            got.append(record)

    handler = Keep()
    lg.addHandler(handler)
    try:
        _round_trip(str(tmp_path / "handled"))
    finally:
        lg.removeHandler(handler)
    assert len(got) > 10 and all(r.levelno == logging.DEBUG for r in got)
    built.clear()
    monkeypatch.setattr(lg, "propagate", True)
    _round_trip(str(tmp_path / "propagated"))
    assert len(built) > 10 and not lg.disabled


def test_the_logger_comes_back_after_errors_nesting_and_overlapping_threads(monkeypatch):
    lg = _as_torch_leaves_it(monkeypatch)
    with pytest.raises(RuntimeError), quiet_dcp_log():
        assert lg.disabled
        raise RuntimeError("inside")
    assert not lg.disabled
    with quiet_dcp_log():
        with quiet_dcp_log():
            assert lg.disabled
        assert lg.disabled  # the outer call is still running
    assert not lg.disabled

    entered, release = threading.Barrier(3), threading.Event()
    seen: list[bool] = []

    def worker(hold: bool) -> None:
        with quiet_dcp_log():
            entered.wait()
            if hold:
                release.wait()
            seen.append(lg.disabled)

    threads = [threading.Thread(target=worker, args=(h,)) for h in (False, True)]
    for t in threads:
        t.start()
    entered.wait()  # both inside
    threads[0].join()  # the first left: the second is still inside, so still quiet
    assert lg.disabled
    release.set()
    threads[1].join()
    assert seen == [True, True] and not lg.disabled
