#!/usr/bin/env bash
# Prove that the documented extras resolve without backtracking: in a fresh venv (pip upgraded
# first, as install guides do; CHECK_INSTALL_PIP=bundled keeps the venv's own), with no constraints
# but the machine's pip config, `pip install --dry-run -e .[EXTRA]` must pick one
# version of every package (pip prints "looking at multiple versions" when it backtracks) within
# CHECK_INSTALL_TIMEOUT seconds (default 240; a cold pip cache spends most of it fetching index pages).
# Nothing is installed. Prints the time and the chosen s3fs/aiobotocore/botocore/boto3/gcsfs versions.
# CHECK_INSTALL_TORCH=2.13.0 holds torch to that release (CI: the CPU wheel on local disk), the only
# constraint it adds.
# Usage: scripts/check_install.sh [EXTRA ...]          (default: all bench)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
LIMIT="${CHECK_INSTALL_TIMEOUT:-240}"
[ $# -gt 0 ] || set -- all bench
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
"$PY" -m venv "$TMP/venv"
VPY="$TMP/venv/bin/python"
if [ "${CHECK_INSTALL_PIP:-latest}" != bundled ]; then
  "$VPY" -m pip install --quiet --disable-pip-version-check --upgrade pip 2>&1 | grep -v "is ignored: it is neither" >&2 || true
fi
if [ -n "${CHECK_INSTALL_TORCH:-}" ]; then
  echo "torch==$CHECK_INSTALL_TORCH" >"$TMP/torch.txt"
  export PIP_CONSTRAINT="$TMP/torch.txt"
fi
echo "check_install: $("$VPY" -m pip --version | cut -d' ' -f1-2), limit ${LIMIT}s per extra, extras resolved in parallel"

resolve() {  # EXTRA: dry-run resolution into $TMP/EXTRA.{log,json,secs,rc}
  local out="$TMP/$1" start rc=0
  start=$(date +%s)
  timeout "$LIMIT" "$VPY" -m pip install --dry-run --ignore-installed --disable-pip-version-check \
    --report "$out.json" -e "$ROOT[$1]" >"$out.log" 2>&1 || rc=$?
  echo $(( $(date +%s) - start )) >"$out.secs"
  echo "$rc" >"$out.rc"
}
for extra in "$@"; do resolve "$extra" & done
wait

failed=0
for extra in "$@"; do
  out="$TMP/$extra" rc="$(cat "$TMP/$extra.rc")" why=""
  backtracked="$(grep -o "looking at multiple versions of [^ ]*" "$out.log" | awk '{print $NF}' | sort -u |
                 tr '\n' ' ' || true)"
  if [ -n "$backtracked" ]; then why="pip backtracked (${backtracked% })"
  elif [ "$rc" = 124 ]; then why="not resolved within ${LIMIT}s"
  elif [ "$rc" != 0 ]; then why="pip failed (exit $rc)"
  fi
  if [ -n "$why" ]; then
    grep -v "is ignored: it is neither" "$out.log" | tail -15 >&2 || true
    echo "check_install: FAIL: ckptio[$extra]: $why. If pip backtracked through boto3/botocore/aiobotocore," \
         "move the boto3 window in pyproject.toml to the botocore range of the newest aiobotocore (and" \
         "requirements/dev.txt with it)." >&2
    failed=1
    continue
  fi
  "$VPY" - "$out.json" "$extra" "$(cat "$out.secs")" <<'PYEOF'
import json, sys
report, extra, secs = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3]
got = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in report["install"]}
keys = ("s3fs", "aiobotocore", "botocore", "boto3", "gcsfs", "fsspec", "torch")
print(f"check_install: ckptio[{extra}] resolved in {secs}s, {len(got)} packages:",
      " ".join(f"{k}={got[k]}" for k in keys if k in got))
PYEOF
done
exit "$failed"
