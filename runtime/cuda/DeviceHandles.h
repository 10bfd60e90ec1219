//===- DeviceHandles.h - RAII CUDA streams and events -----------*- C++ -*-===//
//
// The owned stream and event both device backends (CudaRun, NcclRun) use: created by a checked
// create(), destroyed with their owner; and the event-ordering of one stream after another that
// both transports use. Errors propagate with PIPEC_TRY (kernels/Try.h).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_CUDA_DEVICEHANDLES_H
#define PIPEC_RUNTIME_CUDA_DEVICEHANDLES_H

#include "kernels/Try.h"
#include "kernels/cuda/CudaCheck.h"

#include "llvm/Support/Error.h"

#include <cuda_runtime_api.h>

namespace pipec::runtime_cuda {

class OwnedStream {
public:
  OwnedStream() = default;
  OwnedStream(const OwnedStream &) = delete;
  OwnedStream &operator=(const OwnedStream &) = delete;
  ~OwnedStream() {
    if (s)
      (void)cudaStreamDestroy(s);
  }
  llvm::Error create() {
    PIPEC_CUDA_TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    return llvm::Error::success();
  }
  cudaStream_t get() const { return s; }

private:
  cudaStream_t s = nullptr;
};

class OwnedEvent {
public:
  OwnedEvent() = default;
  OwnedEvent(const OwnedEvent &) = delete;
  OwnedEvent &operator=(const OwnedEvent &) = delete;
  ~OwnedEvent() {
    if (e)
      (void)cudaEventDestroy(e);
  }
  llvm::Error create() {
    PIPEC_CUDA_TRY(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return llvm::Error::success();
  }
  cudaEvent_t get() const { return e; }

private:
  cudaEvent_t e = nullptr;
};

/// `waiter` runs what it queues next only after everything `after` has queued so far (`e` is
/// recorded on `after`; the wait takes that record).
inline llvm::Error order(cudaStream_t waiter, cudaStream_t after, cudaEvent_t e) {
  PIPEC_CUDA_TRY(cudaEventRecord(e, after));
  PIPEC_CUDA_TRY(cudaStreamWaitEvent(waiter, e, 0));
  return llvm::Error::success();
}

} // namespace pipec::runtime_cuda

#endif // PIPEC_RUNTIME_CUDA_DEVICEHANDLES_H
