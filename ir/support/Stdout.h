//===- Stdout.h - Standard output whose failures are not lost ---*- C++ -*-===//
//
// A full disk or a closed pipe behind standard output is an InputError naming it, reported
// either at once (writeStdout) or at the end of a run that must not stop for it (sayToStdout,
// then finishStdout).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_IR_SUPPORT_STDOUT_H
#define PIPEC_IR_SUPPORT_STDOUT_H

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

namespace pipec {

/// Write `text` to standard output and flush it; a failure (a full disk, a closed pipe) is an
/// InputError "standard output: cannot write: <why>".
llvm::Error writeStdout(llvm::StringRef text);
/// Write `text` to standard output without failing: the first error (with its errno) is
/// remembered for finishStdout(). For output that must not stop a run (piperun's losses).
void sayToStdout(llvm::StringRef text);
/// Flush standard output and report whether anything written to it since the start was lost.
llvm::Error finishStdout();

} // namespace pipec

#endif // PIPEC_IR_SUPPORT_STDOUT_H
