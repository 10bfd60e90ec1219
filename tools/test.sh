#!/usr/bin/env bash
# Sets up and runs every test: bash tools/test.sh [--sanitizers]
# Prints "K skipped" and, last, "N passed, M failed" (test cases; a case that called GTEST_SKIP
# counts as skipped, not passed). GPU tests (tag requires-gpu) run only where nvidia-smi sees a
# GPU. --sanitizers (what .ci/run passes) also runs the sanitizer selections below, under
# ASan + UBSan and under TSan (docs/testing.md), and counts their cases too, and builds every
# target under Bazel's layering_check (--config=layering), one case. The clang-format check
# (tools/check_format.sh) is one case too, always.
set -uo pipefail
cd "$(dirname "$0")/.."
source tools/flag.sh
sanitizers=0
switch_given test.sh --sanitizers "$@" && sanitizers=1
bash tools/setup.sh || {
  echo "FAILED setup: bash tools/setup.sh failed (its output is above)"
  echo "0 skipped"
  echo "0 passed, 1 failed"
  exit 1
}
filter="--test_tag_filters=-requires-gpu"
query='tests(//...) except attr(tags, "requires-gpu", tests(//...))'
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  filter=""
  query='tests(//...)'
fi
# Under ASan + UBSan: every fuzz target (fuzzing PIPEC_FUZZ_SECONDS each from its seeds), and
# the suites that feed untrusted or mutated input to the readers (the plan scanner and the
# safetensors reader among them), the verifier and the cpu runtime. Under TSan: the threaded
# runtime, its transport and the watchdog.
asan_targets="//tests/fuzz:all //tests:untrusted_plan_test //tests:ir_test //tests:verifier_test
  //tests:gpt_kernel_test //tests:llama_ops_test //tests:torch_csv_test //tests:json_scan_test
  //tests:init_from_test"
tsan_targets="//tests:transport_test //tests:blocking_watchdog_test //tests:runtime_test"
passed=0
failed=0
skipped=0
status=0
failures="" # one line per failed case or target, printed before the totals
# count QUERY [CONFIG]: adds the cases of the targets QUERY names, as the last run of CONFIG
# left them, to passed, failed and skipped.
count() {
  local query=$1 config=${2:-} targets testlogs target dir newest n xml head tests fails errors
  local disabled skips bad name path shard lines
  # Count test cases from the JUnit XML of each target this run tested (not stale ones of targets
  # the filter skipped); a target with no XML counts as one failure.
  targets=$(bazel query "$query" 2>/dev/null)
  testlogs=$(bazel info $config bazel-testlogs 2>/dev/null)
  # A sharded target (shard_count) has one XML per shard, of this run's shard count.
  targets=$(while IFS= read -r target; do
    [ -n "$target" ] || continue
    dir="$testlogs/$(sed 's|^//||; s|:|/|' <<<"$target")"
    newest=$(ls -t "$dir/test.xml" "$dir"/shard_*_of_*/test.xml 2>/dev/null | head -1)
    case "$newest" in
    */shard_*) n=${newest##*_of_} && ls "$dir"/shard_*_of_"${n%%/*}"/test.xml ;;
    *) echo "$dir/test.xml" ;;
    esac
  done <<<"$targets")
  while IFS= read -r target; do
    [ -n "$target" ] || continue
    xml=$target
    # The target's label (and shard) for the FAILED lines.
    path=${xml#"$testlogs"/}
    path=${path%/test.xml}
    shard=""
    case "$path" in */shard_*_of_*) shard=" (${path##*/})" && path=${path%/*} ;; esac
    name="${config:+${config#--config=} }//${path%/*}:${path##*/}$shard"
    if [ ! -f "$xml" ]; then
      failed=$((failed + 1))
      failures+="FAILED $name: no results (it did not build, or it crashed before writing them)"$'\n'
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
      failures+="FAILED $name: unreadable results"$'\n'
      continue
    fi
    # GoogleTest gives skipped cases per suite only (<testsuite ... skipped="K">).
    skips=$(grep -o '<testsuite [^>]*>' "$xml" | sed -n 's/.* skipped="\([0-9]*\)".*/\1/p' |
            awk '{ s += $1 } END { print s + 0 }')
    bad=$(( ${fails:-0} + ${errors:-0} ))
    if [ "$bad" -gt 0 ]; then
      # The failed cases by name (GoogleTest's Suite.Case, pytest's module.Class.test; Bazel's
      # own XML names only the target), one line each with the start of its first message: the
      # log above has the rest. Read tag by tag (pytest writes its XML on one line).
      lines=$(awk -v t="$name" -v target="$path" 'BEGIN { RS = "<" }
        /^testcase[ \t\n]/ { c = ""; n = ""; printed = 0
          if (match($0, /[ \t\n]classname="[^"]*"/)) c = substr($0, RSTART + 12, RLENGTH - 13) "."
          if (match($0, /[ \t\n]name="[^"]*"/)) n = substr($0, RSTART + 7, RLENGTH - 8)
          if (c == "" && n == target) n = "" }
        /^(failure|error)[ \t\n\/>]/ && !printed { printed = 1; m = ""
          if (match($0, /[ \t\n]message="[^"]*"/)) m = substr($0, RSTART + 10, RLENGTH - 11)
          gsub(/&#x0A;|&#10;|&#x0D;|&#13;|&#x09;|&#9;/, " | ", m)
          gsub(/&quot;/, "\"", m); gsub(/&apos;/, "'"'"'", m)
          gsub(/&lt;/, "<", m); gsub(/&gt;/, ">", m); gsub(/&amp;/, "\\&", m)
          what = c n; sep = (what != "" && m != "") ? ": " : ""
          print "FAILED " t (what m != "" ? ": " : "") what sep substr(m, 1, 160) }' "$xml")
      if [ -n "$lines" ]; then
        failures+="$lines"$'\n'
      fi
    fi
    passed=$((passed + tests - bad - ${disabled:-0} - skips))
    failed=$((failed + bad))
    skipped=$((skipped + skips))
  done <<<"$targets"
}

bazel test //... $filter --test_output=errors || status=1
count "$query"
# Every C++ and CUDA source as clang-format 14 writes it (tools/check_format.sh): one case.
if bash tools/check_format.sh; then
  passed=$((passed + 1))
else
  status=1
  failed=$((failed + 1))
  failures+="FAILED clang-format: bash tools/check_format.sh --fix rewrites the files it names"$'\n'
fi
if [ "$sanitizers" -eq 1 ]; then
  # shellcheck disable=SC2086
  PIPEC_FUZZ_SECONDS=${PIPEC_FUZZ_SECONDS:-10} bazel test --config=asan $asan_targets \
    --test_env=PIPEC_FUZZ_SECONDS --test_output=errors || status=1
  count "tests(set($asan_targets))" --config=asan
  # shellcheck disable=SC2086
  bazel test --config=tsan $tsan_targets --test_output=errors || status=1
  count "tests(set($tsan_targets))" --config=tsan
  # Every #include of a project or library header names a target in the includer's deps. The
  # check is in the compiles: the object files only, nothing linked. The build runs sandboxed,
  # and setting up and removing each action's sandbox (a link to every header it may read) took
  # most of its time on disk: on tmpfs when /dev/shm has room (2 GiB; a container's is often 64
  # MiB), in Bazel's output base otherwise.
  sandbox_base=()
  shm_mib=$(df -Pm /dev/shm 2>/dev/null | awk 'NR == 2 { print $4 }')
  if [ -d /dev/shm ] && [ -w /dev/shm ] && [ "${shm_mib:-0}" -ge 2048 ]; then
    sandbox_base=(--sandbox_base=/dev/shm)
  fi
  if bazel build --config=layering "${sandbox_base[@]}" --output_groups=compilation_outputs \
    //... --keep_going; then
    passed=$((passed + 1))
  else
    status=1
    failed=$((failed + 1))
    failures+="FAILED layering_check: an #include without its target in deps (see above)"$'\n'
  fi
fi
if [ "$status" -ne 0 ] && [ "$failed" -eq 0 ]; then
  failed=1  # the build or a target failed before writing its results
  failures+="FAILED bazel: the build or a test target failed before writing its results"$'\n'
fi
printf '%s' "$failures"
echo "${skipped} skipped"
echo "${passed} passed, ${failed} failed"
[ "$status" -eq 0 ] && [ "$failed" -eq 0 ]
