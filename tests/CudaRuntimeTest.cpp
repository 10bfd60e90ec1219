//===- CudaRuntimeTest.cpp - The cuda backend against the cpu backend ------===//
//
// Needs a GPU (tag requires-gpu). Plans of the tiny GPT run on the cuda backend (every rank a
// thread on one GPU) and must give the CPU single-rank reference's gradients, and the cpu
// backend's losses, within fp32 tolerances: gradients within kCudaGradTolerance (1e-4) of the
// largest reference gradient, losses within 1e-5 absolute (the summation order of cuBLAS, the
// attention kernels and the atomic embedding scatter differs from the CPU loops).
//
//===----------------------------------------------------------------------===//
#include "tests/TestUtil.h"

#include "compiler/Verifier.h"
#include "ir/Error.h"
#include "runtime/Data.h"
#include "runtime/cpu/CpuRun.h"
#include "runtime/cuda/CudaRun.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

namespace pipec::test {
namespace {

/// `steps` steps on the cuda backend with the reference check, and on the cpu backend.
void expectCudaMatchesCpu(const Plan &plan, int steps = 2) {
  ASSERT_FALSE(verifyPlan(plan));
  auto data = syntheticData(32, /*seed=*/7);
  CudaRunOptions o;
  o.steps = steps;
  o.checkReference = true;
  o.timeoutSeconds = 60;
  auto gpu = runOnCuda(plan, *data, o);
  ASSERT_TRUE(bool(gpu)) << takeMessage(gpu.takeError());
  EXPECT_GT(gpu->gradScale, 0);
  EXPECT_LE(gpu->maxAbsGradDiff, kCudaGradTolerance * gpu->gradScale)
      << "max |grad - reference| " << gpu->maxAbsGradDiff << " scale " << gpu->gradScale;
  CpuRunOptions co;
  co.steps = steps;
  co.timeoutSeconds = 20;
  auto cpu = runOnCpu(plan, *data, co);
  ASSERT_TRUE(bool(cpu)) << takeMessage(cpu.takeError());
  ASSERT_EQ(gpu->losses.size(), cpu->losses.size());
  for (size_t s = 0; s < gpu->losses.size(); ++s) {
    EXPECT_NEAR(gpu->losses[s], cpu->losses[s], 1e-5) << "step " << s;
    EXPECT_NEAR(gpu->losses[s], gpu->referenceLosses[s], 1e-5) << "step " << s;
  }
}

class CudaRuntimeTest : public ::testing::Test {
protected:
  void SetUp() override {
    auto devices = cudaDevices();
    if (!devices)
      FAIL() << "no usable CUDA device (this test is tagged requires-gpu): "
             << takeMessage(devices.takeError());
  }
};

TEST_F(CudaRuntimeTest, OneFOneBOnFourStagesGivesTheReferenceGradients) {
  expectCudaMatchesCpu(compileOrFail(tinyGpt(/*tied=*/false, /*layers=*/6),
                                     options("1f1b", /*pp=*/4, /*microbatches=*/6)));
}

TEST_F(CudaRuntimeTest, TensorParallelTwoGivesTheReferenceGradients) {
  expectCudaMatchesCpu(
      compileOrFail(tinyGpt(/*tied=*/false, /*layers=*/6),
                    options("1f1b", /*pp=*/2, /*microbatches=*/4, 1, 1, /*tp=*/2)));
}

TEST_F(CudaRuntimeTest, ZeroBubbleWithSubSequencesAndTensorParallelMatches) {
  expectCudaMatchesCpu(
      compileOrFail(tinyGpt(/*tied=*/false, /*layers=*/6),
                    options("zb-h1", /*pp=*/2, /*microbatches=*/3, 1, /*seqSplits=*/2, /*tp=*/2)));
}

TEST_F(CudaRuntimeTest, TiedEmbeddingsAndDataParallelMatch) {
  expectCudaMatchesCpu(
      compileOrFail(tinyGpt(/*tied=*/true, /*layers=*/6),
                    options("1f1b", /*pp=*/4, /*microbatches=*/4, 1, 1, 1, /*dp=*/2)));
}

TEST_F(CudaRuntimeTest, ZbvOnOneRankPairWithTiedCopiesMatches) {
  expectCudaMatchesCpu(compileOrFail(tinyGpt(/*tied=*/true, /*layers=*/6),
                                     options("zb-v", /*pp=*/2, /*microbatches=*/4, /*vpp=*/2)));
}

} // namespace
} // namespace pipec::test
