//===- Calibration.cpp - Published training runs predicted by the one cost model ------===//
#include "bench/Calibration.h"

#include "compiler/Partition.h"
#include "compiler/Pass.h"
#include "ir/CostModel.h"
#include "ir/formats/SpecJson.h"
#include "ir/support/Error.h"
#include "ir/support/Files.h"

#include "llvm/ADT/StringMap.h"
#include "llvm/ADT/StringRef.h"

#include <fmt/format.h>

#include <cmath>
#include <map>

namespace pipec {

namespace {

/// Split one CSV record (RFC 4180 quoting) into fields.
std::vector<std::string> splitCsv(llvm::StringRef line) {
  std::vector<std::string> out(1);
  bool quoted = false;
  for (size_t i = 0; i < line.size(); ++i) {
    char c = line[i];
    if (quoted) {
      if (c == '"' && i + 1 < line.size() && line[i + 1] == '"') {
        out.back() += '"';
        ++i;
      } else if (c == '"') {
        quoted = false;
      } else {
        out.back() += c;
      }
    } else if (c == '"') {
      quoted = true;
    } else if (c == ',') {
      out.emplace_back();
    } else if (c != '\r') {
      out.back() += c;
    }
  }
  return out;
}

/// Preference of a metric when a run is given in several (lower is better); -1: not a run's
/// throughput (MFU and HFU restate the same measurement).
int metricRank(llvm::StringRef metric) {
  if (metric == "step_time_s")
    return 0;
  if (metric == "tokens_per_s_per_gpu" || metric == "tokens_per_s")
    return 1;
  if (metric == "samples_per_s_per_gpu" || metric == "samples_per_s")
    return 2;
  if (metric == "tflops_per_gpu" || metric == "nemo_tflops_per_gpu")
    return 3;
  return -1;
}

int64_t intOr(const std::string &s, int64_t fallback) {
  if (s.empty())
    return fallback;
  long long v = 0;
  if (llvm::StringRef(s).getAsInteger(10, v))
    return -1;
  return v;
}

} // namespace

llvm::Error loadPublishedRuns(llvm::StringRef path, std::vector<PublishedRun> &runs,
                              std::vector<SkippedRow> &skipped) {
  auto text = readFile(path, kAnyInput);
  if (!text)
    return text.takeError();
  llvm::SmallVector<llvm::StringRef, 0> lines;
  llvm::StringRef(*text).split(lines, '\n', -1, false);
  if (lines.empty())
    return inputError("{}: empty file; expected a header line", path.str());
  std::vector<std::string> header = splitCsv(lines[0]);
  llvm::StringMap<size_t> col;
  for (size_t i = 0; i < header.size(); ++i)
    col[header[i]] = i;
  for (const char *name : {"source_id",
                           "row_id",
                           "num_layers",
                           "hidden_size",
                           "num_attention_heads",
                           "num_query_groups",
                           "ffn_hidden_size",
                           "vocab_size",
                           "seq_length",
                           "gpu",
                           "num_gpus",
                           "tp",
                           "pp",
                           "vpp",
                           "seq_splits",
                           "dp",
                           "cp",
                           "microbatch_size",
                           "global_batch",
                           "schedule",
                           "recompute",
                           "sequence_parallel",
                           "distributed_optimizer",
                           "flash_attention",
                           "precision",
                           "block",
                           "partition",
                           "p2p",
                           "grad_reduce",
                           "metric",
                           "value"})
    if (!col.count(name))
      return inputError("{}: the header has no column \"{}\"", path.str(), name);
  // One run per (source, layout) key; the preferred metric wins.
  std::map<std::string, std::pair<int, PublishedRun>> byKey;
  std::vector<std::string> order;
  for (size_t li = 1; li < lines.size(); ++li) {
    std::vector<std::string> f = splitCsv(lines[li]);
    if (f.size() < header.size())
      return inputError("{}: line {}: {} fields, expected {}", path.str(), li + 1, f.size(),
                        header.size());
    auto at = [&](const char *name) -> const std::string & { return f[col[name]]; };
    int rank = metricRank(at("metric"));
    if (rank < 0)
      continue;
    SkippedRow skip{at("source_id"), at("row_id"), ""};
    int64_t layers = intOr(at("num_layers"), -1), hidden = intOr(at("hidden_size"), -1);
    int64_t heads = intOr(at("num_attention_heads"), -1);
    int64_t groups = intOr(at("num_query_groups"), 0), ffn = intOr(at("ffn_hidden_size"), 0);
    // Megatron's GPT-2 vocabulary padded (51,200) where the source does not give one.
    int64_t vocab = intOr(at("vocab_size"), 51200), seq = intOr(at("seq_length"), -1);
    int64_t gpus = intOr(at("num_gpus"), -1), tp = intOr(at("tp"), 1), pp = intOr(at("pp"), 1);
    int64_t dp = intOr(at("dp"), -1), mb = intOr(at("microbatch_size"), 1);
    int64_t cp = intOr(at("cp"), 1);
    int64_t batch = intOr(at("global_batch"), -1);
    std::string schedule = at("schedule");
    if (schedule.empty() && pp == 1)
      schedule = "1f1b"; // no pipeline: one stage runs forward then backward
    if (schedule.empty()) {
      skip.why = "the schedule is not published";
      skipped.push_back(skip);
      continue;
    }
    // The zero-bubble paper's ZB-1p and ZB-2p are its automatic scheduler's orders under an
    // activation limit of p·M_B and 2p·M_B (Qi et al. 2024, §3): zb-auto at that limit
    // (prepareRun sets it from the compiled stages).
    std::string published = schedule;
    int searchedLimit = schedule == "zb-1p" ? 1 : schedule == "zb-2p" ? 2 : 0;
    if (searchedLimit > 0)
      schedule = "zb-auto";
    if (layers <= 0 || hidden <= 0 || heads <= 0 || seq <= 0 || gpus <= 0 || dp <= 0 ||
        batch <= 0 || tp <= 0 || pp <= 0 || mb <= 0 || cp <= 0 || tp * pp * dp * cp != gpus ||
        batch % (dp * mb) != 0) {
      skip.why = "its layout is incomplete or does not multiply out (tp·cp·pp·dp = GPUs, "
                 "dp·microbatch size divides the batch)";
      skipped.push_back(skip);
      continue;
    }
    // The transformer as published. An unpublished attention kernel is flash (what current
    // Megatron and NeMo run) unless the run recomputes selectively, which only a materialized
    // score matrix calls for; unpublished recomputation is settled in predictSeconds.
    std::string recompute = at("recompute").empty() ? "none" : at("recompute");
    std::string attention = at("flash_attention") == "false" ? "materialized" : "flash";
    if (at("flash_attention").empty() && recompute == "selective")
      attention = "materialized";
    std::string extra;
    if (ffn > 0)
      extra += fmt::format(", \"ffn_hidden_size\": {}", ffn);
    if (groups > 0)
      extra += fmt::format(", \"num_query_groups\": {}", groups);
    if (at("block") == "llama") // Llama's block: RMSNorm, SwiGLU, rotary positions, no biases
      extra += ", \"mlp\": \"swiglu\", \"norm\": \"rmsnorm\", \"position\": \"rope\", "
               "\"bias\": false";
    else if (at("block") == "nemotron") // Nemotron's: LayerNorm, squared ReLU, rotary, no biases
      extra += ", \"position\": \"rope\", \"bias\": false";
    if (at("precision") == "fp8") // Transformer Engine's FP8: the blocks' GEMMs only
      extra += ", \"gemm_precision\": \"fp8\"";
    // Optional columns: the dropout probability (attention and hidden alike, as Megatron-LM's
    // defaults set them; empty: none published, taken as none) and the measured peak memory.
    auto optional = [&](const char *name) -> std::string {
      return col.count(name) ? f[col[name]] : std::string();
    };
    double dropout = 0, peakGB = 0;
    if (!optional("dropout").empty() &&
        (!llvm::to_float(optional("dropout"), dropout) || dropout < 0 || dropout >= 1)) {
      skip.why =
          fmt::format("dropout \"{}\": expected a probability in [0, 1)", optional("dropout"));
      skipped.push_back(skip);
      continue;
    }
    if (!optional("peak_memory_gb").empty() &&
        (!llvm::to_float(optional("peak_memory_gb"), peakGB) || peakGB <= 0)) {
      skip.why = fmt::format("peak_memory_gb \"{}\": expected a positive number",
                             optional("peak_memory_gb"));
      skipped.push_back(skip);
      continue;
    }
    if (dropout > 0)
      extra += fmt::format(", \"attention_dropout\": {}, \"hidden_dropout\": {}", dropout, dropout);
    std::string spec = fmt::format(
        R"({{"format": "pipemodel/1", "name": "{}", "transformer": {{"num_layers": {},
        "hidden_size": {}, "num_attention_heads": {}, "vocab_size": {}, "seq_length": {},
        "microbatch_size": {}, "dtype": "bf16", "attention": "{}", "recompute": "{}"{}}}}})",
        at("row_id"), layers, hidden, heads, vocab, seq, mb, attention, recompute, extra);
    auto model = parseModelSpec(spec, at("row_id"));
    if (!model) {
      skip.why = takeMessage(model.takeError());
      skipped.push_back(skip);
      continue;
    }
    PublishedRun run;
    run.source = at("source_id");
    run.id = at("row_id");
    run.device = at("gpu");
    run.model = std::move(*model);
    run.gpus = gpus;
    run.globalBatch = batch;
    run.fp8 = at("precision") == "fp8";
    run.metric = at("metric");
    run.publishedSchedule = published;
    run.searchedLimit = searchedLimit;
    run.recomputePublished = !at("recompute").empty();
    run.measuredPeakBytes = peakGB * 1e9;
    // How the run's software makes pipeline transfers, where it differs from the cluster
    // spec's (DeepSpeed's pipeline engine: "blocking").
    if (!at("p2p").empty()) {
      P2p mode;
      if (!p2pFromString(at("p2p"), mode)) {
        skip.why = fmt::format("p2p \"{}\": expected blocking, megatron or overlapped", at("p2p"));
        skipped.push_back(skip);
        continue;
      }
      run.p2p = mode;
    }
    // When its software reduces the dp gradients, where that is not the cluster spec's:
    // "after-backward" for Megatron-LM's local DDP, "overlapped" for PyTorch DDP.
    if (!at("grad_reduce").empty()) {
      if (at("grad_reduce") != "overlapped" && at("grad_reduce") != "after-backward") {
        skip.why = fmt::format("grad_reduce \"{}\": expected overlapped or after-backward",
                               at("grad_reduce"));
        skipped.push_back(skip);
        continue;
      }
      run.overlapGradReduce = at("grad_reduce") == "overlapped";
    }
    CompileOptions &o = run.options;
    o.schedule = schedule;
    o.parallel.pp = int(pp);
    o.parallel.tp = int(tp);
    o.parallel.dp = int(dp);
    o.parallel.cp = int(cp);
    o.parallel.microbatches = int(batch / (dp * mb));
    o.parallel.sequenceParallel = at("sequence_parallel") == "true";
    o.parallel.distributedOptimizer = at("distributed_optimizer") == "true";
    // The published split of layers into stages. "megatron": the transformer blocks in equal
    // numbers per stage, the embedding with the first, the head with the last (Megatron-LM's
    // and NeMo's uniform split). "units": the embedding and the head count as one block each
    // and every stage holds as many (so the first and last hold one block fewer: the
    // zero-bubble paper's split, BLOOM's "type:transformer|embedding", Llama 3's). Empty:
    // pipec's balanced partition.
    const std::string &split = at("partition");
    int64_t units = split == "units" ? layers + 2 : layers;
    int64_t vpp = intOr(at("vpp"), 1);
    // Interleaving without a published chunk count: the most chunks whole transformer layers
    // allow (the zero-bubble paper's rule, "each transformer layer serves as a chunk").
    bool interleaved = schedule == "interleaved-1f1b" || schedule == "seq1f1b-interleaved";
    if (interleaved && at("vpp").empty())
      vpp = std::max<int64_t>(2, units / pp);
    o.parallel.vpp = int(interleaved ? vpp : 1);
    // Seq1F1B's sub-sequences, cut as its authors' software cuts them: at equal FLOPs.
    if (schedule == "seq1f1b" || schedule == "seq1f1b-interleaved") {
      int64_t splits = intOr(at("seq_splits"), 1);
      if (splits < 1 || splits > seq) {
        skip.why = fmt::format("seq_splits \"{}\": expected 1 to seq_length", at("seq_splits"));
        skipped.push_back(skip);
        continue;
      }
      o.parallel.seqSplits = int(splits);
      o.parallel.seqSplitByFlops = true;
    }
    if (!split.empty()) {
      int64_t stages = pp * o.parallel.vpp;
      if ((split != "megatron" && split != "units") || units % stages != 0) {
        skip.why = fmt::format("partition \"{}\": {} layers do not split evenly into {} stages",
                               split, units, stages);
        skipped.push_back(skip);
        continue;
      }
      o.stageEnds = *evenStageEnds(run.model, int(stages), split == "units");
    }
    double value = 0;
    if (!llvm::to_float(at("value"), value) || value <= 0) {
      skip.why = "no measured value";
      skipped.push_back(skip);
      continue;
    }
    const std::string &metric = run.metric;
    if (metric == "step_time_s") {
      run.measuredSeconds = value;
    } else if (metric == "tokens_per_s") {
      run.measuredSeconds = double(batch) * double(seq) / value;
    } else if (metric == "tokens_per_s_per_gpu") {
      run.measuredSeconds = double(batch) * double(seq) / (value * double(gpus));
    } else if (metric == "samples_per_s_per_gpu") {
      run.measuredSeconds = double(batch) / (value * double(gpus));
    } else if (metric == "samples_per_s") {
      run.measuredSeconds = double(batch) / value;
    } else if (metric == "nemo_tflops_per_gpu") {
      // NeMo's performance tables count a Llama model's FLOPs per token as
      // l·h²·(12 + 12·g/a + 18·f/h + 12·s/h + 6·V/(l·h)) (nemo/utils/flops_formulas.py, its
      // llama2 and llama3 entries): the attention term is the whole s x s score matrix.
      if (ffn <= 0 || at("vocab_size").empty()) {
        skip.why = "metric nemo_tflops_per_gpu: NeMo's FLOP count needs ffn_hidden_size and "
                   "vocab_size";
        skipped.push_back(skip);
        continue;
      }
      if (at("block") != "llama") {
        skip.why = fmt::format("metric nemo_tflops_per_gpu: NeMo's FLOP count of a \"{}\" "
                               "block is not implemented (only llama)",
                               at("block"));
        skipped.push_back(skip);
        continue;
      }
      double s = double(seq), l = double(layers), h = double(hidden), v = double(vocab);
      double g = double(groups > 0 ? groups : heads), a = double(heads), fh = double(ffn);
      double perToken = l * h * h * (12 + 12 * g / a + 18 * fh / h + 12 * s / h + 6 * v / (l * h));
      run.measuredSeconds = perToken * double(batch) * s / (value * 1e12 * double(gpus));
    } else {
      // Megatron-LM's count (Narayanan et al. Eq. 3): 72·B·s·l·h²·(1 + s/6h + V/16lh) for the
      // forward and backward, a third more with full recomputation's second forward.
      double s = double(seq), l = double(layers), h = double(hidden), v = double(vocab);
      double flops = 72 * double(batch) * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h));
      if (recompute == "full")
        flops *= 4.0 / 3.0;
      run.measuredSeconds = flops / (value * 1e12 * double(gpus));
    }
    std::string key =
        fmt::format("{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}", run.source, layers, hidden, gpus, tp, pp,
                    dp, batch, published, recompute, seq, at("precision"));
    auto it = byKey.find(key);
    if (it == byKey.end()) {
      order.push_back(key);
      byKey.emplace(key, std::make_pair(rank, std::move(run)));
    } else if (rank < it->second.first) {
      it->second = std::make_pair(rank, std::move(run));
    }
  }
  for (const std::string &key : order)
    runs.push_back(std::move(byKey.at(key).second));
  return llvm::Error::success();
}

ClusterSpec clusterFor(const RunSoftware &run, const ClusterSpec &cluster) {
  ClusterSpec c = cluster;
  c.p2p = run.p2p.value_or(c.p2p);
  c.overlapGradReduce = run.overlapGradReduce.value_or(c.overlapGradReduce);
  return c;
}

/// Compiles `run` as published with `model`; a searched run (zb-auto) under the zero-bubble
/// authors' own limit: searchedLimit · p · M_B, M_B the larger of the activations one
/// microbatch's forward leaves on the first two stages. Their runtime profiles each stage's
/// forward memory (f_mem) and hands its scheduler `--zero-bubble-max-pending-backward` times
/// max(f_mem[:2]) as every rank's limit (megatron/core/pipeline_parallel/zb_schedules.py in
/// sail-sg/zero-bubble-pipeline-parallelism); their launch script passes p for ZB-1p and 2p
/// for ZB-2p (Qi et al. 2024, §3).
static llvm::Expected<Plan> compileAsPublished(const PublishedRun &run, const ModelSpec &model,
                                               const ClusterSpec &c) {
  if (run.searchedLimit == 0)
    return compilePlan(model, c, run.options, /*verifyEach=*/false);
  CompileOptions fixed = run.options;
  fixed.schedule = "1f1b";
  auto stages = compilePlan(model, c, fixed, /*verifyEach=*/false);
  if (!stages)
    return inputError("{}: 1F1B, whose stages set its limit: {}", run.id,
                      takeMessage(stages.takeError()));
  int64_t perMicrobatch = 0;
  for (size_t s = 0; s < std::min<size_t>(2, stages->stages.size()); ++s)
    perMicrobatch = std::max(perMicrobatch, stages->stages[s].activationBytes[0]);
  CompileOptions searched = run.options;
  searched.memoryLimit = int64_t(run.searchedLimit) * stages->parallel.pp * perMicrobatch;
  return compilePlan(model, c, searched, /*verifyEach=*/false);
}

llvm::Expected<PreparedRun> prepareRun(const PublishedRun &run, const ClusterSpec &cluster) {
  const ClusterSpec c = clusterFor(run, cluster);
  PreparedRun p;
  static_cast<RunSoftware &>(p) = run;
  p.model = run.model;
  auto plan = compileAsPublished(run, p.model, c);
  if (!plan)
    return plan.takeError();
  if (!run.recomputePublished && plan->stats.maxPeakMemoryBytes() > c.memoryBytes) {
    p.model.transformer->recompute = Recompute::Full;
    plan = compileAsPublished(run, p.model, c);
    if (!plan)
      return plan.takeError();
  }
  p.plan = std::move(*plan);
  for (const StageInfo &st : p.plan.stages)
    p.stageEnds.push_back(st.layerEnd);
  return p;
}

bool reordersWithCosts(const PublishedRun &run, const ClusterSpec &cluster) {
  return run.searchedLimit > 0 || clusterFor(run, cluster).p2p == P2p::Blocking;
}

llvm::Expected<double> predictSeconds(const PublishedRun &run, const ClusterSpec &cluster) {
  auto p = prepareRun(run, cluster);
  if (!p)
    return p.takeError();
  return p->plan.stats.stepTime / 1000.0;
}

llvm::Expected<double> retimedSeconds(PreparedRun &run, const ClusterSpec &cluster) {
  buildStages(run.plan, run.model, clusterFor(run, cluster), run.stageEnds);
  if (auto err = simulateStep(run.plan))
    return err;
  return run.plan.stats.stepTime / 1000.0;
}

} // namespace pipec
