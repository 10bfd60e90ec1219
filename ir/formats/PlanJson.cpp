#include "ir/formats/PlanJson.h"

#include "ir/Model.h"
#include "ir/formats/JsonRead.h"
#include "ir/formats/JsonScan.h"
#include "ir/formats/SpecJson.h"
#include "ir/support/Error.h"
#include "ir/support/Files.h"
#include "ir/support/Limits.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/raw_ostream.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <optional>
#include <vector>

namespace pipec {

using OJson = nlohmann::ordered_json;

//===----------------------------------------------------------------------===//
// Writing
//===----------------------------------------------------------------------===//

/// One instruction on one line, its fields (docs/contracts.md#plan-pipeplan1) in a fixed order: a
/// plan's streams are most of its file, and a line each is both the smallest pretty form and the
/// easiest to grep.
static void writeInstruction(llvm::raw_ostream &os, const Instruction &i) {
  auto field = [&](llvm::StringRef key, auto value) { os << ", \"" << key << "\": " << value; };
  auto name = [](llvm::StringRef s) { return "\"" + s.str() + "\""; };
  os << "    {\"op\": \"" << toString(i.op) << '"';
  switch (i.op) {
  case OpKind::Forward:
  case OpKind::BackwardInput:
  case OpKind::BackwardWeight:
  case OpKind::Backward:
    field("stage", i.stage);
    field("mb", i.mb);
    field("slice", i.slice);
    if (i.part >= 0) {
      field("part", i.part);
      field("parts", i.parts);
    }
    break;
  case OpKind::Send:
  case OpKind::Recv:
    field("tensor", name(toString(i.tensor)));
    field("stage", i.stage);
    field("mb", i.mb);
    field("slice", i.slice);
    field("peer", i.peer);
    field("bytes", i.bytes);
    if (i.group != kNoGroup)
      field("group", i.group);
    break;
  case OpKind::AllReduce:
    field("group", name(toString(i.collective)));
    field("stage", i.stage);
    if (i.collective == CollectiveGroup::Tp) {
      field("phase", name(toString(i.phase)));
      field("mb", i.mb);
      field("slice", i.slice);
      field("part", i.part);
      field("parts", i.parts);
    }
    field("bytes", i.bytes);
    break;
  case OpKind::OptimizerStep:
    break;
  }
  os << '}';
}

/// `value` as nlohmann's pretty printer writes it one level down (after a key at indent 1).
/// The spec's "transformer" object (pipemodel/1): the sizes, then the block's variants only where
/// they are not GPT-2's, so that GPT-2 plans and specs read as before.
static OJson transformerJson(const TransformerConfig &t) {
  OJson o{{"num_layers", t.numLayers},
          {"hidden_size", t.hiddenSize},
          {"num_attention_heads", t.numAttentionHeads},
          {"ffn_hidden_size", t.ffnHiddenSize},
          {"vocab_size", t.vocabSize},
          {"seq_length", t.seqLength},
          {"microbatch_size", t.microbatchSize},
          {"dtype", t.dtype},
          {"tie_embeddings", t.tieEmbeddings},
          {"attention", toString(t.attention).str()},
          {"recompute", toString(t.recompute).str()}};
  if (t.norm != Norm::LayerNorm)
    o["norm"] = toString(t.norm).str();
  if (t.mlp != Mlp::Gelu)
    o["mlp"] = toString(t.mlp).str();
  if (t.position != Position::Learned) {
    o["position"] = toString(t.position).str();
    o["rope_theta"] = t.ropeTheta;
  }
  if (t.numQueryGroups > 0)
    o["num_query_groups"] = t.numQueryGroups;
  if (!t.bias)
    o["bias"] = false;
  if (t.normEps != 1e-5)
    o["norm_eps"] = t.normEps;
  if (t.fp8Gemms)
    o["gemm_precision"] = "fp8";
  if (t.attentionDropout > 0)
    o["attention_dropout"] = t.attentionDropout;
  if (t.hiddenDropout > 0)
    o["hidden_dropout"] = t.hiddenDropout;
  return o;
}

std::string modelSpecJson(llvm::StringRef name, const TransformerConfig &t) {
  OJson j{{"format", "pipemodel/1"}, {"name", name.str()}, {"transformer", transformerJson(t)}};
  return j.dump(2, ' ', false, OJson::error_handler_t::replace) + "\n";
}

static void writeNested(llvm::raw_ostream &os, const OJson &value) {
  std::string text = value.dump(1, ' ', false, OJson::error_handler_t::replace);
  for (char c : text) {
    os << c;
    if (c == '\n')
      os << ' ';
  }
}

/// The plan's rank order, tp fastest (docs/contracts.md): "topology.order".
static const char *rankOrder(const ParallelConfig &pc) {
  return pc.cp > 1 ? "tp-cp-dp-pp" : "tp-dp-pp";
}

/// Every member of the plan's document but "ranks" (the instruction streams).
static OJson headerJson(const Plan &plan) {
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
  if (pc.cp > 1) // written only where used, so that other plans read as before
    par["cp"] = pc.cp;
  if (pc.microbatchGroupSize > 0)
    par["microbatch_group_size"] = pc.microbatchGroupSize;
  // Written only when on, so that plans without them read as before.
  if (pc.sequenceParallel)
    par["sequence_parallel"] = true;
  if (pc.distributedOptimizer)
    par["distributed_optimizer"] = true;
  j["parallel"] = par;
  j["placement"] = toString(plan.placement).str();
  // Global rank of (pp rank r, dp replica d, cp rank c, tp rank t) = ((r*dp + d)*cp + c)*tp + t
  // (Megatron's tp-cp-dp-pp order; tp-dp-pp without cp); node = global rank / gpus_per_node.
  j["topology"] = OJson{{"order", rankOrder(pc)}, {"gpus_per_node", plan.gpusPerNode}};
  j["state_bytes_per_param_byte"] = plan.stateBytesPerParamByte;
  if (plan.optimizerSyncTime > 0)
    j["optimizer_sync_time"] = plan.optimizerSyncTime;
  if (plan.postValidation)
    j["post_validation"] = true;
  if (plan.overlapGradReduce)
    j["grad_reduce_overlap"] = true;
  if (plan.blockingP2p)
    j["p2p_blocking"] = true;
  if (plan.transformer)
    j["transformer"] = transformerJson(*plan.transformer);
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
    auto nonzero = [](llvm::ArrayRef<int64_t> v) {
      return llvm::any_of(v, [](int64_t b) { return b != 0; });
    };
    if (nonzero(s.backwardPeakBytes))
      o["backward_peak_bytes"] =
          std::vector<int64_t>(s.backwardPeakBytes.begin(), s.backwardPeakBytes.end());
    if (!s.fusedBackwardPeakBytes.empty())
      o["fused_backward_peak_bytes"] =
          std::vector<int64_t>(s.fusedBackwardPeakBytes.begin(), s.fusedBackwardPeakBytes.end());
    if (nonzero(s.workspaceBytes))
      o["workspace_bytes"] = std::vector<int64_t>(s.workspaceBytes.begin(), s.workspaceBytes.end());
    if (nonzero(s.sequenceKvBytes))
      o["sequence_kv_bytes"] =
          std::vector<int64_t>(s.sequenceKvBytes.begin(), s.sequenceKvBytes.end());
    if (s.sequenceGradBytes > 0)
      o["sequence_grad_bytes"] = s.sequenceGradBytes;
    o["param_bytes"] = s.paramBytes;
    o["tp_allreduces"] = s.tpAllReduces;
    o["activation_transfer_time"] =
        std::vector<double>(s.activationTransferTime.begin(), s.activationTransferTime.end());
    o["gradient_transfer_time"] =
        std::vector<double>(s.gradientTransferTime.begin(), s.gradientTransferTime.end());
    o["tp_allreduce_time"] =
        std::vector<double>(s.tpAllReduceTime.begin(), s.tpAllReduceTime.end());
    o["dp_allreduce_time"] = s.dpAllReduceTime;
    if (s.optimizerTime > 0)
      o["optimizer_time"] = s.optimizerTime;
    stages.push_back(std::move(o));
  }
  j["stages"] = std::move(stages);
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
    if (!rs.empty()) // (a plan read without per-rank stats writes none back)
      stats["ranks"] = std::move(rs);
    j["stats"] = std::move(stats);
  }
  return j;
}

std::string planHeaderJson(const Plan &plan) { return headerJson(plan).dump(); }

void writePlanJson(const Plan &plan, llvm::raw_ostream &os) {
  const OJson j = headerJson(plan);
  // The document as nlohmann prints j with "ranks" inserted before "stats" (indent 1), except
  // that each instruction takes one line; streamed: every member but the ranks from the small
  // in-memory header, the ranks written directly.
  os << "{\n";
  bool first = true;
  auto member = [&](const std::string &key) {
    os << (first ? "" : ",\n") << " \"" << key << "\": ";
    first = false;
  };
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "stats")
      break;
    member(it.key());
    writeNested(os, it.value());
  }
  member("ranks");
  if (plan.ranks.empty())
    os << "[]";
  else
    os << "[\n";
  for (size_t r = 0; r < plan.ranks.size(); ++r) {
    os << "  {\n   \"rank\": " << r << ",\n   \"instructions\": ";
    const auto &stream = plan.ranks[r];
    if (stream.empty()) {
      os << "[]";
    } else {
      os << "[\n";
      for (size_t n = 0; n < stream.size(); ++n) {
        writeInstruction(os, stream[n]);
        os << (n + 1 < stream.size() ? ",\n" : "\n");
      }
      os << "   ]";
    }
    os << "\n  }" << (r + 1 < plan.ranks.size() ? ",\n" : "\n");
  }
  if (!plan.ranks.empty())
    os << " ]";
  if (auto it = j.find("stats"); it != j.end()) {
    member("stats");
    writeNested(os, *it);
  }
  os << "\n}\n";
}

std::string writePlanJson(const Plan &plan) {
  std::string text;
  llvm::raw_string_ostream os(text);
  writePlanJson(plan, os);
  os.flush();
  return text;
}

//===----------------------------------------------------------------------===//
// Reading
//===----------------------------------------------------------------------===//

namespace {

struct PlanReader {
  const JsonReader &r;
  Plan &plan;
  /// Set while instructions are read from the stream, before "parallel" and "stages" are
  /// known: their indices are range-checked later, by checkIndices().
  bool deferIndices = false;
  /// The instructions the streaming parser took out of $.ranks[r].instructions, by rank.
  std::vector<std::vector<Instruction>> *streamed = nullptr;

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
    if (auto err =
            r.onlyKeys(p, "$.parallel",
                       {"pp", "vpp", "tp", "dp", "microbatches", "seq_splits", "cp",
                        "microbatch_group_size", "sequence_parallel", "distributed_optimizer"}))
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
    if (auto err = r.getInt32(p, path, "cp", pc.cp, false, 1))
      return err;
    if (pc.cp > 1 && pc.seqSplits > 1)
      return inputError("{}: $.parallel: cp {} with seq_splits {}: a plan cuts the sequence one "
                        "way, not both",
                        r.name(), pc.cp, pc.seqSplits);
    if (auto err = r.getBool(p, path, "sequence_parallel", pc.sequenceParallel, false))
      return err;
    if (auto err = r.getBool(p, path, "distributed_optimizer", pc.distributedOptimizer, false))
      return err;
    // The same bounds as pipec compile's (per-op tables are sized stages x microbatches x
    // slices).
    int64_t stages = int64_t(pc.pp) * pc.vpp, units = int64_t(pc.microbatches) * pc.seqSplits;
    if (stages > kMaxStages || units > kMaxUnits || stages * units > kMaxUnits ||
        int64_t(pc.tp) * pc.dp * pc.cp > kMaxTpDp)
      return inputError("{}: $.parallel: too large to be a plan (pp·vpp {}, microbatches·"
                        "seq_splits {}, their product at most 2^24; tp·cp·dp {})",
                        r.name(), stages, units, int64_t(pc.tp) * pc.dp * pc.cp);
    return llvm::Error::success();
  }

  llvm::Error readStage(const Json &o, size_t index) {
    std::string path = jsonPath("$.stages", index);
    if (auto err = r.expectObject(o, path))
      return err;
    if (auto err = r.onlyKeys(o, path,
                              {"stage",
                               "rank",
                               "layers",
                               "forward",
                               "backward_input",
                               "backward_weight",
                               "activation_bytes",
                               "weight_grad_bytes",
                               "output_bytes",
                               "backward_peak_bytes",
                               "fused_backward_peak_bytes",
                               "workspace_bytes",
                               "sequence_kv_bytes",
                               "sequence_grad_bytes",
                               "param_bytes",
                               "tp_allreduces",
                               "activation_transfer_time",
                               "gradient_transfer_time",
                               "tp_allreduce_time",
                               "dp_allreduce_time",
                               "optimizer_time"}))
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
    if (auto err = readArray(o, path, "backward_peak_bytes", s.backwardPeakBytes, false))
      return err;
    if (o.contains("fused_backward_peak_bytes"))
      if (auto err =
              readArray(o, path, "fused_backward_peak_bytes", s.fusedBackwardPeakBytes, true))
        return err;
    if (auto err = readArray(o, path, "workspace_bytes", s.workspaceBytes, false))
      return err;
    if (auto err = readArray(o, path, "sequence_kv_bytes", s.sequenceKvBytes, false))
      return err;
    if (auto err = r.getInt(o, path, "sequence_grad_bytes", s.sequenceGradBytes, false))
      return err;
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
    if (auto err = r.getNumber(o, path, "optimizer_time", s.optimizerTime, false))
      return err;
    plan.stages.push_back(std::move(s));
    return llvm::Error::success();
  }

  llvm::Error readIndex(const Json &o, llvm::StringRef path, llvm::StringRef key, int32_t &out,
                        int limit, llvm::StringRef what) {
    if (auto err = r.getInt32(o, path, key, out, true))
      return err;
    if (!deferIndices && out >= limit)
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

  /// readIndex's range checks, for an instruction read before the plan's sizes were known.
  llvm::Error checkIndices(const Instruction &i, size_t rank, size_t index) {
    const ParallelConfig &pc = plan.parallel;
    auto below = [&](llvm::StringRef key, int32_t value, int limit,
                     llvm::StringRef what) -> llvm::Error {
      if (value < limit)
        return llvm::Error::success();
      Json got = value;
      std::string path = jsonPath(jsonPath(jsonPath("$.ranks", rank), "instructions"), index);
      return r.fail(jsonPath(path, key), fmt::format("{} below {}", what.str(), limit), &got);
    };
    auto stageMbSlice = [&]() -> llvm::Error {
      if (auto err = below("stage", i.stage, plan.numStages(), "a stage"))
        return err;
      if (auto err = below("mb", i.mb, pc.microbatches, "a microbatch"))
        return err;
      return below("slice", i.slice, pc.seqSplits, "a slice");
    };
    switch (i.op) {
    case OpKind::Forward:
    case OpKind::BackwardInput:
    case OpKind::BackwardWeight:
    case OpKind::Backward:
      if (auto err = stageMbSlice())
        return err;
      return i.part >= 0 ? below("part", i.part, i.parts, "a part") : llvm::Error::success();
    case OpKind::Send:
    case OpKind::Recv:
      if (auto err = stageMbSlice())
        return err;
      return below("peer", i.peer, pc.pp, "a pipeline rank");
    case OpKind::AllReduce:
      if (auto err = below("stage", i.stage, plan.numStages(), "a stage"))
        return err;
      if (i.collective != CollectiveGroup::Tp)
        return llvm::Error::success();
      if (auto err = below("mb", i.mb, pc.microbatches, "a microbatch"))
        return err;
      if (auto err = below("slice", i.slice, pc.seqSplits, "a slice"))
        return err;
      return below("part", i.part, i.parts, "a part");
    case OpKind::OptimizerStep:
      return llvm::Error::success();
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
      if (streamed && instrs->empty() && rk < streamed->size()) {
        // Read while streaming; only the ranges are left to check.
        plan.ranks[rk] = std::move((*streamed)[rk]);
        for (size_t n = 0; n < plan.ranks[rk].size(); ++n)
          if (auto err = checkIndices(plan.ranks[rk][n], rk, n))
            return err;
        continue;
      }
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
    if (auto err = r.onlyKeys(st, "$.stats", {"makespan", "bubble_ratio", "step_time", "ranks"}))
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
      if (auto err = r.onlyKeys(o, path,
                                {"rank", "busy", "span", "start", "end", "step_end",
                                 "peak_activation_bytes", "static_bytes", "peak_memory_bytes"}))
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
    if (auto err =
            r.expectDocument(j, "pipeplan/1",
                             {"format", "schedule", "model", "time_unit", "parallel", "placement",
                              "topology", "state_bytes_per_param_byte", "optimizer_sync_time",
                              "post_validation", "grad_reduce_overlap", "p2p_blocking",
                              "transformer", "seq_slices", "stages", "ranks", "stats"}))
      return err;
    if (auto err = r.getName(j, "$", "schedule", plan.schedule, true))
      return err;
    if (auto err = r.getName(j, "$", "model", plan.model, false))
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
      if (auto err = r.onlyKeys(*it, "$.topology", {"order", "gpus_per_node"}))
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
    if (auto err = r.getNumber(j, "$", "optimizer_sync_time", plan.optimizerSyncTime, false))
      return err;
    if (auto err = r.getBool(j, "$", "post_validation", plan.postValidation, false))
      return err;
    if (auto err = r.getBool(j, "$", "grad_reduce_overlap", plan.overlapGradReduce, false))
      return err;
    if (auto err = r.getBool(j, "$", "p2p_blocking", plan.blockingP2p, false))
      return err;
    if (auto it = j.find("transformer"); it != j.end()) {
      // The same object and checks as a model spec's "transformer".
      Json spec = {{"format", "pipemodel/1"}, {"transformer", *it}};
      auto model = parseModelSpec(spec.dump(), r.name());
      if (!model)
        return model.takeError();
      plan.transformer = model->transformer;
    }
    int fits = 1;
    if (std::optional<std::string> why =
            contextParallelProblem(plan.transformer, plan.parallel, fits))
      return inputError("{}: $.parallel.cp: cp {} {}", r.name(), plan.parallel.cp, *why);
    // The rank order is derived from the parallel sizes, written for readers: a plan that says
    // another order would still be placed as this one, so it is refused rather than ignored.
    if (auto it = j.find("topology"); it != j.end()) {
      std::string order = rankOrder(plan.parallel);
      if (auto err = r.getString(*it, "$.topology", "order", order, false))
        return err;
      if (order != rankOrder(plan.parallel))
        return r.fail("$.topology.order",
                      fmt::format("\"{}\" (pipec's rank order for this plan's $.parallel)",
                                  rankOrder(plan.parallel)),
                      &(*it)["order"]);
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
                      plan.transformer ? fmt::format("[{}, end) with {} < end <= seq_length {}",
                                                     begin, begin, length)
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

/// The streaming parse: nlohmann's SAX events build the document in memory except
/// $.ranks[r].instructions[n], the bulk of a plan, which go straight into Instruction records
/// (40 bytes each instead of a JSON object's few hundred). An instruction object of the usual
/// shape (flat, known fields, in range) is decoded from its events; any other is rebuilt as a
/// JSON object from them and read by PlanReader::readInstruction, so that its error is the one
/// the whole-document reader gives. Indices are range-checked once "parallel" and "stages" are
/// known (PlanReader::checkIndices), so the members may come in any order.
class PlanSax {
public:
  using number_integer_t = Json::number_integer_t;
  using number_unsigned_t = Json::number_unsigned_t;
  using number_float_t = Json::number_float_t;
  using string_t = Json::string_t;
  using binary_t = Json::binary_t;

  static constexpr size_t kMaxDepth = 64;

  PlanSax(PlanReader &reader, Json &root) : reader(reader), dom(root, /*allow_exceptions=*/false) {
    reader.deferIndices = true;
    reader.streamed = &streams;
  }

  bool null() { return value(Event::Null); }
  bool boolean(bool b) {
    Event e(Event::Bool);
    e.i = b;
    return value(e);
  }
  bool number_integer(number_integer_t v) {
    Event e(Event::Int);
    e.i = v;
    return value(e);
  }
  bool number_unsigned(number_unsigned_t v) {
    Event e(Event::Unsigned);
    e.u = v;
    return value(e);
  }
  bool number_float(number_float_t v, const string_t &) {
    Event e(Event::Float);
    e.d = v;
    return value(e);
  }
  bool string(string_t &v) {
    Event e(Event::String);
    e.s = std::move(v);
    return value(e);
  }
  bool binary(binary_t &) { return value(Event::Null); }
  bool key(string_t &k) {
    if (tooDeep())
      return true;
    if (capturing) {
      Event e(Event::Key);
      e.s = std::move(k);
      events.push_back(std::move(e));
      return true;
    }
    stack.back().key = k;
    return dom.key(k);
  }
  bool start_object(std::size_t n) { return open(true, n); }
  bool end_object() { return close(true); }
  bool start_array(std::size_t n) { return open(false, n); }
  bool end_array() { return close(false); }
  bool parse_error(std::size_t position, const std::string &,
                   const nlohmann::detail::exception &e) {
    errorAt = position;
    outOfRange = dynamic_cast<const nlohmann::detail::out_of_range *>(&e) != nullptr;
    return false;
  }

  /// Set when the handler stopped the parse (an instruction's error, a syntax error).
  llvm::Error error = llvm::Error::success();
  size_t errorAt = 0;
  bool outOfRange = false;
  size_t deepest = 0;

private:
  struct Event {
    enum Kind : uint8_t {
      Null,
      Bool,
      Int,
      Unsigned,
      Float,
      String,
      Key,
      Open,
      Close,
      OpenArray,
      CloseArray
    } kind;
    int64_t i = 0;
    uint64_t u = 0;
    double d = 0;
    std::string s;
    Event(Kind k) : kind(k) {}
  };
  struct Frame {
    bool object;
    size_t count = 0; // elements so far (arrays)
    std::string key;  // the current member (objects)
  };

  PlanReader &reader;
  nlohmann::detail::json_sax_dom_parser<Json> dom;
  std::vector<Frame> stack;
  std::vector<std::vector<Instruction>> streams;
  bool capturing = false;
  size_t captureDepth = 0, rank = 0, index = 0;
  size_t depth = 0; // of every container open now, built or not
  std::vector<Event> events;

  bool tooDeep() const { return deepest > kMaxDepth; }

  static std::string instructionPath(size_t rank, size_t index) {
    return jsonPath(jsonPath(jsonPath("$.ranks", rank), "instructions"), index);
  }

  /// Inside $.ranks[r].instructions: the next value is an instruction. (Set when that array
  /// opens, so that no key is compared per value.)
  bool atInstruction() const { return inInstructions && stack.size() == 4; }
  bool inInstructions = false;

  bool value(Event e) {
    if (tooDeep())
      return true;
    if (capturing) {
      events.push_back(std::move(e));
      return true;
    }
    if (atInstruction()) {
      // An instruction that is not an object.
      events.assign(1, std::move(e));
      Json got;
      rebuild(got);
      error = reader.r.fail(instructionPath(stack[1].count - 1, stack[3].count), "an object", &got);
      return false;
    }
    if (!stack.empty() && !stack.back().object)
      ++stack.back().count;
    switch (e.kind) {
    case Event::Null:
      return dom.null();
    case Event::Bool:
      return dom.boolean(e.i != 0);
    case Event::Int:
      return dom.number_integer(e.i);
    case Event::Unsigned:
      return dom.number_unsigned(e.u);
    case Event::Float:
      return dom.number_float(e.d, "");
    case Event::String:
      return dom.string(e.s);
    case Event::Key:
    case Event::Open:
    case Event::Close:
    case Event::OpenArray:
    case Event::CloseArray:
      break;
    }
    return true;
  }

  bool open(bool object, std::size_t n) {
    deepest = std::max(deepest, ++depth);
    if (tooDeep())
      return true; // keep counting the depth for the message; build nothing more
    if (capturing) {
      ++captureDepth;
      events.push_back(Event(object ? Event::Open : Event::OpenArray));
      return true;
    }
    if (!object && atInstruction()) {
      Json got = Json::array();
      error = reader.r.fail(instructionPath(stack[1].count - 1, stack[3].count), "an object", &got);
      return false;
    }
    if (object && atInstruction()) {
      capturing = true;
      captureDepth = 1;
      rank = stack[1].count - 1;
      index = stack[3].count++;
      events.clear();
      events.push_back(Event(Event::Open));
      return true;
    }
    if (!stack.empty() && !stack.back().object)
      ++stack.back().count;
    stack.push_back(Frame{object, 0, {}});
    if (!object && stack.size() == 4 && stack[0].object && stack[0].key == "ranks" &&
        !stack[1].object && stack[2].object && stack[2].key == "instructions")
      inInstructions = true;
    return object ? dom.start_object(n) : dom.start_array(n);
  }

  bool close(bool object) {
    --depth;
    if (tooDeep())
      return true;
    if (capturing) {
      events.push_back(Event(object ? Event::Close : Event::CloseArray));
      if (--captureDepth > 0)
        return true;
      capturing = false;
      return decode();
    }
    if (stack.size() == 4)
      inInstructions = false;
    stack.pop_back();
    return object ? dom.end_object() : dom.end_array();
  }

  /// The captured instruction: decoded directly, or read from its JSON object.
  bool decode() {
    if (streams.size() <= rank)
      streams.resize(rank + 1);
    Instruction ins;
    if (!quick(ins)) {
      Json obj;
      rebuild(obj);
      if (llvm::Error err = reader.readInstruction(obj, instructionPath(rank, index), ins)) {
        error = std::move(err);
        return false;
      }
    }
    streams[rank].push_back(ins);
    return true;
  }

  /// The captured events as a JSON value (for the reader's messages).
  void rebuild(Json &out) {
    nlohmann::detail::json_sax_dom_parser<Json> b(out, false);
    for (Event &e : events) {
      switch (e.kind) {
      case Event::Null:
        b.null();
        break;
      case Event::Bool:
        b.boolean(e.i != 0);
        break;
      case Event::Int:
        b.number_integer(e.i);
        break;
      case Event::Unsigned:
        b.number_unsigned(e.u);
        break;
      case Event::Float:
        b.number_float(e.d, "");
        break;
      case Event::String:
        b.string(e.s);
        break;
      case Event::Key:
        b.key(e.s);
        break;
      case Event::Open:
        b.start_object(std::size_t(-1));
        break;
      case Event::Close:
        b.end_object();
        break;
      case Event::OpenArray:
        b.start_array(std::size_t(-1));
        break;
      case Event::CloseArray:
        b.end_array();
        break;
      }
    }
  }

  /// A flat object of known fields that readInstruction would accept, decoded without building
  /// it; false for anything else (readInstruction then says what is wrong).
  bool quick(Instruction &i) {
    Fields f;
    if (events.size() < 2 || events.size() % 2 != 0)
      return false; // Open, (Key, scalar)*, Close
    for (size_t e = 1; e + 1 < events.size(); e += 2) {
      const Event &k = events[e], &v = events[e + 1];
      if (k.kind != Event::Key || v.kind == Event::Open || v.kind == Event::OpenArray ||
          v.kind == Event::Key)
        return false;
      int which = fieldOf(k.s);
      if (which < 0)
        return false;
      FieldValue &to = f[which];
      to = FieldValue{};
      switch (v.kind) {
      case Event::Int:
        to.kind = FieldValue::Int;
        to.i = v.i;
        break;
      case Event::Unsigned:
        to.kind = FieldValue::Unsigned;
        to.u = v.u;
        break;
      case Event::String:
        to.kind = FieldValue::String;
        to.s = v.s;
        break;
      default:
        to.kind = FieldValue::Other;
        break;
      }
    }
    return decodeFields(f, i);
  }

public:
  /// The scanner's offer (json::scanJson): an instruction of the usual shape decoded straight
  /// from the text, `{"op": "F", "stage": 0, ...}` with string and non-negative integer
  /// members; false, consuming nothing, for anything else (the events then take it).
  template <typename Input> bool tryObject(Input &in) {
    if (capturing || tooDeep() || !atInstruction())
      return false;
    in.need(kInstructionText);
    const char *p = in.p;
    Fields f;
    Instruction ins;
    if (!scanFields(p, in.end, f) || !decodeFields(f, ins))
      return false;
    in.p = p;
    deepest = std::max(deepest, depth + 1);
    rank = stack[1].count - 1;
    index = stack[3].count++;
    if (streams.size() <= rank)
      streams.resize(rank + 1);
    streams[rank].push_back(ins);
    return true;
  }

private:
  /// The most text an instruction decoded from the text may take (pipec writes about 80).
  static constexpr size_t kInstructionText = 1024;
  static_assert(kInstructionText * 4 <= json::FileInput::kMinBlock,
                "a file's block holds the text an instruction may take");

  enum { Op, Tensor, Stage, Mb, Slice, Peer, Bytes, Group, Part, Parts, Phase, NumFields };
  struct FieldValue {
    enum Kind : uint8_t { Absent, Int, Unsigned, String, Other } kind = Absent;
    int64_t i = 0;
    uint64_t u = 0;
    llvm::StringRef s;
  };
  using Fields = FieldValue[NumFields];

  /// The field a key names (-1: none), without comparing it to every name.
  static int fieldOf(llvm::StringRef k) {
    switch (k.size()) {
    case 2:
      return k == "op" ? Op : k == "mb" ? Mb : -1;
    case 4:
      return k == "peer" ? Peer : k == "part" ? Part : -1;
    case 5:
      return k == "stage"   ? Stage
             : k == "slice" ? Slice
             : k == "bytes" ? Bytes
             : k == "group" ? Group
             : k == "parts" ? Parts
             : k == "phase" ? Phase
                            : -1;
    case 6:
      return k == "tensor" ? Tensor : -1;
    default:
      return -1;
    }
  }

  /// `{ "key": value, ... }` at p, keys of lower-case letters, values strings of plain ASCII
  /// or digits (no sign, fraction, exponent or leading zero; at most 15), all before `end`.
  /// p ends past the `}`. False for anything else. A repeated key keeps its last value, as
  /// nlohmann's DOM does.
  static bool scanFields(const char *&p, const char *end, Fields &f) {
    auto space = [&] {
      while (p < end && json::detail::isSpace(*p))
        ++p;
      return p < end;
    };
    auto quoted = [&](llvm::StringRef &out, bool letters) {
      const char *start = ++p;
      while (p < end && *p != '"') {
        unsigned char c = static_cast<unsigned char>(*p);
        if (letters ? !(c >= 'a' && c <= 'z') : (c < 0x20 || c >= 0x80 || c == '\\'))
          return false;
        ++p;
      }
      if (p == end)
        return false;
      out = llvm::StringRef(start, size_t(p - start));
      ++p;
      return true;
    };
    if (p == end || *p != '{')
      return false;
    ++p;
    for (;;) {
      llvm::StringRef key;
      if (!space() || *p != '"' || !quoted(key, true))
        return false;
      int which = fieldOf(key);
      if (which < 0 || !space() || *p != ':')
        return false;
      ++p;
      if (!space())
        return false;
      FieldValue v;
      if (*p == '"') {
        v.kind = FieldValue::String;
        if (!quoted(v.s, false))
          return false;
      } else if (*p >= '0' && *p <= '9') {
        const char *start = p;
        uint64_t u = 0;
        while (p < end && *p >= '0' && *p <= '9')
          u = u * 10 + uint64_t(*p++ - '0');
        if (p == end || p - start > 15 || (*start == '0' && p - start > 1) || *p == '.' ||
            *p == 'e' || *p == 'E')
          return false;
        v.kind = FieldValue::Unsigned;
        v.u = u;
      } else {
        return false;
      }
      f[which] = v;
      if (!space())
        return false;
      if (*p == '}') {
        ++p;
        return true;
      }
      if (*p != ',')
        return false;
      ++p;
    }
  }

  /// The instruction of fields that readInstruction would accept; false for anything else.
  static bool decodeFields(const Fields &f, Instruction &i) {
    constexpr int64_t kMax = int64_t(1) << 53;
    auto integer = [&](int which, int64_t min, int64_t max, int64_t &out) {
      const FieldValue &v = f[which];
      if (v.kind == FieldValue::Int && v.i >= min && v.i <= max) {
        out = v.i;
        return true;
      }
      if (v.kind == FieldValue::Unsigned && v.u <= uint64_t(max) && int64_t(v.u) >= min) {
        out = int64_t(v.u);
        return true;
      }
      return false;
    };
    auto int32 = [&](int which, int64_t min, int32_t &out) {
      int64_t wide = 0;
      if (!integer(which, min, std::min<int64_t>(kMax, INT32_MAX), wide))
        return false;
      out = int32_t(wide);
      return true;
    };
    auto text = [&](int which) -> const llvm::StringRef * {
      return f[which].kind == FieldValue::String ? &f[which].s : nullptr;
    };
    auto present = [&](int which) { return f[which].kind != FieldValue::Absent; };
    auto only = [&](std::initializer_list<int> allowed) {
      for (int n = 0; n < NumFields; ++n)
        if (present(n) && std::find(allowed.begin(), allowed.end(), n) == allowed.end())
          return false;
      return true;
    };
    const llvm::StringRef *op = text(Op);
    if (!op || !opKindFromString(*op, i.op))
      return false;
    auto parts = [&](bool required) {
      if (!required && !present(Part) && !present(Parts))
        return true;
      return int32(Parts, 1, i.parts) && int32(Part, 0, i.part) && i.part < i.parts;
    };
    switch (i.op) {
    case OpKind::Forward:
    case OpKind::BackwardInput:
    case OpKind::BackwardWeight:
    case OpKind::Backward:
      return only({Op, Stage, Mb, Slice, Part, Parts}) && int32(Stage, 0, i.stage) &&
             int32(Mb, 0, i.mb) && int32(Slice, 0, i.slice) && parts(false);
    case OpKind::Send:
    case OpKind::Recv: {
      const llvm::StringRef *tensor = text(Tensor);
      return only({Op, Tensor, Stage, Mb, Slice, Peer, Bytes, Group}) && tensor &&
             tensorKindFromString(*tensor, i.tensor) && int32(Stage, 0, i.stage) &&
             int32(Mb, 0, i.mb) && int32(Slice, 0, i.slice) && int32(Peer, 0, i.peer) &&
             integer(Bytes, 0, kMax, i.bytes) && (!present(Group) || int32(Group, 0, i.group));
    }
    case OpKind::AllReduce: {
      const llvm::StringRef *group = text(Group);
      if (!only({Op, Group, Stage, Bytes, Phase, Mb, Slice, Part, Parts}) || !group ||
          !collectiveGroupFromString(*group, i.collective) || !int32(Stage, 0, i.stage) ||
          !integer(Bytes, 0, kMax, i.bytes))
        return false;
      if (i.collective != CollectiveGroup::Tp)
        return true;
      const llvm::StringRef *phase = text(Phase);
      return phase && opKindFromString(*phase, i.phase) &&
             (i.phase == OpKind::Forward || i.phase == OpKind::BackwardInput ||
              i.phase == OpKind::Backward) &&
             int32(Mb, 0, i.mb) && int32(Slice, 0, i.slice) && parts(true);
    }
    case OpKind::OptimizerStep:
      return only({Op});
    }
    return false;
  }
};

/// Line and column of byte `offset` of a text read from `next` (one character at a time).
template <typename Next> std::pair<size_t, size_t> lineAndColumn(size_t offset, Next next) {
  size_t line = 1, col = 1;
  for (size_t i = 0; i < offset; ++i) {
    int c = next();
    if (c < 0)
      break;
    if (c == '\n') {
      ++line;
      col = 1;
    } else {
      ++col;
    }
  }
  return {line, col};
}

enum class Parsed { Ok, Failed, Unsupported };

/// The scanner's outcome. The handler stops only with its error set; were it ever to stop
/// without one, nlohmann's parse decides.
Parsed parsedOf(json::ScanResult r, PlanSax &sax) {
  switch (r) {
  case json::ScanResult::Done:
    return Parsed::Ok;
  case json::ScanResult::Stopped:
    return sax.error ? Parsed::Failed : Parsed::Unsupported;
  case json::ScanResult::Unsupported:
    break;
  }
  return Parsed::Unsupported;
}

/// Parse a plan with `parse` (json::scanJson or nlohmann::json::sax_parse over some input)
/// without holding its text or its whole document. `where(offset)` gives the line and column
/// of a byte offset. Nothing when the scanner left the text to nlohmann.
template <typename Parse, typename Where>
std::optional<llvm::Expected<Plan>> parseStreaming(Parse parse, llvm::StringRef source, size_t size,
                                                   Where where) {
  JsonReader r(source);
  Plan plan;
  PlanReader reader{r, plan};
  Json root;
  PlanSax sax(reader, root);
  Parsed got = Parsed::Failed;
  try {
    got = parse(sax);
  } catch (const Json::exception &e) {
    return inputError("{}: unreadable JSON ({})", source.str(), e.what());
  }
  if (got == Parsed::Unsupported)
    return std::nullopt;
  if (sax.deepest > PlanSax::kMaxDepth)
    return inputError("{}: JSON nested {} levels deep; pipec's formats need at most {}",
                      source.str(), sax.deepest, PlanSax::kMaxDepth);
  if (sax.error)
    return std::move(sax.error);
  if (got == Parsed::Failed) {
    if (sax.outOfRange)
      return inputError("{}: a number is out of range (too large for a double)", source.str());
    size_t offset = sax.errorAt == 0 ? 0 : std::min(sax.errorAt - 1, size);
    auto [line, col] = where(offset);
    return inputError("{}:{}:{}: malformed JSON ({})", source.str(), line, col,
                      sax.errorAt >= size ? "unexpected end of input" : "unexpected character");
  }
  reader.deferIndices = false;
  if (auto err = reader.read(root))
    return err;
  return plan;
}

} // namespace

llvm::Expected<Plan> parsePlanJson(llvm::StringRef text, llvm::StringRef source,
                                   JsonParser parser) {
  auto where = [&](size_t offset) {
    size_t i = 0;
    return lineAndColumn(offset, [&]() -> int { return i < text.size() ? text[i++] : -1; });
  };
  if (parser == JsonParser::Fast) {
    auto scan = [&](PlanSax &sax) {
      json::TextInput in(text.begin(), text.end());
      return parsedOf(json::scanJson(in, sax), sax);
    };
    if (auto plan = parseStreaming(scan, source, text.size(), where))
      return std::move(*plan);
  }
  auto parse = [&](PlanSax &sax) {
    return Json::sax_parse(json::NulVisible{text.begin()}, json::NulVisible{text.end()}, &sax)
               ? Parsed::Ok
               : Parsed::Failed;
  };
  auto plan = parseStreaming(parse, source, text.size(), where);
  if (!plan)
    return inputError("{}: unreadable JSON", source.str());
  return std::move(*plan);
}

namespace {
/// A file's characters through a 256 KiB buffer, as an input iterator for nlohmann's parser
/// (its FILE* adapter reads a character per call; this reads a block per refill).
class FileChars {
public:
  explicit FileChars(std::FILE *file) : file(file), buffer(size_t(1) << 18) {}

  struct Iterator {
    using iterator_category = std::input_iterator_tag;
    using value_type = char;
    using difference_type = std::ptrdiff_t;
    using pointer = const char *;
    using reference = const char &;
    FileChars *in; // null: the end
    const char &operator*() const { return in->buffer[in->at]; }
    Iterator &operator++() {
      if (++in->at == in->filled)
        in->refill();
      return *this;
    }
    bool operator==(const Iterator &o) const { return atEnd() == o.atEnd(); }
    bool operator!=(const Iterator &o) const { return !(*this == o); }
    bool atEnd() const {
      if (!in)
        return true;
      if (in->at == in->filled)
        in->refill();
      return in->at == in->filled;
    }
  };

private:
  std::FILE *file;
  std::vector<char> buffer;
  size_t at = 0, filled = 0;
  void refill() {
    at = 0;
    filled = std::fread(buffer.data(), 1, buffer.size(), file);
  }
};
} // namespace

llvm::Expected<Plan> loadPlan(llvm::StringRef path) {
  // Streamed: the plan, not a JSON tree of the file, is what reading it holds (about a byte of
  // memory per byte of file, against readFile's budget of a tree).
  constexpr InputFormat kStreamedPlan{kPlanInput.name, kPlanInput.maxBytes, 1};
  bool regular = false;
  if (auto err = checkInputFile(path, kStreamedPlan, regular))
    return err;
  if (!regular) { // a pipe cannot be rewound to locate an error: read it whole
    auto text = readFile(path, kPlanInput);
    if (!text)
      return text.takeError();
    return parsePlanJson(*text, path);
  }
  std::FILE *file = std::fopen(path.str().c_str(), "rb");
  if (!file)
    return inputError("{}: cannot read: {}", path.str(), std::strerror(errno));
  uint64_t size = 0;
  if (llvm::sys::fs::file_size(path, size))
    size = 0;
  auto where = [&](size_t offset) {
    std::rewind(file);
    return lineAndColumn(offset, [&]() { return std::fgetc(file); });
  };
  auto scan = [&](PlanSax &sax) {
    json::FileInput in(file);
    return parsedOf(json::scanJson(in, sax), sax);
  };
  auto plan = parseStreaming(scan, path, size_t(size), where);
  if (!plan) { // the scanner left it to nlohmann: read it again from the start
    std::rewind(file);
    FileChars chars(file);
    auto parse = [&](PlanSax &sax) {
      return Json::sax_parse(json::NulVisible{FileChars::Iterator{&chars}},
                             json::NulVisible{FileChars::Iterator{nullptr}}, &sax)
                 ? Parsed::Ok
                 : Parsed::Failed;
    };
    plan = parseStreaming(parse, path, size_t(size), where);
  }
  std::fclose(file);
  if (!plan)
    return inputError("{}: unreadable JSON", path.str());
  return std::move(*plan);
}

} // namespace pipec
