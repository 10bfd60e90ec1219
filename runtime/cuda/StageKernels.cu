//===- StageKernels.cu - glue kernels of a GPU pipeline stage -------------===//
//
// One thread per element (these are O(N C) next to the O(N C^2) matmuls), templated on the
// element type T (float or bf16: loads widen, arithmetic is fp32, stores round once). The
// embedding backward scatters into fp32 gradients with atomics, so its summation order (and last
// bits) differ from the CPU reference's; the tests compare within a tolerance.
//
//===----------------------------------------------------------------------===//
#include "runtime/cuda/StageKernels.h"

#include "kernels/cuda/Device.cuh"

#include <algorithm>
#include <type_traits>

namespace pipec::runtime::cuda::launch {

namespace {

using kernels::cuda::device::fromFloat;
using kernels::cuda::device::toFloat;

constexpr int kThreads = 256;

unsigned blocksFor(size_t n) { return unsigned((n + kThreads - 1) / kThreads); }

template <typename T>
__global__ void embeddingForwardKernel(T *__restrict__ resid, const int32_t *__restrict__ inputs,
                                       const T *__restrict__ wte, const T *__restrict__ wpe, int n,
                                       int x, int begin, int c) {
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= size_t(n) * c)
    return;
  int r = int(i / c), k = int(i % c);
  int pos = begin + r % x;
  resid[i] =
      fromFloat<T>(toFloat(wte[size_t(inputs[r]) * c + k]) + toFloat(wpe[size_t(pos) * c + k]));
}

template <typename T>
__global__ void embeddingBackwardKernel(float *__restrict__ dWte, float *__restrict__ dWpe,
                                        const T *__restrict__ dEmb,
                                        const int32_t *__restrict__ inputs, int n, int x, int begin,
                                        int c) {
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= size_t(n) * c)
    return;
  int r = int(i / c), k = int(i % c);
  const float g = toFloat(dEmb[i]);
  atomicAdd(&dWte[size_t(inputs[r]) * c + k], g);
  if (dWpe)
    atomicAdd(&dWpe[size_t(begin + r % x) * c + k], g);
}

template <typename T>
__global__ void residualAddKernel(T *__restrict__ resid, const T *__restrict__ branch,
                                  const T *__restrict__ bias, int n, int c) {
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= size_t(n) * c)
    return;
  resid[i] = fromFloat<T>(toFloat(resid[i]) + (toFloat(branch[i]) + toFloat(bias[i % c])));
}

/// Row r = (b, t) of the slice is row (begin + t) * batch + b of the position-major K/V.
__device__ size_t kvRow(int r, int x, int batch, int begin) {
  return size_t(begin + r % x) * batch + r / x;
}

template <typename T>
__global__ void splitQkvKernel(T *__restrict__ q, T *__restrict__ k, T *__restrict__ v,
                               const T *__restrict__ qkv, int n, int x, int batch, int begin,
                               int cl) {
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= size_t(n) * cl)
    return;
  int r = int(i / cl), j = int(i % cl);
  const T *row = qkv + size_t(r) * 3 * cl;
  size_t kv = kvRow(r, x, batch, begin) * cl + j;
  q[i] = row[j];
  k[kv] = row[cl + j];
  v[kv] = row[2 * cl + j];
}

template <typename T>
__global__ void gatherQkvKernel(T *__restrict__ dQkv, const T *__restrict__ dq,
                                const float *__restrict__ dk, const float *__restrict__ dv, int n,
                                int x, int batch, int begin, int cl) {
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= size_t(n) * cl)
    return;
  int r = int(i / cl), j = int(i % cl);
  T *row = dQkv + size_t(r) * 3 * cl;
  size_t kv = kvRow(r, x, batch, begin) * cl + j;
  row[j] = dq[i];
  row[cl + j] = fromFloat<T>(dk[kv]);
  row[2 * cl + j] = fromFloat<T>(dv[kv]);
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

cudaError_t embeddingForward(DType dtype, void *resid, const int32_t *inputs, const void *wte,
                             const void *wpe, int n, int x, int begin, int c, cudaStream_t stream) {
  size_t total = size_t(n) * c;
  if (total == 0)
    return cudaSuccess;
  PIPEC_DISPATCH_DTYPE(dtype, [&](auto *type) {
    using T = std::remove_pointer_t<decltype(type)>;
    PIPEC_LAUNCH(blocksFor(total), kThreads, 0, stream, embeddingForwardKernel<T>)
    (static_cast<T *>(resid), inputs, static_cast<const T *>(wte), static_cast<const T *>(wpe), n,
     x, begin, c);
  });
  return cudaGetLastError();
}

cudaError_t embeddingBackward(DType dtype, float *dWte, float *dWpe, const void *dEmb,
                              const int32_t *inputs, int n, int x, int begin, int c,
                              cudaStream_t stream) {
  size_t total = size_t(n) * c;
  if (total == 0)
    return cudaSuccess;
  PIPEC_DISPATCH_DTYPE(dtype, [&](auto *type) {
    using T = std::remove_pointer_t<decltype(type)>;
    PIPEC_LAUNCH(blocksFor(total), kThreads, 0, stream, embeddingBackwardKernel<T>)
    (dWte, dWpe, static_cast<const T *>(dEmb), inputs, n, x, begin, c);
  });
  return cudaGetLastError();
}

cudaError_t residualAdd(DType dtype, void *resid, const void *branch, const void *bias, int n,
                        int c, cudaStream_t stream) {
  size_t total = size_t(n) * c;
  if (total == 0)
    return cudaSuccess;
  PIPEC_DISPATCH_DTYPE(dtype, [&](auto *type) {
    using T = std::remove_pointer_t<decltype(type)>;
    PIPEC_LAUNCH(blocksFor(total), kThreads, 0, stream, residualAddKernel<T>)
    (static_cast<T *>(resid), static_cast<const T *>(branch), static_cast<const T *>(bias), n, c);
  });
  return cudaGetLastError();
}

cudaError_t splitQkv(DType dtype, void *q, void *k, void *v, const void *qkv, int n, int x,
                     int batch, int begin, int cl, cudaStream_t stream) {
  size_t total = size_t(n) * cl;
  if (total == 0)
    return cudaSuccess;
  PIPEC_DISPATCH_DTYPE(dtype, [&](auto *type) {
    using T = std::remove_pointer_t<decltype(type)>;
    PIPEC_LAUNCH(blocksFor(total), kThreads, 0, stream, splitQkvKernel<T>)
    (static_cast<T *>(q), static_cast<T *>(k), static_cast<T *>(v), static_cast<const T *>(qkv), n,
     x, batch, begin, cl);
  });
  return cudaGetLastError();
}

cudaError_t gatherQkv(DType dtype, void *dQkv, const void *dq, const float *dk, const float *dv,
                      int n, int x, int batch, int begin, int cl, cudaStream_t stream) {
  size_t total = size_t(n) * cl;
  if (total == 0)
    return cudaSuccess;
  PIPEC_DISPATCH_DTYPE(dtype, [&](auto *type) {
    using T = std::remove_pointer_t<decltype(type)>;
    PIPEC_LAUNCH(blocksFor(total), kThreads, 0, stream, gatherQkvKernel<T>)
    (static_cast<T *>(dQkv), static_cast<const T *>(dq), dk, dv, n, x, batch, begin, cl);
  });
  return cudaGetLastError();
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
  // A grid-stride loop: at most 64 blocks, so at most 64 atomics per slice.
  unsigned blocks = std::min(blocksFor(size_t(n)), 64u);
  PIPEC_LAUNCH(blocks, kThreads, 0, stream, accumulateSumKernel)(acc, x, n);
  return cudaGetLastError();
}

} // namespace pipec::runtime::cuda::launch
