#!/usr/bin/env bash
# Builds, on a machine with the CUDA toolkit (no GPU needed), everything tools/gpu_check.sh runs
# on a GPU, and stages it in gpu-bundle/ (git ignores it): the requires-gpu test binaries, the
# GPU benchmarks, pipec and piperun, linked with -c opt --dynamic_mode=off (the project's own
# libraries, LLVM Support and GoogleTest static), plus lib/ with the small shared libraries a
# GPU machine's CUDA image may lack (libfmt, the CUDA 13 runtime). cuBLAS, cuBLASLt and NCCL
# (hundreds of MB) come from the GPU machine; gpu_check.sh finds them there.
# That machine needs no Bazel, no apt and no network: carry gpu-bundle/ with the working tree
# (the device tool's `carry`; this prints its size, which must stay under 64 MiB) and run
#   OUT=dir bash tools/gpu_check.sh
# Exit status: 0 staged; 1 the build failed; 2 no CUDA toolkit here.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "gpu_bundle: /usr/local/cuda/bin/nvcc is missing; the CUDA targets need the toolkit" >&2
  exit 2
fi
targets=(//tests:cuda_kernel_test //tests:cuda_runtime_test //tests:nccl_runtime_test
  //bench:cuda_kernel_bench //bench:cuda_overhead_bench //tools:pipec //tools:piperun)
prefix=/tmp/gpu-bundle-
echo "+ bazel build -c opt --dynamic_mode=off ${targets[*]}" >&2
if ! bazel build -c opt --dynamic_mode=off --symlink_prefix="$prefix" "${targets[@]}"; then
  echo "gpu_bundle: the build failed" >&2
  exit 1
fi
rm -rf gpu-bundle.tmp
mkdir -p gpu-bundle.tmp/bin gpu-bundle.tmp/lib
for t in "${targets[@]}"; do
  path="${prefix}bin/$(sed 's|^//||; s|:|/|' <<<"$t")"
  cp "$path" gpu-bundle.tmp/bin/
done
for lib in libfmt.so.9 libcudart.so.13; do
  src=$(ldd gpu-bundle.tmp/bin/piperun | awk -v l="$lib" '$1 == l { print $3 }')
  if [ -z "$src" ]; then
    echo "gpu_bundle: piperun does not link $lib here; update the list in tools/gpu_bundle.sh" >&2
    exit 1
  fi
  cp -L "$src" gpu-bundle.tmp/lib/
done
{
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (dirty)')"
  echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname) with $(/usr/local/cuda/bin/nvcc --version | grep -o 'release [0-9.]*')"
} >gpu-bundle.tmp/BUILT
rm -rf gpu-bundle
mv gpu-bundle.tmp gpu-bundle
echo "gpu_bundle: staged gpu-bundle/ ($(du -sm gpu-bundle | cut -f1) MiB): $(cat gpu-bundle/BUILT | head -1)"
