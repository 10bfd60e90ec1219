//===- Options.h - Every command's flags, declared once ---------*- C++ -*-===//
//
// One table per command (pipec's compile, validate, simulate, show, list-schedules, export,
// import, plan and spec, and piperun) from which everything about a flag comes: the parser
// (tools/Args.h) accepts exactly the table's flags and checks each value by its kind and
// bounds; `--help` and the usage are generated from it; docs/commands.md's synopsis is checked
// against it (tests/OptionsTest.cpp); and the Python package's keyword arguments, with their
// types, are made from it (python/pipec/__init__.py, through the extension).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_TOOLS_OPTIONS_H
#define PIPEC_TOOLS_OPTIONS_H

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/StringRef.h"

#include <cstdint>
#include <string>

namespace pipec {

/// What a flag's value is, and so how it is checked and what Python passes for it.
enum class OptionKind : uint8_t {
  Switch,     // no value (Python: bool)
  Int,        // an integer in [min, max] (Python: int)
  Bytes,      // a byte count: 123, 80GiB, 1.5GB (Python: int or str)
  Double,     // a number in (0, max] (Python: int or float)
  Path,       // a file or directory, relative to the user's directory (Python: str, PathLike)
  String,     // free text, such as a schedule name (Python: str)
  Enum,       // one of `choices` (Python: str)
  IntList,    // comma-separated positive integers up to kMaxFlagCount (Python: list of int)
  StringList, // comma-separated words (Python: list of str)
};

/// Where a flag may be given.
enum class OptionUse : uint8_t {
  Both,   // the command line and Python's keyword arguments
  Cli,    // the command line only (its outputs and printing: -o, --show, --quiet, ...)
  Python, // the Python module only, not shown (--model-json: a model given as a dict)
};

struct Option {
  const char *name; // "--pp"
  OptionKind kind;
  const char *value;        // the placeholder ("P", "plan.json"); an Enum's is its choices, "a|b"
  const char *help;         // one line
  int64_t min = 0, max = 0; // Int: the bounds; Double: max (the value must exceed 0)
  int64_t fallback = 0;     // Int: the value when absent (Args::integer)
  bool required = false;
  OptionUse use = OptionUse::Both;
  const char *alias = nullptr;   // a second spelling ("--output" for "-o")
  const char *within = nullptr;  // shown nested in this flag's brackets ("--data")
  const char *example = nullptr; // the value a bad-input line suggests

  bool isSwitch() const { return kind == OptionKind::Switch; }
  bool shownIn(OptionUse caller) const { return use == OptionUse::Both || use == caller; }
  /// The name Python uses: "--seq-splits" is seq_splits; "-o" has none (a CLI output).
  std::string pythonName() const;
};

/// A command: its flags, in the order its usage lists them.
struct Command {
  const char *tool;       // "pipec" or "piperun"
  const char *name;       // "compile"; "" for piperun, which has no subcommand
  const char *positional; // "plan.json", "sched.csv|sched.txt"; "" for none
  const char *summary;    // a few words, wrapped by the usage
  llvm::ArrayRef<Option> options;

  const Option *find(llvm::StringRef flag) const;
  /// The prefix of its bad-input lines: "compile: ", or "" for piperun (whose tool name leads).
  std::string errorPrefix() const;
};

/// pipec's commands in `pipec --help` order.
llvm::ArrayRef<Command> pipecCommands();
/// A pipec command by name; null for an unknown one.
const Command *findPipecCommand(llvm::StringRef name);
/// piperun's flags.
const Command &piperunCommand();

/// The command's synopsis, as docs/commands.md shows it: "pipec compile --model M.json ...",
/// required flags first, the rest in brackets, wrapped at `width` columns under the first flag.
std::string synopsis(const Command &cmd, unsigned width = 98);
/// `pipec COMMAND --help`, `piperun --help`: the synopsis, the summary and one line per flag.
std::string commandHelp(const Command &cmd);
/// `pipec --help`: every command's synopsis and summary.
std::string pipecHelp();
/// The line on exit codes every usage ends with.
extern const char *const kExitCodes;

} // namespace pipec

#endif // PIPEC_TOOLS_OPTIONS_H
