//===- PlanTextFuzzer.cpp - The text form's parser, and the verifier on what it accepts --===//
//
// The text streams of tests/golden (`rank N: 0F0 0SEND_F0 ...`) parse against a stage table;
// here, against each golden plan's (tests/GoldenConfigs.h, compiled once): any text is refused
// or gives streams that the verifier accepts or refuses, and that print back to text that
// parses to the same streams.
//
//===----------------------------------------------------------------------===//
#include "tests/GoldenConfigs.h"
#include "tests/fuzz/FuzzTarget.h"

#include "compiler/Pass.h"
#include "compiler/Verifier.h"
#include "ir/Model.h"
#include "ir/PlanText.h"

#include <vector>

using namespace pipec;

namespace {

/// The stage tables of the golden plans (tests/GoldenConfigs.h).
const std::vector<Plan> &stageTables() {
  static const std::vector<Plan> plans = [] {
    std::vector<Plan> out;
    for (const golden::Config &c : golden::kConfigs) {
      auto plan =
          compilePlan(golden::uniform8(), ClusterSpec::defaults(), golden::compileOptions(c));
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
