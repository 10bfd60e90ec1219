#include "tools/Driver.h"

#include "compiler/Simulator.h"
#include "compiler/Verifier.h"
#include "ir/Error.h"
#include "ir/PlanJson.h"
#include "ir/PlanText.h"
#include "ir/TorchCsv.h"
#include "schedules/Policy.h"

#include "llvm/ADT/StringExtras.h"

#include <fmt/format.h>

#include <cstdio>

namespace pipec {

llvm::ArrayRef<llvm::StringRef> compileFlags() {
  static const llvm::StringRef flags[] = {"--model",
                                          "--model-json",
                                          "--schedule",
                                          "--pp",
                                          "--vpp",
                                          "--microbatches",
                                          "--seq-splits",
                                          "--tp",
                                          "--dp",
                                          "--cluster",
                                          "--cluster-json",
                                          "--memory-limit",
                                          "--microbatch-group-size",
                                          "--costs"};
  return flags;
}

llvm::ArrayRef<llvm::StringRef> importFlags() {
  static const llvm::StringRef flags[] = {
      "--model",        "--model-json",   "--vpp",
      "--tp",           "--dp",           "--cluster",
      "--cluster-json", "--memory-limit", "--microbatch-group-size",
      "--schedule",     "--costs"};
  return flags;
}

std::vector<InputFile> commandInputs(const Args &args, llvm::StringRef positionalName) {
  std::vector<InputFile> inputs;
  for (const std::string &p : args.positional())
    inputs.push_back({positionalName.str(), userPath(p)});
  for (llvm::StringRef flag : {"--model", "--cluster", "--costs"})
    if (auto path = args.path(flag))
      inputs.push_back({flag.str(), *path});
  return inputs;
}

llvm::Expected<ModelSpec> modelFromFlags(const Args &args) {
  if (auto text = args.get("--model-json")) {
    return parseModelSpec(*text, "model"); // errors start "model: $.field: ..."
  }
  if (!args.has("--model"))
    return inputError("missing --model (a pipemodel/1 JSON file, required); try --model "
                      "examples/uniform-8.json");
  auto model = loadModelSpec(*args.path("--model"));
  if (!model)
    return inputError("--model: {}", takeMessage(model.takeError()));
  return model;
}

llvm::Expected<ClusterSpec> clusterFromFlags(const Args &args) {
  if (auto text = args.get("--cluster-json")) {
    return parseClusterSpec(*text, "cluster");
  }
  if (auto path = args.path("--cluster")) {
    auto cluster = loadClusterSpec(*path);
    if (!cluster)
      return inputError("--cluster: {}", takeMessage(cluster.takeError()));
    return cluster;
  }
  return ClusterSpec::defaults();
}

#ifndef NDEBUG
static constexpr bool kVerifyEachPass = true; // debug builds check invariants after every pass
#else
static constexpr bool kVerifyEachPass = false;
#endif

/// --costs FILE (ir/Costs.h), read and checked; null without the flag.
static llvm::Error costsFromFlags(const Args &args, std::shared_ptr<const MeasuredCosts> &costs,
                                  std::string &source) {
  auto path = args.path("--costs");
  if (!path)
    return llvm::Error::success();
  auto read = readCosts(*path);
  if (!read)
    return inputError("--costs: {}", takeMessage(read.takeError()));
  costs = std::make_shared<const MeasuredCosts>(std::move(*read));
  source = "--costs " + *path;
  return llvm::Error::success();
}

llvm::Expected<CompileOptions> compileOptionsFromFlags(const Args &args) {
  auto schedule = args.required("--schedule");
  if (!schedule)
    return schedule.takeError();
  if (auto p = findPolicy(*schedule); !p)
    return p.takeError();
  if (!args.has("--pp"))
    return inputError("missing --pp (pipeline ranks, required); try --pp 4");
  if (!args.has("--microbatches"))
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
    auto v = args.integer(f.name, f.fallback, f.min, 1 << 24);
    if (!v)
      return v.takeError();
    *f.out = int(*v);
  }
  auto limit = args.bytes("--memory-limit");
  if (!limit)
    return limit.takeError();
  o.memoryLimit = *limit;
  o.parallel.sequenceParallel = args.has("--sequence-parallel");
  if (auto by = args.get("--seq-split-by")) {
    if (*by != "time" && *by != "flops")
      return inputError("--seq-split-by: expected time or flops, got '{}'; try --seq-split-by "
                        "flops (the Seq1F1B paper's rule)",
                        *by);
    o.parallel.seqSplitByFlops = *by == "flops";
  }
  o.parallel.distributedOptimizer = args.has("--distributed-optimizer");
  if (auto err = costsFromFlags(args, o.costs, o.costsSource))
    return err;
  return o;
}

llvm::Expected<Plan> compileWithFlags(const Args &args, ClusterSpec *clusterOut) {
  auto o = compileOptionsFromFlags(args);
  if (!o)
    return o.takeError();
  auto model = modelFromFlags(args);
  if (!model)
    return model.takeError();
  auto cluster = clusterFromFlags(args);
  if (!cluster)
    return cluster.takeError();
  auto plan = compilePlan(*model, *cluster, *o, kVerifyEachPass);
  if (!plan)
    return plan.takeError();
  if (auto err = checkMemoryLimit(*plan, o->memoryLimit))
    return err;
  if (clusterOut)
    *clusterOut = *cluster;
  return plan;
}

llvm::Expected<ImportResult> importWithFlags(const Args &args, llvm::StringRef text,
                                             llvm::StringRef source, ClusterSpec *clusterOut,
                                             ImportedOrder *orderOut) {
  ImportOptions o;
  struct IntFlag {
    const char *name;
    int *out;
    int fallback, min;
  } ints[] = {{"--vpp", &o.vpp, 0, 1},
              {"--tp", &o.tp, 1, 1},
              {"--dp", &o.dp, 1, 1},
              {"--microbatch-group-size", &o.microbatchGroupSize, 0, 1}};
  for (const IntFlag &f : ints) {
    auto v = args.integer(f.name, f.fallback, f.min, 1 << 24);
    if (!v)
      return v.takeError();
    *f.out = int(*v);
  }
  auto limit = args.bytes("--memory-limit");
  if (!limit)
    return limit.takeError();
  o.memoryLimit = *limit;
  o.schedule = args.get("--schedule").value_or("");
  if (auto err = costsFromFlags(args, o.costs, o.costsSource))
    return err;
  auto model = modelFromFlags(args);
  if (!model)
    return model.takeError();
  auto cluster = clusterFromFlags(args);
  if (!cluster)
    return cluster.takeError();
  auto order = parseSchedule(text, source);
  if (!order)
    return order.takeError();
  auto result = compileImported(*model, *cluster, *order, o, source, kVerifyEachPass);
  if (!result)
    return result.takeError();
  if (clusterOut)
    *clusterOut = *cluster;
  if (orderOut)
    *orderOut = std::move(*order);
  return result;
}

std::string importReport(const ImportedOrder &order, const ImportResult &result,
                         llvm::StringRef source) {
  const Plan &plan = result.plan;
  llvm::SmallVector<std::string, 3> notes;
  if (order.droppedComms > 0)
    notes.push_back(fmt::format("{} communication, wait, reduction and FSDP actions dropped; "
                                "pipec derives its own",
                                order.droppedComms));
  if (order.overlappedPairs > 0)
    notes.push_back(fmt::format("{} overlapped pairs split into their F and B, in order",
                                order.overlappedPairs));
  if (order.idleCells > 0)
    notes.push_back(fmt::format("{} idle cells skipped", order.idleCells));
  std::string what = describe(order.source).str();
  if (!notes.empty())
    what += "; " + llvm::join(notes.begin(), notes.end(), "; ");
  std::string name;
  if (result.matches.empty()) {
    name = fmt::format("the order is none of pipec's schedules (named {})", kCustomSchedule);
  } else {
    name = fmt::format("the order is pipec's {}", result.matches.front());
    if (result.matches.size() > 1)
      name += fmt::format(" (also {}'s)",
                          llvm::join(result.matches.begin() + 1, result.matches.end(), "'s, "));
  }
  return fmt::format("imported {} ({}): pp={} vpp={} microbatches={} seq-splits={} inferred, {} "
                     "placement; {}\n",
                     source.str(), what, plan.parallel.pp, plan.parallel.vpp,
                     plan.parallel.microbatches, plan.parallel.seqSplits,
                     toString(plan.placement).str(), name);
}

llvm::Error cmdExport(int argc, char **argv) {
  auto args = Args::parse(argc, argv, 2, {"--format", "-o", "--output"}, {}, "export");
  if (!args)
    return args.takeError();
  if (args->positional().size() != 1)
    return inputError("export: expected one plan file (got {}); usage: pipec export plan.json "
                      "--format torch-csv|torch-csv-comms [-o sched.csv]",
                      args->positional().size());
  auto formatName = args->get("--format");
  if (!formatName)
    return inputError("missing --format (torch-csv: compute only, torch-csv-comms: with "
                      "communication); try --format torch-csv");
  TorchCsvForm form;
  if (!torchCsvFormFromString(*formatName, form))
    return inputError("--format: unknown format '{}' (known: torch-csv, torch-csv-comms); try "
                      "--format torch-csv",
                      *formatName);
  std::optional<std::string> out = args->path("-o");
  if (!out)
    out = args->path("--output");
  const std::vector<InputFile> inputs = commandInputs(*args, "plan");
  if (out)
    if (auto err = checkOutputPath("-o", *out, inputs))
      return err;
  auto plan = loadPlan(userPath(args->positional().front()));
  if (!plan)
    return plan.takeError();
  if (auto err = verifyPlan(*plan))
    return err;
  auto csv = writeTorchCsv(*plan, form);
  if (!csv)
    return csv.takeError();
  if (!out) {
    fmt::print("{}", *csv);
    return llvm::Error::success();
  }
  if (auto err = writeFilesAtomically({OutputFile{"-o", *out, *csv}}, inputs))
    return err;
  fmt::print("wrote {} ({}: {} rows, one per rank)\n", *out, toString(form).str(),
             plan->numRanks());
  return llvm::Error::success();
}

llvm::Error cmdImport(int argc, char **argv, SummaryPrinter printSummary) {
  llvm::SmallVector<llvm::StringRef, 16> valued(importFlags().begin(), importFlags().end());
  valued.append({"-o", "--output", "--trace"});
  llvm::erase_value(valued, "--model-json");
  llvm::erase_value(valued, "--cluster-json");
  auto args = Args::parse(argc, argv, 2, valued, {"--show", "--quiet"}, "import");
  if (!args)
    return args.takeError();
  if (args->positional().size() != 1)
    return inputError("import: expected one schedule file (got {}); usage: pipec import "
                      "sched.csv|sched.txt --model M.json [--vpp V] [-o plan.json]",
                      args->positional().size());
  std::string source = args->positional().front();
  // Every output is checked before anything is read or compiled.
  const std::vector<InputFile> inputs = commandInputs(*args, "schedule");
  for (llvm::StringRef flag : {"-o", "--output", "--trace"})
    if (auto path = args->path(flag))
      if (auto err = checkOutputPath(flag == "--output" ? "-o" : flag, *path, inputs))
        return err;
  auto text = readFile(userPath(source));
  if (!text)
    return text.takeError();
  ClusterSpec cluster;
  ImportedOrder order;
  auto result = importWithFlags(*args, *text, source, &cluster, &order);
  if (!result)
    return result.takeError();
  const Plan &plan = result->plan;
  std::optional<std::string> out = args->path("-o");
  if (!out)
    out = args->path("--output");
  std::vector<OutputFile> outputs;
  if (out)
    outputs.push_back(OutputFile{"-o", *out, writePlanJson(plan)});
  if (auto t = args->path("--trace")) {
    Timeline tl;
    if (auto err = simulateTimeline(plan, tl))
      return err;
    outputs.push_back(OutputFile{"--trace", *t, chromeTrace(plan, tl)});
  }
  if (auto err = writeFilesAtomically(outputs, inputs))
    return err;
  if (!args->has("--quiet")) {
    fmt::print("{}", importReport(order, *result, source));
    printSummary(plan, &cluster);
  }
  if (args->has("--show"))
    fmt::print("\n{}", formatGrid(plan));
  if (out && !args->has("--quiet"))
    fmt::print("wrote {}\n", *out);
  return llvm::Error::success();
}

} // namespace pipec
