//===- CudaCheck.cpp - CUDA and cuBLAS status codes to llvm::Error ---------===//
#include "kernels/cuda/CudaCheck.h"

#include <cublas_v2.h>
#include <fmt/format.h>

namespace pipec::kernels::cuda {

llvm::Error makeCudaError(const char *call, cudaError_t code, const char *file, int line) {
  // Reset the runtime's last-error slot, so that a later cudaGetLastError() does not report
  // this failure a second time (a sticky error, e.g. a kernel fault, stays regardless).
  (void)cudaGetLastError();
  std::string message = fmt::format("{} failed: {} ({}: {}) at {}:{}", call, cudaGetErrorName(code),
                                    int(code), cudaGetErrorString(code), file, line);
  if (code == cudaErrorMemoryAllocation)
    return llvm::make_error<CudaOutOfMemoryError>(std::move(message));
  return llvm::createStringError(llvm::inconvertibleErrorCode(), message);
}

char CudaOutOfMemoryError::ID = 0;

llvm::Error makeCublasError(const char *call, cublasStatus_t code, const char *file, int line) {
  std::string message =
      fmt::format("{} failed: {} ({}: {}) at {}:{}", call, cublasGetStatusName(code), int(code),
                  cublasGetStatusString(code), file, line);
  if (code == CUBLAS_STATUS_ALLOC_FAILED) // (cuBLAS could not allocate its device memory)
    return llvm::make_error<CudaOutOfMemoryError>(std::move(message));
  return llvm::createStringError(llvm::inconvertibleErrorCode(), message);
}

} // namespace pipec::kernels::cuda
