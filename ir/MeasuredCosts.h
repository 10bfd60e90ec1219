//===- MeasuredCosts.h - Measured times in place of the model's -*- C++ -*-===//
//
// A pipecost/1 file's times (ir/formats/Costs.h) put in a plan's stage table, where the cost
// model (ir/CostModel.h), and so every evaluator and zb-auto's search, takes them.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_IR_MEASUREDCOSTS_H
#define PIPEC_IR_MEASUREDCOSTS_H

#include "ir/Plan.h"
#include "ir/formats/Costs.h"

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

namespace pipec {

/// Put `costs`' times in place of the model's in `plan`'s stage table (after the partition
/// pass): each covered (stage, op, slice)'s compute time (a fused backward's splits into input
/// and weight gradient in the model's ratio where those are not measured apart), the transfer
/// time of each message whose kind and size were measured, the dp and tp all-reduces, and each
/// rank's optimizer step (shared among its stages in the model's ratio). A file that does not
/// fit the plan (stage count, sub-sequences, ranks, a time unit other than ms) is an InputError
/// naming the field; `source` names the file.
llvm::Error applyMeasuredCosts(const MeasuredCosts &costs, llvm::StringRef source, Plan &plan);

} // namespace pipec

#endif // PIPEC_IR_MEASUREDCOSTS_H
