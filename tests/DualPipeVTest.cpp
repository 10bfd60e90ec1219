//===- DualPipeVTest.cpp - DualPipeV against DualPipe's published forms ---===//
#include "tests/TestUtil.h"

#include "compiler/Verifier.h"
#include "ir/PlanText.h"

#include <algorithm>

namespace pipec::test {
namespace {

/// Rank r's idle time inside its span.
double idle(const Plan &plan, int r) {
  const RankStats &s = plan.stats.ranks[size_t(r)];
  return s.span - s.busy;
}

TEST(DualPipeVTest, SweepVerifiesAndMatchesDualPipesBubbleAndMemory) {
  for (int p = 2; p <= 16; ++p) {
    // One unit layer per stage (2p stages).
    for (double b : {1.0, 2.0}) {
      ModelSpec model = uniformModel(2 * p, /*f=*/1, /*b=*/b, /*w=*/1);
      const int64_t a = model.layers[0].activationBytes;
      for (int m = 2 * p; m <= 64; m += (m < 2 * p + 4 ? 1 : 7)) {
        SCOPED_TRACE(testing::Message() << "p=" << p << " m=" << m << " B=" << b);
        Plan plan = compileOrFail(model, options("dualpipe-v", p, m, /*vpp=*/2));
        ASSERT_EQ(plan.numStages(), 2 * p);
        // DualPipe's table gives the bubble per device as (PP-1)(F&B + B - 3W); with unit
        // chunk costs F = B = W = 1 and F&B = F + B + W = 3 (no speed-up from the overlap in
        // this timing model) that is PP-1 on the first rank.
        if (b == 1.0) {
          EXPECT_NEAR(idle(plan, 0), (p - 1) * (3.0 + 1.0 - 3.0), 1e-9);
        }
        // Activation: 2P+1 chunks on rank 0 (DualPipe's "PP+1" of full-rank chunks).
        EXPECT_EQ(plan.stats.ranks[0].peakActivationBytes, (2 * p + 1) * a);
        // Never worse than 1F1B at the same pp on the same model.
        Plan ref = compileOrFail(uniformModel(p, 2, 2 * b, 2), options("1f1b", p, m));
        EXPECT_LT(plan.stats.bubbleRatio, ref.stats.bubbleRatio);
      }
    }
  }
}

TEST(DualPipeVTest, PlacesStagesInAVAndSplitsOnlyTheEdgeBackwards) {
  Plan plan = compileOrFail(uniformModel(8), options("dualpipe-v", 4, 8, /*vpp=*/2));
  EXPECT_EQ(plan.placement, Placement::VShape);
  for (int s = 0; s < 8; ++s)
    EXPECT_EQ(plan.rankOf(s), s < 4 ? s : 7 - s);
  // Rank 0 holds stages 0 and 7 (the loss): the first and last stage share a rank.
  std::string text = formatStreams(plan, /*computeOnly=*/true);
  EXPECT_NE(text.find("rank 0: 0F0 0F1 0F2 0F3 0F4 0F5 0F6 7F0"), std::string::npos) << text;
  size_t fused = 0, split = 0;
  for (const auto &stream : plan.ranks)
    for (const Instruction &i : stream) {
      fused += i.op == OpKind::Backward;
      split += i.op == OpKind::BackwardInput;
    }
  EXPECT_GT(fused, 0u);
  EXPECT_GT(split, 0u);
  EXPECT_EQ(fused + split, size_t(2 * 4 * 8));
}

TEST(DualPipeVTest, ConstraintsNameTheFlagAndTheFix) {
  ModelSpec m = uniformModel(8);
  auto err = [&](const CompileOptions &o) {
    return errorText(compilePlan(m, ClusterSpec::defaults(), o).takeError());
  };
  EXPECT_EQ(err(options("dualpipe-v", 4, 8)), "dualpipe-v needs --vpp 2 (got 1); try --vpp 2");
  EXPECT_EQ(err(options("dualpipe-v", 4, 7, 2)),
            "dualpipe-v needs --microbatches >= 2 x --pp = 8 (got 7); try --microbatches 8");
  EXPECT_EQ(err(options("dualpipe-v", 2, 8, 2, /*seqSplits=*/2)),
            "dualpipe-v needs --seq-splits 1 (got 2); try --seq-splits 1");
}

} // namespace
} // namespace pipec::test
