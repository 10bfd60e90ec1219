//===- Try.h - Propagating an llvm::Error out of the enclosing function -*- C++ -*-===//
//
// The one return-if-error macro of the stage, the CUDA ops' callers and the device backends:
//
//   PIPEC_TRY(dev.alloc(buffer, n));   // returns the error from the enclosing function, if any
//
// The enclosing function returns llvm::Error or llvm::Expected<T>. CUDA status codes have their
// own funnel (kernels/cuda/CudaCheck.h), which turns a code into an llvm::Error.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_KERNELS_TRY_H
#define PIPEC_KERNELS_TRY_H

#include "llvm/Support/Error.h"

/// Returns from the enclosing function with the error of `expr` (an llvm::Error), if any.
#define PIPEC_TRY(expr)                                                                            \
  do {                                                                                             \
    if (llvm::Error pipecTryErr = (expr))                                                          \
      return pipecTryErr;                                                                          \
  } while (false)

#endif // PIPEC_KERNELS_TRY_H
