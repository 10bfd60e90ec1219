//===- Budget.h - What a compile will need, before it starts ----*- C++ -*-===//
//
// Every size pipec's flags accept either compiles or is refused up front with the memory it
// would need (docs/reliability.md): an upper bound on the instructions of the plan, times what
// the passes, the verifier and the JSON writer hold per instruction (measured: 670 bytes at the
// peak of a 2.9M-instruction 1f1b compile), against the machine's memory.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_COMPILER_BUDGET_H
#define PIPEC_COMPILER_BUDGET_H

#include "compiler/Pass.h"

#include <cstdint>

namespace pipec {

/// Peak bytes per instruction of a compile (the measured 670, rounded up).
inline constexpr uint64_t kCompileBytesPerInstruction = 768;

/// An upper bound on the instructions of the plan `options` asks of `model`: per (stage,
/// microbatch, slice) a forward and a split backward, with tp each part of the forward and of
/// backward_input apart with its all-reduce, and a send and a recv each way between stages.
/// Saturates instead of overflowing.
uint64_t instructionBound(const ModelSpec &model, const CompileOptions &options);

/// An InputError naming the flags and the memory when the bound's memory is more than the
/// machine has.
llvm::Error checkCompileBudget(const ModelSpec &model, const CompileOptions &options);

} // namespace pipec

#endif // PIPEC_COMPILER_BUDGET_H
