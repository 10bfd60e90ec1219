//===- UniformPlan.h - The plan the runtime benchmarks run ------*- C++ -*-===//
//
// One unit-cost layer per stage (forward = backward_input = backward_weight = 1, 4-byte
// outputs), compiled with `schedule` at pp stages and m microbatches: the runtime benchmarks
// measure the runtime's own cost per instruction, so the model only has to give the schedule's
// instruction streams.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_BENCH_UNIFORMPLAN_H
#define PIPEC_BENCH_UNIFORMPLAN_H

#include "compiler/Pass.h"

#include <string>

namespace pipec::bench {

inline llvm::Expected<Plan> compileUniformPlan(int pp, int microbatches,
                                               const std::string &schedule) {
  ModelSpec model;
  model.name = "uniform";
  Layer l;
  l.forward = l.backwardInput = l.backwardWeight = 1;
  l.outputBytes = 4;
  model.layers.assign(size_t(pp), l);
  CompileOptions o;
  o.schedule = schedule;
  o.parallel.pp = pp;
  o.parallel.microbatches = microbatches;
  return compilePlan(model, ClusterSpec::defaults(), o);
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
