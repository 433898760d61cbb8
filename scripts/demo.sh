#!/usr/bin/env bash
# The main job, on a fresh machine with nothing configured:
#  1. examples/demo.py: an embedded S3 server and GCS emulator, a model + optimizer state round-tripped
#     through a local path, s3://, gs:// and an alias scheme, checked exactly, sizes and GB/s;
#  2. the quick throughput benchmark (benchmarks/throughput.py): local dir, memory://, S3 and GCS on
#     loopback x .fpk/.pt/DCP against torch.save, safetensors, torch DCP, raw and s3fs/gcsfs baselines.
#     Prints the table and where the JSON results and the PNG chart were written (benchmarks/results/);
#  3. the S3 part again under --profile realistic (a loopback proxy adds first-byte latency and a
#     per-connection bandwidth cap, as a remote object store has).
# Extra arguments go to the benchmark, e.g. `./scripts/demo.sh --full` or `--uri s3://my-bucket/tmp`.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
.venv/bin/python examples/demo.py --layers 4
echo
echo "== throughput benchmark (python -m benchmarks.throughput ${*:---quick}) =="
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m benchmarks.throughput "$@"
fi
.venv/bin/python -m benchmarks.throughput --quick
echo
echo "== the same on S3 as a remote store behaves (--profile realistic: 20 ms first-byte latency, 90 MB/s per connection) =="
exec .venv/bin/python -m benchmarks.throughput --quick --backends s3 --profile realistic
