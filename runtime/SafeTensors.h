//===- SafeTensors.h - Initial weights from a safetensors file ---*- C++ -*-===//
//
// `piperun --init-from FILE|DIR` (docs/runtime.md, "Real weights in"). The safetensors format, as
// Hugging Face checkpoints use it: a little-endian u64 N, N bytes of JSON naming every tensor
// ({"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, and an optional
// "__metadata__" of strings}), then the tensors' bytes, little-endian, row-major, at those
// offsets from the end of the header. Read here in C++; nothing else is needed.
//
// gpt2Layers (and llamaLayers, for Llama's) maps a GPT-2 checkpoint's tensor names, as Hugging
// Face stores them
// ("wte.weight", "h.0.attn.c_attn.weight", ..., with or without the "transformer." prefix of
// GPT2LMHeadModel), onto the CPU kernels' whole (tp = 1) layers (kernels/cpu/Gpt.h); the runtime
// then gives each stage and tp rank its part, as it does for a checkpoint. A missing, extra or
// wrongly shaped tensor is an InputError naming it (and both shapes), before any step runs.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_SAFETENSORS_H
#define PIPEC_RUNTIME_SAFETENSORS_H

#include "ir/Model.h"
#include "kernels/cpu/Gpt.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace pipec {

struct SafeTensor {
  std::string dtype; // F32, F16, BF16, F64 are read; others are named in the error
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0; // byte offsets in the data section
  uint32_t shard = 0;          // which file of a sharded checkpoint holds it
};

/// A safetensors file's header, checked as the format's reference library checks it: every
/// entry's dtype, shape and offsets are well formed, its byte count equals its shape's, no name
/// appears twice, and the tensors' data ranges tile the data section exactly (back to back from
/// byte 0 to the end of the file: no overlap, no gap, nothing after the last).
class SafeTensorsFile {
public:
  static llvm::Expected<SafeTensorsFile> open(llvm::StringRef path);
  /// The shards of one checkpoint as one file: a name in two shards is an error.
  static llvm::Expected<SafeTensorsFile> openShards(llvm::ArrayRef<std::string> paths);

  const std::map<std::string, SafeTensor> &tensors() const { return entries; }
  /// A tensor's values as float32 (F16, BF16 and F64 converted).
  llvm::Expected<std::vector<float>> read(const std::string &name) const;
  /// Its first `most` values only (the first rows of a row-major matrix), read without touching
  /// the rest. A read past the memory budget is an InputError naming the file and the tensor.
  llvm::Expected<std::vector<float>> read(const std::string &name, uint64_t most) const;

  /// The file that holds tensor `t`.
  const std::string &pathOf(const SafeTensor &t) const { return shards[t.shard].path; }

private:
  struct Shard {
    std::string path;
    uint64_t dataStart = 0;
  };
  std::vector<Shard> shards;
  std::map<std::string, SafeTensor> entries;
};

/// "[768, 2304]".
std::string shapeText(const std::vector<int64_t> &shape);

/// The model's layers, whole (tp = 1) and in the kernels' order, from a GPT-2 checkpoint in
/// Hugging Face's names. wpe may hold more positions than the model's sequence (GPT-2's 1,024):
/// its first seq_length rows are taken. With tied embeddings the head's matrix is wte (an
/// lm_head.weight in the file, Hugging Face's copy of it, must equal it); untied, the file must
/// hold lm_head.weight. The causal-mask buffers some GPT-2 files carry (h.N.attn.bias,
/// h.N.attn.masked_bias) are not parameters and are skipped; any other extra tensor is an
/// error, and so is a value that is not a finite fp32 number.
llvm::Expected<std::vector<std::vector<float>>> gpt2Layers(const SafeTensorsFile &file,
                                                           const kernels::GptConfig &cfg);

/// The same from a Llama checkpoint in Hugging Face's names (LlamaForCausalLM's
/// "model.embed_tokens.weight", "model.layers.N.self_attn.{q,k,v,o}_proj.weight",
/// "...mlp.{gate,up,down}_proj.weight", "...input_layernorm.weight",
/// "...post_attention_layernorm.weight", "model.norm.weight", "lm_head.weight"; LlamaModel's
/// without "model."). Linear weights are stored [out, in] and transposed into the kernels'
/// [in, out]; q, k, v become qkv's column blocks and gate, up fc's. Hugging Face's q_proj and
/// k_proj already rotate halves (rotate_half), as the kernels do: no permutation. The model must
/// have Llama's block (rmsnorm, swiglu, rope, no biases); its num_query_groups sets k_proj's
/// and v_proj's rows. rotary_emb.inv_freq buffers are skipped.
llvm::Expected<std::vector<std::vector<float>>> llamaLayers(const SafeTensorsFile &file,
                                                            const kernels::GptConfig &cfg);

/// A Hugging Face model directory's weights (docs/runtime.md): config.json, checked against
/// `model` field by field (ir/formats/HfConfig.h), then model.safetensors or the shards that
/// model.safetensors.index.json's weight_map names (file names inside `dir`; every tensor in the
/// shard the map says, every shard's tensor in the map).
llvm::Expected<SafeTensorsFile> openHfDirectory(llvm::StringRef dir,
                                                const TransformerConfig &model);

/// Both steps (Llama's names where the file has model.embed_tokens.weight or
/// embed_tokens.weight, else GPT-2's), from a safetensors file or a Hugging Face model directory
/// (openHfDirectory), with every error starting "--init-from PATH: ".
llvm::Expected<std::vector<std::vector<float>>> loadInitialWeights(llvm::StringRef path,
                                                                   const kernels::GptConfig &cfg,
                                                                   const TransformerConfig &model);

} // namespace pipec

#endif // PIPEC_RUNTIME_SAFETENSORS_H
