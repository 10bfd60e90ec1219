//===- OverheadBench.h - What the two runtime-overhead benchmarks share -*- C++ -*-===//
//
// cuda_overhead_bench (every rank on one GPU, the local transport) and nccl_overhead_bench (one
// rank per process, the nccl transport) time the runtime with a backend whose compute queues
// nothing: EmptyDeviceBackend holds the device buffers its sends, recvs and all-reduces use and
// the compute stream; each benchmark adds how a step begins and how the optimizer step waits
// for its transport. Both take the same flags (parseOverheadFlags).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_BENCH_OVERHEADBENCH_H
#define PIPEC_BENCH_OVERHEADBENCH_H

#include "ir/support/Error.h"
#include "kernels/cuda/CudaCheck.h"
#include "runtime/Backend.h"
#include "runtime/cuda/DeviceHandles.h"
#include "tools/Args.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <string>

namespace pipec::bench {

/// Device buffers of `floats` floats each for what a rank sends, receives and sums, `extra`
/// floats after them, and a compute stream; compute queues nothing.
class EmptyDeviceBackend : public Backend {
public:
  ~EmptyDeviceBackend() override {
    if (buffers)
      (void)cudaFree(buffers);
  }
  llvm::Error init(size_t n, size_t extra = 0) {
    floats = n;
    if (auto err = stream.create())
      return err;
    void *p = nullptr;
    PIPEC_CUDA_TRY(cudaMalloc(&p, (3 * n + extra) * sizeof(float)));
    buffers = static_cast<float *>(p);
    PIPEC_CUDA_TRY(cudaMemset(buffers, 0, (3 * n + extra) * sizeof(float)));
    return llvm::Error::success();
  }
  cudaStream_t computeStream() const { return stream.get(); }
  /// The `extra` floats of init().
  float *extraFloats() const { return buffers + 3 * floats; }

  llvm::Error compute(const Instruction &) override { return llvm::Error::success(); }
  TensorView sendData(const Instruction &) override { return std::span(buffers, floats); }
  TensorView recvData(const Instruction &) override { return std::span(buffers + floats, floats); }
  TensorView reduceData(const Instruction &) override {
    return std::span(buffers + 2 * floats, floats);
  }
  llvm::Error afterAllReduce(const Instruction &) override { return llvm::Error::success(); }
  void sumLocalEmbeddingCopies() override {}

protected:
  static llvm::Error setDevice(int device) {
    PIPEC_CUDA_TRY(cudaSetDevice(device));
    return llvm::Error::success();
  }

private:
  runtime_cuda::OwnedStream stream;
  float *buffers = nullptr;
  size_t floats = 0;
};

/// Prints `err` as the tools do ("<tool>: error: <one line>" for bad input) and returns `code`,
/// by default exitCodeFor's: 2 for bad input, 1 for a finding.
inline int fail(llvm::StringRef tool, llvm::Error err, int code = -1) {
  if (code < 0)
    code = exitCodeFor(err);
  std::string message = takeMessage(std::move(err));
  std::replace(message.begin(), message.end(), '\n', ' ');
  fmt::print(stderr, "{}: {}{}\n", tool.str(), code == 2 ? "error: " : "", message);
  return code;
}

struct OverheadFlags {
  Args args;
  int64_t pp, microbatches, steps, floats;
  std::string schedule;
};

/// --pp (at least `minPp`), --microbatches, --steps, --schedule and --floats, and `switches`;
/// an input error names the flag (and not the tool, which fail adds).
inline llvm::Expected<OverheadFlags>
parseOverheadFlags(int argc, char **argv, llvm::ArrayRef<llvm::StringRef> switches, int64_t minPp) {
  auto args =
      Args::parse(argc, argv, 1, {"--pp", "--microbatches", "--steps", "--schedule", "--floats"},
                  switches, /*command=*/"");
  if (!args)
    return args.takeError();
  if (!args->positional().empty())
    return inputError("unexpected argument '{}'; it takes only flags (--pp, --microbatches, "
                      "--steps, --schedule, --floats)",
                      args->positional().front());
  auto pp = args->integer("--pp", 4, minPp, 32);
  auto m = args->integer("--microbatches", 1024, 1, 1 << 16);
  auto steps = args->integer("--steps", 3, 1, 100);
  auto floats = args->integer("--floats", 4096, 1, 1 << 24);
  for (auto *v : {&pp, &m, &steps, &floats})
    if (!*v)
      return v->takeError();
  std::string schedule = args->get("--schedule").value_or("1f1b");
  return OverheadFlags{std::move(*args), *pp, *m, *steps, *floats, std::move(schedule)};
}

} // namespace pipec::bench

#endif // PIPEC_BENCH_OVERHEADBENCH_H
