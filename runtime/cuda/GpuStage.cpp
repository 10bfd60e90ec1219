//===- GpuStage.cpp - One pipeline stage of the GPT on a GPU --------------===//
//
// The stage is kernels/StageProgram.h, the definition the cpu backend runs too; this file is
// its device (GpuDev: kernels/cuda ops and the glue kernels of StageKernels.cu on the context's
// stream, activations from its allocator) and what only the device has: the parameters' device
// copies and their bf16 copy, the batch's upload with the embedding backward's plans, the
// rotary positions, the loss accumulator and AdamW. Every block variant the cpu runs runs here,
// but a LayerNorm without its shift or with another epsilon (the CUDA layernorm kernel's).
//
//===----------------------------------------------------------------------===//
#include "runtime/cuda/GpuStage.h"

#include "kernels/StageProgram.h"
#include "kernels/Try.h"
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

namespace pipec {

namespace {

namespace cu = kernels::cuda;
namespace launch = runtime::cuda::launch;
using kernels::GptConfig;
using kernels::GptLayerKind;
constexpr cu::DType kF32 = cu::DType::F32;
constexpr cu::DType kBF16 = cu::DType::BF16;

using Floats = StreamBuffer<float>; // statistics, log-sum-exps and losses: fp32 in both modes

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

/// The CUDA stream as StageProgram's device: activations in the compute type from the
/// context's allocator (the rank's arena in the executor), fp32 statistics, the CUDA ops of
/// kernels/cuda and the glue kernels of StageKernels.cu; the parameters, their bf16 copy and
/// the batch's tokens in memory allocated once. Every call queues work on the stream (nothing in
/// the context's sizing pass) and returns an error naming a CUDA failure.
struct GpuDev {
  using Act = DeviceTensor;
  using F32 = Floats;
  using Ptr = void *;
  using CPtr = const void *;
  using Out = TensorView;
  using In = TensorView;
  /// The head's loss state: the log-sum-exp of each row over the whole vocabulary and each
  /// row's (scaled) loss; the logits stay in the head's work and become the logits' gradient.
  struct Loss {
    Floats lse, rowLoss;
    template <typename F> void forEach(F f) { f(lse), f(rowLoss); }
  };

  cu::CudaContext &ctx;
  cudaStream_t stream;
  GptConfig cfg;
  std::vector<std::pair<int, int>> slices;
  cu::DType dt = kF32; // the compute type (activations, the parameters the kernels read)
  Owned<float> params, grads, adamM, adamV;
  // bf16: the parameters the kernels read, rounded from the fp32 master copy `params` after
  // every optimizer step (same layout). fp32 reads `params` itself.
  Owned<uint16_t> paramsLow;
  Owned<double> lossAcc;
  // Inputs and targets of every (mb, slice), slice rows contiguous: (mb, slice) starts at
  // tokenOffset(mb, slice). Allocated by the first setBatch (the sizing pass's), uploaded from
  // pinned host copies (inputs, targets, then the embedding backward's plans).
  Owned<int32_t> inputs, targets;
  // With the embedding: every (mb, slice)'s EmbeddingGradPlan, at maxEmbeddingGradInts times
  // the slice's offset in `inputs` (its order, then its pieces at n, its merges at 4 n), and
  // how many pieces and merges each has, by mb * slices + slice.
  Owned<int32_t> embeddingPlans;
  std::vector<std::pair<int, int>> embeddingPlanSizes;
  Owned<int32_t, /*Pinned=*/true> hostTokens;
  // With rope: the positions of each slice's rows in (b, t) order, then in (t, b) order.
  std::vector<std::unique_ptr<Owned<int32_t>>> positions;

  explicit GpuDev(cu::CudaContext &ctx)
      : ctx(ctx), stream(static_cast<cudaStream_t>(ctx.stream())) {}
  Mem mem() { return Mem{&ctx.allocator(), stream, ctx.sizing()}; }
  size_t tokenOffset(int mb, int slice) const {
    return size_t(mb) * size_t(cfg.microbatch) * size_t(cfg.seqLen) +
           size_t(cfg.microbatch) * size_t(slices[size_t(slice)].first);
  }

  static void *ptr(DeviceTensor &a) { return a.data(); }
  static float *ptr(Floats &f) { return f.data(); }
  static size_t size(const DeviceTensor &a) { return a.size(); }
  static size_t size(const Floats &f) { return f.size(); }
  static void *at(DeviceTensor &a, size_t offset) {
    return static_cast<char *>(a.data()) + offset * kernels::sizeOf(a.dtype());
  }
  llvm::Error alloc(DeviceTensor &a, size_t n) { return a.allocate(mem(), n, dt); }
  llvm::Error allocZero(DeviceTensor &a, size_t n) { return a.allocate(mem(), n, dt, true); }
  llvm::Error alloc(Floats &f, size_t n) { return f.allocate(mem(), n); }
  llvm::Error allocZero(Floats &f, size_t n) { return f.allocate(mem(), n, true); }
  void release(DeviceTensor &a) { a.reset(); }
  void release(Floats &f) { f.reset(); }
  llvm::Error copy(DeviceTensor &dst, DeviceTensor &src) { return dst.copyFrom(mem(), src.view()); }
  llvm::Error input(DeviceTensor &dst, TensorView in, size_t n) {
    assert(in.count == n && in.type == dt && "stage input has the wrong size or type");
    (void)n;
    return dst.copyFrom(mem(), in);
  }
  TensorView out(DeviceTensor &a) { return a.view(); }
  TensorView out(Floats &f) { return TensorView(f.data(), f.size(), kF32); }
  const void *param(size_t at) const {
    if (dt == kBF16)
      return paramsLow.data() + at;
    return params.data() + at;
  }
  float *grad(size_t at) { return grads.data() + at; }
  /// The compute copy of the parameters from the master copy (bf16 only).
  llvm::Error refreshComputeParams() {
    if (dt != kBF16)
      return llvm::Error::success();
    return cu::convert(ctx, kBF16, paramsLow.data(), kF32, params.data(), params.size());
  }
  std::span<float> state(kernels::StageState which) {
    switch (which) {
    case kernels::StageState::Params:
      return {params.data(), params.size()};
    case kernels::StageState::Grads:
      return {grads.data(), grads.size()};
    case kernels::StageState::AdamFirstMoment:
      return {adamM.data(), adamM.size()};
    case kernels::StageState::AdamSecondMoment:
      return {adamV.data(), adamV.size()};
    }
    llvm_unreachable("unknown stage state");
  }
  /// The fp32 state (and the loss's accumulator), allocated once: the parameters uploaded, the
  /// rest zeros, and the compute copy.
  llvm::Error allocateState(std::vector<float> host) {
    const size_t bytes = host.size() * sizeof(float);
    PIPEC_TRY(params.allocate(host.size()));
    PIPEC_TRY(grads.allocate(host.size()));
    PIPEC_TRY(adamM.allocate(host.size()));
    PIPEC_TRY(adamV.allocate(host.size()));
    PIPEC_TRY(lossAcc.allocate(1));
    PIPEC_TRY(ctx.upload(params.data(), host.data(), bytes));
    PIPEC_TRY(ctx.memsetZero(grads.data(), bytes));
    PIPEC_TRY(ctx.memsetZero(adamM.data(), bytes));
    PIPEC_TRY(ctx.memsetZero(adamV.data(), bytes));
    PIPEC_TRY(ctx.memsetZero(lossAcc.data(), sizeof(double)));
    if (dt == kBF16)
      PIPEC_TRY(paramsLow.allocate(host.size()));
    return refreshComputeParams();
  }
  llvm::Error zeroGrads() { return ctx.memsetZero(grads.data(), grads.size() * sizeof(float)); }
  /// AdamW on the fp32 master copy, then the compute copy from it.
  llvm::Error adamUpdate(float lr, float beta1, float beta2, float eps, float weightDecay,
                         int step) {
    PIPEC_TRY(cu::adamUpdate(ctx, params.data(), grads.data(), adamM.data(), adamV.data(),
                             params.size(), lr, beta1, beta2, eps, weightDecay, step));
    return refreshComputeParams();
  }

  llvm::Error layernormForward(void *out, float *mean, float *rstd, const void *in, const void *w,
                               const void *b, int n, int c, float eps) {
    assert(eps == 1e-5f && b && "the CUDA layernorm has GPT-2's shift and epsilon");
    (void)eps;
    return cu::layernormForward(ctx, dt, out, mean, rstd, in, w, b, n, c);
  }
  llvm::Error layernormBackwardInputAccumulate(void *dIn, const void *dOut, const void *in,
                                               const float *mean, const float *rstd, const void *w,
                                               int n, int c) {
    return cu::layernormBackwardInputAccumulate(ctx, dt, dIn, dOut, in, mean, rstd, w, n, c);
  }
  llvm::Error layernormBackwardWeight(float *dW, float *dB, const void *dOut, const void *in,
                                      const float *mean, const float *rstd, int n, int c) {
    return cu::layernormBackwardWeight(ctx, dt, dW, dB, dOut, in, mean, rstd, n, c);
  }
  llvm::Error rmsnormForward(void *out, float *rstd, const void *in, const void *w, int n, int c,
                             float eps) {
    return cu::rmsnormForward(ctx, dt, out, rstd, in, w, n, c, eps);
  }
  llvm::Error rmsnormBackwardInputAccumulate(void *dIn, const void *dOut, const void *in,
                                             const float *rstd, const void *w, int n, int c) {
    return cu::rmsnormBackwardInputAccumulate(ctx, dt, dIn, dOut, in, rstd, w, n, c);
  }
  llvm::Error rmsnormBackwardWeight(float *dW, const void *dOut, const void *in, const float *rstd,
                                    int n, int c) {
    return cu::rmsnormBackwardWeight(ctx, dt, dW, dOut, in, rstd, n, c);
  }
  llvm::Error matmulForward(void *out, const void *in, const void *w, const void *bias, int n,
                            int i, int o) {
    return cu::matmulForward(ctx, dt, out, in, w, bias, n, i, o);
  }
  llvm::Error matmulBackwardInput(void *dIn, const void *dOut, const void *w, int n, int i, int o) {
    return cu::matmulBackwardInput(ctx, dt, dIn, dOut, w, n, i, o);
  }
  llvm::Error matmulBackwardWeight(float *dW, float *dB, const void *in, const void *dOut, int n,
                                   int i, int o) {
    return cu::matmulBackwardWeight(ctx, dt, dW, dB, in, dOut, n, i, o);
  }
  llvm::Error matmulTForward(void *out, const void *in, const void *w, int n, int i, int o) {
    return cu::matmulTForward(ctx, dt, out, in, w, n, i, o);
  }
  llvm::Error matmulTBackwardInput(void *dIn, const void *dOut, const void *w, int n, int i,
                                   int o) {
    return cu::matmulTBackwardInput(ctx, dt, dIn, dOut, w, n, i, o);
  }
  llvm::Error matmulTBackwardWeight(float *dW, const void *in, const void *dOut, int n, int i,
                                    int o) {
    return cu::matmulTBackwardWeight(ctx, dt, dW, in, dOut, n, i, o);
  }
  llvm::Error geluForward(void *out, const void *in, size_t n) {
    return cu::geluForward(ctx, dt, out, in, n);
  }
  llvm::Error geluBackward(void *dIn, const void *dOut, const void *in, size_t n) {
    return cu::geluBackward(ctx, dt, dIn, dOut, in, n);
  }
  llvm::Error swigluForward(void *out, const void *pre, int n, int f) {
    return cu::swigluForward(ctx, dt, out, pre, n, f);
  }
  llvm::Error swigluBackward(void *dPre, const void *dOut, const void *pre, int n, int f) {
    return cu::swigluBackward(ctx, dt, dPre, dOut, pre, n, f);
  }
  const int32_t *positionsOf(kernels::RopeRows which, int slice) const {
    return positions[size_t(slice) * 2 + (which == kernels::RopeRows::Keys ? 1 : 0)]->data();
  }
  llvm::Error rope(void *x, kernels::RopeRows which, int slice, int rows, int heads, int headDim,
                   double theta, bool backward) {
    const int32_t *pos = positionsOf(which, slice);
    if (backward)
      return cu::ropeBackward(ctx, dt, x, pos, rows, heads, headDim, theta);
    return cu::ropeForward(ctx, dt, x, pos, rows, heads, headDim, theta);
  }
  llvm::Error ropeF32(float *x, int slice, int rows, int heads, int headDim, double theta) {
    return cu::ropeBackward(ctx, kF32, x, positionsOf(kernels::RopeRows::Keys, slice), rows, heads,
                            headDim, theta);
  }
  /// The whole sequence's K/V, allocated at slice 0 (position-major (T, B, width)); the
  /// attention ops read only the first a + x rows.
  llvm::Error reserveSequenceKv(DeviceTensor &k, DeviceTensor &v, int b, int width) {
    const size_t kvSize = size_t(cfg.seqLen) * size_t(b) * size_t(width);
    PIPEC_TRY(k.allocate(mem(), kvSize, dt));
    return v.allocate(mem(), kvSize, dt);
  }
  llvm::Error reserveKv(DeviceTensor &, DeviceTensor &, int, int, int, int) {
    return llvm::Error::success();
  }
  llvm::Error splitQkv(void *q, void *k, void *v, const void *qkv, int n, int x, int b, int begin,
                       int cl, int kvl) {
    PIPEC_QUEUE_TRY(ctx, launch::splitQkv(dt, q, k, v, qkv, n, x, b, begin, cl, kvl, stream));
    return llvm::Error::success();
  }
  llvm::Error gatherQkv(void *dQkv, const void *dq, const float *dk, const float *dv, int n, int x,
                        int b, int begin, int cl, int kvl) {
    PIPEC_QUEUE_TRY(ctx, launch::gatherQkv(dt, dQkv, dq, dk, dv, n, x, b, begin, cl, kvl, stream));
    return llvm::Error::success();
  }
  /// Flash attention keeps a log-sum-exp per query row (B, H, x).
  static size_t attentionSavedFloats(const kernels::StageAttentionShape &s) {
    return size_t(s.batch) * size_t(s.heads) * size_t(s.queries);
  }
  static cu::AttentionShape cudaShape(const kernels::StageAttentionShape &s) {
    return cu::AttentionShape{s.batch, s.queries, s.begin,
                              s.heads, s.headDim, s.kvHeads == s.heads ? 0 : s.kvHeads};
  }
  llvm::Error attentionForward(void *out, float *lse, const void *q, const void *k, const void *v,
                               const kernels::StageAttentionShape &s) {
    return cu::attentionForward(ctx, dt, out, lse, q, k, v, cudaShape(s));
  }
  llvm::Error attentionBackward(void *dq, float *dk, float *dv, const void *dOut, const void *out,
                                const float *lse, const void *q, const void *k, const void *v,
                                const kernels::StageAttentionShape &s) {
    return cu::attentionBackward(ctx, dt, dq, dk, dv, dOut, out, lse, q, k, v, cudaShape(s));
  }
  llvm::Error residualAdd(void *resid, const void *branch, const void *bias, int n, int c) {
    PIPEC_QUEUE_TRY(ctx, launch::residualAdd(dt, resid, branch, bias, n, c, stream));
    return llvm::Error::success();
  }
  llvm::Error embeddingForward(void *resid, int mb, int slice, const void *wte, const void *wpe,
                               int n, int x, int begin, int c, int vBegin, int vLocal) {
    PIPEC_QUEUE_TRY(ctx,
                    launch::embeddingForward(dt, resid, inputs.data() + tokenOffset(mb, slice), wte,
                                             wpe, n, x, begin, c, vBegin, vLocal, stream));
    return llvm::Error::success();
  }
  llvm::Error embeddingBackward(float *dWte, float *dWpe, const void *dEmb, int mb, int slice,
                                int n, int x, int begin, int c, int vBegin, int vLocal) {
    const int32_t *in = inputs.data() + tokenOffset(mb, slice);
    const int32_t *at = embeddingPlans.data() + maxEmbeddingGradInts(tokenOffset(mb, slice));
    const size_t planIndex = size_t(mb) * slices.size() + size_t(slice);
    assert(planIndex < embeddingPlanSizes.size() && "setBatch planned every (mb, slice)");
    auto [pieces, merges] = embeddingPlanSizes[planIndex];
    // Scratch of the most slots any batch's plan can use: the same request every step.
    cu::ScratchBuffer slots(ctx.allocator());
    PIPEC_TRY(slots.allocate(maxEmbeddingGradSlots(size_t(n)) * size_t(c) * sizeof(float)));
    const launch::EmbeddingGradArgs plan{at,     at + n,           pieces, at + 4 * size_t(n),
                                         merges, slots.as<float>()};
    PIPEC_QUEUE_TRY(ctx, launch::embeddingBackward(dt, dWte, dWpe, dEmb, in, plan, n, x, begin, c,
                                                   vBegin, vLocal, stream));
    return llvm::Error::success();
  }
  llvm::Error lossForward(Loss &l, DeviceTensor &logits, int mb, int slice, int n, int v,
                          float scale) {
    PIPEC_TRY(l.lse.allocate(mem(), size_t(n)));
    PIPEC_TRY(l.rowLoss.allocate(mem(), size_t(n)));
    return cu::crossEntropyForward(ctx, dt, l.rowLoss.data(), l.lse.data(), logits.data(),
                                   targets.data() + tokenOffset(mb, slice), n, v, scale);
  }
  llvm::Error lossShardStats(Loss &l, DeviceTensor &logits, Floats &stats, int mb, int slice, int n,
                             int vLocal, int vBegin, int tpRank, int tp) {
    PIPEC_TRY(l.lse.allocate(mem(), size_t(n)));
    PIPEC_TRY(l.rowLoss.allocate(mem(), size_t(n)));
    PIPEC_TRY(stats.allocate(mem(), kernels::ops::crossEntropyStatsFloats(n, tp)));
    return cu::crossEntropyShardStats(ctx, dt, stats.data(), logits.data(),
                                      targets.data() + tokenOffset(mb, slice), n, vLocal, vBegin,
                                      tpRank, tp);
  }
  llvm::Error lossCombine(Loss &l, Floats &stats, int n, int tp, float scale) {
    return cu::crossEntropyCombine(ctx, l.rowLoss.data(), l.lse.data(), stats.data(), n, tp, scale);
  }
  /// dLogits overwrite the logits in place (the op allows it).
  llvm::Error lossBackward(Loss &l, DeviceTensor &logits, DeviceTensor &dLogits, int mb, int slice,
                           int n, int vLocal, int vBegin, int /*tp: one op for both*/,
                           float scale) {
    PIPEC_TRY(cu::crossEntropyBackward(ctx, dt, logits.data(), logits.data(), l.lse.data(),
                                       targets.data() + tokenOffset(mb, slice), n, vLocal, scale,
                                       vBegin));
    l.lse.reset();
    dLogits = std::move(logits);
    return llvm::Error::success();
  }
};

} // namespace

static_assert(kernels::StageDevice<GpuDev>,
              "a CUDA stream must provide what kernels/StageDevice.h asks");

struct GpuStage::Impl : kernels::StageProgram<GpuDev> {
  explicit Impl(cu::CudaContext &ctx) : kernels::StageProgram<GpuDev>(ctx) {}
};

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
  // params, grads, adamM, adamV; paramsLow; lossAcc; rope's positions (create()'s allocations).
  return 4 * n * sizeof(float) + (dtype == kBF16 ? n * sizeof(uint16_t) : 0) + sizeof(double) +
         (cfg.rope ? 2 * size_t(cfg.microbatch) * size_t(cfg.seqLen) * sizeof(int32_t) : 0);
}

llvm::Expected<std::unique_ptr<GpuStage>>
GpuStage::create(cu::CudaContext &ctx, const GptConfig &cfg, int layerBegin, int layerEnd,
                 int tpRank, int tp, uint64_t seed, std::vector<std::pair<int, int>> slices,
                 float lossScale, cu::DType dtype,
                 const std::vector<std::vector<float>> *initLayers) {
  assert((cfg.rmsnorm || (cfg.bias && cfg.normEps == 1e-5f)) &&
         "the CUDA layernorm has GPT-2's shift and epsilon; gpuRunsTheBlock refuses the others");
  auto m = std::make_unique<Impl>(ctx);
  GpuDev &d = m->device();
  d.cfg = cfg;
  d.slices = slices;
  d.dt = dtype;
  m->setUp(cfg, layerBegin, layerEnd, tpRank, tp, std::move(slices), lossScale);
  assert(m->paramCount() == paramCount(cfg, layerBegin, layerEnd, tp) && "stateBytes() is wrong");
  PIPEC_TRY(m->initParams(seed, initLayers));
  if (cfg.rope) {
    // Each slice's row positions, (b, t) for q and (t, b) for the K/V rows.
    for (int slice = 0; slice < int(d.slices.size()); ++slice)
      for (kernels::RopeRows which : {kernels::RopeRows::Queries, kernels::RopeRows::Keys}) {
        const auto [begin, end] = d.slices[size_t(slice)];
        const int x = end - begin, rows = cfg.microbatch * x;
        std::vector<int32_t> pos(static_cast<size_t>(rows));
        for (int r = 0; r < rows; ++r)
          pos[size_t(r)] =
              which == kernels::RopeRows::Queries ? begin + r % x : begin + r / cfg.microbatch;
        d.positions.push_back(std::make_unique<Owned<int32_t>>());
        PIPEC_TRY(d.positions.back()->allocate(pos.size()));
        PIPEC_TRY(ctx.upload(d.positions.back()->data(), pos.data(), pos.size() * sizeof(int32_t)));
      }
  }
  PIPEC_TRY(ctx.synchronize());
  return std::unique_ptr<GpuStage>(new GpuStage(std::move(m)));
}

int GpuStage::parts() const { return impl->parts(); }
bool GpuStage::hasEmbedding() const { return impl->hasEmbedding(); }
bool GpuStage::hasHead() const { return impl->hasHead(); }

llvm::Error GpuStage::setBatch(const std::vector<std::vector<int32_t>> &tokens) {
  Impl &m = *impl;
  GpuDev &d = m.device();
  if (!m.hasEmbedding() && !m.hasHead())
    return llvm::Error::success();
  const int b = d.cfg.microbatch, t = d.cfg.seqLen;
  const auto [vocabBegin, vocabEnd] = m.vocabRows();
  std::vector<int32_t> in, tgt, plans;
  std::vector<std::pair<int, int>> planSizes;
  in.reserve(tokens.size() * size_t(b) * size_t(t));
  tgt.reserve(in.capacity());
  for (const std::vector<int32_t> &mb : tokens) {
    assert(mb.size() == size_t(b) * size_t(t + 1) && "batch has the wrong size");
    for (auto [begin, end] : d.slices) {
      const size_t first = in.size();
      for (int s = 0; s < b; ++s)
        for (int p = begin; p < end; ++p) {
          int32_t token = mb[size_t(s) * size_t(t + 1) + size_t(p)];
          assert(token >= 0 && token < d.cfg.vocab && "input token out of the vocabulary");
          in.push_back(token);
          tgt.push_back(mb[size_t(s) * size_t(t + 1) + size_t(p) + 1]);
        }
      if (m.hasEmbedding()) { // the slice's plan at its fixed place (GpuDev::embeddingPlans)
        const size_t rows = in.size() - first;
        const EmbeddingGradPlan plan = planEmbeddingGrad(
            std::span<const int32_t>(in).subspan(first, rows), vocabBegin, vocabEnd);
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
  if (!d.inputs.data() && !in.empty()) {
    if (!d.ctx.sizing())
      return llvm::createStringError(
          llvm::inconvertibleErrorCode(),
          "GpuStage::setBatch: the batch's device buffers are allocated in the sizing pass, "
          "before step 0 (runtime/cuda/DeviceArena.h); this call is outside it");
    PIPEC_TRY(d.inputs.allocate(in.size()));
    PIPEC_TRY(d.targets.allocate(tgt.size()));
    if (!plans.empty())
      PIPEC_TRY(d.embeddingPlans.allocate(plans.size()));
    PIPEC_TRY(d.hostTokens.allocate(in.size() + tgt.size() + plans.size()));
  }
  assert(d.inputs.size() == in.size() && "the batch changed size between steps");
  d.embeddingPlanSizes = std::move(planSizes);
  if (in.empty())
    return llvm::Error::success();
  // The previous step's copies out of the pinned buffer have run: the runtime waits for the
  // stream at the end of every step.
  int32_t *host = d.hostTokens.data();
  std::copy(in.begin(), in.end(), host);
  std::copy(tgt.begin(), tgt.end(), host + in.size());
  std::copy(plans.begin(), plans.end(), host + in.size() + tgt.size());
  PIPEC_QUEUE_TRY(d.ctx, cudaMemcpyAsync(d.inputs.data(), host, in.size() * sizeof(int32_t),
                                         cudaMemcpyHostToDevice, d.stream));
  PIPEC_QUEUE_TRY(d.ctx,
                  cudaMemcpyAsync(d.targets.data(), host + in.size(), tgt.size() * sizeof(int32_t),
                                  cudaMemcpyHostToDevice, d.stream));
  if (!plans.empty())
    PIPEC_QUEUE_TRY(d.ctx, cudaMemcpyAsync(d.embeddingPlans.data(), host + in.size() + tgt.size(),
                                           plans.size() * sizeof(int32_t), cudaMemcpyHostToDevice,
                                           d.stream));
  return llvm::Error::success();
}

llvm::Expected<TensorView> GpuStage::forward(int mb, int slice, int part, TensorView input) {
  TensorView result;
  PIPEC_TRY(impl->forward(mb, slice, part, input, result));
  return result;
}

llvm::Expected<TensorView> GpuStage::output(int mb, int slice) {
  auto out = impl->output(mb, slice);
  if (!out)
    return out.takeError();
  return *out ? (*out)->view() : TensorView();
}

llvm::Error GpuStage::accumulateLoss(int mb, int slice) {
  auto loss = impl->loss(mb, slice);
  if (!loss)
    return loss.takeError();
  GpuDev &d = impl->device();
  PIPEC_QUEUE_TRY(d.ctx, launch::accumulateSum(d.lossAcc.data(), (*loss)->rowLoss.data(),
                                               impl->sliceTokens(slice), d.stream));
  return llvm::Error::success();
}

llvm::Expected<double> GpuStage::takeLoss() {
  GpuDev &d = impl->device();
  double loss = 0;
  PIPEC_TRY(d.ctx.download(&loss, d.lossAcc.data(), sizeof(double)));
  PIPEC_TRY(d.ctx.memsetZero(d.lossAcc.data(), sizeof(double)));
  return loss;
}

llvm::Expected<TensorView> GpuStage::backwardInput(int mb, int slice, int part,
                                                   TensorView gradOutput) {
  TensorView result;
  PIPEC_TRY(impl->backwardInput(mb, slice, part, gradOutput, result));
  return result;
}

llvm::Expected<TensorView> GpuStage::inputGrad(int mb, int slice) {
  auto grad = impl->inputGrad(mb, slice);
  if (!grad)
    return grad.takeError();
  return *grad ? (*grad)->view() : TensorView();
}

llvm::Error GpuStage::backwardWeight(int mb, int slice) { return impl->backwardWeight(mb, slice); }

std::span<float> GpuStage::params() { return impl->state(kernels::StageState::Params); }
std::span<float> GpuStage::grads() { return impl->state(kernels::StageState::Grads); }
std::span<float> GpuStage::adamFirstMoment() {
  return impl->state(kernels::StageState::AdamFirstMoment);
}
std::span<float> GpuStage::adamSecondMoment() {
  return impl->state(kernels::StageState::AdamSecondMoment);
}
int GpuStage::adamSteps() const { return impl->adamSteps(); }
void GpuStage::setAdamSteps(int steps) { impl->setAdamSteps(steps); }
llvm::Error GpuStage::paramsWritten() { return impl->device().refreshComputeParams(); }

std::pair<size_t, size_t> GpuStage::layerRange(int layer) const { return impl->layerRange(layer); }
std::pair<size_t, size_t> GpuStage::tiedEmbeddingRange() const {
  return impl->tiedEmbeddingRange();
}

llvm::Error GpuStage::zeroGrads() { return impl->zeroGrads(); }

llvm::Error GpuStage::adamStep(float lr, float beta1, float beta2, float eps, float weightDecay) {
  return impl->adamStep(lr, beta1, beta2, eps, weightDecay);
}

} // namespace pipec
