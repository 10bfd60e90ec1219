//===- CrossEntropy.cu - softmax cross entropy over the vocabulary ---------===//
//
// One block per row of logits (n, V): each thread keeps a running (max, sum of exp) over a
// strided share of the row — one pass, the online-softmax merge — then the block merges the
// pairs through shared memory. The forward keeps only the row's log-sum-exp (n), not the (n, V)
// probabilities; the backward recomputes softmax from it, and may overwrite the logits in place
// (so that the LM head never holds two vocabulary-wide buffers). The CPU reference sums the
// exponentials in double; here the sum is fp32 over ~V/256 terms per thread, then a tree.
// A target outside [0, V) makes the whole-vocabulary kernel's row loss NaN (the CPU asserts; the
// data sources reject such ids).
// Vocab-parallel (tp > 1): a rank holds the logits of vocabulary columns [vocabBegin, + V);
// ShardStats writes the row's (max, sum) and its target's logit where this rank has it,
// zeros elsewhere, so that the tp all-reduce's sum gathers every shard's pair, and
// combineKernel merges the pairs into the loss. The backward takes vocabBegin (0 without tp).
//
//===----------------------------------------------------------------------===//
#include "kernels/cuda/Device.cuh"
#include "kernels/cuda/Launch.h"

#include <type_traits>

namespace pipec::kernels::cuda {
namespace {

using namespace device;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / kWarp;
static_assert(kThreads % kWarp == 0 && kWarps <= kWarp, "one warp merges the warps' partials");

struct MaxSum {
  float max, sum;
};

__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.max, b.max);
  if (m == -INFINITY)
    return {m, 0.0f};
  return {m, a.sum * expf(a.max - m) + b.sum * expf(b.max - m)};
}

__device__ __forceinline__ MaxSum warpMerge(MaxSum x) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    MaxSum other{__shfl_xor_sync(kFullMask, x.max, offset),
                 __shfl_xor_sync(kFullMask, x.sum, offset)};
    x = merge(x, other);
  }
  return x;
}

// The (max, sum of exp) of the row l (V) over the block's threads; valid in thread 0.
template <typename T> __device__ MaxSum rowMaxSum(const T *__restrict__ l, int v) {
  __shared__ MaxSum partial[kWarps];
  MaxSum acc{-INFINITY, 0.0f};
  for (int c = threadIdx.x; c < v; c += kThreads)
    acc = merge(acc, MaxSum{toFloat(l[c]), 1.0f});
  acc = warpMerge(acc);
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  if (lane == 0)
    partial[warp] = acc;
  __syncthreads();
  if (warp == 0)
    acc = warpMerge(lane < kWarps ? partial[lane] : MaxSum{-INFINITY, 0.0f});
  return acc;
}

// Block `row` of a grid of n blocks takes row `row` of logits (n, V): its (max, sum of exp),
// then thread 0 calls finish(row, the row, that pair).
template <typename T, typename Finish>
__global__ void __launch_bounds__(kThreads)
    rowKernel(const T *__restrict__ logits, int v, Finish finish) {
  const size_t row = blockIdx.x;
  const T *l = logits + row * v;
  const MaxSum acc = rowMaxSum(l, v);
  if (threadIdx.x == 0)
    finish(row, l, acc);
}

// The whole vocabulary's rowLoss and lse (n).
struct RowLoss {
  float *rowLoss, *lse;
  const int32_t *targets;
  int v;
  float scale;
  template <typename T> __device__ void operator()(size_t row, const T *l, MaxSum acc) const {
    const float rowLse = acc.max + logf(acc.sum);
    const int32_t target = targets[row];
    lse[row] = rowLse;
    rowLoss[row] = target >= 0 && target < v ? (rowLse - toFloat(l[target])) * scale : NAN;
  }
};

// A shard's stats (2 parts + 1, n).
struct ShardStats {
  float *stats;
  const int32_t *targets;
  int n, v, vocabBegin, part, parts;
  template <typename T> __device__ void operator()(size_t row, const T *l, MaxSum acc) const {
    for (int p = 0; p < parts; ++p) {
      stats[size_t(2 * p) * n + row] = p == part ? acc.max : 0.0f;
      stats[size_t(2 * p + 1) * n + row] = p == part ? acc.sum : 0.0f;
    }
    const int32_t local = targets[row] - vocabBegin;
    stats[size_t(2 * parts) * n + row] = local >= 0 && local < v ? toFloat(l[local]) : 0.0f;
  }
};

template <typename Finish>
cudaError_t launchRowKernel(DType dtype, const void *logits, int n, int v, Finish finish,
                            cudaStream_t stream) {
  if (n == 0)
    return cudaSuccess;
  return PIPEC_DISPATCH_DTYPE(dtype, [&](auto *tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    PIPEC_LAUNCH(unsigned(n), kThreads, 0, stream, rowKernel<T, Finish>)
    (static_cast<const T *>(logits), v, finish);
    return cudaGetLastError();
  });
}

// rowLoss, lse (n) from the summed stats of `parts` shards; one thread per row.
__global__ void combineKernel(float *__restrict__ rowLoss, float *__restrict__ lse,
                              const float *__restrict__ stats, int n, int parts, float scale) {
  const size_t row = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= size_t(n))
    return;
  MaxSum acc{-INFINITY, 0.0f};
  for (int p = 0; p < parts; ++p)
    acc = merge(acc, MaxSum{stats[size_t(2 * p) * n + row], stats[size_t(2 * p + 1) * n + row]});
  const float rowLse = acc.max + logf(acc.sum);
  lse[row] = rowLse;
  rowLoss[row] = (rowLse - stats[size_t(2 * parts) * n + row]) * scale;
}

// dLogits (n, V) = (exp(logits - lse) - onehot(target - vocabBegin)) * scale; may alias logits.
template <typename T>
__global__ void backwardKernel(T *dLogits, const T *logits, const float *__restrict__ lse,
                               const int32_t *__restrict__ targets, int v, int vocabBegin,
                               float scale) {
  const size_t row = blockIdx.x;
  const float rowLse = lse[row];
  const int32_t target = targets[row] - vocabBegin;
  for (int c = threadIdx.x; c < v; c += blockDim.x) {
    const float p = expf(toFloat(logits[row * v + c]) - rowLse);
    dLogits[row * v + c] = fromFloat<T>((p - (c == target ? 1.0f : 0.0f)) * scale);
  }
}

} // namespace

namespace launch {

cudaError_t crossEntropyForward(DType dtype, float *rowLoss, float *lse, const void *logits,
                                const int32_t *targets, int n, int v, float scale,
                                cudaStream_t stream) {
  return launchRowKernel(dtype, logits, n, v, RowLoss{rowLoss, lse, targets, v, scale}, stream);
}

cudaError_t crossEntropyShardStats(DType dtype, float *stats, const void *logits,
                                   const int32_t *targets, int n, int v, int vocabBegin, int part,
                                   int parts, cudaStream_t stream) {
  return launchRowKernel(dtype, logits, n, v,
                         ShardStats{stats, targets, n, v, vocabBegin, part, parts}, stream);
}

cudaError_t crossEntropyCombine(float *rowLoss, float *lse, const float *stats, int n, int parts,
                                float scale, cudaStream_t stream) {
  if (n == 0)
    return cudaSuccess;
  PIPEC_LAUNCH(unsigned((n + kThreads - 1) / kThreads), kThreads, 0, stream, combineKernel)
  (rowLoss, lse, stats, n, parts, scale);
  return cudaGetLastError();
}

cudaError_t crossEntropyBackward(DType dtype, void *dLogits, const void *logits, const float *lse,
                                 const int32_t *targets, int n, int v, int vocabBegin, float scale,
                                 cudaStream_t stream) {
  if (n == 0)
    return cudaSuccess;
  return PIPEC_DISPATCH_DTYPE(dtype, [&](auto *tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    PIPEC_LAUNCH(unsigned(n), kThreads, 0, stream, backwardKernel<T>)
    (static_cast<T *>(dLogits), static_cast<const T *>(logits), lse, targets, v, vocabBegin, scale);
    return cudaGetLastError();
  });
}

} // namespace launch
} // namespace pipec::kernels::cuda
