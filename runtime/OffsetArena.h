//===- OffsetArena.h - First-fit placement of buffers in one block -*- C++ -*-===//
//
// The bookkeeping of the device backends' activation arena (runtime/cuda/DeviceArena.h), kept
// free of CUDA so that it is tested on any machine. Buffers are byte ranges of one block,
// aligned to kAlign; a request takes the lowest free range it fits in (splitting it), else
// extends the used top; a release merges with its free neighbours, and a free range that
// reaches the top lowers the top.
//
// Unbounded, the arena only learns the highest top a sequence of requests reaches (highWater).
// Bounded by that high-water mark, the SAME sequence of requests and releases is placed at the
// same offsets and never fails: placement depends only on the sequence. That is how a rank's
// sizing pass (a step's requests made on the host, before step 0) sizes the one allocation all
// steps are served from.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_OFFSETARENA_H
#define PIPEC_RUNTIME_OFFSETARENA_H

#include <cstddef>
#include <map>
#include <optional>

namespace pipec {

class OffsetArena {
public:
  static constexpr size_t kAlign = 256;

  /// Unbounded (learns the high-water mark).
  OffsetArena() = default;
  /// At most `capacity` bytes.
  explicit OffsetArena(size_t capacity) : limit(capacity), bounded(true) {}

  /// The offset of a new range of `bytes` (rounded up to kAlign; 0 bytes take kAlign), or
  /// nothing when a bounded arena has no room.
  std::optional<size_t> allocate(size_t bytes);
  /// Frees the range that allocate() returned at `offset`.
  void release(size_t offset);

  size_t highWater() const { return peak; }
  size_t inUse() const { return used; }
  /// The most bytes live at once (each rounded up to kAlign): highWater() less the gaps that
  /// first fit left below the top at that moment.
  size_t peakInUse() const { return peakUsed; }
  size_t liveCount() const { return live.size(); }
  size_t capacity() const { return limit; }
  bool isBounded() const { return bounded; }
  static size_t roundUp(size_t bytes) {
    return bytes == 0 ? kAlign : (bytes + kAlign - 1) / kAlign * kAlign;
  }

private:
  size_t limit = 0;
  bool bounded = false;
  size_t top = 0, peak = 0, used = 0, peakUsed = 0;
  std::map<size_t, size_t> free; // offset -> size, below `top`, never adjacent
  std::map<size_t, size_t> live; // offset -> size
};

} // namespace pipec

#endif // PIPEC_RUNTIME_OFFSETARENA_H
