//===- PlanCommand.cpp - pipec plan: search layouts and schedules ---------===//
//
//   pipec plan --model M.json --gpus N --global-batch B [...]   (flags: tools/Options.cpp)
// Prints the top K layouts (compiler/Planner.h) as a table (with the sequence-parallel and ZeRO-1
// settings chosen, and with --costs whether measured or modelled costs scored each row), what
// was dropped and why, and the `pipec compile` flags of the best; -o writes the best plan,
// --csv every candidate. Exit 0 with a plan, 1 when no layout fits in memory (naming the
// smallest shortfall), 2 for bad input.
//
//===----------------------------------------------------------------------===//
#include "tools/PlanCommand.h"

#include "compiler/Planner.h"
#include "ir/Model.h"
#include "ir/formats/PlanJson.h"
#include "ir/support/Bytes.h"
#include "ir/support/Error.h"
#include "ir/support/Files.h"
#include "tools/Args.h"
#include "tools/Driver.h"
#include "tools/Options.h"

#include "llvm/ADT/StringExtras.h"

#include <fmt/format.h>

#include <chrono>
#include <map>
#include <optional>
#include <string>

namespace pipec {

/// What the cluster spec's calibration record says of the ranked plans' schedules: each
/// schedule's held-out error against published runs, in rank order, and how far apart the
/// ranked plans' step times are. A transformer model's plans on a spec without a record (the
/// embedded default among them) are said to rest on unchecked factors, unless measured costs
/// (`measuredOnly`: every ranked plan timed from --costs) replaced the model.
static std::string calibrationLine(const ClusterSpec &cluster, const PlannerResult &result,
                                   bool transformer, bool measuredOnly, bool defaultCluster) {
  if (result.ranked.empty())
    return "";
  if (cluster.heldOutErrorBySchedule.empty()) {
    if (!transformer || measuredOnly)
      return "";
    return "calibration: none: " + uncalibratedClusterSentence(defaultCluster) + "\n";
  }
  std::vector<std::string> checked, unchecked, seen;
  for (size_t i : result.ranked) {
    const std::string &name = result.candidates[i].schedule;
    if (llvm::is_contained(seen, name))
      continue;
    seen.push_back(name);
    if (auto error = cluster.heldOutError(name))
      checked.push_back(fmt::format("{} {:.1f}%", name, 100 * *error));
    else
      unchecked.push_back(name);
  }
  std::string line = "calibration: ";
  if (!checked.empty())
    line += fmt::format("mean error on published runs, held out: {}", llvm::join(checked, ", "));
  if (!unchecked.empty())
    line += fmt::format("{}{}: no published runs", checked.empty() ? "" : "; ",
                        llvm::join(unchecked, ", "));
  double first = result.candidates[result.ranked.front()].stepTime;
  double last = result.candidates[result.ranked.back()].stepTime;
  if (result.ranked.size() > 1 && first > 0)
    line += fmt::format("; the {} plans above are within {:.1f}% of the first",
                        result.ranked.size(), 100 * (last / first - 1));
  return line + " (docs/planner.md#calibration-out-of-sample)\n";
}

llvm::Error runPlanCommand(int argc, char **argv) {
  auto args = Args::parse(argc, argv, 2, *findPipecCommand("plan"));
  if (!args)
    return args.takeError();
  if (!args->positional().empty())
    return inputError("plan: unexpected argument '{}' (flags are --model, --gpus, "
                      "--global-batch, ...)",
                      args->positional().front());
  // Every output is checked before the search (which may take seconds): a path that cannot be
  // written, or one of the inputs, is refused at once.
  const std::vector<InputFile> inputs = commandInputs(*args, "");
  for (llvm::StringRef flag : {"-o", "--csv"})
    if (auto path = args->path(flag))
      if (auto err = checkOutputPath(flag, *path, inputs))
        return err;
  auto started = std::chrono::steady_clock::now();
  auto search = planWithFlags(*args);
  double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  if (!search)
    return search.takeError();
  const ModelSpec *model = &search->model;
  const ClusterSpec &cluster = search->cluster;
  const PlannerOptions &o = search->options;
  const PlannerResult *result = &search->result;
  std::optional<std::string> out = args->path("-o");
  std::optional<std::string> csv = args->path("--csv");

  std::vector<OutputFile> outputs;
  if (out)
    outputs.push_back(OutputFile{"-o", *out, "",
                                 [&](llvm::raw_ostream &os) { writePlanJson(result->best, os); }});
  if (csv)
    outputs.push_back(OutputFile{"--csv", *csv, plannerCsv(*model, cluster, o, *result)});
  if (auto err = writeFilesAtomically(outputs, inputs))
    return err;
  // (The table would corrupt a file on standard output.)
  if (args->has("--quiet") || writesStandardOutput(*args, {"-o", "--csv"}))
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
      result->minHeadroom > 0 ? fmt::format(", {} kept free", humanBytes(result->minHeadroom)) : "";
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
               cluster.deviceName, cluster.gpusPerNode, humanBytes(result->memoryLimit), kept,
               o.globalBatch);
  } else {
    fmt::print("pipec plan: {} ({} layers) on {} GPUs ({} per node, {} each{}), global batch {} "
               "microbatches\n",
               model->name, model->layers.size(), o.gpus, cluster.gpusPerNode,
               humanBytes(result->memoryLimit), kept, o.globalBatch);
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
  // With --costs, a column says which rows the measured times scored.
  const bool costs = o.costs != nullptr;
  // A cp column where --cp searched context parallelism.
  const bool cpColumn = llvm::any_of(o.cpSizes, [](int cp) { return cp > 1; });
  fmt::print("{:>3}  {:<19} {:>3}{} {:>3} {:>3} {:>4} {:>3} {:>5} {:>2}  {:<9} {:<3} {:<4} {:>13} "
             "{:>10} {:>8} {:>6} {:>7} {:>11} {:>10}{}\n",
             "#", "schedule", "tp", cpColumn ? fmt::format(" {:>3}", "cp") : "", "pp", "vpp", "dp",
             "mb", "m", "K", "recompute", "SP", "ZeRO", fmt::format("step ({})", unit), "tokens/s",
             "TFLOP/s", "MFU", "bubble", "peak memory", "headroom", costs ? "  costs" : "");
  for (size_t i = 0; i < result->ranked.size(); ++i) {
    const PlanCandidate &c = result->candidates[result->ranked[i]];
    const ParallelConfig &pc = c.parallel;
    std::string tokens = "-", tflops = "-", mfu = "-";
    if (auto th = stepThroughput(modelVariant(*model, c.microbatchSize, c.recompute), pc,
                                 c.stepTime, cluster.peakTflops)) {
      tokens = fmt::format("{:.0f}", th->tokensPerSecond);
      tflops = fmt::format("{:.1f}", th->tflopsPerGpu);
      mfu = fmt::format("{:.1f}%", 100 * th->mfu);
    }
    fmt::print("{:>3}  {:<19} {:>3}{} {:>3} {:>3} {:>4} {:>3} {:>5} {:>2}  {:<9} {:<3} {:<4} "
               "{:>13.3f} {:>10} {:>8} {:>6} {:>6.1f}% {:>11} {:>10}{}\n",
               i + 1, scheduleLabel(c), pc.tp, cpColumn ? fmt::format(" {:>3}", pc.cp) : "", pc.pp,
               pc.vpp, pc.dp, c.microbatchSize, pc.microbatches, pc.seqSplits,
               toString(c.recompute).str(), pc.sequenceParallel ? "on" : "off",
               pc.distributedOptimizer ? "on" : "off", c.stepTime, tokens, tflops, mfu,
               100 * c.bubble, inGiB(c.peakMemoryBytes),
               inGiB(result->memoryLimit - c.peakMemoryBytes),
               costs ? (c.measured ? "  measured" : "  model") : "");
  }
  // Measured candidates and model rows rank one machine's times against another's where the
  // profile was not taken on the cluster spec's device (a cpu profile never is).
  if (costs) {
    bool measured =
             llvm::any_of(result->candidates, [](const PlanCandidate &c) { return c.measured; }),
         modelled = llvm::any_of(result->ranked,
                                 [&](size_t i) { return !result->candidates[i].measured; });
    if (measured && modelled)
      fmt::print("note: the measured rows were timed on {} (--costs), the model rows are the "
                 "cost model's for {}: they rank one machine against another unless --cluster "
                 "describes the profiled one; profile each layout to compare them\n",
                 o.costs->device.empty() ? o.costs->backend : o.costs->device, cluster.deviceName);
  }
  // Candidates too large to simulate were not ranked: the table may miss a better one.
  if (size_t large = size_t(
          llvm::count_if(result->candidates, [](const PlanCandidate &c) { return c.tooLarge; })))
    fmt::print("note: {} candidate{} with more than {} instructions (that many microbatches "
               "and sub-sequences) {} not simulated; larger --microbatch-sizes, fewer --seq-splits "
               "or a smaller --global-batch bring them in\n",
               large, large == 1 ? "" : "s", kPlannerMaxInstructions, large == 1 ? "was" : "were");
  bool measuredOnly =
      llvm::all_of(result->ranked, [&](size_t i) { return result->candidates[i].measured; });
  fmt::print("{}", calibrationLine(cluster, *result, bool(model->transformer), measuredOnly,
                                   !args->path("--cluster")));
  const PlanCandidate &best = result->candidates[result->ranked.front()];
  fmt::print(
      "\nbest: {} with tp={}{} pp={} vpp={} dp={}, microbatch size {}, {} microbatches, "
      "seq-splits {}, recompute {}, sequence parallelism {}, distributed optimizer {}{}{}\n",
      best.parallel.pp == 1 ? std::string("no pipeline (1f1b order)") : best.schedule,
      best.parallel.tp,
      best.parallel.cp > 1 ? fmt::format(" cp={}", best.parallel.cp) : std::string(),
      best.parallel.pp, best.parallel.vpp, best.parallel.dp, best.microbatchSize,
      best.parallel.microbatches, best.parallel.seqSplits, toString(best.recompute).str(),
      best.parallel.sequenceParallel ? "on" : "off",
      best.parallel.distributedOptimizer ? "on" : "off",
      best.zbAutoLimit
          ? fmt::format(" (zb-auto under {} of activations per rank)", humanBytes(best.zbAutoLimit))
          : "",
      costs ? (best.measured ? ", scored with the measured costs" : ", scored by the model") : "");
  // The same figures from `pipec compile`, a line to paste into a shell. (With the search's
  // --cluster: compiled on the default cluster the plan's costs and memory would be another
  // cluster's.)
  std::optional<std::string> modelPath = args->path("--model");
  std::optional<std::string> clusterPath = args->path("--cluster");
  fmt::print("compile: pipec compile --model {} {}{}\n",
             modelPath ? shellWord(*modelPath) : std::string("M.json"),
             clusterPath ? "--cluster " + shellWord(*clusterPath) + " " : std::string(),
             compileFlags(best, o, model->isTransformer()));
  // What piperun refuses to run (tools/piperun.cpp), and the flags that plan what it runs.
  std::vector<std::string> notRun, flags;
  if (best.recompute != Recompute::None) {
    notRun.push_back("recomputation");
    flags.push_back("--recompute none");
  }
  if (best.parallel.sequenceParallel) {
    notRun.push_back("sequence parallelism");
    flags.push_back("--no-sequence-parallel");
  }
  if (best.parallel.distributedOptimizer) {
    notRun.push_back("the distributed optimizer");
    flags.push_back("--no-distributed-optimizer");
  }
  if (best.parallel.cp > 1) {
    notRun.push_back("context parallelism");
    flags.push_back("--cp 1");
  }
  if (!notRun.empty())
    fmt::print("note: piperun does not execute {}; the plan sizes a run, {} plans run\n",
               llvm::join(notRun, " or "), llvm::join(flags, " "));
  // The planner splits a vocabulary tp does not divide as Megatron-LM does once it has padded
  // it; piperun does not pad (it refuses such a plan, naming the padded size).
  if (model->transformer && model->transformer->vocabSize % best.parallel.tp != 0) {
    const int64_t multiple = 128 * int64_t(best.parallel.tp), v = model->transformer->vocabSize;
    fmt::print("note: tp {} does not divide vocab_size {}: Megatron-LM pads it (to {}, a "
               "multiple of 128 x tp); piperun needs it padded in the model spec\n",
               best.parallel.tp, v, (v + multiple - 1) / multiple * multiple);
  }
  if (model->transformer &&
      (model->transformer->attentionDropout > 0 || model->transformer->hiddenDropout > 0))
    fmt::print("note: piperun does not execute dropout; the plan sizes a run, a model without "
               "it plans one that runs\n");
  // The memory column is what the cluster spec says the software keeps (docs/planner.md).
  if (model->transformer && !cluster.megatronActivations)
    fmt::print("note: peak memory as piperun keeps activations; for a Megatron-LM or NeMo job "
               "add \"kept_activations\": \"megatron\" to the cluster spec\n");
  else if (model->transformer)
    fmt::print("note: peak memory as Megatron-LM and Transformer Engine keep activations (the "
               "cluster spec's \"kept_activations\"); piperun keeps them otherwise, "
               "\"kept_activations\": \"piperun\" sizes a piperun job\n");
  if (out)
    fmt::print("wrote {}\n", *out);
  if (csv)
    fmt::print("wrote {} ({} candidates)\n", *csv, total);
  return llvm::Error::success();
}

} // namespace pipec
