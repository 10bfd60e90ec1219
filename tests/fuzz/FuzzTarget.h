//===- FuzzTarget.h - What every fuzz target shares -------------*- C++ -*-===//
//
// A fuzz target defines LLVMFuzzerTestOneInput. Under --config=asan it links libFuzzer's main;
// in the normal build it links ReplayMain.cpp, which runs it on every file it is given (the
// seed corpora), so the targets stay tests of the normal suite too.
// An input may be refused (an llvm::Error, as a tool would report it: that is the point); it
// may not crash, leak, trip a sanitizer, or break an invariant the target checks, which ends
// the process with FUZZ_CHECK's message.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_TESTS_FUZZ_FUZZTARGET_H
#define PIPEC_TESTS_FUZZ_FUZZTARGET_H

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

/// A property every accepted input must have; violated, the input is a finding.
#define FUZZ_CHECK(cond, what)                                                                     \
  do {                                                                                             \
    if (!(cond)) {                                                                                 \
      std::fprintf(stderr, "fuzz check failed: %s (%s:%d)\n", what, __FILE__, __LINE__);           \
      std::abort();                                                                                \
    }                                                                                              \
  } while (0)

namespace pipec::fuzz {

inline llvm::StringRef textOf(const uint8_t *data, size_t size) {
  return llvm::StringRef(reinterpret_cast<const char *>(data), size);
}

/// An error a tool would report: its message must exist and be one line once printed.
inline void refused(llvm::Error err) { llvm::consumeError(std::move(err)); }

} // namespace pipec::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#endif // PIPEC_TESTS_FUZZ_FUZZTARGET_H
