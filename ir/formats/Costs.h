//===- Costs.h - Measured costs: the pipecost/1 format -----------*- C++ -*-===//
//
// What a profiled run measured (docs/runtime.md#measured-costs---profile): per stage and
// compute op kind (forward, backward_input, backward_weight, fused backward) and sub-sequence,
// the median time over the steps run (the first dropped as warm-up) and its spread; per message
// kind and size the transfer time; per collective group and stage the all-reduce time; per
// pipeline rank the optimizer step's time and the peak memory; and what it was measured on.
// `piperun --profile` and `pipec.torch.profile` write it; `pipec compile|plan|import --costs`
// reads it, and applyMeasuredCosts (ir/MeasuredCosts.h) puts its times in a plan's stage table.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_IR_FORMATS_COSTS_H
#define PIPEC_IR_FORMATS_COSTS_H

#include "ir/Plan.h"
#include "ir/support/Files.h"

#include "llvm/Support/Error.h"

#include <cstdint>
#include <string>
#include <vector>

namespace pipec {

/// A costs file: at most a few entries per (stage, op, slice), so 64 MiB is far beyond any.
inline constexpr InputFormat kCostsInput{"a costs file", kMaxCostsBytes, 12};

/// A measured time: the median over its samples and the spread (the interquartile range), in
/// milliseconds.
struct Measured {
  double medianMs = 0, spreadMs = 0;
  int64_t samples = 0;
};

/// Median and interquartile range of `ms` (empty: all 0).
Measured summarizeSamples(std::vector<double> ms);

struct MeasuredCosts {
  struct Op {
    int stage = 0;
    OpKind op = OpKind::Forward; // forward, backward_input, backward_weight or backward (fused)
    int slice = 0;
    Measured time;
  };
  struct Message {
    TensorKind kind = TensorKind::Activation;
    int64_t bytes = 0; // the message's size as the plan states it (its producer's output_bytes)
    Measured time;
  };
  struct Collective {
    CollectiveGroup group = CollectiveGroup::Dp;
    int stage = 0;
    Measured time;
  };
  struct Rank {
    int rank = 0;
    Measured optimizer;
    int64_t peakMemoryBytes = 0;
  };
  // What it was measured on.
  std::string backend, dtype, device, planHash;
  int threads = 0, steps = 0;
  int numStages = 0, numSlices = 0; // of the plan profiled
  std::vector<Op> ops;
  std::vector<Message> messages;
  std::vector<Collective> collectives;
  std::vector<Rank> ranks;
};

/// The file's text (pipecost/1).
std::string writeCostsJson(const MeasuredCosts &costs);
/// Parse a costs file; every bad field is an InputError naming it as `$.path`.
llvm::Expected<MeasuredCosts> parseCostsJson(llvm::StringRef text, llvm::StringRef source);
/// Read `path` by the input rules (ir/support/Files.h) and parse it.
llvm::Expected<MeasuredCosts> readCosts(llvm::StringRef path);
/// Write `path` whole (a temporary beside it, then a rename), never onto one of `inputs`.
llvm::Error writeCosts(llvm::StringRef path, const MeasuredCosts &costs,
                       llvm::ArrayRef<InputFile> inputs);

} // namespace pipec

#endif // PIPEC_IR_FORMATS_COSTS_H
