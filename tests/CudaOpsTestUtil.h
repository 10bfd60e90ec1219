//===- CudaOpsTestUtil.h - holding CUDA ops against the CPU reference -*- C++ -*-===//
//
// What the tests of kernels/cuda (tests/CudaKernelTest.cpp) and of kernels/cuda/experimental
// share: random inputs rounded as the device holds them, the error measure and its tolerances,
// and GpuTest, a fixture with a CudaContext on device 0 and buffer helpers. Header-only; built
// into each flavour of those tests (on a GPU, on the kernel emulator).
//
// Tolerance: maxError = max |gpu - cpu| / max |cpu| over a tensor, i.e. the largest error
// relative to the tensor's largest entry (near-zero entries are summed from terms that cancel,
// and their relative error says nothing). fp32: 2e-5 (5e-5 where the reduction order of long
// sums differs: matmul weight gradients, attention backward); bf16: 2e-2 (the unit roundoff of
// bf16 is 2^-8 = 3.9e-3, and outputs are rounded once or twice).
//
// GpuTest fails (not skips) when no device is usable: a silent skip would read as a pass on the
// GPU machine.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_TESTS_CUDAOPSTESTUTIL_H
#define PIPEC_TESTS_CUDAOPSTESTUTIL_H

#include "kernels/cuda/CudaOps.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

namespace pipec::kernels::cuda::test {

using Vec = std::vector<float>;

inline constexpr double kTolF32 = 2e-5;
inline constexpr double kTolF32Long = 5e-5;
inline constexpr double kTolBf16 = 2e-2;

inline uint16_t toBf16Bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  if (std::isnan(x))
    return 0x7fc0;
  bits += 0x7fff + ((bits >> 16) & 1); // round to nearest even
  return uint16_t(bits >> 16);
}

inline float fromBf16Bits(uint16_t h) {
  uint32_t bits = uint32_t(h) << 16;
  float x;
  std::memcpy(&x, &bits, 4);
  return x;
}

inline Vec randomVec(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  Vec v(n);
  for (float &x : v)
    x = dist(rng);
  return v;
}

/// The values as the device will hold them in `dtype` (bf16 rounds).
inline Vec quantized(Vec v, DType dtype) {
  if (dtype == DType::BF16)
    for (float &x : v)
      x = fromBf16Bits(toBf16Bits(x));
  return v;
}

inline double tolerance(DType dtype, bool longSums = false) {
  if (dtype == DType::BF16)
    return kTolBf16;
  return longSums ? kTolF32Long : kTolF32;
}

/// max |a - ref| / max |ref| (see the header); the worst index goes to `where`.
inline double maxError(const Vec &a, const Vec &ref, size_t *where = nullptr) {
  EXPECT_EQ(a.size(), ref.size());
  double scale = 1e-30, worst = 0.0;
  for (float r : ref)
    scale = std::max(scale, double(std::fabs(r)));
  for (size_t k = 0; k < std::min(a.size(), ref.size()); ++k) {
    double err = std::fabs(double(a[k]) - double(ref[k]));
    if (!(err <= worst)) { // also catches NaN
      worst = std::isnan(err) ? INFINITY : err;
      if (where)
        *where = k;
    }
  }
  return worst / scale;
}

#define EXPECT_CLOSE(actual, ref, tol)                                                             \
  do {                                                                                             \
    size_t where = 0;                                                                              \
    double err = ::pipec::kernels::cuda::test::maxError(actual, ref, &where);                      \
    EXPECT_LE(err, tol) << #actual << " vs " << #ref << ": worst at " << where << ": "             \
                        << (actual)[where] << " vs " << (ref)[where];                              \
  } while (false)

#define ASSERT_OK(expr)                                                                            \
  do {                                                                                             \
    if (llvm::Error err = (expr))                                                                  \
      FAIL() << #expr << ": " << llvm::toString(std::move(err));                                   \
  } while (false)

/// A CudaContext on device 0 (with the default KernelConfig), and buffers on it.
class GpuTest : public ::testing::Test {
protected:
  void SetUp() override {
    llvm::Expected<int> count = deviceCount();
    if (!count)
      FAIL() << "no usable CUDA device (this test is tagged requires-gpu): "
             << llvm::toString(count.takeError());
    ASSERT_GT(*count, 0) << "no CUDA device (this test is tagged requires-gpu)";
    auto created = CudaContext::create(/*device=*/0, KernelConfig{});
    if (!created)
      FAIL() << llvm::toString(created.takeError());
    ctx = std::move(*created);
  }

  /// Another context on the device, with `config`: buffers are shared between the two (device
  /// memory is the device's), and each context's ops choose their kernels by its own config.
  std::unique_ptr<CudaContext> contextWith(const KernelConfig &config) {
    auto created = CudaContext::create(/*device=*/0, config);
    if (!created) {
      ADD_FAILURE() << llvm::toString(created.takeError());
      return nullptr;
    }
    return std::move(*created);
  }

  /// A device buffer holding `host` in `dtype`.
  DeviceBuffer upload(const Vec &host, DType dtype) {
    DeviceBuffer buffer = allocate(host.size() * sizeOf(dtype));
    if (dtype == DType::F32) {
      check(ctx->upload(buffer.data(), host.data(), host.size() * 4));
      return buffer;
    }
    std::vector<uint16_t> bits(host.size());
    std::transform(host.begin(), host.end(), bits.begin(), toBf16Bits);
    check(ctx->upload(buffer.data(), bits.data(), bits.size() * 2));
    return buffer;
  }

  DeviceBuffer uploadInts(const std::vector<int32_t> &host) {
    DeviceBuffer buffer = allocate(host.size() * 4);
    check(ctx->upload(buffer.data(), host.data(), host.size() * 4));
    return buffer;
  }

  /// `n` values of `dtype` at `device`, widened to fp32 (synchronizes the stream).
  Vec download(const DeviceBuffer &buffer, size_t n, DType dtype) {
    check(ctx->synchronize());
    Vec host(n);
    if (dtype == DType::F32) {
      check(ctx->download(host.data(), buffer.data(), n * 4));
      return host;
    }
    std::vector<uint16_t> bits(n);
    check(ctx->download(bits.data(), buffer.data(), n * 2));
    std::transform(bits.begin(), bits.end(), host.begin(), fromBf16Bits);
    return host;
  }

  DeviceBuffer allocate(size_t bytes) {
    llvm::Expected<DeviceBuffer> buffer = DeviceBuffer::allocate(bytes);
    if (!buffer) {
      ADD_FAILURE() << llvm::toString(buffer.takeError());
      return DeviceBuffer();
    }
    return std::move(*buffer);
  }

  static void check(llvm::Error err) {
    if (err)
      ADD_FAILURE() << llvm::toString(std::move(err));
  }

  std::unique_ptr<CudaContext> ctx;
};

/// Records an op's buffer requests and hands out addresses that fault if anything reads them
/// (non-canonical on x86-64 and AArch64, and no device allocation has one).
class RecordingAllocator final : public DeviceAllocator {
public:
  llvm::Expected<void *> allocate(size_t bytes) override {
    if (bytes == 0)
      return nullptr;
    requests.push_back(bytes);
    ++live;
    return reinterpret_cast<void *>(kNowhere + (requests.size() << 24));
  }
  void release(void *p) override { live -= p != nullptr; }
  static constexpr uintptr_t kNowhere = uintptr_t(1) << 63;
  std::vector<size_t> requests;
  int live = 0;
};

} // namespace pipec::kernels::cuda::test

#endif // PIPEC_TESTS_CUDAOPSTESTUTIL_H
