//===- Ops.h - fp32 primitive ops of the CPU reference GPT -------*- C++ -*-===//
//
// The handful of primitives the CPU GPT (Gpt.cpp) is built from, each a plain loop nest in the
// manner of llm.c's train_gpt2.c. Backward passes are split the way the pipeline splits them:
// an op's input gradient (backward_input) and its weight gradient (backward_weight) are
// separate functions, so that a stage can run them at different times. Weight gradients
// accumulate (+=); input gradients overwrite unless the name says "Accumulate".
//
// Rows are tokens: `n` is batch * tokens of a slice, and activations are (n, width), row-major.
// All ops are single-threaded and visit elements in a fixed order, so the same inputs give
// bit-identical outputs.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_KERNELS_CPU_OPS_H
#define PIPEC_KERNELS_CPU_OPS_H

#include <cstddef>
#include <cstdint>

namespace pipec::kernels::ops {

/// out (n, o) = in (n, i) @ w (i, o) + bias (o); `bias` may be null.
void matmulForward(float *out, const float *in, const float *w, const float *bias, int n, int i,
                   int o);
/// dIn (n, i) = dOut (n, o) @ w^T.
void matmulBackwardInput(float *dIn, const float *dOut, const float *w, int n, int i, int o);
/// dW (i, o) += in^T @ dOut; dBias (o) += sum over rows of dOut (`dBias` may be null).
void matmulBackwardWeight(float *dW, float *dBias, const float *in, const float *dOut, int n, int i,
                          int o);

/// The same three for a weight stored transposed, w (o, i) — the LM head's [vocab, C] matrix:
/// out (n, o) = in (n, i) @ w^T.
void matmulTForward(float *out, const float *in, const float *w, int n, int i, int o);
/// dIn (n, i) = dOut (n, o) @ w.
void matmulTBackwardInput(float *dIn, const float *dOut, const float *w, int n, int i, int o);
/// dW (o, i) += dOut^T @ in.
void matmulTBackwardWeight(float *dW, const float *in, const float *dOut, int n, int i, int o);

/// Layernorm over the last axis (eps 1e-5 unless given): out = (in - mean) * rstd * w + b, all (n,
/// c); the per-row mean and rstd (n) are kept for the backwards. b may be null (no shift).
void layernormForward(float *out, float *mean, float *rstd, const float *in, const float *w,
                      const float *b, int n, int c, float eps = 1e-5f);
/// dIn (n, c) += the gradient of in from dOut (n, c).
void layernormBackwardInputAccumulate(float *dIn, const float *dOut, const float *in,
                                      const float *mean, const float *rstd, const float *w, int n,
                                      int c);
/// dW (c) += sum dOut * xhat; dB (c) += sum dOut (dB may be null: no shift).
void layernormBackwardWeight(float *dW, float *dB, const float *dOut, const float *in,
                             const float *mean, const float *rstd, int n, int c);

/// GELU, tanh approximation (GPT-2): out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
void geluForward(float *out, const float *in, size_t n);
/// dIn = gelu'(in) * dOut.
void geluBackward(float *dIn, const float *dOut, const float *in, size_t n);

/// Causal attention of the queries of one sub-sequence [begin, begin + queries) against the keys
/// and values of tokens [0, begin + queries) — its own and those of earlier sub-sequences. Keys
/// and values are position-major, (a + x, B, H*hd), so that a microbatch's K/V grow by appending
/// each slice as it runs forward.
struct AttentionShape {
  int batch;   // B
  int queries; // x: tokens of the slice
  int begin;   // a: position of the slice's first token
  int heads;   // heads held by this rank
  int headDim; // hd; a row of q, k, v is heads * headDim wide
  int keys() const { return begin + queries; }
  int width() const { return heads * headDim; }
};
/// out (B, x, H*hd) = softmax(q k^T / sqrt(hd), causal) v; probs (B, H, x, a+x) keeps the
/// attention weights (zero above the diagonal). q (B, x, H*hd); k, v (a + x, B, H*hd).
void attentionForward(float *out, float *probs, const float *q, const float *k, const float *v,
                      const AttentionShape &s);
/// dq (B, x, H*hd) = the gradient of q; dk, dv (a + x, B, H*hd) += those of keys and values.
void attentionBackward(float *dq, float *dk, float *dv, const float *dOut, const float *probs,
                       const float *q, const float *k, const float *v, const AttentionShape &s);

/// probs (n, v) = softmax(logits); returns scale * sum over rows of -log probs[target], in
/// double.
double crossEntropyForward(float *probs, const float *logits, const int32_t *targets, int n, int v,
                           float scale);
/// dLogits (n, v) = (probs - onehot(target)) * scale.
void crossEntropyBackward(float *dLogits, const float *probs, const int32_t *targets, int n, int v,
                          float scale);

// Vocab-parallel cross entropy (Megatron-LM's): each of `parts` tp ranks holds the logits of
// the vocabulary columns [vocabBegin, vocabBegin + v) and the runtime sums one small buffer
// over the tp group between the two forward calls.

/// Floats of the statistics buffer of n rows over `parts` vocabulary shards.
inline size_t crossEntropyStatsFloats(int n, int parts) { return size_t(n) * (2 * parts + 1); }
/// stats (2 parts + 1, n): row r's max logit at [2 part][r], sum of exp(logit - max) at
/// [2 part + 1][r] and its target's logit at [2 parts][r] when the target is in this shard;
/// every other entry 0, so that the sum over the shards holds each shard's values.
void crossEntropyShardStats(float *stats, const float *logits, const int32_t *targets, int n, int v,
                            int vocabBegin, int part, int parts);
/// From the summed stats: lse (n) = log-sum-exp over the whole vocabulary; returns scale * the
/// sum over rows of lse - logit[target], in double, and writes each row's term to rowLoss (n)
/// unless it is null.
double crossEntropyCombine(float *lse, const float *stats, int n, int parts, float scale,
                           float *rowLoss = nullptr);
/// dLogits (n, v) = (exp(logits - lse) - onehot(target - vocabBegin)) * scale: the shard's
/// columns of the gradient. dLogits may be logits itself.
void crossEntropyShardBackward(float *dLogits, const float *logits, const float *lse,
                               const int32_t *targets, int n, int v, int vocabBegin, float scale);

/// One AdamW step (bias-corrected, `step` counts from 1, decoupled weight decay as llm.c):
/// m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; p -= lr (m^ / (sqrt(v^) + eps) + wd p).
void adamUpdate(float *params, const float *grads, float *m, float *v, size_t n, float lr,
                float beta1, float beta2, float eps, float weightDecay, int step);

} // namespace pipec::kernels::ops

#endif // PIPEC_KERNELS_CPU_OPS_H
