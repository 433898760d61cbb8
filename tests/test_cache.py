"""The node-local cache (ckptio.cache) with a local directory standing in for remote storage."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import xxhash

import ckptio
from ckptio import cli
from ckptio.backends.local import LocalBackend
from ckptio.cache import CachedBackend

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "cache_workers.py")
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from cache_workers import slow_cache  # noqa: E402
from conftest import flip_byte  # noqa: E402

BLOCK = 1 << 20  # the cache hashes entries below 16 GiB in blocks of this size

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
    """The data files (``<key>-<basename>``; ``<key>.json`` is metadata, whatever the object's name)."""
    return sorted(
        p
        for p in glob.glob(os.path.join(cache_dir, "data", "*", "*"))
        if re.fullmatch(r"[0-9a-f]{40}-.+", os.path.basename(p))
    )


def _meta(cache_dir: str) -> str:
    [meta] = [
        p
        for p in glob.glob(os.path.join(cache_dir, "data", "*", "*.json"))
        if re.fullmatch(r"[0-9a-f]{40}\.json", os.path.basename(p))
    ]
    return meta


def _disk_bytes(cache_dir: str) -> int:
    """Every byte of every file the cache has on disk."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(cache_dir) for f in files)


def _cli(capsys, *argv: str) -> tuple[int, dict]:
    capsys.readouterr()
    code = cli.main(["--json", "cache", *argv])
    return code, json.loads(capsys.readouterr().out)


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


def _read_all(cache, uri, payload):
    return cache.read(uri), payload


def _read_range(cache, uri, payload):
    return cache.read_range(uri, BLOCK + 12_000, BLOCK + 13_000), payload[BLOCK + 12_000 : BLOCK + 13_000]


def _readinto(cache, uri, payload):
    buf = bytearray(100)
    assert cache.readinto(uri, buf, BLOCK + 12_300) == 100
    return bytes(buf), payload[BLOCK + 12_300 : BLOCK + 12_400]


def _open_reader(cache, uri, payload):
    with cache.open_reader(uri) as f:
        return f.read(), payload


def _local_path(cache, uri, payload):
    with cache.get_local_path(uri) as path, open(path, "rb") as f:
        return f.read(), payload


@pytest.mark.parametrize("reader", [_read_all, _read_range, _readinto, _open_reader, _local_path])
def test_flipped_byte_is_detected_and_refetched_on_every_read_path(remote, cache_dir, reader):
    uri = str(remote / "c.bin")
    payload = os.urandom(2 * BLOCK + BLOCK // 2)
    ckptio.put(payload, uri)
    cache = CachedBackend(LocalBackend(), cache_dir)
    cache.fill(uri)
    [entry] = _entries(cache_dir)
    flip_byte(entry, BLOCK + 12_345)  # same size, one bit: only a checksum can tell
    got, want = reader(cache, uri, payload)
    assert got == want
    assert cache.stats()["discarded"] == 1 and cache.stats()["misses"] == 2
    with open(_entries(cache_dir)[0], "rb") as f:
        assert f.read() == payload  # the damaged entry was replaced, not just bypassed


@pytest.mark.parametrize("ext", [".fpk", ".pt"])
def test_flipped_byte_in_a_cached_checkpoint_is_refetched(remote, cache_dir, ext):
    uri = str(remote / f"m{ext}")
    w = torch.arange(200_000, dtype=torch.float32)
    ckptio.dump({"w": w}, uri)
    assert torch.equal(ckptio.load(uri, cache=cache_dir)["w"], w)
    [entry] = _entries(cache_dir)
    flip_byte(entry, os.path.getsize(entry) // 2)  # inside the tensor's bytes
    for _ in range(2):  # refetched once, then served from the repaired entry
        assert torch.equal(ckptio.load(uri, cache=cache_dir)["w"], w)
    backend, _ = ckptio.resolve(uri, cache=cache_dir)
    assert backend.stats()["discarded"] == 1 and backend.stats()["misses"] == 2


def test_ranged_reads_verify_only_the_blocks_they_touch(remote, cache_dir):
    uri = str(remote / "r.bin")
    payload = os.urandom(3 * BLOCK + 100)
    ckptio.put(payload, uri)
    cache = CachedBackend(LocalBackend(), cache_dir)
    size = len(payload)
    for start, end in [
        (0, 0),
        (0, 1),
        (BLOCK - 1, BLOCK + 1),
        (BLOCK, 2 * BLOCK),
        (5, size),
        (size - 1, size),
        (size, size + 10),
        (size + 5, None),
        (3, None),
        (2 * BLOCK - 7, 3 * BLOCK + 3),
    ]:
        assert cache.read_range(uri, start, end) == payload[start:end]
        buf = bytearray(len(payload[start:end]) + 3)  # up to 3 bytes past ``end``, as far as the object goes
        n = cache.readinto(uri, buf, start)
        assert buf[:n] == payload[start : start + len(buf)] and n == len(payload[start : start + len(buf)])
    [entry] = _entries(cache_dir)
    flip_byte(entry, 2 * BLOCK + 50)
    assert cache.read_range(uri, 10, BLOCK + 10) == payload[10 : BLOCK + 10]  # blocks 0 and 1: intact
    assert cache.stats()["discarded"] == 0
    buf = bytearray(20)
    assert cache.readinto(uri, buf, 2 * BLOCK + 40) == 20 and buf == payload[2 * BLOCK + 40 : 2 * BLOCK + 60]
    assert cache.stats()["discarded"] == 1 and cache.stats()["misses"] == 2


def test_damaged_entry_held_by_others_is_read_through_then_replaced(remote, cache_dir):
    """A pin (ckptio.distributed holds one on every rank) keeps an entry from being replaced: no waiting for it."""
    uri = str(remote / "p.bin")
    payload = os.urandom(2 * BLOCK + 10)
    ckptio.put(payload, uri)
    cache = CachedBackend(LocalBackend(), cache_dir, lock_timeout=20)
    with cache.pinned([cache.stat(uri)]):
        [entry] = _entries(cache_dir)
        flip_byte(entry, 100)
        with pytest.warns(UserWarning, match="damaged and in use"):
            assert cache.read(uri) == payload
        with pytest.warns(UserWarning, match="damaged and in use"), cache.get_local_path(uri) as path:
            assert open(path, "rb").read() == payload
        assert cache.stats()["read_through"] == 2 and cache.stats()["discarded"] == 0
    assert cache.read(uri) == payload  # nobody holds it now: replaced
    assert cache.stats()["discarded"] == 1 and cache.stats()["misses"] == 2


def test_entry_without_block_checksums_is_refetched(remote, cache_dir):
    """An entry written by the old layout (one whole-file xxh3, no block checksums) cannot be verified."""
    uri = str(remote / "old.bin")
    payload = os.urandom(5000)
    ckptio.put(payload, uri)
    cache = CachedBackend(LocalBackend(), cache_dir)
    cache.fill(uri)
    meta = _meta(cache_dir)
    with open(meta) as f:
        record = json.load(f)
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown"
    old = {
        **{k: record[k] for k in ("uri", "version", "size")},
        "xxh3": xxhash.xxh3_64(payload).hexdigest(),
        "boot_id": boot,
        "fsynced": False,
        "created": 0.0,
    }
    with open(meta, "w") as f:
        json.dump(old, f)
    assert cache.read(uri) == payload
    assert cache.stats()["discarded"] == 1 and cache.stats()["misses"] == 2


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
    return subprocess.Popen(
        [sys.executable, WORKER, "fill", uri, cache_dir, str(delay), go],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _fill_together(uri: str, cache_dir: str, delay: float, tmp_path, n: int = 4) -> list[dict]:
    """Start ``n`` fill workers, let them all go at once, return their stats (each checked the bytes)."""
    go = str(tmp_path / "go")
    procs = [_spawn_fill(uri, cache_dir, delay, go) for _ in range(n)]
    time.sleep(0.5)  # let the interpreters start
    open(go, "w").close()
    results = []
    for p in procs:
        out, err = p.communicate(timeout=45)
        assert p.returncode == 0, err
        results.append(json.loads(out))
    assert all(r["ok"] for r in results)
    return results


def test_concurrent_fills_from_several_processes_download_once(remote, cache_dir, tmp_path):
    uri = str(remote / "shared.bin")
    payload = os.urandom(64 * 1024)  # 16 slow 4 KiB reads: the fill takes a while
    ckptio.put(payload, uri)
    results = _fill_together(uri, cache_dir, 0.02, tmp_path)
    assert sum(r["misses"] for r in results) == 1
    assert sum(r["hits"] for r in results) == 3
    assert sum(r["reads"] for r in results) == 16  # the remote saw one download: 16 chunks of 4 KiB
    assert sum(r["bytes_fetched"] for r in results) == len(payload)


def test_concurrent_readers_of_a_damaged_entry_all_get_the_right_bytes(remote, cache_dir, tmp_path):
    uri = str(remote / "shared.bin")
    payload = os.urandom(64 * 1024)
    ckptio.put(payload, uri)
    CachedBackend(LocalBackend(), cache_dir).fill(uri)
    [entry] = _entries(cache_dir)
    flip_byte(entry, 1000)
    results = _fill_together(uri, cache_dir, 0.0, tmp_path)  # each checked it got the right bytes
    # replaced at most once; the others waited or read through. All of them read through when each
    # found the others holding the damaged entry (a busy machine): the next reader replaces it then
    assert sum(r["discarded"] for r in results) <= 1
    assert CachedBackend(LocalBackend(), cache_dir).read(uri) == payload
    with open(_entries(cache_dir)[0], "rb") as f:
        assert f.read() == payload


def test_fill_killed_midway_leaves_no_entry_and_next_load_succeeds(remote, cache_dir, tmp_path):
    uri = str(remote / "big.bin")
    payload = os.urandom(64 * 1024)
    ckptio.put(payload, uri)
    go = str(tmp_path / "go")
    open(go, "w").close()
    proc = _spawn_fill(uri, cache_dir, 0.2, go)  # ~3 s to fill
    tmp_dir = os.path.join(cache_dir, "tmp")
    deadline = time.monotonic() + 30
    while not (
        os.path.isdir(tmp_dir) and any(os.path.getsize(os.path.join(tmp_dir, n)) > 0 for n in os.listdir(tmp_dir))
    ):
        assert time.monotonic() < deadline, "the fill never started"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=10)
    assert os.listdir(tmp_dir) and not _entries(cache_dir)  # a partial temp file, no entry
    cache = slow_cache(cache_dir, 0.0, lock_timeout=10)
    assert cache.cached_bytes() == _disk_bytes(cache_dir) > 0  # counted: it takes space until removed
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


def test_objects_named_like_metadata_are_evicted_counted_and_cleared(remote, cache_dir, capsys):
    names = ["x.json", ".json", "a-b.json", "a-b-c.json", "-.json"]
    opts = {"cache_dir": cache_dir, "max_bytes": 100_000}
    for i in range(20):
        uri = str(remote / f"d{i}" / names[i % len(names)])
        os.makedirs(os.path.dirname(uri))
        ckptio.dump({"i": i, "pad": "x" * 50_000}, uri)
        assert ckptio.load(uri, cache=opts)["i"] == i
        assert _disk_bytes(cache_dir) <= 100_000
    backend, _ = ckptio.resolve(uri, cache=opts)
    assert backend.stats()["evictions"] >= 18
    key = "0" * 40  # what a fill killed before its rename leaves (another object's)
    with open(os.path.join(cache_dir, "tmp", f"{key}.4242.0badf00d"), "wb") as f:
        f.write(b"p" * 3000)
    on_disk = _disk_bytes(cache_dir)
    code, doc = _cli(capsys, "stats", "--cache-dir", cache_dir)
    assert code == 0 and doc["bytes"] == backend.cached_bytes() == on_disk
    assert doc["entries"] == len(_entries(cache_dir)) >= 1
    code, doc = _cli(capsys, "clear", "--cache-dir", cache_dir)
    assert code == 0 and doc["freed_bytes"] == on_disk and doc["bytes_left"] == 0
    assert _disk_bytes(cache_dir) == 0 and not _entries(cache_dir)
    assert ckptio.load(uri, cache=opts)["i"] == 19


def _read_only(path: str) -> list[str]:
    """Make ``path`` read-only for a subprocess: the argv prefix to run it with (chmod, or a read-only bind as root)."""
    if os.geteuid() != 0:
        for d, _, _ in os.walk(path):
            os.chmod(d, 0o555)
        return []
    if shutil.which("unshare") is None:
        pytest.skip("running as root without unshare(1): cannot make a directory read-only")
    prefix = ["unshare", "-m", "sh", "-c", 'mount --bind -o ro "$0" "$0" && exec "$@"', path]
    probe = subprocess.run([*prefix, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"running as root and cannot bind-mount read-only: {probe.stderr.strip()}")
    return prefix


@pytest.mark.parametrize("used", [True, False], ids=["with-an-entry", "empty"])
def test_read_only_cache_dir_is_an_error_that_says_so(remote, tmp_path, used):
    uri = str(remote / "m.pt")
    ckptio.dump({"w": torch.arange(10)}, uri)
    ro = str(tmp_path / "ro-cache")
    if used:
        CachedBackend(LocalBackend(), ro).fill(uri)
    else:
        os.mkdir(ro)
    prefix = _read_only(ro)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")])}
    try:
        proc = subprocess.run(
            [*prefix, sys.executable, WORKER, "readonly", ro, uri], env=env, capture_output=True, text=True, timeout=60
        )
    finally:
        for d, _, _ in os.walk(ro):
            os.chmod(d, 0o755)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    load = res["load"]
    assert not load["ok"] and load["permission"] and not load["not_found"], load
    assert ro in load["message"] and "not writable" in load["message"]
    assert res["stats"]["code"] == 0 and f"{int(used)} entries" in res["stats"]["out"], res["stats"]
    assert res["clear"]["code"] == cli.EXIT_DENIED and ro in res["clear"]["err"], res["clear"]


def test_cache_dir_below_a_file_is_an_error_that_says_so(remote, tmp_path):
    uri = str(remote / "m.pt")
    ckptio.dump({"w": torch.arange(10)}, uri)
    (tmp_path / "file").write_bytes(b"")
    bad = str(tmp_path / "file" / "cache")
    with pytest.raises(PermissionError, match="cache directory") as e:
        ckptio.load(uri, cache=bad)
    assert not isinstance(e.value, FileNotFoundError) and bad in str(e.value)


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
    media = [
        r
        for r in proxy.requests
        if r.method == "GET"
        and ("alt=media" in r.path if store == "gcs" else r.path.split("?")[0].endswith("/ckpt/m.pt"))
    ]
    assert len(media) == 1, [(r.method, r.path) for r in proxy.requests]
    ckptio.dump({"w": torch.ones(64)}, uri)  # same size, new etag / generation
    assert torch.equal(ckptio.load(uri, cache=cache)["w"], torch.ones(64))


def test_cache_settings_per_alias_are_typed(remote, cache_dir):
    uri = str(remote / "a.bin")
    ckptio.put(b"abc", uri)
    ckptio.configure(
        aliases={
            "ck": {
                "target": str(remote),
                "options": {"cache_dir": cache_dir, "cache_verify": "true", "max_bytes": "1KiB"},
            }
        }
    )
    backend, resolved = ckptio.resolve("ck://a.bin")
    assert isinstance(backend, CachedBackend) and backend.verify is True and backend.max_bytes == 1024
    assert backend.read(resolved) == b"abc"
    backend, _ = ckptio.resolve(uri, cache={"cache_dir": cache_dir, "verify": "false", "max_bytes": "2KiB"})
    assert backend.verify is False and backend.max_bytes == 2048
    with pytest.raises(ckptio.SettingsError, match="cache_verify"):
        ckptio.configure(backends={"local": {"cache_verify": "maybe"}})


def test_the_cache_settings_table_configures_the_cache_and_the_cli(remote, cache_dir, tmp_path, capsys, monkeypatch):
    cfg = tmp_path / "ckptio.toml"
    cfg.write_text(f'[cache]\ndir = "{cache_dir}"\nmax_bytes = "1MiB"\n')
    monkeypatch.setenv("CKPTIO_CONFIG", str(cfg))
    ckptio.reset()
    uri = str(remote / "t.bin")
    ckptio.put(b"x" * 100, uri)
    assert not isinstance(ckptio.resolve(uri)[0], CachedBackend)  # configured, not turned on
    backend, resolved = ckptio.resolve(uri, cache=True)
    assert isinstance(backend, CachedBackend) and backend.cache_dir == cache_dir and backend.max_bytes == 2**20
    assert backend.read(resolved) == b"x" * 100
    code, doc = _cli(capsys, "stats")  # no --cache-dir: the table's directory
    assert code == 0 and doc["cache_dir"] == cache_dir and doc["entries"] == 1
    code, doc = _cli(capsys, "clear")
    assert code == 0 and doc["cache_dir"] == cache_dir and doc["bytes_left"] == 0


def test_the_cache_settings_table_is_validated(tmp_path):
    from ckptio.errors import SettingsError

    cfg = tmp_path / "bad.toml"
    cfg.write_text('[cache]\ndri = "/tmp/c"\n')
    with pytest.raises(SettingsError, match=r"cache\.dri.*did you mean 'dir'"):
        ckptio.configure(settings_file=str(cfg))
    with pytest.raises(SettingsError, match=r"cache\.max_bytes"):
        ckptio.configure(cache={"max_bytes": "lots"})
