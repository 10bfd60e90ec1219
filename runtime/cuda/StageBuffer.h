//===- StageBuffer.h - Device buffers from a context's allocator -----*- C++ -*-===//
//
// The RAII buffer GpuStage keeps its activations and saved state in, and the cuda backend its
// received tensors and kept gradients: memory of a DeviceAllocator (the rank's arena in the
// executor), given back when dropped on the host.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_CUDA_STAGEBUFFER_H
#define PIPEC_RUNTIME_CUDA_STAGEBUFFER_H

#include "kernels/cuda/CudaCheck.h"
#include "kernels/cuda/CudaOps.h"

#include <cuda_runtime_api.h>

#include <span>
#include <utility>

namespace pipec {

/// Where a stage's buffers come from: the context's allocator (the rank's arena in the
/// executor), and the stream their memsets and copies are queued on.
struct Mem {
  kernels::cuda::DeviceAllocator *from;
  cudaStream_t stream;
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
    if (zero)
      PIPEC_CUDA_TRY(cudaMemsetAsync(ptr, 0, n * sizeof(T), m.stream));
    return llvm::Error::success();
  }
  /// A copy of `src` (device), queued on the stream.
  llvm::Error copyFrom(const Mem &m, std::span<const T> src) {
    if (llvm::Error err = allocate(m, src.size()))
      return err;
    if (!src.empty())
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

} // namespace pipec

#endif // PIPEC_RUNTIME_CUDA_STAGEBUFFER_H
