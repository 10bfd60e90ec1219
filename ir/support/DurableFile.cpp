#include "ir/support/DurableFile.h"

#include "ir/support/Error.h"
#include "ir/support/Hash.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/StringExtras.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fcntl.h>
#include <unistd.h>

namespace pipec {

namespace {

/// A stream onto a descriptor that keeps the first write error (errno) and the digest of the
/// bytes that reached the file, for the caller to check once it is done.
class HashingFdStream final : public llvm::raw_ostream {
public:
  explicit HashingFdStream(int fd) : fd(fd) { SetBufferSize(size_t(1) << 16); }
  ~HashingFdStream() override { flush(); }

  int error = 0;
  uint64_t digest = kFnv1aStart;

private:
  void write_impl(const char *p, size_t n) override {
    while (n > 0 && !error) {
      ssize_t w = ::write(fd, p, std::min<size_t>(n, size_t(1) << 30));
      if (w < 0 && errno == EINTR)
        continue;
      if (w <= 0) {
        error = w < 0 ? errno : EIO;
        break;
      }
      digest = fnv1a(p, size_t(w), digest);
      p += w;
      n -= size_t(w);
      written += uint64_t(w);
    }
  }
  uint64_t current_pos() const override { return written; }

  int fd;
  uint64_t written = 0;
};

void reach(KillPoint kill) {
  if (kill)
    kill();
}

llvm::Error cannotWrite(llvm::StringRef shown, int code) {
  return inputError("{}: cannot write: {}", shown.str(), std::strerror(code));
}

} // namespace

llvm::StringRef temporaryTarget(llvm::StringRef name) {
  const size_t at = name.rfind(".tmp-");
  if (at == llvm::StringRef::npos)
    return name;
  llvm::StringRef suffix = name.drop_front(at + 5);
  if (suffix.size() != 6 || !llvm::all_of(suffix, llvm::isHexDigit))
    return name;
  return name.take_front(at);
}

llvm::Expected<DurableTemporary>
writeTemporaryAt(int dirFd, llvm::StringRef name, llvm::StringRef shown,
                 llvm::function_ref<void(llvm::raw_ostream &)> write, KillPoint kill) {
  reach(kill);
  // A fresh name: a temporary is never opened twice, by this process or another.
  static std::atomic<uint64_t> counter{0};
  DurableTemporary tmp;
  int fd = -1;
  for (int attempt = 0; attempt < 100 && fd < 0; ++attempt) {
    uint64_t r = fnv1a(&attempt, sizeof attempt,
                       uint64_t(::getpid()) * 0x9E3779B97F4A7C15ULL + counter.fetch_add(1) +
                           uint64_t(std::chrono::steady_clock::now().time_since_epoch().count()));
    tmp.name = fmt::format("{}.tmp-{:06x}", name.str(), r & 0xFFFFFF);
    fd = ::openat(dirFd, tmp.name.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                  0666);
    if (fd < 0 && errno != EEXIST)
      break;
  }
  if (fd < 0)
    return cannotWrite(shown, errno);
  int failed = 0;
  {
    HashingFdStream os(fd);
    write(os);
    os.flush();
    failed = os.error;
    tmp.digest = os.digest;
  }
  reach(kill);
  // fsync is not supported everywhere (EINVAL) nor needed on a read-only file system.
  if (!failed && ::fsync(fd) != 0 && errno != EINVAL && errno != EROFS)
    failed = errno;
  if (::close(fd) != 0 && !failed && errno != EINTR)
    failed = errno;
  if (failed) {
    discardTemporaryAt(dirFd, tmp);
    return cannotWrite(shown, failed);
  }
  return tmp;
}

llvm::Error commitTemporaryAt(int dirFd, const DurableTemporary &tmp, llvm::StringRef name,
                              llvm::StringRef shown, KillPoint kill) {
  reach(kill);
  if (::renameat(dirFd, tmp.name.c_str(), dirFd, name.str().c_str()) != 0) {
    int code = errno;
    discardTemporaryAt(dirFd, tmp);
    return cannotWrite(shown, code);
  }
  reach(kill);
  return llvm::Error::success();
}

void discardTemporaryAt(int dirFd, const DurableTemporary &tmp) {
  ::unlinkat(dirFd, tmp.name.c_str(), 0);
}

llvm::Error writeDurablyAt(int dirFd, llvm::StringRef name, llvm::StringRef shown,
                           llvm::function_ref<void(llvm::raw_ostream &)> write, uint64_t *digest,
                           KillPoint kill) {
  auto tmp = writeTemporaryAt(dirFd, name, shown, write, kill);
  if (!tmp)
    return tmp.takeError();
  if (auto err = commitTemporaryAt(dirFd, *tmp, name, shown, kill))
    return err;
  if (digest)
    *digest = tmp->digest;
  return llvm::Error::success();
}

llvm::Error syncDirectory(int dirFd, llvm::StringRef shown) {
  if (::fsync(dirFd) != 0 && errno != EINVAL)
    return inputError("{}: cannot sync: {}", shown.str(), std::strerror(errno));
  return llvm::Error::success();
}

} // namespace pipec
