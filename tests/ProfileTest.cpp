//===- ProfileTest.cpp - Measured costs: pipecost/1, --profile, --costs ---===//
//
// The format's reader and writer (every bad field named as $.path), how a plan takes measured
// costs (ir/formats/Costs.h), the executed-stream simulation piperun predicts with against a closed
// form, and end to end on the cpu backend: piperun --profile, pipec compile --costs, and the
// last line within a bound the machine's noise cannot break (bench/measured_costs_bench.py
// prints the per-schedule table).
//
//===----------------------------------------------------------------------===//
#include "compiler/Pass.h"
#include "ir/CostModel.h"
#include "ir/formats/Costs.h"
#include "ir/formats/SpecJson.h"
#include "ir/support/Error.h"
#include "tests/Command.h"
#include "tests/TestUtil.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <regex>

namespace pipec {
namespace {

using testing::runCommand;
using testing::slurp;
using testing::tmpDir;

MeasuredCosts sample(int64_t bytes = 4096) {
  MeasuredCosts c = test::profileOf(/*numStages=*/2, /*numSlices=*/1);
  for (int s = 0; s < 2; ++s) {
    c.ops.push_back({s, OpKind::Forward, 0, {1.0, 0.1, 16}});
    c.ops.push_back({s, OpKind::Backward, 0, {2.0, 0.2, 16}});
  }
  c.messages.push_back({TensorKind::Activation, bytes, {0.0, 0.0, 8}});
  c.messages.push_back({TensorKind::Gradient, bytes, {0.0, 0.0, 8}});
  c.collectives.push_back({CollectiveGroup::Dp, 1, {0.5, 0.0, 4}});
  c.ranks.push_back({0, {0.0, 0.0, 4}, 1000});
  c.ranks.push_back({1, {0.0, 0.0, 4}, 2000});
  return c;
}

TEST(CostsFormat, RoundTrips) {
  const std::string text = writeCostsJson(sample());
  auto back = parseCostsJson(text, "c.json");
  ASSERT_TRUE(bool(back)) << takeMessage(back.takeError());
  EXPECT_EQ(writeCostsJson(*back), text);
  EXPECT_EQ(back->ops.size(), 4u);
  EXPECT_EQ(back->ops[1].op, OpKind::Backward);
  EXPECT_EQ(back->ranks[1].peakMemoryBytes, 2000);
  EXPECT_EQ(back->planHash, "0123");
}

/// `err` is an InputError (exit 2) whose message holds `needle`.
void expectInputError(llvm::Error err, const std::string &needle) {
  ASSERT_TRUE(bool(err));
  EXPECT_EQ(exitCodeFor(err), 2);
  std::string m = takeMessage(std::move(err));
  EXPECT_NE(m.find(needle), std::string::npos) << m;
}

/// Parsing `j` fails, naming `path`.
void expectBad(const nlohmann::json &j, const std::string &path) {
  auto parsed = parseCostsJson(j.dump(), "c.json");
  ASSERT_FALSE(bool(parsed)) << j.dump();
  expectInputError(parsed.takeError(), path);
}

TEST(CostsFormat, EveryBadFieldIsNamed) {
  const auto good = nlohmann::json::parse(writeCostsJson(sample()));
  auto j = good;
  j["format"] = "pipecost/2";
  expectBad(j, "$.format");
  j = good;
  j["stages"][0]["ops"][0]["op"] = "sideways";
  expectBad(j, "$.stages[0].ops[0].op");
  j = good;
  j["stages"][1]["ops"][1]["median_ms"] = -1;
  expectBad(j, "$.stages[1].ops[1].median_ms");
  j = good;
  j["stages"][1]["ops"][0]["median_ms"] = 0;
  expectBad(j, "$.stages[1].ops[0].median_ms: expected a positive number of milliseconds");
  j = good;
  j["stages"][0]["ops"][0]["slice"] = 1;
  expectBad(j, "$.stages[0].ops[0].slice");
  j = good;
  j["stages"][0]["ops"][1]["op"] = "forward";
  expectBad(j, "$.stages[0].ops[1]");
  // A backward measured both fused and split (the fused time would be dropped).
  j = good;
  j["stages"][1]["ops"].push_back({{"op", "backward_input"},
                                   {"slice", 0},
                                   {"median_ms", 1.0},
                                   {"spread_ms", 0.0},
                                   {"samples", 4}});
  expectBad(j, "$.stages[1].ops[2]: a backward_input of slice 0 beside its fused backward");
  j = good;
  j["stages"][0]["ops"][1]["op"] = "backward_weight";
  j["stages"][0]["ops"].push_back(
      {{"op", "backward"}, {"slice", 0}, {"median_ms", 1.0}, {"spread_ms", 0.0}, {"samples", 4}});
  expectBad(j, "$.stages[0].ops[2]: a backward of slice 0 beside its split backward");
  j = good;
  j["stages"][1]["stage"] = 0;
  expectBad(j, "$.stages[1].stage");
  j = good;
  j.erase("messages");
  expectBad(j, "$.messages");
  j = good;
  j["messages"][0]["kind"] = "weights";
  expectBad(j, "$.messages[0].kind");
  j = good;
  j["collectives"][0]["stage"] = 7;
  expectBad(j, "$.collectives[0].stage");
  j = good;
  j["ranks"][0]["optimizer"]["samples"] = "four";
  expectBad(j, "$.ranks[0].optimizer.samples");
  j = good;
  j["measured_on"]["threads"] = 0;
  expectBad(j, "$.measured_on.threads");
  j = good;
  j["extra"] = 1;
  expectBad(j, "extra");
}

/// A transformer model of `hidden` channels, 4 layers.
ModelSpec model(int hidden) {
  auto m = parseModelSpec(nlohmann::json{{"format", "pipemodel/1"},
                                         {"name", "profile-gpt"},
                                         {"transformer",
                                          {{"num_layers", 4},
                                           {"hidden_size", hidden},
                                           {"num_attention_heads", 4},
                                           {"ffn_hidden_size", 4 * hidden},
                                           {"vocab_size", 128},
                                           {"seq_length", 32},
                                           {"microbatch_size", 2},
                                           {"dtype", "fp32"}}}}
                              .dump(),
                          "model");
  EXPECT_TRUE(bool(m));
  return *m;
}

Plan compile(const std::string &schedule, int pp, const MeasuredCosts *costs) {
  CompileOptions o;
  o.schedule = schedule;
  o.parallel.pp = pp;
  o.parallel.microbatches = 4;
  if (costs) {
    o.costs = std::make_shared<const MeasuredCosts>(*costs);
    o.costsSource = "--costs c.json";
  }
  auto plan = compilePlan(model(32), ClusterSpec::defaults(), o);
  EXPECT_TRUE(bool(plan)) << (plan ? "" : takeMessage(plan.takeError()));
  return plan ? std::move(*plan) : Plan();
}

/// The size of the test model's messages (every stage's output is one microbatch's hidden
/// state).
int64_t messageBytes() {
  Plan plan = compile("1f1b", 2, nullptr);
  return plan.stages.empty() ? 0 : plan.stages[0].outputBytes[0];
}

TEST(Costs, ReplaceTheModelsTimes) {
  MeasuredCosts c = sample(messageBytes());
  Plan plan = compile("zb-h1", 2, &c);
  ASSERT_EQ(plan.stages.size(), 2u);
  Plan modelOnly = compile("zb-h1", 2, nullptr);
  for (size_t s = 0; s < 2; ++s) {
    EXPECT_DOUBLE_EQ(plan.stages[s].forward[0], 1.0);
    // A fused backward measured: split in the model's ratio, summing to the measured time.
    EXPECT_DOUBLE_EQ(plan.stages[s].backwardInput[0] + plan.stages[s].backwardWeight[0], 2.0);
    const StageInfo &m = modelOnly.stages[s];
    EXPECT_NEAR(plan.stages[s].backwardInput[0] / 2.0,
                m.backwardInput[0] / (m.backwardInput[0] + m.backwardWeight[0]), 1e-12);
    EXPECT_DOUBLE_EQ(plan.stages[s].optimizerTime, 0.0);
  }
  // The measured messages (free) replace the model's transfer times.
  EXPECT_GT(modelOnly.stages[0].activationTransferTime[0], 0.0);
  EXPECT_DOUBLE_EQ(plan.stages[0].activationTransferTime[0], 0.0);
  EXPECT_DOUBLE_EQ(plan.stages[1].gradientTransferTime[0], 0.0);
  // The simulator took them: busy time is the measured compute, 4 x (1 + 2) per rank.
  for (const RankStats &r : plan.stats.ranks)
    EXPECT_NEAR(r.busy, 12.0, 1e-9);
}

TEST(Costs, AMismatchedFileIsRefusedNamingTheField) {
  MeasuredCosts c = sample();
  CompileOptions o;
  o.schedule = "1f1b";
  o.parallel.pp = 4;
  o.parallel.microbatches = 4;
  o.costs = std::make_shared<const MeasuredCosts>(c);
  o.costsSource = "--costs c.json";
  auto plan = compilePlan(model(32), ClusterSpec::defaults(), o);
  ASSERT_FALSE(bool(plan));
  expectInputError(plan.takeError(), "--costs c.json: $.stages: 2 stages measured, the plan has 4");
  o.parallel.pp = 2;
  o.parallel.seqSplits = 2;
  o.schedule = "seq1f1b";
  plan = compilePlan(model(32), ClusterSpec::defaults(), o);
  ASSERT_FALSE(bool(plan));
  expectInputError(plan.takeError(), "$.slices");
}

TEST(Costs, ExecutedStepBoundsAndOneRankClosedForm) {
  // The executed streams only add waits to the compute-only timeline (a send that waits for its
  // receiver delays its rank), and never exceed every op run one after another.
  MeasuredCosts c = sample(messageBytes());
  for (const char *schedule : {"1f1b", "gpipe", "zb-h1"}) {
    SCOPED_TRACE(schedule);
    Plan plan = compile(schedule, 2, &c);
    auto step = simulateExecutedStep(plan);
    ASSERT_TRUE(bool(step)) << takeMessage(step.takeError());
    EXPECT_GE(*step, plan.stats.makespan - 1e-9);
    EXPECT_LE(*step, 2 * 4 * (1.0 + 2.0) + 1e-9);
  }
  // On one rank there is nothing to wait for: the step is its ops, 4 x (F + B) of 2 stages.
  MeasuredCosts one = c;
  one.ranks.resize(1);
  one.messages.clear();
  CompileOptions o;
  o.schedule = "interleaved-1f1b";
  o.parallel.pp = 1;
  o.parallel.vpp = 2;
  o.parallel.microbatches = 4;
  o.costs = std::make_shared<const MeasuredCosts>(one);
  auto plan = compilePlan(model(32), ClusterSpec::defaults(), o);
  if (!plan) {
    // (A policy may refuse pp = 1; gpipe over 2 virtual stages is the same question.)
    llvm::consumeError(plan.takeError());
    GTEST_SKIP() << "interleaved-1f1b refuses pp = 1";
  }
  auto step = simulateExecutedStep(*plan);
  ASSERT_TRUE(bool(step)) << takeMessage(step.takeError());
  EXPECT_NEAR(*step, 2 * 4 * (1.0 + 2.0), 1e-9);
}

// End to end on the cpu backend: piperun measures, pipec takes the measurements, piperun's last
// line compares. The bound is loose (the machine is shared; the test asserts behaviour, the
// benchmark the accuracy).
const std::regex kLastLine(R"(step time: measured median ([0-9.]+) ms over (\d+) steps, )"
                           R"(predicted ([0-9.]+) ms \(([-+0-9.]+)%\)\n?$)");

std::string modelFile() {
  std::string path = tmpDir() + "/profile-model.json";
  nlohmann::json j = {{"format", "pipemodel/1"},
                      {"name", "profile-gpt"},
                      {"transformer",
                       {{"num_layers", 4},
                        {"hidden_size", 64},
                        {"num_attention_heads", 4},
                        {"ffn_hidden_size", 256},
                        {"vocab_size", 128},
                        {"seq_length", 32},
                        {"microbatch_size", 2},
                        {"dtype", "fp32"}}}};
  std::ofstream(path) << j.dump();
  return path;
}

TEST(ProfileCli, PredictsTheMeasuredStepWithinALooseBound) {
  const std::string m = modelFile(), d = tmpDir();
  for (const char *schedule : {"1f1b", "zb-h1"}) {
    SCOPED_TRACE(schedule);
    const std::string base = std::string("tools/pipec compile --quiet --model ") + m +
                             " --pp 2 --microbatches 4 --schedule " + schedule;
    auto r = runCommand(base + " -o " + d + "/plan.json");
    ASSERT_EQ(r.code, 0) << r.err;
    // Compiled for the default cluster (H100s), the plan predicts a step hundreds of times
    // shorter than CPU threads take: a note before the last line says how to predict this one.
    r = runCommand("tools/piperun " + d + "/plan.json --steps 3");
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_TRUE(std::regex_search(
        r.out, std::regex("\nnote: the step ran [0-9]+x slower than the plan's stage times "
                          "predict: .* run with --profile costs.json and compile with --costs "
                          "costs.json\nstep time: measured median [^\n]*\n$")))
        << r.out;
    // Within a factor of 3 either way: on a machine whose cores the ranks share with other work,
    // ops slow down when both ranks compute at once and the prediction came out 25-40% low, and
    // under a heavier load once 2.2x (docs/benchmarks.md#measured-against-predicted-cpu); a
    // unit slip, a message read as its wait, or a lost stage would be far outside. The load
    // can also change between the profiling run and the measured one (other tests start and
    // end): a second profile and run are taken when the first pair is outside the bound, and
    // the bound must hold for one of the two pairs. A real slip puts both outside.
    std::string attempts;
    double ratio = 0;
    for (int attempt = 0; attempt < 2; ++attempt) {
      r = runCommand("tools/piperun " + d + "/plan.json --steps 4 --profile " + d + "/costs.json");
      ASSERT_EQ(r.code, 0) << r.err;
      auto costs = readCosts(d + "/costs.json");
      ASSERT_TRUE(bool(costs)) << takeMessage(costs.takeError());
      EXPECT_EQ(costs->backend, "cpu");
      EXPECT_EQ(costs->steps, 4);
      EXPECT_EQ(costs->numStages, 2);
      EXPECT_EQ(costs->ranks.size(), 2u);
      // 3 steps after the warm-up, 4 microbatches each: 12 samples of every op.
      for (const MeasuredCosts::Op &op : costs->ops) {
        EXPECT_EQ(op.time.samples, 12);
        EXPECT_GT(op.time.medianMs, 0);
      }
      EXPECT_EQ(costs->ops.size(), std::string(schedule) == "1f1b" ? 4u : 6u);
      r = runCommand(base + " --costs " + d + "/costs.json -o " + d + "/fitted.json");
      ASSERT_EQ(r.code, 0) << r.err;
      r = runCommand("tools/piperun " + d + "/fitted.json --steps 5");
      ASSERT_EQ(r.code, 0) << r.err;
      std::smatch got;
      ASSERT_TRUE(std::regex_search(r.out, got, kLastLine)) << r.out;
      EXPECT_EQ(got[2], "4");
      const double measured = std::stod(got[1]), predicted = std::stod(got[3]);
      // The percentage is printed to 0.1 and the times to 0.01 ms, so it matches the printed
      // times' ratio only within what those roundings leave: the true times differ from the
      // printed ones by at most 0.005 ms, which on a 1 ms step is 0.5% of the ratio.
      const double low = predicted - 0.005;
      ASSERT_GT(low, 0) << got.str(0);
      const double rounding = 0.05 + 100 * (0.005 / low + measured * 0.005 / (predicted * low));
      EXPECT_NEAR(std::stod(got[4]), 100 * (measured / predicted - 1), rounding + 1e-9);
      ratio = measured / predicted;
      attempts += "attempt " + std::to_string(attempt) + ": " + got.str(0) + "\n";
      if (ratio < 3.0 && ratio > 1.0 / 3)
        break;
    }
    EXPECT_LT(ratio, 3.0) << attempts;
    EXPECT_GT(ratio, 1.0 / 3) << attempts;
  }
}

TEST(ProfileCli, BadUseExitsTwoNamingTheFlagOrField) {
  const std::string m = modelFile(), d = tmpDir();
  auto r = runCommand("tools/pipec compile --quiet --model " + m +
                      " --pp 2 --microbatches 4 --schedule 1f1b -o " + d + "/p.json");
  ASSERT_EQ(r.code, 0) << r.err;
  r = runCommand("tools/piperun " + d + "/p.json --steps 1 --profile " + d + "/c.json");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("--profile needs --steps 2 or more"), std::string::npos) << r.err;
  std::ofstream(d + "/c.json") << writeCostsJson(sample());
  r = runCommand("tools/pipec compile --quiet --model " + m +
                 " --pp 4 --microbatches 4 --schedule 1f1b --costs " + d + "/c.json -o " + d +
                 "/q.json");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("$.stages: 2 stages measured, the plan has 4"), std::string::npos) << r.err;
  std::ofstream(d + "/bad.json") << R"({"format": "pipecost/1"})";
  r = runCommand("tools/pipec compile --quiet --model " + m +
                 " --pp 2 --microbatches 4 --schedule zb-h1 --costs " + d + "/bad.json -o " + d +
                 "/q.json");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("$.measured_on"), std::string::npos) << r.err;
  // A plan without --steps 3 or more has no last line to compare.
  r = runCommand("tools/piperun " + d + "/p.json --steps 2");
  EXPECT_EQ(r.code, 0);
  EXPECT_EQ(r.out.find("step time:"), std::string::npos);
}

// A profile states its plan's message sizes: one of another model (or microbatch size, or
// sequence length) sends none of them and is refused, as is a switch whose effect the measured
// times would cancel (piperun runs neither sequence parallelism nor ZeRO-1). Before, each was
// accepted: the other model's step predicted from the tiny model's times, the switches' savings
// silently gone.
TEST(ProfileCli, AProfileOfAnotherModelOrOfASwitchItWouldCancelIsRefused) {
  const std::string m = modelFile(), d = tmpDir() + "/other-model";
  std::filesystem::create_directories(d);
  const std::string base = " --pp 2 --microbatches 4 --schedule 1f1b";
  auto r = runCommand("tools/pipec compile --quiet --model " + m + base + " -o " + d + "/p.json");
  ASSERT_EQ(r.code, 0) << r.err;
  r = runCommand("tools/piperun " + d + "/p.json --steps 3 --profile " + d + "/c.json");
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string costs = " --costs " + d + "/c.json -o " + d + "/q.json";
  r = runCommand("tools/pipec compile --quiet --model " + m + base + costs);
  EXPECT_EQ(r.code, 0) << r.err; // the profiled model itself
  auto wider = nlohmann::json::parse(slurp(m));
  wider["transformer"]["hidden_size"] = 128;
  std::ofstream(d + "/wider.json") << wider.dump();
  const std::string widerModel = " --model " + d + "/wider.json";
  for (const std::string &cmd :
       {"tools/pipec compile --quiet" + widerModel + base + costs,
        "tools/pipec plan" + widerModel +
            " --gpus 2 --global-batch 8 --tp 1 --microbatch-sizes 2 --pp 2 --costs " + d +
            "/c.json -o " + d + "/q.json"}) {
    SCOPED_TRACE(cmd);
    r = runCommand(cmd);
    EXPECT_EQ(r.code, 2) << r.out << r.err;
    EXPECT_EQ(r.err.rfind("pipec: error: --costs " + d +
                              "/c.json: $.messages: the profile's activation messages are of ",
                          0),
              0u)
        << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
  for (auto [flags, named] :
       {std::pair{" --tp 2 --sequence-parallel", "cancel --sequence-parallel's"},
        std::pair{" --dp 2 --distributed-optimizer", "cancel --distributed-optimizer's"}}) {
    r = runCommand("tools/pipec compile --quiet --model " + m + base + flags + costs);
    EXPECT_EQ(r.code, 2) << flags;
    EXPECT_NE(r.err.find(named), std::string::npos) << r.err;
  }
}

} // namespace
} // namespace pipec
