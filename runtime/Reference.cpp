#include "runtime/Reference.h"

#include "ir/support/Error.h"
#include "ir/support/Hash.h"
#include "ir/support/Limits.h"

#include <algorithm>

#include <fmt/format.h>

#include <cassert>
#include <cmath>
#include <cstring>
#include <span>

namespace pipec {

std::vector<std::vector<int32_t>> stepBatch(const DataSource &data, const kernels::GptConfig &cfg,
                                            const ParallelConfig &pc, int step, int replica) {
  std::vector<std::vector<int32_t>> out;
  for (int m = 0; m < pc.microbatches; ++m) {
    uint64_t global =
        (uint64_t(step) * uint64_t(pc.dp) + uint64_t(replica)) * uint64_t(pc.microbatches) +
        uint64_t(m);
    out.push_back(microbatchTokens(data, global, cfg.microbatch, cfg.seqLen));
  }
  return out;
}

std::vector<std::pair<int, int>> slicesOf(const Plan &plan) {
  std::vector<std::pair<int, int>> s;
  for (auto [b, e] : plan.seqSlices)
    s.emplace_back(int(b), int(e));
  return s;
}

float lossScaleOf(const Plan &plan, const kernels::GptConfig &cfg) {
  const ParallelConfig &pc = plan.parallel;
  return 1.0f / float(int64_t(pc.microbatches) * pc.dp * cfg.microbatch * cfg.seqLen);
}

ReferenceRun::ReferenceRun(const Plan &plan, const kernels::GptConfig &cfg, const DataSource &data,
                           uint64_t seed, float lr)
    : plan(plan), cfg(cfg), data(data), lr(lr),
      sc(cfg, 0, cfg.numLayers(), 0, 1, seed, {{0, cfg.seqLen}}, lossScaleOf(plan, cfg)) {}

double ReferenceRun::step(int index) {
  const ParallelConfig &pc = plan.parallel;
  std::vector<std::vector<int32_t>> batch;
  for (int d = 0; d < pc.dp; ++d)
    for (auto &mb : stepBatch(data, cfg, pc, index, d))
      batch.push_back(std::move(mb));
  sc.zeroGrads();
  sc.setBatch(batch);
  double loss = 0;
  for (int m = 0; m < int(batch.size()); ++m) {
    for (int p = 0; p < sc.parts(); ++p)
      sc.forward(m, 0, p, {});
    loss += sc.loss(m, 0);
    for (int p = 0; p < sc.parts(); ++p)
      sc.backwardInput(m, 0, p, {});
    sc.backwardWeight(m, 0);
  }
  return loss; // (one stage holding both tied copies sums their gradients itself)
}

namespace {
/// Calls `layer(stage, tpRank, layerIndex, part)` for every layer of every (stage, tp rank) of
/// the plan with that layer's part of the snapshot (the rank's shard, as the stage stores it).
template <typename Layer>
void forEachLayerShard(const Plan &plan, const kernels::GptConfig &cfg,
                       const ParamSnapshot &snapshot, Layer &&layer) {
  const int tp = plan.parallel.tp;
  for (const StageInfo &st : plan.stages)
    for (int t = 0; t < tp; ++t) {
      auto it = snapshot.byStageAndTp.find({st.stage, t});
      assert(it != snapshot.byStageAndTp.end() && "every stage and tp rank is snapshotted");
      std::span<const float> mine = it->second;
      size_t offset = 0;
      for (int l = st.layerBegin; l < st.layerEnd; ++l) {
        const size_t n = kernels::layerParamCount(cfg, l, tp);
        assert(offset + n <= mine.size() && "snapshot shorter than the stage");
        layer(st, t, l, mine.subspan(offset, n));
        offset += n;
      }
    }
}
} // namespace

void ReferenceRun::compare(const ParamSnapshot &snapshot, GradCheck &check, int step) {
  const int tp = plan.parallel.tp;
  // Per tensor: its largest difference and reference gradient, and where the difference was.
  struct Tensor {
    double diff, scale;
    GradDiffPlace place;
  };
  std::vector<Tensor> tensors;
  double stepScale = 0;
  forEachLayerShard(
      plan, cfg, snapshot, [&](const StageInfo &st, int t, int l, std::span<const float> mine) {
        auto [b, e] = sc.layerRange(l);
        const std::vector<float> want =
            kernels::shardLayer(cfg, l, t, tp, sc.grads().subspan(b, e - b));
        const std::vector<size_t> bounds = kernels::paramTensorOffsets(cfg, l, tp);
        for (size_t i = 0; i + 1 < bounds.size(); ++i) {
          double tensorDiff = 0, tensorScale = 0;
          size_t worstAt = bounds[i];
          for (size_t k = bounds[i]; k < bounds[i + 1]; ++k) {
            const double w = want[k];
            double diff = std::fabs(w - double(mine[k]));
            if (std::isfinite(w))
              tensorScale = std::max(tensorScale, std::fabs(w));
            else
              diff = INFINITY; // a broken reference must not pass, nor widen the tolerance
            if (std::isnan(diff))
              diff = INFINITY;
            if (diff > tensorDiff) {
              tensorDiff = diff;
              worstAt = k;
            }
          }
          stepScale = std::max(stepScale, tensorScale);
          if (bounds[i] == bounds[i + 1])
            continue;
          GradDiffPlace place{
              step,          st.stage,     t, l, kernels::paramName(cfg, l, tp, worstAt),
              mine[worstAt], want[worstAt]};
          if (tensorDiff > check.maxAbsDiff) {
            check.maxAbsDiff = tensorDiff;
            check.worst = place;
          }
          tensors.push_back({tensorDiff, tensorScale, std::move(place)});
        }
      });
  check.scale = std::max(check.scale, stepScale);
  for (Tensor &t : tensors) {
    const double relative = t.diff / std::max(t.scale, 1e-3 * stepScale);
    if (relative > check.maxTensorDiff) {
      check.maxTensorDiff = relative;
      check.worstTensor = std::move(t.place);
    }
  }
}

void ReferenceRun::adopt(const ParamSnapshot &snapshot) {
  // (tp ranks in order: of a tensor every rank holds whole, adoptedTpRank()'s copy stays.)
  forEachLayerShard(
      plan, cfg, snapshot, [&](const StageInfo &, int t, int l, std::span<const float> mine) {
        auto [b, e] = sc.layerRange(l);
        kernels::unshardLayer(cfg, l, t, plan.parallel.tp, mine, sc.grads().subspan(b, e - b));
      });
}

WeightCheck ReferenceRun::compareWeights(const ParamSnapshot &weights, int steps) {
  WeightCheck check;
  check.steps = steps;
  const int tp = plan.parallel.tp;
  forEachLayerShard(
      plan, cfg, weights, [&](const StageInfo &st, int t, int l, std::span<const float> mine) {
        auto [b, e] = sc.layerRange(l);
        const std::vector<float> want =
            kernels::shardLayer(cfg, l, t, tp, sc.params().subspan(b, e - b));
        const std::vector<size_t> bounds = kernels::paramTensorOffsets(cfg, l, tp);
        const std::vector<bool> replicated = kernels::paramTensorsReplicated(cfg, l);
        for (size_t i = 0; i + 1 < bounds.size(); ++i) {
          // A copy that stepped on its own gradients, which adopt() did not take: it need only
          // be finite here, and equal to the adopted copy (firstTpCopyMismatch).
          const bool ownSteps = replicated[i] && t != adoptedTpRank(tp);
          for (size_t k = bounds[i]; k < bounds[i + 1]; ++k) {
            const double w = want[k], diff = std::fabs(w - double(mine[k]));
            const double bound = weightBound(w, steps, lr);
            // (A NaN on either side makes diff NaN, an infinite reference weight the bound.)
            double ratio = std::isfinite(diff) && std::isfinite(bound)
                               ? (diff == 0 ? 0.0 : diff / bound)
                               : INFINITY;
            if (ownSteps && ratio != INFINITY)
              ratio = 0;
            if (ratio > check.maxRatio) {
              check.maxRatio = ratio;
              check.diff = diff;
              check.bound = bound;
              check.worst = {steps - 1, st.stage, t, l, kernels::paramName(cfg, l, tp, k),
                             mine[k],   want[k]};
            }
          }
        }
      });
  check.tp = tp;
  check.tpCopy = firstTpCopyMismatch(plan, cfg, weights, steps - 1);
  check.dp = plan.parallel.dp;
  std::map<std::pair<int, int>, uint64_t> replica0; // of the weights compared above
  if (check.dp > 1)
    for (const auto &[key, mine] : weights.byStageAndTp)
      replica0[key] = weightDigest(mine);
  for (int d = 1; d < plan.parallel.dp && check.dpCopy.replica < 0; ++d)
    for (const auto &[key, digest] : replica0) {
      auto it = weights.digests.find({d, key.first, key.second});
      if (it == weights.digests.end() || it->second != digest) {
        check.dpCopy = {d, key.first, key.second, it == weights.digests.end()};
        break;
      }
    }
  return check;
}

uint64_t weightDigest(std::span<const float> values) {
  return fnv1a(values.data(), values.size_bytes());
}

GradDiffPlace firstTpCopyMismatch(const Plan &plan, const kernels::GptConfig &cfg,
                                  const ParamSnapshot &snapshot, int step) {
  const int tp = plan.parallel.tp, adopted = adoptedTpRank(tp);
  for (const StageInfo &st : plan.stages) {
    auto copyOf = [&](int t) -> std::span<const float> {
      auto it = snapshot.byStageAndTp.find({st.stage, t});
      assert(it != snapshot.byStageAndTp.end() && "every stage and tp rank is snapshotted");
      return it->second;
    };
    const std::span<const float> want = copyOf(adopted);
    for (int t = 0; t < tp; ++t) {
      if (t == adopted)
        continue;
      const std::span<const float> mine = copyOf(t);
      size_t offset = 0;
      for (int l = st.layerBegin; l < st.layerEnd; ++l) {
        const std::vector<size_t> bounds = kernels::paramTensorOffsets(cfg, l, tp);
        const std::vector<bool> replicated = kernels::paramTensorsReplicated(cfg, l);
        for (size_t i = 0; i + 1 < bounds.size(); ++i) {
          if (!replicated[i])
            continue;
          for (size_t k = offset + bounds[i]; k < offset + bounds[i + 1]; ++k) {
            assert(k < mine.size() && k < want.size() && "snapshot shorter than the stage");
            if (std::memcmp(&mine[k], &want[k], sizeof(float)) != 0)
              return {step,    st.stage, t, l, kernels::paramName(cfg, l, tp, k - offset),
                      mine[k], want[k]};
          }
        }
        offset += kernels::layerParamCount(cfg, l, tp);
      }
    }
  }
  return {};
}

namespace {
std::string placeText(const GradDiffPlace &w) {
  return fmt::format("step {}, stage {} (tp rank {}), layer {}, {}: {:.6e} against the "
                     "reference's {:.6e}",
                     w.step, w.stage, w.tpRank, w.layer, w.param, w.got, w.want);
}

/// 1e-5, 5e-2: a tolerance as the docs write it.
std::string toleranceText(double relative) {
  std::string text = fmt::format("{:.0e}", relative); // "1e-05"
  if (size_t e = text.find("e-0"); e != std::string::npos)
    text.erase(e + 2, 1);
  return text;
}

const char *nanNote(const GradDiffPlace &w) {
  return std::isnan(w.got) ? " (the run's gradient there is NaN)" : "";
}
} // namespace

std::string gradCheckReport(const GradCheck &g) {
  std::string out = fmt::format("max_abs_grad_diff={:.3e} (largest reference gradient {:.3e})\n",
                                g.maxAbsDiff, g.scale);
  if (g.worst.step >= 0) // (no place: every gradient equal to the reference's)
    out += fmt::format("largest difference: {}\n", placeText(g.worst));
  out +=
      fmt::format("max_tensor_grad_diff={:.3e} (of the tensor's largest reference gradient){}\n",
                  g.maxTensorDiff, g.worstTensor.step >= 0 ? ": " + placeText(g.worstTensor) : "");
  return out;
}

llvm::Error judgeGradCheck(const GradCheck &g, double relative, double perTensor) {
  const double tolerance = relative * g.scale;
  if (g.maxAbsDiff > tolerance)
    return finding("gradients differ from the single-rank reference by {:.3e}, more than {} of "
                   "the gradient scale ({:.3e}){}",
                   g.maxAbsDiff, toleranceText(relative), tolerance, nanNote(g.worst));
  if (g.maxTensorDiff > perTensor) {
    const GradDiffPlace &w = g.worstTensor;
    return finding("the gradient of {} (layer {}, stage {}, tp rank {}) differs from the "
                   "single-rank reference by {:.3e} of the tensor's largest reference gradient, "
                   "more than {:g}{}",
                   w.param.substr(0, w.param.find('[')), w.layer, w.stage, w.tpRank,
                   g.maxTensorDiff, perTensor, nanNote(w));
  }
  return llvm::Error::success();
}

namespace {
constexpr const char *kWeightBoundText =
    "1e-3 of lr, plus per step 1e-5 of lr and 2^-20 of the weight";
} // namespace

std::string weightCheckReport(const WeightCheck &w) {
  std::string place;
  if (w.worst.step >= 0) // (no place: every weight equal to the reference's)
    place = fmt::format(": {} ({:.3e} apart, bound {:.3e})", placeText(w.worst), w.diff, w.bound);
  std::string out =
      fmt::format("max_weight_diff={:.3e} of its bound after {} AdamW step(s) (bound: {}){}\n",
                  w.maxRatio, w.steps, kWeightBoundText, place);
  if (w.tp > 1) {
    const GradDiffPlace &c = w.tpCopy;
    if (c.step < 0)
      out += fmt::format("tp_copies=identical (the {} tp ranks' copies of every tensor they hold "
                         "whole, bit for bit)\n",
                         w.tp);
    else
      out += fmt::format("tp_copies=differ: stage {}, layer {}, {}: tp rank {} holds {:.9e}, tp "
                         "rank {} {:.9e}\n",
                         c.stage, c.layer, c.param, c.tpRank, c.got, adoptedTpRank(w.tp), c.want);
  }
  if (w.dp > 1) {
    const WeightCheck::Replica &r = w.dpCopy;
    if (r.replica < 0)
      out += fmt::format("dp_copies=identical (the {} dp replicas' weights, bit for bit)\n", w.dp);
    else if (r.missing)
      out += fmt::format("dp_copies=differ: dp replica {} reported no weights of stage {} (tp rank "
                         "{}); its process failed and says why\n",
                         r.replica, r.stage, r.tpRank);
    else
      out += fmt::format("dp_copies=differ: dp replica {}'s weights of stage {} (tp rank {}) are "
                         "not replica 0's\n",
                         r.replica, r.stage, r.tpRank);
  }
  return out;
}

llvm::Error judgeWeightCheck(const WeightCheck &w) {
  if (w.maxRatio <= 1) {
    const GradDiffPlace &c = w.tpCopy;
    const WeightCheck::Replica &r = w.dpCopy;
    if (w.tp <= 1 || c.step < 0) {
      if (w.dp <= 1 || r.replica < 0)
        return llvm::Error::success();
      if (r.missing)
        return finding("after {} AdamW step(s), dp replica {} reported no weights of stage {} (tp "
                       "rank {}), so they could not be compared with replica 0's; its process "
                       "failed and its own error says why",
                       w.steps, r.replica, r.stage, r.tpRank);
      return finding("after {} AdamW step(s), dp replica {}'s weights of stage {} (tp rank {}) "
                     "differ from replica 0's; every replica must take the same steps from the "
                     "same all-reduced gradients (a tensor left out of the dp all-reduce, or a "
                     "replica that stepped differently)",
                     w.steps, r.replica, r.stage, r.tpRank);
    }
    return finding("after {} AdamW step(s), tp ranks {} and {} hold different copies of the "
                   "weight {} (layer {}, stage {}), which every tp rank holds whole: {:.9e} and "
                   "{:.9e}; they must stay equal to the last bit, or the copies drift apart (a "
                   "gradient kernel whose sums depend on scheduling, or tp ranks that summed "
                   "different inputs)",
                   w.steps, c.tpRank, adoptedTpRank(w.tp), c.param, c.layer, c.stage, c.got,
                   c.want);
  }
  const GradDiffPlace &p = w.worst;
  return finding("after {} AdamW step(s) on the same gradients, the weight {} (layer {}, stage {}, "
                 "tp rank {}) is {:.6e} where the single-rank reference's is {:.6e}: {:.3e} apart, "
                 "more than its bound {:.3e} ({}): the run's optimizer steps differ from the "
                 "reference's",
                 w.steps, p.param, p.layer, p.stage, p.tpRank, p.got, p.want, w.diff, w.bound,
                 kWeightBoundText);
}

std::string referenceCheckReport(const GradCheck &grads, const WeightCheck &weights) {
  return gradCheckReport(grads) + weightCheckReport(weights);
}

llvm::Error judgeReferenceCheck(const GradCheck &grads, const WeightCheck &weights, double relative,
                                double perTensor) {
  if (auto err = judgeGradCheck(grads, relative, perTensor))
    return err;
  return judgeWeightCheck(weights);
}

void ReferenceRun::update() { sc.adamStep(lr, kAdamBeta1, kAdamBeta2, kAdamEps, kAdamWeightDecay); }

llvm::Expected<kernels::GptConfig> gptConfigOf(const Plan &plan) {
  if (!plan.transformer)
    return inputError("the plan's model '{}' is an abstract layer list; the cpu backend runs "
                      "transformer models (compile one with a \"transformer\" model spec, e.g. "
                      "examples/tiny-gpt.json)",
                      plan.model);
  const TransformerConfig &t = *plan.transformer;
  if (t.hiddenSize > kCpuMaxHiddenSize || t.seqLength > kCpuMaxSeqLength ||
      t.vocabSize > kCpuMaxVocabSize || t.numLayers > kCpuMaxLayers ||
      t.microbatchSize > kCpuMaxMicrobatchSize)
    return inputError("model '{}' is too large for the cpu reference backend (hidden {}, "
                      "seq_length {}, vocab {}); use a small model such as "
                      "examples/tiny-gpt.json",
                      plan.model, t.hiddenSize, t.seqLength, t.vocabSize);
  const ParallelConfig &pc = plan.parallel;
  // The threads and streams are indexed by these: the plan must agree with itself.
  if (plan.numRanks() != pc.pp || plan.numStages() != pc.numStages() || pc.tp < 1 || pc.dp < 1 ||
      int(plan.seqSlices.size()) != pc.seqSplits)
    return inputError("$.parallel: pp {} x vpp {} with seq_splits {} but the plan has {} rank "
                      "streams, {} stages and {} seq_slices",
                      pc.pp, pc.vpp, pc.seqSplits, plan.numRanks(), plan.numStages(),
                      plan.seqSlices.size());
  if (t.numAttentionHeads % pc.tp != 0 || t.ffnHiddenSize % pc.tp != 0)
    return inputError("--tp {} must divide num_attention_heads ({}) and ffn_hidden_size ({})",
                      pc.tp, t.numAttentionHeads, t.ffnHiddenSize);
  // (The plan's model passed the model reader's checks: heads divide hidden_size, groups
  // divide heads.)
  if (t.kvHeads() % pc.tp != 0) {
    int64_t best = 1;
    for (int64_t d = 1; d <= pc.tp; ++d)
      if (t.kvHeads() % d == 0 && t.numAttentionHeads % d == 0 && t.ffnHiddenSize % d == 0 &&
          t.vocabSize % d == 0)
        best = d;
    return inputError("--tp {} must divide num_query_groups ({}): each tp rank holds whole "
                      "key/value heads; compile the plan with --tp {}",
                      pc.tp, t.kvHeads(), best);
  }
  if (t.position == Position::Rope && (t.hiddenSize / t.numAttentionHeads) % 2 != 0) {
    int64_t heads = 1; // the most heads up to the model's whose size is even
    for (int64_t h = 1; h <= t.numAttentionHeads; ++h)
      if (t.hiddenSize % h == 0 && (t.hiddenSize / h) % 2 == 0)
        heads = h;
    return inputError("$.transformer.position: \"rope\" turns pairs of a head's channels, so "
                      "the head size (hidden_size / num_attention_heads = {}) must be even; "
                      "give the model {} heads, or learned positions",
                      t.hiddenSize / t.numAttentionHeads, heads);
  }
  if (t.vocabSize % pc.tp != 0)
    return inputError("--tp {} must divide vocab_size ({}): the runtime splits the vocabulary "
                      "across the tp ranks (vocab-parallel embedding and cross entropy); pad "
                      "vocab_size to a multiple of {} (e.g. {}), as Megatron-LM does",
                      pc.tp, t.vocabSize, pc.tp, (t.vocabSize + pc.tp - 1) / pc.tp * pc.tp);
  // The threads and per-op buffers of a run must stay reasonable on one machine.
  int64_t threads = int64_t(pc.pp) * pc.dp * pc.tp;
  if (threads > kCpuMaxThreads)
    return inputError("the plan needs {} threads (pp x dp x tp); the cpu backend runs at most "
                      "{}",
                      threads, kCpuMaxThreads);
  if (pc.microbatches >= kCpuMaxMicrobatches || pc.seqSplits >= kCpuMaxSeqSplits)
    return inputError("the cpu backend runs at most 2^20 microbatches and {} seq-splits (got "
                      "{} and {})",
                      kCpuMaxSeqSplits, pc.microbatches, pc.seqSplits);
  kernels::GptConfig cfg;
  cfg.vocab = int(t.vocabSize);
  cfg.seqLen = int(t.seqLength);
  cfg.channels = int(t.hiddenSize);
  cfg.heads = int(t.numAttentionHeads);
  cfg.layers = int(t.numLayers);
  cfg.ffn = int(t.ffnHiddenSize);
  cfg.microbatch = int(t.microbatchSize);
  cfg.tiedEmbeddings = t.tieEmbeddings;
  cfg.rmsnorm = t.norm == Norm::RmsNorm;
  cfg.swiglu = t.mlp == Mlp::SwiGlu;
  cfg.rope = t.position == Position::Rope;
  cfg.ropeTheta = t.ropeTheta;
  cfg.kvHeads = int(t.kvHeads());
  cfg.bias = t.bias;
  cfg.normEps = float(t.normEps);
  // The stage table must describe this model (a hand-edited plan may not): all layers,
  // the whole sequence, and with tp the kernels' reduction points.
  if (plan.stages.empty() || plan.stages.back().layerEnd != cfg.numLayers())
    return inputError("$.stages: the stages hold layers [0, {}) but the transformer has {} "
                      "(embedding, {} blocks, head)",
                      plan.stages.empty() ? 0 : plan.stages.back().layerEnd, cfg.numLayers(),
                      cfg.layers);
  if (plan.seqSlices.empty() || plan.seqSlices.back().second != t.seqLength)
    return inputError("$.seq_slices: the slices end at token {} but seq_length is {}",
                      plan.seqSlices.empty() ? 0 : plan.seqSlices.back().second, t.seqLength);
  for (const StageInfo &s : plan.stages) {
    int parts = 0;
    for (int l = s.layerBegin; l < s.layerEnd; ++l)
      parts += kernels::layerParts(cfg, l);
    if (pc.tp > 1 && s.tpAllReduces != parts)
      return inputError("$.stages[{}].tp_allreduces: {} but its layers have {} tensor-parallel "
                        "reduction points",
                        s.stage, s.tpAllReduces, parts);
  }
  return cfg;
}

void loadLayerState(kernels::StageCompute &stage, const kernels::GptConfig &cfg, int layer,
                    int tpRank, int tp, const LayerState &whole) {
  auto [b, e] = stage.layerRange(layer);
  std::span<float> to[] = {stage.params(), stage.adamFirstMoment(), stage.adamSecondMoment()};
  const std::vector<float> *from[] = {&whole.weights, &whole.firstMoment, &whole.secondMoment};
  for (int a = 0; a < 3; ++a) {
    if (from[a]->empty()) // weights alone (--init-from): the moments stay
      continue;
    std::vector<float> shard = kernels::shardLayer(cfg, layer, tpRank, tp, *from[a]);
    assert(shard.size() == e - b && "a shard fills the layer's range");
    std::copy(shard.begin(), shard.end(), to[a].begin() + long(b));
  }
}

void storeLayerState(kernels::StageCompute &stage, const kernels::GptConfig &cfg, int layer,
                     int tpRank, int tp, LayerState &whole) {
  auto [b, e] = stage.layerRange(layer);
  kernels::unshardLayer(cfg, layer, tpRank, tp, stage.params().subspan(b, e - b), whole.weights);
  kernels::unshardLayer(cfg, layer, tpRank, tp, stage.adamFirstMoment().subspan(b, e - b),
                        whole.firstMoment);
  kernels::unshardLayer(cfg, layer, tpRank, tp, stage.adamSecondMoment().subspan(b, e - b),
                        whole.secondMoment);
}

} // namespace pipec
