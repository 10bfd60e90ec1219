//===- Data.h - Training data for the CPU runtime ---------------*- C++ -*-===//
//
// Sequence i of a step is a pure function of (source, seed, i), so every schedule, every
// replica and the single-rank reference see the same tokens.
//  - synthetic: a learnable stream: a random first token, then next = (5·t + 3) mod vocab;
//  - token file: a flat binary of token ids as llm.c and Megatron's tools write them: llm.c's
//    .bin (a 256 x int32 header with magic 20240520; version 1 = uint16, 2 = uint32), or raw
//    uint16 / uint32 ids, or a NumPy .npy array of integer ids (any integer dtype and shape, C
//    order, flattened); sequences are windows at seeded offsets.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_DATA_H
#define PIPEC_RUNTIME_DATA_H

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"
#include "llvm/Support/MemoryBuffer.h"

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace pipec {

class DataSource {
public:
  virtual ~DataSource() = default;
  /// Fill `out` (seqLen + 1 ids) with sequence `index`.
  virtual void sequence(uint64_t index, std::span<int32_t> out) const = 0;
};

std::unique_ptr<DataSource> syntheticData(int vocab, uint64_t seed);
/// `dtype` is "uint16" or "uint32" for raw files (llm.c and NumPy headers say it themselves). Every
/// id must be below `vocab`; the error names the file and the first offending position.
llvm::Expected<std::unique_ptr<DataSource>>
tokenFileData(llvm::StringRef path, llvm::StringRef dtype, int vocab, int seqLen, uint64_t seed);

/// The same from the file's bytes, already read (`path` names it in errors).
llvm::Expected<std::unique_ptr<DataSource>> tokenBytesData(llvm::StringRef bytes,
                                                           llvm::StringRef path,
                                                           llvm::StringRef dtype, int vocab,
                                                           int seqLen, uint64_t seed);

/// The token file's bytes, read whole after the checks tokenFileData makes (a regular file
/// that fits the memory budget).
llvm::Expected<std::unique_ptr<llvm::MemoryBuffer>> readTokenFile(llvm::StringRef path,
                                                                  llvm::StringRef dtype);

/// How a checkpoint records a token file: "file <name> <size> <digest>" (its name without the
/// directory, its size in bytes and the FNV-1a digest of its bytes, 16 hex digits).
std::string dataSourceName(llvm::StringRef path, llvm::StringRef bytes);

/// An InputError unless a run reading `reads` continues the data a checkpoint (`where`) was
/// trained on, `saved` ("synthetic", or dataSourceName's): the same bytes, whatever the file is
/// called now (a manifest without a digest: the same name and size).
llvm::Error checkSameData(llvm::StringRef saved, llvm::StringRef reads, llvm::StringRef where);

/// The `batch` sequences of microbatch `index` (global), each seqLen + 1 ids, back to back.
std::vector<int32_t> microbatchTokens(const DataSource &data, uint64_t index, int batch,
                                      int seqLen);

} // namespace pipec

#endif // PIPEC_RUNTIME_DATA_H
