#!/usr/bin/env bash
# The one prepared check for a machine with a GPU (DESIGN §9), in this order: the requires-gpu
# test binaries (the attention tests again without wgmma if they fail; the runtime tests again
# with the Hopper attention backward switched on), pp=4 --check-reference runs on the local
# transport (fp32 and bf16), a pp=2 tp=2 dp=2 bf16 one (tp and dp copies bit for bit), then the
# runtime-overhead and kernel benchmarks, the nccl mode with 2 and 4 processes (each with
# --check-reference, rank 0's losses also against --backend cuda's) and its overhead benchmark
# with 4 processes, and last an ncu profile of the attention kernels and the training-step
# benchmark. The nccl mode runs one process per GPU where
# the machine has enough GPUs, else all of them on GPU 0, each a node of its own to NCCL
# (NCCL_HOSTID; "one-GPU mode", below). Writes a short report to
# ${OUT:-/tmp/gpu-check}/report.txt, and the full logs and plans into logs.tgz beside it.
# It runs the binaries of gpu-bundle/ (tools/gpu_bundle.sh builds them on any machine with the
# CUDA toolkit; carry that folder to a GPU machine that has no Bazel), and refuses a bundle built
# from other sources than the tree it runs in (ALLOW_STALE=1 runs it anyway). Without gpu-bundle/
# it first runs tools/setup.sh and tools/gpu_bundle.sh here (needs apt and nvcc).
# Time: each step has a limit (tests 30/60/120/60 s, the attention tests without wgmma 30 s, the
# runtime tests with the Hopper attention backward 60 s and with its dQ atomics 2 x 30 s, pp4
# 2 x 60 s, tp2dp2 60 s, overhead 5 x 45 s, kernel benchmark 90 s, each of the 9 nccl cases
# 2 x 60 s, the first one-GPU case's retry 2 x 60 s, the nccl overhead benchmark 55 s, attention
# profile 90 s, step benchmark 4 x 90 s; every command is killed 10 s after its limit if TERM
# did not end it) and the whole run a budget (BUDGET seconds from the start, default 470, so
# that the checks end within 8 minutes; setup and the library search have no limit of their
# own): a step that no longer fits is skipped and reported. The nccl cases come before the
# profile and the step benchmark so that a hang there cannot cost them their turn; a hang of
# the Hopper attention backward (its wgmma kernels have never run on a GPU) skips the later runs
# that switch it on, and a timed-out test names the test it hung in.
# Run it under a limit a little below the machine's (timeout -s TERM 525 bash tools/gpu_check.sh
# for a 540 s command): TERM still packs logs.tgz, a KILL would not.
#   bash tools/gpu_check.sh            # everything
#   QUICK=1 bash tools/gpu_check.sh    # the kernel benchmark at 1/4 the tokens
# Exit status: 0 when every test ran and passed (benchmark numbers are reported, never judged);
# 1 otherwise; 2 when there is no GPU, or no bundle and no way to build one (nothing was run).
set -euo pipefail
cd "$(dirname "$0")/.."

out="${OUT:-/tmp/gpu-check}"
mkdir -p "$out"
out=$(cd "$out" && pwd)
report="$out/report.txt"
: >"$report"

say() { echo "gpu_check: $*" | tee -a "$report"; }
# On exit, every log and plan goes into one logs.tgz beside report.txt: a device machine that
# returns few files (8 at most, here) still returns both.
pack_logs() {
  local files
  files=$(cd "$out" && ls -A | grep -v -x -e report.txt -e logs.tgz || true)
  [ -n "$files" ] || return 0
  # shellcheck disable=SC2086 # file names from ls, without spaces
  (cd "$out" && tar czf logs.tgz $files && rm -rf $files) || true
}
trap pack_logs EXIT
deadline=$((SECONDS + ${BUDGET:-470}))
status=0
# fits SECONDS NAME [bench]: whether a step with that limit still fits the budget (else it is
# skipped; a skipped test counts as a failure, a skipped benchmark does not).
fits() {
  if [ $((SECONDS + $1)) -le "$deadline" ]; then return 0; fi
  say "SKIPPED $2: its ${1} s no longer fit the ${BUDGET:-470} s budget"
  [ "${3:-}" = bench ] || status=1
  return 1
}
run() {
  echo "+ $*" >&2
  "$@"
}

if ! command -v nvidia-smi >/dev/null 2>&1 || ! timeout -k 5 30 nvidia-smi -L >/dev/null 2>&1; then
  say "no GPU: nvidia-smi is missing or lists no device; nothing to check here"
  exit 2
fi
# Whole GPUs, not MIG slices; counted once, here, while the GPU is fresh (a later nvidia-smi
# after a hung kernel may fail, which must not end the script under set -e).
ngpu=$(timeout -k 5 30 nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l ||
  true)
[ -n "$ngpu" ] || ngpu=0
say "started $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
say "glibc $(ldd --version 2>&1 | head -1 | grep -o '[0-9.]*$')"
{ timeout -k 5 30 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm \
  --format=csv,noheader || true; } | sed 's/^/gpu_check: gpu: /' | tee -a "$report"

if [ ! -x gpu-bundle/bin/piperun ]; then
  if [ ! -x /usr/local/cuda/bin/nvcc ]; then
    say "no gpu-bundle/ and no /usr/local/cuda/bin/nvcc to build one: run tools/gpu_bundle.sh on a machine with the CUDA toolkit and carry gpu-bundle/ here"
    exit 2
  fi
  if ! run bash tools/setup.sh >"$out/setup.log" 2>&1; then
    say "no gpu-bundle/, and setup failed (tools/setup.sh installs bazel and the libraries); see $out/setup.log"
    exit 2
  fi
  start=$SECONDS
  if ! run timeout -k 10 400 bash tools/gpu_bundle.sh >"$out/build.log" 2>&1; then
    say "BUILD FAILED after $((SECONDS - start)) s; last lines of $out/build.log:"
    tail -30 "$out/build.log" | tee -a "$report"
    exit 1
  fi
  say "built gpu-bundle/ here ($((SECONDS - start)) s)"
fi
say "bundle: $(tr '\n' ';' <gpu-bundle/BUILT)"
if [ -f gpu-bundle/SOURCES ]; then
  stale=$(sha256sum --check --quiet gpu-bundle/SOURCES 2>&1 | head -5 || true)
  if [ -n "$stale" ]; then
    say "STALE BUNDLE: built from other sources than this tree's (run tools/gpu_bundle.sh again):"
    echo "$stale" | sed 's/^/  /' | tee -a "$report"
    if [ "${ALLOW_STALE:-0}" != 1 ]; then exit 1; fi
    status=1
  fi
fi
bin=$(pwd)/gpu-bundle/bin

# The shared libraries the binaries need: cuBLAS(Lt), NCCL and the CUDA runtime wherever this
# machine has them (the loader's cache, the CUDA toolkit, Python's nvidia-* wheels), then the
# bundle's libfmt, and its CUDA runtime only where the machine has none.
roots=(/usr/local/cuda /usr/local /opt /usr/lib /usr/lib64 /root /home /workspace)
for py in python3 python; do
  if command -v "$py" >/dev/null 2>&1; then
    while IFS= read -r d; do [ -n "$d" ] && roots+=("$d"); done < <("$py" -c \
      'import nvidia; print("\n".join(nvidia.__path__))' 2>/dev/null || true)
  fi
done
find_lib() { # prints the directory of $1, or nothing when the loader's cache has it
  # (grep without -q reads all of ldconfig's output: -q would exit at the first match, and
  # ldconfig's SIGPIPE then fail the pipeline under pipefail.)
  if ldconfig -p 2>/dev/null | grep -F -- "$1" >/dev/null; then return 0; fi
  local found r
  for r in "${roots[@]}"; do # in order: the toolkit's copy before a Python wheel's
    found=$(timeout -k 5 30 find "$r" -name "$1" -print -quit 2>/dev/null || true)
    [ -z "$found" ] || break
  done
  if [ -n "$found" ]; then dirname "$found"; else echo "MISSING"; fi
}
libpath=""
for lib in libcublasLt.so.13 libcublas.so.13 libnccl.so.2 libcudart.so.13; do
  dir=$(find_lib "$lib")
  if [ "$dir" = MISSING ]; then
    if [ "$lib" = libcudart.so.13 ]; then dir=$(pwd)/gpu-bundle/lib/cudart; else continue; fi
  fi
  [ -n "$dir" ] && libpath="$libpath${libpath:+:}$dir"
done
libpath="$libpath${libpath:+:}$(pwd)/gpu-bundle/lib"
export LD_LIBRARY_PATH="$libpath${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
missing=$(ldd -r "$bin/piperun" "$bin/cuda_runtime_test" "$bin/cuda_kernel_test" 2>&1 |
  grep -E 'not found|undefined symbol' | sort -u || true)
if [ -n "$missing" ]; then
  say "missing shared libraries or symbols (LD_LIBRARY_PATH=$LD_LIBRARY_PATH):"
  echo "$missing" | head -20 | sed 's/^/  /' | tee -a "$report"
  exit 1
fi
say "libraries: $(ldd "$bin/piperun" | awk '/cublasLt|nccl|cudart/ { print $1 " -> " $3 }' | tr '\n' ' ')"

# timed_out RC LOG [VARS]: sets `hung` to " TIMED OUT in <the last test started>" when RC is
# timeout's, else to nothing. A hung Hopper attention backward (its wgmma kernels have never run
# on a GPU) also sets wgmma_backward_hung, so that the later runs with it switched on are
# skipped, not waited for. (Called directly, not in $(...), so that both variables stay set.)
wgmma_backward_hung=0
timed_out() {
  hung=""
  case "$1" in
  124 | 137) ;;
  *) return 0 ;;
  esac
  local last
  last=$(grep -E '^\[ RUN      \] ' "$2" 2>/dev/null | tail -1 | sed 's/^\[ RUN      \] //' || true)
  hung=" TIMED OUT in ${last:-its start}"
  case "$last ${3:-}" in
  *Hopper*Backward* | *Wgmma*Backward* | *WGMMA_BACKWARD*) wgmma_backward_hung=1 ;;
  esac
  return 0
}
# passed LOG: gtest's PASSED line, and its SKIPPED one (a Hopper case that skipped did not run).
passed() {
  grep -E '^\[  (PASSED  |SKIPPED )\]' "$1" | grep -v '^\[  SKIPPED \] [A-Za-z]' | tr '\n' ' ' || true
}
for spec in wgmma_layout_test:30 cuda_kernel_test:60 cuda_runtime_test:120 nccl_runtime_test:60; do
  t=${spec%%:*} limit=${spec##*:}
  fits "$limit" "$t" || continue
  start=$SECONDS
  args=()
  # (Its one Hopper case switches the Hopper backward on: after a hang there, it would hang too.)
  if [ "$t" = cuda_runtime_test ] && [ "$wgmma_backward_hung" = 1 ]; then
    args=(--gtest_filter=-*Hopper*)
    say "cuda_runtime_test without its *Hopper* case: the Hopper attention backward hung above"
    status=1
  fi
  if run timeout -k 10 "$limit" "$bin/$t" ${args[@]+"${args[@]}"} >"$out/$t.log" 2>&1; then
    say "$t ok ($((SECONDS - start)) s): $(passed "$out/$t.log")"
  else
    rc=$?
    status=1
    timed_out "$rc" "$out/$t.log"
    say "$t FAILED ($((SECONDS - start)) s)$hung; failed tests, then the first assertions:"
    grep -E '^\[  FAILED  \] [A-Za-z]' "$out/$t.log" | sed 's/, where GetParam.*//; s/ ([0-9]* ms)$//' \
      | sort -u | head -30 | sed 's/^/  /' | tee -a "$report" || true
    grep -E -A3 ': Failure$' "$out/$t.log" | head -24 | sed 's/^/  /' | tee -a "$report" || true
    tail -3 "$out/$t.log" | sed 's/^/  last: /' | tee -a "$report"
  fi
done

# When the kernel test fails on attention: does it pass with the Hopper (wgmma) forward off?
if grep -q '^\[  FAILED  \] .*Attention' "$out/cuda_kernel_test.log" 2>/dev/null &&
  fits 30 "attention tests without wgmma" bench; then
  if PIPEC_ATTENTION_WGMMA=0 timeout -k 10 30 "$bin/cuda_kernel_test" --gtest_filter='*Attention*' \
    >"$out/attention-no-wgmma.log" 2>&1; then
    say "attention tests with PIPEC_ATTENTION_WGMMA=0: passed (the wgmma forward fails them)"
  else
    say "attention tests with PIPEC_ATTENTION_WGMMA=0: failed too"
  fi
fi

# rerun_runtime LIMIT LABEL LOG FILTER VAR=VALUE...: cuda_runtime_test once more, the cases
# matching FILTER, with those variables set; its log in $out/LOG.
rerun_runtime() {
  local limit=$1 label="cuda_runtime_test $2" log="$out/$3" filter=$4
  shift 4
  if [ "$wgmma_backward_hung" = 1 ]; then
    say "SKIPPED $label: the Hopper attention backward hung above"
    status=1
    return 0
  fi
  fits "$limit" "$label" || return 0
  start=$SECONDS
  if run env "$@" timeout -k 10 "$limit" "$bin/cuda_runtime_test" --gtest_filter="$filter" >"$log" 2>&1; then
    say "$label ok ($((SECONDS - start)) s): $(passed "$log")"
  else
    local rc=$?
    status=1
    timed_out "$rc" "$log" "$*"
    say "$label FAILED ($((SECONDS - start)) s)$hung:"
    grep -E '^\[  FAILED  \] [A-Za-z]' "$log" | head -10 | sed 's/^/  /' | tee -a "$report" || true
  fi
}
# The Hopper attention backward is off by default until it has passed here: the runtime tests
# once more with it switched on (the kernel test already checks it against the CPU reference);
# then with its dQ atomics (off by default), fp32 and fixed-point: only the runtime's
# Hopper-attention case (fp32 atomics make dQ's last bits depend on the blocks' order).
rerun_runtime 60 "with PIPEC_ATTENTION_WGMMA_BACKWARD=1" cuda_runtime_test.wgmma-backward.log '*' \
  PIPEC_ATTENTION_WGMMA_BACKWARD=1
for dq_mode in float fixed; do
  rerun_runtime 30 "*Hopper* with PIPEC_ATTENTION_DQ_ATOMICS=$dq_mode" \
    "cuda_runtime_test.dq-$dq_mode.log" '*Hopper*' PIPEC_ATTENTION_WGMMA_BACKWARD=1 \
    "PIPEC_ATTENTION_DQ_ATOMICS=$dq_mode"
done

# The issue's end-to-end check: a pp=4 plan on the local transport against the single-rank
# CPU reference, with the activation arenas it reserved; in fp32 (tolerance 1e-4 of the gradient
# scale) and in bf16 (mixed precision, tolerance 5e-2).
if "$bin/pipec" compile --model examples/tiny-gpt.json --schedule 1f1b --pp 4 --microbatches 8 \
    -o "$out/pp4.json" --quiet >"$out/pp4.compile.txt" 2>&1; then
  for dtype in fp32 bf16; do
    start=$SECONDS
    fits 60 "pp4 cuda $dtype --check-reference" || continue
    if run timeout -k 10 60 "$bin/piperun" "$out/pp4.json" --backend cuda --dtype "$dtype" --steps 3 \
        --check-reference >"$out/pp4-$dtype.txt" 2>&1; then
      say "pp4 cuda --dtype $dtype --check-reference ok ($((SECONDS - start)) s):"
    else
      status=1
      say "pp4 cuda --dtype $dtype --check-reference FAILED ($((SECONDS - start)) s):"
    fi
    sed 's/^/  /' "$out/pp4-$dtype.txt" | tee -a "$report"
  done
else
  status=1
  say "pp4: pipec compile FAILED:"
  sed 's/^/  /' "$out/pp4.compile.txt" | tee -a "$report"
fi

# Bit-identical copies on a GPU: pp = 2, tp = 2, dp = 2 in bf16 with --check-reference, which
# exits 1 unless the tp ranks' copies of the tensors they hold whole (cuBLASLt and the
# deterministic column sums and embedding backward on every rank) and the dp replicas' weights
# are equal to the last bit (tp_copies=, dp_copies=).
if "$bin/pipec" compile --model examples/tiny-gpt.json --schedule zb-h1 --pp 2 --tp 2 --dp 2 \
    --microbatches 4 -o "$out/tp2dp2.json" --quiet >"$out/tp2dp2.compile.txt" 2>&1; then
  start=$SECONDS
  if fits 60 "tp2dp2 cuda bf16 --check-reference"; then
    if run timeout -k 10 60 "$bin/piperun" "$out/tp2dp2.json" --backend cuda --dtype bf16 --steps 3 \
        --check-reference >"$out/tp2dp2.txt" 2>&1; then
      say "pp2 tp2 dp2 cuda --dtype bf16 --check-reference ok ($((SECONDS - start)) s): $(grep -o '[td]p_copies=[^ ]*' "$out/tp2dp2.txt" | tr '\n' ' ')"
    else
      status=1
      say "pp2 tp2 dp2 cuda --dtype bf16 --check-reference FAILED ($((SECONDS - start)) s):"
      sed 's/^/  /' "$out/tp2dp2.txt" | tee -a "$report"
    fi
  fi
else
  status=1
  say "tp2dp2: pipec compile FAILED:"
  sed 's/^/  /' "$out/tp2dp2.compile.txt" | tee -a "$report"
fi

# The runtime's own host cost per instruction (target <= 10 us): interpreter + local transport
# with empty compute.
start=$SECONDS
: >"$out/overhead.txt"
# pp 4 three times: its figure is the 10 us target's, and it varied from run to run.
for pp in 2 4 4 4 8; do
  fits 45 "overhead benchmark pp $pp" bench || continue
  if ! run timeout -k 10 45 "$bin/cuda_overhead_bench" --pp "$pp" --microbatches 1024 \
      >>"$out/overhead.txt" 2>&1; then
    say "OVERHEAD BENCHMARK FAILED (pp $pp); see $out/overhead.txt"
  fi
done
say "runtime overhead ($((SECONDS - start)) s):"
sed 's/^/  /' "$out/overhead.txt" | tee -a "$report"

bench_args=()
[ "${QUICK:-0}" = 1 ] && bench_args=(--quick)
# (Without the Hopper attention backward once it has hung: the rest is still measured.)
[ "$wgmma_backward_hung" = 0 ] || bench_args+=(--no-wgmma-backward)
start=$SECONDS
if fits 90 "kernel benchmark" bench; then
  if run timeout -k 10 90 "$bin/cuda_kernel_bench" ${bench_args[@]+"${bench_args[@]}"} \
      >"$out/bench.txt" 2>&1; then
    say "kernel benchmark ok ($((SECONDS - start)) s):"
  else
    rc=$?
    say "KERNEL BENCHMARK FAILED or timed out (exit $rc, $((SECONDS - start)) s) (not counted against the tests):"
    # A hang here is most likely the Hopper attention backward's (the one part never run on a
    # GPU): the profile and step benchmarks below then leave it out.
    case "$rc" in 124 | 137) wgmma_backward_hung=1 ;; esac
  fi
  sed 's/^/  /' "$out/bench.txt" | tee -a "$report"
fi

# The nccl mode with one process per GPU (runtime/cuda/NcclRun.h), launched here as torchrun
# would (RANK, WORLD_SIZE, LOCAL_RANK, NCCL_COMM_ID; two cases as srun and Open MPI's mpirun
# would, in their own variables) with --check-reference (every process's
# gradients gathered to rank 0 and held against the single-rank reference: a process exits 1
# over tolerance); rank 0's losses must also equal those of --backend cuda (every rank on one
# GPU) within 1e-4. 60 s for each of the two runs of a configuration at most. DTYPE=bf16 runs
# both in bf16.
# A case with more processes than the machine has GPUs runs them all on GPU 0 ("one-GPU mode"):
# NCCL 2.5 and later refuse two ranks of one host on one GPU, so each process gets a host id of
# its own (NCCL_HOSTID), which makes it a node of its own to NCCL; the data then goes through
# host memory over NCCL's socket transport on loopback. That runs the real library across real
# processes (bootstrap, communicators and their splits, grouped p2p, the tp, dp and embedding
# all-reduces, the --check-reference gather), but neither NVLink nor NCCL's P2P and SHM
# transports, and its times mean nothing. If the first such case fails before its communicators
# and warm-up are up (rank 0 prints its arena after them), it is tried once more without NCCL's
# cuMem allocations (a sandboxed driver may lack them); if that fails so too, the other one-GPU
# cases are skipped. A case that fails after them fails alone: the mode works.
one_gpu_env=(NCCL_SOCKET_IFNAME=lo NCCL_NET=Socket NCCL_IB_DISABLE=1 NCCL_MNNVL_ENABLE=0
  NCCL_NVLS_ENABLE=0)
one_gpu_state=untried # untried, works, broken
# launch_ranks N LOG TAG LIMIT CMD...: runs CMD as the N processes of one launch, as torchrun
# would (RANK, WORLD_SIZE, LOCAL_RANK, NCCL_COMM_ID on a port of its own), or with LAUNCHER=srun
# or LAUNCHER=ompi in that launcher's own variables (srun's SLURM_*, Open MPI's
# OMPI_COMM_WORLD_*; runtime/cuda/NcclLayout.h), with the caller's `extra` variables and, in the
# one-GPU mode (`extra` not empty), an NCCL_HOSTID per process; rank r writes LOG.rank<r>.txt
# and gets LIMIT seconds. Fails if any process failed.
launch_ranks() {
  local n=$1 log=$2 tag=$3 limit=$4 port=$((29500 + RANDOM % 2000)) pids=() rc=0 r
  shift 4
  for ((r = 0; r < n; r++)); do
    local -a place
    case "${LAUNCHER:-torchrun}" in
    srun) place=("SLURM_STEP_ID=0" "SLURM_PROCID=$r" "SLURM_STEP_NUM_TASKS=$n" "SLURM_LOCALID=$r") ;;
    ompi) place=("OMPI_COMM_WORLD_RANK=$r" "OMPI_COMM_WORLD_SIZE=$n"
      "OMPI_COMM_WORLD_LOCAL_RANK=$r") ;;
    *) place=("RANK=$r" "WORLD_SIZE=$n" "LOCAL_RANK=$r") ;;
    esac
    local -a vars=("${place[@]}" "NCCL_COMM_ID=127.0.0.1:$port"
      "NCCL_DEBUG=${NCCL_DEBUG:-WARN}" ${extra[@]+"${extra[@]}"})
    [ -z "${NCCL_DEBUG_SUBSYS:-}" ] || vars+=("NCCL_DEBUG_SUBSYS=$NCCL_DEBUG_SUBSYS")
    [ "${#extra[@]}" -eq 0 ] || vars+=("NCCL_HOSTID=pipec-$tag-rank$r")
    echo "+ ${vars[*]} $*" >&2
    env -u RANK -u WORLD_SIZE -u LOCAL_RANK "${vars[@]}" timeout -k 10 "$limit" "$@" \
      >"$log.rank$r.txt" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  return "$rc"
}
nccl_case() { # name nproc pipec-flags...
  local name=$1 n=$2
  shift 2
  local plan="$out/nccl-$name.json" where
  local -a extra=()
  if [ "$n" -le "$ngpu" ]; then
    where="$n processes, one per GPU"
  else
    if [ "$one_gpu_state" = broken ]; then
      say "SKIPPED nccl $name ($n processes on 1 GPU): the one-GPU mode did not set up its communicators, with cuMem or without (above)"
      return 1
    fi
    where="$n processes on 1 GPU, NCCL over loopback sockets"
    extra=(CUDA_VISIBLE_DEVICES=0 "${one_gpu_env[@]}")
  fi
  [ "${LAUNCHER:-torchrun}" = torchrun ] || where="$where, placed by ${LAUNCHER}'s variables"
  fits 120 "nccl $name" || return 3 # (skipped: says nothing about the one-GPU mode)
  if ! "$bin/pipec" compile --model "${MODEL:-examples/tiny-gpt.json}" "$@" -o "$plan" --quiet \
      >"$out/nccl-$name.compile.log" 2>&1 ||
    ! timeout -k 10 60 "$bin/piperun" "$plan" --backend cuda --dtype "${DTYPE:-fp32}" --steps 3 \
      >"$out/nccl-$name.cuda.txt" 2>&1; then
    say "nccl $name: FAILED before launch (pipec or --backend cuda); see $out/nccl-$name.*"
    return 4 # (nor does this)
  fi
  if ! launch_ranks "$n" "$out/nccl-$name" "check-$name" 60 "$bin/piperun" "$plan" \
      --backend nccl --dtype "${DTYPE:-fp32}" --steps 3 --timeout 30 --check-reference; then
    say "nccl $name ($where): FAILED; first lines of each rank's output:"
    for ((r = 0; r < n; r++)); do
      # (without NCCL's INFO lines, which the mode's first case has)
      { grep -v ' NCCL INFO ' "$out/nccl-$name.rank$r.txt" | head -3; echo ...
        grep -v ' NCCL INFO ' "$out/nccl-$name.rank$r.txt" | tail -5; } |
        sed "s/^/  rank $r: /" | tee -a "$report"
    done
    return 1
  fi
  # (Placed by the launcher's variables the case was started with, not by others.)
  local placed
  case "${LAUNCHER:-torchrun}" in
  srun) placed="srun" ;;
  ompi) placed="Open MPI's mpirun" ;;
  *) placed="torchrun" ;;
  esac
  if ! grep -q "^launch: $n processes, placed by $placed (" "$out/nccl-$name.rank0.txt"; then
    say "nccl $name ($where): RANK 0 did not say it was placed by $placed: $(grep -m1 '^launch:' "$out/nccl-$name.rank0.txt" || echo 'no launch line')"
    return 1
  fi
  if paste <(grep '^step' "$out/nccl-$name.rank0.txt") <(grep '^step' "$out/nccl-$name.cuda.txt") |
    awk '{ d = $4 - $8; if (d < 0) d = -d; if (d > 1e-4 || $2 != $6) bad = 1; n++ }
         END { exit (bad || n != 3) }'; then
    say "nccl $name ($where): ok, losses $(grep '^step' "$out/nccl-$name.rank0.txt" | awk '{printf "%s ", $4}')(cuda: $(grep '^step' "$out/nccl-$name.cuda.txt" | awk '{printf "%s ", $4}')); $(grep -o 'max_abs_grad_diff=.*' "$out/nccl-$name.rank0.txt") $(grep -o 'max_tensor_grad_diff=[^ ]*' "$out/nccl-$name.rank0.txt") $(grep -o 'max_weight_diff=[^ ]*' "$out/nccl-$name.rank0.txt") $(grep -o '[td]p_copies=[^ ]*' "$out/nccl-$name.rank0.txt" | tr '\n' ' ')"
  else
    say "nccl $name ($where): LOSSES DIFFER from --backend cuda; see $out/nccl-$name.*"
    return 1
  fi
}
# Whether case NAME's processes got their communicators and warm-up done: rank 0 printed its
# activation arena, which comes after them (runtime/cuda/NcclRun.cpp).
set_up() { grep -q '^activation arena MiB' "$out/nccl-$1.rank0.txt" 2>/dev/null; }
# nccl_check name nproc pipec-flags...: nccl_case, and in the one-GPU mode its first case's
# retry without cuMem and the verdict on the mode.
nccl_check() {
  local n=$2
  if [ "$n" -le "$ngpu" ] || [ "$one_gpu_state" != untried ]; then
    nccl_case "$@"
    return
  fi
  # (NCCL's own account of its setup in the logs, for the mode's first case only: if the mode
  # fails, logs.tgz says why without another run.)
  local rc=0
  NCCL_DEBUG=${NCCL_DEBUG:-INFO} NCCL_DEBUG_SUBSYS=INIT,NET nccl_case "$@" || rc=$?
  if [ "$rc" = 0 ]; then
    one_gpu_state=works
    return 0
  fi
  # Skipped for the budget, or failed before its launch: the next one-GPU case tries the mode.
  [ "$rc" != 3 ] && [ "$rc" != 4 ] || return 1
  if set_up "$1"; then
    one_gpu_state=works
    say "nccl $1: its processes set up their communicators: the one-GPU mode works, the case failed"
    return 1
  fi
  say "nccl $1: trying the one-GPU mode once more with NCCL_CUMEM_ENABLE=0 NCCL_CUMEM_HOST_ENABLE=0"
  local f
  for f in "$out/nccl-$1".rank*.txt; do # (the first try's logs, kept)
    [ ! -e "$f" ] || mv "$f" "${f%.txt}.first-try.txt"
  done
  one_gpu_env+=(NCCL_CUMEM_ENABLE=0 NCCL_CUMEM_HOST_ENABLE=0)
  rc=0
  NCCL_DEBUG=${NCCL_DEBUG:-INFO} NCCL_DEBUG_SUBSYS=INIT,NET nccl_case "$@" || rc=$?
  [ "$rc" != 3 ] && [ "$rc" != 4 ] || return 1 # (as above: the mode is still untried)
  if [ "$rc" = 0 ] || set_up "$1"; then
    one_gpu_state=works
    say "nccl: the one-GPU mode sets up here only without NCCL's cuMem allocations; the other cases run so"
    return "$rc"
  fi
  one_gpu_state=broken
  return 1
}
start=$SECONDS
[ "$ngpu" -ge 2 ] || say "nccl multi-process checks: nvidia-smi lists $ngpu GPU, so every case runs in the one-GPU mode"
# What the one-GPU mode needs of the machine: room in /dev/shm (NCCL's proxy maps a pool there
# per communicator) and a GPU that takes several processes (compute mode Default).
say "nccl: /dev/shm $(df -h /dev/shm 2>/dev/null | awk 'NR == 2 {print $2 " with " $4 " free"}' || true); compute mode $(timeout -k 5 30 nvidia-smi --query-gpu=compute_mode --format=csv,noheader 2>/dev/null | head -1 || true)"
nccl_check pp2-1f1b 2 --schedule 1f1b --pp 2 --microbatches 4 || status=1
nccl_check pp2-zbv 2 --schedule zb-v --pp 2 --vpp 2 --microbatches 4 || status=1
nccl_check dp2 2 --schedule 1f1b --pp 1 --dp 2 --microbatches 2 || status=1
nccl_check tp2 2 --schedule 1f1b --pp 1 --tp 2 --microbatches 2 || status=1
DTYPE=bf16 nccl_check pp2-bf16 2 --schedule 1f1b --pp 2 --microbatches 4 || status=1
# Tied embeddings on two processes: the `embedding` communicator.
sed 's/"dtype": "fp32"/"dtype": "fp32", "tie_embeddings": true/' examples/tiny-gpt.json \
  >"$out/tiny-gpt-tied.json"
MODEL="$out/tiny-gpt-tied.json" nccl_check pp2-tied 2 --schedule 1f1b --pp 2 --microbatches 4 ||
  status=1
nccl_check pp2-tp2 4 --schedule 1f1b --pp 2 --tp 2 --microbatches 4 || status=1
# (Two cases launched in srun's and Open MPI's own variables, as those launchers start them.)
LAUNCHER=srun nccl_check pp2-dp2 4 --schedule zb-h1 --pp 2 --dp 2 --microbatches 4 || status=1
LAUNCHER=ompi nccl_check pp4 4 --schedule 1f1b --pp 4 --microbatches 4 || status=1

# The nccl mode's host cost per instruction (bench/nccl_overhead_bench.cpp: the interpreter and
# the nccl transport with empty compute, target <= 10 us), 4 processes launched as above, each
# printing its rank's line. No two ranks share a process, as on a cluster. In the one-GPU mode
# NCCL moves the data over loopback sockets: step_with_device means nothing there, and
# host_per_instruction is the runtime's own cost only where host_step stays well below
# step_with_device (else NCCL held the host back).
nccl_overhead() {
  local n=4 where="4 processes, one per GPU"
  local -a extra=()
  if [ "$n" -gt "$ngpu" ]; then
    if [ "$one_gpu_state" != works ]; then
      say "SKIPPED nccl overhead benchmark: no case of the one-GPU mode passed (above)"
      return 0
    fi
    where="4 processes on 1 GPU, NCCL over loopback sockets"
    extra=(CUDA_VISIBLE_DEVICES=0 "${one_gpu_env[@]}")
  fi
  fits 55 "nccl overhead benchmark" bench || return 0
  if ! launch_ranks "$n" "$out/nccl-overhead" overhead 45 "$bin/nccl_overhead_bench" --pp "$n" \
      --microbatches 1024; then
    say "NCCL OVERHEAD BENCHMARK FAILED ($where; not counted against the tests); last lines of each rank's output:"
    for ((r = 0; r < n; r++)); do
      tail -3 "$out/nccl-overhead.rank$r.txt" | sed "s/^/  rank $r: /" | tee -a "$report"
    done
    return 0
  fi
  say "nccl overhead ($where):"
  for ((r = 0; r < n; r++)); do
    grep '^rank=' "$out/nccl-overhead.rank$r.txt" | sed 's/^/  /' | tee -a "$report"
  done
}
nccl_overhead
version=$(cat "$out"/nccl-*.rank0.txt 2>/dev/null | grep -m1 -o 'NCCL version [^ ]*' || true)
say "nccl multi-process checks done ($((SECONDS - start)) s; ${version:-NCCL version not printed})"

# A profile of every attention kernel path, each launched once (cuda_kernel_bench
# --attention-once) under Nsight Compute, for the next step on the attention backward: per kernel
# its duration, SM and memory throughput, occupancy and registers in the report, the full
# sections (warp stalls, pipes) in logs.tgz. Skipped where there is no ncu, or with NCU=0.
ncu_bin=$(command -v ncu || true)
[ -z "$ncu_bin" ] && [ -x /usr/local/cuda/bin/ncu ] && ncu_bin=/usr/local/cuda/bin/ncu
if [ "${NCU:-1}" = 0 ]; then
  say "attention profile skipped: NCU=0"
elif [ -z "$ncu_bin" ]; then
  say "attention profile skipped: no ncu on this machine (PATH or /usr/local/cuda/bin)"
elif fits 90 "attention profile (ncu)" bench; then
  start=$SECONDS
  ncu_args=(--attention-once)
  [ "$wgmma_backward_hung" = 0 ] || ncu_args+=(--no-wgmma-backward)
  if run timeout -k 10 90 "$ncu_bin" --section SpeedOfLight --section ComputeWorkloadAnalysis \
      --section Occupancy --section LaunchStats --section WarpStateStats \
      "$bin/cuda_kernel_bench" "${ncu_args[@]}" >"$out/ncu-attention.txt" 2>&1 &&
    grep -q '^    Duration ' "$out/ncu-attention.txt"; then
    say "attention profile (ncu, $((SECONDS - start)) s): per kernel, in launch order:"
    grep -E '^  [A-Za-z_][A-Za-z0-9_:<>, ]*\(|^    (Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Registers Per Thread) ' \
      "$out/ncu-attention.txt" |
      sed 's/pipec::kernels::cuda:://g; s/(anonymous namespace):://g; s/^/  /; s/ \{2,\}/  /g' |
      cut -c1-160 | tee -a "$report" || true
  else
    say "attention profile (ncu) FAILED, timed out or profiled nothing ($((SECONDS - start)) s) (not counted against the tests):"
    grep -E '==ERROR==|==WARNING==|error' "$out/ncu-attention.txt" | head -5 | sed 's/^/  /' |
      tee -a "$report" || true
  fi
fi

# Whole training steps of a GPT with hidden 1024 in bf16 (bench/cuda_step_bench.cpp): the
# runtime and the kernels together, in model TFLOP/s. Reported, never judged.
start=$SECONDS
: >"$out/step.txt"
for step_args in "--pp 2 --microbatches 8" \
  "--schedule seq1f1b --pp 4 --microbatches 8 --seq 4096 --seq-splits 4" \
  "--schedule seq1f1b --pp 4 --microbatches 8 --seq 4096 --seq-splits 4 wgmma-backward" \
  "--schedule seq1f1b --pp 4 --microbatches 8 --seq 4096 --seq-splits 4 wgmma-backward-dq-fixed"; do
  case "$wgmma_backward_hung:$step_args" in
  1:*wgmma-backward*)
    say "SKIPPED step benchmark ($step_args): the Hopper attention backward hung above"
    continue
    ;;
  esac
  fits 90 "step benchmark ($step_args)" bench || continue
  echo "+ cuda_step_bench $step_args" >>"$out/step.txt"
  label=$step_args # (with the wgmma-backward word, which step_args loses below)
  env=()
  case "$step_args" in
  *wgmma-backward)
    env=(PIPEC_ATTENTION_WGMMA_BACKWARD=1)
    step_args=${step_args% wgmma-backward}
    ;;
  *wgmma-backward-dq-fixed)
    env=(PIPEC_ATTENTION_WGMMA_BACKWARD=1 PIPEC_ATTENTION_DQ_ATOMICS=fixed)
    step_args=${step_args% wgmma-backward-dq-fixed}
    ;;
  esac
  # shellcheck disable=SC2086 # the arguments are words
  if env ${env[@]+"${env[@]}"} timeout -k 10 90 "$bin/cuda_step_bench" $step_args >>"$out/step.txt" 2>&1; then
    :
  else
    rc=$?
    say "STEP BENCHMARK FAILED or timed out (exit $rc; $label); see $out/step.txt"
    case "$rc:$label" in 124:*wgmma-backward* | 137:*wgmma-backward*) wgmma_backward_hung=1 ;; esac
  fi
done
say "step benchmark ($((SECONDS - start)) s):"
sed 's/^/  /' "$out/step.txt" | tee -a "$report"


say "finished; report $report, logs in $out/logs.tgz"
exit "$status"
