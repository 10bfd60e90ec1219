//===- Checkpoint.h - Training state that survives a crash ------*- C++ -*-===//
//
// `piperun --save-dir D [--save-every N]` and `--resume D` (docs/commands.md; docs/reliability.md).
// A checkpoint is a directory D/step-<8 digits> holding
//   layer-<5 digits>.bin  one per model layer (embedding, blocks, head): the layer's weights and
//                         AdamW moments WHOLE, tp shards joined (kernels::unshardLayer), so that
//                         a checkpoint saved under one pp/vpp/tp/schedule resumes under another
//   manifest.json         "pipeckpt/1": the step, the model, the layout it was saved under and
//                         a hash of its plan, the data position and seed (the data and the
//                         initialisation come from counter-based generators, so (seed, next
//                         sequence) is the whole RNG state), and every layer file's size and
//                         64-bit digest.
// Every file is written to a temporary beside its name, fsynced and renamed; the manifest is
// committed last (then the directory is fsynced), so a checkpoint without a manifest is
// incomplete and is ignored. Killing the process at any instant leaves the previous checkpoint
// whole: a save never touches another step's directory, and older checkpoints (past the newest
// --keep K; by default none) are removed only after the new manifest is committed, manifest
// first; a step directory that also holds a file piperun did not write is left whole, so that it
// stays resumable and recognisably piperun's. A write that fails (a full disk) removes the new
// step's directory and names the bytes the checkpoint needs; the committed ones are untouched.
//
// Inside D nothing is reached through a symbolic link (openat/unlinkat with O_NOFOLLOW). A save
// first writes the marker file written-by-piperun into its new step directory; piperun deletes
// only step directories it recognises as its own (a pipeckpt/1 manifest of their step, or the
// marker, or nothing in them), and in them only the files a save names. checkSaveDir refuses a
// step-<n> entry of D that is not piperun's (a link, a file, a directory of other files) before
// a run starts; --resume reads only regular files. Steps run 1 .. kMaxCheckpointStep.
//
// A layer file: the 8 bytes "PIPECKPT", then little-endian u32 version (1), u32 layer, u64 n,
// then three arrays of n float32 (weights, first moment, second moment).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_CHECKPOINT_H
#define PIPEC_RUNTIME_CHECKPOINT_H

#include "ir/Plan.h"
#include "ir/formats/CheckpointJson.h"

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace pipec {

/// One layer's training state, whole (tp = 1 layout).
struct LayerState {
  std::vector<float> weights, firstMoment, secondMoment;
};

/// A 64-bit hex digest of the plan's JSON (stats left out): equal plans hash equal.
std::string planHash(const Plan &plan);

/// Test hook: after setCheckpointKillAt(N) with N > 0, the N-th point of this process's saves
/// (before and after every write, fsync, rename and removal) sends SIGKILL to the process
/// itself, so that a test can stop a save at every instant it has. (piperun sets it from
/// PIPEC_CHECKPOINT_KILL_AT; 0, the default, kills nothing.) Call it before the first save.
void setCheckpointKillAt(long n);
void checkpointKillPoint();

/// What a save reports: the checkpoint's size, and the older step directories --keep would
/// have removed but did not: "D/step-<n>: it holds NAME, which piperun did not write; ..." (left
/// whole) or "D/step-<n>: removing it failed (WHY); ...".
struct SavedCheckpoint {
  uint64_t bytes = 0;
  std::vector<std::string> notRemoved;
};

/// Save the state after `manifest.step` steps into D/step-<step>: `gather(layer, out)` fills one
/// layer's whole state, for every layer of `manifest.model` in order (its error ends the save
/// before the commit); the manifest's layer entries are filled here (where the caller gives
/// every layer's `count` beforehand, a failed write, such as a full disk, says how many bytes
/// the checkpoint needs). A write that fails removes what the save wrote. Once the new
/// checkpoint is committed, keeps the newest `keep` committed checkpoints in `dir` (0: all; a
/// step directory holding anything else is never removed) and fills `out`.
llvm::Error saveCheckpoint(llvm::StringRef dir, CheckpointManifest manifest,
                           const std::function<llvm::Error(int, LayerState &)> &gather,
                           size_t keep = 0, SavedCheckpoint *out = nullptr);

/// What a save does after its commit, alone: keep the newest `keep` committed checkpoints of
/// `dir` (0: all) and remove what killed saves or prunes left there (for a finished job's
/// relaunch, which saves nothing). Returns the step directories that stay, described as
/// SavedCheckpoint::notRemoved.
llvm::Expected<std::vector<std::string>> pruneCheckpoints(llvm::StringRef dir, size_t keep);

/// The directory of the checkpoint after `step` steps in `dir`: dir/step-<8 digits>.
std::string checkpointPath(llvm::StringRef dir, int64_t step);

/// What --save-dir `dir` must be before a run starts: a directory (or a new name in an existing
/// one) without committed checkpoints, unless it is `resumeDir` itself, whose newest step the
/// run continues from.
llvm::Error checkSaveDir(llvm::StringRef dir, llvm::StringRef resumeDir);

/// An exclusive lock (flock) on --save-dir `dir`, held while the returned descriptor stays open
/// (piperun keeps it for its life; the kernel drops it when the process ends, however it ends):
/// taken before the first step, so that two runs never save into one directory. Makes `dir`
/// where it does not exist yet, as the first save would. Another process holding it is an
/// InputError naming the flag.
llvm::Expected<int> lockSaveDir(llvm::StringRef dir);

/// Whether `dir` holds a checkpoint to resume, or something in its place that openCheckpoint
/// must refuse (a link, a foreign directory, a manifest that is not piperun's); false for a
/// missing or empty directory, or one holding only what killed saves left. Anything else named
/// `dir` (a file, a pipe, a device, a link to nothing, a path through a file) is an InputError.
llvm::Expected<bool> holdsCheckpoint(llvm::StringRef dir);

/// A committed checkpoint found by openCheckpoint.
struct Checkpoint {
  std::string path; // D/step-<n>
  CheckpointManifest manifest;
};

/// The newest committed checkpoint in `dir` (its manifest read and checked); an InputError
/// naming `--resume` and the directory when there is none or its manifest is bad.
llvm::Expected<Checkpoint> openCheckpoint(llvm::StringRef dir);

/// An InputError naming the first difference that stops `ckpt` from resuming `plan`: another
/// model (field by field), another global batch (dp · microbatches · microbatch_size), another
/// seed (when `seed` is given) or another data source.
llvm::Error checkResumable(const Checkpoint &ckpt, const Plan &plan, std::optional<uint64_t> seed,
                           llvm::StringRef data);

/// Read layer `layer` of `ckpt`, checking its size, header and digest against the manifest;
/// an InputError naming the file otherwise.
llvm::Error readCheckpointLayer(const Checkpoint &ckpt, int layer, LayerState &out);

/// One line on what a resume does: "resuming from D/step-00000003 (step 3; saved by this
/// plan)" or "(...; saved under pp=2 vpp=1 tp=1 1f1b, resharded for this plan)".
std::string describeResume(const Checkpoint &ckpt, const Plan &plan);

} // namespace pipec

#endif // PIPEC_RUNTIME_CHECKPOINT_H
