//===- DeviceMemory.h - The default allocator of a CUDA context --*- C++ -*-===//
//
// Shared by kernels/cuda/CudaOps.cpp and the emulated device's CudaOpsEmu.cpp (both implement
// CudaOps.h's CudaContext): the stream-ordered DeviceAllocator every context starts with.
// DeviceBuffer (CudaOps.h) is implemented once, in DeviceMemory.cpp. For kernels/cuda/ only.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_KERNELS_CUDA_DEVICEMEMORY_H
#define PIPEC_KERNELS_CUDA_DEVICEMEMORY_H

#include "kernels/cuda/CudaCheck.h"
#include "kernels/cuda/CudaOps.h"

#include <cuda_runtime_api.h>

namespace pipec::kernels::cuda {

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

} // namespace pipec::kernels::cuda

#endif // PIPEC_KERNELS_CUDA_DEVICEMEMORY_H
