//===- WgmmaEmuKernels.cu - Kernels that keep or break wgmma's rules ---------===//
//
// WgmmaEmuKernels.h. One warpgroup; B (16 x 16) K-major without swizzle in shared memory: core
// matrices of 8 columns by 8 k values, the leading byte offset (128) steps k by 8, the stride
// (256) the columns by 8. The swizzled cases store B K-major in the 128-byte swizzle instead:
// column n's k values in row n of 128 bytes, chunk j of the row at chunk j ^ (n % 8), the
// stride (1024) stepping n by 8.
//
//===----------------------------------------------------------------------===//
#include "tests/WgmmaEmuKernels.h"

#include "kernels/cuda/Wgmma.cuh"

namespace pipec::emu::test {
namespace {

using namespace ::pipec::kernels::cuda::device;

constexpr int kN = 16;

__device__ int bOffset(int k, int n) { // in bf16 elements
  return (n / 8) * 128 + (n % 8) * 8 + (k / 8) * 64 + k % 8;
}

__global__ void wgmmaCaseKernel(int which, const uint16_t *a, const uint16_t *b,
                                const uint16_t *bColumns, float *out, float *out2) {
  const WgmmaCase c = WgmmaCase(which);
  PIPEC_DYNAMIC_SHARED(uint16_t, tile); // B: 512 bytes, or 2048 swizzled, aligned in 3072
  const int t = threadIdx.x, warp = t / 32, lane = t % 32, g = lane / 4, tg = lane % 4;
  const bool copied =
      c == WgmmaCase::CopiedWithProxyFence || c == WgmmaCase::CopiedWithReaderFences ||
      c == WgmmaCase::CopiedWithoutProxyFence || c == WgmmaCase::ProxyFenceByAnotherThread;
  if (copied) {
    // 32 chunks of 16 bytes: chunk t holds column n's k values 8 kb ... 8 kb + 7, which
    // bColumns (B column-major) has together.
    if (t < 32) {
      const int n = t / 16 * 8 + t % 8, kb = t % 16 / 8;
      cpAsync16(tile + 8 * t, bColumns + 16 * n + 8 * kb);
    }
    cpAsyncCommit();
    cpAsyncWait<0>();
    if (c == WgmmaCase::CopiedWithProxyFence)
      fenceProxyAsyncShared(); // by each writer, before the barrier
  } else if (c == WgmmaCase::SwizzledAligned || c == WgmmaCase::SwizzledUnaligned) {
    if (c == WgmmaCase::SwizzledAligned) {
      const uint32_t skip = (1024 - sharedAddress(tile) % 1024) % 1024;
      tile = reinterpret_cast<uint16_t *>(reinterpret_cast<char *>(tile) + skip);
    }
    for (int i = t; i < 16 * kN; i += blockDim.x) {
      const int k = i / kN, n = i % kN;
      tile[64 * n + 8 * ((k / 8) ^ (n % 8)) + k % 8] = b[i];
    }
    fenceProxyAsyncShared();
  } else {
    for (int i = t; i < 16 * kN; i += blockDim.x)
      tile[bOffset(i / kN, i % kN)] = b[i];
    if (c != WgmmaCase::StoredWithoutProxyFence)
      fenceProxyAsyncShared();
  }
  __syncthreads();
  if (c == WgmmaCase::CopiedWithReaderFences ||
      (c == WgmmaCase::ProxyFenceByAnotherThread && t == 0))
    fenceProxyAsyncShared(); // after the barrier: by each reader, or by thread 0 alone

  uint32_t frag[4];
  for (int r = 0; r < 4; ++r) {
    const int row = 16 * warp + g + 8 * (r & 1), col = 2 * tg + 8 * (r >> 1);
    frag[r] = uint32_t(a[16 * row + col]) | uint32_t(a[16 * row + col + 1]) << 16;
  }
  float d[kN / 2], d2[kN / 2];
  for (int i = 0; i < kN / 2; ++i)
    d[i] = d2[i] = 0.0f;
  const uint64_t desc = c == WgmmaCase::SwizzledAligned || c == WgmmaCase::SwizzledUnaligned
                            ? wgmmaDescriptor(tile, 16, 1024, WgmmaLayout::Swizzle128)
                            : wgmmaDescriptor(tile, 128, 256);
  auto store = [&](float *to, const float(&from)[kN / 2]) {
    for (int i = 0; i < kN / 2; ++i) {
      const int row = 16 * warp + g + 8 * ((i % 4) >> 1), col = 8 * (i / 4) + 2 * tg + (i & 1);
      to[kN * row + col] = from[i];
    }
  };

  if (c == WgmmaCase::FragmentWrittenAfterFence) { // one correct round first
    wgmmaFence();
    wgmmaBf16<kN, false>(d, frag, desc, false);
    wgmmaCommit();
    wgmmaWait<0>();
    frag[1] += 1; // ... then no fence before the next wgmma reads it
  } else if (c != WgmmaCase::NoFence) {
    wgmmaFence();
  }
  if (c != WgmmaCase::WarpSkipsWgmma || warp != 1)
    wgmmaBf16<kN, false>(d, frag, desc, false);
  if (c == WgmmaCase::ChainedInOneGroup)
    wgmmaBf16<kN, false>(d, frag, desc, true);
  wgmmaCommit();
  switch (c) {
  case WgmmaCase::WaitLeavesNewestGroup:
    wgmmaBf16<kN, false>(d2, frag, desc, false);
    wgmmaCommit();
    wgmmaWait<1>();
    store(out, d);
    store(out2, d2); // still in flight
    wgmmaWait<0>();
    return;
  case WgmmaCase::ReadBeforeWait:
    store(out, d);
    break;
  case WgmmaCase::WriteAccumulatorInFlight:
    d[3] = 1.0f;
    break;
  case WgmmaCase::WriteAccumulatorBetweenChained:
    d[0] = 5.0f;
    wgmmaBf16<kN, false>(d, frag, desc, true);
    wgmmaCommit();
    break;
  case WgmmaCase::ChangeFragmentInFlight:
    frag[2] ^= 1u;
    break;
  case WgmmaCase::OverwriteSharedInFlight:
    if (t == 0)
      tile[bOffset(5, 3)] ^= 0x0100;
    break;
  case WgmmaCase::ExitInFlight:
    return;
  default:
    break;
  }
  wgmmaWait<0>();
  if (c != WgmmaCase::ReadBeforeWait)
    store(out, d);
}

} // namespace

void runWgmmaCase(WgmmaCase c, const uint16_t *a, const uint16_t *b, const uint16_t *bColumns,
                  float *out, float *out2) {
  PIPEC_LAUNCH(dim3(1), dim3(128), 3072, nullptr, wgmmaCaseKernel)
  (int(c), a, b, bColumns, out, out2);
}

} // namespace pipec::emu::test
