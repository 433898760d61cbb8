"""ckptio demo: one model + optimizer state through a local path, S3, GCS and an alias scheme.

Starts an S3 API server (moto) and the GCS emulator on loopback, writes a ckptio.toml that points
``s3://`` and ``gs://`` at them and defines the alias ``ckpt://`` -> ``s3://demo-bucket/checkpoints``,
then dumps and loads the state in each place, checks it came back exactly and prints sizes and GB/s.
Pass real URIs with ``--uri`` to try your own storage instead (settings from your ckptio.toml).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import torch

import ckptio


def make_state(hidden: int, layers: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden) for _ in range(layers)])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, hidden)).sum().backward()
    optim.step()
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=10)
    return {
        "model": model.state_dict(),
        "optim": optim.state_dict(),
        "scheduler": sched.state_dict(),
        "step": 100,
        "config": {"hidden": hidden, "layers": layers, "lr": 1e-3},
    }


def nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(v) for v in obj)
    return 0


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def roundtrip(state: dict, uri: str, size: int) -> None:
    t0 = time.perf_counter()
    ckptio.dump(state, uri)
    t1 = time.perf_counter()
    back = ckptio.load(uri)
    t2 = time.perf_counter()
    stored = ckptio.stat(uri).size
    ok = "ok" if same(state, back) else "MISMATCH"
    print(
        f"  {uri:<58} {stored / 2**20:8.1f} MiB   dump {size / (t1 - t0) / 1e9:6.2f} GB/s"
        f"   load {size / (t2 - t1) / 1e9:6.2f} GB/s   {ok}"
    )
    if ok != "ok":
        raise SystemExit(f"round trip through {uri} did not restore the state exactly")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024, help="width of each Linear layer (default 1024)")
    ap.add_argument("--layers", type=int, default=16, help="number of layers (default 16: ~200 MiB with Adam state)")
    ap.add_argument("--uri", action="append", default=[], help="round-trip through these URIs instead")
    args = ap.parse_args()

    state = make_state(args.hidden, args.layers)
    size = nbytes(state)
    exts = [".pt", ".fpk"]
    print(f"state: model + AdamW + scheduler, {size / 2**20:.1f} MiB of tensors; formats {exts}")

    if args.uri:
        for u in args.uri:
            roundtrip(state, u, size)
        return

    from servers import GCSEmulator, MotoServer, make_gcs_bucket, make_s3_bucket

    with tempfile.TemporaryDirectory(prefix="ckptio-demo-") as tmp, MotoServer() as s3, GCSEmulator() as gcs:
        make_s3_bucket(s3.url, "demo-bucket")
        make_gcs_bucket(gcs.url, "demo-bucket")
        settings = os.path.join(tmp, "ckptio.toml")
        with open(settings, "w") as f:
            f.write(f"""
[backends.s3]
endpoint_url = "{s3.url}"
region = "us-east-1"
access_key_id = "demo"
secret_access_key = "demo-secret"

[backends.gcs]
endpoint_url = "{gcs.url}"
token = "anon"

[aliases.ckpt]
target = "s3://demo-bucket/checkpoints"
""")
        os.environ["CKPTIO_CONFIG"] = settings
        ckptio.reset()
        print(f"S3 server {s3.url}, GCS emulator {gcs.url}, settings {settings}")
        print("effective settings (as `ckptio config` shows them):")
        ckptio.cli.main(["config"])
        for ext in exts:
            for base in (os.path.join(tmp, "local"), "s3://demo-bucket/run1", "gs://demo-bucket/run1", "ckpt://run1"):
                roundtrip(state, f"{base}/step100{ext}", size)
        print("listing ckpt://run1:", ckptio.ls("ckpt://run1"))
        ckptio.reset()


if __name__ == "__main__":
    main()
