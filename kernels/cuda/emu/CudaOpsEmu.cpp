//===- CudaOpsEmu.cpp - contexts and matmuls of the emulated device -----------===//
//
// The CudaOps.h contract computed by the CPU reference ops (kernels/cpu/Ops.h), for the emulated
// device (kernels/cuda/emu/README.md): "device" pointers are host memory from the fake runtime
// (FakeCudaRuntime.cpp); each op's work runs in its context's stream order (emu::enqueue: at
// once, or on the stream's worker thread in asynchronous mode). Where the CUDA API departs
// from the CPU one it is followed here too: attention keeps a log-sum-exp per query row and its
// backward recomputes the probabilities from it; cross entropy keeps a log-sum-exp per row and
// returns per-row losses. This file has the matmuls (cuBLASLt's part; fp32, and bf16 by
// widening) and their part of a context (CudaContext.cpp has the rest); the rest of the ops come
// either from CpuKernelOpsEmu.cpp (CPU loops, :cuda_ops_emu) or from the hand-written .cu kernels
// themselves run by the kernel emulator (KernelEmu.h, :cuda_ops_kernel_emu).
//
//===----------------------------------------------------------------------===//
#include "kernels/cuda/CudaOps.h"

#include "kernels/cpu/Ops.h"
#include "kernels/cuda/ContextImpl.h"
#include "kernels/cuda/CudaCheck.h"
#include "kernels/cuda/DeviceMemory.h"
#include "kernels/cuda/emu/EmuOps.h"
#include "kernels/cuda/emu/FakeCuda.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

namespace pipec::kernels::cuda {

namespace ops = kernels::ops;

using emu_ops::run;

//===--- The matmuls' part of a context ------------------------------------===//

/// The device memory the real context's cuBLASLt workspace takes (CudaOps.cpp), counted, not
/// allocated: the emulated matmuls need none.
struct MatmulState {
  bool charged = false;
  ~MatmulState() {
    if (charged)
      emu::unchargeDeviceMemory(CudaContext::kWorkspaceBytes);
  }
};

void MatmulStateDeleter::operator()(MatmulState *state) const { delete state; }

llvm::Expected<MatmulStatePtr> createMatmulState(cudaStream_t) {
  MatmulStatePtr state(new MatmulState);
  PIPEC_CUDA_TRY(emu::chargeDeviceMemory(CudaContext::kWorkspaceBytes));
  state->charged = true;
  return state;
}

//===--- Matmuls ----------------------------------------------------------===//
//
// fp32 as the CPU ops compute them; bf16 (for callers such as cuda_kernel_bench's smoke run) by
// widening the bf16 operands, computing in fp32 and rounding the output to bf16 — the precision
// model of cuBLASLt's bf16 GEMMs with fp32 accumulation, not its summation order.

using emu_ops::Narrowed;
using emu_ops::Widened;

llvm::Error matmulForward(CudaContext &ctx, DType dtype, void *out, const void *in, const void *w,
                          const void *bias, int n, int i, int o) {
  return run(ctx, [=] {
    Widened x(in, size_t(n) * i, dtype), wt(w, size_t(i) * o, dtype), b(bias, size_t(o), dtype);
    Narrowed y(out, size_t(n) * o, dtype);
    ops::matmulForward(y.data, x.data, wt.data, b.data, n, i, o);
    y.done();
  });
}
llvm::Error matmulBackwardInput(CudaContext &ctx, DType dtype, void *dIn, const void *dOut,
                                const void *w, int n, int i, int o) {
  return run(ctx, [=] {
    Widened dy(dOut, size_t(n) * o, dtype), wt(w, size_t(i) * o, dtype);
    Narrowed dx(dIn, size_t(n) * i, dtype);
    ops::matmulBackwardInput(dx.data, dy.data, wt.data, n, i, o);
    dx.done();
  });
}
llvm::Error matmulBackwardWeight(CudaContext &ctx, DType dtype, float *dW, float *dBias,
                                 const void *in, const void *dOut, int n, int i, int o) {
  return run(ctx, [=] {
    Widened x(in, size_t(n) * i, dtype), dy(dOut, size_t(n) * o, dtype);
    ops::matmulBackwardWeight(dW, dBias, x.data, dy.data, n, i, o);
  });
}
llvm::Error matmulTForward(CudaContext &ctx, DType dtype, void *out, const void *in, const void *w,
                           int n, int i, int o) {
  return run(ctx, [=] {
    Widened x(in, size_t(n) * i, dtype), wt(w, size_t(o) * i, dtype);
    Narrowed y(out, size_t(n) * o, dtype);
    ops::matmulTForward(y.data, x.data, wt.data, n, i, o);
    y.done();
  });
}
llvm::Error matmulTBackwardInput(CudaContext &ctx, DType dtype, void *dIn, const void *dOut,
                                 const void *w, int n, int i, int o) {
  return run(ctx, [=] {
    Widened dy(dOut, size_t(n) * o, dtype), wt(w, size_t(o) * i, dtype);
    Narrowed dx(dIn, size_t(n) * i, dtype);
    ops::matmulTBackwardInput(dx.data, dy.data, wt.data, n, i, o);
    dx.done();
  });
}
llvm::Error matmulTBackwardWeight(CudaContext &ctx, DType dtype, float *dW, const void *in,
                                  const void *dOut, int n, int i, int o) {
  return run(ctx, [=] {
    Widened x(in, size_t(n) * i, dtype), dy(dOut, size_t(n) * o, dtype);
    ops::matmulTBackwardWeight(dW, x.data, dy.data, n, i, o);
  });
}

} // namespace pipec::kernels::cuda
