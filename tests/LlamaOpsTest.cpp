//===- LlamaOpsTest.cpp - Llama-style block primitives (kernels/cpu/LlamaOps.h) ----===//
//
// Each op against things it does not share code with:
//   - gradients against central finite differences of a double-precision model written here;
//   - RMSNorm and SwiGLU forwards against that model; rotary embeddings against the rotation
//     written out by hand for a 4-wide head, and by their defining property (the score of a
//     query and a key depends only on their distance);
//   - grouped-query attention against its multi-head case (Ops.h's attention, the same loop
//     nest with a key/value head per query head) on keys and values repeated per group: this
//     checks the group indexing; the finite differences check the math.
//
//===----------------------------------------------------------------------===//
#include "kernels/cpu/LlamaOps.h"
#include "kernels/cpu/Ops.h"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>
#include <vector>

namespace pipec::kernels::ops {
namespace {

using Vec = std::vector<double>;

std::vector<float> randomFloats(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float &x : v)
    x = dist(rng);
  return v;
}

Vec toDouble(const std::vector<float> &v) { return Vec(v.begin(), v.end()); }

/// d/dx of sum(f(x) * r) by central differences, in double.
Vec finiteDifference(const std::function<Vec(const Vec &)> &f, Vec x, const Vec &r) {
  Vec g(x.size());
  const double h = 1e-6;
  for (size_t i = 0; i < x.size(); ++i) {
    const double keep = x[i];
    auto loss = [&] {
      Vec y = f(x);
      double s = 0;
      for (size_t k = 0; k < y.size(); ++k)
        s += y[k] * r[k];
      return s;
    };
    x[i] = keep + h;
    const double up = loss();
    x[i] = keep - h;
    const double down = loss();
    x[i] = keep;
    g[i] = (up - down) / (2 * h);
  }
  return g;
}

/// |got - want| <= rel * (|want| + 0.1 max|want|), elementwise.
void expectClose(const std::vector<float> &got, const Vec &want, double rel, const char *what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double largest = 0;
  for (double w : want)
    largest = std::max(largest, std::fabs(w));
  ASSERT_GT(largest, 0) << what << ": the reference is all zeros";
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_LE(std::fabs(got[i] - want[i]), rel * (std::fabs(want[i]) + 0.1 * largest))
        << what << "[" << i << "]: " << got[i] << " against " << want[i];
}

// --- RMSNorm -------------------------------------------------------------------------------

Vec rmsnormModel(const Vec &x, const Vec &w, int n, int c) {
  Vec y(x.size());
  for (int r = 0; r < n; ++r) {
    double ss = 0;
    for (int i = 0; i < c; ++i)
      ss += x[r * c + i] * x[r * c + i];
    const double s = 1 / std::sqrt(ss / c + 1e-5);
    for (int i = 0; i < c; ++i)
      y[r * c + i] = x[r * c + i] * s * w[i];
  }
  return y;
}

TEST(LlamaOpsTest, RmsNormAgainstADoublePrecisionModel) {
  const int n = 5, c = 12;
  auto x = randomFloats(n * c, 1), w = randomFloats(c, 2, 0.5f), r = randomFloats(n * c, 3);
  for (float &v : w)
    v += 1.0f;
  std::vector<float> y(n * c), rstd(n), dx(n * c, 0.0f), dw(c, 0.0f);
  rmsnormForward(y.data(), rstd.data(), x.data(), w.data(), n, c);
  expectClose(y, rmsnormModel(toDouble(x), toDouble(w), n, c), 1e-5, "y");
  rmsnormBackwardInputAccumulate(dx.data(), r.data(), x.data(), rstd.data(), w.data(), n, c);
  rmsnormBackwardWeight(dw.data(), r.data(), x.data(), rstd.data(), n, c);
  const Vec xd = toDouble(x), wd = toDouble(w), rd = toDouble(r);
  expectClose(dx, finiteDifference([&](const Vec &v) { return rmsnormModel(v, wd, n, c); }, xd, rd),
              1e-3, "dx");
  expectClose(dw, finiteDifference([&](const Vec &v) { return rmsnormModel(xd, v, n, c); }, wd, rd),
              1e-3, "dw");
  // Accumulates: a second call adds the same again.
  std::vector<float> twice = dx;
  rmsnormBackwardInputAccumulate(twice.data(), r.data(), x.data(), rstd.data(), w.data(), n, c);
  for (size_t i = 0; i < dx.size(); ++i)
    EXPECT_FLOAT_EQ(twice[i], 2 * dx[i]);
}

// --- SwiGLU --------------------------------------------------------------------------------

Vec swigluModel(const Vec &g, const Vec &u) {
  Vec y(g.size());
  for (size_t i = 0; i < g.size(); ++i)
    y[i] = g[i] / (1 + std::exp(-g[i])) * u[i];
  return y;
}

TEST(LlamaOpsTest, SwigluAgainstADoublePrecisionModel) {
  const size_t n = 40;
  auto g = randomFloats(n, 4, 2.0f), u = randomFloats(n, 5), r = randomFloats(n, 6);
  std::vector<float> y(n), dg(n), du(n);
  swigluForward(y.data(), g.data(), u.data(), n);
  expectClose(y, swigluModel(toDouble(g), toDouble(u)), 1e-5, "y");
  swigluBackward(dg.data(), du.data(), r.data(), g.data(), u.data(), n);
  const Vec gd = toDouble(g), ud = toDouble(u), rd = toDouble(r);
  expectClose(dg, finiteDifference([&](const Vec &v) { return swigluModel(v, ud); }, gd, rd), 1e-4,
              "dgate");
  expectClose(du, finiteDifference([&](const Vec &v) { return swigluModel(gd, v); }, ud, rd), 1e-4,
              "dup");
}

// --- Rotary embeddings ---------------------------------------------------------------------

TEST(LlamaOpsTest, RopeTurnsThePairsOfEachHeadByTheirAngles) {
  // One row, two heads of 4: pairs (0, 2) and (1, 3), frequencies 1 and theta^(-1/2) = 1/100.
  std::vector<float> x = {1, 2, 3, 4, -1, 0.5f, 2, -3};
  const int32_t position = 7;
  ropeForward(x.data(), &position, 1, 2, 4, 10000.0);
  const double a0 = 7.0, a1 = 7.0 / 100;
  const double want[8] = {
      1 * std::cos(a0) - 3 * std::sin(a0),  2 * std::cos(a1) - 4 * std::sin(a1),
      3 * std::cos(a0) + 1 * std::sin(a0),  4 * std::cos(a1) + 2 * std::sin(a1),
      -1 * std::cos(a0) - 2 * std::sin(a0), 0.5 * std::cos(a1) + 3 * std::sin(a1),
      2 * std::cos(a0) - 1 * std::sin(a0),  -3 * std::cos(a1) + 0.5 * std::sin(a1)};
  for (int i = 0; i < 8; ++i)
    EXPECT_NEAR(x[i], want[i], 2e-6) << i;
}

TEST(LlamaOpsTest, RopeScoresDependOnlyOnTheDistanceAndTheBackwardIsTheTranspose) {
  const int heads = 2, hd = 8, width = heads * hd;
  auto q = randomFloats(width, 7), k = randomFloats(width, 8);
  auto score = [&](int32_t pq, int32_t pk) {
    std::vector<float> a = q, b = k;
    ropeForward(a.data(), &pq, 1, heads, hd, 500000.0);
    ropeForward(b.data(), &pk, 1, heads, hd, 500000.0);
    double s = 0;
    for (int i = 0; i < hd; ++i) // the first head's score
      s += double(a[i]) * b[i];
    return s;
  };
  EXPECT_NEAR(score(5, 3), score(1005, 1003), 1e-4);
  EXPECT_NEAR(score(40, 0), score(90, 50), 1e-4);
  EXPECT_GT(std::fabs(score(5, 3) - score(5, 4)), 1e-3); // and it does depend on the distance
  // Position 0 is the identity.
  std::vector<float> same = q;
  const int32_t zero = 0;
  ropeForward(same.data(), &zero, 1, heads, hd, 10000.0);
  EXPECT_EQ(same, q);
  // The backward is the gradient of sum(rope(x) * r): rope is linear, so it is rope^T r.
  const int rows = 3;
  const int32_t positions[rows] = {0, 9, 4000};
  auto x = randomFloats(rows * width, 9), r = randomFloats(rows * width, 10);
  auto model = [&](const Vec &v) { // the rotation in double, written out again
    Vec y = v;
    for (int row = 0; row < rows; ++row)
      for (int h = 0; h < heads; ++h)
        for (int i = 0; i < hd / 2; ++i) {
          const double angle = positions[row] * std::pow(10000.0, -2.0 * i / hd);
          const size_t at = size_t(row) * width + size_t(h) * hd + i;
          y[at] = v[at] * std::cos(angle) - v[at + hd / 2] * std::sin(angle);
          y[at + hd / 2] = v[at + hd / 2] * std::cos(angle) + v[at] * std::sin(angle);
        }
    return y;
  };
  std::vector<float> fwd = x;
  ropeForward(fwd.data(), positions, rows, heads, hd, 10000.0);
  expectClose(fwd, model(toDouble(x)), 1e-5, "y");
  std::vector<float> g = r;
  ropeBackward(g.data(), positions, rows, heads, hd, 10000.0);
  expectClose(g, finiteDifference(model, toDouble(x), toDouble(r)), 1e-4, "dx");
  // And backward after forward gives the input back.
  std::vector<float> back = x;
  ropeForward(back.data(), positions, rows, heads, hd, 10000.0);
  ropeBackward(back.data(), positions, rows, heads, hd, 10000.0);
  for (size_t i = 0; i < x.size(); ++i)
    EXPECT_NEAR(back[i], x[i], 1e-5);
}

// --- Grouped-query attention ---------------------------------------------------------------

/// Causal attention in double: q (B, x, H hd), k/v (a+x, B, G hd).
Vec attentionModel(const Vec &q, const Vec &k, const Vec &v, const GroupedAttentionShape &s) {
  const int hd = s.headDim, group = s.heads / s.kvHeads;
  Vec out(q.size(), 0);
  for (int b = 0; b < s.batch; ++b)
    for (int h = 0; h < s.heads; ++h)
      for (int t = 0; t < s.queries; ++t) {
        const int pos = s.begin + t, g = h / group;
        Vec p(pos + 1);
        double mx = -1e300, sum = 0;
        for (int j = 0; j <= pos; ++j) {
          double dot = 0;
          for (int d = 0; d < hd; ++d)
            dot += q[(size_t(b) * s.queries + t) * s.heads * hd + h * hd + d] *
                   k[(size_t(j) * s.batch + b) * s.kvHeads * hd + g * hd + d];
          p[j] = dot / std::sqrt(double(hd));
          mx = std::max(mx, p[j]);
        }
        for (double &e : p)
          sum += (e = std::exp(e - mx));
        for (int j = 0; j <= pos; ++j)
          for (int d = 0; d < hd; ++d)
            out[(size_t(b) * s.queries + t) * s.heads * hd + h * hd + d] +=
                p[j] / sum * v[(size_t(j) * s.batch + b) * s.kvHeads * hd + g * hd + d];
      }
  return out;
}

TEST(LlamaOpsTest, GroupedAttentionAgainstADoublePrecisionModel) {
  // A later sub-sequence (begin 3) of 4 queries, 4 query heads sharing 2 key/value heads.
  GroupedAttentionShape s{2, 4, 3, 4, 2, 4};
  const int keys = s.keys();
  auto q = randomFloats(size_t(s.batch) * s.queries * s.heads * s.headDim, 11);
  auto k = randomFloats(size_t(keys) * s.batch * s.kvHeads * s.headDim, 12);
  auto v = randomFloats(size_t(keys) * s.batch * s.kvHeads * s.headDim, 13);
  auto r = randomFloats(q.size(), 14);
  std::vector<float> out(q.size()), probs(size_t(s.batch) * s.heads * s.queries * keys);
  groupedAttentionForward(out.data(), probs.data(), q.data(), k.data(), v.data(), s);
  const Vec qd = toDouble(q), kd = toDouble(k), vd = toDouble(v), rd = toDouble(r);
  expectClose(out, attentionModel(qd, kd, vd, s), 1e-4, "out");
  std::vector<float> dq(q.size()), dk(k.size(), 0.0f), dv(v.size(), 0.0f);
  groupedAttentionBackward(dq.data(), dk.data(), dv.data(), r.data(), probs.data(), q.data(),
                           k.data(), v.data(), s);
  expectClose(dq,
              finiteDifference([&](const Vec &x) { return attentionModel(x, kd, vd, s); }, qd, rd),
              1e-3, "dq");
  expectClose(dk,
              finiteDifference([&](const Vec &x) { return attentionModel(qd, x, vd, s); }, kd, rd),
              1e-3, "dk");
  expectClose(dv,
              finiteDifference([&](const Vec &x) { return attentionModel(qd, kd, x, s); }, vd, rd),
              1e-3, "dv");
}

TEST(LlamaOpsTest, GroupedAttentionIsMultiHeadAttentionOnRepeatedKeysAndValues) {
  const int batch = 2, queries = 3, begin = 2, heads = 6, hd = 4;
  for (int kvHeads : {6, 3, 2, 1}) {
    GroupedAttentionShape g{batch, queries, begin, heads, kvHeads, hd};
    AttentionShape m{batch, queries, begin, heads, hd};
    const int keys = g.keys(), group = heads / kvHeads;
    auto q = randomFloats(size_t(batch) * queries * heads * hd, 20 + kvHeads);
    auto k = randomFloats(size_t(keys) * batch * kvHeads * hd, 30 + kvHeads);
    auto v = randomFloats(size_t(keys) * batch * kvHeads * hd, 40 + kvHeads);
    auto r = randomFloats(q.size(), 50 + kvHeads);
    // Each key/value head copied to the query heads of its group.
    std::vector<float> kRep(size_t(keys) * batch * heads * hd), vRep(kRep.size());
    for (int j = 0; j < keys * batch; ++j)
      for (int h = 0; h < heads; ++h)
        for (int d = 0; d < hd; ++d) {
          kRep[(size_t(j) * heads + h) * hd + d] = k[(size_t(j) * kvHeads + h / group) * hd + d];
          vRep[(size_t(j) * heads + h) * hd + d] = v[(size_t(j) * kvHeads + h / group) * hd + d];
        }
    std::vector<float> outG(q.size()), outM(q.size());
    std::vector<float> probsG(size_t(batch) * heads * queries * keys), probsM(probsG.size());
    groupedAttentionForward(outG.data(), probsG.data(), q.data(), k.data(), v.data(), g);
    attentionForward(outM.data(), probsM.data(), q.data(), kRep.data(), vRep.data(), m);
    EXPECT_EQ(outG, outM) << kvHeads; // the same sums in the same order
    EXPECT_EQ(probsG, probsM) << kvHeads;
    std::vector<float> dqG(q.size()), dkG(k.size(), 0.0f), dvG(v.size(), 0.0f);
    std::vector<float> dqM(q.size()), dkM(kRep.size(), 0.0f), dvM(vRep.size(), 0.0f);
    groupedAttentionBackward(dqG.data(), dkG.data(), dvG.data(), r.data(), probsG.data(), q.data(),
                             k.data(), v.data(), g);
    attentionBackward(dqM.data(), dkM.data(), dvM.data(), r.data(), probsM.data(), q.data(),
                      kRep.data(), vRep.data(), m);
    EXPECT_EQ(dqG, dqM) << kvHeads;
    // A shared key's gradient is the sum of its copies'.
    for (int j = 0; j < keys * batch; ++j)
      for (int kh = 0; kh < kvHeads; ++kh)
        for (int d = 0; d < hd; ++d) {
          double sk = 0, sv = 0;
          for (int h = kh * group; h < (kh + 1) * group; ++h) {
            sk += dkM[(size_t(j) * heads + h) * hd + d];
            sv += dvM[(size_t(j) * heads + h) * hd + d];
          }
          EXPECT_NEAR(dkG[(size_t(j) * kvHeads + kh) * hd + d], sk, 1e-5) << kvHeads;
          EXPECT_NEAR(dvG[(size_t(j) * kvHeads + kh) * hd + d], sv, 1e-5) << kvHeads;
        }
  }
}

} // namespace
} // namespace pipec::kernels::ops
