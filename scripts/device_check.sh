#!/usr/bin/env bash
# Run ON THE GPU MACHINE (device tool, carry [".whl", ".git-sha"]): install the project, then
# either the CUDA tests or suite commands, and copy the reports flat into $OUT so they come back.
# The copy there carries a git of another commit (the session's first), its tree "dirty":
# write `git rev-parse HEAD > .git-sha` here first so reports record the commit they ran.
#   bash scripts/device_check.sh tests [pytest args]
#   bash scripts/device_check.sh suite run            (any suite command line)
#   bash scripts/device_check.sh python scripts/moe_tune.py --preset olmoe   (a probe script)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}
[ -s .git-sha ] && export SUITE_GIT_SHA=$(cat .git-sha) || echo "no .git-sha: reports name the copy's git commit"
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site || { echo "carry .whl (scripts/device_wheels.sh)"; exit 3; }
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null || exit 3
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.used,memory.total --format=csv,noheader
mode=${1:-tests}; shift || true
case "$mode" in
  tests) python3 -m pytest -q -m cuda "$@" 2>&1 | tee "$out/cuda-tests.log"; rc=${PIPESTATUS[0]} ;;
  suite) python3 -m cli "$@" --reports "$out/reports"; rc=$? ;;
  python) python3 "$@"; rc=$? ;;
  *) echo "usage: device_check.sh tests|suite|python ..."; exit 2 ;;
esac
# the device returns files at most two folders down: flatten each report directory
for d in "$out"/reports/*/; do
  [ -d "$d" ] || continue
  name=$(basename "$d")
  for f in report.json report.md; do cp "$d/$f" "$out/${name}_$f" 2>/dev/null; done
done
rm -rf "$out/reports"
exit $rc
