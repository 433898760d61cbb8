"""A fuzzer of copies whose sources change while they are copied (run by test_copy_versions in a child).

``python copy_fuzz.py SECONDS [SEED] [S3_ENDPOINT]``: for SECONDS, copies with random sizes, part sizes,
``jobs`` and tree shapes from local disk, ``memory://`` and (with an endpoint) S3, to another backend;
at a random point of the copy's progress one source is replaced (a rename over a local file, an in-place
rewrite of another size, a new upload, a delete). Each copy must raise IntegrityError or
FileNotFoundError naming the changed source, or leave every destination object equal to exactly one
version of its source; a failed copy leaves no object it had not finished before the change.
Prints ``checked N copies``.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import tempfile
import time
import uuid

import ckptio
from ckptio import transfer
from ckptio.errors import IntegrityError

KiB = 1 << 10


def replace(uri: str, data: bytes | None, how: str) -> None:
    backend, resolved = ckptio.resolve(uri)
    path = backend.file_path(resolved)
    if data is None:
        backend.delete(resolved)
    elif path is None:
        backend.write(resolved, data)
    elif how == "in place":  # another size: a size a reader can see
        with open(path, "r+b") as f:
            f.write(data)
            f.truncate()
    else:
        with open(path + ".new", "wb") as f:
            f.write(data)
        os.replace(path + ".new", path)


def one(rng: random.Random, src_root: str, dst_root: str, part: int, parts: int) -> None:
    """One copy of 1-3 objects of up to ``parts`` parts each, one of them changed while it runs."""
    n = rng.choice([1, 1, 2, 3])
    sizes = [rng.choice([0, 1, part - 1, part, part + 1, rng.randrange(1, parts * part)]) for _ in range(n)]
    names = [f"f{i}.bin" for i in range(n)]
    old = {name: rng.randbytes(size) for name, size in zip(names, sizes, strict=True)}
    for name, data in old.items():
        ckptio.put(data, f"{src_root}/{name}")
    victim = rng.choice(names)
    how = rng.choice(["rename", "in place", "delete"])
    new: bytes | None = (
        None if how == "delete" else rng.randbytes(rng.choice([len(old[victim]), rng.randrange(1, parts * part)]))
    )
    if how == "in place" and new is not None and len(new) == len(old[victim]):
        new += b"+"  # the same size in the same clock tick as the last write cannot be told apart
    at = rng.randrange(0, sum(sizes) + 1)
    fired: list[int] = []

    def progress(done: int, total: int) -> None:
        if not fired and done >= at:
            fired.append(done)
            replace(f"{src_root}/{victim}", new, how)

    tree = n > 1 or rng.random() < 0.5
    src, dst = (src_root, f"{dst_root}/t") if tree else (f"{src_root}/{victim}", f"{dst_root}/t/{victim}")
    try:
        transfer.copy(src, dst, recursive=tree, jobs=rng.choice([1, 2, 4]), progress=progress)
        error = None
    except (IntegrityError, FileNotFoundError) as e:
        error = e
        assert victim in str(e), f"the error does not name the changed source {victim}: {e}"
    for name in names if tree else [victim]:
        target = f"{dst_root}/t/{name}"
        versions = [old[name]] + ([new] if name == victim and new is not None else [])
        if ckptio.exists(target):
            got = ckptio.get(target)
            assert got in versions, f"{target}: {len(got)} bytes, none of the versions {[len(v) for v in versions]}"
        else:
            assert error is not None, f"{target} missing after a copy that succeeded"


def main() -> None:
    seconds = float(sys.argv[1])
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else random.randrange(1 << 30)
    endpoint = sys.argv[3] if len(sys.argv) > 3 else ""
    rng = random.Random(seed)
    tmp = tempfile.mkdtemp(prefix="copy-fuzz-")
    kinds = ["local", "memory"]
    if endpoint:
        from servers import make_s3_bucket

        bucket = f"fuzz-{uuid.uuid4().hex[:12]}"
        make_s3_bucket(endpoint, bucket)
        opts = {"endpoint_url": endpoint, "access_key_id": "testing", "secret_access_key": "testing"}
        ckptio.configure(backends={"s3": {**opts, "region": "us-east-1", "part_size": 5 << 20, "concurrency": 1}})
        kinds.append("s3")
    count, deadline = 0, time.monotonic() + seconds
    try:
        while time.monotonic() < deadline or count < len(kinds):
            kind = kinds[count % len(kinds)]
            part = 5 << 20 if kind == "s3" else rng.choice([1, 7, 4 * KiB, 64 * KiB])
            ckptio.configure(backends={"local": {"part_size": part, "concurrency": rng.choice([1, 2])}})
            ckptio.configure(backends={"memory": {"part_size": part, "concurrency": rng.choice([1, 2])}})
            case = f"c{count}"
            roots = {
                "local": os.path.join(tmp, case),
                "memory": f"memory://fuzz/{case}",
                "s3": f"s3://{bucket}/{case}" if endpoint else "",
            }
            dst_kind = "memory" if kind == "local" else "local"
            try:
                one(rng, roots[kind], f"{roots[dst_kind]}-dst", part, 2 if kind == "s3" else 4)
            except BaseException:
                print(f"seed {seed} case {count} ({kind} -> {dst_kind}, part {part}) failed", flush=True)
                raise
            count += 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"checked {count} copies (seed {seed})")


if __name__ == "__main__":
    main()
