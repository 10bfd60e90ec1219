#include "runtime/Data.h"

#include "ir/Error.h"
#include "ir/Files.h"

#include "llvm/Support/FileSystem.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"

#include <cstring>

namespace pipec {

namespace {

/// SplitMix64: a counter-based generator; the same index always gives the same value.
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

class Synthetic final : public DataSource {
public:
  Synthetic(int vocab, uint64_t seed) : vocab(vocab), seed(seed) {}
  void sequence(uint64_t index, std::span<int32_t> out) const override {
    int64_t t = int64_t(mix(seed * 0x100000001b3ULL ^ index) % uint64_t(vocab));
    for (int32_t &id : out) {
      id = int32_t(t);
      t = (5 * t + 3) % vocab;
    }
  }

private:
  int vocab;
  uint64_t seed;
};

class TokenFile final : public DataSource {
public:
  TokenFile(std::vector<int32_t> tokens, uint64_t seed) : tokens(std::move(tokens)), seed(seed) {}
  void sequence(uint64_t index, std::span<int32_t> out) const override {
    uint64_t windows = tokens.size() - out.size() + 1;
    uint64_t at = mix(seed * 0x100000001b3ULL ^ index) % windows;
    std::copy(tokens.begin() + long(at), tokens.begin() + long(at + out.size()), out.begin());
  }

private:
  std::vector<int32_t> tokens;
  uint64_t seed;
};

} // namespace

std::unique_ptr<DataSource> syntheticData(int vocab, uint64_t seed) {
  return std::make_unique<Synthetic>(vocab, seed);
}

std::string dataSourceName(llvm::StringRef path) {
  uint64_t bytes = 0;
  llvm::sys::fs::file_size(path, bytes);
  return fmt::format("file {} {}", llvm::sys::path::filename(path).str(), bytes);
}

llvm::Expected<std::unique_ptr<DataSource>>
tokenFileData(llvm::StringRef path, llvm::StringRef dtype, int vocab, int seqLen, uint64_t seed) {
  // Sequences are windows at random offsets: the file must be a regular one (not /dev/zero,
  // not a pipe), and its ids (4 bytes each once read) must fit in memory.
  if (llvm::sys::fs::is_directory(path))
    return inputError("--data: {}: cannot read: is a directory", shortened(path, 200));
  if (std::string kind = specialFileKind(path); !kind.empty())
    return inputError("--data: {}: cannot read: is {}, not a token file (give a regular file)",
                      shortened(path, 200), kind);
  uint64_t size = 0;
  if (!llvm::sys::fs::file_size(path, size))
    if (auto err = checkMemoryBudget(size + size / (dtype == "uint32" ? 1 : 2) * 4,
                                     fmt::format("--data: {} ({})", shortened(path, 200),
                                                 humanBytes(size)),
                                     "use a smaller token file"))
      return err;
  auto buf = llvm::MemoryBuffer::getFile(path, /*IsText=*/false);
  if (!buf)
    return inputError("--data: {}: cannot read: {}", path.str(), buf.getError().message());
  llvm::StringRef bytes = (*buf)->getBuffer();
  size_t width = dtype == "uint32" ? 4 : 2;
  size_t offset = 0, count = 0;
  int32_t header[256];
  if (bytes.size() >= sizeof(header)) {
    std::memcpy(header, bytes.data(), sizeof(header));
    if (header[0] == 20240520) { // llm.c's token file
      if (header[1] != 1 && header[1] != 2)
        return inputError("--data: {}: llm.c header version {} (expected 1 or 2)", path.str(),
                          header[1]);
      width = header[1] == 1 ? 2 : 4;
      offset = sizeof(header);
      if (header[2] < 0)
        return inputError("--data: {}: llm.c header gives a negative token count {}", path.str(),
                          header[2]);
      count = size_t(header[2]);
      if (count > (bytes.size() - offset) / width)
        return inputError("--data: {}: header says {} tokens but the file holds {}", path.str(),
                          count, (bytes.size() - offset) / width);
    }
  }
  if (offset == 0) {
    if (bytes.size() % width != 0)
      return inputError("--data: {}: {} bytes is not a whole number of {} ids; try "
                        "--data-dtype {}",
                        path.str(), bytes.size(), dtype.str(), width == 2 ? "uint32" : "uint16");
    count = bytes.size() / width;
  }
  if (count < size_t(seqLen) + 1)
    return inputError("--data: {}: {} tokens, fewer than one sequence of seq_length + 1 = {}",
                      path.str(), count, seqLen + 1);
  std::vector<int32_t> tokens(count);
  const char *p = bytes.data() + offset;
  for (size_t i = 0; i < count; ++i) {
    uint32_t v = 0;
    if (width == 2) {
      uint16_t s;
      std::memcpy(&s, p + 2 * i, 2);
      v = s;
    } else {
      std::memcpy(&v, p + 4 * i, 4);
    }
    if (v >= uint32_t(vocab))
      return inputError("--data: {}: token {} at position {} is outside the model's vocab_size "
                        "{}",
                        path.str(), v, i, vocab);
    tokens[i] = int32_t(v);
  }
  return std::make_unique<TokenFile>(std::move(tokens), seed);
}

std::vector<int32_t> microbatchTokens(const DataSource &data, uint64_t index, int batch,
                                      int seqLen) {
  std::vector<int32_t> out(size_t(batch) * size_t(seqLen + 1));
  for (int b = 0; b < batch; ++b)
    data.sequence(
        index * uint64_t(batch) + uint64_t(b),
        std::span<int32_t>(out).subspan(size_t(b) * size_t(seqLen + 1), size_t(seqLen + 1)));
  return out;
}

} // namespace pipec
