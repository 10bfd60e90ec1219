//===- AttentionBackward.cu - the attention backward on Hopper's wgmma (EXPERIMENTAL) -===//
//
// NOT IN THE MAIN LINE: these kernels pass every attention test on the kernel emulator
// (kernels/cuda/emu), where wgmma runs asynchronously and the PTX ISA's rules around it are
// checked, but have never run on a GPU. The main line's backward is mma.sync's
// (kernels/cuda/AttentionMmaSync.cu), which ran on an H200 at 14 % of the bf16 peak. A GPU run
// of this package's tests and benchmark (tools/gpu_check.sh runs both) decides whether it moves
// into kernels/cuda/ (docs/gpu.md). Compiled for sm_90a alone.
//
// Layouts are Attention.cuh's. For bf16 with a head dimension of 64 or 128 and 16-byte aligned
// tensors, on a compute-capability-9.0 GPU:
//   - the row dots D = dOut . out (and, for the fixed-point dQ, each row's max |dOut|);
//   - dQ on the Hopper forward's loop (queryGradWgmmaKernel: S and dP = dO V^T with Q and dO as
//     register operands, dQ += dS K with K read MN-major), unless a DqMode with atomics puts dQ
//     into the dK/dV kernel;
//   - dK/dV with two warpgroups of 64 keys whose K and V are shared-memory A operands (S^T = K
//     Q^T, dP^T = V dO^T), P^T and dS^T register operands for dV += P^T dO and dK += dS^T Q
//     (backwardKeyValueWgmmaKernel), and with atomics also dQ.
//
//===----------------------------------------------------------------------===//
#include "kernels/cuda/AttentionWgmma.cuh"
#include "kernels/cuda/experimental/Launch.h"

#include <algorithm>
#include <cmath>

namespace pipec::kernels::cuda::experimental {
namespace {

using namespace device;
using attention::Dims;
using attention::exp2Fast;
using attention::KeyValueTiles;
using attention::kLn2;
using attention::kLog2e;
using attention::launchWithSmem;
using attention::loadRowFragments;
using attention::pack;
using attention::storeRowPairs;
using attention::SwizzledCopy;

using attention::absBits;
using attention::BlockRows;

//===--- dQ on the forward's loop -----------------------------------------===//
//
// FlashAttention-2's dQ pass on the loop of kernels/cuda/AttentionWgmma.cu (two warpgroups of 64
// queries a block, K/V tiles in the 128-byte swizzle handed over through mbarriers, four
// buffers): per tile S = Q K^T and dP = dO V^T (dO's A fragments in registers too, V read K-major
// as K is), P = 2^(S scale log2(e) - lse log2(e)) masked, dS = P (dP - D) with D = rowDot, and
// dQ += dS K (K read MN-major, as V is for the forward's P V), overlapped with the next tile's S
// and dP; dq is written, times `scale`.

// dq (B, x, H*hd) bf16 from lse, rowDot (B, H, x), q, dOut (B, x, H*hd), k, v (a+x, B, H*hd), all
// bf16, 16-byte aligned. grid (ceil(x / 128), B*H), block 256; HD 64 or 128.
template <int HD>
__global__ void __launch_bounds__(KeyValueTiles<HD>::kThreads, 1)
    queryGradWgmmaKernel(bf16 *__restrict__ dq, const float *__restrict__ lse,
                         const bf16 *__restrict__ q, const bf16 *__restrict__ k,
                         const bf16 *__restrict__ v, const bf16 *__restrict__ dOut,
                         const float *__restrict__ rowDot, Dims s, float scale) {
  using Tiles = KeyValueTiles<HD>;
  constexpr int kBlockKeys = Tiles::kBlockKeys;
  const float scaleLog2 = scale * kLog2e;
  PIPEC_DYNAMIC_SHARED(float, smem);
  const BlockRows at(s);
  const int g = at.g, tg = at.tg, b = at.b, h = at.h, r0 = at.r0;
  // The first tiles load while the fragments are read.
  Tiles tiles(smem, k, v, s, b, h, at.lastPos / kBlockKeys + 1);
  const int groupFirstPos = s.begin + at.groupRow0;

  // Q's and dO's A fragments (rows r0 + g, r0 + g + 8), with the rows' statistics.
  uint32_t qf[HD / 16][4], dof[HD / 16][4];
  loadRowFragments<HD>(qf, q, s, b, h, r0 + g, tg);
  loadRowFragments<HD>(dof, dOut, s, b, h, r0 + g, tg);
  float lse2[2] = {0.0f, 0.0f}, dRow[2] = {0.0f, 0.0f}; // lse log2(e) and D of the rows
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int t = r0 + g + 8 * half;
    if (t < s.queries) {
      lse2[half] = lse[s.statRow(b, h, t)] * kLog2e;
      dRow[half] = rowDot[s.statRow(b, h, t)];
    }
  }

  const int pos[2] = {s.begin + r0 + g, s.begin + r0 + g + 8};
  float o[HD / 2]; // dQ' accumulators: element 4 dt + e is row g + 8 (e >> 1), dim 8 dt + ...
#pragma unroll
  for (int i = 0; i < HD / 2; ++i)
    o[i] = 0.0f;
  float sc[kBlockKeys / 2];        // the tile's scores, then its dS
  float dp[kBlockKeys / 2];        // the tile's dP
  uint32_t pf[kBlockKeys / 16][4]; // dS of the last tile, as dS K's A fragments

  auto issueScores = [&](int it) { // S = Q K^T and dP = dO V^T (V read K-major as K is)
    Tiles::issueRowsTimesTile(sc, qf, tiles.keysOf(it));
    Tiles::issueRowsTimesTile(dp, dof, tiles.valuesOf(it));
    wgmmaCommit();
  };
  auto issueDq = [&](int it) { // dQ' += dS K, K read MN-major
    Tiles::issueTileProduct(o, pf, tiles.keysOf(it));
    wgmmaCommit();
  };
  // dS of tile it from its scores and dP (masked), into sc.
  auto scoresToDs = [&](int it) {
    wgmmaFenceRegisters(sc);
    wgmmaFenceRegisters(dp);
    Tiles::maskCausal(sc, it * kBlockKeys, groupFirstPos, pos, tg);
#pragma unroll
    for (int i = 0; i < kBlockKeys / 2; ++i) {
      const int row = (i >> 1) & 1;
      const float p = exp2Fast(fmaf(sc[i], scaleLog2, -lse2[row])); // 0 where masked
      sc[i] = p * (dp[i] - dRow[row]);
    }
  };
  // dS as dS K's A fragments (once the previous tile's dS K, which reads them, has completed).
  auto packDs = [&](int) { Tiles::packTile(pf, sc); };
  // Tile i's S and dP with tile i - 1's dS K.
  tiles.overlap(o, issueScores, scoresToDs, packDs, issueDq);
#pragma unroll
  for (int row = 0; row < 2; ++row) {
    const int t = r0 + g + 8 * row;
    if (t < s.queries)
      storeRowPairs<HD>(dq + s.qRow(b, t, h), tg,
                        [&](int dt, int e) { return o[4 * dt + 2 * row + e] * scale; });
  }
}

//===--- dK/dV, and dQ by atomics -----------------------------------------===//

// The fixed-point dQ. Row t of dQ' = dS K is sum_j P_tj (dP_tj - D_t) K_j with sum_j P_tj = 1
// and |dP_tj| = |dO_t . V_j| <= hd max|dO_t| max|V|, so every element of it, and of any partial
// sum over keys, is at most kmax (hd max|dO_t| vmax + |D_t|) in magnitude (kmax = max|K|,
// vmax = max|V| of the (b, h) head): the row's bound, times 17/16 for bf16's rounding of dS and
// the fp32 sums. A row is added in units of 2^-e, e = kFixedBits - ceil(log2(bound)), so the
// sums stay below 2^kFixedBits, well inside int64, and are exact integers in any order. Their
// resolution is the bound times 2^-59, far finer than fp32's rounding of the terms. Each row's e
// is computed once (fixedPointScalesKernel) and read by the kernels that add and convert.
constexpr int kFixedBits = 59;

/// x 2^e rounded to an integer (|x 2^e| < 2^kFixedBits), and back.
__device__ __forceinline__ long long toFixed(float x, int e) { return __float2ll_rn(ldexpf(x, e)); }
__device__ __forceinline__ float fromFixed(long long x, int e) {
  return ldexpf(__ll2float_rn(x), -e);
}

// kvMaxAbs (B*H, 2) = the bits (absBits) of max |K| and max |V| over the finite values of each
// (b, h) head's keys, zeroed before: grid (B*H, ceil((a+x) / 64)), block 256, each block 64
// keys, the maxima by atomicMax (order-free). A row that reads a NaN or Inf of K or V gets a
// NaN D (through O) or a product that is not finite (its flag), so the bound need not cover it,
// and a head's other rows are not all made NaN by it.
__global__ void __launch_bounds__(256)
    keyValueMaxAbsKernel(unsigned *__restrict__ kvMaxAbs, const bf16 *__restrict__ k,
                         const bf16 *__restrict__ v, Dims s) {
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int b = blockIdx.x / s.heads, h = blockIdx.x % s.heads;
  constexpr unsigned kInfBits = 0x7f800000u;
  auto finiteBits = [](float x) {
    const unsigned bits = absBits(x);
    return bits < kInfBits ? bits : 0u;
  };
  unsigned kmax = 0, vmax = 0;
  const int end = min(s.keys(), int(blockIdx.y + 1) * 64);
  for (int j = int(blockIdx.y) * 64 + warp; j < end; j += 8)
    for (int d = lane; d < s.headDim; d += kWarp) {
      kmax = max(kmax, finiteBits(toFloat(k[s.kvRow(j, b, h) + d])));
      vmax = max(vmax, finiteBits(toFloat(v[s.kvRow(j, b, h) + d])));
    }
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    kmax = max(kmax, __shfl_xor_sync(kFullMask, kmax, offset));
    vmax = max(vmax, __shfl_xor_sync(kFullMask, vmax, offset));
  }
  if (lane == 0) {
    atomicMax(kvMaxAbs + 2 * blockIdx.x, kmax);
    atomicMax(kvMaxAbs + 2 * blockIdx.x + 1, vmax);
  }
}

// Per query row (B, H, x): rowExponent = e (a whole number as a float; NaN where the bound is
// not finite: a NaN or Inf in the row's dO or D), and rowFlag = 0 (the dK/dV kernel sets it
// where a product is not finite). grid (ceil(B*H*x / 256)), block 256.
__global__ void __launch_bounds__(256)
    fixedPointScalesKernel(float *__restrict__ rowExponent, unsigned *__restrict__ rowFlag,
                           const unsigned *__restrict__ rowMaxAbs, const float *__restrict__ rowDot,
                           const unsigned *__restrict__ kvMaxAbs, Dims s) {
  const size_t rows = size_t(s.batch) * s.heads * s.queries;
  const size_t stat = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  if (stat >= rows)
    return;
  const size_t head = stat / size_t(s.queries); // (stat = (b H + h) x + t)
  const float kmax = __uint_as_float(kvMaxAbs[2 * head]);
  const float vmax = __uint_as_float(kvMaxAbs[2 * head + 1]);
  const float bound =
      kmax * (float(s.headDim) * __uint_as_float(rowMaxAbs[stat]) * vmax + fabsf(rowDot[stat])) *
      (17.0f / 16.0f);
  float e = 0.0f;
  if (!(bound <= 3.402823466e38f)) {
    e = __int_as_float(0x7fc00000);
  } else if (bound > 0.0f) {
    int exponent = 0;
    (void)frexpf(bound, &exponent); // bound < 2^exponent
    e = float(kFixedBits - exponent);
  }
  rowExponent[stat] = e;
  rowFlag[stat] = 0;
}

// dq (bf16) = scale dqFixed (B, x, H*hd) in each row's units; NaN for a row whose exponent is
// NaN or whose flag is set. `quads` groups of 4 elements, each inside one row of a head.
__global__ void __launch_bounds__(256)
    fixedToBf16Kernel(bf16 *__restrict__ dq, const unsigned long long *__restrict__ dqFixed,
                      const float *__restrict__ rowExponent, const unsigned *__restrict__ rowFlag,
                      Dims s, size_t quads, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < quads;
       i += size_t(gridDim.x) * blockDim.x) {
    const size_t element = 4 * i, row = element / size_t(s.width());
    const int b = int(row / size_t(s.queries)), t = int(row % size_t(s.queries));
    const int h = int(element % size_t(s.width())) / s.headDim;
    const size_t stat = s.statRow(b, h, t);
    const float e = rowFlag[stat] ? __int_as_float(0x7fc00000) : rowExponent[stat];
    float x[4];
    for (int c = 0; c < 4; ++c)
      x[c] = e != e ? e : fromFixed((long long)dqFixed[element + c], int(e)) * scale;
    __nv_bfloat162 *to = reinterpret_cast<__nv_bfloat162 *>(dq) + 2 * i;
    to[0] = __floats2bfloat162_rn(x[0], x[1]);
    to[1] = __floats2bfloat162_rn(x[2], x[3]);
  }
}

// dk, dv (a+x, B, H*hd) fp32 (added to) from dOut, q (B, x, H*hd) bf16, lse, rowDot (B, H, x),
// k, v (a+x, B, H*hd) bf16, all 16-byte aligned. grid (ceil((a+x) / 128), B*H), block 256;
// HD 64 or 128.
//
// The backward's dK/dV on wgmma (FlashAttention-2's dK/dV pass, as
// backwardKeyValueTensorCoreKernel): a block of two warpgroups owns 128 keys (64 each, their K
// and V in shared memory as the A operands of S^T = K Q^T and dP^T = V dO^T, read K-major) and
// streams the 64-query tiles that can see them (Q, dO swizzled as the forward's K/V, their rows'
// lse log2(e) and D beside) through two buffers: per tile P^T = 2^(S^T scale log2(e) - lse
// log2(e)) masked, dS^T = P^T (dP^T - D), then dV += P^T dO and dK += dS^T Q with P^T and dS^T
// as register A fragments and dO, Q read MN-major. Every warpgroup runs every tile (a tile
// before its keys is wholly masked), so no wgmma sits on a divergent path.
//
// With Mode FloatAtomics or FixedPoint the same kernel also adds dQ' = dS K (dQ = scale dQ'): per
// tile, dS^T goes to shared memory (keys as rows, the 128-byte swizzled MN-major A of dQ's
// product) and, after a barrier, warpgroup w computes, with A = dS and B = K from shared memory
// (both MN-major), the columns [64 w, 64 w + 64) over the block's 128 keys (HD 128) or all 64
// columns over its own 64 keys (HD 64), then adds them with atomics: FloatAtomics into the fp32
// `dqFloat` (B, x, H*hd; zeroed before; the products times `scale`), whose last bits then
// depend on the order the blocks run in; FixedPoint into the 64-bit fixed-point `dqFixed` (the
// same layout), each row in units of 2^-e with e its `rowExponent` (fixedPointScalesKernel), so
// that the sums are exact integers whatever the order; a row with a product that is not finite
// gets its `rowFlag` set instead. That is 5 matrix products a tile instead of the 7 of this
// kernel and the dQ kernel (which recomputes S and dP).
template <int HD, DqMode Mode>
__global__ void __launch_bounds__(256, 1)
    backwardKeyValueWgmmaKernel(float *__restrict__ dk, float *__restrict__ dv,
                                float *__restrict__ dqFloat,
                                unsigned long long *__restrict__ dqFixed,
                                const float *__restrict__ rowExponent,
                                unsigned *__restrict__ rowFlag, const bf16 *__restrict__ dOut,
                                const float *__restrict__ lse, const float *__restrict__ rowDot,
                                const bf16 *__restrict__ q, const bf16 *__restrict__ k,
                                const bf16 *__restrict__ v, Dims s, float scale) {
  constexpr bool AtomicDq = Mode != DqMode::Separate;
  // Per query buffer: lse log2(e), D and (FixedPoint) the rows' fixed-point exponents.
  constexpr int kStats = Mode == DqMode::FixedPoint ? 192 : 128;
  static_assert(HD == 64 || HD == 128, "whole 128-byte swizzle rows");
  constexpr int kThreads = 256, kTile = 64 * HD;
  constexpr uint32_t kAtomBytes = 1024, kBlockBytes = 64 * 128; // 8 rows; 64 dims of 64 rows
  PIPEC_DYNAMIC_SHARED(float, smem);
  char *raw = reinterpret_cast<char *>(smem);
  // K and V of warpgroup w at tiles w and 2 + w; query buffer i's Q and dO at tiles 4 + 2 i and
  // 5 + 2 i; then (AtomicDq) dS^T, 128 keys of 64 queries; then the buffers' statistics.
  bf16 *tiles =
      reinterpret_cast<bf16 *>(raw + (kAtomBytes - sharedAddress(raw) % kAtomBytes) % kAtomBytes);
  bf16 *dsT = tiles + 8 * kTile;
  float *stats = reinterpret_cast<float *>(dsT + (AtomicDq ? 128 * 64 : 0));
  const int group = threadIdx.x / 128, warp = threadIdx.x / kWarp % 4, lane = threadIdx.x % kWarp;
  const int g = lane / 4, tg = lane % 4;
  const int b = blockIdx.y / s.heads, h = blockIdx.y % s.heads;
  const int n0 = blockIdx.x * 128, kw0 = n0 + 64 * group; // the block's, the warpgroup's keys
  const float scaleLog2 = scale * kLog2e;

  // A thread copies one chunk of every 16th (HD 128) or 32nd (HD 64) row of a 64-row tile.
  using Copy = SwizzledCopy<HD, kThreads>;
  const Copy copy;
  // Rows [row0, row0 + 64) (those from `rows` on as zeros), `stride` elements apart from
  // `first` (row row0's head), into the swizzled tile `to`.
  auto copyTile = [&](bf16 *to, const bf16 *first, size_t stride, int row0, int rows) {
#pragma unroll
    for (int c = 0; c < Copy::kCopies; ++c) {
      const int r = copy.row + c * Copy::kRowStep;
      bf16 *at = to + copy.shared + c * Copy::kRowStep * 64;
      if (row0 + r < rows)
        cpAsync16(at, first + size_t(r) * stride + copy.chunk * 8);
      else
        *reinterpret_cast<uint4 *>(at) = make_uint4(0, 0, 0, 0);
    }
  };
  const size_t keyStride = size_t(s.batch) * s.width(), queryStride = size_t(s.width());
  for (int w = 0; w < 2; ++w) {
    const int row0 = n0 + 64 * w;
    const size_t first = row0 < s.keys() ? s.kvRow(row0, b, h) : 0;
    copyTile(tiles + w * kTile, k + first, keyStride, row0, s.keys());
    copyTile(tiles + (2 + w) * kTile, v + first, keyStride, row0, s.keys());
  }
  auto loadQueries = [&](int t0, int buffer) { // Q, dO and the statistics of queries t0...
    const size_t first = s.qRow(b, t0, h);
    copyTile(tiles + (4 + 2 * buffer) * kTile, q + first, queryStride, t0, s.queries);
    copyTile(tiles + (5 + 2 * buffer) * kTile, dOut + first, queryStride, t0, s.queries);
    cpAsyncCommit();
    if (threadIdx.x < 128) {
      const int r = threadIdx.x % 64, t = t0 + r;
      const float *from = threadIdx.x < 64 ? lse : rowDot;
      const float factor = threadIdx.x < 64 ? kLog2e : 1.0f;
      stats[buffer * kStats + threadIdx.x] =
          t < s.queries ? from[s.statRow(b, h, t)] * factor : 0.0f;
    } else if (Mode == DqMode::FixedPoint && threadIdx.x < 192) {
      const int t = t0 + int(threadIdx.x) - 128;
      stats[buffer * kStats + threadIdx.x] = t < s.queries ? rowExponent[s.statRow(b, h, t)] : 0.0f;
    }
  };
  // Query t sees key j when s.begin + t >= j: the block's keys from query n0 - begin on.
  const int firstQuery = max(0, n0 - s.begin);
  const int tiles64 = firstQuery < s.queries ? (s.queries - firstQuery + 63) / 64 : 0;
  if (tiles64 > 0)
    loadQueries(firstQuery, 0);
  else
    cpAsyncCommit();

  float dkAcc[HD / 2], dvAcc[HD / 2], dqAcc[32];
#pragma unroll
  for (int i = 0; i < HD / 2; ++i)
    dkAcc[i] = dvAcc[i] = 0.0f;
  float st[32], dpt[32]; // S^T, then P^T; dP^T, then dS^T: 64 keys x 64 queries
  uint32_t pf[4][4], sf[4][4];
  const int key[2] = {kw0 + 16 * warp + g, kw0 + 16 * warp + g + 8};
  const bf16 *kA = tiles + group * kTile, *vA = tiles + (2 + group) * kTile;
  const uint64_t kDesc = wgmmaDescriptor(kA, 16, kAtomBytes, WgmmaLayout::Swizzle128);
  const uint64_t vDesc = wgmmaDescriptor(vA, 16, kAtomBytes, WgmmaLayout::Swizzle128);
  for (int it = 0; it < tiles64; ++it) {
    const int t0 = firstQuery + 64 * it, buffer = it & 1;
    const bf16 *qs = tiles + (4 + 2 * buffer) * kTile, *dos = qs + kTile;
    const float *lse2s = stats + buffer * kStats, *dRows = lse2s + 64;
    cpAsyncWait<0>();        // this thread's copies (K, V the first time) have landed
    fenceProxyAsyncShared(); // ... and are visible to wgmma after the barrier
    __syncthreads(); // every thread's (and the statistics); the other buffer is read no more
    if (it + 1 < tiles64)
      loadQueries(t0 + 64, buffer ^ 1);

    // S^T = K Q^T and dP^T = V dO^T: k-steps of 16 head dims, A and B K-major.
    const uint64_t qDesc = wgmmaDescriptor(qs, 16, kAtomBytes, WgmmaLayout::Swizzle128);
    const uint64_t doDesc = wgmmaDescriptor(dos, 16, kAtomBytes, WgmmaLayout::Swizzle128);
    wgmmaFence();
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      const uint64_t step = (kk / 4 * kBlockBytes + kk % 4 * 32) / 16;
      wgmmaBf16Shared64(st, kDesc + step, qDesc + step, kk > 0);
    }
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      const uint64_t step = (kk / 4 * kBlockBytes + kk % 4 * 32) / 16;
      wgmmaBf16Shared64(dpt, vDesc + step, doDesc + step, kk > 0);
    }
    wgmmaCommit();
    wgmmaWait<0>();
    wgmmaFenceRegisters(st);
    wgmmaFenceRegisters(dpt);

    // P^T and dS^T; element 4 n + 2 row + e is key key[row], query column 8 n + 2 t + e.
    // Visible when s.begin + t0 + column >= key, i.e. column >= key - s.begin - t0.
    const int from[2] = {key[0] - s.begin - t0 - 2 * tg, key[1] - s.begin - t0 - 2 * tg};
    const int past = s.queries - t0 - 2 * tg; // columns from here on are past the slice
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const int row = (i >> 1) & 1, column = (i >> 2) * 8 + (i & 1);
      const float2 l = *reinterpret_cast<const float2 *>(lse2s + (i >> 2) * 8 + 2 * tg);
      const float2 d = *reinterpret_cast<const float2 *>(dRows + (i >> 2) * 8 + 2 * tg);
      const bool visible = column >= from[row] && column < past;
      const float p = visible ? exp2Fast(fmaf(st[i], scaleLog2, -((i & 1) ? l.y : l.x))) : 0.0f;
      st[i] = p;
      dpt[i] = p * (dpt[i] - ((i & 1) ? d.y : d.x));
    }
#pragma unroll
    for (int ks2 = 0; ks2 < 4; ++ks2)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        pf[ks2][r] = pack(st[8 * ks2 + 2 * r], st[8 * ks2 + 2 * r + 1]);
        sf[ks2][r] = pack(dpt[8 * ks2 + 2 * r], dpt[8 * ks2 + 2 * r + 1]);
      }

    if constexpr (AtomicDq) {
      // dS^T into shared memory: sf[ks2][r] is key row (r & 1) (block-local 64 group + 16 warp
      // + g + 8 (r & 1), so its row % 8 is g), queries 8 n + 2 t, n = 2 ks2 + (r >> 1): chunk n
      // of the key's 128-byte row, swizzled.
#pragma unroll
      for (int ks2 = 0; ks2 < 4; ++ks2)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int row = 64 * group + 16 * warp + g + 8 * (r & 1), n = 2 * ks2 + (r >> 1);
          *reinterpret_cast<uint32_t *>(dsT + row * 64 + ((n ^ g) * 8) + 2 * tg) = sf[ks2][r];
        }
      fenceProxyAsyncShared(); // (for the other warps' wgmma, after the barrier below)
      // Zeros added to rather than a first product that writes over: the registers are then
      // free between the atomics and here, where the tile's S^T and dP^T need them.
#pragma unroll
      for (int i = 0; i < 32; ++i)
        dqAcc[i] = 0.0f;
      wgmmaFenceRegisters(dqAcc); // (the zeros are written before the wgmma.fence below)
    }

    // dV += P^T dO and dK += dS^T Q: k-steps of 16 queries, dO and Q read MN-major.
    const uint64_t doT = wgmmaDescriptor(dos, kBlockBytes, kAtomBytes, WgmmaLayout::Swizzle128);
    const uint64_t qT = wgmmaDescriptor(qs, kBlockBytes, kAtomBytes, WgmmaLayout::Swizzle128);
    wgmmaFence();
#pragma unroll
    for (int ks2 = 0; ks2 < 4; ++ks2)
      wgmmaBf16<HD, true>(dvAcc, pf[ks2], doT + ks2 * 2 * kAtomBytes / 16, true);
#pragma unroll
    for (int ks2 = 0; ks2 < 4; ++ks2)
      wgmmaBf16<HD, true>(dkAcc, sf[ks2], qT + ks2 * 2 * kAtomBytes / 16, true);
    wgmmaCommit();
    if constexpr (AtomicDq) {
      __syncthreads(); // every warpgroup's dS^T is in shared memory
      // dQ' = dS K: k-steps of 16 keys; A = dS^T's rows (MN-major: 64 queries each), B = K's
      // rows of the warpgroup's 64 columns (MN-major). HD 128: all 128 keys (K of both
      // warpgroups), columns 64 w on; HD 64: the warpgroup's own keys, all columns.
      constexpr int kSteps = HD == 128 ? 8 : 4;
      const int firstStep = HD == 128 ? 0 : 4 * group;
      const uint64_t dsDesc =
          wgmmaDescriptor(dsT, kBlockBytes, kAtomBytes, WgmmaLayout::Swizzle128);
#pragma unroll
      for (int i = 0; i < kSteps; ++i) {
        const int step = firstStep + i; // keys [16 step, 16 step + 16) of the block
        const bf16 *kB = tiles + step / 4 * kTile + (HD == 128 ? group * 64 * 64 : 0);
        const uint64_t kDescB =
            wgmmaDescriptor(kB, kBlockBytes, kAtomBytes, WgmmaLayout::Swizzle128);
        wgmmaBf16Shared64<true, true>(dqAcc, dsDesc + step * 2 * kAtomBytes / 16,
                                      kDescB + step % 4 * 2 * kAtomBytes / 16, true);
      }
      wgmmaCommit();
    }
    wgmmaWait<0>();
    wgmmaFenceRegisters(dvAcc);
    wgmmaFenceRegisters(dkAcc);
    if constexpr (AtomicDq) {
      wgmmaFenceRegisters(dqAcc);
      // dqAcc[4 j + e]: query t0 + 16 warp + g + 8 (e >> 1), column 8 j + 2 t + (e & 1) of the
      // warpgroup's 64.
      const int column0 = (HD == 128 ? 64 * group : 0) + 2 * tg;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int t = t0 + 16 * warp + g + 8 * half;
        if (t >= s.queries)
          continue;
        const size_t at = s.qRow(b, t, h) + column0;
        if constexpr (Mode == DqMode::FloatAtomics) {
#pragma unroll
          for (int j = 0; j < 8; ++j)
            atomicAdd(
                reinterpret_cast<float2 *>(dqFloat + at + 8 * j),
                make_float2(dqAcc[4 * j + 2 * half] * scale, dqAcc[4 * j + 2 * half + 1] * scale));
        } else {
          const float e = lse2s[128 + 16 * warp + g + 8 * half];
          if (e != e) // (NaN: a non-finite input; the scaling writes NaN into the row)
            continue;
          bool finite = true;
#pragma unroll
          for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              const float x = dqAcc[4 * j + 2 * half + c];
              if (fabsf(x) <= 3.402823466e38f)
                atomicAdd(dqFixed + at + 8 * j + c, (unsigned long long)toFixed(x, int(e)));
              else
                finite = false;
            }
          if (!finite) // (a NaN in Q or lse, say: the row's sum means nothing)
            rowFlag[s.statRow(b, h, t)] = 1;
        }
      }
    }
  }
  cpAsyncWait<0>(); // (with no tile, the K/V copies)

  // dK += scale dK', dV += dV' for the warpgroup's keys inside the sequence.
#pragma unroll
  for (int row = 0; row < 2; ++row) {
    const int j = key[row];
    if (j >= s.keys())
      continue;
    float *dkRow = dk + s.kvRow(j, b, h) + 2 * tg, *dvRow = dv + s.kvRow(j, b, h) + 2 * tg;
#pragma unroll
    for (int dt = 0; dt < HD / 8; ++dt) {
      float2 a = *reinterpret_cast<float2 *>(dkRow + dt * 8);
      a.x += dkAcc[4 * dt + 2 * row] * scale;
      a.y += dkAcc[4 * dt + 2 * row + 1] * scale;
      *reinterpret_cast<float2 *>(dkRow + dt * 8) = a;
      float2 c = *reinterpret_cast<float2 *>(dvRow + dt * 8);
      c.x += dvAcc[4 * dt + 2 * row];
      c.y += dvAcc[4 * dt + 2 * row + 1];
      *reinterpret_cast<float2 *>(dvRow + dt * 8) = c;
    }
  }
}

/// Where the backward's scratch (scratchFloats floats) keeps
/// what: rowDot (B*H*x), then for the float mode the fp32 dQ, for the fixed one the rows' max
/// |dOut|, exponents and flags, the heads' max |K| and |V| and the fixed-point dQ (8 bytes an
/// element); each part at a multiple of 4 floats. Null pointers for the parts the mode does not
/// use (or with no `base`).
struct Scratch {
  float *rowDot = nullptr, *dqFloat = nullptr, *rowExponent = nullptr;
  unsigned *rowMaxAbs = nullptr, *rowFlag = nullptr, *kvMaxAbs = nullptr;
  unsigned long long *dqFixed = nullptr;
  size_t floats = 0;
};
Scratch scratchLayout(const Dims &s, DqMode mode, float *base) {
  auto round4 = [](size_t n) { return (n + 3) / 4 * 4; };
  const size_t rows = size_t(s.batch) * s.heads * s.queries;
  const size_t elements = size_t(s.batch) * s.queries * s.width();
  Scratch r;
  auto take = [&](size_t floats) { // the next part's start
    float *at = base ? base + r.floats : nullptr;
    r.floats += round4(floats);
    return at;
  };
  r.rowDot = take(rows);
  if (mode == DqMode::FloatAtomics)
    r.dqFloat = take(elements);
  if (mode == DqMode::FixedPoint) {
    r.rowMaxAbs = reinterpret_cast<unsigned *>(take(rows));
    r.rowExponent = take(rows);
    r.rowFlag = reinterpret_cast<unsigned *>(take(rows));
    r.kvMaxAbs = reinterpret_cast<unsigned *>(take(2 * size_t(s.batch) * s.heads));
    r.dqFixed = reinterpret_cast<unsigned long long *>(take(2 * elements));
  }
  if (mode == DqMode::Separate)
    r.floats = rows; // (rowDot alone, unrounded)
  return r;
}

/// The backward's dQ on wgmma (two warpgroups, the mbarrier handoff), after rowDot.
template <int HD>
cudaError_t launchWgmmaQueryGrad(bf16 *dq, const float *lse, const float *rowDot, const bf16 *q,
                                 const bf16 *k, const bf16 *v, const bf16 *dOut, const Dims &s,
                                 cudaStream_t stream) {
  using Tiles = KeyValueTiles<HD>;
  const dim3 grid(ceilDiv(s.queries, Tiles::kBlockQueries), unsigned(s.batch * s.heads));
  return launchWithSmem(queryGradWgmmaKernel<HD>, grid, Tiles::kThreads, Tiles::kSharedBytes,
                        Tiles::kSharedBytes, stream, dq, lse, q, k, v, dOut, rowDot, s,
                        1.0f / std::sqrt(float(HD)));
}

/// The Hopper dK/dV kernel; in the float and fixed modes dQ too: into the scratch's fp32 or
/// fixed-point dQ (zeroed first; the fixed mode's bounds computed first), then scaled into `dq`.
template <int HD, DqMode Mode>
cudaError_t launchWgmmaKeyValueGrad(bf16 *dq, float *dk, float *dv, const Scratch &scratch,
                                    const bf16 *dOut, const float *lse, const bf16 *q,
                                    const bf16 *k, const bf16 *v, const Dims &s,
                                    cudaStream_t stream) {
  constexpr bool kAtomicDq = Mode != DqMode::Separate;
  const float scale = 1.0f / std::sqrt(float(HD));
  const size_t elements = size_t(s.batch) * s.queries * s.width();
  if constexpr (Mode == DqMode::FloatAtomics)
    if (cudaError_t err = cudaMemsetAsync(scratch.dqFloat, 0, elements * sizeof(float), stream))
      return err;
  if constexpr (Mode == DqMode::FixedPoint) {
    const size_t heads = size_t(s.batch) * s.heads, rows = heads * s.queries;
    if (cudaError_t err = cudaMemsetAsync(scratch.kvMaxAbs, 0, 2 * heads * 4, stream))
      return err;
    PIPEC_LAUNCH(dim3(unsigned(heads), unsigned(ceilDiv(s.keys(), 64))), 256, 0, stream,
                 keyValueMaxAbsKernel)
    (scratch.kvMaxAbs, k, v, s);
    PIPEC_LAUNCH(dim3(unsigned(ceilDiv(rows, size_t(256)))), 256, 0, stream, fixedPointScalesKernel)
    (scratch.rowExponent, scratch.rowFlag, scratch.rowMaxAbs, scratch.rowDot, scratch.kvMaxAbs, s);
    if (cudaError_t err = cudaGetLastError())
      return err;
    if (cudaError_t err = cudaMemsetAsync(scratch.dqFixed, 0, elements * 8, stream))
      return err;
  }
  const size_t smem = sizeof(bf16) * 8 * 64 * HD + 1024 +
                      (kAtomicDq ? sizeof(bf16) * 128 * 64 : 0) +
                      2 * (Mode == DqMode::FixedPoint ? 192 : 128) * sizeof(float);
  if (cudaError_t err =
          launchWithSmem(backwardKeyValueWgmmaKernel<HD, Mode>,
                         dim3(ceilDiv(s.keys(), 128), unsigned(s.batch * s.heads)), 256, smem, smem,
                         stream, dk, dv, scratch.dqFloat, scratch.dqFixed,
                         static_cast<const float *>(scratch.rowExponent), scratch.rowFlag, dOut,
                         lse, static_cast<const float *>(scratch.rowDot), q, k, v, s, scale))
    return err;
  if constexpr (Mode == DqMode::FloatAtomics) // (the products were scaled before the atomics)
    return cuda::launch::convert(DType::BF16, dq, DType::F32, scratch.dqFloat, elements, stream);
  if constexpr (Mode == DqMode::FixedPoint) {
    const size_t quads = elements / 4; // (HD is 64 or 128: a quad is inside one head's row)
    PIPEC_LAUNCH(dim3(unsigned(std::min<size_t>(ceilDiv(quads, size_t(256)), 4096))), 256, 0,
                 stream, fixedToBf16Kernel)
    (dq, scratch.dqFixed, scratch.rowExponent, scratch.rowFlag, s, quads, scale);
    return cudaGetLastError();
  }
  return cudaSuccess;
}

} // namespace

namespace launch {

bool wgmmaBackwardHeadDim(int headDim) { return headDim == 64 || headDim == 128; }

size_t scratchFloats(DqMode mode, AttentionDims s) {
  return scratchLayout(attention::toDims(s), mode, nullptr).floats;
}

cudaError_t attentionBackwardWgmma(DqMode mode, void *dq, float *dk, float *dv, const void *dOut,
                                   const void *out, const float *lse, const void *q, const void *k,
                                   const void *v, float *scratch, AttentionDims dims,
                                   cudaStream_t stream) {
  const Dims s = attention::toDims(dims);
  if (s.batch == 0 || s.queries == 0 || s.heads == 0)
    return cudaSuccess;
  if (!wgmmaBackwardHeadDim(s.headDim))
    return cudaErrorInvalidValue;
  const Scratch parts = scratchLayout(s, mode, scratch);
  auto *dqT = static_cast<bf16 *>(dq);
  const auto *dOutT = static_cast<const bf16 *>(dOut), *qT = static_cast<const bf16 *>(q),
             *kT = static_cast<const bf16 *>(k), *vT = static_cast<const bf16 *>(v);
  // The row dots D (and, for the fixed-point dQ, each row's max |dOut|: its bound's).
  if (cudaError_t err =
          attention::rowDot(DType::BF16, parts.rowDot, dOut, out, s, stream, parts.rowMaxAbs))
    return err;
  auto run = [&]<int HD>() -> cudaError_t {
    switch (mode) {
    case DqMode::FloatAtomics:
      return launchWgmmaKeyValueGrad<HD, DqMode::FloatAtomics>(dqT, dk, dv, parts, dOutT, lse, qT,
                                                               kT, vT, s, stream);
    case DqMode::FixedPoint:
      return launchWgmmaKeyValueGrad<HD, DqMode::FixedPoint>(dqT, dk, dv, parts, dOutT, lse, qT, kT,
                                                             vT, s, stream);
    case DqMode::Separate:
      break;
    }
    if (cudaError_t err =
            launchWgmmaQueryGrad<HD>(dqT, lse, parts.rowDot, qT, kT, vT, dOutT, s, stream))
      return err;
    return launchWgmmaKeyValueGrad<HD, DqMode::Separate>(dqT, dk, dv, parts, dOutT, lse, qT, kT, vT,
                                                         s, stream);
  };
  return s.headDim == 64 ? run.template operator()<64>() : run.template operator()<128>();
}

} // namespace launch
} // namespace pipec::kernels::cuda::experimental
