//===- Layernorm.cu - layernorm forward, input and weight gradients --------===//
//
// One warp per row (n rows of c channels): the row's reductions are warp shuffles, with no
// shared memory and no block-wide synchronisation, and a row of a few thousand channels stays
// in L1 between the passes. The forward computes mean and variance in two passes, as the CPU
// reference does (no E[x^2] - E[x]^2 cancellation). The weight gradient is a column sum over
// rows in an order fixed by the launch shape (Device.cuh's columnSums, no atomics): every tp
// rank holds ln.w and ln.b whole, and their copies stay equal only if every rank's gradients
// have the same bits.
//
//===----------------------------------------------------------------------===//
#include "kernels/cuda/Device.cuh"
#include "kernels/cuda/Launch.h"

#include <type_traits>

namespace pipec::kernels::cuda {
namespace {

using namespace device;

constexpr float kEps = 1e-5f;

// out (n, c) = (in - mean) * rstd * w + b; mean, rstd (n).
template <typename T>
__global__ void forwardKernel(T *__restrict__ out, float *__restrict__ mean,
                              float *__restrict__ rstd, const T *__restrict__ in,
                              const T *__restrict__ w, const T *__restrict__ b, int n, int c) {
  const int row = warpRow(), lane = threadIdx.x % kWarp;
  if (row >= n)
    return;
  const T *x = in + size_t(row) * c;
  const float m = rowSum(x, c, [](float v) { return v; }) / c;
  const float var = rowSum(x, c, [&](float v) {
    const float d = v - m;
    return d * d;
  });
  const float s = 1.0f / sqrtf(var / c + kEps);
  T *y = out + size_t(row) * c;
  for (int k = lane; k < c; k += kWarp)
    y[k] = fromFloat<T>((toFloat(x[k]) - m) * s * toFloat(w[k]) + toFloat(b[k]));
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = s;
  }
}

// dIn (n, c) += rstd * (dnorm - mean(dnorm) - xhat * mean(dnorm * xhat)), dnorm = dOut * w.
template <typename T>
__global__ void backwardInputKernel(T *__restrict__ dIn, const T *__restrict__ dOut,
                                    const T *__restrict__ in, const float *__restrict__ mean,
                                    const float *__restrict__ rstd, const T *__restrict__ w, int n,
                                    int c) {
  const int row = warpRow(), lane = threadIdx.x % kWarp;
  if (row >= n)
    return;
  const T *x = in + size_t(row) * c;
  const T *dy = dOut + size_t(row) * c;
  const float m = mean[row], s = rstd[row];
  float dnormSum = 0.0f, dnormXhatSum = 0.0f;
  for (int k = lane; k < c; k += kWarp) {
    float xhat = (toFloat(x[k]) - m) * s;
    float dnorm = toFloat(dy[k]) * toFloat(w[k]);
    dnormSum += dnorm;
    dnormXhatSum += dnorm * xhat;
  }
  const float dnormMean = warpSum(dnormSum) / c;
  const float dnormXhatMean = warpSum(dnormXhatSum) / c;
  T *dx = dIn + size_t(row) * c;
  for (int k = lane; k < c; k += kWarp) {
    float xhat = (toFloat(x[k]) - m) * s;
    float dnorm = toFloat(dy[k]) * toFloat(w[k]);
    dx[k] = fromFloat<T>(toFloat(dx[k]) + s * (dnorm - dnormMean - xhat * dnormXhatMean));
  }
}

// dW (c) += sum_r dOut * xhat; dB (c) += sum_r dOut: column sums in a fixed order (columnSums).
template <typename T>
__global__ void __launch_bounds__(kColumnSumThreads)
    backwardWeightKernel(ColumnSumOutputs out, float *__restrict__ partials,
                         const T *__restrict__ dOut, const T *__restrict__ in,
                         const float *__restrict__ mean, const float *__restrict__ rstd, int n,
                         int c) {
  float sums[2];
  auto term = [&](int r, int col, float(&acc)[2]) {
    const float dy = toFloat(dOut[size_t(r) * c + col]);
    acc[0] += dy * ((toFloat(in[size_t(r) * c + col]) - mean[r]) * rstd[r]);
    acc[1] += dy;
  };
  if (columnSums(n, c, term, sums))
    storeColumnSums(out, partials, sums, c);
}

} // namespace

namespace launch {

cudaError_t layernormForward(DType dtype, void *out, float *mean, float *rstd, const void *in,
                             const void *w, const void *b, int n, int c, cudaStream_t stream) {
  if (n == 0 || c == 0)
    return cudaSuccess;
  return PIPEC_DISPATCH_DTYPE(dtype, [&](auto *tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    PIPEC_LAUNCH(ceilDiv(n, kRowWarps), kRowThreads, 0, stream, forwardKernel<T>)
    (static_cast<T *>(out), mean, rstd, static_cast<const T *>(in), static_cast<const T *>(w),
     static_cast<const T *>(b), n, c);
    return cudaGetLastError();
  });
}

cudaError_t layernormBackwardInputAccumulate(DType dtype, void *dIn, const void *dOut,
                                             const void *in, const float *mean, const float *rstd,
                                             const void *w, int n, int c, cudaStream_t stream) {
  if (n == 0 || c == 0)
    return cudaSuccess;
  return PIPEC_DISPATCH_DTYPE(dtype, [&](auto *tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    PIPEC_LAUNCH(ceilDiv(n, kRowWarps), kRowThreads, 0, stream, backwardInputKernel<T>)
    (static_cast<T *>(dIn), static_cast<const T *>(dOut), static_cast<const T *>(in), mean, rstd,
     static_cast<const T *>(w), n, c);
    return cudaGetLastError();
  });
}

cudaError_t layernormBackwardWeight(DType dtype, float *dW, float *dB, const void *dOut,
                                    const void *in, const float *mean, const float *rstd, int n,
                                    int c, float *partials, cudaStream_t stream) {
  const ColumnSumOutputs out{{dW, dB}};
  return launchColumnSums<2>(dtype, out, partials, n, c, stream, [&](auto *tag, dim3 grid) {
    using T = std::remove_pointer_t<decltype(tag)>;
    PIPEC_LAUNCH(grid, kColumnSumThreads, 0, stream, backwardWeightKernel<T>)
    (out, partials, static_cast<const T *>(dOut), static_cast<const T *>(in), mean, rstd, n, c);
  });
}

} // namespace launch
} // namespace pipec::kernels::cuda
