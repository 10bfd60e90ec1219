//===- GPipe.cpp - GPipe: all forwards, then all backwards ----------------===//
//
// Huang et al., "GPipe: Efficient Training of Giant Neural Networks using Pipeline
// Parallelism" (NeurIPS 2019). Every rank runs the forwards of all microbatches, then their
// backwards; a flush ends the step. Bubble with unit F and fused B: (p-1)/(m+p-1). Every
// microbatch's activations are alive at the turn, so rank 0 peaks at m·A.
// Constraints: --vpp 1 (one stage per rank). Any --microbatches >= 1 works (m < p too).
// --seq-splits K cuts each microbatch into K sub-sequences: forwards run them in ascending
// order (a later one attends to the K/V of the earlier ones), backwards in descending order.
//
//===----------------------------------------------------------------------===//
#include "schedules/OneFOneBLoop.h"

namespace pipec {
namespace {

class GPipePolicy final : public OneChunkPolicy {
public:
  GPipePolicy()
      : OneChunkPolicy(PolicyTraits(
            "gpipe", "GPipe (Huang et al. 2019): all forwards, then all backwards; memory m·A",
            "--vpp 1; any --microbatches", PolicyTraits::Vpp::One,
            "for several chunks per rank use --schedule interleaved-1f1b")) {}

  OneFOneBRank rank(const ParallelConfig &c, int) const override {
    // The 1F1B loop with a warm-up of every unit: all forwards (sub-sequences ascending), then
    // all backwards (descending within a microbatch).
    const int units = c.microbatches * c.seqSplits;
    return OneFOneBRank{units, /*warmup=*/units};
  }
};

} // namespace

std::unique_ptr<SchedulePolicy> createGPipePolicy() { return std::make_unique<GPipePolicy>(); }

} // namespace pipec
