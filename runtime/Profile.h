//===- Profile.h - --profile: a run's instruction times into measured costs -*- C++ -*-===//
//
// The interpreter times every instruction of a step when asked (RunShared::timings). After the
// run, each pipeline rank's times (its dp replica 0, tp rank 0 thread's, or the one process
// that runs it) are summarised into a table of fixed layout, one slot group per (stage, op kind,
// slice), message, collective and rank, each filled by that rank alone: so the tables of
// several ranks add up (a sum all-reduce across processes, in the nccl mode) to the whole
// run's, which becomes the pipecost/1 file (ir/formats/Costs.h). The first step is dropped as
// warm-up.
//  - a compute op: its parts' times summed, per microbatch and step, with the backend's work
//    waited for (Backend::awaitCompute);
//  - a message (per kind, producer stage and slice): the exchange is a rendezvous, so each side
//    also waits for the other; the side that posts last waits for the transfer alone, so the
//    transfer time is the smaller of the two sides' times, per message where this process
//    timed both sides (the threads of one process), else the smaller of the two medians;
//  - an all-reduce (per group and stage), the optimizer step (per rank): their times.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_PROFILE_H
#define PIPEC_RUNTIME_PROFILE_H

#include "ir/Plan.h"
#include "ir/formats/Costs.h"

#include <array>
#include <cstdint>
#include <map>
#include <tuple>
#include <vector>

namespace pipec {

class ProfileTable {
public:
  explicit ProfileTable(const Plan &plan);
  /// Summarise pipeline rank `pp`'s instruction times (`timings[instruction][step]`, ms, as
  /// RunShared records them) and its peak memory into the table.
  void addRank(int pp, const std::vector<std::vector<float>> &timings, int64_t peakBytes);
  /// The table's values, to be summed with other processes' (every slot is one rank's).
  std::vector<double> &values() { return slots; }
  /// The measured costs (what it ran on is the caller's to fill).
  MeasuredCosts costs() const;

private:
  static constexpr size_t kTime = 3; // median, spread, samples
  size_t opSlot(int stage, OpKind op, int slice) const;
  size_t messageSlot(int stage, TensorKind kind, int slice, bool send) const;
  size_t collectiveSlot(int stage, CollectiveGroup group) const;
  size_t rankSlot(int pp) const;
  void put(size_t slot, std::vector<double> ms);
  Measured get(size_t slot) const;

  const Plan &plan;
  size_t numStages, numSlices;
  /// Per message (kind, producer stage, slice, microbatch): its send's and its recv's times
  /// per step, where this process ran them.
  std::map<std::tuple<TensorKind, int, int, int>, std::array<std::vector<double>, 2>> exchanges;
  std::vector<double> slots;
};

} // namespace pipec

#endif // PIPEC_RUNTIME_PROFILE_H
