//===- GoldenTest.cpp - Golden text streams for small configs -------------===//
//
// The streams of a few small plans, in the text form, compared with tests/golden/*.txt.
// Regenerate (never hand-edit) with:
//   bazel run //tests:golden_test -- --update
//
//===----------------------------------------------------------------------===//
#include "tests/TestUtil.h"

#include "ir/PlanText.h"

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

namespace pipec::test {
namespace {

std::string goldenDir = "tests/golden";
bool update = false;

struct GoldenCase {
  const char *name;
  const char *schedule;
  int pp, microbatches, seqSplits, tp, dp;
  int vpp = 1;
  int64_t memoryLimit = 0; // zb-auto's --memory-limit
};

const GoldenCase kCases[] = {
    {"gpipe_p4_m8", "gpipe", 4, 8, 1, 1, 1},
    {"1f1b_p4_m8", "1f1b", 4, 8, 1, 1, 1},
    {"1f1b_p4_m8_tp2_dp2", "1f1b", 4, 8, 1, 2, 2},
    {"gpipe_p2_m2_k2", "gpipe", 2, 2, 2, 1, 1},
    {"interleaved_1f1b_p4_m8_v2", "interleaved-1f1b", 4, 8, 1, 1, 1, /*vpp=*/2},
    {"seq1f1b_p4_m8_k2", "seq1f1b", 4, 8, 2, 1, 1},
    {"seq1f1b_interleaved_p4_m8_v2_k2", "seq1f1b-interleaved", 4, 8, 2, 1, 1, /*vpp=*/2},
    {"zb_h1_p4_m8", "zb-h1", 4, 8, 1, 1, 1},
    {"zb_h2_p4_m8", "zb-h2", 4, 8, 1, 1, 1},
    {"zb_v_p4_m8_v2", "zb-v", 4, 8, 1, 1, 1, /*vpp=*/2},
    {"dualpipe_v_p4_m8_v2", "dualpipe-v", 4, 8, 1, 1, 1, /*vpp=*/2},
    // p·M_B (a stage of the uniform model keeps 2 MiB per microbatch): the paper's ZB-1p limit.
    {"zb_auto_p4_m8_limit8mib", "zb-auto", 4, 8, 1, 1, 1, /*vpp=*/1, /*memoryLimit=*/8 << 20},
};

class GoldenStreams : public ::testing::TestWithParam<GoldenCase> {};

TEST_P(GoldenStreams, MatchTheCheckedInText) {
  const GoldenCase &c = GetParam();
  // The uniform-8 example: 8 unit layers.
  CompileOptions o = options(c.schedule, c.pp, c.microbatches, c.vpp, c.seqSplits, c.tp, c.dp);
  o.memoryLimit = c.memoryLimit;
  Plan plan = compileOrFail(uniformModel(8), o);
  std::string text = formatStreams(plan);
  std::string path = goldenDir + "/" + c.name + ".txt";
  if (update) {
    std::ofstream(path) << text;
    GTEST_SKIP() << "updated " << path;
  }
  std::ifstream in(path);
  ASSERT_TRUE(in.good()) << "missing golden " << path
                         << "; run: bazel run //tests:golden_test -- --update";
  std::stringstream ss;
  ss << in.rdbuf();
  EXPECT_EQ(text, ss.str()) << "streams differ from " << path
                            << "; if the change is intended, run: bazel run "
                               "//tests:golden_test -- --update";
}

INSTANTIATE_TEST_SUITE_P(Configs, GoldenStreams, ::testing::ValuesIn(kCases),
                         [](const auto &info) { return std::string(info.param.name); });

} // namespace
} // namespace pipec::test

int main(int argc, char **argv) {
  ::testing::InitGoogleTest(&argc, argv);
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--update") == 0)
      pipec::test::update = true;
    else if (std::strncmp(argv[i], "--golden_dir=", 13) == 0)
      pipec::test::goldenDir = argv[i] + 13;
  }
  if (pipec::test::update) {
    // Under `bazel run`, write into the source tree.
    if (const char *ws = std::getenv("BUILD_WORKSPACE_DIRECTORY"))
      pipec::test::goldenDir = std::string(ws) + "/tests/golden";
  }
  return RUN_ALL_TESTS();
}
