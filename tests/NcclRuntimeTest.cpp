//===- NcclRuntimeTest.cpp - The nccl mode in one process ------------------===//
//
// Needs a GPU (tag requires-gpu). The one configuration of the nccl mode a test binary runs alone:
// a single process (WORLD_SIZE = 1) with a pp = dp = tp = 1 plan. It goes through everything but
// the p2p traffic: NCCL's world communicator, the device-transport backend (device spans, no
// host staging), the end-of-step watchdog wait and the loss all-reduce; its gradients must be
// the CPU single-rank reference's within kCudaGradTolerance and its losses the cpu backend's
// within 1e-5. Several processes: tools/gpu_check.sh launches those as piperun processes (one
// per GPU, or all on one GPU with a NCCL_HOSTID each, README "Multi-node launch"), with
// --check-reference (the gradients gathered to RANK 0; NcclLayoutTest checks what is gathered).
//
//===----------------------------------------------------------------------===//
#include "tests/CudaDeviceTest.h"
#include "tests/TestUtil.h"

#include "compiler/Verifier.h"
#include "ir/support/Error.h"
#include "runtime/Data.h"
#include "runtime/cpu/CpuRun.h"
#include "runtime/cuda/CudaRun.h"
#include "runtime/cuda/NcclRun.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdlib>

namespace pipec::test {
namespace {

class NcclRuntimeTest : public CudaDeviceTest {
protected:
  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(CudaDeviceTest::SetUp());
    // One process bootstraps alone; an inherited NCCL_COMM_ID would make it wait for a root.
    ::unsetenv("NCCL_COMM_ID");
  }
};

TEST_F(NcclRuntimeTest, OneProcessGivesTheReferenceGradientsAndTheCpuLosses) {
  Plan plan = compileOrFail(tinyGpt(), options("1f1b", /*pp=*/1, /*microbatches=*/4));
  ASSERT_FALSE(verifyPlan(plan));
  auto data = syntheticData(32, /*seed=*/7);
  LaunchEnv env; // RANK 0 of WORLD_SIZE 1 on LOCAL_RANK 0
  CudaRunOptions o;
  o.steps = 3;
  o.checkReference = true;
  o.timeoutSeconds = 60;
  std::vector<double> printed;
  auto gpu = runOnNccl(plan, *data, o, env, [&](int, double loss) { printed.push_back(loss); });
  ASSERT_TRUE(bool(gpu)) << takeMessage(gpu.takeError());
  EXPECT_EQ(printed, gpu->losses);
  EXPECT_GT(gpu->grads.scale, 0);
  EXPECT_LE(gpu->grads.maxAbsDiff, kCudaGradTolerance * gpu->grads.scale);
  EXPECT_LE(gpu->grads.maxTensorDiff, kTensorGradTolerance);
  EXPECT_EQ(gpu->weights.steps, 3);
  EXPECT_LE(gpu->weights.maxRatio, 1.0) << weightCheckReport(gpu->weights);
  EXPECT_LT(gpu->weights.tpCopy.step, 0) << weightCheckReport(gpu->weights);
  EXPECT_LT(gpu->weights.dpCopy.replica, 0) << weightCheckReport(gpu->weights);
  CpuRunOptions co;
  co.steps = 3;
  auto cpu = runOnCpu(plan, *data, co);
  ASSERT_TRUE(bool(cpu)) << takeMessage(cpu.takeError());
  ASSERT_EQ(gpu->losses.size(), cpu->losses.size());
  for (size_t s = 0; s < cpu->losses.size(); ++s)
    EXPECT_NEAR(gpu->losses[s], cpu->losses[s], 1e-5) << "step " << s;
}

} // namespace
} // namespace pipec::test
