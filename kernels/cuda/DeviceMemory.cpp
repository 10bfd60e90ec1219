#include "kernels/cuda/DeviceMemory.h"

#include <utility>

namespace pipec::kernels::cuda {

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
