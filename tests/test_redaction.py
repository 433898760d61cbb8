"""No secret a URI carries (``user:password@``, a presigned query string) is ever shown (issue 34, defect 9):
not in an error's str, repr, pickle or notes, the CLI's stdout/stderr, or a log line. URIs point at a
real server (moto): one object that exists (a presigned GET of it) and ones that do not."""

from __future__ import annotations

import logging
import pickle

import boto3
import pytest

import ckptio
from ckptio.cli import main as cli_main
from ckptio.errors import IntegrityError, NotFoundError, logger, note, redact

SECRET = "S3CR3T-PW-4711"
SIG = "S1GN4TURE-0815"


@pytest.fixture
def uris(s3_uri, s3_endpoint) -> list[str]:
    ckptio.dump({"a": 1}, s3_uri + "/x.json")
    bucket = s3_uri[len("s3://") :]
    host = s3_endpoint.split("://", 1)[1]
    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    presigned = client.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": "x.json"})
    return [
        f"http://user:{SECRET}@{host}/{bucket}/missing.pt",
        f"http://user:{SECRET}@{host}/{bucket}/x.json",
        f"https://user:{SECRET}@127.0.0.1:9/x.fpk",
        presigned.split("X-Amz-Signature=")[0] + f"X-Amz-Signature={SIG}",
        f"http://{host}/{bucket}/missing.fpk?X-Amz-Signature={SIG}&X-Amz-Credential=AKIA{SECRET}",
    ]


def shown(e: BaseException) -> str:
    return " ".join([str(e), repr(e), repr(pickle.dumps(e)), repr(getattr(e, "__notes__", []))])


CALLS = [
    ("load", lambda u: ckptio.load(u)),
    ("info", lambda u: ckptio.info(u)),
    ("verify", lambda u: ckptio.verify(u)),
    ("stat", lambda u: ckptio.stat(u)),
    ("get", lambda u: ckptio.get(u)),
    ("dump", lambda u: ckptio.dump({"a": 1}, u)),
    ("put", lambda u: ckptio.put(b"x", u)),
    ("ls", lambda u: ckptio.ls(u)),
    ("remove", lambda u: ckptio.remove(u)),
    ("load_bad_format", lambda u: ckptio.load(u + ".unknownext")),
]


def ours(caplog) -> str:
    """ckptio's log lines (fsspec's own DEBUG lines show the URLs it is given)."""
    return "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("ckptio"))


def test_api_errors_never_show_the_secret(uris, caplog):
    caplog.set_level(logging.DEBUG)
    failures = 0
    for uri in uris:
        for name, call in CALLS:
            try:
                call(uri)
            except Exception as e:  # noqa: BLE001 - the sweep checks whatever each call raises
                failures += 1
                text = shown(e)
                assert SECRET not in text and SIG not in text, (name, uri, text)
    assert failures >= len(uris) * 4  # the sweep did reach errors
    assert SECRET not in ours(caplog) and SIG not in ours(caplog)


@pytest.mark.parametrize(
    "cmd",
    [
        ["ls"],
        ["ls", "-l"],
        ["info"],
        ["verify"],
        ["rm"],
        ["cp", "{uri}", "{tmp}/out.bin"],
        ["cp", "{tmp}/src", "{uri}"],
    ],
)
def test_cli_never_shows_the_secret(cmd, uris, tmp_path, capsys, caplog):
    (tmp_path / "src").write_bytes(b"x")
    caplog.set_level(logging.DEBUG)
    for uri in uris:
        argv = [a.format(uri=uri, tmp=tmp_path) for a in cmd]
        if "{uri}" not in cmd:
            argv.append(uri)
        for extra in ([], ["--json"], ["-v"]):
            try:
                cli_main([argv[0], *extra, *argv[1:]])
            except SystemExit:  # argparse: an option this command lacks
                pass
            out, err = capsys.readouterr()
            assert SECRET not in out + err and SIG not in out + err, (argv, extra, out, err)
    assert SECRET not in ours(caplog) and SIG not in ours(caplog)


def test_credentials_before_a_bucket_are_refused_unsent(s3_uri):
    from ckptio.errors import InvalidURIError

    with pytest.raises(InvalidURIError, match="credentials") as e:
        ckptio.load(f"s3://key:{SECRET}@{s3_uri[len('s3://') :]}/x.json")
    assert SECRET not in shown(e.value)


def test_one_redaction_for_errors_notes_logs_and_settings(caplog):
    uri = f"https://u:{SECRET}@host/p/x.pt?sig={SIG}"
    assert redact(f"cannot read {uri}: gone") == "cannot read https://***@host/p/x.pt?*** gone"
    for e in (NotFoundError(uri), IntegrityError(f"{uri}: damaged")):
        note(e, f"while loading {uri}")
        assert SECRET not in shown(e) and SIG not in shown(e)
        assert SECRET not in str(pickle.loads(pickle.dumps(e)))
    with caplog.at_level(logging.INFO):
        logger("ckptio.test").info("copying %s", uri)
    assert "copying https://***@host/p/x.pt?***" in caplog.text and SECRET not in caplog.text
    assert ckptio.config.redact_url(uri) == redact(uri)
