//===- Semantics.h - The dependency rules of docs/contracts.md#semantics ----------*- C++ -*-===//
//
// Moved below schedules/ (ir/Semantics.h: what a compute op needs; ir/CostModel.h: how long
// it takes and what it allocates), so that the simulator and zb-auto share them. Kept so that
// compiler code may go on including it.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_COMPILER_SEMANTICS_H
#define PIPEC_COMPILER_SEMANTICS_H

#include "ir/CostModel.h"
#include "ir/Semantics.h"

#endif // PIPEC_COMPILER_SEMANTICS_H
