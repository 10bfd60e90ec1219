//===- PlanJson.h - pipeplan/1 JSON read and write --------------*- C++ -*-===//
#ifndef PIPEC_IR_FORMATS_PLANJSON_H
#define PIPEC_IR_FORMATS_PLANJSON_H

#include "ir/Plan.h"

#include "llvm/Support/Error.h"
#include "llvm/Support/raw_ostream.h"

#include <string>

namespace pipec {

/// Deterministic JSON: the same plan gives byte-identical text. Ends with a newline. Written as
/// it goes: only the small header is built in memory, the instruction streams never are.
void writePlanJson(const Plan &plan, llvm::raw_ostream &os);
std::string writePlanJson(const Plan &plan);
/// The same document without "ranks" (the instruction streams), on one line: what a reader of
/// the configuration, the stage table and the stats needs.
std::string planHeaderJson(const Plan &plan);

/// Parse a plan. Types, required fields and index ranges (stage, mb, slice, peer) are checked
/// here and reported as InputErrors naming `source` and the JSON path; whether the streams are
/// correct is the verifier's question. Parsed as a stream (nlohmann's SAX interface): the
/// instructions go straight into the plan, and loadPlan never holds the file's text.
/// Which JSON parser reads a plan: ir/formats/JsonScan.h's scanner, which hands anything unusual
/// (every syntax error included) to nlohmann's, or nlohmann's alone: the reference the
/// scanner is tested against (same plan, same error).
/// A pipemodel/1 spec of transformer `t`, as `pipec spec` prints it (parseModelSpec reads it
/// back to the same TransformerConfig).
std::string modelSpecJson(llvm::StringRef name, const TransformerConfig &t);

enum class JsonParser { Fast, Nlohmann };
llvm::Expected<Plan> parsePlanJson(llvm::StringRef text, llvm::StringRef source,
                                   JsonParser parser = JsonParser::Fast);
llvm::Expected<Plan> loadPlan(llvm::StringRef path);

} // namespace pipec

#endif // PIPEC_IR_FORMATS_PLANJSON_H
