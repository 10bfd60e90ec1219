//===- KernelEnv.cpp - the CUDA kernels' configuration from the environment ----------===//
#include "tools/KernelEnv.h"

#include "ir/support/Error.h"

#include "llvm/ADT/StringRef.h"

namespace pipec {

llvm::Expected<kernels::cuda::KernelConfig>
kernelConfigFromEnvironment(const std::function<const char *(const char *)> &getenv) {
  kernels::cuda::KernelConfig config;
  if (const char *v = getenv("PIPEC_ATTENTION_WGMMA")) {
    const llvm::StringRef value(v);
    if (value != "0" && value != "1")
      return inputError("PIPEC_ATTENTION_WGMMA={}: expected 0 (no Hopper kernels: the mma.sync "
                        "attention forward on every GPU) or 1 (the default); try "
                        "PIPEC_ATTENTION_WGMMA=0",
                        value.str());
    config.hopperKernels = value == "1";
  }
  for (const char *moved : {"PIPEC_ATTENTION_WGMMA_BACKWARD", "PIPEC_ATTENTION_DQ_ATOMICS"})
    if (const char *v = getenv(moved); v && llvm::StringRef(v) != "0" && *v)
      return inputError("{}={}: the Hopper attention backward has never run on a GPU and is no "
                        "longer part of the tools (kernels/cuda/experimental, docs/gpu.md); "
                        "unset {}",
                        moved, v, moved);
  return config;
}

} // namespace pipec
