//===- Evaluate.cpp - The passes that decide time and memory, and the simulate pass ------===//
#include "compiler/Evaluate.h"

#include "ir/CostModel.h"

#include <iterator>

namespace pipec {

namespace {

/// Establishes: stats hold the timing model's makespan, bubble ratio and per-rank times.
class SimulatePass final : public Pass {
public:
  llvm::StringRef name() const override { return "simulate"; }
  llvm::Expected<bool> run(Plan &plan, PassContext &) override {
    if (auto err = simulateStep(plan))
      return err;
    return true;
  }
};

const PassEntry kScoring[] = {
    {"lower-comms", createLowerCommsPass},
    {"lower-collectives", createLowerCollectivesPass},
    {"memory", createMemoryPass},
    {"simulate", createSimulatePass},
};

} // namespace

std::unique_ptr<Pass> createSimulatePass() { return std::make_unique<SimulatePass>(); }

llvm::ArrayRef<PassEntry> scoringPasses() { return kScoring; }

llvm::ArrayRef<llvm::StringRef> scoringPipeline() {
  static const llvm::StringRef names[] = {kScoring[0].name, kScoring[1].name, kScoring[2].name,
                                          kScoring[3].name};
  static_assert(std::size(names) == std::size(kScoring), "one name per scoring pass");
  return names;
}

llvm::Error evaluateOrder(Plan &plan) {
  PassContext ctx;
  ctx.scheduled = true;
  for (const PassEntry &s : kScoring) {
    auto changed = s.create()->run(plan, ctx);
    if (!changed)
      return changed.takeError();
  }
  return llvm::Error::success();
}

} // namespace pipec
