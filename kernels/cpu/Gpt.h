//===- Gpt.h - CPU reference math of a small GPT, per pipeline stage -*- C++ -*-===//
//
// The fp32 reference the runtime executes and every other backend is tested against (llm.c's
// train_gpt2.c is the model: plain loops, shapes in comments). A pipeline stage holds the layers
// [layerBegin, layerEnd) of a GPT whose layers are numbered as the compiler numbers them:
//   layer 0          embedding: token (wte) + position (wpe) lookup
//   layers 1..L      transformer blocks: x += attn(ln1(x)); x += mlp(ln2(x))  (pre-LN, GELU),
//                    or Llama's choices in any combination (GptConfig: RMSNorm, SwiGLU,
//                    rotary positions, grouped-query attention, no biases; LlamaOps.h)
//   layer L+1        head: final layernorm, LM head (wte^T when tied, else its own matrix),
//                    cross-entropy against the next tokens
// Work is split as the plan splits it:
//   - forward and backward_input of a (microbatch, slice) run in `parts`: one per tensor-parallel
//     reduction point (embedding 1, block 2 — after attention and after the MLP — head 1), so
//     that the runtime can all-reduce between parts exactly where the plan's tp all_reduce ops
//     are; a part returns the buffer to sum over the tp group (empty where nothing needs it);
//   - backward_input computes input gradients only and keeps what backward_weight needs;
//     backward_weight accumulates the weight gradients;
//   - sub-sequences (Seq1F1B): slice k of a microbatch attends to the K/V of slices 0..k; its
//     backward adds dK/dV for the earlier slices into their accumulators, which their own
//     backwards (run later, in descending slice order) consume.
// Tensor parallelism follows Megatron-LM: attention heads and the MLP's first matrix are split by
// columns, the attention projection and the MLP's second matrix by rows, and the vocabulary by
// rows of wte and of the LM head (vocab-parallel): the embedding's part returns the lookup of
// the rank's tokens (plus wpe on tp rank 0) to sum; the head's forward part returns each row's
// (max, sum of exp) over the rank's logits and its target's logit, from which the loss over the
// whole vocabulary follows (Megatron's vocab-parallel cross entropy, in one reduction), and its
// backward part the LM head's partial input gradient. The layout, initialisation and shards
// are kernels/StageModel.h's.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_KERNELS_CPU_GPT_H
#define PIPEC_KERNELS_CPU_GPT_H

#include "kernels/StageModel.h"

#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

namespace pipec::kernels {

/// The layers [layerBegin, layerEnd) of the model on one tensor-parallel rank: the stage of
/// kernels/StageProgram.h on the host (runtime/cuda/GpuStage.h runs it on a GPU).
class StageCompute {
public:
  /// `slices`: the [begin, end) token ranges of the plan's sub-sequences (cover [0, seqLen)).
  /// `lossScale`: every token's loss is multiplied by it (1 / tokens in the global batch, so
  /// that summed gradients are those of the mean loss).
  StageCompute(const GptConfig &cfg, int layerBegin, int layerEnd, int tpRank, int tp,
               uint64_t seed, std::vector<std::pair<int, int>> slices, float lossScale);
  ~StageCompute();
  StageCompute(const StageCompute &) = delete;
  StageCompute &operator=(const StageCompute &) = delete;

  /// Reduction points of one forward (== of one backward_input) of the whole stage.
  int parts() const;
  bool hasEmbedding() const;
  bool hasHead() const;

  /// The batch of this step: tokens[mb] holds microbatch*(seqLen+1) ids (each sequence and its
  /// next token), used by the embedding (inputs) and the head (targets).
  void setBatch(std::vector<std::vector<int32_t>> tokens);

  /// Forward part `part` of (mb, slice). Part 0 takes the input: the hidden state
  /// (B, x, C) received from the previous stage (x = slice length), ignored on the first stage.
  /// Returns the buffer the runtime must sum over the tp group before the next part (may be
  /// empty); the sum is written back into it in place. The reduced sum is consumed (residual add
  /// plus the row-parallel bias) at the start of the next part, or by output() after the last.
  /// A forward that is never followed by a backward (evaluation) is allowed: its state is
  /// dropped when the same (mb, slice) runs forward again (slice 0 also resets the K/V).
  std::span<float> forward(int mb, int slice, int part, std::span<const float> input);
  /// After the last part, once its buffer is reduced: the hidden state to send on (B, x, C);
  /// empty on the last stage.
  std::span<const float> output(int mb, int slice) const;
  /// After the last part on the last stage, once its buffer is reduced: the (scaled) loss of
  /// the slice's tokens.
  double loss(int mb, int slice) const;

  /// backward_input part `part` of (mb, slice); parts run 0..parts()-1 (part 0 is the last
  /// layer's last reduction point). Part 0 takes the output gradient (B, x, C) received from
  /// the next stage (ignored on the last stage, where the loss starts the backward). Returns the
  /// buffer to sum over the tp group, as forward().
  std::span<float> backwardInput(int mb, int slice, int part, std::span<const float> gradOutput);
  /// After the last part, once its buffer is reduced: the gradient of the stage input
  /// (B, x, C); empty on the first stage.
  std::span<const float> inputGrad(int mb, int slice) const;
  /// backward_weight of (mb, slice): accumulates weight gradients, frees the slice's state.
  void backwardWeight(int mb, int slice);

  /// All parameters / gradients of the stage, layer after layer, as one flat array, each layer
  /// laid out as kernels/StageModel.h says.
  std::span<float> params();
  std::span<float> grads();
  /// The flat range of `layer`'s parameters within params() / grads().
  std::pair<size_t, size_t> layerRange(int layer) const;
  /// Flat range of the tied embedding matrix (wte on the first stage, the head's copy on the
  /// last), for the embedding all-reduce; {0, 0} when the stage has none or embeddings are
  /// untied, and also when the stage holds both copies: it then ties them itself, each copy's
  /// gradient receiving both contributions (what the all-reduce gives across two stages).
  std::pair<size_t, size_t> tiedEmbeddingRange() const;
  void zeroGrads();
  /// One Adam step on every parameter of the stage (bias-corrected; step counts from 1). Weight
  /// decay is decoupled (AdamW, as llm.c) and applies to every parameter.
  void adamStep(float lr, float beta1, float beta2, float eps, float weightDecay);
  /// The optimizer's state, laid out as params(): the first and second moments, and the steps
  /// taken (a checkpoint saves and restores them; runtime/Checkpoint.h).
  std::span<float> adamFirstMoment();
  std::span<float> adamSecondMoment();
  int adamSteps() const;
  void setAdamSteps(int steps);
  /// Bytes held by saved activations right now (for checks against the memory model): every
  /// (mb, slice)'s saved state plus the microbatches' K/V (which grow slice by slice) and their
  /// gradient accumulators (freed after slice 0's backward_input).
  size_t savedBytes() const;

private:
  struct Impl;
  std::unique_ptr<Impl> impl;
};

} // namespace pipec::kernels

#endif // PIPEC_KERNELS_CPU_GPT_H
