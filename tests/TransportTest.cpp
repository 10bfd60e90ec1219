//===- TransportTest.cpp - The in-process transport's mover hook, the offset arena -===//
//
// Two pieces the device backends build on, checked without a GPU: the hook through which the
// one-GPU cuda backend moves messages and all-reduce operands (runtime/Transport.h; messages of
// different rank pairs, and all-reduces of different groups, move side by side, outside the
// matching lock), and the
// first-fit arena that sizes each rank's activation memory from its sizing pass
// (runtime/OffsetArena.h). The arena is held against an independent overlap check and against
// the closed form of 1F1B's in-flight activations.
//
//===----------------------------------------------------------------------===//
#include "runtime/Transport.h"
#include "ir/support/Error.h"
#include "runtime/OffsetArena.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <random>
#include <thread>

namespace pipec::test {
namespace {

//===--- OffsetArena ------------------------------------------------------===//

/// A request sequence: positive = allocate that many bytes (request id = position), negative
/// = release the request at position -x-1.
std::vector<long> randomSequence(uint32_t seed, int requests) {
  std::mt19937 rng(seed);
  std::vector<long> seq;
  std::vector<long> liveIds;
  for (int k = 0; k < requests; ++k) {
    if (!liveIds.empty() && rng() % 3 == 0) {
      size_t pick = rng() % liveIds.size();
      seq.push_back(-liveIds[pick] - 1);
      liveIds.erase(liveIds.begin() + long(pick));
      continue;
    }
    liveIds.push_back(long(seq.size()));
    seq.push_back(long(1 + rng() % 5000));
  }
  for (long id : liveIds)
    seq.push_back(-id - 1);
  return seq;
}

/// Replays `seq`; the offsets by request position, or nothing when a request did not fit.
/// Checks on the way that no two live ranges overlap and that everything stays below the
/// capacity of a bounded arena.
std::optional<std::map<long, size_t>> replay(OffsetArena &arena, const std::vector<long> &seq) {
  std::map<long, size_t> offsets;
  std::map<size_t, size_t> live; // offset -> rounded size, the test's own view
  for (size_t k = 0; k < seq.size(); ++k) {
    long r = seq[k];
    if (r < 0) {
      long id = -r - 1;
      arena.release(offsets.at(id));
      live.erase(offsets.at(id));
      continue;
    }
    auto at = arena.allocate(size_t(r));
    if (!at)
      return std::nullopt;
    size_t size = OffsetArena::roundUp(size_t(r));
    EXPECT_EQ(*at % OffsetArena::kAlign, 0u);
    if (arena.isBounded()) {
      EXPECT_LE(*at + size, arena.capacity());
    }
    auto next = live.lower_bound(*at);
    if (next != live.end()) {
      EXPECT_LE(*at + size, next->first) << "request " << k << " overlaps a live range";
    }
    if (next != live.begin()) {
      EXPECT_LE(std::prev(next)->first + std::prev(next)->second, *at)
          << "request " << k << " overlaps a live range";
    }
    live[*at] = size;
    offsets[long(k)] = *at;
  }
  return offsets;
}

TEST(OffsetArenaTest, ABoundedReplayAtTheHighWaterMarkPlacesEverythingAtTheSameOffsets) {
  for (uint32_t seed = 1; seed <= 20; ++seed) {
    auto seq = randomSequence(seed, 400);
    OffsetArena measure;
    auto first = replay(measure, seq);
    ASSERT_TRUE(first.has_value());
    EXPECT_EQ(measure.liveCount(), 0u);
    EXPECT_EQ(measure.inUse(), 0u);
    OffsetArena exact(measure.highWater());
    auto second = replay(exact, seq);
    ASSERT_TRUE(second.has_value()) << "seed " << seed;
    EXPECT_EQ(*first, *second) << "seed " << seed;
    // One alignment unit less and the request that set the mark no longer fits.
    OffsetArena tight(measure.highWater() - OffsetArena::kAlign);
    EXPECT_FALSE(replay(tight, seq).has_value()) << "seed " << seed;
  }
}

TEST(OffsetArenaTest, FreedNeighboursMergeAndTheTopComesDown) {
  OffsetArena a;
  size_t x = *a.allocate(1000), y = *a.allocate(1000), z = *a.allocate(1000);
  EXPECT_EQ(x, 0u);
  EXPECT_EQ(y, 1024u);
  EXPECT_EQ(z, 2048u);
  a.release(x);
  a.release(y); // merges with x: 2048 bytes free at 0
  EXPECT_EQ(*a.allocate(2048), 0u);
  a.release(0);
  a.release(z); // everything free: the next request starts at 0 again
  EXPECT_EQ(*a.allocate(3000), 0u);
  EXPECT_EQ(a.highWater(), 3072u);
  EXPECT_EQ(*a.allocate(0), 3072u); // a zero-byte request still takes one unit
}

TEST(OffsetArenaTest, OneFOneBRankZeroPeaksAtPipelineDepthActivations) {
  // Rank 0 of 1F1B (p stages, m microbatches): p warm-up forwards, then one forward and one
  // backward (FIFO) in turn. Each forward keeps an activation of A bytes and a transient of T
  // bytes during the op; the peak is min(p, m) activations plus one transient.
  const size_t A = 5 << 20, T = 1 << 20;
  for (int p : {1, 2, 4, 8})
    for (int m : {1, 3, 8, 16}) {
      OffsetArena arena;
      std::vector<size_t> inFlight;
      auto forward = [&] {
        size_t keep = *arena.allocate(A), tmp = *arena.allocate(T);
        arena.release(tmp);
        inFlight.push_back(keep);
      };
      auto backward = [&] {
        size_t tmp = *arena.allocate(T);
        arena.release(inFlight.front());
        inFlight.erase(inFlight.begin());
        arena.release(tmp);
      };
      int warm = std::min(p, m);
      for (int k = 0; k < warm; ++k)
        forward();
      for (int k = warm; k < m; ++k) {
        backward();
        forward();
      }
      while (!inFlight.empty())
        backward();
      EXPECT_EQ(arena.highWater(), size_t(std::min(p, m)) * A + T) << "p=" << p << " m=" << m;
    }
}

//===--- The mover hook ---------------------------------------------------===//

struct Delivery {
  int sOwner, rOwner;
  size_t sIndex, rIndex;
  std::string what;
};

/// Copies on the host like the default, and records what it was told.
class RecordingMover final : public InProcessMover {
public:
  llvm::Error deliver(const P2POp &s, int sOwner, size_t sIndex, const P2POp &r, int rOwner,
                      size_t rIndex) override {
    std::copy(s.data.floats().begin(), s.data.floats().end(), r.data.floats().begin());
    std::lock_guard<std::mutex> lock(mu); // deliveries run outside the transport's lock
    deliveries.push_back({sOwner, rOwner, sIndex, rIndex, describe(s.id)});
    return llvm::Error::success();
  }
  llvm::Error sum(CollectiveGroup group, llvm::ArrayRef<int> members, int last,
                  llvm::ArrayRef<TensorView> buffers) override {
    EXPECT_EQ(group, CollectiveGroup::Dp);
    EXPECT_EQ(members.size(), buffers.size());
    lastArrived = last;
    summedOn = std::this_thread::get_id();
    // Reversed order on purpose: the transport must leave the arithmetic to the mover.
    for (size_t i = 0; i < buffers[0].count; ++i) {
      float total = 0;
      for (size_t b = buffers.size(); b-- > 0;)
        total += buffers[b].floats()[i];
      for (auto &buffer : buffers)
        buffer.floats()[i] = total;
    }
    return llvm::Error::success();
  }
  std::mutex mu;
  std::vector<Delivery> deliveries; // under mu
  int lastArrived = -1;
  std::thread::id summedOn; // the thread that called sum()
};

class FailingMover final : public InProcessMover {
public:
  llvm::Error deliver(const P2POp &, int, size_t, const P2POp &, int, size_t) override {
    return llvm::createStringError(llvm::inconvertibleErrorCode(), "cudaMemcpyAsync failed");
  }
  llvm::Error sum(CollectiveGroup, llvm::ArrayRef<int>, int, llvm::ArrayRef<TensorView>) override {
    return llvm::Error::success();
  }
};

P2POp op(bool send, int peer, int stage, std::span<float> data) {
  P2POp o;
  o.send = send;
  o.peer = peer;
  o.id = TensorId{TensorKind::Activation, stage, 0, 0};
  o.data = data;
  return o;
}

TEST(MoverTest, MatchedMessagesGoThroughTheMoverWithTheirOwnersAndGroupPositions) {
  RecordingMover mover;
  InProcessTransport t(
      2, [](int r, size_t s) { return fmt::format("r{}s{}", r, s); }, &mover);
  std::vector<float> a{1, 2, 3}, b{4, 5}, gotA(3), gotB(2);
  // Thread 0: [recv stage 1 from 1, send stage 0 to 1]; thread 1: [send stage 1, recv stage 0].
  std::thread other([&] {
    P2POp ops[] = {op(true, 0, 1, b), op(false, 0, 0, gotA)};
    EXPECT_FALSE(bool(t.exchange(1, ops)));
  });
  P2POp ops[] = {op(false, 1, 1, gotB), op(true, 1, 0, a)};
  llvm::Error err = t.exchange(0, ops);
  EXPECT_FALSE(bool(err)) << takeMessage(std::move(err));
  other.join();
  EXPECT_EQ(gotA, a);
  EXPECT_EQ(gotB, b);
  ASSERT_EQ(mover.deliveries.size(), 2u);
  for (const Delivery &d : mover.deliveries) {
    if (d.sOwner == 0) { // a: op 1 of thread 0 into op 1 of thread 1
      EXPECT_EQ(d.rOwner, 1);
      EXPECT_EQ(d.sIndex, 1u);
      EXPECT_EQ(d.rIndex, 1u);
    } else { // b: op 0 of thread 1 into op 0 of thread 0
      EXPECT_EQ(d.rOwner, 0);
      EXPECT_EQ(d.sIndex, 0u);
      EXPECT_EQ(d.rIndex, 0u);
    }
  }
}

TEST(MoverTest, AllReducesAreSummedByTheMoverWhichLearnsWhoCameLast) {
  // The member whose arrival completes the rendezvous sums, on its own thread, and tells the
  // mover which member it is. The arrivals are staggered (2, then 0, then 1) so that the last
  // is usually neither the first nor the last of the member list, but the check does not
  // depend on the scheduler keeping that order: the mover must name the member whose thread
  // called it.
  RecordingMover mover;
  InProcessTransport t(3, {}, &mover);
  std::vector<std::vector<float>> data{{1, 10}, {2, 20}, {4, 40}};
  // Listed out of order, so that a member's index in the list is not its number: the mover
  // must be told the number.
  std::vector<int> members{2, 0, 1};
  std::vector<std::thread> threads;
  for (int k = 0; k < 3; ++k)
    threads.emplace_back([&, k] {
      std::this_thread::sleep_for(std::chrono::milliseconds(k == 2 ? 0 : k == 0 ? 30 : 60));
      EXPECT_FALSE(bool(
          t.allReduce(CollectiveGroup::Dp, "dp/0", members, k, std::span<float>(data[size_t(k)]))));
    });
  std::vector<std::thread::id> ids;
  for (auto &th : threads) {
    ids.push_back(th.get_id());
    th.join();
  }
  for (const auto &d : data)
    EXPECT_EQ(d, (std::vector<float>{7, 70}));
  ASSERT_GE(mover.lastArrived, 0);
  ASSERT_LT(mover.lastArrived, 3);
  EXPECT_EQ(ids[size_t(mover.lastArrived)], mover.summedOn)
      << "the mover was told member " << mover.lastArrived << " came last";
}

/// Each delivery and each sum waits (up to a few seconds) until another one is under way at the
/// same time, and records whether it saw one: moves made under one lock never meet.
class MeetingMover final : public InProcessMover {
public:
  llvm::Error deliver(const P2POp &s, int, size_t, const P2POp &r, int, size_t) override {
    std::copy(s.data.floats().begin(), s.data.floats().end(), r.data.floats().begin());
    meet();
    return llvm::Error::success();
  }
  llvm::Error sum(CollectiveGroup, llvm::ArrayRef<int>, int,
                  llvm::ArrayRef<TensorView> buffers) override {
    for (size_t i = 0; i < buffers[0].count; ++i) {
      float total = 0;
      for (const TensorView &b : buffers)
        total += b.floats()[i];
      for (const TensorView &b : buffers)
        b.floats()[i] = total;
    }
    meet();
    return llvm::Error::success();
  }
  void meet() {
    std::unique_lock<std::mutex> lock(mu);
    ++inside;
    cv.notify_all();
    met.push_back(
        cv.wait_for(lock, std::chrono::seconds(5), [&] { return inside >= 2 || overlapped; }));
    overlapped = overlapped || inside >= 2;
    cv.notify_all();
    --inside;
  }
  std::mutex mu;
  std::condition_variable cv;
  int inside = 0;
  bool overlapped = false;
  std::vector<bool> met; // per move: did another run at the same time
};

TEST(MoverTest, PairsOfDifferentRanksAreDeliveredSideBySide) {
  // Threads 0 -> 1 and 2 -> 3: two independent pairs, whose data moves outside the matching
  // lock, so the cpu backend's copies and the local transport's CUDA calls of different ranks
  // are not made one at a time (runtime/Transport.h, InProcessMover).
  MeetingMover mover;
  InProcessTransport t(4, {}, &mover);
  std::vector<std::vector<float>> data{{1, 2}, {0, 0}, {3, 4}, {0, 0}};
  std::vector<std::thread> threads;
  for (int k = 0; k < 4; ++k)
    threads.emplace_back([&, k] {
      bool sender = k % 2 == 0;
      P2POp ops[] = {op(sender, sender ? k + 1 : k - 1, k / 2, data[size_t(k)])};
      llvm::Error err = t.exchange(k, ops);
      EXPECT_FALSE(bool(err)) << takeMessage(std::move(err));
    });
  for (auto &th : threads)
    th.join();
  EXPECT_EQ(data[1], data[0]);
  EXPECT_EQ(data[3], data[2]);
  ASSERT_EQ(mover.met.size(), 2u);
  EXPECT_TRUE(mover.met[0] && mover.met[1]) << "the two pairs were delivered one at a time";
}

TEST(MoverTest, AllReducesOfDifferentGroupsAreSummedSideBySide) {
  // Two tp groups, {0, 1} and {2, 3} (two pipeline ranks' shards): their sums do not wait for
  // each other.
  MeetingMover mover;
  InProcessTransport t(4, {}, &mover);
  std::vector<std::vector<float>> data{{1, 2}, {10, 20}, {3, 4}, {30, 40}};
  std::vector<std::thread> threads;
  for (int k = 0; k < 4; ++k)
    threads.emplace_back([&, k] {
      std::vector<int> members{k / 2 * 2, k / 2 * 2 + 1};
      llvm::Error err = t.allReduce(CollectiveGroup::Tp, fmt::format("tp/{}", k / 2), members, k,
                                    std::span<float>(data[size_t(k)]));
      EXPECT_FALSE(bool(err)) << takeMessage(std::move(err));
    });
  for (auto &th : threads)
    th.join();
  EXPECT_EQ(data[0], (std::vector<float>{11, 22}));
  EXPECT_EQ(data[1], (std::vector<float>{11, 22}));
  EXPECT_EQ(data[2], (std::vector<float>{33, 44}));
  EXPECT_EQ(data[3], (std::vector<float>{33, 44}));
  ASSERT_EQ(mover.met.size(), 2u);
  EXPECT_TRUE(mover.met[0] && mover.met[1]) << "the two all-reduces were summed one at a time";
}

/// Holds every delivery until release().
class BlockingMover final : public InProcessMover {
public:
  llvm::Error deliver(const P2POp &s, int, size_t, const P2POp &r, int, size_t) override {
    std::copy(s.data.floats().begin(), s.data.floats().end(), r.data.floats().begin());
    std::unique_lock<std::mutex> lock(mu);
    entered = true;
    cv.notify_all();
    cv.wait(lock, [&] { return released; });
    return llvm::Error::success();
  }
  llvm::Error sum(CollectiveGroup, llvm::ArrayRef<int>, int, llvm::ArrayRef<TensorView>) override {
    return llvm::Error::success();
  }
  void waitEntered() {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return entered; });
  }
  void release() {
    std::lock_guard<std::mutex> lock(mu);
    released = true;
    cv.notify_all();
  }

private:
  std::mutex mu;
  std::condition_variable cv;
  bool entered = false, released = false;
};

TEST(MoverTest, AnAbortDoesNotReleaseTheOwnersOfAPairStillBeingDelivered) {
  // The watchdog may abort while a pair's data is moving outside the transport's lock: both
  // owners must stay in exchange() (their buffers and bookkeeping in use) until it has moved.
  BlockingMover mover;
  InProcessTransport t(2, {}, &mover);
  std::vector<float> a{1, 2}, got(2);
  std::atomic<int> returned{0};
  std::string sendMessage, recvMessage;
  std::thread sender([&] {
    P2POp ops[] = {op(true, 1, 0, a)};
    sendMessage = takeMessage(t.exchange(0, ops));
    ++returned;
  });
  std::thread receiver([&] {
    P2POp ops[] = {op(false, 0, 0, got)};
    recvMessage = takeMessage(t.exchange(1, ops));
    ++returned;
  });
  mover.waitEntered();
  t.abort("watchdog: no progress");
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(returned.load(), 0) << "an owner left while its pair was still being delivered";
  mover.release();
  sender.join();
  receiver.join();
  EXPECT_EQ(got, a);
  EXPECT_NE(sendMessage.find("watchdog: no progress"), std::string::npos) << sendMessage;
  EXPECT_NE(recvMessage.find("watchdog: no progress"), std::string::npos) << recvMessage;
}

TEST(MoverTest, AMemberArrivingAfterAFailureDoesNotSumIntoOneThatLeft) {
  // Member 0 waits, the watchdog aborts and member 0 leaves (its buffer is the backend's to
  // reuse); member 1 comes later and must fail too, touching nobody's buffer.
  InProcessTransport t(2, {});
  std::vector<float> first{1, 2}, second{10, 20};
  std::vector<int> members{0, 1};
  std::string firstMessage;
  std::thread member0([&] {
    firstMessage =
        takeMessage(t.allReduce(CollectiveGroup::Tp, "tp/0", members, 0, std::span<float>(first)));
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50)); // (member 0 is usually waiting)
  t.abort("watchdog: no progress");
  member0.join();
  std::string secondMessage =
      takeMessage(t.allReduce(CollectiveGroup::Tp, "tp/0", members, 1, std::span<float>(second)));
  EXPECT_NE(firstMessage.find("watchdog: no progress"), std::string::npos) << firstMessage;
  EXPECT_NE(secondMessage.find("watchdog: no progress"), std::string::npos) << secondMessage;
  EXPECT_EQ(first, (std::vector<float>{1, 2}));
  EXPECT_EQ(second, (std::vector<float>{10, 20}));
}

TEST(MoverTest, AMoverErrorFailsBothSidesOfTheExchangeWithItsMessage) {
  FailingMover mover;
  InProcessTransport t(2, {}, &mover);
  std::vector<float> a{1}, got(1);
  std::string otherMessage;
  std::thread other([&] {
    P2POp ops[] = {op(false, 0, 0, got)};
    otherMessage = takeMessage(t.exchange(1, ops));
  });
  P2POp ops[] = {op(true, 1, 0, a)};
  std::string message = takeMessage(t.exchange(0, ops));
  other.join();
  EXPECT_NE(message.find("cudaMemcpyAsync failed"), std::string::npos) << message;
  EXPECT_NE(otherMessage.find("cudaMemcpyAsync failed"), std::string::npos) << otherMessage;
  EXPECT_TRUE(t.aborted());
}

} // namespace
} // namespace pipec::test
