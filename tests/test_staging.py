"""Async staging (ckptio.checkpointer.staging._Stager): the snapshot is byte-exact for every dtype and layout,
independent of the source, and its buffers are reused across saves. No timing is asserted here:
benchmarks/checkpointer_bench.py --busy measures it."""

from __future__ import annotations

import pytest
import torch

from ckptio.checkpointer import Checkpointer, staging
from ckptio.checkpointer.staging import _dense, _Stager

DTYPES = [
    d
    for d in (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint8,
        getattr(torch, "uint16", None),
        getattr(torch, "uint32", None),
        getattr(torch, "uint64", None),
        torch.bool,
        torch.complex64,
        torch.complex128,
        getattr(torch, "float8_e4m3fn", None),
        getattr(torch, "float8_e5m2", None),
    )
    if d is not None
]


def random(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random bytes of ``dtype`` (NaN payloads included); bools are 0/1."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g, dtype=torch.uint8).bool()
    size = torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (n * size,), generator=g, dtype=torch.uint8).view(dtype).reshape(shape)


def raw(t: torch.Tensor) -> bytes:
    """The logical bytes of ``t`` (conjugate/negative views resolved), in row-major order."""
    t = t.resolve_conj().resolve_neg().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def assert_exact(staged: torch.Tensor, src: torch.Tensor) -> None:
    assert staged.dtype == src.dtype and staged.shape == src.shape and staged.device.type == "cpu"
    assert raw(staged) == raw(src)
    if src.numel():
        assert staged.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()


@pytest.mark.parametrize("torch_copy", [False, True], ids=["memmove", "copy_"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_staged_copy_is_exact_for_every_dtype(dtype, torch_copy):
    st = _Stager()
    st.torch_copy = torch_copy
    src = {"big": random((3, 1 << 19), dtype), "small": random((5,), dtype, 1), "scalar": random((), dtype, 2)}
    out = st.stage(src)
    for k, v in src.items():
        assert_exact(out[k], v)


def layouts() -> dict[str, torch.Tensor]:
    base = random((6, 8, 4), torch.float32)
    c = random((4, 6), torch.complex64, 3)
    return {
        "contiguous": base,
        "sliced": base[:, ::2],  # gaps: copy_
        "transposed": base.transpose(0, 2),  # dense, permuted: one memmove into a same-strided buffer
        "channels_last": random((2, 3, 5, 7), torch.float32, 4).to(memory_format=torch.channels_last),
        "expanded": torch.arange(4.0).expand(3, 4),  # stride 0
        "offset": base.reshape(-1)[7:100],  # a view starting inside its storage
        "size1_odd_stride": torch.arange(12.0).reshape(12, 1)[3:4],
        "empty": torch.empty(0, 5),
        "empty_strided": torch.empty(3, 0).t(),
        "scalar": torch.tensor(3.5),
        "conj": c.conj(),
        "neg": c.conj().imag,
        "requires_grad": torch.randn(4, 4, requires_grad=True),
    }


@pytest.mark.parametrize("torch_copy", [False, True], ids=["memmove", "copy_"])
def test_staged_copy_is_exact_for_every_layout(torch_copy):
    st = _Stager()
    st.torch_copy = torch_copy
    src = layouts()
    out = st.stage(src)
    for k, v in src.items():
        assert_exact(out[k], v.detach())
        assert not out[k].requires_grad and not out[k].is_conj() and not out[k].is_neg(), k
    if not torch_copy:  # dense tensors keep their layout, as a synchronous save sees them
        assert out["transposed"].stride() == src["transposed"].stride()
        assert out["channels_last"].is_contiguous(memory_format=torch.channels_last)
    assert out["sliced"].is_contiguous()


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_chunked_parallel_copy_is_exact(threads, monkeypatch):
    monkeypatch.setattr(staging, "_CHUNK", 4096 + 8)  # many chunks, ragged ends
    monkeypatch.setattr(staging, "_PARALLEL_MIN", 0)
    src = [
        random((n,), d, n)
        for n, d in [(1, torch.uint8), (50_001, torch.float64), (3, torch.bool), (9999, torch.bfloat16)]
    ]
    dst = [torch.zeros_like(t) for t in src]
    staging._memmove_all(list(zip(dst, src, strict=True)), threads)
    for d, t in zip(dst, src, strict=True):
        assert raw(d) == raw(t)


def test_dense():
    src = layouts()
    assert {k for k, v in src.items() if not _dense(v)} == {"sliced", "expanded", "neg"}  # neg: a complex's .imag


def test_views_sharing_storage_are_staged_independently():
    base = random((64, 64), torch.float32)
    src = {"all": base, "rows": base[10:20], "col": base[:, 3], "flat": base.view(-1)[5:4000]}
    st = _Stager()
    out = st.stage(src)
    expected = {k: raw(v) for k, v in src.items()}
    base.fill_(7.0)  # the snapshot does not follow the source
    for k in src:
        assert raw(out[k]) == expected[k], k
    out["all"].zero_()  # nor do the staged copies alias one another
    assert raw(out["rows"]) == expected["rows"]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_quantized_and_subclass_tensors_are_cloned_exactly():
    q = torch.quantize_per_tensor(torch.randn(16, 16), 0.05, 3, torch.quint8)
    qc = torch.quantize_per_channel(
        torch.randn(4, 8), torch.rand(4) + 0.1, torch.zeros(4, dtype=torch.long), 0, torch.qint8
    )
    sparse = torch.randn(6, 6).relu().to_sparse()
    st = _Stager()
    out = st.stage({"q": q, "qc": qc, "sparse": sparse})
    assert torch.equal(out["q"].int_repr(), q.int_repr()) and out["q"].q_scale() == q.q_scale()
    assert out["q"].q_zero_point() == q.q_zero_point()
    assert torch.equal(out["qc"].int_repr(), qc.int_repr())
    assert torch.equal(out["qc"].q_per_channel_scales(), qc.q_per_channel_scales())
    assert torch.equal(out["sparse"].to_dense(), sparse.to_dense())
    assert not st._bufs  # cloned, not pooled


def test_buffers_are_reused_and_refreshed_across_saves():
    st = _Stager()
    src = {"w": random((256, 1024), torch.float32), "t": random((32, 16), torch.bfloat16).t(), "n": [torch.ones(3)]}
    out1 = st.stage(src)
    ptrs = {k: b.data_ptr() for k, b in st._bufs.items()}
    assert st.nbytes == 256 * 1024 * 4 + 32 * 16 * 2 + 3 * 4
    with torch.no_grad():
        src["w"].add_(1.0)
        src["t"].mul_(2)
        src["n"][0].fill_(5)
    out2 = st.stage(src)
    assert {k: b.data_ptr() for k, b in st._bufs.items()} == ptrs  # reused, not reallocated
    assert out2["w"] is out1["w"]
    assert_exact(out2["w"], src["w"])
    assert_exact(out2["t"], src["t"])
    assert_exact(out2["n"][0], src["n"][0])
    src["w"] = src["w"].double()  # dtype change: a new buffer; the old one is dropped
    src["t"] = src["t"].contiguous()  # layout change: a new buffer with the new strides
    out3 = st.stage(src)
    assert st._bufs[("w",)].data_ptr() != ptrs[("w",)] and out3["w"].dtype == torch.float64
    assert out3["t"].stride() == src["t"].stride()
    assert_exact(out3["w"], src["w"])
    assert_exact(out3["t"], src["t"])


@pytest.mark.parametrize("fmt", ["fpk", "pt"])
def test_async_save_round_trips_every_layout(fmt, memory_uri):
    src = {k: v.detach() for k, v in layouts().items() if k not in ("conj", "neg")}
    src["bf16"] = random((33, 7), torch.bfloat16)
    src["complex"] = random((9,), torch.complex128)
    src["bool"] = random((17,), torch.bool)
    ck = Checkpointer(memory_uri, format=fmt, async_save=True)
    for step in (1, 2):  # the second save reuses the staging buffers
        expected = {k: raw(v) for k, v in src.items()}
        ck.save(step, {"s": src})
        src["contiguous"].add_(1.0)  # mutated right after save returns: the checkpoint keeps the snapshot
        src["transposed"].mul_(2.0)
        ck.wait()
        dst: dict = {"s": dict.fromkeys(src)}
        ck.load(dst, step=step)
        for k, v in expected.items():
            assert raw(dst["s"][k]) == v, (step, k)
    ck.close()


def _trained() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 8)).sum().backward()
    opt.step()  # optimizer state exists: the template has every tensor the save stages
    return {"model": model, "optim": opt}


def _loaded(ck: Checkpointer, step: int, like: dict) -> dict:
    fresh = _trained()
    ck.load(fresh, step=step)
    return {k: v.clone() for k, v in fresh["model"].state_dict().items()}


@pytest.mark.parametrize("fmt", ["fpk", "dcp"])
def test_first_save_after_prepare_reuses_the_prepared_buffers(fmt, memory_uri):
    state = _trained()
    ck = Checkpointer(memory_uri, format=fmt, async_save=True)
    ck.prepare(state)
    ck.wait()
    prepared = ck._stager.allocations
    ptrs = {k: b.data_ptr() for k, b in ck._stager._bufs.items()}
    assert prepared > 0 and ck._stager.nbytes > 0
    ck.save(1, state)
    assert ck._stager.allocations == prepared  # the save allocated nothing
    assert {k: b.data_ptr() for k, b in ck._stager._bufs.items()} == ptrs
    expected = {k: v.clone() for k, v in state["model"].state_dict().items()}
    with torch.no_grad():
        for p in state["model"].parameters():
            p.add_(1.0)  # after save returns: the checkpoint keeps the snapshot
    ck.wait()
    got = _loaded(ck, 1, state)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    ck.close()


def test_prepare_racing_a_save_is_safe(memory_uri, monkeypatch):
    import time

    real = _Stager.prepare

    def slow(self, tree):  # the save below starts while the prepare is still allocating
        time.sleep(0.2)
        real(self, tree)

    monkeypatch.setattr(_Stager, "prepare", slow)
    state = _trained()
    ck = Checkpointer(memory_uri, format="fpk", async_save=True)
    ck.prepare(state)
    expected = {k: v.clone() for k, v in state["model"].state_dict().items()}
    ck.save(1, state)
    allocated = ck._stager.allocations
    with torch.no_grad():
        for p in state["model"].parameters():
            p.mul_(3.0)
    ck.prepare(state)  # again while the save persists: it waits, then allocates nothing new
    ck.save(2, state)
    assert ck._stager.allocations == allocated
    ck.wait()
    got = _loaded(ck, 1, state)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    got = _loaded(ck, 2, state)
    assert all(torch.equal(got[k], v) for k, v in state["model"].state_dict().items())
    ck.close()


def test_a_state_whose_shapes_changed_after_prepare_saves_exactly(memory_uri):
    ck = Checkpointer(memory_uri, format="pt", async_save=True)
    ck.prepare({"s": {"a": torch.zeros(4, 4), "b": torch.zeros(3), "gone": torch.zeros(2)}})
    src = {
        "a": random((8, 2), torch.float32, 1),  # same numel, other shape
        "b": random((3,), torch.float64, 2),  # other dtype
        "t": random((6, 5), torch.bfloat16, 3).t(),  # new, transposed
    }
    expected = {k: raw(v) for k, v in src.items()}
    ck.save(1, {"s": src})
    ck.wait()
    assert set(ck._stager._bufs) == {("s", k) for k in src}  # the prepared buffer nothing uses is dropped
    dst: dict = {"s": dict.fromkeys(src)}
    ck.load(dst, step=1)
    assert {k: raw(v) for k, v in dst["s"].items()} == expected
    ck.close()


def test_prepare_errors_are_raised_and_need_async(memory_uri, monkeypatch):
    with pytest.raises(ValueError, match="async_save=True"):
        Checkpointer(memory_uri, format="pt").prepare({"w": torch.zeros(2)})

    def fail(self, tree):
        raise MemoryError("no room for staging buffers")

    monkeypatch.setattr(_Stager, "prepare", fail)
    ck = Checkpointer(memory_uri, format="pt", async_save=True)
    ck.prepare({"w": torch.zeros(2)})
    with pytest.raises(MemoryError, match="no room"):
        ck.save(1, {"w": torch.zeros(2)})
    ck.save(1, {"w": torch.ones(2)})  # the error was raised once; saving works after it
    ck.close()
