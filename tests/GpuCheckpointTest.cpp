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
//    the resumed run passes --check-reference against a reference loaded from the checkpoint.
//
//===----------------------------------------------------------------------===//
#include "tests/Command.h"

#include "ir/Error.h"
#include "runtime/Checkpoint.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <string>

namespace {

namespace fs = std::filesystem;
using pipec::testing::CommandResult;
using pipec::testing::freshDir;
using pipec::testing::runCommand;
using pipec::testing::slurp;
using pipec::testing::stepLosses;

std::string compile(const std::string &dir, const std::string &flags) {
  std::string out = dir + "/plan.json";
  auto r = runCommand("tools/pipec compile --quiet --model examples/tiny-gpt.json " + flags +
                      " -o " + out);
  EXPECT_EQ(r.code, 0) << r.err;
  return out;
}

/// piperun_emu on `plan` with `args`; `backend` "nccl" runs one process from torchrun's
/// variables.
CommandResult piperun(const std::string &backend, const std::string &plan,
                      const std::string &args) {
  std::string env =
      backend == "nccl" ? "env -u NCCL_COMM_ID RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 " : std::string();
  std::string dtype = backend == "cpu" ? "" : " --dtype fp32";
  return runCommand(env + "tools/piperun_emu " + plan + " --backend " + backend + dtype + " " +
                    args);
}

/// Every layer file of the checkpoint of step `step` in `dir` (name -> bytes).
std::map<std::string, std::string> layerFiles(const std::string &dir, int step) {
  char name[32];
  std::snprintf(name, sizeof(name), "/step-%08d", step);
  std::map<std::string, std::string> m;
  for (auto &e : fs::directory_iterator(dir + name))
    if (e.path().filename().string().rfind("layer-", 0) == 0)
      m[e.path().filename().string()] = slurp(e.path().string());
  return m;
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
  const std::string plan = compile(d, "--schedule 1f1b --pp 2 --microbatches 2 --tp 2 --dp 2");
  auto whole = piperun("cuda", plan, "--steps 4 --save-dir " + d + "/four");
  ASSERT_EQ(whole.code, 0) << whole.out << whole.err;
  auto got = saveThenResume("cuda", "cuda", plan, d + "/split", 2, 4);
  EXPECT_EQ(got, stepLosses(whole.out));
  auto want = layerFiles(d + "/four", 4);
  ASSERT_EQ(want.size(), 6u); // embedding, four blocks, head
  EXPECT_TRUE(layerFiles(d + "/split", 4) == want)
      << "the resumed run's step-4 weights and moments differ from the uninterrupted run's";
}

TEST(GpuCheckpointTest, NcclAndCudaCheckpointsResumeEachOtherBitForBit) {
  const std::string d = freshDir("nccl");
  const std::string plan = compile(d, "--schedule 1f1b --pp 1 --microbatches 2");
  auto whole = piperun("cuda", plan, "--steps 4 --save-dir " + d + "/four");
  ASSERT_EQ(whole.code, 0) << whole.out << whole.err;
  const auto want = layerFiles(d + "/four", 4);
  for (auto [saver, resumer] : {std::pair{"nccl", "cuda"}, std::pair{"cuda", "nccl"}}) {
    const std::string dir = d + "/" + saver + "-" + resumer;
    auto got = saveThenResume(saver, resumer, plan, dir, 2, 4);
    EXPECT_EQ(got, stepLosses(whole.out)) << saver << " then " << resumer;
    EXPECT_TRUE(layerFiles(dir, 4) == want) << saver << " then " << resumer;
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
  const std::string plan = compile(d, "--schedule 1f1b --pp 2 --microbatches 2 --tp 2");
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
