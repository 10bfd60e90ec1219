//===- StageKernels.cu - glue kernels of a GPU pipeline stage -------------===//
//
// One thread per element (these are O(N C) next to the O(N C^2) matmuls), templated on the
// element type T (float or bf16: loads widen, arithmetic is fp32, stores round once). No kernel
// here adds floating-point values atomically: every sum runs in an order fixed by its inputs,
// so a step's gradients have the same bits every run, and the tensors every tp rank holds whole
// (wpe) get the same gradients on every rank. The embedding backward sums a token's rows in row
// order, in pieces (the host's plan, runtime/cuda/EmbeddingGrad.h), which differs from the CPU
// reference's order; the tests compare within a tolerance.
//
//===----------------------------------------------------------------------===//
#include "runtime/cuda/StageKernels.h"

#include "kernels/cuda/Device.cuh"

#include <type_traits>

namespace pipec::runtime::cuda::launch {

namespace {

using kernels::cuda::device::fromFloat;
using kernels::cuda::device::toFloat;

constexpr int kThreads = 256;

unsigned blocksFor(size_t n) { return unsigned((n + kThreads - 1) / kThreads); }

/// Runs `launch(T *, blocks)` with T the compute type, which queues a kernel of one thread per
/// element over `total` elements on `blocks` blocks of kThreads; nothing when there are none.
template <typename Launch> cudaError_t launchPerElement(DType dtype, size_t total, Launch launch) {
  if (total == 0)
    return cudaSuccess;
  PIPEC_DISPATCH_DTYPE(dtype, [&](auto *type) { launch(type, blocksFor(total)); });
  return cudaGetLastError();
}

template <typename T>
__global__ void embeddingForwardKernel(T *__restrict__ resid, const int32_t *__restrict__ inputs,
                                       const T *__restrict__ wte, const T *__restrict__ wpe, int n,
                                       int x, int begin, int c, int vocabBegin, int localVocab) {
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= size_t(n) * c)
    return;
  int r = int(i / c), k = int(i % c);
  int pos = begin + r % x, local = inputs[r] - vocabBegin;
  float sum = local >= 0 && local < localVocab ? toFloat(wte[size_t(local) * c + k]) : 0.0f;
  if (wpe)
    sum += toFloat(wpe[size_t(pos) * c + k]);
  resid[i] = fromFloat<T>(sum);
}

// One thread per (piece, channel k) of the plan (EmbeddingGrad.h): the piece's rows in `order`'s
// order, into the token's row of dWte when the piece is the token's whole run, else into the
// piece's slot.
template <typename T>
__global__ void
tokenPieceKernel(float *__restrict__ dWte, float *__restrict__ slots, const T *__restrict__ dEmb,
                 const int32_t *__restrict__ inputs, const int32_t *__restrict__ order,
                 const int32_t *__restrict__ pieces, int numPieces, int c, int vocabBegin) {
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= size_t(numPieces) * c)
    return;
  const int p = int(i / c), k = int(i % c);
  const int begin = pieces[3 * p], end = pieces[3 * p + 1], slot = pieces[3 * p + 2];
  float g = 0.0f;
  for (int q = begin; q < end; ++q)
    g += toFloat(dEmb[size_t(order[q]) * c + k]);
  if (slot < 0)
    dWte[size_t(inputs[order[begin]] - vocabBegin) * c + k] += g;
  else
    slots[size_t(slot) * c + k] = g;
}

// One thread per (run of several pieces, channel k): its slots in piece order into dWte.
__global__ void tokenMergeKernel(float *__restrict__ dWte, const float *__restrict__ slots,
                                 const int32_t *__restrict__ merges, int numMerges, int c,
                                 int vocabBegin) {
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= size_t(numMerges) * c)
    return;
  const int m = int(i / c), k = int(i % c);
  const int token = merges[3 * m], first = merges[3 * m + 1], count = merges[3 * m + 2];
  float g = 0.0f;
  for (int s = first; s < first + count; ++s)
    g += slots[size_t(s) * c + k];
  dWte[size_t(token - vocabBegin) * c + k] += g;
}

// dWpe[begin + t] += the rows (b, t) of every sequence b, added in b order: one thread per (t, k).
template <typename T>
__global__ void positionBackwardKernel(float *__restrict__ dWpe, const T *__restrict__ dEmb,
                                       int batch, int x, int begin, int c) {
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= size_t(x) * c)
    return;
  const int t = int(i / c), k = int(i % c);
  float g = 0.0f;
  for (int b = 0; b < batch; ++b)
    g += toFloat(dEmb[(size_t(b) * x + t) * c + k]);
  dWpe[size_t(begin + t) * c + k] += g;
}

template <typename T>
__global__ void residualAddKernel(T *__restrict__ resid, const T *__restrict__ branch,
                                  const T *__restrict__ bias, int n, int c) {
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= size_t(n) * c)
    return;
  resid[i] = bias ? fromFloat<T>(toFloat(resid[i]) + (toFloat(branch[i]) + toFloat(bias[i % c])))
                  : fromFloat<T>(toFloat(resid[i]) + toFloat(branch[i]));
}

/// Row r = (b, t) of the slice is row (begin + t) * batch + b of the position-major K/V.
__device__ size_t kvRow(int r, int x, int batch, int begin) {
  return size_t(begin + r % x) * batch + r / x;
}

template <typename T>
__global__ void splitQkvKernel(T *__restrict__ q, T *__restrict__ k, T *__restrict__ v,
                               const T *__restrict__ qkv, int n, int x, int batch, int begin,
                               int cl, int kvl) {
  const int cols = cl + 2 * kvl;
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= size_t(n) * cols)
    return;
  int r = int(i / cols), j = int(i % cols);
  const T value = qkv[i];
  if (j < cl)
    q[size_t(r) * cl + j] = value;
  else if (j < cl + kvl)
    k[kvRow(r, x, batch, begin) * kvl + (j - cl)] = value;
  else
    v[kvRow(r, x, batch, begin) * kvl + (j - cl - kvl)] = value;
}

template <typename T>
__global__ void gatherQkvKernel(T *__restrict__ dQkv, const T *__restrict__ dq,
                                const float *__restrict__ dk, const float *__restrict__ dv, int n,
                                int x, int batch, int begin, int cl, int kvl) {
  const int cols = cl + 2 * kvl;
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= size_t(n) * cols)
    return;
  int r = int(i / cols), j = int(i % cols);
  if (j < cl)
    dQkv[i] = dq[size_t(r) * cl + j];
  else if (j < cl + kvl)
    dQkv[i] = fromFloat<T>(dk[kvRow(r, x, batch, begin) * kvl + (j - cl)]);
  else
    dQkv[i] = fromFloat<T>(dv[kvRow(r, x, batch, begin) * kvl + (j - cl - kvl)]);
}

__global__ void sumPairKernel(float *__restrict__ a, float *__restrict__ b, size_t n) {
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n)
    return;
  float s = a[i] + b[i];
  a[i] = s;
  b[i] = s;
}

template <typename T> __global__ void sumInOrderKernel(SumOperands ops, int count, size_t n) {
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n)
    return;
  float s = toFloat(static_cast<const T *>(ops.buffers[0])[i]);
  for (int b = 1; b < count; ++b)
    s += toFloat(static_cast<const T *>(ops.buffers[b])[i]);
  const T rounded = fromFloat<T>(s);
  for (int b = 0; b < count; ++b)
    static_cast<T *>(ops.buffers[b])[i] = rounded;
}

// One block: each thread sums a strided share of x, then the block adds the shares pairwise in a
// fixed tree, so the total has the same bits every launch.
__global__ void accumulateSumKernel(double *__restrict__ acc, const float *__restrict__ x, int n) {
  __shared__ double partial[kThreads];
  double s = 0;
  for (int i = threadIdx.x; i < n; i += kThreads)
    s += double(x[i]);
  partial[threadIdx.x] = s;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (int(threadIdx.x) < stride)
      partial[threadIdx.x] += partial[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0)
    *acc += partial[0];
}

} // namespace

cudaError_t embeddingForward(DType dtype, void *resid, const int32_t *inputs, const void *wte,
                             const void *wpe, int n, int x, int begin, int c, int vocabBegin,
                             int localVocab, cudaStream_t stream) {
  return launchPerElement(dtype, size_t(n) * c, [&](auto *type, unsigned blocks) {
    using T = std::remove_pointer_t<decltype(type)>;
    PIPEC_LAUNCH(blocks, kThreads, 0, stream, embeddingForwardKernel<T>)
    (static_cast<T *>(resid), inputs, static_cast<const T *>(wte), static_cast<const T *>(wpe), n,
     x, begin, c, vocabBegin, localVocab);
  });
}

cudaError_t embeddingBackward(DType dtype, float *dWte, float *dWpe, const void *dEmb,
                              const int32_t *inputs, const EmbeddingGradArgs &plan, int n, int x,
                              int begin, int c, int vocabBegin, int localVocab,
                              cudaStream_t stream) {
  (void)localVocab; // the plan holds only the rows of the shard's tokens
  if (size_t(n) * c == 0)
    return cudaSuccess;
  if (plan.numMerges > 0 && !plan.slots)
    return cudaErrorInvalidValue;
  PIPEC_DISPATCH_DTYPE(dtype, [&](auto *type) {
    using T = std::remove_pointer_t<decltype(type)>;
    const T *d = static_cast<const T *>(dEmb);
    if (plan.numPieces > 0)
      PIPEC_LAUNCH(blocksFor(size_t(plan.numPieces) * c), kThreads, 0, stream, tokenPieceKernel<T>)
    (dWte, plan.slots, d, inputs, plan.order, plan.pieces, plan.numPieces, c, vocabBegin);
    if (plan.numMerges > 0)
      PIPEC_LAUNCH(blocksFor(size_t(plan.numMerges) * c), kThreads, 0, stream, tokenMergeKernel)
    (dWte, plan.slots, plan.merges, plan.numMerges, c, vocabBegin);
    if (dWpe)
      PIPEC_LAUNCH(blocksFor(size_t(x) * c), kThreads, 0, stream, positionBackwardKernel<T>)
    (dWpe, d, n / x, x, begin, c);
  });
  return cudaGetLastError();
}

cudaError_t residualAdd(DType dtype, void *resid, const void *branch, const void *bias, int n,
                        int c, cudaStream_t stream) {
  return launchPerElement(dtype, size_t(n) * c, [&](auto *type, unsigned blocks) {
    using T = std::remove_pointer_t<decltype(type)>;
    PIPEC_LAUNCH(blocks, kThreads, 0, stream, residualAddKernel<T>)
    (static_cast<T *>(resid), static_cast<const T *>(branch), static_cast<const T *>(bias), n, c);
  });
}

cudaError_t splitQkv(DType dtype, void *q, void *k, void *v, const void *qkv, int n, int x,
                     int batch, int begin, int cl, int kvl, cudaStream_t stream) {
  return launchPerElement(dtype, size_t(n) * size_t(cl + 2 * kvl),
                          [&](auto *type, unsigned blocks) {
                            using T = std::remove_pointer_t<decltype(type)>;
                            PIPEC_LAUNCH(blocks, kThreads, 0, stream, splitQkvKernel<T>)
                            (static_cast<T *>(q), static_cast<T *>(k), static_cast<T *>(v),
                             static_cast<const T *>(qkv), n, x, batch, begin, cl, kvl);
                          });
}

cudaError_t gatherQkv(DType dtype, void *dQkv, const void *dq, const float *dk, const float *dv,
                      int n, int x, int batch, int begin, int cl, int kvl, cudaStream_t stream) {
  return launchPerElement(
      dtype, size_t(n) * size_t(cl + 2 * kvl), [&](auto *type, unsigned blocks) {
        using T = std::remove_pointer_t<decltype(type)>;
        PIPEC_LAUNCH(blocks, kThreads, 0, stream, gatherQkvKernel<T>)
        (static_cast<T *>(dQkv), static_cast<const T *>(dq), dk, dv, n, x, batch, begin, cl, kvl);
      });
}

cudaError_t sumPair(float *a, float *b, size_t n, cudaStream_t stream) {
  if (n == 0)
    return cudaSuccess;
  PIPEC_LAUNCH(blocksFor(n), kThreads, 0, stream, sumPairKernel)(a, b, n);
  return cudaGetLastError();
}

cudaError_t sumInOrder(DType dtype, const SumOperands &ops, int count, size_t n,
                       cudaStream_t stream) {
  if (n == 0 || count <= 1)
    return cudaSuccess;
  if (count > kMaxSumOperands)
    return cudaErrorInvalidValue;
  PIPEC_DISPATCH_DTYPE(dtype, [&](auto *type) {
    using T = std::remove_pointer_t<decltype(type)>;
    PIPEC_LAUNCH(blocksFor(n), kThreads, 0, stream, sumInOrderKernel<T>)(ops, count, n);
  });
  return cudaGetLastError();
}

cudaError_t accumulateSum(double *acc, const float *x, int n, cudaStream_t stream) {
  if (n == 0)
    return cudaSuccess;
  // One block: the rows of a slice are a few thousand at most.
  PIPEC_LAUNCH(1, kThreads, 0, stream, accumulateSumKernel)(acc, x, n);
  return cudaGetLastError();
}

} // namespace pipec::runtime::cuda::launch
