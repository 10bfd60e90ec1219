//===- Train.h - The training driver over one backend interface -*- C++ -*-===//
//
// One loop trains a plan on every backend (cpu, cuda, nccl): it steps, reports each step's loss,
// runs the single-rank reference of --check-reference (runtime/Reference.h), loads the
// --init-from weights and a --resume checkpoint, and saves checkpoints (runtime/Checkpoint.h).
// A backend implements TrainBackend: set up, one step -> loss, snapshots of the gradients and
// weights (for the reference check), and whole-layer state (weights, AdamW moments, step count)
// gathered for a checkpoint and scattered from one. Checkpoints hold every layer whole, so one
// saved under one backend and layout resumes under another; where two backends compute the same
// arithmetic (the cpu backend and fp32 cuda with the CPU stand-ins of the emulated device) the
// resumed run is bit for bit the uninterrupted one.
//
// With several processes (the nccl mode) every process runs the loop: the calls that move data
// between processes (takeGradients, snapshotWeights, gatherLayer) are made by all of them in the
// same order, and only the lead process (RANK 0) reports losses, runs the reference and writes
// checkpoints. Every process reads the layers it holds from the --resume checkpoint itself.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_TRAIN_H
#define PIPEC_RUNTIME_TRAIN_H

#include "ir/Plan.h"
#include "ir/formats/Costs.h"
#include "ir/support/Error.h"
#include "kernels/cpu/Gpt.h"
#include "runtime/Checkpoint.h"
#include "runtime/Data.h"
#include "runtime/Reference.h"

#include "llvm/Support/Error.h"

#include <atomic>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace pipec {

/// What the driver does, the same on every backend.
struct TrainOptions {
  int steps = 1; // steps of this run (0: set up, load any weights or checkpoint, stop)
  uint64_t seed = 1;
  float lr = 1e-3f;
  /// Also run the single-rank CPU reference and compare every step's gradients and the last
  /// step's weights (ReferenceRun::adopt, GradCheck, WeightCheck).
  bool checkReference = false;
  /// The watchdogs' limit: a step (and on the GPU the wait for its work) that makes no progress
  /// for this long fails.
  double timeoutSeconds = 60;
  /// Initial weights (`piperun --init-from`, runtime/SafeTensors.h): every layer whole
  /// (tp = 1), in place of the seeded initialisation; each rank and the reference take their
  /// parts. Null: the seeded initialisation.
  const std::vector<std::vector<float>> *initWeights = nullptr;
  /// Checkpoints. With `resume`, the run starts at its step, from its weights and optimizer
  /// state (and the reference with them); with `saveDir`, it saves after every saveEvery-th
  /// step (counted from step 0; 0: none but the last) and after its last.
  const Checkpoint *resume = nullptr;
  std::string saveDir;
  int saveEvery = 0;
  /// How many committed checkpoints a save leaves in saveDir (the newest; 0: all of them).
  size_t keep = 0;
  /// Called with the step count, the directory, the save's report (its bytes, older steps kept
  /// whole) and the seconds of each checkpoint once it is committed.
  std::function<void(int, const std::string &, const SavedCheckpoint &, double)> onSaved;
  /// Preemption: a signal number set asynchronously (piperun's SIGTERM and SIGUSR1 handlers),
  /// read between steps. Once it is non-zero on any process, every process finishes the step in
  /// flight, they agree to stop after the same step (TrainBackend::agreeOnStop), save with
  /// saveDir, and train() returns with TrainResult::stopSignal set. Null: never stops early.
  const std::atomic<int> *stopSignal = nullptr;
  /// `piperun --export-hf DIR` (runtime/HfExport.h): after the last step, every layer's
  /// weights gathered whole and written as a Hugging Face directory (shards of at most
  /// exportHfShardBytes); onExported(dir, files) then, on the lead process.
  std::string exportHfDir;
  uint64_t exportHfShardBytes = 0; // 0: Hugging Face's default (runtime/HfExport.h)
  std::function<void(const std::string &, int)> onExported;
  /// The data source as a checkpoint records it: "synthetic" or "file <name> <bytes>".
  std::string dataName = "synthetic";
  /// With checkReference, called once the reference is built and holds its first weights (on
  /// the lead process only). Tests slow it down here.
  std::function<void()> onReferenceBuilt;
  /// `piperun --profile`: time every instruction (RunShared::timings) and hand back the measured
  /// costs (TrainResult::costs) after the last step.
  bool profile = false;
};

/// What the driver found.
struct TrainResult {
  std::vector<double> losses;          // global mean loss per step (on the lead process)
  std::vector<double> referenceLosses; // with checkReference (the lead process)
  GradCheck grads;                     // with checkReference, over all steps
  WeightCheck weights;                 // with checkReference, after the last step
  /// The gradients of the last step as the optimizer saw them (dp replica 0), per (stage, tp
  /// rank), with checkReference.
  std::map<std::pair<int, int>, std::vector<float>> lastGrads;
  /// With TrainOptions::stopSignal: the signal the run stopped for (0: it ran every step) and
  /// the step count it stopped at (its checkpoint's, with saveDir).
  int stopSignal = 0;
  int stoppedAt = 0;
  /// Each step's time on the driver's clock (backend.step()), ms.
  std::vector<double> stepMs;
  /// With options.profile, on the lead process (runtime/Profile.h).
  std::optional<MeasuredCosts> costs;
};

/// One backend's ranks in this process, as the driver drives them. Calls come from one thread,
/// in this order: setUp(); the layers' state (scatterLayer, setAdamSteps) when the run starts
/// from given weights or a checkpoint; then per step step(), with checkReference
/// takeGradients() and referenceStepDone(), and gatherLayer() of every layer for a checkpoint;
/// after the last step with checkReference snapshotWeights(); finish() when all went well.
class TrainBackend {
public:
  virtual ~TrainBackend();
  /// Builds the ranks, their stages (weights from the seeded initialisation) and everything a
  /// step needs.
  virtual llvm::Error setUp() = 0;
  /// Runs step `step` on every rank; the global mean loss.
  virtual llvm::Expected<double> step(int step) = 0;
  /// With checkReference, after step(): the gradients of dp replica 0 as its optimizer step saw
  /// them, per (stage, tp rank), into `into` (on the lead process; the others hand theirs over).
  virtual llvm::Error takeGradients(ParamSnapshot &into) = 0;
  /// With checkReference, after the lead process's reference step (every process calls it).
  virtual llvm::Error referenceStepDone() { return llvm::Error::success(); }
  /// Replica 0's weights and every replica's digests (ParamSnapshot), on the lead process.
  virtual llvm::Error snapshotWeights(ParamSnapshot &into) = 0;
  /// Whether a rank of this process holds `layer`.
  virtual bool holdsLayer(int layer) const = 0;
  /// Layer `layer`'s state `whole` (tp = 1; its moments may be empty: weights alone) into every
  /// rank of this process that holds it, each taking its tp part.
  virtual llvm::Error scatterLayer(int layer, const LayerState &whole) = 0;
  /// Layer `layer`'s state whole, tp parts joined, from dp replica 0 into `whole` on the lead
  /// process (every process calls it, for every layer in order).
  virtual llvm::Error gatherLayer(int layer, LayerState &whole) = 0;
  /// The optimizer steps the ranks have taken (AdamW's bias correction counts them).
  virtual int adamSteps() const = 0;
  virtual void setAdamSteps(int steps) = 0;
  /// With TrainOptions::stopSignal, after every step on every process: the signal this process
  /// received (0: none) in, the signal all of them stop for out (0: go on), the same on every
  /// process (several processes: SIGTERM where any got it, else any other's).
  virtual llvm::Expected<int> agreeOnStop(int signal) { return signal; }
  /// Whether this process reports the losses, runs the reference and writes checkpoints.
  virtual bool leads() const { return true; }
  /// With options.profile, after the last step (every process calls it): the run's measured
  /// costs on the lead process; the backend fills what they were measured on but the plan hash
  /// and the steps.
  virtual llvm::Error measuredCosts(MeasuredCosts &into) {
    (void)into;
    return inputError("--profile: this backend does not time its steps");
  }
  /// After the last call, when the run succeeded.
  virtual void finish() {}
  /// What the backend has to say after the run (lines, each ending in a newline), or nothing.
  virtual std::string summary() const { return {}; }
};

/// Runs `options.steps` steps of `plan` (already verified; `cfg` is gptConfigOf(plan)) on
/// `backend`. `onStep(step, loss)` after each, on the lead process.
llvm::Expected<TrainResult> train(const Plan &plan, const kernels::GptConfig &cfg,
                                  const DataSource &data, TrainBackend &backend,
                                  const TrainOptions &options,
                                  const std::function<void(int, double)> &onStep = {});

} // namespace pipec

#endif // PIPEC_RUNTIME_TRAIN_H
