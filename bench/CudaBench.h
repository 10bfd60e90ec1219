//===- CudaBench.h - the CUDA benchmarks' buffers, timer and report -*- C++ -*-===//
//
// What bench/cuda_kernel_bench.cpp and kernels/cuda/experimental/attention_backward_bench.cpp
// share: zeroed device buffers that live as long as the benchmark, the seconds per call of an op
// (wall clock over repeated launches on the context's stream after warm-up, synchronised at both
// ends) and the TFLOP/s line against the H200's dense bf16 peak. Not a test: the numbers go into
// docs/benchmarks.md.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_BENCH_CUDABENCH_H
#define PIPEC_BENCH_CUDABENCH_H

#include "kernels/cuda/CudaOps.h"

#include "llvm/Support/Error.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

namespace pipec::bench {

/// The peak the TFLOP/s are against: an H200 SXM's dense bf16 rate.
inline constexpr double kPeakBf16TFlops = 989.0;

/// "TOOL: error: MESSAGE" on standard error, then exit code 1.
[[noreturn]] inline void die(const char *tool, llvm::Error err) {
  fmt::print(stderr, "{}: error: {}\n", tool, llvm::toString(std::move(err)));
  std::exit(1);
}

/// A benchmark on one CUDA context.
struct CudaBench {
  kernels::cuda::CudaContext &ctx;
  const char *tool;  // the benchmark's name, which its errors start with
  int nameWidth;     // the column a report's name is padded to
  bool once = false; // each op launched once, its time that one call's (for a profiler)
  std::vector<kernels::cuda::DeviceBuffer> buffers = {};

  [[noreturn]] void die(llvm::Error err) const { bench::die(tool, std::move(err)); }

  /// A zeroed buffer of `n` elements of `dtype` that lives as long as the bench.
  void *buffer(size_t n, kernels::cuda::DType dtype) {
    const size_t bytes = n * kernels::cuda::sizeOf(dtype);
    llvm::Expected<kernels::cuda::DeviceBuffer> b = kernels::cuda::DeviceBuffer::allocate(bytes);
    if (!b)
      die(b.takeError());
    if (llvm::Error err = ctx.memsetZero(b->data(), bytes))
      die(std::move(err));
    buffers.push_back(std::move(*b));
    return buffers.back().data();
  }

  /// Seconds per call of `op`: 2 warm-up calls, then as many as fit in ~0.5 s (3..50); with
  /// `once`, one call.
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

  /// One line: the op's name, its time and its TFLOP/s, also as a fraction of the peak.
  void report(const std::string &name, double flops, double seconds) const {
    const double tflops = flops / seconds / 1e12;
    fmt::print("{:<{}} {:>10.3f} ms {:>9.1f} TFLOP/s {:>6.1f}% of peak\n", name, nameWidth,
               seconds * 1e3, tflops, 100.0 * tflops / kPeakBf16TFlops);
    std::fflush(stdout);
  }
};

} // namespace pipec::bench

#endif // PIPEC_BENCH_CUDABENCH_H
