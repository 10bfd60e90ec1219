//===- SeqSplit.cpp - Cut each microbatch into K sub-sequences -------------===//
//
// Establishes: plan.seqSlices holds K contiguous, non-empty token ranges covering the sequence.
// Abstract models (no attention term) get K equal ranges. Transformer models get the Seq1F1B
// computation-wise partition (arXiv 2406.03488): boundaries where the cumulative forward FLOPs
// of a block (linear part plus causal attention, DESIGN §3.1) reach i/K of the total, so a
// later slice, which attends to more keys, gets fewer tokens; boundaries are rounded to a
// multiple of tp so that every tensor-parallel rank holds whole tokens.
//
//===----------------------------------------------------------------------===//
#include "compiler/Partition.h"

#include "compiler/Pass.h"
#include "ir/Error.h"

#include <algorithm>

namespace pipec {

llvm::Error seqSlicesFor(const ModelSpec &model, int k, int tp,
                         std::vector<std::pair<int64_t, int64_t>> &out) {
  int64_t n = model.sequenceLength(k);
  out.clear();
  if (!model.isTransformer()) {
    if (n < k)
      return inputError("--seq-splits {} cuts more slices than the model's seq_length {} has "
                        "tokens; try --seq-splits {}",
                        k, n, n);
    for (int i = 0; i < k; ++i)
      out.emplace_back(n * i / k, n * (i + 1) / k);
    return llvm::Error::success();
  }
  int64_t q = tp;
  if (n < int64_t(k) * q)
    return inputError("--seq-splits {} needs seq_length >= seq-splits·tp = {} (got {}); try "
                      "--seq-splits {}",
                      k, int64_t(k) * q, n, std::max<int64_t>(1, n / q));
  double total = model.blockForwardFlopsPrefix(n);
  int64_t prev = 0;
  for (int i = 1; i <= k; ++i) {
    int64_t end = n;
    if (i < k) {
      // Smallest e with prefix(e) >= i/K of the total (prefix is increasing in e).
      double target = total * double(i) / double(k);
      int64_t lo = 0, hi = n;
      while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (model.blockForwardFlopsPrefix(mid) >= target)
          hi = mid;
        else
          lo = mid + 1;
      }
      end = (lo + q / 2) / q * q; // nearest multiple of tp
      // Keep every slice at least q tokens long, leaving q per remaining slice.
      end = std::clamp(end, prev + q, n - int64_t(k - i) * q);
    }
    out.emplace_back(prev, end);
    prev = end;
  }
  return llvm::Error::success();
}

namespace {

class SeqSplitPass final : public Pass {
public:
  llvm::StringRef name() const override { return "seq-split"; }

  llvm::Expected<bool> run(Plan &plan, PassContext &ctx) override {
    if (auto err =
            seqSlicesFor(*ctx.model, plan.parallel.seqSplits, plan.parallel.tp, plan.seqSlices))
      return err;
    return true;
  }
};

} // namespace

std::unique_ptr<Pass> createSeqSplitPass() { return std::make_unique<SeqSplitPass>(); }

} // namespace pipec
