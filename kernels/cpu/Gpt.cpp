//===- Gpt.cpp - CPU reference math of a small GPT, per pipeline stage ------===//
//
// The host as the device of the stage (kernels/StageProgram.h, the one definition the cuda
// backend runs too) and StageCompute, the host's facade over it. The model's layers, layout,
// initialisation and tp shards are kernels/StageModel.h's.
//
//===----------------------------------------------------------------------===//
#include "kernels/cpu/Gpt.h"

#include "kernels/StageProgram.h"

#include "kernels/cpu/LlamaOps.h"
#include "kernels/cpu/Ops.h"

#include "llvm/Support/ErrorHandling.h"

#include <algorithm>
#include <cassert>
#include <vector>

namespace pipec::kernels {

using namespace tensors;

namespace {

size_t floatBytes(const std::vector<float> &v) { return v.size() * sizeof(float); }

/// The host as StageProgram's device: std::vector buffers, kernels/cpu/Ops.h and LlamaOps.h
/// loops, the parameters and the batch in host memory. Nothing fails.
struct CpuDev {
  using Act = std::vector<float>;
  using F32 = std::vector<float>;
  using Ptr = float *;
  using CPtr = const float *;
  using Out = std::span<float>;
  using In = std::span<const float>;
  /// The head's loss state: softmax probabilities (N, V) at tp = 1; at tp > 1 the rank's logits
  /// stay in the head's work and this keeps the whole vocabulary's log-sum-exp (N).
  struct Loss {
    std::vector<float> probs, lse;
    double loss = 0.0;
    template <typename F> void forEach(F f) { f(probs), f(lse); }
  };

  GptConfig cfg;
  std::vector<std::pair<int, int>> slices;
  std::vector<float> params, grads, adamM, adamV;
  std::vector<std::vector<int32_t>> batch;

  static llvm::Error ok() { return llvm::Error::success(); }
  static float *ptr(std::vector<float> &v) { return v.data(); }
  static size_t size(const std::vector<float> &v) { return v.size(); }
  static float *at(std::vector<float> &v, size_t offset) { return v.data() + offset; }
  llvm::Error alloc(std::vector<float> &v, size_t n) {
    v.assign(n, 0.0f);
    return ok();
  }
  llvm::Error allocZero(std::vector<float> &v, size_t n) { return alloc(v, n); }
  void release(std::vector<float> &v) { std::vector<float>().swap(v); }
  llvm::Error copy(std::vector<float> &dst, const std::vector<float> &src) {
    dst = src;
    return ok();
  }
  llvm::Error input(std::vector<float> &dst, std::span<const float> in, size_t n) {
    assert(in.size() == n && "a stage input or output gradient has the wrong size");
    dst.assign(in.begin(), in.end());
    return ok();
  }
  Out out(std::vector<float> &v) { return v; }
  CPtr param(size_t at) { return params.data() + at; }
  float *grad(size_t at) { return grads.data() + at; }
  std::span<float> state(StageState which) {
    switch (which) {
    case StageState::Params:
      return params;
    case StageState::Grads:
      return grads;
    case StageState::AdamFirstMoment:
      return adamM;
    case StageState::AdamSecondMoment:
      return adamV;
    }
    llvm_unreachable("unknown stage state");
  }
  llvm::Error allocateState(std::vector<float> initial) {
    params = std::move(initial);
    grads.assign(params.size(), 0.0f);
    adamM.assign(params.size(), 0.0f);
    adamV.assign(params.size(), 0.0f);
    return ok();
  }
  llvm::Error zeroGrads() {
    std::fill(grads.begin(), grads.end(), 0.0f);
    return ok();
  }
  llvm::Error adamUpdate(float lr, float beta1, float beta2, float eps, float weightDecay,
                         int step) {
    ops::adamUpdate(params.data(), grads.data(), adamM.data(), adamV.data(), params.size(), lr,
                    beta1, beta2, eps, weightDecay, step);
    return ok();
  }

  /// Token ids of a slice's rows (b, t): inputs, or with `next` the targets. Read from the
  /// step's batch when an op needs them (setBatch is called between steps, not within one).
  std::vector<int32_t> tokens(int mb, int slice, bool next) const {
    assert(mb >= 0 && mb < int(batch.size()) && "setBatch() has no such microbatch");
    const std::vector<int32_t> &all = batch[size_t(mb)];
    assert(all.size() == size_t(cfg.microbatch) * size_t(cfg.seqLen + 1) &&
           "batch has the wrong size");
    const auto [begin, end] = slices[size_t(slice)];
    std::vector<int32_t> out;
    for (int s = 0; s < cfg.microbatch; ++s)
      for (int t = begin; t < end; ++t)
        out.push_back(all[size_t(s) * size_t(cfg.seqLen + 1) + size_t(t + (next ? 1 : 0))]);
    return out;
  }

  llvm::Error layernormForward(Ptr out, float *mean, float *rstd, CPtr in, CPtr w, CPtr b, int n,
                               int c, float eps) {
    ops::layernormForward(out, mean, rstd, in, w, b, n, c, eps);
    return ok();
  }
  llvm::Error layernormBackwardInputAccumulate(Ptr dIn, CPtr dOut, CPtr in, const float *mean,
                                               const float *rstd, CPtr w, int n, int c) {
    ops::layernormBackwardInputAccumulate(dIn, dOut, in, mean, rstd, w, n, c);
    return ok();
  }
  llvm::Error layernormBackwardWeight(float *dW, float *dB, CPtr dOut, CPtr in, const float *mean,
                                      const float *rstd, int n, int c) {
    ops::layernormBackwardWeight(dW, dB, dOut, in, mean, rstd, n, c);
    return ok();
  }
  llvm::Error rmsnormForward(Ptr out, float *rstd, CPtr in, CPtr w, int n, int c, float eps) {
    ops::rmsnormForward(out, rstd, in, w, n, c, eps);
    return ok();
  }
  llvm::Error rmsnormBackwardInputAccumulate(Ptr dIn, CPtr dOut, CPtr in, const float *rstd, CPtr w,
                                             int n, int c) {
    ops::rmsnormBackwardInputAccumulate(dIn, dOut, in, rstd, w, n, c);
    return ok();
  }
  llvm::Error rmsnormBackwardWeight(float *dW, CPtr dOut, CPtr in, const float *rstd, int n,
                                    int c) {
    ops::rmsnormBackwardWeight(dW, dOut, in, rstd, n, c);
    return ok();
  }
  llvm::Error matmulForward(Ptr out, CPtr in, CPtr w, CPtr bias, int n, int i, int o) {
    ops::matmulForward(out, in, w, bias, n, i, o);
    return ok();
  }
  llvm::Error matmulBackwardInput(Ptr dIn, CPtr dOut, CPtr w, int n, int i, int o) {
    ops::matmulBackwardInput(dIn, dOut, w, n, i, o);
    return ok();
  }
  llvm::Error matmulBackwardWeight(float *dW, float *dB, CPtr in, CPtr dOut, int n, int i, int o) {
    ops::matmulBackwardWeight(dW, dB, in, dOut, n, i, o);
    return ok();
  }
  llvm::Error matmulTForward(Ptr out, CPtr in, CPtr w, int n, int i, int o) {
    ops::matmulTForward(out, in, w, n, i, o);
    return ok();
  }
  llvm::Error matmulTBackwardInput(Ptr dIn, CPtr dOut, CPtr w, int n, int i, int o) {
    ops::matmulTBackwardInput(dIn, dOut, w, n, i, o);
    return ok();
  }
  llvm::Error matmulTBackwardWeight(float *dW, CPtr in, CPtr dOut, int n, int i, int o) {
    ops::matmulTBackwardWeight(dW, in, dOut, n, i, o);
    return ok();
  }
  llvm::Error geluForward(Ptr out, CPtr in, size_t n) {
    ops::geluForward(out, in, n);
    return ok();
  }
  llvm::Error geluBackward(Ptr dIn, CPtr dOut, CPtr in, size_t n) {
    ops::geluBackward(dIn, dOut, in, n);
    return ok();
  }
  // SwiGLU on the fc output's rows, each gate | up.
  llvm::Error swigluForward(Ptr out, CPtr pre, int n, int f) {
    for (int r = 0; r < n; ++r) {
      const float *row = pre + size_t(r) * 2 * size_t(f);
      ops::swigluForward(out + size_t(r) * size_t(f), row, row + f, size_t(f));
    }
    return ok();
  }
  llvm::Error swigluBackward(Ptr dPre, CPtr dOut, CPtr pre, int n, int f) {
    for (int r = 0; r < n; ++r) {
      const float *row = pre + size_t(r) * 2 * size_t(f);
      float *d = dPre + size_t(r) * 2 * size_t(f);
      ops::swigluBackward(d, d + f, dOut + size_t(r) * size_t(f), row, row + f, size_t(f));
    }
    return ok();
  }
  /// Positions of a slice's `rows` rows: (b, t) order, or the K/V rows' (t, b) order.
  std::vector<int32_t> positions(RopeRows which, int slice, int rows) const {
    const auto [begin, end] = slices[size_t(slice)];
    const int x = end - begin;
    std::vector<int32_t> out(static_cast<size_t>(rows));
    for (int r = 0; r < rows; ++r)
      out[size_t(r)] = which == RopeRows::Queries ? begin + r % x : begin + r / cfg.microbatch;
    return out;
  }
  llvm::Error rope(Ptr x, RopeRows which, int slice, int rows, int heads, int headDim, double theta,
                   bool backward) {
    const std::vector<int32_t> pos = positions(which, slice, rows);
    if (backward)
      ops::ropeBackward(x, pos.data(), rows, heads, headDim, theta);
    else
      ops::ropeForward(x, pos.data(), rows, heads, headDim, theta);
    return ok();
  }
  /// The backward rotation of a slice's K/V gradient rows (fp32).
  llvm::Error ropeF32(float *x, int slice, int rows, int heads, int headDim, double theta) {
    return rope(x, RopeRows::Keys, slice, rows, heads, headDim, theta, /*backward=*/true);
  }
  /// The host grows K/V slice by slice (reserveKv), not at slice 0.
  llvm::Error reserveSequenceKv(std::vector<float> &, std::vector<float> &, int, int) {
    return ok();
  }
  /// The K/V rows [0, end) of the microbatch: grown slice by slice.
  llvm::Error reserveKv(std::vector<float> &k, std::vector<float> &v, int begin, int end, int b,
                        int width) {
    assert(k.size() == size_t(begin) * size_t(b) * size_t(width) &&
           "K/V do not end where the slice begins");
    (void)begin;
    k.resize(size_t(end) * size_t(b) * size_t(width));
    v.resize(k.size());
    return ok();
  }
  // Row r = (b, t) of the slice is K/V row (begin + t) * B + b.
  llvm::Error splitQkv(Ptr q, Ptr k, Ptr v, CPtr qkv, int n, int x, int b, int begin, int cl,
                       int kvl) {
    const size_t cols = size_t(cl) + 2 * size_t(kvl);
    for (int r = 0; r < n; ++r) {
      const float *row = qkv + size_t(r) * cols;
      const size_t kv = (size_t(begin + r % x) * size_t(b) + size_t(r / x)) * size_t(kvl);
      std::copy_n(row, cl, q + size_t(r) * size_t(cl));
      std::copy_n(row + cl, kvl, k + kv);
      std::copy_n(row + cl + kvl, kvl, v + kv);
    }
    return ok();
  }
  llvm::Error gatherQkv(Ptr dQkv, CPtr dq, const float *dk, const float *dv, int n, int x, int b,
                        int begin, int cl, int kvl) {
    const size_t cols = size_t(cl) + 2 * size_t(kvl);
    for (int r = 0; r < n; ++r) {
      float *row = dQkv + size_t(r) * cols;
      const size_t kv = (size_t(begin + r % x) * size_t(b) + size_t(r / x)) * size_t(kvl);
      std::copy_n(dq + size_t(r) * size_t(cl), cl, row);
      std::copy_n(dk + kv, kvl, row + cl);
      std::copy_n(dv + kv, kvl, row + cl + kvl);
    }
    return ok();
  }
  /// The materialized attention keeps the probabilities (B, H, x, a + x).
  static size_t attentionSavedFloats(const StageAttentionShape &s) {
    return size_t(s.batch) * size_t(s.heads) * size_t(s.queries) * size_t(s.begin + s.queries);
  }
  static ops::GroupedAttentionShape cpuShape(const StageAttentionShape &s) {
    return {s.batch, s.queries, s.begin, s.heads, s.kvHeads, s.headDim};
  }
  llvm::Error attentionForward(Ptr out, float *probs, CPtr q, CPtr k, CPtr v,
                               const StageAttentionShape &s) {
    ops::groupedAttentionForward(out, probs, q, k, v, cpuShape(s));
    return ok();
  }
  llvm::Error attentionBackward(Ptr dq, float *dk, float *dv, CPtr dOut, CPtr /*out*/,
                                const float *probs, CPtr q, CPtr k, CPtr v,
                                const StageAttentionShape &s) {
    ops::groupedAttentionBackward(dq, dk, dv, dOut, probs, q, k, v, cpuShape(s));
    return ok();
  }
  llvm::Error residualAdd(Ptr resid, CPtr branch, CPtr bias, int n, int c) {
    const size_t count = size_t(n) * size_t(c);
    if (bias)
      for (size_t k = 0; k < count; ++k)
        resid[k] += branch[k] + bias[k % size_t(c)];
    else
      for (size_t k = 0; k < count; ++k)
        resid[k] += branch[k];
    return ok();
  }
  // resid (B, x, C) = wte[token] (the rank's vocabulary rows) + wpe[position] (when given).
  llvm::Error embeddingForward(Ptr resid, int mb, int slice, CPtr wte, CPtr wpe, int n, int x,
                               int begin, int c, int vocabBegin, int localV) {
    const std::vector<int32_t> in = tokens(mb, slice, false);
    for (int r = 0; r < n; ++r) {
      const int pos = begin + r % x, token = in[size_t(r)], local = token - vocabBegin;
      assert(token >= 0 && token < cfg.vocab && "input token out of the vocabulary");
      float *out = resid + size_t(r) * size_t(c);
      if (local >= 0 && local < localV)
        for (int k = 0; k < c; ++k)
          out[k] = wte[size_t(local) * size_t(c) + size_t(k)];
      if (wpe)
        for (int k = 0; k < c; ++k)
          out[k] += wpe[size_t(pos) * size_t(c) + size_t(k)];
    }
    return ok();
  }
  llvm::Error embeddingBackward(float *dWte, float *dWpe, CPtr dEmb, int mb, int slice, int n,
                                int x, int begin, int c, int vocabBegin, int localV) {
    const std::vector<int32_t> in = tokens(mb, slice, false);
    for (int r = 0; r < n; ++r) {
      const float *g = dEmb + size_t(r) * size_t(c);
      const int local = in[size_t(r)] - vocabBegin; // rows of other ranks' tokens: theirs
      if (local >= 0 && local < localV)
        for (int k = 0; k < c; ++k)
          dWte[size_t(local) * size_t(c) + size_t(k)] += g[k];
      if (dWpe)
        for (int k = 0; k < c; ++k)
          dWpe[size_t(begin + r % x) * size_t(c) + size_t(k)] += g[k];
    }
    return ok();
  }
  llvm::Error lossForward(Loss &l, Act &logits, int mb, int slice, int n, int v, float scale) {
    const std::vector<int32_t> tgt = tokens(mb, slice, true);
    l.probs.resize(logits.size());
    l.loss = ops::crossEntropyForward(l.probs.data(), logits.data(), tgt.data(), n, v, scale);
    release(logits);
    return ok();
  }
  llvm::Error lossShardStats(Loss &, Act &logits, F32 &stats, int mb, int slice, int n, int localV,
                             int vocabBegin, int tpRank, int tp) {
    const std::vector<int32_t> tgt = tokens(mb, slice, true);
    stats.resize(ops::crossEntropyStatsFloats(n, tp));
    ops::crossEntropyShardStats(stats.data(), logits.data(), tgt.data(), n, localV, vocabBegin,
                                tpRank, tp);
    return ok();
  }
  llvm::Error lossCombine(Loss &l, F32 &stats, int n, int tp, float scale) {
    l.lse.resize(size_t(n));
    l.loss = ops::crossEntropyCombine(l.lse.data(), stats.data(), n, tp, scale);
    return ok();
  }
  llvm::Error lossBackward(Loss &l, Act &logits, Act &dLogits, int mb, int slice, int n, int localV,
                           int vocabBegin, int tp, float scale) {
    const std::vector<int32_t> tgt = tokens(mb, slice, true);
    if (tp > 1) { // from the rank's logits and the whole vocabulary's log-sum-exp
      dLogits.resize(logits.size());
      ops::crossEntropyShardBackward(dLogits.data(), logits.data(), l.lse.data(), tgt.data(), n,
                                     localV, vocabBegin, scale);
      release(logits);
      release(l.lse);
      return ok();
    }
    dLogits.resize(l.probs.size());
    ops::crossEntropyBackward(dLogits.data(), l.probs.data(), tgt.data(), n, cfg.vocab, scale);
    release(l.probs);
    return ok();
  }
};

} // namespace

static_assert(StageDevice<CpuDev>, "the host must provide what kernels/StageDevice.h asks");
// And the concept is a contract: the host without one of its operations is no device.
struct CpuDevWithoutRope : CpuDev {
  void rope() = delete;
};
static_assert(!StageDevice<CpuDevWithoutRope>, "StageDevice must require every operation");

struct StageCompute::Impl : StageProgram<CpuDev> {};

StageCompute::StageCompute(const GptConfig &cfg, int layerBegin, int layerEnd, int tpRank, int tp,
                           uint64_t seed, std::vector<std::pair<int, int>> slices, float lossScale)
    : impl(std::make_unique<Impl>()) {
  CpuDev &d = impl->device();
  d.cfg = cfg;
  d.slices = slices;
  impl->setUp(cfg, layerBegin, layerEnd, tpRank, tp, std::move(slices), lossScale);
  llvm::cantFail(impl->initParams(seed, /*initLayers=*/nullptr));
}

StageCompute::~StageCompute() = default;

int StageCompute::parts() const { return impl->parts(); }
bool StageCompute::hasEmbedding() const { return impl->hasEmbedding(); }
bool StageCompute::hasHead() const { return impl->hasHead(); }

void StageCompute::setBatch(std::vector<std::vector<int32_t>> tokens) {
  impl->device().batch = std::move(tokens);
}

std::span<float> StageCompute::forward(int mb, int slice, int part, std::span<const float> input) {
  std::span<float> result;
  llvm::cantFail(impl->forward(mb, slice, part, input, result));
  return result;
}

std::span<const float> StageCompute::output(int mb, int slice) const {
  const std::vector<float> *out = llvm::cantFail(impl->output(mb, slice));
  return out ? std::span<const float>(*out) : std::span<const float>();
}

double StageCompute::loss(int mb, int slice) const {
  return llvm::cantFail(impl->loss(mb, slice))->loss;
}

std::span<float> StageCompute::backwardInput(int mb, int slice, int part,
                                             std::span<const float> gradOutput) {
  std::span<float> result;
  llvm::cantFail(impl->backwardInput(mb, slice, part, gradOutput, result));
  return result;
}

std::span<const float> StageCompute::inputGrad(int mb, int slice) const {
  const std::vector<float> *grad = llvm::cantFail(impl->inputGrad(mb, slice));
  return grad ? std::span<const float>(*grad) : std::span<const float>();
}

void StageCompute::backwardWeight(int mb, int slice) {
  llvm::cantFail(impl->backwardWeight(mb, slice));
}

std::span<float> StageCompute::params() { return impl->state(StageState::Params); }
std::span<float> StageCompute::grads() { return impl->state(StageState::Grads); }
std::span<float> StageCompute::adamFirstMoment() {
  return impl->state(StageState::AdamFirstMoment);
}
std::span<float> StageCompute::adamSecondMoment() {
  return impl->state(StageState::AdamSecondMoment);
}

std::pair<size_t, size_t> StageCompute::layerRange(int layer) const {
  return impl->layerRange(layer);
}
std::pair<size_t, size_t> StageCompute::tiedEmbeddingRange() const {
  return impl->tiedEmbeddingRange();
}

void StageCompute::zeroGrads() { llvm::cantFail(impl->zeroGrads()); }

void StageCompute::adamStep(float lr, float beta1, float beta2, float eps, float weightDecay) {
  llvm::cantFail(impl->adamStep(lr, beta1, beta2, eps, weightDecay));
}

int StageCompute::adamSteps() const { return impl->adamSteps(); }
void StageCompute::setAdamSteps(int steps) { impl->setAdamSteps(steps); }

size_t StageCompute::savedBytes() const {
  size_t total = 0;
  impl->forEachSaved([&](std::vector<float> &v) { total += floatBytes(v); });
  return total;
}

} // namespace pipec::kernels
