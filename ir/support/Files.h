//===- Files.h - Reading inputs and writing outputs, safely -----*- C++ -*-===//
//
// The rules every tool's files follow (docs/reliability.md):
//  - an input is a regular file (or a pipe, read only up to its limit); a directory, a device
//    (/dev/zero), a socket, or a file larger than its format could need is refused before a
//    byte of it is read, and so is one whose parse would need more memory than the machine has;
//  - an output is a regular file, new or replaced whole (a temporary beside it, fsync, rename),
//    or `-` for standard output; never a device or other special file, and never one of the
//    command's inputs: files are compared by device and inode, so a symlink, a hard link or
//    another spelling of an input's path is caught too;
//  - a write error (a full disk, a closed pipe) is an InputError naming the output.
// Outputs are replaced through ir/support/DurableFile.h; standard output through
// ir/support/Stdout.h; the memory check of an input through ir/support/Memory.h.
// Every refusal is an InputError (exit 2) with one line naming the flag and the file.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_IR_SUPPORT_FILES_H
#define PIPEC_IR_SUPPORT_FILES_H

#include "ir/support/Limits.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"
#include "llvm/Support/raw_ostream.h"

#include <cstdint>
#include <functional>
#include <string>

namespace pipec {

/// What a reader accepts from one kind of file.
struct InputFormat {
  const char *name;     // "a model spec", for messages
  uint64_t maxBytes;    // larger files are refused before reading
  double memoryPerByte; // peak memory of reading it, per byte of the file (JSON trees: ~12)
};

/// The limits of pipec's formats (their sizes: ir/support/Limits.h).
inline constexpr InputFormat kModelSpecInput{"a model spec", kMaxModelSpecBytes, 12};
inline constexpr InputFormat kClusterSpecInput{"a cluster spec", kMaxClusterSpecBytes, 12};
inline constexpr InputFormat kPlanInput{"a plan", kMaxPlanBytes, 12};
inline constexpr InputFormat kTextInput{"a schedule text", kMaxTextBytes, 4};
inline constexpr InputFormat kAnyInput{"an input", kMaxTextBytes, 4};

/// Read a whole input file by `format`'s rules; errors name the path.
llvm::Expected<std::string> readFile(llvm::StringRef path, const InputFormat &format = kAnyInput);

/// The refusals readFile makes before it reads a byte (a directory, a device or socket, a file
/// past the format's limit or the memory budget), for a reader that streams the file itself;
/// `regular` says whether it is a regular file (else a pipe).
llvm::Error checkInputFile(llvm::StringRef path, const InputFormat &format, bool &regular);

/// Open `name` inside the directory `dirFd` for reading as the checkpoint rules want it: never
/// through a symbolic link (O_NOFOLLOW), never blocking on a pipe (O_NONBLOCK), and only a
/// regular file of at most `format.maxBytes`; `shown` names it in messages. The descriptor is
/// the caller's to close; its size goes to `size`.
llvm::Expected<int> openRegularFileAt(int dirFd, llvm::StringRef name, llvm::StringRef shown,
                                      const InputFormat &format, uint64_t &size);
/// openRegularFileAt, then the whole file.
llvm::Expected<std::string> readRegularFileAt(int dirFd, llvm::StringRef name,
                                              llvm::StringRef shown, const InputFormat &format);

/// Why `path` is not a regular file ("a character device", "a directory", ...), or "" if it is
/// one; `followLinks` as stat(2) does. Also "" when the path does not exist.
std::string specialFileKind(llvm::StringRef path);

/// Before a long run writes into the directory `dir` (`flag`'s): that a file can be made there
/// now (made and removed at once), so that a permission, a read-only mount or a full quota of
/// entries is found before the run rather than at its first save. A missing `dir` is probed
/// in its parent, where it will be made.
llvm::Error checkCanWriteIn(llvm::StringRef flag, llvm::StringRef dir);

/// A file a command reads, for the alias check of its outputs.
struct InputFile {
  std::string flag, path;
};

/// A file a command writes: `path` "-" is standard output.
struct OutputFile {
  std::string flag, path, contents;
  /// When set, writes the file instead of `contents` (a large file streamed to disk).
  std::function<void(llvm::raw_ostream &)> write = nullptr;
};

/// The checks an output passes before anything is written: a regular file or a new name in an
/// existing directory (or "-"), and not the same file as any of `inputs`.
llvm::Error checkOutputPath(llvm::StringRef flag, llvm::StringRef path,
                            llvm::ArrayRef<InputFile> inputs);

/// The check an output (a file, or a directory written as a whole) passes against the
/// directories a call reads or writes as a whole (piperun's --resume, --save-dir, --export-hf,
/// --init-from DIR): it is none of them and inside none of them, by its real parent directory. Each
/// of `dirs` is a flag and its directory, which may not exist yet.
llvm::Error checkOutsideDirectories(llvm::StringRef flag, llvm::StringRef path,
                                    llvm::ArrayRef<InputFile> dirs);

/// Write several files all or nothing: every check and every temporary first (each fsynced),
/// then standard output, then the renames. The error names the flag of the file that failed.
/// `inputs` are every file the call read (a command's: tools/Driver.h's commandInputs): no
/// output may be one of them, by any path; a writer with no inputs passes {} explicitly.
llvm::Error writeFilesAtomically(llvm::ArrayRef<OutputFile> files,
                                 llvm::ArrayRef<InputFile> inputs);
/// One file the same way; the error names the path.
llvm::Error writeFileAtomically(llvm::StringRef path, llvm::StringRef contents,
                                llvm::ArrayRef<InputFile> inputs);

} // namespace pipec

#endif // PIPEC_IR_SUPPORT_FILES_H
