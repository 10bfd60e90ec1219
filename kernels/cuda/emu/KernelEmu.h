//===- KernelEmu.h - The CUDA device dialect on the host, for the kernel emulator -*- C++ -*-===//
//
// kernels/cuda/emu/README.md. Included first in a host translation unit that then includes a
// .cu file unchanged (the build generates that unit, kernels/BUILD), so that the hand-written
// kernels run on a machine without a GPU and are checked against the CPU reference ops in CI.
//
// Every CUDA thread of a block is a fiber of one host thread; the scheduler (KernelEmu.cpp) runs
// them until each finishes or waits at a barrier, then releases the waits on mbarrier phases that
// have completed, else a barrier whose every live participant has arrived: a warp's (shuffles,
// mma, wgmma's issue and wait) first, then the block's (__syncthreads).
// Threads waiting at different barriers with nothing left to release is a deadlock the real
// GPU would hang in (a __syncthreads in divergent code, a shuffle missing lanes): it ends the
// process with a message naming the block. Blocks run one after another (in index order, or
// with PIPEC_EMU_BLOCK_ORDER=shuffled in a new order every launch), and one grid
// at a time in the process, so `__shared__` variables can be statics. Dynamic shared memory is
// filled with NaN bytes before each block, so a read before the block wrote it shows.
//
// A shuffle or mma whose mask names a lane that has exited is an error too, and the emulated
// kernels are built with -fsanitize=alignment, so a misaligned access (which faults on a GPU,
// not on x86) ends the run with its source line. Fiber stacks have guard pages.
//
// What is emulated: thread and block indices, __syncthreads, the warp shuffles, atomicAdd,
// mma.sync m16n8k16 with bf16 inputs and fp32 accumulation (Device.cuh's mmaBf16, with the PTX
// ISA's fragment layout), ldmatrix .x4 .trans (ldmatrixX4Trans; a row address that is not
// 16-byte aligned ends the run), cp.async to dynamic shared memory (a copy lands at the
// wait_group that covers it, or in every other block at once), Hopper's wgmma (A in registers
// or shared memory, descriptors without swizzle or with the 128-byte one; asynchronous, below)
// and mbarriers (Wgmma.cuh; a wait blocks until the scheduler sees its phase complete), launch
// configuration limits (block
// size, the 48 KiB dynamic shared memory default and cudaFuncSetAttribute raising it), and the
// launch error of a refused launch through cudaGetLastError. Launches run in stream order
// (emu::enqueue). What is not: timing, memory coalescing and bank conflicts, every interleaving
// inside one barrier interval (fibers switch only at barriers and collectives; passes alternate the
// thread order, and one warp runs ahead of the others to the next __syncthreads, so a missing
// __syncthreads shows when its reader runs before its writer, or a fast warp overwrites what a slow
// one still reads, but not always), out-of-bounds accesses (run the emulated test under ASan for
// them), __launch_bounds__ (a launch above the bound runs here and fails on the GPU), registers and
// occupancy.
//
// wgmma runs as on a GPU, asynchronously: its product is computed at the issue, but its
// accumulator registers hold a NaN pattern until the wgmma.wait_group that covers it writes the
// result, so a read before the wait spreads NaN. The run ends, naming the rule, where the PTX
// ISA leaves the kernel undefined: a wgmma before the thread's first wgmma.fence; registers it
// reads or writes (accumulator, A fragment) written by other code since the last wgmma.fence;
// the accumulator or A registers, or the shared memory it reads, changed before its wait (or
// before the next wgmma that accumulates into them); shared memory written by cp.async and read
// by a wgmma with no fence.proxy.async since by the copying thread or the reading one; a thread
// exiting with one in flight; the threads of a warpgroup having issued different numbers of
// wgmma at a __syncthreads or at the block's end (wgmma is .aligned over the warpgroup). Not
// checked: the fence rule on a register array's first use by a thread (the compiler may sink
// stores to an array whose address has not escaped yet past the fence call, so its memory
// there says nothing), reads of registers (only NaN shows them), and shared memory written by
// plain stores (for the proxy fence). Registers are arrays in memory here, so fragment and
// accumulator arrays must outlive the wait that covers them (a loop-local A fragment reused
// while one is in flight reads as a change).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_KERNELS_CUDA_EMU_KERNELEMU_H
#define PIPEC_KERNELS_CUDA_EMU_KERNELEMU_H

#define PIPEC_KERNEL_EMU 1

// The execution-space qualifiers mean nothing on the host; `__shared__` variables become
// statics (one block at a time). Defined before the CUDA headers, which then keep them.
#define __global__
#define __device__
#define __host__
#define __shared__ static

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#undef __launch_bounds__
#define __launch_bounds__(...)

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>

#include "kernels/cuda/emu/KernelEmuRuntime.h"

#define threadIdx (::pipec::emu::kernel::coords().thread)
#define blockIdx (::pipec::emu::kernel::coords().block)
#define blockDim (::pipec::emu::kernel::coords().blockDim)
#define gridDim (::pipec::emu::kernel::coords().gridDim)

inline void __syncthreads() { ::pipec::emu::kernel::syncThreads(); }

// Warp shuffles; `width` splits the warp into segments as CUDA's.
template <typename T> T __shfl_sync(unsigned mask, T value, int srcLane, int width = 32) {
  const int lane = ::pipec::emu::kernel::laneId();
  return ::pipec::emu::kernel::shuffle(value, (lane & ~(width - 1)) + (srcLane & (width - 1)),
                                       mask);
}
template <typename T> T __shfl_xor_sync(unsigned mask, T value, int laneMask, int width = 32) {
  const int lane = ::pipec::emu::kernel::laneId();
  const int src = lane ^ laneMask;
  return ::pipec::emu::kernel::shuffle(value, src < ((lane & ~(width - 1)) + width) ? src : lane,
                                       mask);
}
template <typename T> T __shfl_down_sync(unsigned mask, T value, unsigned delta, int width = 32) {
  const int lane = ::pipec::emu::kernel::laneId();
  const int src = lane + int(delta);
  return ::pipec::emu::kernel::shuffle(value, src < ((lane & ~(width - 1)) + width) ? src : lane,
                                       mask);
}
template <typename T> T __shfl_up_sync(unsigned mask, T value, unsigned delta, int width = 32) {
  const int lane = ::pipec::emu::kernel::laneId();
  const int src = lane - int(delta);
  return ::pipec::emu::kernel::shuffle(value, src >= (lane & ~(width - 1)) ? src : lane, mask);
}

// Atomics: grids run one at a time in the process; atomic_ref keeps them correct regardless.
template <typename T> T atomicAdd(T *address, T value) {
  return std::atomic_ref<T>(*address).fetch_add(value);
}
inline unsigned atomicMax(unsigned *address, unsigned value) {
  std::atomic_ref<unsigned> at(*address);
  unsigned old = at.load();
  while (old < value && !at.compare_exchange_weak(old, value)) {
  }
  return old;
}
// sm_90's float2 atomicAdd: each half atomically (the GPU makes no stronger promise).
inline float2 atomicAdd(float2 *address, float2 value) {
  return make_float2(atomicAdd(&address->x, value.x), atomicAdd(&address->y, value.y));
}

// Device math that the host library lacks.
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline int min(int a, int b) { return std::min(a, b); }
inline int max(int a, int b) { return std::max(a, b); }
inline unsigned min(unsigned a, unsigned b) { return std::min(a, b); }
inline unsigned max(unsigned a, unsigned b) { return std::max(a, b); }
// Conversions in round-to-nearest-even (the host's default rounding mode).
inline long long __float2ll_rn(float x) { return std::llrint(x); }
inline float __ll2float_rn(long long x) { return float(x); }
inline float __int_as_float(int x) {
  float f;
  std::memcpy(&f, &x, sizeof f);
  return f;
}
inline float __uint_as_float(unsigned x) {
  float f;
  std::memcpy(&f, &x, sizeof f);
  return f;
}
inline unsigned __float_as_uint(float x) {
  unsigned u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

// cuda_runtime.h declares the function-pointer overload for nvcc only.
template <typename T>
cudaError_t cudaFuncSetAttribute(T *entry, cudaFuncAttribute attr, int value) {
  return ::cudaFuncSetAttribute(reinterpret_cast<const void *>(entry), attr, value);
}

/// Launch syntax: PIPEC_LAUNCH(grid, block, sharedBytes, stream, kernel)(args...).
#define PIPEC_LAUNCH(grid, block, sharedBytes, stream, ...)                                        \
  ::pipec::emu::kernel::launcher(grid, block, sharedBytes, stream, __VA_ARGS__)
/// `extern __shared__ T name[]`.
#define PIPEC_DYNAMIC_SHARED(T, name)                                                              \
  T *name = static_cast<T *>(::pipec::emu::kernel::dynamicShared())

#endif // PIPEC_KERNELS_CUDA_EMU_KERNELEMU_H
