//===- DType.h - element types of the CUDA ops --------------------*- C++ -*-===//
//
// Kept apart from CudaOps.h so that the .cu launchers (compiled by nvcc, which never sees LLVM's
// headers) and the host wrappers share one enum: kernels/DType.h's, which the runtime uses too.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_KERNELS_CUDA_DTYPE_H
#define PIPEC_KERNELS_CUDA_DTYPE_H

#include "kernels/DType.h"

namespace pipec::kernels::cuda {

using kernels::DType;
using kernels::sizeOf;
using kernels::toString;

} // namespace pipec::kernels::cuda

#endif // PIPEC_KERNELS_CUDA_DTYPE_H
