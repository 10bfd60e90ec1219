#include "runtime/Checkpoint.h"

#include "runtime/Data.h"

#include "ir/formats/PlanJson.h"
#include "ir/support/Bytes.h"
#include "ir/support/DurableFile.h"
#include "ir/support/Error.h"
#include "ir/support/Files.h"
#include "ir/support/Hash.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/SmallString.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/Path.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <dirent.h>
#include <fcntl.h>
#include <map>
#include <optional>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <utility>

namespace pipec {

namespace {

constexpr char kMagic[8] = {'P', 'I', 'P', 'E', 'C', 'K', 'P', 'T'};
constexpr uint32_t kVersion = 1;
constexpr size_t kHeaderBytes = 8 + 4 + 4 + 8;

std::string hex(uint64_t v) { return fmt::format("{:016x}", v); }

std::string stepName(int64_t step) { return fmt::format("step-{:08d}", step); }
std::string layerName(int layer) { return fmt::format("layer-{:05d}.bin", layer); }

std::string join(llvm::StringRef a, llvm::StringRef b) {
  llvm::SmallString<256> p(a);
  llvm::sys::path::append(p, b);
  return std::string(p);
}

/// A descriptor closed when it goes out of scope.
class Descriptor {
public:
  explicit Descriptor(int fd = -1) : fd(fd) {}
  Descriptor(Descriptor &&o) noexcept : fd(o.release()) {}
  Descriptor &operator=(Descriptor &&o) noexcept {
    if (this != &o) {
      reset();
      fd = o.release();
    }
    return *this;
  }
  ~Descriptor() { reset(); }
  int get() const { return fd; }
  explicit operator bool() const { return fd >= 0; }
  int release() { return std::exchange(fd, -1); }
  void reset() {
    if (fd >= 0)
      ::close(fd);
    fd = -1;
  }

private:
  int fd;
};

/// The checkpoint directory `dir` itself (the user's path: a symbolic link there is theirs to
/// give). Everything inside it is then reached relative to this descriptor, never by a path
/// that could follow a link.
Descriptor openDirectory(const std::string &dir) {
  return Descriptor(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
}

/// The directory `name` inside `parent`, never through a symbolic link.
Descriptor openSubdirectory(int parent, const std::string &name) {
  return Descriptor(
      ::openat(parent, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
}

/// fsync a directory so that the names created or removed in it survive a crash.
llvm::Error syncSaveDirectory(int fd, const std::string &shown) {
  if (auto err = syncDirectory(fd, shown))
    return inputError("--save-dir: {}", takeMessage(std::move(err)));
  return llvm::Error::success();
}

/// The file a save writes into a new step directory first, before anything else: a step
/// directory holding it (or nothing at all) is one piperun started, whose files it may remove.
constexpr char kMarkerName[] = "written-by-piperun";
constexpr char kMarkerText[] = "pipeckpt/1: a checkpoint directory written by piperun; its "
                               "files are piperun's to replace and remove\n";
constexpr char kManifestName[] = "manifest.json";

/// Whether `name` is one a save writes inside a step directory: the marker, the manifest, a
/// layer file, or the temporary of one of them (<name>.tmp-<6 characters>).
bool isSavedName(llvm::StringRef name) {
  name = temporaryTarget(name);
  if (name == kMarkerName || name == kManifestName)
    return true;
  llvm::StringRef digits = name;
  return digits.consume_front("layer-") && digits.consume_back(".bin") && digits.size() >= 5 &&
         llvm::all_of(digits, llvm::isDigit);
}

/// Write `pieces` to `name` inside the directory `dirFd` durably (ir/support/DurableFile.h),
/// with a kill point between pieces, so that a test sees partial files. The digest of the
/// bytes goes to `digest`; `shown` names the file in messages.
llvm::Error writeDurably(int dirFd, const std::string &name, const std::string &shown,
                         llvm::ArrayRef<llvm::StringRef> pieces, uint64_t *digest = nullptr) {
  auto writePieces = [&](llvm::raw_ostream &os) {
    for (llvm::StringRef piece : pieces) {
      checkpointKillPoint();
      os << piece;
      os.flush();
    }
  };
  if (auto err = writeDurablyAt(dirFd, name, shown, writePieces, digest, checkpointKillPoint))
    return inputError("--save-dir: {}", takeMessage(std::move(err)));
  return llvm::Error::success();
}

/// The entries of the open directory `fd` (names only, no "." or ".."), sorted.
std::vector<std::string> listDirectory(int fd) {
  std::vector<std::string> names;
  int copy = ::dup(fd);
  if (copy < 0)
    return names;
  DIR *d = ::fdopendir(copy);
  if (!d) {
    ::close(copy);
    return names;
  }
  ::rewinddir(d); // (the copy shares the offset an earlier listing of `fd` left at the end)
  while (struct dirent *e = ::readdir(d)) {
    llvm::StringRef name(e->d_name);
    if (name != "." && name != "..")
      names.push_back(name.str());
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

/// The bytes a checkpoint of `m` takes (every layer's count filled in): its layer files, its
/// manifest (a digest has a fixed width) and the marker.
uint64_t checkpointBytes(CheckpointManifest m) {
  uint64_t total = sizeof kMarkerText - 1;
  for (CheckpointManifest::Layer &l : m.layers) {
    l.bytes = kHeaderBytes + 3 * l.count * sizeof(float);
    l.digest = hex(0);
    total += l.bytes;
  }
  return total + writeCheckpointManifest(m).size();
}

/// The step of a name step-<8 digits>; nullopt for any other name.
std::optional<int64_t> stepOfName(llvm::StringRef name) {
  int64_t step = 0;
  if (!name.consume_front("step-") || name.size() != 8 || !llvm::all_of(name, llvm::isDigit) ||
      name.getAsInteger(10, step))
    return std::nullopt;
  return step;
}

/// What a step-<n> entry of a checkpoint directory is, to piperun.
enum class StepKind {
  Committed, // a directory with a pipeckpt manifest of this step: a checkpoint piperun wrote
  Started,   // a directory holding piperun's marker and no manifest, or nothing: a save that
             // did not finish
  Foreign,   // anything else: a symbolic link, a file, a directory of someone else's files
};

struct StepEntry {
  int64_t step;
  std::string name;
  StepKind kind;
  std::string why; // for Foreign: what it is, for a message
};

/// A lstat inside `dirFd` that does not follow a link; false when `name` is absent.
bool statAt(int dirFd, const std::string &name, struct stat &st) {
  return ::fstatat(dirFd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0;
}

/// Read and check the manifest of step directory `stepFd` (`shown`: its path).
llvm::Expected<CheckpointManifest> readManifest(int stepFd, const std::string &shown,
                                                int64_t step) {
  const std::string path = join(shown, kManifestName);
  auto text = readRegularFileAt(stepFd, kManifestName, path, kAnyInput);
  if (!text)
    return text.takeError();
  auto manifest = parseCheckpointManifest(*text, path);
  if (!manifest)
    return manifest.takeError();
  if (manifest->step != step)
    return inputError("{}: $.step: expected {} (the directory's step), got {}", path, step,
                      manifest->step);
  return manifest;
}

StepEntry classifyStep(int dirFd, const std::string &dir, const std::string &name, int64_t step) {
  StepEntry e{step, name, StepKind::Foreign, ""};
  struct stat st;
  if (!statAt(dirFd, name, st)) {
    e.why = "unreadable";
    return e;
  }
  if (S_ISLNK(st.st_mode)) {
    e.why = "a symbolic link";
    return e;
  }
  if (!S_ISDIR(st.st_mode)) {
    e.why = "not a directory";
    return e;
  }
  Descriptor sub = openSubdirectory(dirFd, name);
  if (!sub) {
    e.why = fmt::format("a directory piperun cannot open ({})", std::strerror(errno));
    return e;
  }
  if (statAt(sub.get(), kManifestName, st)) {
    auto manifest = readManifest(sub.get(), join(dir, name), step);
    if (manifest) {
      e.kind = StepKind::Committed;
    } else {
      e.why = fmt::format("a directory whose manifest.json is not piperun's ({})",
                          takeMessage(manifest.takeError()));
    }
    return e;
  }
  if (statAt(sub.get(), kMarkerName, st) && S_ISREG(st.st_mode)) {
    e.kind = StepKind::Started;
    return e;
  }
  if (listDirectory(sub.get()).empty()) {
    e.kind = StepKind::Started;
    return e;
  }
  e.why = "a directory of files piperun did not write (it has neither a pipeckpt manifest nor "
          "piperun's marker)";
  return e;
}

/// Every step-<8 digits> entry of the checkpoint directory `dirFd`, by step, classified.
std::vector<StepEntry> stepEntries(int dirFd, const std::string &dir) {
  std::vector<StepEntry> out;
  for (const std::string &name : listDirectory(dirFd))
    if (std::optional<int64_t> step = stepOfName(name))
      out.push_back(classifyStep(dirFd, dir, name, *step));
  return out; // names of 8 digits sort as their steps
}

/// The first entry of step directory `sub` that a save does not write (a user's file, a
/// subdirectory, a link), or nothing.
std::optional<std::string> foreignEntry(int sub) {
  for (const std::string &file : listDirectory(sub)) {
    struct stat st;
    if (!isSavedName(file) || !statAt(sub, file, st) || !S_ISREG(st.st_mode))
      return file;
  }
  return std::nullopt;
}

/// Remove a step directory piperun wrote (Committed or Started): its manifest first (from then
/// on it is incomplete and never resumed), then the layer files and temporaries a save writes,
/// the marker last, then the directory. A step directory that also holds anything a save does
/// not write is left whole (a checkpoint stays resumable, a marker keeps it piperun's); nothing
/// is followed through a symbolic link. Returns why the directory is still there, if it is:
/// "it holds NAME, which piperun did not write; ..." or "removing it failed (WHY); ...".
std::optional<std::string> removeOwnStep(int dirFd, const std::string &name) {
  auto failed = [](int error) {
    return fmt::format("removing it failed ({}); the next save tries again", std::strerror(error));
  };
  Descriptor sub = openSubdirectory(dirFd, name);
  if (!sub)
    return errno == ENOENT ? std::nullopt : std::optional(failed(errno));
  if (std::optional<std::string> foreign = foreignEntry(sub.get()))
    return fmt::format("it holds {}, which piperun did not write; move that out and the next "
                       "save removes the step",
                       shortened(*foreign, 100));
  int firstError = 0;
  auto removeFile = [&](const std::string &file) {
    struct stat st;
    if (!statAt(sub.get(), file, st) || !S_ISREG(st.st_mode))
      return false;
    checkpointKillPoint();
    if (::unlinkat(sub.get(), file.c_str(), 0) == 0)
      return true;
    firstError = firstError ? firstError : errno;
    return false;
  };
  if (removeFile(kManifestName))
    llvm::consumeError(syncSaveDirectory(sub.get(), name));
  for (const std::string &file : listDirectory(sub.get()))
    if (file != kMarkerName && isSavedName(file))
      removeFile(file);
  removeFile(kMarkerName);
  checkpointKillPoint();
  if (::unlinkat(dirFd, name.c_str(), AT_REMOVEDIR) == 0 || errno == ENOENT)
    return std::nullopt;
  return failed(firstError ? firstError : errno);
}

/// Past the newest `keep` committed checkpoints of `dir` (0: all are kept), and whatever killed
/// saves or prunes left: only step directories piperun wrote; anything else is left where it
/// is. Each directory that stays is described in `notRemoved`.
void pruneSteps(int dirFd, const std::string &dir, size_t keep,
                std::vector<std::string> &notRemoved) {
  std::vector<StepEntry> steps = stepEntries(dirFd, dir);
  size_t newer = 0;
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    if (it->kind == StepKind::Foreign)
      continue;
    if (it->kind == StepKind::Committed && (keep == 0 || newer < keep)) {
      ++newer;
      continue;
    }
    if (std::optional<std::string> why = removeOwnStep(dirFd, it->name))
      notRemoved.push_back(fmt::format("{}: {}", join(dir, it->name), *why));
  }
}

/// One line refusing a step entry piperun did not write.
llvm::Error foreignStep(llvm::StringRef flag, const std::string &dir, const StepEntry &e) {
  return inputError("{}: {} is {}; piperun reads and deletes only the checkpoints it wrote "
                    "there: move it out of {}, or give another directory",
                    flag, shortened(join(dir, e.name), 200), e.why, shortened(dir, 200));
}

bool sameDirectory(llvm::StringRef a, llvm::StringRef b) {
  struct stat sa, sb;
  return ::stat(a.str().c_str(), &sa) == 0 && ::stat(b.str().c_str(), &sb) == 0 &&
         sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

} // namespace

std::string planHash(const Plan &plan) {
  Plan copy = plan;
  copy.stats = PlanStats();
  const std::string json = writePlanJson(copy);
  return hex(fnv1a(json));
}

namespace {
std::atomic<long> killAt{0};
} // namespace

void setCheckpointKillAt(long n) { killAt = n; }

void checkpointKillPoint() {
  static std::atomic<long> count{0};
  if (const long target = killAt; target > 0 && count.fetch_add(1) + 1 == target)
    ::kill(::getpid(), SIGKILL);
}

llvm::Error checkSaveDir(llvm::StringRef dir, llvm::StringRef resumeDir) {
  if (dir.empty())
    return inputError("--save-dir: expected a directory, got an empty path");
  struct stat st;
  if (::stat(dir.str().c_str(), &st) != 0) {
    if (::lstat(dir.str().c_str(), &st) == 0)
      return inputError("--save-dir: {} is a symbolic link to nothing; give a directory, or a "
                        "new name in one",
                        shortened(dir, 200));
    llvm::StringRef parent = llvm::sys::path::parent_path(dir);
    if (!parent.empty() && !llvm::sys::fs::is_directory(parent))
      return inputError("--save-dir: {}: no directory {} to create it in", shortened(dir, 200),
                        shortened(parent, 200));
    return checkCanWriteIn("--save-dir", dir); // (in the parent, where the run makes it)
  }
  if (!S_ISDIR(st.st_mode))
    return inputError("--save-dir: {}: is {}, not a directory", shortened(dir, 200),
                      specialFileKind(dir).empty() ? std::string("a file") : specialFileKind(dir));
  Descriptor fd = openDirectory(dir.str());
  if (!fd)
    return inputError("--save-dir: {}: cannot open: {}", shortened(dir, 200), std::strerror(errno));
  std::vector<StepEntry> steps = stepEntries(fd.get(), dir.str());
  for (const StepEntry &e : steps)
    if (e.kind == StepKind::Foreign)
      return foreignStep("--save-dir", dir.str(), e);
  if (resumeDir.empty() || !sameDirectory(dir, resumeDir))
    for (auto it = steps.rbegin(); it != steps.rend(); ++it)
      if (it->kind == StepKind::Committed)
        return inputError("--save-dir: {} already holds checkpoints (step {}); continue them "
                          "with --resume {}, or give an empty or new --save-dir",
                          shortened(dir, 200), it->step, shortened(dir, 200));
  return checkCanWriteIn("--save-dir", dir);
}

llvm::Expected<bool> holdsCheckpoint(llvm::StringRef dirRef) {
  const std::string dir = dirRef.str(), shown = shortened(dir, 200);
  struct stat st;
  if (::lstat(dir.c_str(), &st) != 0) {
    if (errno == ENOENT) // (a first launch: --save-dir makes it)
      return false;
    return inputError("--resume: {}: {}", shown, std::strerror(errno));
  }
  // A mistyped path must not start the job again at step 0: only a directory, or nothing.
  if (S_ISLNK(st.st_mode) && ::stat(dir.c_str(), &st) != 0)
    return inputError("--resume: {} is a symbolic link to nothing ({}); give the checkpoint "
                      "directory",
                      shown, std::strerror(errno));
  if (!S_ISDIR(st.st_mode)) {
    std::string kind = specialFileKind(dir);
    return inputError("--resume: {} is {}, not a directory; give the checkpoint directory (the "
                      "--save-dir of the run to continue)",
                      shown, kind.empty() ? "a file" : kind);
  }
  Descriptor fd = openDirectory(dir);
  if (!fd)
    return inputError("--resume: {}: cannot open: {}", shown, std::strerror(errno));
  // A foreign entry, or a step whose manifest is not piperun's, is not "no checkpoint yet":
  // openCheckpoint refuses it with its reason rather than the run starting again at step 0.
  for (const StepEntry &e : stepEntries(fd.get(), dir))
    if (e.kind != StepKind::Started)
      return true;
  return false;
}

std::string checkpointPath(llvm::StringRef dir, int64_t step) { return join(dir, stepName(step)); }

/// --save-dir `dir` made where it does not exist yet, its name made durable in its parent.
llvm::Error makeSaveDir(const std::string &dir) {
  if (llvm::sys::fs::is_directory(dir))
    return llvm::Error::success();
  if (std::error_code ec = llvm::sys::fs::create_directory(dir))
    return inputError("--save-dir: {}: cannot create: {}", dir, ec.message());
  llvm::StringRef parent = llvm::sys::path::parent_path(dir);
  Descriptor parentFd = openDirectory(parent.empty() ? "." : parent.str());
  if (parentFd)
    return syncSaveDirectory(parentFd.get(), dir);
  return llvm::Error::success();
}

llvm::Expected<int> lockSaveDir(llvm::StringRef dirRef) {
  const std::string dir = dirRef.str();
  if (auto err = makeSaveDir(dir))
    return err;
  Descriptor fd = openDirectory(dir);
  if (!fd)
    return inputError("--save-dir: {}: cannot open: {}", shortened(dir, 200), std::strerror(errno));
  if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
    if (errno == EWOULDBLOCK)
      return inputError("--save-dir: {} is in use by another process (a piperun still saving "
                        "there?); wait for it to end, or give another --save-dir",
                        shortened(dir, 200));
    return inputError("--save-dir: {}: cannot lock: {}", shortened(dir, 200), std::strerror(errno));
  }
  return fd.release();
}

llvm::Error saveCheckpoint(llvm::StringRef dirRef, CheckpointManifest manifest,
                           const std::function<llvm::Error(int, LayerState &)> &gather, size_t keep,
                           SavedCheckpoint *out) {
  const std::string dir = dirRef.str();
  if (manifest.step < 0 || manifest.step > kMaxCheckpointStep)
    return inputError("--save-dir: step {} is past the last step a checkpoint can record ({}); "
                      "stop the run by then (--steps)",
                      manifest.step, kMaxCheckpointStep);
  if (auto err = makeSaveDir(dir))
    return err;
  Descriptor dirFd = openDirectory(dir);
  if (!dirFd)
    return inputError("--save-dir: {}: cannot open: {}", dir, std::strerror(errno));
  const std::string name = stepName(manifest.step);
  const std::string stepDir = join(dir, name);
  // What a save killed before its commit left of this step: never resumed, start again. Only
  // a step directory piperun wrote is cleared; anything else in the way is refused.
  struct stat st;
  if (statAt(dirFd.get(), name, st)) {
    StepEntry e = classifyStep(dirFd.get(), dir, name, manifest.step);
    if (e.kind == StepKind::Committed)
      return inputError("--save-dir: {} already holds a checkpoint of step {}", dir, manifest.step);
    if (e.kind == StepKind::Foreign)
      return foreignStep("--save-dir", dir, e);
    if (std::optional<std::string> why = removeOwnStep(dirFd.get(), name))
      return inputError("--save-dir: {} holds what a killed save left, and {}",
                        shortened(stepDir, 200), *why);
  }
  // The bytes it will take, where the caller gave every layer's size (for a full disk's line).
  const int numLayers = int(manifest.model.numLayers) + 2;
  const uint64_t needed =
      manifest.layers.size() == size_t(numLayers) ? checkpointBytes(manifest) : 0;
  checkpointKillPoint();
  if (::mkdirat(dirFd.get(), name.c_str(), 0777) != 0)
    return inputError("--save-dir: {}: cannot create: {}", stepDir, std::strerror(errno));
  if (auto err = syncSaveDirectory(dirFd.get(), dir))
    return err;
  Descriptor stepFd = openSubdirectory(dirFd.get(), name);
  if (!stepFd)
    return inputError("--save-dir: {}: cannot open: {}", stepDir, std::strerror(errno));
  // A write that fails (a full disk, a file size limit) takes back what this save wrote; the
  // committed checkpoints were never touched.
  auto writeFailed = [&](llvm::Error err) -> llvm::Error {
    std::string why = takeMessage(std::move(err));
    stepFd.reset();
    removeOwnStep(dirFd.get(), name);
    if (needed == 0)
      return inputError("{}", why);
    return inputError("{}; the checkpoint needs {:.2f} MiB ({} bytes) in {}: free that much; the "
                      "checkpoints before it are intact",
                      why, inMiB(needed), needed, dir);
  };
  // The marker under its own name at once (no temporary): from its creation on, even empty,
  // the directory is recognisably piperun's, whenever the save is killed.
  checkpointKillPoint();
  Descriptor marker(::openat(stepFd.get(), kMarkerName,
                             O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666));
  if (!marker ||
      ::write(marker.get(), kMarkerText, sizeof kMarkerText - 1) != ssize_t(sizeof kMarkerText - 1))
    return writeFailed(inputError("--save-dir: {}: cannot write: {}", join(stepDir, kMarkerName),
                                  std::strerror(errno ? errno : EIO)));
  marker.reset();
  checkpointKillPoint();
  manifest.layers.assign(size_t(numLayers), CheckpointManifest::Layer());
  LayerState state;
  for (int l = 0; l < numLayers; ++l) {
    if (auto err = gather(l, state))
      return err;
    const uint64_t n = state.weights.size();
    assert(state.firstMoment.size() == n && state.secondMoment.size() == n &&
           "a layer's three arrays have one length");
    char header[kHeaderBytes];
    const uint32_t version = kVersion, layer = uint32_t(l);
    std::memcpy(header, kMagic, 8);
    std::memcpy(header + 8, &version, 4);
    std::memcpy(header + 12, &layer, 4);
    std::memcpy(header + 16, &n, 8);
    auto bytesOf = [](const std::vector<float> &v) {
      return llvm::StringRef(reinterpret_cast<const char *>(v.data()), v.size() * sizeof(float));
    };
    uint64_t digest = 0;
    if (auto err = writeDurably(stepFd.get(), layerName(l), join(stepDir, layerName(l)),
                                {llvm::StringRef(header, kHeaderBytes), bytesOf(state.weights),
                                 bytesOf(state.firstMoment), bytesOf(state.secondMoment)},
                                &digest))
      return writeFailed(std::move(err));
    manifest.layers[size_t(l)] = {kHeaderBytes + 3 * n * sizeof(float), n, hex(digest)};
  }
  if (auto err = syncSaveDirectory(stepFd.get(), stepDir))
    return writeFailed(std::move(err));
  // The commit: from the manifest's rename on, this checkpoint is whole.
  if (auto err = writeDurably(stepFd.get(), kManifestName, join(stepDir, kManifestName),
                              {writeCheckpointManifest(manifest)}))
    return writeFailed(std::move(err));
  if (auto err = syncSaveDirectory(stepFd.get(), stepDir))
    return err;
  if (auto err = syncSaveDirectory(dirFd.get(), dir))
    return err;
  if (out)
    out->bytes = checkpointBytes(manifest);
  std::vector<std::string> notRemoved;
  pruneSteps(dirFd.get(), dir, keep, notRemoved);
  if (out)
    out->notRemoved = std::move(notRemoved);
  return syncSaveDirectory(dirFd.get(), dir);
}

llvm::Expected<std::vector<std::string>> pruneCheckpoints(llvm::StringRef dir, size_t keep) {
  Descriptor dirFd = openDirectory(dir.str());
  if (!dirFd)
    return inputError("--save-dir: {}: cannot open: {}", shortened(dir, 200), std::strerror(errno));
  std::vector<std::string> notRemoved;
  pruneSteps(dirFd.get(), dir.str(), keep, notRemoved);
  if (auto err = syncSaveDirectory(dirFd.get(), dir.str()))
    return err;
  return notRemoved;
}

llvm::Expected<Checkpoint> openCheckpoint(llvm::StringRef dirRef) {
  const std::string dir = dirRef.str();
  if (!llvm::sys::fs::is_directory(dir))
    return inputError("--resume: {}: {}", shortened(dir, 200),
                      llvm::sys::fs::exists(dir) ? "is not a directory" : "no such directory");
  Descriptor dirFd = openDirectory(dir);
  if (!dirFd)
    return inputError("--resume: {}: cannot open: {}", shortened(dir, 200), std::strerror(errno));
  std::vector<std::string> names = listDirectory(dirFd.get());
  for (auto it = names.rbegin(); it != names.rend(); ++it) {
    std::optional<int64_t> step = stepOfName(*it);
    if (!step)
      continue;
    struct stat st;
    if (!statAt(dirFd.get(), *it, st))
      continue;
    if (S_ISLNK(st.st_mode))
      return inputError("--resume: {} is a symbolic link; piperun reads only the checkpoint "
                        "directories it wrote inside {}: remove the link",
                        shortened(join(dir, *it), 200), shortened(dir, 200));
    if (!S_ISDIR(st.st_mode))
      continue;
    Descriptor stepFd = openSubdirectory(dirFd.get(), *it);
    if (!stepFd)
      return inputError("--resume: {}: cannot open: {}", shortened(join(dir, *it), 200),
                        std::strerror(errno));
    if (!statAt(stepFd.get(), kManifestName, st))
      continue; // incomplete: a save that did not finish
    Checkpoint c;
    c.path = join(dir, *it);
    auto manifest = readManifest(stepFd.get(), c.path, *step);
    if (!manifest)
      return inputError("--resume: {}", takeMessage(manifest.takeError()));
    c.manifest = std::move(*manifest);
    return c;
  }
  return inputError("--resume: {} holds no complete checkpoint (a step-<n> directory with a "
                    "manifest.json); start without --resume",
                    shortened(dir, 200));
}

llvm::Error checkResumable(const Checkpoint &ckpt, const Plan &plan, std::optional<uint64_t> seed,
                           llvm::StringRef data) {
  const CheckpointManifest &m = ckpt.manifest;
  if (!plan.transformer)
    return inputError("--resume: the plan's model '{}' is an abstract layer list; checkpoints "
                      "hold transformer weights",
                      plan.model);
  if (auto diff = firstModelDifference(m.model, *plan.transformer))
    return inputError("--resume: {} is of another model: its {} is {}, the plan's is {}", ckpt.path,
                      diff->field, shortened(diff->a), shortened(diff->b));
  const ParallelConfig &pc = plan.parallel;
  const int64_t saved = int64_t(m.parallel.dp) * m.parallel.microbatches;
  const int64_t mine = int64_t(pc.dp) * pc.microbatches;
  if (saved != mine)
    return inputError("--resume: {} was saved with {} microbatches a step (dp {} x "
                      "microbatches {}), this plan takes {} (dp {} x microbatches {}); compile "
                      "the plan with --dp x --microbatches = {} to continue the same data",
                      ckpt.path, saved, m.parallel.dp, m.parallel.microbatches, mine, pc.dp,
                      pc.microbatches, saved);
  if (seed && *seed != m.seed)
    return inputError("--resume: {} was saved by a run with --seed {}, not {}; drop --seed (the "
                      "checkpoint's is used) or give --seed {}",
                      ckpt.path, m.seed, *seed, m.seed);
  return checkSameData(m.data, data, ckpt.path);
}

llvm::Error readCheckpointLayer(const Checkpoint &ckpt, int layer, LayerState &out) {
  const CheckpointManifest::Layer &want = ckpt.manifest.layers.at(size_t(layer));
  const std::string path = join(ckpt.path, layerName(layer));
  auto bad = [&](const std::string &why) {
    return inputError("--resume: {}: {}; the checkpoint is damaged (resume from an older "
                      "step-<n> directory by removing this one)",
                      path, why);
  };
  if (want.bytes != kHeaderBytes + 3 * want.count * sizeof(float))
    return bad(
        fmt::format("the manifest gives {} bytes for {} floats per array", want.bytes, want.count));
  // The step directory and the file, never through a symbolic link (the path to the checkpoint
  // directory itself is the user's).
  Descriptor stepFd(::open(ckpt.path.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!stepFd)
    return bad(errno == ELOOP || errno == ENOTDIR
                   ? std::string("its directory is not the one piperun wrote (a symbolic link?)")
                   : std::string(std::strerror(errno)));
  uint64_t size = 0;
  auto opened = openRegularFileAt(stepFd.get(), layerName(layer), path,
                                  InputFormat{"a checkpoint layer file", UINT64_MAX, 0}, size);
  if (!opened) {
    std::string why = takeMessage(opened.takeError());
    llvm::StringRef rest(why);
    rest.consume_front(shortened(path, 200) + ": ");
    return bad(rest.str());
  }
  const int fd = *opened;
  if (size != want.bytes) {
    ::close(fd);
    return bad(fmt::format("{} bytes, the manifest says {}", size, want.bytes));
  }
  uint64_t h = kFnv1aStart;
  auto readInto = [&](void *dst, size_t n) -> bool {
    char *p = static_cast<char *>(dst);
    while (n > 0) {
      ssize_t got = ::read(fd, p, std::min<size_t>(n, size_t(1) << 30));
      if (got < 0 && errno == EINTR)
        continue;
      if (got <= 0)
        return false;
      h = fnv1a(p, size_t(got), h);
      p += got;
      n -= size_t(got);
    }
    return true;
  };
  char header[kHeaderBytes];
  bool ok = readInto(header, kHeaderBytes);
  uint32_t version = 0, index = 0;
  uint64_t n = 0;
  std::memcpy(&version, header + 8, 4);
  std::memcpy(&index, header + 12, 4);
  std::memcpy(&n, header + 16, 8);
  if (!ok || std::memcmp(header, kMagic, 8) != 0 || version != kVersion ||
      index != uint32_t(layer) || n != want.count) {
    ::close(fd);
    return bad("its header is not a pipec layer file of this layer");
  }
  for (std::vector<float> *v : {&out.weights, &out.firstMoment, &out.secondMoment}) {
    v->resize(size_t(n));
    ok = ok && readInto(v->data(), size_t(n) * sizeof(float));
  }
  ::close(fd);
  if (!ok)
    return bad("cannot read all of it");
  if (hex(h) != want.digest)
    return bad(
        fmt::format("its digest is {}, the manifest says {}", hex(h), shortened(want.digest)));
  return llvm::Error::success();
}

std::string describeResume(const Checkpoint &ckpt, const Plan &plan) {
  const CheckpointManifest &m = ckpt.manifest;
  if (m.planHash == planHash(plan))
    return fmt::format("resuming from {}: step {}, saved by this plan", ckpt.path, m.step);
  const ParallelConfig &pc = m.parallel;
  return fmt::format("resuming from {}: step {}, saved under {} pp={} vpp={} tp={} dp={} "
                     "microbatches={} seq-splits={}; its whole tensors resharded for this plan",
                     ckpt.path, m.step, m.schedule, pc.pp, pc.vpp, pc.tp, pc.dp, pc.microbatches,
                     pc.seqSplits);
}

} // namespace pipec
