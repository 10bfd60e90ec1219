#include "ir/support/Stdout.h"

#include "ir/support/Error.h"

#include <cerrno>
#include <cstdio>
#include <cstring>

namespace pipec {

namespace {

std::string whyFailed(int code) {
  return code ? std::string(std::strerror(code)) : std::string("a write failed");
}

/// The errno of the first failed sayToStdout (0: none).
int firstStdoutError = 0;

} // namespace

llvm::Error writeStdout(llvm::StringRef text) {
  errno = 0;
  size_t written = std::fwrite(text.data(), 1, text.size(), stdout);
  int code = errno;
  if (written == text.size() && std::fflush(stdout) == 0 && !std::ferror(stdout))
    return llvm::Error::success();
  if (errno != 0)
    code = errno;
  return inputError("standard output: cannot write: {}", whyFailed(code));
}

void sayToStdout(llvm::StringRef text) {
  errno = 0;
  if (std::fwrite(text.data(), 1, text.size(), stdout) != text.size() && !firstStdoutError)
    firstStdoutError = errno ? errno : EIO;
}

llvm::Error finishStdout() {
  errno = 0;
  if (std::fflush(stdout) == 0 && !std::ferror(stdout))
    return llvm::Error::success();
  return inputError("standard output: cannot write: {}",
                    whyFailed(firstStdoutError ? firstStdoutError : errno));
}

} // namespace pipec
