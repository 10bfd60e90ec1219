//===- ZbAutoTest.cpp - zb-auto against the zero-bubble paper and 1F1B ----===//
//
// (a) The twelve settings of Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024), Table 5
//     (bubble rates of ZB-1p and ZB-2p), with the profiled T_F, T_B, T_W, T_comm of its Table 9
//     (one stage per rank, so a stage's costs are the table's). Memory: M_B per microbatch and
//     stage, M_W = M_B/2 (the authors' auto_schedule example uses mem_f = 2, mem_b = mem_w =
//     -1). At --memory-limit p·M_B our bubble must be <= ZB-1p's, at 2p·M_B <= ZB-2p's on
//     every setting (the table rounds to 4 places: tolerance 0.00005); peaks stay under the
//     limit; plans verify.
// (b) A seeded sweep over small configurations with uneven costs and several limits; a sweep
//     over transformer sizes, pp, m, tp, dp and limits: zb-auto's step time (as compile reports
//     it) is never above zb-h1's or zb-h2's where their own peak fits the limit.
// (c) The diagnostics. (d) Determinism.
//
//===----------------------------------------------------------------------===//
#include "tests/TestUtil.h"

#include "compiler/Verifier.h"
#include "schedules/Policy.h"

#include <algorithm>
#include <cstdio>
#include <string>

namespace pipec::test {
namespace {

constexpr int64_t kMB = 1 << 20; // M_B of every stage in (a)

struct PaperSetting {
  const char *model;
  int p, m;
  double f, b, w, comm; // Table 9
  double zb1p, zb2p;    // Table 5
  /// Where zb-auto would fall short of the paper (documented, not hidden): 0 everywhere.
  double zb2pShortfall = 0;
};

// Table 9 (profiled times, ms) and Table 5 (bubble rates) of the ICLR 2024 version.
const PaperSetting kPaper[] = {
    // At 2p·M_B both reach the bound (p-1)(F+c) + m(F+B) + (p-1)(B+c) + W on rank 0.
    {"1.5B", 8, 24, 18.522, 18.086, 9.337, 0.601, 0.1585, 0.0433, 0},
    {"1.5B", 8, 32, 18.513, 18.086, 9.331, 0.626, 0.1242, 0.0039},
    {"1.5B", 8, 64, 18.546, 18.097, 9.321, 0.762, 0.0674, 0.0026},
    {"6.2B", 8, 24, 29.718, 29.444, 19.927, 0.527, 0.1323, 0.0029},
    {"6.2B", 8, 32, 29.802, 29.428, 19.530, 0.577, 0.1045, 0.0022},
    {"6.2B", 8, 64, 29.935, 29.621, 19.388, 0.535, 0.0554, 0.0010},
    {"14.6B", 16, 48, 11.347, 11.248, 8.132, 0.377, 0.1397, 0.0066},
    {"14.6B", 16, 64, 11.307, 11.254, 8.101, 0.379, 0.1088, 0.0054},
    {"14.6B", 16, 128, 11.325, 11.308, 8.109, 0.378, 0.0576, 0.0028},
    {"28.3B", 32, 96, 10.419, 10.207, 7.715, 0.408, 0.1421, 0.0038},
    {"28.3B", 32, 128, 10.408, 10.204, 7.703, 0.408, 0.1106, 0.0029},
    {"28.3B", 32, 256, 10.402, 10.248, 7.698, 0.460, 0.0594, 0.0018},
};

CompileOptions zbAuto(int p, int m, int64_t limit) {
  CompileOptions o = options("zb-auto", p, m);
  o.memoryLimit = limit;
  return o;
}

int64_t maxPeak(const Plan &plan) { return plan.stats.maxPeakActivationBytes(); }

void expectWithinLimit(const Plan &plan, int64_t limit) {
  for (const RankStats &r : plan.stats.ranks)
    EXPECT_LE(r.peakActivationBytes, limit) << "rank " << r.rank;
}

//===----------------------------------------------------------------------===//
// (a) The paper's Table 5.
//===----------------------------------------------------------------------===//

class PaperTable5 : public ::testing::TestWithParam<PaperSetting> {};

TEST_P(PaperTable5, AtLeastAsGoodAsZB1pAndZB2p) {
  const PaperSetting &s = GetParam();
  ModelSpec model = uniformModel(s.p, s.f, s.b, s.w, kMB, kMB / 2, s.comm);
  double ours[2] = {0, 0};
  const double paper[2] = {s.zb1p, s.zb2p + s.zb2pShortfall};
  for (int k = 1; k <= 2; ++k) {
    int64_t limit = int64_t(k) * s.p * kMB;
    SCOPED_TRACE(testing::Message()
                 << s.model << " p=" << s.p << " m=" << s.m << " limit " << k << "p·M_B");
    Plan plan = compileOrFail(model, zbAuto(s.p, s.m, limit));
    ASSERT_EQ(plan.numRanks(), s.p);
    EXPECT_FALSE(bool(verifyPlan(plan)));
    expectWithinLimit(plan, limit);
    ours[k - 1] = plan.stats.bubbleRatio;
    EXPECT_LE(plan.stats.bubbleRatio, paper[k - 1] + 0.00005);
  }
  // The README's table is made from these lines.
  std::printf("[table5] %-5s p=%-2d m=%-3d ZB-1p %.4f ours@pM_B %.4f | ZB-2p %.4f ours@2pM_B "
              "%.4f\n",
              s.model, s.p, s.m, s.zb1p, ours[0], s.zb2p, ours[1]);
}

INSTANTIATE_TEST_SUITE_P(Settings, PaperTable5, ::testing::ValuesIn(kPaper), [](const auto &info) {
  std::string name = info.param.model;
  std::replace(name.begin(), name.end(), '.', '_');
  return name + "_p" + std::to_string(info.param.p) + "_m" + std::to_string(info.param.m);
});

//===----------------------------------------------------------------------===//
// (b) Sweep: uneven seeded costs, several limits.
//===----------------------------------------------------------------------===//

/// A small fixed-seed generator (the same stream on every platform).
struct Lcg {
  uint64_t state;
  double next() {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return double(state >> 11) / double(1ull << 53);
  }
  double in(double lo, double hi) { return lo + (hi - lo) * next(); }
};

ModelSpec randomModel(int p, Lcg &rng) {
  ModelSpec m = uniformModel(p);
  for (Layer &l : m.layers) {
    l.forward = rng.in(0.5, 2.0);
    l.backwardInput = rng.in(0.5, 2.0);
    l.backwardWeight = rng.in(0.1, 2.0);
    l.activationBytes = int64_t(rng.in(0.5, 1.5) * double(kMB));
    l.weightGradBytes = int64_t(rng.in(0.0, 0.9) * double(l.activationBytes));
  }
  m.p2pTime = rng.in(0.0, 0.3);
  return m;
}

TEST(ZbAutoSweepTest, VerifiesRespectsTheLimitAndNeverLosesTo1F1B) {
  Lcg rng{20240110};
  // Every m up to 8 (fewer microbatches than ranks, the warm-up's edge cases), then a spread
  // up to 4p: the search is the suite's slowest part, so not all 32 values.
  for (int p = 2; p <= 8; ++p) {
    for (int m : {1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 24, 32}) {
      ModelSpec model = randomModel(p, rng);
      Plan ref = compileOrFail(model, options("1f1b", p, m));
      int64_t refPeak = maxPeak(ref);
      int64_t least = 0;
      for (const Layer &l : model.layers)
        least = std::max(least, l.activationBytes);
      const int64_t limits[] = {least, (p / 2 + 1) * least, refPeak, 2 * p * least,
                                int64_t(m + 1) * least * 2};
      for (int64_t limit : limits) {
        SCOPED_TRACE(testing::Message() << "p=" << p << " m=" << m << " limit=" << limit);
        Plan plan = compileOrFail(model, zbAuto(p, m, limit));
        ASSERT_EQ(plan.numRanks(), p);
        expectWithinLimit(plan, limit);
        if (limit >= refPeak) {
          EXPECT_LE(plan.stats.makespan, ref.stats.makespan * (1 + 1e-12));
        }
      }
    }
  }
}

TEST(ZbAutoSweepTest, UnitCostsMeetZBH1sClosedFormAndMoreMemoryNeverHurts) {
  // F = B = W = 1, no transfer time, M_W = M_B/2: ZB-H1 fits p·M_B with bubble (p-1)/(3m+p-1).
  for (int p : {2, 4, 8}) {
    int m = 3 * p;
    ModelSpec model = uniformModel(p, 1, 1, 1, kMB, kMB / 2);
    Plan h1 = compileOrFail(model, zbAuto(p, m, p * kMB));
    Plan plan = compileOrFail(model, zbAuto(p, m, 2 * p * kMB));
    EXPECT_LE(plan.stats.bubbleRatio, h1.stats.bubbleRatio + 1e-12) << "p=" << p;
    // ZB-H1's bubble (p-1)(F+B-W) per rank bounds zb-auto at p·M_B.
    double h1Bubble = double(p - 1) / (3.0 * m + double(p - 1));
    EXPECT_LE(h1.stats.bubbleRatio, h1Bubble + 1e-12) << "p=" << p;
  }
}

/// Compile-reported step time of zb-auto at `limit` against zb-h1's and zb-h2's wherever their
/// own peak activation fits it: never more (up to a relative 1e-9 of summation order).
void expectNoWorseThanZBH1AndZBH2(const ModelSpec &model, CompileOptions base,
                                  const std::vector<double> &limitFactors, int *compared) {
  base.schedule = "zb-h1";
  Plan h1 = compileOrFail(model, base);
  base.schedule = "zb-h2";
  Plan h2 = compileOrFail(model, base);
  const int64_t h1Peak = maxPeak(h1), h2Peak = maxPeak(h2);
  std::vector<int64_t> limits = {h1Peak, h2Peak, (h1Peak + h2Peak) / 2};
  for (double f : limitFactors)
    limits.push_back(int64_t(double(h2Peak) * f));
  for (int64_t limit : limits) {
    CompileOptions o = base;
    o.schedule = "zb-auto";
    o.memoryLimit = limit;
    auto plan = compilePlan(model, ClusterSpec::defaults(), o);
    if (!plan) { // below one microbatch's lifetime peak: neither fixed order fits either
      EXPECT_LT(limit, std::min(h1Peak, h2Peak)) << takeMessage(plan.takeError());
      continue;
    }
    SCOPED_TRACE(testing::Message()
                 << model.name << " pp=" << base.parallel.pp << " m=" << base.parallel.microbatches
                 << " tp=" << base.parallel.tp << " dp=" << base.parallel.dp << " limit=" << limit
                 << " (zb-h1 peak " << h1Peak << ", zb-h2 peak " << h2Peak << ")");
    expectWithinLimit(*plan, limit);
    const double step = plan->stats.stepTime;
    for (const Plan *fixed : {&h1, &h2}) {
      if (maxPeak(*fixed) > limit)
        continue;
      ++*compared;
      EXPECT_LE(step, fixed->stats.stepTime * (1 + 1e-9)) << "against " << fixed->schedule;
    }
  }
}

TEST(ZbAutoSweepTest, NeverSlowerThanZBH1OrZBH2WhereTheyFit) {
  // Transformers of two sizes (their tp all-reduces and dp all-reduces are in the step time
  // compile reports, not in the greedy's own timing), pp 2 to 8, m = p and 3p+1, tp and dp 1
  // or 2, and limits at zb-h1's and zb-h2's own peaks, between them, above and below.
  int compared = 0;
  struct Size {
    int hidden, heads, ffn, seq;
  };
  for (Size sz : {Size{32, 4, 128, 64}, Size{128, 8, 512, 256}})
    for (int pp : {2, 4, 8})
      for (int m : {pp, 3 * pp + 1})
        for (auto [tp, dp] : {std::pair{1, 1}, std::pair{2, 2}}) {
          ModelSpec model = fp32Gpt(pp, sz.hidden, sz.heads, sz.ffn, sz.seq, 2);
          expectNoWorseThanZBH1AndZBH2(model, options("zb-h1", pp, m, 1, 1, tp, dp), {0.8, 1.5},
                                       &compared);
        }
  // Uneven abstract stages (seeded) with transfer times, dp 1 and 2.
  Lcg rng{41};
  for (int p = 2; p <= 6; ++p)
    for (int m : {p - 1, 2 * p, 3 * p})
      for (int dp : {1, 2}) {
        ModelSpec model = randomModel(p, rng);
        expectNoWorseThanZBH1AndZBH2(model, options("zb-h1", p, m, 1, 1, 1, dp), {0.7, 1.5},
                                     &compared);
      }
  EXPECT_GT(compared, 100); // the comparisons did happen
}

//===----------------------------------------------------------------------===//
// (c) Diagnostics.
//===----------------------------------------------------------------------===//

const SchedulePolicy &policy() {
  auto p = findPolicy("zb-auto");
  EXPECT_TRUE(bool(p));
  return **p;
}

std::vector<StageInfo> stages(int p, int64_t act) {
  std::vector<StageInfo> out(static_cast<size_t>(p));
  for (int s = 0; s < p; ++s) {
    out[size_t(s)].stage = out[size_t(s)].rank = s;
    out[size_t(s)].activationBytes = {act + s}; // stage p-1 is the heaviest
  }
  return out;
}

TEST(ZbAutoDiagnosticsTest, NeedsVpp1AndSeqSplits1) {
  struct Case {
    int vpp, seqSplits;
    const char *says;
  } cases[] = {{2, 1, "zb-auto needs --vpp 1 (got 2)"},
               {1, 2, "zb-auto needs --seq-splits 1 (got 2)"}};
  for (const Case &k : cases) {
    ParallelConfig c{.pp = 4, .vpp = k.vpp, .microbatches = 8, .seqSplits = k.seqSplits};
    std::string msg = errorText(policy().check(c));
    EXPECT_NE(msg.find(k.says), std::string::npos) << msg;
  }
}

TEST(ZbAutoDiagnosticsTest, NeedsAMemoryLimitAndSuggestsPTimesMB) {
  std::vector<StageInfo> st = stages(4, 1000);
  ScheduleRequest req;
  req.parallel = {.pp = 4, .microbatches = 8};
  req.stages = st;
  std::string msg = errorText(policy().checkRequest(req));
  EXPECT_NE(msg.find("zb-auto needs --memory-limit (bytes per rank of activations); try "
                     "--memory-limit 4012"),
            std::string::npos)
      << msg;
}

TEST(ZbAutoDiagnosticsTest, ALimitBelowOneMicrobatchNamesTheMinimum) {
  std::vector<StageInfo> st = stages(4, 1000);
  ScheduleRequest req;
  req.parallel = {.pp = 4, .microbatches = 8};
  req.stages = st;
  req.memoryLimit = 1002;
  std::string msg = errorText(policy().checkRequest(req));
  EXPECT_NE(msg.find("zb-auto needs --memory-limit >= 1003 (one microbatch's activations on "
                     "stage 3; got 1002)"),
            std::string::npos)
      << msg;
  req.memoryLimit = 1003;
  EXPECT_FALSE(bool(policy().checkRequest(req)));
}

TEST(ZbAutoDiagnosticsTest, CompileRejectsVpp2AndSeqSplits2) {
  ModelSpec model = uniformModel(8);
  CompileOptions o = zbAuto(4, 8, 8 * kMB);
  o.parallel.vpp = 2;
  EXPECT_NE(errorText(compilePlan(model, ClusterSpec::defaults(), o).takeError()).find("--vpp 1"),
            std::string::npos);
  o = zbAuto(4, 8, 8 * kMB);
  o.parallel.seqSplits = 2;
  EXPECT_NE(
      errorText(compilePlan(model, ClusterSpec::defaults(), o).takeError()).find("--seq-splits 1"),
      std::string::npos);
}

TEST(ZbAutoDiagnosticsTest, TheLeastLimitStillGivesAValidPlan) {
  // One microbatch of activations per rank: every rank runs F, I, W of one microbatch at a
  // time, and the plan still verifies.
  ModelSpec model = uniformModel(4, 1, 1, 1, kMB, kMB / 4, 0.1);
  Plan plan = compileOrFail(model, zbAuto(4, 6, kMB));
  expectWithinLimit(plan, kMB);
  EXPECT_EQ(maxPeak(plan), kMB);
}

//===----------------------------------------------------------------------===//
// (d) Determinism.
//===----------------------------------------------------------------------===//

TEST(ZbAutoDeterminismTest, SameInputGivesIdenticalStreams) {
  const PaperSetting &s = kPaper[6]; // 14.6B, p = 16, m = 48
  ModelSpec model = uniformModel(s.p, s.f, s.b, s.w, kMB, kMB / 2, s.comm);
  for (int k = 1; k <= 2; ++k) {
    Plan a = compileOrFail(model, zbAuto(s.p, s.m, k * s.p * kMB));
    Plan b = compileOrFail(model, zbAuto(s.p, s.m, k * s.p * kMB));
    EXPECT_EQ(a.ranks, b.ranks);
    EXPECT_EQ(a.stats.makespan, b.stats.makespan);
  }
}

} // namespace
} // namespace pipec::test
