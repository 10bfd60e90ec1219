//===- ZBH1.cpp - ZB-H1: 1F1B with the weight gradient delayed ------------===//
//
// Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024, arXiv 2401.10241), §2.1 and
// Fig. 3 (top). The backward is split into I (gradient w.r.t. the input, on the critical
// path) and W (gradient w.r.t. the weights, needed only by the optimizer). Forwards and I's
// keep 1F1B's order (warm-up p-r-1); rank r runs the W of microbatch j only after the I of
// microbatch j+r, and the last r W's fill its cool-down, where 1F1B waits for gradients.
// Every rank then keeps p microbatches in flight: p-r whole (M_B each) and r waiting for
// their W (M_W each), so rank r (worker i = r+1) peaks at (p-i+1)·M_B + (i-1)·M_W, never above
// rank 0's p·M_B of 1F1B. Bubble with times F, B, W and no transfer time: (p-1)(F+B-W)
// per rank against 1F1B's (p-1)(F+B+W), a third when F = B = W.
// With --seq-splits K (the combination the Seq1F1B paper states, arXiv 2406.03488 §4) the unit
// of the order is a sub-sequence instead of a microbatch, as in seq1f1b: forwards take a
// microbatch's sub-sequences in ascending order, I's and W's in descending order, and the
// warm-up grows by K-1 (the first I is the last sub-sequence of microbatch 0).
// Constraints: --vpp 1; any --seq-splits. Any --microbatches >= 1: with m < p the warm-up is
// cut to the units there are, as in 1f1b, and W's that cannot be delayed by r run at the end.
//
//===----------------------------------------------------------------------===//
#include "schedules/OneFOneBLoop.h"

namespace pipec {
namespace {

class ZBH1Policy final : public OneChunkPolicy {
public:
  ZBH1Policy()
      : OneChunkPolicy(
            PolicyTraits("zb-h1",
                         "ZB-H1 (Qi et al. 2024): 1F1B order with B split into I and W, rank r "
                         "delays its W's by r microbatches; bubble (p-1)(F+B-W), memory as 1F1B",
                         "--vpp 1; any --seq-splits, any --microbatches", PolicyTraits::Vpp::One,
                         "try --vpp 1, or --schedule zb-v with --vpp 2")
                .postValidated()
                .splitBackwards()) {}

  OneFOneBRank rank(const ParallelConfig &c, int r) const override {
    const int p = c.pp, k = c.seqSplits;
    // Units are sub-sequences (OneFOneBLoop.h's walkEveryRank).
    // Warm-up as 1F1B: while microbatch 0 travels to the last stage and its gradient comes
    // back, rank r can run the forwards of microbatches 1..p-r-1; with K sub-sequences the
    // first I (microbatch 0's last one) also waits for K-1 more forwards.
    // Steady state and cool-down: one F (while any is left), one I, and then a W once r I's
    // are outstanding, i.e. W(j) right after I(j+r). Why r: after rank r's last I, that
    // gradient still has to cross ranks r-1..0 (r·B) before rank 0 is done, time in which
    // 1F1B's rank r idles; the r W's held back fill it. Holding them back also keeps the
    // I's of the later ranks (the critical path of every gradient) free of W's early on, and
    // leaves every rank with p microbatches in flight: p-r whole and r waiting for a W.
    // The r delayed W's (fewer when m <= r) close the stream (OneFOneBLoop.h).
    return OneFOneBRank{/*units=*/c.microbatches * k, /*warmup=*/p - r - 1 + k - 1,
                        /*wDelay=*/r};
  }
};

} // namespace

std::unique_ptr<SchedulePolicy> createZBH1Policy() { return std::make_unique<ZBH1Policy>(); }

} // namespace pipec
