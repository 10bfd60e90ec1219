//===- InterleavedOrder.cpp - The interleaved 1F1B order ------------------===//
//
// Narayanan et al. 2021 in Megatron-Core's form (its schedule table), extended to Seq1F1B's
// sub-sequence units (Sun et al. 2024): see the comments below for where each term comes from.
//
//===----------------------------------------------------------------------===//
#include "schedules/InterleavedOrder.h"

#include "schedules/OneFOneBLoop.h"

#include <algorithm>
#include <utility>
#include <vector>

namespace pipec {

void emitInterleavedOrder(int p, int v, int m, int k, int g, ComputeOrder &order) {
  // The schedule table over units: entry i -> (unit, chunk). A group of g microbatches is
  // g·K consecutive units; it runs chunk 0, then chunk 1, ...; the last group is what is left
  // (the policies' checks made it 0 or at least p units long). Every rank walks the same table.
  std::vector<std::pair<int, int>> table;
  table.reserve(size_t(m) * size_t(k) * size_t(v));
  for (int lo = 0; lo < m; lo += g) {
    int hi = std::min(lo + g, m);
    for (int chunk = 0; chunk < v; ++chunk)
      for (int unit = lo * k; unit < hi * k; ++unit)
        table.emplace_back(unit, chunk);
  }
  const int total = m * k * v;
  order.assign(size_t(p), {});
  for (int r = 0; r < p; ++r) {
    auto &ops = order[size_t(r)];
    ops.reserve(size_t(2 * total));
    // Forward i: unit u = microbatch u/K, slice u mod K (ascending) on chunk c, stage c·P + r.
    auto forward = [&](int i) {
      auto [unit, chunk] = table[size_t(i)];
      ops.push_back(Instruction::compute(OpKind::Forward, chunk * p + r, unit / k, unit % k));
    };
    // Backward i mirrors forward i: the same unit on chunk V-1-c, so the last chunk (whose loss
    // is computed first) leads; within the microbatch the slices run descending (K-1 - u mod K),
    // since B(s,m,k) needs the dK/dV of B(s,m,k+1). Each chunk still sees its microbatches in
    // ascending order, the FIFO order Megatron pops them in.
    auto backward = [&](int i) {
      auto [unit, chunk] = table[size_t(i)];
      ops.push_back(Instruction::compute(OpKind::Backward, (v - 1 - chunk) * p + r, unit / k,
                                         k - 1 - unit % k));
    };
    // Warm-up: the last rank's first backward is microbatch 0, slice K-1 on chunk V-1, whose
    // forward sits at table index (V-1)·g·K + K-1. Rank r is P-1-r hops ahead of the last rank
    // on the way down and its first gradient needs as many hops back up, so it runs 2(P-r-1)
    // more forwards to stay busy meanwhile. Steady state: one forward, then one backward
    // (Megatron's order within a step); cool-down: the backwards of the warm-up forwards
    // (OneFOneBLoop.h; a unit is an entry of the table).
    int warmup = 2 * (p - r - 1) + (v - 1) * g * k + k - 1;
    walkOneFOneB(OneFOneBRank{/*units=*/total, warmup}, [&](OpKind op, int i) {
      if (op == OpKind::Forward)
        forward(i);
      else
        backward(i);
    });
  }
}

} // namespace pipec
