//===- GoldenTest.cpp - Golden text streams for small configs -------------===//
//
// The streams of a few small plans, in the text form, compared with tests/golden/*.txt.
// Regenerate (never hand-edit) with:
//   bazel run //tests:golden_test -- --update
//
//===----------------------------------------------------------------------===//
#include "tests/Golden.h"
#include "tests/GoldenConfigs.h"
#include "tests/TestUtil.h"

#include "ir/PlanText.h"

namespace pipec::test {
namespace {

class GoldenStreams : public ::testing::TestWithParam<golden::Config> {};

TEST_P(GoldenStreams, MatchTheCheckedInText) {
  const golden::Config &c = GetParam();
  Plan plan = compileOrFail(golden::uniform8(), golden::compileOptions(c));
  expectMatchesGolden(c.name, formatStreams(plan), "golden_test");
}

INSTANTIATE_TEST_SUITE_P(Configs, GoldenStreams, ::testing::ValuesIn(golden::kConfigs),
                         [](const auto &info) { return std::string(info.param.name); });

} // namespace
} // namespace pipec::test

int main(int argc, char **argv) { return pipec::test::goldenMain(argc, argv); }
