//===- ClusterSpecFuzzer.cpp - The cluster spec reader, and the costs it gives ----------===//
//
// `pipec compile --cluster C.json`: any text is refused with an InputError or becomes a cluster
// whose links and device give a small transformer's plan finite times.
//
//===----------------------------------------------------------------------===//
#include "tests/fuzz/FuzzTarget.h"

#include "compiler/Pass.h"
#include "ir/Model.h"
#include "ir/formats/SpecJson.h"

#include <cmath>

using namespace pipec;

static const char *kTinyGpt = R"({"format": "pipemodel/1", "name": "tiny-gpt",
 "transformer": {"num_layers": 4, "hidden_size": 32, "num_attention_heads": 4,
                 "ffn_hidden_size": 128, "vocab_size": 64, "seq_length": 16,
                 "microbatch_size": 2, "dtype": "fp32"}})";

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  auto cluster = parseClusterSpec(fuzz::textOf(data, size), "fuzz.json");
  if (!cluster) {
    fuzz::refused(cluster.takeError());
    return 0;
  }
  FUZZ_CHECK(cluster->gpusPerNode >= 1, "a node has a GPU");
  static const ModelSpec model = [] {
    auto m = parseModelSpec(kTinyGpt, "tiny-gpt.json");
    FUZZ_CHECK(bool(m), "the built-in model parses");
    return *m;
  }();
  CompileOptions o;
  o.schedule = "1f1b";
  o.parallel.pp = 2;
  o.parallel.tp = 2;
  o.parallel.microbatches = 2;
  auto plan = compilePlan(model, *cluster, o);
  if (!plan) {
    fuzz::refused(plan.takeError());
    return 0;
  }
  FUZZ_CHECK(std::isfinite(plan->stats.makespan) && plan->stats.makespan >= 0,
             "a plan on an accepted cluster has a finite makespan");
  return 0;
}
