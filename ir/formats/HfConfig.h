//===- HfConfig.h - A Hugging Face config.json as pipec's transformer -*- C++ -*-===//
//
// What a Hugging Face causal LM's config.json says of the model, in the model spec's terms
// (docs/contracts.md, "From a Hugging Face config"): `pipec spec --from-hf` writes the spec from
// it, and `piperun --init-from DIR` checks the plan's model against it field by field before it
// reads any weight. Two block families are understood: GPT-2's ("model_type": "gpt2") and
// Llama's ("llama", and "mistral", which shares its blocks); anything the kernels do not compute
// (rope scaling, sliding windows shorter than the sequence, biases on some projections only,
// another activation) is refused with one line naming the config field.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_IR_FORMATS_HFCONFIG_H
#define PIPEC_IR_FORMATS_HFCONFIG_H

#include "ir/Model.h"

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <cstdint>
#include <string>

namespace pipec {

struct HfModel {
  std::string modelType; // "gpt2", "llama" or "mistral"
  /// The model in the spec's terms; seqLength is the config's context (n_positions /
  /// max_position_embeddings), microbatchSize 1, dtype bf16 (the spec's defaults).
  TransformerConfig config;
  /// Mistral's sliding_window (0: none): the attention the kernels compute equals it only for
  /// sequences no longer than the window.
  int64_t slidingWindow = 0;
};

/// Parse config.json's text; errors name `source` and the config's field.
llvm::Expected<HfModel> parseHfConfig(llvm::StringRef text, llvm::StringRef source);
/// Read and parse a config.json file through the project's input rules.
llvm::Expected<HfModel> loadHfConfig(llvm::StringRef path);
/// The name a spec of the config at `path` takes when none is given: the name of the directory
/// holding it (resolved, so `config.json` in the current directory names that directory), else
/// the config's model_type.
std::string hfDefaultName(const HfModel &hf, llvm::StringRef path);

/// The plan's model against the config, field by field: the first that differs is an
/// InputError "<source>: <hf field> is <value> but the model spec's <spec field> is <value>".
/// The spec's sequence may be shorter than the config's context, not longer where positions are
/// learned (no rows for them) or past a sliding window.
llvm::Error checkModelAgainstHf(const HfModel &hf, const TransformerConfig &model,
                                llvm::StringRef source);

/// The pipemodel/1 spec of `hf`, named `name`, for sequences of `seqLength` tokens (0: the
/// config's context) in microbatches of `microbatchSize`; an InputError "--seq-length T: ..." when
/// the config's weights do not cover such a sequence (checkModelAgainstHf's rules). The text
/// parses back (parseModelSpec) to the same model.
llvm::Expected<std::string> hfModelSpecJson(const HfModel &hf, llvm::StringRef name,
                                            int64_t seqLength, int64_t microbatchSize,
                                            llvm::StringRef source);

/// The config.json of `model` (GPT-2's block or Llama's) that transformers loads as
/// GPT2LMHeadModel or LlamaForCausalLM, with the weights in fp32; parseHfConfig reads it back
/// to the same model (the context being its seq_length). An InputError for another block.
llvm::Expected<std::string> hfConfigJson(const TransformerConfig &model);

} // namespace pipec

#endif // PIPEC_IR_FORMATS_HFCONFIG_H
