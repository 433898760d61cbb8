"""The easy_io face: dump/load by extension, file operations, easy_io compatibility, bad input."""

from __future__ import annotations

import io
import itertools
import json
import os
import pathlib
from collections import OrderedDict

import numpy as np
import pytest
import torch

import ckptio
from ckptio.errors import SettingsError, UnknownFormatError, UnknownSchemeError


@pytest.fixture(params=["local", "memory"])
def root(request, tmp_path):
    return str(tmp_path) if request.param == "local" else f"memory://io-{os.getpid()}"


def model_state():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    o = torch.optim.Adam(m.parameters())
    m(torch.randn(3, 8)).sum().backward()
    o.step()
    return {"model": m.state_dict(), "optim": o.state_dict(), "step": 7}


@pytest.mark.parametrize(
    "name, obj",
    [
        ("a.json", {"a": [1, 2, {"b": None}]}),
        ("a.yaml", {"a": [1, 2]}),
        ("a.pkl", {"a": {1, 2}, "b": (1, 2)}),
        ("a.msgpack", {"a": [1, 2], 3: b"x"}),
        ("a.txt", "hello\nworld"),
        ("a.bin", b"\x00\x01raw"),
        ("a.npy", np.arange(12, dtype=np.float32).reshape(3, 4)),
    ],
)
def test_dump_load_by_extension(root, name, obj):
    uri = ckptio.join_path(root, "sub", name)
    ckptio.dump(obj, uri)
    back = ckptio.load(uri)
    if isinstance(obj, np.ndarray):
        np.testing.assert_array_equal(back, obj)
    else:
        assert back == obj


@pytest.mark.parametrize("name", ["m.pt", "m.pth", "m.ckpt", "m.pth.tar"])
def test_torch_formats_and_longest_extension(root, name):
    uri = ckptio.join_path(root, name)
    state = model_state()
    ckptio.dump(state, uri)
    back = ckptio.load(uri, map_location="cpu")
    assert torch.equal(back["model"]["0.weight"], state["model"]["0.weight"])
    assert back["step"] == 7


def test_torch_load_from_memory_needs_no_temporary_file(memory_uri, monkeypatch):
    """memory:// objects are loaded from memory (no copy through a temporary file); ``mmap=True`` still
    works (through one), and weights_only still applies."""
    import ckptio.backends.base as base

    uri = memory_uri + "/m.pt"
    state = model_state()
    ckptio.dump(state, uri)
    made = []
    real = base.tempfile.mkdtemp
    monkeypatch.setattr(base.tempfile, "mkdtemp", lambda *a, **k: made.append(1) or real(*a, **k))
    back = ckptio.load(uri)
    assert torch.equal(back["model"]["0.weight"], state["model"]["0.weight"]) and not made
    back = ckptio.load(uri, mmap=True)
    assert torch.equal(back["model"]["0.weight"], state["model"]["0.weight"]) and made


def test_torch_load_is_weights_only_by_default(root):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    uri = ckptio.join_path(root, "evil.pt")
    ckptio.dump({"x": Evil()}, uri)
    with pytest.raises(Exception) as e:
        ckptio.load(uri)
    assert "weights_only" in str(e.value) or "Unsupported" in str(e.value)


def test_dump_without_file_and_file_objects():
    assert json.loads(ckptio.dump({"a": 1}, file_format="json")) == {"a": 1}
    buf = io.BytesIO()
    ckptio.dump({"a": 1}, buf, file_format="json")
    buf.seek(0)
    assert ckptio.load(buf, file_format="json") == {"a": 1}
    buf = io.BytesIO()
    ckptio.dump({"t": torch.ones(2)}, buf, file_format="pt")
    buf.seek(0)
    assert torch.equal(ckptio.load(buf, file_format="pt")["t"], torch.ones(2))


def _text_file_objects(tmp_path):
    """Text file objects as callers hand them to dump: the io classes and tempfile's wrappers."""
    import tempfile

    yield "StringIO", io.StringIO()
    for mode in ("r+", "w", "w+"):
        yield f"NamedTemporaryFile({mode!r})", tempfile.NamedTemporaryFile(mode, dir=tmp_path)
    yield "SpooledTemporaryFile('w+')", tempfile.SpooledTemporaryFile(mode="w+")
    yield "SpooledTemporaryFile('w+', rolled over)", tempfile.SpooledTemporaryFile(max_size=1, mode="w+")
    yield "TemporaryFile('w+')", tempfile.TemporaryFile("w+", dir=tmp_path)
    yield "open('w')", open(tmp_path / "plain.txt", "w")
    yield "open('w+')", open(tmp_path / "plain2.txt", "w+")


def _binary_file_objects(tmp_path):
    import tempfile

    yield "BytesIO", io.BytesIO()
    yield "NamedTemporaryFile('w+b')", tempfile.NamedTemporaryFile("w+b", dir=tmp_path)
    yield "SpooledTemporaryFile()", tempfile.SpooledTemporaryFile()
    yield "open('wb')", open(tmp_path / "plain.bin", "wb")
    yield "open('wb', buffering=0)", open(tmp_path / "raw.bin", "wb", buffering=0)


@pytest.mark.parametrize("file_format, obj", [("json", {"a": [1, "x"]}), ("yaml", {"a": [1, "x"]}), ("txt", "hé")])
def test_dump_into_text_and_binary_file_objects(tmp_path, file_format, obj):
    """Text or binary, whatever wraps it (tempfile's wrappers are not io.TextIOBase): what is written
    reads back, as mmengine's dump into a NamedTemporaryFile('r+') does."""
    for kind, objects in (("text", _text_file_objects), ("binary", _binary_file_objects)):
        for name, f in objects(tmp_path):
            with f:
                ckptio.dump(obj, f, file_format=file_format)
                f.flush()
                r = f if f.readable() else open(f.name, "r" if kind == "text" else "rb")
                r.seek(0)
                data = r.read()
                assert isinstance(data, str if kind == "text" else bytes), name
                r.seek(0)
                assert ckptio.load(r, file_format=file_format) == obj, name
                if r is not f:
                    r.close()


def test_file_format_overrides_extension(root):
    uri = ckptio.join_path(root, "noext")
    ckptio.dump({"a": 1}, uri, file_format="json")
    assert ckptio.load(uri, file_format="json") == {"a": 1}


def test_put_get_text_exists_stat(root):
    uri = ckptio.join_path(root, "d", "x.bin")
    assert not ckptio.exists(uri)
    ckptio.put(b"abc", uri)
    assert ckptio.exists(uri) and ckptio.isfile(uri) and not ckptio.isdir(uri)
    assert ckptio.isdir(ckptio.join_path(root, "d"))
    assert ckptio.get(uri) == b"abc"
    assert ckptio.stat(uri).size == 3
    ckptio.put_text("héllo", ckptio.join_path(root, "t.txt"))
    assert ckptio.get_text(ckptio.join_path(root, "t.txt")) == "héllo"
    buf = bytearray(2)
    assert ckptio.readinto(uri, buf, 1) == 2 and buf == b"bc"


def test_create_mode_refuses_existing_and_keeps_it(root):
    uri = ckptio.join_path(root, "c.json")
    ckptio.dump({"v": 1}, uri, mode="create")
    with pytest.raises(FileExistsError) as e:
        ckptio.dump({"v": 2}, uri, mode="create")
    assert "c.json" in str(e.value)
    assert ckptio.load(uri) == {"v": 1}
    with pytest.raises(FileExistsError):
        ckptio.put(b"x", uri, mode="create")


def test_open_read_write(root):
    uri = ckptio.join_path(root, "o.bin")
    with ckptio.open(uri, "wb") as f:
        f.write(b"12345")
        assert not ckptio.exists(uri)  # nothing visible before commit
    with ckptio.open(uri) as f:
        f.seek(2)
        assert f.read(2) == b"34"
    with pytest.raises(RuntimeError):
        with ckptio.open(ckptio.join_path(root, "aborted.bin"), "wb") as f:
            f.write(b"partial")
            raise RuntimeError("boom")
    assert not ckptio.exists(ckptio.join_path(root, "aborted.bin"))


def test_listing(root):
    for p in ["a.txt", "b.json", "sub/c.txt", "sub/deep/d.txt"]:
        ckptio.put(b"x", ckptio.join_path(root, *p.split("/")))
    assert sorted(ckptio.list_dir_or_file(root)) == ["a.txt", "b.json", "sub"]
    assert sorted(ckptio.list_dir_or_file(root, list_dir=False)) == ["a.txt", "b.json"]
    assert sorted(ckptio.list_dir_or_file(root, list_file=False)) == ["sub"]
    assert sorted(ckptio.list_dir_or_file(root, list_dir=False, suffix=".txt", recursive=True)) == [
        "a.txt",
        "sub/c.txt",
        "sub/deep/d.txt",
    ]
    assert sorted(ckptio.list_dir_or_file(root, recursive=True)) == [
        "a.txt",
        "b.json",
        "sub",
        "sub/c.txt",
        "sub/deep",
        "sub/deep/d.txt",
    ]
    with pytest.raises(TypeError):
        list(ckptio.list_dir_or_file(root, suffix=".txt"))
    assert [u.rsplit("/", 1)[-1] for u in ckptio.ls(root)] == ["a.txt", "b.json", "sub"]
    assert len(ckptio.ls(root, recursive=True)) == 4


def test_remove_rmtree(root):
    a, b = ckptio.join_path(root, "t", "a"), ckptio.join_path(root, "t", "x", "b")
    ckptio.put(b"1", a)
    ckptio.put(b"2", b)
    ckptio.remove(a)
    assert not ckptio.exists(a)
    with pytest.raises(FileNotFoundError):
        ckptio.remove(a)
    ckptio.rmtree(ckptio.join_path(root, "t"))
    assert not ckptio.exists(b)


def test_copy_across_backends(tmp_path):
    src = str(tmp_path / "src")
    for p in ["a.bin", "d/b.bin"]:
        ckptio.put(p.encode(), os.path.join(src, p))
    ckptio.copytree(src, "memory://cp/dst")
    assert ckptio.get("memory://cp/dst/d/b.bin") == b"d/b.bin"
    ckptio.copytree_to_local("memory://cp/dst", str(tmp_path / "back"))
    assert (tmp_path / "back" / "d" / "b.bin").read_bytes() == b"d/b.bin"
    assert ckptio.copyfile("memory://cp/dst/a.bin", "memory://cp/z.bin") == "memory://cp/z.bin"
    ckptio.copyfile_to_local("memory://cp/z.bin", str(tmp_path / "z.bin"))
    assert (tmp_path / "z.bin").read_bytes() == b"a.bin"
    ckptio.copyfile_from_local(str(tmp_path / "z.bin"), "memory://cp/y.bin")
    assert ckptio.get("memory://cp/y.bin") == b"a.bin"
    with pytest.raises(FileExistsError):
        ckptio.copyfile("memory://cp/z.bin", "memory://cp/y.bin", mode="create")


def test_get_local_path(root):
    uri = ckptio.join_path(root, "g.bin")
    ckptio.put(b"zz", uri)
    with ckptio.get_local_path(uri) as p:
        assert open(p, "rb").read() == b"zz"
    if uri.startswith("memory://"):
        assert not os.path.exists(p)  # the temporary copy is gone
    with pytest.raises(FileNotFoundError):
        with ckptio.get_local_path(ckptio.join_path(root, "missing.bin")):
            pass


def test_join_path():
    assert ckptio.join_path("s3://b", "a", "c.pt") == "s3://b/a/c.pt"
    assert ckptio.join_path("s3://b/", "/a") == "s3://b/a"
    assert ckptio.join_path("/x", "y") == "/x/y"


def test_bad_input_errors(tmp_path):
    with pytest.raises(UnknownSchemeError) as e:
        ckptio.load("nosuch://b/x.json")
    assert "nosuch://b/x.json" in str(e.value) and "aliases" in str(e.value) and "s3://" in str(e.value)
    with pytest.raises(UnknownFormatError, match="x.weird"):
        ckptio.load(str(tmp_path / "x.weird"))
    with pytest.raises(FileNotFoundError, match="missing.json"):
        ckptio.load(str(tmp_path / "missing.json"))
    with pytest.raises(TypeError, match="cannot write .*bad.json"):
        ckptio.dump({"x": object()}, str(tmp_path / "bad.json"))
    assert not os.path.exists(tmp_path / "bad.json")  # nothing half-written
    assert not [p for p in os.listdir(tmp_path) if "tmp" in p]
    with pytest.raises(TypeError):
        ckptio.put("not bytes", str(tmp_path / "s.bin"))
    with pytest.raises(TypeError):
        ckptio.load(12345)
    with pytest.raises(ValueError):
        ckptio.put(b"x", str(tmp_path / "m.bin"), mode="append")


def test_corrupt_json_is_a_format_error(root):
    uri = ckptio.join_path(root, "c.json")
    ckptio.put(b"{not json", uri)
    with pytest.raises(ckptio.FormatError, match="c.json"):
        ckptio.load(uri)


def test_easy_io_backend_args_and_keys(tmp_path):
    creds = tmp_path / "creds.json"
    creds.write_text(json.dumps({"aws_access_key_id": "k", "aws_secret_access_key": "s"}))
    args = {"backend": "local", "path_mapping": {"memory://mapped/": "memory://real/"}}
    ckptio.dump({"a": 1}, "memory://mapped/x.json", backend_args=args)
    assert ckptio.load("memory://real/x.json") == {"a": 1}
    assert ckptio.load("memory://mapped/x.json", backend_args=args) == {"a": 1}
    ckptio.set_s3_backend(
        key="team", backend_args={"backend": "s3", "path_mapping": {"memory://team/": "memory://t2/"}}
    )
    ckptio.put(b"k", "memory://team/y.bin", backend_key="team")
    assert ckptio.get("memory://t2/y.bin") == b"k"
    assert ckptio.exists("memory://team/y.bin", backend_key="team")
    with pytest.raises(SettingsError, match="nokey"):
        ckptio.get("memory://x", backend_key="nokey")
    with pytest.raises(SettingsError, match="ftp-ish"):
        ckptio.get("memory://x", backend_args={"backend": "ftp-ish"})
    ckptio.reset()
    with pytest.raises(SettingsError):
        ckptio.get("memory://x", backend_key="team")  # reset drops set_s3_backend entries


def test_register_format_decorator_and_conflicts(tmp_path):
    @ckptio.register_format("upper", extensions=[".upper"])
    class Upper(ckptio.StreamFormat):
        def dump_file(self, obj, f, **kw):
            f.write(obj.upper().encode())

        def load_file(self, f, **kw):
            return f.read().decode()

    try:
        ckptio.dump("abc", str(tmp_path / "x.upper"))
        assert ckptio.load(str(tmp_path / "x.upper")) == "ABC"
        with pytest.raises(ValueError, match="already registered"):
            ckptio.register_format("other", extensions=[".upper"])(Upper)
        ckptio.register_format("other", extensions=[".upper"], force=True)(Upper)
    finally:
        ckptio.registry.formats.unregister("upper")
        ckptio.registry.formats.unregister("other")


def test_format_is_the_longest_extension_of_the_last_path_segment():
    """Format look-up by name: the longest registered extension wins, case does not matter, a dot in a
    directory or bucket name is not an extension, and nothing matches a name without one."""
    find = ckptio.registry.formats.find

    @ckptio.register_format("longer", extensions=[".V2.PT"])
    class Longer(ckptio.StreamFormat):
        def dump_file(self, obj, f, **kw):
            f.write(obj)

        def load_file(self, f, **kw):
            return f.read()

    try:
        assert find("/a/m.v2.pt").name == "longer"  # registered upper case, found lower case
        assert find("s3://bkt/run/M.V2.PT").name == "longer"
        assert find("/a/m.x.v2.pt").name == "longer"
        assert find("/a/m.pt").name == find("/a/mv2.pt").name == "torch"  # ".pt" only: no dot before "v2"
        assert find("/a/m.pth.tar").name == "torch"
        assert find("memory://bkt/m.fpk").name == "fastpickle"
        assert find("s3://bkt/dir.json/").name == "json"  # a trailing slash names the same object
        assert find(pathlib.Path("/a/m.pth.tar")).name == "torch"  # os.PathLike, as every ckptio function takes
        for bad in ("s3://bkt.pt/model", "/runs/v1.pt/model", "s3://bkt/model", "/a/pt", "/a/m.", "s3://b.json/x"):
            with pytest.raises(UnknownFormatError, match="extension matches none"):
                find(bad)
    finally:
        ckptio.registry.formats.unregister("longer")


def test_text_stream_format_gets_str_streams(root):
    """``StreamFormat.text = True``: dump_file writes str and load_file reads str, on every backend."""

    @ckptio.register_format("texty", extensions=[".texty"])
    class Texty(ckptio.StreamFormat):
        text = True

        def dump_file(self, obj, f, **kw):
            f.write(obj)

        def load_file(self, f, **kw):
            return f.read()

    try:
        uri = ckptio.join_path(root, "t.texty")
        ckptio.dump("h\u00e9llo\n", uri)
        assert ckptio.load(uri) == "h\u00e9llo\n"
        assert ckptio.get(uri) == "h\u00e9llo\n".encode()
    finally:
        ckptio.registry.formats.unregister("texty")


def test_register_backend_conflict_requires_force():
    with pytest.raises(ValueError, match="already registered"):

        @ckptio.register_backend("mine", prefixes=["memory"])
        class Mine(ckptio.Backend):
            pass


def test_a_plugin_format_is_found_by_every_thread_while_its_entry_point_loads(monkeypatch):
    """Two threads look up a format a plug-in provides, the plug-in slow to import: the second waits for
    the first to finish loading entry points instead of missing it (UnknownFormatError)."""
    import threading
    import time

    from ckptio import registry

    class FooFormat:
        extensions = (".foo",)

    class SlowEntryPoint:
        name, value, dist = "foo", "plugin:FooFormat", None

        def load(self):
            time.sleep(0.3)  # importing the plug-in
            return FooFormat

    monkeypatch.setattr(
        registry.metadata, "entry_points", lambda group: [SlowEntryPoint()] if group == "ckptio.formats" else []
    )
    formats = registry.FormatRegistry()  # entry points not read yet
    found: dict[str, str] = {}

    def look(tag: str) -> None:
        try:
            found[tag] = formats.find(f"/ck/{tag}.foo").name
        except Exception as e:
            found[tag] = type(e).__name__

    first = threading.Thread(target=look, args=("a",))
    first.start()
    time.sleep(0.1)  # the first thread is inside the plug-in's import
    look("b")
    first.join()
    assert found == {"a": "foo", "b": "foo"}


def test_backend_is_the_longest_registered_prefix_and_sees_registrations():
    """A prefix longer than ``scheme://`` (one bucket) wins for the URIs under it, whatever the case of
    the scheme; registering and unregistering take effect on the next look-up."""
    find = ckptio.registry.backends.find
    assert find("memory://team/x.pt").name == "memory"  # looked up (and indexed) before the registration

    @ckptio.register_backend("team", prefixes=["memory://team/"])
    class Team(ckptio.Backend):
        pass

    try:
        assert find("memory://team/x.pt").name == "team"
        assert find("MEMORY://team/x.pt").name == "team"
        assert find("memory://teams/x.pt").name == find("memory://other/x.pt").name == "memory"
        assert find("/tmp/x.pt").name == find("file:///tmp/x.pt").name == "local"
    finally:
        ckptio.registry.backends.unregister("team")
    assert find("memory://team/x.pt").name == "memory"


def test_ordered_dict_roundtrip_pt(root):
    od = OrderedDict([("b", torch.ones(1)), ("a", torch.zeros(1))])
    uri = ckptio.join_path(root, "od.pt")
    ckptio.dump(od, uri)
    assert list(ckptio.load(uri)) == ["b", "a"]


def test_backend_args_apply_only_to_their_backend(tmp_path):
    """Cosmos calls copyfile_to_local(s3_uri, local, backend_args={s3 creds}): the local side ignores them."""
    creds = tmp_path / "creds.json"
    creds.write_text(json.dumps({"aws_access_key_id": "k", "aws_secret_access_key": "s"}))
    args = {"backend": "s3", "s3_credential_path": str(creds)}
    ckptio.put(b"x", "memory://m/a.bin")
    ckptio.copyfile_to_local("memory://m/a.bin", str(tmp_path / "a.bin"), backend_args=args)
    assert (tmp_path / "a.bin").read_bytes() == b"x"
    assert ckptio.exists(str(tmp_path / "a.bin"), backend_args=args)
    ckptio.set_s3_backend(key="team", backend_args=args)
    ckptio.copyfile_from_local(str(tmp_path / "a.bin"), "memory://m/b.bin", backend_key="team")
    assert ckptio.get("memory://m/b.bin") == b"x"


@pytest.mark.parametrize("name", ["p.fpk", "p.pt", "p.bin"])
def test_progress_callback_reports_bytes(any_uri, name):
    uri = ckptio.join_path(any_uri, name)
    obj = b"x" * (3 << 20) if name.endswith(".bin") else {"w": torch.randn(256, 1024), "step": 3}
    seen: list[tuple[int, int]] = []
    ckptio.dump(obj, uri, progress=lambda d, t: seen.append((d, t)))
    assert seen and all(b[0] >= a[0] for a, b in itertools.pairwise(seen))  # monotonic
    assert seen[-1][0] >= (1 << 20)
    size = ckptio.stat(uri).size
    seen.clear()
    back = ckptio.load(uri, progress=lambda d, t: seen.append((d, t)))
    assert seen[-1] == (size, size)
    assert back == obj if name.endswith(".bin") else torch.equal(back["w"], obj["w"])
    seen.clear()
    assert ckptio.get(uri, progress=lambda d, t: seen.append((d, t))) == ckptio.get(uri)
    assert seen[-1] == (size, size)
    seen.clear()
    ckptio.put(b"y" * 1000, uri, progress=lambda d, t: seen.append((d, t)))
    assert seen[-1] == (1000, 1000)


def test_progress_true_is_quiet_off_a_terminal(tmp_path, capsys):
    ckptio.put(b"z" * 100, str(tmp_path / "q.bin"), progress=True)
    assert ckptio.get(str(tmp_path / "q.bin"), progress=True) == b"z" * 100
    assert capsys.readouterr().err == ""


# ---- mmengine.fileio / easy_io semantics (their LocalBackend is shutil's) ------------------------


def test_copyfile_onto_itself_raises_same_file_error(root, tmp_path):
    import shutil

    src = ckptio.join_path(root, "same.txt")
    ckptio.put_text("keep", src)
    with pytest.raises(shutil.SameFileError, match="same.txt"):
        ckptio.copyfile(src, src)
    with pytest.raises(shutil.SameFileError):
        ckptio.copyfile(src, root)  # into its own directory: the same name again
    assert ckptio.get_text(src) == "keep"
    if root == str(tmp_path):  # another name for the same file
        os.link(src, tmp_path / "hard.txt")
        with pytest.raises(shutil.SameFileError):
            ckptio.copyfile(tmp_path / "hard.txt", src)


def test_copytree_refuses_an_existing_destination(root):
    src, dst = ckptio.join_path(root, "tree"), ckptio.join_path(root, "dst")
    ckptio.put(b"new", ckptio.join_path(src, "a.bin"))
    ckptio.put(b"old", ckptio.join_path(dst, "a.bin"))
    ckptio.put(b"other", ckptio.join_path(dst, "b.bin"))
    with pytest.raises(FileExistsError, match="dirs_exist_ok.*dst"):
        ckptio.copytree(src, dst)
    assert ckptio.get(ckptio.join_path(dst, "a.bin")) == b"old"  # nothing copied
    with pytest.raises(FileExistsError):
        ckptio.copytree_to_local(src, dst)
    assert ckptio.copytree(src, dst, dirs_exist_ok=True) == dst  # opt-in merge
    assert ckptio.get(ckptio.join_path(dst, "a.bin")) == b"new"
    assert ckptio.get(ckptio.join_path(dst, "b.bin")) == b"other"


def test_copytree_of_an_empty_or_missing_source(tmp_path):
    (tmp_path / "empty").mkdir()
    ckptio.copytree(tmp_path / "empty", tmp_path / "out")
    assert (tmp_path / "out").is_dir()  # as shutil.copytree
    for missing in ("memory://gone/tree", tmp_path / "gone"):
        with pytest.raises(FileNotFoundError, match="gone"):
            ckptio.copytree(missing, tmp_path / "out2")
    assert not (tmp_path / "out2").exists()


def test_copy_functions_return_the_destination_as_given(tmp_path):
    from pathlib import Path

    src = tmp_path / "f.txt"
    ckptio.put_text("x", src)
    for fn in (ckptio.copyfile, ckptio.copyfile_to_local, ckptio.copyfile_from_local):
        dst = tmp_path / f"{fn.__name__}.txt"
        out = fn(src, dst)
        assert out == dst and isinstance(out, Path)
    (tmp_path / "into").mkdir()
    out = ckptio.copyfile(src, tmp_path / "into")  # into a directory: the joined path, as a str
    assert out == os.path.join(tmp_path / "into", "f.txt") and isinstance(out, str)
    ckptio.put(b"m", "memory://ret/a.bin")
    assert ckptio.copyfile("memory://ret/a.bin", "memory://ret/b.bin") == "memory://ret/b.bin"
    tree = tmp_path / "tree"
    ckptio.put(b"t", tree / "a.bin")
    for i, fn in enumerate((ckptio.copytree, ckptio.copytree_to_local, ckptio.copytree_from_local)):
        dst = tmp_path / f"tree{i}"
        out = fn(tree, dst)
        assert out == dst and isinstance(out, Path)
        assert (dst / "a.bin").read_bytes() == b"t"


def test_list_dir_or_file_checks_its_arguments_at_the_call(root):
    with pytest.raises(TypeError, match="should be None when `list_dir` is True"):
        ckptio.list_dir_or_file(root, list_file=False, suffix=".txt")  # not iterated
    with pytest.raises(TypeError, match="string or tuple"):
        ckptio.list_dir_or_file(root, list_dir=False, suffix=[".txt"])
    it = ckptio.list_dir_or_file(root, list_dir=False, suffix=(".txt", ".jpg"))
    ckptio.put(b"x", ckptio.join_path(root, "late.txt"))  # the listing runs when iterated
    assert list(it) == ["late.txt"]


def test_copy_if_symlink_fails(tmp_path, monkeypatch):
    src = tmp_path / "f.txt"
    ckptio.put_text("disk", src)
    (tmp_path / "d").mkdir()
    ckptio.put_text("in dir", tmp_path / "d" / "g.txt")
    assert ckptio.copy_if_symlink_fails(src, tmp_path / "link.txt") is True
    assert os.path.islink(tmp_path / "link.txt") and ckptio.get_text(tmp_path / "link.txt") == "disk"
    assert ckptio.copy_if_symlink_fails(tmp_path / "d", tmp_path / "dlink") is True
    assert os.path.islink(tmp_path / "dlink")
    ckptio.copy_if_symlink_fails("f.txt", tmp_path / "rel.txt")  # the target as given: relative to the link
    assert os.readlink(tmp_path / "rel.txt") == "f.txt" and ckptio.get_text(tmp_path / "rel.txt") == "disk"

    def no_symlinks(*a, **k):
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(os, "symlink", no_symlinks)
    assert ckptio.copy_if_symlink_fails(src, tmp_path / "copy.txt") is False
    assert not os.path.islink(tmp_path / "copy.txt") and ckptio.get_text(tmp_path / "copy.txt") == "disk"
    assert ckptio.copy_if_symlink_fails(tmp_path / "d", tmp_path / "dcopy") is False
    assert not os.path.islink(tmp_path / "dcopy") and ckptio.get_text(tmp_path / "dcopy" / "g.txt") == "in dir"
    monkeypatch.undo()
    # not on the local filesystem: always a copy
    assert ckptio.copy_if_symlink_fails(src, "memory://sym/f.txt") is False
    assert ckptio.get_text("memory://sym/f.txt") == "disk"
    assert ckptio.copy_if_symlink_fails(tmp_path / "d", "memory://sym/d") is False
    assert ckptio.get_text("memory://sym/d/g.txt") == "in dir"


@pytest.mark.parametrize("ext", [".fpk", ".pt", ".safetensors", "dcp", "checkpointer"])
def test_saves_and_loads_inside_a_default_device_context(root, ext):
    """Code that builds its model under ``with torch.device("meta")`` (or ``torch.set_default_device("cuda")``)
    still saves and loads CPU tensors: ckptio's own buffers are made on the CPU, whatever the default."""
    from ckptio import dcp
    from ckptio.checkpointer import Checkpointer

    state = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5, dtype=torch.int64)}
    uri = ckptio.join_path(root, f"dev{ext}")
    with torch.device("meta"):
        if ext == "dcp":
            dcp.save(state, uri)
            out = {k: torch.zeros_like(v, device="cpu") for k, v in state.items()}
            dcp.load(out, uri)
        elif ext == "checkpointer":
            ck = Checkpointer(uri)
            ck.save(1, {"model": state})
            target = {"model": {k: torch.zeros_like(v, device="cpu") for k, v in state.items()}}
            assert ck.load(target) == 1
            out = target["model"]
        else:
            ckptio.dump(state, uri)
            out = ckptio.load(uri)
            if ext == ".fpk":  # copy mode and (local files) a mapping without verification
                for mmap in (False, True) if "://" not in uri else (False,):
                    assert all(torch.equal(ckptio.load(uri, mmap=mmap)[k], state[k]) for k in state)
    assert set(out) == set(state)
    for k, v in state.items():
        assert out[k].device.type == "cpu" and torch.equal(out[k], v), k
