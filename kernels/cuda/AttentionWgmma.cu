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
// (Four other arrangements of the same loop, one warpgroup a block or serial S, softmax and
// P V, measured 398-438 TFLOP/s on the same H200 and were removed; git history has them.)
//
//===----------------------------------------------------------------------===//
#include "kernels/cuda/Attention.cuh"
#include "kernels/cuda/Wgmma.cuh"

#include <cmath>

namespace pipec::kernels::cuda::attention {
namespace {

using namespace device;

constexpr int kGroups = 2;                         // warpgroups a block
constexpr int kThreads = kGroups * 128;            // threads a block
constexpr int kBlockQueries = kGroups * 64;        // query rows a block
constexpr int kBlockKeys = 64;                     // keys a tile
constexpr int kStages = 4;                         // K/V buffers
constexpr int kAhead = 2;                          // tiles loading ahead of the one scored
constexpr int kBarrierBytes = 64;                  // the buffers' `full` and `empty` mbarriers
constexpr uint32_t kAtomBytes = 1024;              // the swizzle's atom: 8 rows of 128 bytes
constexpr uint32_t kBlockBytes = kBlockKeys * 128; // a tile's 64 head dims of its 64 rows

/// The mbarriers, the K/V buffers (64 rows of HD each, K then V) and 1024 bytes to align them.
constexpr size_t sharedBytes(int hd) {
  return sizeof(bf16) * size_t(2 * kStages * kBlockKeys) * hd + kAtomBytes + kBarrierBytes;
}

// out (B, x, H*hd) bf16, lse (B, H, x) from q (B, x, H*hd), k, v (a+x, B, H*hd), all bf16,
// 16-byte aligned. grid (ceil(x / 128), B*H), block 256; HD 64 or 128.
template <int HD>
__global__ void __launch_bounds__(kThreads, 1)
    forwardWgmmaKernel(bf16 *__restrict__ out, float *__restrict__ lse, const bf16 *__restrict__ q,
                       const bf16 *__restrict__ k, const bf16 *__restrict__ v, Dims s,
                       float scale) {
  static_assert(HD == 64 || HD == 128, "whole 128-byte swizzle rows; wgmma's n for P V");
  const float scaleLog2 = scale * kLog2e;
  constexpr int kTile = kBlockKeys * HD;
  PIPEC_DYNAMIC_SHARED(float, smem);
  // Buffer i's `full` and `empty` mbarriers first.
  uint64_t *full = reinterpret_cast<uint64_t *>(smem), *empty = full + kStages;
  static_assert(2 * kStages * sizeof(uint64_t) <= kBarrierBytes, "room for the mbarriers");
  char *buffers = reinterpret_cast<char *>(smem) + kBarrierBytes;
  // Stage i: K at 2 i kTile, V kTile on; aligned to the swizzle's atom.
  bf16 *kvBuf = reinterpret_cast<bf16 *>(
      buffers + (kAtomBytes - sharedAddress(buffers) % kAtomBytes) % kAtomBytes);
  const int group = threadIdx.x / 128, warp = threadIdx.x / kWarp % 4, lane = threadIdx.x % kWarp;
  const int g = lane / 4, tg = lane % 4;
  const int b = blockIdx.y / s.heads, h = blockIdx.y % s.heads;
  const int m0 = (int(gridDim.x) - 1 - int(blockIdx.x)) * kBlockQueries;
  const int groupRow0 = m0 + 64 * group, r0 = groupRow0 + 16 * warp; // first rows
  // A thread copies the same chunk of rows r, r + R, r + 2 R, ... of every tile (R = kThreads /
  // (HD / 8), a multiple of 8, so the chunk's swizzled place is the same in each): its offsets
  // in shared memory and from the tile's first row are worked out once.
  constexpr int kChunks = HD / 8, kRowStep = kThreads / kChunks;
  constexpr int kCopies = kBlockKeys / kRowStep; // a thread's copies of K (and of V) a tile
  static_assert(kThreads % kChunks == 0 && kRowStep % 8 == 0 && kBlockKeys % kRowStep == 0,
                "every thread copies one chunk of every R-th row");
  const int copyRow = int(threadIdx.x) / kChunks, copyChunk = int(threadIdx.x) % kChunks;
  const int copyShared =
      copyChunk / 8 * (kBlockKeys * 64) + copyRow * 64 + ((copyChunk % 8) ^ (copyRow % 8)) * 8;
  const size_t keyStride = size_t(s.batch) * s.width(); // from one position's row to the next
  const size_t copyGlobal = s.kvRow(copyRow, b, h) + size_t(copyChunk) * 8;
  // This thread's share of tile `tile`'s copies, tracked by the buffer's `full` mbarrier (rows
  // past the keys are zeros, written by cp.async too so that the mbarrier covers them).
  auto loadTile = [&](int tile) {
    const int stage = tile % kStages;
    bf16 *to = kvBuf + stage * 2 * kTile + copyShared;
    const size_t from = copyGlobal + size_t(tile) * kBlockKeys * keyStride;
    const int rowsLeft = s.keys() - tile * kBlockKeys - copyRow; // rows of this thread's in range
#pragma unroll
    for (int c = 0; c < kCopies; ++c) {
      bf16 *kTo = to + c * kRowStep * 64, *vTo = kTo + kTile;
      const size_t at = from + size_t(c) * kRowStep * keyStride;
      if (c * kRowStep < rowsLeft) {
        cpAsync16(kTo, k + at);
        cpAsync16(vTo, v + at);
      } else {
        cpAsync16Zero(kTo, k);
        cpAsync16Zero(vTo, v);
      }
    }
    cpAsyncMbarrierArrive(&full[stage]);
  };

  // The block's tiles cover keys [0, lastPos].
  const int lastPos = s.begin + min(s.queries, m0 + kBlockQueries) - 1;
  const int tiles = lastPos / kBlockKeys + 1;
  const int groupFirstPos = s.begin + groupRow0;

  if (threadIdx.x == 0)
    for (int i = 0; i < kStages; ++i) {
      mbarrierInit(&full[i], kThreads);  // every thread, as its copies land
      mbarrierInit(&empty[i], kThreads); // every thread, done with the buffer
    }
  __syncthreads();
  // The first tiles load while Q's fragments are read.
  for (int t = 0; t < kAhead && t < tiles; ++t)
    loadTile(t);

  // Q's A fragments (rows r0 + g, r0 + g + 8).
  uint32_t qf[HD / 16][4];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int t = r0 + g + 8 * half;
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const size_t at = s.qRow(b, t, h) + kk * 16 + 8 * c + 2 * tg;
        qf[kk][half + 2 * c] = t < s.queries ? load32(q + at) : 0u;
      }
  }

  const int pos[2] = {s.begin + r0 + g, s.begin + r0 + g + 8};
  float o[HD / 2]; // P V accumulators: element 4 dt + e is row g + 8 (e >> 1), dim 8 dt + ...
#pragma unroll
  for (int i = 0; i < HD / 2; ++i)
    o[i] = 0.0f;
  // Running row maxima of the scores times scaleLog2, and row sums of 2^(that - max).
  float rowMax[2] = {-INFINITY, -INFINITY}, rowSum[2] = {0.0f, 0.0f};
  float sc[kBlockKeys / 2];        // the tile's scores, then its probabilities
  uint32_t pf[kBlockKeys / 16][4]; // P of the last scored tile, as P V's A fragments

  // One descriptor a tile; a k-step's is that plus its byte offset in 16-byte units (the start
  // address field, bits 0-13, does not overflow: shared memory ends below 256 KiB).
  auto issueScores = [&](const bf16 *ks) {
    const uint64_t base = wgmmaDescriptor(ks, 16, kAtomBytes, WgmmaLayout::Swizzle128);
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk)
      wgmmaBf16<kBlockKeys, false>(sc, qf[kk], base + (kk / 4 * kBlockBytes + kk % 4 * 32) / 16,
                                   kk > 0);
    wgmmaCommit();
  };
  auto issueValues = [&](const bf16 *vs) {
    const uint64_t base = wgmmaDescriptor(vs, kBlockBytes, kAtomBytes, WgmmaLayout::Swizzle128);
#pragma unroll
    for (int ks2 = 0; ks2 < kBlockKeys / 16; ++ks2)
      wgmmaBf16<HD, true>(o, pf[ks2], base + ks2 * 2 * kAtomBytes / 16, true);
    wgmmaCommit();
  };
  // The online softmax of the scores of the tile at key j0: returns the rescaling of O.
  auto softmax = [&](int j0, float(&correction)[2]) {
    float tileMax[2] = {-INFINITY, -INFINITY};
    if (j0 + kBlockKeys - 1 > groupFirstPos) { // some key is past some row's position
      // Key j0 + 8 n + 2 t + e of element 4 n + 2 row + e is visible while below the row's
      // limit (relative to the lane's first key of the tile).
      const int limit[2] = {pos[0] - j0 - 2 * tg, pos[1] - j0 - 2 * tg};
#pragma unroll
      for (int i = 0; i < kBlockKeys / 2; ++i)
        if ((i >> 2) * 8 + (i & 1) > limit[(i >> 1) & 1])
          sc[i] = -INFINITY;
    }
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

  // O *= correction, and P's A fragments of k-step ks (keys [16 ks, 16 ks + 16)): the score
  // accumulators of n-tiles 2 ks and 2 ks + 1.
  auto rescaleAndPack = [&](const float(&correction)[2]) {
#pragma unroll
    for (int i = 0; i < HD / 2; ++i)
      o[i] *= correction[(i >> 1) & 1];
#pragma unroll
    for (int ks2 = 0; ks2 < kBlockKeys / 16; ++ks2)
#pragma unroll
      for (int r = 0; r < 4; ++r)
        pf[ks2][r] = pack(sc[8 * ks2 + 2 * r], sc[8 * ks2 + 2 * r + 1]);
  };

  // Every warpgroup runs every tile of the block, so no wgmma sits on a path that differs
  // between threads (ptxas serializes those): a warpgroup's rows that precede a tile have all its
  // keys masked (the tile adds nothing), and rows past the slice compute on zero queries.
  auto landed = [&](int it) { // tile it in shared memory for wgmma; tile it + kAhead loading
    mbarrierWait(&full[it % kStages], (it / kStages) & 1); // every thread's copies landed
    fenceProxyAsyncShared(); // ... and the generic proxy's writes are seen by wgmma
    const int next = it + kAhead;
    if (next < tiles) {
      if (next >= kStages) // its buffer's last tile, next - kStages, is read no more
        mbarrierWait(&empty[next % kStages], (next / kStages - 1) & 1);
      loadTile(next);
    }
  };
  auto buffer = [&](int it) { return kvBuf + (it % kStages) * 2 * kTile; };
  float correction[2];
  // Tile 0's scores alone; then tile i's scores with tile i - 1's P V, whose buffer stays
  // intact while tiles i + 1 and i + 2 load into the others; then the last tile's P V.
  landed(0);
  wgmmaFence();
  issueScores(buffer(0));
  wgmmaWait<0>();
  wgmmaFenceRegisters(sc);
  softmax(0, correction);
  rescaleAndPack(correction);
  for (int it = 1; it < tiles; ++it) {
    landed(it);
    wgmmaFence();
    issueScores(buffer(it));
    issueValues(buffer(it - 1) + kTile);
    wgmmaWait<1>(); // the scores; P V may still run
    wgmmaFenceRegisters(sc);
    softmax(it * kBlockKeys, correction);
    wgmmaWait<0>();
    wgmmaFenceRegisters(o);
    mbarrierArrive(&empty[(it - 1) % kStages]); // tile it - 1 is read no more
    rescaleAndPack(correction);
  }
  wgmmaFence();
  issueValues(buffer(tiles - 1) + kTile);
  wgmmaWait<0>();
  wgmmaFenceRegisters(o);

#pragma unroll
  for (int row = 0; row < 2; ++row) {
    rowSum[row] += __shfl_xor_sync(kFullMask, rowSum[row], 1);
    rowSum[row] += __shfl_xor_sync(kFullMask, rowSum[row], 2);
    const int t = r0 + g + 8 * row;
    if (t >= s.queries)
      continue;
    const float inv = 1.0f / rowSum[row];
    bf16 *dst = out + s.qRow(b, t, h) + 2 * tg;
#pragma unroll
    for (int dt = 0; dt < HD / 8; ++dt)
      *reinterpret_cast<__nv_bfloat162 *>(dst + dt * 8) =
          __floats2bfloat162_rn(o[4 * dt + 2 * row] * inv, o[4 * dt + 2 * row + 1] * inv);
    if (tg == 0)
      lse[s.statRow(b, h, t)] = (rowMax[row] + log2f(rowSum[row])) * kLn2;
  }
}

template <int HD>
cudaError_t launchForward(bf16 *out, float *lse, const bf16 *q, const bf16 *k, const bf16 *v,
                          const Dims &s, cudaStream_t stream) {
  const dim3 grid(ceilDiv(s.queries, kBlockQueries), unsigned(s.batch * s.heads));
  const size_t smem = sharedBytes(HD);
  return launchWithSmem(forwardWgmmaKernel<HD>, grid, kThreads, smem, smem, stream, out, lse, q, k,
                        v, s, 1.0f / std::sqrt(float(HD)));
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
