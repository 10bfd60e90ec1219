//===- LocalTransportTest.cpp - The local transport's stream ordering, message by message ---===//
//
// runtime/cuda/LocalTransport.h on the emulated device: three rank threads in a ring post, per
// round, one group that sends to the next thread and receives from the previous one, many
// rounds ahead of the device. Each thread's compute stream fills its one send buffer with the
// round's bytes just before the send and again for the next round right after it (a sender that
// reused its buffer before the copy read it sends the next round's bytes); the receiver's
// compute stream copies its one receive buffer out right after the group and then scribbles on
// it (a copy that landed after that read, or before the previous round's scribble, shows as the
// wrong bytes). With PIPEC_EMU_ASYNC=1 (the _async test) every stream is a worker thread that
// pauses at random, so a missing wait between streams fails the test.
//
//===----------------------------------------------------------------------===//
#include "runtime/cuda/LocalTransport.h"
#include "ir/Plan.h"
#include "runtime/cuda/DeviceHandles.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <thread>
#include <vector>

namespace pipec {
namespace {

constexpr int kThreads = 3;
constexpr int kRounds = 200;
constexpr size_t kFloats = 1024;

/// The byte every element of thread `t`'s round-`k` message is made of (never 0xFF, the
/// scribble).
unsigned char pattern(int t, int k) { return static_cast<unsigned char>(1 + (t * 37 + k) % 250); }

struct Rank {
  runtime_cuda::OwnedStream compute;
  void *send = nullptr, *recv = nullptr;
  std::vector<unsigned char> got; // kRounds messages, as the receiver's stream read them
};

TEST(LocalTransportTest, EveryMessageArrivesIntactWithTheHostFarAhead) {
  // Each thread's stream, as far as the transport looks at it: a send and a recv posted as one
  // group (repeated kRounds times below).
  Plan plan;
  plan.ranks.resize(kThreads);
  for (int t = 0; t < kThreads; ++t)
    for (OpKind op : {OpKind::Send, OpKind::Recv}) {
      Instruction i;
      i.op = op;
      i.peer = (t + (op == OpKind::Send ? 1 : kThreads - 1)) % kThreads;
      i.group = 0;
      plan.ranks[size_t(t)].push_back(i);
    }
  LocalCudaTransport transport(plan, kThreads);
  const size_t bytes = kFloats * sizeof(float);
  std::vector<Rank> ranks(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    Rank &r = ranks[size_t(t)];
    ASSERT_FALSE(bool(r.compute.create()));
    ASSERT_EQ(cudaMalloc(&r.send, bytes), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&r.recv, bytes), cudaSuccess);
    r.got.assign(size_t(kRounds) * bytes, 0);
    ASSERT_FALSE(bool(transport.attach(t, r.compute.get(), [] { return llvm::Error::success(); })));
  }
  std::vector<std::string> errors(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      Rank &r = ranks[size_t(t)];
      cudaStream_t s = r.compute.get();
      const int next = (t + 1) % kThreads, prev = (t + kThreads - 1) % kThreads;
      auto fail = [&](const std::string &what) {
        errors[size_t(t)] = what;
        transport.abort(what);
      };
      if (cudaMemsetAsync(r.send, pattern(t, 0), bytes, s) != cudaSuccess)
        return fail("memset");
      for (int k = 0; k < kRounds; ++k) {
        P2POp send, recv;
        send.send = true;
        send.peer = next;
        send.id = TensorId{TensorKind::Activation, t, k, 0};
        send.data = TensorView(r.send, kFloats, DType::F32);
        recv.peer = prev;
        recv.id = TensorId{TensorKind::Activation, prev, k, 0};
        recv.data = TensorView(r.recv, kFloats, DType::F32);
        std::vector<P2POp> group =
            t % 2 ? std::vector<P2POp>{recv, send} : std::vector<P2POp>{send, recv};
        if (llvm::Error err = transport.exchange(t, group))
          return fail(llvm::toString(std::move(err)));
        // The next round's bytes into the buffer just sent, the message out of the one just
        // received, then a scribble over it.
        if (cudaMemsetAsync(r.send, pattern(t, k + 1), bytes, s) != cudaSuccess ||
            cudaMemcpyAsync(r.got.data() + size_t(k) * bytes, r.recv, bytes, cudaMemcpyDeviceToHost,
                            s) != cudaSuccess ||
            cudaMemsetAsync(r.recv, 0xFF, bytes, s) != cudaSuccess)
          return fail("queueing");
      }
    });
  for (auto &th : threads)
    th.join();
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(errors[size_t(t)], "");
    EXPECT_EQ(cudaStreamSynchronize(ranks[size_t(t)].compute.get()), cudaSuccess);
  }
  for (int t = 0; t < kThreads; ++t) {
    const int prev = (t + kThreads - 1) % kThreads;
    int wrong = 0;
    for (int k = 0; k < kRounds; ++k) {
      const unsigned char *m = ranks[size_t(t)].got.data() + size_t(k) * bytes;
      bool ok = true;
      for (size_t b = 0; b < bytes; ++b)
        ok &= m[b] == pattern(prev, k);
      if (!ok && wrong++ < 3)
        ADD_FAILURE() << "thread " << t << " round " << k << ": byte 0 is " << int(m[0])
                      << ", expected " << int(pattern(prev, k)) << " (round " << k + 1 << "'s is "
                      << int(pattern(prev, k + 1)) << ", the scribble 255)";
    }
    EXPECT_EQ(wrong, 0) << "thread " << t << " received " << wrong << " wrong messages";
  }
  for (Rank &r : ranks) {
    (void)cudaFree(r.send);
    (void)cudaFree(r.recv);
  }
}

} // namespace
} // namespace pipec
