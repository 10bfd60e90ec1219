//===- LowerCommsTest.cpp - The lower-comms pass on its own ---------------===//
//
// lower-comms turns every rank's compute order into a stream with one send (after the
// producer) and one recv (before the consumer) per cross-rank input, consecutive comm ops
// grouped, deadlock-free and FIFO-consistent (compiler/LowerComms.cpp). Here it runs alone,
// on what the schedule pass emitted:
//  - goldens: its output for small configurations (regenerate with
//    `bazel run //tests:lower_comms_test -- --update`, never by hand);
//  - a sweep over every schedule: the compute order is kept as it was; the sends are exactly
//    the cross-rank edges (2·m·K per stage boundary between two ranks: (S-1) of them under loop
//    placement, 2P-2 under the V, whose bottom is one rank); every peer is the consumer's rank;
//    runs of comm ops are one group each and lone ones ungrouped; the verifier passes
//    (deadlock freedom, FIFO) and the output is deterministic;
//  - negative: streams that already carry comms, a compute order that cannot run.
//
//===----------------------------------------------------------------------===//
#include "tests/PassTestUtil.h"

#include "compiler/Verifier.h"
#include "ir/PlanText.h"

#include <algorithm>
#include <set>
#include <tuple>

namespace pipec::test {
namespace {

const llvm::StringRef kUpToSchedule[] = {"seq-split", "partition", "schedule"};
const llvm::StringRef kLowerComms[] = {"lower-comms"};

struct GoldenCase {
  const char *name;
  CompileOptions options;
};

class LowerCommsGolden : public ::testing::TestWithParam<GoldenCase> {};

TEST_P(LowerCommsGolden, MatchesTheCheckedInStreams) {
  const GoldenCase &c = GetParam();
  // Uneven layers and a transfer time, so that the global order is not the trivial one.
  ModelSpec model = uniformModel(8, 1, 1, 1, 1 << 20, 1 << 19, /*p2p=*/0.5);
  model.layers[0].forward = 2;
  PassRun run(model, c.options);
  run.runOrFail(kUpToSchedule);
  run.runOrFail(kLowerComms);
  expectMatchesGolden(c.name, formatStreams(run.plan), "lower_comms_test");
}

INSTANTIATE_TEST_SUITE_P(
    Configs, LowerCommsGolden,
    ::testing::Values(GoldenCase{"lower_comms_1f1b_p4_m4", options("1f1b", 4, 4)},
                      // pp 2: the previous and the next rank are the same peer.
                      GoldenCase{"lower_comms_interleaved_p2_m4_v2",
                                 options("interleaved-1f1b", 2, 4, /*vpp=*/2)},
                      // V-shape: the bottom of the V stays on one rank.
                      GoldenCase{"lower_comms_zb_v_p2_m3_v2", options("zb-v", 2, 3, 2)},
                      GoldenCase{"lower_comms_seq1f1b_p3_m2_k2",
                                 options("seq1f1b", 3, 2, 1, /*seqSplits=*/2)}),
    [](const auto &info) { return std::string(info.param.name); });

/// Configurations each schedule accepts, small enough to sweep.
std::vector<CompileOptions> sweepConfigs(const SchedulePolicy &policy) {
  std::vector<CompileOptions> out;
  for (int p : {1, 2, 3, 4, 6})
    for (int m : {1, 2, 4, 5, 8, 12})
      for (int v : {1, 2, 3})
        for (int k : {1, 2, 3}) {
          CompileOptions o = options(policy.name(), p, m, v, k);
          o.memoryLimit = int64_t(2 * p) << 20; // zb-auto: 2p microbatches of a 1 MiB layer
          if (llvm::Error err = policy.check(o.parallel)) {
            llvm::consumeError(std::move(err));
            continue;
          }
          out.push_back(o);
        }
  return out;
}

bool isComm(const Instruction &i) { return i.isP2P(); }

class LowerCommsSweep : public ::testing::TestWithParam<const SchedulePolicy *> {};

TEST_P(LowerCommsSweep, AddsExactlyTheCrossRankEdgesAroundAnUnchangedComputeOrder) {
  const SchedulePolicy &policy = *GetParam();
  std::vector<CompileOptions> configs = sweepConfigs(policy);
  ASSERT_GE(configs.size(), 10u) << policy.name().str();
  for (const CompileOptions &o : configs) {
    const ParallelConfig &pc = o.parallel;
    SCOPED_TRACE(fmt::format("{} pp={} vpp={} m={} K={}", o.schedule, pc.pp, pc.vpp,
                             pc.microbatches, pc.seqSplits));
    const int stages = pc.pp * pc.vpp;
    PassRun run(uniformModel(stages, 1, 1, 1, 1 << 20, 1 << 19, /*p2p=*/0.25), o);
    run.runOrFail(kUpToSchedule);
    std::vector<std::vector<Instruction>> computeOrder = run.plan.ranks;
    run.runOrFail(kLowerComms); // (with the verifier after it: deadlock-free, FIFO-matched)
    const Plan &plan = run.plan;
    // 1. The compute order is untouched.
    for (int r = 0; r < plan.numRanks(); ++r) {
      std::vector<Instruction> compute;
      for (const Instruction &i : plan.ranks[size_t(r)])
        if (i.isCompute())
          compute.push_back(i);
      EXPECT_EQ(compute, computeOrder[size_t(r)]) << "rank " << r;
    }
    // 2. One send and one recv per cross-rank edge, and only those.
    int boundaries = plan.placement == Placement::VShape ? 2 * pc.pp - 2
                     : pc.pp > 1                         ? stages - 1
                                                         : 0;
    size_t expected = size_t(2 * boundaries) * size_t(pc.microbatches * pc.seqSplits);
    size_t sends = 0, recvs = 0;
    std::set<std::tuple<int, int, int, int>> moved; // (tensor, stage, mb, slice)
    for (int r = 0; r < plan.numRanks(); ++r)
      for (const Instruction &i : plan.ranks[size_t(r)]) {
        if (!isComm(i))
          continue;
        int consumer = i.tensor == TensorKind::Activation ? i.stage + 1 : i.stage - 1;
        int producerRank = plan.rankOf(i.stage), consumerRank = plan.rankOf(consumer);
        EXPECT_NE(producerRank, consumerRank) << "a comm op between stages on one rank";
        if (i.op == OpKind::Send) {
          ++sends;
          EXPECT_EQ(r, producerRank);
          EXPECT_EQ(i.peer, consumerRank);
          EXPECT_TRUE(moved.insert({int(i.tensor), i.stage, i.mb, i.slice}).second)
              << "a tensor sent twice";
        } else {
          ++recvs;
          EXPECT_EQ(r, consumerRank);
          EXPECT_EQ(i.peer, producerRank);
        }
      }
    EXPECT_EQ(sends, expected);
    EXPECT_EQ(recvs, expected);
    // 3. Each run of two or more comm ops is one group of its own; a lone comm op has none.
    for (int r = 0; r < plan.numRanks(); ++r) {
      const auto &s = plan.ranks[size_t(r)];
      std::set<int32_t> groups;
      for (size_t i = 0; i < s.size();) {
        if (!isComm(s[i])) {
          ++i;
          continue;
        }
        size_t e = i;
        while (e < s.size() && isComm(s[e]))
          ++e;
        if (e - i == 1) {
          EXPECT_EQ(s[i].group, kNoGroup) << "rank " << r << " step " << i;
        } else {
          EXPECT_NE(s[i].group, kNoGroup) << "rank " << r << " step " << i;
          EXPECT_TRUE(groups.insert(s[i].group).second) << "group reused on rank " << r;
          for (size_t j = i; j < e; ++j)
            EXPECT_EQ(s[j].group, s[i].group) << "rank " << r << " step " << j;
        }
        i = e;
      }
    }
    // 4. Deterministic.
    PassRun again(uniformModel(stages, 1, 1, 1, 1 << 20, 1 << 19, 0.25), o);
    again.runOrFail(kUpToSchedule);
    again.runOrFail(kLowerComms);
    EXPECT_EQ(again.plan.ranks, plan.ranks);
  }
}

TEST_P(LowerCommsSweep, SplitsEveryBackwardExactlyWhereThePolicyDeclaresIt) {
  // The planner bounds a schedule's memory by a split backward's where the policy declares
  // that it splits every backward (a fused one may hold less): the declaration against what
  // the schedule emits over the sweep.
  const SchedulePolicy &policy = *GetParam();
  int fused = 0;
  for (const CompileOptions &o : sweepConfigs(policy)) {
    PassRun run(uniformModel(o.parallel.pp * o.parallel.vpp, 1, 1, 1, 1 << 20, 1 << 19, 0.25), o);
    run.runOrFail(kUpToSchedule);
    for (const auto &stream : run.plan.ranks)
      for (const Instruction &i : stream)
        fused += i.op == OpKind::Backward;
  }
  if (policy.splitsEveryBackward())
    EXPECT_EQ(fused, 0) << policy.name().str();
  else
    EXPECT_GT(fused, 0) << policy.name().str();
}

INSTANTIATE_TEST_SUITE_P(EverySchedule, LowerCommsSweep, ::testing::ValuesIn(allPolicies()),
                         [](const auto &info) {
                           std::string n = info.param->name().str();
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

TEST(LowerCommsTest, RefusesStreamsThatAlreadyCarryComms) {
  PassRun run(uniformModel(4), options("1f1b", 2, 2));
  run.runOrFail(kUpToSchedule);
  run.runOrFail(kLowerComms);
  std::string msg = errorText(run.run(kLowerComms));
  EXPECT_EQ(msg, "lower-comms expects compute-only streams (found send)");
}

TEST(LowerCommsTest, RefusesAComputeOrderThatCannotRunNamingTheOpAndWhatItWaitsFor) {
  // The rank runs the backward of microbatch 1 before the forward it needs: nothing can make
  // its input, and no order of messages can fix that.
  PassRun run(uniformModel(2), options("1f1b", 1, 2));
  run.runOrFail(kUpToSchedule);
  run.ctx.verifyEach = false;
  llvm::Error err = parseStreams("rank 0: 0B1 0F0 0B0 0F1\n", run.plan);
  ASSERT_FALSE(bool(err)) << takeMessage(std::move(err));
  std::string msg = errorText(run.run(kLowerComms));
  EXPECT_NE(msg.find("the compute order cannot run: rank 0 step 0 (0B1) needs 0F1, which never "
                     "completes"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("<-- here (rank 0)"), std::string::npos) << msg;
}

} // namespace
} // namespace pipec::test

int main(int argc, char **argv) { return pipec::test::goldenMain(argc, argv); }
