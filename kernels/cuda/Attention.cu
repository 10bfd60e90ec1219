//===- Attention.cu - causal attention of a query slice over earlier keys ---===//
//
// Seq1F1B's attention: the queries of one sub-sequence, positions [a, a + x), attend to the
// keys and values of positions [0, a + x) — the slice's own and those kept from earlier slices
// of the same microbatch. Layouts are the CPU reference's (kernels/cpu/Ops.h):
//   q, out, dq   (B, x, H*hd)       row (b, t), head h at columns [h*hd, (h+1)*hd)
//   k, v, dk, dv (a + x, B, H*hd)   position-major, so a slice's K/V append to the cache
//   lse          (B, H, x)          fp32 log-sum-exp of a query row's scaled scores
// dk and dv are fp32 in every compute type: each slice's backward adds to the gradients of all
// earlier keys, so in bf16 they would be rounded once per slice.
//
// bf16 with a head dimension that is a multiple of 16 (at most 128) and 16-byte aligned tensors
// runs on the tensor cores, forward and backward (the tensor-core kernels below); every other
// case runs the SIMT kernels described here. Flash-attention structure: nothing quadratic is
// stored. The forward streams tiles of 32 keys through shared memory with an online softmax; the
// backward recomputes the probabilities from lse, in two kernels so that no gradient needs an
// atomic: one warp per query row for dq, one warp per key row for dk and dv. Inside a tile, lane L
// owns key (or query) L of the tile for the dot products, and dimension d = lane + 32 r (r < 8, so
// hd <= 256) for the output accumulators; probabilities move between the two ownerships by warp
// shuffles. Shared tiles are padded to hd + 1 floats a row, so the lanes' column reads fall in
// distinct banks.
//
//===----------------------------------------------------------------------===//
#include "kernels/cuda/Device.cuh"
#include "kernels/cuda/Launch.h"
#include "kernels/cuda/Wgmma.cuh"

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string_view>
#include <type_traits>

namespace pipec::kernels::cuda {
namespace {

using namespace device;

constexpr int kTile = kWarp;     // keys (or queries) per shared tile: one per lane
constexpr int kRowsPerBlock = 8; // warps per block, one query (or key) row each
constexpr int kThreads = kRowsPerBlock * kWarp;
constexpr int kPerLane = launch::kMaxHeadDim / kWarp;
static_assert(kTile == kWarp, "lane L owns row L of a tile");
static_assert(launch::kMaxHeadDim % kWarp == 0, "a lane owns whole strides of the head dim");

struct Dims {
  int batch, queries, begin, heads, headDim;
  __host__ __device__ int width() const { return heads * headDim; }
  __host__ __device__ int keys() const { return begin + queries; }
  __device__ size_t qRow(int b, int t, int h) const {
    return (size_t(b) * queries + t) * width() + size_t(h) * headDim;
  }
  __device__ size_t kvRow(int j, int b, int h) const {
    return (size_t(j) * batch + b) * width() + size_t(h) * headDim;
  }
  __device__ size_t statRow(int b, int h, int t) const {
    return (size_t(b) * heads + h) * queries + t;
  }
};

/// Copies rows [row0, row0 + kTile) of a (b, h) head into a padded shared tile (pitch hd + 1),
/// zeros past `rows`; `rowOffset(r)` is the element offset of row r's head. All threads call it.
template <typename T, typename RowOffset>
__device__ void loadTile(float *__restrict__ tile, const T *__restrict__ src, int row0, int rows,
                         int hd, RowOffset rowOffset) {
  for (int idx = threadIdx.x; idx < kTile * hd; idx += blockDim.x) {
    const int r = idx / hd, d = idx % hd;
    const int row = row0 + r;
    tile[r * (hd + 1) + d] = row < rows ? toFloat(src[rowOffset(row) + d]) : 0.0f;
  }
}

/// sum_d a[d] * b[d] over hd values; `a` is read with stride 1 from a warp-private row.
__device__ __forceinline__ float dot(const float *__restrict__ a, const float *__restrict__ b,
                                     int hd) {
  float sum = 0.0f;
  for (int d = 0; d < hd; ++d)
    sum += a[d] * b[d];
  return sum;
}

// out (B, x, H*hd), lse (B, H, x) from q (B, x, H*hd), k, v (a+x, B, H*hd).
// grid (ceil(x / 8), B*H); block 8 warps, warp w: query t = blockIdx.x * 8 + w.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    forwardKernel(T *__restrict__ out, float *__restrict__ lse, const T *__restrict__ q,
                  const T *__restrict__ k, const T *__restrict__ v, Dims s, float scale) {
  PIPEC_DYNAMIC_SHARED(float, smem);
  const int hd = s.headDim, pitch = hd + 1;
  float *ks = smem;               // (32, hd + 1)
  float *vs = ks + kTile * pitch; // (32, hd + 1)
  float *qs = vs + kTile * pitch; // (8, hd)
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int b = blockIdx.y / s.heads, h = blockIdx.y % s.heads;
  const int t = blockIdx.x * kRowsPerBlock + warp;
  const bool active = t < s.queries;
  const int pos = s.begin + t; // keys [0, pos] are visible
  const int lastPos = s.begin + min(s.queries, int(blockIdx.x + 1) * kRowsPerBlock) - 1;
  float *qRow = qs + warp * hd;
  if (active)
    for (int d = lane; d < hd; d += kWarp)
      qRow[d] = toFloat(q[s.qRow(b, t, h) + d]);

  float runMax = -INFINITY, runSum = 0.0f, acc[kPerLane] = {};
  for (int j0 = 0; j0 <= lastPos; j0 += kTile) {
    __syncthreads(); // the previous tile is consumed (and qs written, on the first pass)
    auto kvOffset = [&](int j) { return s.kvRow(j, b, h); };
    loadTile(ks, k, j0, s.keys(), hd, kvOffset);
    loadTile(vs, v, j0, s.keys(), hd, kvOffset);
    __syncthreads();
    if (!active || j0 > pos)
      continue;
    const int j = j0 + lane;
    const float score = j <= pos ? dot(qRow, ks + lane * pitch, hd) * scale : -INFINITY;
    const float newMax = fmaxf(runMax, warpMax(score)); // finite: key j0 <= pos is visible
    const float p = j <= pos ? expf(score - newMax) : 0.0f;
    const float correction = expf(runMax - newMax);
    runSum = runSum * correction + warpSum(p);
    runMax = newMax;
#pragma unroll
    for (int r = 0; r < kPerLane; ++r)
      acc[r] *= correction;
    const int visible = min(kTile, pos - j0 + 1);
    for (int l = 0; l < visible; ++l) {
      const float pl = __shfl_sync(kFullMask, p, l);
#pragma unroll
      for (int r = 0; r < kPerLane; ++r) {
        const int d = lane + r * kWarp;
        if (d < hd)
          acc[r] += pl * vs[l * pitch + d];
      }
    }
  }
  if (!active)
    return;
  const float inv = 1.0f / runSum;
#pragma unroll
  for (int r = 0; r < kPerLane; ++r) {
    const int d = lane + r * kWarp;
    if (d < hd)
      out[s.qRow(b, t, h) + d] = fromFloat<T>(acc[r] * inv);
  }
  if (lane == 0)
    lse[s.statRow(b, h, t)] = runMax + logf(runSum);
}

/// The bits of |x|: as unsigned integers they order as the magnitudes do, with Inf above every
/// finite value and NaN above Inf, so their maximum keeps a NaN (fmaxf drops it).
__device__ __forceinline__ unsigned absBits(float x) { return __float_as_uint(x) & 0x7fffffffu; }

// rowDot (B, H, x) = dOut . out per query row and head (the softmax backward's sum p dP); and,
// unless null, rowMaxAbs (B, H, x) = the bits of max |dOut| of the row (absBits; the fixed-point
// dQ's bound).
template <typename T>
__global__ void rowDotKernel(float *__restrict__ rowDot, unsigned *__restrict__ rowMaxAbs,
                             const T *__restrict__ dOut, const T *__restrict__ out, Dims s) {
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int b = blockIdx.y / s.heads, h = blockIdx.y % s.heads;
  const int t = blockIdx.x * kRowsPerBlock + warp;
  if (t >= s.queries)
    return;
  const size_t row = s.qRow(b, t, h);
  float sum = 0.0f;
  unsigned maxAbs = 0;
  for (int d = lane; d < s.headDim; d += kWarp) {
    sum += toFloat(dOut[row + d]) * toFloat(out[row + d]);
    maxAbs = max(maxAbs, absBits(toFloat(dOut[row + d])));
  }
  sum = warpSum(sum);
  if (rowMaxAbs)
    for (int offset = kWarp / 2; offset > 0; offset /= 2)
      maxAbs = max(maxAbs, __shfl_xor_sync(kFullMask, maxAbs, offset));
  if (lane == 0) {
    rowDot[s.statRow(b, h, t)] = sum;
    if (rowMaxAbs)
      rowMaxAbs[s.statRow(b, h, t)] = maxAbs;
  }
}

// dq (B, x, H*hd) = sum_j dS_j k_j, dS_j = p_j (dO . v_j - rowDot) * scale. Grid as forward.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    backwardQueryKernel(T *__restrict__ dq, const T *__restrict__ dOut,
                        const float *__restrict__ lse, const float *__restrict__ rowDot,
                        const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                        Dims s, float scale) {
  PIPEC_DYNAMIC_SHARED(float, smem);
  const int hd = s.headDim, pitch = hd + 1;
  float *ks = smem;                     // (32, hd + 1)
  float *vs = ks + kTile * pitch;       // (32, hd + 1)
  float *qs = vs + kTile * pitch;       // (8, hd)
  float *dos = qs + kRowsPerBlock * hd; // (8, hd)
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int b = blockIdx.y / s.heads, h = blockIdx.y % s.heads;
  const int t = blockIdx.x * kRowsPerBlock + warp;
  const bool active = t < s.queries;
  const int pos = s.begin + t;
  const int lastPos = s.begin + min(s.queries, int(blockIdx.x + 1) * kRowsPerBlock) - 1;
  float *qRow = qs + warp * hd, *doRow = dos + warp * hd;
  float rowLse = 0.0f, rowD = 0.0f;
  if (active) {
    for (int d = lane; d < hd; d += kWarp) {
      qRow[d] = toFloat(q[s.qRow(b, t, h) + d]);
      doRow[d] = toFloat(dOut[s.qRow(b, t, h) + d]);
    }
    rowLse = lse[s.statRow(b, h, t)];
    rowD = rowDot[s.statRow(b, h, t)];
  }
  float acc[kPerLane] = {};
  for (int j0 = 0; j0 <= lastPos; j0 += kTile) {
    __syncthreads();
    auto kvOffset = [&](int j) { return s.kvRow(j, b, h); };
    loadTile(ks, k, j0, s.keys(), hd, kvOffset);
    loadTile(vs, v, j0, s.keys(), hd, kvOffset);
    __syncthreads();
    if (!active || j0 > pos)
      continue;
    const int j = j0 + lane;
    float ds = 0.0f;
    if (j <= pos) {
      const float p = expf(dot(qRow, ks + lane * pitch, hd) * scale - rowLse);
      ds = p * (dot(doRow, vs + lane * pitch, hd) - rowD) * scale;
    }
    const int visible = min(kTile, pos - j0 + 1);
    for (int l = 0; l < visible; ++l) {
      const float dsl = __shfl_sync(kFullMask, ds, l);
#pragma unroll
      for (int r = 0; r < kPerLane; ++r) {
        const int d = lane + r * kWarp;
        if (d < hd)
          acc[r] += dsl * ks[l * pitch + d];
      }
    }
  }
  if (!active)
    return;
#pragma unroll
  for (int r = 0; r < kPerLane; ++r) {
    const int d = lane + r * kWarp;
    if (d < hd)
      dq[s.qRow(b, t, h) + d] = fromFloat<T>(acc[r]);
  }
}

// dk, dv (a+x, B, H*hd) fp32 += over the queries t that see key j (a + t >= j):
//   dv_j += p dO_t;  dk_j += dS q_t.
// grid (ceil((a+x) / 8), B*H); warp w: key j = blockIdx.x * 8 + w.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    backwardKeyValueKernel(float *__restrict__ dk, float *__restrict__ dv,
                           const T *__restrict__ dOut, const float *__restrict__ lse,
                           const float *__restrict__ rowDot, const T *__restrict__ q,
                           const T *__restrict__ k, const T *__restrict__ v, Dims s, float scale) {
  PIPEC_DYNAMIC_SHARED(float, smem);
  const int hd = s.headDim, pitch = hd + 1;
  float *qs = smem;                            // (32, hd + 1)
  float *dos = qs + kTile * pitch;             // (32, hd + 1)
  float *kRows = dos + kTile * pitch;          // (8, hd)
  float *vRows = kRows + kRowsPerBlock * hd;   // (8, hd)
  float *lseTile = vRows + kRowsPerBlock * hd; // (32)
  float *dTile = lseTile + kTile;              // (32)
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int b = blockIdx.y / s.heads, h = blockIdx.y % s.heads;
  const int j = blockIdx.x * kRowsPerBlock + warp;
  const bool active = j < s.keys();
  float *kRow = kRows + warp * hd, *vRow = vRows + warp * hd;
  if (active)
    for (int d = lane; d < hd; d += kWarp) {
      kRow[d] = toFloat(k[s.kvRow(j, b, h) + d]);
      vRow[d] = toFloat(v[s.kvRow(j, b, h) + d]);
    }
  // The block's first key is seen from query max(0, j0 - a) on.
  const int firstQuery = max(0, int(blockIdx.x) * kRowsPerBlock - s.begin);
  float dkAcc[kPerLane] = {}, dvAcc[kPerLane] = {};
  for (int t0 = firstQuery / kTile * kTile; t0 < s.queries; t0 += kTile) {
    __syncthreads();
    auto qOffset = [&](int t) { return s.qRow(b, t, h); };
    loadTile(qs, q, t0, s.queries, hd, qOffset);
    loadTile(dos, dOut, t0, s.queries, hd, qOffset);
    if (threadIdx.x < kTile) {
      const int t = t0 + threadIdx.x;
      lseTile[threadIdx.x] = t < s.queries ? lse[s.statRow(b, h, t)] : 0.0f;
      dTile[threadIdx.x] = t < s.queries ? rowDot[s.statRow(b, h, t)] : 0.0f;
    }
    __syncthreads();
    if (!active)
      continue;
    const int t = t0 + lane;
    const bool sees = t < s.queries && s.begin + t >= j;
    float p = 0.0f, ds = 0.0f;
    if (sees) {
      p = expf(dot(kRow, qs + lane * pitch, hd) * scale - lseTile[lane]);
      ds = p * (dot(vRow, dos + lane * pitch, hd) - dTile[lane]) * scale;
    }
    for (int l = 0; l < kTile; ++l) {
      const float pl = __shfl_sync(kFullMask, p, l);
      const float dsl = __shfl_sync(kFullMask, ds, l);
      if (pl == 0.0f && dsl == 0.0f)
        continue; // uniform across the warp: masked query
#pragma unroll
      for (int r = 0; r < kPerLane; ++r) {
        const int d = lane + r * kWarp;
        if (d < hd) {
          dvAcc[r] += pl * dos[l * pitch + d];
          dkAcc[r] += dsl * qs[l * pitch + d];
        }
      }
    }
  }
  if (!active)
    return;
#pragma unroll
  for (int r = 0; r < kPerLane; ++r) {
    const int d = lane + r * kWarp;
    if (d < hd) {
      const size_t at = s.kvRow(j, b, h) + d;
      dk[at] += dkAcc[r];
      dv[at] += dvAcc[r];
    }
  }
}

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
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

/// The forward's Q tile and two buffers of K and V tiles (the next pair loads while the current
/// one is used).
constexpr size_t sharedBytes(int hd) {
  return sizeof(bf16) * size_t(kBlockQueries + 4 * kBlockKeys) * (hd + kPad);
}

/// Two adjacent 16-bit values of shared memory (4-byte aligned) as one fragment register.
template <typename Half> __device__ __forceinline__ uint32_t load32(const Half *p) {
  static_assert(sizeof(Half) == 2, "a pair of 16-bit values");
  return *reinterpret_cast<const uint32_t *>(p);
}

__device__ __forceinline__ uint32_t pack(float lo, float hi) {
  __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi); // .x (low half) = lo
  uint32_t bits;
  memcpy(&bits, &pair, sizeof bits);
  return bits;
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
      const uint32_t pf[4] = {tc::pack(sc[2 * ks2][0], sc[2 * ks2][1]),
                              tc::pack(sc[2 * ks2][2], sc[2 * ks2][3]),
                              tc::pack(sc[2 * ks2 + 1][0], sc[2 * ks2 + 1][1]),
                              tc::pack(sc[2 * ks2 + 1][2], sc[2 * ks2 + 1][3])};
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

#pragma unroll
  for (int row = 0; row < 2; ++row) {
    rowSum[row] += __shfl_xor_sync(kFullMask, rowSum[row], 1);
    rowSum[row] += __shfl_xor_sync(kFullMask, rowSum[row], 2);
    const int t = m0 + r0 + g + 8 * row;
    if (t >= s.queries)
      continue;
    const float inv = 1.0f / rowSum[row];
    bf16 *dst = out + s.qRow(b, t, h) + 2 * tg;
#pragma unroll
    for (int dt = 0; dt < HD / 8; ++dt)
      *reinterpret_cast<__nv_bfloat162 *>(dst + dt * 8) =
          __floats2bfloat162_rn(o[dt][2 * row] * inv, o[dt][2 * row + 1] * inv);
    if (tg == 0)
      lse[s.statRow(b, h, t)] = (rowMax[row] + log2f(rowSum[row])) * tc::kLn2;
  }
}

//===--- Hopper forward (bf16, wgmma) -------------------------------------===//
//
// The forward on sm_90a's warpgroup MMA (Wgmma.cuh). A block of `Groups` warpgroups owns
// 64 * Groups query rows (64 each) and streams 64-key tiles of K and V through shared buffers
// with cp.async, as the mma.sync kernel above. Per tile, each warpgroup computes its 64 x 64
// scores S = Q K^T with wgmma m64n64k16 (Q's A fragments stay in registers, loaded once from
// global memory), runs the online softmax on the accumulators (their layout is mma.sync's, per
// warp), and adds P V with wgmma m64nHDk16, P's A fragments packed from the score
// accumulators. Both products take A from registers, so the tensor cores read only K or V from
// shared memory.
//
// With `Overlap`, a warpgroup issues tile i's S and tile i - 1's P V together and runs tile i's
// softmax while P V is still on the tensor cores (FlashAttention-3's intra-warpgroup overlap);
// that keeps three K/V buffers (tile i + 1 loads, tile i is scored, tile i - 1's V is read).
// Without it, S, softmax and P V of a tile follow one another, over two buffers. The kernel
// benchmark measures every variant; attentionForward runs kWgmmaDefault.
//
// The K and V tiles are stored in wgmma's 128-byte swizzled layout: a tile of 64 rows is HD / 64
// column blocks of 64 rows x 128 bytes (64 head dims), row r of a block 128 bytes on, and its
// 16-byte chunk c (dims [8 c, 8 c + 8) of the block) at chunk c ^ (r % 8) of the row; the
// buffers are 1024-byte aligned (the swizzle's atom). The same bytes are B's K-major layout for
// S (n = keys: 8 rows are 1024 bytes; a k-step of 16 dims starts 32 bytes on in its block) and
// its MN-major layout for P V (k = keys: 8 rows 1024 bytes on; n = dims: the next block of 64
// is 64 x 128 bytes on). Eight threads copy a row's 128 bytes of a block, into 128 contiguous
// bytes of shared memory: whole sectors read, no bank conflicts written. The tiles are written
// through the generic proxy (cp.async, zero stores) and read by wgmma through the async proxy:
// every thread fences the proxies after its copies land, before the barrier that hands the tile
// over. Blocks take their query blocks heaviest (last) first. The causal mask is applied only on
// tiles that reach past the warpgroup's first row.

namespace wg {
constexpr int kBlockKeys = 64;

/// The K/V buffers (64 rows of HD each, K then V) of a variant, 1024 bytes to align them, and
/// with the handoff two mbarriers a buffer.
constexpr int stages(bool overlap, bool handoff) { return handoff ? 4 : overlap ? 3 : 2; }
constexpr int kBarrierBytes = 64;
constexpr size_t sharedBytes(int hd, bool overlap, bool handoff) {
  return sizeof(bf16) * size_t(2 * stages(overlap, handoff) * kBlockKeys) * hd + 1024 +
         (handoff ? kBarrierBytes : 0);
}

/// Rows [row0, row0 + 64) of a head into a swizzled tile (zeros from row `rows` on), by
/// cp.async; each of `threads` loading threads calls it, `first` its index among them. The
/// zeros are stored at once, or (`ZeroByCopy`) written by cp.async too, so that an mbarrier
/// that tracks the copies covers them.
template <int HD, bool ZeroByCopy, typename RowOffset>
__device__ void loadTileAsync(bf16 *__restrict__ tile, const bf16 *__restrict__ src, int row0,
                              int rows, int first, int threads, RowOffset rowOffset) {
  constexpr int kChunks = HD / 8; // 16-byte chunks of a row
  for (int idx = first; idx < kBlockKeys * kChunks; idx += threads) {
    const int r = idx / kChunks, chunk = idx % kChunks, row = row0 + r;
    bf16 *to = tile + (chunk / 8) * (kBlockKeys * 64) + r * 64 + ((chunk % 8) ^ (r % 8)) * 8;
    if (row < rows)
      cpAsync16(to, src + rowOffset(row) + chunk * 8);
    else if constexpr (ZeroByCopy)
      cpAsync16Zero(to, src);
    else
      *reinterpret_cast<uint4 *>(to) = make_uint4(0, 0, 0, 0);
  }
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
} // namespace wg

// out (B, x, H*hd) bf16, lse (B, H, x) from q (B, x, H*hd), k, v (a+x, B, H*hd), all bf16,
// 16-byte aligned. grid (ceil(x / (64 Groups)), B*H), block 128 Groups; HD 64 or 128.
//
// With `Handoff` (and `Overlap`), tiles change hands through mbarriers instead of a block-wide
// barrier: four buffers, tile i + 2 loading while tile i is scored and tile i - 1's V is read;
// every thread copies its share of a tile and its copies' completion arrives on the buffer's
// `full` mbarrier, which every thread waits for before the tile's products; after its P V of a
// tile, every thread arrives on the buffer's `empty` mbarrier, which a thread waits for before it
// copies into that buffer again. A warpgroup can so run up to a tile ahead of the other, and
// one's softmax overlaps the other's products.
//
// With `QueryGrad`, the same loop computes the backward's dQ instead (FlashAttention-2's dQ
// pass, as backwardQueryTensorCoreKernel): per tile S = Q K^T and dP = dO V^T (dO's A
// fragments in registers too, V read K-major), P = 2^(S scale log2(e) - lse log2(e)) masked,
// dS = P (dP - D) with D = rowDot, and dQ += dS K (K read MN-major, as V is for P V), overlapped
// with the next tile's S and dP; `out` is dq (written, times `scale`), `lse` is read.
template <int HD, int Groups, bool Overlap, bool Handoff, bool QueryGrad>
__global__ void __launch_bounds__(Groups * 128, Groups == 1 ? 2 : 1)
    attentionWgmmaKernel(bf16 *__restrict__ out, float *__restrict__ lse,
                         const bf16 *__restrict__ q, const bf16 *__restrict__ k,
                         const bf16 *__restrict__ v, const bf16 *__restrict__ dOut,
                         const float *__restrict__ rowDot, Dims s, float scale) {
  static_assert(HD == 64 || HD == 128, "whole 128-byte swizzle rows; wgmma's n for P V");
  static_assert(!Handoff || Overlap, "the handoff feeds the overlapped loop");
  static_assert(!QueryGrad || (Overlap && Handoff), "dQ runs on the handoff loop");
  const float scaleLog2 = scale * tc::kLog2e;
  constexpr int kThreads = Groups * 128, kBlockQueries = Groups * 64;
  constexpr int kStages = wg::stages(Overlap, Handoff), kTile = wg::kBlockKeys * HD;
  constexpr int kAhead = Handoff ? 2 : 1; // tiles loading ahead of the one scored
  constexpr uint32_t kAtomBytes = 1024, kBlockBytes = wg::kBlockKeys * 128; // 8 rows; 64 dims
  PIPEC_DYNAMIC_SHARED(float, smem);
  // With the handoff: buffer i's `full` and `empty` mbarriers first.
  uint64_t *full = reinterpret_cast<uint64_t *>(smem), *empty = full + kStages;
  static_assert(2 * kStages * sizeof(uint64_t) <= wg::kBarrierBytes, "room for the mbarriers");
  char *buffers = reinterpret_cast<char *>(smem) + (Handoff ? wg::kBarrierBytes : 0);
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
  constexpr int kCopies = wg::kBlockKeys / kRowStep; // a thread's copies of K (and of V) a tile
  static_assert(kThreads % kChunks == 0 && kRowStep % 8 == 0 && wg::kBlockKeys % kRowStep == 0,
                "every thread copies one chunk of every R-th row");
  const int copyRow = int(threadIdx.x) / kChunks, copyChunk = int(threadIdx.x) % kChunks;
  const int copyShared =
      copyChunk / 8 * (wg::kBlockKeys * 64) + copyRow * 64 + ((copyChunk % 8) ^ (copyRow % 8)) * 8;
  const size_t keyStride = size_t(s.batch) * s.width(); // from one position's row to the next
  const size_t copyGlobal = s.kvRow(copyRow, b, h) + size_t(copyChunk) * 8;
  // This thread's share of tile `tile`'s copies (a cp.async group; with the handoff, tracked by
  // the buffer's `full` mbarrier).
  auto loadTile = [&](int tile) {
    const int stage = tile % kStages;
    bf16 *to = kvBuf + stage * 2 * kTile + copyShared;
    const size_t from = copyGlobal + size_t(tile) * wg::kBlockKeys * keyStride;
    const int rowsLeft =
        s.keys() - tile * wg::kBlockKeys - copyRow; // rows of this thread's in range
#pragma unroll
    for (int c = 0; c < kCopies; ++c) {
      bf16 *kTo = to + c * kRowStep * 64, *vTo = kTo + kTile;
      const size_t at = from + size_t(c) * kRowStep * keyStride;
      if (c * kRowStep < rowsLeft) {
        cpAsync16(kTo, k + at);
        cpAsync16(vTo, v + at);
      } else if constexpr (Handoff) {
        cpAsync16Zero(kTo, k);
        cpAsync16Zero(vTo, v);
      } else {
        *reinterpret_cast<uint4 *>(kTo) = make_uint4(0, 0, 0, 0);
        *reinterpret_cast<uint4 *>(vTo) = make_uint4(0, 0, 0, 0);
      }
    }
    if constexpr (Handoff)
      cpAsyncMbarrierArrive(&full[stage]);
    else
      cpAsyncCommit();
  };

  // The block's tiles cover keys [0, lastPos].
  const int lastPos = s.begin + min(s.queries, m0 + kBlockQueries) - 1;
  const int tiles = lastPos / wg::kBlockKeys + 1;
  const int groupFirstPos = s.begin + groupRow0;

  if constexpr (Handoff) {
    if (threadIdx.x == 0)
      for (int i = 0; i < kStages; ++i) {
        mbarrierInit(&full[i], kThreads);  // every thread, as its copies land
        mbarrierInit(&empty[i], kThreads); // every thread, done with the buffer
      }
    __syncthreads();
  }
  // The first tiles load while Q's fragments are read.
  for (int t = 0; t < kAhead && t < tiles; ++t)
    loadTile(t);

  // Q's A fragments (rows r0 + g, r0 + g + 8), and dO's for dQ, with the rows' statistics.
  uint32_t qf[HD / 16][4], dof[QueryGrad ? HD / 16 : 1][4];
  float lse2[2] = {0.0f, 0.0f}, dRow[2] = {0.0f, 0.0f}; // dQ: lse log2(e) and D of the rows
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int t = r0 + g + 8 * half;
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const size_t at = s.qRow(b, t, h) + kk * 16 + 8 * c + 2 * tg;
        qf[kk][half + 2 * c] = t < s.queries ? tc::load32(q + at) : 0u;
        if constexpr (QueryGrad)
          dof[kk][half + 2 * c] = t < s.queries ? tc::load32(dOut + at) : 0u;
      }
    if constexpr (QueryGrad)
      if (t < s.queries) {
        lse2[half] = lse[s.statRow(b, h, t)] * tc::kLog2e;
        dRow[half] = rowDot[s.statRow(b, h, t)];
      }
  }

  const int pos[2] = {s.begin + r0 + g, s.begin + r0 + g + 8};
  float o[HD / 2]; // P V accumulators: element 4 dt + e is row g + 8 (e >> 1), dim 8 dt + ...
#pragma unroll
  for (int i = 0; i < HD / 2; ++i)
    o[i] = 0.0f;
  // Running row maxima of the scores times scaleLog2, and row sums of 2^(that - max).
  float rowMax[2] = {-INFINITY, -INFINITY}, rowSum[2] = {0.0f, 0.0f};
  float sc[wg::kBlockKeys / 2]; // the tile's scores, then its probabilities (dQ: dS)
  float dp[QueryGrad ? wg::kBlockKeys / 2 : 1]; // dQ: the tile's dP
  uint32_t pf[wg::kBlockKeys / 16][4];          // P of the last scored tile, as P V's A fragments

  // One descriptor a tile; a k-step's is that plus its byte offset in 16-byte units (the start
  // address field, bits 0-13, does not overflow: shared memory ends below 256 KiB).
  auto issueScores = [&](const bf16 *ks) {
    const uint64_t base = wgmmaDescriptor(ks, 16, kAtomBytes, WgmmaLayout::Swizzle128);
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk)
      wgmmaBf16<wg::kBlockKeys, false>(sc, qf[kk], base + (kk / 4 * kBlockBytes + kk % 4 * 32) / 16,
                                       kk > 0);
    if constexpr (QueryGrad) { // dP = dO V^T, V read K-major as K is
      const uint64_t vBase = wgmmaDescriptor(ks + kTile, 16, kAtomBytes, WgmmaLayout::Swizzle128);
#pragma unroll
      for (int kk = 0; kk < HD / 16; ++kk)
        wgmmaBf16<wg::kBlockKeys, false>(dp, dof[kk],
                                         vBase + (kk / 4 * kBlockBytes + kk % 4 * 32) / 16, kk > 0);
    }
    wgmmaCommit();
  };
  auto issueValues = [&](const bf16 *vs) {
    const uint64_t base = wgmmaDescriptor(vs, kBlockBytes, kAtomBytes, WgmmaLayout::Swizzle128);
#pragma unroll
    for (int ks2 = 0; ks2 < wg::kBlockKeys / 16; ++ks2)
      wgmmaBf16<HD, true>(o, pf[ks2], base + ks2 * 2 * kAtomBytes / 16, true);
    wgmmaCommit();
  };
  // The online softmax of the scores of the tile at key j0: returns the rescaling of O. For dQ,
  // dS from the scores and dP instead (no rescaling).
  auto softmax = [&](int j0, float(&correction)[2]) {
    float tileMax[2] = {-INFINITY, -INFINITY};
    if (j0 + wg::kBlockKeys - 1 > groupFirstPos) { // some key is past some row's position
      // Key j0 + 8 n + 2 t + e of element 4 n + 2 row + e is visible while below the row's
      // limit (relative to the lane's first key of the tile).
      const int limit[2] = {pos[0] - j0 - 2 * tg, pos[1] - j0 - 2 * tg};
#pragma unroll
      for (int i = 0; i < wg::kBlockKeys / 2; ++i)
        if ((i >> 2) * 8 + (i & 1) > limit[(i >> 1) & 1])
          sc[i] = -INFINITY;
    }
    if constexpr (QueryGrad) {
#pragma unroll
      for (int i = 0; i < wg::kBlockKeys / 2; ++i) {
        const int row = (i >> 1) & 1;
        const float p = wg::exp2Fast(fmaf(sc[i], scaleLog2, -lse2[row])); // 0 where masked
        sc[i] = p * (dp[i] - dRow[row]);
      }
      correction[0] = correction[1] = 1.0f;
    } else {
#pragma unroll
      for (int i = 0; i < wg::kBlockKeys / 2; ++i)
        tileMax[(i >> 1) & 1] = fmaxf(tileMax[(i >> 1) & 1], sc[i]);
#pragma unroll
      for (int row = 0; row < 2; ++row) {
        tileMax[row] = fmaxf(tileMax[row], __shfl_xor_sync(kFullMask, tileMax[row], 1));
        tileMax[row] = fmaxf(tileMax[row], __shfl_xor_sync(kFullMask, tileMax[row], 2));
        // Finite: key 0 of the first tile is visible to every row (rows past the slice see
        // every key of their tiles).
        const float newMax = fmaxf(rowMax[row], tileMax[row] * scaleLog2);
        correction[row] = wg::exp2Fast(rowMax[row] - newMax);
        rowMax[row] = newMax;
        rowSum[row] *= correction[row];
      }
#pragma unroll
      for (int i = 0; i < wg::kBlockKeys / 2; ++i) {
        const int row = (i >> 1) & 1;
        const float p = wg::exp2Fast(fmaf(sc[i], scaleLog2, -rowMax[row]));
        sc[i] = p;
        rowSum[row] += p;
      }
    }
  };

  // O *= correction, and P's A fragments of k-step ks (keys [16 ks, 16 ks + 16)): the score
  // accumulators of n-tiles 2 ks and 2 ks + 1.
  auto rescaleAndPack = [&](const float(&correction)[2]) {
    if constexpr (!QueryGrad)
#pragma unroll
      for (int i = 0; i < HD / 2; ++i)
        o[i] *= correction[(i >> 1) & 1];
#pragma unroll
    for (int ks2 = 0; ks2 < wg::kBlockKeys / 16; ++ks2)
#pragma unroll
      for (int r = 0; r < 4; ++r)
        pf[ks2][r] = tc::pack(sc[8 * ks2 + 2 * r], sc[8 * ks2 + 2 * r + 1]);
  };

  // Every warpgroup runs every tile of the block, so no wgmma sits on a path that differs
  // between threads (ptxas serializes those): a warpgroup's rows that precede a tile have all its
  // keys masked (the tile adds nothing), and rows past the slice compute on zero queries.
  auto landed = [&](int it) { // tile it in shared memory for wgmma; tile it + kAhead loading
    if constexpr (Handoff) {
      mbarrierWait(&full[it % kStages], (it / kStages) & 1); // every thread's copies landed
      fenceProxyAsyncShared(); // ... and the generic proxy's writes are seen by wgmma
      const int next = it + kAhead;
      if (next < tiles) {
        if (next >= kStages) // its buffer's last tile, next - kStages, is read no more
          mbarrierWait(&empty[next % kStages], (next / kStages - 1) & 1);
        loadTile(next);
      }
    } else {
      cpAsyncWait<0>();        // this thread's copies have landed
      fenceProxyAsyncShared(); // ... and are visible to wgmma after the barrier
      __syncthreads();         // every thread's; the buffer loaded next is read no more
      if (it + 1 < tiles)
        loadTile(it + 1);
    }
  };
  auto buffer = [&](int it) { return kvBuf + (it % kStages) * 2 * kTile; };
  float correction[2];
  if constexpr (Overlap) {
    // Tile 0's scores alone; then tile i's scores with tile i - 1's P V, whose buffer stays
    // intact while tile i + 1 loads into the third one; then the last tile's P V.
    landed(0);
    wgmmaFence();
    issueScores(buffer(0));
    wgmmaWait<0>();
    wgmmaFenceRegisters(sc);
    if constexpr (QueryGrad)
      wgmmaFenceRegisters(dp);
    softmax(0, correction);
    rescaleAndPack(correction);
    for (int it = 1; it < tiles; ++it) {
      landed(it);
      wgmmaFence();
      issueScores(buffer(it));
      issueValues(buffer(it - 1) + (QueryGrad ? 0 : kTile));
      wgmmaWait<1>(); // the scores; P V may still run
      wgmmaFenceRegisters(sc);
      if constexpr (QueryGrad)
        wgmmaFenceRegisters(dp);
      softmax(it * wg::kBlockKeys, correction);
      wgmmaWait<0>();
      wgmmaFenceRegisters(o);
      if constexpr (Handoff)
        mbarrierArrive(&empty[(it - 1) % kStages]); // tile it - 1 is read no more
      rescaleAndPack(correction);
    }
    wgmmaFence();
    issueValues(buffer(tiles - 1) + (QueryGrad ? 0 : kTile));
    wgmmaWait<0>();
    wgmmaFenceRegisters(o);
  } else {
    for (int it = 0; it < tiles; ++it) {
      landed(it);
      wgmmaFence();
      issueScores(buffer(it));
      wgmmaWait<0>();
      wgmmaFenceRegisters(sc);
      softmax(it * wg::kBlockKeys, correction);
      rescaleAndPack(correction);
      wgmmaFence();
      issueValues(buffer(it) + kTile);
      wgmmaWait<0>();
      wgmmaFenceRegisters(o);
    }
  }
  if constexpr (QueryGrad) {
#pragma unroll
    for (int row = 0; row < 2; ++row) {
      const int t = r0 + g + 8 * row;
      if (t >= s.queries)
        continue;
      bf16 *dst = out + s.qRow(b, t, h) + 2 * tg;
#pragma unroll
      for (int dt = 0; dt < HD / 8; ++dt)
        *reinterpret_cast<__nv_bfloat162 *>(dst + dt * 8) =
            __floats2bfloat162_rn(o[4 * dt + 2 * row] * scale, o[4 * dt + 2 * row + 1] * scale);
    }
  } else {
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
        lse[s.statRow(b, h, t)] = (rowMax[row] + log2f(rowSum[row])) * tc::kLn2;
    }
  }
}

using launch::DqMode; // how the Hopper backward computes dQ

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
  const float scaleLog2 = scale * tc::kLog2e;

  // A thread copies one chunk of every 16th (HD 128) or 32nd (HD 64) row of a 64-row tile.
  constexpr int kChunks = HD / 8, kRowStep = kThreads / kChunks, kCopies = 64 / kRowStep;
  const int copyRow = int(threadIdx.x) / kChunks, copyChunk = int(threadIdx.x) % kChunks;
  const int copyShared =
      copyChunk / 8 * (64 * 64) + copyRow * 64 + ((copyChunk % 8) ^ (copyRow % 8)) * 8;
  // Rows [row0, row0 + 64) (those from `rows` on as zeros), `stride` elements apart from
  // `first` (row row0's head), into the swizzled tile `to`.
  auto copyTile = [&](bf16 *to, const bf16 *first, size_t stride, int row0, int rows) {
#pragma unroll
    for (int c = 0; c < kCopies; ++c) {
      const int r = copyRow + c * kRowStep;
      bf16 *at = to + copyShared + c * kRowStep * 64;
      if (row0 + r < rows)
        cpAsync16(at, first + size_t(r) * stride + copyChunk * 8);
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
      const float factor = threadIdx.x < 64 ? tc::kLog2e : 1.0f;
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
      const float p = visible ? wg::exp2Fast(fmaf(st[i], scaleLog2, -((i & 1) ? l.y : l.x))) : 0.0f;
      st[i] = p;
      dpt[i] = p * (dpt[i] - ((i & 1) ? d.y : d.x));
    }
#pragma unroll
    for (int ks2 = 0; ks2 < 4; ++ks2)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        pf[ks2][r] = tc::pack(st[8 * ks2 + 2 * r], st[8 * ks2 + 2 * r + 1]);
        sf[ks2][r] = tc::pack(dpt[8 * ks2 + 2 * r], dpt[8 * ks2 + 2 * r + 1]);
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
  const float scaleLog2 = scale * tc::kLog2e;
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
    lse2[half] = t < s.queries ? lse[s.statRow(b, h, t)] * tc::kLog2e : 0.0f;
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
  const float scaleLog2 = scale * tc::kLog2e;
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
      stats[buffer * 64 + r] = t < s.queries ? lse[s.statRow(b, h, t)] * tc::kLog2e : 0.0f;
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

Dims toDims(launch::AttentionDims d) {
  return Dims{d.batch, d.queries, d.begin, d.heads, d.headDim};
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

// Dynamic shared memory of the SIMT kernels for a head dimension.
size_t forwardSmem(int hd) { return sizeof(float) * (2 * kTile * (hd + 1) + kRowsPerBlock * hd); }
size_t backwardQuerySmem(int hd) {
  return sizeof(float) * (2 * kTile * (hd + 1) + 2 * kRowsPerBlock * hd);
}
size_t backwardKeySmem(int hd) { return backwardQuerySmem(hd) + sizeof(float) * 2 * kTile; }

template <int HD>
cudaError_t launchTensorCoreForward(bf16 *out, float *lse, const bf16 *q, const bf16 *k,
                                    const bf16 *v, const Dims &s, cudaStream_t stream) {
  const dim3 grid(ceilDiv(s.queries, tc::kBlockQueries), unsigned(s.batch * s.heads));
  const float scaleLog2 = tc::kLog2e / std::sqrt(float(HD));
  return launchWithSmem(forwardTensorCoreKernel<HD>, grid, tc::kThreads, tc::sharedBytes(HD),
                        tc::sharedBytes(HD), stream, out, lse, q, k, v, s, scaleLog2);
}

bool aligned16(const void *p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <int HD, int Groups, bool Overlap, bool Handoff = false>
cudaError_t launchWgmmaVariant(bf16 *out, float *lse, const bf16 *q, const bf16 *k, const bf16 *v,
                               const Dims &s, cudaStream_t stream) {
  const dim3 grid(ceilDiv(s.queries, 64 * Groups), unsigned(s.batch * s.heads));
  const size_t smem = wg::sharedBytes(HD, Overlap, Handoff);
  return launchWithSmem(attentionWgmmaKernel<HD, Groups, Overlap, Handoff, false>, grid,
                        Groups * 128, smem, smem, stream, out, lse, q, k, v,
                        static_cast<const bf16 *>(nullptr), static_cast<const float *>(nullptr), s,
                        1.0f / std::sqrt(float(HD)));
}

/// The variant attentionForward runs (launch::setAttentionWgmmaVariant changes it).
std::atomic<int> wgmmaVariant{launch::kWgmmaDefault};

template <int HD>
cudaError_t launchWgmmaForward(bf16 *out, float *lse, const bf16 *q, const bf16 *k, const bf16 *v,
                               const Dims &s, cudaStream_t stream) {
  switch (wgmmaVariant.load(std::memory_order_relaxed)) {
  case 0:
    return launchWgmmaVariant<HD, 1, false>(out, lse, q, k, v, s, stream);
  case 1:
    return launchWgmmaVariant<HD, 2, false>(out, lse, q, k, v, s, stream);
  case 2:
    return launchWgmmaVariant<HD, 1, true>(out, lse, q, k, v, s, stream);
  case 3:
    return launchWgmmaVariant<HD, 2, true>(out, lse, q, k, v, s, stream);
  default:
    return launchWgmmaVariant<HD, 2, true, true>(out, lse, q, k, v, s, stream);
  }
}

/// A process-wide switch: -1 until read from the environment variable `name` (set to the value
/// that flips `byDefault`), then 0 or 1; a setter overrides it.
bool switchedOn(std::atomic<int> &state, const char *name, bool byDefault) {
  int enabled = state.load(std::memory_order_relaxed);
  if (enabled < 0) {
    const char *env = std::getenv(name);
    const bool flipped = env && std::string_view(env) == (byDefault ? "0" : "1");
    enabled = byDefault != flipped ? 1 : 0;
    state.store(enabled, std::memory_order_relaxed);
  }
  return enabled == 1;
}

/// The Hopper forward: on unless PIPEC_ATTENTION_WGMMA=0 or setAttentionWgmma(false).
std::atomic<int> wgmmaEnabled{-1};
bool wgmmaSwitchedOn() { return switchedOn(wgmmaEnabled, "PIPEC_ATTENTION_WGMMA", true); }

/// The Hopper backward: off unless PIPEC_ATTENTION_WGMMA_BACKWARD=1 or
/// setAttentionWgmmaBackward(true) (it has run on the kernel emulator only).
std::atomic<int> wgmmaBackwardEnabled{-1};
bool wgmmaBackwardSwitchedOn() {
  return switchedOn(wgmmaBackwardEnabled, "PIPEC_ATTENTION_WGMMA_BACKWARD", false);
}

/// How the Hopper backward computes dQ where it runs (launch::DqMode): separately unless
/// PIPEC_ATTENTION_DQ_ATOMICS is `1` or `float` (fp32 atomics) or `fixed` (fixed-point atomics),
/// or setAttentionDqMode says otherwise.
std::atomic<int> dqModeSetting{-1};
DqMode dqModeSwitch() {
  int mode = dqModeSetting.load(std::memory_order_relaxed);
  if (mode < 0) {
    const char *env = std::getenv("PIPEC_ATTENTION_DQ_ATOMICS");
    const std::string_view value = env ? env : "";
    const DqMode chosen = value == "1" || value == "float" ? DqMode::FloatAtomics
                          : value == "fixed"               ? DqMode::FixedPoint
                                                           : DqMode::Separate;
    if (chosen == DqMode::Separate && !value.empty() && value != "0")
      std::fprintf(stderr,
                   "PIPEC_ATTENTION_DQ_ATOMICS=%s: expected 0, 1 (or float) or fixed; the "
                   "attention backward computes dQ separately\n",
                   env);
    mode = int(chosen);
    dqModeSetting.store(mode, std::memory_order_relaxed);
  }
  return DqMode(mode);
}

/// Where attentionBackward's scratch (`rowDot`, attentionBackwardScratchFloats floats) keeps
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
    r.floats = rows; // (what attentionBackward asked for before the other modes)
  return r;
}

/// Whether the current device runs sm_90a code (compute capability 9.x), read once per device.
bool hopperDevice() {
  constexpr int kDevices = 64;
  static std::atomic<int> known[kDevices] = {}; // 0 unknown, 1 no, 2 yes
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0)
    return false;
  if (device < kDevices)
    if (const int k = known[device].load(std::memory_order_relaxed))
      return k == 2;
  int major = 0;
  const bool hopper =
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
      major == 9;
  if (device < kDevices)
    known[device].store(hopper ? 2 : 1, std::memory_order_relaxed);
  return hopper;
}

/// The backward's dQ on wgmma (two warpgroups, the mbarrier handoff), after rowDot.
template <int HD>
cudaError_t launchWgmmaQueryGrad(bf16 *dq, const float *lse, const float *rowDot, const bf16 *q,
                                 const bf16 *k, const bf16 *v, const bf16 *dOut, const Dims &s,
                                 cudaStream_t stream) {
  const dim3 grid(ceilDiv(s.queries, 128), unsigned(s.batch * s.heads));
  const size_t smem = wg::sharedBytes(HD, true, true);
  return launchWithSmem(attentionWgmmaKernel<HD, 2, true, true, true>, grid, 256, smem, smem,
                        stream, dq, const_cast<float *>(lse), q, k, v, dOut, rowDot, s,
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
    return launch::convert(DType::BF16, dq, DType::F32, scratch.dqFloat, elements, stream);
  if constexpr (Mode == DqMode::FixedPoint) {
    const size_t quads = elements / 4; // (HD is 64 or 128: a quad is inside one head's row)
    PIPEC_LAUNCH(dim3(unsigned(std::min<size_t>(ceilDiv(quads, size_t(256)), 4096))), 256, 0,
                 stream, fixedToBf16Kernel)
    (dq, scratch.dqFixed, scratch.rowExponent, scratch.rowFlag, s, quads, scale);
    return cudaGetLastError();
  }
  return cudaSuccess;
}

template <int HD>
cudaError_t launchTensorCoreBackward(bf16 *dq, float *dk, float *dv, const bf16 *dOut,
                                     const float *lse, const Scratch &scratch, const bf16 *q,
                                     const bf16 *k, const bf16 *v, const Dims &s, bool onWgmma,
                                     DqMode dqMode, cudaStream_t stream) {
  const float scale = 1.0f / std::sqrt(float(HD));
  const float *rowDot = scratch.rowDot;
  const dim3 queryGrid(ceilDiv(s.queries, 64), unsigned(s.batch * s.heads));
  const dim3 keyGrid(ceilDiv(s.keys(), 64), unsigned(s.batch * s.heads));
  if constexpr (HD == 64 || HD == 128)
    if (onWgmma && dqMode != DqMode::Separate) // dQ inside the dK/dV kernel
      return dqMode == DqMode::FloatAtomics
                 ? launchWgmmaKeyValueGrad<HD, DqMode::FloatAtomics>(dq, dk, dv, scratch, dOut, lse,
                                                                     q, k, v, s, stream)
                 : launchWgmmaKeyValueGrad<HD, DqMode::FixedPoint>(dq, dk, dv, scratch, dOut, lse,
                                                                   q, k, v, s, stream);
  cudaError_t err = cudaErrorInvalidValue;
  if constexpr (HD == 64 || HD == 128)
    if (onWgmma)
      err = launchWgmmaQueryGrad<HD>(dq, lse, rowDot, q, k, v, dOut, s, stream);
  if (!onWgmma)
    err = launchWithSmem(backwardQueryTensorCoreKernel<HD>, queryGrid, tc::kThreads,
                         tc::backwardQuerySharedBytes(HD), tc::backwardQuerySharedBytes(HD), stream,
                         dq, dOut, lse, rowDot, q, k, v, s, scale);
  if (err)
    return err;
  if constexpr (HD == 64 || HD == 128)
    if (onWgmma)
      return launchWgmmaKeyValueGrad<HD, DqMode::Separate>(dq, dk, dv, scratch, dOut, lse, q, k, v,
                                                           s, stream);
  return launchWithSmem(backwardKeyValueTensorCoreKernel<HD>, keyGrid, tc::kThreads,
                        tc::backwardKeyValueSharedBytes(HD), tc::backwardKeyValueSharedBytes(HD),
                        stream, dk, dv, dOut, lse, rowDot, q, k, v, s, scale);
}

/// Calls `launch.template operator()<HD>()` for the head dimensions the tensor-core kernels
/// are instantiated for (multiples of 16 up to 128); cudaErrorInvalidValue otherwise.
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

namespace launch {

bool attentionUsesTensorCores(DType dtype, AttentionDims s,
                              std::initializer_list<const void *> tensors) {
  if (dtype != DType::BF16 || s.headDim <= 0 || s.headDim % 16 != 0 || s.headDim > tc::kMaxHeadDim)
    return false;
  for (const void *p : tensors)
    if (!aligned16(p))
      return false;
  return true;
}

bool attentionForwardUsesWgmma(DType dtype, AttentionDims s,
                               std::initializer_list<const void *> tensors) {
  const int hd = s.headDim;
  return (hd == 64 || hd == 128) && attentionUsesTensorCores(dtype, s, tensors) &&
         wgmmaSwitchedOn() && hopperDevice();
}

bool attentionBackwardUsesWgmma(DType dtype, AttentionDims s,
                                std::initializer_list<const void *> tensors) {
  return wgmmaBackwardSwitchedOn() && attentionForwardUsesWgmma(dtype, s, tensors);
}

DqMode attentionBackwardDqMode(DType dtype, AttentionDims s,
                               std::initializer_list<const void *> tensors) {
  return attentionBackwardUsesWgmma(dtype, s, tensors) ? dqModeSwitch() : DqMode::Separate;
}

size_t attentionBackwardScratchFloats(DqMode mode, AttentionDims s) {
  return scratchLayout(toDims(s), mode, nullptr).floats;
}

void setAttentionWgmmaBackward(bool enabled) {
  wgmmaBackwardEnabled.store(enabled ? 1 : 0, std::memory_order_relaxed);
}

void setAttentionDqMode(DqMode mode) { dqModeSetting.store(int(mode), std::memory_order_relaxed); }

void setAttentionWgmma(bool enabled) {
  wgmmaEnabled.store(enabled ? 1 : 0, std::memory_order_relaxed);
}

const char *wgmmaVariantName(int variant) {
  switch (variant) {
  case 0:
    return "1 warpgroup, serial";
  case 1:
    return "2 warpgroups, serial";
  case 2:
    return "1 warpgroup, overlapped";
  case 3:
    return "2 warpgroups, overlapped";
  case 4:
    return "2 warpgroups, overlapped, mbarrier handoff";
  }
  return nullptr;
}

int setAttentionWgmmaVariant(int variant) {
  if (variant < 0 || variant >= kWgmmaVariants)
    variant = kWgmmaDefault;
  return wgmmaVariant.exchange(variant, std::memory_order_relaxed);
}

cudaError_t attentionForward(DType dtype, void *out, float *lse, const void *q, const void *k,
                             const void *v, AttentionDims dims, cudaStream_t stream) {
  const Dims s = toDims(dims);
  if (s.batch == 0 || s.queries == 0 || s.heads == 0)
    return cudaSuccess;
  if (s.headDim <= 0 || s.headDim > kMaxHeadDim)
    return cudaErrorInvalidValue;
  if (attentionForwardUsesWgmma(dtype, dims, {out, q, k, v})) {
    auto *o = static_cast<bf16 *>(out);
    auto *qb = static_cast<const bf16 *>(q), *kb = static_cast<const bf16 *>(k),
         *vb = static_cast<const bf16 *>(v);
    switch (s.headDim) {
    case 64:
      return launchWgmmaForward<64>(o, lse, qb, kb, vb, s, stream);
    case 128:
      return launchWgmmaForward<128>(o, lse, qb, kb, vb, s, stream);
    }
  }
  if (attentionUsesTensorCores(dtype, dims, {out, q, k, v}))
    return withHeadDim(s.headDim, [&]<int HD>() {
      return launchTensorCoreForward<HD>(static_cast<bf16 *>(out), lse,
                                         static_cast<const bf16 *>(q), static_cast<const bf16 *>(k),
                                         static_cast<const bf16 *>(v), s, stream);
    });
  const float scale = 1.0f / std::sqrt(float(s.headDim));
  const dim3 grid(ceilDiv(s.queries, kRowsPerBlock), unsigned(s.batch * s.heads));
  return PIPEC_DISPATCH_DTYPE(dtype, [&](auto *tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    return launchWithSmem(forwardKernel<T>, grid, kThreads, forwardSmem(s.headDim),
                          forwardSmem(kMaxHeadDim), stream, static_cast<T *>(out), lse,
                          static_cast<const T *>(q), static_cast<const T *>(k),
                          static_cast<const T *>(v), s, scale);
  });
}

cudaError_t attentionBackward(DType dtype, void *dq, float *dk, float *dv, const void *dOut,
                              const void *out, const float *lse, const void *q, const void *k,
                              const void *v, float *rowDot, DqMode dqMode, AttentionDims dims,
                              cudaStream_t stream) {
  const Dims s = toDims(dims);
  if (s.batch == 0 || s.queries == 0 || s.heads == 0)
    return cudaSuccess;
  if (s.headDim <= 0 || s.headDim > kMaxHeadDim)
    return cudaErrorInvalidValue;
  const float scale = 1.0f / std::sqrt(float(s.headDim));
  const dim3 queryGrid(ceilDiv(s.queries, kRowsPerBlock), unsigned(s.batch * s.heads));
  const dim3 keyGrid(ceilDiv(s.keys(), kRowsPerBlock), unsigned(s.batch * s.heads));
  return PIPEC_DISPATCH_DTYPE(dtype, [&](auto *tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T *dOutT = static_cast<const T *>(dOut);
    const T *qT = static_cast<const T *>(q), *kT = static_cast<const T *>(k),
            *vT = static_cast<const T *>(v);
    // The mode the scratch was sized for, where the Hopper backward runs (attentionBackwardDqMode
    // gives Separate elsewhere, so a mode the scratch is too small for cannot come from it).
    const bool onWgmma = attentionBackwardUsesWgmma(dtype, dims, {dq, dk, dv, dOut, out, q, k, v});
    const DqMode mode = onWgmma ? dqMode : DqMode::Separate;
    const Scratch scratch = scratchLayout(s, mode, rowDot);
    PIPEC_LAUNCH(queryGrid, kThreads, 0, stream, rowDotKernel<T>)
    (rowDot, scratch.rowMaxAbs, dOutT, static_cast<const T *>(out), s);
    if (cudaError_t err = cudaGetLastError())
      return err;
    if constexpr (std::is_same_v<T, bf16>)
      if (attentionUsesTensorCores(dtype, dims, {dq, dk, dv, dOut, out, q, k, v}))
        return withHeadDim(s.headDim, [&]<int HD>() {
          return launchTensorCoreBackward<HD>(static_cast<bf16 *>(dq), dk, dv, dOutT, lse, scratch,
                                              qT, kT, vT, s, onWgmma, mode, stream);
        });
    if (cudaError_t err = launchWithSmem(
            backwardQueryKernel<T>, queryGrid, kThreads, backwardQuerySmem(s.headDim),
            backwardQuerySmem(kMaxHeadDim), stream, static_cast<T *>(dq), dOutT, lse,
            static_cast<const float *>(rowDot), qT, kT, vT, s, scale))
      return err;
    return launchWithSmem(backwardKeyValueKernel<T>, keyGrid, kThreads, backwardKeySmem(s.headDim),
                          backwardKeySmem(kMaxHeadDim), stream, dk, dv, dOutT, lse,
                          static_cast<const float *>(rowDot), qT, kT, vT, s, scale);
  });
}

} // namespace launch
} // namespace pipec::kernels::cuda
