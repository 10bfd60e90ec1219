//===- KernelEnv.h - the CUDA kernels' configuration from the environment -*- C++ -*-===//
//
// The one place that reads the environment for kernels/cuda/KernelConfig.h: piperun and the GPU
// benchmarks call it once at start and pass the result down (CudaRunOptions::kernels, and from
// there every CudaContext); no kernel or op reads the environment itself.
//
//   PIPEC_ATTENTION_WGMMA=0   KernelConfig::hopperKernels false: the kernels an sm_80 GPU runs
//                             (mma.sync, SIMT), on a Hopper GPU too; 1 or unset: true
//
// Any other value is an input error naming the variable. So is PIPEC_ATTENTION_WGMMA_BACKWARD
// or PIPEC_ATTENTION_DQ_ATOMICS set to anything but 0: they switched the Hopper attention
// backward on, which has never run on a GPU and is no longer part of the tools
// (kernels/cuda/experimental/, docs/gpu.md).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_TOOLS_KERNELENV_H
#define PIPEC_TOOLS_KERNELENV_H

#include "kernels/cuda/KernelConfig.h"

#include "llvm/Support/Error.h"

#include <cstdlib>
#include <functional>

namespace pipec {

/// The configuration `getenv` (::getenv by default) describes.
llvm::Expected<kernels::cuda::KernelConfig> kernelConfigFromEnvironment(
    const std::function<const char *(const char *)> &getenv = [](const char *name) {
      return static_cast<const char *>(std::getenv(name));
    });

} // namespace pipec

#endif // PIPEC_TOOLS_KERNELENV_H
