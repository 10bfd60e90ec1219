//===- Nccl.h - NCCL status codes to llvm::Error, communicators -*- C++ -*-===//
//
// The checked funnel of every NCCL call (STYLE 9, NCCL's checks.h without its gotos):
// PIPEC_NCCL_TRY(call) returns, on failure, an llvm::Error reading
//
//   ncclCommInitRank(&c, n, id, rank) failed: ncclSystemError (2: unhandled system error (run
//   with NCCL_DEBUG=INFO for details)) at runtime/cuda/Nccl.cpp:80; last NCCL error: ...
//
// NcclComm owns one communicator (ncclCommFinalize + ncclCommDestroy when healthy,
// ncclCommAbort after a failure). createCommunicators makes every communicator of this process
// eagerly, in commLayout's order (runtime/cuda/NcclLayout.h): `world` with ncclCommInitRank
// (the unique id from ncclGetUniqueId, which NCCL_COMM_ID=host:port makes the same on every
// process, RANK 0 hosting the bootstrap root), the others with ncclCommSplit of it.
// This header includes nccl.h; it is for runtime/cuda/ only.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_CUDA_NCCL_H
#define PIPEC_RUNTIME_CUDA_NCCL_H

#include "runtime/cuda/NcclLayout.h"

#include "llvm/Support/Error.h"

#include <nccl.h>

#include <memory>

namespace pipec {

/// "<call> failed: <name> (<code>: <ncclGetErrorString>) at <file>:<line>[; last NCCL error:
/// <ncclGetLastError>]".
llvm::Error makeNcclError(const char *call, ncclResult_t code, const char *file, int line);
const char *ncclResultName(ncclResult_t code);

} // namespace pipec

#define PIPEC_NCCL_TRY(call)                                                                       \
  do {                                                                                             \
    ncclResult_t pipecNcclStatus = (call);                                                         \
    if (pipecNcclStatus != ncclSuccess)                                                            \
      return ::pipec::makeNcclError(#call, pipecNcclStatus, __FILE__, __LINE__);                   \
  } while (false)

namespace pipec {

/// One communicator; empty when this process is not in the group.
class NcclComm {
public:
  NcclComm() = default;
  explicit NcclComm(ncclComm_t c) : c(c) {}
  NcclComm(NcclComm &&o) noexcept : c(o.c) { o.c = nullptr; }
  NcclComm &operator=(NcclComm &&o) noexcept;
  NcclComm(const NcclComm &) = delete;
  NcclComm &operator=(const NcclComm &) = delete;
  ~NcclComm() { reset(); }

  ncclComm_t get() const { return c; }
  explicit operator bool() const { return c != nullptr; }
  int size() const;
  /// ncclCommAbort now (and nothing more at destruction); for stalls and failures.
  void abort();
  /// An asynchronous error of the communicator (a peer died, a network failure), or success.
  llvm::Error asyncError() const;

private:
  void reset();
  ncclComm_t c = nullptr;
};

/// Every communicator of this process (members absent from a group hold an empty one).
struct NcclCommunicators {
  NcclComm world, pipeline, tp, dp, embedding;
  NcclComm &of(CommKind k);
  /// Abort every communicator (a stall or a failure on this process).
  void abortAll();
  llvm::Error asyncErrors() const;
};

/// Creates the communicators of commLayout(plan, env.rank) in that order; the device must be
/// set (cudaSetDevice) first. Blocks until every process has joined each; should that take
/// longer than `blockingLimitSeconds` (a process that never started, or died), this process
/// exits with a line saying so (runtime/BlockingWatchdog.h).
llvm::Expected<std::unique_ptr<NcclCommunicators>>
createCommunicators(const Plan &plan, const LaunchEnv &env, double blockingLimitSeconds = 600);

} // namespace pipec

#endif // PIPEC_RUNTIME_CUDA_NCCL_H
