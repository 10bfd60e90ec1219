//===- PlannerTest.cpp - pipec plan against compiling every candidate ------===//
//
// Three claims of compiler/Planner.h, each against something it does not share code with:
//   - every candidate the planner evaluates states the step time and peak memory (receive
//     buffers included) `pipec compile` states for it, within the limit or over it;
//   - the best layout `pipec plan` reports is the best found by running `pipec compile` on every
//     candidate and reading the plans it writes (the brute force here enumerates the space from
//     docs/commands.md's flags alone), and the plan it writes passes `pipec validate`;
//   - pruning and threads change nothing: the same answer with pruning made impossible, the
//     same CSV on one thread and on four.
//
//===----------------------------------------------------------------------===//
#include "tests/Command.h"
#include "tests/TestUtil.h"

#include "compiler/Evaluate.h"
#include "compiler/Planner.h"
#include "compiler/Verifier.h"
#include "ir/formats/SpecJson.h"
#include "schedules/Policy.h"

#include <nlohmann/json.hpp>

#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <tuple>

namespace pipec {
namespace {

using test::options;

ModelSpec transformer(const std::string &extra = "", int layers = 6) {
  auto m = parseModelSpec(fmt::format(R"({{"format": "pipemodel/1", "name": "t",
      "transformer": {{"num_layers": {}, "hidden_size": 64, "num_attention_heads": 4,
      "ffn_hidden_size": 256, "vocab_size": 128, "seq_length": 64, "microbatch_size": 2,
      "dtype": "bf16"{}}}}})",
                                      layers, extra),
                          "t.json");
  EXPECT_TRUE(bool(m)) << (m ? "" : takeMessage(m.takeError()));
  return m ? *m : ModelSpec{};
}

TEST(EvaluateTest, ScoresWithTheDefaultPipelinesOwnPasses) {
  // evaluateOrder runs the default pipeline between schedule and verify, in its order.
  std::vector<llvm::StringRef> expected = {"seq-split", "partition", "schedule"};
  for (llvm::StringRef p : scoringPipeline())
    expected.push_back(p);
  expected.push_back("verify");
  EXPECT_EQ(std::vector<llvm::StringRef>(defaultPipeline().begin(), defaultPipeline().end()),
            expected);
  for (llvm::StringRef p : {"lower-comms", "lower-collectives", "memory", "simulate"})
    EXPECT_TRUE(llvm::is_contained(scoringPipeline(), p)) << p.str();
}

//===----------------------------------------------------------------------===//
// The planner in-process
//===----------------------------------------------------------------------===//

PlannerOptions smallSearch() {
  PlannerOptions o;
  o.gpus = 8;
  o.globalBatch = 32;
  o.memoryLimit = 24 << 20;
  o.top = 3;
  o.maxVpp = 3;
  o.seqSplits = {1, 2};
  o.microbatchSizes = {1, 2, 4};
  return o;
}

ClusterSpec smallCluster() {
  ClusterSpec c = ClusterSpec::defaults();
  c.gpusPerNode = 4;
  return c;
}

TEST(PlannerTest, RankedPlansAreWhatCompilePlanMakesOfThem) {
  ModelSpec model = transformer();
  auto result = planLayouts(model, smallCluster(), smallSearch());
  ASSERT_TRUE(bool(result)) << takeMessage(result.takeError());
  ASSERT_EQ(result->ranked.size(), 3u);
  double previous = 0;
  for (size_t i : result->ranked) {
    const PlanCandidate &c = result->candidates[i];
    EXPECT_EQ(c.outcome, Outcome::Ranked);
    EXPECT_GE(c.stepTime, previous);
    previous = c.stepTime;
    CompileOptions o = options(c.schedule, c.parallel.pp, c.parallel.microbatches, c.parallel.vpp,
                               c.parallel.seqSplits, c.parallel.tp, c.parallel.dp);
    o.memoryLimit = c.zbAutoLimit;
    auto compiled = compilePlan(modelVariant(model, c.microbatchSize, c.recompute), smallCluster(),
                                o, /*verifyEach=*/true);
    ASSERT_TRUE(bool(compiled)) << takeMessage(compiled.takeError());
    const Plan &plan = *compiled;
    EXPECT_EQ(plan.stats.stepTime, c.stepTime);
    int64_t peak = 0;
    for (const RankStats &r : plan.stats.ranks)
      peak = std::max(peak, r.peakMemoryBytes);
    EXPECT_EQ(peak, c.peakMemoryBytes);
    EXPECT_LE(peak, int64_t(24) << 20);
    EXPECT_EQ(c.parallel.tp * c.parallel.pp * c.parallel.dp, 8);
    EXPECT_EQ(int64_t(c.parallel.dp) * c.parallel.microbatches * c.microbatchSize, 32);
  }
  EXPECT_EQ(result->best.stats.stepTime, result->candidates[result->ranked[0]].stepTime);
}

TEST(PlannerTest, EveryEvaluatedCandidateStatesWhatCompileStates) {
  // Over the limit or within it, an evaluated candidate's step time, bubble and worst rank's
  // peak (receive buffers included) are what compilePlan states: the planner runs compile's
  // passes, so "needs X" in an out-of-memory row is compile's X, not a lower bound.
  ModelSpec model = transformer(R"(, "tie_embeddings": true)");
  PlannerOptions o = smallSearch();
  o.top = 1000; // nothing pruned
  o.memoryLimit = 3 << 20;
  o.minHeadroom = 0;
  auto result = planLayouts(model, smallCluster(), o);
  ASSERT_TRUE(bool(result)) << takeMessage(result.takeError());
  int within = 0, over = 0, bounded = 0;
  for (const PlanCandidate &c : result->candidates) {
    if (!c.simulated) {
      // Dropped before scheduling: a lower bound, flagged as such.
      if (c.outcome == Outcome::Memory) {
        ++bounded;
        EXPECT_FALSE(c.peakExact);
      }
      continue;
    }
    SCOPED_TRACE(fmt::format("{} tp={} pp={} vpp={} dp={} b={} m={} k={}", c.schedule,
                             c.parallel.tp, c.parallel.pp, c.parallel.vpp, c.parallel.dp,
                             c.microbatchSize, c.parallel.microbatches, c.parallel.seqSplits));
    EXPECT_TRUE(c.peakExact);
    CompileOptions co = options(c.schedule, c.parallel.pp, c.parallel.microbatches, c.parallel.vpp,
                                c.parallel.seqSplits, c.parallel.tp, c.parallel.dp);
    co.memoryLimit = c.zbAutoLimit;
    auto plan = compilePlan(modelVariant(model, c.microbatchSize, c.recompute), smallCluster(), co);
    ASSERT_TRUE(bool(plan)) << takeMessage(plan.takeError());
    EXPECT_EQ(plan->stats.stepTime, c.stepTime);
    int64_t peak = 0;
    int worst = 0;
    double busy = 0;
    for (const RankStats &r : plan->stats.ranks) {
      busy += r.busy;
      if (r.peakMemoryBytes > peak) {
        peak = r.peakMemoryBytes;
        worst = r.rank;
      }
    }
    EXPECT_EQ(peak, c.peakMemoryBytes);
    EXPECT_EQ(worst, c.worstRank);
    EXPECT_EQ(1.0 - busy / double(plan->stats.ranks.size()) / plan->stats.stepTime, c.bubble);
    if (c.outcome == Outcome::Memory) {
      ++over;
      EXPECT_GT(peak, o.memoryLimit);
      EXPECT_NE(c.why.find(fmt::format("rank {} peaks at", worst)), std::string::npos) << c.why;
    } else {
      ++within;
      EXPECT_LE(peak, o.memoryLimit);
    }
  }
  EXPECT_GT(within, 10);
  EXPECT_GT(over, 10);
  EXPECT_GT(bounded, 0);
  // The CSV says which peaks are exact.
  std::string csv = plannerCsv(model, smallCluster(), o, *result);
  EXPECT_NE(csv.find(",memory,,"), std::string::npos); // a bounded drop: no step time
  EXPECT_NE(csv.find(",no,"), std::string::npos);
  EXPECT_NE(csv.find(",yes,"), std::string::npos);
}

TEST(PlannerTest, PruningAndThreadsChangeNothing) {
  ModelSpec model = transformer();
  PlannerOptions one = smallSearch();
  one.threads = 1;
  PlannerOptions four = one;
  four.threads = 4;
  auto a = planLayouts(model, smallCluster(), one);
  auto b = planLayouts(model, smallCluster(), four);
  ASSERT_TRUE(bool(a) && bool(b));
  EXPECT_EQ(plannerCsv(model, smallCluster(), one, *a),
            plannerCsv(model, smallCluster(), four, *b));
  // With a top K larger than the space, no bound can prune: the best must not move.
  PlannerOptions all = one;
  all.top = 1000000;
  auto c = planLayouts(model, smallCluster(), all);
  ASSERT_TRUE(bool(c));
  size_t pruned = 0;
  for (const PlanCandidate &x : a->candidates)
    pruned += x.outcome == Outcome::Pruned;
  EXPECT_GT(pruned, 0u) << "the bounds should prune something in this space";
  for (const PlanCandidate &x : c->candidates)
    EXPECT_NE(x.outcome, Outcome::Pruned);
  for (size_t i = 0; i < 3; ++i) {
    const PlanCandidate &x = a->candidates[a->ranked[i]], &y = c->candidates[c->ranked[i]];
    EXPECT_EQ(x.schedule, y.schedule);
    EXPECT_EQ(x.stepTime, y.stepTime);
    EXPECT_EQ(x.parallel.pp, y.parallel.pp);
    EXPECT_EQ(x.parallel.tp, y.parallel.tp);
    EXPECT_EQ(x.microbatchSize, y.microbatchSize);
  }
}

TEST(PlannerTest, NoLayoutInMemoryIsAFindingNamingTheSmallestShortfall) {
  PlannerOptions o = smallSearch();
  o.memoryLimit = 64 << 10;
  auto r = planLayouts(transformer(), smallCluster(), o);
  ASSERT_FALSE(bool(r));
  llvm::Error err = r.takeError();
  EXPECT_TRUE(err.isA<Finding>());
  std::string msg = takeMessage(std::move(err));
  EXPECT_NE(msg.find("no layout of 8 GPUs fits in 64.0 KiB per GPU with 3.2 KiB kept free "
                     "(--min-headroom): the closest"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("short); try --memory-limit"), std::string::npos) << msg;
}

TEST(PlannerTest, NoPipelineIsOneCandidatePerLayout) {
  // pp 1: one candidate per (recompute, tp, microbatch size), 1f1b at vpp 1 and one sequence
  // slice, shown as no-pipeline, whatever --schedules lists; pp > 1 keeps every schedule.
  PlannerOptions o = smallSearch();
  o.schedules = {"interleaved-1f1b", "seq1f1b-interleaved", "zb-h1"};
  o.top = 1000;
  auto r = planLayouts(transformer(), smallCluster(), o);
  ASSERT_TRUE(bool(r)) << takeMessage(r.takeError());
  std::map<std::tuple<int, int64_t>, int> perLayout;
  size_t deeper = 0;
  for (const PlanCandidate &c : r->candidates) {
    if (c.schedule.empty())
      continue;
    if (c.parallel.pp != 1) {
      deeper += c.schedule != "1f1b";
      EXPECT_NE(c.schedule, "1f1b") << "1f1b was not asked for at pp > 1";
      EXPECT_NE(scheduleLabel(c), kNoPipelineLabel);
      continue;
    }
    ++perLayout[{c.parallel.tp, c.microbatchSize}];
    EXPECT_EQ(c.schedule, "1f1b");
    EXPECT_EQ(c.parallel.vpp, 1);
    EXPECT_EQ(c.parallel.seqSplits, 1);
    EXPECT_EQ(scheduleLabel(c), kNoPipelineLabel);
  }
  EXPECT_GT(deeper, 0u);
  // tp 1, 2, 4 (a node of 4) with pp 1 leave dp 8, 4, 2: microbatch sizes 1, 2, 4 each.
  EXPECT_EQ(perLayout.size(), 9u);
  for (const auto &[layout, n] : perLayout)
    EXPECT_EQ(n, 1) << "tp " << std::get<0>(layout) << " microbatch size " << std::get<1>(layout);
  // The no-pipeline plan is what compile makes of 1f1b at pp 1.
  o.ppSizes = {1};
  o.top = 1;
  r = planLayouts(transformer(), smallCluster(), o);
  ASSERT_TRUE(bool(r)) << takeMessage(r.takeError());
  EXPECT_EQ(r->best.schedule, "1f1b");
  EXPECT_EQ(r->best.parallel.pp, 1);
  EXPECT_FALSE(bool(verifyPlan(r->best)));
}

TEST(PlannerTest, TheBubbleColumnIsTheIdleShareOfTheStep) {
  // bubble = 1 - mean(busy) / step time, from the compiled plan's own per-rank busy times and
  // step time: so step time x (1 - bubble) is the mean rank's compute time, for every
  // schedule, zero-bubble ones included (whose span-based bubble_ratio is smaller).
  PlannerOptions o = smallSearch();
  o.top = 40;
  ModelSpec model = transformer();
  auto r = planLayouts(model, smallCluster(), o);
  ASSERT_TRUE(bool(r)) << takeMessage(r.takeError());
  std::set<std::string> seen;
  for (size_t i : r->ranked) {
    const PlanCandidate &c = r->candidates[i];
    CompileOptions co = options(c.schedule, c.parallel.pp, c.parallel.microbatches, c.parallel.vpp,
                                c.parallel.seqSplits, c.parallel.tp, c.parallel.dp);
    co.memoryLimit = c.zbAutoLimit;
    auto plan = compilePlan(modelVariant(model, c.microbatchSize, c.recompute), smallCluster(), co);
    ASSERT_TRUE(bool(plan)) << takeMessage(plan.takeError());
    double busy = 0;
    for (const RankStats &rs : plan->stats.ranks)
      busy += rs.busy;
    busy /= double(plan->stats.ranks.size());
    SCOPED_TRACE(c.schedule);
    EXPECT_NEAR(plan->stats.stepTime * (1 - c.bubble), busy, 1e-12 * plan->stats.stepTime);
    EXPECT_GE(c.bubble, plan->stats.bubbleRatio - 1e-12); // the step is at least the max span
    seen.insert(c.schedule);
  }
  EXPECT_TRUE(seen.count("zb-h1") || seen.count("zb-h2") || seen.count("zb-auto"));
}

TEST(PlannerTest, MinHeadroomKeepsTheRankedPlansOffTheEdge) {
  PlannerOptions o = smallSearch();
  o.top = 20;
  const int64_t limit = o.memoryLimit;
  auto fitsWithin = [&](const PlannerResult &r, int64_t most) {
    for (size_t i : r.ranked)
      EXPECT_LE(r.candidates[i].peakMemoryBytes, most);
  };
  // Default: 5% of the limit kept free.
  auto byDefault = planLayouts(transformer(), smallCluster(), o);
  ASSERT_TRUE(bool(byDefault)) << takeMessage(byDefault.takeError());
  EXPECT_EQ(byDefault->minHeadroom, limit / 100 * kDefaultHeadroomPercent);
  fitsWithin(*byDefault, limit - limit / 20);
  // 0: the whole limit; a plan the default drops may now rank.
  o.minHeadroom = 0;
  auto none = planLayouts(transformer(), smallCluster(), o);
  ASSERT_TRUE(bool(none));
  fitsWithin(*none, limit);
  int64_t most = 0;
  for (size_t i : none->ranked)
    most = std::max(most, none->candidates[i].peakMemoryBytes);
  // Enough kept free to drop the fullest of those: every ranked plan below it.
  o.minHeadroom = limit - most + 1;
  auto less = planLayouts(transformer(), smallCluster(), o);
  ASSERT_TRUE(bool(less)) << takeMessage(less.takeError());
  fitsWithin(*less, most - 1);
  EXPECT_FALSE(less->ranked.empty());
  // All of it: bad input naming the flag.
  o.minHeadroom = limit;
  auto all = planLayouts(transformer(), smallCluster(), o);
  ASSERT_FALSE(bool(all));
  EXPECT_NE(takeMessage(all.takeError()).find("--min-headroom"), std::string::npos);
}

TEST(PlannerTest, BadInputNamesTheFlagAndTheNearestValidValue) {
  PlannerOptions o = smallSearch();
  // 32 GPUs of 4 per node and a model of 4 layers (2 blocks): tp <= 4 and pp <= 4 leave dp >= 2,
  // which does not divide 7; 6 sequences on dp 2 do.
  o.gpus = 32;
  o.globalBatch = 7;
  o.microbatchSizes = {};
  auto r = planLayouts(transformer("", 2), smallCluster(), o);
  ASSERT_FALSE(bool(r));
  std::string msg = takeMessage(r.takeError());
  EXPECT_EQ(msg.rfind("--global-batch 7: no layout of 32 GPUs divides it", 0), 0u) << msg;
  EXPECT_NE(msg.find("try --global-batch 6"), std::string::npos) << msg;
  // 64 GPUs leave dp >= 4: one sequence per step is too few, four are enough.
  o.gpus = 64;
  o.globalBatch = 1;
  r = planLayouts(transformer("", 2), smallCluster(), o);
  ASSERT_FALSE(bool(r));
  msg = takeMessage(r.takeError());
  EXPECT_NE(msg.find("--global-batch 1: no layout of 64 GPUs divides it"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("try --global-batch 4"), std::string::npos) << msg;
  // 7 GPUs with --pp 2: no layout tp x 2 x dp is 7 GPUs, whatever the batch: --pp is at
  // fault (pp 1 is the one that divides 7 within the model's 4 layers), or the GPU count:
  // 6 GPUs (pp 2 x dp 3, two sequences per replica) are the nearest that fit.
  o.gpus = 7;
  o.globalBatch = 6;
  o.ppSizes = {2};
  r = planLayouts(transformer("", 2), smallCluster(), o);
  ASSERT_FALSE(bool(r));
  msg = takeMessage(r.takeError());
  EXPECT_EQ(msg.rfind("--pp 2: pp must divide the 7 GPUs", 0), 0u) << msg;
  EXPECT_NE(msg.find("try --pp 1, or --gpus 6"), std::string::npos) << msg;
  // 8 GPUs and a batch of 8, tp 3 asked: 3 divides neither the GPUs nor the heads.
  o = smallSearch();
  o.tpSizes = {3};
  r = planLayouts(transformer(), smallCluster(), o);
  ASSERT_FALSE(bool(r));
  msg = takeMessage(r.takeError());
  EXPECT_EQ(msg.rfind("--tp 3: tp must divide --gpus 8", 0), 0u) << msg;
  EXPECT_NE(msg.find("try --tp 1,2,4"), std::string::npos) << msg;
  // A prime GPU count: a layout needs a batch of its own size (tp 1, pp 1), so the GPU count
  // is blamed, with the nearest one that divides this batch.
  o = smallSearch();
  o.gpus = 1048573;
  r = planLayouts(transformer("", 2), smallCluster(), o);
  ASSERT_FALSE(bool(r));
  msg = takeMessage(r.takeError());
  EXPECT_EQ(msg.rfind("--gpus 1048573: no layout", 0), 0u) << msg;
  o = smallSearch();
  o.schedules = {"1f1b", "zb-h3"};
  r = planLayouts(transformer(), smallCluster(), o);
  ASSERT_FALSE(bool(r));
  msg = takeMessage(r.takeError());
  EXPECT_NE(msg.find("--schedules: unknown schedule 'zb-h3'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("try zb-h1"), std::string::npos) << msg;
}

//===----------------------------------------------------------------------===//
// Against `pipec compile` on every candidate
//===----------------------------------------------------------------------===//

using Result = testing::CommandResult;

Result run(const std::string &cmd) { return testing::runCommand(cmd); }

struct Found {
  bool any = false;
  // The planner's stated tie order: recompute, tp, pp, microbatch size, schedule (as listed),
  // vpp, seq splits.
  std::tuple<double, int, int, int64_t, int, int, int> key;
  std::string schedule;
};

TEST(PlannerCliTest, TheBestIsTheBestOfCompilingEveryCandidate) {
  const std::string dir = testing::tmpDir();
  const std::string model = dir + "/model.json";
  // The space: 4 GPUs, 8 sequences per step, tp in {1, 2, 4}, pp in {1, 2, 4}, microbatch
  // size 1 or 2, vpp up to 2, seq splits 1 or 2, every schedule but zb-auto (whose budget is
  // the planner's own rule, tested in-process above), 64 MiB per GPU less the default 5%
  // headroom. pp 1 is one layout, no pipeline: 1f1b at vpp 1, one slice (docs/planner.md).
  const int gpus = 4, batch = 8;
  const char *limit = "64MiB";
  const int64_t limitBytes = (int64_t(64) << 20) - (int64_t(64) << 20) / 100 * 5;
  std::vector<std::string> schedules = {
      "gpipe", "1f1b", "interleaved-1f1b", "seq1f1b", "seq1f1b-interleaved", "zb-h1",
      "zb-h2", "zb-v", "dualpipe-v"};
  std::string list;
  for (const std::string &s : schedules)
    list += (list.empty() ? "" : ",") + s;
  Found best;
  int compiled = 0;
  for (int64_t b : {1, 2}) {
    std::ofstream(model) << fmt::format(
        R"({{"format": "pipemodel/1", "name": "bf", "transformer": {{"num_layers": 6,
        "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 256,
        "vocab_size": 128, "seq_length": 128, "microbatch_size": {}, "dtype": "bf16"}}}})",
        b);
    for (int tp : {1, 2, 4})
      for (int pp : {1, 2, 4}) {
        if (gpus % (tp * pp))
          continue;
        int dp = gpus / (tp * pp);
        if (batch % (dp * b))
          continue;
        int m = int(batch / (dp * b));
        for (size_t si = 0; si < schedules.size(); ++si)
          for (int vpp : {1, 2})
            for (int k : {1, 2}) {
              if (pp == 1 && (schedules[si] != "1f1b" || vpp != 1 || k != 1))
                continue;
              std::string out = dir + "/c.json";
              std::remove(out.c_str());
              Result r = run(fmt::format("tools/pipec compile --model {} --schedule {} --pp {} "
                                         "--vpp {} --microbatches {} --seq-splits {} --tp {} "
                                         "--dp {} -o {} --quiet",
                                         model, schedules[si], pp, vpp, m, k, tp, dp, out));
              if (r.code != 0) {
                EXPECT_EQ(r.code, 2) << r.err; // a constraint, never a crash or a finding
                continue;
              }
              ++compiled;
              auto j = nlohmann::json::parse(testing::slurp(out));
              int64_t peak = 0;
              for (const auto &rank : j["stats"]["ranks"])
                peak = std::max(peak, rank["peak_memory_bytes"].get<int64_t>());
              if (peak > limitBytes)
                continue;
              auto key = std::make_tuple(j["stats"]["step_time"].get<double>(), tp, pp, b, int(si),
                                         vpp, k);
              if (!best.any || key < best.key) {
                best.any = true;
                best.key = key;
                best.schedule = schedules[si];
              }
            }
      }
  }
  ASSERT_TRUE(best.any);
  EXPECT_GT(compiled, 80);
  std::string plan = dir + "/best.json", csv = dir + "/all.csv";
  Result r = run(fmt::format("tools/pipec plan --model {} --gpus {} --global-batch {} "
                             "--memory-limit {} --schedules {} --microbatch-sizes 1,2 "
                             "--max-vpp 2 --seq-splits 1,2 --top 3 -o {} --csv {}",
                             model, gpus, batch, limit, list, plan, csv));
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  auto j = nlohmann::json::parse(testing::slurp(plan));
  auto [time, tp, pp, b, si, vpp, k] = best.key;
  EXPECT_EQ(j["schedule"], best.schedule) << r.out;
  EXPECT_EQ(j["parallel"]["tp"], tp) << r.out;
  EXPECT_EQ(j["parallel"]["pp"], pp) << r.out;
  EXPECT_EQ(j["parallel"]["vpp"], vpp) << r.out;
  EXPECT_EQ(j["parallel"]["seq_splits"], k) << r.out;
  EXPECT_EQ(j["transformer"]["microbatch_size"], b) << r.out;
  EXPECT_EQ(j["stats"]["step_time"].get<double>(), time) << r.out;
  Result v = run("tools/pipec validate " + plan);
  EXPECT_EQ(v.code, 0) << v.out << v.err;
  // The table, the counts and the CSV.
  EXPECT_NE(r.out.find("searched "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("dropped: "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("  1  " + (pp == 1 ? std::string(kNoPipelineLabel) : best.schedule)),
            std::string::npos)
      << r.out;
  std::string table = testing::slurp(csv);
  EXPECT_EQ(table.rfind("recompute,tp,pp,vpp,dp,microbatch_size,microbatches,seq_splits,", 0), 0u);
  EXPECT_NE(table.find(",ranked,"), std::string::npos);
}

TEST(PlannerCliTest, PiperunRefusesARecomputingPlanWithOneLine) {
  // Recomputation is a plan option pipec models (memory and time) but piperun's kernels do not
  // execute: piperun refuses such a plan before it builds a stage, exit 2, one line naming the
  // field (the cpu backend here; cuda and nccl on the emulated device in PiperunEmuTest; on a
  // machine without a GPU those two say so first).
  const std::string dir = testing::tmpDir();
  for (const char *recompute : {"selective", "full"}) {
    const std::string plan = dir + "/recompute-" + recompute + ".json";
    Result c = run(fmt::format("tools/pipec compile --model examples/tiny-gpt.json --schedule "
                               "1f1b --pp 2 --microbatches 4 --recompute {} -o {} --quiet",
                               recompute, plan));
    ASSERT_EQ(c.code, 0) << c.out << c.err;
    for (const char *backend : {"cpu"}) {
      SCOPED_TRACE(fmt::format("--recompute {} --backend {}", recompute, backend));
      Result r = run(fmt::format("tools/piperun {} --backend {} --steps 1", plan, backend));
      EXPECT_EQ(r.code, 2) << r.out << r.err;
      EXPECT_NE(r.err.find(fmt::format("$.transformer.recompute: \"{}\"", recompute)),
                std::string::npos)
          << r.err;
      EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
      EXPECT_EQ(r.out.find("step 0"), std::string::npos) << r.out;
    }
  }
  // The same model without recomputation runs.
  const std::string plan = dir + "/recompute-none.json";
  ASSERT_EQ(run("tools/pipec compile --model examples/tiny-gpt.json --schedule 1f1b --pp 2 "
                "--microbatches 4 -o " +
                plan + " --quiet")
                .code,
            0);
  Result ok = run("tools/piperun " + plan + " --backend cpu --steps 1");
  EXPECT_EQ(ok.code, 0) << ok.out << ok.err;
}

TEST(PlannerCliTest, BadInputIsOneLineAndExitTwo) {
  auto expectUsage = [](const Result &r, const std::string &part) {
    EXPECT_EQ(r.code, 2) << r.out << r.err;
    EXPECT_NE(r.err.find(part), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  };
  const std::string m = "--model examples/gpt-7b-8k.json";
  expectUsage(run("tools/pipec plan " + m + " --gpus 8"), "missing --global-batch");
  expectUsage(run("tools/pipec plan " + m + " --gpus 8 --global-batch 64 --schedules 1f1b,zbv"),
              "--schedules: unknown schedule 'zbv'");
  expectUsage(run("tools/pipec plan " + m + " --gpus 8 --global-batch 64 --recompute some"),
              "--recompute: expected none, selective or full");
  expectUsage(run("tools/pipec plan " + m + " --gpus 8 --global-batch 64 --min-headroom 100%"),
              "--min-headroom expects a percentage from 0 to below 100");
  expectUsage(run("tools/pipec plan " + m + " --gpus 8 --global-batch 64 --min-headroom abc"),
              "--min-headroom expects 0, a percentage of the memory limit such as 5%, or a byte");
  expectUsage(run("tools/pipec plan " + m + " --gpus 8 --global-batch 64 --min-headroom 80GiB"),
              "--min-headroom 80.00 GiB leaves nothing of the 80.00 GiB memory limit");
  Result tooLittle = run("tools/pipec plan " + m +
                         " --gpus 8 --global-batch 64 "
                         "--memory-limit 1GiB -o " +
                         testing::tmpDir() + "/none.json");
  EXPECT_EQ(tooLittle.code, 1) << tooLittle.out << tooLittle.err;
  EXPECT_NE(tooLittle.err.find("no layout of 8 GPUs fits in 1.00 GiB per GPU"), std::string::npos)
      << tooLittle.err;
  std::ifstream none(testing::tmpDir() + "/none.json");
  EXPECT_FALSE(none.good()) << "no plan file on a finding";
}

TEST(PlannerCliTest, OutOfMemoryStatesWhatCompileStatesAndTheSuggestedLimitWorks) {
  // The closest layout's need is what `pipec compile` prints for it (not a lower bound), and
  // the suggested --memory-limit, rerun, gives a plan: with the default headroom and with
  // --min-headroom 0.
  const std::string dir = testing::tmpDir();
  for (const std::string headroom : {"", " --min-headroom 0", " --min-headroom 1GiB"}) {
    SCOPED_TRACE(headroom);
    const std::string base = "tools/pipec plan --model examples/gpt-7b-8k.json --gpus 8 "
                             "--global-batch 64 --cluster examples/a100-80g.json" +
                             headroom;
    Result oom = run(base + " --memory-limit 4GiB");
    ASSERT_EQ(oom.code, 1) << oom.out << oom.err;
    std::smatch m;
    ASSERT_TRUE(std::regex_search(
        oom.err, m,
        std::regex("the closest, (\\S+) with tp=(\\d+) pp=(\\d+) vpp=(\\d+) dp=(\\d+) "
                   "microbatch size (\\d+) seq-splits (\\d+) recompute (\\w+), needs "
                   "([0-9.]+ GiB) on rank (\\d+) .*try --memory-limit (\\d+),")))
        << oom.err;
    std::string schedule = m[1] == kNoPipelineLabel ? "1f1b" : std::string(m[1]);
    int tp = std::stoi(m[2]), pp = std::stoi(m[3]), dp = std::stoi(m[5]);
    int b = std::stoi(m[6]);
    auto j = nlohmann::json::parse(testing::slurp("examples/gpt-7b-8k.json"));
    j["transformer"]["microbatch_size"] = b;
    j["transformer"]["recompute"] = std::string(m[8]);
    const std::string model = dir + "/oom-model.json";
    std::ofstream(model) << j.dump();
    Result c = run(fmt::format("tools/pipec compile --model {} --cluster examples/a100-80g.json "
                               "--schedule {} --pp {} --vpp {} --dp {} --tp {} --microbatches {} "
                               "--seq-splits {}",
                               model, schedule, pp, std::string(m[4]), dp, tp, 64 / (dp * b),
                               std::string(m[7])));
    ASSERT_EQ(c.code, 0) << c.out << c.err;
    EXPECT_NE(c.out.find(fmt::format("peak memory: rank {} with {}", std::string(m[10]),
                                     std::string(m[9]))),
              std::string::npos)
        << oom.err << "\n"
        << c.out;
    Result again = run(base + " --memory-limit " + std::string(m[11]) + " --top 1");
    EXPECT_EQ(again.code, 0) << again.out << again.err;
  }
}

TEST(PlannerCliTest, HugeInputsWithoutALayoutAreOneLineNamingTheFlag) {
  // Each used to run a full search per nearby value (over 10 minutes); the suggestions now come
  // from divisibility (docs/benchmarks.md has the time). Exit 2, one line, the flag at fault
  // first.
  const std::string m = "tools/pipec plan --model examples/gpt-7b-8k.json ";
  const std::pair<std::string, std::string> cases[] = {
      {"--gpus 1048576 --global-batch 8", "--gpus 1048576: "},
      {"--gpus 1048573 --global-batch 64", "--gpus 1048573: "}, // prime
      {"--gpus 8 --global-batch 1099511627776", "--global-batch 1099511627776: "},
      {"--gpus 1048576 --global-batch 64 --tp 3", "--tp 3: "},
      {"--gpus 1048576 --global-batch 64 --tp-across-nodes", "--gpus 1048576: "},
      {"--gpus 8 --global-batch 64 --tp 16777216", "--tp 16777216: "},
      {"--gpus 1048576 --global-batch 64 --pp 3", "--pp 3: "},
  };
  for (const auto &[flags, blame] : cases) {
    Result r = run(m + flags);
    EXPECT_EQ(r.code, 2) << flags << ": " << r.out << r.err;
    EXPECT_EQ(r.err.rfind("pipec: error: " + blame, 0), 0u) << flags << ": " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_NE(r.err.find("; try --"), std::string::npos) << r.err;
  }
}

} // namespace
} // namespace pipec
