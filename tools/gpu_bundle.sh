#!/usr/bin/env bash
# Builds, on a machine with the CUDA toolkit (no GPU needed), everything tools/gpu_check.sh runs
# on a GPU, and stages it in gpu-bundle/ (git ignores it): the requires-gpu test binaries, the
# GPU benchmarks, pipec and piperun, linked with -c opt --dynamic_mode=off (the project's own
# libraries, LLVM Support and GoogleTest static) and with assertions kept (-UNDEBUG: a first run
# on a GPU should stop at a broken invariant, not compute on), plus lib/ with libfmt and
# lib/cudart/ with the CUDA 13 runtime (used only where the GPU machine has none). cuBLAS,
# cuBLASLt and NCCL (hundreds of MB) come from the GPU machine; gpu_check.sh finds them there.
# The binaries need glibc 2.34 or newer (checked here; tools/bundle/GlibcCompat.c), and
# SOURCES lists the hash of every source file they were built from, so that gpu_check.sh
# refuses a bundle older than the tree it is carried with.
# The GPU machine needs no Bazel, no apt and no network: carry gpu-bundle/ with the working tree
# (the device tool's `carry`; this prints its size, which must stay under 64 MiB) and run
#   OUT=dir bash tools/gpu_check.sh
# `bash tools/gpu_bundle.sh --targets` prints the targets and stops (gpu_check.sh builds them
# itself where there is no bundle).
# Exit status: 0 staged; 1 the build or a check failed; 2 no CUDA toolkit here.
set -euo pipefail
cd "$(dirname "$0")/.."

targets=(//tests:wgmma_layout_test //tests:cuda_kernel_test //tests:cuda_runtime_test
  //tests:nccl_runtime_test //kernels/cuda/experimental:attention_backward_test
  //bench:cuda_kernel_bench //bench:cuda_overhead_bench //bench:nccl_overhead_bench
  //bench:cuda_step_bench //kernels/cuda/experimental:attention_backward_bench
  //tools:pipec //tools:piperun)
if [ "${1:-}" = --targets ]; then
  echo "${targets[*]}"
  exit 0
fi
if [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "gpu_bundle: /usr/local/cuda/bin/nvcc is missing; the CUDA targets need the toolkit" >&2
  exit 2
fi
prefix=/tmp/gpu-bundle-
compat=/tmp/gpu-bundle-glibc-compat.o
# The sources' hashes before the build (an edit made while it runs must not pass for built).
sources() {
  git ls-files -- '*.cpp' '*.h' '*.c' '*.cu' '*.cuh' '*.bzl' '*BUILD' WORKSPACE .bazelrc |
    xargs sha256sum
}
before=$(sources)
gcc -O2 -fPIC -c tools/bundle/GlibcCompat.c -o "$compat"
echo "+ bazel build -c opt --copt=-UNDEBUG --dynamic_mode=off --linkopt=$compat ${targets[*]}" >&2
if ! bazel build -c opt --copt=-UNDEBUG --dynamic_mode=off --linkopt="$compat" \
    --symlink_prefix="$prefix" "${targets[@]}"; then
  echo "gpu_bundle: the build failed" >&2
  exit 1
fi
rm -rf gpu-bundle.tmp
mkdir -p gpu-bundle.tmp/bin gpu-bundle.tmp/lib/cudart
for t in "${targets[@]}"; do
  cp "${prefix}bin/$(sed 's|^//||; s|:|/|' <<<"$t")" gpu-bundle.tmp/bin/
done
lib_of() { ldd gpu-bundle.tmp/bin/piperun | awk -v l="$1" '$1 == l { print $3 }'; }
fmt=$(lib_of libfmt.so.9)
cudart=$(lib_of libcudart.so.13)
if [ -z "$fmt" ] || [ -z "$cudart" ]; then
  echo "gpu_bundle: piperun no longer links libfmt.so.9 and libcudart.so.13 here; update tools/gpu_bundle.sh" >&2
  exit 1
fi
cp -L "$fmt" gpu-bundle.tmp/lib/
cp -L "$cudart" gpu-bundle.tmp/lib/cudart/
newest=$(objdump -T gpu-bundle.tmp/bin/* gpu-bundle.tmp/lib/*.so* 2>/dev/null |
  grep -o 'GLIBC_2\.[0-9]*' | sort -uV | tail -1)
if [ "$(printf '%s\n' "$newest" GLIBC_2.34 | sort -V | tail -1)" != GLIBC_2.34 ]; then
  echo "gpu_bundle: the binaries need $newest (newer than 2.34, which a GPU image may lack):" >&2
  objdump -T gpu-bundle.tmp/bin/* | grep "$newest" | sort -u | head >&2
  exit 1
fi
if [ "$(sources)" != "$before" ]; then
  echo "gpu_bundle: sources changed while they were built; run tools/gpu_bundle.sh again" >&2
  exit 1
fi
echo "$before" >gpu-bundle.tmp/SOURCES
{
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (dirty)')"
  echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname) with $(/usr/local/cuda/bin/nvcc --version | grep -o 'release [0-9.]*'); needs $newest"
} >gpu-bundle.tmp/BUILT
rm -rf gpu-bundle
mv gpu-bundle.tmp gpu-bundle
echo "gpu_bundle: staged gpu-bundle/ ($(du -sm gpu-bundle | cut -f1) MiB): $(tr '\n' ';' <gpu-bundle/BUILT)"
