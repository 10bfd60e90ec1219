#include "runtime/BlockingWatchdog.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

namespace pipec {

BlockingWatchdog::BlockingWatchdog(std::string what, double limitSeconds, std::string cause,
                                   std::function<uint64_t()> progress, Clock &clock) {
  // (A longer duration would overflow the wait's nanoseconds into a deadline in the past.)
  if (!(limitSeconds < kNoLimit))
    return;
  guard = std::thread([this, what = std::move(what), cause = std::move(cause),
                       progress = std::move(progress), limitSeconds, &clock] {
    std::unique_lock<std::mutex> lock(mu);
    double deadline = clock.now() + limitSeconds;
    uint64_t seen = 0;
    if (progress) {
      lock.unlock();
      seen = progress();
      lock.lock();
    }
    for (;;) {
      const double wake = progress ? std::min(deadline, clock.now() + 0.01) : deadline;
      if (clock.waitUntil(lock, cv, wake, [this] { return returned; }))
        return;
      if (progress) {
        lock.unlock(); // (the count may take a while: the destructor must not wait for it)
        const uint64_t now = progress();
        lock.lock();
        if (returned)
          return;
        if (now != seen) {
          seen = now;
          deadline = clock.now() + limitSeconds;
          continue;
        }
      }
      if (clock.now() >= deadline)
        break;
    }
    // What the process printed so far stays in its log, unless another thread holds stdout
    // (blocked on a full pipe, say): the exit must not wait for it.
    if (ftrylockfile(stdout) == 0) {
      fflush_unlocked(stdout);
      funlockfile(stdout);
    }
    fmt::print(stderr, "watchdog: {} blocked for {:.1f} s ({}); exiting\n", what, limitSeconds,
               cause);
    std::fflush(stderr);
    std::_Exit(1); // (exit() would run destructors that wait for the call that blocks)
  });
}

BlockingWatchdog::~BlockingWatchdog() {
  if (!guard.joinable())
    return;
  {
    std::lock_guard<std::mutex> lock(mu);
    returned = true;
  }
  cv.notify_one();
  guard.join();
}

} // namespace pipec
