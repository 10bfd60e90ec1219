//===- NcclWatchdogTest.cpp - the nccl mode's end-of-step watchdog, on the emulated device -===//
//
// runtime/cuda/NcclTransport.h names, when a step stalls, the last p2p group or all-reduce of
// this rank that completed and the first that did not. Here two ranks of a pp = 2 plan are
// threads on the emulated device with asynchronous streams (PIPEC_EMU_ASYNC=1, set by the
// BUILD rule: NCCL's sends and recvs then wait in their stream, as on a GPU, instead of blocking
// the host), and the emulated NCCL (runtime/cuda/emu/FakeNccl.cpp). Rank 0 posts a send that
// rank 1 matches, then a group of two ops that rank 1 never matches; its waitStep must fail
// after its timeout with a report that names the two by their plan steps and instructions
// (the instruction names as `pipec compile --show` prints them), and abort the communicators.
// (A channel's first post blocks the host until the peer has posted on it too, as NCCL's does
// while it connects; the warm-up connects both ranks first.) And a warm-up that the peer never
// joins blocks in that first post: the blocking watchdog must end the process (a death test).
// And a group of sends alone, which the compute stream does not wait for: compute must run on
// while the peer has not posted its recv, and releasing the sent buffer in the rank's arena
// must hold the compute stream until the send is done, so that the peer receives what was sent
// and not what the arena's next buffer writes there.
//
//===----------------------------------------------------------------------===//
#include "compiler/Pass.h"
#include "ir/PlanText.h"
#include "ir/support/Error.h"
#include "runtime/cuda/DeviceArena.h"
#include "runtime/cuda/DeviceHandles.h"
#include "runtime/cuda/NcclLayout.h"
#include "runtime/cuda/NcclTransport.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <map>
#include <thread>
#include <utility>

namespace pipec {
namespace {

/// pp = 2, 1F1B, 2 microbatches of a 2-layer model with unit costs.
Plan twoStagePlan() {
  ModelSpec model;
  model.name = "uniform";
  Layer l;
  l.forward = l.backwardInput = l.backwardWeight = 1;
  l.outputBytes = 4;
  model.layers.assign(2, l);
  CompileOptions o;
  o.schedule = "1f1b";
  o.parallel.pp = 2;
  o.parallel.microbatches = 2;
  auto plan = compilePlan(model, ClusterSpec::defaults(), o);
  EXPECT_TRUE(bool(plan)) << takeMessage(plan.takeError());
  return std::move(*plan);
}

/// The steps of `rank`'s p2p instructions, in stream order.
std::vector<size_t> p2pSteps(const Plan &plan, int rank) {
  std::vector<size_t> steps;
  for (size_t s = 0; s < plan.ranks[size_t(rank)].size(); ++s)
    if (plan.ranks[size_t(rank)][s].isP2P())
      steps.push_back(s);
  return steps;
}

/// One rank as one process of a launch would set it up: its communicators, a compute stream,
/// the transport (warmed up unless `warmUp` is false) and a few floats of device memory to send
/// from and receive into.
struct RankSetup {
  std::unique_ptr<NcclCommunicators> comms;
  runtime_cuda::OwnedStream compute;
  std::unique_ptr<NcclTransport> transport;
  LaunchEnv env;
  float *buffer = nullptr;

  /// `commId`: NCCL_COMM_ID, which the test also puts in the process's environment, where the
  /// emulated bootstrap reads it (as NCCL's does).
  llvm::Error init(const Plan &plan, int rank, const char *commId, bool warmUp = true,
                   NcclTransport::SendHold hold = {}) {
    std::map<std::string, std::string> vars{{"RANK", std::to_string(rank)},
                                            {"WORLD_SIZE", "2"},
                                            {"LOCAL_RANK", "0"},
                                            {"NCCL_COMM_ID", commId}};
    auto e = launchEnvOf(plan, [&](const char *name) -> const char * {
      auto it = vars.find(name);
      return it == vars.end() ? nullptr : it->second.c_str();
    });
    if (!e)
      return e.takeError();
    env = *e;
    PIPEC_CUDA_TRY(cudaSetDevice(0));
    auto c = createCommunicators(plan, env);
    if (!c)
      return c.takeError();
    comms = std::move(*c);
    if (auto err = compute.create())
      return err;
    void *p = nullptr;
    PIPEC_CUDA_TRY(cudaMalloc(&p, 64 * sizeof(float)));
    buffer = static_cast<float *>(p);
    transport = std::make_unique<NcclTransport>(plan, env, *comms);
    if (auto err = transport->init(
            compute.get(), [] { return llvm::Error::success(); }, std::move(hold)))
      return err;
    return warmUp ? transport->warmUp(buffer, /*timeoutSeconds=*/10, /*arrivalLimitSeconds=*/10)
                  : llvm::Error::success();
  }

  P2POp op(const Plan &plan, size_t step, float *data) const {
    const Instruction &i = plan.ranks[size_t(env.coord.pp)][step];
    P2POp o;
    o.send = i.op == OpKind::Send;
    o.peer = i.peer;
    o.data = TensorView(data, 4, DType::F32);
    o.rank = env.coord.pp;
    o.step = step;
    return o;
  }
};

TEST(NcclWatchdogTest, AStalledStepNamesTheLastCompletedAndThePendingGroup) {
  ASSERT_STREQ(std::getenv("PIPEC_EMU_ASYNC"), "1") << "the BUILD rule sets it";
  // (The emulated bootstrap, like NCCL's, reads the id from the process's environment.)
  ASSERT_EQ(::setenv("NCCL_COMM_ID", "emu-watchdog:1", 1), 0);
  const Plan plan = twoStagePlan();
  const std::vector<size_t> steps0 = p2pSteps(plan, 0), steps1 = p2pSteps(plan, 1);
  ASSERT_GE(steps0.size(), 3u);
  ASSERT_GE(steps1.size(), 1u);
  // Rank 0's first p2p op is the send of microbatch 0's activation; rank 1's first receives it.
  ASSERT_EQ(plan.ranks[0][steps0[0]].op, OpKind::Send);
  ASSERT_EQ(plan.ranks[1][steps1[0]].op, OpKind::Recv);

  // Rank 0's 1F1B stream: F0, send of microbatch 0 (step 1), F1, send (3), recv of microbatch
  // 0's gradient (4), ... as `pipec compile --show` names them.
  ASSERT_EQ(steps0[0], 1u);
  ASSERT_EQ(steps0[1], 3u);
  ASSERT_EQ(steps0[2], 4u);

  std::promise<void> rankZeroDone;
  std::shared_future<void> done = rankZeroDone.get_future().share();
  llvm::Error rank1Setup = llvm::Error::success();
  std::thread rank1([&] {
    RankSetup r;
    rank1Setup = r.init(plan, 1, "emu-watchdog:1");
    if (rank1Setup)
      return;
    r.transport->beginStep();
    // Matches rank 0's first send, and nothing after it.
    P2POp recv = r.op(plan, steps1[0], r.buffer + 8);
    llvm::consumeError(r.transport->exchange(1, {recv}));
    done.wait();
  });

  // Rank 0 (failures are recorded, not returned early, so that rank 1 is always released and
  // joined): its stall report, or "".
  RankSetup r0;
  auto rankZero = [&]() -> std::string {
    if (auto err = r0.init(plan, 0, "emu-watchdog:1")) {
      ADD_FAILURE() << "rank 0's setup: " << takeMessage(std::move(err));
      return "";
    }
    r0.transport->beginStep();
    P2POp first = r0.op(plan, steps0[0], r0.buffer + 8);
    if (auto err = r0.transport->exchange(0, {first})) {
      ADD_FAILURE() << takeMessage(std::move(err));
      return "";
    }
    // The compute stream waits for the group: once it is idle, the first send has completed
    // (without this, a slow rank 1 could make it the pending one).
    EXPECT_EQ(cudaStreamSynchronize(r0.compute.get()), cudaSuccess);
    // A group of two: the next two p2p ops of rank 0, which rank 1 never posts.
    std::vector<P2POp> group = {r0.op(plan, steps0[1], r0.buffer + 16),
                                r0.op(plan, steps0[2], r0.buffer + 24)};
    if (auto err = r0.transport->exchange(0, group)) {
      ADD_FAILURE() << takeMessage(std::move(err));
      return "";
    }
    llvm::Error stalled = r0.transport->waitStep(0, /*timeoutSeconds=*/0.5);
    if (!stalled) {
      ADD_FAILURE() << "the step completed without rank 1's second group";
      return "";
    }
    EXPECT_TRUE(r0.transport->aborted());
    return takeMessage(std::move(stalled));
  };
  const std::string report = rankZero();
  rankZeroDone.set_value();
  rank1.join();
  ASSERT_FALSE(bool(rank1Setup)) << takeMessage(std::move(rank1Setup));

  EXPECT_NE(report.find("watchdog: rank 0 (pp 0, dp 0, tp 0) made no progress for "),
            std::string::npos)
      << report;
  EXPECT_NE(report.find(" s in step 0: "), std::string::npos) << report;
  EXPECT_NE(
      report.find(fmt::format("last completed step 1 ({})", formatToken(plan, plan.ranks[0][1]))),
      std::string::npos)
      << report;
  EXPECT_NE(report.find(fmt::format("pending group of steps 3-4 ({} ... {})",
                                    formatToken(plan, plan.ranks[0][3]),
                                    formatToken(plan, plan.ranks[0][4]))),
            std::string::npos)
      << report;
}

/// Polls `e` for up to `seconds`: whether it completed.
bool completesWithin(cudaEvent_t e, double seconds) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < end) {
    if (cudaEventQuery(e) == cudaSuccess)
      return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return false;
}

TEST(NcclSendHoldTest, ComputeRunsOnPastASendAndReusingItsBufferWaitsForIt) {
  ASSERT_STREQ(std::getenv("PIPEC_EMU_ASYNC"), "1") << "the BUILD rule sets it";
  ASSERT_EQ(::setenv("NCCL_COMM_ID", "emu-watchdog:3", 1), 0);
  const Plan plan = twoStagePlan();
  const std::vector<size_t> steps0 = p2pSteps(plan, 0), steps1 = p2pSteps(plan, 1);
  ASSERT_FALSE(steps0.empty());
  ASSERT_FALSE(steps1.empty());
  ASSERT_EQ(plan.ranks[0][steps0[0]].op, OpKind::Send);
  ASSERT_EQ(plan.ranks[1][steps1[0]].op, OpKind::Recv);
  constexpr size_t kFloats = 4; // RankSetup::op's tensors
  const float sent[kFloats] = {1.5f, -2.0f, 3.25f, 4.0f};

  std::promise<void> post; // rank 0 lets rank 1 post its recv, once
  std::shared_future<void> posted = post.get_future().share();
  bool letGo = false;
  auto letRankOnePost = [&] {
    if (!std::exchange(letGo, true))
      post.set_value();
  };
  std::vector<float> got(kFloats, 0.0f);
  llvm::Error rank1Error = llvm::Error::success();
  std::thread rank1([&] {
    RankSetup r;
    rank1Error = [&]() -> llvm::Error {
      if (auto err = r.init(plan, 1, "emu-watchdog:3"))
        return err;
      r.transport->beginStep();
      posted.wait();
      if (auto err = r.transport->exchange(1, {r.op(plan, steps1[0], r.buffer + 8)}))
        return err;
      // (A group with a recv: the compute stream waits for it.)
      PIPEC_CUDA_TRY(cudaMemcpyAsync(got.data(), r.buffer + 8, sizeof sent, cudaMemcpyDeviceToHost,
                                     r.compute.get()));
      PIPEC_CUDA_TRY(cudaStreamSynchronize(r.compute.get()));
      return r.transport->waitStep(0, /*timeoutSeconds=*/10);
    }();
  });

  // Rank 0 (failures are recorded, not returned early, so that rank 1 is always released).
  RankSetup r0;
  std::unique_ptr<DeviceArena> arena;
  runtime_cuda::OwnedEvent afterSend, afterReuse;
  auto rankZero = [&]() -> llvm::Error {
    PIPEC_CUDA_TRY(cudaSetDevice(0));
    if (auto err = afterSend.create())
      return err;
    if (auto err = afterReuse.create())
      return err;
    // Set up before the transport so that its SendHold can name it (its stream is set below).
    if (auto err = r0.init(
            plan, 0, "emu-watchdog:3", /*warmUp=*/true,
            NcclTransport::SendHold{[&arena](const void *data, size_t bytes, cudaEvent_t done) {
                                      arena->readElsewhere(data, bytes, done);
                                    },
                                    [&arena] { arena->elsewhereReadsDone(); }}))
      return err;
    // The rank's arena: sized for one buffer of the tensor, then reserved.
    arena = std::make_unique<DeviceArena>(r0.compute.get(), "rank 0");
    auto sizing = arena->allocate(sizeof sent);
    if (!sizing)
      return sizing.takeError();
    arena->release(*sizing);
    if (auto err = arena->reserve())
      return err;
    auto a = arena->allocate(sizeof sent);
    if (!a)
      return a.takeError();
    auto *data = static_cast<float *>(*a);
    PIPEC_CUDA_TRY(
        cudaMemcpyAsync(data, sent, sizeof sent, cudaMemcpyHostToDevice, r0.compute.get()));
    PIPEC_CUDA_TRY(cudaStreamSynchronize(r0.compute.get()));

    r0.transport->beginStep();
    if (auto err = r0.transport->exchange(0, {r0.op(plan, steps0[0], data)}))
      return err;
    EXPECT_EQ(arena->readsPending(), 1u);
    // Compute runs on although rank 1 has not posted its recv.
    PIPEC_CUDA_TRY(cudaEventRecord(afterSend.get(), r0.compute.get()));
    EXPECT_TRUE(completesWithin(afterSend.get(), 5))
        << "the compute stream waited for a group of sends alone";
    // The next buffer takes the sent one's place; what is queued after its release waits for
    // the send (on the emulated device the release itself also fills it with NaN bytes).
    arena->release(data);
    EXPECT_EQ(arena->readsPending(), 0u);
    auto b = arena->allocate(sizeof sent);
    if (!b)
      return b.takeError();
    EXPECT_EQ(*b, static_cast<void *>(data)) << "first fit: the same place";
    PIPEC_CUDA_TRY(cudaMemsetAsync(*b, 0, sizeof sent, r0.compute.get()));
    PIPEC_CUDA_TRY(cudaEventRecord(afterReuse.get(), r0.compute.get()));
    EXPECT_FALSE(completesWithin(afterReuse.get(), 0.2))
        << "the reuse of a sent buffer ran before its send";
    letRankOnePost();
    // A read the step's end must forget: waitStep makes the compute stream wait for the p2p
    // stream, and then tells the arena.
    arena->readElsewhere(*b, sizeof sent, afterSend.get());
    if (auto err = r0.transport->waitStep(0, /*timeoutSeconds=*/10))
      return err;
    EXPECT_EQ(arena->readsPending(), 0u) << "the step's end kept a read";
    EXPECT_TRUE(completesWithin(afterReuse.get(), 5));
    arena->release(*b);
    return llvm::Error::success();
  };
  llvm::Error rank0Error = rankZero();
  if (rank0Error && r0.transport)
    r0.transport->abort("rank 0 failed"); // (rank 1's waits then fail instead of hanging)
  letRankOnePost();
  rank1.join();
  ASSERT_FALSE(bool(rank0Error)) << takeMessage(std::move(rank0Error));
  ASSERT_FALSE(bool(rank1Error)) << takeMessage(std::move(rank1Error));
  for (size_t k = 0; k < kFloats; ++k)
    EXPECT_EQ(got[k], sent[k]) << "element " << k << " of what rank 1 received";
}

TEST(NcclWatchdogTest, AWarmUpThatAPeerNeverJoinsEndsTheProcessAfterTheTimeout) {
  // Rank 1 creates its communicators and never warms up. Rank 0's warm-up posts its first
  // group to rank 1, which NCCL (and the emulated NCCL) block in on the host until rank 1
  // posts too, to connect: the blocking watchdog ends the process after the timeout with one
  // line naming rank 0's warm-up (it used to wait for as long as the peer stayed away).
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const Plan plan = twoStagePlan();
  EXPECT_EXIT(
      {
        ::setenv("NCCL_COMM_ID", "emu-watchdog:2", 1);
        std::thread rank1([&] {
          RankSetup r;
          llvm::consumeError(r.init(plan, 1, "emu-watchdog:2", /*warmUp=*/false));
          std::promise<void> never; // (rank 1 keeps its communicators until the process ends)
          never.get_future().wait();
        });
        rank1.detach();
        RankSetup r0;
        if (auto err = r0.init(plan, 0, "emu-watchdog:2", /*warmUp=*/false)) {
          std::fprintf(stderr, "rank 0's setup: %s\n", takeMessage(std::move(err)).c_str());
          std::_Exit(3);
        }
        llvm::consumeError(r0.transport->warmUp(r0.buffer, /*timeoutSeconds=*/0.5,
                                                /*arrivalLimitSeconds=*/0.5));
        std::_Exit(4); // (the warm-up returned)
      },
      ::testing::ExitedWithCode(1),
      "watchdog: rank 0's warm-up of its NCCL connections blocked for 0.5 s \\(a peer process "
      "that never took part\\?\\); exiting");
}

} // namespace
} // namespace pipec
