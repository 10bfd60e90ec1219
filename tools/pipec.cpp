//===- pipec.cpp - The pipeline schedule compiler CLI ---------------------===//
//
//   pipec compile --model M.json --schedule NAME --pp P --microbatches N [...] [-o plan.json]
//   pipec validate plan.json
//   pipec simulate plan.json [--trace trace.json]
//   pipec show plan.json [--compute-only] [--text]
//   pipec list-schedules
//   pipec export plan.json --format torch-csv|torch-csv-comms [-o sched.csv]
//   pipec import sched.csv|sched.txt --model M.json [--vpp V] [...] [-o plan.json]
// Exit codes: 0 ok, 1 a finding (the plan or schedule is wrong), 2 bad usage or input.
//
//===----------------------------------------------------------------------===//
#include "compiler/Pass.h"
#include "compiler/Simulator.h"
#include "compiler/Verifier.h"
#include "ir/Error.h"
#include "ir/Model.h"
#include "ir/PlanJson.h"
#include "ir/PlanText.h"
#include "schedules/Policy.h"
#include "tools/Args.h"
#include "tools/Driver.h"

#include <fmt/format.h>

#include <cstdio>

using namespace pipec;

namespace {

const char *kUsage =
    R"(usage: pipec <command> [flags]

commands:
  compile --model M.json --schedule NAME --pp P --microbatches N
          [--vpp V] [--seq-splits K] [--tp T] [--dp D] [--cluster C.json]
          [--memory-limit BYTES] [--microbatch-group-size G] [-o plan.json]
          [--show] [--trace trace.json]
                      compile, verify and simulate a plan; print its summary
  validate plan.json  re-check a plan from disk (exit 1 with a diagnostic if wrong)
  simulate plan.json [--trace trace.json]
                      timed simulation; optional Chrome/Perfetto trace
  show plan.json [--compute-only] [--text]
                      the rank x step grid (or, with --text, one line per rank)
  list-schedules      the schedules, their constraints and a line on each
  export plan.json --format torch-csv|torch-csv-comms [-o sched.csv]
                      the plan as PyTorch pipelining's schedule CSV (compute only, or with
                      its sends, recvs, waits and gradient reductions)
  import sched.csv|sched.txt --model M.json [--vpp V] [--tp T] [--dp D]
          [--cluster C.json] [--memory-limit BYTES] [--microbatch-group-size G]
          [--schedule NAME] [-o plan.json] [--show] [--trace trace.json]
                      a PyTorch schedule CSV or pipec's text form, compiled, verified and
                      simulated as pipec's own (pp, microbatches, placement inferred)

exit codes: 0 ok, 1 the plan or schedule is wrong, 2 bad usage or input
)";

std::string humanBytes(int64_t b) {
  const char *units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = double(b);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  return u == 0 ? fmt::format("{} B", b) : fmt::format("{:.2f} {}", v, units[u]);
}

/// One line for exit 2, the diagnostic for exit 1.
void printSummary(const Plan &plan, const ClusterSpec *cluster) {
  const ParallelConfig &pc = plan.parallel;
  fmt::print("plan: {} on {}: pp={} vpp={} tp={} dp={} microbatches={} seq-splits={} ({} "
             "placement)\n",
             plan.schedule, plan.model, pc.pp, pc.vpp, pc.tp, pc.dp, pc.microbatches, pc.seqSplits,
             toString(plan.placement).str());
  std::string stages;
  for (const StageInfo &s : plan.stages) {
    std::string one = fmt::format("{}:[{},{})@r{}", s.stage, s.layerBegin, s.layerEnd, s.rank);
    stages += (stages.empty() ? "" : " ") + one;
  }
  if (plan.stages.size() <= 16)
    fmt::print("stages (layers, rank): {}\n", stages);
  size_t compute = 0, p2p = 0, coll = 0;
  for (const auto &r : plan.ranks)
    for (const Instruction &i : r) {
      if (i.isCompute())
        ++compute;
      else if (i.isP2P())
        ++p2p;
      else
        ++coll;
    }
  const PlanStats &st = plan.stats;
  double maxSpan = 0;
  for (const RankStats &r : st.ranks)
    maxSpan = std::max(maxSpan, r.span);
  fmt::print("\n{:>5} {:>12} {:>12} {:>8} {:>14} {:>14}\n", "rank", "busy", "span", "bubble",
             "peak act", "peak memory");
  for (const RankStats &r : st.ranks)
    fmt::print("{:>5} {:>12.4f} {:>12.4f} {:>8.4f} {:>14} {:>14}\n", r.rank, r.busy, r.span,
               maxSpan > 0 ? 1.0 - r.busy / maxSpan : 0.0, humanBytes(r.peakActivationBytes),
               humanBytes(r.peakMemoryBytes));
  const RankStats *worst = nullptr;
  for (const RankStats &r : st.ranks)
    if (!worst || r.peakMemoryBytes > worst->peakMemoryBytes)
      worst = &r;
  fmt::print("\nmakespan {:.4f} {}, bubble ratio {:.4f}, step time {:.4f} {}\n", st.makespan,
             plan.timeUnit, st.bubbleRatio, st.stepTime, plan.timeUnit);
  if (worst)
    fmt::print("peak memory: rank {} with {} (weights, grads and optimizer state {})\n",
               worst->rank, humanBytes(worst->peakMemoryBytes), humanBytes(worst->staticBytes));
  if (worst && cluster && plan.timeUnit == "ms" && worst->peakMemoryBytes > cluster->memoryBytes)
    fmt::print("warning: rank {} needs {} but a {} has {}; raise --pp or --tp, or pick a "
               "schedule with less memory\n",
               worst->rank, humanBytes(worst->peakMemoryBytes), cluster->deviceName,
               humanBytes(cluster->memoryBytes));
  fmt::print("instructions: {} ({} compute, {} send/recv, {} collective); verified: "
             "dependencies hold, FIFO-matched, deadlock-free\n",
             compute + p2p + coll, compute, p2p, coll);
}

llvm::Error cmdCompile(int argc, char **argv) {
  auto args = Args::parse(argc, argv, 2,
                          {"--model", "--schedule", "--pp", "--vpp", "--microbatches",
                           "--seq-splits", "--tp", "--dp", "--cluster", "--memory-limit",
                           "--microbatch-group-size", "-o", "--output", "--trace"},
                          {"--show", "--quiet"}, "compile");
  if (!args)
    return args.takeError();
  if (!args->positional().empty())
    return inputError("compile: unexpected argument '{}' (flags are --model, --schedule, --pp, "
                      "--microbatches, ...)",
                      args->positional().front());
  auto modelPath = args->required("--model");
  if (!modelPath)
    return modelPath.takeError();
  auto schedule = args->required("--schedule");
  if (!schedule)
    return schedule.takeError();
  if (auto p = findPolicy(*schedule); !p)
    return p.takeError();
  if (!args->has("--pp"))
    return inputError("missing --pp (pipeline ranks, required); try --pp 4");
  if (!args->has("--microbatches"))
    return inputError("missing --microbatches (required); try --microbatches 8");
  CompileOptions o;
  o.schedule = *schedule;
  struct IntFlag {
    const char *name;
    int *out;
    int fallback, min;
  } ints[] = {{"--pp", &o.parallel.pp, 1, 1},
              {"--vpp", &o.parallel.vpp, 1, 1},
              {"--microbatches", &o.parallel.microbatches, 1, 1},
              {"--seq-splits", &o.parallel.seqSplits, 1, 1},
              {"--tp", &o.parallel.tp, 1, 1},
              {"--dp", &o.parallel.dp, 1, 1},
              {"--microbatch-group-size", &o.parallel.microbatchGroupSize, 0, 1}};
  for (const IntFlag &f : ints) {
    auto v = args->integer(f.name, f.fallback, f.min, 1 << 24);
    if (!v)
      return v.takeError();
    *f.out = int(*v);
  }
  auto limit = args->bytes("--memory-limit");
  if (!limit)
    return limit.takeError();
  o.memoryLimit = *limit;
  std::optional<std::string> out = args->path("-o");
  if (!out)
    out = args->path("--output");
  auto model = loadModelSpec(*args->path("--model"));
  if (!model)
    return inputError("--model: {}", takeMessage(model.takeError()));
  ClusterSpec cluster = ClusterSpec::defaults();
  if (auto c = args->path("--cluster")) {
    auto loaded = loadClusterSpec(*c);
    if (!loaded)
      return inputError("--cluster: {}", takeMessage(loaded.takeError()));
    cluster = *loaded;
  }
#ifndef NDEBUG
  constexpr bool verifyEachPass = true; // debug builds check the invariants after every pass
#else
  constexpr bool verifyEachPass = false;
#endif
  auto plan = compilePlan(*model, cluster, o, verifyEachPass);
  if (!plan)
    return plan.takeError();
  if (o.memoryLimit > 0) {
    for (const RankStats &r : plan->stats.ranks)
      if (r.peakActivationBytes > o.memoryLimit)
        return finding("rank {} holds {} of activations at its peak, over --memory-limit {}; "
                       "raise --pp, lower --microbatches for gpipe, or use a schedule that "
                       "bounds memory (1f1b holds min(p, m) microbatches)",
                       r.rank, humanBytes(r.peakActivationBytes), humanBytes(o.memoryLimit));
  }
  // Outputs are written only once everything has passed, all or nothing.
  std::vector<OutputFile> outputs;
  if (out)
    outputs.push_back(OutputFile{"-o", *out, writePlanJson(*plan)});
  if (auto t = args->path("--trace")) {
    Timeline tl;
    if (auto err = simulateTimeline(*plan, tl))
      return err;
    outputs.push_back(OutputFile{"--trace", *t, chromeTrace(*plan, tl)});
  }
  if (auto err = writeFilesAtomically(outputs))
    return err;
  if (!args->has("--quiet"))
    printSummary(*plan, &cluster);
  if (args->has("--show"))
    fmt::print("\n{}", formatGrid(*plan));
  if (out && !args->has("--quiet"))
    fmt::print("wrote {}\n", *out);
  return llvm::Error::success();
}

llvm::Expected<Plan> loadOnePlan(const Args &args, llvm::StringRef command) {
  if (args.positional().size() != 1)
    return inputError("{}: expected one plan file (got {}); usage: pipec {} plan.json",
                      command.str(), args.positional().size(), command.str());
  std::string path = userPath(args.positional().front());
  return loadPlan(path);
}

llvm::Error cmdValidate(int argc, char **argv) {
  auto args = Args::parse(argc, argv, 2, {}, {}, "validate");
  if (!args)
    return args.takeError();
  auto plan = loadOnePlan(*args, "validate");
  if (!plan)
    return plan.takeError();
  if (auto err = verifyPlan(*plan))
    return err;
  fmt::print("{}: ok: {} instructions on {} ranks; dependencies hold, FIFO-matched, "
             "deadlock-free\n",
             args->positional().front(), plan->numInstructions(), plan->numRanks());
  return llvm::Error::success();
}

llvm::Error cmdSimulate(int argc, char **argv) {
  auto args = Args::parse(argc, argv, 2, {"--trace"}, {}, "simulate");
  if (!args)
    return args.takeError();
  auto plan = loadOnePlan(*args, "simulate");
  if (!plan)
    return plan.takeError();
  if (auto err = verifyPlan(*plan))
    return err;
  PassContext ctx;
  ctx.commsLowered = ctx.collectivesLowered = ctx.scheduled = true;
  if (auto err = runPipeline({"memory"}, *plan, ctx))
    return err;
  Timeline tl;
  if (auto err = simulateTimeline(*plan, tl))
    return err;
  summarizeTimeline(*plan, tl, plan->stats);
  if (auto t = args->path("--trace"))
    if (auto err = writeFileAtomically(*t, chromeTrace(*plan, tl)))
      return inputError("--trace: {}", takeMessage(std::move(err)));
  printSummary(*plan, nullptr);
  if (auto t = args->get("--trace"))
    fmt::print("wrote {}\n", *t);
  return llvm::Error::success();
}

llvm::Error cmdShow(int argc, char **argv) {
  auto args = Args::parse(argc, argv, 2, {}, {"--compute-only", "--text"}, "show");
  if (!args)
    return args.takeError();
  auto plan = loadOnePlan(*args, "show");
  if (!plan)
    return plan.takeError();
  const ParallelConfig &pc = plan->parallel;
  fmt::print("{} on {}: pp={} vpp={} microbatches={} seq-splits={}\n", plan->schedule, plan->model,
             pc.pp, pc.vpp, pc.microbatches, pc.seqSplits);
  if (args->has("--text"))
    fmt::print("{}", formatStreams(*plan, args->has("--compute-only")));
  else
    fmt::print("{}", formatGrid(*plan, {}, args->has("--compute-only")));
  return llvm::Error::success();
}

llvm::Error cmdListSchedules(int argc, char **argv) {
  auto args = Args::parse(argc, argv, 2, {}, {}, "list-schedules");
  if (!args)
    return args.takeError();
  for (const SchedulePolicy *p : allPolicies())
    fmt::print("{:<20} {}\n{:<20} constraints: {}\n", p->name().str(), p->summary().str(), "",
               p->constraints().str());
  return llvm::Error::success();
}

} // namespace

int main(int argc, char **argv) {
  if (argc < 2) {
    fmt::print(stderr, "{}", kUsage);
    return 2;
  }
  llvm::StringRef cmd = argv[1];
  if (cmd == "-h" || cmd == "--help" || cmd == "help") {
    fmt::print("{}", kUsage);
    return 0;
  }
  llvm::Error err = llvm::Error::success();
  if (cmd == "compile")
    err = cmdCompile(argc, argv);
  else if (cmd == "validate")
    err = cmdValidate(argc, argv);
  else if (cmd == "simulate")
    err = cmdSimulate(argc, argv);
  else if (cmd == "show")
    err = cmdShow(argc, argv);
  else if (cmd == "list-schedules")
    err = cmdListSchedules(argc, argv);
  else if (cmd == "export")
    err = cmdExport(argc, argv);
  else if (cmd == "import")
    err = cmdImport(argc, argv, printSummary);
  else
    err = inputError("unknown command '{}' (commands: compile, validate, simulate, show, "
                     "list-schedules, export, import)",
                     cmd.str());
  if (err)
    return reportError("pipec", std::move(err));
  return 0;
}
