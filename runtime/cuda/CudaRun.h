//===- CudaRun.h - The cuda backend: the plan's ranks on one GPU -*- C++ -*-===//
//
// Every rank (pipeline x dp x tp) is a thread, as in the cpu backend, driving its own GpuStage
// objects on its own compute stream of one GPU (DESIGN §8's `local` transport: all ranks of the
// plan on one device, which is how many ranks are tested on one GPU). The interpreter and the
// in-process transport are the cpu backend's (NCCL's matching and blocking rules, mismatch
// diagnostics, watchdog). What travels through the transport is staged in pinned host memory:
// a send copies its device tensor on the rank's send stream (after an event of the compute
// stream) and waits for that copy; a received tensor is copied to a device buffer on the
// rank's recv stream when its consumer runs, and the compute stream waits on an event. tp, dp
// and embedding all-reduces stage the same way (the in-process transport sums on the host).
// Device memory allocated up front: parameters, gradients, Adam moments (per stage) and one
// device buffer per recv instruction of the rank's stream; pinned host slots per send and recv
// instruction. Activations and saved state use the stream-ordered allocator (cudaMallocAsync).
// createDeviceTransportBackend gives one rank's backend without the host staging, for the nccl
// mode (NcclRun.h), where the transport moves device memory itself.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_CUDA_CUDARUN_H
#define PIPEC_RUNTIME_CUDA_CUDARUN_H

#include "ir/Plan.h"
#include "kernels/cpu/Gpt.h"
#include "runtime/Backend.h"
#include "runtime/Data.h"
#include "runtime/Interpreter.h"

#include "llvm/Support/Error.h"

#include <functional>
#include <map>
#include <memory>
#include <vector>

namespace pipec {

struct GradSnapshot;

struct CudaRunOptions {
  int steps = 1;
  uint64_t seed = 1;
  float lr = 1e-3f;
  /// Also run the CPU single-rank reference and compare every step's gradients.
  bool checkReference = false;
  double timeoutSeconds = 60;
  int device = 0;
};

struct CudaRunResult {
  std::vector<double> losses;          // global mean loss per step
  std::vector<double> referenceLosses; // with checkReference (CPU, single rank)
  double maxAbsGradDiff = 0;           // over all steps and parameters
  double gradScale = 0;                // max |reference gradient|
  /// The gradients of the last step as the optimizer saw them (dp replica 0), per (stage, tp
  /// rank), with checkReference.
  std::map<std::pair<int, int>, std::vector<float>> lastGrads;
};

/// The tolerance of --check-reference on the cuda backend, relative to the largest reference
/// gradient: fp32 throughout, but cuBLAS, the attention kernels and the atomic embedding
/// scatter sum in another order than the CPU loops.
inline constexpr double kCudaGradTolerance = 1e-4;

/// GPUs visible to this process; an error (naming the CUDA call) when none can be used.
llvm::Expected<int> cudaDevices();

/// Run `options.steps` steps of `plan` (already verified) on GPU `options.device`.
llvm::Expected<CudaRunResult> runOnCuda(const Plan &plan, const DataSource &data,
                                        const CudaRunOptions &options,
                                        const std::function<void(int, double)> &onStep = {});

/// One rank's cuda backend, for a runner other than runOnCuda (the nccl one, NcclRun.h).
class CudaRankBackend : public Backend {
public:
  /// Waits for the device and returns this rank's share of the step's loss.
  virtual llvm::Expected<double> finishStep() = 0;
  /// The rank's compute stream (a cudaStream_t).
  virtual void *computeStreamHandle() const = 0;
  /// The error a call that cannot return one (sendData, reduceData, ...) kept, or success.
  virtual llvm::Error takeDeferredError() = 0;
};

/// The cuda backend of rank `c` on GPU `options.device`, for a device transport: sendData,
/// recvData and reduceData hand out device memory (no host staging), a received tensor is used
/// in place (the transport orders the compute stream after its group), and all-reduces happen
/// in place. `waitForCollectives` must order the compute stream after every all-reduce queued so
/// far (dp and embedding ones may still run on their own streams); it is called before the
/// optimizer step and a local tied-embedding sum. `cfg`, `data` and `options` must outlive the
/// backend; `snapshot` (may be null) receives replica 0's gradients before each optimizer step.
llvm::Expected<std::unique_ptr<CudaRankBackend>>
createDeviceTransportBackend(const Plan &plan, const kernels::GptConfig &cfg, const Coord &c,
                             const DataSource &data, const CudaRunOptions &options,
                             GradSnapshot *snapshot,
                             std::function<llvm::Error()> waitForCollectives);

} // namespace pipec

#endif // PIPEC_RUNTIME_CUDA_CUDARUN_H
