//===- pipec.cpp - The pipeline schedule compiler CLI ---------------------===//
//
// compile, validate, simulate, show, list-schedules, export, import, plan (tools/PlanCommand.cpp)
// and spec (tools/SpecCommand.cpp); their flags, usage and help are tools/Options.cpp's tables.
// Exit codes: 0 ok, 1 a finding (the plan or schedule is wrong), 2 bad usage or input.
//
//===----------------------------------------------------------------------===//
#include "compiler/Pass.h"
#include "compiler/Planner.h"
#include "compiler/TraceJson.h"
#include "compiler/Verifier.h"
#include "ir/Model.h"
#include "ir/PlanText.h"
#include "ir/formats/PlanJson.h"
#include "ir/support/Bytes.h"
#include "ir/support/Error.h"
#include "ir/support/Files.h"
#include "schedules/Policy.h"
#include "tools/Args.h"
#include "tools/Driver.h"
#include "tools/Figure.h"
#include "tools/Options.h"
#include "tools/PlanCommand.h"
#include "tools/SpecCommand.h"

#include <fmt/format.h>

#include <csignal>
#include <cstdio>

using namespace pipec;

static llvm::Error dispatch(llvm::StringRef cmd, int argc, char **argv);

namespace {

/// One line for exit 2, the diagnostic for exit 1.
void printSummary(const Plan &plan, const ClusterSpec *cluster, const ModelSpec *model) {
  const ParallelConfig &pc = plan.parallel;
  fmt::print("plan: {} on {}: pp={} vpp={} tp={}{} dp={} microbatches={} seq-splits={} ({} "
             "placement)\n",
             plan.schedule, plan.model, pc.pp, pc.vpp, pc.tp,
             pc.cp > 1 ? fmt::format(" cp={}", pc.cp) : "", pc.dp, pc.microbatches, pc.seqSplits,
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
  // As published runs report a step: tokens per second, model FLOP/s per GPU and MFU (what
  // pipec plan's columns show).
  if (model && cluster && plan.timeUnit == "ms")
    if (auto th = stepThroughput(*model, plan.parallel, st.stepTime, cluster->peakTflops))
      fmt::print("throughput: {:.0f} tokens/s ({:.0f} per GPU), {:.1f} TFLOP/s per GPU of model "
                 "FLOPs, MFU {:.1f}% of the {}'s {:.0f} TFLOP/s\n",
                 th->tokensPerSecond, th->tokensPerSecondPerGpu, th->tflopsPerGpu, 100 * th->mfu,
                 cluster->deviceName, cluster->peakTflops);
  if (worst)
    fmt::print("peak memory: rank {} with {} (weights, grads and optimizer state {})\n",
               worst->rank, humanBytes(worst->peakMemoryBytes), humanBytes(worst->staticBytes));
  if (worst && cluster && plan.timeUnit == "ms" && worst->peakMemoryBytes > cluster->memoryBytes)
    fmt::print("warning: rank {} needs {} but the cluster's {} has {}; raise --pp or --tp, or "
               "pick a schedule with less memory{}\n",
               worst->rank, humanBytes(worst->peakMemoryBytes), cluster->deviceName,
               humanBytes(cluster->memoryBytes),
               cluster->megatronActivations
                   ? ""
                   : " (counted as piperun keeps activations; for a Megatron-LM or NeMo job add "
                     "\"kept_activations\": \"megatron\" to the cluster spec)");
  fmt::print("instructions: {} ({} compute, {} send/recv, {} collective); verified: "
             "dependencies hold, FIFO-matched, deadlock-free\n",
             compute + p2p + coll, compute, p2p, coll);
}

llvm::Error cmdCompile(int argc, char **argv) {
  auto args = Args::parse(argc, argv, 2, *findPipecCommand("compile"));
  if (!args)
    return args.takeError();
  if (!args->positional().empty())
    return inputError("compile: unexpected argument '{}' (flags are --model, --schedule, --pp, "
                      "--microbatches, ...)",
                      args->positional().front());
  if (auto model = args->required("--model"); !model)
    return model.takeError();
  std::optional<std::string> out = args->path("-o");
  // Every output is checked before the (possibly long) compile: a file, or - for standard
  // output, and never one of the inputs.
  const std::vector<InputFile> inputs = commandInputs(*args, "");
  const bool toStdout = writesStandardOutput(*args, {"-o", "--trace", "--svg"});
  if (toStdout && args->has("--show"))
    return inputError("--show prints the grid to standard output, which {} - fills; write that "
                      "to a file, or drop --show",
                      out && *out == "-"            ? "-o"
                      : args->get("--trace") == "-" ? "--trace"
                                                    : "--svg");
  for (llvm::StringRef flag : {"-o", "--trace", "--svg"})
    if (auto path = args->path(flag))
      if (auto err = checkOutputPath(flag, *path, inputs))
        return err;
  ClusterSpec cluster;
  ModelSpec model;
  auto plan = compileWithFlags(*args, &cluster, &model);
  if (!plan)
    return plan.takeError();
  // Outputs are written only once everything has passed, all or nothing.
  std::vector<OutputFile> outputs;
  if (out)
    outputs.push_back(
        OutputFile{"-o", *out, "", [&](llvm::raw_ostream &os) { writePlanJson(*plan, os); }});
  if (args->has("--trace") || args->has("--svg")) {
    Timeline tl;
    if (auto err = simulateTimeline(*plan, tl))
      return err;
    if (auto t = args->path("--trace"))
      outputs.push_back(OutputFile{"--trace", *t, chromeTrace(*plan, tl)});
    if (auto svg = args->path("--svg"))
      outputs.push_back(OutputFile{"--svg", *svg, scheduleSvg(*plan, tl)});
  }
  if (auto err = writeFilesAtomically(outputs, inputs))
    return err;
  if (toStdout) // the summary would corrupt the file on standard output
    return llvm::Error::success();
  if (!args->has("--quiet")) {
    printSummary(*plan, &cluster, &model);
    printCalibrationNote(*args, *plan, cluster);
  }
  if (args->has("--show"))
    fmt::print("\n{}", formatGrid(*plan));
  if (out && !args->has("--quiet"))
    fmt::print("wrote {}\n", *out);
  if (auto svg = args->get("--svg"); svg && !args->has("--quiet"))
    fmt::print("wrote {}\n", *svg);
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
  auto args = Args::parse(argc, argv, 2, *findPipecCommand("validate"));
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
  auto args = Args::parse(argc, argv, 2, *findPipecCommand("simulate"));
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
  const std::vector<InputFile> inputs = commandInputs(*args, "plan");
  if (auto t = args->path("--trace"))
    if (auto err = checkOutputPath("--trace", *t, inputs))
      return err;
  Timeline tl;
  if (auto err = simulateStep(*plan, &tl))
    return err;
  if (auto t = args->path("--trace")) {
    if (auto err =
            writeFilesAtomically({OutputFile{"--trace", *t, chromeTrace(*plan, tl)}}, inputs))
      return err;
    if (*t == "-") // the summary would corrupt the trace on standard output
      return llvm::Error::success();
  }
  printSummary(*plan, nullptr, nullptr);
  if (auto t = args->get("--trace"))
    fmt::print("wrote {}\n", *t);
  return llvm::Error::success();
}

/// `show --svg`: the figure of a verified plan over its simulated timeline, instead of the grid.
llvm::Error showSvg(const Plan &plan, const std::string &path, const std::string &asGiven,
                    llvm::ArrayRef<InputFile> inputs) {
  if (auto err = verifyPlan(plan))
    return err;
  Timeline tl;
  if (auto err = simulateTimeline(plan, tl))
    return err;
  if (auto err = writeFilesAtomically({OutputFile{"--svg", path, scheduleSvg(plan, tl)}}, inputs))
    return err;
  if (path != "-") // (the figure alone on standard output)
    fmt::print("wrote {}\n", asGiven);
  return llvm::Error::success();
}

llvm::Error cmdShow(int argc, char **argv) {
  auto args = Args::parse(argc, argv, 2, *findPipecCommand("show"));
  if (!args)
    return args.takeError();
  const std::vector<InputFile> inputs = commandInputs(*args, "plan");
  if (auto svg = args->path("--svg"))
    if (auto err = checkOutputPath("--svg", *svg, inputs))
      return err;
  auto plan = loadOnePlan(*args, "show");
  if (!plan)
    return plan.takeError();
  const ParallelConfig &pc = plan->parallel;
  if (!writesStandardOutput(*args, {"--svg"}))
    fmt::print("{} on {}: pp={} vpp={} microbatches={} seq-splits={}\n", plan->schedule,
               plan->model, pc.pp, pc.vpp, pc.microbatches, pc.seqSplits);
  if (auto svg = args->path("--svg"))
    return showSvg(*plan, *svg, *args->get("--svg"), inputs);
  if (args->has("--text"))
    fmt::print("{}", formatStreams(*plan, args->has("--compute-only")));
  else
    fmt::print("{}", formatGrid(*plan, {}, args->has("--compute-only")));
  return llvm::Error::success();
}

llvm::Error cmdListSchedules(int argc, char **argv) {
  auto args = Args::parse(argc, argv, 2, *findPipecCommand("list-schedules"));
  if (!args)
    return args.takeError();
  if (!args->positional().empty())
    return inputError("list-schedules: unexpected argument '{}' (it takes none; usage: pipec "
                      "list-schedules)",
                      args->positional().front());
  for (const SchedulePolicy *p : allPolicies())
    fmt::print("{:<20} {}\n{:<20} constraints: {}\n", p->name().str(), p->summary().str(), "",
               p->constraints().str());
  return llvm::Error::success();
}

} // namespace

int main(int argc, char **argv) {
  // A closed pipe on standard output is a write error (exit 2 with its line), not a signal.
  std::signal(SIGPIPE, SIG_IGN);
  // Past a file size limit (`ulimit -f`, which Slurm passes on to jobs), a write fails with
  // EFBIG, reported as a full disk is (exit 2 with the line), instead of SIGXFSZ killing the
  // process mid-save.
  std::signal(SIGXFSZ, SIG_IGN);
  if (argc < 2) {
    // Asking for nothing shows what there is; a script still sees exit 2 and its one line.
    std::fputs(pipecHelp().c_str(), stdout);
    return reportError("pipec", inputError("expected a command (compile, validate, simulate, "
                                           "show, list-schedules, export, import, plan, spec); "
                                           "usage above"));
  }
  llvm::StringRef cmd = argv[1];
  const bool helpCommand = cmd == "help" && argc == 3; // pipec help COMMAND
  if (helpCommand)
    cmd = argv[2];
  else if (cmd == "-h" || cmd == "--help" || cmd == "help") {
    std::fputs(pipecHelp().c_str(), stdout);
    return finishTool("pipec", llvm::Error::success());
  }
  // --help or -h anywhere after a command: that command's usage, exit 0.
  if (const Command *command = findPipecCommand(cmd)) {
    bool help = helpCommand;
    for (int i = 2; i < argc && !help; ++i)
      help = llvm::StringRef(argv[i]) == "--help" || llvm::StringRef(argv[i]) == "-h";
    if (help) {
      std::fputs(commandHelp(*command).c_str(), stdout);
      return finishTool("pipec", llvm::Error::success());
    }
  }
  return runTool("pipec", [&] { return dispatch(cmd, argc, argv); });
}

static llvm::Error dispatch(llvm::StringRef cmd, int argc, char **argv) {
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
  else if (cmd == "plan") {
    keepFreedMemoryForPlanning(); // this process only plans (compiler/Planner.h)
    err = runPlanCommand(argc, argv);
  } else if (cmd == "spec")
    err = runSpecCommand(argc, argv);
  else
    err = inputError("unknown command '{}' (commands: compile, validate, simulate, show, "
                     "list-schedules, export, import, plan, spec)",
                     cmd.str());
  return err;
}
