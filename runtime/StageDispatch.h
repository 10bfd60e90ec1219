//===- StageDispatch.h - The instruction dispatch both GPT backends share -*- C++ -*-===//
//
// What a backend of the GPT does with the interpreter's calls, whatever computes the stages:
// which stage runs an op and which parts of it, where its input comes from (its own stage on
// this rank, a tensor kept past its producer's weight gradient, or a received one), which
// buffer a tp, dp or embedding all-reduce sums, when a fused backward's weight half runs (at
// once, or after the plan's last tp all-reduce of the op), and which input gradients must be
// kept: those whose consumer is on this rank and may run after the weight gradient frees the
// slice's state (V-shapes), and those this rank sends only after it (a valid, if unusual, plan).
// A kept tensor is freed once it is used: after its consumer's last part, or at this rank's
// next compute op after its send was exchanged (the transports order every read of a send
// before work the compute stream queues later, runtime/cuda/DeviceArena.h).
//
// The cpu backend (kernels::StageCompute, host vectors) and the cuda backend (GpuStage, arena
// buffers) derive from it (CRTP), so the cpu backend's gradient tests cover this logic for both.
// `Stage` is StageCompute's interface, with results either plain or wrapped in llvm::Expected
// (llvm::Error for backwardWeight). `Derived` supplies:
//   static constexpr const char *kName;                         // "cpu backend"
//   llvm::Error addLoss(Stage &, int mb, int slice);            // after a last stage's forward
//   llvm::Error allocate(Buffer &, size_t elements);            // a recv's buffer
//   llvm::Error keepCopy(Buffer &, TensorView src);             // a kept input gradient
//   static TensorView viewOf(Buffer &);
// and the Backend calls that differ (beginStep, sumLocalEmbeddingCopies, optimizerStep).
// Tensors are TensorViews (runtime/Tensor.h): the cpu stage's float spans convert to and from
// them; the cuda stage's are in its compute type.
// `Base` is Backend or an interface derived from it (the cuda backend's CudaRankBackend).
// Calls that cannot return an error (sendData, recvData) keep it: takeDeferred() returns it, and
// compute() and afterAllReduce() report it first.
//
// It never trusts the plan (piperun verifies it first, but a runtime must not depend on the
// verifier having seen every case): every index an instruction carries is range-checked, and
// the order the stage kernels need (a slice's forward parts in order, its backward after its
// forward, a microbatch's slices forward in ascending and backward in descending order, a
// weight gradient after its input gradient, a tp part's all-reduce right after the part, and a
// tensor read only while it exists) is checked before each kernel call (OpOrder). A plan that
// breaks it is a Finding naming the op, never a kernel assertion or a write out of bounds.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_STAGEDISPATCH_H
#define PIPEC_RUNTIME_STAGEDISPATCH_H

#include "ir/Plan.h"
#include "ir/support/Error.h"
#include "runtime/Backend.h"
#include "runtime/Interpreter.h"
#include "runtime/Tensor.h"

#include <cassert>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

namespace pipec {

namespace stage_dispatch {
/// A stage call's result as llvm::Expected, whether the stage returns it plainly or not.
template <class T> llvm::Expected<T> lift(T value) { return value; }
template <class T> llvm::Expected<T> lift(llvm::Expected<T> value) { return value; }
/// The same, as a TensorView.
template <class T> llvm::Expected<TensorView> liftView(T value) {
  auto r = lift(std::move(value));
  if (!r)
    return r.takeError();
  return TensorView(*r);
}
} // namespace stage_dispatch

/// The order in which a rank's stage kernels accept ops (what kernels/cpu/Gpt.cpp and
/// runtime/cuda/GpuStage.cpp assert), tracked per step so that the dispatch can refuse an op
/// out of order before a kernel sees it. One call per kernel part; each returns an error
/// message, or an empty string when the op may run (and records it).
class OpOrder {
public:
  void reset() {
    slices.clear();
    sequences.clear();
  }

  std::string forwardPart(int stage, int mb, int slice, int part, int parts) {
    SeqKey sk{stage, mb};
    if (part == 0) {
      if (slice == 0)
        sequences[sk] = Sequence{};
      auto seq = sequences.find(sk);
      if (seq == sequences.end())
        return fmt::format("slice {} runs forward before slice 0 of its microbatch", slice);
      if (seq->second.nextForward != slice)
        return fmt::format("the slices of a microbatch run forward in order; expected slice {}",
                           seq->second.nextForward);
      ++seq->second.nextForward;
      slices[SliceKey{stage, mb, slice}] = Slice{};
    }
    auto w = slices.find(SliceKey{stage, mb, slice});
    if (w == slices.end())
      return "a forward part before the forward began (part 0)";
    if (w->second.forwardDone != part)
      return fmt::format("forward parts run in order; expected part {}", w->second.forwardDone);
    if (part >= parts)
      return fmt::format("part {} but the stage has {} parts", part, parts);
    ++w->second.forwardDone;
    return {};
  }

  std::string backwardPart(int stage, int mb, int slice, int part, int parts) {
    auto w = slices.find(SliceKey{stage, mb, slice});
    if (w == slices.end() || w->second.forwardDone != parts)
      return "an input gradient before the forward of the same (stage, microbatch, slice) "
             "ended, or after its weight gradient";
    auto seq = sequences.find(SeqKey{stage, mb});
    if (seq == sequences.end())
      return "an input gradient of a microbatch whose slice 0 has already run backward";
    if (part == 0) {
      if (seq->second.nextBackward < 0)
        seq->second.nextBackward = seq->second.nextForward - 1;
      if (seq->second.nextBackward != slice)
        return fmt::format("the slices of a microbatch run backward last first; expected "
                           "slice {}",
                           seq->second.nextBackward);
      --seq->second.nextBackward;
    }
    if (w->second.backwardDone != part)
      return fmt::format("input-gradient parts run in order; expected part {}",
                         w->second.backwardDone);
    if (part >= parts)
      return fmt::format("part {} but the stage has {} parts", part, parts);
    ++w->second.backwardDone;
    if (part + 1 == parts && slice == 0)
      sequences.erase(seq); // (the kernels free the microbatch's K/V here)
    return {};
  }

  std::string weight(int stage, int mb, int slice, int parts) {
    auto w = slices.find(SliceKey{stage, mb, slice});
    if (w == slices.end() || w->second.backwardDone != parts)
      return "a weight gradient before its input gradient ended, or a second one";
    slices.erase(w); // (the kernels free the slice's state here)
    return {};
  }

  /// The stage's output (activation) or input gradient of (mb, slice) exists right now.
  bool has(TensorKind t, int stage, int mb, int slice, int parts) const {
    auto w = slices.find(SliceKey{stage, mb, slice});
    if (w == slices.end())
      return false;
    return t == TensorKind::Activation ? w->second.forwardDone == parts
                                       : w->second.backwardDone == parts;
  }

private:
  struct SeqKey {
    int stage, mb;
    auto operator<=>(const SeqKey &) const = default;
  };
  struct SliceKey {
    int stage, mb, slice;
    auto operator<=>(const SliceKey &) const = default;
  };
  struct Sequence {
    int nextForward = 0, nextBackward = -1;
  };
  struct Slice {
    int forwardDone = 0, backwardDone = 0;
  };
  std::map<SeqKey, Sequence> sequences;
  std::map<SliceKey, Slice> slices;
};

template <class Derived, class Stage, class Buffer, class Base = Backend>
class StageDispatch : public Base {
  static_assert(std::is_base_of_v<Backend, Base>, "StageDispatch implements a Backend");

public:
  llvm::Error compute(const Instruction &i) final {
    llvm::Error err = computeOp(i);
    if (!err)
      self().afterCompute(i);
    return err;
  }

  /// After each compute op that returned success: nothing here; a backend may hide it (the
  /// cuda backend records a progress event on its compute stream).
  void afterCompute(const Instruction &) {}
  /// After each call into a stage (a forward or input-gradient part, and before a fused
  /// backward's weight half frees the slice): nothing here; the cpu backend samples what it
  /// holds.
  void afterStageCall() {}

private:
  llvm::Error computeOp(const Instruction &i) {
    if (auto err = takeDeferred())
      return err;
    if (auto err = checkIndices(i))
      return err;
    if (auto err = checkNoReductionDue(i))
      return err;
    // Kept tensors whose sends have been exchanged since the last compute op.
    for (uint64_t k : keptSent)
      kept.erase(k);
    keptSent.clear();
    Stage &st = *stages.find(i.stage)->second;
    // An unsplit op (tp = 1) runs every kernel part; the reductions between them are over one
    // rank, i.e. nothing. A split op runs its one part; the plan's tp all_reduce follows.
    if (i.part >= 0 &&
        (i.parts != st.parts() || i.part >= i.parts || i.op == OpKind::BackwardWeight))
      return outOfOrder(i, fmt::format("names part {} of {} but stage {} has {} parts", i.part,
                                       i.parts, i.stage, st.parts()));
    const int first = std::max(i.part, 0), end = i.part < 0 ? st.parts() : i.part + 1;
    const bool last = i.isLastPart();
    switch (i.op) {
    case OpKind::Forward: {
      if (auto err = runParts(i, st, /*forward=*/true, first, end))
        return err;
      // The loss: now when unsplit; after the plan's tp all_reduce of the last part otherwise
      // (the vocab-parallel head completes it from the reduced statistics).
      if (last && i.part < 0 && i.stage == plan.numStages() - 1 && c.tp == 0)
        if (auto err = self().addLoss(st, i.mb, i.slice))
          return err;
      if (last)
        dropInput(TensorKind::Activation, i.stage - 1, i.mb, i.slice);
      return llvm::Error::success();
    }
    case OpKind::BackwardInput:
    case OpKind::Backward: {
      if (auto err = runParts(i, st, /*forward=*/false, first, end))
        return err;
      if (!last)
        return llvm::Error::success();
      dropInput(TensorKind::Gradient, i.stage + 1, i.mb, i.slice);
      // A fused backward's weight half runs once the last part's reduction is in place: now
      // when unsplit, after the plan's tp all_reduce otherwise.
      if (i.op == OpKind::Backward && i.part < 0)
        return finishFusedBackward(i.stage, i.mb, i.slice);
      return llvm::Error::success();
    }
    case OpKind::BackwardWeight:
      // (Checked before keepInputGrad reads the input gradient.)
      if (!order.has(TensorKind::Gradient, i.stage, i.mb, i.slice, st.parts()))
        return outOfOrder(i, "a weight gradient before its input gradient ended, or a second "
                             "one");
      if (auto err = keepInputGrad(i.stage, i.mb, i.slice))
        return err;
      order.weight(i.stage, i.mb, i.slice, st.parts());
      return backwardWeight(st, i.mb, i.slice);
    case OpKind::Send:
    case OpKind::Recv:
    case OpKind::AllReduce:
    case OpKind::OptimizerStep:
      break;
    }
    return inputError("{}: {} is not a compute op", Derived::kName, toString(i.op).str());
  }

public:
  TensorView sendData(const Instruction &i) final {
    // The tensor itself; the transport only reads it.
    auto src = sendSource(i);
    if (!src) {
      defer(src.takeError());
      return {};
    }
    return *src;
  }

  TensorView recvData(const Instruction &i) final {
    if (auto err = checkIndices(i, /*onThisRank=*/false)) {
      defer(std::move(err));
      return {};
    }
    Buffer &buffer = received[key(i.tensor, i.stage, i.mb, i.slice)];
    auto [b, e] = plan.seqSlices[size_t(i.slice)];
    if (auto err = self().allocate(buffer, elementsPerToken * size_t(e - b)))
      defer(std::move(err));
    return Derived::viewOf(buffer);
  }

  TensorView reduceData(const Instruction &i) final {
    if (auto err = checkIndices(i)) {
      defer(std::move(err));
      return {};
    }
    switch (i.collective) {
    case CollectiveGroup::Tp:
      // Only the part that just ran, once: its buffer may be gone after the next op.
      if (!awaiting || awaiting->op != i.phase || awaiting->stage != i.stage ||
          awaiting->mb != i.mb || awaiting->slice != i.slice || awaiting->part != i.part) {
        defer(finding("{}: a tp all_reduce of {} {}; each follows its part directly, once",
                      Derived::kName, describeReduced(i),
                      awaiting ? "where " + describePart(*awaiting) + "'s is due"
                               : std::string("with no part waiting for it")));
        return {};
      }
      return pendingReduce;
    case CollectiveGroup::Dp:
      return stages.find(i.stage)->second->grads();
    case CollectiveGroup::Embedding: {
      Stage &st = *stages.find(i.stage)->second;
      auto [b, e] = st.tiedEmbeddingRange();
      return TensorView(st.grads()).sub(b, e - b);
    }
    }
    return {};
  }

  llvm::Error afterAllReduce(const Instruction &i) final {
    if (auto err = takeDeferred())
      return err;
    if (i.collective != CollectiveGroup::Tp)
      return llvm::Error::success();
    // reduceData() matched `awaiting` against this op (else the deferred error returned).
    const Instruction part = *awaiting;
    awaiting.reset();
    pendingReduce = {};
    if (!part.isLastPart())
      return llvm::Error::success();
    if (part.op == OpKind::Backward)
      return finishFusedBackward(part.stage, part.mb, part.slice);
    if (part.op == OpKind::Forward && part.stage == plan.numStages() - 1 && c.tp == 0)
      return self().addLoss(*stages.find(part.stage)->second, part.mb, part.slice);
    return llvm::Error::success();
  }

protected:
  /// `elementsPerToken` = microbatch x channels (a p2p tensor has that many elements per token).
  StageDispatch(const Plan &plan, const Coord &c, size_t elementsPerToken)
      : plan(plan), c(c), elementsPerToken(elementsPerToken) {
    // Gradient sends placed after their op's weight gradient: that gradient must outlive the
    // slice's state.
    std::set<uint64_t> weightDone;
    for (const Instruction &i : plan.ranks[size_t(c.pp)]) {
      if ((i.op == OpKind::BackwardWeight || i.op == OpKind::Backward) && i.isLastPart())
        weightDone.insert(key(TensorKind::Gradient, i.stage, i.mb, i.slice));
      if (i.op == OpKind::Send && i.tensor == TensorKind::Gradient &&
          weightDone.count(key(i.tensor, i.stage, i.mb, i.slice)))
        sentLate.insert(key(i.tensor, i.stage, i.mb, i.slice));
    }
  }

  /// Elements of the received and kept tensors held now.
  size_t heldBufferElements() const {
    size_t n = 0;
    for (const auto *m : {&received, &kept})
      for (const auto &[key, buffer] : *m)
        n += Derived::elementsOf(buffer);
    return n;
  }

  /// Received and kept tensors of the step (between steps).
  void clearStepBuffers() {
    received.clear();
    kept.clear();
    keptSent.clear();
    order.reset();
    awaiting.reset();
    pendingReduce = {};
  }

  void defer(llvm::Error err) {
    if (deferred)
      llvm::consumeError(std::move(err));
    else
      deferred = std::move(err);
  }

  llvm::Error takeDeferred() {
    llvm::Error err = std::move(deferred);
    deferred = llvm::Error::success();
    return err;
  }

  const Plan &plan;
  Coord c;
  std::map<int, std::unique_ptr<Stage>> stages;

private:
  Derived &self() { return static_cast<Derived &>(*this); }

  static uint64_t key(TensorKind t, int stage, int mb, int slice) {
    return (((uint64_t(stage) << 20) | uint64_t(mb)) << 12 | uint64_t(slice)) << 1 |
           uint64_t(t == TensorKind::Gradient);
  }

  /// Parts [first, end) of the forward (or the input gradient) `i` on `st`, each once OpOrder
  /// accepts it; part 0 reads its input from the neighbouring stage (none at the pipeline's end).
  /// A split op's part then waits for the plan's tp all_reduce.
  llvm::Error runParts(const Instruction &i, Stage &st, bool forward, int first, int end) {
    const TensorKind kind = forward ? TensorKind::Activation : TensorKind::Gradient;
    const int producer = forward ? i.stage - 1 : i.stage + 1;
    TensorView in;
    if (first == 0 && producer >= 0 && producer < plan.numStages()) {
      auto got = inputOf(kind, producer, i.mb, i.slice);
      if (!got)
        return got.takeError();
      in = *got;
    }
    for (int part = first; part < end; ++part) {
      const std::string why = forward
                                  ? order.forwardPart(i.stage, i.mb, i.slice, part, st.parts())
                                  : order.backwardPart(i.stage, i.mb, i.slice, part, st.parts());
      if (!why.empty())
        return outOfOrder(i, why);
      auto r = forward ? stage_dispatch::lift(st.forward(i.mb, i.slice, part, in))
                       : stage_dispatch::lift(st.backwardInput(i.mb, i.slice, part, in));
      if (!r)
        return r.takeError();
      pendingReduce = *r;
      self().afterStageCall();
    }
    if (i.part >= 0)
      awaiting = i;
    return llvm::Error::success();
  }

  /// A consumed input: what was received for it, or kept of it, is freed.
  void dropInput(TensorKind t, int producer, int mb, int slice) {
    received.erase(key(t, producer, mb, slice));
    kept.erase(key(t, producer, mb, slice));
  }

  llvm::Error backwardWeight(Stage &st, int mb, int slice) {
    if constexpr (std::is_void_v<decltype(st.backwardWeight(mb, slice))>) {
      st.backwardWeight(mb, slice);
      return llvm::Error::success();
    } else {
      return st.backwardWeight(mb, slice);
    }
  }

  /// The tensor a send carries: kept (freed at the next compute op), or its stage's output /
  /// input gradient.
  llvm::Expected<TensorView> sendSource(const Instruction &i) {
    if (auto err = checkIndices(i))
      return err;
    // (Reading a stage's output finishes the op and frees the buffer the reduction sums.)
    if (auto err = checkNoReductionDue(i))
      return err;
    if (auto it = kept.find(key(i.tensor, i.stage, i.mb, i.slice)); it != kept.end()) {
      keptSent.push_back(it->first);
      return Derived::viewOf(it->second);
    }
    Stage &st = *stages.find(i.stage)->second;
    if (!order.has(i.tensor, i.stage, i.mb, i.slice, st.parts()))
      return outOfOrder(i, fmt::format("sends {} while it does not exist (before its producer "
                                       "ended, or after the slice's weight gradient freed it)",
                                       toString(i.tensor).str()));
    if (i.tensor == TensorKind::Activation)
      return stage_dispatch::liftView(st.output(i.mb, i.slice));
    return stage_dispatch::liftView(st.inputGrad(i.mb, i.slice));
  }

  /// The input a compute op needs from stage `producer`: kept, its stage object when it is on
  /// this rank, else what was received.
  llvm::Expected<TensorView> inputOf(TensorKind t, int producer, int mb, int slice) {
    const uint64_t k = key(t, producer, mb, slice);
    if (auto it = kept.find(k); it != kept.end())
      return Derived::viewOf(it->second);
    if (plan.rankOf(producer) == c.pp) {
      Stage &p = *stages.find(producer)->second;
      if (!order.has(t, producer, mb, slice, p.parts()))
        return finding("{}: rank {} needs {}({},{},{}) of its own stage {}, which does not exist "
                       "now (not yet made, or freed by the slice's weight gradient)",
                       Derived::kName, c.pp, toString(t).str(), producer, mb, slice, producer);
      if (t == TensorKind::Activation)
        return stage_dispatch::liftView(p.output(mb, slice));
      return stage_dispatch::liftView(p.inputGrad(mb, slice));
    }
    auto it = received.find(k);
    if (it == received.end())
      return finding("{}: rank {} needs {}({},{},{}) from rank {} but has not received it",
                     Derived::kName, c.pp, toString(t).str(), producer, mb, slice,
                     plan.rankOf(producer));
    return Derived::viewOf(it->second);
  }

  /// The weight half of a fused backward; it frees the slice's state, so the input gradient is
  /// kept for any consumer first (its send comes after the whole fused op).
  llvm::Error finishFusedBackward(int stage, int mb, int slice) {
    if (auto err = keepInputGrad(stage, mb, slice, /*anyConsumer=*/true))
      return err;
    Stage &st = *stages.find(stage)->second;
    if (auto why = order.weight(stage, mb, slice, st.parts()); !why.empty())
      return finding("{}: the weight half of the fused backward of ({}, {}, {}): {}",
                     Derived::kName, stage, mb, slice, why);
    return backwardWeight(st, mb, slice);
  }

  /// An instruction's indices: its stage on this rank (unless `onThisRank` is false: a recv
  /// names the producer's stage), its microbatch and slice in range.
  llvm::Error checkIndices(const Instruction &i, bool onThisRank = true) const {
    const ParallelConfig &pc = plan.parallel;
    if (i.stage < 0 || i.stage >= plan.numStages())
      return outOfOrder(i, fmt::format("stage {} is outside 0..{}", i.stage, plan.numStages() - 1));
    if (onThisRank && !stages.count(i.stage))
      return outOfOrder(i, fmt::format("stage {} is not on rank {}", i.stage, c.pp));
    bool perOp = i.isCompute() || i.isP2P() ||
                 (i.op == OpKind::AllReduce && i.collective == CollectiveGroup::Tp);
    if (perOp && (i.mb < 0 || i.mb >= pc.microbatches || i.slice < 0 || i.slice >= pc.seqSplits ||
                  size_t(i.slice) >= plan.seqSlices.size()))
      return outOfOrder(i, fmt::format("microbatch {} or slice {} is outside the plan's {} and {}",
                                       i.mb, i.slice, pc.microbatches, pc.seqSplits));
    return llvm::Error::success();
  }

  /// Nothing but its tp all_reduce may follow a split part.
  llvm::Error checkNoReductionDue(const Instruction &i) const {
    if (!awaiting)
      return llvm::Error::success();
    return outOfOrder(i, fmt::format("the tp all_reduce of {} has not run; every tp part is "
                                     "followed by its all-reduce",
                                     describePart(*awaiting)));
  }

  llvm::Error outOfOrder(const Instruction &i, llvm::StringRef why) const {
    return finding("{}: rank {} cannot run {} {}: {}", Derived::kName, c.pp, toString(i.op).str(),
                   describeOp(i), why.str());
  }
  static std::string describeOp(const Instruction &i) {
    return i.part >= 0
               ? fmt::format("({}, {}, {}) part {}/{}", i.stage, i.mb, i.slice, i.part, i.parts)
               : fmt::format("({}, {}, {})", i.stage, i.mb, i.slice);
  }
  static std::string describePart(const Instruction &i) {
    return fmt::format("{} {}", toString(i.op).str(), describeOp(i));
  }
  static std::string describeReduced(const Instruction &ar) {
    return fmt::format("{} ({}, {}, {}) part {}/{}", toString(ar.phase).str(), ar.stage, ar.mb,
                       ar.slice, ar.part, ar.parts);
  }

  /// Before a weight gradient frees the slice's state: keep the input gradient if its
  /// consumer, stage - 1, is on this rank and may run later (V-shapes), or if this rank sends
  /// it only after the weight gradient (otherwise it has been sent already).
  llvm::Error keepInputGrad(int stage, int mb, int slice, bool anyConsumer = false) {
    if (stage == 0)
      return llvm::Error::success();
    const bool sameRank = plan.rankOf(stage - 1) == c.pp;
    const uint64_t k = key(TensorKind::Gradient, stage, mb, slice);
    if (!anyConsumer && !sameRank && !sentLate.count(k))
      return llvm::Error::success();
    Stage &st = *stages.find(stage)->second;
    if (!order.has(TensorKind::Gradient, stage, mb, slice, st.parts()))
      return finding("{}: the input gradient of ({}, {}, {}) does not exist", Derived::kName, stage,
                     mb, slice);
    auto g = stage_dispatch::liftView(st.inputGrad(mb, slice));
    if (!g)
      return g.takeError();
    return self().keepCopy(kept[k], *g);
  }

  size_t elementsPerToken;
  std::map<uint64_t, Buffer> received, kept;
  std::vector<uint64_t> keptSent; // kept tensors sent since the last compute op
  std::set<uint64_t> sentLate;
  OpOrder order;
  /// The split part whose tp all_reduce is due (its result is pendingReduce).
  std::optional<Instruction> awaiting;
  TensorView pendingReduce;
  llvm::Error deferred = llvm::Error::success();
};

} // namespace pipec

#endif // PIPEC_RUNTIME_STAGEDISPATCH_H
