//===- Launch.h - host launcher of the experimental Hopper attention backward -*- C++ -*-===//
//
// The boundary between nvcc (AttentionBackward.cu) and the host compiler (AttentionBackward.cpp),
// as kernels/cuda/Launch.h is for the main line's kernels.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_KERNELS_CUDA_EXPERIMENTAL_LAUNCH_H
#define PIPEC_KERNELS_CUDA_EXPERIMENTAL_LAUNCH_H

#include "kernels/cuda/Launch.h"
#include "kernels/cuda/experimental/DqMode.h"

#include <cuda_runtime_api.h>

#include <cstddef>

namespace pipec::kernels::cuda::experimental::launch {

using cuda::launch::AttentionDims;

/// Whether the kernels are instantiated for this head dimension (64 and 128).
bool wgmmaBackwardHeadDim(int headDim);
/// The floats of attentionBackwardWgmma's `scratch` in `mode`: B*H*x (the row dots), and more in
/// the modes with atomics (their dQ, 4 or 8 bytes per element of q, and the fixed-point mode's
/// bounds).
size_t scratchFloats(DqMode mode, AttentionDims s);
/// cuda::launch::attentionBackward on the Hopper kernels (sm_90a: call it only on a
/// compute-capability-9.0 device), bf16 and head dimension 64 or 128, every tensor 16-byte
/// aligned: dq written, dk and dv (fp32) added to; `scratch` holds scratchFloats(mode, s)
/// floats, 16-byte aligned.
cudaError_t attentionBackwardWgmma(DqMode mode, void *dq, float *dk, float *dv, const void *dOut,
                                   const void *out, const float *lse, const void *q, const void *k,
                                   const void *v, float *scratch, AttentionDims s,
                                   cudaStream_t stream);

} // namespace pipec::kernels::cuda::experimental::launch

#endif // PIPEC_KERNELS_CUDA_EXPERIMENTAL_LAUNCH_H
