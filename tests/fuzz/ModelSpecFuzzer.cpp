//===- ModelSpecFuzzer.cpp - The model spec reader, and a compile of what it accepts ------===//
//
// `pipec compile --model M.json`: any text is refused with an InputError or becomes a model
// whose every layer costs a finite time, and a small plan of it compiles or is refused.
//
//===----------------------------------------------------------------------===//
#include "tests/fuzz/FuzzTarget.h"

#include "compiler/Budget.h"
#include "compiler/Pass.h"
#include "compiler/Verifier.h"
#include "ir/Model.h"
#include "ir/formats/SpecJson.h"

#include <cmath>

using namespace pipec;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  auto model = parseModelSpec(fuzz::textOf(data, size), "fuzz.json");
  if (!model) {
    fuzz::refused(model.takeError());
    return 0;
  }
  FUZZ_CHECK(!model->layers.empty(), "an accepted model has layers");
  const ClusterSpec cluster = ClusterSpec::defaults();
  const size_t shown = std::min<size_t>(model->layers.size(), 64);
  for (size_t l = 0; l < shown; ++l) {
    SliceCost c = model->sliceCost(cluster, l, 0, model->sequenceLength(1), 0, 1, 1);
    FUZZ_CHECK(std::isfinite(c.forward) && std::isfinite(c.backwardInput) &&
                   std::isfinite(c.backwardWeight),
               "every layer of an accepted model costs a finite time");
    FUZZ_CHECK(c.activationBytes >= 0 && c.weightGradBytes >= 0 && c.outputBytes >= 0,
               "byte counts are not negative");
  }
  CompileOptions o;
  o.schedule = "1f1b";
  o.parallel.pp = model->layers.size() >= 2 ? 2 : 1;
  o.parallel.microbatches = 2;
  FUZZ_CHECK(instructionBound(*model, o) > 0, "a plan has instructions");
  if (model->layers.size() > 256)
    return 0; // the compile below is for small models: it would dominate the run time
  auto plan = compilePlan(*model, cluster, o);
  if (!plan) {
    fuzz::refused(plan.takeError());
    return 0;
  }
  if (auto err = verifyPlan(*plan)) {
    llvm::consumeError(std::move(err));
    FUZZ_CHECK(false, "a compiled plan verifies");
  }
  return 0;
}
