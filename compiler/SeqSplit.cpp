//===- SeqSplit.cpp - Cut each microbatch into K sub-sequences -------------===//
//
// Establishes: plan.seqSlices holds K contiguous, non-empty token ranges covering the sequence.
// Abstract models (no attention term) get K equal ranges. Transformer models get slices of
// equal predicted time: a block's F + B + W for the slice under the cluster spec (its GEMM
// efficiency by shape, attention kernel, memory-bound kernels and fixed costs), so a later
// slice, which attends to more keys, gets fewer tokens. --seq-split-by flops keeps the
// Seq1F1B paper's computation-wise partition (arXiv 2406.03488): boundaries where the
// cumulative forward FLOPs of a block (linear part plus causal attention,
// docs/contracts.md#model-spec-pipemodel1) reach i/K of the total. Boundaries are multiples of tp
// so that every tensor-parallel rank holds whole tokens.
//
//===----------------------------------------------------------------------===//
#include "compiler/Partition.h"

#include "compiler/Pass.h"
#include "ir/support/Error.h"

#include <algorithm>

namespace pipec {

namespace {

/// Time-balanced boundaries: each slice's block time (F + B + W) as close to a common T as
/// multiples of q allow; T by bisection so that the last slice, which takes what is left, is
/// no further from it than the others.
void timeBalanced(const ModelSpec &model, const ClusterSpec &cluster, int k, int tp, bool sp,
                  int64_t n, int64_t q, std::vector<std::pair<int64_t, int64_t>> &out) {
  size_t block = 0;
  while (model.layers[block].kind != LayerKind::Block)
    ++block;
  auto cost = [&](int64_t b, int64_t e) {
    SliceCost c = model.sliceCost(cluster, block, b, e, 0, k, tp, sp);
    return c.forward + c.backwardInput + c.backwardWeight;
  };
  // Cut k - 1 slices of about `target` each; the last takes the rest.
  auto cut = [&](double target, std::vector<std::pair<int64_t, int64_t>> &slices) {
    slices.clear();
    int64_t prev = 0;
    for (int i = 1; i < k; ++i) {
      int64_t lo = prev + q, hi = n - int64_t(k - i) * q; // in multiples of q from prev
      // Smallest multiple of q (in [lo, hi]) whose slice reaches the target.
      int64_t a = lo / q, b = hi / q;
      while (a < b) {
        int64_t mid = a + (b - a) / 2;
        if (cost(prev, mid * q) >= target)
          b = mid;
        else
          a = mid + 1;
      }
      int64_t end = a * q;
      // Or the multiple below it, when that is nearer the target.
      if (end - q >= lo && target - cost(prev, end - q) < cost(prev, end) - target)
        end -= q;
      slices.emplace_back(prev, end);
      prev = end;
    }
    slices.emplace_back(prev, n);
    return cost(prev, n);
  };
  double lo = 0, hi = cost(0, n);
  std::vector<std::pair<int64_t, int64_t>> slices;
  for (int it = 0; it < 60; ++it) {
    double mid = (lo + hi) / 2;
    if (cut(mid, slices) > mid) // the last slice is left too much: aim higher
      lo = mid;
    else
      hi = mid;
  }
  // Of the two ends of the bracket, the cut whose slowest slice is the faster.
  std::vector<std::pair<int64_t, int64_t>> a, b;
  cut(lo, a);
  cut(hi, b);
  auto slowest = [&](const std::vector<std::pair<int64_t, int64_t>> &s) {
    double m = 0;
    for (auto [x, e] : s)
      m = std::max(m, cost(x, e));
    return m;
  };
  out = slowest(a) <= slowest(b) ? a : b;
}

} // namespace

llvm::Error seqSlicesFor(const ModelSpec &model, const ClusterSpec &cluster,
                         const ParallelConfig &pc, std::vector<std::pair<int64_t, int64_t>> &out) {
  return seqSlicesFor(model, pc.seqSplits, pc.tp, out, pc.seqSplitByFlops ? nullptr : &cluster,
                      pc.sequenceParallel);
}

llvm::Error seqSlicesFor(const ModelSpec &model, int k, int tp,
                         std::vector<std::pair<int64_t, int64_t>> &out, const ClusterSpec *cluster,
                         bool sequenceParallel) {
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
  if (cluster && k > 1) {
    timeBalanced(model, *cluster, k, tp, sequenceParallel, n, q, out);
    return llvm::Error::success();
  }
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
    if (auto err = seqSlicesFor(*ctx.model, *ctx.cluster, plan.parallel, plan.seqSlices))
      return err;
    return true;
  }
};

} // namespace

std::unique_ptr<Pass> createSeqSplitPass() { return std::make_unique<SeqSplitPass>(); }

} // namespace pipec
