//===- calibration_bench.cpp - pipec's cost model against published throughput ------===//
//
// Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
// Megatron-LM" (SC'21, arXiv 2104.04473), Table 1: GPT models of 1.7B to 1T parameters trained
// on up to 3,072 A100s of NVIDIA's Selene (DGX A100 nodes of 8 GPUs, NVLink within a node, eight
// 200 Gb/s HDR InfiniBand adapters per node), vocabulary 51,200, sequence 2,048, with the
// interleaved schedule and activation recomputation, and the achieved teraFLOP/s per GPU,
// counted as the paper's Eq. (3): F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) per step (which
// counts the recomputed forward).
//
//   calibration_bench [--cluster examples/a100-selene.json] [--fit] [--planner]
//
// For every row: the published layout (tp, pp, dp = GPUs / (tp·pp), global batch) compiled by
// the planner restricted to that tp and pp (the best microbatch size and virtual stages under
// interleaved 1F1B, full recomputation), its predicted step time and so per-GPU teraFLOP/s
// under Eq. (3), against the published. --fit searches the cluster's GEMM efficiency
// (achieved_fraction) and the links' efficiency for the least mean absolute error and prints
// them. --planner also runs the unrestricted planner on each row's GPUs and batch and prints
// its choice against the published layout. Not a test: the table goes into docs/planner.md.
//
//===----------------------------------------------------------------------===//
#include "compiler/Planner.h"
#include "ir/Error.h"
#include "ir/Model.h"
#include "tools/Args.h"

#include <fmt/format.h>

#include <cmath>

using namespace pipec;

namespace {

struct Row {
  double billions;
  int heads, hidden, layers, tp, pp, gpus, batch;
  double tflops; // published, per GPU
};

// Table 1 of Narayanan et al. (SC'21).
const Row kTable1[] = {
    {1.7, 24, 2304, 24, 1, 1, 32, 512, 137},
    {3.6, 32, 3072, 30, 2, 1, 64, 512, 138},
    {7.5, 32, 4096, 36, 4, 1, 128, 512, 142},
    {18.4, 48, 6144, 40, 8, 1, 256, 1024, 135},
    {39.1, 64, 8192, 48, 8, 2, 512, 1536, 138},
    {76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140},
    {145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148},
    {310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155},
    {529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163},
    {1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163},
};
constexpr int kSeq = 2048, kVocab = 51200;

ModelSpec modelOf(const Row &r) {
  auto m = parseModelSpec(fmt::format(R"({{"format": "pipemodel/1", "name": "gpt-{}b",
      "transformer": {{"num_layers": {}, "hidden_size": {}, "num_attention_heads": {},
      "vocab_size": {}, "seq_length": {}, "dtype": "bf16", "attention": "materialized",
      "recompute": "full"}}}})",
                                      r.billions, r.layers, r.hidden, r.heads, kVocab, kSeq),
                          "table1");
  assert(m && "a row of Table 1 is a valid model");
  return *m;
}

/// Eq. (3): FLOPs of one step, recomputation included.
double megatronFlops(const Row &r) {
  double b = r.batch, s = kSeq, l = r.layers, h = r.hidden, v = kVocab;
  return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h));
}

PlannerOptions publishedLayout(const Row &r) {
  PlannerOptions o;
  o.gpus = r.gpus;
  o.globalBatch = r.batch;
  o.tpSizes = {r.tp};
  o.ppSizes = {r.pp};
  o.schedules = {r.pp > 1 ? "interleaved-1f1b" : "1f1b", "1f1b"};
  o.recompute = {Recompute::Full};
  o.microbatchSizes = {1, 2, 4, 8};
  o.seqSplits = {1};
  o.top = 1;
  o.minHeadroom = 0; // the published layout ran: no margin is asked of it
  return o;
}

/// Predicted per-GPU teraFLOP/s of each row's published layout (0 where none fits).
std::vector<double> predict(const ClusterSpec &cluster, std::vector<PlanCandidate> *best) {
  std::vector<double> out;
  for (const Row &r : kTable1) {
    auto result = planLayouts(modelOf(r), cluster, publishedLayout(r));
    if (!result) {
      llvm::consumeError(result.takeError());
      out.push_back(0);
      if (best)
        best->push_back(PlanCandidate{});
      continue;
    }
    const PlanCandidate &c = result->candidates[result->ranked.front()];
    out.push_back(megatronFlops(r) / (c.stepTime / 1000) / r.gpus / 1e12);
    if (best)
      best->push_back(c);
  }
  return out;
}

double meanAbsError(const std::vector<double> &predicted) {
  double sum = 0;
  for (size_t i = 0; i < predicted.size(); ++i)
    sum += predicted[i] > 0 ? std::abs(predicted[i] / kTable1[i].tflops - 1) : 1;
  return sum / double(predicted.size());
}

int fail(llvm::Error err) {
  fmt::print(stderr, "calibration_bench: {}\n", takeMessage(std::move(err)));
  return 2;
}

} // namespace

int main(int argc, char **argv) {
  auto args = Args::parse(argc, argv, 1, {"--cluster"}, {"--fit", "--planner"}, /*command=*/"");
  if (!args)
    return fail(args.takeError());
  auto loaded = loadClusterSpec(args->path("--cluster").value_or("examples/a100-selene.json"));
  if (!loaded)
    return fail(loaded.takeError());
  ClusterSpec cluster = *loaded;
  if (args->has("--fit")) {
    // A grid over the GEMMs' and the attention core's fractions of peak and the links'
    // efficiency, then a finer one around the best.
    double bestError = 1e9, bestGemm = 0, bestAttention = 0, bestLink = 0;
    auto search = [&](double g0, double g1, double gs, double a0, double a1, double as,
                      std::vector<double> links) {
      for (double gemm = g0; gemm <= g1 + 1e-9; gemm += gs)
        for (double attention = a0; attention <= a1 + 1e-9; attention += as)
          for (double link : links) {
            ClusterSpec c = cluster;
            c.achievedFraction = gemm;
            c.attentionFraction = attention;
            c.intraNode.efficiency = c.interNode.efficiency = link;
            double e = meanAbsError(predict(c, nullptr));
            if (e < bestError) {
              bestError = e;
              bestGemm = gemm;
              bestAttention = attention;
              bestLink = link;
            }
          }
    };
    // (About a second of CPU per point: 162 coarse points, 27 fine ones.)
    search(0.40, 0.80, 0.05, 0.10, 0.60, 0.10, {0.6, 0.8, 1.0});
    search(bestGemm - 0.04, bestGemm + 0.04, 0.01, std::max(0.05, bestAttention - 0.05),
           bestAttention + 0.05, 0.05, {bestLink});
    fmt::print("fit: achieved_fraction {:.2f}, attention_fraction {:.2f}, link efficiency "
               "{:.1f}: mean absolute error {:.1f}%\n",
               bestGemm, bestAttention, bestLink, 100 * bestError);
    cluster.achievedFraction = bestGemm;
    cluster.attentionFraction = bestAttention;
    cluster.intraNode.efficiency = cluster.interNode.efficiency = bestLink;
  }
  std::vector<PlanCandidate> chosen;
  std::vector<double> predicted = predict(cluster, &chosen);
  fmt::print("{} (peak {} TFLOP/s, GEMMs at {:.2f} of it, the attention core at {:.2f}, links at "
             "{:.2f}/{:.2f} of their bandwidth)\n\n",
             cluster.deviceName, cluster.peakTflops, cluster.achievedFraction,
             cluster.attentionFlopsPerMs() / (cluster.peakTflops * 1e9),
             cluster.intraNode.efficiency, cluster.interNode.efficiency);
  fmt::print("| model | GPUs | batch | t | p | published TFLOP/s | predicted | error | "
             "schedule, v, b (predicted best) |\n|---|---|---|---|---|---|---|---|---|\n");
  for (size_t i = 0; i < predicted.size(); ++i) {
    const Row &r = kTable1[i];
    const PlanCandidate &c = chosen[i];
    fmt::print("| {}B | {} | {} | {} | {} | {:.0f} | {:.1f} | {:+.1f}% | {}, v={}, b={} |\n",
               r.billions, r.gpus, r.batch, r.tp, r.pp, r.tflops, predicted[i],
               100 * (predicted[i] / r.tflops - 1), c.schedule, c.parallel.vpp, c.microbatchSize);
  }
  fmt::print("\nmean absolute error {:.1f}%\n", 100 * meanAbsError(predicted));
  if (!args->has("--planner"))
    return 0;
  // The planner's choice against the published layout in seconds per step: Table 1's
  // throughput is Eq. (3)'s FLOPs (recomputation included) per second, so its step time is
  // those FLOPs over the row's GPUs at the published rate; a plan without recomputation does
  // fewer FLOPs, so time, not FLOP/s, is what compares the layouts.
  fmt::print("\n| model | GPUs | published t, p | published step (s) | its predicted step (s) | "
             "planner's choice | its predicted step (s) |\n|---|---|---|---|---|---|---|\n");
  for (size_t i = 0; i < predicted.size(); ++i) {
    const Row &r = kTable1[i];
    PlannerOptions o;
    o.gpus = r.gpus;
    o.globalBatch = r.batch;
    o.recompute = {Recompute::None, Recompute::Full};
    o.top = 1;
    auto result = planLayouts(modelOf(r), cluster, o);
    if (!result)
      return fail(result.takeError());
    const PlanCandidate &c = result->candidates[result->ranked.front()];
    double published = megatronFlops(r) / (r.tflops * 1e12 * r.gpus);
    fmt::print("| {}B | {} | t={} p={} | {:.2f} | {:.2f} | {} t={} p={} v={} dp={} b={} "
               "recompute {} | {:.2f} |\n",
               r.billions, r.gpus, r.tp, r.pp, published, chosen[i].stepTime / 1000, c.schedule,
               c.parallel.tp, c.parallel.pp, c.parallel.vpp, c.parallel.dp, c.microbatchSize,
               toString(c.recompute).str(), c.stepTime / 1000);
  }
  return 0;
}
