#include "runtime/Profile.h"

#include <algorithm>
#include <map>
#include <set>
#include <tuple>

namespace pipec {

namespace {
constexpr OpKind kComputeOps[] = {OpKind::Forward, OpKind::BackwardInput, OpKind::BackwardWeight,
                                  OpKind::Backward};
constexpr CollectiveGroup kGroups[] = {CollectiveGroup::Tp, CollectiveGroup::Dp,
                                       CollectiveGroup::Embedding};

size_t computeIndex(OpKind op) {
  return size_t(std::find(std::begin(kComputeOps), std::end(kComputeOps), op) -
                std::begin(kComputeOps));
}
size_t groupIndex(CollectiveGroup g) {
  return size_t(std::find(std::begin(kGroups), std::end(kGroups), g) - std::begin(kGroups));
}
} // namespace

ProfileTable::ProfileTable(const Plan &plan)
    : plan(plan), numStages(plan.stages.size()),
      numSlices(plan.seqSlices.empty() ? 1 : plan.seqSlices.size()) {
  slots.assign(rankSlot(plan.parallel.pp), 0.0);
}

size_t ProfileTable::opSlot(int stage, OpKind op, int slice) const {
  return ((size_t(stage) * numSlices + size_t(slice)) * 4 + computeIndex(op)) * kTime;
}
size_t ProfileTable::messageSlot(int stage, TensorKind kind, int slice, bool send) const {
  size_t base = numStages * numSlices * 4 * kTime;
  return base + (((size_t(stage) * numSlices + size_t(slice)) * 2 +
                  (kind == TensorKind::Activation ? 0 : 1)) *
                     2 +
                 (send ? 0 : 1)) *
                    kTime;
}
size_t ProfileTable::collectiveSlot(int stage, CollectiveGroup group) const {
  size_t base = numStages * numSlices * (4 + 4) * kTime;
  return base + (size_t(stage) * 3 + groupIndex(group)) * kTime;
}
size_t ProfileTable::rankSlot(int pp) const {
  // Per rank: the optimizer's time, then the peak memory.
  return collectiveSlot(int(numStages), CollectiveGroup::Tp) + size_t(pp) * (kTime + 1);
}

void ProfileTable::put(size_t slot, std::vector<double> ms) {
  Measured m = summarizeSamples(std::move(ms));
  slots[slot] = m.medianMs;
  slots[slot + 1] = m.spreadMs;
  slots[slot + 2] = double(m.samples);
}

Measured ProfileTable::get(size_t slot) const {
  return Measured{slots[slot], slots[slot + 1], int64_t(slots[slot + 2])};
}

void ProfileTable::addRank(int pp, const std::vector<std::vector<float>> &timings,
                           int64_t peakBytes) {
  const auto &stream = plan.ranks[size_t(pp)];
  // Per slot, its samples: compute ops per (microbatch, step), their parts summed.
  std::map<size_t, std::vector<double>> samples;
  std::map<std::tuple<size_t, int, size_t>, double> parts; // (slot, mb, step) -> ms
  for (size_t n = 0; n < stream.size() && n < timings.size(); ++n) {
    const Instruction &i = stream[n];
    // Step 0 is the warm-up.
    for (size_t step = 1; step < timings[n].size(); ++step) {
      const double ms = timings[n][step];
      if (i.isCompute()) {
        parts[{opSlot(i.stage, i.op, i.slice), i.mb, step}] += ms;
      } else if (i.isP2P()) {
        const bool send = i.op == OpKind::Send;
        samples[messageSlot(i.stage, i.tensor, i.slice, send)].push_back(ms);
        exchanges[{i.tensor, i.stage, i.slice, i.mb}][send ? 0 : 1].push_back(ms);
      } else if (i.op == OpKind::AllReduce) {
        samples[collectiveSlot(i.stage, i.collective)].push_back(ms);
      } else if (i.op == OpKind::OptimizerStep) {
        samples[rankSlot(pp)].push_back(ms);
      }
    }
  }
  for (const auto &[key, ms] : parts)
    samples[std::get<0>(key)].push_back(ms);
  for (auto &[slot, ms] : samples)
    put(slot, std::move(ms));
  slots[rankSlot(pp) + kTime] = double(peakBytes);
}

MeasuredCosts ProfileTable::costs() const {
  MeasuredCosts c;
  c.numStages = int(numStages);
  c.numSlices = int(numSlices);
  for (int s = 0; s < int(numStages); ++s)
    for (int k = 0; k < int(numSlices); ++k)
      for (OpKind op : kComputeOps)
        if (Measured m = get(opSlot(s, op, k)); m.samples > 0)
          c.ops.push_back({s, op, k, m});
  // Messages: per (kind, size). An exchange is a rendezvous, so an observation is the transfer
  // plus however long a side waited for its partner: where one process timed both sides, each
  // message's observation is its smaller side's (the side that posted last waited for the
  // transfer alone), else each side's median stands in. Of those, the ones within twice the
  // fastest (plus 50 us) are the transfer's; the rest waited for something else of their group.
  std::map<std::pair<TensorKind, int64_t>, std::vector<double>> bySize;
  auto bytesOf = [&](TensorKind kind, int s, int k) {
    return plan.stages[size_t(kind == TensorKind::Activation ? s : s - 1)].outputBytes[size_t(k)];
  };
  std::set<std::tuple<TensorKind, int, int>> paired;
  for (const auto &[key, sides] : exchanges) {
    auto [kind, s, k, mb] = key;
    auto &out = bySize[{kind, bytesOf(kind, s, k)}];
    for (size_t n = 0; n < std::min(sides[0].size(), sides[1].size()); ++n) {
      out.push_back(std::min(sides[0][n], sides[1][n]));
      paired.insert({kind, s, k});
    }
  }
  for (int s = 0; s < int(numStages); ++s)
    for (int k = 0; k < int(numSlices); ++k)
      for (TensorKind kind : {TensorKind::Activation, TensorKind::Gradient}) {
        Measured send = get(messageSlot(s, kind, k, true)),
                 recv = get(messageSlot(s, kind, k, false));
        if (send.samples == 0 || recv.samples == 0 || paired.count({kind, s, k}) ||
            (kind == TensorKind::Gradient && s == 0))
          continue;
        bySize[{kind, bytesOf(kind, s, k)}].push_back(std::min(send.medianMs, recv.medianMs));
      }
  for (auto &[key, ms] : bySize) {
    if (ms.empty())
      continue;
    const double fastest = *std::min_element(ms.begin(), ms.end());
    std::vector<double> kept;
    for (double x : ms)
      if (x <= 2 * fastest + 0.05)
        kept.push_back(x);
    c.messages.push_back({key.first, key.second, summarizeSamples(std::move(kept))});
  }
  for (int s = 0; s < int(numStages); ++s)
    for (CollectiveGroup g : kGroups)
      if (Measured m = get(collectiveSlot(s, g)); m.samples > 0)
        c.collectives.push_back({g, s, m});
  for (int pp = 0; pp < plan.parallel.pp; ++pp)
    c.ranks.push_back({pp, get(rankSlot(pp)), int64_t(slots[rankSlot(pp) + kTime])});
  return c;
}

} // namespace pipec
