//===- LowerCollectives.h - Where the collective lowering puts collectives -*- C++ -*-===//
//
// The placement rule of the lower-collectives pass (LowerCollectives.cpp), for whoever writes a
// plan's collectives in another form (PyTorch's schedule CSV, compiler/torch/TorchCsv.h) and
// must put them where pipec would.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_COMPILER_LOWERCOLLECTIVES_H
#define PIPEC_COMPILER_LOWERCOLLECTIVES_H

#include "ir/Instruction.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/SmallVector.h"

#include <vector>

namespace pipec {

/// Where the data-parallel all-reduces of one rank's `stream` go: element n lists, in order, the
/// stages whose all-reduce comes right before stream[n], and element stream.size() those that
/// come after the last op. A stage's all-reduce follows its last weight-gradient op (W, or a
/// fused B) and the sends and recvs right after it, so that the reduction overlaps the rest of
/// the step; ops already in the stream (collectives, the optimizer step) are not sends or recvs.
std::vector<llvm::SmallVector<int, 2>> dpAllReducePoints(llvm::ArrayRef<Instruction> stream);

} // namespace pipec

#endif // PIPEC_COMPILER_LOWERCOLLECTIVES_H
