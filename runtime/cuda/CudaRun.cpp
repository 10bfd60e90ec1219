//===- CudaRun.cpp - The cuda backend: the plan's ranks on one GPU --------===//
//
// CpuBackend (runtime/cpu/CpuRun.cpp) with GpuStage for StageCompute: the same handling of
// recv buffers, kept input gradients of fused backwards and late sends, tp parts and their
// all-reduces, dp and tied-embedding all-reduces. Backend calls that cannot return an error
// (sendData, recvData, reduceData, sumLocalEmbeddingCopies) keep the first CUDA error and the
// next call that can return one reports it; their span then has the right size (filled with
// NaN where it carries data), so the transport does not report a mismatch instead.
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
#include "runtime/cuda/DeviceHandles.h"
#include "runtime/cuda/GpuStage.h"
#include "runtime/cuda/StageKernels.h"

#include <cuda_runtime_api.h>

#include <cmath>
#include <limits>
#include <mutex>
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

using Stream = runtime_cuda::OwnedStream;
using Event = runtime_cuda::OwnedEvent;

class PinnedFloats {
public:
  PinnedFloats() = default;
  PinnedFloats(const PinnedFloats &) = delete;
  PinnedFloats &operator=(const PinnedFloats &) = delete;
  ~PinnedFloats() {
    if (p)
      (void)cudaFreeHost(p);
  }
  llvm::Error allocate(size_t n) {
    if (n == 0)
      return llvm::Error::success();
    void *ptr = nullptr;
    PIPEC_CUDA_TRY(cudaMallocHost(&ptr, n * sizeof(float)));
    p = static_cast<float *>(ptr);
    count = n;
    return llvm::Error::success();
  }
  float *data() const { return p; }
  size_t size() const { return count; }

private:
  float *p = nullptr;
  size_t count = 0;
};

class DeviceFloats {
public:
  DeviceFloats() = default;
  DeviceFloats(const DeviceFloats &) = delete;
  DeviceFloats &operator=(const DeviceFloats &) = delete;
  ~DeviceFloats() {
    if (p)
      (void)cudaFree(p);
  }
  llvm::Error allocate(size_t n) {
    if (n == 0)
      return llvm::Error::success();
    void *ptr = nullptr;
    PIPEC_CUDA_TRY(cudaMalloc(&ptr, n * sizeof(float)));
    p = static_cast<float *>(ptr);
    count = n;
    return llvm::Error::success();
  }
  float *data() const { return p; }

private:
  float *p = nullptr;
  size_t count = 0;
};

/// With `waitForCollectives` set, the device-transport variant (createDeviceTransportBackend):
/// the transport moves device memory itself, so nothing is staged through the host.
class CudaBackend final : public CudaRankBackend {
public:
  CudaBackend(const Plan &plan, const GptConfig &cfg, const Coord &c, const DataSource &data,
              const CudaRunOptions &options, GradSnapshot *snapshot,
              std::function<llvm::Error()> waitForCollectives = {})
      : plan(plan), cfg(cfg), c(c), data(data), options(options), snapshot(snapshot),
        stream(plan.ranks[size_t(c.pp)]), waitForCollectives(std::move(waitForCollectives)) {}

  bool onDevice() const { return bool(waitForCollectives); }
  void *computeStreamHandle() const override { return computeStream; }
  llvm::Error takeDeferredError() override { return takeDeferred(); }

  /// Streams, stages, staging slots; everything that can fail.
  llvm::Error init() {
    auto ctxOr = cu::CudaContext::create(options.device);
    if (!ctxOr)
      return ctxOr.takeError();
    ctx = std::move(*ctxOr);
    computeStream = static_cast<cudaStream_t>(ctx->stream());
    PIPEC_GPU_TRY(sendStream.create());
    PIPEC_GPU_TRY(recvStream.create());
    PIPEC_GPU_TRY(computeDone.create());
    PIPEC_GPU_TRY(recvDone.create());
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
    // One pinned slot per send and recv, one device buffer per recv, for the whole run.
    size_t pinnedTotal = 0, deviceTotal = 0;
    std::map<uint64_t, size_t> weightDone;
    slot.assign(stream.size(), 0);
    deviceSlot.assign(stream.size(), 0);
    for (size_t n = 0; n < stream.size(); ++n) {
      const Instruction &i = stream[n];
      if ((i.op == OpKind::BackwardWeight || i.op == OpKind::Backward) && i.isLastPart())
        weightDone[key(TensorKind::Gradient, i.stage, i.mb, i.slice)] = n;
      if (!i.isP2P())
        continue;
      slot[n] = pinnedTotal;
      pinnedTotal += tensorSize(i);
      if (i.op == OpKind::Recv) {
        deviceSlot[n] = deviceTotal;
        deviceTotal += tensorSize(i);
        recvAt[key(i.tensor, i.stage, i.mb, i.slice)] = n;
      }
      if (i.op == OpKind::Send && i.tensor == TensorKind::Gradient) {
        uint64_t k = key(i.tensor, i.stage, i.mb, i.slice);
        if (weightDone.count(k))
          sentLate.insert(k);
      }
    }
    if (!onDevice())
      PIPEC_GPU_TRY(pinned.allocate(pinnedTotal));
    PIPEC_GPU_TRY(recvDevice.allocate(deviceTotal));
    // The largest all-reduce: a stage's gradients (dp) or one tp part's (N, C) buffer.
    size_t reduceMax = 0;
    for (auto &[s, st] : stages)
      reduceMax = std::max(reduceMax, st->grads().size());
    size_t longest = 0;
    for (auto [b, e] : plan.seqSlices)
      longest = std::max(longest, size_t(e - b));
    reduceMax = std::max(reduceMax, size_t(cfg.microbatch) * longest * size_t(cfg.channels));
    return onDevice() ? llvm::Error::success() : reduceStaging.allocate(reduceMax);
  }

  llvm::Error beginStep(int step) override {
    PIPEC_CUDA_TRY(cudaSetDevice(options.device));
    PIPEC_GPU_TRY(takeDeferred());
    // The previous step's staging copies are done before their slots are reused.
    PIPEC_CUDA_TRY(cudaStreamSynchronize(recvStream.get()));
    PIPEC_CUDA_TRY(cudaStreamSynchronize(sendStream.get()));
    uploaded.clear();
    kept.clear();
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
    if (onDevice()) {
      // The device tensor itself; the transport orders its send after the compute stream.
      auto src = sendSource(i);
      if (!src) {
        defer(src.takeError(), {});
        return {};
      }
      return {const_cast<float *>(src->data()), src->size()};
    }
    std::span<float> host(pinned.data() + slot[indexOf(i)], tensorSize(i));
    if (llvm::Error err = stageSend(i, host))
      defer(std::move(err), host);
    return host;
  }

  std::span<float> recvData(const Instruction &i) override {
    if (onDevice())
      return {recvDevice.data() + deviceSlot[indexOf(i)], tensorSize(i)};
    return {pinned.data() + slot[indexOf(i)], tensorSize(i)};
  }

  std::span<float> reduceData(const Instruction &i) override {
    reduceTarget = deviceReduceSpan(i);
    if (onDevice())
      return reduceTarget; // summed in place on the device
    std::span<float> host(reduceStaging.data(), reduceTarget.size());
    assert(host.size() <= reduceStaging.size() && "all-reduce larger than its staging buffer");
    if (llvm::Error err = download(host, reduceTarget))
      defer(std::move(err), host);
    return host;
  }

  llvm::Error afterAllReduce(const Instruction &i) override {
    PIPEC_GPU_TRY(takeDeferred());
    if (!reduceTarget.empty() && !onDevice())
      PIPEC_CUDA_TRY(cudaMemcpyAsync(reduceTarget.data(), reduceStaging.data(),
                                     reduceTarget.size() * sizeof(float), cudaMemcpyHostToDevice,
                                     computeStream));
    if (i.collective == CollectiveGroup::Tp && i.phase == OpKind::Backward && i.part == i.parts - 1)
      return finishFusedBackward(i.stage, i.mb, i.slice);
    return llvm::Error::success();
  }

  void sumLocalEmbeddingCopies() override {
    GpuStage &first = *stages.at(0), &last = *stages.at(plan.numStages() - 1);
    auto [fb, fe] = first.tiedEmbeddingRange();
    auto [lb, le] = last.tiedEmbeddingRange();
    assert(fe - fb == le - lb && "tied copies differ in size");
    if (onDevice())
      if (llvm::Error err = waitForCollectives()) { // dp all-reduces of both stages may still run
        defer(std::move(err), {});
        return;
      }
    cudaError_t status = runtime::cuda::launch::sumPair(
        first.grads().data() + fb, last.grads().data() + lb, fe - fb, computeStream);
    if (status != cudaSuccess)
      deferred = cu::makeCudaError("launch::sumPair", status, __FILE__, __LINE__);
  }

  llvm::Error optimizerStep() override {
    PIPEC_GPU_TRY(takeDeferred());
    if (onDevice())
      PIPEC_GPU_TRY(waitForCollectives());
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

  size_t indexOf(const Instruction &i) const {
    assert(&i >= stream.data() && &i < stream.data() + stream.size() && "not this rank's op");
    return size_t(&i - stream.data());
  }

  size_t tensorSize(const Instruction &i) const {
    auto [b, e] = plan.seqSlices[size_t(i.slice)];
    return size_t(cfg.microbatch) * size_t(e - b) * size_t(cfg.channels);
  }

  void defer(llvm::Error err, std::span<float> host) {
    std::fill(host.begin(), host.end(), std::numeric_limits<float>::quiet_NaN());
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

  /// Device to pinned host through the send stream, after the compute stream's work.
  llvm::Error download(std::span<float> host, std::span<const float> device) {
    if (host.empty())
      return llvm::Error::success();
    PIPEC_CUDA_TRY(cudaEventRecord(computeDone.get(), computeStream));
    PIPEC_CUDA_TRY(cudaStreamWaitEvent(sendStream.get(), computeDone.get(), 0));
    PIPEC_CUDA_TRY(cudaMemcpyAsync(host.data(), device.data(), host.size() * sizeof(float),
                                   cudaMemcpyDeviceToHost, sendStream.get()));
    PIPEC_CUDA_TRY(cudaStreamSynchronize(sendStream.get()));
    return llvm::Error::success();
  }

  /// The device tensor a send carries.
  llvm::Expected<std::span<const float>> sendSource(const Instruction &i) {
    if (auto it = kept.find(key(i.tensor, i.stage, i.mb, i.slice)); it != kept.end())
      return std::span<const float>(it->second.span);
    GpuStage &st = *stages.at(i.stage);
    return i.tensor == TensorKind::Activation ? st.output(i.mb, i.slice)
                                              : st.inputGrad(i.mb, i.slice);
  }

  llvm::Error stageSend(const Instruction &i, std::span<float> host) {
    auto src = sendSource(i);
    if (!src)
      return src.takeError();
    assert(src->size() == host.size() && "sent tensor has the wrong size");
    return download(host, *src);
  }

  std::span<float> deviceReduceSpan(const Instruction &i) {
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

  llvm::Error finishFusedBackward(int stage, int mb, int slice) {
    PIPEC_GPU_TRY(keepInputGrad(stage, mb, slice, /*anyConsumer=*/true));
    return stages.at(stage)->backwardWeight(mb, slice);
  }

  /// As the cpu backend: keep the input gradient past the weight gradient when a consumer may
  /// still need it (a copy on the compute stream).
  llvm::Error keepInputGrad(int stage, int mb, int slice, bool anyConsumer = false) {
    if (stage == 0)
      return llvm::Error::success();
    bool sameRank = plan.rankOf(stage - 1) == c.pp;
    if (!anyConsumer && !sameRank && !sentLate.count(key(TensorKind::Gradient, stage, mb, slice)))
      return llvm::Error::success();
    auto g = stages.at(stage)->inputGrad(mb, slice);
    if (!g)
      return g.takeError();
    Kept &k = kept[key(TensorKind::Gradient, stage, mb, slice)];
    PIPEC_GPU_TRY(k.buffer.allocate(g->size()));
    k.span = {k.buffer.data(), g->size()};
    if (!g->empty())
      PIPEC_CUDA_TRY(cudaMemcpyAsync(k.buffer.data(), g->data(), g->size() * sizeof(float),
                                     cudaMemcpyDeviceToDevice, computeStream));
    return llvm::Error::success();
  }

  /// The input of a compute op from stage `producer`: kept, on this rank, or received (then
  /// copied to its device buffer on the recv stream; the compute stream waits for it).
  llvm::Expected<std::span<const float>> inputOf(TensorKind t, int producer, int mb, int slice) {
    uint64_t k = key(t, producer, mb, slice);
    if (auto it = kept.find(k); it != kept.end())
      return std::span<const float>(it->second.span);
    if (plan.rankOf(producer) == c.pp) {
      GpuStage &p = *stages.at(producer);
      return t == TensorKind::Activation ? p.output(mb, slice) : p.inputGrad(mb, slice);
    }
    auto it = recvAt.find(k);
    assert(it != recvAt.end() && "the verifier guarantees a recv before its consumer");
    size_t n = it->second;
    const Instruction &recv = stream[n];
    std::span<float> device(recvDevice.data() + deviceSlot[n], tensorSize(recv));
    // A device transport received it there, and ordered the compute stream after it.
    if (!onDevice() && uploaded.insert(n).second) {
      PIPEC_CUDA_TRY(cudaMemcpyAsync(device.data(), pinned.data() + slot[n],
                                     device.size() * sizeof(float), cudaMemcpyHostToDevice,
                                     recvStream.get()));
      PIPEC_CUDA_TRY(cudaEventRecord(recvDone.get(), recvStream.get()));
      PIPEC_CUDA_TRY(cudaStreamWaitEvent(computeStream, recvDone.get(), 0));
    }
    return std::span<const float>(device);
  }

  struct Kept {
    DeviceFloats buffer;
    std::span<float> span;
  };

  const Plan &plan;
  const GptConfig &cfg;
  Coord c;
  const DataSource &data;
  const CudaRunOptions &options;
  GradSnapshot *snapshot;
  const std::vector<Instruction> &stream;
  std::unique_ptr<cu::CudaContext> ctx;
  cudaStream_t computeStream = nullptr;
  Stream sendStream, recvStream;
  Event computeDone, recvDone;
  std::map<int, std::unique_ptr<GpuStage>> stages;
  std::vector<size_t> slot, deviceSlot; // per stream index: pinned / device offsets
  std::map<uint64_t, size_t> recvAt;    // received tensor -> its recv's stream index
  std::set<size_t> uploaded;            // recvs copied to the device this step
  PinnedFloats pinned, reduceStaging;
  DeviceFloats recvDevice;
  std::map<uint64_t, Kept> kept;
  std::set<uint64_t> sentLate;
  std::span<float> pendingReduce, reduceTarget;
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
  const ParallelConfig &pc = plan.parallel;
  GradSnapshot snapshot;
  std::vector<std::unique_ptr<Backend>> backends;
  std::vector<CudaBackend *> gpu;
  for (int t = 0; t < pc.pp * pc.dp * pc.tp; ++t) {
    Coord c{t / (pc.dp * pc.tp), t / pc.tp % pc.dp, t % pc.tp};
    auto b = std::make_unique<CudaBackend>(plan, cfg, c, data, options,
                                           options.checkReference ? &snapshot : nullptr);
    if (auto err = b->init())
      return err;
    gpu.push_back(b.get());
    backends.push_back(std::move(b));
  }
  Runner runner(plan, Faults{}, options.timeoutSeconds, std::move(backends));
  std::unique_ptr<ReferenceRun> ref;
  if (options.checkReference)
    ref = std::make_unique<ReferenceRun>(plan, cfg, data, options.seed, options.lr);
  CudaRunResult result;
  for (int s = 0; s < options.steps; ++s) {
    if (auto err = runner.step(s))
      return err;
    double loss = 0;
    for (CudaBackend *b : gpu) {
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
