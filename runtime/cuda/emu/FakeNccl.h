//===- FakeNccl.h - What the emulated NCCL lets a test observe --------------===//
//
// runtime/cuda/emu/FakeNccl.cpp implements NCCL's calls for ranks that are threads of one
// process; this is what it shows of itself beyond them.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_CUDA_EMU_FAKENCCL_H
#define PIPEC_RUNTIME_CUDA_EMU_FAKENCCL_H

#include <cstddef>

namespace pipec::emu {

/// How many channels (a sender and a receiver on one communicator) this process has connected
/// so far: both sides have posted on it once. On a GPU each connection is a host call that
/// blocks until the peer posts, and NCCL's buffers allocated then.
size_t ncclChannelsConnected();
/// How many communicators this process has aborted so far (ncclCommAbort on a live one).
size_t ncclCommsAborted();

} // namespace pipec::emu

#endif // PIPEC_RUNTIME_CUDA_EMU_FAKENCCL_H
