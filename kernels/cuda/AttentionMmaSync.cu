//===- AttentionMmaSync.cu - causal attention on the tensor cores (mma.sync) -===//
//
// FlashAttention-2 on mma.sync.m16n8k16 (bf16 in, fp32 accumulate; sm_80 and newer): the
// forward, and the backward without atomics (one kernel for dQ, one for dK and dV), for bf16
// with a head dimension that is a multiple of 16 up to 128 and 16-byte aligned tensors. On an
// sm_80 GPU (A100) these are the attention kernels of every such shape; on an sm_90 one (H100,
// H200) the backward's, and the forward's when the Hopper kernels are off or the head dimension
// is not 64 or 128 (Attention.cu chooses). Layouts: Attention.cuh.
//
//===----------------------------------------------------------------------===//
#include "kernels/cuda/Attention.cuh"

#include <cmath>

namespace pipec::kernels::cuda::attention {
namespace {

using namespace device;

//===--- Tensor-core forward (bf16) ---------------------------------------===//
//
// FlashAttention-2's forward on mma.sync.m16n8k16 (bf16 in, fp32 accumulate): a block of four
// warps owns 64 query rows, 16 per warp, and streams 64-key tiles of K and V through two shared
// buffers: the next tile's cp.async copies are in flight while the current one is used (the
// backward kernels stream theirs the same way). Per tile, a warp computes its 16 x 64 scores
// S = Q K^T (Q's fragments stay in registers for the whole loop), masks them causally, updates
// the running row maxima and sums (online softmax in base 2), rescales its output accumulators
// and adds P V, with P rounded to bf16 as the A operand straight from the score accumulators (a
// 16 x 8 accumulator pair is exactly a 16 x 16 A fragment). V stays row-major in shared memory;
// its B fragments (V's rows are the k of P V) come from ldmatrix .trans, which also keeps the
// stores conflict-free. The row sums stay per lane until the end (their scale factors are equal
// across the four lanes of a row), then one shuffle pair reduces them. Warps whose rows are all
// past the slice, or whose rows all precede a tile, skip its math (but not its barriers).
// Fragment layouts are the PTX ISA's (Device.cuh, mmaBf16).

namespace tc {
constexpr int kWarps = 4;
constexpr int kRowsPerWarp = 16;
constexpr int kBlockQueries = kWarps * kRowsPerWarp;
constexpr int kBlockKeys = 64;
constexpr int kThreads = kWarps * kWarp;
constexpr int kMaxHeadDim = 128;
constexpr int kPad = 8; // bf16 per shared row past the data: rows start 16 bytes off a bank cycle

/// The forward's Q tile and two buffers of K and V tiles (the next pair loads while the current
/// one is used).
constexpr size_t sharedBytes(int hd) {
  return sizeof(bf16) * size_t(kBlockQueries + 4 * kBlockKeys) * (hd + kPad);
}

/// Rows [row0, row0 + 64) of a head (offset `rowOffset(row)` in `src`, zeros from row `rows` on)
/// into a row-major shared tile (64, HD + kPad). All threads of the block call it.
template <int HD, typename RowOffset>
__device__ void loadRows(bf16 *__restrict__ tile, const bf16 *__restrict__ src, int row0, int rows,
                         RowOffset rowOffset) {
  constexpr int kChunks = HD / 8; // 16-byte chunks of a head row
  for (int idx = threadIdx.x; idx < 64 * kChunks; idx += blockDim.x) {
    const int r = idx / kChunks, c = idx % kChunks * 8, row = row0 + r;
    *reinterpret_cast<uint4 *>(tile + r * (HD + kPad) + c) =
        row < rows ? *reinterpret_cast<const uint4 *>(src + rowOffset(row) + c)
                   : make_uint4(0, 0, 0, 0);
  }
}

/// loadRows with cp.async: the rows in range are queued (they land at the cpAsyncWait that
/// covers the caller's next cpAsyncCommit), those past `rows` are zeroed at once.
template <int HD, typename RowOffset>
__device__ void loadRowsAsync(bf16 *__restrict__ tile, const bf16 *__restrict__ src, int row0,
                              int rows, RowOffset rowOffset) {
  constexpr int kChunks = HD / 8;
  for (int idx = threadIdx.x; idx < 64 * kChunks; idx += blockDim.x) {
    const int r = idx / kChunks, c = idx % kChunks * 8, row = row0 + r;
    bf16 *to = tile + r * (HD + kPad) + c;
    if (row < rows)
      cpAsync16(to, src + rowOffset(row) + c);
    else
      *reinterpret_cast<uint4 *>(to) = make_uint4(0, 0, 0, 0);
  }
}

/// The A fragment of rows [row0, row0 + 16) and columns [col0, col0 + 16) of a row-major shared
/// tile with `pitch` elements a row (g, tg: the lane's groupID and threadID_in_group).
template <typename Half>
__device__ __forceinline__ void loadA(uint32_t (&a)[4], const Half *tile, int pitch, int row0,
                                      int col0, int g, int tg) {
  const Half *at = tile + (row0 + g) * pitch + col0 + 2 * tg;
  a[0] = load32(at);
  a[1] = load32(at + 8 * pitch);
  a[2] = load32(at + 8);
  a[3] = load32(at + 8 * pitch + 8);
}

/// The B fragment B(kk, n) = tile[n0 + n][k0 + kk] (16 x 8) of a row-major shared tile: the
/// tile's rows are B's columns.
template <typename Half>
__device__ __forceinline__ void loadB(uint32_t (&b)[2], const Half *tile, int pitch, int n0, int k0,
                                      int g, int tg) {
  const Half *at = tile + (n0 + g) * pitch + k0 + 2 * tg;
  b[0] = load32(at);
  b[1] = load32(at + 8);
}

/// The B fragments of B(kk, n) = tile[k0 + kk][n0 + n] for two n-tiles, [n0, n0 + 8) into b0
/// and [n0 + 8, n0 + 16) into b1, kk < 16: the tile's rows are B's k, so one ldmatrix .trans
/// reads both (lane l names row k0 + l % 8 + 8 (m & 1) at column n0 + 8 (m >> 1), m = l / 8).
__device__ __forceinline__ void loadBTrans(uint32_t (&b0)[2], uint32_t (&b1)[2], const bf16 *tile,
                                           int pitch, int k0, int n0, int lane) {
  const int m = lane / 8;
  uint32_t r[4];
  ldmatrixX4Trans(r, tile + (k0 + lane % 8 + 8 * (m & 1)) * pitch + n0 + 8 * (m >> 1));
  b0[0] = r[0];
  b0[1] = r[1];
  b1[0] = r[2];
  b1[1] = r[3];
}

/// Two products of the warp's 16 rows [r0, r0 + 16) by a tile's 64 rows, sharing the k-loop over
/// the HD columns: x = A1 B1^T and y = A2 B2^T (16 x 64 each, 8 n-tiles of 8), where A1, A2,
/// B1, B2 are row-major shared tiles of pitch HD + kPad.
template <int HD>
__device__ __forceinline__ void productPair(float (&x)[8][4], float (&y)[8][4], const bf16 *a1,
                                            const bf16 *b1, const bf16 *a2, const bf16 *b2, int r0,
                                            int g, int tg) {
  constexpr int kPitch = HD + kPad;
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk) {
    uint32_t fa1[4], fa2[4];
    loadA(fa1, a1, kPitch, r0, kk * 16, g, tg);
    loadA(fa2, a2, kPitch, r0, kk * 16, g, tg);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      uint32_t fb1[2], fb2[2];
      loadB(fb1, b1, kPitch, nt * 8, kk * 16, g, tg);
      loadB(fb2, b2, kPitch, nt * 8, kk * 16, g, tg);
      mmaBf16(x[nt], fa1, fb1);
      mmaBf16(y[nt], fa2, fb2);
    }
  }
}

/// The A fragment (16 x 16, bf16) made of two fp32 accumulator tiles: columns [0, 8) and [8, 16).
__device__ __forceinline__ void accumulatorsToA(uint32_t (&a)[4], const float (&lo)[4],
                                                const float (&hi)[4]) {
  a[0] = pack(lo[0], lo[1]);
  a[1] = pack(lo[2], lo[3]);
  a[2] = pack(hi[0], hi[1]);
  a[3] = pack(hi[2], hi[3]);
}

/// Two adjacent elements as a float2, and back (rounded to nearest for bf16).
__device__ __forceinline__ float2 loadPair(const float *p) {
  return *reinterpret_cast<const float2 *>(p);
}
__device__ __forceinline__ float2 loadPair(const bf16 *p) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(p));
}
__device__ __forceinline__ void storePair(float *p, float2 v) {
  *reinterpret_cast<float2 *>(p) = v;
}
__device__ __forceinline__ void storePair(bf16 *p, float2 v) {
  *reinterpret_cast<__nv_bfloat162 *>(p) = __floats2bfloat162_rn(v.x, v.y);
}

/// Adds acc * scale to the head's 16 rows [row0, row0 + 16) of `dst` (bf16 or fp32, rows from
/// `rowOffset`, those from `rows` on skipped): acc[dt] is the accumulator of dims [8 dt, 8 dt + 8).
/// With `accumulate` false, writes instead of adding.
template <int HD, typename Dst, typename RowOffset>
__device__ void storeRows(Dst *__restrict__ dst, const float (&acc)[HD / 8][4], float scale,
                          bool accumulate, int row0, int rows, int g, int tg, RowOffset rowOffset) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = row0 + g + 8 * half;
    if (row >= rows)
      continue;
    Dst *at = dst + rowOffset(row) + 2 * tg;
#pragma unroll
    for (int dt = 0; dt < HD / 8; ++dt) {
      float2 value = make_float2(acc[dt][2 * half] * scale, acc[dt][2 * half + 1] * scale);
      if (accumulate) {
        const float2 old = loadPair(at + dt * 8);
        value.x += old.x;
        value.y += old.y;
      }
      storePair(at + dt * 8, value);
    }
  }
}
} // namespace tc

// out (B, x, H*hd) bf16, lse (B, H, x) from q (B, x, H*hd), k, v (a+x, B, H*hd), all bf16,
// 16-byte aligned. grid (ceil(x / 64), B*H), block 128; HD = headDim, a multiple of 16.
template <int HD>
__global__ void __launch_bounds__(tc::kThreads)
    forwardTensorCoreKernel(bf16 *__restrict__ out, float *__restrict__ lse,
                            const bf16 *__restrict__ q, const bf16 *__restrict__ k,
                            const bf16 *__restrict__ v, Dims s, float scaleLog2) {
  static_assert(HD % 16 == 0 && HD <= tc::kMaxHeadDim, "k-steps of 16 over the head dim");
  constexpr int kPitch = HD + tc::kPad; // Q, K and V rows in shared memory
  PIPEC_DYNAMIC_SHARED(float, smem);
  bf16 *qs = reinterpret_cast<bf16 *>(smem); // (64, kPitch) each
  // Buffer i holds a key tile's K at kBuf + i kBufferStride and its V kTile further.
  constexpr int kTile = tc::kBlockKeys * kPitch, kBufferStride = 2 * kTile;
  bf16 *kBuf = qs + tc::kBlockQueries * kPitch;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int g = lane / 4, tg = lane % 4; // the fragments' groupID and threadID_in_group
  const int b = blockIdx.y / s.heads, h = blockIdx.y % s.heads;
  const int m0 = blockIdx.x * tc::kBlockQueries, r0 = warp * tc::kRowsPerWarp;
  auto queryRow = [&](int t) { return s.qRow(b, t, h); };
  auto keyRow = [&](int j) { return s.kvRow(j, b, h); };

  tc::loadRows<HD>(qs, q, m0, s.queries, queryRow);
  __syncthreads();
  uint32_t qf[HD / 16][4]; // A fragments of the warp's 16 rows, one per k-step of 16 dims
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk)
    tc::loadA(qf[kk], qs, kPitch, r0, kk * 16, g, tg);

  // This lane's two rows: g and g + 8 of the warp's 16 (their positions see keys [0, pos]).
  const int pos[2] = {s.begin + m0 + r0 + g, s.begin + m0 + r0 + g + 8};
  const bool warpActive = m0 + r0 < s.queries;
  const int warpLastPos = s.begin + min(s.queries - 1, m0 + r0 + tc::kRowsPerWarp - 1);
  const int lastPos = s.begin + min(s.queries, m0 + tc::kBlockQueries) - 1;
  float o[HD / 8][4] = {}; // output accumulators, 8 dims per n-tile
  float rowMax[2] = {-INFINITY, -INFINITY}, rowSum[2] = {0.0f, 0.0f};

  // K/V tiles stream through two buffers: tile i + 1 loads (cp.async) while tile i is used.
  tc::loadRowsAsync<HD>(kBuf, k, 0, s.keys(), keyRow);
  tc::loadRowsAsync<HD>(kBuf + kTile, v, 0, s.keys(), keyRow);
  cpAsyncCommit();
  for (int j0 = 0, it = 0; j0 <= lastPos; j0 += tc::kBlockKeys, ++it) {
    const bf16 *ks = kBuf + (it & 1) * kBufferStride, *vs = ks + kTile;
    __syncthreads(); // the other buffer's tile (the previous one) is consumed
    if (j0 + tc::kBlockKeys <= lastPos) {
      bf16 *next = kBuf + (~it & 1) * kBufferStride;
      tc::loadRowsAsync<HD>(next, k, j0 + tc::kBlockKeys, s.keys(), keyRow);
      tc::loadRowsAsync<HD>(next + kTile, v, j0 + tc::kBlockKeys, s.keys(), keyRow);
      cpAsyncCommit();
      cpAsyncWait<1>(); // this tile's group has landed, the next one's may be in flight
    } else {
      cpAsyncWait<0>();
    }
    __syncthreads(); // ... for every thread's copies
    if (!warpActive || j0 > warpLastPos)
      continue;

    // S = Q K^T for the warp's 16 rows and the tile's 64 keys: 8 n-tiles of 8 keys.
    float sc[tc::kBlockKeys / 8][4] = {};
#pragma unroll
    for (int nt = 0; nt < tc::kBlockKeys / 8; ++nt)
#pragma unroll
      for (int kk = 0; kk < HD / 16; ++kk) {
        uint32_t kf[2];
        tc::loadB(kf, ks, kPitch, nt * 8, kk * 16, g, tg);
        mmaBf16(sc[nt], qf[kk], kf);
      }

    // Causal mask, scale to base 2, new row maxima (over the 4 lanes that share a row).
    float tileMax[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < tc::kBlockKeys / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = e >> 1, j = j0 + nt * 8 + 2 * tg + (e & 1);
        const float x = j <= pos[row] ? sc[nt][e] * scaleLog2 : -INFINITY;
        sc[nt][e] = x;
        tileMax[row] = fmaxf(tileMax[row], x);
      }
    float correction[2];
#pragma unroll
    for (int row = 0; row < 2; ++row) {
      tileMax[row] = fmaxf(tileMax[row], __shfl_xor_sync(kFullMask, tileMax[row], 1));
      tileMax[row] = fmaxf(tileMax[row], __shfl_xor_sync(kFullMask, tileMax[row], 2));
      // Finite: key 0 of the first tile is visible to every row.
      const float newMax = fmaxf(rowMax[row], tileMax[row]);
      correction[row] = exp2f(rowMax[row] - newMax);
      rowMax[row] = newMax;
      rowSum[row] *= correction[row];
    }
#pragma unroll
    for (int nt = 0; nt < tc::kBlockKeys / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float p = exp2f(sc[nt][e] - rowMax[e >> 1]);
        sc[nt][e] = p;
        rowSum[e >> 1] += p;
      }
#pragma unroll
    for (int dt = 0; dt < HD / 8; ++dt) {
      o[dt][0] *= correction[0];
      o[dt][1] *= correction[0];
      o[dt][2] *= correction[1];
      o[dt][3] *= correction[1];
    }

    // O += P V: k-steps of 16 keys; P's A fragment is the score accumulators of n-tiles 2 ks
    // and 2 ks + 1.
#pragma unroll
    for (int ks2 = 0; ks2 < tc::kBlockKeys / 16; ++ks2) {
      const uint32_t pf[4] = {pack(sc[2 * ks2][0], sc[2 * ks2][1]),
                              pack(sc[2 * ks2][2], sc[2 * ks2][3]),
                              pack(sc[2 * ks2 + 1][0], sc[2 * ks2 + 1][1]),
                              pack(sc[2 * ks2 + 1][2], sc[2 * ks2 + 1][3])};
#pragma unroll
      for (int dt = 0; dt < HD / 8; dt += 2) {
        uint32_t v0[2], v1[2];
        tc::loadBTrans(v0, v1, vs, kPitch, ks2 * 16, dt * 8, lane);
        mmaBf16(o[dt], pf, v0);
        mmaBf16(o[dt + 1], pf, v1);
      }
    }
  }
  if (!warpActive)
    return; // no barrier follows

  storeForwardRows<HD>(out, lse, s, b, h, m0 + r0 + g, tg, rowMax, rowSum,
                       [&](int dt, int row, int e) { return o[dt][2 * row + e]; });
}

//===--- Tensor-core backward (bf16) --------------------------------------===//
//
// FlashAttention-2's backward on the same mma, without atomics: as the SIMT backward, one
// kernel per output. Both recompute P = exp2(S scale log2(e) - lse log2(e)) from the forward's
// log-sum-exp and use dS = P (dP - D), D = rowDot (dO . O per query row, from rowDotKernel):
//   backwardQueryTensorCoreKernel: four warps own 64 query rows and stream 64-key tiles:
//     S = Q K^T, dP = dO V^T, dQ += dS K;
//   backwardKeyValueTensorCoreKernel: four warps own 64 keys and stream the 64-query tiles that
//     can see them, computing everything transposed so that keys are the rows:
//     S^T = K Q^T, dP^T = V dO^T, dV += P^T dO and dK += dS^T Q.
// Every tile is row-major in shared memory (pitch hd + 8: the fragment loads and ldmatrix rows
// fall in distinct banks); B operands whose k runs along the tile's rows come from ldmatrix
// .trans.
// P and dS are rounded to bf16 as A operands (as FlashAttention does); sums are fp32. dq is
// written (rounded to bf16); dk and dv are fp32 and added to, as in the SIMT kernels.

namespace tc {
/// Q and dO, and two buffers of K and V tiles.
constexpr size_t backwardQuerySharedBytes(int hd) {
  return sizeof(bf16) * size_t(6 * 64) * (hd + kPad);
}
/// K and V, and two buffers of Q and dO tiles with their rows' lse and rowDot.
constexpr size_t backwardKeyValueSharedBytes(int hd) {
  return sizeof(bf16) * size_t(6 * 64) * (hd + kPad) + sizeof(float) * 2 * 2 * 64;
}
} // namespace tc

// dq (B, x, H*hd) from dOut, q (B, x, H*hd), k, v (a+x, B, H*hd), lse and rowDot (B, H, x).
// grid (ceil(x / 64), B*H), block 128.
template <int HD>
__global__ void __launch_bounds__(tc::kThreads)
    backwardQueryTensorCoreKernel(bf16 *__restrict__ dq, const bf16 *__restrict__ dOut,
                                  const float *__restrict__ lse, const float *__restrict__ rowDot,
                                  const bf16 *__restrict__ q, const bf16 *__restrict__ k,
                                  const bf16 *__restrict__ v, Dims s, float scale) {
  constexpr int kPitch = HD + tc::kPad;
  PIPEC_DYNAMIC_SHARED(float, smem);
  bf16 *qs = reinterpret_cast<bf16 *>(smem); // (64, kPitch) each
  bf16 *dos = qs + 64 * kPitch;
  // Buffer i holds a key tile's K at kBuf + i kBufferStride and its V kTile further.
  constexpr int kTile = 64 * kPitch, kBufferStride = 2 * kTile;
  bf16 *kBuf = dos + kTile;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int g = lane / 4, tg = lane % 4;
  const int b = blockIdx.y / s.heads, h = blockIdx.y % s.heads;
  const int m0 = blockIdx.x * 64, r0 = warp * tc::kRowsPerWarp;
  const float scaleLog2 = scale * kLog2e;
  auto queryRow = [&](int t) { return s.qRow(b, t, h); };
  auto keyRow = [&](int j) { return s.kvRow(j, b, h); };
  tc::loadRows<HD>(qs, q, m0, s.queries, queryRow);
  tc::loadRows<HD>(dos, dOut, m0, s.queries, queryRow);

  int pos[2];
  float lse2[2], dRow[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int t = m0 + r0 + g + 8 * half;
    pos[half] = t < s.queries ? s.begin + t : -1; // rows past the slice see no key
    lse2[half] = t < s.queries ? lse[s.statRow(b, h, t)] * kLog2e : 0.0f;
    dRow[half] = t < s.queries ? rowDot[s.statRow(b, h, t)] : 0.0f;
  }
  const bool warpActive = m0 + r0 < s.queries;
  const int warpLastPos = s.begin + min(s.queries - 1, m0 + r0 + tc::kRowsPerWarp - 1);
  const int lastPos = s.begin + min(s.queries, m0 + 64) - 1;
  float acc[HD / 8][4] = {};

  // K/V tiles stream through two buffers: tile i + 1 loads (cp.async) while tile i is used.
  tc::loadRowsAsync<HD>(kBuf, k, 0, s.keys(), keyRow);
  tc::loadRowsAsync<HD>(kBuf + kTile, v, 0, s.keys(), keyRow);
  cpAsyncCommit();
  for (int j0 = 0, it = 0; j0 <= lastPos; j0 += 64, ++it) {
    const bf16 *ks = kBuf + (it & 1) * kBufferStride, *vs = ks + kTile;
    // The other buffer's tile (the previous one) is consumed; Q and dO are in place.
    __syncthreads();
    if (j0 + 64 <= lastPos) {
      bf16 *next = kBuf + (~it & 1) * kBufferStride;
      tc::loadRowsAsync<HD>(next, k, j0 + 64, s.keys(), keyRow);
      tc::loadRowsAsync<HD>(next + kTile, v, j0 + 64, s.keys(), keyRow);
      cpAsyncCommit();
      cpAsyncWait<1>();
    } else {
      cpAsyncWait<0>();
    }
    __syncthreads();
    if (!warpActive || j0 > warpLastPos)
      continue;
    float sc[8][4] = {}, dp[8][4] = {}; // S = Q K^T and dP = dO V^T: 16 rows x 64 keys
    tc::productPair<HD>(sc, dp, qs, ks, dos, vs, r0, g, tg);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int half = e >> 1, j = j0 + nt * 8 + 2 * tg + (e & 1);
        const float p = j <= pos[half] ? exp2f(sc[nt][e] * scaleLog2 - lse2[half]) : 0.0f;
        sc[nt][e] = p * (dp[nt][e] - dRow[half]); // dS
      }
      // dQ += dS K: k-steps of 16 keys; B(key, d) = K[key][d] (ldmatrix .trans of K's rows).
#pragma unroll
    for (int ks2 = 0; ks2 < 4; ++ks2) {
      uint32_t sa[4];
      tc::accumulatorsToA(sa, sc[2 * ks2], sc[2 * ks2 + 1]);
#pragma unroll
      for (int dt = 0; dt < HD / 8; dt += 2) {
        uint32_t k0[2], k1[2];
        tc::loadBTrans(k0, k1, ks, kPitch, ks2 * 16, dt * 8, lane);
        mmaBf16(acc[dt], sa, k0);
        mmaBf16(acc[dt + 1], sa, k1);
      }
    }
  }
  if (warpActive)
    tc::storeRows<HD>(dq, acc, scale, /*accumulate=*/false, m0 + r0, s.queries, g, tg, queryRow);
}

// dk, dv (a+x, B, H*hd) fp32 += the gradients of keys and values. grid (ceil((a+x) / 64), B*H),
// block 128.
template <int HD>
__global__ void __launch_bounds__(tc::kThreads)
    backwardKeyValueTensorCoreKernel(float *__restrict__ dk, float *__restrict__ dv,
                                     const bf16 *__restrict__ dOut, const float *__restrict__ lse,
                                     const float *__restrict__ rowDot, const bf16 *__restrict__ q,
                                     const bf16 *__restrict__ k, const bf16 *__restrict__ v, Dims s,
                                     float scale) {
  constexpr int kPitch = HD + tc::kPad;
  PIPEC_DYNAMIC_SHARED(float, smem);
  bf16 *ks = reinterpret_cast<bf16 *>(smem); // (64, kPitch) each
  bf16 *vs = ks + 64 * kPitch;
  // Buffer i holds a query tile's Q at qBuf + i kBufferStride, its dO kTile further, and its
  // rows' lse and rowDot at stats + 64 i and stats + 128 + 64 i.
  constexpr int kTile = 64 * kPitch, kBufferStride = 2 * kTile;
  bf16 *qBuf = vs + kTile;
  float *stats = reinterpret_cast<float *>(vs + 5 * kTile);
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int g = lane / 4, tg = lane % 4;
  const int b = blockIdx.y / s.heads, h = blockIdx.y % s.heads;
  const int n0 = blockIdx.x * 64, r0 = warp * tc::kRowsPerWarp;
  const float scaleLog2 = scale * kLog2e;
  auto queryRow = [&](int t) { return s.qRow(b, t, h); };
  auto keyRow = [&](int j) { return s.kvRow(j, b, h); };
  tc::loadRows<HD>(ks, k, n0, s.keys(), keyRow);
  tc::loadRows<HD>(vs, v, n0, s.keys(), keyRow);

  // Query t sees key j when s.begin + t >= j: the block's keys are seen from query
  // n0 - begin on, the warp's first key from kw0 - begin.
  const int kw0 = n0 + r0;
  const bool warpActive = kw0 < s.keys();
  const int key[2] = {kw0 + g, kw0 + g + 8};
  float dkAcc[HD / 8][4] = {}, dvAcc[HD / 8][4] = {};

  // Query tiles (Q, dO, their lse and rowDot) stream through two buffers: tile i + 1 loads
  // (cp.async; the statistics by plain stores) while tile i is used.
  auto loadQueryTile = [&](int t0, int buffer) {
    tc::loadRowsAsync<HD>(qBuf + buffer * kBufferStride, q, t0, s.queries, queryRow);
    tc::loadRowsAsync<HD>(qBuf + buffer * kBufferStride + kTile, dOut, t0, s.queries, queryRow);
    cpAsyncCommit();
    for (int r = threadIdx.x; r < 64; r += blockDim.x) {
      const int t = t0 + r;
      stats[buffer * 64 + r] = t < s.queries ? lse[s.statRow(b, h, t)] * kLog2e : 0.0f;
      stats[128 + buffer * 64 + r] = t < s.queries ? rowDot[s.statRow(b, h, t)] : 0.0f;
    }
  };
  const int firstQuery = max(0, n0 - s.begin);
  if (firstQuery < s.queries)
    loadQueryTile(firstQuery, 0);
  for (int t0 = firstQuery, it = 0; t0 < s.queries; t0 += 64, ++it) {
    const bf16 *qs = qBuf + (it & 1) * kBufferStride, *dos = qs + kTile;
    const float *lse2s = stats + (it & 1) * 64, *dRows = lse2s + 128;
    // The other buffer's tile (the previous one) is consumed; K and V are in place.
    __syncthreads();
    if (t0 + 64 < s.queries) {
      loadQueryTile(t0 + 64, ~it & 1);
      cpAsyncWait<1>();
    } else {
      cpAsyncWait<0>();
    }
    __syncthreads();
    // The tile's last query must see the warp's first key.
    if (!warpActive || s.begin + min(s.queries - 1, t0 + 63) < kw0)
      continue;
    float st[8][4] = {}, dpt[8][4] = {}; // S^T = K Q^T and dP^T = V dO^T: 16 keys x 64 queries
    tc::productPair<HD>(st, dpt, ks, qs, vs, dos, r0, g, tg);
    // P^T and dS^T; element e of n-tile nt is (key row g + 8 (e >> 1), query column
    // nt * 8 + 2 tg + (e & 1)).
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = nt * 8 + 2 * tg + (e & 1), t = t0 + r;
        const bool visible = t < s.queries && s.begin + t >= key[e >> 1];
        const float p = visible ? exp2f(st[nt][e] * scaleLog2 - lse2s[r]) : 0.0f;
        st[nt][e] = p;
        dpt[nt][e] = p * (dpt[nt][e] - dRows[r]);
      }
      // dV += P^T dO and dK += dS^T Q: k-steps of 16 queries; B(query, d) by ldmatrix .trans of
      // the rows of dO and Q.
#pragma unroll
    for (int ks2 = 0; ks2 < 4; ++ks2) {
      uint32_t pa[4], sa[4];
      tc::accumulatorsToA(pa, st[2 * ks2], st[2 * ks2 + 1]);
      tc::accumulatorsToA(sa, dpt[2 * ks2], dpt[2 * ks2 + 1]);
#pragma unroll
      for (int dt = 0; dt < HD / 8; dt += 2) {
        uint32_t d0[2], d1[2], q0[2], q1[2];
        tc::loadBTrans(d0, d1, dos, kPitch, ks2 * 16, dt * 8, lane);
        tc::loadBTrans(q0, q1, qs, kPitch, ks2 * 16, dt * 8, lane);
        mmaBf16(dvAcc[dt], pa, d0);
        mmaBf16(dvAcc[dt + 1], pa, d1);
        mmaBf16(dkAcc[dt], sa, q0);
        mmaBf16(dkAcc[dt + 1], sa, q1);
      }
    }
  }
  if (!warpActive)
    return;
  tc::storeRows<HD>(dk, dkAcc, scale, /*accumulate=*/true, kw0, s.keys(), g, tg, keyRow);
  tc::storeRows<HD>(dv, dvAcc, 1.0f, /*accumulate=*/true, kw0, s.keys(), g, tg, keyRow);
}

template <int HD>
cudaError_t launchForward(bf16 *out, float *lse, const bf16 *q, const bf16 *k, const bf16 *v,
                          const Dims &s, cudaStream_t stream) {
  const dim3 grid(ceilDiv(s.queries, tc::kBlockQueries), unsigned(s.batch * s.heads));
  const float scaleLog2 = kLog2e / std::sqrt(float(HD));
  return launchWithSmem(forwardTensorCoreKernel<HD>, grid, tc::kThreads, tc::sharedBytes(HD),
                        tc::sharedBytes(HD), stream, out, lse, q, k, v, s, scaleLog2);
}

template <int HD>
cudaError_t launchBackward(bf16 *dq, float *dk, float *dv, const bf16 *dOut, const float *lse,
                           const float *rowDot, const bf16 *q, const bf16 *k, const bf16 *v,
                           const Dims &s, cudaStream_t stream) {
  const float scale = 1.0f / std::sqrt(float(HD));
  const dim3 queryGrid(ceilDiv(s.queries, 64), unsigned(s.batch * s.heads));
  const dim3 keyGrid(ceilDiv(s.keys(), 64), unsigned(s.batch * s.heads));
  if (cudaError_t err =
          launchWithSmem(backwardQueryTensorCoreKernel<HD>, queryGrid, tc::kThreads,
                         tc::backwardQuerySharedBytes(HD), tc::backwardQuerySharedBytes(HD), stream,
                         dq, dOut, lse, rowDot, q, k, v, s, scale))
    return err;
  return launchWithSmem(backwardKeyValueTensorCoreKernel<HD>, keyGrid, tc::kThreads,
                        tc::backwardKeyValueSharedBytes(HD), tc::backwardKeyValueSharedBytes(HD),
                        stream, dk, dv, dOut, lse, rowDot, q, k, v, s, scale);
}

/// Calls `launch.template operator()<HD>()` for the head dimensions the kernels are
/// instantiated for (multiples of 16 up to 128); cudaErrorInvalidValue otherwise.
template <typename Launch> cudaError_t withHeadDim(int headDim, Launch &&launch) {
  switch (headDim) {
  case 16:
    return launch.template operator()<16>();
  case 32:
    return launch.template operator()<32>();
  case 48:
    return launch.template operator()<48>();
  case 64:
    return launch.template operator()<64>();
  case 80:
    return launch.template operator()<80>();
  case 96:
    return launch.template operator()<96>();
  case 112:
    return launch.template operator()<112>();
  case 128:
    return launch.template operator()<128>();
  }
  return cudaErrorInvalidValue;
}

} // namespace

bool mmaSyncHeadDim(int headDim) {
  return headDim > 0 && headDim % 16 == 0 && headDim <= tc::kMaxHeadDim;
}

cudaError_t mmaSyncForward(bf16 *out, float *lse, const bf16 *q, const bf16 *k, const bf16 *v,
                           const Dims &s, cudaStream_t stream) {
  return withHeadDim(s.headDim,
                     [&]<int HD>() { return launchForward<HD>(out, lse, q, k, v, s, stream); });
}

cudaError_t mmaSyncBackward(bf16 *dq, float *dk, float *dv, const bf16 *dOut, const float *lse,
                            const float *rowDot, const bf16 *q, const bf16 *k, const bf16 *v,
                            const Dims &s, cudaStream_t stream) {
  return withHeadDim(s.headDim, [&]<int HD>() {
    return launchBackward<HD>(dq, dk, dv, dOut, lse, rowDot, q, k, v, s, stream);
  });
}

} // namespace pipec::kernels::cuda::attention
