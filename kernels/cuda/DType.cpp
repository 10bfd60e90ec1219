//===- DType.cpp - names and sizes of the CUDA ops' element types ---------===//
#include "kernels/cuda/CudaOps.h"

#include "llvm/Support/ErrorHandling.h"

namespace pipec::kernels::cuda {

const char *toString(DType dtype) {
  switch (dtype) {
  case DType::F32:
    return "f32";
  case DType::BF16:
    return "bf16";
  }
  llvm_unreachable("unknown dtype");
}

size_t sizeOf(DType dtype) {
  switch (dtype) {
  case DType::F32:
    return 4;
  case DType::BF16:
    return 2;
  }
  llvm_unreachable("unknown dtype");
}

} // namespace pipec::kernels::cuda
