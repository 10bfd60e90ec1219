//===- CostModel.h - docs/contracts.md#semantics' timing and memory rules, in one place -*- C++
//-*-===//
//
// How long an op takes, when it may start, when its output reaches another rank, and what it
// allocates and frees. The simulator (compiler/: the simulate and memory passes, comm
// lowering's global order) and zb-auto's search (schedules/ZBAuto.cpp) both run these rules,
// so that a schedule searched for one cost model is scored by the same one. It lives below
// schedules/ (ir <- schedules <- compiler) for that reason.
//
// Timing (docs/contracts.md#semantics):
//  - each rank runs its compute ops (and tp all-reduces, which occupy it: Megatron's are
//    synchronous) one at a time in stream order; an op starts at the later of the end of the
//    rank's previous op and the arrival of each input (ir/Semantics.h says which inputs);
//  - a cross-rank input arrives a transfer time after its producer ends (a fused backward
//    sends its gradient at its end); same-rank inputs are free; sends and recvs overlap
//    compute and cost nothing here;
//  - a compute op split at tp all-reduces takes an equal share of its time per part;
//  - dp and embedding all-reduces run on their own stream, one after another, each after
//    what precedes it in the stream; a dp all-reduce takes the stage's dp_allreduce_time
//    (the tied-embedding one is not timed: one matrix between two ranks). With the plan's
//    overlapGradReduce a dp all-reduce may start with the stage's last backward (the op
//    before it) and ends no sooner than that op's end plus one layer's share of its time.
// Memory (docs/contracts.md#semantics, activations; it depends only on stream order):
//  - F(s,m,k) allocates activation_bytes[k] of stage s at its start (its first part);
//  - every compute op holds its stage's workspace_bytes[k] while it runs, and a backward
//    (input-gradient or fused) also holds backward_peak_bytes[k] (at least weight_grad -
//    activation bytes: what it builds for the weight gradient) at its last part, a fused one
//    fused_backward_peak_bytes[k] instead where the stage has them;
//  - at its end (last part) a backward_input frees activation - weight_grad bytes (so keeps
//    weight_grad bytes for W, allocating the difference when that is larger), a
//    backward_weight the remaining weight_grad bytes, a fused backward all of them;
//  - with sub-sequences, a microbatch's state shared by its slices: the first backward of the
//    microbatch (slice K - 1) allocates sequence_grad_bytes (dK/dV) at its start; the backward
//    of a slice k > 0 does not free sequence_kv_bytes[k] of its activations (K/V); the
//    backward of slice 0, the microbatch's last, frees both.
// The memory pass (which the planner's scoring runs too) and zb-auto's greedy run these.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_IR_COSTMODEL_H
#define PIPEC_IR_COSTMODEL_H

#include "ir/Plan.h"
#include "ir/Semantics.h"

#include "llvm/Support/Error.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace pipec {

//===----------------------------------------------------------------------===//
// Per-op rules
//===----------------------------------------------------------------------===//

/// Time of a whole compute op of `stage` on slice `slice` (0 for any other op).
double opTime(const StageInfo &stage, OpKind op, int slice);

/// Duration of one part of a compute op (its whole time when unsplit); 0 for other ops.
double computeTime(const Plan &plan, const Instruction &i);

/// Duration of a tp all-reduce, which occupies its rank.
double tpAllReduceTime(const Plan &plan, const Instruction &i);

/// How long `tensor` of `producer`'s slice `slice` takes to reach the rank of the stage that
/// consumes it (0 when that stage lives on the producer's rank).
double transferTime(const StageInfo &producer, TensorKind tensor, int slice);

/// Activation bytes compute op `i` of `stage` allocates at its start.
int64_t activationAllocatedAtStart(const StageInfo &stage, const Instruction &i);
/// Activation bytes compute op `i` of `stage` frees at its end.
int64_t activationFreedAtEnd(const StageInfo &stage, const Instruction &i);
/// Bytes op `i` holds while it runs on top of the running total (after what it allocated at
/// its start): its stage's workspace_bytes on every part, and on the last part of a backward
/// (input-gradient or fused) what it builds before it frees: backward_peak_bytes, at least
/// weight_grad - activation bytes (a fused one fused_backward_peak_bytes where the stage has
/// them).
int64_t activationHeldWhileRunning(const StageInfo &stage, const Instruction &i);
/// The most one microbatch of slice `slice` holds at once, workspace aside: its activations
/// plus what its backward adds while it runs (which covers what it keeps for W after it): an
/// input-gradient backward's, or with `fusedBackward` a fused one's.
int64_t activationLifetimePeak(const StageInfo &stage, int slice, bool fusedBackward = false);
/// The workspace every compute op of slice `slice` of `stage` holds while it runs.
int64_t workspaceBytes(const StageInfo &stage, int slice);

//===----------------------------------------------------------------------===//
// The timed simulation of a plan's streams
//===----------------------------------------------------------------------===//

struct OpTime {
  double start = 0, end = 0;
};

struct Timeline {
  /// ops[r][i]: when instruction i of rank r runs (zero-length for sends, recvs, optimizer).
  std::vector<std::vector<OpTime>> ops;
  /// depth[r][i]: longest chain of compute ops ending at instruction i (compute ops only);
  /// a producer's depth is always below its consumer's, even when times tie.
  std::vector<std::vector<uint32_t>> depth;
};

/// Run the timing model on every rank's stream (compute-only streams too, as a policy emits
/// them). A Finding if some rank waits for an input that never comes (the compute order is
/// not executable: a cycle, or a producer missing).
llvm::Error simulateTimeline(const Plan &plan, Timeline &out);

/// When the dp and embedding all-reduces of rank `rank` run on their own stream (the rule
/// above); zero-length entries for every other instruction.
std::vector<OpTime> collectiveTimes(const Plan &plan, const Timeline &t, size_t rank);

/// A completion time not reached yet (the `done` tables of simulateTimeline and its callers).
constexpr double kNotDone = -1.0;

/// When compute op `ins` of rank `rank` may start: the latest of `ready` (its rank's clock)
/// and each input's arrival, done[key] plus the transfer time when its producer is on another
/// rank. `onInput(key)` sees every input that is done. Returns the key of the first input not
/// done yet, SIZE_MAX when all are (then `ready` is the start).
template <typename OnInput>
size_t inputsReady(const Plan &plan, const KeySpace &keys, const std::vector<double> &done,
                   const Instruction &ins, size_t rank, double &ready, OnInput onInput) {
  size_t missing = SIZE_MAX;
  forEachInput(plan, ins, [&](const Input &in) {
    if (missing != SIZE_MAX)
      return;
    size_t key = keys.key(in.stage, in.mb, in.slice, in.slot);
    if (done[key] == kNotDone) {
      missing = key;
      return;
    }
    double arrival = done[key];
    if (plan.rankOf(in.stage) != int(rank))
      arrival += transferTime(plan.stages[size_t(in.stage)], in.tensor, in.slice);
    ready = std::max(ready, arrival);
    onInput(key);
  });
  return missing;
}

/// One rank's share of a step: compute time, first compute start, last compute end, when
/// its dp all-reduces are done (at least `end`), and its optimizer step's time.
struct RankSpan {
  double busy = 0, start = 0, end = 0, stepEnd = 0, optimizer = 0;
};
struct StepFigures {
  double makespan = 0, stepTime = 0, bubbleRatio = 0;
};
/// The optimizer step's time on pipeline rank `rank`: its stages' optimizer_time.
double rankOptimizerTime(const Plan &plan, size_t rank);
/// docs/contracts.md#semantics' step figures from every rank's span: makespan = last end - first
/// start, bubble_ratio = 1 - mean(busy) / max(span), and step_time, the period of steady training:
///  - without the optimizer step timed (no optimizer_time, no sync): last step end - first
///    start;
///  - otherwise, without post-validation: every rank waits for the last step end, the
///    pipeline-wide check (optimizer_sync_time), then steps; the next step starts when the
///    slowest optimizer step ends: last step end + sync + max(optimizer) - first start;
///  - with post-validation: each rank steps at its own step end and starts the next step's
///    first op that long after (the timeline repeats, shifted by the period), so the period is
///    max over ranks of (step end + optimizer - first compute start).
StepFigures stepFigures(const Plan &plan, const std::vector<RankSpan> &ranks);

/// The step as piperun executes the plan's lowered streams, under the same per-op times: every
/// instruction in stream order, one at a time; a group of sends and recvs (or a lone one) blocks
/// its rank until every op of it has met its partner (a send and a recv meet when both are
/// posted; the exchange is a rendezvous) and its transfer is done; tp and dp all-reduces and the
/// optimizer step occupy their rank; the tied-embedding all-reduce waits for both of its ranks.
/// The step time is the last rank's end, all starting at 0. Unlike simulateTimeline, a send
/// that waits for its receiver delays its own rank (runtime/Interpreter.h). A Finding if the
/// exchanges cannot complete (a plan that fails verification).
llvm::Expected<double> simulateExecutedStep(const Plan &plan);

/// The simulate pass: the timeline of the plan's streams and its summary (below); with the
/// plan's blockingP2p, step_time is the executed step (simulateExecutedStep) plus the
/// pipeline-wide check before the optimizer where the schedule does not post-validate. The
/// timeline goes to `timeline` when given.
llvm::Error simulateStep(Plan &plan, Timeline *timeline = nullptr);

/// Fill plan.stats' timing fields from a timeline: busy_r (compute time), span_r (first
/// compute start to last compute end), makespan, bubble_ratio = 1 - mean(busy) / max(span),
/// and step_time (what the dp all-reduces add past the last compute).
void summarizeTimeline(const Plan &plan, const Timeline &t, PlanStats &stats);

} // namespace pipec

#endif // PIPEC_IR_COSTMODEL_H
