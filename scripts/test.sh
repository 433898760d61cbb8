#!/usr/bin/env bash
# Run the test suite (starts its own S3 and GCS servers on loopback). Extra args go to pytest.
# Two xdist workers by default, each file's tests on one worker (its module fixtures stay shared);
# CKPTIO_TEST_WORKERS=0 (or `-n 0`) runs in this one process, e.g. under --pdb.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
exec .venv/bin/python -m pytest -p no:cacheprovider -n "${CKPTIO_TEST_WORKERS:-2}" --dist loadfile "$@"
