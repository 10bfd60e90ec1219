//===- BlockingWatchdogTest.cpp - A call that never returns ends the process --===//
//
// runtime/BlockingWatchdog.h guards a host call that waits for a peer process (NCCL's
// communicator creation, the first post to a peer): past its limit the process exits with
// status 1 and one line on stderr; a call that returns in time costs nothing more than the
// guard thread's start and join.
//
//===----------------------------------------------------------------------===//
#include "runtime/BlockingWatchdog.h"

#include <gtest/gtest.h>

#include <chrono>
#include <limits>
#include <thread>

namespace pipec {
namespace {

TEST(BlockingWatchdogTest, ACallThatReturnsInTimeLeavesTheProcessAlone) {
  const auto start = std::chrono::steady_clock::now();
  {
    BlockingWatchdog watchdog("the test's quick call", /*limitSeconds=*/60);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // The guard is released at once, not at its limit.
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

TEST(BlockingWatchdogTest, ALimitTooLongToCountGuardsNothing) {
  // (piperun takes any --timeout > 0: 1e12 s, or inf, must not overflow the timer into a
  // deadline in the past, which ended the process at once.)
  for (double limit : {1e12, std::numeric_limits<double>::infinity(), BlockingWatchdog::kNoLimit}) {
    BlockingWatchdog watchdog("the test's call", limit);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  SUCCEED() << "the process is still here";
}

TEST(BlockingWatchdogTest, ACallPastItsLimitEndsTheProcessNamingIt) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        BlockingWatchdog watchdog("rank 3's creation of its NCCL world communicator", 0.2);
        std::this_thread::sleep_for(std::chrono::seconds(30)); // (a peer that never comes)
      },
      ::testing::ExitedWithCode(1),
      "^watchdog: rank 3's creation of its NCCL world communicator blocked for 0.2 s \\(a peer "
      "process that never took part\\?\\); exiting\n$");
}

} // namespace
} // namespace pipec
