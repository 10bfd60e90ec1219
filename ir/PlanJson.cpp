#include "ir/PlanJson.h"

#include "ir/Error.h"
#include "ir/Files.h"
#include "ir/JsonRead.h"
#include "ir/Model.h"

namespace pipec {

using OJson = nlohmann::ordered_json;

//===----------------------------------------------------------------------===//
// Writing
//===----------------------------------------------------------------------===//

static OJson instructionJson(const Instruction &i) {
  OJson o;
  o["op"] = toString(i.op).str();
  switch (i.op) {
  case OpKind::Forward:
  case OpKind::BackwardInput:
  case OpKind::BackwardWeight:
  case OpKind::Backward:
    o["stage"] = i.stage;
    o["mb"] = i.mb;
    o["slice"] = i.slice;
    if (i.part >= 0) {
      o["part"] = i.part;
      o["parts"] = i.parts;
    }
    return o;
  case OpKind::Send:
  case OpKind::Recv:
    o["tensor"] = toString(i.tensor).str();
    o["stage"] = i.stage;
    o["mb"] = i.mb;
    o["slice"] = i.slice;
    o["peer"] = i.peer;
    o["bytes"] = i.bytes;
    if (i.group != kNoGroup)
      o["group"] = i.group;
    return o;
  case OpKind::AllReduce:
    o["group"] = toString(i.collective).str();
    o["stage"] = i.stage;
    if (i.collective == CollectiveGroup::Tp) {
      o["phase"] = toString(i.phase).str();
      o["mb"] = i.mb;
      o["slice"] = i.slice;
      o["part"] = i.part;
      o["parts"] = i.parts;
    }
    o["bytes"] = i.bytes;
    return o;
  case OpKind::OptimizerStep:
    return o;
  }
  return o;
}

std::string writePlanJson(const Plan &plan) {
  OJson j;
  j["format"] = "pipeplan/1";
  j["schedule"] = plan.schedule;
  j["model"] = plan.model;
  j["time_unit"] = plan.timeUnit;
  const ParallelConfig &pc = plan.parallel;
  OJson par;
  par["pp"] = pc.pp;
  par["vpp"] = pc.vpp;
  par["tp"] = pc.tp;
  par["dp"] = pc.dp;
  par["microbatches"] = pc.microbatches;
  par["seq_splits"] = pc.seqSplits;
  if (pc.microbatchGroupSize > 0)
    par["microbatch_group_size"] = pc.microbatchGroupSize;
  j["parallel"] = par;
  j["placement"] = toString(plan.placement).str();
  // Global rank of (pp rank r, dp replica d, tp rank t) = r*dp*tp + d*tp + t (Megatron's
  // tp-dp-pp order); node = global rank / gpus_per_node.
  j["topology"] = OJson{{"order", "tp-dp-pp"}, {"gpus_per_node", plan.gpusPerNode}};
  j["state_bytes_per_param_byte"] = plan.stateBytesPerParamByte;
  if (plan.transformer) {
    const TransformerConfig &t = *plan.transformer;
    j["transformer"] = OJson{{"num_layers", t.numLayers},
                             {"hidden_size", t.hiddenSize},
                             {"num_attention_heads", t.numAttentionHeads},
                             {"ffn_hidden_size", t.ffnHiddenSize},
                             {"vocab_size", t.vocabSize},
                             {"seq_length", t.seqLength},
                             {"microbatch_size", t.microbatchSize},
                             {"dtype", t.dtype},
                             {"tie_embeddings", t.tieEmbeddings}};
  }
  OJson slices = OJson::array();
  for (auto [b, e] : plan.seqSlices)
    slices.push_back(OJson::array({b, e}));
  j["seq_slices"] = slices;
  OJson stages = OJson::array();
  for (const StageInfo &s : plan.stages) {
    OJson o;
    o["stage"] = s.stage;
    o["rank"] = s.rank;
    o["layers"] = OJson::array({s.layerBegin, s.layerEnd});
    o["forward"] = std::vector<double>(s.forward.begin(), s.forward.end());
    o["backward_input"] = std::vector<double>(s.backwardInput.begin(), s.backwardInput.end());
    o["backward_weight"] = std::vector<double>(s.backwardWeight.begin(), s.backwardWeight.end());
    o["activation_bytes"] =
        std::vector<int64_t>(s.activationBytes.begin(), s.activationBytes.end());
    o["weight_grad_bytes"] =
        std::vector<int64_t>(s.weightGradBytes.begin(), s.weightGradBytes.end());
    o["output_bytes"] = std::vector<int64_t>(s.outputBytes.begin(), s.outputBytes.end());
    o["param_bytes"] = s.paramBytes;
    o["tp_allreduces"] = s.tpAllReduces;
    o["activation_transfer_time"] =
        std::vector<double>(s.activationTransferTime.begin(), s.activationTransferTime.end());
    o["gradient_transfer_time"] =
        std::vector<double>(s.gradientTransferTime.begin(), s.gradientTransferTime.end());
    o["tp_allreduce_time"] =
        std::vector<double>(s.tpAllReduceTime.begin(), s.tpAllReduceTime.end());
    o["dp_allreduce_time"] = s.dpAllReduceTime;
    stages.push_back(std::move(o));
  }
  j["stages"] = std::move(stages);
  OJson ranks = OJson::array();
  for (size_t r = 0; r < plan.ranks.size(); ++r) {
    OJson instrs = OJson::array();
    for (const Instruction &i : plan.ranks[r])
      instrs.push_back(instructionJson(i));
    ranks.push_back(OJson{{"rank", int(r)}, {"instructions", std::move(instrs)}});
  }
  j["ranks"] = std::move(ranks);
  const PlanStats &st = plan.stats;
  if (st.simulated || st.memory) {
    OJson stats;
    if (st.simulated) {
      stats["makespan"] = st.makespan;
      stats["bubble_ratio"] = st.bubbleRatio;
      stats["step_time"] = st.stepTime;
    }
    OJson rs = OJson::array();
    for (const RankStats &r : st.ranks) {
      OJson o;
      o["rank"] = r.rank;
      if (st.simulated) {
        o["busy"] = r.busy;
        o["span"] = r.span;
        o["start"] = r.start;
        o["end"] = r.end;
        o["step_end"] = r.stepEnd;
      }
      if (st.memory) {
        o["peak_activation_bytes"] = r.peakActivationBytes;
        o["static_bytes"] = r.staticBytes;
        o["peak_memory_bytes"] = r.peakMemoryBytes;
      }
      rs.push_back(std::move(o));
    }
    stats["ranks"] = std::move(rs);
    j["stats"] = std::move(stats);
  }
  return j.dump(1, ' ', false, OJson::error_handler_t::replace) + "\n";
}

//===----------------------------------------------------------------------===//
// Reading
//===----------------------------------------------------------------------===//

namespace {

struct PlanReader {
  const JsonReader &r;
  Plan &plan;

  template <typename T>
  llvm::Error readArray(const Json &obj, llvm::StringRef path, llvm::StringRef key,
                        llvm::SmallVectorImpl<T> &out, bool required) {
    std::string where = jsonPath(path, key);
    auto it = obj.find(key.str());
    size_t want = size_t(plan.parallel.seqSplits);
    if (it == obj.end()) {
      if (required)
        return r.fail(where, fmt::format("an array of {} numbers (one per slice)", want), nullptr);
      out.assign(want, T(0));
      return llvm::Error::success();
    }
    if (!it->is_array() || it->size() != want)
      return r.fail(where, fmt::format("an array of {} numbers (one per slice)", want), &*it);
    out.clear();
    for (size_t k = 0; k < it->size(); ++k) {
      const Json &v = (*it)[k];
      bool ok = std::is_integral_v<T> ? v.is_number_integer() : v.is_number();
      double most = std::is_integral_v<T> ? 9007199254740992.0 : 1e15; // 2^53, 1e15
      if (!ok || v.get<double>() < 0 || v.get<double>() > most)
        return r.fail(jsonPath(where, k),
                      std::is_integral_v<T> ? "an integer in [0, 2^53]" : "a number in [0, 1e15]",
                      &v);
      out.push_back(v.get<T>());
    }
    return llvm::Error::success();
  }

  llvm::Error readParallel(const Json &j) {
    auto it = j.find("parallel");
    if (it == j.end())
      return r.fail("$.parallel", "an object", nullptr);
    const Json &p = *it;
    if (auto err = r.expectObject(p, "$.parallel"))
      return err;
    if (auto err = r.onlyKeys(
            p, "$.parallel",
            {"pp", "vpp", "tp", "dp", "microbatches", "seq_splits", "microbatch_group_size"}))
      return err;
    ParallelConfig &pc = plan.parallel;
    const char *path = "$.parallel";
    int32_t *fields[] = {&pc.pp, &pc.vpp, &pc.tp, &pc.dp, &pc.microbatches, &pc.seqSplits};
    const char *names[] = {"pp", "vpp", "tp", "dp", "microbatches", "seq_splits"};
    for (size_t i = 0; i < 6; ++i)
      if (auto err = r.getInt32(p, path, names[i], *fields[i], true, 1))
        return err;
    if (auto err = r.getInt32(p, path, "microbatch_group_size", pc.microbatchGroupSize, false))
      return err;
    // The same bounds as pipec compile's (per-op tables are sized stages x microbatches x
    // slices).
    int64_t stages = int64_t(pc.pp) * pc.vpp, units = int64_t(pc.microbatches) * pc.seqSplits;
    if (stages > 4096 || units > (1 << 24) || stages * units > (int64_t(1) << 24) ||
        int64_t(pc.tp) * pc.dp > 65536)
      return inputError("{}: $.parallel: too large to be a plan (pp·vpp {}, microbatches·"
                        "seq_splits {}, their product at most 2^24; tp·dp {})",
                        r.name(), stages, units, int64_t(pc.tp) * pc.dp);
    return llvm::Error::success();
  }

  llvm::Error readStage(const Json &o, size_t index) {
    std::string path = jsonPath("$.stages", index);
    if (auto err = r.expectObject(o, path))
      return err;
    if (auto err =
            r.onlyKeys(o, path,
                       {"stage", "rank", "layers", "forward", "backward_input", "backward_weight",
                        "activation_bytes", "weight_grad_bytes", "output_bytes", "param_bytes",
                        "tp_allreduces", "activation_transfer_time", "gradient_transfer_time",
                        "tp_allreduce_time", "dp_allreduce_time"}))
      return err;
    StageInfo s;
    int32_t stage = -1;
    if (auto err = r.getInt32(o, path, "stage", stage, true))
      return err;
    if (size_t(stage) != index)
      return r.fail(jsonPath(path, "stage"), fmt::format("{} (stages are listed in order)", index),
                    &o["stage"]);
    s.stage = stage;
    if (auto err = r.getInt32(o, path, "rank", s.rank, true))
      return err;
    if (s.rank >= plan.parallel.pp)
      return r.fail(jsonPath(path, "rank"), fmt::format("a rank below pp={}", plan.parallel.pp),
                    &o["rank"]);
    auto layers = o.find("layers");
    if (layers == o.end() || !layers->is_array() || layers->size() != 2 ||
        !(*layers)[0].is_number_integer() || !(*layers)[1].is_number_integer() ||
        (*layers)[0].get<int64_t>() < 0 ||
        (*layers)[1].get<int64_t>() <= (*layers)[0].get<int64_t>() ||
        (*layers)[1].get<int64_t>() > kMaxLayers)
      return r.fail(jsonPath(path, "layers"),
                    fmt::format("[first, end) with 0 <= first < end <= {}", kMaxLayers),
                    layers == o.end() ? nullptr : &*layers);
    s.layerBegin = int((*layers)[0].get<int64_t>());
    s.layerEnd = int((*layers)[1].get<int64_t>());
    if (auto err = readArray(o, path, "forward", s.forward, true))
      return err;
    if (auto err = readArray(o, path, "backward_input", s.backwardInput, true))
      return err;
    if (auto err = readArray(o, path, "backward_weight", s.backwardWeight, true))
      return err;
    if (auto err = readArray(o, path, "activation_bytes", s.activationBytes, true))
      return err;
    if (auto err = readArray(o, path, "weight_grad_bytes", s.weightGradBytes, true))
      return err;
    if (auto err = readArray(o, path, "output_bytes", s.outputBytes, true))
      return err;
    for (size_t k = 0; k < s.activationBytes.size(); ++k)
      if (s.weightGradBytes[k] > s.activationBytes[k])
        return r.fail(jsonPath(jsonPath(path, "weight_grad_bytes"), k),
                      fmt::format("at most activation_bytes[{}] ({})", k, s.activationBytes[k]),
                      &o["weight_grad_bytes"][k]);
    if (auto err = r.getInt(o, path, "param_bytes", s.paramBytes, true))
      return err;
    if (auto err = r.getInt32(o, path, "tp_allreduces", s.tpAllReduces, false))
      return err;
    if (auto err = readArray(o, path, "activation_transfer_time", s.activationTransferTime, false))
      return err;
    if (auto err = readArray(o, path, "gradient_transfer_time", s.gradientTransferTime, false))
      return err;
    if (auto err = readArray(o, path, "tp_allreduce_time", s.tpAllReduceTime, false))
      return err;
    if (auto err = r.getNumber(o, path, "dp_allreduce_time", s.dpAllReduceTime, false))
      return err;
    plan.stages.push_back(std::move(s));
    return llvm::Error::success();
  }

  llvm::Error readIndex(const Json &o, llvm::StringRef path, llvm::StringRef key, int32_t &out,
                        int limit, llvm::StringRef what) {
    if (auto err = r.getInt32(o, path, key, out, true))
      return err;
    if (out >= limit)
      return r.fail(jsonPath(path, key), fmt::format("{} below {}", what.str(), limit),
                    &o[key.str()]);
    return llvm::Error::success();
  }

  llvm::Error readInstruction(const Json &o, llvm::StringRef path, Instruction &i) {
    if (auto err = r.expectObject(o, path))
      return err;
    std::string op;
    if (auto err = r.getString(o, path, "op", op, true))
      return err;
    if (!opKindFromString(op, i.op))
      return r.fail(jsonPath(path, "op"),
                    "one of forward, backward_input, backward_weight, backward, send, recv, "
                    "all_reduce, optimizer_step",
                    &o["op"]);
    const ParallelConfig &pc = plan.parallel;
    int stages = plan.numStages();
    auto readStageMbSlice = [&]() -> llvm::Error {
      if (auto err = readIndex(o, path, "stage", i.stage, stages, "a stage"))
        return err;
      if (auto err = readIndex(o, path, "mb", i.mb, pc.microbatches, "a microbatch"))
        return err;
      return readIndex(o, path, "slice", i.slice, pc.seqSplits, "a slice");
    };
    auto readParts = [&](bool required) -> llvm::Error {
      if (!required && !o.contains("part") && !o.contains("parts"))
        return llvm::Error::success();
      if (auto err = r.getInt32(o, path, "parts", i.parts, true, 1))
        return err;
      return readIndex(o, path, "part", i.part, i.parts, "a part");
    };
    switch (i.op) {
    case OpKind::Forward:
    case OpKind::BackwardInput:
    case OpKind::BackwardWeight:
    case OpKind::Backward:
      if (auto err = r.onlyKeys(o, path, {"op", "stage", "mb", "slice", "part", "parts"}))
        return err;
      if (auto err = readStageMbSlice())
        return err;
      return readParts(false);
    case OpKind::Send:
    case OpKind::Recv: {
      if (auto err = r.onlyKeys(o, path,
                                {"op", "tensor", "stage", "mb", "slice", "peer", "bytes", "group"}))
        return err;
      std::string tensor;
      if (auto err = r.getString(o, path, "tensor", tensor, true))
        return err;
      if (!tensorKindFromString(tensor, i.tensor))
        return r.fail(jsonPath(path, "tensor"), "\"activation\" or \"gradient\"", &o["tensor"]);
      if (auto err = readStageMbSlice())
        return err;
      if (auto err = readIndex(o, path, "peer", i.peer, pc.pp, "a pipeline rank"))
        return err;
      if (auto err = r.getInt(o, path, "bytes", i.bytes, true))
        return err;
      return r.getInt32(o, path, "group", i.group, false);
    }
    case OpKind::AllReduce: {
      if (auto err = r.onlyKeys(
              o, path, {"op", "group", "stage", "bytes", "phase", "mb", "slice", "part", "parts"}))
        return err;
      std::string group;
      if (auto err = r.getString(o, path, "group", group, true))
        return err;
      if (!collectiveGroupFromString(group, i.collective))
        return r.fail(jsonPath(path, "group"), "\"dp\", \"tp\" or \"embedding\"", &o["group"]);
      if (auto err = readIndex(o, path, "stage", i.stage, stages, "a stage"))
        return err;
      if (auto err = r.getInt(o, path, "bytes", i.bytes, true))
        return err;
      if (i.collective != CollectiveGroup::Tp)
        return llvm::Error::success();
      std::string phase;
      if (auto err = r.getString(o, path, "phase", phase, true))
        return err;
      if (!opKindFromString(phase, i.phase) ||
          !(i.phase == OpKind::Forward || i.phase == OpKind::BackwardInput ||
            i.phase == OpKind::Backward))
        return r.fail(jsonPath(path, "phase"), "\"forward\", \"backward_input\" or \"backward\"",
                      &o["phase"]);
      if (auto err = readIndex(o, path, "mb", i.mb, pc.microbatches, "a microbatch"))
        return err;
      if (auto err = readIndex(o, path, "slice", i.slice, pc.seqSplits, "a slice"))
        return err;
      return readParts(true);
    }
    case OpKind::OptimizerStep:
      return r.onlyKeys(o, path, {"op"});
    }
    return llvm::Error::success();
  }

  llvm::Error readRanks(const Json &j) {
    auto it = j.find("ranks");
    if (it == j.end())
      return r.fail("$.ranks", "an array", nullptr);
    if (!it->is_array() || it->size() != size_t(plan.parallel.pp))
      return r.fail("$.ranks", fmt::format("an array of pp={} rank streams", plan.parallel.pp),
                    &*it);
    plan.ranks.resize(it->size());
    for (size_t rk = 0; rk < it->size(); ++rk) {
      std::string path = jsonPath("$.ranks", rk);
      const Json &o = (*it)[rk];
      if (auto err = r.expectObject(o, path))
        return err;
      if (auto err = r.onlyKeys(o, path, {"rank", "instructions"}))
        return err;
      int32_t rank = -1;
      if (auto err = r.getInt32(o, path, "rank", rank, true))
        return err;
      if (size_t(rank) != rk)
        return r.fail(jsonPath(path, "rank"), fmt::format("{} (ranks are listed in order)", rk),
                      &o["rank"]);
      auto instrs = o.find("instructions");
      if (instrs == o.end() || !instrs->is_array())
        return r.fail(jsonPath(path, "instructions"), "an array",
                      instrs == o.end() ? nullptr : &*instrs);
      plan.ranks[rk].reserve(instrs->size());
      for (size_t n = 0; n < instrs->size(); ++n) {
        Instruction ins;
        if (auto err =
                readInstruction((*instrs)[n], jsonPath(jsonPath(path, "instructions"), n), ins))
          return err;
        plan.ranks[rk].push_back(ins);
      }
    }
    return llvm::Error::success();
  }

  llvm::Error readStats(const Json &j) {
    auto it = j.find("stats");
    if (it == j.end())
      return llvm::Error::success();
    // Stats are outputs of the compiler (`pipec simulate` recomputes them); read them back so
    // that a plan round-trips exactly.
    const Json &st = *it;
    if (auto err = r.expectObject(st, "$.stats"))
      return err;
    PlanStats &out = plan.stats;
    out.simulated = st.contains("makespan");
    if (auto err = r.getNumber(st, "$.stats", "makespan", out.makespan, false))
      return err;
    if (auto err = r.getNumber(st, "$.stats", "bubble_ratio", out.bubbleRatio, false, -1))
      return err;
    if (auto err = r.getNumber(st, "$.stats", "step_time", out.stepTime, false))
      return err;
    auto ranks = st.find("ranks");
    if (ranks == st.end())
      return llvm::Error::success();
    if (!ranks->is_array() || ranks->size() != size_t(plan.parallel.pp))
      return r.fail("$.stats.ranks", fmt::format("an array of pp={} entries", plan.parallel.pp),
                    &*ranks);
    for (size_t i = 0; i < ranks->size(); ++i) {
      const Json &o = (*ranks)[i];
      std::string path = jsonPath("$.stats.ranks", i);
      if (auto err = r.expectObject(o, path))
        return err;
      RankStats rs;
      rs.rank = int(i);
      out.memory = out.memory || o.contains("peak_activation_bytes");
      double *nums[] = {&rs.busy, &rs.span, &rs.start, &rs.end, &rs.stepEnd};
      const char *numNames[] = {"busy", "span", "start", "end", "step_end"};
      for (size_t n = 0; n < 5; ++n)
        if (auto err = r.getNumber(o, path, numNames[n], *nums[n], false))
          return err;
      int64_t *ints[] = {&rs.peakActivationBytes, &rs.staticBytes, &rs.peakMemoryBytes};
      const char *intNames[] = {"peak_activation_bytes", "static_bytes", "peak_memory_bytes"};
      for (size_t n = 0; n < 3; ++n)
        if (auto err = r.getInt(o, path, intNames[n], *ints[n], false))
          return err;
      out.ranks.push_back(rs);
    }
    return llvm::Error::success();
  }

  llvm::Error read(const Json &j) {
    if (auto err = r.expectObject(j, "$"))
      return err;
    if (auto err = r.onlyKeys(j, "$",
                              {"format", "schedule", "model", "time_unit", "parallel", "placement",
                               "topology", "state_bytes_per_param_byte", "transformer",
                               "seq_slices", "stages", "ranks", "stats"}))
      return err;
    std::string format;
    if (auto err = r.getString(j, "$", "format", format, true))
      return err;
    if (format != "pipeplan/1")
      return inputError("{}: $.format: expected \"pipeplan/1\", got \"{}\"", r.name(),
                        shortened(format));
    if (auto err = r.getString(j, "$", "schedule", plan.schedule, true))
      return err;
    if (auto err = r.getString(j, "$", "model", plan.model, false))
      return err;
    if (auto err = r.getString(j, "$", "time_unit", plan.timeUnit, false))
      return err;
    if (auto err = readParallel(j))
      return err;
    std::string placement = "loop";
    if (auto err = r.getString(j, "$", "placement", placement, false))
      return err;
    if (!placementFromString(placement, plan.placement))
      return r.fail("$.placement", "\"loop\" or \"v-shape\"", &j["placement"]);
    if (auto it = j.find("topology"); it != j.end()) {
      if (auto err = r.expectObject(*it, "$.topology"))
        return err;
      int64_t gpn = plan.gpusPerNode;
      if (auto err =
              r.getIntInRange(*it, "$.topology", "gpus_per_node", gpn, false, 1, kMaxGpusPerNode))
        return err;
      plan.gpusPerNode = int(gpn);
    }
    if (auto err =
            r.getNumber(j, "$", "state_bytes_per_param_byte", plan.stateBytesPerParamByte, false))
      return err;
    if (auto it = j.find("transformer"); it != j.end()) {
      // The same object and checks as a model spec's "transformer".
      Json spec = {{"format", "pipemodel/1"}, {"transformer", *it}};
      auto model = parseModelSpec(spec.dump(), r.name());
      if (!model)
        return model.takeError();
      plan.transformer = model->transformer;
    }
    auto slices = j.find("seq_slices");
    size_t k = size_t(plan.parallel.seqSplits);
    if (slices == j.end() || !slices->is_array() || slices->size() != k)
      return r.fail("$.seq_slices", fmt::format("an array of seq_splits={} [begin, end) pairs", k),
                    slices == j.end() ? nullptr : &*slices);
    // The slices cut one sequence: each begins where the one before ends, the first at 0, and
    // a transformer's end at its seq_length (a runtime sizes its buffers by them).
    const int64_t length = plan.transformer ? plan.transformer->seqLength : int64_t(1) << 40;
    for (size_t s = 0; s < k; ++s) {
      const Json &p = (*slices)[s];
      const int64_t begin = s == 0 ? 0 : plan.seqSlices.back().second;
      if (!p.is_array() || p.size() != 2 || !p[0].is_number_integer() ||
          !p[1].is_number_integer() || p[0].get<int64_t>() != begin ||
          p[1].get<int64_t>() <= begin || p[1].get<int64_t>() > length)
        return r.fail(jsonPath("$.seq_slices", s),
                      plan.transformer
                          ? fmt::format("[{}, end) with {} < end <= seq_length {}", begin, begin,
                                        length)
                          : fmt::format("[{}, end) with end > {}", begin, begin),
                      &p);
      plan.seqSlices.emplace_back(begin, p[1].get<int64_t>());
    }
    if (plan.transformer && plan.seqSlices.back().second != length)
      return r.fail(jsonPath("$.seq_slices", k - 1),
                    fmt::format("a last slice ending at the model's seq_length {}", length),
                    &(*slices)[k - 1]);
    auto stages = j.find("stages");
    size_t want = size_t(plan.parallel.numStages());
    if (stages == j.end() || !stages->is_array() || stages->size() != want)
      return r.fail("$.stages", fmt::format("an array of pp·vpp={} stages", want),
                    stages == j.end() ? nullptr : &*stages);
    for (size_t s = 0; s < want; ++s)
      if (auto err = readStage((*stages)[s], s))
        return err;
    if (auto err = readRanks(j))
      return err;
    return readStats(j);
  }
};

} // namespace

llvm::Expected<Plan> parsePlanJson(llvm::StringRef text, llvm::StringRef source) {
  JsonReader r(source);
  auto parsed = r.parse(text);
  if (!parsed)
    return parsed.takeError();
  Plan plan;
  PlanReader reader{r, plan};
  if (auto err = reader.read(*parsed))
    return err;
  return plan;
}

llvm::Expected<Plan> loadPlan(llvm::StringRef path) {
  auto text = readFile(path, kPlanInput);
  if (!text)
    return text.takeError();
  return parsePlanJson(*text, path);
}

} // namespace pipec
