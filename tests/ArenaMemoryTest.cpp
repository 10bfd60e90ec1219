//===- ArenaMemoryTest.cpp - pipec's activation memory against the cuda backend's arenas ---===//
//
// Issue 33, item 4, on the device side: the cuda backend sizes each rank's activation arena
// before step 0 by interpreting the rank's stream on the host and recording every buffer a
// step requests (runtime/cuda/CudaRun.h); that arena holds everything a step allocates on the
// device: activations, saved state, received tensors, kept gradients and the ops' scratch. pipec
// predicts the same thing per rank (peak_memory_bytes - static_bytes: the cost model's
// activations, backward build-up, workspace and receive buffers). The GPU kernels run
// flash-style attention (the model's default "attention"), at the model's dtype. Built for the
// emulated device (//tests:arena_memory_test_emu) and a real GPU.
// Issue 41, item 1: the weight-gradient state a split backward keeps from B to W, isolated as
// the difference of zb-h1's and 1f1b's (or seq1f1b's) peaks, is what the stages keep, to the
// byte of their buffers (the arena's live bytes, without first fit's gaps).
//
//===----------------------------------------------------------------------===//
#include "tests/MemoryTest.h"

#include "compiler/Verifier.h"
#include "ir/support/Error.h"
#include "runtime/Data.h"
#include "runtime/cuda/CudaRun.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <map>
#include <string>
#include <tuple>

namespace pipec::test {
namespace {

/// A case's plan and what its run's arenas were: reserved (`arena`) and live at once (`live`),
/// per runtime rank; `predicted`: pipec's peak_memory_bytes - static_bytes, per runtime rank.
struct Arenas {
  Plan plan;
  std::vector<double> predicted, arena, live;
};

Arenas run(const MemoryCase &c, const char *dtype, bool llama) {
  Arenas out;
  out.plan = compileOrFail(memoryModel(dtype, "flash", llama), c.compileOptions());
  EXPECT_FALSE(verifyPlan(out.plan));
  auto data = syntheticData(32, /*seed=*/3);
  CudaRunOptions o;
  o.steps = 1;
  o.timeoutSeconds = 60;
  o.dtype = std::string(dtype) == "bf16" ? kernels::DType::BF16 : kernels::DType::F32;
  auto result = runOnCuda(out.plan, *data, o);
  if (!result) {
    ADD_FAILURE() << takeMessage(result.takeError());
    return out;
  }
  EXPECT_EQ(result->arenaBytes.size(), out.plan.stats.ranks.size() * c.replicas());
  EXPECT_EQ(result->arenaLiveBytes.size(), result->arenaBytes.size());
  for (size_t g = 0; g < result->arenaBytes.size() && g < result->arenaLiveBytes.size(); ++g) {
    const RankStats &rs = out.plan.stats.ranks[g / c.replicas()];
    out.predicted.push_back(double(rs.peakMemoryBytes - rs.staticBytes));
    out.arena.push_back(double(result->arenaBytes[g]));
    out.live.push_back(double(result->arenaLiveBytes[g]));
  }
  return out;
}

// The arena is what a step's buffers need live at once (`live`) plus the gaps that first-fit
// placement leaves below its top: 0-16% more here, most with zb-v, seq1f1b's sequence-long
// dK/dV and GPT-2's later stages. pipec predicts the buffers, with every op's whole workspace
// on top of a backward's build-up (the kernels' backward frees most of its temporaries before
// its end: up to 13% more than the buffers, at the end of a backward); so the prediction is
// never under the live bytes and lands within 9% of the arena (0.919 - 1.055 over these
// ranks; 0.936 without zb-v).
// Issue 41, item 1: the weight-gradient state alone, from the same runs (kWeightGradPairs).
// One instance per block and precision (the test shards them).
class ArenaMemoryTest : public ::testing::TestWithParam<std::tuple<bool, const char *>> {};

TEST_P(ArenaMemoryTest, ArenasAreWhatPipecPredicts) {
  const auto [llama, dtype] = GetParam();
  std::map<std::string, Arenas> runs;
  for (const MemoryCase &c : kMemoryCases) {
    if (c.dp > 1) // (every dp replica's arena is its pipeline rank's: as dp = 1)
      continue;
    SCOPED_TRACE(c.name());
    Arenas &a = runs[c.name()] = run(c, dtype, llama);
    for (size_t g = 0; g < a.arena.size(); ++g) {
      std::printf("%s %s %-42s rank %zu: predicted %.0f, arena %.0f (live %.0f), ratio %.3f "
                  "(to live %.3f)\n",
                  llama ? "llama" : "gpt  ", dtype, c.name().c_str(), g, a.predicted[g], a.arena[g],
                  a.live[g], a.predicted[g] / a.arena[g], a.predicted[g] / a.live[g]);
      ASSERT_GT(a.arena[g], 0) << "rank " << g;
      EXPECT_LE(a.live[g], a.arena[g]) << "rank " << g;
      EXPECT_NEAR(a.predicted[g] / a.arena[g], 1.0, 0.09)
          << "rank " << g << ": pipec predicts " << a.predicted[g] << " bytes, the arena is "
          << a.arena[g];
      EXPECT_GE(a.predicted[g] / a.live[g], 0.98)
          << "rank " << g << ": pipec predicts " << a.predicted[g] << " bytes, the buffers "
          << "live at once need " << a.live[g];
    }
  }
  // The weight-gradient state: to the byte of the buffers (the arena's live peak).
  for (const auto &[splitCase, fusedCase] : kWeightGradPairs) {
    SCOPED_TRACE(splitCase.name());
    const Arenas &split = runs.at(splitCase.name()), &fused = runs.at(fusedCase.name());
    expectWeightGradState(split.predicted, split.live, fused.predicted, fused.live, 0.01);
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, ArenaMemoryTest,
                         ::testing::Combine(::testing::Values(false, true),
                                            ::testing::Values("fp32", "bf16")),
                         [](const auto &info) {
                           return std::string(std::get<0>(info.param) ? "Llama" : "Gpt2") + "_" +
                                  std::get<1>(info.param);
                         });

} // namespace
} // namespace pipec::test
