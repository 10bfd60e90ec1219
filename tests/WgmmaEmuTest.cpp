//===- WgmmaEmuTest.cpp - The kernel emulator runs wgmma asynchronously, and checks its rules -===//
//
// On a GPU, wgmma.mma_async runs asynchronously until the wgmma.wait_group that covers it, and
// the PTX ISA leaves undefined a kernel that touches its accumulator or A registers or the shared
// memory it reads before then, that issues one without a wgmma.fence after writing its
// registers, or that lets it read shared memory written by cp.async without a
// fence.proxy.async. Such a kernel may pass on one GPU and fail on the next. The kernel emulator
// (kernels/cuda/emu/KernelEmu.cpp) ends the run for each of these, naming the rule; these tests
// hold it to that, and to computing the right product when the rules are kept. The products
// are exact (small halves), so they are compared bit for bit with the host's.
//
//===----------------------------------------------------------------------===//
#include "tests/WgmmaEmuKernels.h"

#include "kernels/HostBf16.h"

#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <vector>

namespace {

using pipec::emu::test::runWgmmaCase;
using pipec::emu::test::WgmmaCase;
using pipec::kernels::floatToBf16;

class WgmmaEmuTest : public ::testing::Test {
protected:
  void SetUp() override {
    GTEST_FLAG_SET(death_test_style, "threadsafe");
    for (int i = 0; i < 64 * 16; ++i) {
      aValues[i] = float((i * 7) % 5 - 2) * 0.5f;
      a[i] = floatToBf16(aValues[i]);
    }
    for (int k = 0; k < 16; ++k)
      for (int n = 0; n < 16; ++n) {
        bValues[16 * k + n] = float((k * 3 + n * 5) % 7 - 3) * 0.5f;
        b[16 * k + n] = bColumns[16 * n + k] = floatToBf16(bValues[16 * k + n]);
      }
    for (int m = 0; m < 64; ++m)
      for (int n = 0; n < 16; ++n) {
        float sum = 0.0f;
        for (int k = 0; k < 16; ++k)
          sum += aValues[16 * m + k] * bValues[16 * k + n];
        product[16 * m + n] = sum;
      }
  }
  void run(WgmmaCase c) {
    runWgmmaCase(c, a.data(), b.data(), bColumns.data(), out.data(), out2.data());
  }
  /// Runs `c`, which keeps the rules, and checks that it computed the product.
  void expectProduct(WgmmaCase c) {
    run(c);
    EXPECT_EQ(out, product) << "case " << int(c);
  }
  /// Every accumulator in `v` still NaN: none was read before its wait.
  static void expectUnread(const std::vector<float> &v) {
    for (float x : v)
      ASSERT_TRUE(std::isnan(x)) << "an accumulator read before its wait: " << x;
  }

  std::vector<float> aValues = std::vector<float>(64 * 16), bValues = std::vector<float>(16 * 16);
  std::vector<uint16_t> a = std::vector<uint16_t>(64 * 16), b = std::vector<uint16_t>(16 * 16);
  alignas(16) std::array<uint16_t, 16 * 16> bColumns{};
  std::vector<float> product = std::vector<float>(64 * 16);
  std::vector<float> out = std::vector<float>(64 * 16, -1.0f),
                     out2 = std::vector<float>(64 * 16, -1.0f);
};

TEST_F(WgmmaEmuTest, KeepingTheRulesGivesTheProduct) { expectProduct(WgmmaCase::Correct); }

TEST_F(WgmmaEmuTest, CopiedOperandsAreReadAfterAProxyFenceOfTheWriterOrTheReader) {
  expectProduct(WgmmaCase::CopiedWithProxyFence);
  expectProduct(WgmmaCase::CopiedWithReaderFences);
}

TEST_F(WgmmaEmuTest, WgmmaInFlightAccumulateIntoTheSameRegistersWithoutAWait) {
  run(WgmmaCase::ChainedInOneGroup);
  std::vector<float> twice(product.size());
  for (size_t i = 0; i < product.size(); ++i)
    twice[i] = 2.0f * product[i];
  EXPECT_EQ(out, twice);
}

TEST_F(WgmmaEmuTest, AWaitForAllButTheNewestGroupLeavesThatOneInFlight) {
  expectProduct(WgmmaCase::WaitLeavesNewestGroup);
  expectUnread(out2);
}

TEST_F(WgmmaEmuTest, AnAccumulatorReadBeforeItsWaitIsNaN) {
  run(WgmmaCase::ReadBeforeWait);
  expectUnread(out);
}

TEST_F(WgmmaEmuTest, SwizzledTilesAreTheKernelsToAlign) {
  // Dynamic shared memory need not start on a 1024-byte boundary, and the 128-byte swizzle
  // XORs the shared address's bits: a tile used where the kernel did not align it is read in
  // another order than it was stored in.
  expectProduct(WgmmaCase::SwizzledAligned);
  run(WgmmaCase::SwizzledUnaligned);
  EXPECT_NE(out, product);
}

TEST_F(WgmmaEmuTest, BreakingARuleEndsTheRunNamingIt) {
  EXPECT_DEATH(run(WgmmaCase::WriteAccumulatorInFlight),
               "accumulator registers of a wgmma in flight were written before the "
               "wgmma.wait_group");
  EXPECT_DEATH(run(WgmmaCase::WriteAccumulatorBetweenChained),
               "accumulator registers of a wgmma in flight were written before the next wgmma");
  EXPECT_DEATH(run(WgmmaCase::ChangeFragmentInFlight),
               "A-fragment registers of a wgmma in flight changed");
  EXPECT_DEATH(run(WgmmaCase::OverwriteSharedInFlight),
               "thread 0 .*shared memory a wgmma in flight reads was written");
  EXPECT_DEATH(run(WgmmaCase::NoFence), "before the thread's first wgmma.fence");
  EXPECT_DEATH(run(WgmmaCase::FragmentWrittenAfterFence),
               "A-fragment registers of a wgmma were written since the last wgmma.fence");
  EXPECT_DEATH(run(WgmmaCase::CopiedWithoutProxyFence), "with no fence.proxy.async");
  EXPECT_DEATH(run(WgmmaCase::StoredWithoutProxyFence),
               "written since the block's last fence.proxy.async");
  // Thread 0's fence after the barrier orders neither the other writers' copies nor the other
  // warps' reads.
  EXPECT_DEATH(run(WgmmaCase::ProxyFenceByAnotherThread),
               "warp [123], lane 0\\): wgmma reads shared memory that cp.async wrote");
  EXPECT_DEATH(run(WgmmaCase::ExitInFlight), "exited with wgmma.mma_async in flight");
  EXPECT_DEATH(run(WgmmaCase::WarpSkipsWgmma),
               "warpgroup 0: at the block's end its threads have issued different numbers of "
               "wgmma \\(thread 0: 1, thread 32: 0\\)");
}

} // namespace
