//===- PiperunEmuTest.cpp - piperun --backend cuda|nccl end to end, emulated -===//
//
// Runs in CI: tools/piperun_emu is piperun built on the emulated device and NCCL
// (kernels/cuda/emu/README.md), so the GPU backends' command line (flags, the printed steps,
// the activation arena line, --check-reference's report and exit code, the launcher variables
// of the nccl mode) is checked end to end without a GPU.
//
//===----------------------------------------------------------------------===//
#include "tests/Command.h"

#include <gtest/gtest.h>

#include <string>

namespace {

using pipec::testing::tmpDir;
using Result = pipec::testing::CommandResult;

Result run(const std::string &cmd) { return pipec::testing::runCommand(cmd); }

std::string plan(const std::string &name, const std::string &flags) {
  std::string path = tmpDir() + "/" + name + ".json";
  Result r = run("tools/pipec compile --model examples/tiny-gpt.json " + flags + " -o " + path +
                 " --quiet");
  EXPECT_EQ(r.code, 0) << r.err;
  return path;
}

TEST(PiperunEmuTest, CudaBackendRunsStepsReportsArenasAndPassesTheReferenceCheck) {
  std::string p = plan("cuda", "--schedule 1f1b --pp 4 --microbatches 8");
  Result r = run("tools/piperun_emu " + p + " --backend cuda --steps 3 --check-reference");
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  for (const char *line : {"step 0 loss ", "step 2 loss ",
                           "activation arena MiB (every rank, in RANK order; sized by the warm-up "
                           "step): ",
                           "reference loss (last step) ", "max_abs_grad_diff="})
    EXPECT_NE(r.out.find(line), std::string::npos) << line << " missing from:\n" << r.out;
  EXPECT_EQ(r.out.find("step 3 loss"), std::string::npos) << "the warm-up step is not printed";
}

TEST(PiperunEmuTest, NcclBackendOneProcessFromLauncherVariables) {
  std::string p = plan("nccl", "--schedule 1f1b --pp 1 --microbatches 4");
  Result r = run("env -u NCCL_COMM_ID RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 tools/piperun_emu " + p +
                 " --backend nccl --steps 2 --check-reference");
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  for (const char *line :
       {"step 1 loss ", "activation arena MiB (this process's rank 0", "max_abs_grad_diff="})
    EXPECT_NE(r.out.find(line), std::string::npos) << line << " missing from:\n" << r.out;
}

TEST(PiperunEmuTest, NcclBackendNamesAMissingLauncherVariable) {
  std::string p = plan("nccl2", "--schedule 1f1b --pp 2 --microbatches 4");
  Result r =
      run("env -u RANK RANK= WORLD_SIZE=2 LOCAL_RANK=0 tools/piperun_emu " + p + " --backend nccl");
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_NE(r.err.find("RANK"), std::string::npos) << r.err;
}

} // namespace
