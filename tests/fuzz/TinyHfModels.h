//===- TinyHfModels.h - The two tiny models the weight-reading targets load ---*- C++ -*-===//
//
// GPT-2's block and Llama's (grouped-query, untied), each one block of hidden size 4, 2 heads,
// an 8-wide MLP, a vocabulary of 8 and 4 positions: small enough that a whole valid checkpoint
// is a 2-4 KB input. The seeds in seeds/safetensors and seeds/hf_directory hold their weights.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_TESTS_FUZZ_TINYHFMODELS_H
#define PIPEC_TESTS_FUZZ_TINYHFMODELS_H

#include "ir/Model.h"
#include "kernels/cpu/Gpt.h"
#include "tests/fuzz/FuzzTarget.h"

#include <vector>

namespace pipec::fuzz {

struct TinyModel {
  kernels::GptConfig cfg;
  TransformerConfig model;
};

inline std::vector<TinyModel> tinyHfModels() {
  TinyModel gpt2;
  gpt2.cfg.vocab = 8;
  gpt2.cfg.seqLen = 4;
  gpt2.cfg.channels = 4;
  gpt2.cfg.heads = 2;
  gpt2.cfg.layers = 1;
  gpt2.cfg.ffn = 8;
  gpt2.cfg.microbatch = 1;
  gpt2.cfg.tiedEmbeddings = true;
  TransformerConfig &g = gpt2.model;
  g.numLayers = 1;
  g.hiddenSize = 4;
  g.numAttentionHeads = 2;
  g.ffnHiddenSize = 8;
  g.vocabSize = 8;
  g.seqLength = 4;
  g.tieEmbeddings = true;

  TinyModel llama = gpt2;
  llama.cfg.tiedEmbeddings = false;
  llama.cfg.rmsnorm = llama.cfg.swiglu = llama.cfg.rope = true;
  llama.cfg.kvHeads = 1;
  llama.cfg.bias = false;
  llama.cfg.normEps = 1e-6f;
  TransformerConfig &l = llama.model;
  l.tieEmbeddings = false;
  l.norm = Norm::RmsNorm;
  l.mlp = Mlp::SwiGlu;
  l.position = Position::Rope;
  l.numQueryGroups = 1;
  l.bias = false;
  l.normEps = 1e-6;
  return {gpt2, llama};
}

/// What loaded weights must be: one whole (tp = 1) layer per layer of the model, each of the
/// size the kernels use.
inline void checkLayers(const kernels::GptConfig &cfg, const std::vector<std::vector<float>> &w) {
  FUZZ_CHECK(w.size() == size_t(cfg.numLayers()), "one weight vector per layer");
  for (int layer = 0; layer < cfg.numLayers(); ++layer)
    FUZZ_CHECK(w[size_t(layer)].size() == kernels::layerParamCount(cfg, layer, 1),
               "each layer holds the kernels' parameter count");
}

} // namespace pipec::fuzz

#endif // PIPEC_TESTS_FUZZ_TINYHFMODELS_H
