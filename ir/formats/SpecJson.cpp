#include "ir/formats/SpecJson.h"

#include "ir/formats/JsonRead.h"
#include "ir/support/Error.h"
#include "ir/support/Files.h"
#include "ir/support/Limits.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/Support/Path.h"

#include <fmt/format.h>

#include <algorithm>
#include <utility>

namespace pipec {

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

/// A top-level switch of the cluster spec spelled `on` (true) or `off` (false); absent, `out`
/// keeps its value.
static llvm::Error getSwitch(const JsonReader &r, const Json &j, const char *field, const char *on,
                             const char *off, bool &out) {
  std::string value = out ? on : off;
  if (auto err = r.getString(j, "$", field, value, false))
    return err;
  if (value != on && value != off)
    return inputError("{}: $.{}: expected \"{}\" or \"{}\", got \"{}\"", r.name(), field, on, off,
                      shortened(value));
  out = value == on;
  return llvm::Error::success();
}

/// The cluster spec's optional "calibration" record: {"runs": "...", "held_out_error":
/// {"<schedule>": fraction, ...}}, at most kMaxCalibrationSchedules schedules, each name a
/// schedule's spelling (lower-case letters, digits, '-'), each error in [0, 10].
static llvm::Error parseCalibration(const JsonReader &r, const Json &j, ClusterSpec &c) {
  constexpr size_t kMaxCalibrationSchedules = 64, kMaxScheduleName = 64;
  auto it = j.find("calibration");
  if (it == j.end())
    return llvm::Error::success();
  if (auto err = r.expectObject(*it, "$.calibration"))
    return err;
  if (auto err = r.onlyKeys(*it, "$.calibration", {"runs", "held_out_error"}))
    return err;
  if (auto err = r.getString(*it, "$.calibration", "runs", c.calibrationRuns, false))
    return err;
  auto e = it->find("held_out_error");
  if (e == it->end())
    return llvm::Error::success();
  const char *path = "$.calibration.held_out_error";
  if (auto err = r.expectObject(*e, path))
    return err;
  if (e->size() > kMaxCalibrationSchedules)
    return inputError("{}: {}: expected at most {} schedules, got {}", r.name(), path,
                      kMaxCalibrationSchedules, e->size());
  c.heldOutErrorBySchedule.clear();
  for (auto item = e->begin(); item != e->end(); ++item) {
    const std::string &name = item.key();
    bool spelled = !name.empty() && name.size() <= kMaxScheduleName &&
                   std::all_of(name.begin(), name.end(), [](char ch) {
                     return (ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9') || ch == '-';
                   });
    if (!spelled)
      return inputError("{}: {}: expected schedule names (lower-case letters, digits and '-', "
                        "at most {} characters), got \"{}\"",
                        r.name(), path, kMaxScheduleName, shortened(name));
    double v = -1;
    if (auto err = r.getNumber(*e, path, name, v, true))
      return err;
    if (v > 10)
      return inputError("{}: {}: expected a fraction in [0, 10] (0.05 is 5%), got {}", r.name(),
                        jsonPath(path, name), v);
    c.heldOutErrorBySchedule.emplace_back(name, v);
  }
  return llvm::Error::success();
}

static llvm::Error parseCluster(const JsonReader &r, const Json &j, ClusterSpec &c) {
  if (auto err =
          r.expectDocument(j, "pipecluster/1",
                           {"format", "device", "gpus_per_node", "intra_node", "inter_node",
                            "message_overhead_us", "p2p_sync_us", "p2p", "grad_reduce",
                            "param_gather", "block_kernels", "kept_activations", "calibration"}))
    return err;
  if (auto err = parseCalibration(r, j, c))
    return err;
  if (auto it = j.find("device"); it != j.end()) {
    if (auto err = r.expectObject(*it, "$.device"))
      return err;
    if (auto err = r.onlyKeys(*it, "$.device",
                              {"name", "peak_tflops", "achieved_fraction", "attention_fraction",
                               "flash_attention_fraction", "gemm_half_dim", "gemm_half_intensity",
                               "fp8_gemm_speedup", "memory_GBps", "op_overhead_us",
                               "pass_jitter_us", "memory_bytes"}))
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
    if (auto err = r.getNumber(*it, "$.device", "gemm_half_intensity", c.gemmHalfIntensity, false))
      return err;
    if (auto err = r.getNumber(*it, "$.device", "fp8_gemm_speedup", c.fp8GemmSpeedup, false))
      return err;
    if (it->contains("fp8_gemm_speedup") && (c.fp8GemmSpeedup < 1 || c.fp8GemmSpeedup > 2))
      return inputError("{}: $.device.fp8_gemm_speedup: expected a number in [1, 2] (FP8 GEMMs "
                        "over BF16 ones), got {}",
                        r.name(), c.fp8GemmSpeedup);
    if (auto err = r.getNumber(*it, "$.device", "memory_GBps", c.memoryGBps, false))
      return err;
    // (As the other rates' floors: below it a memory-bound kernel's time overflows a double.)
    if (c.memoryGBps > 0 && c.memoryGBps < 1e-9)
      return inputError("{}: $.device.memory_GBps: expected 0 (memory-bound kernels not timed) "
                        "or a number in [1e-9, 1e15], got {}",
                        r.name(), c.memoryGBps);
    if (auto err = r.getNumber(*it, "$.device", "op_overhead_us", c.opOverheadUs, false))
      return err;
    if (auto err = r.getNumber(*it, "$.device", "pass_jitter_us", c.passJitterUs, false))
      return err;
    if (auto err = r.getInt(*it, "$.device", "memory_bytes", c.memoryBytes, false, 1))
      return err;
  }
  if (auto err = r.getNumber(j, "$", "message_overhead_us", c.messageOverheadUs, false))
    return err;
  if (auto err = r.getNumber(j, "$", "p2p_sync_us", c.p2pSyncUs, false))
    return err;
  std::string p2p = toString(c.p2p).str();
  if (auto err = r.getString(j, "$", "p2p", p2p, false))
    return err;
  if (!p2pFromString(p2p, c.p2p))
    return inputError("{}: $.p2p: expected \"megatron\", \"blocking\" or \"overlapped\", got "
                      "\"{}\"",
                      r.name(), shortened(p2p));
  if (auto err =
          getSwitch(r, j, "grad_reduce", "overlapped", "after-backward", c.overlapGradReduce))
    return err;
  if (auto err = getSwitch(r, j, "param_gather", "overlapped", "after-step", c.overlapParamGather))
    return err;
  if (auto err =
          getSwitch(r, j, "block_kernels", "megatron-legacy", "fused", c.megatronLegacyKernels))
    return err;
  if (auto err = getSwitch(r, j, "kept_activations", "megatron", "piperun", c.megatronActivations))
    return err;
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

/// The fields of a model spec's "transformer" object.
static constexpr llvm::StringRef kTransformerFields[] = {"num_layers",
                                                         "hidden_size",
                                                         "num_attention_heads",
                                                         "ffn_hidden_size",
                                                         "vocab_size",
                                                         "seq_length",
                                                         "microbatch_size",
                                                         "dtype",
                                                         "tie_embeddings",
                                                         "attention",
                                                         "recompute",
                                                         "norm",
                                                         "mlp",
                                                         "position",
                                                         "rope_theta",
                                                         "num_query_groups",
                                                         "bias",
                                                         "norm_eps",
                                                         "gemm_precision",
                                                         "attention_dropout",
                                                         "hidden_dropout"};

/// Hugging Face config.json names (Llama's and GPT-2's) of transformer fields, with pipec's.
static constexpr std::pair<llvm::StringRef, llvm::StringRef> kHfFieldNames[] = {
    {"num_hidden_layers", "num_layers"},
    {"n_layer", "num_layers"},
    {"n_embd", "hidden_size"},
    {"num_heads", "num_attention_heads"},
    {"n_head", "num_attention_heads"},
    {"intermediate_size", "ffn_hidden_size"},
    {"n_inner", "ffn_hidden_size"},
    {"num_key_value_heads", "num_query_groups"},
    {"max_position_embeddings", "seq_length"},
    {"n_positions", "seq_length"},
    {"tie_word_embeddings", "tie_embeddings"},
    {"torch_dtype", "dtype"},
    {"rms_norm_eps", "norm_eps"},
    {"layer_norm_epsilon", "norm_eps"}};

/// pipec's name of a transformer field `key` spelled as a Hugging Face config spells it, or "".
static llvm::StringRef pipecFieldOf(llvm::StringRef key) {
  for (const auto &[hf, ours] : kHfFieldNames)
    if (key == hf)
      return ours;
  return "";
}

static llvm::Error parseTransformer(const JsonReader &r, const Json &j, ModelSpec &m) {
  const Json &t = j["transformer"];
  const char *path = "$.transformer";
  if (auto err = r.expectObject(t, path))
    return err;
  for (auto it = t.begin(); it != t.end(); ++it)
    if (llvm::StringRef ours = pipecFieldOf(it.key()); !ours.empty())
      return inputError("{}: $.transformer.{}: a Hugging Face config's name; pipec's field is "
                        "\"{}\" (pipec spec --from-hf config.json writes the whole spec)",
                        r.name(), it.key(), ours.str());
  if (auto err = r.onlyKeys(t, path, kTransformerFields))
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
  std::string gemmPrecision = "bf16";
  if (auto err = r.getString(t, path, "gemm_precision", gemmPrecision, false))
    return err;
  if (gemmPrecision != "bf16" && gemmPrecision != "fp8")
    return inputError("{}: $.transformer.gemm_precision: expected \"bf16\" or \"fp8\", got "
                      "\"{}\"",
                      r.name(), shortened(gemmPrecision));
  c.fp8Gemms = gemmPrecision == "fp8";
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
  for (auto [key, p] : {std::pair{"attention_dropout", &c.attentionDropout},
                        std::pair{"hidden_dropout", &c.hiddenDropout}}) {
    if (auto err = r.getNumber(t, path, key, *p, false, -1e15))
      return err;
    if (*p < 0 || *p >= 1)
      return inputError("{}: $.transformer.{}: expected a probability in [0, 1), got {}", r.name(),
                        key, *p);
  }
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
  m.setTransformer(c);
  return llvm::Error::success();
}

llvm::Expected<ModelSpec> parseModelSpec(llvm::StringRef text, llvm::StringRef source) {
  JsonReader r(source);
  auto parsed = r.parseObject(text);
  if (!parsed)
    return parsed.takeError();
  const Json &j = *parsed;
  // A transformer's fields written at the top level (or a config.json's): say where they go,
  // before the list of the top level's own fields would.
  auto format = j.find("format");
  bool ours = format == j.end() || (format->is_string() && *format == "pipemodel/1");
  if (ours && !j.contains("layers") && !j.contains("transformer"))
    for (auto it = j.begin(); it != j.end(); ++it)
      if (it.key() != "seq_length" &&
          (llvm::is_contained(kTransformerFields, it.key()) || !pipecFieldOf(it.key()).empty()))
        return inputError("{}: $.{}: a transformer's field at the top level; a transformer "
                          "model's fields go under \"transformer\" ({{\"format\": "
                          "\"pipemodel/1\", \"transformer\": {{\"num_layers\": ...}}}}, as in "
                          "examples/llama3-8b.json; pipec spec --from-hf config.json writes one)",
                          source.str(), it.key());
  if (auto err = r.expectDocument(j, "pipemodel/1",
                                  {"format", "name", "layers", "transformer", "p2p_time",
                                   "allreduce_time", "seq_length", "state_bytes_per_param_byte"}))
    return err;
  ModelSpec m;
  m.name = llvm::sys::path::stem(source).str();
  if (auto err = r.getName(j, "$", "name", m.name, false))
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
