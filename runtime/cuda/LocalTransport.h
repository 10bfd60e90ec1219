//===- LocalTransport.h - Every rank of the plan on one GPU, device to device -*- C++ -*-===//
//
// docs/runtime.md's `local` transport: the ranks are threads of this process sharing one GPU,
// matched by the in-process transport's rules (FIFO per ordered pair, a group posted at once and
// complete only when every op met its partner, mismatches named), but the data never leaves
// the device and the host never waits for it:
//
//   p2p         a thread whose group sends anything records `ready` on its compute stream
//               before it posts the group; a matched pair is one cudaMemcpyAsync (device to
//               device) queued on the receiver's compute stream after a wait for the sender's
//               `ready` (the receiver, blocked in its own exchange, queues nothing meanwhile, so
//               the copy lands before anything it queues later reads the buffer), then the
//               receiver's `copied` event, which the sender's compute stream waits for before it
//               reuses the buffer. Pairs are delivered outside the matching lock, so the
//               ranks' pairs are queued side by side; `ready` is recorded only by its thread
//               before it posts, and the receiver's own lock keeps each record of `copied`
//               with its sender's wait, so a sender waits for its own copy, not a later one.
//               Five CUDA calls per pair: record ready (once per group), wait, copy, record,
//               wait; none for an empty message.
//   all-reduce  per thread a tp, a dp and an embedding stream, as the nccl transport: a member
//               orders its stream after its compute stream (and the dp and embedding ones after
//               each other: both touch the tied matrix's gradient) and records `arrive`; the member
//               that arrives last queues, on its own stream, one kernel that adds the members'
//               buffers in member order and writes the sum back to each (the cpu backend's bits
//               in fp32; a bf16 sum is added in fp32 and rounded once),
//               and records every member's `done`. Members order their stream after `done`; for
//               tp the compute stream waits at once, dp and embedding sums overlap compute until
//               waitForCollectives() (before the optimizer step).
//
// Every cross-stream wait is on an event recorded earlier on the host, so the device cannot
// deadlock where the host did not. A rank's memory is only touched by other streams between its
// `ready` and its compute stream's wait (runtime/cuda/DeviceArena.h relies on this).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_CUDA_LOCALTRANSPORT_H
#define PIPEC_RUNTIME_CUDA_LOCALTRANSPORT_H

#include "ir/Plan.h"
#include "runtime/Transport.h"

#include <cuda_runtime_api.h>

#include <functional>
#include <memory>
#include <vector>

namespace pipec {

class LocalCudaTransport final : public Transport, private InProcessMover {
public:
  /// `numThreads` threads of `plan` (RunShared::threadOf order).
  LocalCudaTransport(const Plan &plan, int numThreads);
  ~LocalCudaTransport() override;

  /// Streams and events of thread `thread`, whose backend queues its work on `compute`;
  /// `pendingError` is the backend's kept error, checked before anything is posted (a failed
  /// send never leaves its peer reading a wrong buffer). Before the first step.
  llvm::Error attach(int thread, cudaStream_t compute, std::function<llvm::Error()> pendingError);

  llvm::Error exchange(int self, llvm::ArrayRef<P2POp> ops) override;
  llvm::Error allReduce(CollectiveGroup group, const std::string &key, llvm::ArrayRef<int> members,
                        int self, TensorView data) override;
  void abort(const std::string &why) override { inProcess.abort(why); }
  bool aborted() const override { return inProcess.aborted(); }

  /// Thread `self`'s compute stream waits for every dp and embedding all-reduce it has queued.
  llvm::Error waitForCollectives(int self);

private:
  llvm::Error deliver(const P2POp &s, int sOwner, size_t sIndex, const P2POp &r, int rOwner,
                      size_t rIndex) override;
  llvm::Error sum(CollectiveGroup group, llvm::ArrayRef<int> members, int last,
                  llvm::ArrayRef<TensorView> buffers) override;

  struct PerThread;
  std::vector<std::unique_ptr<PerThread>> threads;
  InProcessTransport inProcess;
};

} // namespace pipec

#endif // PIPEC_RUNTIME_CUDA_LOCALTRANSPORT_H
