#!/usr/bin/env bash
# Run the whole test suite (starts its own S3 and GCS servers on loopback). Extra args go to pytest.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
exec .venv/bin/python -m pytest -p no:cacheprovider "$@"
