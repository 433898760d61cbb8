"""Settings: file discovery, precedence, alias schemes, path mapping, validation, redaction."""

from __future__ import annotations

import textwrap

import pytest

import ckptio
from ckptio import config
from ckptio.errors import SettingsError


def write(path, text: str) -> str:
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_alias_scheme_resolves_with_its_own_options(tmp_path, monkeypatch):
    f = write(tmp_path / "ckptio.toml", """
        [aliases.ckpt]
        target = "memory://team-bucket/checkpoints"
        [aliases.ckpt.options]
        part_size = "8MiB"

        [aliases.other]
        target = "memory://elsewhere"
        options = { part_size = "16MiB" }
    """)
    monkeypatch.setenv("CKPTIO_CONFIG", f)
    b1, u1 = ckptio.resolve("ckpt://run7/step100")
    b2, u2 = ckptio.resolve("other://x")
    assert u1 == "memory://team-bucket/checkpoints/run7/step100"
    assert u2 == "memory://elsewhere/x"
    assert (b1.part_size, b2.part_size) == (8 * 2**20, 16 * 2**20)
    ckptio.put(b"data", "ckpt://run7/a.bin")
    assert ckptio.get("memory://team-bucket/checkpoints/run7/a.bin") == b"data"
    assert ckptio.load("ckpt://run7/a.bin") == b"data"


def test_path_mapping_longest_prefix_wins():
    ckptio.configure(path_mapping={"memory://old/": "memory://new/", "memory://old/special/": "memory://vip/"})
    assert ckptio.resolve("memory://old/a")[1] == "memory://new/a"
    assert ckptio.resolve("memory://old/special/b")[1] == "memory://vip/b"
    assert ckptio.resolve("memory://other/c")[1] == "memory://other/c"


def test_precedence_argument_over_env_over_file(tmp_path, monkeypatch):
    f = write(tmp_path / "s.toml", """
        [backends.memory]
        part_size = 1000
        concurrency = 3
    """)
    monkeypatch.setenv("CKPTIO_CONFIG", f)
    b, _ = ckptio.resolve("memory://a/b")
    assert (b.part_size, b.concurrency) == (1000, 3)
    ckptio.reset()
    monkeypatch.setenv("CKPTIO_MEMORY_PART_SIZE", "2000")
    b, _ = ckptio.resolve("memory://a/b")
    assert (b.part_size, b.concurrency) == (2000, 3)  # env beats file, file still fills the rest
    ckptio.configure(backends={"memory": {"part_size": 3000}})
    b, _ = ckptio.resolve("memory://a/b")
    assert b.part_size == 3000  # configure() beats env
    b, _ = ckptio.resolve("memory://a/b", part_size=4000)
    assert b.part_size == 4000  # a call's own argument beats everything


def test_cwd_file_is_found(tmp_path, monkeypatch):
    monkeypatch.delenv("CKPTIO_CONFIG", raising=False)
    write(tmp_path / "ckptio.toml", '[aliases.here]\ntarget = "memory://cwd"\n')
    monkeypatch.chdir(tmp_path)
    assert ckptio.resolve("here://x")[1] == "memory://cwd/x"


@pytest.mark.parametrize("text, key", [
    ("[backends.s3]\nconcurrency = -1\n", "backends.s3.concurrency"),
    ("[backends.s3]\npart_size = \"lots\"\n", "backends.s3.part_size"),
    ("[backends.s3]\nendpoint_url = \"localhost:9000\"\n", "backends.s3.endpoint_url"),
    ("[aliases.ckpt]\noptions = {}\n", "aliases.ckpt.target"),
    ("[aliases.s3]\ntarget = \"memory://x\"\n", "aliases.s3"),
    ("[aliases.ckpt]\ntarget = \"memory://x\"\ntypo = 1\n", "aliases.ckpt"),
    ("[bakends.s3]\nregion = \"x\"\n", "unknown top-level key"),
    ("[backends.s3\n", "not valid TOML"),
])
def test_invalid_file_names_file_and_key(tmp_path, monkeypatch, text, key):
    f = write(tmp_path / "bad.toml", text)
    monkeypatch.setenv("CKPTIO_CONFIG", f)
    with pytest.raises(SettingsError) as e:
        ckptio.resolve("memory://a")
    assert f in str(e.value) and key in str(e.value)


def test_missing_settings_file_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTIO_CONFIG", str(tmp_path / "nope.toml"))
    with pytest.raises(SettingsError, match="nope.toml"):
        ckptio.resolve("memory://a")


def test_unknown_backend_option_is_reported_with_backend_and_uri():
    ckptio.configure(backends={"memory": {"colour": "blue"}})
    with pytest.raises(SettingsError, match=r"memory.*colour"):
        ckptio.resolve("memory://a/b")


def test_secrets_are_redacted_everywhere(tmp_path, monkeypatch):
    secret = "SUPERSECRET-123"
    f = write(tmp_path / "s.toml", f"""
        [backends.s3]
        secret_access_key = "{secret}"
        session_token = "{secret}"
        region = "us-east-1"
        [aliases.ckpt]
        target = "s3://b/x"
        options = {{ secret_access_key = "{secret}" }}
    """)
    monkeypatch.setenv("CKPTIO_CONFIG", f)
    shown = ckptio.settings()
    assert secret not in repr(shown)
    assert shown["backends"]["s3"]["region"] == "us-east-1"
    assert shown["backends"]["s3"]["secret_access_key"] == "***"
    s = config.load()
    assert secret not in repr(s) and secret not in str(s.aliases)
    monkeypatch.setenv("CKPTIO_CONFIG", str(write(tmp_path / "bad.toml", f'[backends.s3]\nsecret_access_key = "{secret}"\nconcurrency = 0\n')))
    ckptio.reset()
    with pytest.raises(SettingsError) as e:
        ckptio.resolve("memory://a")
    assert secret not in str(e.value)


def test_bad_secret_value_is_not_echoed():
    with pytest.raises(SettingsError) as e:
        config.from_mapping({"backends": {"s3": {"timeout": "SECRET-ish-not-a-number"}}})
    assert "timeout" in str(e.value)


def test_sizes_parse():
    assert config.parse_size("64MiB") == 64 * 2**20
    assert config.parse_size("1GB") == 10**9
    assert config.parse_size(4096) == 4096
    with pytest.raises(ValueError):
        config.parse_size("many")


def test_configure_settings_file_and_reset(tmp_path):
    f = write(tmp_path / "x.toml", '[aliases.zz]\ntarget = "memory://zz"\n')
    ckptio.configure(settings_file=f)
    assert ckptio.resolve("zz://k")[1] == "memory://zz/k"
    ckptio.reset()
    with pytest.raises(ckptio.UnknownSchemeError):
        ckptio.resolve("zz://k")


@pytest.mark.parametrize("key", ["key", "secret", "token", "account_key", "connection_string", "sas_token",
                                 "api_key", "aws_access_key_id", "aws_secret_access_key", "session_token"])
def test_fsspec_style_secret_names_are_redacted(key):
    ckptio.configure(backends={"abfs": {key: "S3CR3T-VALUE"}})
    assert "S3CR3T-VALUE" not in repr(ckptio.settings())


def test_credentials_in_urls_are_redacted():
    ckptio.configure(backends={"s3": {"endpoint_url": "https://user:S3CR3T@host:9000"}})
    shown = ckptio.settings()["backends"]["s3"]["endpoint_url"]
    assert "S3CR3T" not in shown and shown.endswith("@host:9000")
