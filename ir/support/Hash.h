//===- Hash.h - The one content hash ----------------------------*- C++ -*-===//
//
// FNV-1a, 64 bits: the digests of checkpoint files and of the plan a checkpoint or a costs
// file was made for, and the weight digests of the reference check. Not cryptographic: it
// tells apart files that differ by accident (a torn write, another plan), not by design.
// SplitMix64, the mixer of the counter-based generators (initial weights, synthetic data):
// the same counter always gives the same value, so a run's random state is its seed and its
// position.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_IR_SUPPORT_HASH_H
#define PIPEC_IR_SUPPORT_HASH_H

#include "llvm/ADT/StringRef.h"

#include <cstddef>
#include <cstdint>

namespace pipec {

/// FNV-1a's offset basis: the hash of no bytes, and where a hash in pieces starts.
inline constexpr uint64_t kFnv1aStart = 0xcbf29ce484222325ULL;

/// FNV-1a (64 bits) of `n` bytes at `data`, continued from `hash` (so that hashing a whole and
/// hashing its pieces in order agree).
inline uint64_t fnv1a(const void *data, size_t n, uint64_t hash = kFnv1aStart) {
  const auto *p = static_cast<const unsigned char *>(data);
  for (size_t i = 0; i < n; ++i)
    hash = (hash ^ p[i]) * 0x100000001b3ULL;
  return hash;
}
inline uint64_t fnv1a(llvm::StringRef bytes, uint64_t hash = kFnv1aStart) {
  return fnv1a(bytes.data(), bytes.size(), hash);
}

/// SplitMix64's output function of counter `x` (Steele, Lea and Flood 2014).
inline constexpr uint64_t splitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

} // namespace pipec

#endif // PIPEC_IR_SUPPORT_HASH_H
