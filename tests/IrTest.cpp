//===- IrTest.cpp - Specs, plan JSON and the text form --------------------===//
#include "tests/TestUtil.h"

#include "ir/PlanJson.h"
#include "ir/PlanText.h"

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
