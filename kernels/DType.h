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
constexpr const char *toString(DType dtype) {
  switch (dtype) {
  case DType::F32:
    return "fp32";
  case DType::BF16:
    return "bf16";
  }
  return "?"; // unreachable: every DType is a case (and -Wswitch names a new one)
}

/// Bytes per element.
constexpr size_t sizeOf(DType dtype) {
  switch (dtype) {
  case DType::F32:
    return 4;
  case DType::BF16:
    return 2;
  }
  return 0; // unreachable: every DType is a case (and -Wswitch names a new one)
}

} // namespace pipec::kernels

#endif // PIPEC_KERNELS_DTYPE_H
