//===- KernelConfig.h - how the CUDA ops choose their kernels -----*- C++ -*-===//
//
// Which kernel a CUDA op runs is decided by the shapes, the tensors' alignment and the device's
// compute capability (read once, when its CudaContext is created), and by this object: the
// run's choices beyond those. It is plain data, made by the tools (tools/KernelEnv.h reads the
// environment, once, in piperun and the benchmarks), carried by the runtime's options
// (CudaRunOptions::kernels) and handed to every CudaContext the run creates. No op reads the
// environment or a process-wide switch, so two contexts of one process may run with different
// configurations (the kernel test compares the wgmma and mma.sync forwards that way).
//
// Plain C++, no CUDA: tools and tests of machines without the toolkit include it too.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_KERNELS_CUDA_KERNELCONFIG_H
#define PIPEC_KERNELS_CUDA_KERNELCONFIG_H

namespace pipec::kernels::cuda {

struct KernelConfig {
  /// The Hopper kernels (wgmma, sm_90a: the attention forward) where the device has them, a
  /// compute-capability-9.0 GPU. false: the kernels an sm_80 GPU runs (mma.sync and SIMT), on
  /// every device; for telling a wrong result of a Hopper kernel from one of the others on a
  /// GPU, and for measuring both (PIPEC_ATTENTION_WGMMA=0 in piperun's environment).
  bool hopperKernels = true;

  bool operator==(const KernelConfig &) const = default;
};

} // namespace pipec::kernels::cuda

#endif // PIPEC_KERNELS_CUDA_KERNELCONFIG_H
