"""A child process that reads objects through a hostile proxy answering with random reply headers, and
checks that each read returns the object's bytes or raises a ckptio error: never other bytes.

``python reply_workers.py SCHEME ENDPOINT SEED CASES`` writes a small and a larger object (and an
``.fpk`` of a few tensors) straight to the server, then for each case puts a :class:`hostile.HostileProxy`
in front of it whose data GETs get, at random, another status (206/200/3xx/416/5xx), ``Content-Range``,
``Content-Length``, ``Content-Encoding``, ``Location`` (a host serving its own bytes), body (cut,
longer, gzipped: what the headers then misstate) or request range, and reads one object (``get``,
``readinto`` from an offset, an ``.fpk`` load). Each case runs under an alarm. One ``RESULT`` JSON line
per case: ``ok``, ``refused`` (a ckptio error), ``smaller`` (a prefix of the object, where a 200 reply
said the object is that long: only a checksum would tell) or a ``problem`` (other bytes, another error
type, a hang); :func:`run_cases` is the parent's side.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import signal
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

MiB = 1024 * 1024


def run_cases(scheme: str, endpoint: str, seed: int, cases: int, timeout: float = 300) -> list[dict]:
    """Run ``cases`` hostile replies in a child (forked from the zygote); the result of each, in order."""
    import zygote

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = zygote.run([sys.executable, __file__, scheme, endpoint, str(seed), str(cases)], timeout=timeout, env=env)
    results = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and len(results) == cases, (proc.returncode, proc.stdout[-3000:], proc.stderr[-4000:])
    return results


class CaseTimeout(BaseException):
    pass


def _on_alarm(signum, frame):
    raise CaseTimeout()


def _mutation(rng: random.Random, decoy: str):
    """A random (ask, answer) pair for the proxy: each data GET is changed with probability 1/2."""
    from hostile import Reply, shifted

    shift = shifted(rng.choice([1, 7, 4096, -1]))
    status = rng.choice([None, None, 200, 206, 301, 302, 303, 307, 308, 304, 416, 500])
    content_range = rng.choice([None, None, "drop", "shift", "garbage", "total", "star"])
    length = rng.choice([None, None, None, "short", "long", "zero"])
    encoding = rng.choice(
        [None, None, "gzip-body", "gzip-header", "identity", "br", "gzip, identity", "aws-chunked", "aws-chunked, gzip"]
    )
    body = rng.choice([None, None, "cut", "empty", "extra"])
    change_rng = random.Random(rng.random())
    said = f"status={status} range={content_range} length={length} encoding={encoding} body={body}"

    moved: set[tuple[str, str | None]] = set()  # requests sent for other bytes: their Content-Range stays true

    def ask(sent):
        if change_rng.random() >= 0.2:
            return sent.headers
        moved.add((sent.path, sent.range()))
        return shift(sent)

    smaller: list[bool] = []  # a 200 sent that says the object is smaller than it is

    def answer(reply: Reply, sent) -> Reply:
        if change_rng.random() < 0.5:
            return reply
        headers, data, out_status = list(reply.headers), reply.body, status or reply.status
        cr = reply.header("content-range")
        headers = [(k, v) for k, v in headers if k.lower() not in ("content-range", "content-encoding", "location")]
        # (other bytes relabelled as the bytes asked for is a body damaged in flight: only a checksum tells)
        if (content_range is None or (sent.path, sent.range()) in moved) and cr:
            headers.append(("Content-Range", cr))
        elif content_range == "shift" and cr:
            a, _, rest = cr[6:].partition("-")
            b, _, t = rest.partition("/")
            headers.append(("Content-Range", f"bytes {int(a) + 1}-{int(b) + 1}/{t}"))
        elif content_range == "garbage":
            headers.append(("Content-Range", rng.choice(["bytes x-y/z", "bytes 0-/5", "items 0-1/2", "bytes -5"])))
        elif content_range == "total":
            headers.append(("Content-Range", f"bytes 0-{max(len(data) - 1, 0)}/{len(data)}"))
        elif content_range == "star":
            headers.append(("Content-Range", f"bytes 0-{max(len(data) - 1, 0)}/*"))
        if body == "cut":
            data = data[: len(data) // 2]
        elif body == "other":
            data = bytes(b ^ 0x5A for b in data)
        elif body == "empty":
            data = b""
        elif body == "extra":
            data = data + b"\x00" * 17
        if encoding == "gzip-body":
            data = gzip.compress(data, compresslevel=1)
            headers.append(("Content-Encoding", "gzip"))
        elif encoding is not None and encoding != "gzip-header":
            headers.append(("Content-Encoding", encoding))
        elif encoding == "gzip-header":
            headers.append(("Content-Encoding", "gzip"))
        if 300 <= out_status < 400:
            headers.append(("Location", decoy + sent.path))
        n = {"short": max(len(data) - 3, 0), "long": len(data) + 3, "zero": 0}.get(length or "", None)
        if out_status == 200 and (reply.status != 200 or len(data) < len(reply.body) or (n or 0) < len(data)):
            smaller.append(True)
        return Reply(out_status, headers, data, n)

    return ask, answer, said, smaller


def main() -> None:
    import torch

    import ckptio
    from ckptio.errors import CkptioError
    from hostile import HostileProxy, forged

    scheme, endpoint, seed, cases = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    flavor = "s3" if scheme == "s3" else "gcs"
    options = (
        {"access_key_id": "testing", "secret_access_key": "testing", "region": "us-east-1", "part_size": 5 * MiB}
        if flavor == "s3"
        else {"anon": True, "project": "test", "part_size": 256 * 1024}
    )
    fast = {"max_attempts": 3, "deadline": 15.0, "stall_timeout": 1.0, "connect_timeout": 2.0, "concurrency": 3}

    def configure(url: str) -> None:
        ckptio.configure(backends={flavor: {"endpoint_url": url, **options, **fast}})

    from servers import make_gcs_bucket, make_s3_bucket

    bucket = f"r-{seed:x}-{os.getpid():x}"
    (make_s3_bucket if flavor == "s3" else make_gcs_bucket)(endpoint, bucket)
    base = f"{scheme}://{bucket}"
    rng = random.Random(seed)
    small, large = os.urandom(100_000), os.urandom(6 * MiB + 5 if flavor == "s3" else 700_001)
    state = {"w": torch.arange(200_000, dtype=torch.float32), "b": torch.ones(3)}
    configure(endpoint)
    ckptio.put(small, base + "/small.bin")
    ckptio.put(large, base + "/large.bin")
    ckptio.dump(state, base + "/state.fpk")

    def read_at(uri: str, offset: int, n: int) -> bytes:
        buf = bytearray(n)
        got = ckptio.readinto(uri, buf, offset)
        return bytes(buf[:got])

    def load_state(uri: str) -> bool:
        out = ckptio.load(uri)
        return set(out) == set(state) and all(torch.equal(out[k], state[k]) for k in state)

    reads = [
        ("get small", lambda: ckptio.get(base + "/small.bin"), small),
        ("get large", lambda: ckptio.get(base + "/large.bin"), large),
        ("readinto large at 300001", lambda: read_at(base + "/large.bin", 300_001, len(large)), large[300_001:]),
        ("load fpk", lambda: load_state(base + "/state.fpk"), True),
    ]
    signal.signal(signal.SIGALRM, _on_alarm)
    with HostileProxy(endpoint, answer=forged(len(large))) as decoy:
        for _ in range(cases):
            name, read, want = rng.choice(reads)
            ask, answer, said, smaller = _mutation(rng, decoy.url)
            out: dict = {"read": name, "outcome": "ok", "replies": said}
            with HostileProxy(endpoint, ask=ask, answer=answer) as p:
                configure(p.url)
                signal.alarm(60)
                try:
                    got = read()
                    if got != want and smaller and isinstance(got, bytes) and want.startswith(got):
                        out["outcome"] = "smaller"  # as a 200 said: no client tells that without a checksum
                    elif got != want:
                        at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
                        out["outcome"], out["problem"] = "problem", f"other bytes returned ({len(got)}, from {at})"
                        out["log"] = [f"{m} {path[:60]} {h.get('Range')}" for m, path, h in p.requests]
                except CkptioError as e:
                    out["outcome"], out["error"] = "refused", f"{type(e).__name__}: {str(e)[:300]}"
                except CaseTimeout:
                    out["outcome"], out["problem"] = "problem", "no answer within 60 s"
                except Exception as e:  # noqa: BLE001 - what is not a ckptio error is the finding
                    out["outcome"], out["problem"] = "problem", f"{type(e).__name__}: {str(e)[:300]}"
                finally:
                    signal.alarm(0)
                    out["changed"] = p.changed
            ckptio.reset()
            print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
