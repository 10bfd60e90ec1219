#include "runtime/BlockingWatchdog.h"

#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>

namespace pipec {

BlockingWatchdog::BlockingWatchdog(std::string what, double limitSeconds, std::string cause) {
  // (A longer duration would overflow the wait's nanoseconds into a deadline in the past.)
  if (!(limitSeconds < kNoLimit))
    return;
  guard = std::thread([this, what = std::move(what), cause = std::move(cause), limitSeconds] {
    std::unique_lock<std::mutex> lock(mu);
    const auto limit = std::chrono::duration<double>(limitSeconds);
    if (cv.wait_for(lock, limit, [this] { return returned; }))
      return;
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
