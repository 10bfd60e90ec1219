#include "ir/support/Bytes.h"

#include <fmt/format.h>

namespace pipec {

std::string humanBytes(uint64_t bytes) {
  const char *units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = double(bytes);
  int u = 0;
  while (v >= 1024 && u < 6) {
    v /= 1024;
    ++u;
  }
  return u == 0 ? fmt::format("{} B", bytes) : fmt::format("{:.2f} {}", v, units[u]);
}

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
