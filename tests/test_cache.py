"""The node-local cache (ckptio.backends.cached) with a local directory standing in for remote storage."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import ckptio
from ckptio.backends.cached import CachedBackend
from ckptio.backends.local import LocalBackend

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "cache_workers.py")
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from cache_workers import slow_cache  # noqa: E402

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def remote(tmp_path):
    d = tmp_path / "remote"
    d.mkdir()
    return d


@pytest.fixture
def cache_dir(tmp_path):
    return str(tmp_path / "cache")


def _entries(cache_dir: str) -> list[str]:
    return sorted(p for p in glob.glob(os.path.join(cache_dir, "data", "*", "*")) if not p.endswith(".json"))


def test_load_through_cache_counts_hits_and_misses(remote, cache_dir):
    uri = str(remote / "m.pt")
    ckptio.dump({"w": torch.arange(100)}, uri)
    assert torch.equal(ckptio.load(uri, cache=cache_dir)["w"], torch.arange(100))
    assert torch.equal(ckptio.load(uri, cache=cache_dir)["w"], torch.arange(100))
    backend, _ = ckptio.resolve(uri, cache=cache_dir)
    assert isinstance(backend, CachedBackend)
    stats = backend.stats()
    assert (stats["misses"], stats["hits"]) == (1, 1)
    assert stats["bytes_fetched"] == os.path.getsize(uri)
    assert len(_entries(cache_dir)) == 1


def test_get_local_path_is_the_cache_entry(remote, cache_dir):
    uri = str(remote / "blob.bin")
    ckptio.put(b"x" * 1000, uri)
    backend, resolved = ckptio.resolve(uri, cache=cache_dir)
    with backend.get_local_path(resolved) as path:
        assert path.startswith(cache_dir) and path.endswith("blob.bin")
        assert open(path, "rb").read() == b"x" * 1000
    assert backend.read_range(resolved, 10, 20) == b"x" * 10
    buf = bytearray(5)
    assert backend.readinto(resolved, buf, 998) == 2


def test_settings_enable_the_cache_and_false_disables_it(remote, cache_dir):
    uri = str(remote / "a.json")
    ckptio.dump({"k": 1}, uri)
    ckptio.configure(backends={"local": {"cache_dir": cache_dir, "max_bytes": "1MiB"}})
    backend, _ = ckptio.resolve(uri)
    assert isinstance(backend, CachedBackend) and backend.max_bytes == 2**20
    assert ckptio.load(uri) == {"k": 1}
    assert backend.stats()["misses"] == 1
    plain, _ = ckptio.resolve(uri, cache=False)
    assert isinstance(plain, LocalBackend)


def test_bad_cache_argument_is_a_settings_error(remote):
    with pytest.raises(ckptio.SettingsError, match="unknown key"):
        ckptio.resolve(str(remote / "x.bin"), cache={"dir": "/tmp/x"})


def test_changed_remote_object_is_not_served_stale(remote, cache_dir):
    uri = str(remote / "m.pt")
    ckptio.dump({"w": torch.zeros(4)}, uri)
    assert torch.equal(ckptio.load(uri, cache=cache_dir)["w"], torch.zeros(4))
    ckptio.dump({"w": torch.ones(4)}, uri)  # same size, new mtime
    assert torch.equal(ckptio.load(uri, cache=cache_dir)["w"], torch.ones(4))
    backend, _ = ckptio.resolve(uri, cache=cache_dir)
    assert backend.stats()["misses"] == 2


def test_writes_through_the_cached_backend_reach_the_remote(remote, cache_dir):
    uri = str(remote / "w.bin")
    backend, resolved = ckptio.resolve(uri, cache=cache_dir)
    backend.write(resolved, b"one")
    assert backend.read(resolved) == b"one"
    backend.write(resolved, b"two!")
    assert backend.read(resolved) == b"two!"
    assert open(uri, "rb").read() == b"two!"
    backend.delete(resolved)
    with pytest.raises(FileNotFoundError):
        backend.read(resolved)


@pytest.mark.parametrize("damage", ["truncate", "empty", "no-metadata"])
def test_damaged_entry_is_discarded_and_refetched(remote, cache_dir, damage):
    uri = str(remote / "d.bin")
    payload = os.urandom(5000)
    ckptio.put(payload, uri)
    cache = CachedBackend(LocalBackend(), cache_dir)
    assert cache.read(uri) == payload
    [entry] = _entries(cache_dir)
    if damage == "no-metadata":
        os.unlink(glob.glob(os.path.join(cache_dir, "data", "*", "*.json"))[0])
    else:
        with open(entry, "r+b") as f:
            f.truncate(0 if damage == "empty" else 100)
    assert cache.read(uri) == payload
    assert cache.stats()["discarded"] == 1 and cache.stats()["misses"] == 2


def test_verify_catches_same_size_corruption(remote, cache_dir):
    uri = str(remote / "c.bin")
    payload = os.urandom(5000)
    ckptio.put(payload, uri)
    cache = CachedBackend(LocalBackend(), cache_dir, verify=True)
    assert cache.read(uri) == payload
    [entry] = _entries(cache_dir)
    with open(entry, "r+b") as f:
        f.write(b"\0" * 16)
    assert cache.read(uri) == payload
    assert cache.stats()["discarded"] == 1


def test_entry_from_an_unsynced_previous_boot_is_checksummed(remote, cache_dir):
    uri = str(remote / "b.bin")
    payload = os.urandom(3000)
    ckptio.put(payload, uri)
    cache = CachedBackend(LocalBackend(), cache_dir)
    cache.read(uri)
    [entry] = _entries(cache_dir)
    [meta] = glob.glob(os.path.join(cache_dir, "data", "*", "*.json"))
    record = json.load(open(meta))
    json.dump({**record, "boot_id": "some-earlier-boot"}, open(meta, "w"))
    with open(entry, "r+b") as f:  # what a power loss can leave: right size, wrong bytes
        f.write(b"\0" * 3000)
    assert cache.read(uri) == payload
    assert cache.stats()["discarded"] == 1


def test_eviction_respects_max_bytes_and_spares_entries_in_use(remote, cache_dir):
    size = 10_000
    uris = []
    for i in range(5):
        uris.append(str(remote / f"o{i}.bin"))
        ckptio.put(bytes([i]) * size, uris[-1])
    cache = CachedBackend(LocalBackend(), cache_dir, max_bytes=int(2.5 * size))
    for u in uris:
        cache.read(u)
        assert cache.cached_bytes() <= cache.max_bytes
    assert cache.stats()["evictions"] == 3
    assert len(_entries(cache_dir)) == 2
    assert cache.read(uris[-1]) == bytes([4]) * size  # most recent ones survive
    assert cache.stats()["hits"] == 1
    with cache.get_local_path(uris[0]) as held:  # held: cannot be evicted by later fills
        for u in uris[1:4]:
            cache.read(u)
        assert os.path.exists(held)
        assert open(held, "rb").read() == bytes([0]) * size
    cache.read(uris[4])
    assert cache.cached_bytes() <= cache.max_bytes


def test_open_reader_survives_eviction(remote, cache_dir):
    a, b = str(remote / "a.bin"), str(remote / "b.bin")
    ckptio.put(b"a" * 4000, a)
    ckptio.put(b"b" * 4000, b)
    cache = CachedBackend(LocalBackend(), cache_dir, max_bytes=5000)
    with cache.open_reader(a) as f:
        cache.read(b)  # evicts a's entry
        assert len(_entries(cache_dir)) == 1
        assert f.read() == b"a" * 4000


def _spawn_fill(uri: str, cache_dir: str, delay: float, go: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, WORKER, "fill", uri, cache_dir, str(delay), go], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_concurrent_fills_from_several_processes_download_once(remote, cache_dir, tmp_path):
    uri = str(remote / "shared.bin")
    payload = os.urandom(64 * 1024)  # 16 slow 4 KiB reads: the fill takes a while
    ckptio.put(payload, uri)
    go = str(tmp_path / "go")
    procs = [_spawn_fill(uri, cache_dir, 0.02, go) for _ in range(4)]
    time.sleep(0.5)  # let the interpreters start
    open(go, "w").close()
    results = []
    for p in procs:
        out, err = p.communicate(timeout=45)
        assert p.returncode == 0, err
        results.append(json.loads(out))
    assert all(r["ok"] for r in results)
    assert sum(r["misses"] for r in results) == 1
    assert sum(r["hits"] for r in results) == 3
    assert sum(r["reads"] for r in results) == 16  # the remote saw one download: 16 chunks of 4 KiB
    assert sum(r["bytes_fetched"] for r in results) == len(payload)


def test_fill_killed_midway_leaves_no_entry_and_next_load_succeeds(remote, cache_dir, tmp_path):
    uri = str(remote / "big.bin")
    payload = os.urandom(64 * 1024)
    ckptio.put(payload, uri)
    go = str(tmp_path / "go")
    open(go, "w").close()
    proc = _spawn_fill(uri, cache_dir, 0.2, go)  # ~3 s to fill
    tmp_dir = os.path.join(cache_dir, "tmp")
    deadline = time.monotonic() + 30
    while not (os.path.isdir(tmp_dir) and any(os.path.getsize(os.path.join(tmp_dir, n)) > 0
                                              for n in os.listdir(tmp_dir))):
        assert time.monotonic() < deadline, "the fill never started"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=10)
    assert os.listdir(tmp_dir) and not _entries(cache_dir)  # a partial temp file, no entry
    cache = slow_cache(cache_dir, 0.0, lock_timeout=10)
    assert cache.read(uri) == payload
    assert os.listdir(tmp_dir) == []
    assert cache.stats()["misses"] == 1


def test_lock_timeout_names_the_object(remote, cache_dir, tmp_path):
    uri = str(remote / "slow.bin")
    ckptio.put(os.urandom(64 * 1024), uri)
    go = str(tmp_path / "go")
    open(go, "w").close()
    proc = _spawn_fill(uri, cache_dir, 0.3, go)
    try:
        tmp_dir = os.path.join(cache_dir, "tmp")
        deadline = time.monotonic() + 30
        while not (os.path.isdir(tmp_dir) and os.listdir(tmp_dir)):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        cache = CachedBackend(LocalBackend(), cache_dir, lock_timeout=0.3)
        with pytest.raises(TimeoutError, match="slow.bin"):
            cache.read(uri)
    finally:
        proc.kill()
        proc.communicate(timeout=10)


@pytest.mark.parametrize("ext", [".fpk", ".pt"])
def test_mmap_loads_map_the_cache_entry(remote, cache_dir, ext):
    uri = str(remote / f"m{ext}")
    ckptio.dump({"w": torch.arange(1000.0)}, uri)
    out = ckptio.load(uri, cache=cache_dir, mmap=True)
    assert torch.equal(out["w"], torch.arange(1000.0))
    backend, _ = ckptio.resolve(uri, cache=cache_dir)
    assert backend.stats()["misses"] == 1


@pytest.mark.parametrize("store", ["s3", "gcs"])
def test_object_store_is_downloaded_once_and_revalidated(request, tmp_path, store):
    proxy = request.getfixturevalue(f"{store}_proxy")
    uri = f"{proxy.uri}/ckpt/m.pt"
    cache = str(tmp_path / "cache")
    ckptio.dump({"w": torch.zeros(64)}, uri)
    proxy.clear()
    for _ in range(3):
        assert torch.equal(ckptio.load(uri, cache=cache)["w"], torch.zeros(64))
    media = [r for r in proxy.requests if r.method == "GET" and (
        "alt=media" in r.path if store == "gcs" else r.path.split("?")[0].endswith("/ckpt/m.pt"))]
    assert len(media) == 1, [(r.method, r.path) for r in proxy.requests]
    ckptio.dump({"w": torch.ones(64)}, uri)  # same size, new etag / generation
    assert torch.equal(ckptio.load(uri, cache=cache)["w"], torch.ones(64))


def test_cache_settings_per_alias_are_typed(remote, cache_dir):
    uri = str(remote / "a.bin")
    ckptio.put(b"abc", uri)
    ckptio.configure(aliases={"ck": {"target": str(remote), "options": {"cache_dir": cache_dir,
                                                                        "cache_verify": "true", "max_bytes": "1KiB"}}})
    backend, resolved = ckptio.resolve("ck://a.bin")
    assert isinstance(backend, CachedBackend) and backend.verify is True and backend.max_bytes == 1024
    assert backend.read(resolved) == b"abc"
    backend, _ = ckptio.resolve(uri, cache={"cache_dir": cache_dir, "verify": "false", "max_bytes": "2KiB"})
    assert backend.verify is False and backend.max_bytes == 2048
    with pytest.raises(ckptio.SettingsError, match="cache_verify"):
        ckptio.configure(backends={"local": {"cache_verify": "maybe"}})
