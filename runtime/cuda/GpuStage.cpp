//===- GpuStage.cpp - One pipeline stage of the GPT on a GPU --------------===//
//
// kernels/cpu/Gpt.cpp transcribed onto device memory: the same parts, the same lazily completed
// reductions, the same saved state per (microbatch, slice) and per microbatch (K/V and their
// gradient accumulators), with kernels/cuda ops in place of the CPU loops and the glue kernels
// of StageKernels.cu. Comments here only mark where the device version departs. The parameter
// layout is not transcribed: both address it through kernels::paramRoleOffsets. GPT-2's block
// only (Llama-style blocks run on the cpu backend; issue 34 item 1 is to write the stage once).
//
//===----------------------------------------------------------------------===//
#include "runtime/cuda/GpuStage.h"

#include "kernels/cpu/Ops.h"
#include "kernels/cuda/CudaCheck.h"
#include "kernels/cuda/DeviceMemory.h"
#include "runtime/cuda/EmbeddingGrad.h"
#include "runtime/cuda/StageBuffer.h"
#include "runtime/cuda/StageKernels.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cassert>
#include <map>

namespace pipec {

namespace {

namespace cu = kernels::cuda;
namespace launch = runtime::cuda::launch;
using kernels::GptConfig;
using kernels::GptLayerKind;
constexpr cu::DType kF32 = cu::DType::F32;
constexpr cu::DType kBF16 = cu::DType::BF16;

/// Propagates an llvm::Error out of the enclosing function.
#define PIPEC_GPU_TRY(expr)                                                                        \
  do {                                                                                             \
    if (llvm::Error pipecGpuErr = (expr))                                                          \
      return pipecGpuErr;                                                                          \
  } while (false)

using Floats = StreamBuffer<float>; // statistics, log-sum-exps and losses: fp32 in both modes
using Act = DeviceTensor;           // activations and their gradients: the compute type

/// Memory allocated once: device memory (parameters, gradients, moments, tokens, the loss
/// accumulator) or, with `Pinned`, page-locked host memory (the tokens on their way up).
template <typename T, bool Pinned = false> class Owned {
public:
  Owned() = default;
  Owned(const Owned &) = delete;
  Owned &operator=(const Owned &) = delete;
  ~Owned() {
    if (ptr)
      (void)(Pinned ? cudaFreeHost(ptr) : cudaFree(ptr));
  }
  llvm::Error allocate(size_t n) {
    assert(!ptr && "allocated twice");
    if (n == 0)
      return llvm::Error::success();
    void *p = nullptr;
    if constexpr (Pinned)
      PIPEC_CUDA_TRY(cudaMallocHost(&p, n * sizeof(T)));
    else
      PIPEC_CUDA_TRY(cudaMalloc(&p, n * sizeof(T)));
    ptr = static_cast<T *>(p);
    count = n;
    return llvm::Error::success();
  }
  T *data() const { return ptr; }
  size_t size() const { return count; }

private:
  T *ptr = nullptr;
  size_t count = 0;
};

// A layer's tensors by role, where kernels/cpu/Gpt.h's one layout puts them
// (kernels::paramRoleOffsets).
using namespace kernels::tensors;

struct BlockWork {
  Act xIn, q, attOut, attnPartial, xMid, fcPre, mlpPartial;
  Floats ln1Mean, ln1Rstd, lse, ln2Mean, ln2Rstd;
  Act dOut, dFcPre, dLn2, dXmid, dQkv, dLn1;
};

struct HeadWork {
  Act lnfIn, lnfOut, logits; // logits (the rank's vocabulary columns) become dLogits
  Floats lnfMean, lnfRstd, lse, rowLoss;
  Floats stats; // tp > 1: the shards' statistics, reduced over tp in place
  Act dLnfOut;  // tp > 1: reduced over tp in place
};

struct SliceWork {
  int nextForwardPart = 0, nextBackwardPart = 0;
  int pendingForward = -1, pendingBackward = -1;
  int n = 0; // tokens of the slice (B * x)
  Act resid, dResid, dEmb;
  std::vector<BlockWork> blocks;
  HeadWork head;
};

/// K/V of the whole sequence, allocated at slice 0 (position-major (T, B, Cl)); the CPU grows
/// them slice by slice, the attention ops read only the first a + x rows. Their gradients are
/// fp32 in both modes: every slice's backward adds to those of all the earlier keys.
struct SequenceBlock {
  Act k, v;
  Floats dk, dv;
};

struct SequenceWork {
  int nextForwardSlice = 0;
  int nextBackwardSlice = -1;
  std::vector<SequenceBlock> blocks;
};

struct PartRef {
  int layer;
  int sub;
};

} // namespace

struct GpuStage::Impl {
  cu::CudaContext &ctx;
  cudaStream_t stream;
  GptConfig cfg;
  int layerBegin = 0, layerEnd = 0, tpRank = 0, tp = 1;
  std::vector<std::pair<int, int>> slices;
  float lossScale = 1;
  cu::DType dt = kF32; // the compute type (activations, the parameters the kernels read)
  int localHeads = 0, headDim = 0, localC = 0, localF = 0;
  int localV = 0, vocabBegin = 0; // the rank's rows of wte and lm.w
  std::vector<PartRef> forwardParts, backwardParts;
  std::vector<size_t> layerOffset;
  std::vector<std::array<size_t, kMostRoles>> tensorOffset; // per stage layer, by role
  Owned<float> params, grads, adamM, adamV;
  // bf16: the parameters the kernels read, rounded from the fp32 master copy `params` after
  // every optimizer step (same layout). fp32 reads `params` itself.
  Owned<uint16_t> paramsLow;
  Owned<double> lossAcc;
  int adamSteps = 0;
  // Inputs and targets of every (mb, slice), slice rows contiguous: (mb, slice) starts at
  // mb * B * T + B * slices[slice].first. Allocated by the first setBatch (the sizing pass's),
  // uploaded from pinned host copies (inputs, targets, then the embedding backward's plans)
  // without waiting for the device.
  Owned<int32_t> inputs, targets;
  // With the embedding: every (mb, slice)'s EmbeddingGradPlan, at maxEmbeddingGradInts times
  // the slice's offset in `inputs` (its order, then its pieces at n, its merges at 4 n), and
  // how many pieces and merges each has, by mb * slices + slice.
  Owned<int32_t> embeddingPlans;
  std::vector<std::pair<int, int>> embeddingPlanSizes;
  Owned<int32_t, /*Pinned=*/true> hostTokens;
  std::map<std::pair<int, int>, SliceWork> work;
  std::map<int, SequenceWork> sequences;

  explicit Impl(cu::CudaContext &ctx) : ctx(ctx), stream(static_cast<cudaStream_t>(ctx.stream())) {}
  Mem mem() { return Mem{&ctx.allocator(), stream, ctx.sizing()}; }
  /// An activation buffer of `n` elements of the compute type.
  llvm::Error alloc(Act &a, size_t n, bool zero = false) { return a.allocate(mem(), n, dt, zero); }

  GptLayerKind kind(int layer) const { return kernels::layerKind(cfg, layer); }
  int firstBlock() const { return layerBegin == 0 ? 1 : layerBegin; }
  int blockCount() const {
    int count = 0;
    for (int l = layerBegin; l < layerEnd; ++l)
      count += kind(l) == GptLayerKind::Block;
    return count;
  }
  bool hasEmbedding() const { return layerBegin == 0; }
  bool hasHead() const { return layerEnd == cfg.numLayers(); }
  bool tiedHere() const { return cfg.tiedEmbeddings && hasEmbedding() && hasHead(); }
  /// A parameter tensor as the kernels read it (compute type).
  const void *param(int layer, int tensor) const {
    int l = layer - layerBegin;
    if (tensorOffset[size_t(l)][size_t(tensor)] == kAbsent)
      return nullptr;
    const size_t at = layerOffset[size_t(l)] + tensorOffset[size_t(l)][size_t(tensor)];
    if (dt == kBF16)
      return paramsLow.data() + at;
    return params.data() + at;
  }
  /// The compute copy of the parameters from the master copy (bf16 only).
  llvm::Error refreshComputeParams() {
    if (dt != kBF16)
      return llvm::Error::success();
    return cu::convert(ctx, kBF16, paramsLow.data(), kF32, params.data(), params.size());
  }
  float *grad(int layer, int tensor) {
    int l = layer - layerBegin;
    if (tensorOffset[size_t(l)][size_t(tensor)] == kAbsent)
      return nullptr;
    return grads.data() + layerOffset[size_t(l)] + tensorOffset[size_t(l)][size_t(tensor)];
  }
  int sliceLen(int slice) const {
    return slices[size_t(slice)].second - slices[size_t(slice)].first;
  }
  size_t tokenOffset(int mb, int slice) const {
    return size_t(mb) * size_t(cfg.microbatch) * size_t(cfg.seqLen) +
           size_t(cfg.microbatch) * size_t(slices[size_t(slice)].first);
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

  llvm::Error forward(int mb, int slice, int part, TensorView input, TensorView &result);
  llvm::Error finishForward(SliceWork &w);
  llvm::Error backwardInput(int mb, int slice, int part, TensorView gradOutput, TensorView &result);
  llvm::Error finishBackward(SliceWork &w);
  llvm::Error backwardWeight(int mb, int slice);
};

llvm::Error GpuStage::Impl::finishForward(SliceWork &w) {
  if (w.pendingForward < 0)
    return llvm::Error::success();
  PartRef p = forwardParts[size_t(w.pendingForward)];
  w.pendingForward = -1;
  if (kind(p.layer) == GptLayerKind::Head) {
    HeadWork &hw = w.head;
    PIPEC_GPU_TRY(cu::crossEntropyCombine(ctx, hw.rowLoss.data(), hw.lse.data(), hw.stats.data(),
                                          w.n, tp, lossScale));
    hw.stats.reset();
    return llvm::Error::success();
  }
  assert(kind(p.layer) == GptLayerKind::Block && "the embedding's reduction needs no finishing");
  BlockWork &bw = w.blocks[size_t(p.layer - firstBlock())];
  Act &branch = p.sub == 0 ? bw.attnPartial : bw.mlpPartial;
  PIPEC_QUEUE_TRY(ctx, launch::residualAdd(dt, w.resid.data(), branch.data(),
                                           param(p.layer, p.sub == 0 ? AttnB : ProjB), w.n,
                                           cfg.channels, stream));
  branch.reset();
  if (p.sub == 0)
    PIPEC_GPU_TRY(bw.xMid.copyFrom(mem(), w.resid.view()));
  return llvm::Error::success();
}

llvm::Error GpuStage::Impl::forward(int mb, int slice, int part, TensorView input,
                                    TensorView &result) {
  assert(slice >= 0 && slice < int(slices.size()) && "slice out of range");
  assert(part >= 0 && part < int(forwardParts.size()) && "part out of range");
  result = {};
  const auto [begin, end] = slices[size_t(slice)];
  const int x = sliceLen(slice), b = cfg.microbatch, c = cfg.channels, n = b * x;
  const size_t nc = size_t(n) * size_t(c);
  if (part == 0) {
    if (slice == 0) {
      SequenceWork &seq = sequences[mb] = SequenceWork();
      seq.blocks.resize(size_t(blockCount()));
      const size_t kvSize = size_t(cfg.seqLen) * size_t(b) * size_t(localC);
      for (SequenceBlock &sb : seq.blocks) {
        PIPEC_GPU_TRY(alloc(sb.k, kvSize));
        PIPEC_GPU_TRY(alloc(sb.v, kvSize));
      }
    }
    SequenceWork &seq = sequence(mb);
    assert(seq.nextForwardSlice == slice && "slices of a microbatch run forward in order");
    ++seq.nextForwardSlice;
    SliceWork &w = work[{mb, slice}] = SliceWork();
    w.blocks.resize(size_t(blockCount()));
    w.n = n;
    if (!hasEmbedding()) {
      assert(input.count == nc && input.type == dt && "stage input has the wrong size or type");
      PIPEC_GPU_TRY(w.resid.copyFrom(mem(), input));
    }
  }
  SliceWork &w = get(mb, slice);
  assert(part == w.nextForwardPart && "forward parts run in order");
  ++w.nextForwardPart;
  PIPEC_GPU_TRY(finishForward(w));
  const PartRef p = forwardParts[size_t(part)];
  switch (kind(p.layer)) {
  case GptLayerKind::Embedding:
    // Vocab-parallel: the rank's rows of wte, wpe on tp rank 0; the tp reduction sums in place.
    PIPEC_GPU_TRY(alloc(w.resid, nc));
    PIPEC_QUEUE_TRY(ctx, launch::embeddingForward(
                             dt, w.resid.data(), inputs.data() + tokenOffset(mb, slice),
                             param(p.layer, Wte), tpRank == 0 ? param(p.layer, Wpe) : nullptr, n, x,
                             begin, c, vocabBegin, localV, stream));
    if (tp > 1)
      result = w.resid.view();
    return llvm::Error::success();
  case GptLayerKind::Head: {
    HeadWork &hw = w.head;
    hw.lnfIn = std::move(w.resid);
    PIPEC_GPU_TRY(hw.lnfMean.allocate(mem(), size_t(n)));
    PIPEC_GPU_TRY(hw.lnfRstd.allocate(mem(), size_t(n)));
    PIPEC_GPU_TRY(alloc(hw.lnfOut, nc));
    PIPEC_GPU_TRY(cu::layernormForward(ctx, dt, hw.lnfOut.data(), hw.lnfMean.data(),
                                       hw.lnfRstd.data(), hw.lnfIn.data(), param(p.layer, LnfW),
                                       param(p.layer, LnfB), n, c));
    PIPEC_GPU_TRY(alloc(hw.logits, size_t(n) * size_t(localV)));
    PIPEC_GPU_TRY(cu::matmulTForward(ctx, dt, hw.logits.data(), hw.lnfOut.data(),
                                     param(p.layer, LmW), n, c, localV));
    PIPEC_GPU_TRY(hw.lse.allocate(mem(), size_t(n)));
    PIPEC_GPU_TRY(hw.rowLoss.allocate(mem(), size_t(n)));
    const int32_t *tgt = targets.data() + tokenOffset(mb, slice);
    if (tp > 1) {
      // Vocab-parallel: the statistics of the rank's columns; finishForward() takes the loss.
      PIPEC_GPU_TRY(hw.stats.allocate(mem(), kernels::ops::crossEntropyStatsFloats(n, tp)));
      PIPEC_GPU_TRY(cu::crossEntropyShardStats(ctx, dt, hw.stats.data(), hw.logits.data(), tgt, n,
                                               localV, vocabBegin, tpRank, tp));
      w.pendingForward = part;
      result = TensorView(hw.stats.data(), hw.stats.size(), kF32);
      return llvm::Error::success();
    }
    PIPEC_GPU_TRY(cu::crossEntropyForward(ctx, dt, hw.rowLoss.data(), hw.lse.data(),
                                          hw.logits.data(), tgt, n, cfg.vocab, lossScale));
    return llvm::Error::success();
  }
  case GptLayerKind::Block:
    break;
  }
  BlockWork &bw = w.blocks[size_t(p.layer - firstBlock())];
  if (p.sub == 0) {
    PIPEC_GPU_TRY(bw.xIn.copyFrom(mem(), w.resid.view()));
    PIPEC_GPU_TRY(bw.ln1Mean.allocate(mem(), size_t(n)));
    PIPEC_GPU_TRY(bw.ln1Rstd.allocate(mem(), size_t(n)));
    Act ln1Out, qkv; // (B, x, C), (B, x, 3 Cl)
    PIPEC_GPU_TRY(alloc(ln1Out, nc));
    PIPEC_GPU_TRY(cu::layernormForward(ctx, dt, ln1Out.data(), bw.ln1Mean.data(), bw.ln1Rstd.data(),
                                       bw.xIn.data(), param(p.layer, Ln1W), param(p.layer, Ln1B), n,
                                       c));
    PIPEC_GPU_TRY(alloc(qkv, size_t(n) * 3 * size_t(localC)));
    PIPEC_GPU_TRY(cu::matmulForward(ctx, dt, qkv.data(), ln1Out.data(), param(p.layer, QkvW),
                                    param(p.layer, QkvB), n, c, 3 * localC));
    SequenceBlock &sb = sequence(mb).blocks[size_t(p.layer - firstBlock())];
    PIPEC_GPU_TRY(alloc(bw.q, size_t(n) * size_t(localC)));
    PIPEC_QUEUE_TRY(ctx, launch::splitQkv(dt, bw.q.data(), sb.k.data(), sb.v.data(), qkv.data(), n,
                                          x, b, begin, localC, stream));
    const cu::AttentionShape shape{b, x, begin, localHeads, headDim};
    PIPEC_GPU_TRY(bw.lse.allocate(mem(), size_t(b) * size_t(localHeads) * size_t(x)));
    PIPEC_GPU_TRY(alloc(bw.attOut, size_t(n) * size_t(localC)));
    PIPEC_GPU_TRY(cu::attentionForward(ctx, dt, bw.attOut.data(), bw.lse.data(), bw.q.data(),
                                       sb.k.data(), sb.v.data(), shape));
    PIPEC_GPU_TRY(alloc(bw.attnPartial, nc));
    PIPEC_GPU_TRY(cu::matmulForward(ctx, dt, bw.attnPartial.data(), bw.attOut.data(),
                                    param(p.layer, AttnW), nullptr, n, localC, c));
    w.pendingForward = part;
    result = bw.attnPartial.view();
    return llvm::Error::success();
  }
  PIPEC_GPU_TRY(bw.ln2Mean.allocate(mem(), size_t(n)));
  PIPEC_GPU_TRY(bw.ln2Rstd.allocate(mem(), size_t(n)));
  Act ln2Out, fcAct; // (B, x, C), (B, x, Fl)
  PIPEC_GPU_TRY(alloc(ln2Out, nc));
  PIPEC_GPU_TRY(cu::layernormForward(ctx, dt, ln2Out.data(), bw.ln2Mean.data(), bw.ln2Rstd.data(),
                                     bw.xMid.data(), param(p.layer, Ln2W), param(p.layer, Ln2B), n,
                                     c));
  const size_t nf = size_t(n) * size_t(localF);
  PIPEC_GPU_TRY(alloc(bw.fcPre, nf));
  PIPEC_GPU_TRY(cu::matmulForward(ctx, dt, bw.fcPre.data(), ln2Out.data(), param(p.layer, FcW),
                                  param(p.layer, FcB), n, c, localF));
  PIPEC_GPU_TRY(alloc(fcAct, nf));
  PIPEC_GPU_TRY(cu::geluForward(ctx, dt, fcAct.data(), bw.fcPre.data(), nf));
  PIPEC_GPU_TRY(alloc(bw.mlpPartial, nc));
  PIPEC_GPU_TRY(cu::matmulForward(ctx, dt, bw.mlpPartial.data(), fcAct.data(),
                                  param(p.layer, ProjW), nullptr, n, localF, c));
  w.pendingForward = part;
  result = bw.mlpPartial.view();
  return llvm::Error::success();
}

llvm::Error GpuStage::Impl::finishBackward(SliceWork &w) {
  if (w.pendingBackward < 0)
    return llvm::Error::success();
  PartRef p = backwardParts[size_t(w.pendingBackward)];
  w.pendingBackward = -1;
  if (kind(p.layer) == GptLayerKind::Head) {
    HeadWork &hw = w.head;
    PIPEC_GPU_TRY(alloc(w.dResid, size_t(w.n) * size_t(cfg.channels), /*zero=*/true));
    return cu::layernormBackwardInputAccumulate(
        ctx, dt, w.dResid.data(), hw.dLnfOut.data(), hw.lnfIn.data(), hw.lnfMean.data(),
        hw.lnfRstd.data(), param(p.layer, LnfW), w.n, cfg.channels);
  }
  assert(kind(p.layer) == GptLayerKind::Block && "the embedding reduces nothing backward");
  BlockWork &bw = w.blocks[size_t(p.layer - firstBlock())];
  const int n = w.n, c = cfg.channels;
  if (p.sub == 0) {
    PIPEC_GPU_TRY(cu::layernormBackwardInputAccumulate(
        ctx, dt, w.dResid.data(), bw.dLn2.data(), bw.xMid.data(), bw.ln2Mean.data(),
        bw.ln2Rstd.data(), param(p.layer, Ln2W), n, c));
    return bw.dXmid.copyFrom(mem(), w.dResid.view());
  }
  return cu::layernormBackwardInputAccumulate(ctx, dt, w.dResid.data(), bw.dLn1.data(),
                                              bw.xIn.data(), bw.ln1Mean.data(), bw.ln1Rstd.data(),
                                              param(p.layer, Ln1W), n, c);
}

llvm::Error GpuStage::Impl::backwardInput(int mb, int slice, int part, TensorView gradOutput,
                                          TensorView &result) {
  assert(part >= 0 && part < int(backwardParts.size()) && "part out of range");
  result = {};
  SliceWork &w = get(mb, slice);
  assert(w.nextForwardPart == int(forwardParts.size()) && "backward before the forward ended");
  const int begin = slices[size_t(slice)].first;
  const int x = sliceLen(slice), b = cfg.microbatch, c = cfg.channels, n = b * x;
  const size_t nc = size_t(n) * size_t(c);
  SequenceWork &seq = sequence(mb);
  if (part == 0) {
    PIPEC_GPU_TRY(finishForward(w));
    if (seq.nextBackwardSlice < 0)
      seq.nextBackwardSlice = seq.nextForwardSlice - 1;
    assert(seq.nextBackwardSlice == slice && "slices of a microbatch run backward last first");
    --seq.nextBackwardSlice;
    w.resid.reset();
    if (!hasHead()) {
      assert(gradOutput.count == nc && gradOutput.type == dt &&
             "output gradient has the wrong size or type");
      PIPEC_GPU_TRY(w.dResid.copyFrom(mem(), gradOutput));
    }
  }
  assert(part == w.nextBackwardPart && "backward parts run in order");
  ++w.nextBackwardPart;
  PIPEC_GPU_TRY(finishBackward(w));
  const PartRef p = backwardParts[size_t(part)];
  const bool lastPart = part + 1 == int(backwardParts.size());
  switch (kind(p.layer)) {
  case GptLayerKind::Head: {
    HeadWork &hw = w.head;
    const int32_t *tgt = targets.data() + tokenOffset(mb, slice);
    // dLogits overwrite the logits in place (the op allows it).
    PIPEC_GPU_TRY(cu::crossEntropyBackward(ctx, dt, hw.logits.data(), hw.logits.data(),
                                           hw.lse.data(), tgt, n, localV, lossScale, vocabBegin));
    hw.lse.reset();
    PIPEC_GPU_TRY(alloc(hw.dLnfOut, nc));
    PIPEC_GPU_TRY(cu::matmulTBackwardInput(ctx, dt, hw.dLnfOut.data(), hw.logits.data(),
                                           param(p.layer, LmW), n, c, localV));
    // The lnf backward: once dLnfOut is reduced (tp > 1), or now.
    w.pendingBackward = part;
    if (tp > 1)
      result = hw.dLnfOut.view();
    else
      PIPEC_GPU_TRY(finishBackward(w));
    break;
  }
  case GptLayerKind::Embedding:
    w.dEmb = std::move(w.dResid);
    break;
  case GptLayerKind::Block: {
    BlockWork &bw = w.blocks[size_t(p.layer - firstBlock())];
    if (p.sub == 0) {
      PIPEC_GPU_TRY(bw.dOut.copyFrom(mem(), w.dResid.view()));
      const size_t nf = size_t(n) * size_t(localF);
      Act dFcAct; // (B, x, Fl)
      PIPEC_GPU_TRY(alloc(dFcAct, nf));
      PIPEC_GPU_TRY(cu::matmulBackwardInput(ctx, dt, dFcAct.data(), bw.dOut.data(),
                                            param(p.layer, ProjW), n, localF, c));
      PIPEC_GPU_TRY(alloc(bw.dFcPre, nf));
      PIPEC_GPU_TRY(
          cu::geluBackward(ctx, dt, bw.dFcPre.data(), dFcAct.data(), bw.fcPre.data(), nf));
      PIPEC_GPU_TRY(alloc(bw.dLn2, nc));
      PIPEC_GPU_TRY(cu::matmulBackwardInput(ctx, dt, bw.dLn2.data(), bw.dFcPre.data(),
                                            param(p.layer, FcW), n, c, localF));
      w.pendingBackward = part;
      result = bw.dLn2.view();
      break;
    }
    const size_t ncl = size_t(n) * size_t(localC);
    Act dAttOut, dq; // (B, x, Cl) each
    PIPEC_GPU_TRY(alloc(dAttOut, ncl));
    PIPEC_GPU_TRY(cu::matmulBackwardInput(ctx, dt, dAttOut.data(), bw.dXmid.data(),
                                          param(p.layer, AttnW), n, localC, c));
    SequenceBlock &sb = seq.blocks[size_t(p.layer - firstBlock())];
    if (sb.dk.empty()) { // the first backward of the microbatch
      PIPEC_GPU_TRY(sb.dk.allocate(mem(), sb.k.size(), /*zero=*/true));
      PIPEC_GPU_TRY(sb.dv.allocate(mem(), sb.v.size(), /*zero=*/true));
    }
    PIPEC_GPU_TRY(alloc(dq, ncl));
    const cu::AttentionShape shape{b, x, begin, localHeads, headDim};
    PIPEC_GPU_TRY(cu::attentionBackward(ctx, dt, dq.data(), sb.dk.data(), sb.dv.data(),
                                        dAttOut.data(), bw.attOut.data(), bw.lse.data(),
                                        bw.q.data(), sb.k.data(), sb.v.data(), shape));
    bw.lse.reset();
    bw.q.reset();
    PIPEC_GPU_TRY(alloc(bw.dQkv, 3 * ncl));
    PIPEC_QUEUE_TRY(ctx, launch::gatherQkv(dt, bw.dQkv.data(), dq.data(), sb.dk.data(),
                                           sb.dv.data(), n, x, b, begin, localC, stream));
    PIPEC_GPU_TRY(alloc(bw.dLn1, nc));
    PIPEC_GPU_TRY(cu::matmulBackwardInput(ctx, dt, bw.dLn1.data(), bw.dQkv.data(),
                                          param(p.layer, QkvW), n, c, 3 * localC));
    w.pendingBackward = part;
    result = bw.dLn1.view();
    break;
  }
  }
  if (lastPart && slice == 0)
    sequences.erase(mb);
  return llvm::Error::success();
}

llvm::Error GpuStage::Impl::backwardWeight(int mb, int slice) {
  SliceWork &w = get(mb, slice);
  assert(w.nextBackwardPart == int(backwardParts.size()) &&
         "backward_weight before backward_input ended");
  PIPEC_GPU_TRY(finishBackward(w));
  const int begin = slices[size_t(slice)].first;
  const int x = sliceLen(slice), n = w.n, c = cfg.channels;
  const size_t nc = size_t(n) * size_t(c);
  const int32_t *in = inputs.data() + tokenOffset(mb, slice);
  for (int l = layerBegin; l < layerEnd; ++l) {
    switch (kind(l)) {
    case GptLayerKind::Embedding: {
      const int32_t *at = embeddingPlans.data() + maxEmbeddingGradInts(tokenOffset(mb, slice));
      const size_t planIndex = size_t(mb) * slices.size() + size_t(slice);
      assert(planIndex < embeddingPlanSizes.size() && "setBatch planned every (mb, slice)");
      auto [pieces, merges] = embeddingPlanSizes[planIndex];
      // Scratch of the most slots any batch's plan can use: the same request every step.
      cu::ScratchBuffer slots(ctx.allocator());
      PIPEC_GPU_TRY(slots.allocate(maxEmbeddingGradSlots(size_t(n)) * size_t(c) * sizeof(float)));
      const launch::EmbeddingGradArgs plan{at,     at + n,           pieces, at + 4 * size_t(n),
                                           merges, slots.as<float>()};
      PIPEC_QUEUE_TRY(ctx,
                      launch::embeddingBackward(dt, grad(l, Wte), grad(l, Wpe), w.dEmb.data(), in,
                                                plan, n, x, begin, c, vocabBegin, localV, stream));
      if (tiedHere())
        PIPEC_QUEUE_TRY(ctx, launch::embeddingBackward(dt, grad(cfg.numLayers() - 1, LmW), nullptr,
                                                       w.dEmb.data(), in, plan, n, x, begin, c,
                                                       vocabBegin, localV, stream));
      break;
    }
    case GptLayerKind::Head: {
      HeadWork &hw = w.head;
      PIPEC_GPU_TRY(cu::layernormBackwardWeight(ctx, dt, grad(l, LnfW), grad(l, LnfB),
                                                hw.dLnfOut.data(), hw.lnfIn.data(),
                                                hw.lnfMean.data(), hw.lnfRstd.data(), n, c));
      if (tiedHere())
        PIPEC_GPU_TRY(cu::matmulTBackwardWeight(ctx, dt, grad(0, Wte), hw.lnfOut.data(),
                                                hw.logits.data(), n, c, localV));
      PIPEC_GPU_TRY(cu::matmulTBackwardWeight(ctx, dt, grad(l, LmW), hw.lnfOut.data(),
                                              hw.logits.data(), n, c, localV));
      break;
    }
    case GptLayerKind::Block: {
      BlockWork &bw = w.blocks[size_t(l - firstBlock())];
      Act lnOut, fcAct; // recomputed inputs of qkv, fc and proj
      Floats mean, rstd;
      PIPEC_GPU_TRY(alloc(lnOut, nc));
      PIPEC_GPU_TRY(mean.allocate(mem(), size_t(n)));
      PIPEC_GPU_TRY(rstd.allocate(mem(), size_t(n)));
      PIPEC_GPU_TRY(cu::layernormForward(ctx, dt, lnOut.data(), mean.data(), rstd.data(),
                                         bw.xIn.data(), param(l, Ln1W), param(l, Ln1B), n, c));
      PIPEC_GPU_TRY(cu::layernormBackwardWeight(ctx, dt, grad(l, Ln1W), grad(l, Ln1B),
                                                bw.dLn1.data(), bw.xIn.data(), bw.ln1Mean.data(),
                                                bw.ln1Rstd.data(), n, c));
      PIPEC_GPU_TRY(cu::matmulBackwardWeight(ctx, dt, grad(l, QkvW), grad(l, QkvB), lnOut.data(),
                                             bw.dQkv.data(), n, c, 3 * localC));
      PIPEC_GPU_TRY(cu::matmulBackwardWeight(ctx, dt, grad(l, AttnW), grad(l, AttnB),
                                             bw.attOut.data(), bw.dXmid.data(), n, localC, c));
      PIPEC_GPU_TRY(cu::layernormForward(ctx, dt, lnOut.data(), mean.data(), rstd.data(),
                                         bw.xMid.data(), param(l, Ln2W), param(l, Ln2B), n, c));
      PIPEC_GPU_TRY(cu::layernormBackwardWeight(ctx, dt, grad(l, Ln2W), grad(l, Ln2B),
                                                bw.dLn2.data(), bw.xMid.data(), bw.ln2Mean.data(),
                                                bw.ln2Rstd.data(), n, c));
      PIPEC_GPU_TRY(cu::matmulBackwardWeight(ctx, dt, grad(l, FcW), grad(l, FcB), lnOut.data(),
                                             bw.dFcPre.data(), n, c, localF));
      const size_t nf = size_t(n) * size_t(localF);
      PIPEC_GPU_TRY(alloc(fcAct, nf));
      PIPEC_GPU_TRY(cu::geluForward(ctx, dt, fcAct.data(), bw.fcPre.data(), nf));
      PIPEC_GPU_TRY(cu::matmulBackwardWeight(ctx, dt, grad(l, ProjW), grad(l, ProjB), fcAct.data(),
                                             bw.dOut.data(), n, localF, c));
      break;
    }
    }
  }
  work.erase({mb, slice});
  return llvm::Error::success();
}

GpuStage::GpuStage(std::unique_ptr<Impl> impl) : impl(std::move(impl)) {}
GpuStage::~GpuStage() = default;

size_t GpuStage::paramCount(const GptConfig &cfg, int layerBegin, int layerEnd, int tp) {
  size_t n = 0;
  for (int l = layerBegin; l < layerEnd; ++l)
    n += kernels::layerParamCount(cfg, l, tp);
  return n;
}

size_t GpuStage::stateBytes(const GptConfig &cfg, int layerBegin, int layerEnd, int tp,
                            cu::DType dtype) {
  const size_t n = paramCount(cfg, layerBegin, layerEnd, tp);
  // params, grads, adamM, adamV; paramsLow; lossAcc (create()'s allocations).
  return 4 * n * sizeof(float) + (dtype == kBF16 ? n * sizeof(uint16_t) : 0) + sizeof(double);
}

llvm::Expected<std::unique_ptr<GpuStage>>
GpuStage::create(cu::CudaContext &ctx, const GptConfig &cfg, int layerBegin, int layerEnd,
                 int tpRank, int tp, uint64_t seed, std::vector<std::pair<int, int>> slices,
                 float lossScale, cu::DType dtype,
                 const std::vector<std::vector<float>> *initLayers) {
  assert(0 <= layerBegin && layerBegin < layerEnd && layerEnd <= cfg.numLayers() &&
         "empty or out-of-range layer range");
  assert(tpRank >= 0 && tpRank < tp && cfg.heads % tp == 0 && cfg.ffn % tp == 0 &&
         cfg.vocab % tp == 0 && "bad tensor-parallel split");
  assert(!slices.empty() && slices.front().first == 0 && slices.back().second == cfg.seqLen &&
         "slices must cover the sequence");
  assert(cfg.isGpt2() && "GpuStage runs GPT-2's block; gpuRunsTheBlock refuses the others");
  auto m = std::make_unique<Impl>(ctx);
  m->cfg = cfg;
  m->layerBegin = layerBegin;
  m->layerEnd = layerEnd;
  m->tpRank = tpRank;
  m->tp = tp;
  m->slices = std::move(slices);
  m->lossScale = lossScale;
  m->dt = dtype;
  m->localHeads = cfg.heads / tp;
  m->headDim = cfg.channels / cfg.heads;
  m->localC = m->localHeads * m->headDim;
  m->localF = cfg.ffn / tp;
  m->localV = cfg.vocab / tp;
  m->vocabBegin = tpRank * m->localV;
  std::vector<float> host;
  m->layerOffset.push_back(0);
  for (int l = layerBegin; l < layerEnd; ++l) {
    for (int sub = 0; sub < kernels::layerParts(cfg, l); ++sub)
      m->forwardParts.push_back({l, sub});
    m->tensorOffset.push_back(kernels::paramRoleOffsets(cfg, l, tp));
    std::vector<float> shard = kernels::shardLayer(
        cfg, l, tpRank, tp,
        initLayers ? (*initLayers)[size_t(l)] : kernels::initLayerFull(cfg, l, seed));
    host.insert(host.end(), shard.begin(), shard.end());
    m->layerOffset.push_back(host.size());
  }
  for (int l = layerEnd - 1; l >= layerBegin; --l)
    for (int sub = 0; sub < kernels::layerParts(cfg, l); ++sub)
      m->backwardParts.push_back({l, sub});
  assert(host.size() == paramCount(cfg, layerBegin, layerEnd, tp) && "stateBytes() is wrong");
  const size_t bytes = host.size() * sizeof(float);
  PIPEC_GPU_TRY(m->params.allocate(host.size()));
  PIPEC_GPU_TRY(m->grads.allocate(host.size()));
  PIPEC_GPU_TRY(m->adamM.allocate(host.size()));
  PIPEC_GPU_TRY(m->adamV.allocate(host.size()));
  PIPEC_GPU_TRY(m->lossAcc.allocate(1));
  PIPEC_GPU_TRY(ctx.upload(m->params.data(), host.data(), bytes));
  PIPEC_GPU_TRY(ctx.memsetZero(m->grads.data(), bytes));
  PIPEC_GPU_TRY(ctx.memsetZero(m->adamM.data(), bytes));
  PIPEC_GPU_TRY(ctx.memsetZero(m->adamV.data(), bytes));
  PIPEC_GPU_TRY(ctx.memsetZero(m->lossAcc.data(), sizeof(double)));
  if (dtype == kBF16)
    PIPEC_GPU_TRY(m->paramsLow.allocate(host.size()));
  PIPEC_GPU_TRY(m->refreshComputeParams());
  PIPEC_GPU_TRY(ctx.synchronize());
  return std::unique_ptr<GpuStage>(new GpuStage(std::move(m)));
}

int GpuStage::parts() const { return int(impl->forwardParts.size()); }
bool GpuStage::hasEmbedding() const { return impl->hasEmbedding(); }
bool GpuStage::hasHead() const { return impl->hasHead(); }

llvm::Error GpuStage::setBatch(const std::vector<std::vector<int32_t>> &tokens) {
  Impl &m = *impl;
  if (!m.hasEmbedding() && !m.hasHead())
    return llvm::Error::success();
  const int b = m.cfg.microbatch, t = m.cfg.seqLen;
  std::vector<int32_t> in, tgt, plans;
  std::vector<std::pair<int, int>> planSizes;
  in.reserve(tokens.size() * size_t(b) * size_t(t));
  tgt.reserve(in.capacity());
  for (const std::vector<int32_t> &mb : tokens) {
    assert(mb.size() == size_t(b) * size_t(t + 1) && "batch has the wrong size");
    for (auto [begin, end] : m.slices) {
      const size_t first = in.size();
      for (int s = 0; s < b; ++s)
        for (int p = begin; p < end; ++p) {
          int32_t token = mb[size_t(s) * size_t(t + 1) + size_t(p)];
          assert(token >= 0 && token < m.cfg.vocab && "input token out of the vocabulary");
          in.push_back(token);
          tgt.push_back(mb[size_t(s) * size_t(t + 1) + size_t(p) + 1]);
        }
      if (m.hasEmbedding()) { // the slice's plan at its fixed place (Impl::embeddingPlans)
        const size_t rows = in.size() - first;
        const EmbeddingGradPlan plan =
            planEmbeddingGrad(std::span<const int32_t>(in).subspan(first, rows), m.vocabBegin,
                              m.vocabBegin + m.localV);
        plans.resize(maxEmbeddingGradInts(in.size()), 0);
        int32_t *at = plans.data() + maxEmbeddingGradInts(first);
        std::copy(plan.order.begin(), plan.order.end(), at);
        std::copy(plan.pieces.begin(), plan.pieces.end(), at + rows);
        std::copy(plan.merges.begin(), plan.merges.end(), at + 4 * rows);
        planSizes.emplace_back(plan.numPieces(), plan.numMerges());
      }
    }
  }
  // Every step's batch has the same size: allocated once, by the first call, which is the sizing
  // pass's (a step allocates nothing).
  if (!m.inputs.data() && !in.empty()) {
    if (!m.ctx.sizing())
      return llvm::createStringError(
          llvm::inconvertibleErrorCode(),
          "GpuStage::setBatch: the batch's device buffers are allocated in the sizing pass, "
          "before step 0 (runtime/cuda/DeviceArena.h); this call is outside it");
    PIPEC_GPU_TRY(m.inputs.allocate(in.size()));
    PIPEC_GPU_TRY(m.targets.allocate(tgt.size()));
    if (!plans.empty())
      PIPEC_GPU_TRY(m.embeddingPlans.allocate(plans.size()));
    PIPEC_GPU_TRY(m.hostTokens.allocate(in.size() + tgt.size() + plans.size()));
  }
  assert(m.inputs.size() == in.size() && "the batch changed size between steps");
  m.embeddingPlanSizes = std::move(planSizes);
  if (in.empty())
    return llvm::Error::success();
  // The previous step's copies out of the pinned buffer have run: the runtime waits for the
  // stream at the end of every step.
  int32_t *host = m.hostTokens.data();
  std::copy(in.begin(), in.end(), host);
  std::copy(tgt.begin(), tgt.end(), host + in.size());
  std::copy(plans.begin(), plans.end(), host + in.size() + tgt.size());
  PIPEC_QUEUE_TRY(m.ctx, cudaMemcpyAsync(m.inputs.data(), host, in.size() * sizeof(int32_t),
                                         cudaMemcpyHostToDevice, m.stream));
  PIPEC_QUEUE_TRY(m.ctx,
                  cudaMemcpyAsync(m.targets.data(), host + in.size(), tgt.size() * sizeof(int32_t),
                                  cudaMemcpyHostToDevice, m.stream));
  if (!plans.empty())
    PIPEC_QUEUE_TRY(m.ctx, cudaMemcpyAsync(m.embeddingPlans.data(), host + in.size() + tgt.size(),
                                           plans.size() * sizeof(int32_t), cudaMemcpyHostToDevice,
                                           m.stream));
  return llvm::Error::success();
}

llvm::Expected<TensorView> GpuStage::forward(int mb, int slice, int part, TensorView input) {
  TensorView result;
  if (auto err = impl->forward(mb, slice, part, input, result))
    return err;
  return result;
}

llvm::Expected<TensorView> GpuStage::output(int mb, int slice) {
  SliceWork &w = impl->get(mb, slice);
  assert(w.nextForwardPart == parts() && "output() before the last forward part");
  if (auto err = impl->finishForward(w))
    return err;
  if (hasHead())
    return TensorView();
  return w.resid.view();
}

llvm::Error GpuStage::accumulateLoss(int mb, int slice) {
  assert(hasHead() && "accumulateLoss() on a stage without the head");
  SliceWork &w = impl->get(mb, slice);
  assert(w.nextForwardPart == parts() && "loss before the last forward part");
  if (auto err = impl->finishForward(w)) // with tp > 1, the loss of the reduced statistics
    return err;
  PIPEC_QUEUE_TRY(impl->ctx, launch::accumulateSum(impl->lossAcc.data(), w.head.rowLoss.data(), w.n,
                                                   impl->stream));
  return llvm::Error::success();
}

llvm::Expected<double> GpuStage::takeLoss() {
  double loss = 0;
  if (auto err = impl->ctx.download(&loss, impl->lossAcc.data(), sizeof(double)))
    return err;
  if (auto err = impl->ctx.memsetZero(impl->lossAcc.data(), sizeof(double)))
    return err;
  return loss;
}

llvm::Expected<TensorView> GpuStage::backwardInput(int mb, int slice, int part,
                                                   TensorView gradOutput) {
  TensorView result;
  if (auto err = impl->backwardInput(mb, slice, part, gradOutput, result))
    return err;
  return result;
}

llvm::Expected<TensorView> GpuStage::inputGrad(int mb, int slice) {
  SliceWork &w = impl->get(mb, slice);
  assert(w.nextBackwardPart == parts() && "inputGrad() before the last backward part");
  if (auto err = impl->finishBackward(w))
    return err;
  if (hasEmbedding())
    return TensorView();
  return w.dResid.view();
}

llvm::Error GpuStage::backwardWeight(int mb, int slice) { return impl->backwardWeight(mb, slice); }

std::span<float> GpuStage::params() { return {impl->params.data(), impl->params.size()}; }
std::span<float> GpuStage::grads() { return {impl->grads.data(), impl->grads.size()}; }

std::pair<size_t, size_t> GpuStage::layerRange(int layer) const {
  assert(layer >= impl->layerBegin && layer < impl->layerEnd && "layer not on this stage");
  size_t l = size_t(layer - impl->layerBegin);
  return {impl->layerOffset[l], impl->layerOffset[l + 1]};
}

std::pair<size_t, size_t> GpuStage::tiedEmbeddingRange() const {
  const Impl &m = *impl;
  if (!m.cfg.tiedEmbeddings || m.tiedHere())
    return {0, 0};
  const size_t matrix = size_t(m.localV) * size_t(m.cfg.channels); // the rank's rows
  if (m.hasEmbedding()) {
    size_t at = m.layerOffset[0] + m.tensorOffset[0][Wte];
    return {at, at + matrix};
  }
  if (m.hasHead()) {
    size_t l = size_t(m.layerEnd - 1 - m.layerBegin);
    size_t at = m.layerOffset[l] + m.tensorOffset[l][LmW];
    return {at, at + matrix};
  }
  return {0, 0};
}

llvm::Error GpuStage::zeroGrads() {
  return impl->ctx.memsetZero(impl->grads.data(), impl->grads.size() * sizeof(float));
}

llvm::Error GpuStage::adamStep(float lr, float beta1, float beta2, float eps, float weightDecay) {
  Impl &m = *impl;
  ++m.adamSteps;
  PIPEC_GPU_TRY(cu::adamUpdate(m.ctx, m.params.data(), m.grads.data(), m.adamM.data(),
                               m.adamV.data(), m.params.size(), lr, beta1, beta2, eps, weightDecay,
                               m.adamSteps));
  return m.refreshComputeParams();
}

#undef PIPEC_GPU_TRY

} // namespace pipec
