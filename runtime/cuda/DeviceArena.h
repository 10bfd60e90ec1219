//===- DeviceArena.h - A rank's activation memory, sized before the first step -*- C++ -*-===//
//
// The executor's DeviceAllocator (kernels/cuda/CudaOps.h) for everything a rank allocates while
// it runs a step: activations and saved state, received tensors, kept input gradients and the
// ops' scratch. Two phases:
//
//   sizing     (the sizing pass, before step 0): the rank's stream is interpreted on the host
//              with its CUDA context in sizing mode (CudaContext::setSizing: every op takes
//              and gives back its buffers as in a step, but nothing is queued on the device)
//              and no transport; requests are placed in an unbounded OffsetArena, which learns
//              the highest offset the rank's sequence of requests reaches. The addresses
//              handed out then point nowhere (a non-canonical range that faults if read) and
//              no device memory is touched;
//   reserved   (reserve(), after the pass): one cudaMalloc of that size; from then on requests
//              are offsets into it, placed by the same first-fit rule.
//
// A rank issues the same requests in the same order every step, the sizing pass included (its
// instruction stream is fixed, one host thread issues them, and no size depends on the data),
// so every step fits exactly and no step allocates device memory (runtime/OffsetArena.h).
// Should a step ever ask for more, the request fails with an error that says so instead of
// allocating.
// Releases take effect on the host at once: the memory is only reused by work queued later on
// the rank's compute stream, and every other stream that reads a rank's buffers (a copy to a
// peer, a p2p group with a recv, a tp all-reduce) is ordered before the compute stream's next
// work by the transports. The one exception is a group of sends alone in the nccl transport,
// which the compute stream does not wait for (so that compute runs on while a peer is not yet
// ready to receive): the transport registers its reads (readElsewhere), and a release of a
// buffer under one makes the stream wait for it first.
// One arena per rank; not thread-safe. On the emulated device (PIPEC_EMULATED_DEVICE,
// kernels/cuda/emu/README.md) a release fills the buffer with NaN bytes, in the stream's order,
// so that reading it after its release shows up in the gradient checks; and every buffer takes
// 256 bytes more, which hold the emulated device's guard (kernels/cuda/emu/FakeCuda.h): a read
// past a buffer's end computes with NaN, and a write there ends the run, naming the rank and the
// offset, when the buffer is released. Its allocation is larger than a GPU's by those bytes, but
// the sizes it reports are a GPU's: the same requests are also placed without guards. (There,
// destroy an arena on the thread whose streams it queued on: cudaFree waits for the calling
// thread's streams only, and a guard check still queued would read freed memory. The backends
// do.)
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_CUDA_DEVICEARENA_H
#define PIPEC_RUNTIME_CUDA_DEVICEARENA_H

#include "kernels/cuda/CudaOps.h"
#include "runtime/OffsetArena.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace pipec {

class DeviceArena final : public kernels::cuda::DeviceAllocator {
public:
  /// Sizing; after reserve(), releases on the emulated device are queued on `stream`. `who`
  /// names the rank in errors.
  DeviceArena(cudaStream_t stream, std::string who) : stream(stream), who(std::move(who)) {}
  ~DeviceArena() override;
  DeviceArena(const DeviceArena &) = delete;
  DeviceArena &operator=(const DeviceArena &) = delete;

  /// Fails, naming the call, once a release's wait for a read (below) could not be queued.
  llvm::Expected<void *> allocate(size_t bytes) override;
  void release(void *p) override;

  /// A read of [data, data + bytes) on another stream that `stream` has not waited for (a p2p
  /// send of the nccl transport), complete at `done`. A release of a buffer that overlaps it
  /// first makes `stream` wait for `done`, so that no work queued after the release reuses the
  /// memory under the read. The reads must be registered in the order of the one stream they
  /// run on: waiting for one covers every read registered before it.
  void readElsewhere(const void *data, size_t bytes, cudaEvent_t done);
  /// `stream` has waited for every read registered so far.
  void elsewhereReadsDone() { reads.clear(); }
  /// Reads registered and not yet waited for (tests).
  size_t readsPending() const { return reads.size(); }

  /// Ends the sizing phase: one allocation of the high-water mark the requests so far reached.
  /// Nothing may be live (an error names how much is).
  llvm::Error reserve();
  bool reserved() const { return placement.isBounded(); }
  /// The bytes reserved (before reserve(): the high-water mark so far). On the emulated device,
  /// what a GPU's arena reserves for the same requests (its own allocation adds the guards).
  size_t reservedBytes() const { return reserved() ? sizes().capacity() : sizes().highWater(); }
  /// The highest offset the requests since reserve() reached: reservedBytes() once a step has
  /// run, when the sizing pass saw the steps' requests exactly.
  size_t stepHighWater() const { return sizes().highWater(); }
  /// The most bytes the requests since reserve() held live at once: stepHighWater() without the
  /// free gaps below the top (what the buffers themselves need, rounded to OffsetArena::kAlign).
  size_t stepPeakLive() const { return sizes().peakInUse(); }

private:
  cudaStream_t stream;
  std::string who;
  OffsetArena placement;
  /// On the emulated device, the same requests placed without the guards: the sizes a GPU's
  /// arena would report. (Declared in every build, so that the class has one layout whether or
  /// not its user defines PIPEC_EMULATED_DEVICE; unused on a GPU.)
  OffsetArena unguarded;
  /// The placement whose sizes are reported: `placement` on a GPU, `unguarded` emulated.
  const OffsetArena &sizes() const;
  char *base = nullptr;
  struct Placed {
    size_t offset, bytes;
    size_t unguardedOffset = 0; // in `unguarded`
  };
  std::unordered_map<void *, Placed> live; // live buffers
  struct Read {
    uintptr_t begin, end;
    cudaEvent_t done;
  };
  std::vector<Read> reads;              // readElsewhere's, in their stream's order
  cudaError_t waitFailed = cudaSuccess; // the first failed wait for one
};

} // namespace pipec

#endif // PIPEC_RUNTIME_CUDA_DEVICEARENA_H
