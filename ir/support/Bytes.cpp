#include "ir/support/Bytes.h"

#include <fmt/format.h>

namespace pipec {

namespace {

const char *const kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};

/// `value` bytes / 1024^unit, two decimals, and the unit's name.
std::string inUnit(double value, int unit) {
  for (int u = 0; u < unit; ++u)
    value /= 1024;
  return fmt::format("{:.2f} {}", value, kUnits[unit]);
}

} // namespace

std::string humanBytes(uint64_t bytes) {
  int u = 0;
  for (double v = double(bytes); v >= 1024 && u < 6; v /= 1024)
    ++u;
  return u == 0 ? fmt::format("{} B", bytes) : inUnit(double(bytes), u);
}

std::string inGiB(int64_t bytes) { return inUnit(double(bytes), 3); }

std::string humanBytes(int64_t bytes) {
  // The magnitude as unsigned: -INT64_MIN does not fit an int64_t.
  return bytes < 0 ? "-" + humanBytes(uint64_t(0) - uint64_t(bytes)) : humanBytes(uint64_t(bytes));
}

std::string mibColumns(llvm::ArrayRef<uint64_t> sizes) {
  std::string out;
  for (uint64_t bytes : sizes)
    out += fmt::format("{}{:.2f}", out.empty() ? "" : " ", inMiB(bytes));
  return out;
}

} // namespace pipec
