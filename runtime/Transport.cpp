#include "runtime/Transport.h"

#include "ir/support/Error.h"

#include <algorithm>
#include <cstring>
#include <thread>

namespace pipec {

std::string describe(const TensorId &t) {
  return fmt::format("{}({},{},{})", toString(t.kind).str(), t.stage, t.mb, t.slice);
}

namespace {
/// "256 floats" (fp32) or "256 bf16 values".
std::string describeSize(const TensorView &t) {
  if (t.type == DType::F32)
    return fmt::format("{} floats", t.count);
  return fmt::format("{} {} values", t.count, kernels::toString(t.type));
}
bool sameShape(const TensorView &a, const TensorView &b) {
  return a.count == b.count && a.type == b.type;
}
} // namespace

InProcessTransport::InProcessTransport(int numThreads,
                                       std::function<std::string(int, size_t)> where,
                                       InProcessMover *mover)
    : numThreads(numThreads), where(std::move(where)), mover(mover),
      channels(size_t(numThreads) * size_t(numThreads)) {}

void InProcessTransport::matchLocked(Channel &c, llvm::SmallVectorImpl<Match> &matches) {
  while (c.sendHead < c.sends.size() && c.recvHead < c.recvs.size()) {
    Posted *s = c.sends[c.sendHead++];
    Posted *r = c.recvs[c.recvHead++];
    if (!(s->op.id == r->op.id) || !sameShape(s->op.data, r->op.data)) {
      failure =
          fmt::format("message mismatch: {} expects {} ({}) but the matching send, {}, "
                      "carries {} ({}); sends and recvs of a rank pair match in order, so "
                      "these tensors would have been swapped",
                      where(r->op.rank, r->op.step), describe(r->op.id), describeSize(r->op.data),
                      where(s->op.rank, s->op.step), describe(s->op.id), describeSize(s->op.data));
      failed = true;
      cv.notify_all();
      return;
    }
    matches.push_back({s, r});
  }
  if (c.sendHead == c.sends.size()) {
    c.sends.clear();
    c.sendHead = 0;
  }
  if (c.recvHead == c.recvs.size()) {
    c.recvs.clear();
    c.recvHead = 0;
  }
}

void InProcessTransport::failLocked(llvm::Error err) {
  if (failure.empty())
    failure = takeMessage(std::move(err));
  else
    llvm::consumeError(std::move(err)); // (the first failure is the one reported)
  failed = true;
}

llvm::Error InProcessTransport::deliver(const Match &m) {
  const P2POp &s = m.send->op, &r = m.recv->op;
  if (mover)
    return mover->deliver(s, m.send->owner, m.send->index, r, m.recv->owner, m.recv->index);
  if (!s.data.empty())
    std::memcpy(r.data.data, s.data.data, s.data.bytes());
  return llvm::Error::success();
}

llvm::Error InProcessTransport::exchange(int self, llvm::ArrayRef<P2POp> ops) {
  // Groups are small: keep their bookkeeping off the heap.
  Posted local[8];
  std::unique_ptr<Posted[]> heap;
  Posted *posted = local;
  if (ops.size() > 8) {
    heap = std::make_unique<Posted[]>(ops.size());
    posted = heap.get();
  }
  std::span<Posted> all(posted, ops.size());
  std::unique_lock<std::mutex> lock(mu);
  llvm::SmallVector<Match, 8> matches; // completed by this post: this thread delivers them
  for (size_t i = 0; i < ops.size(); ++i) {
    posted[i].op = ops[i];
    posted[i].owner = self;
    posted[i].index = i;
    if (ops[i].send && ops[i].drop) {
      posted[i].done.store(true); // "sent", but nobody will ever see it
      continue;
    }
    int src = ops[i].send ? self : ops[i].peer, dst = ops[i].send ? ops[i].peer : self;
    Channel &c = channels[size_t(src) * size_t(numThreads) + size_t(dst)];
    (ops[i].send ? c.sends : c.recvs).push_back(&posted[i]);
    matchLocked(c, matches);
  }
  if (!matches.empty()) {
    // Move the data outside the lock, so that the pairs of different ranks move side by side
    // (a device transport's copies and event calls, the cpu backend's memcpys). Until their
    // `done` is set, both owners of every pair stay in exchange() and keep their frames and
    // buffers; a failing one waits for `delivering` to drop to zero before it leaves.
    ++delivering;
    lock.unlock();
    llvm::Error err = [&]() -> llvm::Error {
      for (const Match &m : matches)
        if (llvm::Error e = deliver(m))
          return e;
      return llvm::Error::success();
    }();
    lock.lock();
    --delivering;
    if (err) {
      failLocked(std::move(err));
    } else {
      for (const Match &m : matches) {
        m.send->done.store(true, std::memory_order_release);
        m.recv->done.store(true, std::memory_order_release);
      }
    }
    // Wakes the owners of the pairs (or everyone, on a failure) and any failing waiter that
    // waits for the deliveries to end. A post that matches nothing wakes no one.
    cv.notify_all();
  }
  auto allDone = [&] {
    return std::all_of(all.begin(), all.end(),
                       [](const Posted &p) { return p.done.load(std::memory_order_acquire); });
  };
  // The partner is usually a few microseconds away: spin briefly before sleeping.
  lock.unlock();
  for (int spin = 0; spin < 4000 && !allDone() && !failed.load(); ++spin)
    std::this_thread::yield();
  // Every op met its partner and nothing failed: done, without taking the lock again (our ops
  // left the channels before their `done` was set; a failure after this point is the next
  // post's to report, as if we had looked a moment earlier).
  if (allDone() && !failed.load())
    return llvm::Error::success();
  lock.lock();
  cv.wait(lock, [&] { return !failure.empty() || allDone(); });
  if (!failure.empty()) {
    // Another thread may still be moving data of our ops (or into our buffers).
    cv.wait(lock, [&] { return delivering == 0; });
    // Take our ops out of the channels so nobody matches a dead stack frame.
    for (Channel &c : channels) {
      auto mine = [&](Posted *p) { return p->owner == self; };
      c.sends.erase(std::remove_if(c.sends.begin() + long(std::min(c.sendHead, c.sends.size())),
                                   c.sends.end(), mine),
                    c.sends.end());
      c.recvs.erase(std::remove_if(c.recvs.begin() + long(std::min(c.recvHead, c.recvs.size())),
                                   c.recvs.end(), mine),
                    c.recvs.end());
    }
    return llvm::make_error<Finding>(failure);
  }
  return llvm::Error::success();
}

llvm::Error InProcessTransport::allReduce(CollectiveGroup group, const std::string &key,
                                          llvm::ArrayRef<int> members, int self, TensorView data) {
  auto it = std::find(members.begin(), members.end(), self);
  assert(it != members.end() && "all-reduce by a non-member");
  size_t index = size_t(it - members.begin());
  std::unique_lock<std::mutex> lock(mu);
  // After a failure, members that were waiting have left (their buffers with them): a late
  // arriver must not complete the sum.
  if (!failure.empty())
    return llvm::make_error<Finding>(failure);
  Rendezvous &rv = rendezvous[key];
  if (rv.buffers.size() != members.size())
    rv.buffers.assign(members.size(), {});
  uint64_t generation = rv.generation;
  rv.buffers[index] = data;
  if (++rv.arrived == members.size()) {
    for (const auto &b : rv.buffers)
      if (!sameShape(b, data)) {
        failure = fmt::format("all-reduce {}: members pass {} and {}", key, describeSize(b),
                              describeSize(data));
        failed = true;
        cv.notify_all();
        return llvm::make_error<Finding>(failure);
      }
    // Sum outside the lock (as exchange() delivers), so that all-reduces of different groups
    // run side by side. Every other member waits for the generation to change and keeps its
    // buffer until then; a failing one waits for `delivering` to drop to zero first.
    llvm::SmallVector<TensorView, 8> buffers(rv.buffers.begin(), rv.buffers.end());
    ++delivering;
    lock.unlock();
    llvm::Error err = mover ? mover->sum(group, members, self, buffers) : hostSum(buffers);
    lock.lock();
    --delivering;
    if (err) {
      failLocked(std::move(err));
      cv.notify_all();
      return llvm::make_error<Finding>(failure);
    }
    rv.arrived = 0;
    ++rv.generation;
    cv.notify_all();
    return llvm::Error::success();
  }
  cv.wait(lock, [&] { return !failure.empty() || rv.generation != generation; });
  if (rv.generation == generation) {
    // The last member may still be summing into our buffer.
    cv.wait(lock, [&] { return delivering == 0; });
    return llvm::make_error<Finding>(failure);
  }
  return llvm::Error::success();
}

llvm::Error InProcessTransport::hostSum(llvm::ArrayRef<TensorView> buffers) {
  // Sum in member order into a scratch, then hand the same bits to everyone. (Host tensors are
  // the cpu backend's: fp32; floats() asserts it.)
  std::vector<float> sum(buffers[0].count, 0.0f);
  for (const auto &b : buffers) {
    std::span<const float> x = b.floats();
    for (size_t i = 0; i < sum.size(); ++i)
      sum[i] += x[i];
  }
  for (const auto &b : buffers)
    std::copy(sum.begin(), sum.end(), b.floats().begin());
  return llvm::Error::success();
}

void InProcessTransport::abort(const std::string &why) {
  std::lock_guard<std::mutex> lock(mu);
  if (failure.empty())
    failure = why;
  failed = true;
  cv.notify_all();
}

bool InProcessTransport::aborted() const {
  std::lock_guard<std::mutex> lock(mu);
  return !failure.empty();
}

} // namespace pipec
