//===- Memory.cpp - Per-rank peak memory from stream order ----------------===//
//
// Establishes: stats.ranks[r].peak_activation_bytes, static_bytes and peak_memory_bytes
// (docs/contracts.md#semantics memory model; it depends only on stream order, not on timing). The
// activation rules are ir/CostModel.h's, which zb-auto's search runs too:
//  - F(s,m,k) allocates activation_bytes[k] of stage s at its start (first part);
//  - a backward (input-gradient or fused) holds up to backward_peak_bytes[k] more while it runs
//    (at least weight_grad - activation bytes: what it builds for the weight gradient); a fused
//    one fused_backward_peak_bytes[k] instead where the stage has them;
//  - a backward_input then keeps weight_grad bytes of the slice (it frees activation -
//    weight_grad bytes at its end, or allocates the difference when weight_grad is larger),
//    the backward_weight frees them at its end; a fused backward frees all;
//  - with sub-sequences, the microbatch's first backward also allocates the sequence's dK/dV
//    (sequence_grad_bytes) and a later slice's backward keeps its K/V (sequence_kv_bytes[k])
//    for slice 0's backward, which frees both;
//  - a recv buffer lives from its recv to the end of the op that consumes it;
//  - every compute op of stage s also holds workspace_bytes[k] of its own while it runs;
//  - static bytes: parameters of the rank's stages times state_bytes_per_param_byte (weights,
//    gradients, optimizer state).
// peak_activation_bytes is the peak of the activations alone; peak_memory_bytes is static
// bytes plus the peak of activations and receive buffers together.
//
//===----------------------------------------------------------------------===//
#include "compiler/Pass.h"

#include "ir/CostModel.h"
#include "ir/Semantics.h"

#include <algorithm>

namespace pipec {

namespace {

class MemoryPass final : public Pass {
public:
  llvm::StringRef name() const override { return "memory"; }

  llvm::Expected<bool> run(Plan &plan, PassContext &ctx) override {
    KeySpace keys(plan);
    PlanStats &stats = plan.stats;
    stats.ranks.resize(plan.ranks.size());
    // Receive buffers waiting for their consumer, by the consumer's key.
    std::vector<int64_t> buffered(keys.size(), 0);
    for (size_t r = 0; r < plan.ranks.size(); ++r) {
      RankStats &rs = stats.ranks[r];
      rs.rank = int(r);
      int64_t act = 0, peakAct = 0, bufs = 0, peakAll = 0;
      for (const Instruction &i : plan.ranks[r]) {
        if (i.op == OpKind::Recv) {
          int consumer = consumerStage(i.tensor, i.stage);
          Slot slot = i.tensor == TensorKind::Activation ? Slot::F : Slot::B;
          buffered[keys.key(consumer, i.mb, i.slice, slot)] += i.bytes;
          bufs += i.bytes;
          peakAll = std::max(peakAll, act + bufs);
          continue;
        }
        if (!i.isCompute())
          continue;
        const StageInfo &st = plan.stages[size_t(i.stage)];
        act += activationAllocatedAtStart(st, i);
        int64_t held = act + activationHeldWhileRunning(st, i);
        peakAct = std::max(peakAct, held);
        peakAll = std::max(peakAll, held + bufs);
        if (!i.isLastPart())
          continue;
        act -= activationFreedAtEnd(st, i);
        if (i.op == OpKind::Forward || i.op == OpKind::BackwardInput || i.op == OpKind::Backward) {
          int64_t &b = buffered[keys.key(i)];
          bufs -= b;
          b = 0;
        }
      }
      rs.peakActivationBytes = peakAct;
      int64_t params = 0;
      for (const StageInfo &st : plan.stages)
        if (st.rank == int(r))
          params += st.paramBytes;
      rs.staticBytes = int64_t(double(params) * plan.stateBytesPerParamByte);
      rs.peakMemoryBytes = rs.staticBytes + peakAll;
    }
    stats.memory = true;
    return true;
  }
};

} // namespace

std::unique_ptr<Pass> createMemoryPass() { return std::make_unique<MemoryPass>(); }

} // namespace pipec
