//===- Partition.h - Layers into stages, as the partition pass does it -*- C++ -*-===//
//
// The partition pass's pieces, for callers that build many stage tables of one model (the
// planner, compiler/Planner.h): the same functions the pass runs, so a stage table built here
// is the one `pipec compile` builds for the same configuration, bit for bit.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_COMPILER_PARTITION_H
#define PIPEC_COMPILER_PARTITION_H

#include "ir/Model.h"
#include "ir/Plan.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/Support/Error.h"

#include <cstdint>
#include <optional>
#include <vector>

namespace pipec {

/// Whole-sequence time (F + B + W) of every layer of `model` on one of `tp` ranks (of `cp`
/// context-parallel ones): what the partition balances.
std::vector<double> layerTimes(const ModelSpec &model, const ClusterSpec &cluster, int64_t seq,
                               int tp, int cp = 1);

/// An InputError when `times` (layerTimes of `model`) do not add up to a finite number: rates
/// too small for the model, which would split and simulate infinities.
llvm::Error checkLayerTimesAddUp(const ModelSpec &model, llvm::ArrayRef<double> times);

/// Split `cost` into `parts` contiguous non-empty ranges of least maximum sum (then least sum of
/// squares, then earliest cuts); returns the end of each range. Needs parts <= cost.size().
std::vector<int> exactPartition(llvm::ArrayRef<double> cost, int parts);

/// What --partition even divides among the stages: a transformer's blocks (its layer list less
/// the embedding and the head), an abstract model's layers.
int64_t evenSplitUnits(const ModelSpec &model);

/// The even split Megatron-LM and NeMo make by default (`--partition even`): the same number of
/// transformer blocks in every stage, the embedding with the first and the head with the last;
/// with `unitsRule`, the embedding and the head count as a block each (the zero-bubble paper's,
/// BLOOM's and Llama 3's split). An abstract model's layers split evenly. Each stage's end in
/// `model`'s layer list; none when the blocks (units) do not divide into `stages`.
std::optional<std::vector<int>> evenStageEnds(const ModelSpec &model, int stages,
                                              bool unitsRule = false);

/// Fill plan.stages for plan.parallel, plan.placement and plan.seqSlices: stage s holds the
/// layers [ends[s-1], ends[s]) with their per-slice costs, bytes and transfer times.
void buildStages(Plan &plan, const ModelSpec &model, const ClusterSpec &cluster,
                 llvm::ArrayRef<int> ends);
/// The same with `costs`, layerSliceCosts' table for plan.parallel and plan.seqSlices: the
/// stage sums do not depend on the layout past tp, sequence parallelism and the slices, so a
/// caller that builds many stage tables (the planner) computes the table once for them all.
void buildStages(Plan &plan, const ModelSpec &model, const ClusterSpec &cluster,
                 llvm::ArrayRef<int> ends, llvm::ArrayRef<SliceCost> costs);
/// model.sliceCost of every layer for every slice of `slices` under pc's tp and sequence
/// parallelism: entry l * slices.size() + i is layer l's slice i.
std::vector<SliceCost> layerSliceCosts(const ModelSpec &model, const ClusterSpec &cluster,
                                       const ParallelConfig &pc,
                                       llvm::ArrayRef<std::pair<int64_t, int64_t>> slices);

/// The seq-split pass's token ranges: K equal ranges for an abstract model; for a transformer,
/// boundaries on multiples of tp where a block's predicted F + B + W time under `cluster` is
/// the same for every slice (as far as tp's token granularity allows), or, without a cluster,
/// the Seq1F1B paper's rule: equal forward FLOPs. An InputError when K slices do not fit the
/// sequence.
llvm::Error seqSlicesFor(const ModelSpec &model, int seqSplits, int tp,
                         std::vector<std::pair<int64_t, int64_t>> &out,
                         const ClusterSpec *cluster = nullptr, bool sequenceParallel = false);
/// seqSlicesFor for `pc` (its seq_splits, tp, sequence parallelism and split rule).
llvm::Error seqSlicesFor(const ModelSpec &model, const ClusterSpec &cluster,
                         const ParallelConfig &pc, std::vector<std::pair<int64_t, int64_t>> &out);

} // namespace pipec

#endif // PIPEC_COMPILER_PARTITION_H
