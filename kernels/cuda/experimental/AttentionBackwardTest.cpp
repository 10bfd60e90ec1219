//===- AttentionBackwardTest.cpp - the Hopper attention backward against the CPU ---------===//
//
// AttentionBackward.h (EXPERIMENTAL: never run on a GPU) against kernels/cpu/Ops.h, in each dQ
// mode, with the tolerances of tests/CudaKernelTest.cpp (tests/CudaOpsTestUtil.h). Built for a GPU
// (:attention_backward_test, requires-gpu: the run that decides whether these kernels move into
// the main line) and for the kernel emulator (:attention_backward_test_kernel_emu, in CI). Every
// case but the refusal needs the Hopper kernels, so on a device that is not compute capability
// 9.0 they skip, saying so.
//
//===----------------------------------------------------------------------===//
#include "kernels/cuda/experimental/AttentionBackward.h"

#include "kernels/cpu/Ops.h"
#include "kernels/cuda/CudaOps.h"
#include "tests/CudaOpsTestUtil.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

namespace pipec::kernels::cuda::experimental {
namespace {

namespace cpu = ::pipec::kernels::ops;
using namespace cuda::test; // Vec, randomVec, quantized, tolerances, GpuTest

const DqMode kModes[] = {DqMode::Separate, DqMode::FloatAtomics, DqMode::FixedPoint};

std::string modeName(DqMode mode) {
  switch (mode) {
  case DqMode::Separate:
    return "Separate";
  case DqMode::FloatAtomics:
    return "FloatAtomics";
  case DqMode::FixedPoint:
    return "FixedPoint";
  }
  return "?";
}

/// GpuTest whose cases skip where the Hopper kernels cannot run.
class HopperTest : public GpuTest {
protected:
  void SetUp() override {
    GpuTest::SetUp();
    if (HasFatalFailure())
      return;
    if (ctx->computeCapability() != 90)
      GTEST_SKIP() << "the Hopper attention kernels need a compute-capability-9.0 device (this one "
                   << ctx->computeCapability() / 10 << "." << ctx->computeCapability() % 10 << ")";
  }

  /// The CPU reference's gradients of q, k, v (dk, dv added to dk0, dv0).
  static void reference(const AttentionShape &s, const Vec &q, const Vec &k, const Vec &v,
                        const Vec &dOut, Vec &dq, Vec &dk, Vec &dv) {
    const cpu::AttentionShape cs{s.batch, s.queries, s.begin, s.heads, s.headDim};
    Vec out(size_t(s.batch) * s.queries * s.width());
    Vec probs(size_t(s.batch) * s.heads * s.queries * s.keys());
    dq.assign(out.size(), 0.0f);
    cpu::attentionForward(out.data(), probs.data(), q.data(), k.data(), v.data(), cs);
    cpu::attentionBackward(dq.data(), dk.data(), dv.data(), dOut.data(), probs.data(), q.data(),
                           k.data(), v.data(), cs);
  }
};

struct Case {
  AttentionShape shape;
  const char *name;
};

// The head dimensions the kernels take (64, 128), over the tiles' and blocks' edges.
const Case kCases[] = {
    {{/*batch=*/2, /*queries=*/40, /*begin=*/0, /*heads=*/3, /*headDim=*/64}, "FirstSlice"},
    {{/*batch=*/2, /*queries=*/24, /*begin=*/40, /*heads=*/3, /*headDim=*/64}, "LaterSlice"},
    // Two 64-query blocks (the second one partly past the slice) over three 64-key tiles.
    {{/*batch=*/1, /*queries=*/100, /*begin=*/70, /*heads=*/2, /*headDim=*/128}, "ManyTiles"},
    // Four 64-query tiles stream past the first key blocks: both buffers refilled.
    {{/*batch=*/1, /*queries=*/200, /*begin=*/30, /*heads=*/2, /*headDim=*/64}, "RefilledBuffers"},
    // 128-query blocks: three, the last one's second warpgroup wholly past the slice, its first
    // partly; key tiles that start mid-block (begin 37).
    {{/*batch=*/1, /*queries=*/300, /*begin=*/37, /*heads=*/2, /*headDim=*/128},
     "ThreeQueryBlocks"},
};

class AttentionBackwardWgmmaTest : public HopperTest,
                                   public ::testing::WithParamInterface<std::tuple<Case, DqMode>> {
};

// dq starts as NaN bits, so a row or column the kernels do not write shows; dk and dv start as
// random values, which the kernels add to. The fixed-point dQ runs twice (the kernel emulator runs
// the blocks in a new order each launch): its bits must not change.
TEST_P(AttentionBackwardWgmmaTest, MatchesCpuInEveryDqMode) {
  const AttentionShape s = std::get<0>(GetParam()).shape;
  const DqMode mode = std::get<1>(GetParam());
  const DType dt = DType::BF16;
  const size_t qSize = size_t(s.batch) * s.queries * s.width();
  const size_t kvSize = size_t(s.keys()) * s.batch * s.width();
  const Vec q = quantized(randomVec(qSize, 40), dt), k = quantized(randomVec(kvSize, 41), dt);
  const Vec v = quantized(randomVec(kvSize, 42), dt), dOut = quantized(randomVec(qSize, 43), dt);
  const Vec dk0 = randomVec(kvSize, 44), dv0 = randomVec(kvSize, 45);
  Vec refDq, refDk = dk0, refDv = dv0;
  reference(s, q, k, v, dOut, refDq, refDk, refDv);
  DeviceBuffer gq = upload(q, dt), gk = upload(k, dt), gv = upload(v, dt);
  DeviceBuffer gdOut = upload(dOut, dt), out = allocate(qSize * sizeOf(dt));
  DeviceBuffer lse = allocate(size_t(s.batch) * s.heads * s.queries * 4);
  ASSERT_OK(
      attentionForward(*ctx, dt, out.data(), lse.as<float>(), gq.data(), gk.data(), gv.data(), s));
  Vec firstDq;
  for (int run = 0; run < (mode == DqMode::FixedPoint ? 2 : 1); ++run) {
    DeviceBuffer dq = upload(Vec(qSize, std::nanf("")), dt);
    DeviceBuffer dk = upload(dk0, DType::F32), dv = upload(dv0, DType::F32);
    EXPECT_TRUE(attentionBackwardWgmmaRuns(*ctx, dt, s,
                                           {dq.data(), dk.data(), dv.data(), gdOut.data(),
                                            out.data(), gq.data(), gk.data(), gv.data()}));
    ASSERT_OK(attentionBackwardWgmma(*ctx, mode, dt, dq.data(), dk.as<float>(), dv.as<float>(),
                                     gdOut.data(), out.data(), lse.as<float>(), gq.data(),
                                     gk.data(), gv.data(), s));
    const Vec gotDq = download(dq, qSize, dt);
    EXPECT_CLOSE(gotDq, refDq, tolerance(dt, /*longSums=*/true));
    EXPECT_CLOSE(download(dk, kvSize, DType::F32), refDk, tolerance(dt, /*longSums=*/true));
    EXPECT_CLOSE(download(dv, kvSize, DType::F32), refDv, tolerance(dt, /*longSums=*/true));
    if (run == 0) {
      firstDq = gotDq;
      continue;
    }
    auto [mine, theirs] = std::mismatch(gotDq.begin(), gotDq.end(), firstDq.begin());
    EXPECT_TRUE(mine == gotDq.end())
        << "fixed-point dQ element " << (mine - gotDq.begin()) << " is " << *mine
        << " in the second launch and " << *theirs << " in the first";
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, AttentionBackwardWgmmaTest,
                         ::testing::Combine(::testing::ValuesIn(kCases),
                                            ::testing::ValuesIn(kModes)),
                         [](const ::testing::TestParamInfo<std::tuple<Case, DqMode>> &info) {
                           return std::string(std::get<0>(info.param).name) + "_" +
                                  modeName(std::get<1>(info.param));
                         });

// Seq1F1B's slices, as tests/CudaKernelTest.cpp's CudaAttentionSlicesTest: four slices' forwards,
// then their backwards in reverse order, every one adding to the same dK/dV, against the CPU
// reference of the unsliced sequence.
class AttentionBackwardSlicesTest : public HopperTest,
                                    public ::testing::WithParamInterface<std::tuple<int, DqMode>> {
};

TEST_P(AttentionBackwardSlicesTest, SlicesAccumulateKeyGradientsOfTheWholeSequence) {
  const int hd = std::get<0>(GetParam());
  const DqMode mode = std::get<1>(GetParam());
  const DType dt = DType::BF16;
  const int heads = 2, slices = 4, x = 24, tokens = slices * x; // batch 1: slices are row ranges
  const size_t rowsSize = size_t(tokens) * heads * hd, sliceSize = size_t(x) * heads * hd;
  const Vec q = quantized(randomVec(rowsSize, 60), dt), k = quantized(randomVec(rowsSize, 61), dt);
  const Vec v = quantized(randomVec(rowsSize, 62), dt);
  const Vec dOut = quantized(randomVec(rowsSize, 63), dt);
  Vec refDq, refDk(rowsSize, 0.0f), refDv(rowsSize, 0.0f);
  reference({1, tokens, 0, heads, hd}, q, k, v, dOut, refDq, refDk, refDv);

  DeviceBuffer gq = upload(q, dt), gk = upload(k, dt), gv = upload(v, dt), gdOut = upload(dOut, dt);
  DeviceBuffer out = allocate(rowsSize * sizeOf(dt)), dq = allocate(rowsSize * sizeOf(dt));
  DeviceBuffer lse = allocate(size_t(slices) * heads * x * 4);
  DeviceBuffer dk = upload(Vec(rowsSize, 0.0f), DType::F32);
  DeviceBuffer dv = upload(Vec(rowsSize, 0.0f), DType::F32);
  auto at = [&](const DeviceBuffer &b, size_t elements) {
    return static_cast<char *>(b.data()) + elements * sizeOf(dt);
  };
  for (int slice = 0; slice < slices; ++slice)
    ASSERT_OK(attentionForward(
        *ctx, dt, at(out, slice * sliceSize), lse.as<float>() + size_t(slice) * heads * x,
        at(gq, slice * sliceSize), gk.data(), gv.data(), {1, x, slice * x, heads, hd}));
  for (int slice = slices - 1; slice >= 0; --slice)
    ASSERT_OK(attentionBackwardWgmma(
        *ctx, mode, dt, at(dq, slice * sliceSize), dk.as<float>(), dv.as<float>(),
        at(gdOut, slice * sliceSize), at(out, slice * sliceSize),
        lse.as<float>() + size_t(slice) * heads * x, at(gq, slice * sliceSize), gk.data(),
        gv.data(), {1, x, slice * x, heads, hd}));
  EXPECT_CLOSE(download(dq, rowsSize, dt), refDq, tolerance(dt, /*longSums=*/true));
  EXPECT_CLOSE(download(dk, rowsSize, DType::F32), refDk, tolerance(dt, /*longSums=*/true));
  EXPECT_CLOSE(download(dv, rowsSize, DType::F32), refDv, tolerance(dt, /*longSums=*/true));
}

INSTANTIATE_TEST_SUITE_P(HeadDims, AttentionBackwardSlicesTest,
                         ::testing::Combine(::testing::Values(64, 128),
                                            ::testing::ValuesIn(kModes)),
                         [](const ::testing::TestParamInfo<std::tuple<int, DqMode>> &info) {
                           return "hd" + std::to_string(std::get<0>(info.param)) + "_" +
                                  modeName(std::get<1>(info.param));
                         });

// The fixed-point dQ scales each row by a bound of its own (AttentionBackward.cu, kFixedBits):
// dOut scaled by 2^-90 and 2^90 (exact in bf16) must scale dQ alike, with the same relative error
// as at 1; a NaN in one row of dOut must make that row of dQ NaN (as the other modes do) and
// leave the others alone.
class FixedPointDqTest : public HopperTest, public ::testing::WithParamInterface<int> {
protected:
  llvm::Error fixedPointBackward(const DeviceBuffer &dq, const DeviceBuffer &dk,
                                 const DeviceBuffer &dv, const DeviceBuffer &dOut,
                                 const DeviceBuffer &out, const DeviceBuffer &lse,
                                 const DeviceBuffer &q, const DeviceBuffer &k,
                                 const DeviceBuffer &v) {
    return attentionBackwardWgmma(*ctx, DqMode::FixedPoint, dt, dq.data(), dk.as<float>(),
                                  dv.as<float>(), dOut.data(), out.data(), lse.as<float>(),
                                  q.data(), k.data(), v.data(), s);
  }

  Vec referenceDq(const Vec &q, const Vec &k, const Vec &v, const Vec &dOut) const {
    Vec dq, dk(kvSize, 0.0f), dv(kvSize, 0.0f);
    reference(s, q, k, v, dOut, dq, dk, dv);
    return dq;
  }

  const DType dt = DType::BF16;
  // Two 64-query tiles over two 128-key blocks, the second tile partly past the slice.
  const AttentionShape s{/*batch=*/1, /*queries=*/100, /*begin=*/70, /*heads=*/2, GetParam()};
  const size_t qSize = size_t(s.batch) * s.queries * s.width();
  const size_t kvSize = size_t(s.keys()) * s.batch * s.width();
};

TEST_P(FixedPointDqTest, RowsKeepTheirPrecisionAtEveryScaleAndNanStaysInItsRow) {
  Vec q = quantized(randomVec(qSize, 70), dt), k = quantized(randomVec(kvSize, 71), dt);
  Vec v = quantized(randomVec(kvSize, 72), dt), dOut = quantized(randomVec(qSize, 73), dt);
  const Vec refDq = referenceDq(q, k, v, dOut);
  DeviceBuffer gq = upload(q, dt), gk = upload(k, dt), gv = upload(v, dt);
  DeviceBuffer out = allocate(qSize * sizeOf(dt));
  DeviceBuffer lse = allocate(size_t(s.batch) * s.heads * s.queries * 4);
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
TEST_P(FixedPointDqTest, ANanInQKOrLseReachesTheRowsThatReadIt) {
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
TEST_P(FixedPointDqTest, ARowAtItsBoundDoesNotOverflow) {
  Vec q(qSize, 0.0f), k(kvSize), v(kvSize), dOut(qSize, 1.0f);
  for (size_t i = 0; i < kvSize; ++i)
    k[i] = v[i] = (i / size_t(s.width())) % 2 ? -1.0f : 1.0f; // (batch 1: row i / width is key j)
  const Vec refDq = referenceDq(q, k, v, dOut);
  DeviceBuffer gq = upload(q, dt), gk = upload(k, dt), gv = upload(v, dt);
  DeviceBuffer gdOut = upload(dOut, dt), out = allocate(qSize * sizeOf(dt));
  DeviceBuffer dq = allocate(qSize * sizeOf(dt)), lse = allocate(size_t(s.heads) * s.queries * 4);
  DeviceBuffer dk = upload(Vec(kvSize, 0.0f), DType::F32);
  DeviceBuffer dv = upload(Vec(kvSize, 0.0f), DType::F32);
  ASSERT_OK(
      attentionForward(*ctx, dt, out.data(), lse.as<float>(), gq.data(), gk.data(), gv.data(), s));
  ASSERT_OK(fixedPointBackward(dq, dk, dv, gdOut, out, lse, gq, gk, gv));
  // (The reference's dQ is hd (1 - m^2) / sqrt(hd) per element, so far from 0.)
  EXPECT_GT(*std::max_element(refDq.begin(), refDq.end()), 0.5f * std::sqrt(float(s.headDim)));
  EXPECT_CLOSE(download(dq, qSize, dt), refDq, tolerance(dt, /*longSums=*/true));
}

INSTANTIATE_TEST_SUITE_P(HeadDims, FixedPointDqTest, ::testing::Values(64, 128),
                         [](const ::testing::TestParamInfo<int> &info) {
                           return "hd" + std::to_string(info.param);
                         });

// The scratch the arena's sizing pass would reserve: in the pass the op takes exactly what it
// takes when it runs (the row dots, and the modes' dQ and bounds), and queues nothing (its
// pointers point nowhere: a queued kernel would crash the emulator, fault on a GPU).
TEST_F(HopperTest, InTheSizingPassTheBackwardTakesItsScratchAndQueuesNothing) {
  const AttentionShape s{2, 24, 8, 3, 64};
  const size_t rows4 = (size_t(s.batch) * s.heads * s.queries + 3) / 4 * 4;
  const size_t qSize = size_t(s.batch) * s.queries * s.width();
  const size_t heads4 = (2 * size_t(s.batch) * s.heads + 3) / 4 * 4;
  EXPECT_EQ(attentionBackwardWgmmaScratchBytes(DqMode::Separate, s),
            size_t(s.batch) * s.heads * s.queries * 4);
  EXPECT_EQ(attentionBackwardWgmmaScratchBytes(DqMode::FloatAtomics, s), (rows4 + qSize) * 4);
  EXPECT_EQ(attentionBackwardWgmmaScratchBytes(DqMode::FixedPoint, s),
            (4 * rows4 + heads4 + 2 * qSize) * 4);
  RecordingAllocator recording;
  ctx->setAllocator(&recording);
  ctx->setSizing(true);
  void *p = reinterpret_cast<void *>(RecordingAllocator::kNowhere);
  float *f = static_cast<float *>(p);
  for (DqMode mode : kModes) {
    SCOPED_TRACE(modeName(mode));
    recording.requests.clear();
    ASSERT_OK(attentionBackwardWgmma(*ctx, mode, DType::BF16, p, f, f, p, p, f, p, p, p, s));
    EXPECT_EQ(recording.requests, std::vector<size_t>{attentionBackwardWgmmaScratchBytes(mode, s)});
  }
  EXPECT_EQ(recording.live, 0) << "scratch not given back";
  ctx->setSizing(false);
  ctx->setAllocator(nullptr);
}

// Where the kernels cannot run (the Hopper kernels off, fp32, another head dimension), the op
// says which condition failed instead of launching.
TEST_F(GpuTest, WhereTheHopperKernelsCannotRunTheBackwardIsAnErrorNamingWhy) {
  std::unique_ptr<CudaContext> noHopper = contextWith(KernelConfig{.hopperKernels = false});
  ASSERT_TRUE(noHopper);
  alignas(16) static char buffer[64];
  void *p = buffer;
  float *f = reinterpret_cast<float *>(buffer);
  const AttentionShape hd64{1, 8, 0, 2, 64}, hd80{1, 8, 0, 2, 80};
  EXPECT_FALSE(attentionBackwardWgmmaRuns(*noHopper, DType::BF16, hd64, {p}));
  EXPECT_FALSE(attentionBackwardWgmmaRuns(*ctx, DType::F32, hd64, {p}));
  EXPECT_FALSE(attentionBackwardWgmmaRuns(*ctx, DType::BF16, hd80, {p}));
  EXPECT_EQ(attentionBackwardWgmmaRuns(*ctx, DType::BF16, hd64, {p}),
            ctx->computeCapability() == 90);
  llvm::Error err = attentionBackwardWgmma(*noHopper, DqMode::Separate, DType::BF16, p, f, f, p, p,
                                           f, p, p, p, hd64);
  ASSERT_TRUE(bool(err));
  const std::string message = llvm::toString(std::move(err));
  EXPECT_NE(message.find("not allowed"), std::string::npos) << message;
  llvm::Error fp32 =
      attentionBackwardWgmma(*ctx, DqMode::Separate, DType::F32, p, f, f, p, p, f, p, p, p, hd64);
  ASSERT_TRUE(bool(fp32));
  EXPECT_NE(llvm::toString(std::move(fp32)).find("bf16 (got fp32)"), std::string::npos);
}

} // namespace
} // namespace pipec::kernels::cuda::experimental
