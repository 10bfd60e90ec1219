//===- UntrustedPlanTest.cpp - A plan from disk cannot corrupt the runtime ===//
//
// Two guarantees, checked on mutated plans:
//  - the verifier accepts a plan only if the runtime computes it correctly: an accepted plan's
//    gradients equal the single-rank reference's;
//  - the runtime never trusts a plan: run WITHOUT the verifier, a mutated plan either trains
//    or ends in an error (a Finding or an InputError), never in a crash, an assertion or a
//    write out of bounds (the sanitizer builds run this suite too).
// The first case is the reproducer of issue 36: one extra copy of a rank's own tp all_reduce,
// which the verifier used to accept and which made the cpu backend sum a freed buffer.
//
//===----------------------------------------------------------------------===//
#include "tests/TestUtil.h"

#include "compiler/Verifier.h"
#include "runtime/Data.h"
#include "runtime/cpu/CpuRun.h"

#include <cstdlib>
#include <random>

namespace pipec::test {
namespace {

struct Case {
  const char *name;
  CompileOptions options;
};

/// The schedules of the 42 crashing runs, at tp 2.
std::vector<Case> tpCases() {
  return {
      {"1f1b", options("1f1b", 2, 4, 1, 1, /*tp=*/2)},
      {"interleaved", options("interleaved-1f1b", 2, 4, 2, 1, /*tp=*/2)},
      {"zb-v", options("zb-v", 2, 4, 2, 1, /*tp=*/2)},
      {"seq1f1b", options("seq1f1b", 2, 4, 1, 2, /*tp=*/2)},
      {"zb-h1", options("zb-h1", 2, 4, 1, 1, /*tp=*/2)},
  };
}

/// Run without the verifier; success or an error, whatever the plan.
llvm::Expected<CpuRunResult> runUnverified(const Plan &plan, bool checkReference) {
  auto data = syntheticData(32, /*seed=*/3);
  CpuRunOptions o;
  o.steps = 1;
  o.checkReference = checkReference;
  o.timeoutSeconds = 2; // a mutation may deadlock; the watchdog reports it
  return runOnCpu(plan, *data, o);
}

std::vector<std::pair<int, size_t>> tpAllReduces(const Plan &plan) {
  std::vector<std::pair<int, size_t>> out;
  for (int r = 0; r < plan.numRanks(); ++r)
    for (size_t n = 0; n < plan.ranks[size_t(r)].size(); ++n) {
      const Instruction &i = plan.ranks[size_t(r)][n];
      if (i.op == OpKind::AllReduce && i.collective == CollectiveGroup::Tp)
        out.push_back({r, n});
    }
  return out;
}

TEST(UntrustedPlanTest, AnExtraCopyOfATpAllReduceIsRefusedByTheVerifierAndByTheRuntime) {
  for (const Case &c : tpCases()) {
    Plan good = compileOrFail(tinyGpt(), c.options);
    auto ars = tpAllReduces(good);
    ASSERT_FALSE(ars.empty()) << c.name;
    std::mt19937 rng(17);
    for (int trial = 0; trial < 6; ++trial) {
      Plan bad = good;
      auto [r, n] = ars[rng() % ars.size()];
      auto &stream = bad.ranks[size_t(r)];
      size_t at = rng() % (stream.size() + 1);
      Instruction copy = stream[n];
      stream.insert(stream.begin() + long(at), copy);
      std::string where =
          fmt::format("{} trial {}: copy of rank {} step {} at {}", c.name, trial, r, n, at);
      llvm::Error err = verifyPlan(bad);
      ASSERT_TRUE(bool(err)) << where;
      EXPECT_TRUE(err.isA<Finding>()) << where;
      std::string msg = takeMessage(std::move(err));
      EXPECT_NE(msg.find("ALLREDUCE_TP"), std::string::npos) << where << "\n" << msg;
      auto run = runUnverified(bad, /*checkReference=*/false);
      ASSERT_FALSE(bool(run)) << where << ": the runtime ran a plan with an extra tp all-reduce";
      llvm::consumeError(run.takeError());
    }
  }
}

TEST(UntrustedPlanTest, ATpAllReduceCarriesWhatTheRuntimeSums) {
  // tiny: 4 blocks of hidden 16, seq 8, microbatch 2, fp32; pp 2 puts the embedding and two
  // blocks on stage 0, two blocks and the head on stage 1.
  Plan plan = compileOrFail(tinyGpt(), options("1f1b", 2, 2, 1, 1, /*tp=*/2));
  const int64_t hidden = 2 * 8 * 16 * 4;
  const int64_t headStats = 2 * 8 * (2 * 2 + 1) * 4; // (2 tp + 1) fp32 values per token
  ASSERT_EQ(plan.stages[0].layerEnd, 3);
  ASSERT_EQ(plan.stages[0].tpAllReduces, 5);
  ASSERT_EQ(plan.stages[1].tpAllReduces, 5);
  for (const auto &stream : plan.ranks)
    for (const Instruction &i : stream) {
      if (i.op != OpKind::AllReduce || i.collective != CollectiveGroup::Tp)
        continue;
      bool forward = i.phase == OpKind::Forward;
      int64_t want = hidden;
      if (i.stage == 0 && !forward && i.part == 4)
        want = 0; // the embedding's backward reduces nothing
      if (i.stage == 1 && forward && i.part == 4)
        want = headStats; // the vocab-parallel cross entropy's statistics
      EXPECT_EQ(i.bytes, want) << "stage " << i.stage << " part " << i.part;
    }
  // A wrong count is a finding.
  Plan bad = plan;
  for (Instruction &i : bad.ranks[1])
    if (i.op == OpKind::AllReduce && i.collective == CollectiveGroup::Tp) {
      i.bytes = 0;
      break;
    }
  llvm::Error err = verifyPlan(bad);
  ASSERT_TRUE(bool(err));
  EXPECT_NE(takeMessage(std::move(err)).find("carries 0 bytes"), std::string::npos);
}

TEST(UntrustedPlanTest, SeqSlicesPastTheModelsSequenceAreAFinding) {
  Plan plan = compileOrFail(tinyGpt(), options("seq1f1b", 2, 2, 1, 2));
  plan.seqSlices.back().second += 8;
  llvm::Error err = verifyPlan(plan);
  ASSERT_TRUE(bool(err));
  EXPECT_NE(takeMessage(std::move(err)).find("seq_length is 8"), std::string::npos);
}

/// One random edit of a rank's stream or of an instruction's fields.
void mutate(Plan &plan, std::mt19937 &rng) {
  int r = int(rng() % unsigned(plan.numRanks()));
  auto &stream = plan.ranks[size_t(r)];
  size_t n = rng() % stream.size();
  Instruction &i = stream[n];
  auto any = [&](int range) { return int(rng() % unsigned(range + 3)) - 1; }; // -1 .. range+1
  switch (rng() % 9) {
  case 0:
    stream.erase(stream.begin() + long(n));
    return;
  case 1:
    stream.insert(stream.begin() + long(rng() % stream.size()), i);
    return;
  case 2:
    if (n + 1 < stream.size())
      std::swap(stream[n], stream[n + 1]);
    return;
  case 3:
    i.stage = any(plan.numStages());
    return;
  case 4:
    i.mb = any(plan.parallel.microbatches);
    return;
  case 5:
    i.slice = any(plan.parallel.seqSplits);
    return;
  case 6:
    i.part = any(std::max(i.parts, 1));
    return;
  case 7:
    i.peer = any(plan.parallel.pp);
    return;
  default: {
    // Move an instruction elsewhere in its stream.
    Instruction moved = i;
    stream.erase(stream.begin() + long(n));
    stream.insert(stream.begin() + long(rng() % (stream.size() + 1)), moved);
    return;
  }
  }
}

TEST(UntrustedPlanTest, MutatedPlansTrainCorrectlyWhenAcceptedAndNeverCrashTheRuntime) {
  std::vector<Case> cases = tpCases();
  cases.push_back({"gpipe dp2", options("gpipe", 2, 2, 1, 1, 1, /*dp=*/2)});
  cases.push_back({"gpipe k2", options("gpipe", 2, 3, 1, 2)});
  // PIPEC_MUTATIONS=N runs N per case (a longer campaign than CI's 12).
  const char *env = std::getenv("PIPEC_MUTATIONS");
  const int trials = env ? std::max(1, std::atoi(env)) : 12;
  int accepted = 0, refused = 0, runtimeErrors = 0;
  for (const Case &c : cases) {
    Plan good = compileOrFail(tinyGpt(), c.options);
    std::mt19937 rng(5);
    for (int trial = 0; trial < trials; ++trial) {
      Plan bad = good;
      mutate(bad, rng);
      std::string where = fmt::format("{} trial {}", c.name, trial);
      llvm::Error err = verifyPlan(bad);
      bool ok = !err;
      llvm::consumeError(std::move(err));
      auto run = runUnverified(bad, /*checkReference=*/ok);
      if (ok) {
        // Accepted: it must be right (a harmless swap or move, say).
        ++accepted;
        ASSERT_TRUE(bool(run)) << where
                               << ": accepted but failed: " << takeMessage(run.takeError());
        EXPECT_LE(run->grads.maxAbsDiff, 1e-5 * run->grads.scale) << where;
        continue;
      }
      ++refused;
      if (!run) {
        ++runtimeErrors;
        llvm::consumeError(run.takeError());
      }
    }
  }
  // The sweep must exercise the refusals (and most refused plans end in a runtime error).
  EXPECT_GT(refused, trials * 3);
  EXPECT_GT(runtimeErrors, refused / 2);
  std::printf("mutations: %d accepted, %d refused by the verifier (%d of them a runtime "
              "error)\n",
              accepted, refused, runtimeErrors);
}

} // namespace
} // namespace pipec::test
