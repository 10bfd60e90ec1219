#include "compiler/Budget.h"

#include "ir/support/Error.h"
#include "ir/support/Memory.h"

#include <algorithm>

namespace pipec {

namespace {
/// a * b, or UINT64_MAX past it.
uint64_t mul(uint64_t a, uint64_t b) {
  uint64_t out = 0;
  return __builtin_mul_overflow(a, b, &out) ? UINT64_MAX : out;
}
uint64_t add(uint64_t a, uint64_t b) {
  uint64_t out = 0;
  return __builtin_add_overflow(a, b, &out) ? UINT64_MAX : out;
}
} // namespace

uint64_t instructionBound(const ModelSpec &model, const CompileOptions &options) {
  const ParallelConfig &pc = options.parallel;
  const uint64_t stages = mul(uint64_t(std::max(pc.pp, 1)), uint64_t(std::max(pc.vpp, 1)));
  const uint64_t units =
      mul(uint64_t(std::max(pc.microbatches, 1)), uint64_t(std::max(pc.seqSplits, 1)));
  // F, I, W and 4 p2p ops per (stage, unit).
  uint64_t perUnit = mul(stages, 7);
  if (pc.tp > 1) {
    // Each tp reduction point of a layer cuts the forward and backward_input into one more part
    // and adds an all-reduce to each: 4 more instructions per point and unit.
    uint64_t points = 0;
    for (const Layer &l : model.layers)
      points = add(points, uint64_t(std::max(l.tpAllReduces, 0)));
    perUnit = add(perUnit, mul(points, 4));
  }
  // dp and embedding all-reduces and the optimizer step: a few per stage.
  return add(mul(units, perUnit), mul(stages, 4));
}

llvm::Error checkCompileBudget(const ModelSpec &model, const CompileOptions &options) {
  const uint64_t instructions = instructionBound(model, options);
  const ParallelConfig &pc = options.parallel;
  return checkMemoryBudget(
      mul(instructions, kCompileBytesPerInstruction),
      fmt::format("a plan of --pp {} --vpp {} --microbatches {} --seq-splits {} --tp {} (up to "
                  "{} instructions)",
                  pc.pp, pc.vpp, pc.microbatches, pc.seqSplits, pc.tp, instructions),
      "lower --microbatches or --seq-splits");
}

} // namespace pipec
