//===- LlamaOps.cpp - fp32 primitives of Llama-style blocks ----------------===//
#include "kernels/cpu/LlamaOps.h"

#include <cassert>
#include <cmath>

namespace pipec::kernels::ops {

void rmsnormForward(float *__restrict__ out, float *__restrict__ rstd, const float *__restrict__ in,
                    const float *__restrict__ w, int n, int c, float eps) {
  for (int r = 0; r < n; ++r) {
    const float *x = in + size_t(r) * c;
    float *o = out + size_t(r) * c;
    float sumSq = 0.0f;
    for (int i = 0; i < c; ++i)
      sumSq += x[i] * x[i];
    const float s = 1.0f / std::sqrt(sumSq / float(c) + eps);
    rstd[r] = s;
    for (int i = 0; i < c; ++i)
      o[i] = x[i] * s * w[i];
  }
}

void rmsnormBackwardInputAccumulate(float *__restrict__ dIn, const float *__restrict__ dOut,
                                    const float *__restrict__ in, const float *__restrict__ rstd,
                                    const float *__restrict__ w, int n, int c) {
  // y = x s w with s = (mean(x^2) + eps)^(-1/2): dx = s (w dy - xhat mean(w dy xhat)),
  // xhat = x s.
  for (int r = 0; r < n; ++r) {
    const float *x = in + size_t(r) * c;
    const float *dy = dOut + size_t(r) * c;
    float *dx = dIn + size_t(r) * c;
    const float s = rstd[r];
    float dot = 0.0f;
    for (int i = 0; i < c; ++i)
      dot += w[i] * dy[i] * x[i] * s;
    const float mean = dot / float(c);
    for (int i = 0; i < c; ++i)
      dx[i] += s * (w[i] * dy[i] - x[i] * s * mean);
  }
}

void rmsnormBackwardWeight(float *__restrict__ dW, const float *__restrict__ dOut,
                           const float *__restrict__ in, const float *__restrict__ rstd, int n,
                           int c) {
  for (int r = 0; r < n; ++r) {
    const float *x = in + size_t(r) * c;
    const float *dy = dOut + size_t(r) * c;
    for (int i = 0; i < c; ++i)
      dW[i] += dy[i] * x[i] * rstd[r];
  }
}

void swigluForward(float *__restrict__ out, const float *__restrict__ gate,
                   const float *__restrict__ up, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const float g = gate[i];
    out[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

void swigluBackward(float *__restrict__ dGate, float *__restrict__ dUp,
                    const float *__restrict__ dOut, const float *__restrict__ gate,
                    const float *__restrict__ up, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const float g = gate[i];
    const float sig = 1.0f / (1.0f + std::exp(-g));
    const float silu = g * sig;
    dUp[i] = dOut[i] * silu;
    dGate[i] = dOut[i] * up[i] * (sig + silu * (1.0f - sig));
  }
}

namespace {
/// Turn each head's pairs (i, i + half) of every row by `sign` times its angle.
void rotate(float *x, const int32_t *positions, int rows, int heads, int headDim, double theta,
            double sign) {
  assert(headDim % 2 == 0 && "rotary embeddings need an even head size");
  const int half = headDim / 2;
  for (int r = 0; r < rows; ++r) {
    for (int i = 0; i < half; ++i) {
      // In double, then rounded once: the angles of long sequences keep their digits.
      const double angle = sign * double(positions[r]) * std::pow(theta, -2.0 * i / headDim);
      const float cs = float(std::cos(angle)), sn = float(std::sin(angle));
      for (int h = 0; h < heads; ++h) {
        float *head = x + size_t(r) * heads * headDim + size_t(h) * headDim;
        const float a = head[i], b = head[i + half];
        head[i] = a * cs - b * sn;
        head[i + half] = b * cs + a * sn;
      }
    }
  }
}
} // namespace

void ropeForward(float *x, const int32_t *positions, int rows, int heads, int headDim,
                 double theta) {
  rotate(x, positions, rows, heads, headDim, theta, 1.0);
}

void ropeBackward(float *dx, const int32_t *positions, int rows, int heads, int headDim,
                  double theta) {
  rotate(dx, positions, rows, heads, headDim, theta, -1.0);
}

namespace {

/// One query row of grouped attention, with its offsets: in q, out, dq, dOut (B, x, heads*hd),
/// in probs (B, heads, x, keys), and its key/value head's in k, v, dk, dv (a + x, B,
/// kvHeads*hd).
struct QueryRow {
  int pos;        // the row's position: keys [0, pos] are visible (causal)
  size_t row;     // q, out, dq, dOut
  size_t probs;   // probs
  size_t kvHead;  // key 0's head
  size_t kvPitch; // from one key's row to the next
  size_t kv(int j) const { return kvHead + size_t(j) * kvPitch; }
};

/// Calls f(QueryRow) for every query row: batch by batch, head by head, query by query; query
/// head h reads key/value head h / (heads / kvHeads).
template <typename F> void forEachQueryRow(const GroupedAttentionShape &s, F f) {
  assert(s.kvHeads > 0 && s.heads % s.kvHeads == 0 && "key/value heads divide the heads");
  const int hd = s.headDim, group = s.heads / s.kvHeads;
  const size_t qWidth = size_t(s.heads) * hd, kvWidth = size_t(s.kvHeads) * hd;
  for (int b = 0; b < s.batch; ++b)
    for (int h = 0; h < s.heads; ++h)
      for (int t = 0; t < s.queries; ++t)
        f(QueryRow{s.begin + t, (size_t(b) * s.queries + t) * qWidth + size_t(h) * hd,
                   ((size_t(b) * s.heads + h) * s.queries + t) * size_t(s.keys()),
                   size_t(b) * kvWidth + size_t(h / group) * hd, size_t(s.batch) * kvWidth});
}

} // namespace

void groupedAttentionForward(float *__restrict__ out, float *__restrict__ probs,
                             const float *__restrict__ q, const float *__restrict__ k,
                             const float *__restrict__ v, const GroupedAttentionShape &s) {
  const int hd = s.headDim, keys = s.keys();
  const float scale = 1.0f / std::sqrt(float(hd));
  forEachQueryRow(s, [&](const QueryRow &r) {
    const int pos = r.pos;
    const float *qRow = q + r.row;
    float *p = probs + r.probs;
    float maxScore = -INFINITY;
    for (int j = 0; j <= pos; ++j) {
      const float *kRow = k + r.kv(j);
      float dot = 0.0f;
      for (int d = 0; d < hd; ++d)
        dot += qRow[d] * kRow[d];
      p[j] = dot * scale;
      maxScore = std::fmax(maxScore, p[j]);
    }
    float sum = 0.0f;
    for (int j = 0; j <= pos; ++j) {
      p[j] = std::exp(p[j] - maxScore);
      sum += p[j];
    }
    const float inv = 1.0f / sum;
    for (int j = 0; j <= pos; ++j)
      p[j] *= inv;
    for (int j = pos + 1; j < keys; ++j)
      p[j] = 0.0f;
    float *o = out + r.row;
    for (int d = 0; d < hd; ++d)
      o[d] = 0.0f;
    for (int j = 0; j <= pos; ++j) {
      const float *vRow = v + r.kv(j);
      for (int d = 0; d < hd; ++d)
        o[d] += p[j] * vRow[d];
    }
  });
}

void groupedAttentionBackward(float *__restrict__ dq, float *__restrict__ dk,
                              float *__restrict__ dv, const float *__restrict__ dOut,
                              const float *__restrict__ probs, const float *__restrict__ q,
                              const float *__restrict__ k, const float *__restrict__ v,
                              const GroupedAttentionShape &s) {
  const int hd = s.headDim;
  const float scale = 1.0f / std::sqrt(float(hd));
  forEachQueryRow(s, [&](const QueryRow &r) {
    const int pos = r.pos;
    const size_t row = r.row;
    const float *p = probs + r.probs;
    const float *dO = dOut + row;
    // dP_j = dO . v_j; dv_j += p_j dO; softmax backward dS_j = p_j (dP_j - sum_i p_i dP_i).
    float pdp = 0.0f;
    for (int j = 0; j <= pos; ++j) {
      const size_t kv = r.kv(j);
      float dp = 0.0f;
      for (int d = 0; d < hd; ++d) {
        dp += dO[d] * v[kv + d];
        dv[kv + d] += p[j] * dO[d];
      }
      pdp += p[j] * dp;
    }
    float *dqRow = dq + row;
    const float *qRow = q + row;
    for (int d = 0; d < hd; ++d)
      dqRow[d] = 0.0f;
    for (int j = 0; j <= pos; ++j) {
      const size_t kv = r.kv(j);
      float dp = 0.0f;
      for (int d = 0; d < hd; ++d)
        dp += dO[d] * v[kv + d];
      const float dsScaled = p[j] * (dp - pdp) * scale;
      for (int d = 0; d < hd; ++d) {
        dqRow[d] += dsScaled * k[kv + d];
        dk[kv + d] += dsScaled * qRow[d];
      }
    }
  });
}

} // namespace pipec::kernels::ops
