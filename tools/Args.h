//===- Args.h - Command-line flags for pipec and piperun --------*- C++ -*-===//
//
// "--name value" and "--name=value"; every problem is an InputError that names the flag and,
// where one exists, the nearest valid value. Relative paths are taken from the directory the
// user ran `bazel run` in (BUILD_WORKING_DIRECTORY), so examples/ paths work both ways.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_TOOLS_ARGS_H
#define PIPEC_TOOLS_ARGS_H

#include "ir/support/Error.h"
#include "tools/Options.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/STLFunctionalExtras.h"
#include "llvm/ADT/StringRef.h"

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace pipec {

class Args {
public:
  /// Parse argv[first..] by `cmd`'s table (tools/Options.h): its flags and their second
  /// spellings (stored under the first: "--output" is "-o"), those `caller` may give. Errors
  /// start with cmd.errorPrefix() ("compile: "), and name the flag.
  static llvm::Expected<Args> parse(int argc, char **argv, int first, const Command &cmd,
                                    OptionUse caller = OptionUse::Cli);
  /// For the benchmarks' own flags: `valued` flags take a value, `switches` take none; no
  /// table, so integer() needs its bounds given.
  static llvm::Expected<Args> parse(int argc, char **argv, int first,
                                    llvm::ArrayRef<llvm::StringRef> valued,
                                    llvm::ArrayRef<llvm::StringRef> switches,
                                    llvm::StringRef command);

  bool has(llvm::StringRef flag) const { return values.count(flag.str()) > 0; }
  std::optional<std::string> get(llvm::StringRef flag) const;
  llvm::Expected<std::string> required(llvm::StringRef flag) const;
  /// An Int flag, checked against its table's bounds; its table's fallback when absent.
  llvm::Expected<int64_t> integer(llvm::StringRef flag) const;
  /// An integer flag in [min, max]; `fallback` when absent.
  llvm::Expected<int64_t> integer(llvm::StringRef flag, int64_t fallback, int64_t min,
                                  int64_t max) const;
  /// A byte count: 123, 80GiB, 512MiB, 1.5GB, ...; 0 when absent.
  llvm::Expected<int64_t> bytes(llvm::StringRef flag) const;
  /// A Double flag: above 0 and at most its table's max (when it has one).
  llvm::Expected<std::optional<double>> real(llvm::StringRef flag) const;
  /// An Enum flag: one of its table's choices.
  llvm::Expected<std::optional<std::string>> choice(llvm::StringRef flag) const;
  /// Whether `value` is one of an Enum flag's choices.
  bool isChoice(llvm::StringRef flag, llvm::StringRef value) const;
  /// An IntList flag: positive integers up to kMaxFlagCount; empty when absent.
  llvm::Expected<std::vector<int64_t>> integers(llvm::StringRef flag) const;
  /// A StringList flag's words; empty when absent.
  llvm::Expected<std::vector<std::string>> words(llvm::StringRef flag) const;
  /// A path flag resolved against the user's working directory.
  std::optional<std::string> path(llvm::StringRef flag) const;
  const std::vector<std::string> &positional() const { return pos; }

private:
  /// The table entry of `flag`, of the given kind (a mismatch is a bug in the caller).
  const Option &option(llvm::StringRef flag, OptionKind kind) const;

  const Command *cmd = nullptr; // null for the benchmarks' parse
  std::map<std::string, std::string> values;
  std::vector<std::string> pos;
};

/// Print an error the way the tools do — one line "<tool>: error: ..." for bad input (exit 2),
/// the full diagnostic for a finding (exit 1) — and return the exit code.
int reportError(llvm::StringRef tool, llvm::Error err);

/// Run a tool's body and return its exit code: its error as reportError prints it; an
/// allocation failure or a library's exception (fmt's write errors) as exit 2 with one line; and,
/// when the body succeeded, a write to standard output that was lost (a full disk, a closed
/// pipe) as exit 2 with one line. Callers ignore SIGPIPE, so that a closed pipe is an error.
int runTool(llvm::StringRef tool, llvm::function_ref<llvm::Error()> body);
/// The end of a tool: reportError for an error, else finishStdout()'s verdict.
int finishTool(llvm::StringRef tool, llvm::Error err);

/// Resolve a relative path against BUILD_WORKING_DIRECTORY when run under `bazel run`.
std::string userPath(llvm::StringRef path);

/// `word` as one word of a POSIX shell command line: unchanged when it is made of letters,
/// digits and `_./:=,+@%-` only, else in single quotes (a quote inside as '\''), so that a
/// command the tools print for the user to paste keeps a path with spaces or `$` whole.
std::string shellWord(llvm::StringRef word);

} // namespace pipec

#endif // PIPEC_TOOLS_ARGS_H
