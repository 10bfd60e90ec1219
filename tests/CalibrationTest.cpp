//===- CalibrationTest.cpp - The shipped cluster specs against published runs -------===//
//
// bench/data/published-runs.csv (docs/calibration-sources.md): measured training throughput
// of other people's runs, compiled here exactly as published with the shipped, calibrated
// cluster specs. The bounds are the in-sample errors calibration_bench reports for those specs
// with a margin; the zero-bubble ordering is the paper's measurement, not ours.
//
//===----------------------------------------------------------------------===//
#include "bench/Calibration.h"
#include "compiler/Pass.h"
#include "ir/CostModel.h"
#include "ir/formats/PlanJson.h"
#include "ir/formats/SpecJson.h"
#include "ir/support/Error.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <set>

namespace pipec {
namespace {

struct Loaded {
  std::vector<PublishedRun> runs;
  std::vector<SkippedRow> skipped;
};

const Loaded &published() {
  static Loaded l = [] {
    Loaded out;
    if (auto err = loadPublishedRuns("bench/data/published-runs.csv", out.runs, out.skipped))
      ADD_FAILURE() << takeMessage(std::move(err));
    return out;
  }();
  return l;
}

ClusterSpec spec(const char *path) {
  auto c = loadClusterSpec(path);
  EXPECT_TRUE(bool(c)) << takeMessage(c.takeError());
  return c ? *c : ClusterSpec::defaults();
}

const PublishedRun &runNamed(llvm::StringRef id) {
  for (const PublishedRun &r : published().runs)
    if (r.id == id)
      return r;
  ADD_FAILURE() << "no run " << id.str();
  return published().runs.front();
}

TEST(CalibrationTest, TheDataFileHoldsEverySourceWithItsRuns) {
  const Loaded &l = published();
  std::map<std::string, int> bySource;
  for (const PublishedRun &r : l.runs) {
    ++bySource[r.source];
    EXPECT_GT(r.measuredSeconds, 0) << r.id;
  }
  // Six A100 sources and four H100 ones, each with runs that compile as published.
  for (const char *s :
       {"narayanan2021_sc21", "korthikanti2022", "qi2024_zerobubble", "smith2022_mtnlg",
        "bigscience_bloom176b", "sun2024_seq1f1b", "dubey2024_llama3", "nvidia_nemo_perf_2407",
        "nvidia_dgxc_benchmarking", "nvidia_nemo_longseq_2403"})
    EXPECT_GT(bySource[s], 0) << s;
  // NeMo's long-sequence table: the three lengths (4K, 8K, 16K) it ran without context
  // parallelism and the six (32K to 1M) it ran with it.
  EXPECT_EQ(bySource["nvidia_nemo_longseq_2403"], 9);
  EXPECT_EQ(runNamed("LS-1024K-1024gpu-cp32").options.parallel.cp, 32);
  EXPECT_EQ(bySource["qi2024_zerobubble"], 66);
  // The Seq1F1B table's 20 cells that ran, less one whose two metrics disagree (left out).
  EXPECT_EQ(bySource["sun2024_seq1f1b"], 19);
  // BF16 and FP8 runs of one layout are two runs (the DGX Cloud recipes publish both).
  EXPECT_EQ(bySource["nvidia_dgxc_benchmarking"], 20);
  EXPECT_TRUE(runNamed("GPT3-175B-fp8-128gpu").fp8);
  EXPECT_FALSE(runNamed("GPT3-175B-bf16-128gpu").fp8);
  // Runs with context parallelism are predicted (NeMo's Llama 3 8B and 70B at cp 2); Llama 3's
  // 128K-token stage is left out: its published layout (tp 8, cp 16, pp 16, dp 4: 8,192 GPUs)
  // does not multiply out to the 16,384 GPUs it names. Every row left out says why.
  EXPECT_EQ(runNamed("LLAMA3-8B-8gpu-tok").options.parallel.cp, 2);
  EXPECT_EQ(runNamed("LLAMA3-70B-64gpu-tok").options.parallel.cp, 2);
  EXPECT_EQ(bySource["nvidia_nemo_perf_2407"], 12);
  bool stage3 = false;
  for (const SkippedRow &s : l.skipped) {
    EXPECT_FALSE(s.why.empty()) << s.id;
    stage3 |= s.id == "T4-3-tflops" && s.why.find("does not multiply out") != std::string::npos;
  }
  EXPECT_TRUE(stage3);
}

TEST(CalibrationTest, RunsCompileWithTheirPublishedSplit) {
  // Qi et al. 2024: 22 layers on 8 ranks, the first and last rank holding one layer fewer (the
  // embedding and the head take their place), and interleaved 1F1B with one layer per chunk.
  ClusterSpec c = spec("examples/a100-selene.json");
  auto plain = compilePlan(runNamed("T4-1.5B-m24-1F1B").model, c,
                           runNamed("T4-1.5B-m24-1F1B").options, /*verifyEach=*/true);
  ASSERT_TRUE(bool(plain)) << takeMessage(plain.takeError());
  ASSERT_EQ(plain->stages.size(), 8u);
  for (const StageInfo &st : plain->stages) {
    EXPECT_EQ(st.layerEnd - st.layerBegin, 3) << st.stage; // embedding + 2 blocks, 3 blocks...
    EXPECT_EQ(st.layerBegin, 3 * st.stage);
  }
  const PublishedRun &inter = runNamed("T4-1.5B-m24-1F1B-I");
  EXPECT_EQ(inter.options.parallel.vpp, 3);
  auto interleaved = compilePlan(inter.model, c, inter.options, /*verifyEach=*/true);
  ASSERT_TRUE(bool(interleaved)) << takeMessage(interleaved.takeError());
  ASSERT_EQ(interleaved->stages.size(), 24u);
  for (const StageInfo &st : interleaved->stages)
    EXPECT_EQ(st.layerEnd - st.layerBegin, 1) << st.stage;
  // Megatron-LM's uniform split: 96 blocks over 8 x 3 stages, the embedding with the first and
  // the head with the last (Korthikanti et al. 2022, 175B).
  const PublishedRun &mega = runNamed("T5-175B-sel");
  auto m = compilePlan(mega.model, c, mega.options, /*verifyEach=*/false);
  ASSERT_TRUE(bool(m)) << takeMessage(m.takeError());
  ASSERT_EQ(m->stages.size(), 24u);
  EXPECT_EQ(m->stages.front().layerEnd, 5);
  EXPECT_EQ(m->stages.back().layerBegin, 93);
  // A split that does not fit the stages is refused with one line.
  CompileOptions bad = runNamed("T4-1.5B-m24-1F1B").options;
  bad.stageEnds = {3, 6, 9, 12, 15, 18, 21, 23};
  auto refused = compilePlan(runNamed("T4-1.5B-m24-1F1B").model, c, bad, false);
  ASSERT_FALSE(bool(refused));
  EXPECT_NE(takeMessage(refused.takeError()).find("the last 24"), std::string::npos);
}

TEST(CalibrationTest, PartitionEvenIsTheMegatronSplitOfThePublishedRuns) {
  // compile's --partition even (CompileOptions::evenPartition) is the split calibration gives
  // the runs whose software splits blocks evenly: the same stages and the same step.
  ClusterSpec h100 = spec("examples/h100-nemo.json");
  for (const char *id :
       {"LLAMA2-70B-64gpu-tok", "NEMOTRON-22B-64gpu-tok", "GPT3-175B-bf16-128gpu"}) {
    SCOPED_TRACE(id);
    const PublishedRun &r = runNamed(id);
    ASSERT_FALSE(r.options.stageEnds.empty());
    CompileOptions even = r.options;
    even.stageEnds.clear();
    even.evenPartition = true;
    const ClusterSpec c = clusterFor(r, h100);
    auto published = compilePlan(r.model, c, r.options, false);
    auto plan = compilePlan(r.model, c, even, false);
    ASSERT_TRUE(published && plan);
    ASSERT_EQ(plan->stages.size(), published->stages.size());
    for (size_t s = 0; s < plan->stages.size(); ++s)
      EXPECT_EQ(plan->stages[s].layerEnd, published->stages[s].layerEnd);
    EXPECT_DOUBLE_EQ(plan->stats.stepTime, published->stats.stepTime);
  }
}

TEST(CalibrationTest, MegatronTransfersHoldTheSender) {
  const PublishedRun &r = runNamed("T5-175B-full"); // tp 8, no sequence parallelism
  ClusterSpec overlapped = spec("examples/a100-selene.json");
  overlapped.p2p = P2p::Overlapped;
  ClusterSpec megatron = overlapped;
  megatron.p2p = P2p::Megatron;
  auto a = compilePlan(r.model, overlapped, r.options, false);
  auto b = compilePlan(r.model, megatron, r.options, false);
  ASSERT_TRUE(a && b);
  // Stage 0 sends its activation to stage 1 on another rank: overlapped, the transfer only
  // delays the receiver; Megatron's synchronous send is part of the forward, and without
  // sequence parallelism each of the 8 tp ranks sends an eighth and the receivers all-gather.
  const StageInfo &sa = a->stages[0], &sb = b->stages[0];
  ASSERT_GT(sa.activationTransferTime[0], 0);
  EXPECT_EQ(sb.activationTransferTime[0], 0);
  double added = sb.forward[0] - sa.forward[0];
  EXPECT_GT(added, 0);
  const Link &inter = overlapped.interNode; // stage 0 and 1 are 8 x 1 GPUs apart: other nodes
  double bytes = double(sa.outputBytes[0]);
  double expected = (inter.latencyUs + overlapped.messageOverheadUs) / 1000 +
                    megatron.p2pSyncUs / 1000 + bytes / 8 / inter.bytesPerMs() +
                    (overlapped.intraNode.latencyUs + overlapped.messageOverheadUs) / 1000 +
                    7.0 / 8 * bytes / overlapped.intraNode.bytesPerMs();
  EXPECT_NEAR(added, expected, 1e-9 * expected);
  EXPECT_GT(b->stats.stepTime, 0);
  // The field reads and is checked.
  auto parsed = parseClusterSpec(R"({"format": "pipecluster/1", "p2p": "megatron"})", "c.json");
  ASSERT_TRUE(bool(parsed)) << takeMessage(parsed.takeError());
  EXPECT_EQ(parsed->p2p, P2p::Megatron);
  auto wrong = parseClusterSpec(R"({"format": "pipecluster/1", "p2p": "sync"})", "c.json");
  ASSERT_FALSE(bool(wrong));
  EXPECT_EQ(takeMessage(wrong.takeError()),
            "c.json: $.p2p: expected \"megatron\", \"blocking\" or \"overlapped\", got \"sync\"");
}

TEST(CalibrationTest, ASynchronousTransferAlsoPaysItsDeviceSync) {
  // p2p_sync_us: Megatron-LM synchronises the device after every batch of pipeline sends and
  // receives (batch_p2p_sync), so each of its transfers costs the op that sends it that much
  // more; DeepSpeed's and overlapped transfers and the tp collectives do not pay it.
  const PublishedRun &r = runNamed("T5-175B-full"); // tp 8, pp 8, 3 chunks per rank
  ClusterSpec base = spec("examples/a100-selene.json");
  base.p2pSyncUs = 0;
  base.p2p = P2p::Megatron;
  ClusterSpec synced = base;
  synced.p2pSyncUs = 250;
  auto a = compilePlan(r.model, base, r.options, false);
  auto b = compilePlan(r.model, synced, r.options, false);
  ASSERT_TRUE(a && b);
  const StageInfo &first = a->stages[0], &firstSynced = b->stages[0];
  EXPECT_NEAR(firstSynced.forward[0] - first.forward[0], 0.25, 1e-9);
  // A middle stage sends both ways: its forward and its input-gradient backward pay one each.
  const StageInfo &mid = a->stages[3], &midSynced = b->stages[3];
  EXPECT_NEAR(midSynced.forward[0] - mid.forward[0], 0.25, 1e-9);
  EXPECT_NEAR(midSynced.backwardInput[0] - mid.backwardInput[0], 0.25, 1e-9);
  EXPECT_DOUBLE_EQ(midSynced.tpAllReduceTime[0], mid.tpAllReduceTime[0]);
  EXPECT_DOUBLE_EQ(midSynced.backwardWeight[0], mid.backwardWeight[0]);
  EXPECT_GT(b->stats.stepTime, a->stats.stepTime);
  // DeepSpeed's blocking transfers (plain NCCL sends and receives) and overlapped ones never
  // synchronise the device.
  for (P2p mode : {P2p::Blocking, P2p::Overlapped}) {
    SCOPED_TRACE(toString(mode).str());
    base.p2p = synced.p2p = mode;
    auto c = compilePlan(r.model, base, r.options, false);
    auto d = compilePlan(r.model, synced, r.options, false);
    ASSERT_TRUE(c && d);
    for (size_t s = 0; s < c->stages.size(); ++s) {
      const StageInfo &x = c->stages[s], &y = d->stages[s];
      EXPECT_DOUBLE_EQ(x.forward[0], y.forward[0]) << s;
      EXPECT_DOUBLE_EQ(x.backwardInput[0], y.backwardInput[0]) << s;
      EXPECT_DOUBLE_EQ(x.activationTransferTime[0], y.activationTransferTime[0]) << s;
      EXPECT_DOUBLE_EQ(x.gradientTransferTime[0], y.gradientTransferTime[0]) << s;
    }
    EXPECT_DOUBLE_EQ(c->stats.stepTime, d->stats.stepTime);
  }
  // The field reads, and a negative value is refused with its path.
  auto parsed = parseClusterSpec(R"({"format": "pipecluster/1", "p2p_sync_us": 120})", "c.json");
  ASSERT_TRUE(bool(parsed)) << takeMessage(parsed.takeError());
  EXPECT_DOUBLE_EQ(parsed->p2pSyncUs, 120);
  auto negative = parseClusterSpec(R"({"format": "pipecluster/1", "p2p_sync_us": -1})", "c.json");
  ASSERT_FALSE(bool(negative));
  EXPECT_NE(takeMessage(negative.takeError()).find("$.p2p_sync_us"), std::string::npos);
}

TEST(CalibrationTest, BlockingTransfersAlsoWaitForTheReceiver) {
  // "p2p": "blocking" (DeepSpeed's pipeline engine): Megatron's synchronous transfers, and
  // every send and receive also waits for its partner, so step_time is the executed step of
  // the streams (the rendezvous rule piperun runs), never below the Megatron-mode step.
  const PublishedRun &r = runNamed("S2.4-280n-time"); // MT-NLG: 1f1b, tp 8, pp 35
  ClusterSpec megatron = spec("examples/a100-selene.json");
  megatron.p2p = P2p::Megatron;
  // Megatron-LM's device synchronisation per transfer is its own (tested above).
  megatron.p2pSyncUs = 0;
  ClusterSpec blocking = megatron;
  blocking.p2p = P2p::Blocking;
  EXPECT_TRUE(blocking.synchronousP2p() && megatron.synchronousP2p());
  auto a = compilePlan(r.model, megatron, r.options, false);
  auto b = compilePlan(r.model, blocking, r.options, false);
  ASSERT_TRUE(a && b);
  EXPECT_FALSE(a->blockingP2p);
  EXPECT_TRUE(b->blockingP2p);
  // The same per-op times (the transfers inside the ops that send them) ...
  for (size_t s = 0; s < a->stages.size(); ++s) {
    EXPECT_DOUBLE_EQ(a->stages[s].forward[0], b->stages[s].forward[0]) << s;
    EXPECT_DOUBLE_EQ(a->stages[s].backwardInput[0], b->stages[s].backwardInput[0]) << s;
  }
  // ... and the same timeline, but the step is the executed one, plus the check before the
  // optimizer step (1f1b does not post-validate).
  EXPECT_DOUBLE_EQ(a->stats.makespan, b->stats.makespan);
  auto executed = simulateExecutedStep(*b);
  ASSERT_TRUE(bool(executed)) << takeMessage(executed.takeError());
  EXPECT_DOUBLE_EQ(b->stats.stepTime, *executed + b->optimizerSyncTime);
  EXPECT_GT(b->stats.stepTime, a->stats.stepTime);
  // The data file runs MT-NLG and BLOOM (DeepSpeed) blocking, Megatron-LM's runs not.
  EXPECT_EQ(r.p2p, P2p::Blocking);
  EXPECT_EQ(runNamed("log-it85376-time").p2p, P2p::Blocking);
  EXPECT_FALSE(runNamed("T5-530B-full").p2p.has_value());
  // The spec field, and the plan file keeps it.
  auto parsed = parseClusterSpec(R"({"format": "pipecluster/1", "p2p": "blocking"})", "c.json");
  ASSERT_TRUE(bool(parsed)) << takeMessage(parsed.takeError());
  EXPECT_EQ(parsed->p2p, P2p::Blocking);
  std::string text;
  llvm::raw_string_ostream os(text);
  writePlanJson(*b, os);
  auto back = parsePlanJson(text, "b.json");
  ASSERT_TRUE(bool(back)) << takeMessage(back.takeError());
  EXPECT_TRUE(back->blockingP2p);
}

TEST(CalibrationTest, ARunsOwnGradientReductionOverridesTheSpecs) {
  // Narayanan et al.'s Table 1 ran PyTorch DDP up to 18B (gradients reduced during the
  // backward) and Megatron-LM's local DDP from 39B (reduced after it): the data file's
  // grad_reduce column, applied over the spec's rule for that run only.
  EXPECT_EQ(runNamed("T1-1").overlapGradReduce, std::optional<bool>(true));
  EXPECT_EQ(runNamed("T1-5").overlapGradReduce, std::optional<bool>(false));
  EXPECT_FALSE(runNamed("T4-1.5B-m24-1F1B").overlapGradReduce.has_value());
  const PublishedRun &r = runNamed("T1-5"); // 39B: tp 8, pp 2, dp 32
  ClusterSpec overlapped = spec("examples/a100-selene.json");
  overlapped.overlapGradReduce = true;
  ClusterSpec after = overlapped;
  after.overlapGradReduce = false;
  EXPECT_FALSE(clusterFor(r, overlapped).overlapGradReduce);
  EXPECT_TRUE(clusterFor(r, after).overlapGradReduce == false &&
              clusterFor(runNamed("T1-1"), after).overlapGradReduce);
  EXPECT_FALSE(clusterFor(runNamed("T4-1.5B-m24-1F1B"), after).overlapGradReduce);
  // The run predicts the same under either spec, and as the after-backward rule compiles it,
  // which is slower than the overlapped rule for its dp all-reduce of 32 ranks.
  auto a = predictSeconds(r, overlapped), b = predictSeconds(r, after);
  PublishedRun asSpec = r;
  asSpec.overlapGradReduce.reset();
  auto c = predictSeconds(asSpec, overlapped);
  ASSERT_TRUE(a && b && c);
  EXPECT_DOUBLE_EQ(*a, *b);
  EXPECT_GT(*a, *c);
}

TEST(CalibrationTest, Fp8RunsHaveFp8GemmsAndMtNlgRecomputes) {
  // The NeMo rows are FP8 (their precision column): their blocks' GEMMs, and only theirs, run
  // the spec's fp8_gemm_speedup faster; Llama 3's rows are BF16.
  const PublishedRun &fp8 = runNamed("LLAMA2-7B-8gpu-tok");
  const PublishedRun &bf16 = runNamed("T4-1-tflops");
  EXPECT_TRUE(fp8.fp8 && fp8.model.transformer->fp8Gemms);
  EXPECT_FALSE(bf16.fp8 || bf16.model.transformer->fp8Gemms);
  ClusterSpec c = spec("examples/h100-nemo.json");
  ASSERT_GT(c.fp8GemmSpeedup, 1);
  ClusterSpec none = c;
  none.fp8GemmSpeedup = 1;
  auto fast = predictSeconds(fp8, c), slow = predictSeconds(fp8, none);
  auto b1 = predictSeconds(bf16, c), b2 = predictSeconds(bf16, none);
  ASSERT_TRUE(fast && slow && b1 && b2);
  EXPECT_LT(*fast, *slow);
  EXPECT_DOUBLE_EQ(*b1, *b2);
  // MT-NLG 530B recomputes every block (Smith et al. 2022, §2.1; docs/calibration-sources.md).
  const PublishedRun &mtnlg = runNamed("S2.4-280n-time");
  EXPECT_TRUE(mtnlg.recomputePublished);
  EXPECT_EQ(mtnlg.model.transformer->recompute, Recompute::Full);
}

TEST(CalibrationTest, ARunTimedAgainIsTheRunCompiledAgain) {
  // calibration_bench fits by re-timing each run's compiled plan (bench/Calibration.h): under a
  // cluster with every factor and switch changed, the re-timed step must be the step of a
  // fresh compile, on runs of every fixed schedule, split and interconnect kind in the file
  // (searched and blocking-transfer runs, whose streams depend on the costs, are compiled again
  // instead: ThePapersSearchedSchedulesAreZbAutoUnderTheirLimits).
  ClusterSpec a = spec("examples/a100-selene.json");
  ClusterSpec b = a;
  b.achievedFraction *= 0.8;
  b.attentionFraction *= 1.5;
  b.flashAttentionFraction *= 0.7;
  b.memoryGBps *= 0.5;
  b.opOverheadUs += 40;
  b.messageOverheadUs += 30;
  b.p2pSyncUs += 70;
  b.intraNode.efficiency *= 0.6;
  b.interNode.efficiency *= 0.4;
  b.overlapGradReduce = !a.overlapGradReduce;
  int checked = 0;
  for (const char *id :
       {"T1-1", "T1-9", "T1-10", "T5-530B-sel", "T4-14.6B-m48-1F1B", "T4-28.3B-m96-1F1B-I",
        "T12-1.5B-m2-1f1b", "T5-175B-full", "T4-6.2B-m64-1F1B"}) {
    SCOPED_TRACE(id);
    auto prepared = prepareRun(runNamed(id), a);
    ASSERT_TRUE(bool(prepared)) << takeMessage(prepared.takeError());
    for (const ClusterSpec *c : {&b, &a}) {
      auto compiled = predictSeconds(runNamed(id), *c);
      auto retimed = retimedSeconds(*prepared, *c);
      ASSERT_TRUE(compiled && retimed);
      EXPECT_NEAR(*retimed, *compiled, 1e-9 * *compiled);
    }
    ++checked;
  }
  EXPECT_EQ(checked, 9);
}

TEST(CalibrationTest, ThePapersSearchedSchedulesAreZbAutoUnderTheirLimits) {
  // Qi et al. 2024, §3: ZB-1p and ZB-2p are the automatic scheduler's orders under an
  // activation limit of p·M_B and 2p·M_B. The authors' runtime sets it as
  // --zero-bubble-max-pending-backward (p or 2p) times the larger forward memory of the first
  // two stages. Each compiles as zb-auto at that limit, recomputed here from the stages of a
  // 1F1B compile of the same run; its activations stay within it, and it is never slower than
  // ZB-H1 or ZB-H2 where their own peak fits the limit.
  ClusterSpec c = spec("examples/a100-selene.json");
  int handFits = 0;
  for (const char *id :
       {"T4-1.5B-m24-ZB-1p", "T4-6.2B-m32-ZB-2p", "T12-14.6B-m8-zb-2p", "T4-28.3B-m96-ZB-1p"}) {
    SCOPED_TRACE(id);
    const PublishedRun &r = runNamed(id);
    ASSERT_EQ(r.options.schedule, "zb-auto");
    int k = llvm::StringRef(id).lower().find("zb-1p") != std::string::npos ? 1 : 2;
    EXPECT_EQ(r.searchedLimit, k);
    auto prepared = prepareRun(r, c);
    ASSERT_TRUE(bool(prepared)) << takeMessage(prepared.takeError());
    CompileOptions oneF = r.options;
    oneF.schedule = "1f1b";
    auto ref = compilePlan(r.model, c, oneF, /*verifyEach=*/false);
    ASSERT_TRUE(bool(ref)) << takeMessage(ref.takeError());
    int64_t perMicrobatch =
        std::max(ref->stages[0].activationBytes[0], ref->stages[1].activationBytes[0]);
    int64_t limit = int64_t(k) * ref->parallel.pp * perMicrobatch;
    EXPECT_LE(prepared->plan.stats.maxPeakActivationBytes(), limit);
    // The limit is the paper's p·M_B: within a microbatch of 1F1B's own peak.
    if (k == 1) {
      EXPECT_NEAR(double(limit), double(ref->stats.maxPeakActivationBytes()),
                  double(perMicrobatch));
    }
    CompileOptions fixed = r.options;
    fixed.schedule = k == 1 ? "zb-h1" : "zb-h2";
    auto hand = compilePlan(r.model, c, fixed, /*verifyEach=*/false);
    ASSERT_TRUE(bool(hand)) << takeMessage(hand.takeError());
    if (hand->stats.maxPeakActivationBytes() <= limit) {
      EXPECT_LE(prepared->plan.stats.stepTime, hand->stats.stepTime * (1 + 1e-9));
      ++handFits;
    }
    // Re-timed under the cluster it was searched under, it is the compiled run.
    auto compiled = predictSeconds(r, c);
    auto retimed = retimedSeconds(*prepared, c);
    ASSERT_TRUE(compiled && retimed);
    EXPECT_NEAR(*retimed, *compiled, 1e-9 * *compiled);
  }
  EXPECT_GE(handFits, 2); // at least the two ZB-1p runs were compared with ZB-H1
  // Searched runs and blocking ones (whose executed step depends on where the comms pass put
  // each receive, by the simulated timeline) are compiled again after each fit; the rest are
  // only re-timed.
  EXPECT_TRUE(reordersWithCosts(runNamed("T4-1.5B-m24-ZB-1p"), c));
  EXPECT_TRUE(reordersWithCosts(runNamed("S2.4-280n-time"), c));
  EXPECT_FALSE(reordersWithCosts(runNamed("T4-1.5B-m24-1F1B"), c));
  EXPECT_FALSE(reordersWithCosts(runNamed("T1-1"), c));
}

TEST(CalibrationTest, TheZeroBubbleRunsHoldThePapersMemoryRatios) {
  // Qi et al. 2024, Table 4's peak memory (GB) at the smallest m of each model: 1F1B,
  // interleaved 1F1B, ZB-1p. The rows compile without recomputation (docs/calibration-
  // sources.md: with selective recomputation, which drops the attention scores, pipec's
  // ZB-1p/1F1B ratio would be 1.17-1.49); pipec's peaks, divided by 1F1B's, against the
  // measured ratios, with the activations Megatron-LM keeps ("kept_activations": "megatron"),
  // which the authors' runtime measures when it sets ZB-1p's limit. Under piperun's own
  // accounting the weight gradient holds a larger share of a microbatch, and ZB-1p searched
  // at the authors' limit stays at 1F1B's peak on the 6.2B model (measured: 8% above it).
  struct Setting {
    const char *stem;
    double oneF, inter, zb1;
  } settings[] = {{"T4-1.5B-m24", 30, 40, 32},
                  {"T4-6.2B-m24", 39, 48, 42},
                  {"T4-14.6B-m48", 32, 39, 33},
                  {"T4-28.3B-m96", 43, 58, 44}};
  ClusterSpec c = spec("examples/a100-selene.json");
  c.megatronActivations = true;
  auto peak = [&](const std::string &id) {
    auto p = prepareRun(runNamed(id), c);
    EXPECT_TRUE(bool(p)) << id << ": " << (p ? "" : takeMessage(p.takeError()));
    return p ? double(p->plan.stats.maxPeakMemoryBytes()) : 0.0;
  };
  for (const Setting &s : settings) {
    SCOPED_TRACE(s.stem);
    std::string stem = s.stem;
    EXPECT_EQ(runNamed(stem + "-1F1B").model.transformer->recompute, Recompute::None);
    double oneF = peak(stem + "-1F1B");
    ASSERT_GT(oneF, 0);
    EXPECT_NEAR(peak(stem + "-ZB-1p") / oneF, s.zb1 / s.oneF, 0.05);
    EXPECT_NEAR(peak(stem + "-1F1B-I") / oneF, s.inter / s.oneF, 0.05);
  }
}

TEST(CalibrationTest, MegatronActivationsPredictThePapersPeakMemory) {
  // Qi et al. 2024, Table 4 reports every run's peak memory (48 runs: four models, three
  // microbatch counts, four schedules; bench/data/published-runs.csv's peak_memory_gb), which
  // no fit sees: nothing in the memory model is fitted. Megatron-LM ran them with its default
  // dropout (0.1). Under "kept_activations": "megatron" (Korthikanti et al.'s count) each
  // published peak is predicted within 10% (calibration_bench: 4.8% on average, 8.5% at
  // worst, 45 of the 48 high); under piperun's own accounting, which recomputes the
  // norms' and the activation's outputs and has no dropout, they come out a third low.
  ClusterSpec piperun = spec("examples/a100-selene.json"), megatron = piperun;
  piperun.megatronActivations = false;
  megatron.megatronActivations = true;
  int runs = 0;
  double sumMegatron = 0, sumPiperun = 0;
  for (const PublishedRun &r : published().runs) {
    if (r.measuredPeakBytes <= 0)
      continue;
    SCOPED_TRACE(r.id);
    EXPECT_GT(r.model.transformer->hiddenDropout, 0);
    auto m = prepareRun(r, megatron);
    auto p = prepareRun(r, piperun);
    ASSERT_TRUE(bool(m)) << takeMessage(m.takeError());
    ASSERT_TRUE(bool(p)) << takeMessage(p.takeError());
    double em = double(m->plan.stats.maxPeakMemoryBytes()) / r.measuredPeakBytes - 1;
    double ep = double(p->plan.stats.maxPeakMemoryBytes()) / r.measuredPeakBytes - 1;
    EXPECT_LT(std::abs(em), 0.10) << em;
    EXPECT_LT(ep, -0.15) << ep;
    sumMegatron += std::abs(em);
    sumPiperun += ep;
    ++runs;
  }
  EXPECT_EQ(runs, 48);
  EXPECT_LT(sumMegatron / runs, 0.05);
  EXPECT_LT(sumPiperun / runs, -0.25);
}

TEST(CalibrationTest, TheSeq1F1BTablesOutOfMemoryCellsAreOutOfMemory) {
  // The Seq1F1B authors' 7B table (tp 8, pp 4 on 32 A100s, docs/calibration-sources.md):
  // 1F1B and interleaved 1F1B ran at 32,768 and 65,536 tokens and ran out of memory at
  // 131,072; Seq1F1B and Seq1F1B-I ran at all three. pipec's peaks, from the rows as compiled
  // (and the 65,536-token 1F1B rows at twice the sequence), against the device's memory.
  ClusterSpec c = spec("examples/a100-selene.json");
  ASSERT_GT(c.memoryBytes, 0);
  int ran = 0;
  for (const PublishedRun &r : published().runs) {
    if (r.source != "sun2024_seq1f1b")
      continue;
    auto plan = compilePlan(r.model, clusterFor(r, c), r.options, /*verifyEach=*/false);
    ASSERT_TRUE(bool(plan)) << r.id << ": " << takeMessage(plan.takeError());
    EXPECT_LE(plan->stats.maxPeakMemoryBytes(), c.memoryBytes) << r.id;
    ++ran;
  }
  EXPECT_EQ(ran, 19);
  for (const char *id : {"7B-s64k-m8-1F1B", "7B-s64k-m8-1F1B-I"}) {
    const PublishedRun &r = runNamed(id);
    ModelSpec longer = r.model;
    TransformerConfig t = *longer.transformer;
    t.seqLength *= 2;
    longer.setTransformer(t);
    auto plan = compilePlan(longer, clusterFor(r, c), r.options, /*verifyEach=*/false);
    ASSERT_TRUE(bool(plan)) << id << ": " << takeMessage(plan.takeError());
    EXPECT_GT(plan->stats.maxPeakMemoryBytes(), c.memoryBytes) << id << " at 131072 tokens";
  }
}

/// The ids of `device`'s published runs whose layout, compiled as calibration compiles it
/// under `c`, needs more than the device's memory.
std::set<std::string> overDeviceMemory(const char *device, const ClusterSpec &c) {
  std::set<std::string> over;
  for (const PublishedRun &r : published().runs) {
    if (r.device != device)
      continue;
    auto p = prepareRun(r, c);
    EXPECT_TRUE(bool(p)) << r.id << ": " << takeMessage(p.takeError());
    if (p && p->plan.stats.maxPeakMemoryBytes() > clusterFor(r, c).memoryBytes)
      over.insert(r.id);
  }
  return over;
}

TEST(CalibrationTest, PublishedLayoutsFitTheirDevicesUnderTheirSoftwaresRule) {
  // Every published run ran, so its layout fit its 80 GB device. The H100 spec counts memory
  // as NeMo's Megatron-core and Transformer Engine layers keep it ("kept_activations":
  // "megatron"): 38 of its 43 runs fit. The five that do not are known gaps
  // (docs/planner.md, "Memory of Megatron-LM's own layers"): Llama 3 405B (its tensor-parallel
  // activations and Meta's memory optimizations are not published) and Nemotron-4 340B at dp 2
  // (its recipe's gradients in BF16, which pipec keeps in FP32). Under piperun's rule, which
  // keeps a fused backward's weight-gradient state for the whole stage, 14 do not
  // (calibration_bench lists them).
  ClusterSpec h100 = spec("examples/h100-nemo.json");
  EXPECT_TRUE(h100.megatronActivations);
  EXPECT_EQ(overDeviceMemory("H100-SXM", h100),
            (std::set<std::string>{"T4-1-tflops", "T4-2-tflops", "NEMOTRON-340B-128gpu-tok",
                                   "NEMOTRON4-340B-bf16-128gpu", "NEMOTRON4-340B-fp8-128gpu"}));
  // Every A100 source ran Megatron-LM's layers (or DeepSpeed's copy of them): under its rule all
  // 106 layouts fit; under piperun's, which the A100 spec keeps (docs/planner.md), Narayanan et
  // al.'s four smallest and Korthikanti et al.'s 22B with full recomputation do not.
  ClusterSpec a100 = spec("examples/a100-selene.json");
  EXPECT_FALSE(a100.megatronActivations);
  EXPECT_EQ(overDeviceMemory("A100-80GB", a100),
            (std::set<std::string>{"T1-1", "T1-2", "T1-3", "T1-4", "T5-22B-full"}));
  a100.megatronActivations = true;
  EXPECT_EQ(overDeviceMemory("A100-80GB", a100), std::set<std::string>{});
}

TEST(CalibrationTest, NeMosFlopCountTurnsItsTflopsIntoItsOwnTokensPerSecond) {
  // NeMo's 24.07 summary publishes its LLAMA2-7B run (8 H100s, 4K tokens, batch 128) both as
  // 16,847 tokens/s/GPU and as 776 model TFLOP/s/GPU, and its LLAMA3-8B run (8K tokens,
  // grouped-query attention: 8 key/value groups for 32 heads) as 12,036 and 697. Under two
  // source ids (one run per source and layout is kept), each metric must give the same step
  // time; a GPT block, whose count NeMo writes differently, and a row without an MLP width are
  // left out with their reasons.
  std::string path = ::testing::TempDir() + "/nemo-flops.csv";
  {
    std::ifstream in("bench/data/published-runs.csv");
    std::string header;
    ASSERT_TRUE(bool(std::getline(in, header)));
    std::ofstream out(path);
    const char *row = ",LLAMA2-7B,32,4096,32,,11008,32000,4096,H100-SXM,8,1,1,,,8,1,1,128,,,,"
                      "true,,fp8,";
    const char *llama3 = ",LLAMA3-8B,32,4096,32,8,14336,128000,8192,H100-SXM,8,1,1,,,8,1,1,128,,,,"
                         "true,,fp8,";
    const char *noFfn = ",LLAMA2-7B,32,4096,32,,,32000,4096,H100-SXM,8,1,1,,,8,1,1,128,,,,"
                        "true,,fp8,";
    out << header << "\n"
        << "tok,r" << row << "llama,megatron,,,tokens_per_s_per_gpu,16847,x,,,\n"
        << "flops,r" << row << "llama,megatron,,,nemo_tflops_per_gpu,776,x,,,\n"
        << "tok3,r" << llama3 << "llama,megatron,,,tokens_per_s_per_gpu,12036,x,,,\n"
        << "flops3,r" << llama3 << "llama,megatron,,,nemo_tflops_per_gpu,697,x,,,\n"
        << "gpt,r" << row << "gpt,megatron,,,nemo_tflops_per_gpu,776,x,,,\n"
        << "noffn,r" << noFfn << "llama,megatron,,,nemo_tflops_per_gpu,776,x,,,\n";
  }
  std::vector<PublishedRun> runs;
  std::vector<SkippedRow> skipped;
  if (auto err = loadPublishedRuns(path, runs, skipped))
    FAIL() << takeMessage(std::move(err));
  ASSERT_EQ(runs.size(), 4u);
  EXPECT_NEAR(runs[1].measuredSeconds / runs[0].measuredSeconds, 1.0, 0.005);
  EXPECT_NEAR(runs[3].measuredSeconds / runs[2].measuredSeconds, 1.0, 0.005);
  ASSERT_EQ(skipped.size(), 2u);
  for (const SkippedRow &s : skipped)
    EXPECT_NE(s.why.find("nemo_tflops_per_gpu"), std::string::npos) << s.why;
  EXPECT_NE(skipped[1].why.find("ffn_hidden_size"), std::string::npos) << skipped[1].why;
}

/// Predicted step times of the runs of `device` in the file, keyed by row id.
std::map<std::string, std::pair<const PublishedRun *, double>> predict(const char *device,
                                                                       const ClusterSpec &c) {
  std::map<std::string, std::pair<const PublishedRun *, double>> out;
  for (const PublishedRun &r : published().runs) {
    if (r.device != device)
      continue;
    auto s = predictSeconds(r, c);
    EXPECT_TRUE(bool(s)) << r.id << ": " << (s ? "" : takeMessage(s.takeError()));
    out[r.id] = {&r, s ? *s : 0};
  }
  return out;
}

TEST(CalibrationTest, ARankingAgreesWhereverTheMeasurementOrders) {
  // Step times of four schedules; a published tie (the second and third) orders nothing.
  EXPECT_TRUE(sameRanking({4, 3, 3, 2}, {4, 3, 3.1, 2}));
  EXPECT_TRUE(sameRanking({4, 3, 3, 2}, {4, 3.1, 3, 2}));
  EXPECT_FALSE(sameRanking({4, 3, 3, 2}, {4, 3, 2, 3}));
  EXPECT_FALSE(sameRanking({4, 3, 2, 1}, {4, 2, 3, 1}));
  // A predicted tie where the measurement orders is not agreement.
  EXPECT_FALSE(sameRanking({4, 3, 2, 1}, {4, 3, 3, 1}));
  EXPECT_TRUE(sameRanking({1, 2, 3}, {1, 2, 3}));
}

TEST(CalibrationTest, TheA100SpecRanksTheZeroBubbleSchedulesAsMeasured) {
  // Qi et al. 2024, Table 4: at every one of the 12 settings ZB-2p is the fastest of 1F1B,
  // interleaved 1F1B, ZB-1p and ZB-2p, and ZB-1p beats 1F1B.
  auto p = predict("A100-80GB", spec("examples/a100-selene.json"));
  int settings = 0, same = 0, zbGainsClose = 0, interleavedGainsClose = 0;
  // Throughput gain over 1F1B, in points.
  auto gain = [](double oneF, double x) { return 100 * (oneF / x - 1); };
  for (const auto &[id, rp] : p) {
    llvm::StringRef name(id);
    if (!name.startswith("T4-") || !name.endswith("-1F1B"))
      continue;
    std::string stem = name.drop_back(5).str();
    ASSERT_TRUE(p.count(stem + "-ZB-2p") && p.count(stem + "-ZB-1p") && p.count(stem + "-1F1B-I"))
        << stem;
    double oneF = rp.second, inter = p[stem + "-1F1B-I"].second;
    double zb1 = p[stem + "-ZB-1p"].second, zb2 = p[stem + "-ZB-2p"].second;
    ++settings;
    SCOPED_TRACE(stem);
    EXPECT_LT(zb2, oneF);
    EXPECT_LT(zb2, inter);
    EXPECT_LT(zb2, zb1);
    EXPECT_LT(zb1, oneF);
    // The whole ranking of the four, predicted against measured.
    std::vector<double> measured, predicted;
    for (const char *suffix : {"-1F1B", "-1F1B-I", "-ZB-1p", "-ZB-2p"}) {
      measured.push_back(p[stem + suffix].first->measuredSeconds);
      predicted.push_back(p[stem + suffix].second);
    }
    same += sameRanking(measured, predicted);
    // The zero-bubble schedules' gains over 1F1B within 3 points of the measured ones (the
    // issue's bound), each of ZB-1p and ZB-2p.
    for (int k : {2, 3})
      zbGainsClose += std::abs(gain(measured[0], measured[size_t(k)]) -
                               gain(predicted[0], predicted[size_t(k)])) <= 3.0;
    // And interleaved 1F1B's, which the pass variability (pass_jitter_us) brought within 3.
    interleavedGainsClose +=
        std::abs(gain(measured[0], measured[1]) - gain(predicted[0], predicted[1])) <= 3.0;
  }
  EXPECT_EQ(settings, 12);
  EXPECT_EQ(zbGainsClose, 24);
  EXPECT_EQ(interleavedGainsClose, 12);
  // calibration_bench: 11 of 12. The miss is 22 layers at 24 microbatches, where the paper
  // measures interleaved 1F1B 1.7 points ahead of ZB-1p and pipec, whose ZB-1p gain there is 3
  // points too large, puts ZB-1p 0.9 ahead (docs/planner.md). Before the pass variability
  // term it was 30 layers at 64 microbatches, the other way round.
  EXPECT_GE(same, 11);
}

/// Mean absolute throughput error per source of the runs of `device`.
std::map<std::string, double> errorsBySource(const char *device, const ClusterSpec &c) {
  std::map<std::string, std::pair<double, int>> sum;
  for (const auto &[id, rp] : predict(device, c)) {
    auto &[s, n] = sum[rp.first->source];
    s += rp.second > 0 ? std::abs(throughputError(rp.first->measuredSeconds, rp.second)) : 1.0;
    ++n;
  }
  std::map<std::string, double> out;
  for (const auto &[source, sn] : sum)
    out[source] = sn.first / sn.second;
  return out;
}

TEST(CalibrationTest, TheShippedSpecsStayWithinTheirInSampleErrors) {
  // calibration_bench's in-sample figures for the shipped specs (docs/planner.md), each with a
  // margin: a change to the cost model that moves a source past its bound must refit the specs
  // and update the docs.
  std::map<std::string, double> bound = {
      {"narayanan2021_sc21", 0.05},       {"korthikanti2022", 0.04},
      {"qi2024_zerobubble", 0.04},        {"bigscience_bloom176b", 0.05},
      {"smith2022_mtnlg", 0.03},          {"sun2024_seq1f1b", 0.10},
      {"dubey2024_llama3", 0.04},         {"nvidia_nemo_perf_2407", 0.07},
      {"nvidia_dgxc_benchmarking", 0.04}, {"nvidia_nemo_longseq_2403", 0.03}};
  // (NeMo's long-sequence source: 0.7% over its three runs without context parallelism, 2.4%
  // with its six context-parallel runs at 32K to 1M tokens, which pipec predicts 2% too slow to
  // 6% too fast.)
  for (const char *device : {"A100-80GB", "H100-SXM"}) {
    auto errors = errorsBySource(
        device, spec(device[0] == 'A' ? "examples/a100-selene.json" : "examples/h100-nemo.json"));
    for (const auto &[source, e] : errors) {
      ASSERT_TRUE(bound.count(source)) << source;
      EXPECT_LE(e, bound[source]) << source;
    }
  }
}

} // namespace
} // namespace pipec
