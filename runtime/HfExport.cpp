//===- HfExport.cpp - Trained weights out as a Hugging Face directory ------===//
#include "runtime/HfExport.h"

#include "ir/formats/HfConfig.h"
#include "ir/support/Bytes.h"
#include "ir/support/DurableFile.h"
#include "ir/support/Error.h"
#include "ir/support/Files.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/Path.h"

#include <nlohmann/json.hpp>

#include <fmt/format.h>

#include <cerrno>
#include <csignal>
#include <cstring>
#include <string>
#include <sys/stat.h>
#include <unistd.h>
#include <vector>

namespace pipec {

namespace {

using OJson = nlohmann::ordered_json;
using namespace kernels::tensors;

/// One Hugging Face tensor: `rows` x `cols` values of role `role` of the layer. Copied as it is
/// ([in, out], GPT-2's Conv1D, or a vector), or, where `width` > 0, an nn.Linear [out, in]
/// taken transposed out of columns [column, column + rows) of the kernels' [cols, width] matrix.
struct HfTensor {
  std::string name;
  int role;
  int64_t rows, cols;
  int64_t width = 0, column = 0;
};

std::vector<HfTensor> gpt2Tensors(const kernels::GptConfig &c, kernels::GptLayerKind kind,
                                  int block) {
  const int64_t C = c.channels, V = c.vocab, T = c.seqLen, F = c.ffn;
  switch (kind) {
  case kernels::GptLayerKind::Embedding:
    return {{"transformer.wte.weight", Wte, V, C}, {"transformer.wpe.weight", Wpe, T, C}};
  case kernels::GptLayerKind::Block: {
    const std::string h = fmt::format("transformer.h.{}.", block);
    return {{h + "ln_1.weight", Ln1W, 1, C},
            {h + "ln_1.bias", Ln1B, 1, C},
            {h + "attn.c_attn.weight", QkvW, C, 3 * C},
            {h + "attn.c_attn.bias", QkvB, 1, 3 * C},
            {h + "attn.c_proj.weight", AttnW, C, C},
            {h + "attn.c_proj.bias", AttnB, 1, C},
            {h + "ln_2.weight", Ln2W, 1, C},
            {h + "ln_2.bias", Ln2B, 1, C},
            {h + "mlp.c_fc.weight", FcW, C, F},
            {h + "mlp.c_fc.bias", FcB, 1, F},
            {h + "mlp.c_proj.weight", ProjW, F, C},
            {h + "mlp.c_proj.bias", ProjB, 1, C}};
  }
  case kernels::GptLayerKind::Head: {
    std::vector<HfTensor> out{{"transformer.ln_f.weight", LnfW, 1, C},
                              {"transformer.ln_f.bias", LnfB, 1, C}};
    if (!c.tiedEmbeddings) // tied: transformers takes the head from wte
      out.push_back({"lm_head.weight", LmW, V, C});
    return out;
  }
  }
  return {};
}

std::vector<HfTensor> llamaTensors(const kernels::GptConfig &c, kernels::GptLayerKind kind,
                                   int block) {
  const int64_t C = c.channels, V = c.vocab, F = c.ffn;
  const int64_t K = int64_t(c.kvHeadCount()) * (C / c.heads);
  switch (kind) {
  case kernels::GptLayerKind::Embedding:
    return {{"model.embed_tokens.weight", Wte, V, C}};
  case kernels::GptLayerKind::Block: {
    const std::string h = fmt::format("model.layers.{}.", block);
    // The kernels' qkv.w is [C, C + 2K] (q | k | v), fc.w [C, 2F] (gate | up), attn.w [C, C] and
    // proj.w [F, C], all [in, out].
    return {{h + "input_layernorm.weight", Ln1W, 1, C},
            {h + "self_attn.q_proj.weight", QkvW, C, C, C + 2 * K, 0},
            {h + "self_attn.k_proj.weight", QkvW, K, C, C + 2 * K, C},
            {h + "self_attn.v_proj.weight", QkvW, K, C, C + 2 * K, C + K},
            {h + "self_attn.o_proj.weight", AttnW, C, C, C, 0},
            {h + "post_attention_layernorm.weight", Ln2W, 1, C},
            {h + "mlp.gate_proj.weight", FcW, F, C, 2 * F, 0},
            {h + "mlp.up_proj.weight", FcW, F, C, 2 * F, F},
            {h + "mlp.down_proj.weight", ProjW, C, F, C, 0}};
  }
  case kernels::GptLayerKind::Head: {
    std::vector<HfTensor> out{{"model.norm.weight", LnfW, 1, C}};
    if (!c.tiedEmbeddings)
      out.push_back({"lm_head.weight", LmW, V, C});
    return out;
  }
  }
  return {};
}

/// A tensor's values in Hugging Face's layout, from its layer's flat parameters.
std::vector<float> gather(const HfTensor &t, const std::vector<float> &layer, size_t offset) {
  std::vector<float> out(size_t(t.rows * t.cols));
  if (t.width == 0) {
    std::memcpy(out.data(), layer.data() + offset, out.size() * sizeof(float));
    return out;
  }
  for (int64_t r = 0; r < t.rows; ++r)
    for (int64_t c = 0; c < t.cols; ++c)
      out[size_t(r * t.cols + c)] = layer[offset + size_t(c * t.width + t.column + r)];
  return out;
}

struct Named {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> values;
};

/// A safetensors file of fp32 tensors: the header (padded with spaces to 8 bytes, as the
/// reference library writes it) then the tensors back to back in the header's order.
std::string safetensorsBytes(const std::vector<const Named *> &tensors) {
  OJson header;
  header["__metadata__"] = {{"format", "pt"}};
  uint64_t at = 0;
  for (const Named *t : tensors) {
    const uint64_t bytes = t->values.size() * sizeof(float);
    header[t->name] = {{"dtype", "F32"}, {"shape", t->shape}, {"data_offsets", {at, at + bytes}}};
    at += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i)
    out[size_t(i)] = char((n >> (8 * i)) & 0xff);
  out += text;
  out.reserve(out.size() + at);
  for (const Named *t : tensors) // little-endian hosts, as the rest of the runtime
    out.append(reinterpret_cast<const char *>(t->values.data()), t->values.size() * sizeof(float));
  return out;
}

} // namespace

llvm::Error checkHfExportDir(llvm::StringRef dir) {
  // The export is written beside `dir` (DIR.partial-<pid>) and renamed onto it: what can be
  // known before the run of whether that rename will work is checked here.
  llvm::StringRef parentRef = llvm::sys::path::parent_path(dir);
  const std::string parent = parentRef.empty() ? std::string(".") : parentRef.str();
  struct stat st, up;
  if (::lstat(dir.str().c_str(), &st) == 0 && S_ISLNK(st.st_mode))
    return inputError("--export-hf: {} is a symbolic link; give the directory itself (the "
                      "export is renamed into place, which would replace the link)",
                      dir.str());
  if (!llvm::sys::fs::exists(dir)) {
    if (!llvm::sys::fs::is_directory(parent))
      return inputError("--export-hf: {}: its parent directory does not exist", dir.str());
    return checkCanWriteIn("--export-hf", parent);
  }
  if (!llvm::sys::fs::is_directory(dir))
    return inputError("--export-hf: {}: exists and is not a directory; give a new directory",
                      dir.str());
  if (::stat(dir.str().c_str(), &st) == 0 && ::stat(parent.c_str(), &up) == 0 &&
      st.st_dev != up.st_dev)
    return inputError("--export-hf: {} is a mount point; the export is renamed into place, which "
                      "a mount point cannot take: give a new directory inside it, such as {}/hf",
                      dir.str(), dir.str());
  std::error_code ec;
  llvm::sys::fs::directory_iterator it(dir, ec);
  if (ec)
    return inputError("--export-hf: {}: cannot read: {}", dir.str(), ec.message());
  if (it != llvm::sys::fs::directory_iterator())
    return inputError("--export-hf: {}: exists and is not empty; give a new or empty directory",
                      dir.str());
  return checkCanWriteIn("--export-hf", parent);
}

namespace {

/// Whether `name` is one an export writes: config.json, model.safetensors,
/// model-<5 digits>-of-<5 digits>.safetensors, model.safetensors.index.json, or the temporary of
/// one of them (<name>.tmp-<6 hex digits>, ir/support/DurableFile.h).
bool isExportedName(llvm::StringRef name) {
  name = temporaryTarget(name);
  if (name == "config.json" || name == "model.safetensors" ||
      name == "model.safetensors.index.json")
    return true;
  llvm::StringRef digits = name;
  if (!digits.consume_front("model-") || !digits.consume_back(".safetensors") ||
      digits.size() != 14 || digits.substr(5, 4) != "-of-")
    return false;
  return llvm::all_of(digits.take_front(5), llvm::isDigit) &&
         llvm::all_of(digits.drop_front(9), llvm::isDigit);
}

/// Remove what exports to `dir` killed before their rename left beside it: DIR.partial-<pid>
/// directories (never links) of a process that no longer runs on this machine, holding only
/// regular files an export writes. Anything else under such a name stays where it is.
void removeKilledExports(llvm::StringRef dir) {
  llvm::StringRef parent = llvm::sys::path::parent_path(dir);
  const std::string prefix = (llvm::sys::path::filename(dir) + ".partial-").str();
  std::error_code ec;
  std::vector<std::string> leftovers;
  for (llvm::sys::fs::directory_iterator it(parent.empty() ? "." : parent, ec), end;
       !ec && it != end; it.increment(ec)) {
    llvm::StringRef name = llvm::sys::path::filename(it->path());
    if (!name.consume_front(prefix) || name.empty() || name.size() > 9 ||
        !llvm::all_of(name, llvm::isDigit))
      continue;
    const pid_t pid = pid_t(std::stol(name.str()));
    if (pid == ::getpid() || ::kill(pid, 0) == 0 || errno != ESRCH)
      continue; // (a live export's, or one this process cannot tell)
    leftovers.push_back(it->path());
  }
  for (const std::string &leftover : leftovers) {
    struct stat st;
    if (::lstat(leftover.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
      continue;
    std::vector<std::string> files;
    bool own = true;
    for (llvm::sys::fs::directory_iterator it(leftover, ec), end; own && !ec && it != end;
         it.increment(ec)) {
      own = isExportedName(llvm::sys::path::filename(it->path())) &&
            ::lstat(it->path().c_str(), &st) == 0 && S_ISREG(st.st_mode);
      files.push_back(it->path());
    }
    if (!own || ec)
      continue;
    for (const std::string &file : files)
      ::unlink(file.c_str());
    ::rmdir(leftover.c_str());
  }
}

} // namespace

llvm::Expected<int> writeHfDirectory(llvm::StringRef dir, const kernels::GptConfig &cfg,
                                     const TransformerConfig &model,
                                     const std::vector<std::vector<float>> &layers,
                                     uint64_t shardBytes) {
  if (auto err = checkHfExportDir(dir))
    return err;
  auto config = hfConfigJson(model);
  if (!config)
    return config.takeError();
  const bool llama = cfg.rmsnorm;
  std::vector<Named> tensors;
  for (int l = 0; l < cfg.numLayers(); ++l) {
    const kernels::GptLayerKind kind = kernels::layerKind(cfg, l);
    const auto offsets = kernels::paramRoleOffsets(cfg, l, 1);
    for (const HfTensor &t :
         llama ? llamaTensors(cfg, kind, l - 1) : gpt2Tensors(cfg, kind, l - 1)) {
      std::vector<int64_t> shape{t.rows, t.cols};
      if (t.rows == 1)
        shape = {t.cols};
      tensors.push_back({t.name, shape, gather(t, layers[size_t(l)], offsets[size_t(t.role)])});
    }
  }
  // Shards of at most shardBytes each (a larger tensor alone), in the layers' order.
  std::vector<std::vector<const Named *>> shards(1);
  uint64_t inShard = 0;
  for (const Named &t : tensors) {
    const uint64_t bytes = t.values.size() * sizeof(float);
    if (!shards.back().empty() && inShard + bytes > shardBytes) {
      shards.emplace_back();
      inShard = 0;
    }
    shards.back().push_back(&t);
    inShard += bytes;
  }
  // Written under a temporary name beside `dir`, then renamed: the directory appears whole.
  // (What a killed export left under such a name goes first.)
  removeKilledExports(dir);
  const std::string temp = fmt::format("{}.partial-{}", dir.str(), ::getpid());
  // Never a directory someone else has under that name: create_directory refuses one.
  // As mkdir(1) makes one (0777 less the umask), or with the mode of the empty directory it
  // replaces.
  if (std::error_code ec =
          llvm::sys::fs::create_directory(temp, /*IgnoreExisting=*/false, llvm::sys::fs::all_all))
    return inputError("--export-hf: {}: cannot create: {}", temp, ec.message());
  if (struct stat st; ::stat(dir.str().c_str(), &st) == 0 && S_ISDIR(st.st_mode))
    ::chmod(temp.c_str(), st.st_mode & 07777);
  // Every file is new, inside a directory made here: none can be one of the run's inputs.
  auto write = [&]() -> llvm::Error {
    if (auto err = writeFileAtomically(temp + "/config.json", *config, /*inputs=*/{}))
      return err;
    if (shards.size() == 1)
      return writeFileAtomically(temp + "/model.safetensors", safetensorsBytes(shards[0]), {});
    OJson map = OJson::object();
    uint64_t total = 0;
    for (size_t k = 0; k < shards.size(); ++k) {
      const std::string file =
          fmt::format("model-{:05}-of-{:05}.safetensors", k + 1, shards.size());
      for (const Named *t : shards[k]) {
        map[t->name] = file;
        total += t->values.size() * sizeof(float);
      }
      if (auto err = writeFileAtomically(temp + "/" + file, safetensorsBytes(shards[k]), {}))
        return err;
    }
    OJson index{{"metadata", {{"total_size", total}}}, {"weight_map", map}};
    return writeFileAtomically(temp + "/model.safetensors.index.json", index.dump(2) + "\n", {});
  };
  if (auto err = write()) {
    llvm::sys::fs::remove_directories(temp);
    uint64_t needed = config->size();
    for (const Named &t : tensors)
      needed += t.values.size() * sizeof(float);
    return inputError("--export-hf: {}; the export needs about {} beside {}: free that much",
                      takeMessage(std::move(err)), humanBytes(needed), dir.str());
  }
  if (llvm::sys::fs::is_directory(dir))
    llvm::sys::fs::remove(dir); // empty, as checkHfExportDir found it
  if (std::error_code ec = llvm::sys::fs::rename(temp, dir)) {
    llvm::sys::fs::remove_directories(temp);
    return inputError("--export-hf: {}: cannot rename {} into place: {}", dir.str(), temp,
                      ec.message());
  }
  return int(shards.size());
}

} // namespace pipec
