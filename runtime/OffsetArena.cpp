#include "runtime/OffsetArena.h"

#include <algorithm>
#include <cassert>

namespace pipec {

std::optional<size_t> OffsetArena::allocate(size_t bytes) {
  const size_t size = roundUp(bytes);
  size_t at = 0;
  auto fit =
      std::find_if(free.begin(), free.end(), [&](const auto &f) { return f.second >= size; });
  if (fit != free.end()) {
    at = fit->first;
    size_t rest = fit->second - size;
    free.erase(fit);
    if (rest > 0)
      free[at + size] = rest;
  } else {
    if (bounded && size > limit - top)
      return std::nullopt;
    at = top;
    top += size;
    peak = std::max(peak, top);
  }
  live[at] = size;
  used += size;
  peakUsed = std::max(peakUsed, used);
  return at;
}

void OffsetArena::release(size_t offset) {
  auto it = live.find(offset);
  assert(it != live.end() && "release of an offset the arena did not hand out");
  size_t at = it->first, size = it->second;
  live.erase(it);
  used -= size;
  // Merge with the free range after it and the one before it.
  if (auto next = free.find(at + size); next != free.end()) {
    size += next->second;
    free.erase(next);
  }
  if (auto next = free.lower_bound(at); next != free.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == at) {
      at = prev->first;
      size += prev->second;
      free.erase(prev);
    }
  }
  if (at + size == top)
    top = at;
  else
    free[at] = size;
}

} // namespace pipec
