//===- Plan.h - The compiled plan (pipeplan/1) ------------------*- C++ -*-===//
//
// A plan is the stage table (layers and per-slice costs of every stage, where each stage runs)
// plus one instruction stream per pipeline rank, plus the statistics the memory and simulate
// passes write. JSON (PlanJson.h) is its exchange form, text (PlanText.h) its log form.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_IR_PLAN_H
#define PIPEC_IR_PLAN_H

#include "ir/Instruction.h"
#include "ir/Model.h"

#include "llvm/ADT/SmallVector.h"
#include "llvm/ADT/StringRef.h"

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace pipec {

/// Megatron-like parallel configuration (DESIGN §3.3).
struct ParallelConfig {
  int pp = 1, vpp = 1, tp = 1, dp = 1, microbatches = 1, seqSplits = 1;
  /// Interleaved schedules only; 0 = the policy's default.
  int microbatchGroupSize = 0;
  int numStages() const { return pp * vpp; }
};

/// Stage-to-rank maps a schedule may choose.
enum class Placement : uint8_t {
  Loop,   // stage s on rank s % P
  VShape, // stage s on rank s for s < P, else 2P - 1 - s
};
llvm::StringRef toString(Placement p);
bool placementFromString(llvm::StringRef name, Placement &out);
int rankOfStage(Placement p, int stage, int pp);

/// One pipeline stage: a contiguous layer range [layerBegin, layerEnd) on one rank.
struct StageInfo {
  int stage = 0, rank = 0;
  int layerBegin = 0, layerEnd = 0;
  // Per-slice costs (seq_splits entries each).
  llvm::SmallVector<double, 1> forward, backwardInput, backwardWeight;
  llvm::SmallVector<int64_t, 1> activationBytes, weightGradBytes, outputBytes;
  int64_t paramBytes = 0;
  /// Tensor-parallel all-reduces in one forward (and one backward_input) of this stage.
  int tpAllReduces = 0;
  // Transfer times (time unit of the plan), per slice: this stage's activation to stage + 1,
  // its input gradient to stage - 1 (0 where the peer is on the same rank or absent), one tp
  // all-reduce of its output; and the dp all-reduce of its gradients.
  llvm::SmallVector<double, 1> activationTransferTime, gradientTransferTime, tpAllReduceTime;
  double dpAllReduceTime = 0;
};

struct RankStats {
  int rank = 0;
  double busy = 0, span = 0, start = 0, end = 0;
  /// When the rank's last dp all-reduce ends (== end without dp).
  double stepEnd = 0;
  int64_t peakActivationBytes = 0;
  int64_t staticBytes = 0; // weights, gradients and optimizer state
  int64_t peakMemoryBytes = 0;
};

struct PlanStats {
  bool simulated = false; // timing fields valid
  bool memory = false;    // memory fields valid
  double makespan = 0, bubbleRatio = 0;
  double stepTime = 0; // makespan plus what dp all-reduces add past the last compute
  std::vector<RankStats> ranks;
};

struct Plan {
  std::string schedule;
  std::string model;
  std::string timeUnit = "unit";
  ParallelConfig parallel;
  Placement placement = Placement::Loop;
  int gpusPerNode = 8;
  double stateBytesPerParamByte = 4;
  /// The transformer the plan was compiled from (what a runtime builds); none for abstract models.
  std::optional<TransformerConfig> transformer;
  std::vector<std::pair<int64_t, int64_t>> seqSlices;
  std::vector<StageInfo> stages;
  std::vector<std::vector<Instruction>> ranks;
  PlanStats stats;

  int numStages() const { return int(stages.size()); }
  int numRanks() const { return int(ranks.size()); }
  int numSlices() const { return parallel.seqSplits; }
  int rankOf(int stage) const { return stages[size_t(stage)].rank; }
  size_t numInstructions() const;
  /// Input and output embeddings are tied and live on different stages (so copies exist).
  bool tiedEmbeddings() const {
    return transformer && transformer->tieEmbeddings && numStages() > 1;
  }
  /// Bytes of the tied matrix per tp rank (vocab x hidden, sharded as Megatron does).
  int64_t tiedEmbeddingBytes() const;
  /// The payload of the tp all_reduce after part `part` of a `phase` op (Forward,
  /// BackwardInput or Backward) of (stage, slice): what the runtime sums there. A transformer's
  /// parts are its layers' reduction points, in layer order forward and in reverse order
  /// backward: the embedding's lookup and each block's two row-parallel outputs are hidden
  /// states (b, x, h) at the model's dtype; the head's forward sums the vocab-parallel cross
  /// entropy's statistics, (2 tp + 1) fp32 values per token (each shard's max and sum of exp,
  /// and the target's logit); its backward the LM head's partial input gradient (a hidden
  /// state); the embedding's backward sums nothing (0). An abstract model's parts all sum the
  /// stage's output (output_bytes). Stage and slice must be in range.
  int64_t tpAllReduceBytes(int stage, int slice, OpKind phase, int part) const;
};

} // namespace pipec

#endif // PIPEC_IR_PLAN_H
