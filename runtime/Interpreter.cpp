#include "runtime/Interpreter.h"

#include "ir/PlanText.h"
#include "ir/support/Error.h"

#include "llvm/Support/ErrorHandling.h"

#include <chrono>

namespace pipec {

RunShared::RunShared(const Plan &plan, Faults faults)
    : plan(plan), inProcess(plan.parallel.pp * plan.parallel.dp * plan.parallel.tp,
                            [&plan](int rank, size_t step) {
                              return fmt::format("rank {} step {} ({})", rank, step,
                                                 formatToken(plan, plan.ranks[size_t(rank)][step]));
                            }),
      transport(inProcess), faults(std::move(faults)),
      position(size_t(plan.parallel.pp * plan.parallel.dp * plan.parallel.tp)) {}

RunShared::RunShared(const Plan &plan, Faults faults, Transport &external)
    : plan(plan), inProcess(0, {}), transport(external), faults(std::move(faults)),
      position(size_t(plan.parallel.pp * plan.parallel.dp * plan.parallel.tp)) {}

void RunShared::enableTiming() {
  timings.assign(position.size(), {});
  for (size_t t = 0; t < timings.size(); ++t)
    timings[t].resize(plan.ranks[size_t(coordOf(int(t)).pp)].size());
}

Coord RunShared::coordOf(int thread) const {
  const ParallelConfig &pc = plan.parallel;
  return Coord{thread / (pc.dp * pc.tp), thread / pc.tp % pc.dp, thread % pc.tp};
}

namespace {

/// The identity the send at `step` puts on the wire (another step's, under a swap fault).
TensorId sentTensor(const RunShared &shared, int rank, size_t step) {
  const auto &stream = shared.plan.ranks[size_t(rank)];
  size_t from = step;
  if (shared.faults.swapSends && shared.faults.swapSends->first == rank) {
    auto [a, b] = shared.faults.swapSends->second;
    from = step == a ? b : step == b ? a : step;
  }
  const Instruction &i = stream[from];
  return TensorId{i.tensor, i.stage, i.mb, i.slice};
}

class StepRunner {
public:
  StepRunner(RunShared &shared, const Coord &c, Backend &backend)
      : shared(shared), plan(shared.plan), c(c), self(shared.threadOf(c)), backend(backend),
        stream(plan.ranks[size_t(c.pp)]) {
    // With tied embeddings whose copies share this rank, the later of the two ops sums them.
    if (plan.tiedEmbeddings() && plan.rankOf(0) == plan.rankOf(plan.numStages() - 1))
      for (size_t n = 0; n < stream.size(); ++n)
        if (stream[n].op == OpKind::AllReduce && stream[n].collective == CollectiveGroup::Embedding)
          localEmbeddingStep = n;
  }

  llvm::Error run() {
    // (--profile: the instructions' times; the stream's length when they are not timed.)
    std::vector<std::vector<float>> *timings =
        shared.timings.empty() ? nullptr : &shared.timings[size_t(self)];
    using Clock = std::chrono::steady_clock;
    for (size_t n = 0; n < stream.size();) {
      publish(n);
      const Instruction &i = stream[n];
      const Clock::time_point started = timings ? Clock::now() : Clock::time_point();
      size_t end = n + 1;
      if (i.isP2P()) {
        if (i.group != kNoGroup)
          while (end < stream.size() && stream[end].isP2P() && stream[end].group == i.group)
            ++end;
        if (auto err = exchange(n, end))
          return err;
      } else if (auto err = execute(n)) {
        return err;
      }
      if (timings) {
        if (auto err = backend.awaitCompute())
          return err;
        const float ms = std::chrono::duration<float, std::milli>(Clock::now() - started).count();
        for (size_t k = n; k < end; ++k)
          (*timings)[k].push_back(ms);
      }
      n = end;
    }
    publish(stream.size());
    return llvm::Error::success();
  }

private:
  RunShared &shared;
  const Plan &plan;
  Coord c;
  int self;
  Backend &backend;
  const std::vector<Instruction> &stream;
  std::optional<size_t> localEmbeddingStep;

  void publish(size_t n) {
    shared.position[size_t(self)].store(n, std::memory_order_relaxed);
    shared.progress.fetch_add(1, std::memory_order_relaxed);
  }

  llvm::Error exchange(size_t begin, size_t end) {
    llvm::SmallVector<P2POp, 4> ops;
    for (size_t n = begin; n < end; ++n) {
      const Instruction &i = stream[n];
      if (i.peer < 0 || i.peer >= plan.parallel.pp || i.peer == c.pp)
        return finding("rank {} step {}: {} names peer {}, not another of the plan's {} pipeline "
                       "ranks",
                       c.pp, n, toString(i.op).str(), i.peer, plan.parallel.pp);
      P2POp op;
      op.send = i.op == OpKind::Send;
      op.peer = shared.threadOf(Coord{i.peer, c.dp, c.tp});
      op.rank = c.pp;
      op.step = n;
      if (op.send) {
        // (A swap fault changes the identity on the wire; the receiver must notice.)
        op.id = sentTensor(shared, c.pp, n);
        op.data = backend.sendData(i);
        op.drop = shared.faults.dropSend && shared.faults.dropSend->first == c.pp &&
                  shared.faults.dropSend->second == n;
      } else {
        op.id = TensorId{i.tensor, i.stage, i.mb, i.slice};
        op.data = backend.recvData(i);
      }
      ops.push_back(std::move(op));
    }
    return shared.transport.exchange(self, ops);
  }

  llvm::Error execute(size_t n) {
    const Instruction &i = stream[n];
    switch (i.op) {
    case OpKind::Forward:
    case OpKind::BackwardInput:
    case OpKind::BackwardWeight:
    case OpKind::Backward:
      return backend.compute(i);
    case OpKind::AllReduce:
      return allReduce(n);
    case OpKind::OptimizerStep:
      return backend.optimizerStep();
    case OpKind::Send:
    case OpKind::Recv:
      break;
    }
    llvm_unreachable("p2p ops are exchanged in groups");
  }

  llvm::Error allReduce(size_t n) {
    const Instruction &i = stream[n];
    const ParallelConfig &pc = plan.parallel;
    llvm::SmallVector<int, 8> members;
    std::string key;
    switch (i.collective) {
    case CollectiveGroup::Tp:
      for (int t = 0; t < pc.tp; ++t)
        members.push_back(shared.threadOf(Coord{c.pp, c.dp, t}));
      key = fmt::format("tp/{}/{}", c.pp, c.dp);
      break;
    case CollectiveGroup::Dp:
      for (int d = 0; d < pc.dp; ++d)
        members.push_back(shared.threadOf(Coord{c.pp, d, c.tp}));
      key = fmt::format("dp/{}/{}/{}", c.pp, c.tp, i.stage);
      break;
    case CollectiveGroup::Embedding: {
      if (localEmbeddingStep) {
        // Both copies are on this rank: sum them once, at the later of the two ops.
        if (n == *localEmbeddingStep)
          backend.sumLocalEmbeddingCopies();
        return llvm::Error::success();
      }
      members.push_back(shared.threadOf(Coord{plan.rankOf(0), c.dp, c.tp}));
      members.push_back(shared.threadOf(Coord{plan.rankOf(plan.numStages() - 1), c.dp, c.tp}));
      key = fmt::format("emb/{}/{}", c.dp, c.tp);
      break;
    }
    }
    if (members.size() > 1)
      if (auto err =
              shared.transport.allReduce(i.collective, key, members, self, backend.reduceData(i)))
        return err;
    return backend.afterAllReduce(i);
  }
};

} // namespace

llvm::Error interpretStep(RunShared &shared, const Coord &c, Backend &backend) {
  return StepRunner(shared, c, backend).run();
}

} // namespace pipec
