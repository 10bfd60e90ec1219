//===- WgmmaLayoutKernels.h - One wgmma product per operand layout the attention uses -*- C++
//-*-===//
//
// For //tests:wgmma_layout_test (on a GPU: what the hardware makes of our shared-memory layouts
// and descriptors) and //tests:wgmma_layout_test_kernel_emu (the kernel emulator's reading of the
// same). Each case is one warpgroup computing D = A B through the operand forms of the attention
// kernels (the forward of kernels/cuda/AttentionWgmma.cu, the experimental backward of
// kernels/cuda/experimental/AttentionBackward.cu), with tiles of 64 rows x 128 bf16 columns in
// its 128-byte swizzled layout (two blocks of 64 columns; row r's 16-byte chunk j at chunk
// j ^ (r % 8)). Should the Hopper attention backward fail on a GPU, these say whether the
// operand form is the cause: the first two are the forward's (it passed on an H200), the third
// and fourth only the backward's.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_TESTS_WGMMALAYOUTKERNELS_H
#define PIPEC_TESTS_WGMMALAYOUTKERNELS_H

#include <cstdint>

namespace pipec::test {

enum class WgmmaLayoutCase : int {
  /// The forward's S = Q K^T: A (64 x 128) in registers, B = the transposed tile (B(k, n) =
  /// tile[n][k], K-major), 8 k-steps, N = 64.
  RegisterAKMajorB,
  /// The forward's O += P V: A (64 x 64, the first 64 columns of `a`) in registers, B = the tile
  /// (B(k, n) = tile[k][n], MN-major), 4 k-steps, N = 128.
  RegisterAMNMajorB,
  /// The dK/dV backward's S^T = K Q^T: A = the tile of `a` in shared memory (K-major), B = the
  /// transposed tile of `b` (K-major), 8 k-steps, N = 64.
  SharedAKMajorB,
  /// The backward's dQ += dS K with dQ's atomics (dS^T and K in shared memory): A (64 x 64, the
  /// first 64 columns of `a`) stored transposed in shared memory (tile[k][m], MN-major), B =
  /// the second 64-column block of `b`'s tile (B(k, n) = b[k][64 + n], MN-major), 4 k-steps,
  /// N = 64.
  SharedMNMajorAMNMajorB,
};

/// Columns of D in each case.
inline int wgmmaLayoutColumns(WgmmaLayoutCase c) {
  return c == WgmmaLayoutCase::RegisterAMNMajorB ? 128 : 64;
}

/// Launches the case on the current device and returns the launch error: `a` and `b` are 64 x 128
/// row-major bf16 bits, `d` receives D (64 x wgmmaLayoutColumns(c), row-major fp32); all three
/// device memory.
int runWgmmaLayoutCase(WgmmaLayoutCase c, const uint16_t *a, const uint16_t *b, float *d);

} // namespace pipec::test

#endif // PIPEC_TESTS_WGMMALAYOUTKERNELS_H
