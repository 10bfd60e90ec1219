//===- PlanFuzzer.cpp - The plan reader, the verifier and what runs on a verified plan ---===//
//
// `pipec validate|simulate|show plan.json`: any text is refused by the reader (InputError) or
// the verifier (Finding); a plan both accept is simulated, drawn as the grid and as text, and
// written back: its JSON round-trips to the same bytes, its text to the same streams. Every
// input is also read by nlohmann's parser alone, the reference for ir/formats/JsonScan.h's scanner:
// the same plan or the same error.
//
//===----------------------------------------------------------------------===//
#include "tests/fuzz/FuzzTarget.h"

#include "compiler/Pass.h"
#include "compiler/TraceJson.h"
#include "compiler/Verifier.h"
#include "ir/PlanText.h"
#include "ir/formats/PlanJson.h"

using namespace pipec;

namespace {
/// A read's outcome as text: the plan written back, or the error's line.
std::string outcomeOf(llvm::Expected<Plan> &plan) {
  if (!plan)
    return "error: " + llvm::toString(plan.takeError());
  return writePlanJson(*plan);
}
} // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  auto plan = parsePlanJson(fuzz::textOf(data, size), "fuzz.json");
  {
    auto reference = parsePlanJson(fuzz::textOf(data, size), "fuzz.json", JsonParser::Nlohmann);
    const std::string want = outcomeOf(reference);
    if (!plan) {
      const std::string got = outcomeOf(plan);
      if (got != want)
        std::fprintf(stderr, "fast: %s\nnlohmann: %s\n", got.c_str(), want.c_str());
      FUZZ_CHECK(got == want, "the scanner and nlohmann refuse a plan alike");
      return 0;
    }
    FUZZ_CHECK(writePlanJson(*plan) == want, "the scanner and nlohmann read the same plan");
  }
  // (The streams of an accepted plan print, whether or not they verify: `pipec show`.)
  if (plan->numInstructions() > 20000)
    return 0; // verifying is superlinear: a large plan would dominate the run time
  const std::string grid = formatGrid(*plan, {GridMark{0, 1}});
  FUZZ_CHECK(!grid.empty(), "a grid prints");
  if (auto err = verifyPlan(*plan)) {
    fuzz::refused(std::move(err));
    return 0;
  }
  const std::string json = writePlanJson(*plan);
  auto again = parsePlanJson(json, "again.json");
  if (!again) {
    std::fprintf(stderr, "%s\n", llvm::toString(again.takeError()).c_str());
    FUZZ_CHECK(false, "a verified plan's JSON parses back");
  }
  FUZZ_CHECK(writePlanJson(*again) == json, "a plan's JSON round-trips byte for byte");
  Plan text = *plan;
  if (auto err = parseStreams(formatStreams(*plan), text)) {
    fuzz::refused(std::move(err));
    FUZZ_CHECK(false, "a verified plan's text parses back");
  }
  FUZZ_CHECK(text.ranks == plan->ranks, "a plan's text round-trips to the same streams");
  PassContext ctx;
  ctx.commsLowered = ctx.collectivesLowered = ctx.scheduled = true;
  if (auto err = runPipeline({"memory"}, *plan, ctx)) {
    fuzz::refused(std::move(err));
    return 0;
  }
  Timeline tl;
  if (auto err = simulateTimeline(*plan, tl)) {
    fuzz::refused(std::move(err));
    return 0;
  }
  summarizeTimeline(*plan, tl, plan->stats);
  FUZZ_CHECK(!chromeTrace(*plan, tl).empty(), "a trace is written");
  return 0;
}
