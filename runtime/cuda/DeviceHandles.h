//===- DeviceHandles.h - RAII CUDA streams and events -----------*- C++ -*-===//
//
// The owned stream and event both device backends (CudaRun, NcclRun) use: created by a checked
// create(), destroyed with their owner.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_CUDA_DEVICEHANDLES_H
#define PIPEC_RUNTIME_CUDA_DEVICEHANDLES_H

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

} // namespace pipec::runtime_cuda

#endif // PIPEC_RUNTIME_CUDA_DEVICEHANDLES_H
