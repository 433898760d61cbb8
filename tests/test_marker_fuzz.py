"""A structure and size fuzzer for every marker, pointer, recipe and cache entry's metadata ckptio reads
(issue 51): random bytes, deep nesting, huge numbers, wrong types at every key, non-ASCII digits,
truncations, byte flips, oversized files and recipes whose blocks claim other lengths. Each case damages
one of them under a Checkpointer root (local, memory; S3 too with ``-m slow``), then runs one operation
on it (load, load_model, save with retention, is_complete, catalog, info, a cached load) in a child
with ``RLIMIT_AS`` and an alarm (``marker_workers``). Every outcome must be a success, the documented
fallback (a pointer, a cache entry) or a ckptio error naming the damaged file; never a raw exception, a
hang or a large allocation. The default run is seeded and short; ``-m slow`` runs more cases.
"""

from __future__ import annotations

import os
import random
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from conftest import S3_TEST_OPTIONS  # noqa: E402
from marker_workers import b64, run_jobs  # noqa: E402
from servers import make_s3_bucket  # noqa: E402

MIB = 1 << 20
OPS = {
    "latest.txt": ["load", "save", "load_model", "is_complete", "catalog"],
    "checkpoint.json": ["load", "load_model", "is_complete", "save", "catalog", "info"],
    "checkpoint.json@1": ["save", "catalog", "load"],
    "kept.json": ["save", "catalog"],
    "tier.json": ["load", "save"],
    "recipe": ["load", "load_model", "is_complete", "info"],
    "cache-meta": ["cached_load"],
    "cosmos-pointer": ["load"],
    "cosmos-names": ["load"],
}
FALLBACK = {"latest.txt", "cache-meta", "cosmos-pointer", "cosmos-names"}  # these must end in a success
KEYS = {
    "checkpoint.json": [
        ["step"],
        ["format"],
        ["files"],
        ["metrics"],
        ["metrics", "loss"],
        ["content"],
        ["parts"],
        ["time"],
        ["world_size"],
        ["sizes"],
    ],  # fmt: skip
    "kept.json": [["best"], ["other"]],
    "tier.json": [["root"], ["identity"], ["time"]],
    "recipe": [["size"], ["hash"], ["blocks"], ["blocks", 0], ["blocks", 0, 0], ["blocks", 0, 1], ["blocks", -1, 1]],
    "cache-meta": [["size"], ["uri"], ["block_size"], ["blocks"], ["fill_id"]],
}
KEYS["checkpoint.json@1"] = KEYS["checkpoint.json"]
DIGITS = ["٠١٢٣٤٥٦٧٨٩", "０１２３４５６７８９", "०१२३४५६७८९", "0123456789"]


def _value(rng: random.Random, depth: int = 0):
    """A random JSON value of any type."""
    pick = rng.randrange(12 if depth < 3 else 8)
    return [
        lambda: None,
        lambda: rng.choice([True, False]),
        lambda: rng.choice([0, 1, -1, 2, 1 << 31, 1 << 63, -(1 << 70), 10**300]),
        lambda: rng.choice([0.5, -0.0, 1e308, float("inf"), float("nan")]),
        lambda: rng.choice(["", "x", "pt", "fpk", "dcp", "xxh3_128", "state.pt", "../x", "/etc/passwd", "a" * 300]),
        lambda: rng.choice(["000000000002", "٢", "2", "0" * 30]),
        lambda: f"{rng.getrandbits(128):032x}",
        lambda: "\ud800" if rng.random() < 0.5 else "\x00",
        lambda: [_value(rng, depth + 1) for _ in range(rng.randrange(4))],
        lambda: {str(_value(rng, depth + 1))[:20]: _value(rng, depth + 1) for _ in range(rng.randrange(4))},
        lambda: [[f"{rng.getrandbits(128):032x}", rng.choice([1, 1 << 20, 1 << 30])]],
        lambda: {"loss": _value(rng, depth + 1)},
    ][pick]()


def _text(rng: random.Random) -> bytes:
    """Random pointer text: names of no step, of other digits, paths, junk."""
    d = rng.choice(DIGITS)
    return rng.choice(
        [
            lambda: "".join(rng.choice(d) for _ in range(rng.randrange(1, 30))).encode(),
            lambda: ("iter_" + "".join(rng.choice(d) for _ in range(9)) + ".pt").encode(),
            lambda: b"9" * rng.randrange(20, 6000),
            lambda: b"iter_" + b"9" * rng.randrange(20, 6000) + b".pt",
            lambda: rng.choice([b"", b"\n", b"../000000000001", b"/x/000000000001", b"s3://b/000000000001\n"]),
            lambda: bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 64))),
            lambda: b"000000000001\x00",
        ]
    )()


def mutation(rng: random.Random, target: str) -> dict:
    if target == "cosmos-names":
        d = rng.choice(DIGITS[:3])
        return {"digits": "".join(rng.choice(d) for _ in range(9)) if rng.random() < 0.8 else "9" * 25}
    how = rng.randrange(10)
    if how == 0:
        return {"bytes": b64(bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 200))))}
    if how == 1:
        return {"deep": rng.choice([33, 1000, 100_000])}
    if how == 2 and target in KEYS:
        opened = rng.choice([b'{"a":', b"[", b'{"a":[']) * rng.choice([40, 5000])
        return {"bytes": b64(opened + b"1")}
    if how == 3:
        return {"truncate": rng.randrange(1, 400)}
    if how == 4:
        return {"flip": rng.randrange(1 << 16), "mask": rng.choice([1, 0x80, 0xFF])}
    if how == 5 and rng.random() < 0.15:  # oversized: past every marker's cap
        return {"fill": b64(rng.choice([b" ", b"[0,", b'"a",'])), "size": 9 * MIB}
    if how in (5, 6) and target in ("latest.txt", "cosmos-pointer"):
        return {"bytes": b64(_text(rng))}
    if how == 7 and target == "recipe":
        return {"claim": rng.choice([0, -1, 1, 1 << 20, 1 << 30, 1 << 40, 1 << 63])}
    if how == 8:
        return {"bytes": b64(b"9" * rng.randrange(600, 6000))}
    if target in KEYS:  # wrong types, or a value out of range, at one key
        return {"set": rng.choice([[], *KEYS[target]]), "value": _value(rng)}
    return {"bytes": b64(_text(rng))}


def jobs(seed: int, n: int, wheres: list[str], bucket: str | None) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        target = rng.choice(list(OPS))
        fmt = rng.choice(["pt", "fpk", "dcp"])
        where = rng.choice(wheres) if target not in ("tier.json", "cache-meta") else "local"
        job = {"target": target, "op": rng.choice(OPS[target]), "fmt": fmt, "where": where, "bucket": bucket}
        job["incremental"] = target == "recipe" or (target != "tier.json" and rng.random() < 0.2)
        job["mutation"] = mutation(rng, target)
        out.append(job)
    return out


def check(r: dict) -> None:
    job, outcome = r["job"], r["outcome"]
    target = job["target"]
    assert outcome in ("ok", "ckptio"), r
    if target in FALLBACK or job["op"] == "is_complete":
        assert outcome == "ok", r
    if outcome == "ckptio":
        named = {"recipe": ("state.pt", "state.fpk", ".distcp", ".content/")}.get(target, (target.split("@")[0],))
        assert any(n in r["msg"] for n in named), r
    assert r["grew"] < 96 * MIB, r


def _run(seed: int, n: int, wheres: list[str], request) -> None:
    s3 = bucket = None
    if "s3" in wheres:
        endpoint = request.getfixturevalue("s3_endpoint")
        bucket = f"f{os.urandom(6).hex()}"
        make_s3_bucket(endpoint, bucket)
        s3 = {"endpoint_url": endpoint, **S3_TEST_OPTIONS}
    for r in run_jobs(jobs(seed, n, wheres, bucket), s3=s3, headroom=1024 * MIB, alarm=60, timeout=1800):
        check(r)


def test_marker_fuzz(request):
    _run(51, 30, ["local", "memory"], request)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("seed", range(4))
def test_marker_fuzz_long(seed, request):
    _run(1000 + seed, 150, ["local", "memory", "s3"], request)
