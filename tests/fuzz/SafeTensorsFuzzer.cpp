//===- SafeTensorsFuzzer.cpp - piperun --init-from FILE: a safetensors file -------------===//
//
// Any bytes, as a .safetensors file, are refused with an error naming the file, or give a header
// whose every tensor reads (whole and its first values) or is refused by name; what GPT-2's or
// Llama's names take from it (gpt2Layers, llamaLayers) is one layer of the kernels' size per
// layer of the tiny models, or an error.
//
//===----------------------------------------------------------------------===//
#include "tests/fuzz/FuzzTarget.h"
#include "tests/fuzz/TinyHfModels.h"

#include "runtime/SafeTensors.h"

using namespace pipec;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  const std::string path = fuzz::scratchDir() + "/model.safetensors";
  fuzz::writeFile(path, fuzz::textOf(data, size));
  auto file = SafeTensorsFile::open(path);
  if (!file) {
    fuzz::refused(file.takeError());
    return 0;
  }
  for (const auto &[name, t] : file->tensors()) {
    FUZZ_CHECK(t.begin <= t.end && t.end <= size, "a tensor lies inside the file");
    auto whole = file->read(name);
    if (!whole) {
      fuzz::refused(whole.takeError());
      continue;
    }
    auto first = file->read(name, 2);
    FUZZ_CHECK(bool(first), "a tensor that reads whole reads its first values");
    FUZZ_CHECK(first->size() == std::min<size_t>(2, whole->size()) &&
                   std::equal(first->begin(), first->end(), whole->begin()),
               "the first values are the whole tensor's");
  }
  static const std::vector<fuzz::TinyModel> models = fuzz::tinyHfModels();
  for (const fuzz::TinyModel &m : models) {
    auto layers = m.cfg.rope ? llamaLayers(*file, m.cfg) : gpt2Layers(*file, m.cfg);
    if (!layers) {
      fuzz::refused(layers.takeError());
      continue;
    }
    fuzz::checkLayers(m.cfg, *layers);
  }
  return 0;
}
