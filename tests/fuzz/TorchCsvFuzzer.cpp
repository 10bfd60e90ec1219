//===- TorchCsvFuzzer.cpp - `pipec import`'s reader, and the passes on what it accepts ----===//
//
// Any bytes given to parseSchedule (PyTorch's schedule CSV in either form, or pipec's text
// form) are refused with an error, or give a compute order that compiles from the schedule pass
// on (lower comms, collectives, memory, simulate, verify) for the golden plans' model of 8 uniform
// layers (tests/GoldenConfigs.h), or is refused there (bad input or the verifier's finding). What
// compiles and PyTorch can express exports to CSV and imports back to the same plan.
//
//===----------------------------------------------------------------------===//
#include "tests/GoldenConfigs.h"
#include "tests/fuzz/FuzzTarget.h"

#include "compiler/Import.h"
#include "compiler/torch/TorchCsv.h"
#include "ir/Model.h"
#include "ir/formats/PlanJson.h"

using namespace pipec;

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
  auto result = compileImported(golden::uniform8(), ClusterSpec::defaults(), *order,
                                ImportOptions{}, "fuzz.csv");
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
  auto back = compileImported(golden::uniform8(), ClusterSpec::defaults(), *again, ImportOptions{},
                              "exported.csv");
  FUZZ_CHECK(bool(back), "an exported CSV compiles");
  FUZZ_CHECK(writePlanJson(back->plan) == writePlanJson(result->plan),
             "export then import gives the same plan");
  return 0;
}
