//===- PlanTextFuzzer.cpp - The text form's parser, and the verifier on what it accepts --===//
//
// The text streams of tests/golden (`rank N: 0F0 0SEND_F0 ...`) parse against a stage table;
// here, against each golden configuration's (compiled once): any text is refused or gives
// streams that the verifier accepts or refuses, and that print back to text that parses to
// the same streams.
//
//===----------------------------------------------------------------------===//
#include "tests/fuzz/FuzzTarget.h"

#include "compiler/Pass.h"
#include "compiler/Verifier.h"
#include "ir/Model.h"
#include "ir/PlanText.h"
#include "ir/formats/SpecJson.h"

#include <vector>

using namespace pipec;

namespace {

const char *kUniform8 = R"({"format": "pipemodel/1", "name": "uniform-8",
 "layers": [{"name": "block", "count": 8, "forward": 1.0, "backward_input": 1.0,
             "backward_weight": 1.0, "activation_bytes": 1048576, "weight_grad_bytes": 0,
             "param_bytes": 4194304, "output_bytes": 65536}], "p2p_time": 0.0})";

/// The stage tables of tests/GoldenTest.cpp's configurations.
const std::vector<Plan> &stageTables() {
  static const std::vector<Plan> plans = [] {
    struct Config {
      const char *schedule;
      int pp, microbatches, seqSplits, tp, dp, vpp;
    } configs[] = {{"gpipe", 4, 8, 1, 1, 1, 1},
                   {"1f1b", 4, 8, 1, 1, 1, 1},
                   {"1f1b", 4, 8, 1, 2, 2, 1},
                   {"gpipe", 2, 2, 2, 1, 1, 1},
                   {"interleaved-1f1b", 4, 8, 1, 1, 1, 2},
                   {"seq1f1b", 4, 8, 2, 1, 1, 1},
                   {"seq1f1b-interleaved", 4, 8, 2, 1, 1, 2},
                   {"zb-h1", 4, 8, 1, 1, 1, 1},
                   {"zb-v", 4, 8, 1, 1, 1, 2}};
    auto model = parseModelSpec(kUniform8, "uniform-8.json");
    FUZZ_CHECK(bool(model), "the built-in model parses");
    std::vector<Plan> out;
    for (const Config &c : configs) {
      CompileOptions o;
      o.schedule = c.schedule;
      o.parallel.pp = c.pp;
      o.parallel.microbatches = c.microbatches;
      o.parallel.seqSplits = c.seqSplits;
      o.parallel.tp = c.tp;
      o.parallel.dp = c.dp;
      o.parallel.vpp = c.vpp;
      auto plan = compilePlan(*model, ClusterSpec::defaults(), o);
      FUZZ_CHECK(bool(plan), "a golden configuration compiles");
      out.push_back(std::move(*plan));
    }
    return out;
  }();
  return plans;
}

} // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  const llvm::StringRef text = fuzz::textOf(data, size);
  for (const Plan &table : stageTables()) {
    Plan plan = table;
    if (auto err = parseStreams(text, plan)) {
      fuzz::refused(std::move(err));
      continue;
    }
    Plan again = table;
    if (auto err = parseStreams(formatStreams(plan), again)) {
      fuzz::refused(std::move(err));
      FUZZ_CHECK(false, "printed streams parse back");
    }
    FUZZ_CHECK(again.ranks == plan.ranks, "streams round-trip through their text");
    if (plan.numInstructions() > 20000)
      continue;
    if (auto err = verifyPlan(plan))
      fuzz::refused(std::move(err));
  }
  return 0;
}
