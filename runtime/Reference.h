//===- Reference.h - What every backend's run shares with the reference -*- C++ -*-===//
//
// The model a plan describes, the data of a step, the loss scale, the gradient snapshot a
// backend takes before its optimizer step, and the single-rank reference (all layers, all
// microbatches of every replica, whole sequences, tp = 1, on the CPU kernels of kernels/cpu)
// that `--check-reference` compares against. Every backend uses these (no backend includes
// another), so they all check against the very same thing; the training driver
// (runtime/Train.h) runs the reference.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_REFERENCE_H
#define PIPEC_RUNTIME_REFERENCE_H

#include "ir/Plan.h"
#include "kernels/cpu/Gpt.h"
#include "runtime/Checkpoint.h"
#include "runtime/Data.h"

#include <llvm/Support/Error.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace pipec {

/// AdamW settings of every backend.
constexpr float kAdamBeta1 = 0.9f, kAdamBeta2 = 0.95f, kAdamEps = 1e-8f, kAdamWeightDecay = 0.0f;

/// The model a plan describes, for the kernels; an InputError when the plan has no
/// transformer or its sizes do not fit the kernels.
llvm::Expected<kernels::GptConfig> gptConfigOf(const Plan &plan);

/// Layer `layer`'s whole (tp = 1) state `whole` cut for tp rank `tpRank` of `tp` into `stage`
/// (which holds the layer): its weights, and its AdamW moments where `whole` has them.
void loadLayerState(kernels::StageCompute &stage, const kernels::GptConfig &cfg, int layer,
                    int tpRank, int tp, const LayerState &whole);
/// The reverse: tp rank `tpRank`'s part of layer `layer` in `stage` written into its places in
/// `whole` (sized for the whole layer).
void storeLayerState(kernels::StageCompute &stage, const kernels::GptConfig &cfg, int layer,
                     int tpRank, int tp, LayerState &whole);

/// Tokens of one step for one dp replica: microbatch m is global microbatch
/// (step·dp + replica)·M + m, so replicas and the reference agree on the data.
std::vector<std::vector<int32_t>> stepBatch(const DataSource &data, const kernels::GptConfig &cfg,
                                            const ParallelConfig &pc, int step, int replica);
/// The plan's sub-sequences as the kernels take them.
std::vector<std::pair<int, int>> slicesOf(const Plan &plan);
/// 1 / tokens of the global batch: summed gradients are those of the mean loss.
float lossScaleOf(const Plan &plan, const kernels::GptConfig &cfg);

/// A value for every parameter of dp replica 0, per (stage, tp rank), in the stage's layout
/// (the rank's shards): the gradients of a step as the optimizer will see them, or the weights
/// after the last step.
struct ParamSnapshot {
  std::mutex mu;
  std::map<std::pair<int, int>, std::vector<float>> byStageAndTp;
  /// With the weights: weightDigest() of every dp replica's, per (replica, stage, tp rank), so
  /// that the check can tell whether the replicas hold the same weights bit for bit.
  std::map<std::tuple<int, int, int>, uint64_t> digests;
  /// Moves the values into `to` (TrainBackend::takeGradients), leaving none here.
  void handOver(ParamSnapshot &to) {
    to.byStageAndTp = std::move(byStageAndTp);
    byStageAndTp.clear();
  }
};

/// A 64-bit digest of `values`' bits (FNV-1a over their bytes): equal for equal bits, and for
/// any other bits equal only by a 2^-64 chance.
uint64_t weightDigest(std::span<const float> values);

/// Where the largest gradient difference of a reference check was: the step, the stage and tp
/// rank that computed it, the layer, and the parameter (kernels::paramName). step < 0: none yet.
struct GradDiffPlace {
  int step = -1;
  int stage = 0, tpRank = 0, layer = 0;
  std::string param;
  double got = 0, want = 0;
};

/// What --check-reference found, over every step so far: the largest difference of any
/// gradient and the largest reference gradient (the tolerances are fractions of it), and,
/// tensor by tensor, the largest difference as a fraction of the tensor's own largest reference
/// gradient (at least 1e-3 of the step's largest), which a wrong tensor with small gradients
/// cannot hide in. Both with their places.
struct GradCheck {
  double maxAbsDiff = 0;
  double scale = 0;
  GradDiffPlace worst;
  double maxTensorDiff = 0;
  GradDiffPlace worstTensor; // the worst element of that tensor
};

/// What --check-reference prints for `check`, a line each: "max_abs_grad_diff=..." (with the
/// largest reference gradient), "largest difference: <place>" (when there is one) and
/// "max_tensor_grad_diff=...[: <place>]".
std::string gradCheckReport(const GradCheck &check);
/// A finding (ir/support/Error.h; exit 1) when `check` exceeds `relative` of its scale or
/// `perTensor` of a tensor's own, in one line naming the tolerance and, per tensor, the tensor and
/// where it is; success otherwise.
llvm::Error judgeGradCheck(const GradCheck &check, double relative, double perTensor);

/// The per-tensor tolerances of every backend's check: fp32 (observed on the emulated device:
/// up to 1e-6, the CPU loops and the GPU kernels summing in other orders), and bf16 against the
/// fp32 reference (observed: up to 3e-2, a layernorm weight's or wpe's gradient).
inline constexpr double kTensorGradTolerance = 1e-3;
inline constexpr double kBf16TensorGradTolerance = 0.15;

/// What --check-reference found in the weights after the last step: the run's (fp32 master
/// weights in every compute type) against the reference's, which took the same AdamW steps on
/// the same (adopted) gradients. Each weight may differ by weightBound(): the two optimizers
/// round alike but for fused multiply-adds (about 1e-7 of an update), while a wrong optimizer
/// step (beta1, bias correction, lr, the weight decay, a skipped tensor) moves some weight by a
/// fair part of lr. With tp > 1, a tensor every tp rank holds whole is compared on the rank
/// whose gradients adopt() took (adoptedTpRank), and every other rank's copy must equal that
/// one to the last bit (`tpCopy`): each rank computed the tensor's gradients from the same
/// inputs, and the kernels' sums do not depend on scheduling, so copies that differ at all have
/// begun to drift apart (AdamW turns a last-bit difference of a near-zero gradient, under its
/// eps, into a sizeable part of lr). `worst` is the weight nearest its bound.
struct WeightCheck {
  int steps = 0;              // the optimizer steps both took; 0: not checked
  double maxRatio = 0;        // the largest difference as a fraction of its weight's bound
  double diff = 0, bound = 0; // at `worst`
  GradDiffPlace worst;        // got, want: the weights; step: the last step
  int tp = 1;                 // > 1: the tp copies were compared
  /// The first weight whose tp copies differ: got is tp rank tpRank's, want adoptedTpRank's.
  /// step < 0: none.
  GradDiffPlace tpCopy;
  int dp = 1; // > 1: the dp replicas' weights were compared (ParamSnapshot::digests)
  /// The first (stage, tp rank) where a dp replica's weights are not replica 0's bit for bit
  /// (or it reported none); replica < 0: none.
  struct Replica {
    int replica = -1, stage = 0, tpRank = 0;
    bool missing = false; // the replica reported no digest (its process failed; it says why)
  } dpCopy;
};
inline constexpr double kWeightLrTolerance = 1e-3, kWeightLrPerStep = 1e-5;
inline constexpr double kWeightRelTolerance = 0x1p-20; // 8 units in the last place of an fp32
/// How far the run's weight may be from the reference's `w` after `steps` AdamW steps at `lr`:
/// 1e-3 of lr, plus per step 1e-5 of lr and 2^-20 of the weight (its rounding). A skipped or
/// wrong last step moves a weight by about lr, which this stays well under up to thousands of
/// steps.
inline double weightBound(double w, int steps, double lr) {
  return lr * (kWeightLrTolerance + kWeightLrPerStep * steps) +
         steps * kWeightRelTolerance * (w < 0 ? -w : w);
}
/// The tp rank whose copy of a tensor every rank holds whole adopt() takes: the last.
inline int adoptedTpRank(int tp) { return tp - 1; }
/// The first value in `snapshot` of a tensor every tp rank holds whole (layernorms, row-parallel
/// biases, wpe, the final layernorm) where a tp rank's copy is not bit for bit adoptedTpRank()'s:
/// got is that rank's, want adoptedTpRank()'s, step `step`. step < 0: every copy agrees (or
/// tp = 1).
GradDiffPlace firstTpCopyMismatch(const Plan &plan, const kernels::GptConfig &cfg,
                                  const ParamSnapshot &snapshot, int step);

/// "max_weight_diff=<ratio> of the bound ...[: <place>]", a line; with tp > 1 another,
/// "tp_copies=identical ..." or "tp_copies=differ: <place>"; with dp > 1 another,
/// "dp_copies=identical ..." or "dp_copies=differ: ...".
std::string weightCheckReport(const WeightCheck &check);
/// A finding (exit 1) when a weight is past its bound, or else when its tp copies differ, or
/// else when a dp replica's weights differ from replica 0's, naming where; success otherwise.
llvm::Error judgeWeightCheck(const WeightCheck &check);

/// What piperun prints for --check-reference after the reference's loss (gradCheckReport, then
/// weightCheckReport), and its verdict: the gradients' finding if any, else the weights'.
std::string referenceCheckReport(const GradCheck &grads, const WeightCheck &weights);
llvm::Error judgeReferenceCheck(const GradCheck &grads, const WeightCheck &weights, double relative,
                                double perTensor);

/// The single-rank reference run.
class ReferenceRun {
public:
  ReferenceRun(const Plan &plan, const kernels::GptConfig &cfg, const DataSource &data,
               uint64_t seed, float lr);
  /// One step's forwards and backwards; returns its loss. Gradients stay until update().
  double step(int index);
  /// Folds step `step`'s differences between `snapshot` and the reference into `check`. A NaN
  /// or infinite gradient, on either side, counts as an infinite difference (and not towards
  /// the scale).
  void compare(const ParamSnapshot &snapshot, GradCheck &check, int step);
  /// Replaces this step's reference gradients by the run's (every stage and tp rank of the
  /// snapshot), so that update() takes the step the run takes and the next step starts from
  /// the run's weights. Every backend's check does this after compare(), so that each step
  /// compares the gradients of the same weights. Left to train on its own, the reference
  /// drifts: AdamW's first steps move every weight by about lr whatever the size of its
  /// gradient, so a near-zero gradient whose sign another summation order (or bf16) flips puts
  /// the two runs on different weights, and later steps compare different models. A wrong
  /// optimizer step in the run still shows: in the next step's gradients, and after the last
  /// step in compareWeights(). Of a tensor every tp rank holds whole, it takes the copy of
  /// adoptedTpRank().
  void adopt(const ParamSnapshot &snapshot);
  /// The optimizer step.
  void update();
  /// The run's weights `weights` after `steps` optimizer steps against the reference's after as
  /// many update()s. A NaN or infinite weight on either side is infinitely far off. With dp > 1,
  /// every replica's digest must be replica 0's (whose weights `weights` holds).
  WeightCheck compareWeights(const ParamSnapshot &weights, int steps);
  /// The reference's one stage (all layers, tp = 1), e.g. to load a checkpoint into.
  kernels::StageCompute &stage() { return sc; }

private:
  const Plan &plan;
  const kernels::GptConfig &cfg;
  const DataSource &data;
  float lr;
  kernels::StageCompute sc;
};

} // namespace pipec

#endif // PIPEC_RUNTIME_REFERENCE_H
