"""Promises about packaging: one version (``ckptio.__version__``) read by the build and printed by
``ckptio --version``; clean metadata (SPDX license, no build warnings); the s3/gcs backends refuse a
client library older than the extra's floor, naming the package and the version needed.

That every documented extra resolves without backtracking is checked by ``scripts/check_install.sh``
(CI), not here: it needs the package index."""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

import ckptio

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def _pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _floors(extra: str) -> dict[str, str]:
    """``{"s3fs": "2025.2.0", ...}`` from the extra's ``name>=version`` requirements in pyproject.toml."""
    out = {}
    for req in _pyproject()["project"]["optional-dependencies"][extra]:
        name, _, version = req.partition(">=")
        out[name.strip()] = version.strip()
    return out


def _run(args: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, **kw)


def test_version_is_written_in_one_place():
    project = _pyproject()["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert _pyproject()["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "ckptio.__version__"}
    r = _run([sys.executable, "-m", "ckptio.cli", "--version"], env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"ckptio {ckptio.__version__}"
    with open(os.path.join(ROOT, "CHANGELOG.md"), encoding="utf-8") as f:
        assert re.search(rf"^## \[?{re.escape(ckptio.__version__)}\]?", f.read(), re.M), (
            f"CHANGELOG.md has no section for {ckptio.__version__}"
        )


def test_build_metadata_has_the_version_and_an_spdx_license_without_warnings(tmp_path):
    pytest.importorskip("setuptools", minversion="77")
    src = tmp_path / "src"
    shutil.copytree(os.path.join(ROOT, "ckptio"), src / "ckptio", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    code = f"from setuptools import build_meta as b; print(b.prepare_metadata_for_build_wheel({str(tmp_path)!r}))"
    r = _run([sys.executable, "-W", "always", "-c", code], cwd=src)
    assert r.returncode == 0, r.stderr
    assert "Warning" not in r.stderr and "deprecat" not in r.stderr.lower(), r.stderr
    meta = (tmp_path / r.stdout.strip().splitlines()[-1] / "METADATA").read_text()
    assert f"\nVersion: {ckptio.__version__}\n" in meta
    assert "\nLicense-Expression: Apache-2.0\n" in meta


@pytest.mark.parametrize("module, extra", [("ckptio.backends.s3", "s3"), ("ckptio.backends.gcs", "gcs")])
def test_import_time_floors_are_the_extras_floors(module, extra):
    import importlib

    assert importlib.import_module(module).MIN_VERSIONS == _floors(extra)


@pytest.mark.parametrize(
    "dist, old, uri, extra",
    [
        ("s3fs", "0.4.2", "s3://bucket/k", "s3"),
        ("aiobotocore", "2.5.0", "s3://bucket/k", "s3"),
        ("gcsfs", "2023.6.0", "gs://bucket/k", "gcs"),
    ],
)
def test_too_old_client_library_is_refused_by_name_and_version(tmp_path, dist, old, uri, extra):
    """An older release first on sys.path: its metadata, and a module that fails to import (as old
    releases do against today's dependencies). The version is named, not the import error."""
    info = tmp_path / f"{dist}-{old}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {old}\n")
    (tmp_path / dist).mkdir()
    (tmp_path / dist / "__init__.py").write_text("raise ImportError('cannot import name Session')\n")
    code = textwrap.dedent(f"""
        import ckptio
        try:
            ckptio.resolve({uri!r})
        except ckptio.MissingDependencyError as e:
            print("REFUSED:", e)
    """)
    r = _run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT])})
    assert r.returncode == 0, r.stderr
    minimum = _floors(extra)[dist]
    assert f"REFUSED: ckptio's {extra} backend needs {dist}>={minimum}, but {dist} {old} is installed" in r.stdout
    assert f"pip install -U 'ckptio[{extra}]'" in r.stdout


def test_torch_requirement_is_the_release_table_of_torch_internals():
    """pyproject.toml declares torch>= the oldest release ckptio.torch_internals.TORCH_RELEASES claims, with no
    upper bound (pip would replace a newer torch); the table is contiguous and holds the dev pin's release."""
    from ckptio import torch_internals as ti

    minors = sorted(tuple(int(p) for p in r.split(".")) for r in ti.TORCH_RELEASES)
    assert all(b == (a[0], a[1] + 1) for a, b in itertools.pairwise(minors)), minors
    torch_reqs = [r for r in _pyproject()["project"]["dependencies"] if re.match(r"torch\b", r)]
    assert torch_reqs == [f"torch>={minors[0][0]}.{minors[0][1]}"], torch_reqs
    with open(os.path.join(ROOT, "requirements", "dev.txt"), encoding="utf-8") as f:
        (pin,) = re.findall(r"^torch==(\d+\.\d+)\.", f.read(), re.M)
    assert ti.TORCH_RELEASES[pin].startswith("tested: the whole suite"), ti.TORCH_RELEASES
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        assert f"torch>={minors[0][0]}.{minors[0][1]}" in f.read()
