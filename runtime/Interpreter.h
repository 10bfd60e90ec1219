//===- Interpreter.h - Walks one rank's instruction stream ------*- C++ -*-===//
//
// The one interpreter every backend shares: compute ops go to the backend, consecutive send/recv
// ops with one group are posted together, all-reduces go to their group (tp: the tp ranks of
// this pipeline rank and replica; dp: the dp replicas; embedding: the first and last stage's
// ranks), the optimizer step to the backend. Progress is published for the watchdog.
// With the in-process transport every rank is a thread (Runner); with another transport (the
// nccl one) a process interprets its one rank alone.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_INTERPRETER_H
#define PIPEC_RUNTIME_INTERPRETER_H

#include "ir/Plan.h"
#include "runtime/Backend.h"
#include "runtime/Transport.h"

#include <atomic>
#include <optional>
#include <vector>

namespace pipec {

/// Where a thread sits: pipeline rank, dp replica, tp rank.
struct Coord {
  int pp = 0, dp = 0, tp = 0;
};

/// Deliberate faults, for tests that prove a broken exchange is caught.
struct Faults {
  /// The send at this (pipeline rank, step) is never delivered (on every replica).
  std::optional<std::pair<int, size_t>> dropSend;
  /// Rank `first` sends the tensors of its steps `second.first` and `second.second` swapped.
  std::optional<std::pair<int, std::pair<size_t, size_t>>> swapSends;
};

/// State shared by the threads of one run.
struct RunShared {
  const Plan &plan;
  /// Every rank a thread of this process (the default) ...
  InProcessTransport inProcess;
  /// ... or another transport (one rank per process: runtime/cuda/NcclTransport.h).
  Transport &transport;
  Faults faults;
  /// Per thread: index of the instruction it is executing (== done before it).
  std::vector<std::atomic<size_t>> position;
  std::atomic<uint64_t> progress{0};
  /// --profile (runtime/Profile.h): per thread, per instruction of its stream, the host-clock
  /// milliseconds it took in each step run, its backend's work waited for (Backend::awaitCompute;
  /// a send or recv: its group's exchange). Empty: nothing is timed.
  std::vector<std::vector<std::vector<float>>> timings;

  RunShared(const Plan &plan, Faults faults);
  /// With `external` as the transport; the caller keeps it alive.
  RunShared(const Plan &plan, Faults faults, Transport &external);
  int numThreads() const { return int(position.size()); }
  /// Megatron's tp-dp-pp order.
  int threadOf(const Coord &c) const {
    return (c.pp * plan.parallel.dp + c.dp) * plan.parallel.tp + c.tp;
  }
  Coord coordOf(int thread) const;
  /// Time every instruction from now on (`timings`).
  void enableTiming();
};

/// Execute rank `c.pp`'s stream once (one training step) on `backend`.
llvm::Error interpretStep(RunShared &shared, const Coord &c, Backend &backend);

} // namespace pipec

#endif // PIPEC_RUNTIME_INTERPRETER_H
