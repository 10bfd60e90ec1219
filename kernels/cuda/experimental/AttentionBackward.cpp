//===- AttentionBackward.cpp - host side of the Hopper attention backward (EXPERIMENTAL) -===//
//
// AttentionBackward.h's entry points, as kernels/cuda/KernelOps.cpp's for the main line:
// validate, take the scratch from the context's allocator, launch (Launch.h), and pass the
// status through the checked funnel of CudaCheck.h. Built for a GPU and for the kernel emulator.
//
//===----------------------------------------------------------------------===//
#include "kernels/cuda/experimental/AttentionBackward.h"

#include "kernels/cuda/CudaCheck.h"
#include "kernels/cuda/DeviceMemory.h"
#include "kernels/cuda/experimental/Launch.h"

#include <fmt/format.h>

namespace pipec::kernels::cuda::experimental {

static cuda::launch::AttentionDims dimsOf(const AttentionShape &s) {
  return {s.batch, s.queries, s.begin, s.heads, s.headDim, s.kvHeads};
}

bool attentionBackwardWgmmaRuns(const CudaContext &ctx, DType dtype, const AttentionShape &s,
                                std::initializer_list<const void *> tensors) {
  const cuda::launch::Target target{ctx.computeCapability(), ctx.kernelConfig().hopperKernels};
  return target.hopper() && launch::wgmmaBackwardHeadDim(s.headDim) &&
         cuda::launch::attentionUsesTensorCores(dtype, dimsOf(s), tensors);
}

size_t attentionBackwardWgmmaScratchBytes(DqMode mode, const AttentionShape &s) {
  return launch::scratchFloats(mode, dimsOf(s)) * sizeof(float);
}

llvm::Error attentionBackwardWgmma(CudaContext &ctx, DqMode mode, DType dtype, void *dq, float *dk,
                                   float *dv, const void *dOut, const void *out, const float *lse,
                                   const void *q, const void *k, const void *v,
                                   const AttentionShape &s) {
  if (!attentionBackwardWgmmaRuns(ctx, dtype, s, {dq, dk, dv, dOut, out, q, k, v}))
    return llvm::createStringError(
        llvm::inconvertibleErrorCode(),
        fmt::format("attentionBackwardWgmma: needs a compute-capability-9.0 GPU with the Hopper "
                    "kernels allowed (this one is {}.{}, {}), bf16 (got {}), head dimension 64 "
                    "or 128 (got {}) and 16-byte aligned tensors",
                    ctx.computeCapability() / 10, ctx.computeCapability() % 10,
                    ctx.kernelConfig().hopperKernels ? "allowed" : "not allowed", toString(dtype),
                    s.headDim));
  if (size_t(s.batch) * s.heads > 65535)
    return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                   fmt::format("attentionBackwardWgmma: batch x heads = {} is "
                                               "over 65535 (grid y)",
                                               size_t(s.batch) * s.heads));
  if (size_t(s.batch) * s.heads * s.queries == 0)
    return llvm::Error::success();
  ScratchBuffer scratch(ctx.allocator());
  if (auto err = scratch.allocate(attentionBackwardWgmmaScratchBytes(mode, s)))
    return err;
  PIPEC_QUEUE_TRY(ctx, launch::attentionBackwardWgmma(mode, dq, dk, dv, dOut, out, lse, q, k, v,
                                                      scratch.as<float>(), dimsOf(s),
                                                      static_cast<cudaStream_t>(ctx.stream())));
  return llvm::Error::success();
}

} // namespace pipec::kernels::cuda::experimental
