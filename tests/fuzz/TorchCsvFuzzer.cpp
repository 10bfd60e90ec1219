//===- TorchCsvFuzzer.cpp - `pipec import`'s reader, and the passes on what it accepts ----===//
//
// Any bytes given to parseSchedule (PyTorch's schedule CSV in either form, or pipec's text
// form) are refused with an error, or give a compute order that compiles from the schedule pass
// on (lower comms, collectives, memory, simulate, verify) for a model of 8 uniform layers, or
// is refused there (bad input or the verifier's finding). What compiles and PyTorch can
// express exports to CSV and imports back to the same plan.
//
//===----------------------------------------------------------------------===//
#include "tests/fuzz/FuzzTarget.h"

#include "compiler/Import.h"
#include "compiler/torch/TorchCsv.h"
#include "ir/Model.h"
#include "ir/formats/PlanJson.h"
#include "ir/formats/SpecJson.h"

using namespace pipec;

namespace {

const char *kUniform8 = R"({"format": "pipemodel/1", "name": "uniform-8",
 "layers": [{"name": "block", "count": 8, "forward": 1.0, "backward_input": 1.0,
             "backward_weight": 1.0, "activation_bytes": 1048576, "weight_grad_bytes": 0,
             "param_bytes": 4194304, "output_bytes": 65536}], "p2p_time": 0.0})";

const ModelSpec &model() {
  static const ModelSpec m = [] {
    auto parsed = parseModelSpec(kUniform8, "uniform-8.json");
    FUZZ_CHECK(bool(parsed), "the built-in model parses");
    return std::move(*parsed);
  }();
  return m;
}

} // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  auto order = parseSchedule(fuzz::textOf(data, size), "fuzz.csv");
  if (!order) {
    fuzz::refused(order.takeError());
    return 0;
  }
  size_t ops = 0;
  for (const auto &rank : order->ranks)
    ops += rank.size();
  if (ops > 4096)
    return 0; // the parse is what this target is for; keep each input fast
  auto result =
      compileImported(model(), ClusterSpec::defaults(), *order, ImportOptions{}, "fuzz.csv");
  if (!result) {
    fuzz::refused(result.takeError());
    return 0;
  }
  auto csv = writeTorchCsv(result->plan, TorchCsvForm::ComputeOnly);
  if (!csv) {
    fuzz::refused(csv.takeError()); // not expressible in PyTorch's form
    return 0;
  }
  auto again = parseSchedule(*csv, "exported.csv");
  FUZZ_CHECK(bool(again), "an exported CSV parses");
  auto back =
      compileImported(model(), ClusterSpec::defaults(), *again, ImportOptions{}, "exported.csv");
  FUZZ_CHECK(bool(back), "an exported CSV compiles");
  FUZZ_CHECK(writePlanJson(back->plan) == writePlanJson(result->plan),
             "export then import gives the same plan");
  return 0;
}
