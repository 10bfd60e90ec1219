//===- CostsFuzzer.cpp - A measured-costs file (pipec compile|plan|import --costs) ----------===//
//
// `--costs FILE` reads a pipecost/1 file: any text is refused or gives measured costs whose
// every op names one of its stages and sub-sequences, which write back to text that parses to
// the same costs.
//
//===----------------------------------------------------------------------===//
#include "tests/fuzz/FuzzTarget.h"

#include "ir/formats/Costs.h"

using namespace pipec;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  auto c = parseCostsJson(fuzz::textOf(data, size), "costs.json");
  if (!c) {
    fuzz::refused(c.takeError());
    return 0;
  }
  for (const MeasuredCosts::Op &op : c->ops)
    FUZZ_CHECK(op.stage >= 0 && op.stage < c->numStages && op.slice >= 0 && op.slice < c->numSlices,
               "an op names a stage and sub-sequence of the file");
  const std::string text = writeCostsJson(*c);
  auto again = parseCostsJson(text, "again.json");
  if (!again) {
    fuzz::refused(again.takeError());
    FUZZ_CHECK(false, "a costs file's JSON parses back");
  }
  FUZZ_CHECK(writeCostsJson(*again) == text, "a costs file round-trips byte for byte");
  return 0;
}
