#include "ir/formats/CheckpointJson.h"

#include "ir/formats/JsonRead.h"
#include "ir/formats/PlanJson.h"
#include "ir/formats/SpecJson.h"
#include "ir/support/Error.h"
#include "ir/support/Limits.h"

#include <fmt/format.h>

#include <string>

namespace pipec {

using OJson = nlohmann::ordered_json;

/// The "transformer" object a plan writes for `t` (PlanJson.cpp's, so that every field a model
/// has is recorded, whatever fields it gains).
static OJson transformerJson(const TransformerConfig &t) {
  Plan p;
  p.transformer = t;
  OJson plan = OJson::parse(writePlanJson(p), nullptr, /*allow_exceptions=*/false);
  return plan.contains("transformer") ? plan["transformer"] : OJson::object();
}

std::optional<FieldDifference> firstModelDifference(const TransformerConfig &a,
                                                    const TransformerConfig &b) {
  OJson ja = transformerJson(a), jb = transformerJson(b);
  for (auto it = ja.begin(); it != ja.end(); ++it) {
    if (it.key() == "dtype")
      continue;
    OJson other = jb.contains(it.key()) ? jb[it.key()] : OJson();
    if (other != it.value())
      return FieldDifference{it.key(), it.value().dump(), other.dump()};
  }
  for (auto it = jb.begin(); it != jb.end(); ++it)
    if (it.key() != "dtype" && !ja.contains(it.key()))
      return FieldDifference{it.key(), "null", it.value().dump()};
  return std::nullopt;
}

std::string writeCheckpointManifest(const CheckpointManifest &m) {
  OJson j;
  j["format"] = "pipeckpt/1";
  j["step"] = m.step;
  j["adam_steps"] = m.adamSteps;
  j["seed"] = std::to_string(m.seed); // decimal: any uint64 (JSON numbers stop at 2^53 here)
  j["sequences"] = m.sequences;
  j["data"] = m.data;
  if (m.lr)
    j["lr"] = std::stod(fmt::format("{}", *m.lr)); // (the float's shortest decimal: reads back
                                                   //  to the same float)
  j["model_name"] = m.modelName;
  j["model"] = transformerJson(m.model);
  j["schedule"] = m.schedule;
  const ParallelConfig &pc = m.parallel;
  j["parallel"] = OJson{{"pp", pc.pp},
                        {"vpp", pc.vpp},
                        {"tp", pc.tp},
                        {"dp", pc.dp},
                        {"microbatches", pc.microbatches},
                        {"seq_splits", pc.seqSplits}};
  j["plan_hash"] = m.planHash;
  OJson layers = OJson::array();
  for (size_t l = 0; l < m.layers.size(); ++l)
    layers.push_back(OJson{{"layer", l},
                           {"bytes", m.layers[l].bytes},
                           {"count", m.layers[l].count},
                           {"digest", m.layers[l].digest}});
  j["layers"] = std::move(layers);
  return j.dump(1, ' ', false, OJson::error_handler_t::replace) + "\n";
}

llvm::Expected<CheckpointManifest> parseCheckpointManifest(llvm::StringRef text,
                                                           llvm::StringRef source) {
  JsonReader r(source);
  auto parsed =
      r.parseDocument(text, "pipeckpt/1",
                      {"format", "step", "adam_steps", "seed", "sequences", "data", "lr",
                       "model_name", "model", "schedule", "parallel", "plan_hash", "layers"});
  if (!parsed)
    return parsed.takeError();
  const Json &j = *parsed;
  CheckpointManifest m;
  int64_t sequences = 0;
  if (auto err = r.getIntInRange(j, "$", "step", m.step, true, 1, kMaxCheckpointStep))
    return err;
  if (auto err = r.getIntInRange(j, "$", "adam_steps", m.adamSteps, true, 0, kMaxCheckpointStep))
    return err;
  std::string seedText;
  if (auto err = r.getString(j, "$", "seed", seedText, true))
    return err;
  if (llvm::StringRef(seedText).getAsInteger(10, m.seed))
    return r.fail("$.seed", "an unsigned integer in decimal", &j["seed"]);
  if (auto err = r.getInt(j, "$", "sequences", sequences, true))
    return err;
  m.sequences = uint64_t(sequences);
  if (auto err = r.getString(j, "$", "data", m.data, true))
    return err;
  if (j.contains("lr")) {
    // What --lr takes: (0, 10], and a float.
    double lr = 0;
    if (auto err = r.getNumber(j, "$", "lr", lr, true))
      return err;
    if (!(float(lr) > 0 && lr <= 10))
      return r.fail("$.lr", "a learning rate in (0, 10]", &j["lr"]);
    m.lr = float(lr);
  }
  if (auto err = r.getString(j, "$", "model_name", m.modelName, true))
    return err;
  if (auto err = r.getString(j, "$", "schedule", m.schedule, true))
    return err;
  if (auto err = r.getString(j, "$", "plan_hash", m.planHash, true))
    return err;
  auto model = j.find("model");
  if (model == j.end())
    return r.fail("$.model", "an object", nullptr);
  {
    // The same object and checks as a model spec's "transformer".
    Json spec = {{"format", "pipemodel/1"}, {"transformer", *model}};
    auto parsedModel = parseModelSpec(spec.dump(), r.name());
    if (!parsedModel)
      return parsedModel.takeError();
    m.model = *parsedModel->transformer;
  }
  auto par = j.find("parallel");
  if (par == j.end())
    return r.fail("$.parallel", "an object", nullptr);
  if (auto err = r.expectObject(*par, "$.parallel"))
    return err;
  if (auto err =
          r.onlyKeys(*par, "$.parallel", {"pp", "vpp", "tp", "dp", "microbatches", "seq_splits"}))
    return err;
  ParallelConfig &pc = m.parallel;
  int32_t *fields[] = {&pc.pp, &pc.vpp, &pc.tp, &pc.dp, &pc.microbatches, &pc.seqSplits};
  const char *names[] = {"pp", "vpp", "tp", "dp", "microbatches", "seq_splits"};
  for (size_t i = 0; i < 6; ++i)
    if (auto err = r.getInt32(*par, "$.parallel", names[i], *fields[i], true, 1))
      return err;
  auto layers = j.find("layers");
  const size_t want = size_t(m.model.numLayers) + 2; // embedding, blocks, head
  if (layers == j.end() || !layers->is_array() || layers->size() != want)
    return r.fail("$.layers", fmt::format("an array of {} layers (embedding, blocks, head)", want),
                  layers == j.end() ? nullptr : &*layers);
  for (size_t l = 0; l < want; ++l) {
    const Json &o = (*layers)[l];
    std::string path = jsonPath("$.layers", l);
    if (auto err = r.expectObject(o, path))
      return err;
    if (auto err = r.onlyKeys(o, path, {"layer", "bytes", "count", "digest"}))
      return err;
    int64_t index = -1, bytes = 0, count = 0;
    CheckpointManifest::Layer layer;
    if (auto err = r.getInt(o, path, "layer", index, true))
      return err;
    if (size_t(index) != l)
      return r.fail(jsonPath(path, "layer"), fmt::format("{} (layers are listed in order)", l),
                    &o["layer"]);
    if (auto err = r.getInt(o, path, "bytes", bytes, true))
      return err;
    if (auto err = r.getInt(o, path, "count", count, true))
      return err;
    if (auto err = r.getString(o, path, "digest", layer.digest, true))
      return err;
    layer.bytes = uint64_t(bytes);
    layer.count = uint64_t(count);
    m.layers.push_back(std::move(layer));
  }
  return m;
}

} // namespace pipec
