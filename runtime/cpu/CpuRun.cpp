#include "runtime/cpu/CpuRun.h"

#include "ir/Error.h"
#include "runtime/Runner.h"
#include "runtime/StageDispatch.h"
#include "runtime/cpu/Reference.h"

#include <cmath>
#include <map>
#include <mutex>
#include <set>

namespace pipec {

namespace {

using kernels::GptConfig;
using kernels::StageCompute;

class CpuBackend final : public StageDispatch<CpuBackend, StageCompute, std::vector<float>> {
public:
  static constexpr const char *kName = "cpu backend";

  CpuBackend(const Plan &plan, const GptConfig &cfg, const Coord &c, const DataSource &data,
             const CpuRunOptions &options, ParamSnapshot *snapshot)
      : StageDispatch(plan, c, size_t(cfg.microbatch) * size_t(cfg.channels)), cfg(cfg), data(data),
        options(options), snapshot(snapshot) {
    const ParallelConfig &pc = plan.parallel;
    float lossScale = 1.0f / float(int64_t(pc.microbatches) * pc.dp * cfg.microbatch * cfg.seqLen);
    for (const StageInfo &s : plan.stages)
      if (s.rank == c.pp)
        stages[s.stage] = std::make_unique<StageCompute>(cfg, s.layerBegin, s.layerEnd, c.tp, pc.tp,
                                                         options.seed, slicesOf(plan), lossScale);
  }

  double stepLoss = 0;

  llvm::Error beginStep(int step) override {
    stepLoss = 0;
    clearStepBuffers();
    auto batch = stepBatch(data, cfg, plan.parallel, step, c.dp);
    for (auto &[s, sc] : stages) {
      sc->zeroGrads();
      sc->setBatch(batch);
    }
    return llvm::Error::success();
  }

  // StageDispatch's hooks.
  llvm::Error addLoss(StageCompute &sc, int mb, int slice) {
    stepLoss += sc.loss(mb, slice);
    return llvm::Error::success();
  }
  llvm::Error allocate(std::vector<float> &buffer, size_t floats) {
    buffer.assign(floats, 0.0f);
    return llvm::Error::success();
  }
  llvm::Error keepCopy(std::vector<float> &buffer, TensorView src) {
    std::span<const float> from = src; // the cpu stage's tensors are fp32
    buffer.assign(from.begin(), from.end());
    return llvm::Error::success();
  }
  static TensorView viewOf(std::vector<float> &buffer) { return std::span<float>(buffer); }

  void sumLocalEmbeddingCopies() override {
    StageCompute &first = *stages.at(0), &last = *stages.at(plan.numStages() - 1);
    auto [fb, fe] = first.tiedEmbeddingRange();
    auto [lb, le] = last.tiedEmbeddingRange();
    auto f = first.grads().subspan(fb, fe - fb), l = last.grads().subspan(lb, le - lb);
    for (size_t k = 0; k < f.size(); ++k)
      f[k] = l[k] = f[k] + l[k];
  }

  llvm::Error optimizerStep() override {
    // (A single stage holding both embedding copies ties them itself, in the kernels.)
    if (snapshot && c.dp == 0) {
      std::lock_guard<std::mutex> lock(snapshot->mu);
      for (auto &[s, sc] : stages)
        snapshot->byStageAndTp[{s, c.tp}].assign(sc->grads().begin(), sc->grads().end());
    }
    for (auto &[s, sc] : stages)
      sc->adamStep(options.lr, kAdamBeta1, kAdamBeta2, kAdamEps, kAdamWeightDecay);
    return llvm::Error::success();
  }

  /// Between steps: every replica's weight digests into `into`, and replica 0's weights.
  void snapshotWeights(ParamSnapshot &into) {
    std::lock_guard<std::mutex> lock(into.mu);
    for (auto &[s, sc] : stages) {
      into.digests[{c.dp, s, c.tp}] = weightDigest(sc->params());
      if (c.dp == 0)
        into.byStageAndTp[{s, c.tp}].assign(sc->params().begin(), sc->params().end());
    }
  }

private:
  const GptConfig &cfg;
  const DataSource &data;
  const CpuRunOptions &options;
  ParamSnapshot *snapshot;
};

} // namespace

llvm::Expected<GptConfig> gptConfigOf(const Plan &plan) {
  if (!plan.transformer)
    return inputError("the plan's model '{}' is an abstract layer list; the cpu backend runs "
                      "transformer models (compile one with a \"transformer\" model spec, e.g. "
                      "examples/tiny-gpt.json)",
                      plan.model);
  const TransformerConfig &t = *plan.transformer;
  if (t.hiddenSize > 4096 || t.seqLength > 8192 || t.vocabSize > 1 << 20 || t.numLayers > 256 ||
      t.microbatchSize > 64)
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
  if (t.vocabSize % pc.tp != 0)
    return inputError("--tp {} must divide vocab_size ({}): the runtime splits the vocabulary "
                      "across the tp ranks (vocab-parallel embedding and cross entropy); pad "
                      "vocab_size to a multiple of {} (e.g. {}), as Megatron-LM does",
                      pc.tp, t.vocabSize, pc.tp, (t.vocabSize + pc.tp - 1) / pc.tp * pc.tp);
  // The threads and per-op buffers of a run must stay reasonable on one machine.
  int64_t threads = int64_t(pc.pp) * pc.dp * pc.tp;
  if (threads > 256)
    return inputError("the plan needs {} threads (pp x dp x tp); the cpu backend runs at most "
                      "256",
                      threads);
  if (pc.microbatches >= (1 << 20) || pc.seqSplits >= 4096)
    return inputError("the cpu backend runs at most 2^20 microbatches and 4096 seq-splits (got "
                      "{} and {})",
                      pc.microbatches, pc.seqSplits);
  GptConfig cfg;
  cfg.vocab = int(t.vocabSize);
  cfg.seqLen = int(t.seqLength);
  cfg.channels = int(t.hiddenSize);
  cfg.heads = int(t.numAttentionHeads);
  cfg.layers = int(t.numLayers);
  cfg.ffn = int(t.ffnHiddenSize);
  cfg.microbatch = int(t.microbatchSize);
  cfg.tiedEmbeddings = t.tieEmbeddings;
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

llvm::Expected<CpuRunResult> runOnCpu(const Plan &plan, const DataSource &data,
                                      const CpuRunOptions &options,
                                      const std::function<void(int, double)> &onStep) {
  auto cfgOr = gptConfigOf(plan);
  if (!cfgOr)
    return cfgOr.takeError();
  const GptConfig cfg = *cfgOr;
  const ParallelConfig &pc = plan.parallel;
  ParamSnapshot snapshot;
  std::vector<std::unique_ptr<Backend>> backends;
  std::vector<CpuBackend *> cpu;
  for (int t = 0; t < pc.pp * pc.dp * pc.tp; ++t) {
    Coord c{t / (pc.dp * pc.tp), t / pc.tp % pc.dp, t % pc.tp};
    auto b = std::make_unique<CpuBackend>(plan, cfg, c, data, options,
                                          options.checkReference ? &snapshot : nullptr);
    cpu.push_back(b.get());
    backends.push_back(std::move(b));
  }
  Runner runner(plan, options.faults, options.timeoutSeconds, std::move(backends));
  std::unique_ptr<ReferenceRun> ref;
  if (options.checkReference)
    ref = std::make_unique<ReferenceRun>(plan, cfg, data, options.seed, options.lr);
  CpuRunResult result;
  for (int s = 0; s < options.steps; ++s) {
    if (auto err = runner.step(s))
      return err;
    double loss = 0;
    for (CpuBackend *b : cpu)
      loss += b->stepLoss;
    result.losses.push_back(loss);
    if (ref) {
      result.referenceLosses.push_back(ref->step(s));
      ref->compare(snapshot, result.grads, s);
      ref->adopt(snapshot); // ReferenceRun::adopt: the next step starts from the run's weights
      ref->update();
    }
    if (onStep)
      onStep(s, loss);
  }
  if (ref) {
    ParamSnapshot weights;
    for (CpuBackend *b : cpu)
      b->snapshotWeights(weights);
    result.weights = ref->compareWeights(weights, options.steps);
  }
  return result;
}

} // namespace pipec
