//===- KernelOps.cpp - host side of the hand-written CUDA kernels ---------===//
//
// The CudaOps.h entry points of the .cu kernels (layernorm, GELU, attention, cross entropy,
// AdamW, convert): each validates its shape (an llvm::Error naming the argument), takes any
// scratch from the context's allocator, calls a launcher of Launch.h and passes the status
// through the checked funnel of CudaCheck.h. Where a launcher chooses among kernels (attention)
// it is told the context's device and configuration (launch::Target). The same file serves the
// GPU build (:cuda_ops, the .cu files through nvcc) and the kernel emulator
// (:cuda_ops_kernel_emu, the .cu files compiled for the host, kernels/cuda/emu/KernelEmu.h).
//
//===----------------------------------------------------------------------===//
#include "kernels/cuda/CudaOps.h"

#include "kernels/cuda/CudaCheck.h"
#include "kernels/cuda/DeviceMemory.h"
#include "kernels/cuda/Launch.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <cmath>
#include <string>

namespace pipec::kernels::cuda {

static llvm::Error shapeError(const std::string &message) {
  return llvm::createStringError(llvm::inconvertibleErrorCode(), message);
}

llvm::Error convert(CudaContext &ctx, DType dstType, void *dst, DType srcType, const void *src,
                    size_t n) {
  PIPEC_QUEUE_TRY(
      ctx, launch::convert(dstType, dst, srcType, src, n, static_cast<cudaStream_t>(ctx.stream())));
  return llvm::Error::success();
}

//===--- Hand-written kernels ---------------------------------------------===//

static cudaStream_t streamOf(CudaContext &ctx) { return static_cast<cudaStream_t>(ctx.stream()); }

static llvm::Error checkRows(const char *op, int n, int c) {
  if (n < 0 || c <= 0)
    return shapeError(fmt::format("{}: needs n >= 0 and c > 0 (got n {}, c {})", op, n, c));
  return llvm::Error::success();
}

llvm::Error layernormForward(CudaContext &ctx, DType dtype, void *out, float *mean, float *rstd,
                             const void *in, const void *w, const void *b, int n, int c) {
  if (auto err = checkRows("layernormForward", n, c))
    return err;
  PIPEC_QUEUE_TRY(ctx,
                  launch::layernormForward(dtype, out, mean, rstd, in, w, b, n, c, streamOf(ctx)));
  return llvm::Error::success();
}

llvm::Error layernormBackwardInputAccumulate(CudaContext &ctx, DType dtype, void *dIn,
                                             const void *dOut, const void *in, const float *mean,
                                             const float *rstd, const void *w, int n, int c) {
  if (auto err = checkRows("layernormBackwardInputAccumulate", n, c))
    return err;
  PIPEC_QUEUE_TRY(ctx, launch::layernormBackwardInputAccumulate(dtype, dIn, dOut, in, mean, rstd, w,
                                                                n, c, streamOf(ctx)));
  return llvm::Error::success();
}

llvm::Error layernormBackwardWeight(CudaContext &ctx, DType dtype, float *dW, float *dB,
                                    const void *dOut, const void *in, const float *mean,
                                    const float *rstd, int n, int c) {
  if (auto err = checkRows("layernormBackwardWeight", n, c))
    return err;
  ScratchBuffer partials(ctx.allocator());
  if (auto err = partials.allocate(launch::columnSumScratchFloats(n, c, 2) * sizeof(float)))
    return err;
  PIPEC_QUEUE_TRY(ctx, launch::layernormBackwardWeight(dtype, dW, dB, dOut, in, mean, rstd, n, c,
                                                       partials.as<float>(), streamOf(ctx)));
  return llvm::Error::success();
}

llvm::Error rmsnormForward(CudaContext &ctx, DType dtype, void *out, float *rstd, const void *in,
                           const void *w, int n, int c, float eps) {
  if (auto err = checkRows("rmsnormForward", n, c))
    return err;
  if (!(eps > 0.0f))
    return shapeError(fmt::format("rmsnormForward: needs eps > 0 (got {})", eps));
  PIPEC_QUEUE_TRY(ctx, launch::rmsnormForward(dtype, out, rstd, in, w, n, c, eps, streamOf(ctx)));
  return llvm::Error::success();
}

llvm::Error rmsnormBackwardInputAccumulate(CudaContext &ctx, DType dtype, void *dIn,
                                           const void *dOut, const void *in, const float *rstd,
                                           const void *w, int n, int c) {
  if (auto err = checkRows("rmsnormBackwardInputAccumulate", n, c))
    return err;
  PIPEC_QUEUE_TRY(ctx, launch::rmsnormBackwardInputAccumulate(dtype, dIn, dOut, in, rstd, w, n, c,
                                                              streamOf(ctx)));
  return llvm::Error::success();
}

llvm::Error rmsnormBackwardWeight(CudaContext &ctx, DType dtype, float *dW, const void *dOut,
                                  const void *in, const float *rstd, int n, int c) {
  if (auto err = checkRows("rmsnormBackwardWeight", n, c))
    return err;
  ScratchBuffer partials(ctx.allocator());
  if (auto err = partials.allocate(launch::columnSumScratchFloats(n, c, 1) * sizeof(float)))
    return err;
  PIPEC_QUEUE_TRY(ctx, launch::rmsnormBackwardWeight(dtype, dW, dOut, in, rstd, n, c,
                                                     partials.as<float>(), streamOf(ctx)));
  return llvm::Error::success();
}

llvm::Error swigluForward(CudaContext &ctx, DType dtype, void *out, const void *pre, int n, int f) {
  if (auto err = checkRows("swigluForward", n, f))
    return err;
  PIPEC_QUEUE_TRY(ctx, launch::swigluForward(dtype, out, pre, n, f, streamOf(ctx)));
  return llvm::Error::success();
}

llvm::Error swigluBackward(CudaContext &ctx, DType dtype, void *dPre, const void *dOut,
                           const void *pre, int n, int f) {
  if (auto err = checkRows("swigluBackward", n, f))
    return err;
  PIPEC_QUEUE_TRY(ctx, launch::swigluBackward(dtype, dPre, dOut, pre, n, f, streamOf(ctx)));
  return llvm::Error::success();
}

static llvm::Error checkRope(const char *op, int rows, int heads, int headDim, double theta) {
  if (rows < 0 || heads <= 0 || headDim <= 0 || headDim % 2 != 0 || !(theta > 0))
    return shapeError(fmt::format("{}: needs rows >= 0, heads > 0, an even head size and theta > "
                                  "0 (got rows {}, heads {}, head size {}, theta {})",
                                  op, rows, heads, headDim, theta));
  return llvm::Error::success();
}

llvm::Error ropeForward(CudaContext &ctx, DType dtype, void *x, const int32_t *positions, int rows,
                        int heads, int headDim, double theta) {
  if (auto err = checkRope("ropeForward", rows, heads, headDim, theta))
    return err;
  PIPEC_QUEUE_TRY(ctx, launch::rope(dtype, x, positions, rows, heads, headDim, theta,
                                    /*backward=*/false, streamOf(ctx)));
  return llvm::Error::success();
}

llvm::Error ropeBackward(CudaContext &ctx, DType dtype, void *dx, const int32_t *positions,
                         int rows, int heads, int headDim, double theta) {
  if (auto err = checkRope("ropeBackward", rows, heads, headDim, theta))
    return err;
  PIPEC_QUEUE_TRY(ctx, launch::rope(dtype, dx, positions, rows, heads, headDim, theta,
                                    /*backward=*/true, streamOf(ctx)));
  return llvm::Error::success();
}

llvm::Error geluForward(CudaContext &ctx, DType dtype, void *out, const void *in, size_t n) {
  PIPEC_QUEUE_TRY(ctx, launch::geluForward(dtype, out, in, n, streamOf(ctx)));
  return llvm::Error::success();
}

llvm::Error geluBackward(CudaContext &ctx, DType dtype, void *dIn, const void *dOut, const void *in,
                         size_t n) {
  PIPEC_QUEUE_TRY(ctx, launch::geluBackward(dtype, dIn, dOut, in, n, streamOf(ctx)));
  return llvm::Error::success();
}

static llvm::Error checkAttention(const char *op, const AttentionShape &s) {
  if (s.batch < 0 || s.queries < 0 || s.begin < 0 || s.heads < 0)
    return shapeError(fmt::format("{}: negative dimension (batch {}, queries {}, begin {}, "
                                  "heads {})",
                                  op, s.batch, s.queries, s.begin, s.heads));
  if (s.headDim <= 0 || s.headDim > launch::kMaxHeadDim)
    return shapeError(fmt::format("{}: headDim {} is outside [1, {}]; the kernels hold a head "
                                  "row in registers, {} values per lane",
                                  op, s.headDim, launch::kMaxHeadDim, launch::kMaxHeadDim / 32));
  if (size_t(s.batch) * s.heads > 65535)
    return shapeError(fmt::format("{}: batch x heads = {} is over 65535 (grid y)", op,
                                  size_t(s.batch) * s.heads));
  if (s.kvHeads < 0 || (s.kvHeads > 0 && s.heads % s.kvHeads != 0))
    return shapeError(
        fmt::format("{}: kvHeads {} does not divide heads {}", op, s.kvHeads, s.heads));
  return llvm::Error::success();
}

static launch::AttentionDims dimsOf(const AttentionShape &s) {
  return {s.batch, s.queries, s.begin, s.heads, s.headDim, s.kvHeads};
}

/// What the launchers choose kernels by: the context's device and configuration.
static launch::Target targetOf(const CudaContext &ctx) {
  return {ctx.computeCapability(), ctx.kernelConfig().hopperKernels};
}

llvm::Error attentionForward(CudaContext &ctx, DType dtype, void *out, float *lse, const void *q,
                             const void *k, const void *v, const AttentionShape &s) {
  if (auto err = checkAttention("attentionForward", s))
    return err;
  PIPEC_QUEUE_TRY(ctx, launch::attentionForward(targetOf(ctx), dtype, out, lse, q, k, v, dimsOf(s),
                                                streamOf(ctx)));
  return llvm::Error::success();
}

llvm::Error attentionBackward(CudaContext &ctx, DType dtype, void *dq, float *dk, float *dv,
                              const void *dOut, const void *out, const float *lse, const void *q,
                              const void *k, const void *v, const AttentionShape &s) {
  if (auto err = checkAttention("attentionBackward", s))
    return err;
  const size_t rows = size_t(s.batch) * s.heads * s.queries;
  if (rows == 0)
    return llvm::Error::success();
  ScratchBuffer rowDot(ctx.allocator());
  if (auto err = rowDot.allocate(launch::attentionBackwardScratchFloats(dimsOf(s)) * sizeof(float)))
    return err;
  PIPEC_QUEUE_TRY(ctx, launch::attentionBackward(dtype, dq, dk, dv, dOut, out, lse, q, k, v,
                                                 rowDot.as<float>(), dimsOf(s), streamOf(ctx)));
  return llvm::Error::success();
}

llvm::Error crossEntropyForward(CudaContext &ctx, DType dtype, float *rowLoss, float *lse,
                                const void *logits, const int32_t *targets, int n, int v,
                                float scale) {
  if (auto err = checkRows("crossEntropyForward", n, v))
    return err;
  PIPEC_QUEUE_TRY(ctx, launch::crossEntropyForward(dtype, rowLoss, lse, logits, targets, n, v,
                                                   scale, streamOf(ctx)));
  return llvm::Error::success();
}

llvm::Error crossEntropyShardStats(CudaContext &ctx, DType dtype, float *stats, const void *logits,
                                   const int32_t *targets, int n, int v, int vocabBegin, int part,
                                   int parts) {
  if (auto err = checkRows("crossEntropyShardStats", n, v))
    return err;
  if (parts < 1 || part < 0 || part >= parts)
    return shapeError(
        fmt::format("crossEntropyShardStats: shard {} of {} is out of range", part, parts));
  PIPEC_QUEUE_TRY(ctx, launch::crossEntropyShardStats(dtype, stats, logits, targets, n, v,
                                                      vocabBegin, part, parts, streamOf(ctx)));
  return llvm::Error::success();
}

llvm::Error crossEntropyCombine(CudaContext &ctx, float *rowLoss, float *lse, const float *stats,
                                int n, int parts, float scale) {
  if (auto err = checkRows("crossEntropyCombine", n, parts))
    return err;
  PIPEC_QUEUE_TRY(ctx,
                  launch::crossEntropyCombine(rowLoss, lse, stats, n, parts, scale, streamOf(ctx)));
  return llvm::Error::success();
}

llvm::Error crossEntropyBackward(CudaContext &ctx, DType dtype, void *dLogits, const void *logits,
                                 const float *lse, const int32_t *targets, int n, int v,
                                 float scale, int vocabBegin) {
  if (auto err = checkRows("crossEntropyBackward", n, v))
    return err;
  PIPEC_QUEUE_TRY(ctx, launch::crossEntropyBackward(dtype, dLogits, logits, lse, targets, n, v,
                                                    vocabBegin, scale, streamOf(ctx)));
  return llvm::Error::success();
}

llvm::Error adamUpdate(CudaContext &ctx, float *params, const float *grads, float *m, float *v,
                       size_t n, float lr, float beta1, float beta2, float eps, float weightDecay,
                       int step) {
  if (step < 1)
    return shapeError(fmt::format("adamUpdate: step counts from 1 (got {})", step));
  // As the CPU reference computes them, in float.
  const float mCorrection = 1.0f - std::pow(beta1, float(step));
  const float vCorrection = 1.0f - std::pow(beta2, float(step));
  PIPEC_QUEUE_TRY(ctx, launch::adamUpdate(params, grads, m, v, n, lr, beta1, beta2, eps,
                                          weightDecay, mCorrection, vCorrection, streamOf(ctx)));
  return llvm::Error::success();
}

} // namespace pipec::kernels::cuda
