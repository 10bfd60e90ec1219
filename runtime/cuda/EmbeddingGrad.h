//===- EmbeddingGrad.h - How the embedding backward adds a slice's rows -*- C++ -*-===//
//
// The token embedding's gradient adds every row of a slice into the row of wte its token names.
// So that the sums have the same bits every run (and are the same whatever the tp split),
// the GPU adds each token's rows in row order, with no atomics, in pieces of at most
// kEmbeddingPieceRows rows so that a frequent token (or a padding run) does not leave one thread
// per channel adding thousands of rows: the host sorts the rows by token (stably), cuts each
// token's run into pieces, and a run of several pieces gets a slot of scratch per piece that a
// second kernel adds up in piece order (runtime/cuda/StageKernels.h, embeddingBackward). Host
// code, built with both the GPU and the emulated backends.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_CUDA_EMBEDDINGGRAD_H
#define PIPEC_RUNTIME_CUDA_EMBEDDINGGRAD_H

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace pipec {

inline constexpr int kEmbeddingPieceRows = 128;

/// One slice's plan: `order` lists its rows sorted by token, stably; `pieces` holds 3 ints per
/// piece (begin and end, positions in `order`, and a slot, or -1 when the piece is its token's
/// whole run), in `order`'s order; `merges` 3 per run of several pieces (the token, its first
/// slot, its number of slots; a run's slots are consecutive).
struct EmbeddingGradPlan {
  std::vector<int32_t> order, pieces, merges;
  int slots = 0;
  int numPieces() const { return int(pieces.size() / 3); }
  int numMerges() const { return int(merges.size() / 3); }
};

/// The plan for a slice whose rows have the input tokens `tokens`, over the rows whose token is
/// in [vocabBegin, vocabEnd) (a vocab-parallel rank's rows of wte; the others are omitted).
EmbeddingGradPlan planEmbeddingGrad(std::span<const int32_t> tokens, int32_t vocabBegin = 0,
                                    int32_t vocabEnd = INT32_MAX);

/// The most slots a plan of `rows` rows can use (a run cut into pieces is longer than a piece,
/// so its pieces are fewer than twice its rows over kEmbeddingPieceRows): scratch of this many
/// rows of the embedding's width, the same every step.
inline size_t maxEmbeddingGradSlots(size_t rows) { return 2 * rows / kEmbeddingPieceRows + 1; }

/// The most ints a plan of `rows` rows takes (order, pieces, merges): its capacity in a buffer
/// that holds every step's plans at fixed places.
inline size_t maxEmbeddingGradInts(size_t rows) { return 7 * rows; }

} // namespace pipec

#endif // PIPEC_RUNTIME_CUDA_EMBEDDINGGRAD_H
