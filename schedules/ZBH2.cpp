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
#include "schedules/Policy.h"

#include "ir/support/Error.h"

namespace pipec {
namespace {

class ZBH2Policy final : public SchedulePolicy {
public:
  llvm::StringRef name() const override { return "zb-h2"; }
  bool postValidation() const override { return true; }
  llvm::StringRef summary() const override {
    return "ZB-H2 (Qi et al. 2024): B split into I and W, 2(p-r-1) warm-up forwards and 2r "
           "W's moved to the end; zero bubble when F = B = W, memory (2p-1)·M_B";
  }
  llvm::StringRef constraints() const override {
    return "--vpp 1, --seq-splits 1; any --microbatches (zero bubble from 2p-1)";
  }

  llvm::Error check(const ParallelConfig &c) const override {
    if (c.vpp != 1)
      return inputError("zb-h2 needs --vpp 1 (got {}); try --vpp 1, or --schedule zb-v with "
                        "--vpp 2",
                        c.vpp);
    if (c.seqSplits != 1)
      return inputError("zb-h2 needs --seq-splits 1 (got {}); try --seq-splits 1, or "
                        "--schedule seq1f1b",
                        c.seqSplits);
    return llvm::Error::success();
  }

  void emit(const ScheduleRequest &request, ComputeOrder &order) const override {
    const ParallelConfig &c = request.parallel;
    const int p = c.pp;
    // Warm-up (unit times, no transfer time): rank r gets F(0) at time r; I(0) leaves the last
    // rank at p+1 and reaches rank r at 2p-1-r. The 2(p-r)-1 slots in between take forwards:
    // 2(p-r-1) here and the first steady-state F.
    // Steady state: F (while any is left), I, and W once 2r I's are outstanding, i.e. W(j)
    // right after I(j+2r). Why 2r: never idle from time r, rank r must end at r+3m; its last I
    // ends r steps before rank 0's, which ends at 3m (rank 0 has no W to postpone). The 2r
    // steps after it are W's: the cool-down (fewer when m <= 2r; OneFOneBLoop.h).
    order = walkEveryRank(p, 1, [&](int r) {
      return OneFOneBRank{/*units=*/c.microbatches, /*warmup=*/2 * (p - r - 1), /*wDelay=*/2 * r};
    });
  }
};

} // namespace

std::unique_ptr<SchedulePolicy> createZBH2Policy() { return std::make_unique<ZBH2Policy>(); }

} // namespace pipec
