//===- LowerComms.cpp - Send/recv pairs, deadlock-free by construction ----===//
//
// Establishes: every cross-rank edge has exactly one send (after its producer) and one recv
// (before its consumer); consecutive comm ops of a rank form one group; the plan is
// deadlock-free under NCCL's rules (docs/contracts.md#semantics) and FIFO-consistent per rank pair.
//
// How: simulate the compute order to get a global order g of all compute ops (a linear
// extension of stream order and data dependencies: by start time, then by dependency depth,
// rank and step). A tensor made by P on rank a for rank b becomes a message of "round" g(P):
// the send goes on a right after P; the recv goes on b after b's ops with g <= g(P), i.e.
// before b's first op that is later than P (so before the consumer, which is later than P).
// Each rank's comm ops then appear in increasing round order, and runs of comm ops with no
// compute between them become one group.
// Why it cannot deadlock: a rank blocked in a group G waits for a partner of some round x in G
// to be posted; the peer, if it has not posted it, is blocked in an earlier group whose rounds
// are all below x <= max(G). Following waits, max round strictly decreases, so no wait cycle
// exists. Why FIFO holds: both the sends a->b and the recvs on b from a are in round order.
//
//===----------------------------------------------------------------------===//
#include "compiler/Pass.h"

#include "ir/CostModel.h"
#include "ir/Semantics.h"
#include "ir/support/Error.h"

#include <algorithm>
#include <cassert>
#include <numeric>
#include <tuple>

namespace pipec {
namespace {

/// A cross-rank tensor: made in `round` (the global index of its producer) on rank `from`,
/// consumed on rank `to`.
struct Message {
  uint64_t round;
  int32_t from, to;
  TensorKind tensor;
  int32_t stage, mb, slice;
};

/// The global order of all compute ops, as each op's index g in it: by (start, depth, rank,
/// step). Along a rank's stream both start and depth grow (an op starts after the previous one
/// ends and its depth is one more), so each rank is already in that order and the global order
/// is their merge.
std::vector<std::vector<uint64_t>> globalOrder(const Plan &plan, const Timeline &timeline) {
  struct Head {
    double start;
    uint32_t depth;
    int32_t rank;
  };
  auto later = [](const Head &a, const Head &b) {
    return std::tie(a.start, a.depth, a.rank) > std::tie(b.start, b.depth, b.rank);
  };
  std::vector<std::vector<uint64_t>> order(plan.ranks.size());
  std::vector<Head> heads;
  for (size_t r = 0; r < plan.ranks.size(); ++r) {
    order[r].resize(plan.ranks[r].size());
    if (!plan.ranks[r].empty())
      heads.push_back(Head{timeline.ops[r][0].start, timeline.depth[r][0], int32_t(r)});
  }
  std::make_heap(heads.begin(), heads.end(), later);
  std::vector<size_t> next(plan.ranks.size(), 0);
  for (uint64_t g = 0; !heads.empty(); ++g) {
    std::pop_heap(heads.begin(), heads.end(), later);
    size_t r = size_t(heads.back().rank);
    size_t n = next[r]++;
    order[r][n] = g;
    if (n + 1 < plan.ranks[r].size()) {
      assert(std::tie(timeline.ops[r][n].start, timeline.depth[r][n]) <
                 std::tie(timeline.ops[r][n + 1].start, timeline.depth[r][n + 1]) &&
             "a rank's compute ops are in (start, depth) order");
      heads.back() = Head{timeline.ops[r][n + 1].start, timeline.depth[r][n + 1], int32_t(r)};
      std::push_heap(heads.begin(), heads.end(), later);
    } else {
      heads.pop_back();
    }
  }
  return order;
}

/// One message per cross-rank input, each in the round of its producer.
std::vector<Message> crossRankInputs(const Plan &plan,
                                     const std::vector<std::vector<uint64_t>> &order) {
  // Where each op's output is produced: global index, by key.
  KeySpace keys(plan);
  std::vector<uint64_t> producedAt(keys.size(), UINT64_MAX);
  for (size_t r = 0; r < plan.ranks.size(); ++r)
    for (size_t n = 0; n < plan.ranks[r].size(); ++n)
      producedAt[keys.key(plan.ranks[r][n])] = order[r][n];
  std::vector<Message> messages;
  messages.reserve(plan.numInstructions()); // about one cross-rank input per op at most
  for (size_t r = 0; r < plan.ranks.size(); ++r) {
    for (const Instruction &c : plan.ranks[r]) {
      forEachInput(plan, c, [&](const Input &in) {
        int from = plan.rankOf(in.stage);
        if (from == int(r))
          return;
        uint64_t round = producedAt[keys.key(in.stage, in.mb, in.slice, in.slot)];
        assert(round < plan.numInstructions() && "simulateTimeline ran every producer");
        messages.push_back(Message{round, from, int32_t(r), in.tensor, in.stage, in.mb, in.slice});
      });
    }
  }
  return messages;
}

/// Each rank's comm ops, as message indices (times 2, plus 1 for the recv end), in round order:
/// a counting sort by round (rounds are global indices of compute ops), then by (consumer rank,
/// tensor, stage, mb, slice) within a round (one producer's messages). Each rank's comm ops come
/// sorted by (round, op, peer, tensor, stage, mb, slice): a round's ops on a rank are all sends
/// (its producer's rank) or all recvs from that one rank.
std::vector<std::vector<uint32_t>> commsByRound(const Plan &plan,
                                                const std::vector<Message> &messages) {
  const size_t numOps = plan.numInstructions(); // compute ops only, here
  std::vector<size_t> perRank(plan.ranks.size(), 0);
  std::vector<uint32_t> bucket(numOps + 1, 0);
  for (const Message &m : messages) {
    ++bucket[m.round + 1];
    ++perRank[size_t(m.from)];
    ++perRank[size_t(m.to)];
  }
  for (size_t g = 0; g < numOps; ++g)
    bucket[g + 1] += bucket[g];
  std::vector<uint32_t> byRound(messages.size());
  for (size_t i = 0; i < messages.size(); ++i)
    byRound[bucket[messages[i].round]++] = uint32_t(i);
  auto tieKey = [&](uint32_t i) {
    const Message &m = messages[i];
    return std::tie(m.to, m.tensor, m.stage, m.mb, m.slice);
  };
  std::vector<std::vector<uint32_t>> comms(plan.ranks.size());
  for (size_t r = 0; r < plan.ranks.size(); ++r)
    comms[r].reserve(perRank[r]);
  for (size_t b = 0, e = 0; b < byRound.size(); b = e) {
    for (e = b + 1; e < byRound.size() && messages[byRound[e]].round == messages[byRound[b]].round;)
      ++e;
    if (e - b > 1)
      std::sort(byRound.begin() + ptrdiff_t(b), byRound.begin() + ptrdiff_t(e),
                [&](uint32_t x, uint32_t y) { return tieKey(x) < tieKey(y); });
    for (size_t j = b; j < e; ++j) {
      const Message &m = messages[byRound[j]];
      comms[size_t(m.from)].push_back(2 * byRound[j]);
      comms[size_t(m.to)].push_back(2 * byRound[j] + 1);
    }
  }
  return comms;
}

/// Rank r's stream with its comm ops `pending` put in: before each compute op, every comm op
/// of an earlier round, as one group when there are several.
std::vector<Instruction> withComms(const Plan &plan, size_t r, const std::vector<uint64_t> &order,
                                   const std::vector<Message> &messages,
                                   const std::vector<uint32_t> &pending) {
  std::vector<Instruction> merged;
  merged.reserve(plan.ranks[r].size() + pending.size());
  size_t next = 0;
  int32_t group = 0;
  auto flush = [&](uint64_t upTo) {
    // Comm ops of rounds <= upTo, as one group when there are several.
    size_t begin = next;
    while (next < pending.size() && messages[pending[next] / 2].round <= upTo)
      ++next;
    bool grouped = next - begin > 1;
    for (size_t i = begin; i < next; ++i) {
      const Message &m = messages[pending[i] / 2];
      Instruction ins;
      ins.op = pending[i] % 2 ? OpKind::Recv : OpKind::Send;
      ins.tensor = m.tensor;
      ins.stage = m.stage;
      ins.mb = m.mb;
      ins.slice = m.slice;
      ins.peer = pending[i] % 2 ? m.from : m.to;
      ins.bytes = tensorBytes(plan, m.tensor, m.stage, m.slice);
      ins.group = grouped ? group : kNoGroup;
      merged.push_back(ins);
    }
    group += grouped ? 1 : 0;
  };
  for (size_t n = 0; n < plan.ranks[r].size(); ++n) {
    // Before compute op n: everything of a round earlier than it.
    if (order[n] > 0)
      flush(order[n] - 1);
    merged.push_back(plan.ranks[r][n]);
  }
  flush(UINT64_MAX);
  return merged;
}

class LowerCommsPass final : public Pass {
public:
  llvm::StringRef name() const override { return "lower-comms"; }

  llvm::Expected<bool> run(Plan &plan, PassContext &ctx) override {
    for (const auto &stream : plan.ranks)
      for (const Instruction &i : stream)
        if (!i.isCompute())
          return finding("lower-comms expects compute-only streams (found {})",
                         toString(i.op).str());
    Timeline timeline;
    if (auto err = simulateTimeline(plan, timeline))
      return err;
    std::vector<std::vector<uint64_t>> order = globalOrder(plan, timeline);
    std::vector<Message> messages = crossRankInputs(plan, order);
    std::vector<std::vector<uint32_t>> comms = commsByRound(plan, messages);
    bool changed = false;
    for (size_t r = 0; r < plan.ranks.size(); ++r) {
      if (comms[r].empty())
        continue;
      changed = true;
      plan.ranks[r] = withComms(plan, r, order[r], messages, comms[r]);
    }
    ctx.commsLowered = true;
    return changed;
  }
};

} // namespace

std::unique_ptr<Pass> createLowerCommsPass() { return std::make_unique<LowerCommsPass>(); }

} // namespace pipec
