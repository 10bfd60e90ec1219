//===- DualPipeV.cpp - DualPipeV (DeepSeek) -------------------------------===//
//
// DualPipeV, the "cut-in-half" DualPipe of DeepSeek-V3 (arXiv 2412.19437; the DualPipe
// repository's dualpipev): each of the P ranks holds two chunks in a V (chunk 0 = stage r on
// the way down, chunk 1 = stage 2P-1-r on the way back up, so the loss is on rank 0), and a
// steady state in which every rank runs a forward of one chunk overlapped with a backward of
// the other ("F&B" pairs, whose communication hides behind the other's compute). Backwards at
// the edges of the steady state are split into B and W (zero-bubble style) and the W's fill the
// bubbles. Rank r runs eight phases:
//   1. 2(P-r-1) F0 — fill the way down;
//   2. (r+1) x (F0 F1) — the first microbatches reach chunk 1;
//   3. (P-r-1) x (I1 W F1) — first backwards, weight gradients deferred and run at once;
//   4. M-2P+r+1 x (F0&B1, F1&B0) — the steady state of overlapped pairs;
//   5. (P-r-1) x (B1, F1&B0) — forwards of chunk 1 run out;
//   6. (r+1) x (B1 B0) — the second half split (I now, W later), so the W's can fill:
//   7. (P-r-1) x (W I0);   8. (r+1) x W.
// Every chunk's forwards and backwards take microbatches in order; a deferred W runs in the order
// its B ran. Constraints: --vpp 2 (two chunks, V-shape placement), --seq-splits 1,
// --microbatches >= 2 x --pp (phase 4 must have at least one pair on rank 0).
//
//===----------------------------------------------------------------------===//
#include "schedules/Policy.h"

#include "ir/support/Error.h"

#include <deque>

namespace pipec {
namespace {

class DualPipeVPolicy final : public DeclaredPolicy {
public:
  DualPipeVPolicy()
      : DeclaredPolicy(
            PolicyTraits("dualpipe-v",
                         "DualPipeV (DeepSeek-V3): V-shape, two chunks per rank, overlapped F&B "
                         "pairs, edge backwards split into B and W",
                         "--vpp 2, --seq-splits 1, --microbatches >= 2 x --pp",
                         PolicyTraits::Vpp::Two, "try --vpp 2")
                .oneSeqSplit("try --seq-splits 1")
                .vShape()) {}

  llvm::Error checkMore(const ParallelConfig &c) const override {
    if (c.microbatches < 2 * c.pp)
      return inputError("dualpipe-v needs --microbatches >= 2 x --pp = {} (got {}); try "
                        "--microbatches {}",
                        2 * c.pp, c.microbatches, 2 * c.pp);
    return llvm::Error::success();
  }

  void emit(const ScheduleRequest &request, ComputeOrder &order) const override {
    const ParallelConfig &c = request.parallel;
    int p = c.pp, m = c.microbatches;
    order.assign(size_t(p), {});
    for (int r = 0; r < p; ++r)
      emitRank(r, p, m, order[size_t(r)]);
  }

private:
  static void emitRank(int r, int p, int m, std::vector<Instruction> &ops) {
    // Chunk 0 is stage r (down the V), chunk 1 is stage 2P-1-r (back up).
    const int stage[2] = {r, 2 * p - 1 - r};
    int nextF[2] = {0, 0}, nextB[2] = {0, 0};
    std::deque<std::pair<int, int>> deferredW; // (stage, mb) of split backwards, in order
    auto f = [&](int chunk) {
      ops.push_back(Instruction::compute(OpKind::Forward, stage[chunk], nextF[chunk]++, 0));
    };
    auto b = [&](int chunk, bool split) {
      int mb = nextB[chunk]++;
      if (!split) {
        ops.push_back(Instruction::compute(OpKind::Backward, stage[chunk], mb, 0));
        return;
      }
      ops.push_back(Instruction::compute(OpKind::BackwardInput, stage[chunk], mb, 0));
      deferredW.emplace_back(stage[chunk], mb);
    };
    auto w = [&]() {
      auto [s, mb] = deferredW.front();
      deferredW.pop_front();
      ops.push_back(Instruction::compute(OpKind::BackwardWeight, s, mb, 0));
    };
    // 1. Fill the way down: rank r is 2(P-r-1) forwards ahead of when chunk 1 can start,
    //    since microbatch 0 still has P-r-1 ranks to go down and P-r-1 to come back up.
    for (int i = 0; i < 2 * (p - r - 1); ++i)
      f(0);
    // 2. Alternate the chunks until chunk 1 has r+1 microbatches in flight.
    for (int i = 0; i < r + 1; ++i) {
      f(0);
      f(1);
    }
    // 3. The first backwards of chunk 1 come back; split them and run the W at once.
    for (int i = 0; i < p - r - 1; ++i) {
      b(1, /*split=*/true);
      w();
      f(1);
    }
    // 4. Steady state: pairs F0&B1, F1&B0; M - 2P + r + 1 of each keeps every count at M.
    for (int i = 0; i < m - 2 * p + r + 1; ++i) {
      f(0);
      b(1, /*split=*/false);
      f(1);
      b(0, /*split=*/false);
    }
    // 5. Chunk 0's forwards are done; chunk 1 still has P-r-1 to run.
    for (int i = 0; i < p - r - 1; ++i) {
      b(1, /*split=*/false);
      f(1);
      b(0, /*split=*/false);
    }
    // 6. Drain both chunks' backwards; from the middle on, split them so their W's can fill
    //    the tail (odd ranks switch one backward earlier than even ones, as DualPipeV does).
    bool split = false;
    for (int i = 0; i < r + 1; ++i) {
      if (i == (r + 1) / 2 && r % 2 == 1)
        split = true;
      b(1, split);
      if (i == (r + 1) / 2 && r % 2 == 0)
        split = true;
      b(0, split);
    }
    // 7. Interleave deferred W's with chunk 0's last backwards.
    for (int i = 0; i < p - r - 1; ++i) {
      w();
      b(0, /*split=*/true);
    }
    // 8. The remaining W's.
    while (!deferredW.empty())
      w();
  }
};

} // namespace

std::unique_ptr<SchedulePolicy> createDualPipeVPolicy() {
  return std::make_unique<DualPipeVPolicy>();
}

} // namespace pipec
