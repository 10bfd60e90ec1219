//===- DurableFile.h - Files replaced whole or not at all -------*- C++ -*-===//
//
// The one routine that writes a file durably (docs/reliability.md): the bytes go to a new
// temporary beside the destination, <name>.tmp-<6 hex digits>, created exclusively and never
// through a symbolic link; it is fsynced and closed, then renamed over the destination. Until
// the rename the destination is untouched; after a crash a temporary is recognisable by its
// name. Names are relative to a directory descriptor (AT_FDCWD: a path), so that a checkpoint
// reaches its files through its open directory only. Errors are InputErrors
// "<shown>: cannot write: <why>", and a failed write leaves no temporary behind.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_IR_SUPPORT_DURABLEFILE_H
#define PIPEC_IR_SUPPORT_DURABLEFILE_H

#include "llvm/ADT/STLFunctionalExtras.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"
#include "llvm/Support/raw_ostream.h"

#include <cstdint>
#include <string>

namespace pipec {

/// Called at each step of a write (before the temporary is made, after its bytes, before and
/// after the rename), where a test may stop the process; null: nothing.
using KillPoint = void (*)();

/// A temporary written and synced, not yet in place.
struct DurableTemporary {
  std::string name;    // the temporary's name, relative to the directory it was made in
  uint64_t digest = 0; // FNV-1a (ir/support/Hash.h) of the bytes written
};

/// Write the temporary of `name` inside `dirFd`: `write` puts the bytes on the stream (a flush
/// sends what it holds to the file at once). `shown` names the file in messages.
llvm::Expected<DurableTemporary>
writeTemporaryAt(int dirFd, llvm::StringRef name, llvm::StringRef shown,
                 llvm::function_ref<void(llvm::raw_ostream &)> write, KillPoint kill = nullptr);
/// Rename the temporary over `name`; on failure the temporary is removed.
llvm::Error commitTemporaryAt(int dirFd, const DurableTemporary &tmp, llvm::StringRef name,
                              llvm::StringRef shown, KillPoint kill = nullptr);
/// Remove a temporary that is not to be committed.
void discardTemporaryAt(int dirFd, const DurableTemporary &tmp);
/// writeTemporaryAt, then commitTemporaryAt: the digest of the bytes written goes to `digest`.
llvm::Error writeDurablyAt(int dirFd, llvm::StringRef name, llvm::StringRef shown,
                           llvm::function_ref<void(llvm::raw_ostream &)> write,
                           uint64_t *digest = nullptr, KillPoint kill = nullptr);

/// The name whose temporary `name` is (<target>.tmp-<6 hex digits>, as writeTemporaryAt names
/// them), or `name` itself when it is not one: how a cleaner tells a killed write's leftovers.
llvm::StringRef temporaryTarget(llvm::StringRef name);

/// fsync the open directory `dirFd`, so that the names created, renamed or removed in it
/// survive a crash; the error names `shown`.
llvm::Error syncDirectory(int dirFd, llvm::StringRef shown);

} // namespace pipec

#endif // PIPEC_IR_SUPPORT_DURABLEFILE_H
