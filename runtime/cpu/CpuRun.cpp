#include "runtime/cpu/CpuRun.h"

#include "ir/support/Bytes.h"
#include "ir/support/Error.h"
#include "ir/support/Memory.h"
#include "runtime/Profile.h"
#include "runtime/Runner.h"
#include "runtime/StageDispatch.h"

#include "llvm/Support/Host.h"

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
             const TrainOptions &options, ParamSnapshot *snapshot)
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
  /// The weights, gradients and AdamW moments of the rank's stages (fp32).
  size_t stateBytes() const {
    size_t floats = 0;
    for (auto &[s, sc] : stages)
      floats += 4 * sc->params().size();
    return floats * sizeof(float);
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
  const TrainOptions &options;
  ParamSnapshot *snapshot;
};

} // namespace

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

} // namespace

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
    const double slice =
        n * (3 * c + 2) * f +
        blocks * (n * (8 * c + 5 * c / tp + 2 * ffn / tp + 4) * f + b * (heads / tp) * x * t * f) +
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

namespace {

/// The cpu backend as the training driver sees it: every rank a CpuBackend thread of a Runner.
class CpuTrainBackend final : public TrainBackend {
public:
  CpuTrainBackend(const Plan &plan, const GptConfig &cfg, const DataSource &data,
                  const TrainOptions &options, Faults faults)
      : plan(plan), cfg(cfg), data(data), options(options), faults(std::move(faults)) {}

  llvm::Error setUp() override {
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
    std::vector<std::unique_ptr<Backend>> backends;
    for (int t = 0; t < pc.pp * pc.dp * pc.tp; ++t) {
      Coord c{t / (pc.dp * pc.tp), t / pc.tp % pc.dp, t % pc.tp};
      auto b = std::make_unique<CpuBackend>(plan, cfg, c, data, options,
                                            options.checkReference ? &snapshot : nullptr);
      ranks.push_back(b.get());
      backends.push_back(std::move(b));
    }
    runner = std::make_unique<Runner>(plan, faults, options.timeoutSeconds, std::move(backends));
    if (options.profile)
      runner->state().enableTiming();
    return llvm::Error::success();
  }

  llvm::Error measuredCosts(MeasuredCosts &into) override {
    // Each pipeline rank's dp replica 0, tp rank 0 thread speaks for it.
    ProfileTable table(plan);
    RunShared &shared = runner->state();
    for (int pp = 0; pp < plan.parallel.pp; ++pp) {
      const int t = shared.threadOf(Coord{pp, 0, 0});
      const CpuBackend &b = *ranks[size_t(t)];
      table.addRank(pp, shared.timings[size_t(t)], int64_t(b.heldHighWater + b.stateBytes()));
    }
    into = table.costs();
    into.backend = "cpu";
    into.dtype = "fp32";
    into.device = fmt::format("host cpu ({})", llvm::sys::getHostCPUName().str());
    into.threads = shared.numThreads();
    return llvm::Error::success();
  }

  llvm::Expected<double> step(int s) override {
    if (auto err = runner->step(s))
      return err;
    double loss = 0;
    for (CpuBackend *b : ranks)
      loss += b->stepLoss;
    return loss;
  }

  llvm::Error takeGradients(ParamSnapshot &into) override {
    snapshot.handOver(into);
    return llvm::Error::success();
  }

  llvm::Error snapshotWeights(ParamSnapshot &into) override {
    for (CpuBackend *b : ranks)
      b->snapshotWeights(into);
    return llvm::Error::success();
  }

  bool holdsLayer(int) const override { return true; } // every rank is a thread here

  llvm::Error scatterLayer(int layer, const LayerState &whole) override {
    for (CpuBackend *r : ranks)
      if (StageCompute *sc = r->stageOfLayer(layer))
        loadLayerState(*sc, cfg, layer, r->coord().tp, plan.parallel.tp, whole);
    return llvm::Error::success();
  }

  llvm::Error gatherLayer(int layer, LayerState &whole) override {
    for (CpuBackend *r : ranks)
      if (StageCompute *sc = r->coord().dp == 0 ? r->stageOfLayer(layer) : nullptr)
        storeLayerState(*sc, cfg, layer, r->coord().tp, plan.parallel.tp, whole);
    return llvm::Error::success();
  }

  int adamSteps() const override { return ranks.front()->adamSteps(); }
  void setAdamSteps(int steps) override {
    for (CpuBackend *r : ranks)
      r->setAdamSteps(steps);
  }

  std::vector<size_t> heldBytes() const {
    std::vector<size_t> held;
    for (CpuBackend *b : ranks)
      held.push_back(b->heldHighWater);
    return held;
  }

  std::string summary() const override {
    return fmt::format("activations held MiB (every rank, in RANK order; the most between kernel "
                       "calls): {}\n",
                       mibColumns(heldBytes()));
  }

private:
  const Plan &plan;
  const GptConfig &cfg;
  const DataSource &data;
  const TrainOptions &options;
  Faults faults;
  ParamSnapshot snapshot; // with checkReference: the gradients of the step, by (stage, tp rank)
  std::vector<CpuBackend *> ranks;
  std::unique_ptr<Runner> runner;
};

} // namespace

std::unique_ptr<TrainBackend> createCpuBackend(const Plan &plan, const GptConfig &cfg,
                                               const DataSource &data, const TrainOptions &options,
                                               Faults faults) {
  return std::make_unique<CpuTrainBackend>(plan, cfg, data, options, std::move(faults));
}

llvm::Expected<CpuRunResult> runOnCpu(const Plan &plan, const DataSource &data,
                                      const CpuRunOptions &options,
                                      const std::function<void(int, double)> &onStep) {
  auto cfg = gptConfigOf(plan);
  if (!cfg)
    return cfg.takeError();
  CpuTrainBackend backend(plan, *cfg, data, options, options.faults);
  auto trained = train(plan, *cfg, data, backend, options, onStep);
  if (!trained)
    return trained.takeError();
  CpuRunResult result;
  static_cast<TrainResult &>(result) = std::move(*trained);
  result.heldBytes = backend.heldBytes();
  return result;
}

} // namespace pipec
