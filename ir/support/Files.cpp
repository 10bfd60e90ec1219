#include "ir/support/Files.h"

#include "ir/support/Bytes.h"
#include "ir/support/DurableFile.h"
#include "ir/support/Error.h"
#include "ir/support/Memory.h"
#include "ir/support/Stdout.h"

#include "llvm/ADT/SmallString.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/Path.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <optional>
#include <sys/stat.h>
#include <unistd.h>

namespace pipec {

namespace {

std::string errnoText(int code) { return std::strerror(code); }

/// What kind of special file `st` describes ("" for a regular file).
std::string kindOf(const struct stat &st) {
  if (S_ISREG(st.st_mode))
    return "";
  if (S_ISDIR(st.st_mode))
    return "a directory";
  if (S_ISCHR(st.st_mode))
    return "a character device";
  if (S_ISBLK(st.st_mode))
    return "a block device";
  if (S_ISFIFO(st.st_mode))
    return "a pipe";
  if (S_ISSOCK(st.st_mode))
    return "a socket";
  return "not a regular file";
}

/// Read from `fd` until end of file or `most` + 1 bytes; false with errno on a read error.
bool readAll(int fd, uint64_t most, std::string &out) {
  char buffer[1 << 16];
  for (;;) {
    size_t want = sizeof(buffer);
    if (out.size() + want > most + 1)
      want = size_t(most + 1 - out.size());
    if (want == 0)
      return true;
    ssize_t n = ::read(fd, buffer, want);
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0)
      return false;
    if (n == 0)
      return true;
    out.append(buffer, size_t(n));
  }
}

struct FileId {
  dev_t dev = 0;
  ino_t ino = 0;
};

bool idOf(llvm::StringRef path, FileId &id) {
  struct stat st;
  if (::stat(path.str().c_str(), &st) != 0)
    return false;
  id = FileId{st.st_dev, st.st_ino};
  return true;
}

/// The absolute, normalised form of a path that may not exist yet (its directory must).
std::string canonicalDestination(llvm::StringRef path) {
  llvm::SmallString<256> dir(llvm::sys::path::parent_path(path));
  if (dir.empty())
    dir = ".";
  llvm::SmallString<256> real;
  if (llvm::sys::fs::real_path(dir, real))
    return path.str();
  llvm::sys::path::append(real, llvm::sys::path::filename(path));
  return std::string(real);
}

/// fsync the directory of `path`, so that a rename into it survives a crash; best effort.
void syncDirectoryOf(llvm::StringRef path) {
  llvm::SmallString<256> dir(llvm::sys::path::parent_path(path));
  if (dir.empty())
    dir = ".";
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0)
    return;
  llvm::consumeError(syncDirectory(fd, path));
  ::close(fd);
}

/// The first of `inputs` that is the same file as the existing file `id`.
const InputFile *aliasOf(const FileId &id, llvm::ArrayRef<InputFile> inputs) {
  for (const InputFile &in : inputs) {
    FileId other;
    if (idOf(in.path, other) && other.dev == id.dev && other.ino == id.ino)
      return &in;
  }
  return nullptr;
}

/// "--flag: " when the output has a flag.
std::string prefixOf(llvm::StringRef flag) {
  return flag.empty() ? std::string() : flag.str() + ": ";
}

} // namespace

std::string specialFileKind(llvm::StringRef path) {
  struct stat st;
  if (::stat(path.str().c_str(), &st) != 0)
    return "";
  return kindOf(st);
}

llvm::Error checkCanWriteIn(llvm::StringRef flag, llvm::StringRef dirRef) {
  std::string dir = dirRef.str();
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) {
    llvm::StringRef parent = llvm::sys::path::parent_path(dirRef);
    dir = parent.empty() ? std::string(".") : parent.str();
  }
  const std::string probe = fmt::format("{}/.piperun-write-test-{}", dir, ::getpid());
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0)
    return inputError("{}: {}: cannot write there: {}", flag.str(), shortened(dir, 200),
                      errnoText(errno));
  ::close(fd);
  ::unlink(probe.c_str());
  return llvm::Error::success();
}

llvm::Error checkInputFile(llvm::StringRef path, const InputFormat &format, bool &regular) {
  if (path.empty())
    return inputError("expected the path of {}, got an empty one", format.name);
  struct stat before;
  if (::stat(path.str().c_str(), &before) != 0)
    return inputError("{}: cannot read: {}", shortened(path, 200), errnoText(errno));
  // Refused before a byte is read: /dev/zero, /dev/stdin on a terminal, a socket would never
  // end, a directory is no file, and a file past the format's limit is not one of its files.
  std::string kind = kindOf(before);
  if (S_ISDIR(before.st_mode))
    return inputError("{}: cannot read: is a directory", shortened(path, 200));
  if (!kind.empty() && !S_ISFIFO(before.st_mode))
    return inputError("{}: cannot read: is {}, not {} (give a regular file)", shortened(path, 200),
                      kind, format.name);
  regular = S_ISREG(before.st_mode);
  if (regular) {
    const uint64_t size = uint64_t(before.st_size);
    if (size > format.maxBytes)
      return inputError("{}: {} is more than {} can need (at most {})", shortened(path, 200),
                        humanBytes(size), format.name, humanBytes(format.maxBytes));
    if (auto err = checkMemoryBudget(
            uint64_t(double(size) * format.memoryPerByte),
            fmt::format("reading {} ({})", shortened(path, 200), humanBytes(size)),
            "use a machine with more memory"))
      return err;
  }
  return llvm::Error::success();
}

llvm::Expected<std::string> readFile(llvm::StringRef path, const InputFormat &format) {
  const std::string p = path.str();
  bool regular = false;
  if (auto err = checkInputFile(path, format, regular))
    return err;
  struct stat before;
  if (::stat(p.c_str(), &before) != 0)
    return inputError("{}: cannot read: {}", shortened(path, 200), errnoText(errno));
  int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return inputError("{}: cannot read: {}", shortened(path, 200), errnoText(errno));
  struct stat opened;
  if (::fstat(fd, &opened) != 0 || opened.st_dev != before.st_dev ||
      opened.st_ino != before.st_ino) {
    ::close(fd);
    return inputError("{}: cannot read: the file changed while it was opened",
                      shortened(path, 200));
  }
  std::string out;
  if (S_ISREG(opened.st_mode))
    out.reserve(size_t(std::min<uint64_t>(uint64_t(opened.st_size), format.maxBytes)));
  bool ok = readAll(fd, format.maxBytes, out);
  int readErrno = errno;
  ::close(fd);
  if (!ok)
    return inputError("{}: cannot read: {}", shortened(path, 200), errnoText(readErrno));
  if (out.size() > format.maxBytes)
    return inputError("{}: more than {} can need (at most {})", shortened(path, 200), format.name,
                      humanBytes(format.maxBytes));
  return out;
}

llvm::Expected<int> openRegularFileAt(int dirFd, llvm::StringRef name, llvm::StringRef shown,
                                      const InputFormat &format, uint64_t &size) {
  int fd = ::openat(dirFd, name.str().c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    int code = errno;
    struct stat st;
    if (code == ELOOP || (::fstatat(dirFd, name.str().c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 &&
                          S_ISLNK(st.st_mode)))
      return inputError("{}: is a symbolic link, not {} (links are not followed here)",
                        shortened(shown, 200), format.name);
    return inputError("{}: cannot read: {}", shortened(shown, 200), errnoText(code));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    std::string kind = ::fstat(fd, &st) == 0 ? kindOf(st) : std::string("unreadable");
    ::close(fd);
    return inputError("{}: is {}, not {} (give a regular file)", shortened(shown, 200), kind,
                      format.name);
  }
  size = uint64_t(st.st_size);
  if (size > format.maxBytes) {
    ::close(fd);
    return inputError("{}: {} is more than {} can need (at most {})", shortened(shown, 200),
                      humanBytes(size), format.name, humanBytes(format.maxBytes));
  }
  // A regular file never blocks; clear O_NONBLOCK for the reads that follow.
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  return fd;
}

llvm::Expected<std::string> readRegularFileAt(int dirFd, llvm::StringRef name,
                                              llvm::StringRef shown, const InputFormat &format) {
  uint64_t size = 0;
  auto fd = openRegularFileAt(dirFd, name, shown, format, size);
  if (!fd)
    return fd.takeError();
  if (auto err =
          checkMemoryBudget(uint64_t(double(size) * format.memoryPerByte),
                            fmt::format("reading {} ({})", shortened(shown, 200), humanBytes(size)),
                            "use a machine with more memory")) {
    ::close(*fd);
    return err;
  }
  std::string out;
  out.reserve(size_t(size));
  bool ok = readAll(*fd, format.maxBytes, out);
  int readErrno = errno;
  ::close(*fd);
  if (!ok)
    return inputError("{}: cannot read: {}", shortened(shown, 200), errnoText(readErrno));
  if (out.size() > format.maxBytes)
    return inputError("{}: more than {} can need (at most {})", shortened(shown, 200), format.name,
                      humanBytes(format.maxBytes));
  return out;
}

llvm::Error checkOutputPath(llvm::StringRef flag, llvm::StringRef path,
                            llvm::ArrayRef<InputFile> inputs) {
  const std::string at = prefixOf(flag);
  if (path == "-")
    return llvm::Error::success();
  if (path.empty())
    return inputError("{}expected a file name or - (standard output), got an empty path", at);
  struct stat st;
  if (::stat(path.str().c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode))
      return inputError("{}{}: is a directory; give a file name", at, shortened(path, 200));
    if (!S_ISREG(st.st_mode))
      return inputError("{}{}: is {}; outputs go to regular files or - (standard output)", at,
                        shortened(path, 200), kindOf(st));
    if (const InputFile *in = aliasOf(FileId{st.st_dev, st.st_ino}, inputs))
      return inputError("{}{} is the {} input{}; give the output its own file", at,
                        shortened(path, 200), in->flag,
                        in->path == path ? "" : fmt::format(" ({})", shortened(in->path, 200)));
    return llvm::Error::success();
  }
  llvm::StringRef dir = llvm::sys::path::parent_path(path);
  if (!dir.empty() && !llvm::sys::fs::is_directory(dir))
    return inputError("{}{}: cannot write: no directory {}", at, shortened(path, 200),
                      shortened(dir, 200));
  return llvm::Error::success();
}

llvm::Error checkOutsideDirectories(llvm::StringRef flag, llvm::StringRef path,
                                    llvm::ArrayRef<InputFile> dirs) {
  if (path == "-")
    return llvm::Error::success();
  const std::string file = canonicalDestination(path);
  for (const InputFile &d : dirs) {
    llvm::SmallString<256> real;
    std::string dir =
        llvm::sys::fs::real_path(d.path, real) ? canonicalDestination(d.path) : std::string(real);
    if (file == dir)
      return inputError("{}{} is the {} directory; give it a path of its own", prefixOf(flag),
                        shortened(path, 200), d.flag);
    if (!dir.empty() && dir.back() != '/')
      dir += '/';
    if (llvm::StringRef(file).startswith(dir))
      return inputError("{}{} is inside the {} directory {}; give it a path outside it",
                        prefixOf(flag), shortened(path, 200), d.flag, shortened(d.path, 200));
  }
  return llvm::Error::success();
}

llvm::Error writeFilesAtomically(llvm::ArrayRef<OutputFile> files,
                                 llvm::ArrayRef<InputFile> inputs) {
  // Check every destination first, so that one bad path writes nothing at all.
  std::vector<std::string> seen;
  for (const OutputFile &f : files) {
    if (auto err = checkOutputPath(f.flag, f.path, inputs))
      return err;
    std::string canonical = f.path == "-" ? "-" : canonicalDestination(f.path);
    FileId mine;
    bool exists = f.path != "-" && idOf(f.path, mine);
    for (size_t i = 0; i < seen.size(); ++i) {
      FileId other;
      bool same =
          seen[i] == canonical || (exists && files[i].path != "-" && idOf(files[i].path, other) &&
                                   other.dev == mine.dev && other.ino == mine.ino);
      if (same)
        return inputError("{}{} is also the {} output; give each output its own file",
                          prefixOf(f.flag), shortened(f.path, 200), files[i].flag);
    }
    seen.push_back(canonical);
  }
  std::vector<std::optional<DurableTemporary>> temps(files.size());
  auto cleanup = [&](size_t from) {
    for (size_t i = from; i < temps.size(); ++i)
      if (temps[i])
        discardTemporaryAt(AT_FDCWD, *temps[i]);
  };
  for (size_t i = 0; i < files.size(); ++i) {
    if (files[i].path == "-")
      continue;
    const OutputFile &file = files[i];
    auto tmp = writeTemporaryAt(AT_FDCWD, file.path, file.path, [&](llvm::raw_ostream &os) {
      if (file.write)
        file.write(os);
      else
        os << file.contents;
    });
    if (!tmp) {
      cleanup(0);
      return inputError("{}{}", prefixOf(file.flag), takeMessage(tmp.takeError()));
    }
    temps[i] = std::move(*tmp);
  }
  for (size_t i = 0; i < files.size(); ++i) {
    if (files[i].path != "-")
      continue;
    std::string streamed;
    if (files[i].write) {
      llvm::raw_string_ostream os(streamed);
      files[i].write(os);
    }
    if (auto err = writeStdout(files[i].write ? llvm::StringRef(streamed)
                                              : llvm::StringRef(files[i].contents))) {
      cleanup(0);
      return inputError("{}{}", prefixOf(files[i].flag), takeMessage(std::move(err)));
    }
  }
  for (size_t i = 0; i < files.size(); ++i) {
    if (files[i].path == "-")
      continue;
    if (auto err =
            commitTemporaryAt(AT_FDCWD, *temps[i], files[i].path, shortened(files[i].path, 200))) {
      temps[i].reset(); // removed by the failed commit
      cleanup(i + 1);
      return inputError("{}{}", prefixOf(files[i].flag), takeMessage(std::move(err)));
    }
    syncDirectoryOf(files[i].path);
  }
  return llvm::Error::success();
}

llvm::Error writeFileAtomically(llvm::StringRef path, llvm::StringRef contents,
                                llvm::ArrayRef<InputFile> inputs) {
  return writeFilesAtomically({OutputFile{"", path.str(), contents.str()}}, inputs);
}

} // namespace pipec
