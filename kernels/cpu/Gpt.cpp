//===- Gpt.cpp - CPU reference math of a small GPT, per pipeline stage ------===//
//
// The layers' layout, initialisation and sharding, and the host as the device of the stage
// (kernels/StageProgram.h, the one definition the cuda backend runs too). The stage walks its
// layers as a list of "parts" (one per tensor-parallel reduction point) and keeps, per
// (microbatch, slice), the residual stream and what the backwards need. A part that returns a
// buffer for the tp all-reduce is completed lazily: the residual add (forward) or the norm
// backward plus residual add (backward) that consumes the reduced buffer runs at the start of
// the next part, or in output() / inputGrad() / backwardWeight() after the last.
//
// Flat parameter layout of one layer on tp rank r of tp (floats, row-major, concatenated in
// this order; `layerRange()` gives where a layer starts within the stage's params()):
//   embedding: wte [V/tp, C]   the vocabulary rows [r V/tp, (r+1) V/tp), wpe [T, C]
//   block:     ln1.w [C], ln1.b [C],
//              qkv.w [C, 3C/tp]   columns: q of local heads | k of local heads | v of local heads
//              qkv.b [3C/tp]      (same column order),
//              attn.w [C/tp, C]   the rows of the local heads, attn.b [C] (replicated),
//              ln2.w [C], ln2.b [C],
//              fc.w [C, F/tp]     columns [r F/tp, (r+1) F/tp), fc.b [F/tp],
//              proj.w [F/tp, C]   the matching rows, proj.b [C] (replicated)
//   head:      lnf.w [C], lnf.b [C], lm.w [V/tp, C] (the same rows; logits = h lm.w^T; the
//              head's own copy of wte when embeddings are tied)
// Llama-style variants (GptConfig) change that as Gpt.h says: grouped-query attention narrows
// qkv's k and v blocks to the key/value heads (rank r holding heads [r KV/tp, (r+1) KV/tp));
// SwiGLU doubles fc into gate | up blocks, each split like fc; rope drops wpe; RMSNorm and
// "no biases" drop the tensors they do not have. Rotary embeddings turn q and k after qkv, so
// the K kept for later slices is rotated; the backward turns dq and the slice's complete dK
// back before they become qkv's output gradient.
// Linear weights are [in, out] (y = x W + b). The full (tp = 1) qkv.w is [C, 3C] with columns
// q | k | v, head h owning columns [h hd, (h+1) hd) of each third. Row-parallel biases are
// replicated and added once, after the reduction, so every tp rank holds the same value and
// computes the same gradient (from the replicated output gradient): shards of gradients equal
// shardLayer() of the tp = 1 gradients.
//
//===----------------------------------------------------------------------===//
#include "kernels/cpu/Gpt.h"

#include "kernels/StageProgram.h"

#include "kernels/cpu/LlamaOps.h"
#include "kernels/cpu/Ops.h"

#include "llvm/Support/ErrorHandling.h"

#include <algorithm>
#include <array>
#include <cassert>
#include <cmath>
#include <numbers>
#include <string>

namespace pipec::kernels {

namespace {

enum class Shard { Replicated, Columns, Rows };
enum class Init { Zeros, Ones, Normal };

/// One parameter tensor of a layer, at its full (tp = 1) shape. A Columns tensor is cut into
/// column blocks of widths `groups` (q, k, v; gate, up) and rank r takes the r-th tp-th of
/// each block. `role` names the tensor for the code (the enums below) whatever the variant
/// leaves out, and seeds its initialisation stream.
struct TensorSpec {
  int rows;
  int cols;
  Shard shard;
  std::vector<int> groups;
  Init init;
  const char *name;
  int role;
};

using namespace tensors;
constexpr int kMostTensors = kMostRoles;

/// The layer's tensors in their flat order. GPT-2's are all there and a role equals its index;
/// a Llama-style variant leaves some out (Gpt.h) and keeps the others' order.
std::vector<TensorSpec> layerTensors(const GptConfig &cfg, int layer) {
  const int c = cfg.channels, v = cfg.vocab, f = cfg.ffn;
  const int kv = cfg.kvHeadCount() * (c / cfg.heads); // width of K (and of V)
  const bool normShift = !cfg.rmsnorm && cfg.bias;
  std::vector<TensorSpec> out;
  switch (layerKind(cfg, layer)) {
  case GptLayerKind::Embedding:
    out.push_back({v, c, Shard::Rows, {}, Init::Normal, "wte", Wte});
    if (!cfg.rope)
      out.push_back({cfg.seqLen, c, Shard::Replicated, {}, Init::Normal, "wpe", Wpe});
    return out;
  case GptLayerKind::Block: {
    const std::vector<int> qkv{c, kv, kv};
    const std::vector<int> fc = cfg.swiglu ? std::vector<int>{f, f} : std::vector<int>{f};
    const int fcCols = cfg.swiglu ? 2 * f : f;
    out.push_back({1, c, Shard::Replicated, {}, Init::Ones, "ln1.w", Ln1W});
    if (normShift)
      out.push_back({1, c, Shard::Replicated, {}, Init::Zeros, "ln1.b", Ln1B});
    out.push_back({c, c + 2 * kv, Shard::Columns, qkv, Init::Normal, "qkv.w", QkvW});
    if (cfg.bias)
      out.push_back({1, c + 2 * kv, Shard::Columns, qkv, Init::Zeros, "qkv.b", QkvB});
    out.push_back({c, c, Shard::Rows, {}, Init::Normal, "attn.w", AttnW});
    if (cfg.bias)
      out.push_back({1, c, Shard::Replicated, {}, Init::Zeros, "attn.b", AttnB});
    out.push_back({1, c, Shard::Replicated, {}, Init::Ones, "ln2.w", Ln2W});
    if (normShift)
      out.push_back({1, c, Shard::Replicated, {}, Init::Zeros, "ln2.b", Ln2B});
    out.push_back({c, fcCols, Shard::Columns, fc, Init::Normal, "fc.w", FcW});
    if (cfg.bias)
      out.push_back({1, fcCols, Shard::Columns, fc, Init::Zeros, "fc.b", FcB});
    out.push_back({f, c, Shard::Rows, {}, Init::Normal, "proj.w", ProjW});
    if (cfg.bias)
      out.push_back({1, c, Shard::Replicated, {}, Init::Zeros, "proj.b", ProjB});
    return out;
  }
  case GptLayerKind::Head:
    out.push_back({1, c, Shard::Replicated, {}, Init::Ones, "lnf.w", LnfW});
    if (normShift)
      out.push_back({1, c, Shard::Replicated, {}, Init::Zeros, "lnf.b", LnfB});
    out.push_back({v, c, Shard::Rows, {}, Init::Normal, "lm.w", LmW});
    return out;
  }
  llvm_unreachable("unknown layer kind");
  return {};
}


size_t localSize(const TensorSpec &t, int tp) {
  switch (t.shard) {
  case Shard::Replicated:
    return size_t(t.rows) * t.cols;
  case Shard::Columns:
    return size_t(t.rows) * (t.cols / tp);
  case Shard::Rows:
    return size_t(t.rows / tp) * t.cols;
  }
  llvm_unreachable("unknown shard kind");
  return 0;
}

/// Offsets of a layer's tensors within its flat block on one tp rank, plus the total at the end.
std::vector<size_t> tensorOffsets(const GptConfig &cfg, int layer, int tp) {
  std::vector<size_t> offsets{0};
  for (const TensorSpec &t : layerTensors(cfg, layer))
    offsets.push_back(offsets.back() + localSize(t, tp));
  return offsets;
}

} // namespace

std::array<size_t, kMostTensors> paramRoleOffsets(const GptConfig &cfg, int layer, int tp) {
  std::array<size_t, kMostTensors> out;
  out.fill(kAbsent);
  size_t at = 0;
  for (const TensorSpec &t : layerTensors(cfg, layer)) {
    out[size_t(t.role)] = at;
    at += localSize(t, tp);
  }
  return out;
}

namespace {

uint64_t splitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/// A standard normal that depends only on (seed, layer, tensor, index): Box-Muller on two
/// uniforms hashed from the counter.
float counterNormal(uint64_t seed, int layer, int tensor, size_t index) {
  uint64_t h = splitMix64(seed);
  h = splitMix64(h ^ uint64_t(layer));
  h = splitMix64(h ^ uint64_t(tensor));
  h = splitMix64(h ^ uint64_t(index));
  const double u1 = double((h >> 11) + 1) * 0x1.0p-53; // (0, 1]
  const double u2 = double(splitMix64(h) >> 11) * 0x1.0p-53;
  return float(std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2));
}

void checkConfig(const GptConfig &cfg, int tp) {
  assert(tp >= 1 && "tp must be positive");
  assert(cfg.channels % cfg.heads == 0 && "channels must be divisible by heads");
  assert(cfg.heads % tp == 0 && "heads must be divisible by tp");
  assert(cfg.kvHeadCount() >= 1 && cfg.heads % cfg.kvHeadCount() == 0 &&
         "key/value heads must divide heads");
  assert(cfg.kvHeadCount() % tp == 0 && "key/value heads must be divisible by tp");
  assert((!cfg.rope || (cfg.channels / cfg.heads) % 2 == 0) && "rope needs an even head size");
  assert(cfg.ffn % tp == 0 && "ffn must be divisible by tp");
  assert(cfg.vocab % tp == 0 && "vocab must be divisible by tp");
  (void)cfg;
  (void)tp;
}

size_t floatBytes(const std::vector<float> &v) { return v.size() * sizeof(float); }

} // namespace

GptLayerKind layerKind(const GptConfig &cfg, int layer) {
  assert(layer >= 0 && layer < cfg.numLayers() && "layer out of range");
  if (layer == 0)
    return GptLayerKind::Embedding;
  if (layer == cfg.layers + 1)
    return GptLayerKind::Head;
  return GptLayerKind::Block;
}

int layerParts(const GptConfig &cfg, int layer) {
  return layerKind(cfg, layer) == GptLayerKind::Block ? 2 : 1;
}

size_t layerParamCount(const GptConfig &cfg, int layer, int tp) {
  checkConfig(cfg, tp);
  return tensorOffsets(cfg, layer, tp).back();
}

std::vector<float> initLayerFull(const GptConfig &cfg, int layer, uint64_t seed) {
  std::vector<TensorSpec> tensors = layerTensors(cfg, layer);
  std::vector<float> out;
  out.reserve(layerParamCount(cfg, layer, 1));
  const bool tiedHead = cfg.tiedEmbeddings && layerKind(cfg, layer) == GptLayerKind::Head;
  for (size_t t = 0; t < tensors.size(); ++t) {
    size_t n = size_t(tensors[t].rows) * tensors[t].cols;
    // The tied head matrix draws the embedding's wte stream, so the two start equal.
    const int role = tensors[t].role;
    int streamLayer = tiedHead && role == LmW ? 0 : layer;
    int streamTensor = tiedHead && role == LmW ? int(Wte) : role;
    for (size_t k = 0; k < n; ++k) {
      switch (tensors[t].init) {
      case Init::Zeros:
        out.push_back(0.0f);
        break;
      case Init::Ones:
        out.push_back(1.0f);
        break;
      case Init::Normal:
        out.push_back(0.02f * counterNormal(seed, streamLayer, streamTensor, k));
        break;
      }
    }
  }
  return out;
}

namespace {
/// Calls `piece(fullOffset, count)` for each run of a full layer tensor that tp rank `tpRank`
/// holds, in the order the rank stores them (so the shard is their concatenation).
template <typename Piece>
void forEachShardPiece(const GptConfig &cfg, int layer, int tpRank, int tp, Piece &&piece) {
  size_t offset = 0;
  for (const TensorSpec &t : layerTensors(cfg, layer)) {
    switch (t.shard) {
    case Shard::Replicated:
      piece(offset, size_t(t.rows) * t.cols);
      break;
    case Shard::Columns: {
      // Each of the column blocks (q, k, v; gate, up) is split into tp equal pieces.
      const std::vector<int> groups = t.groups.empty() ? std::vector<int>{t.cols} : t.groups;
      for (int r = 0; r < t.rows; ++r) {
        int groupBegin = 0;
        for (int width : groups) {
          const int localCols = width / tp;
          piece(offset + size_t(r) * t.cols + groupBegin + tpRank * localCols, size_t(localCols));
          groupBegin += width;
        }
      }
      break;
    }
    case Shard::Rows: {
      const size_t localRows = t.rows / tp;
      piece(offset + tpRank * localRows * t.cols, localRows * t.cols);
      break;
    }
    }
    offset += size_t(t.rows) * t.cols;
  }
}
} // namespace

std::vector<float> shardLayer(const GptConfig &cfg, int layer, int tpRank, int tp,
                              std::span<const float> full) {
  assert(full.size() == layerParamCount(cfg, layer, 1) && "not a full layer tensor");
  assert(tpRank >= 0 && tpRank < tp && "tp rank out of range");
  std::vector<float> out;
  out.reserve(layerParamCount(cfg, layer, tp));
  forEachShardPiece(cfg, layer, tpRank, tp, [&](size_t at, size_t n) {
    out.insert(out.end(), full.data() + at, full.data() + at + n);
  });
  return out;
}

void unshardLayer(const GptConfig &cfg, int layer, int tpRank, int tp, std::span<const float> shard,
                  std::span<float> full) {
  assert(full.size() == layerParamCount(cfg, layer, 1) && "not a full layer tensor");
  assert(shard.size() == layerParamCount(cfg, layer, tp) && "not a shard of the layer");
  assert(tpRank >= 0 && tpRank < tp && "tp rank out of range");
  const float *src = shard.data();
  forEachShardPiece(cfg, layer, tpRank, tp, [&](size_t at, size_t n) {
    std::copy_n(src, n, full.data() + at);
    src += n;
  });
}

std::vector<size_t> paramTensorOffsets(const GptConfig &cfg, int layer, int tp) {
  return tensorOffsets(cfg, layer, tp);
}

std::vector<bool> paramTensorsReplicated(const GptConfig &cfg, int layer) {
  std::vector<bool> out;
  for (const TensorSpec &t : layerTensors(cfg, layer))
    out.push_back(t.shard == Shard::Replicated);
  return out;
}

std::string paramName(const GptConfig &cfg, int layer, int tp, size_t index) {
  size_t begin = 0;
  for (const TensorSpec &t : layerTensors(cfg, layer)) {
    const size_t n = localSize(t, tp);
    if (index < begin + n) {
      const size_t rows = size_t(t.shard == Shard::Rows ? t.rows / tp : t.rows);
      const size_t at = index - begin, cols = n / rows;
      if (rows == 1)
        return std::string(t.name) + "[" + std::to_string(at) + "]";
      return std::string(t.name) + "[" + std::to_string(at / cols) + ", " +
             std::to_string(at % cols) + "]";
    }
    begin += n;
  }
  return "element " + std::to_string(index) + " past the layer's " + std::to_string(begin) +
         " parameters";
}
namespace {

/// The host as StageProgram's device: std::vector buffers, kernels/cpu/Ops.h and LlamaOps.h
/// loops, the parameters and the batch in host memory. Nothing fails.
struct CpuDev {
  using Act = std::vector<float>;
  using F32 = std::vector<float>;
  using Ptr = float *;
  using CPtr = const float *;
  using Out = std::span<float>;
  using In = std::span<const float>;
  /// The head's loss state: softmax probabilities (N, V) at tp = 1; at tp > 1 the rank's logits
  /// stay in the head's work and this keeps the whole vocabulary's log-sum-exp (N).
  struct Loss {
    std::vector<float> probs, lse;
    double loss = 0.0;
    template <typename F> void forEach(F f) { f(probs), f(lse); }
  };

  GptConfig cfg;
  std::vector<std::pair<int, int>> slices;
  std::vector<float> params, grads, adamM, adamV;
  int adamSteps = 0;
  std::vector<std::vector<int32_t>> batch;

  static llvm::Error ok() { return llvm::Error::success(); }
  static float *ptr(std::vector<float> &v) { return v.data(); }
  static size_t size(const std::vector<float> &v) { return v.size(); }
  static float *at(std::vector<float> &v, size_t offset) { return v.data() + offset; }
  llvm::Error alloc(std::vector<float> &v, size_t n) {
    v.assign(n, 0.0f);
    return ok();
  }
  llvm::Error allocZero(std::vector<float> &v, size_t n) { return alloc(v, n); }
  void release(std::vector<float> &v) { std::vector<float>().swap(v); }
  llvm::Error copy(std::vector<float> &dst, const std::vector<float> &src) {
    dst = src;
    return ok();
  }
  llvm::Error input(std::vector<float> &dst, std::span<const float> in, size_t n) {
    assert(in.size() == n && "a stage input or output gradient has the wrong size");
    dst.assign(in.begin(), in.end());
    return ok();
  }
  Out out(std::vector<float> &v) { return v; }
  CPtr param(size_t at) { return params.data() + at; }
  float *grad(size_t at) { return grads.data() + at; }

  /// Token ids of a slice's rows (b, t): inputs, or with `next` the targets. Read from the
  /// step's batch when an op needs them (setBatch is called between steps, not within one).
  std::vector<int32_t> tokens(int mb, int slice, bool next) const {
    assert(mb >= 0 && mb < int(batch.size()) && "setBatch() has no such microbatch");
    const std::vector<int32_t> &all = batch[size_t(mb)];
    assert(all.size() == size_t(cfg.microbatch) * size_t(cfg.seqLen + 1) &&
           "batch has the wrong size");
    const auto [begin, end] = slices[size_t(slice)];
    std::vector<int32_t> out;
    for (int s = 0; s < cfg.microbatch; ++s)
      for (int t = begin; t < end; ++t)
        out.push_back(all[size_t(s) * size_t(cfg.seqLen + 1) + size_t(t + (next ? 1 : 0))]);
    return out;
  }

  llvm::Error layernormForward(Ptr out, float *mean, float *rstd, CPtr in, CPtr w, CPtr b, int n,
                               int c, float eps) {
    ops::layernormForward(out, mean, rstd, in, w, b, n, c, eps);
    return ok();
  }
  llvm::Error layernormBackwardInputAccumulate(Ptr dIn, CPtr dOut, CPtr in, const float *mean,
                                               const float *rstd, CPtr w, int n, int c) {
    ops::layernormBackwardInputAccumulate(dIn, dOut, in, mean, rstd, w, n, c);
    return ok();
  }
  llvm::Error layernormBackwardWeight(float *dW, float *dB, CPtr dOut, CPtr in, const float *mean,
                                      const float *rstd, int n, int c) {
    ops::layernormBackwardWeight(dW, dB, dOut, in, mean, rstd, n, c);
    return ok();
  }
  llvm::Error rmsnormForward(Ptr out, float *rstd, CPtr in, CPtr w, int n, int c, float eps) {
    ops::rmsnormForward(out, rstd, in, w, n, c, eps);
    return ok();
  }
  llvm::Error rmsnormBackwardInputAccumulate(Ptr dIn, CPtr dOut, CPtr in, const float *rstd,
                                             CPtr w, int n, int c) {
    ops::rmsnormBackwardInputAccumulate(dIn, dOut, in, rstd, w, n, c);
    return ok();
  }
  llvm::Error rmsnormBackwardWeight(float *dW, CPtr dOut, CPtr in, const float *rstd, int n,
                                    int c) {
    ops::rmsnormBackwardWeight(dW, dOut, in, rstd, n, c);
    return ok();
  }
  llvm::Error matmulForward(Ptr out, CPtr in, CPtr w, CPtr bias, int n, int i, int o) {
    ops::matmulForward(out, in, w, bias, n, i, o);
    return ok();
  }
  llvm::Error matmulBackwardInput(Ptr dIn, CPtr dOut, CPtr w, int n, int i, int o) {
    ops::matmulBackwardInput(dIn, dOut, w, n, i, o);
    return ok();
  }
  llvm::Error matmulBackwardWeight(float *dW, float *dB, CPtr in, CPtr dOut, int n, int i, int o) {
    ops::matmulBackwardWeight(dW, dB, in, dOut, n, i, o);
    return ok();
  }
  llvm::Error matmulTForward(Ptr out, CPtr in, CPtr w, int n, int i, int o) {
    ops::matmulTForward(out, in, w, n, i, o);
    return ok();
  }
  llvm::Error matmulTBackwardInput(Ptr dIn, CPtr dOut, CPtr w, int n, int i, int o) {
    ops::matmulTBackwardInput(dIn, dOut, w, n, i, o);
    return ok();
  }
  llvm::Error matmulTBackwardWeight(float *dW, CPtr in, CPtr dOut, int n, int i, int o) {
    ops::matmulTBackwardWeight(dW, in, dOut, n, i, o);
    return ok();
  }
  llvm::Error geluForward(Ptr out, CPtr in, size_t n) {
    ops::geluForward(out, in, n);
    return ok();
  }
  llvm::Error geluBackward(Ptr dIn, CPtr dOut, CPtr in, size_t n) {
    ops::geluBackward(dIn, dOut, in, n);
    return ok();
  }
  // SwiGLU on the fc output's rows, each gate | up.
  llvm::Error swigluForward(Ptr out, CPtr pre, int n, int f) {
    for (int r = 0; r < n; ++r) {
      const float *row = pre + size_t(r) * 2 * size_t(f);
      ops::swigluForward(out + size_t(r) * size_t(f), row, row + f, size_t(f));
    }
    return ok();
  }
  llvm::Error swigluBackward(Ptr dPre, CPtr dOut, CPtr pre, int n, int f) {
    for (int r = 0; r < n; ++r) {
      const float *row = pre + size_t(r) * 2 * size_t(f);
      float *d = dPre + size_t(r) * 2 * size_t(f);
      ops::swigluBackward(d, d + f, dOut + size_t(r) * size_t(f), row, row + f, size_t(f));
    }
    return ok();
  }
  /// Positions of a slice's `rows` rows: (b, t) order, or the K/V rows' (t, b) order.
  std::vector<int32_t> positions(RopeRows which, int slice, int rows) const {
    const auto [begin, end] = slices[size_t(slice)];
    const int x = end - begin;
    std::vector<int32_t> out(static_cast<size_t>(rows));
    for (int r = 0; r < rows; ++r)
      out[size_t(r)] = which == RopeRows::Queries ? begin + r % x : begin + r / cfg.microbatch;
    return out;
  }
  llvm::Error rope(Ptr x, RopeRows which, int slice, int rows, int heads, int headDim,
                   double theta, bool backward) {
    const std::vector<int32_t> pos = positions(which, slice, rows);
    if (backward)
      ops::ropeBackward(x, pos.data(), rows, heads, headDim, theta);
    else
      ops::ropeForward(x, pos.data(), rows, heads, headDim, theta);
    return ok();
  }
  /// The backward rotation of a slice's K/V gradient rows (fp32).
  llvm::Error ropeF32(float *x, int slice, int rows, int heads, int headDim, double theta) {
    return rope(x, RopeRows::Keys, slice, rows, heads, headDim, theta, /*backward=*/true);
  }
  /// The host grows K/V slice by slice (reserveKv), not at slice 0.
  llvm::Error reserveSequenceKv(std::vector<float> &, std::vector<float> &, int, int) { return ok(); }
  /// The K/V rows [0, end) of the microbatch: grown slice by slice.
  llvm::Error reserveKv(std::vector<float> &k, std::vector<float> &v, int begin, int end, int b,
                        int width) {
    assert(k.size() == size_t(begin) * size_t(b) * size_t(width) &&
           "K/V do not end where the slice begins");
    (void)begin;
    k.resize(size_t(end) * size_t(b) * size_t(width));
    v.resize(k.size());
    return ok();
  }
  // Row r = (b, t) of the slice is K/V row (begin + t) * B + b.
  llvm::Error splitQkv(Ptr q, Ptr k, Ptr v, CPtr qkv, int n, int x, int b, int begin, int cl,
                       int kvl) {
    const size_t cols = size_t(cl) + 2 * size_t(kvl);
    for (int r = 0; r < n; ++r) {
      const float *row = qkv + size_t(r) * cols;
      const size_t kv = (size_t(begin + r % x) * size_t(b) + size_t(r / x)) * size_t(kvl);
      std::copy_n(row, cl, q + size_t(r) * size_t(cl));
      std::copy_n(row + cl, kvl, k + kv);
      std::copy_n(row + cl + kvl, kvl, v + kv);
    }
    return ok();
  }
  llvm::Error gatherQkv(Ptr dQkv, CPtr dq, const float *dk, const float *dv, int n, int x, int b,
                        int begin, int cl, int kvl) {
    const size_t cols = size_t(cl) + 2 * size_t(kvl);
    for (int r = 0; r < n; ++r) {
      float *row = dQkv + size_t(r) * cols;
      const size_t kv = (size_t(begin + r % x) * size_t(b) + size_t(r / x)) * size_t(kvl);
      std::copy_n(dq + size_t(r) * size_t(cl), cl, row);
      std::copy_n(dk + kv, kvl, row + cl);
      std::copy_n(dv + kv, kvl, row + cl + kvl);
    }
    return ok();
  }
  /// The materialized attention keeps the probabilities (B, H, x, a + x).
  static size_t attentionSavedFloats(const StageAttentionShape &s) {
    return size_t(s.batch) * size_t(s.heads) * size_t(s.queries) * size_t(s.begin + s.queries);
  }
  static ops::GroupedAttentionShape cpuShape(const StageAttentionShape &s) {
    return {s.batch, s.queries, s.begin, s.heads, s.kvHeads, s.headDim};
  }
  llvm::Error attentionForward(Ptr out, float *probs, CPtr q, CPtr k, CPtr v,
                               const StageAttentionShape &s) {
    ops::groupedAttentionForward(out, probs, q, k, v, cpuShape(s));
    return ok();
  }
  llvm::Error attentionBackward(Ptr dq, float *dk, float *dv, CPtr dOut, CPtr /*out*/,
                                const float *probs, CPtr q, CPtr k, CPtr v,
                                const StageAttentionShape &s) {
    ops::groupedAttentionBackward(dq, dk, dv, dOut, probs, q, k, v, cpuShape(s));
    return ok();
  }
  llvm::Error residualAdd(Ptr resid, CPtr branch, CPtr bias, int n, int c) {
    const size_t count = size_t(n) * size_t(c);
    if (bias)
      for (size_t k = 0; k < count; ++k)
        resid[k] += branch[k] + bias[k % size_t(c)];
    else
      for (size_t k = 0; k < count; ++k)
        resid[k] += branch[k];
    return ok();
  }
  // resid (B, x, C) = wte[token] (the rank's vocabulary rows) + wpe[position] (when given).
  llvm::Error embeddingForward(Ptr resid, int mb, int slice, CPtr wte, CPtr wpe, int n, int x,
                               int begin, int c, int vocabBegin, int localV) {
    const std::vector<int32_t> in = tokens(mb, slice, false);
    for (int r = 0; r < n; ++r) {
      const int pos = begin + r % x, token = in[size_t(r)], local = token - vocabBegin;
      assert(token >= 0 && token < cfg.vocab && "input token out of the vocabulary");
      float *out = resid + size_t(r) * size_t(c);
      if (local >= 0 && local < localV)
        for (int k = 0; k < c; ++k)
          out[k] = wte[size_t(local) * size_t(c) + size_t(k)];
      if (wpe)
        for (int k = 0; k < c; ++k)
          out[k] += wpe[size_t(pos) * size_t(c) + size_t(k)];
    }
    return ok();
  }
  llvm::Error embeddingBackward(float *dWte, float *dWpe, CPtr dEmb, int mb, int slice, int n,
                                int x, int begin, int c, int vocabBegin, int localV) {
    const std::vector<int32_t> in = tokens(mb, slice, false);
    for (int r = 0; r < n; ++r) {
      const float *g = dEmb + size_t(r) * size_t(c);
      const int local = in[size_t(r)] - vocabBegin; // rows of other ranks' tokens: theirs
      if (local >= 0 && local < localV)
        for (int k = 0; k < c; ++k)
          dWte[size_t(local) * size_t(c) + size_t(k)] += g[k];
      if (dWpe)
        for (int k = 0; k < c; ++k)
          dWpe[size_t(begin + r % x) * size_t(c) + size_t(k)] += g[k];
    }
    return ok();
  }
  llvm::Error lossForward(Loss &l, Act &logits, int mb, int slice, int n, int v, float scale) {
    const std::vector<int32_t> tgt = tokens(mb, slice, true);
    l.probs.resize(logits.size());
    l.loss = ops::crossEntropyForward(l.probs.data(), logits.data(), tgt.data(), n, v, scale);
    release(logits);
    return ok();
  }
  llvm::Error lossShardStats(Loss &, Act &logits, F32 &stats, int mb, int slice, int n,
                             int localV, int vocabBegin, int tpRank, int tp) {
    const std::vector<int32_t> tgt = tokens(mb, slice, true);
    stats.resize(ops::crossEntropyStatsFloats(n, tp));
    ops::crossEntropyShardStats(stats.data(), logits.data(), tgt.data(), n, localV, vocabBegin,
                                tpRank, tp);
    return ok();
  }
  llvm::Error lossCombine(Loss &l, F32 &stats, int n, int tp, float scale) {
    l.lse.resize(size_t(n));
    l.loss = ops::crossEntropyCombine(l.lse.data(), stats.data(), n, tp, scale);
    return ok();
  }
  llvm::Error lossBackward(Loss &l, Act &logits, Act &dLogits, int mb, int slice, int n,
                           int localV, int vocabBegin, int tp, float scale) {
    const std::vector<int32_t> tgt = tokens(mb, slice, true);
    if (tp > 1) { // from the rank's logits and the whole vocabulary's log-sum-exp
      dLogits.resize(logits.size());
      ops::crossEntropyShardBackward(dLogits.data(), logits.data(), l.lse.data(), tgt.data(), n,
                                     localV, vocabBegin, scale);
      release(logits);
      release(l.lse);
      return ok();
    }
    dLogits.resize(l.probs.size());
    ops::crossEntropyBackward(dLogits.data(), l.probs.data(), tgt.data(), n, cfg.vocab, scale);
    release(l.probs);
    return ok();
  }
};

} // namespace

struct StageCompute::Impl : StageProgram<CpuDev> {};

StageCompute::StageCompute(const GptConfig &cfg, int layerBegin, int layerEnd, int tpRank, int tp,
                           uint64_t seed, std::vector<std::pair<int, int>> slices, float lossScale)
    : impl(std::make_unique<Impl>()) {
  checkConfig(cfg, tp);
  assert(0 <= layerBegin && layerBegin < layerEnd && layerEnd <= cfg.numLayers() &&
         "empty or out-of-range layer range");
  assert(tpRank >= 0 && tpRank < tp && "tp rank out of range");
  assert(!slices.empty() && slices.front().first == 0 && slices.back().second == cfg.seqLen &&
         "slices must cover the sequence");
  for (size_t s = 0; s < slices.size(); ++s)
    assert(slices[s].first < slices[s].second &&
           (s == 0 || slices[s - 1].second == slices[s].first) &&
           "slices must be non-empty and contiguous");
  Impl &m = *impl;
  m.dev.cfg = cfg;
  m.dev.slices = slices;
  m.setUp(cfg, layerBegin, layerEnd, tpRank, tp, std::move(slices), lossScale);
  for (int l = layerBegin; l < layerEnd; ++l) {
    std::vector<float> shard = shardLayer(cfg, l, tpRank, tp, initLayerFull(cfg, l, seed));
    m.dev.params.insert(m.dev.params.end(), shard.begin(), shard.end());
  }
  assert(m.dev.params.size() == m.layerOffset.back() && "the layout and the shards disagree");
  m.dev.grads.assign(m.dev.params.size(), 0.0f);
  m.dev.adamM.assign(m.dev.params.size(), 0.0f);
  m.dev.adamV.assign(m.dev.params.size(), 0.0f);
}

StageCompute::~StageCompute() = default;

int StageCompute::parts() const { return int(impl->forwardParts.size()); }
bool StageCompute::hasEmbedding() const { return impl->hasEmbedding(); }
bool StageCompute::hasHead() const { return impl->hasHead(); }

void StageCompute::setBatch(std::vector<std::vector<int32_t>> tokens) {
  impl->dev.batch = std::move(tokens);
}

std::span<float> StageCompute::forward(int mb, int slice, int part, std::span<const float> input) {
  std::span<float> result;
  llvm::cantFail(impl->forward(mb, slice, part, input, result));
  return result;
}

std::span<const float> StageCompute::output(int mb, int slice) const {
  auto &w = impl->get(mb, slice);
  assert(w.nextForwardPart == parts() && "output() before the last forward part");
  // Completes the last part: the residual add of its reduced buffer.
  llvm::cantFail(impl->finishForward(w));
  if (hasHead())
    return {};
  return w.resid;
}

double StageCompute::loss(int mb, int slice) const {
  assert(hasHead() && "loss() on a stage without the head");
  auto &w = impl->get(mb, slice);
  assert(w.nextForwardPart == parts() && "loss() before the last forward part");
  llvm::cantFail(impl->finishForward(w)); // with tp > 1, the loss of the reduced statistics
  return w.head.loss.loss;
}

std::span<float> StageCompute::backwardInput(int mb, int slice, int part,
                                             std::span<const float> gradOutput) {
  std::span<float> result;
  llvm::cantFail(impl->backwardInput(mb, slice, part, gradOutput, result));
  return result;
}

std::span<const float> StageCompute::inputGrad(int mb, int slice) const {
  auto &w = impl->get(mb, slice);
  assert(w.nextBackwardPart == parts() && "inputGrad() before the last backward part");
  // Completes the last part: norm1 backward of its reduced buffer plus the residual path.
  llvm::cantFail(impl->finishBackward(w));
  if (hasEmbedding())
    return {};
  return w.dResid;
}

void StageCompute::backwardWeight(int mb, int slice) {
  llvm::cantFail(impl->backwardWeight(mb, slice));
}

std::span<float> StageCompute::params() { return impl->dev.params; }
std::span<float> StageCompute::grads() { return impl->dev.grads; }

std::pair<size_t, size_t> StageCompute::layerRange(int layer) const {
  assert(layer >= impl->layerBegin && layer < impl->layerEnd && "layer not on this stage");
  int l = layer - impl->layerBegin;
  return {impl->layerOffset[size_t(l)], impl->layerOffset[size_t(l + 1)]};
}

std::pair<size_t, size_t> StageCompute::tiedEmbeddingRange() const {
  const Impl &m = *impl;
  // A stage holding both copies ties them itself (see backwardWeight): nothing to all-reduce.
  if (!m.cfg.tiedEmbeddings || m.tiedHere())
    return {0, 0};
  const size_t matrix = size_t(m.localV) * size_t(m.cfg.channels); // the rank's rows
  if (m.hasEmbedding()) {
    size_t at = m.offsetOf(m.layerBegin, Wte);
    return {at, at + matrix};
  }
  if (m.hasHead()) {
    size_t at = m.offsetOf(m.layerEnd - 1, LmW);
    return {at, at + matrix};
  }
  return {0, 0};
}

void StageCompute::zeroGrads() { std::fill(impl->dev.grads.begin(), impl->dev.grads.end(), 0.0f); }

void StageCompute::adamStep(float lr, float beta1, float beta2, float eps, float weightDecay) {
  CpuDev &d = impl->dev;
  ++d.adamSteps;
  ops::adamUpdate(d.params.data(), d.grads.data(), d.adamM.data(), d.adamV.data(), d.params.size(),
                  lr, beta1, beta2, eps, weightDecay, d.adamSteps);
}

std::span<float> StageCompute::adamFirstMoment() { return impl->dev.adamM; }
std::span<float> StageCompute::adamSecondMoment() { return impl->dev.adamV; }
int StageCompute::adamSteps() const { return impl->dev.adamSteps; }
void StageCompute::setAdamSteps(int steps) { impl->dev.adamSteps = steps; }

size_t StageCompute::savedBytes() const {
  size_t total = 0;
  auto add = [&](std::vector<float> &v) { total += floatBytes(v); };
  for (auto &[key, w] : impl->work)
    w.forEach(add);
  for (auto &[mb, seq] : impl->sequences)
    for (auto &b : seq.blocks)
      add(b.k), add(b.v), add(b.dk), add(b.dv);
  return total;
}

} // namespace pipec::kernels
