#include "runtime/cpu/CpuRun.h"

#include "ir/Error.h"
#include "runtime/Runner.h"
#include "runtime/cpu/Reference.h"

#include <cmath>
#include <map>
#include <mutex>
#include <set>

namespace pipec {

namespace {

using kernels::GptConfig;
using kernels::StageCompute;

class CpuBackend final : public Backend {
public:
  CpuBackend(const Plan &plan, const GptConfig &cfg, const Coord &c, const DataSource &data,
             const CpuRunOptions &options, GradSnapshot *snapshot)
      : plan(plan), cfg(cfg), c(c), data(data), options(options), snapshot(snapshot) {
    const ParallelConfig &pc = plan.parallel;
    float lossScale = 1.0f / float(int64_t(pc.microbatches) * pc.dp * cfg.microbatch * cfg.seqLen);
    for (const StageInfo &s : plan.stages)
      if (s.rank == c.pp)
        stages[s.stage] = std::make_unique<StageCompute>(cfg, s.layerBegin, s.layerEnd, c.tp, pc.tp,
                                                         options.seed, slicesOf(plan), lossScale);
    // Gradient sends placed after their op's weight gradient (valid, if unusual): that
    // gradient must outlive the slice's state.
    const auto &stream = plan.ranks[size_t(c.pp)];
    std::map<uint64_t, size_t> weightDone;
    for (size_t n = 0; n < stream.size(); ++n) {
      const Instruction &i = stream[n];
      if ((i.op == OpKind::BackwardWeight || i.op == OpKind::Backward) && i.isLastPart())
        weightDone[key(TensorKind::Gradient, i.stage, i.mb, i.slice)] = n;
      if (i.op == OpKind::Send && i.tensor == TensorKind::Gradient) {
        uint64_t k = key(i.tensor, i.stage, i.mb, i.slice);
        if (weightDone.count(k))
          sentLate.insert(k);
      }
    }
  }

  double stepLoss = 0;

  llvm::Error beginStep(int step) override {
    stepLoss = 0;
    recvBuffers.clear();
    kept.clear();
    auto batch = stepBatch(data, cfg, plan.parallel, step, c.dp);
    for (auto &[s, sc] : stages) {
      sc->zeroGrads();
      sc->setBatch(batch);
    }
    return llvm::Error::success();
  }

  llvm::Error compute(const Instruction &i) override {
    StageCompute &sc = *stages.at(i.stage);
    // An unsplit op (tp = 1) runs every kernel part; the reductions between them are over one
    // rank, i.e. nothing. A split op runs its one part; the plan's tp all_reduce follows.
    int first = std::max(i.part, 0), end = i.part < 0 ? sc.parts() : i.part + 1;
    bool last = i.isLastPart();
    switch (i.op) {
    case OpKind::Forward: {
      std::span<const float> in;
      if (i.stage > 0 && first == 0)
        in = inputOf(TensorKind::Activation, i.stage - 1, i.mb, i.slice);
      for (int part = first; part < end; ++part)
        pendingReduce = sc.forward(i.mb, i.slice, part, in);
      if (last && i.stage == plan.numStages() - 1 && c.tp == 0)
        stepLoss += sc.loss(i.mb, i.slice);
      if (last)
        release(TensorKind::Activation, i.stage - 1, i.mb, i.slice);
      return llvm::Error::success();
    }
    case OpKind::BackwardInput:
    case OpKind::Backward: {
      std::span<const float> grad;
      if (i.stage < plan.numStages() - 1 && first == 0)
        grad = inputOf(TensorKind::Gradient, i.stage + 1, i.mb, i.slice);
      for (int part = first; part < end; ++part)
        pendingReduce = sc.backwardInput(i.mb, i.slice, part, grad);
      if (last) {
        release(TensorKind::Gradient, i.stage + 1, i.mb, i.slice);
        // A fused backward's weight half runs once the last part's reduction is in place: now
        // when unsplit, after the plan's tp all_reduce otherwise.
        if (i.op == OpKind::Backward && i.part < 0)
          finishFusedBackward(i.stage, i.mb, i.slice);
      }
      return llvm::Error::success();
    }
    case OpKind::BackwardWeight:
      keepInputGrad(i.stage, i.mb, i.slice);
      sc.backwardWeight(i.mb, i.slice);
      return llvm::Error::success();
    case OpKind::Send:
    case OpKind::Recv:
    case OpKind::AllReduce:
    case OpKind::OptimizerStep:
      break;
    }
    return inputError("cpu backend: {} is not a compute op", toString(i.op).str());
  }

  std::span<float> sendData(const Instruction &i) override {
    if (auto it = kept.find(key(i.tensor, i.stage, i.mb, i.slice)); it != kept.end())
      return it->second; // freed at the next step
    StageCompute &sc = *stages.at(i.stage);
    std::span<const float> out =
        i.tensor == TensorKind::Activation ? sc.output(i.mb, i.slice) : sc.inputGrad(i.mb, i.slice);
    // The transport only reads a send's data.
    return {const_cast<float *>(out.data()), out.size()};
  }

  std::span<float> recvData(const Instruction &i) override {
    auto &buf = recvBuffers[key(i.tensor, i.stage, i.mb, i.slice)];
    auto [b, e] = plan.seqSlices[size_t(i.slice)];
    buf.assign(size_t(cfg.microbatch) * size_t(e - b) * size_t(cfg.channels), 0.0f);
    return buf;
  }

  std::span<float> reduceData(const Instruction &i) override {
    switch (i.collective) {
    case CollectiveGroup::Tp:
      return pendingReduce;
    case CollectiveGroup::Dp:
      return stages.at(i.stage)->grads();
    case CollectiveGroup::Embedding: {
      StageCompute &sc = *stages.at(i.stage);
      auto [b, e] = sc.tiedEmbeddingRange();
      return sc.grads().subspan(b, e - b);
    }
    }
    return {};
  }

  llvm::Error afterAllReduce(const Instruction &i) override {
    if (i.collective == CollectiveGroup::Tp && i.phase == OpKind::Backward && i.part == i.parts - 1)
      finishFusedBackward(i.stage, i.mb, i.slice);
    return llvm::Error::success();
  }

  /// The weight half of a fused backward; it frees the slice's state, so the input gradient is
  /// kept for its consumer first.
  void finishFusedBackward(int stage, int mb, int slice) {
    // Its send comes after the whole fused op, so keep the input gradient for any consumer.
    keepInputGrad(stage, mb, slice, /*anyConsumer=*/true);
    stages.at(stage)->backwardWeight(mb, slice);
  }

  /// Before a weight gradient frees the slice's state: keep the input gradient if its
  /// consumer, stage - 1, is on this rank and may run later (V-shapes), or if this rank sends
  /// it only after the weight gradient (otherwise it has been sent already).
  void keepInputGrad(int stage, int mb, int slice, bool anyConsumer = false) {
    if (stage == 0)
      return;
    bool sameRank = plan.rankOf(stage - 1) == c.pp;
    if (!anyConsumer && !sameRank && !sentLate.count(key(TensorKind::Gradient, stage, mb, slice)))
      return;
    std::span<const float> g = stages.at(stage)->inputGrad(mb, slice);
    kept[key(TensorKind::Gradient, stage, mb, slice)].assign(g.begin(), g.end());
  }

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

private:
  static uint64_t key(TensorKind t, int stage, int mb, int slice) {
    return (((uint64_t(stage) << 20) | uint64_t(mb)) << 12 | uint64_t(slice)) << 1 |
           uint64_t(t == TensorKind::Gradient);
  }

  /// The input a compute op needs from stage `producer`: its stage object when it is on this
  /// rank, else what was received.
  std::span<const float> inputOf(TensorKind t, int producer, int mb, int slice) {
    if (auto it = kept.find(key(t, producer, mb, slice)); it != kept.end())
      return it->second;
    if (plan.rankOf(producer) == c.pp) {
      StageCompute &p = *stages.at(producer);
      return t == TensorKind::Activation ? p.output(mb, slice) : p.inputGrad(mb, slice);
    }
    auto it = recvBuffers.find(key(t, producer, mb, slice));
    assert(it != recvBuffers.end() && "the verifier guarantees a recv before its consumer");
    return it->second;
  }

  void release(TensorKind t, int producer, int mb, int slice) {
    recvBuffers.erase(key(t, producer, mb, slice));
  }

  const Plan &plan;
  const GptConfig &cfg;
  Coord c;
  const DataSource &data;
  const CpuRunOptions &options;
  GradSnapshot *snapshot;
  std::map<int, std::unique_ptr<StageCompute>> stages;
  std::map<uint64_t, std::vector<float>> recvBuffers;
  /// Input gradients of fused backwards, kept past their weight half for their consumer.
  std::map<uint64_t, std::vector<float>> kept;
  /// Gradients whose send comes after their op's weight gradient in this rank's stream.
  std::set<uint64_t> sentLate;
  std::span<float> pendingReduce;
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
  if (t.numAttentionHeads % pc.tp != 0 || t.ffnHiddenSize % pc.tp != 0)
    return inputError("--tp {} must divide num_attention_heads ({}) and ffn_hidden_size ({})",
                      pc.tp, t.numAttentionHeads, t.ffnHiddenSize);
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
  GradSnapshot snapshot;
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
      ref->compare(snapshot, result.maxAbsGradDiff, result.gradScale);
      ref->update();
    }
    if (onStep)
      onStep(s, loss);
  }
  return result;
}

} // namespace pipec
