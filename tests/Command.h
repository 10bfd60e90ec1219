//===- Command.h - Running the real binaries from a test ------------*- C++ -*-===//
//
// For the end-to-end tests (CliTest.cpp, PiperunEmuTest.cpp): a shell command's exit code and
// its stdout and stderr, captured through files in the test's temporary directory.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_TESTS_COMMAND_H
#define PIPEC_TESTS_COMMAND_H

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <sys/wait.h>

namespace pipec::testing {

/// Bazel's per-test temporary directory (/tmp outside Bazel).
inline std::string tmpDir() {
  const char *d = std::getenv("TEST_TMPDIR");
  return d ? d : "/tmp";
}

/// A fresh (emptied) directory `name` under tmpDir().
inline std::string freshDir(const std::string &name) {
  std::string d = tmpDir() + "/" + name;
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}

/// The whole file (empty if it cannot be read).
inline std::string slurp(const std::string &path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

struct CommandResult {
  int code; // the exit code; -1 if the command did not exit normally
  std::string out, err;
};

/// Runs `cmd` through the shell.
inline CommandResult runCommand(const std::string &cmd) {
  std::string out = tmpDir() + "/stdout.txt", err = tmpDir() + "/stderr.txt";
  int status = std::system((cmd + " >" + out + " 2>" + err).c_str());
  return CommandResult{WIFEXITED(status) ? WEXITSTATUS(status) : -1, slurp(out), slurp(err)};
}

/// A test failure, showing `text`, where `text` (a command's output) does not hold `part`.
inline void expectHas(const std::string &text, const std::string &part) {
  EXPECT_NE(text.find(part), std::string::npos) << part << "\n  missing from:\n" << text;
}

/// piperun's losses by step, as it prints them ("step N loss X").
inline std::map<int, std::string> stepLosses(const std::string &out) {
  std::map<int, std::string> m;
  std::regex line(R"(step (\d+) loss ([-0-9.naif]+))");
  for (std::sregex_iterator it(out.begin(), out.end(), line), end; it != end; ++it)
    m[std::stoi((*it)[1])] = (*it)[2];
  return m;
}

} // namespace pipec::testing

#endif // PIPEC_TESTS_COMMAND_H
