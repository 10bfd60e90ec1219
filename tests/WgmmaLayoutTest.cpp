//===- WgmmaLayoutTest.cpp - What wgmma makes of the attention's operand layouts ---------===//
//
// WgmmaLayoutKernels.h: one product per operand form of the attention kernels, against the
// host's. The inputs are halves in [-1.5, 1.5], so every product and partial sum is exact in
// fp32 whatever the order, and D must match bit for bit. Built twice: for the GPU
// (wgmma_layout_test, requires-gpu: the hardware's reading of our layouts and descriptors) and
// for the kernel emulator (wgmma_layout_test_kernel_emu: the emulator's reading). Skipped on a GPU
// that is not compute capability 9.0 (the kernels are sm_90a).
//
//===----------------------------------------------------------------------===//
#include "tests/WgmmaLayoutKernels.h"

#include "kernels/HostBf16.h"
#include <cuda_runtime_api.h>

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace {

using pipec::kernels::floatToBf16;
using pipec::test::runWgmmaLayoutCase;
using pipec::test::WgmmaLayoutCase;
using pipec::test::wgmmaLayoutColumns;

template <typename T> T *deviceCopy(const std::vector<T> &host) {
  void *p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, host.size() * sizeof(T)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
            cudaSuccess);
  return static_cast<T *>(p);
}

class WgmmaLayoutTest : public ::testing::TestWithParam<WgmmaLayoutCase> {
protected:
  void SetUp() override {
    int major = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) != cudaSuccess ||
        major != 9)
      GTEST_SKIP() << "wgmma needs a compute-capability-9.0 GPU";
  }
};

TEST_P(WgmmaLayoutTest, ProductMatchesTheHostsBitForBit) {
  const WgmmaLayoutCase c = GetParam();
  constexpr int kRows = 64, kCols = 128;
  // Halves from a linear congruential sequence: no row or column repeats another, so an operand
  // read from the wrong row, column or k-step shows.
  std::vector<float> a(kRows * kCols), b(kRows * kCols);
  uint32_t state = 12345;
  auto next = [&] {
    state = state * 1103515245u + 12345u;
    return float(int(state >> 16 & 0x7fff) % 7 - 3) * 0.5f;
  };
  for (int i = 0; i < kRows * kCols; ++i) {
    a[i] = next();
    b[i] = next();
  }
  const int n = wgmmaLayoutColumns(c);
  std::vector<float> expected(size_t(kRows) * n);
  for (int m = 0; m < kRows; ++m)
    for (int j = 0; j < n; ++j) {
      float sum = 0.0f;
      if (c == WgmmaLayoutCase::RegisterAMNMajorB)
        for (int k = 0; k < 64; ++k)
          sum += a[kCols * m + k] * b[kCols * k + j];
      else if (c == WgmmaLayoutCase::SharedMNMajorAMNMajorB)
        for (int k = 0; k < 64; ++k)
          sum += a[kCols * m + k] * b[kCols * k + 64 + j];
      else
        for (int k = 0; k < kCols; ++k)
          sum += a[kCols * m + k] * b[kCols * j + k];
      expected[size_t(n) * m + j] = sum;
    }
  std::vector<uint16_t> aBits(a.size()), bBits(b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    aBits[i] = floatToBf16(a[i]);
    bBits[i] = floatToBf16(b[i]);
  }
  uint16_t *da = deviceCopy(aBits), *db = deviceCopy(bBits);
  float *dd = deviceCopy(std::vector<float>(expected.size(), -1.0f));
  ASSERT_EQ(runWgmmaLayoutCase(c, da, db, dd), int(cudaSuccess));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<float> got(expected.size());
  ASSERT_EQ(cudaMemcpy(got.data(), dd, got.size() * sizeof(float), cudaMemcpyDeviceToHost),
            cudaSuccess);
  int wrong = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != expected[i] && ++wrong <= 5) {
      ADD_FAILURE() << "D[" << i / size_t(n) << "][" << i % size_t(n) << "] = " << got[i]
                    << ", the host's " << expected[i];
    }
  EXPECT_EQ(wrong, 0) << "of " << got.size();
  cudaFree(da);
  cudaFree(db);
  cudaFree(dd);
}

INSTANTIATE_TEST_SUITE_P(AttentionForms, WgmmaLayoutTest,
                         ::testing::Values(WgmmaLayoutCase::RegisterAKMajorB,
                                           WgmmaLayoutCase::RegisterAMNMajorB,
                                           WgmmaLayoutCase::SharedAKMajorB,
                                           WgmmaLayoutCase::SharedMNMajorAMNMajorB),
                         [](const ::testing::TestParamInfo<WgmmaLayoutCase> &info) {
                           switch (info.param) {
                           case WgmmaLayoutCase::RegisterAKMajorB:
                             return std::string("ForwardScores_RegisterA_KMajorB");
                           case WgmmaLayoutCase::RegisterAMNMajorB:
                             return std::string("ForwardValues_RegisterA_MNMajorB");
                           case WgmmaLayoutCase::SharedAKMajorB:
                             return std::string("BackwardKeyScores_SharedA_KMajorB");
                           case WgmmaLayoutCase::SharedMNMajorAMNMajorB:
                             return std::string("BackwardQueryGrad_SharedMNMajorA_MNMajorB");
                           }
                           return std::string("Unknown");
                         });

} // namespace
