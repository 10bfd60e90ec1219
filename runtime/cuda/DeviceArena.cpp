#include "runtime/cuda/DeviceArena.h"

#include "kernels/cuda/CudaCheck.h"

#include <fmt/format.h>

#include <cassert>

namespace pipec {

namespace {
double mib(size_t bytes) { return double(bytes) / double(1 << 20); }
} // namespace

DeviceArena::~DeviceArena() {
  if (!base)
    for (auto &[p, placed] : live)
      (void)cudaFreeAsync(p, stream);
  if (base)
    (void)cudaFree(base);
}

llvm::Expected<void *> DeviceArena::allocate(size_t bytes) {
  if (bytes == 0)
    return nullptr;
  auto at = placement.allocate(bytes);
  if (!at)
    return llvm::createStringError(
        llvm::inconvertibleErrorCode(),
        fmt::format("{}: the activation arena ({:.1f} MiB, sized by the warm-up step) has no room "
                    "for {} more bytes ({:.1f} MiB in use): this step allocates more than the "
                    "warm-up did, which the executor does not expect; please report it with the "
                    "plan",
                    who, mib(placement.capacity()), bytes, mib(placement.inUse())));
  void *p = nullptr;
  if (base) {
    p = base + *at;
  } else {
    cudaError_t status = cudaMallocAsync(&p, bytes, stream);
    if (status != cudaSuccess) {
      placement.release(*at);
      return kernels::cuda::makeCudaError("cudaMallocAsync(&p, bytes, stream)", status, __FILE__,
                                          __LINE__);
    }
  }
  live[p] = Placed{*at, bytes};
  return p;
}

void DeviceArena::release(void *p) {
  if (!p)
    return;
  auto it = live.find(p);
  assert(it != live.end() && "released memory the arena did not hand out");
  placement.release(it->second.offset);
#ifdef PIPEC_EMULATED_DEVICE
  if (base)
    (void)cudaMemsetAsync(p, 0xff, it->second.bytes, stream);
#endif
  live.erase(it);
  if (!base)
    (void)cudaFreeAsync(p, stream);
}

llvm::Error DeviceArena::reserve() {
  assert(!reserved() && "reserved twice");
  if (placement.liveCount() != 0)
    return llvm::createStringError(
        llvm::inconvertibleErrorCode(),
        fmt::format("{}: {} buffers ({:.1f} MiB) are still live after the warm-up step; the "
                    "executor frees everything of a step by its end, so this is a bug",
                    who, placement.liveCount(), mib(placement.inUse())));
  size_t bytes = placement.highWater();
  placement = OffsetArena(bytes);
  reservedSize = bytes;
  if (bytes == 0) {
    reservedEmpty = true;
    return llvm::Error::success();
  }
  void *p = nullptr;
  cudaError_t status = cudaMalloc(&p, bytes);
  if (status != cudaSuccess)
    return llvm::createStringError(
        llvm::inconvertibleErrorCode(),
        fmt::format("{}: cannot reserve the {:.1f} MiB of activation memory the warm-up step "
                    "measured: {} ({}); use fewer microbatches in flight (a schedule with a "
                    "lower peak, e.g. 1f1b instead of gpipe), more pipeline stages or a smaller "
                    "microbatch",
                    who, mib(bytes), cudaGetErrorName(status), cudaGetErrorString(status)));
  base = static_cast<char *>(p);
  return llvm::Error::success();
}

llvm::Error releaseWarmUpMemory() {
  PIPEC_CUDA_TRY(cudaDeviceSynchronize());
  int device = 0;
  PIPEC_CUDA_TRY(cudaGetDevice(&device));
  cudaMemPool_t pool = nullptr;
  PIPEC_CUDA_TRY(cudaDeviceGetDefaultMemPool(&pool, device));
  PIPEC_CUDA_TRY(cudaMemPoolTrimTo(pool, 0));
  return llvm::Error::success();
}

} // namespace pipec
