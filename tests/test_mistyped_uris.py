"""A string that reads as a URI with its '//' missing or mangled (``s3:/b/k``, ``s3:b``, `` s3://b``,
``S3 ://b``) is refused with the fix at the one resolver, for every call and the CLI; it never becomes a
local file named ``s3:``. Local paths with a ':' deeper in them, or before a name that is no scheme, work."""

from __future__ import annotations

import os
import pathlib
import re
import textwrap

import pytest

import ckptio
from ckptio import cli
from ckptio.errors import InvalidURIError, UnknownFormatError, UnknownOptionError
from fuzzing import fuzz_in_child

MISTYPED = [
    ("s3:/team-bucket/x.pt", "s3://team-bucket/x.pt"),
    ("s3:team-bucket/x.pt", "s3://team-bucket/x.pt"),
    (" s3://team-bucket/x.pt", "s3://team-bucket/x.pt"),
    ("S3 ://team-bucket/x.pt", "s3://team-bucket/x.pt"),
    ("gs:/b/x.json", "gs://b/x.json"),
    ("memory:/b/x.json", "memory://b/x.json"),
    ("s3a:\\b\\x.json", "s3a://b\\x.json"),
    ("file:/tmp/x.json", "file:///tmp/x.json"),
]


@pytest.mark.parametrize("given,fix", MISTYPED)
def test_a_mistyped_uri_is_refused_with_the_fix(tmp_path, monkeypatch, given, fix):
    monkeypatch.chdir(tmp_path)
    for call in (
        lambda: ckptio.dump({"a": 1}, given, file_format="json"),
        lambda: ckptio.load(given, file_format="json"),
        lambda: ckptio.exists(given),
        lambda: ckptio.list_dir_or_file(given),
        lambda: ckptio.put(b"x", given),
    ):
        with pytest.raises(InvalidURIError, match=re.escape(f"did you mean {fix!r}")):
            call()
    assert os.listdir(tmp_path) == []


def test_a_path_object_of_a_uri_is_refused():
    with pytest.raises(InvalidURIError, match="did you mean 's3://b/x.pt'"):
        ckptio.dump({"a": 1}, pathlib.Path("s3://b/x.pt"))  # pathlib folds '//' into '/'


def test_an_alias_missing_its_slashes_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckptio.configure(aliases={"ckpt": "memory://team/checkpoints"})
    with pytest.raises(InvalidURIError, match="did you mean 'ckpt://run7/x.json'"):
        ckptio.dump({"a": 1}, "ckpt:/run7/x.json")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("path", ["./a:b.json", "x:y/z.json", "C:/data/x.json", "notes:today.json", "./s3:/b.json"])
def test_local_paths_with_a_colon_still_work(tmp_path, monkeypatch, path):
    monkeypatch.chdir(tmp_path)
    ckptio.dump({"a": 1}, path)
    assert ckptio.load(path) == {"a": 1} and ckptio.exists(path)
    absolute = str(tmp_path / "deep:er" / "x:y.json")
    ckptio.dump({"b": 2}, absolute)
    assert ckptio.load(absolute) == {"b": 2}


def test_cli_ls_of_a_mistyped_uri_says_the_fix(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    os.makedirs("s3:/team-bucket")  # what an earlier dump(x, "s3:/team-bucket/x.pt") used to leave
    assert cli.main(["ls", "s3:/team-bucket"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "did you mean 's3://team-bucket'" in err and "./s3:/team-bucket" in err


SECRET = "S3CR3T-PW-4711"


@pytest.mark.parametrize(
    "given",
    [
        f"s3:/AKIAEXAMPLE:{SECRET}@team-bucket/x.pt",
        f"s3:AKIAEXAMPLE:{SECRET}@team-bucket/x.pt",
        f" S3 ://user:{SECRET}@team-bucket/x.pt",
        f"https:/user:{SECRET}@host/x.pt",
        f"https:/host/x.pt?X-Amz-Signature={SECRET}",
        f"memory:/b/x.pt?token={SECRET}",
    ],
)
def test_a_mistyped_uri_never_shows_its_credentials(tmp_path, monkeypatch, capsys, given):
    """The error repeats the string it refuses: what ``redact`` masks in the URI it stands for is masked
    there too, in the error and in the CLI's output."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidURIError) as e:
        ckptio.exists(given)
    assert SECRET not in str(e.value) and "did you mean" in str(e.value) and "***" in str(e.value)
    with pytest.raises((UnknownOptionError, UnknownFormatError)) as e:  # refused before the URI is looked at
        ckptio.load(given, mmmap=True)
    assert SECRET not in str(e.value)
    assert cli.main(["ls", given]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert SECRET not in err and "did you mean" in err


CREDENTIALS_FUZZ = textwrap.dedent(
    r"""
    import contextlib, io, json, pickle, random, sys
    import ckptio
    from ckptio import cli
    from ckptio.errors import InvalidURIError, UnknownFormatError, UnknownOptionError

    seed, n, secret = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    rng = random.Random(seed)
    ckptio.configure(aliases={"ckpt": "memory://aliased"}, backends={"s3": {"anon": True}, "gcs": {"anon": True}})
    SCHEMES = ["s3", "s3a", "gs", "gcs", "memory", "file", "https", "http", "ckpt"]
    SEPS = [":/", ":", ":\\\\", ": //", " ://", ":/ /"]

    def case():
        scheme = "".join(c.upper() if rng.random() < 0.3 else c for c in rng.choice(SCHEMES))
        user = rng.choice(["", "user:", "AKIAEXAMPLE:", ":"])
        where = rng.choice(["userinfo", "query", "both"])
        host = rng.choice(["b", "team-bucket", "host:9000", "127.0.0.1"])
        path = "/".join(rng.choice(["k", "run7", "x.pt", "%41"]) for _ in range(rng.randrange(1, 4)))
        auth = f"{user}{secret}@" if where != "query" else ""
        query = "?" + rng.choice(["X-Amz-Signature=", "token=", "sig="]) + secret if where != "userinfo" else ""
        if where == "both" and rng.random() < 0.5:
            query += "&X-Amz-Credential=" + secret
        return rng.choice(["", " ", "	"]) + scheme + rng.choice(SEPS) + auth + host + "/" + path + query

    out = []
    for _ in range(n):
        uri = case()
        shown = []
        calls = (ckptio.resolve, ckptio.exists, lambda u: ckptio.put(b"x", u), ckptio.list_dir_or_file,
                 lambda u: ckptio.load(u, mmmap=True), lambda u: ckptio.dump({}, u, indnt=1))
        for call in calls:
            try:
                call(uri)
                shown.append(["ok", ""])
            except Exception as e:
                text = " ".join([str(e), repr(e), repr(pickle.dumps(e)), repr(getattr(e, "__notes__", []))])
                shown.append([type(e).__name__, text])
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = cli.main(["ls", uri])
        shown.append(["cli", str(code) + " " + err.getvalue()])
        out.append({"uri": uri, "shown": shown})
    print(json.dumps(out))
    """
)


REFUSED = ("InvalidURIError", "UnknownOptionError", "UnknownFormatError")  # a misspelt keyword, a query as extension


def test_fuzz_mistyped_uris_never_show_credentials(tmp_path):
    """Mistyped URIs of every kind of scheme (and an alias) carrying a secret in their userinfo, their query
    string or both, through resolve/exists/put/list, load/dump with a misspelt keyword and ``ckptio ls`` in a
    child: each is refused (a mistyped URI, the keyword, or a query read as the extension) and the secret
    appears in no error's str, repr, pickle or notes, nor in the CLI's output."""
    cases = fuzz_in_child(CREDENTIALS_FUZZ, 5, 150, SECRET, cwd=tmp_path)
    assert len(cases) == 150
    for c in cases:
        for kind, text in c["shown"]:
            assert SECRET not in text, (kind, c["uri"], text)
            assert kind in REFUSED or (kind == "cli" and text.startswith(str(cli.EXIT_USAGE))), c
    assert os.listdir(tmp_path) == []


FUZZ = textwrap.dedent(
    r"""
    import json, os, random, sys
    import ckptio
    from ckptio.errors import CkptioError, InvalidURIError

    seed, n, root = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    rng = random.Random(seed)
    ckptio.configure(aliases={"ckpt": "memory://aliased"}, backends={"s3": {"anon": True}, "gcs": {"anon": True}})
    SCHEMES = ["s3", "s3a", "gs", "gcs", "memory", "file", "ckpt"]
    SEPS = ["://", ":/", ":", ":\\", ": //", " ://"]

    def cased(s):
        return "".join(c.upper() if rng.random() < 0.3 else c for c in s)

    def case():
        scheme = rng.choice(SCHEMES)
        sep = rng.choice(SEPS) if rng.random() < 0.8 else "://"
        lead = rng.choice(["", "", " ", "\t"])
        name = f"b{rng.randrange(4)}/k{rng.randrange(1000)}.json"
        if scheme == "file":  # file:///abs/path; one slash fewer is the mistyped form
            name = os.path.join(root, "files", name).lstrip("/")
            sep = sep.replace("//", "///")
        return scheme, lead + cased(scheme) + sep + name, name

    def expect_target(scheme, name):
        # where a well-formed URI of this case leads, as a canonical URI
        return "/" + name if scheme == "file" else f"{scheme}://{name}"

    out = []
    for _ in range(n):
        scheme, uri, name = case()
        well_formed = uri.lower().startswith(scheme + "://")
        results = {}
        for op in ("resolve", "dump", "exists", "load", "ls"):
            try:
                if op == "resolve":
                    backend, resolved = ckptio.resolve(uri)
                    results[op] = ("ok", backend.name, resolved)
                elif scheme in ("s3", "s3a", "gs", "gcs"):
                    continue  # no server: the resolver's answer is the case
                elif op == "dump":
                    ckptio.dump({"v": uri}, uri)
                    results[op] = ("ok",)
                elif op == "exists":
                    results[op] = ("ok", ckptio.exists(uri))
                elif op == "load":
                    results[op] = ("ok", ckptio.load(uri))
                else:
                    results[op] = ("ok", sorted(ckptio.list_dir_or_file(uri.rsplit("/", 1)[0])))
            except CkptioError as e:
                results[op] = ("error", type(e).__name__, str(e))
            except Exception as e:  # not a clear error
                results[op] = ("raw", type(e).__name__, str(e))
        target = None
        if scheme not in ("s3", "s3a", "gs", "gcs") and results.get("dump", ("x",))[0] == "ok":
            t = expect_target(scheme if scheme != "ckpt" else "memory", name if scheme != "ckpt" else "aliased/" + name)
            target = ckptio.load(t) if ckptio.exists(t) else None
        out.append({"uri": uri, "scheme": scheme, "name": name, "well_formed": well_formed,
                    "results": results, "target": target})
    print(json.dumps(out))
    """
)


def _bad_names(top: str) -> list[str]:
    return [os.path.join(d, n) for d, dirs, files in os.walk(top) for n in dirs + files if ":" in n]


def test_fuzz_mistyped_uris(tmp_path):
    """Random schemes and aliases with 0-3 slashes, a mangled separator, case changes and stray spaces,
    through resolve/dump/exists/load/ls in a child: each case is its correct target or an error naming the
    fix; nothing named like a URI is ever created locally."""
    work = tmp_path / "cwd"
    work.mkdir()
    cases = fuzz_in_child(FUZZ, 7, 300, str(tmp_path), cwd=work, keep_ckptio_env=True)
    assert len(cases) == 300
    assert _bad_names(str(tmp_path)) == []
    kinds = {"refused": 0, "ok": 0}
    for c in cases:
        res = c["results"]
        assert all(r[0] != "raw" for r in res.values()), c
        if c["well_formed"]:
            assert res["resolve"][0] == "ok", c
            if "dump" in res:
                assert res["dump"] == ["ok"] and res["load"] == ["ok", {"v": c["uri"]}], c
                assert c["target"] == {"v": c["uri"]}, c  # written where the well-formed URI points
            kinds["ok"] += 1
        else:
            fix = f"file:///{c['name']}" if c["scheme"] == "file" else f"{c['scheme']}://{c['name']}"
            for op, r in res.items():
                want = fix.rsplit("/", 1)[0] if op == "ls" else fix  # ls lists the URI's parent
                assert r[0] == "error" and r[1] == "InvalidURIError" and f"did you mean {want!r}" in r[2], (op, c)
            kinds["refused"] += 1
    assert kinds["refused"] > 50 and kinds["ok"] > 20, kinds
