//===- DqMode.h - how the experimental Hopper attention backward computes dQ -*- C++ -*-===//
//
// Plain C++, included by both the kernels (AttentionBackward.cu) and the host side
// (AttentionBackward.h).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_KERNELS_CUDA_EXPERIMENTAL_DQMODE_H
#define PIPEC_KERNELS_CUDA_EXPERIMENTAL_DQMODE_H

namespace pipec::kernels::cuda::experimental {

/// Separate: dQ has its own kernel, which recomputes S and dP (7 matrix products a tile with the
/// dK/dV kernel). In the other two the dK/dV kernel also computes dQ and adds it with atomics
/// (5 products): FloatAtomics into an fp32 dQ, whose last bits then depend on the order the
/// blocks run in, so that two runs of a plan no longer agree bit for bit; FixedPoint into a
/// 64-bit fixed-point dQ scaled per row by a bound of the row, whose sums are exact integers in
/// any order (deterministic; AttentionBackward.cu, kFixedBits).
enum class DqMode : int { Separate = 0, FloatAtomics = 1, FixedPoint = 2 };

inline const char *toString(DqMode mode) {
  switch (mode) {
  case DqMode::Separate:
    return "separate";
  case DqMode::FloatAtomics:
    return "fp32 atomics";
  case DqMode::FixedPoint:
    return "fixed-point atomics";
  }
  return "?";
}

} // namespace pipec::kernels::cuda::experimental

#endif // PIPEC_KERNELS_CUDA_EXPERIMENTAL_DQMODE_H
