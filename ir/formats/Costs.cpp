//===- Costs.cpp - The pipecost/1 reader, writer and how a plan takes it --===//
#include "ir/formats/Costs.h"

#include "ir/formats/JsonRead.h"
#include "ir/support/Error.h"
#include "ir/support/Files.h"
#include "ir/support/Limits.h"

#include <algorithm>
#include <cmath>
#include <map>

namespace pipec {

using OJson = nlohmann::ordered_json;

Measured summarizeSamples(std::vector<double> ms) {
  Measured m;
  if (ms.empty())
    return m;
  std::sort(ms.begin(), ms.end());
  // Linear interpolation between the order statistics.
  auto quantile = [&](double q) {
    double at = q * double(ms.size() - 1);
    size_t lo = size_t(at), hi = std::min(lo + 1, ms.size() - 1);
    return ms[lo] + (ms[hi] - ms[lo]) * (at - double(lo));
  };
  m.medianMs = quantile(0.5);
  m.spreadMs = quantile(0.75) - quantile(0.25);
  m.samples = int64_t(ms.size());
  return m;
}

namespace {

void putTime(OJson &o, const Measured &t) {
  o["median_ms"] = t.medianMs;
  o["spread_ms"] = t.spreadMs;
  o["samples"] = t.samples;
}

llvm::Error getTime(const JsonReader &r, const Json &o, llvm::StringRef path, Measured &t) {
  if (auto err = r.getNumber(o, path, "median_ms", t.medianMs, true))
    return err;
  if (auto err = r.getNumber(o, path, "spread_ms", t.spreadMs, true))
    return err;
  if (auto err = r.getInt(o, path, "samples", t.samples, true, 1))
    return err;
  if (!std::isfinite(t.medianMs) || !std::isfinite(t.spreadMs))
    return r.fail(jsonPath(path, "median_ms"), "a finite number of milliseconds", &o["median_ms"]);
  return llvm::Error::success();
}

/// The array at obj[key] (required), each element an object.
llvm::Expected<const Json *> getArray(const JsonReader &r, const Json &obj, llvm::StringRef path,
                                      llvm::StringRef key) {
  auto it = obj.find(key.str());
  std::string at = jsonPath(path, key);
  if (it == obj.end())
    return r.fail(at, "an array", nullptr);
  if (auto err = r.expectArray(*it, at))
    return err;
  for (size_t n = 0; n < it->size(); ++n)
    if (auto err = r.expectObject((*it)[n], jsonPath(at, n)))
      return err;
  return &*it;
}

} // namespace

std::string writeCostsJson(const MeasuredCosts &c) {
  OJson j;
  j["format"] = "pipecost/1";
  j["measured_on"] = OJson{{"backend", c.backend},    {"dtype", c.dtype},     {"device", c.device},
                           {"plan_hash", c.planHash}, {"threads", c.threads}, {"steps", c.steps}};
  j["slices"] = c.numSlices;
  OJson stages = OJson::array();
  for (int s = 0; s < c.numStages; ++s) {
    OJson ops = OJson::array();
    for (const MeasuredCosts::Op &op : c.ops)
      if (op.stage == s) {
        OJson o{{"op", toString(op.op).str()}, {"slice", op.slice}};
        putTime(o, op.time);
        ops.push_back(std::move(o));
      }
    stages.push_back(OJson{{"stage", s}, {"ops", std::move(ops)}});
  }
  j["stages"] = std::move(stages);
  OJson messages = OJson::array();
  for (const MeasuredCosts::Message &m : c.messages) {
    OJson o{{"kind", toString(m.kind).str()}, {"bytes", m.bytes}};
    putTime(o, m.time);
    messages.push_back(std::move(o));
  }
  j["messages"] = std::move(messages);
  OJson collectives = OJson::array();
  for (const MeasuredCosts::Collective &m : c.collectives) {
    OJson o{{"group", toString(m.group).str()}, {"stage", m.stage}};
    putTime(o, m.time);
    collectives.push_back(std::move(o));
  }
  j["collectives"] = std::move(collectives);
  OJson ranks = OJson::array();
  for (const MeasuredCosts::Rank &rk : c.ranks) {
    OJson opt;
    putTime(opt, rk.optimizer);
    ranks.push_back(OJson{{"rank", rk.rank},
                          {"optimizer", std::move(opt)},
                          {"peak_memory_bytes", rk.peakMemoryBytes}});
  }
  j["ranks"] = std::move(ranks);
  return j.dump(1, ' ', false, OJson::error_handler_t::replace) + "\n";
}

llvm::Expected<MeasuredCosts> parseCostsJson(llvm::StringRef text, llvm::StringRef source) {
  JsonReader r(source);
  auto parsed = r.parseDocument(
      text, "pipecost/1",
      {"format", "measured_on", "slices", "stages", "messages", "collectives", "ranks"});
  if (!parsed)
    return parsed.takeError();
  const Json &j = *parsed;
  MeasuredCosts c;
  auto on = j.find("measured_on");
  if (on == j.end())
    return r.fail("$.measured_on", "an object", nullptr);
  if (auto err = r.expectObject(*on, "$.measured_on"))
    return err;
  if (auto err = r.onlyKeys(*on, "$.measured_on",
                            {"backend", "dtype", "device", "plan_hash", "threads", "steps"}))
    return err;
  for (auto [key, out] : {std::pair{"backend", &c.backend}, std::pair{"dtype", &c.dtype},
                          std::pair{"device", &c.device}, std::pair{"plan_hash", &c.planHash}})
    if (auto err = r.getString(*on, "$.measured_on", key, *out, true))
      return err;
  int64_t v = 0;
  if (auto err = r.getIntInRange(*on, "$.measured_on", "threads", v, true, 1, kMaxUnits))
    return err;
  c.threads = int(v);
  if (auto err = r.getIntInRange(*on, "$.measured_on", "steps", v, true, 1, 1000000))
    return err;
  c.steps = int(v);
  if (auto err = r.getIntInRange(j, "$", "slices", v, true, 1, kMaxUnits))
    return err;
  c.numSlices = int(v);

  auto stages = getArray(r, j, "$", "stages");
  if (!stages)
    return stages.takeError();
  c.numStages = int((*stages)->size());
  if (c.numStages < 1 || c.numStages > 4096)
    return r.fail("$.stages", "an array of 1 to 4096 stages", *stages);
  std::map<std::tuple<int, OpKind, int>, bool> seen;
  for (size_t s = 0; s < (*stages)->size(); ++s) {
    const Json &st = (**stages)[s];
    std::string path = jsonPath("$.stages", s);
    if (auto err = r.onlyKeys(st, path, {"stage", "ops"}))
      return err;
    if (auto err = r.getIntInRange(st, path, "stage", v, true, int64_t(s), int64_t(s)))
      return err;
    auto ops = getArray(r, st, path, "ops");
    if (!ops)
      return ops.takeError();
    for (size_t n = 0; n < (*ops)->size(); ++n) {
      const Json &o = (**ops)[n];
      std::string at = jsonPath(jsonPath(path, "ops"), n);
      if (auto err = r.onlyKeys(o, at, {"op", "slice", "median_ms", "spread_ms", "samples"}))
        return err;
      MeasuredCosts::Op op;
      op.stage = int(s);
      std::string name;
      if (auto err = r.getString(o, at, "op", name, true))
        return err;
      if (!opKindFromString(name, op.op) || !Instruction::compute(op.op, 0, 0, 0).isCompute())
        return r.fail(jsonPath(at, "op"),
                      "one of forward, backward_input, backward_weight, backward", &o["op"]);
      if (auto err = r.getIntInRange(o, at, "slice", v, true, 0, c.numSlices - 1))
        return err;
      op.slice = int(v);
      if (auto err = getTime(r, o, at, op.time))
        return err;
      // A timed pass takes time: zeros would give a plan of no time (infinite tokens/s).
      if (!(op.time.medianMs > 0))
        return r.fail(jsonPath(at, "median_ms"),
                      "a positive number of milliseconds (a timed "
                      "pass takes time)",
                      &o["median_ms"]);
      if (seen[{op.stage, op.op, op.slice}])
        return inputError("{}: {}: a second {} of slice {} (one entry each)", r.name(), at, name,
                          op.slice);
      // A backward ran fused or split, not both: the fused time would be silently dropped.
      if (op.op != OpKind::Forward) {
        const bool fused = op.op == OpKind::Backward;
        const bool other = fused ? seen[{op.stage, OpKind::BackwardInput, op.slice}] ||
                                       seen[{op.stage, OpKind::BackwardWeight, op.slice}]
                                 : seen[{op.stage, OpKind::Backward, op.slice}];
        if (other)
          return inputError("{}: {}: a {} of slice {} beside its {}: a stage's backward is "
                            "measured fused or split into input and weight gradients, not both",
                            r.name(), at, name, op.slice,
                            fused ? "split backward" : "fused backward");
      }
      seen[{op.stage, op.op, op.slice}] = true;
      c.ops.push_back(op);
    }
  }

  auto messages = getArray(r, j, "$", "messages");
  if (!messages)
    return messages.takeError();
  for (size_t n = 0; n < (*messages)->size(); ++n) {
    const Json &o = (**messages)[n];
    std::string at = jsonPath("$.messages", n);
    if (auto err = r.onlyKeys(o, at, {"kind", "bytes", "median_ms", "spread_ms", "samples"}))
      return err;
    MeasuredCosts::Message m;
    std::string kind;
    if (auto err = r.getString(o, at, "kind", kind, true))
      return err;
    if (!tensorKindFromString(kind, m.kind))
      return r.fail(jsonPath(at, "kind"), "activation or gradient", &o["kind"]);
    if (auto err = r.getInt(o, at, "bytes", m.bytes, true, 0))
      return err;
    if (auto err = getTime(r, o, at, m.time))
      return err;
    c.messages.push_back(m);
  }

  auto collectives = getArray(r, j, "$", "collectives");
  if (!collectives)
    return collectives.takeError();
  for (size_t n = 0; n < (*collectives)->size(); ++n) {
    const Json &o = (**collectives)[n];
    std::string at = jsonPath("$.collectives", n);
    if (auto err = r.onlyKeys(o, at, {"group", "stage", "median_ms", "spread_ms", "samples"}))
      return err;
    MeasuredCosts::Collective m;
    std::string group;
    if (auto err = r.getString(o, at, "group", group, true))
      return err;
    if (!collectiveGroupFromString(group, m.group))
      return r.fail(jsonPath(at, "group"), "tp, dp or embedding", &o["group"]);
    if (auto err = r.getIntInRange(o, at, "stage", v, true, 0, c.numStages - 1))
      return err;
    m.stage = int(v);
    if (auto err = getTime(r, o, at, m.time))
      return err;
    c.collectives.push_back(m);
  }

  auto ranks = getArray(r, j, "$", "ranks");
  if (!ranks)
    return ranks.takeError();
  for (size_t n = 0; n < (*ranks)->size(); ++n) {
    const Json &o = (**ranks)[n];
    std::string at = jsonPath("$.ranks", n);
    if (auto err = r.onlyKeys(o, at, {"rank", "optimizer", "peak_memory_bytes"}))
      return err;
    MeasuredCosts::Rank rk;
    if (auto err = r.getIntInRange(o, at, "rank", v, true, int64_t(n), int64_t(n)))
      return err;
    rk.rank = int(v);
    auto opt = o.find("optimizer");
    std::string optAt = jsonPath(at, "optimizer");
    if (opt == o.end())
      return r.fail(optAt, "an object", nullptr);
    if (auto err = r.expectObject(*opt, optAt))
      return err;
    if (auto err = r.onlyKeys(*opt, optAt, {"median_ms", "spread_ms", "samples"}))
      return err;
    if (auto err = getTime(r, *opt, optAt, rk.optimizer))
      return err;
    if (auto err = r.getInt(o, at, "peak_memory_bytes", rk.peakMemoryBytes, true, 0))
      return err;
    c.ranks.push_back(rk);
  }
  if (c.ranks.size() > size_t(c.numStages))
    return r.fail("$.ranks", fmt::format("at most one rank per stage ({})", c.numStages),
                  &*j.find("ranks"));
  return c;
}

llvm::Expected<MeasuredCosts> readCosts(llvm::StringRef path) {
  auto text = readFile(path, kCostsInput);
  if (!text)
    return text.takeError();
  return parseCostsJson(*text, path);
}

llvm::Error writeCosts(llvm::StringRef path, const MeasuredCosts &costs,
                       llvm::ArrayRef<InputFile> inputs) {
  return writeFileAtomically(path, writeCostsJson(costs), inputs);
}

} // namespace pipec
