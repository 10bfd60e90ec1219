//===- Clock.h - The time the runtime's watchdogs count, injectable -*- C++ -*-===//
//
// The watchdogs (Runner's step watchdog, BlockingWatchdog's guard, the nccl mode's pollDevice)
// measure time without progress against a limit. They read a Clock: the real one
// (steadyClock()) in the tools, a ManualClock in tests, which moves only when the test
// advances it. A test of a watchdog then neither sleeps nor asserts wall-clock times: whether
// it fires depends on nothing the machine's load can change, and a ten-minute limit takes no
// time to test.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_CLOCK_H
#define PIPEC_RUNTIME_CLOCK_H

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <vector>

namespace pipec {

class Clock {
public:
  virtual ~Clock() = default;
  /// Seconds since an arbitrary origin; never decreases.
  virtual double now() = 0;
  /// With `lock` held (on the mutex that guards what `pred` reads, and that whoever changes
  /// it notifies `cv` under): waits until `pred` holds or the clock reaches `deadline`.
  /// Returns pred()'s last value.
  virtual bool waitUntil(std::unique_lock<std::mutex> &lock, std::condition_variable &cv,
                         double deadline, const std::function<bool()> &pred) = 0;
  /// Lets `seconds` of this clock pass (the pace of a polling loop).
  virtual void sleepFor(double seconds) = 0;
};

/// The real time (std::chrono::steady_clock); what the tools use.
Clock &steadyClock();

/// Time that moves only when advance() moves it. advance() returns once every thread waiting
/// on the clock has looked at the new time (and fired, or gone back to waiting), so a test
/// knows what a watchdog did with each step it takes. sleepFor waits until the time has moved
/// that far, unless the clock was made with `sleepAdvances`, for a polling loop that runs on
/// the test's own thread: then sleeping is what moves the time.
class ManualClock final : public Clock {
public:
  explicit ManualClock(bool sleepAdvances = false) : sleepAdvances(sleepAdvances) {}
  double now() override;
  bool waitUntil(std::unique_lock<std::mutex> &lock, std::condition_variable &cv, double deadline,
                 const std::function<bool()> &pred) override;
  void sleepFor(double seconds) override;
  /// Moves the time `seconds` ahead; returns once every waiter has seen it.
  void advance(double seconds);
  /// How many threads are waiting on the clock now.
  size_t waiting();
  /// Blocks until at least `n` threads wait on the clock (a guard thread that has started).
  void awaitWaiters(size_t n);

private:
  struct Waiter {
    std::mutex *mutex;
    std::condition_variable *cv;
    uint64_t seen;
  };

  const bool sleepAdvances;
  std::mutex mu; // guards everything below
  std::condition_variable changed;
  double time = 0;
  uint64_t generation = 0;
  bool advancing = false;
  std::vector<Waiter *> waiters;
  // sleepFor's own wait.
  std::mutex sleepMu;
  std::condition_variable sleepCv;
};

} // namespace pipec

#endif // PIPEC_RUNTIME_CLOCK_H
