"""Every private torch name ckptio relies on (ckptio.torch_internals.SYMBOLS) exists in the installed torch."""

from __future__ import annotations

import importlib
import pickle
import re
import subprocess
import sys

import pytest
import torch

from ckptio import torch_internals as ti


@pytest.mark.parametrize("name", sorted(ti.SYMBOLS))
def test_symbol_resolves(name):
    module, attr = ti.SYMBOLS[name]
    try:
        obj = ti.resolve_symbol(name)
    except AttributeError as e:
        pytest.fail(f"torch {torch.__version__} lacks {module}.{attr} (ckptio.torch_internals.{name}): {e}")
    assert obj is not None, f"{module}.{attr} is None in torch {torch.__version__}"
    assert getattr(ti, name) is obj


def test_pickled_names_are_what_torch_pickles():
    """The strings unpicklers match are the globals torch.save writes for tensors, parameters and layouts."""
    blob = pickle.dumps([torch.zeros(2), torch.nn.Parameter(torch.zeros(2)), torch.strided], protocol=2)
    for module, name in [
        (ti.REBUILD_MODULE, ti.REBUILD_TENSOR),
        (ti.REBUILD_MODULE, ti.REBUILD_PARAMETER),
        ti.LAYOUT_GLOBAL,
    ]:
        assert f"{module}\n{name}\n".encode() in blob, f"torch {torch.__version__} no longer pickles {module}.{name}"
        assert callable(getattr(importlib.import_module(module), name))


def test_missing_symbol_is_named(monkeypatch):
    monkeypatch.setitem(ti.SYMBOLS, "gone", ("torch._utils", "_no_such_thing"))
    with pytest.raises(AttributeError, match=r"torch\._utils\._no_such_thing \(ckptio\.torch_internals\.gone\)"):
        ti.gone  # noqa: B018 - the attribute access is the test


def test_untested_torch_version_warns(monkeypatch):
    monkeypatch.setattr(ti, "_checked", False)
    monkeypatch.setattr(ti, "TESTED_TORCH", ("1.0",))
    with pytest.warns(RuntimeWarning, match="tested with torch 1.0"):
        ti.check_torch_version()


def test_import_is_lazy():
    """Importing the module resolves nothing: a DCP-only symbol does not import torch.distributed."""
    code = "import sys, ckptio.torch_internals; assert 'torch.distributed.checkpoint' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("version, why", [("2.12.1", "older than 2.13"), ("9.0.0+cpu", "not been tested")])
def test_a_release_outside_the_table_warns_saying_why(monkeypatch, version, why):
    monkeypatch.setattr(ti, "_checked", False)
    monkeypatch.setattr(torch, "__version__", version)
    with pytest.warns(RuntimeWarning, match=rf"not {re.escape(version)} \(.*{why}"):
        ti.check_torch_version()


def test_the_installed_torch_is_a_release_of_the_table(monkeypatch, recwarn):
    monkeypatch.setattr(ti, "_checked", False)
    ti.check_torch_version()
    assert not [w for w in recwarn if "tested with torch" in str(w.message)]
