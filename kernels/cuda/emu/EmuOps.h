//===- EmuOps.h - What the CPU-computed ops of the emulated device share -*- C++ -*-===//
//
// kernels/cuda/emu/README.md. The matmuls (CudaOpsEmu.cpp) and the CPU stand-ins for the
// hand-written kernels (CpuKernelOpsEmu.cpp) queue host loops on the context's stream. They
// compute in fp32, as the CPU ops do; bf16 operands are widened first and bf16 results rounded
// once at the end (to nearest even): the precision model of the CUDA ops (fp32 arithmetic on
// bf16 storage), not their summation order.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_KERNELS_CUDA_EMU_EMUOPS_H
#define PIPEC_KERNELS_CUDA_EMU_EMUOPS_H

#include "kernels/HostBf16.h"
#include "kernels/cuda/CudaOps.h"
#include "kernels/cuda/emu/FakeCuda.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

namespace pipec::kernels::cuda::emu_ops {

/// `n` elements of `dtype` at `p` as fp32: the memory itself, or a widened copy.
struct Widened {
  std::vector<float> copy;
  const float *data = nullptr;
  Widened(const void *p, size_t n, DType dtype) {
    if (dtype == DType::F32 || !p) {
      data = static_cast<const float *>(p);
      return;
    }
    copy.resize(n);
    const auto *bits = static_cast<const uint16_t *>(p);
    for (size_t k = 0; k < n; ++k)
      copy[k] = bf16ToFloat(bits[k]);
    data = copy.data();
  }
};

/// Where an op writes `n` elements of `dtype` at `p`: the memory itself (fp32), or an fp32
/// scratch that done() rounds into it. With `accumulate` (an op that adds to its output) the
/// scratch starts as the widened memory.
struct Narrowed {
  void *dst;
  DType dtype;
  std::vector<float> scratch;
  float *data;
  Narrowed(void *p, size_t n, DType dtype, bool accumulate = false)
      : dst(p), dtype(dtype), scratch(dtype == DType::F32 ? 0 : n),
        data(dtype == DType::F32 ? static_cast<float *>(p) : scratch.data()) {
    if (accumulate && dtype != DType::F32)
      for (size_t k = 0; k < n; ++k)
        scratch[k] = bf16ToFloat(static_cast<const uint16_t *>(p)[k]);
  }
  void done() {
    if (dtype == DType::F32)
      return;
    auto *bits = static_cast<uint16_t *>(dst);
    for (size_t k = 0; k < scratch.size(); ++k)
      bits[k] = floatToBf16(scratch[k]);
  }
};

/// Queues `work` on the context's stream (nothing in its sizing pass).
inline llvm::Error run(CudaContext &ctx, std::function<void()> work) {
  if (ctx.sizing())
    return llvm::Error::success();
  emu::enqueue(static_cast<cudaStream_t>(ctx.stream()), std::move(work));
  return llvm::Error::success();
}

} // namespace pipec::kernels::cuda::emu_ops

#endif // PIPEC_KERNELS_CUDA_EMU_EMUOPS_H
