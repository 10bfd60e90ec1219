//===- Calibration.h - Published training runs predicted by the one cost model -*- C++ -*-===//
//
// bench/data/published-runs.csv holds measured training throughput with the layout it was
// measured at (docs/calibration-sources.md says where each row comes from). Each usable run is
// compiled exactly as published (model shape, tp, pp, vpp, dp, microbatch size, global batch,
// schedule, recomputation, sequence parallelism, distributed optimizer, attention kernel) by
// compilePlan, the same passes and cost model `pipec compile` runs, and its predicted step
// time is set against the measured one. calibration_bench fits a cluster spec's factors on
// these runs and reports the leave-one-source-out error; tests/CalibrationTest.cpp checks the
// shipped specs against them.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_BENCH_CALIBRATION_H
#define PIPEC_BENCH_CALIBRATION_H

#include "compiler/Pass.h"
#include "ir/Model.h"
#include "ir/Plan.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/Support/Error.h"

#include <cassert>
#include <optional>
#include <string>
#include <vector>

namespace pipec {

/// What a run's software does that a cluster spec states for all its runs, where the run's
/// differs from the spec's (empty: the spec's).
struct RunSoftware {
  /// How it makes pipeline transfers ("p2p" of a cluster spec): "blocking" for DeepSpeed's
  /// pipeline engine.
  std::optional<P2p> p2p;
  /// When it reduces the dp gradients ("grad_reduce"): after the backward for Megatron-LM's
  /// local DDP (false), during it for PyTorch DDP (true).
  std::optional<bool> overlapGradReduce;
};

/// One measured run, ready to compile.
struct PublishedRun : RunSoftware {
  std::string source, id, device; // device: the CSV's gpu column ("A100-80GB", "H100-SXM")
  ModelSpec model;
  CompileOptions options;
  int64_t globalBatch = 0, gpus = 0;
  bool fp8 = false;
  /// The source gives the run's recomputation; where it does not, the run evidently fit in
  /// its devices' memory: none if the plan fits without it, else full.
  bool recomputePublished = true;
  /// The schedule as the source names it ("zb-1p", "interleaved-1f1b", ...).
  std::string publishedSchedule;
  /// k > 0 for a schedule the source searched under an activation limit of k·p·M_B (the
  /// zero-bubble paper's ZB-1p, k = 1, and ZB-2p, k = 2): compiled as zb-auto at the limit
  /// the authors' runtime sets, k · p · M_B, M_B the larger of the activations one
  /// microbatch's forward leaves on the first two stages.
  /// Its order depends on the cluster's costs, so re-timing it under other factors is not
  /// compiling it again (prepareRun searches again).
  int searchedLimit = 0;
  /// The measured step time in seconds (from whichever metric the source gives).
  double measuredSeconds = 0;
  std::string metric; // the metric it came from
  /// The peak memory per GPU the source reports, in bytes (0: none given).
  double measuredPeakBytes = 0;
};

/// A row of the file that was left out, and why (one line).
struct SkippedRow {
  std::string source, id, why;
};

/// Read the CSV: one PublishedRun per measured run (a run given in several metrics counts once:
/// step time, else tokens, else samples, else TFLOP/s; MFU and HFU restate one of those).
llvm::Error loadPublishedRuns(llvm::StringRef path, std::vector<PublishedRun> &runs,
                              std::vector<SkippedRow> &skipped);

/// The predicted step time of `run` on `cluster` in seconds. An FP8 run's model has
/// "gemm_precision": "fp8": its blocks' GEMMs run the cluster's fp8_gemm_speedup faster.
llvm::Expected<double> predictSeconds(const PublishedRun &run, const ClusterSpec &cluster);
/// `cluster` with a run's own transfer mode and gradient reduction where it has them.
ClusterSpec clusterFor(const RunSoftware &run, const ClusterSpec &cluster);

/// A run compiled once, to be timed again under other clusters. A published run's compute
/// order does not depend on the cluster's factors (its schedule is a fixed order, its stages
/// the published split, and whether it must recompute depends on memory alone), so a fit can
/// re-run the partition pass's costs and the simulate pass on the compiled plan instead of
/// compiling it for every candidate (calibration_bench checks that both agree). Two kinds of
/// run are exceptions (reordersWithCosts): a searched run (PublishedRun::searchedLimit), whose
/// order zb-auto searches under the costs, and a run with blocking transfers, whose step is the
/// executed step and so depends on where the comms pass put each receive, which it places by
/// the simulated compute timeline. Re-timed, they keep the order of the cluster they were
/// prepared under, so calibration_bench prepares them again after each fit.
struct PreparedRun : RunSoftware { // the run's
  Plan plan;
  ModelSpec model; // as compiled: the run's, or its full-recomputation fallback
  std::vector<int> stageEnds;
};
llvm::Expected<PreparedRun> prepareRun(const PublishedRun &run, const ClusterSpec &cluster);
/// Whether compiling `run` under another cluster may give other instruction streams (above).
bool reordersWithCosts(const PublishedRun &run, const ClusterSpec &cluster);
/// predictSeconds of the prepared run under `cluster`, without compiling it again.
llvm::Expected<double> retimedSeconds(PreparedRun &run, const ClusterSpec &cluster);

/// The throughput error of a prediction: predicted throughput / measured - 1, i.e. measured
/// step time / predicted - 1 (positive: pipec is too optimistic).
inline double throughputError(double measuredSeconds, double predictedSeconds) {
  return measuredSeconds / predictedSeconds - 1;
}

/// Whether `predicted` step times rank schedules as `measured` ones do: every pair the
/// measurement orders strictly, the prediction orders the same way. A tie in the published
/// numbers (two schedules at the same throughput to the digits printed) orders nothing, so
/// either predicted order agrees with it.
inline bool sameRanking(llvm::ArrayRef<double> measured, llvm::ArrayRef<double> predicted) {
  assert(measured.size() == predicted.size() && "one prediction per measurement");
  for (size_t a = 0; a < measured.size(); ++a)
    for (size_t b = 0; b < measured.size(); ++b)
      if (measured[a] < measured[b] && !(predicted[a] < predicted[b]))
        return false;
  return true;
}

} // namespace pipec

#endif // PIPEC_BENCH_CALIBRATION_H
