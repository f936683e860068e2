#!/usr/bin/env bash
# Run ON THE GPU MACHINE (device tool, carry [".whl", ".git-sha"]): install the project, then
# either the CUDA tests, suite commands, a probe script, or a plan of several of them, and copy
# the reports flat into $OUT so they come back.
# The copy there carries a git of another commit (the session's first), its tree "dirty":
# write `git rev-parse HEAD > .git-sha` here first so reports record the commit they ran.
#   bash scripts/device_check.sh tests [pytest args]
#   bash scripts/device_check.sh suite run            (any suite command line)
#   bash scripts/device_check.sh python scripts/moe_tune.py --preset olmoe   (a probe script)
#   bash scripts/device_check.sh plan scripts/gpu-check.plan     (the check every change needs)
# A plan installs once, then runs its lines in order, each "SECONDS MODE ARGS..." under its own
# timeout (# starts a comment; ARGS quoted as in a shell), and prints one line per step last:
# a call that runs out of time still returns every step that finished.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}
mkdir -p "$out"
if [ -z "${SUITE_DEVICE_INSTALLED:-}" ]; then
  [ -s .git-sha ] && export SUITE_GIT_SHA=$(cat .git-sha) || echo "no .git-sha: reports name the copy's git commit"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || { echo "carry .whl (scripts/device_wheels.sh)"; exit 3; }
  python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null || exit 3
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.used,memory.total --format=csv,noheader
  export SUITE_DEVICE_INSTALLED=1
fi
# SonicMoE (scripts/sonicmoe_wheels.sh): its wheels' files in one xz archive (carry .sonic/site),
# unpacked once, on the path of every later call while the machine stays warm
if [ ! -d /tmp/sonic-site ] && [ -s .sonic/site/sonic-site.tar.xz ]; then
  mkdir -p /tmp/sonic-site && tar xJf .sonic/site/sonic-site.tar.xz -C /tmp/sonic-site --strip-components=1 \
    && echo "SonicMoE installed" || { echo "SonicMoE's archive did not unpack"; rm -rf /tmp/sonic-site; }
fi
if [ -d /tmp/sonic-site ]; then
  export PYTHONPATH=/tmp/sonic-site/nvidia_cutlass_dsl/python_packages:/tmp/sonic-site:${PYTHONPATH:-}
  # QuACK autotunes each GEMM for each new shape, compiling every config first (minutes on a
  # fresh machine, docs/arms/moe.md); its autotune results and compiled .o files go to one
  # folder, which comes back in $OUT (quack-cache.tgz, split in 15 MB parts) and, carried as
  # .sonic/jit (in this call or an earlier one on the machine: with .sonic/site it may pass the
  # 64 MiB), spares a later machine that work
  export QUACK_CACHE_DIR=/tmp/quack-cache QUACK_COMPILE_WORKERS=16
fi
if [ ! -d /tmp/quack-cache ] && ls .sonic/jit/quack-cache.tgz.* >/dev/null 2>&1; then
  cat .sonic/jit/quack-cache.tgz.* | tar xz -C /tmp && echo "SonicMoE's QuACK cache restored"
fi
mode=${1:-tests}; shift || true
case "$mode" in
  # each test's name and verdict into the log as it ends, so a step cut off by its timeout
  # still says which tests finished; the console gets the log's tail
  tests) python3 -m pytest -v -m cuda "$@" >>"$out/cuda-tests.log" 2>&1; rc=$?
    grep -E "FAILED|ERROR|passed|failed" "$out/cuda-tests.log" | tail -40 ;;
  suite) python3 -m cli "$@" --reports "$out/reports"; rc=$? ;;
  python) python3 "$@"; rc=$? ;;
  plan)
    summary=()
    while read -r limit step; do
      [[ -z "$limit" || "$limit" == \#* ]] && continue
      start=$SECONDS
      echo "== plan step: $step (at most ${limit} s)"
      # split as tests/test_plans.py splits it (shlex): a quoted contender name stays one argument
      mapfile -d '' -t args < <(python3 -c \
        'import shlex, sys; sys.stdout.write("\0".join(shlex.split(sys.argv[1])))' "$step")
      if [ ${#args[@]} -eq 0 ]; then
        summary+=("not run: its quotes do not close: $step")
        continue
      fi
      timeout "$limit" bash "$0" "${args[@]}"
      status=$?
      [ $status -eq 124 ] && verdict="timed out" || verdict="exit $status"
      summary+=("$(printf '%-9s %5d s  %s' "$verdict" $((SECONDS - start)) "$step")")
    done < "$1"
    echo "== plan: one line per step"
    printf '%s\n' "${summary[@]}" | tee "$out/plan-summary.txt"
    rc=0 ;;
  *) echo "usage: device_check.sh tests|suite|python|plan ..."; exit 2 ;;
esac
# the device returns files at most two folders down: flatten each report directory
for d in "$out"/reports/*/; do
  [ -d "$d" ] || continue
  name=$(basename "$d")
  for f in report.json report.md; do cp "$d/$f" "$out/${name}_$f" 2>/dev/null; done
done
rm -rf "$out/reports"
if [ -d /tmp/quack-cache ]; then
  tar czf /tmp/quack-cache.tgz -C /tmp quack-cache && split -b 15M -d /tmp/quack-cache.tgz "$out/quack-cache.tgz."
  du -sh /tmp/quack-cache /tmp/quack-cache.tgz
fi
exit $rc
