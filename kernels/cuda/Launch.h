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

// Llama.cu (kernels/cpu/LlamaOps.h's formulas)
cudaError_t rmsnormForward(DType dtype, void *out, float *rstd, const void *in, const void *w,
                           int n, int c, float eps, cudaStream_t stream);
cudaError_t rmsnormBackwardInputAccumulate(DType dtype, void *dIn, const void *dOut, const void *in,
                                           const float *rstd, const void *w, int n, int c,
                                           cudaStream_t stream);
/// dW (c) += sum over rows of dOut * in * rstd; `partials`: columnSumScratchFloats(n, c, 1)
/// floats (cudaErrorInvalidValue if null when needed).
cudaError_t rmsnormBackwardWeight(DType dtype, float *dW, const void *dOut, const void *in,
                                  const float *rstd, int n, int c, float *partials,
                                  cudaStream_t stream);
cudaError_t swigluForward(DType dtype, void *out, const void *pre, int n, int f,
                          cudaStream_t stream);
cudaError_t swigluBackward(DType dtype, void *dPre, const void *dOut, const void *pre, int n, int f,
                           cudaStream_t stream);
/// Rotary embeddings in place (`backward`: the transposed rotation); cudaErrorInvalidValue for
/// an odd head size.
cudaError_t rope(DType dtype, void *x, const int32_t *positions, int rows, int heads, int headDim,
                 double theta, bool backward, cudaStream_t stream);

// Attention.cu (the choice of kernel) and AttentionSimt.cu, AttentionMmaSync.cu,
// AttentionWgmma.cu (the kernel families; Attention.cuh)
struct AttentionDims {
  int batch, queries, begin, heads, headDim;
  int kvHeads = 0; // key/value heads (grouped-query attention); 0: heads
};
/// What a launcher chooses kernels by besides the shapes: the device its stream's work runs on
/// and the run's configuration (kernels/cuda/KernelConfig.h). KernelOps.cpp makes it from the
/// CudaContext; tests make it for devices they do not have.
struct Target {
  /// The device's compute capability, 10 major + minor: 80 (A100), 86, 89, 90 (H100, H200), ...
  int computeCapability = 0;
  /// KernelConfig::hopperKernels.
  bool hopperKernels = true;
  /// Whether sm_90a code may run: a compute-capability-9.0 device (the only one sm_90a code
  /// runs on) and a configuration that allows it.
  bool hopper() const { return hopperKernels && computeCapability == 90; }
};
/// The attention kernel families.
enum class AttentionKernel { Simt, MmaSync, Wgmma };
const char *toString(AttentionKernel kernel);
/// Whether the tensor cores take these `tensors` (out, q, k, v; or dq, dk, dv, dOut, out, q, k,
/// v): bf16, a head dimension that is a multiple of 16 up to 128, every tensor 16-byte aligned.
bool attentionUsesTensorCores(DType dtype, AttentionDims s,
                              std::initializer_list<const void *> tensors);
/// The forward's kernel: Wgmma where target.hopper(), the tensor cores take the tensors and the
/// head dimension is 64 or 128; else MmaSync where the tensor cores take them; else Simt.
AttentionKernel attentionForwardKernel(const Target &target, DType dtype, AttentionDims s,
                                       std::initializer_list<const void *> tensors);
/// The backward's kernel, on every device: MmaSync where the tensor cores take the tensors,
/// else Simt.
AttentionKernel attentionBackwardKernel(DType dtype, AttentionDims s,
                                        std::initializer_list<const void *> tensors);
/// The floats of attentionBackward's `rowDot` scratch: B*H*x.
size_t attentionBackwardScratchFloats(AttentionDims s);
cudaError_t attentionForward(const Target &target, DType dtype, void *out, float *lse,
                             const void *q, const void *k, const void *v, AttentionDims s,
                             cudaStream_t stream);
/// `rowDot` is scratch of attentionBackwardScratchFloats(s) floats, which receives dOut . out
/// per query row and head; dk and dv are fp32 (added to) whatever `dtype` is.
cudaError_t attentionBackward(DType dtype, void *dq, float *dk, float *dv, const void *dOut,
                              const void *out, const float *lse, const void *q, const void *k,
                              const void *v, float *rowDot, AttentionDims s, cudaStream_t stream);

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
