//===- Memory.h - The memory this process may use ---------------*- C++ -*-===//
//
// Readers and planners refuse work that could not fit before they start it: the budget is the
// least of the machine's memory, its container's (cgroup) limit and the process's rlimits.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_IR_SUPPORT_MEMORY_H
#define PIPEC_IR_SUPPORT_MEMORY_H

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <cstdint>

namespace pipec {

/// The memory this process may use: the least of the machine's physical memory, the cgroup's
/// limit and RLIMIT_AS / RLIMIT_DATA.
uint64_t memoryBudgetBytes();
/// An InputError when `bytes` is more than memoryBudgetBytes(): "<what> needs about X of
/// memory, more than this machine's Y; <fix>".
llvm::Error checkMemoryBudget(uint64_t bytes, llvm::StringRef what, llvm::StringRef fix);

} // namespace pipec

#endif // PIPEC_IR_SUPPORT_MEMORY_H
