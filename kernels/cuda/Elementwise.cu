//===- Elementwise.cu - GELU, AdamW, dtype conversion, bias gradients ------===//
//
// The memory-bound ops: one thread per element in a grid-stride loop (so that any n launches a
// bounded grid; the bias gradient's grid grows with the rows, Device.cuh's columnSums), fp32
// arithmetic on fp32 or bf16 storage. They match kernels/cpu/Ops.cpp
// formula for formula; the only differences are the device's tanhf/sqrtf rounding (a few ulp)
// and, for the bias gradient, the order of the fp32 sums (Device.cuh's columnSums: fixed by the
// launch shape, so the same bits every launch).
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
constexpr float kGeluScale = 0.7978845608028654f; // sqrt(2 / pi)
static_assert(kThreads % kWarp == 0, "blocks are whole warps");

unsigned gridFor(size_t n) {
  unsigned blocks = ceilDiv(n, kThreads);
  return blocks < kMaxBlocks ? blocks : kMaxBlocks;
}

template <typename Dst, typename Src>
__global__ void convertKernel(Dst *__restrict__ dst, const Src *__restrict__ src, size_t n) {
  for (size_t k = blockIdx.x * size_t(blockDim.x) + threadIdx.x; k < n;
       k += size_t(gridDim.x) * blockDim.x)
    dst[k] = fromFloat<Dst>(toFloat(src[k]));
}

// out (n) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
template <typename T>
__global__ void geluForwardKernel(T *__restrict__ out, const T *__restrict__ in, size_t n) {
  for (size_t k = blockIdx.x * size_t(blockDim.x) + threadIdx.x; k < n;
       k += size_t(gridDim.x) * blockDim.x) {
    float x = toFloat(in[k]);
    out[k] = fromFloat<T>(0.5f * x * (1.0f + tanhf(kGeluScale * (x + 0.044715f * x * x * x))));
  }
}

// dIn (n) = gelu'(in) * dOut
template <typename T>
__global__ void geluBackwardKernel(T *__restrict__ dIn, const T *__restrict__ dOut,
                                   const T *__restrict__ in, size_t n) {
  for (size_t k = blockIdx.x * size_t(blockDim.x) + threadIdx.x; k < n;
       k += size_t(gridDim.x) * blockDim.x) {
    float x = toFloat(in[k]);
    float u = kGeluScale * (x + 0.044715f * x * x * x);
    float th = tanhf(u);
    float sech2 = 1.0f - th * th;
    float du = kGeluScale * (1.0f + 3.0f * 0.044715f * x * x);
    dIn[k] = fromFloat<T>((0.5f * (1.0f + th) + 0.5f * x * sech2 * du) * toFloat(dOut[k]));
  }
}

// params, grads, m, v (n), all fp32.
__global__ void adamKernel(float *__restrict__ params, const float *__restrict__ grads,
                           float *__restrict__ m, float *__restrict__ v, size_t n, float lr,
                           float beta1, float beta2, float eps, float weightDecay,
                           float mCorrection, float vCorrection) {
  for (size_t k = blockIdx.x * size_t(blockDim.x) + threadIdx.x; k < n;
       k += size_t(gridDim.x) * blockDim.x) {
    float g = grads[k];
    float mk = beta1 * m[k] + (1.0f - beta1) * g;
    float vk = beta2 * v[k] + (1.0f - beta2) * g * g;
    m[k] = mk;
    v[k] = vk;
    float mHat = mk / mCorrection;
    float vHat = vk / vCorrection;
    params[k] -= lr * (mHat / (sqrtf(vHat) + eps) + weightDecay * params[k]);
  }
}

// dBias (o) += sum over rows of dOut (n, o), in a fixed order (columnSums).
template <typename T>
__global__ void __launch_bounds__(kColumnSumThreads)
    columnSumKernel(ColumnSumOutputs out, float *__restrict__ partials, const T *__restrict__ dOut,
                    int n, int o) {
  float sums[1];
  auto term = [&](int r, int col, float(&acc)[1]) { acc[0] += toFloat(dOut[size_t(r) * o + col]); };
  if (columnSums(n, o, term, sums))
    storeColumnSums(out, partials, sums, o);
}

template <typename T>
__global__ void addRowBiasKernel(T *__restrict__ out, const T *__restrict__ bias, int n, int o,
                                 int ld) {
  const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= size_t(n) * o)
    return;
  const int r = int(i / o), c = int(i % o);
  T *at = out + size_t(r) * ld + c;
  *at = fromFloat<T>(toFloat(*at) + toFloat(bias[c]));
}

} // namespace

namespace launch {

cudaError_t convert(DType dstType, void *dst, DType srcType, const void *src, size_t n,
                    cudaStream_t stream) {
  if (n == 0)
    return cudaSuccess;
  return PIPEC_DISPATCH_DTYPE(dstType, [&](auto *dstTag) {
    using Dst = std::remove_pointer_t<decltype(dstTag)>;
    return PIPEC_DISPATCH_DTYPE(srcType, [&](auto *srcTag) {
      using Src = std::remove_pointer_t<decltype(srcTag)>;
      PIPEC_LAUNCH(gridFor(n), kThreads, 0, stream, convertKernel<Dst, Src>)
      (static_cast<Dst *>(dst), static_cast<const Src *>(src), n);
      return cudaGetLastError();
    });
  });
}

cudaError_t geluForward(DType dtype, void *out, const void *in, size_t n, cudaStream_t stream) {
  if (n == 0)
    return cudaSuccess;
  return PIPEC_DISPATCH_DTYPE(dtype, [&](auto *tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    PIPEC_LAUNCH(gridFor(n), kThreads, 0, stream, geluForwardKernel<T>)
    (static_cast<T *>(out), static_cast<const T *>(in), n);
    return cudaGetLastError();
  });
}

cudaError_t geluBackward(DType dtype, void *dIn, const void *dOut, const void *in, size_t n,
                         cudaStream_t stream) {
  if (n == 0)
    return cudaSuccess;
  return PIPEC_DISPATCH_DTYPE(dtype, [&](auto *tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    PIPEC_LAUNCH(gridFor(n), kThreads, 0, stream, geluBackwardKernel<T>)
    (static_cast<T *>(dIn), static_cast<const T *>(dOut), static_cast<const T *>(in), n);
    return cudaGetLastError();
  });
}

cudaError_t adamUpdate(float *params, const float *grads, float *m, float *v, size_t n, float lr,
                       float beta1, float beta2, float eps, float weightDecay, float mCorrection,
                       float vCorrection, cudaStream_t stream) {
  if (n == 0)
    return cudaSuccess;
  PIPEC_LAUNCH(gridFor(n), kThreads, 0, stream, adamKernel)
  (params, grads, m, v, n, lr, beta1, beta2, eps, weightDecay, mCorrection, vCorrection);
  return cudaGetLastError();
}

cudaError_t columnSumAccumulate(DType dtype, float *dBias, const void *dOut, int n, int o,
                                float *partials, cudaStream_t stream) {
  const ColumnSumOutputs out{{dBias, nullptr}};
  return launchColumnSums<1>(dtype, out, partials, n, o, stream, [&](auto *tag, dim3 grid) {
    using T = std::remove_pointer_t<decltype(tag)>;
    PIPEC_LAUNCH(grid, kColumnSumThreads, 0, stream, columnSumKernel<T>)
    (out, partials, static_cast<const T *>(dOut), n, o);
  });
}

cudaError_t addRowBias(DType dtype, void *out, const void *bias, int n, int o, int ld,
                       cudaStream_t stream) {
  if (n == 0 || o == 0)
    return cudaSuccess;
  if (ld < o)
    return cudaErrorInvalidValue;
  return PIPEC_DISPATCH_DTYPE(dtype, [&](auto *tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    PIPEC_LAUNCH(ceilDiv(size_t(n) * o, kThreads), kThreads, 0, stream, addRowBiasKernel<T>)
    (static_cast<T *>(out), static_cast<const T *>(bias), n, o, ld);
    return cudaGetLastError();
  });
}

} // namespace launch
} // namespace pipec::kernels::cuda
