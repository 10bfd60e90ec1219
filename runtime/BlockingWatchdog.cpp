#include "runtime/BlockingWatchdog.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>

namespace pipec {

BlockingWatchdog::BlockingWatchdog(std::string what, double limitSeconds, std::string cause,
                                   std::function<uint64_t()> progress) {
  // (A longer duration would overflow the wait's nanoseconds into a deadline in the past.)
  if (!(limitSeconds < kNoLimit))
    return;
  guard = std::thread([this, what = std::move(what), cause = std::move(cause),
                       progress = std::move(progress), limitSeconds] {
    using Clock = std::chrono::steady_clock;
    std::unique_lock<std::mutex> lock(mu);
    const auto limit =
        std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(limitSeconds));
    auto deadline = Clock::now() + limit;
    uint64_t seen = 0;
    if (progress) {
      lock.unlock();
      seen = progress();
      lock.lock();
    }
    for (;;) {
      const auto wake =
          progress ? std::min(deadline, Clock::now() + std::chrono::milliseconds(10)) : deadline;
      if (cv.wait_until(lock, wake, [this] { return returned; }))
        return;
      if (progress) {
        lock.unlock(); // (the count may take a while: the destructor must not wait for it)
        const uint64_t now = progress();
        lock.lock();
        if (returned)
          return;
        if (now != seen) {
          seen = now;
          deadline = Clock::now() + limit;
          continue;
        }
      }
      if (Clock::now() >= deadline)
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
