//===- Simulator.h - The timing model of DESIGN §6 --------------*- C++ -*-===//
//
// Each rank runs its compute ops (and tp all-reduces, which occupy it) one at a time in stream
// order; an op starts at the later of the previous op's end and the arrival of each input. A
// cross-rank input arrives a transfer time after its producer ends; same-rank inputs are free;
// sends and recvs overlap compute and cost nothing here. DP all-reduces run on their own stream
// after their stage's last weight gradient and can stretch the step past the last compute.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_COMPILER_SIMULATOR_H
#define PIPEC_COMPILER_SIMULATOR_H

#include "ir/Plan.h"

#include "llvm/Support/Error.h"

#include <cstdint>
#include <vector>

namespace pipec {

struct OpTime {
  double start = 0, end = 0;
};

struct Timeline {
  /// ops[r][i]: when instruction i of rank r runs (zero-length for sends, recvs, optimizer).
  std::vector<std::vector<OpTime>> ops;
  /// depth[r][i]: longest chain of compute ops ending at instruction i (compute ops only);
  /// a producer's depth is always below its consumer's, even when times tie.
  std::vector<std::vector<uint32_t>> depth;
};

/// Run the timing model. A Finding if some rank waits for an input that never comes (the
/// compute order is not executable: a cycle, or a producer missing).
llvm::Error simulateTimeline(const Plan &plan, Timeline &out);

/// Fill plan.stats' timing fields from a timeline.
void summarizeTimeline(const Plan &plan, const Timeline &t, PlanStats &stats);

/// Chrome/Perfetto trace JSON: one track per rank, one slice per op.
std::string chromeTrace(const Plan &plan, const Timeline &t);

} // namespace pipec

#endif // PIPEC_COMPILER_SIMULATOR_H
