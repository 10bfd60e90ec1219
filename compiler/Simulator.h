//===- Simulator.h - The timing model of docs/contracts.md#semantics --------------*- C++ -*-===//
//
// The simulate pass's model: ir/CostModel.h holds it (simulateTimeline, summarizeTimeline),
// below schedules/ so that zb-auto's search runs the same rules. Each rank runs its compute
// ops (and tp all-reduces, which occupy it) one at a time in stream order; an op starts at the
// later of the previous op's end and the arrival of each input. A cross-rank input arrives a
// transfer time after its producer ends; same-rank inputs are free; sends and recvs overlap
// compute and cost nothing here. DP all-reduces run on their own stream after their stage's
// last weight gradient and can stretch the step past the last compute.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_COMPILER_SIMULATOR_H
#define PIPEC_COMPILER_SIMULATOR_H

#include "ir/CostModel.h"
#include "ir/Plan.h"

#include <string>

namespace pipec {

/// Chrome/Perfetto trace JSON: one track per rank, one slice per op.
std::string chromeTrace(const Plan &plan, const Timeline &t);

} // namespace pipec

#endif // PIPEC_COMPILER_SIMULATOR_H
