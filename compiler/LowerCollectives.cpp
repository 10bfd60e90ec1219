//===- LowerCollectives.cpp - tp and dp all-reduces, the optimizer step ---===//
//
// Establishes:
//  - with tp > 1, every forward and input-gradient op (fused or not) of a stage with n
//    tensor-parallel reductions is split into n parts, each followed by an all_reduce of group
//    tp: Megatron-LM's row-parallel output reduction after attention and after the MLP in the
//    forward, and the conjugate reduction of the input gradient of each column-parallel block
//    in the backward (Shoeybi et al. 2019, Fig. 3). Weight-gradient ops need none;
//  - with dp > 1, one all_reduce of group dp per stage, right after the stage's last weight
//    gradient (and the sends that follow it), so the reduction overlaps the rest of the step;
//  - with tied input/output embeddings (and more than one stage), one all_reduce of group
//    embedding for the first and for the last stage, summing their copies' gradients as
//    Megatron-LM's embedding group does; last before the optimizer, after every p2p op, so it
//    cannot wait in a cycle with them;
//  - one optimizer_step, last on every rank.
// The replicas of a group run the same stream, so every group issues its collectives in the
// same order on all its members.
//
//===----------------------------------------------------------------------===//
#include "compiler/LowerCollectives.h"

#include "compiler/Pass.h"
#include "ir/support/Error.h"

#include "llvm/ADT/DenseMap.h"

#include <algorithm>

namespace pipec {

std::vector<llvm::SmallVector<int, 2>> dpAllReducePoints(llvm::ArrayRef<Instruction> stream) {
  // Last weight-gradient op of each stage on this rank.
  llvm::SmallDenseMap<int, size_t, 8> lastWeightGrad;
  for (size_t n = 0; n < stream.size(); ++n)
    if (stream[n].op == OpKind::BackwardWeight || stream[n].op == OpKind::Backward)
      lastWeightGrad[stream[n].stage] = n;
  std::vector<llvm::SmallVector<int, 2>> points(stream.size() + 1);
  llvm::SmallVector<int, 4> due; // stages whose all-reduce waits for the sends and recvs
  for (size_t n = 0; n < stream.size(); ++n) {
    const Instruction &i = stream[n];
    if (!i.isP2P()) {
      points[n].append(due.begin(), due.end());
      due.clear();
    }
    if (i.isCompute()) {
      auto it = lastWeightGrad.find(i.stage);
      if (it != lastWeightGrad.end() && it->second == n)
        due.push_back(i.stage);
    }
  }
  points[stream.size()].append(due.begin(), due.end());
  return points;
}

namespace {

class LowerCollectivesPass final : public Pass {
public:
  llvm::StringRef name() const override { return "lower-collectives"; }

  llvm::Expected<bool> run(Plan &plan, PassContext &ctx) override {
    const ParallelConfig &pc = plan.parallel;
    for (size_t r = 0; r < plan.ranks.size(); ++r) {
      const auto &in = plan.ranks[r];
      // dp all-reduces where the rule puts them (none to place with dp = 1).
      std::vector<llvm::SmallVector<int, 2>> dpAt;
      size_t numDp = 0;
      if (pc.gradReduceRanks() > 1) {
        dpAt = dpAllReducePoints(in);
        for (const auto &stages : dpAt)
          numDp += stages.size();
      }
      // Exactly what is emitted below, so that the stream is allocated once.
      size_t size = in.size() + numDp + 3;
      if (pc.tp > 1)
        for (const Instruction &i : in) {
          int parts = plan.stages[size_t(std::max(i.stage, 0))].tpAllReduces;
          if (parts > 0 && i.isCompute() && i.op != OpKind::BackwardWeight)
            size += 2 * size_t(parts) - 1; // parts and their all-reduces, for the op
        }
      std::vector<Instruction> out;
      out.reserve(size);
      auto emitDp = [&](size_t n) {
        if (dpAt.empty())
          return;
        for (int s : dpAt[n]) {
          Instruction ar;
          ar.op = OpKind::AllReduce;
          ar.collective = CollectiveGroup::Dp;
          ar.stage = s;
          ar.bytes = plan.stages[size_t(s)].paramBytes;
          out.push_back(ar);
        }
      };
      for (size_t n = 0; n < in.size(); ++n) {
        const Instruction &i = in[n];
        emitDp(n);
        int parts = plan.stages[size_t(std::max(i.stage, 0))].tpAllReduces;
        bool split = pc.tp > 1 && parts > 0 && i.isCompute() && i.op != OpKind::BackwardWeight;
        if (!split) {
          out.push_back(i);
        } else {
          for (int p = 0; p < parts; ++p) {
            Instruction part = i;
            part.part = p;
            part.parts = parts;
            out.push_back(part);
            Instruction ar;
            ar.op = OpKind::AllReduce;
            ar.collective = CollectiveGroup::Tp;
            ar.phase = i.op;
            ar.stage = i.stage;
            ar.mb = i.mb;
            ar.slice = i.slice;
            ar.part = p;
            ar.parts = parts;
            ar.bytes = plan.tpAllReduceBytes(i.stage, i.slice, i.op, p);
            out.push_back(ar);
          }
        }
      }
      emitDp(in.size());
      if (plan.tiedEmbeddings()) {
        for (int s : {0, plan.numStages() - 1}) {
          if (plan.rankOf(s) != int(r))
            continue;
          Instruction ar;
          ar.op = OpKind::AllReduce;
          ar.collective = CollectiveGroup::Embedding;
          ar.stage = s;
          ar.bytes = plan.tiedEmbeddingBytes();
          out.push_back(ar);
        }
      }
      Instruction opt;
      opt.op = OpKind::OptimizerStep;
      out.push_back(opt);
      plan.ranks[r] = std::move(out);
    }
    ctx.collectivesLowered = true;
    return true;
  }
};

} // namespace

std::unique_ptr<Pass> createLowerCollectivesPass() {
  return std::make_unique<LowerCollectivesPass>();
}

} // namespace pipec
