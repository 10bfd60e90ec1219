//===- Wgmma.cuh - Hopper's warpgroup MMA, and the mbarriers that feed it -*- CUDA -*-===//
//
// wgmma.mma_async (PTX ISA 8.0+, sm_90a) for bf16 inputs and fp32 accumulators, with A in
// registers (or in shared memory) and B in shared memory behind a matrix descriptor without
// swizzle or with the 128-byte one, as the attention kernels use it (AttentionWgmma.cu and
// kernels/cuda/experimental). Four warps
// (a warpgroup, 128 threads from a multiple of 128) issue each one together; the instruction
// runs asynchronously until wgmmaWait:
//
//   wgmmaFence();                       // registers written before are ready for the wgmma
//   wgmmaBf16<N, TransposeB>(d, a, descriptor, accumulate);   // any number of them
//   wgmmaCommit(); wgmmaWait<0>();      // d, and the shared memory B was read from, are free
//   wgmmaFenceRegisters(d);             // keep the compiler's reads of d after the wait
//
// Fragment layouts (per warp w of the warpgroup: rows [16 w, 16 w + 16) of the 64) are those of
// mma.m16n8k16 (Device.cuh's mmaBf16): a[r] holds row g + 8 (r & 1), columns 2 t + 8 (r >> 1)
// + {0, 1}; d[4 j + e] is row g + 8 (e >> 1), column 8 j + 2 t + (e & 1) (g = lane / 4,
// t = lane % 4). B (16 x N) is K-major (each of its N columns holds its k values together;
// TransposeB false) or MN-major (TransposeB true); wgmmaDescriptor builds its descriptor. On the
// kernel emulator (kernels/cuda/emu) the same calls run asynchronously too, and a wait ends the
// run if the registers or shared memory of a wgmma in flight were touched (KernelEmu.h).
//
// Only for code compiled for sm_90a (__CUDA_ARCH_FEAT_SM90_ALL): the build compiles the files
// that use it for sm_90a alone (third_party/cuda/cuda.bzl, HOPPER_ARCHS), so their kernels exist
// on a compute-capability-9.0 GPU only, and the launchers choose them there alone
// (kernels/cuda/Launch.h, Target). Compiled for another architecture each call traps.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_KERNELS_CUDA_WGMMA_CUH
#define PIPEC_KERNELS_CUDA_WGMMA_CUH

#include "kernels/cuda/Device.cuh"

#include <cstdint>

#if defined(PIPEC_KERNEL_EMU) || (defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL))
#define PIPEC_HAS_WGMMA 1
#endif

namespace pipec::kernels::cuda::device {

/// The address of `p` in the shared window (what descriptors and shared-memory PTX take).
__device__ __forceinline__ uint32_t sharedAddress(const void *p) {
#ifdef PIPEC_KERNEL_EMU
  return ::pipec::emu::kernel::sharedOffset(p);
#else
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
#endif
}

/// The shared-memory layouts a descriptor can name (the PTX ISA's "swizzling modes"): none
/// (core matrices of 8 rows of 16 bytes, each 128 contiguous bytes) or 128-byte (rows of 128
/// bytes in 1024-byte atoms of 8 rows, the 16-byte chunk c of row r stored at chunk c ^ (r % 8)
/// of its row; atoms 1024-byte aligned).
enum class WgmmaLayout : uint64_t { Interleave = 0, Swizzle128 = 1 };

/// A matrix descriptor for the operand whose canonical layout starts at `tile`: `leadingBytes`
/// and `strideBytes` are the PTX ISA's leading and stride dimension byte offsets for that layout
/// (both multiples of 16 below 256 KiB).
__device__ __forceinline__ uint64_t wgmmaDescriptor(const void *tile, uint32_t leadingBytes,
                                                    uint32_t strideBytes,
                                                    WgmmaLayout layout = WgmmaLayout::Interleave) {
  return uint64_t((sharedAddress(tile) & 0x3ffffu) >> 4) |
         uint64_t((leadingBytes & 0x3ffffu) >> 4) << 16 |
         uint64_t((strideBytes & 0x3ffffu) >> 4) << 32 | uint64_t(layout) << 62;
}

/// Registers written before it are ready for the wgmma instructions after it.
__device__ __forceinline__ void wgmmaFence() {
#ifdef PIPEC_KERNEL_EMU
  ::pipec::emu::kernel::wgmmaFence();
#elif defined(PIPEC_HAS_WGMMA)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

/// The wgmma instructions issued since the last commit become one group.
__device__ __forceinline__ void wgmmaCommit() {
#ifdef PIPEC_KERNEL_EMU
  ::pipec::emu::kernel::wgmmaCommit();
#elif defined(PIPEC_HAS_WGMMA)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

/// Waits until at most `Pending` committed groups are in flight.
template <int Pending> __device__ __forceinline__ void wgmmaWait() {
#ifdef PIPEC_KERNEL_EMU
  ::pipec::emu::kernel::wgmmaWait(Pending);
#elif defined(PIPEC_HAS_WGMMA)
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(Pending) : "memory");
#endif
}

/// Ties `d` to this point for the compiler: reads of it are not moved above, nor writes below.
template <int N> __device__ __forceinline__ void wgmmaFenceRegisters(float (&d)[N]) {
#ifndef PIPEC_KERNEL_EMU
#pragma unroll
  for (int i = 0; i < N; ++i)
    asm volatile("" : "+f"(d[i])::"memory");
#endif
}

/// Stores by this thread to shared memory are visible to the async proxy (wgmma's operand reads)
/// once a barrier follows.
__device__ __forceinline__ void fenceProxyAsyncShared() {
#ifdef PIPEC_KERNEL_EMU
  ::pipec::emu::kernel::fenceProxyAsyncShared();
#elif defined(PIPEC_HAS_WGMMA)
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

/// mbarriers (PTX ISA 7.0+, 8-byte objects in shared memory; CTA scope): `count` arrivals
/// complete a phase. Initialise from one thread, then a __syncthreads before any other use.
__device__ __forceinline__ void mbarrierInit(uint64_t *bar, unsigned count) {
#ifdef PIPEC_KERNEL_EMU
  ::pipec::emu::kernel::mbarrierInit(bar, count);
#else
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(sharedAddress(bar)), "r"(count)
               : "memory");
#endif
}

/// One arrival (release: this thread's earlier memory operations are seen by a waiter).
__device__ __forceinline__ void mbarrierArrive(uint64_t *bar) {
#ifdef PIPEC_KERNEL_EMU
  ::pipec::emu::kernel::mbarrierArrive(bar);
#else
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(
                   sharedAddress(bar))
               : "memory");
#endif
}

/// Waits (acquire) until the phase of parity `parity` has completed: phases complete in turn,
/// 0, 1, 0, ..., so the k-th completion (from 0) is waited for with parity k & 1.
__device__ __forceinline__ void mbarrierWait(uint64_t *bar, unsigned parity) {
#ifdef PIPEC_KERNEL_EMU
  ::pipec::emu::kernel::mbarrierWait(bar, parity);
#else
  asm volatile("{\n.reg .pred done;\n"
               "WAIT:\n"
               "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
               "@!done bra WAIT;\n"
               "}\n" ::"r"(sharedAddress(bar)),
               "r"(parity)
               : "memory");
#endif
}

/// An arrival on `bar` once every cp.async this thread issued before has landed; counts
/// against the barrier's count (.noinc).
__device__ __forceinline__ void cpAsyncMbarrierArrive(uint64_t *bar) {
#ifdef PIPEC_KERNEL_EMU
  ::pipec::emu::kernel::cpAsyncMbarrierArrive(bar);
#else
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(sharedAddress(bar))
               : "memory");
#endif
}

/// d (64 x N of the warpgroup, N / 2 per thread) = [d +] A (64 x 16, registers) B (16 x N,
/// shared memory through `b`): one wgmma.mma_async.m64nNk16 of the warpgroup.
template <int N, bool TransposeB>
__device__ __forceinline__ void wgmmaBf16(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b,
                                          bool accumulate) {
  static_assert(N == 16 || N == 32 || N == 64 || N == 128, "the instantiated shapes");
#ifdef PIPEC_KERNEL_EMU
  ::pipec::emu::kernel::wgmmaBf16(d, N, a, b, accumulate, TransposeB);
#elif defined(PIPEC_HAS_WGMMA)
  const int scaleD = accumulate ? 1 : 0;
  if constexpr (N == 16) {
    asm volatile("{\n.reg .pred p;\n"
                 "setp.ne.b32 p, %13, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7"
                 "}, {%8, %9, %10, %11}, %12, p, 1, 1, %14;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scaleD),
                   "n"(TransposeB ? 1 : 0));
  } else if constexpr (N == 32) {
    asm volatile("{\n.reg .pred p;\n"
                 "setp.ne.b32 p, %21, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
                 "}, {%16, %17, %18, %19}, %20, p, 1, 1, %22;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scaleD),
                   "n"(TransposeB ? 1 : 0));
  } else if constexpr (N == 64) {
    asm volatile(
        "{\n.reg .pred p;\n"
        "setp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
          "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
          "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scaleD), "n"(TransposeB ? 1 : 0));
  } else if constexpr (N == 128) {
    asm volatile(
        "{\n.reg .pred p;\n"
        "setp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
          "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
          "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
          "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
          "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
          "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
          "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scaleD), "n"(TransposeB ? 1 : 0));
  }
#else
  (void)d, (void)a, (void)b, (void)accumulate;
  __trap(); // not an sm_90a build: the launcher must not have chosen a wgmma kernel
#endif
}

/// d (64 x 64 of the warpgroup) = [d +] A (64 x 16) B (16 x 64), both in shared memory through
/// descriptors (A's rows are m; warp w of the warpgroup computes rows [16 w, 16 w + 16)): A
/// K-major or (TransposeA) MN-major, B K-major or (TransposeB) MN-major.
template <bool TransposeA = false, bool TransposeB = false>
__device__ __forceinline__ void wgmmaBf16Shared64(float (&d)[32], uint64_t a, uint64_t b,
                                                  bool accumulate) {
#ifdef PIPEC_KERNEL_EMU
  ::pipec::emu::kernel::wgmmaBf16Shared(d, 64, a, b, accumulate, TransposeA, TransposeB);
#elif defined(PIPEC_HAS_WGMMA)
  const int scaleD = accumulate ? 1 : 0;
  asm volatile("{\n.reg .pred p;\n"
               "setp.ne.b32 p, %34, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
               "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
               "}, %32, %33, p, 1, 1, %35, %36;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
                 "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]),
                 "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]),
                 "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
                 "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]),
                 "+f"(d[31])
               : "l"(a), "l"(b), "r"(scaleD), "n"(TransposeA ? 1 : 0), "n"(TransposeB ? 1 : 0));
#else
  (void)d, (void)a, (void)b, (void)accumulate;
  __trap();
#endif
}

} // namespace pipec::kernels::cuda::device

#endif // PIPEC_KERNELS_CUDA_WGMMA_CUH
