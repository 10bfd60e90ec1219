//===- GoldenConfigs.h - The plans of tests/golden's text streams -*- C++ -*-===//
//
// The small plans whose streams tests/golden/*.txt holds in the text form: one model of 8
// uniform layers and a layout for each schedule. GoldenTest.cpp compares what they compile to
// with those files; the fuzz targets of the text form and of the CSV importer read their
// inputs against the same plans.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_TESTS_GOLDENCONFIGS_H
#define PIPEC_TESTS_GOLDENCONFIGS_H

#include "compiler/Pass.h"
#include "ir/Model.h"
#include "ir/Plan.h"
#include "ir/formats/SpecJson.h"

#include "llvm/Support/Error.h"

#include <cstdint>

namespace pipec::golden {

/// The model: 8 identical unit-time layers (tests/TestUtil.h's uniformModel(8)), as a
/// pipemodel/1 file.
inline constexpr const char *kUniform8Json = R"({"format": "pipemodel/1", "name": "uniform-8",
 "layers": [{"name": "block", "count": 8, "forward": 1.0, "backward_input": 1.0,
             "backward_weight": 1.0, "activation_bytes": 1048576, "weight_grad_bytes": 0,
             "param_bytes": 4194304, "output_bytes": 65536}], "p2p_time": 0.0})";

/// kUniform8Json read (it parses: anything else ends the process).
inline const ModelSpec &uniform8() {
  static const ModelSpec model =
      llvm::cantFail(parseModelSpec(kUniform8Json, "uniform-8.json"), "the built-in model parses");
  return model;
}

/// A golden plan: its file's name (without .txt) and what it is compiled with.
struct Config {
  const char *name;
  const char *schedule;
  ParallelConfig parallel;
  int64_t memoryLimit = 0; // zb-auto's --memory-limit
};

inline constexpr Config kConfigs[] = {
    {"gpipe_p4_m8", "gpipe", {.pp = 4, .microbatches = 8}},
    {"1f1b_p4_m8", "1f1b", {.pp = 4, .microbatches = 8}},
    {"1f1b_p4_m8_tp2_dp2", "1f1b", {.pp = 4, .tp = 2, .dp = 2, .microbatches = 8}},
    {"gpipe_p2_m2_k2", "gpipe", {.pp = 2, .microbatches = 2, .seqSplits = 2}},
    {"interleaved_1f1b_p4_m8_v2", "interleaved-1f1b", {.pp = 4, .vpp = 2, .microbatches = 8}},
    {"seq1f1b_p4_m8_k2", "seq1f1b", {.pp = 4, .microbatches = 8, .seqSplits = 2}},
    {"seq1f1b_interleaved_p4_m8_v2_k2",
     "seq1f1b-interleaved",
     {.pp = 4, .vpp = 2, .microbatches = 8, .seqSplits = 2}},
    {"zb_h1_p4_m8", "zb-h1", {.pp = 4, .microbatches = 8}},
    {"zb_h2_p4_m8", "zb-h2", {.pp = 4, .microbatches = 8}},
    {"zb_v_p4_m8_v2", "zb-v", {.pp = 4, .vpp = 2, .microbatches = 8}},
    {"dualpipe_v_p4_m8_v2", "dualpipe-v", {.pp = 4, .vpp = 2, .microbatches = 8}},
    // p·M_B (a stage of the uniform model keeps 2 MiB per microbatch): the paper's ZB-1p limit.
    {"zb_auto_p4_m8_limit8mib", "zb-auto", {.pp = 4, .microbatches = 8}, 8 << 20},
};

/// What `pipec compile` is given for `c`.
inline CompileOptions compileOptions(const Config &c) {
  CompileOptions o;
  o.schedule = c.schedule;
  o.parallel = c.parallel;
  o.memoryLimit = c.memoryLimit;
  return o;
}

} // namespace pipec::golden

#endif // PIPEC_TESTS_GOLDENCONFIGS_H
