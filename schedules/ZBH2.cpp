//===- ZBH2.cpp - ZB-H2: zero bubble for 2p-1 microbatches of memory ------===//
//
// Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024, arXiv 2401.10241), §2.2 and
// Fig. 3 (bottom). As ZB-H1, the backward is split into I (input gradient) and W (weight
// gradient), but rank r also fills the bubble before its first I with extra forwards
// (2(p-r)-1 of them before I(0), 1F1B has p-r) and runs its last 2r W's after its last I, which
// turns the schedule into a parallelogram: with F = B = W and no transfer time, no rank idles
// between its first and last op. Rank r (worker i = r+1) holds 2p-2i+1 whole microbatches and
// 2i-2 waiting for their W: peak (2p-2i+1)·M_B + (2i-2)·M_W, (2p-1)·M_B on rank 0. With
// transfer time c the bubble is (p-1)(F+B-2W+2c) per rank (the paper's accounting).
// Constraints: --vpp 1, --seq-splits 1. Any --microbatches >= 1 compiles; the bubble is zero
// (unit costs, no transfer time) once m >= 2p-1, when rank 0 can fill its warm-up.
//
//===----------------------------------------------------------------------===//
#include "schedules/OneFOneBLoop.h"

namespace pipec {
namespace {

class ZBH2Policy final : public OneChunkPolicy {
public:
  ZBH2Policy()
      : OneChunkPolicy(
            PolicyTraits("zb-h2",
                         "ZB-H2 (Qi et al. 2024): B split into I and W, 2(p-r-1) warm-up forwards "
                         "and 2r W's moved to the end; zero bubble when F = B = W, memory "
                         "(2p-1)·M_B",
                         "--vpp 1, --seq-splits 1; any --microbatches (zero bubble from 2p-1)",
                         PolicyTraits::Vpp::One, "try --vpp 1, or --schedule zb-v with --vpp 2")
                .oneSeqSplit("try --seq-splits 1, or --schedule seq1f1b")
                .postValidated()
                .splitBackwards()) {}

  OneFOneBRank rank(const ParallelConfig &c, int r) const override {
    const int p = c.pp;
    // Warm-up (unit times, no transfer time): rank r gets F(0) at time r; I(0) leaves the last
    // rank at p+1 and reaches rank r at 2p-1-r. The 2(p-r)-1 slots in between take forwards:
    // 2(p-r-1) here and the first steady-state F.
    // Steady state: F (while any is left), I, and W once 2r I's are outstanding, i.e. W(j)
    // right after I(j+2r). Why 2r: never idle from time r, rank r must end at r+3m; its last I
    // ends r steps before rank 0's, which ends at 3m (rank 0 has no W to postpone). The 2r
    // steps after it are W's: the cool-down (fewer when m <= 2r; OneFOneBLoop.h).
    return OneFOneBRank{/*units=*/c.microbatches, /*warmup=*/2 * (p - r - 1), /*wDelay=*/2 * r};
  }
};

} // namespace

std::unique_ptr<SchedulePolicy> createZBH2Policy() { return std::make_unique<ZBH2Policy>(); }

} // namespace pipec
