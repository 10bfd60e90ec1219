//===- InterleavedOrder.h - The interleaved 1F1B order, shared -----*- C++ -*-===//
//
// interleaved-1f1b and seq1f1b-interleaved walk the same Megatron-Core schedule table; the
// latter over sub-sequence units. One implementation serves both (with K = 1 the two are
// the same order, which a test checks).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_SCHEDULES_INTERLEAVEDORDER_H
#define PIPEC_SCHEDULES_INTERLEAVEDORDER_H

#include "schedules/Policy.h"

namespace pipec {

/// The valid value nearest to `from` (ties go up), searching [lo, hi]; -1 if there is none.
template <typename Valid> int nearestValid(int from, int lo, int hi, Valid valid) {
  for (int d = 0; from - d >= lo || from + d <= hi; ++d) {
    if (from + d <= hi && from + d >= lo && valid(from + d))
      return from + d;
    if (from - d >= lo && from - d <= hi && valid(from - d))
      return from - d;
  }
  return -1;
}

/// Interleaved 1F1B over units: p ranks, v chunks per rank (stage c·p + r on rank r), m
/// microbatches of k sub-sequences each, groups of g microbatches. Forwards take a
/// microbatch's sub-sequences in ascending order, backwards in descending order.
void emitInterleavedOrder(int p, int v, int m, int k, int g, ComputeOrder &order);

} // namespace pipec

#endif // PIPEC_SCHEDULES_INTERLEAVEDORDER_H
