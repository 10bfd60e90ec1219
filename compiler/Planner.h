//===- Planner.h - pipec plan: the best layout and schedule for a cluster -*- C++ -*-===//
//
// Given a model, a cluster and a number of GPUs, the planner enumerates every layout that fits:
// tensor-parallel size tp (dividing the heads, the MLP's hidden size and the vocabulary; within
// a node unless allowed across), pipeline size pp, data-parallel size dp = GPUs / (tp·pp),
// microbatch size b and count m with dp·m·b = the global batch, virtual stages and sequence
// splits where a schedule takes them, every schedule whose constraints the layout meets, and
// with each of them activation recomputation (none, selective, full), sequence parallelism
// (tp > 1) and ZeRO-1 (dp > 1), each searched unless fixed; pp 1 is one candidate, no pipeline
// (1f1b at vpp 1, one slice). It keeps the layouts whose worst rank's peak memory fits the
// device with --min-headroom left free, simulates each, and ranks them by step time. With
// --costs, the measured times score the candidates the file covers (coversCandidate).
//
// How (the "fast"):
//   - no JSON and no verification per candidate: the stage table comes from the partition
//     pass's own functions (compiler/Partition.h, partitions cached per model variant, tp and
//     stage count), the order from the schedule policy, and step time and memory (receive
//     buffers included) from evaluateOrder (compiler/Evaluate.h), which runs compile's own
//     lowering, memory and simulate passes: the figures are compile's, not a mirror's;
//   - bounds before scheduling: a memory lower bound (a rank's static bytes plus the most one
//     of its microbatches holds) drops a layout that cannot fit; a step-time lower bound (the
//     busiest rank's compute and tp all-reduces, after the pipeline fill before it) prunes a
//     layout that cannot enter the top K found so far;
//   - bounds of the order, before it is lowered and simulated: the memory pass on the
//     compute-only streams (compile's peak less the receive buffers) and the compute-only
//     timeline with all but the last tp all-reduce of each op folded in, then the dp
//     all-reduces and the optimizer step (no op starts later than in compile's simulation);
//   - stage tables summed from every layer's slice costs (layerSliceCosts, compiler/Partition.h),
//     computed once per model variant, tp, sequence parallelism and slicing;
//   - candidates run in waves over the machine's cores, best lower bound first; the threshold
//     for pruning changes only between waves, so what is pruned, and so the whole result, does
//     not depend on the threads' timing;
//   - the candidates that may enter the top K are compiled in full (compilePlan, verification
//     included), and only compiled plans are ranked.
// Ties are broken by the order candidates are enumerated in: recompute, tp, pp, microbatch
// size, schedule as listed, vpp, seq splits, sequence parallelism (off first), ZeRO-1 (off
// first).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_COMPILER_PLANNER_H
#define PIPEC_COMPILER_PLANNER_H

#include "ir/Model.h"
#include "ir/Plan.h"
#include "ir/formats/Costs.h"

#include "llvm/Support/Error.h"

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace pipec {

/// The most instructions (compiler/Budget.h's instructionBound) of a candidate the planner
/// orders and simulates; a larger one (tens of thousands of microbatches) is dropped with its
/// reason, and `pipec compile` still builds it alone.
constexpr uint64_t kPlannerMaxInstructions = uint64_t(1) << 22;

/// --min-headroom's default: this percentage of the memory limit is kept free.
constexpr int kDefaultHeadroomPercent = 5;

/// The schedule column's label for a layout without pipeline parallelism (pp 1): one
/// candidate, compiled as `1f1b` (each microbatch's forward, then its backward; what
/// `pipec compile --pp 1 --schedule 1f1b` builds).
constexpr const char *kNoPipelineLabel = "no-pipeline";

struct PlannerOptions {
  int gpus = 0;
  /// Sequences per step (transformer models) or microbatches per step (abstract models).
  int64_t globalBatch = 0;
  /// Schedule names to consider; empty: every registered schedule.
  std::vector<std::string> schedules;
  /// Bytes per GPU a plan may use; 0: the cluster device's memory.
  int64_t memoryLimit = 0;
  /// Bytes of that limit every ranked plan must leave free (so that the top plan is not at the
  /// edge); negative: kDefaultHeadroomPercent of the limit. 0 lets a plan use it all.
  int64_t minHeadroom = -1;
  /// The percentage of the limit kept free where minHeadroom is negative (--min-headroom P%).
  double minHeadroomPercent = kDefaultHeadroomPercent;
  int top = 5;
  /// Let tp exceed a node's GPUs (tensor-parallel all-reduces then cross the inter-node links).
  bool tpAcrossNodes = false;
  /// --partition even: every candidate split as Megatron-LM splits layers by default (the same
  /// blocks in every stage; evenStageEnds), layouts whose stages do not divide the blocks
  /// dropped for divisibility; false: pipec's balanced partition.
  bool evenPartition = false;
  /// Sequence parallelism and the distributed optimizer (ZeRO-1): unset, both settings are
  /// searched where they apply (sequence parallelism with tp > 1, ZeRO-1 with dp > 1); set,
  /// every candidate has that setting (--sequence-parallel / --no-sequence-parallel, ...).
  std::optional<bool> sequenceParallel, distributedOptimizer;
  /// Tensor- and pipeline-parallel sizes to try; empty: every divisor that fits.
  std::vector<int> tpSizes, ppSizes;
  /// Context-parallel sizes to try (--cp; transformer models, without sub-sequences): each
  /// divides the GPUs left over tp. Not searched unless listed.
  std::vector<int> cpSizes = {1};
  /// Recomputation settings to try; empty: none, selective (materialized attention only: with
  /// flash attention it changes nothing) and full, or, with costs, the model's own.
  std::vector<Recompute> recompute;
  /// --costs: measured times (ir/formats/Costs.h) in place of the cost model's for the candidates
  /// the file covers (coversCandidate); `costsSource` names it in messages.
  std::shared_ptr<const MeasuredCosts> costs;
  std::string costsSource;
  /// Microbatch sizes to try; empty: every divisor of the per-replica batch up to
  /// maxMicrobatchSize (transformer models; an abstract model's microbatch is its unit).
  std::vector<int64_t> microbatchSizes;
  int64_t maxMicrobatchSize = 16;
  /// Sequence splits to try with the schedules that take them.
  std::vector<int> seqSplits = {1, 2, 4, 8};
  /// Most virtual stages per rank to try with the schedules that take several.
  int maxVpp = 8;
  /// Worker threads; 0: the machine's cores.
  unsigned threads = 0;
};

/// What became of a candidate.
enum class Outcome : uint8_t {
  Ranked,       // among the top K
  Fits,         // fits in memory, simulated, not among the top K
  Memory,       // its worst rank needs more than the limit
  Divisibility, // tp, the batch or the layer count does not divide as the layout needs
  Constraint,   // a schedule's constraint (its --vpp, --seq-splits, --microbatches rules)
  Pruned,       // its step-time lower bound could not beat the K-th best
};
llvm::StringRef toString(Outcome o);

struct PlanCandidate {
  Recompute recompute = Recompute::None;
  /// pp, vpp, tp, dp, microbatches, seq splits.
  ParallelConfig parallel;
  int64_t microbatchSize = 1;
  std::string schedule;

  Outcome outcome = Outcome::Divisibility;
  /// For a drop: one line saying why.
  std::string why;
  /// Simulated (Ranked, Fits and some Memory candidates). bubble: the share of the step a
  /// rank computes nothing, averaged over ranks: 1 - mean(busy) / stepTime (so that
  /// stepTime · (1 - bubble) is the mean rank's compute time).
  bool simulated = false;
  double stepTime = 0, bubble = 0;
  /// Lower bound of the step time (0 when not computed): the layout's, raised by its order's
  /// once the order is built.
  double stepTimeBound = 0;
  /// Peak memory of the worst rank: exact (what `pipec compile` states, receive buffers
  /// included) when peakExact, i.e. when evaluated or compiled; else a lower bound: for a
  /// layout dropped before scheduling, static bytes plus the most one microbatch holds; for
  /// one dropped by its order, the memory pass's peak on the compute-only streams.
  int64_t peakMemoryBytes = 0;
  int worstRank = 0;
  bool peakExact = false;
  /// Compiled in full (and verified) by compilePlan.
  bool compiled = false;
  /// The activation budget zb-auto ran under (0 for other schedules, and for a zb-auto layout
  /// dropped before it was scheduled).
  int64_t zbAutoLimit = 0;
  /// zb-auto: the least activation budget it takes (one microbatch of the heaviest stage).
  int64_t zbAutoLeast = 0;
  /// Scored with the --costs file's measured times (else the cost model's).
  bool measured = false;
  /// Dropped (Constraint) for having more than kPlannerMaxInstructions.
  bool tooLarge = false;
};

struct PlannerResult {
  /// Every candidate, in enumeration order.
  std::vector<PlanCandidate> candidates;
  /// The top K, best first: indices into candidates.
  std::vector<size_t> ranked;
  /// Bytes every ranked plan leaves free of memoryLimit (--min-headroom, resolved).
  int64_t minHeadroom = 0;
  /// The best candidate's compiled, verified plan (empty when nothing fits).
  Plan best;
  int64_t memoryLimit = 0;
  /// The tokens one step trains; 0 for abstract models. (A ranked entry's model FLOPs and
  /// throughput: stepThroughput.)
  int64_t tokensPerStep = 0;
};

/// For a process that plans (pipec, plan_bench): each evaluated candidate builds and drops
/// megabytes of lowered streams and timelines, and glibc's malloc returns freed memory at the top
/// of its heap to the system past a small threshold, so every candidate faults the same pages in
/// again (a fifth of the search's time for a 175B model). This keeps up to 1 GiB of freed memory
/// in the process instead. Process-wide, so the library never calls it itself: the executable
/// decides (the Python module does not).
void keepFreedMemoryForPlanning();

/// Search. An InputError for bad input (no layout of that many GPUs, a global batch no layout
/// divides, --tp or --pp values no layout can use, an unknown schedule), naming the flag at
/// fault and the nearest valid value, found by arithmetic on the divisibility rules (never by
/// searching again); a Finding when layouts exist but none fits in memory, naming what
/// `pipec compile` reports for the closest and a --memory-limit under which it fits.
llvm::Expected<PlannerResult> planLayouts(const ModelSpec &model, const ClusterSpec &cluster,
                                          const PlannerOptions &options);

/// The schedule as the table and the CSV show it: kNoPipelineLabel for pp 1.
std::string scheduleLabel(const PlanCandidate &c);

/// The headroom PlannerOptions' `minHeadroom` (or, where it is negative, `percent` of the
/// limit) resolves to under `limit`, and the least --memory-limit under which a plan peaking at
/// `peak` bytes keeps it.
int64_t headroomFor(int64_t minHeadroom, double percent, int64_t limit);
int64_t limitThatFits(int64_t minHeadroom, double percent, int64_t peak);

/// The `pipec compile` flags that build candidate `c` (less --model and --cluster): its schedule
/// (1f1b for no-pipeline), parallel sizes, recomputation, a `transformer`'s microbatch size,
/// sequence parallelism, distributed optimizer, zb-auto's --memory-limit and, where it was
/// scored with them, --costs.
std::string compileFlags(const PlanCandidate &c, const PlannerOptions &options, bool transformer);

/// Whether `costs` covers candidate `c`: its stage count (pp x vpp), sub-sequences and, where
/// the file lists ranks, its pipeline ranks are the profiled plan's. (The tp, microbatch size,
/// recomputation and switches, which the file does not record, are fixed by the options.)
bool coversCandidate(const MeasuredCosts &costs, const PlanCandidate &c);

/// Every candidate as CSV, one row each, a header first.
std::string plannerCsv(const ModelSpec &model, const ClusterSpec &cluster,
                       const PlannerOptions &options, const PlannerResult &result);

/// The model with microbatch size `b` and recomputation `r` (a transformer's; an abstract
/// model is returned as it is): what a candidate compiles.
ModelSpec modelVariant(const ModelSpec &model, int64_t microbatchSize, Recompute recompute);

} // namespace pipec

#endif // PIPEC_COMPILER_PLANNER_H
