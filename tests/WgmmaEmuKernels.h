//===- WgmmaEmuKernels.h - Kernels that keep or break wgmma's rules -*- C++ -*-===//
//
// For //tests:wgmma_emu_test, which checks that the kernel emulator (kernels/cuda/emu) runs
// Hopper's wgmma asynchronously and ends the run, naming the rule, when a kernel breaks one.
// WgmmaEmuKernels.cu is built for the emulator only (it is a test of the emulator, not a GPU
// kernel).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_TESTS_WGMMAEMUKERNELS_H
#define PIPEC_TESTS_WGMMAEMUKERNELS_H

#include <cstdint>

namespace pipec::emu::test {

/// What one warpgroup (128 threads) does around its wgmma (m64n16k16, A in registers, B K-major
/// in shared memory) of D = A B.
enum class WgmmaCase : int {
  Correct,                        // fence, wgmma, commit, wait, then read D
  CopiedWithProxyFence,           // B by cp.async (warp 0), fence.proxy.async, a barrier
  CopiedWithReaderFences,         // B by cp.async (warp 0), a barrier, then every thread fences
  ChainedInOneGroup,              // D = A B, then D += A B before any wait: D = 2 A B
  WaitLeavesNewestGroup,          // D into out, then into out2 in a second group; wait<1>
  ReadBeforeWait,                 // reads D between the wgmma and its wait
  WriteAccumulatorInFlight,       // writes D between the wgmma and its wait
  WriteAccumulatorBetweenChained, // D = A B; a write to D; D += A B, all before the wait
  ChangeFragmentInFlight,         // changes A's registers between the wgmma and its wait
  OverwriteSharedInFlight,        // thread 0 rewrites B before its wait
  NoFence,                        // no wgmma.fence before the first wgmma
  FragmentWrittenAfterFence,      // a correct round, then A written and no fence before the next
  CopiedWithoutProxyFence,        // B by cp.async, waited for, a barrier, no fence.proxy.async
  ProxyFenceByAnotherThread,      // B by cp.async (warp 0), a barrier, then thread 0 alone fences
  ExitInFlight,                   // no wait at all
  WarpSkipsWgmma,                 // warp 1 does not issue the wgmma its warpgroup issues
  SwizzledAligned,   // B K-major in the 128-byte swizzle, its tile aligned to 1024 bytes
  SwizzledUnaligned, // the same at the start of dynamic shared memory, not aligned by the kernel
  StoredWithoutProxyFence, // B by plain stores and a barrier, no fence.proxy.async
};

/// Runs the case on the emulated device: `a` is A (64 x 16, row-major bf16 bits), `b` is B (16 x
/// 16, row-major: b[16 k + n]) and `bColumns` the same B column-major (the cp.async cases copy
/// from it, 16-byte aligned); `out` (and for WaitLeavesNewestGroup `out2`) receive D (64 x 16,
/// row-major) as the threads read it.
void runWgmmaCase(WgmmaCase c, const uint16_t *a, const uint16_t *b, const uint16_t *bColumns,
                  float *out, float *out2);

} // namespace pipec::emu::test

#endif // PIPEC_TESTS_WGMMAEMUKERNELS_H
