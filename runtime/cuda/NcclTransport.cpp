//===- NcclTransport.cpp - The nccl mode's transport: one rank per process ---===//
#include "runtime/cuda/NcclTransport.h"

#include "ir/PlanText.h"
#include "ir/support/Error.h"
#include "kernels/cuda/CudaCheck.h"
#include "runtime/BlockingWatchdog.h"

#include <fmt/format.h>

#include <algorithm>
#include <cassert>
#include <chrono>
#include <set>
#include <thread>

namespace pipec {

using runtime_cuda::order;
using runtime_cuda::OwnedEvent;
using runtime_cuda::OwnedStream;

namespace {

/// NCCL's name of a tensor's element type.
ncclDataType_t ncclTypeOf(DType dtype) {
  switch (dtype) {
  case DType::F32:
    return ncclFloat;
  case DType::BF16:
    return ncclBfloat16;
  }
  llvm_unreachable("unknown dtype");
}

} // namespace

llvm::Error pollDevice(const std::function<cudaError_t()> &done, NcclCommunicators &comms,
                       double timeout, const std::function<std::string(double)> &stalled,
                       const std::function<size_t()> &progress, Clock &clock) {
  double start = clock.now(); // of the time without progress
  double checked = start;
  // Progress is read every 10 ms (a quarter of the timeout where that is shorter): it may query
  // many events, the completion only one.
  const double every = std::min(0.01, timeout / 4);
  size_t seen = progress ? progress() : 0;
  for (;;) {
    cudaError_t q = done();
    if (q == cudaSuccess)
      return llvm::Error::success();
    if (q != cudaErrorNotReady) {
      comms.abortAll();
      PIPEC_CUDA_TRY(q);
    }
    if (auto err = comms.asyncErrors()) {
      comms.abortAll();
      return err;
    }
    const double now = clock.now();
    if (progress && now - checked >= every) {
      checked = now;
      if (size_t p = progress(); p != seen) {
        seen = p;
        start = now;
      }
    }
    double idle = now - start;
    if (idle >= timeout) {
      std::string report = stalled(idle);
      comms.abortAll();
      return llvm::make_error<Finding>(report);
    }
    clock.sleepFor(200e-6);
  }
}

llvm::Error NcclTransport::init(cudaStream_t computeStream,
                                std::function<llvm::Error()> pendingErrorOf, SendHold sendHold) {
  assert(bool(sendHold.reading) == bool(sendHold.allRead) && "a SendHold has both or neither");
  compute = computeStream;
  pendingError = std::move(pendingErrorOf);
  hold = std::move(sendHold);
  for (OwnedStream *s : {&p2p, &tp, &dp, &emb})
    if (auto err = s->create())
      return err;
  for (OwnedEvent *e : {&ready, &p2pDone, &tpDone, &dpDone, &embDone, &stepDone})
    if (auto err = e->create())
      return err;
  // A progress marker for every send, recv and all-reduce of the rank's stream (a p2p group
  // takes one for all its sends and recvs), so that no step creates an event.
  size_t most = 0;
  for (const Instruction &i : plan.ranks[size_t(env.coord.pp)])
    most += i.isP2P() || i.op == OpKind::AllReduce ? 1 : 0;
  markers.reserve(most);
  while (markers.size() < most) {
    markers.push_back(std::make_unique<Marker>());
    if (auto err = markers.back()->event.create())
      return err;
  }
  return llvm::Error::success();
}

llvm::Error NcclTransport::exchange(int self, llvm::ArrayRef<P2POp> ops) {
  if (auto err = pendingError())
    return err;
  if (ops.empty())
    return llvm::Error::success();
  if (auto err = order(p2p.get(), compute, ready.get()))
    return err;
  const ParallelConfig &pc = plan.parallel;
  llvm::Error first = llvm::Error::success();
  auto keep = [&](llvm::Error err) {
    if (err && !first)
      first = std::move(err);
    else
      llvm::consumeError(std::move(err));
  };
  keep([&]() -> llvm::Error {
    PIPEC_NCCL_TRY(ncclGroupStart());
    return llvm::Error::success();
  }());
  for (const P2POp &op : ops) {
    // The pipeline communicator's rank is the pipeline rank (NcclLayout.cpp).
    int peer = op.peer / (pc.dp * pc.tp);
    assert(op.peer % (pc.dp * pc.tp) == self % (pc.dp * pc.tp) && "peer in another replica");
    keep([&]() -> llvm::Error {
      if (op.send)
        PIPEC_NCCL_TRY(ncclSend(op.data.data, op.data.count, ncclTypeOf(op.data.type), peer,
                                comms.pipeline.get(), p2p.get()));
      else
        PIPEC_NCCL_TRY(ncclRecv(op.data.data, op.data.count, ncclTypeOf(op.data.type), peer,
                                comms.pipeline.get(), p2p.get()));
      return llvm::Error::success();
    }());
  }
  // Always closed, also after a failed post (NCCL's group must be ended).
  keep([&]() -> llvm::Error {
    PIPEC_NCCL_TRY(ncclGroupEnd());
    return llvm::Error::success();
  }());
  if (first)
    return first;
  if (auto err = mark({ops.front().rank, ops.front().step, ops.back().step, {}}, p2p.get()))
    return err;
  // Sends alone: compute runs on; a sent buffer's release waits for its send instead (the
  // marker just recorded is the group's completion).
  if (hold.reading &&
      std::all_of(ops.begin(), ops.end(), [](const P2POp &op) { return op.send; })) {
    cudaEvent_t done = markers[markersUsed - 1]->event.get();
    for (const P2POp &op : ops)
      hold.reading(op.data.data, op.data.bytes(), done);
    return llvm::Error::success();
  }
  if (auto err = order(compute, p2p.get(), p2pDone.get()))
    return err;
  // (The p2p stream runs its groups in order: this one's completion covers every earlier send.)
  if (hold.allRead)
    hold.allRead();
  return llvm::Error::success();
}

llvm::Error NcclTransport::allReduce(CollectiveGroup group, const std::string &key,
                                     llvm::ArrayRef<int> members, int self, TensorView data) {
  if (auto err = pendingError())
    return err;
  NcclComm *comm = &comms.tp;
  cudaStream_t s = tp.get();
  switch (group) {
  case CollectiveGroup::Tp:
    break;
  case CollectiveGroup::Dp:
    comm = &comms.dp;
    s = dp.get();
    // A hand-written plan may put it after the embedding all-reduce of the same stage.
    if (auto err = order(s, emb.get(), embDone.get()))
      return err;
    break;
  case CollectiveGroup::Embedding:
    comm = &comms.embedding;
    s = emb.get();
    // Its range of the gradients may still be in a dp all-reduce of the same stage.
    if (auto err = order(s, dp.get(), dpDone.get()))
      return err;
    break;
  }
  if (!*comm || comm->size() != int(members.size()))
    return llvm::createStringError(
        llvm::inconvertibleErrorCode(),
        fmt::format("all-reduce {} of {} members has no matching communicator on rank {} (it "
                    "has {} ranks)",
                    key, members.size(), self, comm->size()));
  if (auto err = order(s, compute, ready.get()))
    return err;
  PIPEC_NCCL_TRY(ncclAllReduce(data.data, data.data, data.count, ncclTypeOf(data.type), ncclSum,
                               comm->get(), s));
  if (auto err = mark({-1, 0, 0, key}, s))
    return err;
  // tp reductions are consumed by the next part at once; dp and embedding ones overlap
  // compute until waitForCollectives().
  if (group == CollectiveGroup::Tp)
    return order(compute, s, tpDone.get());
  return llvm::Error::success();
}

llvm::Error NcclTransport::waitForCollectives() {
  if (auto err = order(compute, dp.get(), dpDone.get()))
    return err;
  return order(compute, emb.get(), embDone.get());
}

void NcclTransport::abort(const std::string &why) {
  if (failure.empty())
    failure = why;
  comms.abortAll();
}

llvm::Error NcclTransport::warmUp(float *scratch, double timeoutSeconds,
                                  double arrivalLimitSeconds) {
  // Any failure aborts the communicators at once: what was posted may never complete, and the
  // caller's buffers, freed on the way out, would wait for it.
  llvm::Error err = warmUpOnce(scratch, timeoutSeconds, arrivalLimitSeconds);
  if (err)
    comms.abortAll();
  return err;
}

llvm::Error NcclTransport::warmUpOnce(float *scratch, double timeoutSeconds,
                                      double arrivalLimitSeconds) {
  std::set<int> peers;
  for (const Instruction &i : plan.ranks[size_t(env.coord.pp)])
    if (i.isP2P())
      peers.insert(i.peer);
  {
    // The posts block the host while NCCL connects to each peer, which waits for the peer to
    // post too: guarded by the blocking watchdog (runtime/BlockingWatchdog.h), since no poll
    // runs meanwhile.
    BlockingWatchdog watchdog(fmt::format("rank {}'s warm-up of its NCCL connections", env.rank),
                              arrivalLimitSeconds);
    if (!peers.empty()) {
      // Both directions with every peer, in one group: every peer posts the mirror image. (The
      // recvs of a rank with two peers land in one float, which nothing reads.) The group is
      // closed also after a failed post, as exchange()'s.
      PIPEC_NCCL_TRY(ncclGroupStart());
      ncclResult_t posted = ncclSuccess;
      for (int p : peers) {
        if (posted == ncclSuccess)
          posted = ncclSend(scratch, 1, ncclFloat, p, comms.pipeline.get(), p2p.get());
        if (posted == ncclSuccess)
          posted = ncclRecv(scratch + 1, 1, ncclFloat, p, comms.pipeline.get(), p2p.get());
      }
      const ncclResult_t ended = ncclGroupEnd();
      if (posted != ncclSuccess)
        return makeNcclError("ncclSend/ncclRecv (the warm-up's, to every peer)", posted, __FILE__,
                             __LINE__);
      if (ended != ncclSuccess)
        return makeNcclError("ncclGroupEnd() (the warm-up's p2p group)", ended, __FILE__, __LINE__);
    }
    // Every collective communicator, in creation order (the same on every process), each into
    // a float of its own: they run side by side on three streams.
    float *slot = scratch + 2;
    for (auto [c, s] : {std::pair{&comms.tp, tp.get()}, std::pair{&comms.dp, dp.get()},
                        std::pair{&comms.embedding, emb.get()}}) {
      if (*c)
        PIPEC_NCCL_TRY(ncclAllReduce(slot, slot, 1, ncclFloat, ncclSum, c->get(), s));
      ++slot;
    }
  }
  // Then the device, polled with the watchdog: `timeoutSeconds` in all, not per stream.
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  for (cudaStream_t s : {p2p.get(), tp.get(), dp.get(), emb.get()}) {
    const double left =
        timeoutSeconds - std::chrono::duration<double>(Clock::now() - start).count();
    if (auto err = pollDevice([s] { return cudaStreamQuery(s); }, comms, std::max(left, 0.0),
                              [this, timeoutSeconds](double) {
                                return fmt::format(
                                    "watchdog: rank {}'s warm-up of its NCCL connections made no "
                                    "progress for {:.1f} s: a peer did not reach its own",
                                    env.rank, timeoutSeconds);
                              }))
      return err;
  }
  return llvm::Error::success();
}

llvm::Error NcclTransport::waitStep(int step, double timeoutSeconds,
                                    const std::function<size_t()> &computeDone) {
  if (auto err = waitForCollectives())
    return err;
  for (cudaStream_t s : {p2p.get(), tp.get()})
    if (auto err = order(compute, s, ready.get()))
      return err;
  if (hold.allRead)
    hold.allRead();
  PIPEC_CUDA_TRY(cudaEventRecord(stepDone.get(), compute));
  return pollDevice([&] { return cudaEventQuery(stepDone.get()); }, comms, timeoutSeconds,
                    [&](double idle) {
                      std::string report = stallReport(step, idle);
                      if (failure.empty())
                        failure = report;
                      return report;
                    },
                    [&] { return completedMarkers() + (computeDone ? computeDone() : 0); });
}

size_t NcclTransport::completedMarkers() {
  markerDone.resize(markersUsed, false);
  size_t n = 0;
  for (size_t k = 0; k < markersUsed; ++k) {
    // (A failed query is left to the step's own, which reports it.)
    if (!markerDone[k] && cudaEventQuery(markers[k]->event.get()) == cudaSuccess)
      markerDone[k] = true;
    n += markerDone[k] ? 1 : 0;
  }
  return n;
}

llvm::Error NcclTransport::mark(Posted what, cudaStream_t s) {
  assert(markersUsed < markers.size() && "init() made too few markers: a step creates events");
  if (markersUsed == markers.size()) { // (release builds: still correct, only slower)
    markers.push_back(std::make_unique<Marker>());
    if (auto err = markers.back()->event.create())
      return err;
  }
  Marker &m = *markers[markersUsed++];
  m.what = std::move(what);
  PIPEC_CUDA_TRY(cudaEventRecord(m.event.get(), s));
  return llvm::Error::success();
}

std::string NcclTransport::describe(const Posted &p) const {
  if (p.rank < 0)
    return fmt::format("all-reduce {}", p.key);
  const auto &stream = plan.ranks[size_t(p.rank)];
  if (p.first == p.last)
    return fmt::format("step {} ({})", p.first, formatToken(plan, stream[p.first]));
  return fmt::format("group of steps {}-{} ({} ... {})", p.first, p.last,
                     formatToken(plan, stream[p.first]), formatToken(plan, stream[p.last]));
}

std::string NcclTransport::stallReport(int step, double seconds) const {
  std::string last = "none", pending = "none (its p2p groups and all-reduces are done; the "
                                       "compute stream is not)";
  for (size_t k = 0; k < markersUsed; ++k) {
    if (cudaEventQuery(markers[k]->event.get()) == cudaSuccess) {
      last = describe(markers[k]->what);
      continue;
    }
    pending = describe(markers[k]->what);
    break;
  }
  const Coord &c = env.coord;
  return fmt::format("watchdog: rank {} (pp {}, dp {}, tp {}) made no progress for {:.1f} s in "
                     "step {}: last completed {}, pending {}; the processes it waits for "
                     "report their own pending instructions",
                     env.rank, c.pp, c.dp, c.tp, seconds, step, last, pending);
}

} // namespace pipec
