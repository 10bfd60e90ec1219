//===- attention_backward_bench.cpp - the Hopper attention backward's TFLOP/s (EXPERIMENTAL) -===//
//
// Times the main line's attention backward (mma.sync) and the experimental Hopper one
// (AttentionBackward.h) in each dQ mode, at the size of bench/cuda_kernel_bench's attention (8k
// tokens, 32 heads of 128, bf16; whole sequence and the last of four Seq1F1B slices), in TFLOP/s
// against the H200's dense bf16 peak. The backward counts 5 matrix products (2.5x the forward's
// FLOPs) whatever it runs: the separate-dQ kernels run 7, so their rate is at most 5/7 of what
// their tensor cores reach. Needs a compute-capability-9.0 GPU (the Hopper kernels); elsewhere it
// measures the mma.sync backward alone.
//   bazel run -c opt //kernels/cuda/experimental:attention_backward_bench
//   ... -- --tiny   # toy sizes, each op once: a smoke run (CI runs it on the kernel emulator)
//   ... -- --once   # each backward launched once (for a profiler)
// Not a test: the numbers decide whether the kernels move into the main line (docs/gpu.md).
//
//===----------------------------------------------------------------------===//
#include "kernels/cuda/CudaOps.h"
#include "kernels/cuda/experimental/AttentionBackward.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

using namespace pipec::kernels::cuda;

namespace {

constexpr double kPeakBf16TFlops = 989.0; // H200 SXM, dense bf16

[[noreturn]] void die(llvm::Error err) {
  fmt::print(stderr, "attention_backward_bench: error: {}\n", llvm::toString(std::move(err)));
  std::exit(1);
}

struct Bench {
  CudaContext &ctx;
  bool once = false;
  std::vector<DeviceBuffer> buffers;

  void *buffer(size_t n, DType dtype) {
    llvm::Expected<DeviceBuffer> b = DeviceBuffer::allocate(n * sizeOf(dtype));
    if (!b)
      die(b.takeError());
    if (llvm::Error err = ctx.memsetZero(b->data(), n * sizeOf(dtype)))
      die(std::move(err));
    buffers.push_back(std::move(*b));
    return buffers.back().data();
  }

  /// Seconds per call of `op`: 2 warm-up calls, then as many as fit in ~0.5 s (3..50).
  double time(const std::function<llvm::Error()> &op) {
    using Clock = std::chrono::steady_clock;
    auto run = [&](int calls) {
      if (llvm::Error err = ctx.synchronize())
        die(std::move(err));
      auto start = Clock::now();
      for (int k = 0; k < calls; ++k)
        if (llvm::Error err = op())
          die(std::move(err));
      if (llvm::Error err = ctx.synchronize())
        die(std::move(err));
      return std::chrono::duration<double>(Clock::now() - start).count();
    };
    if (once)
      return run(1);
    run(2);
    const double one = run(1);
    const int calls = std::max(3, std::min(50, int(0.5 / std::max(one, 1e-6))));
    return run(calls) / calls;
  }

  void report(const std::string &name, double flops, double seconds) {
    const double tflops = flops / seconds / 1e12;
    fmt::print("{:<90} {:>10.3f} ms {:>9.1f} TFLOP/s {:>6.1f}% of peak\n", name, seconds * 1e3,
               tflops, 100.0 * tflops / kPeakBf16TFlops);
    std::fflush(stdout);
  }

  void attention(const std::string &name, AttentionShape s) {
    const DType dt = DType::BF16;
    const size_t qSize = size_t(s.batch) * s.queries * s.width();
    const size_t kvSize = size_t(s.keys()) * s.batch * s.width();
    void *q = buffer(qSize, dt), *k = buffer(kvSize, dt), *v = buffer(kvSize, dt);
    void *out = buffer(qSize, dt), *dOut = buffer(qSize, dt), *dq = buffer(qSize, dt);
    auto *dk = static_cast<float *>(buffer(kvSize, DType::F32));
    auto *dv = static_cast<float *>(buffer(kvSize, DType::F32));
    auto *lse = static_cast<float *>(buffer(size_t(s.batch) * s.heads * s.queries, DType::F32));
    if (llvm::Error err = attentionForward(ctx, dt, out, lse, q, k, v, s))
      die(std::move(err));
    // Visible (query, key) pairs: query a + t sees a + t + 1 keys; the backward's five products.
    const double pairs = double(s.queries) * s.begin + double(s.queries) * (s.queries + 1) / 2.0;
    const double flops = 2.5 * 4.0 * s.batch * s.heads * s.headDim * pairs;
    const std::string shape = fmt::format("{} bf16 (B{} x{} a{} H{} hd{}) bwd", name, s.batch,
                                          s.queries, s.begin, s.heads, s.headDim);
    report(shape + " (mma.sync; the main line's)", flops, time([&] {
             return attentionBackward(ctx, dt, dq, dk, dv, dOut, out, lse, q, k, v, s);
           }));
    if (!experimental::attentionBackwardWgmmaRuns(ctx, dt, s, {dq, dk, dv, dOut, out, q, k, v})) {
      fmt::print("{}: the Hopper backward does not run on this device (compute capability "
                 "{}.{})\n",
                 shape, ctx.computeCapability() / 10, ctx.computeCapability() % 10);
      return;
    }
    for (experimental::DqMode mode :
         {experimental::DqMode::Separate, experimental::DqMode::FloatAtomics,
          experimental::DqMode::FixedPoint})
      report(fmt::format("{} (wgmma, dQ {}; experimental)", shape, toString(mode)), flops,
             time([&] {
               return experimental::attentionBackwardWgmma(ctx, mode, dt, dq, dk, dv, dOut, out,
                                                           lse, q, k, v, s);
             }));
  }
};

} // namespace

int main(int argc, char **argv) {
  bool tiny = false, once = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--tiny") == 0) {
      tiny = true;
      continue;
    }
    if (std::strcmp(argv[i], "--once") == 0) {
      once = true;
      continue;
    }
    fmt::print(stderr,
               "attention_backward_bench: error: unknown flag '{}' (known: --tiny, --once)\n",
               argv[i]);
    return 2;
  }
  auto ctx = CudaContext::create(/*device=*/0, KernelConfig{});
  if (!ctx)
    die(ctx.takeError());
  // --tiny checks that the benchmark runs (its times mean nothing): each op launched once.
  Bench bench{**ctx, once || tiny, {}};
  const int tokens = tiny ? 128 : 8192, heads = tiny ? 2 : 32, headDim = tiny ? 64 : 128;
  fmt::print("attention_backward_bench: {} tokens, {} heads of {}; peak {} TFLOP/s (H200 dense "
             "bf16)\n",
             tokens, heads, headDim, kPeakBf16TFlops);
  bench.attention("attention", {/*batch=*/1, tokens, /*begin=*/0, heads, headDim});
  bench.attention("attention last-of-4 slice",
                  {/*batch=*/1, tokens / 4, /*begin=*/3 * tokens / 4, heads, headDim});
  return 0;
}
