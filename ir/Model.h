//===- Model.h - Model and cluster specs (pipemodel/1, pipecluster/1) -*- C++ -*-===//
//
// The declarative inputs of the compiler. A model is either an abstract list of layers with
// given costs, or a GPT-style transformer whose costs come from the FLOP and activation formulas
// of docs/contracts.md#model-spec-pipemodel1 and the cluster's device. Both become a list of Layer
// entries whose per-slice costs are asked for with sliceCost().
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_IR_MODEL_H
#define PIPEC_IR_MODEL_H

#include "ir/support/Limits.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace pipec {

struct Link {
  double bandwidthGBps = 0;
  double latencyUs = 0;
  /// Fraction of the nominal bandwidth that transfers and collectives reach (NCCL's bus
  /// bandwidth over the link's), in (0, 1].
  double efficiency = 1.0;
  /// Bytes per millisecond the link moves in practice.
  double bytesPerMs() const { return bandwidthGBps * efficiency * 1e6; }
};

/// How pipeline transfers run (a cluster's "p2p"): "overlapped" (one asynchronous message per
/// tp rank that only delays the receiver); "megatron" (Megatron-LM's: synchronous, holding the
/// sender until they arrive, and split over the tp ranks, each sending 1/tp and the receivers
/// all-gathering); "blocking" (DeepSpeed's pipeline engine, and piperun: Megatron-LM's
/// transfers, and every send and receive also blocks its rank until its partner has posted the
/// match, so the step is the executed step of the plan's streams, simulateExecutedStep).
enum class P2p : uint8_t { Overlapped, Megatron, Blocking };
llvm::StringRef toString(P2p p);
bool p2pFromString(llvm::StringRef name, P2p &out);

/// pipecluster/1.
struct ClusterSpec {
  std::string deviceName = "H100-SXM";
  double peakTflops = 989;
  /// Fraction of peak_tflops the GEMMs reach (the matrix multiplies of every layer).
  double achievedFraction = 0.55;
  /// Fraction of peak_tflops the materialized attention core's FLOPs reach (its QK^T and
  /// times-V GEMMs as separate kernels; its passes over the score matrix are memory-bound,
  /// timed at memory_GBps, ModelSpec::sliceCost); 0 = the same as achievedFraction.
  double attentionFraction = 0;
  /// Fraction of peak_tflops a flash (fused, tiled) attention kernel reaches; 0 = the same as
  /// achievedFraction. attention_fraction never applies to flash attention.
  double flashAttentionFraction = 0;
  /// GEMM efficiency by shape: a GEMM whose smallest dimension (after tp sharding) is d reaches
  /// achieved_fraction · d / (d + gemm_half_dim) of peak (a tile-occupancy saturation); 0 = every
  /// GEMM reaches achieved_fraction.
  double gemmHalfDim = 0;
  /// GEMM efficiency by size: a GEMM of m x k times k x n reaches achieved_fraction · I / (I +
  /// gemm_half_intensity) of peak, I = m·k·n / (m·k + k·n + m·n) its arithmetic intensity (FLOPs
  /// per element moved, over 2); large GEMMs saturate at achieved_fraction. 0 = not applied.
  double gemmHalfIntensity = 0;
  /// How much faster a block's GEMMs run in FP8 (a model's "gemm_precision": "fp8") than the
  /// same GEMMs in BF16, in [1, 2] (2: the H100's FP8 tensor-core peak over its BF16 one); 0 =
  /// 1, no gain. Attention, the memory-bound kernels, the head and communication stay BF16.
  double fp8GemmSpeedup = 0;
  /// Bytes per second (in GB/s) the memory-bound kernels reach (norms, dropouts, residual adds,
  /// activations, a materialized attention core's score-matrix passes, the optimizer step); 0 =
  /// those kernels and the optimizer step are not timed.
  double memoryGBps = 0;
  /// Fixed cost of every layer's forward, input-gradient and weight-gradient pass (kernel
  /// launches and framework overhead), in microseconds.
  double opOverheadUs = 0;
  /// What the variability of a pass's time costs a pipeline whose ranks wait on each other, a
  /// fitted term (calibration_bench; docs/planner.md, eleventh round), not a measured spread
  /// (docs/contracts.md): each stage's forward, input-gradient and weight-gradient pass of
  /// mean time t (the model's, before its transfers) takes pass_jitter_us · sqrt(t / 1 ms)
  /// microseconds more. A pass's spread grows with the square root of its length (its layers'
  /// and kernels' variations add up), and a neighbour waiting on it loses about that spread, so
  /// many short passes (interleaving, sub-sequences, split backwards) lose more than a few long
  /// ones of the same total. 0 = not charged. A measured pass (--costs) replaces the modelled
  /// time, this term included; a pass the costs file does not cover keeps it. The stage
  /// partition and Seq1F1B's time-balanced cuts balance the model's times without it.
  double passJitterUs = 0;
  /// Fixed cost of every message (transfer or collective) on top of its link's latency, in
  /// microseconds.
  double messageOverheadUs = 0;
  /// What a Megatron-LM pipeline transfer ("megatron" p2p) costs on top of
  /// message_overhead_us, in microseconds: Megatron-LM synchronises the device after every batch
  /// of sends and receives (its batch_p2p_sync), so the GPU idles until the host launches the
  /// next pass. Collectives, "overlapped" transfers and DeepSpeed's ("blocking": plain NCCL
  /// sends and receives, no device synchronisation) do not pay it.
  double p2pSyncUs = 0;
  P2p p2p = P2p::Overlapped;
  /// Whether a transfer holds its sender until it has arrived ("megatron" and "blocking").
  bool synchronousP2p() const { return p2p != P2p::Overlapped; }
  /// A message's fixed cost on `l`: its latency and message_overhead_us, in ms.
  double messageMs(const Link &l) const { return (l.latencyUs + messageOverheadUs) / 1000.0; }
  /// One message of `bytes` over `l`, in ms.
  double transferMs(const Link &l, double bytes) const {
    return messageMs(l) + bytes / l.bytesPerMs();
  }
  /// The link a group of `members` ranks `stride` global ranks apart spans (Megatron-LM's order
  /// of global ranks: tp fastest, then cp, dp, pp): within a node while the group does.
  const Link &groupLink(int64_t stride, int64_t members) const {
    return stride * members <= gpusPerNode ? intraNode : interNode;
  }
  /// Gradient reduction as PyTorch DDP, Megatron-LM's --overlap-grad-reduce and NeMo make it
  /// ("grad_reduce": "overlapped"): each stage's gradients reduce bucket by bucket while its last
  /// backward produces them, so the dp all-reduce may start with that backward; "after-backward"
  /// (the default): it starts when the stage's last weight gradient is done.
  bool overlapGradReduce = false;
  /// The distributed optimizer's all-gather of the updated parameters as NeMo's
  /// overlap_param_sync and Megatron-LM's --overlap-param-gather run it ("param_gather":
  /// "overlapped"): bucket by bucket during the next step's forward, so a stage's dp collective
  /// exposes only its reduce-scatter; "after-step" (the default): the all-gather follows the
  /// reduce-scatter. Without --distributed-optimizer it changes nothing.
  bool overlapParamGather = false;
  /// The memory-bound passes Megatron-LM's own layers (megatron/model, later megatron/legacy,
  /// and Megatron-DeepSpeed: Megatron-LM without Transformer Engine) make besides their GEMMs
  /// and fused kernels ("block_kernels": "megatron-legacy"): the QKV projection's bias (and
  /// SwiGLU's gate and up biases) added by a kernel of its own; every bias gradient summed over
  /// the tokens by a reduction of its own; the attention's output copied into [s, b, h] order;
  /// the Q, K and V gradients concatenated into the projection's; with flash attention also Q,
  /// K and V copied into [b, s, ...] order and their gradients back (ModelSpec::sliceCost).
  /// "fused" (the default): none of them, as Transformer Engine's layers run.
  bool megatronLegacyKernels = false;
  /// What the training software keeps for the backward ("kept_activations"): "piperun" (the
  /// default) as piperun's blocks keep it, recomputing the norms' outputs and the MLP
  /// activation's output in the backward, with no dropout; "megatron" as Megatron-LM's and
  /// Transformer Engine's layers keep it (Korthikanti et al. 2022): those outputs too, the
  /// dropouts' masks where the model has dropout, the attention dropout's output beside the
  /// probabilities of a materialized core, and the loss's fp32 softmax (ModelSpec::sliceCost).
  bool megatronActivations = false;
  int64_t memoryBytes = 85899345920;
  int gpusPerNode = 8;
  Link intraNode{450, 3};
  Link interNode{50, 8};
  /// The spec's "calibration" record (calibration_bench writes it): which published runs its
  /// factors were checked against, and by schedule the mean absolute throughput error of those
  /// runs predicted by factors fitted without their source (leave-one-source-out). Timing
  /// never reads it; `pipec plan` reports it beside the plans it ranks. Empty: never checked.
  std::string calibrationRuns;
  std::vector<std::pair<std::string, double>> heldOutErrorBySchedule;
  /// The record's held-out error of `schedule`'s published runs; none when it has no record of
  /// that schedule.
  std::optional<double> heldOutError(llvm::StringRef schedule) const {
    for (const auto &[name, error] : heldOutErrorBySchedule)
      if (name == schedule)
        return error;
    return std::nullopt;
  }

  /// The embedded default (an H100 SXM node with 8 GPUs).
  static ClusterSpec defaults() { return ClusterSpec{}; }
  /// FLOPs per millisecond of one device on GEMMs and on the attention core.
  double gemmFlopsPerMs() const { return peakTflops * 1e9 * achievedFraction; }
  double attentionFlopsPerMs(bool flash) const {
    double f = flash ? flashAttentionFraction : attentionFraction;
    return peakTflops * 1e9 * (f > 0 ? f : achievedFraction);
  }
  /// FLOPs per millisecond of one device on a GEMM of m x k times k x n (its smallest dimension
  /// and its arithmetic intensity set its efficiency), in FP8 when `fp8`.
  double gemmFlopsPerMs(double m, double k, double n, bool fp8 = false) const {
    double rate = gemmFlopsPerMs();
    if (gemmHalfDim > 0) {
      double d = std::min({m, k, n});
      rate *= d / (d + gemmHalfDim);
    }
    if (gemmHalfIntensity > 0) {
      double intensity = m * k * n / (m * k + k * n + m * n);
      rate *= intensity / (intensity + gemmHalfIntensity);
    }
    return fp8 && fp8GemmSpeedup > 0 ? rate * fp8GemmSpeedup : rate;
  }
  /// Bytes per millisecond of the memory-bound kernels (0 = not timed).
  double memoryBytesPerMs() const { return memoryGBps * 1e6; }
};

/// How the attention kernels treat the score matrix (docs/contracts.md#model-spec-pipemodel1):
/// "flash" keeps a log-sum-exp per row and recomputes the probabilities in the backward (the device
/// backends' tiled kernels); "materialized" keeps the probabilities from forward to backward (the
/// cpu backend's reference kernels).
enum class Attention : uint8_t { Flash, Materialized };
/// Activation recomputation (Korthikanti et al. 2022): "selective" recomputes the attention
/// core in the backward instead of keeping its probabilities; "full" keeps only each block's
/// input and recomputes the block's forward in the backward.
enum class Recompute : uint8_t { None, Selective, Full };
/// The block's variants (GPT-2's first, Llama's second): the normalisation ("layernorm",
/// "rmsnorm": a scale and no shift or mean), the MLP ("gelu": two matrices; "swiglu": gate and
/// up matrices, silu(gate)·up, then down) and the positions ("learned": a table in the
/// embedding; "rope": rotary embeddings of q and k, no parameters).
enum class Norm : uint8_t { LayerNorm, RmsNorm };
enum class Mlp : uint8_t { Gelu, SwiGlu };
enum class Position : uint8_t { Learned, Rope };
llvm::StringRef toString(Attention a);
llvm::StringRef toString(Recompute r);
llvm::StringRef toString(Norm n);
llvm::StringRef toString(Mlp m);
llvm::StringRef toString(Position p);
bool attentionFromString(llvm::StringRef name, Attention &out);
bool recomputeFromString(llvm::StringRef name, Recompute &out);
bool normFromString(llvm::StringRef name, Norm &out);
bool mlpFromString(llvm::StringRef name, Mlp &out);
bool positionFromString(llvm::StringRef name, Position &out);

enum class LayerKind : uint8_t { Abstract, Embedding, Block, Head };

/// One layer of the model. Abstract layers carry their costs; transformer layers derive them.
struct Layer {
  std::string name;
  LayerKind kind = LayerKind::Abstract;
  double forward = 0, backwardInput = 0, backwardWeight = 0;
  int64_t activationBytes = 0, weightGradBytes = 0, paramBytes = 0, outputBytes = 0;
  /// Megatron tensor-parallel all-reduces in this layer's forward (and, conjugate, in its
  /// input-gradient backward): 2 for a block (after attention, after the MLP).
  int tpAllReduces = 2;
};

struct TransformerConfig {
  int64_t numLayers = 0, hiddenSize = 0, numAttentionHeads = 0, ffnHiddenSize = 0;
  int64_t vocabSize = 0, seqLength = 0, microbatchSize = 1;
  std::string dtype = "bf16";
  /// Input and output embeddings share one matrix; the first and last stage keep copies whose
  /// gradients are summed (Megatron-LM's embedding group).
  bool tieEmbeddings = false;
  Attention attention = Attention::Flash;
  Recompute recompute = Recompute::None;
  /// The blocks' GEMMs in FP8 ("gemm_precision": "fp8", Transformer Engine's recipe): they run
  /// fp8_gemm_speedup times faster; everything else, and what is kept, stays at `dtype`.
  bool fp8Gemms = false;
  Norm norm = Norm::LayerNorm;
  Mlp mlp = Mlp::Gelu;
  Position position = Position::Learned;
  double ropeTheta = 10000; // with Position::Rope
  /// Key/value heads, each shared by num_attention_heads / groups query heads (grouped-query
  /// attention); 0: one per query head (multi-head attention).
  int64_t numQueryGroups = 0;
  /// Biases on the linear layers (and LayerNorm's shift); Llama has none.
  bool bias = true;
  /// The norms' epsilon (LayerNorm's added to the variance, RMSNorm's to the mean square):
  /// Hugging Face's layer_norm_epsilon / rms_norm_eps (GPT-2 and Llama 3: 1e-5, Llama 2: 1e-6).
  double normEps = 1e-5;
  /// Dropout probabilities (Megatron-LM's --attention-dropout and --hidden-dropout): on the
  /// attention's probabilities, and on the embeddings' and each residual branch's output. They
  /// change what a "megatron" cluster keeps (masks); piperun runs no dropout and refuses them.
  double attentionDropout = 0, hiddenDropout = 0;
  int64_t dtypeBytes() const { return dtype == "fp32" ? 4 : 2; }
  int64_t kvHeads() const { return numQueryGroups > 0 ? numQueryGroups : numAttentionHeads; }
  /// GPT-2's block in every choice (what the runtime's kernels implement today).
  bool isGpt2() const {
    return norm == Norm::LayerNorm && mlp == Mlp::Gelu && position == Position::Learned &&
           kvHeads() == numAttentionHeads && bias && normEps == 1e-5;
  }
  /// The choices that differ from GPT-2's, as the spec writes them ("" for GPT-2).
  std::string variantText() const;
};

/// Costs of one layer for one sub-sequence of one microbatch. Memory (docs/contracts.md#semantics):
/// the layer holds activationBytes from its forward to the end of its input-gradient backward,
/// weightGradBytes from there to the end of its weight-gradient backward (more than
/// activationBytes where the runtime keeps the output gradients the weight gradient needs), and
/// while a backward runs up to backwardPeakBytes on top of activationBytes (what it builds for
/// the weight gradient, dK/dV accumulators). workspaceBytes: the most one op of the layer
/// allocates for itself and frees before it ends (a stage needs its largest layer's, once).
/// With sub-sequences: sequenceKvBytes, the part of activationBytes kept until the
/// microbatch's slice 0 backward ends (K/V), and sequenceGradBytes, the whole sequence's dK/dV
/// the microbatch's backwards hold from the first (slice K - 1) to the last (slice 0); given by
/// slice 0's cost, 0 in the others' (StageInfo's fields of the same names).
struct SliceCost {
  double forward = 0, backwardInput = 0, backwardWeight = 0;
  int64_t activationBytes = 0, weightGradBytes = 0, outputBytes = 0;
  int64_t backwardPeakBytes = 0, workspaceBytes = 0;
  int64_t sequenceKvBytes = 0, sequenceGradBytes = 0;
};

/// pipemodel/1.
struct ModelSpec {
  std::string name;
  std::vector<Layer> layers; // expanded: one entry per layer
  double p2pTime = 0;        // abstract: fixed time of every transfer
  /// abstract: time of one tp all-reduce (defaults to p2p_time).
  double allReduceTime = 0;
  int64_t seqLength = 0; // abstract: optional, default = number of slices
  /// Bytes of weights + gradients + optimizer state per byte of parameters (4 for plain Adam
  /// in the parameter precision; 9 for bf16 mixed precision: 18 bytes per parameter).
  double stateBytesPerParamByte = 4;
  std::optional<TransformerConfig> transformer;

  /// Makes this the transformer `c`: its layers (the embedding, c.numLayers blocks, the head)
  /// with their parameter bytes and the mixed-precision state per parameter byte.
  void setTransformer(const TransformerConfig &c);
  bool isTransformer() const { return transformer.has_value(); }
  /// "ms" for transformer models (derived from FLOPs), "unit" for abstract ones.
  llvm::StringRef timeUnit() const { return isTransformer() ? "ms" : "unit"; }
  /// Sequence length the slices cut.
  int64_t sequenceLength(int seqSplits) const;
  /// Costs of layer `layer` for slice `sliceIndex` of `numSlices`, tokens [begin, end), on one
  /// of `tp` tensor-parallel ranks.
  /// With `sequenceParallel` the norms, dropouts and residual adds (and what they keep) are
  /// sharded along the sequence over the tp ranks (Korthikanti et al. 2022).
  /// With `cp` > 1 (context parallelism, one slice only) each of cp ranks holds 1/cp of the
  /// tokens, load-balanced for causal attention, and the keys and values go round the cp ranks
  /// in a ring (Megatron-LM's and Transformer Engine's point-to-point context parallelism).
  SliceCost sliceCost(const ClusterSpec &cluster, size_t layer, int64_t begin, int64_t end,
                      int sliceIndex, int numSlices, int tp, bool sequenceParallel = false,
                      int cp = 1) const;
  /// Forward FLOPs of tokens [0, end) through one transformer block (for FLOP-balanced slicing).
  double blockForwardFlopsPrefix(int64_t end) const;
  /// Bytes a stage keeps per (microbatch, slice) besides its layers' own: the residual stream
  /// from the forward to the backward, then its gradient until the weight gradient (the same
  /// size, b·x·h in the model's dtype, over `shards` tp ranks with sequence parallelism); 0
  /// for abstract models.
  int64_t residualBytes(int64_t begin, int64_t end, int shards = 1) const;
  /// FLOPs of one microbatch through the model (forward, input and weight gradients, without
  /// recomputation), over the whole sequence at tp = 1: what model FLOP/s and MFU count.
  double modelFlopsPerMicrobatch() const;
};

} // namespace pipec

#endif // PIPEC_IR_MODEL_H
