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

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace pipec {

/// Megatron-like parallel configuration (docs/contracts.md#parallel-configuration).
struct ParallelConfig {
  int pp = 1, vpp = 1, tp = 1, dp = 1, microbatches = 1, seqSplits = 1;
  /// Context parallelism (--cp): ranks that share each sequence, 1/cp of its tokens each,
  /// passing keys and values round a ring for attention (transformer models, one slice). The
  /// GPUs are tp·cp·pp·dp; the gradients reduce over dp·cp ranks.
  int cp = 1;
  /// Interleaved schedules only; 0 = the policy's default.
  int microbatchGroupSize = 0;
  /// Megatron's sequence parallelism (--sequence-parallel): the norms, dropouts and residual
  /// adds sharded along the sequence over tp, each tp all-reduce a reduce-scatter plus an
  /// all-gather (the same bytes on a ring).
  bool sequenceParallel = false;
  /// ZeRO-1 (--distributed-optimizer): optimizer state and fp32 master weights sharded over
  /// dp, the dp all-reduce a reduce-scatter of gradients plus an all-gather of parameters.
  bool distributedOptimizer = false;
  /// Seq1F1B's sub-sequences at equal forward FLOPs (the paper's rule, --seq-split-by flops)
  /// instead of equal predicted F + B + W time under the cluster (the default).
  bool seqSplitByFlops = false;
  int numStages() const { return pp * vpp; }
  /// Ranks each stage's gradients are reduced over: the dp replicas and the cp ranks.
  int gradReduceRanks() const { return dp * cp; }
};

/// Why `pc`'s context parallelism cannot share the sequences of `t` (none where it can, or where
/// cp is 1), worded to follow "cp N": no transformer, no sequence; a sequence that does not
/// cut into 2·cp chunks, two per rank (Megatron-LM's causal balance); with sequence parallelism
/// over tp > 1, a rank's tokens that do not split into tp parts. `fits` gets the largest cp up
/// to pc.cp that passes (1 at least) and, where `divides` > 0, divides it (a suggestion that
/// must also divide a GPU count).
std::optional<std::string> contextParallelProblem(const std::optional<TransformerConfig> &t,
                                                  const ParallelConfig &pc, int &fits,
                                                  int64_t divides = 0);

/// A training step's throughput, as published runs report it: tokens per second over all the
/// GPUs and per GPU, model FLOP/s per GPU (Model::modelFlopsPerMicrobatch: no recomputation
/// counted) and that as a fraction of the device's peak (MFU); and the step's model FLOPs.
struct StepThroughput {
  double tokensPerSecond = 0, tokensPerSecondPerGpu = 0, tflopsPerGpu = 0, mfu = 0;
  double modelFlops = 0;
};

/// The throughput of a step of `stepMs` milliseconds that runs pc.microbatches microbatches of
/// `model` (its microbatch size and sequence length) on each of pc.dp replicas, on
/// tp·cp·pp·dp GPUs of `peakTflops` each (mfu 0 where that is 0); nullopt for an abstract
/// model or a step of no time.
std::optional<StepThroughput> stepThroughput(const ModelSpec &model, const ParallelConfig &pc,
                                             double stepMs, double peakTflops);

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
  /// Bytes a backward of the slice holds on top of its activation_bytes while it runs
  /// (docs/contracts.md §6); all 0 when the model gives none (the memory pass then takes
  /// weight_grad_bytes - activation_bytes where that is positive).
  llvm::SmallVector<int64_t, 1> backwardPeakBytes;
  /// What a fused backward of the slice holds on top of its activation_bytes instead, where
  /// the training software computes each layer's weight gradient right after its input
  /// gradient (Megatron-LM; the cluster's "kept_activations": "megatron"): the most one layer
  /// builds. Empty: backward_peak_bytes, as piperun's stages (the whole stage's input gradient,
  /// then its weight gradient) hold it.
  llvm::SmallVector<int64_t, 1> fusedBackwardPeakBytes;
  /// Bytes the largest op of the stage allocates for itself and frees before it ends; the
  /// memory pass adds them to the rank's bytes at every op of the stage.
  llvm::SmallVector<int64_t, 1> workspaceBytes;
  /// With sub-sequences (seq_splits > 1): the part of activation_bytes[k] that stays until the
  /// microbatch's slice 0 backward ends, not its own (slice k's K and V where the runtime keeps
  /// them in one buffer per microbatch), and the fp32 dK/dV accumulators of the whole sequence,
  /// which the microbatch's first backward (slice seq_splits - 1) allocates at its start and its
  /// last (slice 0) frees at its end (docs/contracts.md §6). Empty or 0 when the model gives none.
  llvm::SmallVector<int64_t, 1> sequenceKvBytes;
  int64_t sequenceGradBytes = 0;
  int64_t paramBytes = 0;
  /// Tensor-parallel all-reduces in one forward (and one backward_input) of this stage.
  int tpAllReduces = 0;
  // Transfer times (time unit of the plan), per slice: this stage's activation to stage + 1,
  // its input gradient to stage - 1 (0 where the peer is on the same rank or absent), one tp
  // all-reduce of its output; and the dp all-reduce of its gradients.
  llvm::SmallVector<double, 1> activationTransferTime, gradientTransferTime, tpAllReduceTime;
  double dpAllReduceTime = 0;
  /// The optimizer step of this stage's parameters (0 where the cluster does not time it).
  double optimizerTime = 0;
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
  /// The largest of the ranks' activation peaks, and of their whole-memory peaks.
  int64_t maxPeakActivationBytes() const { return maxOver(&RankStats::peakActivationBytes); }
  int64_t maxPeakMemoryBytes() const { return maxOver(&RankStats::peakMemoryBytes); }

private:
  int64_t maxOver(int64_t RankStats::*field) const {
    int64_t most = 0;
    for (const RankStats &r : ranks)
      most = std::max(most, r.*field);
    return most;
  }
};

struct Plan {
  std::string schedule;
  std::string model;
  std::string timeUnit = "unit";
  ParallelConfig parallel;
  Placement placement = Placement::Loop;
  int gpusPerNode = 8;
  double stateBytesPerParamByte = 4;
  /// The pipeline-wide gradient-norm and finite check before the optimizer step (two scalar
  /// all-reduces over the pipeline ranks); 0 where the cluster does not time the step.
  double optimizerSyncTime = 0;
  /// The schedule validates the step after it (the zero-bubble paper's post-validation): each
  /// rank steps as soon as its own gradients are reduced, without the pipeline-wide wait.
  bool postValidation = false;
  /// Each stage's dp all-reduce overlaps its last backward, bucket by bucket (the cluster's
  /// "grad_reduce": "overlapped"; docs/contracts.md#semantics).
  bool overlapGradReduce = false;
  /// Every send and receive blocks its rank until its partner posts the match (the cluster's
  /// "p2p": "blocking"): step_time is the executed step (docs/contracts.md#semantics).
  bool blockingP2p = false;
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
