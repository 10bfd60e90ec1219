//===- IrTest.cpp - Specs, plan JSON and the text form --------------------===//
#include "tests/TestUtil.h"

#include "ir/PlanText.h"
#include "ir/formats/PlanJson.h"
#include "ir/formats/SpecJson.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>

namespace pipec::test {
namespace {

TEST(PlanJsonTest, WriteParseWriteIsByteIdentical) {
  for (const char *s : {"gpipe", "1f1b"}) {
    Plan plan = compileOrFail(uniformModel(6, 1, 2, 0.5, 1000, 300, 0.1),
                              options(s, /*pp=*/3, /*microbatches=*/5, 1, 1, /*tp=*/2, /*dp=*/2));
    std::string text = writePlanJson(plan);
    auto back = parsePlanJson(text, "plan.json");
    ASSERT_TRUE(bool(back)) << takeMessage(back.takeError());
    EXPECT_EQ(back->ranks, plan.ranks);
    EXPECT_EQ(writePlanJson(*back), text);
  }
}

TEST(PlanJsonTest, SameInputGivesByteIdenticalOutput) {
  ModelSpec m = uniformModel(8, 1.25, 1.5, 0.75, 4096, 1024, 0.3);
  std::string a = writePlanJson(compileOrFail(m, options("1f1b", 4, 12)));
  std::string b = writePlanJson(compileOrFail(m, options("1f1b", 4, 12)));
  EXPECT_EQ(a, b);
}

TEST(PlanJsonTest, ErrorsNameTheJsonPathAndWhatWasExpected) {
  Plan plan = compileOrFail(uniformModel(2), options("1f1b", 2, 2));
  std::string text = writePlanJson(plan);
  // A string where a microbatch index belongs.
  size_t at = text.find("\"mb\": 0");
  ASSERT_NE(at, std::string::npos);
  std::string bad = text;
  bad.replace(at, 7, "\"mb\": \"zero\"");
  auto parsed = parsePlanJson(bad, "p.json");
  std::string msg = errorText(parsed.takeError());
  EXPECT_EQ(msg, "p.json: $.ranks[0].instructions[0].mb: expected an integer >= 0, got string "
                 "\"zero\"");
}

// Found by plan_fuzzer: a misspelt key inside "stats" was ignored, so the plan read without
// per-rank stats and wrote back an empty "ranks" array that it then refused to read.
TEST(PlanJsonTest, StatsTakeOnlyTheirOwnKeysAndAPlanWithoutPerRankStatsRoundTrips) {
  Plan plan = compileOrFail(uniformModel(2), options("1f1b", 2, 2));
  const std::string text = writePlanJson(plan);
  size_t at = text.find("\"ranks\": [", text.find("\"stats\""));
  ASSERT_NE(at, std::string::npos);
  std::string misspelt = text;
  misspelt.replace(at, 7, "\"Ranks\"");
  EXPECT_EQ(errorText(parsePlanJson(misspelt, "p.json").takeError()),
            "p.json: $.stats.Ranks: unknown field (valid fields: makespan, bubble_ratio, "
            "step_time, ranks)");
  // Without per-rank stats at all: read, written back without them, read again.
  auto doc = nlohmann::json::parse(text);
  doc["stats"].erase("ranks");
  auto once = parsePlanJson(doc.dump(1), "p.json");
  ASSERT_TRUE(bool(once)) << takeMessage(once.takeError());
  const std::string again = writePlanJson(*once);
  auto twice = parsePlanJson(again, "p.json");
  ASSERT_TRUE(bool(twice)) << takeMessage(twice.takeError());
  EXPECT_EQ(writePlanJson(*twice), again);
}

TEST(PlanJsonTest, TheStreamedTextIsNlohmannsPrintOfTheDocumentWithAnInstructionALine) {
  // The writer streams the ranks itself; nlohmann's own printer, given the same document, is
  // the reference: indentation, member order, number and string spelling.
  std::vector<Plan> plans = {
      compileOrFail(uniformModel(6, 1, 2, 0.5, 1000, 300, 0.1),
                    options("1f1b", 3, 5, 1, 1, /*tp=*/2, /*dp=*/2)),
      compileOrFail(tinyGpt(/*tied=*/true, 4, 8), options("zb-v", 2, 4, 2, 1, 2, 2)),
      compileOrFail(tinyGpt(false, 4, 8), options("seq1f1b", 2, 3, 1, /*seqSplits=*/2)),
      compileOrFail(uniformModel(1), options("gpipe", 1, 1)),
  };
  // The one difference: an instruction takes one line, {"key": value, ...} in nlohmann's
  // spelling of each value.
  for (const Plan &plan : plans) {
    std::string text = writePlanJson(plan);
    auto doc = nlohmann::ordered_json::parse(text);
    std::vector<std::string> lines;
    for (auto &rank : doc["ranks"])
      for (auto &ins : rank["instructions"]) {
        std::string line;
        for (auto it = ins.begin(); it != ins.end(); ++it)
          line += (line.empty() ? "{" : ", ") + nlohmann::ordered_json(it.key()).dump() + ": " +
                  it.value().dump();
        ins = "@" + std::to_string(lines.size()) + "@";
        lines.push_back(line + "}");
      }
    std::string expected = doc.dump(1, ' ', false) + "\n";
    for (size_t n = lines.size(); n-- > 0;) {
      std::string placeholder = "\"@" + std::to_string(n) + "@\"";
      size_t at = expected.find(placeholder);
      ASSERT_NE(at, std::string::npos);
      expected.replace(at, placeholder.size(), lines[n]);
    }
    EXPECT_EQ(expected, text) << plan.schedule;
  }
}

TEST(PlanJsonTest, MembersMayComeInAnyOrder) {
  Plan plan = compileOrFail(uniformModel(4), options("1f1b", 2, 3, 1, 1, 2));
  auto doc = nlohmann::ordered_json::parse(writePlanJson(plan));
  // The ranks (whose indices depend on "parallel" and "stages") first, the rest after.
  nlohmann::ordered_json shuffled;
  shuffled["ranks"] = doc["ranks"];
  for (auto it = doc.begin(); it != doc.end(); ++it)
    if (it.key() != "ranks")
      shuffled[it.key()] = it.value();
  auto back = parsePlanJson(shuffled.dump(), "shuffled.json");
  ASSERT_TRUE(bool(back)) << takeMessage(back.takeError());
  EXPECT_EQ(back->ranks, plan.ranks);
  // An index out of range is still named with its path, once the sizes are known.
  shuffled["ranks"][1]["instructions"][0]["stage"] = 7;
  auto bad = parsePlanJson(shuffled.dump(), "shuffled.json");
  EXPECT_EQ(errorText(bad.takeError()),
            "shuffled.json: $.ranks[1].instructions[0].stage: expected a stage below 2, got "
            "number 7");
}

TEST(PlanJsonTest, UnusualInstructionsGetTheWholeDocumentReadersMessages) {
  Plan plan = compileOrFail(uniformModel(2), options("1f1b", 2, 2));
  auto doc = nlohmann::ordered_json::parse(writePlanJson(plan));
  auto messageFor = [&](const nlohmann::ordered_json &instruction) {
    auto copy = doc;
    copy["ranks"][0]["instructions"][1] = instruction;
    return errorText(parsePlanJson(copy.dump(), "u.json").takeError());
  };
  const std::string at = "u.json: $.ranks[0].instructions[1]";
  EXPECT_EQ(messageFor({{"op", "forward"}, {"stage", 0}, {"mb", {1}}, {"slice", 0}}),
            at + ".mb: expected an integer >= 0, got an array");
  EXPECT_EQ(messageFor({{"op", "send"},
                        {"tensor", "activation"},
                        {"stage", 0},
                        {"mb", 0},
                        {"slice", 0},
                        {"peer", 1},
                        {"bytes", 1},
                        {"colour", "red"}}),
            at + ".colour: unknown field (valid fields: op, tensor, stage, mb, slice, peer, "
                 "bytes, group)");
  EXPECT_EQ(messageFor({{"op", "jump"}}),
            at + ".op: expected one of forward, backward_input, backward_weight, backward, "
                 "send, recv, all_reduce, optimizer_step, got string \"jump\"");
  EXPECT_EQ(
      messageFor(
          {{"op", "forward"}, {"stage", 0}, {"mb", 0}, {"slice", 0}, {"part", 2}, {"parts", 2}}),
      at + ".part: expected a part below 2, got number 2");
  EXPECT_EQ(messageFor(7), at + ": expected an object, got number 7");
}

TEST(PlanJsonTest, AFileIsReadAsAStreamWithLineAndColumnOnErrors) {
  Plan plan = compileOrFail(uniformModel(4), options("1f1b", 2, 4));
  std::string text = writePlanJson(plan);
  std::string path = ::testing::TempDir() + "/truncated.json";
  { std::ofstream(path) << text; }
  auto back = loadPlan(path);
  ASSERT_TRUE(bool(back)) << takeMessage(back.takeError());
  EXPECT_EQ(back->ranks, plan.ranks);
  { std::ofstream(path) << text.substr(0, 200) << "}"; }
  std::string msg = errorText(loadPlan(path).takeError());
  size_t line = size_t(std::count(text.begin(), text.begin() + 200, '\n')) + 1;
  EXPECT_NE(msg.find(fmt::format("truncated.json:{}:", line)), std::string::npos) << msg;
  EXPECT_NE(msg.find("malformed JSON"), std::string::npos) << msg;
}

TEST(PlanTextTest, StreamsParseBackExactly) {
  for (int tp : {1, 2}) {
    Plan plan = compileOrFail(uniformModel(4), options("1f1b", 4, 6, 1, 1, tp, /*dp=*/2));
    Plan back = plan;
    back.ranks.clear();
    ASSERT_FALSE(parseStreams(formatStreams(plan), back));
    EXPECT_EQ(back.ranks, plan.ranks);
  }
  Plan sliced = compileOrFail(uniformModel(4), options("gpipe", 2, 3, 1, /*seqSplits=*/3));
  Plan back = sliced;
  ASSERT_FALSE(parseStreams(formatStreams(sliced), back));
  EXPECT_EQ(back.ranks, sliced.ranks);
}

TEST(PlanTextTest, TokensUsePyTorchSpelling) {
  Plan plan = compileOrFail(uniformModel(2), options("1f1b", 2, 1));
  // Rank 0 posts its send and the next recv together, as Megatron's send_forward_recv_backward.
  EXPECT_EQ(formatStreams(plan), "rank 0: 0F0 0SEND_F0#0 0RECV_B0#0 0B0 OPTIMIZER_STEP\n"
                                 "rank 1: 1RECV_F0 1F0 1B0 1SEND_B0 OPTIMIZER_STEP\n");
}

TEST(PlanTextTest, BadTokenNamesRankAndToken) {
  Plan plan = compileOrFail(uniformModel(2), options("1f1b", 2, 1));
  std::string msg = errorText(parseStreams("rank 1: 1F0 1X0", plan));
  EXPECT_EQ(msg, "rank 1: token '1X0': expected F, I, W, B, SEND_, RECV_ or ALLREDUCE_ after "
                 "the stage");
}

TEST(ModelSpecTest, ParsesTheAbstractExample) {
  auto m = parseModelSpec(R"({"format": "pipemodel/1", "name": "u",
    "layers": [{"name": "block", "count": 8, "forward": 1.0, "backward_input": 1.0,
                "backward_weight": 1.0, "activation_bytes": 1048576, "weight_grad_bytes": 0,
                "param_bytes": 4194304, "output_bytes": 65536}], "p2p_time": 0.5})",
                          "m.json");
  ASSERT_TRUE(bool(m)) << takeMessage(m.takeError());
  EXPECT_EQ(m->layers.size(), 8u);
  EXPECT_EQ(m->p2pTime, 0.5);
}

TEST(ModelSpecTest, AStringWhereANumberBelongsIsNamed) {
  auto m = parseModelSpec(R"({"format": "pipemodel/1",
    "layers": [{"forward": "fast", "backward_input": 1, "backward_weight": 1}]})",
                          "m.json");
  EXPECT_EQ(errorText(m.takeError()),
            "m.json: $.layers[0].forward: expected a number >= 0, got string \"fast\"");
}

TEST(ModelSpecTest, MalformedJsonGivesLineAndColumn) {
  auto m = parseModelSpec("{\"format\": \"pipemodel/1\",\n  \"layers\": [,]}", "m.json");
  EXPECT_EQ(errorText(m.takeError()), "m.json:2:14: malformed JSON (unexpected character)");
}

TEST(ModelSpecTest, UnknownFieldsAreRejectedWithTheValidOnes) {
  auto m = parseModelSpec(R"({"format": "pipemodel/1", "layers": [{"forward": 1,
    "backward_input": 1, "backward_weigth": 1}]})",
                          "m.json");
  std::string msg = errorText(m.takeError());
  EXPECT_NE(msg.find("m.json: $.layers[0].backward_weigth: unknown field (valid fields: "),
            std::string::npos)
      << msg;
}

TEST(ModelSpecTest, ATransformersFieldsOutOfPlaceSayWhereTheyGo) {
  // Written flat, as a Megatron-LM argument list or a config.json would have them: the error
  // says they go under "transformer", not only that the top level has no such field.
  auto flat = parseModelSpec(R"({"format": "pipemodel/1", "num_layers": 32, "hidden_size": 4096,
    "num_attention_heads": 32, "vocab_size": 32000, "seq_length": 4096})",
                             "m.json");
  EXPECT_EQ(errorText(flat.takeError()),
            "m.json: $.hidden_size: a transformer's field at the top level; a transformer "
            "model's fields go under \"transformer\" ({\"format\": \"pipemodel/1\", "
            "\"transformer\": {\"num_layers\": ...}}, as in examples/llama3-8b.json; pipec "
            "spec --from-hf config.json writes one)");
  // A config.json's names, at the top level too, and under "transformer".
  auto hfTop = parseModelSpec(R"({"num_hidden_layers": 32})", "m.json");
  EXPECT_NE(errorText(hfTop.takeError()).find("$.num_hidden_layers: a transformer's field"),
            std::string::npos);
  auto hf = parseModelSpec(R"({"format": "pipemodel/1", "transformer": {"num_layers": 2,
    "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 128, "seq_length": 16,
    "num_key_value_heads": 2}})",
                           "m.json");
  EXPECT_EQ(errorText(hf.takeError()),
            "m.json: $.transformer.num_key_value_heads: a Hugging Face config's name; pipec's "
            "field is \"num_query_groups\" (pipec spec --from-hf config.json writes the whole "
            "spec)");
  // An abstract model's seq_length is its own; another format is named as what it is.
  auto abstract = parseModelSpec(R"({"format": "pipemodel/1", "seq_length": 8,
    "layers": [{"forward": 1, "backward_input": 1, "backward_weight": 1}]})",
                                 "m.json");
  EXPECT_TRUE(static_cast<bool>(abstract)) << errorText(abstract.takeError());
  auto cluster = parseModelSpec(R"({"format": "pipecluster/1", "hidden_size": 1})", "c.json");
  EXPECT_EQ(errorText(cluster.takeError()),
            "c.json: $.format: expected \"pipemodel/1\", got \"pipecluster/1\" (a cluster spec)");
}

TEST(ModelSpecTest, MissingFileNamesThePath) {
  auto m = loadModelSpec("/nonexistent/model.json");
  EXPECT_EQ(errorText(m.takeError()),
            "/nonexistent/model.json: cannot read: No such file or directory");
}

TEST(ClusterSpecTest, ParsesAndDefaults) {
  auto c = parseClusterSpec(R"({"format": "pipecluster/1",
    "device": {"name": "H200", "peak_tflops": 989, "memory_bytes": 150323855360},
    "gpus_per_node": 4, "inter_node": {"bandwidth_GBps": 25, "latency_us": 10}})",
                            "c.json");
  ASSERT_TRUE(bool(c)) << takeMessage(c.takeError());
  EXPECT_EQ(c->deviceName, "H200");
  EXPECT_EQ(c->gpusPerNode, 4);
  EXPECT_EQ(c->interNode.bandwidthGBps, 25);
  EXPECT_EQ(c->intraNode.bandwidthGBps, 450); // default kept
  EXPECT_EQ(c->achievedFraction, 0.55);
}

} // namespace
} // namespace pipec::test
