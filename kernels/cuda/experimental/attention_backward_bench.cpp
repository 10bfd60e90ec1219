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
#include "bench/CudaBench.h"
#include "kernels/cuda/CudaOps.h"
#include "kernels/cuda/experimental/AttentionBackward.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>

using namespace pipec::kernels::cuda;

namespace {

using pipec::bench::kPeakBf16TFlops;

struct Bench : pipec::bench::CudaBench {
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
    pipec::bench::die("attention_backward_bench", ctx.takeError());
  // --tiny checks that the benchmark runs (its times mean nothing): each op launched once.
  Bench bench{{**ctx, "attention_backward_bench", /*nameWidth=*/90, once || tiny}};
  const int tokens = tiny ? 128 : 8192, heads = tiny ? 2 : 32, headDim = tiny ? 64 : 128;
  fmt::print("attention_backward_bench: {} tokens, {} heads of {}; peak {} TFLOP/s (H200 dense "
             "bf16)\n",
             tokens, heads, headDim, kPeakBf16TFlops);
  bench.attention("attention", {/*batch=*/1, tokens, /*begin=*/0, heads, headDim});
  bench.attention("attention last-of-4 slice",
                  {/*batch=*/1, tokens / 4, /*begin=*/3 * tokens / 4, heads, headDim});
  return 0;
}
