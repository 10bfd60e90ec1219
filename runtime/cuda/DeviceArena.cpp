#include "runtime/cuda/DeviceArena.h"

#include "ir/support/Bytes.h"
#include "kernels/cuda/CudaCheck.h"

#include <fmt/format.h>

#ifdef PIPEC_EMULATED_DEVICE
#include "kernels/cuda/emu/FakeCuda.h"
#endif

#include <cassert>
#include <cstddef>
#include <cstdint>

namespace pipec {

namespace {

/// Where the sizing pass's addresses start: a non-canonical address on x86-64 and AArch64, so
/// that reading one on the host faults at once (the emulated device's kernels run on the host),
/// and no device allocation can have it.
const uintptr_t kSizingBase = uintptr_t(1) << 63;

/// The bytes behind each buffer that hold the emulated device's guard (FakeCuda.h): a buffer
/// takes these on top of its own, in the sizing pass and in the steps alike. None on a GPU.
#ifdef PIPEC_EMULATED_DEVICE
constexpr size_t kGuardBytes = 256;
#else
constexpr size_t kGuardBytes = 0;
#endif

#ifdef PIPEC_EMULATED_DEVICE
/// The guard behind a buffer of `bytes`: what its placement holds past its end.
size_t guardOf(size_t bytes) { return OffsetArena::roundUp(bytes + kGuardBytes) - bytes; }
#endif

} // namespace

const OffsetArena &DeviceArena::sizes() const {
#ifdef PIPEC_EMULATED_DEVICE
  return unguarded;
#else
  return placement;
#endif
}

DeviceArena::~DeviceArena() {
  if (base)
    (void)cudaFree(base);
}

llvm::Expected<void *> DeviceArena::allocate(size_t bytes) {
  if (waitFailed != cudaSuccess)
    return llvm::createStringError(
        llvm::inconvertibleErrorCode(),
        fmt::format("{}: cudaStreamWaitEvent (a released buffer's wait for the p2p send that "
                    "reads it) failed: {} ({})",
                    who, cudaGetErrorName(waitFailed), cudaGetErrorString(waitFailed)));
  if (bytes == 0)
    return nullptr;
  auto noRoom = [&] {
    return llvm::createStringError(
        llvm::inconvertibleErrorCode(),
        fmt::format("{}: the activation arena ({:.1f} MiB, sized before step 0 by the sizing "
                    "pass) has no room for {} more bytes ({:.1f} MiB in use): this step "
                    "allocates more than the sizing pass did, which the executor does not "
                    "expect; please report it with the plan",
                    who, inMiB(reservedBytes()), bytes, inMiB(sizes().inUse())));
  };
  auto at = placement.allocate(bytes + kGuardBytes);
  if (!at)
    return noRoom();
#ifdef PIPEC_EMULATED_DEVICE
  // The same request without the guard, placed as a GPU's arena places it: where that has no
  // room, a GPU would fail here, and so does the emulated device.
  auto unguardedAt = unguarded.allocate(bytes);
  if (!unguardedAt) {
    placement.release(*at);
    return noRoom();
  }
#endif
  void *p = base ? static_cast<void *>(base + *at) : reinterpret_cast<void *>(kSizingBase + *at);
  live[p] = Placed{*at, bytes};
#ifdef PIPEC_EMULATED_DEVICE
  live[p].unguardedOffset = *unguardedAt;
  if (base)
    emu::fillGuard(stream, p, bytes, guardOf(bytes));
#endif
  return p;
}

void DeviceArena::release(void *p) {
  if (!p)
    return;
  auto it = live.find(p);
  assert(it != live.end() && "released memory the arena did not hand out");
  if (!reads.empty()) {
    // The latest read under the buffer: waiting for it covers the earlier ones too.
    const uintptr_t begin = reinterpret_cast<uintptr_t>(p), end = begin + it->second.bytes;
    size_t under = reads.size();
    for (size_t k = reads.size(); k-- > 0;)
      if (reads[k].begin < end && begin < reads[k].end) {
        under = k;
        break;
      }
    if (under < reads.size()) {
      cudaError_t status = cudaStreamWaitEvent(stream, reads[under].done, 0);
      if (status != cudaSuccess && waitFailed == cudaSuccess)
        waitFailed = status;
      reads.erase(reads.begin(), reads.begin() + std::ptrdiff_t(under) + 1);
    }
  }
  placement.release(it->second.offset);
#ifdef PIPEC_EMULATED_DEVICE
  unguarded.release(it->second.unguardedOffset);
  if (base) {
    const size_t bytes = it->second.bytes;
    emu::checkGuard(stream, p, bytes, guardOf(bytes),
                    fmt::format("{}'s activation arena, offset {}", who, it->second.offset));
    (void)cudaMemsetAsync(p, 0xff, bytes, stream);
  }
#endif
  live.erase(it);
}

void DeviceArena::readElsewhere(const void *data, size_t bytes, cudaEvent_t done) {
  if (bytes == 0)
    return;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data);
  reads.push_back(Read{begin, begin + bytes, done});
}

llvm::Error DeviceArena::reserve() {
  assert(!reserved() && "reserved twice");
  if (placement.liveCount() != 0)
    return llvm::createStringError(
        llvm::inconvertibleErrorCode(),
        fmt::format("{}: {} buffers ({:.1f} MiB) are still live after the sizing pass; the "
                    "executor frees everything of a step by its end, so this is a bug",
                    who, placement.liveCount(), inMiB(placement.inUse())));
  const size_t bytes = placement.highWater();
  void *p = nullptr;
  // (On failure nothing changes: the arena is still unreserved.)
  cudaError_t status = bytes == 0 ? cudaSuccess : cudaMalloc(&p, bytes);
  if (status != cudaSuccess) {
    size_t free = 0, total = 0;
    (void)cudaGetLastError(); // the failed allocation's error is not sticky: clear it
    const bool known = cudaMemGetInfo(&free, &total) == cudaSuccess;
    return llvm::createStringError(
        llvm::inconvertibleErrorCode(),
        fmt::format("{}: cannot reserve the {:.1f} MiB of activation memory the plan needs on "
                    "this rank{}: {} ({}); use fewer microbatches in flight (a schedule with a "
                    "lower peak, e.g. 1f1b instead of gpipe), more pipeline stages or a smaller "
                    "microbatch",
                    who, inMiB(bytes),
                    known
                        ? fmt::format(" ({:.1f} MiB of {:.1f} MiB free)", inMiB(free), inMiB(total))
                        : std::string(),
                    cudaGetErrorName(status), cudaGetErrorString(status)));
  }
  placement = OffsetArena(bytes);
#ifdef PIPEC_EMULATED_DEVICE
  unguarded = OffsetArena(unguarded.highWater());
#endif
  base = static_cast<char *>(p);
  return llvm::Error::success();
}

} // namespace pipec
