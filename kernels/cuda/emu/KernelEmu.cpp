//===- KernelEmu.cpp - Runs a CUDA grid on the host: one fiber per thread ---===//
//
// KernelEmu.h documents the model (this file sees only KernelEmuRuntime.h, not its macros). A grid
// runs on the host thread that executes its stream's work (the caller, or the stream's worker in
// asynchronous mode), under a process-wide lock; its blocks run one after another. Each block's
// threads are fibers with their own stacks (a fiber runs one thread of each block in turn,
// fiberMain); the scheduler resumes every ready fiber until
// it finishes or waits at a barrier, then releases complete warp barriers, then (when every live
// thread waits there) the block barrier.
//
//===----------------------------------------------------------------------===//
#include "kernels/cuda/emu/KernelEmuRuntime.h"

#include "kernels/cuda/emu/FakeCuda.h"

#include <cuda_runtime_api.h>
#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <unordered_map>
#include <utility>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif
#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#endif

namespace pipec::emu::kernel {
namespace {

/// A fiber's new stack: under ASan, the shadow of an earlier stack unmapped at these addresses
/// (whose frames never returned) may still mark red zones there, which would fault the fiber's
/// writes. (Without ASan, nothing to do.)
void unpoisonStack([[maybe_unused]] char *stack, [[maybe_unused]] size_t bytes) {
#if defined(__SANITIZE_ADDRESS__)
  __asan_unpoison_memory_region(stack, bytes);
#endif
}

/// Under ThreadSanitizer, the fiber object it follows a context by (it cannot follow a switch of
/// stacks by hand otherwise): a fiber context owns one, made with it (fiberMain); the
/// scheduler's is its host thread's own. Elsewhere nothing.
struct SanitizerFiber {
  void *handle = nullptr;
  bool owned = false;
  SanitizerFiber() = default;
  SanitizerFiber(SanitizerFiber &&o) noexcept
      : handle(std::exchange(o.handle, nullptr)), owned(std::exchange(o.owned, false)) {}
  SanitizerFiber &operator=(SanitizerFiber &&o) noexcept {
    std::swap(handle, o.handle);
    std::swap(owned, o.owned);
    return *this;
  }
  ~SanitizerFiber() { release(); }
  void release() {
#if defined(__SANITIZE_THREAD__)
    if (owned && handle)
      __tsan_destroy_fiber(handle);
#endif
    handle = nullptr;
    owned = false;
  }
  /// A fresh fiber, for a context about to run a new thread.
  void renew() {
    release();
#if defined(__SANITIZE_THREAD__)
    handle = __tsan_create_fiber(0);
    owned = true;
#endif
  }
  /// The calling host thread's own (the scheduler's).
  void adoptCurrent() {
    release();
#if defined(__SANITIZE_THREAD__)
    handle = __tsan_get_current_fiber();
#endif
  }
  /// Tells ThreadSanitizer that this fiber runs next (just before the switch; with
  /// synchronisation, since the fibers of a block run one at a time on one host thread).
  void enter() const {
#if defined(__SANITIZE_THREAD__)
    __tsan_switch_to_fiber(handle, 0);
#endif
  }
};

// Switching between fibers. On x86-64 a few instructions that save and restore the registers the
// calling convention preserves (and the SSE/x87 control words) — swapcontext would also make
// two signal-mask system calls per switch, and a kernel switches at every barrier and shuffle.
// Elsewhere, ucontext.
#if defined(__x86_64__)
extern "C" void pipecEmuSwitch(void **save, void *load);
asm(R"(
  .text
  .globl pipecEmuSwitch
  .type pipecEmuSwitch, @function
pipecEmuSwitch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size pipecEmuSwitch, .-pipecEmuSwitch
)");

struct Context {
  void *sp = nullptr;
  SanitizerFiber sanitizer;
};

/// `context` starts `entry` (which never returns) on `stack` at the next switch to it.
void prepare(Context &context, char *stack, size_t bytes, void (*entry)()) {
  unpoisonStack(stack, bytes);
  context.sanitizer.renew();
  auto top = (reinterpret_cast<uintptr_t>(stack) + bytes) & ~uintptr_t(15);
  auto *frame = reinterpret_cast<uint64_t *>(top) - 9;
  const uint32_t mxcsr = 0x1f80; // the defaults: all exceptions masked, round to nearest
  const uint16_t x87Control = 0x037f;
  std::memcpy(frame, &mxcsr, 4);
  std::memcpy(reinterpret_cast<char *>(frame) + 4, &x87Control, 2);
  for (int r = 1; r <= 6; ++r)
    frame[r] = 0;                               // r15, r14, r13, r12, rbx, rbp
  frame[7] = reinterpret_cast<uint64_t>(entry); // `ret` goes there, leaving rsp = 8 mod 16
  frame[8] = 0;                                 // entry's (never used) return address
  context.sp = frame;
}

void switchTo(Context &from, Context &to) {
  to.sanitizer.enter();
  pipecEmuSwitch(&from.sp, to.sp);
}
#else
struct Context {
  ucontext_t uc;
  SanitizerFiber sanitizer;
};

void prepare(Context &context, char *stack, size_t bytes, void (*entry)()) {
  unpoisonStack(stack, bytes);
  context.sanitizer.renew();
  getcontext(&context.uc);
  context.uc.uc_stack.ss_sp = stack;
  context.uc.uc_stack.ss_size = bytes;
  context.uc.uc_link = nullptr;
  makecontext(&context.uc, entry, 0);
}

void switchTo(Context &from, Context &to) {
  to.sanitizer.enter();
  swapcontext(&from.uc, &to.uc);
}
#endif

constexpr int kWarp = 32;
constexpr size_t kStackBytes = size_t(256) << 10;
constexpr size_t kGuardBytes = size_t(64) << 10;
constexpr size_t kDefaultDynamicShared = size_t(48) << 10;
constexpr size_t kMaxDynamicShared = size_t(227) << 10; // sm_90's opt-in limit per block
/// Where a block's dynamic shared memory starts in its shared window (what sharedOffset and so
/// the descriptors see). A GPU places it after the reserved and the static shared memory with
/// no more than 16-byte alignment, so a kernel that swizzles in 1024-byte atoms must align its
/// tiles itself; 16 bytes past a 1024-byte boundary here, so that one that assumes an aligned
/// base reads the wrong bytes (and the 128-byte swizzle XORs the window address's bits, as a
/// GPU's does, not the offset's).
constexpr size_t kSharedWindowBase = 1024 + 16;

enum class State { Ready, AtWarpBarrier, AtBlockBarrier, AtMbarrier, Done };

[[noreturn]] void fatal(const char *message) {
  std::fprintf(stderr, "kernel emulator: %s\n", message);
  std::fflush(stderr);
  std::abort();
}

/// A fiber's stack: mmap'd, with an inaccessible guard page below it, so that an overflow
/// faults instead of corrupting the heap.
struct Stack {
  char *base = nullptr; // kStackBytes usable from here up
  Stack() = default;
  Stack(Stack &&o) noexcept : base(std::exchange(o.base, nullptr)) {}
  Stack &operator=(Stack &&o) noexcept {
    std::swap(base, o.base);
    return *this;
  }
  ~Stack() {
    if (base)
      munmap(base - kGuardBytes, kGuardBytes + kStackBytes);
  }
  explicit operator bool() const { return base != nullptr; }
  static Stack make() {
    void *p = mmap(nullptr, kGuardBytes + kStackBytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED || mprotect(p, kGuardBytes, PROT_NONE) != 0)
      fatal("cannot map a fiber stack");
    Stack s;
    s.base = static_cast<char *>(p) + kGuardBytes;
    return s;
  }
};

/// A cp.async copy of 16 bytes, queued until a wait lets it land.
struct AsyncCopy {
  void *to;
  const void *from; // null: 16 zero bytes (cp.async with a source size of 0)
};

/// Where a wgmma reads its shared-memory operands: the warp's instruction's descriptors.
struct OperandRead {
  uint64_t a = 0, b = 0;   // descriptors (a: only with sharedA)
  bool sharedA = false;    // A read through `a`, not from registers
  bool transposeB = false; // B MN-major
  int n = 0, warpInGroup = 0;
  bool transposeA = false; // A (in shared memory) MN-major
};

/// Bits of a float that marks an accumulator register a wgmma in flight will write: a quiet NaN,
/// so a read before the wait spreads NaN, and a payload no arithmetic produces, so a write
/// before the wait shows.
constexpr uint32_t kInFlightBits = 0x7fdead00u;

/// One lane's wgmma.mma_async in flight: issued, not yet completed by a wait_group.
struct InFlightWgmma {
  float *d = nullptr;
  int n = 0;
  std::array<float, 128> result{};  // d[0, n / 2) once it completes (computed at the issue)
  const uint32_t *a = nullptr;      // the A-fragment registers (null: A in shared memory) ...
  std::array<uint32_t, 4> aBits{};  // ... as the instruction read them
  OperandRead read;                 // lane 0 of each warp: the shared memory the warp's
  std::vector<uint16_t> sharedBits; // instruction reads, and its bits at the issue
};

/// Registers wgmma instructions read or write, as the async proxy last saw them: at the thread's
/// last wgmma.fence, at the wgmma that read them, or at the wait that wrote them.
struct WatchedRegisters {
  const void *at;
  size_t bytes;
  std::array<uint32_t, 128> bits; // up to an m64n256 accumulator
};

/// A thread's asynchronous operations of one kind (cp.async copies, wgmma) as the PTX ISA groups
/// them: those since the last commit_group, then the committed groups in flight, oldest first.
template <typename Op> struct AsyncGroups {
  std::vector<Op> open;
  std::deque<std::vector<Op>> committed;

  bool empty() const { return open.empty() && committed.empty(); }
  void clear() {
    open.clear();
    committed.clear();
  }
  /// commit_group: the open operations become one group (possibly empty).
  void commit() {
    committed.push_back(std::move(open));
    open.clear();
  }
  /// wait_group: the oldest groups leave, one by one, until at most `pending` remain; each is
  /// handed to `complete` once it has left.
  template <typename Complete> void wait(int pending, Complete complete) {
    while (committed.size() > size_t(std::max(pending, 0))) {
      std::vector<Op> group = std::move(committed.front());
      committed.pop_front();
      complete(group);
    }
  }
};

struct Fiber {
  Context context;
  State state = State::Ready;
  ThreadCoords coords;
  Stack stack;
  AsyncGroups<AsyncCopy> copies;      // cp.async not landed yet
  const uint64_t *mbarrier = nullptr; // AtMbarrier: the barrier waited on ...
  unsigned parity = 0;                // ... until its phase of this parity completes
  AsyncGroups<InFlightWgmma> wgmmas;  // wgmma not completed yet
  std::vector<WatchedRegisters> watched;
  bool wgmmaFenced = false;   // a wgmma.fence since the thread started
  uint64_t wgmmaIssued = 0;   // wgmma instructions the thread has issued
  uint64_t proxyFencedAt = 0; // the stamp (Grid::stamp) of its last fence.proxy.async, or 0
};

// An mbarrier in emulation: its 8 bytes hold the arrivals still pending in the current phase
// (bits 0-20), the count each phase expects (bits 21-41) and the current phase's parity (bit
// 63). Fibers run one at a time, so plain reads and writes do.
constexpr uint64_t kMbarrierCountMask = (uint64_t(1) << 21) - 1;
// The largest count mbarrier.init takes; a larger field (shared memory starts as 0xff bytes here)
// is a barrier never initialised.
constexpr uint64_t kMbarrierMaxCount = (uint64_t(1) << 20) - 1;
bool mbarrierInitialised(const uint64_t *bar) {
  const uint64_t expected = *bar >> 21 & kMbarrierCountMask;
  return expected != 0 && expected <= kMbarrierMaxCount;
}
bool mbarrierPhaseDone(const uint64_t *bar, unsigned parity) {
  return (*bar >> 63) != (parity & 1u);
}

struct WarpSlots {
  std::array<uint32_t, kWarp> mask{}; // the lanes each waiting lane's collective names
  std::array<uint64_t, kWarp> bits{};
  std::array<std::array<uint32_t, 4>, kWarp> a{};
  std::array<std::array<uint32_t, 2>, kWarp> b{};
};

/// The grid running on this host thread.
struct Grid {
  Context scheduler;
  // The compute capability (10 major + minor) of the device the grid was launched on.
  int computeCapability = 0;
  std::vector<Fiber> fibers; // grows to the largest block seen; the first `threads` are used
  size_t threads = 0, current = 0;
  std::vector<WarpSlots> warps;
  std::vector<std::byte> shared;
  const std::function<void()> *body = nullptr;
  // cp.async copies land at once (the earliest a GPU may complete them) in every other block,
  // and only at the wait that covers them (the latest) in the others: the first shows a copy
  // into a buffer that a slower warp still reads, the second a read that did not wait.
  bool copiesLandEarly = false;
  // Per 16 bytes of shared memory: when cp.async last wrote it (a stamp of `stamp`, 0 for never)
  // and which thread's copy that was. A wgmma may read it once that thread, or the reading
  // thread, has run fence.proxy.async since (the fence must lie between the generic proxy's
  // write and the async proxy's read). The chunks written, to clear them.
  std::vector<uint64_t> landedAt;
  std::vector<uint32_t> landedBy;
  std::vector<size_t> landedChunks;
  uint64_t stamp = 0; // counts landings and proxy fences in the block
  // The shared memory as at the block's latest fence.proxy.async, by any thread (as at its
  // start before the first): a wgmma may read only bytes that are still as they were then, since
  // an ordinary store reaches the async proxy only through such a fence. (Any thread's: weaker
  // than the PTX ISA, which asks for the writer's, but it sees a fence that is missing or comes
  // before the stores it should follow.)
  std::vector<std::byte> proxySeen;
};

thread_local Grid *running = nullptr;
thread_local std::unique_ptr<Grid> gridOfThread;

std::mutex &gridLock() {
  static std::mutex mu;
  return mu;
}

struct Limits {
  std::mutex mu;
  std::unordered_map<const void *, size_t> maxDynamicShared;
};
Limits &limits() {
  static Limits l;
  return l;
}

Grid &grid() {
  if (!running)
    fatal("a device function ran outside an emulated kernel");
  return *running;
}

Fiber &self() {
  Grid &g = grid();
  return g.fibers[g.current];
}

size_t linearThread(const ThreadCoords &c) {
  return c.thread.x + size_t(c.blockDim.x) * (c.thread.y + size_t(c.blockDim.y) * c.thread.z);
}

/// Lands a cp.async copy of the calling thread; wgmma may not read the chunk before a
/// fence.proxy.async of this thread or of the reader.
void land(const AsyncCopy &c) {
  if (c.from)
    std::memcpy(c.to, c.from, 16);
  else
    std::memset(c.to, 0, 16);
  Grid &g = grid();
  const size_t chunk = size_t(static_cast<std::byte *>(c.to) - g.shared.data()) / 16;
  if (g.landedAt[chunk] == 0)
    g.landedChunks.push_back(chunk);
  g.landedAt[chunk] = ++g.stamp;
  g.landedBy[chunk] = uint32_t(g.current);
}

void landAll(const std::vector<AsyncCopy> &group) {
  for (const AsyncCopy &c : group)
    land(c);
}

/// Back to the scheduler, in `state`.
void wait(State state) {
  Fiber &f = self();
  f.state = state;
  switchTo(f.context, grid().scheduler);
}

/// A fiber runs its threads one after another: one per block that uses it, each to its end
/// (every thread of a block finishes before the next block starts). So its frames return, and
/// its stack and ThreadSanitizer's record of it (SanitizerFiber) stay as they were made.
[[noreturn]] void fiberMain() {
  for (;;) {
    Grid &g = grid();
    (*g.body)();
    Fiber &f = g.fibers[g.current];
    if (!f.copies.empty())
      fatal("a thread exited with cp.async copies it never waited for");
    if (!f.wgmmas.empty())
      fatal("a thread exited with wgmma.mma_async in flight (no wgmma.wait_group covers it)");
    f.state = State::Done;
    switchTo(f.context, g.scheduler);
    // The next block's thread (runBlock made it Ready), or a mistake.
    if (grid().fibers[grid().current].state != State::Ready)
      fatal("a finished thread was resumed");
  }
}

/// wgmma is .aligned over a warpgroup: its four warps issue the same wgmma instructions, so at a
/// block barrier, and at the block's end, every thread of a warpgroup has issued as many.
void checkWarpgroupsAligned(const Grid &g, const ThreadCoords &base, const char *where) {
  for (size_t group = 0; (group + 1) * 128 <= g.threads; ++group) {
    const Fiber &first = g.fibers[group * 128];
    for (size_t i = group * 128 + 1; i < (group + 1) * 128; ++i)
      if (g.fibers[i].wgmmaIssued != first.wgmmaIssued) {
        char message[320];
        std::snprintf(message, sizeof message,
                      "block (%u, %u, %u), warpgroup %zu: at %s its threads have issued different "
                      "numbers of wgmma (thread %zu: %llu, thread %zu: %llu); all four warps of "
                      "a warpgroup must issue each one (.aligned)",
                      base.block.x, base.block.y, base.block.z, group, where, group * 128,
                      (unsigned long long)first.wgmmaIssued, i,
                      (unsigned long long)g.fibers[i].wgmmaIssued);
        fatal(message);
      }
  }
}

/// Runs one block to completion.
void runBlock(Grid &g, const ThreadCoords &base) {
  const size_t n = g.threads;
  g.scheduler.sanitizer.adoptCurrent();
  for (size_t i = 0; i < n; ++i) {
    Fiber &f = g.fibers[i];
    if (!f.stack) { // (else the fiber waits in fiberMain's loop for its next thread)
      f.stack = Stack::make();
      prepare(f.context, f.stack.base, kStackBytes, fiberMain);
    }
    f.state = State::Ready;
    f.copies.clear();
    f.wgmmas.clear();
    f.watched.clear();
    f.wgmmaFenced = false;
    f.wgmmaIssued = 0;
    f.proxyFencedAt = 0;
    f.coords = base;
    f.coords.thread =
        Index{unsigned(i % base.blockDim.x), unsigned(i / base.blockDim.x % base.blockDim.y),
              unsigned(i / (size_t(base.blockDim.x) * base.blockDim.y))};
  }
  std::memset(g.shared.data(), 0xff, g.shared.size()); // NaN until written
  std::memcpy(g.proxySeen.data(), g.shared.data(), g.shared.size());
  for (size_t chunk : g.landedChunks)
    g.landedAt[chunk] = 0;
  g.landedChunks.clear();
  g.stamp = 0;
  // Rounds alternate between ascending and descending thread order, so that a thread reading
  // what another wrote in the same barrier interval (a missing __syncthreads) runs before the
  // writer in one of them. Warps do not advance in lockstep either: between two block barriers
  // one warp (the leader: the first warp in even intervals, the last in odd ones) runs through
  // its warp collectives to the next block barrier before any other warp passes its first
  // collective, as a GPU may schedule them, so a warp that overwrites what a slower warp still
  // reads in the same interval shows.
  int leader = -1; // the warp running ahead in this interval, -1 before it is chosen
  bool oddInterval = false;
  for (bool descending = false;; descending = !descending) {
    for (size_t k = 0; k < n; ++k) {
      const size_t i = descending ? n - 1 - k : k;
      if (g.fibers[i].state == State::Ready) {
        g.current = i;
        switchTo(g.scheduler, g.fibers[i].context);
      }
    }
    // Nothing is ready: release the threads whose mbarrier phase has completed, else what can
    // be released (at most one warp: the leader while it waits at a collective, else the new
    // leader).
    bool released = false;
    for (size_t i = 0; i < n; ++i)
      if (g.fibers[i].state == State::AtMbarrier &&
          mbarrierPhaseDone(g.fibers[i].mbarrier, g.fibers[i].parity)) {
        g.fibers[i].state = State::Ready;
        released = true;
      }
    if (released)
      continue;
    size_t live = 0, atBlock = 0;
    // Warps whose every live lane waits at a collective (at most 1024 / 32 of them).
    std::array<size_t, 1024 / kWarp> releasable;
    size_t releasableCount = 0;
    for (size_t w = 0; w * kWarp < n; ++w) {
      size_t lanes = 0, atWarp = 0;
      for (size_t i = w * kWarp; i < std::min(n, (w + 1) * kWarp); ++i) {
        const State s = g.fibers[i].state;
        lanes += s != State::Done;
        atWarp += s == State::AtWarpBarrier;
        atBlock += s == State::AtBlockBarrier;
      }
      live += lanes;
      if (atWarp > 0 && atWarp == lanes)
        releasable[releasableCount++] = w;
    }
    if (releasableCount > 0) {
      const size_t *begin = releasable.data(), *end = begin + releasableCount;
      size_t w = oddInterval ? releasable[releasableCount - 1] : releasable[0];
      if (std::find(begin, end, size_t(leader)) != end)
        w = size_t(leader);
      leader = int(w);
      {
        uint32_t arrived = 0, exited = 0; // lanes past the block's size are neither
        for (size_t i = w * kWarp; i < std::min(n, (w + 1) * kWarp); ++i) {
          if (g.fibers[i].state == State::AtWarpBarrier)
            arrived |= 1u << (i % kWarp);
          if (g.fibers[i].state == State::Done)
            exited |= 1u << (i % kWarp);
        }
        for (size_t i = w * kWarp; i < std::min(n, (w + 1) * kWarp); ++i)
          if (g.fibers[i].state == State::AtWarpBarrier) {
            if (g.warps[w].mask[i % kWarp] & exited) {
              char message[200];
              std::snprintf(message, sizeof message,
                            "block (%u, %u, %u), warp %zu: a shuffle or mma names lanes (mask "
                            "0x%08x) that have exited (arrived: 0x%08x)",
                            base.block.x, base.block.y, base.block.z, w, g.warps[w].mask[i % kWarp],
                            arrived);
              fatal(message);
            }
            g.fibers[i].state = State::Ready;
          }
        released = true;
      }
    }
    if (released)
      continue;
    if (live == 0) {
      checkWarpgroupsAligned(g, base, "the block's end");
      return;
    }
    if (atBlock == live) {
      checkWarpgroupsAligned(g, base, "a __syncthreads");
      for (size_t i = 0; i < n; ++i)
        if (g.fibers[i].state == State::AtBlockBarrier)
          g.fibers[i].state = State::Ready;
      leader = -1;
      oddInterval = !oddInterval;
      continue;
    }
    char message[256];
    std::snprintf(message, sizeof message,
                  "deadlock in block (%u, %u, %u): %zu threads wait at __syncthreads while others "
                  "of their block wait at a warp collective (shuffle or mma) of a warp with lanes "
                  "at __syncthreads, or at an mbarrier phase that cannot complete",
                  base.block.x, base.block.y, base.block.z, atBlock);
    fatal(message);
  }
}

/// PIPEC_EMU_BLOCK_ORDER: "ascending" (unset: the default) runs a grid's blocks in index order;
/// "shuffled" in a new random order every launch, as a GPU may schedule them, so that a kernel
/// whose result depends on the order its blocks finish in (floating-point atomics) gives other
/// bits from one launch to the next, and a test of its determinism fails.
bool shuffleBlocks() {
  static const bool shuffled = [] {
    const char *v = std::getenv("PIPEC_EMU_BLOCK_ORDER");
    if (!v || std::strcmp(v, "") == 0 || std::strcmp(v, "ascending") == 0)
      return false;
    if (std::strcmp(v, "shuffled") == 0)
      return true;
    fatal("PIPEC_EMU_BLOCK_ORDER must be \"ascending\" or \"shuffled\"");
  }();
  return shuffled;
}

void runGrid(dim3 gridDim, dim3 blockDim, size_t sharedBytes, int computeCapability,
             const std::function<void()> &body) {
  std::lock_guard<std::mutex> lock(gridLock());
  if (!gridOfThread)
    gridOfThread = std::make_unique<Grid>();
  Grid &g = *gridOfThread;
  g.computeCapability = computeCapability;
  g.threads = size_t(blockDim.x) * blockDim.y * blockDim.z;
  if (g.fibers.size() < g.threads)
    g.fibers.resize(g.threads);
  g.warps.assign((g.threads + kWarp - 1) / kWarp, WarpSlots{});
  g.shared.assign(sharedBytes, std::byte{0});
  if (reinterpret_cast<uintptr_t>(g.shared.data()) % 16 != 0)
    fatal("the emulated shared memory is not 16-byte aligned");
  g.landedAt.assign(sharedBytes / 16 + 1, 0);
  g.landedBy.assign(sharedBytes / 16 + 1, 0);
  g.proxySeen.assign(sharedBytes, std::byte{0});
  g.landedChunks.clear();
  g.body = &body;
  running = &g;
  ThreadCoords base;
  base.blockDim = Index{blockDim.x, blockDim.y, blockDim.z};
  base.gridDim = Index{gridDim.x, gridDim.y, gridDim.z};
  const size_t blocks = size_t(gridDim.x) * gridDim.y * gridDim.z;
  std::vector<size_t> order(blocks);
  std::iota(order.begin(), order.end(), size_t(0));
  if (shuffleBlocks()) {
    // A new order every launch, from a process-wide launch count: reproducible, and two
    // launches of one kernel (the same kernel on two tp ranks) order their blocks apart.
    static std::atomic<uint64_t> launches{0};
    std::mt19937_64 rng(0x9e3779b97f4a7c15ull * (launches.fetch_add(1) + 1));
    std::shuffle(order.begin(), order.end(), rng);
  }
  for (size_t linear : order) {
    const unsigned x = unsigned(linear % gridDim.x);
    const unsigned y = unsigned(linear / gridDim.x % gridDim.y);
    const unsigned z = unsigned(linear / gridDim.x / gridDim.y);
    base.block = Index{x, y, z};
    g.copiesLandEarly = (x + y + z) % 2 == 1;
    runBlock(g, base);
  }
  running = nullptr;
}

float bf16Low(uint32_t pair) {
  uint32_t bits = pair << 16;
  float x;
  std::memcpy(&x, &bits, 4);
  return x;
}
float bf16High(uint32_t pair) {
  uint32_t bits = pair & 0xffff0000u;
  float x;
  std::memcpy(&x, &bits, 4);
  return x;
}

} // namespace

const ThreadCoords &coords() { return self().coords; }

void syncThreads() { wait(State::AtBlockBarrier); }

int laneId() { return int(linearThread(self().coords) % kWarp); }

uint64_t exchange(uint64_t bits, int srcLane, uint32_t mask) {
  const size_t t = linearThread(self().coords);
  WarpSlots &slots = grid().warps[t / kWarp];
  slots.mask[t % kWarp] = mask;
  slots.bits[t % kWarp] = bits;
  wait(State::AtWarpBarrier); // every lane has written
  const uint64_t got = slots.bits[size_t(srcLane) % kWarp];
  wait(State::AtWarpBarrier); // every lane has read
  return got;
}

void mmaM16N8K16Bf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  const size_t t = linearThread(self().coords);
  WarpSlots &slots = grid().warps[t / kWarp];
  const int lane = int(t % kWarp);
  slots.mask[size_t(lane)] = 0xffffffffu; // mma.sync.aligned: the whole warp
  slots.a[size_t(lane)] = {a[0], a[1], a[2], a[3]};
  slots.b[size_t(lane)] = {b[0], b[1]};
  wait(State::AtWarpBarrier);
  // The PTX ISA's fragments: groupID = lane / 4, threadID_in_group = lane % 4.
  //   A (16 x 16, row): register r holds (row g + 8 (r & 1), cols 2 t + 8 (r >> 1) + {0, 1}).
  //   B (16 x 8, col):  register r holds (rows 2 t + 8 r + {0, 1}, col g).
  //   C/D (16 x 8):     element e is (row g + 8 (e >> 1), col 2 t + (e & 1)).
  auto aAt = [&](int row, int col) {
    const int owner = (row % 8) * 4 + (col % 8) / 2;
    const uint32_t reg = slots.a[size_t(owner)][size_t((row / 8) + 2 * (col / 8))];
    return col % 2 ? bf16High(reg) : bf16Low(reg);
  };
  auto bAt = [&](int row, int col) {
    const int owner = col * 4 + (row % 8) / 2;
    const uint32_t reg = slots.b[size_t(owner)][size_t(row / 8)];
    return row % 2 ? bf16High(reg) : bf16Low(reg);
  };
  const int g = lane / 4, tg = lane % 4;
  for (int e = 0; e < 4; ++e) {
    const int row = g + 8 * (e >> 1), col = 2 * tg + (e & 1);
    float sum = d[e];
    for (int k = 0; k < 16; ++k)
      sum += aAt(row, k) * bAt(k, col);
    d[e] = sum;
  }
  wait(State::AtWarpBarrier); // every lane has read the fragments
}

void ldmatrixX4Trans(uint32_t (&r)[4], const void *row) {
  const size_t t = linearThread(self().coords);
  WarpSlots &slots = grid().warps[t / kWarp];
  const int lane = int(t % kWarp);
  if (reinterpret_cast<uintptr_t>(row) % 16 != 0)
    fatal("ldmatrix: a row address is not 16-byte aligned");
  slots.mask[size_t(lane)] = 0xffffffffu; // .aligned: the whole warp
  std::memcpy(&slots.bits[size_t(lane)], &row, sizeof row);
  wait(State::AtWarpBarrier);
  // Matrix i's row j is at the address lane 8 i + j passed; lane l gets rows 2 (l % 4) and
  // 2 (l % 4) + 1 of column l / 4.
  auto element = [&](int matrix, int rowOf, int column) {
    const void *p;
    std::memcpy(&p, &slots.bits[size_t(8 * matrix + rowOf)], sizeof p);
    uint16_t value;
    std::memcpy(&value, static_cast<const char *>(p) + 2 * column, 2);
    return uint32_t(value);
  };
  for (int i = 0; i < 4; ++i)
    r[i] = element(i, 2 * (lane % 4), lane / 4) | element(i, 2 * (lane % 4) + 1, lane / 4) << 16;
  wait(State::AtWarpBarrier); // every lane has read the addresses
}

namespace {
/// Checks a cp.async destination (16 bytes, 16-byte aligned, in the block's dynamic shared
/// memory) and queues `copy`, or lands it at once in blocks where copies land early.
void queueCopy(const AsyncCopy &copy) {
  Grid &g = grid();
  const auto *at = static_cast<const std::byte *>(copy.to);
  if (at < g.shared.data() || at + 16 > g.shared.data() + g.shared.size())
    fatal("cp.async: the destination is not in the block's dynamic shared memory");
  if (reinterpret_cast<uintptr_t>(copy.to) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(copy.from) % 16 != 0)
    fatal("cp.async: a 16-byte copy's address is not 16-byte aligned");
  if (g.copiesLandEarly)
    land(copy);
  else
    self().copies.open.push_back(copy);
}
} // namespace

void cpAsync16(void *shared, const void *global) { queueCopy({shared, global}); }

void cpAsync16Zero(void *shared) { queueCopy({shared, nullptr}); }

namespace {
uint64_t *checkedMbarrier(void *bar) {
  Grid &g = grid();
  const auto *at = static_cast<const std::byte *>(bar);
  if (at < g.shared.data() || at + 8 > g.shared.data() + g.shared.size())
    fatal("mbarrier: not in the block's dynamic shared memory");
  if (reinterpret_cast<uintptr_t>(bar) % 8 != 0)
    fatal("mbarrier: not 8-byte aligned");
  return static_cast<uint64_t *>(bar);
}

void arriveOn(uint64_t *bar) {
  if (!mbarrierInitialised(bar))
    fatal("mbarrier: an arrive on a barrier that was never initialised");
  const uint64_t expected = *bar >> 21 & kMbarrierCountMask;
  uint64_t pending = *bar & kMbarrierCountMask, phase = *bar >> 63;
  if (expected == 0 || pending == 0)
    fatal("mbarrier: an arrive on a barrier that was never initialised");
  if (--pending == 0) {
    pending = expected;
    phase ^= 1;
  }
  *bar = pending | expected << 21 | phase << 63;
}
} // namespace

void mbarrierInit(void *bar, unsigned count) {
  if (count == 0 || count > kMbarrierMaxCount)
    fatal("mbarrier: the count must be in [1, 2^20 - 1]");
  *checkedMbarrier(bar) = uint64_t(count) | uint64_t(count) << 21;
}

void mbarrierArrive(void *bar) { arriveOn(checkedMbarrier(bar)); }

void mbarrierWait(void *bar, unsigned parity) {
  uint64_t *b = checkedMbarrier(bar);
  if (!mbarrierInitialised(b))
    fatal("mbarrier: a wait on a barrier that was never initialised");
  if (mbarrierPhaseDone(b, parity))
    return;
  Fiber &f = self();
  f.mbarrier = b;
  f.parity = parity;
  wait(State::AtMbarrier);
  f.mbarrier = nullptr;
}

void cpAsyncMbarrierArrive(void *bar) {
  // The arrive follows the completion of every cp.async the thread issued before it: land them
  // now (the earliest a GPU may) and arrive.
  uint64_t *b = checkedMbarrier(bar);
  AsyncGroups<AsyncCopy> &copies = self().copies;
  copies.commit(); // the uncommitted ones too, after the committed
  copies.wait(0, landAll);
  arriveOn(b);
}

void cpAsyncCommit() { self().copies.commit(); }

void cpAsyncWait(int pending) { self().copies.wait(pending, landAll); }

void *dynamicShared() { return grid().shared.data(); }

uint32_t sharedOffset(const void *p) {
  Grid &g = grid();
  const auto *at = static_cast<const std::byte *>(p);
  if (at < g.shared.data() || at >= g.shared.data() + g.shared.size())
    fatal("a shared-memory address is not in the block's dynamic shared memory");
  return uint32_t(kSharedWindowBase + size_t(at - g.shared.data()));
}

namespace {
/// The offset in the block's dynamic shared memory (not its window address: kSharedWindowBase
/// less) of element (k, col) of B (16 x n), or,
/// K-major (transposeB false), element (col, k) of A, read through the descriptor `desc`. A
/// (m x 16) in shared memory is laid out as B (16 x n) is: MN-major A's element (m, k) is where
/// MN-major B's (k, m) would be (transposeB true, col m).
size_t descriptorOffset(uint64_t desc, int k, int col, bool transposeB) {
  // The matrix descriptor (PTX ISA, "Matrix Descriptor Format"): start address, leading and
  // stride dimension byte offsets, each in 16-byte units in 14 bits; base offset bits 49-51
  // (must be 0 here) and the swizzle mode bits 62-63 (0 none, 1 128-byte; the others are not
  // emulated). The canonical layouts (CUTLASS's cute/atom/mma_traits_sm90_gmma.hpp spells
  // them out), for 16-bit values:
  //   no swizzle, K-major:   core matrices of 8 rows (n) of 8 k-values, 128 contiguous bytes;
  //                          the leading offset steps k by 8, the stride offset n by 8;
  //   no swizzle, MN-major:  core matrices of 8 k-rows of 8 n-values; leading steps k by 8,
  //                          stride n by 8;
  //   128-byte, K-major:     rows (n) of 128 bytes, 8 to an atom; the stride offset steps n by
  //                          8 (the leading one is unused: a k-step of 16 stays in a row);
  //   128-byte, MN-major:    k-rows of 64 n-values (128 bytes), 8 to an atom; the stride offset
  //                          steps k by 8, the leading one n by 64;
  // and in 128-byte mode the byte address then has its bits 4-6 XORed with its bits 7-9.
  Grid &g = grid();
  const uint64_t b = desc;
  const size_t start = size_t(b & 0x3fff) << 4, leading = size_t(b >> 16 & 0x3fff) << 4;
  const size_t stride = size_t(b >> 32 & 0x3fff) << 4;
  const uint64_t mode = b >> 62;
  if ((b >> 49 & 7) != 0 || mode > 1)
    fatal("wgmma: only descriptors without swizzle or with the 128-byte one, and without base "
          "offset, are emulated");
  size_t offset;
  if (mode == 0)
    offset = transposeB ? start + size_t(col / 8) * stride + size_t(col % 8) * 2 +
                              size_t(k / 8) * leading + size_t(k % 8) * 16
                        : start + size_t(col / 8) * stride + size_t(col % 8) * 16 +
                              size_t(k / 8) * leading + size_t(k % 8) * 2;
  else
    offset = transposeB ? start + size_t(col / 64) * leading + size_t(col % 64) * 2 +
                              size_t(k / 8) * stride + size_t(k % 8) * 128
                        : start + size_t(col / 8) * stride + size_t(col % 8) * 128 + size_t(k) * 2;
  if (mode == 1)
    offset ^= (offset >> 7 & 7) << 4;
  if (offset < kSharedWindowBase || offset - kSharedWindowBase + 2 > g.shared.size())
    fatal("wgmma: an operand lies outside the block's dynamic shared memory");
  return offset - kSharedWindowBase;
}

uint16_t sharedBits(size_t offset) {
  uint16_t bits;
  std::memcpy(&bits, grid().shared.data() + offset, 2);
  return bits;
}

/// Element (k, col) of B, or (col, k) of A, as descriptorOffset.
float descriptorElement(uint64_t desc, int k, int col, bool transposeB) {
  return bf16Low(sharedBits(descriptorOffset(desc, k, col, transposeB)));
}

[[noreturn]] void wgmmaHazard(const char *what) {
  const ThreadCoords &c = self().coords;
  const size_t t = linearThread(c);
  char message[512];
  std::snprintf(message, sizeof message, "block (%u, %u, %u), thread %zu (warp %zu, lane %zu): %s",
                c.block.x, c.block.y, c.block.z, t, t / kWarp, t % kWarp, what);
  fatal(message);
}

/// The bits of every shared-memory element a warp's wgmma reads (B's 16 x n, then the warp's 16
/// rows of A when A is in shared memory). With `atIssue`, an element that cp.async wrote ends
/// the run unless the copying thread or the calling one has run fence.proxy.async since, and
/// one that changed since the block's latest fence.proxy.async (Grid::proxySeen) ends it too.
std::vector<uint16_t> readShared(const OperandRead &r, bool atIssue) {
  Grid &g = grid();
  std::vector<uint16_t> bits;
  bits.reserve(size_t(16) * size_t(r.n) + (r.sharedA ? 256 : 0));
  auto add = [&](size_t offset) {
    const uint64_t landed = g.landedAt[offset / 16];
    if (atIssue && landed != 0 && g.fibers[g.landedBy[offset / 16]].proxyFencedAt < landed &&
        self().proxyFencedAt < landed)
      wgmmaHazard("wgmma reads shared memory that cp.async wrote, with no fence.proxy.async "
                  "(fenceProxyAsyncShared) since, by the thread that copied or by the reader: "
                  "the async proxy may not see the copy");
    if (atIssue && std::memcmp(g.shared.data() + offset, g.proxySeen.data() + offset, 2) != 0)
      wgmmaHazard("wgmma reads shared memory that was written since the block's last "
                  "fence.proxy.async (fenceProxyAsyncShared): the async proxy may not see an "
                  "ordinary store that no such fence follows");
    bits.push_back(sharedBits(offset));
  };
  for (int k = 0; k < 16; ++k)
    for (int col = 0; col < r.n; ++col)
      add(descriptorOffset(r.b, k, col, r.transposeB));
  if (r.sharedA)
    for (int row = 0; row < 16; ++row)
      for (int k = 0; k < 16; ++k)
        add(descriptorOffset(r.a, k, 16 * r.warpInGroup + row, r.transposeA));
  return bits;
}

WatchedRegisters *findWatched(Fiber &f, const void *at) {
  for (WatchedRegisters &w : f.watched)
    if (w.at == at)
      return &w;
  return nullptr;
}

/// The async proxy has seen `bytes` at `at` as they are now.
void remember(Fiber &f, const void *at, size_t bytes) {
  WatchedRegisters *w = findWatched(f, at);
  if (!w) {
    f.watched.push_back({at, bytes, {}});
    w = &f.watched.back();
  }
  w->bytes = bytes;
  std::memcpy(w->bits.data(), at, bytes);
}

/// Registers a wgmma is about to access: unless first seen now, as the async proxy last saw them
/// (the PTX ISA asks for a wgmma.fence between another instruction's access and a wgmma's).
void checkFenced(Fiber &f, const void *at, size_t bytes, const char *what) {
  const WatchedRegisters *w = findWatched(f, at);
  if (w && w->bytes == bytes && std::memcmp(w->bits.data(), at, bytes) != 0) {
    char message[300];
    std::snprintf(message, sizeof message,
                  "%s of a wgmma were written since the last wgmma.fence (wgmmaFence): the "
                  "wgmma may read them before the write",
                  what);
    wgmmaHazard(message);
  }
}

/// The newest wgmma in flight that writes `d`, if any.
const InFlightWgmma *newestInFlight(const Fiber &f, const float *d) {
  for (auto op = f.wgmmas.open.rbegin(); op != f.wgmmas.open.rend(); ++op)
    if (op->d == d)
      return &*op;
  for (auto group = f.wgmmas.committed.rbegin(); group != f.wgmmas.committed.rend(); ++group)
    for (auto op = group->rbegin(); op != group->rend(); ++op)
      if (op->d == d)
        return &*op;
  return nullptr;
}

/// The start of a lane's wgmma: the PTX ISA's rules on its registers, and the accumulator it adds
/// to (that of the newest wgmma in flight on `d`: accumulating into the same registers needs no
/// wait, or d itself).
InFlightWgmma beginWgmma(Fiber &f, float *d, int n, bool accumulate, const uint32_t *a) {
  if (!f.wgmmaFenced)
    wgmmaHazard("a wgmma.mma_async before the thread's first wgmma.fence (wgmmaFence)");
  if (a)
    checkFenced(f, a, 4 * sizeof(uint32_t), "the A-fragment registers");
  InFlightWgmma op;
  op.d = d;
  op.n = n;
  op.a = a;
  if (a)
    std::memcpy(op.aBits.data(), a, 4 * sizeof(uint32_t));
  const size_t count = size_t(n) / 2;
  if (const InFlightWgmma *chained = newestInFlight(f, d)) {
    if (chained->n != n)
      wgmmaHazard("two wgmma of different shapes in flight on the same accumulator registers");
    for (size_t i = 0; i < count; ++i)
      if (std::memcmp(&d[i], &kInFlightBits, 4) != 0)
        wgmmaHazard("the accumulator registers of a wgmma in flight were written before the next "
                    "wgmma that accumulates into them");
    op.result = chained->result;
  } else {
    checkFenced(f, d, count * sizeof(float), "the accumulator registers");
    std::copy(d, d + count, op.result.begin());
  }
  return op;
}

/// The end of a lane's wgmma issue: d waits for the result, the A registers are seen as read.
void issueWgmma(Fiber &f, InFlightWgmma op) {
  const size_t count = size_t(op.n) / 2;
  for (size_t i = 0; i < count; ++i)
    std::memcpy(&op.d[i], &kInFlightBits, 4);
  if (op.a)
    remember(f, op.a, 4 * sizeof(uint32_t));
  ++f.wgmmaIssued;
  f.wgmmas.open.push_back(std::move(op));
}

/// Completes `op` at a wait: nothing it uses was touched while it ran; its result lands in d
/// unless a newer wgmma in flight (`superseded`) adds to it.
void completeWgmma(Fiber &f, const InFlightWgmma &op, bool superseded) {
  const size_t count = size_t(op.n) / 2;
  for (size_t i = 0; i < count; ++i)
    if (std::memcmp(&op.d[i], &kInFlightBits, 4) != 0)
      wgmmaHazard("the accumulator registers of a wgmma in flight were written before the "
                  "wgmma.wait_group that covers it");
  if (op.a && std::memcmp(op.a, op.aBits.data(), 4 * sizeof(uint32_t)) != 0)
    wgmmaHazard("the A-fragment registers of a wgmma in flight changed before the "
                "wgmma.wait_group that covers it (or the array holding them went out of scope: "
                "here fragment and accumulator arrays must outlive the wait)");
  if (!op.sharedBits.empty() && readShared(op.read, false) != op.sharedBits)
    wgmmaHazard("shared memory a wgmma in flight reads was written before the wgmma.wait_group "
                "that covers it (a buffer reused too early, or a wait missing)");
  if (superseded)
    return;
  std::copy(op.result.begin(), op.result.begin() + count, op.d);
  remember(f, op.d, count * sizeof(float));
}
} // namespace

namespace {
/// sm_90a's instructions (wgmma, fence.proxy.async) exist only in the sm_90a code of a binary,
/// which runs on a compute-capability-9.0 GPU alone: on another device the launcher must not
/// have chosen a kernel that uses them (there the launch would fail, no kernel image).
void requireSm90a(const char *instruction) {
  const int capability = grid().computeCapability;
  if (capability == 90)
    return;
  char message[256];
  std::snprintf(message, sizeof message,
                "%s on a compute-capability-%d.%d device: sm_90a code runs on 9.0 alone, so "
                "the launcher chose a Hopper kernel for a device without it",
                instruction, capability / 10, capability % 10);
  fatal(message);
}

/// A wgmma needs a block of whole warpgroups and an n that is a multiple of 8 in [8, 256].
void checkWgmma(const ThreadCoords &c, int n) {
  requireSm90a("wgmma.mma_async");
  if ((size_t(c.blockDim.x) * c.blockDim.y * c.blockDim.z) % 128 != 0)
    fatal("wgmma: the block is not made of whole warpgroups (128 threads)");
  if (n < 8 || n > 256 || n % 8 != 0)
    fatal("wgmma: n must be a multiple of 8 in [8, 256]");
}

/// The calling lane's accumulators of a warp's 16 rows x n: element 4 j + e is (row
/// g + 8 (e >> 1), column 8 j + 2 t + (e & 1)), given A(row, k) and B(k, col) for k < 16.
template <typename A, typename B>
void accumulateRows(float *d, int n, int lane, bool accumulate, A aAt, B bAt) {
  const int gid = lane / 4, tg = lane % 4;
  for (int j = 0; j < n / 8; ++j)
    for (int e = 0; e < 4; ++e) {
      const int row = gid + 8 * (e >> 1), col = 8 * j + 2 * tg + (e & 1);
      float sum = accumulate ? d[4 * j + e] : 0.0f;
      for (int k = 0; k < 16; ++k)
        sum += aAt(row, k) * bAt(k, col);
      d[4 * j + e] = sum;
    }
}
} // namespace

void wgmmaBf16Shared(float *d, int n, uint64_t a, uint64_t b, bool accumulate, bool transposeA,
                     bool transposeB) {
  Fiber &f = self();
  const ThreadCoords &c = f.coords;
  const size_t t = linearThread(c);
  checkWgmma(c, n);
  InFlightWgmma op = beginWgmma(f, d, n, accumulate, nullptr);
  WarpSlots &slots = grid().warps[t / kWarp];
  const int lane = int(t % kWarp), warpInGroup = int(t / kWarp % 4);
  slots.mask[size_t(lane)] = 0xffffffffu; // .sync.aligned: the whole warp (and warpgroup)
  wait(State::AtWarpBarrier);
  accumulateRows(
      op.result.data(), n, lane, accumulate,
      [&](int row, int k) { return descriptorElement(a, k, 16 * warpInGroup + row, transposeA); },
      [&](int k, int col) { return descriptorElement(b, k, col, transposeB); });
  if (lane == 0) {
    op.read = OperandRead{a, b, /*sharedA=*/true, transposeB, n, warpInGroup, transposeA};
    op.sharedBits = readShared(op.read, /*atIssue=*/true);
  }
  wait(State::AtWarpBarrier);
  issueWgmma(f, std::move(op));
}

void wgmmaBf16(float *d, int n, const uint32_t (&a)[4], uint64_t b, bool accumulate,
               bool transposeB) {
  Grid &g = grid();
  Fiber &f = self();
  const ThreadCoords &c = f.coords;
  const size_t t = linearThread(c);
  checkWgmma(c, n);
  InFlightWgmma op = beginWgmma(f, d, n, accumulate, a);
  WarpSlots &slots = g.warps[t / kWarp];
  const int lane = int(t % kWarp);
  slots.mask[size_t(lane)] = 0xffffffffu; // .sync.aligned: the whole warp (and warpgroup)
  slots.a[size_t(lane)] = {a[0], a[1], a[2], a[3]};
  wait(State::AtWarpBarrier);
  auto bAt = [&](int k, int col) { return descriptorElement(b, k, col, transposeB); };
  auto aAt = [&](int row, int col) { // mma.m16n8k16's A fragment, as mmaM16N8K16Bf16
    const int owner = (row % 8) * 4 + (col % 8) / 2;
    const uint32_t reg = slots.a[size_t(owner)][size_t((row / 8) + 2 * (col / 8))];
    return col % 2 ? bf16High(reg) : bf16Low(reg);
  };
  accumulateRows(op.result.data(), n, lane, accumulate, aAt, bAt);
  if (lane == 0) {
    op.read = OperandRead{0, b, /*sharedA=*/false, transposeB, n, int(t / kWarp % 4)};
    op.sharedBits = readShared(op.read, /*atIssue=*/true);
  }
  wait(State::AtWarpBarrier); // every lane has read the fragments
  issueWgmma(f, std::move(op));
}

void wgmmaFence() {
  requireSm90a("wgmma.fence");
  Fiber &f = self();
  f.wgmmaFenced = true;
  for (WatchedRegisters &w : f.watched)
    std::memcpy(w.bits.data(), w.at, w.bytes);
}

void wgmmaCommit() { self().wgmmas.commit(); }

void wgmmaWait(int pending) {
  Fiber &f = self();
  const size_t t = linearThread(f.coords);
  // .sync.aligned: the whole warp waits together, so its lanes' writes before the wait are in
  // place when lane 0 checks the shared memory its instructions read.
  grid().warps[t / kWarp].mask[t % kWarp] = 0xffffffffu;
  wait(State::AtWarpBarrier);
  f.wgmmas.wait(pending, [&](const std::vector<InFlightWgmma> &group) {
    for (size_t i = 0; i < group.size(); ++i) {
      bool superseded = newestInFlight(f, group[i].d) != nullptr;
      for (size_t j = i + 1; j < group.size() && !superseded; ++j)
        superseded = group[j].d == group[i].d;
      completeWgmma(f, group[i], superseded);
    }
  });
}

void fenceProxyAsyncShared() {
  requireSm90a("fence.proxy.async");
  Grid &g = grid();
  g.fibers[g.current].proxyFencedAt = ++g.stamp;
  std::memcpy(g.proxySeen.data(), g.shared.data(), g.shared.size());
}

void launch(dim3 gridDim, dim3 blockDim, size_t sharedBytes, cudaStream_t stream,
            const void *kernel, std::function<void()> body) {
  const size_t threads = size_t(blockDim.x) * blockDim.y * blockDim.z;
  size_t sharedLimit = kDefaultDynamicShared;
  {
    Limits &l = limits();
    std::lock_guard<std::mutex> lock(l.mu);
    if (auto it = l.maxDynamicShared.find(kernel); it != l.maxDynamicShared.end())
      sharedLimit = it->second;
  }
  if (threads == 0 || threads > 1024 || blockDim.z > 64 || gridDim.x == 0 || gridDim.y == 0 ||
      gridDim.z == 0 || gridDim.y > 65535 || gridDim.z > 65535) {
    setLastError(cudaErrorInvalidConfiguration);
    return;
  }
  if (sharedBytes > sharedLimit) {
    setLastError(cudaErrorInvalidValue);
    return;
  }
  // The device the launch is for (the calling thread's), as a GPU binds a launch to it.
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    setLastError(cudaErrorInvalidDevice);
    return;
  }
  const int computeCapability = 10 * major + minor;
  enqueue(stream, [=, body = std::move(body)] {
    runGrid(gridDim, blockDim, sharedBytes, computeCapability, body);
  });
}

} // namespace pipec::emu::kernel

extern "C" cudaError_t cudaFuncSetAttribute(const void *func, enum cudaFuncAttribute attr,
                                            int value) {
  using namespace pipec::emu::kernel;
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize)
    return cudaSuccess;
  if (value < 0 || size_t(value) > kMaxDynamicShared)
    return cudaErrorInvalidValue;
  Limits &l = limits();
  std::lock_guard<std::mutex> lock(l.mu);
  l.maxDynamicShared[func] = size_t(value);
  return cudaSuccess;
}
