//===- CheckpointLayerFuzzer.cpp - A checkpoint's layer file (piperun --resume) ----------===//
//
// `piperun --resume D` reads each D/step-<n>/layer-<5 digits>.bin against its manifest entry
// (runtime/Checkpoint.h gives the format). The input's first byte frames the case: bit 0 gives
// the manifest the file's true digest (so the reader gets past it to the header and the
// arrays), bit 1 the float count the file's size implies (else the count is bytes 1-2 of the
// input), bits 2-3 the layer index the file is read as; the rest is the file. Any file is
// refused with one line naming it, or read whole: three arrays of the manifest's count whose
// bytes are the file's after its 24-byte header, which names the layer read.
//
//===----------------------------------------------------------------------===//
#include "tests/fuzz/FuzzTarget.h"

#include "ir/support/Hash.h"
#include "runtime/Checkpoint.h"

#include <fmt/format.h>

#include <cstring>
#include <filesystem>

using namespace pipec;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 3)
    return 0;
  const uint8_t flags = data[0];
  const llvm::StringRef file(reinterpret_cast<const char *>(data + 1), size - 1);
  constexpr uint64_t kHeader = 24, kLayers = 4;
  const int layer = (flags >> 2) & 3;

  Checkpoint ckpt;
  ckpt.path = fuzz::scratchDir() + "/step-00000001";
  std::filesystem::create_directories(ckpt.path);
  fuzz::writeFile(fmt::format("{}/layer-{:05d}.bin", ckpt.path, layer), file);
  ckpt.manifest.layers.resize(kLayers);
  CheckpointManifest::Layer &want = ckpt.manifest.layers[size_t(layer)];
  want.count = (flags & 2) ? (file.size() >= kHeader ? (file.size() - kHeader) / 12 : 0)
                           : uint64_t(data[1]) | uint64_t(data[2]) << 8;
  want.bytes = kHeader + 12 * want.count;
  want.digest = fmt::format("{:016x}", (flags & 1) ? fnv1a(file.data(), file.size()) : 0);

  LayerState out;
  if (auto err = readCheckpointLayer(ckpt, layer, out)) {
    const std::string message = llvm::toString(std::move(err));
    FUZZ_CHECK(message.find('\n') == std::string::npos, "a refusal is one line");
    FUZZ_CHECK(message.find("layer-") != std::string::npos, "a refusal names the file");
    if (std::getenv("PIPEC_FUZZ_VERBOSE"))
      std::fprintf(stderr, "refused: %s\n", message.c_str());
    return 0;
  }
  FUZZ_CHECK(file.size() == want.bytes, "a file read whole has the manifest's size");
  FUZZ_CHECK(std::memcmp(file.data(), "PIPECKPT", 8) == 0, "a file read has the magic");
  uint32_t index = 0;
  std::memcpy(&index, file.data() + 12, 4);
  FUZZ_CHECK(index == uint32_t(layer), "a file read names the layer it was read as");
  const char *at = file.data() + kHeader;
  for (const std::vector<float> *v : {&out.weights, &out.firstMoment, &out.secondMoment}) {
    FUZZ_CHECK(v->size() == want.count, "each array has the manifest's count");
    FUZZ_CHECK(want.count == 0 || std::memcmp(v->data(), at, 4 * want.count) == 0,
               "the arrays are the file's bytes");
    at += 4 * want.count;
  }
  return 0;
}
