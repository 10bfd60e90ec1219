//===- JsonRead.h - Checked reading of JSON inputs --------------*- C++ -*-===//
//
// Every getter checks presence, type and range and reports "<source>: <json path>: expected
// ..., got ..." as an InputError. nlohmann/json stays inside ir/formats; no exception escapes.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_IR_FORMATS_JSONREAD_H
#define PIPEC_IR_FORMATS_JSONREAD_H

#include "ir/support/Error.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/StringRef.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>

namespace pipec {

using Json = nlohmann::json;

class JsonReader {
public:
  explicit JsonReader(llvm::StringRef source) : source(source.str()) {}

  /// Parse text; a syntax error names the line and column, and a key given twice in one object
  /// its path (unless keepingLastDuplicate()).
  llvm::Expected<Json> parse(llvm::StringRef text) const;
  /// Take the last of a key given twice, as Python's json does: for the files transformers
  /// reads (config.json, a safetensors index), which must mean to pipec what they mean to it.
  JsonReader &keepingLastDuplicate() {
    keepLastDuplicate = true;
    return *this;
  }
  /// parse() of a document that must be a JSON object (every pipec format and config.json).
  llvm::Expected<Json> parseObject(llvm::StringRef text) const;

  llvm::Error fail(llvm::StringRef path, llvm::StringRef expected, const Json *got) const;
  llvm::Error expectObject(const Json &j, llvm::StringRef path) const;
  llvm::Error expectArray(const Json &j, llvm::StringRef path) const;
  /// The top of every pipec document: an object of only the `allowed` keys whose "format" is
  /// `format` ("pipeplan/1") exactly.
  llvm::Error expectDocument(const Json &j, llvm::StringRef format,
                             llvm::ArrayRef<llvm::StringRef> allowed) const;
  /// parseObject(), then expectDocument().
  llvm::Expected<Json> parseDocument(llvm::StringRef text, llvm::StringRef format,
                                     llvm::ArrayRef<llvm::StringRef> allowed) const;
  /// Unknown keys are errors (they are almost always typos); the message lists the valid ones.
  llvm::Error onlyKeys(const Json &obj, llvm::StringRef path,
                       llvm::ArrayRef<llvm::StringRef> allowed) const;

  /// Getters: a missing key is an error when `required`, else `out` keeps its value.
  llvm::Error getNumber(const Json &obj, llvm::StringRef path, llvm::StringRef key, double &out,
                        bool required, double min = 0) const;
  llvm::Error getInt(const Json &obj, llvm::StringRef path, llvm::StringRef key, int64_t &out,
                     bool required, int64_t min = 0) const;
  llvm::Error getInt32(const Json &obj, llvm::StringRef path, llvm::StringRef key, int32_t &out,
                       bool required, int64_t min = 0) const;
  /// An integer in [min, max]; anything else is "expected an integer in [min, max]".
  llvm::Error getIntInRange(const Json &obj, llvm::StringRef path, llvm::StringRef key,
                            int64_t &out, bool required, int64_t min, int64_t max) const;
  llvm::Error getString(const Json &obj, llvm::StringRef path, llvm::StringRef key,
                        std::string &out, bool required) const;
  /// A string that names something (a model, a schedule): printed in summaries, grids and the
  /// text form, so without control characters (a newline would split a line a reader parses).
  llvm::Error getName(const Json &obj, llvm::StringRef path, llvm::StringRef key, std::string &out,
                      bool required) const;
  llvm::Error getBool(const Json &obj, llvm::StringRef path, llvm::StringRef key, bool &out,
                      bool required) const;

  const std::string &name() const { return source; }

private:
  std::string source;
  bool keepLastDuplicate = false;
};

/// "$.a" + "b" -> "$.a.b"; "$.a" + 3 -> "$.a[3]".
std::string jsonPath(llvm::StringRef base, llvm::StringRef key);
std::string jsonPath(llvm::StringRef base, size_t index);
/// A short description of a JSON value for error messages: `string "abc"`, `number -3`.
std::string describeJson(const Json &j);

} // namespace pipec

#endif // PIPEC_IR_FORMATS_JSONREAD_H
