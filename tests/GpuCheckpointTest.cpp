//===- GpuCheckpointTest.cpp - Checkpoints on the GPU backends, emulated -------------===//
//
// The one training driver (runtime/Train.h) saves and resumes checkpoints on every backend:
// tools/piperun_emu (piperun on the emulated device and NCCL) in real processes.
//  - cuda: 2 steps, a checkpoint, a resume and 2 more are the uninterrupted 4-step run bit for
//    bit (losses, weights and AdamW moments; tp and dp shards joined and cut again);
//  - the nccl mode and the cuda backend compute the same arithmetic (fp32, one process): a
//    checkpoint saved by either resumes under the other to the uninterrupted run bit for bit;
//  - cpu and cuda sum in other orders (the emulated device's stand-ins follow the GPU kernels'
//    orders), so across them a resumed run matches the uninterrupted one to fp32 rounding, and
//    the resumed run passes --check-reference against a reference loaded from the checkpoint;
//  - cuda: the same command line (--save-dir D --resume D) killed (SIGKILL) at random instants
//    and relaunched until it exits 0 ends with the uninterrupted run's losses and final weights
//    bit for bit;
//  - preemption in real processes: a process of the nccl mode (and the cuda backend) sent
//    SIGTERM (SIGUSR1) after a step's line finishes the step in flight, saves it and exits 143
//    (138) with one line; relaunched, the job ends as the uninterrupted run bit for bit. (The
//    agreement of several processes on the step they stop at: NcclEmuTest.cpp, whose emulated
//    NCCL runs ranks as threads of one process.)
//
//===----------------------------------------------------------------------===//
#include "tests/Command.h"
#include "tests/Process.h"

#include "ir/support/Error.h"
#include "runtime/Checkpoint.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <string>

namespace {

namespace fs = std::filesystem;
using namespace pipec::testing;

/// The command line of piperun_emu on `plan` with `args`, in fp32 on a GPU backend; `backend`
/// "nccl" runs one process from torchrun's variables.
std::string piperunCommand(const std::string &backend, const std::string &plan,
                           const std::string &args) {
  std::string env =
      backend == "nccl" ? "env -u NCCL_COMM_ID RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 " : std::string();
  std::string dtype = backend == "cpu" ? "" : " --dtype fp32";
  return env + "tools/piperun_emu " + plan + " --backend " + backend + dtype + " " + args;
}

/// That command run.
CommandResult piperun(const std::string &backend, const std::string &plan,
                      const std::string &args) {
  return runCommand(piperunCommand(backend, plan, args));
}

/// `first` steps under `saver` with a checkpoint, then the rest of `steps` resumed under
/// `resumer` (with `resumeArgs`); the losses of both runs by step.
std::map<int, std::string> saveThenResume(const std::string &saver, const std::string &resumer,
                                          const std::string &plan, const std::string &dir,
                                          int first, int steps,
                                          const std::string &resumeArgs = "") {
  auto a = piperun(saver, plan, "--steps " + std::to_string(first) + " --save-dir " + dir);
  EXPECT_EQ(a.code, 0) << a.out << a.err;
  auto b = piperun(resumer, plan,
                   "--steps " + std::to_string(steps) + " --resume " + dir + " --save-dir " + dir +
                       " " + resumeArgs);
  EXPECT_EQ(b.code, 0) << b.out << b.err;
  EXPECT_NE(b.out.find("resuming from " + dir + "/step-0000000" + std::to_string(first)),
            std::string::npos)
      << b.out;
  std::map<int, std::string> losses = stepLosses(a.out);
  for (auto [step, loss] : stepLosses(b.out))
    losses[step] = loss;
  return losses;
}

TEST(GpuCheckpointTest, CudaSaveAndResumeIsTheUninterruptedRunBitForBit) {
  const std::string d = freshDir("cuda");
  // tp and dp too, so that shards are joined on save and cut again on resume.
  const std::string plan =
      compileTinyGpt(d, "--schedule 1f1b --pp 2 --microbatches 2 --tp 2 --dp 2");
  auto whole = piperun("cuda", plan, "--steps 4 --save-dir " + d + "/four");
  ASSERT_EQ(whole.code, 0) << whole.out << whole.err;
  auto got = saveThenResume("cuda", "cuda", plan, d + "/split", 2, 4);
  EXPECT_EQ(got, stepLosses(whole.out));
  auto want = checkpointLayerFiles(d + "/four", 4);
  ASSERT_EQ(want.size(), 6u); // embedding, four blocks, head
  EXPECT_TRUE(checkpointLayerFiles(d + "/split", 4) == want)
      << "the resumed run's step-4 weights and moments differ from the uninterrupted run's";
}

TEST(GpuCheckpointTest, NcclAndCudaCheckpointsResumeEachOtherBitForBit) {
  const std::string d = freshDir("nccl");
  const std::string plan = compileTinyGpt(d, "--schedule 1f1b --pp 1 --microbatches 2");
  auto whole = piperun("cuda", plan, "--steps 4 --save-dir " + d + "/four");
  ASSERT_EQ(whole.code, 0) << whole.out << whole.err;
  const auto want = checkpointLayerFiles(d + "/four", 4);
  for (auto [saver, resumer] : {std::pair{"nccl", "cuda"}, std::pair{"cuda", "nccl"}}) {
    const std::string dir = d + "/" + saver + "-" + resumer;
    auto got = saveThenResume(saver, resumer, plan, dir, 2, 4);
    EXPECT_EQ(got, stepLosses(whole.out)) << saver << " then " << resumer;
    EXPECT_TRUE(checkpointLayerFiles(dir, 4) == want) << saver << " then " << resumer;
  }
}

/// The largest difference between two checkpoints' weights, as a fraction of the largest
/// weight, over every layer; and whether their moments are as close.
double largestWeightDifference(const std::string &a, const std::string &b) {
  auto ca = pipec::openCheckpoint(a), cb = pipec::openCheckpoint(b);
  if (!ca || !cb) {
    ADD_FAILURE() << (ca ? "" : pipec::takeMessage(ca.takeError()))
                  << (cb ? "" : pipec::takeMessage(cb.takeError()));
    return INFINITY;
  }
  EXPECT_EQ(ca->manifest.step, cb->manifest.step);
  EXPECT_EQ(ca->manifest.adamSteps, cb->manifest.adamSteps);
  double worst = 0, largest = 0;
  pipec::LayerState la, lb;
  for (int l = 0; l < int(ca->manifest.layers.size()); ++l) {
    if (auto err = pipec::readCheckpointLayer(*ca, l, la))
      ADD_FAILURE() << pipec::takeMessage(std::move(err));
    if (auto err = pipec::readCheckpointLayer(*cb, l, lb))
      ADD_FAILURE() << pipec::takeMessage(std::move(err));
    EXPECT_EQ(la.weights.size(), lb.weights.size());
    for (size_t k = 0; k < la.weights.size() && k < lb.weights.size(); ++k) {
      worst = std::max(worst, double(std::fabs(la.weights[k] - lb.weights[k])));
      largest = std::max(largest, double(std::fabs(la.weights[k])));
    }
  }
  return worst / largest;
}

TEST(GpuCheckpointTest, CpuAndCudaCheckpointsResumeEachOther) {
  const std::string d = freshDir("cpu-cuda");
  const std::string plan = compileTinyGpt(d, "--schedule 1f1b --pp 2 --microbatches 2 --tp 2");
  auto whole = piperun("cpu", plan, "--steps 4 --save-dir " + d + "/four");
  ASSERT_EQ(whole.code, 0) << whole.out << whole.err;
  const auto want = stepLosses(whole.out);
  for (auto [saver, resumer] : {std::pair{"cpu", "cuda"}, std::pair{"cuda", "cpu"}}) {
    const std::string dir = d + "/" + saver + "-" + resumer;
    // The resumed run's reference starts from the checkpoint too: its gradients and weights
    // check out against it (exit 0).
    auto got = saveThenResume(saver, resumer, plan, dir, 2, 4, "--check-reference");
    ASSERT_EQ(got.size(), want.size()) << saver << " then " << resumer;
    for (auto [step, loss] : want)
      EXPECT_NEAR(std::stod(got[step]), std::stod(loss), 1e-5 * std::fabs(std::stod(loss)))
          << saver << " then " << resumer << ", step " << step;
    // The same weights as the uninterrupted cpu run's to fp32 rounding (a step moves each by
    // about lr = 1e-3: a lost or repeated step, or a layer cut wrongly, shows).
    EXPECT_LT(largestWeightDifference(d + "/four", dir), 1e-5) << saver << " then " << resumer;
  }
}

} // namespace

// --export-hf on the GPU backends: the one driver gathers the device's layers (tp parts joined)
// into the Hugging Face directory. With a token file of one sequence every step sees the same
// batch, so a run from the export of a 2-step run computes, at its step 0, the loss the
// uninterrupted run computes at step 2, bit for bit on the same arithmetic (the cuda backend
// under tp 2 x pp 2, the nccl mode in one process).
TEST(GpuCheckpointTest, AnExportFromTheGpuBackendsResumesTheirWeights) {
  const std::string d = freshDir("gpu-export");
  const std::string plan = compileTinyGpt(d, "--schedule 1f1b --pp 2 --microbatches 4 --tp 2");
  {
    std::ofstream tokens(d + "/one.bin", std::ios::binary);
    for (uint16_t t = 0; t < 17; ++t) { // seq_length 16 + 1: one window
      uint16_t id = uint16_t((t * 7 + 3) % 64);
      tokens.write(reinterpret_cast<const char *>(&id), 2);
    }
  }
  const std::string data = " --data " + d + "/one.bin";
  auto whole = piperun("cuda", plan, "--steps 3" + data);
  ASSERT_EQ(whole.code, 0) << whole.err;
  auto exported = piperun("cuda", plan, "--steps 2 --export-hf " + d + "/hf" + data);
  ASSERT_EQ(exported.code, 0) << exported.err;
  EXPECT_NE(exported.out.find("exported the weights to " + d + "/hf"), std::string::npos)
      << exported.out;
  ASSERT_TRUE(fs::exists(d + "/hf/config.json"));
  auto from = piperun("cuda", plan, "--steps 1 --init-from " + d + "/hf" + data);
  ASSERT_EQ(from.code, 0) << from.err;
  EXPECT_EQ(stepLosses(from.out).at(0), stepLosses(whole.out).at(2));
  // The nccl mode (one process: pp 1, tp 1) exports the same way.
  const std::string one = compileTinyGpt(d, "--schedule 1f1b --pp 1 --microbatches 2");
  auto wholeNccl = piperun("nccl", one, "--steps 3" + data);
  ASSERT_EQ(wholeNccl.code, 0) << wholeNccl.err;
  auto exportedNccl = piperun("nccl", one, "--steps 2 --export-hf " + d + "/hf-nccl" + data);
  ASSERT_EQ(exportedNccl.code, 0) << exportedNccl.err;
  auto fromNccl = piperun("nccl", one, "--steps 1 --init-from " + d + "/hf-nccl" + data);
  ASSERT_EQ(fromNccl.code, 0) << fromNccl.err;
  EXPECT_EQ(stepLosses(fromNccl.out).at(0), stepLosses(wholeNccl.out).at(2));
}

namespace {

TEST(GpuCheckpointTest, CudaKilledAtRandomAndRelaunchedFinishesTheJobBitForBit) {
  const std::string d = freshDir("cuda-relaunch");
  const std::string plan = compileTinyGpt(d, "--schedule 1f1b --pp 2 --microbatches 2 --tp 2");
  const int steps = 8;
  const auto started = std::chrono::steady_clock::now();
  auto whole =
      piperun("cuda", plan, "--steps " + std::to_string(steps) + " --save-dir " + d + "/whole");
  ASSERT_EQ(whole.code, 0) << whole.out << whole.err;
  // The kills fall anywhere in a launch: at random instants up to the whole job's time here.
  const int span = millisecondsSince(started);
  const std::string ck = d + "/ck";
  const std::string cmd = piperunCommand(
      "cuda", plan,
      "--steps " + std::to_string(steps) + " --save-every 1 --save-dir " + ck + " --resume " + ck);
  int killed = 0;
  auto got = relaunchUntilDone(cmd, d + "/out.txt", span, 45, killed);
  EXPECT_GT(killed, 0) << "no launch was killed";
  EXPECT_EQ(got, stepLosses(whole.out));
  auto want = checkpointLayerFiles(d + "/whole", steps);
  ASSERT_EQ(want.size(), 6u);
  EXPECT_TRUE(checkpointLayerFiles(ck, steps) == want)
      << "the relaunched job's final weights and moments differ from the uninterrupted run's";
}

/// `backend` ("cuda" or "nccl", one process) sent `sig` after its first step's line: it saves
/// the step in flight and exits 128 + `sig` with one line; relaunched to two steps past it, the
/// job's losses and weights are the uninterrupted run's bit for bit.
void expectPreemptedAndRelaunched(const std::string &backend, int sig, const char *name) {
  const std::string d = freshDir("preempt-" + backend);
  const std::string plan = compileTinyGpt(d, "--schedule 1f1b --pp 1 --microbatches 2");
  const std::string ck = d + "/ck";
  Child c =
      spawn(piperunCommand(backend, plan, "--steps 1000 --save-dir " + ck + " --resume " + ck));
  int status = 0;
  ASSERT_NO_FATAL_FAILURE(signalAfterStepZero(c, sig, status));
  EXPECT_EQ(status, 128 + sig) << c.out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(
      c.out, m,
      std::regex(std::string("piperun: ") + name + ": stopped after step ([0-9]+), saved " + ck +
                 "/step-([0-9]{8}) \\(relaunch with --resume " + ck +
                 " to continue\\); exit status " + std::to_string(128 + sig) + "\n")))
      << c.out;
  auto losses = stepLosses(c.out);
  ASSERT_FALSE(losses.empty());
  EXPECT_EQ(losses.rbegin()->first, std::stoi(m[1])) << c.out;
  const int end = std::stoi(m[2]) + 2;
  auto rest = piperun(backend, plan,
                      "--steps " + std::to_string(end) + " --save-dir " + ck + " --resume " + ck);
  ASSERT_EQ(rest.code, 0) << rest.out << rest.err;
  auto whole =
      piperun(backend, plan, "--steps " + std::to_string(end) + " --save-dir " + d + "/whole");
  ASSERT_EQ(whole.code, 0) << whole.out << whole.err;
  for (auto [step, loss] : stepLosses(rest.out))
    losses[step] = loss;
  EXPECT_EQ(losses, stepLosses(whole.out));
  EXPECT_TRUE(checkpointLayerFiles(ck, end) == checkpointLayerFiles(d + "/whole", end));
}

TEST(GpuCheckpointTest, AnNcclProcessSentSigtermSavesTheStepInFlightAndExits143) {
  expectPreemptedAndRelaunched("nccl", SIGTERM, "SIGTERM");
}

TEST(GpuCheckpointTest, TheCudaBackendSentSigusrOneSavesTheStepInFlightAndExits138) {
  expectPreemptedAndRelaunched("cuda", SIGUSR1, "SIGUSR1");
}

} // namespace
