#include "compiler/Simulator.h"

#include "compiler/Semantics.h"
#include "ir/Error.h"
#include "ir/PlanText.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <limits>

namespace pipec {

namespace {
constexpr double kNotDone = -1.0;

/// Transfer time of an input produced on another rank.
double transferTime(const Plan &plan, const Input &in) {
  const StageInfo &p = plan.stages[size_t(in.stage)];
  return in.tensor == TensorKind::Activation ? p.activationTransferTime[size_t(in.slice)]
                                             : p.gradientTransferTime[size_t(in.slice)];
}
} // namespace

llvm::Error simulateTimeline(const Plan &plan, Timeline &out) {
  KeySpace keys(plan);
  size_t numRanks = plan.ranks.size();
  std::vector<double> done(keys.size(), kNotDone);
  std::vector<uint32_t> doneDepth(keys.size(), 0);
  // Ranks blocked on a key form a singly linked list from waitHead[key] through waitNext.
  std::vector<int32_t> waitHead(keys.size(), -1), waitNext(numRanks, -1);
  std::vector<size_t> pos(numRanks, 0);
  std::vector<double> clock(numRanks, 0);
  std::vector<uint32_t> lastDepth(numRanks, 0);
  std::vector<size_t> blockedOn(numRanks, SIZE_MAX);
  out.ops.assign(numRanks, {});
  out.depth.assign(numRanks, {});
  for (size_t r = 0; r < numRanks; ++r) {
    out.ops[r].resize(plan.ranks[r].size());
    out.depth[r].resize(plan.ranks[r].size());
  }
  std::vector<int32_t> work;
  work.reserve(numRanks);
  for (size_t r = numRanks; r-- > 0;)
    work.push_back(int32_t(r));

  while (!work.empty()) {
    size_t r = size_t(work.back());
    work.pop_back();
    blockedOn[r] = SIZE_MAX;
    const auto &stream = plan.ranks[r];
    for (; pos[r] < stream.size(); ++pos[r]) {
      const Instruction &ins = stream[pos[r]];
      OpTime &t = out.ops[r][pos[r]];
      if (ins.isCompute()) {
        double ready = clock[r];
        uint32_t depth = lastDepth[r];
        if (ins.isFirstPart()) {
          size_t missing = SIZE_MAX;
          forEachInput(plan, ins, [&](const Input &in) {
            if (missing != SIZE_MAX)
              return;
            size_t key = keys.key(in.stage, in.mb, in.slice, in.slot);
            if (done[key] == kNotDone) {
              missing = key;
              return;
            }
            double arrival = done[key];
            if (plan.rankOf(in.stage) != int(r))
              arrival += transferTime(plan, in);
            ready = std::max(ready, arrival);
            depth = std::max(depth, doneDepth[key]);
          });
          if (missing != SIZE_MAX) {
            blockedOn[r] = missing;
            waitNext[r] = waitHead[missing];
            waitHead[missing] = int32_t(r);
            break;
          }
        }
        t.start = ready;
        t.end = ready + computeTime(plan, ins);
        clock[r] = t.end;
        lastDepth[r] = depth + 1;
        out.depth[r][pos[r]] = depth + 1;
        if (ins.isLastPart()) {
          size_t key = keys.key(ins);
          done[key] = t.end;
          doneDepth[key] = depth + 1;
          if (ins.op == OpKind::Backward) { // a fused backward is also the W of its op
            done[key + 1] = t.end;
            doneDepth[key + 1] = depth + 1;
          }
          for (int32_t w = waitHead[key]; w >= 0;) {
            int32_t next = waitNext[size_t(w)];
            work.push_back(w);
            w = next;
          }
          waitHead[key] = -1;
        }
        continue;
      }
      if (ins.op == OpKind::AllReduce && ins.collective == CollectiveGroup::Tp) {
        // Megatron's tp all-reduce blocks the compute stream.
        t.start = clock[r];
        t.end = clock[r] + plan.stages[size_t(ins.stage)].tpAllReduceTime[size_t(ins.slice)];
        clock[r] = t.end;
        continue;
      }
      t.start = t.end = clock[r];
    }
  }
  // Anyone left blocked waits for something that never comes.
  for (size_t r = 0; r < numRanks; ++r) {
    if (pos[r] == plan.ranks[r].size())
      continue;
    const Instruction &ins = plan.ranks[r][pos[r]];
    size_t key = blockedOn[r];
    size_t slot = key % kNumSlots, rest = key / kNumSlots;
    int k = int(rest % keys.numSlices), m = int(rest / keys.numSlices % keys.numMb);
    int s = int(rest / keys.numSlices / keys.numMb);
    Instruction needed = Instruction::compute(slot == 0   ? OpKind::Forward
                                              : slot == 1 ? OpKind::BackwardInput
                                                          : OpKind::BackwardWeight,
                                              s, m, k);
    std::string neededTok = formatToken(plan, needed);
    if (slot == 1)
      neededTok += " (or fused B)";
    return finding("the compute order cannot run: rank {} step {} ({}) needs {}, which never "
                   "completes (it comes later on its rank, or is missing, or waits in a cycle)\n{}",
                   r, pos[r], formatToken(plan, ins), neededTok,
                   formatGrid(plan, {GridMark{int(r), pos[r]}}, /*computeOnly=*/false));
  }
  return llvm::Error::success();
}

void summarizeTimeline(const Plan &plan, const Timeline &t, PlanStats &stats) {
  size_t numRanks = plan.ranks.size();
  stats.ranks.resize(numRanks);
  double first = std::numeric_limits<double>::infinity(), last = 0, maxSpan = 0, sumBusy = 0,
         stepEnd = 0;
  for (size_t r = 0; r < numRanks; ++r) {
    RankStats &rs = stats.ranks[r];
    rs.rank = int(r);
    double busy = 0, start = std::numeric_limits<double>::infinity(), end = 0;
    double dpFree = 0, lastComputeEnd = 0;
    bool any = false;
    for (size_t i = 0; i < plan.ranks[r].size(); ++i) {
      const Instruction &ins = plan.ranks[r][i];
      const OpTime &ot = t.ops[r][i];
      if (ins.isCompute()) {
        // busy is compute time only (DESIGN §6); a tp all-reduce occupies the rank but is
        // idle time for the pipeline, inside the span.
        any = true;
        busy += ot.end - ot.start;
        start = std::min(start, ot.start);
        end = std::max(end, ot.end);
        lastComputeEnd = ot.end;
      } else if (ins.op == OpKind::AllReduce && ins.collective == CollectiveGroup::Tp) {
        lastComputeEnd = ot.end; // the reduced output is what the dp all-reduce waits for
      } else if (ins.op == OpKind::AllReduce) {
        // DP and embedding all-reduces: serial on their own stream, after what precedes them.
        // (The embedding all-reduce is not timed: it is one matrix between two ranks.)
        double s = std::max(dpFree, lastComputeEnd);
        if (ins.collective == CollectiveGroup::Dp)
          dpFree = s + plan.stages[size_t(ins.stage)].dpAllReduceTime;
      }
    }
    if (!any)
      start = 0;
    rs.busy = busy;
    rs.start = start;
    rs.end = end;
    rs.span = end - start;
    rs.stepEnd = std::max(end, dpFree);
    first = std::min(first, start);
    last = std::max(last, end);
    stepEnd = std::max(stepEnd, rs.stepEnd);
    maxSpan = std::max(maxSpan, rs.span);
    sumBusy += busy;
  }
  if (!std::isfinite(first))
    first = 0;
  stats.simulated = true;
  stats.makespan = last - first;
  stats.stepTime = stepEnd - first;
  double meanBusy = numRanks ? sumBusy / double(numRanks) : 0;
  stats.bubbleRatio = maxSpan > 0 ? 1.0 - meanBusy / maxSpan : 0.0;
}

std::string chromeTrace(const Plan &plan, const Timeline &t) {
  using OJson = nlohmann::ordered_json;
  // Chrome traces count microseconds: a plan in ms maps 1:1000; an abstract unit is shown as 1 ms.
  double scale = 1000.0;
  OJson events = OJson::array();
  events.push_back(
      OJson{{"name", "process_name"},
            {"ph", "M"},
            {"pid", 0},
            {"args", OJson{{"name", fmt::format("{} ({}, time unit: {})", plan.schedule, plan.model,
                                                plan.timeUnit)}}}});
  for (size_t r = 0; r < plan.ranks.size(); ++r) {
    events.push_back(OJson{{"name", "thread_name"},
                           {"ph", "M"},
                           {"pid", 0},
                           {"tid", r},
                           {"args", OJson{{"name", fmt::format("rank {}", r)}}}});
    events.push_back(OJson{{"name", "thread_sort_index"},
                           {"ph", "M"},
                           {"pid", 0},
                           {"tid", r},
                           {"args", OJson{{"sort_index", r}}}});
  }
  for (size_t r = 0; r < plan.ranks.size(); ++r) {
    for (size_t i = 0; i < plan.ranks[r].size(); ++i) {
      const Instruction &ins = plan.ranks[r][i];
      const OpTime &ot = t.ops[r][i];
      bool timed =
          ins.isCompute() || (ins.op == OpKind::AllReduce && ins.collective == CollectiveGroup::Tp);
      OJson e;
      e["name"] = formatToken(plan, ins);
      e["cat"] = timed ? (ins.isCompute() ? std::string(1, computeLetter(ins.op)) : "tp")
                       : toString(ins.op).str();
      e["ph"] = timed ? "X" : "i";
      e["ts"] = ot.start * scale;
      if (timed)
        e["dur"] = (ot.end - ot.start) * scale;
      else
        e["s"] = "t";
      e["pid"] = 0;
      e["tid"] = r;
      OJson args;
      args["step"] = i;
      if (ins.stage >= 0)
        args["stage"] = ins.stage;
      if (ins.mb >= 0)
        args["mb"] = ins.mb;
      if (ins.isP2P())
        args["peer"] = ins.peer;
      e["args"] = std::move(args);
      events.push_back(std::move(e));
    }
  }
  OJson j;
  j["traceEvents"] = std::move(events);
  j["displayTimeUnit"] = "ms";
  return j.dump(-1, ' ', false, OJson::error_handler_t::replace) + "\n";
}

} // namespace pipec
