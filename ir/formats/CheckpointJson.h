//===- CheckpointJson.h - A checkpoint's manifest (pipeckpt/1) --*- C++ -*-===//
//
// The manifest.json of a checkpoint directory (runtime/Checkpoint.h has the directory and the
// layer files): what was saved, by which run, and how to check every layer file.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_IR_FORMATS_CHECKPOINTJSON_H
#define PIPEC_IR_FORMATS_CHECKPOINTJSON_H

#include "ir/Plan.h"

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace pipec {

/// The last step a checkpoint can record: its directory is named step-<8 digits>, and AdamW's
/// step counter (an int) must have room for the next step. A manifest beyond it is refused, and
/// so is a save after it.
inline constexpr int64_t kMaxCheckpointStep = 99'999'999;

struct CheckpointManifest {
  int64_t step = 0;      // optimizer steps taken: the index of the next step
  int64_t adamSteps = 0; // AdamW's step counter (its bias correction)
  uint64_t seed = 1;     // piperun --seed: of the data stream and the initialisation
  /// Sequences of the data stream consumed: step · dp · microbatches · microbatch_size. With
  /// the seed it is the whole RNG state: data and weights come from counter-based generators.
  uint64_t sequences = 0;
  /// "synthetic", or "file <name> <bytes> <digest>" for --data (runtime/Data.h dataSourceName).
  std::string data = "synthetic";
  /// piperun --lr: AdamW's learning rate the run trained with (a resume without --lr goes on
  /// with it). Absent from manifests written before it was recorded.
  std::optional<float> lr;
  std::string modelName;
  TransformerConfig model;
  // The layout it was saved under (any layout of the same model and global batch resumes it)
  // and the hash of that plan.
  std::string schedule;
  ParallelConfig parallel;
  std::string planHash;
  /// One entry per model layer, in order: its file's bytes, 64-bit digest (FNV-1a, hex) and
  /// floats per array. The file name follows from the index (layer-<5 digits>.bin).
  struct Layer {
    uint64_t bytes = 0, count = 0;
    std::string digest;
  };
  std::vector<Layer> layers;
};

std::string writeCheckpointManifest(const CheckpointManifest &m);

/// The first field of the model spec's "transformer" object in which `a` and `b` differ, with
/// both values as JSON text; nullopt when they describe the same model. "dtype" is left out:
/// a checkpoint holds fp32 state, which resumes in any compute type.
struct FieldDifference {
  std::string field, a, b;
};
std::optional<FieldDifference> firstModelDifference(const TransformerConfig &a,
                                                    const TransformerConfig &b);
/// Parse and check a manifest: every field present and in range, one layer entry per layer of
/// the model. Errors name `source` and the JSON path.
llvm::Expected<CheckpointManifest> parseCheckpointManifest(llvm::StringRef text,
                                                           llvm::StringRef source);

} // namespace pipec

#endif // PIPEC_IR_FORMATS_CHECKPOINTJSON_H
