//===- Dialect.h - The two CUDA spellings the kernel emulator replaces -*- CUDA -*-===//
//
// Every .cu file launches kernels and declares dynamic shared memory through these macros, so
// that both nvcc and the host compiler of the kernel emulator (kernels/cuda/emu/KernelEmu.h,
// which defines them its own way first) read the same source:
//   PIPEC_LAUNCH(grid, block, sharedBytes, stream, kernel)(args...);  // kernel<<<...>>>(args...)
//   PIPEC_DYNAMIC_SHARED(T, name);                                      // extern __shared__ T
//   name[]
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_KERNELS_CUDA_DIALECT_H
#define PIPEC_KERNELS_CUDA_DIALECT_H

#ifndef PIPEC_KERNEL_EMU
#define PIPEC_LAUNCH(grid, block, sharedBytes, stream, ...)                                        \
  __VA_ARGS__<<<grid, block, sharedBytes, stream>>>
#define PIPEC_DYNAMIC_SHARED(T, name) extern __shared__ T name[]
#endif

#endif // PIPEC_KERNELS_CUDA_DIALECT_H
