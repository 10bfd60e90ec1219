//===- cuda_overhead_bench.cpp - Host cost per instruction of the cuda backend's runtime -===//
//
// interpreter_bench on the device: a compiled plan runs through the interpreter, the watchdog
// and the `local` transport (runtime/cuda/LocalTransport.h: events, device-to-device copies
// of --floats floats per message) with backends whose compute ops queue nothing, so the time
// is what the runtime itself adds per instruction on the host (the target is <= 10 us on an
// H200 host). Reports the host time of the best step per instruction of the longest stream,
// and the step time including the device's copies; then the instructions of all ranks, the
// host time per instruction of all ranks (if it stays flat as pp grows while the first
// figure grows, the ranks' host work is serialized, not concurrent) and the p2p ops.
//   bazel run -c opt //bench:cuda_overhead_bench -- --pp 4 --microbatches 1024
// Needs a GPU; not a test: the numbers go into the README.
//
//===----------------------------------------------------------------------===//
#include "bench/UniformPlan.h"
#include "ir/Error.h"
#include "kernels/cuda/CudaCheck.h"
#include "runtime/Runner.h"
#include "runtime/cuda/DeviceHandles.h"
#include "runtime/cuda/LocalTransport.h"
#include "tools/Args.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <chrono>

using namespace pipec;

namespace {

/// Device buffers for what a rank sends and receives; compute queues nothing.
class EmptyDeviceBackend final : public Backend {
public:
  EmptyDeviceBackend(LocalCudaTransport &transport, int thread)
      : transport(transport), thread(thread) {}
  ~EmptyDeviceBackend() override {
    if (buffers)
      (void)cudaFree(buffers);
  }
  llvm::Error init(size_t n) {
    floats = n;
    if (auto err = stream.create())
      return err;
    void *p = nullptr;
    PIPEC_CUDA_TRY(cudaMalloc(&p, 3 * n * sizeof(float)));
    buffers = static_cast<float *>(p);
    PIPEC_CUDA_TRY(cudaMemset(buffers, 0, 3 * n * sizeof(float)));
    return transport.attach(thread, stream.get(), [] { return llvm::Error::success(); });
  }
  cudaStream_t computeStream() const { return stream.get(); }

  llvm::Error beginStep(int) override { return cudaCheck(cudaSetDevice(0)); }
  llvm::Error compute(const Instruction &) override { return llvm::Error::success(); }
  TensorView sendData(const Instruction &) override { return std::span(buffers, floats); }
  TensorView recvData(const Instruction &) override { return std::span(buffers + floats, floats); }
  TensorView reduceData(const Instruction &) override {
    return std::span(buffers + 2 * floats, floats);
  }
  llvm::Error afterAllReduce(const Instruction &) override { return llvm::Error::success(); }
  void sumLocalEmbeddingCopies() override {}
  llvm::Error optimizerStep() override { return transport.waitForCollectives(thread); }

private:
  static llvm::Error cudaCheck(cudaError_t status) {
    PIPEC_CUDA_TRY(status);
    return llvm::Error::success();
  }
  LocalCudaTransport &transport;
  int thread;
  runtime_cuda::OwnedStream stream;
  float *buffers = nullptr;
  size_t floats = 0;
};

int fail(llvm::Error err, int code) {
  fmt::print(stderr, "cuda_overhead_bench: {}\n", takeMessage(std::move(err)));
  return code;
}

} // namespace

int main(int argc, char **argv) {
  auto args =
      Args::parse(argc, argv, 1, {"--pp", "--microbatches", "--steps", "--schedule", "--floats"},
                  {}, "cuda_overhead_bench");
  if (!args)
    return fail(args.takeError(), 2);
  auto pp = args->integer("--pp", 4, 1, 32);
  auto m = args->integer("--microbatches", 1024, 1, 1 << 16);
  auto steps = args->integer("--steps", 3, 1, 100);
  auto floats = args->integer("--floats", 4096, 1, 1 << 24);
  for (auto *v : {&pp, &m, &steps, &floats})
    if (!*v)
      return fail(v->takeError(), 2);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    fmt::print(stderr, "cuda_overhead_bench: no usable CUDA device\n");
    return 2;
  }
  const std::string schedule = args->get("--schedule").value_or("1f1b");
  auto plan = bench::compileUniformPlan(int(*pp), int(*m), schedule);
  if (!plan)
    return fail(plan.takeError(), 1);
  if (plan->parallel.tp * plan->parallel.dp != 1) {
    fmt::print(stderr, "cuda_overhead_bench: tp and dp must be 1\n");
    return 2;
  }
  LocalCudaTransport transport(*plan, int(*pp));
  std::vector<std::unique_ptr<Backend>> backends;
  std::vector<EmptyDeviceBackend *> raw;
  for (int t = 0; t < int(*pp); ++t) {
    auto b = std::make_unique<EmptyDeviceBackend>(transport, t);
    if (auto err = b->init(size_t(*floats)))
      return fail(std::move(err), 1);
    raw.push_back(b.get());
    backends.push_back(std::move(b));
  }
  Runner runner(*plan, Faults{}, /*timeoutSeconds=*/60, std::move(backends), transport);
  const size_t longest = bench::longestStream(*plan);
  size_t allInstructions = 0, p2pOps = 0;
  for (const auto &stream : plan->ranks) {
    allInstructions += stream.size();
    for (const Instruction &i : stream)
      p2pOps += i.isP2P() ? 1 : 0;
  }
  using Clock = std::chrono::steady_clock;
  double bestHost = 1e300, bestTotal = 1e300;
  for (int64_t s = 0; s <= *steps; ++s) { // step 0 warms up (events, copy engines)
    auto start = Clock::now();
    if (auto err = runner.step(int(s)))
      return fail(std::move(err), 1);
    double host = std::chrono::duration<double>(Clock::now() - start).count();
    for (EmptyDeviceBackend *b : raw)
      if (cudaStreamSynchronize(b->computeStream()) != cudaSuccess) {
        fmt::print(stderr, "cuda_overhead_bench: cudaStreamSynchronize failed\n");
        return 1;
      }
    double total = std::chrono::duration<double>(Clock::now() - start).count();
    if (s > 0) {
      bestHost = std::min(bestHost, host);
      bestTotal = std::min(bestTotal, total);
    }
  }
  fmt::print("schedule={} pp={} microbatches={} floats={} longest_stream={} host_step={:.4f}s "
             "host_per_instruction={:.2f}us step_with_device={:.4f}s all_ranks_instructions={} "
             "host_per_instruction_all_ranks={:.2f}us p2p_ops={}\n",
             schedule, *pp, *m, *floats, longest, bestHost, bestHost / double(longest) * 1e6,
             bestTotal, allInstructions, bestHost / double(allInstructions) * 1e6, p2pOps);
  return 0;
}
