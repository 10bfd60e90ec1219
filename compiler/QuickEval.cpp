//===- QuickEval.cpp - Step time and memory of a compute order, without lowering ------===//
//
// Mirrors, operation for operation, what lower-collectives produces and what the simulate and
// memory passes then compute (compiler/LowerCollectives.cpp, Simulator.cpp, Memory.cpp):
//   - an op of a stage with tp_allreduces n > 0 (at tp > 1), other than a weight gradient, runs
//     as n parts of t/n, each followed by a tp all-reduce on the same stream; its output is
//     ready at the end of its last part;
//   - the dp all-reduce of a stage follows the stage's last weight gradient on the rank (after
//     that op's tp all-reduces), serial on the dp stream;
//   - memory: the same events at the same points of the stream.
// Every time and byte count is ir/CostModel.h's (op, transfer and tp all-reduce times, the
// activation rule): this walk only replays lowering's placement of them.
//
//===----------------------------------------------------------------------===//
#include "compiler/QuickEval.h"

#include "ir/CostModel.h"
#include "ir/Error.h"
#include "ir/Semantics.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace pipec {

namespace {

/// tp parts of a compute op, as lower-collectives splits it (0: not split).
int partsOf(const Plan &plan, const Instruction &i) {
  if (plan.parallel.tp <= 1 || i.op == OpKind::BackwardWeight)
    return 0;
  return std::max(plan.stages[size_t(i.stage)].tpAllReduces, 0);
}

struct RankClock {
  size_t pos = 0;
  double clock = 0;
  // What summarizeTimeline accumulates, in stream order.
  double busy = 0, start = std::numeric_limits<double>::infinity(), end = 0;
  double dpFree = 0, lastComputeEnd = 0;
  bool any = false;
};

} // namespace

llvm::Error quickEvaluate(const Plan &plan, QuickStats &out) {
  KeySpace keys(plan);
  size_t numRanks = plan.ranks.size();
  std::vector<double> done(keys.size(), kNotDone);
  std::vector<int32_t> waitHead(keys.size(), -1), waitNext(numRanks, -1);
  std::vector<RankClock> rc(numRanks);
  // The stage whose last weight-gradient op is at step n of rank r: its dp all-reduce follows.
  std::vector<std::vector<int32_t>> dpAfter(numRanks);
  if (plan.parallel.dp > 1) {
    for (size_t r = 0; r < numRanks; ++r) {
      const auto &stream = plan.ranks[r];
      dpAfter[r].assign(stream.size(), -1);
      std::vector<int32_t> last(plan.stages.size(), -1);
      for (size_t n = 0; n < stream.size(); ++n)
        if (stream[n].op == OpKind::BackwardWeight || stream[n].op == OpKind::Backward)
          last[size_t(stream[n].stage)] = int32_t(n);
      for (size_t s = 0; s < last.size(); ++s)
        if (last[s] >= 0)
          dpAfter[r][size_t(last[s])] = int32_t(s);
    }
  }
  std::vector<int32_t> work;
  work.reserve(numRanks);
  for (size_t r = numRanks; r-- > 0;)
    work.push_back(int32_t(r));

  while (!work.empty()) {
    size_t r = size_t(work.back());
    work.pop_back();
    RankClock &me = rc[r];
    const auto &stream = plan.ranks[r];
    for (; me.pos < stream.size(); ++me.pos) {
      const Instruction &ins = stream[me.pos];
      double ready = me.clock;
      size_t missing = inputsReady(plan, keys, done, ins, r, ready, [](size_t) {});
      if (missing != SIZE_MAX) {
        waitNext[r] = waitHead[missing];
        waitHead[missing] = int32_t(r);
        break;
      }
      int parts = partsOf(plan, ins);
      const StageInfo &st = plan.stages[size_t(ins.stage)];
      Instruction part = ins;
      part.parts = parts;
      double duration = computeTime(plan, part);
      double outputAt = 0;
      me.any = true;
      me.start = std::min(me.start, ready);
      if (parts == 0) {
        double end = ready + duration;
        me.busy += end - ready;
        me.end = std::max(me.end, end);
        me.lastComputeEnd = end;
        me.clock = end;
        outputAt = end;
      } else {
        double at = ready;
        double allReduce = st.tpAllReduceTime[size_t(ins.slice)];
        for (int p = 0; p < parts; ++p) {
          double end = at + duration;
          me.busy += end - at;
          me.end = std::max(me.end, end);
          outputAt = end;
          at = end + allReduce; // the part's tp all-reduce
        }
        me.lastComputeEnd = at;
        me.clock = at;
      }
      if (plan.parallel.dp > 1 && dpAfter[r][me.pos] >= 0) {
        double s = std::max(me.dpFree, me.lastComputeEnd);
        me.dpFree = s + plan.stages[size_t(dpAfter[r][me.pos])].dpAllReduceTime;
      }
      size_t key = keys.key(ins);
      done[key] = outputAt;
      if (ins.op == OpKind::Backward)
        done[key + 1] = outputAt;
      for (int32_t w = waitHead[key]; w >= 0;) {
        int32_t next = waitNext[size_t(w)];
        work.push_back(w);
        w = next;
      }
      waitHead[key] = -1;
    }
  }
  for (size_t r = 0; r < numRanks; ++r)
    if (rc[r].pos != plan.ranks[r].size())
      return finding("the compute order cannot run: rank {} waits at step {} for an input that "
                     "never comes",
                     r, rc[r].pos);

  std::vector<RankSpan> spans;
  spans.reserve(numRanks);
  for (size_t r = 0; r < numRanks; ++r) {
    const RankClock &me = rc[r];
    double start = me.any ? me.start : 0;
    spans.push_back(
        RankSpan{me.busy, start, me.end, std::max(me.end, me.dpFree), rankOptimizerTime(plan, r)});
  }
  StepFigures f = stepFigures(plan, spans);
  double busy = 0;
  for (const RankSpan &s : spans)
    busy += s.busy;
  out.meanBusy = spans.empty() ? 0 : busy / double(spans.size());
  out.makespan = f.makespan;
  out.stepTime = f.stepTime;
  out.bubbleRatio = f.bubbleRatio;

  // Memory: the memory pass's events on the compute ops (receive buffers aside).
  out.peakActivationBytes.assign(numRanks, 0);
  out.staticBytes.assign(numRanks, 0);
  for (size_t r = 0; r < numRanks; ++r) {
    int64_t act = 0, peak = 0;
    for (const Instruction &i : plan.ranks[r]) {
      // Compute-only streams: every op is whole (its first and last part).
      const StageInfo &st = plan.stages[size_t(i.stage)];
      act += activationAllocatedAtStart(st, i);
      peak = std::max(peak, act + activationHeldWhileRunning(st, i));
      act -= activationFreedAtEnd(st, i);
    }
    out.peakActivationBytes[r] = peak;
    int64_t params = 0;
    for (const StageInfo &st : plan.stages)
      if (st.rank == int(r))
        params += st.paramBytes;
    out.staticBytes[r] = int64_t(double(params) * plan.stateBytesPerParamByte);
  }
  return llvm::Error::success();
}

} // namespace pipec
