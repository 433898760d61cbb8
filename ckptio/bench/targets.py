"""The storages ``ckptio bench`` measures: a temporary local directory, ``memory://``, S3 (moto)
and GCS (the emulator) started on loopback, and the user's own URIs. A column whose packages are
missing is left out with a note naming what to install."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import uuid
from collections.abc import Callable, Iterator

import ckptio
from ckptio import uri as _uri
from ckptio.errors import MissingDependencyError

from .impls import backend_raw_baseline, ckptio_impls, fsspec_baselines, local_baselines, memory_baselines
from .measure import Target
from .peers import s3_peers, s3fs_put_baseline
from .servers import GCSEmulator, MotoServer, ProxyServer, Server, make_gcs_bucket, make_s3_bucket

EMBEDDED = ("local", "memory", "s3", "gcs")
S3_CREDS = {"access_key_id": "bench", "secret_access_key": "bench", "region": "us-east-1"}
BENCH_HINT = "pip install 'ckptio[bench]'"
Wan = tuple[float, float]  # (first-byte latency in s, bandwidth per connection in bytes/s)


def _require(module: str, hint: str) -> None:
    """Raise :class:`MissingDependencyError` naming ``hint`` when ``module`` cannot be imported."""
    if importlib.util.find_spec(module) is None:
        raise MissingDependencyError(f"the {module} package is not installed: {hint}")


def has_format(ext: str) -> bool:
    try:
        ckptio.registry.formats.find("x" + ext)
        return True
    except ckptio.UnknownFormatError:
        return False


def has_dcp() -> bool:
    try:
        from ckptio import dcp  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def embedded_targets(
    names: list[str],
    tmp: str,
    log: Callable[[str], None],
    quick: bool = False,
    wan: Wan | None = None,
    moto_as_is: bool = False,
) -> Iterator[list[Target]]:
    """The embedded storages ``names``; with ``wan`` (latency s, bandwidth B/s), S3 and GCS are reached
    through a :class:`~ckptio.bench.servers.ProxyServer` that adds them. moto serves ranged GETs from the
    range, as S3 does (:mod:`ckptio.bench.moto_ranges`), unless ``moto_as_is``."""
    mine = ckptio_impls(has_format(".fpk"), has_dcp())
    targets: list[Target] = []
    with contextlib.ExitStack() as stack:
        for name in names:
            if name == "local":
                d = os.path.join(tmp, "local")
                os.makedirs(d, exist_ok=True)
                notes = []
                if importlib.util.find_spec("safetensors") is None:
                    notes.append(
                        {
                            "impl": "safetensors",
                            "reason": f"baseline left out: the safetensors package is not installed ({BENCH_HINT})",
                        }
                    )
                targets.append(Target("local", d, mine + local_baselines(), local_dir=d, notes=notes))
            elif name == "memory":
                targets.append(Target("memory", f"memory://bench-{uuid.uuid4().hex[:8]}", mine + memory_baselines()))
            elif name in ("s3", "gcs"):
                try:
                    targets.append(stack.enter_context(_server_target(name, log, quick, wan, moto_as_is)))
                except Exception as e:  # noqa: BLE001 - a server that cannot start skips the column with a note
                    why = str(e) if isinstance(e, MissingDependencyError) else f"{type(e).__name__}: {e}"
                    log(f"skipping {name}: {why}")
                    targets.append(Target(name, "", [], notes=[{"impl": "*", "reason": why}]))
            else:
                raise SystemExit(f"unknown backend {name!r}; choose from {', '.join(EMBEDDED)} or pass --uri")
        yield targets


@contextlib.contextmanager
def _endpoint(srv: Server, wan: Wan | None, log: Callable[[str], None]) -> Iterator[str]:
    """The server's URL, or that of a latency proxy in front of it."""
    if wan is None:
        yield srv.url
        return
    with ProxyServer(srv.url, *wan) as proxy:
        log(f"  through a loopback proxy on {proxy.url} (its own process): {proxy.describe()}")
        yield proxy.url


@contextlib.contextmanager
def _server_target(
    name: str, log: Callable[[str], None], quick: bool = False, wan: Wan | None = None, moto_as_is: bool = False
) -> Iterator[Target]:
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    mine = ckptio_impls(has_format(".fpk"), has_dcp())
    if name == "s3":
        _require("s3fs", "pip install 'ckptio[bench,s3]'")
        import s3fs

        # an object store's ranged GET costs what its range does; moto's own costs what the whole object does
        with MotoServer(ranged_reads=not moto_as_is) as srv, _endpoint(srv, wan, log) as url:
            make_s3_bucket(srv.url, bucket)
            log(f"S3 API server (moto{' as is' if moto_as_is else ', ranged GETs read only their range'}) on {srv.url}")
            ckptio.configure(backends={"s3": {"endpoint_url": url, **S3_CREDS}})
            opts = {
                "key": S3_CREDS["access_key_id"],
                "secret": S3_CREDS["secret_access_key"],
                "client_kwargs": {"endpoint_url": url, "region_name": "us-east-1"},
            }
            fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
            peers, notes = s3_peers(url, S3_CREDS["access_key_id"], S3_CREDS["secret_access_key"])
            impls = mine + fsspec_baselines(fs, "s3", opts) + [s3fs_put_baseline(fs)] + peers
            yield Target("s3", f"s3://{bucket}", impls, notes=notes)
    else:
        import logging

        _require("gcsfs", "pip install 'ckptio[bench,gcs]'")
        import gcsfs

        logging.getLogger("gcsfs").setLevel(logging.CRITICAL)  # it logs tracebacks for the emulator's missing moveTo
        with GCSEmulator() as gcs, _endpoint(gcs, wan, log) as url:
            make_gcs_bucket(gcs.url, bucket)
            log(f"GCS emulator on {gcs.url}")
            ckptio.configure(backends={"gcs": {"endpoint_url": url, "anon": True, "project": "bench"}})
            opts = {"token": "anon", "project": "bench", "endpoint_url": url}
            fs = gcsfs.GCSFileSystem(skip_instance_cache=True, **opts)
            impls, notes = mine + fsspec_baselines(fs, "gs", opts), []
            if quick:  # the emulator has no moveTo API: gcsfs renames by copy + delete, ~30 s for 32 MiB here
                impls = [i for i in impls if i.name != "torch DCP FsspecWriter"]
                notes.append(
                    {
                        "impl": "torch DCP FsspecWriter",
                        "reason": "left out of --quick: the GCS emulator "
                        "has no rename (moveTo) API, so gcsfs falls back to copy + delete and one save takes "
                        "tens of seconds; --full or --sizes includes it",
                    }
                )
            yield Target("gcs", f"gs://{bucket}", impls, notes=notes)


def user_targets(uris: list[str]) -> list[Target]:
    mine = ckptio_impls(has_format(".fpk"), has_dcp())
    out = []
    for u in uris:
        _, resolved = ckptio.resolve(u)
        local = resolved.removeprefix("file://") if _uri.scheme_of(resolved) in ("", "file") else None
        impls = mine + [backend_raw_baseline()]
        out.append(Target(u.rstrip("/"), u.rstrip("/"), impls, local_dir=local))
    return out
