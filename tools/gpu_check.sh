#!/usr/bin/env bash
# The one prepared check for a machine with a GPU (DESIGN §9): builds the CUDA targets, runs the
# requires-gpu tests and the kernel benchmark, and writes a short text report to
# ${OUT:-/tmp/gpu-check}/report.txt (plus the full logs beside it). Meant to finish in under
# 8 minutes on an H200 (time limits: build 240 s, tests 150 s, benchmark 90 s); prints each
# command before it runs it.
#   bash tools/gpu_check.sh            # everything
#   QUICK=1 bash tools/gpu_check.sh    # the benchmark at 1/4 the tokens
# Exit status: 0 when the build and every test passed (benchmark numbers are reported, never
# judged); 1 otherwise; 2 when there is no GPU or no CUDA toolkit (nothing was run).
set -euo pipefail
cd "$(dirname "$0")/.."

out="${OUT:-/tmp/gpu-check}"
mkdir -p "$out"
report="$out/report.txt"
: >"$report"
# Bazel's own output base, so that a concurrent build elsewhere on the machine is not disturbed.
bazel_cmd=(bazel "--output_base=${PIPEC_GPU_OUTPUT_BASE:-$HOME/.cache/bazel-gpu-check}")
build_flags=(-c opt --symlink_prefix=/tmp/gpu-check-)

say() { echo "gpu_check: $*" | tee -a "$report"; }
run() {
  echo "+ $*" >&2
  "$@"
}

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  say "no GPU: nvidia-smi is missing or lists no device; nothing to check here"
  exit 2
fi
if [ ! -x /usr/local/cuda/bin/nvcc ]; then
  say "no CUDA toolkit: /usr/local/cuda/bin/nvcc is missing; the CUDA targets are not declared"
  exit 2
fi

if ! run bash tools/setup.sh >"$out/setup.log" 2>&1; then
  say "setup failed (tools/setup.sh installs bazel and the libraries); see $out/setup.log"
  exit 2
fi
say "started $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
say "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (dirty)')"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader \
  | sed 's/^/gpu_check: gpu: /' | tee -a "$report"
say "nvcc: $(/usr/local/cuda/bin/nvcc --version | grep -o 'release [0-9.]*')"

status=0
start=$SECONDS
if ! run timeout 240 "${bazel_cmd[@]}" build "${build_flags[@]}" //tests:cuda_kernel_test \
    //tests:cuda_check_test //tests:cuda_runtime_test //bench:cuda_kernel_bench >"$out/build.log" 2>&1; then
  say "BUILD FAILED after $((SECONDS - start)) s; last lines of $out/build.log:"
  tail -30 "$out/build.log" | tee -a "$report"
  exit 1
fi
say "build ok ($((SECONDS - start)) s)"

start=$SECONDS
if run timeout 150 "${bazel_cmd[@]}" test "${build_flags[@]}" //tests:cuda_kernel_test \
    //tests:cuda_check_test //tests:cuda_runtime_test --test_output=all >"$out/test.log" 2>&1; then
  say "tests ok ($((SECONDS - start)) s)"
else
  status=1
  say "TESTS FAILED ($((SECONDS - start)) s); failures:"
  grep -E '^\[  FAILED  \]|Failure|error:' "$out/test.log" | sort -u | head -40 | tee -a "$report"
fi
grep -E '^\[==========\].*ran|^\[  PASSED  \]' "$out/test.log" | sed 's/^/gpu_check: /' \
  | tee -a "$report" || true

bench_args=()
[ "${QUICK:-0}" = 1 ] && bench_args=(--quick)
start=$SECONDS
if run timeout 90 /tmp/gpu-check-bin/bench/cuda_kernel_bench "${bench_args[@]}" \
    >"$out/bench.txt" 2>&1; then
  say "benchmark ok ($((SECONDS - start)) s):"
else
  say "BENCHMARK FAILED or timed out ($((SECONDS - start)) s) (not counted against the tests):"
fi
sed 's/^/  /' "$out/bench.txt" | tee -a "$report"

say "finished; report $report, logs in $out"
exit "$status"
