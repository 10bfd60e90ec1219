//===- ZBV.cpp - ZB-V: zero bubble with a V-shape placement ---------------===//
//
// Qi et al., "Zero Bubble Pipeline Parallelism" (arXiv 2401.10241 v2, §6, the ZB-V figure).
// The model is cut into 2p stages; rank r holds stage r (chunk 0) and stage 2p-1-r (chunk 1),
// so a microbatch goes down the ranks and back up (a "V"), and rank 0 holds both the first
// stage and the loss. The backward is split into I (input gradient) and W (weight gradient).
// The handcrafted order below has, with F = B = W and no transfer time, no idle time between a
// rank's first and last op once m >= 2p-1 (the paper states m >= 2p). Every rank holds at most
// 2p chunk activations, i.e. p·M_B of a 1F1B stage (twice a chunk): 1F1B's peak on its rank 0
// (exactly so when the chunks are equal; uneven chunks, e.g. embedding and LM head on rank 0,
// can put rank 0 slightly above it).
// With --seq-splits K (the Seq1F1B paper's combination) the unit is a sub-sequence: forwards
// ascending, I and W descending within a microbatch, and K-1 more forward pairs (and, at the
// end, I pairs) so that the first I of a chunk, the last sub-sequence of microbatch 0, has all
// its forwards. With F = B = W the bubble stays zero and every unit is 1/K as long.
// Constraints: --vpp 2; any --seq-splits. Any --microbatches >= 1: for m < 2p-1 the order for
// 2p-1 microbatches is built and the ops of the missing ones are left out (as the authors'
// runtime does), which keeps every dependency order.
//
//===----------------------------------------------------------------------===//
#include "schedules/Policy.h"

#include "ir/support/Error.h"

#include <algorithm>
#include <array>
#include <cassert>

namespace pipec {
namespace {

class ZBVPolicy final : public DeclaredPolicy {
public:
  ZBVPolicy()
      : DeclaredPolicy(
            PolicyTraits("zb-v",
                         "ZB-V (Qi et al. 2024, §6): V-shape placement, 2 chunks per rank, B split "
                         "into I and W; zero bubble when F = B = W and m >= 2p-1, memory as 1F1B",
                         "--vpp 2; any --seq-splits, any --microbatches (zero bubble from 2p-1)",
                         PolicyTraits::Vpp::Two, "try --vpp 2")
                .postValidated()
                .vShape()
                .splitBackwards()) {}

  void emit(const ScheduleRequest &request, ComputeOrder &order) const override {
    const ParallelConfig &c = request.parallel;
    const int p = c.pp, k = c.seqSplits, m = c.microbatches * k; // m, n count units
    // The order is built for at least 2p-1 microbatches (the warm-up below assumes that many
    // exist); ops of microbatches >= m are then dropped.
    const int n = std::max(2 * p - 1, c.microbatches) * k;
    order.assign(size_t(p), {});
    for (int r = 0; r < p; ++r) {
      auto &ops = order[size_t(r)];
      ops.reserve(size_t(6 * m));
      // V-shape placement: chunk 0 of rank r is stage r, chunk 1 is stage 2p-1-r.
      const std::array<int, 2> stage = {r, 2 * p - 1 - r};
      std::array<int, 2> f = {0, 0}, b = {0, 0}, w = {0, 0};
      // Unit i is sub-sequence i mod K of microbatch i / K: ascending for forwards,
      // descending for I and W (I(k) needs the dK/dV of I(k+1)).
      auto put = [&](OpKind op, int chunk, std::array<int, 2> &count) {
        int i = count[size_t(chunk)]++;
        int slice = op == OpKind::Forward ? i % k : k - 1 - i % k;
        if (i < m)
          ops.push_back(Instruction::compute(op, stage[size_t(chunk)], i / k, slice));
      };
      auto runF = [&](int chunk) { put(OpKind::Forward, chunk, f); };
      auto runI = [&](int chunk) { put(OpKind::BackwardInput, chunk, b); };
      auto runW = [&](int chunk) { put(OpKind::BackwardWeight, chunk, w); };

      // Times below are for F = B = W = 1 and no transfer time. F0(0) reaches rank r at r.
      // Its chunk-1 forward goes down to rank p-1 (done at p), turns, and comes back up:
      // F1(0) can start on rank r at p + (p-1-r) = 2p-1-r. The 2(p-r)-1 steps before take
      // chunk-0 forwards.
      for (int i = 0; i < 2 * (p - r) - 1; ++i)
        runF(0);
      // Rank r+1 now alternates F1, F0, so chunk-1 forwards reach rank r every second step:
      // r pairs (F1, F0) fill the time until the loss gradient I1(0), made on rank 0 at 2p,
      // comes down to rank r at 2p+r. Rank r has then run exactly 2p forwards (counting the
      // F1 that opens the next phase), its peak: 2p chunk activations.
      // With K sub-sequences the first I of each chunk (microbatch 0's last sub-sequence)
      // waits for K-1 more forwards of that chunk: run K-1 more pairs before it.
      for (int i = 0; i < r + k - 1; ++i) {
        runF(1);
        runF(0);
      }
      // Chunk-1 backwards start at the loss (rank 0) and move down one rank per step; each
      // rank runs them as (F1, I1, W1) triples, a wave of period 3. The chunk-0 backward of
      // microbatch 0 starts at the bottom of the V (rank p-1, after its I1(0)) and climbs back
      // up; rank r runs triples until it is near: rank p-1 one, each rank above one more.
      for (int i = 0; i < p - r; ++i) {
        runF(1);
        runI(1);
        runW(1);
      }
      // Steady state: both chunks in 1F1B fashion, each I followed by its W, so no weight
      // gradient is held and the memory stays at the warm-up's peak. Runs until all forwards
      // are out: chunk 1 trails chunk 0 by the microbatches of the warm-up.
      while (f[1] < f[0] || f[0] < n) {
        if (f[0] < n)
          runF(0);
        runI(0);
        runW(0);
        runF(1);
        runI(1);
        runW(1);
      }
      // Cool-down: the remaining I's are on the critical path (an I0 feeds rank r-1, an I1
      // rank r+1), so they go first and W's fill the waits, as in ZB-H1: r pairs (I0, I1)
      // while rank r still has chunk-1 gradients to pass down, then p-r pairs (I0, W0), then
      // the held W's.
      for (int i = 0; i < r + k - 1; ++i) {
        runI(0);
        runI(1);
      }
      for (int i = 0; i < p - r; ++i) {
        runI(0);
        runW(0);
      }
      while (w[1] < b[1])
        runW(1);
      while (w[0] < b[0])
        runW(0);
      assert(f[0] == n && f[1] == n && b[0] == n && b[1] == n && w[0] == n && w[1] == n &&
             "every chunk runs F, I and W of every microbatch once");
    }
  }
};

} // namespace

std::unique_ptr<SchedulePolicy> createZBVPolicy() { return std::make_unique<ZBVPolicy>(); }

} // namespace pipec
