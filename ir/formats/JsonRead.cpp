#include "ir/formats/JsonRead.h"

#include "ir/formats/JsonScan.h"
#include "ir/support/Error.h"
#include "ir/support/Limits.h"

#include "llvm/ADT/STLExtras.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <set>
#include <string>
#include <vector>

namespace pipec {

std::string jsonPath(llvm::StringRef base, llvm::StringRef key) {
  return fmt::format("{}.{}", base.str(), key.str());
}

std::string jsonPath(llvm::StringRef base, size_t index) {
  return fmt::format("{}[{}]", base.str(), index);
}

std::string describeJson(const Json &j) {
  // Only scalars are printed: dumping a (possibly deeply nested) container is not needed.
  std::string dumped;
  if (j.is_primitive())
    dumped = j.dump(-1, ' ', false, Json::error_handler_t::replace);
  if (dumped.size() > 40)
    dumped = dumped.substr(0, 37) + "...";
  switch (j.type()) {
  case Json::value_t::null:
    return "null";
  case Json::value_t::object:
    return "an object";
  case Json::value_t::array:
    return "an array";
  case Json::value_t::string:
    return "string " + dumped;
  case Json::value_t::boolean:
    return "boolean " + dumped;
  case Json::value_t::number_integer:
  case Json::value_t::number_unsigned:
  case Json::value_t::number_float:
    return "number " + dumped;
  case Json::value_t::binary:
  case Json::value_t::discarded:
    break;
  }
  return "an unreadable value";
}

/// Nesting depth of JSON text (brackets outside strings), to refuse pathological inputs before
/// anything recursive touches them.
static size_t nestingDepth(llvm::StringRef text) {
  size_t depth = 0, most = 0;
  bool inString = false;
  for (size_t i = 0; i < text.size(); ++i) {
    char c = text[i];
    if (inString) {
      if (c == '\\')
        ++i;
      else if (c == '"')
        inString = false;
      continue;
    }
    if (c == '"')
      inString = true;
    else if (c == '[' || c == '{')
      most = std::max(most, ++depth);
    else if ((c == ']' || c == '}') && depth > 0)
      --depth;
  }
  return most;
}

llvm::Expected<Json> JsonReader::parseObject(llvm::StringRef text) const {
  auto parsed = parse(text);
  if (!parsed)
    return parsed.takeError();
  if (auto err = expectObject(*parsed, "$"))
    return err;
  return parsed;
}

llvm::Expected<Json> JsonReader::parse(llvm::StringRef text) const {
  constexpr size_t kMaxDepth = 64;
  if (size_t depth = nestingDepth(text); depth > kMaxDepth)
    return inputError("{}: JSON nested {} levels deep; pipec's formats need at most {}", source,
                      depth, kMaxDepth);
  // A key given twice in one object: JSON parsers keep one of the two silently (nlohmann and
  // Python the last), so a hand-edited spec's earlier value would be ignored without a word.
  // Refused, naming the key's path, unless the reader follows Python's rule (config.json).
  struct Frame {
    bool array = false;
    size_t index = 0; // an array's element being read
    std::string key;  // an object's member being read
    std::set<std::string, std::less<>> keys;
  };
  std::vector<Frame> frames;
  std::string twice;
  auto pathOf = [&](llvm::StringRef key) {
    std::string path = "$";
    for (size_t i = 0; i + 1 < frames.size(); ++i)
      path += frames[i].array ? fmt::format("[{}]", frames[i].index) : "." + frames[i].key;
    return path + "." + key.str();
  };
  auto endElement = [&] {
    if (!frames.empty() && frames.back().array)
      ++frames.back().index;
  };
  Json::parser_callback_t watch = [&](int, Json::parse_event_t event, Json &parsed) {
    switch (event) {
    case Json::parse_event_t::object_start:
    case Json::parse_event_t::array_start:
      frames.push_back(Frame{event == Json::parse_event_t::array_start, 0, {}, {}});
      break;
    case Json::parse_event_t::key: {
      Frame &f = frames.back();
      f.key = parsed.get<std::string>();
      if (!f.keys.insert(f.key).second && twice.empty() && !keepLastDuplicate)
        twice = pathOf(f.key);
      break;
    }
    case Json::parse_event_t::object_end:
    case Json::parse_event_t::array_end:
      frames.pop_back();
      endElement();
      break;
    case Json::parse_event_t::value:
      endElement();
      break;
    }
    return true;
  };
  try {
    Json j = Json::parse(json::NulVisible{text.begin()}, json::NulVisible{text.end()}, watch);
    if (!twice.empty())
      return inputError("{}: {}: given twice in one object (say it once)", source,
                        shortened(twice, 200));
    return j;
  } catch (const Json::out_of_range &e) {
    return inputError("{}: a number is out of range ({})", source,
                      llvm::StringRef(e.what()).contains("overflow") ? "too large for a double"
                                                                     : "unreadable");
  } catch (const Json::parse_error &e) {
    // Turn the byte offset into line:column for the message.
    size_t offset = std::min<size_t>(e.byte == 0 ? 0 : e.byte - 1, text.size());
    size_t line = 1, col = 1;
    for (size_t i = 0; i < offset; ++i) {
      if (text[i] == '\n') {
        ++line;
        col = 1;
      } else {
        ++col;
      }
    }
    return inputError("{}:{}:{}: malformed JSON ({})", source, line, col,
                      e.byte >= text.size() ? "unexpected end of input" : "unexpected character");
  } catch (const Json::exception &e) {
    return inputError("{}: unreadable JSON ({})", source, e.what());
  }
}

llvm::Error JsonReader::expectDocument(const Json &j, llvm::StringRef format,
                                       llvm::ArrayRef<llvm::StringRef> allowed) const {
  if (auto err = expectObject(j, "$"))
    return err;
  // The format before the fields: a document of another of pipec's formats (a cluster spec
  // given as --model, a costs file as a plan) is named as what it is, not by a field this
  // format lacks.
  if (auto it = j.find("format"); it != j.end() && it->is_string()) {
    const std::string got = it->get<std::string>();
    static const std::pair<llvm::StringRef, llvm::StringRef> kKnown[] = {
        {"pipemodel/1", "a model spec"},
        {"pipecluster/1", "a cluster spec"},
        {"pipeplan/1", "a plan"},
        {"pipecost/1", "a costs file"},
        {"pipeckpt/1", "a checkpoint manifest"}};
    if (got != format)
      for (const auto &[name, what] : kKnown)
        if (got == name)
          return inputError("{}: $.format: expected \"{}\", got \"{}\" ({})", source, format.str(),
                            got, what.str());
  }
  if (auto err = onlyKeys(j, "$", allowed))
    return err;
  std::string got;
  if (auto err = getString(j, "$", "format", got, true))
    return err;
  if (got != format)
    return inputError("{}: $.format: expected \"{}\", got \"{}\"", source, format.str(),
                      shortened(got));
  return llvm::Error::success();
}

llvm::Expected<Json> JsonReader::parseDocument(llvm::StringRef text, llvm::StringRef format,
                                               llvm::ArrayRef<llvm::StringRef> allowed) const {
  auto parsed = parseObject(text);
  if (!parsed)
    return parsed.takeError();
  if (auto err = expectDocument(*parsed, format, allowed))
    return err;
  return parsed;
}

llvm::Error JsonReader::fail(llvm::StringRef path, llvm::StringRef expected,
                             const Json *got) const {
  if (!got)
    return inputError("{}: {}: missing, expected {}", source, path.str(), expected.str());
  return inputError("{}: {}: expected {}, got {}", source, path.str(), expected.str(),
                    describeJson(*got));
}

llvm::Error JsonReader::expectObject(const Json &j, llvm::StringRef path) const {
  if (j.is_object())
    return llvm::Error::success();
  return fail(path, "an object", &j);
}

llvm::Error JsonReader::expectArray(const Json &j, llvm::StringRef path) const {
  if (j.is_array())
    return llvm::Error::success();
  return fail(path, "an array", &j);
}

llvm::Error JsonReader::onlyKeys(const Json &obj, llvm::StringRef path,
                                 llvm::ArrayRef<llvm::StringRef> allowed) const {
  for (auto it = obj.begin(); it != obj.end(); ++it) {
    if (llvm::is_contained(allowed, llvm::StringRef(it.key())))
      continue;
    std::string list;
    for (llvm::StringRef a : allowed)
      list += (list.empty() ? "" : ", ") + a.str();
    return inputError("{}: {}: unknown field (valid fields: {})", source,
                      jsonPath(path, shortened(it.key())), list);
  }
  return llvm::Error::success();
}

static const Json *lookup(const Json &obj, llvm::StringRef key) {
  auto it = obj.find(key.str());
  return it == obj.end() ? nullptr : &*it;
}

llvm::Error JsonReader::getNumber(const Json &obj, llvm::StringRef path, llvm::StringRef key,
                                  double &out, bool required, double min) const {
  const Json *v = lookup(obj, key);
  std::string where = jsonPath(path, key);
  std::string expected = fmt::format("a number >= {}", min);
  if (!v)
    return required ? fail(where, expected, nullptr) : llvm::Error::success();
  if (!v->is_number())
    return fail(where, expected, v);
  double d = v->get<double>();
  // Above 1e15 no cost or time is meaningful, and sums of such values would overflow.
  if (!std::isfinite(d) || d < min || d > 1e15)
    return fail(where, fmt::format("a number in [{}, 1e15]", min), v);
  out = d;
  return llvm::Error::success();
}

llvm::Error JsonReader::getInt(const Json &obj, llvm::StringRef path, llvm::StringRef key,
                               int64_t &out, bool required, int64_t min) const {
  const Json *v = lookup(obj, key);
  std::string where = jsonPath(path, key);
  std::string expected = fmt::format("an integer >= {}", min);
  if (!v)
    return required ? fail(where, expected, nullptr) : llvm::Error::success();
  if (!v->is_number_integer())
    return fail(where, expected, v);
  // Up to 2^53: byte counts and sizes above that are not real, and sums of them would overflow.
  constexpr int64_t kMax = int64_t(1) << 53;
  if (v->is_number_unsigned() && v->get<uint64_t>() > uint64_t(kMax))
    return fail(where, fmt::format("an integer in [{}, 2^53]", min), v);
  int64_t i = v->get<int64_t>();
  if (i < min || i > kMax)
    return fail(where, fmt::format("an integer in [{}, 2^53]", min), v);
  out = i;
  return llvm::Error::success();
}

llvm::Error JsonReader::getInt32(const Json &obj, llvm::StringRef path, llvm::StringRef key,
                                 int32_t &out, bool required, int64_t min) const {
  int64_t wide = out;
  if (auto err = getInt(obj, path, key, wide, required, min))
    return err;
  if (wide > INT32_MAX)
    return fail(jsonPath(path, key), "an integer below 2^31", lookup(obj, key));
  out = int32_t(wide);
  return llvm::Error::success();
}

llvm::Error JsonReader::getIntInRange(const Json &obj, llvm::StringRef path, llvm::StringRef key,
                                      int64_t &out, bool required, int64_t min, int64_t max) const {
  const Json *v = lookup(obj, key);
  std::string expected = fmt::format("an integer in [{}, {}]", min, max);
  if (!v)
    return required ? fail(jsonPath(path, key), expected, nullptr) : llvm::Error::success();
  bool ok = v->is_number_integer() &&
            (v->is_number_unsigned() ? v->get<uint64_t>() <= uint64_t(INT64_MAX) : true) &&
            v->get<int64_t>() >= min && v->get<int64_t>() <= max;
  if (!ok)
    return fail(jsonPath(path, key), expected, v);
  out = v->get<int64_t>();
  return llvm::Error::success();
}

llvm::Error JsonReader::getString(const Json &obj, llvm::StringRef path, llvm::StringRef key,
                                  std::string &out, bool required) const {
  const Json *v = lookup(obj, key);
  std::string where = jsonPath(path, key);
  if (!v)
    return required ? fail(where, "a string", nullptr) : llvm::Error::success();
  if (!v->is_string())
    return fail(where, "a string", v);
  out = v->get<std::string>();
  return llvm::Error::success();
}

llvm::Error JsonReader::getName(const Json &obj, llvm::StringRef path, llvm::StringRef key,
                                std::string &out, bool required) const {
  std::string got;
  if (auto err = getString(obj, path, key, got, required))
    return err;
  if (hasControlCharacter(got))
    return fail(jsonPath(path, key), "a name without control characters", lookup(obj, key));
  if (lookup(obj, key))
    out = std::move(got);
  return llvm::Error::success();
}

llvm::Error JsonReader::getBool(const Json &obj, llvm::StringRef path, llvm::StringRef key,
                                bool &out, bool required) const {
  const Json *v = lookup(obj, key);
  std::string where = jsonPath(path, key);
  if (!v)
    return required ? fail(where, "true or false", nullptr) : llvm::Error::success();
  if (!v->is_boolean())
    return fail(where, "true or false", v);
  out = v->get<bool>();
  return llvm::Error::success();
}

} // namespace pipec
