//===- cuda_kernel_bench.cpp - achieved TFLOP/s of the CUDA matmuls and attention ----===//
//
// Times the ops of kernels/cuda/CudaOps.h at the sizes of a GPT layer (8k tokens, hidden 4096,
// 32 heads of 128) in bf16 — the matmuls of the layer in their three forms (forward, input
// gradient, weight gradient: the B/W split) and causal attention, whole-sequence and as the
// last of four Seq1F1B slices — and reports TFLOP/s and the fraction of the H200's dense bf16
// peak (989 TFLOP/s). The memory-bound kernels (layernorm, GELU, cross entropy over a 50k
// vocabulary, AdamW over one layer's parameters, the fp32 -> bf16 copy) report the bandwidth of
// the bytes they must move at least, against the H200's 4.8 TB/s. One fp32 matmul shows the
// strict-fp32 rate. Times are wall clock over repeated launches on one stream after warm-up, with a
// synchronize at both ends.
//   bazel run -c opt //bench:cuda_kernel_bench            # the full sizes
//   bazel run -c opt //bench:cuda_kernel_bench -- --quick # 1/4 the tokens
//   ... -- --tiny   # toy sizes: a smoke run (CI runs it on the kernel emulator; head dim 64,
//                   # so that the Hopper attention paths run there too)
//   ... -- --attention-once  # only the full-size attention, each kernel launched once: for a
//                            # profiler (ncu --section SpeedOfLight ... cuda_kernel_bench
//                            # --attention-once; docs/gpu.md)
// The attention forward is measured on the kernel the device runs (wgmma on an H100/H200,
// mma.sync elsewhere) and, where that is wgmma, on mma.sync too (a context whose KernelConfig
// turns the Hopper kernels off). The experimental Hopper backward has its own benchmark
// (kernels/cuda/experimental/attention_backward_bench.cpp).
// Not a test: the numbers go into docs/benchmarks.md.
//
//===----------------------------------------------------------------------===//
#include "bench/CudaBench.h"
#include "kernels/cuda/CudaOps.h"
#include "kernels/cuda/Launch.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>

using namespace pipec::kernels::cuda;

namespace {

using pipec::bench::kPeakBf16TFlops;
constexpr double kPeakHbmTBs = 4.8; // H200 SXM, HBM3e

struct Bench : pipec::bench::CudaBench {
  /// The memory-bound kernels: achieved bandwidth for the bytes they must move at least.
  void reportBandwidth(const std::string &name, double bytes, double seconds) {
    double tbs = bytes / seconds / 1e12;
    fmt::print("{:<80} {:>10.3f} ms {:>9.2f} TB/s    {:>6.1f}% of HBM\n", name, seconds * 1e3, tbs,
               100.0 * tbs / kPeakHbmTBs);
    std::fflush(stdout);
  }

  // Layernorm (forward and both backwards) and GELU over n rows of c (GELU on the MLP's n x f).
  void elementwise(DType dt, int n, int c, int f) {
    const double sz = double(sizeOf(dt)), nc = double(n) * c, nf = double(n) * f;
    void *x = buffer(size_t(n) * c, dt), *y = buffer(size_t(n) * c, dt);
    void *dy = buffer(size_t(n) * c, dt), *dx = buffer(size_t(n) * c, dt);
    void *w = buffer(c, dt), *b = buffer(c, dt);
    auto *mean = static_cast<float *>(buffer(n, DType::F32));
    auto *rstd = static_cast<float *>(buffer(n, DType::F32));
    auto *dW = static_cast<float *>(buffer(c, DType::F32));
    auto *dB = static_cast<float *>(buffer(c, DType::F32));
    const std::string rows = fmt::format("({}x{})", n, c);
    const std::string dtn = toString(dt);
    reportBandwidth("layernorm " + dtn + " " + rows + " fwd", 2 * nc * sz + 8.0 * n,
                    time([&] { return layernormForward(ctx, dt, y, mean, rstd, x, w, b, n, c); }));
    reportBandwidth("layernorm " + dtn + " " + rows + " dX +=", 4 * nc * sz + 8.0 * n, time([&] {
                      return layernormBackwardInputAccumulate(ctx, dt, dx, dy, x, mean, rstd, w, n,
                                                              c);
                    }));
    reportBandwidth("layernorm " + dtn + " " + rows + " dW, dB", 2 * nc * sz + 8.0 * n, time([&] {
                      return layernormBackwardWeight(ctx, dt, dW, dB, dy, x, mean, rstd, n, c);
                    }));
    void *u = buffer(size_t(n) * f, dt), *gu = buffer(size_t(n) * f, dt);
    void *du = buffer(size_t(n) * f, dt);
    const std::string mlp = fmt::format("({}x{})", n, f);
    reportBandwidth("gelu " + dtn + " " + mlp + " fwd", 2 * nf * sz,
                    time([&] { return geluForward(ctx, dt, gu, u, size_t(n) * f); }));
    reportBandwidth("gelu " + dtn + " " + mlp + " bwd", 3 * nf * sz,
                    time([&] { return geluBackward(ctx, dt, du, gu, u, size_t(n) * f); }));
  }

  // The Llama-style block's memory-bound kernels: RMSNorm over n rows of c, SwiGLU over the
  // MLP's n x f (reading gate | up rows of 2f), rotary embeddings of q (n rows of c).
  void llama(DType dt, int n, int c, int f, int headDim) {
    const double sz = double(sizeOf(dt)), nc = double(n) * c, nf = double(n) * f;
    void *x = buffer(size_t(n) * c, dt), *y = buffer(size_t(n) * c, dt);
    void *dy = buffer(size_t(n) * c, dt), *dx = buffer(size_t(n) * c, dt), *w = buffer(c, dt);
    auto *rstd = static_cast<float *>(buffer(n, DType::F32));
    auto *dW = static_cast<float *>(buffer(c, DType::F32));
    auto *positions = static_cast<int32_t *>(buffer(n, DType::F32)); // zeros: position 0
    const std::string rows = fmt::format("({}x{})", n, c), dtn = toString(dt);
    reportBandwidth("rmsnorm " + dtn + " " + rows + " fwd", 2 * nc * sz + 4.0 * n,
                    time([&] { return rmsnormForward(ctx, dt, y, rstd, x, w, n, c); }));
    reportBandwidth("rmsnorm " + dtn + " " + rows + " dX +=", 4 * nc * sz + 4.0 * n, time([&] {
                      return rmsnormBackwardInputAccumulate(ctx, dt, dx, dy, x, rstd, w, n, c);
                    }));
    reportBandwidth("rmsnorm " + dtn + " " + rows + " dW", 2 * nc * sz + 4.0 * n,
                    time([&] { return rmsnormBackwardWeight(ctx, dt, dW, dy, x, rstd, n, c); }));
    reportBandwidth("rope " + dtn + " " + rows + " fwd (in place)", 2 * nc * sz + 4.0 * n,
                    time([&] {
                      return ropeForward(ctx, dt, y, positions, n, c / headDim, headDim, 500000.0);
                    }));
    void *pre = buffer(size_t(n) * 2 * f, dt), *dPre = buffer(size_t(n) * 2 * f, dt);
    void *act = buffer(size_t(n) * f, dt), *dAct = buffer(size_t(n) * f, dt);
    const std::string mlp = fmt::format("({}x{})", n, f);
    reportBandwidth("swiglu " + dtn + " " + mlp + " fwd", 3 * nf * sz,
                    time([&] { return swigluForward(ctx, dt, act, pre, n, f); }));
    reportBandwidth("swiglu " + dtn + " " + mlp + " bwd", 5 * nf * sz,
                    time([&] { return swigluBackward(ctx, dt, dPre, dAct, pre, n, f); }));
  }

  // Cross entropy over n rows of a vocabulary of v; AdamW and the fp32 -> bf16 copy over p
  // parameters.
  void lossAndOptimizer(DType dt, int n, int v, size_t p) {
    const double sz = double(sizeOf(dt)), nv = double(n) * v;
    void *logits = buffer(size_t(n) * v, dt), *dLogits = buffer(size_t(n) * v, dt);
    auto *targets = static_cast<int32_t *>(buffer(n, DType::F32)); // zeros: token 0
    auto *rowLoss = static_cast<float *>(buffer(n, DType::F32));
    auto *lse = static_cast<float *>(buffer(n, DType::F32));
    const std::string rows = fmt::format("({}x{})", n, v);
    reportBandwidth("cross entropy " + std::string(toString(dt)) + " " + rows + " fwd",
                    nv * sz + 8.0 * n, time([&] {
                      return crossEntropyForward(ctx, dt, rowLoss, lse, logits, targets, n, v,
                                                 1.0f / float(n));
                    }));
    reportBandwidth("cross entropy " + std::string(toString(dt)) + " " + rows + " bwd",
                    2 * nv * sz + 8.0 * n, time([&] {
                      return crossEntropyBackward(ctx, dt, dLogits, logits, lse, targets, n, v,
                                                  1.0f / float(n));
                    }));
    // Vocab-parallel at tp 8: one rank's statistics over its v / 8 columns, and the merge of
    // the 8 shards' summed statistics.
    const int tp = 8, vl = v / tp;
    auto *stats = static_cast<float *>(buffer(size_t(n) * (2 * tp + 1), DType::F32));
    reportBandwidth(fmt::format("cross entropy {} ({}x{}) shard stats, tp {}",
                                std::string(toString(dt)), n, vl, tp),
                    double(n) * vl * sz + 4.0 * n * (2 * tp + 1), time([&] {
                      return crossEntropyShardStats(ctx, dt, stats, logits, targets, n, vl, 0, 0,
                                                    tp);
                    }));
    reportBandwidth(fmt::format("cross entropy combine of {} shards ({} rows)", tp, n),
                    4.0 * n * (2 * tp + 3), time([&] {
                      return crossEntropyCombine(ctx, rowLoss, lse, stats, n, tp, 1.0f / float(n));
                    }));
    auto *params = static_cast<float *>(buffer(p, DType::F32));
    auto *grads = static_cast<float *>(buffer(p, DType::F32));
    auto *m = static_cast<float *>(buffer(p, DType::F32));
    auto *vv = static_cast<float *>(buffer(p, DType::F32));
    void *copy = buffer(p, DType::BF16);
    int step = 0;
    reportBandwidth(fmt::format("adamw fp32 ({} params)", p), 7.0 * 4 * double(p), time([&] {
                      return adamUpdate(ctx, params, grads, m, vv, p, 1e-4f, 0.9f, 0.95f, 1e-8f,
                                        0.1f, ++step);
                    }));
    reportBandwidth(fmt::format("convert fp32 -> bf16 ({})", p), 6.0 * double(p),
                    time([&] { return convert(ctx, DType::BF16, copy, DType::F32, params, p); }));
  }

  // A row-major (n, i) @ (i, o) matmul in its three forms.
  void matmul(const std::string &name, DType dt, int n, int i, int o) {
    void *x = buffer(size_t(n) * i, dt), *w = buffer(size_t(i) * o, dt);
    void *y = buffer(size_t(n) * o, dt), *bias = buffer(o, dt);
    auto *dW = static_cast<float *>(buffer(size_t(i) * o, DType::F32));
    const double flops = 2.0 * n * i * o;
    const std::string shape = fmt::format("{} {} ({}x{}x{})", name, toString(dt), n, i, o);
    report(shape + " fwd+bias", flops,
           time([&] { return matmulForward(ctx, dt, y, x, w, bias, n, i, o); }));
    report(shape + " dX (B)", flops,
           time([&] { return matmulBackwardInput(ctx, dt, x, y, w, n, i, o); }));
    report(shape + " dW (W)", flops,
           time([&] { return matmulBackwardWeight(ctx, dt, dW, nullptr, x, y, n, i, o); }));
  }

  // Causal attention of queries [a, a + x) over keys [0, a + x).
  void attention(const std::string &name, DType dt, AttentionShape s) {
    const size_t qSize = size_t(s.batch) * s.queries * s.width();
    const size_t kvSize = size_t(s.keys()) * s.batch * s.kvHeadCount() * s.headDim;
    void *q = buffer(qSize, dt), *k = buffer(kvSize, dt), *v = buffer(kvSize, dt);
    void *out = buffer(qSize, dt), *dOut = buffer(qSize, dt), *dq = buffer(qSize, dt);
    // dK and dV are fp32 accumulators in both types (CudaOps.h).
    auto *dk = static_cast<float *>(buffer(kvSize, DType::F32));
    auto *dv = static_cast<float *>(buffer(kvSize, DType::F32));
    auto *lse = static_cast<float *>(buffer(size_t(s.batch) * s.heads * s.queries, DType::F32));
    // Visible (query, key) pairs: query a + t sees a + t + 1 keys.
    const double pairs = double(s.queries) * s.begin + double(s.queries) * (s.queries + 1) / 2.0;
    const double fwdFlops = 4.0 * s.batch * s.heads * s.headDim * pairs; // QK^T and PV
    const std::string shape = fmt::format(
        "{} {} (B{} x{} a{} H{} hd{}{})", name, toString(dt), s.batch, s.queries, s.begin, s.heads,
        s.headDim, s.kvHeadCount() != s.heads ? fmt::format(" KV{}", s.kvHeads) : "");
    const launch::AttentionDims dims{s.batch, s.queries, s.begin, s.heads, s.headDim, s.kvHeads};
    const launch::Target target{ctx.computeCapability(), ctx.kernelConfig().hopperKernels};
    const launch::AttentionKernel forwardKernel =
        launch::attentionForwardKernel(target, dt, dims, {out, q, k, v});
    report(fmt::format("{} fwd ({})", shape, toString(forwardKernel)), fwdFlops,
           time([&] { return attentionForward(ctx, dt, out, lse, q, k, v, s); }));
    if (forwardKernel == launch::AttentionKernel::Wgmma) {
      // The forward an sm_80 GPU runs, on this one: a context without the Hopper kernels.
      auto noHopper = CudaContext::create(ctx.device(), KernelConfig{.hopperKernels = false});
      if (!noHopper)
        die(noHopper.takeError());
      if (llvm::Error err = ctx.synchronize())
        die(std::move(err));
      Bench other{{**noHopper, tool, nameWidth, once}};
      report(shape + " fwd (mma.sync)", fwdFlops,
             other.time([&] { return attentionForward(**noHopper, dt, out, lse, q, k, v, s); }));
    }
    // The backward's five products (S recomputed, dP, dV, dQ, dK): 2.5x the forward.
    report(
        fmt::format(
            "{} bwd ({})", shape,
            toString(launch::attentionBackwardKernel(dt, dims, {dq, dk, dv, dOut, out, q, k, v}))),
        2.5 * fwdFlops,
        time([&] { return attentionBackward(ctx, dt, dq, dk, dv, dOut, out, lse, q, k, v, s); }));
  }
};

} // namespace

int main(int argc, char **argv) {
  bool quick = false, tiny = false, attentionOnce = false;
  for (int k = 1; k < argc; ++k) {
    if (std::strcmp(argv[k], "--attention-once") == 0) {
      attentionOnce = true;
      continue;
    }
    if (std::strcmp(argv[k], "--quick") == 0) {
      quick = true;
      continue;
    }
    if (std::strcmp(argv[k], "--tiny") == 0) {
      tiny = true;
      continue;
    }
    fmt::print(stderr,
               "cuda_kernel_bench: error: unknown flag '{}' (known: --quick, --tiny, "
               "--attention-once)\n",
               argv[k]);
    return 2;
  }
  // The kernels the device runs by default (the tools' KernelConfig).
  llvm::Expected<std::unique_ptr<CudaContext>> ctx =
      CudaContext::create(/*device=*/0, KernelConfig{});
  if (!ctx)
    pipec::bench::die("cuda_kernel_bench", ctx.takeError());
  Bench bench{{**ctx, "cuda_kernel_bench", /*nameWidth=*/80}};
  // --tiny: every op at toy sizes, to check the bench itself runs
  // (bench:cuda_kernel_bench_kernel_emu_test runs it on the kernel emulator in CI); its numbers
  // mean nothing.
  const int tokens = tiny ? 128 : quick ? 2048 : 8192, hidden = tiny ? 64 : 4096;
  const int heads = tiny ? 2 : 32, headDim = tiny ? 64 : 128, vocab = tiny ? 256 : 50304;
  fmt::print("cuda_kernel_bench: {} tokens, hidden {}, {} heads of {}; peak {} TFLOP/s "
             "(H200 dense bf16)\n",
             tokens, hidden, heads, headDim, kPeakBf16TFlops);
  if (attentionOnce) {
    // Every attention kernel the device runs (the forward on wgmma and on mma.sync where the
    // device has wgmma, the backward) launched once, for a profiler to name and measure; the
    // times are one call's.
    fmt::print("--attention-once: each path launched once; times are of one call, not a "
               "measurement\n");
    bench.once = true;
    bench.attention("attention", DType::BF16,
                    {/*batch=*/1, /*queries=*/tokens, /*begin=*/0, heads, headDim});
    return 0;
  }
  bench.matmul("qkv", DType::BF16, tokens, hidden, 3 * hidden);
  bench.matmul("attn-proj", DType::BF16, tokens, hidden, hidden);
  bench.matmul("mlp-up", DType::BF16, tokens, hidden, 4 * hidden);
  bench.matmul("mlp-down", DType::BF16, tokens, 4 * hidden, hidden);
  bench.matmul("attn-proj", DType::F32, tokens, hidden, hidden);
  bench.attention("attention", DType::BF16,
                  {/*batch=*/1, /*queries=*/tokens, /*begin=*/0, heads, headDim});
  bench.attention("attention last-of-4 slice", DType::BF16,
                  {/*batch=*/1, /*queries=*/tokens / 4, /*begin=*/3 * tokens / 4, heads, headDim});
  // Llama 3 8B's grouped heads: 8 key/value heads for 32 (the SIMT kernels).
  bench.attention("attention GQA", DType::BF16,
                  {/*batch=*/1, /*queries=*/tokens, /*begin=*/0, heads, headDim,
                   /*kvHeads=*/tiny ? 1 : 8});
  fmt::print("memory-bound kernels: peak {} TB/s (H200 HBM3e)\n", kPeakHbmTBs);
  bench.elementwise(DType::BF16, tokens, hidden, 4 * hidden);
  // Llama 3 8B's MLP: ffn 14336 (3.5 hidden).
  bench.llama(DType::BF16, tokens, hidden, tiny ? 224 : 14336, headDim);
  // A GPT-2-sized vocabulary; one layer's parameters (12 hidden^2) for the optimizer.
  bench.lossAndOptimizer(DType::BF16, tokens, vocab, size_t(12) * hidden * hidden);
  return 0;
}
