//===- CpuKernelOpsEmu.cpp - the hand-written kernels' ops as CPU loops (emulated device) -===//
//
// kernels/cuda/emu/README.md. Layernorm, GELU, attention, cross entropy, AdamW and convert of
// CudaOps.h, computed by the CPU reference ops on the emulated device's host memory, in stream
// order; fp32 only. This is the fast stand-in the runtime tests use (:cuda_ops_emu); the .cu
// kernels themselves run on the kernel emulator in :cuda_ops_kernel_emu.
//
//===----------------------------------------------------------------------===//
#include "kernels/cuda/CudaOps.h"

#include "kernels/cpu/Ops.h"
#include "kernels/cuda/emu/EmuOps.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

namespace pipec::kernels::cuda {

namespace ops = kernels::ops;
using emu_ops::fp32Only;
using emu_ops::run;

namespace {

/// softmax probabilities (B, H, x, a+x) of a query slice, from the log-sum-exp of each row.
std::vector<float> attentionProbs(const float *q, const float *k, const float *lse,
                                  const AttentionShape &s) {
  const int keys = s.keys(), w = s.width();
  const float scale = 1.0f / std::sqrt(float(s.headDim));
  std::vector<float> probs(size_t(s.batch) * s.heads * s.queries * keys, 0.0f);
  for (int b = 0; b < s.batch; ++b)
    for (int h = 0; h < s.heads; ++h)
      for (int t = 0; t < s.queries; ++t) {
        const size_t row = (size_t(b) * s.heads + h) * s.queries + t;
        const float *qr = q + (size_t(b) * s.queries + t) * w + size_t(h) * s.headDim;
        for (int j = 0; j <= s.begin + t; ++j) {
          const float *kr = k + (size_t(j) * s.batch + b) * w + size_t(h) * s.headDim;
          float dot = 0;
          for (int d = 0; d < s.headDim; ++d)
            dot += qr[d] * kr[d];
          probs[row * keys + size_t(j)] = std::exp(dot * scale - lse[row]);
        }
      }
  return probs;
}

ops::AttentionShape cpuShape(const AttentionShape &s) {
  return ops::AttentionShape{s.batch, s.queries, s.begin, s.heads, s.headDim};
}

} // namespace

llvm::Error convert(CudaContext &ctx, DType dstType, void *dst, DType srcType, const void *src,
                    size_t n) {
  if (auto err = fp32Only("convert", dstType))
    return err;
  if (auto err = fp32Only("convert", srcType))
    return err;
  return run(ctx, [=] { std::memmove(dst, src, n * sizeof(float)); });
}

llvm::Error layernormForward(CudaContext &ctx, DType dtype, void *out, float *mean, float *rstd,
                             const void *in, const void *w, const void *b, int n, int c) {
  PIPEC_EMU_FP32("layernormForward");
  return run(ctx, [=] {
    ops::layernormForward(static_cast<float *>(out), mean, rstd, static_cast<const float *>(in),
                          static_cast<const float *>(w), static_cast<const float *>(b), n, c);
  });
}
llvm::Error layernormBackwardInputAccumulate(CudaContext &ctx, DType dtype, void *dIn,
                                             const void *dOut, const void *in, const float *mean,
                                             const float *rstd, const void *w, int n, int c) {
  PIPEC_EMU_FP32("layernormBackwardInputAccumulate");
  return run(ctx, [=] {
    ops::layernormBackwardInputAccumulate(
        static_cast<float *>(dIn), static_cast<const float *>(dOut), static_cast<const float *>(in),
        mean, rstd, static_cast<const float *>(w), n, c);
  });
}
llvm::Error layernormBackwardWeight(CudaContext &ctx, DType dtype, float *dW, float *dB,
                                    const void *dOut, const void *in, const float *mean,
                                    const float *rstd, int n, int c) {
  PIPEC_EMU_FP32("layernormBackwardWeight");
  return run(ctx, [=] {
    ops::layernormBackwardWeight(dW, dB, static_cast<const float *>(dOut),
                                 static_cast<const float *>(in), mean, rstd, n, c);
  });
}

llvm::Error geluForward(CudaContext &ctx, DType dtype, void *out, const void *in, size_t n) {
  PIPEC_EMU_FP32("geluForward");
  return run(
      ctx, [=] { ops::geluForward(static_cast<float *>(out), static_cast<const float *>(in), n); });
}
llvm::Error geluBackward(CudaContext &ctx, DType dtype, void *dIn, const void *dOut, const void *in,
                         size_t n) {
  PIPEC_EMU_FP32("geluBackward");
  return run(ctx, [=] {
    ops::geluBackward(static_cast<float *>(dIn), static_cast<const float *>(dOut),
                      static_cast<const float *>(in), n);
  });
}

llvm::Error attentionForward(CudaContext &ctx, DType dtype, void *out, float *lse, const void *q,
                             const void *k, const void *v, const AttentionShape &s) {
  PIPEC_EMU_FP32("attentionForward");
  return run(ctx, [=] {
    const auto *qf = static_cast<const float *>(q), *kf = static_cast<const float *>(k);
    const int w = s.width();
    const float scale = 1.0f / std::sqrt(float(s.headDim));
    // The log-sum-exp of every query row's scaled, causally masked scores ...
    for (int b = 0; b < s.batch; ++b)
      for (int h = 0; h < s.heads; ++h)
        for (int t = 0; t < s.queries; ++t) {
          const float *qr = qf + (size_t(b) * s.queries + t) * w + size_t(h) * s.headDim;
          std::vector<float> scores(size_t(s.begin + t + 1));
          float top = -std::numeric_limits<float>::infinity();
          for (int j = 0; j <= s.begin + t; ++j) {
            const float *kr = kf + (size_t(j) * s.batch + b) * w + size_t(h) * s.headDim;
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
    ops::attentionForward(static_cast<float *>(out), probs.data(), qf, kf,
                          static_cast<const float *>(v), cpuShape(s));
  });
}

llvm::Error attentionBackward(CudaContext &ctx, DType dtype, void *dq, void *dk, void *dv,
                              const void *dOut, const void *, const float *lse, const void *q,
                              const void *k, const void *v, const AttentionShape &s) {
  PIPEC_EMU_FP32("attentionBackward");
  // The real op takes scratch from the context's allocator: so does this one, so that the
  // executor's arena sees the same requests (given back once the work is queued, as there).
  DeviceAllocator &from = ctx.allocator();
  auto scratch = from.allocate(size_t(s.batch) * s.heads * s.queries * sizeof(float));
  if (!scratch)
    return scratch.takeError();
  auto err = run(ctx, [=] {
    std::vector<float> probs =
        attentionProbs(static_cast<const float *>(q), static_cast<const float *>(k), lse, s);
    ops::attentionBackward(static_cast<float *>(dq), static_cast<float *>(dk),
                           static_cast<float *>(dv), static_cast<const float *>(dOut), probs.data(),
                           static_cast<const float *>(q), static_cast<const float *>(k),
                           static_cast<const float *>(v), cpuShape(s));
  });
  from.release(*scratch);
  return err;
}

llvm::Error crossEntropyForward(CudaContext &ctx, DType dtype, float *rowLoss, float *lse,
                                const void *logits, const int32_t *targets, int n, int v,
                                float scale) {
  PIPEC_EMU_FP32("crossEntropyForward");
  return run(ctx, [=] {
    const auto *l = static_cast<const float *>(logits);
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

llvm::Error crossEntropyBackward(CudaContext &ctx, DType dtype, void *dLogits, const void *logits,
                                 const float *lse, const int32_t *targets, int n, int v,
                                 float scale) {
  PIPEC_EMU_FP32("crossEntropyBackward");
  return run(ctx, [=] {
    const auto *l = static_cast<const float *>(logits);
    auto *d = static_cast<float *>(dLogits);
    for (int r = 0; r < n; ++r)
      for (int j = 0; j < v; ++j) {
        const size_t at = size_t(r) * v + size_t(j);
        float p = std::exp(l[at] - lse[r]);
        d[at] = (p - (j == targets[r] ? 1.0f : 0.0f)) * scale;
      }
  });
}

llvm::Error adamUpdate(CudaContext &ctx, float *params, const float *grads, float *m, float *v,
                       size_t n, float lr, float beta1, float beta2, float eps, float weightDecay,
                       int step) {
  if (step < 1)
    return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                   fmt::format("adamUpdate: step counts from 1 (got {})", step));
  return run(ctx, [=] {
    ops::adamUpdate(params, grads, m, v, n, lr, beta1, beta2, eps, weightDecay, step);
  });
}

} // namespace pipec::kernels::cuda
