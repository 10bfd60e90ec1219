//===- CpuRun.h - The cpu backend: real fp32 math on threads ----*- C++ -*-===//
//
// Every rank (pipeline x dp x tp) is a thread running the plan with the CPU reference kernels
// (kernels/cpu/Gpt.h). With checkReference the same steps also run on one rank without
// pipelining (all layers, all microbatches of all replicas, whole sequences, tp = 1), and the
// gradients of every step are compared before the optimizer applies them, and the weights after
// the last step.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_CPU_CPURUN_H
#define PIPEC_RUNTIME_CPU_CPURUN_H

#include "ir/Plan.h"
#include "kernels/cpu/Gpt.h"
#include "runtime/Data.h"
#include "runtime/Checkpoint.h"
#include "runtime/Interpreter.h"
#include "runtime/cpu/Reference.h"

#include <functional>
#include <string>
#include <vector>

namespace pipec {

struct CpuRunOptions {
  int steps = 1; // steps of this run (0: build every rank's stages, load any checkpoint, stop)
  uint64_t seed = 1;
  float lr = 1e-3f;
  bool checkReference = false;
  double timeoutSeconds = 60;
  Faults faults;
  // Checkpoints (runtime/Checkpoint.h). With `resume`, the run starts at its step, from its
  // weights and optimizer state (and the reference with them); with `saveDir`, it saves after
  // every saveEvery-th step (counted from step 0; 0: none but the last) and after its last.
  const Checkpoint *resume = nullptr;
  std::string saveDir;
  int saveEvery = 0;
  /// Called with the step count and the directory of each checkpoint once it is committed.
  std::function<void(int, const std::string &)> onSaved;
  /// Initial weights (`piperun --init-from`, runtime/SafeTensors.h): every layer whole
  /// (tp = 1), in place of the seeded initialisation; each rank and the reference take their
  /// parts. Null: the seeded initialisation.
  const std::vector<std::vector<float>> *initWeights = nullptr;
  /// The data source as a checkpoint records it: "synthetic" or "file <name> <bytes>".
  std::string dataName = "synthetic";
};

struct CpuRunResult {
  std::vector<double> losses;          // global mean loss per step
  std::vector<double> referenceLosses; // with checkReference
  GradCheck grads;                     // with checkReference, over all steps
  WeightCheck weights;                 // with checkReference, after the last step
  /// Per rank in RANK order ((pp·dp + dp)·tp + tp): the most its stages and p2p buffers held
  /// between kernel calls (activations at the model's fp32), over the run.
  std::vector<size_t> heldBytes;
};

/// Copies whole (tp = 1) layers [layerBegin, layerEnd) of weights into `stage` (which holds
/// them), each cut for tp rank `tpRank` of `tp` (`piperun --init-from`; the GPU backends'
/// references use it too).
void loadWholeLayers(kernels::StageCompute &stage, const kernels::GptConfig &cfg, int layerBegin,
                     int layerEnd, int tpRank, int tp,
                     const std::vector<std::vector<float>> &layers);

/// The model a plan describes, for the CPU kernels; an InputError when the plan has no
/// transformer or its sizes do not fit the kernels.
llvm::Expected<kernels::GptConfig> gptConfigOf(const Plan &plan);

/// An upper bound on the memory a run of `plan` on the cpu backend allocates: every rank
/// thread's weights, gradients and AdamW moments, its copy of the step's tokens, the
/// activations of the (microbatch, slice)s its stream keeps in flight at once, and the
/// received tensors; with `checkReference` also the single-rank reference's.
uint64_t cpuRunBytes(const Plan &plan, const kernels::GptConfig &cfg, bool checkReference);

/// Run `options.steps` steps of `plan` (already verified). `onStep(step, loss)` after each.
/// Refused up front (an InputError with the memory it needs) when cpuRunBytes is more than the
/// machine has.
llvm::Expected<CpuRunResult> runOnCpu(const Plan &plan, const DataSource &data,
                                      const CpuRunOptions &options,
                                      const std::function<void(int, double)> &onStep = {});

} // namespace pipec

#endif // PIPEC_RUNTIME_CPU_CPURUN_H
