#include "ir/Model.h"

#include "ir/Error.h"
#include "ir/JsonRead.h"

#include "llvm/Support/FileSystem.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/raw_ostream.h"

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

double ModelSpec::blockForwardFlopsPrefix(int64_t end) const {
  assert(transformer && "FLOP prefix needs a transformer model");
  const TransformerConfig &t = *transformer;
  double h = double(t.hiddenSize), f = double(t.ffnHiddenSize);
  return double(end) * (8 * h * h + 4 * h * f) + 4 * h * causalPositions(0, end);
}

SliceCost ModelSpec::sliceCost(const ClusterSpec &cluster, size_t layerIndex, int64_t begin,
                               int64_t end, int index, int numSlices, int tp) const {
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
  double flopsPerMs = cluster.peakTflops * 1e12 * cluster.achievedFraction / 1e3 * tp;
  double byteScale = double(t.dtypeBytes()) / 2.0; // the formulas are for 2-byte types
  double dt = double(t.dtypeBytes());
  switch (layer.kind) {
  case LayerKind::Embedding:
    // A lookup: no FLOPs to speak of, keeps only token ids.
    c.outputBytes = int64_t(b * x * h * dt);
    return c;
  case LayerKind::Block: {
    double linear = b * x * (8 * h * h + 4 * h * f);
    c.forward = (linear + b * 4 * h * sigma) / flopsPerMs;
    c.backwardInput = (linear + b * 8 * h * sigma) / flopsPerMs;
    c.backwardWeight = linear / flopsPerMs;
    // Korthikanti et al.: 34·b·x·h (10 replicated + 24 sharded by tp) + 5·heads·Σ (sharded).
    c.activationBytes =
        int64_t(byteScale * (b * x * h * (10 + 24.0 / tp) + 5 * heads * b * sigma / tp));
    c.weightGradBytes = int64_t(byteScale * (b * x * h * (8 + 24.0 / tp)));
    c.outputBytes = int64_t(b * x * h * dt);
    return c;
  }
  case LayerKind::Head: {
    double gemm = 2 * b * x * h * v;
    c.forward = gemm / flopsPerMs;
    c.backwardInput = gemm / flopsPerMs;
    c.backwardWeight = gemm / flopsPerMs;
    // fp32 logits (vocab-parallel) for the loss backward, plus the input for dW.
    c.weightGradBytes = int64_t(b * x * h * dt);
    c.activationBytes = int64_t(b * x * v * 4 / tp) + c.weightGradBytes;
    c.outputBytes = 0;
    return c;
  }
  case LayerKind::Abstract:
    break;
  }
  assert(false && "abstract layer in a transformer model");
  return c;
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
  if (auto err = r.onlyKeys(*it, where, {"bandwidth_GBps", "latency_us"}))
    return err;
  if (auto err = r.getNumber(*it, where, "bandwidth_GBps", out.bandwidthGBps, true, 1e-9))
    return err;
  return r.getNumber(*it, where, "latency_us", out.latencyUs, true);
}

static llvm::Error parseCluster(const JsonReader &r, const Json &j, ClusterSpec &c) {
  if (auto err = r.expectObject(j, "$"))
    return err;
  if (auto err =
          r.onlyKeys(j, "$", {"format", "device", "gpus_per_node", "intra_node", "inter_node"}))
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
                              {"name", "peak_tflops", "achieved_fraction", "memory_bytes"}))
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
    if (auto err = r.getInt(*it, "$.device", "memory_bytes", c.memoryBytes, false, 1))
      return err;
  }
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
  if (auto err =
          r.onlyKeys(t, path,
                     {"num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                      "vocab_size", "seq_length", "microbatch_size", "dtype", "tie_embeddings"}))
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
  if (c.dtype != "bf16" && c.dtype != "fp16" && c.dtype != "fp32")
    return inputError("{}: $.transformer.dtype: expected \"bf16\", \"fp16\" or \"fp32\", got "
                      "\"{}\"",
                      r.name(), shortened(c.dtype));
  if (c.hiddenSize % c.numAttentionHeads != 0)
    return inputError("{}: $.transformer.num_attention_heads: expected a divisor of hidden_size "
                      "({}), got {}",
                      r.name(), c.hiddenSize, c.numAttentionHeads);
  struct Bound {
    const char *name;
    int64_t value, most;
  } bounds[] = {{"num_layers", c.numLayers, 100000},
                {"hidden_size", c.hiddenSize, 1 << 20},
                {"num_attention_heads", c.numAttentionHeads, 1 << 16},
                {"ffn_hidden_size", c.ffnHiddenSize, 1 << 22},
                {"vocab_size", c.vocabSize, 1 << 27},
                {"seq_length", c.seqLength, 1 << 27},
                {"microbatch_size", c.microbatchSize, 1 << 20}};
  for (const Bound &b : bounds)
    if (b.value > b.most)
      return inputError("{}: $.transformer.{}: expected at most {}, got {}", r.name(), b.name,
                        b.most, b.value);
  double dt = double(c.dtypeBytes());
  double h = double(c.hiddenSize), f = double(c.ffnHiddenSize), v = double(c.vocabSize);
  Layer emb;
  emb.name = "embedding";
  emb.kind = LayerKind::Embedding;
  emb.paramBytes = int64_t(v * h * dt + double(c.seqLength) * h * dt); // word + position
  emb.tpAllReduces = 1; // vocab-parallel lookup ends in an all-reduce
  m.layers.push_back(emb);
  Layer block;
  block.name = "block";
  block.kind = LayerKind::Block;
  // QKV + proj (4h² + 4h), MLP (2hf + f + h), two layernorms (4h).
  block.paramBytes = int64_t((4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h) * dt);
  block.tpAllReduces = 2;
  for (int64_t i = 0; i < c.numLayers; ++i)
    m.layers.push_back(block);
  Layer head;
  head.name = "lm_head";
  head.kind = LayerKind::Head;
  head.paramBytes = int64_t((v * h + 2 * h) * dt); // untied output embedding + final layernorm
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
  auto parsed = r.parse(text);
  if (!parsed)
    return parsed.takeError();
  const Json &j = *parsed;
  if (auto err = r.expectObject(j, "$"))
    return err;
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
