"""``ckptio bench`` and every other benchmark of the project, shipped with the package so they run
where users need them (their cluster, their bucket, no clone); ``benchmarks/`` holds only thin entry
points (``python -m benchmarks.NAME``).

Nothing here is imported by ``import ckptio``; the ``ckptio bench`` command imports
:mod:`ckptio.bench.throughput` on use. The optional packages (matplotlib, moto, gcp-storage-emulator,
psutil, tqdm, safetensors) are the ``bench`` extra (``pip install 'ckptio[bench]'``), s3torchconnector
the ``peers`` extra; without one, the part that needs it is left out and listed under "not measured".
The throughput benchmark: ``throughput`` (the command), ``targets`` (storages), ``impls`` (ckptio and
the baselines), ``peers`` (s3torchconnector, s3fs's single PUT), ``measure`` (timing, RSS, the
interleaved matrix), ``report`` (summary, table, machine), ``chart``, ``workload``, ``servers`` (moto
and the GCS emulator on loopback), ``proxy`` (latency and bandwidth of a remote store, on loopback),
``heap``, ``busy`` (CPU hogs). Focused benchmarks: ``fastpickle``, ``dcp``, ``transfer``, ``cache``,
``safetensors``, ``checkpointer``, ``incremental``, ``tiered``, ``load_into``, ``floors``. Nothing in
this package imports ``tests/`` or ``benchmarks/``.
"""
