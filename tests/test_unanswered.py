"""An endpoint that accepts connections and never answers (or answers part of a reply and stops): the first
failed attempt says what is being waited on (operation, URI, endpoint, attempt n of m, retrying) and how long
the attempts left can take at most, with the options that change it; the ``ckptio`` command shows it without
``-v`` and its hint points at the timeouts. Small timeouts come from settings; the messages are checked,
never the timing, except that no call outlives the deadline it was given."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator

import pytest

import ckptio
from ckptio.errors import TransferError

# what a server does with each connection: nothing at all, the status line only, headers and part of a body
REPLIES = {
    "silent": b"",
    "status line": b"HTTP/1.1 200 OK\r\n",
    "part of a body": b"HTTP/1.1 200 OK\r\nContent-Type: application/xml\r\nContent-Length: 1000\r\n\r\n<?xml",
}


class Unanswering:
    """A loopback server that accepts every connection, reads what comes, sends ``reply`` and then nothing."""

    def __init__(self, reply: bytes = b"") -> None:
        self.reply = reply
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.05)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                c, _ = self.sock.accept()
            except OSError:
                continue
            self.conns.append(c)
            if self.reply:
                c.sendall(self.reply)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for c in [*self.conns, self.sock]:
            c.close()


@pytest.fixture
def silent() -> Iterator[Unanswering]:
    s = Unanswering()
    yield s
    s.close()


def _options(kind: str, endpoint: str, **extra) -> dict:
    creds = {"access_key_id": "x", "secret_access_key": "y"} if kind == "s3" else {"anon": True}
    return {"endpoint_url": endpoint, "stall_timeout": 0.5, "max_attempts": 2, **creds, **extra}


@pytest.mark.parametrize("kind,scheme", [("s3", "s3"), ("gcs", "gs")])
def test_the_first_failure_says_what_is_waited_on_and_for_how_long(silent, caplog, kind, scheme):
    ckptio.configure(backends={kind: _options(kind, silent.url)})
    with caplog.at_level(logging.WARNING, logger="ckptio.retry"), pytest.raises(TransferError) as e:
        list(ckptio.list_dir_or_file(f"{scheme}://team-bucket/run7/"))
    first = caplog.records[0].getMessage()
    for part in (
        f"{scheme}://team-bucket/run7/",
        silent.url,
        "attempt 1 of 2 failed",
        "retrying",
        "the 1 attempt(s) left take at most",
        "if the endpoint keeps not answering (0.5s each)",
        "max_attempts=2",
        "stall_timeout=0.5",
        "deadline=600",
        f"CKPTIO_{kind.upper()}_<OPTION>",
        "docs/failures.md",
    ):
        assert part in first, (part, first)
    assert e.value.attempts == 2
    for said in re.findall(r"within ([\d.]+)s", str(e.value) + first):
        assert float(said) <= 1, (said, e.value)  # never a wait longer than the attempt had (the deadline's)


# the variable each store's client reads its endpoint from when the settings give none
ENDPOINT_VARIABLES = {"s3": "AWS_ENDPOINT_URL", "gcs": "STORAGE_EMULATOR_HOST"}


@pytest.mark.parametrize("kind,scheme", [("s3", "s3"), ("gcs", "gs")])
def test_an_endpoint_from_the_environment_is_the_one_named(silent, caplog, monkeypatch, kind, scheme):
    """No ``endpoint_url`` in the settings, the client's own variable names the endpoint: the message names
    that endpoint (where the requests go), never 'the default endpoint', and so does the error."""
    monkeypatch.setenv(ENDPOINT_VARIABLES[kind], silent.url)
    options = _options(kind, silent.url)
    del options["endpoint_url"]
    ckptio.configure(backends={kind: options})
    with caplog.at_level(logging.WARNING, logger="ckptio.retry"), pytest.raises(TransferError) as e:
        ckptio.exists(f"{scheme}://team-bucket/x.pt")
    first = caplog.records[0].getMessage()
    assert silent.conns, "the requests went to the endpoint of the environment"
    assert f"at {silent.url}:" in first and "default" not in first, first
    assert silent.url in str(e.value), e.value


def test_the_cli_shows_it_without_verbose_and_hints_at_the_timeouts(silent, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTIO_")}
    env.update(
        PYTHONPATH=os.pathsep.join(sys.path),
        CKPTIO_S3_ENDPOINT_URL=silent.url,
        CKPTIO_S3_STALL_TIMEOUT="0.5",
        CKPTIO_S3_MAX_ATTEMPTS="2",
        AWS_ACCESS_KEY_ID="x",
        AWS_SECRET_ACCESS_KEY="y",
    )
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from ckptio.cli import main; sys.exit(main())", "ls", "s3://team-bucket"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stderr
    first, *rest = proc.stderr.splitlines()
    assert "list_objects_v2 of s3://team-bucket" in first and silent.url in first and "attempt 1 of 2" in first
    assert "at most" in first and "CKPTIO_S3_<OPTION>" in first
    assert "rerun with -v" not in proc.stderr and "docs/failures.md" in rest[-1]


FUZZ = textwrap.dedent(
    r"""
    import json, logging, os, random, sys, time
    sys.path.insert(0, sys.argv[3])
    import ckptio
    from test_unanswered import REPLIES, Unanswering, _options

    seed, n = int(sys.argv[1]), int(sys.argv[2])
    rng = random.Random(seed)
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("ckptio.retry").addHandler(Keep())
    logging.getLogger("ckptio.retry").propagate = False
    out = []
    for _ in range(n):
        kind, scheme = rng.choice([("s3", "s3"), ("gcs", "gs")])
        reply = rng.choice(sorted(REPLIES))
        op = rng.choice(["ls", "exists", "get", "load"])
        extra = {"max_attempts": rng.choice([1, 2, 3]), "stall_timeout": rng.choice([0.2, 0.3]),
                 "deadline": rng.choice([1.0, 3.0])}
        if rng.random() < 0.3:
            extra["timeout"] = 0.25
        server = Unanswering(REPLIES[reply])
        ckptio.reset()
        options = _options(kind, server.url, **extra)
        variable = {"s3": "AWS_ENDPOINT_URL", "gcs": "STORAGE_EMULATOR_HOST"}[kind]
        os.environ.pop(variable, None)
        if rng.random() < 0.4:  # the endpoint from the client's own variable, none in the settings
            os.environ[variable] = options.pop("endpoint_url")
        ckptio.configure(backends={kind: options})
        records.clear()
        uri = f"{scheme}://team-bucket/k{rng.randrange(100)}.fpk"
        started = time.monotonic()
        try:
            {"ls": lambda: list(ckptio.list_dir_or_file(uri.rsplit("/", 1)[0])), "exists": lambda: ckptio.exists(uri),
             "get": lambda: ckptio.get(uri), "load": lambda: ckptio.load(uri)}[op]()
            outcome = ("ok", "")
        except ckptio.CkptioError as e:
            outcome = (type(e).__name__, str(e))
        except Exception as e:
            outcome = ("raw " + type(e).__name__, str(e))
        took = time.monotonic() - started
        server.close()
        out.append({"case": [kind, reply, op, extra], "outcome": outcome, "took": took, "records": list(records),
                    "url": server.url, "uri": uri})
    print(json.dumps(out))
    """
)


def test_fuzz_unanswering_endpoints(tmp_path):
    """Random store, reply cut short (nothing, the status line, part of a body), operation, attempt count,
    stall and attempt timeouts and deadline, in a child under a timeout: every call ends with a ckptio error,
    each of its requests within the deadline, and a retried one first says what it waits on."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTIO_")}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    seed = int(os.environ.get("CKPTIO_FUZZ_SEED", "3"))
    proc = subprocess.run(
        [sys.executable, "-c", FUZZ, str(seed), "6", here],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for c in json.loads(proc.stdout):
        kind, reply, op, extra = c["case"]
        name, msg = c["outcome"]
        assert name in ("TransferError", "FormatError", "IntegrityError"), c
        assert c["took"] <= 3 * extra["deadline"] + 2, c  # each request within its deadline; a load makes a few
        for said in re.findall(r"within ([\d.]+)s", msg + " ".join(c["records"])):
            assert float(said) <= extra["deadline"], c
        if c["records"]:
            first = c["records"][0]
            assert c["uri"].rsplit("/", 1)[0] in first and c["url"] in first and "attempt 1 of" in first, c
            assert "at most" in first and f"max_attempts={extra['max_attempts']}" in first, c
