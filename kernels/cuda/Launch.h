//===- Launch.h - host launchers of the hand-written CUDA kernels -*- C++ -*-===//
//
// The boundary between nvcc and the host compiler: each .cu file defines some of these plain
// functions, which check nothing but the kernel's own preconditions, launch on `stream` and
// return cudaGetLastError() (plus attentionUsesTensorCores, a query). Validation of user-facing
// arguments and the conversion of the status into llvm::Error happen in KernelOps.cpp (and
// CudaOps.cpp for the bias gradient of a matmul), through the one funnel of CudaCheck.h.
// Pointers are device pointers whose element type is `dtype` unless declared float.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_KERNELS_CUDA_LAUNCH_H
#define PIPEC_KERNELS_CUDA_LAUNCH_H

#include "kernels/cuda/DType.h"

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>

namespace pipec::kernels::cuda::launch {

/// The largest head dimension the attention kernels hold per warp (8 values per lane).
inline constexpr int kMaxHeadDim = 256;

// Elementwise.cu
cudaError_t convert(DType dstType, void *dst, DType srcType, const void *src, size_t n,
                    cudaStream_t stream);
cudaError_t geluForward(DType dtype, void *out, const void *in, size_t n, cudaStream_t stream);
cudaError_t geluBackward(DType dtype, void *dIn, const void *dOut, const void *in, size_t n,
                         cudaStream_t stream);
/// mHatScale = 1 / (1 - beta1^step), vHatScale = 1 / (1 - beta2^step), computed on the host as
/// the CPU reference computes them.
cudaError_t adamUpdate(float *params, const float *grads, float *m, float *v, size_t n, float lr,
                       float beta1, float beta2, float eps, float weightDecay, float mCorrection,
                       float vCorrection, cudaStream_t stream);
/// The column sums (the bias and layernorm weight gradients) add rows in chunks of this many, in
/// an order the shapes alone fix (no atomics: the same bits every launch); with more than one
/// chunk they need `partials`, scratch of columnSumScratchFloats(n, c, sums) floats.
inline constexpr int kColumnSumChunkRows = 256;
inline size_t columnSumScratchFloats(int n, int c, int sums) {
  const size_t chunks = (size_t(n) + kColumnSumChunkRows - 1) / kColumnSumChunkRows;
  return chunks > 1 ? chunks * size_t(c) * size_t(sums) : 0;
}
/// dBias (o) += column sums of dOut (n, o); `partials`: columnSumScratchFloats(n, o, 1) floats
/// (cudaErrorInvalidValue if null when needed).
cudaError_t columnSumAccumulate(DType dtype, float *dBias, const void *dOut, int n, int o,
                                float *partials, cudaStream_t stream);
/// out (n rows of o, `ld` apart) += bias (o) on every row; fp32 arithmetic, one rounding.
cudaError_t addRowBias(DType dtype, void *out, const void *bias, int n, int o, int ld,
                       cudaStream_t stream);

// Layernorm.cu
cudaError_t layernormForward(DType dtype, void *out, float *mean, float *rstd, const void *in,
                             const void *w, const void *b, int n, int c, cudaStream_t stream);
cudaError_t layernormBackwardInputAccumulate(DType dtype, void *dIn, const void *dOut,
                                             const void *in, const float *mean, const float *rstd,
                                             const void *w, int n, int c, cudaStream_t stream);
/// dW (c) += sum over rows of dOut * xhat, dB (c) += sum of dOut; `partials`:
/// columnSumScratchFloats(n, c, 2) floats (cudaErrorInvalidValue if null when needed).
cudaError_t layernormBackwardWeight(DType dtype, float *dW, float *dB, const void *dOut,
                                    const void *in, const float *mean, const float *rstd, int n,
                                    int c, float *partials, cudaStream_t stream);

// Attention.cu
struct AttentionDims {
  int batch, queries, begin, heads, headDim;
};
/// Whether attentionForward and attentionBackward run the tensor-core kernels for these
/// `tensors` (out, q, k, v; or dq, dk, dv, dOut, out, q, k, v): bf16, a head dimension that is a
/// multiple of 16 up to 128, every tensor 16-byte aligned. Otherwise they run the SIMT kernels.
bool attentionUsesTensorCores(DType dtype, AttentionDims s,
                              std::initializer_list<const void *> tensors);
/// Whether attentionForward runs the Hopper kernel (wgmma, sm_90a) rather than the mma.sync one:
/// attentionUsesTensorCores, a head dimension of 64 or 128, a current device of
/// compute capability 9.x (always on the kernel emulator), and not switched off by
/// setAttentionWgmma(false) or PIPEC_ATTENTION_WGMMA=0 in the environment.
bool attentionForwardUsesWgmma(DType dtype, AttentionDims s,
                               std::initializer_list<const void *> tensors);
/// Whether attentionBackward runs the Hopper kernels (dQ, and dK with dV): the forward's
/// conditions, and switched on by setAttentionWgmmaBackward(true) or
/// PIPEC_ATTENTION_WGMMA_BACKWARD=1. Off by default: they pass every test on the kernel emulator
/// but have not run on a GPU yet (the mma.sync backward has).
bool attentionBackwardUsesWgmma(DType dtype, AttentionDims s,
                                std::initializer_list<const void *> tensors);
/// Turns the Hopper attention backward on or off (the default) for the whole process.
void setAttentionWgmmaBackward(bool enabled);
/// How the Hopper backward computes dQ. Separate: its own kernel, which recomputes S and dP (7
/// matrix products a tile with the dK/dV kernel). In the others the dK/dV kernel also computes
/// dQ and adds it with atomics (5 products): FloatAtomics into an fp32 dQ, whose last bits then
/// depend on the order the blocks run in, so that two runs of a plan no longer agree bit for
/// bit; FixedPoint into a 64-bit fixed-point dQ scaled per row by a bound of the row, whose sums
/// are exact integers in any order (deterministic; Attention.cu, fixedPointExponent).
enum class DqMode : int { Separate = 0, FloatAtomics = 1, FixedPoint = 2 };
/// The mode attentionBackward runs for these tensors: Separate unless the Hopper backward runs
/// (attentionBackwardUsesWgmma) and setAttentionDqMode or PIPEC_ATTENTION_DQ_ATOMICS (`1` or
/// `float`: FloatAtomics; `fixed`: FixedPoint) chose another. Separate by default (the others
/// have not run on a GPU yet).
DqMode attentionBackwardDqMode(DType dtype, AttentionDims s,
                               std::initializer_list<const void *> tensors);
/// Sets the dQ mode for the whole process (it takes effect where the Hopper backward runs).
void setAttentionDqMode(DqMode mode);
/// The floats of attentionBackward's `rowDot` scratch in a dQ mode: B*H*x, and more in the modes
/// with atomics (their dQ, 4 or 8 bytes per element of q, and the fixed-point mode's bounds).
size_t attentionBackwardScratchFloats(DqMode mode, AttentionDims s);
/// Turns the Hopper attention kernels (the forward and the backward) on (the default) or off
/// for the whole process; the kernel benchmark measures both.
void setAttentionWgmma(bool enabled);
/// The Hopper forward's variants: 0 one warpgroup (64 queries) a block, 1 two, each computing a
/// tile's scores, softmax and P V one after another; 2 and 3 the same with the next tile's
/// scores overlapping P V; 4 as 3 with tiles handed over through mbarriers instead of a
/// block-wide barrier, two tiles loading ahead (Attention.cu). Every one is tested;
/// attentionForward runs kWgmmaDefault (the fastest measured on an H200) unless set otherwise for
/// the process.
inline constexpr int kWgmmaVariants = 5;
inline constexpr int kWgmmaDefault = 4;
const char *wgmmaVariantName(int variant);
/// Sets the variant (kWgmmaDefault for one out of range) and returns the previous one.
int setAttentionWgmmaVariant(int variant);
cudaError_t attentionForward(DType dtype, void *out, float *lse, const void *q, const void *k,
                             const void *v, AttentionDims s, cudaStream_t stream);
/// `rowDot` is scratch of attentionBackwardScratchFloats(dqMode, s) floats, 16-byte aligned (its
/// first B*H*x receive dOut . out per query row and head), `dqMode` what attentionBackwardDqMode
/// said for these tensors when the scratch was sized (looked up once, so that a switch flipped
/// in between cannot outgrow the scratch; the Hopper backward off means Separate whatever it
/// is); dk and dv are fp32 whatever `dtype` is.
cudaError_t attentionBackward(DType dtype, void *dq, float *dk, float *dv, const void *dOut,
                              const void *out, const float *lse, const void *q, const void *k,
                              const void *v, float *rowDot, DqMode dqMode, AttentionDims s,
                              cudaStream_t stream);

// CrossEntropy.cu
cudaError_t crossEntropyForward(DType dtype, float *rowLoss, float *lse, const void *logits,
                                const int32_t *targets, int n, int v, float scale,
                                cudaStream_t stream);
cudaError_t crossEntropyShardStats(DType dtype, float *stats, const void *logits,
                                   const int32_t *targets, int n, int v, int vocabBegin, int part,
                                   int parts, cudaStream_t stream);
cudaError_t crossEntropyCombine(float *rowLoss, float *lse, const float *stats, int n, int parts,
                                float scale, cudaStream_t stream);
cudaError_t crossEntropyBackward(DType dtype, void *dLogits, const void *logits, const float *lse,
                                 const int32_t *targets, int n, int v, int vocabBegin, float scale,
                                 cudaStream_t stream);

} // namespace pipec::kernels::cuda::launch

#endif // PIPEC_KERNELS_CUDA_LAUNCH_H
