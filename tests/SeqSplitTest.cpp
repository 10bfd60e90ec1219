//===- SeqSplitTest.cpp - The seq-split pass on its own -------------------===//
//
// seq-split (compiler/SeqSplit.cpp) cuts each microbatch into K sub-sequences: K equal token
// ranges for an abstract model, and for a transformer Seq1F1B's computation-wise partition
// (arXiv 2406.03488): slices of equal forward FLOPs, causal attention included, with
// boundaries on multiples of tp. Here it runs alone:
//  - goldens: the slices of small and realistic configurations (regenerate with
//    `bazel run //tests:seq_split_test -- --update`, never by hand);
//  - a sweep: the slices cover the sequence in order, none empty, boundaries on multiples of
//    tp; abstract slices differ by at most one token; a transformer's slices carry equal
//    shares of docs/contracts.md#model-spec-pipemodel1's forward FLOPs (computed here from the
//    formula, in closed form) up to the rounding of their two boundaries, a later slice never has
//    more than a tp's worth of tokens more than the one before it, and the split is never less
//    balanced than equal token counts;
//  - negative: more slices than tokens (abstract), fewer than seq-splits·tp tokens (transformer).
//
//===----------------------------------------------------------------------===//
#include "ir/formats/SpecJson.h"
#include "tests/PassTestUtil.h"

#include <algorithm>
#include <cmath>

namespace pipec::test {
namespace {

const llvm::StringRef kSeqSplit[] = {"seq-split"};

ModelSpec transformer(int64_t hidden, int64_t heads, int64_t ffn, int64_t seq, int64_t mbs = 1) {
  return modelOrFail(fmt::format(R"({{"format": "pipemodel/1", "name": "gpt",
      "transformer": {{"num_layers": 4, "hidden_size": {}, "num_attention_heads": {},
      "ffn_hidden_size": {}, "vocab_size": 32000, "seq_length": {}, "microbatch_size": {}}}}})",
                                 hidden, heads, ffn, seq, mbs),
                     "gpt.json");
}

ModelSpec abstractModel(int64_t seq) {
  ModelSpec m = uniformModel(4);
  m.seqLength = seq;
  return m;
}

std::vector<std::pair<int64_t, int64_t>> slicesOf(const ModelSpec &model, int k, int tp = 1) {
  PassRun run(model, options("gpipe", 1, 1, 1, k, tp));
  run.runOrFail(kSeqSplit);
  return run.plan.seqSlices;
}

std::string slicesText(const std::vector<std::pair<int64_t, int64_t>> &slices) {
  std::string s = "seq_slices:";
  for (auto [b, e] : slices)
    s += fmt::format(" [{}, {})", b, e);
  return s + "\n";
}

TEST(SeqSplitGolden, MatchesTheCheckedInSlices) {
  std::string text;
  text += "abstract seq_length 10, K 3: " + slicesText(slicesOf(abstractModel(10), 3));
  text += "abstract seq_length 7, K 7: " + slicesText(slicesOf(abstractModel(7), 7));
  // The 7B model of examples/gpt-7b-8k.json (h 4096, f 16384, 8k tokens).
  ModelSpec gpt7b = transformer(4096, 32, 16384, 8192);
  text += "gpt-7b 8k, K 4, tp 1: " + slicesText(slicesOf(gpt7b, 4));
  text += "gpt-7b 8k, K 4, tp 8: " + slicesText(slicesOf(gpt7b, 4, 8));
  text += "gpt-7b 8k, K 8, tp 2: " + slicesText(slicesOf(gpt7b, 8, 2));
  // Long context: attention dominates, so the last slice is much shorter than the first.
  ModelSpec longCtx = transformer(1024, 16, 4096, 131072);
  text += "h 1024 128k, K 4, tp 1: " + slicesText(slicesOf(longCtx, 4));
  expectMatchesGolden("seq_split_slices", text, "seq_split_test");
}

void expectCoverInOrder(const std::vector<std::pair<int64_t, int64_t>> &s, int64_t n, int k,
                        int tp) {
  ASSERT_EQ(s.size(), size_t(k));
  EXPECT_EQ(s.front().first, 0);
  EXPECT_EQ(s.back().second, n);
  for (size_t i = 0; i < s.size(); ++i) {
    EXPECT_LT(s[i].first, s[i].second) << "slice " << i << " is empty";
    if (i > 0) {
      EXPECT_EQ(s[i].first, s[i - 1].second) << "slice " << i << " does not follow on";
    }
    if (i + 1 < s.size()) {
      EXPECT_EQ(s[i].second % tp, 0) << "boundary " << s[i].second << " not a multiple of tp";
    }
  }
}

TEST(SeqSplitSweep, AbstractSlicesAreEqualTokenRanges) {
  for (int64_t n = 1; n <= 40; ++n)
    for (int k = 1; k <= n && k <= 12; ++k) {
      SCOPED_TRACE(fmt::format("n={} K={}", n, k));
      auto s = slicesOf(abstractModel(n), k);
      expectCoverInOrder(s, n, k, 1);
      int64_t shortest = n, longest = 0;
      for (auto [b, e] : s) {
        shortest = std::min(shortest, e - b);
        longest = std::max(longest, e - b);
      }
      EXPECT_LE(longest - shortest, 1);
    }
}

/// docs/contracts.md#model-spec-pipemodel1: forward FLOPs of tokens [a, e) through one block, b_mb
/// = 1: x·(8h² + 4hf) + 4h·Σ_{t=a}^{e-1}(t+1), the sum in closed form.
double forwardFlops(double h, double f, int64_t a, int64_t e) {
  double x = double(e - a);
  double positions = (double(e) * double(e + 1) - double(a) * double(a + 1)) / 2;
  return x * (8 * h * h + 4 * h * f) + 4 * h * positions;
}

TEST(SeqSplitSweep, TransformerSlicesCarryEqualForwardFlops) {
  struct Shape {
    int64_t h, heads, f, n;
  };
  for (Shape sh : {Shape{256, 4, 1024, 4096}, Shape{4096, 32, 16384, 8192},
                   Shape{1024, 16, 4096, 32768}, Shape{512, 8, 2048, 2000}})
    for (int k : {1, 2, 3, 4, 6, 8})
      for (int tp : {1, 2, 4, 8}) {
        if (sh.n < 4 * int64_t(k) * tp)
          continue;
        SCOPED_TRACE(fmt::format("h={} n={} K={} tp={}", sh.h, sh.n, k, tp));
        auto s = slicesOf(transformer(sh.h, sh.heads, sh.f, sh.n), k, tp);
        expectCoverInOrder(s, sh.n, k, tp);
        const double h = double(sh.h), f = double(sh.f);
        const double total = forwardFlops(h, f, 0, sh.n);
        // A boundary is the first token where the prefix reaches i/K of the total, rounded to
        // the nearest multiple of tp: off by at most tp/2 + 1 tokens, each of at most the last
        // token's FLOPs.
        const double token = forwardFlops(h, f, sh.n - 1, sh.n);
        const double slack = 2 * (tp / 2.0 + 1) * token;
        double worst = 0;
        for (size_t i = 0; i < s.size(); ++i) {
          double mine = forwardFlops(h, f, s[i].first, s[i].second);
          EXPECT_NEAR(mine, total / k, slack) << "slice " << i;
          worst = std::max(worst, mine);
          if (i > 0) {
            EXPECT_LE(s[i].second - s[i].first, s[i - 1].second - s[i - 1].first + tp)
                << "a later slice, which attends to more keys, has more tokens";
          }
        }
        // Never less balanced than equal token counts.
        double evenWorst = 0;
        for (int i = 0; i < k; ++i)
          evenWorst = std::max(evenWorst, forwardFlops(h, f, sh.n * i / k, sh.n * (i + 1) / k));
        EXPECT_LE(worst, evenWorst + slack);
      }
}

TEST(SeqSplitTest, MoreSlicesThanTokensIsAnErrorWithTheNearestValidValue) {
  PassRun run(abstractModel(4), options("gpipe", 1, 1, 1, /*seqSplits=*/5));
  std::string msg = errorText(run.run(kSeqSplit));
  EXPECT_EQ(msg, "--seq-splits 5 cuts more slices than the model's seq_length 4 has tokens; try "
                 "--seq-splits 4");
}

TEST(SeqSplitTest, FewerTokensThanSlicesTimesTpIsAnErrorWithTheNearestValidValue) {
  PassRun run(transformer(64, 4, 256, 12), options("gpipe", 1, 1, 1, /*seqSplits=*/4, /*tp=*/4));
  std::string msg = errorText(run.run(kSeqSplit));
  EXPECT_EQ(msg, "--seq-splits 4 needs seq_length >= seq-splits·tp = 16 (got 12); try "
                 "--seq-splits 3");
}

} // namespace
} // namespace pipec::test

int main(int argc, char **argv) { return pipec::test::goldenMain(argc, argv); }
