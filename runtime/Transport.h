//===- Transport.h - What the interpreter posts its p2p ops and collectives to -*- C++ -*-===//
//
// `Transport` is the interface the interpreter talks to; two implement it: InProcessTransport
// below (every rank a thread of this process: the cpu backend and the one-GPU cuda backend) and
// NcclTransport (runtime/cuda/NcclTransport.h: one rank per process, device memory, NCCL).
//
// InProcessTransport: ranks are threads of one process. Point-to-point ops obey the rules the
// verifier assumes (docs/contracts.md#semantics): sends and recvs of an ordered pair of threads
// match in FIFO order; a thread posts a group of ops at once and blocks until every op in it has
// met its partner (a send is a rendezvous, never buffered, as NCCL's can be). A matched pair whose
// tensors differ (identity, size or element type) is an error naming both instructions, never a
// silent swap. Collectives are rendezvous sums over a fixed member list, added in member order so
// every member gets the same bits. abort() wakes every waiter with an error (the watchdog uses it).
// How a matched message and an all-reduce's operands move is an InProcessMover: host copies and
// fp32 sums by default (the cpu backend's tensors); the one-GPU cuda backend's mover queues device
// copies and sum kernels instead (runtime/cuda/LocalTransport.h), so the matching rules are the
// same code for both.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_TRANSPORT_H
#define PIPEC_RUNTIME_TRANSPORT_H

#include "ir/Instruction.h"
#include "runtime/Tensor.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/SmallVector.h"
#include "llvm/Support/Error.h"

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <tuple>
#include <vector>

namespace pipec {

/// What a p2p message carries, named by its producer (docs/contracts.md#plan-pipeplan1).
struct TensorId {
  TensorKind kind = TensorKind::Activation;
  int stage = 0, mb = 0, slice = 0;
  bool operator==(const TensorId &o) const = default;
};
std::string describe(const TensorId &t);

struct P2POp {
  bool send = false;
  int peer = 0; // thread id
  TensorId id;
  TensorView data; // read for a send, written for a recv
  int rank = 0;    // pipeline rank and step of the instruction, for diagnostics
  size_t step = 0;
  bool drop = false; // fault injection: a send that is never delivered
};

class Transport {
public:
  virtual ~Transport() = default;
  /// Post every op of a group at once (one NCCL group). When it returns the ops are complete
  /// (in-process) or ordered before everything the rank queues after it (a device transport),
  /// but for the nccl transport's groups of sends alone: the rank's compute runs on past those,
  /// and a release of a sent buffer waits for its send (NcclTransport.h, DeviceArena.h).
  virtual llvm::Error exchange(int self, llvm::ArrayRef<P2POp> ops) = 0;
  /// Sum `data` over `members` (thread ids = global ranks, in this order) of a `group` all-reduce.
  /// `key` names the group instance; every member passes the same key and members.
  virtual llvm::Error allReduce(CollectiveGroup group, const std::string &key,
                                llvm::ArrayRef<int> members, int self, TensorView data) = 0;
  /// Fail every current and future wait with `why`.
  virtual void abort(const std::string &why) = 0;
  virtual bool aborted() const = 0;
};

/// Moves the data of the in-process transport, on whichever thread completed the match or
/// arrived last. Both calls run outside the transport's matching lock, so several threads may
/// deliver and sum at once (never two pairs of one ordered thread pair: those are delivered one
/// after another, in FIFO order; never two all-reduces with a member in common), while the
/// owners of the pair, or the other members, wait.
class InProcessMover {
public:
  virtual ~InProcessMover() = default;
  /// Send `s` (op `sIndex` of the group thread `sOwner` posted) met recv `r` (op `rIndex` of
  /// thread `rOwner`'s group); identities and sizes are already checked equal.
  virtual llvm::Error deliver(const P2POp &s, int sOwner, size_t sIndex, const P2POp &r, int rOwner,
                              size_t rIndex) = 0;
  /// Every member of a `group` all-reduce has arrived (`last` is the thread that came last):
  /// sum `buffers` (members' order) and give every member the same bits.
  virtual llvm::Error sum(CollectiveGroup group, llvm::ArrayRef<int> members, int last,
                          llvm::ArrayRef<TensorView> buffers) = 0;
};

class InProcessTransport final : public Transport {
public:
  /// `where(rank, step)` names an instruction in diagnostics ("rank 1 step 3 (1RECV_F0)").
  /// `mover` (kept by the caller) moves the data; host copies and sums when null.
  InProcessTransport(int numThreads, std::function<std::string(int, size_t)> where,
                     InProcessMover *mover = nullptr);

  /// Post every op of a group, then wait until each has matched its partner.
  llvm::Error exchange(int self, llvm::ArrayRef<P2POp> ops) override;
  /// A rendezvous sum in member order (every member gets the same bits); `group` is the mover's.
  llvm::Error allReduce(CollectiveGroup group, const std::string &key, llvm::ArrayRef<int> members,
                        int self, TensorView data) override;
  void abort(const std::string &why) override;
  bool aborted() const override;

private:
  struct Posted {
    P2POp op;
    int owner = 0;
    size_t index = 0; // in the owner's group
    std::atomic<bool> done{false};
  };
  struct Channel {
    std::vector<Posted *> sends, recvs; // FIFO: front at index `head`
    size_t sendHead = 0, recvHead = 0;
  };
  struct Rendezvous {
    uint64_t generation = 0;
    size_t arrived = 0;
    std::vector<TensorView> buffers;
  };

  struct Match {
    Posted *send, *recv;
  };
  /// Takes the pairs `c` can match into `matches` (sets `failure` on a mismatch).
  void matchLocked(Channel &c, llvm::SmallVectorImpl<Match> &matches);
  /// Under the lock: a move failed with `err` (kept unless an earlier failure is); the caller
  /// wakes the waiters.
  void failLocked(llvm::Error err);
  /// Moves one matched pair's data (the mover's, or a host copy); outside the lock.
  llvm::Error deliver(const Match &m);
  /// The default all-reduce: fp32 sums on the host in member order; outside the lock.
  static llvm::Error hostSum(llvm::ArrayRef<TensorView> buffers);

  int numThreads;
  std::function<std::string(int, size_t)> where;
  InProcessMover *mover;
  mutable std::mutex mu;
  std::condition_variable cv;
  std::vector<Channel> channels; // [src * n + dst]
  std::map<std::string, Rendezvous> rendezvous;
  std::string failure;
  std::atomic<bool> failed{false};
  size_t delivering = 0; // threads moving data (pairs, all-reduce sums) outside the lock
};

} // namespace pipec

#endif // PIPEC_RUNTIME_TRANSPORT_H
