//===- EmuOps.h - What the CPU-computed ops of the emulated device share -*- C++ -*-===//
//
// kernels/cuda/emu/README.md. The matmuls (CudaOpsEmu.cpp) and the CPU stand-ins for the
// hand-written kernels (CpuKernelOpsEmu.cpp) queue host loops on the context's stream and
// accept fp32 only.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_KERNELS_CUDA_EMU_EMUOPS_H
#define PIPEC_KERNELS_CUDA_EMU_EMUOPS_H

#include "kernels/cuda/CudaOps.h"
#include "kernels/cuda/emu/FakeCuda.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <functional>
#include <utility>

namespace pipec::kernels::cuda::emu_ops {

inline llvm::Error fp32Only(const char *op, DType dtype) {
  if (dtype == DType::F32)
    return llvm::Error::success();
  return llvm::createStringError(
      llvm::inconvertibleErrorCode(),
      fmt::format("{}: the emulated device computes fp32 only (got {})", op, toString(dtype)));
}

/// Queues `work` on the context's stream.
inline llvm::Error run(CudaContext &ctx, std::function<void()> work) {
  emu::enqueue(static_cast<cudaStream_t>(ctx.stream()), std::move(work));
  return llvm::Error::success();
}

} // namespace pipec::kernels::cuda::emu_ops

#define PIPEC_EMU_FP32(op)                                                                         \
  do {                                                                                             \
    if (auto err = ::pipec::kernels::cuda::emu_ops::fp32Only(op, dtype))                           \
      return err;                                                                                  \
  } while (false)

#endif // PIPEC_KERNELS_CUDA_EMU_EMUOPS_H
