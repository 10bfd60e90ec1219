//===- HfDirectoryFuzzer.cpp - piperun --init-from DIR: a Hugging Face model directory ---===//
//
// The input is a directory, framed as text: sections "=== NAME\n" followed by the file's bytes
// up to the next "\n=== " (NAME a plain file name: config.json, model.safetensors,
// model.safetensors.index.json, a shard's name, ...). The files are written to a directory of
// this process's own, which loadInitialWeights reads for the tiny GPT-2 and Llama models
// (openHfDirectory: config.json checked against the model, the index's weight_map against its
// shards): an error starting "--init-from DIR: ", or one layer of the kernels' size per layer.
//
//===----------------------------------------------------------------------===//
#include "tests/fuzz/FuzzTarget.h"
#include "tests/fuzz/TinyHfModels.h"

#include "runtime/SafeTensors.h"

#include "llvm/ADT/StringExtras.h"

using namespace pipec;

namespace {

bool plainName(llvm::StringRef name) {
  return !name.empty() && name.size() <= 64 && name != "." && name != ".." &&
         llvm::all_of(name,
                      [](char c) { return llvm::isAlnum(c) || c == '.' || c == '_' || c == '-'; });
}

} // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  const std::string &dir = fuzz::scratchDir();
  llvm::StringRef rest = fuzz::textOf(data, size);
  if (!rest.consume_front("=== "))
    return 0;
  for (int files = 0; !rest.empty() && files < 8; ++files) {
    auto [header, body] = rest.split('\n');
    size_t end = body.find("\n=== ");
    rest = end == llvm::StringRef::npos ? llvm::StringRef() : body.drop_front(end + 5);
    body = body.take_front(end);
    if (!plainName(header))
      return 0;
    fuzz::writeFile(dir + "/" + header.str(), body);
  }
  static const std::vector<fuzz::TinyModel> models = fuzz::tinyHfModels();
  for (const fuzz::TinyModel &m : models) {
    auto layers = loadInitialWeights(dir, m.cfg, m.model);
    if (!layers) {
      std::string message = llvm::toString(layers.takeError());
      if (std::getenv("PIPEC_FUZZ_VERBOSE"))
        std::fprintf(stderr, "refused: %s\n", message.c_str());
      FUZZ_CHECK(llvm::StringRef(message).startswith("--init-from " + dir + ": "),
                 "the error names --init-from and the directory");
      FUZZ_CHECK(message.find('\n') == std::string::npos, "the error is one line");
      continue;
    }
    fuzz::checkLayers(m.cfg, *layers);
  }
  return 0;
}
