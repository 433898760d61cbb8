"""The errors a user meets for a misspelt option name the thing the user wrote: a ``CKPTIO_*`` variable (and
its value, unless secret), the public call (``load``, ``dump``, ``load_into``) with its real options and the
closest one, the ``ckptio`` command's option; never an internal function or a settings path."""

from __future__ import annotations

import json
import os
import textwrap

import numpy as np
import pytest
import torch

import ckptio
from ckptio import cli, config
from ckptio.errors import SettingsError, UnknownOptionError
from fuzzing import fuzz_in_child

SECRET = "hunter2-S3CR3T"


@pytest.mark.parametrize(
    "var,value,said",
    [
        ("CKPTIO_S3_PART_SIZE", "abc", "'abc'"),
        ("CKPTIO_S3_TIMEOUT", "-1", "'-1'"),
        ("CKPTIO_GCS_ANON", "maybe", "'maybe'"),
        ("CKPTIO_S3_PARTSIZE", "64MiB", "did you mean 'CKPTIO_S3_PART_SIZE'"),
    ],
)
def test_a_bad_environment_variable_is_named(monkeypatch, var, value, said):
    monkeypatch.setenv(var, value)
    with pytest.raises(SettingsError) as e:
        ckptio.resolve("memory://b/x")
    assert f"environment variable {var}" in str(e.value) and said in str(e.value)


@pytest.mark.parametrize("var", ["CKPTIO_S3_SECRET_ACCES_KEY", "CKPTIO_S3_SESION_TOKEN", "CKPTIO_S3_CREDENTIALS_FIL"])
def test_a_misspelt_secret_variable_is_named_without_its_value(monkeypatch, var):
    monkeypatch.setenv(var, SECRET)
    with pytest.raises(SettingsError) as e:
        ckptio.resolve("memory://b/x")
    assert var in str(e.value) and SECRET not in str(e.value) and "did you mean 'CKPTIO_S3_" in str(e.value)


def _files(tmp_path) -> dict[str, str]:
    out = {}
    for ext, obj in {
        "fpk": {"w": torch.ones(2)},
        "pt": {"w": torch.ones(2)},
        "safetensors": {"w": torch.ones(2)},
        "json": {"a": 1},
        "pkl": {"a": 1},
        "npy": np.ones(2),
        "msgpack": {"a": 1},
    }.items():
        out[ext] = str(tmp_path / f"x.{ext}")
        ckptio.dump(obj, out[ext])
    return out


@pytest.mark.parametrize("ext", ["fpk", "pt", "safetensors", "json", "pkl", "npy", "msgpack"])
def test_a_misspelt_load_keyword_names_load_and_its_options(tmp_path, ext):
    path = _files(tmp_path)[ext]
    with pytest.raises(UnknownOptionError) as e:
        ckptio.load(path, mmmap=True)
    msg = str(e.value)
    assert isinstance(e.value, TypeError)
    assert msg.startswith("load() got an unexpected keyword argument 'mmmap'") and path in msg
    assert "file_format" in msg and "cache" in msg  # load's own options are among those named
    if ext in ("fpk", "pt", "safetensors"):
        assert "did you mean 'mmap'?" in msg
    for internal in ("load_source", "Unpickler", "JSONDecoder", "SafetensorsFormat", "unpackb"):
        assert internal not in msg


@pytest.mark.parametrize("ext", ["fpk", "pt", "safetensors", "json"])
def test_a_misspelt_dump_keyword_names_dump_and_its_options(tmp_path, ext):
    path = str(tmp_path / f"y.{ext}")
    with pytest.raises(UnknownOptionError, match=r"^dump\(\) got an unexpected keyword argument 'durabel'; did you"):
        ckptio.dump({"w": torch.ones(2)}, path, durabel=False)
    assert not os.path.exists(path)


def test_load_into_and_the_distributed_load_name_themselves(tmp_path):
    m = torch.nn.Linear(2, 2)
    path = str(tmp_path / "m.fpk")
    ckptio.dump(m.state_dict(), path)
    with pytest.raises(UnknownOptionError, match=r"^load_into\(\) .* 'map_locaton'; did you mean 'map_location'"):
        ckptio.load_into(m, path, map_locaton="cpu")
    ckptio.load_into(m, path, map_location="cpu", cache=False, verify=True)  # load's options pass through
    from ckptio import distributed

    with pytest.raises(UnknownOptionError, match=r"^load\(\) .* 'mmmap'; did you mean 'mmap'"):
        distributed.load(path, mmmap=True)


def test_the_options_a_format_takes_still_work(tmp_path):
    files = _files(tmp_path)
    assert ckptio.load(files["pt"], map_location="cpu", weights_only=True, mmap=False)["w"].sum() == 2
    assert ckptio.load(files["fpk"], keys=["w"], verify=True)["w"].sum() == 2
    assert ckptio.load(files["json"], object_pairs_hook=dict) == {"a": 1}

    class Decoder(json.JSONDecoder):  # a caller's own class takes keywords ckptio cannot know
        def __init__(self, *, shout: bool = False, **kw):
            super().__init__(**kw)

    assert ckptio.load(files["json"], cls=Decoder, shout=True) == {"a": 1}
    ckptio.dump({"a": 1}, str(tmp_path / "z.json"), indent=2, sort_keys=True)


def test_options_the_underlying_library_takes_still_work(tmp_path):
    """A keyword the library under a format takes passes, as it did before keywords were checked: json's
    decoder ``strict``, msgpack's packer ``autoreset``/``buf_size``."""
    path = tmp_path / "ctl.json"
    path.write_text('{"a": "x\ty"}')  # a raw tab: only strict=False decodes it
    assert ckptio.load(str(path), strict=False) == {"a": "x\ty"}
    ckptio.dump({"a": 1}, str(tmp_path / "x.msgpack"), autoreset=True, buf_size=1 << 16)
    assert ckptio.load(str(tmp_path / "x.msgpack")) == {"a": 1}


def test_a_plugin_format_takes_its_own_options(tmp_path):
    """A plug-in format's options are those its ``load``/``dump`` take by keyword, written with or without
    ``*``; a subclass of a built-in format that adds one takes it (the declared options of its base describe
    the base's methods, not the subclass's)."""
    from ckptio.formats.simple import JsonFormat

    @ckptio.register_format("shout", extensions=[".shout"])
    class Shout(ckptio.Format):
        def dump(self, obj, backend, uri, mode="overwrite", loud=False):
            backend.write(uri, (obj.upper() if loud else obj).encode(), mode=mode)

        def load(self, backend, uri, lower=False):
            text = backend.read(uri).decode()
            return text.lower() if lower else text

    @ckptio.register_format("tagged_json", extensions=[".tjson"])
    class Tagged(JsonFormat):
        def load_file(self, f, *, tag=None, **kw):
            return {"tag": tag, **super().load_file(f, **kw)}

    try:
        path = str(tmp_path / "x.shout")
        ckptio.dump("Hi", path, loud=True)
        assert ckptio.load(path, lower=True) == "hi"
        with pytest.raises(UnknownOptionError, match="'lowre'; did you mean 'lower'"):
            ckptio.load(path, lowre=True)
        path = str(tmp_path / "x.tjson")
        ckptio.dump({"a": 1}, path, indent=1)
        assert ckptio.load(path, tag="t", object_pairs_hook=dict) == {"tag": "t", "a": 1}
    finally:
        ckptio.registry.formats.unregister("shout")
        ckptio.registry.formats.unregister("tagged_json")


PLUGIN_FUZZ = textwrap.dedent(
    r"""
    import json, os, random, sys
    import torch
    import ckptio
    from ckptio.errors import UnknownOptionError
    from ckptio.formats.simple import JsonFormat, PickleFormat
    from ckptio.formats.torch import TorchFormat

    seed, n, root = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    rng = random.Random(seed)
    NAMES = ["tag", "level", "lower", "verbose", "shards", "codec", "strict_shapes", "dtype", "prefix", "limit"]
    SEEN = {}
    BASES = {"Format": ({"a": 1}, None), "JsonFormat": ({"a": 1}, JsonFormat), "PickleFormat": ({"a": 1}, PickleFormat),
             "TorchFormat": ({"a": torch.ones(1)}, TorchFormat)}

    def params(names, var_kw):
        out, star = [], False
        for name in names:
            if rng.random() < 0.5 and not star:
                out.append(f"{name}=None")  # positional-or-keyword, with a default
            else:
                out.append(("" if star else "*, ") + f"{name}=None")
                star = True
        return ", ".join(out + (["**kw"] if var_kw else []))

    def source(i, base, names, var_kw):
        rec = "SEEN.update({" + ", ".join(f"{n!r}: {n}" for n in names) + "})"
        if base == "Format":
            body = [
                f"class F{i}(ckptio.Format):",
                f"    def dump(self, obj, backend, uri, mode='overwrite', {params(names, var_kw)}):",
                f"        {rec}",
                "        backend.write(uri, b'x', mode=mode)",
                f"    def load(self, backend, uri, {params(names, var_kw)}):",
                f"        {rec}",
                "        return {'a': 1}",
            ]
        else:
            own = ", ".join(f"{n}=None" for n in names)
            op, args = ("load", "backend, uri") if base == "TorchFormat" else ("load_file", "f")
            body = [
                f"class F{i}({base}):",
                f"    def {op}(self, {args}, *, {own}, **kw):",
                f"        {rec}",
                f"        return super().{op}({args}, **kw)",
            ]
        return chr(10).join(body) + chr(10)

    out = []
    for i in range(n):
        base = rng.choice(sorted(BASES))
        names = rng.sample(NAMES, rng.randrange(1, 4))
        var_kw = base != "Format" or rng.random() < 0.3
        ns = {"ckptio": ckptio, "SEEN": SEEN, **{b: v[1] for b, v in BASES.items() if v[1] is not None}}
        exec(source(i, base, names, var_kw), ns)
        ckptio.register_format(f"fuzz{i}", extensions=[f".fz{i}"])(ns[f"F{i}"])
        path = os.path.join(root, f"x.fz{i}")
        ckptio.dump(BASES[base][0], path)
        case = {"base": base, "names": names, "var_kw": var_kw}
        try:
            for name in names:
                SEEN.clear()
                ckptio.load(path, **{name: i})
                case.setdefault("received", []).append(SEEN.get(name))
            SEEN.clear()
            if base == "Format":
                ckptio.dump({"a": 1}, path, **{names[0]: -i})
                case["dumped"] = SEEN.get(names[0])
            case["outcome"] = "ok"
        except Exception as e:
            case["outcome"] = f"{type(e).__name__}: {e}"
        try:
            ckptio.load(path, **{names[0] + "x": 1})
            case["misspelt"] = "ok"
        except UnknownOptionError:
            case["misspelt"] = "refused"
        except Exception as e:
            case["misspelt"] = type(e).__name__
        out.append(case)
    print(json.dumps(out))
    """
)


def test_fuzz_plugin_format_options(tmp_path):
    """Plug-in formats generated at random (on ``Format`` with options written with or without ``*`` and with
    or without ``**kwargs``; subclasses of the json, pickle and torch formats adding options), in a child:
    every option a format's own methods take reaches them through ``ckptio.load``/``dump``; a misspelt one is
    refused by a format whose methods take no ``**kwargs`` (and passed on by the others, as before)."""
    cases = fuzz_in_child(PLUGIN_FUZZ, 3, 60, str(tmp_path))
    assert len(cases) == 60 and {c["base"] for c in cases} == {"Format", "JsonFormat", "PickleFormat", "TorchFormat"}
    i = 0
    for i, c in enumerate(cases):
        assert c["outcome"] == "ok" and c["received"] == [i] * len(c["names"]), c
        assert c.get("dumped", -i) == -i, c
        if not c["var_kw"]:
            assert c["misspelt"] == "refused", c
        else:
            assert c["misspelt"] != "refused", c


def test_the_cli_suggests_the_closest_option(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["ls", "--recursve", "/tmp"])
    assert e.value.code == 2
    assert "did you mean --recursive?" in capsys.readouterr().err


FUZZ = textwrap.dedent(
    r"""
    import json, os, random, sys
    import numpy as np, torch
    import ckptio
    from ckptio.errors import SettingsError, UnknownOptionError

    seed, n, root, secret = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    rng = random.Random(seed)
    files = {}
    for ext, obj in {"fpk": {"w": torch.ones(2)}, "pt": {"w": torch.ones(2)}, "safetensors": {"w": torch.ones(2)},
                     "json": {"a": 1}, "pkl": {"a": 1}, "npy": np.ones(2), "msgpack": {"a": 1}}.items():
        files[ext] = os.path.join(root, "x." + ext)
        ckptio.dump(obj, files[ext])
    WORDS = ["mmap", "map_location", "weights_only", "keys", "verify", "allow_pickle", "cache", "progress",
             "durable", "object_hook", "mmap_mode", "encoding", "metadata", "file_format", "backend_args"]
    OPTIONS = ["part_size", "endpoint_url", "timeout", "max_attempts", "secret_access_key", "session_token",
               "stall_timeout", "anon", "region", "credentials_file", "concurrency", "deadline"]

    def typo(word):
        i = rng.randrange(len(word))
        how = rng.choice(["drop", "double", "swap", "case", "extra"])
        if how == "drop":
            return word[:i] + word[i + 1:]
        if how == "double":
            return word[:i] + word[i] + word[i:]
        if how == "swap" and i + 1 < len(word):
            return word[:i] + word[i + 1] + word[i] + word[i + 2:]
        if how == "case":
            return word.upper()
        return word + rng.choice(["s", "_", "x"])

    out = []
    for _ in range(n):
        if rng.random() < 0.5:
            ext, word = rng.choice(sorted(files)), typo(rng.choice(WORDS))
            op = rng.choice(["load", "dump", "load_into"])
            try:
                if op == "load":
                    ckptio.load(files[ext], **{word: None})
                elif op == "dump":
                    ckptio.dump({"w": torch.ones(2)} if ext != "npy" else np.ones(2),
                                os.path.join(root, "d." + ext), **{word: None})
                else:
                    ckptio.load_into({"w": torch.zeros(2)}, files[ext], strict=False, **{word: None})
                out.append({"case": [op, ext, word], "outcome": "ok"})
            except UnknownOptionError as e:
                out.append({"case": [op, ext, word], "outcome": "refused", "msg": str(e)})
            except Exception as e:
                out.append({"case": [op, ext, word], "outcome": type(e).__name__, "msg": str(e)})
        else:
            backend = rng.choice(["S3", "LOCAL"])
            var = "CKPTIO_%s_%s" % (backend, typo(rng.choice(OPTIONS)).upper())
            value = rng.choice([secret, "-3", "12abc", "yes-no", "http//x"])
            os.environ[var] = value
            ckptio.reset()
            try:
                ckptio.settings()
                out.append({"case": [var, value], "outcome": "ok"})
            except SettingsError as e:
                out.append({"case": [var, value], "outcome": "refused", "msg": str(e)})
            except Exception as e:
                out.append({"case": [var, value], "outcome": type(e).__name__, "msg": str(e)})
            finally:
                del os.environ[var]
    print(json.dumps(out))
    """
)
INTERNAL = (
    "load_source",
    "Unpickler",
    "JSONDecoder",
    "JSONEncoder",
    "Format.",
    "unpackb",
    "packb",
    "save()",
    "__init__",
    "backends.s3.",
    "backends.gcs.",
)


def test_fuzz_misspelt_options(tmp_path):
    """Misspelt keywords (dropped, doubled, swapped letters, case) of every format's load/dump/load_into and
    misspelt or mistyped ``CKPTIO_*`` variables, in a child: each works (a real option) or is refused naming
    the public call or the variable, never an internal name and never a secret value."""
    cases = fuzz_in_child(FUZZ, 11, 200, str(tmp_path), "S3CR3T-" + "x" * 8)
    refused = 0
    for c in cases:
        assert c["outcome"] in ("ok", "refused"), c
        msg = c.get("msg", "")
        if "S3CR3T" in msg:  # only a typed option that is no secret shows its value
            option = c["case"][0].split("_", 2)[2].lower()
            assert option in config.OPTION_TYPES and not config.is_secret(option), c
        assert not any(name in msg for name in INTERNAL), c
        if c["outcome"] == "refused":
            refused += 1
            first = c["case"][0]
            assert (
                msg.startswith(f"{first}() got an unexpected keyword")
                if first in ("load", "dump", "load_into")
                else f"environment variable {first}" in msg
            ), c
    assert refused > 100, refused
