//===- Attention.cuh - what the attention kernel families share ---*- CUDA -*-===//
//
// Causal attention of a query slice [a, a + x) over the keys [0, a + x) (CudaOps.h) is computed
// by one of three kernel families, each in its own file, chosen by Attention.cu:
//   AttentionSimt.cu     SIMT kernels: fp32, and bf16 shapes the tensor cores do not take;
//                        the row dots dOut . out every backward starts with;
//   AttentionMmaSync.cu  FlashAttention-2 on mma.sync.m16n8k16 (sm_80 and newer): bf16, head
//                        dimensions that are multiples of 16 up to 128;
//   AttentionWgmma.cu    the forward on Hopper's wgmma (sm_90a only): bf16, head dimension 64
//                        or 128.
// This header has their shared layout (Dims), the base-2 softmax's constants, the 16-bit
// fragment helpers of both tensor-core families, the launch that raises a kernel's shared memory
// limit, and each family's host launcher (plain functions: the families are separate
// translation units, and AttentionWgmma.cu is compiled for sm_90a alone). Layouts are the CPU
// reference's (kernels/cpu/Ops.h):
//   q, out, dq   (B, x, H*hd)       row (b, t), head h at columns [h*hd, (h+1)*hd)
//   k, v, dk, dv (a + x, B, H*hd)   position-major, so a slice's K/V append to the cache
//   lse          (B, H, x)          fp32 log-sum-exp of a query row's scaled scores
//   rowDot       (B, H, x)          fp32 dOut . out per query row and head (the backward's D)
// dk and dv are fp32 in every compute type and added to: each slice's backward adds to the
// gradients of all earlier keys, so in bf16 they would be rounded once per slice.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_KERNELS_CUDA_ATTENTION_CUH
#define PIPEC_KERNELS_CUDA_ATTENTION_CUH

#include "kernels/cuda/Device.cuh"
#include "kernels/cuda/Launch.h"

#include <cmath>
#include <cstdint>
#include <cstring>

namespace pipec::kernels::cuda::attention {

using device::bf16;

/// The shape of one call, with the layouts' offsets.
struct Dims {
  int batch, queries, begin, heads, headDim;
  int kvHeads; // key/value heads, dividing heads (== heads: multi-head attention)
  __host__ __device__ int width() const { return heads * headDim; }
  __host__ __device__ int kvWidth() const { return kvHeads * headDim; }
  __host__ __device__ int group() const { return heads / kvHeads; } // query heads per K/V head
  __host__ __device__ int keys() const { return begin + queries; }
  __device__ size_t qRow(int b, int t, int h) const {
    return (size_t(b) * queries + t) * width() + size_t(h) * headDim;
  }
  /// The key/value row that query head h reads.
  __device__ size_t kvRow(int j, int b, int h) const {
    return (size_t(j) * batch + b) * kvWidth() + size_t(h / group()) * headDim;
  }
  __device__ size_t statRow(int b, int h, int t) const {
    return (size_t(b) * heads + h) * queries + t;
  }
};

inline Dims toDims(launch::AttentionDims d) {
  return Dims{d.batch, d.queries, d.begin, d.heads, d.headDim, d.kvHeads > 0 ? d.kvHeads : d.heads};
}

/// The softmax in base 2: scores are scaled by log2(e) / sqrt(hd) and exponentiated by exp2;
/// the log-sum-exp is turned back to base e by ln(2).
inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;

/// Two adjacent 16-bit values of shared or global memory (4-byte aligned) as one fragment
/// register.
template <typename Half> __device__ __forceinline__ uint32_t load32(const Half *p) {
  static_assert(sizeof(Half) == 2, "a pair of 16-bit values");
  return *reinterpret_cast<const uint32_t *>(p);
}

/// Two floats rounded to bf16 (to nearest even) as one fragment register: lo in the low half.
__device__ __forceinline__ uint32_t pack(float lo, float hi) {
  __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi); // .x (low half) = lo
  uint32_t bits;
  memcpy(&bits, &pair, sizeof bits);
  return bits;
}

/// 2^x by the SFU (ex2.approx.ftz: 2 ulp, subnormal results flushed to zero).
__device__ __forceinline__ float exp2Fast(float x) {
#ifdef PIPEC_KERNEL_EMU
  return std::exp2(x);
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

/// The bits of |x|: as unsigned integers they order as the magnitudes do, with Inf above every
/// finite value and NaN above Inf, so their maximum keeps a NaN (fmaxf drops it).
__device__ __forceinline__ unsigned absBits(float x) { return __float_as_uint(x) & 0x7fffffffu; }

/// A thread's share of an output row in the tensor cores' accumulator layout, as bf16: dims
/// 8 dt + 2 tg + e (e = 0, 1; dt < HD / 8) of the row starting at `row` are value(dt, e).
template <int HD, typename Value>
__device__ __forceinline__ void storeRowPairs(bf16 *row, int tg, Value value) {
  bf16 *dst = row + 2 * tg;
#pragma unroll
  for (int dt = 0; dt < HD / 8; ++dt)
    *reinterpret_cast<__nv_bfloat162 *>(dst + dt * 8) =
        __floats2bfloat162_rn(value(dt, 0), value(dt, 1));
}

/// The tensor-core forwards' last step for a thread's rows t0 and t0 + 8 (row = 0, 1): the
/// quad's row sums added up, then for the slice's rows out = O / sum as bf16 (acc(dt, row, e):
/// O's accumulator of dims 8 dt + 2 tg + e) and, on tg 0, lse = (rowMax + log2(sum)) ln(2), the
/// row maxima being of the scores scaled by log2(e).
template <int HD, typename Acc>
__device__ __forceinline__ void storeForwardRows(bf16 *out, float *lse, const Dims &s, int b, int h,
                                                 int t0, int tg, const float (&rowMax)[2],
                                                 float (&rowSum)[2], Acc acc) {
#pragma unroll
  for (int row = 0; row < 2; ++row) {
    rowSum[row] += __shfl_xor_sync(device::kFullMask, rowSum[row], 1);
    rowSum[row] += __shfl_xor_sync(device::kFullMask, rowSum[row], 2);
    const int t = t0 + 8 * row;
    if (t >= s.queries)
      continue;
    const float inv = 1.0f / rowSum[row];
    storeRowPairs<HD>(out + s.qRow(b, t, h), tg,
                      [&](int dt, int e) { return acc(dt, row, e) * inv; });
    if (tg == 0)
      lse[s.statRow(b, h, t)] = (rowMax[row] + log2f(rowSum[row])) * kLn2;
  }
}

/// Launches `kernel` on `block` threads with `smemBytes` of dynamic shared memory, after raising
/// its limit past the 48 KiB default to `smemLimit`: a constant of the kernel (its size at the
/// largest head dimension), so that rank threads launching it concurrently with different sizes
/// never lower the limit under each other.
template <typename Kernel, typename... Args>
cudaError_t launchWithSmem(Kernel kernel, dim3 grid, unsigned block, size_t smemBytes,
                           size_t smemLimit, cudaStream_t stream, Args... args) {
  if (cudaError_t err =
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smemLimit)))
    return err;
  PIPEC_LAUNCH(grid, block, smemBytes, stream, kernel)(args...);
  return cudaGetLastError();
}

//===--- The families' launchers (every pointer on the device) ------------===//

// AttentionSimt.cu: any head dimension up to launch::kMaxHeadDim, fp32 or bf16.
cudaError_t simtForward(DType dtype, void *out, float *lse, const void *q, const void *k,
                        const void *v, const Dims &s, cudaStream_t stream);
/// rowDot (B, H, x) = dOut . out per query row and head: the first kernel of every backward;
/// with `rowMaxAbs`, also the absBits of each row's max |dOut| there (B, H, x).
cudaError_t rowDot(DType dtype, float *rowDot, const void *dOut, const void *out, const Dims &s,
                   cudaStream_t stream, unsigned *rowMaxAbs = nullptr);
/// dq written; dk and dv (fp32) added to; after rowDot.
cudaError_t simtBackward(DType dtype, void *dq, float *dk, float *dv, const void *dOut,
                         const float *lse, const float *rowDot, const void *q, const void *k,
                         const void *v, const Dims &s, cudaStream_t stream);

// AttentionMmaSync.cu: bf16, 16-byte aligned tensors.
/// Whether the mma.sync kernels are instantiated for this head dimension (multiples of 16 up
/// to 128).
bool mmaSyncHeadDim(int headDim);
cudaError_t mmaSyncForward(bf16 *out, float *lse, const bf16 *q, const bf16 *k, const bf16 *v,
                           const Dims &s, cudaStream_t stream);
/// As simtBackward.
cudaError_t mmaSyncBackward(bf16 *dq, float *dk, float *dv, const bf16 *dOut, const float *lse,
                            const float *rowDot, const bf16 *q, const bf16 *k, const bf16 *v,
                            const Dims &s, cudaStream_t stream);

// AttentionWgmma.cu: sm_90a code; call it only on a compute-capability-9.0 device.
/// Whether the wgmma forward is instantiated for this head dimension (64 and 128).
bool wgmmaHeadDim(int headDim);
cudaError_t wgmmaForward(bf16 *out, float *lse, const bf16 *q, const bf16 *k, const bf16 *v,
                         const Dims &s, cudaStream_t stream);

} // namespace pipec::kernels::cuda::attention

#endif // PIPEC_KERNELS_CUDA_ATTENTION_CUH
