//===- Device.cuh - device helpers shared by the .cu files --------*- CUDA -*-===//
//
// Loads and stores that widen bf16 to fp32 (all arithmetic is fp32), warp reductions by
// shuffles, column sums in a fixed order, the tensor-core mma of a warp, ldmatrix .x4 .trans,
// cp.async copies to shared memory, and the fp32/bf16 dispatch of a launcher (plus Dialect.h's
// launch macros). Included by .cu files only.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_KERNELS_CUDA_DEVICE_CUH
#define PIPEC_KERNELS_CUDA_DEVICE_CUH

#include "kernels/cuda/DType.h"
#include "kernels/cuda/Dialect.h"
#include "kernels/cuda/Launch.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

/// Runs `body` (a generic lambda taking a T* null pointer) with T = float or bf16 by `dtype`.
#define PIPEC_DISPATCH_DTYPE(dtype, ...)                                                           \
  ((dtype) == ::pipec::kernels::cuda::DType::F32                                                   \
       ? (__VA_ARGS__)(static_cast<float *>(nullptr))                                              \
       : (__VA_ARGS__)(static_cast<::pipec::kernels::cuda::device::bf16 *>(nullptr)))

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

/// d (16 x 8, fp32) += a (16 x 16) b (16 x 8), bf16 inputs: one mma.sync.m16n8k16 of the warp,
/// every lane passing its fragments in the PTX ISA's layout (groupID g = lane / 4,
/// threadID_in_group t = lane % 4; the low half of a register is the lower column or row):
///   a[r]: row g + 8 (r & 1), columns 2 t + 8 (r >> 1) + {0, 1};
///   b[r]: rows 2 t + 8 r + {0, 1}, column g;
///   d[e]: row g + 8 (e >> 1), column 2 t + (e & 1).
__device__ __forceinline__ void mmaBf16(float (&d)[4], const uint32_t (&a)[4],
                                        const uint32_t (&b)[2]) {
#ifdef PIPEC_KERNEL_EMU
  ::pipec::emu::kernel::mmaM16N8K16Bf16(d, a, b);
#else
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
               "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

/// Four 8 x 8 matrices of 16-bit values from shared memory, transposed (ldmatrix .x4 .trans):
/// lane l passes the address of row l % 8 of matrix l / 8 (8 values, 16-byte aligned), and r[i]
/// gets matrix i's elements (2 (l % 4), l / 4) in its low half and (2 (l % 4) + 1, l / 4) in
/// its high half: a B fragment (mmaBf16) of a row-major tile whose rows are B's k.
__device__ __forceinline__ void ldmatrixX4Trans(uint32_t (&r)[4], const void *row) {
#ifdef PIPEC_KERNEL_EMU
  ::pipec::emu::kernel::ldmatrixX4Trans(r, row);
#else
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
#endif
}

/// Starts a 16-byte copy from global to shared memory that bypasses registers and L1
/// (cp.async.cg); both addresses 16-byte aligned. It lands only after a cpAsyncWait that covers
/// its group (cpAsyncCommit), and is visible to other threads after a barrier that follows.
__device__ __forceinline__ void cpAsync16(void *shared, const void *global) {
#ifdef PIPEC_KERNEL_EMU
  ::pipec::emu::kernel::cpAsync16(shared, global);
#else
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(address), "l"(global)
               : "memory");
#endif
}

/// cpAsync16 with a source size of 0: the 16 bytes at `shared` become zeros, in the same
/// asynchronous way (an mbarrier that tracks the thread's copies tracks this one); `global` is
/// any valid global address (nothing is read from it).
__device__ __forceinline__ void cpAsync16Zero(void *shared, const void *global) {
#ifdef PIPEC_KERNEL_EMU
  (void)global;
  ::pipec::emu::kernel::cpAsync16Zero(shared);
#else
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, 0;\n" ::"r"(address), "l"(global)
               : "memory");
#endif
}

/// Closes the group of the calling thread's cp.async copies issued since the last commit.
__device__ __forceinline__ void cpAsyncCommit() {
#ifdef PIPEC_KERNEL_EMU
  ::pipec::emu::kernel::cpAsyncCommit();
#else
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

/// Waits until at most `Pending` of the calling thread's committed groups are in flight.
template <int Pending> __device__ __forceinline__ void cpAsyncWait() {
#ifdef PIPEC_KERNEL_EMU
  ::pipec::emu::kernel::cpAsyncWait(Pending);
#else
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending) : "memory");
#endif
}

inline unsigned ceilDiv(size_t a, size_t b) { return unsigned((a + b - 1) / b); }

// Row kernels: one warp per row of c values, kRowWarps warps (kRowThreads threads) a block, on
// ceilDiv(n, kRowWarps) blocks for n rows.
inline constexpr int kRowWarps = 8;
inline constexpr int kRowThreads = kRowWarps * kWarp;

/// The row a row kernel's warp owns.
__device__ __forceinline__ int warpRow() { return blockIdx.x * kRowWarps + threadIdx.x / kWarp; }

/// In a row kernel, the sum of f(x[k]) over the warp's row x of c values: each lane adds its
/// share (k = lane, lane + 32, ...) in order, then warpSum adds the lanes'.
template <typename T, typename F>
__device__ __forceinline__ float rowSum(const T *__restrict__ x, int c, F f) {
  float sum = 0.0f;
  for (int k = int(threadIdx.x % kWarp); k < c; k += kWarp)
    sum += f(toFloat(x[k]));
  return warpSum(sum);
}

// Column sums in an order that the shapes alone fix, so that every launch (and every tp rank,
// from the same inputs) gets the same bits: no atomics. Rows go in chunks of
// kColumnSumChunkRows; a kernel launched on ColumnSumGrid blocks of kColumnSumThreads threads
// calls columnSums and then storeColumnSums: block (x, y) sums columns [kWarp x, kWarp x + kWarp)
// over chunk y, warp w (a warp reads kWarp adjacent columns of a row) rows w, w +
// kColumnSumWarps, ... of the chunk, then warp 0 adds the warps' sums in warp order. With one
// chunk that is the total; with more, each chunk's sums go to scratch and combineColumnSums adds
// them in chunk order.
inline constexpr int kColumnSumWarps = 8;
inline constexpr int kColumnSumThreads = kColumnSumWarps * kWarp;
using launch::kColumnSumChunkRows;

/// Where N column sums go (each `to[i][col] +=` its sum).
struct ColumnSumOutputs {
  float *to[2];
};

/// N sums over chunk blockIdx.y of the n rows, for column kWarp blockIdx.x + lane: `term(r, col,
/// acc)` adds row r's terms to acc[0..N). Every thread of the block must call it (it
/// synchronises the block); true on the threads that then hold a column's sums (warp 0, columns
/// < c).
template <int N, typename Term>
__device__ __forceinline__ bool columnSums(int n, int c, Term term, float (&sums)[N]) {
  static_assert(N >= 1 && N <= 2, "ColumnSumOutputs holds two");
  __shared__ float parts[kColumnSumWarps][N][kWarp];
  const int lane = int(threadIdx.x) % kWarp, warp = int(threadIdx.x) / kWarp;
  const int col = int(blockIdx.x) * kWarp + lane;
  const int end = min(n, (int(blockIdx.y) + 1) * kColumnSumChunkRows);
  float acc[N];
  for (int i = 0; i < N; ++i)
    acc[i] = 0.0f;
  if (col < c)
    for (int r = int(blockIdx.y) * kColumnSumChunkRows + warp; r < end; r += kColumnSumWarps)
      term(r, col, acc);
  for (int i = 0; i < N; ++i)
    parts[warp][i][lane] = acc[i];
  __syncthreads();
  if (warp != 0 || col >= c)
    return false;
  for (int i = 0; i < N; ++i) {
    float total = 0.0f;
    for (int w = 0; w < kColumnSumWarps; ++w)
      total += parts[w][i][lane];
    sums[i] = total;
  }
  return true;
}

/// After columnSums returned true: into `out` when the rows are one chunk, else into chunk
/// blockIdx.y's row of `partials` (N * chunks rows of c).
template <int N>
__device__ __forceinline__ void storeColumnSums(const ColumnSumOutputs &out, float *partials,
                                                const float (&sums)[N], int c) {
  const int col = int(blockIdx.x) * kWarp + int(threadIdx.x);
  for (int i = 0; i < N; ++i) {
    if (gridDim.y == 1)
      out.to[i][col] += sums[i];
    else
      partials[(size_t(i) * gridDim.y + blockIdx.y) * c + col] = sums[i];
  }
}

/// out.to[i][col] += the chunks' sums, in chunk order: one thread per (i, col).
template <int N>
__global__ void combineColumnSums(ColumnSumOutputs out, const float *__restrict__ partials,
                                  int chunks, int c) {
  const size_t k = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k >= size_t(N) * c)
    return;
  const int i = int(k / c), col = int(k % c);
  float total = 0.0f;
  for (int y = 0; y < chunks; ++y)
    total += partials[(size_t(i) * chunks + y) * c + col];
  out.to[i][col] += total;
}

/// The grid of a columnSums kernel over n rows of c columns.
inline dim3 columnSumGrid(int n, int c) {
  return dim3(unsigned((c + kWarp - 1) / kWarp),
              unsigned((n + kColumnSumChunkRows - 1) / kColumnSumChunkRows));
}

/// A columnSums kernel's whole launch over n rows of c columns in `dtype`: `queue(T *, grid)`
/// queues the kernel (T the element type) on `stream` with kColumnSumThreads threads a block;
/// then combineColumnSums when the rows span more than one chunk. `partials` holds
/// launch::columnSumScratchFloats(n, c, N) floats (cudaErrorInvalidValue if null when needed).
template <int N, typename Launch>
cudaError_t launchColumnSums(DType dtype, ColumnSumOutputs out, float *partials, int n, int c,
                             cudaStream_t stream, Launch queue) {
  if (n == 0 || c == 0)
    return cudaSuccess;
  if (!partials && launch::columnSumScratchFloats(n, c, N) > 0)
    return cudaErrorInvalidValue;
  const dim3 grid = columnSumGrid(n, c);
  PIPEC_DISPATCH_DTYPE(dtype, [&](auto *tag) { queue(tag, grid); });
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess)
    return err;
  const unsigned chunks = grid.y;
  if (chunks == 1)
    return cudaSuccess;
  constexpr int kThreads = 256;
  const size_t total = size_t(N) * size_t(c);
  PIPEC_LAUNCH(unsigned((total + kThreads - 1) / kThreads), kThreads, 0, stream,
               combineColumnSums<N>)
  (out, partials, int(chunks), c);
  return cudaGetLastError();
}

} // namespace pipec::kernels::cuda::device

#endif // PIPEC_KERNELS_CUDA_DEVICE_CUH
