//===- Nccl.cpp - NCCL status codes to llvm::Error, communicators ---------===//
#include "runtime/cuda/Nccl.h"

#include "ir/support/Error.h"
#include "runtime/BlockingWatchdog.h"
#include "runtime/cuda/CudaRun.h"

#include <fmt/format.h>

#include <cstdlib>
#include <cstring>

namespace pipec {

const char *ncclResultName(ncclResult_t code) {
  switch (code) {
  case ncclSuccess:
    return "ncclSuccess";
  case ncclUnhandledCudaError:
    return "ncclUnhandledCudaError";
  case ncclSystemError:
    return "ncclSystemError";
  case ncclInternalError:
    return "ncclInternalError";
  case ncclInvalidArgument:
    return "ncclInvalidArgument";
  case ncclInvalidUsage:
    return "ncclInvalidUsage";
  case ncclRemoteError:
    return "ncclRemoteError";
  case ncclInProgress:
    return "ncclInProgress";
  default:
    return "ncclResult";
  }
}

llvm::Error makeNcclError(const char *call, ncclResult_t code, const char *file, int line) {
  std::string msg = fmt::format("{} failed: {} ({}: {}) at {}:{}", call, ncclResultName(code),
                                int(code), ncclGetErrorString(code), file, line);
  if (const char *last = ncclGetLastError(nullptr); last && *last)
    msg += fmt::format("; last NCCL error: {}", last);
  return llvm::createStringError(llvm::inconvertibleErrorCode(), msg);
}

NcclComm &NcclComm::operator=(NcclComm &&o) noexcept {
  if (this != &o) {
    reset();
    c = o.c;
    o.c = nullptr;
  }
  return *this;
}

int NcclComm::size() const {
  int n = 0;
  if (c && ncclCommCount(c, &n) != ncclSuccess)
    return 0;
  return n;
}

void NcclComm::abort() {
  if (c)
    (void)ncclCommAbort(c);
  c = nullptr;
}

llvm::Error NcclComm::asyncError() const {
  if (!c)
    return llvm::Error::success();
  ncclResult_t status = ncclSuccess;
  PIPEC_NCCL_TRY(ncclCommGetAsyncError(c, &status));
  if (status != ncclSuccess && status != ncclInProgress)
    return makeNcclError("ncclCommGetAsyncError (an asynchronous failure)", status, __FILE__,
                         __LINE__);
  return llvm::Error::success();
}

void NcclComm::reset() {
  if (!c)
    return;
  // A healthy communicator flushes its work and is freed; one whose finalize fails is aborted.
  // (After a stall or failure the owner calls abort() first, so finalize never waits for a peer
  // that is gone.)
  if (ncclCommFinalize(c) != ncclSuccess)
    (void)ncclCommAbort(c);
  else
    (void)ncclCommDestroy(c);
  c = nullptr;
}

NcclComm &NcclCommunicators::of(CommKind k) {
  switch (k) {
  case CommKind::World:
    return world;
  case CommKind::Pipeline:
    return pipeline;
  case CommKind::Tp:
    return tp;
  case CommKind::Dp:
    return dp;
  case CommKind::Embedding:
    return embedding;
  }
  return world;
}

void NcclCommunicators::abortAll() {
  // Children first, then the parent.
  embedding.abort();
  dp.abort();
  tp.abort();
  pipeline.abort();
  world.abort();
}

llvm::Error NcclCommunicators::asyncErrors() const {
  for (const NcclComm *c : {&world, &pipeline, &tp, &dp, &embedding})
    if (auto err = c->asyncError())
      return err;
  return llvm::Error::success();
}

namespace {

llvm::Error initWorld(NcclComm &out, const LaunchEnv &env) {
  ncclUniqueId id;
  std::memset(&id, 0, sizeof id);
  // With NCCL_COMM_ID set, every process gets the same id (the address of RANK 0's bootstrap
  // root, which ncclCommInitRank starts on RANK 0); with one process a fresh id is enough.
  PIPEC_NCCL_TRY(ncclGetUniqueId(&id));
  ncclComm_t c = nullptr;
  ncclResult_t status = ncclCommInitRank(&c, env.worldSize, id, env.rank);
  if (status == ncclInvalidUsage) {
    // Two processes on one GPU: say so in the launcher's terms rather than NCCL's.
    const char *last = ncclGetLastError(nullptr);
    int visible = 0;
    if (auto n = cudaDevices())
      visible = *n;
    else
      llvm::consumeError(n.takeError());
    if (auto err = sharedGpuError(last ? last : "", env, visible,
                                  env.hostId ? env.hostId->c_str() : nullptr))
      return err;
  }
  if (status != ncclSuccess) {
    const char *last = ncclGetLastError(nullptr);
    const std::string lastError = last ? last : "";
    llvm::Error err = makeNcclError("ncclCommInitRank(&c, env.worldSize, id, env.rank)", status,
                                    __FILE__, __LINE__);
    // Another rank than 0 that gave up connecting (NCCL's retries ran out, or the connection
    // was refused): most often RANK 0, whose ncclCommInitRank starts the bootstrap root, is not
    // up yet. Not for other failures of the call (a full /dev/shm, a peer's proxy).
    if (env.rank == 0 || !env.commId || status != ncclRemoteError ||
        (lastError.find("retr") == std::string::npos &&
         lastError.find("refused") == std::string::npos))
      return err;
    return llvm::createStringError(
        llvm::inconvertibleErrorCode(),
        fmt::format("{}; RANK 0's bootstrap root at NCCL_COMM_ID={} could not be reached: NCCL "
                    "retries for {:.1f} s (NCCL_SOCKET_RETRY_CNT, NCCL_SOCKET_RETRY_SLEEP_MSEC), "
                    "so start RANK 0 at most that long after the others, or raise those, and "
                    "check that the address is RANK 0's host",
                    takeMessage(std::move(err)), *env.commId, env.rootRetrySeconds));
  }
  out = NcclComm(c);
  return llvm::Error::success();
}

llvm::Error split(NcclComm &world, const CommSpec &spec, NcclComm &out) {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0)
  ncclComm_t c = nullptr;
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  PIPEC_NCCL_TRY(ncclCommSplit(world.get(), spec.color < 0 ? NCCL_SPLIT_NOCOLOR : spec.color,
                               spec.key, &c, &config));
  out = NcclComm(c);
  if (spec.color >= 0 && out.size() != spec.size)
    return llvm::createStringError(
        llvm::inconvertibleErrorCode(),
        fmt::format("ncclCommSplit made a {} communicator of {} ranks, expected {}",
                    toString(spec.kind), out.size(), spec.size));
  return llvm::Error::success();
#else
  return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                 fmt::format("the installed NCCL {}.{}.{} has no ncclCommSplit "
                                             "(2.18 or later is needed for the {} communicator)",
                                             NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH,
                                             toString(spec.kind)));
#endif
}

} // namespace

llvm::Expected<std::unique_ptr<NcclCommunicators>>
createCommunicators(const Plan &plan, const LaunchEnv &env, double blockingLimitSeconds) {
  auto comms = std::make_unique<NcclCommunicators>();
  for (const CommSpec &spec : commLayout(plan, env.rank)) {
    BlockingWatchdog watchdog(fmt::format("rank {}'s creation of its NCCL {} communicator",
                                          env.rank, toString(spec.kind)),
                              blockingLimitSeconds);
    llvm::Error err = spec.kind == CommKind::World
                          ? initWorld(comms->world, env)
                          : split(comms->world, spec, comms->of(spec.kind));
    if (err) {
      comms->abortAll();
      return err;
    }
  }
  return comms;
}

} // namespace pipec
