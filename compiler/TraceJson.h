//===- TraceJson.h - A simulated timeline as a Chrome/Perfetto trace ---*- C++ -*-===//
//
// The writer of `pipec compile --trace`'s file (docs/commands.md): the timeline that the
// simulate pass's model computes (ir/CostModel.h's simulateTimeline) as Chrome's trace event
// JSON, which chrome://tracing and Perfetto open. A format writer, and so the one place of the
// compiler that uses nlohmann's JSON library.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_COMPILER_TRACEJSON_H
#define PIPEC_COMPILER_TRACEJSON_H

#include "ir/CostModel.h"
#include "ir/Plan.h"

#include <string>

namespace pipec {

/// Chrome/Perfetto trace JSON: one track per rank, one slice per op.
std::string chromeTrace(const Plan &plan, const Timeline &t);

} // namespace pipec

#endif // PIPEC_COMPILER_TRACEJSON_H
