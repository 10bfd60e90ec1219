//===- JsonScan.h - A fast scanner for the JSON that pipec writes ------*- C++ -*-===//
//
// Plan files are large (a 1f1b plan at p=64, m=1,024 is 38 MB of small instruction objects)
// and nlohmann's lexer reads them at about 70 MB/s: five times the cost of compiling the plan.
// scanJson produces the same SAX events as nlohmann::json::sax_parse (the same handler
// interface, called in the same order with the same values) for the JSON a writer like
// pipec's produces: ASCII or valid UTF-8 strings with the short escapes, integers that fit
// 64 bits, finite floats. For anything else, including every syntax error, it stops and says
// Unsupported, and the caller parses the text again with nlohmann, whose messages and
// positions are the ones users see. A handler may also offer `tryObject(input)` to decode an
// object straight from the text (the plan reader's instructions); it returns false, consuming
// nothing, for an object it leaves to the events.
//
// tests/JsonScanTest.cpp checks the events against nlohmann's on written and mutated texts;
// the plan fuzzer reads every input both ways and requires the same plan or the same error.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_IR_FORMATS_JSONSCAN_H
#define PIPEC_IR_FORMATS_JSONSCAN_H

#include <cmath>
#include <concepts>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <string>
#include <vector>

namespace pipec::json {

enum class ScanResult {
  Done,       ///< one whole value, then only whitespace: every event delivered
  Stopped,    ///< the handler returned false
  Unsupported ///< not scanned here (a syntax error, a \u escape, a 20-digit number...)
};

/// nlohmann's lexer takes a NUL byte for the end of its input, so that a document followed by
/// a NUL and anything at all would parse as the document alone. Every reader hands nlohmann its
/// characters through this iterator, which shows a NUL as 0x01: a control character that no
/// JSON text holds outside a string (nor unescaped inside one), so the parse fails at the NUL's
/// position, as it does for any other stray byte.
template <typename It> struct NulVisible {
  using iterator_category = std::input_iterator_tag;
  using value_type = char;
  using difference_type = std::ptrdiff_t;
  using pointer = const char *;
  using reference = char;
  It it;
  char operator*() const {
    char c = *it;
    return c == '\0' ? '\x01' : c;
  }
  NulVisible &operator++() {
    ++it;
    return *this;
  }
  bool operator==(const NulVisible &o) const { return it == o.it; }
  bool operator!=(const NulVisible &o) const { return !(it == o.it); }
};
template <typename It> NulVisible(It) -> NulVisible<It>;

/// A text held in memory.
struct TextInput {
  const char *p, *end;
  TextInput(const char *begin, const char *end) : p(begin), end(end) {}
  /// Make `n` bytes from p available where the input has them.
  void need(size_t) {}
  /// At p == end: read on; false at the end of the input.
  bool more() { return false; }
};

/// A file read in blocks; the unread rest of a block moves to the front before a refill.
class FileInput {
public:
  const char *p = nullptr, *end = nullptr;
  /// `block` bytes per read, at least kMinBlock: need(n) asks for at most a quarter of that.
  static constexpr size_t kMinBlock = 4096;
  explicit FileInput(std::FILE *file, size_t block = size_t(1) << 18)
      : file(file), buffer(block < kMinBlock ? kMinBlock : block) {}
  void need(size_t n) {
    while (size_t(end - p) < n && !eof)
      fill();
  }
  bool more() {
    need(1);
    return p < end;
  }

private:
  std::FILE *file;
  std::vector<char> buffer;
  bool eof = false;
  void fill() {
    size_t keep = size_t(end - p);
    if (keep)
      std::memmove(buffer.data(), p, keep);
    size_t got = std::fread(buffer.data() + keep, 1, buffer.size() - keep, file);
    if (got == 0)
      eof = true; // the end, or a read error: either way no more text
    p = buffer.data();
    end = p + keep + got;
  }
};

namespace detail {

inline bool isSpace(char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; }

template <typename Input> bool skipSpace(Input &in) {
  for (;;) {
    while (in.p < in.end && isSpace(*in.p))
      ++in.p;
    if (in.p < in.end)
      return true;
    if (!in.more())
      return false;
  }
}

/// Length of the valid UTF-8 sequence at p (lead byte >= 0x80), 0 if it is not one; the
/// rules nlohmann's lexer applies (RFC 3629: no overlong forms, no surrogates, <= U+10FFFF).
inline size_t utf8Length(const unsigned char *p, const unsigned char *end) {
  auto in = [&](size_t i, unsigned lo, unsigned hi) {
    return p + i < end && p[i] >= lo && p[i] <= hi;
  };
  unsigned c = p[0];
  if (c >= 0xC2 && c <= 0xDF)
    return in(1, 0x80, 0xBF) ? 2 : 0;
  if (c == 0xE0)
    return in(1, 0xA0, 0xBF) && in(2, 0x80, 0xBF) ? 3 : 0;
  if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF)
    return in(1, 0x80, 0xBF) && in(2, 0x80, 0xBF) ? 3 : 0;
  if (c == 0xED)
    return in(1, 0x80, 0x9F) && in(2, 0x80, 0xBF) ? 3 : 0;
  if (c == 0xF0)
    return in(1, 0x90, 0xBF) && in(2, 0x80, 0xBF) && in(3, 0x80, 0xBF) ? 4 : 0;
  if (c >= 0xF1 && c <= 0xF3)
    return in(1, 0x80, 0xBF) && in(2, 0x80, 0xBF) && in(3, 0x80, 0xBF) ? 4 : 0;
  if (c == 0xF4)
    return in(1, 0x80, 0x8F) && in(2, 0x80, 0xBF) && in(3, 0x80, 0xBF) ? 4 : 0;
  return 0;
}

/// The string whose opening quote is at p, into `out`; p ends past the closing quote.
template <typename Input> bool scanString(Input &in, std::string &out) {
  out.clear();
  ++in.p;
  for (;;) {
    const char *start = in.p;
    while (in.p < in.end) {
      unsigned char c = static_cast<unsigned char>(*in.p);
      if (c == '"' || c == '\\' || c < 0x20 || c >= 0x80)
        break;
      ++in.p;
    }
    out.append(start, in.p);
    if (in.p == in.end) {
      if (!in.more())
        return false;
      continue;
    }
    unsigned char c = static_cast<unsigned char>(*in.p);
    if (c == '"') {
      ++in.p;
      return true;
    }
    if (c < 0x20)
      return false; // a control character: nlohmann's error
    if (c >= 0x80) {
      in.need(4);
      size_t n = utf8Length(reinterpret_cast<const unsigned char *>(in.p),
                            reinterpret_cast<const unsigned char *>(in.end));
      if (n == 0)
        return false;
      out.append(in.p, n);
      in.p += n;
      continue;
    }
    in.need(2);
    if (in.end - in.p < 2)
      return false;
    char e = in.p[1];
    char decoded;
    switch (e) {
    case '"':
    case '\\':
    case '/':
      decoded = e;
      break;
    case 'b':
      decoded = '\b';
      break;
    case 'f':
      decoded = '\f';
      break;
    case 'n':
      decoded = '\n';
      break;
    case 'r':
      decoded = '\r';
      break;
    case 't':
      decoded = '\t';
      break;
    default:
      return false; // \u (surrogates and all) and the invalid ones: nlohmann's
    }
    out.push_back(decoded);
    in.p += 2;
  }
}

constexpr size_t kMaxNumber = 64;

/// A number at p, by nlohmann's rules: non-negative integers are unsigned, negative ones
/// signed, the rest (and integers too large for 64 bits) double.
template <typename Input, typename Sax> ScanResult scanNumber(Input &in, Sax &sax) {
  in.need(kMaxNumber + 1);
  const char *s = in.p, *q = in.p, *end = in.end;
  auto digit = [&](const char *at) { return at < end && *at >= '0' && *at <= '9'; };
  bool negative = *q == '-';
  if (negative)
    ++q;
  if (!digit(q))
    return ScanResult::Unsupported;
  if (*q == '0')
    ++q;
  else
    while (digit(q))
      ++q;
  const size_t intDigits = size_t(q - s) - (negative ? 1 : 0);
  bool isFloat = false;
  if (q < end && *q == '.') {
    isFloat = true;
    ++q;
    if (!digit(q))
      return ScanResult::Unsupported;
    while (digit(q))
      ++q;
  }
  if (q < end && (*q == 'e' || *q == 'E')) {
    isFloat = true;
    ++q;
    if (q < end && (*q == '+' || *q == '-'))
      ++q;
    if (!digit(q))
      return ScanResult::Unsupported;
    while (digit(q))
      ++q;
  }
  const size_t length = size_t(q - s);
  if (length > kMaxNumber || q == end)
    return ScanResult::Unsupported; // long, or perhaps cut by the block: nlohmann's to read
  in.p = q;
  if (!isFloat && intDigits <= 18) { // fits either type without overflow
    uint64_t v = 0;
    for (const char *d = s + (negative ? 1 : 0); d < q; ++d)
      v = v * 10 + uint64_t(*d - '0');
    bool ok = negative ? sax.number_integer(-int64_t(v)) : sax.number_unsigned(v);
    return ok ? ScanResult::Done : ScanResult::Stopped;
  }
  if (!isFloat)
    return ScanResult::Unsupported; // 19 digits and more: nlohmann decides about overflow
  char token[kMaxNumber + 1];
  std::memcpy(token, s, length);
  token[length] = '\0';
  double d = std::strtod(token, nullptr); // what nlohmann calls, on the same characters
  if (!std::isfinite(d))
    return ScanResult::Unsupported; // nlohmann's out-of-range error
  typename Sax::string_t text(s, length);
  return sax.number_float(d, text) ? ScanResult::Done : ScanResult::Stopped;
}

template <typename Sax, typename Input>
concept DecodesObjects = requires(Sax &sax, Input &in) {
  { sax.tryObject(in) } -> std::same_as<bool>;
};

} // namespace detail

/// Scan one JSON value and the whitespace after it from `in`, calling `sax` as
/// nlohmann::json::sax_parse would. Iterative: nesting costs a byte of stack vector per level.
template <typename Input, typename Sax> ScanResult scanJson(Input &in, Sax &sax) {
  using detail::skipSpace;
  typename Sax::string_t text;
  std::vector<char> open; // '{' or '[' per level
  constexpr size_t unknown = static_cast<size_t>(-1);
#define PIPEC_SCAN_CALL(call)                                                                      \
  do {                                                                                             \
    if (!(call))                                                                                   \
      return ScanResult::Stopped;                                                                  \
  } while (0)
  for (;;) {
    // A value.
    if (!skipSpace(in))
      return ScanResult::Unsupported;
    bool closed = false; // the value is complete (a scalar, or an empty or decoded container)
    switch (*in.p) {
    case '{':
      if constexpr (detail::DecodesObjects<Sax, Input>) {
        if (sax.tryObject(in)) {
          closed = true;
          break;
        }
      }
      ++in.p;
      PIPEC_SCAN_CALL(sax.start_object(unknown));
      if (!skipSpace(in))
        return ScanResult::Unsupported;
      if (*in.p == '}') {
        ++in.p;
        PIPEC_SCAN_CALL(sax.end_object());
        closed = true;
      } else {
        open.push_back('{');
      }
      break;
    case '[':
      ++in.p;
      PIPEC_SCAN_CALL(sax.start_array(unknown));
      if (!skipSpace(in))
        return ScanResult::Unsupported;
      if (*in.p == ']') {
        ++in.p;
        PIPEC_SCAN_CALL(sax.end_array());
        closed = true;
      } else {
        open.push_back('[');
      }
      break;
    case '"':
      if (!detail::scanString(in, text))
        return ScanResult::Unsupported;
      PIPEC_SCAN_CALL(sax.string(text));
      closed = true;
      break;
    case 't':
    case 'f':
    case 'n': {
      in.need(5);
      auto word = [&](const char *w) {
        size_t n = std::strlen(w);
        if (size_t(in.end - in.p) < n || std::memcmp(in.p, w, n) != 0)
          return false;
        in.p += n;
        return true;
      };
      if (word("true"))
        PIPEC_SCAN_CALL(sax.boolean(true));
      else if (word("false"))
        PIPEC_SCAN_CALL(sax.boolean(false));
      else if (word("null"))
        PIPEC_SCAN_CALL(sax.null());
      else
        return ScanResult::Unsupported;
      closed = true;
      break;
    }
    default:
      if (*in.p == '-' || (*in.p >= '0' && *in.p <= '9')) {
        ScanResult r = detail::scanNumber(in, sax);
        if (r != ScanResult::Done)
          return r;
        closed = true;
        break;
      }
      return ScanResult::Unsupported;
    }
    if (!closed) {
      if (open.back() == '[')
        continue; // the array's first element
      // The object's first key.
      if (*in.p != '"' || !detail::scanString(in, text))
        return ScanResult::Unsupported;
      PIPEC_SCAN_CALL(sax.key(text));
      if (!skipSpace(in) || *in.p != ':')
        return ScanResult::Unsupported;
      ++in.p;
      continue;
    }
    // After a value: a separator, the end of containers, or the end of the input.
    for (;;) {
      if (open.empty()) {
        if (skipSpace(in))
          return ScanResult::Unsupported; // text after the value
        return ScanResult::Done;
      }
      if (!skipSpace(in))
        return ScanResult::Unsupported;
      char c = *in.p;
      if (c == ',') {
        ++in.p;
        if (open.back() == '{') {
          if (!skipSpace(in) || *in.p != '"' || !detail::scanString(in, text))
            return ScanResult::Unsupported;
          PIPEC_SCAN_CALL(sax.key(text));
          if (!skipSpace(in) || *in.p != ':')
            return ScanResult::Unsupported;
          ++in.p;
        }
        break; // the next value
      }
      if ((c == '}' && open.back() == '{') || (c == ']' && open.back() == '[')) {
        ++in.p;
        open.pop_back();
        PIPEC_SCAN_CALL(c == '}' ? sax.end_object() : sax.end_array());
        continue;
      }
      return ScanResult::Unsupported;
    }
  }
#undef PIPEC_SCAN_CALL
}

} // namespace pipec::json

#endif // PIPEC_IR_FORMATS_JSONSCAN_H
