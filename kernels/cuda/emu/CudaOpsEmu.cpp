//===- CudaOpsEmu.cpp - contexts and matmuls of the emulated device -----------===//
//
// The CudaOps.h contract computed by the CPU reference ops (kernels/cpu/Ops.h), for the emulated
// device (kernels/cuda/emu/README.md): "device" pointers are host memory from the fake runtime
// (FakeCudaRuntime.cpp); each op's work runs in its context's stream order (emu::enqueue: at
// once, or on the stream's worker thread in asynchronous mode). Where the CUDA API departs
// from the CPU one it is followed here too: attention keeps a log-sum-exp per query row and its
// backward recomputes the probabilities from it; cross entropy keeps a log-sum-exp per row and
// returns per-row losses. This file has the contexts and the matmuls (cuBLASLt's part; fp32, and
// bf16 by widening); the rest of the ops come either from
// CpuKernelOpsEmu.cpp (CPU loops, :cuda_ops_emu) or from the hand-written .cu kernels themselves
// run by the kernel emulator (KernelEmu.h, :cuda_ops_kernel_emu).
//
//===----------------------------------------------------------------------===//
#include "kernels/cuda/CudaOps.h"

#include "kernels/cpu/Ops.h"
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

llvm::Expected<int> deviceCount() {
  int count = 0;
  PIPEC_CUDA_TRY(cudaGetDeviceCount(&count));
  return count;
}

//===--- Context and buffers ----------------------------------------------===//

struct CudaContext::Impl {
  int device = 0;
  int computeCapability = 0;
  KernelConfig config;
  cudaStream_t stream = nullptr;
  bool ownsStream = false;
  StreamOrderedAllocator streamOrdered;
  DeviceAllocator *allocator = &streamOrdered;
  bool sizing = false;
  bool workspaceCharged = false; // cuBLASLt's, which the emulated matmuls do not need
  ~Impl() {
    if (workspaceCharged)
      emu::unchargeDeviceMemory(CudaContext::kWorkspaceBytes);
    if (stream && ownsStream)
      (void)cudaStreamDestroy(stream);
  }
};

CudaContext::CudaContext(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaContext::~CudaContext() = default;

llvm::Expected<std::unique_ptr<CudaContext>>
CudaContext::create(int device, const KernelConfig &config, void *stream) {
  auto impl = std::make_unique<Impl>();
  impl->device = device;
  impl->config = config;
  PIPEC_CUDA_TRY(cudaSetDevice(device));
  auto capability = computeCapabilityOf(device);
  if (!capability)
    return capability.takeError();
  impl->computeCapability = *capability;
  if (stream) {
    impl->stream = static_cast<cudaStream_t>(stream);
  } else {
    PIPEC_CUDA_TRY(cudaStreamCreateWithFlags(&impl->stream, cudaStreamNonBlocking));
    impl->ownsStream = true;
  }
  impl->streamOrdered.stream = impl->stream;
  // The device memory the real context's workspace takes (CudaOps.cpp), counted, not allocated.
  PIPEC_CUDA_TRY(emu::chargeDeviceMemory(kWorkspaceBytes));
  impl->workspaceCharged = true;
  return std::unique_ptr<CudaContext>(new CudaContext(std::move(impl)));
}

int CudaContext::device() const { return impl_->device; }
void *CudaContext::stream() const { return impl_->stream; }
int CudaContext::computeCapability() const { return impl_->computeCapability; }
const KernelConfig &CudaContext::kernelConfig() const { return impl_->config; }
llvm::Error CudaContext::synchronize() {
  PIPEC_QUEUE_TRY(*this, cudaStreamSynchronize(impl_->stream));
  return llvm::Error::success();
}

// As the real ones: queued on the stream, then waited for (nothing in the sizing pass).
llvm::Error CudaContext::upload(void *device, const void *host, size_t bytes) {
  PIPEC_QUEUE_TRY(*this,
                  cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, impl_->stream));
  PIPEC_QUEUE_TRY(*this, cudaStreamSynchronize(impl_->stream));
  return llvm::Error::success();
}
llvm::Error CudaContext::download(void *host, const void *device, size_t bytes) {
  PIPEC_QUEUE_TRY(*this,
                  cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, impl_->stream));
  PIPEC_QUEUE_TRY(*this, cudaStreamSynchronize(impl_->stream));
  return llvm::Error::success();
}
llvm::Error CudaContext::memsetZero(void *device, size_t bytes) {
  PIPEC_QUEUE_TRY(*this, cudaMemsetAsync(device, 0, bytes, impl_->stream));
  return llvm::Error::success();
}

void CudaContext::setAllocator(DeviceAllocator *allocator) {
  impl_->allocator = allocator ? allocator : &impl_->streamOrdered;
}
DeviceAllocator &CudaContext::allocator() { return *impl_->allocator; }

void CudaContext::setSizing(bool on) { impl_->sizing = on; }
bool CudaContext::sizing() const { return impl_->sizing; }

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
