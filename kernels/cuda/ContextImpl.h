//===- ContextImpl.h - What a CudaContext holds, in every flavour -*- C++ -*-===//
//
// CudaContext (CudaOps.h) is created, and its stream, copies, allocator and sizing pass run, in
// one place for every backend flavour (CudaContext.cpp). What differs is what the matmuls keep:
// on a GPU cuBLASLt's handle, workspace and algorithm cache (CudaOps.cpp), on the emulated
// device the charge for that workspace (emu/CudaOpsEmu.cpp). Each flavour defines MatmulState
// and the two functions below. For kernels/cuda/ only.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_KERNELS_CUDA_CONTEXTIMPL_H
#define PIPEC_KERNELS_CUDA_CONTEXTIMPL_H

#include "kernels/cuda/CudaOps.h"
#include "kernels/cuda/DeviceMemory.h"
#include "kernels/cuda/KernelConfig.h"

#include "llvm/Support/Error.h"

#include <cuda_runtime_api.h>

#include <memory>

namespace pipec::kernels::cuda {

/// The matmuls' part of a context (each flavour's own).
struct MatmulState;
struct MatmulStateDeleter {
  void operator()(MatmulState *state) const;
};
using MatmulStatePtr = std::unique_ptr<MatmulState, MatmulStateDeleter>;
/// The matmuls' part of a context on `stream` (its device is current), or an error naming the
/// call that failed.
llvm::Expected<MatmulStatePtr> createMatmulState(cudaStream_t stream);

struct CudaContext::Impl {
  int device = 0;
  int computeCapability = 0;
  KernelConfig config;
  cudaStream_t stream = nullptr;
  bool ownsStream = false;
  StreamOrderedAllocator streamOrdered;
  DeviceAllocator *allocator = &streamOrdered;
  bool sizing = false;
  MatmulStatePtr matmul;

  // Frees whatever was created, so that create() can return early at any step: the matmuls'
  // state before the stream.
  ~Impl() {
    matmul.reset();
    if (stream && ownsStream)
      (void)cudaStreamDestroy(stream);
  }
};

} // namespace pipec::kernels::cuda

#endif // PIPEC_KERNELS_CUDA_CONTEXTIMPL_H
