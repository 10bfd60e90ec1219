//===- CudaCheck.h - CUDA and cuBLAS status codes to llvm::Error -*- C++ -*-===//
//
// The one checked funnel of the CUDA code (STYLE 9, after NCCL's checks.h without its gotos):
// every runtime or cuBLAS(Lt) call goes through PIPEC_CUDA_TRY / PIPEC_CUBLAS_TRY, which on
// failure return an llvm::Error reading
//
//   cudaMalloc(&ptr, bytes) failed: cudaErrorMemoryAllocation (2: out of memory) at
//   kernels/cuda/CudaOps.cpp:120
//
// Cleanup is the caller's RAII, so an early return leaks nothing. Kernel launches are checked
// with PIPEC_CUDA_TRY(cudaGetLastError()) right after the launch (the .cu launchers return it).
// This header includes CUDA's; it is for kernels/cuda/ only — CudaOps.h is the public face.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_KERNELS_CUDA_CUDACHECK_H
#define PIPEC_KERNELS_CUDA_CUDACHECK_H

#include "llvm/Support/Error.h"

#include <cublas_api.h>
#include <cuda_runtime_api.h>

#include <string>
#include <utility>

namespace pipec::kernels::cuda {

/// "<call> failed: <name> (<code>: <description>) at <file>:<line>": a CudaOutOfMemoryError for
/// cudaErrorMemoryAllocation and CUBLAS_STATUS_ALLOC_FAILED, a plain string error otherwise.
llvm::Error makeCudaError(const char *call, cudaError_t code, const char *file, int line);
llvm::Error makeCublasError(const char *call, cublasStatus_t code, const char *file, int line);

/// A CUDA allocation that failed for want of device memory, which a caller may explain in its
/// own terms (what it needed the memory for, the fix) rather than pass on; other failures it
/// should not. Test with `err.isA<CudaOutOfMemoryError>()`.
class CudaOutOfMemoryError : public llvm::ErrorInfo<CudaOutOfMemoryError> {
public:
  static char ID;
  explicit CudaOutOfMemoryError(std::string message) : message(std::move(message)) {}
  void log(llvm::raw_ostream &os) const override { os << message; }
  std::error_code convertToErrorCode() const override { return llvm::inconvertibleErrorCode(); }

private:
  std::string message;
};

} // namespace pipec::kernels::cuda

#define PIPEC_CUDA_TRY(call)                                                                       \
  do {                                                                                             \
    cudaError_t pipecCudaStatus = (call);                                                          \
    if (pipecCudaStatus != cudaSuccess)                                                            \
      return ::pipec::kernels::cuda::makeCudaError(#call, pipecCudaStatus, __FILE__, __LINE__);    \
  } while (false)

#define PIPEC_CUBLAS_TRY(call)                                                                     \
  do {                                                                                             \
    cublasStatus_t pipecCublasStatus = (call);                                                     \
    if (pipecCublasStatus != CUBLAS_STATUS_SUCCESS)                                                \
      return ::pipec::kernels::cuda::makeCublasError(#call, pipecCublasStatus, __FILE__,           \
                                                     __LINE__);                                    \
  } while (false)

/// Device work an op queues on context `ctx` (a launch, a copy, a memset), checked as
/// PIPEC_CUDA_TRY; skipped while the context is in its sizing pass (CudaContext::setSizing).
#define PIPEC_QUEUE_TRY(ctx, call)                                                                 \
  do {                                                                                             \
    if (!(ctx).sizing())                                                                           \
      PIPEC_CUDA_TRY(call);                                                                        \
  } while (false)

#endif // PIPEC_KERNELS_CUDA_CUDACHECK_H
