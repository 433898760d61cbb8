"""The ``ckptio`` command end to end: local, S3 (moto) and GCS (emulator).

Most cases call :func:`ckptio.cli.main` in this process (settings from the URI fixtures); a few
run the installed entry point in a subprocess with a ``CKPTIO_CONFIG`` TOML file, as users do.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import subprocess
import sys

import pytest
import torch

import ckptio
from ckptio import cli
from ckptio.progress import Bar, Tracker
from conftest import S3_TEST_OPTIONS


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv: str) -> tuple[int, object]:
    code, out, _ = run(capsys, "--json", *argv)
    return code, json.loads(out)


def state() -> dict:
    torch.manual_seed(0)
    return {
        "model": {"w": torch.randn(16, 8), "b": torch.zeros(8, dtype=torch.bfloat16)},
        "step": 7,
        "cfg": {"lr": 0.5, "name": "run"},
    }


def corrupt(uri: str, at: int) -> None:
    data = bytearray(ckptio.get(uri))
    data[at] ^= 0xFF
    ckptio.put(bytes(data), uri)


PAIRS = [("local_uri", "s3_uri"), ("s3_uri", "gcs_uri"), ("gcs_uri", "local_uri")]


@pytest.mark.parametrize("src_fx,dst_fx", PAIRS, ids=["local-s3", "s3-gcs", "gcs-local"])
def test_ls_cp_rm_across_backends(request, capsys, src_fx, dst_fx):
    src = request.getfixturevalue(src_fx) + "/run"
    dst = request.getfixturevalue(dst_fx) + "/copy"
    files = {"a.bin": b"a" * 1000, "sub/b.bin": os.urandom(300_000), "sub/deeper/c.txt": b"hello"}
    for rel, data in files.items():
        ckptio.put(data, f"{src}/{rel}")

    code, rows = run_json(capsys, "ls", "-r", src)
    assert code == 0
    assert sorted(r["uri"] for r in rows) == sorted(f"{src}/{rel}" for rel in files)
    assert all(r["size"] == len(files[r["uri"][len(src) + 1 :]]) for r in rows)

    assert run(capsys, "cp", src, dst)[0] == cli.EXIT_USAGE  # a directory needs -r
    code, res = run_json(capsys, "cp", "-r", "-j", "3", src, dst)
    assert code == 0 and res["copied"] == 3 and res["skipped"] == 0 and res["bytes"] == sum(map(len, files.values()))
    for rel, data in files.items():
        assert ckptio.get(f"{dst}/{rel}") == data

    code, res = run_json(capsys, "cp", "-r", "--resume", src, dst)  # resumable: nothing left to do
    assert code == 0 and res["copied"] == 0 and res["skipped"] == 3
    code, res = run_json(capsys, "cp", "-r", src, dst)  # without --resume everything is copied again
    assert code == 0 and res["copied"] == 3

    code, res = run_json(capsys, "cp", f"{src}/a.bin", dst + "/one/")  # into a directory, keeping the name
    assert code == 0 and res["files"] == [f"{dst}/one/a.bin"]
    code, res = run_json(capsys, "cp", "--resume", f"{src}/a.bin", dst)  # an existing directory: the same
    assert code == 0 and res["skipped_files"] == [f"{dst}/a.bin"]

    assert run(capsys, "rm", dst)[0] == cli.EXIT_USAGE  # a directory needs -r
    code, res = run_json(capsys, "rm", "-r", dst)
    assert code == 0 and len(res["removed"]) == 4
    assert run(capsys, "ls", dst)[0] == cli.EXIT_NOT_FOUND
    assert run(capsys, "rm", f"{src}/a.bin")[0] == 0
    assert not ckptio.exists(f"{src}/a.bin")


def test_cp_resumes_after_partial_copy(local_uri, s3_uri, capsys):
    src, dst = f"{local_uri}/src", f"{s3_uri}/dst"
    for i in range(4):
        ckptio.put(bytes([i]) * 50_000, f"{src}/f{i}.bin")
    ckptio.put(bytes([0]) * 50_000, f"{dst}/f0.bin")  # already there (as if a previous run copied it)
    ckptio.put(b"short", f"{dst}/f1.bin")  # a different size: copied again
    code, res = run_json(capsys, "cp", "-r", "--resume", src, dst)
    assert code == 0 and res["skipped"] == 1 and res["copied"] == 3
    assert ckptio.get(f"{dst}/f1.bin") == bytes([1]) * 50_000


def test_cp_without_resume_replaces_same_size_newer_destination(local_uri, capsys):
    src, dst = f"{local_uri}/old.bin", f"{local_uri}/new.bin"
    ckptio.put(b"A" * 1000, src)
    os.utime(src, (1_000_000, 1_000_000))  # an older checkpoint of the same size
    ckptio.put(b"B" * 1000, dst)
    code, res = run_json(capsys, "cp", src, dst)
    assert code == 0 and res["copied"] == 1
    assert ckptio.get(dst) == b"A" * 1000


@pytest.mark.parametrize("fx", ["local_uri", "s3_uri", "gcs_uri"])
def test_missing_objects_exit_3(request, capsys, fx):
    base = request.getfixturevalue(fx)
    for argv in (
        ["ls", f"{base}/nope"],
        ["info", f"{base}/nope.pt"],
        ["verify", f"{base}/nope.fpk"],
        ["rm", f"{base}/nope.bin"],
        ["cp", f"{base}/nope.bin", f"{base}/x.bin"],
    ):
        code, out, err = run(capsys, "--json", *argv)
        assert code == cli.EXIT_NOT_FOUND, argv
        assert json.loads(out)["exit_code"] == cli.EXIT_NOT_FOUND
        lines = err.strip().splitlines()
        assert len(lines) == 2 and "error:" in lines[0] and "nope" in lines[0] and "hint:" in lines[1]


@pytest.mark.parametrize("fx", ["local_uri", "s3_uri"])
def test_info_and_verify_torch(request, capsys, fx):
    uri = request.getfixturevalue(fx) + "/ckpt/step7.pt"
    ckptio.dump(state(), uri)
    code, doc = run_json(capsys, "info", uri)
    assert code == 0 and doc["format"] == "torch"
    t = {x["key"]: x for x in doc["tensors"]}
    assert t["model.w"]["shape"] == [16, 8] and t["model.w"]["dtype"] == "float32" and t["model.w"]["nbytes"] == 512
    assert t["model.b"]["dtype"] == "bfloat16"
    assert doc["values"]["step"] == 7 and doc["values"]["cfg.name"] == "run"
    code, out, _ = run(capsys, "info", uri)
    assert code == 0 and "model.w" in out and "16x8" in out
    code, doc = run_json(capsys, "verify", uri)
    assert code == 0 and doc["ok"] is True and doc["format"] == "torch"

    size = ckptio.stat(uri).size
    data = ckptio.get(uri)
    pos = data.index(state()["model"]["w"].numpy().tobytes()[:64])  # inside the tensor bytes
    corrupt(uri, pos + 10)
    code, out, err = run(capsys, "verify", uri)
    assert code == cli.EXIT_FAILURE and "corrupt" in err
    ckptio.put(data[: size // 2], uri)  # truncated
    assert run(capsys, "verify", uri)[0] == cli.EXIT_FAILURE
    assert run(capsys, "info", uri)[0] == cli.EXIT_FAILURE


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("fx", ["local_uri", "gcs_uri"])
def test_info_and_verify_dcp(request, capsys, fx):
    dcp = pytest.importorskip("ckptio.dcp")
    uri = request.getfixturevalue(fx) + "/dcp/step7"
    sd = {"w": torch.randn(64, 32), "b": torch.arange(10), "extra": {"k": 3}}
    dcp.save(sd, uri)
    code, doc = run_json(capsys, "info", uri)
    assert code == 0 and doc["format"] == "dcp"
    t = {x["key"]: x for x in doc["tensors"]}
    assert t["w"]["shape"] == [64, 32] and t["w"]["nbytes"] == 64 * 32 * 4 and t["b"]["dtype"] == "int64"
    assert "extra.k" in doc["values"]
    code, doc = run_json(capsys, "verify", uri)
    assert code == 0 and doc["ok"] and doc["checked"] >= 3

    data_obj = next(u for u in ckptio.ls(uri) if u.endswith(".distcp"))
    raw = ckptio.get(data_obj)
    pos = raw.index(sd["w"].numpy().tobytes()[:64])
    corrupt(data_obj, pos + 100)
    code, out, err = run(capsys, "verify", uri)
    assert code == cli.EXIT_FAILURE and "checksum mismatch" in err

    ckptio.remove(f"{uri}/.metadata")  # an interrupted save
    assert run(capsys, "verify", uri)[0] == cli.EXIT_FAILURE
    code, out, err = run(capsys, "info", uri)
    assert code == cli.EXIT_FAILURE and "incomplete" in err


@pytest.mark.parametrize("fx", ["local_uri", "s3_uri"])
def test_info_and_verify_fastpickle(request, capsys, fx):
    pytest.importorskip("ckptio.fastpickle")
    uri = request.getfixturevalue(fx) + "/step7.fpk"
    sd = state()
    ckptio.dump(sd, uri)
    code, doc = run_json(capsys, "info", uri)
    assert code == 0 and doc["format"] == "fastpickle"
    t = {x["key"]: x for x in doc["tensors"]}
    assert t["model.w"]["shape"] == [16, 8] and t["model.w"]["nbytes"] == 512
    assert doc["values"]["step"] == 7
    assert run(capsys, "verify", uri)[0] == 0
    pos = ckptio.get(uri).index(sd["model"]["w"].numpy().tobytes()[:64])
    corrupt(uri, pos + 5)
    code, _, err = run(capsys, "verify", uri)
    assert code == cli.EXIT_FAILURE and "error:" in err


def test_verify_unsupported_format_and_plain_directory(local_uri, capsys):
    ckptio.put(b"x", f"{local_uri}/d/a.bin")
    assert run(capsys, "verify", f"{local_uri}/d/a.bin")[0] == cli.EXIT_FAILURE
    assert run(capsys, "info", f"{local_uri}/d")[0] == cli.EXIT_FAILURE
    code, doc = run_json(capsys, "info", f"{local_uri}/d/a.bin")
    assert code == 0 and doc["format"] == "bytes" and doc["size"] == 1


@pytest.mark.parametrize("fx", ["s3_uri", "gcs_uri", "memory_uri"])
def test_rm_r_of_a_whole_bucket_needs_force(request, capsys, fx):
    bucket = request.getfixturevalue(fx)
    for key in ("a/b.bin", "c.bin"):
        ckptio.put(b"x", f"{bucket}/{key}")
    ckptio.configure(aliases={"whole": {"target": bucket}})
    for given in (bucket, bucket + "/", "whole://"):
        code, _, err = run(capsys, "rm", "-r", given)
        assert code == cli.EXIT_USAGE and "whole bucket" in err and "pass --force" in err, err
        assert given in err and bucket in err  # an alias is shown with what it names
    assert ckptio.exists(f"{bucket}/a/b.bin") and ckptio.exists(f"{bucket}/c.bin")
    assert run(capsys, "rm", "-r", f"{bucket}/a")[0] == 0  # below the bucket: no question
    assert run(capsys, "rm", "-r", "--force", "whole://")[0] == 0
    assert not ckptio.exists(f"{bucket}/c.bin")


def test_rm_r_of_the_filesystem_root_needs_force(capsys, monkeypatch):
    from ckptio.backends.local import LocalBackend

    def never(*a, **kw):
        raise AssertionError("rm -r / went on to list or delete")

    for name in ("list", "rmtree", "delete"):  # so a missing guard fails this test instead of deleting /
        monkeypatch.setattr(LocalBackend, name, never)
    monkeypatch.setattr("shutil.rmtree", never)
    for given in ("/", "file:///", "/tmp/.."):
        code, _, err = run(capsys, "rm", "-r", given)
        assert code == cli.EXIT_USAGE and "whole filesystem" in err and "pass --force" in err, err


def test_rm_r_of_a_whole_bucket_asks_on_a_terminal():
    import pty

    code = (
        "import ckptio, sys\n"
        "from ckptio.cli import main\n"
        "ckptio.put(b'x', 'memory://b/k')\n"
        "rc = main(['rm', '-r', 'memory://b'])\n"
        "print('exit', rc, 'left', ckptio.exists('memory://b/k'))\n"
    )
    for answer, expect in (("n", "exit 2 left True"), ("", "exit 2 left True"), ("y", "exit 0 left False")):
        master, slave = pty.openpty()
        try:
            os.write(master, f"{answer}\n".encode())
            r = subprocess.run([sys.executable, "-c", code], stdin=slave, capture_output=True, text=True, timeout=120)
        finally:
            os.close(slave)
            os.close(master)
        assert "memory://b is a whole bucket; remove everything in it? [y/N]" in r.stderr, r.stderr
        assert expect in r.stdout, (answer, r.stdout, r.stderr)


def test_config_redacts_secrets(s3_uri, capsys):
    ckptio.configure(aliases={"ckpt": {"target": f"{s3_uri}/checkpoints"}})
    code, doc = run_json(capsys, "config")
    assert code == 0
    assert doc["backends"]["s3"]["secret_access_key"] == "***"
    assert doc["aliases"]["ckpt"]["target"] == f"{s3_uri}/checkpoints"
    ckptio.configure(backends={"s3": {"secret_access_key": "sup3r-secret-value"}})
    code, out, _ = run(capsys, "config")
    assert code == 0 and "sup3r" not in out and 'secret_access_key = "***"' in out


def test_alias_scheme_and_usage_errors(s3_uri, capsys):
    ckptio.configure(aliases={"ckpt": {"target": f"{s3_uri}/checkpoints"}})
    ckptio.put(b"abc", "ckpt://run1/x.bin")
    code, rows = run_json(capsys, "ls", "ckpt://run1")
    assert code == 0 and [r["uri"] for r in rows] == ["ckpt://run1/x.bin"]
    assert run(capsys, "ls", "nosuchscheme://a/b")[0] == cli.EXIT_USAGE
    with pytest.raises(SystemExit) as e:
        cli.main(["frobnicate"])
    assert e.value.code == cli.EXIT_USAGE


def test_cache_stats_and_clear(tmp_path, capsys):
    code, doc = run_json(capsys, "cache", "stats", "--cache-dir", str(tmp_path / "c"))
    assert code == 0 and doc["entries"] == 0 and doc["bytes"] == 0
    code, doc = run_json(capsys, "cache", "clear", "--cache-dir", str(tmp_path / "c"))
    assert code == 0 and doc["freed_bytes"] == 0


def test_copy_progress_callback(local_uri, memory_uri):
    for i in range(3):
        ckptio.put(os.urandom(100_000 + i), f"{memory_uri}/p/{i}.bin")
    seen: list[tuple[int, int]] = []
    res = cli.copy(
        f"{memory_uri}/p", f"{local_uri}/p", recursive=True, jobs=2, progress=lambda d, t: seen.append((d, t))
    )
    total = 3 * 100_000 + 3
    assert res.bytes_copied == total and seen[-1] == (total, total)
    assert all(a[0] <= b[0] for a, b in itertools.pairwise(seen))


def test_progress_bar_silent_off_tty_and_drawn_when_enabled(monkeypatch):
    buf = io.StringIO()
    with Bar(100, "x", file=buf) as bar:  # StringIO is not a tty
        bar(50, 100)
    assert buf.getvalue() == ""
    monkeypatch.setitem(sys.modules, "tqdm", None)  # the fallback line without tqdm
    buf = io.StringIO()
    with Bar(100, "copy", enabled=True, file=buf) as bar:
        t = Tracker(100, bar)
        t.add(40)
        t.add(60)
    assert "copy" in buf.getvalue() and "100.0%" in buf.getvalue()


# ---- the installed command in a subprocess, settings from a CKPTIO_CONFIG file -----------------------


def _cli(args: list[str], config: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CKPTIO_CONFIG": config, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    return subprocess.run(
        [sys.executable, "-m", "ckptio.cli", *args], env=env, capture_output=True, text=True, timeout=120
    )


def test_subprocess_with_settings_file(s3_uri, gcs_uri, s3_endpoint, gcs_endpoint, tmp_path):
    cfg = tmp_path / "ckptio.toml"
    cfg.write_text(f"""
[backends.s3]
endpoint_url = "{s3_endpoint}"
access_key_id = "{S3_TEST_OPTIONS["access_key_id"]}"
secret_access_key = "{S3_TEST_OPTIONS["secret_access_key"]}"
region = "us-east-1"

[backends.gcs]
endpoint_url = "{gcs_endpoint}"
anon = true
project = "test"

[aliases.ckpt]
target = "{s3_uri}/ck"
""")
    ckptio.dump(state(), f"{s3_uri}/ck/step7.pt")
    r = _cli(["cp", "--quiet", "ckpt://step7.pt", f"{gcs_uri}/mirror/"], str(cfg))
    assert r.returncode == 0, r.stderr
    r = _cli(["ls", "--json", f"{gcs_uri}/mirror"], str(cfg))
    assert r.returncode == 0, r.stderr
    assert [x["uri"] for x in json.loads(r.stdout)] == [f"{gcs_uri}/mirror/step7.pt"]
    r = _cli(["verify", "--json", f"{gcs_uri}/mirror/step7.pt"], str(cfg))
    assert r.returncode == 0 and json.loads(r.stdout)["ok"] is True
    r = _cli(["info", f"{gcs_uri}/mirror/missing.pt"], str(cfg))
    assert r.returncode == cli.EXIT_NOT_FOUND and r.stdout == "" and len(r.stderr.strip().splitlines()) == 2
    r = _cli(["config", "--json"], str(cfg))
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and doc["sources"] == [str(cfg)] and doc["backends"]["s3"]["secret_access_key"] == "***"


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_verify_dcp_written_by_torch(tmp_path, capsys):
    import struct
    import zipfile

    import torch.distributed.checkpoint as tdcp

    root = tmp_path / "tdcp"
    tdcp.save({"w": torch.randn(32, 32)}, storage_writer=tdcp.FileSystemWriter(str(root)))
    code, doc = run_json(capsys, "verify", str(root))
    assert code == 0 and doc["checked"] == 1 and doc["unchecked"] == 0
    obj = next(root.glob("*.distcp"))
    data = bytearray(obj.read_bytes())
    member = next(i for i in zipfile.ZipFile(io.BytesIO(bytes(data))).infolist() if i.filename.endswith("data/0"))
    n, e = struct.unpack("<HH", data[member.header_offset + 26 : member.header_offset + 30])
    data[member.header_offset + 30 + n + e + 17] ^= 0xFF  # a byte of the tensor
    obj.write_bytes(bytes(data))
    code, out, err = run(capsys, "verify", str(root))
    assert code == cli.EXIT_FAILURE and "CRC mismatch" in err


# ---- `ckptio config` refuses what the library refuses, naming file and key, echoing no secret -----

SECRET = "S3CR3T-VALUE-42"
BAD_SETTINGS = {
    "zero part_size": ("[backends.s3]\npart_size = 0\n", "backends.s3.part_size"),
    "negative max_buffer_bytes": ('[backends.s3]\nmax_buffer_bytes = "-1"\n', "backends.s3.max_buffer_bytes"),
    "zero cache max_bytes": ("[backends.local]\nmax_bytes = 0\n", "backends.local.max_bytes"),
    "alias cycle": ('[aliases.a]\ntarget = "b://x"\n[aliases.b]\ntarget = "a://y"\n', "cycle"),
    "self alias": ('[aliases.me]\ntarget = "me://x"\n', "aliases.me.target"),
    "alias shadows s3a": ('[aliases.s3a]\ntarget = "memory://x"\n', "aliases.s3a"),
    "unknown option": (f'[backends.s3]\nsecret_acess_key = "{SECRET}"\n', "did you mean 'secret_access_key'"),
    "unknown backend": ('[backends.s33]\nregion = "x"\n', "did you mean 's3'"),
    "not utf-8": (b'[backends.s3]\nregion = "\xff"\n', "not UTF-8"),
    "invalid toml": ("[backends.s3\n", "not valid TOML"),
    "directory": (None, "is a directory"),
}


@pytest.mark.parametrize("case", list(BAD_SETTINGS))
def test_config_refuses_bad_settings(tmp_path, monkeypatch, capsys, case):
    text, reason = BAD_SETTINGS[case]
    path = tmp_path / "ckptio.toml"
    if text is None:
        path.mkdir()
    else:
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
    monkeypatch.setenv("CKPTIO_CONFIG", str(path))
    ckptio.reset()
    code, out, err = run(capsys, "config")
    assert code == cli.EXIT_USAGE and out == ""
    assert str(path) in err and reason in err and SECRET not in err
    code, out, err = run(capsys, "--json", "config")
    doc = json.loads(out)
    assert code == cli.EXIT_USAGE and doc["type"] == "SettingsError" and str(path) in doc["error"]


def test_config_shows_no_value_of_an_unknown_key(tmp_path, monkeypatch, capsys):
    path = tmp_path / "ckptio.toml"
    path.write_text(
        f'[backends.abfs]\naccount_name = "{SECRET}"\nsas = "{SECRET}"\nanon = true\n'
        f'[aliases.ck]\ntarget = "https://u:{SECRET}@h/x?sig={SECRET}"\n'
    )
    monkeypatch.setenv("CKPTIO_CONFIG", str(path))
    ckptio.reset()
    code, out, _ = run(capsys, "config")
    assert code == 0 and SECRET not in out and 'account_name = "***"' in out and "anon = true" in out
    code, doc = run_json(capsys, "config")
    assert code == 0 and SECRET not in json.dumps(doc) and doc["aliases"]["ck"]["target"] == "https://***@h/x?***"


def test_subprocess_config_pointing_at_a_directory(tmp_path):
    r = _cli(["config"], str(tmp_path))
    assert r.returncode == cli.EXIT_USAGE and r.stdout == ""
    assert f"{tmp_path}: is a directory" in r.stderr and "Traceback" not in r.stderr
