#include "runtime/BlockingWatchdog.h"

#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>

namespace pipec {

BlockingWatchdog::BlockingWatchdog(std::string what, double limitSeconds) {
  guard = std::thread([this, what = std::move(what), limitSeconds] {
    std::unique_lock<std::mutex> lock(mu);
    const auto limit = std::chrono::duration<double>(limitSeconds);
    if (cv.wait_for(lock, limit, [this] { return returned; }))
      return;
    std::fflush(stdout); // (what the process printed so far stays in its log)
    fmt::print(stderr,
               "watchdog: {} blocked for {:.1f} s (a peer process that never took part?); "
               "exiting\n",
               what, limitSeconds);
    std::fflush(stderr);
    std::_Exit(1); // (exit() would run destructors that wait for the call that blocks)
  });
}

BlockingWatchdog::~BlockingWatchdog() {
  {
    std::lock_guard<std::mutex> lock(mu);
    returned = true;
  }
  cv.notify_one();
  guard.join();
}

} // namespace pipec
