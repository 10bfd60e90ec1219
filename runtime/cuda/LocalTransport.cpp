#include "runtime/cuda/LocalTransport.h"

#include "ir/PlanText.h"
#include "kernels/cuda/CudaCheck.h"
#include "runtime/cuda/DeviceHandles.h"
#include "runtime/cuda/StageKernels.h"

#include <fmt/format.h>

#include <algorithm>
#include <mutex>

namespace pipec {

namespace {

using runtime_cuda::order;
using runtime_cuda::OwnedEvent;
using runtime_cuda::OwnedStream;

size_t groupIndex(CollectiveGroup g) {
  switch (g) {
  case CollectiveGroup::Tp:
    return 0;
  case CollectiveGroup::Dp:
    return 1;
  case CollectiveGroup::Embedding:
    return 2;
  }
  return 0;
}

} // namespace

struct LocalCudaTransport::PerThread {
  cudaStream_t compute = nullptr;
  std::function<llvm::Error()> pendingError;
  OwnedStream collective[3];     // tp, dp, embedding
  OwnedEvent ready;              // compute stream at the post of a sending group or an all-reduce
  OwnedEvent copied;             // after a copy into this thread's buffer (under copyMu only)
  std::mutex copyMu;             // deliveries into this thread: record and wait `copied` as one
  OwnedEvent mark;               // scratch for order()
  OwnedEvent arrive[3], done[3]; // per collective kind
};

LocalCudaTransport::LocalCudaTransport(const Plan &plan, int numThreads)
    : inProcess(
          numThreads,
          [&plan](int rank, size_t step) {
            return fmt::format("rank {} step {} ({})", rank, step,
                               formatToken(plan, plan.ranks[size_t(rank)][step]));
          },
          this) {
  threads.resize(size_t(numThreads));
}

LocalCudaTransport::~LocalCudaTransport() = default;

llvm::Error LocalCudaTransport::attach(int thread, cudaStream_t compute,
                                       std::function<llvm::Error()> pendingError) {
  auto t = std::make_unique<PerThread>();
  t->compute = compute;
  t->pendingError = std::move(pendingError);
  for (OwnedStream &s : t->collective)
    if (auto err = s.create())
      return err;
  for (OwnedEvent *e : {&t->ready, &t->copied, &t->mark})
    if (auto err = e->create())
      return err;
  for (size_t g = 0; g < 3; ++g) {
    if (auto err = t->arrive[g].create())
      return err;
    if (auto err = t->done[g].create())
      return err;
  }
  threads[size_t(thread)] = std::move(t);
  return llvm::Error::success();
}

/// A send that moves bytes (a dropped send is never delivered; an empty one moves nothing).
static bool movesData(const P2POp &op) { return op.send && !op.drop && !op.data.empty(); }

llvm::Error LocalCudaTransport::exchange(int self, llvm::ArrayRef<P2POp> ops) {
  PerThread &t = *threads[size_t(self)];
  if (auto err = t.pendingError())
    return err;
  // Only a send's copy waits for `ready`; its receiver and the copies into this thread's buffers
  // are ordered by this compute stream itself.
  if (std::any_of(ops.begin(), ops.end(), movesData))
    PIPEC_CUDA_TRY(cudaEventRecord(t.ready.get(), t.compute));
  // Every wait the group needs is queued by deliver() as its pairs match; nothing is left to
  // queue here.
  return inProcess.exchange(self, ops);
}

llvm::Error LocalCudaTransport::deliver(const P2POp &s, int sOwner, size_t, const P2POp &r,
                                        int rOwner, size_t) {
  if (!movesData(s))
    return llvm::Error::success();
  // Both owners are blocked in exchange() with these ops pending (or one of them is this thread,
  // inside it), so neither queues anything on its compute stream meanwhile: what is queued here
  // sits exactly where the group is in each stream. The sender's `ready` is this group's record
  // (it re-records only after its exchange returns). Deliveries run outside the transport's lock,
  // and two senders' threads may deliver into one receiver at once: the receiver's copyMu keeps
  // each record of `copied` together with its sender's wait, so a sender waits for its own copy
  // and not for a later one (which would be safe too, since it is queued after ours, but would
  // hold the sender's compute stream for another rank's copy).
  PerThread &sender = *threads[size_t(sOwner)], &receiver = *threads[size_t(rOwner)];
  std::lock_guard<std::mutex> lock(receiver.copyMu);
  PIPEC_CUDA_TRY(cudaStreamWaitEvent(receiver.compute, sender.ready.get(), 0));
  PIPEC_CUDA_TRY(cudaMemcpyAsync(r.data.data, s.data.data, s.data.bytes(), cudaMemcpyDeviceToDevice,
                                 receiver.compute));
  if (sOwner == rOwner) // (a thread's message to itself: its own stream orders the copy)
    return llvm::Error::success();
  PIPEC_CUDA_TRY(cudaEventRecord(receiver.copied.get(), receiver.compute));
  PIPEC_CUDA_TRY(cudaStreamWaitEvent(sender.compute, receiver.copied.get(), 0));
  return llvm::Error::success();
}

llvm::Error LocalCudaTransport::allReduce(CollectiveGroup group, const std::string &key,
                                          llvm::ArrayRef<int> members, int self, TensorView data) {
  PerThread &t = *threads[size_t(self)];
  if (auto err = t.pendingError())
    return err;
  if (members.size() > size_t(runtime::cuda::launch::kMaxSumOperands))
    return llvm::createStringError(
        llvm::inconvertibleErrorCode(),
        fmt::format("all-reduce {} has {} members; the cuda backend (every rank on one GPU) sums "
                    "at most {}: use --backend nccl (one GPU per rank) for this plan",
                    key, members.size(), runtime::cuda::launch::kMaxSumOperands));
  const size_t g = groupIndex(group);
  cudaStream_t s = t.collective[g].get();
  if (auto err = order(s, t.compute, t.ready.get()))
    return err;
  // dp and embedding sums both touch the tied matrix's gradient: each waits for the other's
  // stream (compiled plans put dp first; a hand-written one may not).
  if (group == CollectiveGroup::Embedding)
    if (auto err = order(s, t.collective[groupIndex(CollectiveGroup::Dp)].get(), t.mark.get()))
      return err;
  if (group == CollectiveGroup::Dp)
    if (auto err =
            order(s, t.collective[groupIndex(CollectiveGroup::Embedding)].get(), t.mark.get()))
      return err;
  PIPEC_CUDA_TRY(cudaEventRecord(t.arrive[g].get(), s));
  if (auto err = inProcess.allReduce(group, key, members, self, data))
    return err;
  PIPEC_CUDA_TRY(cudaStreamWaitEvent(s, t.done[g].get(), 0));
  if (group == CollectiveGroup::Tp)
    PIPEC_CUDA_TRY(cudaStreamWaitEvent(t.compute, t.done[g].get(), 0));
  return llvm::Error::success();
}

llvm::Error LocalCudaTransport::sum(CollectiveGroup group, llvm::ArrayRef<int> members, int last,
                                    llvm::ArrayRef<TensorView> buffers) {
  const size_t g = groupIndex(group);
  cudaStream_t s = threads[size_t(last)]->collective[g].get();
  runtime::cuda::launch::SumOperands ops{};
  for (size_t m = 0; m < members.size(); ++m) {
    PIPEC_CUDA_TRY(cudaStreamWaitEvent(s, threads[size_t(members[m])]->arrive[g].get(), 0));
    ops.buffers[m] = buffers[m].data;
  }
  PIPEC_CUDA_TRY(runtime::cuda::launch::sumInOrder(buffers[0].type, ops, int(members.size()),
                                                   buffers[0].count, s));
  for (int m : members)
    PIPEC_CUDA_TRY(cudaEventRecord(threads[size_t(m)]->done[g].get(), s));
  return llvm::Error::success();
}

llvm::Error LocalCudaTransport::waitForCollectives(int self) {
  PerThread &t = *threads[size_t(self)];
  if (auto err =
          order(t.compute, t.collective[groupIndex(CollectiveGroup::Dp)].get(), t.mark.get()))
    return err;
  return order(t.compute, t.collective[groupIndex(CollectiveGroup::Embedding)].get(), t.mark.get());
}

} // namespace pipec
