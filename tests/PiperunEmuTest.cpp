//===- PiperunEmuTest.cpp - piperun --backend cuda|nccl end to end, emulated -===//
//
// Runs in CI: tools/piperun_emu is piperun built on the emulated device and NCCL
// (kernels/cuda/emu/README.md), so the GPU backends' command line (flags, the printed steps,
// the activation arena line, --check-reference's report and exit code, the launcher variables
// of the nccl mode) is checked end to end without a GPU.
//
//===----------------------------------------------------------------------===//
#include "ir/formats/Costs.h"
#include "ir/support/Error.h"
#include "tests/Command.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <regex>
#include <string>

namespace {

using pipec::testing::expectHas;
using pipec::testing::tmpDir;
using Result = pipec::testing::CommandResult;

Result run(const std::string &cmd) { return pipec::testing::runCommand(cmd); }

std::string plan(const std::string &name, const std::string &flags,
                 const std::string &model = "examples/tiny-gpt.json") {
  std::string path = tmpDir() + "/" + name + ".json";
  Result r = run("tools/pipec compile --model " + model + " " + flags + " -o " + path + " --quiet");
  EXPECT_EQ(r.code, 0) << r.err;
  return path;
}

/// A usage error as piperun must give it: exit 2, one line on stderr that holds `part`, and no
/// step run.
void expectUsageError(const Result &r, const std::string &part) {
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  expectHas(r.err, part);
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_EQ(r.out.find("step 0 loss"), std::string::npos) << r.out;
}

/// examples/tiny-gpt.json with "dtype": `dtype` (it says "fp32"), compiled as 1f1b pp = 2.
std::string tinyPlanInDtype(const std::string &dtype) {
  std::string spec = pipec::testing::slurp("examples/tiny-gpt.json");
  size_t at = spec.find("\"fp32\"");
  EXPECT_NE(at, std::string::npos) << spec;
  std::string model = tmpDir() + "/tiny-" + dtype + ".json";
  std::ofstream(model) << spec.replace(at, 6, "\"" + dtype + "\"");
  return plan(dtype + "-model", "--schedule 1f1b --pp 2 --microbatches 4", model);
}

TEST(PiperunEmuTest, CudaBackendRunsStepsReportsArenasAndPassesTheReferenceCheck) {
  std::string p = plan("cuda", "--schedule 1f1b --pp 4 --microbatches 8");
  Result r = run("tools/piperun_emu " + p + " --backend cuda --steps 3 --check-reference");
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  for (const char *line :
       {"step 0 loss ", "step 2 loss ",
        "weights, gradients and optimizer state MiB (every rank, in RANK order): ",
        "activation arena MiB (every rank, in RANK order; sized before step 0): ",
        "reference loss (last step) ", "max_abs_grad_diff=", "largest difference: step ",
        "max_tensor_grad_diff=", "max_weight_diff="})
    expectHas(r.out, line);
  EXPECT_LT(r.out.find("activation arena MiB"), r.out.find("step 0 loss"))
      << "the arenas are known, and printed, before step 0:\n"
      << r.out;
  EXPECT_EQ(r.out.find("step 3 loss"), std::string::npos) << "three steps, no more";
}

TEST(PiperunEmuTest, Bf16ComputePassesTheReferenceCheckWithinItsTolerance) {
  std::string p = plan("bf16", "--schedule 1f1b --pp 4 --microbatches 8");
  Result r =
      run("tools/piperun_emu " + p + " --backend cuda --dtype bf16 --steps 3 --check-reference");
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  expectHas(r.out, "max_abs_grad_diff=");
}

TEST(PiperunEmuTest, TheModelsDtypeIsTheDefaultComputeType) {
  // A model that says bf16 runs in bf16 without --dtype, and says so: its gradients are more
  // than 100 times further from the fp32 reference than those of the same plan with --dtype
  // fp32.
  std::string path = tinyPlanInDtype("bf16");
  Result fp32 = run("tools/piperun_emu " + path + " --backend cuda --dtype fp32 --check-reference");
  EXPECT_EQ(fp32.code, 0) << fp32.out << fp32.err;
  Result byModel = run("tools/piperun_emu " + path + " --backend cuda --check-reference");
  EXPECT_EQ(byModel.code, 0) << byModel.out << byModel.err;
  expectHas(byModel.out, "compute type bf16 (the model's \"dtype\"; --dtype fp32 to "
                         "override)");
  auto diff = [](const std::string &out) {
    size_t at = out.find("max_abs_grad_diff=");
    return at == std::string::npos ? -1.0 : std::stod(out.substr(at + 18));
  };
  ASSERT_GE(diff(fp32.out), 0) << fp32.out;
  ASSERT_GE(diff(byModel.out), 0) << byModel.out;
  EXPECT_GT(diff(byModel.out), 100 * diff(fp32.out)) << fp32.out << byModel.out;
  // A model in fp16, which no backend computes in: exit 2 naming the way out.
  std::string fp16Plan = tinyPlanInDtype("fp16");
  Result fp16 = run("tools/piperun_emu " + fp16Plan + " --backend cuda");
  EXPECT_EQ(fp16.code, 2) << fp16.out << fp16.err;
  expectHas(fp16.err, "\"dtype\": \"fp16\", which --backend cuda does not compute in; "
                      "pass --dtype bf16");
}

TEST(PiperunEmuTest, GpuBackendsRefuseARecomputingPlanWithOneLine) {
  // pipec models recomputation; piperun's kernels do not execute it, on any backend.
  const std::string p = tmpDir() + "/recompute.json";
  Result c = run("tools/pipec compile --model examples/tiny-gpt.json --schedule 1f1b --pp 2 "
                 "--microbatches 4 --recompute selective -o " +
                 p + " --quiet");
  ASSERT_EQ(c.code, 0) << c.out << c.err;
  for (const char *backend : {"cuda", "nccl"}) {
    Result r = run(std::string("RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 tools/piperun_emu ") + p +
                   " --backend " + backend + " --steps 1");
    expectUsageError(r, "$.transformer.recompute: \"selective\"");
  }
}

TEST(PiperunEmuTest, CudaBackendTrainsALlamaBlockAndPassesTheReferenceCheck) {
  // The stage is one definition (kernels/StageProgram.h): Llama's block runs on the device.
  const std::string p = plan("tiny-llama", "--schedule zb-h1 --pp 2 --microbatches 4 --tp 2",
                             "examples/tiny-llama.json");
  Result r = run("tools/piperun_emu " + p + " --backend cuda --steps 2 --check-reference");
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  for (const char *line : {"step 0 loss ", "step 1 loss ", "max_abs_grad_diff=", "tp_copies="})
    expectHas(r.out, line);
}

TEST(PiperunEmuTest, GpuBackendsRefuseALayernormWithoutItsShiftWithOneLine) {
  // The CUDA layernorm kernel has GPT-2's shift and epsilon; RMSNorm runs, so does the cpu.
  std::string spec = pipec::testing::slurp("examples/tiny-gpt.json");
  const size_t at = spec.find("\"dtype\": \"fp32\"");
  ASSERT_NE(at, std::string::npos) << spec;
  const std::string model = tmpDir() + "/tiny-nobias.json";
  std::ofstream(model) << spec.insert(at, "\"bias\": false, ");
  const std::string p = plan("nobias", "--schedule 1f1b --pp 2 --microbatches 4", model);
  for (const char *backend : {"cuda", "nccl"}) {
    Result r = run(std::string("RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 tools/piperun_emu ") + p +
                   " --backend " + backend + " --steps 1");
    expectUsageError(r, std::string("--backend ") + backend +
                            ": the plan's model has a LayerNorm without a shift (\"bias\": "
                            "false)");
    expectUsageError(r, "use \"norm\": \"rmsnorm\", or train it with --backend cpu");
  }
}

TEST(PiperunEmuTest, AnUnsupportedDtypeIsAUsageError) {
  std::string p = plan("dtype", "--schedule 1f1b --pp 2 --microbatches 4");
  Result r = run("tools/piperun_emu " + p + " --backend cuda --dtype fp16");
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  expectHas(r.err, "--dtype: expected fp32 or bf16 (got 'fp16'); try --dtype bf16");
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}

TEST(PiperunEmuTest, APlanTooLargeForTheDeviceIsOneLineAndExitTwoBeforeStepZero) {
  // GPipe's rank 0 keeps 130 microbatches of two blocks' 268 MB fc inputs: twice the emulated
  // device's 16 GiB (kernels/cuda/emu/FakeCudaRuntime.cpp).
  std::string model = tmpDir() + "/wide-ffn.json";
  std::ofstream(model) << R"({"format": "pipemodel/1", "name": "wide-ffn", "transformer": {
      "num_layers": 4, "hidden_size": 32, "num_attention_heads": 2, "ffn_hidden_size": 4096,
      "vocab_size": 32, "seq_length": 1024, "microbatch_size": 8, "dtype": "fp32"}})";
  std::string p = plan("wide-ffn-plan", "--schedule gpipe --pp 2 --microbatches 130", model);
  Result r = run("tools/piperun_emu " + p + " --backend cuda --steps 1");
  expectUsageError(r, "piperun: error: --backend cuda: the plan's 2 ranks need ");
}

TEST(PiperunEmuTest, AGpuOthersHaveNearlyFilledIsOneLineAndExitTwoNamingTheFix) {
  // An emulated device of 80 MiB, as a GPU would be with another job on it. Each rank sets up
  // cuBLASLt with its 32 MiB workspace before anything of the plan: with --backend cuda two of
  // four ranks fit and the third says why; in the nccl mode one process of a 16 MiB device.
  std::string p = plan("full-gpu", "--schedule 1f1b --pp 4 --microbatches 4");
  Result r = run("PIPEC_EMU_DEVICE_MIB=80 tools/piperun_emu " + p + " --backend cuda --steps 1");
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  for (const char *part :
       {"piperun: error: rank 2 (pp 2, dp 0, tp 0): cannot set up on GPU 0: a CUDA stream, "
        "cuBLASLt and its 32 MiB workspace do not fit in the 16.0 MiB free of its 80.0 MiB (",
        "out of memory",
        "); free the GPU's memory (nvidia-smi lists the processes using it) or "
        "run on another GPU\n"})
    expectHas(r.err, part);
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_EQ(r.out.find("step 0 loss"), std::string::npos) << r.out;

  std::string one = plan("full-gpu-nccl", "--schedule 1f1b --pp 1 --microbatches 4");
  r = run("env -u NCCL_COMM_ID PIPEC_EMU_DEVICE_MIB=16 RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 "
          "tools/piperun_emu " +
          one + " --backend nccl --steps 1");
  expectUsageError(r, "piperun: error: rank 0 (pp 0, dp 0, tp 0): cannot set up on GPU 0: a "
                      "CUDA stream, cuBLASLt and its 32 MiB workspace do not fit in the 16.0 MiB "
                      "free of its 16.0 MiB (");
}

TEST(PiperunEmuTest, CudaBackendRefusesAnAllReduceLargerThanItsSumUpFront) {
  // The local transport sums at most 32 buffers in one kernel: dp 33 is a usage error before
  // any rank is set up, not a failure in step 0.
  std::string p = plan("dp33", "--schedule 1f1b --pp 1 --dp 33 --microbatches 2");
  Result r = run("tools/piperun_emu " + p + " --backend cuda --steps 1");
  expectUsageError(r, "--backend cuda: the plan's dp all-reduces have 33 members, and the cuda "
                      "backend (every rank on one GPU) sums at most 32; use --backend nccl");
  EXPECT_EQ(r.out.find("arena"), std::string::npos) << r.out;
}

TEST(PiperunEmuTest, CudaBackendAKernelThatNeverFinishesEndsTheProcessWithOneLine) {
  // The host queues a whole step and then waits for the GPU; a kernel that never finishes
  // (the emulated AdamW here, on asynchronous streams) held that wait forever. Now --timeout
  // seconds in which no rank's compute op finishes end the process with status 1 and one line.
  std::string p = plan("hang", "--schedule 1f1b --pp 2 --microbatches 2");
  Result r = run("env PIPEC_EMU_ASYNC=1 PIPEC_EMU_HANG_OP=adam tools/piperun_emu " + p +
                 " --backend cuda --steps 1 --timeout 0.3");
  EXPECT_EQ(r.code, 1) << r.out << r.err;
  expectHas(r.err, "watchdog: the wait for step 0's GPU work (every rank's) blocked for 0.3 s "
                   "(no rank's compute op finished on the GPU in that time: a kernel that "
                   "never finishes?); exiting\n");
  EXPECT_EQ(r.out.find("step 0 loss"), std::string::npos) << r.out;
}

TEST(PiperunEmuTest, ALongStepThatKeepsProgressingIsNoStallInEitherGpuMode) {
  // Every piece of emulated GPU work 2 ms longer: a step takes seconds on the device, far past
  // --timeout 1.5, while each compute op ends within it. The end-of-step watchdogs count the
  // compute ops that finish (CudaRankBackend::completedWork), so neither fires.
  struct Case {
    const char *name, *flags, *launch;
  } cases[] = {{"cuda", "--schedule 1f1b --pp 2 --microbatches 6", "--backend cuda"},
               {"nccl", "--schedule 1f1b --pp 1 --microbatches 4", "--backend nccl"}};
  for (const Case &c : cases) {
    std::string p = plan(std::string("slow-") + c.name, c.flags);
    Result r = run("env -u NCCL_COMM_ID PIPEC_EMU_ASYNC=1 PIPEC_EMU_OP_DELAY_MS=2 RANK=0 "
                   "WORLD_SIZE=1 LOCAL_RANK=0 tools/piperun_emu " +
                   p + " " + c.launch + " --steps 1 --timeout 1.5");
    EXPECT_EQ(r.code, 0) << c.name << "\n" << r.out << r.err;
    EXPECT_NE(r.out.find("step 0 loss "), std::string::npos) << c.name << "\n" << r.out;
    EXPECT_EQ(r.err.find("watchdog"), std::string::npos) << c.name << "\n" << r.err;
    // The device was busy for far longer than the timeout (else this proves nothing), counted,
    // not timed: the emulated device says how many pieces of work its busiest stream ran one
    // after another, each 2 ms longer; more than 1500 of them are over 3 s, twice the timeout.
    std::smatch m;
    ASSERT_TRUE(std::regex_search(r.err, m,
                                  std::regex("emulated device: the busiest stream ran ([0-9]+) "
                                             "pieces of work, each PIPEC_EMU_OP_DELAY_MS=2 ms")))
        << c.name << "\n"
        << r.err;
    EXPECT_GT(std::stoul(m[1]), 1500u) << c.name;
  }
}

TEST(PiperunEmuTest, NcclBackendOneProcessFromLauncherVariables) {
  std::string p = plan("nccl", "--schedule 1f1b --pp 1 --microbatches 4");
  Result r = run("env -u NCCL_COMM_ID -u NCCL_RUNTIME_CONNECT -u CUDA_MODULE_LOADING RANK=0 "
                 "WORLD_SIZE=1 LOCAL_RANK=0 tools/piperun_emu " +
                 p + " --backend nccl --steps 2 --check-reference");
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  for (const char *line : {"step 0 loss ", "step 1 loss ",
                           "weights, gradients and optimizer state MiB (this process's rank 0): ",
                           "activation arena MiB (this process's rank 0", "max_abs_grad_diff="})
    expectHas(r.out, line);
  EXPECT_LT(r.out.find("activation arena MiB"), r.out.find("step 0 loss")) << r.out;
  expectHas(r.out, "launch: 1 process, placed by torchrun (RANK 0 has RANK=0 "
                   "WORLD_SIZE=1 LOCAL_RANK=0)");
  // NCCL's version, first (tools/gpu_check.sh reports it), its connections made eagerly, and
  // every kernel loaded before step 0 (a lazy first launch could wait for a peer's NCCL kernel).
  EXPECT_EQ(r.out.rfind("NCCL version ", 0), 0u) << r.out;
  expectHas(r.out, "NCCL_RUNTIME_CONNECT=0 (connections made as the communicators are "
                   "created); CUDA_MODULE_LOADING=EAGER (every kernel loaded before the "
                   "first step)\n");
}

TEST(PiperunEmuTest, NcclBackendRunsFromSrunsOwnVariables) {
  // A task srun started, without a wrapper mapping its variables to RANK and the others.
  std::string p = plan("nccl-srun", "--schedule 1f1b --pp 1 --microbatches 4");
  Result r = run("env -u NCCL_COMM_ID -u RANK SLURM_STEP_ID=0 SLURM_PROCID=0 "
                 "SLURM_STEP_NUM_TASKS=1 SLURM_NTASKS=4 SLURM_LOCALID=0 tools/piperun_emu " +
                 p + " --backend nccl --steps 1");
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  expectHas(r.out, "launch: 1 process, placed by srun (RANK 0 has SLURM_PROCID=0 "
                   "SLURM_STEP_NUM_TASKS=1 SLURM_LOCALID=0)");
  expectHas(r.out, "step 0 loss ");
  // The allocation's own shell (no step) is refused at once, saying to use srun.
  r = run("env -u NCCL_COMM_ID -u RANK -u SLURM_STEP_ID SLURM_PROCID=0 SLURM_NTASKS=4 "
          "SLURM_LOCALID=0 tools/piperun_emu " +
          p + " --backend nccl --steps 1");
  expectUsageError(r, "SLURM_PROCID is set but SLURM_STEP_ID is not");
}

TEST(PiperunEmuTest, NcclBackendKeepsTheUsersSettingsAndSaysWhatTheyMean) {
  std::string p = plan("nccl-connect", "--schedule 1f1b --pp 1 --microbatches 4");
  Result r = run("env -u NCCL_COMM_ID NCCL_RUNTIME_CONNECT=1 CUDA_MODULE_LOADING=LAZY RANK=0 "
                 "WORLD_SIZE=1 LOCAL_RANK=0 tools/piperun_emu " +
                 p + " --backend nccl --steps 1");
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  expectHas(r.out, "NCCL_RUNTIME_CONNECT=1 (from the environment: NCCL may connect inside "
                   "step 0, after the arena was sized); CUDA_MODULE_LOADING=LAZY (from the "
                   "environment: a kernel's first launch in step 0 may wait for NCCL kernels "
                   "that wait for a peer stuck the same way)");
}

TEST(PiperunEmuTest, NcclBackendNamesAMissingLauncherVariable) {
  std::string p = plan("nccl2", "--schedule 1f1b --pp 2 --microbatches 4");
  Result r =
      run("env -u RANK RANK= WORLD_SIZE=2 LOCAL_RANK=0 tools/piperun_emu " + p + " --backend nccl");
  expectUsageError(r, "RANK");
}

// The kernels' configuration comes from the environment, which piperun alone reads
// (tools/KernelEnv.h): PIPEC_ATTENTION_WGMMA=0 runs (the mma.sync attention forward on a Hopper
// GPU) and passes the reference check; a value other than 0 or 1, or a switch of the Hopper
// backward that left the tools, is exit 2 naming the variable, before any step, in both GPU
// modes.
TEST(PiperunEmuTest, KernelVariablesAreCheckedBeforeAnyStep) {
  std::string p = plan("kernels", "--schedule 1f1b --pp 2 --microbatches 4");
  Result off = run("PIPEC_ATTENTION_WGMMA=0 tools/piperun_emu " + p +
                   " --backend cuda --dtype bf16 --steps 2 --check-reference");
  EXPECT_EQ(off.code, 0) << off.out << off.err;
  expectHas(off.out, "max_abs_grad_diff=");
  expectUsageError(run("PIPEC_ATTENTION_WGMMA=no tools/piperun_emu " + p + " --backend cuda"),
                   "PIPEC_ATTENTION_WGMMA=no: expected 0");
  expectUsageError(
      run("PIPEC_ATTENTION_WGMMA_BACKWARD=1 tools/piperun_emu " + p + " --backend cuda"),
      "PIPEC_ATTENTION_WGMMA_BACKWARD=1: the Hopper attention backward");
  expectUsageError(run("PIPEC_ATTENTION_DQ_ATOMICS=fixed RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 "
                       "tools/piperun_emu " +
                       plan("kernels1", "--schedule 1f1b --pp 1 --microbatches 2") +
                       " --backend nccl"),
                   "unset PIPEC_ATTENTION_DQ_ATOMICS");
}

} // namespace

namespace {

/// --profile on the GPU backends (the emulated device runs each rank's stream, which the
/// interpreter synchronises per timed instruction): a pipecost/1 file of the run's backend,
/// every op of the plan measured once per microbatch and step after the warm-up.
TEST(PiperunEmuTest, ProfileWritesMeasuredCostsOnEveryGpuBackend) {
  struct Case {
    const char *backend, *flags, *env;
    size_t ops; // (stage, op kind) pairs the plan runs
  } cases[] = {{"cuda", "--schedule zb-h1 --pp 2 --microbatches 4", "", 6},
               {"nccl", "--schedule 1f1b --pp 1 --microbatches 4",
                "env -u NCCL_COMM_ID RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 ", 2}};
  for (const Case &c : cases) {
    SCOPED_TRACE(c.backend);
    const std::string p = plan(std::string("profile-") + c.backend, c.flags);
    const std::string out = tmpDir() + "/costs-" + c.backend + ".json";
    Result r = run(std::string(c.env) + "tools/piperun_emu " + p + " --backend " + c.backend +
                   " --steps 3 --profile " + out);
    ASSERT_EQ(r.code, 0) << r.out << r.err;
    expectHas(r.out, "step time: measured median ");
    auto costs = pipec::readCosts(out);
    ASSERT_TRUE(bool(costs)) << pipec::takeMessage(costs.takeError());
    EXPECT_EQ(costs->backend, c.backend);
    EXPECT_EQ(costs->dtype, "fp32");
    EXPECT_EQ(costs->steps, 3);
    EXPECT_EQ(costs->ops.size(), c.ops);
    for (const pipec::MeasuredCosts::Op &op : costs->ops) {
      EXPECT_EQ(op.time.samples, 2 * 4) << "2 steps after the warm-up, 4 microbatches";
      EXPECT_GT(op.time.medianMs, 0);
    }
    for (const pipec::MeasuredCosts::Rank &rank : costs->ranks)
      EXPECT_GT(rank.peakMemoryBytes, 0);
  }
}

} // namespace
