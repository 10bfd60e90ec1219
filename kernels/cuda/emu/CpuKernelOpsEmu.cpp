//===- CpuKernelOpsEmu.cpp - the hand-written kernels' ops as CPU loops (emulated device) -===//
//
// kernels/cuda/emu/README.md. Layernorm, GELU, attention, cross entropy, AdamW and convert of
// CudaOps.h, computed by the CPU reference ops on the emulated device's host memory, in stream
// order; bf16 by widening (EmuOps.h). This is the fast stand-in the runtime tests use
// (:cuda_ops_emu); the .cu kernels themselves run on the kernel emulator in :cuda_ops_kernel_emu.
//
//===----------------------------------------------------------------------===//
#include "kernels/cuda/CudaOps.h"

#include "kernels/cpu/LlamaOps.h"
#include "kernels/cpu/Ops.h"
#include "kernels/cuda/emu/EmuOps.h"
#include "kernels/cuda/emu/FakeCuda.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

namespace pipec::kernels::cuda {

namespace ops = kernels::ops;
using emu_ops::Narrowed;
using emu_ops::run;
using emu_ops::Widened;

namespace {

/// softmax probabilities (B, H, x, a+x) of a query slice, from the log-sum-exp of each row.
std::vector<float> attentionProbs(const float *q, const float *k, const float *lse,
                                  const AttentionShape &s) {
  const int keys = s.keys(), w = s.width(), kw = s.kvHeadCount() * s.headDim;
  const int group = s.heads / s.kvHeadCount();
  const float scale = 1.0f / std::sqrt(float(s.headDim));
  std::vector<float> probs(size_t(s.batch) * s.heads * s.queries * keys, 0.0f);
  for (int b = 0; b < s.batch; ++b)
    for (int h = 0; h < s.heads; ++h)
      for (int t = 0; t < s.queries; ++t) {
        const size_t row = (size_t(b) * s.heads + h) * s.queries + t;
        const float *qr = q + (size_t(b) * s.queries + t) * w + size_t(h) * s.headDim;
        for (int j = 0; j <= s.begin + t; ++j) {
          const float *kr = k + (size_t(j) * s.batch + b) * kw + size_t(h / group) * s.headDim;
          float dot = 0;
          for (int d = 0; d < s.headDim; ++d)
            dot += qr[d] * kr[d];
          probs[row * keys + size_t(j)] = std::exp(dot * scale - lse[row]);
        }
      }
  return probs;
}

/// The shape checks of KernelOps.cpp that the CPU ops would otherwise meet as asserts.
llvm::Error checkRope(const char *op, int rows, int heads, int headDim) {
  if (rows < 0 || heads <= 0 || headDim <= 0 || headDim % 2 != 0)
    return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                   "%s: needs rows >= 0, heads > 0 and an even head size (got "
                                   "rows %d, heads %d, head size %d)",
                                   op, rows, heads, headDim);
  return llvm::Error::success();
}
llvm::Error checkGroups(const char *op, const AttentionShape &s) {
  if (s.kvHeads < 0 || (s.kvHeads > 0 && s.heads % s.kvHeads != 0))
    return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                   "%s: kvHeads %d does not divide heads %d", op, s.kvHeads,
                                   s.heads);
  return llvm::Error::success();
}

ops::GroupedAttentionShape cpuShape(const AttentionShape &s) {
  return ops::GroupedAttentionShape{s.batch, s.queries,       s.begin,
                                    s.heads, s.kvHeadCount(), s.headDim};
}

} // namespace

llvm::Error convert(CudaContext &ctx, DType dstType, void *dst, DType srcType, const void *src,
                    size_t n) {
  return run(ctx, [=] {
    Widened from(src, n, srcType);
    Narrowed to(dst, n, dstType);
    std::memmove(to.data, from.data, n * sizeof(float));
    to.done();
  });
}

llvm::Error layernormForward(CudaContext &ctx, DType dtype, void *out, float *mean, float *rstd,
                             const void *in, const void *w, const void *b, int n, int c) {
  return run(ctx, [=] {
    const size_t nc = size_t(n) * size_t(c);
    Widened x(in, nc, dtype), wt(w, size_t(c), dtype), bs(b, size_t(c), dtype);
    Narrowed y(out, nc, dtype);
    ops::layernormForward(y.data, mean, rstd, x.data, wt.data, bs.data, n, c);
    y.done();
  });
}
llvm::Error layernormBackwardInputAccumulate(CudaContext &ctx, DType dtype, void *dIn,
                                             const void *dOut, const void *in, const float *mean,
                                             const float *rstd, const void *w, int n, int c) {
  return run(ctx, [=] {
    const size_t nc = size_t(n) * size_t(c);
    Widened dy(dOut, nc, dtype), x(in, nc, dtype), wt(w, size_t(c), dtype);
    Narrowed dx(dIn, nc, dtype, /*accumulate=*/true);
    ops::layernormBackwardInputAccumulate(dx.data, dy.data, x.data, mean, rstd, wt.data, n, c);
    dx.done();
  });
}
llvm::Error layernormBackwardWeight(CudaContext &ctx, DType dtype, float *dW, float *dB,
                                    const void *dOut, const void *in, const float *mean,
                                    const float *rstd, int n, int c) {
  return run(ctx, [=] {
    const size_t nc = size_t(n) * size_t(c);
    Widened dy(dOut, nc, dtype), x(in, nc, dtype);
    ops::layernormBackwardWeight(dW, dB, dy.data, x.data, mean, rstd, n, c);
  });
}

llvm::Error rmsnormForward(CudaContext &ctx, DType dtype, void *out, float *rstd, const void *in,
                           const void *w, int n, int c, float eps) {
  return run(ctx, [=] {
    const size_t nc = size_t(n) * size_t(c);
    Widened x(in, nc, dtype), wt(w, size_t(c), dtype);
    Narrowed y(out, nc, dtype);
    ops::rmsnormForward(y.data, rstd, x.data, wt.data, n, c, eps);
    y.done();
  });
}
llvm::Error rmsnormBackwardInputAccumulate(CudaContext &ctx, DType dtype, void *dIn,
                                           const void *dOut, const void *in, const float *rstd,
                                           const void *w, int n, int c) {
  return run(ctx, [=] {
    const size_t nc = size_t(n) * size_t(c);
    Widened dy(dOut, nc, dtype), x(in, nc, dtype), wt(w, size_t(c), dtype);
    Narrowed dx(dIn, nc, dtype, /*accumulate=*/true);
    ops::rmsnormBackwardInputAccumulate(dx.data, dy.data, x.data, rstd, wt.data, n, c);
    dx.done();
  });
}
llvm::Error rmsnormBackwardWeight(CudaContext &ctx, DType dtype, float *dW, const void *dOut,
                                  const void *in, const float *rstd, int n, int c) {
  return run(ctx, [=] {
    const size_t nc = size_t(n) * size_t(c);
    Widened dy(dOut, nc, dtype), x(in, nc, dtype);
    ops::rmsnormBackwardWeight(dW, dy.data, x.data, rstd, n, c);
  });
}
llvm::Error swigluForward(CudaContext &ctx, DType dtype, void *out, const void *pre, int n, int f) {
  return run(ctx, [=] {
    const size_t nf = size_t(n) * size_t(f);
    Widened p(pre, 2 * nf, dtype);
    Narrowed y(out, nf, dtype);
    for (int r = 0; r < n; ++r)
      ops::swigluForward(y.data + size_t(r) * f, p.data + size_t(r) * 2 * f,
                         p.data + size_t(r) * 2 * f + f, size_t(f));
    y.done();
  });
}
llvm::Error swigluBackward(CudaContext &ctx, DType dtype, void *dPre, const void *dOut,
                           const void *pre, int n, int f) {
  return run(ctx, [=] {
    const size_t nf = size_t(n) * size_t(f);
    Widened p(pre, 2 * nf, dtype), dy(dOut, nf, dtype);
    Narrowed dp(dPre, 2 * nf, dtype);
    for (int r = 0; r < n; ++r) {
      float *row = dp.data + size_t(r) * 2 * f;
      const float *pr = p.data + size_t(r) * 2 * f;
      ops::swigluBackward(row, row + f, dy.data + size_t(r) * f, pr, pr + f, size_t(f));
    }
    dp.done();
  });
}
llvm::Error ropeForward(CudaContext &ctx, DType dtype, void *x, const int32_t *positions, int rows,
                        int heads, int headDim, double theta) {
  if (auto err = checkRope("ropeForward", rows, heads, headDim))
    return err;
  return run(ctx, [=] {
    const size_t n = size_t(rows) * size_t(heads) * size_t(headDim);
    Narrowed y(x, n, dtype, /*accumulate=*/true);
    ops::ropeForward(y.data, positions, rows, heads, headDim, theta);
    y.done();
  });
}
llvm::Error ropeBackward(CudaContext &ctx, DType dtype, void *dx, const int32_t *positions,
                         int rows, int heads, int headDim, double theta) {
  if (auto err = checkRope("ropeBackward", rows, heads, headDim))
    return err;
  return run(ctx, [=] {
    const size_t n = size_t(rows) * size_t(heads) * size_t(headDim);
    Narrowed y(dx, n, dtype, /*accumulate=*/true);
    ops::ropeBackward(y.data, positions, rows, heads, headDim, theta);
    y.done();
  });
}

llvm::Error geluForward(CudaContext &ctx, DType dtype, void *out, const void *in, size_t n) {
  return run(ctx, [=] {
    Widened x(in, n, dtype);
    Narrowed y(out, n, dtype);
    ops::geluForward(y.data, x.data, n);
    y.done();
  });
}
llvm::Error geluBackward(CudaContext &ctx, DType dtype, void *dIn, const void *dOut, const void *in,
                         size_t n) {
  return run(ctx, [=] {
    Widened dy(dOut, n, dtype), x(in, n, dtype);
    Narrowed dx(dIn, n, dtype);
    ops::geluBackward(dx.data, dy.data, x.data, n);
    dx.done();
  });
}

llvm::Error attentionForward(CudaContext &ctx, DType dtype, void *out, float *lse, const void *q,
                             const void *k, const void *v, const AttentionShape &s) {
  if (auto err = checkGroups("attentionForward", s))
    return err;
  return run(ctx, [=] {
    const size_t qSize = size_t(s.batch) * s.queries * s.width();
    const size_t kvSize = size_t(s.keys()) * s.batch * s.kvHeadCount() * s.headDim;
    Widened qw(q, qSize, dtype), kw(k, kvSize, dtype), vw(v, kvSize, dtype);
    Narrowed o(out, qSize, dtype);
    const float *qf = qw.data, *kf = kw.data;
    const int w = s.width(), kvw = s.kvHeadCount() * s.headDim;
    const int group = s.heads / s.kvHeadCount();
    const float scale = 1.0f / std::sqrt(float(s.headDim));
    // The log-sum-exp of every query row's scaled, causally masked scores ...
    for (int b = 0; b < s.batch; ++b)
      for (int h = 0; h < s.heads; ++h)
        for (int t = 0; t < s.queries; ++t) {
          const float *qr = qf + (size_t(b) * s.queries + t) * w + size_t(h) * s.headDim;
          std::vector<float> scores(size_t(s.begin + t + 1));
          float top = -std::numeric_limits<float>::infinity();
          for (int j = 0; j <= s.begin + t; ++j) {
            const float *kr = kf + (size_t(j) * s.batch + b) * kvw + size_t(h / group) * s.headDim;
            float dot = 0;
            for (int d = 0; d < s.headDim; ++d)
              dot += qr[d] * kr[d];
            scores[size_t(j)] = dot * scale;
            top = std::max(top, scores[size_t(j)]);
          }
          double sum = 0;
          for (float sc : scores)
            sum += std::exp(double(sc - top));
          lse[(size_t(b) * s.heads + h) * s.queries + t] = top + float(std::log(sum));
        }
    // ... and the output from the CPU op.
    std::vector<float> probs(size_t(s.batch) * s.heads * s.queries * s.keys());
    ops::groupedAttentionForward(o.data, probs.data(), qf, kf, vw.data, cpuShape(s));
    o.done();
  });
}

llvm::Error attentionBackward(CudaContext &ctx, DType dtype, void *dq, float *dk, float *dv,
                              const void *dOut, const void *, const float *lse, const void *q,
                              const void *k, const void *v, const AttentionShape &s) {
  if (auto err = checkGroups("attentionBackward", s))
    return err;
  // The real op takes scratch from the context's allocator: so does this one, so that the
  // executor's arena sees the same requests (given back once the work is queued, as there).
  DeviceAllocator &from = ctx.allocator();
  auto scratch = from.allocate(size_t(s.batch) * s.heads * s.queries * sizeof(float));
  if (!scratch)
    return scratch.takeError();
  auto err = run(ctx, [=] {
    const size_t qSize = size_t(s.batch) * s.queries * s.width();
    const size_t kvSize = size_t(s.keys()) * s.batch * s.kvHeadCount() * s.headDim;
    Widened qw(q, qSize, dtype), kw(k, kvSize, dtype), vw(v, kvSize, dtype),
        dyw(dOut, qSize, dtype);
    Narrowed dqn(dq, qSize, dtype);
    std::vector<float> probs = attentionProbs(qw.data, kw.data, lse, s);
    // dk and dv are fp32 accumulators in every compute type: the CPU op adds to them in place.
    ops::groupedAttentionBackward(dqn.data, dk, dv, dyw.data, probs.data(), qw.data, kw.data,
                                  vw.data, cpuShape(s));
    dqn.done();
  });
  from.release(*scratch);
  return err;
}

llvm::Error crossEntropyForward(CudaContext &ctx, DType dtype, float *rowLoss, float *lse,
                                const void *logits, const int32_t *targets, int n, int v,
                                float scale) {
  return run(ctx, [=] {
    Widened lw(logits, size_t(n) * size_t(v), dtype);
    const float *l = lw.data;
    for (int r = 0; r < n; ++r) {
      const float *row = l + size_t(r) * v;
      float top = *std::max_element(row, row + v);
      double sum = 0;
      for (int j = 0; j < v; ++j)
        sum += std::exp(double(row[j] - top));
      lse[r] = top + float(std::log(sum));
      rowLoss[r] = scale * (lse[r] - row[targets[r]]);
    }
  });
}

llvm::Error crossEntropyShardStats(CudaContext &ctx, DType dtype, float *stats, const void *logits,
                                   const int32_t *targets, int n, int v, int vocabBegin, int part,
                                   int parts) {
  // The same refusal as the real op's (KernelOps.cpp), where the CPU op would assert.
  if (parts < 1 || part < 0 || part >= parts)
    return llvm::createStringError(
        llvm::inconvertibleErrorCode(),
        fmt::format("crossEntropyShardStats: shard {} of {} is out of range", part, parts));
  return run(ctx, [=] {
    Widened lw(logits, size_t(n) * size_t(v), dtype);
    ops::crossEntropyShardStats(stats, lw.data, targets, n, v, vocabBegin, part, parts);
  });
}

llvm::Error crossEntropyCombine(CudaContext &ctx, float *rowLoss, float *lse, const float *stats,
                                int n, int parts, float scale) {
  return run(ctx, [=] { ops::crossEntropyCombine(lse, stats, n, parts, scale, rowLoss); });
}

llvm::Error crossEntropyBackward(CudaContext &ctx, DType dtype, void *dLogits, const void *logits,
                                 const float *lse, const int32_t *targets, int n, int v,
                                 float scale, int vocabBegin) {
  return run(ctx, [=] {
    const size_t nv = size_t(n) * size_t(v);
    Widened lw(logits, nv, dtype); // a copy in bf16, so dLogits may alias logits
    Narrowed dn(dLogits, nv, dtype);
    const float *l = lw.data;
    float *d = dn.data;
    for (int r = 0; r < n; ++r)
      for (int j = 0; j < v; ++j) {
        const size_t at = size_t(r) * v + size_t(j);
        float p = std::exp(l[at] - lse[r]);
        d[at] = (p - (j == targets[r] - vocabBegin ? 1.0f : 0.0f)) * scale;
      }
    dn.done();
  });
}

llvm::Error adamUpdate(CudaContext &ctx, float *params, const float *grads, float *m, float *v,
                       size_t n, float lr, float beta1, float beta2, float eps, float weightDecay,
                       int step) {
  if (step < 1)
    return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                   fmt::format("adamUpdate: step counts from 1 (got {})", step));
  return run(ctx, [=] {
    if (emu::hangs("adam"))
      emu::hangForever();
    ops::adamUpdate(params, grads, m, v, n, lr, beta1, beta2, eps, weightDecay, step);
  });
}

} // namespace pipec::kernels::cuda
