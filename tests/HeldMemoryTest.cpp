//===- HeldMemoryTest.cpp - pipec's activation memory against what piperun holds ------===//
//
// Issue 33, item 4: the per-rank activation memory pipec predicts for a plan (the memory pass,
// ir/CostModel.h's rule: activations, what a backward builds, workspace, and receive buffers;
// peak_memory_bytes - static_bytes) must be what the runtime really holds, at the same
// precision. Here the cpu backend, which measures, after every call into a stage, the bytes its
// stages keep (StageCompute::savedBytes) plus its received and kept p2p tensors
// (CpuRunResult::heldBytes, the high-water mark per rank). Several schedules and layouts (pp,
// vpp, seq splits, tp, dp), a GPT large enough that the activations, not the few-byte
// bookkeeping, are what is held. Issue 41, item 1: the weight-gradient state alone, as the
// difference of zb-h1's and 1f1b's peaks.
//
//===----------------------------------------------------------------------===//
#include "tests/MemoryTest.h"

#include "compiler/Pass.h"
#include "compiler/Verifier.h"
#include "ir/support/Error.h"
#include "runtime/Data.h"
#include "runtime/cpu/CpuRun.h"

#include <gtest/gtest.h>

#include <cstdio>

namespace pipec::test {
namespace {

/// A case's predictions and what the cpu backend held, per runtime rank: `predicted` between
/// kernel calls (see below), `full` with the ops' workspace.
struct Held {
  std::vector<double> predicted, full, held;
};

/// The cpu kernels keep the attention probabilities of every query and key
/// (kernels/cpu/Gpt.cpp, BlockWork::probs): "attention": "materialized" is how they behave.
Held run(const MemoryCase &c, bool llama) {
  Held out;
  ModelSpec m = memoryModel("fp32", "materialized", llama);
  Plan plan = compileOrFail(m, c.compileOptions());
  EXPECT_FALSE(verifyPlan(plan));
  auto data = syntheticData(32, /*seed=*/3);
  CpuRunOptions o;
  o.steps = 1;
  auto result = runOnCpu(plan, *data, o);
  if (!result) {
    ADD_FAILURE() << takeMessage(result.takeError());
    return out;
  }
  // The cpu backend samples between kernel calls, so it never sees an op's own temporaries
  // (the cost model's workspace_bytes, held only while the op runs): the prediction it is
  // held to is the memory pass's on the same plan with those set to 0.
  Plan between = plan;
  for (StageInfo &st : between.stages)
    for (int64_t &w : st.workspaceBytes)
      w = 0;
  ClusterSpec cluster = ClusterSpec::defaults();
  PassContext ctx;
  ctx.model = &m;
  ctx.cluster = &cluster;
  ctx.options = c.compileOptions();
  const llvm::StringRef memory[] = {"memory"};
  llvm::Error err = runPipeline(memory, between, ctx);
  EXPECT_FALSE(bool(err)) << takeMessage(std::move(err));
  // heldBytes is per process rank, ((pp·dp + dp)·tp + tp); the plan's ranks are pipeline
  // ranks, which every dp replica and tp shard repeats.
  EXPECT_EQ(result->heldBytes.size(), plan.stats.ranks.size() * c.replicas());
  for (size_t g = 0; g < result->heldBytes.size(); ++g) {
    const RankStats &rs = between.stats.ranks[g / c.replicas()];
    const RankStats &full = plan.stats.ranks[g / c.replicas()];
    out.predicted.push_back(double(rs.peakMemoryBytes - rs.staticBytes));
    out.full.push_back(double(full.peakMemoryBytes - full.staticBytes));
    out.held.push_back(double(result->heldBytes[g]));
  }
  return out;
}

class HeldMemoryTest : public ::testing::TestWithParam<bool> {};

TEST_P(HeldMemoryTest, CpuBackendHoldsWhatPipecPredictsWithinNinePercent) {
  const bool llama = GetParam();
  for (const MemoryCase &c : kMemoryCases) {
    SCOPED_TRACE(c.name());
    Held h = run(c, llama);
    for (size_t g = 0; g < h.held.size(); ++g) {
      ASSERT_GT(h.held[g], 0) << "rank " << g;
      // The cpu backend's samples fall between a stage's parts, so it misses the last block's
      // K/V and dK/dV that the end of a backward holds when the stage's last part is a block's
      // (every stage but the first): the prediction is never under what is held, and up to 8%
      // over it there (1.000 - 1.079 over these ranks).
      EXPECT_GE(h.predicted[g] / h.held[g], 0.99)
          << "rank " << g << ": pipec predicts " << h.predicted[g]
          << " bytes between kernel calls, the cpu backend held " << h.held[g];
      EXPECT_LE(h.predicted[g] / h.held[g], 1.09)
          << "rank " << g << ": pipec predicts " << h.predicted[g]
          << " bytes between kernel calls, the cpu backend held " << h.held[g];
      std::printf("%-42s rank %zu: predicted %.0f (with workspace %.0f), held %.0f, ratio "
                  "%.3f\n",
                  c.name().c_str(), g, h.predicted[g], h.full[g], h.held[g],
                  h.predicted[g] / h.held[g]);
    }
  }
}

TEST_P(HeldMemoryTest, WeightGradientStateIsWhatTheStagesKeep) {
  for (const auto &[splitCase, fusedCase] : kWeightGradPairs) {
    SCOPED_TRACE(splitCase.name());
    Held split = run(splitCase, GetParam());
    Held fused = run(fusedCase, GetParam());
    expectWeightGradState(split.predicted, split.held, fused.predicted, fused.held, 0.01);
  }
}

INSTANTIATE_TEST_SUITE_P(Blocks, HeldMemoryTest, ::testing::Values(false, true),
                         [](const auto &info) { return info.param ? "Llama" : "Gpt2"; });

} // namespace
} // namespace pipec::test
