#!/usr/bin/env bash
# The one prepared check for a machine with a GPU (DESIGN §9): builds the CUDA targets, runs the
# requires-gpu tests, the nccl mode with several processes where nvidia-smi lists two GPUs or
# more (rank 0's losses against --backend cuda's), and the kernel benchmark; writes a short
# text report to
# ${OUT:-/tmp/gpu-check}/report.txt (plus the full logs beside it). Meant to finish in under
# 8 minutes on an H200 (limits: build 240 s, tests 150 s, kernel benchmark 90 s, runtime
# overhead 2 x 60 s, the pp4 reference check 60 s); prints each
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
    //tests:cuda_check_test //tests:cuda_runtime_test //tests:nccl_runtime_test \
    //bench:cuda_kernel_bench //bench:cuda_overhead_bench //tools:pipec //tools:piperun \
    >"$out/build.log" 2>&1; then
  say "BUILD FAILED after $((SECONDS - start)) s; last lines of $out/build.log:"
  tail -30 "$out/build.log" | tee -a "$report"
  exit 1
fi
say "build ok ($((SECONDS - start)) s)"

start=$SECONDS
if run timeout 150 "${bazel_cmd[@]}" test "${build_flags[@]}" //tests:cuda_kernel_test \
    //tests:cuda_check_test //tests:cuda_runtime_test //tests:nccl_runtime_test \
    --test_output=all >"$out/test.log" 2>&1; then
  say "tests ok ($((SECONDS - start)) s)"
else
  status=1
  say "TESTS FAILED ($((SECONDS - start)) s); failures:"
  grep -E '^\[  FAILED  \]|Failure|error:' "$out/test.log" | sort -u | head -40 | tee -a "$report"
fi
grep -E '^\[==========\].*ran|^\[  PASSED  \]' "$out/test.log" | sed 's/^/gpu_check: /' \
  | tee -a "$report" || true

# The nccl mode with one process per GPU (runtime/cuda/NcclRun.h), launched here as torchrun
# would (RANK, WORLD_SIZE, LOCAL_RANK, NCCL_COMM_ID); rank 0's losses must equal those of
# --backend cuda (every rank on one GPU) within 1e-4. 60 s per configuration at most.
bin=/tmp/gpu-check-bin/tools
nccl_case() { # name nproc pipec-flags...
  local name=$1 n=$2
  shift 2
  local plan="$out/nccl-$name.json" port=$((29500 + RANDOM % 2000)) pids=() rc=0
  if ! "$bin/pipec" compile --model "${MODEL:-examples/tiny-gpt.json}" "$@" -o "$plan" --quiet \
      >"$out/nccl-$name.compile.log" 2>&1 ||
    ! timeout 60 "$bin/piperun" "$plan" --backend cuda --steps 3 >"$out/nccl-$name.cuda.txt" 2>&1; then
    say "nccl $name: FAILED before launch (pipec or --backend cuda); see $out/nccl-$name.*"
    return 1
  fi
  for ((r = 0; r < n; r++)); do
    echo "+ RANK=$r WORLD_SIZE=$n LOCAL_RANK=$r NCCL_COMM_ID=127.0.0.1:$port piperun $plan --backend nccl --steps 3" >&2
    RANK=$r WORLD_SIZE=$n LOCAL_RANK=$r NCCL_COMM_ID=127.0.0.1:$port timeout 60 "$bin/piperun" \
      "$plan" --backend nccl --steps 3 --timeout 30 >"$out/nccl-$name.rank$r.txt" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  if [ "$rc" != 0 ]; then
    say "nccl $name ($n processes): FAILED; first lines of each rank's output:"
    for ((r = 0; r < n; r++)); do head -5 "$out/nccl-$name.rank$r.txt" | sed "s/^/  rank $r: /" | tee -a "$report"; done
    return 1
  fi
  if paste <(grep '^step' "$out/nccl-$name.rank0.txt") <(grep '^step' "$out/nccl-$name.cuda.txt") |
    awk '{ d = $4 - $8; if (d < 0) d = -d; if (d > 1e-4 || $2 != $6) bad = 1; n++ }
         END { exit (bad || n != 3) }'; then
    say "nccl $name ($n processes): ok, losses $(grep '^step' "$out/nccl-$name.rank0.txt" | awk '{printf "%s ", $4}')(cuda: $(grep '^step' "$out/nccl-$name.cuda.txt" | awk '{printf "%s ", $4}'))"
  else
    say "nccl $name ($n processes): LOSSES DIFFER from --backend cuda; see $out/nccl-$name.*"
    return 1
  fi
}
ngpu=$(nvidia-smi -L | wc -l)
if [ "$ngpu" -ge 2 ]; then
  start=$SECONDS
  nccl_case pp2-1f1b 2 --schedule 1f1b --pp 2 --microbatches 4 || status=1
  nccl_case pp2-zbv 2 --schedule zb-v --pp 2 --vpp 2 --microbatches 4 || status=1
  nccl_case dp2 2 --schedule 1f1b --pp 1 --dp 2 --microbatches 2 || status=1
  nccl_case tp2 2 --schedule 1f1b --pp 1 --tp 2 --microbatches 2 || status=1
  # Tied embeddings on two processes: the `embedding` communicator.
  sed 's/"dtype": "fp32"/"dtype": "fp32", "tie_embeddings": true/' examples/tiny-gpt.json \
    >"$out/tiny-gpt-tied.json"
  MODEL="$out/tiny-gpt-tied.json" nccl_case pp2-tied 2 --schedule 1f1b --pp 2 --microbatches 4 ||
    status=1
  if [ "$ngpu" -ge 4 ]; then
    nccl_case pp2-tp2 4 --schedule 1f1b --pp 2 --tp 2 --microbatches 4 || status=1
    nccl_case pp2-dp2 4 --schedule zb-h1 --pp 2 --dp 2 --microbatches 4 || status=1
    nccl_case pp4 4 --schedule 1f1b --pp 4 --microbatches 4 || status=1
  fi
  say "nccl multi-process checks done ($((SECONDS - start)) s)"
else
  say "nccl multi-process checks skipped: nvidia-smi lists $ngpu GPU (they need 2 or more)"
fi

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

# The runtime's own host cost per instruction (target <= 10 us): interpreter + local transport
# with empty compute.
start=$SECONDS
for pp in 2 4; do
  if run timeout 60 /tmp/gpu-check-bin/bench/cuda_overhead_bench --pp "$pp" --microbatches 1024 \
      >>"$out/overhead.txt" 2>&1; then :; else
    say "OVERHEAD BENCHMARK FAILED (pp $pp); see $out/overhead.txt"
  fi
done
say "runtime overhead ($((SECONDS - start)) s):"
sed 's/^/  /' "$out/overhead.txt" | tee -a "$report"

# The issue's end-to-end check: a pp=4 plan on the local transport against the single-rank
# CPU reference, with the activation arenas it reserved.
start=$SECONDS
if "$bin/pipec" compile --model examples/tiny-gpt.json --schedule 1f1b --pp 4 --microbatches 8 \
    -o "$out/pp4.json" --quiet >"$out/pp4.txt" 2>&1 &&
  run timeout 60 "$bin/piperun" "$out/pp4.json" --backend cuda --steps 3 --check-reference \
    >>"$out/pp4.txt" 2>&1; then
  say "pp4 cuda --check-reference ok ($((SECONDS - start)) s):"
else
  status=1
  say "pp4 cuda --check-reference FAILED ($((SECONDS - start)) s):"
fi
sed 's/^/  /' "$out/pp4.txt" | tee -a "$report"

say "finished; report $report, logs in $out"
exit "$status"
