//===- HfConfig.cpp - A Hugging Face config.json as pipec's transformer ------===//
#include "ir/formats/HfConfig.h"

#include "ir/formats/JsonRead.h"
#include "ir/formats/PlanJson.h"
#include "ir/formats/SpecJson.h"
#include "ir/support/Error.h"
#include "ir/support/Files.h"
#include "ir/support/Limits.h"

#include "llvm/Support/FileSystem.h"
#include "llvm/Support/Path.h"

#include <fmt/format.h>

#include <cmath>

namespace pipec {

namespace {

/// A config.json holds a few dozen fields; 1 MiB is plenty.
constexpr InputFormat kHfConfigInput{"a Hugging Face config.json", kMaxHfConfigBytes, 12};

/// Reads config fields by their Hugging Face names: a field may be absent (then the
/// architecture's default, as transformers has it) or null where transformers allows it.
class Fields {
public:
  Fields(const JsonReader &r, const Json &j) : r(r), j(j) {}

  bool has(const char *key) const { return j.contains(key) && !j[key].is_null(); }
  llvm::Error integer(const char *key, int64_t &out, bool required) const {
    if (!has(key))
      return required ? inputError("{}: {}: missing (expected a positive integer)", r.name(), key)
                      : llvm::Error::success();
    return r.getInt(j, "$", key, out, true, 1);
  }
  llvm::Error number(const char *key, double &out) const {
    return has(key) ? r.getNumber(j, "$", key, out, true, 0) : llvm::Error::success();
  }
  llvm::Error boolean(const char *key, bool &out) const {
    return has(key) ? r.getBool(j, "$", key, out, true) : llvm::Error::success();
  }
  llvm::Error string(const char *key, std::string &out) const {
    return has(key) ? r.getString(j, "$", key, out, true) : llvm::Error::success();
  }
  /// Refuse `key` unless it is absent, null or `allowed` (a value the kernels compute).
  llvm::Error onlyIf(const char *key, bool holds, llvm::StringRef why) const {
    if (holds)
      return llvm::Error::success();
    return inputError("{}: {}: {} is not supported: {}", r.name(), key,
                      shortened(j[key].dump(), 60), why);
  }

private:
  const JsonReader &r;
  const Json &j;
};

llvm::Error parseGpt2(const Fields &f, HfModel &m) {
  TransformerConfig &c = m.config;
  if (auto err = f.integer("n_layer", c.numLayers, true))
    return err;
  if (auto err = f.integer("n_embd", c.hiddenSize, true))
    return err;
  if (auto err = f.integer("n_head", c.numAttentionHeads, true))
    return err;
  c.ffnHiddenSize = 4 * c.hiddenSize; // n_inner: null means 4 * n_embd
  if (auto err = f.integer("n_inner", c.ffnHiddenSize, false))
    return err;
  c.seqLength = 1024;
  if (auto err = f.integer("n_positions", c.seqLength, false))
    return err;
  c.tieEmbeddings = true;
  if (auto err = f.boolean("tie_word_embeddings", c.tieEmbeddings))
    return err;
  if (auto err = f.number("layer_norm_epsilon", c.normEps))
    return err;
  std::string act = "gelu_new";
  if (auto err = f.string("activation_function", act))
    return err;
  return f.onlyIf("activation_function", act == "gelu_new" || act == "gelu_pytorch_tanh",
                  "the kernels' GELU is the tanh approximation (gelu_new)");
}

llvm::Error parseLlama(const Fields &f, const Json &j, HfModel &m) {
  TransformerConfig &c = m.config;
  c.norm = Norm::RmsNorm;
  c.mlp = Mlp::SwiGlu;
  c.position = Position::Rope;
  c.bias = false;
  if (auto err = f.integer("num_hidden_layers", c.numLayers, true))
    return err;
  if (auto err = f.integer("hidden_size", c.hiddenSize, true))
    return err;
  if (auto err = f.integer("num_attention_heads", c.numAttentionHeads, true))
    return err;
  if (auto err = f.integer("intermediate_size", c.ffnHiddenSize, true))
    return err;
  int64_t kvHeads = c.numAttentionHeads;
  if (auto err = f.integer("num_key_value_heads", kvHeads, false))
    return err;
  if (c.numAttentionHeads % kvHeads != 0)
    return inputError("{}: num_key_value_heads: {} does not divide num_attention_heads {}", "",
                      kvHeads, c.numAttentionHeads);
  c.numQueryGroups = kvHeads == c.numAttentionHeads ? 0 : kvHeads;
  c.seqLength = m.modelType == "mistral" ? 32768 : 2048;
  if (auto err = f.integer("max_position_embeddings", c.seqLength, false))
    return err;
  c.tieEmbeddings = false;
  if (auto err = f.boolean("tie_word_embeddings", c.tieEmbeddings))
    return err;
  c.normEps = 1e-6;
  if (auto err = f.number("rms_norm_eps", c.normEps))
    return err;
  // rope_theta at the top (transformers 4) or in rope_parameters (transformers 5).
  if (auto err = f.number("rope_theta", c.ropeTheta))
    return err;
  if (f.has("rope_parameters")) {
    const Json &rp = j["rope_parameters"];
    if (!rp.is_object())
      return inputError("{}: rope_parameters: expected an object", "");
    JsonReader nested("rope_parameters");
    Fields p(nested, rp);
    std::string type = "default";
    if (auto err = p.string("rope_type", type))
      return err;
    if (type != "default")
      return inputError("rope_parameters.rope_type: \"{}\" is not supported: the kernels compute "
                        "plain rotary embeddings (\"default\")",
                        shortened(type, 40));
    if (auto err = p.number("rope_theta", c.ropeTheta))
      return err;
  }
  if (auto err = f.onlyIf("rope_scaling", !f.has("rope_scaling"),
                          "the kernels compute plain rotary embeddings, without scaling"))
    return err;
  bool attentionBias = false, mlpBias = false;
  if (auto err = f.boolean("attention_bias", attentionBias))
    return err;
  if (auto err = f.boolean("mlp_bias", mlpBias))
    return err;
  if (auto err = f.onlyIf("attention_bias", !attentionBias,
                          "Llama's block without biases is what the kernels compute"))
    return err;
  if (auto err = f.onlyIf("mlp_bias", !mlpBias,
                          "Llama's block without biases is what the kernels compute"))
    return err;
  std::string act = "silu";
  if (auto err = f.string("hidden_act", act))
    return err;
  if (auto err = f.onlyIf("hidden_act", act == "silu", "the kernels' SwiGLU gates with silu"))
    return err;
  int64_t headDim = c.hiddenSize / c.numAttentionHeads;
  if (auto err = f.integer("head_dim", headDim, false))
    return err;
  // (Without head_dim, heads that do not split hidden_size are refused below, by name.) Compared
  // by division: head_dim and the heads are each up to 2^53, their product past int64.
  if (f.has("head_dim"))
    if (auto err = f.onlyIf("head_dim",
                            c.hiddenSize % c.numAttentionHeads == 0 &&
                                headDim == c.hiddenSize / c.numAttentionHeads,
                            "heads must split hidden_size evenly (head_dim = hidden_size / "
                            "num_attention_heads)"))
      return err;
  if (m.modelType == "mistral")
    if (auto err = f.integer("sliding_window", m.slidingWindow, false))
      return err;
  return llvm::Error::success();
}

/// Prefixes `source: ` to errors raised without it (nested readers).
llvm::Error named(llvm::Error err, llvm::StringRef source) {
  if (!err)
    return err;
  std::string message = takeMessage(std::move(err));
  if (llvm::StringRef(message).startswith(source))
    return inputError("{}", message);
  llvm::StringRef rest(message);
  rest.consume_front(": ");
  return inputError("{}: {}", source.str(), rest.str());
}

} // namespace

llvm::Expected<HfModel> parseHfConfig(llvm::StringRef text, llvm::StringRef source) {
  JsonReader r(source);
  r.keepingLastDuplicate(); // (as transformers' json.load does)
  auto parsed = r.parseObject(text);
  if (!parsed)
    return parsed.takeError();
  const Json &j = *parsed;
  HfModel m;
  Fields f(r, j);
  if (!f.has("model_type"))
    return inputError("{}: model_type: missing (expected \"gpt2\", \"llama\" or \"mistral\")",
                      source.str());
  if (auto err = f.string("model_type", m.modelType))
    return err;
  if (auto err = f.integer("vocab_size", m.config.vocabSize, true))
    return err;
  llvm::Error err = llvm::Error::success();
  if (m.modelType == "gpt2")
    err = parseGpt2(f, m);
  else if (m.modelType == "llama" || m.modelType == "mistral")
    err = parseLlama(f, j, m);
  else
    return inputError("{}: model_type: \"{}\" is not one pipec runs (gpt2, llama, mistral)",
                      source.str(), shortened(m.modelType, 40));
  if (err)
    return named(std::move(err), source);
  if (m.config.numAttentionHeads > m.config.hiddenSize ||
      m.config.hiddenSize % m.config.numAttentionHeads != 0)
    return inputError("{}: {} heads do not split hidden size {} evenly", source.str(),
                      m.config.numAttentionHeads, m.config.hiddenSize);
  return m;
}

llvm::Expected<HfModel> loadHfConfig(llvm::StringRef path) {
  auto text = readFile(path, kHfConfigInput);
  if (!text)
    return text.takeError();
  return parseHfConfig(*text, path);
}

std::string hfDefaultName(const HfModel &hf, llvm::StringRef path) {
  llvm::SmallString<256> dir(llvm::sys::path::parent_path(path)), real;
  if (dir.empty())
    dir = ".";
  std::string name = llvm::sys::fs::real_path(dir, real) ? llvm::sys::path::filename(dir).str()
                                                         : llvm::sys::path::filename(real).str();
  return name.empty() || name == "." || name == "/" ? hf.modelType : name;
}

llvm::Error checkModelAgainstHf(const HfModel &hf, const TransformerConfig &model,
                                llvm::StringRef source) {
  const TransformerConfig &c = hf.config;
  const bool llama = hf.modelType != "gpt2";
  auto differ = [&](const char *hfField, const std::string &hfValue, const char *specField,
                    const std::string &specValue) {
    return inputError("{}: {} is {} but the model spec's {} is {}", source.str(), hfField, hfValue,
                      specField, specValue);
  };
  struct IntField {
    const char *hf, *spec;
    int64_t hfValue, specValue;
  };
  const IntField ints[] = {
      {llama ? "num_hidden_layers" : "n_layer", "num_layers", c.numLayers, model.numLayers},
      {llama ? "hidden_size" : "n_embd", "hidden_size", c.hiddenSize, model.hiddenSize},
      {llama ? "num_attention_heads" : "n_head", "num_attention_heads", c.numAttentionHeads,
       model.numAttentionHeads},
      {"num_key_value_heads", "num_query_groups", c.kvHeads(), model.kvHeads()},
      {llama ? "intermediate_size" : "n_inner", "ffn_hidden_size", c.ffnHiddenSize,
       model.ffnHiddenSize},
      {"vocab_size", "vocab_size", c.vocabSize, model.vocabSize},
  };
  for (const IntField &f : ints)
    if (f.hfValue != f.specValue)
      return differ(f.hf, std::to_string(f.hfValue), f.spec, std::to_string(f.specValue));
  if (c.norm != model.norm || c.mlp != model.mlp || c.position != model.position ||
      c.bias != model.bias)
    return differ("model_type", fmt::format("\"{}\"", hf.modelType), "block",
                  fmt::format("{{\"norm\": \"{}\", \"mlp\": \"{}\", \"position\": \"{}\", "
                              "\"bias\": {}}} (the config's block is norm {}, mlp {}, position "
                              "{}, bias {})",
                              toString(model.norm).str(), toString(model.mlp).str(),
                              toString(model.position).str(), model.bias, toString(c.norm).str(),
                              toString(c.mlp).str(), toString(c.position).str(), c.bias));
  if (c.normEps != model.normEps)
    return differ(llama ? "rms_norm_eps" : "layer_norm_epsilon", fmt::format("{}", c.normEps),
                  "norm_eps", fmt::format("{}", model.normEps));
  if (c.position == Position::Rope && c.ropeTheta != model.ropeTheta)
    return differ("rope_theta", fmt::format("{}", c.ropeTheta), "rope_theta",
                  fmt::format("{}", model.ropeTheta));
  if (c.tieEmbeddings != model.tieEmbeddings)
    return differ("tie_word_embeddings", c.tieEmbeddings ? "true" : "false", "tie_embeddings",
                  model.tieEmbeddings ? "true" : "false");
  if (c.position == Position::Learned && model.seqLength > c.seqLength)
    return differ("n_positions", std::to_string(c.seqLength), "seq_length",
                  fmt::format("{} (learned positions: at most n_positions)", model.seqLength));
  if (hf.slidingWindow > 0 && model.seqLength > hf.slidingWindow)
    return differ("sliding_window", std::to_string(hf.slidingWindow), "seq_length",
                  fmt::format("{} (the kernels attend to every earlier token: at most the "
                              "window)",
                              model.seqLength));
  return llvm::Error::success();
}

llvm::Expected<std::string> hfModelSpecJson(const HfModel &hf, llvm::StringRef name,
                                            int64_t seqLength, int64_t microbatchSize,
                                            llvm::StringRef source) {
  if (hasControlCharacter(name))
    return inputError("--name: expected a name without control characters, got '{}'",
                      shortened(name));
  TransformerConfig t = hf.config;
  if (seqLength > 0)
    t.seqLength = seqLength;
  t.microbatchSize = microbatchSize;
  if (auto err = checkModelAgainstHf(hf, t, source))
    return inputError("--seq-length {}: {}", t.seqLength, takeMessage(std::move(err)));
  std::string text = modelSpecJson(name, t);
  // The spec must parse back as pipec reads specs (the group and size rules, the limits).
  if (auto parsed = parseModelSpec(text, source); !parsed)
    return parsed.takeError();
  return text;
}

llvm::Expected<std::string> hfConfigJson(const TransformerConfig &t) {
  using OJson = nlohmann::ordered_json;
  const bool gpt2 = t.norm == Norm::LayerNorm && t.mlp == Mlp::Gelu &&
                    t.position == Position::Learned && t.kvHeads() == t.numAttentionHeads && t.bias;
  const bool llama =
      t.norm == Norm::RmsNorm && t.mlp == Mlp::SwiGlu && t.position == Position::Rope && !t.bias;
  OJson j;
  if (gpt2) {
    j = OJson{{"architectures", {"GPT2LMHeadModel"}},
              {"model_type", "gpt2"},
              {"vocab_size", t.vocabSize},
              {"n_positions", t.seqLength},
              {"n_embd", t.hiddenSize},
              {"n_layer", t.numLayers},
              {"n_head", t.numAttentionHeads},
              {"n_inner", t.ffnHiddenSize},
              {"activation_function", "gelu_new"},
              {"layer_norm_epsilon", t.normEps},
              {"tie_word_embeddings", t.tieEmbeddings}};
  } else if (llama) {
    j = OJson{{"architectures", {"LlamaForCausalLM"}},
              {"model_type", "llama"},
              {"vocab_size", t.vocabSize},
              {"max_position_embeddings", t.seqLength},
              {"hidden_size", t.hiddenSize},
              {"intermediate_size", t.ffnHiddenSize},
              {"num_hidden_layers", t.numLayers},
              {"num_attention_heads", t.numAttentionHeads},
              {"num_key_value_heads", t.kvHeads()},
              {"head_dim", t.hiddenSize / t.numAttentionHeads},
              {"hidden_act", "silu"},
              {"rms_norm_eps", t.normEps},
              // transformers 4 reads rope_theta, 5 rope_parameters.
              {"rope_theta", t.ropeTheta},
              {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", t.ropeTheta}}},
              {"attention_bias", false},
              {"mlp_bias", false},
              {"tie_word_embeddings", t.tieEmbeddings}};
  } else {
    return inputError("--export-hf: the model's block ({}) is neither GPT-2's nor Llama's, which "
                      "transformers loads",
                      t.variantText());
  }
  j["dtype"] = "float32";
  j["torch_dtype"] = "float32";
  return j.dump(2) + "\n";
}

} // namespace pipec
