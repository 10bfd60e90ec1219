//===- HfConfigFuzzer.cpp - A Hugging Face config.json (pipec spec --from-hf, --init-from) ===//
//
// Any text given to parseHfConfig is refused with an error, or gives a model that passes its own
// field-by-field check (checkModelAgainstHf, at the context or the sliding window if shorter);
// the model spec written from it
// (hfModelSpecJson, as `pipec spec --from-hf` writes it) is refused with one error or parses
// back (parseModelSpec) to a model that config accepts; and the config.json written for that
// model (hfConfigJson, as `piperun --export-hf` writes it) reads back to a model the first
// config accepts.
//
//===----------------------------------------------------------------------===//
#include "tests/fuzz/FuzzTarget.h"

#include "ir/Model.h"
#include "ir/formats/HfConfig.h"
#include "ir/formats/SpecJson.h"

using namespace pipec;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  auto hf = parseHfConfig(fuzz::textOf(data, size), "config.json");
  if (!hf) {
    fuzz::refused(hf.takeError());
    return 0;
  }
  // Its own model, for the longest sequence its attention computes (Mistral's sliding window
  // may be shorter than its context).
  TransformerConfig own = hf->config;
  if (hf->slidingWindow > 0 && own.seqLength > hf->slidingWindow)
    own.seqLength = hf->slidingWindow;
  if (auto err = checkModelAgainstHf(*hf, own, "config.json")) {
    fuzz::refused(std::move(err));
    FUZZ_CHECK(false, "a config accepts its own model");
  }
  auto spec = hfModelSpecJson(*hf, "fuzz", own.seqLength, 1, "config.json");
  if (!spec) {
    fuzz::refused(spec.takeError());
    return 0;
  }
  auto model = parseModelSpec(*spec, "spec.json");
  if (!model) {
    fuzz::refused(model.takeError()); // the spec reader's own limits (sizes it cannot cost)
    return 0;
  }
  FUZZ_CHECK(model->transformer.has_value(), "the spec is a transformer's");
  if (auto err = checkModelAgainstHf(*hf, *model->transformer, "config.json")) {
    fuzz::refused(std::move(err));
    FUZZ_CHECK(false, "the config accepts the spec written from it");
  }
  auto config = hfConfigJson(*model->transformer);
  if (!config) {
    fuzz::refused(config.takeError());
    return 0;
  }
  auto again = parseHfConfig(*config, "again.json");
  if (!again) {
    fuzz::refused(again.takeError());
    FUZZ_CHECK(false, "a written config.json reads back");
  }
  if (auto err = checkModelAgainstHf(*hf, again->config, "config.json")) {
    fuzz::refused(std::move(err));
    FUZZ_CHECK(false, "the written config.json is the same model");
  }
  return 0;
}
