//===- Seq1F1BInterleaved.cpp - Seq1F1B over interleaved 1F1B ---------------===//
//
// Sun et al., "Seq1F1B: Efficient Sequence-Level Pipeline Parallelism for Large Language Model
// Training" (arXiv 2406.03488), its interleaved variant (Seq1F1B-I, the authors' Megatron
// fork): Megatron-Core's interleaved 1F1B (see Interleaved1F1B.cpp) with the sub-sequence as
// the unit. Microbatch u/K, slice u mod K is unit u; groups of G microbatches (G·K units,
// --microbatch-group-size G, default ceil(P/K) so that a group has at least P units) run their
// forwards through chunk 0, then chunk 1, ..., and the backwards mirror that, last chunk
// first, with each microbatch's slices in descending order. Rank r warms up with
// 2(P-r-1) + (V-1)·G·K + K-1 forwards. With equal-cost slices the bubble is at most
// (P-1)/(V·K·m+P-1). With K = 1 this is exactly interleaved-1f1b's order.
// Constraints: --vpp >= 2; G·K >= P (fewer units per group leave rank 0 waiting for its own
// chunk-0 outputs); G <= m; the last group, m mod G microbatches, is empty or has at least
// P units. G counts whole microbatches: a group that split a microbatch would need a
// backward before the forward of the slice it depends on.
//
//===----------------------------------------------------------------------===//
#include "schedules/InterleavedOrder.h"
#include "schedules/Policy.h"

#include "ir/support/Error.h"
#include "ir/support/Limits.h"

#include <algorithm>
#include <utility>

namespace pipec {
namespace {

/// Group rule in microbatches: G·K >= P, G <= m, and the last group is empty or has >= P units.
bool groupsFit(int m, int g, int k, int p) {
  if (int64_t(g) * k < p || g > m)
    return false;
  return m % g == 0 || int64_t(m % g) * k >= p;
}

/// Smallest group that holds at least P units.
int defaultGroupSize(int p, int k) { return (p + k - 1) / k; }

class Seq1F1BInterleavedPolicy final : public DeclaredPolicy {
public:
  Seq1F1BInterleavedPolicy()
      : DeclaredPolicy(
            PolicyTraits("seq1f1b-interleaved",
                         "Seq1F1B-I (Sun et al. 2024): interleaved 1F1B over K sub-sequences per "
                         "microbatch; bubble (p-1)/(v·K·m+p-1)",
                         "--vpp >= 2; --microbatch-group-size G (microbatches, default "
                         "ceil(pp/K)) with G·K >= pp, G <= --microbatches, last group 0 or >= "
                         "pp sub-sequences",
                         PolicyTraits::Vpp::AtLeastTwo,
                         "try --vpp 2, or --schedule seq1f1b for one chunk per rank")) {}

  llvm::Error checkMore(const ParallelConfig &c) const override {
    int p = c.pp, m = c.microbatches, k = c.seqSplits, g = c.microbatchGroupSize;
    int minG = defaultGroupSize(p, k);
    // Each suggestion satisfies every rule below too (the last group's included), so that,
    // applied, it compiles.
    auto fitsM = [&](int x) { return groupsFit(m, x, k, p); };
    if (g > 0 && int64_t(g) * k < p) {
      int tryG = m >= minG ? nearestValid(minG, minG, m, fitsM) : minG;
      return inputError("seq1f1b-interleaved needs --microbatch-group-size x --seq-splits >= "
                        "--pp (got {} x {}, pp {}); a smaller group leaves bubbles; try "
                        "--microbatch-group-size {}",
                        g, k, p, tryG < 0 ? minG : tryG);
    }
    if (m < minG) {
      int tryM = g > 0 ? nearestValid(minG, minG, kMaxFlagCount,
                                      [&](int x) { return groupsFit(x, g, k, p); })
                       : minG;
      return inputError("seq1f1b-interleaved needs --microbatches x --seq-splits >= --pp (got {} "
                        "x {}, pp {}); try --microbatches {}",
                        m, k, p, tryM);
    }
    if (g <= 0) {
      if (groupsFit(m, minG, k, p))
        return llvm::Error::success();
      return inputError(
          "seq1f1b-interleaved needs --microbatches to be a multiple of ceil(--pp/--seq-splits)"
          "={} (got {}) or a --microbatch-group-size whose last group has at least --pp={} "
          "sub-sequences; try {}, or --microbatch-group-size {}",
          minG, m, p,
          nearestValid(m, minG, kMaxFlagCount, [&](int x) { return groupsFit(x, minG, k, p); }),
          nearestValid(minG, minG, m, fitsM));
    }
    if (g > m)
      return inputError("seq1f1b-interleaved needs --microbatch-group-size <= --microbatches "
                        "(got {}, microbatches {}); try --microbatch-group-size {}",
                        g, m, nearestValid(g, minG, m, fitsM));
    if (!groupsFit(m, g, k, p))
      return inputError(
          "seq1f1b-interleaved needs --microbatches to be a multiple of "
          "--microbatch-group-size={} or to leave a last group of at least --pp={} "
          "sub-sequences (got {}, last group {} x {}); try {}, or --microbatch-group-size {}",
          g, p, m, m % g, k,
          nearestValid(m, g, kMaxFlagCount, [&](int x) { return groupsFit(x, g, k, p); }),
          nearestValid(g, minG, m, fitsM));
    return llvm::Error::success();
  }

  void emit(const ScheduleRequest &request, ComputeOrder &order) const override {
    const ParallelConfig &c = request.parallel;
    const int g =
        c.microbatchGroupSize > 0 ? c.microbatchGroupSize : defaultGroupSize(c.pp, c.seqSplits);
    emitInterleavedOrder(c.pp, c.vpp, c.microbatches, c.seqSplits, g, order);
  }
};

} // namespace

std::unique_ptr<SchedulePolicy> createSeq1F1BInterleavedPolicy() {
  return std::make_unique<Seq1F1BInterleavedPolicy>();
}

} // namespace pipec
