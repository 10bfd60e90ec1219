//===- LlamaOps.h - fp32 primitives of Llama-style blocks -------*- C++ -*-===//
//
// The ops a Llama-style block adds to the CPU reference (issue 34: "norm": "rmsnorm",
// "mlp": "swiglu", "position": "rope", "num_query_groups"), in Ops.h's manner: plain loop nests,
// single-threaded, a fixed visiting order, rows are tokens. They are tested on their own
// against a double-precision model and finite differences (tests/LlamaOpsTest.cpp), and the
// cpu backend's stages call them for Llama-style blocks (kernels/cuda/Llama.cu holds the CUDA
// kernels of the same formulas). Grouped-query attention is also Ops.h's multi-head attention
// (one key/value head per query head).
//
// Conventions are Hugging Face's Llama, so that its checkpoints load without permutation:
// RMSNorm's eps inside the square root; SwiGLU is silu(gate) * up; rotary embeddings rotate
// the pairs (i, i + hd/2) of each head ("rotate_half"), by position * theta^(-2i/hd).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_KERNELS_CPU_LLAMAOPS_H
#define PIPEC_KERNELS_CPU_LLAMAOPS_H

#include <cstddef>
#include <cstdint>

namespace pipec::kernels::ops {

/// RMSNorm over the last axis: out = in * rstd * w, rstd = 1 / sqrt(mean(in^2) + eps), all
/// (n, c); the per-row rstd (n) is kept for the backwards.
void rmsnormForward(float *out, float *rstd, const float *in, const float *w, int n, int c,
                    float eps = 1e-5f);
/// dIn (n, c) += the gradient of in from dOut (n, c).
void rmsnormBackwardInputAccumulate(float *dIn, const float *dOut, const float *in,
                                    const float *rstd, const float *w, int n, int c);
/// dW (c) += sum over rows of dOut * in * rstd.
void rmsnormBackwardWeight(float *dW, const float *dOut, const float *in, const float *rstd, int n,
                           int c);

/// out = silu(gate) * up, silu(g) = g / (1 + exp(-g)), elementwise over n values.
void swigluForward(float *out, const float *gate, const float *up, size_t n);
/// dGate = dOut * up * silu'(gate), dUp = dOut * silu(gate).
void swigluBackward(float *dGate, float *dUp, const float *dOut, const float *gate, const float *up,
                    size_t n);

/// Rotary embeddings in place: x (rows, heads * headDim), row r at position positions[r]; for
/// i < headDim / 2 the pair (x[i], x[i + headDim/2]) of each head turns by the angle
/// positions[r] * theta^(-2i / headDim).
void ropeForward(float *x, const int32_t *positions, int rows, int heads, int headDim,
                 double theta);
/// The gradient through ropeForward, in place: the same rotation backwards (its transpose).
void ropeBackward(float *dx, const int32_t *positions, int rows, int heads, int headDim,
                  double theta);

/// Causal grouped-query attention (Ops.h's AttentionShape, with K/V of fewer heads): query
/// head h reads key/value head h / (heads / kvHeads). q, out (B, x, heads*hd); k, v
/// (a + x, B, kvHeads*hd), position-major as in Ops.h; probs (B, heads, x, a + x).
struct GroupedAttentionShape {
  int batch;   // B
  int queries; // x: tokens of the slice
  int begin;   // a: position of the slice's first token
  int heads;   // query heads held by this rank
  int kvHeads; // key/value heads held by this rank; divides heads
  int headDim; // hd
  int keys() const { return begin + queries; }
};
void groupedAttentionForward(float *out, float *probs, const float *q, const float *k,
                             const float *v, const GroupedAttentionShape &s);
/// dq (B, x, heads*hd) = the gradient of q; dk, dv (a + x, B, kvHeads*hd) += those of the keys
/// and values, summed over the query heads of each group.
void groupedAttentionBackward(float *dq, float *dk, float *dv, const float *dOut,
                              const float *probs, const float *q, const float *k, const float *v,
                              const GroupedAttentionShape &s);

} // namespace pipec::kernels::ops

#endif // PIPEC_KERNELS_CPU_LLAMAOPS_H
