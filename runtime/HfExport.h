//===- HfExport.h - Trained weights out as a Hugging Face directory -*- C++ -*-===//
//
// `piperun ... --export-hf DIR` (docs/runtime.md, "Weights out"): the model's whole (tp = 1)
// layers, in the kernels' layout (kernels/cpu/Gpt.h), written as the directory transformers'
// save_pretrained writes and AutoModelForCausalLM.from_pretrained reads: config.json (GPT-2's or
// Llama's, from the plan's model) and fp32 safetensors in Hugging Face's tensor names, one
// model.safetensors or, past `shardBytes`, model-0000K-of-0000N.safetensors shards and their
// model.safetensors.index.json. Linear weights go out as Hugging Face stores them: GPT-2's
// Conv1D [in, out] as the kernels hold them, Llama's nn.Linear [out, in] transposed out of the
// kernels' fused q | k | v and gate | up matrices. `--init-from DIR` reads such a directory back
// to the same layers bit for bit.
//
// The directory appears whole or not at all: it is written under a temporary name beside DIR
// (every file fsynced) and renamed into place; DIR must not exist, or be an empty directory.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_HFEXPORT_H
#define PIPEC_RUNTIME_HFEXPORT_H

#include "ir/Model.h"
#include "kernels/cpu/Gpt.h"

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <cstdint>
#include <vector>

namespace pipec {

/// Hugging Face's classic default shard size (save_pretrained's max_shard_size="5GB").
constexpr uint64_t kDefaultHfShardBytes = uint64_t(5) * 1000 * 1000 * 1000;

/// Refuse an --export-hf directory up front (before any step runs): a new name in an existing
/// directory, or an empty directory.
llvm::Error checkHfExportDir(llvm::StringRef dir);

/// Write `layers` (whole, tp = 1, as kernels::initLayerFull lays them out) of the model `model`
/// (GPT-2's block or Llama's) to `dir`. Returns the number of safetensors files written.
llvm::Expected<int> writeHfDirectory(llvm::StringRef dir, const kernels::GptConfig &cfg,
                                     const TransformerConfig &model,
                                     const std::vector<std::vector<float>> &layers,
                                     uint64_t shardBytes = kDefaultHfShardBytes);

} // namespace pipec

#endif // PIPEC_RUNTIME_HFEXPORT_H
