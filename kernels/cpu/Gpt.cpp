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
// Linear weights are [in, out] (y = x W + b). The full (tp = 1) qkv.w is [C, 3C] with columns
// q | k | v, head h owning columns [h hd, (h+1) hd) of each third. Row-parallel biases are
// replicated and added once, after the reduction, so every tp rank holds the same value and
// computes the same gradient (from the replicated output gradient): shards of gradients equal
// shardLayer() of the tp = 1 gradients.
//
//===----------------------------------------------------------------------===//
#include "kernels/cpu/Gpt.h"

#include "kernels/cpu/Ops.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <numbers>
#include <string>

namespace pipec::kernels {

namespace {

enum class Shard { Replicated, Columns, Rows };
enum class Init { Zeros, Ones, Normal };

/// One parameter tensor of a layer, at its full (tp = 1) shape. A Columns tensor is cut into
/// `groups` equal column blocks (q, k, v) and rank r takes the r-th tp-th of each block.
struct TensorSpec {
  int rows;
  int cols;
  Shard shard;
  int groups;
  Init init;
  const char *name;
};

enum BlockTensor {
  Ln1W,
  Ln1B,
  QkvW,
  QkvB,
  AttnW,
  AttnB,
  Ln2W,
  Ln2B,
  FcW,
  FcB,
  ProjW,
  ProjB,
  NumBlockTensors
};
enum EmbeddingTensor { Wte, Wpe, NumEmbeddingTensors };
enum HeadTensor { LnfW, LnfB, LmW, NumHeadTensors };

std::vector<TensorSpec> layerTensors(const GptConfig &cfg, int layer) {
  const int c = cfg.channels, v = cfg.vocab, f = cfg.ffn;
  switch (layerKind(cfg, layer)) {
  case GptLayerKind::Embedding:
    return {{v, c, Shard::Rows, 1, Init::Normal, "wte"},
            {cfg.seqLen, c, Shard::Replicated, 1, Init::Normal, "wpe"}};
  case GptLayerKind::Block:
    return {{1, c, Shard::Replicated, 1, Init::Ones, "ln1.w"},
            {1, c, Shard::Replicated, 1, Init::Zeros, "ln1.b"},
            {c, 3 * c, Shard::Columns, 3, Init::Normal, "qkv.w"},
            {1, 3 * c, Shard::Columns, 3, Init::Zeros, "qkv.b"},
            {c, c, Shard::Rows, 1, Init::Normal, "attn.w"},
            {1, c, Shard::Replicated, 1, Init::Zeros, "attn.b"},
            {1, c, Shard::Replicated, 1, Init::Ones, "ln2.w"},
            {1, c, Shard::Replicated, 1, Init::Zeros, "ln2.b"},
            {c, f, Shard::Columns, 1, Init::Normal, "fc.w"},
            {1, f, Shard::Columns, 1, Init::Zeros, "fc.b"},
            {f, c, Shard::Rows, 1, Init::Normal, "proj.w"},
            {1, c, Shard::Replicated, 1, Init::Zeros, "proj.b"}};
  case GptLayerKind::Head:
    return {{1, c, Shard::Replicated, 1, Init::Ones, "lnf.w"},
            {1, c, Shard::Replicated, 1, Init::Zeros, "lnf.b"},
            {v, c, Shard::Rows, 1, Init::Normal, "lm.w"}};
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
    int streamLayer = tiedHead && t == LmW ? 0 : layer;
    int streamTensor = tiedHead && t == LmW ? int(Wte) : int(t);
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
      // Each of the `groups` column blocks (q, k, v) is split into tp equal pieces.
      const int groupCols = t.cols / t.groups, localCols = groupCols / tp;
      for (int r = 0; r < t.rows; ++r)
        for (int g = 0; g < t.groups; ++g)
          piece(offset + size_t(r) * t.cols + g * groupCols + tpRank * localCols,
                size_t(localCols));
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
  std::vector<float> q;                      // (N, Cl); k, v live in SequenceWork
  std::vector<float> probs;                  // (B, Hl, x, a + x)
  std::vector<float> attOut;                 // (N, Cl)
  std::vector<float> attnPartial;            // (N, C) reduced over tp in place, then freed
  std::vector<float> xMid, ln2Mean, ln2Rstd; // (N, C), (N), (N)
  std::vector<float> fcPre;                  // (N, Fl)
  std::vector<float> mlpPartial;             // (N, C) reduced over tp in place, then freed
  // backward_input: output gradients of every linear and layernorm.
  std::vector<float> dOut;   // (N, C) gradient of the block output = of proj's output
  std::vector<float> dFcPre; // (N, Fl) gradient of fc's output
  std::vector<float> dLn2;   // (N, C) gradient of ln2's output, reduced over tp in place
  std::vector<float> dXmid;  // (N, C) gradient of attn proj's output
  std::vector<float> dQkv;   // (N, 3 Cl) gradient of qkv's output
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
  int localV, vocabBegin; // the rank's vocabulary rows of wte and lm.w: [vocabBegin, + localV)
  std::vector<PartRef> forwardParts, backwardParts; // backward: last layer first, MLP first
  std::vector<size_t> layerOffset;                  // per stage layer, plus the end
  std::vector<std::vector<size_t>> tensorOffset;    // per stage layer
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

  float *param(int layer, int tensor) {
    int l = layer - layerBegin;
    return params.data() + layerOffset[l] + tensorOffset[l][tensor];
  }
  float *grad(int layer, int tensor) {
    int l = layer - layerBegin;
    return grads.data() + layerOffset[l] + tensorOffset[l][tensor];
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
    const int n = int(hw.lnfMean.size());
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
  for (size_t k = 0; k < w.resid.size(); ++k)
    w.resid[k] += branch[k] + bias[k % c];
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
      if (tpRank == 0)
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
    hw.lnfMean.resize(n);
    hw.lnfRstd.resize(n);
    hw.lnfOut.resize(size_t(n) * c);
    ops::layernormForward(hw.lnfOut.data(), hw.lnfMean.data(), hw.lnfRstd.data(), hw.lnfIn.data(),
                          param(p.layer, LnfW), param(p.layer, LnfB), n, c);
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
    // ln1 -> qkv -> causal attention over keys [0, end) -> attn proj (partial over tp).
    bw.xIn = w.resid;
    bw.ln1Mean.resize(n);
    bw.ln1Rstd.resize(n);
    std::vector<float> ln1Out(size_t(n) * c); // (B, x, C)
    ops::layernormForward(ln1Out.data(), bw.ln1Mean.data(), bw.ln1Rstd.data(), bw.xIn.data(),
                          param(p.layer, Ln1W), param(p.layer, Ln1B), n, c);
    std::vector<float> qkv(size_t(n) * 3 * localC); // (B, x, 3 Cl)
    ops::matmulForward(qkv.data(), ln1Out.data(), param(p.layer, QkvW), param(p.layer, QkvB), n, c,
                       3 * localC);
    // Append the slice's keys and values: rows [begin, end) of the position-major K/V.
    SequenceBlock &sb = sequence(mb).blocks[p.layer - firstBlock()];
    assert(sb.k.size() == size_t(begin) * b * localC && "K/V do not end where the slice begins");
    sb.k.resize(size_t(end) * b * localC);
    sb.v.resize(size_t(end) * b * localC);
    bw.q.resize(size_t(n) * localC);
    for (int r = 0; r < n; ++r) {
      const float *row = qkv.data() + size_t(r) * 3 * localC;
      const size_t kv = (size_t(begin + r % x) * b + r / x) * localC; // (t, b) of row r = (b, t)
      for (int k = 0; k < localC; ++k) {
        bw.q[size_t(r) * localC + k] = row[k];
        sb.k[kv + k] = row[localC + k];
        sb.v[kv + k] = row[2 * localC + k];
      }
    }
    const ops::AttentionShape shape{b, x, begin, localHeads, headDim};
    bw.probs.resize(size_t(b) * localHeads * x * end);
    bw.attOut.resize(size_t(n) * localC);
    ops::attentionForward(bw.attOut.data(), bw.probs.data(), bw.q.data(), sb.k.data(), sb.v.data(),
                          shape);
    bw.attnPartial.resize(size_t(n) * c);
    ops::matmulForward(bw.attnPartial.data(), bw.attOut.data(), param(p.layer, AttnW), nullptr, n,
                       localC, c);
    w.pendingForward = part;
    return bw.attnPartial;
  }
  // ln2 -> fc -> gelu -> proj (partial over tp).
  bw.ln2Mean.resize(n);
  bw.ln2Rstd.resize(n);
  std::vector<float> ln2Out(size_t(n) * c); // (B, x, C)
  ops::layernormForward(ln2Out.data(), bw.ln2Mean.data(), bw.ln2Rstd.data(), bw.xMid.data(),
                        param(p.layer, Ln2W), param(p.layer, Ln2B), n, c);
  bw.fcPre.resize(size_t(n) * localF);
  ops::matmulForward(bw.fcPre.data(), ln2Out.data(), param(p.layer, FcW), param(p.layer, FcB), n, c,
                     localF);
  std::vector<float> fcAct(bw.fcPre.size()); // (B, x, Fl)
  ops::geluForward(fcAct.data(), bw.fcPre.data(), fcAct.size());
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
    const int n = int(hw.lnfMean.size()), c = cfg.channels;
    w.dResid.assign(size_t(n) * c, 0.0f);
    ops::layernormBackwardInputAccumulate(w.dResid.data(), hw.dLnfOut.data(), hw.lnfIn.data(),
                                          hw.lnfMean.data(), hw.lnfRstd.data(),
                                          param(p.layer, LnfW), n, c);
    return;
  }
  assert(kind(p.layer) == GptLayerKind::Block && "the embedding reduces nothing backward");
  BlockWork &bw = w.blocks[p.layer - firstBlock()];
  const int n = int(bw.ln1Mean.size()), c = cfg.channels;
  if (p.sub == 0) {
    // After the MLP backward: dXmid = dOut + ln2 backward of the reduced dLn2.
    ops::layernormBackwardInputAccumulate(w.dResid.data(), bw.dLn2.data(), bw.xMid.data(),
                                          bw.ln2Mean.data(), bw.ln2Rstd.data(),
                                          param(p.layer, Ln2W), n, c);
    bw.dXmid = w.dResid;
    return;
  }
  // After the attention backward: dXin = dXmid + ln1 backward of the reduced dLn1.
  ops::layernormBackwardInputAccumulate(w.dResid.data(), bw.dLn1.data(), bw.xIn.data(),
                                        bw.ln1Mean.data(), bw.ln1Rstd.data(), param(p.layer, Ln1W),
                                        n, c);
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
      // MLP backward: dOut -> proj -> gelu -> fc; returns dLn2 (partial over tp).
      bw.dOut = w.dResid;
      std::vector<float> dFcAct(size_t(n) * localF); // (B, x, Fl)
      ops::matmulBackwardInput(dFcAct.data(), bw.dOut.data(), param(p.layer, ProjW), n, localF, c);
      bw.dFcPre.resize(dFcAct.size());
      ops::geluBackward(bw.dFcPre.data(), dFcAct.data(), bw.fcPre.data(), dFcAct.size());
      bw.dLn2.resize(size_t(n) * c);
      ops::matmulBackwardInput(bw.dLn2.data(), bw.dFcPre.data(), param(p.layer, FcW), n, c, localF);
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
    assert(sb.dk.size() >= size_t(end) * b * localC && "K/V gradients miss this slice");
    std::vector<float> dq(size_t(n) * localC); // (B, x, Cl)
    const ops::AttentionShape shape{b, x, begin, localHeads, headDim};
    ops::attentionBackward(dq.data(), sb.dk.data(), sb.dv.data(), dAttOut.data(), bw.probs.data(),
                           bw.q.data(), sb.k.data(), sb.v.data(), shape);
    release(bw.probs);
    release(bw.q);
    // The slice's own dK/dV are complete: every later slice has already added its share.
    bw.dQkv.resize(size_t(n) * 3 * localC);
    for (int r = 0; r < n; ++r) {
      float *row = bw.dQkv.data() + size_t(r) * 3 * localC;
      const size_t kv = (size_t(begin + r % x) * b + r / x) * localC;
      for (int k = 0; k < localC; ++k) {
        row[k] = dq[size_t(r) * localC + k];
        row[localC + k] = sb.dk[kv + k];
        row[2 * localC + k] = sb.dv[kv + k];
      }
    }
    bw.dLn1.resize(size_t(n) * c);
    ops::matmulBackwardInput(bw.dLn1.data(), bw.dQkv.data(), param(p.layer, QkvW), n, c,
                             3 * localC);
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
        for (int k = 0; k < c; ++k)
          dWpe[size_t(begin + r % x) * c + k] += g[k];
      }
      break;
    }
    case GptLayerKind::Head: {
      HeadWork &hw = w.head;
      ops::layernormBackwardWeight(grad(l, LnfW), grad(l, LnfB), hw.dLnfOut.data(), hw.lnfIn.data(),
                                   hw.lnfMean.data(), hw.lnfRstd.data(), n, c);
      if (tiedHere())
        ops::matmulTBackwardWeight(grad(0, Wte), hw.lnfOut.data(), hw.dLogits.data(), n, c, localV);
      ops::matmulTBackwardWeight(grad(l, LmW), hw.lnfOut.data(), hw.dLogits.data(), n, c, localV);
      break;
    }
    case GptLayerKind::Block: {
      BlockWork &bw = w.blocks[l - firstBlock()];
      std::vector<float> lnOut(size_t(n) * c), mean(n), rstd(n); // (B, x, C), recomputed
      ops::layernormForward(lnOut.data(), mean.data(), rstd.data(), bw.xIn.data(), param(l, Ln1W),
                            param(l, Ln1B), n, c);
      ops::layernormBackwardWeight(grad(l, Ln1W), grad(l, Ln1B), bw.dLn1.data(), bw.xIn.data(),
                                   bw.ln1Mean.data(), bw.ln1Rstd.data(), n, c);
      ops::matmulBackwardWeight(grad(l, QkvW), grad(l, QkvB), lnOut.data(), bw.dQkv.data(), n, c,
                                3 * localC);
      ops::matmulBackwardWeight(grad(l, AttnW), grad(l, AttnB), bw.attOut.data(), bw.dXmid.data(),
                                n, localC, c);
      ops::layernormForward(lnOut.data(), mean.data(), rstd.data(), bw.xMid.data(), param(l, Ln2W),
                            param(l, Ln2B), n, c);
      ops::layernormBackwardWeight(grad(l, Ln2W), grad(l, Ln2B), bw.dLn2.data(), bw.xMid.data(),
                                   bw.ln2Mean.data(), bw.ln2Rstd.data(), n, c);
      ops::matmulBackwardWeight(grad(l, FcW), grad(l, FcB), lnOut.data(), bw.dFcPre.data(), n, c,
                                localF);
      std::vector<float> fcAct(bw.fcPre.size()); // (B, x, Fl), recomputed
      ops::geluForward(fcAct.data(), bw.fcPre.data(), fcAct.size());
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
  m.localV = cfg.vocab / tp;
  m.vocabBegin = tpRank * m.localV;
  m.layerOffset.push_back(0);
  for (int l = layerBegin; l < layerEnd; ++l) {
    for (int sub = 0; sub < layerParts(cfg, l); ++sub)
      m.forwardParts.push_back({l, sub});
    m.tensorOffset.push_back(tensorOffsets(cfg, l, tp));
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
