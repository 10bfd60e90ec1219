//===- FakeNccl.h - What the emulated NCCL lets a test observe --------------===//
//
// runtime/cuda/emu/FakeNccl.cpp implements NCCL's calls for ranks that are threads of one
// process; this is what it shows of itself beyond them, and the hooks a test sets (calls, not
// environment variables: the environment is the real NCCL's, and the emulation reads only what
// NCCL itself reads).
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

/// Whether every rank is on one GPU (false by default, each rank a process of its own GPU): then
/// ncclCommInitRank fails on every rank of a communicator of several, as NCCL 2.5 and later do
/// for ranks that share a GPU, as a launch of several processes on a one-GPU host would.
void setNcclOneGpu(bool all);
/// How long (0 by default) a group with a send waits in its stream before it posts, on
/// asynchronous streams: a slow link or a late peer, so that the sender's compute runs ahead.
void setNcclSendDelayMs(int ms);

} // namespace pipec::emu

#endif // PIPEC_RUNTIME_CUDA_EMU_FAKENCCL_H
