//===- BlockingWatchdogTest.cpp - A call that never returns ends the process --===//
//
// runtime/BlockingWatchdog.h guards a host call that waits for a peer process (NCCL's
// communicator creation, the first post to a peer): past its limit the process exits with
// status 1 and one line on stderr; a call that returns in time costs nothing more than the
// guard thread's start and join. Time here is a ManualClock's (runtime/Clock.h): each test
// moves it itself, so nothing sleeps and nothing depends on how busy the machine is; the
// limits are the real ones (ten minutes), which take no time to pass.
//
//===----------------------------------------------------------------------===//
#include "runtime/BlockingWatchdog.h"

#include <gtest/gtest.h>

#include <atomic>
#include <limits>
#include <thread>
#include <unistd.h>

namespace pipec {
namespace {

constexpr double kTenMinutes = 600;

TEST(BlockingWatchdogTest, ACallThatReturnsInTimeLeavesTheProcessAlone) {
  ManualClock clock;
  {
    BlockingWatchdog watchdog("the test's quick call", kTenMinutes,
                              "a peer process that never took part?", {}, clock);
    clock.awaitWaiters(1);          // (the guard has started)
    clock.advance(kTenMinutes - 1); // (the guard has looked at this time and gone on waiting)
    EXPECT_EQ(clock.waiting(), 1u);
  }
  // The guard was released at once, not at its limit, which this clock never reaches.
  EXPECT_EQ(clock.waiting(), 0u);
}

TEST(BlockingWatchdogTest, ALimitTooLongToCountGuardsNothing) {
  // (piperun takes any --timeout > 0: 1e12 s, or inf, must not overflow the timer into a
  // deadline in the past, which ended the process at once.)
  for (double limit : {1e12, std::numeric_limits<double>::infinity(), BlockingWatchdog::kNoLimit}) {
    ManualClock clock;
    BlockingWatchdog watchdog("the test's call", limit, "a peer process that never took part?", {},
                              clock);
    EXPECT_EQ(clock.waiting(), 0u) << "a guard started for a limit of " << limit;
    clock.advance(1e13);
  }
  SUCCEED() << "the process is still here";
}

TEST(BlockingWatchdogTest, ACallPastItsLimitEndsTheProcessNamingIt) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        ManualClock clock;
        BlockingWatchdog watchdog("rank 3's creation of its NCCL world communicator", kTenMinutes,
                                  "a peer process that never took part?", {}, clock);
        clock.awaitWaiters(1);
        clock.advance(kTenMinutes - 0.1);
        clock.advance(0.1);
        for (;;) // (only the guard's exit ends this)
          ::pause();
      },
      ::testing::ExitedWithCode(1),
      "^watchdog: rank 3's creation of its NCCL world communicator blocked for 600.0 s \\(a peer "
      "process that never took part\\?\\); exiting\n$");
}

TEST(BlockingWatchdogTest, ACallThatKeepsProgressingIsGuardedByTimeWithoutProgress) {
  // With a progress count the limit is of time in which the count did not change: twenty
  // limits of a call whose count moves are fine; a limit without a change ends it.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        ManualClock clock;
        std::atomic<uint64_t> count{0};
        BlockingWatchdog watchdog(
            "rank 0's warm-up of its NCCL connections", /*limitSeconds=*/1.0, "a stalled peer?",
            [&] { return count.load(); }, clock);
        // Each step waits for the guard to be back on the clock (it reads the count off it).
        auto step = [&](double seconds) {
          clock.advance(seconds);
          clock.awaitWaiters(1);
        };
        clock.awaitWaiters(1);
        for (int i = 0; i < 400; ++i) { // 20 s, progressing every 50 ms
          count.fetch_add(1);
          step(0.05);
        }
        std::fprintf(stderr, "still here after 20 s of progress\n");
        for (int i = 0; i < 150; ++i) // then up to 1.5 s without (the guard exits on the way)
          step(0.01);
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(1),
      "^still here after 20 s of progress\nwatchdog: rank 0's warm-up of its NCCL connections "
      "blocked for 1.0 s \\(a stalled peer\\?\\); exiting\n$");
}

TEST(ManualClockTest, AWaitEndsWhenTheTimeReachesItsDeadlineAndNotBefore) {
  ManualClock clock;
  std::mutex mu;
  std::condition_variable cv;
  std::atomic<bool> returned{false};
  std::thread waiter([&] {
    std::unique_lock<std::mutex> lock(mu);
    EXPECT_FALSE(clock.waitUntil(lock, cv, 2.0, [] { return false; }));
    returned = true;
  });
  clock.awaitWaiters(1);
  clock.advance(1.0);
  EXPECT_FALSE(returned.load()); // (advance returns once the waiter has looked at the time)
  EXPECT_EQ(clock.waiting(), 1u);
  clock.advance(1.0);
  waiter.join();
  EXPECT_TRUE(returned.load());
  EXPECT_EQ(clock.now(), 2.0);
}

} // namespace
} // namespace pipec
