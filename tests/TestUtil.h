//===- TestUtil.h - Shared helpers for the test suites ----------*- C++ -*-===//
#ifndef PIPEC_TESTS_TESTUTIL_H
#define PIPEC_TESTS_TESTUTIL_H

#include "compiler/Pass.h"
#include "ir/Model.h"
#include "ir/Plan.h"
#include "ir/formats/Costs.h"
#include "ir/formats/SpecJson.h"
#include "ir/support/Error.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <string>
#include <utility>

namespace pipec::test {

/// An abstract model of `layers` identical layers.
inline ModelSpec uniformModel(int layers, double f = 1, double b = 1, double w = 1,
                              int64_t act = 1 << 20, int64_t wgrad = 0, double p2p = 0,
                              int64_t out = 1 << 16, int64_t params = 1 << 22) {
  ModelSpec m;
  m.name = "uniform";
  Layer l;
  l.name = "block";
  l.forward = f;
  l.backwardInput = b;
  l.backwardWeight = w;
  l.activationBytes = act;
  l.weightGradBytes = wgrad;
  l.paramBytes = params;
  l.outputBytes = out;
  for (int i = 0; i < layers; ++i)
    m.layers.push_back(l);
  m.p2pTime = p2p;
  m.allReduceTime = p2p;
  return m;
}

/// A profile of a `numStages`-stage, `numSlices`-slice plan, as the cpu backend in fp32 measured
/// it (5 steps, 2 threads, plan hash "0123"), before its measurements are added.
inline MeasuredCosts profileOf(int numStages, int numSlices) {
  MeasuredCosts m;
  m.backend = "cpu";
  m.dtype = "fp32";
  m.device = "host cpu";
  m.planHash = "0123";
  m.threads = 2;
  m.steps = 5;
  m.numStages = numStages;
  m.numSlices = numSlices;
  return m;
}

inline CompileOptions options(llvm::StringRef schedule, int pp, int microbatches, int vpp = 1,
                              int seqSplits = 1, int tp = 1, int dp = 1) {
  CompileOptions o;
  o.schedule = schedule.str();
  o.parallel.pp = pp;
  o.parallel.vpp = vpp;
  o.parallel.microbatches = microbatches;
  o.parallel.seqSplits = seqSplits;
  o.parallel.tp = tp;
  o.parallel.dp = dp;
  return o;
}

/// Compile with the verifier after every pass; fails the test on any error.
inline Plan compileOrFail(const ModelSpec &model, const CompileOptions &o) {
  auto plan = compilePlan(model, ClusterSpec::defaults(), o, /*verifyEach=*/true);
  if (!plan) {
    ADD_FAILURE() << "compile failed: " << takeMessage(plan.takeError());
    return Plan{};
  }
  return std::move(*plan);
}

/// `json`, a pipemodel/1 file named `name`, read; a test failure where it does not parse.
inline ModelSpec modelOrFail(const std::string &json, const std::string &name) {
  auto m = parseModelSpec(json, name);
  EXPECT_TRUE(bool(m)) << (m ? "" : takeMessage(m.takeError()));
  return m ? std::move(*m) : ModelSpec{};
}

/// A GPT-style transformer with the spec's defaults (docs/contracts.md#model-spec-pipemodel1)
/// but for `layers` blocks of hidden size `h` with `heads` heads, sequences of `seq` tokens and
/// GPT-2's padded vocabulary (50,304).
inline ModelSpec gptSpec(int64_t layers, int64_t h, int64_t seq, int64_t heads = 32) {
  std::string text = fmt::format(
      R"({{"format": "pipemodel/1", "name": "gpt", "transformer": {{"num_layers": {},
      "hidden_size": {}, "num_attention_heads": {}, "vocab_size": 50304, "seq_length": {}}}}})",
      layers, h, heads, seq);
  return modelOrFail(text, "gpt.json");
}

/// A transformer small enough for the runtimes to run in a moment (fp32, 16 hidden, 4 heads).
inline ModelSpec tinyGpt(bool tied = false, int layers = 4, int seq = 8) {
  std::string text = fmt::format(
      R"({{"format": "pipemodel/1", "name": "tiny", "transformer": {{"num_layers": {},
      "hidden_size": 16, "num_attention_heads": 4, "ffn_hidden_size": 32, "vocab_size": 32,
      "seq_length": {}, "microbatch_size": 2, "dtype": "fp32", "tie_embeddings": {}}}}})",
      layers, seq, tied ? "true" : "false");
  return modelOrFail(text, "tiny.json");
}

/// tinyGpt's shape with Llama's block: RMSNorm, SwiGLU, rotary positions, 2 key/value heads
/// for the 4 query heads, no biases.
inline ModelSpec tinyLlama(bool tied = false, int layers = 4, int seq = 8) {
  std::string text = fmt::format(
      R"({{"format": "pipemodel/1", "name": "tiny-llama", "transformer": {{"num_layers": {},
      "hidden_size": 16, "num_attention_heads": 4, "num_query_groups": 2, "ffn_hidden_size": 32,
      "vocab_size": 32, "seq_length": {}, "microbatch_size": 2, "dtype": "fp32",
      "tie_embeddings": {}, "norm": "rmsnorm", "mlp": "swiglu", "position": "rope",
      "bias": false}}}})",
      layers, seq, tied ? "true" : "false");
  return modelOrFail(text, "tiny-llama.json");
}

/// An fp32 GPT with a vocabulary of 32, for the memory tests: `layers` blocks of `hidden`
/// channels, `heads` heads and an fc of `ffn`, `microbatchSize` sequences of `seq` tokens.
inline ModelSpec fp32Gpt(int layers, int hidden, int heads, int ffn, int seq, int microbatchSize) {
  return modelOrFail(fmt::format(R"({{"format": "pipemodel/1", "name": "gpt-{}x{}-ffn{}",
      "transformer": {{"num_layers": {}, "hidden_size": {}, "num_attention_heads": {},
      "ffn_hidden_size": {}, "vocab_size": 32, "seq_length": {}, "microbatch_size": {},
      "dtype": "fp32"}}}})",
                                 layers, hidden, ffn, layers, hidden, heads, ffn, seq,
                                 microbatchSize),
                     "gpt.json");
}

/// A GPT whose activations dwarf its weights, for arenas larger than a device: 4 blocks of
/// hidden 32 with an fc of 4096, `microbatchSize` (8) sequences of 1024 tokens per microbatch,
/// fp32. Each microbatch keeps at least its blocks' fc inputs: 8 x 1024 x 4096 x 4 bytes (134
/// MB) each at 8 sequences.
inline ModelSpec wideFfnGpt(int microbatchSize = 8) {
  return fp32Gpt(/*layers=*/4, /*hidden=*/32, /*heads=*/2, /*ffn=*/4096, /*seq=*/1024,
                 microbatchSize);
}

/// The message of an expected error (empty, and a test failure, if there was none).
inline std::string errorText(llvm::Error err) {
  if (!err) {
    ADD_FAILURE() << "expected an error";
    return "";
  }
  return takeMessage(std::move(err));
}

} // namespace pipec::test

#endif // PIPEC_TESTS_TESTUTIL_H
