//===- FakeNccl.cpp - NCCL's calls, for ranks that are threads of one process -===//
//
// Part of the emulated device (kernels/cuda/emu/README.md): the NCCL calls of runtime/cuda/Nccl.cpp
// and NcclRun.cpp, for ranks that are threads of one process, so that the nccl mode (one rank
// per "process") runs several ranks in CI, which no one-GPU machine can (NCCL refuses two ranks
// on one GPU). Data is host memory (the fake CUDA runtime's). NCCL's rules that the runtime
// relies on are kept:
//   - ncclCommInitRank blocks until all ranks of the id have joined (the id comes from
//     NCCL_COMM_ID, as with the real library's bootstrap); with NCCL_COMM_ID, RANK 0 starts the
//     bootstrap root in its call, and another rank that finds no root retries its connection
//     for NCCL's retry window only (NCCL_SOCKET_RETRY_CNT times, sleeping k times
//     NCCL_SOCKET_RETRY_SLEEP_MSEC before the k-th: 34 and 100 ms, 59.5 s in all, by default),
//     then fails with ncclRemoteError as NCCL does; after emu::setNcclOneGpu(true)
//     fails on every rank as NCCL does for ranks sharing a GPU; ncclCommSplit is a collective of
//     the parent that orders each color's members by (key, rank);
//   - sends and recvs of a rank pair on one communicator match in FIFO order, with equal sizes
//     (a mismatch is an error); the ops between ncclGroupStart and ncclGroupEnd are posted at once
//     and ncclGroupEnd returns when all have matched; an op outside a group completes alone;
//   - ncclAllReduce (sum; bf16, fp32, fp64, uint64) is a rendezvous of all ranks, added in rank
//     order;
//   - the first send or recv on a channel (sender, receiver, communicator) connects it: the host
//     call that posts it blocks until the other side has posted on it too, also on asynchronous
//     streams, where the matching then waits in the stream.
// Where the real library returns and lets the GPU wait, this one blocks: the calling thread on
// the synchronous emulated device, the stream's worker thread on the asynchronous one (where the
// sends, recvs and all-reduces run in their stream's order, and a failure there becomes the
// communicator's asynchronous error, as NCCL reports one). The plans the verifier accepts
// complete under these blocking rules (the in-process transport's).
// A wait longer than 60 s fails with ncclSystemError instead of hanging CI; ncclCommAbort fails
// every wait on that communicator, every member's. (Both unlike NCCL, whose waits never time
// out and whose abort tells no peer: there a peer of an aborted process fails through its own
// watchdog, or over sockets when that process exits. A test that passes because a peer's abort
// released a rank proves less than it seems.)
//
//===----------------------------------------------------------------------===//
#include "runtime/cuda/emu/FakeNccl.h"

#include "kernels/HostBf16.h"
#include "kernels/cuda/emu/FakeCuda.h"

#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

namespace {

constexpr auto kPatience = std::chrono::seconds(60);

/// The members of one communicator, shared by their ncclComm objects.
struct Group {
  int size = 0;
  bool aborted = false;
  ncclResult_t asyncError = ncclSuccess; // of work run on a stream
  // The sides of its channels that have posted once (sender, receiver, sender's side?): a
  // channel with both is connected (connect()). Kept here, not in `channels`, which is keyed
  // by the group's address: a later group may reuse that address.
  std::set<std::tuple<int, int, bool>> came;
};

struct Posted {
  bool send = false;
  void *buffer = nullptr;
  size_t bytes = 0;
  bool done = false;
};

struct Rendezvous {
  int arrived = 0;
  std::vector<std::tuple<int, int, int>> splits; // (rank, color, key)
  std::vector<std::pair<const void *, void *>> buffers;
  bool complete = false;
  std::map<int, std::shared_ptr<Group>> splitGroups; // color -> group
  std::map<int, int> splitRank;                      // parent rank -> new rank
  int pickedUp = 0;
};

struct Init {
  std::shared_ptr<Group> group;
  int joined = 0, left = 0;
  bool root = false; // RANK 0 has joined: its bootstrap root listens
};

/// How long a rank other than 0 keeps trying to reach the bootstrap root, as NCCL's socket
/// connect retries: NCCL_SOCKET_RETRY_CNT retries (34), the k-th after k times
/// NCCL_SOCKET_RETRY_SLEEP_MSEC (100 ms).
std::chrono::milliseconds rootRetryWindow() {
  auto param = [](const char *name, long fallback) {
    const char *v = std::getenv(name);
    return v && *v ? std::strtol(v, nullptr, 10) : fallback;
  };
  const long retries = param("NCCL_SOCKET_RETRY_CNT", 34);
  const long sleep = param("NCCL_SOCKET_RETRY_SLEEP_MSEC", 100);
  return std::chrono::milliseconds(sleep * retries * (retries + 1) / 2);
}

struct Channel {
  std::deque<Posted *> sends, recvs; // FIFO
};

std::mutex mu;
std::condition_variable cv;
// The test hooks (FakeNccl.h).
std::atomic<bool> oneGpu{false};
std::atomic<int> sendDelayMs{0};
std::map<std::string, Init> inits;                         // by id
std::map<std::tuple<Group *, int, int>, Channel> channels; // (group, src, dst)
std::map<std::pair<Group *, long>, Rendezvous> rendezvous; // (group, sequence)
thread_local int groupDepth = 0;
thread_local std::string lastError;
std::string lastAsyncError; // of work run on a stream (under mu)
size_t connected = 0;       // channels with both sides posted (under mu)
size_t aborted = 0;         // communicators aborted (under mu)

} // namespace

struct ncclComm {
  std::shared_ptr<Group> group;
  int rank = 0;
  long collectives = 0; // this member's count: the rendezvous sequence
  struct Pending {
    bool send;
    void *buffer;
    size_t bytes;
    int peer;
    cudaStream_t stream;
  };
};

namespace {

/// A send or recv as queued: the communicator's group and this member's rank are copied, since
/// queued work may outlive the ncclComm object (an abort frees it).
struct Op {
  std::shared_ptr<Group> group;
  int rank;
  ncclComm::Pending p;
};

thread_local std::vector<Op> pending;

size_t sizeOf(ncclDataType_t t) {
  switch (t) {
  case ncclInt8:
  case ncclUint8:
    return 1;
  case ncclFloat16:
  case ncclBfloat16:
    return 2;
  case ncclInt32:
  case ncclUint32:
  case ncclFloat32:
    return 4;
  case ncclInt64:
  case ncclUint64:
  case ncclFloat64:
    return 8;
  default:
    return 0;
  }
}

ncclResult_t fail(const std::string &why, ncclResult_t code = ncclSystemError) {
  lastError = "emulated NCCL: " + why;
  return code;
}

/// Waits (holding `lock`) until `ready()`; an aborted group or the patience running out fail.
template <typename Ready>
ncclResult_t waitFor(std::unique_lock<std::mutex> &lock, Group *g, Ready ready, const char *what) {
  auto until = std::chrono::steady_clock::now() + kPatience;
  while (!ready()) {
    if (g && g->aborted)
      return fail(std::string(what) + ": the communicator was aborted", ncclRemoteError);
    if (cv.wait_until(lock, until) == std::cv_status::timeout && !ready())
      return fail(std::string(what) + ": no partner within 60 s");
  }
  return ncclSuccess;
}

/// Matches the heads of one channel (lock held); an error on a size mismatch.
ncclResult_t matchChannel(Channel &c) {
  while (!c.sends.empty() && !c.recvs.empty()) {
    Posted *s = c.sends.front(), *r = c.recvs.front();
    if (s->bytes != r->bytes)
      return fail("a send of " + std::to_string(s->bytes) + " bytes met a recv of " +
                  std::to_string(r->bytes) + " bytes (sends and recvs of a pair match in order)");
    if (s->bytes)
      std::memcpy(r->buffer, s->buffer, s->bytes);
    s->done = r->done = true;
    c.sends.pop_front();
    c.recvs.pop_front();
  }
  return ncclSuccess;
}

/// Posts `ops` of the calling thread at once and waits until every one has matched. On a
/// failure its ops leave the channels (nobody may match a dead stack frame) and the
/// communicator is marked aborted, so that its peers fail too instead of waiting.
ncclResult_t postAndWait(const std::vector<Op> &ops) {
  std::vector<Posted> posted(ops.size());
  std::unique_lock<std::mutex> lock(mu);
  Group *g = ops.front().group.get();
  ncclResult_t result = ncclSuccess;
  for (size_t k = 0; k < ops.size() && result == ncclSuccess; ++k) {
    const Op &op = ops[k];
    const ncclComm::Pending &p = op.p;
    if (p.peer < 0 || p.peer >= op.group->size) {
      result = fail("peer " + std::to_string(p.peer) + " outside a communicator of " +
                        std::to_string(op.group->size),
                    ncclInvalidArgument);
      break;
    }
    posted[k] = Posted{p.send, p.buffer, p.bytes, false};
    int src = p.send ? op.rank : p.peer, dst = p.send ? p.peer : op.rank;
    Channel &c = channels[{op.group.get(), src, dst}];
    (p.send ? c.sends : c.recvs).push_back(&posted[k]);
    result = matchChannel(c);
  }
  cv.notify_all();
  if (result == ncclSuccess)
    result = waitFor(
        lock, g,
        [&] {
          return std::all_of(posted.begin(), posted.end(), [](const Posted &p) { return p.done; });
        },
        "send/recv");
  if (result != ncclSuccess) {
    for (auto &[key, c] : channels)
      for (auto *q : {&c.sends, &c.recvs})
        q->erase(std::remove_if(q->begin(), q->end(),
                                [&](Posted *p) {
                                  return p >= posted.data() && p < posted.data() + posted.size();
                                }),
                 q->end());
    g->aborted = true;
    cv.notify_all();
  }
  return result;
}

/// NCCL connects a channel (a sender and a receiver on one communicator) at its first use, in
/// the host call that posts it, which blocks until the other side has posted on the channel
/// too. So here: every op of `ops` marks its side of its channel, then the call waits until
/// each channel has both (a group whose peer posts the mirror image connects at once).
ncclResult_t connect(const std::vector<Op> &ops) {
  std::unique_lock<std::mutex> lock(mu);
  std::vector<std::tuple<Group *, int, int>> waiting; // (communicator, sender, receiver)
  for (const Op &op : ops) {
    const ncclComm::Pending &p = op.p;
    if (p.peer < 0 || p.peer >= op.group->size)
      continue; // (postAndWait reports it)
    const int src = p.send ? op.rank : p.peer, dst = p.send ? p.peer : op.rank;
    if (op.group->came.insert({src, dst, p.send}).second &&
        op.group->came.count({src, dst, !p.send}) > 0)
      ++connected;
    waiting.emplace_back(op.group.get(), src, dst);
  }
  cv.notify_all();
  return waitFor(
      lock, ops.front().group.get(),
      [&] {
        return std::all_of(waiting.begin(), waiting.end(), [](const auto &c) {
          const auto [g, src, dst] = c;
          return g->came.count({src, dst, true}) > 0 && g->came.count({src, dst, false}) > 0;
        });
      },
      "connecting to a peer (its first send or recv with this rank)");
}

/// Runs `op` now (synchronous device) or in `stream`'s order, its failure then becoming the
/// group's asynchronous error.
ncclResult_t launch(cudaStream_t stream, std::shared_ptr<Group> group,
                    std::function<ncclResult_t()> op) {
  if (!pipec::emu::asynchronous())
    return op();
  pipec::emu::enqueue(stream, [group, op] {
    if (ncclResult_t r = op(); r != ncclSuccess) {
      {
        std::lock_guard<std::mutex> lock(mu);
        if (group->asyncError == ncclSuccess)
          group->asyncError = r;
        group->aborted = true;
        if (lastAsyncError.empty())
          lastAsyncError = lastError;
      }
      cv.notify_all();
    }
  });
  return ncclSuccess;
}

ncclResult_t p2p(bool send, void *buffer, size_t count, ncclDataType_t type, int peer,
                 ncclComm_t comm, cudaStream_t stream) {
  if (!comm)
    return fail("send/recv on a null communicator", ncclInvalidArgument);
  ncclComm::Pending p{send, buffer, count * sizeOf(type), peer, stream};
  Op op{comm->group, comm->rank, p};
  if (groupDepth > 0) {
    pending.push_back(std::move(op));
    return ncclSuccess;
  }
  if (ncclResult_t r = connect({op}); r != ncclSuccess)
    return r;
  return launch(stream, comm->group, [op] { return postAndWait({op}); });
}

/// Every member's `count` values of T added in rank order, into every member's output.
template <typename T, typename Buffers> void sumInRankOrder(const Buffers &buffers, size_t count) {
  std::vector<T> sum(count, T(0));
  for (auto [in, out] : buffers)
    for (size_t i = 0; i < count; ++i)
      sum[i] += static_cast<const T *>(in)[i];
  for (auto [in, out] : buffers)
    std::memcpy(out, sum.data(), count * sizeof(T));
}

ncclResult_t allReduceNow(std::shared_ptr<Group> group, int rank, long seq, const void *sendbuff,
                          void *recvbuff, size_t count, ncclDataType_t datatype) {
  Group *g = group.get();
  std::unique_lock<std::mutex> lock(mu);
  Rendezvous &rv = rendezvous[{g, seq}];
  if (rv.buffers.empty())
    rv.buffers.resize(size_t(g->size));
  rv.buffers[size_t(rank)] = {sendbuff, recvbuff};
  if (++rv.arrived == g->size) {
    // In rank order, into a scratch, then to every member.
    if (datatype == ncclBfloat16) {
      // Widened and added in fp32, rounded once (NCCL's own rounding points differ).
      std::vector<float> sum(count, 0.0f);
      for (auto [in, out] : rv.buffers)
        for (size_t i = 0; i < count; ++i)
          sum[i] += pipec::kernels::bf16ToFloat(static_cast<const uint16_t *>(in)[i]);
      std::vector<uint16_t> rounded(count);
      for (size_t i = 0; i < count; ++i)
        rounded[i] = pipec::kernels::floatToBf16(sum[i]);
      for (auto [in, out] : rv.buffers)
        std::memcpy(out, rounded.data(), count * sizeof(uint16_t));
    } else if (datatype == ncclFloat32) {
      sumInRankOrder<float>(rv.buffers, count);
    } else if (datatype == ncclUint64) { // (wrapping, as NCCL's)
      sumInRankOrder<uint64_t>(rv.buffers, count);
    } else {
      sumInRankOrder<double>(rv.buffers, count);
    }
    rv.complete = true;
    cv.notify_all();
  }
  Rendezvous *at = &rv;
  if (auto r = waitFor(
          lock, g, [&] { return at->complete; }, "ncclAllReduce");
      r != ncclSuccess)
    return r;
  if (++at->pickedUp == g->size)
    rendezvous.erase({g, seq});
  return ncclSuccess;
}

} // namespace

extern "C" {

const char *ncclGetErrorString(ncclResult_t result) {
  switch (result) {
  case ncclSuccess:
    return "no error";
  case ncclSystemError:
    return "unhandled system error (emulated NCCL)";
  case ncclInvalidArgument:
    return "invalid argument (emulated NCCL)";
  case ncclInvalidUsage:
    return "invalid usage (emulated NCCL)";
  case ncclRemoteError:
    return "remote process exited or there was a network error (emulated NCCL)";
  default:
    return "internal error (emulated NCCL)";
  }
}

const char *ncclGetLastError(ncclComm_t) {
  if (!lastError.empty())
    return lastError.c_str();
  std::lock_guard<std::mutex> lock(mu);
  static thread_local std::string copy;
  copy = lastAsyncError;
  return copy.c_str();
}

ncclResult_t ncclGetVersion(int *version) {
  *version = NCCL_VERSION_CODE; // (the headers' own: the emulation follows them)
  return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId *uniqueId) {
  std::memset(uniqueId, 0, sizeof *uniqueId);
  // As the real bootstrap: every process with the same NCCL_COMM_ID gets the same id; without
  // it, a fresh one.
  static long fresh = 0;
  std::string id;
  if (const char *env = std::getenv("NCCL_COMM_ID"))
    id = std::string("env:") + env;
  else {
    std::lock_guard<std::mutex> lock(mu);
    id = "fresh:" + std::to_string(++fresh);
  }
  std::strncpy(uniqueId->internal, id.c_str(), sizeof uniqueId->internal - 1);
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank) {
  if (nranks < 1 || rank < 0 || rank >= nranks)
    return fail("bad rank or size", ncclInvalidArgument);
  std::string id(commId.internal, strnlen(commId.internal, sizeof commId.internal));
  std::unique_lock<std::mutex> lock(mu);
  Init &init = inits[id];
  if (!init.group) {
    init.group = std::make_shared<Group>();
    init.group->size = nranks;
  }
  if (init.group->size != nranks)
    return fail("ranks disagree on the communicator's size", ncclInvalidUsage);
  std::shared_ptr<Group> mine = init.group;
  Init *at = &init;
  if (rank == 0)
    at->root = true;
  else if (id.rfind("env:", 0) == 0 && !at->root &&
           !cv.wait_for(lock, rootRetryWindow(), [&] { return at->root; })) {
    // (Not counted as joined: the real root never hears of this rank.)
    lastError = "emulated NCCL: bootstrap: connect to the root of NCCL_COMM_ID returned "
                "Connection refused, exceeded error retry count";
    return ncclRemoteError;
  }
  ++at->joined;
  cv.notify_all();
  if (auto r = waitFor(
          lock, nullptr, [&] { return at->joined >= nranks; }, "ncclCommInitRank");
      r != ncclSuccess)
    return r;
  // The last one to leave clears the entry, so that the id can be used again.
  if (++at->left == nranks)
    inits.erase(id);
  // NCCL 2.5 and later refuse two ranks on one GPU of one host: every rank fails, naming itself
  // and the first other rank on its GPU (in NCCL's words). The ranks here are threads on the one
  // emulated device; they count as processes of their own GPUs unless setNcclOneGpu(true)
  // puts them all on it, as a launch of several processes on a one-GPU host would.
  if (oneGpu && nranks > 1) {
    char words[128];
    std::snprintf(words, sizeof words,
                  "Duplicate GPU detected : rank %d and rank %d both on CUDA device %lx", rank,
                  rank == 0 ? 1 : 0, 0x1000ul);
    lastError = words;
    return ncclInvalidUsage;
  }
  *comm = new ncclComm{mine, rank, 0};
  return ncclSuccess;
}

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm,
                           ncclConfig_t *) {
  if (!comm)
    return fail("split of a null communicator", ncclInvalidArgument);
  Group *g = comm->group.get();
  std::unique_lock<std::mutex> lock(mu);
  Rendezvous &rv = rendezvous[{g, comm->collectives++}];
  rv.splits.emplace_back(comm->rank, color, key);
  if (int(rv.splits.size()) == g->size) {
    std::map<int, std::vector<std::tuple<int, int>>> byColor; // color -> (key, rank)
    for (auto [r, c, k] : rv.splits)
      if (c != NCCL_SPLIT_NOCOLOR)
        byColor[c].emplace_back(k, r);
    for (auto &[c, members] : byColor) {
      std::sort(members.begin(), members.end());
      auto group = std::make_shared<Group>();
      group->size = int(members.size());
      rv.splitGroups[c] = group;
      for (size_t i = 0; i < members.size(); ++i)
        rv.splitRank[std::get<1>(members[i])] = int(i);
    }
    rv.complete = true;
    cv.notify_all();
  }
  Rendezvous *at = &rv;
  if (auto r = waitFor(
          lock, g, [&] { return at->complete; }, "ncclCommSplit");
      r != ncclSuccess)
    return r;
  *newcomm = color == NCCL_SPLIT_NOCOLOR
                 ? nullptr
                 : new ncclComm{at->splitGroups.at(color), at->splitRank.at(comm->rank), 0};
  if (++at->pickedUp == g->size)
    rendezvous.erase({g, comm->collectives - 1});
  return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int *count) {
  if (!comm)
    return fail("count of a null communicator", ncclInvalidArgument);
  *count = comm->group->size;
  return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError) {
  std::lock_guard<std::mutex> lock(mu);
  *asyncError = !comm || !comm->group->aborted           ? ncclSuccess
                : comm->group->asyncError != ncclSuccess ? comm->group->asyncError
                                                         : ncclRemoteError;
  return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t) { return ncclSuccess; }

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (!comm)
    return ncclSuccess;
  {
    std::lock_guard<std::mutex> lock(mu);
    comm->group->aborted = true;
    ++aborted;
  }
  cv.notify_all();
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclGroupStart() {
  ++groupDepth;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
  if (groupDepth == 0)
    return fail("ncclGroupEnd without ncclGroupStart", ncclInvalidUsage);
  if (--groupDepth > 0)
    return ncclSuccess;
  auto ops = std::move(pending);
  pending.clear();
  if (ops.empty())
    return ncclSuccess;
  // (The runtime posts a group's ops on one stream.) Taken before the ops move into the work.
  cudaStream_t stream = ops.front().p.stream;
  std::shared_ptr<Group> group = ops.front().group;
  if (ncclResult_t r = connect(ops); r != ncclSuccess)
    return r;
  // setNcclSendDelayMs (asynchronous streams): a group with a send waits that long in its
  // stream before it posts, as a send to a slow link or a late peer does, so that the sender's
  // compute runs ahead of it (the test of a sent buffer's release, runtime/cuda/DeviceArena.h).
  const int delayMs = std::any_of(ops.begin(), ops.end(), [](const Op &op) { return op.p.send; })
                          ? sendDelayMs.load()
                          : 0;
  return launch(stream, std::move(group), [ops = std::move(ops), delayMs] {
    if (delayMs > 0)
      std::this_thread::sleep_for(std::chrono::milliseconds(delayMs));
    return postAndWait(ops);
  });
}

ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream) {
  return p2p(true, const_cast<void *>(sendbuff), count, datatype, peer, comm, stream);
}

ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream) {
  return p2p(false, recvbuff, count, datatype, peer, comm, stream);
}

ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count,
                           ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                           cudaStream_t stream) {
  if (!comm)
    return fail("all-reduce on a null communicator", ncclInvalidArgument);
  if (op != ncclSum || (datatype != ncclFloat32 && datatype != ncclFloat64 &&
                        datatype != ncclBfloat16 && datatype != ncclUint64))
    return fail("only bf16, fp32, fp64 and uint64 sums are emulated", ncclInvalidArgument);
  if (groupDepth > 0)
    return fail("an all-reduce inside a group is not emulated", ncclInvalidUsage);
  long seq = 0;
  {
    std::lock_guard<std::mutex> lock(mu);
    seq = comm->collectives++; // in the order the host posts them, as NCCL's
  }
  std::shared_ptr<Group> group = comm->group;
  int rank = comm->rank;
  return launch(stream, group, [=] {
    return allReduceNow(group, rank, seq, sendbuff, recvbuff, count, datatype);
  });
}

} // extern "C"

size_t pipec::emu::ncclChannelsConnected() {
  std::lock_guard<std::mutex> lock(mu);
  return connected;
}

void pipec::emu::setNcclOneGpu(bool all) { oneGpu = all; }

void pipec::emu::setNcclSendDelayMs(int ms) { sendDelayMs = ms; }

size_t pipec::emu::ncclCommsAborted() {
  std::lock_guard<std::mutex> lock(mu);
  return aborted;
}
