#include "ir/Model.h"

#include "ir/Error.h"
#include "ir/JsonRead.h"

#include "llvm/Support/ErrorHandling.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/raw_ostream.h"

#include <algorithm>
#include <cassert>

namespace pipec {

//===----------------------------------------------------------------------===//
// Costs
//===----------------------------------------------------------------------===//

int64_t ModelSpec::sequenceLength(int seqSplits) const {
  if (transformer)
    return transformer->seqLength;
  return seqLength > 0 ? seqLength : seqSplits;
}

/// Sum over t in [begin, end) of (t + 1): the causal attention positions of a token range.
static double causalPositions(int64_t begin, int64_t end) {
  return (double(end) * double(end + 1) - double(begin) * double(begin + 1)) / 2.0;
}

/// `total` shared by `n` parts as equally as integers allow; earlier parts take the remainder.
static int64_t shareOf(int64_t total, int n, int index) {
  int64_t base = total / n;
  return base + (index < total % n ? 1 : 0);
}

/// Forward FLOPs of one token through a block's matrices (2 per multiply-add): q and the
/// output projection 2h² each, k and v 2h·(kv heads · head size) each, the MLP 2hf per matrix
/// (two for GELU, three for SwiGLU). GPT-2: 8h² + 4hf. Rotary embeddings, norms and
/// activations are a few FLOPs per element and are left out, as
/// docs/contracts.md#model-spec-pipemodel1 leaves them.
static double blockLinearFlopsPerToken(const TransformerConfig &t) {
  double h = double(t.hiddenSize), f = double(t.ffnHiddenSize);
  double kv = double(t.kvHeads()) * (h / double(t.numAttentionHeads));
  double mlpMatrices = t.mlp == Mlp::SwiGlu ? 3 : 2;
  return 4 * h * h + 4 * h * kv + 2 * mlpMatrices * h * f;
}

double ModelSpec::blockForwardFlopsPrefix(int64_t end) const {
  assert(transformer && "FLOP prefix needs a transformer model");
  const TransformerConfig &t = *transformer;
  return double(end) * blockLinearFlopsPerToken(t) +
         4 * double(t.hiddenSize) * causalPositions(0, end);
}

llvm::StringRef toString(Attention a) {
  switch (a) {
  case Attention::Flash:
    return "flash";
  case Attention::Materialized:
    return "materialized";
  }
  llvm_unreachable("unknown Attention");
}

llvm::StringRef toString(Recompute r) {
  switch (r) {
  case Recompute::None:
    return "none";
  case Recompute::Selective:
    return "selective";
  case Recompute::Full:
    return "full";
  }
  llvm_unreachable("unknown Recompute");
}

llvm::StringRef toString(Norm n) { return n == Norm::RmsNorm ? "rmsnorm" : "layernorm"; }
llvm::StringRef toString(Mlp m) { return m == Mlp::SwiGlu ? "swiglu" : "gelu"; }
llvm::StringRef toString(Position p) { return p == Position::Rope ? "rope" : "learned"; }

bool normFromString(llvm::StringRef name, Norm &out) {
  for (Norm n : {Norm::LayerNorm, Norm::RmsNorm})
    if (toString(n) == name) {
      out = n;
      return true;
    }
  return false;
}

bool mlpFromString(llvm::StringRef name, Mlp &out) {
  for (Mlp m : {Mlp::Gelu, Mlp::SwiGlu})
    if (toString(m) == name) {
      out = m;
      return true;
    }
  return false;
}

bool positionFromString(llvm::StringRef name, Position &out) {
  for (Position p : {Position::Learned, Position::Rope})
    if (toString(p) == name) {
      out = p;
      return true;
    }
  return false;
}

std::string TransformerConfig::variantText() const {
  std::vector<std::string> parts;
  if (norm != Norm::LayerNorm)
    parts.push_back(fmt::format("\"norm\": \"{}\"", toString(norm).str()));
  if (mlp != Mlp::Gelu)
    parts.push_back(fmt::format("\"mlp\": \"{}\"", toString(mlp).str()));
  if (position != Position::Learned)
    parts.push_back(fmt::format("\"position\": \"{}\"", toString(position).str()));
  if (kvHeads() != numAttentionHeads)
    parts.push_back(fmt::format("\"num_query_groups\": {}", numQueryGroups));
  if (!bias)
    parts.push_back("\"bias\": false");
  if (normEps != 1e-5)
    parts.push_back(fmt::format("\"norm_eps\": {}", normEps));
  return fmt::format("{}", fmt::join(parts, ", "));
}

bool attentionFromString(llvm::StringRef name, Attention &out) {
  for (Attention a : {Attention::Flash, Attention::Materialized})
    if (toString(a) == name) {
      out = a;
      return true;
    }
  return false;
}

bool recomputeFromString(llvm::StringRef name, Recompute &out) {
  for (Recompute r : {Recompute::None, Recompute::Selective, Recompute::Full})
    if (toString(r) == name) {
      out = r;
      return true;
    }
  return false;
}

int64_t ModelSpec::residualBytes(int64_t begin, int64_t end, int shards) const {
  if (!transformer)
    return 0;
  const TransformerConfig &t = *transformer;
  return t.microbatchSize * (end - begin) * t.hiddenSize * t.dtypeBytes() / shards;
}

double ModelSpec::modelFlopsPerMicrobatch() const {
  if (!transformer)
    return 0;
  const TransformerConfig &t = *transformer;
  double b = double(t.microbatchSize), s = double(t.seqLength), h = double(t.hiddenSize);
  double v = double(t.vocabSize);
  // docs/contracts.md#model-spec-pipemodel1 per block: F + B + W = b·(3·s·(8h² + 4hf) + 12h·Σ(t+1))
  // for GPT-2 (the matrices' FLOPs per token: blockLinearFlopsPerToken); head: 3 GEMMs of
  // 2·b·s·h·v.
  double block =
      b * (3 * s * blockLinearFlopsPerToken(t) + 12 * h * causalPositions(0, t.seqLength));
  return double(t.numLayers) * block + 3 * 2 * b * s * h * v;
}

// Memory of a transformer layer (what piperun's stages keep, runtime/cuda/GpuStage.cpp and
// kernels/cpu/Gpt.cpp, at the model's dtype: d bytes per element; layernorm statistics, the
// attention's log-sum-exps and the dK/dV accumulators are fp32). Per (microbatch, slice) of
// x tokens [a, e), N = b·x tokens, on one of tp ranks (Cl = h/tp, Fl = f/tp, Hl = heads/tp):
//   block forward keeps   xIn, xMid (h each), q, attOut (Cl each), fcPre (Fl),
//                         two layernorms' mean and rstd (16 bytes per token),
//                         flash: a log-sum-exp per head and token (4·b·Hl·x bytes);
//                         materialized: the probabilities (b·Hl·x·e elements),
//                         K and V (flash: of the whole sequence, with slice 0; materialized:
//                         the slice's own x tokens);
//   after its backward    xIn, xMid, attOut, fcPre and the statistics stay; the output
//                         gradients of its linears and layernorms join them: dOut, dXmid,
//                         dLn1, dLn2 (h each), dQkv (3 Cl), dFcPre (Fl);
//   during its backward   also the fp32 dK/dV accumulators (2·N·Cl·4 bytes);
//   workspace             the largest temporaries of one op: the MLP forward's layernorm
//                         output, GELU output and partial sum (N·(2h + Fl)), or the attention
//                         forward's layernorm output, QKV and partial sum (N·(2h + 3Cl)).
// So activation_bytes = N·(2h + 2Cl + Fl)·d + 16N + attention + K/V and weight_grad_bytes =
// N·(6h + 4Cl + 2Fl)·d + 16N. The stage's residual stream (N·h·d, residualBytes) is the
// stage's, not a layer's. Recomputation (Korthikanti et al. 2022): "full" keeps only the
// block's input (and K/V, which later slices read) and adds a forward to the input-gradient
// backward; "selective" drops the materialized probabilities and adds the attention core's
// forward to the backward (with flash attention there are none to drop: it is "none").
// Llama-style blocks change the widths, not the rule: K and V (and dK, dV, and their columns
// of dQkv) are Kl = kv heads · head size / tp wide instead of Cl; SwiGLU keeps its gate and up
// outputs, 2Fl, where GELU keeps Fl (and so do their gradients); RMSNorm keeps 8N of
// statistics where LayerNorm keeps 16N (the head's final norm 4N instead of 8N). These are
// the rules the Llama kernels are to follow; until they exist nothing checks them against an
// arena.
/// Milliseconds of a GEMM of `flops` (on one rank) whose dimensions are m x k times k x n.
static double gemmMs(const ClusterSpec &c, double flops, double m, double k, double n) {
  return flops / c.gemmFlopsPerMs(std::min({m, k, n}));
}

SliceCost ModelSpec::sliceCost(const ClusterSpec &cluster, size_t layerIndex, int64_t begin,
                               int64_t end, int index, int numSlices, int tp,
                               bool sequenceParallel) const {
  const Layer &layer = layers[layerIndex];
  SliceCost c;
  if (!transformer) {
    // Abstract layers have no attention term: every slice takes an equal share.
    c.forward = layer.forward / numSlices;
    c.backwardInput = layer.backwardInput / numSlices;
    c.backwardWeight = layer.backwardWeight / numSlices;
    c.activationBytes = shareOf(layer.activationBytes, numSlices, index);
    c.weightGradBytes = shareOf(layer.weightGradBytes, numSlices, index);
    c.outputBytes = shareOf(layer.outputBytes, numSlices, index);
    return c;
  }
  const TransformerConfig &t = *transformer;
  double b = double(t.microbatchSize), h = double(t.hiddenSize), f = double(t.ffnHiddenSize);
  double x = double(end - begin), v = double(t.vocabSize), heads = double(t.numAttentionHeads);
  double sigma = causalPositions(begin, end);
  bool flash = t.attention == Attention::Flash;
  double attentionPerMs = cluster.attentionFlopsPerMs(flash) * tp;
  double d = double(t.dtypeBytes());
  double n = b * x, cl = h / tp, fl = f / tp, hl = heads / tp;
  // What sequence parallelism shards over the tp ranks: the norms, dropouts and residual adds
  // (and the residual stream they keep); without it every tp rank repeats them whole.
  double sp = sequenceParallel ? double(tp) : 1.0;
  double overhead = cluster.opOverheadUs / 1000.0;
  double memPerMs = cluster.memoryBytesPerMs();
  switch (layer.kind) {
  case LayerKind::Embedding:
    // A lookup: no FLOPs to speak of; its output is the stage's residual stream.
    c.outputBytes = int64_t(n * h * d);
    return c;
  case LayerKind::Block: {
    // K and V per rank: kv heads x head size / tp (grouped-query attention shares them).
    double kl = double(t.kvHeads()) * (h / heads) / tp;
    double mlpIn = t.mlp == Mlp::SwiGlu ? 2 : 1; // gate and up, or one up projection
    // The block's GEMMs on one rank, each 2·n·k·out FLOPs at the efficiency of its shape (the
    // input gradient's and weight gradient's GEMMs have the same three dimensions): QKV,
    // the attention's output projection, the MLP's up (and gate) and down projections.
    double linear = gemmMs(cluster, 2 * n * h * (cl + 2 * kl), n, h, cl + 2 * kl) +
                    gemmMs(cluster, 2 * n * cl * h, n, cl, h) +
                    mlpIn * gemmMs(cluster, 2 * n * h * fl, n, h, fl) +
                    gemmMs(cluster, 2 * n * fl * h, n, fl, h);
    double attentionF = b * 4 * h * sigma, attentionB = b * 8 * h * sigma;
    // Memory-bound kernels, elements per token: two norms (read and write h each), two
    // dropout-and-residual adds (read 2h, write h each), all sharded only by sequence
    // parallelism; the MLP's activation (read its input width per rank, write its output).
    // Their backward reads what the forward saved and the output's gradient and writes the
    // input's gradient: the norms 3h each, the dropout-and-residual adds 3h each, the
    // activation its input width twice and its output once (GELU 3Fl, SwiGLU 5Fl). The weight
    // gradient is GEMMs only.
    double forwardBytes = 10 * h / sp + (mlpIn + 1) * fl;
    double backwardBytes = 12 * h / sp + (2 * mlpIn + 1) * fl;
    double perByte = memPerMs > 0 ? n * d / memPerMs : 0.0;
    c.forward = linear + attentionF / attentionPerMs + perByte * forwardBytes + overhead;
    c.backwardInput = linear + attentionB / attentionPerMs + perByte * backwardBytes + overhead;
    c.backwardWeight = linear + overhead;
    // The MLP keeps its pre-activation (GELU) or both gate and up outputs (SwiGLU).
    double fc = t.mlp == Mlp::SwiGlu ? 2 * fl : fl;
    // Each norm keeps per token its rstd (RMSNorm) or mean and rstd (LayerNorm), in fp32.
    double stats = t.norm == Norm::RmsNorm ? 8 : 16;
    double kv = flash ? (index == 0 ? 2 * double(t.seqLength) * b * kl * d : 0) : 2 * n * kl * d;
    double probs = flash ? 4 * b * hl * x : b * hl * x * double(end) * d;
    // xIn, xMid (sharded with sequence parallelism), attOut, fcPre, statistics.
    double kept = n * (2 * h / sp + cl + fc) * d + stats * n / sp;
    double forwardOnly = n * cl * d + probs;               // q and the attention's state
    double gradients = n * (4 * h + cl + 2 * kl + fc) * d; // output gradients of the linears
    double dkv = 2 * n * kl * 4;
    double activation = kept + forwardOnly + kv;
    switch (t.recompute) {
    case Recompute::None:
      break;
    case Recompute::Selective:
      if (!flash) {
        activation -= probs;
        c.backwardInput += attentionF / attentionPerMs;
      }
      break;
    case Recompute::Full:
      activation = n * h * d / sp + kv;
      c.backwardInput += c.forward;
      break;
    }
    c.workspaceBytes = int64_t(n * (2 * h + std::max(cl + 2 * kl, fl)) * d);
    // Full recomputation rebuilds one block's forward state at a time inside the backward.
    if (t.recompute == Recompute::Full)
      c.workspaceBytes += int64_t(kept + forwardOnly - n * h * d / sp);
    double weightGrad = kept + gradients;
    c.activationBytes = int64_t(activation);
    c.weightGradBytes = int64_t(weightGrad);
    // At the end of the backward: the weight gradient's inputs, K/V (freed with slice 0) and
    // dK/dV, all on top of what the forward kept.
    c.backwardPeakBytes = std::max<int64_t>(0, int64_t(weightGrad + kv + dkv - activation));
    c.outputBytes = int64_t(n * h * d / sp);
    return c;
  }
  case LayerKind::Head: {
    double vl = v / tp;
    double gemm = gemmMs(cluster, 2 * n * h * vl, n, h, vl);
    c.forward = gemm + overhead;
    c.backwardInput = gemm + overhead;
    c.backwardWeight = gemm + overhead;
    // Forward: final layernorm output and its statistics, the rank's logits (the loss
    // backward overwrites them with their gradient), the log-sum-exp and loss per token (its
    // input is the stage's residual stream). Backward: the layernorm's input stays for W,
    // the logits' gradient and dLnfOut join, the log-sum-exp goes.
    double stats = t.norm == Norm::RmsNorm ? 4 : 8; // the final norm's, per token
    c.activationBytes = int64_t(n * (h + vl) * d + (stats + 8) * n);
    c.weightGradBytes = int64_t(n * (3 * h + vl) * d + (stats + 4) * n);
    c.backwardPeakBytes = c.weightGradBytes - c.activationBytes;
    c.outputBytes = 0;
    return c;
  }
  case LayerKind::Abstract:
    break;
  }
  llvm_unreachable("abstract layer in a transformer model");
}

//===----------------------------------------------------------------------===//
// Parsing
//===----------------------------------------------------------------------===//

static llvm::Error parseLink(const JsonReader &r, const Json &obj, llvm::StringRef path,
                             llvm::StringRef key, Link &out) {
  auto it = obj.find(key.str());
  if (it == obj.end())
    return llvm::Error::success();
  std::string where = jsonPath(path, key);
  if (auto err = r.expectObject(*it, where))
    return err;
  if (auto err = r.onlyKeys(*it, where, {"bandwidth_GBps", "latency_us", "efficiency"}))
    return err;
  if (auto err = r.getNumber(*it, where, "bandwidth_GBps", out.bandwidthGBps, true, 1e-9))
    return err;
  if (auto err = r.getNumber(*it, where, "latency_us", out.latencyUs, true))
    return err;
  if (auto err = r.getNumber(*it, where, "efficiency", out.efficiency, false, 1e-9))
    return err;
  if (out.efficiency > 1)
    return inputError("{}: {}.efficiency: expected a number in (0, 1], got {}", r.name(), where,
                      out.efficiency);
  return llvm::Error::success();
}

static llvm::Error parseCluster(const JsonReader &r, const Json &j, ClusterSpec &c) {
  if (auto err = r.expectObject(j, "$"))
    return err;
  if (auto err = r.onlyKeys(j, "$",
                            {"format", "device", "gpus_per_node", "intra_node", "inter_node",
                             "message_overhead_us", "p2p"}))
    return err;
  std::string format;
  if (auto err = r.getString(j, "$", "format", format, true))
    return err;
  if (format != "pipecluster/1")
    return inputError("{}: $.format: expected \"pipecluster/1\", got \"{}\"", r.name(),
                      shortened(format));
  if (auto it = j.find("device"); it != j.end()) {
    if (auto err = r.expectObject(*it, "$.device"))
      return err;
    if (auto err = r.onlyKeys(*it, "$.device",
                              {"name", "peak_tflops", "achieved_fraction", "attention_fraction",
                               "flash_attention_fraction", "gemm_half_dim", "memory_GBps",
                               "op_overhead_us", "memory_bytes"}))
      return err;
    if (auto err = r.getString(*it, "$.device", "name", c.deviceName, false))
      return err;
    if (auto err = r.getNumber(*it, "$.device", "peak_tflops", c.peakTflops, true, 1e-9))
      return err;
    if (auto err =
            r.getNumber(*it, "$.device", "achieved_fraction", c.achievedFraction, false, 1e-9))
      return err;
    if (c.achievedFraction > 1)
      return inputError("{}: $.device.achieved_fraction: expected a number in (0, 1], got {}",
                        r.name(), c.achievedFraction);
    if (auto err =
            r.getNumber(*it, "$.device", "attention_fraction", c.attentionFraction, false, 1e-9))
      return err;
    if (c.attentionFraction > 1)
      return inputError("{}: $.device.attention_fraction: expected a number in (0, 1], got {}",
                        r.name(), c.attentionFraction);
    if (auto err = r.getNumber(*it, "$.device", "flash_attention_fraction",
                               c.flashAttentionFraction, false, 1e-9))
      return err;
    if (c.flashAttentionFraction > 1)
      return inputError("{}: $.device.flash_attention_fraction: expected a number in (0, 1], "
                        "got {}",
                        r.name(), c.flashAttentionFraction);
    if (auto err = r.getNumber(*it, "$.device", "gemm_half_dim", c.gemmHalfDim, false))
      return err;
    if (auto err = r.getNumber(*it, "$.device", "memory_GBps", c.memoryGBps, false))
      return err;
    if (auto err = r.getNumber(*it, "$.device", "op_overhead_us", c.opOverheadUs, false))
      return err;
    if (auto err = r.getInt(*it, "$.device", "memory_bytes", c.memoryBytes, false, 1))
      return err;
  }
  if (auto err = r.getNumber(j, "$", "message_overhead_us", c.messageOverheadUs, false))
    return err;
  std::string p2p = c.megatronP2p ? "megatron" : "overlapped";
  if (auto err = r.getString(j, "$", "p2p", p2p, false))
    return err;
  if (p2p != "megatron" && p2p != "overlapped")
    return inputError("{}: $.p2p: expected \"megatron\" or \"overlapped\", got \"{}\"", r.name(),
                      shortened(p2p));
  c.megatronP2p = p2p == "megatron";
  int64_t gpn = c.gpusPerNode;
  if (auto err = r.getIntInRange(j, "$", "gpus_per_node", gpn, false, 1, kMaxGpusPerNode))
    return err;
  c.gpusPerNode = int(gpn);
  if (auto err = parseLink(r, j, "$", "intra_node", c.intraNode))
    return err;
  return parseLink(r, j, "$", "inter_node", c.interNode);
}

static llvm::Error parseAbstractLayers(const JsonReader &r, const Json &j, ModelSpec &m) {
  const Json &layers = j["layers"];
  if (auto err = r.expectArray(layers, "$.layers"))
    return err;
  if (layers.empty())
    return inputError("{}: $.layers: expected at least one layer, got an empty array", r.name());
  for (size_t i = 0; i < layers.size(); ++i) {
    std::string path = jsonPath("$.layers", i);
    const Json &l = layers[i];
    if (auto err = r.expectObject(l, path))
      return err;
    if (auto err = r.onlyKeys(l, path,
                              {"name", "count", "forward", "backward_input", "backward_weight",
                               "activation_bytes", "weight_grad_bytes", "param_bytes",
                               "output_bytes", "tp_allreduces"}))
      return err;
    Layer layer;
    layer.name = fmt::format("layer{}", i);
    int64_t count = 1, tpAllReduces = 2;
    if (auto err = r.getString(l, path, "name", layer.name, false))
      return err;
    if (auto err = r.getInt(l, path, "count", count, false, 1))
      return err;
    if (auto err = r.getNumber(l, path, "forward", layer.forward, true))
      return err;
    if (auto err = r.getNumber(l, path, "backward_input", layer.backwardInput, true))
      return err;
    if (auto err = r.getNumber(l, path, "backward_weight", layer.backwardWeight, true))
      return err;
    if (auto err = r.getInt(l, path, "activation_bytes", layer.activationBytes, false))
      return err;
    if (auto err = r.getInt(l, path, "weight_grad_bytes", layer.weightGradBytes, false))
      return err;
    if (auto err = r.getInt(l, path, "param_bytes", layer.paramBytes, false))
      return err;
    if (auto err = r.getInt(l, path, "output_bytes", layer.outputBytes, false))
      return err;
    if (auto err = r.getInt(l, path, "tp_allreduces", tpAllReduces, false))
      return err;
    if (layer.weightGradBytes > layer.activationBytes)
      return inputError("{}: {}.weight_grad_bytes: expected at most activation_bytes ({}), got {}",
                        r.name(), path, layer.activationBytes, layer.weightGradBytes);
    if (count > kMaxLayers - int64_t(m.layers.size()))
      return inputError("{}: {}.count: expected at most {} (a model has at most {} layers in "
                        "all), got {}",
                        r.name(), path, kMaxLayers - int64_t(m.layers.size()), kMaxLayers, count);
    if (tpAllReduces > 1000)
      return inputError("{}: {}.tp_allreduces: expected at most 1000, got {}", r.name(), path,
                        tpAllReduces);
    layer.tpAllReduces = int(tpAllReduces);
    for (int64_t c = 0; c < count; ++c)
      m.layers.push_back(layer);
  }
  if (auto err = r.getNumber(j, "$", "p2p_time", m.p2pTime, false))
    return err;
  m.allReduceTime = m.p2pTime;
  if (auto err = r.getNumber(j, "$", "allreduce_time", m.allReduceTime, false))
    return err;
  return r.getInt(j, "$", "seq_length", m.seqLength, false, 1);
}

static llvm::Error parseTransformer(const JsonReader &r, const Json &j, ModelSpec &m) {
  const Json &t = j["transformer"];
  const char *path = "$.transformer";
  if (auto err = r.expectObject(t, path))
    return err;
  if (auto err = r.onlyKeys(t, path,
                            {"num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                             "vocab_size", "seq_length", "microbatch_size", "dtype",
                             "tie_embeddings", "attention", "recompute", "norm", "mlp", "position",
                             "rope_theta", "num_query_groups", "bias", "norm_eps"}))
    return err;
  TransformerConfig c;
  if (auto err = r.getInt(t, path, "num_layers", c.numLayers, true, 1))
    return err;
  if (auto err = r.getInt(t, path, "hidden_size", c.hiddenSize, true, 1))
    return err;
  if (auto err = r.getInt(t, path, "num_attention_heads", c.numAttentionHeads, true, 1))
    return err;
  c.ffnHiddenSize = 4 * c.hiddenSize;
  if (auto err = r.getInt(t, path, "ffn_hidden_size", c.ffnHiddenSize, false, 1))
    return err;
  if (auto err = r.getInt(t, path, "vocab_size", c.vocabSize, true, 1))
    return err;
  if (auto err = r.getInt(t, path, "seq_length", c.seqLength, true, 1))
    return err;
  if (auto err = r.getInt(t, path, "microbatch_size", c.microbatchSize, false, 1))
    return err;
  if (auto err = r.getString(t, path, "dtype", c.dtype, false))
    return err;
  if (auto err = r.getBool(t, path, "tie_embeddings", c.tieEmbeddings, false))
    return err;
  std::string attention = "flash", recompute = "none";
  if (auto err = r.getString(t, path, "attention", attention, false))
    return err;
  if (!attentionFromString(attention, c.attention))
    return inputError("{}: $.transformer.attention: expected \"flash\" or \"materialized\", got "
                      "\"{}\"",
                      r.name(), attention);
  if (auto err = r.getString(t, path, "recompute", recompute, false))
    return err;
  if (!recomputeFromString(recompute, c.recompute))
    return inputError("{}: $.transformer.recompute: expected \"none\", \"selective\" or "
                      "\"full\", got \"{}\"",
                      r.name(), recompute);
  // The block's variants (Llama's: rmsnorm, swiglu, rope, num_query_groups, bias false).
  std::string norm = "layernorm", mlp = "gelu", position = "learned";
  if (auto err = r.getString(t, path, "norm", norm, false))
    return err;
  if (!normFromString(norm, c.norm))
    return inputError("{}: $.transformer.norm: expected \"layernorm\" or \"rmsnorm\", got "
                      "\"{}\"",
                      r.name(), shortened(norm));
  if (auto err = r.getString(t, path, "mlp", mlp, false))
    return err;
  if (!mlpFromString(mlp, c.mlp))
    return inputError("{}: $.transformer.mlp: expected \"gelu\" or \"swiglu\", got \"{}\"",
                      r.name(), shortened(mlp));
  if (auto err = r.getString(t, path, "position", position, false))
    return err;
  if (!positionFromString(position, c.position))
    return inputError("{}: $.transformer.position: expected \"learned\" or \"rope\", got "
                      "\"{}\"",
                      r.name(), shortened(position));
  if (t.contains("rope_theta") && c.position != Position::Rope)
    return inputError("{}: $.transformer.rope_theta: applies to \"position\": \"rope\" only",
                      r.name());
  if (auto err = r.getNumber(t, path, "rope_theta", c.ropeTheta, false, 1e-9))
    return err;
  if (auto err = r.getInt(t, path, "num_query_groups", c.numQueryGroups, false, 1))
    return err;
  if (auto err = r.getBool(t, path, "bias", c.bias, false))
    return err;
  if (auto err = r.getNumber(t, path, "norm_eps", c.normEps, false, 1e-12))
    return err;
  if (c.normEps > 0.1)
    return inputError("{}: $.transformer.norm_eps: expected at most 0.1 (checkpoints use 1e-5 or "
                      "1e-6), got {}",
                      r.name(), c.normEps);
  if (c.dtype != "bf16" && c.dtype != "fp16" && c.dtype != "fp32")
    return inputError("{}: $.transformer.dtype: expected \"bf16\", \"fp16\" or \"fp32\", got "
                      "\"{}\"",
                      r.name(), shortened(c.dtype));
  if (c.hiddenSize % c.numAttentionHeads != 0)
    return inputError("{}: $.transformer.num_attention_heads: expected a divisor of hidden_size "
                      "({}), got {}",
                      r.name(), c.hiddenSize, c.numAttentionHeads);
  if (c.numQueryGroups > 0 && c.numAttentionHeads % c.numQueryGroups != 0)
    return inputError("{}: $.transformer.num_query_groups: expected a divisor of "
                      "num_attention_heads ({}), got {}",
                      r.name(), c.numAttentionHeads, c.numQueryGroups);
  if (c.numQueryGroups == c.numAttentionHeads)
    c.numQueryGroups = 0; // one group per head is multi-head attention: written as such
  struct Bound {
    const char *name;
    int64_t value, most;
  } bounds[] = {{"num_layers", c.numLayers, kMaxTransformerLayers},
                {"hidden_size", c.hiddenSize, kMaxHiddenSize},
                {"num_attention_heads", c.numAttentionHeads, kMaxAttentionHeads},
                {"ffn_hidden_size", c.ffnHiddenSize, kMaxFfnHiddenSize},
                {"vocab_size", c.vocabSize, kMaxVocabSize},
                {"seq_length", c.seqLength, kMaxSeqLength},
                {"microbatch_size", c.microbatchSize, kMaxMicrobatchSize}};
  for (const Bound &b : bounds)
    if (b.value > b.most)
      return inputError("{}: $.transformer.{}: expected at most {}, got {}", r.name(), b.name,
                        b.most, b.value);
  double dt = double(c.dtypeBytes());
  double h = double(c.hiddenSize), f = double(c.ffnHiddenSize), v = double(c.vocabSize);
  double kv = double(c.kvHeads()) * (h / double(c.numAttentionHeads)); // K (or V) width
  // A norm's scale, and LayerNorm's shift where the model has biases.
  double normParams = c.norm == Norm::LayerNorm && c.bias ? 2 * h : h;
  Layer emb;
  emb.name = "embedding";
  emb.kind = LayerKind::Embedding;
  // Word embeddings, and the position table where positions are learned.
  emb.paramBytes =
      int64_t(v * h * dt + (c.position == Position::Learned ? double(c.seqLength) * h * dt : 0));
  emb.tpAllReduces = 1; // vocab-parallel lookup ends in an all-reduce
  m.layers.push_back(emb);
  Layer block;
  block.name = "block";
  block.kind = LayerKind::Block;
  // QKV (h·(h + 2kv) + biases), proj (h² + bias), MLP (2hf + f + h for GELU, 3hf + 2f + h
  // for SwiGLU, less the biases without them), two norms. GPT-2: 4h² + 4h + 2hf + f + h + 4h.
  double mlpMatrices = c.mlp == Mlp::SwiGlu ? 3 : 2, mlpBiases = c.mlp == Mlp::SwiGlu ? 2 * f : f;
  double blockParams = h * (h + 2 * kv) + h * h + mlpMatrices * h * f + 2 * normParams;
  if (c.bias)
    blockParams += (h + 2 * kv) + h + mlpBiases + h;
  block.paramBytes = int64_t(blockParams * dt);
  block.tpAllReduces = 2;
  for (int64_t i = 0; i < c.numLayers; ++i)
    m.layers.push_back(block);
  Layer head;
  head.name = "lm_head";
  head.kind = LayerKind::Head;
  head.paramBytes = int64_t((v * h + normParams) * dt); // output embedding + final norm
  head.tpAllReduces = 1;
  m.layers.push_back(head);
  // Megatron mixed precision: 2 (param) + 4 (fp32 grad) + 12 (fp32 master, Adam m and v)
  // = 18 bytes per parameter, i.e. 9 per bf16 parameter byte; 16 / 4 = 4 in fp32.
  m.stateBytesPerParamByte = c.dtype == "fp32" ? 4 : 9;
  m.transformer = c;
  return llvm::Error::success();
}

llvm::Expected<ModelSpec> parseModelSpec(llvm::StringRef text, llvm::StringRef source) {
  JsonReader r(source);
  auto parsed = r.parseObject(text);
  if (!parsed)
    return parsed.takeError();
  const Json &j = *parsed;
  if (auto err = r.onlyKeys(j, "$",
                            {"format", "name", "layers", "transformer", "p2p_time",
                             "allreduce_time", "seq_length", "state_bytes_per_param_byte"}))
    return err;
  std::string format;
  if (auto err = r.getString(j, "$", "format", format, true))
    return err;
  if (format != "pipemodel/1")
    return inputError("{}: $.format: expected \"pipemodel/1\", got \"{}\"", source.str(),
                      shortened(format));
  ModelSpec m;
  m.name = llvm::sys::path::stem(source).str();
  if (auto err = r.getString(j, "$", "name", m.name, false))
    return err;
  bool hasLayers = j.contains("layers"), hasTransformer = j.contains("transformer");
  if (hasLayers == hasTransformer)
    return inputError("{}: $: expected exactly one of \"layers\" (abstract model) or "
                      "\"transformer\", got {}",
                      source.str(), hasLayers ? "both" : "neither");
  if (hasLayers) {
    if (auto err = parseAbstractLayers(r, j, m))
      return err;
  } else {
    for (const char *key : {"p2p_time", "allreduce_time", "seq_length"})
      if (j.contains(key))
        return inputError("{}: $.{}: only abstract models take this field; a transformer model "
                          "takes link times from the cluster spec",
                          source.str(), key);
    if (auto err = parseTransformer(r, j, m))
      return err;
  }
  if (auto err = r.getNumber(j, "$", "state_bytes_per_param_byte", m.stateBytesPerParamByte, false))
    return err;
  return m;
}

llvm::Expected<ClusterSpec> parseClusterSpec(llvm::StringRef text, llvm::StringRef source) {
  JsonReader r(source);
  auto parsed = r.parse(text);
  if (!parsed)
    return parsed.takeError();
  ClusterSpec c = ClusterSpec::defaults();
  if (auto err = parseCluster(r, *parsed, c))
    return err;
  return c;
}

//===----------------------------------------------------------------------===//
// Files
//===----------------------------------------------------------------------===//

llvm::Expected<ModelSpec> loadModelSpec(llvm::StringRef path) {
  auto text = readFile(path, kModelSpecInput);
  if (!text)
    return text.takeError();
  return parseModelSpec(*text, path);
}

llvm::Expected<ClusterSpec> loadClusterSpec(llvm::StringRef path) {
  auto text = readFile(path, kClusterSpecInput);
  if (!text)
    return text.takeError();
  return parseClusterSpec(*text, path);
}

} // namespace pipec
