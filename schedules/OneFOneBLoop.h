//===- OneFOneBLoop.h - The 1F1B family's warm-up, steady state, cool-down -*- C++ -*-===//
//
// 1F1B (PipeDream-Flush), Seq1F1B, interleaved 1F1B (Megatron's table), ZB-H1 and ZB-H2 walk a
// rank's units the same way:
//   warm-up:     `warmup` forwards;
//   steady:      one forward (while any are left), then one backward;
//   cool-down:   the backwards left.
// With the backward split into I (input gradient) and W (weight gradient), the W of unit j runs
// right after the I of unit j + wDelay, and the last wDelay W's close the stream. The policies
// differ in what a unit is (a microbatch, a sub-sequence, an entry of Megatron's table), in the
// length of the warm-up and in wDelay; each derives those in its own file, next to its paper's
// figure, and this loop is written once.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_SCHEDULES_ONEFONEBLOOP_H
#define PIPEC_SCHEDULES_ONEFONEBLOOP_H

#include "ir/Instruction.h"
#include "schedules/Policy.h"

#include <algorithm>
#include <vector>

namespace pipec {

/// One rank's walk through the 1F1B loop.
struct OneFOneBRank {
  /// The rank's units: it runs the forward and the backward of each once.
  int units = 0;
  /// Forwards before the first backward (cut to `units` when there are fewer).
  int warmup = 0;
  /// kFusedBackward: one fused backward (B) per unit. Otherwise the backward is split into I
  /// and W, and the W of unit j follows the I of unit j + wDelay.
  int wDelay = kFusedBackward;
  static constexpr int kFusedBackward = -1;
};

/// Calls emit(OpKind op, int unit) for every op of the rank, in order: Forward, then Backward
/// (fused) or BackwardInput and BackwardWeight; each kind takes the units in ascending order.
template <typename Emit> void walkOneFOneB(const OneFOneBRank &rank, Emit &&emit) {
  const int n = rank.units;
  const bool split = rank.wDelay != OneFOneBRank::kFusedBackward;
  const int warmup = std::clamp(rank.warmup, 0, n);
  int fwd = 0, bwd = 0, wgt = 0;
  for (; fwd < warmup; ++fwd)
    emit(OpKind::Forward, fwd);
  while (bwd < n) {
    if (fwd < n)
      emit(OpKind::Forward, fwd++);
    emit(split ? OpKind::BackwardInput : OpKind::Backward, bwd++);
    if (split && bwd - wgt > rank.wDelay)
      emit(OpKind::BackwardWeight, wgt++);
  }
  while (split && wgt < n)
    emit(OpKind::BackwardWeight, wgt++);
}

/// Every rank's stream of a one-chunk member of the family (stage r on rank r): rank r walks
/// `rankOf(r)` (an OneFOneBRank) over the units, unit i being sub-sequence i mod K of
/// microbatch i / K, ascending for forwards and descending (K-1 - i mod K) for backwards, since
/// a backward needs the dK/dV of the sub-sequence after it.
template <typename RankOf>
std::vector<std::vector<Instruction>> walkEveryRank(int p, int k, RankOf &&rankOf) {
  std::vector<std::vector<Instruction>> order(static_cast<size_t>(p));
  for (int r = 0; r < p; ++r) {
    const OneFOneBRank rank = rankOf(r);
    auto &ops = order[size_t(r)];
    ops.reserve(size_t(rank.units) * (rank.wDelay == OneFOneBRank::kFusedBackward ? 2 : 3));
    walkOneFOneB(rank, [&](OpKind op, int i) {
      int slice = op == OpKind::Forward ? i % k : k - 1 - i % k;
      ops.push_back(Instruction::compute(op, r, i / k, slice));
    });
  }
  return order;
}

/// A one-chunk member of the family (stage r on rank r): every rank walks the loop over the
/// units of walkEveryRank (sub-sequences; microbatches with --seq-splits 1), as rank() says.
class OneChunkPolicy : public DeclaredPolicy {
public:
  using DeclaredPolicy::DeclaredPolicy;
  void emit(const ScheduleRequest &request, ComputeOrder &order) const final {
    const ParallelConfig &c = request.parallel;
    order = walkEveryRank(c.pp, c.seqSplits, [&](int r) { return rank(c, r); });
  }

protected:
  /// Rank r's walk, for a configuration that passed check().
  virtual OneFOneBRank rank(const ParallelConfig &c, int r) const = 0;
};

} // namespace pipec

#endif // PIPEC_SCHEDULES_ONEFONEBLOOP_H
