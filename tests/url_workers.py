"""A child process that sends crafted bucket and object names through ckptio's calls on a store, and checks
after each that nothing but that object was touched.

``python url_workers.py SCHEME ENDPOINT SEED CASES`` makes a bucket under test and a neighbour, each holding
sentinel objects, then for each case a URI ``SCHEME://BUCKET/KEY`` from random parts (``?``, ``#``, ``%``,
``/``, ``..``, spaces, control characters, unicode, lone surrogates, empty parts, the names of the
buckets and sentinels themselves) goes through ``put``, ``get``, ``exists``, ``isfile``, ``stat``, ``ls``,
``remove`` and ``rmtree``. Each call must end in a ckptio error or do exactly what it says to exactly that
object: ``put`` then ``get`` gives the bytes back, and the store (listed with its own API, not ckptio's)
holds the sentinels plus that one key; after ``remove`` only the sentinels, their bytes unchanged; both
buckets exist throughout. One ``RESULT`` JSON line per case (``ok``, ``refused``: a ckptio error, or a
``problem``); :func:`run_cases` is the parent's side.
"""

from __future__ import annotations

import functools
import json
import os
import posixpath
import random
import sys
import time
import urllib.parse
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

PIECES = ["?", "#", "%", "%2F", "%23", "%2E%2E", "/", "//", "..", ".", "./", "../", " ", "\t", "\n", "\r",
          "\x00", "\x01", "\x7f", "\x85", "é", "日本", "\u202e", "\ud800", "+", "&", "=", ";", "\\", "@", ":",
          "~", "*", "'", '"', "<", ">", "a", "b", "dir", "sentinel", "o", "b/"]  # fmt: skip


def run_cases(scheme: str, endpoint: str, seed: int, cases: int, timeout: float = 300) -> list[dict]:
    """Run ``cases`` crafted names in a child (forked from the zygote); the result of each, in order."""
    import zygote

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = zygote.run([sys.executable, __file__, scheme, endpoint, str(seed), str(cases)], timeout=timeout, env=env)
    results = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and len(results) == cases, (proc.returncode, proc.stdout[-3000:], proc.stderr[-4000:])
    return results


class Store:
    """Buckets and objects seen through the store's own API (boto3, or the GCS JSON API by urllib)."""

    def __init__(self, scheme: str, endpoint: str) -> None:
        self.scheme, self.endpoint = scheme, endpoint
        if scheme == "s3":
            from servers import s3_client

            self._s3 = s3_client(endpoint)

    def make(self, bucket: str, objects: dict[str, bytes]) -> None:
        from servers import make_gcs_bucket, make_s3_bucket

        (make_s3_bucket if self.scheme == "s3" else make_gcs_bucket)(self.endpoint, bucket)
        self.put(bucket, objects)

    def put(self, bucket: str, objects: dict[str, bytes]) -> None:
        for k, v in objects.items():
            if self.scheme == "s3":
                self._s3.put_object(Bucket=bucket, Key=k, Body=v)
            else:
                q = urllib.parse.urlencode({"uploadType": "media", "name": k})
                req = urllib.request.Request(
                    f"{self.endpoint}/upload/storage/v1/b/{bucket}/o?{q}", data=v, method="POST"
                )
                urllib.request.urlopen(req, timeout=10).close()

    def delete(self, bucket: str, key: str) -> None:
        if self.scheme == "s3":
            self._s3.delete_object(Bucket=bucket, Key=key)
        else:
            url = f"{self.endpoint}/storage/v1/b/{bucket}/o/{urllib.parse.quote(key, safe='')}"
            urllib.request.urlopen(urllib.request.Request(url, method="DELETE"), timeout=10).close()

    def buckets(self) -> set[str]:
        if self.scheme == "s3":
            return {b["Name"] for b in self._s3.list_buckets()["Buckets"]}
        with urllib.request.urlopen(f"{self.endpoint}/storage/v1/b?project=test", timeout=10) as r:
            return {b["name"] for b in json.loads(r.read()).get("items", [])}

    def objects(self, bucket: str) -> dict[str, bytes]:
        if self.scheme == "s3":
            keys = [o["Key"] for o in self._s3.list_objects_v2(Bucket=bucket).get("Contents", [])]
            return {k: self._s3.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys}
        with urllib.request.urlopen(f"{self.endpoint}/storage/v1/b/{bucket}/o", timeout=10) as r:
            keys = [o["name"] for o in json.loads(r.read()).get("items", [])]
        out = {}
        for k in keys:
            url = f"{self.endpoint}/storage/v1/b/{bucket}/o/{urllib.parse.quote(k, safe='')}?alt=media"
            with urllib.request.urlopen(url, timeout=10) as r:
                out[k] = r.read()
        return out


def _junk(rng: random.Random, most: int = 5) -> str:
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(0, most)))


def _bucket(rng: random.Random, home: str, other: str) -> str:
    kind = rng.random()
    if kind < 0.7:
        return home
    if kind < 0.8:
        return home + _junk(rng, 3).split("/")[0]
    if kind < 0.9:  # (the neighbour's own name, exactly, is the home bucket's: a call may use it)
        name = _junk(rng, 3).split("/")[0] + rng.choice([home, other])
        return home if name == other else name
    return rng.choice(["", home.upper(), other + "#", home + "?", "..", ".", home[:2]])


SENTINELS = {"sentinel": b"home sentinel", "dir/sentinel": b"home dir sentinel", "o": b"an o"}


def _case(rng: random.Random, scheme: str, home: str, other: str) -> str:
    while True:
        key = _junk(rng)
        if rng.random() < 0.3:
            key = rng.choice(["sentinel", "dir/sentinel", "dir", ""]) + key
        # the GCS emulator keeps objects as files: "sentinel//.", "sentinel\\" and "sentinel" are one file
        # there (GCS itself has flat names); such an alias of a sentinel would test the emulator
        alias = posixpath.normpath(key.replace("\\", "/") or ".")
        if scheme == "s3" or key in SENTINELS or alias not in SENTINELS:
            return f"{scheme}://{_bucket(rng, home, other)}/{key}"


def main() -> None:
    import ckptio
    from ckptio.errors import CkptioError

    scheme, endpoint, seed, cases = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    flavor = "s3" if scheme == "s3" else "gcs"
    options = (
        {"access_key_id": "testing", "secret_access_key": "testing", "region": "us-east-1"}
        if flavor == "s3"
        else {"anon": True, "project": "test"}
    )
    fast = {"max_attempts": 2, "deadline": 10.0, "stall_timeout": 2.0, "connect_timeout": 2.0}
    ckptio.configure(backends={flavor: {"endpoint_url": endpoint, **options, **fast}})
    store = Store(scheme, endpoint)
    tag = f"{seed:x}-{os.getpid():x}"
    home, other = f"u-home-{tag}", f"u-next-{tag}"
    sentinels = SENTINELS
    theirs = {"sentinel": b"neighbour sentinel"}
    store.make(home, sentinels)
    store.make(other, theirs)
    rng = random.Random(seed)

    def touched(expect_home: dict[str, bytes]) -> str | None:
        """What differs from the two buckets as expected (the neighbour always as it was made)."""
        have = store.buckets()
        if not {home, other} <= have:
            return f"a bucket was deleted: {sorted({home, other} - have)}"
        for b, objs in ((home, expect_home), (other, theirs)):
            got = store.objects(b)
            if got != objs:
                return f"bucket {b}: objects {sorted(got)!r}, expected {sorted(objs)!r} (or other bytes)"
        return None

    for i in range(cases):
        uri = _case(rng, scheme, home, other)
        data = f"case {i} of seed {seed}".encode()
        steps: list[str] = []
        out = {"uri": uri, "outcome": "ok", "steps": steps, "t0": time.monotonic()}

        attempt = functools.partial(_attempt, steps, CkptioError)
        bucket, _, key = uri.split("://", 1)[1].partition("/")
        try:
            if not isinstance(attempt("put", functools.partial(ckptio.put, data, uri)), CkptioError):
                if bucket != home:
                    raise AssertionError("put succeeded on a bucket that is not the home bucket")
                problem = touched({**sentinels, key: data})
                if problem:
                    raise AssertionError(f"after put: {problem}")
                _round_trip(ckptio, attempt, uri, data)
                problem = touched({k: v for k, v in sentinels.items() if k != key})
            else:
                out["outcome"] = "refused"
                _refused(ckptio, attempt, uri, f"{scheme}://{home}/", CkptioError)
                named = {k for k in sentinels if bucket == home and (k == key or k.startswith(key.rstrip("/") + "/"))}
                have = store.objects(home)
                problem = touched({k: v for k, v in sentinels.items() if k in have or k not in named})
            if problem:
                raise AssertionError(problem)
        except AssertionError as e:
            out["outcome"], out["problem"] = "problem", str(e)
        if out["outcome"] != "ok" or key in sentinels:  # a call may have removed what its name names
            _reset(store, home, sentinels, other, theirs)
        out["seconds"] = round(time.monotonic() - out.pop("t0"), 3)
        print("RESULT " + json.dumps(out), flush=True)


def _attempt(steps: list[str], error: type, name: str, fn):
    """``fn()``, or the ckptio error it raised (noted in ``steps``); any other error is a finding."""
    try:
        value = fn()
    except error as e:
        steps.append(f"{name}: {type(e).__name__}: {str(e)[:160]}")
        return e
    except Exception as e:  # noqa: BLE001 - what is not a ckptio error is the finding
        raise AssertionError(f"{name} raised {type(e).__name__}: {e}") from None
    steps.append(f"{name}: ok")
    return value


def _round_trip(ckptio, attempt, uri: str, data: bytes) -> None:
    """A name ``put`` took: every other call sees exactly that object, and ``remove`` removes it."""
    got = attempt("get", lambda: ckptio.get(uri))
    if got != data:
        raise AssertionError(f"get gave {got!r}")
    for name, call in (("exists", ckptio.exists), ("isfile", ckptio.isfile)):
        if attempt(name, lambda c=call: c(uri)) is not True:
            raise AssertionError(f"{name} is not True after put")
    info = attempt("stat", lambda: ckptio.stat(uri))
    if getattr(info, "size", None) != len(data):
        raise AssertionError(f"stat gave {info!r}")
    if attempt("remove", lambda: ckptio.remove(uri)) is not None:
        raise AssertionError("remove failed after put")


def _refused(ckptio, attempt, uri: str, home: str, error: type) -> None:
    """A name ``put`` refused: the other calls refuse it too, or read or remove only what it names (a
    sentinel's own name; under it, for ``rmtree``); ``ls`` lists only the home bucket."""
    for name, call in (("get", ckptio.get), ("exists", ckptio.exists), ("isfile", ckptio.isfile)):
        attempt(name, lambda c=call: c(uri))
    listed = attempt("ls", lambda: list(ckptio.ls(uri)))
    if not isinstance(listed, error) and any(not u.startswith(home) for u in listed):
        raise AssertionError(f"ls listed {listed!r}")
    attempt("remove", lambda: ckptio.remove(uri))
    if uri.split("://", 1)[1].partition("/")[2].strip("/"):  # not a bucket's root: rmtree takes what is under it
        attempt("rmtree", lambda: ckptio.rmtree(uri))


def _reset(store: Store, home: str, sentinels: dict, other: str, theirs: dict) -> None:
    """After each case: both buckets as they were made, so the next case starts clean."""
    for bucket, objs in ((home, sentinels), (other, theirs)):
        if bucket not in store.buckets():
            store.make(bucket, {})
        have = store.objects(bucket)
        for k in set(have) - set(objs):
            store.delete(bucket, k)
        store.put(bucket, {k: v for k, v in objs.items() if have.get(k) != v})


if __name__ == "__main__":
    main()
