//===- Device.cuh - device helpers shared by the .cu files --------*- CUDA -*-===//
//
// Loads and stores that widen bf16 to fp32 (all arithmetic is fp32), warp reductions by
// shuffles, and the fp32/bf16 dispatch of a launcher. Included by .cu files only.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_KERNELS_CUDA_DEVICE_CUH
#define PIPEC_KERNELS_CUDA_DEVICE_CUH

#include "kernels/cuda/DType.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace pipec::kernels::cuda::device {

using bf16 = __nv_bfloat16;
inline constexpr int kWarp = 32;
inline constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float toFloat(float x) { return x; }
__device__ __forceinline__ float toFloat(bf16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T fromFloat(float x);
template <> __device__ __forceinline__ float fromFloat<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 fromFloat<bf16>(float x) {
  return __float2bfloat16_rn(x);
}

__device__ __forceinline__ float warpSum(float x) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2)
    x += __shfl_xor_sync(kFullMask, x, offset);
  return x;
}

__device__ __forceinline__ float warpMax(float x) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2)
    x = fmaxf(x, __shfl_xor_sync(kFullMask, x, offset));
  return x;
}

inline unsigned ceilDiv(size_t a, size_t b) { return unsigned((a + b - 1) / b); }

} // namespace pipec::kernels::cuda::device

/// Runs `body` (a generic lambda taking a T* null pointer) with T = float or bf16 by `dtype`.
#define PIPEC_DISPATCH_DTYPE(dtype, ...)                                                           \
  ((dtype) == ::pipec::kernels::cuda::DType::F32                                                   \
       ? (__VA_ARGS__)(static_cast<float *>(nullptr))                                              \
       : (__VA_ARGS__)(static_cast<::pipec::kernels::cuda::device::bf16 *>(nullptr)))

#endif // PIPEC_KERNELS_CUDA_DEVICE_CUH
