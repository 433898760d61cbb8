"""Storage servers on loopback for the benchmark (and the tests): moto (S3 API) and gcp-storage-emulator.

Each server runs as a subprocess (``python -m moto.server`` / ``python -m gcp_storage_emulator``
with this interpreter, so it works from any virtual environment that has the packages, activated
or not) on a free 127.0.0.1 port; :meth:`Server.start` waits until it answers, :meth:`Server.stop`
terminates its process group (and ``atexit`` does it for any still running). A missing package
raises :class:`~ckptio.errors.MissingDependencyError` naming ``pip install 'ckptio[bench]'``.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any, TypeVar

from ..errors import MissingDependencyError
from .proxy import check_wan, describe_wan

_running: list[Server] = []
_S = TypeVar("_S", bound="Server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A storage server subprocess. ``url`` is its endpoint (``http://127.0.0.1:PORT``)."""

    name = "server"
    ready_path = "/"
    requires: tuple[str, ...] = ()  # modules the server needs (checked before starting it)

    ssl_context: Any = None  # how start() checks an https server's certificate

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        return dict(os.environ)

    def start(self, timeout: float = 30.0) -> Server:
        missing = [m for m in self.requires if importlib.util.find_spec(m) is None]
        if missing:
            raise MissingDependencyError(
                f"{self.name} needs the Python module(s) {', '.join(missing)}, which are "
                f"not installed: pip install 'ckptio[bench]'"
            )
        self.proc = subprocess.Popen(
            self.command(), env=self.env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        _running.append(self)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} while starting: {self.command()}")
            try:
                with urllib.request.urlopen(self.url + self.ready_path, timeout=1, context=self.ssl_context):
                    return self
            except urllib.error.HTTPError:
                return self  # it answered
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{self.name} did not answer on {self.url} within {timeout}s")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if self in _running:
            _running.remove(self)
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def __enter__(self: _S) -> _S:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class MotoServer(Server):
    """S3 API (moto). Accepts any credentials; bucket names need >= 3 characters.

    ``ranged_reads``: serve a ranged GET by reading only its range (:mod:`ckptio.bench.moto_ranges`), as an
    object store does; moto itself reads the whole object for each one."""

    name = "moto_server"
    ready_path = "/moto-api/"
    requires = ("moto", "flask", "flask_cors")  # moto[server]

    def __init__(self, ranged_reads: bool = False) -> None:
        super().__init__()
        self.ranged_reads = ranged_reads

    def command(self) -> list[str]:
        module = "ckptio.bench.moto_ranges" if self.ranged_reads else "moto.server"
        return [sys.executable, "-m", module, "-H", "127.0.0.1", "-p", str(self.port)]

    def reset(self) -> None:
        """Drop every bucket and object (moto's reset API)."""
        urllib.request.urlopen(urllib.request.Request(self.url + "/moto-api/reset", method="POST"), timeout=10).close()


class GCSEmulator(Server):
    """gcp-storage-emulator, in memory. Note: it does not enforce ``ifGenerationMatch``."""

    name = "gcp-storage-emulator"
    ready_path = "/storage/v1/b"
    requires = ("gcp_storage_emulator",)

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "gcp_storage_emulator",
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--in-memory",
            "--quiet",
        ]


class ProxyServer(Server):
    """A :class:`~ckptio.bench.proxy.LatencyProxy` in front of ``upstream_url``, in its own process: a
    remote store's network shares no interpreter with the client, and a proxy in the client's process
    took 7-9% off ckptio's 256 MiB ``.fpk`` loads through it and 2-4% off s3torchconnector's (GIL)."""

    name = "latency proxy"

    def __init__(self, upstream_url: str, latency: float, bandwidth: float) -> None:
        check_wan(latency, bandwidth)
        super().__init__()
        self.upstream_url, self.latency, self.bandwidth = upstream_url, latency, bandwidth

    def command(self) -> list[str]:
        wan = ["--latency", repr(self.latency), "--bandwidth", repr(self.bandwidth)]
        return [sys.executable, "-m", "ckptio.bench.proxy", self.upstream_url, "--port", str(self.port), *wan]

    def describe(self) -> str:
        return describe_wan(self.latency, self.bandwidth)


class TLSMotoServer(MotoServer):
    """moto over https with a self-signed certificate for 127.0.0.1; ``ca_file`` is the certificate to
    trust (``AWS_CA_BUNDLE``)."""

    name = "moto_server (https)"

    def __init__(self, directory: str) -> None:
        super().__init__()
        self.url = f"https://127.0.0.1:{self.port}"
        self.ca_file, self._key_file = self_signed_certificate(directory)
        import ssl

        self.ssl_context = ssl.create_default_context(cafile=self.ca_file)

    def command(self) -> list[str]:
        return super().command() + ["-c", self.ca_file, "-k", self._key_file]


def self_signed_certificate(directory: str) -> tuple[str, str]:
    """A certificate for 127.0.0.1 (its own CA) and its key, as PEM files in ``directory``."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
    with open(cert_file, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_file, "wb") as f:
        f.write(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    return cert_file, key_file


def s3_client(endpoint: str) -> Any:
    """A boto3 S3 client for a :class:`MotoServer` at ``endpoint`` (moto's documented test credentials)."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )


@atexit.register
def _stop_all() -> None:
    for s in list(_running):
        s.stop()


def make_s3_bucket(endpoint: str, bucket: str) -> None:
    req = urllib.request.Request(f"{endpoint}/{bucket}", method="PUT")
    urllib.request.urlopen(req, timeout=10).close()  # moto does not check signatures


# ckptio's S3 backend options for a MotoServer (moto takes any credentials; these are its documented test ones)
MOTO_S3_OPTIONS = {"access_key_id": "testing", "secret_access_key": "testing", "region": "us-east-1"}


def moto_s3fs(endpoint: str) -> Any:
    """A fresh s3fs client for the moto server at ``endpoint`` (the raw-s3fs baselines)."""
    import s3fs

    return s3fs.S3FileSystem(
        endpoint_url=endpoint,
        key="testing",
        secret="testing",
        skip_instance_cache=True,
        client_kwargs={"region_name": "us-east-1"},
    )


def make_gcs_bucket(endpoint: str, bucket: str) -> None:
    req = urllib.request.Request(
        f"{endpoint}/storage/v1/b?project=test",
        data=json.dumps({"name": bucket}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    urllib.request.urlopen(req, timeout=10).close()
