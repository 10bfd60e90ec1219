//===- Evaluate.h - Step time and memory of a compute order, by compile's own passes -*- C++
//-*-===//
//
// What `pipec compile` states of a plan's time and memory is decided by the passes of the
// default pipeline between schedule and verify: lower-comms, lower-collectives, memory and
// simulate (scoringPipeline(); defaultPipeline() is built around it). evaluateOrder runs exactly
// those pass objects on a plan that holds a stage table and compute-only streams (the schedule
// pass's output) and nothing else: no verification, no JSON. The planner (compiler/Planner.h)
// scores every candidate with it and zb-auto (schedules/ZBAuto.cpp) chooses among its orders
// with it, so both rank by the figures compile states (receive buffers included); there is no
// second implementation of the semantics to keep in step.
//
// This library sits below schedules/ (ir <- lowering <- schedules <- compiler) so that zb-auto
// can use it; the schedule, partition, seq-split and verify passes and the registry live in
// //compiler.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_COMPILER_EVALUATE_H
#define PIPEC_COMPILER_EVALUATE_H

#include "compiler/Pass.h"
#include "ir/Plan.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

namespace pipec {

/// The passes evaluateOrder runs, in order: the default pipeline's between schedule and verify
/// (compiler/Pipeline.cpp registers them from this list).
llvm::ArrayRef<PassEntry> scoringPasses();
/// Their names.
llvm::ArrayRef<llvm::StringRef> scoringPipeline();

/// Lower `plan` (stages and compute-only streams) and fill plan.stats as compilePlan does:
/// step time, makespan, bubble ratio, per-rank busy/span and static, activation and total peak
/// memory. `plan` is left lowered (comms and collectives in its streams), unverified. A Finding
/// when the compute order cannot run.
llvm::Error evaluateOrder(Plan &plan);

} // namespace pipec

#endif // PIPEC_COMPILER_EVALUATE_H
