#include "kernels/cuda/DeviceMemory.h"

#include <fmt/format.h>

#include <utility>

namespace pipec::kernels::cuda {

llvm::Expected<int> computeCapabilityOf(int device) {
  int major = 0, minor = 0;
  PIPEC_CUDA_TRY(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  PIPEC_CUDA_TRY(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  const int capability = 10 * major + minor;
  if (capability < CudaContext::kMinComputeCapability)
    return llvm::createStringError(
        llvm::inconvertibleErrorCode(),
        fmt::format("GPU {} has compute capability {}.{}; this build has kernels for compute "
                    "capability {}.{} and newer (sm_80 code: A100 and later; sm_90a code: H100, "
                    "H200); run on a newer GPU",
                    device, major, minor, CudaContext::kMinComputeCapability / 10,
                    CudaContext::kMinComputeCapability % 10));
  return capability;
}

llvm::Expected<DeviceBuffer> DeviceBuffer::allocate(size_t bytes) {
  DeviceBuffer buffer;
  if (bytes == 0)
    return buffer;
  PIPEC_CUDA_TRY(cudaMalloc(&buffer.ptr_, bytes));
  buffer.bytes_ = bytes;
  return buffer;
}

DeviceBuffer::DeviceBuffer(DeviceBuffer &&other) noexcept
    : ptr_(std::exchange(other.ptr_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

DeviceBuffer &DeviceBuffer::operator=(DeviceBuffer &&other) noexcept {
  if (this != &other) {
    if (ptr_)
      (void)cudaFree(ptr_);
    ptr_ = std::exchange(other.ptr_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_)
    (void)cudaFree(ptr_);
}

} // namespace pipec::kernels::cuda
