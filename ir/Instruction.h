//===- Instruction.h - The closed set of plan instructions ------*- C++ -*-===//
//
// One instruction of a rank's stream. The set is closed: every consumer (verifier, simulator,
// memory analysis, runtime) switches over OpKind without a default.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_IR_INSTRUCTION_H
#define PIPEC_IR_INSTRUCTION_H

#include "llvm/ADT/StringRef.h"

#include <cstdint>

namespace pipec {

enum class OpKind : uint8_t {
  /// act(s,m,k) = stage_s.forward(input(s,m,k)); allocates activation_bytes[k] of stage s.
  /// Needs F(s-1,m,k) and, when K > 1, F(s,m,k-1) (K/V of earlier sub-sequences).
  Forward,
  /// dx(s,m,k) = stage_s.backward_input(dy(s,m,k)); frees activation - weight_grad bytes.
  /// Needs F(s,m,k), B(s+1,m,k) and, when K > 1, B(s,m,k+1) (dK/dV of later sub-sequences).
  BackwardInput,
  /// dW(s) += stage_s.backward_weight(m,k); frees weight_grad bytes. Needs BackwardInput(s,m,k).
  BackwardWeight,
  /// Fused BackwardInput + BackwardWeight; frees all activation bytes at its end.
  Backward,
  /// post send(tensor(stage,mb,slice) -> peer); matched by exactly one Recv of the same tensor
  /// on `peer`, in FIFO order per (sender, receiver) pair. Issued after the tensor's producer.
  Send,
  /// post recv(tensor(stage,mb,slice) <- peer); matched by exactly one Send on `peer`. Issued
  /// before the tensor's consumer on this rank.
  Recv,
  /// x = sum over `group` replicas of x. dp: gradients of `stage` (after its last W);
  /// tp: Megatron's intra-layer reduction after part `part` of a forward or backward_input;
  /// embedding: tied embedding gradients between first and last stage ranks.
  AllReduce,
  /// params = adam(params, grads); after every all-reduce of the rank.
  OptimizerStep,
};

/// Which tensor a send/recv carries, named by its producer stage.
enum class TensorKind : uint8_t {
  /// Output of F(stage): travels stage -> stage + 1.
  Activation,
  /// Input gradient made by B/I(stage): travels stage -> stage - 1.
  Gradient,
};

/// Which replica group a collective runs over.
enum class CollectiveGroup : uint8_t { Dp, Tp, Embedding };

constexpr int32_t kNoGroup = -1;

/// A plan instruction. Fields that do not apply to an op are -1 (or 0 for bytes).
struct Instruction {
  OpKind op = OpKind::Forward;
  TensorKind tensor = TensorKind::Activation;       // Send/Recv only.
  CollectiveGroup collective = CollectiveGroup::Dp; // AllReduce only.
  OpKind phase = OpKind::Forward; // tp AllReduce only: Forward, BackwardInput or Backward.
  int32_t stage = -1;
  int32_t mb = -1;
  int32_t slice = -1;
  int32_t peer = -1;        // Send/Recv: the other pipeline rank.
  int32_t group = kNoGroup; // Send/Recv: ops with the same group are issued together.
  int32_t part = -1;        // Compute split by tp all-reduces: part index, -1 when unsplit.
  int32_t parts = 0;        // Number of parts when split.
  int64_t bytes = 0;        // Send/Recv/AllReduce payload.

  static Instruction compute(OpKind op, int32_t stage, int32_t mb, int32_t slice) {
    Instruction i;
    i.op = op;
    i.stage = stage;
    i.mb = mb;
    i.slice = slice;
    return i;
  }

  bool isCompute() const {
    return op == OpKind::Forward || op == OpKind::BackwardInput || op == OpKind::BackwardWeight ||
           op == OpKind::Backward;
  }
  bool isP2P() const { return op == OpKind::Send || op == OpKind::Recv; }
  /// True for the last (or only) part of a compute op: where its outputs become available.
  bool isLastPart() const { return part < 0 || part == parts - 1; }
  bool isFirstPart() const { return part <= 0; }

  bool operator==(const Instruction &o) const = default;
};

llvm::StringRef toString(OpKind op);
llvm::StringRef toString(TensorKind tensor);
llvm::StringRef toString(CollectiveGroup group);
/// Reverse of toString; returns false when the name is unknown.
bool opKindFromString(llvm::StringRef name, OpKind &out);
bool tensorKindFromString(llvm::StringRef name, TensorKind &out);
bool collectiveGroupFromString(llvm::StringRef name, CollectiveGroup &out);

/// The grid letter of a compute op: F, I (backward_input), W, B (fused backward).
char computeLetter(OpKind op);

} // namespace pipec

#endif // PIPEC_IR_INSTRUCTION_H
