//===- Seq1F1B.cpp - Seq1F1B: 1F1B over sub-sequences -----------------------===//
//
// Sun et al., "Seq1F1B: Efficient Sequence-Level Pipeline Parallelism for Large Language Model
// Training" (arXiv 2406.03488, NAACL 2025). Every microbatch is cut into K sub-sequences
// (--seq-splits; the seq-split pass balances their causal-attention FLOPs) and the unit of 1F1B
// becomes a sub-sequence: forwards run a microbatch's sub-sequences in ascending order (a later
// one attends to the K/V of the earlier ones), backwards in descending order (a later one sends
// dK/dV back to the earlier ones). Rank r warms up with p-r+K-2 sub-sequence forwards, then
// alternates one forward and one fused backward. With equal-cost slices the bubble is
// (p-1)/(K·m+p-1) and rank 0 holds at most p+K-1 slices (≈ (p+K-1)/K microbatches) of
// activations. With K = 1 this is exactly 1F1B's order.
// Constraints: --vpp 1 (seq1f1b-interleaved does chunks). Any --microbatches and --seq-splits.
//
//===----------------------------------------------------------------------===//
#include "schedules/OneFOneBLoop.h"

namespace pipec {
namespace {

class Seq1F1BPolicy final : public OneChunkPolicy {
public:
  Seq1F1BPolicy()
      : OneChunkPolicy(
            PolicyTraits("seq1f1b",
                         "Seq1F1B (Sun et al. 2024): 1F1B over K sub-sequences per microbatch, "
                         "forwards ascending, backwards descending; bubble (p-1)/(K·m+p-1), memory "
                         "(p+K-1) slices",
                         "--vpp 1; any --seq-splits, any --microbatches", PolicyTraits::Vpp::One,
                         "for several chunks per rank use --schedule seq1f1b-interleaved")) {}

  OneFOneBRank rank(const ParallelConfig &c, int r) const override {
    const int p = c.pp, k = c.seqSplits;
    // Units are sub-sequences, forwards ascending within a microbatch and backwards descending,
    // since B(s,m,k) needs the dK/dV of B(s,m,k+1) (OneFOneBLoop.h's walkEveryRank).
    // Warm-up: the first backward is microbatch 0's last sub-sequence, K-1. The last rank must
    // first run all K forwards of microbatch 0 (K-1 before its first 1F1B pair); rank r is
    // p-1-r hops further from the loss, and covers the round trip with as many more forwards
    // as 1F1B does: (p-r-1) + (K-1) = p-r+K-2 (fewer if there are fewer units). Then one
    // sub-sequence forward, one sub-sequence backward; then the backwards of the warm-up units.
    return OneFOneBRank{/*units=*/c.microbatches * k, /*warmup=*/p - r + k - 2};
  }
};

} // namespace

std::unique_ptr<SchedulePolicy> createSeq1F1BPolicy() { return std::make_unique<Seq1F1BPolicy>(); }

} // namespace pipec
