//===- Interleaved1F1B.cpp - Interleaved 1F1B (Megatron-LM virtual stages) ===//
//
// Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
// Megatron-LM" (SC 2021, §2.2.2), in the order Megatron-Core runs it (schedules.py,
// forward_backward_pipelining_with_interleaving and its schedule table). Every rank holds V
// model chunks; with loop placement chunk c of rank r is stage c·P + r. Microbatches go in
// groups of G (--microbatch-group-size, default P): a group runs its forwards through chunk 0,
// then through chunk 1, ..., and the backwards mirror that, last chunk first. Rank r warms up
// with 2(P-r-1) + (V-1)·G forwards, then alternates one forward and one fused backward, then
// drains. Bubble with unit costs: (P-1)/(V·m+P-1), V times less than 1F1B's, for about
// (1 + (P-1)/(P·V))·P microbatches of activations on rank 0 instead of P.
// Constraints (Megatron-Core's): --vpp >= 2; --seq-splits 1 (seq1f1b-interleaved does
// sub-sequences); P <= G <= m (a group shorter than P leaves rank 0 waiting for its own
// chunk-0 outputs to come round the ring: the silent bubble of Megatron-LM#1829); and the last
// group, m mod G, is empty or at least P. With the default G = P: m is a multiple of P.
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

/// Megatron-Core's group rule: P <= G <= m, and the last group (m mod G) is empty or >= P.
bool groupsFit(int m, int g, int p) {
  if (g < p || g > m)
    return false;
  return m % g == 0 || m % g >= p;
}

class Interleaved1F1BPolicy final : public DeclaredPolicy {
public:
  Interleaved1F1BPolicy()
      : DeclaredPolicy(
            PolicyTraits("interleaved-1f1b",
                         "interleaved 1F1B (Narayanan et al. 2021, Megatron-Core order): V chunks "
                         "per rank, microbatch groups of G through every chunk; bubble "
                         "(p-1)/(v·m+p-1)",
                         "--vpp >= 2, --seq-splits 1; --pp <= --microbatch-group-size "
                         "(default pp) <= --microbatches, last group 0 or >= pp",
                         PolicyTraits::Vpp::AtLeastTwo,
                         "try --vpp 2, or --schedule 1f1b for one chunk per rank")
                .oneSeqSplit("sub-sequences over chunks are --schedule seq1f1b-interleaved")) {}

  llvm::Error checkMore(const ParallelConfig &c) const override {
    int p = c.pp, m = c.microbatches, g = c.microbatchGroupSize;
    // Each suggestion satisfies every rule below too (the last group's included), so that,
    // applied, it compiles.
    auto fitsM = [&](int x) { return groupsFit(m, x, p); };
    if (g > 0 && g < p) {
      int tryG = m >= p ? nearestValid(p, p, m, fitsM) : p;
      return inputError("interleaved-1f1b needs --microbatch-group-size >= --pp (got {}, pp "
                        "{}); a smaller group leaves bubbles; try --microbatch-group-size {}",
                        g, p, tryG < 0 ? p : tryG);
    }
    if (m < p) {
      int tryM =
          g > 0 ? nearestValid(p, p, kMaxFlagCount, [&](int x) { return groupsFit(x, g, p); }) : p;
      return inputError("interleaved-1f1b needs --microbatches >= --pp (got {}, pp {}); try "
                        "--microbatches {}",
                        m, p, tryM);
    }
    if (g <= 0) {
      // Default G = P: the last group is m mod P, which is 0 or < P, so m must be a multiple
      // of P; or the user picks a group size that leaves a long enough last group.
      if (m % p == 0)
        return llvm::Error::success();
      int tryM = nearestValid(m, p, kMaxFlagCount, [&](int x) { return x % p == 0; });
      int tryG = nearestValid(p, p, m, fitsM);
      return inputError("interleaved-1f1b needs --microbatches to be a multiple of --pp={} "
                        "(got {}) or a --microbatch-group-size whose last group is at least "
                        "--pp; try {}, or --microbatch-group-size {}",
                        p, m, tryM, tryG);
    }
    if (g > m)
      return inputError("interleaved-1f1b needs --microbatch-group-size <= --microbatches (got "
                        "{}, microbatches {}); try --microbatch-group-size {}",
                        g, m, nearestValid(g, p, m, fitsM));
    if (!groupsFit(m, g, p))
      return inputError(
          "interleaved-1f1b needs --microbatches to be a multiple of --microbatch-group-size={} "
          "or to leave a last group of at least --pp={} (got {}, last group {}); try {}, or "
          "--microbatch-group-size {}",
          g, p, m, m % g,
          nearestValid(m, g, kMaxFlagCount, [&](int x) { return groupsFit(x, g, p); }),
          nearestValid(g, p, m, fitsM));
    return llvm::Error::success();
  }

  void emit(const ScheduleRequest &request, ComputeOrder &order) const override {
    const ParallelConfig &c = request.parallel;
    const int g = c.microbatchGroupSize > 0 ? c.microbatchGroupSize : c.pp;
    // Whole sequences: the shared order with one unit per microbatch.
    emitInterleavedOrder(c.pp, c.vpp, c.microbatches, /*k=*/1, g, order);
  }
};

} // namespace

std::unique_ptr<SchedulePolicy> createInterleaved1F1BPolicy() {
  return std::make_unique<Interleaved1F1BPolicy>();
}

} // namespace pipec
