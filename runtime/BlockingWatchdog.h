//===- BlockingWatchdog.h - Ends the process when a blocking call never returns -*- C++ -*-===//
//
// Some calls block the host thread until a peer process takes part: NCCL's communicator
// creation (its bootstrap waits for every rank) and the first ncclGroupEnd with a peer, which
// connects to it. A peer that died or never started holds such a call forever, where no
// polling watchdog runs (NCCL's waits have no timeout). BlockingWatchdog guards one such call:
// should it not return within its limit, the process prints one line naming the call and the
// limit to stderr and exits with status 1, and so closes its sockets, which lets peers blocked
// on it over a network fail too. (Nothing is aborted from the guarding thread: NCCL does not
// promise that freeing a communicator another thread is inside is safe. Exiting is.)
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_BLOCKINGWATCHDOG_H
#define PIPEC_RUNTIME_BLOCKINGWATCHDOG_H

#include "runtime/Clock.h"

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace pipec {

class BlockingWatchdog {
public:
  /// Guards what runs until this object is destroyed: after `limitSeconds` the process exits,
  /// printing "watchdog: <what> blocked for <limit> s (<cause>); exiting". `what` names the
  /// call and the rank, `cause` the likely reason. With `progress` (a count the guard reads
  /// every 10 ms from its own thread), the limit is of time in which the count did not change.
  /// A limit of kNoLimit seconds or more (or not a number) guards nothing: no thread starts.
  /// Time is `clock`'s (tests pass a ManualClock; it must outlive the watchdog).
  BlockingWatchdog(std::string what, double limitSeconds,
                   std::string cause = "a peer process that never took part?",
                   std::function<uint64_t()> progress = {}, Clock &clock = steadyClock());
  /// About three years: what a timer can count without overflowing its nanoseconds.
  static constexpr double kNoLimit = 1e8;
  ~BlockingWatchdog();
  BlockingWatchdog(const BlockingWatchdog &) = delete;
  BlockingWatchdog &operator=(const BlockingWatchdog &) = delete;

private:
  std::mutex mu;
  std::condition_variable cv;
  bool returned = false;
  std::thread guard;
};

} // namespace pipec

#endif // PIPEC_RUNTIME_BLOCKINGWATCHDOG_H
