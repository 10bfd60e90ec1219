//===- Semantics.h - The dependency rules of docs/contracts.md#semantics ----------*- C++ -*-===//
//
// One definition of "what a compute op needs", shared by the lowering, the verifier and the
// cost model (ir/CostModel.h: the simulator and zb-auto) so that they cannot disagree about
// the rules. (tests/DependencyCheckTest.cpp checks every schedule against its own reading of
// docs/contracts.md#semantics, written without this file.)
//   F(s,m,k) needs F(s-1,m,k) and, when K > 1, F(s,m,k-1);
//   B(s,m,k) (fused or input-gradient) needs F(s,m,k), B(s+1,m,k) and, when K > 1, B(s,m,k+1);
//   W(s,m,k) needs B(s,m,k).
// Ops are identified by a dense key (stage, mb, slice, slot) so that per-op state lives in flat
// arrays: slot F, slot B (fused backward or backward_input: what makes the input gradient), and
// slot W (backward_weight; a fused backward fills it too).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_IR_SEMANTICS_H
#define PIPEC_IR_SEMANTICS_H

#include "ir/Plan.h"

#include "llvm/Support/ErrorHandling.h"

#include <cstddef>

namespace pipec {

enum class Slot : uint8_t { F = 0, B = 1, W = 2 };
constexpr size_t kNumSlots = 3;

inline Slot slotOf(OpKind op) {
  switch (op) {
  case OpKind::Forward:
    return Slot::F;
  case OpKind::BackwardInput:
  case OpKind::Backward:
    return Slot::B;
  case OpKind::BackwardWeight:
    return Slot::W;
  case OpKind::Send:
  case OpKind::Recv:
  case OpKind::AllReduce:
  case OpKind::OptimizerStep:
    break;
  }
  llvm_unreachable("slotOf a non-compute op");
}

/// Dense index of (stage, mb, slice, slot).
struct KeySpace {
  size_t numMb = 1, numSlices = 1, numStages = 1;
  explicit KeySpace(const Plan &plan)
      : numMb(size_t(plan.parallel.microbatches)), numSlices(size_t(plan.parallel.seqSplits)),
        numStages(size_t(plan.numStages())) {}
  size_t size() const { return numStages * numMb * numSlices * kNumSlots; }
  size_t key(int stage, int mb, int slice, Slot slot) const {
    return ((size_t(stage) * numMb + size_t(mb)) * numSlices + size_t(slice)) * kNumSlots +
           size_t(slot);
  }
  size_t key(const Instruction &i) const { return key(i.stage, i.mb, i.slice, slotOf(i.op)); }
};

/// One input of a compute op.
struct Input {
  int stage, mb, slice;
  Slot slot;
  /// The tensor that crosses ranks when the producer's stage lives elsewhere.
  TensorKind tensor;
};

/// Calls fn(const Input &) for every input of compute op `i` (docs/contracts.md#semantics).
template <typename Fn> void forEachInput(const Plan &plan, const Instruction &i, Fn &&fn) {
  int s = i.stage, m = i.mb, k = i.slice;
  int last = plan.numStages() - 1, lastSlice = plan.numSlices() - 1;
  switch (i.op) {
  case OpKind::Forward:
    if (s > 0)
      fn(Input{s - 1, m, k, Slot::F, TensorKind::Activation});
    if (k > 0)
      fn(Input{s, m, k - 1, Slot::F, TensorKind::Activation});
    return;
  case OpKind::BackwardInput:
  case OpKind::Backward:
    fn(Input{s, m, k, Slot::F, TensorKind::Activation});
    if (s < last)
      fn(Input{s + 1, m, k, Slot::B, TensorKind::Gradient});
    if (k < lastSlice)
      fn(Input{s, m, k + 1, Slot::B, TensorKind::Gradient});
    return;
  case OpKind::BackwardWeight:
    fn(Input{s, m, k, Slot::B, TensorKind::Gradient});
    return;
  case OpKind::Send:
  case OpKind::Recv:
  case OpKind::AllReduce:
  case OpKind::OptimizerStep:
    return;
  }
}

/// The stage that consumes a p2p tensor: activation of s goes to s+1, gradient of s to s-1.
inline int consumerStage(TensorKind t, int producerStage) {
  return t == TensorKind::Activation ? producerStage + 1 : producerStage - 1;
}

/// Bytes of a p2p tensor (the gradient of stage s has the shape of stage s-1's output).
inline int64_t tensorBytes(const Plan &plan, TensorKind t, int stage, int slice) {
  int shapeStage = t == TensorKind::Activation ? stage : stage - 1;
  return plan.stages[size_t(shapeStage)].outputBytes[size_t(slice)];
}

} // namespace pipec

#endif // PIPEC_IR_SEMANTICS_H
