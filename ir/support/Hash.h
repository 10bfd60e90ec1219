//===- Hash.h - The one content hash ----------------------------*- C++ -*-===//
//
// FNV-1a, 64 bits: the digests of checkpoint files and of the plan a checkpoint or a costs
// file was made for, and the weight digests of the reference check. Not cryptographic: it
// tells apart files that differ by accident (a torn write, another plan), not by design.
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

} // namespace pipec

#endif // PIPEC_IR_SUPPORT_HASH_H
