//===- AttentionBackward.h - the Hopper attention backward (EXPERIMENTAL) -*- C++ -*-===//
//
// NOT IN THE MAIN LINE: the attention backward on wgmma (AttentionBackward.cu), with dQ by its
// own kernel or by atomics in the dK/dV kernel (DqMode.h). It passes every test of this package
// on the kernel emulator but has never run on a GPU; the runtime does not call it (CudaOps.h's
// attentionBackward runs the mma.sync and SIMT kernels). Once a GPU run of
// //kernels/cuda/experimental:attention_backward_test and :attention_backward_bench shows it
// correct and faster than mma.sync's (14 % of the H200's bf16 peak), it can move into
// kernels/cuda/ as one more kernel attentionBackward chooses on a compute-capability-9.0 device
// (docs/gpu.md, "Experimental kernels").
//
// The same contract as CudaOps.h's attentionBackward (shapes, layouts, dk and dv fp32 and added
// to), on the context's stream; scratch from the context's allocator, so the sizing pass of the
// activation arena would reserve it. No CUDA types, as CudaOps.h.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_KERNELS_CUDA_EXPERIMENTAL_ATTENTIONBACKWARD_H
#define PIPEC_KERNELS_CUDA_EXPERIMENTAL_ATTENTIONBACKWARD_H

#include "kernels/cuda/CudaOps.h"
#include "kernels/cuda/experimental/DqMode.h"

#include <initializer_list>

namespace pipec::kernels::cuda::experimental {

/// Whether attentionBackwardWgmma runs for these `tensors` (dq, dk, dv, dOut, out, q, k, v) on
/// `ctx`: a compute-capability-9.0 device whose KernelConfig allows the Hopper kernels, bf16, a
/// head dimension of 64 or 128, every tensor 16-byte aligned.
bool attentionBackwardWgmmaRuns(const CudaContext &ctx, DType dtype, const AttentionShape &s,
                                std::initializer_list<const void *> tensors);
/// The scratch attentionBackwardWgmma takes from the context's allocator in `mode`, in bytes:
/// the row dots (B*H*x floats), and in the modes with atomics their dQ (4 or 8 bytes per element
/// of q) and the fixed-point mode's row and head bounds.
size_t attentionBackwardWgmmaScratchBytes(DqMode mode, const AttentionShape &s);
/// CudaOps.h's attentionBackward on the Hopper kernels, dQ computed as `mode` says. An error
/// naming the condition where attentionBackwardWgmmaRuns is false.
llvm::Error attentionBackwardWgmma(CudaContext &ctx, DqMode mode, DType dtype, void *dq, float *dk,
                                   float *dv, const void *dOut, const void *out, const float *lse,
                                   const void *q, const void *k, const void *v,
                                   const AttentionShape &s);

} // namespace pipec::kernels::cuda::experimental

#endif // PIPEC_KERNELS_CUDA_EXPERIMENTAL_ATTENTIONBACKWARD_H
