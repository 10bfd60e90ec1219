//===- FakeCudaTest.cpp - the emulated device's guards around every allocation -===//
//
// kernels/cuda/emu/FakeCudaRuntime.cpp puts guard bytes on both sides of every allocation, so
// that the kernel and runtime tests on the emulated device see a kernel that steps outside its
// buffers (a scratch area sized too small, a tile loop that runs past the last row): a read
// there computes with NaN, a write there ends the process, naming the allocation, when the
// buffer is freed or at cudaDeviceSynchronize. The activation arena (runtime/cuda/DeviceArena.h)
// places the runtime's buffers inside one allocation, and puts the same guard behind each.
// These cases check each of those, with the positions written by hand rather than taken from
// the runtime. And the device's compute capability, which a CudaContext reads once: the ops
// choose their kernels by it, and a GPU older than the build's oldest code is refused.
//
//===----------------------------------------------------------------------===//
#include "kernels/cuda/emu/FakeCuda.h"
#include "kernels/cuda/CudaOps.h"
#include "runtime/cuda/DeviceArena.h"

#include <cuda_runtime_api.h>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

/// A device allocation of `bytes` from the emulated device (host memory there).
unsigned char *deviceBytes(size_t bytes) {
  void *p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, bytes), cudaSuccess);
  return static_cast<unsigned char *>(p);
}

class FakeCudaGuardTest : public ::testing::Test {
protected:
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};

TEST_F(FakeCudaGuardTest, WritesInsideTheAllocationPass) {
  unsigned char *p = deviceBytes(100);
  std::memset(p, 0x7f, 100);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(cudaFree(p), cudaSuccess);
}

TEST_F(FakeCudaGuardTest, AWritePastTheEndEndsTheProcessWhenFreed) {
  EXPECT_DEATH(
      {
        unsigned char *p = deviceBytes(100);
        p[100] = 0;
        (void)cudaFree(p);
      },
      "a write past the end of a 100-byte allocation at .*: byte 100 changed \\(found when it "
      "was freed\\)");
  // The guard reaches past the next multiple of 256, then 256 bytes further: byte 511 of a
  // 100-byte allocation is its last byte.
  EXPECT_DEATH(
      {
        unsigned char *p = deviceBytes(100);
        p[511] = 0;
        (void)cudaFree(p);
      },
      "byte 511 changed");
}

TEST_F(FakeCudaGuardTest, AWriteBeforeTheStartEndsTheProcessWhenFreed) {
  EXPECT_DEATH(
      {
        unsigned char *p = deviceBytes(64);
        p[-3] = 0;
        (void)cudaFree(p);
      },
      "a write before the start of a 64-byte allocation at .*: byte -3 changed");
  EXPECT_DEATH(
      {
        unsigned char *p = deviceBytes(64);
        p[-256] = 0;
        (void)cudaFree(p);
      },
      "byte -256 changed");
}

TEST_F(FakeCudaGuardTest, AWriteOfNanPastTheEndIsSeenToo) {
  // The guard is not the freed-memory fill (all-ones bytes), so NaN written there still shows.
  EXPECT_DEATH(
      {
        unsigned char *p = deviceBytes(16);
        std::memset(p + 16, 0xff, 4);
        (void)cudaFree(p);
      },
      "byte 16 changed");
}

TEST_F(FakeCudaGuardTest, StreamOrderedFreesAndDeviceSynchronizeCheckToo) {
  EXPECT_DEATH(
      {
        cudaStream_t s = nullptr;
        (void)cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
        void *p = nullptr;
        (void)cudaMallocAsync(&p, 40, s);
        static_cast<unsigned char *>(p)[41] = 1;
        (void)cudaFreeAsync(p, s);
        (void)cudaStreamSynchronize(s);
      },
      "a write past the end of a 40-byte allocation at .*: byte 41 changed");
  EXPECT_DEATH(
      {
        unsigned char *p = deviceBytes(8);
        p[8] = 1;
        (void)cudaDeviceSynchronize(); // p is still live
      },
      "byte 8 changed \\(found at cudaDeviceSynchronize\\)");
}

TEST_F(FakeCudaGuardTest, ReadsPastEitherEndAreNanInFp32AndBf16) {
  unsigned char *p = deviceBytes(64);
  std::memset(p, 0, 64);
  for (long at : {-256L, -4L, 64L, 252L, 508L}) { // the guards: [-256, 0) and [64, 512)
    float f;
    std::memcpy(&f, p + at, 4);
    EXPECT_TRUE(std::isnan(f)) << "fp32 at byte " << at;
    uint16_t h;
    std::memcpy(&h, p + at + 2, 2);
    EXPECT_EQ(h & 0x7f80, 0x7f80) << "bf16 at byte " << at + 2 << ": exponent all ones";
    EXPECT_NE(h & 0x007f, 0) << "bf16 at byte " << at + 2 << ": a NaN, not an infinity";
  }
  EXPECT_EQ(cudaFree(p), cudaSuccess);
}

/// An arena after a sizing pass that took one buffer of `bytes`, then that buffer again.
struct ReservedArena {
  pipec::DeviceArena arena{nullptr, "rank 0"};
  unsigned char *buffer = nullptr;
  explicit ReservedArena(size_t bytes) {
    auto sized = arena.allocate(bytes);
    EXPECT_TRUE(bool(sized));
    arena.release(*sized);
    EXPECT_FALSE(bool(arena.reserve()));
    auto p = arena.allocate(bytes);
    EXPECT_TRUE(bool(p));
    buffer = static_cast<unsigned char *>(*p);
  }
};

TEST_F(FakeCudaGuardTest, ArenaBuffersAreGuardedToo) {
  {
    ReservedArena a(252);
    // The sizes reported are a GPU's arena's (252 rounded to 256), not the guarded placement's.
    EXPECT_EQ(a.arena.reservedBytes(), 256u);
    EXPECT_EQ(a.arena.stepHighWater(), 256u);
    std::memset(a.buffer, 0, 252);
    float behind;
    std::memcpy(&behind, a.buffer + 252, 4); // (the GPU's arena would round 252 to 256 here)
    EXPECT_TRUE(std::isnan(behind));
    a.arena.release(a.buffer);
  }
  EXPECT_DEATH(
      {
        ReservedArena a(252);
        a.buffer[252] = 0; // in the 4 bytes a GPU's arena would pad with and nothing would see
        a.arena.release(a.buffer);
      },
      "a write past the end of a 252-byte buffer at .* \\(rank 0's activation arena, offset "
      "0\\): byte 252 changed \\(found when it was released\\)");
  EXPECT_DEATH(
      {
        ReservedArena a(1024);
        a.buffer[1024 + 255] = 0;
        a.arena.release(a.buffer);
      },
      "byte 1279 changed");
}

// The arena's record of reads on another stream (a p2p send the compute stream does not wait
// for, runtime/cuda/NcclTransport.h): a release waits for the latest read under its buffer
// and forgets the reads before it (their stream runs them in order); a release under none
// keeps them; elsewhereReadsDone forgets all. (Whether the wait holds the stream is
// nccl_watchdog_test_emu's, on asynchronous streams.)
TEST(DeviceArenaReadsTest, AReleaseWaitsForTheLatestReadUnderItAndForgetsThoseBefore) {
  pipec::DeviceArena arena{nullptr, "rank 0"};
  void *sized[3];
  for (void *&p : sized) {
    auto got = arena.allocate(1024);
    ASSERT_TRUE(bool(got));
    p = *got;
  }
  for (void *p : sized)
    arena.release(p);
  ASSERT_FALSE(bool(arena.reserve()));
  unsigned char *b[3];
  for (auto &p : b) {
    auto got = arena.allocate(1024);
    ASSERT_TRUE(bool(got));
    p = static_cast<unsigned char *>(*got);
  }
  cudaEvent_t e[3];
  for (auto &ev : e)
    ASSERT_EQ(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), cudaSuccess);
  arena.readElsewhere(b[0], 512, e[0]);
  arena.readElsewhere(b[2] + 256, 16, e[1]); // part of a buffer
  arena.readElsewhere(b[1], 1024, e[2]);
  arena.readElsewhere(b[1], 0, e[2]); // nothing
  EXPECT_EQ(arena.readsPending(), 3u);
  // b[2]'s read is the second: the first goes with it, the third stays.
  arena.release(b[2]);
  EXPECT_EQ(arena.readsPending(), 1u);
  arena.release(b[0]); // under no read left
  EXPECT_EQ(arena.readsPending(), 1u);
  arena.elsewhereReadsDone();
  EXPECT_EQ(arena.readsPending(), 0u);
  arena.release(b[1]);
  auto again = arena.allocate(1024);
  ASSERT_TRUE(bool(again)) << "a release's wait failed";
  arena.release(*again);
  for (auto &ev : e)
    EXPECT_EQ(cudaEventDestroy(ev), cudaSuccess);
}

/// The emulated device's compute capability for a scope (back to the default at its end).
struct ComputeCapability {
  explicit ComputeCapability(int capability) { pipec::emu::setComputeCapability(capability); }
  ~ComputeCapability() { pipec::emu::setComputeCapability(0); }
};

TEST(FakeCudaDeviceTest, AContextReadsTheComputeCapabilityItsOpsChooseKernelsBy) {
  using pipec::kernels::cuda::CudaContext;
  using pipec::kernels::cuda::KernelConfig;
  for (int capability : {80, 86, 90}) {
    const ComputeCapability device(capability);
    int major = 0, minor = 0;
    ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0), cudaSuccess);
    ASSERT_EQ(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0), cudaSuccess);
    EXPECT_EQ(10 * major + minor, capability);
    auto ctx = CudaContext::create(/*device=*/0, KernelConfig{.hopperKernels = false});
    ASSERT_TRUE(bool(ctx)) << llvm::toString(ctx.takeError());
    EXPECT_EQ((*ctx)->computeCapability(), capability);
    EXPECT_FALSE((*ctx)->kernelConfig().hopperKernels);
  }
}

TEST(FakeCudaDeviceTest, AGpuOlderThanTheBuildsOldestCodeIsRefusedNamingItsComputeCapability) {
  const ComputeCapability volta(70);
  auto ctx = pipec::kernels::cuda::CudaContext::create(/*device=*/0, {});
  ASSERT_FALSE(bool(ctx));
  const std::string message = llvm::toString(ctx.takeError());
  EXPECT_NE(message.find("GPU 0 has compute capability 7.0; this build has kernels for compute "
                         "capability 8.0 and newer"),
            std::string::npos)
      << message;
}

} // namespace
