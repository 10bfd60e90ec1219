//===- StageModel.h - The GPT's layers, layout, initialisation and shards -*- C++ -*-===//
//
// The model a pipeline stage computes, whatever the device: its configuration, its layers as
// the compiler numbers them, each layer's tensors by role and their flat layout on a
// tensor-parallel rank, the deterministic initialisation and the cutting of full (tp = 1)
// tensors into tp shards and back. The stage template (kernels/StageProgram.h) and every backend
// (kernels/cpu/Gpt.h on the host, runtime/cuda/GpuStage.h on a GPU) address parameters through
// it, so there is one layout. Plain C++ (no device, no LLVM).
//
// Layers: 0 the embedding (wte, and wpe without rope), 1..L the transformer blocks, L+1 the head
// (final norm, LM head). Tensor parallelism follows Megatron-LM: attention heads and the MLP's
// first matrix by columns, the attention projection and the MLP's second matrix by rows, the
// vocabulary by rows of wte and of the LM head; norms, the row-parallel biases and wpe whole on
// every rank. Every tp shard is cut from the same full initialisation, so shards concatenate to
// the single-rank weights exactly.
//
// Flat layout. One layer on tp rank r of tp holds, in order (row-major; linear weights are
// [in, out], y = x W + b):
//   embedding: wte [V/tp, C], wpe [T, C]
//   block:     ln1.w [C], ln1.b [C], qkv.w [C, (C + 2K)/tp], qkv.b [(C + 2K)/tp],
//              attn.w [C/tp, C], attn.b [C], ln2.w [C], ln2.b [C], fc.w [C, G F/tp],
//              fc.b [G F/tp], proj.w [F/tp, C], proj.b [C]
//   head:      lnf.w [C], lnf.b [C], lm.w [V/tp, C] (logits = h lm.w^T)
// K = kvHeads * C / heads (C without grouped-query attention); G = 2 with SwiGLU (fc's
// columns gate | up, each split across tp), else 1. Absent: wpe with rope; the norms' .b
// with RMSNorm or without biases; qkv.b, attn.b, fc.b and proj.b without biases.
// qkv's columns are q | k | v, q holding the rank's heads [r H/tp, (r+1) H/tp) and k, v its
// key/value heads [r KV/tp, (r+1) KV/tp); attn.w and proj.w hold the matching rows; attn.b
// and proj.b are replicated and added once, after the tp reduction, so every rank computes
// the same (full) gradient for them. wte and lm.w hold the vocabulary rows
// [r V/tp, (r+1) V/tp).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_KERNELS_STAGEMODEL_H
#define PIPEC_KERNELS_STAGEMODEL_H

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace pipec::kernels {

struct GptConfig {
  int vocab = 64;
  int seqLen = 16;   // T: tokens per sequence
  int channels = 32; // C
  int heads = 4;     // H (divisible by tp)
  int layers = 2;    // L transformer blocks
  int ffn = 128;     // MLP hidden size (divisible by tp)
  // (vocab divisible by tp, too)
  int microbatch = 2; // B: sequences per microbatch
  bool tiedEmbeddings = false;
  // The block's variants (the model spec's "norm", "mlp", "position", "num_query_groups",
  // "bias"); the defaults are GPT-2's, and any combination runs.
  bool rmsnorm = false;     // RMSNorm (a scale, no shift, no mean) instead of LayerNorm
  bool swiglu = false;      // MLP silu(x Wgate) * (x Wup) Wdown instead of gelu(x Wfc) Wproj
  bool rope = false;        // rotary q and k (no wpe) instead of learned positions
  double ropeTheta = 10000; // with rope
  int kvHeads = 0;          // key/value heads (grouped-query attention); 0: one per head
  bool bias = true;         // biases of the linear layers and LayerNorm's shift
  float normEps = 1e-5f;    // the norms' epsilon (the spec's "norm_eps")
  int numLayers() const { return layers + 2; } // embedding + blocks + head
  int kvHeadCount() const { return kvHeads > 0 ? kvHeads : heads; }
  bool isGpt2() const {
    return !rmsnorm && !swiglu && !rope && kvHeadCount() == heads && bias && normEps == 1e-5f;
  }
};

enum class GptLayerKind { Embedding, Block, Head };
GptLayerKind layerKind(const GptConfig &cfg, int layer);
/// Tensor-parallel reduction points in one forward (and in one backward_input) of a layer.
int layerParts(const GptConfig &cfg, int layer);

/// Number of floats of a layer's parameters on one tp rank.
size_t layerParamCount(const GptConfig &cfg, int layer, int tp);
/// The full (tp = 1) initial parameters of a layer: deterministic in (seed, layer). Biases and
/// layernorm shifts 0, layernorm scales 1, matrices N(0, 0.02) (GPT-2's init) from a
/// counter-based generator so the values do not depend on the order of calls. With tied
/// embeddings the head's matrix is initialised equal to the embedding's wte.
std::vector<float> initLayerFull(const GptConfig &cfg, int layer, uint64_t seed);
/// The part of a full (tp = 1) layer tensor (parameters or gradients) that tp rank `tpRank`
/// of `tp` holds. Replicated tensors are copied whole.
std::vector<float> shardLayer(const GptConfig &cfg, int layer, int tpRank, int tp,
                              std::span<const float> full);
/// The reverse of shardLayer: writes tp rank `tpRank`'s part `shard` into its places in the
/// full layer tensor `full` (the replicated tensors whole).
void unshardLayer(const GptConfig &cfg, int layer, int tpRank, int tp, std::span<const float> shard,
                  std::span<float> full);
/// The name of element `index` of a layer's parameters (or gradients) on a tp rank, with its
/// place in that rank's part of the tensor: "qkv.w[3, 17]" (row, column), "ln1.b[5]".
std::string paramName(const GptConfig &cfg, int layer, int tp, size_t index);
/// Where each of a layer's tensors begins within its parameters on a tp rank, and the total
/// at the end (one more entry than the layer has tensors).
std::vector<size_t> paramTensorOffsets(const GptConfig &cfg, int layer, int tp);
/// The tensors of a layer by role, whatever the variant leaves out (the layout StageModel.cpp
/// spells out): a block's, the embedding's and the head's. Every backend addresses a
/// layer's flat parameters through paramRoleOffsets, so there is one layout.
namespace tensors {
enum Block { Ln1W, Ln1B, QkvW, QkvB, AttnW, AttnB, Ln2W, Ln2B, FcW, FcB, ProjW, ProjB, NumBlock };
enum Embedding { Wte, Wpe, NumEmbedding };
enum Head { LnfW, LnfB, LmW, NumHead };
constexpr int kMostRoles = NumBlock;
/// paramRoleOffsets's entry for a tensor the variant does not have (a bias, wpe, a shift).
constexpr size_t kAbsent = size_t(-1);
} // namespace tensors
/// Where each role's tensor begins within a layer's flat parameters on a tp rank, indexed by
/// the layer kind's enum in `tensors` (kAbsent where the variant has none).
std::array<size_t, tensors::kMostRoles> paramRoleOffsets(const GptConfig &cfg, int layer, int tp);
/// For each of a layer's tensors (paramTensorOffsets's order): whether every tp rank holds all
/// of it (layernorms, the row-parallel biases, wpe) rather than a part.
std::vector<bool> paramTensorsReplicated(const GptConfig &cfg, int layer);

/// Asserts what a stage of `cfg` on `tp` ranks needs: tp, heads, key/value heads, ffn and
/// vocabulary divisible as the shards need, an even head size with rope.
void checkConfig(const GptConfig &cfg, int tp);

} // namespace pipec::kernels

#endif // PIPEC_KERNELS_STAGEMODEL_H
