//===- PlanCommand.cpp - pipec plan: search layouts and schedules ---------===//
//
//   pipec plan --model M.json --gpus N --global-batch B [--cluster C.json] [--schedules a,b]
//              [--memory-limit BYTES] [--top K] [-o best.json] [--csv all.csv] [...]
// Prints the top K layouts (compiler/Planner.h) as a table and what was dropped and why; -o
// writes the best plan, --csv every candidate. Exit 0 with a plan, 1 when no layout fits in
// memory (naming the smallest shortfall), 2 for bad input.
//
//===----------------------------------------------------------------------===//
#include "tools/PlanCommand.h"

#include "compiler/Planner.h"
#include "ir/Error.h"
#include "ir/Model.h"
#include "ir/PlanJson.h"
#include "tools/Args.h"
#include "tools/Driver.h"

#include "llvm/ADT/StringExtras.h"

#include <fmt/format.h>

#include <chrono>
#include <map>

namespace pipec {

const char *const kPlanUsage =
    R"(  plan --model M.json --gpus N --global-batch B [--cluster C.json]
       [--schedules a,b,...] [--memory-limit BYTES] [--min-headroom BYTES|P%] [--top K]
       [-o|--output best.json] [--csv all.csv] [--recompute none,selective,full]
       [--microbatch-sizes 1,2,4] [--seq-splits 1,2,4,8] [--max-vpp V] [--tp 1,2,...]
       [--pp 1,2,...] [--tp-across-nodes] [--sequence-parallel]
       [--distributed-optimizer] [--threads T] [--quiet]
                      search tp, pp, vpp, dp, microbatch size and count, seq-splits and
                      schedules for the fastest step that fits the device's memory, less
                      --min-headroom (default 5% of it; 0 to use it all)
)";

namespace {

std::string gib(int64_t bytes) { return fmt::format("{:.2f} GiB", double(bytes) / (1 << 30)); }

/// A comma-separated list of positive integers.
template <typename T>
llvm::Error parseList(const Args &args, llvm::StringRef flag, std::vector<T> &out) {
  auto v = args.get(flag);
  if (!v)
    return llvm::Error::success();
  llvm::SmallVector<llvm::StringRef, 8> parts;
  llvm::StringRef(*v).split(parts, ',', -1, false);
  out.clear();
  for (llvm::StringRef p : parts) {
    int64_t x = 0;
    if (p.trim().getAsInteger(10, x) || x < 1 || x > (1 << 24))
      return inputError("{} expects a comma-separated list of positive integers such as 1,2,4 "
                        "(got '{}')",
                        flag.str(), *v);
    out.push_back(T(x));
  }
  if (out.empty())
    return inputError("{} expects at least one value such as 1,2,4", flag.str());
  return llvm::Error::success();
}

/// --min-headroom: 0, a percentage of the memory limit ("5%") or a byte count ("4GiB").
llvm::Expected<int64_t> headroomBytes(const Args &args, llvm::StringRef value, int64_t limit) {
  llvm::StringRef v = value.trim();
  double pct = 0;
  if (v == "0")
    return int64_t(0);
  if (v.endswith("%")) {
    if (v.drop_back().trim().getAsDouble(pct) || !(pct >= 0 && pct < 100))
      return inputError("--min-headroom expects a percentage from 0 to below 100 such as 5% "
                        "(got '{}')",
                        value.str());
    return int64_t(double(limit) * pct / 100);
  }
  auto bytes = args.bytes("--min-headroom");
  if (!bytes)
    return inputError("--min-headroom expects 0, a percentage of the memory limit such as 5%, "
                      "or a byte count such as 4GiB (got '{}')",
                      value.str());
  return *bytes;
}

} // namespace

llvm::Error runPlanCommand(int argc, char **argv) {
  auto args = Args::parse(argc, argv, 2,
                          {"--model", "--gpus", "--global-batch", "--cluster", "--schedules",
                           "--memory-limit", "--min-headroom", "--top", "-o", "--output", "--csv",
                           "--recompute", "--microbatch-sizes", "--seq-splits", "--max-vpp",
                           "--threads", "--tp", "--pp"},
                          {"--tp-across-nodes", "--quiet", "--sequence-parallel",
                           "--distributed-optimizer"},
                          "plan");
  if (!args)
    return args.takeError();
  if (!args->positional().empty())
    return inputError("plan: unexpected argument '{}' (flags are --model, --gpus, "
                      "--global-batch, ...)",
                      args->positional().front());
  if (!args->has("--model"))
    return inputError("missing --model (the model spec, required); try --model "
                      "examples/gpt-7b-8k.json");
  if (!args->has("--gpus"))
    return inputError("missing --gpus (GPUs to plan for, required); try --gpus 8");
  if (!args->has("--global-batch"))
    return inputError("missing --global-batch (sequences per step, required); try "
                      "--global-batch 64");
  PlannerOptions o;
  auto gpus = args->integer("--gpus", 1, 1, 1 << 20);
  if (!gpus)
    return gpus.takeError();
  o.gpus = int(*gpus);
  auto batch = args->integer("--global-batch", 1, 1, int64_t(1) << 40);
  if (!batch)
    return batch.takeError();
  o.globalBatch = *batch;
  auto top = args->integer("--top", 5, 1, 1000);
  if (!top)
    return top.takeError();
  o.top = int(*top);
  auto maxVpp = args->integer("--max-vpp", o.maxVpp, 1, 64);
  if (!maxVpp)
    return maxVpp.takeError();
  o.maxVpp = int(*maxVpp);
  auto threads = args->integer("--threads", 0, 1, 256);
  if (!threads)
    return threads.takeError();
  o.threads = unsigned(*threads);
  auto limit = args->bytes("--memory-limit");
  if (!limit)
    return limit.takeError();
  o.memoryLimit = *limit;
  o.tpAcrossNodes = args->has("--tp-across-nodes");
  o.sequenceParallel = args->has("--sequence-parallel");
  o.distributedOptimizer = args->has("--distributed-optimizer");
  std::optional<std::string> headroom = args->get("--min-headroom");
  if (auto err = parseList(*args, "--microbatch-sizes", o.microbatchSizes))
    return err;
  if (auto err = parseList(*args, "--seq-splits", o.seqSplits))
    return err;
  if (auto err = parseList(*args, "--tp", o.tpSizes))
    return err;
  if (auto err = parseList(*args, "--pp", o.ppSizes))
    return err;
  if (auto s = args->get("--schedules")) {
    llvm::SmallVector<llvm::StringRef, 8> names;
    llvm::StringRef(*s).split(names, ',', -1, false);
    for (llvm::StringRef n : names)
      o.schedules.push_back(n.trim().str());
    if (o.schedules.empty())
      return inputError("--schedules expects a comma-separated list such as 1f1b,zb-h1");
  }
  if (auto r = args->get("--recompute")) {
    llvm::SmallVector<llvm::StringRef, 4> names;
    llvm::StringRef(*r).split(names, ',', -1, false);
    for (llvm::StringRef n : names) {
      Recompute rec;
      if (!recomputeFromString(n.trim(), rec))
        return inputError("--recompute: expected none, selective or full, or a list of them "
                          "(got '{}'); try --recompute none,full",
                          n.str());
      o.recompute.push_back(rec);
    }
  }
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
  if (headroom) {
    auto bytes =
        headroomBytes(*args, *headroom, o.memoryLimit ? o.memoryLimit : cluster.memoryBytes);
    if (!bytes)
      return bytes.takeError();
    o.minHeadroom = *bytes;
  }
  std::optional<std::string> out = args->path("-o");
  if (!out)
    out = args->path("--output");
  std::optional<std::string> csv = args->path("--csv");

  auto started = std::chrono::steady_clock::now();
  auto result = planLayouts(*model, cluster, o);
  double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  // The CSV is worth having when nothing fits, too: it says why for every candidate. (The
  // planner hands candidates back only with a result; on a finding, nothing is written.)
  if (!result)
    return result.takeError();

  std::vector<OutputFile> outputs;
  if (out)
    outputs.push_back(OutputFile{"-o", *out, "",
                                 [&](llvm::raw_ostream &os) { writePlanJson(result->best, os); }});
  if (csv)
    outputs.push_back(OutputFile{"--csv", *csv, plannerCsv(*model, cluster, o, *result)});
  if (auto err = writeFilesAtomically(outputs, commandInputs(*args, "")))
    return err;
  if (args->has("--quiet"))
    return llvm::Error::success();

  std::map<Outcome, size_t> count;
  size_t simulated = 0, compiled = 0;
  for (const PlanCandidate &c : result->candidates) {
    ++count[c.outcome];
    simulated += c.simulated;
    compiled += c.compiled;
  }
  const bool transformer = model->isTransformer();
  const std::string kept =
      result->minHeadroom > 0 ? fmt::format(", {} kept free", gib(result->minHeadroom)) : "";
  if (transformer) {
    const TransformerConfig &t = *model->transformer;
    // Llama-style choices, where the block is not GPT-2's.
    std::string heads = fmt::format("{} heads", t.numAttentionHeads), block;
    if (t.kvHeads() != t.numAttentionHeads)
      heads += fmt::format(" in {} key/value groups", t.kvHeads());
    if (t.norm != Norm::LayerNorm)
      block += ", " + toString(t.norm).str();
    if (t.mlp != Mlp::Gelu)
      block += ", " + toString(t.mlp).str();
    if (t.position != Position::Learned)
      block += ", " + toString(t.position).str();
    if (!t.bias)
      block += ", no biases";
    fmt::print("pipec plan: {} ({} layers, hidden {}, {}, seq {}, {}{}) on {} x {} ({} per "
               "node, {} each{}), global batch {} sequences\n",
               model->name, t.numLayers, t.hiddenSize, heads, t.seqLength, t.dtype, block, o.gpus,
               cluster.deviceName, cluster.gpusPerNode, gib(result->memoryLimit), kept,
               o.globalBatch);
  } else {
    fmt::print("pipec plan: {} ({} layers) on {} GPUs ({} per node, {} each{}), global batch {} "
               "microbatches\n",
               model->name, model->layers.size(), o.gpus, cluster.gpusPerNode,
               gib(result->memoryLimit), kept, o.globalBatch);
  }
  size_t total = result->candidates.size();
  fmt::print("searched {} candidates in {:.2f} s ({:.0f} candidates/s): {} simulated, {} "
             "compiled in full\n",
             total, seconds, double(total) / std::max(seconds, 1e-9), simulated, compiled);
  fmt::print("dropped: {} divisibility, {} schedule constraint, {} memory; pruned by the "
             "step-time bound: {}\n\n",
             count[Outcome::Divisibility], count[Outcome::Constraint], count[Outcome::Memory],
             count[Outcome::Pruned]);
  const char *unit = transformer ? "ms" : "unit";
  fmt::print("{:>3}  {:<19} {:>3} {:>3} {:>3} {:>4} {:>3} {:>5} {:>2}  {:<9} {:>13} {:>10} "
             "{:>8} {:>6} {:>7} {:>11} {:>10}\n",
             "#", "schedule", "tp", "pp", "vpp", "dp", "mb", "m", "K", "recompute",
             fmt::format("step ({})", unit), "tokens/s", "TFLOP/s", "MFU", "bubble", "peak memory",
             "headroom");
  for (size_t i = 0; i < result->ranked.size(); ++i) {
    const PlanCandidate &c = result->candidates[result->ranked[i]];
    const ParallelConfig &pc = c.parallel;
    std::string tokens = "-", tflops = "-", mfu = "-";
    if (transformer) {
      double s = c.stepTime / 1000;
      tokens = fmt::format("{:.0f}", double(result->tokensPerStep) / s);
      double perGpu = result->modelFlops[i] / s / o.gpus;
      tflops = fmt::format("{:.1f}", perGpu / 1e12);
      mfu = fmt::format("{:.1f}%", 100 * perGpu / (cluster.peakTflops * 1e12));
    }
    fmt::print("{:>3}  {:<19} {:>3} {:>3} {:>3} {:>4} {:>3} {:>5} {:>2}  {:<9} {:>13.3f} {:>10} "
               "{:>8} {:>6} {:>6.1f}% {:>11} {:>10}\n",
               i + 1, scheduleLabel(c), pc.tp, pc.pp, pc.vpp, pc.dp, c.microbatchSize,
               pc.microbatches, pc.seqSplits, toString(c.recompute).str(), c.stepTime, tokens,
               tflops, mfu, 100 * c.bubble, gib(c.peakMemoryBytes),
               gib(result->memoryLimit - c.peakMemoryBytes));
  }
  const PlanCandidate &best = result->candidates[result->ranked.front()];
  fmt::print("\nbest: {} with tp={} pp={} vpp={} dp={}, microbatch size {}, {} microbatches, "
             "seq-splits {}, recompute {}{}\n",
             best.parallel.pp == 1 ? std::string("no pipeline (1f1b order)") : best.schedule,
             best.parallel.tp, best.parallel.pp, best.parallel.vpp, best.parallel.dp,
             best.microbatchSize, best.parallel.microbatches, best.parallel.seqSplits,
             toString(best.recompute).str(),
             best.zbAutoLimit
                 ? fmt::format(" (zb-auto under {} of activations per rank)", gib(best.zbAutoLimit))
                 : "");
  if (best.recompute != Recompute::None)
    fmt::print("note: piperun does not execute recomputation; the plan sizes a run, "
               "--recompute none plans run\n");
  if (out)
    fmt::print("wrote {}\n", *out);
  if (csv)
    fmt::print("wrote {} ({} candidates)\n", *csv, total);
  return llvm::Error::success();
}

} // namespace pipec
