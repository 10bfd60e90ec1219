//===- Import.h - Compile a schedule read from a file ------------*- C++ -*-===//
//
// `pipec import`: a compute order written by someone else (PyTorch's CSV, pipec's text form)
// goes through compile's pipeline (defaultPipeline()) with the imported order as its schedule
// policy: seq-split and partition from the model, the schedule pass taking the imported order
// (checked by the verifier before anything lowers it), then lower-comms, lower-collectives,
// memory, simulate and verify. pp, vpp, microbatches, seq-splits and the
// placement (loop or V) come from the file; the plan is named after the pipec policy whose
// order it equals, so an exported plan imports back byte for byte.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_COMPILER_IMPORT_H
#define PIPEC_COMPILER_IMPORT_H

#include "compiler/Pass.h"
#include "ir/Instruction.h"
#include "ir/Model.h"
#include "ir/Plan.h"

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace pipec {

/// A schedule read back from a file (compiler/torch/TorchCsv.h reads PyTorch's CSV and pipec's
/// text form): compute ops per rank, whatever else was there dropped.
struct ImportedOrder {
  enum class Source : uint8_t { TorchCsv, TorchCsvComms, PipecText };
  Source source = Source::TorchCsv;
  /// Compute ops of each rank, in order (slice set, never split into tp parts).
  std::vector<std::vector<Instruction>> ranks;
  int numStages = 0;          // largest stage + 1
  int microbatches = 0;       // largest microbatch + 1
  int seqSplits = 1;          // largest slice + 1 (pipec text only; PyTorch has no slices)
  size_t droppedComms = 0;    // comm, wait, reduction and FSDP actions, re-derived by pipec
  size_t overlappedPairs = 0; // OVERLAP_F_B actions, split into their F and B in order
  size_t idleCells = 0;       // empty cells of the compute-only form
};
llvm::StringRef describe(ImportedOrder::Source source);

/// What the file cannot say; the flags mean what they mean for `pipec compile`.
struct ImportOptions {
  int vpp = 0; // 0: inferred from the file; otherwise checked against it
  int tp = 1, dp = 1, cp = 1;
  int microbatchGroupSize = 0; // interleaved policies; 0: the policy's default
  int64_t memoryLimit = 0;     // per rank; 0 = none (zb-auto is only recognised with one)
  /// The policy the order must equal (a finding if it does not); empty: recognise it.
  std::string schedule;
  /// --costs: measured times (CompileOptions::costs).
  std::shared_ptr<const MeasuredCosts> costs;
  std::string costsSource;
};

struct ImportResult {
  Plan plan;
  /// Every policy whose order for the inferred configuration equals the imported one, in
  /// list-schedules order; plan.schedule is the first, or "custom" when there is none.
  std::vector<std::string> matches;
};

/// The schedule name of a plan whose order matches no policy.
inline constexpr const char *kCustomSchedule = "custom";

/// Compile `order` (read from `source`) for `model`. Bad input (flags, a file that does not
/// fit the model, a placement neither loop nor V) is an InputError; a wrong order (a backward
/// before its forward, a missing or duplicate op, a stage on two ranks, a cycle) is the
/// verifier's Finding.
llvm::Expected<ImportResult> compileImported(const ModelSpec &model, const ClusterSpec &cluster,
                                             const ImportedOrder &order,
                                             const ImportOptions &options, llvm::StringRef source,
                                             bool verifyEach = false);

/// The Finding `pipec compile` (or, `imported`, `pipec import`) reports when a rank's peak
/// activations exceed --memory-limit, with the fix that command's flags make.
llvm::Error checkMemoryLimit(const Plan &plan, int64_t memoryLimit, bool imported = false);

} // namespace pipec

#endif // PIPEC_COMPILER_IMPORT_H
