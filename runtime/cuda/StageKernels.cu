//===- StageKernels.cu - glue kernels of a GPU pipeline stage -------------===//
//
// fp32 only, one thread per element (these are O(N C) next to the O(N C^2) matmuls). The
// embedding backward scatters with atomics, so its summation order (and last bits) differ from
// the CPU reference's; the tests compare within an fp32 tolerance.
//
//===----------------------------------------------------------------------===//
#include "runtime/cuda/StageKernels.h"

#include "kernels/cuda/Dialect.h"

#include <algorithm>

namespace pipec::runtime::cuda::launch {

namespace {

constexpr int kThreads = 256;

unsigned blocksFor(size_t n) { return unsigned((n + kThreads - 1) / kThreads); }

__global__ void embeddingForwardKernel(float *__restrict__ resid,
                                       const int32_t *__restrict__ inputs,
                                       const float *__restrict__ wte, const float *__restrict__ wpe,
                                       int n, int x, int begin, int c) {
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= size_t(n) * c)
    return;
  int r = int(i / c), k = int(i % c);
  int pos = begin + r % x;
  resid[i] = wte[size_t(inputs[r]) * c + k] + wpe[size_t(pos) * c + k];
}

__global__ void embeddingBackwardKernel(float *__restrict__ dWte, float *__restrict__ dWpe,
                                        const float *__restrict__ dEmb,
                                        const int32_t *__restrict__ inputs, int n, int x, int begin,
                                        int c) {
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= size_t(n) * c)
    return;
  int r = int(i / c), k = int(i % c);
  atomicAdd(&dWte[size_t(inputs[r]) * c + k], dEmb[i]);
  if (dWpe)
    atomicAdd(&dWpe[size_t(begin + r % x) * c + k], dEmb[i]);
}

__global__ void residualAddKernel(float *__restrict__ resid, const float *__restrict__ branch,
                                  const float *__restrict__ bias, int n, int c) {
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= size_t(n) * c)
    return;
  resid[i] += branch[i] + bias[i % c];
}

/// Row r = (b, t) of the slice is row (begin + t) * batch + b of the position-major K/V.
__device__ size_t kvRow(int r, int x, int batch, int begin) {
  return size_t(begin + r % x) * batch + r / x;
}

__global__ void splitQkvKernel(float *__restrict__ q, float *__restrict__ k, float *__restrict__ v,
                               const float *__restrict__ qkv, int n, int x, int batch, int begin,
                               int cl) {
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= size_t(n) * cl)
    return;
  int r = int(i / cl), j = int(i % cl);
  const float *row = qkv + size_t(r) * 3 * cl;
  size_t kv = kvRow(r, x, batch, begin) * cl + j;
  q[i] = row[j];
  k[kv] = row[cl + j];
  v[kv] = row[2 * cl + j];
}

__global__ void gatherQkvKernel(float *__restrict__ dQkv, const float *__restrict__ dq,
                                const float *__restrict__ dk, const float *__restrict__ dv, int n,
                                int x, int batch, int begin, int cl) {
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= size_t(n) * cl)
    return;
  int r = int(i / cl), j = int(i % cl);
  float *row = dQkv + size_t(r) * 3 * cl;
  size_t kv = kvRow(r, x, batch, begin) * cl + j;
  row[j] = dq[i];
  row[cl + j] = dk[kv];
  row[2 * cl + j] = dv[kv];
}

__global__ void sumPairKernel(float *__restrict__ a, float *__restrict__ b, size_t n) {
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n)
    return;
  float s = a[i] + b[i];
  a[i] = s;
  b[i] = s;
}

__global__ void sumInOrderKernel(SumOperands ops, int count, size_t n) {
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n)
    return;
  float s = ops.buffers[0][i];
  for (int b = 1; b < count; ++b)
    s += ops.buffers[b][i];
  for (int b = 0; b < count; ++b)
    ops.buffers[b][i] = s;
}

__global__ void accumulateSumKernel(double *__restrict__ acc, const float *__restrict__ x, int n) {
  __shared__ double partial[kThreads];
  double s = 0;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    s += double(x[i]);
  partial[threadIdx.x] = s;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (int(threadIdx.x) < stride)
      partial[threadIdx.x] += partial[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0)
    atomicAdd(acc, partial[0]);
}

} // namespace

cudaError_t embeddingForward(float *resid, const int32_t *inputs, const float *wte,
                             const float *wpe, int n, int x, int begin, int c,
                             cudaStream_t stream) {
  size_t total = size_t(n) * c;
  if (total == 0)
    return cudaSuccess;
  PIPEC_LAUNCH(blocksFor(total), kThreads, 0, stream, embeddingForwardKernel)
  (resid, inputs, wte, wpe, n, x, begin, c);
  return cudaGetLastError();
}

cudaError_t embeddingBackward(float *dWte, float *dWpe, const float *dEmb, const int32_t *inputs,
                              int n, int x, int begin, int c, cudaStream_t stream) {
  size_t total = size_t(n) * c;
  if (total == 0)
    return cudaSuccess;
  PIPEC_LAUNCH(blocksFor(total), kThreads, 0, stream, embeddingBackwardKernel)
  (dWte, dWpe, dEmb, inputs, n, x, begin, c);
  return cudaGetLastError();
}

cudaError_t residualAdd(float *resid, const float *branch, const float *bias, int n, int c,
                        cudaStream_t stream) {
  size_t total = size_t(n) * c;
  if (total == 0)
    return cudaSuccess;
  PIPEC_LAUNCH(blocksFor(total), kThreads, 0, stream, residualAddKernel)(resid, branch, bias, n, c);
  return cudaGetLastError();
}

cudaError_t splitQkv(float *q, float *k, float *v, const float *qkv, int n, int x, int batch,
                     int begin, int cl, cudaStream_t stream) {
  size_t total = size_t(n) * cl;
  if (total == 0)
    return cudaSuccess;
  PIPEC_LAUNCH(blocksFor(total), kThreads, 0, stream, splitQkvKernel)
  (q, k, v, qkv, n, x, batch, begin, cl);
  return cudaGetLastError();
}

cudaError_t gatherQkv(float *dQkv, const float *dq, const float *dk, const float *dv, int n, int x,
                      int batch, int begin, int cl, cudaStream_t stream) {
  size_t total = size_t(n) * cl;
  if (total == 0)
    return cudaSuccess;
  PIPEC_LAUNCH(blocksFor(total), kThreads, 0, stream, gatherQkvKernel)
  (dQkv, dq, dk, dv, n, x, batch, begin, cl);
  return cudaGetLastError();
}

cudaError_t sumPair(float *a, float *b, size_t n, cudaStream_t stream) {
  if (n == 0)
    return cudaSuccess;
  PIPEC_LAUNCH(blocksFor(n), kThreads, 0, stream, sumPairKernel)(a, b, n);
  return cudaGetLastError();
}

cudaError_t sumInOrder(const SumOperands &ops, int count, size_t n, cudaStream_t stream) {
  if (n == 0 || count <= 1)
    return cudaSuccess;
  if (count > kMaxSumOperands)
    return cudaErrorInvalidValue;
  PIPEC_LAUNCH(blocksFor(n), kThreads, 0, stream, sumInOrderKernel)(ops, count, n);
  return cudaGetLastError();
}

cudaError_t accumulateSum(double *acc, const float *x, int n, cudaStream_t stream) {
  if (n == 0)
    return cudaSuccess;
  // A grid-stride loop: at most 64 blocks, so at most 64 atomics per slice.
  unsigned blocks = std::min(blocksFor(size_t(n)), 64u);
  PIPEC_LAUNCH(blocks, kThreads, 0, stream, accumulateSumKernel)(acc, x, n);
  return cudaGetLastError();
}

} // namespace pipec::runtime::cuda::launch
