#!/usr/bin/env bash
# The GPU check (docs/gpu.md): on a machine with an NVIDIA GPU, build the GPU binaries (or take
# them from gpu-bundle/), run every GPU test, whole plans against the CPU reference and the
# benchmarks, and write a report.
#   OUT=dir bash tools/gpu_check.sh      # report in dir/report.txt, every log in dir/logs.tgz
#   QUICK=1 ...                          # the kernel benchmark at 1/4 the tokens
# Binaries: gpu-bundle/bin when it exists (tools/gpu_bundle.sh builds it on any machine with the
# CUDA toolkit, for a GPU machine without Bazel; refused when built from other sources than this
# tree, unless ALLOW_STALE=1), else `bazel build -c opt` here. Shared libraries (cuBLAS, NCCL)
# come from the machine's loader path (/usr/local/cuda/lib64, or LD_LIBRARY_PATH).
# Each step has a time limit, and the whole run a budget (BUDGET seconds, default 480): a step
# that no longer fits is skipped and reported. Exit status: 0 when every test and check passed
# (benchmark numbers are reported, never judged), 1 otherwise, 2 when there is no GPU.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

out=$(mkdir -p "${OUT:-/tmp/gpu-check}" && cd "${OUT:-/tmp/gpu-check}" && pwd)
logs="$out/logs"
rm -rf "$logs" "$out/logs.tgz" && mkdir -p "$logs"
report="$out/report.txt"
: >"$report"
trap '(cd "$out" && tar czf logs.tgz logs && rm -rf logs) || true' EXIT
say() { echo "gpu_check: $*" | tee -a "$report"; }
indent() { sed 's/^/  /' | tee -a "$report"; }
status=0
deadline=$((SECONDS + ${BUDGET:-480}))
# fits LIMIT NAME: whether a step of LIMIT seconds still fits the budget (else it is skipped).
fits() {
  [ $((SECONDS + $1)) -le "$deadline" ] && return 0
  say "SKIPPED $2: its $1 s no longer fit the ${BUDGET:-480} s budget"
  return 1
}

if ! timeout 30 nvidia-smi -L >/dev/null 2>&1; then
  say "no GPU (nvidia-smi is missing or lists no device): nothing to check here"
  exit 2
fi
ngpu=$(timeout 30 nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
say "started $(date -u +%Y-%m-%dT%H:%M:%SZ); commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
timeout 30 nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total \
  --format=csv,noheader | sed 's/^/gpu: /' | indent

# The binaries: those tools/gpu_bundle.sh stages, from the bundle or built here.
if [ -d gpu-bundle/bin ]; then
  bin=$(pwd)/gpu-bundle/bin
  say "bundle: $(tr '\n' ';' <gpu-bundle/BUILT)"
  if ! sha256sum --check --quiet gpu-bundle/SOURCES >"$logs/stale.txt" 2>&1; then
    say "STALE BUNDLE: built from other sources than this tree (run tools/gpu_bundle.sh again):"
    head -5 "$logs/stale.txt" | indent
    [ "${ALLOW_STALE:-0}" = 1 ] || exit 1
    status=1
  fi
  LD_LIBRARY_PATH="$(pwd)/gpu-bundle/lib:$(pwd)/gpu-bundle/lib/cudart${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export LD_LIBRARY_PATH
else
  targets=$(bash tools/gpu_bundle.sh --targets)
  start=$SECONDS
  # shellcheck disable=SC2086 # target labels
  if ! bazel build -c opt --copt=-UNDEBUG $targets >"$logs/build.txt" 2>&1; then
    say "BUILD FAILED ($((SECONDS - start)) s); last lines of the build:"
    tail -20 "$logs/build.txt" | indent
    exit 1
  fi
  say "built here ($((SECONDS - start)) s)"
  bin=$(mktemp -d)
  for t in $targets; do cp "bazel-bin/$(sed 's|^//||; s|:|/|' <<<"$t")" "$bin/"; done
fi
missing=$(ldd "$bin"/* 2>/dev/null | grep 'not found' | sort -u)
if [ -n "$missing" ]; then
  say "missing shared libraries (install the CUDA toolkit's, or set LD_LIBRARY_PATH):"
  echo "$missing" | indent
  exit 1
fi

# check LIMIT NAME LOG CMD...: runs CMD with a time limit, its output in LOG; says ok (with
# GoogleTest's PASSED line and what skipped) or FAILED (with the failed tests).
check() {
  local limit=$1 name=$2 log=$3 start=$SECONDS rc=0
  shift 3
  fits "$limit" "$name" || { status=1; return 1; }
  echo "+ $*" >"$log"
  timeout -k 10 "$limit" "$@" >>"$log" 2>&1 || rc=$?
  if [ "$rc" = 0 ]; then
    say "$name ok ($((SECONDS - start)) s)$(grep -m1 -o '\[  PASSED  \].*' "$log" | sed 's/^/: /')"
    local skipped
    skipped=$(grep -c '^\[  SKIPPED \] [A-Za-z]' "$log")
    [ "$skipped" = 0 ] || say "  $skipped skipped: $(grep -m1 -A1 ': Skipped$' "$log" | tail -1)"
    return 0
  fi
  status=1
  say "$name FAILED ($((SECONDS - start)) s$([ "$rc" = 124 ] && echo ', timed out')):"
  { grep -E '^\[  FAILED  \] [A-Za-z]' "$log" | sort -u | head -20
    grep -E -A3 ': Failure$' "$log" | head -16
    tail -3 "$log"; } | indent
  return 1
}

# 1. Every GPU test (tag requires-gpu; the sm_90a kernels' cases skip on other GPUs, saying so).
for spec in wgmma_layout_test:30 cuda_kernel_test:60 attention_backward_test:120 \
  cuda_runtime_test:120 nccl_runtime_test:60; do
  check "${spec##*:}" "${spec%%:*}" "$logs/${spec%%:*}.txt" "$bin/${spec%%:*}"
done

# 2. Whole plans against the single-rank CPU reference (piperun exits 1 over its tolerance): pp 4
# in fp32 and bf16 on the local transport, pp 2 x tp 2 x dp 2 in bf16 (whose tp and dp copies
# must be equal bit for bit), and the nccl mode with 2 and 4 processes.
plan() { # NAME pipec-flags...
  local name=$1
  shift
  "$bin/pipec" compile --model examples/tiny-gpt.json "$@" -o "$logs/$name.json" --quiet
}
plan pp4 --schedule 1f1b --pp 4 --microbatches 8
plan tp2dp2 --schedule zb-h1 --pp 2 --tp 2 --dp 2 --microbatches 4
for dtype in fp32 bf16; do
  check 60 "piperun pp4 --dtype $dtype" "$logs/pp4-$dtype.txt" "$bin/piperun" "$logs/pp4.json" \
    --backend cuda --dtype "$dtype" --steps 3 --check-reference
  grep -E '^(step 2|reference|max_abs|max_tensor)' "$logs/pp4-$dtype.txt" | cut -c1-100 | indent
done
check 60 "piperun pp2 tp2 dp2 --dtype bf16" "$logs/tp2dp2.txt" "$bin/piperun" \
  "$logs/tp2dp2.json" --backend cuda --dtype bf16 --steps 3 --check-reference
grep -o '[td]p_copies=[^ ]*' "$logs/tp2dp2.txt" | indent

# The nccl mode: N processes of one plan, started as torchrun starts them (RANK, WORLD_SIZE,
# LOCAL_RANK, NCCL_COMM_ID). With fewer GPUs than processes, all run on GPU 0, each a node of
# its own to NCCL (NCCL_HOSTID), over loopback sockets (docs/gpu.md).
nccl() { # NAME N pipec-flags...
  local name=$1 n=$2 port=$((29500 + RANDOM % 2000)) start=$SECONDS pids=() failed=0 r
  shift 2
  fits 90 "piperun --backend nccl $name" || { status=1; return; }
  plan "nccl-$name" "$@"
  for ((r = 0; r < n; r++)); do
    local -a vars=("RANK=$r" "WORLD_SIZE=$n" "LOCAL_RANK=$r" "NCCL_COMM_ID=127.0.0.1:$port")
    [ "$n" -le "$ngpu" ] || vars+=(CUDA_VISIBLE_DEVICES=0 NCCL_HOSTID="check-$r"
      NCCL_SOCKET_IFNAME=lo NCCL_NET=Socket NCCL_IB_DISABLE=1 NCCL_NVLS_ENABLE=0
      NCCL_MNNVL_ENABLE=0)
    env "${vars[@]}" timeout -k 10 80 "$bin/piperun" "$logs/nccl-$name.json" --backend nccl \
      --steps 3 --timeout 30 --check-reference >"$logs/nccl-$name.rank$r.txt" 2>&1 &
    pids+=($!)
  done
  for r in "${pids[@]}"; do wait "$r" || failed=1; done
  local where="$n processes, one per GPU"
  [ "$n" -le "$ngpu" ] || where="$n processes on GPU 0"
  if [ "$failed" = 0 ]; then
    say "piperun --backend nccl $name ($where) ok ($((SECONDS - start)) s):"
    grep -E '^max_abs' "$logs/nccl-$name.rank0.txt" | cut -c1-100 | indent
    return
  fi
  status=1
  say "piperun --backend nccl $name ($where) FAILED ($((SECONDS - start)) s); each rank's last lines:"
  for ((r = 0; r < n; r++)); do
    tail -3 "$logs/nccl-$name.rank$r.txt" | sed "s/^/rank $r: /" | indent
  done
}
nccl pp2 2 --schedule 1f1b --pp 2 --microbatches 4
nccl tp2 2 --schedule 1f1b --pp 1 --tp 2 --microbatches 2
nccl pp2-tp2 4 --schedule 1f1b --pp 2 --tp 2 --microbatches 4

# 3. Benchmarks: reported, never judged.
bench() { # LIMIT NAME CMD...
  local limit=$1 name=$2
  shift 2
  fits "$limit" "$name" || return 0
  if timeout -k 10 "$limit" "$@" >"$logs/$name.txt" 2>&1; then
    say "$name:"
  else
    say "$name FAILED or timed out (not counted against the tests):"
  fi
  indent <"$logs/$name.txt"
}
bench 90 kernel-benchmark "$bin/cuda_kernel_bench" ${QUICK:+--quick}
bench 60 attention-backward-benchmark "$bin/attention_backward_bench"
bench 45 overhead-benchmark-pp2 "$bin/cuda_overhead_bench" --pp 2 --microbatches 1024
bench 45 overhead-benchmark-pp4 "$bin/cuda_overhead_bench" --pp 4 --microbatches 1024
bench 90 step-benchmark-1f1b "$bin/cuda_step_bench" --pp 2 --microbatches 8
bench 90 step-benchmark-seq1f1b "$bin/cuda_step_bench" --schedule seq1f1b --pp 4 \
  --microbatches 8 --seq 4096 --seq-splits 4

say "finished ($SECONDS s); report $report, logs in $out/logs.tgz"
exit "$status"
