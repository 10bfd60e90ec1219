#!/usr/bin/env bash
# Sets up and runs every test; ends with "N passed, M failed, K skipped" (test cases; a case
# that called GTEST_SKIP counts as skipped, not passed).
# GPU tests (tag requires-gpu) run only where nvidia-smi sees a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh || { echo "0 passed, 1 failed, 0 skipped"; exit 1; }
filter="--test_tag_filters=-requires-gpu"
query='tests(//...) except attr(tags, "requires-gpu", tests(//...))'
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  filter=""
  query='tests(//...)'
fi
bazel test //... $filter --test_output=errors
status=$?
passed=0
failed=0
skipped=0
# Count test cases from the JUnit XML of each target this run tested (not stale ones of targets
# the filter skipped); a target with no XML counts as one failure.
targets=$(bazel query "$query" 2>/dev/null)
# A sharded target (shard_count) has one XML per shard, of this run's shard count.
targets=$(while IFS= read -r target; do
  [ -n "$target" ] || continue
  dir="bazel-testlogs/$(sed 's|^//||; s|:|/|' <<<"$target")"
  newest=$(ls -t "$dir/test.xml" "$dir"/shard_*_of_*/test.xml 2>/dev/null | head -1)
  case "$newest" in
  */shard_*) n=${newest##*_of_} && ls "$dir"/shard_*_of_"${n%%/*}"/test.xml ;;
  *) echo "$dir/test.xml" ;;
  esac
done <<<"$targets")
while IFS= read -r target; do
  [ -n "$target" ] || continue
  xml=$target
  if [ ! -f "$xml" ]; then
    failed=$((failed + 1))
    continue
  fi
  head=$(grep -m1 -o '<testsuites[^>]*>' "$xml" || true)
  if ! grep -q ' tests="' <<<"$head"; then
    # Not GoogleTest: Bazel wrote this XML itself, one suite with one case (the binary's exit).
    head=$(grep -m1 -o '<testsuite [^>]*>' "$xml" || true)
  fi
  tests=$(sed -n 's/.* tests="\([0-9]*\)".*/\1/p' <<<"$head")
  fails=$(sed -n 's/.* failures="\([0-9]*\)".*/\1/p' <<<"$head")
  errors=$(sed -n 's/.* errors="\([0-9]*\)".*/\1/p' <<<"$head")
  disabled=$(sed -n 's/.* disabled="\([0-9]*\)".*/\1/p' <<<"$head")
  if [ -z "$tests" ]; then
    failed=$((failed + 1))
    continue
  fi
  # GoogleTest gives skipped cases per suite only (<testsuite ... skipped="K">).
  skips=$(grep -o '<testsuite [^>]*>' "$xml" | sed -n 's/.* skipped="\([0-9]*\)".*/\1/p' |
          awk '{ s += $1 } END { print s + 0 }')
  bad=$(( ${fails:-0} + ${errors:-0} ))
  passed=$((passed + tests - bad - ${disabled:-0} - skips))
  failed=$((failed + bad))
  skipped=$((skipped + skips))
done <<<"$targets"
if [ "$status" -ne 0 ] && [ "$failed" -eq 0 ]; then
  failed=1  # the build or a target failed before writing its results
fi
echo "${passed} passed, ${failed} failed, ${skipped} skipped"
[ "$status" -eq 0 ] && [ "$failed" -eq 0 ]
