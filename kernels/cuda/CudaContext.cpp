//===- CudaContext.cpp - CUDA contexts, in every backend flavour ----------===//
//
// CudaOps.h's CudaContext and deviceCount(), once for the GPU and the emulated device (whose
// runtime calls the fake runtime answers); the matmuls' part of a context is each flavour's
// (ContextImpl.h).
//
//===----------------------------------------------------------------------===//
#include "kernels/cuda/ContextImpl.h"

#include "kernels/cuda/CudaCheck.h"

#include <utility>

namespace pipec::kernels::cuda {

llvm::Expected<int> deviceCount() {
  int count = 0;
  PIPEC_CUDA_TRY(cudaGetDeviceCount(&count));
  return count;
}

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
  auto matmul = createMatmulState(impl->stream);
  if (!matmul)
    return matmul.takeError();
  impl->matmul = std::move(*matmul);
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

// Queued on the stream, then waited for (nothing in the sizing pass).
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

} // namespace pipec::kernels::cuda
