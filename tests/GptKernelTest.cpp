//===- GptKernelTest.cpp - CPU reference GPT: gradients, splits, Adam -------===//
//
// Checks of kernels/cpu/Gpt against independent references rather than against itself where
// possible:
//   - the gradients of one stage holding the whole model against central finite differences of
//     a separate double-precision implementation of the same model written here;
//   - pipeline stages, tensor-parallel shards and sub-sequence slices against the single-stage,
//     single-rank, single-slice run of the same model;
//   - Adam against the update computed by hand, training against a loss that must fall.
// Tolerances: "close(rel)" means |a - ref| <= rel * (|ref| + 0.1 * max|ref|) elementwise over
// a layer — relative, with a floor of 10% of the layer's largest entry for the near-zero entries
// (e.g. key weights, whose gradient is a sum that cancels) where fp32 rounding of a different
// summation order dominates.
//
//===----------------------------------------------------------------------===//
#include "kernels/cpu/Gpt.h"
#include "kernels/cpu/Ops.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numbers>
#include <random>
#include <string>

namespace pipec::kernels {
namespace {

using Slices = std::vector<std::pair<int, int>>;
using Batch = std::vector<std::vector<int32_t>>;

GptConfig tinyConfig() {
  GptConfig cfg;
  cfg.vocab = 16;
  cfg.seqLen = 8;
  cfg.channels = 16;
  cfg.heads = 4;
  cfg.layers = 2;
  cfg.ffn = 32;
  cfg.microbatch = 2;
  return cfg;
}

Batch randomBatch(const GptConfig &cfg, int microbatches, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> token(0, cfg.vocab - 1);
  Batch batch(microbatches);
  for (std::vector<int32_t> &mb : batch)
    for (int k = 0; k < cfg.microbatch * (cfg.seqLen + 1); ++k)
      mb.push_back(token(rng));
  return batch;
}

struct RunOptions {
  std::vector<int> stageBounds; // layer boundaries: stage s holds [bounds[s], bounds[s+1])
  int tp = 1;
  Slices slices;
  int microbatches = 2;
  bool deferWeight = false; // all backward_weights at the end instead of after each backward
};

struct RunResult {
  double loss = 0;
  std::vector<std::vector<std::vector<float>>> grads; // [layer][tpRank]
  size_t savedBytesMid = 0;                           // summed over stages before the last W
  size_t savedBytesAfter = 0;
};

/// Sums the buffers of a tp group in rank order and writes the sum back into every member, as
/// the runtime's all-reduce does.
void allReduce(std::vector<std::span<float>> &bufs) {
  for (const std::span<float> &b : bufs)
    ASSERT_EQ(b.size(), bufs[0].size());
  for (size_t k = 0; k < bufs[0].size(); ++k) {
    float sum = 0.0f;
    for (const std::span<float> &b : bufs)
      sum += b[k];
    for (std::span<float> &b : bufs)
      b[k] = sum;
  }
}

/// Runs one training step of `batch` through the stages and tp ranks of `opt` by hand: forward
/// of every slice ascending, then backward descending, chaining output()/inputGrad().
RunResult runModel(const GptConfig &cfg, const RunOptions &opt, const Batch &batch,
                   uint64_t seed = 7) {
  const int numStages = int(opt.stageBounds.size()) - 1, tp = opt.tp;
  const int numSlices = int(opt.slices.size());
  const float lossScale = 1.0f / float(opt.microbatches * cfg.microbatch * cfg.seqLen);
  std::vector<std::vector<std::unique_ptr<StageCompute>>> stages(numStages);
  for (int s = 0; s < numStages; ++s)
    for (int r = 0; r < tp; ++r) {
      stages[s].push_back(std::make_unique<StageCompute>(
          cfg, opt.stageBounds[s], opt.stageBounds[s + 1], r, tp, seed, opt.slices, lossScale));
      stages[s].back()->setBatch(batch);
    }
  RunResult result;
  for (int mb = 0; mb < opt.microbatches; ++mb) {
    for (int k = 0; k < numSlices; ++k) {
      std::vector<float> act;
      for (int s = 0; s < numStages; ++s) {
        for (int part = 0; part < stages[s][0]->parts(); ++part) {
          std::vector<std::span<float>> bufs;
          for (int r = 0; r < tp; ++r)
            bufs.push_back(stages[s][r]->forward(mb, k, part, act));
          allReduce(bufs);
        }
        std::span<const float> out = stages[s][0]->output(mb, k);
        for (int r = 1; r < tp; ++r)
          EXPECT_TRUE(std::ranges::equal(stages[s][r]->output(mb, k), out));
        act.assign(out.begin(), out.end());
      }
      result.loss += stages[numStages - 1][0]->loss(mb, k);
    }
    for (int k = numSlices - 1; k >= 0; --k) {
      std::vector<float> grad;
      for (int s = numStages - 1; s >= 0; --s) {
        for (int part = 0; part < stages[s][0]->parts(); ++part) {
          std::vector<std::span<float>> bufs;
          for (int r = 0; r < tp; ++r)
            bufs.push_back(stages[s][r]->backwardInput(mb, k, part, grad));
          allReduce(bufs);
        }
        std::span<const float> in = stages[s][0]->inputGrad(mb, k);
        grad.assign(in.begin(), in.end());
        if (!opt.deferWeight)
          for (int r = 0; r < tp; ++r)
            stages[s][r]->backwardWeight(mb, k);
      }
    }
  }
  for (int s = 0; s < numStages; ++s)
    for (int r = 0; r < tp; ++r)
      result.savedBytesMid += stages[s][r]->savedBytes();
  if (opt.deferWeight)
    for (int mb = 0; mb < opt.microbatches; ++mb)
      for (int k = numSlices - 1; k >= 0; --k)
        for (int s = 0; s < numStages; ++s)
          for (int r = 0; r < tp; ++r)
            stages[s][r]->backwardWeight(mb, k);
  result.grads.resize(cfg.numLayers());
  for (int s = 0; s < numStages; ++s)
    for (int r = 0; r < tp; ++r) {
      result.savedBytesAfter += stages[s][r]->savedBytes();
      std::span<float> g = stages[s][r]->grads();
      for (int l = opt.stageBounds[s]; l < opt.stageBounds[s + 1]; ++l) {
        auto [begin, end] = stages[s][r]->layerRange(l);
        result.grads[l].emplace_back(g.begin() + begin, g.begin() + end);
      }
    }
  return result;
}

RunOptions singleStage(const GptConfig &cfg) {
  return {{0, cfg.numLayers()}, /*tp=*/1, {{0, cfg.seqLen}}};
}

double maxAbs(const std::vector<float> &v) {
  double m = 0;
  for (float x : v)
    m = std::max(m, double(std::fabs(x)));
  return m;
}

void expectClose(const std::vector<float> &got, const std::vector<float> &ref, double rel,
                 const std::string &what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  const double floor = 0.1 * maxAbs(ref);
  int bad = 0;
  for (size_t k = 0; k < ref.size(); ++k) {
    double diff = std::fabs(double(got[k]) - ref[k]);
    if (diff <= rel * (std::fabs(ref[k]) + floor))
      continue;
    if (++bad <= 5) {
      ADD_FAILURE() << what << "[" << k << "]: " << got[k] << " vs " << ref[k] << " (max "
                    << maxAbs(ref) << ")";
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << ref.size() << " entries off";
}

void expectSameGrads(const RunResult &got, const RunResult &ref, double rel) {
  ASSERT_EQ(got.grads.size(), ref.grads.size());
  for (size_t l = 0; l < ref.grads.size(); ++l)
    expectClose(got.grads[l][0], ref.grads[l][0], rel, "layer " + std::to_string(l));
}

/// The model's block in GPT-2's choices and Llama's, alone and mixed (the spec's "norm",
/// "mlp", "position", "num_query_groups" and "bias" take any combination).
struct Variant {
  const char *name;
  GptConfig cfg;
};
std::vector<Variant> variants() {
  GptConfig llama = tinyConfig();
  llama.rmsnorm = llama.swiglu = llama.rope = true;
  llama.kvHeads = 2;
  llama.bias = false;
  GptConfig mixA = tinyConfig(); // layernorm without shift, swiglu, learned positions, GQA
  mixA.swiglu = true;
  mixA.kvHeads = 2;
  mixA.bias = false;
  GptConfig mixB = tinyConfig(); // rmsnorm, gelu, rope, multi-head, biases, a large eps
  mixB.rmsnorm = mixB.rope = true;
  mixB.ropeTheta = 500000;
  mixB.normEps = 0.25f;  // large enough that a kernel ignoring it misses the double model
  GptConfig mqa = llama; // one key/value head (multi-query)
  mqa.kvHeads = 1;
  return {{"Gpt2", tinyConfig()},
          {"Llama", llama},
          {"LayernormSwigluGqa", mixA},
          {"RmsnormGeluRope", mixB},
          {"MultiQuery", mqa}};
}

class GptVariantTest : public ::testing::TestWithParam<GptConfig> {};

//===-- A double-precision model, written independently of Gpt.cpp ------===//
// It reads the flat layout Gpt.h documents and implements GPT-2's block and Llama's choices
// from their definitions: RMSNorm x / sqrt(mean(x^2) + eps) w; SwiGLU silu(x Wg) * (x Wu);
// rotary embeddings turning the pairs (i, i + hd/2) of q and k by pos * theta^(-2i/hd);
// query head h reading key/value head h / (heads / kvHeads).

struct Ref {
  const GptConfig &cfg;
  using Mat = std::vector<double>; // row-major

  static double gelu(double x) {
    return 0.5 * x * (1 + std::tanh(std::sqrt(2 / std::numbers::pi) * (x + 0.044715 * x * x * x)));
  }
  Mat norm(const Mat &x, int rows, const double *w, const double *b) const {
    const int c = cfg.channels;
    Mat y(x.size());
    for (int r = 0; r < rows; ++r) {
      double mean = 0, var = 0;
      if (cfg.rmsnorm) {
        for (int k = 0; k < c; ++k)
          var += x[r * c + k] * x[r * c + k] / c; // mean square, about 0
      } else {
        for (int k = 0; k < c; ++k)
          mean += x[r * c + k] / c;
        for (int k = 0; k < c; ++k)
          var += (x[r * c + k] - mean) * (x[r * c + k] - mean) / c;
      }
      for (int k = 0; k < c; ++k)
        y[r * c + k] =
            (x[r * c + k] - mean) / std::sqrt(var + double(cfg.normEps)) * w[k] + (b ? b[k] : 0.0);
    }
    return y;
  }
  // y (rows, o) = x (rows, i) @ w (i, o) + b
  static Mat linear(const Mat &x, int rows, int i, int o, const double *w, const double *b) {
    Mat y(size_t(rows) * o);
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < o; ++c) {
        double sum = b ? b[c] : 0;
        for (int k = 0; k < i; ++k)
          sum += x[r * i + k] * w[k * o + c];
        y[r * o + c] = sum;
      }
    return y;
  }
  // Rotates head `h` of row `p` (position p) of x, whose rows are `stride` wide, from `at`.
  void rotate(Mat &x, int p, int stride, int at, int hd) const {
    double *head = x.data() + size_t(p) * stride + at;
    for (int i = 0; i < hd / 2; ++i) {
      const double angle = p * std::pow(cfg.ropeTheta, -2.0 * i / hd);
      const double a = head[i], b = head[i + hd / 2];
      head[i] = a * std::cos(angle) - b * std::sin(angle);
      head[i + hd / 2] = b * std::cos(angle) + a * std::sin(angle);
    }
  }

  /// The scaled loss of one microbatch; `layers` holds every layer's full parameters.
  double loss(const std::vector<std::vector<double>> &layers, const std::vector<int32_t> &tokens,
              double scale) const {
    const int c = cfg.channels, t = cfg.seqLen, v = cfg.vocab, f = cfg.ffn;
    const int hd = c / cfg.heads, kvh = cfg.kvHeads > 0 ? cfg.kvHeads : cfg.heads;
    const int kvw = kvh * hd, qkvw = c + 2 * kvw, fcw = cfg.swiglu ? 2 * f : f;
    const bool shift = !cfg.rmsnorm && cfg.bias;
    double total = 0;
    for (int s = 0; s < cfg.microbatch; ++s) {
      const int32_t *seq = tokens.data() + s * (t + 1);
      Mat x(size_t(t) * c);
      const double *wte = layers[0].data(), *wpe = wte + v * c;
      for (int p = 0; p < t; ++p)
        for (int k = 0; k < c; ++k)
          x[p * c + k] = wte[seq[p] * c + k] + (cfg.rope ? 0.0 : wpe[p * c + k]);
      for (int l = 1; l <= cfg.layers; ++l) {
        const double *cur = layers[l].data();
        auto take = [&](size_t n, bool present = true) -> const double * {
          if (!present)
            return nullptr;
          const double *at = cur;
          cur += n;
          return at;
        };
        const double *ln1w = take(c), *ln1b = take(c, shift), *qkvW = take(size_t(c) * qkvw),
                     *qkvB = take(qkvw, cfg.bias), *attnw = take(c * c), *attnb = take(c, cfg.bias),
                     *ln2w = take(c), *ln2b = take(c, shift), *fcW = take(size_t(c) * fcw),
                     *fcB = take(fcw, cfg.bias), *projw = take(f * c), *projb = take(c, cfg.bias);
        EXPECT_EQ(cur, layers[l].data() + layers[l].size()) << "block layout";
        Mat qkv = linear(norm(x, t, ln1w, ln1b), t, c, qkvw, qkvW, qkvB);
        if (cfg.rope)
          for (int p = 0; p < t; ++p) {
            for (int h = 0; h < cfg.heads; ++h)
              rotate(qkv, p, qkvw, h * hd, hd);
            for (int h = 0; h < kvh; ++h)
              rotate(qkv, p, qkvw, c + h * hd, hd);
          }
        Mat y(size_t(t) * c, 0.0);
        for (int h = 0; h < cfg.heads; ++h) {
          const int g = h / (cfg.heads / kvh); // its key/value head
          for (int i = 0; i < t; ++i) {
            std::vector<double> w(i + 1);
            double mx = -1e300, sum = 0;
            for (int j = 0; j <= i; ++j) {
              double dot = 0;
              for (int d = 0; d < hd; ++d)
                dot += qkv[i * qkvw + h * hd + d] * qkv[j * qkvw + c + g * hd + d];
              w[j] = dot / std::sqrt(double(hd));
              mx = std::max(mx, w[j]);
            }
            for (int j = 0; j <= i; ++j)
              sum += w[j] = std::exp(w[j] - mx);
            for (int j = 0; j <= i; ++j)
              for (int d = 0; d < hd; ++d)
                y[i * c + h * hd + d] += w[j] / sum * qkv[j * qkvw + c + kvw + g * hd + d];
          }
        }
        Mat a = linear(y, t, c, c, attnw, attnb);
        for (size_t k = 0; k < x.size(); ++k)
          x[k] += a[k];
        Mat pre = linear(norm(x, t, ln2w, ln2b), t, c, fcw, fcW, fcB);
        Mat hidden(size_t(t) * f);
        for (int p = 0; p < t; ++p)
          for (int k = 0; k < f; ++k) {
            const double gate = pre[p * fcw + k];
            hidden[p * f + k] =
                cfg.swiglu ? gate / (1 + std::exp(-gate)) * pre[p * fcw + f + k] : gelu(gate);
          }
        Mat m = linear(hidden, t, f, c, projw, projb);
        for (size_t k = 0; k < x.size(); ++k)
          x[k] += m[k];
      }
      const double *lnfw = layers[cfg.layers + 1].data(), *lnfb = shift ? lnfw + c : nullptr;
      const double *lm = lnfw + (shift ? 2 * c : c);
      Mat h = norm(x, t, lnfw, lnfb);
      for (int p = 0; p < t; ++p) {
        std::vector<double> logits(v, 0.0);
        double mx = -1e300, sum = 0;
        for (int o = 0; o < v; ++o) {
          for (int k = 0; k < c; ++k)
            logits[o] += h[p * c + k] * lm[o * c + k];
          mx = std::max(mx, logits[o]);
        }
        for (int o = 0; o < v; ++o)
          sum += std::exp(logits[o] - mx);
        total += scale * (std::log(sum) + mx - logits[seq[p + 1]]);
      }
    }
    return total;
  }
};

TEST_P(GptVariantTest, GradientsMatchFiniteDifferencesOfAnIndependentModel) {
  const GptConfig cfg = GetParam();
  const Batch batch = randomBatch(cfg, /*microbatches=*/1, /*seed=*/11);
  const float lossScale = 1.0f / float(cfg.microbatch * cfg.seqLen);
  StageCompute stage(cfg, 0, cfg.numLayers(), /*tpRank=*/0, /*tp=*/1, /*seed=*/3, {{0, cfg.seqLen}},
                     lossScale);
  // Move away from the init (unit layernorm scales, zero biases, near-uniform attention) so
  // that every term of the model matters.
  std::mt19937 rng(5);
  std::normal_distribution<float> noise(0.0f, 0.2f);
  for (float &p : stage.params())
    p += noise(rng);
  stage.setBatch(batch);
  for (int part = 0; part < stage.parts(); ++part)
    stage.forward(0, 0, part, {});
  const double loss = stage.loss(0, 0);
  for (int part = 0; part < stage.parts(); ++part)
    stage.backwardInput(0, 0, part, {});
  stage.backwardWeight(0, 0);

  std::vector<std::vector<double>> layers;
  for (int l = 0; l < cfg.numLayers(); ++l) {
    auto [begin, end] = stage.layerRange(l);
    layers.emplace_back(stage.params().begin() + begin, stage.params().begin() + end);
  }
  const Ref ref{cfg};
  const double refLoss = ref.loss(layers, batch[0], lossScale);
  EXPECT_NEAR(loss, refLoss, 1e-5 * refLoss);

  // Central differences in double (step 1e-6) on 60 random parameters of every layer; the fp32
  // gradient must agree within 1e-2 relative (floor: 1e-3 of the layer's largest gradient).
  for (int l = 0; l < cfg.numLayers(); ++l) {
    auto [begin, end] = stage.layerRange(l);
    std::vector<float> grad(stage.grads().begin() + begin, stage.grads().begin() + end);
    const double floor = 1e-3 * maxAbs(grad);
    std::uniform_int_distribution<size_t> pick(0, grad.size() - 1);
    for (int sample = 0; sample < 60; ++sample) {
      const size_t k = pick(rng);
      const double saved = layers[l][k], h = 1e-6;
      layers[l][k] = saved + h;
      const double up = ref.loss(layers, batch[0], lossScale);
      layers[l][k] = saved - h;
      const double down = ref.loss(layers, batch[0], lossScale);
      layers[l][k] = saved;
      const double fd = (up - down) / (2 * h);
      EXPECT_NEAR(grad[k], fd, 1e-2 * std::fabs(fd) + floor) << "layer " << l << " param " << k;
    }
  }
}

TEST_P(GptVariantTest, PipelineStagesGiveTheSingleStageLossAndGrads) {
  const GptConfig cfg = GetParam();
  const Batch batch = randomBatch(cfg, /*microbatches=*/2, /*seed=*/1);
  const RunResult one = runModel(cfg, singleStage(cfg), batch);
  for (std::vector<int> bounds :
       {std::vector<int>{0, 2, 4}, std::vector<int>{0, 1, 3, 4}, std::vector<int>{0, 1, 2, 4}}) {
    RunOptions opt = singleStage(cfg);
    opt.stageBounds = bounds;
    const RunResult split = runModel(cfg, opt, batch);
    // Every op runs on the same rows in the same order: bit-identical.
    EXPECT_EQ(split.loss, one.loss);
    for (int l = 0; l < cfg.numLayers(); ++l)
      EXPECT_EQ(split.grads[l][0], one.grads[l][0]) << "layer " << l;
  }
}

TEST_P(GptVariantTest, TensorParallelShardsGiveTheSingleRankLossAndShardedGrads) {
  const GptConfig cfg = GetParam();
  const Batch batch = randomBatch(cfg, /*microbatches=*/2, /*seed=*/2);
  const RunResult one = runModel(cfg, singleStage(cfg), batch);
  for (int tp : {2, 4}) {
    if (cfg.kvHeadCount() % tp != 0)
      continue; // key/value heads split across tp
    RunOptions opt = singleStage(cfg);
    opt.tp = tp;
    const RunResult sharded = runModel(cfg, opt, batch);
    EXPECT_NEAR(sharded.loss, one.loss, 1e-6 * one.loss) << "tp " << tp;
    for (int l = 0; l < cfg.numLayers(); ++l)
      for (int r = 0; r < tp; ++r)
        expectClose(sharded.grads[l][r], shardLayer(cfg, l, r, tp, one.grads[l][0]), 1e-5,
                    "tp " + std::to_string(tp) + " rank " + std::to_string(r) + " layer " +
                        std::to_string(l));
  }
}

TEST(GptKernelTest, VocabParallelCrossEntropyEqualsTheWholeVocabularyOne) {
  // Logits of 5 rows over 12 tokens, split into 3 shards of 4 columns; one row's mass sits in
  // one shard (another shard's max is far below), one row's target in each shard.
  const int n = 5, v = 12, parts = 3, vl = v / parts;
  const float scale = 0.25f;
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> logits(size_t(n) * v);
  for (float &l : logits)
    l = normal(rng);
  for (int c = 0; c < vl; ++c)
    logits[size_t(2) * v + c] += 80.0f; // row 2: shard 0 dominates
  const std::vector<int32_t> targets{0, 5, 9, 11, 4};
  // The reference: log-sum-exp in double, here.
  double wantLoss = 0;
  std::vector<double> wantLse(n);
  for (int r = 0; r < n; ++r) {
    const float *l = logits.data() + size_t(r) * v;
    const double top = *std::max_element(l, l + v);
    double sum = 0;
    for (int c = 0; c < v; ++c)
      sum += std::exp(double(l[c]) - top);
    wantLse[r] = top + std::log(sum);
    wantLoss += scale * (wantLse[r] - l[targets[r]]);
  }
  std::vector<float> probs(logits.size()), wantGrad(logits.size());
  ops::crossEntropyForward(probs.data(), logits.data(), targets.data(), n, v, scale);
  ops::crossEntropyBackward(wantGrad.data(), probs.data(), targets.data(), n, v, scale);
  // Each shard's statistics, summed as the tp all-reduce sums them.
  std::vector<std::vector<float>> shard(parts);
  std::vector<float> summed(ops::crossEntropyStatsFloats(n, parts), 0.0f);
  for (int p = 0; p < parts; ++p) {
    for (int r = 0; r < n; ++r)
      shard[p].insert(shard[p].end(), logits.begin() + r * v + p * vl,
                      logits.begin() + r * v + (p + 1) * vl);
    std::vector<float> stats(summed.size(), -1.0f);
    ops::crossEntropyShardStats(stats.data(), shard[p].data(), targets.data(), n, vl, p * vl, p,
                                parts);
    for (size_t k = 0; k < stats.size(); ++k)
      summed[k] += stats[k];
  }
  std::vector<float> lse(n);
  const double loss = ops::crossEntropyCombine(lse.data(), summed.data(), n, parts, scale);
  EXPECT_NEAR(loss, wantLoss, 1e-5 * std::abs(wantLoss));
  for (int r = 0; r < n; ++r)
    EXPECT_NEAR(lse[r], wantLse[r], 1e-5 * std::abs(wantLse[r])) << "row " << r;
  // Each shard's gradient columns are those of the whole vocabulary's.
  for (int p = 0; p < parts; ++p) {
    std::vector<float> grad(shard[p].size());
    ops::crossEntropyShardBackward(grad.data(), shard[p].data(), lse.data(), targets.data(), n, vl,
                                   p * vl, scale);
    for (int r = 0; r < n; ++r)
      for (int c = 0; c < vl; ++c)
        EXPECT_NEAR(grad[size_t(r) * vl + c], wantGrad[size_t(r) * v + p * vl + c], 1e-6)
            << "shard " << p << " row " << r << " column " << c;
  }
}

TEST(GptKernelTest, VocabParallelEmbeddingSumsToTheSingleRankLookupBitForBit) {
  const GptConfig cfg = tinyConfig();
  const Batch batch = randomBatch(cfg, /*microbatches=*/1, /*seed=*/4);
  const Slices whole{{0, cfg.seqLen}};
  StageCompute one(cfg, 0, 1, 0, 1, /*seed=*/5, whole, 1.0f);
  one.setBatch(batch);
  EXPECT_TRUE(one.forward(0, 0, 0, {}).empty()); // tp = 1: nothing to reduce
  const std::span<const float> want = one.output(0, 0);
  for (int tp : {2, 4}) {
    std::vector<std::unique_ptr<StageCompute>> ranks;
    std::vector<std::span<float>> bufs;
    for (int r = 0; r < tp; ++r) {
      ranks.push_back(std::make_unique<StageCompute>(cfg, 0, 1, r, tp, 5, whole, 1.0f));
      ranks.back()->setBatch(batch);
      bufs.push_back(ranks.back()->forward(0, 0, 0, {}));
      ASSERT_EQ(bufs.back().size(), want.size()) << "tp " << tp;
    }
    allReduce(bufs);
    for (int r = 0; r < tp; ++r)
      EXPECT_TRUE(std::ranges::equal(ranks[r]->output(0, 0), want)) << "tp " << tp << " rank " << r;
  }
}

TEST(GptKernelTest, ShardsConcatenateToTheFullInitialisation) {
  const GptConfig cfg = tinyConfig();
  for (int l = 0; l < cfg.numLayers(); ++l) {
    const std::vector<float> full = initLayerFull(cfg, l, /*seed=*/9);
    ASSERT_EQ(full.size(), layerParamCount(cfg, l, /*tp=*/1));
    size_t total = 0;
    for (int r = 0; r < 2; ++r) {
      std::vector<float> shard = shardLayer(cfg, l, r, /*tp=*/2, full);
      EXPECT_EQ(shard.size(), layerParamCount(cfg, l, /*tp=*/2));
      total += shard.size();
    }
    // Sharded tensors split, replicated ones (layernorms, row-parallel biases, wpe) copy; the
    // vocabulary tables (wte, lm.w) split by rows.
    const size_t c = size_t(cfg.channels);
    const GptLayerKind kind = layerKind(cfg, l);
    const size_t replicated = kind == GptLayerKind::Block       ? 6 * c
                              : kind == GptLayerKind::Embedding ? size_t(cfg.seqLen) * c
                                                                : 2 * c;
    EXPECT_EQ(total, full.size() + replicated) << "layer " << l;
  }
  // The tp = 2 rank 1 qkv bias is the second half of each of q, k and v (Megatron's split).
  std::vector<float> full(layerParamCount(cfg, 1, 1));
  for (size_t k = 0; k < full.size(); ++k)
    full[k] = float(k);
  const std::vector<float> shard = shardLayer(cfg, 1, /*tpRank=*/1, /*tp=*/2, full);
  const int c = cfg.channels;
  const size_t fullQkvB = 2 * c + 3 * c * c, shardQkvB = 2 * c + 3 * c * c / 2;
  EXPECT_EQ(shard[shardQkvB], full[fullQkvB + c / 2]);
  EXPECT_EQ(shard[shardQkvB + c / 2], full[fullQkvB + c + c / 2]);
  EXPECT_EQ(shard[shardQkvB + c], full[fullQkvB + 2 * c + c / 2]);
}

TEST(GptKernelTest, LlamaShardsSplitQueryAndKeyValueHeadsAndGateAndUpSeparately) {
  // Llama-shaped: channels 16, 4 heads of 4, 2 key/value heads (K = 8), ffn 32, no biases or
  // shifts. Full qkv.w is [16, 16 + 8 + 8]; fc.w is [16, 64] (gate | up).
  GptConfig cfg = tinyConfig();
  cfg.rmsnorm = cfg.swiglu = cfg.rope = true;
  cfg.kvHeads = 2;
  cfg.bias = false;
  const size_t c = 16;
  EXPECT_EQ(layerParamCount(cfg, 0, 1), 16 * c);                       // wte only
  EXPECT_EQ(layerParamCount(cfg, cfg.numLayers() - 1, 1), c + 16 * c); // lnf.w, lm.w
  // ln1.w, qkv.w, attn.w, ln2.w, fc.w, proj.w: the published formula h(h + 2kv) + h^2 + 3hf + 2h.
  EXPECT_EQ(layerParamCount(cfg, 1, 1), c * (c + 16) + c * c + 3 * c * 32 + 2 * c);
  std::vector<float> full(layerParamCount(cfg, 1, 1));
  for (size_t k = 0; k < full.size(); ++k)
    full[k] = float(k);
  const std::vector<float> shard = shardLayer(cfg, 1, /*tpRank=*/1, /*tp=*/2, full);
  ASSERT_EQ(shard.size(), layerParamCount(cfg, 1, 2));
  // Row 2 of qkv.w on rank 1: q heads 2, 3 (columns 8..15), key head 1 (20..23), value head 1
  // (28..31).
  const size_t fullRow = c + 2 * 32, shardRow = c + 2 * 16; // after ln1.w, two rows in
  for (int k = 0; k < 8; ++k)
    EXPECT_EQ(shard[shardRow + k], full[fullRow + 8 + k]) << "q " << k;
  for (int k = 0; k < 4; ++k) {
    EXPECT_EQ(shard[shardRow + 8 + k], full[fullRow + 20 + k]) << "k " << k;
    EXPECT_EQ(shard[shardRow + 12 + k], full[fullRow + 28 + k]) << "v " << k;
  }
  // fc.w row 0 on rank 1: gate columns 16..31, then up columns 48..63.
  const size_t fullFc = c + c * 32 + c * c + c, shardFc = c + c * 16 + c * c / 2 + c;
  for (int k = 0; k < 16; ++k) {
    EXPECT_EQ(shard[shardFc + k], full[fullFc + 16 + k]) << "gate " << k;
    EXPECT_EQ(shard[shardFc + 16 + k], full[fullFc + 48 + k]) << "up " << k;
  }
  EXPECT_EQ(paramName(cfg, 1, 2, shardFc + 16 * 32 - 1), "fc.w[15, 31]") << "16 x 32 on a rank";
  EXPECT_EQ(paramName(cfg, 1, 2, shardFc + 16 * 32), "proj.w[0, 0]") << "no fc.b";
  EXPECT_EQ(paramName(cfg, 1, 1, c), "qkv.w[0, 0]") << "no ln1.b";
}

TEST(GptKernelTest, ParamNamesGiveTheTensorAndItsRowAndColumnOnTheRank) {
  const GptConfig cfg = tinyConfig(); // channels 16, ffn 32, vocab 16, seq 8
  const size_t c = 16;
  EXPECT_EQ(paramName(cfg, 0, 1, 0), "wte[0, 0]");
  EXPECT_EQ(paramName(cfg, 0, 1, 16 * c + 3), "wpe[0, 3]");
  EXPECT_EQ(paramName(cfg, 1, 1, 5), "ln1.w[5]");
  EXPECT_EQ(paramName(cfg, 1, 1, 2 * c + 3 * c + 7), "qkv.w[1, 7]");
  // tp = 2: rank-local shapes (qkv.w is 16 x 24 on a rank, fc.w 16 x 16).
  EXPECT_EQ(paramName(cfg, 1, 2, 2 * c + 24 + 7), "qkv.w[1, 7]");
  const size_t fcW2 = 2 * c + 16 * 24 + 24 + 8 * 16 + c + 2 * c; // ln1, qkv, attn, ln2
  EXPECT_EQ(paramName(cfg, 1, 2, fcW2 + 16 + 1), "fc.w[1, 1]");
  // Row-parallel tensors: a rank holds rows / tp of them (attn.w 8 x 16, proj.w 16 x 16).
  const size_t attnW2 = 2 * c + 16 * 24 + 24;
  EXPECT_EQ(paramName(cfg, 1, 2, attnW2 + 16), "attn.w[1, 0]");
  EXPECT_EQ(paramName(cfg, 1, 2, attnW2 + 8 * 16 - 1), "attn.w[7, 15]");
  const size_t projW2 = fcW2 + 16 * 16 + 16; // fc.w, fc.b
  EXPECT_EQ(paramName(cfg, 1, 2, projW2 + 16 * 16 - 1), "proj.w[15, 15]");
  EXPECT_EQ(paramName(cfg, 1, 2, projW2 + 16 * 16), "proj.b[0]");
  const size_t block = layerParamCount(cfg, 1, 1);
  EXPECT_EQ(paramName(cfg, 1, 1, block - 1), "proj.b[15]");
  EXPECT_EQ(block, 2224u);
  EXPECT_EQ(paramName(cfg, 1, 1, block), "element 2224 past the layer's 2224 parameters");
  EXPECT_EQ(paramName(cfg, cfg.numLayers() - 1, 1, 2 * c + 1), "lm.w[0, 1]");
}

TEST_P(GptVariantTest, TheTensorsEveryTpRankHoldsWholeAreTheReplicatedOnes) {
  const GptConfig cfg = GetParam();
  // Gpt.h's layout: a block's layernorms and its row-parallel biases are whole on every rank.
  if (cfg.isGpt2()) {
    EXPECT_EQ(paramTensorsReplicated(cfg, 1),
              (std::vector<bool>{true, true, false, false, false, true, true, true, false, false,
                                 false, true}));
    // The vocabulary tables are split by rows (vocab-parallel); wpe and lnf are whole.
    EXPECT_EQ(paramTensorsReplicated(cfg, 0), (std::vector<bool>{false, true}));
    EXPECT_EQ(paramTensorsReplicated(cfg, cfg.numLayers() - 1),
              (std::vector<bool>{true, true, false}));
  }
  // ... and exactly the tensors whose size does not shrink with tp.
  for (int l = 0; l < cfg.numLayers(); ++l) {
    const std::vector<size_t> whole = paramTensorOffsets(cfg, l, 1),
                              half = paramTensorOffsets(cfg, l, 2);
    const std::vector<bool> replicated = paramTensorsReplicated(cfg, l);
    ASSERT_EQ(replicated.size() + 1, whole.size());
    for (size_t i = 0; i < replicated.size(); ++i)
      EXPECT_EQ(replicated[i], whole[i + 1] - whole[i] == half[i + 1] - half[i])
          << "layer " << l << " tensor " << i;
  }
}

TEST_P(GptVariantTest, UnshardingEveryRanksShardRebuildsTheFullTensor) {
  const GptConfig cfg = GetParam();
  for (int tp : {2, 4}) {
    if (cfg.kvHeadCount() % tp != 0)
      continue; // key/value heads split across tp
    for (int l = 0; l < cfg.numLayers(); ++l) {
      std::vector<float> full(layerParamCount(cfg, l, 1));
      for (size_t k = 0; k < full.size(); ++k)
        full[k] = float(k); // every place its own value
      std::vector<float> rebuilt(full.size(), -1.0f);
      for (int r = 0; r < tp; ++r)
        unshardLayer(cfg, l, r, tp, shardLayer(cfg, l, r, tp, full), rebuilt);
      EXPECT_EQ(rebuilt, full) << "layer " << l << " tp " << tp;
      // One rank writes exactly its own places: the others stay untouched.
      std::vector<float> one(full.size(), -1.0f);
      unshardLayer(cfg, l, /*tpRank=*/tp - 1, tp, shardLayer(cfg, l, tp - 1, tp, full), one);
      const size_t written =
          size_t(std::count_if(one.begin(), one.end(), [](float x) { return x >= 0; }));
      EXPECT_EQ(written, layerParamCount(cfg, l, tp)) << "layer " << l << " tp " << tp;
    }
  }
}

TEST_P(GptVariantTest, SubSequenceSlicesGiveTheWholeSequenceLossAndGrads) {
  const GptConfig cfg = GetParam();
  const Batch batch = randomBatch(cfg, /*microbatches=*/2, /*seed=*/3);
  const RunResult one = runModel(cfg, singleStage(cfg), batch);
  for (Slices slices : {Slices{{0, 2}, {2, 4}, {4, 6}, {6, 8}}, Slices{{0, 3}, {3, 4}, {4, 8}}}) {
    RunOptions opt = singleStage(cfg);
    opt.slices = slices;
    const RunResult sliced = runModel(cfg, opt, batch);
    EXPECT_NEAR(sliced.loss, one.loss, 1e-5 * one.loss);
    expectSameGrads(sliced, one, 1e-5);
  }
}

TEST_P(GptVariantTest, StagesShardsAndSlicesTogetherGiveTheSingleRankGrads) {
  const GptConfig cfg = GetParam();
  const Batch batch = randomBatch(cfg, /*microbatches=*/3, /*seed=*/4);
  RunOptions base = singleStage(cfg);
  base.microbatches = 3;
  const RunResult one = runModel(cfg, base, batch);
  RunOptions opt = base;
  opt.stageBounds = {0, 2, 4};
  opt.tp = cfg.kvHeadCount() % 2 == 0 ? 2 : 1; // multi-query: one key/value head
  opt.slices = {{0, 4}, {4, 5}, {5, 8}};
  opt.deferWeight = true;
  const RunResult all = runModel(cfg, opt, batch);
  EXPECT_NEAR(all.loss, one.loss, 1e-5 * one.loss);
  for (int l = 0; l < cfg.numLayers(); ++l)
    for (int r = 0; r < opt.tp; ++r)
      expectClose(all.grads[l][r], shardLayer(cfg, l, r, opt.tp, one.grads[l][0]), 1e-5,
                  "layer " + std::to_string(l));
}

TEST_P(GptVariantTest, DeferredBackwardWeightEqualsImmediate) {
  const GptConfig cfg = GetParam();
  const Batch batch = randomBatch(cfg, /*microbatches=*/2, /*seed=*/5);
  RunOptions opt = singleStage(cfg);
  opt.stageBounds = {0, 2, 4};
  opt.slices = {{0, 2}, {2, 4}, {4, 6}, {6, 8}};
  const RunResult fused = runModel(cfg, opt, batch);
  opt.deferWeight = true;
  const RunResult split = runModel(cfg, opt, batch);
  EXPECT_EQ(split.loss, fused.loss);
  for (int l = 0; l < cfg.numLayers(); ++l)
    EXPECT_EQ(split.grads[l][0], fused.grads[l][0]) << "layer " << l;
  // What backward_weight needs is held until it runs, and freed by it.
  EXPECT_EQ(fused.savedBytesMid, 0u);
  EXPECT_GT(split.savedBytesMid, 0u);
  EXPECT_EQ(split.savedBytesAfter, 0u);
}

TEST(GptKernelTest, SavedBytesAreHeldFromForwardUntilBackwardWeight) {
  const GptConfig cfg = tinyConfig();
  StageCompute stage(cfg, 1, 3, /*tpRank=*/0, /*tp=*/1, /*seed=*/1, {{0, 4}, {4, 8}}, 1.0f);
  const std::vector<float> input(size_t(cfg.microbatch) * 4 * cfg.channels, 0.5f);
  EXPECT_EQ(stage.savedBytes(), 0u);
  for (int k = 0; k < 2; ++k)
    for (int part = 0; part < stage.parts(); ++part)
      stage.forward(0, k, part, input);
  stage.output(0, 1);
  const size_t afterForward = stage.savedBytes();
  EXPECT_GT(afterForward, 0u);
  for (int k = 1; k >= 0; --k) {
    for (int part = 0; part < stage.parts(); ++part)
      stage.backwardInput(0, k, part, input);
    EXPECT_EQ(stage.inputGrad(0, k).size(), input.size());
  }
  // The attention weights and K/V are gone; the output gradients for backward_weight are kept.
  EXPECT_GT(stage.savedBytes(), 0u);
  stage.backwardWeight(0, 1);
  stage.backwardWeight(0, 0);
  EXPECT_EQ(stage.savedBytes(), 0u);
}

TEST(GptKernelTest, AdamStepMatchesTheHandComputedUpdate) {
  const GptConfig cfg = tinyConfig();
  StageCompute stage(cfg, 0, 1, /*tpRank=*/0, /*tp=*/1, /*seed=*/1, {{0, cfg.seqLen}}, 1.0f);
  const float lr = 0.1f, b1 = 0.9f, b2 = 0.99f, eps = 1e-8f, wd = 0.01f;
  const std::vector<float> g1{0.5f, -2.0f, 1e-3f}, g2{-0.25f, 1.0f, 0.0f};
  std::vector<double> p(3), m(3, 0.0), v(3, 0.0);
  for (int k = 0; k < 3; ++k)
    p[k] = stage.params()[k * 7];
  for (int step = 1; step <= 2; ++step) {
    const std::vector<float> &g = step == 1 ? g1 : g2;
    stage.zeroGrads();
    for (int k = 0; k < 3; ++k)
      stage.grads()[k * 7] = g[k];
    stage.adamStep(lr, b1, b2, eps, wd);
    for (int k = 0; k < 3; ++k) {
      m[k] = b1 * m[k] + (1 - b1) * g[k];
      v[k] = b2 * v[k] + (1 - b2) * double(g[k]) * g[k];
      const double mHat = m[k] / (1 - std::pow(double(b1), step));
      const double vHat = v[k] / (1 - std::pow(double(b2), step));
      p[k] -= lr * (mHat / (std::sqrt(vHat) + eps) + wd * p[k]);
      EXPECT_NEAR(stage.params()[k * 7], p[k], 1e-6) << "step " << step << " element " << k;
    }
  }
}

TEST(GptKernelTest, TiedEmbeddingsStartEqualAndReportTheirRanges) {
  GptConfig cfg = tinyConfig();
  cfg.tiedEmbeddings = true;
  const size_t matrix = size_t(cfg.vocab) * cfg.channels;
  const std::vector<float> embedding = initLayerFull(cfg, 0, /*seed=*/4);
  const std::vector<float> head = initLayerFull(cfg, cfg.numLayers() - 1, /*seed=*/4);
  EXPECT_TRUE(std::equal(embedding.begin(), embedding.begin() + matrix, head.end() - matrix));

  const Slices whole{{0, cfg.seqLen}};
  StageCompute first(cfg, 0, 2, 0, 1, 4, whole, 1.0f), last(cfg, 2, 4, 0, 1, 4, whole, 1.0f);
  EXPECT_EQ(first.tiedEmbeddingRange(), (std::pair<size_t, size_t>{0, matrix}));
  const size_t headBegin = last.layerRange(cfg.numLayers() - 1).first + 2 * cfg.channels;
  EXPECT_EQ(last.tiedEmbeddingRange(), (std::pair<size_t, size_t>{headBegin, headBegin + matrix}));
  EXPECT_TRUE(std::equal(first.params().begin(), first.params().begin() + matrix,
                         last.params().begin() + headBegin));
  StageCompute middle(cfg, 1, 3, 0, 1, 4, whole, 1.0f);
  EXPECT_EQ(middle.tiedEmbeddingRange(), (std::pair<size_t, size_t>{0, 0}));
  cfg.tiedEmbeddings = false;
  StageCompute untied(cfg, 0, 2, 0, 1, 4, whole, 1.0f);
  EXPECT_EQ(untied.tiedEmbeddingRange(), (std::pair<size_t, size_t>{0, 0}));
}

TEST(GptKernelTest, OneStageTiesItsTwoEmbeddingCopiesAsTheAllReduceWould) {
  GptConfig cfg = tinyConfig();
  cfg.tiedEmbeddings = true;
  const Batch batch = randomBatch(cfg, /*microbatches=*/2, /*seed=*/6);
  const RunResult one = runModel(cfg, singleStage(cfg), batch);
  RunOptions opt = singleStage(cfg);
  opt.stageBounds = {0, 2, 4};
  const RunResult two = runModel(cfg, opt, batch);
  const size_t matrix = size_t(cfg.vocab) * cfg.channels;
  const std::vector<float> &wte = one.grads[0][0], &lm = one.grads[cfg.numLayers() - 1][0];
  // Both copies of the single stage hold the summed gradient, bit for bit.
  EXPECT_TRUE(std::equal(wte.begin(), wte.begin() + matrix, lm.end() - matrix));
  std::vector<float> summed(matrix), oneWte(wte.begin(), wte.begin() + matrix);
  for (size_t k = 0; k < matrix; ++k)
    summed[k] = two.grads[0][0][k] + two.grads[cfg.numLayers() - 1][0][lm.size() - matrix + k];
  expectClose(oneWte, summed, 1e-5, "tied wte");
}

TEST(GptKernelTest, TrainingOnALearnableSequenceHalvesTheLoss) {
  const GptConfig cfg = tinyConfig();
  const int microbatches = 2;
  const float lossScale = 1.0f / float(microbatches * cfg.microbatch * cfg.seqLen);
  StageCompute stage(cfg, 0, cfg.numLayers(), 0, 1, /*seed=*/8, {{0, 4}, {4, 8}}, lossScale);
  std::mt19937 rng(21);
  std::uniform_int_distribution<int32_t> start(0, cfg.vocab - 1);
  double firstLoss = 0, lastLoss = 0;
  for (int step = 0; step < 40; ++step) {
    // Next token = (3 t + 1) mod vocab from a random first token.
    Batch batch(microbatches);
    for (std::vector<int32_t> &mb : batch)
      for (int s = 0; s < cfg.microbatch; ++s) {
        int32_t t = start(rng);
        for (int p = 0; p <= cfg.seqLen; ++p, t = (3 * t + 1) % cfg.vocab)
          mb.push_back(t);
      }
    stage.setBatch(batch);
    stage.zeroGrads();
    double loss = 0;
    for (int mb = 0; mb < microbatches; ++mb) {
      for (int k = 0; k < 2; ++k) {
        for (int part = 0; part < stage.parts(); ++part)
          stage.forward(mb, k, part, {});
        loss += stage.loss(mb, k);
      }
      for (int k = 1; k >= 0; --k) {
        for (int part = 0; part < stage.parts(); ++part)
          stage.backwardInput(mb, k, part, {});
        stage.backwardWeight(mb, k);
      }
    }
    stage.adamStep(/*lr=*/1e-2f, /*beta1=*/0.9f, /*beta2=*/0.999f, /*eps=*/1e-8f,
                   /*weightDecay=*/0.0f);
    if (step == 0)
      firstLoss = loss;
    lastLoss = loss;
  }
  EXPECT_NEAR(firstLoss, std::log(double(cfg.vocab)), 0.2);
  EXPECT_LT(lastLoss, 0.5 * firstLoss) << "first " << firstLoss << ", last " << lastLoss;
}

TEST(GptKernelTest, SameCallsGiveBitIdenticalResults) {
  const GptConfig cfg = tinyConfig();
  const Batch batch = randomBatch(cfg, /*microbatches=*/2, /*seed=*/7);
  RunOptions opt = singleStage(cfg);
  opt.slices = {{0, 3}, {3, 8}};
  opt.tp = 2;
  const RunResult a = runModel(cfg, opt, batch), b = runModel(cfg, opt, batch);
  EXPECT_EQ(a.loss, b.loss);
  EXPECT_EQ(a.grads, b.grads);
}

INSTANTIATE_TEST_SUITE_P(Blocks, GptVariantTest, ::testing::ValuesIn([] {
                           std::vector<GptConfig> out;
                           for (const Variant &v : variants())
                             out.push_back(v.cfg);
                           return out;
                         }()),
                         [](const ::testing::TestParamInfo<GptConfig> &info) {
                           return std::string(variants()[info.index].name);
                         });

} // namespace
} // namespace pipec::kernels
