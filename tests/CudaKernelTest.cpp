//===- CudaKernelTest.cpp - every CUDA op against the fp32 CPU reference -----===//
//
// Each kernels/cuda op runs on small random inputs, with sizes chosen to cross the kernels'
// edges (rows not a multiple of a warp, a head dimension not a multiple of 32, key ranges
// crossing 32-key tiles and, on the tensor cores, 64-key tiles and 64-query blocks, a slice with
// begin > 0), and is compared with kernels/cpu/Ops.h on the
// same inputs. In bf16 the inputs are first rounded to bf16 on the host, so both sides see the
// same values and the difference is the kernel's bf16 storage and summation order alone.
//
// Tolerances and the GpuTest fixture: tests/CudaOpsTestUtil.h.
//
// Built as //tests:cuda_kernel_test on a GPU (tag requires-gpu), and in CI with the .cu kernels
// on the kernel emulator (kernels/cuda/emu/KernelEmu.h), matmul cases filtered out (they are
// cuBLASLt's): //tests:cuda_kernel_test_kernel_emu on an emulated compute-capability-9.0 GPU and
// //tests:cuda_kernel_sm80_test_kernel_emu on an emulated A100 (8.0), where every op takes the
// kernels an sm_80 GPU runs. CudaCheckTest and AttentionKernelChoiceTest need no device and run
// everywhere CUDA is installed (//tests:cuda_check_test).
//
//===----------------------------------------------------------------------===//
#include "kernels/cpu/LlamaOps.h"
#include "kernels/cpu/Ops.h"
#include "kernels/cuda/CudaCheck.h"
#include "kernels/cuda/CudaOps.h"
#include "kernels/cuda/Launch.h"
#include "tests/CudaOpsTestUtil.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace pipec::kernels::cuda {
namespace launch {
/// gtest prints the family's name.
void PrintTo(AttentionKernel kernel, std::ostream *os) { *os << toString(kernel); }
} // namespace launch

namespace {

namespace cpu = ::pipec::kernels::ops;
using namespace test; // Vec, randomVec, quantized, tolerances, GpuTest

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
// //tests:cuda_kernel_test_kernel_emu sets PIPEC_EMU_BLOCK_ORDER=shuffled: every launch runs its
// blocks in a new order, and a sum of atomically added partials comes out with other bits.)
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

// The Llama-style block's ops (Llama.cu) against kernels/cpu/LlamaOps.h.
TEST_P(CudaLayernormTest, RmsnormForwardAndBothBackwardsMatchCpu) {
  const DType dt = GetParam();
  const int n = 300, c = 70; // two chunks of rows for the weight gradient; c not a multiple of 32
  Vec x = quantized(randomVec(size_t(n) * c, 40, -2.0f, 3.0f), dt);
  Vec w = quantized(randomVec(c, 41, 0.5f, 1.5f), dt);
  Vec dOut = quantized(randomVec(size_t(n) * c, 42), dt);
  Vec dIn0 = quantized(randomVec(size_t(n) * c, 43), dt); // accumulated into
  Vec dW0 = randomVec(c, 44);
  Vec refOut(size_t(n) * c), refRstd(n), refIn = dIn0, refW = dW0;
  cpu::rmsnormForward(refOut.data(), refRstd.data(), x.data(), w.data(), n, c);
  cpu::rmsnormBackwardInputAccumulate(refIn.data(), dOut.data(), x.data(), refRstd.data(), w.data(),
                                      n, c);
  cpu::rmsnormBackwardWeight(refW.data(), dOut.data(), x.data(), refRstd.data(), n, c);

  DeviceBuffer gx = upload(x, dt), gw = upload(w, dt), gdOut = upload(dOut, dt);
  DeviceBuffer gdIn = upload(dIn0, dt), gdW = upload(dW0, DType::F32);
  DeviceBuffer out = allocate(refOut.size() * sizeOf(dt)), rstd = allocate(n * 4);
  ASSERT_OK(rmsnormForward(*ctx, dt, out.data(), rstd.as<float>(), gx.data(), gw.data(), n, c));
  ASSERT_OK(rmsnormBackwardInputAccumulate(*ctx, dt, gdIn.data(), gdOut.data(), gx.data(),
                                           rstd.as<float>(), gw.data(), n, c));
  ASSERT_OK(rmsnormBackwardWeight(*ctx, dt, gdW.as<float>(), gdOut.data(), gx.data(),
                                  rstd.as<float>(), n, c));
  EXPECT_CLOSE(download(out, refOut.size(), dt), refOut, tolerance(dt));
  EXPECT_CLOSE(download(rstd, n, DType::F32), refRstd, kTolF32);
  EXPECT_CLOSE(download(gdIn, refIn.size(), dt), refIn, tolerance(dt, /*longSums=*/true));
  EXPECT_CLOSE(download(gdW, c, DType::F32), refW, kTolF32Long);
  // The weight gradient sums each column in one order: the same bits on a second launch.
  DeviceBuffer again = upload(dW0, DType::F32);
  ASSERT_OK(rmsnormBackwardWeight(*ctx, dt, again.as<float>(), gdOut.data(), gx.data(),
                                  rstd.as<float>(), n, c));
  EXPECT_EQ(download(again, c, DType::F32), download(gdW, c, DType::F32));
  // Another epsilon (the spec's norm_eps), large enough to show: the forward takes it.
  Vec epsOut(refOut.size()), epsRstd(n);
  cpu::rmsnormForward(epsOut.data(), epsRstd.data(), x.data(), w.data(), n, c, 0.5f);
  ASSERT_OK(
      rmsnormForward(*ctx, dt, out.data(), rstd.as<float>(), gx.data(), gw.data(), n, c, 0.5f));
  EXPECT_CLOSE(download(out, refOut.size(), dt), epsOut, tolerance(dt));
  EXPECT_CLOSE(download(rstd, n, DType::F32), epsRstd, kTolF32);
}

TEST_P(CudaLayernormTest, SwigluForwardAndBackwardMatchCpuOnGateUpRows) {
  const DType dt = GetParam();
  const int n = 37, f = 45; // rows of gate | up, as the stage's fc output
  Vec pre = quantized(randomVec(size_t(n) * 2 * f, 50, -4.0f, 4.0f), dt);
  Vec dOut = quantized(randomVec(size_t(n) * f, 51), dt);
  Vec refOut(size_t(n) * f), refPre(size_t(n) * 2 * f);
  for (int r = 0; r < n; ++r) {
    const float *p = pre.data() + size_t(r) * 2 * f;
    float *d = refPre.data() + size_t(r) * 2 * f;
    cpu::swigluForward(refOut.data() + size_t(r) * f, p, p + f, size_t(f));
    cpu::swigluBackward(d, d + f, dOut.data() + size_t(r) * f, p, p + f, size_t(f));
  }
  DeviceBuffer gPre = upload(pre, dt), gdOut = upload(dOut, dt);
  DeviceBuffer out = allocate(refOut.size() * sizeOf(dt)),
               dPre = allocate(refPre.size() * sizeOf(dt));
  ASSERT_OK(swigluForward(*ctx, dt, out.data(), gPre.data(), n, f));
  ASSERT_OK(swigluBackward(*ctx, dt, dPre.data(), gdOut.data(), gPre.data(), n, f));
  EXPECT_CLOSE(download(out, refOut.size(), dt), refOut, tolerance(dt));
  EXPECT_CLOSE(download(dPre, refPre.size(), dt), refPre, tolerance(dt));
}

TEST_P(CudaLayernormTest, RopeForwardAndBackwardMatchCpuAndUndoEachOther) {
  const DType dt = GetParam();
  const int rows = 40, heads = 3, hd = 10; // positions up to 8,191: angles of long sequences
  std::vector<int32_t> positions(rows);
  for (int r = 0; r < rows; ++r)
    positions[size_t(r)] = (r * 211) % 8192;
  for (double theta : {10000.0, 500000.0}) {
    Vec x = quantized(randomVec(size_t(rows) * heads * hd, 60), dt);
    Vec refFwd = x, refBwd = x;
    cpu::ropeForward(refFwd.data(), positions.data(), rows, heads, hd, theta);
    cpu::ropeBackward(refBwd.data(), positions.data(), rows, heads, hd, theta);
    DeviceBuffer gPos = uploadInts(positions);
    DeviceBuffer fwd = upload(x, dt), bwd = upload(x, dt);
    ASSERT_OK(ropeForward(*ctx, dt, fwd.data(), gPos.as<int32_t>(), rows, heads, hd, theta));
    ASSERT_OK(ropeBackward(*ctx, dt, bwd.data(), gPos.as<int32_t>(), rows, heads, hd, theta));
    EXPECT_CLOSE(download(fwd, x.size(), dt), refFwd, tolerance(dt));
    EXPECT_CLOSE(download(bwd, x.size(), dt), refBwd, tolerance(dt));
    // The backward is the forward's transpose, a rotation back: it undoes it.
    ASSERT_OK(ropeBackward(*ctx, dt, fwd.data(), gPos.as<int32_t>(), rows, heads, hd, theta));
    EXPECT_CLOSE(download(fwd, x.size(), dt), x, tolerance(dt, /*longSums=*/true));
  }
  DeviceBuffer gPos = uploadInts(positions), y = upload(Vec(size_t(rows) * 9, 0.0f), dt);
  llvm::Error odd = ropeForward(*ctx, dt, y.data(), gPos.as<int32_t>(), rows, 1, 9, 10000.0);
  ASSERT_TRUE(bool(odd));
  EXPECT_NE(llvm::toString(std::move(odd)).find("an even head size"), std::string::npos);
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

/// The log-sum-exp of each query row's scaled, causally masked scores (B, H, x), in double;
/// query head h reads key head h / (H / KV).
Vec referenceLse(const Vec &q, const Vec &k, const AttentionShape &s) {
  const int kvw = s.kvHeadCount() * s.headDim, group = s.heads / s.kvHeadCount();
  Vec lse(size_t(s.batch) * s.heads * s.queries);
  for (int b = 0; b < s.batch; ++b)
    for (int h = 0; h < s.heads; ++h)
      for (int t = 0; t < s.queries; ++t) {
        double sum = 0;
        for (int j = 0; j <= s.begin + t; ++j) {
          double dot = 0;
          for (int d = 0; d < s.headDim; ++d)
            dot += double(q[(size_t(b) * s.queries + t) * s.width() + size_t(h) * s.headDim + d]) *
                   k[(size_t(j) * s.batch + b) * kvw + size_t(h / group) * s.headDim + d];
          sum += std::exp(dot / std::sqrt(double(s.headDim)));
        }
        lse[(size_t(b) * s.heads + h) * s.queries + t] = float(std::log(sum));
      }
  return lse;
}

struct AttentionCase {
  AttentionShape shape;
  const char *name;
};

/// An attention case on the host and the device: random inputs, the CPU reference's results
/// and the device's buffers.
struct AttentionTensors {
  size_t qSize, kvSize;
  Vec q, k, v, dOut, dk0, dv0;
  Vec refOut, probs, refDq, refDk, refDv, refLse;
  DeviceBuffer gq, gk, gv, gdOut, gdk, gdv, out, dq, lse;
};

class AttentionTest : public GpuTest {
protected:
  /// Inputs of shape `s` (key and value rows `kvWidth` wide) from seeds `seed`.. `seed` + 5,
  /// rounded to `dt` where the op reads `dt`, on the host and uploaded; the reference's outputs
  /// sized, its lse computed (the test computes the rest).
  AttentionTensors tensors(const AttentionShape &s, DType dt, size_t kvWidth, uint32_t seed) {
    AttentionTensors t;
    t.qSize = size_t(s.batch) * s.queries * s.width();
    t.kvSize = size_t(s.keys()) * s.batch * kvWidth;
    t.q = quantized(randomVec(t.qSize, seed), dt);
    t.k = quantized(randomVec(t.kvSize, seed + 1), dt);
    t.v = quantized(randomVec(t.kvSize, seed + 2), dt);
    t.dOut = quantized(randomVec(t.qSize, seed + 3), dt);
    // dk and dv are fp32 accumulators in both types (CudaOps.h): what they hold is added to.
    t.dk0 = randomVec(t.kvSize, seed + 4);
    t.dv0 = randomVec(t.kvSize, seed + 5);
    t.refOut = Vec(t.qSize);
    t.probs = Vec(size_t(s.batch) * s.heads * s.queries * s.keys());
    t.refDq = Vec(t.qSize);
    t.refDk = t.dk0;
    t.refDv = t.dv0;
    t.refLse = referenceLse(t.q, t.k, s);
    t.gq = upload(t.q, dt), t.gk = upload(t.k, dt), t.gv = upload(t.v, dt);
    t.gdOut = upload(t.dOut, dt), t.gdk = upload(t.dk0, DType::F32);
    t.gdv = upload(t.dv0, DType::F32);
    t.out = allocate(t.qSize * sizeOf(dt)), t.dq = allocate(t.qSize * sizeOf(dt));
    t.lse = allocate(t.refLse.size() * 4);
    return t;
  }

  /// The forward and backward on the device against the reference's results.
  void expectMatchesReference(AttentionTensors &t, const AttentionShape &s, DType dt) {
    ASSERT_OK(attentionForward(*ctx, dt, t.out.data(), t.lse.as<float>(), t.gq.data(), t.gk.data(),
                               t.gv.data(), s));
    ASSERT_OK(attentionBackward(*ctx, dt, t.dq.data(), t.gdk.as<float>(), t.gdv.as<float>(),
                                t.gdOut.data(), t.out.data(), t.lse.as<float>(), t.gq.data(),
                                t.gk.data(), t.gv.data(), s));
    EXPECT_CLOSE(download(t.out, t.qSize, dt), t.refOut, tolerance(dt));
    EXPECT_CLOSE(download(t.lse, t.refLse.size(), DType::F32), t.refLse, tolerance(dt));
    EXPECT_CLOSE(download(t.dq, t.qSize, dt), t.refDq, tolerance(dt, /*longSums=*/true));
    EXPECT_CLOSE(download(t.gdk, t.kvSize, DType::F32), t.refDk, tolerance(dt, /*longSums=*/true));
    EXPECT_CLOSE(download(t.gdv, t.kvSize, DType::F32), t.refDv, tolerance(dt, /*longSums=*/true));
  }
};

class CudaAttentionTest : public AttentionTest,
                          public ::testing::WithParamInterface<std::tuple<DType, AttentionCase>> {};

TEST_P(CudaAttentionTest, SliceOverEarlierKeysMatchesCpu) {
  const DType dt = std::get<0>(GetParam());
  const AttentionShape s = std::get<1>(GetParam()).shape;
  cpu::AttentionShape cs{s.batch, s.queries, s.begin, s.heads, s.headDim};
  AttentionTensors t = tensors(s, dt, s.width(), /*seed=*/40);
  cpu::attentionForward(t.refOut.data(), t.probs.data(), t.q.data(), t.k.data(), t.v.data(), cs);
  cpu::attentionBackward(t.refDq.data(), t.refDk.data(), t.refDv.data(), t.dOut.data(),
                         t.probs.data(), t.q.data(), t.k.data(), t.v.data(), cs);
  // bf16 head dimensions that are multiples of 16 (up to 128) take the tensor-core kernels.
  const bool tensorCores = dt == DType::BF16 && s.headDim % 16 == 0 && s.headDim <= 128;
  const launch::AttentionDims dims{s.batch, s.queries, s.begin, s.heads, s.headDim};
  const std::initializer_list<const void *> forwardTensors = {t.out.data(), t.gq.data(),
                                                              t.gk.data(), t.gv.data()};
  const std::initializer_list<const void *> backwardTensors = {
      t.dq.data(),  t.gdk.data(), t.gdv.data(), t.gdOut.data(),
      t.out.data(), t.gq.data(),  t.gk.data(),  t.gv.data()};
  EXPECT_EQ(launch::attentionUsesTensorCores(dt, dims, forwardTensors), tensorCores);
  EXPECT_EQ(launch::attentionUsesTensorCores(dt, dims, backwardTensors), tensorCores);
  // The forward of head dimensions 64 and 128 runs on Hopper's wgmma on a compute-capability-9.0
  // device (the emulated device is one unless PIPEC_EMU_COMPUTE_CAPABILITY says otherwise), and
  // then the mma.sync forward is checked too; the backward is mma.sync's on every device.
  int major = 0, minor = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0), cudaSuccess);
  ASSERT_EQ(ctx->computeCapability(), 10 * major + minor);
  const bool wgmmaShape = tensorCores && (s.headDim == 64 || s.headDim == 128);
  const launch::Target target{ctx->computeCapability(), ctx->kernelConfig().hopperKernels};
  const launch::AttentionKernel forwardKernel =
      launch::attentionForwardKernel(target, dt, dims, forwardTensors);
  EXPECT_EQ(forwardKernel, wgmmaShape && major == 9 && minor == 0 ? launch::AttentionKernel::Wgmma
                           : tensorCores                          ? launch::AttentionKernel::MmaSync
                                                                  : launch::AttentionKernel::Simt);
  EXPECT_EQ(launch::attentionBackwardKernel(dt, dims, backwardTensors),
            tensorCores ? launch::AttentionKernel::MmaSync : launch::AttentionKernel::Simt);
  ASSERT_NO_FATAL_FAILURE(expectMatchesReference(t, s, dt));
  if (forwardKernel != launch::AttentionKernel::Wgmma)
    return;
  // The mma.sync forward, which a context without the Hopper kernels runs on this device too,
  // into fresh buffers.
  SCOPED_TRACE("mma.sync forward (KernelConfig::hopperKernels false)");
  std::unique_ptr<CudaContext> noHopper = contextWith(KernelConfig{.hopperKernels = false});
  ASSERT_TRUE(noHopper);
  EXPECT_EQ(launch::attentionForwardKernel(
                {noHopper->computeCapability(), noHopper->kernelConfig().hopperKernels}, dt, dims,
                forwardTensors),
            launch::AttentionKernel::MmaSync);
  DeviceBuffer otherOut = allocate(t.qSize * sizeOf(dt));
  DeviceBuffer otherLse = allocate(t.refLse.size() * 4);
  ASSERT_OK(attentionForward(*noHopper, dt, otherOut.data(), otherLse.as<float>(), t.gq.data(),
                             t.gk.data(), t.gv.data(), s));
  ASSERT_OK(noHopper->synchronize());
  EXPECT_CLOSE(download(otherOut, t.qSize, dt), t.refOut, tolerance(dt));
  EXPECT_CLOSE(download(otherLse, t.refLse.size(), DType::F32), t.refLse, tolerance(dt));
}

// Grouped-query attention (Llama's num_query_groups): query head h reads key/value head
// h / (H / KV); K, V and their fp32 gradients are (a + x, B, KV*hd). Against
// kernels/cpu/LlamaOps.h's grouped attention, with slices over earlier keys (Seq1F1B), key
// ranges crossing 32-key tiles, and bf16 shapes the tensor cores would take for multi-head
// attention: grouped heads run on the SIMT kernels, forward and backward.
class CudaGroupedAttentionTest : public AttentionTest,
                                 public ::testing::WithParamInterface<std::tuple<DType, int>> {};

TEST_P(CudaGroupedAttentionTest, SliceOverEarlierKeysMatchesCpu) {
  const DType dt = std::get<0>(GetParam());
  const AttentionShape cases[] = {
      {/*batch=*/2, /*queries=*/13, /*begin=*/40, /*heads=*/6, /*headDim=*/20, /*kvHeads=*/2},
      {1, 33, 0, 4, 64, 1}, // multi-query; a bf16 tensor-core head size
      {2, 9, 25, 8, 32, 4}, // a slice of a sub-sequence split
  };
  const AttentionShape s = cases[std::get<1>(GetParam())];
  SCOPED_TRACE(fmt::format("B {} x {} a {} H {} hd {} KV {}", s.batch, s.queries, s.begin, s.heads,
                           s.headDim, s.kvHeads));
  cpu::GroupedAttentionShape cs{s.batch, s.queries, s.begin, s.heads, s.kvHeads, s.headDim};
  AttentionTensors t = tensors(s, dt, size_t(s.kvHeads) * s.headDim, /*seed=*/70);
  cpu::groupedAttentionForward(t.refOut.data(), t.probs.data(), t.q.data(), t.k.data(), t.v.data(),
                               cs);
  cpu::groupedAttentionBackward(t.refDq.data(), t.refDk.data(), t.refDv.data(), t.dOut.data(),
                                t.probs.data(), t.q.data(), t.k.data(), t.v.data(), cs);
  const launch::AttentionDims dims{s.batch, s.queries, s.begin, s.heads, s.headDim, s.kvHeads};
  EXPECT_FALSE(
      launch::attentionUsesTensorCores(dt, dims, {t.out.data(), t.gq.data(), t.gk.data()}));
  ASSERT_NO_FATAL_FAILURE(expectMatchesReference(t, s, dt));
  // A group count that does not divide the heads is a shape error, not a launch.
  AttentionShape bad = s;
  bad.kvHeads = s.heads + 1;
  llvm::Error err = attentionForward(*ctx, dt, t.out.data(), t.lse.as<float>(), t.gq.data(),
                                     t.gk.data(), t.gv.data(), bad);
  ASSERT_TRUE(bool(err));
  EXPECT_NE(llvm::toString(std::move(err)).find("does not divide heads"), std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaGroupedAttentionTest,
                         ::testing::Combine(::testing::Values(DType::F32, DType::BF16),
                                            ::testing::Values(0, 1, 2)));

// Which kernel each device gets, for devices this machine does not have: sm_90a's wgmma only
// on compute capability 9.0 with the Hopper kernels allowed, mma.sync for the other tensor-core
// shapes and devices (an A100 is 8.0; 8.6 and 8.9 run its sm_80 code; a newer GPU the build's
// compute_90 PTX, without sm_90a's instructions), SIMT for fp32, other head dimensions or
// unaligned tensors. The backward never takes a Hopper kernel.
TEST(AttentionKernelChoiceTest, HopperKernelsRunOnComputeCapability90Only) {
  using launch::AttentionKernel;
  alignas(16) static char buffer[64];
  const void *aligned = buffer, *unaligned = buffer + 2;
  const launch::AttentionDims hd64{1, 8, 0, 2, 64}, hd128{1, 8, 0, 2, 128}, hd80{1, 8, 0, 2, 80},
      hd72{1, 8, 0, 2, 72};
  struct Case {
    launch::Target target;
    DType dtype;
    launch::AttentionDims dims;
    const void *tensor;
    AttentionKernel forward;
  };
  const Case cases[] = {
      {{90, true}, DType::BF16, hd64, aligned, AttentionKernel::Wgmma},
      {{90, true}, DType::BF16, hd128, aligned, AttentionKernel::Wgmma},
      {{90, true}, DType::BF16, hd80, aligned, AttentionKernel::MmaSync},
      {{90, false}, DType::BF16, hd64, aligned, AttentionKernel::MmaSync},
      {{80, true}, DType::BF16, hd64, aligned, AttentionKernel::MmaSync},
      {{80, true}, DType::BF16, hd128, aligned, AttentionKernel::MmaSync},
      {{86, true}, DType::BF16, hd64, aligned, AttentionKernel::MmaSync},
      {{89, true}, DType::BF16, hd128, aligned, AttentionKernel::MmaSync},
      {{100, true}, DType::BF16, hd64, aligned, AttentionKernel::MmaSync},
      {{90, true}, DType::BF16, hd64, unaligned, AttentionKernel::Simt},
      {{90, true}, DType::BF16, hd72, aligned, AttentionKernel::Simt},
      {{90, true}, DType::F32, hd64, aligned, AttentionKernel::Simt},
      {{80, true}, DType::F32, hd128, aligned, AttentionKernel::Simt},
  };
  for (const Case &c : cases) {
    SCOPED_TRACE(fmt::format("compute capability {}, Hopper kernels {}, {} hd {}{}",
                             c.target.computeCapability, c.target.hopperKernels ? "on" : "off",
                             toString(c.dtype), c.dims.headDim,
                             c.tensor == unaligned ? ", unaligned" : ""));
    EXPECT_EQ(launch::attentionForwardKernel(c.target, c.dtype, c.dims, {c.tensor, aligned}),
              c.forward)
        << toString(launch::attentionForwardKernel(c.target, c.dtype, c.dims, {c.tensor, aligned}));
    EXPECT_EQ(launch::attentionBackwardKernel(c.dtype, c.dims, {c.tensor, aligned}),
              c.forward == AttentionKernel::Simt ? AttentionKernel::Simt
                                                 : AttentionKernel::MmaSync);
  }
}

// Seq1F1B's attention over a whole sequence, slice by slice as the runtime runs it: each slice's
// forward over the keys so far, then the backwards in reverse order, every one adding to the same
// dK/dV. Held against
//   - the CPU reference of the unsliced sequence (one causal attention over all T tokens): the
//     slices' dQ and the accumulated dK/dV must be its gradients;
//   - the same kernel run for each slice alone into zeroed buffers, summed on the host in double:
//     the accumulated dK/dV must be that sum to fp32 rounding (1e-6 of the largest entry). A dK/dV
//     stored in bf16 between slices is rounded once per slice (3-4e-3) and fails this.
class CudaAttentionSlicesTest : public GpuTest,
                                public ::testing::WithParamInterface<std::tuple<DType, int>> {};

TEST_P(CudaAttentionSlicesTest, SlicesAccumulateKeyGradientsOfTheWholeSequence) {
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
    else {
      EXPECT_EQ(sums, first) << "launch " << run << " summed in another order";
    }
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
INSTANTIATE_TEST_SUITE_P(HeadDims, CudaAttentionSlicesTest,
                         ::testing::Combine(::testing::Values(DType::F32, DType::BF16),
                                            ::testing::Values(64, 40, 16)),
                         [](const ::testing::TestParamInfo<std::tuple<DType, int>> &info) {
                           return std::string(toString(std::get<0>(info.param))) + "_hd" +
                                  std::to_string(std::get<1>(info.param));
                         });

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
