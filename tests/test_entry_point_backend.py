"""A backend from an installed package (tests/plugins/ckptio_testplugin, installed by
requirements/dev.txt) is found through the ``ckptio.backends`` entry-point group."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

import pytest

import ckptio
from ckptio import registry


def _installed() -> bool:
    return any(ep.name == "testplug" for ep in metadata.entry_points(group="ckptio.backends"))


pytestmark = pytest.mark.skipif(not _installed(), reason="run: pip install -e ./tests/plugins/ckptio_testplugin")


def test_entry_point_backend_resolves_and_round_trips():
    b, u = ckptio.resolve("testplug://box/a/b.bin")
    assert type(b).__name__ == "TestPlugBackend" and u == "testplug://box/a/b.bin"
    b.write(u, b"plugged in")
    assert b.read(u) == b"plugged in" and b.stat(u).size == 10
    assert [i.uri for i in b.list("testplug://box", recursive=True)] == [u]
    with pytest.raises(FileExistsError):
        b.write(u, b"again", mode="create")
    b.delete(u)
    with pytest.raises(FileNotFoundError, match="testplug://box/a/b.bin"):
        b.read(u)


def test_entry_point_backend_takes_its_options_from_settings():
    ckptio.configure(backends={"testplug": {"greeting": "hi", "part_size": "8MiB"}})
    b, _ = ckptio.resolve("testplug://box/x")
    assert b.greeting == "hi" and b.part_size == 8 * 1024 * 1024
    assert "testplug://" in registry.backends.keys() and "testplug" in registry.backends.names()


def test_fresh_process_finds_entry_point_before_anything_is_registered():
    code = (
        "import ckptio; b, u = ckptio.resolve('testplug://x/y'); b.write(u, b'1'); print(type(b).__name__, b.read(u))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["TestPlugBackend", "b'1'"]


def test_a_plugin_that_fails_to_import_is_skipped_with_a_warning_naming_it(monkeypatch):
    """A broken installed plug-in must not take every other lookup down with it."""
    broken = metadata.EntryPoint(name="brokenplug", value="ckptio_no_such_module_xyz:Backend", group="ckptio.backends")
    real = metadata.entry_points
    monkeypatch.setattr(registry.metadata, "entry_points", lambda group: [broken, *real(group=group)])
    reg = registry.BackendRegistry()
    reg.register("local", ("",), "ckptio.backends.local:LocalBackend")
    with pytest.warns(RuntimeWarning, match=r"brokenplug.*ckptio_no_such_module_xyz.*ModuleNotFoundError"):
        assert reg.by_name("testplug") is not None  # the plug-ins after it still load
    assert reg.find("/tmp/x").name == "local"
