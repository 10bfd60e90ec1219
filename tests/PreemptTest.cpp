//===- PreemptTest.cpp - Preemption, retention and full disks, in real processes ------===//
//
// The real piperun (cpu backend: every rank a thread of one process) under what a cluster does
// to a long job (docs/reliability.md):
//  - SIGTERM after a step's line: the step in flight is finished, a checkpoint of it saved, one
//    line printed, exit status 143; the same command relaunched finishes the job with the
//    uninterrupted run's losses and weights bit for bit;
//  - SIGUSR1 without --save-dir: the line says nothing was saved, exit status 138;
//  - a second signal ends the process at once, killed by it;
//  - --keep K leaves the newest K checkpoints (default: all);
//  - a full disk in a save (RLIMIT_FSIZE): exit 2, one line naming the file and the bytes the
//    checkpoint needs, nothing of the failed save left, the previous checkpoint whole and
//    resumable to the uninterrupted run bit for bit.
// Every wait is for a line the process prints, never a delay.
//
//===----------------------------------------------------------------------===//
#include "tests/Command.h"
#include "tests/Process.h"

#include "ir/support/Error.h"
#include "runtime/Checkpoint.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <csignal>
#include <filesystem>
#include <map>
#include <regex>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
using namespace pipec::testing;

std::string piperun(const std::string &plan, const std::string &args) {
  return "tools/piperun " + plan + " " + args;
}

/// The step-<n> names in `dir`, sorted.
std::vector<std::string> stepDirs(const std::string &dir) {
  std::vector<std::string> names;
  for (auto &e : fs::directory_iterator(dir))
    names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

/// How many lines of `out` start with `prefix`.
int linesStartingWith(const std::string &out, const std::string &prefix) {
  int n = 0;
  for (size_t at = 0; at < out.size(); at = out.find('\n', at) + 1) {
    n += out.compare(at, prefix.size(), prefix) == 0;
    if (out.find('\n', at) == std::string::npos)
      break;
  }
  return n;
}

TEST(PreemptTest, SigtermFinishesTheStepSavesExits143AndTheRelaunchFinishesTheJobBitForBit) {
  const std::string d = freshDir("sigterm");
  const std::string plan = compileTinyGpt(d, "--schedule 1f1b --pp 2 --microbatches 2 --tp 2");
  const std::string ck = d + "/ck";
  // The job's command line as a launcher gives it; far more steps than run before the signal.
  Child c = spawn(piperun(plan, "--steps 1000 --save-dir " + ck + " --resume " + ck));
  int status = 0;
  ASSERT_NO_FATAL_FAILURE(signalAfterStepZero(c, SIGTERM, status));
  EXPECT_EQ(status, 143) << c.out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(c.out, m,
                                std::regex("piperun: SIGTERM: stopped after step ([0-9]+), saved " +
                                           ck + "/step-([0-9]{8}) \\(relaunch with --resume " + ck +
                                           " to continue\\); exit status 143\n")))
      << c.out;
  EXPECT_EQ(linesStartingWith(c.out, "piperun: "), 1) << c.out;
  const int stopped = std::stoi(m[1]), saved = std::stoi(m[2]);
  EXPECT_EQ(saved, stopped + 1);
  // The step in flight was finished: the last loss printed is the saved step's, and the save's
  // line is there; the checkpoint is the newest, committed and whole.
  auto losses = stepLosses(c.out);
  ASSERT_FALSE(losses.empty());
  EXPECT_EQ(losses.rbegin()->first, stopped) << c.out;
  EXPECT_NE(c.out.find("saved " + pipec::checkpointPath(ck, saved) + " (step "), std::string::npos)
      << c.out;
  auto ckpt = pipec::openCheckpoint(ck);
  ASSERT_TRUE(bool(ckpt)) << pipec::takeMessage(ckpt.takeError());
  EXPECT_EQ(ckpt->manifest.step, saved);
  // Relaunched (to two steps past it), the job ends as the uninterrupted run does.
  const int end = saved + 2;
  auto rest = runCommand(
      piperun(plan, "--steps " + std::to_string(end) + " --save-dir " + ck + " --resume " + ck));
  ASSERT_EQ(rest.code, 0) << rest.out << rest.err;
  auto whole =
      runCommand(piperun(plan, "--steps " + std::to_string(end) + " --save-dir " + d + "/whole"));
  ASSERT_EQ(whole.code, 0) << whole.err;
  for (auto [step, loss] : stepLosses(rest.out))
    losses[step] = loss;
  EXPECT_EQ(losses, stepLosses(whole.out));
  auto want = checkpointLayerFiles(d + "/whole", end);
  ASSERT_EQ(want.size(), 6u);
  EXPECT_TRUE(checkpointLayerFiles(ck, end) == want)
      << "the preempted and relaunched job's weights and moments differ from the uninterrupted";
}

TEST(PreemptTest, SigusrOneWithoutSaveDirStopsSaysNothingWasSavedAndExits138) {
  const std::string d = freshDir("sigusr1");
  const std::string plan = compileTinyGpt(d, "--schedule 1f1b --pp 2 --microbatches 2");
  Child c = spawn(piperun(plan, "--steps 1000"));
  int status = 0;
  ASSERT_NO_FATAL_FAILURE(signalAfterStepZero(c, SIGUSR1, status));
  EXPECT_EQ(status, 138) << c.out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(c.out, m,
                                std::regex("piperun: SIGUSR1: stopped after step ([0-9]+), not "
                                           "saved \\(no --save-dir\\); exit status 138\n")))
      << c.out;
  EXPECT_EQ(stepLosses(c.out).rbegin()->first, std::stoi(m[1]));
  EXPECT_EQ(linesStartingWith(c.out, "piperun: "), 1) << c.out;
}

TEST(PreemptTest, ASecondSignalEndsTheProcessAtOnce) {
  const std::string d = freshDir("second");
  const std::string plan = compileTinyGpt(d, "--schedule 1f1b --pp 2 --microbatches 2");
  const std::string ck = d + "/ck";
  Child c = spawn(piperun(plan, "--steps 1000 --save-dir " + ck));
  ASSERT_TRUE(readUntil(c, "step 0 loss")) << c.out;
  // Both signals pending while the process is stopped (two of one kind would merge into one):
  // their handlers run as it continues, before it can finish a step.
  ::kill(c.pid, SIGSTOP);
  ::kill(c.pid, SIGTERM);
  ::kill(c.pid, SIGUSR1);
  ::kill(c.pid, SIGCONT);
  const int status = finish(c);
  ASSERT_TRUE(WIFSIGNALED(status)) << "exited " << WEXITSTATUS(status) << ":\n" << c.out;
  EXPECT_TRUE(WTERMSIG(status) == SIGTERM || WTERMSIG(status) == SIGUSR1) << WTERMSIG(status);
  EXPECT_EQ(c.out.find("stopped after step"), std::string::npos) << c.out;
}

TEST(PreemptTest, KeepLeavesTheNewestCheckpointsAndTheDefaultKeepsAll) {
  const std::string d = freshDir("keep");
  const std::string plan = compileTinyGpt(d, "--schedule 1f1b --pp 2 --microbatches 2");
  auto all = runCommand(piperun(plan, "--steps 4 --save-every 1 --save-dir " + d + "/all"));
  ASSERT_EQ(all.code, 0) << all.err;
  EXPECT_EQ(stepDirs(d + "/all"), (std::vector<std::string>{"step-00000001", "step-00000002",
                                                            "step-00000003", "step-00000004"}));
  auto one =
      runCommand(piperun(plan, "--steps 4 --save-every 1 --keep 1 --save-dir " + d + "/one"));
  ASSERT_EQ(one.code, 0) << one.err;
  EXPECT_EQ(stepDirs(d + "/one"), std::vector<std::string>{"step-00000004"});
  EXPECT_TRUE(checkpointLayerFiles(d + "/one", 4) == checkpointLayerFiles(d + "/all", 4));
  // Resumed with --keep 2, the older checkpoints of the directory count too.
  auto more = runCommand(piperun(plan, "--steps 6 --save-every 1 --keep 2 --resume " + d +
                                           "/all --save-dir " + d + "/all"));
  ASSERT_EQ(more.code, 0) << more.err;
  EXPECT_EQ(stepDirs(d + "/all"), (std::vector<std::string>{"step-00000005", "step-00000006"}));
  auto bad = runCommand(piperun(plan, "--steps 4 --keep 2"));
  EXPECT_EQ(bad.code, 2);
  EXPECT_EQ(bad.err, "piperun: error: --keep needs --save-dir (where to save); try --save-dir "
                     "ckpt\n");
  bad = runCommand(piperun(plan, "--steps 4 --keep 0 --save-dir " + d + "/zero"));
  EXPECT_EQ(bad.code, 2);
  EXPECT_NE(bad.err.find("--keep"), std::string::npos) << bad.err;
  EXPECT_FALSE(fs::exists(d + "/zero"));
}

TEST(PreemptTest, AFullDiskInASaveExitsTwoNamingTheBytesAndLeavesThePreviousCheckpoint) {
  const std::string d = freshDir("full");
  const std::string plan = compileTinyGpt(d, "--schedule 1f1b --pp 2 --microbatches 2");
  const std::string ck = d + "/ck";
  auto first = runCommand(piperun(plan, "--steps 2 --save-dir " + ck));
  ASSERT_EQ(first.code, 0) << first.err;
  const auto before = checkpointLayerFiles(ck, 2);
  // The uninterrupted run, whose step-3 checkpoint is what the save below needs room for.
  auto whole = runCommand(piperun(plan, "--steps 4 --save-every 1 --save-dir " + d + "/whole"));
  ASSERT_EQ(whole.code, 0) << whole.err;
  uint64_t bytes = 0, largest = 0;
  for (auto &e : fs::directory_iterator(d + "/whole/step-00000003")) {
    bytes += fs::file_size(e.path());
    largest = std::max<uint64_t>(largest, fs::file_size(e.path()));
  }
  // No file may grow past half the largest layer file: the save of step 3 fails in its
  // largest layer, as on a disk that fills up there.
  Child c = spawn(piperun(plan, "--steps 4 --save-every 1 --resume " + ck + " --save-dir " + ck),
                  rlim_t(largest / 2));
  const int status = finish(c);
  ASSERT_TRUE(WIFEXITED(status)) << c.out;
  EXPECT_EQ(WEXITSTATUS(status), 2) << c.out;
  // One line: the file, why, and the bytes of the checkpoint it was writing.
  const std::string prefix = "piperun: error: --save-dir: " + ck + "/step-00000003/layer-";
  char needs[64];
  std::snprintf(needs, sizeof needs, "%.2f MiB (%llu bytes)", double(bytes) / (1 << 20),
                static_cast<unsigned long long>(bytes));
  const size_t at = c.out.find(prefix);
  ASSERT_NE(at, std::string::npos) << c.out;
  EXPECT_TRUE(std::regex_match(c.out.substr(at + prefix.size(), 25),
                               std::regex("[0-9]{5}\\.bin: cannot write: ")))
      << c.out;
  EXPECT_EQ(c.out.substr(at + prefix.size() + 25),
            "File too large; the checkpoint needs " + std::string(needs) + " in " + ck +
                ": free that much; the checkpoints before it are intact\n");
  EXPECT_EQ(linesStartingWith(c.out, "piperun: "), 1) << c.out;
  // Nothing of the failed save is left; the previous checkpoint is as it was.
  EXPECT_EQ(stepDirs(ck), std::vector<std::string>{"step-00000002"});
  EXPECT_TRUE(checkpointLayerFiles(ck, 2) == before);
  // And it resumes, with room again, to the uninterrupted run bit for bit.
  auto rest =
      runCommand(piperun(plan, "--steps 4 --save-every 1 --resume " + ck + " --save-dir " + ck));
  ASSERT_EQ(rest.code, 0) << rest.out << rest.err;
  auto losses = stepLosses(first.out);
  for (auto [step, loss] : stepLosses(rest.out))
    losses[step] = loss;
  EXPECT_EQ(losses, stepLosses(whole.out));
  EXPECT_TRUE(checkpointLayerFiles(ck, 4) == checkpointLayerFiles(d + "/whole", 4));
}

} // namespace
