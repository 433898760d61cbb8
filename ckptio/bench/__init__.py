"""``ckptio bench``: the throughput benchmark, shipped with the package so it runs where users need it
(their cluster, their bucket, no clone).

Nothing here is imported by ``import ckptio``; the ``ckptio bench`` command imports
:mod:`ckptio.bench.throughput` on use. The optional packages (matplotlib, moto, gcp-storage-emulator,
psutil, tqdm, safetensors) are the ``bench`` extra: ``pip install 'ckptio[bench]'``; without one,
the part that needs it is left out and listed under "not measured". Modules: ``throughput`` (the
command), ``targets`` (storages), ``impls`` (ckptio and the baselines), ``measure`` (timing, RSS,
the interleaved matrix), ``report`` (table, chart, machine), ``workload``, ``servers`` (moto and
the GCS emulator on loopback), ``heap``. Nothing in this package imports ``tests/`` or ``benchmarks/``;
the scripts in ``benchmarks/`` import their shared helpers from here.
"""
