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

#include "ir/support/Bytes.h"
#include "ir/support/Error.h"
#include "kernels/cpu/Gpt.h"
#include "kernels/cuda/CudaCheck.h"
#include "kernels/cuda/CudaOps.h"
#include "runtime/BlockingWatchdog.h"
#include "runtime/Profile.h"
#include "runtime/Runner.h"
#include "runtime/StageDispatch.h"
#include "runtime/cuda/DeviceArena.h"
#include "runtime/cuda/DeviceHandles.h"
#include "runtime/cuda/GpuStage.h"
#include "runtime/cuda/LocalTransport.h"
#include "runtime/cuda/StageBuffer.h"
#include "runtime/cuda/StageKernels.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <mutex>
#include <optional>
#include <set>

namespace pipec {

namespace {

namespace cu = kernels::cuda;

/// `bytes` in MiB, as the memory errors print them.
using kernels::GptConfig;
using kernels::StageCompute;

/// The transport of the sizing pass: nothing moves and no peer is waited for. A rank's buffer
/// requests do not depend on its peers (the recv buffer is the backend's, whatever fills it).
class SizingTransport final : public Transport {
public:
  llvm::Error exchange(int, llvm::ArrayRef<P2POp>) override { return llvm::Error::success(); }
  llvm::Error allReduce(CollectiveGroup, const std::string &, llvm::ArrayRef<int>, int,
                        TensorView) override {
    return llvm::Error::success();
  }
  void abort(const std::string &) override {}
  bool aborted() const override { return false; }
};

/// One rank's backend on a device transport (the local one here, NCCL's in NcclRun.cpp): sends
/// hand out the device tensor itself, recvs a buffer of the rank's arena that the transport
/// fills, all-reduces sum in place. The dispatch is the cpu backend's (StageDispatch).
class CudaBackend final
    : public StageDispatch<CudaBackend, GpuStage, DeviceTensor, CudaRankBackend> {
public:
  static constexpr const char *kName = "cuda backend";

  CudaBackend(const Plan &plan, const GptConfig &cfg, const Coord &c, const DataSource &data,
              const CudaRunOptions &options, ParamSnapshot *snapshot,
              std::function<llvm::Error()> waitForCollectives)
      : StageDispatch(plan, c, size_t(cfg.microbatch) * size_t(cfg.channels)), cfg(cfg), data(data),
        options(options), snapshot(snapshot), waitForCollectives(std::move(waitForCollectives)),
        who(fmt::format("rank {} (pp {}, dp {}, tp {})",
                        (c.pp * plan.parallel.dp + c.dp) * plan.parallel.tp + c.tp, c.pp, c.dp,
                        c.tp)) {}

  void *computeStreamHandle() const override { return computeStream; }
  /// --profile: the host clock times the rank's queued work (the emulated device runs it too).
  llvm::Error awaitCompute() override {
    PIPEC_CUDA_TRY(cudaStreamSynchronize(computeStream));
    return llvm::Error::success();
  }
  void readElsewhere(const void *p, size_t bytes, void *done) override {
    if (arena)
      arena->readElsewhere(p, bytes, static_cast<cudaEvent_t>(done));
  }
  void elsewhereReadsDone() override {
    if (arena)
      arena->elsewhereReadsDone();
  }
  llvm::Error takeDeferredError() override { return takeDeferred(); }
  size_t arenaBytes() const override { return arena ? arena->reservedBytes() : 0; }
  size_t arenaUsedBytes() const override { return arena ? arena->stepHighWater() : 0; }
  size_t arenaLiveBytes() const override { return arena ? arena->stepPeakLive() : 0; }

  llvm::Expected<size_t> measureArena() override {
    ctx->setSizing(true);
    llvm::Error err = [&]() -> llvm::Error {
      SizingTransport none;
      RunShared shared(plan, Faults{}, none);
      PIPEC_TRY(beginStep(0));
      PIPEC_TRY(interpretStep(shared, c, *this));
      if (auto share = finishStep(); !share)
        return share.takeError();
      return llvm::Error::success();
    }();
    ctx->setSizing(false);
    if (err) {
      clearStepBuffers();
      return err;
    }
    return arena->reservedBytes();
  }
  llvm::Error reserveArena() override { return arena->reserve(); }

  llvm::Error snapshotWeights(ParamSnapshot &into) override {
    PIPEC_CUDA_TRY(cudaSetDevice(options.device));
    for (auto &[s, st] : stages) {
      std::vector<float> w(st->params().size());
      if (!w.empty()) {
        PIPEC_CUDA_TRY(cudaMemcpyAsync(w.data(), st->params().data(), w.size() * sizeof(float),
                                       cudaMemcpyDeviceToHost, computeStream));
        PIPEC_CUDA_TRY(cudaStreamSynchronize(computeStream));
      }
      std::lock_guard<std::mutex> lock(into.mu);
      into.digests[{c.dp, s, c.tp}] = weightDigest(w);
      if (c.dp == 0)
        into.byStageAndTp[{s, c.tp}] = std::move(w);
    }
    return llvm::Error::success();
  }

  bool holdsLayer(int layer) const override { return stageOf(layer) != nullptr; }

  llvm::Error readLayer(int layer, LayerState &part) override {
    GpuStage *st = stageOf(layer);
    assert(st && "readLayer of a layer the rank does not hold");
    PIPEC_CUDA_TRY(cudaSetDevice(options.device));
    auto [b, e] = st->layerRange(layer);
    std::span<float> from[] = {st->params(), st->adamFirstMoment(), st->adamSecondMoment()};
    std::vector<float> *to[] = {&part.weights, &part.firstMoment, &part.secondMoment};
    for (int a = 0; a < 3; ++a) {
      to[a]->resize(e - b);
      if (e > b)
        PIPEC_CUDA_TRY(cudaMemcpyAsync(to[a]->data(), from[a].data() + b, (e - b) * sizeof(float),
                                       cudaMemcpyDeviceToHost, computeStream));
    }
    PIPEC_CUDA_TRY(cudaStreamSynchronize(computeStream));
    return llvm::Error::success();
  }

  llvm::Error writeLayer(int layer, const LayerState &whole) override {
    GpuStage *st = stageOf(layer);
    if (!st)
      return llvm::Error::success();
    PIPEC_CUDA_TRY(cudaSetDevice(options.device));
    auto [b, e] = st->layerRange(layer);
    std::span<float> to[] = {st->params(), st->adamFirstMoment(), st->adamSecondMoment()};
    const std::vector<float> *from[] = {&whole.weights, &whole.firstMoment, &whole.secondMoment};
    for (int a = 0; a < 3; ++a) {
      if (from[a]->empty()) // weights alone (--init-from): the moments stay
        continue;
      std::vector<float> shard = kernels::shardLayer(cfg, layer, c.tp, plan.parallel.tp, *from[a]);
      assert(shard.size() == e - b && "a shard fills the layer's range");
      if (!shard.empty())
        PIPEC_CUDA_TRY(cudaMemcpyAsync(to[a].data() + b, shard.data(), shard.size() * sizeof(float),
                                       cudaMemcpyHostToDevice, computeStream));
      // (The copy reads `shard` on the host: it must finish before the vector goes.)
      PIPEC_CUDA_TRY(cudaStreamSynchronize(computeStream));
    }
    return st->paramsWritten();
  }

  int adamSteps() const override {
    return stages.empty() ? 0 : stages.begin()->second->adamSteps();
  }
  void setAdamSteps(int steps) override {
    for (auto &[s, st] : stages)
      st->setAdamSteps(steps);
  }

  /// The context and the arena (empty until reserveArena()).
  llvm::Error init() {
    auto ctxOr = cu::CudaContext::create(options.device, options.kernels);
    if (!ctxOr) {
      // Out of memory before any of the plan's: the GPU is (nearly) full already, so say so, and
      // what would help. Any other failure is passed on as it is.
      llvm::Error err = ctxOr.takeError();
      if (!err.isA<cu::CudaOutOfMemoryError>())
        return err;
      size_t freeBytes = 0, totalBytes = 0;
      if (cudaMemGetInfo(&freeBytes, &totalBytes) != cudaSuccess)
        freeBytes = totalBytes = 0;
      return llvm::createStringError(
          llvm::inconvertibleErrorCode(),
          fmt::format("{}: cannot set up on GPU {}: a CUDA stream, cuBLASLt and its {:.0f} MiB "
                      "workspace do not fit{} ({}); free the GPU's memory (nvidia-smi lists the "
                      "processes using it) or run on another GPU",
                      who, options.device, inMiB(cu::CudaContext::kWorkspaceBytes),
                      totalBytes ? fmt::format(" in the {:.1f} MiB free of its {:.1f} MiB",
                                               inMiB(freeBytes), inMiB(totalBytes))
                                 : std::string(),
                      takeMessage(std::move(err))));
    }
    ctx = std::move(*ctxOr);
    computeStream = static_cast<cudaStream_t>(ctx->stream());
    arena = std::make_unique<DeviceArena>(computeStream, who);
    ctx->setAllocator(arena.get());
    // The progress events, one per compute op of the rank's stream and one for the optimizer
    // step, made now so that no step creates one.
    size_t ops = 1;
    for (const Instruction &i : plan.ranks[size_t(c.pp)])
      ops += i.op == OpKind::Forward || i.op == OpKind::BackwardInput ||
                     i.op == OpKind::BackwardWeight || i.op == OpKind::Backward
                 ? 1
                 : 0;
    while (progress.size() < ops) {
      progress.push_back(std::make_unique<runtime_cuda::OwnedEvent>());
      if (auto err = progress.back()->create())
        return err;
    }
    return llvm::Error::success();
  }

  size_t stateBytes() const override {
    size_t bytes = 0;
    for (const StageInfo &s : plan.stages)
      if (s.rank == c.pp)
        bytes +=
            GpuStage::stateBytes(cfg, s.layerBegin, s.layerEnd, plan.parallel.tp, options.dtype);
    if (snapshot && c.dp == 0)
      bytes += paramsHere() * sizeof(float); // snapshotCopies
    return bytes;
  }

  llvm::Error createStages(llvm::StringRef fix) override {
    assert(stages.empty() && "createStages() twice");
    PIPEC_CUDA_TRY(cudaSetDevice(options.device));
    const size_t need = stateBytes();
    size_t freeBytes = 0, totalBytes = 0;
    PIPEC_CUDA_TRY(cudaMemGetInfo(&freeBytes, &totalBytes));
    if (need > freeBytes)
      return cannotHold(need, freeBytes, totalBytes, "", fix);
    llvm::Error err = [&]() -> llvm::Error {
      for (const StageInfo &s : plan.stages) {
        if (s.rank != c.pp)
          continue;
        auto st =
            GpuStage::create(*ctx, cfg, s.layerBegin, s.layerEnd, c.tp, plan.parallel.tp,
                             options.seed, slicesOf(plan), lossScaleOf(plan, cfg), options.dtype);
        if (!st)
          return st.takeError();
        stages[s.stage] = std::move(*st);
      }
      if (snapshot && c.dp == 0)
        for (auto &[s, st] : stages) {
          auto copy = cu::DeviceBuffer::allocate(st->grads().size() * sizeof(float));
          if (!copy)
            return copy.takeError();
          snapshotCopies[s] = std::move(*copy);
        }
      return llvm::Error::success();
    }();
    if (!err)
      return llvm::Error::success();
    snapshotCopies.clear();
    stages.clear();
    // Out of memory after all (memory another process took meanwhile, the allocations' rounding,
    // fragmentation): the same message, with the call that failed. Any other failure (a launch,
    // a copy) is passed on as it is: no fix about memory would help.
    if (!err.isA<cu::CudaOutOfMemoryError>())
      return err;
    if (cudaMemGetInfo(&freeBytes, &totalBytes) != cudaSuccess)
      freeBytes = totalBytes = 0;
    return cannotHold(need, freeBytes, totalBytes, takeMessage(std::move(err)), fix);
  }

  ~CudaBackend() override {
    // The stages and the step's buffers (StageDispatch's, destroyed after this class's members)
    // hold arena memory and use the context: they go first.
    clearStepBuffers();
    stages.clear();
  }

  llvm::Error beginStep(int step) override {
    PIPEC_CUDA_TRY(cudaSetDevice(options.device));
    PIPEC_TRY(takeDeferred());
    progressUsed = progressDone = 0;
    auto batch = stepBatch(data, cfg, plan.parallel, step, c.dp);
    for (auto &[s, st] : stages) {
      PIPEC_TRY(st->zeroGrads());
      PIPEC_TRY(st->setBatch(batch));
    }
    return llvm::Error::success();
  }

  size_t completedWork() override {
    while (progressDone < progressUsed &&
           cudaEventQuery(progress[progressDone]->get()) == cudaSuccess)
      ++progressDone;
    return progressDone;
  }

  /// After a compute op (StageDispatch::compute) and the optimizer step: a progress event.
  void afterCompute(const Instruction &) { markProgress(); }

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
    clearStepBuffers();
    if (snapshotPending) {
      snapshotPending = false;
      for (auto &[s, st] : stages) {
        std::vector<float> g(st->grads().size());
        PIPEC_CUDA_TRY(cudaMemcpy(g.data(), snapshotCopies.at(s).as<float>(),
                                  g.size() * sizeof(float), cudaMemcpyDeviceToHost));
        std::lock_guard<std::mutex> lock(snapshot->mu);
        snapshot->byStageAndTp[{s, c.tp}] = std::move(g);
      }
    }
    return loss;
  }

  // StageDispatch's hooks.
  llvm::Error addLoss(GpuStage &st, int mb, int slice) { return st.accumulateLoss(mb, slice); }
  llvm::Error allocate(DeviceTensor &buffer, size_t elements) {
    // (The transport checks a kept error before it posts anything.) A received tensor is in
    // the compute type, as every p2p tensor.
    return buffer.allocate(mem(), elements, options.dtype);
  }
  /// A copy on the compute stream, into the arena.
  llvm::Error keepCopy(DeviceTensor &buffer, TensorView src) { return buffer.copyFrom(mem(), src); }
  static TensorView viewOf(DeviceTensor &buffer) { return buffer.view(); }
  Mem mem() { return Mem{&ctx->allocator(), computeStream, ctx->sizing()}; }

  void sumLocalEmbeddingCopies() override {
    if (ctx->sizing())
      return;
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
    PIPEC_TRY(takeDeferred());
    if (ctx->sizing()) // the sizing pass measures memory; it does not train
      return llvm::Error::success();
    PIPEC_TRY(waitForCollectives());
    // The gradients the optimizer sees, for --check-reference: a device copy now (the host must
    // not wait for the device inside the step), read back by finishStep().
    if (snapshot && c.dp == 0) {
      for (auto &[s, st] : stages) {
        if (!st->grads().empty())
          PIPEC_CUDA_TRY(cudaMemcpyAsync(snapshotCopies.at(s).as<float>(), st->grads().data(),
                                         st->grads().size() * sizeof(float),
                                         cudaMemcpyDeviceToDevice, computeStream));
      }
      snapshotPending = true;
    }
    for (auto &[s, st] : stages)
      PIPEC_TRY(st->adamStep(options.lr, kAdamBeta1, kAdamBeta2, kAdamEps, kAdamWeightDecay));
    markProgress();
    return llvm::Error::success();
  }

private:
  /// The stage of this rank holding `layer`, or null.
  GpuStage *stageOf(int layer) const {
    for (auto &[s, st] : stages) {
      const StageInfo &info = plan.stages[size_t(s)];
      if (layer >= info.layerBegin && layer < info.layerEnd)
        return st.get();
    }
    return nullptr;
  }

  void markProgress() {
    if (ctx->sizing() || progressUsed == progress.size())
      return; // (the sizing pass queues nothing; the bound is init()'s count of the ops)
    cudaError_t status = cudaEventRecord(progress[progressUsed]->get(), computeStream);
    if (status != cudaSuccess)
      defer(cu::makeCudaError("cudaEventRecord(progress)", status, __FILE__, __LINE__));
    ++progressUsed;
  }

  /// The parameters of this rank's stages (on its tp rank).
  size_t paramsHere() const {
    size_t n = 0;
    for (const StageInfo &s : plan.stages)
      if (s.rank == c.pp)
        n += GpuStage::paramCount(cfg, s.layerBegin, s.layerEnd, plan.parallel.tp);
    return n;
  }

  /// createStages()'s error: `need` bytes, `freeBytes` of `totalBytes` free (0 of 0: unknown),
  /// the failed call's message, if any, and the runner's `fix`.
  llvm::Error cannotHold(size_t need, size_t freeBytes, size_t totalBytes, const std::string &cause,
                         llvm::StringRef fix) const {
    std::string copies = "4 fp32 copies: weights, gradients, Adam's two moments";
    if (options.dtype == kernels::DType::BF16)
      copies += "; a bf16 copy of the weights";
    if (snapshot && c.dp == 0)
      copies += "; --check-reference's copy of the gradients";
    return llvm::createStringError(
        llvm::inconvertibleErrorCode(),
        fmt::format("{}: cannot hold the {:.1f} MiB of weights, gradients and optimizer state "
                    "its stages need ({} parameters, {}){}{}; {}",
                    who, inMiB(need), paramsHere(), copies,
                    totalBytes ? fmt::format(" ({:.1f} MiB of {:.1f} MiB free)", inMiB(freeBytes),
                                             inMiB(totalBytes))
                               : std::string(),
                    cause.empty() ? std::string() : ": " + cause, fix.str()));
  }

  const GptConfig &cfg;
  const DataSource &data;
  const CudaRunOptions &options;
  ParamSnapshot *snapshot;
  std::unique_ptr<cu::CudaContext> ctx;
  cudaStream_t computeStream = nullptr;
  std::function<llvm::Error()> waitForCollectives;
  std::string who;                    // "rank R (pp P, dp D, tp T)", its errors' start
  std::unique_ptr<DeviceArena> arena; // destroyed before ctx (its stream)
  // --check-reference: per stage, the gradients before the update (not the arena's memory).
  std::map<int, cu::DeviceBuffer> snapshotCopies;
  bool snapshotPending = false;
  // completedWork(): events recorded on the compute stream after each compute op and the
  // optimizer step (progressUsed of them this step), the first progressDone seen finished.
  std::vector<std::unique_ptr<runtime_cuda::OwnedEvent>> progress;
  size_t progressUsed = 0, progressDone = 0;
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
                             ParamSnapshot *snapshot,
                             std::function<llvm::Error()> waitForCollectives) {
  assert(waitForCollectives && "a device transport orders the all-reduces");
  auto b = std::make_unique<CudaBackend>(plan, cfg, c, data, options, snapshot,
                                         std::move(waitForCollectives));
  if (auto err = b->init())
    return err;
  return std::unique_ptr<CudaRankBackend>(std::move(b));
}

/// The ranks' `need` (thread order) of `what` fits into the free memory of `device` together, or
/// an error that gives what each needs and `fix`.
static llvm::Error checkRanksFit(const std::vector<size_t> &need, int device, const char *what,
                                 const char *fix) {
  size_t sum = 0;
  for (size_t bytes : need)
    sum += bytes;
  size_t freeBytes = 0, totalBytes = 0;
  PIPEC_CUDA_TRY(cudaMemGetInfo(&freeBytes, &totalBytes));
  if (sum <= freeBytes)
    return llvm::Error::success();
  std::string byRank;
  for (size_t r = 0; r < need.size(); ++r)
    byRank += fmt::format("{}{:.1f}", r == 0 ? "" : " ", inMiB(need[r]));
  return llvm::createStringError(
      llvm::inconvertibleErrorCode(),
      fmt::format("--backend cuda: the plan's {} ranks need {:.1f} MiB of {} together on GPU {} "
                  "(MiB by rank, in RANK order: {}), and {:.1f} MiB of its {:.1f} MiB are free; {}",
                  need.size(), inMiB(sum), what, device, byRank, inMiB(freeBytes),
                  inMiB(totalBytes), fix));
}

llvm::Error gpuRunsTheBlock(const GptConfig &cfg, const Plan &plan, llvm::StringRef backend) {
  if (cfg.rmsnorm || (cfg.bias && cfg.normEps == 1e-5f))
    return llvm::Error::success();
  return inputError("--backend {}: the plan's model has a LayerNorm {} ({}), which the CUDA "
                    "layernorm kernel does not compute (it has GPT-2's shift and epsilon 1e-5); "
                    "use \"norm\": \"rmsnorm\", or train it with --backend cpu",
                    backend.str(), cfg.bias ? "with another epsilon" : "without a shift",
                    plan.transformer ? plan.transformer->variantText() : "");
}

namespace {

/// Layer `layer` whole from the tp parts of the ranks of dp replica 0 that hold it (`ranks`, this
/// process's), into `whole`.
llvm::Error gatherLocalLayer(const std::vector<CudaRankBackend *> &ranks,
                             const std::vector<Coord> &coords, const GptConfig &cfg, int tp,
                             int layer, LayerState &whole) {
  LayerState part;
  for (size_t r = 0; r < ranks.size(); ++r) {
    if (coords[r].dp != 0 || !ranks[r]->holdsLayer(layer))
      continue;
    PIPEC_TRY(ranks[r]->readLayer(layer, part));
    const int t = coords[r].tp;
    kernels::unshardLayer(cfg, layer, t, tp, part.weights, whole.weights);
    kernels::unshardLayer(cfg, layer, t, tp, part.firstMoment, whole.firstMoment);
    kernels::unshardLayer(cfg, layer, t, tp, part.secondMoment, whole.secondMoment);
  }
  return llvm::Error::success();
}

/// The cuda backend as the training driver sees it: every rank a CudaBackend thread of a Runner
/// on one GPU, over the local transport.
class CudaTrainBackend final : public GpuTrainBackend {
public:
  CudaTrainBackend(const Plan &plan, const GptConfig &cfg, const DataSource &data,
                   const CudaRunOptions &options)
      : plan(plan), cfg(cfg), data(data), options(options) {}

  llvm::Error setUp() override {
    PIPEC_TRY(gpuRunsTheBlock(cfg, plan, "cuda"));
    auto devices = cudaDevices();
    if (!devices)
      return devices.takeError();
    if (options.device < 0 || options.device >= *devices)
      return inputError("cuda device {} does not exist ({} visible); try 0", options.device,
                        *devices);
    PIPEC_CUDA_TRY(cudaSetDevice(options.device));
    const ParallelConfig &pc = plan.parallel;
    // The local transport sums an all-reduce's members in one kernel of at most kMaxSumOperands
    // (LocalTransport.cpp): a larger dp or tp group is refused here, not in step 0.
    const int most = runtime::cuda::launch::kMaxSumOperands;
    if (pc.dp > most || pc.tp > most)
      return inputError("--backend cuda: the plan's {} all-reduces have {} members, and the cuda "
                        "backend (every rank on one GPU) sums at most {}; use --backend nccl "
                        "(one GPU per rank) for this plan",
                        pc.dp > most ? "dp" : "tp", pc.dp > most ? pc.dp : pc.tp, most);
    const int threads = pc.pp * pc.dp * pc.tp;
    transport = std::make_unique<LocalCudaTransport>(plan, threads);
    std::vector<std::unique_ptr<Backend>> backends;
    for (int t = 0; t < threads; ++t) {
      Coord c{t / (pc.dp * pc.tp), t / pc.tp % pc.dp, t % pc.tp};
      auto b = createDeviceTransportBackend(plan, cfg, c, data, options,
                                            options.checkReference ? &snapshot : nullptr,
                                            [this, t] { return transport->waitForCollectives(t); });
      if (!b)
        return b.takeError();
      CudaRankBackend *raw = b->get();
      PIPEC_TRY(transport->attach(t, static_cast<cudaStream_t>(raw->computeStreamHandle()),
                                  [raw] { return raw->takeDeferredError(); }));
      gpu.push_back(raw);
      coords.push_back(c);
      backends.push_back(std::move(*b));
    }
    PIPEC_TRY(allocate());
    runner = std::make_unique<Runner>(plan, Faults{}, options.timeoutSeconds, std::move(backends),
                                      *transport);
    if (options.profile)
      runner->state().enableTiming();
    for (CudaRankBackend *b : gpu) {
      sofar.stateBytes.push_back(b->stateBytes());
      sofar.arenaBytes.push_back(b->arenaBytes());
    }
    if (options.onArenas)
      options.onArenas(sofar);
    return llvm::Error::success();
  }

  llvm::Expected<double> step(int s) override {
    if (auto err = runner->step(s))
      return err;
    // The host has queued the whole step; the ranks' GPU work may still run for a while, but
    // a kernel that never finishes would hold these waits forever, where no watchdog of the
    // Runner's (it sees the host) runs. So: --timeout without any rank's compute op
    // finishing on the GPU, and the process ends with one line.
    BlockingWatchdog guard(
        fmt::format("the wait for step {}'s GPU work (every rank's)", s), options.timeoutSeconds,
        "no rank's compute op finished on the GPU in that time: a kernel that never finishes?",
        [this] {
          uint64_t done = 0;
          for (CudaRankBackend *b : gpu)
            done += b->completedWork();
          return done;
        });
    double loss = 0;
    for (CudaRankBackend *b : gpu) {
      auto l = b->finishStep();
      if (!l)
        return l.takeError();
      loss += *l;
    }
    return loss;
  }

  llvm::Error takeGradients(ParamSnapshot &into) override {
    snapshot.handOver(into);
    return llvm::Error::success();
  }
  llvm::Error snapshotWeights(ParamSnapshot &into) override {
    for (CudaRankBackend *b : gpu)
      PIPEC_TRY(b->snapshotWeights(into));
    return llvm::Error::success();
  }
  bool holdsLayer(int) const override { return true; } // every rank is a thread here
  llvm::Error scatterLayer(int layer, const LayerState &whole) override {
    for (CudaRankBackend *b : gpu)
      PIPEC_TRY(b->writeLayer(layer, whole));
    return llvm::Error::success();
  }
  llvm::Error gatherLayer(int layer, LayerState &whole) override {
    return gatherLocalLayer(gpu, coords, cfg, plan.parallel.tp, layer, whole);
  }
  llvm::Error measuredCosts(MeasuredCosts &into) override {
    // Each pipeline rank's dp replica 0, tp rank 0 thread speaks for it.
    ProfileTable table(plan);
    RunShared &shared = runner->state();
    for (int pp = 0; pp < plan.parallel.pp; ++pp) {
      const int t = shared.threadOf(Coord{pp, 0, 0});
      const CudaRankBackend &b = *gpu[size_t(t)];
      table.addRank(pp, shared.timings[size_t(t)], int64_t(b.stateBytes() + b.arenaUsedBytes()));
    }
    into = table.costs();
    into.backend = "cuda";
    into.dtype = options.dtype == kernels::DType::BF16 ? "bf16" : "fp32";
    into.device = fmt::format("cuda device {}", options.device);
    into.threads = shared.numThreads();
    return llvm::Error::success();
  }
  int adamSteps() const override { return gpu.front()->adamSteps(); }
  void setAdamSteps(int steps) override {
    for (CudaRankBackend *b : gpu)
      b->setAdamSteps(steps);
  }

  /// The memory figures so far (stateBytes and arenaBytes; arenaUsedBytes after the run).
  CudaRunResult memory() const override {
    CudaRunResult m = sofar;
    for (CudaRankBackend *b : gpu) {
      m.arenaUsedBytes.push_back(b->arenaUsedBytes());
      m.arenaLiveBytes.push_back(b->arenaLiveBytes());
    }
    return m;
  }

private:
  /// Every rank's weights, gradients and optimizer state, and then its arena: all ranks share
  /// the GPU, so what they need together is checked against its free memory before any is
  /// allocated (or initialised).
  llvm::Error allocate() {
    std::vector<size_t> state;
    for (CudaRankBackend *b : gpu)
      state.push_back(b->stateBytes());
    const char *fix = "run one rank per GPU with --backend nccl (each GPU then holds its rank's "
                      "share alone), or a smaller model";
    PIPEC_TRY(checkRanksFit(state, options.device, "weights, gradients and optimizer state", fix));
    for (CudaRankBackend *b : gpu)
      PIPEC_TRY(b->createStages(fix));
    // Every rank's arena, before anything of a step reaches the device (one rank after another:
    // the sizing pass involves no peer).
    std::vector<size_t> need;
    for (CudaRankBackend *b : gpu) {
      auto bytes = b->measureArena();
      if (!bytes)
        return bytes.takeError();
      need.push_back(*bytes);
    }
    PIPEC_TRY(checkRanksFit(need, options.device, "activation memory",
                            "use fewer microbatches in flight (a schedule with a lower peak, e.g. "
                            "1f1b instead of gpipe) or a smaller microbatch, or run one rank per "
                            "GPU with --backend nccl"));
    for (CudaRankBackend *b : gpu)
      PIPEC_TRY(b->reserveArena());
    return llvm::Error::success();
  }

  const Plan &plan;
  const GptConfig &cfg;
  const DataSource &data;
  const CudaRunOptions &options;
  ParamSnapshot snapshot; // with checkReference: the gradients of the step, by (stage, tp rank)
  std::unique_ptr<LocalCudaTransport> transport; // (destroyed after the runner and its ranks)
  std::vector<CudaRankBackend *> gpu;
  std::vector<Coord> coords;
  std::unique_ptr<Runner> runner;
  CudaRunResult sofar;
};

} // namespace

std::unique_ptr<TrainBackend> createCudaBackend(const Plan &plan, const GptConfig &cfg,
                                                const DataSource &data,
                                                const CudaRunOptions &options) {
  return std::make_unique<CudaTrainBackend>(plan, cfg, data, options);
}

llvm::Expected<CudaRunResult> runOnCuda(const Plan &plan, const DataSource &data,
                                        const CudaRunOptions &options,
                                        const std::function<void(int, double)> &onStep) {
  auto cfg = gptConfigOf(plan);
  if (!cfg)
    return cfg.takeError();
  CudaTrainBackend backend(plan, *cfg, data, options);
  return trainOnGpu(plan, *cfg, data, backend, options, onStep);
}

llvm::Expected<CudaRunResult> trainOnGpu(const Plan &plan, const GptConfig &cfg,
                                         const DataSource &data, GpuTrainBackend &backend,
                                         const CudaRunOptions &options,
                                         const std::function<void(int, double)> &onStep) {
  auto trained = train(plan, cfg, data, backend, options, onStep);
  if (!trained)
    return trained.takeError();
  CudaRunResult result = backend.memory();
  static_cast<TrainResult &>(result) = std::move(*trained);
  return result;
}

} // namespace pipec
