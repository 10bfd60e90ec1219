//===- Error.h - The two kinds of recoverable error -------------*- C++ -*-===//
//
// Bad input (a flag, a file, a field) is an InputError: tools exit 2 with its one line.
// A plan or schedule that is wrong is a Finding: tools exit 1 with its (multi-line) diagnostic.
// Bugs are asserts, never errors.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_IR_SUPPORT_ERROR_H
#define PIPEC_IR_SUPPORT_ERROR_H

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <fmt/format.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace pipec {

class InputError : public llvm::ErrorInfo<InputError> {
public:
  static char ID;
  explicit InputError(std::string msg) : msg(std::move(msg)) {}
  void log(llvm::raw_ostream &os) const override;
  std::error_code convertToErrorCode() const override { return llvm::inconvertibleErrorCode(); }

private:
  std::string msg;
};

class Finding : public llvm::ErrorInfo<Finding> {
public:
  static char ID;
  explicit Finding(std::string msg) : msg(std::move(msg)) {}
  void log(llvm::raw_ostream &os) const override;
  std::error_code convertToErrorCode() const override { return llvm::inconvertibleErrorCode(); }

private:
  std::string msg;
};

template <typename... Args> llvm::Error inputError(fmt::format_string<Args...> f, Args &&...args) {
  return llvm::make_error<InputError>(fmt::format(f, std::forward<Args>(args)...));
}

template <typename... Args> llvm::Error finding(fmt::format_string<Args...> f, Args &&...args) {
  return llvm::make_error<Finding>(fmt::format(f, std::forward<Args>(args)...));
}

/// Exit code of a tool for an error: 1 for a Finding, 2 for anything else.
int exitCodeFor(const llvm::Error &err);

/// The message of an error, consuming it.
std::string takeMessage(llvm::Error err);

/// `value` as it may appear in a one-line message: at most `most` characters, a longer one cut
/// in the middle with the number of bytes left out ("abc...[49999990 more bytes]...xyz"), and
/// control characters escaped ("\n", "\x1b").
std::string shortened(llvm::StringRef value, size_t most = 80);

/// A control character (C0 or DEL): never printed raw in a message, nor allowed in a name.
inline bool isControlCharacter(char c) { return uint8_t(c) < 0x20 || c == 0x7f; }
/// Whether `text` holds one.
inline bool hasControlCharacter(llvm::StringRef text) {
  return llvm::any_of(text, isControlCharacter);
}

/// A message as it is printed or raised: every control character but the newline and the tab
/// written as \xNN, since a NUL from an input (a CSV cell) would end the message there and an
/// ESC would drive the terminal.
std::string printableMessage(llvm::StringRef message);

} // namespace pipec

#endif // PIPEC_IR_SUPPORT_ERROR_H
