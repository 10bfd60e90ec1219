//===- Clock.cpp - The real clock and the manual one ------------------------===//
#include "runtime/Clock.h"

#include <algorithm>
#include <chrono>
#include <thread>

namespace pipec {

namespace {

class SteadyClock final : public Clock {
public:
  using Steady = std::chrono::steady_clock;

  double now() override {
    return std::chrono::duration<double>(Steady::now().time_since_epoch()).count();
  }

  bool waitUntil(std::unique_lock<std::mutex> &lock, std::condition_variable &cv, double deadline,
                 const std::function<bool()> &pred) override {
    // (A deadline past what the wait's nanoseconds hold would wrap into the past.)
    deadline = std::min(deadline, 1e9);
    auto at = Steady::time_point(
        std::chrono::duration_cast<Steady::duration>(std::chrono::duration<double>(deadline)));
    return cv.wait_until(lock, at, pred);
  }

  void sleepFor(double seconds) override {
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  }
};

} // namespace

Clock &steadyClock() {
  static SteadyClock clock;
  return clock;
}

double ManualClock::now() {
  std::lock_guard<std::mutex> g(mu);
  return time;
}

bool ManualClock::waitUntil(std::unique_lock<std::mutex> &lock, std::condition_variable &cv,
                            double deadline, const std::function<bool()> &pred) {
  Waiter w{lock.mutex(), &cv, 0};
  {
    std::lock_guard<std::mutex> g(mu);
    w.seen = generation;
    waiters.push_back(&w);
  }
  changed.notify_all();
  bool result = false;
  for (;;) {
    if (pred()) {
      result = true;
      break;
    }
    {
      std::lock_guard<std::mutex> g(mu);
      if (time >= deadline)
        break;
      w.seen = generation; // looked at the time, and goes back to waiting
    }
    changed.notify_all();
    // advance() notifies `cv` holding `lock`'s mutex, so no advance is missed between the
    // look above and this wait.
    cv.wait(lock);
  }
  // Leave with the caller's lock released: an advance() in progress may be about to take it.
  lock.unlock();
  {
    std::unique_lock<std::mutex> g(mu);
    changed.wait(g, [&] { return !advancing; });
    waiters.erase(std::find(waiters.begin(), waiters.end(), &w));
  }
  changed.notify_all();
  lock.lock();
  return result;
}

void ManualClock::sleepFor(double seconds) {
  if (sleepAdvances) {
    advance(seconds);
    return;
  }
  std::unique_lock<std::mutex> lock(sleepMu);
  waitUntil(lock, sleepCv, now() + seconds, [] { return false; });
}

void ManualClock::advance(double seconds) {
  std::vector<Waiter *> toWake;
  uint64_t gen = 0;
  {
    std::lock_guard<std::mutex> g(mu);
    time += seconds;
    gen = ++generation;
    advancing = true;
    toWake = waiters;
  }
  // (A waiter cannot leave while `advancing`: its mutex and condition variable stay alive.)
  for (Waiter *w : toWake) {
    std::lock_guard<std::mutex> l(*w->mutex);
    w->cv->notify_all();
  }
  std::unique_lock<std::mutex> g(mu);
  advancing = false;
  changed.notify_all();
  changed.wait(g, [&] {
    return std::all_of(waiters.begin(), waiters.end(), [&](Waiter *w) { return w->seen >= gen; });
  });
}

void ManualClock::awaitWaiters(size_t n) {
  std::unique_lock<std::mutex> g(mu);
  changed.wait(g, [&] { return waiters.size() >= n; });
}

size_t ManualClock::waiting() {
  std::lock_guard<std::mutex> g(mu);
  return waiters.size();
}

} // namespace pipec
