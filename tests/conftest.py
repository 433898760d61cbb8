"""Shared fixtures: real S3 (moto) and GCS (emulator) servers on loopback, one fresh bucket per test.

URI fixtures return a root URI (no trailing slash) that plain ``s3://``/``gs://`` URIs route to
the test servers: ``s3_uri``, ``gcs_uri``, ``memory_uri``, ``local_uri``, ``fsspec_uri`` (fsspec's
memory filesystem under the ``fstest://`` scheme), ``user_uri`` (a minimal backend registered
with the decorator) and ``any_uri``, parametrized over all of them. ``s3_proxy``/``gcs_proxy``
route through a :class:`servers.CountingProxy` that records what the server saw.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

# before anything imports gcsfs: without it gcsfs 2026.x stalls a minute per call on the emulator
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
_ENV_DEFAULTS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}
for _k, _v in _ENV_DEFAULTS.items():
    os.environ.setdefault(_k, _v)
# the developer's AWS settings (a profile, request_checksum_calculation for R2/MinIO...) must not change the tests
for _k in (
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_REQUEST_CHECKSUM_CALCULATION",
    "AWS_RESPONSE_CHECKSUM_VALIDATION",
):
    os.environ.pop(_k, None)
os.environ["AWS_CONFIG_FILE"] = os.environ["AWS_SHARED_CREDENTIALS_FILE"] = os.devnull

sys.path.insert(0, os.path.dirname(__file__))

import fsspec  # noqa: E402
from fsspec.implementations.memory import MemoryFileSystem  # noqa: E402

import ckptio  # noqa: E402
from ckptio.backends.base import Backend, BufferedWriter, ObjectInfo, check_mode  # noqa: E402
from ckptio.errors import AlreadyExistsError, NotFoundError  # noqa: E402
from servers import CountingProxy, GCSEmulator, MotoServer, make_gcs_bucket, make_s3_bucket  # noqa: E402

# fixtures defined next to their helpers, for every test module: faults, s3_faults, gcs_faults
# (faultproxy.py), loader (fpk_crafting.py); per-file progress lines (progress.py)
pytest_plugins = ["faultproxy", "fpk_crafting", "progress"]

S3_TEST_OPTIONS = {"access_key_id": "testing", "secret_access_key": "testing", "region": "us-east-1"}


# ---- a user backend and an fsspec protocol, registered the way users would ---------------------


@ckptio.register_backend("userdict", prefixes=["userdict://"], force=True)
class UserDictBackend(Backend):
    """Only the five required methods: everything else comes from the base class."""

    store: dict[str, tuple[bytes, int]] = {}
    _gen = 0
    _lock = threading.Lock()

    def read_range(self, uri: str, start: int = 0, end: int | None = None) -> bytes:
        if uri not in self.store:
            raise NotFoundError(uri)
        return self.store[uri][0][start:end]

    def open_writer(self, uri: str, *, mode: str = "overwrite", durable: bool = True) -> BufferedWriter:
        check_mode(mode)

        def commit(data: bytes) -> None:
            with self._lock:
                if mode == "create" and uri in self.store:
                    raise AlreadyExistsError(uri)
                type(self)._gen += 1
                self.store[uri] = (data, self._gen)

        return BufferedWriter(uri, commit)

    def stat(self, uri: str) -> ObjectInfo:
        if uri in self.store:
            data, gen = self.store[uri]
            return ObjectInfo(uri, len(data), time.time(), str(gen))
        if any(k.startswith(uri.rstrip("/") + "/") for k in self.store):
            return ObjectInfo(uri, 0, None, None, is_dir=True)
        raise NotFoundError(uri)

    def list(self, uri: str, *, recursive: bool = False) -> Iterator[ObjectInfo]:
        prefix = uri.rstrip("/") + "/"
        dirs = set()
        for k in sorted(self.store):
            if not k.startswith(prefix):
                continue
            rest = k[len(prefix) :]
            if "/" in rest and not recursive:
                d = prefix + rest.split("/", 1)[0]
                if d not in dirs:
                    dirs.add(d)
                    yield ObjectInfo(d, 0, None, None, True)
            else:
                yield self.stat(k)

    def delete(self, uri: str) -> None:
        if self.store.pop(uri, None) is None:
            raise NotFoundError(uri)


class FsTestFileSystem(MemoryFileSystem):
    """fsspec's memory filesystem under its own scheme, with its own store."""

    protocol = ("fstest",)
    store: dict = {}
    pseudo_dirs = [""]


fsspec.register_implementation("fstest", FsTestFileSystem, clobber=True)


# ---- per-test isolation ------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _ckptio_isolation() -> Iterator[None]:
    os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
    for k, v in _ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    ckptio.reset()
    yield
    ckptio.reset()


@pytest.fixture(autouse=True)
def _no_early_end(monkeypatch) -> None:
    """Remote .fpk loads read an object's end with its first range only when a test asks (it sets
    ``read.TAIL_EARLY`` / ``read.SLOW_STORE``): whether the loopback servers are "slow" (the first reply
    later than 10-15 ms) depends on how busy the machine is, and tests count requests and bytes."""
    from ckptio.formats.fastpickle import read as fpk_read

    monkeypatch.setattr(fpk_read, "TAIL_EARLY", 3600.0)
    monkeypatch.setattr(fpk_read, "SLOW_STORE", 3600.0)


def _unique(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


def flip_byte(path: str, at: int, mask: int = 0x01) -> None:
    """Damage a file in place: XOR the byte at ``at`` with ``mask`` (what bit rot or a bad disk leaves)."""
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ mask]))


# ---- servers -----------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def s3_server() -> Iterator[MotoServer]:
    with MotoServer() as server:
        yield server


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[GCSEmulator]:
    with GCSEmulator() as server:
        yield server


@pytest.fixture(scope="session")
def s3_endpoint(s3_server: MotoServer) -> str:
    return s3_server.url


@pytest.fixture(scope="session")
def gcs_endpoint(gcs_server: GCSEmulator) -> str:
    return gcs_server.url


def _s3_bucket(endpoint: str, route_to: str) -> str:
    bucket = _unique()
    make_s3_bucket(endpoint, bucket)
    ckptio.configure(backends={"s3": {"endpoint_url": route_to, **S3_TEST_OPTIONS}})
    return f"s3://{bucket}"


def _gcs_bucket(endpoint: str, route_to: str) -> str:
    bucket = _unique()
    make_gcs_bucket(endpoint, bucket)
    ckptio.configure(backends={"gcs": {"endpoint_url": route_to, "anon": True, "project": "test"}})
    return f"gs://{bucket}"


@pytest.fixture
def s3_uri(s3_endpoint: str) -> str:
    return _s3_bucket(s3_endpoint, s3_endpoint)


@pytest.fixture
def gcs_uri(gcs_endpoint: str) -> str:
    return _gcs_bucket(gcs_endpoint, gcs_endpoint)


@pytest.fixture
def s3_proxy(s3_endpoint: str) -> Iterator[CountingProxy]:
    """A counting proxy in front of moto; ``proxy.uri`` is a fresh bucket routed through it."""
    with CountingProxy(s3_endpoint) as proxy:
        proxy.uri = _s3_bucket(s3_endpoint, proxy.url)  # type: ignore[attr-defined]
        yield proxy


@pytest.fixture
def gcs_proxy(gcs_endpoint: str) -> Iterator[CountingProxy]:
    """A counting proxy in front of the GCS emulator; ``proxy.uri`` is a fresh bucket routed through it."""
    with CountingProxy(gcs_endpoint) as proxy:
        proxy.uri = _gcs_bucket(gcs_endpoint, proxy.url)  # type: ignore[attr-defined]
        yield proxy


@pytest.fixture(params=["s3", "gcs"])
def proxy(request) -> CountingProxy:
    """``s3_proxy``, then ``gcs_proxy``: a test that counts requests on both object stores."""
    return request.getfixturevalue(f"{request.param}_proxy")


@pytest.fixture
def memory_uri() -> str:
    return f"memory://{_unique()}"


@pytest.fixture
def local_uri(tmp_path) -> str:
    return str(tmp_path)


@pytest.fixture
def fsspec_uri() -> Iterator[str]:
    root = f"fstest://{_unique()}"
    yield root
    FsTestFileSystem.store.clear()
    FsTestFileSystem.pseudo_dirs[:] = [""]


@pytest.fixture
def user_uri() -> Iterator[str]:
    yield f"userdict://{_unique()}"
    UserDictBackend.store.clear()


ALL_BACKENDS = ["local", "memory", "s3", "gcs", "fsspec", "user"]


@pytest.fixture(params=ALL_BACKENDS)
def any_uri(request) -> str:
    """The same test on every backend: a fresh, empty root URI on each."""
    return request.getfixturevalue(f"{request.param}_uri")
