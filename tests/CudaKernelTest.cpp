//===- CudaKernelTest.cpp - every CUDA op against the fp32 CPU reference -----===//
//
// Each kernels/cuda op runs on small random inputs, with sizes chosen to cross the kernels'
// edges (rows not a multiple of a warp, a head dimension not a multiple of 32, key ranges
// crossing 32-key tiles and, on the tensor cores, 64-key tiles and 64-query blocks, a slice with
// begin > 0), and is compared with kernels/cpu/Ops.h on the
// same inputs. In bf16 the inputs are first rounded to bf16 on the host, so both sides see the
// same values and the difference is the kernel's bf16 storage and summation order alone.
//
// Tolerance: maxErr = max |gpu - cpu| / max(|cpu|, 1e-3 * ...) over a tensor, i.e. the largest
// error relative to the tensor's largest entry (near-zero entries are summed from terms that
// cancel, and their relative error says nothing). fp32: 2e-5 (5e-5 where the reduction order
// of long sums differs: matmul weight gradients, attention backward); bf16: 2e-2 (the unit
// roundoff of bf16 is 2^-8 = 3.9e-3, and outputs are rounded once or twice).
//
// Built twice: //tests:cuda_kernel_test on a GPU (tag requires-gpu), and
// //tests:cuda_kernel_emu_test with the .cu kernels on the kernel emulator
// (kernels/cuda/emu/KernelEmu.h), in CI, matmul cases filtered out (they are cuBLASLt's).
// The GpuTest fixture fails (not skips) when no device is usable: a silent skip would read as a
// pass on the GPU machine. CudaCheckTest needs
// no device and runs everywhere CUDA is installed (//tests:cuda_check_test).
//
//===----------------------------------------------------------------------===//
#include "kernels/cpu/Ops.h"
#include "kernels/cuda/CudaCheck.h"
#include "kernels/cuda/CudaOps.h"
#include "kernels/cuda/Launch.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace pipec::kernels::cuda {
namespace {

namespace cpu = ::pipec::kernels::ops;
using Vec = std::vector<float>;

constexpr double kTolF32 = 2e-5;
constexpr double kTolF32Long = 5e-5;
constexpr double kTolBf16 = 2e-2;

//===--- Host helpers -----------------------------------------------------===//

uint16_t toBf16Bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  if (std::isnan(x))
    return 0x7fc0;
  bits += 0x7fff + ((bits >> 16) & 1); // round to nearest even
  return uint16_t(bits >> 16);
}

float fromBf16Bits(uint16_t h) {
  uint32_t bits = uint32_t(h) << 16;
  float x;
  std::memcpy(&x, &bits, 4);
  return x;
}

Vec randomVec(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  Vec v(n);
  for (float &x : v)
    x = dist(rng);
  return v;
}

/// The values as the device will hold them in `dtype` (bf16 rounds).
Vec quantized(Vec v, DType dtype) {
  if (dtype == DType::BF16)
    for (float &x : v)
      x = fromBf16Bits(toBf16Bits(x));
  return v;
}

double tolerance(DType dtype, bool longSums = false) {
  if (dtype == DType::BF16)
    return kTolBf16;
  return longSums ? kTolF32Long : kTolF32;
}

/// max |a - ref| / max |ref| (see the header); the worst index goes to `where`.
double maxError(const Vec &a, const Vec &ref, size_t *where = nullptr) {
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
    double err = maxError(actual, ref, &where);                                                    \
    EXPECT_LE(err, tol) << #actual << " vs " << #ref << ": worst at " << where << ": "             \
                        << (actual)[where] << " vs " << (ref)[where];                              \
  } while (false)

#define ASSERT_OK(expr)                                                                            \
  do {                                                                                             \
    if (llvm::Error err = (expr))                                                                  \
      FAIL() << #expr << ": " << llvm::toString(std::move(err));                                   \
  } while (false)

//===--- Device helpers ---------------------------------------------------===//

class GpuTest : public ::testing::Test {
protected:
  void SetUp() override {
    llvm::Expected<int> count = deviceCount();
    if (!count)
      FAIL() << "no usable CUDA device (this test is tagged requires-gpu): "
             << llvm::toString(count.takeError());
    ASSERT_GT(*count, 0) << "no CUDA device (this test is tagged requires-gpu)";
    auto created = CudaContext::create(/*device=*/0);
    if (!created)
      FAIL() << llvm::toString(created.takeError());
    ctx = std::move(*created);
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

//===--- Matmuls ----------------------------------------------------------===//

struct MatmulCase {
  int n = 37, i = 48, o = 40;
};

class CudaMatmulTest : public GpuTest, public ::testing::WithParamInterface<DType> {};

TEST_P(CudaMatmulTest, ForwardWithBiasMatchesCpu) {
  const DType dt = GetParam();
  const MatmulCase m;
  Vec x = quantized(randomVec(size_t(m.n) * m.i, 1), dt);
  Vec w = quantized(randomVec(size_t(m.i) * m.o, 2), dt);
  Vec bias = quantized(randomVec(m.o, 3), dt);
  Vec ref(size_t(m.n) * m.o), refNoBias(ref.size());
  cpu::matmulForward(ref.data(), x.data(), w.data(), bias.data(), m.n, m.i, m.o);
  cpu::matmulForward(refNoBias.data(), x.data(), w.data(), nullptr, m.n, m.i, m.o);
  DeviceBuffer dx = upload(x, dt), dw = upload(w, dt), db = upload(bias, dt);
  DeviceBuffer out = allocate(ref.size() * sizeOf(dt));
  ASSERT_OK(matmulForward(*ctx, dt, out.data(), dx.data(), dw.data(), db.data(), m.n, m.i, m.o));
  EXPECT_CLOSE(download(out, ref.size(), dt), ref, tolerance(dt));
  ASSERT_OK(matmulForward(*ctx, dt, out.data(), dx.data(), dw.data(), nullptr, m.n, m.i, m.o));
  EXPECT_CLOSE(download(out, ref.size(), dt), refNoBias, tolerance(dt));
  // A bias one element into its buffer (a slice of packed parameters: 2- or 4-byte aligned)
  // takes the separate bias kernel instead of cuBLASLt's epilogue.
  Vec shifted(bias.size() + 1, 0.0f);
  std::copy(bias.begin(), bias.end(), shifted.begin() + 1);
  DeviceBuffer dShifted = upload(shifted, dt);
  const void *misaligned = static_cast<const char *>(dShifted.data()) + sizeOf(dt);
  ASSERT_OK(matmulForward(*ctx, dt, out.data(), dx.data(), dw.data(), misaligned, m.n, m.i, m.o));
  EXPECT_CLOSE(download(out, ref.size(), dt), ref, tolerance(dt));
}

TEST_P(CudaMatmulTest, BackwardInputMatchesCpu) {
  const DType dt = GetParam();
  const MatmulCase m;
  Vec dOut = quantized(randomVec(size_t(m.n) * m.o, 4), dt);
  Vec w = quantized(randomVec(size_t(m.i) * m.o, 5), dt);
  Vec ref(size_t(m.n) * m.i);
  cpu::matmulBackwardInput(ref.data(), dOut.data(), w.data(), m.n, m.i, m.o);
  DeviceBuffer ddOut = upload(dOut, dt), dw = upload(w, dt);
  DeviceBuffer dIn = allocate(ref.size() * sizeOf(dt));
  ASSERT_OK(matmulBackwardInput(*ctx, dt, dIn.data(), ddOut.data(), dw.data(), m.n, m.i, m.o));
  EXPECT_CLOSE(download(dIn, ref.size(), dt), ref, tolerance(dt));
}

TEST_P(CudaMatmulTest, BackwardWeightAccumulatesLikeCpu) {
  const DType dt = GetParam();
  const MatmulCase m;
  Vec x = quantized(randomVec(size_t(m.n) * m.i, 6), dt);
  Vec dOut = quantized(randomVec(size_t(m.n) * m.o, 7), dt);
  Vec dW = randomVec(size_t(m.i) * m.o, 8), dBias = randomVec(m.o, 9); // fp32, accumulated into
  Vec refW = dW, refBias = dBias;
  cpu::matmulBackwardWeight(refW.data(), refBias.data(), x.data(), dOut.data(), m.n, m.i, m.o);
  DeviceBuffer dx = upload(x, dt), ddOut = upload(dOut, dt);
  DeviceBuffer gW = upload(dW, DType::F32), gB = upload(dBias, DType::F32);
  ASSERT_OK(matmulBackwardWeight(*ctx, dt, gW.as<float>(), gB.as<float>(), dx.data(), ddOut.data(),
                                 m.n, m.i, m.o));
  // fp32 outputs in both modes: only the summation order differs.
  EXPECT_CLOSE(download(gW, refW.size(), DType::F32), refW, kTolF32Long);
  EXPECT_CLOSE(download(gB, refBias.size(), DType::F32), refBias, kTolF32Long);
}

TEST_P(CudaMatmulTest, TransposedWeightTrioMatchesCpu) {
  const DType dt = GetParam();
  const MatmulCase m; // w (o, i): the LM head's [vocab, C]
  Vec x = quantized(randomVec(size_t(m.n) * m.i, 10), dt);
  Vec w = quantized(randomVec(size_t(m.o) * m.i, 11), dt);
  Vec dOut = quantized(randomVec(size_t(m.n) * m.o, 12), dt);
  Vec dW = randomVec(size_t(m.o) * m.i, 13);
  Vec refOut(size_t(m.n) * m.o), refIn(size_t(m.n) * m.i), refW = dW;
  cpu::matmulTForward(refOut.data(), x.data(), w.data(), m.n, m.i, m.o);
  cpu::matmulTBackwardInput(refIn.data(), dOut.data(), w.data(), m.n, m.i, m.o);
  cpu::matmulTBackwardWeight(refW.data(), x.data(), dOut.data(), m.n, m.i, m.o);
  DeviceBuffer dx = upload(x, dt), dw = upload(w, dt), ddOut = upload(dOut, dt);
  DeviceBuffer out = allocate(refOut.size() * sizeOf(dt));
  DeviceBuffer dIn = allocate(refIn.size() * sizeOf(dt));
  DeviceBuffer gW = upload(dW, DType::F32);
  ASSERT_OK(matmulTForward(*ctx, dt, out.data(), dx.data(), dw.data(), m.n, m.i, m.o));
  ASSERT_OK(matmulTBackwardInput(*ctx, dt, dIn.data(), ddOut.data(), dw.data(), m.n, m.i, m.o));
  ASSERT_OK(
      matmulTBackwardWeight(*ctx, dt, gW.as<float>(), dx.data(), ddOut.data(), m.n, m.i, m.o));
  EXPECT_CLOSE(download(out, refOut.size(), dt), refOut, tolerance(dt));
  EXPECT_CLOSE(download(dIn, refIn.size(), dt), refIn, tolerance(dt));
  EXPECT_CLOSE(download(gW, refW.size(), DType::F32), refW, kTolF32Long);
}

//===--- Layernorm, GELU ------------------------------------------------===//

class CudaLayernormTest : public GpuTest, public ::testing::WithParamInterface<DType> {};

TEST_P(CudaLayernormTest, ForwardAndBothBackwardsMatchCpu) {
  const DType dt = GetParam();
  const int n = 33, c = 200;
  Vec x = quantized(randomVec(size_t(n) * c, 20, -2.0f, 3.0f), dt);
  Vec w = quantized(randomVec(c, 21, 0.5f, 1.5f), dt), b = quantized(randomVec(c, 22), dt);
  Vec dOut = quantized(randomVec(size_t(n) * c, 23), dt);
  Vec dIn0 = quantized(randomVec(size_t(n) * c, 24), dt); // accumulated into
  Vec dW0 = randomVec(c, 25), dB0 = randomVec(c, 26);
  Vec refOut(size_t(n) * c), refMean(n), refRstd(n), refIn = dIn0, refW = dW0, refB = dB0;
  cpu::layernormForward(refOut.data(), refMean.data(), refRstd.data(), x.data(), w.data(), b.data(),
                        n, c);
  cpu::layernormBackwardInputAccumulate(refIn.data(), dOut.data(), x.data(), refMean.data(),
                                        refRstd.data(), w.data(), n, c);
  cpu::layernormBackwardWeight(refW.data(), refB.data(), dOut.data(), x.data(), refMean.data(),
                               refRstd.data(), n, c);

  DeviceBuffer gx = upload(x, dt), gw = upload(w, dt), gb = upload(b, dt);
  DeviceBuffer gdOut = upload(dOut, dt), gdIn = upload(dIn0, dt);
  DeviceBuffer gdW = upload(dW0, DType::F32), gdB = upload(dB0, DType::F32);
  DeviceBuffer out = allocate(refOut.size() * sizeOf(dt));
  DeviceBuffer mean = allocate(n * 4), rstd = allocate(n * 4);
  ASSERT_OK(layernormForward(*ctx, dt, out.data(), mean.as<float>(), rstd.as<float>(), gx.data(),
                             gw.data(), gb.data(), n, c));
  ASSERT_OK(layernormBackwardInputAccumulate(*ctx, dt, gdIn.data(), gdOut.data(), gx.data(),
                                             mean.as<float>(), rstd.as<float>(), gw.data(), n, c));
  ASSERT_OK(layernormBackwardWeight(*ctx, dt, gdW.as<float>(), gdB.as<float>(), gdOut.data(),
                                    gx.data(), mean.as<float>(), rstd.as<float>(), n, c));
  EXPECT_CLOSE(download(out, refOut.size(), dt), refOut, tolerance(dt));
  EXPECT_CLOSE(download(mean, n, DType::F32), refMean, kTolF32);
  EXPECT_CLOSE(download(rstd, n, DType::F32), refRstd, kTolF32);
  EXPECT_CLOSE(download(gdIn, refIn.size(), dt), refIn, tolerance(dt, /*longSums=*/true));
  EXPECT_CLOSE(download(gdW, c, DType::F32), refW, kTolF32Long);
  EXPECT_CLOSE(download(gdB, c, DType::F32), refB, kTolF32Long);
}

// The weight gradients every tp rank computes whole (layernorms, row-parallel biases) must have
// the same bits on every rank, from the same inputs, or the ranks' copies drift apart: each
// launch sums a column in one order, whatever order its blocks run in. (On the kernel emulator,
// //tests:cuda_kernel_emu_test sets PIPEC_EMU_BLOCK_ORDER=shuffled: every launch runs its blocks
// in a new order, and a sum of atomically added partials comes out with other bits.)
TEST_P(CudaLayernormTest, WeightGradientHasTheSameBitsEveryLaunch) {
  const DType dt = GetParam();
  const int n = 300, c = 70; // two chunks of rows (scratch, then their sum), columns not 32 k
  Vec x = quantized(randomVec(size_t(n) * c, 27, -2.0f, 3.0f), dt);
  Vec dOut = quantized(randomVec(size_t(n) * c, 28), dt);
  Vec mean(n), rstd(n), out(size_t(n) * c), w(c, 1.0f), b(c, 0.0f);
  cpu::layernormForward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), n, c);
  Vec refW(c, 0.0f), refB(c, 0.0f);
  cpu::layernormBackwardWeight(refW.data(), refB.data(), dOut.data(), x.data(), mean.data(),
                               rstd.data(), n, c);
  DeviceBuffer gx = upload(x, dt), gdOut = upload(dOut, dt);
  DeviceBuffer gMean = upload(mean, DType::F32), gRstd = upload(rstd, DType::F32);
  Vec firstW, firstB;
  for (int run = 0; run < 4; ++run) {
    DeviceBuffer gdW = upload(Vec(c, 0.0f), DType::F32), gdB = upload(Vec(c, 0.0f), DType::F32);
    ASSERT_OK(layernormBackwardWeight(*ctx, dt, gdW.as<float>(), gdB.as<float>(), gdOut.data(),
                                      gx.data(), gMean.as<float>(), gRstd.as<float>(), n, c));
    Vec dW = download(gdW, c, DType::F32), dB = download(gdB, c, DType::F32);
    EXPECT_CLOSE(dW, refW, kTolF32Long);
    EXPECT_CLOSE(dB, refB, kTolF32Long);
    if (run == 0) {
      firstW = dW, firstB = dB;
      continue;
    }
    EXPECT_EQ(dW, firstW) << "launch " << run << " summed dW in another order";
    EXPECT_EQ(dB, firstB) << "launch " << run << " summed dB in another order";
  }
}

TEST_P(CudaLayernormTest, GeluForwardAndBackwardMatchCpu) {
  const DType dt = GetParam();
  const size_t n = 1000;
  Vec x = quantized(randomVec(n, 30, -4.0f, 4.0f), dt), dOut = quantized(randomVec(n, 31), dt);
  Vec refOut(n), refIn(n);
  cpu::geluForward(refOut.data(), x.data(), n);
  cpu::geluBackward(refIn.data(), dOut.data(), x.data(), n);
  DeviceBuffer gx = upload(x, dt), gdOut = upload(dOut, dt);
  DeviceBuffer out = allocate(n * sizeOf(dt)), dIn = allocate(n * sizeOf(dt));
  ASSERT_OK(geluForward(*ctx, dt, out.data(), gx.data(), n));
  ASSERT_OK(geluBackward(*ctx, dt, dIn.data(), gdOut.data(), gx.data(), n));
  EXPECT_CLOSE(download(out, n, dt), refOut, tolerance(dt));
  EXPECT_CLOSE(download(dIn, n, dt), refIn, tolerance(dt));
}

//===--- Attention ------------------------------------------------------===//

struct AttentionCase {
  AttentionShape shape;
  const char *name;
};

class CudaAttentionTest : public GpuTest,
                          public ::testing::WithParamInterface<std::tuple<DType, AttentionCase>> {};

TEST_P(CudaAttentionTest, SliceOverEarlierKeysMatchesCpu) {
  const DType dt = std::get<0>(GetParam());
  const AttentionShape s = std::get<1>(GetParam()).shape;
  cpu::AttentionShape cs{s.batch, s.queries, s.begin, s.heads, s.headDim};
  const size_t qSize = size_t(s.batch) * s.queries * s.width();
  const size_t kvSize = size_t(s.keys()) * s.batch * s.width();
  Vec q = quantized(randomVec(qSize, 40), dt), k = quantized(randomVec(kvSize, 41), dt);
  Vec v = quantized(randomVec(kvSize, 42), dt), dOut = quantized(randomVec(qSize, 43), dt);
  // dk and dv are fp32 accumulators in both types (CudaOps.h): what they hold is added to.
  Vec dk0 = randomVec(kvSize, 44), dv0 = randomVec(kvSize, 45);
  Vec refOut(qSize), probs(size_t(s.batch) * s.heads * s.queries * s.keys());
  Vec refDq(qSize), refDk = dk0, refDv = dv0;
  cpu::attentionForward(refOut.data(), probs.data(), q.data(), k.data(), v.data(), cs);
  cpu::attentionBackward(refDq.data(), refDk.data(), refDv.data(), dOut.data(), probs.data(),
                         q.data(), k.data(), v.data(), cs);
  // The log-sum-exp of each query row's scaled scores (B, H, x), in double.
  Vec refLse(size_t(s.batch) * s.heads * s.queries);
  for (int b = 0; b < s.batch; ++b)
    for (int h = 0; h < s.heads; ++h)
      for (int t = 0; t < s.queries; ++t) {
        double sum = 0;
        for (int j = 0; j <= s.begin + t; ++j) {
          double dot = 0;
          for (int d = 0; d < s.headDim; ++d)
            dot += double(q[(size_t(b) * s.queries + t) * s.width() + size_t(h) * s.headDim + d]) *
                   k[(size_t(j) * s.batch + b) * s.width() + size_t(h) * s.headDim + d];
          sum += std::exp(dot / std::sqrt(double(s.headDim)));
        }
        refLse[(size_t(b) * s.heads + h) * s.queries + t] = float(std::log(sum));
      }

  DeviceBuffer gq = upload(q, dt), gk = upload(k, dt), gv = upload(v, dt);
  DeviceBuffer gdOut = upload(dOut, dt), gdk = upload(dk0, DType::F32),
               gdv = upload(dv0, DType::F32);
  DeviceBuffer out = allocate(qSize * sizeOf(dt)), dq = allocate(qSize * sizeOf(dt));
  DeviceBuffer lse = allocate(size_t(s.batch) * s.heads * s.queries * 4);
  // bf16 head dimensions that are multiples of 16 (up to 128) take the tensor-core kernels.
  const bool tensorCores = dt == DType::BF16 && s.headDim % 16 == 0 && s.headDim <= 128;
  const launch::AttentionDims dims{s.batch, s.queries, s.begin, s.heads, s.headDim};
  EXPECT_EQ(
      launch::attentionUsesTensorCores(dt, dims, {out.data(), gq.data(), gk.data(), gv.data()}),
      tensorCores);
  EXPECT_EQ(launch::attentionUsesTensorCores(dt, dims,
                                             {dq.data(), gdk.data(), gdv.data(), gdOut.data(),
                                              out.data(), gq.data(), gk.data(), gv.data()}),
            tensorCores);
  // The forward of these head dimensions runs on Hopper's wgmma where the device has it (the
  // emulated device does); then the mma.sync forward is checked too.
  const bool wgmmaShape = tensorCores && (s.headDim == 64 || s.headDim == 128);
  int major = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0), cudaSuccess);
  const bool wgmma =
      launch::attentionForwardUsesWgmma(dt, dims, {out.data(), gq.data(), gk.data(), gv.data()});
  EXPECT_EQ(wgmma, wgmmaShape && major == 9);
  // The Hopper backward is off by default (it has not run on a GPU yet); switched on, it runs
  // exactly where the forward does (checked below).
  const std::initializer_list<const void *> backwardTensors = {
      dq.data(), gdk.data(), gdv.data(), gdOut.data(), out.data(), gq.data(), gk.data(), gv.data()};
  EXPECT_FALSE(launch::attentionBackwardUsesWgmma(dt, dims, backwardTensors));
  launch::setAttentionWgmmaBackward(true);
  EXPECT_EQ(launch::attentionBackwardUsesWgmma(dt, dims, backwardTensors), wgmma);
  launch::setAttentionWgmmaBackward(false);
  ASSERT_OK(
      attentionForward(*ctx, dt, out.data(), lse.as<float>(), gq.data(), gk.data(), gv.data(), s));
  ASSERT_OK(attentionBackward(*ctx, dt, dq.data(), gdk.as<float>(), gdv.as<float>(), gdOut.data(),
                              out.data(), lse.as<float>(), gq.data(), gk.data(), gv.data(), s));
  EXPECT_CLOSE(download(out, qSize, dt), refOut, tolerance(dt));
  EXPECT_CLOSE(download(lse, refLse.size(), DType::F32), refLse, tolerance(dt));
  if (wgmma) {
    // Every variant of the Hopper forward (the default ran above), then, with the Hopper
    // kernels off, the mma.sync forward and backward (whose dQ is then mma.sync's too), each
    // into fresh buffers.
    for (int variant = 0; variant <= launch::kWgmmaVariants; ++variant) {
      const bool mmaSync = variant == launch::kWgmmaVariants;
      if (mmaSync)
        launch::setAttentionWgmma(false);
      else
        launch::setAttentionWgmmaVariant(variant);
      const std::string name = mmaSync ? "mma.sync" : launch::wgmmaVariantName(variant);
      EXPECT_EQ(launch::attentionForwardUsesWgmma(dt, dims,
                                                  {out.data(), gq.data(), gk.data(), gv.data()}),
                !mmaSync)
          << name;
      DeviceBuffer otherOut = allocate(qSize * sizeOf(dt));
      DeviceBuffer otherLse = allocate(size_t(s.batch) * s.heads * s.queries * 4);
      DeviceBuffer otherDq = allocate(qSize * sizeOf(dt));
      DeviceBuffer otherDk = upload(dk0, DType::F32), otherDv = upload(dv0, DType::F32);
      llvm::Error err = attentionForward(*ctx, dt, otherOut.data(), otherLse.as<float>(), gq.data(),
                                         gk.data(), gv.data(), s);
      if (mmaSync && !err) {
        EXPECT_FALSE(launch::attentionBackwardUsesWgmma(
            dt, dims,
            {otherDq.data(), otherDk.data(), otherDv.data(), gdOut.data(), otherOut.data(),
             gq.data(), gk.data(), gv.data()}));
        err = attentionBackward(*ctx, dt, otherDq.data(), otherDk.as<float>(), otherDv.as<float>(),
                                gdOut.data(), otherOut.data(), otherLse.as<float>(), gq.data(),
                                gk.data(), gv.data(), s);
      }
      launch::setAttentionWgmma(true);
      launch::setAttentionWgmmaVariant(launch::kWgmmaDefault);
      ASSERT_OK(std::move(err));
      SCOPED_TRACE(name);
      EXPECT_CLOSE(download(otherOut, qSize, dt), refOut, tolerance(dt));
      EXPECT_CLOSE(download(otherLse, refLse.size(), DType::F32), refLse, tolerance(dt));
      if (mmaSync) {
        EXPECT_CLOSE(download(otherDq, qSize, dt), refDq, tolerance(dt, /*longSums=*/true));
        EXPECT_CLOSE(download(otherDk, kvSize, DType::F32), refDk,
                     tolerance(dt, /*longSums=*/true));
        EXPECT_CLOSE(download(otherDv, kvSize, DType::F32), refDv,
                     tolerance(dt, /*longSums=*/true));
      }
    }
    // The Hopper backward (dQ, dK and dV), switched on, into fresh buffers.
    SCOPED_TRACE("wgmma backward");
    DeviceBuffer hopperDq = allocate(qSize * sizeOf(dt));
    DeviceBuffer hopperDk = upload(dk0, DType::F32), hopperDv = upload(dv0, DType::F32);
    launch::setAttentionWgmmaBackward(true);
    EXPECT_TRUE(launch::attentionBackwardUsesWgmma(dt, dims,
                                                   {hopperDq.data(), hopperDk.data(),
                                                    hopperDv.data(), gdOut.data(), out.data(),
                                                    gq.data(), gk.data(), gv.data()}));
    llvm::Error err = attentionBackward(*ctx, dt, hopperDq.data(), hopperDk.as<float>(),
                                        hopperDv.as<float>(), gdOut.data(), out.data(),
                                        lse.as<float>(), gq.data(), gk.data(), gv.data(), s);
    launch::setAttentionWgmmaBackward(false);
    ASSERT_OK(std::move(err));
    EXPECT_CLOSE(download(hopperDq, qSize, dt), refDq, tolerance(dt, /*longSums=*/true));
    EXPECT_CLOSE(download(hopperDk, kvSize, DType::F32), refDk, tolerance(dt, /*longSums=*/true));
    EXPECT_CLOSE(download(hopperDv, kvSize, DType::F32), refDv, tolerance(dt, /*longSums=*/true));

    // ... and with dQ added by atomics inside the dK/dV kernel, in fp32 and in fixed point
    // (off by default; only where the Hopper backward runs), into fresh buffers: dq starts as
    // NaN bits, so a row or column the kernel's scaling does not write shows. The fixed-point
    // dQ runs twice (the kernel emulator runs the blocks in a new order each launch): its bits
    // must not change.
    const size_t rows4 = (size_t(s.batch) * s.heads * s.queries + 3) / 4 * 4;
    for (launch::DqMode mode : {launch::DqMode::FloatAtomics, launch::DqMode::FixedPoint}) {
      const bool fixed = mode == launch::DqMode::FixedPoint;
      SCOPED_TRACE(fixed ? "wgmma backward, fixed-point dQ atomics"
                         : "wgmma backward, fp32 dQ atomics");
      Vec firstDq;
      for (int run = 0; run < (fixed ? 2 : 1); ++run) {
        DeviceBuffer fusedDq = upload(Vec(qSize, std::nanf("")), dt);
        DeviceBuffer fusedDk = upload(dk0, DType::F32), fusedDv = upload(dv0, DType::F32);
        const std::initializer_list<const void *> fusedTensors = {
            fusedDq.data(), fusedDk.data(), fusedDv.data(), gdOut.data(),
            out.data(),     gq.data(),      gk.data(),      gv.data()};
        launch::setAttentionDqMode(mode);
        EXPECT_EQ(launch::attentionBackwardDqMode(dt, dims, fusedTensors), launch::DqMode::Separate)
            << "dQ atomics without the Hopper backward";
        launch::setAttentionWgmmaBackward(true);
        EXPECT_EQ(launch::attentionBackwardDqMode(dt, dims, fusedTensors), mode);
        EXPECT_EQ(launch::attentionBackwardScratchFloats(mode, dims),
                  fixed ? 4 * rows4 + (2 * size_t(s.batch) * s.heads + 3) / 4 * 4 + 2 * qSize
                        : rows4 + qSize);
        err = attentionBackward(*ctx, dt, fusedDq.data(), fusedDk.as<float>(), fusedDv.as<float>(),
                                gdOut.data(), out.data(), lse.as<float>(), gq.data(), gk.data(),
                                gv.data(), s);
        launch::setAttentionWgmmaBackward(false);
        launch::setAttentionDqMode(launch::DqMode::Separate);
        ASSERT_OK(std::move(err));
        const Vec gotDq = download(fusedDq, qSize, dt);
        EXPECT_CLOSE(gotDq, refDq, tolerance(dt, /*longSums=*/true));
        EXPECT_CLOSE(download(fusedDk, kvSize, DType::F32), refDk,
                     tolerance(dt, /*longSums=*/true));
        EXPECT_CLOSE(download(fusedDv, kvSize, DType::F32), refDv,
                     tolerance(dt, /*longSums=*/true));
        if (run == 0) {
          firstDq = gotDq;
        } else {
          auto [mine, theirs] = std::mismatch(gotDq.begin(), gotDq.end(), firstDq.begin());
          EXPECT_TRUE(mine == gotDq.end())
              << "fixed-point dQ element " << (mine - gotDq.begin()) << " is " << *mine
              << " in the second launch and " << *theirs << " in the first";
        }
      }
    }
  }
  EXPECT_EQ(launch::attentionBackwardDqMode(dt, dims, backwardTensors), launch::DqMode::Separate);
  EXPECT_EQ(launch::attentionBackwardScratchFloats(launch::DqMode::Separate, dims),
            size_t(s.batch) * s.heads * s.queries);
  EXPECT_CLOSE(download(dq, qSize, dt), refDq, tolerance(dt, /*longSums=*/true));
  EXPECT_CLOSE(download(gdk, kvSize, DType::F32), refDk, tolerance(dt, /*longSums=*/true));
  EXPECT_CLOSE(download(gdv, kvSize, DType::F32), refDv, tolerance(dt, /*longSums=*/true));
}

/// The backward a case runs: the default one, the Hopper one, or the Hopper one with fp32 or
/// fixed-point dQ atomics.
enum BackwardKind : int { kDefaultBackward, kHopperBackward, kHopperDqFloat, kHopperDqFixed };

/// Switches the Hopper attention backward (and a dQ mode) on for a scope (off again at its end).
struct HopperBackwardOn {
  explicit HopperBackwardOn(int kind) {
    launch::setAttentionWgmmaBackward(kind != kDefaultBackward);
    launch::setAttentionDqMode(kind == kHopperDqFloat   ? launch::DqMode::FloatAtomics
                               : kind == kHopperDqFixed ? launch::DqMode::FixedPoint
                                                        : launch::DqMode::Separate);
  }
  ~HopperBackwardOn() {
    launch::setAttentionWgmmaBackward(false);
    launch::setAttentionDqMode(launch::DqMode::Separate);
  }
};

// The fixed-point dQ scales each row by a bound of its own (Attention.cu, fixedPointExponent):
// dOut scaled by 2^-90 and 2^90 (exact in bf16) must scale dQ alike, with the same relative
// error as at 1; a NaN in one row of dOut must make that row of dQ NaN (as the other modes do)
// and leave the others alone. Only where the Hopper backward runs (the kernel emulator too).
class CudaFixedPointDqTest : public GpuTest, public ::testing::WithParamInterface<int> {
protected:
  /// attentionBackward in the fixed-point mode, which it must run for these tensors.
  llvm::Error fixedPointBackward(const DeviceBuffer &dq, const DeviceBuffer &dk,
                                 const DeviceBuffer &dv, const DeviceBuffer &dOut,
                                 const DeviceBuffer &out, const DeviceBuffer &lse,
                                 const DeviceBuffer &q, const DeviceBuffer &k,
                                 const DeviceBuffer &v) {
    const HopperBackwardOn fixedPoint(kHopperDqFixed);
    EXPECT_EQ(launch::attentionBackwardDqMode(dt, dims,
                                              {dq.data(), dk.data(), dv.data(), dOut.data(),
                                               out.data(), q.data(), k.data(), v.data()}),
              launch::DqMode::FixedPoint);
    return attentionBackward(*ctx, dt, dq.data(), dk.as<float>(), dv.as<float>(), dOut.data(),
                             out.data(), lse.as<float>(), q.data(), k.data(), v.data(), s);
  }

  /// The CPU reference's dQ.
  Vec referenceDq(const Vec &q, const Vec &k, const Vec &v, const Vec &dOut) const {
    Vec out(qSize), probs(size_t(s.batch) * s.heads * s.queries * s.keys());
    Vec dq(qSize), dk(kvSize, 0.0f), dv(kvSize, 0.0f);
    cpu::attentionForward(out.data(), probs.data(), q.data(), k.data(), v.data(), cs);
    cpu::attentionBackward(dq.data(), dk.data(), dv.data(), dOut.data(), probs.data(), q.data(),
                           k.data(), v.data(), cs);
    return dq;
  }

  const DType dt = DType::BF16;
  // Two 64-query tiles over two 128-key blocks, the second tile partly past the slice.
  const AttentionShape s{/*batch=*/1, /*queries=*/100, /*begin=*/70, /*heads=*/2, GetParam()};
  const launch::AttentionDims dims{s.batch, s.queries, s.begin, s.heads, s.headDim};
  const cpu::AttentionShape cs{s.batch, s.queries, s.begin, s.heads, s.headDim};
  const size_t qSize = size_t(s.batch) * s.queries * s.width();
  const size_t kvSize = size_t(s.keys()) * s.batch * s.width();
};

TEST_P(CudaFixedPointDqTest, RowsKeepTheirPrecisionAtEveryScaleAndNanStaysInItsRow) {
  Vec q = quantized(randomVec(qSize, 70), dt), k = quantized(randomVec(kvSize, 71), dt);
  Vec v = quantized(randomVec(kvSize, 72), dt), dOut = quantized(randomVec(qSize, 73), dt);
  const Vec refDq = referenceDq(q, k, v, dOut);
  DeviceBuffer gq = upload(q, dt), gk = upload(k, dt), gv = upload(v, dt);
  DeviceBuffer out = allocate(qSize * sizeOf(dt));
  DeviceBuffer lse = allocate(size_t(s.batch) * s.heads * s.queries * 4);
  if (!launch::attentionForwardUsesWgmma(dt, dims, {out.data(), gq.data(), gk.data(), gv.data()}))
    GTEST_SKIP() << "the Hopper attention kernels do not run here";
  ASSERT_OK(
      attentionForward(*ctx, dt, out.data(), lse.as<float>(), gq.data(), gk.data(), gv.data(), s));
  // dQ of dOut x `scale`, with dOut's element `nanAt` made NaN (none if past the end).
  auto dqOf = [&](float scale, size_t nanAt) {
    Vec scaled = dOut;
    for (float &x : scaled)
      x *= scale;
    if (nanAt < scaled.size())
      scaled[nanAt] = std::nanf("");
    DeviceBuffer gdOut = upload(scaled, dt), dq = allocate(qSize * sizeOf(dt));
    DeviceBuffer dk = upload(Vec(kvSize, 0.0f), DType::F32);
    DeviceBuffer dv = upload(Vec(kvSize, 0.0f), DType::F32);
    llvm::Error err = fixedPointBackward(dq, dk, dv, gdOut, out, lse, gq, gk, gv);
    EXPECT_FALSE(bool(err)) << llvm::toString(std::move(err));
    return download(dq, qSize, dt);
  };
  for (float scale : {0x1p-90f, 1.0f, 0x1p90f}) {
    SCOPED_TRACE("dOut x " + std::to_string(scale));
    Vec want = refDq;
    for (float &x : want)
      x *= scale;
    EXPECT_CLOSE(dqOf(scale, qSize), want, tolerance(dt, /*longSums=*/true));
  }
  // A NaN in query 37's row of head 1: that row of that head is NaN, everything else finite.
  const int nanQuery = 37, nanHead = 1;
  const size_t rowStart = size_t(nanQuery) * s.width() + size_t(nanHead) * s.headDim;
  const Vec withNan = dqOf(1.0f, rowStart + 5);
  size_t nans = 0, wrongNans = 0;
  for (size_t i = 0; i < qSize; ++i) {
    const bool inRow = i >= rowStart && i < rowStart + size_t(s.headDim);
    if (std::isnan(withNan[i]))
      ++nans;
    if (std::isnan(withNan[i]) != inRow)
      ++wrongNans;
  }
  EXPECT_EQ(wrongNans, 0u) << nans << " NaN elements; the row has " << s.headDim;
}

// A NaN that the fixed point's bound does not see still reaches dQ. One in Q reaches its row's
// D (through O); one in K the D of the rows that read it; one in lse (the forward's, handed
// back wrong) only the row's product, which the row's flag catches. As in the other modes, the
// rows that read the NaN are NaN and another head's rows are finite. (Rows of the same head
// that do not read a bad key may be NaN too, in every mode: their masked zeros of dS meet the
// NaN in the tile's product with K.)
TEST_P(CudaFixedPointDqTest, ANanInQKOrLseReachesTheRowsThatReadIt) {
  const size_t lseSize = size_t(s.heads) * s.queries;
  const Vec q = quantized(randomVec(qSize, 80), dt), k = quantized(randomVec(kvSize, 81), dt);
  const Vec v = quantized(randomVec(kvSize, 82), dt), dOut = quantized(randomVec(qSize, 83), dt);
  // dQ of these Q and K, with lse entry `nanLse` (B, H, x) made NaN after the forward (none if
  // past the end).
  auto dqOf = [&](const Vec &qIn, const Vec &kIn, size_t nanLse) {
    DeviceBuffer gq = upload(qIn, dt), gk = upload(kIn, dt), gv = upload(v, dt);
    DeviceBuffer gdOut = upload(dOut, dt), out = allocate(qSize * sizeOf(dt));
    DeviceBuffer dq = allocate(qSize * sizeOf(dt)), lse = allocate(lseSize * 4);
    DeviceBuffer dk = upload(Vec(kvSize, 0.0f), DType::F32);
    DeviceBuffer dv = upload(Vec(kvSize, 0.0f), DType::F32);
    EXPECT_FALSE(bool(attentionForward(*ctx, dt, out.data(), lse.as<float>(), gq.data(), gk.data(),
                                       gv.data(), s)));
    if (nanLse < lseSize) {
      Vec stats = download(lse, lseSize, DType::F32);
      stats[nanLse] = std::nanf("");
      lse = upload(stats, DType::F32);
    }
    llvm::Error err = fixedPointBackward(dq, dk, dv, gdOut, out, lse, gq, gk, gv);
    EXPECT_FALSE(bool(err)) << llvm::toString(std::move(err));
    return download(dq, qSize, dt);
  };
  {
    const auto gq = upload(q, dt), gk = upload(k, dt), gv = upload(v, dt);
    if (!launch::attentionForwardUsesWgmma(dt, dims, {gq.data(), gk.data(), gv.data()}))
      GTEST_SKIP() << "the Hopper attention kernels do not run here";
  }
  auto isNan = [&](const Vec &dq, int t, int h) { // every element of the row, or none
    size_t nans = 0;
    for (int d = 0; d < s.headDim; ++d)
      nans += std::isnan(dq[size_t(t) * s.width() + size_t(h) * s.headDim + d]) ? 1 : 0;
    EXPECT_TRUE(nans == 0 || nans == size_t(s.headDim)) << "row " << t << " head " << h;
    return nans > 0;
  };
  // Query 37 of head 0, in Q and then in lse.
  Vec badQ = q;
  badQ[37 * size_t(s.width()) + 3] = std::nanf("");
  const Vec fromQ = dqOf(badQ, k, lseSize);
  const Vec fromLse = dqOf(q, k, /*(b 0, h 0, t 37)*/ 37);
  for (int h = 0; h < s.heads; ++h)
    for (int t = 0; t < s.queries; ++t) {
      EXPECT_EQ(isNan(fromQ, t, h), h == 0 && t == 37) << "NaN in Q: row " << t << " head " << h;
      EXPECT_EQ(isNan(fromLse, t, h), h == 0 && t == 37)
          << "NaN in lse: row " << t << " head " << h;
    }
  // Key 80 of head 1: queries from 80 - begin = 10 on read it.
  Vec badK = k;
  badK[80 * size_t(s.width()) + size_t(s.headDim) + 7] = std::nanf("");
  const Vec fromK = dqOf(q, badK, lseSize);
  for (int t = 0; t < s.queries; ++t) {
    EXPECT_FALSE(isNan(fromK, t, 0)) << "NaN in head 1's K: row " << t << " of head 0";
    if (t >= 80 - s.begin) {
      EXPECT_TRUE(isNan(fromK, t, 1)) << "NaN in K: row " << t << " of head 1";
    }
  }
}

// Inputs whose dQ reaches the bound the fixed point is scaled by (up to its 17/16): Q = 0 (a
// uniform softmax), K_j = V_j = s_j (1, ..., 1) with s_j = +-1 by key, dO = (1, ..., 1). Then
// dP_tj = hd s_j, D_t = hd m_t (m_t the mean of s over the keys query t sees) and every element
// of dQ' is hd (1 - m_t^2), against a bound of hd (1 + |m_t|): with kFixedBits at 64 instead of
// 59 (no headroom left over the bound's rounding up to a power of two) this test fails.
TEST_P(CudaFixedPointDqTest, ARowAtItsBoundDoesNotOverflow) {
  Vec q(qSize, 0.0f), k(kvSize), v(kvSize), dOut(qSize, 1.0f);
  for (size_t i = 0; i < kvSize; ++i)
    k[i] = v[i] = (i / size_t(s.width())) % 2 ? -1.0f : 1.0f; // (batch 1: row i / width is key j)
  const Vec refDq = referenceDq(q, k, v, dOut);
  DeviceBuffer gq = upload(q, dt), gk = upload(k, dt), gv = upload(v, dt);
  DeviceBuffer gdOut = upload(dOut, dt), out = allocate(qSize * sizeOf(dt));
  DeviceBuffer dq = allocate(qSize * sizeOf(dt)), lse = allocate(size_t(s.heads) * s.queries * 4);
  DeviceBuffer dk = upload(Vec(kvSize, 0.0f), DType::F32);
  DeviceBuffer dv = upload(Vec(kvSize, 0.0f), DType::F32);
  if (!launch::attentionForwardUsesWgmma(dt, dims, {out.data(), gq.data(), gk.data(), gv.data()}))
    GTEST_SKIP() << "the Hopper attention kernels do not run here";
  ASSERT_OK(
      attentionForward(*ctx, dt, out.data(), lse.as<float>(), gq.data(), gk.data(), gv.data(), s));
  ASSERT_OK(fixedPointBackward(dq, dk, dv, gdOut, out, lse, gq, gk, gv));
  // (The reference's dQ is hd (1 - m^2) / sqrt(hd) per element, so far from 0.)
  EXPECT_GT(*std::max_element(refDq.begin(), refDq.end()), 0.5f * std::sqrt(float(s.headDim)));
  EXPECT_CLOSE(download(dq, qSize, dt), refDq, tolerance(dt, /*longSums=*/true));
}

INSTANTIATE_TEST_SUITE_P(HeadDims, CudaFixedPointDqTest, ::testing::Values(64, 128),
                         [](const ::testing::TestParamInfo<int> &info) {
                           return "hd" + std::to_string(info.param);
                         });

// Seq1F1B's attention over a whole sequence, slice by slice as the runtime runs it: each slice's
// forward over the keys so far, then the backwards in reverse order, every one adding to the same
// dK/dV. Held against
//   - the CPU reference of the unsliced sequence (one causal attention over all T tokens): the
//     slices' dQ and the accumulated dK/dV must be its gradients;
//   - the same kernel run for each slice alone into zeroed buffers, summed on the host in double:
//     the accumulated dK/dV must be that sum to fp32 rounding (1e-6 of the largest entry). A dK/dV
//     stored in bf16 between slices is rounded once per slice (3-4e-3) and fails this.
// With the third parameter (BackwardKind), the backwards run on the Hopper kernels (switched
// on), with or without dQ atomics.
class CudaAttentionSlicesTest : public GpuTest,
                                public ::testing::WithParamInterface<std::tuple<DType, int, int>> {
};

TEST_P(CudaAttentionSlicesTest, SlicesAccumulateKeyGradientsOfTheWholeSequence) {
  const HopperBackwardOn hopperBackward(std::get<2>(GetParam()));
  const DType dt = std::get<0>(GetParam());
  const int hd = std::get<1>(GetParam());
  const int heads = 2, slices = 4, x = 24, tokens = slices * x; // batch 1: slices are row ranges
  const int width = heads * hd;
  const size_t rowsSize = size_t(tokens) * width, sliceSize = size_t(x) * width;
  Vec q = quantized(randomVec(rowsSize, 60), dt), k = quantized(randomVec(rowsSize, 61), dt);
  Vec v = quantized(randomVec(rowsSize, 62), dt), dOut = quantized(randomVec(rowsSize, 63), dt);

  const cpu::AttentionShape whole{1, tokens, 0, heads, hd};
  Vec refOut(rowsSize), probs(size_t(heads) * tokens * tokens), refDq(rowsSize);
  Vec refDk(rowsSize, 0.0f), refDv(rowsSize, 0.0f);
  cpu::attentionForward(refOut.data(), probs.data(), q.data(), k.data(), v.data(), whole);
  cpu::attentionBackward(refDq.data(), refDk.data(), refDv.data(), dOut.data(), probs.data(),
                         q.data(), k.data(), v.data(), whole);

  DeviceBuffer gq = upload(q, dt), gk = upload(k, dt), gv = upload(v, dt), gdOut = upload(dOut, dt);
  DeviceBuffer out = allocate(rowsSize * sizeOf(dt)), dq = allocate(rowsSize * sizeOf(dt));
  DeviceBuffer lse = allocate(size_t(slices) * heads * x * 4);
  const Vec zeros(rowsSize, 0.0f);
  DeviceBuffer dk = upload(zeros, DType::F32), dv = upload(zeros, DType::F32);
  auto at = [&](const DeviceBuffer &b, size_t elements, DType type) {
    return static_cast<char *>(b.data()) + elements * sizeOf(type);
  };
  auto shapeOf = [&](int slice) { return AttentionShape{1, x, slice * x, heads, hd}; };
  auto backward = [&](int slice, float *dkInto, float *dvInto) {
    const size_t rows = size_t(slice) * sliceSize;
    return attentionBackward(*ctx, dt, at(dq, rows, dt), dkInto, dvInto, at(gdOut, rows, dt),
                             at(out, rows, dt), lse.as<float>() + size_t(slice) * heads * x,
                             at(gq, rows, dt), gk.data(), gv.data(), shapeOf(slice));
  };
  const bool tensorCores = dt == DType::BF16 && hd % 16 == 0;
  for (int slice = 0; slice < slices; ++slice) {
    const size_t rows = size_t(slice) * sliceSize;
    const launch::AttentionDims dims{1, x, slice * x, heads, hd};
    EXPECT_EQ(launch::attentionUsesTensorCores(dt, dims,
                                               {at(dq, rows, dt), dk.data(), dv.data(),
                                                at(gdOut, rows, dt), at(out, rows, dt),
                                                at(gq, rows, dt), gk.data(), gv.data()}),
              tensorCores)
        << "slice " << slice;
    ASSERT_OK(attentionForward(*ctx, dt, at(out, rows, dt),
                               lse.as<float>() + size_t(slice) * heads * x, at(gq, rows, dt),
                               gk.data(), gv.data(), shapeOf(slice)));
  }
  for (int slice = slices - 1; slice >= 0; --slice)
    ASSERT_OK(backward(slice, dk.as<float>(), dv.as<float>()));
  const Vec gotDk = download(dk, rowsSize, DType::F32), gotDv = download(dv, rowsSize, DType::F32);
  EXPECT_CLOSE(download(out, rowsSize, dt), refOut, tolerance(dt));
  EXPECT_CLOSE(download(dq, rowsSize, dt), refDq, tolerance(dt, /*longSums=*/true));
  EXPECT_CLOSE(gotDk, refDk, tolerance(dt, /*longSums=*/true));
  EXPECT_CLOSE(gotDv, refDv, tolerance(dt, /*longSums=*/true));

  std::vector<double> sumDk(rowsSize, 0.0), sumDv(rowsSize, 0.0);
  for (int slice = slices - 1; slice >= 0; --slice) {
    DeviceBuffer oneDk = upload(zeros, DType::F32), oneDv = upload(zeros, DType::F32);
    ASSERT_OK(backward(slice, oneDk.as<float>(), oneDv.as<float>()));
    const Vec a = download(oneDk, rowsSize, DType::F32), b = download(oneDv, rowsSize, DType::F32);
    for (size_t i = 0; i < rowsSize; ++i) {
      sumDk[i] += a[i];
      sumDv[i] += b[i];
    }
  }
  EXPECT_CLOSE(gotDk, Vec(sumDk.begin(), sumDk.end()), 1e-6);
  EXPECT_CLOSE(gotDv, Vec(sumDv.begin(), sumDv.end()), 1e-6);
}

const AttentionCase kAttentionCases[] = {
    {{/*batch=*/2, /*queries=*/40, /*begin=*/0, /*heads=*/3, /*headDim=*/64}, "FirstSlice"},
    {{/*batch=*/2, /*queries=*/24, /*begin=*/40, /*heads=*/3, /*headDim=*/64}, "LaterSlice"},
    {{/*batch=*/1, /*queries=*/13, /*begin=*/29, /*heads=*/2, /*headDim=*/48}, "OddHeadDim"},
    {{/*batch=*/1, /*queries=*/9, /*begin=*/70, /*heads=*/1, /*headDim=*/256}, "WidestHead"},
    // Two 64-query blocks (the second one partly past the slice) over three 64-key tiles.
    {{/*batch=*/1, /*queries=*/100, /*begin=*/70, /*heads=*/2, /*headDim=*/128}, "ManyTiles"},
    {{/*batch=*/2, /*queries=*/8, /*begin=*/0, /*heads=*/4, /*headDim=*/4}, "CpuTinyConfig"},
    // The smallest and an odd multiple of 16: other instantiations of the tensor-core kernels.
    {{/*batch=*/2, /*queries=*/20, /*begin=*/50, /*heads=*/2, /*headDim=*/16}, "HeadDim16"},
    {{/*batch=*/1, /*queries=*/70, /*begin=*/0, /*heads=*/1, /*headDim=*/80}, "HeadDim80"},
    // Four 64-query tiles stream past the first key blocks: every kernel refills both of its
    // double buffers (the dK/dV kernel's query tiles included).
    {{/*batch=*/1, /*queries=*/200, /*begin=*/30, /*heads=*/2, /*headDim=*/64}, "RefilledBuffers"},
    // The Hopper forward's 128-query blocks: three, the last one's second warpgroup wholly past
    // the slice, its first partly; key tiles that start mid-block (begin 37).
    {{/*batch=*/1, /*queries=*/300, /*begin=*/37, /*heads=*/2, /*headDim=*/128},
     "ThreeQueryBlocks"},
    {{/*batch=*/2, /*queries=*/70, /*begin=*/130, /*heads=*/2, /*headDim=*/32}, "HeadDim32"},
};

//===--- Cross entropy, AdamW, conversion -------------------------------===//

class CudaLossTest : public GpuTest, public ::testing::WithParamInterface<DType> {};

TEST_P(CudaLossTest, CrossEntropyMatchesCpuAndWorksInPlace) {
  const DType dt = GetParam();
  const int n = 19, v = 1000;
  const float scale = 1.0f / n;
  Vec logits = quantized(randomVec(size_t(n) * v, 50, -5.0f, 5.0f), dt);
  std::vector<int32_t> targets(n);
  for (int r = 0; r < n; ++r)
    targets[r] = (r * 331 + 7) % v;
  Vec probs(logits.size()), refDLogits(logits.size());
  double refLoss =
      cpu::crossEntropyForward(probs.data(), logits.data(), targets.data(), n, v, scale);
  cpu::crossEntropyBackward(refDLogits.data(), probs.data(), targets.data(), n, v, scale);

  DeviceBuffer gLogits = upload(logits, dt), gTargets = uploadInts(targets);
  DeviceBuffer rowLoss = allocate(n * 4), lse = allocate(n * 4);
  DeviceBuffer dLogits = allocate(logits.size() * sizeOf(dt));
  ASSERT_OK(crossEntropyForward(*ctx, dt, rowLoss.as<float>(), lse.as<float>(), gLogits.data(),
                                gTargets.as<int32_t>(), n, v, scale));
  ASSERT_OK(crossEntropyBackward(*ctx, dt, dLogits.data(), gLogits.data(), lse.as<float>(),
                                 gTargets.as<int32_t>(), n, v, scale));
  Vec losses = download(rowLoss, n, DType::F32);
  double loss = std::accumulate(losses.begin(), losses.end(), 0.0);
  EXPECT_NEAR(loss, refLoss, 1e-5 * std::fabs(refLoss)); // logits are exact in both dtypes
  EXPECT_CLOSE(download(dLogits, logits.size(), dt), refDLogits, tolerance(dt));
  // In place: the LM head's logits buffer becomes its gradient.
  ASSERT_OK(crossEntropyBackward(*ctx, dt, gLogits.data(), gLogits.data(), lse.as<float>(),
                                 gTargets.as<int32_t>(), n, v, scale));
  EXPECT_CLOSE(download(gLogits, logits.size(), dt), refDLogits, tolerance(dt));
}

TEST_P(CudaLossTest, VocabParallelCrossEntropyMatchesTheWholeVocabularyOnCpu) {
  // Four shards of 250 columns (tp 4): each shard's statistics, summed as the tp all-reduce
  // sums them, give the whole vocabulary's loss, and each shard's gradient is its columns of
  // the CPU's whole-vocabulary gradient. Row 3's mass sits in shard 2.
  const DType dt = GetParam();
  const int n = 19, v = 1000, parts = 4, vl = v / parts;
  const float scale = 1.0f / n;
  Vec logits = randomVec(size_t(n) * v, 51, -5.0f, 5.0f);
  for (int c = 2 * vl; c < 3 * vl; ++c)
    logits[size_t(3) * v + c] += 40.0f;
  logits = quantized(logits, dt);
  std::vector<int32_t> targets(n);
  for (int r = 0; r < n; ++r)
    targets[r] = (r * 331 + 7) % v;
  Vec probs(logits.size()), refDLogits(logits.size());
  const double refLoss =
      cpu::crossEntropyForward(probs.data(), logits.data(), targets.data(), n, v, scale);
  cpu::crossEntropyBackward(refDLogits.data(), probs.data(), targets.data(), n, v, scale);

  const size_t statsFloats = cpu::crossEntropyStatsFloats(n, parts);
  std::vector<Vec> shards(parts);
  Vec summed(statsFloats, 0.0f);
  DeviceBuffer gTargets = uploadInts(targets), stats = allocate(statsFloats * 4);
  for (int p = 0; p < parts; ++p) {
    for (int r = 0; r < n; ++r)
      shards[p].insert(shards[p].end(), logits.begin() + r * v + p * vl,
                       logits.begin() + r * v + (p + 1) * vl);
    DeviceBuffer gShard = upload(shards[p], dt);
    ASSERT_OK(crossEntropyShardStats(*ctx, dt, stats.as<float>(), gShard.data(),
                                     gTargets.as<int32_t>(), n, vl, p * vl, p, parts));
    const Vec got = download(stats, statsFloats, DType::F32);
    for (size_t k = 0; k < statsFloats; ++k)
      summed[k] += got[k];
  }
  DeviceBuffer gSummed = upload(summed, DType::F32);
  DeviceBuffer rowLoss = allocate(n * 4), lse = allocate(n * 4);
  ASSERT_OK(crossEntropyCombine(*ctx, rowLoss.as<float>(), lse.as<float>(), gSummed.as<float>(), n,
                                parts, scale));
  const Vec losses = download(rowLoss, n, DType::F32);
  EXPECT_NEAR(std::accumulate(losses.begin(), losses.end(), 0.0), refLoss,
              1e-5 * std::fabs(refLoss));
  for (int p = 0; p < parts; ++p) {
    DeviceBuffer gShard = upload(shards[p], dt);
    ASSERT_OK(crossEntropyBackward(*ctx, dt, gShard.data(), gShard.data(), lse.as<float>(),
                                   gTargets.as<int32_t>(), n, vl, scale, p * vl));
    Vec want;
    for (int r = 0; r < n; ++r)
      want.insert(want.end(), refDLogits.begin() + r * v + p * vl,
                  refDLogits.begin() + r * v + (p + 1) * vl);
    EXPECT_CLOSE(download(gShard, want.size(), dt), want, tolerance(dt));
  }
}

TEST_P(CudaLossTest, ConvertRoundsToNearestEvenBothWays) {
  const DType dt = GetParam();
  const size_t n = 777;
  Vec x = randomVec(n, 60, -100.0f, 100.0f);
  DeviceBuffer src = upload(x, DType::F32), mid = allocate(n * sizeOf(dt)), back = allocate(n * 4);
  ASSERT_OK(convert(*ctx, dt, mid.data(), DType::F32, src.data(), n));
  ASSERT_OK(convert(*ctx, DType::F32, back.data(), dt, mid.data(), n));
  EXPECT_EQ(download(back, n, DType::F32), quantized(x, dt)); // exact: same rounding as the host
}

TEST_P(CudaLossTest, RowBiasAddsToEveryRowOfAStridedMatrix) {
  // The matmuls' fallback for a bias the cuBLASLt epilogue cannot take (kernels/cuda/CudaOps.cpp).
  const DType dt = GetParam();
  const int n = 37, o = 45, ld = 50;
  Vec out = quantized(randomVec(size_t(n) * ld, 61), dt), bias = quantized(randomVec(o, 62), dt);
  Vec ref = out;
  for (int r = 0; r < n; ++r)
    for (int c = 0; c < o; ++c)
      ref[size_t(r) * ld + c] += bias[size_t(c)]; // columns past o stay as they are
  ref = quantized(ref, dt);
  DeviceBuffer dOut = upload(out, dt), dBias = upload(bias, dt);
  ASSERT_EQ(launch::addRowBias(dt, dOut.data(), dBias.data(), n, o, ld,
                               static_cast<cudaStream_t>(ctx->stream())),
            cudaSuccess);
  EXPECT_EQ(download(dOut, ref.size(), dt), ref); // one rounding, as the host's
}

TEST_P(CudaLossTest, ColumnSumMatchesCpuWithTheSameBitsEveryLaunch) {
  // The bias gradient of matmulBackwardWeight (row-parallel biases are held whole by every tp
  // rank, so their gradients must not depend on the order the blocks run in; see
  // WeightGradientHasTheSameBitsEveryLaunch).
  const DType dt = GetParam();
  const int n = 301, o = 45;
  Vec dOut = quantized(randomVec(size_t(n) * o, 63), dt), start = randomVec(o, 64);
  Vec ref = start;
  for (int r = 0; r < n; ++r)
    for (int c = 0; c < o; ++c)
      ref[size_t(c)] += dOut[size_t(r) * o + c];
  DeviceBuffer gdOut = upload(dOut, dt);
  const size_t scratch = launch::columnSumScratchFloats(n, o, 1);
  ASSERT_EQ(scratch, 2u * o) << "301 rows are two chunks";
  DeviceBuffer partials = allocate(scratch * 4);
  const auto stream = static_cast<cudaStream_t>(ctx->stream());
  EXPECT_EQ(
      launch::columnSumAccumulate(dt, partials.as<float>(), gdOut.data(), n, o, nullptr, stream),
      cudaErrorInvalidValue)
      << "two chunks and no scratch";
  Vec first;
  for (int run = 0; run < 4; ++run) {
    DeviceBuffer gBias = upload(start, DType::F32);
    ASSERT_EQ(launch::columnSumAccumulate(dt, gBias.as<float>(), gdOut.data(), n, o,
                                          partials.as<float>(), stream),
              cudaSuccess);
    Vec sums = download(gBias, o, DType::F32);
    EXPECT_CLOSE(sums, ref, kTolF32Long);
    if (run == 0)
      first = sums;
    else
      EXPECT_EQ(sums, first) << "launch " << run << " summed in another order";
  }
}

TEST_F(GpuTest, AdamMatchesCpuOverThreeSteps) {
  const size_t n = 1000;
  Vec params = randomVec(n, 70), m(n, 0.0f), v(n, 0.0f);
  Vec refParams = params, refM = m, refV = v;
  DeviceBuffer gp = upload(params, DType::F32), gm = upload(m, DType::F32);
  DeviceBuffer gv = upload(v, DType::F32), gg = allocate(n * 4);
  for (int step = 1; step <= 3; ++step) {
    Vec grads = randomVec(n, 71 + step);
    cpu::adamUpdate(refParams.data(), grads.data(), refM.data(), refV.data(), n, /*lr=*/1e-3f,
                    /*beta1=*/0.9f, /*beta2=*/0.95f, /*eps=*/1e-8f, /*weightDecay=*/0.1f, step);
    check(ctx->upload(gg.data(), grads.data(), n * 4));
    ASSERT_OK(adamUpdate(*ctx, gp.as<float>(), gg.as<float>(), gm.as<float>(), gv.as<float>(), n,
                         1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, step));
  }
  EXPECT_CLOSE(download(gp, n, DType::F32), refParams, kTolF32);
  EXPECT_CLOSE(download(gm, n, DType::F32), refM, kTolF32);
  EXPECT_CLOSE(download(gv, n, DType::F32), refV, kTolF32);
}

TEST_F(GpuTest, BadShapesAreErrorsNamingTheArgument) {
  AttentionShape wide{1, 4, 0, 1, /*headDim=*/300};
  llvm::Error err =
      attentionForward(*ctx, DType::F32, nullptr, nullptr, nullptr, nullptr, nullptr, wide);
  ASSERT_TRUE(bool(err));
  EXPECT_NE(llvm::toString(std::move(err)).find("headDim 300"), std::string::npos);
  llvm::Error step = adamUpdate(*ctx, nullptr, nullptr, nullptr, nullptr, 0, 1e-3f, 0.9f, 0.95f,
                                1e-8f, 0.0f, /*step=*/0);
  ASSERT_TRUE(bool(step));
  EXPECT_NE(llvm::toString(std::move(step)).find("step counts from 1"), std::string::npos);
  llvm::Error shard = crossEntropyShardStats(*ctx, DType::F32, nullptr, nullptr, nullptr, 1, 8,
                                             /*vocabBegin=*/32, /*part=*/4, /*parts=*/4);
  ASSERT_TRUE(bool(shard));
  EXPECT_NE(llvm::toString(std::move(shard)).find("shard 4 of 4 is out of range"),
            std::string::npos);
}

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

TEST_F(GpuTest, InTheSizingPassOpsTakeTheirScratchAndQueueNothing) {
  // Every op with every pointer pointing nowhere: had one queued its kernel, copy or GEMM, the
  // kernel emulator (which runs kernels on the host) would crash and a GPU would report an
  // illegal address (sticky: the checks after the pass would fail too).
  RecordingAllocator recording;
  ctx->setAllocator(&recording);
  ctx->setSizing(true);
  void *p = reinterpret_cast<void *>(RecordingAllocator::kNowhere);
  float *f = static_cast<float *>(p);
  const auto *tokens = static_cast<const int32_t *>(p);
  const int n = 600, c = 64; // more rows than launch::kColumnSumChunkRows: the sums need scratch
  const AttentionShape shape{2, 24, 8, 2, 32};
  for (DType dt : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(toString(dt));
    recording.requests.clear();
    ASSERT_OK(matmulForward(*ctx, dt, p, p, p, p, n, c, c));
    ASSERT_OK(matmulBackwardInput(*ctx, dt, p, p, p, n, c, c));
    ASSERT_OK(matmulBackwardWeight(*ctx, dt, f, f, p, p, n, c, c));
    ASSERT_OK(matmulTForward(*ctx, dt, p, p, p, n, c, c));
    ASSERT_OK(matmulTBackwardInput(*ctx, dt, p, p, p, n, c, c));
    ASSERT_OK(matmulTBackwardWeight(*ctx, dt, f, p, p, n, c, c));
    const size_t afterMatmuls = recording.requests.size();
    ASSERT_OK(layernormForward(*ctx, dt, p, f, f, p, p, p, n, c));
    ASSERT_OK(layernormBackwardInputAccumulate(*ctx, dt, p, p, p, f, f, p, n, c));
    ASSERT_OK(layernormBackwardWeight(*ctx, dt, f, f, p, p, f, f, n, c));
    ASSERT_OK(geluForward(*ctx, dt, p, p, size_t(n) * c));
    ASSERT_OK(geluBackward(*ctx, dt, p, p, p, size_t(n) * c));
    ASSERT_OK(attentionForward(*ctx, dt, p, f, p, p, p, shape));
    ASSERT_OK(attentionBackward(*ctx, dt, p, f, f, p, p, f, p, p, p, shape));
    ASSERT_OK(crossEntropyForward(*ctx, dt, f, f, p, tokens, n, c, 1.0f));
    ASSERT_OK(crossEntropyBackward(*ctx, dt, p, p, f, tokens, n, c, 1.0f));
    ASSERT_OK(convert(*ctx, dt, p, DType::F32, p, size_t(n)));
    ASSERT_OK(adamUpdate(*ctx, f, f, f, f, size_t(n), 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 1));
    // The hand-written kernels' scratch, as a step takes it: the layernorm weight gradient's
    // column-sum partials (two sums) and the attention backward's row dots. (The matmuls' bias
    // sums take scratch on a GPU too; the emulated device's matmuls compute on the host.)
    const std::vector<size_t> kernelScratch(recording.requests.begin() + afterMatmuls,
                                            recording.requests.end());
    const std::vector<size_t> expected{launch::columnSumScratchFloats(n, c, 2) * sizeof(float),
                                       size_t(shape.batch) * size_t(shape.heads) *
                                           size_t(shape.queries) * sizeof(float)};
    EXPECT_EQ(kernelScratch, expected);
  }
  EXPECT_EQ(recording.live, 0) << "scratch not given back";
  std::vector<float> host{1.0f, 2.0f};
  ASSERT_OK(ctx->upload(p, host.data(), 8));
  ASSERT_OK(ctx->download(host.data(), p, 8));
  EXPECT_EQ(host, (std::vector<float>{1.0f, 2.0f})) << "download() wrote in the sizing pass";
  ASSERT_OK(ctx->memsetZero(p, 8));
  ASSERT_OK(ctx->synchronize());
  // Out of the pass, the same context computes again.
  ctx->setSizing(false);
  ctx->setAllocator(nullptr);
  const Vec x = randomVec(64, 90);
  Vec ref(64);
  cpu::geluForward(ref.data(), x.data(), x.size());
  DeviceBuffer in = upload(x, DType::F32), out = allocate(64 * 4);
  ASSERT_OK(geluForward(*ctx, DType::F32, out.data(), in.data(), x.size()));
  EXPECT_CLOSE(download(out, 64, DType::F32), ref, kTolF32);
}

std::string dtypeName(const ::testing::TestParamInfo<DType> &info) { return toString(info.param); }

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaMatmulTest, ::testing::Values(DType::F32, DType::BF16),
                         dtypeName);
INSTANTIATE_TEST_SUITE_P(Dtypes, CudaLayernormTest, ::testing::Values(DType::F32, DType::BF16),
                         dtypeName);
INSTANTIATE_TEST_SUITE_P(Dtypes, CudaLossTest, ::testing::Values(DType::F32, DType::BF16),
                         dtypeName);
INSTANTIATE_TEST_SUITE_P(
    Cases, CudaAttentionTest,
    ::testing::Combine(::testing::Values(DType::F32, DType::BF16),
                       ::testing::ValuesIn(kAttentionCases)),
    [](const ::testing::TestParamInfo<std::tuple<DType, AttentionCase>> &info) {
      return std::string(toString(std::get<0>(info.param))) + "_" + std::get<1>(info.param).name;
    });
// Head dims 64 and 16 take the tensor-core kernels in bf16; 40 (not a multiple of 16) the SIMT
// ones.
std::string slicesName(const ::testing::TestParamInfo<std::tuple<DType, int, int>> &info) {
  const int kind = std::get<2>(info.param);
  return std::string(toString(std::get<0>(info.param))) + "_hd" +
         std::to_string(std::get<1>(info.param)) +
         (kind == kHopperBackward  ? "_wgmma"
          : kind == kHopperDqFloat ? "_wgmma_dq_float"
          : kind == kHopperDqFixed ? "_wgmma_dq_fixed"
                                   : "");
}
INSTANTIATE_TEST_SUITE_P(HeadDims, CudaAttentionSlicesTest,
                         ::testing::Combine(::testing::Values(DType::F32, DType::BF16),
                                            ::testing::Values(64, 40, 16),
                                            ::testing::Values(int(kDefaultBackward))),
                         slicesName);
// The Hopper backward (dQ, dK and dV) over slices: dK/dV added to across four backwards.
INSTANTIATE_TEST_SUITE_P(HopperBackward, CudaAttentionSlicesTest,
                         ::testing::Combine(::testing::Values(DType::BF16),
                                            ::testing::Values(64, 128),
                                            ::testing::Values(int(kHopperBackward),
                                                              int(kHopperDqFloat),
                                                              int(kHopperDqFixed))),
                         slicesName);

//===--- The checked funnel (no device needed) --------------------------===//

llvm::Error failingCudaCall() {
  PIPEC_CUDA_TRY(cudaErrorMemoryAllocation);
  return llvm::Error::success();
}

llvm::Error failingCublasCall() {
  PIPEC_CUBLAS_TRY(CUBLAS_STATUS_NOT_SUPPORTED);
  return llvm::Error::success();
}

TEST(CudaCheckTest, CudaFailureNamesCallCodeAndLocation) {
  std::string message = llvm::toString(failingCudaCall());
  EXPECT_NE(message.find("cudaErrorMemoryAllocation failed: cudaErrorMemoryAllocation (2: "),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("CudaKernelTest.cpp:"), std::string::npos) << message;
}

TEST(CudaCheckTest, CublasFailureNamesCallCodeAndLocation) {
  std::string message = llvm::toString(failingCublasCall());
  EXPECT_NE(message.find("failed: CUBLAS_STATUS_NOT_SUPPORTED (15: "), std::string::npos)
      << message;
  EXPECT_NE(message.find("CudaKernelTest.cpp:"), std::string::npos) << message;
}

TEST(CudaCheckTest, SuccessIsNoError) {
  auto ok = []() -> llvm::Error {
    PIPEC_CUDA_TRY(cudaSuccess);
    PIPEC_CUBLAS_TRY(CUBLAS_STATUS_SUCCESS);
    return llvm::Error::success();
  };
  EXPECT_FALSE(bool(ok()));
}

} // namespace
} // namespace pipec::kernels::cuda
