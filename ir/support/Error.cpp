#include "ir/support/Error.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/Support/raw_ostream.h"

#include <fmt/format.h>

#include <cstdint>

namespace pipec {

char InputError::ID = 0;
char Finding::ID = 0;

void InputError::log(llvm::raw_ostream &os) const { os << msg; }
void Finding::log(llvm::raw_ostream &os) const { os << msg; }

int exitCodeFor(const llvm::Error &err) { return err.isA<Finding>() ? 1 : 2; }

std::string takeMessage(llvm::Error err) { return llvm::toString(std::move(err)); }

std::string shortened(llvm::StringRef value, size_t most) {
  // A control character (a newline in a tensor's name) would break the line: written escaped.
  if (hasControlCharacter(value)) {
    std::string escaped;
    for (char c : value)
      escaped += c == '\n'               ? std::string("\\n")
                 : c == '\t'             ? std::string("\\t")
                 : c == '\r'             ? std::string("\\r")
                 : isControlCharacter(c) ? fmt::format("\\x{:02x}", uint8_t(c))
                                         : std::string(1, c);
    return shortened(escaped, most);
  }
  if (value.size() <= most)
    return value.str();
  // Cut at character boundaries: never inside a UTF-8 sequence.
  auto boundary = [&](size_t at) {
    while (at > 0 && at < value.size() && (uint8_t(value[at]) & 0xC0) == 0x80)
      --at;
    return at;
  };
  size_t head = boundary(most * 2 / 3), tail = boundary(value.size() - most / 4);
  return fmt::format("{}...[{} more bytes]...{}", value.take_front(head).str(), tail - head,
                     value.drop_front(tail).str());
}

std::string printableMessage(llvm::StringRef message) {
  std::string out;
  out.reserve(message.size());
  for (char c : message)
    out += isControlCharacter(c) && c != '\n' && c != '\t' ? fmt::format("\\x{:02x}", uint8_t(c))
                                                           : std::string(1, c);
  return out;
}

} // namespace pipec
