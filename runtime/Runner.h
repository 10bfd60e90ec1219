//===- Runner.h - Threads, steps and the watchdog ---------------*- C++ -*-===//
//
// Runs one thread per (pipeline rank, dp replica, tp rank), each interpreting its rank's
// stream on its own backend, one training step at a time. The watchdog turns a stall into a
// report in schedule terms: if no thread completes an instruction for `timeout` seconds, every
// rank's last completed and pending instruction is printed as the rank x step grid with the
// stuck steps marked, and the step fails.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_RUNNER_H
#define PIPEC_RUNTIME_RUNNER_H

#include "runtime/Clock.h"
#include "runtime/Interpreter.h"

#include <memory>
#include <vector>

namespace pipec {

class Runner {
public:
  /// `backends[thread]` for every thread (RunShared::threadOf order). The watchdog counts
  /// `clock`'s time (tests pass a ManualClock; it must outlive the runner).
  Runner(const Plan &plan, Faults faults, double timeoutSeconds,
         std::vector<std::unique_ptr<Backend>> backends, Clock &clock = steadyClock());
  /// The same over `transport` (kept by the caller) instead of a host InProcessTransport.
  Runner(const Plan &plan, Faults faults, double timeoutSeconds,
         std::vector<std::unique_ptr<Backend>> backends, Transport &transport,
         Clock &clock = steadyClock());
  /// One training step on every thread. A Finding on a mismatch, an error of a backend, or a
  /// stall (the watchdog's report).
  llvm::Error step(int index);
  Backend &backend(const Coord &c) { return *backends[size_t(shared.threadOf(c))]; }
  int numThreads() const { return shared.numThreads(); }
  /// The threads' shared state (--profile: RunShared::enableTiming, timings).
  RunShared &state() { return shared; }

private:
  std::string stallReport(double seconds, int step) const;

  RunShared shared;
  double timeout;
  Clock &clock;
  std::vector<std::unique_ptr<Backend>> backends;
};

} // namespace pipec

#endif // PIPEC_RUNTIME_RUNNER_H
