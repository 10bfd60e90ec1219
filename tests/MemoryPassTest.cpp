//===- MemoryPassTest.cpp - The memory pass on its own --------------------===//
//
// The memory pass (compiler/Memory.cpp, docs/contracts.md#semantics' memory model) gives every rank
// its peak activation, its static bytes (weights, gradients, optimizer state) and its peak memory
// (static plus the peak of activations and receive buffers together), from stream order
// alone. Here it runs alone on lowered streams:
//  - goldens: the per-rank figures for small configurations (regenerate with
//    `bazel run //tests:memory_pass_test -- --update`, never by hand);
//  - a sweep against the papers' closed forms: 1F1B's min(p-r, m)·A, GPipe's m·A, ZB-H1's
//    (p-i+1)·M_B + (i-1)·M_W and ZB-H2's (2p-2i+1)·M_B + (2i-2)·M_W on worker i = r+1;
//    static bytes from the parameters; receive buffers between nothing (no output bytes) and
//    every received byte; independent of timing; the same when run twice;
//  - negative: a plan over --memory-limit is a finding naming the rank (pipec compile).
//
//===----------------------------------------------------------------------===//
#include "tests/Command.h"
#include "tests/PassTestUtil.h"

#include <algorithm>

namespace pipec::test {
namespace {

const llvm::StringRef kUpToMemory[] = {"seq-split", "partition", "schedule", "lower-comms",
                                       "lower-collectives"};
const llvm::StringRef kMemory[] = {"memory"};

std::string memoryText(const Plan &plan) {
  std::string s;
  for (const RankStats &r : plan.stats.ranks)
    s += fmt::format("rank {}: peak_activation_bytes={} static_bytes={} peak_memory_bytes={}\n",
                     r.rank, r.peakActivationBytes, r.staticBytes, r.peakMemoryBytes);
  return s;
}

struct GoldenCase {
  const char *name;
  CompileOptions options;
};

class MemoryGolden : public ::testing::TestWithParam<GoldenCase> {};

TEST_P(MemoryGolden, MatchesTheCheckedInFigures) {
  const GoldenCase &c = GetParam();
  // 1 MiB of activations per layer, half of it kept for W, 64 KiB outputs, 4 MiB of weights.
  PassRun run(uniformModel(8, 1, 1, 1, 1 << 20, 1 << 19), c.options);
  run.runOrFail(kUpToMemory);
  ASSERT_FALSE(run.plan.stats.memory);
  run.runOrFail(kMemory);
  ASSERT_TRUE(run.plan.stats.memory);
  expectMatchesGolden(c.name, memoryText(run.plan), "memory_pass_test");
}

INSTANTIATE_TEST_SUITE_P(
    Configs, MemoryGolden,
    ::testing::Values(GoldenCase{"memory_1f1b_p4_m8", options("1f1b", 4, 8)},
                      GoldenCase{"memory_gpipe_p2_m3_k2", options("gpipe", 2, 3, 1, 2)},
                      GoldenCase{"memory_zb_h1_p4_m8", options("zb-h1", 4, 8)},
                      GoldenCase{"memory_zb_v_p2_m4_v2_tp2_dp2",
                                 options("zb-v", 2, 4, /*vpp=*/2, 1, /*tp=*/2, /*dp=*/2)}),
    [](const auto &info) { return std::string(info.param.name); });

TEST(MemoryPassSweep, PeaksMeetThePapersClosedForms) {
  for (int p = 1; p <= 8; ++p) {
    // One layer per stage: A = M_B = 1 MiB, M_W = 256 KiB; no outputs, so no receive buffers.
    const int64_t a = 1 << 20, mw = 1 << 18;
    ModelSpec model = uniformModel(p, 1, 1, 1, a, mw, /*p2p=*/0, /*out=*/0);
    for (int m = 1; m <= 3 * p + 2; ++m) {
      SCOPED_TRACE(fmt::format("p={} m={}", p, m));
      auto peaks = [&](const char *schedule, int k = 1) {
        PassRun run(model, options(schedule, p, m, 1, k));
        run.runOrFail(kUpToMemory);
        run.runOrFail(kMemory);
        std::vector<int64_t> out;
        for (const RankStats &r : run.plan.stats.ranks) {
          out.push_back(r.peakActivationBytes);
          EXPECT_EQ(r.peakMemoryBytes, r.staticBytes + r.peakActivationBytes)
              << "no outputs: nothing to receive";
        }
        return out;
      };
      std::vector<int64_t> gpipe = peaks("gpipe"), gpipeK = peaks("gpipe", 2), oneF = peaks("1f1b"),
                           h1 = peaks("zb-h1"), h2 = peaks("zb-h2");
      for (int r = 0; r < p; ++r) {
        const int i = r + 1; // the paper's worker index
        EXPECT_EQ(gpipe[size_t(r)], m * a) << "rank " << r;
        EXPECT_EQ(gpipeK[size_t(r)], m * a) << "rank " << r << ", two half slices";
        EXPECT_EQ(oneF[size_t(r)], std::min(p - r, m) * a) << "rank " << r;
        if (m >= p) {
          EXPECT_EQ(h1[size_t(r)], (p - i + 1) * a + (i - 1) * mw) << "rank " << r;
        }
        if (m >= 2 * p - 1) {
          EXPECT_EQ(h2[size_t(r)], (2 * p - 2 * i + 1) * a + (2 * i - 2) * mw) << "rank " << r;
        }
      }
    }
  }
}

TEST(MemoryPassSweep, StaticBytesReceiveBuffersTimingAndRepeats) {
  for (const CompileOptions &o :
       {options("1f1b", 4, 8), options("zb-v", 3, 6, 2), options("interleaved-1f1b", 2, 4, 2),
        options("seq1f1b", 3, 4, 1, 3), options("dualpipe-v", 2, 4, 2, 1, /*tp=*/2, /*dp=*/2),
        options("zb-h1", 4, 4, 1, 1, 2, 1)}) {
    SCOPED_TRACE(o.schedule);
    const int stages = o.parallel.pp * o.parallel.vpp, layersPerStage = 2;
    const int64_t params = 4 << 20;
    auto run = [&](double p2p) {
      auto r = std::make_unique<PassRun>(
          uniformModel(stages * layersPerStage, 1, 1, 1, 1 << 20, 1 << 19, p2p, 1 << 16, params),
          o);
      r->runOrFail(kUpToMemory);
      r->runOrFail(kMemory);
      return r;
    };
    auto a = run(0), b = run(0.7);
    const Plan &plan = a->plan;
    for (const RankStats &rs : plan.stats.ranks) {
      // Static: the parameters of the rank's stages (sharded by tp) times 4 (weights, grads
      // and Adam's two moments in the parameter precision).
      int onRank = 0;
      for (const StageInfo &st : plan.stages)
        onRank += st.rank == rs.rank;
      EXPECT_EQ(rs.staticBytes, int64_t(onRank) * layersPerStage * params / o.parallel.tp * 4)
          << "rank " << rs.rank;
      // Receive buffers add something, but never more than everything the rank receives.
      int64_t received = 0;
      for (const Instruction &i : plan.ranks[size_t(rs.rank)])
        received += i.op == OpKind::Recv ? i.bytes : 0;
      int64_t buffers = rs.peakMemoryBytes - rs.staticBytes - rs.peakActivationBytes;
      EXPECT_GE(buffers, 0) << "rank " << rs.rank;
      EXPECT_LE(buffers, received) << "rank " << rs.rank;
      // Activations depend on the compute order only, not on when things run.
      EXPECT_EQ(rs.peakActivationBytes, b->plan.stats.ranks[size_t(rs.rank)].peakActivationBytes);
    }
    // Running it again changes nothing.
    std::vector<RankStats> before = plan.stats.ranks;
    a->runOrFail(kMemory);
    for (size_t r = 0; r < before.size(); ++r) {
      EXPECT_EQ(a->plan.stats.ranks[r].peakActivationBytes, before[r].peakActivationBytes);
      EXPECT_EQ(a->plan.stats.ranks[r].peakMemoryBytes, before[r].peakMemoryBytes);
    }
  }
}

TEST(MemoryPassTest, APlanOverTheMemoryLimitIsAFindingNamingTheRank) {
  // GPipe keeps all 8 microbatches of uniform-8's 2 MiB stages on every rank: 16 MiB, against
  // a limit of 10 MiB.
  auto r = pipec::testing::runCommand("tools/pipec compile --model examples/uniform-8.json "
                                      "--schedule gpipe --pp 4 --microbatches 8 "
                                      "--memory-limit 10MiB");
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_NE(r.err.find("rank 0 holds 16.00 MiB of activations at its peak, over --memory-limit "
                       "10.00 MiB"),
            std::string::npos)
      << r.err;
  // The same under 1F1B (min(p, m) = 4 microbatches: 8 MiB) fits.
  auto ok = pipec::testing::runCommand("tools/pipec compile --model examples/uniform-8.json "
                                       "--schedule 1f1b --pp 4 --microbatches 8 "
                                       "--memory-limit 10MiB --quiet");
  EXPECT_EQ(ok.code, 0) << ok.err;
}

} // namespace
} // namespace pipec::test

int main(int argc, char **argv) { return pipec::test::goldenMain(argc, argv); }
