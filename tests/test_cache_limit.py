"""The node-local cache has a size limit unless one is lifted on purpose: by default min(50 GiB, 25%
of the cache's filesystem); ``"unlimited"`` (settings file, backend options, environment) or
``max_bytes=None`` (a ``cache=`` mapping) lifts it, and an explicit size replaces it."""

from __future__ import annotations

import shutil

import pytest

import ckptio
from ckptio.cache import CachedBackend
from ckptio.errors import SettingsError


def _limit(tmp_path, **kw) -> int | None:
    uri = str(tmp_path / "remote" / "x.bin")
    ckptio.put(b"x", uri)
    backend, _ = ckptio.resolve(uri, **kw)
    assert isinstance(backend, CachedBackend)
    return backend.max_bytes


def test_the_cache_has_a_default_limit(tmp_path):
    cache_dir = tmp_path / "not-yet" / "cache"  # a directory that does not exist yet: its parent's filesystem
    expected = min(50 * 2**30, shutil.disk_usage(tmp_path).total // 4)
    assert _limit(tmp_path, cache=str(cache_dir)) == expected
    assert _limit(tmp_path, cache={"cache_dir": str(cache_dir)}) == expected


def test_none_or_unlimited_lifts_the_limit_and_a_size_replaces_it(tmp_path, monkeypatch):
    cache_dir = str(tmp_path / "cache")
    assert _limit(tmp_path, cache={"cache_dir": cache_dir, "max_bytes": None}) is None
    assert _limit(tmp_path, cache={"cache_dir": cache_dir, "max_bytes": "unlimited"}) is None
    assert _limit(tmp_path, cache={"cache_dir": cache_dir, "max_bytes": "3MiB"}) == 3 * 2**20
    cfg = tmp_path / "ckptio.toml"
    cfg.write_text(f'[cache]\ndir = "{cache_dir}"\nmax_bytes = "unlimited"\n')
    monkeypatch.setenv("CKPTIO_CONFIG", str(cfg))
    ckptio.reset()
    assert _limit(tmp_path, cache=True) is None
    ckptio.configure(backends={"local": {"cache_dir": cache_dir, "max_bytes": "UNLIMITED"}})
    assert _limit(tmp_path) is None


def test_zero_is_not_a_way_to_lift_it(tmp_path):
    with pytest.raises(SettingsError, match=r"max_bytes"):
        ckptio.configure(cache={"max_bytes": 0})
