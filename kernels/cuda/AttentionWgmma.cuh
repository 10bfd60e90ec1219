//===- AttentionWgmma.cuh - the loop the wgmma attention kernels share -*- CUDA -*-===//
//
// The Hopper forward (AttentionWgmma.cu) and the experimental backward's dQ kernel
// (kernels/cuda/experimental) run one loop: a block of two warpgroups owns 128 query rows (64
// each) and streams the 64-key tiles of K and V of its (b, h) head through four shared buffers,
// the tiles changing hands through mbarriers, and each warpgroup issues a tile's first products
// (its scores) together with the tile before's second (P V, or dS K), working on the scores while
// those run. AttentionWgmma.cu describes the handoff and the 128-byte swizzled layout. This header
// has that loop (KeyValueTiles), the swizzled copy of 64-row tiles that the experimental dK/dV
// kernel uses too, and the A fragments of a thread's query rows. Only for code compiled for
// sm_90a (Wgmma.cuh).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_KERNELS_CUDA_ATTENTIONWGMMA_CUH
#define PIPEC_KERNELS_CUDA_ATTENTIONWGMMA_CUH

#include "kernels/cuda/Attention.cuh"
#include "kernels/cuda/Wgmma.cuh"

#include <cmath>

namespace pipec::kernels::cuda::attention {

/// How a block of `Threads` threads copies 64-row tiles of HD bf16 columns into the 128-byte
/// swizzled layout (HD / 64 column blocks of 64 rows x 128 bytes; the 16-byte chunk c of row r of
/// a block at chunk c ^ (r % 8) of the row): thread i copies chunk i % (HD / 8) of rows
/// i / (HD / 8) + R c, c < kCopies, with R = Threads / (HD / 8) a multiple of 8, so that the
/// chunk's swizzled place is the same in each; its offsets are worked out once.
template <int HD, int Threads> struct SwizzledCopy {
  static constexpr int kChunks = HD / 8, kRowStep = Threads / kChunks, kCopies = 64 / kRowStep;
  static_assert(Threads % kChunks == 0 && kRowStep % 8 == 0 && 64 % kRowStep == 0,
                "every thread copies one chunk of every R-th row");
  int row = int(threadIdx.x) / kChunks;   // the first row this thread copies
  int chunk = int(threadIdx.x) % kChunks; // its chunk of each
  int shared = chunk / 8 * (64 * 64) + row * 64 + ((chunk % 8) ^ (row % 8)) * 8; // in a tile
};

/// The A fragments (mma.sync's layout, Wgmma.cuh) of the head-dimension k-steps of query rows t0
/// and t0 + 8 of x (B, x, H*hd) for the thread at column pair tg; zeros past the slice's rows.
template <int HD>
__device__ __forceinline__ void loadRowFragments(uint32_t (&f)[HD / 16][4], const bf16 *x,
                                                 const Dims &s, int b, int h, int t0, int tg) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int t = t0 + 8 * half;
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const size_t at = s.qRow(b, t, h) + kk * 16 + 8 * c + 2 * tg;
        f[kk][half + 2 * c] = t < s.queries ? load32(x + at) : 0u;
      }
  }
}

/// A thread's place in a block of the wgmma kernels: two warpgroups of 64 query rows of head
/// (b, h), the blocks taking their query blocks heaviest (last) first; the thread's rows are
/// r0 + g and r0 + g + 8, at column pair tg of the fragments.
struct BlockRows {
  int group, warp, lane, g, tg, b, h;
  int m0, groupRow0, r0; // the block's, the warpgroup's and the warp's first rows
  int lastPos;           // the block's last row's position: it sees keys [0, lastPos]
  __device__ explicit BlockRows(const Dims &s)
      : group(threadIdx.x / 128), warp(threadIdx.x / device::kWarp % 4),
        lane(threadIdx.x % device::kWarp), g(lane / 4), tg(lane % 4), b(blockIdx.y / s.heads),
        h(blockIdx.y % s.heads), m0((int(gridDim.x) - 1 - int(blockIdx.x)) * 128),
        groupRow0(m0 + 64 * group), r0(groupRow0 + 16 * warp),
        lastPos(s.begin + min(s.queries, m0 + 128) - 1) {}
};

/// The K and V tiles of a block's (b, h) head streaming through four shared buffers: tile i
/// loads into buffer i % 4 (K, then V kTile elements on), kAhead tiles ahead of the one scored;
/// buffer i's `full` mbarrier completes when every thread's copies into it have landed (rows past
/// the keys are zeros, written by cp.async too so that the mbarrier covers them), its `empty`
/// one when every thread is done reading it.
template <int HD> class KeyValueTiles {
public:
  static_assert(HD == 64 || HD == 128, "whole 128-byte swizzle rows; wgmma's n for the products");
  static constexpr int kThreads = 256;         // two warpgroups
  static constexpr int kBlockQueries = 128;    // query rows a block
  static constexpr int kBlockKeys = 64;        // keys a tile
  static constexpr int kStages = 4;            // K/V buffers
  static constexpr int kAhead = 2;             // tiles loading ahead of the one scored
  static constexpr int kBarrierBytes = 64;     // the `full` and `empty` mbarriers
  static constexpr uint32_t kAtomBytes = 1024; // the swizzle's atom: 8 rows of 128 bytes
  static constexpr uint32_t kBlockBytes = kBlockKeys * 128; // a tile's 64 head dims of its 64 rows
  static constexpr int kTile = kBlockKeys * HD;             // the elements of a K (or V) tile
  /// The dynamic shared memory: the mbarriers, the buffers and 1024 bytes to align them.
  static constexpr size_t kSharedBytes =
      sizeof(bf16) * size_t(2 * kStages * kBlockKeys) * HD + kAtomBytes + kBarrierBytes;

  /// Every thread of the block: the mbarriers first in `smem`, then the buffers, aligned to the
  /// swizzle's atom; the mbarriers initialised, and the first tiles of `tiles` loading.
  __device__ KeyValueTiles(void *smem, const bf16 *kIn, const bf16 *vIn, const Dims &s, int b,
                           int h, int tileCount)
      : full(static_cast<uint64_t *>(smem)), empty(full + kStages),
        buffers(reinterpret_cast<bf16 *>(
            static_cast<char *>(smem) + kBarrierBytes +
            (kAtomBytes -
             device::sharedAddress(static_cast<char *>(smem) + kBarrierBytes) % kAtomBytes) %
                kAtomBytes)),
        k(kIn), v(vIn), keyStride(size_t(s.batch) * s.width()),
        from(s.kvRow(copy.row, b, h) + size_t(copy.chunk) * 8), keys(s.keys()), tiles(tileCount) {
    static_assert(2 * kStages * sizeof(uint64_t) <= kBarrierBytes, "room for the mbarriers");
    if (threadIdx.x == 0)
      for (int i = 0; i < kStages; ++i) {
        device::mbarrierInit(&full[i], kThreads);  // every thread, as its copies land
        device::mbarrierInit(&empty[i], kThreads); // every thread, done with the buffer
      }
    __syncthreads();
    for (int t = 0; t < kAhead && t < tiles; ++t)
      load(t);
  }

  /// Issues d = a b^T over the head dimension (64 columns, wgmma m64n64k16): a a warpgroup's
  /// row fragments (loadRowFragments), b a tile of 64 rows in shared memory (K, or V), read
  /// K-major. One descriptor a tile; a k-step's is that plus its byte offset in 16-byte units
  /// (the start address field, bits 0-13, does not overflow: shared memory ends below 256 KiB).
  __device__ __forceinline__ static void issueRowsTimesTile(float (&d)[kBlockKeys / 2],
                                                            const uint32_t (&a)[HD / 16][4],
                                                            const bf16 *tile) {
    const uint64_t base =
        device::wgmmaDescriptor(tile, 16, kAtomBytes, device::WgmmaLayout::Swizzle128);
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk)
      device::wgmmaBf16<kBlockKeys, false>(
          d, a[kk], base + (kk / 4 * kBlockBytes + kk % 4 * 32) / 16, kk > 0);
  }

  /// Issues acc += p b (wgmma m64nHDk16, 4 k-steps of 16 rows): p the fragments of packTile, b a
  /// tile of 64 rows in shared memory (V, or K), read MN-major.
  __device__ __forceinline__ static void issueTileProduct(float (&acc)[HD / 2],
                                                          const uint32_t (&p)[kBlockKeys / 16][4],
                                                          const bf16 *tile) {
    const uint64_t base =
        device::wgmmaDescriptor(tile, kBlockBytes, kAtomBytes, device::WgmmaLayout::Swizzle128);
#pragma unroll
    for (int ks = 0; ks < kBlockKeys / 16; ++ks)
      device::wgmmaBf16<HD, true>(acc, p[ks], base + ks * 2 * kAtomBytes / 16, true);
  }

  /// A tile's accumulators (issueRowsTimesTile's d) as the A fragments of issueTileProduct's
  /// k-steps: k-step ks (tile rows [16 ks, 16 ks + 16)) is the accumulators of n-tiles 2 ks and
  /// 2 ks + 1.
  __device__ __forceinline__ static void packTile(uint32_t (&p)[kBlockKeys / 16][4],
                                                  const float (&d)[kBlockKeys / 2]) {
#pragma unroll
    for (int ks = 0; ks < kBlockKeys / 16; ++ks)
#pragma unroll
      for (int r = 0; r < 4; ++r)
        p[ks][r] = pack(d[8 * ks + 2 * r], d[8 * ks + 2 * r + 1]);
  }

  /// Masks (to -inf) the scores of the tile at key j0 past their row's position: element
  /// 4 n + 2 row + e of `sc` is key j0 + 8 n + 2 tg + e of the row at position pos[row]. Only a
  /// tile that reaches past `firstPos` (the warpgroup's first row's) has such keys.
  __device__ static void maskCausal(float (&sc)[kBlockKeys / 2], int j0, int firstPos,
                                    const int (&pos)[2], int tg) {
    if (j0 + kBlockKeys - 1 <= firstPos)
      return;
    // Visible while below the row's limit (relative to the lane's first key of the tile).
    const int limit[2] = {pos[0] - j0 - 2 * tg, pos[1] - j0 - 2 * tg};
#pragma unroll
    for (int i = 0; i < kBlockKeys / 2; ++i)
      if ((i >> 2) * 8 + (i & 1) > limit[(i >> 1) & 1])
        sc[i] = -INFINITY;
  }

  /// The overlapped loop over the tiles, which every warpgroup runs whole (so no wgmma sits on a
  /// path that differs between threads; a warpgroup's rows that precede a tile have all its keys
  /// masked, and rows past the slice compute on zero queries): tile 0's first(0) alone; then for
  /// each tile it, first(it) with second(it - 1), scored(it) once first's products are done
  /// (second's may still run), and ready(it) once second's are done too and tile it - 1 is
  /// released; at the end second(last). first(it) and second(it) issue and commit their wgmma
  /// groups (reading keys(it), values(it)); `acc` is second's accumulator, ready(it) writes the
  /// register operands second(it) reads.
  template <int N, typename First, typename Scored, typename Ready, typename Second>
  __device__ __forceinline__ void overlap(float (&acc)[N], First first, Scored scored, Ready ready,
                                          Second second) {
    landed(0);
    device::wgmmaFence();
    first(0);
    device::wgmmaWait<0>();
    scored(0);
    ready(0);
    for (int it = 1; it < tiles; ++it) {
      landed(it);
      device::wgmmaFence();
      first(it);
      second(it - 1);
      device::wgmmaWait<1>(); // first's products; second's may still run
      scored(it);
      device::wgmmaWait<0>();
      device::wgmmaFenceRegisters(acc);
      device::mbarrierArrive(&empty[(it - 1) % kStages]); // tile it - 1 is read no more
      ready(it);
    }
    device::wgmmaFence();
    second(tiles - 1);
    device::wgmmaWait<0>();
    device::wgmmaFenceRegisters(acc);
  }

  /// Tile it's K and V in shared memory.
  __device__ const bf16 *keysOf(int it) const { return buffers + (it % kStages) * 2 * kTile; }
  __device__ const bf16 *valuesOf(int it) const { return keysOf(it) + kTile; }

private:
  /// This thread's share of tile `tile`'s copies, tracked by its buffer's `full` mbarrier.
  __device__ __forceinline__ void load(int tile) {
    using Copy = SwizzledCopy<HD, kThreads>;
    const int stage = tile % kStages;
    bf16 *to = buffers + stage * 2 * kTile + copy.shared;
    const size_t at0 = from + size_t(tile) * kBlockKeys * keyStride;
    const int rowsLeft = keys - tile * kBlockKeys - copy.row; // rows of this thread's in range
#pragma unroll
    for (int c = 0; c < Copy::kCopies; ++c) {
      bf16 *kTo = to + c * Copy::kRowStep * 64, *vTo = kTo + kTile;
      const size_t at = at0 + size_t(c) * Copy::kRowStep * keyStride;
      if (c * Copy::kRowStep < rowsLeft) {
        device::cpAsync16(kTo, k + at);
        device::cpAsync16(vTo, v + at);
      } else {
        device::cpAsync16Zero(kTo, k);
        device::cpAsync16Zero(vTo, v);
      }
    }
    device::cpAsyncMbarrierArrive(&full[stage]);
  }

  /// Tile it in shared memory for wgmma; tile it + kAhead loading.
  __device__ __forceinline__ void landed(int it) {
    device::mbarrierWait(&full[it % kStages], (it / kStages) & 1); // every thread's copies landed
    device::fenceProxyAsyncShared(); // ... and the generic proxy's writes are seen by wgmma
    const int next = it + kAhead;
    if (next < tiles) {
      if (next >= kStages) // its buffer's last tile, next - kStages, is read no more
        device::mbarrierWait(&empty[next % kStages], (next / kStages - 1) & 1);
      load(next);
    }
  }

  uint64_t *full, *empty;
  bf16 *buffers;
  const bf16 *k, *v;
  SwizzledCopy<HD, kThreads> copy;
  size_t keyStride; // from one position's row to the next
  size_t from;      // this thread's first copy's element in k and v
  int keys, tiles;
};

} // namespace pipec::kernels::cuda::attention

#endif // PIPEC_KERNELS_CUDA_ATTENTIONWGMMA_CUH
