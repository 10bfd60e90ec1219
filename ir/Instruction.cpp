#include "ir/Instruction.h"

#include "llvm/Support/ErrorHandling.h"

namespace pipec {

llvm::StringRef toString(OpKind op) {
  switch (op) {
  case OpKind::Forward:
    return "forward";
  case OpKind::BackwardInput:
    return "backward_input";
  case OpKind::BackwardWeight:
    return "backward_weight";
  case OpKind::Backward:
    return "backward";
  case OpKind::Send:
    return "send";
  case OpKind::Recv:
    return "recv";
  case OpKind::AllReduce:
    return "all_reduce";
  case OpKind::OptimizerStep:
    return "optimizer_step";
  }
  llvm_unreachable("unknown OpKind");
}

llvm::StringRef toString(TensorKind tensor) {
  switch (tensor) {
  case TensorKind::Activation:
    return "activation";
  case TensorKind::Gradient:
    return "gradient";
  }
  llvm_unreachable("unknown TensorKind");
}

llvm::StringRef toString(CollectiveGroup group) {
  switch (group) {
  case CollectiveGroup::Dp:
    return "dp";
  case CollectiveGroup::Tp:
    return "tp";
  case CollectiveGroup::Embedding:
    return "embedding";
  }
  llvm_unreachable("unknown CollectiveGroup");
}

bool opKindFromString(llvm::StringRef name, OpKind &out) {
  for (OpKind k : {OpKind::Forward, OpKind::BackwardInput, OpKind::BackwardWeight, OpKind::Backward,
                   OpKind::Send, OpKind::Recv, OpKind::AllReduce, OpKind::OptimizerStep}) {
    if (toString(k) == name) {
      out = k;
      return true;
    }
  }
  return false;
}

bool tensorKindFromString(llvm::StringRef name, TensorKind &out) {
  for (TensorKind k : {TensorKind::Activation, TensorKind::Gradient}) {
    if (toString(k) == name) {
      out = k;
      return true;
    }
  }
  return false;
}

bool collectiveGroupFromString(llvm::StringRef name, CollectiveGroup &out) {
  for (CollectiveGroup k : {CollectiveGroup::Dp, CollectiveGroup::Tp, CollectiveGroup::Embedding}) {
    if (toString(k) == name) {
      out = k;
      return true;
    }
  }
  return false;
}

char computeLetter(OpKind op) {
  switch (op) {
  case OpKind::Forward:
    return 'F';
  case OpKind::BackwardInput:
    return 'I';
  case OpKind::BackwardWeight:
    return 'W';
  case OpKind::Backward:
    return 'B';
  case OpKind::Send:
  case OpKind::Recv:
  case OpKind::AllReduce:
  case OpKind::OptimizerStep:
    break;
  }
  llvm_unreachable("computeLetter of a non-compute op");
}

} // namespace pipec
