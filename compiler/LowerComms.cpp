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

#include "compiler/Semantics.h"
#include "compiler/Simulator.h"
#include "ir/Error.h"

#include <algorithm>
#include <numeric>
#include <tuple>

namespace pipec {
namespace {

struct PendingComm {
  uint64_t round;
  Instruction ins;
};

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
    // Global order of all compute ops.
    struct Ref {
      double start;
      uint32_t depth;
      int32_t rank;
      uint32_t step;
    };
    std::vector<Ref> refs;
    refs.reserve(plan.numInstructions());
    for (size_t r = 0; r < plan.ranks.size(); ++r)
      for (size_t n = 0; n < plan.ranks[r].size(); ++n)
        refs.push_back(
            Ref{timeline.ops[r][n].start, timeline.depth[r][n], int32_t(r), uint32_t(n)});
    std::sort(refs.begin(), refs.end(), [](const Ref &a, const Ref &b) {
      return std::tie(a.start, a.depth, a.rank, a.step) <
             std::tie(b.start, b.depth, b.rank, b.step);
    });
    std::vector<std::vector<uint64_t>> order(plan.ranks.size());
    for (size_t r = 0; r < plan.ranks.size(); ++r)
      order[r].resize(plan.ranks[r].size());
    for (size_t g = 0; g < refs.size(); ++g)
      order[size_t(refs[g].rank)][refs[g].step] = g;

    // Where each op's output is produced: global index, by key.
    KeySpace keys(plan);
    std::vector<uint64_t> producedAt(keys.size(), UINT64_MAX);
    for (size_t r = 0; r < plan.ranks.size(); ++r)
      for (size_t n = 0; n < plan.ranks[r].size(); ++n)
        producedAt[keys.key(plan.ranks[r][n])] = order[r][n];

    std::vector<std::vector<PendingComm>> comms(plan.ranks.size());
    for (size_t r = 0; r < plan.ranks.size(); ++r) {
      for (const Instruction &c : plan.ranks[r]) {
        forEachInput(plan, c, [&](const Input &in) {
          int from = plan.rankOf(in.stage);
          if (from == int(r))
            return;
          uint64_t round = producedAt[keys.key(in.stage, in.mb, in.slice, in.slot)];
          Instruction send;
          send.op = OpKind::Send;
          send.tensor = in.tensor;
          send.stage = in.stage;
          send.mb = in.mb;
          send.slice = in.slice;
          send.peer = int32_t(r);
          send.bytes = tensorBytes(plan, in.tensor, in.stage, in.slice);
          Instruction recv = send;
          recv.op = OpKind::Recv;
          recv.peer = from;
          comms[size_t(from)].push_back(PendingComm{round, send});
          comms[r].push_back(PendingComm{round, recv});
        });
      }
    }
    bool changed = false;
    for (size_t r = 0; r < plan.ranks.size(); ++r) {
      auto &pending = comms[r];
      if (pending.empty())
        continue;
      changed = true;
      std::sort(pending.begin(), pending.end(), [](const PendingComm &a, const PendingComm &b) {
        auto key = [](const PendingComm &c) {
          return std::make_tuple(c.round, c.ins.op, c.ins.peer, c.ins.tensor, c.ins.stage, c.ins.mb,
                                 c.ins.slice);
        };
        return key(a) < key(b);
      });
      std::vector<Instruction> merged;
      merged.reserve(plan.ranks[r].size() + pending.size());
      size_t next = 0;
      int32_t group = 0;
      auto flush = [&](uint64_t upTo) {
        // Comm ops of rounds <= upTo, as one group when there are several.
        size_t begin = next;
        while (next < pending.size() && pending[next].round <= upTo)
          ++next;
        bool grouped = next - begin > 1;
        for (size_t i = begin; i < next; ++i) {
          Instruction ins = pending[i].ins;
          ins.group = grouped ? group : kNoGroup;
          merged.push_back(ins);
        }
        group += grouped ? 1 : 0;
      };
      for (size_t n = 0; n < plan.ranks[r].size(); ++n) {
        // Before compute op n: everything of a round earlier than it.
        if (order[r][n] > 0)
          flush(order[r][n] - 1);
        merged.push_back(plan.ranks[r][n]);
      }
      flush(UINT64_MAX);
      plan.ranks[r] = std::move(merged);
    }
    ctx.commsLowered = true;
    return changed;
  }
};

} // namespace

std::unique_ptr<Pass> createLowerCommsPass() { return std::make_unique<LowerCommsPass>(); }

} // namespace pipec
