//===- CostModel.cpp - docs/contracts.md#semantics' timing and memory rules ----------------===//
#include "ir/CostModel.h"

#include "ir/PlanText.h"
#include "ir/support/Error.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <tuple>

namespace pipec {

/// What a backward op takes of a quantity that splits into an input part (I's) and a weight part
/// (W's): a fused B both; 0 for any other op.
template <typename T> static T backwardShare(OpKind op, T input, T weight) {
  switch (op) {
  case OpKind::BackwardInput:
    return input;
  case OpKind::BackwardWeight:
    return weight;
  case OpKind::Backward:
    return input + weight;
  case OpKind::Forward:
  case OpKind::Send:
  case OpKind::Recv:
  case OpKind::AllReduce:
  case OpKind::OptimizerStep:
    break;
  }
  return 0;
}

double opTime(const StageInfo &st, OpKind op, int slice) {
  size_t k = size_t(slice);
  if (op == OpKind::Forward)
    return st.forward[k];
  return backwardShare(op, st.backwardInput[k], st.backwardWeight[k]);
}

double computeTime(const Plan &plan, const Instruction &i) {
  if (!i.isCompute())
    return 0;
  double t = opTime(plan.stages[size_t(i.stage)], i.op, i.slice);
  return i.parts > 0 ? t / i.parts : t;
}

double tpAllReduceTime(const Plan &plan, const Instruction &i) {
  assert(i.op == OpKind::AllReduce && i.collective == CollectiveGroup::Tp);
  return plan.stages[size_t(i.stage)].tpAllReduceTime[size_t(i.slice)];
}

double transferTime(const StageInfo &producer, TensorKind tensor, int slice) {
  const auto &times = tensor == TensorKind::Activation ? producer.activationTransferTime
                                                       : producer.gradientTransferTime;
  // (A stage table that never went through the partition pass has no transfer times.)
  return times.empty() ? 0.0 : times[size_t(slice)];
}

static bool isBackward(const Instruction &i) {
  return i.op == OpKind::BackwardInput || i.op == OpKind::Backward;
}

/// The part of slice k's activations that its own backward leaves to slice 0's.
static int64_t sequenceKv(const StageInfo &st, size_t k) {
  return k > 0 && k < st.sequenceKvBytes.size() ? st.sequenceKvBytes[k] : 0;
}

int64_t activationAllocatedAtStart(const StageInfo &st, const Instruction &i) {
  if (!i.isFirstPart())
    return 0;
  if (i.op == OpKind::Forward)
    return st.activationBytes[size_t(i.slice)];
  // The microbatch's first backward (its last slice's) allocates the whole sequence's dK/dV.
  if (isBackward(i) && size_t(i.slice) + 1 == st.activationBytes.size())
    return st.sequenceGradBytes;
  return 0;
}

int64_t activationFreedAtEnd(const StageInfo &st, const Instruction &i) {
  if (!i.isLastPart())
    return 0;
  size_t k = size_t(i.slice);
  int64_t a = st.activationBytes[k];
  int64_t w = st.weightGradBytes[k];
  // A slice's backward keeps its sequence state for slice 0's, which frees all of it.
  int64_t sequence = -sequenceKv(st, k);
  if (k == 0) {
    sequence = st.sequenceGradBytes;
    for (size_t j = 1; j < st.activationBytes.size(); ++j)
      sequence += sequenceKv(st, j);
  }
  // I frees the activations but the part W still reads (and the sequence state as above); W
  // frees that part.
  return backwardShare(i.op, a - w + sequence, w);
}

int64_t workspaceBytes(const StageInfo &st, int slice) {
  // (A stage table of an abstract model, or one that never went through the partition pass,
  // has none.)
  size_t k = size_t(slice);
  return k < st.workspaceBytes.size() ? st.workspaceBytes[k] : 0;
}

/// What a backward of slice k holds at its end beyond the slice's activations: an
/// input-gradient one, or a fused one (which may hold less: fused_backward_peak_bytes).
static int64_t backwardExtra(const StageInfo &st, size_t k, bool fused) {
  if (fused && k < st.fusedBackwardPeakBytes.size())
    return st.fusedBackwardPeakBytes[k];
  // (A request's stage table may leave weight_grad_bytes out: then it is 0.)
  int64_t w = k < st.weightGradBytes.size() ? st.weightGradBytes[k] : 0;
  int64_t extra = std::max<int64_t>(w - st.activationBytes[k], 0);
  if (k < st.backwardPeakBytes.size())
    extra = std::max(extra, st.backwardPeakBytes[k]);
  return extra;
}

int64_t activationHeldWhileRunning(const StageInfo &st, const Instruction &i) {
  if (!i.isCompute())
    return 0;
  int64_t held = workspaceBytes(st, i.slice);
  if (i.isLastPart() && (i.op == OpKind::BackwardInput || i.op == OpKind::Backward))
    held += backwardExtra(st, size_t(i.slice), i.op == OpKind::Backward);
  return held;
}

int64_t activationLifetimePeak(const StageInfo &st, int slice, bool fusedBackward) {
  // Every backward of a microbatch runs with the sequence's dK/dV allocated.
  size_t k = size_t(slice);
  return st.activationBytes[k] + backwardExtra(st, k, fusedBackward) + st.sequenceGradBytes;
}

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
          size_t missing = inputsReady(plan, keys, done, ins, r, ready, [&](size_t key) {
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
        t.end = clock[r] + tpAllReduceTime(plan, ins);
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

std::vector<OpTime> collectiveTimes(const Plan &plan, const Timeline &t, size_t r) {
  std::vector<OpTime> out(plan.ranks[r].size());
  // lastOpStart: when the compute op that ends at lastComputeEnd began (its first part).
  double streamFree = 0, lastComputeEnd = 0, lastOpStart = 0;
  for (size_t i = 0; i < plan.ranks[r].size(); ++i) {
    const Instruction &ins = plan.ranks[r][i];
    const OpTime &ot = t.ops[r][i];
    if (ins.isCompute() || (ins.op == OpKind::AllReduce && ins.collective == CollectiveGroup::Tp)) {
      // (A tp all-reduce's reduced output is what a later dp all-reduce waits for.)
      if (ins.isCompute() && ins.isFirstPart())
        lastOpStart = ot.start;
      lastComputeEnd = ot.end;
      continue;
    }
    if (ins.op != OpKind::AllReduce)
      continue;
    // dp and embedding all-reduces: serial on their own stream, after what precedes them.
    double start = std::max(streamFree, lastComputeEnd);
    double end = start;
    if (ins.collective == CollectiveGroup::Dp) {
      const StageInfo &st = plan.stages[size_t(ins.stage)];
      end = start + st.dpAllReduceTime;
      if (plan.overlapGradReduce) {
        // Bucket by bucket while the stage's last backward (the op just before) produces the
        // gradients, a layer's bucket at a time: the reduction starts with that op and ends
        // no sooner than one layer's share after it.
        double buckets = std::max(1, st.layerEnd - st.layerBegin);
        start = std::max(streamFree, lastOpStart);
        end = std::max(start + st.dpAllReduceTime, lastComputeEnd + st.dpAllReduceTime / buckets);
      }
      streamFree = end;
    }
    out[i] = OpTime{start, end};
  }
  return out;
}

double rankOptimizerTime(const Plan &plan, size_t rank) {
  double t = 0;
  for (const StageInfo &st : plan.stages)
    if (st.rank == int(rank))
      t += st.optimizerTime;
  return t;
}

StepFigures stepFigures(const Plan &plan, const std::vector<RankSpan> &ranks) {
  double first = std::numeric_limits<double>::infinity(), last = 0, maxSpan = 0, sumBusy = 0,
         stepEnd = 0, optimizer = 0, period = 0;
  for (const RankSpan &rs : ranks) {
    first = std::min(first, rs.start);
    last = std::max(last, rs.end);
    stepEnd = std::max(stepEnd, rs.stepEnd);
    maxSpan = std::max(maxSpan, rs.end - rs.start);
    sumBusy += rs.busy;
    optimizer = std::max(optimizer, rs.optimizer);
    period = std::max(period, rs.stepEnd + rs.optimizer - rs.start);
  }
  if (!std::isfinite(first))
    first = 0;
  StepFigures f;
  f.makespan = last - first;
  f.stepTime = stepEnd - first;
  if (optimizer > 0 || plan.optimizerSyncTime > 0)
    f.stepTime = plan.postValidation ? period : f.stepTime + plan.optimizerSyncTime + optimizer;
  double meanBusy = ranks.empty() ? 0 : sumBusy / double(ranks.size());
  f.bubbleRatio = maxSpan > 0 ? 1.0 - meanBusy / maxSpan : 0.0;
  return f;
}

llvm::Expected<double> simulateExecutedStep(const Plan &plan) {
  const size_t numRanks = plan.ranks.size();
  // When each side of a message, or each rank's n-th tied-embedding all-reduce, was posted.
  using Key = std::tuple<int, int, int, int, int>; // (kind: tensor or -1, stage, mb, slice, side)
  std::map<Key, double> posted;
  std::vector<size_t> pos(numRanks, 0), embeddings(numRanks, 0);
  std::vector<double> clock(numRanks, 0);
  std::vector<bool> groupPosted(numRanks, false);
  const bool embeddingLocal =
      plan.numStages() == 0 || plan.rankOf(0) == plan.rankOf(plan.numStages() - 1);
  auto groupEnd = [&](size_t r, size_t n) {
    const auto &stream = plan.ranks[r];
    size_t end = n + 1;
    if (stream[n].group != kNoGroup)
      while (end < stream.size() && stream[end].isP2P() && stream[end].group == stream[n].group)
        ++end;
    return end;
  };
  bool progress = true;
  while (progress) {
    progress = false;
    for (size_t r = 0; r < numRanks; ++r) {
      const auto &stream = plan.ranks[r];
      while (pos[r] < stream.size()) {
        const Instruction &i = stream[pos[r]];
        if (i.isP2P()) {
          const size_t end = groupEnd(r, pos[r]);
          if (!groupPosted[r]) {
            for (size_t n = pos[r]; n < end; ++n) {
              const Instruction &m = stream[n];
              posted[{int(m.tensor), m.stage, m.mb, m.slice, m.op == OpKind::Send}] = clock[r];
            }
            groupPosted[r] = true;
            progress = true;
          }
          double done = clock[r];
          bool all = true;
          for (size_t n = pos[r]; n < end && all; ++n) {
            const Instruction &m = stream[n];
            auto partner =
                posted.find({int(m.tensor), m.stage, m.mb, m.slice, m.op != OpKind::Send});
            if (partner == posted.end()) {
              all = false;
              break;
            }
            done =
                std::max(done, std::max(clock[r], partner->second) +
                                   transferTime(plan.stages[size_t(m.stage)], m.tensor, m.slice));
          }
          if (!all)
            break;
          clock[r] = done;
          groupPosted[r] = false;
          pos[r] = end;
          progress = true;
          continue;
        }
        if (i.op == OpKind::AllReduce && i.collective == CollectiveGroup::Embedding &&
            !embeddingLocal) {
          if (!groupPosted[r]) {
            posted[{-1, int(embeddings[r]), 0, 0, int(r)}] = clock[r];
            groupPosted[r] = true;
            progress = true;
          }
          const int other =
              int(r) == plan.rankOf(0) ? plan.rankOf(plan.numStages() - 1) : plan.rankOf(0);
          auto partner = posted.find({-1, int(embeddings[r]), 0, 0, other});
          if (partner == posted.end())
            break;
          clock[r] = std::max(clock[r], partner->second);
          ++embeddings[r];
          groupPosted[r] = false;
        } else if (i.isCompute()) {
          clock[r] += computeTime(plan, i);
        } else if (i.op == OpKind::AllReduce && i.collective == CollectiveGroup::Tp) {
          clock[r] += tpAllReduceTime(plan, i);
        } else if (i.op == OpKind::AllReduce && i.collective == CollectiveGroup::Dp) {
          clock[r] += plan.stages[size_t(i.stage)].dpAllReduceTime;
        } else if (i.op == OpKind::OptimizerStep) {
          clock[r] += rankOptimizerTime(plan, r);
        }
        ++pos[r];
        progress = true;
      }
    }
  }
  double end = 0;
  for (size_t r = 0; r < numRanks; ++r) {
    if (pos[r] < plan.ranks[r].size())
      return finding("the plan's exchanges cannot complete: rank {} waits at step {} ({})", r,
                     pos[r], formatToken(plan, plan.ranks[r][pos[r]]));
    end = std::max(end, clock[r]);
  }
  return end;
}

llvm::Error simulateStep(Plan &plan, Timeline *timeline) {
  Timeline own;
  Timeline &t = timeline ? *timeline : own;
  if (auto err = simulateTimeline(plan, t))
    return err;
  summarizeTimeline(plan, t, plan.stats);
  if (!plan.blockingP2p)
    return llvm::Error::success();
  auto executed = simulateExecutedStep(plan);
  if (!executed)
    return executed.takeError();
  plan.stats.stepTime = *executed + (plan.postValidation ? 0.0 : plan.optimizerSyncTime);
  return llvm::Error::success();
}

void summarizeTimeline(const Plan &plan, const Timeline &t, PlanStats &stats) {
  size_t numRanks = plan.ranks.size();
  stats.ranks.resize(numRanks);
  std::vector<RankSpan> spans(numRanks);
  for (size_t r = 0; r < numRanks; ++r) {
    RankStats &rs = stats.ranks[r];
    rs.rank = int(r);
    double busy = 0, start = std::numeric_limits<double>::infinity(), end = 0, dpFree = 0;
    bool any = false;
    std::vector<OpTime> collectives = collectiveTimes(plan, t, r);
    for (size_t i = 0; i < plan.ranks[r].size(); ++i) {
      const Instruction &ins = plan.ranks[r][i];
      const OpTime &ot = t.ops[r][i];
      if (ins.isCompute()) {
        // busy is compute time only (docs/contracts.md#semantics); a tp all-reduce occupies the
        // rank but is idle time for the pipeline, inside the span.
        any = true;
        busy += ot.end - ot.start;
        start = std::min(start, ot.start);
        end = std::max(end, ot.end);
      } else if (ins.op == OpKind::AllReduce && ins.collective == CollectiveGroup::Dp) {
        dpFree = std::max(dpFree, collectives[i].end);
      }
    }
    if (!any)
      start = 0;
    rs.busy = busy;
    rs.start = start;
    rs.end = end;
    rs.span = end - start;
    rs.stepEnd = std::max(end, dpFree);
    spans[r] = RankSpan{busy, start, end, rs.stepEnd, rankOptimizerTime(plan, r)};
  }
  StepFigures f = stepFigures(plan, spans);
  stats.simulated = true;
  stats.makespan = f.makespan;
  stats.stepTime = f.stepTime;
  stats.bubbleRatio = f.bubbleRatio;
}

} // namespace pipec
