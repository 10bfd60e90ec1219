//===- CompilerTest.cpp - Passes checked against independent references ---===//
#include "tests/TestUtil.h"

#include "compiler/Semantics.h"
#include "compiler/Verifier.h"
#include "ir/CostModel.h"
#include "ir/PlanText.h"
#include "ir/formats/PlanJson.h"
#include "ir/formats/SpecJson.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <set>

namespace pipec::test {
namespace {

//===----------------------------------------------------------------------===//
// Partition: exact against brute force.
//===----------------------------------------------------------------------===//

/// Least possible max stage time by enumerating every split (reference, exponential).
double bruteForceBest(const std::vector<double> &c, int parts) {
  double best = INFINITY;
  std::function<void(size_t, int, double)> go = [&](size_t start, int left, double worst) {
    if (left == 0) {
      if (start == c.size())
        best = std::min(best, worst);
      return;
    }
    double sum = 0;
    for (size_t end = start + 1; end + size_t(left - 1) <= c.size(); ++end) {
      sum += c[end - 1];
      go(end, left - 1, std::max(worst, sum));
    }
  };
  go(0, parts, 0);
  return best;
}

TEST(PartitionTest, MinimisesTheLargestStageExactlyAgainstBruteForce) {
  uint64_t seed = 7;
  for (int trial = 0; trial < 200; ++trial) {
    seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
    int layers = 2 + int((seed >> 40) % 9);
    int pp = 1 + int((seed >> 20) % uint64_t(layers));
    ModelSpec m = uniformModel(layers);
    std::vector<double> cost;
    for (Layer &l : m.layers) {
      seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
      l.forward = double((seed >> 33) % 97 + 1);
      l.backwardInput = l.backwardWeight = 0;
      cost.push_back(l.forward);
    }
    SCOPED_TRACE(testing::Message() << "trial " << trial << " layers " << layers << " pp " << pp);
    Plan plan = compileOrFail(m, options("gpipe", pp, 1));
    double worst = 0;
    for (const StageInfo &s : plan.stages) {
      EXPECT_LT(s.layerBegin, s.layerEnd); // never an empty stage
      worst = std::max(worst, s.forward[0]);
    }
    EXPECT_DOUBLE_EQ(worst, bruteForceBest(cost, pp));
  }
}

TEST(PartitionTest, UniformLayersSplitAsEvenlyAsIntegersAllow) {
  Plan plan = compileOrFail(uniformModel(10), options("1f1b", 4, 4));
  std::vector<int> sizes;
  for (const StageInfo &s : plan.stages)
    sizes.push_back(s.layerEnd - s.layerBegin);
  std::sort(sizes.begin(), sizes.end());
  EXPECT_EQ(sizes, (std::vector<int>{2, 2, 3, 3}));
}

TEST(PartitionTest, MoreStagesThanLayersIsAnErrorWithTheFix) {
  auto plan = compilePlan(uniformModel(6), ClusterSpec::defaults(), options("1f1b", 8, 8));
  EXPECT_EQ(errorText(plan.takeError()),
            "--pp 8 x --vpp 1 = 8 stages but the model has 6 layers; every stage needs at least "
            "one layer; try --pp 6");
}

//===----------------------------------------------------------------------===//
// Transformer costs: docs/contracts.md#model-spec-pipemodel1 against the zero-bubble paper's closed
// forms.
//===----------------------------------------------------------------------===//

TEST(TransformerCostTest, BlockCostsMatchTheZeroBubblePaperWithCausalAttention) {
  ModelSpec m = gptSpec(4, 4096, 4096);
  ClusterSpec c = ClusterSpec::defaults();
  SliceCost cost = m.sliceCost(c, /*layer=*/1, 0, 4096, 0, 1, /*tp=*/1);
  double s = 4096, h = 4096;
  // ZB paper Table 1 with f = 4h: F = 24sh^2 + 4hs^2, B = 24sh^2 + 8hs^2, W = 24sh^2; causal
  // attention touches s(s+1)/2 of the s^2 positions.
  double causal = s * (s + 1) / 2;
  double flopsPerMs = 989e12 * 0.55 / 1e3;
  EXPECT_NEAR(cost.forward, (24 * s * h * h + 4 * h * causal) / flopsPerMs, 1e-9);
  EXPECT_NEAR(cost.backwardInput, (24 * s * h * h + 8 * h * causal) / flopsPerMs, 1e-9);
  EXPECT_NEAR(cost.backwardWeight, 24 * s * h * h / flopsPerMs, 1e-9);
  EXPECT_EQ(cost.outputBytes, int64_t(2 * s * h));
}

// Activation memory as piperun's stages keep it (ir/Model.cpp's table), in closed form for a
// bf16 block with f = 4h, one microbatch, the whole sequence as one slice, tp = 1:
//   forward keeps  xIn, xMid, q, attOut (h each), fcPre (4h), K and V (h each): 10h elements,
//                  20sh bytes, plus two layernorms' fp32 mean and rstd (16 bytes per token) and
//                  flash attention's fp32 log-sum-exp per head (4·heads per token);
//   backward keeps xIn, xMid, attOut, fcPre and the statistics, and adds dOut, dXmid, dLn1,
//                  dLn2 (h each), dQkv (3h), dFcPre (4h): 18h elements, 36sh + 16s bytes;
//   at its end     also K, V and the fp32 dK/dV (2sh·2 + 2sh·4 bytes).
// (Korthikanti et al.'s 34sh + 5·heads·s² counts Megatron's dropout masks, its layernorm and GELU
// outputs and the materialised scores, which these kernels do not keep.)
TEST(TransformerCostTest, FlashBlockKeepsWhatTheDeviceKernelsKeep) {
  ModelSpec m = gptSpec(4, 4096, 4096);
  ClusterSpec c = ClusterSpec::defaults();
  SliceCost cost = m.sliceCost(c, /*layer=*/1, 0, 4096, 0, 1, /*tp=*/1);
  int64_t s = 4096, h = 4096, heads = 32;
  EXPECT_EQ(cost.activationBytes, 20 * s * h + 16 * s + 4 * heads * s);
  EXPECT_EQ(cost.weightGradBytes, 36 * s * h + 16 * s);
  EXPECT_EQ(cost.backwardPeakBytes,
            (36 * s * h + 16 * s) + 4 * s * h + 8 * s * h - (20 * s * h + 16 * s + 4 * heads * s));
  // The MLP forward's layernorm output, GELU output and partial sum: 2h + 4h elements.
  EXPECT_EQ(cost.workspaceBytes, 12 * s * h);
}

//===----------------------------------------------------------------------===//
// Llama-style blocks: parameters against the published counts, FLOPs against them.
//===----------------------------------------------------------------------===//

/// A transformer spec with the given fields (a JSON fragment) besides the sizes.
ModelSpec transformerSpec(int64_t layers, int64_t h, int64_t heads, int64_t ffn, int64_t vocab,
                          int64_t seq, const std::string &extra) {
  std::string text = fmt::format(
      R"({{"format": "pipemodel/1", "name": "m", "transformer": {{"num_layers": {},
      "hidden_size": {}, "num_attention_heads": {}, "ffn_hidden_size": {}, "vocab_size": {},
      "seq_length": {}, "dtype": "fp32"{}}}}})",
      layers, h, heads, ffn, vocab, seq, extra.empty() ? "" : ", " + extra);
  auto parsed = parseModelSpec(text, "m.json");
  EXPECT_TRUE(bool(parsed)) << (parsed ? "" : takeMessage(parsed.takeError()));
  return parsed ? *parsed : ModelSpec{};
}

int64_t parameters(const ModelSpec &m) {
  if (!m.transformer)
    return -1; // transformerSpec failed (and said why)
  int64_t bytes = 0;
  for (const Layer &l : m.layers)
    bytes += l.paramBytes;
  return bytes / m.transformer->dtypeBytes();
}

const char *kLlama = R"("norm": "rmsnorm", "mlp": "swiglu", "position": "rope", "bias": false)";

TEST(LlamaCostTest, ParametersEqualThePublishedCounts) {
  // Meta's Llama 3 8B (8,030,261,248: 32 layers, 4096 hidden, 32 heads in 8 key/value groups,
  // SwiGLU 14336, vocabulary 128256, untied), Llama 2 7B (6,738,415,616: multi-head, 11008,
  // 32000) and Mistral 7B v0.1 (7,241,732,096: 8 groups, 14336, 32000), as their model cards
  // and Hugging Face's parameter counts give them.
  EXPECT_EQ(parameters(transformerSpec(32, 4096, 32, 14336, 128256, 8192,
                                       std::string(kLlama) + R"(, "num_query_groups": 8)")),
            8030261248);
  EXPECT_EQ(parameters(transformerSpec(32, 4096, 32, 11008, 32000, 4096, kLlama)), 6738415616);
  EXPECT_EQ(parameters(transformerSpec(32, 4096, 32, 14336, 32000, 8192,
                                       std::string(kLlama) + R"(, "num_query_groups": 8)")),
            7241732096);
  // GPT-2 small (124,439,808 with its tied embeddings: the head's copy of wte not counted).
  ModelSpec gpt2 = transformerSpec(12, 768, 12, 3072, 50257, 1024, "");
  EXPECT_EQ(parameters(gpt2) - 50257 * 768, 124439808);
  // The examples' Llama 3 8B is the same model.
  auto example = loadModelSpec("examples/llama3-8b.json");
  ASSERT_TRUE(bool(example)) << takeMessage(example.takeError());
  EXPECT_EQ(parameters(*example), 8030261248);
}

TEST(LlamaCostTest, MatrixFlopsAreTwicePerTokenTheMatrixParameters) {
  // Llama 3 8B's block holds 218,103,808 matrix parameters (its 218,112,000 less the two
  // norms' 2 x 4096): each is a multiply-add per token in the forward.
  ModelSpec m = transformerSpec(32, 4096, 32, 14336, 128256, 8192,
                                std::string(kLlama) + R"(, "num_query_groups": 8)");
  const double h = 4096, matrices = 218103808, s = 8192, v = 128256, layers = 32;
  // One token at position 0 attends to one key: 4h of attention FLOPs.
  EXPECT_DOUBLE_EQ(m.blockForwardFlopsPrefix(1), 2 * matrices + 4 * h);
  // F + B + W of the whole model: 6 FLOPs per matrix parameter and token (the LM head's
  // v x h too), plus causal attention's 12h per (query, key) pair.
  double causal = s * (s + 1) / 2;
  EXPECT_DOUBLE_EQ(m.modelFlopsPerMicrobatch(),
                   6 * s * (layers * matrices + v * h) + layers * 12 * h * causal);
  // Grouped keys and values cost their share: 2h·(8 x 128) each instead of 2h².
  ModelSpec mha = transformerSpec(32, 4096, 32, 14336, 128256, 8192, kLlama);
  EXPECT_DOUBLE_EQ(mha.blockForwardFlopsPrefix(1) - m.blockForwardFlopsPrefix(1),
                   2 * 2 * h * (h - 8 * 128));
}

TEST(LlamaCostTest, GroupedKeysAndValuesAreWhatAttentionKeeps) {
  // Flash attention keeps the whole sequence's K and V with slice 0: 2·s·b·(groups x head
  // size)/tp elements; 8 groups of 128 against 32 heads of 128 save 2·s·(4096 - 1024)/tp.
  const int64_t s = 4096;
  ModelSpec gqa = transformerSpec(2, 4096, 32, 14336, 32000, s,
                                  std::string(kLlama) + R"(, "num_query_groups": 8)");
  ModelSpec mha = transformerSpec(2, 4096, 32, 14336, 32000, s, kLlama);
  ClusterSpec c = ClusterSpec::defaults();
  for (int tp : {1, 2, 8}) {
    SliceCost a = mha.sliceCost(c, 1, 0, s, 0, 1, tp), b = gqa.sliceCost(c, 1, 0, s, 0, 1, tp);
    EXPECT_EQ(a.activationBytes - b.activationBytes, 2 * s * (4096 - 1024) / tp * 4) << tp;
    // And their gradients (dQkv's k and v columns) in the backward.
    EXPECT_EQ(a.weightGradBytes - b.weightGradBytes, 2 * s * (4096 - 1024) / tp * 4) << tp;
  }
  // RMSNorm keeps one statistic per token and norm where LayerNorm keeps two; SwiGLU keeps
  // the gate and up outputs (2 x ffn) where GELU keeps one pre-activation.
  ModelSpec gpt = transformerSpec(2, 4096, 32, 14336, 32000, s, "");
  ModelSpec rms = transformerSpec(2, 4096, 32, 14336, 32000, s, R"("norm": "rmsnorm")");
  ModelSpec swiglu = transformerSpec(2, 4096, 32, 14336, 32000, s, R"("mlp": "swiglu")");
  SliceCost g = gpt.sliceCost(c, 1, 0, s, 0, 1, 1);
  EXPECT_EQ(g.activationBytes - rms.sliceCost(c, 1, 0, s, 0, 1, 1).activationBytes, 8 * s);
  EXPECT_EQ(swiglu.sliceCost(c, 1, 0, s, 0, 1, 1).activationBytes - g.activationBytes,
            s * 14336 * 4);
}

TEST(LlamaCostTest, PlansCarryTheVariantsAndGpt2PlansDoNot) {
  ModelSpec m =
      transformerSpec(4, 64, 8, 128, 256, 32,
                      std::string(kLlama) + R"(, "num_query_groups": 2, "rope_theta": 500000)");
  Plan plan = compileOrFail(m, options("1f1b", 2, 4, 1, 1, /*tp=*/2));
  const std::string text = writePlanJson(plan);
  for (const char *field :
       {R"("norm": "rmsnorm")", R"("mlp": "swiglu")", R"("position": "rope")",
        R"("rope_theta": 500000.0)", R"("num_query_groups": 2)", R"("bias": false)"})
    EXPECT_NE(text.find(field), std::string::npos) << field;
  auto back = parsePlanJson(text, "p.json");
  ASSERT_TRUE(bool(back)) << takeMessage(back.takeError());
  EXPECT_EQ(writePlanJson(*back), text);
  EXPECT_FALSE(back->transformer->isGpt2());
  EXPECT_EQ(back->transformer->kvHeads(), 2);
  // GPT-2's plans are written as before: none of the new fields.
  const std::string gpt2 = writePlanJson(compileOrFail(tinyGpt(), options("1f1b", 2, 4)));
  for (const char *field :
       {"\"norm\"", "\"mlp\"", "\"position\"", "\"num_query_groups\"", "\"bias\""})
    EXPECT_EQ(gpt2.find(field), std::string::npos) << field;
}

TEST(TransformerCostTest, MaterializedAttentionKeepsTheProbabilitiesOfEveryQueryAndKey) {
  ModelSpec m = gptSpec(4, 4096, 4096);
  m.transformer->attention = Attention::Materialized;
  ClusterSpec c = ClusterSpec::defaults();
  int64_t s = 4096, h = 4096, heads = 32;
  SliceCost cost = m.sliceCost(c, /*layer=*/1, 0, s, 0, 1, /*tp=*/1);
  // The (heads, s, s) probabilities in bf16 replace the log-sum-exps.
  EXPECT_EQ(cost.activationBytes, 20 * s * h + 16 * s + 2 * heads * s * s);
  // A later slice [a, e) keeps its x rows against all e keys, and only its own K/V.
  int64_t a = 3072, e = 4096, x = e - a;
  SliceCost late = m.sliceCost(c, /*layer=*/1, a, e, 1, 2, /*tp=*/1);
  EXPECT_EQ(late.activationBytes, 20 * x * h + 16 * x + 2 * heads * x * e);
}

TEST(TransformerCostTest, TensorParallelismShardsAllButTheResidualStreamsAndLayernormInputs) {
  ModelSpec m = gptSpec(4, 4096, 4096);
  ClusterSpec c = ClusterSpec::defaults();
  int64_t s = 4096, h = 4096, heads = 32;
  SliceCost cost = m.sliceCost(c, /*layer=*/1, 0, s, 0, 1, /*tp=*/2);
  // xIn, xMid whole (2h); q, attOut, K, V (4 · h/2); fcPre (4h/2): 6h elements, 12sh bytes.
  EXPECT_EQ(cost.activationBytes, 12 * s * h + 16 * s + 4 * (heads / 2) * s);
  // Whole: xIn, xMid, dOut, dXmid, dLn1, dLn2 (6h); sharded: attOut (h/2), dQkv (3h/2), fcPre
  // and dFcPre (2h each): 12h elements.
  EXPECT_EQ(cost.weightGradBytes, 24 * s * h + 16 * s);
}

TEST(TransformerCostTest, TheLongSequenceExampleNoLongerChargesTheScoreMatrix) {
  // examples/gpt-7b-8k.json: Korthikanti's score term 5·heads·Σ(t+1) was 5.4 GB per layer and
  // microbatch; the flash kernels keep 4 bytes per head and token instead.
  auto model = loadModelSpec("examples/gpt-7b-8k.json");
  ASSERT_TRUE(bool(model)) << takeMessage(model.takeError());
  ClusterSpec c = ClusterSpec::defaults();
  int64_t s = 8192, h = 4096, heads = 32;
  double korthikantiScores = 5.0 * heads * (double(s) * (s + 1) / 2);
  EXPECT_NEAR(korthikantiScores / 1e9, 5.4, 0.05);
  SliceCost flash = model->sliceCost(c, /*layer=*/1, 0, s, 0, 1, /*tp=*/1);
  EXPECT_EQ(flash.activationBytes, 20 * s * h + 16 * s + 4 * heads * s);
  EXPECT_LT(double(flash.activationBytes), 0.13 * korthikantiScores);
}

TEST(TransformerCostTest, FullRecomputationKeepsTheBlockInputAndRepeatsTheForward) {
  ModelSpec none = gptSpec(4, 4096, 4096);
  ModelSpec full = none;
  full.transformer->recompute = Recompute::Full;
  ClusterSpec c = ClusterSpec::defaults();
  int64_t s = 4096, h = 4096;
  SliceCost a = none.sliceCost(c, 1, 0, s, 0, 1, 1), b = full.sliceCost(c, 1, 0, s, 0, 1, 1);
  // The block's input (and K/V, which later slices read): h + 2h elements.
  EXPECT_EQ(b.activationBytes, 2 * s * h + 4 * s * h);
  EXPECT_EQ(b.weightGradBytes, a.weightGradBytes);
  EXPECT_DOUBLE_EQ(b.forward, a.forward);
  EXPECT_NEAR(b.backwardInput, a.backwardInput + a.forward, 1e-12);
  // Selective recomputation drops only materialised probabilities: with flash it changes nothing.
  ModelSpec selective = none;
  selective.transformer->recompute = Recompute::Selective;
  SliceCost sel = selective.sliceCost(c, 1, 0, s, 0, 1, 1);
  EXPECT_EQ(sel.activationBytes, a.activationBytes);
  EXPECT_DOUBLE_EQ(sel.backwardInput, a.backwardInput);
}

TEST(TransformerCostTest, EfficiencyFactorsScaleGemmAttentionAndLinkTimes) {
  ModelSpec m = gptSpec(4, 4096, 4096);
  ClusterSpec c = ClusterSpec::defaults();
  c.achievedFraction = 0.5;
  c.flashAttentionFraction = 0.25;
  c.attentionFraction = 0.1; // the materialized kernels' only: never a flash kernel's
  double s = 4096, h = 4096, causal = s * (s + 1) / 2;
  SliceCost cost = m.sliceCost(c, 1, 0, 4096, 0, 1, 1);
  EXPECT_NEAR(cost.forward, 24 * s * h * h / (989e9 * 0.5) + 4 * h * causal / (989e9 * 0.25), 1e-9);
  ModelSpec materialized = m;
  materialized.transformer->attention = Attention::Materialized;
  EXPECT_NEAR(materialized.sliceCost(c, 1, 0, 4096, 0, 1, 1).forward,
              24 * s * h * h / (989e9 * 0.5) + 4 * h * causal / (989e9 * 0.1), 1e-9);
  c.intraNode.efficiency = 0.5;
  EXPECT_DOUBLE_EQ(c.intraNode.bytesPerMs(), 450 * 0.5 * 1e6);
}

TEST(TransformerCostTest, MaterializedAttentionPassesOverItsScoresAtTheMemoryRate) {
  // Megatron-LM's unfused attention writes the b·(heads/tp)·x·e score matrix and passes over
  // it in softmax and dropout: 5·d + 1 bytes per element forward (d = 2 in bf16), 6·d + 1
  // backward, at memory_GBps. With both kernels at one fraction of peak, that is all a
  // materialized core costs beyond a flash one (whose scores never reach memory).
  ModelSpec flash = gptSpec(4, 4096, 4096);
  ModelSpec materialized = flash;
  materialized.transformer->attention = Attention::Materialized;
  ClusterSpec c = ClusterSpec::defaults();
  c.attentionFraction = c.flashAttentionFraction = 0.3;
  c.memoryGBps = 1000; // 1e9 bytes per ms
  const int tp = 2;
  for (auto [begin, end] : {std::pair<int64_t, int64_t>{0, 4096}, {3072, 4096}}) {
    SCOPED_TRACE(begin);
    double scores = 1.0 * (32 / tp) * double(end - begin) * double(end);
    SliceCost f = flash.sliceCost(c, 1, begin, end, 0, 1, tp);
    SliceCost m = materialized.sliceCost(c, 1, begin, end, 0, 1, tp);
    EXPECT_NEAR(m.forward - f.forward, scores * 11 / 1e9, 1e-9);
    EXPECT_NEAR(m.backwardInput - f.backwardInput, scores * 13 / 1e9, 1e-9);
    EXPECT_DOUBLE_EQ(m.backwardWeight, f.backwardWeight);
  }
  // Selective recomputation runs the core's forward again inside the backward: its score GEMMs
  // and its forward passes over the scores. With microbatch size 2 in fp32 (d = 4): 21 bytes
  // an element forward, 25 backward, twice the elements.
  auto spec = [](const char *attention, const char *recompute) {
    return modelOrFail(fmt::format(R"({{"format": "pipemodel/1", "transformer": {{
        "num_layers": 4, "hidden_size": 4096, "num_attention_heads": 32, "vocab_size": 50304,
        "seq_length": 4096, "microbatch_size": 2, "dtype": "fp32", "attention": "{}",
        "recompute": "{}"}}}})",
                                   attention, recompute),
                       "m.json");
  };
  double scores = 2.0 * (32 / tp) * 4096 * 4096;
  SliceCost f = spec("flash", "none").sliceCost(c, 1, 0, 4096, 0, 1, tp);
  SliceCost m = spec("materialized", "none").sliceCost(c, 1, 0, 4096, 0, 1, tp);
  EXPECT_NEAR(m.forward - f.forward, scores * 21 / 1e9, 1e-9);
  EXPECT_NEAR(m.backwardInput - f.backwardInput, scores * 25 / 1e9, 1e-9);
  SliceCost sel = spec("materialized", "selective").sliceCost(c, 1, 0, 4096, 0, 1, tp);
  double causal = 4096.0 * 4097 / 2, attentionF = 2 * 4 * 4096 * causal;
  EXPECT_NEAR(sel.backwardInput - m.backwardInput,
              attentionF / (c.peakTflops * 1e9 * 0.3 * tp) + scores * 21 / 1e9, 1e-9);
  // Without a memory rate the passes are not timed (older cluster files predict as before).
  c.memoryGBps = 0;
  EXPECT_DOUBLE_EQ(materialized.sliceCost(c, 1, 0, 4096, 0, 1, tp).forward,
                   flash.sliceCost(c, 1, 0, 4096, 0, 1, tp).forward);
}

TEST(TransformerCostTest, MegatronActivationsAreKorthikantisCount) {
  // "kept_activations": "megatron": a block's activations are what Korthikanti et al. (2022,
  // section 4.1 and Table 2) count for Megatron-LM in 16-bit training, GPT's block with
  // dropout, a materialized attention core and MLP width 4h: s·b·h·(34 + 5·a·s/h) bytes
  // without tensor parallelism, s·b·h·(10 + 24/t + 5·a·s/(h·t)) with t ranks, and
  // s·b·h/t·(34 + 5·a·s/h) with sequence parallelism; selective recomputation drops the
  // 5·a·s/h part, full keeps the block's input (2·s·b·h/t with sequence parallelism). pipec
  // also counts what their count leaves out: the norms' statistics (fp32 mean and rstd, 16
  // bytes a token per rank) and, without dropout, no masks (2·s·b·h/t bytes less) and only
  // the probabilities of the attention core (2·a·s²·b / t). piperun's own accounting
  // ("piperun") keeps 10·s·b·h/t (norm outputs, MLP output) less still, and no dropout.
  const double s = 1024, b = 4, h = 2048, a = 16;
  auto model = [&](const char *extra) {
    return modelOrFail(fmt::format(R"({{"format": "pipemodel/1", "transformer": {{
        "num_layers": 2, "hidden_size": 2048, "num_attention_heads": 16, "vocab_size": 50304,
        "seq_length": 1024, "microbatch_size": 4, "attention": "materialized"{}}}}})",
                                   extra),
                       "m.json");
  };
  ClusterSpec megatron = ClusterSpec::defaults(), piperun = megatron;
  megatron.megatronActivations = true;
  const char *dropout = R"(, "attention_dropout": 0.1, "hidden_dropout": 0.1)";
  const double sbh = s * b * h;
  struct Case {
    const char *recompute;
    int tp;
    bool sp, dropout, megatron;
    double expected; // bytes, Korthikanti's count (or its variant above)
  };
  const double stats = 16 * s * b; // the two norms' fp32 mean and rstd per token
  const Case cases[] = {
      {"none", 1, false, true, true, sbh * (34 + 5 * a * s / h) + stats},
      {"none", 2, false, true, true, sbh * (10 + 24 / 2.0 + 5 * a * s / (h * 2)) + stats},
      {"none", 4, false, true, true, sbh * (10 + 24 / 4.0 + 5 * a * s / (h * 4)) + stats},
      {"none", 4, true, true, true, sbh / 4 * (34 + 5 * a * s / h) + stats / 4},
      {"selective", 4, true, true, true, sbh / 4 * 34 + stats / 4},
      {"full", 4, true, true, true, 2 * sbh / 4},
      // Without dropout: no masks, the probabilities alone.
      {"none", 1, false, false, true, sbh * 32 + 2 * a * s * s * b + stats},
      // piperun's accounting: norm outputs and the MLP's output recomputed, no dropout.
      {"none", 1, false, false, false, sbh * 20 + 2 * a * s * s * b + stats},
  };
  for (const Case &k : cases) {
    SCOPED_TRACE(fmt::format("{} tp {} sp {} dropout {} megatron {}", k.recompute, k.tp, k.sp,
                             k.dropout, k.megatron));
    ModelSpec m = model(
        fmt::format(R"(, "recompute": "{}"{})", k.recompute, k.dropout ? dropout : "").c_str());
    SliceCost c = m.sliceCost(k.megatron ? megatron : piperun, 1, 0, 1024, 0, 1, k.tp, k.sp);
    EXPECT_NEAR(double(c.activationBytes), k.expected, 2.0) << c.activationBytes;
  }
  // What waits for the weight gradient is the zero-bubble paper's M_W (Qi et al. 2024, Table
  // 1): the linears' inputs and output gradients, 32·s·b·h bytes a block without tensor
  // parallelism.
  EXPECT_NEAR(double(model(dropout).sliceCost(megatron, 1, 0, 1024, 0, 1, 1).weightGradBytes),
              32 * sbh, 2.0);
  // The loss keeps its softmax in fp32 (4 bytes a logit) where piperun keeps bf16 logits.
  ModelSpec m = model(dropout);
  const size_t head = m.layers.size() - 1;
  const double vocab = 50304;
  EXPECT_NEAR(double(m.sliceCost(megatron, head, 0, 1024, 0, 1, 1).activationBytes -
                     m.sliceCost(piperun, head, 0, 1024, 0, 1, 1).activationBytes),
              s * b * vocab * 2, 2.0);
  // The embedding's dropout keeps its mask, a byte an element; piperun keeps nothing.
  EXPECT_EQ(m.sliceCost(megatron, 0, 0, 1024, 0, 1, 1).activationBytes, int64_t(s * b * h));
  EXPECT_EQ(m.sliceCost(piperun, 0, 0, 1024, 0, 1, 1).activationBytes, 0);
  // Read from the cluster spec; anything else refused naming the field.
  auto spec =
      parseClusterSpec(R"({"format": "pipecluster/1", "kept_activations": "megatron"})", "c.json");
  ASSERT_TRUE(bool(spec)) << takeMessage(spec.takeError());
  EXPECT_TRUE(spec->megatronActivations);
  auto bad =
      parseClusterSpec(R"({"format": "pipecluster/1", "kept_activations": "torch"})", "c.json");
  ASSERT_FALSE(bool(bad));
  EXPECT_EQ(takeMessage(bad.takeError()),
            "c.json: $.kept_activations: expected \"megatron\" or \"piperun\", got \"torch\"");
  auto badDropout = parseModelSpec(
      R"({"format": "pipemodel/1", "transformer": {"num_layers": 2, "hidden_size": 64,
          "num_attention_heads": 4, "vocab_size": 64, "seq_length": 16,
          "hidden_dropout": 1}})",
      "m.json");
  ASSERT_FALSE(bool(badDropout));
  EXPECT_EQ(takeMessage(badDropout.takeError()),
            "m.json: $.transformer.hidden_dropout: expected a probability in [0, 1), got 1");
}

TEST(TransformerCostTest, Fp8LinearsKeepTheirInputsAtAByteUnderMegatronsRule) {
  // Transformer Engine's FP8 linears keep the FP8 cast of their input for the weight gradient
  // (its 1.x linear.py and layernorm_linear.py / layernorm_mlp.py): the QKV and up projections'
  // inputs (the norms' outputs, h each) and the down projection's (the activation's output,
  // 4h) at a byte an element instead of 2, and the output projection's (the attention's
  // output, h), which the attention also keeps in BF16, once more at a byte. Without tensor
  // parallelism that is 5 bytes a token and hidden unit fewer (Korthikanti et al.'s 34·s·b·h
  // less 5·s·b·h), and the zero-bubble paper's M_W, 32·s·b·h, becomes 25·s·b·h. Under
  // piperun's rule, which keeps no such inputs, FP8 changes nothing.
  const double s = 1024, b = 4, h = 2048, sbh = s * b * h;
  auto model = [&](const char *precision) {
    return modelOrFail(fmt::format(R"({{"format": "pipemodel/1", "transformer": {{
        "num_layers": 2, "hidden_size": 2048, "num_attention_heads": 16, "vocab_size": 50304,
        "seq_length": 1024, "microbatch_size": 4, "attention_dropout": 0.1,
        "hidden_dropout": 0.1, "gemm_precision": "{}"}}}})",
                                   precision),
                       "m.json");
  };
  ClusterSpec megatron = ClusterSpec::defaults(), piperun = megatron;
  megatron.megatronActivations = true;
  ModelSpec bf16 = model("bf16"), fp8 = model("fp8");
  for (int tp : {1, 4})
    for (bool sp : {false, true}) {
      SCOPED_TRACE(fmt::format("tp {} sp {}", tp, sp));
      double spDiv = sp ? tp : 1;
      SliceCost a = bf16.sliceCost(megatron, 1, 0, 1024, 0, 1, tp, sp);
      SliceCost e = fp8.sliceCost(megatron, 1, 0, 1024, 0, 1, tp, sp);
      // Bytes a token saved: the three inputs a byte each (2h/sp + 4h/tp), less the attention
      // output's second copy (h/tp).
      double saved = s * b * (2 * h / spDiv + 4 * h / tp - h / tp);
      EXPECT_NEAR(double(a.activationBytes - e.activationBytes), saved, 2.0);
      // The weight gradient's inputs (2h/sp + h/tp + 4h/tp) at a byte.
      EXPECT_NEAR(double(a.weightGradBytes - e.weightGradBytes),
                  s * b * (2 * h / spDiv + 5 * h / tp), 2.0);
      EXPECT_EQ(fp8.sliceCost(piperun, 1, 0, 1024, 0, 1, tp, sp).activationBytes,
                bf16.sliceCost(piperun, 1, 0, 1024, 0, 1, tp, sp).activationBytes);
    }
  EXPECT_NEAR(double(bf16.sliceCost(megatron, 1, 0, 1024, 0, 1, 1).weightGradBytes), 32 * sbh, 2.0);
  EXPECT_NEAR(double(fp8.sliceCost(megatron, 1, 0, 1024, 0, 1, 1).weightGradBytes), 25 * sbh, 2.0);
}

TEST(TransformerCostTest, MegatronsFusedBackwardHoldsOneLayersWeightGradientStateAtATime) {
  // Megatron-LM's fused backward runs autograd through the stage, which computes each layer's
  // weight gradient right after its input gradient and frees what the layer kept: under
  // "kept_activations": "megatron" a fused backward holds, on top of the stage's activations,
  // the most any one layer builds, not the sum over the stage's layers (what piperun's stages,
  // and an input-gradient backward that leaves W for later, hold).
  ModelSpec m = modelOrFail(R"({"format": "pipemodel/1", "transformer": {"num_layers": 8,
      "hidden_size": 1024, "num_attention_heads": 16, "vocab_size": 50304,
      "seq_length": 2048, "attention": "flash"}})",
                            "m.json");
  ClusterSpec c = ClusterSpec::defaults();
  c.megatronActivations = true;
  auto plan = compilePlan(m, c, options("1f1b", 2, 4), /*verifyEach=*/true);
  ASSERT_TRUE(bool(plan)) << takeMessage(plan.takeError());
  for (const StageInfo &st : plan->stages) {
    int64_t most = 0, sum = 0;
    for (int l = st.layerBegin; l < st.layerEnd; ++l) {
      SliceCost lc = m.sliceCost(c, size_t(l), 0, 2048, 0, 1, 1);
      most = std::max({most, lc.backwardPeakBytes, lc.weightGradBytes - lc.activationBytes});
      sum += lc.backwardPeakBytes;
    }
    ASSERT_EQ(st.fusedBackwardPeakBytes.size(), 1u);
    EXPECT_EQ(st.fusedBackwardPeakBytes[0], most);
    EXPECT_EQ(st.backwardPeakBytes[0], sum);
    EXPECT_LT(most, sum / 2) << "the stage's layers each build some";
  }
  // Rank 0 (F0 F1 B0 F2 B1 ...) peaks in its first backward: two microbatches' activations,
  // the workspace and one layer's state.
  const StageInfo &s0 = plan->stages[0];
  EXPECT_EQ(plan->stats.ranks[0].peakActivationBytes,
            2 * s0.activationBytes[0] + s0.workspaceBytes[0] + s0.fusedBackwardPeakBytes[0]);
  // An input-gradient backward still builds the whole stage's state for its W.
  Instruction in = Instruction::compute(OpKind::BackwardInput, 0, 0, 0);
  EXPECT_EQ(activationHeldWhileRunning(s0, in), s0.workspaceBytes[0] + s0.backwardPeakBytes[0]);
  // The plan file keeps the field; a wrong length is refused with its path.
  auto back = parsePlanJson(writePlanJson(*plan), "p.json");
  ASSERT_TRUE(bool(back)) << takeMessage(back.takeError());
  EXPECT_EQ(back->stages[1].fusedBackwardPeakBytes, plan->stages[1].fusedBackwardPeakBytes);
  EXPECT_EQ(back->stats.ranks[0].peakMemoryBytes, plan->stats.ranks[0].peakMemoryBytes);
  std::string text = writePlanJson(*plan);
  size_t at = text.find("\"fused_backward_peak_bytes\": [");
  ASSERT_NE(at, std::string::npos);
  text.insert(at + std::strlen("\"fused_backward_peak_bytes\": ["), "0,");
  auto bad = parsePlanJson(text, "p.json");
  ASSERT_FALSE(bool(bad));
  EXPECT_NE(takeMessage(bad.takeError())
                .find("$.stages[0].fused_backward_peak_bytes: expected "
                      "an array of 1 numbers"),
            std::string::npos);
  // piperun's stages hold the whole stage's state: no such field.
  c.megatronActivations = false;
  auto own = compilePlan(m, c, options("1f1b", 2, 4), /*verifyEach=*/true);
  ASSERT_TRUE(bool(own)) << takeMessage(own.takeError());
  EXPECT_TRUE(own->stages[0].fusedBackwardPeakBytes.empty());
}

TEST(TransformerCostTest, MegatronLegacyKernelsPassOverTheAttentionsInputsAndOutput) {
  // "block_kernels": "megatron-legacy", counted kernel by kernel in Megatron-LM's own layers,
  // per token and tp rank, bf16 (2 bytes an element). Forward: the QKV linear adds its bias
  // with a kernel of its own (read and write the q|k|v output, qkv = h/tp + 2·kv/tp wide) and
  // the core attention's output is made contiguous in [s, b, h] order (read, write h/tp).
  // Backward: autograd sums each bias's gradient over the tokens (read qkv for QKV, f/tp for
  // the MLP's up projection, h twice for the two biases the bias-dropout-add kernels add), the
  // copy's gradient (read, write h/tp) and the split's gradient, the three gradients
  // concatenated (read, write qkv). The flash path first copies q, k and v into [b, s, ...]
  // order (read, write qkv), and its backward copies their gradients back. The weight
  // gradient is GEMMs only.
  const int64_t s = 2048;
  const int tp = 2;
  ClusterSpec c = ClusterSpec::defaults();
  c.memoryGBps = 1000; // 1e9 bytes per millisecond
  auto model = [&](const char *attention, const char *extra) {
    return modelOrFail(fmt::format(R"({{"format": "pipemodel/1", "transformer": {{
        "num_layers": 4, "hidden_size": 4096, "num_attention_heads": 32, "vocab_size": 50304,
        "seq_length": {}, "attention": "{}"{}}}}})",
                                   s, attention, extra),
                       "m.json");
  };
  struct Case {
    const char *attention, *extra;
    double forward, backward; // elements per token and rank
  };
  const double h = 4096.0 / tp, f = 4 * 4096.0 / tp, biasSums = 3 * h + f + 2 * 4096.0;
  const Case cases[] = {
      {"materialized", "", 2 * 3 * h + 2 * h, biasSums + 2 * h + 2 * 3 * h},
      {"flash", "", 2 * 3 * h + 2 * h + 2 * 3 * h, biasSums + 2 * h + 4 * 3 * h},
      // No bias (Llama-style), grouped-query attention: K and V 8 of 32 heads wide.
      {"flash", R"(, "bias": false, "num_query_groups": 8)", 2 * h + 2 * 1.5 * h,
       2 * h + 4 * 1.5 * h},
      // SwiGLU with biases (ffn 8192, 4096 per rank): the gate's and up projection's biases
      // are added by a kernel of their own (read, write 2·4096) and summed (read 2·4096).
      {"flash", R"(, "mlp": "swiglu", "ffn_hidden_size": 8192)",
       2 * 3 * h + 2 * 2 * 4096 + 2 * h + 2 * 3 * h,
       3 * h + 2 * 4096 + 2 * 4096.0 + 2 * h + 4 * 3 * h},
  };
  for (const Case &k : cases) {
    SCOPED_TRACE(std::string(k.attention) + k.extra);
    ModelSpec m = model(k.attention, k.extra);
    c.megatronLegacyKernels = false;
    SliceCost fused = m.sliceCost(c, 1, 0, s, 0, 1, tp);
    c.megatronLegacyKernels = true;
    SliceCost legacy = m.sliceCost(c, 1, 0, s, 0, 1, tp);
    EXPECT_NEAR(legacy.forward - fused.forward, s * k.forward * 2 / 1e9, 1e-9);
    EXPECT_NEAR(legacy.backwardInput - fused.backwardInput, s * k.backward * 2 / 1e9, 1e-9);
    EXPECT_DOUBLE_EQ(legacy.backwardWeight, fused.backwardWeight);
    EXPECT_EQ(legacy.activationBytes, fused.activationBytes);
  }
  // With sequence parallelism the two residual branches' bias sums run over the rank's share
  // of the tokens: 2·h/tp per token instead of 2·h. Nothing else here is sharded by it.
  ModelSpec m = model("materialized", "");
  c.megatronLegacyKernels = false;
  SliceCost spFused = m.sliceCost(c, 1, 0, s, 0, 1, tp, true);
  c.megatronLegacyKernels = true;
  SliceCost spLegacy = m.sliceCost(c, 1, 0, s, 0, 1, tp, true);
  EXPECT_NEAR(spLegacy.forward - spFused.forward, s * (2 * 3 * h + 2 * h) * 2 / 1e9, 1e-9);
  EXPECT_NEAR(spLegacy.backwardInput - spFused.backwardInput,
              s * (3 * h + f + 2 * h + 2 * h + 2 * 3 * h) * 2 / 1e9, 1e-9);
  // The head and the embedding never pay it; without a memory rate nothing memory-bound is
  // timed.
  size_t head = m.layers.size() - 1;
  ASSERT_EQ(m.layers[0].kind, LayerKind::Embedding);
  for (size_t layer : {size_t(0), head}) {
    SCOPED_TRACE(layer);
    c.megatronLegacyKernels = false;
    SliceCost fusedOther = m.sliceCost(c, layer, 0, s, 0, 1, tp);
    c.megatronLegacyKernels = true;
    SliceCost legacyOther = m.sliceCost(c, layer, 0, s, 0, 1, tp);
    EXPECT_DOUBLE_EQ(legacyOther.forward, fusedOther.forward);
    EXPECT_DOUBLE_EQ(legacyOther.backwardInput, fusedOther.backwardInput);
  }
  c.memoryGBps = 0;
  double untimed = m.sliceCost(c, 1, 0, s, 0, 1, tp).forward;
  c.megatronLegacyKernels = false;
  EXPECT_DOUBLE_EQ(m.sliceCost(c, 1, 0, s, 0, 1, tp).forward, untimed);
  // The spec's field: "fused" by default, "megatron-legacy" read, anything else refused with
  // its path.
  auto fusedSpec = parseClusterSpec(R"({"format": "pipecluster/1"})", "c.json");
  ASSERT_TRUE(bool(fusedSpec));
  EXPECT_FALSE(fusedSpec->megatronLegacyKernels);
  auto legacySpec = parseClusterSpec(
      R"({"format": "pipecluster/1", "block_kernels": "megatron-legacy"})", "c.json");
  ASSERT_TRUE(bool(legacySpec));
  EXPECT_TRUE(legacySpec->megatronLegacyKernels);
  auto bad = parseClusterSpec(R"({"format": "pipecluster/1", "block_kernels": "apex"})", "c.json");
  ASSERT_FALSE(bool(bad));
  EXPECT_EQ(takeMessage(bad.takeError()),
            "c.json: $.block_kernels: expected \"megatron-legacy\" or \"fused\", got \"apex\"");
}

TEST(TransformerCostTest, GemmEfficiencySaturatesWithTheSmallestDimension) {
  // eff = achieved_fraction · d / (d + gemm_half_dim), d the GEMM's smallest dimension after tp
  // sharding: the weight gradient (GEMMs only) is the sum of its four GEMMs at that rate.
  ModelSpec m = gptSpec(4, 4096, 1024);
  ClusterSpec c = ClusterSpec::defaults();
  c.achievedFraction = 0.5;
  c.gemmHalfDim = 256;
  double n = 1024, h = 4096, tp = 2, rate = 989e9 * 0.5;
  auto at = [&](double d) { return rate * d / (d + 256); };
  // QKV n x h x 3h/tp, projection n x h/tp x h, MLP n x h x 4h/tp and n x 4h/tp x h.
  double expected = 2 * n * h * 3 * h / tp / at(n) + 2 * n * h / tp * h / at(n) +
                    2 * n * h * 4 * h / tp / at(n) + 2 * n * 4 * h / tp * h / at(n);
  EXPECT_NEAR(m.sliceCost(c, 1, 0, 1024, 0, 1, 2).backwardWeight, expected, 1e-9);
  // Half the tokens: every GEMM's smallest dimension halves, so each runs at a lower rate.
  double half = m.sliceCost(c, 1, 0, 512, 0, 2, 2).backwardWeight;
  EXPECT_NEAR(half, expected / 2 * (512 + 256) / 512 * 1024 / (1024 + 256), 1e-9);
  // Without a half dimension the rate is achieved_fraction for every shape (the old model).
  c.gemmHalfDim = 0;
  EXPECT_NEAR(m.sliceCost(c, 1, 0, 1024, 0, 1, 2).backwardWeight, 2 * n * 12 * h * h / tp / rate,
              1e-9);
}

TEST(TransformerCostTest, GemmEfficiencySaturatesWithArithmeticIntensity) {
  // eff = achieved_fraction · I / (I + gemm_half_intensity), I = mkn / (mk + kn + mn): a
  // 3000-cube has I = 3000³ / (3 · 3000²) = 1000, so a half intensity of 1000 halves its rate.
  ClusterSpec c = ClusterSpec::defaults();
  c.achievedFraction = 0.5;
  c.gemmHalfIntensity = 1000;
  EXPECT_NEAR(c.gemmFlopsPerMs(3000, 3000, 3000), 989e9 * 0.25, 1e-3);
  // 1000 x 1000 x 1000: I = 1000/3, rate · (1000/3) / (1000/3 + 1000) = rate / 4.
  EXPECT_NEAR(c.gemmFlopsPerMs(1000, 1000, 1000), 989e9 * 0.5 / 4, 1e-3);
  // A block's weight gradient is its four GEMMs, each at its own shape's rate.
  ModelSpec m = gptSpec(4, 4096, 1024);
  double n = 1024, h = 4096, tp = 2, rate = 989e9 * 0.5;
  auto ms = [&](double a, double b, double d) {
    double i = a * b * d / (a * b + b * d + a * d);
    return 2 * a * b * d / (rate * i / (i + 1000));
  };
  double expected =
      ms(n, h, 3 * h / tp) + ms(n, h / tp, h) + ms(n, h, 4 * h / tp) + ms(n, 4 * h / tp, h);
  EXPECT_NEAR(m.sliceCost(c, 1, 0, 1024, 0, 1, 2).backwardWeight, expected, 1e-9);
  // Larger models' GEMMs are more intense and lose less: per FLOP, h = 8192 runs faster.
  ModelSpec big = gptSpec(4, 8192, 1024);
  double perFlopSmall = expected / (2 * n * 12 * h * h / tp);
  double perFlopBig =
      big.sliceCost(c, 1, 0, 1024, 0, 1, 2).backwardWeight / (2 * n * 12 * 4 * h * h / tp);
  EXPECT_LT(perFlopBig, perFlopSmall);
}

TEST(TransformerCostTest, APassPaysItsVariabilityByTheSquareRootOfItsTime) {
  // "pass_jitter_us": J: every stage's forward, input-gradient and weight-gradient pass of
  // model time t (ms) takes J/1000 · sqrt(t) ms more, before its transfers; so eight short
  // passes pay twice what two passes four times as long pay for the same total.
  ModelSpec m = gptSpec(8, 1024, 1024, 16);
  CompileOptions o = options("1f1b", 2, 4);
  ClusterSpec c = ClusterSpec::defaults();
  auto base = compilePlan(m, c, o, /*verifyEach=*/true);
  c.passJitterUs = 250;
  auto jittered = compilePlan(m, c, o, /*verifyEach=*/true);
  ASSERT_TRUE(base && jittered);
  for (size_t s = 0; s < base->stages.size(); ++s) {
    const StageInfo &a = base->stages[s], &b = jittered->stages[s];
    EXPECT_NEAR(b.forward[0], a.forward[0] + 0.25 * std::sqrt(a.forward[0]), 1e-12);
    EXPECT_NEAR(b.backwardInput[0], a.backwardInput[0] + 0.25 * std::sqrt(a.backwardInput[0]),
                1e-12);
    EXPECT_NEAR(b.backwardWeight[0], a.backwardWeight[0] + 0.25 * std::sqrt(a.backwardWeight[0]),
                1e-12);
  }
  EXPECT_GT(jittered->stats.stepTime, base->stats.stepTime);
  // Interleaving (the same layers in passes half as long) pays sqrt(2) times as much per layer.
  CompileOptions io = options("interleaved-1f1b", 2, 4, /*vpp=*/2);
  c.passJitterUs = 0;
  auto ib = compilePlan(m, c, io, /*verifyEach=*/true);
  c.passJitterUs = 250;
  auto ij = compilePlan(m, c, io, /*verifyEach=*/true);
  ASSERT_TRUE(ib && ij);
  double added = 0, addedOne = 0;
  for (size_t s = 0; s < ib->stages.size(); ++s)
    added += ij->stages[s].forward[0] - ib->stages[s].forward[0];
  for (size_t s = 0; s < base->stages.size(); ++s)
    addedOne += jittered->stages[s].forward[0] - base->stages[s].forward[0];
  EXPECT_GT(added, 1.3 * addedOne);
  // The spec field; a negative value is refused with one line naming it.
  auto parsed = parseClusterSpec(
      R"({"format": "pipecluster/1", "device": {"peak_tflops": 312, "pass_jitter_us": 150}})",
      "c.json");
  ASSERT_TRUE(bool(parsed)) << llvm::toString(parsed.takeError());
  EXPECT_DOUBLE_EQ(parsed->passJitterUs, 150);
  auto bad = parseClusterSpec(
      R"({"format": "pipecluster/1", "device": {"peak_tflops": 312, "pass_jitter_us": -1}})",
      "c.json");
  ASSERT_FALSE(bool(bad));
  EXPECT_NE(llvm::toString(bad.takeError()).find("$.device.pass_jitter_us"), std::string::npos);
}

TEST(TransformerCostTest, Fp8SpeedsUpTheBlocksGemmsOnly) {
  // "gemm_precision": "fp8": the block's GEMMs run fp8_gemm_speedup times faster; attention,
  // the memory-bound kernels, the per-op overhead and the head stay as they were.
  ModelSpec bf16 = gptSpec(4, 2048, 2048, 16);
  ModelSpec fp8 = bf16;
  fp8.transformer->fp8Gemms = true;
  ClusterSpec c = ClusterSpec::defaults();
  c.achievedFraction = 0.5;
  c.memoryGBps = 2000;
  c.opOverheadUs = 20;
  double n = 2048, h = 2048, linear = 2 * n * 12 * h * h / (989e9 * 0.5);
  SliceCost a = bf16.sliceCost(c, 1, 0, 2048, 0, 1, 1);
  // Without the factor an FP8 model runs at the BF16 rate.
  SliceCost same = fp8.sliceCost(c, 1, 0, 2048, 0, 1, 1);
  EXPECT_DOUBLE_EQ(same.forward, a.forward);
  c.fp8GemmSpeedup = 1.6;
  SliceCost b = fp8.sliceCost(c, 1, 0, 2048, 0, 1, 1);
  EXPECT_NEAR(a.backwardWeight, linear + 0.02, 1e-9);
  EXPECT_NEAR(b.backwardWeight, linear / 1.6 + 0.02, 1e-9);
  EXPECT_NEAR(a.forward - b.forward, linear - linear / 1.6, 1e-9);
  EXPECT_NEAR(a.backwardInput - b.backwardInput, linear - linear / 1.6, 1e-9);
  EXPECT_EQ(b.activationBytes, a.activationBytes);
  size_t head = bf16.layers.size() - 1;
  EXPECT_DOUBLE_EQ(fp8.sliceCost(c, head, 0, 2048, 0, 1, 1).forward,
                   bf16.sliceCost(c, head, 0, 2048, 0, 1, 1).forward);
}

TEST(TransformerCostTest, Fp8FieldsAreReadAndCheckedWithOneLine) {
  auto m = parseModelSpec(R"({"format": "pipemodel/1", "transformer": {"num_layers": 2,
      "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 128, "seq_length": 16,
      "gemm_precision": "fp8"}})",
                          "m.json");
  ASSERT_TRUE(bool(m)) << takeMessage(m.takeError());
  EXPECT_TRUE(m->transformer->fp8Gemms);
  auto bad = parseModelSpec(R"({"format": "pipemodel/1", "transformer": {"num_layers": 2,
      "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 128, "seq_length": 16,
      "gemm_precision": "fp4"}})",
                            "m.json");
  ASSERT_FALSE(bool(bad));
  EXPECT_NE(takeMessage(bad.takeError()).find("$.transformer.gemm_precision: expected"),
            std::string::npos);
  auto c = parseClusterSpec(R"({"format": "pipecluster/1", "device": {"peak_tflops": 989,
      "fp8_gemm_speedup": 1.4, "gemm_half_intensity": 300}})",
                            "c.json");
  ASSERT_TRUE(bool(c)) << takeMessage(c.takeError());
  EXPECT_DOUBLE_EQ(c->fp8GemmSpeedup, 1.4);
  EXPECT_DOUBLE_EQ(c->gemmHalfIntensity, 300);
  auto over = parseClusterSpec(R"({"format": "pipecluster/1", "device": {"peak_tflops": 989,
      "fp8_gemm_speedup": 3}})",
                               "c.json");
  ASSERT_FALSE(bool(over));
  EXPECT_NE(takeMessage(over.takeError())
                .find("$.device.fp8_gemm_speedup: expected a number in "
                      "[1, 2]"),
            std::string::npos);
}

TEST(TransformerCostTest, MemoryBoundKernelsAndFixedCostsAreNotWeightGradientTime) {
  // The norms, dropouts, residual adds and activation are charged to F and B (bytes over
  // memory_GBps), never to W; the per-op overhead to each of F, B and W.
  ModelSpec m = gptSpec(4, 1024, 2048, 16);
  ClusterSpec c = ClusterSpec::defaults();
  SliceCost base = m.sliceCost(c, 1, 0, 2048, 0, 1, 1);
  c.memoryGBps = 1000;
  c.opOverheadUs = 50;
  SliceCost with = m.sliceCost(c, 1, 0, 2048, 0, 1, 1);
  double n = 2048, h = 1024, bytes = n * 2 * (10 * h + 2 * 4 * h); // bf16 elements, GELU
  EXPECT_NEAR(with.forward - base.forward, bytes / 1e9 + 0.05, 1e-9);
  // The backward reads the saved input and the output's gradient and writes the input's
  // gradient: 3h per norm and per dropout-and-residual add, 3 · 4h for the GELU.
  double backwardBytes = n * 2 * (12 * h + 3 * 4 * h);
  EXPECT_NEAR(with.backwardInput - base.backwardInput, backwardBytes / 1e9 + 0.05, 1e-9);
  EXPECT_NEAR(with.backwardWeight - base.backwardWeight, 0.05, 1e-12);
  // Sequence parallelism shards the norm/dropout part of that traffic over tp.
  SliceCost tp2 = m.sliceCost(c, 1, 0, 2048, 0, 1, 2);
  SliceCost sp2 = m.sliceCost(c, 1, 0, 2048, 0, 1, 2, /*sequenceParallel=*/true);
  EXPECT_NEAR(tp2.forward - sp2.forward, n * 2 * (10 * h - 5 * h) / 1e9, 1e-9);
}

TEST(TransformerCostTest, TheLossIsMemoryBoundWorkOfTheHeadsForwardAndInputGradient) {
  // Megatron-LM's vocab-parallel cross entropy, counted kernel by kernel over the rank's bf16
  // logits (n tokens x V/tp): widen to fp32 (read 2, write 4), row max (read 4), subtract it
  // (read 4, write 4), exp (read 4, write 4), row sum (read 4), normalise (read 4, write 4) =
  // 38 bytes per logit forward; backward: scale by the loss gradient (read 4, write 4) and
  // narrow to bf16 (read 4, write 2) = 14. The head's weight gradient is a GEMM only.
  ModelSpec m = gptSpec(4, 1024, 2048, 16);
  ClusterSpec c = ClusterSpec::defaults();
  size_t head = m.layers.size() - 1;
  double n = 2048, v = 50304;
  for (int tp : {1, 2}) {
    SCOPED_TRACE(tp);
    c.memoryGBps = 0;
    SliceCost base = m.sliceCost(c, head, 0, 2048, 0, 1, tp);
    c.memoryGBps = 1000; // 1e9 bytes per millisecond
    SliceCost with = m.sliceCost(c, head, 0, 2048, 0, 1, tp);
    EXPECT_NEAR(with.forward - base.forward, n * v / tp * 38 / 1e9, 1e-9);
    EXPECT_NEAR(with.backwardInput - base.backwardInput, n * v / tp * 14 / 1e9, 1e-9);
    EXPECT_DOUBLE_EQ(with.backwardWeight, base.backwardWeight);
  }
  // Every token of the microbatch has its logits: twice the tokens, twice the bytes.
  ModelSpec two = m;
  two.transformer->microbatchSize = 2;
  c.memoryGBps = 0;
  SliceCost twoBase = two.sliceCost(c, head, 0, 2048, 0, 1, 1);
  c.memoryGBps = 1000;
  SliceCost twoWith = two.sliceCost(c, head, 0, 2048, 0, 1, 1);
  EXPECT_NEAR(twoWith.forward - twoBase.forward, 2 * n * v * 38 / 1e9, 1e-9);
  // In fp32 nothing is widened or narrowed: 32 and 8 bytes per logit.
  m.transformer->dtype = "fp32";
  c.memoryGBps = 0;
  SliceCost base = m.sliceCost(c, head, 0, 2048, 0, 1, 1);
  c.memoryGBps = 1000;
  SliceCost with = m.sliceCost(c, head, 0, 2048, 0, 1, 1);
  EXPECT_NEAR(with.forward - base.forward, n * v * 32 / 1e9, 1e-9);
  EXPECT_NEAR(with.backwardInput - base.backwardInput, n * v * 8 / 1e9, 1e-9);
}

TEST(TransformerCostTest, SequenceParallelismShardsWhatTheNormsKeep) {
  // Korthikanti et al. 2022, Table 2: per layer and token, 34h bytes without tp sharding;
  // tensor parallelism alone leaves 10h unsharded, sequence parallelism shards those too.
  ModelSpec m = gptSpec(4, 4096, 2048);
  ClusterSpec c = ClusterSpec::defaults();
  int64_t s = 2048, h = 4096;
  SliceCost tp = m.sliceCost(c, 1, 0, s, 0, 1, 4), sp = m.sliceCost(c, 1, 0, s, 0, 1, 4, true);
  // xIn and xMid (2h elements, bf16) and the two norms' statistics (16 bytes) per token.
  EXPECT_EQ(tp.activationBytes - sp.activationBytes, s * (2 * h * 2 + 16) * 3 / 4);
  EXPECT_EQ(sp.outputBytes * 4, tp.outputBytes);
  EXPECT_EQ(m.residualBytes(0, s, 4) * 4, m.residualBytes(0, s));
  // Full recomputation keeps only the block input: sharded too.
  m.transformer->recompute = Recompute::Full;
  EXPECT_LT(m.sliceCost(c, 1, 0, s, 0, 1, 4, true).activationBytes,
            m.sliceCost(c, 1, 0, s, 0, 1, 4).activationBytes);
}

TEST(ParallelOptionsTest, AnOverlappedParameterGatherLeavesTheReduceScatterExposed) {
  // "param_gather": "overlapped" (NeMo's overlap_param_sync): with the distributed optimizer a
  // stage's dp collective is its reduce-scatter only, one message and (n-1)/n of the stage's
  // parameter bytes over the link, where reduce-scatter plus all-gather is two messages and
  // twice the bytes. Without the distributed optimizer the all-reduce stays whole.
  ModelSpec m = gptSpec(8, 1024, 1024, 16);
  CompileOptions o = options("1f1b", 2, 4, 1, 1, /*tp=*/1, /*dp=*/4);
  o.parallel.distributedOptimizer = true;
  ClusterSpec c = ClusterSpec::defaults();
  auto after = compilePlan(m, c, o, /*verifyEach=*/true);
  c.overlapParamGather = true;
  auto overlapped = compilePlan(m, c, o, /*verifyEach=*/true);
  ASSERT_TRUE(after && overlapped);
  const Link &l = c.intraNode; // tp 1 x dp 4 ranks share a node
  double bytes = double(after->stages[0].paramBytes), message = l.latencyUs / 1000;
  double ring = 3.0 / 4 * bytes / l.bytesPerMs();
  EXPECT_NEAR(after->stages[0].dpAllReduceTime, 2 * message + 2 * ring, 1e-9);
  EXPECT_NEAR(overlapped->stages[0].dpAllReduceTime, message + ring, 1e-9);
  EXPECT_LT(overlapped->stats.stepTime, after->stats.stepTime);
  o.parallel.distributedOptimizer = false;
  auto plain = compilePlan(m, c, o, /*verifyEach=*/true);
  ASSERT_TRUE(bool(plain));
  EXPECT_NEAR(plain->stages[0].dpAllReduceTime, message + 2 * ring, 1e-9);
  // The spec field, and a wrong value refused with one line naming it.
  auto parsed =
      parseClusterSpec(R"({"format": "pipecluster/1", "param_gather": "overlapped"})", "c.json");
  ASSERT_TRUE(bool(parsed)) << takeMessage(parsed.takeError());
  EXPECT_TRUE(parsed->overlapParamGather);
  auto bad = parseClusterSpec(R"({"format": "pipecluster/1", "param_gather": "early"})", "c.json");
  ASSERT_FALSE(bool(bad));
  EXPECT_EQ(takeMessage(bad.takeError()),
            "c.json: $.param_gather: expected \"overlapped\" or \"after-step\", got \"early\"");
}

TEST(ClusterSpecTest, TheCalibrationRecordIsReadAndCheckedAndChangesNoTime) {
  // The optional "calibration" record (calibration_bench writes it): read in file order, each
  // bad part refused with one line naming it, and no effect on any time.
  auto spec = [](const std::string &calibration) {
    return parseClusterSpec(R"({"format": "pipecluster/1", "calibration": )" + calibration + "}",
                            "c.json");
  };
  auto ok = spec(R"({"runs": "106 runs", "held_out_error": {"zb-auto": 0.159, "1f1b": 0.1}})");
  ASSERT_TRUE(bool(ok)) << takeMessage(ok.takeError());
  EXPECT_EQ(ok->calibrationRuns, "106 runs");
  ASSERT_EQ(ok->heldOutErrorBySchedule.size(), 2u);
  EXPECT_EQ(ok->heldOutErrorBySchedule[0].first, "1f1b"); // nlohmann orders keys
  EXPECT_DOUBLE_EQ(ok->heldOutErrorBySchedule[0].second, 0.1);
  EXPECT_EQ(ok->heldOutErrorBySchedule[1].first, "zb-auto");
  auto message = [&](const std::string &calibration) {
    auto c = spec(calibration);
    return c ? std::string("accepted") : takeMessage(c.takeError());
  };
  EXPECT_EQ(message(R"({"held_out": {}})"),
            "c.json: $.calibration.held_out: unknown field (valid fields: runs, held_out_error)");
  EXPECT_EQ(message(R"({"held_out_error": {"1f1b": -0.1}})")
                .rfind("c.json: $.calibration.held_out_error.1f1b: ", 0),
            0u)
      << message(R"({"held_out_error": {"1f1b": -0.1}})");
  EXPECT_EQ(message(R"({"held_out_error": {"1f1b": 11}})"),
            "c.json: $.calibration.held_out_error.1f1b: expected a fraction in [0, 10] (0.05 is "
            "5%), got 11");
  EXPECT_EQ(message(R"({"held_out_error": {"1F1B": 0.1}})"),
            "c.json: $.calibration.held_out_error: expected schedule names (lower-case letters, "
            "digits and '-', at most 64 characters), got \"1F1B\"");
  EXPECT_EQ(message(R"({"held_out_error": [0.1]})")
                .rfind("c.json: $.calibration.held_out_error: expected an object", 0),
            0u)
      << message(R"({"held_out_error": [0.1]})");
  std::string many = "{\"held_out_error\": {";
  for (int i = 0; i < 65; ++i)
    many += fmt::format("{}\"s{}\": 0.1", i ? ", " : "", i);
  EXPECT_EQ(message(many + "}}"),
            "c.json: $.calibration.held_out_error: expected at most 64 schedules, got 65");
  // Timing never reads it.
  ClusterSpec plain = ClusterSpec::defaults(), recorded = plain;
  recorded.heldOutErrorBySchedule = ok->heldOutErrorBySchedule;
  ModelSpec m = gptSpec(4, 256, 64, 4);
  CompileOptions o;
  o.schedule = "1f1b";
  o.parallel.pp = 2;
  o.parallel.microbatches = 4;
  auto a = compilePlan(m, plain, o, /*verifyEach=*/false);
  auto b = compilePlan(m, recorded, o, /*verifyEach=*/false);
  ASSERT_TRUE(a && b);
  EXPECT_EQ(a->stats.stepTime, b->stats.stepTime);
}

TEST(ParallelOptionsTest, SequenceParallelAndDistributedOptimizerInPlansAndMemory) {
  ModelSpec m = gptSpec(8, 1024, 1024, 16);
  CompileOptions o = options("1f1b", 2, 4, 1, 1, /*tp=*/2, /*dp=*/4);
  Plan plain = compileOrFail(m, o);
  o.parallel.sequenceParallel = true;
  o.parallel.distributedOptimizer = true;
  Plan both = compileOrFail(m, o);
  // ZeRO-1: 2 + 4 bytes (bf16 weight, fp32 gradient) per parameter stay, 12 are sharded over
  // dp = 4: 9 bytes per parameter byte become 3 + 6/4.
  EXPECT_DOUBLE_EQ(plain.stateBytesPerParamByte, 9);
  EXPECT_DOUBLE_EQ(both.stateBytesPerParamByte, 3 + 6.0 / 4);
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_LT(both.stats.ranks[r].staticBytes, plain.stats.ranks[r].staticBytes);
    EXPECT_LT(both.stats.ranks[r].peakActivationBytes, plain.stats.ranks[r].peakActivationBytes);
  }
  // A reduce-scatter and an all-gather: the ring's bytes again, one more message.
  const Link &l = ClusterSpec::defaults().intraNode;
  EXPECT_NEAR(both.stages[0].tpAllReduceTime[0] - plain.stages[0].tpAllReduceTime[0],
              l.latencyUs / 1000, 1e-12);
  EXPECT_NEAR(both.stages[0].dpAllReduceTime - plain.stages[0].dpAllReduceTime, l.latencyUs / 1000,
              1e-12);
  // Both options survive the plan file, and an old plan (without them) reads as off.
  std::string text;
  llvm::raw_string_ostream os(text);
  writePlanJson(both, os);
  auto back = parsePlanJson(text, "both.json");
  ASSERT_TRUE(bool(back)) << takeMessage(back.takeError());
  EXPECT_TRUE(back->parallel.sequenceParallel);
  EXPECT_TRUE(back->parallel.distributedOptimizer);
  std::string old;
  llvm::raw_string_ostream os2(old);
  writePlanJson(plain, os2);
  EXPECT_EQ(old.find("sequence_parallel"), std::string::npos);
}

/// A GPT block of width 1024 (16 heads of 64), flash attention, at sequence `seq`.
ModelSpec cpSpec(int64_t seq) {
  return modelOrFail(fmt::format(R"({{"format": "pipemodel/1", "name": "gpt", "transformer": {{
      "num_layers": 4, "hidden_size": 1024, "num_attention_heads": 16, "vocab_size": 50304,
      "seq_length": {}, "attention": "flash"}}}})",
                                 seq),
                     "gpt.json");
}

TEST(ContextParallelTest, ARankKeepsWhatHalfTheSequenceKeepsAndComputesHalfItsAttention) {
  // cp 2 at sequence s: a rank holds s/2 of the tokens (two of the four chunks), so it keeps
  // what the block keeps at sequence s/2 (its own K and V included) and runs the same GEMMs;
  // its attention is half of the whole causal sequence's, b·4h·s(s+1)/4 FLOPs forward (twice
  // that backward), where the s/2 sequence alone has b·4h·(s/2)(s/2 + 1)/2. A link fast
  // enough hides the ring behind the attention.
  const double s = 4096, h = 1024;
  ModelSpec whole = cpSpec(4096), half = cpSpec(2048);
  ClusterSpec c = ClusterSpec::defaults();
  c.intraNode.bandwidthGBps = 1e9;
  SliceCost a = whole.sliceCost(c, 1, 0, 4096, 0, 1, /*tp=*/1, false, /*cp=*/2);
  SliceCost b = half.sliceCost(c, 1, 0, 2048, 0, 1, /*tp=*/1);
  EXPECT_EQ(a.activationBytes, b.activationBytes);
  EXPECT_EQ(a.weightGradBytes, b.weightGradBytes);
  EXPECT_EQ(a.outputBytes, b.outputBytes);
  // The ring's receive buffers on top: a K/V chunk (2 · s/2 · h · 2 bytes) and its gradient.
  EXPECT_EQ(a.workspaceBytes - b.workspaceBytes, int64_t(2 * (2 * s / 2 * h * 2)));
  double extra = 4 * h * (s * (s + 1) / 4 - s / 2 * (s / 2 + 1) / 2) / c.attentionFlopsPerMs(true);
  double latency = (c.intraNode.latencyUs + c.messageOverheadUs) / 1000;
  EXPECT_GT(extra, latency); // so that the ring's steps hide their messages
  EXPECT_NEAR(a.forward - b.forward, extra, 1e-9);
  EXPECT_NEAR(a.backwardInput - b.backwardInput, 2 * extra, 1e-9);
  EXPECT_DOUBLE_EQ(a.backwardWeight, b.backwardWeight);
  // The embedding's output and the head's logits: the rank's tokens only.
  EXPECT_EQ(whole.sliceCost(c, 0, 0, 4096, 0, 1, 1, false, 2).outputBytes,
            half.sliceCost(c, 0, 0, 2048, 0, 1, 1).outputBytes);
  size_t head = whole.layers.size() - 1;
  EXPECT_EQ(whole.sliceCost(c, head, 0, 4096, 0, 1, 1, false, 2).activationBytes,
            half.sliceCost(c, head, 0, 2048, 0, 1, 1).activationBytes);
}

TEST(ContextParallelTest, TheRingExposesWhatItsMessagesTakeBeyondTheAttention) {
  // On a slow link each of the cp - 1 ring steps waits for its message: forward the K/V chunk
  // of the rank's b·s/cp tokens (2 · s/cp · h · 2 bytes), backward that and its gradient.
  // cp 4 of tp 1 share a node: the intra-node link, 1 GB/s.
  const double s = 4096, h = 1024, cp = 4;
  ModelSpec m = cpSpec(4096);
  ClusterSpec fast = ClusterSpec::defaults(), slow = fast;
  fast.intraNode.bandwidthGBps = 1e9;
  slow.intraNode.bandwidthGBps = 1;
  SliceCost f = m.sliceCost(fast, 1, 0, 4096, 0, 1, 1, false, 4);
  SliceCost w = m.sliceCost(slow, 1, 0, 4096, 0, 1, 1, false, 4);
  double chunk = 2 * s / cp * h * 2;
  double message = (slow.intraNode.latencyUs + slow.messageOverheadUs) / 1000;
  double stepF = 4 * h * s * (s + 1) / 2 / cp / fast.attentionFlopsPerMs(true) / cp;
  auto send = [&](double bytes) { return message + bytes / slow.intraNode.bytesPerMs(); };
  EXPECT_NEAR(w.forward - f.forward, (cp - 1) * (send(chunk) - stepF), 1e-9);
  EXPECT_NEAR(w.backwardInput - f.backwardInput, (cp - 1) * (send(2 * chunk) - 2 * stepF), 1e-9);
  EXPECT_DOUBLE_EQ(w.backwardWeight, f.backwardWeight);
}

TEST(ContextParallelTest, TheRingsMemoryPassesAreTheCopiesAndMergesEachStepMakes) {
  // With a memory rate the ring also pays its memory-bound passes on the rank that sets its
  // pace, at that rate: per token, forward 4Kl + (cp-1)·2Kl + Cl + cp·3Cl elements (K/V into
  // the send buffer, each later half chunk made contiguous, the output zeroed, every step's
  // partial output merged), backward 4Kl + (cp-1)·2Kl + cp·3(Cl + Kl) (the same copies, dQ and
  // the half-chunk dK/dV summed). A GPT of width 1024 at tp 1: Cl = Kl = 1024, 2 bytes each;
  // cp 4 of 4096 tokens, 1024 a rank. Without context parallelism there are none.
  const double cp = 4, n = 4096 / cp, w = 1024, d = 2;
  ModelSpec m = cpSpec(4096);
  ClusterSpec c = ClusterSpec::defaults();
  c.intraNode.bandwidthGBps = 1e9;
  ClusterSpec mem = c;
  mem.memoryGBps = 1000;
  double perElement = d / mem.memoryBytesPerMs();
  SliceCost without = m.sliceCost(c, 1, 0, 4096, 0, 1, 1, false, 4);
  SliceCost with = m.sliceCost(mem, 1, 0, 4096, 0, 1, 1, false, 4);
  // (The block's other memory-bound passes are the same at cp 1 and cp 4 of the rank's tokens.)
  SliceCost plain = cpSpec(1024).sliceCost(c, 1, 0, 1024, 0, 1, 1);
  SliceCost plainMem = cpSpec(1024).sliceCost(mem, 1, 0, 1024, 0, 1, 1);
  double others = plainMem.forward - plain.forward,
         othersB = plainMem.backwardInput - plain.backwardInput;
  EXPECT_NEAR(with.forward - without.forward - others,
              n * perElement * (4 * w + (cp - 1) * 2 * w + w + cp * 3 * w), 1e-9);
  EXPECT_NEAR(with.backwardInput - without.backwardInput - othersB,
              n * perElement * (4 * w + (cp - 1) * 2 * w + cp * 3 * (w + w)), 1e-9);
  EXPECT_DOUBLE_EQ(with.backwardWeight, without.backwardWeight);
}

TEST(ContextParallelTest, PlansReduceGradientsOverTheCpRanksAndSayCpInTheirFile) {
  // pp 2, tp 2, cp 2, dp 1: every stage's gradients are all-reduced over the 2 cp ranks (a
  // dp all-reduce with dp 1), 2 ranks tp apart in one node; ZeRO-1 shards over dp x cp = 2.
  ModelSpec m = cpSpec(4096);
  CompileOptions o = options("1f1b", 2, 4, 1, 1, /*tp=*/2, /*dp=*/1);
  o.parallel.cp = 2;
  o.parallel.distributedOptimizer = true;
  Plan p = compileOrFail(m, o);
  EXPECT_TRUE(p.parallel.distributedOptimizer);
  EXPECT_DOUBLE_EQ(p.stateBytesPerParamByte, 3 + 6.0 / 2);
  const Link &l = ClusterSpec::defaults().intraNode;
  double bytes = double(p.stages[0].paramBytes), message = l.latencyUs / 1000;
  EXPECT_NEAR(p.stages[0].dpAllReduceTime, 2 * message + 2 * (1.0 / 2) * bytes / l.bytesPerMs(),
              1e-9);
  size_t dpReduces = 0;
  for (const auto &stream : p.ranks)
    for (const Instruction &i : stream)
      dpReduces += i.op == OpKind::AllReduce && i.collective == CollectiveGroup::Dp;
  EXPECT_EQ(dpReduces, p.stages.size());
  // The tp all-reduce carries the rank's tokens: half the sequence.
  CompileOptions noCp = o;
  noCp.parallel.cp = 1;
  noCp.parallel.dp = 2;
  Plan q = compileOrFail(m, noCp);
  EXPECT_NEAR(p.stages[0].tpAllReduceTime[0] - message,
              (q.stages[0].tpAllReduceTime[0] - message) / 2, 1e-9);
  // and so do its instructions' bytes, which the verifier checks against the same rule.
  // (The two plans' stages may hold other layers: their partitions balance other times.)
  auto tpBytes = [](const Plan &plan, int64_t times) {
    std::set<int64_t> b;
    for (const auto &stream : plan.ranks)
      for (const Instruction &i : stream)
        if (i.op == OpKind::AllReduce && i.collective == CollectiveGroup::Tp)
          b.insert(times * i.bytes);
    return b;
  };
  EXPECT_EQ(tpBytes(p, 2), tpBytes(q, 1));
  EXPECT_FALSE(tpBytes(p, 1).empty());
  // The plan file says cp and the rank order; an old plan reads as cp 1.
  std::string text;
  llvm::raw_string_ostream os(text);
  writePlanJson(p, os);
  EXPECT_NE(text.find(R"("cp": 2)"), std::string::npos) << text.substr(0, 400);
  EXPECT_NE(text.find("tp-cp-dp-pp"), std::string::npos);
  auto back = parsePlanJson(text, "cp.json");
  ASSERT_TRUE(bool(back)) << takeMessage(back.takeError());
  EXPECT_EQ(back->parallel.cp, 2);
  std::string old;
  llvm::raw_string_ostream os2(old);
  writePlanJson(q, os2);
  EXPECT_EQ(old.find(R"("cp")"), std::string::npos);
  EXPECT_NE(old.find("tp-dp-pp"), std::string::npos);
}

TEST(OptimizerStepTest, SyncedStepWaitsForTheLastRankAndPostValidationDoesNot) {
  // With the optimizer timed (memory_GBps), a 1f1b step is the last rank's end plus the
  // pipeline-wide check plus the slowest optimizer step; zb-h2 (post-validation) steps each
  // rank at its own end, so its period is the longest of (end + optimizer - first start).
  ModelSpec m = gptSpec(8, 1024, 1024, 16);
  ClusterSpec c = ClusterSpec::defaults();
  c.memoryGBps = 2000;
  for (const char *schedule : {"1f1b", "zb-h2"}) {
    SCOPED_TRACE(schedule);
    auto plan = compilePlan(m, c, options(schedule, 4, 8), /*verifyEach=*/true);
    ASSERT_TRUE(bool(plan)) << takeMessage(plan.takeError());
    double opt = 0, last = 0, period = 0;
    for (size_t r = 0; r < 4; ++r) {
      double o = rankOptimizerTime(*plan, r);
      EXPECT_GT(o, 0);
      opt = std::max(opt, o);
      const RankStats &rs = plan->stats.ranks[r];
      last = std::max(last, rs.stepEnd);
      period = std::max(period, rs.stepEnd + o - rs.start);
    }
    EXPECT_GT(plan->optimizerSyncTime, 0);
    EXPECT_EQ(plan->postValidation, std::string(schedule) == "zb-h2");
    if (plan->postValidation)
      EXPECT_DOUBLE_EQ(plan->stats.stepTime, period);
    else
      EXPECT_DOUBLE_EQ(plan->stats.stepTime, last + plan->optimizerSyncTime + opt);
  }
  // Without memory_GBps nothing is timed: the step is the makespan (no dp) as before.
  auto plain = compilePlan(m, ClusterSpec::defaults(), options("zb-h2", 4, 8), true);
  ASSERT_TRUE(bool(plain));
  EXPECT_DOUBLE_EQ(plain->stats.stepTime, plain->stats.makespan);
}

TEST(GradReduceTest, OverlappedReductionStartsWithTheLastBackward) {
  // "grad_reduce": "overlapped": a stage's dp all-reduce starts with its last backward (t0 to
  // t1, found here from the timeline) and ends at max(t0 + dp, t1 + dp / layers of the stage);
  // "after-backward" (the default) ends at t1 + dp. Two link speeds take both branches.
  ModelSpec m = gptSpec(8, 1024, 1024, 16);
  for (double gbps : {2.0, 2000.0}) {
    SCOPED_TRACE(gbps);
    ClusterSpec c = ClusterSpec::defaults();
    c.intraNode.bandwidthGBps = gbps;
    auto after = compilePlan(m, c, options("1f1b", 2, 4, 1, 1, 1, /*dp=*/4), true);
    c.overlapGradReduce = true;
    auto over = compilePlan(m, c, options("1f1b", 2, 4, 1, 1, 1, /*dp=*/4), true);
    ASSERT_TRUE(after && over);
    EXPECT_FALSE(after->overlapGradReduce);
    EXPECT_TRUE(over->overlapGradReduce);
    Timeline t;
    ASSERT_FALSE(bool(simulateTimeline(*over, t)));
    for (size_t r = 0; r < 2; ++r) {
      const auto &stream = over->ranks[r];
      size_t last = 0;
      for (size_t i = 0; i < stream.size(); ++i)
        if (stream[i].op == OpKind::Backward)
          last = i;
      size_t first = last;
      while (first > 0 && !stream[first].isFirstPart())
        --first;
      double t0 = t.ops[r][first].start, t1 = t.ops[r][last].end;
      const StageInfo &st = over->stages[r];
      double dp = st.dpAllReduceTime, layers = st.layerEnd - st.layerBegin;
      ASSERT_GT(dp, 0);
      EXPECT_NEAR(after->stats.ranks[r].stepEnd, t1 + dp, 1e-9);
      EXPECT_NEAR(over->stats.ranks[r].stepEnd, std::max(t0 + dp, t1 + dp / layers), 1e-9);
      if (gbps < 10) // the reduction outlasts the backward: the network sets the end
        EXPECT_NEAR(over->stats.ranks[r].stepEnd, t0 + dp, 1e-9);
      else // it hides behind the backward but for the last layer's bucket
        EXPECT_NEAR(over->stats.ranks[r].stepEnd, t1 + dp / layers, 1e-9);
    }
    EXPECT_LT(over->stats.stepTime, after->stats.stepTime);
    // The plan file keeps the choice, so simulating the plan again gives the same step.
    std::string text;
    llvm::raw_string_ostream os(text);
    writePlanJson(*over, os);
    auto back = parsePlanJson(text, "over.json");
    ASSERT_TRUE(bool(back)) << takeMessage(back.takeError());
    EXPECT_TRUE(back->overlapGradReduce);
  }
  // The cluster field, and a bad value named by its path.
  auto spec =
      parseClusterSpec(R"({"format": "pipecluster/1", "grad_reduce": "overlapped"})", "c.json");
  ASSERT_TRUE(bool(spec)) << takeMessage(spec.takeError());
  EXPECT_TRUE(spec->overlapGradReduce);
  auto bad = parseClusterSpec(R"({"format": "pipecluster/1", "grad_reduce": "later"})", "c.json");
  ASSERT_FALSE(bool(bad));
  EXPECT_NE(takeMessage(bad.takeError()).find("$.grad_reduce"), std::string::npos);
}

TEST(TransformerCostTest, SeqSplitBalancesPredictedTimeAndFlopsOnRequest) {
  // Under a calibrated cluster (GEMMs and attention at different fractions of peak,
  // memory-bound kernels, fixed costs) equal forward FLOPs are not equal times. The default
  // split makes a block's F + B + W the same for every slice within 5%; --seq-split-by flops
  // keeps the paper's rule, whose slices are then further apart.
  ClusterSpec c = ClusterSpec::defaults();
  c.peakTflops = 312;
  c.achievedFraction = 0.574;
  c.attentionFraction = 0.5;
  c.flashAttentionFraction = 0.307;
  c.memoryGBps = 1734;
  c.opOverheadUs = 10;
  for (const char *attention : {"flash", "materialized"}) {
    SCOPED_TRACE(attention);
    auto m = parseModelSpec(fmt::format(R"({{"format": "pipemodel/1", "transformer": {{
        "num_layers": 8, "hidden_size": 4096, "num_attention_heads": 32, "vocab_size": 32000,
        "seq_length": 32768, "attention": "{}"}}}})",
                                        attention),
                            "long.json");
    ASSERT_TRUE(bool(m));
    auto spread = [&](bool byFlops) {
      CompileOptions o = options("seq1f1b", 2, 4, 1, /*seqSplits=*/4, /*tp=*/2);
      o.parallel.seqSplitByFlops = byFlops;
      auto plan = compilePlan(*m, c, o, /*verifyEach=*/true);
      EXPECT_TRUE(bool(plan));
      double lo = INFINITY, hi = 0;
      for (auto [b, e] : plan->seqSlices) {
        EXPECT_EQ(b % 2, 0);
        SliceCost s = m->sliceCost(c, 1, b, e, 0, 4, 2);
        double t = s.forward + s.backwardInput + s.backwardWeight;
        lo = std::min(lo, t);
        hi = std::max(hi, t);
      }
      return hi / lo - 1;
    };
    EXPECT_LE(spread(false), 0.05);
    EXPECT_GT(spread(true), spread(false));
  }
}

TEST(TransformerCostTest, SeqSplitBalancesForwardFlopsInMultiplesOfTp) {
  ModelSpec m = gptSpec(8, 1024, 8192, 16);
  Plan plan = compileOrFail(m, options("gpipe", 2, 2, 1, /*seqSplits=*/4, /*tp=*/2));
  ASSERT_EQ(plan.seqSlices.size(), 4u);
  double h = 1024, total = 0;
  auto flops = [&](double a, double e) {
    return (e - a) * 24 * h * h + 4 * h * (e * (e + 1) - a * (a + 1)) / 2;
  };
  total = flops(0, 8192);
  for (auto [a, e] : plan.seqSlices) {
    EXPECT_EQ(a % 2, 0);
    EXPECT_EQ(e % 2, 0);
    // Within one tp-quantum of tokens of an equal share.
    EXPECT_NEAR(flops(double(a), double(e)), total / 4, flops(8190, 8192) * 1.01);
  }
  // Later slices attend to more keys, so they get fewer tokens.
  EXPECT_GT(plan.seqSlices[0].second - plan.seqSlices[0].first,
            plan.seqSlices[3].second - plan.seqSlices[3].first);
  // Per-slice forward times of a block are then equal too.
  ClusterSpec c = ClusterSpec::defaults();
  auto blockForward = [&](size_t k) {
    auto [a, e] = plan.seqSlices[k];
    return m.sliceCost(c, /*layer=*/1, a, e, int(k), 4, /*tp=*/2).forward;
  };
  for (size_t k = 1; k < 4; ++k)
    EXPECT_NEAR(blockForward(k), blockForward(0), blockForward(0) * 0.001);
}

TEST(TransformerCostTest, EmbeddingAndHeadAreLayersOfTheFirstAndLastStage) {
  Plan plan = compileOrFail(gptSpec(6, 1024, 2048, 16), options("1f1b", 4, 8));
  EXPECT_EQ(plan.stages.front().layerBegin, 0);
  EXPECT_EQ(plan.stages.back().layerEnd, 8); // embedding + 6 blocks + head
  EXPECT_EQ(plan.timeUnit, "ms");
  EXPECT_GT(plan.stages.back().activationTransferTime[0], -1);
  // Pipeline neighbours on one 8-GPU node: NVLink latency 3 us + bytes / 450 GB/s.
  double bytes = 2.0 * 2048 * 1024;
  EXPECT_NEAR(plan.stages[0].activationTransferTime[0], 0.003 + bytes / 450e9 * 1e3, 1e-12);
}

//===----------------------------------------------------------------------===//
// Collectives: tp parts and all-reduces, dp all-reduces, optimizer.
//===----------------------------------------------------------------------===//

TEST(LowerCollectivesTest, TensorParallelSplitsComputeAtMegatronsReductions) {
  ModelSpec m = uniformModel(4, 1, 1, 1, 1 << 20, 0, /*p2p=*/0.25);
  Plan plan = compileOrFail(m, options("1f1b", 2, 2, 1, 1, /*tp=*/2));
  // Two layers per stage, two reductions per layer: forwards and backwards in 4 parts.
  EXPECT_EQ(plan.stages[0].tpAllReduces, 4);
  std::string text = formatStreams(plan, false);
  EXPECT_NE(text.find("0F0:0/4 0ALLREDUCE_TP_F0:0/4 0F0:1/4 0ALLREDUCE_TP_F0:1/4"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("1B0:3/4 1ALLREDUCE_TP_B0:3/4"), std::string::npos) << text;
  // busy stays compute time (docs/contracts.md#semantics); the rank spends 2 mb x (4 + 4)
  // all-reduces x 0.25 on tp, which lengthens the step by at least that much on the first rank.
  Plan noTp = compileOrFail(m, options("1f1b", 2, 2));
  EXPECT_NEAR(plan.stats.ranks[0].busy, noTp.stats.ranks[0].busy, 1e-9);
  EXPECT_GE(plan.stats.makespan - noTp.stats.makespan, 2 * 8 * 0.25 - 1e-9);
}

TEST(LowerCollectivesTest, DataParallelAllReducesEachStageAfterItsLastWeightGradient) {
  Plan plan = compileOrFail(uniformModel(4), options("1f1b", 2, 3, 1, 1, 1, /*dp=*/2));
  for (const auto &stream : plan.ranks) {
    ASSERT_GE(stream.size(), 2u);
    EXPECT_EQ(stream.back().op, OpKind::OptimizerStep);
    const Instruction &ar = stream[stream.size() - 2];
    EXPECT_EQ(ar.op, OpKind::AllReduce);
    EXPECT_EQ(ar.collective, CollectiveGroup::Dp);
    EXPECT_EQ(ar.bytes, plan.stages[size_t(ar.stage)].paramBytes);
  }
  // Moving the all-reduce before the last backward is caught.
  Plan bad = plan;
  auto &s0 = bad.ranks[0];
  auto ar = std::find_if(s0.begin(), s0.end(),
                         [](const Instruction &i) { return i.op == OpKind::AllReduce; });
  Instruction moved = *ar;
  s0.erase(ar);
  s0.insert(s0.begin() + 1, moved);
  std::string msg = errorText(verifyPlan(bad));
  EXPECT_NE(msg.find("all-reduces stage 0's gradients before its last weight gradient"),
            std::string::npos)
      << msg;
}

//===----------------------------------------------------------------------===//
// Fidelity: the zero-bubble paper's Table 5.
//===----------------------------------------------------------------------===//

TEST(FidelityTest, OneFOneBBubbleMatchesZeroBubblePaperTable5) {
  // Profiled times of the paper's 1.5B model, p = 8, m = 24 (its Table 9 / ICLR Table 6).
  ModelSpec m = uniformModel(8, 18.522, 18.086, 9.337, 1000, 500, /*p2p=*/0.601);
  Plan plan = compileOrFail(m, options("1f1b", 8, 24));
  EXPECT_NEAR(plan.stats.bubbleRatio, 0.2431, 0.00005);
}

TEST(SimulatorTest, TransferTimeStretchesTheWarmUpByOneHopPerStage) {
  // GPipe with p2p c: makespan = (m + p - 1)(F + B) + 2(p - 1)c for unit layers.
  ModelSpec m = uniformModel(4, 1, 1, 0, 1, 0, /*p2p=*/0.5);
  Plan plan = compileOrFail(m, options("gpipe", 4, 6));
  EXPECT_NEAR(plan.stats.makespan, (6 + 3) * 2.0 + 2 * 3 * 0.5, 1e-12);
}

} // namespace
} // namespace pipec::test
