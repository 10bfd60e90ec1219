//===- StageBuffer.h - Device buffers from a context's allocator -----*- C++ -*-===//
//
// The RAII buffers GpuStage keeps its activations and saved state in, and the cuda backend its
// received tensors and kept gradients: memory of a DeviceAllocator (the rank's arena in the
// executor), given back when dropped on the host. StreamBuffer<T> has a fixed element type (fp32
// statistics); DeviceTensor's is chosen at allocation (activations in the compute type).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_CUDA_STAGEBUFFER_H
#define PIPEC_RUNTIME_CUDA_STAGEBUFFER_H

#include "kernels/cuda/CudaCheck.h"
#include "kernels/cuda/CudaOps.h"
#include "runtime/Tensor.h"

#include <cuda_runtime_api.h>

#include <cstddef>
#include <span>
#include <utility>

namespace pipec {

/// Where a stage's buffers come from: the context's allocator (the rank's arena in the
/// executor), and the stream their memsets and copies are queued on; none are queued in the
/// context's sizing pass (kernels::cuda::CudaContext::setSizing).
struct Mem {
  kernels::cuda::DeviceAllocator *from;
  cudaStream_t stream;
  bool sizing = false;
};

/// Device memory of the stage's allocator, given back when dropped on the host: the allocator
/// reuses it only for work queued after everything that read it (kernels/cuda/CudaOps.h).
template <typename T> class StreamBuffer {
public:
  StreamBuffer() = default;
  StreamBuffer(StreamBuffer &&o) noexcept
      : ptr(std::exchange(o.ptr, nullptr)), count(std::exchange(o.count, 0)), from(o.from) {}
  StreamBuffer &operator=(StreamBuffer &&o) noexcept {
    if (this != &o) {
      reset();
      ptr = std::exchange(o.ptr, nullptr);
      count = std::exchange(o.count, 0);
      from = o.from;
    }
    return *this;
  }
  StreamBuffer(const StreamBuffer &) = delete;
  StreamBuffer &operator=(const StreamBuffer &) = delete;
  ~StreamBuffer() { reset(); }

  llvm::Error allocate(const Mem &m, size_t n, bool zero = false) {
    reset();
    from = m.from;
    if (n == 0)
      return llvm::Error::success();
    auto p = from->allocate(n * sizeof(T));
    if (!p)
      return p.takeError();
    ptr = static_cast<T *>(*p);
    count = n;
    if (zero && !m.sizing)
      PIPEC_CUDA_TRY(cudaMemsetAsync(ptr, 0, n * sizeof(T), m.stream));
    return llvm::Error::success();
  }
  /// A copy of `src` (device), queued on the stream.
  llvm::Error copyFrom(const Mem &m, std::span<const T> src) {
    if (llvm::Error err = allocate(m, src.size()))
      return err;
    if (!src.empty() && !m.sizing)
      PIPEC_CUDA_TRY(cudaMemcpyAsync(ptr, src.data(), src.size() * sizeof(T),
                                     cudaMemcpyDeviceToDevice, m.stream));
    return llvm::Error::success();
  }
  void reset() {
    if (ptr)
      from->release(ptr);
    ptr = nullptr;
    count = 0;
  }

  T *data() const { return ptr; }
  size_t size() const { return count; }
  bool empty() const { return count == 0; }
  std::span<T> span() const { return {ptr, count}; }

private:
  T *ptr = nullptr;
  size_t count = 0;
  kernels::cuda::DeviceAllocator *from = nullptr;
};

/// A tensor of the allocator's memory whose element type is chosen when it is allocated.
class DeviceTensor {
public:
  DeviceTensor() = default;
  DeviceTensor(DeviceTensor &&o) noexcept
      : bytes(std::move(o.bytes)), count(std::exchange(o.count, 0)), type(o.type) {}
  DeviceTensor &operator=(DeviceTensor &&o) noexcept {
    if (this != &o) {
      bytes = std::move(o.bytes);
      count = std::exchange(o.count, 0);
      type = o.type;
    }
    return *this;
  }

  llvm::Error allocate(const Mem &m, size_t n, DType dtype, bool zero = false) {
    type = dtype;
    count = n;
    if (llvm::Error err = bytes.allocate(m, n * kernels::sizeOf(dtype), zero)) {
      count = 0;
      return err;
    }
    return llvm::Error::success();
  }
  /// A copy of `src` (device), queued on the stream; the same element type.
  llvm::Error copyFrom(const Mem &m, TensorView src) {
    if (llvm::Error err = allocate(m, src.count, src.type))
      return err;
    if (!src.empty() && !m.sizing)
      PIPEC_CUDA_TRY(
          cudaMemcpyAsync(data(), src.data, src.bytes(), cudaMemcpyDeviceToDevice, m.stream));
    return llvm::Error::success();
  }
  void reset() {
    bytes.reset();
    count = 0;
  }

  void *data() const { return bytes.data(); }
  size_t size() const { return count; }
  bool empty() const { return count == 0; }
  DType dtype() const { return type; }
  TensorView view() const { return {bytes.data(), count, type}; }

private:
  StreamBuffer<std::byte> bytes;
  size_t count = 0;
  DType type = DType::F32;
};

} // namespace pipec

#endif // PIPEC_RUNTIME_CUDA_STAGEBUFFER_H
