//===- NcclRun.h - The nccl mode: one rank of the plan per process ---*- C++ -*-===//
//
// docs/runtime.md's `nccl` transport: a launcher starts one process per GPU with RANK, WORLD_SIZE
// and LOCAL_RANK, or srun's or an MPI's own variables for them (NcclLayout.h); each process selects
// GPU LOCAL_RANK, creates its communicators
// eagerly (Nccl.h), sets up its GPU (streams, events, cuBLASLt and its workspace) and learns
// (an all-reduce on `world`) whether every process could, so that all stop together if one
// could not, warms up every p2p connection and collective it will use, and interprets
// its one rank's stream with the shared interpreter (runtime/Interpreter.h) on the cuda
// backend's device-transport variant (CudaRun.h) and NcclTransport (NcclTransport.h):
//   - the sends and recvs of one plan group are posted inside one ncclGroupStart/ncclGroupEnd
//     on the `pipeline` communicator and a p2p stream, in plan order (the order NCCL's FIFO
//     matching per peer pair needs; at pp = 2, where prev and next are the same process, the
//     verified plan order is what keeps the two directions apart); the p2p stream first waits
//     for the compute stream, and the compute stream waits for a group that receives (a sent
//     buffer's release in the arena waits for a group of sends alone);
//   - tp all-reduces run on the `tp` communicator and stream (the compute stream waits at
//     once: Megatron's are synchronous); dp and embedding all-reduces on their own
//     communicators and streams, overlapping compute until the optimizer step (or a local
//     tied-embedding sum) waits for them;
//   - no host synchronisation inside a step; at its end the host polls the device with a
//     watchdog (--timeout) that names the first p2p group or all-reduce of this rank that has
//     not completed, then aborts the communicators (its peers' watchdogs report theirs).
// Before step 0, after the warm-up, every process creates its stages (weights, gradients and
// optimizer state, checked against the GPU's free memory first), runs the sizing pass that
// sizes its activation arena (CudaRun.h; no NCCL call, no peer), reserves it, and learns (an
// all-reduce on `world`) whether every process could: if one could not, all stop.
// Loss: every process's share is summed over `world`; `onStep` runs on RANK 0 only.
// --check-reference: RANK 0 runs the single-rank CPU reference, built just before step 0 while
// the others wait in an all-reduce (under the arrival limit); after each step every other
// process of dp replica 0 sends its gradients to RANK 0 over `world` (gradientShards in
// NcclLayout.h), over connections made before the arena is sized, and only RANK 0's result
// carries the comparison.
// The training driver (runtime/Train.h) runs the steps on every process. A checkpoint gathers
// each layer's tp parts from the processes of dp replica 0 that hold it to RANK 0 over `world`
// (connected before the arena is sized, as the reference's gather), and RANK 0 writes it; on
// --resume every process reads the layers it holds. Every process must save, or none (agreed
// before step 0, as --dtype and --check-reference are).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_CUDA_NCCLRUN_H
#define PIPEC_RUNTIME_CUDA_NCCLRUN_H

#include "runtime/cuda/CudaRun.h"
#include "runtime/cuda/NcclLayout.h"

namespace pipec {

/// Sets up the environment of the nccl mode, where the environment does not set it itself
/// (`getenv` reads a variable, `setenv` sets one that is not set; the binary passes the
/// process's, as ::getenv and ::setenv without overwriting):
///   - NCCL_RUNTIME_CONNECT=0: NCCL connects every algorithm's channels as a communicator is
///     created. NCCL 2.22 and later otherwise connect at the first collective that needs a
///     connection: inside step 0, where that allocates device memory after the activation arena
///     was sized to what was free, and blocks the host inside the NCCL call, where the watchdog
///     cannot see it.
///   - CUDA_MODULE_LOADING=EAGER: every kernel is loaded as the process's CUDA context is
///     created. CUDA 12.2 and later otherwise load a kernel's module at its first launch, which
///     waits for the kernels the GPU is running to finish; in step 0 those include NCCL
///     kernels that wait for a peer process, and a peer stuck the same way in its own first
///     launch never comes (a hang inside cudaLaunchKernel that no watchdog can name). The price
///     is the device memory and start-up time of loading every kernel (cuBLASLt's too).
/// Returns the line for the log, with NCCL's version: "NCCL version 2.28.9 (built against
/// 2.28.9); NCCL_RUNTIME_CONNECT=0 (...); CUDA_MODULE_LOADING=EAGER (...)". Call it from the
/// main thread before other threads start (setenv is not thread-safe), so before the first CUDA
/// call, whose driver may start some, and which reads CUDA_MODULE_LOADING. (NCCL's config files,
/// /etc/nccl.conf and ~/.nccl.conf, set only what the environment does not: to override either
/// setting, set the variable in the environment.)
std::string prepareNcclEnvironment(const std::function<const char *(const char *)> &getenv,
                                   const std::function<void(const char *, const char *)> &setenv);

/// This process's rank of `plan` (already verified; `cfg` is gptConfigOf(plan)) for the training
/// driver (runtime/Train.h); the device is chosen from env.localRank (options.device is
/// ignored). `plan`, `cfg`, `data` and `env` must outlive it. A launcher calls
/// prepareNcclEnvironment first (piperun does).
std::unique_ptr<TrainBackend> createNcclBackend(const Plan &plan, const kernels::GptConfig &cfg,
                                                const DataSource &data,
                                                const CudaRunOptions &options,
                                                const LaunchEnv &env);

/// Run `options.steps` steps of this process's rank of `plan` (already verified) with the
/// training driver; as createNcclBackend.
llvm::Expected<CudaRunResult> runOnNccl(const Plan &plan, const DataSource &data,
                                        const CudaRunOptions &options, const LaunchEnv &env,
                                        const std::function<void(int, double)> &onStep = {});

} // namespace pipec

#endif // PIPEC_RUNTIME_CUDA_NCCLRUN_H
