//===- NcclTransport.h - The nccl mode's transport: one rank per process -*- C++ -*-===//
//
// The Transport of the nccl mode (runtime/cuda/NcclRun.h): the sends and recvs of one plan group
// are posted inside one ncclGroupStart/ncclGroupEnd on the `pipeline` communicator and a p2p
// stream, in plan order; the p2p stream first waits for the compute stream, and the compute
// stream waits for a group that receives. A group of sends alone it does not wait for: compute
// runs on while the peer is not yet ready to receive, and the owner of the sent buffers (the
// rank's arena, given as a SendHold) is told of the reads, so that releasing a sent buffer makes
// the compute stream wait for its send instead (DeviceArena::readElsewhere). tp all-reduces
// run on the `tp` communicator and stream (the compute stream waits at once); dp and embedding
// all-reduces on their own communicators and streams, until waitForCollectives(). Nothing
// blocks the host inside a step; waitStep() polls the device at its end with a watchdog that
// names the first p2p group or all-reduce of this rank that has not completed. The names are
// made only then: the hot path records one event per group and keeps the group's steps.
// Used by runOnNccl and by the nccl overhead benchmark (bench/nccl_overhead_bench.cpp).
// This header includes nccl.h; it is for runtime/cuda/, its tests and the benchmarks only.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_CUDA_NCCLTRANSPORT_H
#define PIPEC_RUNTIME_CUDA_NCCLTRANSPORT_H

#include "runtime/Clock.h"
#include "runtime/Transport.h"
#include "runtime/cuda/DeviceHandles.h"
#include "runtime/cuda/Nccl.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace pipec {

/// Polls `done` (an event or stream query) until it reports success. A CUDA error or an
/// asynchronous NCCL error aborts this process's communicators and is returned; so is a stall of
/// `timeout` seconds, as a Finding with the report `stalled(seconds)` writes. A stall is
/// `timeout` seconds in which `progress` (a count of completed work, read every few
/// milliseconds) did not change, or, without `progress`, `timeout` seconds in all: a step
/// whose work keeps completing is never one, however long it takes. (An abort frees this
/// process's NCCL resources and ends its kernels; NCCL tells no peer. A peer blocked on this
/// process fails through its own watchdog, or sooner over sockets, when this process exits and they
/// close.) Time is `clock`'s (tests pass a ManualClock).
llvm::Error pollDevice(const std::function<cudaError_t()> &done, NcclCommunicators &comms,
                       double timeout, const std::function<std::string(double)> &stalled,
                       const std::function<size_t()> &progress = {}, Clock &clock = steadyClock());

/// How long a host call may wait for a peer process to arrive (communicator creation, a first
/// post to a peer, which connects to it): ten timeouts, at least 10 minutes, since the
/// processes of a launch start, and set up their ranks, at different speeds.
inline double peerArrivalLimit(double timeoutSeconds) {
  return std::max(timeoutSeconds * 10, 600.0);
}

class NcclTransport final : public Transport {
public:
  NcclTransport(const Plan &plan, const LaunchEnv &env, NcclCommunicators &comms)
      : plan(plan), env(env), comms(comms) {}

  /// Where the sent buffers come from, told of the sends the compute stream does not wait for.
  /// Without one (empty functions), the compute stream waits for every group.
  struct SendHold {
    /// A send reads [data, data + bytes) on the p2p stream until `done`; the reads come in the
    /// p2p stream's order (DeviceArena::readElsewhere).
    std::function<void(const void *data, size_t bytes, cudaEvent_t done)> reading;
    /// The compute stream has waited for every send so far.
    std::function<void()> allRead;
  };

  /// Streams and events; `compute` is the backend's compute stream, `pendingError` its kept
  /// error (checked before anything is posted, so a failed send never leaves a peer waiting
  /// on a wrong buffer), `sendHold` the owner of the sent buffers (runOnNccl's: the rank's
  /// arena; without one, the compute stream waits for every group).
  llvm::Error init(cudaStream_t computeStream, std::function<llvm::Error()> pendingErrorOf,
                   SendHold sendHold = {});

  /// Before a step: forget the last step's progress markers.
  void beginStep() {
    markersUsed = 0;
    markerDone.clear();
  }

  llvm::Error exchange(int self, llvm::ArrayRef<P2POp> ops) override;
  llvm::Error allReduce(CollectiveGroup group, const std::string &key, llvm::ArrayRef<int> members,
                        int self, TensorView data) override;

  /// The compute stream waits for every dp and embedding all-reduce queued so far.
  llvm::Error waitForCollectives();

  void abort(const std::string &why) override;
  bool aborted() const override { return !failure.empty(); }

  /// Connect every pipeline peer and every collective communicator once, before the first step
  /// (NCCL connects p2p peers at the first ncclGroupEnd otherwise, blocking the host there).
  /// The posts, which block while NCCL connects (until the peer posts too), are guarded by a
  /// BlockingWatchdog: the process exits after `arrivalLimitSeconds` (peerArrivalLimit for a
  /// launch). The device's completion is then polled, and a stall of `timeoutSeconds` in all
  /// fails. Any failure aborts the communicators. `scratch`: 5 floats of device memory. (The
  /// collectives' other algorithms connect when the communicators are created; see
  /// prepareNcclEnvironment, runtime/cuda/NcclRun.h.)
  llvm::Error warmUp(float *scratch, double timeoutSeconds, double arrivalLimitSeconds);

  /// After the step's instructions are queued: wait for the device, with the watchdog, which
  /// fires after `timeoutSeconds` in which none of the step's p2p groups and all-reduces
  /// finished, nor any of the work `computeDone` counts (the backend's compute ops,
  /// CudaRankBackend::completedWork).
  llvm::Error waitStep(int step, double timeoutSeconds,
                       const std::function<size_t()> &computeDone = {});

private:
  /// What a marker stands for: a p2p group (the plan steps of its first and last op on
  /// `rank`'s stream) or an all-reduce (its key).
  struct Posted {
    int rank = -1; // -1: an all-reduce
    size_t first = 0, last = 0;
    std::string key;
  };
  /// A point of this rank's work on one of its streams.
  struct Marker {
    Posted what;
    runtime_cuda::OwnedEvent event;
  };

  llvm::Error warmUpOnce(float *scratch, double timeoutSeconds, double arrivalLimitSeconds);
  llvm::Error mark(Posted what, cudaStream_t s);
  std::string describe(const Posted &p) const;
  std::string stallReport(int step, double seconds) const;

  const Plan &plan;
  const LaunchEnv &env;
  NcclCommunicators &comms;
  cudaStream_t compute = nullptr;
  std::function<llvm::Error()> pendingError;
  SendHold hold;
  runtime_cuda::OwnedStream p2p, tp, dp, emb;
  runtime_cuda::OwnedEvent ready, p2pDone, tpDone, dpDone, embDone, stepDone;
  std::vector<std::unique_ptr<Marker>> markers; // in post order; reused across steps
  size_t markersUsed = 0;
  std::vector<bool> markerDone; // of this step's markers, those seen complete (waitStep)
  /// How many of this step's markers have completed (a stall is a time in which none did).
  size_t completedMarkers();
  std::string failure;
};

} // namespace pipec

#endif // PIPEC_RUNTIME_CUDA_NCCLTRANSPORT_H
