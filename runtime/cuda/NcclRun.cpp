//===- NcclRun.cpp - The nccl mode: one rank of the plan per process ------===//
#include "runtime/cuda/NcclRun.h"

#include "ir/support/Error.h"
#include "kernels/cuda/CudaCheck.h"
#include "kernels/cuda/CudaOps.h"
#include "runtime/BlockingWatchdog.h"
#include "runtime/Profile.h"
#include "runtime/cuda/DeviceArena.h"
#include "runtime/cuda/DeviceHandles.h"
#include "runtime/cuda/Nccl.h"
#include "runtime/cuda/NcclTransport.h"

#include <cuda_runtime_api.h>

#include <csignal>
#include <cstdlib>
#include <cstring>
#include <map>

namespace pipec {

namespace {

/// GPU LOCAL_RANK (the launcher's variable for it); with a single visible GPU
/// (CUDA_VISIBLE_DEVICES set per process, as srun --gpus-per-task=1 does), that one.
llvm::Expected<int> deviceOf(const LaunchEnv &env) {
  auto n = cudaDevices();
  if (!n)
    return n.takeError();
  if (env.localRank < *n)
    return env.localRank;
  if (*n == 1)
    return 0;
  return inputError("--backend nccl: {}={} but this process sees {} GPUs; launch at most {} "
                    "processes per node ({})",
                    env.launcher->localRankVar, env.localRank, *n, *n, env.launcher->perNode(*n));
}

/// Waits for everything queued on `stream`, polling: an asynchronous NCCL error or `timeout`
/// seconds without completion aborts the communicators (pollDevice) and is an
/// error naming `what`.
llvm::Error waitPolling(cudaStream_t stream, NcclCommunicators &comms, double timeout,
                        const std::string &what) {
  return pollDevice([stream] { return cudaStreamQuery(stream); }, comms, timeout,
                    [&what](double idle) {
                      return fmt::format("watchdog: {} made no progress for {:.1f} s", what, idle);
                    });
}

/// Every process adds `value` (a float slot of device scratch) over `world` and gets the sum.
/// The host call that posts it is guarded for `postLimit` seconds (BlockingWatchdog): it blocks
/// where NCCL connects `world` at run time, until every peer posts too.
llvm::Expected<float> worldSum(float value, float *slot, NcclCommunicators &comms,
                               cudaStream_t stream, double timeout, const std::string &what,
                               double postLimit = BlockingWatchdog::kNoLimit) {
  PIPEC_CUDA_TRY(cudaMemcpyAsync(slot, &value, sizeof value, cudaMemcpyHostToDevice, stream));
  {
    BlockingWatchdog watchdog(what, postLimit);
    PIPEC_NCCL_TRY(ncclAllReduce(slot, slot, 1, ncclFloat, ncclSum, comms.world.get(), stream));
  }
  // Polled before the copy back, which into pageable memory returns only when done: a peer
  // that never comes must meet the watchdog, not block the host in the copy.
  if (auto err = waitPolling(stream, comms, timeout, what))
    return err;
  PIPEC_CUDA_TRY(cudaMemcpyAsync(&value, slot, sizeof value, cudaMemcpyDeviceToHost, stream));
  PIPEC_CUDA_TRY(cudaStreamSynchronize(stream));
  return value;
}

/// With --check-reference on several processes, after each step (the gradients) and after the
/// last (the weights; `what` says which): every other process's blocks of dp replica 0 travel to
/// RANK 0 over `world` (gatherGroups: one NCCL group per sender, mirrored on RANK 0), through
/// `staging` (device memory for the largest sender's blocks), into `snapshot`, which then holds
/// all of replica 0's blocks on RANK 0. The processes first agree that every sender's blocks
/// have the expected sizes and that no process had `localProblem` (non-empty: this process
/// could not fill its part of `snapshot`), so that either all of them take part or all of them
/// fail (a sender that returned early would leave RANK 0 waiting forever).
llvm::Error gatherSnapshot(const std::vector<GradientShard> &shards, const LaunchEnv &env,
                           NcclCommunicators &comms, cudaStream_t stream, float *staging,
                           float *agreeSlot, double timeout, ParamSnapshot &snapshot,
                           const char *what, const std::string &localProblem = "") {
  auto groups = gatherGroups(shards, env.rank);
  std::string problem = localProblem;
  for (const auto &group : groups)
    for (const GatherOp &op : group)
      if (op.send) {
        auto it = snapshot.byStageAndTp.find({op.shard.stage, op.shard.tp});
        size_t have = it == snapshot.byStageAndTp.end() ? 0 : it->second.size();
        if (have != op.shard.floats && problem.empty())
          problem = fmt::format("--check-reference: rank {} holds {} {} of stage {} tp {}, the "
                                "gather expects {}",
                                env.rank, have, what, op.shard.stage, op.shard.tp, op.shard.floats);
      }
  auto failures = worldSum(problem.empty() ? 0.0f : 1.0f, agreeSlot, comms, stream, timeout,
                           fmt::format("the {} gather's agreement", what));
  if (!failures)
    return failures.takeError();
  if (!problem.empty())
    return llvm::createStringError(llvm::inconvertibleErrorCode(), problem);
  if (*failures > 0)
    return llvm::createStringError(
        llvm::inconvertibleErrorCode(),
        fmt::format("--check-reference: {} process(es) could not hand over their {} (they say "
                    "why)",
                    int(*failures), what));
  for (const auto &group : groups) {
    std::vector<size_t> offsets;
    size_t total = 0;
    for (const GatherOp &op : group) {
      offsets.push_back(total);
      total += op.shard.floats;
    }
    for (size_t k = 0; k < group.size(); ++k)
      if (group[k].send) {
        const std::vector<float> &g =
            snapshot.byStageAndTp.at({group[k].shard.stage, group[k].shard.tp});
        PIPEC_CUDA_TRY(cudaMemcpyAsync(staging + offsets[k], g.data(), g.size() * sizeof(float),
                                       cudaMemcpyHostToDevice, stream));
      }
    // The group is always closed, also after a failed post.
    llvm::Error first = llvm::Error::success();
    auto keep = [&](ncclResult_t r, const std::string &call) {
      if (r != ncclSuccess && !first)
        first = makeNcclError(call.c_str(), r, __FILE__, __LINE__);
    };
    // (The first such group with a peer connects to it on `world`, blocking the host until the
    // peer posts its own, which RANK 0 does sender after sender: guarded, with the arrival
    // limit, runtime/BlockingWatchdog.h.)
    {
      BlockingWatchdog watchdog(fmt::format("rank {}'s post of its {} gather", env.rank, what),
                                peerArrivalLimit(timeout));
      keep(ncclGroupStart(), "ncclGroupStart()");
      for (size_t k = 0; k < group.size(); ++k) {
        const GatherOp &op = group[k];
        if (op.send)
          keep(ncclSend(staging + offsets[k], op.shard.floats, ncclFloat, op.peer,
                        comms.world.get(), stream),
               fmt::format("ncclSend({} to RANK 0)", what));
        else
          keep(ncclRecv(staging + offsets[k], op.shard.floats, ncclFloat, op.peer,
                        comms.world.get(), stream),
               fmt::format("ncclRecv({} from a sender)", what));
      }
      keep(ncclGroupEnd(), "ncclGroupEnd()");
    }
    if (first) {
      comms.abortAll();
      return first;
    }
    // The group is polled before the copies out: a copy into pageable memory returns only when
    // done, so it would wait for a sender that never comes without the watchdog.
    if (auto err = waitPolling(stream, comms, timeout,
                               fmt::format("rank {}'s gather of the {}", env.rank, what)))
      return err;
    for (size_t k = 0; k < group.size(); ++k)
      if (!group[k].send) {
        std::vector<float> &g = snapshot.byStageAndTp[{group[k].shard.stage, group[k].shard.tp}];
        g.resize(group[k].shard.floats);
        PIPEC_CUDA_TRY(cudaMemcpyAsync(g.data(), staging + offsets[k], g.size() * sizeof(float),
                                       cudaMemcpyDeviceToHost, stream));
      }
    PIPEC_CUDA_TRY(cudaStreamSynchronize(stream));
  }
  return llvm::Error::success();
}

/// --check-reference with several processes, before step 0: the gather's connections on
/// `world`, RANK 0's with every sender, made as the warm-up makes the pipeline's
/// (NcclTransport::warmUp): gatherGroups' groups in their order, one float each way through
/// `scratch`. Else each connection would be made by step 0's gather, which would then allocate
/// NCCL's buffers after the arena was sized and block the host until the peer posts.
llvm::Error connectGather(const std::vector<GradientShard> &shards, const LaunchEnv &env,
                          NcclCommunicators &comms, cudaStream_t stream, float *scratch,
                          double timeout) {
  for (const auto &group : gatherGroups(shards, env.rank)) {
    // (Every op of a group has the same peer: a sender's group goes to RANK 0, RANK 0's comes
    // from one sender.)
    const GatherOp &op = group.front();
    ncclResult_t posted = ncclSuccess, ended = ncclSuccess;
    {
      // The post blocks the host until the peer posts its side (RANK 0 takes the senders one
      // after another): guarded with the arrival limit, as the warm-up's.
      BlockingWatchdog watchdog(
          fmt::format("rank {}'s connection for the --check-reference gather", env.rank),
          peerArrivalLimit(timeout));
      if (ncclResult_t r = ncclGroupStart(); r != ncclSuccess)
        return makeNcclError("ncclGroupStart()", r, __FILE__, __LINE__);
      posted = op.send ? ncclSend(scratch, 1, ncclFloat, op.peer, comms.world.get(), stream)
                       : ncclRecv(scratch, 1, ncclFloat, op.peer, comms.world.get(), stream);
      ended = ncclGroupEnd(); // (closed also after a failed post)
    }
    if (posted != ncclSuccess)
      return makeNcclError(op.send ? "ncclSend (the gather's connection to RANK 0)"
                                   : "ncclRecv (the gather's connection from a sender)",
                           posted, __FILE__, __LINE__);
    if (ended != ncclSuccess)
      return makeNcclError("ncclGroupEnd() (the gather's connection)", ended, __FILE__, __LINE__);
    if (auto err = waitPolling(stream, comms, timeout,
                               fmt::format("rank {}'s connection for the gather", env.rank)))
      return err;
  }
  return llvm::Error::success();
}

/// --check-reference with dp > 1, after the weights' gather: every process's weight digests
/// (ParamSnapshot::digests: its own (replica, stage, tp rank) entries) go into one slot each of
/// a vector summed over `world` in `device` (dp * stages * tp of them, allocated before the
/// steps), so that RANK 0 ends with every replica's digests in `weights`.
llvm::Error shareDigests(const Plan &plan, NcclCommunicators &comms, cudaStream_t stream,
                         uint64_t *device, double timeout, ParamSnapshot &weights) {
  std::map<int, size_t> stageIndex;
  for (const StageInfo &st : plan.stages)
    stageIndex.emplace(st.stage, stageIndex.size());
  const size_t tp = size_t(plan.parallel.tp);
  auto slot = [&](int d, int stage, int t) {
    return (size_t(d) * stageIndex.size() + stageIndex.at(stage)) * tp + size_t(t);
  };
  std::vector<uint64_t> slots(size_t(plan.parallel.dp) * stageIndex.size() * tp, 0);
  for (const auto &[key, digest] : weights.digests)
    slots[slot(std::get<0>(key), std::get<1>(key), std::get<2>(key))] = digest;
  const size_t bytes = slots.size() * sizeof(uint64_t);
  PIPEC_CUDA_TRY(cudaMemcpyAsync(device, slots.data(), bytes, cudaMemcpyHostToDevice, stream));
  PIPEC_NCCL_TRY(
      ncclAllReduce(device, device, slots.size(), ncclUint64, ncclSum, comms.world.get(), stream));
  // (Polled before the copy back: a copy into pageable memory returns only when it is done, so
  // it would wait for a peer that never comes without the watchdog.)
  if (auto err = waitPolling(stream, comms, timeout, "the exchange of the weights' digests"))
    return err;
  PIPEC_CUDA_TRY(cudaMemcpyAsync(slots.data(), device, bytes, cudaMemcpyDeviceToHost, stream));
  PIPEC_CUDA_TRY(cudaStreamSynchronize(stream));
  for (int d = 0; d < plan.parallel.dp; ++d)
    for (const StageInfo &st : plan.stages)
      for (int t = 0; t < plan.parallel.tp; ++t)
        if (uint64_t digest = slots[slot(d, st.stage, t)]; digest != 0)
          weights.digests[{d, st.stage, t}] = digest;
  return llvm::Error::success();
}

} // namespace

std::string prepareNcclEnvironment(const std::function<const char *(const char *)> &getenv,
                                   const std::function<void(const char *, const char *)> &setenv) {
  const char *set = getenv("NCCL_RUNTIME_CONNECT");
  std::string setting;
  if (set) {
    setting = fmt::format("NCCL_RUNTIME_CONNECT={} (from the environment{})", set,
                          std::strcmp(set, "0") == 0
                              ? ""
                              : ": NCCL may connect inside step 0, after the arena was sized");
  } else {
    setenv("NCCL_RUNTIME_CONNECT", "0");
    setting = "NCCL_RUNTIME_CONNECT=0 (connections made as the communicators are created)";
  }
  std::string loading;
  if (const char *mode = getenv("CUDA_MODULE_LOADING")) {
    loading = fmt::format("CUDA_MODULE_LOADING={} (from the environment{})", mode,
                          std::strcmp(mode, "EAGER") == 0
                              ? ""
                              : ": a kernel's first launch in step 0 may wait for NCCL kernels "
                                "that wait for a peer stuck the same way");
  } else {
    setenv("CUDA_MODULE_LOADING", "EAGER");
    loading = "CUDA_MODULE_LOADING=EAGER (every kernel loaded before the first step)";
  }
  int code = 0;
  std::string loaded = "of unknown version";
  if (ncclGetVersion(&code) == ncclSuccess) // 2.9 on: major * 10000 + minor * 100 + patch
    loaded = fmt::format("version {}.{}.{}", code / 10000, code % 10000 / 100, code % 100);
  return fmt::format("NCCL {} (built against {}.{}.{}); {}; {}", loaded, NCCL_MAJOR, NCCL_MINOR,
                     NCCL_PATCH, setting, loading);
}

namespace {

/// The nccl mode as the training driver sees it: this process's one rank (NcclRun.h).
class NcclTrainBackend final : public GpuTrainBackend {
public:
  NcclTrainBackend(const Plan &plan, const kernels::GptConfig &cfg, const DataSource &data,
                   const CudaRunOptions &options, const LaunchEnv &env)
      : plan(plan), cfg(cfg), data(data), o(options), env(env) {}

  // A failure aborts this process's communicators, at the latest as the backend goes:
  // destroying a communicator finalizes it, which waits for its queued work, and a peer that
  // failed may never complete that. (Where work may be queued, the abort comes before the
  // return, since the buffers' cudaFree waits for the device too.) NCCL tells no peer of an
  // abort: the peers fail through their own watchdogs, or sooner over sockets when this process
  // exits. Where every process stops together after an agreement, with nothing queued
  // (stopTogether), the communicators are finalized instead: that flushes this process's last
  // sends, the agreement's, which an abort could drop before a peer has them.
  ~NcclTrainBackend() override {
    if (comms && !completed)
      comms->abortAll();
  }

  llvm::Error setUp() override;
  llvm::Expected<double> step(int s) override;
  llvm::Error takeGradients(ParamSnapshot &into) override;
  llvm::Error referenceStepDone() override;
  llvm::Error snapshotWeights(ParamSnapshot &into) override;
  bool holdsLayer(int layer) const override { return backend->holdsLayer(layer); }
  llvm::Error scatterLayer(int layer, const LayerState &whole) override {
    return backend->writeLayer(layer, whole);
  }
  llvm::Error gatherLayer(int layer, LayerState &whole) override;
  int adamSteps() const override { return backend->adamSteps(); }
  void setAdamSteps(int steps) override { backend->setAdamSteps(steps); }
  bool leads() const override { return env.rank == 0; }
  llvm::Expected<int> agreeOnStop(int signal) override;
  void finish() override { completed = true; }
  llvm::Error measuredCosts(MeasuredCosts &into) override;

  /// The memory figures of this process's rank (arenaUsedBytes after the run).
  CudaRunResult memory() const override {
    CudaRunResult m;
    if (backend) {
      m.stateBytes.push_back(backend->stateBytes());
      m.arenaBytes.push_back(backend->arenaBytes());
      m.arenaUsedBytes.push_back(backend->arenaUsedBytes());
      m.arenaLiveBytes.push_back(backend->arenaLiveBytes());
    }
    return m;
  }

private:
  llvm::Error stopTogether(llvm::Error err) {
    completed = true;
    return err;
  }
  llvm::Error stopUnlessAllCould(llvm::Error mine, llvm::Expected<float> failed, const char *what);
  /// How many processes have a per-process launch setting or outcome (a worldSum of 0 or 1
  /// each), waiting `timeout` seconds at most.
  llvm::Expected<float> processesWith(bool mine, const char *what, double timeout) {
    return worldSum(mine ? 1.0f : 0.0f, agreeSlot(), *comms, compute, timeout, what);
  }
  bool some(float n) const { return n != 0.0f && n != float(env.worldSize); }
  llvm::Error agreeOnSettings();
  llvm::Error reserveMemory();
  llvm::Error moveLayerPart(int peer, bool send, size_t floats, int layer);
  float *agreeSlot() { return scratch.as<float>() + 4; } // (after the loss's double)
  bool saving() const { return !o.saveDir.empty() && env.worldSize > 1; }

  const Plan &plan;
  const kernels::GptConfig &cfg;
  const DataSource &data;
  CudaRunOptions o; // with the device of env.localRank
  const LaunchEnv &env;
  bool completed = false;
  std::unique_ptr<NcclCommunicators> comms;
  // The warm-up's 5 floats, then, one after another: the agreements' and the waits for RANK
  // 0's reference (float 4), the gather's connection (float 0) and the loss (a double, floats
  // 0-1).
  kernels::cuda::DeviceBuffer scratch;
  runtime_cuda::OwnedStream setUpStream;
  std::unique_ptr<NcclTransport> transport;
  ParamSnapshot snapshot;
  std::unique_ptr<CudaRankBackend> backend;
  cudaStream_t compute = nullptr;
  // --check-reference with several processes: what the others send RANK 0 after each step.
  std::vector<GradientShard> shards;
  std::unique_ptr<RunShared> shared;
  // The gather's staging (the largest sender's blocks of replica 0), with dp > 1 the digests'
  // slots, and with checkpoints on several processes the staging of one layer's tp part.
  kernels::cuda::DeviceBuffer staging, digestSlots, layerStaging;
  bool referenceBuilt = false;
};

llvm::Error NcclTrainBackend::stopUnlessAllCould(llvm::Error mine, llvm::Expected<float> failed,
                                                 const char *what) {
  // After an agreement on how many processes failed a part of the launch (`failed`, this one's
  // `mine` counted in): success where none did; else this process's own error, or that some
  // could not `what`, with every process stopping together. Where the agreement's wait failed
  // (it aborted): this process's own error, which says more, or the wait's.
  if (mine) {
    if (failed)
      return stopTogether(std::move(mine));
    llvm::consumeError(failed.takeError());
    return mine;
  }
  if (!failed)
    return failed.takeError();
  if (*failed > 0)
    return stopTogether(llvm::createStringError(
        llvm::inconvertibleErrorCode(),
        fmt::format("rank {}: {} of the launch's {} processes could not {}, so this one stops "
                    "too",
                    env.rank, int(*failed), env.worldSize, what)));
  return llvm::Error::success();
}

llvm::Error NcclTrainBackend::setUp() {
  PIPEC_TRY(gpuRunsTheBlock(cfg, plan, "nccl"));
  auto device = deviceOf(env);
  if (!device)
    return device.takeError();
  o.device = *device;
  PIPEC_CUDA_TRY(cudaSetDevice(o.device));
  // Eagerly, in the same order on every process (NcclLayout.h); a process that never joins
  // ends this one after ten timeouts (at least 10 minutes: the launcher may start the others
  // slowly).
  auto made = createCommunicators(plan, env, peerArrivalLimit(o.timeoutSeconds));
  if (!made)
    return made.takeError();
  comms = std::move(*made);
  // (Allocated first, with the set-up agreement's stream, so that a process whose set-up fails
  // can still take part in that agreement. If these fail, the GPU is unusable, and the peers
  // wait for this process under their arrival limit.)
  auto floats = kernels::cuda::DeviceBuffer::allocate(4 * sizeof(double));
  if (!floats)
    return floats.takeError();
  scratch = std::move(*floats);
  PIPEC_TRY(setUpStream.create());
  // The process's GPU set-up: its compute stream, cuBLASLt handle and workspace, and the
  // transport's streams and events. It fails on one process alone where that process's GPU is
  // (nearly) full or faulty, so every process then learns whether all of them could, at once,
  // rather than wait for that one in the warm-up until its arrival limit.
  transport = std::make_unique<NcclTransport>(plan, env, *comms);
  llvm::Error setUp = [&]() -> llvm::Error {
    auto rank = createDeviceTransportBackend(plan, cfg, env.coord, data, o,
                                             o.checkReference ? &snapshot : nullptr,
                                             [this] { return transport->waitForCollectives(); });
    if (!rank)
      return rank.takeError();
    backend = std::move(*rank);
    CudaRankBackend *b = backend.get();
    // Sends alone do not hold the compute stream; the arena waits for them at a release.
    NcclTransport::SendHold hold{[b](const void *data, size_t bytes, cudaEvent_t done) {
                                   b->readElsewhere(data, bytes, done);
                                 },
                                 [b] { b->elsewhereReadsDone(); }};
    return transport->init(
        static_cast<cudaStream_t>(b->computeStreamHandle()), [b] { return b->takeDeferredError(); },
        std::move(hold));
  }();
  if (setUp)
    (void)cudaGetLastError(); // (so that no later launch check reports the set-up's failure)
  // The first collective on `world`, which the others may reach late (their set-up takes a
  // while): under the arrival limit, and its post guarded as the warm-up's are, should
  // connecting block the host call (NCCL_RUNTIME_CONNECT=1).
  const double arrivalLimit = peerArrivalLimit(o.timeoutSeconds);
  auto setUpFailures =
      worldSum(setUp ? 1.0f : 0.0f, agreeSlot(), *comms, setUpStream.get(), arrivalLimit,
               fmt::format("rank {}'s set-up agreement", env.rank), arrivalLimit);
  PIPEC_TRY(stopUnlessAllCould(std::move(setUp), std::move(setUpFailures),
                               "set up their GPU (each says why)"));
  compute = static_cast<cudaStream_t>(backend->computeStreamHandle());
  PIPEC_TRY(transport->warmUp(scratch.as<float>(), o.timeoutSeconds, arrivalLimit));
  PIPEC_TRY(agreeOnSettings());
  // RANK 0's connections with every other process of dp replica 0 on `world`, for
  // --check-reference's gathers and the checkpoints' (the same processes), made now, before the
  // arena is sized: NCCL allocates a connection's buffers as it makes it (connectGather).
  if ((o.checkReference || !o.saveDir.empty()) && env.worldSize > 1) {
    auto blocks = gradientShards(
        plan, [this](int l) { return kernels::layerParamCount(cfg, l, plan.parallel.tp); });
    if (auto err =
            connectGather(blocks, env, *comms, compute, scratch.as<float>(), o.timeoutSeconds)) {
      comms->abortAll(); // (before the scratch's cudaFree, which would wait for the posts)
      return err;
    }
    if (o.checkReference)
      shards = std::move(blocks);
  }
  shared = std::make_unique<RunShared>(plan, Faults{}, *transport);
  if (o.profile)
    shared->enableTiming();
  // Every process learns whether all of them could reserve their memory: one that could not
  // says why, and the others say that it could not, at once, rather than wait for it in step 0
  // until their watchdog ends them. (Rank 0 of 1f1b keeps the most microbatches, so it is often
  // alone.) Under the arrival limit: a process with a larger stage initialises its weights for
  // longer. (So a process that dies before it gets here holds its peers that long too, as in
  // the warm-up.)
  llvm::Error reserved = reserveMemory();
  auto memoryFailures =
      processesWith(static_cast<bool>(reserved), "the device memory's agreement", arrivalLimit);
  PIPEC_TRY(stopUnlessAllCould(std::move(reserved), std::move(memoryFailures),
                               "reserve the device memory the plan needs before step 0 (each "
                               "says why, with the fix)"));
  if (o.onArenas) {
    CudaRunResult sofar;
    sofar.stateBytes.push_back(backend->stateBytes());
    sofar.arenaBytes.push_back(backend->arenaBytes());
    o.onArenas(sofar);
  }
  return llvm::Error::success();
}

/// Every process must compute in the same type, check the reference or not, and save
/// checkpoints or not: the launch line is per process, so this is checked on every process.
llvm::Error NcclTrainBackend::agreeOnSettings() {
  // A p2p tensor's bytes and its NCCL datatype must match its peer's.
  auto bf16 = processesWith(o.dtype == kernels::DType::BF16, "the compute-type agreement",
                            o.timeoutSeconds);
  if (!bf16)
    return bf16.takeError();
  if (some(*bf16))
    return stopTogether(
        inputError("--dtype: {} of the launch's {} processes compute in bf16, the others in "
                   "fp32; pass the same --dtype to every process",
                   int(*bf16), env.worldSize));
  // --check-reference adds collectives on `world` after every step: all processes or none.
  auto checking =
      processesWith(o.checkReference, "the --check-reference agreement", o.timeoutSeconds);
  if (!checking)
    return checking.takeError();
  if (some(*checking))
    return stopTogether(
        inputError("--check-reference: {} of the launch's {} processes check against the "
                   "reference, the others do not; pass it to every process or to none",
                   int(*checking), env.worldSize));
  // A checkpoint gathers every layer to RANK 0: all processes or none.
  auto saving = processesWith(!o.saveDir.empty(), "the --save-dir agreement", o.timeoutSeconds);
  if (!saving)
    return saving.takeError();
  if (some(*saving))
    return stopTogether(
        inputError("--save-dir: {} of the launch's {} processes save checkpoints, the others do "
                   "not; pass the same --save-dir and --save-every to every process",
                   int(*saving), env.worldSize));
  return llvm::Error::success();
}

/// The device memory this process needs before step 0, all of it allocated now, after NCCL's
/// connections: the stages' weights, gradients and optimizer state (initialised on the host,
/// which can take a while for a large stage), the sizing pass's activation arena (every process
/// alone: no NCCL call; CudaRun.h), with --check-reference on several processes the gather's
/// staging (the largest sender's blocks of replica 0's gradients) and, with dp > 1, the digests'
/// slots (shareDigests: one per (replica, stage, tp rank)), and with checkpoints on several
/// processes the staging of the largest layer's tp part.
llvm::Error NcclTrainBackend::reserveMemory() {
  CudaRankBackend &b = *backend;
  PIPEC_TRY(b.createStages("compile the plan with more pipeline stages (pipec compile "
                           "--pp) or tensor-parallel ranks (--tp), or use a GPU with more "
                           "memory"));
  if (auto bytes = b.measureArena(); !bytes)
    return bytes.takeError();
  PIPEC_TRY(b.reserveArena());
  auto allocate = [](kernels::cuda::DeviceBuffer &into, size_t bytes) -> llvm::Error {
    auto buffer = kernels::cuda::DeviceBuffer::allocate(bytes);
    if (!buffer)
      return buffer.takeError();
    into = std::move(*buffer);
    return llvm::Error::success();
  };
  if (saving()) {
    size_t largest = 0;
    for (int l = 0; l < cfg.numLayers(); ++l)
      largest = std::max(largest, kernels::layerParamCount(cfg, l, plan.parallel.tp));
    PIPEC_TRY(allocate(layerStaging, 3 * largest * sizeof(float)));
  }
  if (!o.checkReference || env.worldSize == 1)
    return llvm::Error::success();
  std::map<int, size_t> perRank;
  size_t largest = 0;
  for (const GradientShard &g : shards)
    largest = std::max(largest, perRank[g.rank] += g.floats);
  if (largest > 0)
    PIPEC_TRY(allocate(staging, largest * sizeof(float)));
  if (plan.parallel.dp > 1)
    PIPEC_TRY(allocate(digestSlots, size_t(plan.parallel.dp) * plan.stages.size() *
                                        size_t(plan.parallel.tp) * sizeof(uint64_t)));
  return llvm::Error::success();
}

llvm::Expected<double> NcclTrainBackend::step(int s) {
  CudaRankBackend &b = *backend;
  transport->beginStep();
  llvm::Error err = b.beginStep(s);
  if (!err)
    err = interpretStep(*shared, env.coord, b);
  if (!err)
    err = transport->waitStep(s, o.timeoutSeconds, [&b] { return b.completedWork(); });
  if (err) {
    comms->abortAll(); // before the buffers' cudaFree, which would wait for its kernels
    return err;
  }
  auto share = b.finishStep();
  if (!share) {
    comms->abortAll(); // (the peers wait for this process in the loss's all-reduce)
    return share.takeError();
  }
  // The global loss: every process's share summed over `world` (polled before the copy back,
  // which into pageable memory would block past the watchdog if a peer never came).
  double loss = *share;
  auto *dloss = scratch.as<double>();
  PIPEC_CUDA_TRY(cudaMemcpyAsync(dloss, &loss, sizeof loss, cudaMemcpyHostToDevice, compute));
  PIPEC_NCCL_TRY(ncclAllReduce(dloss, dloss, 1, ncclDouble, ncclSum, comms->world.get(), compute));
  PIPEC_TRY(
      waitPolling(compute, *comms, o.timeoutSeconds, fmt::format("step {}'s loss all-reduce", s)));
  PIPEC_CUDA_TRY(cudaMemcpyAsync(&loss, dloss, sizeof loss, cudaMemcpyDeviceToHost, compute));
  PIPEC_CUDA_TRY(cudaStreamSynchronize(compute));
  return loss;
}

llvm::Expected<int> NcclTrainBackend::agreeOnStop(int signal) {
  // The launcher may signal some processes only, or all at different instants: one that
  // stopped alone would leave its peers waiting in the next step. (A second sum, on the step
  // they stop at only, says which signal: SIGTERM where any process got it, else SIGUSR1.)
  if (env.worldSize == 1)
    return signal;
  const char *what = "the agreement on stopping after a signal";
  auto stopping = processesWith(signal != 0, what, o.timeoutSeconds);
  if (!stopping || *stopping == 0)
    return stopping ? llvm::Expected<int>(0) : stopping.takeError();
  auto term = processesWith(signal == SIGTERM, what, o.timeoutSeconds);
  if (!term)
    return term.takeError();
  return *term > 0 ? SIGTERM : SIGUSR1;
}

llvm::Error NcclTrainBackend::takeGradients(ParamSnapshot &into) {
  if (!shards.empty())
    if (auto err = gatherSnapshot(shards, env, *comms, compute, staging.as<float>(), agreeSlot(),
                                  o.timeoutSeconds, snapshot, "gradients")) {
      comms->abortAll();
      return err;
    }
  snapshot.handOver(into);
  return llvm::Error::success();
}

llvm::Error NcclTrainBackend::measuredCosts(MeasuredCosts &into) {
  // Each pipeline rank's dp replica 0, tp rank 0 process fills its slots of the table; the
  // tables are summed over the world (every slot is one process's) for RANK 0.
  ProfileTable table(plan);
  if (env.coord.dp == 0 && env.coord.tp == 0)
    table.addRank(env.coord.pp, shared->timings[size_t(shared->threadOf(env.coord))],
                  int64_t(backend->stateBytes() + backend->arenaUsedBytes()));
  std::vector<double> &v = table.values();
  if (env.worldSize > 1) {
    auto buffer = kernels::cuda::DeviceBuffer::allocate(v.size() * sizeof(double));
    if (!buffer)
      return buffer.takeError();
    double *d = buffer->as<double>();
    const size_t bytes = v.size() * sizeof(double);
    PIPEC_CUDA_TRY(cudaMemcpyAsync(d, v.data(), bytes, cudaMemcpyHostToDevice, compute));
    PIPEC_NCCL_TRY(ncclAllReduce(d, d, v.size(), ncclDouble, ncclSum, comms->world.get(), compute));
    PIPEC_TRY(waitPolling(compute, *comms, o.timeoutSeconds, "--profile's gather of the costs"));
    PIPEC_CUDA_TRY(cudaMemcpyAsync(v.data(), d, bytes, cudaMemcpyDeviceToHost, compute));
    PIPEC_CUDA_TRY(cudaStreamSynchronize(compute));
  }
  into = table.costs();
  into.backend = "nccl";
  into.dtype = o.dtype == kernels::DType::BF16 ? "bf16" : "fp32";
  into.device = fmt::format("cuda device {} of each process", o.device);
  into.threads = env.worldSize;
  return llvm::Error::success();
}

llvm::Error NcclTrainBackend::referenceStepDone() {
  // The others wait here while RANK 0 builds the CPU reference (before step 0) or runs its step,
  // not inside the next step, where their watchdog would count its time. (Every process
  // checks, or none: agreed in setUp().) Not before the communicators: RANK 0's
  // ncclCommInitRank starts the bootstrap root, which NCCL gives the others only about a minute
  // to reach.
  const char *what =
      referenceBuilt ? "the wait for RANK 0's reference step" : "the wait for RANK 0's reference";
  referenceBuilt = true;
  if (env.worldSize == 1)
    return llvm::Error::success();
  auto r = worldSum(0.0f, agreeSlot(), *comms, compute, peerArrivalLimit(o.timeoutSeconds), what);
  return r ? llvm::Error::success() : r.takeError();
}

llvm::Error NcclTrainBackend::snapshotWeights(ParamSnapshot &weights) {
  // The weights after the last step, gathered to RANK 0 like the gradients, and with dp > 1
  // every replica's digests (ParamSnapshot::digests). A process that cannot read its weights
  // still takes part in the gather's agreement, so that every process fails at once. (One whose
  // CUDA context is broken cannot: the others' watchdog then names the wait.)
  llvm::Error copied = backend->snapshotWeights(weights);
  if (!shards.empty()) {
    const std::string problem =
        copied ? fmt::format("--check-reference: rank {} could not read its weights", env.rank)
               : "";
    llvm::Error gathered =
        gatherSnapshot(shards, env, *comms, compute, staging.as<float>(), agreeSlot(),
                       o.timeoutSeconds, weights, "weights", problem);
    if (gathered) {
      comms->abortAll();
      if (copied) { // (its own error says more than the agreement's)
        llvm::consumeError(std::move(gathered));
        return copied;
      }
      return gathered;
    }
  }
  // Every process exchanges its digests, one that could not read its weights too (its slots
  // stay 0: "reported none"), so that nobody waits for it alone. (With pp = tp = 1 there was
  // no gather, and so no agreement, before this.)
  if (env.worldSize > 1 && plan.parallel.dp > 1) {
    if (copied)
      weights.digests.clear();
    if (auto err = shareDigests(plan, *comms, compute, digestSlots.as<uint64_t>(), o.timeoutSeconds,
                                weights)) {
      comms->abortAll();
      if (copied) {
        llvm::consumeError(std::move(err));
        return copied;
      }
      return err;
    }
  }
  return copied;
}

/// One tp part of layer `layer` (`floats` of each of its three arrays, through layerStaging)
/// from process `peer` to RANK 0 (`send`: this process is that peer) on `world`.
llvm::Error NcclTrainBackend::moveLayerPart(int peer, bool send, size_t floats, int layer) {
  float *at = layerStaging.as<float>();
  ncclResult_t started = ncclSuccess, posted = ncclSuccess, ended = ncclSuccess;
  {
    BlockingWatchdog watchdog(
        fmt::format("rank {}'s post of layer {} for a checkpoint", env.rank, layer),
        peerArrivalLimit(o.timeoutSeconds));
    started = ncclGroupStart();
    if (started == ncclSuccess) {
      posted = send ? ncclSend(at, 3 * floats, ncclFloat, 0, comms->world.get(), compute)
                    : ncclRecv(at, 3 * floats, ncclFloat, peer, comms->world.get(), compute);
      ended = ncclGroupEnd(); // (closed also after a failed post)
    }
  }
  for (ncclResult_t r : {started, posted, ended})
    if (r != ncclSuccess) {
      comms->abortAll();
      return makeNcclError(send ? "ncclSend (a layer to RANK 0 for a checkpoint)"
                                : "ncclRecv (a layer for a checkpoint)",
                           r, __FILE__, __LINE__);
    }
  return waitPolling(compute, *comms, o.timeoutSeconds,
                     fmt::format("rank {}'s move of layer {} for a checkpoint", env.rank, layer));
}

llvm::Error NcclTrainBackend::gatherLayer(int layer, LayerState &whole) {
  const ParallelConfig &pc = plan.parallel;
  int pp = 0; // the pipeline rank that holds the layer
  for (const StageInfo &st : plan.stages)
    if (layer >= st.layerBegin && layer < st.layerEnd)
      pp = st.rank;
  const bool owner = env.coord.dp == 0 && env.coord.pp == pp, lead = env.rank == 0;
  if (!owner && !lead)
    return llvm::Error::success();
  const size_t n = kernels::layerParamCount(cfg, layer, pc.tp);
  LayerState part;
  if (owner)
    PIPEC_TRY(backend->readLayer(layer, part));
  std::vector<float> *arrays[] = {&part.weights, &part.firstMoment, &part.secondMoment};
  for (int t = 0; t < pc.tp; ++t) {
    const int from = pp * pc.dp * pc.tp + t; // RANK of (pp, dp 0, tp t)
    if (env.rank != from && !lead)
      continue;
    if (env.rank != from || !lead) { // a move from `from` to RANK 0 through the staging
      const bool send = env.rank == from;
      if (send)
        for (int a = 0; a < 3; ++a)
          PIPEC_CUDA_TRY(cudaMemcpyAsync(layerStaging.as<float>() + size_t(a) * n,
                                         arrays[a]->data(), n * sizeof(float),
                                         cudaMemcpyHostToDevice, compute));
      PIPEC_TRY(moveLayerPart(from, send, n, layer));
      if (send)
        continue;
      for (int a = 0; a < 3; ++a) {
        arrays[a]->resize(n);
        PIPEC_CUDA_TRY(cudaMemcpyAsync(arrays[a]->data(), layerStaging.as<float>() + size_t(a) * n,
                                       n * sizeof(float), cudaMemcpyDeviceToHost, compute));
      }
      PIPEC_CUDA_TRY(cudaStreamSynchronize(compute));
    }
    kernels::unshardLayer(cfg, layer, t, pc.tp, part.weights, whole.weights);
    kernels::unshardLayer(cfg, layer, t, pc.tp, part.firstMoment, whole.firstMoment);
    kernels::unshardLayer(cfg, layer, t, pc.tp, part.secondMoment, whole.secondMoment);
  }
  return llvm::Error::success();
}

} // namespace

std::unique_ptr<TrainBackend> createNcclBackend(const Plan &plan, const kernels::GptConfig &cfg,
                                                const DataSource &data,
                                                const CudaRunOptions &options,
                                                const LaunchEnv &env) {
  return std::make_unique<NcclTrainBackend>(plan, cfg, data, options, env);
}

llvm::Expected<CudaRunResult> runOnNccl(const Plan &plan, const DataSource &data,
                                        const CudaRunOptions &options, const LaunchEnv &env,
                                        const std::function<void(int, double)> &onStep) {
  auto cfg = gptConfigOf(plan);
  if (!cfg)
    return cfg.takeError();
  NcclTrainBackend backend(plan, *cfg, data, options, env);
  return trainOnGpu(plan, *cfg, data, backend, options, onStep);
}

} // namespace pipec
