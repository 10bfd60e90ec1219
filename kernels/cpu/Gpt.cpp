//===- Gpt.cpp - CPU reference math of a small GPT, per pipeline stage ------===//
//
// The stage walks its layers as a list of "parts" (one per tensor-parallel reduction point) and
// keeps, per (microbatch, slice), the residual stream and what the backwards need. A part that
// returns a buffer for the tp all-reduce is completed lazily: the residual add (forward) or
// the layernorm backward plus residual add (backward) that consumes the reduced buffer runs at
// the start of the next part, or in output() / inputGrad() / backwardWeight() after the last.
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

#include "kernels/cpu/LlamaOps.h"
#include "kernels/cpu/Ops.h"

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
  assert(false && "unknown layer kind");
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
  assert(false && "unknown shard kind");
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

void release(std::vector<float> &v) { std::vector<float>().swap(v); }

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

/// What one block saved for one slice. Forward fills the first group; backward_input frees
/// what only it needed and fills the second group, which backward_weight consumes. The inputs
/// of qkv, fc and proj (ln1(xIn), ln2(xMid), gelu(fcPre)) are not kept: backward_weight
/// recomputes them, which costs O(N C) against the O(N C^2) of the matmuls.
struct BlockWork {
  // Forward. Shapes with N = B * x tokens of the slice; Cl = C / tp, Fl = F / tp.
  std::vector<float> xIn, ln1Mean, ln1Rstd;  // (N, C), (N), (N)
  std::vector<float> q;                      // (N, Cl), rotated with rope; k, v: SequenceWork
  std::vector<float> probs;                  // (B, Hl, x, a + x)
  std::vector<float> attOut;                 // (N, Cl)
  std::vector<float> attnPartial;            // (N, C) reduced over tp in place, then freed
  std::vector<float> xMid, ln2Mean, ln2Rstd; // (N, C), (N), (N)
  std::vector<float> fcPre;                  // (N, Fl); SwiGLU: (N, 2 Fl), gate | up
  std::vector<float> mlpPartial;             // (N, C) reduced over tp in place, then freed
  // backward_input: output gradients of every linear and layernorm.
  std::vector<float> dOut;   // (N, C) gradient of the block output = of proj's output
  std::vector<float> dFcPre; // (N, Fl or 2 Fl) gradient of fc's output
  std::vector<float> dLn2;   // (N, C) gradient of ln2's output, reduced over tp in place
  std::vector<float> dXmid;  // (N, C) gradient of attn proj's output
  std::vector<float> dQkv;   // (N, Cl + 2 Kl) gradient of qkv's output (Kl: K/V width)
  std::vector<float> dLn1;   // (N, C) gradient of ln1's output, reduced over tp in place

  template <typename F> void forEach(F f) {
    for (auto *v : {&xIn, &ln1Mean, &ln1Rstd, &q, &probs, &attOut, &attnPartial, &xMid, &ln2Mean,
                    &ln2Rstd, &fcPre, &mlpPartial, &dOut, &dFcPre, &dLn2, &dXmid, &dQkv, &dLn1})
      f(*v);
  }
};

struct HeadWork {
  std::vector<float> lnfIn, lnfMean, lnfRstd, lnfOut; // (N, C), (N), (N), (N, C)
  std::vector<float> probs;                           // (N, V) softmax (tp = 1)
  std::vector<float> logits;  // (N, Vl) the rank's vocabulary columns (tp > 1)
  std::vector<float> stats;   // (2 tp + 1, N) reduced over tp in place, then freed (tp > 1)
  std::vector<float> lse;     // (N) over the whole vocabulary (tp > 1)
  std::vector<float> dLogits; // (N, Vl)
  std::vector<float> dLnfOut; // (N, C) reduced over tp in place (tp > 1)

  template <typename F> void forEach(F f) {
    for (auto *v :
         {&lnfIn, &lnfMean, &lnfRstd, &lnfOut, &probs, &logits, &stats, &lse, &dLogits, &dLnfOut})
      f(*v);
  }
};

struct SliceWork {
  int nextForwardPart = 0;
  int nextBackwardPart = 0;
  /// The part whose returned buffer has not been consumed yet (-1: none).
  int pendingForward = -1;
  int pendingBackward = -1;
  std::vector<int32_t> inputs, targets; // (B, x) token ids and next-token targets
  std::vector<float> resid;             // (N, C) residual stream (forward)
  std::vector<float> dResid;            // (N, C) its gradient (backward)
  std::vector<float> dEmb;              // (N, C) gradient of the embedding output
  std::vector<BlockWork> blocks;        // one per block of the stage
  HeadWork head;
  double loss = 0.0;

  size_t bytes() {
    size_t total = (inputs.size() + targets.size()) * sizeof(int32_t) + floatBytes(resid) +
                   floatBytes(dResid) + floatBytes(dEmb);
    for (BlockWork &b : blocks)
      b.forEach([&](std::vector<float> &v) { total += floatBytes(v); });
    head.forEach([&](std::vector<float> &v) { total += floatBytes(v); });
    return total;
  }
};

/// Per block: keys and values of every token of the microbatch run forward so far, and the
/// gradients later slices' backwards have added for them. All (tokens so far, B, Cl),
/// position-major: a slice's forward appends its rows.
struct SequenceBlock {
  std::vector<float> k, v, dk, dv;
};

struct SequenceWork {
  int nextForwardSlice = 0;
  int nextBackwardSlice = -1; // set when the first backward starts
  std::vector<SequenceBlock> blocks;

  size_t bytes() const {
    size_t total = 0;
    for (const SequenceBlock &b : blocks)
      total += floatBytes(b.k) + floatBytes(b.v) + floatBytes(b.dk) + floatBytes(b.dv);
    return total;
  }
};

namespace {
/// A reduction point of the stage: layer and which of its parts (block: 0 attention, 1 MLP).
struct PartRef {
  int layer;
  int sub;
};
} // namespace

struct StageCompute::Impl {
  GptConfig cfg;
  int layerBegin, layerEnd, tpRank, tp;
  std::vector<std::pair<int, int>> slices;
  float lossScale;
  int localHeads, headDim, localC, localF;
  int localKv, localKvC; // the rank's key/value heads and their width
  int qkvCols, fcCols;   // the rank's columns of qkv (q | k | v) and of fc (gate | up)
  int localV, vocabBegin; // the rank's vocabulary rows of wte and lm.w: [vocabBegin, + localV)
  std::vector<PartRef> forwardParts, backwardParts; // backward: last layer first, MLP first
  std::vector<size_t> layerOffset;                  // per stage layer, plus the end
  std::vector<std::array<size_t, kMostTensors>> tensorOffset; // per stage layer, by role
  std::vector<float> params, grads, adamM, adamV;
  int adamSteps = 0;
  std::vector<std::vector<int32_t>> batch;
  std::map<std::pair<int, int>, SliceWork> work;
  std::map<int, SequenceWork> sequences;

  GptLayerKind kind(int layer) const { return layerKind(cfg, layer); }
  int firstBlock() const { return layerBegin == 0 ? 1 : layerBegin; }
  int blockCount() const {
    int count = 0;
    for (int l = layerBegin; l < layerEnd; ++l)
      count += kind(l) == GptLayerKind::Block;
    return count;
  }
  bool hasEmbedding() const { return layerBegin == 0; }
  bool hasHead() const { return layerEnd == cfg.numLayers(); }
  bool tiedHere() const { return cfg.tiedEmbeddings && hasEmbedding() && hasHead(); }

  /// A tensor of the layer by role; null where the variant has none (a bias, wpe, a shift).
  float *param(int layer, int tensor) {
    int l = layer - layerBegin;
    const size_t at = tensorOffset[l][size_t(tensor)];
    return at == kAbsent ? nullptr : params.data() + layerOffset[l] + at;
  }
  float *grad(int layer, int tensor) {
    int l = layer - layerBegin;
    const size_t at = tensorOffset[l][size_t(tensor)];
    return at == kAbsent ? nullptr : grads.data() + layerOffset[l] + at;
  }
  /// Positions of a slice's rows (b, t) for rotary embeddings.
  std::vector<int32_t> positions(int slice) const {
    const auto [begin, end] = slices[slice];
    const int x = end - begin;
    std::vector<int32_t> out(size_t(cfg.microbatch) * x);
    for (size_t r = 0; r < out.size(); ++r)
      out[r] = begin + int(r % size_t(x));
    return out;
  }
  // The block's norms: LayerNorm (mean kept) or RMSNorm (mean left empty).
  void normForward(float *out, std::vector<float> &mean, std::vector<float> &rstd,
                   const float *in, int layer, int w, int b, int n) {
    rstd.resize(n);
    if (cfg.rmsnorm) {
      ops::rmsnormForward(out, rstd.data(), in, param(layer, w), n, cfg.channels, cfg.normEps);
      return;
    }
    mean.resize(n);
    ops::layernormForward(out, mean.data(), rstd.data(), in, param(layer, w), param(layer, b), n,
                          cfg.channels, cfg.normEps);
  }
  void normBackwardInput(float *dIn, const float *dOut, const float *in,
                         const std::vector<float> &mean, const std::vector<float> &rstd, int layer,
                         int w, int n) {
    if (cfg.rmsnorm)
      ops::rmsnormBackwardInputAccumulate(dIn, dOut, in, rstd.data(), param(layer, w), n,
                                          cfg.channels);
    else
      ops::layernormBackwardInputAccumulate(dIn, dOut, in, mean.data(), rstd.data(),
                                            param(layer, w), n, cfg.channels);
  }
  void normBackwardWeight(const float *dOut, const float *in, const std::vector<float> &mean,
                          const std::vector<float> &rstd, int layer, int w, int b, int n) {
    if (cfg.rmsnorm)
      ops::rmsnormBackwardWeight(grad(layer, w), dOut, in, rstd.data(), n, cfg.channels);
    else
      ops::layernormBackwardWeight(grad(layer, w), grad(layer, b), dOut, in, mean.data(),
                                   rstd.data(), n, cfg.channels);
  }
  /// The MLP's activation: gelu(fcPre), or silu(gate) * up of each row's gate | up.
  void mlpActivation(float *out, const std::vector<float> &fcPre, int n) const {
    if (!cfg.swiglu) {
      ops::geluForward(out, fcPre.data(), fcPre.size());
      return;
    }
    for (int r = 0; r < n; ++r) {
      const float *row = fcPre.data() + size_t(r) * fcCols;
      ops::swigluForward(out + size_t(r) * localF, row, row + localF, size_t(localF));
    }
  }

  int sliceLen(int slice) const { return slices[slice].second - slices[slice].first; }
  SequenceWork &sequence(int mb) {
    auto it = sequences.find(mb);
    assert(it != sequences.end() && "slice 0 of this microbatch has not run forward");
    return it->second;
  }
  SliceWork &get(int mb, int slice) {
    auto it = work.find({mb, slice});
    assert(it != work.end() && "no forward state for this (microbatch, slice)");
    return it->second;
  }

  std::span<float> forward(int mb, int slice, int part, std::span<const float> input);
  void finishForward(SliceWork &w);
  std::span<float> backwardInput(int mb, int slice, int part, std::span<const float> gradOutput);
  void finishBackward(SliceWork &w);
  void backwardWeight(int mb, int slice);
};

void StageCompute::Impl::finishForward(SliceWork &w) {
  if (w.pendingForward < 0)
    return;
  PartRef p = forwardParts[w.pendingForward];
  w.pendingForward = -1;
  if (kind(p.layer) == GptLayerKind::Head) {
    // The loss over the whole vocabulary from the shards' reduced statistics.
    HeadWork &hw = w.head;
    const int n = int(hw.lnfRstd.size());
    hw.lse.resize(n);
    w.loss = ops::crossEntropyCombine(hw.lse.data(), hw.stats.data(), n, tp, lossScale);
    release(hw.stats);
    return;
  }
  assert(kind(p.layer) == GptLayerKind::Block && "the embedding's reduction needs no finishing");
  BlockWork &bw = w.blocks[p.layer - firstBlock()];
  const int c = cfg.channels;
  // Residual add of the reduced branch output; the row-parallel bias is added here, once.
  const float *bias = param(p.layer, p.sub == 0 ? AttnB : ProjB);
  std::vector<float> &branch = p.sub == 0 ? bw.attnPartial : bw.mlpPartial;
  if (bias)
    for (size_t k = 0; k < w.resid.size(); ++k)
      w.resid[k] += branch[k] + bias[k % c];
  else
    for (size_t k = 0; k < w.resid.size(); ++k)
      w.resid[k] += branch[k];
  release(branch);
  if (p.sub == 0)
    bw.xMid = w.resid;
}

std::span<float> StageCompute::Impl::forward(int mb, int slice, int part,
                                             std::span<const float> input) {
  assert(slice >= 0 && slice < int(slices.size()) && "slice out of range");
  assert(part >= 0 && part < int(forwardParts.size()) && "part out of range");
  const auto [begin, end] = slices[slice];
  const int x = sliceLen(slice), b = cfg.microbatch, c = cfg.channels, n = b * x;
  if (part == 0) {
    // A fresh forward; state left by a forward that never ran backward (evaluation) is dropped.
    if (slice == 0) {
      SequenceWork &seq = sequences[mb] = SequenceWork();
      seq.blocks.resize(blockCount());
    }
    SequenceWork &seq = sequence(mb);
    assert(seq.nextForwardSlice == slice && "slices of a microbatch run forward in order");
    ++seq.nextForwardSlice;
    SliceWork &w = work[{mb, slice}] = SliceWork();
    w.blocks.resize(blockCount());
    if (hasEmbedding() || hasHead()) {
      assert(mb >= 0 && mb < int(batch.size()) && "setBatch() has no such microbatch");
      const std::vector<int32_t> &tokens = batch[mb];
      assert(tokens.size() == size_t(b) * (cfg.seqLen + 1) && "batch has the wrong size");
      for (int s = 0; s < b; ++s)
        for (int t = begin; t < end; ++t) {
          w.inputs.push_back(tokens[size_t(s) * (cfg.seqLen + 1) + t]);
          w.targets.push_back(tokens[size_t(s) * (cfg.seqLen + 1) + t + 1]);
        }
    }
    if (!hasEmbedding()) {
      assert(input.size() == size_t(n) * c && "stage input has the wrong size");
      w.resid.assign(input.begin(), input.end());
    }
  }
  SliceWork &w = get(mb, slice);
  assert(part == w.nextForwardPart && "forward parts run in order");
  ++w.nextForwardPart;
  finishForward(w);
  const PartRef p = forwardParts[part];
  switch (kind(p.layer)) {
  case GptLayerKind::Embedding: {
    // resid (B, x, C) = wte[token] + wpe[position]. Vocab-parallel: a rank adds the wte rows it
    // holds, tp rank 0 also wpe, and the tp reduction sums them in place; the other terms are
    // zeros, so the sum equals tp = 1's to the bit.
    const float *wte = param(p.layer, Wte), *wpe = param(p.layer, Wpe);
    w.resid.assign(size_t(n) * c, 0.0f);
    for (int r = 0; r < n; ++r) {
      const int pos = begin + r % x, token = w.inputs[r], local = token - vocabBegin;
      assert(token >= 0 && token < cfg.vocab && "input token out of the vocabulary");
      float *out = w.resid.data() + size_t(r) * c;
      if (local >= 0 && local < localV) {
        for (int k = 0; k < c; ++k)
          out[k] = wte[size_t(local) * c + k];
      }
      if (tpRank == 0 && wpe)
        for (int k = 0; k < c; ++k)
          out[k] += wpe[size_t(pos) * c + k];
    }
    if (tp > 1)
      return w.resid;
    return {};
  }
  case GptLayerKind::Head: {
    HeadWork &hw = w.head;
    hw.lnfIn = std::move(w.resid);
    w.resid.clear();
    hw.lnfOut.resize(size_t(n) * c);
    normForward(hw.lnfOut.data(), hw.lnfMean, hw.lnfRstd, hw.lnfIn.data(), p.layer, LnfW, LnfB, n);
    if (tp > 1) {
      // Vocab-parallel: the rank's columns of the logits (B, x, Vl) and their statistics, which
      // the tp reduction completes; finishForward() computes the loss.
      hw.logits.resize(size_t(n) * localV);
      ops::matmulTForward(hw.logits.data(), hw.lnfOut.data(), param(p.layer, LmW), n, c, localV);
      hw.stats.resize(ops::crossEntropyStatsFloats(n, tp));
      ops::crossEntropyShardStats(hw.stats.data(), hw.logits.data(), w.targets.data(), n, localV,
                                  vocabBegin, tpRank, tp);
      w.pendingForward = part;
      return hw.stats;
    }
    std::vector<float> logits(size_t(n) * cfg.vocab); // (B, x, V)
    ops::matmulTForward(logits.data(), hw.lnfOut.data(), param(p.layer, LmW), n, c, cfg.vocab);
    hw.probs.resize(logits.size());
    w.loss = ops::crossEntropyForward(hw.probs.data(), logits.data(), w.targets.data(), n,
                                      cfg.vocab, lossScale);
    return {};
  }
  case GptLayerKind::Block:
    break;
  }
  BlockWork &bw = w.blocks[p.layer - firstBlock()];
  if (p.sub == 0) {
    // ln1 -> qkv (-> rope of q and k) -> causal attention over keys [0, end) -> attn proj
    // (partial over tp).
    bw.xIn = w.resid;
    std::vector<float> ln1Out(size_t(n) * c); // (B, x, C)
    normForward(ln1Out.data(), bw.ln1Mean, bw.ln1Rstd, bw.xIn.data(), p.layer, Ln1W, Ln1B, n);
    std::vector<float> qkv(size_t(n) * qkvCols); // (B, x, Cl + 2 Kl)
    ops::matmulForward(qkv.data(), ln1Out.data(), param(p.layer, QkvW), param(p.layer, QkvB), n, c,
                       qkvCols);
    std::vector<float> keys(size_t(n) * localKvC); // (B, x, Kl)
    bw.q.resize(size_t(n) * localC);
    for (int r = 0; r < n; ++r) {
      const float *row = qkv.data() + size_t(r) * qkvCols;
      std::copy_n(row, localC, bw.q.data() + size_t(r) * localC);
      std::copy_n(row + localC, localKvC, keys.data() + size_t(r) * localKvC);
    }
    if (cfg.rope) {
      const std::vector<int32_t> pos = positions(slice);
      ops::ropeForward(bw.q.data(), pos.data(), n, localHeads, headDim, cfg.ropeTheta);
      ops::ropeForward(keys.data(), pos.data(), n, localKv, headDim, cfg.ropeTheta);
    }
    // Append the slice's keys and values: rows [begin, end) of the position-major K/V.
    SequenceBlock &sb = sequence(mb).blocks[p.layer - firstBlock()];
    assert(sb.k.size() == size_t(begin) * b * localKvC && "K/V do not end where the slice begins");
    sb.k.resize(size_t(end) * b * localKvC);
    sb.v.resize(size_t(end) * b * localKvC);
    for (int r = 0; r < n; ++r) {
      const float *row = qkv.data() + size_t(r) * qkvCols;
      const size_t kv = (size_t(begin + r % x) * b + r / x) * localKvC; // (t, b) of row r = (b, t)
      std::copy_n(keys.data() + size_t(r) * localKvC, localKvC, sb.k.data() + kv);
      std::copy_n(row + localC + localKvC, localKvC, sb.v.data() + kv);
    }
    const ops::GroupedAttentionShape shape{b, x, begin, localHeads, localKv, headDim};
    bw.probs.resize(size_t(b) * localHeads * x * end);
    bw.attOut.resize(size_t(n) * localC);
    ops::groupedAttentionForward(bw.attOut.data(), bw.probs.data(), bw.q.data(), sb.k.data(),
                                 sb.v.data(), shape);
    bw.attnPartial.resize(size_t(n) * c);
    ops::matmulForward(bw.attnPartial.data(), bw.attOut.data(), param(p.layer, AttnW), nullptr, n,
                       localC, c);
    w.pendingForward = part;
    return bw.attnPartial;
  }
  // ln2 -> fc -> gelu (or silu(gate) * up) -> proj (partial over tp).
  std::vector<float> ln2Out(size_t(n) * c); // (B, x, C)
  normForward(ln2Out.data(), bw.ln2Mean, bw.ln2Rstd, bw.xMid.data(), p.layer, Ln2W, Ln2B, n);
  bw.fcPre.resize(size_t(n) * fcCols); // (B, x, Fl), or (B, x, 2 Fl): gate | up
  ops::matmulForward(bw.fcPre.data(), ln2Out.data(), param(p.layer, FcW), param(p.layer, FcB), n, c,
                     fcCols);
  std::vector<float> fcAct(size_t(n) * localF); // (B, x, Fl)
  mlpActivation(fcAct.data(), bw.fcPre, n);
  bw.mlpPartial.resize(size_t(n) * c);
  ops::matmulForward(bw.mlpPartial.data(), fcAct.data(), param(p.layer, ProjW), nullptr, n, localF,
                     c);
  w.pendingForward = part;
  return bw.mlpPartial;
}

void StageCompute::Impl::finishBackward(SliceWork &w) {
  if (w.pendingBackward < 0)
    return;
  PartRef p = backwardParts[w.pendingBackward];
  w.pendingBackward = -1;
  if (kind(p.layer) == GptLayerKind::Head) {
    // After the LM head backward: dResid = lnf backward of the reduced dLnfOut.
    HeadWork &hw = w.head;
    const int n = int(hw.lnfRstd.size()), c = cfg.channels;
    w.dResid.assign(size_t(n) * c, 0.0f);
    normBackwardInput(w.dResid.data(), hw.dLnfOut.data(), hw.lnfIn.data(), hw.lnfMean, hw.lnfRstd,
                      p.layer, LnfW, n);
    return;
  }
  assert(kind(p.layer) == GptLayerKind::Block && "the embedding reduces nothing backward");
  BlockWork &bw = w.blocks[p.layer - firstBlock()];
  const int n = int(bw.ln1Rstd.size());
  if (p.sub == 0) {
    // After the MLP backward: dXmid = dOut + ln2 backward of the reduced dLn2.
    normBackwardInput(w.dResid.data(), bw.dLn2.data(), bw.xMid.data(), bw.ln2Mean, bw.ln2Rstd,
                      p.layer, Ln2W, n);
    bw.dXmid = w.dResid;
    return;
  }
  // After the attention backward: dXin = dXmid + ln1 backward of the reduced dLn1.
  normBackwardInput(w.dResid.data(), bw.dLn1.data(), bw.xIn.data(), bw.ln1Mean, bw.ln1Rstd, p.layer,
                    Ln1W, n);
}

std::span<float> StageCompute::Impl::backwardInput(int mb, int slice, int part,
                                                   std::span<const float> gradOutput) {
  assert(part >= 0 && part < int(backwardParts.size()) && "part out of range");
  SliceWork &w = get(mb, slice);
  assert(w.nextForwardPart == int(forwardParts.size()) && "backward before the forward ended");
  const auto [begin, end] = slices[slice];
  const int x = sliceLen(slice), b = cfg.microbatch, c = cfg.channels, n = b * x;
  SequenceWork &seq = sequence(mb);
  if (part == 0) {
    finishForward(w);
    if (seq.nextBackwardSlice < 0)
      seq.nextBackwardSlice = seq.nextForwardSlice - 1;
    assert(seq.nextBackwardSlice == slice && "slices of a microbatch run backward last first");
    --seq.nextBackwardSlice;
    release(w.resid);
    if (!hasHead()) {
      assert(gradOutput.size() == size_t(n) * c && "output gradient has the wrong size");
      w.dResid.assign(gradOutput.begin(), gradOutput.end());
    }
  }
  assert(part == w.nextBackwardPart && "backward parts run in order");
  ++w.nextBackwardPart;
  finishBackward(w);
  const PartRef p = backwardParts[part];
  const bool lastPart = part + 1 == int(backwardParts.size());
  std::span<float> result;
  switch (kind(p.layer)) {
  case GptLayerKind::Head: {
    // dlogits = (softmax - onehot) * lossScale -> lm head (partial over tp) -> lnf.
    HeadWork &hw = w.head;
    if (tp > 1) {
      hw.dLogits.resize(hw.logits.size());
      ops::crossEntropyShardBackward(hw.dLogits.data(), hw.logits.data(), hw.lse.data(),
                                     w.targets.data(), n, localV, vocabBegin, lossScale);
      release(hw.logits);
      release(hw.lse);
    } else {
      hw.dLogits.resize(hw.probs.size());
      ops::crossEntropyBackward(hw.dLogits.data(), hw.probs.data(), w.targets.data(), n, cfg.vocab,
                                lossScale);
      release(hw.probs);
    }
    hw.dLnfOut.resize(size_t(n) * c);
    ops::matmulTBackwardInput(hw.dLnfOut.data(), hw.dLogits.data(), param(p.layer, LmW), n, c,
                              localV);
    w.pendingBackward = part;
    if (tp > 1)
      result = hw.dLnfOut;
    else
      finishBackward(w);
    break;
  }
  case GptLayerKind::Embedding:
    w.dEmb = std::move(w.dResid);
    w.dResid.clear();
    break;
  case GptLayerKind::Block: {
    BlockWork &bw = w.blocks[p.layer - firstBlock()];
    if (p.sub == 0) {
      // MLP backward: dOut -> proj -> gelu (or swiglu) -> fc; returns dLn2 (partial over tp).
      bw.dOut = w.dResid;
      std::vector<float> dFcAct(size_t(n) * localF); // (B, x, Fl)
      ops::matmulBackwardInput(dFcAct.data(), bw.dOut.data(), param(p.layer, ProjW), n, localF, c);
      bw.dFcPre.resize(bw.fcPre.size());
      if (cfg.swiglu) {
        for (int r = 0; r < n; ++r) {
          const float *pre = bw.fcPre.data() + size_t(r) * fcCols;
          float *dPre = bw.dFcPre.data() + size_t(r) * fcCols;
          ops::swigluBackward(dPre, dPre + localF, dFcAct.data() + size_t(r) * localF, pre,
                              pre + localF, size_t(localF));
        }
      } else {
        ops::geluBackward(bw.dFcPre.data(), dFcAct.data(), bw.fcPre.data(), dFcAct.size());
      }
      bw.dLn2.resize(size_t(n) * c);
      ops::matmulBackwardInput(bw.dLn2.data(), bw.dFcPre.data(), param(p.layer, FcW), n, c, fcCols);
      w.pendingBackward = part;
      result = bw.dLn2;
      break;
    }
    // Attention backward: dXmid -> attn proj -> attention -> qkv; returns dLn1 (partial).
    std::vector<float> dAttOut(size_t(n) * localC); // (B, x, Cl)
    ops::matmulBackwardInput(dAttOut.data(), bw.dXmid.data(), param(p.layer, AttnW), n, localC, c);
    SequenceBlock &sb = seq.blocks[p.layer - firstBlock()];
    if (sb.dk.empty()) { // the first backward of the microbatch: every slice has run forward
      sb.dk.assign(sb.k.size(), 0.0f);
      sb.dv.assign(sb.v.size(), 0.0f);
    }
    assert(sb.dk.size() >= size_t(end) * b * localKvC && "K/V gradients miss this slice");
    std::vector<float> dq(size_t(n) * localC); // (B, x, Cl)
    const ops::GroupedAttentionShape shape{b, x, begin, localHeads, localKv, headDim};
    ops::groupedAttentionBackward(dq.data(), sb.dk.data(), sb.dv.data(), dAttOut.data(),
                                  bw.probs.data(), bw.q.data(), sb.k.data(), sb.v.data(), shape);
    release(bw.probs);
    release(bw.q);
    // The slice's own dK/dV are complete: every later slice has already added its share.
    std::vector<float> dKeys(size_t(n) * localKvC); // (B, x, Kl)
    for (int r = 0; r < n; ++r) {
      const size_t kv = (size_t(begin + r % x) * b + r / x) * localKvC;
      std::copy_n(sb.dk.data() + kv, localKvC, dKeys.data() + size_t(r) * localKvC);
    }
    if (cfg.rope) { // back through the rotations to the gradients of qkv's q and k columns
      const std::vector<int32_t> pos = positions(slice);
      ops::ropeBackward(dq.data(), pos.data(), n, localHeads, headDim, cfg.ropeTheta);
      ops::ropeBackward(dKeys.data(), pos.data(), n, localKv, headDim, cfg.ropeTheta);
    }
    bw.dQkv.resize(size_t(n) * qkvCols);
    for (int r = 0; r < n; ++r) {
      float *row = bw.dQkv.data() + size_t(r) * qkvCols;
      const size_t kv = (size_t(begin + r % x) * b + r / x) * localKvC;
      std::copy_n(dq.data() + size_t(r) * localC, localC, row);
      std::copy_n(dKeys.data() + size_t(r) * localKvC, localKvC, row + localC);
      std::copy_n(sb.dv.data() + kv, localKvC, row + localC + localKvC);
    }
    bw.dLn1.resize(size_t(n) * c);
    ops::matmulBackwardInput(bw.dLn1.data(), bw.dQkv.data(), param(p.layer, QkvW), n, c, qkvCols);
    w.pendingBackward = part;
    result = bw.dLn1;
    break;
  }
  }
  // Slice 0 is the last of its microbatch to run backward: nobody needs its K/V any more.
  if (lastPart && slice == 0)
    sequences.erase(mb);
  return result;
}

void StageCompute::Impl::backwardWeight(int mb, int slice) {
  SliceWork &w = get(mb, slice);
  assert(w.nextBackwardPart == int(backwardParts.size()) &&
         "backward_weight before backward_input ended");
  finishBackward(w);
  const int begin = slices[slice].first;
  const int x = sliceLen(slice), n = cfg.microbatch * x, c = cfg.channels;
  // With tied embeddings and both copies on this stage, each copy's gradient receives both
  // contributions, in the same order, as the runtime's all-reduce would give across stages.
  for (int l = layerBegin; l < layerEnd; ++l) {
    switch (kind(l)) {
    case GptLayerKind::Embedding: {
      std::vector<float *> wteGrads{grad(l, Wte)};
      if (tiedHere())
        wteGrads.push_back(grad(cfg.numLayers() - 1, LmW));
      float *dWpe = grad(l, Wpe);
      for (int r = 0; r < n; ++r) {
        const float *g = w.dEmb.data() + size_t(r) * c;
        const int local = w.inputs[r] - vocabBegin; // rows of other ranks' tokens: theirs
        if (local >= 0 && local < localV)
          for (float *dWte : wteGrads)
            for (int k = 0; k < c; ++k)
              dWte[size_t(local) * c + k] += g[k];
        if (dWpe)
          for (int k = 0; k < c; ++k)
            dWpe[size_t(begin + r % x) * c + k] += g[k];
      }
      break;
    }
    case GptLayerKind::Head: {
      HeadWork &hw = w.head;
      normBackwardWeight(hw.dLnfOut.data(), hw.lnfIn.data(), hw.lnfMean, hw.lnfRstd, l, LnfW, LnfB,
                         n);
      if (tiedHere())
        ops::matmulTBackwardWeight(grad(0, Wte), hw.lnfOut.data(), hw.dLogits.data(), n, c, localV);
      ops::matmulTBackwardWeight(grad(l, LmW), hw.lnfOut.data(), hw.dLogits.data(), n, c, localV);
      break;
    }
    case GptLayerKind::Block: {
      BlockWork &bw = w.blocks[l - firstBlock()];
      std::vector<float> lnOut(size_t(n) * c), mean, rstd; // (B, x, C), recomputed
      normForward(lnOut.data(), mean, rstd, bw.xIn.data(), l, Ln1W, Ln1B, n);
      normBackwardWeight(bw.dLn1.data(), bw.xIn.data(), bw.ln1Mean, bw.ln1Rstd, l, Ln1W, Ln1B, n);
      ops::matmulBackwardWeight(grad(l, QkvW), grad(l, QkvB), lnOut.data(), bw.dQkv.data(), n, c,
                                qkvCols);
      ops::matmulBackwardWeight(grad(l, AttnW), grad(l, AttnB), bw.attOut.data(), bw.dXmid.data(),
                                n, localC, c);
      normForward(lnOut.data(), mean, rstd, bw.xMid.data(), l, Ln2W, Ln2B, n);
      normBackwardWeight(bw.dLn2.data(), bw.xMid.data(), bw.ln2Mean, bw.ln2Rstd, l, Ln2W, Ln2B, n);
      ops::matmulBackwardWeight(grad(l, FcW), grad(l, FcB), lnOut.data(), bw.dFcPre.data(), n, c,
                                fcCols);
      std::vector<float> fcAct(size_t(n) * localF); // (B, x, Fl), recomputed
      mlpActivation(fcAct.data(), bw.fcPre, n);
      ops::matmulBackwardWeight(grad(l, ProjW), grad(l, ProjB), fcAct.data(), bw.dOut.data(), n,
                                localF, c);
      break;
    }
    }
  }
  work.erase({mb, slice});
}

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
  m.cfg = cfg;
  m.layerBegin = layerBegin;
  m.layerEnd = layerEnd;
  m.tpRank = tpRank;
  m.tp = tp;
  m.slices = std::move(slices);
  m.lossScale = lossScale;
  m.localHeads = cfg.heads / tp;
  m.headDim = cfg.channels / cfg.heads;
  m.localC = m.localHeads * m.headDim;
  m.localF = cfg.ffn / tp;
  m.localKv = cfg.kvHeadCount() / tp;
  m.localKvC = m.localKv * m.headDim;
  m.qkvCols = m.localC + 2 * m.localKvC;
  m.fcCols = cfg.swiglu ? 2 * m.localF : m.localF;
  m.localV = cfg.vocab / tp;
  m.vocabBegin = tpRank * m.localV;
  m.layerOffset.push_back(0);
  for (int l = layerBegin; l < layerEnd; ++l) {
    for (int sub = 0; sub < layerParts(cfg, l); ++sub)
      m.forwardParts.push_back({l, sub});
    m.tensorOffset.push_back(paramRoleOffsets(cfg, l, tp));
    std::vector<float> shard = shardLayer(cfg, l, tpRank, tp, initLayerFull(cfg, l, seed));
    m.params.insert(m.params.end(), shard.begin(), shard.end());
    m.layerOffset.push_back(m.params.size());
  }
  for (int l = layerEnd - 1; l >= layerBegin; --l)
    for (int sub = 0; sub < layerParts(cfg, l); ++sub)
      m.backwardParts.push_back({l, sub});
  m.grads.assign(m.params.size(), 0.0f);
  m.adamM.assign(m.params.size(), 0.0f);
  m.adamV.assign(m.params.size(), 0.0f);
}

StageCompute::~StageCompute() = default;

int StageCompute::parts() const { return int(impl->forwardParts.size()); }
bool StageCompute::hasEmbedding() const { return impl->hasEmbedding(); }
bool StageCompute::hasHead() const { return impl->hasHead(); }

void StageCompute::setBatch(std::vector<std::vector<int32_t>> tokens) {
  impl->batch = std::move(tokens);
}

std::span<float> StageCompute::forward(int mb, int slice, int part, std::span<const float> input) {
  return impl->forward(mb, slice, part, input);
}

std::span<const float> StageCompute::output(int mb, int slice) const {
  SliceWork &w = impl->get(mb, slice);
  assert(w.nextForwardPart == parts() && "output() before the last forward part");
  // Completes the last part: the residual add of its reduced buffer.
  impl->finishForward(w);
  if (hasHead())
    return {};
  return w.resid;
}

double StageCompute::loss(int mb, int slice) const {
  assert(hasHead() && "loss() on a stage without the head");
  SliceWork &w = impl->get(mb, slice);
  assert(w.nextForwardPart == parts() && "loss() before the last forward part");
  impl->finishForward(w); // with tp > 1, the loss of the reduced statistics
  return w.loss;
}

std::span<float> StageCompute::backwardInput(int mb, int slice, int part,
                                             std::span<const float> gradOutput) {
  return impl->backwardInput(mb, slice, part, gradOutput);
}

std::span<const float> StageCompute::inputGrad(int mb, int slice) const {
  SliceWork &w = impl->get(mb, slice);
  assert(w.nextBackwardPart == parts() && "inputGrad() before the last backward part");
  // Completes the last part: ln1 backward of its reduced buffer plus the residual path.
  impl->finishBackward(w);
  if (hasEmbedding())
    return {};
  return w.dResid;
}

void StageCompute::backwardWeight(int mb, int slice) { impl->backwardWeight(mb, slice); }

std::span<float> StageCompute::params() { return impl->params; }
std::span<float> StageCompute::grads() { return impl->grads; }

std::pair<size_t, size_t> StageCompute::layerRange(int layer) const {
  assert(layer >= impl->layerBegin && layer < impl->layerEnd && "layer not on this stage");
  int l = layer - impl->layerBegin;
  return {impl->layerOffset[l], impl->layerOffset[l + 1]};
}

std::pair<size_t, size_t> StageCompute::tiedEmbeddingRange() const {
  const Impl &m = *impl;
  // A stage holding both copies ties them itself (see backwardWeight): nothing to all-reduce.
  if (!m.cfg.tiedEmbeddings || m.tiedHere())
    return {0, 0};
  const size_t matrix = size_t(m.localV) * m.cfg.channels; // the rank's rows
  if (m.hasEmbedding()) {
    size_t at = m.layerOffset[0] + m.tensorOffset[0][Wte];
    return {at, at + matrix};
  }
  if (m.hasHead()) {
    int l = m.layerEnd - 1 - m.layerBegin;
    size_t at = m.layerOffset[l] + m.tensorOffset[l][LmW];
    return {at, at + matrix};
  }
  return {0, 0};
}

void StageCompute::zeroGrads() { std::fill(impl->grads.begin(), impl->grads.end(), 0.0f); }

void StageCompute::adamStep(float lr, float beta1, float beta2, float eps, float weightDecay) {
  Impl &m = *impl;
  ++m.adamSteps;
  ops::adamUpdate(m.params.data(), m.grads.data(), m.adamM.data(), m.adamV.data(), m.params.size(),
                  lr, beta1, beta2, eps, weightDecay, m.adamSteps);
}

std::span<float> StageCompute::adamFirstMoment() { return impl->adamM; }
std::span<float> StageCompute::adamSecondMoment() { return impl->adamV; }
int StageCompute::adamSteps() const { return impl->adamSteps; }
void StageCompute::setAdamSteps(int steps) { impl->adamSteps = steps; }

size_t StageCompute::savedBytes() const {
  size_t total = 0;
  for (auto &[key, w] : impl->work)
    total += w.bytes();
  for (const auto &[mb, seq] : impl->sequences)
    total += seq.bytes();
  return total;
}

} // namespace pipec::kernels
