//===- PassTestUtil.h - Running passes one at a time; golden files -*- C++ -*-===//
//
// For the per-pass suites (LowerCommsTest, MemoryPassTest, SeqSplitTest): a plan prepared as
// compilePlan prepares it, then the named passes run in order with the verifier after each,
// so a suite can stop before the pass it tests and look at that pass's output alone. And
// golden files: compared byte for byte, regenerated only by `bazel run //tests:<suite> --
// --update` (never by hand).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_TESTS_PASSTESTUTIL_H
#define PIPEC_TESTS_PASSTESTUTIL_H

#include "tests/TestUtil.h"

#include "schedules/Policy.h"

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

namespace pipec::test {

/// A plan on its way through the pipeline, with what its passes read.
struct PassRun {
  ModelSpec model;
  ClusterSpec cluster = ClusterSpec::defaults();
  PassContext ctx;
  Plan plan;

  PassRun(ModelSpec m, const CompileOptions &o) : model(std::move(m)) {
    ctx.model = &model;
    ctx.cluster = &cluster;
    ctx.options = o;
    ctx.verifyEach = true;
    auto policy = findPolicy(o.schedule);
    EXPECT_TRUE(bool(policy)) << (policy ? "" : takeMessage(policy.takeError()));
    if (policy) {
      ctx.policy = *policy;
      plan.placement = (*policy)->placement();
    }
    plan.schedule = o.schedule;
    plan.model = model.name;
    plan.timeUnit = model.timeUnit().str();
    plan.parallel = o.parallel;
    plan.gpusPerNode = cluster.gpusPerNode;
    plan.stateBytesPerParamByte = model.stateBytesPerParamByte;
    plan.transformer = model.transformer;
  }
  PassRun(const PassRun &) = delete;
  PassRun &operator=(const PassRun &) = delete;

  /// Run `passes` in order (the verifier after each, at the plan's stage).
  llvm::Error run(llvm::ArrayRef<llvm::StringRef> passes) { return runPipeline(passes, plan, ctx); }
  /// Run them and fail the test on an error.
  void runOrFail(llvm::ArrayRef<llvm::StringRef> passes) {
    llvm::Error err = run(passes);
    ASSERT_FALSE(bool(err)) << takeMessage(std::move(err));
  }
};

//===----------------------------------------------------------------------===//
// Golden files
//===----------------------------------------------------------------------===//

inline std::string &goldenDir() {
  static std::string dir = "tests/golden";
  return dir;
}
inline bool &goldenUpdate() {
  static bool update = false;
  return update;
}

/// `text` against tests/golden/<name>.txt; with --update, writes it there instead.
inline void expectMatchesGolden(const std::string &name, const std::string &text,
                                const char *suite) {
  std::string path = goldenDir() + "/" + name + ".txt";
  if (goldenUpdate()) {
    std::ofstream(path) << text;
    GTEST_SKIP() << "updated " << path;
  }
  std::ifstream in(path);
  ASSERT_TRUE(in.good()) << "missing golden " << path << "; run: bazel run //tests:" << suite
                         << " -- --update";
  std::stringstream ss;
  ss << in.rdbuf();
  EXPECT_EQ(text, ss.str()) << "differs from " << path
                            << "; if the change is intended, run: bazel run //tests:" << suite
                            << " -- --update";
}

/// main() of a suite with goldens: --update rewrites them (into the source tree under
/// `bazel run`), --golden_dir=D reads them from D.
inline int goldenMain(int argc, char **argv) {
  ::testing::InitGoogleTest(&argc, argv);
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--update") == 0)
      goldenUpdate() = true;
    else if (std::strncmp(argv[i], "--golden_dir=", 13) == 0)
      goldenDir() = argv[i] + 13;
  }
  if (goldenUpdate())
    if (const char *ws = std::getenv("BUILD_WORKSPACE_DIRECTORY"))
      goldenDir() = std::string(ws) + "/tests/golden";
  return RUN_ALL_TESTS();
}

} // namespace pipec::test

#endif // PIPEC_TESTS_PASSTESTUTIL_H
