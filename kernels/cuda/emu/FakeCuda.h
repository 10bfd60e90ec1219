//===- FakeCuda.h - How the emulated device runs work in stream order -*- C++ -*-===//
//
// kernels/cuda/emu/README.md. The emulated ops and glue kernels hand their work to enqueue():
// synchronous mode runs it at once; asynchronous mode (PIPEC_EMU_ASYNC=1 in the environment)
// gives every stream a worker thread that runs its work in order, waits for events as a GPU
// does, and sleeps for short random moments, so that work on two streams overlaps the way it
// can on a GPU and a missing event wait shows up as a wrong result.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_KERNELS_CUDA_EMU_FAKECUDA_H
#define PIPEC_KERNELS_CUDA_EMU_FAKECUDA_H

#include <cuda_runtime_api.h>

#include <functional>
#include <string>

namespace pipec::emu {

/// Runs `work` after everything queued on `stream` so far (at once when synchronous; in
/// asynchronous mode PIPEC_EMU_OP_DELAY_MS=N makes each piece of work N ms longer).
void enqueue(cudaStream_t stream, std::function<void()> work);
/// Whether streams run asynchronously (PIPEC_EMU_ASYNC=1).
bool asynchronous();
/// The calling thread's next cudaGetLastError() (a launch the kernel emulator refused).
void setLastError(cudaError_t error);

/// For allocators that place buffers inside one allocation (runtime/cuda/DeviceArena.h), the
/// guards every allocation has (FakeCudaRuntime.cpp): in `stream`'s order, fill the `n` bytes
/// behind a buffer of `bytes` at `buffer` with the guard's bytes, and later check them, ending
/// the process with a line that names `owner` if a write changed one.
void fillGuard(cudaStream_t stream, void *buffer, size_t bytes, size_t n);
void checkGuard(cudaStream_t stream, const void *buffer, size_t bytes, size_t n, std::string owner);

/// The device's memory, which cudaMemGetInfo reports and allocations may not exceed: 16 GiB
/// (or PIPEC_EMU_DEVICE_MIB MiB where the environment sets it) until a test sets another size
/// (0: back to that).
void setDeviceMemory(size_t bytes);
/// The device's compute capability as 10 major + minor (cudaDeviceGetAttribute's): 90 (a
/// Hopper GPU; the kernel emulator runs sm_90a code), or PIPEC_EMU_COMPUTE_CAPABILITY where the
/// environment sets it (80: the ops choose the kernels of an A100), until a test sets another
/// (0: back to that). Contexts read it when they are created; the kernel emulator ends the run
/// when a kernel issues an sm_90a instruction (wgmma) on a device other than 9.0.
void setComputeCapability(int capability);
/// Counts `bytes` of device memory as allocated, backed by nothing: what a library the emulator
/// stands in for holds but the emulated ops never touch (cuBLASLt's workspace).
/// cudaErrorMemoryAllocation where they do not fit, as cudaMalloc's. uncharge gives them back.
cudaError_t chargeDeviceMemory(size_t bytes);
void unchargeDeviceMemory(size_t bytes);

/// Fault injection for the tests of the watchdogs: whether the emulated op `op` ("adam", the
/// AdamW update) is to be a kernel that never finishes (PIPEC_EMU_HANG_OP=adam in the
/// environment), and the work that does so (it sleeps forever). In asynchronous mode the stream
/// then never drains, as a GPU's with a hung kernel.
bool hangs(const char *op);
[[noreturn]] void hangForever();

} // namespace pipec::emu

#endif // PIPEC_KERNELS_CUDA_EMU_FAKECUDA_H
