#include "runtime/Data.h"

#include "ir/support/Bytes.h"
#include "ir/support/Error.h"
#include "ir/support/Files.h"
#include "ir/support/Hash.h"
#include "ir/support/Memory.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/SmallVector.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"

#include <cstring>
#include <optional>

namespace pipec {

namespace {

/// SplitMix64: a counter-based generator; the same index always gives the same value.
uint64_t mix(uint64_t x) { return splitMix64(x); }

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

/// Where a token file's ids lie: `count` ids of `width` bytes (little-endian, signed or not)
/// from byte `offset`.
struct TokenLayout {
  size_t width;
  bool isSigned;
  size_t offset, count;
};

int64_t readId(const char *p, size_t width, bool isSigned) {
  uint64_t u = 0;
  std::memcpy(&u, p, width); // little-endian hosts only, as the rest of the runtime
  if (isSigned && width < 8 && (u >> (8 * width - 1)) & 1)
    u |= ~uint64_t(0) << (8 * width); // sign-extend
  return int64_t(u);
}

/// llm.c's token file: a 256 x int32 header, magic 20240520, version 1 (uint16 ids) or 2
/// (uint32), then the token count. None when `bytes` has no such header.
std::optional<llvm::Expected<TokenLayout>> llmcLayout(llvm::StringRef path, llvm::StringRef bytes) {
  int32_t header[256];
  if (bytes.size() < sizeof(header))
    return std::nullopt;
  std::memcpy(header, bytes.data(), sizeof(header));
  if (header[0] != 20240520)
    return std::nullopt;
  if (header[1] != 1 && header[1] != 2)
    return inputError("--data: {}: llm.c header version {} (expected 1 or 2)", path.str(),
                      header[1]);
  if (header[2] < 0)
    return inputError("--data: {}: llm.c header gives a negative token count {}", path.str(),
                      header[2]);
  TokenLayout layout{header[1] == 1 ? 2u : 4u, false, sizeof(header), size_t(header[2])};
  if (layout.count > (bytes.size() - layout.offset) / layout.width)
    return inputError("--data: {}: header says {} tokens but the file holds {}", path.str(),
                      layout.count, (bytes.size() - layout.offset) / layout.width);
  return layout;
}

constexpr llvm::StringLiteral kNpyMagic("\x93NUMPY");

/// The value of `key` in a NumPy header, a Python dict literal such as
/// {'descr': '<u2', 'fortran_order': False, 'shape': (1000,), }: the text after "'key':" up to
/// the closing quote (strings), parenthesis (tuples) or the next comma. Empty when absent.
llvm::StringRef npyField(llvm::StringRef header, llvm::StringRef key) {
  size_t at = header.find(("'" + key + "'").str());
  if (at == llvm::StringRef::npos)
    return {};
  llvm::StringRef rest = header.drop_front(at + key.size() + 2).ltrim();
  if (!rest.consume_front(":"))
    return {};
  rest = rest.ltrim();
  if (rest.startswith("'"))
    return rest.drop_front().take_until([](char c) { return c == '\''; });
  if (rest.startswith("("))
    return rest.drop_front().take_until([](char c) { return c == ')'; });
  return rest.take_until([](char c) { return c == ',' || c == '}'; }).rtrim();
}

/// A NumPy .npy file (format versions 1 to 3) of integer token ids in C order, any shape
/// (flattened row by row): the header says the dtype, the order and the shape.
llvm::Expected<TokenLayout> npyLayout(llvm::StringRef path, llvm::StringRef bytes) {
  std::string where = fmt::format("--data: {}: NumPy file", shortened(path, 200));
  if (bytes.size() < 10)
    return inputError("{}: truncated header", where);
  uint8_t major = uint8_t(bytes[6]);
  size_t lengthBytes = major == 1 ? 2 : 4;
  if (major < 1 || major > 3)
    return inputError("{}: format version {} (expected 1, 2 or 3)", where, major);
  if (bytes.size() < 8 + lengthBytes)
    return inputError("{}: truncated header", where);
  uint32_t length = 0;
  std::memcpy(&length, bytes.data() + 8, lengthBytes);
  size_t offset = 8 + lengthBytes + length;
  if (offset > bytes.size())
    return inputError("{}: header of {} bytes runs past the end of the file", where, length);
  llvm::StringRef header = bytes.slice(8 + lengthBytes, offset);
  llvm::StringRef descr = npyField(header, "descr");
  // '<' little-endian, '|' byte-sized (no order), then i (signed) or u and the width.
  static const struct {
    llvm::StringLiteral name;
    size_t width;
    bool isSigned;
  } kTypes[] = {{"|u1", 1, false}, {"|i1", 1, true}, {"<u2", 2, false}, {"<i2", 2, true},
                {"<u4", 4, false}, {"<i4", 4, true}, {"<u8", 8, false}, {"<i8", 8, true}};
  const auto *type = llvm::find_if(kTypes, [&](const auto &t) { return t.name == descr; });
  if (type == std::end(kTypes))
    return inputError("{}: dtype '{}' is not one of token ids (little-endian integers: uint8, "
                      "uint16, uint32, uint64, int8 ... int64); save with "
                      "numpy.asarray(ids, dtype=numpy.uint32)",
                      where, shortened(descr, 20));
  if (npyField(header, "fortran_order") != "False")
    return inputError("{}: fortran_order {} (expected False: save a C-ordered array)", where,
                      shortened(npyField(header, "fortran_order"), 20));
  if (!header.contains("'shape'"))
    return inputError("{}: header has no shape", where);
  uint64_t count = 1;
  llvm::SmallVector<llvm::StringRef, 4> dims;
  npyField(header, "shape").split(dims, ',', -1, /*KeepEmpty=*/false);
  for (llvm::StringRef dim : dims) {
    uint64_t n = 0;
    if (dim.trim().getAsInteger(10, n))
      return inputError("{}: shape ({}) is not a tuple of sizes", where,
                        shortened(npyField(header, "shape"), 40));
    if (n != 0 && count > (uint64_t(1) << 62) / n)
      return inputError("{}: shape ({}) is too large", where,
                        shortened(npyField(header, "shape"), 40));
    count *= n;
  }
  if (count != (bytes.size() - offset) / type->width || (bytes.size() - offset) % type->width)
    return inputError("{}: shape ({}) needs {} bytes of data but the file has {}", where,
                      shortened(npyField(header, "shape"), 40), count * type->width,
                      bytes.size() - offset);
  return TokenLayout{type->width, type->isSigned, offset, size_t(count)};
}
} // namespace

std::unique_ptr<DataSource> syntheticData(int vocab, uint64_t seed) {
  return std::make_unique<Synthetic>(vocab, seed);
}

std::string dataSourceName(llvm::StringRef path, llvm::StringRef bytes) {
  return fmt::format("file {} {} {:016x}", llvm::sys::path::filename(path).str(), bytes.size(),
                     fnv1a(bytes));
}

llvm::Error checkSameData(llvm::StringRef saved, llvm::StringRef reads, llvm::StringRef where) {
  if (saved == reads)
    return llvm::Error::success();
  // "file <name> <bytes> <digest>": the same bytes under another name or directory are the
  // same data (a shard moved to a faster disk); a manifest written before the digest was
  // recorded ("file <name> <bytes>") is compared by name and size.
  llvm::SmallVector<llvm::StringRef, 4> a, b;
  saved.split(a, ' ');
  reads.split(b, ' ');
  if (a.size() == 4 && b.size() == 4 && a[0] == "file" && b[0] == "file" && a[2] == b[2] &&
      a[3] == b[3])
    return llvm::Error::success();
  if (a.size() == 3 && b.size() == 4 && a[0] == "file" && b[0] == "file" && a[1] == b[1] &&
      a[2] == b[2])
    return llvm::Error::success();
  auto describe = [](llvm::ArrayRef<llvm::StringRef> f) {
    if (f.size() == 1 && f[0] == "synthetic")
      return std::string("synthetic tokens (no --data)");
    if (f.size() < 3 || f[0] != "file")
      return shortened(llvm::join(f, " "), 200);
    return fmt::format("the token file {} ({} bytes{})", shortened(f[1], 200), f[2],
                       f.size() == 4 ? fmt::format(", digest {}", f[3]) : std::string());
  };
  const bool sameSize =
      a.size() >= 3 && b.size() >= 3 && a[0] == "file" && b[0] == "file" && a[2] == b[2];
  return inputError("--resume: {} was trained on {}, this run reads {}{}; give the same --data",
                    where.str(), describe(a), describe(b),
                    sameSize && a.size() == 4 ? " (the same size, other bytes)" : "");
}

llvm::Expected<std::unique_ptr<llvm::MemoryBuffer>> readTokenFile(llvm::StringRef path,
                                                                  llvm::StringRef dtype) {
  // Sequences are windows at random offsets: the file must be a regular one (not /dev/zero,
  // not a pipe), and its ids (4 bytes each once read) must fit in memory.
  if (llvm::sys::fs::is_directory(path))
    return inputError("--data: {}: cannot read: is a directory", shortened(path, 200));
  if (std::string kind = specialFileKind(path); !kind.empty())
    return inputError("--data: {}: cannot read: is {}, not a token file (give a regular file)",
                      shortened(path, 200), kind);
  uint64_t size = 0;
  if (!llvm::sys::fs::file_size(path, size))
    if (auto err = checkMemoryBudget(
            size + size / (dtype == "uint32" ? 1 : 2) * 4,
            fmt::format("--data: {} ({})", shortened(path, 200), humanBytes(size)),
            "use a smaller token file"))
      return err;
  auto buf = llvm::MemoryBuffer::getFile(path, /*IsText=*/false);
  if (!buf)
    return inputError("--data: {}: cannot read: {}", path.str(), buf.getError().message());
  return std::move(*buf);
}

llvm::Expected<std::unique_ptr<DataSource>>
tokenFileData(llvm::StringRef path, llvm::StringRef dtype, int vocab, int seqLen, uint64_t seed) {
  auto buf = readTokenFile(path, dtype);
  if (!buf)
    return buf.takeError();
  return tokenBytesData((*buf)->getBuffer(), path, dtype, vocab, seqLen, seed);
}

llvm::Expected<std::unique_ptr<DataSource>> tokenBytesData(llvm::StringRef bytes,
                                                           llvm::StringRef path,
                                                           llvm::StringRef dtype, int vocab,
                                                           int seqLen, uint64_t seed) {
  TokenLayout layout{dtype == "uint32" ? 4u : 2u, false, 0, 0};
  if (bytes.startswith(kNpyMagic)) {
    auto npy = npyLayout(path, bytes);
    if (!npy)
      return npy.takeError();
    layout = *npy;
  } else if (auto llmc = llmcLayout(path, bytes)) {
    if (!*llmc)
      return llmc->takeError();
    layout = **llmc;
  } else {
    if (bytes.size() % layout.width != 0)
      return inputError("--data: {}: {} bytes is not a whole number of {} ids; try "
                        "--data-dtype {}",
                        path.str(), bytes.size(), dtype.str(),
                        layout.width == 2 ? "uint32" : "uint16");
    layout.count = bytes.size() / layout.width;
  }
  if (layout.count < size_t(seqLen) + 1)
    return inputError("--data: {}: {} tokens, fewer than one sequence of seq_length + 1 = {}",
                      path.str(), layout.count, seqLen + 1);
  std::vector<int32_t> tokens(layout.count);
  const char *p = bytes.data() + layout.offset;
  for (size_t i = 0; i < layout.count; ++i) {
    int64_t v = readId(p + layout.width * i, layout.width, layout.isSigned);
    if (v < 0 || v >= int64_t(vocab))
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
