//===- StageProgram.h - One pipeline stage, written once over a device -*- C++ -*-===//
//
// The stage of the model of kernels/StageModel.h (its layers, parts, lazily completed tp
// reductions, the state a (microbatch, slice) keeps between its forward, backward_input and
// backward_weight, and a microbatch's K/V across Seq1F1B slices) as one definition over a device
// `Dev`. The cpu backend's StageCompute (kernels/cpu/Gpt.cpp, Dev = its host loops) and the cuda
// backend's GpuStage (runtime/cuda/GpuStage.cpp, Dev = CUDA kernels on a stream, on a GPU or the
// emulated device) both run this code: a block variant is written here, once.
//
// What a Dev provides is the concept StageDevice (kernels/StageDevice.h); both devices are
// checked against it where they are defined. The state (the layers, parts and layout, each
// (microbatch, slice)'s saved work, the step count of the optimizer) is private: the backends'
// facades (kernels::StageCompute, GpuStage) reach the stage through the methods below.
// The order of allocations is the device stage's (its arena is sized by running these calls).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_KERNELS_STAGEPROGRAM_H
#define PIPEC_KERNELS_STAGEPROGRAM_H

#include "kernels/StageDevice.h"
#include "kernels/StageModel.h"
#include "kernels/Try.h"

#include "llvm/Support/Error.h"

#include <array>
#include <cassert>
#include <cstdint>
#include <map>
#include <span>
#include <utility>
#include <vector>

namespace pipec::kernels {

template <StageDevice Dev> class StageProgram {
public:
  using Act = typename Dev::Act;
  using F32 = typename Dev::F32;
  using Out = typename Dev::Out;
  using In = typename Dev::In;
  using Loss = typename Dev::Loss;

  /// `args` construct the device.
  template <typename... Args>
  explicit StageProgram(Args &&...args) : dev(std::forward<Args>(args)...) {}

  /// The layers [begin, end) on tp rank `rank` of `tpSize`: their parts and layout. `slices`:
  /// the [begin, end) token ranges of the plan's sub-sequences; `scale` multiplies every
  /// token's loss.
  void setUp(const GptConfig &c, int begin, int end, int rank, int tpSize,
             std::vector<std::pair<int, int>> sliceRanges, float scale) {
    checkConfig(c, tpSize);
    assert(0 <= begin && begin < end && end <= c.numLayers() &&
           "empty or out-of-range layer range");
    assert(rank >= 0 && rank < tpSize && "tp rank out of range");
    assert(!sliceRanges.empty() && sliceRanges.front().first == 0 &&
           sliceRanges.back().second == c.seqLen && "slices must cover the sequence");
    for (size_t s = 0; s < sliceRanges.size(); ++s)
      assert(sliceRanges[s].first < sliceRanges[s].second &&
             (s == 0 || sliceRanges[s - 1].second == sliceRanges[s].first) &&
             "slices must be non-empty and contiguous");
    cfg = c;
    layerBegin = begin;
    layerEnd = end;
    tpRank = rank;
    tp = tpSize;
    slices = std::move(sliceRanges);
    lossScale = scale;
    localHeads = cfg.heads / tp;
    headDim = cfg.channels / cfg.heads;
    localC = localHeads * headDim;
    localF = cfg.ffn / tp;
    localKv = cfg.kvHeadCount() / tp;
    localKvC = localKv * headDim;
    qkvCols = localC + 2 * localKvC;
    fcCols = cfg.swiglu ? 2 * localF : localF;
    localV = cfg.vocab / tp;
    vocabBegin = tpRank * localV;
    layerOffset.assign(1, 0);
    for (int l = layerBegin; l < layerEnd; ++l) {
      for (int sub = 0; sub < layerParts(cfg, l); ++sub)
        forwardParts.push_back({l, sub});
      tensorOffset.push_back(paramRoleOffsets(cfg, l, tp));
      layerOffset.push_back(layerOffset.back() + layerParamCount(cfg, l, tp));
    }
    for (int l = layerEnd - 1; l >= layerBegin; --l)
      for (int sub = 0; sub < layerParts(cfg, l); ++sub)
        backwardParts.push_back({l, sub});
  }
  /// The parameters, handed to the device with zero gradients and moments: each layer's shard of
  /// `initLayers` (every layer whole, tp = 1) when given, else of the seeded initialisation.
  llvm::Error initParams(uint64_t seed, const std::vector<std::vector<float>> *initLayers) {
    std::vector<float> host;
    host.reserve(paramCount());
    for (int l = layerBegin; l < layerEnd; ++l) {
      std::vector<float> shard = shardLayer(
          cfg, l, tpRank, tp, initLayers ? (*initLayers)[size_t(l)] : initLayerFull(cfg, l, seed));
      host.insert(host.end(), shard.begin(), shard.end());
    }
    assert(host.size() == paramCount() && "the layout and the shards disagree");
    return dev.allocateState(std::move(host));
  }

  Dev &device() { return dev; }
  const Dev &device() const { return dev; }
  const GptConfig &config() const { return cfg; }
  const std::vector<std::pair<int, int>> &sliceRanges() const { return slices; }
  /// Reduction points of one forward (== of one backward_input) of the whole stage.
  int parts() const { return int(forwardParts.size()); }
  bool hasEmbedding() const { return layerBegin == 0; }
  bool hasHead() const { return layerEnd == cfg.numLayers(); }
  /// Tokens of a slice of one microbatch (rows of its activations).
  int sliceTokens(int slice) const { return cfg.microbatch * sliceLen(slice); }
  /// The vocabulary rows [begin, end) of wte and the LM head on this tp rank.
  std::pair<int, int> vocabRows() const { return {vocabBegin, vocabBegin + localV}; }

  /// After the last forward part, once its buffer is reduced: completes the part (the residual
  /// add) and returns the hidden state to send on; null on the last stage.
  llvm::Expected<Act *> output(int mb, int slice) {
    SliceWork &w = get(mb, slice);
    assert(w.nextForwardPart == parts() && "output() before the last forward part");
    PIPEC_TRY(finishForward(w));
    return hasHead() ? nullptr : &w.resid;
  }
  /// After the last forward part on the last stage, once its buffer is reduced: the head's loss
  /// state (with tp > 1, completed from the reduced statistics).
  llvm::Expected<const Loss *> loss(int mb, int slice) {
    assert(hasHead() && "loss() on a stage without the head");
    SliceWork &w = get(mb, slice);
    assert(w.nextForwardPart == parts() && "loss() before the last forward part");
    PIPEC_TRY(finishForward(w));
    return &w.head.loss;
  }
  /// After the last backward_input part, once its buffer is reduced: completes the part (norm1
  /// backward plus the residual path) and returns the stage input's gradient; null on the first
  /// stage.
  llvm::Expected<Act *> inputGrad(int mb, int slice) {
    SliceWork &w = get(mb, slice);
    assert(w.nextBackwardPart == parts() && "inputGrad() before the last backward part");
    PIPEC_TRY(finishBackward(w));
    return hasEmbedding() ? nullptr : &w.dResid;
  }

  /// The stage's parameters, gradients and Adam moments (device memory on a GPU), flat, layer
  /// after layer (kernels/StageModel.h's layout).
  std::span<float> state(StageState which) { return dev.state(which); }
  size_t paramCount() const { return layerOffset.back(); }
  /// The flat range of `layer`'s parameters within state().
  std::pair<size_t, size_t> layerRange(int layer) const {
    assert(layer >= layerBegin && layer < layerEnd && "layer not on this stage");
    const size_t l = size_t(layer - layerBegin);
    return {layerOffset[l], layerOffset[l + 1]};
  }
  /// Flat range of the tied embedding matrix (wte on the first stage, the head's copy on the
  /// last), for the embedding all-reduce; {0, 0} when the stage has none or embeddings are
  /// untied, and also when the stage holds both copies: it then ties them itself, each copy's
  /// gradient receiving both contributions (what the all-reduce gives across two stages).
  std::pair<size_t, size_t> tiedEmbeddingRange() const {
    if (!cfg.tiedEmbeddings || tiedHere())
      return {0, 0};
    const size_t matrix = size_t(localV) * size_t(cfg.channels); // the rank's rows
    if (hasEmbedding()) {
      const size_t at = offsetOf(layerBegin, tensors::Wte);
      return {at, at + matrix};
    }
    if (hasHead()) {
      const size_t at = offsetOf(layerEnd - 1, tensors::LmW);
      return {at, at + matrix};
    }
    return {0, 0};
  }
  llvm::Error zeroGrads() { return dev.zeroGrads(); }
  /// One AdamW step on every parameter of the stage (bias-corrected; steps count from 1; the
  /// decay decoupled, on every parameter, as llm.c).
  llvm::Error adamStep(float lr, float beta1, float beta2, float eps, float weightDecay) {
    ++steps;
    return dev.adamUpdate(lr, beta1, beta2, eps, weightDecay, steps);
  }
  int adamSteps() const { return steps; }
  void setAdamSteps(int count) { steps = count; }

  /// Calls `f` on every buffer of saved state: each (mb, slice)'s work and the microbatches'
  /// K/V with their gradient accumulators.
  template <typename F> void forEachSaved(F f) {
    for (auto &[key, w] : work)
      w.forEach(f);
    for (auto &[mb, seq] : sequences)
      for (SequenceBlock &b : seq.blocks)
        f(b.k), f(b.v), f(b.dk), f(b.dv);
  }

private:
  /// What one block saved for one slice (GpuStage.h / Gpt.cpp describe each).
  struct BlockWork {
    Act xIn, q, attOut, attnPartial, xMid, fcPre, mlpPartial;
    F32 ln1Mean, ln1Rstd, attnSaved, ln2Mean, ln2Rstd;
    Act dOut, dFcPre, dLn2, dXmid, dQkv, dLn1;
    template <typename F> void forEach(F f) {
      f(xIn), f(q), f(attOut), f(attnPartial), f(xMid), f(fcPre), f(mlpPartial);
      f(ln1Mean), f(ln1Rstd), f(attnSaved), f(ln2Mean), f(ln2Rstd);
      f(dOut), f(dFcPre), f(dLn2), f(dXmid), f(dQkv), f(dLn1);
    }
  };
  struct HeadWork {
    Act lnfIn, lnfOut, logits, dLogits, dLnfOut;
    F32 lnfMean, lnfRstd, stats;
    Loss loss;
    template <typename F> void forEach(F f) {
      f(lnfIn), f(lnfOut), f(logits), f(dLogits), f(dLnfOut), f(lnfMean), f(lnfRstd), f(stats);
      loss.forEach(f);
    }
  };
  struct SliceWork {
    int nextForwardPart = 0, nextBackwardPart = 0;
    int pendingForward = -1, pendingBackward = -1; // a part whose returned buffer waits
    int n = 0;                                     // tokens of the slice (B * x)
    Act resid, dResid, dEmb;
    std::vector<BlockWork> blocks;
    HeadWork head;
    template <typename F> void forEach(F f) {
      f(resid), f(dResid), f(dEmb);
      for (BlockWork &b : blocks)
        b.forEach(f);
      head.forEach(f);
    }
  };
  /// K/V of the microbatch's slices so far, position-major (tokens, B, K/V width), and the
  /// fp32 gradients later slices add for them.
  struct SequenceBlock {
    Act k, v;
    F32 dk, dv;
  };
  struct SequenceWork {
    int nextForwardSlice = 0;
    int nextBackwardSlice = -1;
    std::vector<SequenceBlock> blocks;
  };
  struct PartRef {
    int layer, sub;
  };

  Dev dev;
  GptConfig cfg;
  int layerBegin = 0, layerEnd = 0, tpRank = 0, tp = 1;
  std::vector<std::pair<int, int>> slices;
  float lossScale = 1;
  int localHeads = 0, headDim = 0, localC = 0, localF = 0;
  int localKv = 0, localKvC = 0, qkvCols = 0, fcCols = 0;
  int localV = 0, vocabBegin = 0;
  std::vector<PartRef> forwardParts, backwardParts;
  std::vector<size_t> layerOffset; // per stage layer, plus the end
  std::vector<std::array<size_t, tensors::kMostRoles>> tensorOffset;
  std::map<std::pair<int, int>, SliceWork> work;
  std::map<int, SequenceWork> sequences;
  int steps = 0; // Adam's

  GptLayerKind kind(int layer) const { return layerKind(cfg, layer); }
  int firstBlock() const { return layerBegin == 0 ? 1 : layerBegin; }
  int blockCount() const {
    int count = 0;
    for (int l = layerBegin; l < layerEnd; ++l)
      count += kind(l) == GptLayerKind::Block;
    return count;
  }
  bool tiedHere() const { return cfg.tiedEmbeddings && hasEmbedding() && hasHead(); }
  int sliceLen(int slice) const {
    return slices[size_t(slice)].second - slices[size_t(slice)].first;
  }
  /// A tensor of the layer by role: the compute copy, or null where the variant has none.
  typename Dev::CPtr param(int layer, int role) {
    const size_t at = tensorOffset[size_t(layer - layerBegin)][size_t(role)];
    return at == tensors::kAbsent ? nullptr
                                  : dev.param(layerOffset[size_t(layer - layerBegin)] + at);
  }
  float *grad(int layer, int role) {
    const size_t at = tensorOffset[size_t(layer - layerBegin)][size_t(role)];
    return at == tensors::kAbsent ? nullptr
                                  : dev.grad(layerOffset[size_t(layer - layerBegin)] + at);
  }
  /// Flat offset of a role's tensor in the stage's parameters (the tied-embedding range).
  size_t offsetOf(int layer, int role) const {
    return layerOffset[size_t(layer - layerBegin)] +
           tensorOffset[size_t(layer - layerBegin)][size_t(role)];
  }
  SequenceWork &sequence(int mb) {
    auto it = sequences.find(mb);
    assert(it != sequences.end() && "slice 0 of this microbatch has not run forward");
    return it->second;
  }
  SliceWork &get(int mb, int slice) {
    auto it = work.find({mb, slice});
    assert(it != work.end() && "no forward state for this (microbatch, slice)");
    return it->second;
  }

  //===-- The block's norms and MLP activation, by variant -----------------===//

  /// The norm's statistics: LayerNorm keeps a mean and an rstd per row, RMSNorm an rstd.
  llvm::Error allocNormStats(F32 &mean, F32 &rstd, int n) {
    if (!cfg.rmsnorm)
      PIPEC_TRY(dev.alloc(mean, size_t(n)));
    return dev.alloc(rstd, size_t(n));
  }
  /// The norm's statistics, then its output `out` (the device's allocation order), then the norm.
  llvm::Error normForward(Act &out, F32 &mean, F32 &rstd, typename Dev::CPtr in, int layer, int w,
                          int b, int n) {
    PIPEC_TRY(allocNormStats(mean, rstd, n));
    PIPEC_TRY(dev.alloc(out, size_t(n) * size_t(cfg.channels)));
    return normCompute(Dev::ptr(out), mean, rstd, in, layer, w, b, n);
  }
  llvm::Error normCompute(typename Dev::Ptr out, F32 &mean, F32 &rstd, typename Dev::CPtr in,
                          int layer, int w, int b, int n) {
    if (cfg.rmsnorm)
      return dev.rmsnormForward(out, Dev::ptr(rstd), in, param(layer, w), n, cfg.channels,
                                cfg.normEps);
    return dev.layernormForward(out, Dev::ptr(mean), Dev::ptr(rstd), in, param(layer, w),
                                param(layer, b), n, cfg.channels, cfg.normEps);
  }
  llvm::Error normBackwardInput(typename Dev::Ptr dIn, typename Dev::CPtr dOut,
                                typename Dev::CPtr in, F32 &mean, F32 &rstd, int layer, int w,
                                int n) {
    if (cfg.rmsnorm)
      return dev.rmsnormBackwardInputAccumulate(dIn, dOut, in, Dev::ptr(rstd), param(layer, w), n,
                                                cfg.channels);
    return dev.layernormBackwardInputAccumulate(dIn, dOut, in, Dev::ptr(mean), Dev::ptr(rstd),
                                                param(layer, w), n, cfg.channels);
  }
  llvm::Error normBackwardWeight(typename Dev::CPtr dOut, typename Dev::CPtr in, F32 &mean,
                                 F32 &rstd, int layer, int w, int b, int n) {
    if (cfg.rmsnorm)
      return dev.rmsnormBackwardWeight(grad(layer, w), dOut, in, Dev::ptr(rstd), n, cfg.channels);
    return dev.layernormBackwardWeight(grad(layer, w), grad(layer, b), dOut, in, Dev::ptr(mean),
                                       Dev::ptr(rstd), n, cfg.channels);
  }
  llvm::Error mlpActivation(typename Dev::Ptr out, Act &fcPre, int n) {
    if (cfg.swiglu)
      return dev.swigluForward(out, Dev::ptr(fcPre), n, localF);
    return dev.geluForward(out, Dev::ptr(fcPre), size_t(n) * size_t(localF));
  }

  //===-- Forward ------------------------------------------------------------===//

  llvm::Error finishForward(SliceWork &w) {
    if (w.pendingForward < 0)
      return llvm::Error::success();
    PartRef p = forwardParts[size_t(w.pendingForward)];
    w.pendingForward = -1;
    if (kind(p.layer) == GptLayerKind::Head) {
      HeadWork &hw = w.head;
      PIPEC_TRY(dev.lossCombine(hw.loss, hw.stats, w.n, tp, lossScale));
      dev.release(hw.stats);
      return llvm::Error::success();
    }
    assert(kind(p.layer) == GptLayerKind::Block && "the embedding's reduction needs no finishing");
    BlockWork &bw = w.blocks[size_t(p.layer - firstBlock())];
    Act &branch = p.sub == 0 ? bw.attnPartial : bw.mlpPartial;
    // Residual add of the reduced branch output; the row-parallel bias is added here, once.
    PIPEC_TRY(dev.residualAdd(Dev::ptr(w.resid), Dev::ptr(branch),
                              param(p.layer, p.sub == 0 ? tensors::AttnB : tensors::ProjB), w.n,
                              cfg.channels));
    dev.release(branch);
    if (p.sub == 0)
      PIPEC_TRY(dev.copy(bw.xMid, w.resid));
    return llvm::Error::success();
  }

public:
  /// Forward part `part` of (mb, slice); part 0 takes the stage's input (ignored on the first
  /// stage). `result`: the buffer the runtime sums over the tp group before the next part (empty
  /// where nothing needs it); its sum is consumed at the start of the next part, or by
  /// output() / loss() after the last. A forward never followed by a backward (evaluation) is
  /// allowed: its state is dropped when the same (mb, slice) runs forward again.
  llvm::Error forward(int mb, int slice, int part, In input, Out &result) {
    assert(slice >= 0 && slice < int(slices.size()) && "slice out of range");
    assert(part >= 0 && part < int(forwardParts.size()) && "part out of range");
    result = Out();
    const auto [begin, end] = slices[size_t(slice)];
    const int x = sliceLen(slice), b = cfg.microbatch, c = cfg.channels, n = b * x;
    const size_t nc = size_t(n) * size_t(c);
    if (part == 0) {
      // A fresh forward; state left by a forward that never ran backward (evaluation) is
      // dropped.
      if (slice == 0) {
        SequenceWork &seq = sequences[mb] = SequenceWork();
        seq.blocks.resize(size_t(blockCount()));
        // A device that holds the whole sequence's K/V allocates it here, before the slice's
        // buffers (the CPU grows it slice by slice, in reserveKv).
        for (SequenceBlock &sb : seq.blocks)
          PIPEC_TRY(dev.reserveSequenceKv(sb.k, sb.v, b, localKvC));
      }
      SequenceWork &seq = sequence(mb);
      assert(seq.nextForwardSlice == slice && "slices of a microbatch run forward in order");
      ++seq.nextForwardSlice;
      SliceWork &w = work[{mb, slice}] = SliceWork();
      w.blocks.resize(size_t(blockCount()));
      w.n = n;
      if (!hasEmbedding())
        PIPEC_TRY(dev.input(w.resid, input, nc));
    }
    SliceWork &w = get(mb, slice);
    assert(part == w.nextForwardPart && "forward parts run in order");
    ++w.nextForwardPart;
    PIPEC_TRY(finishForward(w));
    const PartRef p = forwardParts[size_t(part)];
    switch (kind(p.layer)) {
    case GptLayerKind::Embedding:
      // Vocab-parallel: a rank adds the wte rows it holds, tp rank 0 also wpe; the tp reduction
      // sums them in place (the other terms are zeros: tp = 1's sums to the bit).
      PIPEC_TRY(dev.alloc(w.resid, nc));
      PIPEC_TRY(dev.embeddingForward(Dev::ptr(w.resid), mb, slice, param(p.layer, tensors::Wte),
                                     tpRank == 0 ? param(p.layer, tensors::Wpe) : nullptr, n, x,
                                     begin, c, vocabBegin, localV));
      if (tp > 1)
        result = dev.out(w.resid);
      return llvm::Error::success();
    case GptLayerKind::Head: {
      HeadWork &hw = w.head;
      hw.lnfIn = std::move(w.resid);
      w.resid = Act();
      PIPEC_TRY(normForward(hw.lnfOut, hw.lnfMean, hw.lnfRstd, Dev::ptr(hw.lnfIn), p.layer,
                            tensors::LnfW, tensors::LnfB, n));
      PIPEC_TRY(dev.alloc(hw.logits, size_t(n) * size_t(localV)));
      PIPEC_TRY(dev.matmulTForward(Dev::ptr(hw.logits), Dev::ptr(hw.lnfOut),
                                   param(p.layer, tensors::LmW), n, c, localV));
      if (tp > 1) {
        // Vocab-parallel: the statistics of the rank's columns, which the tp reduction
        // completes; finishForward() takes the loss.
        PIPEC_TRY(dev.lossShardStats(hw.loss, hw.logits, hw.stats, mb, slice, n, localV, vocabBegin,
                                     tpRank, tp));
        w.pendingForward = part;
        result = dev.out(hw.stats);
        return llvm::Error::success();
      }
      return dev.lossForward(hw.loss, hw.logits, mb, slice, n, cfg.vocab, lossScale);
    }
    case GptLayerKind::Block:
      break;
    }
    BlockWork &bw = w.blocks[size_t(p.layer - firstBlock())];
    if (p.sub == 0) {
      // norm1 -> qkv -> (rope of q and k) -> causal attention over keys [0, end) -> attn proj
      // (partial over tp).
      PIPEC_TRY(dev.copy(bw.xIn, w.resid));
      Act ln1Out, qkv; // (B, x, C), (B, x, Cl + 2 Kl)
      PIPEC_TRY(normForward(ln1Out, bw.ln1Mean, bw.ln1Rstd, Dev::ptr(bw.xIn), p.layer,
                            tensors::Ln1W, tensors::Ln1B, n));
      PIPEC_TRY(dev.alloc(qkv, size_t(n) * size_t(qkvCols)));
      PIPEC_TRY(dev.matmulForward(Dev::ptr(qkv), Dev::ptr(ln1Out), param(p.layer, tensors::QkvW),
                                  param(p.layer, tensors::QkvB), n, c, qkvCols));
      // The slice's keys and values: rows [begin, end) of the position-major K/V.
      SequenceBlock &sb = sequence(mb).blocks[size_t(p.layer - firstBlock())];
      PIPEC_TRY(dev.reserveKv(sb.k, sb.v, begin, end, b, localKvC));
      PIPEC_TRY(dev.alloc(bw.q, size_t(n) * size_t(localC)));
      PIPEC_TRY(dev.splitQkv(Dev::ptr(bw.q), Dev::ptr(sb.k), Dev::ptr(sb.v), Dev::ptr(qkv), n, x, b,
                             begin, localC, localKvC));
      if (cfg.rope) { // the K kept for later slices is rotated
        PIPEC_TRY(dev.rope(Dev::ptr(bw.q), RopeRows::Queries, slice, n, localHeads, headDim,
                           cfg.ropeTheta, /*backward=*/false));
        PIPEC_TRY(dev.rope(Dev::at(sb.k, size_t(begin) * size_t(b) * size_t(localKvC)),
                           RopeRows::Keys, slice, n, localKv, headDim, cfg.ropeTheta,
                           /*backward=*/false));
      }
      const StageAttentionShape shape{b, x, begin, localHeads, localKv, headDim};
      PIPEC_TRY(dev.alloc(bw.attnSaved, Dev::attentionSavedFloats(shape)));
      PIPEC_TRY(dev.alloc(bw.attOut, size_t(n) * size_t(localC)));
      PIPEC_TRY(dev.attentionForward(Dev::ptr(bw.attOut), Dev::ptr(bw.attnSaved), Dev::ptr(bw.q),
                                     Dev::ptr(sb.k), Dev::ptr(sb.v), shape));
      PIPEC_TRY(dev.alloc(bw.attnPartial, nc));
      PIPEC_TRY(dev.matmulForward(Dev::ptr(bw.attnPartial), Dev::ptr(bw.attOut),
                                  param(p.layer, tensors::AttnW), nullptr, n, localC, c));
      w.pendingForward = part;
      result = dev.out(bw.attnPartial);
      return llvm::Error::success();
    }
    // norm2 -> fc -> gelu (or silu(gate) * up) -> proj (partial over tp).
    Act ln2Out, fcAct; // (B, x, C), (B, x, Fl)
    PIPEC_TRY(normForward(ln2Out, bw.ln2Mean, bw.ln2Rstd, Dev::ptr(bw.xMid), p.layer, tensors::Ln2W,
                          tensors::Ln2B, n));
    PIPEC_TRY(dev.alloc(bw.fcPre, size_t(n) * size_t(fcCols)));
    PIPEC_TRY(dev.matmulForward(Dev::ptr(bw.fcPre), Dev::ptr(ln2Out), param(p.layer, tensors::FcW),
                                param(p.layer, tensors::FcB), n, c, fcCols));
    PIPEC_TRY(dev.alloc(fcAct, size_t(n) * size_t(localF)));
    PIPEC_TRY(mlpActivation(Dev::ptr(fcAct), bw.fcPre, n));
    PIPEC_TRY(dev.alloc(bw.mlpPartial, nc));
    PIPEC_TRY(dev.matmulForward(Dev::ptr(bw.mlpPartial), Dev::ptr(fcAct),
                                param(p.layer, tensors::ProjW), nullptr, n, localF, c));
    w.pendingForward = part;
    result = dev.out(bw.mlpPartial);
    return llvm::Error::success();
  }

private:
  //===-- backward_input -----------------------------------------------------===//

  llvm::Error finishBackward(SliceWork &w) {
    if (w.pendingBackward < 0)
      return llvm::Error::success();
    PartRef p = backwardParts[size_t(w.pendingBackward)];
    w.pendingBackward = -1;
    if (kind(p.layer) == GptLayerKind::Head) {
      // After the LM head backward: dResid = lnf backward of the reduced dLnfOut.
      HeadWork &hw = w.head;
      PIPEC_TRY(dev.allocZero(w.dResid, size_t(w.n) * size_t(cfg.channels)));
      return normBackwardInput(Dev::ptr(w.dResid), Dev::ptr(hw.dLnfOut), Dev::ptr(hw.lnfIn),
                               hw.lnfMean, hw.lnfRstd, p.layer, tensors::LnfW, w.n);
    }
    assert(kind(p.layer) == GptLayerKind::Block && "the embedding reduces nothing backward");
    BlockWork &bw = w.blocks[size_t(p.layer - firstBlock())];
    if (p.sub == 0) {
      // After the MLP backward: dXmid = dOut + norm2 backward of the reduced dLn2.
      PIPEC_TRY(normBackwardInput(Dev::ptr(w.dResid), Dev::ptr(bw.dLn2), Dev::ptr(bw.xMid),
                                  bw.ln2Mean, bw.ln2Rstd, p.layer, tensors::Ln2W, w.n));
      return dev.copy(bw.dXmid, w.dResid);
    }
    // After the attention backward: dXin = dXmid + norm1 backward of the reduced dLn1.
    return normBackwardInput(Dev::ptr(w.dResid), Dev::ptr(bw.dLn1), Dev::ptr(bw.xIn), bw.ln1Mean,
                             bw.ln1Rstd, p.layer, tensors::Ln1W, w.n);
  }

public:
  /// backward_input part `part` of (mb, slice); part 0 takes the output gradient (ignored on the
  /// last stage, where the loss starts the backward). `result` as forward()'s.
  llvm::Error backwardInput(int mb, int slice, int part, In gradOutput, Out &result) {
    assert(part >= 0 && part < int(backwardParts.size()) && "part out of range");
    result = Out();
    SliceWork &w = get(mb, slice);
    assert(w.nextForwardPart == int(forwardParts.size()) && "backward before the forward ended");
    const auto [begin, end] = slices[size_t(slice)];
    const int x = sliceLen(slice), b = cfg.microbatch, c = cfg.channels, n = w.n;
    const size_t nc = size_t(n) * size_t(c);
    SequenceWork &seq = sequence(mb);
    if (part == 0) {
      PIPEC_TRY(finishForward(w));
      if (seq.nextBackwardSlice < 0)
        seq.nextBackwardSlice = seq.nextForwardSlice - 1;
      assert(seq.nextBackwardSlice == slice && "slices of a microbatch run backward last first");
      --seq.nextBackwardSlice;
      dev.release(w.resid);
      if (!hasHead())
        PIPEC_TRY(dev.input(w.dResid, gradOutput, nc));
    }
    assert(part == w.nextBackwardPart && "backward parts run in order");
    ++w.nextBackwardPart;
    PIPEC_TRY(finishBackward(w));
    const PartRef p = backwardParts[size_t(part)];
    const bool lastPart = part + 1 == int(backwardParts.size());
    switch (kind(p.layer)) {
    case GptLayerKind::Head: {
      // dLogits = (softmax - onehot) * lossScale -> LM head (partial over tp) -> lnf.
      HeadWork &hw = w.head;
      PIPEC_TRY(dev.lossBackward(hw.loss, hw.logits, hw.dLogits, mb, slice, n, localV, vocabBegin,
                                 tp, lossScale));
      PIPEC_TRY(dev.alloc(hw.dLnfOut, nc));
      PIPEC_TRY(dev.matmulTBackwardInput(Dev::ptr(hw.dLnfOut), Dev::ptr(hw.dLogits),
                                         param(p.layer, tensors::LmW), n, c, localV));
      // The lnf backward: once dLnfOut is reduced (tp > 1), or now.
      w.pendingBackward = part;
      if (tp > 1)
        result = dev.out(hw.dLnfOut);
      else
        PIPEC_TRY(finishBackward(w));
      break;
    }
    case GptLayerKind::Embedding:
      w.dEmb = std::move(w.dResid);
      w.dResid = Act();
      break;
    case GptLayerKind::Block: {
      BlockWork &bw = w.blocks[size_t(p.layer - firstBlock())];
      if (p.sub == 0) {
        // MLP backward: dOut -> proj -> gelu (or swiglu) -> fc; returns dLn2 (partial).
        PIPEC_TRY(dev.copy(bw.dOut, w.dResid));
        const size_t nf = size_t(n) * size_t(localF);
        Act dFcAct; // (B, x, Fl)
        PIPEC_TRY(dev.alloc(dFcAct, nf));
        PIPEC_TRY(dev.matmulBackwardInput(Dev::ptr(dFcAct), Dev::ptr(bw.dOut),
                                          param(p.layer, tensors::ProjW), n, localF, c));
        PIPEC_TRY(dev.alloc(bw.dFcPre, size_t(n) * size_t(fcCols)));
        if (cfg.swiglu)
          PIPEC_TRY(dev.swigluBackward(Dev::ptr(bw.dFcPre), Dev::ptr(dFcAct), Dev::ptr(bw.fcPre), n,
                                       localF));
        else
          PIPEC_TRY(
              dev.geluBackward(Dev::ptr(bw.dFcPre), Dev::ptr(dFcAct), Dev::ptr(bw.fcPre), nf));
        PIPEC_TRY(dev.alloc(bw.dLn2, nc));
        PIPEC_TRY(dev.matmulBackwardInput(Dev::ptr(bw.dLn2), Dev::ptr(bw.dFcPre),
                                          param(p.layer, tensors::FcW), n, c, fcCols));
        w.pendingBackward = part;
        result = dev.out(bw.dLn2);
        break;
      }
      // Attention backward: dXmid -> attn proj -> attention -> (rope back) -> qkv; returns dLn1.
      const size_t ncl = size_t(n) * size_t(localC);
      Act dAttOut, dq; // (B, x, Cl) each
      PIPEC_TRY(dev.alloc(dAttOut, ncl));
      PIPEC_TRY(dev.matmulBackwardInput(Dev::ptr(dAttOut), Dev::ptr(bw.dXmid),
                                        param(p.layer, tensors::AttnW), n, localC, c));
      SequenceBlock &sb = seq.blocks[size_t(p.layer - firstBlock())];
      // The first backward of the microbatch: dK/dV as large as K/V (the CPU's every slice so
      // far, which by now is all of them; the GPU's whole sequence).
      if (Dev::size(sb.dk) == 0) {
        PIPEC_TRY(dev.allocZero(sb.dk, Dev::size(sb.k)));
        PIPEC_TRY(dev.allocZero(sb.dv, Dev::size(sb.v)));
      }
      PIPEC_TRY(dev.alloc(dq, ncl));
      const StageAttentionShape shape{b, x, begin, localHeads, localKv, headDim};
      PIPEC_TRY(dev.attentionBackward(
          Dev::ptr(dq), Dev::ptr(sb.dk), Dev::ptr(sb.dv), Dev::ptr(dAttOut), Dev::ptr(bw.attOut),
          Dev::ptr(bw.attnSaved), Dev::ptr(bw.q), Dev::ptr(sb.k), Dev::ptr(sb.v), shape));
      dev.release(bw.attnSaved);
      dev.release(bw.q);
      // The slice's own dK/dV are complete: every later slice has already added its share.
      if (cfg.rope) { // back through the rotations, to qkv's q and k columns
        PIPEC_TRY(dev.rope(Dev::ptr(dq), RopeRows::Queries, slice, n, localHeads, headDim,
                           cfg.ropeTheta, /*backward=*/true));
        PIPEC_TRY(dev.ropeF32(Dev::ptr(sb.dk) + size_t(begin) * size_t(b) * size_t(localKvC), slice,
                              n, localKv, headDim, cfg.ropeTheta));
      }
      PIPEC_TRY(dev.alloc(bw.dQkv, size_t(n) * size_t(qkvCols)));
      PIPEC_TRY(dev.gatherQkv(Dev::ptr(bw.dQkv), Dev::ptr(dq), Dev::ptr(sb.dk), Dev::ptr(sb.dv), n,
                              x, b, begin, localC, localKvC));
      PIPEC_TRY(dev.alloc(bw.dLn1, nc));
      PIPEC_TRY(dev.matmulBackwardInput(Dev::ptr(bw.dLn1), Dev::ptr(bw.dQkv),
                                        param(p.layer, tensors::QkvW), n, c, qkvCols));
      w.pendingBackward = part;
      result = dev.out(bw.dLn1);
      break;
    }
    }
    // Slice 0 is the last of its microbatch to run backward: nobody needs its K/V any more.
    if (lastPart && slice == 0)
      sequences.erase(mb);
    return llvm::Error::success();
  }

  //===-- backward_weight ----------------------------------------------------===//

  /// backward_weight of (mb, slice): accumulates the weight gradients, frees the slice's state.
  llvm::Error backwardWeight(int mb, int slice) {
    SliceWork &w = get(mb, slice);
    assert(w.nextBackwardPart == int(backwardParts.size()) &&
           "backward_weight before backward_input ended");
    PIPEC_TRY(finishBackward(w));
    const int begin = slices[size_t(slice)].first;
    const int x = sliceLen(slice), n = w.n, c = cfg.channels;
    const size_t nc = size_t(n) * size_t(c);
    for (int l = layerBegin; l < layerEnd; ++l) {
      switch (kind(l)) {
      case GptLayerKind::Embedding:
        // With tied embeddings and both copies on this stage, each copy's gradient receives
        // both contributions, in the same order, as the all-reduce would give across stages.
        PIPEC_TRY(dev.embeddingBackward(grad(l, tensors::Wte), grad(l, tensors::Wpe),
                                        Dev::ptr(w.dEmb), mb, slice, n, x, begin, c, vocabBegin,
                                        localV));
        if (tiedHere())
          PIPEC_TRY(dev.embeddingBackward(grad(cfg.numLayers() - 1, tensors::LmW), nullptr,
                                          Dev::ptr(w.dEmb), mb, slice, n, x, begin, c, vocabBegin,
                                          localV));
        break;
      case GptLayerKind::Head: {
        HeadWork &hw = w.head;
        PIPEC_TRY(normBackwardWeight(Dev::ptr(hw.dLnfOut), Dev::ptr(hw.lnfIn), hw.lnfMean,
                                     hw.lnfRstd, l, tensors::LnfW, tensors::LnfB, n));
        if (tiedHere())
          PIPEC_TRY(dev.matmulTBackwardWeight(grad(0, tensors::Wte), Dev::ptr(hw.lnfOut),
                                              Dev::ptr(hw.dLogits), n, c, localV));
        PIPEC_TRY(dev.matmulTBackwardWeight(grad(l, tensors::LmW), Dev::ptr(hw.lnfOut),
                                            Dev::ptr(hw.dLogits), n, c, localV));
        break;
      }
      case GptLayerKind::Block: {
        // The inputs of qkv, fc and proj are recomputed, not kept: O(N C) against the O(N C^2)
        // of the matmuls.
        BlockWork &bw = w.blocks[size_t(l - firstBlock())];
        Act lnOut, fcAct;
        F32 mean, rstd;
        PIPEC_TRY(dev.alloc(lnOut, nc));
        PIPEC_TRY(allocNormStats(mean, rstd, n));
        PIPEC_TRY(normCompute(Dev::ptr(lnOut), mean, rstd, Dev::ptr(bw.xIn), l, tensors::Ln1W,
                              tensors::Ln1B, n));
        PIPEC_TRY(normBackwardWeight(Dev::ptr(bw.dLn1), Dev::ptr(bw.xIn), bw.ln1Mean, bw.ln1Rstd, l,
                                     tensors::Ln1W, tensors::Ln1B, n));
        PIPEC_TRY(dev.matmulBackwardWeight(grad(l, tensors::QkvW), grad(l, tensors::QkvB),
                                           Dev::ptr(lnOut), Dev::ptr(bw.dQkv), n, c, qkvCols));
        PIPEC_TRY(dev.matmulBackwardWeight(grad(l, tensors::AttnW), grad(l, tensors::AttnB),
                                           Dev::ptr(bw.attOut), Dev::ptr(bw.dXmid), n, localC, c));
        PIPEC_TRY(normCompute(Dev::ptr(lnOut), mean, rstd, Dev::ptr(bw.xMid), l, tensors::Ln2W,
                              tensors::Ln2B, n));
        PIPEC_TRY(normBackwardWeight(Dev::ptr(bw.dLn2), Dev::ptr(bw.xMid), bw.ln2Mean, bw.ln2Rstd,
                                     l, tensors::Ln2W, tensors::Ln2B, n));
        PIPEC_TRY(dev.matmulBackwardWeight(grad(l, tensors::FcW), grad(l, tensors::FcB),
                                           Dev::ptr(lnOut), Dev::ptr(bw.dFcPre), n, c, fcCols));
        PIPEC_TRY(dev.alloc(fcAct, size_t(n) * size_t(localF)));
        PIPEC_TRY(mlpActivation(Dev::ptr(fcAct), bw.fcPre, n));
        PIPEC_TRY(dev.matmulBackwardWeight(grad(l, tensors::ProjW), grad(l, tensors::ProjB),
                                           Dev::ptr(fcAct), Dev::ptr(bw.dOut), n, localF, c));
        break;
      }
      }
    }
    work.erase({mb, slice});
    return llvm::Error::success();
  }
};

} // namespace pipec::kernels

#endif // PIPEC_KERNELS_STAGEPROGRAM_H
