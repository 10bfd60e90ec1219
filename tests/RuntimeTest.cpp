//===- RuntimeTest.cpp - The cpu runtime against a single-rank reference --===//
//
// Every schedule the compiler offers runs with real fp32 math on threads and must produce the
// gradients of one rank running the same steps without pipelining (kernels/cpu, all layers,
// all microbatches, whole sequences, tp = 1) within 1e-5 of the gradient scale: the reference
// shares the kernels but none of the plan, the partition, the interpreter or the transport.
//
//===----------------------------------------------------------------------===//
#include "tests/TestUtil.h"

#include "compiler/Verifier.h"
#include "ir/PlanText.h"
#include "kernels/cpu/Gpt.h"
#include "runtime/Data.h"
#include "runtime/Reference.h"
#include "runtime/Runner.h"
#include "runtime/cpu/CpuRun.h"
#include "schedules/Policy.h"

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <span>
#include <thread>
#include <vector>

namespace pipec::test {
namespace {

/// How a run of `plan` on synthetic data with `faults` planted fails, under a watchdog of
/// `timeout` seconds: its message (a test failure where it does not fail).
std::string failureWith(const Plan &plan, const Faults &faults, double timeout) {
  CpuRunOptions o;
  o.timeoutSeconds = timeout;
  o.faults = faults;
  auto data = syntheticData(32, 1);
  auto result = runOnCpu(plan, *data, o);
  EXPECT_FALSE(bool(result)) << "the run with a planted fault succeeded";
  return result ? std::string() : takeMessage(result.takeError());
}

/// Run `steps` steps with the reference check; expect equal gradients and losses.
void expectMatchesReference(const Plan &plan, int steps = 2) {
  ASSERT_FALSE(verifyPlan(plan));
  auto data = syntheticData(32, /*seed=*/7);
  CpuRunOptions o;
  o.steps = steps;
  o.checkReference = true;
  o.timeoutSeconds = 20;
  auto result = runOnCpu(plan, *data, o);
  ASSERT_TRUE(bool(result)) << takeMessage(result.takeError());
  EXPECT_GT(result->grads.scale, 0);
  EXPECT_LE(result->grads.maxAbsDiff, 1e-5 * result->grads.scale)
      << "max |grad - reference| " << result->grads.maxAbsDiff << " scale " << result->grads.scale;
  EXPECT_LE(result->grads.maxTensorDiff, kTensorGradTolerance)
      << "worst tensor at " << result->grads.worstTensor.param;
  // Every replica-0 weight after the last step, against the reference's.
  EXPECT_EQ(result->weights.steps, steps);
  EXPECT_LE(result->weights.maxRatio, 1.0) << weightCheckReport(result->weights);
  EXPECT_LT(result->weights.tpCopy.step, 0) << weightCheckReport(result->weights);
  EXPECT_LT(result->weights.dpCopy.replica, 0) << weightCheckReport(result->weights);
  for (int s = 0; s < steps; ++s)
    EXPECT_NEAR(result->losses[size_t(s)], result->referenceLosses[size_t(s)], 1e-5);
}

struct RunCase {
  const char *name;
  CompileOptions options;
  bool tied = false;
};

CompileOptions withMemory(CompileOptions o, int64_t limit) {
  o.memoryLimit = limit;
  return o;
}

class EverySchedule : public ::testing::TestWithParam<RunCase> {};

TEST_P(EverySchedule, GradientsEqualTheSingleRankReference) {
  const RunCase &c = GetParam();
  // Every case names a registered policy: one missing from the registry fails here.
  auto policy = findPolicy(c.options.schedule);
  ASSERT_TRUE(bool(policy)) << c.options.schedule
                            << " is not registered: " << takeMessage(policy.takeError());
  ModelSpec model = tinyGpt(c.tied, /*layers=*/6);
  auto plan = compilePlan(model, ClusterSpec::defaults(), c.options, /*verifyEach=*/true);
  ASSERT_TRUE(bool(plan)) << takeMessage(plan.takeError());
  expectMatchesReference(*plan);
}

TEST_P(EverySchedule, LlamaBlockGradientsEqualTheSingleRankReference) {
  // The same plans over a Llama-style block (rmsnorm, swiglu, rope, grouped-query attention
  // with its 2 key/value heads split across tp, no biases).
  const RunCase &c = GetParam();
  ModelSpec model = tinyLlama(c.tied, /*layers=*/6);
  auto plan = compilePlan(model, ClusterSpec::defaults(), c.options, /*verifyEach=*/true);
  ASSERT_TRUE(bool(plan)) << takeMessage(plan.takeError());
  expectMatchesReference(*plan);
}

const RunCase kRunCases[] = {
    RunCase{"gpipe", options("gpipe", 4, 4)},
    RunCase{"onefoneb", options("1f1b", 4, 6)},
    RunCase{"onefoneb_fewer_microbatches", options("1f1b", 4, 2)},
    RunCase{"onefoneb_tp2", options("1f1b", 2, 4, 1, 1, /*tp=*/2)},
    RunCase{"onefoneb_dp2", options("1f1b", 2, 4, 1, 1, 1, /*dp=*/2)},
    RunCase{"onefoneb_tp2_dp2", options("1f1b", 2, 3, 1, 1, /*tp=*/2, /*dp=*/2)},
    RunCase{"gpipe_seq4", options("gpipe", 2, 3, 1, /*seqSplits=*/4)},
    RunCase{"onefoneb_tied", options("1f1b", 4, 4), /*tied=*/true},
    RunCase{"single_stage_tied", options("1f1b", 1, 3), /*tied=*/true},
    RunCase{"dualpipev", options("dualpipe-v", 2, 4, /*vpp=*/2)},
    RunCase{"dualpipev_tied_tp2", options("dualpipe-v", 2, 4, 2, 1, /*tp=*/2), true},
    RunCase{"interleaved", options("interleaved-1f1b", 2, 4, /*vpp=*/2)},
    RunCase{"seq1f1b_k4", options("seq1f1b", 2, 4, 1, /*seqSplits=*/4)},
    RunCase{"seq1f1b_interleaved", options("seq1f1b-interleaved", 2, 4, 2, 2)},
    RunCase{"zbh1", options("zb-h1", 4, 6)},
    RunCase{"zbh2", options("zb-h2", 4, 6)},
    RunCase{"zbv", options("zb-v", 2, 4, /*vpp=*/2)},
    RunCase{"zbh1_seq2_tp2", options("zb-h1", 2, 3, 1, /*seqSplits=*/2, /*tp=*/2)},
    RunCase{"zbv_seq2", options("zb-v", 2, 3, /*vpp=*/2, /*seqSplits=*/2)},
    RunCase{"zbauto", withMemory(options("zb-auto", 4, 6), int64_t(1) << 40)}};

INSTANTIATE_TEST_SUITE_P(Runtime, EverySchedule, ::testing::ValuesIn(kRunCases),
                         [](const auto &info) { return std::string(info.param.name); });

TEST(RuntimeTest, EveryRegisteredPolicyRunsInTheReferenceCheck) {
  // A policy added to the registry without a case above would never be run against the
  // single-rank reference.
  for (const SchedulePolicy *policy : allPolicies()) {
    bool covered = false;
    for (const RunCase &c : kRunCases)
      covered |= c.options.schedule == policy->name();
    EXPECT_TRUE(covered) << policy->name().str() << " has no case in kRunCases";
  }
}

TEST(RuntimeTest, LossOfALearnableTaskFallsOver40Steps) {
  ModelSpec model = tinyGpt(false, 2, 8);
  Plan plan = compileOrFail(model, options("1f1b", 2, 4));
  auto data = syntheticData(32, 3);
  CpuRunOptions o;
  o.steps = 40;
  o.lr = 1e-2f;
  auto result = runOnCpu(plan, *data, o);
  ASSERT_TRUE(bool(result)) << takeMessage(result.takeError());
  EXPECT_GT(result->losses.front(), 3.0); // ~ln(32) at the start
  EXPECT_LT(result->losses.back(), 0.5 * result->losses.front());
}

TEST(RuntimeTest, ADroppedMessageIsReportedByTheWatchdogInScheduleTerms) {
  Plan plan = compileOrFail(tinyGpt(), options("1f1b", 2, 2));
  // Rank 0's last send (the activation of microbatch 1) never arrives: nothing else can match
  // rank 1's recv, so it waits until the watchdog fires.
  size_t step = plan.ranks[0].size();
  while (plan.ranks[0][--step].op != OpKind::Send) {
  }
  size_t recv = 0;
  while (!(plan.ranks[1][recv].op == OpKind::Recv && plan.ranks[1][recv].mb == 1))
    ++recv;
  Faults faults;
  faults.dropSend = {0, step};
  std::string msg = failureWith(plan, faults, /*timeout=*/0.3);
  EXPECT_NE(msg.find("watchdog: no rank made progress for"), std::string::npos) << msg;
  // Rank 1 waits in the group that holds the recv of the lost message.
  std::string lost = formatToken(plan, plan.ranks[1][recv]);
  size_t at = msg.find("rank 1: last completed");
  ASSERT_NE(at, std::string::npos) << msg;
  std::string line = msg.substr(at, msg.find('\n', at) - at);
  EXPECT_NE(line.find("pending"), std::string::npos) << line;
  EXPECT_NE(line.find(lost), std::string::npos) << lost << "\n" << msg;
  EXPECT_NE(msg.find("<-- here"), std::string::npos) << msg;
}

/// A rank whose compute op never returns, as a thread held inside a GPU call (a launch queue
/// full behind a kernel that never finishes), which no transport abort can wake; the other
/// ranks' ops return at once. A held rank sets `holding` once it is inside the call.
class HeldBackend final : public Backend {
public:
  explicit HeldBackend(bool held, std::atomic<bool> *holding = nullptr)
      : held(held), holding(holding) {}
  llvm::Error beginStep(int) override { return llvm::Error::success(); }
  llvm::Error compute(const Instruction &) override {
    if (held && holding)
      holding->store(true);
    while (held)
      std::this_thread::sleep_for(std::chrono::seconds(1));
    return llvm::Error::success();
  }
  TensorView sendData(const Instruction &) override { return std::span<float>(buffer); }
  TensorView recvData(const Instruction &) override { return std::span<float>(buffer); }
  TensorView reduceData(const Instruction &) override { return std::span<float>(buffer); }
  llvm::Error afterAllReduce(const Instruction &) override { return llvm::Error::success(); }
  void sumLocalEmbeddingCopies() override {}
  llvm::Error optimizerStep() override { return llvm::Error::success(); }

private:
  bool held;
  std::atomic<bool> *holding;
  float buffer[4] = {};
};

TEST(RuntimeDeathTest, ARankThreadTheAbortCannotReachEndsTheProcessWithTheReport) {
  // Rank 0 never finishes its first forward, so rank 1 waits for its activation: the watchdog
  // reports the stall after 0.2 s and aborts the transport. Rank 1 returns; rank 0 cannot,
  // and joining it would wait forever. After 10 s the process ends with the report. The
  // watchdog's time is a ManualClock that a ticker moves 50 ms at a time, each step once the
  // watchdog is back waiting on it: the ten seconds take no time, and nothing here depends on
  // how fast the machine is. The ticker starts once rank 0 is inside its held call: a rank
  // thread that starts after the abort returns before its first op, and the runner with it.
  // Rank 1 returns at the abort in real time while the ticker's ten seconds take none, so
  // whether it has returned by then is the scheduler's choice: the report counts 1 or 2.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  Plan plan = compileOrFail(tinyGpt(), options("1f1b", 2, 2));
  EXPECT_EXIT(
      {
        ManualClock clock;
        std::atomic<bool> holding{false};
        std::vector<std::unique_ptr<Backend>> backends;
        backends.push_back(std::make_unique<HeldBackend>(true, &holding));
        backends.push_back(std::make_unique<HeldBackend>(false));
        Runner runner(plan, Faults{}, /*timeoutSeconds=*/0.2, std::move(backends), clock);
        std::thread ticker([&clock, &holding] {
          while (!holding.load())
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
          for (;;) {
            clock.awaitWaiters(1);
            clock.advance(0.05);
          }
        });
        ticker.detach();
        llvm::Error err = runner.step(0);
        llvm::consumeError(std::move(err));
        std::_Exit(0); // (not reached: the runner cannot return)
      },
      ::testing::ExitedWithCode(1),
      "watchdog: no rank made progress for 0\\.[0-9] s in step 0.*watchdog: [12] of the 2 rank "
      "threads did not stop 10\\.0 s after the report above");
}

TEST(RuntimeTest, ADroppedMessageFollowedByAnotherIsAMismatch) {
  Plan plan = compileOrFail(tinyGpt(), options("1f1b", 2, 2));
  size_t step = 0;
  while (plan.ranks[0][step].op != OpKind::Send)
    ++step;
  Faults faults;
  faults.dropSend = {0, step};
  std::string msg = failureWith(plan, faults, /*timeout=*/5);
  // The next message from rank 0 meets the recv that waited for the lost one.
  EXPECT_NE(msg.find("message mismatch: rank 1 step 0 (1RECV_F0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("expects activation(0,0,0)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("carries activation(0,1,0)"), std::string::npos) << msg;
}

TEST(RuntimeTest, TwoSwappedMessagesAreCaughtNamingBothInstructions) {
  Plan plan = compileOrFail(tinyGpt(), options("gpipe", 2, 2));
  // Rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 ...: put each send's identity on the other.
  std::vector<size_t> sends;
  for (size_t n = 0; n < plan.ranks[0].size(); ++n)
    if (plan.ranks[0][n].op == OpKind::Send)
      sends.push_back(n);
  ASSERT_GE(sends.size(), 2u);
  Faults faults;
  faults.swapSends = {0, {sends[0], sends[1]}};
  std::string msg = failureWith(plan, faults, /*timeout=*/5);
  EXPECT_NE(msg.find("message mismatch: rank 1 step 0 (1RECV_F0#0) expects activation(0,0,0)"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("rank 0 step 1 (0SEND_F0), carries activation(0,1,0)"), std::string::npos)
      << msg;
}

TEST(RuntimeTest, AbstractModelsAreRefusedWithTheReason) {
  Plan plan = compileOrFail(uniformModel(4), options("1f1b", 2, 2));
  auto data = syntheticData(32, 1);
  auto result = runOnCpu(plan, *data, CpuRunOptions{});
  ASSERT_FALSE(bool(result));
  EXPECT_NE(takeMessage(result.takeError()).find("is an abstract layer list"), std::string::npos);
}

TEST(DataTest, TokenFilesLoadRawAndLlmcFormatsAndRejectOutOfVocabIds) {
  std::string dir = std::getenv("TEST_TMPDIR") ? std::getenv("TEST_TMPDIR") : "/tmp";
  std::string raw = dir + "/tokens.bin", llmc = dir + "/llmc.bin", bad = dir + "/bad.bin";
  {
    std::ofstream out(raw, std::ios::binary);
    for (uint16_t t = 0; t < 100; ++t) {
      uint16_t v = t % 32;
      out.write(reinterpret_cast<const char *>(&v), 2);
    }
  }
  {
    std::ofstream out(llmc, std::ios::binary);
    int32_t header[256] = {20240520, 2, 50};
    out.write(reinterpret_cast<const char *>(header), sizeof(header));
    for (uint32_t t = 0; t < 50; ++t) {
      uint32_t v = (t * 7) % 32;
      out.write(reinterpret_cast<const char *>(&v), 4);
    }
  }
  {
    std::ofstream out(bad, std::ios::binary);
    for (uint16_t t = 0; t < 20; ++t) {
      uint16_t v = t == 13 ? 40 : 1;
      out.write(reinterpret_cast<const char *>(&v), 2);
    }
  }
  auto a = tokenFileData(raw, "uint16", 32, 8, 1);
  ASSERT_TRUE(bool(a)) << takeMessage(a.takeError());
  std::vector<int32_t> seq(9);
  (*a)->sequence(0, seq);
  for (size_t i = 1; i < seq.size(); ++i)
    EXPECT_EQ(seq[i], (seq[i - 1] + 1) % 32); // a window of the file
  auto b = tokenFileData(llmc, "uint16", 32, 8, 1);
  ASSERT_TRUE(bool(b)) << takeMessage(b.takeError());
  (*b)->sequence(3, seq);
  for (size_t i = 1; i < seq.size(); ++i)
    EXPECT_EQ(seq[i], (seq[i - 1] + 7) % 32);
  auto c = tokenFileData(bad, "uint16", 32, 8, 1);
  ASSERT_FALSE(bool(c));
  EXPECT_NE(takeMessage(c.takeError())
                .find("token 40 at position 13 is outside the model's "
                      "vocab_size 32"),
            std::string::npos);
}

/// Fills `out` as the plan's ranks would hold full layer tensors whose element k of layer l is
/// value(l, k): every (stage, tp rank)'s shards (kernels::shardLayer), layer after layer.
template <typename Value>
void fillShardedSnapshot(const Plan &plan, const kernels::GptConfig &cfg, ParamSnapshot &out,
                         Value &&value) {
  const int tp = plan.parallel.tp;
  for (const StageInfo &st : plan.stages)
    for (int t = 0; t < tp; ++t) {
      std::vector<float> &mine = out.byStageAndTp[{st.stage, t}];
      for (int l = st.layerBegin; l < st.layerEnd; ++l) {
        std::vector<float> full(kernels::layerParamCount(cfg, l, 1));
        for (size_t k = 0; k < full.size(); ++k)
          full[k] = value(l, k);
        std::vector<float> shard = kernels::shardLayer(cfg, l, t, tp, full);
        mine.insert(mine.end(), shard.begin(), shard.end());
      }
    }
}

// ReferenceRun::adopt, which the bf16 reference check uses to take the run's gradients for its
// optimizer step, and compare(), which finds and places differences: what adopt() takes from a
// pp=2, tp=2 snapshot (sharded as the ranks hold it) is exactly what compare() then finds.
TEST(ReferenceRunTest, AdoptedGradientsAreWhatCompareFindsAndDifferencesArePlaced) {
  const Plan plan = compileOrFail(tinyGpt(/*tied=*/false, /*layers=*/6),
                                  options("1f1b", /*pp=*/2, /*microbatches=*/2, 1, 1, /*tp=*/2));
  auto cfg = gptConfigOf(plan);
  ASSERT_TRUE(bool(cfg)) << takeMessage(cfg.takeError());
  auto data = syntheticData(32, /*seed=*/7);
  ReferenceRun ref(plan, *cfg, *data, /*seed=*/1, /*lr=*/1e-3f);
  ref.step(0);
  ParamSnapshot snapshot; // every full layer tensor a pattern in [0.5, 12.5], then sharded
  fillShardedSnapshot(plan, *cfg, snapshot,
                      [](int l, size_t k) { return 0.5f + float((k * 7 + size_t(l)) % 13); });
  // Stage 0's first block (layer 1, after the embedding) gets small ln1.b gradients, 0.05 (above
  // the floor of a tensor's scale, 1e-3 of the largest gradient).
  const int c = 16, f = 32; // tinyGpt: hidden 16, ffn 32; tp 2 halves qkv's and fc's columns
  const size_t block1 = kernels::layerParamCount(*cfg, 0, 2), ln1b = block1 + c;
  for (int t = 0; t < 2; ++t) // replicated: both ranks hold it
    for (int k = 0; k < c; ++k)
      snapshot.byStageAndTp[{0, t}][ln1b + size_t(k)] = 0.05f;
  GradCheck before;
  ref.compare(snapshot, before, /*step=*/0);
  EXPECT_GT(before.maxAbsDiff, 0.4) << "the pattern is not the reference's own gradients";
  ref.adopt(snapshot);
  GradCheck same;
  ref.compare(snapshot, same, /*step=*/0);
  EXPECT_EQ(same.maxAbsDiff, 0.0);
  EXPECT_EQ(same.maxTensorDiff, 0.0);
  EXPECT_EQ(same.scale, 12.5);
  EXPECT_EQ(same.worst.step, -1) << "no difference, no place";

  // One element of stage 1's tp rank 1 off by 2, in the rank's part of its first block's fc.w.
  const StageInfo &st = plan.stages[1];
  const int layer = st.layerBegin; // a block
  ASSERT_EQ(kernels::layerKind(*cfg, layer), kernels::GptLayerKind::Block);
  size_t offset = 0;
  for (int l = st.layerBegin; l < layer; ++l)
    offset += kernels::layerParamCount(*cfg, l, 2);
  const size_t fcW = size_t(2 * c + c * 3 * c / 2 + 3 * c / 2 + c / 2 * c + c + 2 * c);
  std::vector<float> &rank = snapshot.byStageAndTp[{st.stage, 1}];
  const size_t at = offset + fcW + 3 * (f / 2) + 5; // row 3, column 5
  const float want = rank[at];
  rank[at] += 2.0f;
  GradCheck off;
  ref.compare(snapshot, off, /*step=*/4);
  EXPECT_FLOAT_EQ(off.maxAbsDiff, 2.0);
  EXPECT_EQ(off.worst.step, 4);
  EXPECT_EQ(off.worst.stage, st.stage);
  EXPECT_EQ(off.worst.tpRank, 1);
  EXPECT_EQ(off.worst.layer, layer);
  EXPECT_EQ(off.worst.param, "fc.w[3, 5]");
  EXPECT_EQ(off.worst.want, want);
  EXPECT_EQ(off.worst.got, want + 2.0f);
  EXPECT_FLOAT_EQ(off.maxTensorDiff, 2.0 / 12.5); // fc.w's largest gradient is 12.5
  EXPECT_EQ(off.worstTensor.param, "fc.w[3, 5]");
  rank[at] = want;

  // ln1.b's gradients with the wrong sign: 0.1 is under 1 % of the largest gradient, 12.5, but
  // twice the tensor's own.
  for (int k = 0; k < c; ++k)
    snapshot.byStageAndTp[{0, 0}][ln1b + size_t(k)] = -0.05f;
  GradCheck flipped;
  ref.compare(snapshot, flipped, /*step=*/1);
  EXPECT_LT(flipped.maxAbsDiff, 1e-2 * flipped.scale);
  EXPECT_FLOAT_EQ(flipped.maxTensorDiff, 2.0);
  EXPECT_EQ(flipped.worstTensor.stage, 0);
  EXPECT_EQ(flipped.worstTensor.tpRank, 0);
  EXPECT_EQ(flipped.worstTensor.layer, 1);
  EXPECT_EQ(flipped.worstTensor.param, "ln1.b[0]");

  // An infinite gradient in the reference (here adopted from the run): an infinite difference,
  // and not the scale (which would make every tolerance infinite).
  ParamSnapshot broken;
  broken.byStageAndTp = snapshot.byStageAndTp;
  broken.byStageAndTp[{1, 0}][3] = INFINITY;
  ref.adopt(broken);
  GradCheck infinite;
  ref.compare(broken, infinite, /*step=*/2);
  EXPECT_EQ(infinite.maxAbsDiff, INFINITY);
  EXPECT_EQ(infinite.maxTensorDiff, INFINITY);
  EXPECT_EQ(infinite.scale, 12.5);
  EXPECT_EQ(infinite.worst.stage, 1);
  ref.adopt(snapshot);

  // A NaN, which no finite difference outweighs.
  snapshot.byStageAndTp[{0, 0}][7] = NAN;
  ref.compare(snapshot, flipped, /*step=*/5);
  EXPECT_EQ(flipped.maxAbsDiff, INFINITY) << "a NaN gradient must fail the check, not be skipped";
  EXPECT_EQ(flipped.maxTensorDiff, INFINITY);
  EXPECT_EQ(flipped.worst.step, 5);
  EXPECT_EQ(flipped.worst.stage, 0);
  EXPECT_EQ(flipped.worst.param, "wte[0, 7]");
}

// The weights after the last step: the reference's AdamW (kernels/cpu) against the textbook
// AdamW (Loshchilov & Hutter; PyTorch's torch.optim.AdamW), written here in double on every
// rank's shard, from the same gradients. The check passes the textbook optimizer and catches
// one with beta1 0.89 for 0.9 (from the second step on: the first is the same whatever beta1, by
// the bias correction), an lr 0.5 % off, a weight decay of 0.1 or a rank that skips its step.
TEST(ReferenceRunTest, TheWeightsAfterTheLastStepCatchAWrongOptimizerStep) {
  const Plan plan = compileOrFail(tinyGpt(/*tied=*/false, /*layers=*/6),
                                  options("1f1b", /*pp=*/2, /*microbatches=*/2, 1, 1, /*tp=*/2));
  auto cfg = gptConfigOf(plan);
  ASSERT_TRUE(bool(cfg)) << takeMessage(cfg.takeError());
  auto data = syntheticData(32, /*seed=*/7);
  const float lr = 1e-3f;
  // Step s's gradients of every rank: a pattern in [-0.06, 0.06], zeros included, sharded.
  auto gradients = [&](int s, ParamSnapshot &g) {
    fillShardedSnapshot(plan, *cfg, g, [s](int l, size_t k) {
      return 1e-2f * float(int((k * 7 + size_t(l) + 5 * size_t(s)) % 13) - 6);
    });
  };
  struct Moments {
    std::vector<double> w, m, v;
  };
  auto run = [&](int steps, double beta1, double runLr, double decay = kAdamWeightDecay,
                 std::pair<int, int> skipped = {-1, -1}) {
    ReferenceRun ref(plan, *cfg, *data, /*seed=*/1, lr);
    std::map<std::pair<int, int>, Moments> ranks; // every rank's stage as created
    for (const StageInfo &st : plan.stages)
      for (int t = 0; t < 2; ++t) {
        kernels::StageCompute sc(*cfg, st.layerBegin, st.layerEnd, t, 2, /*seed=*/1, slicesOf(plan),
                                 lossScaleOf(plan, *cfg));
        Moments &r = ranks[{st.stage, t}];
        r.w.assign(sc.params().begin(), sc.params().end());
        r.m.assign(r.w.size(), 0.0);
        r.v.assign(r.w.size(), 0.0);
      }
    for (int s = 0; s < steps; ++s) {
      ParamSnapshot g;
      gradients(s, g);
      ref.adopt(g);
      ref.update();
      const double beta2 = kAdamBeta2, eps = kAdamEps;
      for (auto &[key, r] : ranks) {
        if (key == skipped)
          continue;
        const std::vector<float> &gk = g.byStageAndTp.at(key);
        for (size_t k = 0; k < r.w.size(); ++k) {
          r.w[k] *= 1.0 - runLr * decay;
          r.m[k] = beta1 * r.m[k] + (1.0 - beta1) * gk[k];
          r.v[k] = beta2 * r.v[k] + (1.0 - beta2) * double(gk[k]) * gk[k];
          const double mHat = r.m[k] / (1.0 - std::pow(beta1, s + 1));
          const double vHat = r.v[k] / (1.0 - std::pow(beta2, s + 1));
          r.w[k] -= runLr * mHat / (std::sqrt(vHat) + eps);
        }
      }
    }
    ParamSnapshot weights;
    for (auto &[key, r] : ranks)
      weights.byStageAndTp[key].assign(r.w.begin(), r.w.end());
    return std::pair{ref.compareWeights(weights, steps), weights.byStageAndTp};
  };

  // (Not a structured binding: clang 14, --config=layering's, cannot capture one in a lambda.)
  auto textbookRun = run(2, kAdamBeta1, lr);
  auto &textbook = textbookRun.first;
  auto &textbookWeights = textbookRun.second;
  EXPECT_EQ(textbook.steps, 2);
  EXPECT_LT(textbook.maxRatio, 0.1) << weightCheckReport(textbook);
  EXPECT_FALSE(bool(judgeWeightCheck(textbook)));

  EXPECT_LT(run(1, 0.89, lr).first.maxRatio, 0.1) << "one step does not depend on beta1";
  const WeightCheck beta1 = run(2, 0.89, lr).first;
  EXPECT_GT(beta1.maxRatio, 2.0);
  EXPECT_EQ(beta1.worst.step, 1);
  EXPECT_EQ(errorText(judgeWeightCheck(beta1))
                .rfind("after 2 AdamW step(s) on the same gradients, "
                       "the weight ",
                       0),
            0u);
  const WeightCheck lrOff = run(1, kAdamBeta1, 1.005 * lr).first;
  EXPECT_GT(lrOff.maxRatio, 2.0) << weightCheckReport(lrOff);
  const WeightCheck decayed = run(1, kAdamBeta1, lr, /*decay=*/0.1).first;
  EXPECT_GT(decayed.maxRatio, 2.0) << weightCheckReport(decayed);
  for (int t = 0; t < 2; ++t) { // (tp rank 0: seen in its parts of the split tensors)
    const WeightCheck skipped = run(1, kAdamBeta1, lr, kAdamWeightDecay, {1, t}).first;
    EXPECT_GT(skipped.maxRatio, 2.0) << weightCheckReport(skipped);
    EXPECT_EQ(skipped.worst.stage, 1);
    EXPECT_EQ(skipped.worst.tpRank, t);
  }

  // Planted differences, against a reference after the same two steps.
  ReferenceRun fresh(plan, *cfg, *data, /*seed=*/1, lr);
  for (int s = 0; s < 2; ++s) {
    ParamSnapshot g;
    gradients(s, g);
    fresh.adopt(g);
    fresh.update();
  }
  const StageInfo &last = plan.stages[1];
  auto planted = [&](int tpRank, size_t at, float value) {
    ParamSnapshot weights;
    weights.byStageAndTp = textbookWeights;
    weights.byStageAndTp[{last.stage, tpRank}][at] = value;
    return fresh.compareWeights(weights, 2);
  };
  // Stage 1's first block: ln1.w (whole on both tp ranks) begins it, qkv.w's rows follow the
  // two layernorm vectors (hidden 16; a tp rank holds 24 of its 48 columns).
  const size_t ln1w2 = 2, qkvW = 2 * 16;
  // A NaN weight: infinitely far off, named.
  const WeightCheck nan = planted(1, ln1w2, NAN);
  EXPECT_EQ(nan.maxRatio, INFINITY);
  EXPECT_EQ(nan.worst.stage, last.stage);
  EXPECT_EQ(nan.worst.tpRank, 1);
  EXPECT_EQ(nan.worst.layer, last.layerBegin);
  EXPECT_EQ(nan.worst.param, "ln1.w[2]");
  EXPECT_NE(weightCheckReport(nan).find(fmt::format(
                "max_weight_diff=inf of its bound after 2 AdamW step(s) (bound: 1e-3 of lr, plus "
                "per step 1e-5 of lr and 2^-20 of the weight): step 1, stage 1 (tp rank 1), layer "
                "{}, ln1.w[2]: nan against the reference's ",
                last.layerBegin)),
            std::string::npos)
      << weightCheckReport(nan);
  EXPECT_NE(errorText(judgeWeightCheck(nan))
                .find(fmt::format("the weight ln1.w[2] (layer {}, stage 1, tp rank 1) is nan where "
                                  "the single-rank reference's is ",
                                  last.layerBegin)),
            std::string::npos)
      << errorText(judgeWeightCheck(nan));
  // Tensors whole on every tp rank are held to the reference on the rank whose gradients it
  // took, the last; tp rank 0's copies stepped on their own sums, and must equal the last
  // rank's to the last bit (or be infinitely far off). Its own parts of the split tensors are
  // held to the reference.
  EXPECT_EQ(textbook.tp, 2);
  EXPECT_LT(textbook.tpCopy.step, 0) << weightCheckReport(textbook);
  EXPECT_NE(weightCheckReport(textbook).find("tp_copies=identical (the 2 tp ranks' copies of "
                                             "every tensor they hold whole, bit for bit)\n"),
            std::string::npos)
      << weightCheckReport(textbook);
  const float ln1 = textbookWeights.at({last.stage, 0})[ln1w2];
  const WeightCheck drifted = planted(0, ln1w2, std::nextafter(ln1, INFINITY)); // one ulp
  EXPECT_EQ(drifted.maxRatio, textbook.maxRatio);
  EXPECT_EQ(drifted.tpCopy.step, 1);
  EXPECT_EQ(drifted.tpCopy.stage, last.stage);
  EXPECT_EQ(drifted.tpCopy.tpRank, 0);
  EXPECT_EQ(drifted.tpCopy.layer, last.layerBegin);
  EXPECT_EQ(drifted.tpCopy.param, "ln1.w[2]");
  EXPECT_EQ(drifted.tpCopy.want, textbookWeights.at({last.stage, 1})[ln1w2]);
  EXPECT_NE(weightCheckReport(drifted).find(fmt::format("tp_copies=differ: stage 1, layer {}, "
                                                        "ln1.w[2]: tp rank 0 holds ",
                                                        last.layerBegin)),
            std::string::npos)
      << weightCheckReport(drifted);
  EXPECT_EQ(errorText(judgeWeightCheck(drifted))
                .rfind(fmt::format("after 2 AdamW step(s), tp ranks 0 and 1 hold different "
                                   "copies of the weight ln1.w[2] (layer {}, stage 1), which "
                                   "every tp rank holds whole: ",
                                   last.layerBegin),
                       0),
            0u)
      << errorText(judgeWeightCheck(drifted));
  EXPECT_EQ(planted(0, ln1w2, INFINITY).maxRatio, INFINITY);
  // A split tensor's halves differ between the ranks, as they should: no tp finding.
  EXPECT_LT(planted(0, qkvW + 3, textbookWeights.at({last.stage, 0})[qkvW + 3]).tpCopy.step, 0);
  const WeightCheck mine =
      planted(0, qkvW + 3, textbookWeights.at({last.stage, 0})[qkvW + 3] + 1e-4f);
  EXPECT_GT(mine.maxRatio, 50.0);
  EXPECT_EQ(mine.worst.tpRank, 0);
  EXPECT_EQ(mine.worst.param, "qkv.w[0, 3]");
  const WeightCheck last1 = planted(1, ln1w2, textbookWeights.at({last.stage, 1})[ln1w2] + 1e-4f);
  EXPECT_GT(last1.maxRatio, 20.0);
  EXPECT_EQ(last1.worst.param, "ln1.w[2]");
}

// The dp replicas must hold the same weights bit for bit: each replica's digest (the backends
// take one per stage and tp rank) against replica 0's weights. A replica whose weights differ
// in one bit, or that reported none, is named.
TEST(ReferenceRunTest, EveryDpReplicaMustHoldReplicaZerosWeights) {
  const Plan plan =
      compileOrFail(tinyGpt(/*tied=*/false, /*layers=*/6),
                    options("1f1b", /*pp=*/2, /*microbatches=*/2, 1, 1, /*tp=*/2, /*dp=*/3));
  auto cfg = gptConfigOf(plan);
  ASSERT_TRUE(bool(cfg)) << takeMessage(cfg.takeError());
  auto data = syntheticData(32, /*seed=*/7);
  ReferenceRun ref(plan, *cfg, *data, /*seed=*/1, /*lr=*/1e-3f);
  ParamSnapshot weights;
  fillShardedSnapshot(plan, *cfg, weights,
                      [](int l, size_t k) { return 0.01f * float((k * 5 + size_t(l)) % 17); });
  auto digestsOf = [&](int replica, const ParamSnapshot &from, ParamSnapshot &into) {
    for (const auto &[key, w] : from.byStageAndTp)
      into.digests[{replica, key.first, key.second}] = weightDigest(w);
  };
  for (int d = 0; d < 3; ++d)
    digestsOf(d, weights, weights);
  const WeightCheck same = ref.compareWeights(weights, 1);
  EXPECT_EQ(same.dp, 3);
  EXPECT_LT(same.dpCopy.replica, 0);
  EXPECT_NE(weightCheckReport(same).find(
                "\ndp_copies=identical (the 3 dp replicas' weights, bit for bit)\n"),
            std::string::npos)
      << weightCheckReport(same);

  // Replica 2's stage 1, tp rank 0 is one ulp off in one weight.
  ParamSnapshot off;
  off.byStageAndTp = weights.byStageAndTp;
  float &w = off.byStageAndTp.at({1, 0})[7];
  w = std::nextafter(w, INFINITY);
  ParamSnapshot planted;
  planted.byStageAndTp = weights.byStageAndTp;
  planted.digests = weights.digests;
  planted.digests[{2, 1, 0}] = weightDigest(off.byStageAndTp.at({1, 0}));
  const WeightCheck differ = ref.compareWeights(planted, 1);
  EXPECT_EQ(differ.dpCopy.replica, 2);
  EXPECT_EQ(differ.dpCopy.stage, 1);
  EXPECT_EQ(differ.dpCopy.tpRank, 0);
  EXPECT_NE(weightCheckReport(differ).find("\ndp_copies=differ: dp replica 2's weights of stage 1 "
                                           "(tp rank 0) are not replica 0's\n"),
            std::string::npos)
      << weightCheckReport(differ);
  // A replica that reported nothing for a stage fails the same way.
  ParamSnapshot missing;
  missing.byStageAndTp = weights.byStageAndTp;
  missing.digests = weights.digests;
  missing.digests.erase({1, 0, 1});
  const WeightCheck absent = ref.compareWeights(missing, 1);
  EXPECT_EQ(absent.dpCopy.replica, 1);
  EXPECT_EQ(absent.dpCopy.stage, 0);
  EXPECT_EQ(absent.dpCopy.tpRank, 1);
  EXPECT_TRUE(absent.dpCopy.missing);
  EXPECT_FALSE(differ.dpCopy.missing);
  // (A failed process's replica is not said to hold other weights: it reported none.)
  EXPECT_NE(weightCheckReport(absent).find("\ndp_copies=differ: dp replica 1 reported no weights "
                                           "of stage 0 (tp rank 1); its process failed"),
            std::string::npos)
      << weightCheckReport(absent);
  WeightCheck onlyAbsent = absent; // (the planted weights here are not the reference's)
  onlyAbsent.maxRatio = 0.5;
  const std::string absentVerdict = takeMessage(judgeWeightCheck(onlyAbsent));
  EXPECT_NE(absentVerdict.find("dp replica 1 reported no weights of stage 0 (tp rank 1)"),
            std::string::npos)
      << absentVerdict;

  // The digest tells bits apart: one ulp, the sign of zero, and the order of the values.
  const std::vector<float> v{0.5f, -1.25f, 3.0f};
  EXPECT_EQ(weightDigest(v), weightDigest(std::vector<float>{0.5f, -1.25f, 3.0f}));
  EXPECT_NE(weightDigest(v),
            weightDigest(std::vector<float>{0.5f, -1.25f, std::nextafter(3.0f, 4.0f)}));
  EXPECT_NE(weightDigest(v), weightDigest(std::vector<float>{-1.25f, 0.5f, 3.0f}));
  EXPECT_NE(weightDigest(std::vector<float>{0.0f}), weightDigest(std::vector<float>{-0.0f}));
}

// What piperun prints and decides from a GradCheck (judgeGradCheck, gradCheckReport).
TEST(ReferenceRunTest, TheVerdictNamesTheToleranceAndTheTensor) {
  auto passes = [](llvm::Error err) {
    if (!err)
      return true;
    ADD_FAILURE() << takeMessage(std::move(err));
    return false;
  };
  GradCheck g;
  g.scale = 0.5;
  EXPECT_EQ(gradCheckReport(g), "max_abs_grad_diff=0.000e+00 (largest reference gradient "
                                "5.000e-01)\nmax_tensor_grad_diff=0.000e+00 (of the tensor's "
                                "largest reference gradient)\n");
  EXPECT_TRUE(passes(judgeGradCheck(g, 1e-5, 1e-3)));

  g.maxAbsDiff = 4e-6; // 8e-6 of the scale: under 1e-5
  g.worst = GradDiffPlace{3, 1, 0, 4, "qkv.w[2, 5]", 0.25, 0.250004};
  g.maxTensorDiff = 2e-3; // over 1e-3 of the tensor's own
  g.worstTensor = GradDiffPlace{2, 0, 1, 1, "ln1.b[7]", -1e-3, 1e-3};
  const std::string report = gradCheckReport(g);
  EXPECT_NE(report.find("largest difference: step 3, stage 1 (tp rank 0), layer 4, qkv.w[2, 5]: "
                        "2.500000e-01 against the reference's 2.500040e-01\n"),
            std::string::npos)
      << report;
  EXPECT_NE(report.find("max_tensor_grad_diff=2.000e-03 (of the tensor's largest reference "
                        "gradient): step 2, stage 0 (tp rank 1), layer 1, ln1.b[7]"),
            std::string::npos)
      << report;
  EXPECT_EQ(errorText(judgeGradCheck(g, 1e-5, 1e-3)),
            "the gradient of ln1.b (layer 1, stage 0, tp rank 1) differs from the single-rank "
            "reference by 2.000e-03 of the tensor's largest reference gradient, more than 0.001");
  EXPECT_TRUE(passes(judgeGradCheck(g, 1e-5, 0.15))); // bf16's per-tensor bound

  g.maxAbsDiff = INFINITY;
  g.worst.got = NAN;
  EXPECT_EQ(errorText(judgeGradCheck(g, 1e-5, 0.15)),
            "gradients differ from the single-rank reference by inf, more than 1e-5 of the "
            "gradient scale (5.000e-06) (the run's gradient there is NaN)");

  // piperun's report and verdict: the weights after the gradients; the gradients' finding first.
  GradCheck same;
  same.scale = 0.5;
  WeightCheck w;
  w.steps = 3;
  EXPECT_EQ(referenceCheckReport(same, w),
            gradCheckReport(same) + "max_weight_diff=0.000e+00 of its bound after 3 AdamW step(s) "
                                    "(bound: 1e-3 of lr, plus per step 1e-5 of lr and 2^-20 of "
                                    "the weight)\n");
  EXPECT_TRUE(passes(judgeReferenceCheck(same, w, 1e-5, 1e-3)));
  w.maxRatio = 2.5;
  w.diff = 2.5e-6;
  w.bound = 1e-6;
  w.worst = GradDiffPlace{2, 1, 0, 4, "fc.b[3]", 1.25e-3, 1.2475e-3};
  EXPECT_EQ(weightCheckReport(w),
            "max_weight_diff=2.500e+00 of its bound after 3 AdamW step(s) (bound: 1e-3 of lr, plus "
            "per step 1e-5 of lr and 2^-20 of the weight): step 2, stage 1 (tp rank 0), layer 4, "
            "fc.b[3]: 1.250000e-03 against the reference's 1.247500e-03 (2.500e-06 apart, bound "
            "1.000e-06)\n");
  const std::string weightsFinding =
      "after 3 AdamW step(s) on the same gradients, the weight fc.b[3] (layer 4, stage 1, tp "
      "rank 0) is 1.250000e-03 where the single-rank reference's is 1.247500e-03: 2.500e-06 "
      "apart, more than its bound 1.000e-06 (1e-3 of lr, plus per step 1e-5 of lr and 2^-20 of "
      "the weight): the run's optimizer steps differ from the reference's";
  EXPECT_EQ(errorText(judgeWeightCheck(w)), weightsFinding);
  EXPECT_EQ(errorText(judgeReferenceCheck(same, w, 1e-5, 1e-3)), weightsFinding);
  EXPECT_EQ(errorText(judgeReferenceCheck(g, w, 1e-5, 0.15)),
            errorText(judgeGradCheck(g, 1e-5, 0.15)));

  // The dp replicas' weights, when the bound holds.
  WeightCheck replicas;
  replicas.steps = 2;
  replicas.dp = 2;
  replicas.dpCopy = {1, 0, 1};
  EXPECT_EQ(errorText(judgeWeightCheck(replicas)),
            "after 2 AdamW step(s), dp replica 1's weights of stage 0 (tp rank 1) differ from "
            "replica 0's; every replica must take the same steps from the same all-reduced "
            "gradients (a tensor left out of the dp all-reduce, or a replica that stepped "
            "differently)");
  replicas.dpCopy = {};
  EXPECT_TRUE(passes(judgeWeightCheck(replicas)));
}

} // namespace
} // namespace pipec::test
