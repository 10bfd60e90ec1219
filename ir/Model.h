//===- Model.h - Model and cluster specs (pipemodel/1, pipecluster/1) -*- C++ -*-===//
//
// The declarative inputs of the compiler. A model is either an abstract list of layers with
// given costs, or a GPT-style transformer whose costs come from the FLOP and activation formulas
// of DESIGN §3.1 and the cluster's device. Both become a list of Layer entries whose per-slice
// costs are asked for with sliceCost().
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_IR_MODEL_H
#define PIPEC_IR_MODEL_H

#include "ir/Files.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace pipec {

struct Link {
  double bandwidthGBps = 0;
  double latencyUs = 0;
};

/// Bounds of the specs' fields: a node of more GPUs than this is no node (NVLink domains hold
/// hundreds), and a model of more layers than this is not one the compiler is meant for.
inline constexpr int64_t kMaxGpusPerNode = 1 << 16;
inline constexpr int64_t kMaxLayers = 1000000;

/// pipecluster/1.
struct ClusterSpec {
  std::string deviceName = "H100-SXM";
  double peakTflops = 989;
  double achievedFraction = 0.55;
  int64_t memoryBytes = 85899345920;
  int gpusPerNode = 8;
  Link intraNode{450, 3};
  Link interNode{50, 8};

  /// The embedded default (an H100 SXM node with 8 GPUs).
  static ClusterSpec defaults() { return ClusterSpec{}; }
};

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
  int64_t dtypeBytes() const { return dtype == "fp32" ? 4 : 2; }
};

/// Costs of one layer for one sub-sequence of one microbatch.
struct SliceCost {
  double forward = 0, backwardInput = 0, backwardWeight = 0;
  int64_t activationBytes = 0, weightGradBytes = 0, outputBytes = 0;
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

  bool isTransformer() const { return transformer.has_value(); }
  /// "ms" for transformer models (derived from FLOPs), "unit" for abstract ones.
  llvm::StringRef timeUnit() const { return isTransformer() ? "ms" : "unit"; }
  /// Sequence length the slices cut.
  int64_t sequenceLength(int seqSplits) const;
  /// Costs of layer `layer` for slice `sliceIndex` of `numSlices`, tokens [begin, end), on one
  /// of `tp` tensor-parallel ranks.
  SliceCost sliceCost(const ClusterSpec &cluster, size_t layer, int64_t begin, int64_t end,
                      int sliceIndex, int numSlices, int tp) const;
  /// Forward FLOPs of tokens [0, end) through one transformer block (for FLOP-balanced slicing).
  double blockForwardFlopsPrefix(int64_t end) const;
};

/// Parse and check a model spec; errors name `source`, the JSON path and what was expected.
llvm::Expected<ModelSpec> parseModelSpec(llvm::StringRef text, llvm::StringRef source);
llvm::Expected<ClusterSpec> parseClusterSpec(llvm::StringRef text, llvm::StringRef source);
llvm::Expected<ModelSpec> loadModelSpec(llvm::StringRef path);
llvm::Expected<ClusterSpec> loadClusterSpec(llvm::StringRef path);

} // namespace pipec

#endif // PIPEC_IR_MODEL_H
