"""A fuzzer of copies whose sources change while they are copied (run by test_copy_versions in a child).

``python copy_fuzz.py SECONDS [SEED] [S3_ENDPOINT]``: for SECONDS, copies with random sizes, part sizes,
``jobs`` and tree shapes from local disk, ``memory://`` and (with an endpoint) S3, to the same or another
backend (local or memory); at a random point of the bytes written one source is replaced (a rename over a
local file, an in-place rewrite of another size, a new upload, a delete). Each copy must raise IntegrityError or
FileNotFoundError naming the changed source, or leave every destination object equal to exactly one
version of its source; a failed copy leaves no object it had not finished before the change.
Prints ``checked N copies``.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import ckptio
from ckptio import transfer
from ckptio.backends.base import BufferedWriter
from ckptio.backends.local import LocalWriter
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


@contextlib.contextmanager
def written(seen: Callable[[int], None]) -> Iterator[None]:
    """``seen(bytes written so far)`` after each write to a local or memory destination in the block,
    whichever way the copy goes (streamed, or one backend's own ``copy``)."""
    total, lock, real = [0], threading.RLock(), {cls: cls.write for cls in (LocalWriter, BufferedWriter)}

    def hook(cls: type) -> Callable[..., int]:
        def write(self: Any, data: Any) -> int:
            n = real[cls](self, data)
            with lock:
                total[0] += memoryview(data).nbytes
                seen(total[0])
            return n

        return write

    for cls in real:
        cls.write = hook(cls)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for cls, write in real.items():
            cls.write = write  # type: ignore[method-assign]


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

    def progress(done: int) -> None:
        if not fired and done >= at:
            fired.append(done)
            replace(f"{src_root}/{victim}", new, how)

    tree = n > 1 or rng.random() < 0.5
    src, dst = (src_root, f"{dst_root}/t") if tree else (f"{src_root}/{victim}", f"{dst_root}/t/{victim}")
    try:
        with written(progress):
            transfer.copy(src, dst, recursive=tree, jobs=rng.choice([1, 2, 4]))
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
            dst_kind = rng.choice([kind if kind != "s3" else "local", "memory" if kind == "local" else "local"])
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
