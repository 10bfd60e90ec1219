//===- CudaRun.cpp - The cuda backend: the plan's ranks on one GPU --------===//
//
// CpuBackend (runtime/cpu/CpuRun.cpp) with GpuStage for StageCompute: the same handling of
// received tensors, kept input gradients of fused backwards and late sends, tp parts and their
// all-reduces, dp and tied-embedding all-reduces. Backend calls that cannot return an error
// (sendData, recvData, sumLocalEmbeddingCopies) keep the first error; the transport checks it
// before it posts anything and the next call that can return one reports it.
//
//===----------------------------------------------------------------------===//
#include "runtime/cuda/CudaRun.h"

#include "ir/Error.h"
#include "kernels/cpu/Gpt.h"
#include "kernels/cuda/CudaCheck.h"
#include "kernels/cuda/CudaOps.h"
#include "runtime/Runner.h"
#include "runtime/cpu/CpuRun.h"
#include "runtime/cpu/Reference.h"
#include "runtime/cuda/DeviceArena.h"
#include "runtime/cuda/GpuStage.h"
#include "runtime/cuda/LocalTransport.h"
#include "runtime/cuda/StageKernels.h"

#include <cuda_runtime_api.h>

#include <mutex>
#include <optional>
#include <set>

namespace pipec {

namespace {

namespace cu = kernels::cuda;
using kernels::GptConfig;
using kernels::StageCompute;

#define PIPEC_GPU_TRY(expr)                                                                        \
  do {                                                                                             \
    if (llvm::Error pipecGpuErr = (expr))                                                          \
      return pipecGpuErr;                                                                          \
  } while (false)

/// A buffer of the rank's arena (or of whatever allocator the context has), given back when
/// dropped on the host.
class ArenaFloats {
public:
  ArenaFloats() = default;
  ArenaFloats(ArenaFloats &&o) noexcept
      : from(o.from), p(std::exchange(o.p, nullptr)), count(std::exchange(o.count, 0)) {}
  ArenaFloats &operator=(ArenaFloats &&o) noexcept {
    if (this != &o) {
      reset();
      from = o.from;
      p = std::exchange(o.p, nullptr);
      count = std::exchange(o.count, 0);
    }
    return *this;
  }
  ArenaFloats(const ArenaFloats &) = delete;
  ArenaFloats &operator=(const ArenaFloats &) = delete;
  ~ArenaFloats() { reset(); }
  llvm::Error allocate(cu::DeviceAllocator &a, size_t n) {
    reset();
    from = &a;
    auto ptr = a.allocate(n * sizeof(float));
    if (!ptr)
      return ptr.takeError();
    p = static_cast<float *>(*ptr);
    count = n;
    return llvm::Error::success();
  }
  void reset() {
    if (p)
      from->release(p);
    p = nullptr;
    count = 0;
  }
  std::span<float> span() const { return {p, count}; }

private:
  cu::DeviceAllocator *from = nullptr;
  float *p = nullptr;
  size_t count = 0;
};

/// One rank's backend on a device transport (the local one here, NCCL's in NcclRun.cpp): sends
/// hand out the device tensor itself, recvs a buffer of the rank's arena that the transport
/// fills, all-reduces sum in place.
class CudaBackend final : public CudaRankBackend {
public:
  CudaBackend(const Plan &plan, const GptConfig &cfg, const Coord &c, const DataSource &data,
              const CudaRunOptions &options, GradSnapshot *snapshot,
              std::function<llvm::Error()> waitForCollectives)
      : plan(plan), cfg(cfg), c(c), data(data), options(options), snapshot(snapshot),
        stream(plan.ranks[size_t(c.pp)]), waitForCollectives(std::move(waitForCollectives)) {}

  void *computeStreamHandle() const override { return computeStream; }
  llvm::Error takeDeferredError() override { return takeDeferred(); }
  void setWarmUp(bool on) override { warmUp = on; }
  llvm::Error reserveArena() override { return arena->reserve(); }
  size_t arenaBytes() const override { return arena ? arena->reservedBytes() : 0; }

  /// The context, the arena and the stages; everything that can fail.
  llvm::Error init() {
    auto ctxOr = cu::CudaContext::create(options.device);
    if (!ctxOr)
      return ctxOr.takeError();
    ctx = std::move(*ctxOr);
    computeStream = static_cast<cudaStream_t>(ctx->stream());
    arena = std::make_unique<DeviceArena>(
        computeStream, fmt::format("rank {} (pp {}, dp {}, tp {})",
                                   (c.pp * plan.parallel.dp + c.dp) * plan.parallel.tp + c.tp,
                                   c.pp, c.dp, c.tp));
    ctx->setAllocator(arena.get());
    const ParallelConfig &pc = plan.parallel;
    for (const StageInfo &s : plan.stages) {
      if (s.rank != c.pp)
        continue;
      auto st = GpuStage::create(*ctx, cfg, s.layerBegin, s.layerEnd, c.tp, pc.tp, options.seed,
                                 slicesOf(plan), lossScaleOf(plan, cfg));
      if (!st)
        return st.takeError();
      stages[s.stage] = std::move(*st);
    }
    // Gradients sent after this stage's weight gradient freed them (kept until the send).
    std::set<uint64_t> weightDone;
    for (const Instruction &i : stream) {
      if ((i.op == OpKind::BackwardWeight || i.op == OpKind::Backward) && i.isLastPart())
        weightDone.insert(key(TensorKind::Gradient, i.stage, i.mb, i.slice));
      if (i.op == OpKind::Send && i.tensor == TensorKind::Gradient &&
          weightDone.count(key(i.tensor, i.stage, i.mb, i.slice)))
        sentLate.insert(key(i.tensor, i.stage, i.mb, i.slice));
    }
    return llvm::Error::success();
  }

  llvm::Error beginStep(int step) override {
    PIPEC_CUDA_TRY(cudaSetDevice(options.device));
    PIPEC_GPU_TRY(takeDeferred());
    auto batch = stepBatch(data, cfg, plan.parallel, step, c.dp);
    for (auto &[s, st] : stages) {
      PIPEC_GPU_TRY(st->zeroGrads());
      PIPEC_GPU_TRY(st->setBatch(batch));
    }
    return llvm::Error::success();
  }

  /// After the step: waits for the device and returns this rank's share of the loss.
  llvm::Expected<double> finishStep() override {
    if (auto err = takeDeferred())
      return err;
    double loss = 0;
    for (auto &[s, st] : stages) {
      if (!st->hasHead() || c.tp != 0)
        continue;
      auto l = st->takeLoss();
      if (!l)
        return l.takeError();
      loss += *l;
    }
    if (auto err = ctx->synchronize())
      return err;
    kept.clear();
    received.clear();
    return loss;
  }

  llvm::Error compute(const Instruction &i) override {
    PIPEC_GPU_TRY(takeDeferred());
    GpuStage &st = *stages.at(i.stage);
    int first = std::max(i.part, 0), end = i.part < 0 ? st.parts() : i.part + 1;
    bool last = i.isLastPart();
    switch (i.op) {
    case OpKind::Forward: {
      std::span<const float> in;
      if (i.stage > 0 && first == 0) {
        auto got = inputOf(TensorKind::Activation, i.stage - 1, i.mb, i.slice);
        if (!got)
          return got.takeError();
        in = *got;
      }
      for (int part = first; part < end; ++part) {
        auto r = st.forward(i.mb, i.slice, part, in);
        if (!r)
          return r.takeError();
        pendingReduce = *r;
      }
      releaseConsumed();
      if (last && i.stage == plan.numStages() - 1 && c.tp == 0)
        PIPEC_GPU_TRY(st.accumulateLoss(i.mb, i.slice));
      return llvm::Error::success();
    }
    case OpKind::BackwardInput:
    case OpKind::Backward: {
      std::span<const float> grad;
      if (i.stage < plan.numStages() - 1 && first == 0) {
        auto got = inputOf(TensorKind::Gradient, i.stage + 1, i.mb, i.slice);
        if (!got)
          return got.takeError();
        grad = *got;
      }
      for (int part = first; part < end; ++part) {
        auto r = st.backwardInput(i.mb, i.slice, part, grad);
        if (!r)
          return r.takeError();
        pendingReduce = *r;
      }
      releaseConsumed();
      if (last && i.op == OpKind::Backward && i.part < 0)
        return finishFusedBackward(i.stage, i.mb, i.slice);
      return llvm::Error::success();
    }
    case OpKind::BackwardWeight:
      PIPEC_GPU_TRY(keepInputGrad(i.stage, i.mb, i.slice));
      return st.backwardWeight(i.mb, i.slice);
    case OpKind::Send:
    case OpKind::Recv:
    case OpKind::AllReduce:
    case OpKind::OptimizerStep:
      break;
    }
    return inputError("cuda backend: {} is not a compute op", toString(i.op).str());
  }

  std::span<float> sendData(const Instruction &i) override {
    // The device tensor itself; the transport orders its reads after the compute stream.
    auto src = sendSource(i);
    if (!src) {
      defer(src.takeError());
      return {};
    }
    return {const_cast<float *>(src->data()), src->size()};
  }

  std::span<float> recvData(const Instruction &i) override {
    ArenaFloats &buffer = received[key(i.tensor, i.stage, i.mb, i.slice)];
    if (llvm::Error err = buffer.allocate(ctx->allocator(), tensorSize(i)))
      defer(std::move(err)); // the transport checks the kept error before it posts
    return buffer.span();
  }

  std::span<float> reduceData(const Instruction &i) override {
    switch (i.collective) {
    case CollectiveGroup::Tp:
      return pendingReduce;
    case CollectiveGroup::Dp:
      return stages.at(i.stage)->grads();
    case CollectiveGroup::Embedding: {
      GpuStage &st = *stages.at(i.stage);
      auto [b, e] = st.tiedEmbeddingRange();
      return st.grads().subspan(b, e - b);
    }
    }
    return {};
  }

  llvm::Error afterAllReduce(const Instruction &i) override {
    PIPEC_GPU_TRY(takeDeferred());
    if (i.collective == CollectiveGroup::Tp && i.phase == OpKind::Backward && i.part == i.parts - 1)
      return finishFusedBackward(i.stage, i.mb, i.slice);
    return llvm::Error::success();
  }

  void sumLocalEmbeddingCopies() override {
    GpuStage &first = *stages.at(0), &last = *stages.at(plan.numStages() - 1);
    auto [fb, fe] = first.tiedEmbeddingRange();
    auto [lb, le] = last.tiedEmbeddingRange();
    assert(fe - fb == le - lb && "tied copies differ in size");
    // The dp all-reduces of both stages may still run on their stream.
    if (llvm::Error err = waitForCollectives()) {
      defer(std::move(err));
      return;
    }
    cudaError_t status = runtime::cuda::launch::sumPair(
        first.grads().data() + fb, last.grads().data() + lb, fe - fb, computeStream);
    if (status != cudaSuccess)
      defer(cu::makeCudaError("launch::sumPair", status, __FILE__, __LINE__));
  }

  llvm::Error optimizerStep() override {
    PIPEC_GPU_TRY(takeDeferred());
    PIPEC_GPU_TRY(waitForCollectives());
    if (warmUp) // the warm-up step measures memory; it does not train
      return llvm::Error::success();
    if (snapshot && c.dp == 0) {
      for (auto &[s, st] : stages) {
        std::vector<float> g;
        PIPEC_GPU_TRY(st->downloadGrads(g));
        std::lock_guard<std::mutex> lock(snapshot->mu);
        snapshot->byStageAndTp[{s, c.tp}] = std::move(g);
      }
    }
    for (auto &[s, st] : stages)
      PIPEC_GPU_TRY(st->adamStep(options.lr, kAdamBeta1, kAdamBeta2, kAdamEps, kAdamWeightDecay));
    return llvm::Error::success();
  }

private:
  static uint64_t key(TensorKind t, int stage, int mb, int slice) {
    return (((uint64_t(stage) << 20) | uint64_t(mb)) << 12 | uint64_t(slice)) << 1 |
           uint64_t(t == TensorKind::Gradient);
  }

  size_t tensorSize(const Instruction &i) const {
    auto [b, e] = plan.seqSlices[size_t(i.slice)];
    return size_t(cfg.microbatch) * size_t(e - b) * size_t(cfg.channels);
  }

  void defer(llvm::Error err) {
    if (deferred)
      llvm::consumeError(std::move(err));
    else
      deferred = std::move(err);
  }

  llvm::Error takeDeferred() {
    llvm::Error err = std::move(deferred);
    deferred = llvm::Error::success();
    return err;
  }

  /// The device tensor a send carries.
  llvm::Expected<std::span<const float>> sendSource(const Instruction &i) {
    if (auto it = kept.find(key(i.tensor, i.stage, i.mb, i.slice)); it != kept.end())
      return std::span<const float>(it->second.span());
    GpuStage &st = *stages.at(i.stage);
    return i.tensor == TensorKind::Activation ? st.output(i.mb, i.slice)
                                              : st.inputGrad(i.mb, i.slice);
  }

  llvm::Error finishFusedBackward(int stage, int mb, int slice) {
    PIPEC_GPU_TRY(keepInputGrad(stage, mb, slice, /*anyConsumer=*/true));
    return stages.at(stage)->backwardWeight(mb, slice);
  }

  /// As the cpu backend: keep the input gradient past the weight gradient when a consumer may
  /// still need it (a copy on the compute stream, into the arena).
  llvm::Error keepInputGrad(int stage, int mb, int slice, bool anyConsumer = false) {
    if (stage == 0)
      return llvm::Error::success();
    bool sameRank = plan.rankOf(stage - 1) == c.pp;
    if (!anyConsumer && !sameRank && !sentLate.count(key(TensorKind::Gradient, stage, mb, slice)))
      return llvm::Error::success();
    auto g = stages.at(stage)->inputGrad(mb, slice);
    if (!g)
      return g.takeError();
    ArenaFloats &k = kept[key(TensorKind::Gradient, stage, mb, slice)];
    PIPEC_GPU_TRY(k.allocate(ctx->allocator(), g->size()));
    if (!g->empty())
      PIPEC_CUDA_TRY(cudaMemcpyAsync(k.span().data(), g->data(), g->size() * sizeof(float),
                                     cudaMemcpyDeviceToDevice, computeStream));
    return llvm::Error::success();
  }

  /// The input of a compute op from stage `producer`: kept, on this rank, or received (the
  /// transport ordered the compute stream after its arrival; given back once consumed).
  llvm::Expected<std::span<const float>> inputOf(TensorKind t, int producer, int mb, int slice) {
    uint64_t k = key(t, producer, mb, slice);
    if (auto it = kept.find(k); it != kept.end())
      return std::span<const float>(it->second.span());
    if (plan.rankOf(producer) == c.pp) {
      GpuStage &p = *stages.at(producer);
      return t == TensorKind::Activation ? p.output(mb, slice) : p.inputGrad(mb, slice);
    }
    auto it = received.find(k);
    assert(it != received.end() && "the verifier guarantees a recv before its consumer");
    consumed = k;
    return std::span<const float>(it->second.span());
  }

  /// The received tensor the op just queued has copied into its stage; its buffer may go.
  void releaseConsumed() {
    if (consumed)
      received.erase(*consumed);
    consumed.reset();
  }

  const Plan &plan;
  const GptConfig &cfg;
  Coord c;
  const DataSource &data;
  const CudaRunOptions &options;
  GradSnapshot *snapshot;
  const std::vector<Instruction> &stream;
  std::unique_ptr<cu::CudaContext> ctx;
  // Declared after ctx and before the stages and buffers, which are destroyed first and give
  // their memory back to it.
  std::unique_ptr<DeviceArena> arena;
  cudaStream_t computeStream = nullptr;
  std::map<int, std::unique_ptr<GpuStage>> stages;
  std::map<uint64_t, ArenaFloats> received, kept;
  std::optional<uint64_t> consumed;
  std::set<uint64_t> sentLate;
  std::span<float> pendingReduce;
  bool warmUp = false;
  llvm::Error deferred = llvm::Error::success();
  std::function<llvm::Error()> waitForCollectives;
};

} // namespace

llvm::Expected<int> cudaDevices() {
  auto n = cu::deviceCount();
  if (!n)
    return n.takeError();
  if (*n == 0)
    return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                   "cudaGetDeviceCount reports 0 devices");
  return *n;
}

llvm::Expected<std::unique_ptr<CudaRankBackend>>
createDeviceTransportBackend(const Plan &plan, const GptConfig &cfg, const Coord &c,
                             const DataSource &data, const CudaRunOptions &options,
                             GradSnapshot *snapshot,
                             std::function<llvm::Error()> waitForCollectives) {
  assert(waitForCollectives && "a device transport orders the all-reduces");
  auto b = std::make_unique<CudaBackend>(plan, cfg, c, data, options, snapshot,
                                         std::move(waitForCollectives));
  if (auto err = b->init())
    return err;
  return std::unique_ptr<CudaRankBackend>(std::move(b));
}

/// The warm-up step (not counted, no optimizer update) that sizes every rank's arena.
static llvm::Error warmUpAndReserve(Runner &runner, llvm::ArrayRef<CudaRankBackend *> backends) {
  for (CudaRankBackend *b : backends)
    b->setWarmUp(true);
  if (auto err = runner.step(0))
    return err;
  for (CudaRankBackend *b : backends)
    if (auto share = b->finishStep(); !share)
      return share.takeError();
  PIPEC_GPU_TRY(releaseWarmUpMemory());
  for (CudaRankBackend *b : backends) {
    PIPEC_GPU_TRY(b->reserveArena());
    b->setWarmUp(false);
  }
  return llvm::Error::success();
}

llvm::Expected<CudaRunResult> runOnCuda(const Plan &plan, const DataSource &data,
                                        const CudaRunOptions &options,
                                        const std::function<void(int, double)> &onStep) {
  auto cfgOr = gptConfigOf(plan);
  if (!cfgOr)
    return cfgOr.takeError();
  const GptConfig cfg = *cfgOr;
  auto devices = cudaDevices();
  if (!devices)
    return devices.takeError();
  if (options.device < 0 || options.device >= *devices)
    return inputError("cuda device {} does not exist ({} visible); try 0", options.device,
                      *devices);
  PIPEC_CUDA_TRY(cudaSetDevice(options.device));
  const ParallelConfig &pc = plan.parallel;
  const int threads = pc.pp * pc.dp * pc.tp;
  LocalCudaTransport transport(plan, threads);
  GradSnapshot snapshot;
  std::vector<std::unique_ptr<Backend>> backends;
  std::vector<CudaRankBackend *> gpu;
  for (int t = 0; t < threads; ++t) {
    Coord c{t / (pc.dp * pc.tp), t / pc.tp % pc.dp, t % pc.tp};
    auto b = createDeviceTransportBackend(plan, cfg, c, data, options,
                                          options.checkReference ? &snapshot : nullptr,
                                          [&transport, t] { return transport.waitForCollectives(t); });
    if (!b)
      return b.takeError();
    CudaRankBackend *raw = b->get();
    PIPEC_GPU_TRY(transport.attach(t, static_cast<cudaStream_t>(raw->computeStreamHandle()),
                                   [raw] { return raw->takeDeferredError(); }));
    gpu.push_back(raw);
    backends.push_back(std::move(*b));
  }
  Runner runner(plan, Faults{}, options.timeoutSeconds, std::move(backends), transport);
  PIPEC_GPU_TRY(warmUpAndReserve(runner, gpu));
  CudaRunResult result;
  for (CudaRankBackend *b : gpu)
    result.arenaBytes.push_back(b->arenaBytes());
  std::unique_ptr<ReferenceRun> ref;
  if (options.checkReference)
    ref = std::make_unique<ReferenceRun>(plan, cfg, data, options.seed, options.lr);
  for (int s = 0; s < options.steps; ++s) {
    if (auto err = runner.step(s))
      return err;
    double loss = 0;
    for (CudaRankBackend *b : gpu) {
      auto l = b->finishStep();
      if (!l)
        return l.takeError();
      loss += *l;
    }
    result.losses.push_back(loss);
    if (ref) {
      result.referenceLosses.push_back(ref->step(s));
      ref->compare(snapshot, result.maxAbsGradDiff, result.gradScale);
      result.lastGrads = snapshot.byStageAndTp;
      ref->update();
    }
    if (onStep)
      onStep(s, loss);
  }
  return result;
}

#undef PIPEC_GPU_TRY

} // namespace pipec
