#include "runtime/Checkpoint.h"

#include "ir/Error.h"
#include "ir/Files.h"
#include "ir/PlanJson.h"

#include "llvm/ADT/SmallString.h"
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
#include <sys/stat.h>
#include <unistd.h>

namespace pipec {

namespace {

constexpr char kMagic[8] = {'P', 'I', 'P', 'E', 'C', 'K', 'P', 'T'};
constexpr uint32_t kVersion = 1;
constexpr size_t kHeaderBytes = 8 + 4 + 4 + 8;
/// How many committed checkpoints a save leaves: the new one and the one before it.
constexpr size_t kKeep = 2;

/// FNV-1a, 64 bits, continued from `h`.
uint64_t fnv(const void *data, size_t n, uint64_t h = 0xcbf29ce484222325ULL) {
  const auto *p = static_cast<const unsigned char *>(data);
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 0x100000001b3ULL;
  }
  return h;
}

std::string hex(uint64_t v) { return fmt::format("{:016x}", v); }

std::string stepName(int64_t step) { return fmt::format("step-{:08d}", step); }
std::string layerName(int layer) { return fmt::format("layer-{:05d}.bin", layer); }

std::string join(llvm::StringRef a, llvm::StringRef b) {
  llvm::SmallString<256> p(a);
  llvm::sys::path::append(p, b);
  return std::string(p);
}

/// fsync a directory so that the names created or removed in it survive a crash.
llvm::Error syncDirectory(const std::string &dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0)
    return inputError("--save-dir: {}: cannot open: {}", dir, std::strerror(errno));
  int rc = ::fsync(fd);
  int code = errno;
  ::close(fd);
  if (rc != 0 && code != EINVAL)
    return inputError("--save-dir: {}: cannot sync: {}", dir, std::strerror(code));
  return llvm::Error::success();
}

/// Write `pieces` to `path` as the rules say: a temporary beside it, each piece written (with a
/// kill point between pieces, so that a test sees partial files), fsync, rename. The digest of
/// the bytes goes to `digest`.
llvm::Error writeDurably(const std::string &path, llvm::ArrayRef<llvm::StringRef> pieces,
                         uint64_t *digest = nullptr) {
  checkpointKillPoint();
  int fd = -1;
  llvm::SmallString<256> tmp;
  if (std::error_code ec = llvm::sys::fs::createUniqueFile(path + ".tmp-%%%%%%", fd, tmp))
    return inputError("--save-dir: {}: cannot write: {}", path, ec.message());
  uint64_t h = 0xcbf29ce484222325ULL;
  int failed = 0;
  for (llvm::StringRef piece : pieces) {
    checkpointKillPoint();
    const char *p = piece.data();
    size_t left = piece.size();
    while (left > 0 && !failed) {
      ssize_t n = ::write(fd, p, std::min<size_t>(left, size_t(1) << 30));
      if (n < 0 && errno == EINTR)
        continue;
      if (n <= 0) {
        failed = n < 0 ? errno : EIO;
        break;
      }
      h = fnv(p, size_t(n), h);
      p += n;
      left -= size_t(n);
    }
    if (failed)
      break;
  }
  checkpointKillPoint();
  if (!failed && ::fsync(fd) != 0 && errno != EINVAL)
    failed = errno;
  if (::close(fd) != 0 && !failed && errno != EINTR)
    failed = errno;
  if (failed) {
    llvm::sys::fs::remove(tmp);
    return inputError("--save-dir: {}: cannot write: {}", path, std::strerror(failed));
  }
  checkpointKillPoint();
  if (std::error_code ec = llvm::sys::fs::rename(tmp, path)) {
    llvm::sys::fs::remove(tmp);
    return inputError("--save-dir: {}: cannot write: {}", path, ec.message());
  }
  checkpointKillPoint();
  if (digest)
    *digest = h;
  return llvm::Error::success();
}

/// The entries of a directory (names only, no "." or ".."), sorted.
std::vector<std::string> listDirectory(const std::string &dir) {
  std::vector<std::string> names;
  DIR *d = ::opendir(dir.c_str());
  if (!d)
    return names;
  while (struct dirent *e = ::readdir(d)) {
    llvm::StringRef name(e->d_name);
    if (name != "." && name != "..")
      names.push_back(name.str());
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

/// step-<digits> directories of `dir`, by step: whether each holds a manifest (is committed).
std::map<int64_t, bool> stepDirectories(const std::string &dir) {
  std::map<int64_t, bool> steps;
  for (const std::string &name : listDirectory(dir)) {
    llvm::StringRef digits(name);
    int64_t step = 0;
    if (!digits.consume_front("step-") || digits.size() != 8 || digits.getAsInteger(10, step))
      continue;
    const std::string path = join(dir, name);
    if (!llvm::sys::fs::is_directory(path))
      continue;
    steps[step] = llvm::sys::fs::exists(join(path, "manifest.json"));
  }
  return steps;
}

/// Remove a checkpoint directory: its manifest first (from then on it is incomplete and never
/// resumed), then everything else.
void removeCheckpointDirectory(const std::string &path) {
  const std::string manifest = join(path, "manifest.json");
  if (llvm::sys::fs::exists(manifest)) {
    checkpointKillPoint();
    llvm::sys::fs::remove(manifest);
    llvm::consumeError(syncDirectory(path));
  }
  for (const std::string &name : listDirectory(path)) {
    checkpointKillPoint();
    llvm::sys::fs::remove(join(path, name));
  }
  checkpointKillPoint();
  llvm::sys::fs::remove(path);
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
  return hex(fnv(json.data(), json.size()));
}

void checkpointKillPoint() {
  static const long target = [] {
    const char *v = std::getenv("PIPEC_CHECKPOINT_KILL_AT");
    return v ? std::atol(v) : 0L;
  }();
  static std::atomic<long> count{0};
  if (target > 0 && count.fetch_add(1) + 1 == target)
    ::kill(::getpid(), SIGKILL);
}

llvm::Error checkSaveDir(llvm::StringRef dir, llvm::StringRef resumeDir) {
  if (dir.empty())
    return inputError("--save-dir: expected a directory, got an empty path");
  struct stat st;
  if (::stat(dir.str().c_str(), &st) != 0) {
    llvm::StringRef parent = llvm::sys::path::parent_path(dir);
    if (!parent.empty() && !llvm::sys::fs::is_directory(parent))
      return inputError("--save-dir: {}: no directory {} to create it in", shortened(dir, 200),
                        shortened(parent, 200));
    return llvm::Error::success();
  }
  if (!S_ISDIR(st.st_mode))
    return inputError("--save-dir: {}: is {}, not a directory", shortened(dir, 200),
                      specialFileKind(dir).empty() ? std::string("a file") : specialFileKind(dir));
  if (!resumeDir.empty() && sameDirectory(dir, resumeDir))
    return llvm::Error::success();
  std::map<int64_t, bool> steps = stepDirectories(dir.str());
  for (auto it = steps.rbegin(); it != steps.rend(); ++it)
    if (auto [step, committed] = *it; committed)
      return inputError("--save-dir: {} already holds checkpoints (step {}); continue them "
                        "with --resume {}, or give an empty or new --save-dir",
                        shortened(dir, 200), step, shortened(dir, 200));
  return llvm::Error::success();
}

bool holdsCheckpoint(llvm::StringRef dir) {
  for (auto [step, committed] : stepDirectories(dir.str()))
    if (committed)
      return true;
  return false;
}

std::string checkpointPath(llvm::StringRef dir, int64_t step) { return join(dir, stepName(step)); }

llvm::Error saveCheckpoint(llvm::StringRef dirRef, CheckpointManifest manifest,
                           const std::function<llvm::Error(int, LayerState &)> &gather) {
  const std::string dir = dirRef.str();
  if (!llvm::sys::fs::is_directory(dir)) {
    if (std::error_code ec = llvm::sys::fs::create_directory(dir))
      return inputError("--save-dir: {}: cannot create: {}", dir, ec.message());
    if (auto err = syncDirectory(
            std::string(llvm::sys::path::parent_path(dir).empty()
                            ? llvm::StringRef(".")
                            : llvm::sys::path::parent_path(dir))))
      return err;
  }
  const std::string stepDir = join(dir, stepName(manifest.step));
  // What a save killed before its commit left of this step: never resumed, start again.
  if (llvm::sys::fs::is_directory(stepDir)) {
    if (llvm::sys::fs::exists(join(stepDir, "manifest.json")))
      return inputError("--save-dir: {} already holds a checkpoint of step {}", dir,
                        manifest.step);
    removeCheckpointDirectory(stepDir);
  }
  checkpointKillPoint();
  if (std::error_code ec = llvm::sys::fs::create_directory(stepDir))
    return inputError("--save-dir: {}: cannot create: {}", stepDir, ec.message());
  if (auto err = syncDirectory(dir))
    return err;
  const int numLayers = int(manifest.model.numLayers) + 2;
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
    if (auto err = writeDurably(join(stepDir, layerName(l)),
                                {llvm::StringRef(header, kHeaderBytes), bytesOf(state.weights),
                                 bytesOf(state.firstMoment), bytesOf(state.secondMoment)},
                                &digest))
      return err;
    manifest.layers[size_t(l)] = {kHeaderBytes + 3 * n * sizeof(float), n, hex(digest)};
  }
  if (auto err = syncDirectory(stepDir))
    return err;
  // The commit: from the manifest's rename on, this checkpoint is whole.
  if (auto err = writeDurably(join(stepDir, "manifest.json"), {writeCheckpointManifest(manifest)}))
    return err;
  if (auto err = syncDirectory(stepDir))
    return err;
  if (auto err = syncDirectory(dir))
    return err;
  // Older checkpoints past the newest kKeep, and what killed saves left behind.
  std::map<int64_t, bool> steps = stepDirectories(dir);
  size_t newer = 0;
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    if (it->second && newer < kKeep) {
      ++newer;
      continue;
    }
    removeCheckpointDirectory(join(dir, stepName(it->first)));
  }
  return syncDirectory(dir);
}

llvm::Expected<Checkpoint> openCheckpoint(llvm::StringRef dirRef) {
  const std::string dir = dirRef.str();
  if (!llvm::sys::fs::is_directory(dir))
    return inputError("--resume: {}: {}", shortened(dir, 200),
                      llvm::sys::fs::exists(dir) ? "is not a directory"
                                                 : "no such directory");
  std::map<int64_t, bool> steps = stepDirectories(dir);
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    if (!it->second)
      continue; // incomplete: a save that did not finish
    Checkpoint c;
    c.path = join(dir, stepName(it->first));
    const std::string manifestPath = join(c.path, "manifest.json");
    auto text = readFile(manifestPath, kAnyInput);
    if (!text)
      return inputError("--resume: {}", takeMessage(text.takeError()));
    auto manifest = parseCheckpointManifest(*text, manifestPath);
    if (!manifest)
      return inputError("--resume: {}", takeMessage(manifest.takeError()));
    if (manifest->step != it->first)
      return inputError("--resume: {}: $.step: expected {} (the directory's step), got {}",
                        manifestPath, it->first, manifest->step);
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
    return inputError("--resume: {} is of another model: its {} is {}, the plan's is {}",
                      ckpt.path, diff->field, shortened(diff->a), shortened(diff->b));
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
  if (data != m.data)
    return inputError("--resume: {} was trained on {}, this run reads {}; give the same --data",
                      ckpt.path, shortened(m.data, 200), shortened(data, 200));
  return llvm::Error::success();
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
    return bad(fmt::format("the manifest gives {} bytes for {} floats per array", want.bytes,
                           want.count));
  struct stat st;
  if (::stat(path.c_str(), &st) != 0)
    return bad(std::strerror(errno));
  if (!S_ISREG(st.st_mode))
    return bad(fmt::format("is {}, not a file", specialFileKind(path)));
  if (uint64_t(st.st_size) != want.bytes)
    return bad(fmt::format("{} bytes, the manifest says {}", uint64_t(st.st_size), want.bytes));
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return bad(std::strerror(errno));
  uint64_t h = 0xcbf29ce484222325ULL;
  auto readInto = [&](void *dst, size_t n) -> bool {
    char *p = static_cast<char *>(dst);
    while (n > 0) {
      ssize_t got = ::read(fd, p, std::min<size_t>(n, size_t(1) << 30));
      if (got < 0 && errno == EINTR)
        continue;
      if (got <= 0)
        return false;
      h = fnv(p, size_t(got), h);
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
    return bad(fmt::format("its digest is {}, the manifest says {}", hex(h),
                           shortened(want.digest)));
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
