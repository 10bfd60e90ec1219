//===- plan_bench.cpp - pipec plan's search speed, and how it grows with N -----===//
//
//   plan_bench [--model examples/gpt3-175b.json] [--cluster examples/a100-80g.json]
//              [--gpus 64,128,256,512,1024,2048] [--global-batch 1536] [--threads T]
// Runs the planner (compiler/Planner.h, the search `pipec plan` runs) once per GPU count and
// prints, per count, the candidates, wall and CPU seconds, candidates per wall second, how many
// were simulated and compiled, and the best layout. CPU seconds matter on a shared machine:
// wall time there also counts other processes' turns on the cores. Target: the 175B GPT on
// 1,024 GPUs (8 per node) in at most 10 s on a 2-core machine. Not a test: the numbers go into
// docs/benchmarks.md.
//
//===----------------------------------------------------------------------===//
#include "compiler/Planner.h"
#include "ir/Model.h"
#include "ir/formats/SpecJson.h"
#include "ir/support/Error.h"
#include "tools/Args.h"

#include "llvm/ADT/StringExtras.h"

#include <fmt/format.h>

#include <chrono>
#include <sys/resource.h>

using namespace pipec;

namespace {

double cpuSeconds() {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return double(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
         double(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

int fail(llvm::Error err) {
  fmt::print(stderr, "plan_bench: {}\n", takeMessage(std::move(err)));
  return 2;
}

} // namespace

int main(int argc, char **argv) {
  keepFreedMemoryForPlanning(); // as `pipec plan` does
  auto args = Args::parse(argc, argv, 1,
                          {"--model", "--cluster", "--gpus", "--global-batch", "--threads"}, {},
                          /*command=*/"");
  if (!args)
    return fail(args.takeError());
  auto model = loadModelSpec(args->path("--model").value_or("examples/gpt3-175b.json"));
  if (!model)
    return fail(model.takeError());
  auto cluster = loadClusterSpec(args->path("--cluster").value_or("examples/a100-80g.json"));
  if (!cluster)
    return fail(cluster.takeError());
  auto batch = args->integer("--global-batch", 1536, 1, int64_t(1) << 40);
  if (!batch)
    return fail(batch.takeError());
  auto threads = args->integer("--threads", 0, 0, 256);
  if (!threads)
    return fail(threads.takeError());
  llvm::SmallVector<llvm::StringRef, 8> counts;
  // (The list is kept alive here: the pieces point into it.)
  const std::string list = args->get("--gpus").value_or("64,128,256,512,1024,2048");
  llvm::StringRef(list).split(counts, ',');
  fmt::print("{} on {} ({} per node), global batch {}\n", model->name, cluster->deviceName,
             cluster->gpusPerNode, *batch);
  fmt::print("{:>6} {:>10} {:>8} {:>8} {:>12} {:>9} {:>8}  {}\n", "gpus", "candidates", "wall s",
             "cpu s", "candidates/s", "simulated", "compiled", "best");
  for (llvm::StringRef c : counts) {
    int gpus = 0;
    if (c.trim().getAsInteger(10, gpus) || gpus < 1)
      return fail(inputError("--gpus expects a list such as 64,1024 (got '{}')", c.str()));
    PlannerOptions o;
    o.gpus = gpus;
    o.globalBatch = *batch;
    o.threads = unsigned(*threads);
    double cpu0 = cpuSeconds();
    auto start = std::chrono::steady_clock::now();
    auto result = planLayouts(*model, *cluster, o);
    double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    double cpu = cpuSeconds() - cpu0;
    if (!result)
      return fail(result.takeError());
    size_t simulated = 0, compiled = 0;
    for (const PlanCandidate &x : result->candidates) {
      simulated += x.simulated;
      compiled += x.compiled;
    }
    const PlanCandidate &best = result->candidates[result->ranked.front()];
    fmt::print("{:>6} {:>10} {:>8.2f} {:>8.2f} {:>12.0f} {:>9} {:>8}  {} tp={} pp={} vpp={} "
               "dp={} mb={} m={} K={} recompute {} sp={} zero={} step {:.1f} ms\n",
               gpus, result->candidates.size(), wall, cpu, double(result->candidates.size()) / wall,
               simulated, compiled, best.schedule, best.parallel.tp, best.parallel.pp,
               best.parallel.vpp, best.parallel.dp, best.microbatchSize, best.parallel.microbatches,
               best.parallel.seqSplits, toString(best.recompute).str(),
               best.parallel.sequenceParallel ? "on" : "off",
               best.parallel.distributedOptimizer ? "on" : "off", best.stepTime);
  }
  return 0;
}
