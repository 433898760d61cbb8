"""Security: no code execution on load, no path escapes when copying, no secrets in output.

* ``.pt`` files load with ``weights_only=True``; ``.fpk`` files never unpickle unless the caller
  passes ``allow_pickle=True``; DCP's pickled ``.metadata`` goes through an allow-list unpickler
  (tests in test_dcp.py) and is read only from the checkpoint the user points at (a latest pointer
  cannot redirect a Checkpointer elsewhere).
* Keys with ``../``, absolute keys and symlinks in the destination cannot make ``copytree`` or
  ``ckptio cp`` write outside the target directory.
* Secrets from settings, the environment and credential files never appear in logs, exceptions,
  ``repr``, settings output or CLI output.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
import traceback

import pytest
import torch

import ckptio
from ckptio import fastpickle
from ckptio.checkpointer import Checkpointer
from ckptio.errors import CkptioError
from faultproxy import Fault

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore::ckptio.checkpointer.CheckpointWarning"),
]


class Evil:
    marker = ""

    def __reduce__(self):
        return (open, (self.marker, "w"))  # creating the file proves code ran


def _evil(tmp_path) -> Evil:
    e = Evil()
    e.marker = str(tmp_path / "PWNED")
    return e


@pytest.mark.parametrize("where", ["local", "s3"])
def test_crafted_pt_does_not_run_code(tmp_path, request, where):
    root = str(tmp_path) if where == "local" else request.getfixturevalue("s3_uri")
    evil = _evil(tmp_path)
    raw = str(tmp_path / "raw.pt")
    torch.save({"w": torch.ones(2), "x": evil}, raw)
    uri = root + "/evil.pt"
    ckptio.put(open(raw, "rb").read(), uri)
    with pytest.raises(pickle.UnpicklingError):
        ckptio.load(uri)
    assert not os.path.exists(evil.marker)


def test_crafted_fpk_does_not_run_code(tmp_path):
    evil = _evil(tmp_path)
    uri = str(tmp_path / "evil.fpk")
    fastpickle.save({"w": torch.ones(2), "x": evil}, uri, allow_pickle=True)
    with pytest.raises(CkptioError, match="allow_pickle"):
        ckptio.load(uri)
    with pytest.raises(CkptioError):
        fastpickle.load(uri)
    assert not os.path.exists(evil.marker)


def test_latest_pointer_cannot_redirect_to_another_checkpoint(tmp_path):
    """A Checkpointer reads DCP metadata only under its own root, whatever the pointer says."""
    root, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    ck = Checkpointer(str(root), format="dcp")
    ck.save(1, {"model": {"w": torch.ones(3)}})
    evil = _evil(tmp_path)
    os.makedirs(elsewhere / "000000000009")
    (elsewhere / "000000000009" / ".metadata").write_bytes(pickle.dumps(evil))
    pointer = next(p for p in root.iterdir() if p.is_file())
    for text in ("../elsewhere/000000000009", str(elsewhere / "000000000009"), "file:///etc/passwd"):
        pointer.write_text(text)
        state = {"model": {"w": torch.zeros(3)}}
        assert Checkpointer(str(root), format="dcp").load(state) == 1
        assert torch.equal(state["model"]["w"], torch.ones(3))
    assert not os.path.exists(evil.marker)


# ---- path escapes ------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["../escaped.bin", "a/../../escaped.bin"])
def test_copytree_refuses_keys_that_escape(tmp_path, user_uri, key):
    from conftest import UserDictBackend

    UserDictBackend.store[f"{user_uri}/tree/fine.bin"] = (b"ok", 1)
    UserDictBackend.store[f"{user_uri}/tree/{key}"] = (b"evil", 2)  # a listing can return any key
    dst = tmp_path / "dst" / "inner"
    with pytest.raises(ValueError, match="escapes"):
        ckptio.copytree(f"{user_uri}/tree", str(dst))
    assert not (tmp_path / "dst" / "escaped.bin").exists() and not (tmp_path / "escaped.bin").exists()


def _symlinked_destination(tmp_path):
    """``dst/link`` is a symlink to ``outside``; ``src`` has a real directory ``link`` with a file in it."""
    outside = tmp_path / "outside"
    outside.mkdir()
    dst = tmp_path / "dst"
    dst.mkdir()
    os.symlink(outside, dst / "link")
    src = tmp_path / "src"
    (src / "link").mkdir(parents=True)
    (src / "link" / "payload.bin").write_bytes(b"data")
    return outside, src, dst


def test_copytree_does_not_write_through_a_symlink_in_the_destination(tmp_path):
    outside, src, dst = _symlinked_destination(tmp_path)
    with pytest.raises(PermissionError, match="symlink|outside"):
        ckptio.copytree(str(src), str(dst), dirs_exist_ok=True)
    assert list(outside.iterdir()) == []


def test_cli_cp_does_not_write_through_a_symlink(tmp_path):
    outside, src, dst = _symlinked_destination(tmp_path)
    r = subprocess.run(
        [sys.executable, "-m", "ckptio.cli", "cp", "-r", str(src) + "/", str(dst) + "/"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert list(outside.iterdir()) == [], (r.stdout, r.stderr)


def test_copytree_with_absolute_looking_keys_stays_inside(tmp_path):
    src = "memory://bkt2/t"
    ckptio.put(b"x", src + "//etc/passwd-copy")
    dst = tmp_path / "dst"
    ckptio.copytree(src, str(dst))
    assert not os.path.exists("/etc/passwd-copy")
    files = [os.path.relpath(os.path.join(d, f), dst) for d, _, fs in os.walk(dst) for f in fs]
    assert all(not f.startswith("..") for f in files) and files


# ---- secrets -----------------------------------------------------------------------------------

SECRET_SETTINGS = "SettingsSecretQ1w2e3r4t5y6"
SECRET_ENV = "EnvSecretZ9x8c7v6b5n4m3"
SECRET_FILE = "FileSecretA1s2d3f4g5h6"
SECRET_PROVIDED = "ProvidedSecretP0o9i8u7"
SECRETS = (SECRET_SETTINGS, SECRET_ENV, SECRET_FILE, SECRET_PROVIDED)


def _assert_clean(*texts: str) -> None:
    for t in texts:
        for s in SECRETS:
            assert s not in t, f"secret {s[:8]}... leaked: {t[max(0, t.find(s) - 200) : t.find(s) + 50]!r}"


def test_secrets_never_in_logs_errors_repr_or_settings(s3_faults, tmp_path, monkeypatch, caplog):
    creds = tmp_path / "creds.json"
    creds.write_text(
        json.dumps(
            {
                "aws_access_key_id": "filekey",
                "aws_secret_access_key": SECRET_FILE,
                "aws_session_token": SECRET_FILE + "tok",
            }
        )
    )
    monkeypatch.setenv("CKPTIO_S3_SESSION_TOKEN", SECRET_ENV)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_ENV)
    ckptio.reset()
    ckptio.configure(
        backends={
            "s3": {
                "endpoint_url": s3_faults.url,
                "secret_access_key": SECRET_SETTINGS,
                "access_key_id": "k",
                "max_attempts": 2,
                "deadline": 10,
            }
        },
        aliases={
            "filecreds": {"target": s3_faults.uri, "options": {"credentials_file": str(creds)}},
            "provided": {
                "target": s3_faults.uri,
                "options": {
                    "credential_provider": lambda: {"access_key_id": "p", "secret_access_key": SECRET_PROVIDED}
                },
            },
        },
    )
    texts: list[str] = []
    with caplog.at_level(logging.DEBUG, logger="ckptio"):
        for uri in (s3_faults.uri + "/a", "filecreds://a", "provided://a"):
            b, u = ckptio.resolve(uri)
            texts += [repr(b), str(b.__dict__.get("policy"))]
            s3_faults.clear()
            s3_faults.add(Fault("status", status=503, fraction=1.0))
            try:
                ckptio.put(b"x", uri)
            except Exception as e:  # noqa: BLE001 - the point is what it says
                texts.append("".join(traceback.format_exception(e)) + repr(e))
            s3_faults.clear()
            s3_faults.add(Fault("expired", fraction=1.0))
            try:
                ckptio.get(uri)
            except Exception as e:  # noqa: BLE001
                texts.append("".join(traceback.format_exception(e)) + repr(e))
    texts += [caplog.text, repr(ckptio.settings()), json.dumps(ckptio.settings(), default=repr)]
    assert "attempt(s)" in "".join(texts)  # the errors did happen
    _assert_clean(*texts)


def test_secrets_never_in_cli_output(tmp_path, s3_faults):
    cfg = tmp_path / "ckptio.toml"
    cfg.write_text(
        f'[backends.s3]\nendpoint_url = "{s3_faults.url}"\naccess_key_id = "k"\n'
        f'secret_access_key = "{SECRET_SETTINGS}"\nmax_attempts = 1\n'
    )
    env = {**os.environ, "CKPTIO_CONFIG": str(cfg), "CKPTIO_S3_SESSION_TOKEN": SECRET_ENV}
    s3_faults.add(Fault("status", status=503, fraction=1.0))
    outs = []
    for args in (
        ["config"],
        ["ls", s3_faults.uri],
        ["cp", str(cfg), s3_faults.uri + "/x"],
        ["info", s3_faults.uri + "/missing.fpk"],
    ):
        r = subprocess.run(
            [sys.executable, "-m", "ckptio.cli", *args], capture_output=True, text=True, env=env, timeout=120
        )
        outs += [r.stdout, r.stderr]
    assert "***" in "".join(outs) or "attempt" in "".join(outs)
    _assert_clean(*outs)


def test_cli_inspector_decodes_only_latin1_bytes():
    """`ckptio info` on a .pt reads its pickle with an inspector; `_codecs.encode` is how torch pickles
    bytes (latin1), and no other codec (zlib, bz2: compression bombs, arbitrary transforms) is run."""
    import _codecs

    from ckptio.errors import FormatError
    from ckptio.formats.torch import _TorchInspector

    def payload(encoding: str) -> bytes:
        class P:
            def __reduce__(self):
                return _codecs.encode, ("x" * 64, encoding)

        return pickle.dumps({"b": P()}, protocol=2)

    assert _TorchInspector(__import__("io").BytesIO(payload("latin1"))).load() == {"b": b"x" * 64}
    for enc in ("zlib_codec", "bz2_codec", "rot13"):
        with pytest.raises(FormatError, match="only latin1"):
            _TorchInspector(__import__("io").BytesIO(payload(enc))).load()
