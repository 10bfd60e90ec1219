//===- CheckpointTest.cpp - Checkpoints survive a crash and resume exactly ---------------===//
//
// The real piperun, in real processes (runtime/Checkpoint.h, docs/reliability.md):
//  - 3 steps, a checkpoint, a resume and 3 more give the uninterrupted 6-step run's losses and,
//    bit for bit, its weights and AdamW moments (the two step-6 checkpoints are equal bytes);
//  - a save killed (SIGKILL) at every point it has (before and after every write, fsync,
//    rename and removal; PIPEC_CHECKPOINT_KILL_AT) leaves the previous checkpoint whole, and
//    the newest committed one resumes to the uninterrupted run's losses; the next save cleans
//    up what the killed one left;
//  - kills at random instants of a run that saves every step, the same;
//  - a checkpoint saved under one layout (pp, tp, dp x microbatches, schedule) resumes under
//    another, to the same losses within fp32 rounding, and passes --check-reference;
//  - --save-every with --keep 2 keeps the two newest checkpoints, and each save's line gives
//    its size and seconds;
//  - --steps is the step the job ends at: the same command line (--save-dir D --resume D),
//    killed at random instants and relaunched until it exits 0, ends with the uninterrupted
//    run's losses and final weights bit for bit; --resume on a missing or empty directory starts
//    at step 0.
//
//===----------------------------------------------------------------------===//
#include "tests/Command.h"
#include "tests/Process.h"

#include "ir/support/Error.h"
#include "runtime/Checkpoint.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <regex>
#include <signal.h>
#include <string>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#include <vector>

namespace {

namespace fs = std::filesystem;
using namespace pipec::testing;

std::string tool(const std::string &name) { return fs::current_path().string() + "/tools/" + name; }

std::string compile(const std::string &dir, const std::string &flags,
                    const std::string &model = "examples/tiny-gpt.json") {
  std::string out =
      dir + "/plan-" + std::to_string(std::hash<std::string>()(model + flags)) + ".json";
  auto r =
      runCommand(tool("pipec") + " compile --quiet --model " + model + " " + flags + " -o " + out);
  EXPECT_EQ(r.code, 0) << r.err;
  return out;
}

pipec::testing::CommandResult piperun(const std::string &args, const std::string &env = "") {
  return runCommand(env + " " + tool("piperun") + " " + args);
}

void spit(const std::string &path, const std::string &text) {
  std::ofstream(path, std::ios::binary) << text;
}

/// Every regular file under `dir` (relative name -> bytes).
std::map<std::string, std::string> files(const std::string &dir) {
  std::map<std::string, std::string> m;
  for (auto &e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file())
      m[fs::relative(e.path(), dir).string()] = slurp(e.path().string());
  return m;
}

/// Names under `dir` that a finished save must not leave: temporaries.
std::vector<std::string> temporaries(const std::string &dir) {
  std::vector<std::string> t;
  for (auto &e : fs::recursive_directory_iterator(dir))
    if (e.path().filename().string().find(".tmp-") != std::string::npos)
      t.push_back(e.path().string());
  return t;
}

/// " --steps N" that runs one step after the newest committed checkpoint in `dir` (--steps is
/// the step the job ends at).
std::string oneMoreStep(const std::string &dir) {
  auto ckpt = pipec::openCheckpoint(dir);
  EXPECT_TRUE(bool(ckpt)) << (ckpt ? "" : pipec::takeMessage(ckpt.takeError()));
  return " --steps " + std::to_string(ckpt ? ckpt->manifest.step + 1 : 1);
}

TEST(CheckpointTest, ThreeStepsAResumeAndThreeMoreAreTheSixStepRunBitForBit) {
  const std::string d = freshDir("bitwise");
  // tp and dp too, so that shards are joined on save and cut again on resume.
  const std::string plan = compile(d, "--schedule 1f1b --pp 2 --microbatches 2 --tp 2 --dp 2");
  auto whole = piperun(plan + " --steps 6 --save-dir " + d + "/six");
  ASSERT_EQ(whole.code, 0) << whole.err;
  auto first = piperun(plan + " --steps 3 --save-dir " + d + "/split");
  ASSERT_EQ(first.code, 0) << first.err;
  auto rest = piperun(plan + " --steps 6 --resume " + d + "/split --save-dir " + d + "/split");
  ASSERT_EQ(rest.code, 0) << rest.err;
  EXPECT_NE(rest.out.find("step 3, saved by this plan"), std::string::npos) << rest.out;
  std::map<int, std::string> want = stepLosses(whole.out), got = stepLosses(first.out);
  for (auto [step, loss] : stepLosses(rest.out))
    got[step] = loss;
  ASSERT_EQ(want.size(), 6u);
  EXPECT_EQ(got, want);
  // The weights and optimizer state after step 6, bit for bit, and the manifests alike.
  auto a = files(d + "/six/step-00000006"), b = files(d + "/split/step-00000006");
  ASSERT_EQ(a.size(), 8u); // six layers, the manifest and piperun's marker
  EXPECT_TRUE(a == b) << "the resumed run's step-6 checkpoint differs from the uninterrupted one";
}

TEST(CheckpointTest, ASaveDirAnotherProcessHoldsIsRefusedBeforeTheFirstStep) {
  // Two launches of one job at once (a requeue while the old one is still dying) would
  // interleave their checkpoints: the second is refused, exit 2 and one line, having written
  // nothing, for as long as the other holds the directory's lock; once it is gone, it runs.
  const std::string d = freshDir("lock");
  const std::string plan = compile(d, "--schedule 1f1b --pp 2 --microbatches 2");
  const std::string save = d + "/ck";
  fs::create_directory(save);
  int fd = ::open(save.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);
  auto held = piperun(plan + " --steps 2 --save-dir " + save);
  EXPECT_EQ(held.code, 2) << held.out << held.err;
  EXPECT_EQ(held.err, "piperun: error: --save-dir: " + save +
                          " is in use by another process (a piperun still saving there?); wait "
                          "for it to end, or give another --save-dir\n");
  EXPECT_TRUE(fs::is_empty(save));
  // A resume of the same directory alike.
  auto resumed = piperun(plan + " --steps 2 --resume " + save + " --save-dir " + save);
  EXPECT_EQ(resumed.code, 2) << resumed.err;
  ::close(fd);
  auto free = piperun(plan + " --steps 2 --resume " + save + " --save-dir " + save);
  EXPECT_EQ(free.code, 0) << free.err;
  EXPECT_TRUE(fs::is_directory(save + "/step-00000002"));
  // The lock ends with the process: the next launch finds the job done.
  auto again = piperun(plan + " --steps 2 --resume " + save + " --save-dir " + save);
  EXPECT_EQ(again.code, 0) << again.err;
}

TEST(CheckpointTest, AResumeGoesOnWithTheSavedLearningRateUnlessLrSetsAnother) {
  // The same job relaunched without its --lr (a wrapper that drops it, a hand-typed resume)
  // still finishes as the uninterrupted run; another --lr is taken, from the resumed step on,
  // and said. Losses of a 4-step run at lr 0.01 differ from the default 1e-3's from step 1 on.
  const std::string d = freshDir("lr");
  const std::string plan = compile(d, "--schedule 1f1b --pp 2 --microbatches 2");
  auto whole = piperun(plan + " --steps 4 --lr 0.01");
  ASSERT_EQ(whole.code, 0) << whole.err;
  auto defaults = piperun(plan + " --steps 4");
  ASSERT_EQ(defaults.code, 0) << defaults.err;
  ASSERT_NE(stepLosses(whole.out)[3], stepLosses(defaults.out)[3]);
  const std::string ck = d + "/ck";
  auto first = piperun(plan + " --steps 2 --lr 0.01 --save-dir " + ck);
  ASSERT_EQ(first.code, 0) << first.err;
  EXPECT_NE(slurp(ck + "/step-00000002/manifest.json").find("\"lr\": 0.01,"), std::string::npos);
  auto rest = piperun(plan + " --steps 4 --resume " + ck);
  ASSERT_EQ(rest.code, 0) << rest.err;
  std::map<int, std::string> got = stepLosses(first.out);
  for (auto [step, loss] : stepLosses(rest.out))
    got[step] = loss;
  EXPECT_EQ(got, stepLosses(whole.out));
  EXPECT_EQ(rest.out.find("note: --lr"), std::string::npos) << rest.out;
  auto other = piperun(plan + " --steps 4 --lr 0.002 --resume " + ck);
  ASSERT_EQ(other.code, 0) << other.err;
  EXPECT_NE(other.out.find("note: --lr 0.002 from step 2 on; the checkpoint's run trained with "
                           "--lr 0.01\n"),
            std::string::npos)
      << other.out;
  EXPECT_NE(stepLosses(other.out)[3], stepLosses(whole.out)[3]);
  // A manifest's lr outside what --lr takes is refused, naming the field.
  std::string manifest = slurp(ck + "/step-00000002/manifest.json");
  manifest.replace(manifest.find("\"lr\": 0.01"), 10, "\"lr\": 0");
  spit(ck + "/step-00000002/manifest.json", manifest);
  auto bad = piperun(plan + " --steps 4 --resume " + ck);
  EXPECT_EQ(bad.code, 2);
  EXPECT_NE(bad.err.find("$.lr: expected a learning rate in (0, 10]"), std::string::npos)
      << bad.err;
}

/// `n` uint16 token ids below 64 (tiny-gpt's vocabulary) from seed `seed`.
std::string tokenBytes(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string bytes;
  for (int i = 0; i < n; ++i) {
    const uint16_t id = uint16_t(rng() % 64);
    bytes.append(reinterpret_cast<const char *>(&id), 2);
  }
  return bytes;
}

TEST(CheckpointTest, AResumeNeedsTheSameTokensWhateverTheFileIsCalled) {
  // A checkpoint records its token file's name, size and digest. Another file of the same name
  // and size (a re-tokenised shard) is refused; the same bytes moved or renamed go on.
  const std::string d = freshDir("data");
  const std::string plan = compile(d, "--schedule 1f1b --pp 2 --microbatches 2");
  spit(d + "/tok.u16", tokenBytes(5000, 1));
  const std::string ck = d + "/ck";
  auto first = piperun(plan + " --steps 2 --data " + d + "/tok.u16 --save-dir " + ck);
  ASSERT_EQ(first.code, 0) << first.err;
  auto whole = piperun(plan + " --steps 3 --data " + d + "/tok.u16");
  ASSERT_EQ(whole.code, 0) << whole.err;
  fs::create_directories(d + "/elsewhere");
  fs::copy_file(d + "/tok.u16", d + "/elsewhere/renamed.u16");
  auto moved =
      piperun(plan + " --steps 3 --resume " + ck + " --data " + d + "/elsewhere/renamed.u16");
  ASSERT_EQ(moved.code, 0) << moved.err;
  EXPECT_EQ(stepLosses(moved.out)[2], stepLosses(whole.out)[2]);
  spit(d + "/tok.u16", tokenBytes(5000, 2));
  auto other = piperun(plan + " --steps 3 --resume " + ck + " --data " + d + "/tok.u16");
  EXPECT_EQ(other.code, 2);
  EXPECT_TRUE(std::regex_search(
      other.err, std::regex("was trained on the token file tok\\.u16 \\(10000 bytes, digest "
                            "[0-9a-f]{16}\\), this run reads the token file tok\\.u16 \\(10000 "
                            "bytes, digest [0-9a-f]{16}\\) \\(the same size, other bytes\\); "
                            "give the same --data\n$")))
      << other.err;
  auto none = piperun(plan + " --steps 3 --resume " + ck);
  EXPECT_EQ(none.code, 2);
  EXPECT_NE(none.err.find("this run reads synthetic tokens (no --data)"), std::string::npos)
      << none.err;
}

TEST(CheckpointTest, SaveEveryWithKeepTwoKeepsTheTwoNewestCheckpoints) {
  const std::string d = freshDir("every");
  const std::string plan = compile(d, "--schedule 1f1b --pp 2 --microbatches 2");
  auto r = piperun(plan + " --steps 5 --save-every 2 --keep 2 --save-dir " + d + "/ck");
  ASSERT_EQ(r.code, 0) << r.err;
  std::vector<std::string> names;
  for (auto &e : fs::directory_iterator(d + "/ck"))
    names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"step-00000004", "step-00000005"}));
  EXPECT_TRUE(temporaries(d + "/ck").empty());
  // Each save says so once it is committed, after its step's loss, with its size (the sum of
  // its files') and seconds.
  uint64_t bytes = 0;
  for (auto &[name, text] : files(d + "/ck/step-00000005"))
    bytes += text.size();
  char mib[32];
  std::snprintf(mib, sizeof mib, "%.2f MiB, ", double(bytes) / (1 << 20));
  for (int step : {2, 4, 5}) {
    const std::string line = "saved " + d + "/ck/step-0000000" + std::to_string(step) + " (step " +
                             std::to_string(step) + ", " + mib;
    size_t at = r.out.find(line);
    ASSERT_NE(at, std::string::npos) << line << "\n" << r.out;
    EXPECT_TRUE(
        std::regex_search(r.out.substr(at + line.size()), std::regex("^[0-9]+\\.[0-9]{2} s\\)\n")))
        << r.out.substr(at);
    EXPECT_LT(r.out.find("step " + std::to_string(step - 1) + " loss"), at);
  }
  EXPECT_EQ(r.out.find("/ck/step-00000003"), std::string::npos);
}

/// Checks every layer file of the newest committed checkpoint in `dir` against its manifest
/// (size, header, digest), as --resume does before it loads one; returns its step.
int64_t expectWhole(const std::string &dir, const std::string &what) {
  auto ckpt = pipec::openCheckpoint(dir);
  if (!ckpt) {
    ADD_FAILURE() << what << ": " << pipec::takeMessage(ckpt.takeError());
    return -1;
  }
  pipec::LayerState layer;
  for (int l = 0; l < int(ckpt->manifest.layers.size()); ++l)
    if (auto err = pipec::readCheckpointLayer(*ckpt, l, layer)) {
      ADD_FAILURE() << what << ": " << pipec::takeMessage(std::move(err));
    }
  return ckpt->manifest.step;
}

/// The checkpoint of step `step` alone in a directory of its own, whole.
void expectStepWhole(const std::string &dir, int step, const std::string &what) {
  const std::string alone = dir + "-alone";
  fs::remove_all(alone);
  fs::create_directories(alone);
  char name[32];
  std::snprintf(name, sizeof(name), "step-%08d", step);
  fs::copy(dir + "/" + name, alone + "/" + name, fs::copy_options::recursive);
  EXPECT_EQ(expectWhole(alone, what), step) << what;
  fs::remove_all(alone);
}

/// What a killed save may leave: the newest committed checkpoint resumes to the uninterrupted
/// run's loss of its step, and so does `previous` (the one before the killed save) alone.
void expectResumable(const std::string &dir, const std::string &plan,
                     const std::map<int, std::string> &want, int previous,
                     const std::string &what) {
  auto r = piperun(plan + oneMoreStep(dir) + " --resume " + dir);
  ASSERT_EQ(r.code, 0) << what << ": " << r.err;
  auto got = stepLosses(r.out);
  ASSERT_EQ(got.size(), 1u) << what << ": " << r.out;
  EXPECT_EQ(got.begin()->second, want.at(got.begin()->first)) << what;
  EXPECT_GE(got.begin()->first, previous) << what;
  // The previous checkpoint on its own (anything newer removed).
  const std::string alone = dir + "-previous";
  fs::remove_all(alone);
  fs::create_directories(alone);
  fs::copy(dir + "/step-0000000" + std::to_string(previous),
           alone + "/step-0000000" + std::to_string(previous), fs::copy_options::recursive);
  r = piperun(plan + oneMoreStep(alone) + " --resume " + alone);
  ASSERT_EQ(r.code, 0) << what << " (previous alone): " << r.err;
  got = stepLosses(r.out);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got.begin()->first, previous) << what;
  EXPECT_EQ(got.begin()->second, want.at(previous)) << what << " (previous alone)";
  fs::remove_all(alone);
}

TEST(CheckpointTest, ASaveKilledAtAnyPointLeavesThePreviousCheckpointWhole) {
  const std::string d = freshDir("kill");
  const std::string plan = compile(d, "--schedule 1f1b --pp 2 --microbatches 2");
  auto uninterrupted = piperun(plan + " --steps 5");
  ASSERT_EQ(uninterrupted.code, 0) << uninterrupted.err;
  const auto want = stepLosses(uninterrupted.out);
  // Two committed checkpoints (steps 1 and 2), so that the save of step 3 also removes one.
  const std::string base = d + "/base";
  auto r = piperun(plan + " --steps 2 --save-every 1 --save-dir " + base);
  ASSERT_EQ(r.code, 0) << r.err;
  int points = 0;
  for (int k = 1; k < 1000; ++k) {
    const std::string ck = d + "/ck";
    fs::remove_all(ck);
    fs::copy(base, ck, fs::copy_options::recursive);
    r = piperun(plan + oneMoreStep(ck) + " --resume " + ck + " --save-dir " + ck + " --keep 2",
                "PIPEC_CHECKPOINT_KILL_AT=" + std::to_string(k));
    if (r.code == 0)
      break; // past the last point: the save finished
    ASSERT_TRUE(r.code == 128 + SIGKILL || r.code == -1) << "kill point " << k << ": " << r.err;
    ++points;
    const std::string what = "killed at point " + std::to_string(k);
    // Whole: the newest committed checkpoint (step 2, or 3 once its manifest is in), and step 2
    // on its own; every file as its manifest says.
    const int64_t newest = expectWhole(ck, what);
    EXPECT_GE(newest, 2) << what;
    expectStepWhole(ck, 2, what);
    // --keep 2 removes step 1 only once step 3 is committed: until then it is whole too.
    if (newest == 2)
      expectStepWhole(ck, 1, what);
    // And everything the killed save left is recognisably piperun's: the next run's start-up
    // check of --save-dir accepts the directory.
    if (llvm::Error err = pipec::checkSaveDir(ck, ck))
      ADD_FAILURE() << what << ": " << pipec::takeMessage(std::move(err));
    if (k % 8 != 1)
      continue;
    // And, at every eighth point, they resume to the uninterrupted run's losses, and the next
    // save finishes and leaves no debris of the killed one.
    expectResumable(ck, plan, want, 2, what);
    r = piperun(plan + oneMoreStep(ck) + " --resume " + ck + " --save-dir " + ck);
    ASSERT_EQ(r.code, 0) << "after point " << k << ": " << r.err;
    EXPECT_TRUE(temporaries(ck).empty()) << "after point " << k;
  }
  // Six layer files (5 points each and 3 around them), the manifest, the step directory and
  // the removal of step 1 (its manifest, 7 files and the directory).
  EXPECT_GE(points, 60) << "the save has fewer kill points than expected";
}

TEST(CheckpointTest, KillsAtRandomInstantsLeaveAResumableCheckpoint) {
  const std::string d = freshDir("random");
  const std::string plan = compile(d, "--schedule 1f1b --pp 2 --microbatches 2");
  // Each round runs at most 30 steps from where the last one's newest checkpoint was.
  auto uninterrupted = piperun(plan + " --steps 121");
  ASSERT_EQ(uninterrupted.code, 0) << uninterrupted.err;
  const auto want = stepLosses(uninterrupted.out);
  std::mt19937 rng(36);
  const std::string ck = d + "/ck";
  int previous = 0;
  for (int round = 0; round < 4; ++round) {
    pid_t pid = ::fork();
    if (pid == 0) {
      std::string args =
          "--steps " + std::to_string(previous + 30) + " --save-every 1 --save-dir " + ck;
      if (previous > 0) // (else ck holds no committed checkpoint, which --save-dir accepts)
        args += " --resume " + ck;
      std::string cmd = tool("piperun") + " " + plan + " " + args + " >/dev/null 2>&1";
      ::execl("/bin/sh", "sh", "-c", ("exec " + cmd).c_str(), static_cast<char *>(nullptr));
      ::_exit(127);
    }
    // Not a fixed delay (a loaded machine may not have started the run by then): wait until
    // this round has committed a checkpoint newer than the last round's, or 120 s, then kill at
    // a random instant of what follows (saves every step, so often in the middle of one).
    auto newestCommitted = [&] {
      int newest = 0;
      std::error_code ec; // the run renames and removes entries as we look
      for (fs::directory_iterator it(ck, ec), end; !ec && it != end; it.increment(ec)) {
        const std::string name = it->path().filename().string();
        std::error_code ignored;
        if (name.rfind("step-", 0) == 0 && fs::exists(it->path() / "manifest.json", ignored))
          newest = std::max(newest, std::atoi(name.c_str() + 5));
      }
      return newest;
    };
    for (int waited = 0; waited < 12000 && newestCommitted() <= previous; ++waited) {
      int status = 0;
      if (::waitpid(pid, &status, WNOHANG) == pid) {
        pid = -1; // finished its 30 steps before the kill
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (pid > 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 400));
      ::kill(pid, SIGKILL);
      int status = 0;
      ::waitpid(pid, &status, 0);
    }
    bool committed = false;
    if (fs::exists(ck))
      for (auto &e : fs::recursive_directory_iterator(ck))
        committed = committed || e.path().filename() == "manifest.json";
    if (!committed)
      continue; // killed before its first save finished
    auto r = piperun(plan + oneMoreStep(ck) + " --resume " + ck);
    ASSERT_EQ(r.code, 0) << "round " << round << ": " << r.err;
    auto got = stepLosses(r.out);
    ASSERT_EQ(got.size(), 1u);
    EXPECT_EQ(got.begin()->second, want.at(got.begin()->first)) << "round " << round;
    EXPECT_GE(got.begin()->first, previous) << "a newer checkpoint was lost";
    previous = got.begin()->first;
  }
  EXPECT_GT(previous, 0) << "no round got as far as a checkpoint";
}

TEST(CheckpointTest, TheSameCommandKilledAtRandomAndRelaunchedFinishesTheJobBitForBit) {
  // A preemptible job's launcher: the same command line, killed (SIGKILL) at a random instant
  // and launched again until it exits 0. --steps is the step the job ends at and --resume on a
  // directory without a checkpoint starts at step 0, so the job ends with the uninterrupted
  // run's losses (every step's, from whichever launch printed it last) and its final weights
  // and moments bit for bit.
  const std::string d = freshDir("relaunch");
  const std::string plan = compile(d, "--schedule 1f1b --pp 2 --microbatches 2 --tp 2");
  const int steps = 12;
  const auto started = std::chrono::steady_clock::now();
  auto uninterrupted =
      piperun(plan + " --steps " + std::to_string(steps) + " --save-dir " + d + "/whole");
  // The kills fall anywhere in a launch: at random instants up to the whole job's time here.
  const int span = pipec::testing::millisecondsSince(started);
  ASSERT_EQ(uninterrupted.code, 0) << uninterrupted.err;
  const auto want = stepLosses(uninterrupted.out);
  ASSERT_EQ(want.size(), size_t(steps));
  const std::string ck = d + "/ck";
  const std::string cmd = tool("piperun") + " " + plan + " --steps " + std::to_string(steps) +
                          " --save-every 1 --save-dir " + ck + " --resume " + ck;
  int killed = 0;
  auto got = pipec::testing::relaunchUntilDone(cmd, d + "/out.txt", span, 44, killed);
  EXPECT_GT(killed, 0) << "no launch was killed";
  EXPECT_EQ(got, want);
  auto final = pipec::testing::checkpointLayerFiles(d + "/whole", steps);
  ASSERT_EQ(final.size(), 6u);
  EXPECT_TRUE(pipec::testing::checkpointLayerFiles(ck, steps) == final)
      << "the relaunched job's final weights and moments differ from the uninterrupted run's";
  // Launched once more, the finished job says so and exits 0.
  auto again = runCommand(cmd);
  EXPECT_EQ(again.code, 0) << again.err;
  EXPECT_NE(again.out.find(ck + "/step-000000" + std::to_string(steps) + " is at step " +
                           std::to_string(steps) + ", at or past --steps " + std::to_string(steps) +
                           ": nothing to train\n"),
            std::string::npos)
      << again.out;
  EXPECT_EQ(again.out.find(" loss "), std::string::npos) << again.out;
}

TEST(CheckpointTest, AFinishedJobsRelaunchPrunesWhatTheLastPruneLeft) {
  // A kill during the last save's pruning leaves an older step half removed (no manifest) or
  // whole; the job is done, so its relaunch saves nothing, but it still prunes (and --profile
  // says it times nothing).
  const std::string d = freshDir("finished");
  const std::string plan = compile(d, "--schedule 1f1b --pp 2 --microbatches 2");
  const std::string ck = d + "/ck";
  auto r = piperun(plan + " --steps 3 --save-every 1 --save-dir " + ck);
  ASSERT_EQ(r.code, 0) << r.err;
  fs::remove(ck + "/step-00000001/manifest.json"); // (as a prune killed after its first removal)
  auto again = piperun(plan + " --steps 3 --save-every 1 --keep 1 --resume " + ck + " --save-dir " +
                       ck + " --profile " + d + "/costs.json");
  ASSERT_EQ(again.code, 0) << again.err;
  EXPECT_NE(
      again.out.find("nothing to train; nothing to time, so " + d + "/costs.json is not written\n"),
      std::string::npos)
      << again.out;
  EXPECT_FALSE(fs::exists(d + "/costs.json"));
  EXPECT_FALSE(fs::exists(ck + "/step-00000001"));
  EXPECT_FALSE(fs::exists(ck + "/step-00000002"));
  EXPECT_EQ(expectWhole(ck, "the finished job's checkpoint"), 3);
}

TEST(CheckpointTest, ResumeFromAMissingOrEmptyDirectoryStartsAtStepZeroAndSaysSo) {
  const std::string d = freshDir("fresh");
  const std::string plan = compile(d, "--schedule 1f1b --pp 2 --microbatches 2");
  auto plain = piperun(plan + " --steps 2");
  ASSERT_EQ(plain.code, 0) << plain.err;
  fs::create_directories(d + "/empty");
  // What a first launch killed inside its first save leaves: a step directory without manifest.
  fs::create_directories(d + "/killed/step-00000001");
  for (const char *dir : {"missing", "empty", "killed"}) {
    const std::string ck = d + "/" + dir;
    auto r = piperun(plan + " --steps 2 --resume " + ck + " --save-dir " + ck);
    ASSERT_EQ(r.code, 0) << dir << ": " << r.err;
    EXPECT_EQ(r.out.rfind("--resume " + ck + ": no checkpoint yet; starting at step 0\n", 0), 0u)
        << r.out;
    EXPECT_EQ(stepLosses(r.out), stepLosses(plain.out)) << dir;
  }
  // Anything else of that name is a mistyped path, not a first launch: refused, not step 0.
  spit(d + "/afile", "x");
  ::mkfifo((d + "/fifo").c_str(), 0644);
  fs::create_symlink(d + "/nothing", d + "/dangling");
  const std::pair<std::string, std::string> refused[] = {
      {d + "/afile", "afile is a file, not a directory"},
      {d + "/fifo", "fifo is a pipe, not a directory"},
      {"/dev/null", "/dev/null is a character device, not a directory"},
      {d + "/dangling", "dangling is a symbolic link to nothing"},
      {d + "/afile/sub", "afile/sub: Not a directory"}};
  for (const auto &[path, message] : refused) {
    auto r = piperun(plan + " --steps 2 --resume " + path);
    EXPECT_EQ(r.code, 2) << path;
    EXPECT_NE(r.err.find("--resume: "), std::string::npos) << r.err;
    EXPECT_NE(r.err.find(message), std::string::npos) << r.err;
    EXPECT_EQ(r.out.find("step 0"), std::string::npos) << r.out;
  }
}

/// Six steps of `saved`, against three of it saved to a checkpoint and three more of `other`
/// resumed from it with --check-reference: the same training within fp32 rounding (other
/// summation orders: tp, dp). Returns the resumed run.
pipec::testing::CommandResult expectResumeUnderAnotherLayout(const std::string &d,
                                                             const std::string &saved,
                                                             const std::string &other) {
  auto whole = piperun(saved + " --steps 6");
  EXPECT_EQ(whole.code, 0) << whole.err;
  auto first = piperun(saved + " --steps 3 --save-dir " + d + "/ck");
  EXPECT_EQ(first.code, 0) << first.err;
  auto rest = piperun(other + " --steps 6 --resume " + d + "/ck --check-reference");
  EXPECT_EQ(rest.code, 0) << rest.out << rest.err;
  auto want = stepLosses(whole.out), got = stepLosses(rest.out);
  EXPECT_EQ(got.size(), 3u) << rest.out;
  for (auto [step, loss] : got)
    EXPECT_NEAR(std::stod(loss), std::stod(want.at(step)), 2e-5 * std::stod(want.at(step)))
        << "step " << step;
  return rest;
}

TEST(CheckpointTest, ACheckpointResumesUnderAnotherLayout) {
  const std::string d = freshDir("layout");
  const std::string saved = compile(d, "--schedule 1f1b --pp 2 --microbatches 4");
  // Three pipeline ranks, tp 2, zero-bubble, and dp 2 x 2 microbatches: the same 4 a step.
  const std::string other = compile(d, "--schedule zb-h1 --pp 3 --microbatches 2 --tp 2 --dp 2");
  auto rest = expectResumeUnderAnotherLayout(d, saved, other);
  EXPECT_NE(rest.out.find("saved under 1f1b pp=2 vpp=1 tp=1 dp=1 microbatches=4"),
            std::string::npos)
      << rest.out;
}

TEST(CheckpointTest, ALlamaCheckpointResumesUnderAnotherLayout) {
  // Llama's block (its tensors and their tp cut: gate | up, grouped key/value heads): saved
  // under tp 2, resumed as a V-shape on one tp rank.
  const std::string d = freshDir("llama-layout");
  const std::string model = "examples/tiny-llama.json";
  expectResumeUnderAnotherLayout(
      d, compile(d, "--schedule 1f1b --pp 2 --microbatches 4 --tp 2", model),
      compile(d, "--schedule zb-v --pp 2 --vpp 2 --microbatches 4", model));
}

/// Save `step` into `dir` in this process, with the state of the checkpoint `from` (what a run
/// would do between the start-up checks and its next save).
llvm::Error saveAs(const std::string &dir, const pipec::Checkpoint &from, int64_t step,
                   pipec::SavedCheckpoint *saved = nullptr) {
  pipec::CheckpointManifest m = from.manifest;
  m.step = m.adamSteps = step;
  return pipec::saveCheckpoint(
      dir, m,
      [&](int l, pipec::LayerState &out) { return pipec::readCheckpointLayer(from, l, out); },
      /*keep=*/2, saved);
}

TEST(CheckpointTest, ASaveRemovesOnlyWhatPiperunWroteAndFollowsNoLink) {
  // What piperun's start-up checks refuse (tests/BadInputTest.cpp) may appear while it runs:
  // a link named like an older step, pointing outside; a user's file in one of piperun's step
  // directories; a directory of the user's files named like a later step.
  const std::string d = freshDir("foreign");
  const std::string plan = compile(d, "--schedule 1f1b --pp 2 --microbatches 2");
  const std::string ck = d + "/ck";
  auto r = piperun(plan + " --steps 2 --save-every 1 --save-dir " + ck);
  ASSERT_EQ(r.code, 0) << r.err;
  fs::create_directories(d + "/outside");
  spit(d + "/outside/secret.txt", "x\n");
  fs::create_directory_symlink("../outside", ck + "/step-00000000");
  spit(ck + "/step-00000001/notes.txt", "mine\n");
  fs::create_directories(ck + "/step-00000099");
  spit(ck + "/step-00000099/important.txt", "mine\n");
  auto from = pipec::openCheckpoint(ck);
  ASSERT_TRUE(bool(from)) << pipec::takeMessage(from.takeError());
  ASSERT_EQ(from->manifest.step, 2);

  // Step 3 would prune step 1 (two are kept), but the user's file is in it: it is left whole,
  // still a checkpoint (not half of one, which the next run's checks would refuse), and the
  // save says so; nothing is reached through the link.
  pipec::SavedCheckpoint saved;
  ASSERT_FALSE(bool(saveAs(ck, *from, 3, &saved)));
  EXPECT_EQ(slurp(d + "/outside/secret.txt"), "x\n");
  EXPECT_TRUE(fs::is_symlink(ck + "/step-00000000"));
  EXPECT_EQ(slurp(ck + "/step-00000001/notes.txt"), "mine\n");
  expectStepWhole(ck, 1, "step 1, which holds the user's file");
  ASSERT_EQ(saved.notRemoved.size(), 1u);
  EXPECT_EQ(saved.notRemoved[0], ck + "/step-00000001: it holds notes.txt, which piperun did not "
                                      "write; move that out and the next save removes the step");
  EXPECT_EQ(slurp(ck + "/step-00000099/important.txt"), "mine\n");
  EXPECT_EQ(expectWhole(ck, "after the save of step 3"), 3);
  expectStepWhole(ck, 2, "step 2 after the save of step 3");
  // A relaunch (--resume ck --save-dir ck) still passes its start-up check on step 1.
  fs::remove_all(ck + "/step-00000099");
  fs::remove(ck + "/step-00000000");
  llvm::Error relaunch = pipec::checkSaveDir(ck, ck);
  EXPECT_FALSE(bool(relaunch)) << pipec::takeMessage(std::move(relaunch));
  fs::create_directory_symlink("../outside", ck + "/step-00000000");
  fs::create_directories(ck + "/step-00000099");
  spit(ck + "/step-00000099/important.txt", "mine\n");
  // Once the file is moved out, the next save prunes step 1 (and step 2) whole.
  fs::remove(ck + "/step-00000001/notes.txt");
  saved = {};
  ASSERT_FALSE(bool(saveAs(ck, *from, 4, &saved)));
  EXPECT_TRUE(saved.notRemoved.empty());
  EXPECT_FALSE(fs::exists(ck + "/step-00000001"));
  EXPECT_FALSE(fs::exists(ck + "/step-00000002"));
  expectStepWhole(ck, 3, "step 3 after the save of step 4");
  from = pipec::openCheckpoint(ck); // (step 2, which the saves below read, is gone)
  ASSERT_TRUE(bool(from)) << pipec::takeMessage(from.takeError());

  // A save onto the user's directory is refused, and leaves it as it was.
  llvm::Error err = saveAs(ck, *from, 99);
  ASSERT_TRUE(bool(err));
  EXPECT_NE(pipec::takeMessage(std::move(err))
                .find("step-00000099 is a directory of files "
                      "piperun did not write"),
            std::string::npos);
  EXPECT_EQ(slurp(ck + "/step-00000099/important.txt"), "mine\n");
  EXPECT_FALSE(fs::exists(ck + "/step-00000099/manifest.json"));

  // Past the last step a directory name can hold: refused, not named so that --resume and
  // pruning would never see it.
  err = saveAs(ck, *from, pipec::kMaxCheckpointStep + 1);
  ASSERT_TRUE(bool(err));
  EXPECT_NE(pipec::takeMessage(std::move(err))
                .find("is past the last step a checkpoint can "
                      "record (99999999)"),
            std::string::npos);
  EXPECT_FALSE(fs::exists(ck + "/step-100000000"));
  // The last one it can hold is named, found and resumed like any other.
  err = saveAs(ck, *from, pipec::kMaxCheckpointStep);
  ASSERT_FALSE(bool(err)) << pipec::takeMessage(std::move(err));
  EXPECT_EQ(expectWhole(ck, "the last step"), pipec::kMaxCheckpointStep);
}

} // namespace
