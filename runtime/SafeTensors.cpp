//===- SafeTensors.cpp - Initial weights from a safetensors file ------------===//
#include "runtime/SafeTensors.h"

#include "ir/formats/HfConfig.h"
#include "ir/formats/JsonRead.h"
#include "ir/support/Error.h"
#include "ir/support/Files.h"
#include "ir/support/Limits.h"
#include "ir/support/Memory.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/Support/FileSystem.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <bit>
#include <cassert>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fmt/format.h>
#include <memory>
#include <set>
#include <span>

namespace pipec {

namespace {

/// Header of at most 100 MB (Hugging Face's own limit); tensor data up to 1 TiB.
constexpr uint64_t kMaxHeader = uint64_t(100) << 20;
constexpr int kMaxHeaderDepth = 3;
constexpr InputFormat kSafetensorsInput{"a safetensors file", kMaxSafetensorsBytes, 0};
/// A sharded checkpoint's index: a weight_map of a few thousand names.
constexpr InputFormat kSafetensorsIndexInput{"a safetensors index", kMaxSafetensorsIndexBytes, 12};

size_t dtypeSize(const std::string &dtype) {
  if (dtype == "F64" || dtype == "I64" || dtype == "U64")
    return 8;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32")
    return 4;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16")
    return 2;
  if (dtype == "I8" || dtype == "U8" || dtype == "BOOL" || dtype == "F8_E4M3" || dtype == "F8_E5M2")
    return 1;
  return 0;
}

struct FileCloser {
  void operator()(std::FILE *f) const { std::fclose(f); }
};
using File = std::unique_ptr<std::FILE, FileCloser>;

float halfToFloat(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else { // subnormal: normalise
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while ((man & 0x400) == 0);
      bits = sign | uint32_t(127 - 15 - e) << 23 | (man & 0x3FF) << 13;
    }
  } else if (exp == 0x1F) {
    bits = sign | 0x7F800000u | man << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | man << 13;
  }
  return std::bit_cast<float>(bits);
}

/// The reference library's rule: sorted by offset, the tensors' data ranges follow each other
/// from byte 0 of the data section to its end, with nothing between or after them.
llvm::Error checkTiling(llvm::StringRef path, const std::map<std::string, SafeTensor> &entries,
                        uint64_t dataSize) {
  std::vector<std::pair<const std::string *, const SafeTensor *>> byOffset;
  for (const auto &[name, t] : entries)
    byOffset.emplace_back(&name, &t);
  std::sort(byOffset.begin(), byOffset.end(), [](const auto &a, const auto &b) {
    return std::tie(a.second->begin, a.second->end) < std::tie(b.second->begin, b.second->end);
  });
  uint64_t next = 0;
  const std::string *previous = nullptr;
  for (auto [name, t] : byOffset) {
    if (t->begin < next)
      return inputError("{}: tensors {} and {} overlap (data [{}, {}) and [{}, {}))", path.str(),
                        shortened(*previous), shortened(*name), entries.at(*previous).begin,
                        entries.at(*previous).end, t->begin, t->end);
    if (t->begin > next)
      return inputError("{}: data bytes [{}, {}) before tensor {} belong to no tensor (the format "
                        "packs tensors back to back)",
                        path.str(), next, t->begin, shortened(*name));
    next = t->end;
    previous = name;
  }
  if (next != dataSize)
    return inputError("{}: the last {} bytes of data belong to no tensor", path.str(),
                      dataSize - next);
  return llvm::Error::success();
}

} // namespace

std::string shapeText(const std::vector<int64_t> &shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

llvm::Expected<SafeTensorsFile> SafeTensorsFile::open(llvm::StringRef path) {
  bool regular = false;
  if (auto err = checkInputFile(path, kSafetensorsInput, regular))
    return err;
  if (!regular)
    return inputError("{}: a pipe; the tensors are read at their offsets, so give a file",
                      path.str());
  File f(std::fopen(path.str().c_str(), "rb"));
  if (!f)
    return inputError("{}: cannot read: {}", path.str(), std::strerror(errno));
  std::fseek(f.get(), 0, SEEK_END);
  const long sizeL = std::ftell(f.get());
  std::fseek(f.get(), 0, SEEK_SET);
  const uint64_t size = sizeL < 0 ? 0 : uint64_t(sizeL);
  unsigned char lenBytes[8];
  if (size < 8 || std::fread(lenBytes, 1, 8, f.get()) != 8)
    return inputError("{}: not a safetensors file ({} bytes; it starts with an 8-byte header "
                      "length)",
                      path.str(), size);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i)
    n = n << 8 | lenBytes[i];
  if (n > kMaxHeader || n > size - 8)
    return inputError("{}: not a safetensors file (its header length {} is past {})", path.str(), n,
                      n > kMaxHeader ? "the format's 100 MB" : "the end of the file");
  std::string header(size_t(n), '\0');
  if (std::fread(header.data(), 1, header.size(), f.get()) != header.size())
    return inputError("{}: cannot read its header", path.str());
  // (The JSON parser would stop at a NUL and take the rest, padding or not, as read; the
  // format pads a header with spaces, and its reference library refuses anything else.)
  if (size_t nul = header.find('\0'); nul != std::string::npos)
    return inputError("{}: its header holds a NUL byte at offset {} (the format pads a header "
                      "with spaces)",
                      path.str(), 8 + nul);
  // The format nests three levels ({name: {"shape": [...]}}); a deeper header is refused before
  // it is built into a tree (a 100 MB run of brackets would take gigabytes).
  {
    int depth = 0;
    bool inString = false;
    for (size_t i = 0; i < header.size(); ++i) {
      const char c = header[i];
      if (inString) {
        if (c == '\\')
          ++i;
        else if (c == '"')
          inString = false;
      } else if (c == '"') {
        inString = true;
      } else if (c == '{' || c == '[') {
        if (++depth > kMaxHeaderDepth)
          return inputError("{}: its header nests deeper than the format's {} levels", path.str(),
                            kMaxHeaderDepth);
      } else if (c == '}' || c == ']') {
        --depth;
      }
    }
  }
  // JSON keeps the last of two equal keys; the format's reference library refuses them, and so
  // does this reader (two entries for one name could hold different data).
  std::set<std::string> names;
  std::string twice;
  Json j = Json::parse(
      header,
      [&](int depth, Json::parse_event_t event, Json &parsed) {
        if (event == Json::parse_event_t::key && depth == 1 && twice.empty() &&
            !names.insert(parsed.get<std::string>()).second)
          twice = parsed.get<std::string>();
        return true;
      },
      /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object())
    return inputError("{}: its header is not a JSON object", path.str());
  if (!twice.empty())
    return inputError("{}: tensor {} appears twice in the header", path.str(), shortened(twice));
  SafeTensorsFile out;
  out.shards.push_back({path.str(), 8 + n});
  const uint64_t dataSize = size - out.shards[0].dataStart;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string &name = it.key();
    if (name == "__metadata__") {
      // The format's free-form part: strings only (the reference library refuses anything else).
      const Json &meta = it.value();
      if (!meta.is_object() ||
          !std::all_of(meta.begin(), meta.end(), [](const Json &v) { return v.is_string(); }))
        return inputError("{}: __metadata__: expected an object of strings such as "
                          "{{\"format\": \"pt\"}}",
                          path.str());
      continue;
    }
    const Json &e = it.value();
    auto bad = [&](const char *what) {
      return inputError("{}: tensor {}: {}", path.str(), shortened(name), what);
    };
    if (!e.is_object())
      return bad("expected an object with dtype, shape and data_offsets");
    auto dtype = e.find("dtype"), shape = e.find("shape"), offsets = e.find("data_offsets");
    if (dtype == e.end() || !dtype->is_string())
      return bad("dtype: expected a string such as \"F32\"");
    if (shape == e.end() || !shape->is_array() || shape->size() > 8)
      return bad("shape: expected an array of at most 8 sizes");
    if (offsets == e.end() || !offsets->is_array() || offsets->size() != 2 ||
        !(*offsets)[0].is_number_unsigned() || !(*offsets)[1].is_number_unsigned())
      return bad("data_offsets: expected [begin, end] in bytes");
    SafeTensor t;
    t.dtype = dtype->get<std::string>();
    uint64_t elements = 1;
    for (const Json &d : *shape) {
      if (!d.is_number_unsigned() || d.get<uint64_t>() > kMaxTensorElements)
        return bad("shape: expected sizes >= 0 (and below 2^40)");
      const uint64_t size = d.get<uint64_t>();
      t.shape.push_back(int64_t(size));
      if (size != 0 && elements > kMaxTensorElements / size)
        return bad("shape: more than 2^40 elements");
      elements *= size;
    }
    t.begin = (*offsets)[0].get<uint64_t>();
    t.end = (*offsets)[1].get<uint64_t>();
    if (t.begin > t.end || t.end > dataSize)
      return inputError("{}: tensor {}: data_offsets [{}, {}] are not inside the {} bytes of "
                        "data",
                        path.str(), shortened(name), t.begin, t.end, dataSize);
    const size_t width = dtypeSize(t.dtype);
    if (width == 0)
      return inputError("{}: tensor {}: unknown dtype \"{}\"", path.str(), shortened(name),
                        shortened(t.dtype));
    if (t.end - t.begin != elements * width)
      return inputError("{}: tensor {}: {} bytes for shape {} of {} ({} expected)", path.str(),
                        shortened(name), t.end - t.begin, shapeText(t.shape), t.dtype,
                        elements * width);
    out.entries.emplace(name, std::move(t));
  }
  if (auto err = checkTiling(path, out.entries, dataSize))
    return err;
  return out;
}

llvm::Expected<SafeTensorsFile> SafeTensorsFile::openShards(llvm::ArrayRef<std::string> paths) {
  SafeTensorsFile out;
  for (const std::string &path : paths) {
    auto shard = open(path);
    if (!shard)
      return shard.takeError();
    for (auto &[name, t] : shard->entries) {
      auto [at, added] = out.entries.emplace(name, t);
      if (!added)
        return inputError("{}: tensor {} is in {} too", path, shortened(name),
                          out.pathOf(at->second));
      at->second.shard = uint32_t(out.shards.size());
    }
    out.shards.push_back(shard->shards[0]);
  }
  return out;
}

llvm::Expected<std::vector<float>> SafeTensorsFile::read(const std::string &name) const {
  return read(name, UINT64_MAX);
}

llvm::Expected<std::vector<float>> SafeTensorsFile::read(const std::string &name,
                                                         uint64_t most) const {
  auto it = entries.find(name);
  if (it == entries.end())
    return inputError("{}: no tensor {}", shards.empty() ? "" : shards[0].path, shortened(name));
  const SafeTensor &t = it->second;
  const std::string &path = shards[t.shard].path;
  const uint64_t dataStart = shards[t.shard].dataStart;
  const size_t width = dtypeSize(t.dtype);
  if (t.dtype != "F32" && t.dtype != "F16" && t.dtype != "BF16" && t.dtype != "F64")
    return inputError("{}: tensor {} is {}; initial weights are read from F32, F16, BF16 or F64",
                      path, shortened(name), t.dtype);
  const size_t count = size_t(std::min<uint64_t>((t.end - t.begin) / width, most));
  if (auto err =
          checkMemoryBudget(uint64_t(count) * (width + sizeof(float)),
                            fmt::format("{}: tensor {} ({} values)", path, shortened(name), count),
                            "use a machine with more memory"))
    return err;
  std::vector<unsigned char> raw(count * width);
  File f(std::fopen(path.c_str(), "rb"));
  if (!f || std::fseek(f.get(), long(dataStart + t.begin), SEEK_SET) != 0 ||
      std::fread(raw.data(), 1, raw.size(), f.get()) != raw.size())
    return inputError("{}: cannot read tensor {}", path, shortened(name));
  std::vector<float> out(count);
  for (size_t i = 0; i < count; ++i) {
    const unsigned char *b = raw.data() + i * width;
    if (t.dtype == "F32") {
      uint32_t v =
          uint32_t(b[0]) | uint32_t(b[1]) << 8 | uint32_t(b[2]) << 16 | uint32_t(b[3]) << 24;
      out[i] = std::bit_cast<float>(v);
    } else if (t.dtype == "F64") {
      uint64_t v = 0;
      for (int k = 7; k >= 0; --k)
        v = v << 8 | b[k];
      out[i] = float(std::bit_cast<double>(v));
    } else if (t.dtype == "BF16") {
      out[i] = std::bit_cast<float>(uint32_t(b[0]) << 16 | uint32_t(b[1]) << 24);
    } else {
      out[i] = halfToFloat(uint16_t(b[0] | b[1] << 8));
    }
    if (!std::isfinite(out[i]))
      return inputError("{}: tensor {} holds a value that is not a finite fp32 number at element "
                        "{}",
                        path, shortened(name), i);
  }
  return out;
}

namespace {
/// The blocks whose checkpoint names the loader knows (any norm_eps).
bool hasGpt2Block(const kernels::GptConfig &c) {
  return !c.rmsnorm && !c.swiglu && !c.rope && c.kvHeadCount() == c.heads && c.bias;
}
bool hasLlamaBlock(const kernels::GptConfig &c) {
  return c.rmsnorm && c.swiglu && c.rope && !c.bias;
}
std::string variantsOf(const kernels::GptConfig &c) {
  return fmt::format("\"norm\": \"{}\", \"mlp\": \"{}\", \"position\": \"{}\", "
                     "\"bias\": {}",
                     c.rmsnorm ? "rmsnorm" : "layernorm", c.swiglu ? "swiglu" : "gelu",
                     c.rope ? "rope" : "learned", c.bias ? "true" : "false");
}

/// A tensor of shape `want` read whole, or an InputError naming it and both shapes.
llvm::Expected<std::vector<float>> readShaped(const SafeTensorsFile &file, const std::string &name,
                                              const std::vector<int64_t> &want,
                                              llvm::StringRef model) {
  auto it = file.tensors().find(name);
  if (it == file.tensors().end())
    return inputError("missing tensor {} (shape {}) of {}", name, shapeText(want), model.str());
  if (it->second.shape != want)
    return inputError("tensor {} has shape {}; the model needs {}", name,
                      shapeText(it->second.shape), shapeText(want));
  return file.read(name);
}

/// Appends `m` ([rows, cols], Hugging Face's nn.Linear [out, in]) transposed to `to`'s
/// columns [at, at + rows) of a row-major [cols, width] matrix (the kernels' [in, out]).
void placeTransposed(const std::vector<float> &m, int64_t rows, int64_t cols,
                     std::vector<float> &to, size_t toBegin, int64_t width, int64_t at) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      to[toBegin + size_t(c * width + at + r)] = m[size_t(r * cols + c)];
}

/// Appends the LM head's matrix to `head`. With tied embeddings it is the embedding `emb`
/// ([V, C]); a lm_head.weight in the file, Hugging Face's copy of it, must equal it. Untied, it
/// is the file's lm_head.weight. `embName` names the embedding, `tieHint` how a model ties.
llvm::Error appendLmHead(const SafeTensorsFile &file, const kernels::GptConfig &cfg,
                         std::span<const float> emb, const std::string &embName,
                         llvm::StringRef tieHint, llvm::StringRef model, std::vector<float> &head,
                         std::set<std::string> &used) {
  const std::vector<int64_t> shape{cfg.vocab, cfg.channels};
  const bool inFile = file.tensors().count("lm_head.weight") > 0;
  if (!cfg.tiedEmbeddings && !inFile)
    return inputError("missing tensor lm_head.weight (shape {}): the model's head is untied "
                      "(\"tie_embeddings\": false); add the tensor, or tie the model's "
                      "embeddings {}",
                      shapeText(shape), tieHint.str());
  if (cfg.tiedEmbeddings)
    head.insert(head.end(), emb.begin(), emb.end());
  if (!inFile)
    return llvm::Error::success();
  auto lm = readShaped(file, "lm_head.weight", shape, model);
  if (!lm)
    return lm.takeError();
  used.insert("lm_head.weight");
  if (!cfg.tiedEmbeddings)
    head.insert(head.end(), lm->begin(), lm->end());
  else if (!std::equal(lm->begin(), lm->end(), emb.begin()))
    return inputError("tensor lm_head.weight differs from {}, but the model ties its embeddings "
                      "(\"tie_embeddings\": true); untie the model to use the file's head",
                      embName);
  return llvm::Error::success();
}
} // namespace

llvm::Expected<std::vector<std::vector<float>>> gpt2Layers(const SafeTensorsFile &file,
                                                           const kernels::GptConfig &cfg) {
  const auto &all = file.tensors();
  // Hugging Face's GPT2LMHeadModel prefixes the body "transformer."; GPT2Model does not.
  const std::string prefix = all.count("transformer.wte.weight") ? "transformer." : "";
  if (!hasGpt2Block(cfg))
    return inputError("the model's block is not GPT-2's: GPT-2 checkpoints load into "
                      "\"norm\": \"layernorm\", \"mlp\": \"gelu\", \"position\": "
                      "\"learned\", multi-head attention and biases");
  if (all.count("model.embed_tokens.weight") || all.count("embed_tokens.weight"))
    return inputError("the file has a Llama checkpoint's tensor names (embed_tokens.weight), but "
                      "the model's block is GPT-2's; give the model Llama's block (\"norm\": "
                      "\"rmsnorm\", \"mlp\": \"swiglu\", \"position\": \"rope\", "
                      "\"bias\": false) or load a GPT-2 checkpoint");
  const int64_t C = cfg.channels, V = cfg.vocab, T = cfg.seqLen, F = cfg.ffn;
  std::set<std::string> used;
  std::vector<std::vector<float>> layers(size_t(cfg.numLayers()));
  // Appends tensor `name` of shape `want` (its first rows only where `firstRows`) to `to`.
  auto take = [&](const std::string &name, std::vector<int64_t> want, std::vector<float> &to,
                  bool firstRows = false) -> llvm::Error {
    auto it = all.find(name);
    if (it == all.end())
      return inputError("missing tensor {} (shape {}) of a GPT-2 model with {} blocks", name,
                        shapeText(want), cfg.layers);
    const std::vector<int64_t> &got = it->second.shape;
    bool fits = got == want;
    if (!fits && firstRows && got.size() == want.size() && got[0] >= want[0])
      fits = std::equal(got.begin() + 1, got.end(), want.begin() + 1);
    if (!fits)
      return inputError("tensor {} has shape {}; the model needs {}{}", name, shapeText(got),
                        shapeText(want), firstRows ? " (or more rows)" : "");
    size_t count = 1;
    for (int64_t d : want)
      count *= size_t(d);
    // Only the rows the model uses are read (GPT-2's wpe holds 1,024 positions, maybe more).
    auto values = file.read(name, count);
    if (!values)
      return values.takeError();
    if (values->size() < count)
      return inputError("tensor {} holds {} values; the model needs {}", name, values->size(),
                        count);
    to.insert(to.end(), values->begin(), values->begin() + long(count));
    used.insert(name);
    return llvm::Error::success();
  };
  auto build = [&]() -> llvm::Error {
    // Embedding: wte [V, C], wpe [T, C].
    if (auto err = take(prefix + "wte.weight", {V, C}, layers[0]))
      return err;
    if (auto err = take(prefix + "wpe.weight", {T, C}, layers[0], /*firstRows=*/true))
      return err;
    for (int b = 0; b < cfg.layers; ++b) {
      const std::string h = fmt::format("{}h.{}.", prefix, b);
      std::vector<float> &to = layers[size_t(b + 1)];
      const std::pair<const char *, std::vector<int64_t>> order[] = {
          {"ln_1.weight", {C}},
          {"ln_1.bias", {C}},
          {"attn.c_attn.weight", {C, 3 * C}},
          {"attn.c_attn.bias", {3 * C}},
          {"attn.c_proj.weight", {C, C}},
          {"attn.c_proj.bias", {C}},
          {"ln_2.weight", {C}},
          {"ln_2.bias", {C}},
          {"mlp.c_fc.weight", {C, F}},
          {"mlp.c_fc.bias", {F}},
          {"mlp.c_proj.weight", {F, C}},
          {"mlp.c_proj.bias", {C}}};
      for (const auto &[name, shape] : order)
        if (auto err = take(h + name, shape, to))
          return err;
    }
    std::vector<float> &head = layers.back();
    if (auto err = take(prefix + "ln_f.weight", {C}, head))
      return err;
    if (auto err = take(prefix + "ln_f.bias", {C}, head))
      return err;
    return appendLmHead(file, cfg, std::span<const float>(layers[0]).first(size_t(V * C)),
                        prefix + "wte.weight", "as GPT-2 does",
                        fmt::format("a GPT-2 model with {} blocks", cfg.layers), head, used);
  };
  if (auto err = build())
    return err;
  for (const auto &[name, t] : all) {
    if (used.count(name))
      continue;
    llvm::StringRef n = name;
    // The causal mask (h.N.attn.bias, [1, 1, n, n]) and its fill value (h.N.attn.masked_bias,
    // a scalar) are buffers, not parameters.
    if (n.startswith(prefix + "h.") && ((n.endswith(".attn.bias") && t.shape.size() == 4) ||
                                        (n.endswith(".attn.masked_bias") && t.shape.size() <= 4)))
      continue;
    return inputError("extra tensor {} (shape {}) is not a parameter of a GPT-2 model with {} "
                      "blocks",
                      shortened(name), shapeText(t.shape), cfg.layers);
  }
  for (int l = 0; l < cfg.numLayers(); ++l)
    if (layers[size_t(l)].size() != kernels::layerParamCount(cfg, l, 1))
      return inputError("layer {} holds {} values, the kernels' {}", l, layers[size_t(l)].size(),
                        kernels::layerParamCount(cfg, l, 1));
  return layers;
}

llvm::Expected<std::vector<std::vector<float>>> llamaLayers(const SafeTensorsFile &file,
                                                            const kernels::GptConfig &cfg) {
  const auto &all = file.tensors();
  // LlamaForCausalLM prefixes the body "model."; LlamaModel does not.
  const std::string prefix = all.count("embed_tokens.weight") ? "" : "model.";
  if (!hasLlamaBlock(cfg))
    return inputError("the model's block is not Llama's: Llama checkpoints load into \"norm\": "
                      "\"rmsnorm\", \"mlp\": \"swiglu\", \"position\": \"rope\" and "
                      "\"bias\": false");
  if (all.count("wte.weight") || all.count("transformer.wte.weight"))
    return inputError("the file has GPT-2's tensor names (wte.weight), but the model's block is "
                      "Llama's; load a Llama checkpoint (model.embed_tokens.weight, "
                      "model.layers.N.self_attn.q_proj.weight, ...) or give the model GPT-2's "
                      "block");
  const int64_t C = cfg.channels, V = cfg.vocab, F = cfg.ffn;
  const int64_t K = int64_t(cfg.kvHeadCount()) * (C / cfg.heads); // k_proj's and v_proj's rows
  const std::string model = fmt::format("a Llama model with {} blocks", cfg.layers);
  std::set<std::string> used;
  std::vector<std::vector<float>> layers(size_t(cfg.numLayers()));
  auto read = [&](const std::string &name,
                  std::vector<int64_t> want) -> llvm::Expected<std::vector<float>> {
    auto values = readShaped(file, name, want, model);
    if (values)
      used.insert(name);
    return values;
  };
  auto build = [&]() -> llvm::Error {
    auto emb = read(prefix + "embed_tokens.weight", {V, C});
    if (!emb)
      return emb.takeError();
    layers[0] = std::move(*emb);
    for (int b = 0; b < cfg.layers; ++b) {
      const std::string h = fmt::format("{}layers.{}.", prefix, b);
      std::vector<float> &to = layers[size_t(b + 1)];
      // The kernels' order (Gpt.h): ln1.w, qkv.w [C, C + 2K], attn.w [C, C], ln2.w,
      // fc.w [C, 2F] (gate | up), proj.w [F, C].
      to.assign(kernels::layerParamCount(cfg, b + 1, 1), 0.0f);
      size_t at = 0;
      auto vec = [&](const std::string &name) -> llvm::Error {
        auto v = read(h + name, {C});
        if (!v)
          return v.takeError();
        std::copy(v->begin(), v->end(), to.begin() + long(at));
        at += size_t(C);
        return llvm::Error::success();
      };
      // Linear layers [out, in] side by side as the columns of one [in, sum of outs] matrix.
      auto matrices = [&](std::initializer_list<std::pair<const char *, int64_t>> parts,
                          int64_t in) -> llvm::Error {
        int64_t width = 0;
        for (const auto &part : parts)
          width += part.second;
        int64_t col = 0;
        for (const auto &[name, out] : parts) {
          auto m = read(h + name, {out, in});
          if (!m)
            return m.takeError();
          placeTransposed(*m, out, in, to, at, width, col);
          col += out;
        }
        at += size_t(in * width);
        return llvm::Error::success();
      };
      if (auto err = vec("input_layernorm.weight"))
        return err;
      if (auto err = matrices({{"self_attn.q_proj.weight", C},
                               {"self_attn.k_proj.weight", K},
                               {"self_attn.v_proj.weight", K}},
                              C))
        return err;
      if (auto err = matrices({{"self_attn.o_proj.weight", C}}, C))
        return err;
      if (auto err = vec("post_attention_layernorm.weight"))
        return err;
      if (auto err = matrices({{"mlp.gate_proj.weight", F}, {"mlp.up_proj.weight", F}}, C))
        return err;
      if (auto err = matrices({{"mlp.down_proj.weight", C}}, F))
        return err;
      assert(at == to.size() && "the Llama block's layout and the kernels' disagree");
    }
    std::vector<float> &head = layers.back();
    auto norm = read(prefix + "norm.weight", {C});
    if (!norm)
      return norm.takeError();
    head = std::move(*norm);
    return appendLmHead(file, cfg, layers[0], prefix + "embed_tokens.weight",
                        "(\"tie_embeddings\": true, as tie_word_embeddings does)", model, head,
                        used);
  };
  if (auto err = build())
    return err;
  for (const auto &[name, t] : all) {
    if (used.count(name))
      continue;
    // Older files carry the rotary frequencies as a buffer: not a parameter.
    if (llvm::StringRef(name).endswith(".self_attn.rotary_emb.inv_freq"))
      continue;
    return inputError("extra tensor {} (shape {}) is not a parameter of {}", shortened(name),
                      shapeText(t.shape), model);
  }
  for (int l = 0; l < cfg.numLayers(); ++l)
    if (layers[size_t(l)].size() != kernels::layerParamCount(cfg, l, 1))
      return inputError("layer {} holds {} values, the kernels' {}", l, layers[size_t(l)].size(),
                        kernels::layerParamCount(cfg, l, 1));
  return layers;
}

llvm::Expected<SafeTensorsFile> openHfDirectory(llvm::StringRef dir,
                                                const TransformerConfig &model) {
  auto inDir = [&](llvm::StringRef name) { return (dir + "/" + name).str(); };
  const std::string configPath = inDir("config.json");
  if (!llvm::sys::fs::exists(configPath))
    return inputError("no config.json: a Hugging Face model directory holds config.json and "
                      "model.safetensors (or its shards with model.safetensors.index.json)");
  // A directory's files are files (a symbolic link to one, as a hub snapshot holds, included):
  // a pipe there would wait for a writer that never comes.
  for (const std::string &path : {configPath, inDir("model.safetensors.index.json")})
    if (std::string kind = specialFileKind(path); !kind.empty())
      return inputError("{}: is {}, not a file of a model directory (give a regular file)", path,
                        kind);
  auto hf = loadHfConfig(configPath);
  if (!hf)
    return hf.takeError();
  if (auto err = checkModelAgainstHf(*hf, model, configPath))
    return err;
  const std::string indexPath = inDir("model.safetensors.index.json");
  if (!llvm::sys::fs::exists(indexPath)) {
    if (!llvm::sys::fs::exists(inDir("model.safetensors")))
      return inputError("neither model.safetensors nor model.safetensors.index.json is there");
    return SafeTensorsFile::open(inDir("model.safetensors"));
  }
  // The index: {"metadata": {...}, "weight_map": {"tensor name": "shard file name", ...}}.
  auto text = readFile(indexPath, kSafetensorsIndexInput);
  if (!text)
    return text.takeError();
  JsonReader r(indexPath);
  r.keepingLastDuplicate(); // (as transformers' json.load does)
  auto index = r.parse(*text);
  if (!index)
    return index.takeError();
  if (auto err = r.expectObject(*index, "$"))
    return err;
  if (!index->contains("weight_map"))
    return inputError("{}: $.weight_map: missing (expected an object of tensor name: shard file)",
                      indexPath);
  const Json &map = (*index)["weight_map"];
  if (auto err = r.expectObject(map, "$.weight_map"))
    return err;
  std::map<std::string, std::string> shardOf;
  std::vector<std::string> files;
  for (auto it = map.begin(); it != map.end(); ++it) {
    llvm::StringRef file;
    if (it.value().is_string())
      file = it.value().get_ref<const std::string &>();
    // Shards are files of this directory, named plainly (and printably: the name is in errors).
    if (file.empty() || file.contains('/') || file == "." || file == ".." ||
        hasControlCharacter(file))
      return inputError("{}: $.weight_map[\"{}\"]: expected the name of a shard file in the "
                        "directory, got {}",
                        indexPath, shortened(it.key()), shortened(describeJson(it.value())));
    shardOf[it.key()] = file.str();
    if (llvm::find(files, file) == files.end())
      files.push_back(file.str());
  }
  std::sort(files.begin(), files.end());
  std::vector<std::string> paths;
  for (const std::string &f : files)
    paths.push_back(inDir(f));
  auto set = SafeTensorsFile::openShards(paths);
  if (!set)
    return set.takeError();
  for (const auto &[name, t] : set->tensors()) {
    auto listed = shardOf.find(name);
    if (listed == shardOf.end())
      return inputError("{}: tensor {} is not in {}'s weight_map", set->pathOf(t), shortened(name),
                        indexPath);
    if (inDir(listed->second) != set->pathOf(t))
      return inputError("{}: $.weight_map: tensor {} is said to be in {} but is in {}", indexPath,
                        shortened(name), listed->second, set->pathOf(t));
  }
  for (const auto &[name, file] : shardOf)
    if (!set->tensors().count(name))
      return inputError("{}: $.weight_map: tensor {} is said to be in {}, which does not hold it",
                        indexPath, shortened(name), file);
  return set;
}

llvm::Expected<std::vector<std::vector<float>>> loadInitialWeights(llvm::StringRef path,
                                                                   const kernels::GptConfig &cfg,
                                                                   const TransformerConfig &model) {
  auto fail = [&](llvm::Error err) {
    std::string msg = takeMessage(std::move(err));
    // The file's own errors already start with its path.
    if (llvm::StringRef(msg).startswith((path + ": ").str()))
      msg = msg.substr(path.size() + 2);
    return inputError("--init-from {}: {}", path.str(), msg);
  };
  auto file = llvm::sys::fs::is_directory(path) ? openHfDirectory(path, model)
                                                : SafeTensorsFile::open(path);
  if (!file)
    return fail(file.takeError());
  // The model's block says which names to read: Llama's (Hugging Face's LlamaForCausalLM, with
  // or without its "model." prefix) or GPT-2's.
  if (!hasGpt2Block(cfg) && !hasLlamaBlock(cfg))
    return fail(inputError("the model's block mixes GPT-2's and Llama's choices ({}); "
                           "checkpoints load into GPT-2's block or Llama's",
                           variantsOf(cfg)));
  auto layers = hasLlamaBlock(cfg) ? llamaLayers(*file, cfg) : gpt2Layers(*file, cfg);
  if (!layers)
    return fail(layers.takeError());
  return layers;
}

} // namespace pipec
