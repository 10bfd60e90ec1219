//===- compile_bench.cpp - Compile + verify + simulate throughput ---------===//
//
// Compiles a 1f1b plan (one unit layer per stage) through the whole default pipeline
// (partition, schedule, comm lowering, collectives, memory, simulate, verify) and reports
// instructions per second and the process's peak resident memory. One configuration per process
// so the peak belongs to it:
//   bazel run -c opt //bench:compile_bench -- --pp 64 --microbatches 1024
// Not a test: the numbers go into the README.
//
//===----------------------------------------------------------------------===//
#include "bench/UniformPlan.h"
#include "compiler/Pass.h"
#include "ir/support/Error.h"
#include "tools/Args.h"

#include <fmt/format.h>

#include <chrono>
#include <sys/resource.h>

using namespace pipec;

int main(int argc, char **argv) {
  auto args = Args::parse(argc, argv, 1, {"--pp", "--microbatches", "--schedule", "--repeat"}, {},
                          /*command=*/"");
  if (!args) {
    fmt::print(stderr, "compile_bench: {}\n", takeMessage(args.takeError()));
    return 2;
  }
  auto pp = args->integer("--pp", 64, 1, 4096);
  auto m = args->integer("--microbatches", 1024, 1, 1 << 20);
  auto repeat = args->integer("--repeat", 3, 1, 100);
  if (!pp || !m || !repeat) {
    llvm::Error err = !pp ? pp.takeError() : !m ? m.takeError() : repeat.takeError();
    fmt::print(stderr, "compile_bench: {}\n", takeMessage(std::move(err)));
    return 2;
  }
  ModelSpec model = bench::uniformModel(int(*pp), bench::kCompileBenchSizes);
  CompileOptions o;
  o.schedule = args->get("--schedule").value_or("1f1b");
  o.parallel.pp = int(*pp);
  o.parallel.microbatches = int(*m);
  double best = 1e300;
  size_t instructions = 0;
  double bubble = 0;
  for (int64_t i = 0; i < *repeat; ++i) {
    auto start = std::chrono::steady_clock::now();
    auto plan = compilePlan(model, ClusterSpec::defaults(), o);
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (!plan) {
      fmt::print(stderr, "compile_bench: {}\n", takeMessage(plan.takeError()));
      return 1;
    }
    instructions = plan->numInstructions();
    bubble = plan->stats.bubbleRatio;
    best = std::min(best, secs);
  }
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  double rssMiB = double(ru.ru_maxrss) / 1024.0;
  fmt::print("schedule={} pp={} microbatches={} instructions={} best_of_{}={:.3f}s ({:.3f}ms) "
             "instructions_per_s={:.2f}M peak_rss={:.1f}MiB bytes_per_instruction={:.0f} "
             "bubble={:.4f}\n",
             o.schedule, *pp, *m, instructions, *repeat, best, best * 1e3,
             double(instructions) / best / 1e6, rssMiB, rssMiB * 1048576.0 / double(instructions),
             bubble);
  return 0;
}
