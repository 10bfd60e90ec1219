//===- FakeCudaRuntime.cpp - The CUDA runtime calls the executor makes, on the host -===//
//
// Part of the emulated device (kernels/cuda/emu/README.md): the subset of libcudart (and the
// two cuBLAS status-name calls of kernels/cuda/CudaCheck.cpp) that the cuda backend's host code
// calls, implemented on the CPU so that runtime/cuda runs, and is tested, on a machine without
// a GPU. Device memory is host memory; every "asynchronous" call completes before it returns, so
// streams and events only need to exist. Two things are kept honest on purpose:
//   - freed device memory (cudaFree, cudaFreeAsync) is filled with NaN bytes and not reused for
//     a while, so a kernel that reads a buffer after its owner gave it back reads NaN, which the
//     gradient checks see;
//   - memory is counted: cudaMemGetInfo reports a fixed total minus what is allocated, and the
//     default pool's used-memory high-water mark (cudaMemPoolAttrUsedMemHigh) follows the
//     stream-ordered allocations, so the no-allocation-inside-a-step test means the same here.
// One device, index 0. Thread-safe (one mutex).
//
//===----------------------------------------------------------------------===//
#include <cublas_api.h>
#include <cuda_runtime_api.h>

#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <unordered_map>

namespace {

constexpr size_t kTotalBytes = size_t(16) << 30;
constexpr size_t kQuarantineBytes = size_t(256) << 20;

struct State {
  std::mutex mu;
  struct Block {
    size_t bytes;
    bool streamOrdered;
    bool pinned;
  };
  std::unordered_map<void *, Block> live;
  std::deque<std::pair<void *, size_t>> quarantine; // freed, poisoned, not yet given back
  size_t quarantined = 0;
  size_t deviceBytes = 0, poolUsed = 0, poolHigh = 0;
};

State &state() {
  static State s;
  return s;
}

thread_local int currentDevice = 0;
int defaultPool; // its address is the default pool's handle

cudaError_t allocate(void **p, size_t bytes, bool streamOrdered, bool pinned) {
  if (!p)
    return cudaErrorInvalidValue;
  State &s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (!pinned && s.deviceBytes + bytes > kTotalBytes)
    return cudaErrorMemoryAllocation;
  void *mem = std::aligned_alloc(256, (bytes + 255) / 256 * 256 + 256);
  if (!mem)
    return cudaErrorMemoryAllocation;
  s.live[mem] = {bytes, streamOrdered, pinned};
  if (!pinned)
    s.deviceBytes += bytes;
  if (streamOrdered) {
    s.poolUsed += bytes;
    s.poolHigh = std::max(s.poolHigh, s.poolUsed);
  }
  *p = mem;
  return cudaSuccess;
}

cudaError_t release(void *p) {
  if (!p)
    return cudaSuccess;
  State &s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.live.find(p);
  if (it == s.live.end())
    return cudaErrorInvalidValue;
  State::Block b = it->second;
  s.live.erase(it);
  if (!b.pinned)
    s.deviceBytes -= b.bytes;
  if (b.streamOrdered)
    s.poolUsed -= b.bytes;
  std::memset(p, 0xff, b.bytes); // all-ones floats are NaN
  s.quarantine.emplace_back(p, b.bytes);
  s.quarantined += b.bytes;
  while (s.quarantined > kQuarantineBytes) {
    auto [old, bytes] = s.quarantine.front();
    s.quarantine.pop_front();
    s.quarantined -= bytes;
    std::free(old);
  }
  return cudaSuccess;
}

template <typename T> T fakeHandle() { return reinterpret_cast<T>(new char[1]); }
template <typename T> void dropHandle(T h) { delete[] reinterpret_cast<char *>(h); }

} // namespace

extern "C" {

cudaError_t cudaGetDeviceCount(int *count) {
  *count = 1;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  if (device != 0)
    return cudaErrorInvalidDevice;
  currentDevice = device;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int *device) {
  *device = currentDevice;
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize(void) { return cudaSuccess; }
cudaError_t cudaGetLastError(void) { return cudaSuccess; }
cudaError_t cudaPeekAtLastError(void) { return cudaSuccess; }

const char *cudaGetErrorName(cudaError_t error) {
  switch (error) {
  case cudaSuccess:
    return "cudaSuccess";
  case cudaErrorInvalidValue:
    return "cudaErrorInvalidValue";
  case cudaErrorMemoryAllocation:
    return "cudaErrorMemoryAllocation";
  case cudaErrorInvalidDevice:
    return "cudaErrorInvalidDevice";
  case cudaErrorNotReady:
    return "cudaErrorNotReady";
  default:
    return "cudaErrorUnknown";
  }
}
const char *cudaGetErrorString(cudaError_t error) {
  switch (error) {
  case cudaSuccess:
    return "no error";
  case cudaErrorInvalidValue:
    return "invalid argument";
  case cudaErrorMemoryAllocation:
    return "out of memory";
  case cudaErrorInvalidDevice:
    return "invalid device ordinal";
  default:
    return "unknown error (emulated device)";
  }
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *stream, unsigned int) {
  *stream = fakeHandle<cudaStream_t>();
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  dropHandle(stream);
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaStreamQuery(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t, unsigned int) { return cudaSuccess; }

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int) {
  *event = fakeHandle<cudaEvent_t>();
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t event) {
  dropHandle(event);
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t) { return cudaSuccess; }
cudaError_t cudaEventQuery(cudaEvent_t) { return cudaSuccess; }

cudaError_t cudaMalloc(void **devPtr, size_t size) { return allocate(devPtr, size, false, false); }
cudaError_t cudaFree(void *devPtr) { return release(devPtr); }
cudaError_t cudaMallocAsync(void **devPtr, size_t size, cudaStream_t) {
  return allocate(devPtr, size, true, false);
}
cudaError_t cudaFreeAsync(void *devPtr, cudaStream_t) { return release(devPtr); }
cudaError_t cudaMallocHost(void **ptr, size_t size) { return allocate(ptr, size, false, true); }
cudaError_t cudaFreeHost(void *ptr) { return release(ptr); }

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, enum cudaMemcpyKind,
                            cudaStream_t) {
  if (count)
    std::memmove(dst, src, count);
  return cudaSuccess;
}
cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, enum cudaMemcpyKind) {
  if (count)
    std::memmove(dst, src, count);
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void *devPtr, int value, size_t count, cudaStream_t) {
  std::memset(devPtr, value, count);
  return cudaSuccess;
}
cudaError_t cudaMemset(void *devPtr, int value, size_t count) {
  std::memset(devPtr, value, count);
  return cudaSuccess;
}
cudaError_t cudaMemGetInfo(size_t *free, size_t *total) {
  State &s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  *total = kTotalBytes;
  *free = kTotalBytes - s.deviceBytes;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t *memPool, int device) {
  if (device != 0)
    return cudaErrorInvalidDevice;
  *memPool = reinterpret_cast<cudaMemPool_t>(&defaultPool);
  return cudaSuccess;
}
cudaError_t cudaMemPoolTrimTo(cudaMemPool_t, size_t) { return cudaSuccess; }
cudaError_t cudaMemPoolGetAttribute(cudaMemPool_t, enum cudaMemPoolAttr attr, void *value) {
  State &s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  switch (attr) {
  case cudaMemPoolAttrUsedMemHigh:
    *static_cast<uint64_t *>(value) = s.poolHigh;
    return cudaSuccess;
  case cudaMemPoolAttrUsedMemCurrent:
    *static_cast<uint64_t *>(value) = s.poolUsed;
    return cudaSuccess;
  default:
    return cudaErrorInvalidValue;
  }
}
cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t, enum cudaMemPoolAttr attr, void *value) {
  State &s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (attr != cudaMemPoolAttrUsedMemHigh || *static_cast<uint64_t *>(value) != 0)
    return cudaErrorInvalidValue;
  s.poolHigh = s.poolUsed; // "reset": from the current use
  return cudaSuccess;
}

const char *cublasGetStatusName(cublasStatus_t) { return "CUBLAS_STATUS_NOT_SUPPORTED"; }
const char *cublasGetStatusString(cublasStatus_t) { return "cuBLAS is not emulated"; }

} // extern "C"
