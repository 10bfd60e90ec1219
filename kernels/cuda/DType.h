//===- DType.h - element types of the CUDA ops --------------------*- C++ -*-===//
//
// Kept apart from CudaOps.h so that the .cu launchers (compiled by nvcc, which never sees LLVM's
// headers) and the host wrappers share one enum.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_KERNELS_CUDA_DTYPE_H
#define PIPEC_KERNELS_CUDA_DTYPE_H

namespace pipec::kernels::cuda {

/// fp32, or bf16 storage with fp32 arithmetic.
enum class DType { F32, BF16 };

} // namespace pipec::kernels::cuda

#endif // PIPEC_KERNELS_CUDA_DTYPE_H
