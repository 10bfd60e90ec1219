//===- UniformPlan.h - The plan the runtime benchmarks run ------*- C++ -*-===//
//
// One unit-cost layer per stage (forward = backward_input = backward_weight = 1, 4-byte
// outputs), compiled with `schedule` at pp stages and m microbatches: the runtime benchmarks
// measure the runtime's own cost per instruction, so the model only has to give the schedule's
// instruction streams. The compile benchmarks use the same layers with sizes.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_BENCH_UNIFORMPLAN_H
#define PIPEC_BENCH_UNIFORMPLAN_H

#include "compiler/Pass.h"

#include <string>

namespace pipec::bench {

/// What a uniform model's layers hold besides their unit costs.
struct UniformSizes {
  int64_t activationBytes = 0, outputBytes = 4, paramBytes = 0;
  double p2pTime = 0;
};
/// The compile benchmarks' sizes: 1 MiB of activations, 64 KiB outputs, 4 MiB of parameters
/// per layer, transfers at 0.1 of a layer's forward.
inline constexpr UniformSizes kCompileBenchSizes{1 << 20, 1 << 16, 1 << 22, 0.1};

/// `pp` layers of unit cost (forward = backward_input = backward_weight = 1).
inline ModelSpec uniformModel(int pp, const UniformSizes &sizes = {}) {
  ModelSpec model;
  model.name = "uniform";
  Layer l;
  l.forward = l.backwardInput = l.backwardWeight = 1;
  l.activationBytes = sizes.activationBytes;
  l.outputBytes = sizes.outputBytes;
  l.paramBytes = sizes.paramBytes;
  model.layers.assign(size_t(pp), l);
  model.p2pTime = sizes.p2pTime;
  return model;
}

inline llvm::Expected<Plan> compileUniformPlan(int pp, int microbatches,
                                               const std::string &schedule) {
  CompileOptions o;
  o.schedule = schedule;
  o.parallel.pp = pp;
  o.parallel.microbatches = microbatches;
  return compilePlan(uniformModel(pp), ClusterSpec::defaults(), o);
}

/// The longest rank stream of `plan` (the critical path in instructions).
inline size_t longestStream(const Plan &plan) {
  size_t longest = 0;
  for (const auto &r : plan.ranks)
    longest = std::max(longest, r.size());
  return longest;
}

} // namespace pipec::bench

#endif // PIPEC_BENCH_UNIFORMPLAN_H
