"""Moved to :mod:`ckptio.bench.heap`; kept so older scripts importing ``benchmarks._heap`` still run."""

from ckptio.bench.heap import trim_heap  # noqa: F401
