//===- TraceJson.cpp - A simulated timeline as a Chrome/Perfetto trace ----===//
#include "compiler/TraceJson.h"

#include "ir/PlanText.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace pipec {

std::string chromeTrace(const Plan &plan, const Timeline &t) {
  using OJson = nlohmann::ordered_json;
  // Chrome traces count microseconds: a plan in ms maps 1:1000; an abstract unit is shown as 1 ms.
  double scale = 1000.0;
  OJson events = OJson::array();
  events.push_back(
      OJson{{"name", "process_name"},
            {"ph", "M"},
            {"pid", 0},
            {"args", OJson{{"name", fmt::format("{} ({}, time unit: {})", plan.schedule, plan.model,
                                                plan.timeUnit)}}}});
  for (size_t r = 0; r < plan.ranks.size(); ++r) {
    events.push_back(OJson{{"name", "thread_name"},
                           {"ph", "M"},
                           {"pid", 0},
                           {"tid", r},
                           {"args", OJson{{"name", fmt::format("rank {}", r)}}}});
    events.push_back(OJson{{"name", "thread_sort_index"},
                           {"ph", "M"},
                           {"pid", 0},
                           {"tid", r},
                           {"args", OJson{{"sort_index", r}}}});
  }
  for (size_t r = 0; r < plan.ranks.size(); ++r) {
    for (size_t i = 0; i < plan.ranks[r].size(); ++i) {
      const Instruction &ins = plan.ranks[r][i];
      const OpTime &ot = t.ops[r][i];
      bool timed =
          ins.isCompute() || (ins.op == OpKind::AllReduce && ins.collective == CollectiveGroup::Tp);
      OJson e;
      e["name"] = formatToken(plan, ins);
      e["cat"] = timed ? (ins.isCompute() ? std::string(1, computeLetter(ins.op)) : "tp")
                       : toString(ins.op).str();
      e["ph"] = timed ? "X" : "i";
      e["ts"] = ot.start * scale;
      if (timed)
        e["dur"] = (ot.end - ot.start) * scale;
      else
        e["s"] = "t";
      e["pid"] = 0;
      e["tid"] = r;
      OJson args;
      args["step"] = i;
      if (ins.stage >= 0)
        args["stage"] = ins.stage;
      if (ins.mb >= 0)
        args["mb"] = ins.mb;
      if (ins.isP2P())
        args["peer"] = ins.peer;
      e["args"] = std::move(args);
      events.push_back(std::move(e));
    }
  }
  OJson j;
  j["traceEvents"] = std::move(events);
  j["displayTimeUnit"] = "ms";
  return j.dump(-1, ' ', false, OJson::error_handler_t::replace) + "\n";
}

} // namespace pipec
