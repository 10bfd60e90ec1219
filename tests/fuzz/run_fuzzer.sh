#!/usr/bin/env bash
# A fuzz target as a test (tests/fuzz/BUILD):
#   run_fuzzer.sh MODE BINARY DICT [--plans PREFIX] SEED...
# MODE replay (normal build): run every seed once; fuzz (--config=asan): libFuzzer for
# PIPEC_FUZZ_SECONDS (default 20) from the seeds, in a fresh corpus; a crash fails the test.
# --plans PREFIX adds the plans of tests/fuzz/seed_plans.txt whose names start with PREFIX
# ("" for all), compiled here by tools/pipec from examples/.
set -euo pipefail
mode=$1 bin=$2 dict=$3
shift 3
tmp=${TEST_TMPDIR:-$(mktemp -d)}
mkdir -p "$tmp/seeds" "$tmp/corpus"
if [ "${1:-}" = --plans ]; then
  prefix=$2
  shift 2
  while read -r name flags; do
    case "$name" in '#'* | '') continue ;; esac
    case "$name" in "$prefix"*) ;; *) continue ;; esac
    # shellcheck disable=SC2086
    tools/pipec compile --quiet --model examples/$flags -o "$tmp/seeds/$name.json"
  done <tests/fuzz/seed_plans.txt
fi
if [ $# -gt 0 ]; then
  cp "$@" "$tmp/seeds/"
fi
if [ "$mode" = replay ]; then
  exec "$bin" "$tmp/seeds"
fi
out=${TEST_UNDECLARED_OUTPUTS_DIR:-$tmp}
exec "$bin" -max_total_time="${PIPEC_FUZZ_SECONDS:-20}" -timeout=20 -rss_limit_mb=2560 \
  -print_final_stats=1 -dict="$dict" -artifact_prefix="$out/" "$tmp/corpus" "$tmp/seeds"
