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
#include "bench/OverheadBench.h"
#include "bench/UniformPlan.h"
#include "ir/support/Error.h"
#include "kernels/cuda/CudaCheck.h"
#include "runtime/Runner.h"
#include "runtime/cuda/LocalTransport.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <chrono>

using namespace pipec;

namespace {

/// The local transport's rank `thread`: its compute stream attached to the transport.
class LocalEmptyBackend final : public bench::EmptyDeviceBackend {
public:
  LocalEmptyBackend(LocalCudaTransport &transport, int thread)
      : transport(transport), thread(thread) {}
  llvm::Error init(size_t n) {
    if (auto err = EmptyDeviceBackend::init(n))
      return err;
    return transport.attach(thread, computeStream(), [] { return llvm::Error::success(); });
  }
  llvm::Error beginStep(int) override { return setDevice(0); }
  llvm::Error optimizerStep() override { return transport.waitForCollectives(thread); }

private:
  LocalCudaTransport &transport;
  int thread;
};

int fail(llvm::Error err, int code = -1) {
  return bench::fail("cuda_overhead_bench", std::move(err), code);
}

} // namespace

int main(int argc, char **argv) {
  auto flags = bench::parseOverheadFlags(argc, argv, {}, 1);
  if (!flags)
    return fail(flags.takeError());
  const int64_t pp = flags->pp, m = flags->microbatches, steps = flags->steps,
                floats = flags->floats;
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    fmt::print(stderr, "cuda_overhead_bench: no usable CUDA device\n");
    return 2;
  }
  const std::string &schedule = flags->schedule;
  auto plan = bench::compileUniformPlan(int(pp), int(m), schedule);
  if (!plan)
    return fail(plan.takeError());
  if (plan->parallel.tp * plan->parallel.dp != 1) {
    fmt::print(stderr, "cuda_overhead_bench: tp and dp must be 1\n");
    return 2;
  }
  LocalCudaTransport transport(*plan, int(pp));
  std::vector<std::unique_ptr<Backend>> backends;
  std::vector<LocalEmptyBackend *> raw;
  for (int t = 0; t < int(pp); ++t) {
    auto b = std::make_unique<LocalEmptyBackend>(transport, t);
    if (auto err = b->init(size_t(floats)))
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
  for (int64_t s = 0; s <= steps; ++s) { // step 0 warms up (events, copy engines)
    auto start = Clock::now();
    if (auto err = runner.step(int(s)))
      return fail(std::move(err), 1);
    double host = std::chrono::duration<double>(Clock::now() - start).count();
    for (LocalEmptyBackend *b : raw)
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
             schedule, pp, m, floats, longest, bestHost, bestHost / double(longest) * 1e6,
             bestTotal, allInstructions, bestHost / double(allInstructions) * 1e6, p2pOps);
  return 0;
}
