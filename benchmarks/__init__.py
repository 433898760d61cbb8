"""ckptio benchmarks: ``python -m benchmarks.throughput`` (or ``ckptio bench``). See benchmarks/README.md."""
