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
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_STAGEDISPATCH_H
#define PIPEC_RUNTIME_STAGEDISPATCH_H

#include "ir/Error.h"
#include "ir/Plan.h"
#include "runtime/Backend.h"
#include "runtime/Interpreter.h"
#include "runtime/Tensor.h"

#include <cassert>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
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
    // Kept tensors whose sends have been exchanged since the last compute op.
    for (uint64_t k : keptSent)
      kept.erase(k);
    keptSent.clear();
    Stage &st = *stages.at(i.stage);
    // An unsplit op (tp = 1) runs every kernel part; the reductions between them are over one
    // rank, i.e. nothing. A split op runs its one part; the plan's tp all_reduce follows.
    const int first = std::max(i.part, 0), end = i.part < 0 ? st.parts() : i.part + 1;
    const bool last = i.isLastPart();
    switch (i.op) {
    case OpKind::Forward: {
      TensorView in;
      if (i.stage > 0 && first == 0) {
        auto got = inputOf(TensorKind::Activation, i.stage - 1, i.mb, i.slice);
        if (!got)
          return got.takeError();
        in = *got;
      }
      for (int part = first; part < end; ++part) {
        auto r = stage_dispatch::lift(st.forward(i.mb, i.slice, part, in));
        if (!r)
          return r.takeError();
        pendingReduce = *r;
        self().afterStageCall();
      }
      // The loss: now when unsplit; after the plan's tp all_reduce of the last part otherwise
      // (the vocab-parallel head completes it from the reduced statistics).
      if (last && i.part < 0 && i.stage == plan.numStages() - 1 && c.tp == 0)
        if (auto err = self().addLoss(st, i.mb, i.slice))
          return err;
      if (last) {
        received.erase(key(TensorKind::Activation, i.stage - 1, i.mb, i.slice));
        kept.erase(key(TensorKind::Activation, i.stage - 1, i.mb, i.slice));
      }
      return llvm::Error::success();
    }
    case OpKind::BackwardInput:
    case OpKind::Backward: {
      TensorView grad;
      if (i.stage < plan.numStages() - 1 && first == 0) {
        auto got = inputOf(TensorKind::Gradient, i.stage + 1, i.mb, i.slice);
        if (!got)
          return got.takeError();
        grad = *got;
      }
      for (int part = first; part < end; ++part) {
        auto r = stage_dispatch::lift(st.backwardInput(i.mb, i.slice, part, grad));
        if (!r)
          return r.takeError();
        pendingReduce = *r;
        self().afterStageCall();
      }
      if (!last)
        return llvm::Error::success();
      received.erase(key(TensorKind::Gradient, i.stage + 1, i.mb, i.slice));
      kept.erase(key(TensorKind::Gradient, i.stage + 1, i.mb, i.slice));
      // A fused backward's weight half runs once the last part's reduction is in place: now
      // when unsplit, after the plan's tp all_reduce otherwise.
      if (i.op == OpKind::Backward && i.part < 0)
        return finishFusedBackward(i.stage, i.mb, i.slice);
      return llvm::Error::success();
    }
    case OpKind::BackwardWeight:
      if (auto err = keepInputGrad(i.stage, i.mb, i.slice))
        return err;
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
    Buffer &buffer = received[key(i.tensor, i.stage, i.mb, i.slice)];
    auto [b, e] = plan.seqSlices[size_t(i.slice)];
    if (auto err = self().allocate(buffer, elementsPerToken * size_t(e - b)))
      defer(std::move(err));
    return Derived::viewOf(buffer);
  }

  TensorView reduceData(const Instruction &i) final {
    switch (i.collective) {
    case CollectiveGroup::Tp:
      return pendingReduce;
    case CollectiveGroup::Dp:
      return stages.at(i.stage)->grads();
    case CollectiveGroup::Embedding: {
      Stage &st = *stages.at(i.stage);
      auto [b, e] = st.tiedEmbeddingRange();
      return TensorView(st.grads()).sub(b, e - b);
    }
    }
    return {};
  }

  llvm::Error afterAllReduce(const Instruction &i) final {
    if (auto err = takeDeferred())
      return err;
    if (i.collective != CollectiveGroup::Tp || i.part != i.parts - 1)
      return llvm::Error::success();
    if (i.phase == OpKind::Backward)
      return finishFusedBackward(i.stage, i.mb, i.slice);
    if (i.phase == OpKind::Forward && i.stage == plan.numStages() - 1 && c.tp == 0)
      return self().addLoss(*stages.at(i.stage), i.mb, i.slice);
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
    if (auto it = kept.find(key(i.tensor, i.stage, i.mb, i.slice)); it != kept.end()) {
      keptSent.push_back(it->first);
      return Derived::viewOf(it->second);
    }
    Stage &st = *stages.at(i.stage);
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
      Stage &p = *stages.at(producer);
      if (t == TensorKind::Activation)
        return stage_dispatch::liftView(p.output(mb, slice));
      return stage_dispatch::liftView(p.inputGrad(mb, slice));
    }
    auto it = received.find(k);
    assert(it != received.end() && "the verifier guarantees a recv before its consumer");
    return Derived::viewOf(it->second);
  }

  /// The weight half of a fused backward; it frees the slice's state, so the input gradient is
  /// kept for any consumer first (its send comes after the whole fused op).
  llvm::Error finishFusedBackward(int stage, int mb, int slice) {
    if (auto err = keepInputGrad(stage, mb, slice, /*anyConsumer=*/true))
      return err;
    return backwardWeight(*stages.at(stage), mb, slice);
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
    auto g = stage_dispatch::liftView(stages.at(stage)->inputGrad(mb, slice));
    if (!g)
      return g.takeError();
    return self().keepCopy(kept[k], *g);
  }

  size_t elementsPerToken;
  std::map<uint64_t, Buffer> received, kept;
  std::vector<uint64_t> keptSent; // kept tensors sent since the last compute op
  std::set<uint64_t> sentLate;
  TensorView pendingReduce;
  llvm::Error deferred = llvm::Error::success();
};

} // namespace pipec

#endif // PIPEC_RUNTIME_STAGEDISPATCH_H
