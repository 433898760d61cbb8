#!/usr/bin/env bash
# The main job: start an embedded S3 server and GCS emulator, round-trip a model + optimizer state
# through a local path, s3://, gs:// and an alias scheme, and print sizes and GB/s.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
exec .venv/bin/python examples/demo.py "$@"
