//===- DeviceMemory.h - The default allocator of a CUDA context --*- C++ -*-===//
//
// Shared by every flavour's CudaContext (CudaContext.cpp, ContextImpl.h): the stream-ordered
// DeviceAllocator every context starts with, the ops' scratch buffers, and the device's compute
// capability that a context reads once.
// DeviceBuffer (CudaOps.h) is implemented once, in DeviceMemory.cpp. For kernels/cuda/ and the
// cuda backend's stages (runtime/cuda/GpuStage.cpp: the embedding backward's scratch).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_KERNELS_CUDA_DEVICEMEMORY_H
#define PIPEC_KERNELS_CUDA_DEVICEMEMORY_H

#include "kernels/cuda/CudaCheck.h"
#include "kernels/cuda/CudaOps.h"

#include <cuda_runtime_api.h>

#include <cassert>

namespace pipec::kernels::cuda {

/// The compute capability of `device` as 10 major + minor; an error naming it when it is below
/// CudaContext::kMinComputeCapability (the build has no kernels for it).
llvm::Expected<int> computeCapabilityOf(int device);

/// cudaMallocAsync / cudaFreeAsync on one stream.
class StreamOrderedAllocator final : public DeviceAllocator {
public:
  cudaStream_t stream = nullptr;
  llvm::Expected<void *> allocate(size_t bytes) override {
    if (bytes == 0)
      return nullptr;
    void *p = nullptr;
    PIPEC_CUDA_TRY(cudaMallocAsync(&p, bytes, stream));
    return p;
  }
  void release(void *p) override {
    if (p)
      (void)cudaFreeAsync(p, stream);
  }
};

/// An op's temporary buffer from a context's allocator, given back when it goes out of scope,
/// after the op has queued the work that uses it (DeviceAllocator's rule).
class ScratchBuffer {
public:
  explicit ScratchBuffer(DeviceAllocator &from) : from(from) {}
  ~ScratchBuffer() { from.release(ptr); }
  ScratchBuffer(const ScratchBuffer &) = delete;
  ScratchBuffer &operator=(const ScratchBuffer &) = delete;
  /// `bytes` (nothing for 0: data() stays null).
  llvm::Error allocate(size_t bytes) {
    assert(!ptr && "one allocation per ScratchBuffer");
    auto p = from.allocate(bytes);
    if (!p)
      return p.takeError();
    ptr = *p;
    return llvm::Error::success();
  }
  template <typename T> T *as() const { return static_cast<T *>(ptr); }

private:
  DeviceAllocator &from;
  void *ptr = nullptr;
};

} // namespace pipec::kernels::cuda

#endif // PIPEC_KERNELS_CUDA_DEVICEMEMORY_H
