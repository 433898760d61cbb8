"""ckptio.load_into and Checkpointer.load reading tensor bytes straight into existing tensors."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import ckptio
from ckptio.errors import IntegrityError


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    o = torch.optim.Adam(m.parameters())
    m(torch.randn(4, 64)).sum().backward()
    o.step()
    return m, o


def _ptrs(m: torch.nn.Module, o: torch.optim.Optimizer) -> list[int]:
    return [p.data_ptr() for p in m.parameters()] + [
        t.data_ptr() for s in o.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim()
    ]


def _same(a: tuple[torch.nn.Module, torch.optim.Optimizer], b: tuple[torch.nn.Module, torch.optim.Optimizer]) -> bool:
    sa, sb = a[1].state_dict()["state"], b[1].state_dict()["state"]
    return all(torch.equal(x, y) for x, y in zip(a[0].parameters(), b[0].parameters(), strict=True)) and all(
        torch.equal(sa[k][n], sb[k][n]) for k in sa for n in sa[k]
    )


@pytest.mark.parametrize("where", ["local", "memory", "s3"])
def test_module_and_optimizer_are_filled_in_place(tmp_path, where, request):
    root = {"local": str(tmp_path), "memory": "memory://li"}.get(where) or request.getfixturevalue("s3_uri")
    uri = f"{root}/ck.fpk"
    saved = _trained(0)
    ckptio.dump({"model": saved[0].state_dict(), "optim": saved[1].state_dict(), "step": 7, "extra": [1, 2]}, uri)
    m, o = _trained(1)
    before = _ptrs(m, o)
    state = {"model": m, "optim": o, "step": 0, "extra": None}
    res = ckptio.load_into(state, uri)
    assert (res.missing_keys, res.unexpected_keys) == ([], [])
    assert _same(saved, (m, o)) and state["step"] == 7 and state["extra"] == [1, 2]
    assert _ptrs(m, o) == before  # the same memory, filled


def test_autograd_sees_the_in_place_write(tmp_path):
    # bytes written behind autograd's back still count as an in-place change: a graph that saved the
    # old values fails on backward instead of computing gradients from overwritten memory
    uri = str(tmp_path / "w.fpk")
    ckptio.dump({"w": torch.ones(4)}, uri)
    w = torch.zeros(4, requires_grad=True)
    y = (w * w).sum()  # saves w for backward
    ckptio.load_into({"w": w}, uri)
    assert torch.equal(w.detach(), torch.ones(4))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_tensors_are_read_into_target_memory_not_copied(tmp_path, monkeypatch):
    # the proof that bytes land in the target: no fresh payload buffer is allocated and no copy_ runs
    uri = str(tmp_path / "t.fpk")
    ckptio.dump({"a": torch.arange(1000.0), "b": torch.ones(3, 5, dtype=torch.bfloat16)}, uri)
    target = {"a": torch.zeros(1000), "b": torch.zeros(3, 5, dtype=torch.bfloat16)}
    sizes: list[int] = []
    real_empty = torch.empty

    def counting_empty(*args, **kwargs):
        sizes.append(args[0] if args and isinstance(args[0], int) else -1)
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", counting_empty)  # what the .fpk reader allocates payloads with
    ckptio.load_into(target, uri)
    assert sizes == []
    assert torch.equal(target["a"], torch.arange(1000.0)) and torch.equal(
        target["b"], torch.ones(3, 5, dtype=torch.bfloat16)
    )


def test_what_cannot_be_filled_in_place_is_still_restored(tmp_path):
    uri = str(tmp_path / "t.fpk")
    w = torch.randn(6, 4)
    shared = torch.randn(10)
    saved = {
        "shape": torch.randn(4, 4),
        "dtype": torch.randn(8),
        "transposed": torch.randn(3, 5),
        "tied1": w,
        "tied2": w,
        "view": shared[2:6],  # not the whole of its storage
        "full": shared,
        "n": 3,
    }
    ckptio.dump(saved, uri)
    wt = torch.zeros(6, 4)
    target = {
        "shape": torch.zeros(2, 8),
        "dtype": torch.zeros(8, dtype=torch.float64),
        "transposed": torch.zeros(5, 3).t(),  # not contiguous: copied in
        "tied1": wt,
        "tied2": wt,  # one memory for two keys: filled once
        "view": torch.zeros(4),
        "full": torch.zeros(10),
        "n": 0,
    }
    keep = {k: v for k, v in target.items() if isinstance(v, torch.Tensor)}
    ckptio.load_into(target, uri)
    for k in ("transposed", "tied1", "tied2", "view", "full"):
        assert target[k] is keep[k] and torch.equal(target[k], saved[k]), k
    # a tensor of another shape or dtype is replaced by the stored one (the Checkpointer's rules)
    assert target["shape"] is not keep["shape"] and torch.equal(target["shape"], saved["shape"])
    assert target["dtype"].dtype == torch.float32 and torch.equal(target["dtype"], saved["dtype"])
    assert target["n"] == 3


def test_strict_names_the_keys_and_non_strict_reports_them(tmp_path):
    uri = str(tmp_path / "t.fpk")
    ckptio.dump({"a": torch.ones(3), "extra": 1}, uri)
    with pytest.raises(KeyError, match=r"missing keys \['b'\].*unexpected keys \['extra'\]"):
        ckptio.load_into({"a": torch.zeros(3), "b": 2}, uri)
    target = {"a": torch.zeros(3), "b": 2}
    res = ckptio.load_into(target, uri, strict=False)
    assert res.missing_keys == ["b"] and res.unexpected_keys == ["extra"]
    assert torch.equal(target["a"], torch.ones(3)) and target["extra"] == 1
    with pytest.raises(TypeError, match="keys= and mmap="):
        ckptio.load_into(target, uri, keys=["a"])


def test_a_damaged_payload_fails_with_an_integrity_error_naming_the_file(tmp_path):
    uri = str(tmp_path / "t.fpk")
    ckptio.dump({"a": torch.arange(4096.0)}, uri)
    data = bytearray(open(uri, "rb").read())
    pos = data.find(torch.arange(4096.0)[100:104].numpy().tobytes())
    data[pos] ^= 0xFF
    open(uri, "wb").write(bytes(data))
    with pytest.raises(IntegrityError, match=r"t\.fpk.*checksum"):
        ckptio.load_into({"a": torch.zeros(4096)}, uri)


def test_other_formats_restore_by_copy(tmp_path):
    m, o = _trained(0)
    for name in ("ck.pt", "ck.safetensors"):
        uri = str(tmp_path / name)
        ckptio.dump(m.state_dict(), uri)
        m2, _ = _trained(1)
        ptr = m2[0].weight.data_ptr()
        ckptio.load_into(m2, uri)
        assert m2[0].weight.data_ptr() == ptr and torch.equal(m2[0].weight, m[0].weight)


@pytest.mark.parametrize("incremental", [False, True])
def test_checkpointer_load_fills_the_state_in_place(tmp_path, incremental):
    m, o = _trained(0)
    ck = ckptio.Checkpointer(str(tmp_path / "run"), format="fpk", incremental=incremental)
    ck.save(3, {"model": m, "optim": o})
    m2, o2 = _trained(1)
    before = _ptrs(m2, o2)
    assert ck.load({"model": m2, "optim": o2}) == 3
    assert _same((m, o), (m2, o2)) and _ptrs(m2, o2) == before
    ck.close()


_RSS_CHILD = textwrap.dedent(
    """
    import sys, torch, ckptio

    def status(field):  # KiB
        return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(field + ":"))

    mode, uri = sys.argv[1], sys.argv[2]
    n = 256  # MiB of float32 tensors, 4 MiB each
    target = {f"t{i}": torch.zeros(1 << 20) for i in range(n // 4)}
    for t in target.values():
        t.fill_(1.0)  # touched: the memory is resident before the baseline
    torch.manual_seed(0)
    ckptio.load(uri, keys=["t0"])  # imports and first-use allocations before the baseline
    open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) starts again from what is resident now
    base = status("VmRSS")
    if mode == "into":
        ckptio.load_into(target, uri)
    else:
        loaded = ckptio.load(uri)
        for k, v in loaded.items():
            target[k].copy_(v)
    assert all(float(t[5]) == i for i, t in enumerate(target.values()))
    print((status("VmHWM") - base) // 1024)  # extra peak, MiB
    """
)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_extra_peak_memory_of_load_into_is_small(tmp_path, where, request):
    """Extra peak RSS of restoring 256 MiB in place: at most 64 MiB (a load and copy takes 256 MiB more);
    from S3 the ranged GETs stream straight into the tensors (scatter reads), nothing staged."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if where == "local":
        uri = str(tmp_path / "big.fpk")
    else:
        from conftest import S3_TEST_OPTIONS

        uri = request.getfixturevalue("s3_uri") + "/big.fpk"
        s3 = {"endpoint_url": request.getfixturevalue("s3_endpoint"), **S3_TEST_OPTIONS}
        env.update({f"CKPTIO_S3_{k.upper()}": str(v) for k, v in s3.items()})
    ckptio.dump({f"t{i}": torch.full((1 << 20,), float(i)) for i in range(64)}, uri)
    extra = {}
    for mode in ("into", "copy"):
        out = subprocess.run(
            [sys.executable, "-c", _RSS_CHILD, mode, uri],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert out.returncode == 0, out.stderr
        extra[mode] = int(out.stdout.split()[-1])
    assert extra["into"] <= 64, extra
    assert extra["copy"] >= 200, extra  # the measurement can see a second copy
