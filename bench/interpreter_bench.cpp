//===- interpreter_bench.cpp - Interpreter overhead per instruction -------===//
//
// Runs a compiled 1f1b plan through the real interpreter, transport and watchdog with a backend
// whose compute does nothing, and reports wall time per instruction of the longest stream (the
// cost the runtime adds on the critical path of each op: dispatch, progress, p2p rendezvous).
//   bazel run -c opt //bench:interpreter_bench -- --pp 2 --microbatches 4096
// Not a test: the numbers go into the README.
//
//===----------------------------------------------------------------------===//
#include "bench/UniformPlan.h"
#include "ir/support/Error.h"
#include "runtime/Runner.h"
#include "tools/Args.h"

#include <fmt/format.h>

#include <chrono>

using namespace pipec;

namespace {

class NullBackend final : public Backend {
public:
  llvm::Error beginStep(int) override { return llvm::Error::success(); }
  llvm::Error compute(const Instruction &) override { return llvm::Error::success(); }
  TensorView sendData(const Instruction &) override { return std::span<float>(buf); }
  TensorView recvData(const Instruction &) override { return std::span<float>(buf); }
  TensorView reduceData(const Instruction &) override { return {}; }
  llvm::Error afterAllReduce(const Instruction &) override { return llvm::Error::success(); }
  void sumLocalEmbeddingCopies() override {}
  llvm::Error optimizerStep() override { return llvm::Error::success(); }

private:
  float buf[1] = {0};
};

} // namespace

int main(int argc, char **argv) {
  auto args = Args::parse(argc, argv, 1, {"--pp", "--microbatches", "--steps", "--schedule"}, {},
                          /*command=*/"");
  if (!args) {
    fmt::print(stderr, "interpreter_bench: {}\n", takeMessage(args.takeError()));
    return 2;
  }
  auto pp = args->integer("--pp", 2, 1, 64);
  auto m = args->integer("--microbatches", 4096, 1, 1 << 20);
  auto steps = args->integer("--steps", 3, 1, 100);
  if (!pp || !m || !steps) {
    llvm::Error err = !pp ? pp.takeError() : !m ? m.takeError() : steps.takeError();
    fmt::print(stderr, "interpreter_bench: {}\n", takeMessage(std::move(err)));
    return 2;
  }
  const std::string schedule = args->get("--schedule").value_or("1f1b");
  auto plan = bench::compileUniformPlan(int(*pp), int(*m), schedule);
  if (!plan) {
    fmt::print(stderr, "interpreter_bench: {}\n", takeMessage(plan.takeError()));
    return 1;
  }
  std::vector<std::unique_ptr<Backend>> backends;
  for (int t = 0; t < *pp; ++t)
    backends.push_back(std::make_unique<NullBackend>());
  Runner runner(*plan, Faults{}, /*timeoutSeconds=*/60, std::move(backends));
  const size_t longest = bench::longestStream(*plan);
  double best = 1e300;
  for (int64_t s = 0; s < *steps; ++s) {
    auto start = std::chrono::steady_clock::now();
    if (auto err = runner.step(int(s))) {
      fmt::print(stderr, "interpreter_bench: {}\n", takeMessage(std::move(err)));
      return 1;
    }
    best = std::min(
        best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  fmt::print("schedule={} pp={} microbatches={} longest_stream={} best_step={:.4f}s "
             "per_instruction={:.3f}us\n",
             schedule, *pp, *m, longest, best, best / double(longest) * 1e6);
  return 0;
}
