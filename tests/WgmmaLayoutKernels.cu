//===- WgmmaLayoutKernels.cu - One wgmma product per operand layout the attention uses ----===//
//
// WgmmaLayoutKernels.h. The descriptors and k-step offsets are spelled as the attention kernels
// spell them (kAtomBytes, kBlockBytes), so that this checks that spelling.
//
//===----------------------------------------------------------------------===//
#include "tests/WgmmaLayoutKernels.h"

#include "kernels/cuda/Wgmma.cuh"

namespace pipec::test {
namespace {

using namespace ::pipec::kernels::cuda::device;

constexpr int kRows = 64, kCols = 128, kTile = kRows * kCols;
constexpr uint32_t kAtomBytes = 1024, kBlockBytes = 64 * 128; // 8 rows; 64 columns of 64 rows
constexpr size_t kSharedBytes = 2 * kTile * 2 + kAtomBytes;

/// Element (r, c) of a tile in the 128-byte swizzled layout.
__device__ int swizzled(int r, int c) {
  return c / 64 * 64 * 64 + r * 64 + ((c % 64 / 8) ^ (r % 8)) * 8 + c % 8;
}

/// The warp's A fragment of k-step kk from a row-major 64 x 128 matrix (mma.m16n8k16's layout).
__device__ void fragment(uint32_t (&f)[4], const uint16_t *a, int warp, int lane, int kk) {
  const int g = lane / 4, t = lane % 4;
  for (int r = 0; r < 4; ++r) {
    const int row = 16 * warp + g + 8 * (r & 1), col = 16 * kk + 2 * t + 8 * (r >> 1);
    f[r] = uint32_t(a[kCols * row + col]) | uint32_t(a[kCols * row + col + 1]) << 16;
  }
}

template <int N> __device__ void store(float *d, const float (&acc)[N / 2], int warp, int lane) {
  const int g = lane / 4, t = lane % 4;
  for (int i = 0; i < N / 2; ++i)
    d[N * (16 * warp + g + 8 * (i % 4 >> 1)) + 8 * (i / 4) + 2 * t + (i & 1)] = acc[i];
}

__global__ void __launch_bounds__(128)
    wgmmaLayoutKernel(int which, const uint16_t *a, const uint16_t *b, float *d) {
  PIPEC_DYNAMIC_SHARED(float, smem);
  char *raw = reinterpret_cast<char *>(smem);
  uint16_t *tiles = reinterpret_cast<uint16_t *>(
      raw + (kAtomBytes - sharedAddress(raw) % kAtomBytes) % kAtomBytes);
  uint16_t *aTile = tiles, *bTile = tiles + kTile;
  const int t = threadIdx.x, warp = t / 32, lane = t % 32;
  const bool transposedA = WgmmaLayoutCase(which) == WgmmaLayoutCase::SharedMNMajorAMNMajorB;
  for (int i = t; i < kTile; i += 128) {
    const int r = i / kCols, c = i % kCols;
    if (!transposedA)
      aTile[swizzled(r, c)] = a[i];
    else if (c < 64) // A(m = r, k = c) at row k, column m of a 64 x 64 tile
      aTile[swizzled(c, r)] = a[i];
    bTile[swizzled(r, c)] = b[i];
  }
  fenceProxyAsyncShared();
  __syncthreads();

  switch (WgmmaLayoutCase(which)) {
  case WgmmaLayoutCase::RegisterAKMajorB: {
    uint32_t f[8][4];
    for (int kk = 0; kk < 8; ++kk)
      fragment(f[kk], a, warp, lane, kk);
    float acc[32];
    const uint64_t base = wgmmaDescriptor(bTile, 16, kAtomBytes, WgmmaLayout::Swizzle128);
    wgmmaFence();
#pragma unroll
    for (int kk = 0; kk < 8; ++kk)
      wgmmaBf16<64, false>(acc, f[kk], base + (kk / 4 * kBlockBytes + kk % 4 * 32) / 16, kk > 0);
    wgmmaCommit();
    wgmmaWait<0>();
    wgmmaFenceRegisters(acc);
    store<64>(d, acc, warp, lane);
    break;
  }
  case WgmmaLayoutCase::RegisterAMNMajorB: {
    uint32_t f[4][4];
    for (int kk = 0; kk < 4; ++kk)
      fragment(f[kk], a, warp, lane, kk);
    float acc[64];
    const uint64_t base = wgmmaDescriptor(bTile, kBlockBytes, kAtomBytes, WgmmaLayout::Swizzle128);
    wgmmaFence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
      wgmmaBf16<128, true>(acc, f[ks], base + ks * 2 * kAtomBytes / 16, ks > 0);
    wgmmaCommit();
    wgmmaWait<0>();
    wgmmaFenceRegisters(acc);
    store<128>(d, acc, warp, lane);
    break;
  }
  case WgmmaLayoutCase::SharedAKMajorB: {
    float acc[32];
    const uint64_t aDesc = wgmmaDescriptor(aTile, 16, kAtomBytes, WgmmaLayout::Swizzle128);
    const uint64_t bDesc = wgmmaDescriptor(bTile, 16, kAtomBytes, WgmmaLayout::Swizzle128);
    wgmmaFence();
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
      const uint64_t step = (kk / 4 * kBlockBytes + kk % 4 * 32) / 16;
      wgmmaBf16Shared64(acc, aDesc + step, bDesc + step, kk > 0);
    }
    wgmmaCommit();
    wgmmaWait<0>();
    wgmmaFenceRegisters(acc);
    store<64>(d, acc, warp, lane);
    break;
  }
  case WgmmaLayoutCase::SharedMNMajorAMNMajorB: {
    float acc[32];
    // As the experimental backward's dQ: A's k-rows of 64 m-values, B's k-rows of a 64-column
    // block.
    const uint64_t aDesc = wgmmaDescriptor(aTile, kBlockBytes, kAtomBytes, WgmmaLayout::Swizzle128);
    const uint64_t bDesc =
        wgmmaDescriptor(bTile + 64 * 64, kBlockBytes, kAtomBytes, WgmmaLayout::Swizzle128);
    wgmmaFence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
      wgmmaBf16Shared64<true, true>(acc, aDesc + ks * 2 * kAtomBytes / 16,
                                    bDesc + ks * 2 * kAtomBytes / 16, ks > 0);
    wgmmaCommit();
    wgmmaWait<0>();
    wgmmaFenceRegisters(acc);
    store<64>(d, acc, warp, lane);
    break;
  }
  }
}

} // namespace

int runWgmmaLayoutCase(WgmmaLayoutCase c, const uint16_t *a, const uint16_t *b, float *d) {
  cudaError_t status = cudaFuncSetAttribute(
      wgmmaLayoutKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSharedBytes));
  if (status != cudaSuccess)
    return int(status);
  PIPEC_LAUNCH(dim3(1), dim3(128), kSharedBytes, nullptr, wgmmaLayoutKernel)(int(c), a, b, d);
  return int(cudaGetLastError());
}

} // namespace pipec::test
