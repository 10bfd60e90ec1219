#include "ir/MeasuredCosts.h"

#include "ir/Semantics.h"
#include "ir/support/Error.h"

#include <algorithm>
#include <map>
#include <set>
#include <tuple>

namespace pipec {

llvm::Error applyMeasuredCosts(const MeasuredCosts &c, llvm::StringRef source, Plan &plan) {
  if (plan.timeUnit != "ms")
    return inputError("{}: measured costs are in ms, but the model's times are in '{}' (an "
                      "abstract model); use --costs with a transformer model spec",
                      source, plan.timeUnit);
  if (size_t(c.numStages) != plan.stages.size())
    return inputError("{}: $.stages: {} stages measured, the plan has {} (--pp x --vpp); "
                      "profile a plan of this layout",
                      source, c.numStages, plan.stages.size());
  const size_t k = plan.seqSlices.empty() ? 1 : plan.seqSlices.size();
  if (size_t(c.numSlices) != k)
    return inputError("{}: $.slices: {} sub-sequences measured, the plan has {} (--seq-splits); "
                      "profile a plan with --seq-splits {}",
                      source, c.numSlices, k, k);
  if (c.ranks.size() > size_t(plan.parallel.pp) ||
      (!c.ranks.empty() && c.ranks.size() != size_t(plan.parallel.pp)))
    return inputError("{}: $.ranks: {} pipeline ranks measured, the plan has {} (--pp)", source,
                      c.ranks.size(), plan.parallel.pp);
  // Measured without sequence parallelism or ZeRO-1 (piperun runs neither): in their place the
  // times would silently undo the flag's effect on the step.
  if (plan.parallel.sequenceParallel)
    return inputError("{}: the profile's layers ran without sequence parallelism (piperun does "
                      "not run it), so its times would cancel --sequence-parallel's; drop one of "
                      "the two",
                      source);
  if (plan.parallel.cp > 1)
    return inputError("{}: the profile's layers each ran a whole sequence (piperun does not run "
                      "context parallelism), so its times would cancel --cp's; drop one of the two",
                      source);
  if (plan.parallel.distributedOptimizer)
    return inputError("{}: the profile's optimizer step updated every weight on every replica "
                      "(piperun does not shard it), so its time would cancel "
                      "--distributed-optimizer's; drop one of the two",
                      source);
  // A profile of another model, microbatch size or sequence length: the file records the plan's
  // own message sizes, and none of a kind is one this plan sends.
  const int n = plan.numStages();
  for (TensorKind kind : {TensorKind::Activation, TensorKind::Gradient}) {
    std::set<int64_t> measured, sent;
    for (const MeasuredCosts::Message &m : c.messages)
      if (m.kind == kind)
        measured.insert(m.bytes);
    for (const StageInfo &st : plan.stages)
      for (size_t i = 0; i < k; ++i) {
        const int s = st.stage, to = kind == TensorKind::Activation ? s + 1 : s - 1;
        if (to >= 0 && to < n && plan.rankOf(to) != st.rank)
          sent.insert(tensorBytes(plan, kind, s, int(i)));
      }
    if (measured.empty() || sent.empty() ||
        std::any_of(measured.begin(), measured.end(), [&](int64_t b) { return sent.count(b); }))
      continue;
    return inputError(
        "{}: $.messages: the profile's {} messages are of {} bytes, this plan's of "
        "{}: it was measured on another model, microbatch size or sequence length (or "
        "with sequence parallelism); profile a plan of this model and layout",
        source, toString(kind).str(), *measured.begin(), *sent.begin());
  }
  // Compute ops.
  std::map<std::tuple<int, OpKind, int>, double> ms;
  for (const MeasuredCosts::Op &op : c.ops)
    ms[{op.stage, op.op, op.slice}] = op.time.medianMs;
  auto find = [&](int s, OpKind op, size_t slice) -> const double * {
    auto it = ms.find({s, op, int(slice)});
    return it == ms.end() ? nullptr : &it->second;
  };
  for (StageInfo &st : plan.stages)
    for (size_t i = 0; i < k; ++i) {
      if (const double *f = find(st.stage, OpKind::Forward, i))
        st.forward[i] = *f;
      const double *b = find(st.stage, OpKind::BackwardInput, i);
      const double *w = find(st.stage, OpKind::BackwardWeight, i);
      const double *fused = find(st.stage, OpKind::Backward, i);
      if (b)
        st.backwardInput[i] = *b;
      if (w)
        st.backwardWeight[i] = *w;
      if (fused && !b && !w) {
        // Split as the model splits it: the schedule may run the two apart.
        double model = st.backwardInput[i] + st.backwardWeight[i];
        double share = model > 0 ? st.backwardInput[i] / model : 0.5;
        st.backwardInput[i] = *fused * share;
        st.backwardWeight[i] = *fused * (1 - share);
      }
    }
  // Messages, by kind and size (the plan's tensorBytes).
  std::map<std::pair<TensorKind, int64_t>, double> msgs;
  for (const MeasuredCosts::Message &m : c.messages)
    msgs[{m.kind, m.bytes}] = m.time.medianMs;
  for (StageInfo &st : plan.stages)
    for (size_t i = 0; i < k; ++i) {
      const int s = st.stage;
      if (s + 1 < n && plan.rankOf(s + 1) != st.rank && i < st.activationTransferTime.size()) {
        auto it = msgs.find(
            {TensorKind::Activation, tensorBytes(plan, TensorKind::Activation, s, int(i))});
        if (it != msgs.end())
          st.activationTransferTime[i] = it->second;
      }
      if (s > 0 && plan.rankOf(s - 1) != st.rank && i < st.gradientTransferTime.size()) {
        auto it =
            msgs.find({TensorKind::Gradient, tensorBytes(plan, TensorKind::Gradient, s, int(i))});
        if (it != msgs.end())
          st.gradientTransferTime[i] = it->second;
      }
    }
  // Collectives (the embedding all-reduce is not timed by the model).
  for (const MeasuredCosts::Collective &m : c.collectives) {
    StageInfo &st = plan.stages[size_t(m.stage)];
    if (m.group == CollectiveGroup::Dp)
      st.dpAllReduceTime = m.time.medianMs;
    else if (m.group == CollectiveGroup::Tp)
      std::fill(st.tpAllReduceTime.begin(), st.tpAllReduceTime.end(), m.time.medianMs);
  }
  // Each rank's optimizer step, shared among its stages as the model shares it.
  for (const MeasuredCosts::Rank &rk : c.ranks) {
    if (rk.optimizer.samples == 0)
      continue;
    double model = 0;
    int count = 0;
    for (const StageInfo &st : plan.stages)
      if (st.rank == rk.rank) {
        model += st.optimizerTime;
        ++count;
      }
    for (StageInfo &st : plan.stages)
      if (st.rank == rk.rank)
        st.optimizerTime =
            rk.optimizer.medianMs * (model > 0 ? st.optimizerTime / model : 1.0 / double(count));
  }
  return llvm::Error::success();
}

} // namespace pipec
