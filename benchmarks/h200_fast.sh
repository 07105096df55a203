#!/usr/bin/env bash
# The second of two H200 calls (the first stages the CuTe DSL: `source .devcarry/cutedsl/env.sh`):
# carry .devcarry/wheels; runs the fast-mode GPU tests, then the given steps of h200_sm90.sh.
set -uo pipefail
test -f /tmp/cutedsl-site/.ok || { echo "cutedsl not staged: stage again"; exit 3; }
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
timeout "${FT_LIMIT:-200}" env PYTHONPATH=/tmp/cutedsl-site:/tmp/cutedsl-site/nvidia_cutlass_dsl/dsl_packages:$PWD \
  CUTE_DSL_CACHE_DIR=/tmp/cutedsl-cache QUACK_CACHE_DIR=/tmp/quack-cache bash -c \
  'source .devcarry/wheels/env.sh >/dev/null; python3 -m pytest -q -p no:cacheprovider -W ignore --tb=short ${FT_ARGS:-tests/test_sm90_fast.py}' \
  > "$OUT/fast_tests.log" 2>&1
echo "fast tests rc=$?"; grep -E "^E |passed|failed|Error" "$OUT/fast_tests.log" | tail -25
[ -n "${STEPS:-}" ] && bash benchmarks/h200_sm90.sh
exit 0
