//===- SpecJson.h - Model and cluster specs from their JSON -----*- C++ -*-===//
//
// The readers of pipemodel/1 and pipecluster/1 (docs/contracts.md): every field checked for
// presence, type and range, an unknown key refused, each error naming the file and the JSON
// path. What the specs mean is ir/Model.h's.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_IR_FORMATS_SPECJSON_H
#define PIPEC_IR_FORMATS_SPECJSON_H

#include "ir/Model.h"

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

namespace pipec {

/// Parse and check a model spec; errors name `source`, the JSON path and what was expected.
llvm::Expected<ModelSpec> parseModelSpec(llvm::StringRef text, llvm::StringRef source);
llvm::Expected<ClusterSpec> parseClusterSpec(llvm::StringRef text, llvm::StringRef source);
/// Read a spec file by the input rules (ir/support/Files.h) and parse it.
llvm::Expected<ModelSpec> loadModelSpec(llvm::StringRef path);
llvm::Expected<ClusterSpec> loadClusterSpec(llvm::StringRef path);

} // namespace pipec

#endif // PIPEC_IR_FORMATS_SPECJSON_H
