//===- TokenDataFuzzer.cpp - piperun --data: .npy, llm.c's .bin and raw token files ------===//
//
// Any bytes, as a file of either raw width, are refused with an error naming the file, or give a
// data source whose sequences (windows at seeded offsets) hold only ids below the vocabulary.
//
//===----------------------------------------------------------------------===//
#include "tests/fuzz/FuzzTarget.h"

#include "runtime/Data.h"

#include <vector>

using namespace pipec;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  constexpr int kVocab = 50257, kSeqLen = 4;
  for (const char *dtype : {"uint16", "uint32"}) {
    auto source = tokenBytesData(fuzz::textOf(data, size), "tokens.npy", dtype, kVocab, kSeqLen,
                                 /*seed=*/size);
    if (!source) {
      fuzz::refused(source.takeError());
      continue;
    }
    for (uint64_t mb = 0; mb < 3; ++mb)
      for (int32_t id : microbatchTokens(**source, mb, 2, kSeqLen))
        FUZZ_CHECK(id >= 0 && id < kVocab, "every id is inside the vocabulary");
  }
  return 0;
}
