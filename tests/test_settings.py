"""Settings: file discovery, precedence, alias schemes, path mapping, validation, redaction."""

from __future__ import annotations

import os
import textwrap

import pytest

import ckptio
from ckptio import config
from ckptio.errors import SettingsError


def write(path, text: str) -> str:
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_alias_scheme_resolves_with_its_own_options(tmp_path, monkeypatch):
    f = write(
        tmp_path / "ckptio.toml",
        """
        [aliases.ckpt]
        target = "memory://team-bucket/checkpoints"
        [aliases.ckpt.options]
        part_size = "8MiB"

        [aliases.other]
        target = "memory://elsewhere"
        options = { part_size = "16MiB" }
    """,
    )
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
    f = write(
        tmp_path / "s.toml",
        """
        [backends.memory]
        part_size = 1000
        concurrency = 3
    """,
    )
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


@pytest.mark.parametrize(
    "text, key",
    [
        ("[backends.s3]\nconcurrency = -1\n", "backends.s3.concurrency"),
        ('[backends.s3]\npart_size = "lots"\n', "backends.s3.part_size"),
        ('[backends.s3]\nendpoint_url = "localhost:9000"\n', "backends.s3.endpoint_url"),
        ("[aliases.ckpt]\noptions = {}\n", "aliases.ckpt.target"),
        ('[aliases.s3]\ntarget = "memory://x"\n', "aliases.s3"),
        ('[aliases.ckpt]\ntarget = "memory://x"\ntypo = 1\n', "aliases.ckpt"),
        ('[bakends.s3]\nregion = "x"\n', "unknown top-level key"),
        ("[backends.s3\n", "not valid TOML"),
    ],
)
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
    with pytest.raises(SettingsError, match=r"backends\.memory\.colour"):
        ckptio.configure(backends={"memory": {"colour": "blue"}})
    with pytest.raises(SettingsError, match=r"memory.*memory://a/b.*colour"):  # a call's own keyword
        ckptio.resolve("memory://a/b", colour="blue")


def test_secrets_are_redacted_everywhere(tmp_path, monkeypatch):
    secret = "SUPERSECRET-123"
    f = write(
        tmp_path / "s.toml",
        f"""
        [backends.s3]
        secret_access_key = "{secret}"
        session_token = "{secret}"
        region = "us-east-1"
        [aliases.ckpt]
        target = "s3://b/x"
        options = {{ secret_access_key = "{secret}" }}
    """,
    )
    monkeypatch.setenv("CKPTIO_CONFIG", f)
    shown = ckptio.settings()
    assert secret not in repr(shown)
    assert shown["backends"]["s3"]["region"] == "us-east-1"
    assert shown["backends"]["s3"]["secret_access_key"] == "***"
    s = config.load()
    assert secret not in repr(s) and secret not in str(s.aliases)
    monkeypatch.setenv(
        "CKPTIO_CONFIG",
        str(write(tmp_path / "bad.toml", f'[backends.s3]\nsecret_access_key = "{secret}"\nconcurrency = 0\n')),
    )
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


@pytest.mark.parametrize(
    "key",
    [
        "key",
        "secret",
        "token",
        "account_key",
        "connection_string",
        "sas_token",
        "api_key",
        "aws_access_key_id",
        "aws_secret_access_key",
        "session_token",
    ],
)
def test_fsspec_style_secret_names_are_redacted(key):
    ckptio.configure(backends={"abfs": {key: "S3CR3T-VALUE"}})
    assert "S3CR3T-VALUE" not in repr(ckptio.settings())


def test_credentials_in_urls_are_redacted():
    ckptio.configure(backends={"s3": {"endpoint_url": "https://user:S3CR3T@host:9000"}})
    shown = ckptio.settings()["backends"]["s3"]["endpoint_url"]
    assert "S3CR3T" not in shown and shown.endswith("@host:9000")


# ---- every rough edge fails when the settings load, naming file, key and reason ---------------


def load_error(tmp_path, monkeypatch, text: str | bytes, name: str = "ckptio.toml") -> str:
    """The SettingsError that loading ``text`` as $CKPTIO_CONFIG raises, checked to name the file."""
    f = tmp_path / name
    f.write_bytes(text if isinstance(text, bytes) else textwrap.dedent(text).encode())
    monkeypatch.setenv("CKPTIO_CONFIG", str(f))
    ckptio.reset()
    with pytest.raises(SettingsError) as e:
        ckptio.settings()
    assert str(f) in str(e.value)
    return str(e.value)


SIZES = ["part_size", "upload_part_size", "max_buffer_bytes", "max_bytes"]
COUNTS = ["concurrency", "max_attempts"]


@pytest.mark.parametrize(
    "key, value, reason",
    [
        *((k, v, "> 0") for k in SIZES for v in ("0", "-1", '"0MiB"', "0.4")),
        *((k, v, "positive") for k in COUNTS for v in ("0", "-3")),
        *((k, "1.5", "whole number") for k in COUNTS + ["retries"]),
        ("retries", "-1", ">= 0"),
        ("concurrency", "true", "whole number"),
        ("timeout", "0", "> 0"),
        ("deadline", "false", "> 0"),
    ],
)
def test_sizes_and_counts_must_be_positive(tmp_path, monkeypatch, key, value, reason):
    msg = load_error(tmp_path, monkeypatch, f"[backends.s3]\n{key} = {value}\n")
    assert f"backends.s3.{key}" in msg and reason in msg


@pytest.mark.parametrize("cache", [{"max_bytes": 0}, {"max_bytes": "-1KiB"}, {"lock_timeout": -1}])
def test_cache_argument_sizes_must_be_positive(tmp_path, cache):
    with pytest.raises(SettingsError, match=f"cache=.{next(iter(cache))}"):
        ckptio.resolve(str(tmp_path / "x"), cache={"cache_dir": str(tmp_path / "c"), **cache})


def test_positive_sizes_still_load(tmp_path, monkeypatch):
    f = write(
        tmp_path / "s.toml",
        """
        [backends.s3]
        part_size = "8MiB"
        upload_part_size = "5MiB"
        max_buffer_bytes = "1GiB"
        max_bytes = 1
        concurrency = 1
        retries = 0
    """,
    )
    monkeypatch.setenv("CKPTIO_CONFIG", f)
    assert ckptio.settings()["backends"]["s3"] == {
        "part_size": 8 << 20,
        "upload_part_size": 5 << 20,
        "max_buffer_bytes": 1 << 30,
        "max_bytes": 1,
        "concurrency": 1,
        "retries": 0,
    }


@pytest.mark.parametrize(
    "text, key, cycle",
    [
        ('[aliases.a]\ntarget = "b://x"\n[aliases.b]\ntarget = "a://y"\n', "aliases.", "-> "),
        ('[aliases.me]\ntarget = "me://again"\n', "aliases.me.target", "me ("),
        (
            '[aliases.a]\ntarget = "b://"\n[aliases.b]\ntarget = "c://"\n[aliases.c]\ntarget = "b://z"\n',
            "aliases.",
            "b (",
        ),
    ],
)
def test_alias_cycles_are_refused_at_load(tmp_path, monkeypatch, text, key, cycle):
    msg = load_error(tmp_path, monkeypatch, text)
    assert key in msg and "cycle" in msg and cycle in msg


def test_alias_cycle_across_layers_names_both_sources(tmp_path, monkeypatch):
    f = write(tmp_path / "s.toml", '[aliases.a]\ntarget = "b://x"\n')
    monkeypatch.setenv("CKPTIO_CONFIG", f)
    ckptio.configure(aliases={"b": "a://y"})
    with pytest.raises(SettingsError, match="cycle") as e:
        ckptio.resolve("a://k")
    assert f in str(e.value) and "ckptio.configure()" in str(e.value)


def test_long_alias_chains_resolve(tmp_path, monkeypatch):
    n = 20
    text = "".join(f'[aliases.hop{i}]\ntarget = "hop{i + 1}://p{i}"\n' for i in range(n))
    text += f'[aliases.hop{n}]\ntarget = "memory://end"\noptions = {{ part_size = "1MiB" }}\n'
    monkeypatch.setenv("CKPTIO_CONFIG", write(tmp_path / "s.toml", text))
    b, u = ckptio.resolve("hop0://k")
    assert u == "memory://end/" + "/".join(f"p{i}" for i in range(n - 1, -1, -1)) + "/k"
    assert b.part_size == 1 << 20


@pytest.mark.parametrize(
    "name, owner", [("s3a", "s3"), ("gs", "gcs"), ("file", "local"), ("memory", "memory"), ("userdict", "userdict")]
)
def test_alias_may_not_shadow_a_registered_scheme(tmp_path, monkeypatch, name, owner):
    msg = load_error(tmp_path, monkeypatch, f'[aliases.{name}]\ntarget = "memory://x"\n')
    assert f"aliases.{name}" in msg and f"{owner!r} backend" in msg
    with pytest.raises(SettingsError, match=f"aliases.{name}"):
        ckptio.configure(aliases={name: "memory://x"})


def test_alias_shadowing_a_backend_registered_later_is_refused_on_use():
    ckptio.configure(aliases={"latecomer": "memory://late"})
    assert ckptio.resolve("latecomer://k")[1] == "memory://late/k"
    ckptio.register_backend("latecomer", ["latecomer://"])(
        type("Late", (ckptio.registry.backends.by_name("memory").load(),), {})
    )
    try:
        with pytest.raises(SettingsError, match="ckptio.configure.*aliases.latecomer.*'latecomer' backend"):
            ckptio.resolve("latecomer://k")
    finally:
        ckptio.registry.backends.unregister("latecomer")


@pytest.mark.parametrize(
    "text, key, hint",
    [
        ('[backends.s3]\nendpoint = "http://h:1"\n', "backends.s3.endpoint", "did you mean 'endpoint_url'"),
        ('[backends.s3]\npartsize = "8MiB"\n', "backends.s3.partsize", "did you mean 'part_size'"),
        ("[backends.s3]\nfrobnicate = 1\n", "backends.s3.frobnicate", "it takes: "),
        ('[backends.gcs]\nregion = "x"\n', "backends.gcs.region", "'gcs' backend has no option"),
        ("[backends.local]\ndurabel = false\n", "backends.local.durabel", "did you mean 'durable'"),
        ('[backends.memory]\ncache_dri = "/tmp/c"\n', "backends.memory.cache_dri", "did you mean 'cache_dir'"),
        (
            '[aliases.ck]\ntarget = "s3://b/x"\noptions = { endpoint = "http://h:1" }\n',
            "aliases.ck.options.endpoint",
            "did you mean 'endpoint_url'",
        ),
        (
            '[aliases.ck]\ntarget = "ck2://x"\n[aliases.ck2]\ntarget = "/tmp/x"\noptions = { durabel = 1 }\n',
            "aliases.ck2.options.durabel",
            "'local' backend",
        ),
        ('[backends.s4]\nregion = "x"\n', "backends.s4", "did you mean 's3'"),
        ('[backends.s3a]\nregion = "x"\n', "backends.s3a", "[backends.s3]"),
        ('[backends.gs]\nproject = "x"\n', "backends.gs", "[backends.gcs]"),
    ],
)
def test_unknown_options_and_backends_are_refused(tmp_path, monkeypatch, text, key, hint):
    msg = load_error(tmp_path, monkeypatch, text)
    assert key in msg and hint in msg


def test_unknown_option_from_environment(monkeypatch):
    monkeypatch.setenv("CKPTIO_S3_ENDPOINT", "http://h:1")
    with pytest.raises(SettingsError, match=r"variable CKPTIO_S3_ENDPOINT: .*did you mean 'CKPTIO_S3_ENDPOINT_URL'"):
        ckptio.settings()


def test_fsspec_backends_take_any_option_but_show_none():
    ckptio.configure(backends={"abfs": {"account_name": "acct", "sig": "S3CR3T", "anon": True}})
    shown = ckptio.settings()["backends"]["abfs"]
    assert shown == {"account_name": "***", "sig": "***", "anon": True}  # only typed options show their values


@pytest.mark.parametrize("kind", ["directory", "unreadable", "symlink loop", "not utf-8", "invalid toml"])
def test_unusable_settings_file_is_a_settings_error(tmp_path, monkeypatch, kind):
    path = tmp_path / "ckptio.toml"
    if kind == "directory":
        path.mkdir()
    elif kind == "unreadable":
        if os.geteuid() == 0:
            pytest.skip("root reads any file (the symlink-loop case covers other read errors)")
        path.write_text('[backends.s3]\nregion = "x"\n')
        path.chmod(0)
    elif kind == "symlink loop":
        path.symlink_to(path)
    elif kind == "not utf-8":
        path.write_bytes(b'[backends.s3]\nregion = "\xff\xfe"\n')
    else:
        path.write_text("[backends.s3]\nregion = \n")
    monkeypatch.setenv("CKPTIO_CONFIG", str(path))
    with pytest.raises(SettingsError) as e:
        ckptio.resolve("memory://a")
    reason = {
        "directory": "is a directory",
        "unreadable": "cannot read",
        "symlink loop": "cannot read",
        "not utf-8": "not UTF-8",
        "invalid toml": "not valid TOML",
    }[kind]
    assert str(path) in str(e.value) and reason in str(e.value)
    with pytest.raises(SettingsError, match=reason):
        ckptio.configure(settings_file=str(path))


SECRET = "S3CR3T-VALUE-42"


@pytest.mark.parametrize(
    "text",
    [
        f'[backends.s3]\nsecret_acess_key = "{SECRET}"\n',  # a typo in a secret's name: refused, value not echoed
        f'[backends.s3]\npassword_for_thing = "{SECRET}"\n',
        f'[backends.s3]\nendpoint_url = "user:{SECRET}@host:9000"\n',  # invalid value holding a credential
        f'[backends.s3]\nendpoint_url = "https://user:{SECRET}@host:9000"\nconcurrency = 0\n',
        f'[backends.nosuch]\ntoken = "{SECRET}"\n',
        f'[aliases.ck]\ntarget = "s3://b/x"\noptions = {{ sekret = "{SECRET}" }}\n',
        f'[aliases.ck]\ntarget = "ck://{SECRET}"\n',  # a cycle: the targets are not echoed
    ],
)
def test_errors_never_echo_secrets(tmp_path, monkeypatch, text):
    assert SECRET not in load_error(tmp_path, monkeypatch, text)


def test_unknown_keys_and_url_credentials_are_never_shown(tmp_path, monkeypatch):
    f = write(
        tmp_path / "s.toml",
        f"""
        [backends.abfs]
        account_name = "{SECRET}"
        client_kwargs = {{ nested = "{SECRET}" }}
        [backends.s3]
        endpoint_url = "https://user:{SECRET}@host:9000"
        [aliases.ck]
        target = "https://user:{SECRET}@host/x?sig={SECRET}"
        [path_mapping]
        "s3://old/" = "https://u:{SECRET}@h/new/?token={SECRET}"
    """,
    )
    monkeypatch.setenv("CKPTIO_CONFIG", f)
    shown = ckptio.settings()
    assert SECRET not in repr(shown) and SECRET not in repr(config.load()) and SECRET not in repr(config.load().aliases)
    assert shown["backends"]["s3"]["endpoint_url"] == "https://***@host:9000"
    assert shown["aliases"]["ck"]["target"] == "https://***@host/x?***"
    assert shown["backends"]["abfs"] == {"account_name": "***", "client_kwargs": {"nested": "***"}}


@pytest.mark.parametrize(
    "url, want",
    [
        ("https://user:p@ss@host:9000/x", "https://***@host:9000/x"),  # an unencoded '@' in the password
        ("user:p@ss@host", "***@host"),
        ("https://host/a@b?sig=1", "https://host/a@b?***"),  # an '@' in the path is not a credential
    ],
)
def test_url_credentials_are_masked_up_to_the_last_at_sign(url, want):
    assert config.redact_url(url) == want
