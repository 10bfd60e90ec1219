//===- GPipe.cpp - GPipe: all forwards, then all backwards ----------------===//
//
// Huang et al., "GPipe: Efficient Training of Giant Neural Networks using Pipeline
// Parallelism" (NeurIPS 2019). Every rank runs the forwards of all microbatches, then their
// backwards; a flush ends the step. Bubble with unit F and fused B: (p-1)/(m+p-1). Every
// microbatch's activations are alive at the turn, so rank 0 peaks at m·A.
// Constraints: --vpp 1 (one stage per rank). Any --microbatches >= 1 works (m < p too).
// --seq-splits K cuts each microbatch into K sub-sequences: forwards run them in ascending
// order (a later one attends to the K/V of the earlier ones), backwards in descending order.
//
//===----------------------------------------------------------------------===//
#include "schedules/Policy.h"

#include "ir/support/Error.h"

namespace pipec {
namespace {

class GPipePolicy final : public SchedulePolicy {
public:
  llvm::StringRef name() const override { return "gpipe"; }
  llvm::StringRef summary() const override {
    return "GPipe (Huang et al. 2019): all forwards, then all backwards; memory m·A";
  }
  llvm::StringRef constraints() const override { return "--vpp 1; any --microbatches"; }

  llvm::Error check(const ParallelConfig &c) const override {
    if (c.vpp != 1)
      return inputError("gpipe needs --vpp 1 (got {}); for several chunks per rank use "
                        "--schedule interleaved-1f1b",
                        c.vpp);
    return llvm::Error::success();
  }

  void emit(const ScheduleRequest &request, ComputeOrder &order) const override {
    const ParallelConfig &c = request.parallel;
    order.assign(size_t(c.pp), {});
    for (int r = 0; r < c.pp; ++r) {
      auto &ops = order[size_t(r)];
      ops.reserve(size_t(2 * c.microbatches * c.seqSplits));
      // Stage r lives on rank r (loop placement with one chunk).
      for (int m = 0; m < c.microbatches; ++m)
        for (int k = 0; k < c.seqSplits; ++k)
          ops.push_back(Instruction::compute(OpKind::Forward, r, m, k));
      for (int m = 0; m < c.microbatches; ++m)
        for (int k = c.seqSplits - 1; k >= 0; --k)
          ops.push_back(Instruction::compute(OpKind::Backward, r, m, k));
    }
  }
};

} // namespace

std::unique_ptr<SchedulePolicy> createGPipePolicy() { return std::make_unique<GPipePolicy>(); }

} // namespace pipec
