//===- AttentionWgmma.cu - the attention forward on Hopper's warpgroup MMA --===//
//
// The forward on sm_90a's wgmma (Wgmma.cuh), for bf16 with a head dimension of 64 or 128 and
// 16-byte aligned tensors. This file is compiled for sm_90a alone (kernels/BUILD): its kernel
// runs only on a compute-capability-9.0 GPU, and Attention.cu chooses it only there. It ran on an
// H200 at 458 TFLOP/s (46 % of the dense bf16 peak; the mma.sync forward: 160) and passed
// cuda_kernel_test there (docs/gpu.md). Layouts: Attention.cuh.
//
// A block of two warpgroups owns 128 query rows (64 each) and streams 64-key tiles of K and V
// through four shared buffers with cp.async. Per tile, each warpgroup computes its 64 x 64
// scores S = Q K^T with wgmma m64n64k16 (Q's A fragments stay in registers, loaded once from
// global memory), runs the online softmax on the accumulators (their layout is mma.sync's, per
// warp), and adds P V with wgmma m64nHDk16, P's A fragments packed from the score accumulators.
// Both products take A from registers, so the tensor cores read only K or V from shared memory.
// A warpgroup issues tile i's S and tile i - 1's P V together and runs tile i's softmax while P V
// is still on the tensor cores (FlashAttention-3's intra-warpgroup overlap).
//
// Tiles change hands through mbarriers instead of a block-wide barrier: tile i + 2 loads while
// tile i is scored and tile i - 1's V is read; every thread copies its share of a tile and its
// copies' completion arrives on the buffer's `full` mbarrier, which every thread waits for
// before the tile's products; after its P V of a tile, every thread arrives on the buffer's
// `empty` mbarrier, which a thread waits for before it copies into that buffer again. A
// warpgroup can so run up to a tile ahead of the other, and one's softmax overlaps the other's
// products.
//
// The K and V tiles are stored in wgmma's 128-byte swizzled layout: a tile of 64 rows is HD / 64
// column blocks of 64 rows x 128 bytes (64 head dims), row r of a block 128 bytes on, and its
// 16-byte chunk c (dims [8 c, 8 c + 8) of the block) at chunk c ^ (r % 8) of the row; the
// buffers are 1024-byte aligned (the swizzle's atom). The same bytes are B's K-major layout for
// S (n = keys: 8 rows are 1024 bytes; a k-step of 16 dims starts 32 bytes on in its block) and
// its MN-major layout for P V (k = keys: 8 rows 1024 bytes on; n = dims: the next block of 64
// is 64 x 128 bytes on). Eight threads copy a row's 128 bytes of a block, into 128 contiguous
// bytes of shared memory: whole sectors read, no bank conflicts written. The tiles are written
// through the generic proxy (cp.async) and read by wgmma through the async proxy: every thread
// fences the proxies after its copies land. Blocks take their query blocks heaviest (last)
// first. The causal mask is applied only on tiles that reach past the warpgroup's first row.
//
// The loop itself (the K/V pipeline, the overlap of a tile's scores with the tile before's P V,
// the products' descriptors) is KeyValueTiles in AttentionWgmma.cuh, which the experimental
// backward's dQ kernel runs too.
//
// (Four other arrangements of the same loop, one warpgroup a block or serial S, softmax and
// P V, measured 398-438 TFLOP/s on the same H200 and were removed; git history has them.)
//
//===----------------------------------------------------------------------===//
#include "kernels/cuda/AttentionWgmma.cuh"

#include <cmath>

namespace pipec::kernels::cuda::attention {
namespace {

using namespace device;

// out (B, x, H*hd) bf16, lse (B, H, x) from q (B, x, H*hd), k, v (a+x, B, H*hd), all bf16,
// 16-byte aligned. grid (ceil(x / 128), B*H), block 256; HD 64 or 128.
template <int HD>
__global__ void __launch_bounds__(KeyValueTiles<HD>::kThreads, 1)
    forwardWgmmaKernel(bf16 *__restrict__ out, float *__restrict__ lse, const bf16 *__restrict__ q,
                       const bf16 *__restrict__ k, const bf16 *__restrict__ v, Dims s,
                       float scale) {
  using Tiles = KeyValueTiles<HD>;
  constexpr int kBlockKeys = Tiles::kBlockKeys;
  const float scaleLog2 = scale * kLog2e;
  PIPEC_DYNAMIC_SHARED(float, smem);
  const BlockRows at(s);
  const int g = at.g, tg = at.tg, b = at.b, h = at.h, r0 = at.r0;
  // The first tiles load while Q's fragments are read.
  Tiles tiles(smem, k, v, s, b, h, at.lastPos / kBlockKeys + 1);
  const int groupFirstPos = s.begin + at.groupRow0;

  uint32_t qf[HD / 16][4]; // Q's A fragments (rows r0 + g, r0 + g + 8)
  loadRowFragments<HD>(qf, q, s, b, h, r0 + g, tg);

  const int pos[2] = {s.begin + r0 + g, s.begin + r0 + g + 8};
  float o[HD / 2]; // P V accumulators: element 4 dt + e is row g + 8 (e >> 1), dim 8 dt + ...
#pragma unroll
  for (int i = 0; i < HD / 2; ++i)
    o[i] = 0.0f;
  // Running row maxima of the scores times scaleLog2, and row sums of 2^(that - max).
  float rowMax[2] = {-INFINITY, -INFINITY}, rowSum[2] = {0.0f, 0.0f};
  float sc[kBlockKeys / 2];        // the tile's scores, then its probabilities
  uint32_t pf[kBlockKeys / 16][4]; // P of the last scored tile, as P V's A fragments

  auto issueScores = [&](int it) { // S = Q K^T
    Tiles::issueRowsTimesTile(sc, qf, tiles.keysOf(it));
    wgmmaCommit();
  };
  auto issueValues = [&](int it) { // O += P V
    Tiles::issueTileProduct(o, pf, tiles.valuesOf(it));
    wgmmaCommit();
  };
  float correction[2]; // the last tile's rescaling of O
  // The online softmax of the scores of tile it.
  auto softmax = [&](int it) {
    wgmmaFenceRegisters(sc);
    Tiles::maskCausal(sc, it * kBlockKeys, groupFirstPos, pos, tg);
    float tileMax[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int i = 0; i < kBlockKeys / 2; ++i)
      tileMax[(i >> 1) & 1] = fmaxf(tileMax[(i >> 1) & 1], sc[i]);
#pragma unroll
    for (int row = 0; row < 2; ++row) {
      tileMax[row] = fmaxf(tileMax[row], __shfl_xor_sync(kFullMask, tileMax[row], 1));
      tileMax[row] = fmaxf(tileMax[row], __shfl_xor_sync(kFullMask, tileMax[row], 2));
      // Finite: key 0 of the first tile is visible to every row (rows past the slice see
      // every key of their tiles).
      const float newMax = fmaxf(rowMax[row], tileMax[row] * scaleLog2);
      correction[row] = exp2Fast(rowMax[row] - newMax);
      rowMax[row] = newMax;
      rowSum[row] *= correction[row];
    }
#pragma unroll
    for (int i = 0; i < kBlockKeys / 2; ++i) {
      const int row = (i >> 1) & 1;
      const float p = exp2Fast(fmaf(sc[i], scaleLog2, -rowMax[row]));
      sc[i] = p;
      rowSum[row] += p;
    }
  };
  // O *= correction, and P as P V's A fragments.
  auto rescaleAndPack = [&](int) {
#pragma unroll
    for (int i = 0; i < HD / 2; ++i)
      o[i] *= correction[(i >> 1) & 1];
    Tiles::packTile(pf, sc);
  };
  // Tile i's scores with tile i - 1's P V, whose buffer stays intact while tiles i + 1 and
  // i + 2 load into the others.
  tiles.overlap(o, issueScores, softmax, rescaleAndPack, issueValues);

  storeForwardRows<HD>(out, lse, s, b, h, r0 + g, tg, rowMax, rowSum,
                       [&](int dt, int row, int e) { return o[4 * dt + 2 * row + e]; });
}

template <int HD>
cudaError_t launchForward(bf16 *out, float *lse, const bf16 *q, const bf16 *k, const bf16 *v,
                          const Dims &s, cudaStream_t stream) {
  using Tiles = KeyValueTiles<HD>;
  const dim3 grid(ceilDiv(s.queries, Tiles::kBlockQueries), unsigned(s.batch * s.heads));
  return launchWithSmem(forwardWgmmaKernel<HD>, grid, Tiles::kThreads, Tiles::kSharedBytes,
                        Tiles::kSharedBytes, stream, out, lse, q, k, v, s,
                        1.0f / std::sqrt(float(HD)));
}

} // namespace

bool wgmmaHeadDim(int headDim) { return headDim == 64 || headDim == 128; }

cudaError_t wgmmaForward(bf16 *out, float *lse, const bf16 *q, const bf16 *k, const bf16 *v,
                         const Dims &s, cudaStream_t stream) {
  switch (s.headDim) {
  case 64:
    return launchForward<64>(out, lse, q, k, v, s, stream);
  case 128:
    return launchForward<128>(out, lse, q, k, v, s, stream);
  }
  return cudaErrorInvalidValue;
}

} // namespace pipec::kernels::cuda::attention
