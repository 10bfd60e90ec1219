//===- ManifestFuzzer.cpp - A checkpoint's manifest.json (piperun --resume) --------------===//
//
// `piperun --resume D` reads D/step-<n>/manifest.json before any layer file: any text is
// refused or gives a manifest with one entry per layer of its model, which writes back to text
// that parses to the same manifest.
//
//===----------------------------------------------------------------------===//
#include "tests/fuzz/FuzzTarget.h"

#include "ir/formats/CheckpointJson.h"

using namespace pipec;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  auto m = parseCheckpointManifest(fuzz::textOf(data, size), "manifest.json");
  if (!m) {
    fuzz::refused(m.takeError());
    return 0;
  }
  FUZZ_CHECK(m->layers.size() == size_t(m->model.numLayers) + 2, "one entry per layer");
  const std::string text = writeCheckpointManifest(*m);
  auto again = parseCheckpointManifest(text, "again.json");
  if (!again) {
    fuzz::refused(again.takeError());
    FUZZ_CHECK(false, "a manifest's JSON parses back");
  }
  FUZZ_CHECK(writeCheckpointManifest(*again) == text, "a manifest round-trips byte for byte");
  return 0;
}
