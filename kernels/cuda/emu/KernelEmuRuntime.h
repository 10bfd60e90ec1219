//===- KernelEmuRuntime.h - The kernel emulator's runtime calls ------*- C++ -*-===//
//
// What the device dialect of KernelEmu.h expands to; implemented by KernelEmu.cpp. Kept apart
// from KernelEmu.h, whose macros (threadIdx, blockDim, ...) would rename the runtime's own code.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_KERNELS_CUDA_EMU_KERNELEMURUNTIME_H
#define PIPEC_KERNELS_CUDA_EMU_KERNELEMURUNTIME_H

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>

namespace pipec::emu::kernel {

struct Index {
  unsigned x = 0, y = 0, z = 0;
};

/// The calling (emulated) thread's coordinates.
struct ThreadCoords {
  Index thread, block, blockDim, gridDim;
};
const ThreadCoords &coords();

/// Waits until every live thread of the block has arrived.
void syncThreads();
/// The calling thread's lane in its warp.
int laneId();
/// Every lane of the warp passes its `bits` and gets those of lane `srcLane`; `mask` names the
/// lanes taking part (each must reach the exchange; one that has exited is an error).
uint64_t exchange(uint64_t bits, int srcLane, uint32_t mask);
/// d += a b for the warp's m16n8k16 fragments (bf16 pairs in a, b; fp32 c/d), PTX ISA layout.
void mmaM16N8K16Bf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]);
/// ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 (Device.cuh's ldmatrixX4Trans): `row` is the
/// lane's row address (16-byte aligned, else the run ends as on a GPU).
void ldmatrixX4Trans(uint32_t (&r)[4], const void *row);
/// cp.async.cg.shared.global of 16 bytes (Device.cuh's cpAsync16): queued until a wait lands it
/// (or, in every other block, copied at once); both addresses 16-byte aligned and `shared` in
/// the block's dynamic shared memory, else the run ends.
void cpAsync16(void *shared, const void *global);
/// cp.async.cg.shared.global with a source size of 0 (Device.cuh's cpAsync16Zero): 16 zero
/// bytes, queued like a copy.
void cpAsync16Zero(void *shared);
/// mbarrier.init.shared::cta.b64 (Wgmma.cuh's mbarrierInit): `count` arrivals complete a phase.
void mbarrierInit(void *bar, unsigned count);
/// mbarrier.arrive.shared::cta.b64.
void mbarrierArrive(void *bar);
/// A loop on mbarrier.try_wait.parity.shared::cta.b64: returns once the phase of `parity` has
/// completed (at once if it has). A block whose threads all wait on phases that cannot
/// complete is reported as a deadlock.
void mbarrierWait(void *bar, unsigned parity);
/// cp.async.mbarrier.arrive.noinc.shared::cta.b64: an arrive once the thread's earlier cp.async
/// copies have landed (here: they land now).
void cpAsyncMbarrierArrive(void *bar);
/// cp.async.commit_group: the queued copies become one group.
void cpAsyncCommit();
/// cp.async.wait_group: the calling thread's committed groups land, oldest first, until at most
/// `pending` remain in flight (the latest a GPU may complete them, so a read that does not wait
/// sees the old contents).
void cpAsyncWait(int pending);
/// The block's dynamic shared memory.
void *dynamicShared();
/// The offset of `p` in the block's dynamic shared memory: what a wgmma descriptor holds as its
/// start address here (on a GPU, the shared window's address). Outside it, the run ends.
uint32_t sharedOffset(const void *p);
/// wgmma.mma_async.sync.aligned.m64nNk16.f32.bf16.bf16 with A in registers (Wgmma.cuh's
/// wgmmaBf16): the calling warp's 16 rows of the warpgroup's 64 (`a`: its A fragment, the
/// layout of mma.m16n8k16's), times B (16 x n) read through the shared-memory descriptor `b`
/// (no swizzle or the 128-byte one; K-major, or MN-major with `transposeB`), added to
/// (`accumulate`) or written over d[0, n / 2) in the accumulator layout. Asynchronous, as on a
/// GPU: the product is computed now, but d holds a NaN pattern until the wgmmaWait that covers
/// the instruction writes the result there, and that wait ends the run if, in between, d was
/// written, the A registers changed or the shared memory read changed (KernelEmu.h lists every
/// rule checked). A block that is not whole warpgroups, a descriptor with another swizzle or a
/// base offset, or a B outside the shared memory ends the run too.
void wgmmaBf16(float *d, int n, const uint32_t (&a)[4], uint64_t b, bool accumulate,
               bool transposeB);
/// The same with A (64 x 16) read through the descriptor `a` too (the calling warp's 16 rows of
/// it), K-major or (transposeA) MN-major, and B K-major or (transposeB) MN-major.
void wgmmaBf16Shared(float *d, int n, uint64_t a, uint64_t b, bool accumulate, bool transposeA,
                     bool transposeB);
/// wgmma.fence.sync.aligned: registers the thread wrote before are ready for the wgmma
/// instructions after it.
void wgmmaFence();
/// wgmma.commit_group.sync.aligned: the thread's wgmma instructions since the last commit
/// become one group (possibly empty).
void wgmmaCommit();
/// wgmma.wait_group.sync.aligned: the thread's committed groups complete, oldest first, until
/// at most `pending` remain in flight.
void wgmmaWait(int pending);
/// fence.proxy.async.shared::cta: shared memory written before it (here: by cp.async) may be
/// read by wgmma.
void fenceProxyAsyncShared();

/// Queues `body` as a grid on `stream`; a configuration the GPU would refuse is not run and
/// becomes the next cudaGetLastError(). `kernel` identifies the function (its
/// cudaFuncSetAttribute limits).
void launch(dim3 grid, dim3 block, size_t sharedBytes, cudaStream_t stream, const void *kernel,
            std::function<void()> body);

template <typename Kernel> struct Launcher {
  dim3 grid, block;
  size_t sharedBytes;
  cudaStream_t stream;
  Kernel kernel;
  template <typename... Args> void operator()(Args... args) const {
    Kernel k = kernel;
    launch(grid, block, sharedBytes, stream, reinterpret_cast<const void *>(k),
           [k, args...] { k(args...); });
  }
};
template <typename Kernel>
Launcher<Kernel> launcher(dim3 grid, dim3 block, size_t sharedBytes, cudaStream_t stream,
                          Kernel kernel) {
  return {grid, block, sharedBytes, stream, kernel};
}

template <typename T> T shuffle(T value, int srcLane, uint32_t mask) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "shuffles move 64 bits");
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  bits = exchange(bits, srcLane, mask);
  std::memcpy(&value, &bits, sizeof(T));
  return value;
}

} // namespace pipec::emu::kernel

#endif // PIPEC_KERNELS_CUDA_EMU_KERNELEMURUNTIME_H
