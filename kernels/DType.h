//===- DType.h - Element types of tensors, on the host and on the device -*- C++ -*-===//
//
// Shared by the CUDA ops (kernels/cuda), whose launchers nvcc compiles without LLVM's headers,
// and by the runtime, whose tensors carry their element type (runtime/Tensor.h). Plain C++.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_KERNELS_DTYPE_H
#define PIPEC_KERNELS_DTYPE_H

#include <cstddef>

namespace pipec::kernels {

/// fp32, or bf16 storage with fp32 arithmetic.
enum class DType { F32, BF16 };

/// "fp32" or "bf16", the spelling of the model spec's `dtype` and of piperun's --dtype.
constexpr const char *toString(DType dtype) { return dtype == DType::BF16 ? "bf16" : "fp32"; }

/// Bytes per element.
constexpr size_t sizeOf(DType dtype) { return dtype == DType::BF16 ? 2 : 4; }

} // namespace pipec::kernels

#endif // PIPEC_KERNELS_DTYPE_H
