#!/usr/bin/env bash
# Lint, format check and type check, all three even when one fails (CI runs this before the tests).
# The settings are in pyproject.toml. `scripts/lint.sh --fix` applies ruff's fixes and formats first.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
PATHS=(ckptio tests benchmarks examples scripts)
failed=0
if [ "${1:-}" = "--fix" ]; then
  .venv/bin/ruff check --fix "${PATHS[@]}" || failed=1
  .venv/bin/ruff format "${PATHS[@]}" || failed=1
else
  .venv/bin/ruff check "${PATHS[@]}" || failed=1
  .venv/bin/ruff format --check "${PATHS[@]}" || failed=1
fi
.venv/bin/mypy || failed=1  # ckptio/ ([tool.mypy] files)
exit "$failed"
