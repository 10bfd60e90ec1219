//===- OneFOneB.cpp - 1F1B (PipeDream-Flush) ------------------------------===//
//
// Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training" (PipeDream-2BW/Flush,
// ICML 2021), the schedule Megatron-LM runs without interleaving. Rank r runs a warm-up of
// p-r-1 forwards, then alternates one forward and one (fused) backward, then drains the
// remaining backwards. Bubble with unit F and B: (p-1)/(m+p-1), as GPipe's, but rank r holds
// at most min(p-r, m) microbatches of activations instead of m.
// Constraints: --vpp 1, --seq-splits 1 (sub-sequences are seq1f1b's business). Any
// --microbatches >= 1: with m < p the warm-up is cut to m, which is GPipe's order on the ranks
// that cannot reach a steady state (PyTorch's guard against m < p is not needed here).
//
//===----------------------------------------------------------------------===//
#include "schedules/OneFOneBLoop.h"

namespace pipec {
namespace {

class OneFOneBPolicy final : public OneChunkPolicy {
public:
  OneFOneBPolicy()
      : OneChunkPolicy(
            PolicyTraits("1f1b",
                         "1F1B / PipeDream-Flush (Narayanan et al. 2021): warm-up p-r-1 forwards, "
                         "then one forward one backward; memory min(p, m)·A",
                         "--vpp 1, --seq-splits 1; any --microbatches", PolicyTraits::Vpp::One,
                         "for several chunks per rank use --schedule interleaved-1f1b")
                .oneSeqSplit("sub-sequence pipelining is --schedule seq1f1b, or use --schedule "
                             "gpipe")) {}

  OneFOneBRank rank(const ParallelConfig &c, int r) const override {
    // Warm-up: the first backward on rank r needs microbatch 0 to reach the last stage and
    // come back, during which rank r can run the forwards of microbatches 1..p-r-1; so it runs
    // p-r-1 forwards before its first 1F1B pair (fewer if there are fewer microbatches). Then
    // one forward, one (fused) backward until the forwards run out, and the backwards of the
    // warm-up microbatches (OneFOneBLoop.h). The unit is the microbatch.
    return OneFOneBRank{/*units=*/c.microbatches, /*warmup=*/c.pp - r - 1};
  }
};

} // namespace

std::unique_ptr<SchedulePolicy> createOneFOneBPolicy() {
  return std::make_unique<OneFOneBPolicy>();
}

} // namespace pipec
