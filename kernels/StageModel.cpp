//===- StageModel.cpp - The GPT's layers, layout, initialisation and tp shards -===//
//
// Device-neutral: every backend's stage (kernels/StageProgram.h on the host or a GPU) lays out,
// initialises and cuts its parameters here.
//
// The layout is StageModel.h's. Linear weights are [in, out] (y = x W + b). The full (tp = 1) qkv.w
// is [C, 3C] with columns q | k | v, head h owning columns [h hd, (h+1) hd) of each third.
// Row-parallel biases are replicated and added once, after the reduction, so every tp rank holds
// the same value and computes the same gradient (from the replicated output gradient): shards of
// gradients equal shardLayer() of the tp = 1 gradients.
//
//===----------------------------------------------------------------------===//
#include "kernels/StageModel.h"

#include "ir/support/Hash.h"

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

} // namespace

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

} // namespace pipec::kernels
