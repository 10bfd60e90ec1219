//===- Golden.h - Golden files of the test suites ---------------*- C++ -*-===//
//
// Text a suite produces, compared byte for byte with its file in tests/golden and regenerated
// only by `bazel run //tests:<suite> -- --update` (never by hand). A suite with golden files
// has goldenMain as its main (tests/defs.bzl: pipec_test's `goldens`).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_TESTS_GOLDEN_H
#define PIPEC_TESTS_GOLDEN_H

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

namespace pipec::test {

/// Where the golden files are: tests/golden, or --golden_dir=D.
inline std::string &goldenDir() {
  static std::string dir = "tests/golden";
  return dir;
}
/// Whether this run (--update) rewrites the golden files instead of comparing with them.
inline bool &goldenUpdate() {
  static bool update = false;
  return update;
}

/// `text` against the golden file `file` (in goldenDir()); with --update, writes it there
/// instead and skips the test.
inline void expectMatchesGoldenFile(const std::string &file, const std::string &text,
                                    const char *suite) {
  std::string path = goldenDir() + "/" + file;
  if (goldenUpdate()) {
    std::ofstream(path, std::ios::binary) << text;
    GTEST_SKIP() << "updated " << path;
  }
  std::ifstream in(path, std::ios::binary);
  ASSERT_TRUE(in.good()) << "missing golden " << path << "; run: bazel run //tests:" << suite
                         << " -- --update";
  std::stringstream ss;
  ss << in.rdbuf();
  EXPECT_EQ(text, ss.str()) << "differs from " << path
                            << "; if the change is intended, run: bazel run //tests:" << suite
                            << " -- --update";
}

/// The same for tests/golden/<name>.txt.
inline void expectMatchesGolden(const std::string &name, const std::string &text,
                                const char *suite) {
  expectMatchesGoldenFile(name + ".txt", text, suite);
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

#endif // PIPEC_TESTS_GOLDEN_H
