//===- plan_io_bench.cpp - Writing and reading plan JSON against compiling ----===//
//
// One step per process, so that the peak resident memory belongs to it:
//   plan_io_bench --step compile --pp 64 --microbatches 1024          compile only
//   plan_io_bench --step write --pp 64 --microbatches 1024 --out F    compile, then write F
//   plan_io_bench --step read --out F                                 read F, then verify it
// (1f1b, one unit layer per stage, as compile_bench.) Each prints the step's own time (the
// compile before a write is timed apart) and the process's peak RSS. Not a test: the numbers
// go into docs/benchmarks.md.
//
//===----------------------------------------------------------------------===//
#include "bench/UniformPlan.h"
#include "compiler/Pass.h"
#include "compiler/Verifier.h"
#include "ir/formats/PlanJson.h"
#include "ir/support/Error.h"
#include "ir/support/Files.h"
#include "tools/Args.h"

#include <fmt/format.h>

#include <chrono>
#include <sys/resource.h>

using namespace pipec;

namespace {

double since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

double peakRssMiB() {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return double(ru.ru_maxrss) / 1024.0;
}

int fail(llvm::Error err) {
  fmt::print(stderr, "plan_io_bench: {}\n", takeMessage(std::move(err)));
  return 2;
}

} // namespace

int main(int argc, char **argv) {
  auto args = Args::parse(argc, argv, 1, {"--step", "--pp", "--microbatches", "--out"}, {},
                          /*command=*/"");
  if (!args)
    return fail(args.takeError());
  std::string step = args->get("--step").value_or("compile");
  std::string out = args->get("--out").value_or("/tmp/plan_io_bench.json");
  auto pp = args->integer("--pp", 64, 1, 4096);
  if (!pp)
    return fail(pp.takeError());
  auto m = args->integer("--microbatches", 1024, 1, 1 << 20);
  if (!m)
    return fail(m.takeError());
  if (step == "read") {
    auto start = std::chrono::steady_clock::now();
    auto plan = loadPlan(out);
    if (!plan)
      return fail(plan.takeError());
    double read = since(start);
    start = std::chrono::steady_clock::now();
    if (auto err = verifyPlan(*plan))
      return fail(std::move(err));
    fmt::print("step=read instructions={} read={:.3f}s verify={:.3f}s peak_rss={:.1f}MiB\n",
               plan->numInstructions(), read, since(start), peakRssMiB());
    return 0;
  }
  ModelSpec model = bench::uniformModel(int(*pp), bench::kCompileBenchSizes);
  CompileOptions o;
  o.schedule = "1f1b";
  o.parallel.pp = int(*pp);
  o.parallel.microbatches = int(*m);
  auto start = std::chrono::steady_clock::now();
  auto plan = compilePlan(model, ClusterSpec::defaults(), o);
  if (!plan)
    return fail(plan.takeError());
  double compile = since(start);
  if (step == "compile") {
    fmt::print("step=compile instructions={} compile={:.3f}s peak_rss={:.1f}MiB\n",
               plan->numInstructions(), compile, peakRssMiB());
    return 0;
  }
  start = std::chrono::steady_clock::now();
  OutputFile file{"--out", out, "", [&](llvm::raw_ostream &os) { writePlanJson(*plan, os); }};
  if (auto err = writeFilesAtomically(file, {}))
    return fail(std::move(err));
  fmt::print("step=write instructions={} compile={:.3f}s write={:.3f}s peak_rss={:.1f}MiB\n",
             plan->numInstructions(), compile, since(start), peakRssMiB());
  return 0;
}
