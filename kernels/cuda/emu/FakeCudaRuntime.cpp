//===- FakeCudaRuntime.cpp - The CUDA runtime calls the executor makes, on the host -===//
//
// Part of the emulated device (kernels/cuda/emu/README.md): the subset of libcudart (and the
// two cuBLAS status-name calls of kernels/cuda/CudaCheck.cpp) that the cuda backend's host code
// calls, implemented on the CPU so that runtime/cuda runs, and is tested, on a machine without
// a GPU. Device memory is host memory. By default every "asynchronous" call completes before it
// returns, so streams and events only need to exist; with PIPEC_EMU_ASYNC=1 each stream is a
// worker thread that runs its work in order, waits for the events it was told to wait for (the
// latest record at the time of the wait, as CUDA's), and pauses at random, so that streams
// overlap and a missing wait shows (FakeCuda.h). Three things are kept honest on purpose:
//   - freed device memory (cudaFree, cudaFreeAsync) is filled with NaN bytes and not reused for
//     a while, so a kernel that reads a buffer after its owner gave it back reads NaN, which the
//     gradient checks see;
//   - memory is counted: cudaMemGetInfo reports a fixed total (16 GiB, or
//     pipec::emu::setDeviceMemory's) minus what is allocated, an allocation past it fails, and
//     the default pool's used-memory high-water mark (cudaMemPoolAttrUsedMemHigh) follows the
//     stream-ordered allocations, so the no-allocation-inside-a-step test means the same here.
//   - every allocation has guard bytes on both sides (kGuardBytes before it, and from its end to
//     kGuardBytes past the next multiple of 256), which read as NaN in fp32 and bf16: a kernel
//     that reads past a buffer's end computes with NaN, which the checks against the CPU see,
//     and one that writes there ends the process when the buffer is freed (or at
//     cudaDeviceSynchronize), naming the allocation and the first byte it changed.
// One device, index 0. Thread-safe (one mutex).
//
//===----------------------------------------------------------------------===//
#include "kernels/cuda/emu/FakeCuda.h"

#include <cublas_api.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <unordered_map>
#include <utility>

namespace {

/// The device's memory (pipec::emu::setDeviceMemory; 0: PIPEC_EMU_DEVICE_MIB MiB where the
/// environment sets it, for a test of a whole program, else 16 GiB).
std::atomic<size_t> deviceMemory{0};
size_t totalBytes() {
  static const size_t byDefault = [] {
    const char *mib = std::getenv("PIPEC_EMU_DEVICE_MIB");
    const long long n = mib ? std::atoll(mib) : 0;
    return n > 0 ? size_t(n) << 20 : size_t(16) << 30;
  }();
  const size_t set = deviceMemory.load();
  return set ? set : byDefault;
}
/// The device's compute capability, 10 major + minor (pipec::emu::setComputeCapability; 0:
/// PIPEC_EMU_COMPUTE_CAPABILITY where the environment sets it, for a test of a whole program,
/// else 90: the kernel emulator runs sm_90a code, and sm_80 code too).
std::atomic<int> computeCapabilitySet{0};
int computeCapability() {
  static const int byDefault = [] {
    const char *v = std::getenv("PIPEC_EMU_COMPUTE_CAPABILITY");
    if (!v)
      return 90;
    const int n = std::atoi(v);
    if (n < 10 || n > 999) {
      std::fprintf(stderr,
                   "emulated device: PIPEC_EMU_COMPUTE_CAPABILITY=%s: expected 10 major + minor, "
                   "such as 80 or 90\n",
                   v);
      std::abort();
    }
    return n;
  }();
  const int set = computeCapabilitySet.load();
  return set ? set : byDefault;
}
constexpr size_t kQuarantineBytes = size_t(256) << 20;
/// The guard in front of an allocation (which keeps its 256-byte alignment) and the least one
/// behind it.
constexpr size_t kGuardBytes = 256;
/// The guards' contents: 0x7fbf repeated, a NaN as a bf16 and (0x7fbf7fbf) as an fp32, and not
/// the freed-memory fill (0xff), so that a kernel that writes NaN past a buffer still shows.
constexpr unsigned char kGuardFill[2] = {0xbf, 0x7f};

/// The bytes behind an allocation of `bytes`: to the next multiple of 256, then kGuardBytes.
size_t tailBytes(size_t bytes) { return (bytes + 255) / 256 * 256 - bytes + kGuardBytes; }

void fillGuard(unsigned char *from, size_t n) {
  for (size_t i = 0; i < n; ++i)
    from[i] = kGuardFill[uintptr_t(from + i) & 1];
}

/// The first byte of [from, from + n) that is not the guard's, or n.
size_t firstChanged(const unsigned char *from, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (from[i] != kGuardFill[uintptr_t(from + i) & 1])
      return i;
  return n;
}

/// Ends the process if a write went past either end of the allocation at `p`: a sanitizer's
/// report, since a write outside a buffer on a GPU corrupts whatever lies there.
void checkGuards(const void *p, size_t bytes, const char *when) {
  const auto *user = static_cast<const unsigned char *>(p);
  const size_t front = firstChanged(user - kGuardBytes, kGuardBytes);
  const size_t tail = firstChanged(user + bytes, tailBytes(bytes));
  if (front == kGuardBytes && tail == tailBytes(bytes))
    return;
  if (front != kGuardBytes)
    std::fprintf(stderr,
                 "emulated device: a write before the start of a %zu-byte allocation at %p: "
                 "byte -%zu changed (found %s)\n",
                 bytes, p, kGuardBytes - front, when);
  else
    std::fprintf(stderr,
                 "emulated device: a write past the end of a %zu-byte allocation at %p: byte %zu "
                 "changed (found %s)\n",
                 bytes, p, bytes + tail, when);
  std::fflush(stderr);
  std::abort();
}

struct State {
  std::mutex mu;
  struct Block {
    size_t bytes;
    bool streamOrdered;
    bool pinned;
  };
  std::unordered_map<void *, Block> live;
  /// Freed, poisoned, not yet given back: (the allocation's start, its guards included; bytes).
  std::deque<std::pair<void *, size_t>> quarantine;
  size_t quarantined = 0;
  size_t deviceBytes = 0, poolUsed = 0, poolHigh = 0;
};

State &state() {
  static State s;
  return s;
}

thread_local int currentDevice = 0;
/// The launch error of the calling host thread (cudaGetLastError), as the real runtime keeps it.
thread_local cudaError_t lastError = cudaSuccess;
int defaultPool; // its address is the default pool's handle

cudaError_t allocate(void **p, size_t bytes, bool streamOrdered, bool pinned) {
  if (!p)
    return cudaErrorInvalidValue;
  State &s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (!pinned && s.deviceBytes + bytes > totalBytes())
    return cudaErrorMemoryAllocation;
  auto *mem =
      static_cast<unsigned char *>(std::aligned_alloc(256, kGuardBytes + bytes + tailBytes(bytes)));
  if (!mem)
    return cudaErrorMemoryAllocation;
  fillGuard(mem, kGuardBytes);
  fillGuard(mem + kGuardBytes + bytes, tailBytes(bytes));
  mem += kGuardBytes;
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
  checkGuards(p, b.bytes, "when it was freed");
  s.live.erase(it);
  if (!b.pinned)
    s.deviceBytes -= b.bytes;
  if (b.streamOrdered)
    s.poolUsed -= b.bytes;
  std::memset(p, 0xff, b.bytes); // all-ones floats are NaN
  s.quarantine.emplace_back(static_cast<unsigned char *>(p) - kGuardBytes, b.bytes);
  s.quarantined += b.bytes;
  while (s.quarantined > kQuarantineBytes) {
    auto [old, bytes] = s.quarantine.front();
    s.quarantine.pop_front();
    s.quarantined -= bytes;
    std::free(old);
  }
  return cudaSuccess;
}

/// A point in a stream's work: done once the stream has run everything queued before it.
struct Mark {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  void set() {
    {
      std::lock_guard<std::mutex> lock(mu);
      done = true;
    }
    cv.notify_all();
  }
  void wait() {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done; });
  }
};

/// A stream: in asynchronous mode a worker thread running its work in order.
struct FakeStream {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> work;
  size_t queued = 0, finished = 0;
  bool stopping = false;
  std::thread worker;
  std::minstd_rand rng;
  // The thread that created it stands for its process: a device-wide wait (cudaFree,
  // cudaDeviceSynchronize) waits for its own process's streams only, as on a real GPU, where
  // the other ranks of an emulated multi-process run (threads of this one) are other processes.
  std::thread::id creator = std::this_thread::get_id();

  explicit FakeStream(unsigned seed) : rng(seed) {
    if (pipec::emu::asynchronous())
      worker = std::thread([this] { run(); });
  }
  ~FakeStream() {
    if (worker.joinable()) {
      {
        std::lock_guard<std::mutex> lock(mu);
        stopping = true;
      }
      cv.notify_all();
      worker.join();
    }
  }
  void run() {
    for (;;) {
      std::function<void()> next;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return stopping || !work.empty(); });
        if (work.empty())
          return;
        next = std::move(work.front());
        work.pop_front();
      }
      // Random pauses: another stream gets ahead, as on a GPU.
      if (rng() % 4 == 0)
        std::this_thread::sleep_for(std::chrono::microseconds(rng() % 200));
      next();
      {
        std::lock_guard<std::mutex> lock(mu);
        ++finished;
      }
      cv.notify_all();
    }
  }
  /// Queues `fn`; returns how many pieces of work the stream has been given.
  size_t push(std::function<void()> fn) {
    size_t n;
    {
      std::lock_guard<std::mutex> lock(mu);
      work.push_back(std::move(fn));
      n = ++queued;
    }
    cv.notify_all();
    return n;
  }
  void drain() {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return finished == queued; });
  }
  bool idle() {
    std::lock_guard<std::mutex> lock(mu);
    return finished == queued;
  }
};

struct FakeEvent {
  std::mutex mu;
  std::shared_ptr<Mark> latest; // the most recent record
};

std::mutex streamsMu;
// Shared, so that a stream or event another thread is using outlives its destroy call.
std::unordered_map<cudaStream_t, std::shared_ptr<FakeStream>> streams;
std::unordered_map<cudaEvent_t, std::shared_ptr<FakeEvent>> events;
unsigned nextSeed = 1;

std::shared_ptr<FakeStream> streamOf(cudaStream_t s) {
  std::lock_guard<std::mutex> lock(streamsMu);
  auto it = streams.find(s);
  return it == streams.end() ? nullptr : it->second;
}

std::shared_ptr<FakeEvent> eventOf(cudaEvent_t e) {
  std::lock_guard<std::mutex> lock(streamsMu);
  auto it = events.find(e);
  return it == events.end() ? nullptr : it->second;
}

/// A device-wide wait of the calling thread's "process" (FakeStream::creator).
void synchronizeAll() {
  std::vector<std::shared_ptr<FakeStream>> all;
  {
    std::lock_guard<std::mutex> lock(streamsMu);
    for (auto &[h, s] : streams)
      if (s->creator == std::this_thread::get_id())
        all.push_back(s);
  }
  for (auto &s : all)
    s->drain();
}

} // namespace

namespace pipec::emu {

bool asynchronous() {
  static const bool on = [] {
    const char *v = std::getenv("PIPEC_EMU_ASYNC");
    return v && std::string(v) == "1";
  }();
  return on;
}

void setLastError(cudaError_t error) { lastError = error; }

bool hangs(const char *op) {
  static const std::string hanging = [] {
    const char *v = std::getenv("PIPEC_EMU_HANG_OP");
    return std::string(v ? v : "");
  }();
  return hanging == op;
}

void hangForever() {
  for (;;)
    std::this_thread::sleep_for(std::chrono::seconds(1));
}

void setDeviceMemory(size_t bytes) { deviceMemory = bytes; }
void setComputeCapability(int capability) { computeCapabilitySet = capability; }

cudaError_t chargeDeviceMemory(size_t bytes) {
  State &s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.deviceBytes + bytes > totalBytes())
    return cudaErrorMemoryAllocation;
  s.deviceBytes += bytes;
  return cudaSuccess;
}

void unchargeDeviceMemory(size_t bytes) {
  State &s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.deviceBytes -= bytes;
}

void fillGuard(cudaStream_t stream, void *buffer, size_t bytes, size_t n) {
  enqueue(stream, [=] { ::fillGuard(static_cast<unsigned char *>(buffer) + bytes, n); });
}

void checkGuard(cudaStream_t stream, const void *buffer, size_t bytes, size_t n,
                std::string owner) {
  enqueue(stream, [=, owner = std::move(owner)] {
    const size_t at = firstChanged(static_cast<const unsigned char *>(buffer) + bytes, n);
    if (at == n)
      return;
    std::fprintf(stderr,
                 "emulated device: a write past the end of a %zu-byte buffer at %p (%s): byte %zu "
                 "changed (found when it was released)\n",
                 bytes, buffer, owner.c_str(), bytes + at);
    std::fflush(stderr);
    std::abort();
  });
}

void enqueue(cudaStream_t stream, std::function<void()> work) {
  std::shared_ptr<FakeStream> s = asynchronous() ? streamOf(stream) : nullptr;
  if (!s) {
    work(); // synchronous mode, or the legacy default stream
    return;
  }
  // PIPEC_EMU_OP_DELAY_MS: every piece of work takes that much longer, as on a slow GPU (for
  // the tests of the watchdogs' progress: a long step that keeps progressing is no stall). At
  // exit the process then says how many pieces its busiest stream ran, which is how long (in
  // delays alone) the device was at least busy: a test knows the run was long without timing it.
  static const int delayMs = [] {
    const char *v = std::getenv("PIPEC_EMU_OP_DELAY_MS");
    return v ? std::atoi(v) : 0;
  }();
  if (delayMs <= 0) {
    s->push(std::move(work));
    return;
  }
  static std::atomic<size_t> busiest{0};
  static const bool reported = [] {
    std::atexit([] {
      std::fprintf(stderr,
                   "emulated device: the busiest stream ran %zu pieces of work, each "
                   "PIPEC_EMU_OP_DELAY_MS=%d ms longer\n",
                   busiest.load(), delayMs);
    });
    return true;
  }();
  (void)reported;
  const size_t n = s->push([work = std::move(work)] {
    std::this_thread::sleep_for(std::chrono::milliseconds(delayMs));
    work();
  });
  for (size_t seen = busiest.load(); n > seen && !busiest.compare_exchange_weak(seen, n);) {
  }
}

} // namespace pipec::emu

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
/// The emulated device is a compute-capability-9.0 one unless set otherwise (computeCapability).
cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int device) {
  if (device != 0)
    return cudaErrorInvalidDevice;
  switch (attr) {
  case cudaDevAttrComputeCapabilityMajor:
    *value = computeCapability() / 10;
    return cudaSuccess;
  case cudaDevAttrComputeCapabilityMinor:
    *value = computeCapability() % 10;
    return cudaSuccess;
  default:
    return cudaErrorInvalidValue;
  }
}
cudaError_t cudaDeviceSynchronize(void) {
  synchronizeAll();
  // Every live allocation, whichever thread made it (where ranks are threads, another rank's
  // streams may still run: a changed guard is an error wherever the write came from, but it
  // may then be found here by a rank that did not make it).
  State &s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  for (const auto &[p, b] : s.live)
    checkGuards(p, b.bytes, "at cudaDeviceSynchronize");
  return cudaSuccess;
}
cudaError_t cudaGetLastError(void) { return std::exchange(lastError, cudaSuccess); }
cudaError_t cudaPeekAtLastError(void) { return lastError; }

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
  case cudaErrorInvalidConfiguration:
    return "cudaErrorInvalidConfiguration";
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
  auto handle = reinterpret_cast<cudaStream_t>(new char[1]);
  std::lock_guard<std::mutex> lock(streamsMu);
  streams[handle] = std::make_shared<FakeStream>(nextSeed++);
  *stream = handle;
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  std::shared_ptr<FakeStream> s;
  {
    std::lock_guard<std::mutex> lock(streamsMu);
    auto it = streams.find(stream);
    if (it == streams.end())
      return cudaErrorInvalidValue;
    s = std::move(it->second);
    streams.erase(it);
  }
  s->drain();
  s.reset();
  delete[] reinterpret_cast<char *>(stream);
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  if (auto s = streamOf(stream))
    s->drain();
  return cudaSuccess;
}
cudaError_t cudaStreamQuery(cudaStream_t stream) {
  auto s = streamOf(stream);
  return !s || s->idle() ? cudaSuccess : cudaErrorNotReady;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int) {
  auto e = eventOf(event);
  if (!e)
    return cudaErrorInvalidValue;
  std::shared_ptr<Mark> mark;
  {
    std::lock_guard<std::mutex> lock(e->mu);
    mark = e->latest; // the record at the time of the wait, as CUDA's
  }
  if (mark)
    pipec::emu::enqueue(stream, [mark] { mark->wait(); });
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int) {
  auto handle = reinterpret_cast<cudaEvent_t>(new char[1]);
  std::lock_guard<std::mutex> lock(streamsMu);
  events[handle] = std::make_shared<FakeEvent>();
  *event = handle;
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t event) {
  {
    std::lock_guard<std::mutex> lock(streamsMu);
    events.erase(event);
  }
  delete[] reinterpret_cast<char *>(event);
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  auto e = eventOf(event);
  if (!e)
    return cudaErrorInvalidValue;
  auto mark = std::make_shared<Mark>();
  {
    std::lock_guard<std::mutex> lock(e->mu);
    e->latest = mark;
  }
  pipec::emu::enqueue(stream, [mark] { mark->set(); });
  return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t event) {
  auto e = eventOf(event);
  if (!e)
    return cudaErrorInvalidValue;
  std::lock_guard<std::mutex> lock(e->mu);
  if (!e->latest)
    return cudaSuccess;
  std::lock_guard<std::mutex> markLock(e->latest->mu);
  return e->latest->done ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaMalloc(void **devPtr, size_t size) { return allocate(devPtr, size, false, false); }
cudaError_t cudaFree(void *devPtr) {
  synchronizeAll(); // as CUDA's, which waits for the device
  return release(devPtr);
}
cudaError_t cudaMallocAsync(void **devPtr, size_t size, cudaStream_t) {
  return allocate(devPtr, size, true, false);
}
cudaError_t cudaFreeAsync(void *devPtr, cudaStream_t stream) {
  pipec::emu::enqueue(stream, [devPtr] { (void)release(devPtr); });
  return cudaSuccess;
}
cudaError_t cudaMallocHost(void **ptr, size_t size) { return allocate(ptr, size, false, true); }
cudaError_t cudaFreeHost(void *ptr) {
  synchronizeAll();
  return release(ptr);
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, enum cudaMemcpyKind,
                            cudaStream_t stream) {
  if (count)
    pipec::emu::enqueue(stream, [=] { std::memmove(dst, src, count); });
  return cudaSuccess;
}
cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, enum cudaMemcpyKind) {
  if (count)
    std::memmove(dst, src, count);
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void *devPtr, int value, size_t count, cudaStream_t stream) {
  pipec::emu::enqueue(stream, [=] { std::memset(devPtr, value, count); });
  return cudaSuccess;
}
cudaError_t cudaMemset(void *devPtr, int value, size_t count) {
  std::memset(devPtr, value, count);
  return cudaSuccess;
}
cudaError_t cudaMemGetInfo(size_t *free, size_t *total) {
  State &s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  *total = totalBytes();
  *free = *total > s.deviceBytes ? *total - s.deviceBytes : 0;
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

// The names of the statuses the code or its tests meet; cuBLAS itself is not emulated.
const char *cublasGetStatusName(cublasStatus_t status) {
  switch (status) {
  case CUBLAS_STATUS_SUCCESS:
    return "CUBLAS_STATUS_SUCCESS";
  case CUBLAS_STATUS_ALLOC_FAILED:
    return "CUBLAS_STATUS_ALLOC_FAILED";
  case CUBLAS_STATUS_INVALID_VALUE:
    return "CUBLAS_STATUS_INVALID_VALUE";
  default:
    return "CUBLAS_STATUS_NOT_SUPPORTED";
  }
}
const char *cublasGetStatusString(cublasStatus_t) { return "cuBLAS is not emulated"; }

} // extern "C"
