//===- CpuRun.h - The cpu backend: real fp32 math on threads ----*- C++ -*-===//
//
// Every rank (pipeline x dp x tp) is a thread running the plan with the CPU reference kernels
// (kernels/cpu/Gpt.h), driven by the training driver (runtime/Train.h), which also runs the
// reference check, --init-from and checkpoints.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_CPU_CPURUN_H
#define PIPEC_RUNTIME_CPU_CPURUN_H

#include "ir/Plan.h"
#include "kernels/cpu/Gpt.h"
#include "runtime/Data.h"
#include "runtime/Interpreter.h"
#include "runtime/Reference.h"
#include "runtime/Train.h"

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace pipec {

/// The cpu backend's options: the driver's, and faults to inject (tests).
struct CpuRunOptions : TrainOptions {
  Faults faults;
};

struct CpuRunResult : TrainResult {
  /// Per rank in RANK order ((pp·dp + dp)·tp + tp): the most its stages and p2p buffers held
  /// between kernel calls (activations at the model's fp32), over the run.
  std::vector<size_t> heldBytes;
};

/// An upper bound on the memory a run of `plan` on the cpu backend allocates: every rank
/// thread's weights, gradients and AdamW moments, its copy of the step's tokens, the
/// activations of the (microbatch, slice)s its stream keeps in flight at once, and the
/// received tensors; with `checkReference` also the single-rank reference's.
uint64_t cpuRunBytes(const Plan &plan, const kernels::GptConfig &cfg, bool checkReference);

/// The cpu backend of `plan` (already verified; `cfg` is gptConfigOf(plan)) for the training
/// driver (runtime/Train.h); `plan`, `cfg`, `data` and `options` must outlive it. Its set-up is
/// refused (an InputError with the memory it needs) when cpuRunBytes is more than the machine
/// has. After the run, summary() is a line with every rank's held activations.
std::unique_ptr<TrainBackend> createCpuBackend(const Plan &plan, const kernels::GptConfig &cfg,
                                               const DataSource &data, const TrainOptions &options,
                                               Faults faults = {});

/// Run `options.steps` steps of `plan` (already verified) with the training driver on the cpu
/// backend. `onStep(step, loss)` after each.
llvm::Expected<CpuRunResult> runOnCpu(const Plan &plan, const DataSource &data,
                                      const CpuRunOptions &options,
                                      const std::function<void(int, double)> &onStep = {});

} // namespace pipec

#endif // PIPEC_RUNTIME_CPU_CPURUN_H
