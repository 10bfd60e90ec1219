#include "tools/Driver.h"

#include "compiler/Planner.h"
#include "compiler/TraceJson.h"
#include "compiler/Verifier.h"
#include "compiler/torch/TorchCsv.h"
#include "ir/PlanText.h"
#include "ir/formats/PlanJson.h"
#include "ir/formats/SpecJson.h"
#include "ir/support/Error.h"
#include "ir/support/Files.h"
#include "schedules/Policy.h"

#include "llvm/ADT/StringExtras.h"

#include <fmt/format.h>

#include <cstdio>
#include <functional>
#include <initializer_list>
#include <tuple>

namespace pipec {

std::vector<InputFile> commandInputs(const Args &args, llvm::StringRef positionalName) {
  std::vector<InputFile> inputs;
  for (const std::string &p : args.positional())
    inputs.push_back({positionalName.str(), userPath(p)});
  for (llvm::StringRef flag : {"--model", "--cluster", "--costs"})
    if (auto path = args.path(flag))
      inputs.push_back({flag.str(), *path});
  return inputs;
}

bool writesStandardOutput(const Args &args, std::initializer_list<llvm::StringRef> flags) {
  for (llvm::StringRef flag : flags)
    if (args.get(flag) == "-")
      return true;
  return false;
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

/// --model and --cluster (or their JSON twins), read in that order.
static llvm::Error specsFromFlags(const Args &args, ModelSpec &model, ClusterSpec &cluster) {
  auto m = modelFromFlags(args);
  if (!m)
    return m.takeError();
  auto c = clusterFromFlags(args);
  if (!c)
    return c.takeError();
  model = std::move(*m);
  cluster = std::move(*c);
  return llvm::Error::success();
}

#ifndef NDEBUG
static constexpr bool kVerifyEachPass = true; // debug builds check invariants after every pass
#else
static constexpr bool kVerifyEachPass = false;
#endif

/// --costs FILE (ir/formats/Costs.h), read and checked; null without the flag.
static llvm::Error costsFromFlags(const Args &args, std::shared_ptr<const MeasuredCosts> &costs,
                                  std::string &source) {
  auto path = args.path("--costs");
  if (!path)
    return llvm::Error::success();
  auto read = readCosts(*path);
  if (!read)
    return inputError("--costs: {}", takeMessage(read.takeError()));
  costs = std::make_shared<const MeasuredCosts>(std::move(*read));
  source = "--costs " + shellWord(*path);
  return llvm::Error::success();
}

/// An integer flag and the field it sets.
struct IntFlag {
  const char *name;
  int *out;
};

/// The integer flags into their fields, then --memory-limit.
static llvm::Error intsAndLimitFromFlags(const Args &args, std::initializer_list<IntFlag> ints,
                                         int64_t &memoryLimit) {
  for (const IntFlag &f : ints) {
    auto v = args.integer(f.name);
    if (!v)
      return v.takeError();
    *f.out = int(*v);
  }
  auto limit = args.bytes("--memory-limit");
  if (!limit)
    return limit.takeError();
  memoryLimit = *limit;
  return llvm::Error::success();
}

llvm::Expected<CompileOptions> compileOptionsFromFlags(const Args &args) {
  auto schedule = args.required("--schedule");
  if (!schedule)
    return schedule.takeError();
  if (!args.has("--pp"))
    return inputError("missing --pp (pipeline ranks, required); try --pp 4");
  if (!args.has("--microbatches"))
    return inputError("missing --microbatches (required); try --microbatches 8");
  CompileOptions o;
  o.schedule = *schedule;
  if (auto err =
          intsAndLimitFromFlags(args,
                                {{"--pp", &o.parallel.pp},
                                 {"--vpp", &o.parallel.vpp},
                                 {"--microbatches", &o.parallel.microbatches},
                                 {"--seq-splits", &o.parallel.seqSplits},
                                 {"--tp", &o.parallel.tp},
                                 {"--dp", &o.parallel.dp},
                                 {"--cp", &o.parallel.cp},
                                 {"--microbatch-group-size", &o.parallel.microbatchGroupSize}},
                                o.memoryLimit))
    return err;
  o.parallel.sequenceParallel = args.has("--sequence-parallel");
  auto by = args.choice("--seq-split-by");
  if (!by)
    return by.takeError();
  o.parallel.seqSplitByFlops = *by == "flops";
  auto partition = args.choice("--partition");
  if (!partition)
    return partition.takeError();
  o.evenPartition = *partition == "even";
  o.parallel.distributedOptimizer = args.has("--distributed-optimizer");
  if (auto err = costsFromFlags(args, o.costs, o.costsSource))
    return err;
  return o;
}

/// --microbatch-size (compile, import): the transformer spec's microbatch_size overridden, as
/// --recompute overrides its recompute; an abstract model's costs are per microbatch already.
static llvm::Error microbatchSizeFromFlags(const Args &args, ModelSpec &model) {
  if (!args.has("--microbatch-size"))
    return llvm::Error::success();
  auto size = args.integer("--microbatch-size");
  if (!size)
    return size.takeError();
  if (!model.transformer)
    return inputError("--microbatch-size: the model is an abstract layer list with given costs; "
                      "the microbatch size applies to a \"transformer\" model (its costs are per "
                      "microbatch already)");
  model.transformer->microbatchSize = *size;
  return llvm::Error::success();
}

llvm::Expected<Plan> compileWithFlags(const Args &args, ClusterSpec *clusterOut,
                                      ModelSpec *modelOut) {
  auto o = compileOptionsFromFlags(args);
  if (!o)
    return o.takeError();
  ModelSpec model;
  ClusterSpec cluster;
  if (auto err = specsFromFlags(args, model, cluster))
    return err;
  auto recompute = args.choice("--recompute");
  if (!recompute)
    return recompute.takeError();
  if (*recompute) {
    // (`none` is what an abstract model runs anyway, as `pipec plan` takes it, so the compile
    // line it prints for one works.)
    if (!model.transformer && **recompute != "none")
      return inputError("--recompute: the model is an abstract layer list with given costs; "
                        "recomputation applies to a \"transformer\" model");
    if (model.transformer)
      recomputeFromString(**recompute, model.transformer->recompute);
  }
  if (auto err = microbatchSizeFromFlags(args, model))
    return err;
  auto plan = compilePlan(model, cluster, *o, kVerifyEachPass);
  if (!plan)
    return plan.takeError();
  if (auto err = checkMemoryLimit(*plan, o->memoryLimit))
    return err;
  if (clusterOut)
    *clusterOut = cluster;
  if (modelOut)
    *modelOut = std::move(model);
  return plan;
}

llvm::Expected<ImportResult> importWithFlags(const Args &args, llvm::StringRef text,
                                             llvm::StringRef source, ClusterSpec *clusterOut,
                                             ImportedOrder *orderOut, ModelSpec *modelOut) {
  ImportOptions o;
  if (auto err = intsAndLimitFromFlags(args,
                                       {{"--vpp", &o.vpp},
                                        {"--tp", &o.tp},
                                        {"--dp", &o.dp},
                                        {"--cp", &o.cp},
                                        {"--microbatch-group-size", &o.microbatchGroupSize}},
                                       o.memoryLimit))
    return err;
  o.schedule = args.get("--schedule").value_or("");
  if (auto err = costsFromFlags(args, o.costs, o.costsSource))
    return err;
  ModelSpec model;
  ClusterSpec cluster;
  if (auto err = specsFromFlags(args, model, cluster))
    return err;
  if (auto err = microbatchSizeFromFlags(args, model))
    return err;
  auto order = parseSchedule(text, source);
  if (!order)
    return order.takeError();
  auto result = compileImported(model, cluster, *order, o, source, kVerifyEachPass);
  if (!result)
    return result.takeError();
  if (clusterOut)
    *clusterOut = cluster;
  if (orderOut)
    *orderOut = std::move(*order);
  if (modelOut)
    *modelOut = std::move(model);
  return result;
}

/// --min-headroom: 0, a percentage of the memory limit ("5%", which the planner takes of
/// whatever limit it plans for, so that a limit it suggests keeps the same share) or a byte
/// count ("4GiB").
static llvm::Error minHeadroomFromFlag(const Args &args, llvm::StringRef value, PlannerOptions &o) {
  llvm::StringRef v = value.trim();
  double pct = 0;
  if (v == "0") {
    o.minHeadroom = 0;
    return llvm::Error::success();
  }
  if (v.endswith("%")) {
    if (v.drop_back().trim().getAsDouble(pct) || !(pct >= 0 && pct < 100))
      return inputError("--min-headroom expects a percentage from 0 to below 100 such as 5% "
                        "(got '{}')",
                        value.str());
    o.minHeadroom = -1;
    o.minHeadroomPercent = pct;
    return llvm::Error::success();
  }
  auto bytes = args.bytes("--min-headroom");
  if (!bytes)
    return inputError("--min-headroom expects 0, a percentage of the memory limit such as 5%, "
                      "or a byte count such as 4GiB (got '{}')",
                      value.str());
  o.minHeadroom = *bytes;
  return llvm::Error::success();
}

llvm::Expected<PlannerOptions> plannerOptionsFromFlags(const Args &args) {
  if (!args.has("--model") && !args.has("--model-json"))
    return inputError("missing --model (the model spec, required); try --model "
                      "examples/gpt-7b-8k.json");
  if (!args.has("--gpus"))
    return inputError("missing --gpus (GPUs to plan for, required); try --gpus 8");
  if (!args.has("--global-batch"))
    return inputError("missing --global-batch (sequences per step, required); try "
                      "--global-batch 64");
  PlannerOptions o;
  struct IntFlag {
    const char *name;
    std::function<void(int64_t)> set;
  } ints[] = {{"--gpus", [&](int64_t v) { o.gpus = int(v); }},
              {"--global-batch", [&](int64_t v) { o.globalBatch = v; }},
              {"--top", [&](int64_t v) { o.top = int(v); }},
              {"--max-vpp", [&](int64_t v) { o.maxVpp = int(v); }},
              {"--threads", [&](int64_t v) { o.threads = unsigned(v); }}};
  for (const IntFlag &f : ints) {
    auto v = args.integer(f.name);
    if (!v)
      return v.takeError();
    f.set(*v);
  }
  auto limit = args.bytes("--memory-limit");
  if (!limit)
    return limit.takeError();
  o.memoryLimit = *limit;
  o.tpAcrossNodes = args.has("--tp-across-nodes");
  auto partition = args.choice("--partition");
  if (!partition)
    return partition.takeError();
  o.evenPartition = *partition == "even";
  // Each switch fixed on, fixed off, or (neither given) searched.
  for (auto [on, off, out] :
       {std::tuple{"--sequence-parallel", "--no-sequence-parallel", &o.sequenceParallel},
        std::tuple{"--distributed-optimizer", "--no-distributed-optimizer",
                   &o.distributedOptimizer}}) {
    if (args.has(on) && args.has(off))
      return inputError("{} and {} contradict each other; give one (or neither, to search both)",
                        on, off);
    if (args.has(on) || args.has(off))
      *out = args.has(on);
  }
  if (auto err = costsFromFlags(args, o.costs, o.costsSource))
    return err;
  auto sizes = args.integers("--microbatch-sizes");
  if (!sizes)
    return sizes.takeError();
  if (!sizes->empty())
    o.microbatchSizes = std::move(*sizes);
  for (auto [flag, out] : {std::pair{"--seq-splits", &o.seqSplits}, std::pair{"--tp", &o.tpSizes},
                           std::pair{"--pp", &o.ppSizes}, std::pair{"--cp", &o.cpSizes}}) {
    auto v = args.integers(flag);
    if (!v)
      return v.takeError();
    if (!v->empty())
      out->assign(v->begin(), v->end());
  }
  auto schedules = args.words("--schedules");
  if (!schedules)
    return schedules.takeError();
  o.schedules = std::move(*schedules);
  auto recompute = args.words("--recompute");
  if (!recompute)
    return recompute.takeError();
  for (const std::string &n : *recompute) {
    Recompute rec;
    if (!recomputeFromString(n, rec))
      return inputError("--recompute: expected none, selective or full, or a list of them "
                        "(got '{}'); try --recompute none,full",
                        n);
    o.recompute.push_back(rec);
  }
  return o;
}

llvm::Expected<PlanSearch> planWithFlags(const Args &args) {
  auto o = plannerOptionsFromFlags(args);
  if (!o)
    return o.takeError();
  PlanSearch search;
  if (auto err = specsFromFlags(args, search.model, search.cluster))
    return err;
  if (auto headroom = args.get("--min-headroom"))
    if (auto err = minHeadroomFromFlag(args, *headroom, *o))
      return err;
  search.options = std::move(*o);
  // (The planner hands candidates back only with a result; on a finding, nothing is written.)
  auto result = planLayouts(search.model, search.cluster, search.options);
  if (!result)
    return result.takeError();
  search.result = std::move(*result);
  return search;
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
  auto args = Args::parse(argc, argv, 2, *findPipecCommand("export"));
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
  if (*out != "-") // (the CSV alone on standard output)
    fmt::print("wrote {} ({}: {} rows, one per rank)\n", *out, toString(form).str(),
               plan->numRanks());
  return llvm::Error::success();
}

std::string uncalibratedClusterSentence(bool defaultCluster) {
  return fmt::format("{} carries no calibration record, so these step times rest on factors no "
                     "published run has checked; --cluster examples/a100-selene.json or "
                     "examples/h100-nemo.json are fitted to published runs "
                     "(docs/planner.md#calibration-out-of-sample)",
                     defaultCluster ? "the embedded default cluster (no --cluster)"
                                    : "the cluster spec");
}

void printCalibrationNote(const Args &args, const Plan &plan, const ClusterSpec &cluster) {
  // A transformer's times ("ms"; an abstract model's are its own units) from a cluster spec no
  // published run has checked.
  if (plan.timeUnit != "ms" || args.has("--costs") || !cluster.heldOutErrorBySchedule.empty())
    return;
  fmt::print("note: {}\n", uncalibratedClusterSentence(!args.has("--cluster")));
}

llvm::Error cmdImport(int argc, char **argv, SummaryPrinter printSummary) {
  auto args = Args::parse(argc, argv, 2, *findPipecCommand("import"));
  if (!args)
    return args.takeError();
  if (args->positional().size() != 1)
    return inputError("import: expected one schedule file (got {}); usage: pipec import "
                      "sched.csv|sched.txt --model M.json [--vpp V] [-o plan.json]",
                      args->positional().size());
  std::string source = args->positional().front();
  // Every output is checked before anything is read or compiled.
  const std::vector<InputFile> inputs = commandInputs(*args, "schedule");
  const bool toStdout = writesStandardOutput(*args, {"-o", "--trace"});
  if (toStdout && args->has("--show"))
    return inputError("--show prints the grid to standard output, which {} - fills; write that "
                      "to a file, or drop --show",
                      args->get("-o") == "-" ? "-o" : "--trace");
  for (llvm::StringRef flag : {"-o", "--trace"})
    if (auto path = args->path(flag))
      if (auto err = checkOutputPath(flag, *path, inputs))
        return err;
  auto text = readFile(userPath(source));
  if (!text)
    return text.takeError();
  ClusterSpec cluster;
  ImportedOrder order;
  ModelSpec model;
  auto result = importWithFlags(*args, *text, source, &cluster, &order, &model);
  if (!result)
    return result.takeError();
  const Plan &plan = result->plan;
  std::optional<std::string> out = args->path("-o");
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
  if (toStdout) // the report would corrupt the file on standard output
    return llvm::Error::success();
  if (!args->has("--quiet")) {
    fmt::print("{}", importReport(order, *result, source));
    printSummary(plan, &cluster, &model);
    printCalibrationNote(*args, plan, cluster);
  }
  if (args->has("--show"))
    fmt::print("\n{}", formatGrid(plan));
  if (out && !args->has("--quiet"))
    fmt::print("wrote {}\n", *out);
  return llvm::Error::success();
}

} // namespace pipec
