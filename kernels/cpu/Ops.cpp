//===- Ops.cpp - fp32 primitive ops of the CPU reference GPT -----------------===//
//
// Plain loop nests, ordered so that the innermost loop walks contiguous memory. No threads:
// the runtime runs each rank as a thread of its own.
//
//===----------------------------------------------------------------------===//
#include "kernels/cpu/Ops.h"
#include "kernels/cpu/LlamaOps.h"

#include <algorithm>
#include <cassert>
#include <cmath>

namespace pipec::kernels::ops {

void matmulForward(float *__restrict__ out, const float *__restrict__ in,
                   const float *__restrict__ w, const float *__restrict__ bias, int n, int i,
                   int o) {
  for (int r = 0; r < n; ++r) {
    float *__restrict__ outRow = out + size_t(r) * o;
    for (int c = 0; c < o; ++c)
      outRow[c] = bias ? bias[c] : 0.0f;
    const float *inRow = in + size_t(r) * i;
    for (int k = 0; k < i; ++k) {
      float a = inRow[k];
      const float *__restrict__ wRow = w + size_t(k) * o;
      for (int c = 0; c < o; ++c)
        outRow[c] += a * wRow[c];
    }
  }
}

void matmulBackwardInput(float *__restrict__ dIn, const float *__restrict__ dOut,
                         const float *__restrict__ w, int n, int i, int o) {
  for (int r = 0; r < n; ++r) {
    const float *dOutRow = dOut + size_t(r) * o;
    for (int k = 0; k < i; ++k) {
      const float *wRow = w + size_t(k) * o;
      float sum = 0.0f;
      for (int c = 0; c < o; ++c)
        sum += dOutRow[c] * wRow[c];
      dIn[size_t(r) * i + k] = sum;
    }
  }
}

void matmulBackwardWeight(float *__restrict__ dW, float *__restrict__ dBias,
                          const float *__restrict__ in, const float *__restrict__ dOut, int n,
                          int i, int o) {
  for (int r = 0; r < n; ++r) {
    const float *dOutRow = dOut + size_t(r) * o;
    const float *inRow = in + size_t(r) * i;
    for (int k = 0; k < i; ++k) {
      float a = inRow[k];
      float *__restrict__ dWRow = dW + size_t(k) * o;
      for (int c = 0; c < o; ++c)
        dWRow[c] += a * dOutRow[c];
    }
    if (dBias)
      for (int c = 0; c < o; ++c)
        dBias[c] += dOutRow[c];
  }
}

void matmulTForward(float *__restrict__ out, const float *__restrict__ in,
                    const float *__restrict__ w, int n, int i, int o) {
  for (int r = 0; r < n; ++r) {
    const float *inRow = in + size_t(r) * i;
    for (int c = 0; c < o; ++c) {
      const float *wRow = w + size_t(c) * i;
      float sum = 0.0f;
      for (int k = 0; k < i; ++k)
        sum += inRow[k] * wRow[k];
      out[size_t(r) * o + c] = sum;
    }
  }
}

void matmulTBackwardInput(float *__restrict__ dIn, const float *__restrict__ dOut,
                          const float *__restrict__ w, int n, int i, int o) {
  for (int r = 0; r < n; ++r) {
    float *__restrict__ dInRow = dIn + size_t(r) * i;
    for (int k = 0; k < i; ++k)
      dInRow[k] = 0.0f;
    for (int c = 0; c < o; ++c) {
      float g = dOut[size_t(r) * o + c];
      const float *__restrict__ wRow = w + size_t(c) * i;
      for (int k = 0; k < i; ++k)
        dInRow[k] += g * wRow[k];
    }
  }
}

void matmulTBackwardWeight(float *__restrict__ dW, const float *__restrict__ in,
                           const float *__restrict__ dOut, int n, int i, int o) {
  for (int r = 0; r < n; ++r) {
    const float *inRow = in + size_t(r) * i;
    for (int c = 0; c < o; ++c) {
      float g = dOut[size_t(r) * o + c];
      float *__restrict__ dWRow = dW + size_t(c) * i;
      for (int k = 0; k < i; ++k)
        dWRow[k] += g * inRow[k];
    }
  }
}

void layernormForward(float *__restrict__ out, float *__restrict__ mean, float *__restrict__ rstd,
                      const float *__restrict__ in, const float *__restrict__ w,
                      const float *__restrict__ b, int n, int c, float eps) {
  for (int r = 0; r < n; ++r) {
    const float *x = in + size_t(r) * c;
    float m = 0.0f;
    for (int k = 0; k < c; ++k)
      m += x[k];
    m /= c;
    float var = 0.0f;
    for (int k = 0; k < c; ++k)
      var += (x[k] - m) * (x[k] - m);
    var /= c;
    float s = 1.0f / std::sqrt(var + eps);
    float *y = out + size_t(r) * c;
    for (int k = 0; k < c; ++k)
      y[k] = (x[k] - m) * s * w[k] + (b ? b[k] : 0.0f);
    mean[r] = m;
    rstd[r] = s;
  }
}

void layernormBackwardInputAccumulate(float *__restrict__ dIn, const float *__restrict__ dOut,
                                      const float *__restrict__ in, const float *__restrict__ mean,
                                      const float *__restrict__ rstd, const float *__restrict__ w,
                                      int n, int c) {
  for (int r = 0; r < n; ++r) {
    const float *x = in + size_t(r) * c;
    const float *dy = dOut + size_t(r) * c;
    float m = mean[r], s = rstd[r];
    // dx = rstd * (dnorm - mean(dnorm) - xhat * mean(dnorm * xhat)), dnorm = dy * w.
    float dnormMean = 0.0f, dnormXhatMean = 0.0f;
    for (int k = 0; k < c; ++k) {
      float xhat = (x[k] - m) * s;
      float dnorm = dy[k] * w[k];
      dnormMean += dnorm;
      dnormXhatMean += dnorm * xhat;
    }
    dnormMean /= c;
    dnormXhatMean /= c;
    float *dx = dIn + size_t(r) * c;
    for (int k = 0; k < c; ++k) {
      float xhat = (x[k] - m) * s;
      float dnorm = dy[k] * w[k];
      dx[k] += s * (dnorm - dnormMean - xhat * dnormXhatMean);
    }
  }
}

void layernormBackwardWeight(float *__restrict__ dW, float *__restrict__ dB,
                             const float *__restrict__ dOut, const float *__restrict__ in,
                             const float *__restrict__ mean, const float *__restrict__ rstd, int n,
                             int c) {
  for (int r = 0; r < n; ++r) {
    const float *x = in + size_t(r) * c;
    const float *dy = dOut + size_t(r) * c;
    for (int k = 0; k < c; ++k) {
      float xhat = (x[k] - mean[r]) * rstd[r];
      dW[k] += dy[k] * xhat;
      if (dB)
        dB[k] += dy[k];
    }
  }
}

static constexpr float kGeluScale = 0.7978845608028654f; // sqrt(2 / pi)

void geluForward(float *__restrict__ out, const float *__restrict__ in, size_t n) {
  for (size_t k = 0; k < n; ++k) {
    float x = in[k];
    out[k] = 0.5f * x * (1.0f + std::tanh(kGeluScale * (x + 0.044715f * x * x * x)));
  }
}

void geluBackward(float *__restrict__ dIn, const float *__restrict__ dOut,
                  const float *__restrict__ in, size_t n) {
  for (size_t k = 0; k < n; ++k) {
    float x = in[k];
    float u = kGeluScale * (x + 0.044715f * x * x * x);
    float th = std::tanh(u);
    float sech2 = 1.0f - th * th;
    float du = kGeluScale * (1.0f + 3.0f * 0.044715f * x * x);
    dIn[k] = (0.5f * (1.0f + th) + 0.5f * x * sech2 * du) * dOut[k];
  }
}

// Multi-head attention is grouped-query attention with one key/value head per query head
// (LlamaOps.h): one loop nest for both.
void attentionForward(float *out, float *probs, const float *q, const float *k, const float *v,
                      const AttentionShape &s) {
  groupedAttentionForward(
      out, probs, q, k, v,
      GroupedAttentionShape{s.batch, s.queries, s.begin, s.heads, s.heads, s.headDim});
}

void attentionBackward(float *dq, float *dk, float *dv, const float *dOut, const float *probs,
                       const float *q, const float *k, const float *v, const AttentionShape &s) {
  groupedAttentionBackward(
      dq, dk, dv, dOut, probs, q, k, v,
      GroupedAttentionShape{s.batch, s.queries, s.begin, s.heads, s.heads, s.headDim});
}

double crossEntropyForward(float *__restrict__ probs, const float *__restrict__ logits,
                           const int32_t *__restrict__ targets, int n, int v, float scale) {
  double loss = 0.0;
  for (int r = 0; r < n; ++r) {
    const float *l = logits + size_t(r) * v;
    float *p = probs + size_t(r) * v;
    float maxLogit = -INFINITY;
    for (int c = 0; c < v; ++c)
      maxLogit = std::fmax(maxLogit, l[c]);
    double sum = 0.0;
    for (int c = 0; c < v; ++c) {
      p[c] = std::exp(l[c] - maxLogit);
      sum += p[c];
    }
    const float inv = float(1.0 / sum);
    for (int c = 0; c < v; ++c)
      p[c] *= inv;
    int32_t target = targets[r];
    assert(target >= 0 && target < v && "target token out of the vocabulary");
    // -log softmax = logsumexp - logit, in double so tiny probabilities keep their digits.
    loss += (std::log(sum) + maxLogit - l[target]) * double(scale);
  }
  return loss;
}

void crossEntropyBackward(float *__restrict__ dLogits, const float *__restrict__ probs,
                          const int32_t *__restrict__ targets, int n, int v, float scale) {
  for (int r = 0; r < n; ++r) {
    for (int c = 0; c < v; ++c) {
      float onehot = c == targets[r] ? 1.0f : 0.0f;
      dLogits[size_t(r) * v + c] = (probs[size_t(r) * v + c] - onehot) * scale;
    }
  }
}

void crossEntropyShardStats(float *__restrict__ stats, const float *__restrict__ logits,
                            const int32_t *__restrict__ targets, int n, int v, int vocabBegin,
                            int part, int parts) {
  assert(0 <= part && part < parts && "shard out of range");
  std::fill(stats, stats + crossEntropyStatsFloats(n, parts), 0.0f);
  for (int r = 0; r < n; ++r) {
    const float *l = logits + size_t(r) * v;
    float maxLogit = -INFINITY;
    for (int c = 0; c < v; ++c)
      maxLogit = std::fmax(maxLogit, l[c]);
    double sum = 0.0;
    for (int c = 0; c < v; ++c)
      sum += std::exp(l[c] - maxLogit);
    stats[size_t(2 * part) * n + r] = maxLogit;
    stats[size_t(2 * part + 1) * n + r] = float(sum);
    const int32_t local = targets[r] - vocabBegin;
    if (local >= 0 && local < v)
      stats[size_t(2 * parts) * n + r] = l[local];
  }
}

double crossEntropyCombine(float *__restrict__ lse, const float *__restrict__ stats, int n,
                           int parts, float scale, float *__restrict__ rowLoss) {
  double loss = 0.0;
  for (int r = 0; r < n; ++r) {
    float top = -INFINITY;
    for (int p = 0; p < parts; ++p)
      top = std::fmax(top, stats[size_t(2 * p) * n + r]);
    double sum = 0.0;
    for (int p = 0; p < parts; ++p)
      sum += double(stats[size_t(2 * p + 1) * n + r]) *
             std::exp(double(stats[size_t(2 * p) * n + r]) - double(top));
    lse[r] = float(double(top) + std::log(sum));
    const double row = (std::log(sum) + top - stats[size_t(2 * parts) * n + r]) * double(scale);
    if (rowLoss)
      rowLoss[r] = float(row);
    loss += row;
  }
  return loss;
}

void crossEntropyShardBackward(float *dLogits, const float *logits, const float *__restrict__ lse,
                               const int32_t *__restrict__ targets, int n, int v, int vocabBegin,
                               float scale) {
  for (int r = 0; r < n; ++r) {
    const int32_t local = targets[r] - vocabBegin;
    for (int c = 0; c < v; ++c) {
      const size_t at = size_t(r) * v + c;
      const float p = std::exp(logits[at] - lse[r]);
      dLogits[at] = (p - (c == local ? 1.0f : 0.0f)) * scale;
    }
  }
}

void adamUpdate(float *__restrict__ params, const float *__restrict__ grads, float *__restrict__ m,
                float *__restrict__ v, size_t n, float lr, float beta1, float beta2, float eps,
                float weightDecay, int step) {
  assert(step >= 1 && "adam steps count from 1");
  const float mCorrection = 1.0f - std::pow(beta1, float(step));
  const float vCorrection = 1.0f - std::pow(beta2, float(step));
  for (size_t k = 0; k < n; ++k) {
    float g = grads[k];
    m[k] = beta1 * m[k] + (1.0f - beta1) * g;
    v[k] = beta2 * v[k] + (1.0f - beta2) * g * g;
    float mHat = m[k] / mCorrection;
    float vHat = v[k] / vCorrection;
    params[k] -= lr * (mHat / (std::sqrt(vHat) + eps) + weightDecay * params[k]);
  }
}

} // namespace pipec::kernels::ops
