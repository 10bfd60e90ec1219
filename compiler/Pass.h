//===- Pass.h - Passes, their registry and the pipeline ---------*- C++ -*-===//
//
// A pass transforms a Plan in place and says whether it changed it. Passes are registered once
// by name (LLVM's pass registry); a pipeline is a list of names. With verifyEach the verifier
// runs after every pass, at the strength the plan has reached (XLA's invariant checker).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_COMPILER_PASS_H
#define PIPEC_COMPILER_PASS_H

#include "ir/Model.h"
#include "ir/Plan.h"
#include "ir/formats/Costs.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace pipec {

class SchedulePolicy;

/// What the user asked for (docs/contracts.md#parallel-configuration).
struct CompileOptions {
  std::string schedule = "1f1b";
  ParallelConfig parallel;
  int64_t memoryLimit = 0; // per rank; 0 = none
  /// A published split: each stage's end in the model's layer list (embedding and head
  /// included); empty = the balanced partition.
  std::vector<int> stageEnds;
  /// --partition even: Megatron-LM's default split (evenStageEnds, compiler/Partition.h) where
  /// no stageEnds are given; false = the balanced partition.
  bool evenPartition = false;
  /// --costs (ir/formats/Costs.h): measured times in place of the model's, from the partition
  /// pass on (so the schedule pass, zb-auto's search included, and the simulator take them); the
  /// file's name for messages in `costsSource`.
  std::shared_ptr<const MeasuredCosts> costs;
  std::string costsSource;
};

/// Shared state of a pipeline run.
struct PassContext {
  const ModelSpec *model = nullptr;
  const ClusterSpec *cluster = nullptr;
  CompileOptions options;
  const SchedulePolicy *policy = nullptr;
  bool verifyEach = false;
  // How far lowering has come; decides how strict verification after a pass is.
  bool scheduled = false;
  bool commsLowered = false;
  bool collectivesLowered = false;
};

class Pass {
public:
  virtual ~Pass() = default;
  virtual llvm::StringRef name() const = 0;
  /// Run on `plan`; true if it changed the plan.
  virtual llvm::Expected<bool> run(Plan &plan, PassContext &ctx) = 0;
};

/// A registered pass: its name and how to create it.
struct PassEntry {
  llvm::StringRef name;
  std::unique_ptr<Pass> (*create)();
};

/// Names of all registered passes, in the default pipeline's order.
llvm::ArrayRef<llvm::StringRef> defaultPipeline();
/// Create a registered pass by name.
llvm::Expected<std::unique_ptr<Pass>> createPass(llvm::StringRef name);
/// Run the named passes in order.
llvm::Error runPipeline(llvm::ArrayRef<llvm::StringRef> names, Plan &plan, PassContext &ctx);

// The passes (each in its own file).
std::unique_ptr<Pass> createSeqSplitPass();
std::unique_ptr<Pass> createPartitionPass();
std::unique_ptr<Pass> createSchedulePass();
std::unique_ptr<Pass> createLowerCommsPass();
std::unique_ptr<Pass> createLowerCollectivesPass();
std::unique_ptr<Pass> createMemoryPass();
std::unique_ptr<Pass> createSimulatePass();
std::unique_ptr<Pass> createVerifyPass();

/// The bounds compilePlan puts on the options (counts at least 1, sizes pipec plans); an
/// InputError naming the flag.
llvm::Error checkCompileOptions(const CompileOptions &options);
/// The checks compilePlan makes before it picks a policy: flag bounds, and tp against the
/// transformer's heads and MLP width.
llvm::Error checkCompileOptions(const ModelSpec &model, const CompileOptions &options);

/// --cp against the model: a transformer, one slice per microbatch (no --seq-splits), and a
/// sequence that cuts into 2·cp chunks; an InputError naming the flag otherwise, whose
/// suggested size also divides `gpus` where that is given (> 0).
llvm::Error checkContextParallel(const ModelSpec &model, const ParallelConfig &pc,
                                 int64_t gpus = 0);

/// Every stage (--pp x --vpp) holds at least one of the model's layers; an InputError naming
/// the flag to change and a value that fits.
llvm::Error checkStageCount(const ModelSpec &model, const ParallelConfig &pc);

/// Check the options, select the policy, and run the whole default pipeline.
llvm::Expected<Plan> compilePlan(const ModelSpec &model, const ClusterSpec &cluster,
                                 const CompileOptions &options, bool verifyEach = false);

} // namespace pipec

#endif // PIPEC_COMPILER_PASS_H
