//===- NcclEmuTest.cpp - The nccl mode with several ranks, on the emulated device -===//
//
// Runs in CI, on the emulated device (kernels/cuda/emu/README.md) with the emulated NCCL
// (runtime/cuda/emu/FakeNccl.cpp): every rank of a plan is a thread calling runOnNccl as one
// process of a torchrun launch would (its own LaunchEnv from RANK, WORLD_SIZE, LOCAL_RANK and one
// NCCL_COMM_ID), so the communicators' creation and splits, the p2p groups on `pipeline`, the
// tp, dp and embedding all-reduces, the end-of-step waits and the --check-reference gather to
// RANK 0 all run with several ranks, which a one-GPU machine cannot do with the real library.
// RANK 0's gradients (all replica-0 blocks, gathered) must be the single-rank reference's within
// kCudaGradTolerance, and its losses the cpu backend's; in the bf16 cases (bf16 p2p tensors and
// tp sums through NCCL, fp32 dp and embedding sums) within the bf16 tolerances of
// CudaRuntimeTest.cpp.
//
//===----------------------------------------------------------------------===//
#include "tests/TestUtil.h"

#include "compiler/Verifier.h"
#include "ir/support/Error.h"
#include "kernels/cuda/emu/FakeCuda.h"
#include "runtime/Checkpoint.h"
#include "runtime/Data.h"
#include "runtime/cpu/CpuRun.h"
#include "runtime/cuda/NcclLayout.h"
#include "runtime/cuda/NcclRun.h"
#include "runtime/cuda/NcclTransport.h"
#include "runtime/cuda/emu/FakeNccl.h"

#include "llvm/ADT/ScopeExit.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace pipec::test {
namespace {

struct Case {
  const char *name;
  CompileOptions options;
  bool tied = false;
  kernels::DType dtype = kernels::DType::F32;
  bool llama = false; // Llama's block (tinyLlama) instead of GPT-2's
};

class NcclEmuTest : public ::testing::TestWithParam<Case> {};

/// Every rank of `plan` a thread calling runOnNccl as one process of a launch would, with the
/// options `optionsOf(rank)`; the results in RANK order. `id` pairs the ranks in the emulated
/// bootstrap (one per test).
std::vector<llvm::Expected<CudaRunResult>>
runEveryRank(const Plan &plan, const DataSource &data, const std::string &id,
             const std::function<CudaRunOptions(int)> &optionsOf) {
  const ParallelConfig &pc = plan.parallel;
  const int world = pc.pp * pc.dp * pc.tp;
  EXPECT_EQ(::setenv("NCCL_COMM_ID", fmt::format("emu-{}:1", id).c_str(), 1), 0);
  std::vector<llvm::Expected<CudaRunResult>> results;
  for (int r = 0; r < world; ++r)
    results.emplace_back(CudaRunResult{});
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      std::map<std::string, std::string> vars{{"RANK", std::to_string(r)},
                                              {"WORLD_SIZE", std::to_string(world)},
                                              {"LOCAL_RANK", "0"},
                                              {"NCCL_COMM_ID", "emu:1"}};
      auto env = launchEnvOf(plan, [&](const char *name) -> const char * {
        auto it = vars.find(name);
        return it == vars.end() ? nullptr : it->second.c_str();
      });
      if (!env) {
        results[size_t(r)] = env.takeError();
        return;
      }
      results[size_t(r)] = runOnNccl(plan, data, optionsOf(r), *env);
    });
  for (auto &t : threads)
    t.join();
  ::unsetenv("NCCL_COMM_ID");
  return results;
}

TEST_P(NcclEmuTest, EveryRankAThreadGivesTheReferenceGradientsOnRankZero) {
  const Case &c = GetParam();
  Plan plan =
      compileOrFail(c.llama ? tinyLlama(c.tied, /*layers=*/6) : tinyGpt(c.tied, 6), c.options);
  ASSERT_FALSE(verifyPlan(plan));
  const ParallelConfig &pc = plan.parallel;
  const int world = pc.pp * pc.dp * pc.tp;
  auto data = syntheticData(32, /*seed=*/7);
  CudaRunOptions o;
  o.steps = 2;
  o.checkReference = true;
  o.timeoutSeconds = 60;
  o.dtype = c.dtype;
  const bool bf16 = c.dtype == kernels::DType::BF16;
  // The channels connected when RANK 0 reaches step 0: every process has passed its warm-up
  // by then (the launch settings' all-reduces on `world` follow it), and RANK 0 its part of the
  // gather's connections (connectGather), which are all with RANK 0.
  std::atomic<size_t> connectedBeforeStepZero{0};
  auto results = runEveryRank(plan, *data, c.name, [&](int r) {
    CudaRunOptions mine = o;
    if (r == 0)
      mine.onArenas = [&](const CudaRunResult &) {
        connectedBeforeStepZero = emu::ncclChannelsConnected();
      };
    return mine;
  });
  for (int r = 0; r < world; ++r) {
    ASSERT_TRUE(bool(results[size_t(r)]))
        << "rank " << r << ": " << takeMessage(results[size_t(r)].takeError());
    // Each process's sizing pass (alone, no NCCL call) saw exactly its steps' requests.
    EXPECT_EQ(results[size_t(r)]->arenaUsedBytes, results[size_t(r)]->arenaBytes) << "rank " << r;
    EXPECT_GT(results[size_t(r)]->arenaBytes.at(0), 0u) << "rank " << r;
  }
  // No step and no gather after one connects a channel: a connection is a host call that waits
  // for the peer, and NCCL allocates its buffers in it, after the arena was sized.
  EXPECT_EQ(emu::ncclChannelsConnected(), connectedBeforeStepZero.load())
      << "channels connected after the warm-up, inside the steps or their gathers";
  CudaRunResult &root = *results[0];
  ASSERT_EQ(root.referenceLosses.size(), 2u);
  EXPECT_GT(root.grads.scale, 0);
  EXPECT_LE(root.grads.maxAbsDiff, cudaGradTolerance(c.dtype) * root.grads.scale)
      << "max |grad - reference| " << root.grads.maxAbsDiff << " scale " << root.grads.scale;
  EXPECT_LE(root.grads.maxTensorDiff, cudaTensorGradTolerance(c.dtype))
      << "worst tensor at layer " << root.grads.worstTensor.layer << " "
      << root.grads.worstTensor.param;
  // The weights after the last step, gathered to RANK 0 like the gradients.
  EXPECT_EQ(root.weights.steps, 2);
  EXPECT_LE(root.weights.maxRatio, 1.0) << weightCheckReport(root.weights);
  EXPECT_LT(root.weights.tpCopy.step, 0) << weightCheckReport(root.weights);
  EXPECT_LT(root.weights.dpCopy.replica, 0) << weightCheckReport(root.weights);
  if (bf16) {
    EXPECT_GT(root.grads.maxAbsDiff, kCudaGradTolerance * root.grads.scale)
        << "bf16 gradients as exact as fp32 ones: the run did not compute in bf16";
  }
  // Every (stage, tp) block of replica 0 took part in the comparison.
  EXPECT_EQ(root.lastGrads.size(), plan.stages.size() * size_t(pc.tp));
  CpuRunOptions co;
  co.steps = 2;
  auto cpu = runOnCpu(plan, *data, co);
  ASSERT_TRUE(bool(cpu)) << takeMessage(cpu.takeError());
  for (int r = 0; r < world; ++r) {
    const CudaRunResult &mine = *results[size_t(r)];
    ASSERT_EQ(mine.losses.size(), 2u) << "rank " << r;
    for (size_t s = 0; s < 2; ++s)
      EXPECT_NEAR(mine.losses[s], cpu->losses[s], bf16 ? 2e-3 * std::fabs(cpu->losses[s]) : 1e-5)
          << "rank " << r << " step " << s;
    if (r > 0) {
      EXPECT_TRUE(mine.referenceLosses.empty()) << "only RANK 0 runs the reference";
      EXPECT_EQ(mine.weights.steps, 0) << "only RANK 0 compares the weights";
    }
  }
}

/// Sets the environment variable `name` to `value` for its lifetime, then restores it.
struct ScopedEnv {
  const char *name;
  std::optional<std::string> before;
  ScopedEnv(const char *n, const char *value) : name(n) {
    if (const char *v = std::getenv(n))
      before = v;
    EXPECT_EQ(::setenv(n, value, 1), 0);
  }
  ~ScopedEnv() {
    if (before)
      ::setenv(name, before->c_str(), 1);
    else
      ::unsetenv(name);
  }
};

// A group of sends alone does not hold its rank's compute stream (NcclTransport.h); a sent
// buffer's release in the arena waits for the send instead. Here every group with a send waits
// 20 ms in its stream before it posts (the emulated NCCL's setNcclSendDelayMs), so each
// rank's compute runs ahead of its sends, and zb-h1's input gradients, released by the weight
// gradients that follow them, are released while their sends are still pending: the release
// must wait (on the emulated device it fills the buffer with NaN bytes in the compute stream's
// order), or the next stage trains on NaN. With the asynchronous device only: synchronous,
// every send is done before its host call returns.
TEST(NcclEmuSendHoldTest, SendsThatLagTheirRanksComputeStillCarryWhatWasSent) {
  if (!emu::asynchronous()) {
    GTEST_SKIP() << "needs asynchronous streams (nccl_runtime_test_emu_async)";
  }
  emu::setNcclSendDelayMs(20);
  auto fast = llvm::make_scope_exit([] { emu::setNcclSendDelayMs(0); });
  Plan plan = compileOrFail(tinyGpt(false, /*layers=*/6), options("zb-h1", 4, 6));
  ASSERT_FALSE(verifyPlan(plan));
  auto data = syntheticData(32, /*seed=*/7);
  CudaRunOptions o;
  o.steps = 1;
  o.checkReference = true;
  o.timeoutSeconds = 60;
  auto results = runEveryRank(plan, *data, "send-hold", [&](int) { return o; });
  for (size_t r = 0; r < results.size(); ++r)
    ASSERT_TRUE(bool(results[r])) << "rank " << r << ": " << takeMessage(results[r].takeError());
  const CudaRunResult &root = *results[0];
  ASSERT_EQ(root.referenceLosses.size(), 1u);
  EXPECT_TRUE(std::isfinite(root.losses.at(0)));
  EXPECT_GT(root.grads.scale, 0);
  EXPECT_LE(root.grads.maxAbsDiff, cudaGradTolerance(kernels::DType::F32) * root.grads.scale)
      << "max |grad - reference| " << root.grads.maxAbsDiff << " scale " << root.grads.scale;
}

// The step watchdog (pollDevice) counts time without progress, not the step's length: a step
// whose markers keep completing runs as long as it needs, one whose markers stop is a stall
// after --timeout. (A device that takes 1.5 s for a step, against a timeout of 0.5 s.) Time is
// a ManualClock that the watchdog's own polling moves (sleepAdvances): the device's 1.5 s and
// the watchdog's 0.5 s are the same clock's, whatever the machine's load.
TEST(NcclPollTest, AStepThatKeepsCompletingWorkIsNotAStallHoweverLongItTakes) {
  NcclCommunicators comms; // none: no asynchronous NCCL error to read, nothing to abort
  ManualClock clock(/*sleepAdvances=*/true);
  double start = clock.now();
  auto done = [&] { return clock.now() - start >= 1.5 ? cudaSuccess : cudaErrorNotReady; };
  auto stalled = [](double idle) { return fmt::format("no progress for {:.1f} s", idle); };
  size_t completed = 0;
  llvm::Error ok = pollDevice(
      done, comms, /*timeout=*/0.5, stalled, [&] { return ++completed; }, clock);
  EXPECT_FALSE(bool(ok)) << takeMessage(std::move(ok));
  EXPECT_GE(clock.now() - start, 1.5);
  EXPECT_GT(completed, 100u); // read every 10 ms of the 1.5 s
  // The same step whose markers stop completing: a Finding after the timeout (and at most one
  // progress reading later), long before the device would be done.
  start = clock.now();
  llvm::Error stall = pollDevice(
      done, comms, 0.5, stalled, [] { return size_t(3); }, clock);
  const double took = clock.now() - start;
  ASSERT_TRUE(bool(stall));
  EXPECT_TRUE(stall.isA<Finding>());
  EXPECT_NE(takeMessage(std::move(stall)).find("no progress for 0.5 s"), std::string::npos);
  EXPECT_GE(took, 0.5);
  EXPECT_LE(took, 0.5 + 0.0101);
  // Without a progress count, the timeout is the whole wait's.
  start = clock.now();
  llvm::Error whole = pollDevice(done, comms, 0.5, stalled, {}, clock);
  EXPECT_TRUE(bool(whole));
  llvm::consumeError(std::move(whole));
  EXPECT_GE(clock.now() - start, 0.5);
  EXPECT_LT(clock.now() - start, 0.51);
}

TEST(NcclEmuReferenceTest, ARankZeroSlowToBuildTheReferenceKeepsItsPeersWaitingNotFailing) {
  // RANK 0 builds the single-rank CPU reference, which for a large model takes a while. Its
  // peers must wait for it under the arrival limit (ten timeouts, at least 10 minutes), not in
  // step 0, whose watchdog gives up after one timeout, and not in ncclCommInitRank, where NCCL
  // gives them its socket retries only (59.5 s by default; 0.3 s here) to reach RANK 0's
  // bootstrap root. RANK 0 takes 1 s, more than both the step timeout (0.5 s) and the retry
  // window. (Built before the communicators, the reference fails rank 1 in ncclCommInitRank;
  // built after the warm-up with no wait for it, it fails rank 1 in step 0 on the asynchronous
  // emulated device, nccl_runtime_test_emu_async, as it would on a GPU: on the synchronous one
  // the host waits inside the emulated NCCL's recv instead.)
  ScopedEnv retries("NCCL_SOCKET_RETRY_CNT", "2"), sleep("NCCL_SOCKET_RETRY_SLEEP_MSEC", "100");
  Plan plan = compileOrFail(tinyGpt(false, /*layers=*/4), options("1f1b", /*pp=*/2, 2));
  auto data = syntheticData(32, /*seed=*/7);
  auto results = runEveryRank(plan, *data, "slow-reference", [](int rank) {
    CudaRunOptions o;
    o.checkReference = true;
    o.timeoutSeconds = 0.5;
    if (rank == 0)
      o.onReferenceBuilt = [] { std::this_thread::sleep_for(std::chrono::seconds(1)); };
    return o;
  });
  for (size_t r = 0; r < results.size(); ++r)
    ASSERT_TRUE(bool(results[r])) << "rank " << r << ": " << takeMessage(results[r].takeError());
  EXPECT_EQ(results[0]->referenceLosses.size(), 1u);
  EXPECT_LE(results[0]->grads.maxAbsDiff,
            cudaGradTolerance(kernels::DType::F32) * results[0]->grads.scale);
}

TEST(NcclEmuLaunchTest, AProcessThatCannotReachRankZerosRootSaysWhatNcclWaitsFor) {
  // Only RANK 1 of a launch of 2 starts: with NCCL_COMM_ID its ncclCommInitRank retries the
  // connection to RANK 0's bootstrap root for NCCL's retry window (0.2 s here), then fails;
  // the error says why and names NCCL's settings.
  ScopedEnv retries("NCCL_SOCKET_RETRY_CNT", "1"), sleep("NCCL_SOCKET_RETRY_SLEEP_MSEC", "200"),
      id("NCCL_COMM_ID", "emu-no-root:1");
  Plan plan = compileOrFail(tinyGpt(false, /*layers=*/4), options("1f1b", /*pp=*/2, 2));
  auto data = syntheticData(32, /*seed=*/7);
  std::map<std::string, std::string> vars{{"RANK", "1"},
                                          {"WORLD_SIZE", "2"},
                                          {"LOCAL_RANK", "0"},
                                          {"NCCL_COMM_ID", "emu-no-root:1"},
                                          {"NCCL_SOCKET_RETRY_CNT", "1"},
                                          {"NCCL_SOCKET_RETRY_SLEEP_MSEC", "200"}};
  auto env = launchEnvOf(plan, [&](const char *name) -> const char * {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
  ASSERT_TRUE(bool(env)) << takeMessage(env.takeError());
  auto result = runOnNccl(plan, *data, CudaRunOptions{}, *env);
  ASSERT_FALSE(bool(result)) << "RANK 1 ran alone";
  const std::string message = takeMessage(result.takeError());
  EXPECT_NE(message.find("ncclCommInitRank"), std::string::npos) << message;
  EXPECT_NE(message.find("RANK 0's bootstrap root at NCCL_COMM_ID=emu-no-root:1 could not be "
                         "reached: NCCL retries for 0.2 s (NCCL_SOCKET_RETRY_CNT, "
                         "NCCL_SOCKET_RETRY_SLEEP_MSEC), so start RANK 0 at most that long after "
                         "the others"),
            std::string::npos)
      << message;
}

TEST(NcclEmuDtypeTest, ProcessesLaunchedWithDifferentDtypesAllFailNamingTheFlag) {
  // A real NCCL would hang or corrupt the p2p tensors (their bytes and datatypes differ): every
  // process must refuse, before the first step.
  Plan plan = compileOrFail(tinyGpt(false, /*layers=*/6), options("1f1b", /*pp=*/2, 4));
  auto data = syntheticData(32, /*seed=*/7);
  auto results = runEveryRank(plan, *data, "mixed-dtype", [](int rank) {
    CudaRunOptions o;
    o.dtype = rank == 0 ? kernels::DType::BF16 : kernels::DType::F32;
    return o;
  });
  for (size_t r = 0; r < results.size(); ++r) {
    ASSERT_FALSE(bool(results[r])) << "rank " << r << " ran";
    EXPECT_NE(takeMessage(results[r].takeError())
                  .find("--dtype: 1 of the launch's 2 processes compute in bf16, the others in "
                        "fp32; pass the same --dtype to every process"),
              std::string::npos)
        << "rank " << r;
  }
}

TEST(NcclEmuMemoryTest, AnArenaItsGpuCannotHoldFailsEveryProcessBeforeStepZero) {
  // GPipe's ranks keep all 130 microbatches' fc inputs (134 MB each per block): more than the
  // emulated device's 16 GiB for each process's one rank. Each process sizes its arena before
  // step 0 and says so; none runs a step.
  Plan plan = compileOrFail(wideFfnGpt(), options("gpipe", /*pp=*/2, 130));
  auto data = syntheticData(32, /*seed=*/7);
  auto results = runEveryRank(plan, *data, "too-large", [](int) { return CudaRunOptions{}; });
  for (size_t r = 0; r < results.size(); ++r) {
    ASSERT_FALSE(bool(results[r])) << "rank " << r << " ran";
    const std::string message = takeMessage(results[r].takeError());
    EXPECT_NE(message.find(fmt::format("rank {} (pp {}, dp 0, tp 0): cannot reserve the ", r, r)),
              std::string::npos)
        << message;
    EXPECT_NE(message.find(" MiB of activation memory the plan needs on this rank ("),
              std::string::npos)
        << message;
  }
}

/// Rank 1 of two, whose peer could not allocate what it needed before step 0, stopped too.
void expectRankOneStoppedForItsPeer(llvm::Expected<CudaRunResult> &result) {
  ASSERT_FALSE(bool(result)) << "rank 1 ran";
  const std::string peer = takeMessage(result.takeError());
  EXPECT_NE(peer.find("rank 1: 1 of the launch's 2 processes could not reserve the device memory "
                      "the plan needs before step 0 (each says why, with the fix), so this one "
                      "stops too"),
            std::string::npos)
      << peer;
}

TEST(NcclEmuMemoryTest, ARankAloneShortOfMemoryStopsEveryProcessBeforeStepZero) {
  // 1f1b's rank 0 keeps two microbatches of this model's fc inputs in flight, rank 1 one. The
  // two "processes" are threads sharing one emulated device of 192 MiB, 128 MiB of it free once
  // their cuBLASLt workspaces (32 MiB each) are set up: rank 0's arena (132 MiB) never fits, and
  // rank 1's (99 MiB) fits beside both ranks' weights and buffers (under 29 MiB together) since
  // rank 0's is never reserved. Rank 0 says why; rank 1 says that a process could not, before
  // step 0.
  Plan plan = compileOrFail(wideFfnGpt(/*microbatchSize=*/1), options("1f1b", /*pp=*/2, 4));
  auto data = syntheticData(32, /*seed=*/7);
  emu::setDeviceMemory(size_t(192) << 20);
  auto results = runEveryRank(plan, *data, "one-short", [](int) {
    CudaRunOptions o;
    o.checkReference = true;
    return o;
  });
  emu::setDeviceMemory(0);
  ASSERT_EQ(results.size(), 2u);
  ASSERT_FALSE(bool(results[0])) << "rank 0 ran";
  const std::string mine = takeMessage(results[0].takeError());
  EXPECT_NE(mine.find("rank 0 (pp 0, dp 0, tp 0): cannot reserve the "), std::string::npos) << mine;
  expectRankOneStoppedForItsPeer(results[1]);
}

TEST(NcclEmuMemoryTest, AProcessWhoseGpuCannotHoldItsWeightsStopsEveryProcessBeforeStepZero) {
  // Three blocks with an fc of 16384 on two ranks: rank 0 holds the embedding and two blocks,
  // 32 x (32 + 8) + 2 x (4 x 32^2 + 4 x 32 + 2 x 32 x 16384 + 16384 + 32 + 4 x 32) = 2139968
  // parameters (GPT-2's count; 34.2 MB of fp32 weights, gradients and Adam moments), rank 1
  // one block and the head (17.1 MB), and their activations are tiny. The two "processes" share one
  // emulated device of 90 MiB, 26 MiB of it free once their cuBLASLt workspaces (32 MiB each) are
  // set up: rank 0's weights never fit, whatever rank 1 holds, and are never allocated; rank 1's
  // and its arena fit. Rank 0 says why, with the fix; rank 1 stops at once,
  // rather than wait for rank 0 in the warm-up or in step 0 until its watchdog.
  Plan plan = compileOrFail(fp32Gpt(/*layers=*/3, /*hidden=*/32, /*heads=*/2, /*ffn=*/16384,
                                    /*seq=*/8, /*microbatchSize=*/1),
                            options("1f1b", /*pp=*/2, 4));
  ASSERT_EQ(plan.stages.size(), 2u);
  ASSERT_EQ(plan.stages[0].layerEnd - plan.stages[0].layerBegin, 3) << "embedding and 2 blocks";
  auto data = syntheticData(32, /*seed=*/7);
  emu::setDeviceMemory(size_t(90) << 20);
  auto results = runEveryRank(plan, *data, "weights", [](int) { return CudaRunOptions{}; });
  emu::setDeviceMemory(0);
  ASSERT_EQ(results.size(), 2u);
  ASSERT_FALSE(bool(results[0])) << "rank 0 ran";
  const std::string mine = takeMessage(results[0].takeError());
  for (const char *part :
       {"rank 0 (pp 0, dp 0, tp 0): cannot hold the 32.7 MiB of weights, gradients and "
        "optimizer state its stages need (2139968 parameters, 4 fp32 copies: weights, "
        "gradients, Adam's two moments) (",
        " MiB of 90.0 MiB free); compile the plan with more pipeline stages (pipec compile --pp) "
        "or tensor-parallel ranks (--tp), or use a GPU with more memory"})
    EXPECT_NE(mine.find(part), std::string::npos) << part << " missing from: " << mine;
  expectRankOneStoppedForItsPeer(results[1]);
}

TEST(NcclEmuMemoryTest, AProcessThatCannotSetUpItsGpuStopsEveryProcessBeforeTheWarmUp) {
  // Each process's set-up (after the communicators, before the warm-up) allocates a 32 MiB
  // cuBLASLt workspace. The two "processes" share one emulated device of 48 MiB, as two would
  // share a GPU that another job has nearly filled: whichever allocates second finds 16 MiB free.
  // It says so, with the fix; the other stops at once, on the set-up agreement, rather than wait
  // for it in the warm-up (with the real library, which tells no peer of an abort, until its
  // arrival limit: ten timeouts, at least 10 minutes). Neither reaches the warm-up.
  Plan plan = compileOrFail(tinyGpt(false, /*layers=*/6), options("1f1b", /*pp=*/2, 4));
  auto data = syntheticData(32, /*seed=*/7);
  const size_t connectedBefore = emu::ncclChannelsConnected();
  const size_t abortedBefore = emu::ncclCommsAborted();
  emu::setDeviceMemory(size_t(48) << 20);
  auto results = runEveryRank(plan, *data, "set-up", [](int) { return CudaRunOptions{}; });
  emu::setDeviceMemory(0);
  ASSERT_EQ(results.size(), 2u);
  std::vector<std::string> messages;
  for (size_t r = 0; r < results.size(); ++r) {
    ASSERT_FALSE(bool(results[r])) << "rank " << r << " ran";
    messages.push_back(takeMessage(results[r].takeError()));
  }
  const std::string setUpFailed =
      "cannot set up on GPU 0: a CUDA stream, cuBLASLt and its 32 MiB workspace do not fit in "
      "the 16.0 MiB free of its 48.0 MiB (";
  const int short_ = messages[0].find(setUpFailed) != std::string::npos ? 0 : 1;
  const int other = 1 - short_;
  for (const std::string &part :
       {fmt::format("rank {} (pp {}, dp 0, tp 0): ", short_, short_), setUpFailed,
        std::string("out of memory"),
        std::string("); free the GPU's memory (nvidia-smi lists the processes using it) or run "
                    "on another GPU")})
    EXPECT_NE(messages[size_t(short_)].find(part), std::string::npos)
        << part << " missing from: " << messages[size_t(short_)];
  EXPECT_NE(messages[size_t(other)].find(fmt::format(
                "rank {}: 1 of the launch's 2 processes could not set up their GPU (each says "
                "why), so this one stops too",
                other)),
            std::string::npos)
      << messages[size_t(other)];
  EXPECT_EQ(emu::ncclChannelsConnected(), connectedBefore) << "a process reached the warm-up";
  // Both stopped together after the agreement, with nothing queued: they finalized their
  // communicators. (An abort could drop the agreement's last sends before a peer has them.)
  EXPECT_EQ(emu::ncclCommsAborted(), abortedBefore) << "a process aborted its communicators";
}

TEST(NcclEmuDtypeTest, ProcessesLaunchedWithAndWithoutCheckReferenceAllFailNamingTheFlag) {
  // --check-reference adds collectives on `world` after every step; a process without it would
  // meet them with the next step's and hang: every process must refuse, before the first step.
  Plan plan = compileOrFail(tinyGpt(false, /*layers=*/6), options("1f1b", /*pp=*/1, 2, 1, 1, 1, 2));
  auto data = syntheticData(32, /*seed=*/7);
  auto results = runEveryRank(plan, *data, "mixed-check", [](int rank) {
    CudaRunOptions o;
    o.checkReference = rank == 1;
    return o;
  });
  for (size_t r = 0; r < results.size(); ++r) {
    ASSERT_FALSE(bool(results[r])) << "rank " << r << " ran";
    EXPECT_NE(takeMessage(results[r].takeError())
                  .find("--check-reference: 1 of the launch's 2 processes check against the "
                        "reference, the others do not; pass it to every process or to none"),
              std::string::npos)
        << "rank " << r;
  }
}

TEST(NcclEmuLaunchTest, ProcessesSharingOneGpuAllFailNamingNcclHostId) {
  // Two processes started on a one-GPU host: NCCL refuses them at ncclCommInitRank (the emulated
  // NCCL does as the real one after setNcclOneGpu(true)); each says so in the launcher's
  // terms, as an input error (piperun: exit 2).
  Plan plan = compileOrFail(tinyGpt(false, /*layers=*/6), options("1f1b", /*pp=*/2, 4));
  auto data = syntheticData(32, /*seed=*/7);
  emu::setNcclOneGpu(true);
  auto results = runEveryRank(plan, *data, "one-gpu", [](int) { return CudaRunOptions{}; });
  emu::setNcclOneGpu(false);
  for (size_t r = 0; r < results.size(); ++r) {
    ASSERT_FALSE(bool(results[r])) << "rank " << r << " ran";
    llvm::Error err = results[r].takeError();
    EXPECT_TRUE(err.isA<InputError>()) << "rank " << r;
    const std::string message = takeMessage(std::move(err));
    EXPECT_NE(
        message.find(fmt::format("--backend nccl: RANK {} and RANK {} share one GPU", r, 1 - r)),
        std::string::npos)
        << message;
    EXPECT_NE(message.find("give each its own NCCL_HOSTID"), std::string::npos) << message;
  }
}

/// Every layer file of `dir`'s checkpoint of step `step` (name -> bytes).
std::map<std::string, std::string> layerFiles(const std::string &dir, int step) {
  std::map<std::string, std::string> m;
  for (auto &e : std::filesystem::directory_iterator(checkpointPath(dir, step)))
    if (e.path().filename().string().rfind("layer-", 0) == 0) {
      std::ifstream in(e.path(), std::ios::binary);
      m[e.path().filename().string()].assign(std::istreambuf_iterator<char>(in), {});
    }
  return m;
}

TEST(NcclEmuCheckpointTest, SeveralProcessesSaveAndResumeAsTheCudaBackendBitForBit) {
  // pp 2 x tp 2 x dp 2, every rank a "process": RANK 0 gathers each layer's tp parts from the
  // processes of replica 0 that hold it (over `world`) and writes the checkpoint; on resume each
  // process reads the layers it holds. The nccl mode and the cuda backend compute the same
  // arithmetic, so the checkpoints and the resumed losses are the cuda backend's bit for bit.
  Plan plan = compileOrFail(tinyGpt(false, /*layers=*/4),
                            options("1f1b", /*pp=*/2, 2, 1, 1, /*tp=*/2, /*dp=*/2));
  ASSERT_FALSE(verifyPlan(plan));
  auto data = syntheticData(32, /*seed=*/7);
  const std::string dir = ::testing::TempDir() + "/nccl-checkpoints";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  CudaRunOptions o;
  o.steps = 4;
  o.saveDir = dir + "/cuda";
  o.saveEvery = 2;
  auto cuda = runOnCuda(plan, *data, o);
  ASSERT_TRUE(bool(cuda)) << takeMessage(cuda.takeError());
  ASSERT_EQ(cuda->losses.size(), 4u);
  // Two steps, saved by the launch.
  o.steps = 2;
  o.saveDir = dir + "/nccl";
  o.saveEvery = 0;
  auto saved = runEveryRank(plan, *data, "ckpt-save", [&](int) { return o; });
  for (size_t r = 0; r < saved.size(); ++r)
    ASSERT_TRUE(bool(saved[r])) << "rank " << r << ": " << takeMessage(saved[r].takeError());
  EXPECT_EQ(saved[0]->losses, std::vector<double>(cuda->losses.begin(), cuda->losses.begin() + 2));
  const auto want2 = layerFiles(dir + "/cuda", 2);
  ASSERT_EQ(want2.size(), 6u);
  EXPECT_TRUE(layerFiles(dir + "/nccl", 2) == want2) << "the launch's step-2 checkpoint";
  // Two more, resumed by another launch from its checkpoint.
  auto ckpt = openCheckpoint(dir + "/nccl");
  ASSERT_TRUE(bool(ckpt)) << takeMessage(ckpt.takeError());
  EXPECT_EQ(ckpt->manifest.adamSteps, 2u);
  o.resume = &*ckpt;
  auto resumed = runEveryRank(plan, *data, "ckpt-resume", [&](int) { return o; });
  for (size_t r = 0; r < resumed.size(); ++r)
    ASSERT_TRUE(bool(resumed[r])) << "rank " << r << ": " << takeMessage(resumed[r].takeError());
  EXPECT_EQ(resumed[0]->losses, std::vector<double>(cuda->losses.begin() + 2, cuda->losses.end()));
  EXPECT_TRUE(layerFiles(dir + "/nccl", 4) == layerFiles(dir + "/cuda", 4))
      << "the resumed launch's step-4 checkpoint";
}

TEST(NcclEmuCheckpointTest, ProcessesSignalledAtDifferentStepsOrNotAtAllStopAfterTheSameStep) {
  // Preemption (TrainOptions::stopSignal): a launcher may signal one process only, or each at
  // another instant. Here one process sees its signal before step 0 ends and the others none;
  // then two see different signals. Every process must stop after step 0 (a process that
  // stopped alone would leave the others waiting in step 1), report the same signal (SIGTERM
  // where any saw it), and RANK 0 must save step 1's checkpoint: the cuda backend's bit for bit.
  Plan plan = compileOrFail(tinyGpt(false, /*layers=*/4),
                            options("1f1b", /*pp=*/2, 2, 1, 1, /*tp=*/1, /*dp=*/2));
  ASSERT_FALSE(verifyPlan(plan));
  auto data = syntheticData(32, /*seed=*/7);
  const std::string dir = ::testing::TempDir() + "/nccl-preempt";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  CudaRunOptions o;
  o.steps = 1;
  o.saveDir = dir + "/cuda";
  auto cuda = runOnCuda(plan, *data, o);
  ASSERT_TRUE(bool(cuda)) << takeMessage(cuda.takeError());
  o.steps = 4;
  for (auto [signals, want] : {std::pair{std::vector<int>{0, 0, 0, SIGUSR1}, SIGUSR1},
                               std::pair{std::vector<int>{SIGUSR1, SIGTERM, 0, 0}, SIGTERM}}) {
    std::vector<std::atomic<int>> flags(signals.size());
    for (size_t r = 0; r < signals.size(); ++r)
      flags[r] = signals[r];
    o.saveDir = fmt::format("{}/nccl-{}", dir, want);
    auto results = runEveryRank(plan, *data, fmt::format("preempt-{}", want), [&](int rank) {
      CudaRunOptions mine = o;
      mine.stopSignal = &flags[size_t(rank)];
      return mine;
    });
    for (size_t r = 0; r < results.size(); ++r) {
      ASSERT_TRUE(bool(results[r])) << "rank " << r << ": " << takeMessage(results[r].takeError());
      EXPECT_EQ(results[r]->stopSignal, want) << "rank " << r;
      EXPECT_EQ(results[r]->stoppedAt, 1) << "rank " << r;
    }
    EXPECT_EQ(results[0]->losses, cuda->losses);
    auto ckpt = openCheckpoint(o.saveDir);
    ASSERT_TRUE(bool(ckpt)) << takeMessage(ckpt.takeError());
    EXPECT_EQ(ckpt->manifest.step, 1);
    EXPECT_TRUE(layerFiles(o.saveDir, 1) == layerFiles(dir + "/cuda", 1));
  }
}

TEST(NcclEmuCheckpointTest, ProcessesLaunchedWithAndWithoutSaveDirAllFailNamingTheFlag) {
  // A checkpoint gathers every layer to RANK 0: a process without --save-dir would never send
  // its part, and RANK 0 would wait for it; every process refuses, before the first step.
  Plan plan = compileOrFail(tinyGpt(false, /*layers=*/6), options("1f1b", /*pp=*/2, 2));
  auto data = syntheticData(32, /*seed=*/7);
  const std::string dir = ::testing::TempDir() + "/nccl-mixed-save";
  std::filesystem::remove_all(dir);
  auto results = runEveryRank(plan, *data, "mixed-save", [&](int rank) {
    CudaRunOptions o;
    if (rank == 0)
      o.saveDir = dir;
    return o;
  });
  for (size_t r = 0; r < results.size(); ++r) {
    ASSERT_FALSE(bool(results[r])) << "rank " << r << " ran";
    EXPECT_NE(takeMessage(results[r].takeError())
                  .find("--save-dir: 1 of the launch's 2 processes save checkpoints, the others "
                        "do not; pass the same --save-dir and --save-every to every process"),
              std::string::npos)
        << "rank " << r;
  }
  EXPECT_FALSE(std::filesystem::exists(dir)) << "nothing saved";
}

INSTANTIATE_TEST_SUITE_P(
    Nccl, NcclEmuTest,
    ::testing::Values(Case{"pp2", options("1f1b", /*pp=*/2, /*microbatches=*/4)},
                      Case{"pp4_zbh1", options("zb-h1", /*pp=*/4, /*microbatches=*/6)},
                      Case{"pp2_zbv", options("zb-v", /*pp=*/2, /*microbatches=*/4, /*vpp=*/2)},
                      Case{"pp2_tied", options("1f1b", /*pp=*/2, /*microbatches=*/4),
                           /*tied=*/true},
                      Case{"pp2_tp2_dp2", options("1f1b", 2, 3, 1, 1, /*tp=*/2, /*dp=*/2)},
                      // Replica 0 is RANK 0 alone: nothing to gather, the digests still travel.
                      Case{"pp1_dp2", options("1f1b", 1, 2, 1, 1, 1, /*dp=*/2)},
                      Case{"interleaved_seq2", options("seq1f1b-interleaved", 2, 4, /*vpp=*/2, 2)},
                      Case{"dualpipev_tied_tp2", options("dualpipe-v", 2, 4, 2, 1, /*tp=*/2), true},
                      Case{"bf16_pp2_tp2_dp2_tied", options("1f1b", 2, 3, 1, 1, /*tp=*/2, /*dp=*/2),
                           true, kernels::DType::BF16},
                      Case{"bf16_zbv_seq2", options("zb-v", 2, 4, /*vpp=*/2, /*seqSplits=*/2),
                           false, kernels::DType::BF16},
                      // Llama's block, its key/value heads split over tp, across processes.
                      Case{"llama_pp2_tp2_dp2_tied",
                           options("1f1b", 2, 3, 1, 1, /*tp=*/2, /*dp=*/2), true,
                           kernels::DType::F32, /*llama=*/true},
                      Case{"llama_bf16_zbv_seq2", options("zb-v", 2, 4, /*vpp=*/2, /*seqSplits=*/2),
                           false, kernels::DType::BF16, /*llama=*/true}),
    [](const auto &info) { return std::string(info.param.name); });

} // namespace
} // namespace pipec::test
