#include "runtime/cpu/CpuRun.h"

#include "ir/Error.h"
#include "ir/Files.h"
#include "runtime/Runner.h"
#include "runtime/StageDispatch.h"
#include "runtime/cpu/Reference.h"

#include <algorithm>
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
  static size_t elementsOf(const std::vector<float> &buffer) { return buffer.size(); }

  /// What the rank holds between kernel calls: every stage's saved activations, K/V and
  /// gradients kept for the weight gradient (StageCompute::savedBytes), and the received and
  /// kept p2p tensors; its high-water mark over the run.
  void afterStageCall() {
    size_t bytes = heldBufferElements() * sizeof(float);
    for (auto &[s, sc] : stages)
      bytes += sc->savedBytes();
    heldHighWater = std::max(heldHighWater, bytes);
  }
  size_t heldHighWater = 0;

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

  const Coord &coord() const { return c; }
  /// The stage of this rank holding `layer`, or null.
  StageCompute *stageOfLayer(int layer) {
    for (auto &[s, sc] : stages) {
      const StageInfo &info = plan.stages[size_t(s)];
      if (layer >= info.layerBegin && layer < info.layerEnd)
        return sc.get();
    }
    return nullptr;
  }
  void setAdamSteps(int steps) {
    for (auto &[s, sc] : stages)
      sc->setAdamSteps(steps);
  }
  int adamSteps() const { return stages.empty() ? 0 : stages.begin()->second->adamSteps(); }

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

namespace {

/// The most (microbatch, slice)s of each stage whose forward state a rank's stream keeps at
/// once: a forward's first part makes it, a weight gradient (or fused backward)'s last part
/// frees it.
std::vector<int64_t> peakInFlight(const Plan &plan) {
  std::vector<int64_t> live(plan.stages.size(), 0), peak(plan.stages.size(), 0);
  for (const auto &stream : plan.ranks)
    for (const Instruction &i : stream) {
      if (i.stage < 0 || size_t(i.stage) >= live.size())
        continue;
      if (i.op == OpKind::Forward && i.isFirstPart())
        peak[size_t(i.stage)] = std::max(peak[size_t(i.stage)], ++live[size_t(i.stage)]);
      if ((i.op == OpKind::BackwardWeight || i.op == OpKind::Backward) && i.isLastPart())
        --live[size_t(i.stage)];
    }
  return peak;
}

/// Loads layer by layer `ckpt` into every rank's stages (each takes its tp shard) and into the
/// reference, and sets their optimizer step counters.
llvm::Error loadCheckpoint(const Checkpoint &ckpt, const GptConfig &cfg, int tp,
                           const std::vector<CpuBackend *> &ranks, ReferenceRun *ref) {
  LayerState whole;
  for (int l = 0; l < cfg.numLayers(); ++l) {
    if (auto err = readCheckpointLayer(ckpt, l, whole))
      return err;
    if (whole.weights.size() != kernels::layerParamCount(cfg, l, 1))
      return inputError("--resume: {}: layer {} holds {} weights, the model's has {}", ckpt.path,
                        l, whole.weights.size(), kernels::layerParamCount(cfg, l, 1));
    auto load = [&](StageCompute &sc, int tpRank, int tpSize) {
      auto [b, e] = sc.layerRange(l);
      std::span<float> to[] = {sc.params(), sc.adamFirstMoment(), sc.adamSecondMoment()};
      const std::vector<float> *from[] = {&whole.weights, &whole.firstMoment,
                                          &whole.secondMoment};
      for (int a = 0; a < 3; ++a) {
        std::vector<float> shard = kernels::shardLayer(cfg, l, tpRank, tpSize, *from[a]);
        assert(shard.size() == e - b && "a shard fills the layer's range");
        std::copy(shard.begin(), shard.end(), to[a].begin() + long(b));
      }
    };
    for (CpuBackend *r : ranks)
      if (StageCompute *sc = r->stageOfLayer(l))
        load(*sc, r->coord().tp, tp);
    if (ref)
      load(ref->stage(), 0, 1);
  }
  for (CpuBackend *r : ranks)
    r->setAdamSteps(int(ckpt.manifest.adamSteps));
  if (ref)
    ref->stage().setAdamSteps(int(ckpt.manifest.adamSteps));
  return llvm::Error::success();
}

/// Loads whole layers of initial weights (--init-from) into every rank's stages (each takes its
/// tp shard) and into the reference.
void loadInitialWeights(const std::vector<std::vector<float>> &layers, const GptConfig &cfg, int tp,
                        const std::vector<CpuBackend *> &ranks, ReferenceRun *ref) {
  for (int l = 0; l < cfg.numLayers(); ++l)
    for (CpuBackend *r : ranks)
      if (StageCompute *sc = r->stageOfLayer(l))
        loadWholeLayers(*sc, cfg, l, l + 1, r->coord().tp, tp, layers);
  if (ref)
    loadWholeLayers(ref->stage(), cfg, 0, cfg.numLayers(), 0, 1, layers);
}

} // namespace

void loadWholeLayers(StageCompute &stage, const GptConfig &cfg, int layerBegin, int layerEnd,
                     int tpRank, int tp, const std::vector<std::vector<float>> &layers) {
  for (int l = layerBegin; l < layerEnd; ++l) {
    auto [b, e] = stage.layerRange(l);
    std::vector<float> shard = kernels::shardLayer(cfg, l, tpRank, tp, layers[size_t(l)]);
    assert(shard.size() == e - b && "a shard fills the layer's range");
    std::copy(shard.begin(), shard.end(), stage.params().begin() + long(b));
  }
}

uint64_t cpuRunBytes(const Plan &plan, const GptConfig &cfg, bool checkReference) {
  // In doubles: the sizes a plan can ask for overflow 64 bits; the answer only needs to be
  // compared with the machine's memory.
  const ParallelConfig &pc = plan.parallel;
  const double f = sizeof(float), b = cfg.microbatch, c = cfg.channels, t = cfg.seqLen,
               v = cfg.vocab, heads = cfg.heads, tp = pc.tp;
  // fc's output columns (SwiGLU: gate | up); grouped K/V are narrower than c, counted as c.
  const double ffn = cfg.swiglu ? 2.0 * cfg.ffn : double(cfg.ffn);
  double x = 0;
  for (auto [begin, end] : plan.seqSlices)
    x = std::max(x, double(end - begin));
  const double n = b * x; // tokens of the widest slice
  const double tokens = double(pc.microbatches) * b * (t + 1) * sizeof(int32_t);
  const std::vector<int64_t> inFlight = peakInFlight(plan);
  double total = 0;
  for (const StageInfo &s : plan.stages) {
    double params = 0, blocks = 0;
    bool head = false;
    for (int l = s.layerBegin; l < s.layerEnd; ++l) {
      params += double(kernels::layerParamCount(cfg, l, pc.tp));
      blocks += kernels::layerKind(cfg, l) == kernels::GptLayerKind::Block;
      head = head || kernels::layerKind(cfg, l) == kernels::GptLayerKind::Head;
    }
    // What one (microbatch, slice) keeps (kernels/cpu/Gpt.cpp: SliceWork, BlockWork, HeadWork),
    // and one microbatch's K/V and their gradients (SequenceWork).
    const double slice = n * (3 * c + 2) * f +
                         blocks * (n * (8 * c + 5 * c / tp + 2 * ffn / tp + 4) * f +
                                   b * (heads / tp) * x * t * f) +
                         (head ? n * (4 * c + 3 * v / tp + 2 * tp + 4) * f : 0);
    const double sequence = blocks * 4 * t * b * (c / tp) * f;
    const double live = double(std::max<int64_t>(inFlight[size_t(s.stage)], 1));
    const double perThread = 4 * params * f + tokens + live * (slice + 2 * n * c * f) +
                             std::min(live, double(pc.microbatches)) * sequence;
    total += perThread * double(pc.dp) * tp;
  }
  if (checkReference) {
    double params = 0;
    for (int l = 0; l < cfg.numLayers(); ++l)
      params += double(kernels::layerParamCount(cfg, l, 1));
    const double whole = b * t;
    const double slice = whole * (3 * c + 2) * f +
                         cfg.layers * (whole * (12 * c + 2 * ffn + 4) * f + b * heads * t * t * f +
                                       4 * t * b * c * f) +
                         whole * (4 * c + 3 * v + 6) * f;
    // Its weights, gradients and moments, one microbatch in flight, the step's tokens of every
    // replica, and the snapshots of the run's gradients and weights it compares with.
    total += 4 * params * f + slice + tokens * pc.dp + 2 * params * f;
  }
  return total >= 1.8e19 ? UINT64_MAX : uint64_t(total);
}

llvm::Expected<CpuRunResult> runOnCpu(const Plan &plan, const DataSource &data,
                                      const CpuRunOptions &options,
                                      const std::function<void(int, double)> &onStep) {
  auto cfgOr = gptConfigOf(plan);
  if (!cfgOr)
    return cfgOr.takeError();
  const GptConfig cfg = *cfgOr;
  const ParallelConfig &pc = plan.parallel;
  // Before anything is allocated: the run fits, or it is refused with what it needs.
  if (auto err = checkMemoryBudget(
          cpuRunBytes(plan, cfg, options.checkReference),
          fmt::format("the cpu backend's run of model '{}' (vocab_size {}, hidden_size {}, "
                      "{} layers; {} rank threads{})",
                      shortened(plan.model), cfg.vocab, cfg.channels, cfg.layers,
                      int64_t(pc.pp) * pc.dp * pc.tp,
                      options.checkReference ? ", and the reference" : ""),
          "use a smaller model, such as examples/tiny-gpt.json"))
    return err;
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
  if (options.initWeights) {
    if (options.initWeights->size() != size_t(cfg.numLayers()))
      return inputError("--init-from: {} layers of weights for a model of {}",
                        options.initWeights->size(), cfg.numLayers());
    for (int l = 0; l < cfg.numLayers(); ++l)
      if ((*options.initWeights)[size_t(l)].size() != kernels::layerParamCount(cfg, l, 1))
        return inputError("--init-from: layer {} holds {} weights, the model's has {}", l,
                          (*options.initWeights)[size_t(l)].size(),
                          kernels::layerParamCount(cfg, l, 1));
    loadInitialWeights(*options.initWeights, cfg, pc.tp, cpu, ref.get());
  }
  int first = 0;
  if (options.resume) {
    if (auto err = loadCheckpoint(*options.resume, cfg, pc.tp, cpu, ref.get()))
      return err;
    first = int(options.resume->manifest.step);
  }
  // A checkpoint after step s: every layer whole, from dp replica 0 (the replicas are equal)
  // with its tp shards joined.
  auto save = [&](int stepsDone) -> llvm::Error {
    CheckpointManifest m;
    m.step = stepsDone;
    m.adamSteps = cpu.front()->adamSteps();
    m.seed = options.seed;
    m.sequences = uint64_t(stepsDone) * uint64_t(pc.dp) * uint64_t(pc.microbatches) *
                  uint64_t(cfg.microbatch);
    m.data = options.dataName;
    m.modelName = plan.model;
    m.model = *plan.transformer;
    m.schedule = plan.schedule;
    m.parallel = pc;
    m.planHash = planHash(plan);
    return saveCheckpoint(options.saveDir, m, [&](int l, LayerState &out) {
      const size_t whole = kernels::layerParamCount(cfg, l, 1);
      out.weights.assign(whole, 0.0f);
      out.firstMoment.assign(whole, 0.0f);
      out.secondMoment.assign(whole, 0.0f);
      for (CpuBackend *r : cpu) {
        StageCompute *sc = r->coord().dp == 0 ? r->stageOfLayer(l) : nullptr;
        if (!sc)
          continue;
        auto [b, e] = sc->layerRange(l);
        const int t = r->coord().tp;
        kernels::unshardLayer(cfg, l, t, pc.tp, sc->params().subspan(b, e - b), out.weights);
        kernels::unshardLayer(cfg, l, t, pc.tp, sc->adamFirstMoment().subspan(b, e - b),
                              out.firstMoment);
        kernels::unshardLayer(cfg, l, t, pc.tp, sc->adamSecondMoment().subspan(b, e - b),
                              out.secondMoment);
      }
    });
  };
  CpuRunResult result;
  for (int s = first; s < first + options.steps; ++s) {
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
    const bool last = s + 1 == first + options.steps;
    if (!options.saveDir.empty() &&
        (last || (options.saveEvery > 0 && (s + 1) % options.saveEvery == 0))) {
      if (auto err = save(s + 1))
        return err;
      if (options.onSaved)
        options.onSaved(s + 1, checkpointPath(options.saveDir, s + 1));
    }
  }
  for (CpuBackend *b : cpu)
    result.heldBytes.push_back(b->heldHighWater);
  if (ref && options.steps > 0) {
    ParamSnapshot weights;
    for (CpuBackend *b : cpu)
      b->snapshotWeights(weights);
    result.weights = ref->compareWeights(weights, options.steps);
  }
  return result;
}

} // namespace pipec
