//===- PiperunIntakeFuzzer.cpp - piperun --backend cpu up to its first step --------------===//
//
// What `piperun plan.json --backend cpu` does before step 0: read the plan, verify it, check
// it against the model and the machine (gptConfigOf, cpuRunBytes), and build every rank
// thread's stages and the transport (runOnCpu with no steps). Any text is refused (exit 2 or 1
// in the tool) or prepares a run; nothing may crash, overflow or leak on the way.
//
//===----------------------------------------------------------------------===//
#include "tests/fuzz/FuzzTarget.h"

#include "compiler/Verifier.h"
#include "ir/formats/PlanJson.h"
#include "runtime/Data.h"
#include "runtime/cpu/CpuRun.h"

using namespace pipec;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  auto plan = parsePlanJson(fuzz::textOf(data, size), "fuzz.json");
  if (!plan) {
    fuzz::refused(plan.takeError());
    return 0;
  }
  if (plan->numInstructions() > 20000)
    return 0; // verifying is superlinear: a large plan would dominate the run time
  if (auto err = verifyPlan(*plan)) {
    fuzz::refused(std::move(err));
    return 0;
  }
  auto cfg = gptConfigOf(*plan);
  if (!cfg) {
    fuzz::refused(cfg.takeError());
    return 0;
  }
  // The tool refuses a run past the machine's memory; the fuzzer's limit is lower (libFuzzer
  // stops at 2.5 GiB), so runs it could not hold are left out here, by the same estimate.
  if (cpuRunBytes(*plan, *cfg, /*checkReference=*/false) > (uint64_t(256) << 20))
    return 0;
  std::unique_ptr<DataSource> tokens = syntheticData(cfg->vocab, /*seed=*/1);
  CpuRunOptions o;
  o.steps = 0;
  auto result = runOnCpu(*plan, *tokens, o);
  if (!result)
    fuzz::refused(result.takeError());
  return 0;
}
