//===- CudaRun.h - The cuda backend: the plan's ranks on one GPU -*- C++ -*-===//
//
// Every rank (pipeline x dp x tp) is a thread, as in the cpu backend, driving its own GpuStage
// objects on its own compute stream of one GPU, through the `local` transport
// (runtime/cuda/LocalTransport.h): the in-process matching rules, diagnostics and watchdog, with
// device-to-device copies and sum kernels ordered by events, so the host never waits for the
// device inside a step. Sends hand the transport the device tensor itself, a recv a buffer of
// the rank's arena.
//
// Memory. Parameters, gradients and Adam moments are allocated when the stages are created
// (createStages, after the ranks' need together was checked against the GPU's free memory);
// everything a step allocates (activations, saved state, received tensors, kept gradients,
// scratch) comes from one arena per rank (runtime/cuda/DeviceArena.h), sized before step 0 by
// the sizing pass (the rank's stream interpreted on the host, step 0's batch, every buffer
// request as a step makes it, nothing queued on the device, no peer involved) and then reserved
// with one cudaMalloc: no step allocates, step 0 included.
//
// createDeviceTransportBackend gives one rank's backend to another runner: the nccl mode
// (NcclRun.h), where NCCL moves the device memory.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_CUDA_CUDARUN_H
#define PIPEC_RUNTIME_CUDA_CUDARUN_H

#include "ir/Plan.h"
#include "kernels/cpu/Gpt.h"
#include "kernels/cuda/KernelConfig.h"
#include "runtime/Backend.h"
#include "runtime/Data.h"
#include "runtime/Interpreter.h"
#include "runtime/Reference.h"
#include "runtime/Train.h"

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <functional>
#include <map>
#include <memory>
#include <vector>

namespace pipec {

struct ParamSnapshot;
struct CudaRunResult;

/// The GPU backends' options: the driver's (runtime/Train.h), and the device's.
struct CudaRunOptions : TrainOptions {
  int device = 0;
  /// The compute type (GpuStage.h, Precision): fp32, or bf16 with fp32 master weights.
  kernels::DType dtype = kernels::DType::F32;
  /// How the ops choose their kernels beyond the device and the shapes (the tools make it;
  /// every rank's CudaContext gets it).
  kernels::cuda::KernelConfig kernels;
  /// Called once the arenas are reserved, before step 0, with the result so far: its arenaBytes
  /// and stateBytes. (The watchdog of TrainOptions::timeoutSeconds also ends a step's wait for
  /// the GPU after that long without a compute op or p2p group or all-reduce finishing: runOnCuda's
  /// ends the process, a kernel that never finishes; NcclTransport's aborts.)
  std::function<void(const CudaRunResult &)> onArenas;
};

struct CudaRunResult : TrainResult {
  /// Per rank of this process (thread order): its stages' weights, gradients and optimizer state
  /// (CudaRankBackend::stateBytes; at tp 1 without --check-reference, the plan's static_bytes of
  /// the rank plus 8 when the compute type is the model's: 16 bytes a parameter in fp32, 18 in
  /// bf16) ...
  std::vector<size_t> stateBytes;
  /// ... the activation arena the sizing pass reserved ...
  std::vector<size_t> arenaBytes;
  /// ... and the most of it the steps used (equal, when the pass saw the steps' requests) ...
  std::vector<size_t> arenaUsedBytes;
  /// ... and of that, the most bytes live at once: arenaUsedBytes less the gaps first-fit
  /// placement left free below its top (runtime/OffsetArena.h). pipec's memory model predicts
  /// live bytes; the gaps are the allocator's.
  std::vector<size_t> arenaLiveBytes;
};

/// The tolerance of --check-reference on the cuda backend, relative to the largest reference
/// gradient: fp32 throughout, but cuBLAS, the attention kernels, the column sums and the
/// embedding backward sum in another order than the CPU loops (a fixed one: runs repeat bit for
/// bit).
inline constexpr double kCudaGradTolerance = 1e-4;
/// The same for bf16 compute against the fp32 reference: every activation, input gradient and
/// parameter read is rounded to 8 significant bits (a relative error of up to 2^-8 each), and
/// the errors add up through the layers and the softmaxes.
inline constexpr double kCudaBf16GradTolerance = 5e-2;
/// The tolerance for `dtype`.
inline double cudaGradTolerance(kernels::DType dtype) {
  return dtype == kernels::DType::BF16 ? kCudaBf16GradTolerance : kCudaGradTolerance;
}
/// The per-tensor tolerance for `dtype` (GradCheck::maxTensorDiff, runtime/Reference.h).
inline double cudaTensorGradTolerance(kernels::DType dtype) {
  return dtype == kernels::DType::BF16 ? kBf16TensorGradTolerance : kTensorGradTolerance;
}

/// GPUs visible to this process; an error (naming the CUDA call) when none can be used.
llvm::Expected<int> cudaDevices();

/// The GPU stages (GpuStage) run every block but a LayerNorm without its shift or with an
/// epsilon other than 1e-5 (the CUDA layernorm kernel's): such a plan is an input error naming
/// `backend` (cuda or nccl) and the fix.
llvm::Error gpuRunsTheBlock(const kernels::GptConfig &cfg, const Plan &plan,
                            llvm::StringRef backend);

/// A GPU backend as the training driver sees it (the cuda backend's and the nccl mode's), with
/// its memory figures: CudaRunResult's stateBytes, arenaBytes and arenaUsedBytes of its ranks.
class GpuTrainBackend : public TrainBackend {
public:
  virtual CudaRunResult memory() const = 0;
};

/// train() on `backend`, with its memory figures after the run: runOnCuda's and runOnNccl's.
llvm::Expected<CudaRunResult> trainOnGpu(const Plan &plan, const kernels::GptConfig &cfg,
                                         const DataSource &data, GpuTrainBackend &backend,
                                         const CudaRunOptions &options,
                                         const std::function<void(int, double)> &onStep);

/// The cuda backend of `plan` (already verified; `cfg` is gptConfigOf(plan)) on GPU
/// `options.device` for the training driver (runtime/Train.h); `plan`, `cfg`, `data` and
/// `options` must outlive it.
std::unique_ptr<TrainBackend> createCudaBackend(const Plan &plan, const kernels::GptConfig &cfg,
                                                const DataSource &data,
                                                const CudaRunOptions &options);

/// Run `options.steps` steps of `plan` (already verified) on GPU `options.device`, with the
/// training driver.
llvm::Expected<CudaRunResult> runOnCuda(const Plan &plan, const DataSource &data,
                                        const CudaRunOptions &options,
                                        const std::function<void(int, double)> &onStep = {});

/// One rank's cuda backend, for a runner other than runOnCuda (the nccl one, NcclRun.h).
class CudaRankBackend : public Backend {
public:
  /// Waits for the device and returns this rank's share of the step's loss.
  virtual llvm::Expected<double> finishStep() = 0;
  /// How many of this step's compute ops (and its optimizer step) have finished on the GPU so
  /// far, counted in stream order from an event recorded after each: the watchdogs' measure of
  /// progress while the host waits for the device. Call it from one thread at a time, between
  /// the step's end on the host and the next beginStep().
  virtual size_t completedWork() = 0;
  /// The rank's compute stream (a cudaStream_t).
  virtual void *computeStreamHandle() const = 0;
  /// A read of [data, data + bytes) of this rank's buffers on a transport stream that the
  /// compute stream does not wait for, complete at `done` (a cudaEvent_t): releasing a buffer
  /// under it makes the compute stream wait for `done` first (DeviceArena::readElsewhere).
  virtual void readElsewhere(const void *data, size_t bytes, void *done) = 0;
  /// The compute stream has waited for every such read so far.
  virtual void elsewhereReadsDone() = 0;
  /// The error a call that cannot return one (sendData, recvData, ...) kept, or success.
  virtual llvm::Error takeDeferredError() = 0;
  /// The device memory createStages() allocates: every stage's GpuStage::stateBytes and, with
  /// a snapshot on dp replica 0, a copy of its gradients. Computed, before anything is.
  virtual size_t stateBytes() const = 0;
  /// Once, before measureArena() (and every other call that uses the stages): the rank's
  /// stages, their weights initialised. When the GPU cannot hold them (checked against its free
  /// memory before the host initialises anything, and again if an allocation still runs out),
  /// an error that names the rank and the bytes and ends with `fix` (the runner's); nothing
  /// stays allocated.
  virtual llvm::Error createStages(llvm::StringRef fix) = 0;
  /// Before step 0: the sizing pass over this rank's stream (DeviceArena.h); the bytes its
  /// arena needs. Queues nothing on the device, waits for no peer, trains nothing.
  virtual llvm::Expected<size_t> measureArena() = 0;
  /// After measureArena(): one allocation of that size.
  virtual llvm::Error reserveArena() = 0;
  /// The bytes reserveArena() reserved.
  virtual size_t arenaBytes() const = 0;
  /// The most of them the steps since have used at once...
  virtual size_t arenaUsedBytes() const = 0;
  /// ... and the most bytes their buffers held live at once (without first fit's gaps).
  virtual size_t arenaLiveBytes() const = 0;
  /// Between steps (after finishStep()): the digests of the stages' fp32 master weights into
  /// `into` (ParamSnapshot::digests), and on dp replica 0 the weights themselves (the host waits
  /// for the copies).
  virtual llvm::Error snapshotWeights(ParamSnapshot &into) = 0;
  /// Whether one of the rank's stages holds `layer`.
  virtual bool holdsLayer(int layer) const = 0;
  /// Between steps: the rank's tp part of layer `layer` (which it holds) into `part`, read from
  /// the device (weights and AdamW moments, in the rank's layout)...
  virtual llvm::Error readLayer(int layer, LayerState &part) = 0;
  /// ... and the whole layer `whole` (tp = 1; empty moments: weights alone) cut for this rank and
  /// written to the device, where it holds the layer.
  virtual llvm::Error writeLayer(int layer, const LayerState &whole) = 0;
  /// The stages' optimizer step count.
  virtual int adamSteps() const = 0;
  virtual void setAdamSteps(int steps) = 0;
};

/// The cuda backend of rank `c` on GPU `options.device` (its context and compute stream; the
/// stages come with createStages()), for a device transport: sendData,
/// recvData and reduceData hand out device memory, a received tensor is used in place (the
/// transport orders the compute stream after its group), and all-reduces happen in place.
/// `waitForCollectives` must order the compute stream after every all-reduce queued so far (dp and
/// embedding ones may still run on their own streams); it is called before the optimizer step and a
/// local tied-embedding sum. `cfg`, `data` and `options` must outlive the backend; `snapshot` (may
/// be null) receives replica 0's gradients as each optimizer step saw them, in finishStep().
llvm::Expected<std::unique_ptr<CudaRankBackend>>
createDeviceTransportBackend(const Plan &plan, const kernels::GptConfig &cfg, const Coord &c,
                             const DataSource &data, const CudaRunOptions &options,
                             ParamSnapshot *snapshot,
                             std::function<llvm::Error()> waitForCollectives);

} // namespace pipec

#endif // PIPEC_RUNTIME_CUDA_CUDARUN_H
