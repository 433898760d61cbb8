# Sourced by scripts/demo.sh and scripts/test.sh: create or refresh .venv with the pinned dev set.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# Re-install only when the requirements or project metadata changed since the last install.
STAMP=.venv/.ckptio-installed
HASH="$(cat requirements/*.txt pyproject.toml | sha256sum | cut -d" " -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$HASH" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -U pip
  .venv/bin/python -m pip install -q --disable-pip-version-check -r requirements/dev.txt -e .
  echo "$HASH" > "$STAMP"
fi
export GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false
