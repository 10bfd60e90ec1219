//===- StageKernels.h - glue kernels of a GPU pipeline stage ----*- C++ -*-===//
//
// The few kernels a GPU stage needs besides kernels/cuda/CudaOps.h: the embedding lookup and its
// scatter-add backward, the residual add of a reduced branch, the split of qkv into q and the
// position-major K/V (and the gather of their gradients back), an elementwise sum and a
// device-side loss accumulator. Same boundary as kernels/cuda/Launch.h: plain launchers that
// return cudaGetLastError(); GpuStage.cpp turns the status into an llvm::Error.
//
// `dtype` is the stage's compute type, that of the activations and of the parameters' compute
// copy (`void *` arguments); gradients of the parameters, losses and the tied sum stay fp32
// (`float *`). bf16 is read into fp32, computed in fp32 and rounded once when stored.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_CUDA_STAGEKERNELS_H
#define PIPEC_RUNTIME_CUDA_STAGEKERNELS_H

#include "kernels/DType.h"

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace pipec::runtime::cuda::launch {

using kernels::DType;

/// resid (n, c) = wte[inputs[r]] + wpe[begin + r % x]; rows r = (b, t) of the slice.
/// Vocab-parallel: wte holds the rows [vocabBegin, vocabBegin + localVocab) (a token outside
/// them adds 0), and wpe may be null (adds 0): tp rank 0 adds it, the tp reduction sums.
cudaError_t embeddingForward(DType dtype, void *resid, const int32_t *inputs, const void *wte,
                             const void *wpe, int n, int x, int begin, int c, int vocabBegin,
                             int localVocab, cudaStream_t stream);
/// A slice's EmbeddingGradPlan (runtime/cuda/EmbeddingGrad.h) in device memory, and scratch.
struct EmbeddingGradArgs {
  const int32_t *order = nullptr;  // n: the rows sorted by token, stably
  const int32_t *pieces = nullptr; // 3 per piece: begin, end (positions in order), slot or -1
  int numPieces = 0;
  const int32_t *merges = nullptr; // 3 per run of several pieces: token, first slot, slots
  int numMerges = 0;
  float *slots = nullptr; // a row of c floats per slot
};
/// dWte[inputs[r] - vocabBegin] += dEmb[r] for the rows whose token is in [vocabBegin,
/// vocabBegin + localVocab) (the plan's rows); dWpe[begin + r % x] += dEmb[r] for every row when
/// dWpe is not null. Each
/// token's rows are added in row order, in the plan's pieces (a multi-piece run's pieces then in
/// piece order), each position's rows in sequence order, with no atomics, so the gradients have
/// the same bits every run and on every tp rank.
cudaError_t embeddingBackward(DType dtype, float *dWte, float *dWpe, const void *dEmb,
                              const int32_t *inputs, const EmbeddingGradArgs &plan, int n, int x,
                              int begin, int c, int vocabBegin, int localVocab,
                              cudaStream_t stream);
/// resid (n, c) += branch (n, c) + bias (c) (bias may be null: none).
cudaError_t residualAdd(DType dtype, void *resid, const void *branch, const void *bias, int n,
                        int c, cudaStream_t stream);
/// qkv (n, cl + 2 kvl) rows (b, t) -> q (n, cl); k, v rows (begin + t, b) of the
/// position-major (T, B, kvl) buffers (kvl: the key/value heads' width).
cudaError_t splitQkv(DType dtype, void *q, void *k, void *v, const void *qkv, int n, int x,
                     int batch, int begin, int cl, int kvl, cudaStream_t stream);
/// The reverse: dQkv (n, cl + 2 kvl) = dq | dk rows | dv rows; dk and dv are fp32 (the
/// attention backward's accumulators), rounded to `dtype` here.
cudaError_t gatherQkv(DType dtype, void *dQkv, const void *dq, const float *dk, const float *dv,
                      int n, int x, int batch, int begin, int cl, int kvl, cudaStream_t stream);
/// a (n) = b (n) = a + b (fp32: the tied embedding's two gradient copies).
cudaError_t sumPair(float *a, float *b, size_t n, cudaStream_t stream);
/// The operands of sumInOrder, passed by value to the kernel.
inline constexpr int kMaxSumOperands = 32;
struct SumOperands {
  void *buffers[kMaxSumOperands];
};
/// Every buffers[b] (n) = ((buffers[0] + buffers[1]) + ...) + buffers[count - 1], added in
/// that order in fp32 (the in-process transport's member order: every member gets the same bits),
/// rounded once to `dtype`. count <= kMaxSumOperands (cudaErrorInvalidValue otherwise).
cudaError_t sumInOrder(DType dtype, const SumOperands &ops, int count, size_t n,
                       cudaStream_t stream);
/// *acc += sum of x (n), in fp64 and in a fixed order (one block).
cudaError_t accumulateSum(double *acc, const float *x, int n, cudaStream_t stream);

} // namespace pipec::runtime::cuda::launch

#endif // PIPEC_RUNTIME_CUDA_STAGEKERNELS_H
