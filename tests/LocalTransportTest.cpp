//===- LocalTransportTest.cpp - The local transport's stream ordering, message by message ---===//
//
// runtime/cuda/LocalTransport.h on the emulated device: rank threads post, per round, one group
// that sends and receives, many rounds ahead of the device. Two shapes: three threads in a ring
// (send to the next, receive from the previous), and a star whose hub sends to and receives from
// three threads in one group, so that several threads deliver into one receiver at once (the
// transport moves pairs outside its lock). Each thread's compute stream fills its one send
// buffer with the round's bytes just before the group and again for the next round right after
// it (a sender that reused its buffer before a copy read it sends the next round's bytes); the
// receiver's compute stream copies each receive buffer out right after the group and then
// scribbles on it (a copy that landed after that read, or before the previous round's scribble,
// shows as the wrong bytes). With PIPEC_EMU_ASYNC=1 (the _async test) every stream is a worker
// thread that pauses at random, so a missing wait between streams fails the test.
//
//===----------------------------------------------------------------------===//
#include "runtime/cuda/LocalTransport.h"
#include "ir/Plan.h"
#include "runtime/cuda/DeviceHandles.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace pipec {
namespace {

constexpr int kRounds = 200;
constexpr size_t kFloats = 1024;

/// The byte every element of thread `t`'s round-`k` message is made of (never 0xFF, the
/// scribble).
unsigned char pattern(int t, int k) { return static_cast<unsigned char>(1 + (t * 37 + k) % 250); }

/// Who each thread sends to and receives from every round (one group each).
struct Topology {
  std::vector<std::vector<int>> to, from; // per thread
  int threads() const { return int(to.size()); }
};

/// Thread t sends to t + 1 and receives from t - 1.
Topology ring(int n) {
  Topology g;
  for (int t = 0; t < n; ++t) {
    g.to.push_back({(t + 1) % n});
    g.from.push_back({(t + n - 1) % n});
  }
  return g;
}

/// Thread 0 sends to and receives from every other thread in one group, so several threads
/// deliver into it, and it into several, at the same time (the transport moves the pairs
/// outside its lock).
Topology star(int n) {
  Topology g;
  g.to.resize(size_t(n));
  g.from.resize(size_t(n));
  for (int t = 1; t < n; ++t) {
    g.to[0].push_back(t);
    g.from[0].push_back(t);
    g.to[size_t(t)].push_back(0);
    g.from[size_t(t)].push_back(0);
  }
  return g;
}

struct Rank {
  runtime_cuda::OwnedStream compute;
  void *send = nullptr;
  std::vector<void *> recv;                    // per sender (Topology::from)
  std::vector<std::vector<unsigned char>> got; // per sender: kRounds messages, as read
};

/// Every thread fills its one send buffer with the round's bytes just before its group and
/// with the next round's right after it; after the group it copies each receive buffer out
/// and scribbles on it. All rounds are queued with the host far ahead of the device.
void runRounds(const Topology &g) {
  const int n = g.threads();
  // Each thread's stream, as far as the transport looks at it (diagnostics): one group.
  Plan plan;
  plan.ranks.resize(size_t(n));
  for (int t = 0; t < n; ++t)
    for (OpKind op : {OpKind::Send, OpKind::Recv}) {
      Instruction i;
      i.op = op;
      i.peer = (op == OpKind::Send ? g.to : g.from)[size_t(t)].front();
      i.group = 0;
      plan.ranks[size_t(t)].push_back(i);
    }
  LocalCudaTransport transport(plan, n);
  const size_t bytes = kFloats * sizeof(float);
  std::vector<Rank> ranks(static_cast<size_t>(n));
  for (int t = 0; t < n; ++t) {
    Rank &r = ranks[size_t(t)];
    ASSERT_FALSE(bool(r.compute.create()));
    ASSERT_EQ(cudaMalloc(&r.send, bytes), cudaSuccess);
    for (size_t f = 0; f < g.from[size_t(t)].size(); ++f) {
      ASSERT_EQ(cudaMalloc(&r.recv.emplace_back(), bytes), cudaSuccess);
      r.got.emplace_back(size_t(kRounds) * bytes, 0);
    }
    ASSERT_FALSE(bool(transport.attach(t, r.compute.get(), [] { return llvm::Error::success(); })));
  }
  std::vector<std::string> errors(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int t = 0; t < n; ++t)
    threads.emplace_back([&, t] {
      Rank &r = ranks[size_t(t)];
      cudaStream_t s = r.compute.get();
      auto fail = [&](const std::string &what) {
        errors[size_t(t)] = what;
        transport.abort(what);
      };
      if (cudaMemsetAsync(r.send, pattern(t, 0), bytes, s) != cudaSuccess)
        return fail("memset");
      for (int k = 0; k < kRounds; ++k) {
        std::vector<P2POp> group;
        for (int peer : g.to[size_t(t)]) {
          P2POp send;
          send.send = true;
          send.peer = peer;
          send.id = TensorId{TensorKind::Activation, t, k, 0};
          send.data = TensorView(r.send, kFloats, DType::F32);
          group.push_back(send);
        }
        for (size_t f = 0; f < g.from[size_t(t)].size(); ++f) {
          P2POp recv;
          recv.peer = g.from[size_t(t)][f];
          recv.id = TensorId{TensorKind::Activation, recv.peer, k, 0};
          recv.data = TensorView(r.recv[f], kFloats, DType::F32);
          group.push_back(recv);
        }
        if (t % 2)
          std::reverse(group.begin(), group.end());
        if (llvm::Error err = transport.exchange(t, group))
          return fail(llvm::toString(std::move(err)));
        // The next round's bytes into the buffer just sent, each message out of the buffer it
        // was received in, then a scribble over it.
        if (cudaMemsetAsync(r.send, pattern(t, k + 1), bytes, s) != cudaSuccess)
          return fail("queueing");
        for (size_t f = 0; f < r.recv.size(); ++f)
          if (cudaMemcpyAsync(r.got[f].data() + size_t(k) * bytes, r.recv[f], bytes,
                              cudaMemcpyDeviceToHost, s) != cudaSuccess ||
              cudaMemsetAsync(r.recv[f], 0xFF, bytes, s) != cudaSuccess)
            return fail("queueing");
      }
    });
  for (auto &th : threads)
    th.join();
  for (int t = 0; t < n; ++t) {
    EXPECT_EQ(errors[size_t(t)], "");
    EXPECT_EQ(cudaStreamSynchronize(ranks[size_t(t)].compute.get()), cudaSuccess);
  }
  for (int t = 0; t < n; ++t)
    for (size_t f = 0; f < g.from[size_t(t)].size(); ++f) {
      const int prev = g.from[size_t(t)][f];
      int wrong = 0;
      for (int k = 0; k < kRounds; ++k) {
        const unsigned char *m = ranks[size_t(t)].got[f].data() + size_t(k) * bytes;
        bool ok = true;
        for (size_t b = 0; b < bytes; ++b)
          ok &= m[b] == pattern(prev, k);
        if (!ok && wrong++ < 3) {
          ADD_FAILURE() << "thread " << t << " from " << prev << " round " << k << ": byte 0 is "
                        << int(m[0]) << ", expected " << int(pattern(prev, k)) << " (round "
                        << k + 1 << "'s is " << int(pattern(prev, k + 1)) << ", the scribble 255)";
        }
      }
      EXPECT_EQ(wrong, 0) << "thread " << t << " received " << wrong << " wrong messages from "
                          << prev;
    }
  for (Rank &r : ranks) {
    (void)cudaFree(r.send);
    for (void *p : r.recv)
      (void)cudaFree(p);
  }
}

TEST(LocalTransportTest, EveryMessageArrivesIntactWithTheHostFarAhead) { runRounds(ring(3)); }

TEST(LocalTransportTest, MessagesIntoAndOutOfOneThreadMoveAtOnceAndArriveIntact) {
  runRounds(star(4));
}

} // namespace
} // namespace pipec
