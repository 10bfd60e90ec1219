//===- QuickEval.h - Step time and memory of a compute order, without lowering -*- C++ -*-===//
//
// The planner (compiler/Planner.h) judges thousands of candidates; lowering each into full
// instruction streams (sends, recvs, tp parts and all-reduces) only to simulate them would cost
// most of its time. quickEvaluate() takes a plan right after the schedule pass (stage table and
// compute-only streams) and computes what the rest of the default pipeline would report for it:
//   - timing exactly as the simulate pass on the lowered plan (docs/contracts.md#semantics): the tp
//   parts of a
//     forward or input-gradient op, each followed by its tp all-reduce on the compute stream
//     (consumers on other ranks see the op's output when its last part ends), sends and recvs
//     free, dp all-reduces serial on their own stream after each stage's last weight gradient;
//     the same floating-point operations in the same order, so makespan, step time and bubble
//     ratio are bit-identical to `pipec compile`'s;
//   - per rank, static bytes and peak_activation_bytes exactly as the memory pass; its
//     peak_memory_bytes also counts receive buffers, whose places only the comm lowering
//     decides, so static + peak activation is a lower bound of it.
// tests/PlannerTest.cpp checks both claims against compilePlan on a sweep of configurations.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_COMPILER_QUICKEVAL_H
#define PIPEC_COMPILER_QUICKEVAL_H

#include "ir/Plan.h"

#include "llvm/Support/Error.h"

#include <cstdint>
#include <vector>

namespace pipec {

struct QuickStats {
  double makespan = 0, stepTime = 0, bubbleRatio = 0;
  /// Compute time of the mean rank (busy as summarizeTimeline counts it).
  double meanBusy = 0;
  /// Per pipeline rank, as the memory pass computes them.
  std::vector<int64_t> peakActivationBytes, staticBytes;
};

/// `plan` holds stages and compute-only streams (the schedule pass's output). A Finding when
/// the compute order cannot run (as the simulator's).
llvm::Error quickEvaluate(const Plan &plan, QuickStats &out);

} // namespace pipec

#endif // PIPEC_COMPILER_QUICKEVAL_H
