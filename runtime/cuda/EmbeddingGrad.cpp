//===- EmbeddingGrad.cpp - How the embedding backward adds a slice's rows ---===//
#include "runtime/cuda/EmbeddingGrad.h"

#include <algorithm>
#include <cassert>

namespace pipec {

EmbeddingGradPlan planEmbeddingGrad(std::span<const int32_t> tokens, int32_t vocabBegin,
                                    int32_t vocabEnd) {
  EmbeddingGradPlan plan;
  for (size_t r = 0; r < tokens.size(); ++r)
    if (tokens[r] >= vocabBegin && tokens[r] < vocabEnd)
      plan.order.push_back(int32_t(r));
  const size_t n = plan.order.size();
  std::stable_sort(plan.order.begin(), plan.order.end(),
                   [&](int32_t a, int32_t b) { return tokens[size_t(a)] < tokens[size_t(b)]; });
  auto tokenAt = [&](size_t position) { return tokens[size_t(plan.order[position])]; };
  for (size_t begin = 0; begin < n;) {
    size_t end = begin;
    while (end < n && tokenAt(end) == tokenAt(begin))
      ++end;
    if (end - begin <= size_t(kEmbeddingPieceRows)) {
      plan.pieces.insert(plan.pieces.end(), {int32_t(begin), int32_t(end), -1});
    } else {
      const int first = plan.slots;
      for (size_t at = begin; at < end; at += kEmbeddingPieceRows)
        plan.pieces.insert(
            plan.pieces.end(),
            {int32_t(at), int32_t(std::min(end, at + kEmbeddingPieceRows)), int32_t(plan.slots++)});
      plan.merges.insert(plan.merges.end(), {tokenAt(begin), first, plan.slots - first});
    }
    begin = end;
  }
  assert(size_t(plan.slots) <= maxEmbeddingGradSlots(n));
  assert(plan.order.size() + plan.pieces.size() + plan.merges.size() <= maxEmbeddingGradInts(n));
  return plan;
}

} // namespace pipec
