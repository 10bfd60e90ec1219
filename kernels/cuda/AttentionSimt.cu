//===- AttentionSimt.cu - causal attention on the SIMT cores ---------------===//
//
// The attention kernels for every case the tensor cores do not take (fp32; bf16 with a head
// dimension that is not a multiple of 16, over 128, or tensors not 16-byte aligned), and the
// row dots every backward starts with. Layouts: Attention.cuh. Flash-attention structure:
// nothing quadratic is stored. The forward streams tiles of 32 keys through shared memory with an
// online softmax; the backward recomputes the probabilities from lse, in two kernels so that no
// gradient needs an atomic: one warp per query row for dq, one warp per key row for dk and dv.
// Inside a tile, lane L owns key (or query) L of the tile for the dot products, and dimension
// d = lane + 32 r (r < 8, so hd <= 256) for the output accumulators; probabilities move between
// the two ownerships by warp shuffles. Shared tiles are padded to hd + 1 floats a row, so the
// lanes' column reads fall in distinct banks. Runs on every GPU the build targets.
//
//===----------------------------------------------------------------------===//
#include "kernels/cuda/Attention.cuh"

#include <cmath>
#include <type_traits>

namespace pipec::kernels::cuda::attention {
namespace {

using namespace device;

constexpr int kTile = kWarp;     // keys (or queries) per shared tile: one per lane
constexpr int kRowsPerBlock = 8; // warps per block, one query (or key) row each
constexpr int kThreads = kRowsPerBlock * kWarp;
constexpr int kPerLane = launch::kMaxHeadDim / kWarp;
static_assert(kTile == kWarp, "lane L owns row L of a tile");
static_assert(launch::kMaxHeadDim % kWarp == 0, "a lane owns whole strides of the head dim");

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

/// The kernels' dynamic shared memory: two tiles of 32 rows padded to hd + 1 floats, then sets
/// of the 8 warps' own rows of hd floats (set i's row of warp w at warpRow(i, w)), then what
/// follows those.
struct SharedTiles {
  float *tile[2];
  float *rows;
  int hd;
  __device__ SharedTiles(float *smem, int headDim)
      : tile{smem, smem + kTile * (headDim + 1)}, rows(smem + 2 * kTile * (headDim + 1)),
        hd(headDim) {}
  __device__ float *warpRow(int set, int warp) const {
    return rows + (set * kRowsPerBlock + warp) * hd;
  }
};

/// acc[r] += sum over the tile's rows l < `visible` of lane l's x times tile[l][lane + 32 r].
__device__ __forceinline__ void addTileRows(float (&acc)[kPerLane], float x,
                                            const float *__restrict__ tile, int visible, int pitch,
                                            int hd, int lane) {
  for (int l = 0; l < visible; ++l) {
    const float xl = __shfl_sync(kFullMask, x, l);
#pragma unroll
    for (int r = 0; r < kPerLane; ++r) {
      const int d = lane + r * kWarp;
      if (d < hd)
        acc[r] += xl * tile[l * pitch + d];
    }
  }
}

/// to[row + lane + 32 r] = acc[r] * factor, for the row's hd dims.
template <typename T>
__device__ __forceinline__ void storeRow(T *to, size_t row, const float (&acc)[kPerLane],
                                         float factor, int hd, int lane) {
#pragma unroll
  for (int r = 0; r < kPerLane; ++r) {
    const int d = lane + r * kWarp;
    if (d < hd)
      to[row + d] = fromFloat<T>(acc[r] * factor);
  }
}

/// The query-row kernels' frame (forward and dQ; grid (ceil(x / 8), B*H), block 8 warps): warp
/// w owns query t = blockIdx.x * 8 + w of head (b, h), which sees keys [0, pos].
struct QueryWarp {
  int warp, lane, b, h, t, pos, lastPos; // lastPos: the block's last visible key
  bool active;                           // t is a query of the slice
  __device__ explicit QueryWarp(const Dims &s)
      : warp(threadIdx.x / kWarp), lane(threadIdx.x % kWarp), b(blockIdx.y / s.heads),
        h(blockIdx.y % s.heads), t(blockIdx.x * kRowsPerBlock + warp), pos(s.begin + t),
        lastPos(s.begin + min(s.queries, int(blockIdx.x + 1) * kRowsPerBlock) - 1),
        active(t < s.queries) {}

  /// For every 32-key tile up to lastPos: the block loads its K and V into the shared tiles (after
  /// a barrier: the previous tile is consumed, and what the warps wrote before the first tile is
  /// written); then, where this warp's query sees a key of it, body(j0, the keys it sees).
  template <typename T, typename Body>
  __device__ __forceinline__ void forEachKeyTile(const Dims &s, const SharedTiles &shared,
                                                 const T *__restrict__ k, const T *__restrict__ v,
                                                 Body body) const {
    for (int j0 = 0; j0 <= lastPos; j0 += kTile) {
      __syncthreads();
      auto kvOffset = [&](int j) { return s.kvRow(j, b, h); };
      loadTile(shared.tile[0], k, j0, s.keys(), s.headDim, kvOffset);
      loadTile(shared.tile[1], v, j0, s.keys(), s.headDim, kvOffset);
      __syncthreads();
      if (active && j0 <= pos)
        body(j0, min(kTile, pos - j0 + 1));
    }
  }
};

// out (B, x, H*hd), lse (B, H, x) from q (B, x, H*hd), k, v (a+x, B, H*hd). Frame: QueryWarp.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    forwardKernel(T *__restrict__ out, float *__restrict__ lse, const T *__restrict__ q,
                  const T *__restrict__ k, const T *__restrict__ v, Dims s, float scale) {
  PIPEC_DYNAMIC_SHARED(float, smem);
  const int hd = s.headDim, pitch = hd + 1;
  const SharedTiles shared(smem, hd); // K, V tiles; the warps' query rows
  const QueryWarp w(s);
  const int lane = w.lane, b = w.b, h = w.h, t = w.t, pos = w.pos;
  float *qRow = shared.warpRow(0, w.warp);
  if (w.active)
    for (int d = lane; d < hd; d += kWarp)
      qRow[d] = toFloat(q[s.qRow(b, t, h) + d]);

  float runMax = -INFINITY, runSum = 0.0f, acc[kPerLane] = {};
  w.forEachKeyTile(s, shared, k, v, [&](int j0, int visible) {
    const int j = j0 + lane;
    const float score = j <= pos ? dot(qRow, shared.tile[0] + lane * pitch, hd) * scale : -INFINITY;
    const float newMax = fmaxf(runMax, warpMax(score)); // finite: key j0 <= pos is visible
    const float p = j <= pos ? expf(score - newMax) : 0.0f;
    const float correction = expf(runMax - newMax);
    runSum = runSum * correction + warpSum(p);
    runMax = newMax;
#pragma unroll
    for (int r = 0; r < kPerLane; ++r)
      acc[r] *= correction;
    addTileRows(acc, p, shared.tile[1], visible, pitch, hd, lane);
  });
  if (!w.active)
    return;
  const float inv = 1.0f / runSum;
  storeRow(out, s.qRow(b, t, h), acc, inv, hd, lane);
  if (lane == 0)
    lse[s.statRow(b, h, t)] = runMax + logf(runSum);
}

// rowDot (B, H, x) = dOut . out per query row and head (the softmax backward's sum p dP);
// with MaxAbs also rowMaxAbs (B, H, x) = absBits of the row's max |dOut|. Frame: QueryWarp.
template <typename T, bool MaxAbs>
__global__ void rowDotKernel(float *__restrict__ rowDot, unsigned *__restrict__ rowMaxAbs,
                             const T *__restrict__ dOut, const T *__restrict__ out, Dims s) {
  const QueryWarp w(s);
  if (!w.active)
    return;
  const size_t row = s.qRow(w.b, w.t, w.h);
  float sum = 0.0f;
  unsigned maxAbs = 0;
  for (int d = w.lane; d < s.headDim; d += kWarp) {
    sum += toFloat(dOut[row + d]) * toFloat(out[row + d]);
    if constexpr (MaxAbs)
      maxAbs = max(maxAbs, absBits(toFloat(dOut[row + d])));
  }
  sum = warpSum(sum);
  if constexpr (MaxAbs)
    for (int offset = kWarp / 2; offset > 0; offset /= 2)
      maxAbs = max(maxAbs, __shfl_xor_sync(kFullMask, maxAbs, offset));
  if (w.lane == 0) {
    rowDot[s.statRow(w.b, w.h, w.t)] = sum;
    if constexpr (MaxAbs)
      rowMaxAbs[s.statRow(w.b, w.h, w.t)] = maxAbs;
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
  const SharedTiles shared(smem, hd); // K, V tiles; the warps' query and dO rows
  const QueryWarp w(s);
  const int lane = w.lane, b = w.b, h = w.h, t = w.t, pos = w.pos;
  float *qRow = shared.warpRow(0, w.warp), *doRow = shared.warpRow(1, w.warp);
  float rowLse = 0.0f, rowD = 0.0f;
  if (w.active) {
    for (int d = lane; d < hd; d += kWarp) {
      qRow[d] = toFloat(q[s.qRow(b, t, h) + d]);
      doRow[d] = toFloat(dOut[s.qRow(b, t, h) + d]);
    }
    rowLse = lse[s.statRow(b, h, t)];
    rowD = rowDot[s.statRow(b, h, t)];
  }
  float acc[kPerLane] = {};
  w.forEachKeyTile(s, shared, k, v, [&](int j0, int visible) {
    const int j = j0 + lane;
    float ds = 0.0f;
    if (j <= pos) {
      const float p = expf(dot(qRow, shared.tile[0] + lane * pitch, hd) * scale - rowLse);
      ds = p * (dot(doRow, shared.tile[1] + lane * pitch, hd) - rowD) * scale;
    }
    addTileRows(acc, ds, shared.tile[0], visible, pitch, hd, lane);
  });
  if (!w.active)
    return;
  storeRow(dq, s.qRow(b, t, h), acc, 1.0f, hd, lane);
}

// dk, dv (a+x, B, KV*hd) fp32 += over the queries t that see key j (a + t >= j), of every query
// head h of the key/value head's group (in order):
//   dv_j += p dO_t;  dk_j += dS q_t.
// grid (ceil((a+x) / 8), B*KV); warp w: key j = blockIdx.x * 8 + w.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    backwardKeyValueKernel(float *__restrict__ dk, float *__restrict__ dv,
                           const T *__restrict__ dOut, const float *__restrict__ lse,
                           const float *__restrict__ rowDot, const T *__restrict__ q,
                           const T *__restrict__ k, const T *__restrict__ v, Dims s, float scale) {
  PIPEC_DYNAMIC_SHARED(float, smem);
  const int hd = s.headDim, pitch = hd + 1;
  const SharedTiles shared(smem, hd);
  float *qs = shared.tile[0], *dos = shared.tile[1];
  float *lseTile = shared.warpRow(2, 0); // (32)
  float *dTile = lseTile + kTile;        // (32)
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int b = blockIdx.y / s.kvHeads, firstHead = (blockIdx.y % s.kvHeads) * s.group();
  const int j = blockIdx.x * kRowsPerBlock + warp;
  const bool active = j < s.keys();
  float *kRow = shared.warpRow(0, warp), *vRow = shared.warpRow(1, warp);
  if (active)
    for (int d = lane; d < hd; d += kWarp) {
      kRow[d] = toFloat(k[s.kvRow(j, b, firstHead) + d]);
      vRow[d] = toFloat(v[s.kvRow(j, b, firstHead) + d]);
    }
  // The block's first key is seen from query max(0, j0 - a) on.
  const int firstQuery = max(0, int(blockIdx.x) * kRowsPerBlock - s.begin);
  float dkAcc[kPerLane] = {}, dvAcc[kPerLane] = {};
  for (int h = firstHead; h < firstHead + s.group(); ++h) {
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
  }
  if (!active)
    return;
#pragma unroll
  for (int r = 0; r < kPerLane; ++r) {
    const int d = lane + r * kWarp;
    if (d < hd) {
      const size_t at = s.kvRow(j, b, firstHead) + d;
      dk[at] += dkAcc[r];
      dv[at] += dvAcc[r];
    }
  }
}

// Dynamic shared memory of the kernels for a head dimension.
size_t forwardSmem(int hd) { return sizeof(float) * (2 * kTile * (hd + 1) + kRowsPerBlock * hd); }
size_t backwardQuerySmem(int hd) {
  return sizeof(float) * (2 * kTile * (hd + 1) + 2 * kRowsPerBlock * hd);
}
size_t backwardKeySmem(int hd) { return backwardQuerySmem(hd) + sizeof(float) * 2 * kTile; }

} // namespace

cudaError_t simtForward(DType dtype, void *out, float *lse, const void *q, const void *k,
                        const void *v, const Dims &s, cudaStream_t stream) {
  const float scale = 1.0f / std::sqrt(float(s.headDim));
  const dim3 grid(ceilDiv(s.queries, kRowsPerBlock), unsigned(s.batch * s.heads));
  return PIPEC_DISPATCH_DTYPE(dtype, [&](auto *tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    return launchWithSmem(forwardKernel<T>, grid, kThreads, forwardSmem(s.headDim),
                          forwardSmem(launch::kMaxHeadDim), stream, static_cast<T *>(out), lse,
                          static_cast<const T *>(q), static_cast<const T *>(k),
                          static_cast<const T *>(v), s, scale);
  });
}

cudaError_t rowDot(DType dtype, float *rowDot, const void *dOut, const void *out, const Dims &s,
                   cudaStream_t stream, unsigned *rowMaxAbs) {
  const dim3 grid(ceilDiv(s.queries, kRowsPerBlock), unsigned(s.batch * s.heads));
  return PIPEC_DISPATCH_DTYPE(dtype, [&](auto *tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    auto run = [&](auto kernel) {
      PIPEC_LAUNCH(grid, kThreads, 0, stream, kernel)
      (rowDot, rowMaxAbs, static_cast<const T *>(dOut), static_cast<const T *>(out), s);
      return cudaGetLastError();
    };
    return rowMaxAbs ? run(rowDotKernel<T, true>) : run(rowDotKernel<T, false>);
  });
}

cudaError_t simtBackward(DType dtype, void *dq, float *dk, float *dv, const void *dOut,
                         const float *lse, const float *rowDot, const void *q, const void *k,
                         const void *v, const Dims &s, cudaStream_t stream) {
  const float scale = 1.0f / std::sqrt(float(s.headDim));
  const dim3 queryGrid(ceilDiv(s.queries, kRowsPerBlock), unsigned(s.batch * s.heads));
  const dim3 keyGrid(ceilDiv(s.keys(), kRowsPerBlock), unsigned(s.batch * s.kvHeads));
  return PIPEC_DISPATCH_DTYPE(dtype, [&](auto *tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T *dOutT = static_cast<const T *>(dOut);
    const T *qT = static_cast<const T *>(q), *kT = static_cast<const T *>(k),
            *vT = static_cast<const T *>(v);
    if (cudaError_t err =
            launchWithSmem(backwardQueryKernel<T>, queryGrid, kThreads,
                           backwardQuerySmem(s.headDim), backwardQuerySmem(launch::kMaxHeadDim),
                           stream, static_cast<T *>(dq), dOutT, lse, rowDot, qT, kT, vT, s, scale))
      return err;
    return launchWithSmem(backwardKeyValueKernel<T>, keyGrid, kThreads, backwardKeySmem(s.headDim),
                          backwardKeySmem(launch::kMaxHeadDim), stream, dk, dv, dOutT, lse, rowDot,
                          qT, kT, vT, s, scale);
  });
}

} // namespace pipec::kernels::cuda::attention
