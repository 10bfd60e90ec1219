//===- SweepTest.cpp - gpipe and 1f1b against their closed forms ----------===//
//
// For p in 1..16 and m in 1..64 every plan compiles with the verifier after each pass, and the
// simulator meets the papers' closed forms: bubble (p-1)/(m+p-1) with unit F, B, W (both
// schedules), peak activation of rank 0 = m·A (GPipe) and min(p, m)·A (1F1B).
//
//===----------------------------------------------------------------------===//
#include "tests/TestUtil.h"

#include "compiler/Verifier.h"

#include <algorithm>

namespace pipec::test {
namespace {

struct SweepCase {
  const char *schedule;
  bool boundedMemory;
};

class ClosedFormSweep : public ::testing::TestWithParam<SweepCase> {};

TEST_P(ClosedFormSweep, BubbleAndPeakActivationMatchThePapers) {
  const SweepCase &c = GetParam();
  for (int p = 1; p <= 16; ++p) {
    // One unit layer per stage: F = B = W = 1 per stage, A = 1 MiB.
    ModelSpec model = uniformModel(/*layers=*/p);
    const int64_t a = model.layers[0].activationBytes;
    for (int m = 1; m <= 64; ++m) {
      SCOPED_TRACE(testing::Message() << c.schedule << " p=" << p << " m=" << m);
      Plan plan = compileOrFail(model, options(c.schedule, p, m));
      ASSERT_EQ(plan.numRanks(), p);
      double expected = double(p - 1) / double(m + p - 1);
      EXPECT_NEAR(plan.stats.bubbleRatio, expected, 1e-12);
      // Busy time per rank is m·(F + B + W) = 3m; the makespan (m+p-1)·3.
      EXPECT_NEAR(plan.stats.makespan, 3.0 * (m + p - 1), 1e-9);
      int64_t peak0 = plan.stats.ranks[0].peakActivationBytes;
      int64_t want = c.boundedMemory ? std::min(p, m) * a : m * a;
      EXPECT_EQ(peak0, want);
      // Every rank of 1F1B holds at most min(p - r, m) microbatches.
      if (c.boundedMemory) {
        for (int r = 0; r < p; ++r)
          EXPECT_EQ(plan.stats.ranks[size_t(r)].peakActivationBytes, std::min(p - r, m) * a);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Schedules, ClosedFormSweep,
                         ::testing::Values(SweepCase{"gpipe", false}, SweepCase{"1f1b", true}),
                         [](const auto &info) {
                           return std::string(info.param.schedule) == "gpipe" ? "GPipe"
                                                                              : "OneFOneB";
                         });

/// Uneven, random costs and transfer times: the plan must still verify (the lowering's
/// deadlock-freedom argument does not depend on the costs).
TEST(SweepTest, RandomCostsStillVerifyAndStayDeterministic) {
  uint64_t seed = 12345;
  auto next = [&]() {
    seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
    return double((seed >> 33) % 1000) / 100.0;
  };
  for (int trial = 0; trial < 60; ++trial) {
    int p = 1 + int(next() * 10) % 9, m = 1 + int(next() * 10) % 17;
    ModelSpec model = uniformModel(p + trial % 5);
    for (Layer &l : model.layers) {
      l.forward = next();
      l.backwardInput = next();
      l.backwardWeight = next();
      l.weightGradBytes = l.activationBytes / 2;
    }
    model.p2pTime = next() / 4;
    for (const char *s : {"gpipe", "1f1b"}) {
      SCOPED_TRACE(testing::Message() << s << " trial " << trial << " p=" << p << " m=" << m);
      Plan a = compileOrFail(model, options(s, p, m));
      Plan b = compileOrFail(model, options(s, p, m));
      EXPECT_EQ(a.ranks, b.ranks);
      EXPECT_EQ(a.stats.makespan, b.stats.makespan);
      EXPECT_FALSE(verifyPlan(a));
    }
  }
}

/// m < p must work for both (PyTorch refuses 1F1B there; GPipe-like behaviour is the answer).
TEST(SweepTest, FewerMicrobatchesThanRanksWorksForOneFOneB) {
  Plan plan = compileOrFail(uniformModel(8), options("1f1b", /*pp=*/8, /*microbatches=*/3));
  EXPECT_NEAR(plan.stats.bubbleRatio, 7.0 / 10.0, 1e-12);
}

} // namespace
} // namespace pipec::test
