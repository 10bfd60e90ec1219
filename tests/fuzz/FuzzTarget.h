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
#include <filesystem>
#include <fstream>
#include <string>
#include <unistd.h>

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

/// An error a tool would report (printed when PIPEC_FUZZ_VERBOSE is set, to see what a seed
/// reaches).
inline void refused(llvm::Error err) {
  if (std::getenv("PIPEC_FUZZ_VERBOSE")) {
    std::fprintf(stderr, "refused: %s\n", llvm::toString(std::move(err)).c_str());
    return;
  }
  llvm::consumeError(std::move(err));
}

/// A directory of this process's own for targets whose reader takes files (in /dev/shm where
/// there is one, so writing an input costs no disk), emptied on every call and removed at exit.
inline const std::string &scratchDir() {
  static const std::string dir = [] {
    namespace fs = std::filesystem;
    const fs::path base =
        fs::is_directory("/dev/shm") ? fs::path("/dev/shm") : fs::temp_directory_path();
    std::string d = (base / ("pipec-fuzz-" + std::to_string(::getpid()))).string();
    fs::remove_all(d);
    fs::create_directories(d);
    static struct Remover {
      std::string path;
      ~Remover() {
        std::error_code ec;
        std::filesystem::remove_all(path, ec);
      }
    } remover{d};
    return d;
  }();
  std::error_code ec;
  for (const auto &e : std::filesystem::directory_iterator(dir, ec))
    std::filesystem::remove_all(e.path(), ec);
  return dir;
}

/// Writes `bytes` to `path` (a file of scratchDir()).
inline void writeFile(const std::string &path, llvm::StringRef bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), std::streamsize(bytes.size()));
  FUZZ_CHECK(bool(f), "the scratch file is written");
}

} // namespace pipec::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#endif // PIPEC_TESTS_FUZZ_FUZZTARGET_H
