//===- Llama.cu - RMSNorm, SwiGLU and rotary embeddings --------------------===//
//
// The memory-bound ops of a Llama-style block, on fp32 or bf16 storage with fp32 arithmetic,
// formula for formula those of kernels/cpu/LlamaOps.cpp (tested against them on the kernel
// emulator, //tests:cuda_kernel_test_kernel_emu):
//   - RMSNorm as Layernorm.cu: one warp per row, the row's sums as warp shuffles; the weight
//     gradient a column sum in the order the launch shape fixes (Device.cuh's columnSums), so
//     every tp rank's copy of a norm gets the same bits;
//   - SwiGLU on the stage's layout, each row of the fc output gate | up (the CPU stage calls the
//     CPU op row by row on the same halves);
//   - rotary embeddings in place, the angle of each (position, pair) in double and rounded once,
//     as the CPU computes it, so that long sequences keep their digits.
// The stage (kernels/StageProgram.h) calls them for Llama-style blocks.
//
//===----------------------------------------------------------------------===//
#include "kernels/cuda/Device.cuh"
#include "kernels/cuda/Launch.h"

#include <type_traits>

namespace pipec::kernels::cuda {
namespace {

using namespace device;

constexpr int kThreads = 256;
constexpr unsigned kMaxBlocks = 65535u * 8u;

unsigned gridFor(size_t n) {
  unsigned blocks = ceilDiv(n, kThreads);
  return blocks < kMaxBlocks ? blocks : kMaxBlocks;
}

// out (n, c) = in * rstd * w, rstd (n) = 1 / sqrt(mean(in^2) + eps).
template <typename T>
__global__ void rmsnormForwardKernel(T *__restrict__ out, float *__restrict__ rstd,
                                     const T *__restrict__ in, const T *__restrict__ w, int n,
                                     int c, float eps) {
  const int row = warpRow(), lane = threadIdx.x % kWarp;
  if (row >= n)
    return;
  const T *x = in + size_t(row) * c;
  const float s = 1.0f / sqrtf(rowSum(x, c, [](float v) { return v * v; }) / c + eps);
  T *y = out + size_t(row) * c;
  for (int k = lane; k < c; k += kWarp)
    y[k] = fromFloat<T>(toFloat(x[k]) * s * toFloat(w[k]));
  if (lane == 0)
    rstd[row] = s;
}

// dIn (n, c) += rstd * (w dOut - xhat * mean(w dOut xhat)), xhat = in * rstd.
template <typename T>
__global__ void rmsnormBackwardInputKernel(T *__restrict__ dIn, const T *__restrict__ dOut,
                                           const T *__restrict__ in, const float *__restrict__ rstd,
                                           const T *__restrict__ w, int n, int c) {
  const int row = warpRow(), lane = threadIdx.x % kWarp;
  if (row >= n)
    return;
  const T *x = in + size_t(row) * c;
  const T *dy = dOut + size_t(row) * c;
  const float s = rstd[row];
  float dot = 0.0f;
  for (int k = lane; k < c; k += kWarp)
    dot += toFloat(w[k]) * toFloat(dy[k]) * toFloat(x[k]) * s;
  const float mean = warpSum(dot) / c;
  T *dx = dIn + size_t(row) * c;
  for (int k = lane; k < c; k += kWarp)
    dx[k] = fromFloat<T>(toFloat(dx[k]) +
                         s * (toFloat(w[k]) * toFloat(dy[k]) - toFloat(x[k]) * s * mean));
}

// dW (c) += sum_r dOut * in * rstd: column sums in a fixed order (columnSums).
template <typename T>
__global__ void __launch_bounds__(kColumnSumThreads)
    rmsnormBackwardWeightKernel(ColumnSumOutputs out, float *__restrict__ partials,
                                const T *__restrict__ dOut, const T *__restrict__ in,
                                const float *__restrict__ rstd, int n, int c) {
  float sums[1];
  auto term = [&](int r, int col, float(&acc)[1]) {
    acc[0] += toFloat(dOut[size_t(r) * c + col]) * (toFloat(in[size_t(r) * c + col]) * rstd[r]);
  };
  if (columnSums(n, c, term, sums))
    storeColumnSums(out, partials, sums, c);
}

// out (n, f) = silu(gate) * up, each row of pre (n, 2f) gate | up.
template <typename T>
__global__ void swigluForwardKernel(T *__restrict__ out, const T *__restrict__ pre, int n, int f) {
  const size_t total = size_t(n) * f;
  for (size_t e = blockIdx.x * size_t(blockDim.x) + threadIdx.x; e < total;
       e += size_t(gridDim.x) * blockDim.x) {
    const size_t r = e / size_t(f), k = e % size_t(f);
    const float g = toFloat(pre[r * 2 * f + k]), u = toFloat(pre[r * 2 * f + f + k]);
    out[e] = fromFloat<T>(g / (1.0f + expf(-g)) * u);
  }
}

// dPre (n, 2f): dGate = dOut * up * silu'(gate), dUp = dOut * silu(gate).
template <typename T>
__global__ void swigluBackwardKernel(T *__restrict__ dPre, const T *__restrict__ dOut,
                                     const T *__restrict__ pre, int n, int f) {
  const size_t total = size_t(n) * f;
  for (size_t e = blockIdx.x * size_t(blockDim.x) + threadIdx.x; e < total;
       e += size_t(gridDim.x) * blockDim.x) {
    const size_t r = e / size_t(f), k = e % size_t(f);
    const float g = toFloat(pre[r * 2 * f + k]), u = toFloat(pre[r * 2 * f + f + k]);
    const float dy = toFloat(dOut[e]);
    const float sig = 1.0f / (1.0f + expf(-g)), silu = g * sig;
    dPre[r * 2 * f + f + k] = fromFloat<T>(dy * silu);
    dPre[r * 2 * f + k] = fromFloat<T>(dy * u * (sig + silu * (1.0f - sig)));
  }
}

// x (rows, heads * hd) in place: the pair (i, i + hd/2) of every head of row r turns by
// sign * positions[r] * theta^(-2i / hd). One thread per (row, pair), looping over the heads.
template <typename T>
__global__ void ropeKernel(T *__restrict__ x, const int32_t *__restrict__ positions, int rows,
                           int heads, int headDim, double theta, double sign) {
  const int half = headDim / 2;
  const size_t total = size_t(rows) * half;
  for (size_t e = blockIdx.x * size_t(blockDim.x) + threadIdx.x; e < total;
       e += size_t(gridDim.x) * blockDim.x) {
    const size_t r = e / size_t(half);
    const int i = int(e % size_t(half));
    const double angle = sign * double(positions[r]) * pow(theta, -2.0 * i / headDim);
    const float cs = float(cos(angle)), sn = float(sin(angle));
    for (int h = 0; h < heads; ++h) {
      T *head = x + r * size_t(heads) * headDim + size_t(h) * headDim;
      const float a = toFloat(head[i]), b = toFloat(head[i + half]);
      head[i] = fromFloat<T>(a * cs - b * sn);
      head[i + half] = fromFloat<T>(b * cs + a * sn);
    }
  }
}

} // namespace

namespace launch {

cudaError_t rmsnormForward(DType dtype, void *out, float *rstd, const void *in, const void *w,
                           int n, int c, float eps, cudaStream_t stream) {
  if (n == 0 || c == 0)
    return cudaSuccess;
  return PIPEC_DISPATCH_DTYPE(dtype, [&](auto *tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    PIPEC_LAUNCH(ceilDiv(n, kRowWarps), kRowThreads, 0, stream, rmsnormForwardKernel<T>)
    (static_cast<T *>(out), rstd, static_cast<const T *>(in), static_cast<const T *>(w), n, c, eps);
    return cudaGetLastError();
  });
}

cudaError_t rmsnormBackwardInputAccumulate(DType dtype, void *dIn, const void *dOut, const void *in,
                                           const float *rstd, const void *w, int n, int c,
                                           cudaStream_t stream) {
  if (n == 0 || c == 0)
    return cudaSuccess;
  return PIPEC_DISPATCH_DTYPE(dtype, [&](auto *tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    PIPEC_LAUNCH(ceilDiv(n, kRowWarps), kRowThreads, 0, stream, rmsnormBackwardInputKernel<T>)
    (static_cast<T *>(dIn), static_cast<const T *>(dOut), static_cast<const T *>(in), rstd,
     static_cast<const T *>(w), n, c);
    return cudaGetLastError();
  });
}

cudaError_t rmsnormBackwardWeight(DType dtype, float *dW, const void *dOut, const void *in,
                                  const float *rstd, int n, int c, float *partials,
                                  cudaStream_t stream) {
  const ColumnSumOutputs out{{dW, nullptr}};
  return launchColumnSums<1>(dtype, out, partials, n, c, stream, [&](auto *tag, dim3 grid) {
    using T = std::remove_pointer_t<decltype(tag)>;
    PIPEC_LAUNCH(grid, kColumnSumThreads, 0, stream, rmsnormBackwardWeightKernel<T>)
    (out, partials, static_cast<const T *>(dOut), static_cast<const T *>(in), rstd, n, c);
  });
}

cudaError_t swigluForward(DType dtype, void *out, const void *pre, int n, int f,
                          cudaStream_t stream) {
  if (n == 0 || f == 0)
    return cudaSuccess;
  return PIPEC_DISPATCH_DTYPE(dtype, [&](auto *tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    PIPEC_LAUNCH(gridFor(size_t(n) * f), kThreads, 0, stream, swigluForwardKernel<T>)
    (static_cast<T *>(out), static_cast<const T *>(pre), n, f);
    return cudaGetLastError();
  });
}

cudaError_t swigluBackward(DType dtype, void *dPre, const void *dOut, const void *pre, int n, int f,
                           cudaStream_t stream) {
  if (n == 0 || f == 0)
    return cudaSuccess;
  return PIPEC_DISPATCH_DTYPE(dtype, [&](auto *tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    PIPEC_LAUNCH(gridFor(size_t(n) * f), kThreads, 0, stream, swigluBackwardKernel<T>)
    (static_cast<T *>(dPre), static_cast<const T *>(dOut), static_cast<const T *>(pre), n, f);
    return cudaGetLastError();
  });
}

cudaError_t rope(DType dtype, void *x, const int32_t *positions, int rows, int heads, int headDim,
                 double theta, bool backward, cudaStream_t stream) {
  if (rows == 0 || heads == 0)
    return cudaSuccess;
  if (headDim <= 0 || headDim % 2 != 0)
    return cudaErrorInvalidValue;
  return PIPEC_DISPATCH_DTYPE(dtype, [&](auto *tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    PIPEC_LAUNCH(gridFor(size_t(rows) * size_t(headDim / 2)), kThreads, 0, stream, ropeKernel<T>)
    (static_cast<T *>(x), positions, rows, heads, headDim, theta, backward ? -1.0 : 1.0);
    return cudaGetLastError();
  });
}

} // namespace launch
} // namespace pipec::kernels::cuda
